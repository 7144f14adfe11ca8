// cuda_support.hpp - the binding's CUDA pieces, behind plain types so that the rest of the
// binding compiles the same with and without CUDA (cuda_support.cpp has both versions):
// the caller's stream captured in an event, host-free stream waits on a work's completion,
// and the copy-back of staged outputs on a stream of our own.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace chorus_torch {
namespace cuda {

// Records an event on the current stream of `device` (after whatever the caller queued so
// far); the core's operations wait for it. Returns the cudaEvent_t.
void* recordCurrentStream(int device);
void destroyEvent(void* event);

// A completion word in pinned, device-visible host memory. Tokens only grow, so a word may
// be handed to the next work as soon as its token is written: a stream still waiting on the
// old token has its condition (word >= token) met for good.
struct DoneSlot {
  int index = -1;
  uint64_t token = 0;
};
// false when no word is free or stream waits on host memory are unavailable here.
bool allocSlot(DoneSlot* slot);
// Publishes the token (the work is complete) and hands the word back.
void completeSlot(DoneSlot* slot);
// Makes the current stream of `device` wait until the slot is completed, without blocking
// the host; true at once if the slot is already complete. false if it could not (the caller
// then waits on the host).
bool streamWait(int device, const DoneSlot& slot);

// dst.copy_(src) for each pair, on a stream of our own, waited for before returning.
void copyBack(int device, std::vector<std::pair<at::Tensor, at::Tensor>>& pairs);

}  // namespace cuda
}  // namespace chorus_torch
