// cuda_support.cpp - see cuda_support.hpp. The completion words are one block of mapped
// pinned memory (cudaHostAllocMapped | Portable: every device sees it at one address); a
// stream waits on a word with the driver's cuStreamWaitValue64, found through the runtime at
// first use, so the extension needs no link against libcuda.
#include "cuda_support.hpp"

#include <atomic>
#include <cstring>
#include <mutex>

#include <c10/util/Exception.h>

#ifdef CHORUS_WITH_CUDA
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
void destroyEvent(void*) {}
bool allocSlot(DoneSlot*) { return false; }
void completeSlot(DoneSlot*) {}
bool streamWait(int, const DoneSlot&) { return false; }
void copyBack(int, std::vector<std::pair<at::Tensor, at::Tensor>>& pairs) {
  for (auto& p : pairs) p.first.copy_(p.second);
}

#else

namespace {

void check(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "chorus: ", what, " failed: ", cudaGetErrorName(e), " (",
              cudaGetErrorString(e), ")");
}

// CUresult cuStreamWaitValue64(CUstream, CUdeviceptr, cuuint64_t, unsigned int)
using WaitValue64 = int (*)(cudaStream_t, unsigned long long, unsigned long long, unsigned);
constexpr unsigned kWaitGeq = 0;  // CU_STREAM_WAIT_VALUE_GEQ
constexpr int kSlots = 4096;
// Device works a caller may have in flight behind stream waits before wait() waits on the
// host instead. Unbounded, a caller that never blocks fills its stream's command queue, and
// the driver then blocks the caller's thread inside a CUDA call until the GPU drains it.
constexpr int kMaxAhead = 128;

struct Slots {
  std::mutex mu;  // free_list, next_token, init
  bool tried = false;
  std::atomic<bool> usable{false};
  std::atomic<int> in_use{0};
  volatile uint64_t* words = nullptr;  // host view
  unsigned long long dev_base = 0;     // device view of words[0]
  WaitValue64 wait = nullptr;
  std::vector<int> free_list;
  uint64_t next_token = 1;

  // Under mu.
  void init() {
    tried = true;
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &fn, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess || !fn) {
      cudaGetLastError();
      return;
    }
    void* host = nullptr;
    if (cudaHostAlloc(&host, kSlots * sizeof(uint64_t),
                      cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    void* dev = nullptr;
    if (cudaHostGetDevicePointer(&dev, host, 0) != cudaSuccess) {
      cudaGetLastError();
      cudaFreeHost(host);
      return;
    }
    std::memset(host, 0, kSlots * sizeof(uint64_t));
    words = static_cast<volatile uint64_t*>(host);
    dev_base = reinterpret_cast<unsigned long long>(dev);
    wait = reinterpret_cast<WaitValue64>(fn);
    for (int i = kSlots - 1; i >= 0; --i) free_list.push_back(i);
    usable = true;
  }
};

// Never freed: streams may wait on the words until the process ends.
Slots& slots() {
  static Slots* s = new Slots();
  return *s;
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

void destroyEvent(void* event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

bool allocSlot(DoneSlot* slot) {
  Slots& s = slots();
  std::lock_guard<std::mutex> lk(s.mu);
  if (!s.tried) s.init();
  if (!s.usable.load() || s.free_list.empty()) return false;
  __atomic_store_n(&slot->index, s.free_list.back(), __ATOMIC_RELEASE);
  s.free_list.pop_back();
  slot->token = s.next_token++;
  s.in_use.fetch_add(1);
  return true;
}

void completeSlot(DoneSlot* slot) {
  const int index = __atomic_load_n(&slot->index, __ATOMIC_ACQUIRE);
  if (index < 0) return;
  Slots& s = slots();
  std::lock_guard<std::mutex> lk(s.mu);
  __atomic_store_n(const_cast<uint64_t*>(&s.words[index]), slot->token, __ATOMIC_RELEASE);
  s.free_list.push_back(index);
  __atomic_store_n(&slot->index, -1, __ATOMIC_RELEASE);
  s.in_use.fetch_sub(1);
}

bool streamWait(int device, const DoneSlot& slot) {
  if (slot.token == 0) return false;  // no word was free for this work
  Slots& s = slots();
  // No lock: the driver call below may block (a full command queue) until the GPU moves on,
  // which may need completeSlot. Racing with completeSlot is harmless: once the word was
  // handed back, it only ever holds this token or later (larger) ones, so the condition
  // (word >= token) holds for good.
  const int index = __atomic_load_n(&slot.index, __ATOMIC_ACQUIRE);
  if (index < 0) return true;  // already complete: nothing to wait for
  if (!s.usable.load() || s.in_use.load() > kMaxAhead) return false;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const unsigned long long addr = s.dev_base + static_cast<unsigned long long>(index) * 8;
  if (s.wait(stream, addr, slot.token, kWaitGeq) != 0) {
    s.usable = false;  // e.g. stream memory operations disabled by the driver: wait on host
    return false;
  }
  return true;
}

void copyBack(int device, std::vector<std::pair<at::Tensor, at::Tensor>>& pairs) {
  if (pairs.empty()) return;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  auto stream = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device));
  {
    c10::cuda::CUDAStreamGuard sg(stream);
    for (auto& p : pairs) p.first.copy_(p.second, /*non_blocking=*/true);
  }
  stream.synchronize();
}

#endif

}  // namespace cuda
}  // namespace chorus_torch
