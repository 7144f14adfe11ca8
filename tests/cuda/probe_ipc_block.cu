// probe_ipc_block.cu - which CUDA calls hold the calling thread while the GPU is busy?
// A host-free collective must not make, on the caller's thread, a call that waits behind the
// caller's running kernels; Chorus's shared-GPU path exports and maps user buffers through
// CUDA IPC, and its first collective sets up streams and IPC events.
//
// Two processes (fork, before any CUDA call) on device 0. Process 0 allocates, then launches
// a kernel that spins for SPIN_MS; while it runs, it times each call below (ms). Process 1
// does the same with its own spinning kernel and maps process 0's buffers (handles passed
// through shared memory) while both kernels run. Each line: "who call ms". Also: does a
// kernel's first launch (CUDA's lazy loading) wait for the running kernel, and does loading
// it beforehand with cudaFuncGetAttributes (while the GPU is busy too) avoid that?
// usage: probe_ipc_block [spin_ms=200]
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct shared {
  volatile int step;
  cudaIpcMemHandle_t old_h, new_h;
  cudaIpcEventHandle_t ev_h;
};

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

__global__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

__global__ void k_a(int *p) {
  if (p) *p = 1;
}
__global__ void k_b(int *p) {
  if (p) *p = 2;
}

static cudaError_t launch_b(cudaStream_t s) {
  k_b<<<1, 1, 0, s>>>(NULL);
  return cudaGetLastError();
}
static cudaError_t launch_a(cudaStream_t s) {
  k_a<<<1, 1, 0, s>>>(NULL);
  return cudaGetLastError();
}

#define T(who, what, call)                                                        \
  do {                                                                            \
    double t0_ = now_ms();                                                        \
    cudaError_t e_ = (call);                                                      \
    printf("%s %-36s %8.3f ms %s\n", who, what, now_ms() - t0_,                   \
           e_ == cudaSuccess ? "" : cudaGetErrorName(e_));                        \
    fflush(stdout);                                                               \
  } while (0)

static void wait_step(struct shared *sh, int s) {
  while (sh->step < s) usleep(100);
}

static long long spin_cycles(int ms) {
  int khz = 0;
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  if (khz <= 0) khz = 1980000;
  return (long long)khz * ms;
}

static void proc0(struct shared *sh, int ms) {
  const char *w = "p0";
  cudaSetDevice(0);
  cudaFree(0);
  void *old_buf = NULL, *new_buf = NULL, *late = NULL;
  cudaMalloc(&old_buf, 1 << 20);
  cudaMalloc(&new_buf, 1 << 20);
  cudaIpcGetMemHandle(&sh->old_h, old_buf); /* exported before the kernel */
  cudaDeviceSynchronize();
  sh->step = 1;
  wait_step(sh, 2); /* p1 ready too */
  double t0 = now_ms();
  spin<<<1, 1>>>(spin_cycles(ms));
  cudaStream_t s;
  cudaEvent_t ev, ev2;
  T(w, "cudaStreamCreateWithFlags", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  T(w, "cudaEventCreate(interprocess)",
    cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess));
  T(w, "cudaIpcGetEventHandle", cudaIpcGetEventHandle(&sh->ev_h, ev));
  T(w, "cudaEventCreate(plain)", cudaEventCreateWithFlags(&ev2, cudaEventDisableTiming));
  T(w, "cudaIpcGetMemHandle(again, cached)", cudaIpcGetMemHandle(&sh->old_h, old_buf));
  T(w, "cudaIpcGetMemHandle(first)", cudaIpcGetMemHandle(&sh->new_h, new_buf));
  struct cudaPointerAttributes a;
  T(w, "cudaPointerGetAttributes", cudaPointerGetAttributes(&a, new_buf));
  T(w, "cudaMalloc(1 MiB)", cudaMalloc(&late, 1 << 20));
  T(w, "cudaMemcpyAsync d2d", cudaMemcpyAsync(late, new_buf, 4096, cudaMemcpyDefault, s));
  T(w, "first launch of an unloaded kernel", launch_b(s));
  sh->step = 3; /* handles out: p1 maps them */
  wait_step(sh, 4);
  printf("%s kernel still running at the end: %s (%.1f ms after launch)\n", w,
         cudaStreamQuery(0) == cudaErrorNotReady ? "yes" : "NO", now_ms() - t0);
  T(w, "cudaDeviceSynchronize", cudaDeviceSynchronize());
  T(w, "cudaFree", cudaFree(late));
  sh->step = 5;
}

static void proc1(struct shared *sh, int ms) {
  const char *w = "p1";
  cudaSetDevice(0);
  cudaFree(0);
  wait_step(sh, 1);
  cudaDeviceSynchronize();
  sh->step = 2;
  wait_step(sh, 3);
  double t0 = now_ms();
  spin<<<1, 1>>>(spin_cycles(ms));
  void *p_old = NULL, *p_new = NULL;
  cudaEvent_t ev;
  T(w, "cudaIpcOpenMemHandle(old)",
    cudaIpcOpenMemHandle(&p_old, sh->old_h, cudaIpcMemLazyEnablePeerAccess));
  T(w, "cudaIpcOpenMemHandle(new)",
    cudaIpcOpenMemHandle(&p_new, sh->new_h, cudaIpcMemLazyEnablePeerAccess));
  T(w, "cudaIpcOpenEventHandle", cudaIpcOpenEventHandle(&ev, sh->ev_h));
  struct cudaFuncAttributes fa;
  T(w, "cudaFuncGetAttributes(unloaded kernel)", cudaFuncGetAttributes(&fa, k_a));
  T(w, "launch of that kernel", launch_a(0));
  T(w, "cudaIpcCloseMemHandle(old)", cudaIpcCloseMemHandle(p_old));
  printf("%s kernel still running at the end: %s (%.1f ms after launch)\n", w,
         cudaStreamQuery(0) == cudaErrorNotReady ? "yes" : "NO", now_ms() - t0);
  sh->step = 4;
  wait_step(sh, 5);
  cudaDeviceSynchronize();
  cudaIpcCloseMemHandle(p_new);
}

int main(int argc, char **argv) {
  int ms = argc > 1 ? atoi(argv[1]) : 200;
  struct shared *sh = (struct shared *)mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE,
                                            MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED) return 1;
  memset((void *)sh, 0, sizeof *sh);
  pid_t pid = fork();
  if (pid == 0) {
    proc1(sh, ms);
    _exit(0);
  }
  proc0(sh, ms);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
