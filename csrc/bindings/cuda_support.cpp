// cuda_support.cpp - see cuda_support.hpp. The completion stream is one non-blocking stream
// per device, made at first use and never destroyed (events recorded on it may be waited on
// until the process ends).
#include "cuda_support.hpp"

#include <array>
#include <mutex>

#include <c10/util/Exception.h>

#ifdef CHORUS_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace chorus_torch {
namespace cuda {

#ifndef CHORUS_WITH_CUDA

void* recordCurrentStream(int) {
  TORCH_CHECK(false, "chorus: this build of chorus has no CUDA support");
}
void* recordCurrentStreamIfBusy(int) {
  TORCH_CHECK(false, "chorus: this build of chorus has no CUDA support");
}
void* createEvent(int) { TORCH_CHECK(false, "chorus: this build of chorus has no CUDA support"); }
void destroyEvent(void*) {}
bool eventDone(void*) { return true; }
void streamWaitEvent(int, void*) {}
bool finishAfter(int, void*, std::vector<std::pair<at::Tensor, at::Tensor>>& pairs,
                 std::initializer_list<const std::vector<at::Tensor>*>) {
  for (auto& p : pairs) p.first.copy_(p.second);
  return false;
}
void onCompletionStream(int, const std::function<void()>& body) { body(); }

#else

namespace {

void check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "chorus: ", what, " failed: ", cudaGetErrorName(e), " (",
              cudaGetErrorString(e), ")");
}

constexpr int kMaxDevices = 64;

c10::cuda::CUDAStream completionStream(int device) {
  static std::mutex mu;
  static std::array<cudaStream_t, kMaxDevices> streams{};
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "chorus: CUDA device ", device,
              " out of range");
  std::lock_guard<std::mutex> lk(mu);
  if (!streams[device]) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    streams[device] = s;
  }
  return c10::cuda::getStreamFromExternal(streams[device],
                                          static_cast<c10::DeviceIndex>(device));
}

void protect(const at::Tensor& t, const c10::cuda::CUDAStream& s) {
  if (t.defined() && t.is_cuda() && t.has_storage())
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), s);
}

}  // namespace

void* recordCurrentStream(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  cudaError_t e = cudaEventRecord(ev, c10::cuda::getCurrentCUDAStream(device).stream());
  if (e != cudaSuccess) {
    cudaEventDestroy(ev);
    check(e, "cudaEventRecord on the current stream");
  }
  return ev;
}

void* recordCurrentStreamIfBusy(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaError_t e = cudaStreamQuery(c10::cuda::getCurrentCUDAStream(device).stream());
  if (e == cudaSuccess) return nullptr;
  if (e != cudaErrorNotReady) cudaGetLastError();  // recordCurrentStream reports it
  return recordCurrentStream(device);
}

void* createEvent(int device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  return ev;
}

void destroyEvent(void* event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

bool eventDone(void* event) {
  if (!event) return true;
  cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (e == cudaErrorNotReady) return false;
  if (e != cudaSuccess) cudaGetLastError();
  return true;
}

void streamWaitEvent(int device, void* event) {
  if (!event) return;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  check(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device).stream(),
                            static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent on the work's end event");
}

bool finishAfter(int device, void* event, std::vector<std::pair<at::Tensor, at::Tensor>>& pairs,
                 std::initializer_list<const std::vector<at::Tensor>*> keep) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  auto s = completionStream(device);
  const bool pending = !eventDone(event);
  if (pending) check(cudaStreamWaitEvent(s.stream(), static_cast<cudaEvent_t>(event), 0),
                     "cudaStreamWaitEvent on the work's end event");
  {
    c10::cuda::CUDAStreamGuard sg(s);
    for (auto& p : pairs) p.first.copy_(p.second, /*non_blocking=*/true);
  }
  if (!pending) {
    if (!pairs.empty()) s.synchronize();
    return false;
  }
  for (const auto* list : keep)
    for (auto& t : *list) protect(t, s);
  for (auto& p : pairs) {
    protect(p.first, s);
    protect(p.second, s);
  }
  check(cudaEventRecord(static_cast<cudaEvent_t>(event), s.stream()),
        "cudaEventRecord of the work's end event");
  return true;
}

void onCompletionStream(int device, const std::function<void()>& body) {
  c10::cuda::CUDAStreamGuard sg(completionStream(device));
  body();
}

#endif

}  // namespace cuda
}  // namespace chorus_torch
