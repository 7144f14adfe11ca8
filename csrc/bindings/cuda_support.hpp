// cuda_support.hpp - the binding's CUDA pieces, behind plain types so that the rest of the
// binding compiles the same with and without CUDA (cuda_support.cpp has both versions):
// the caller's stream captured in an event, the work's end event, and what must follow a
// work's device work (copy-back of staged outputs, the caching allocator's view of its
// tensors, its future) on a stream of our own.
#pragma once

#include <functional>
#include <initializer_list>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace chorus_torch {
namespace cuda {

// Records an event on the current stream of `device` (after whatever the caller queued so
// far); the core's operations wait for it. Returns the cudaEvent_t.
void* recordCurrentStream(int device);
// recordCurrentStream, or nullptr when the current stream has completed all its work.
void* recordCurrentStreamIfBusy(int device);
// A new event (no timing) for the core to record when a work's device part outlives it.
void* createEvent(int device);
void destroyEvent(void* event);
// Has the event completed? An event never recorded has. Errors count as completed (the
// work reports them).
bool eventDone(void* event);
// The current stream of `device` waits for `event`; the host does not.
void streamWaitEvent(int device, void* event);

// After a work's requests completed, while its device work (up to `event`) may still run:
// on the completion stream of `device` (which waits for `event` first) the staged outputs
// are copied back (dst.copy_(src) for each pair), every tensor of the lists in `keep` and of the pairs is
// marked as used by that stream (the caching allocator reuses its memory only after the
// stream's work), and `event` is recorded again after all of it. Where `event` has already
// completed, the copies are made at once and waited for. Returns whether it queued.
bool finishAfter(int device, void* event, std::vector<std::pair<at::Tensor, at::Tensor>>& pairs,
                 std::initializer_list<const std::vector<at::Tensor>*> keep);
// Runs body with the completion stream of `device` current, so that what body records (a
// future's events) follows everything finishAfter queued.
void onCompletionStream(int device, const std::function<void()>& body);

}  // namespace cuda
}  // namespace chorus_torch
