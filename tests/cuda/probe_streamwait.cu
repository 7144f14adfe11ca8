// probe_streamwait.cu - does a stream blocked on host memory in one process hold up the GPU
// for the other processes sharing it? Chorus lets several ranks share one GPU; without MPS
// their contexts time-slice. A host-free Work.wait() makes the caller's stream wait on a word
// in host memory (cuStreamWaitValue64) that another rank's progress releases. If a blocked
// wait kept its context on the GPU, the others' copies would stall (or deadlock).
//
// N processes (fork, before any CUDA call) on device 0. Each times small device-to-host
// copies on a stream of its own (mean us per copy + sync):
//   base:   nothing else pending;
//   wait:   another stream of the same process blocked in cuStreamWaitValue64 on a shared
//           word (released by process 0 once every process has finished timing);
//   hostfn: the same with a host function that blocks on the word (cudaLaunchHostFunc).
//   kernels: tiny kernels (launch + synchronize) timed by every process at once, then by
//           process 0 while the others have a stream blocked in cuStreamWaitValue64.
// Then each checks that the blocked streams ran once released (5-10 s bound).
// usage: probe_streamwait [nproc=2] [bytes=8] [iters=2000]
#include <cuda_runtime_api.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int (*wait_value64_fn)(cudaStream_t, unsigned long long, unsigned long long, unsigned);

struct shared {
  volatile uint64_t go[3];       // released words for the three blocked phases
  volatile int64_t arrived[6];   // per phase: processes that finished timing
};


static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

#define CK(call)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      fprintf(stderr, "pid %d: %s: %s\n", (int)getpid(), #call, cudaGetErrorString(e_)); \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

static void barrier(struct shared *sh, int phase, int nproc) {
  __atomic_add_fetch(&sh->arrived[phase], 1, __ATOMIC_SEQ_CST);
  while (__atomic_load_n(&sh->arrived[phase], __ATOMIC_SEQ_CST) < nproc) sched_yield();
}

static double time_copies(void *dst, const void *src, size_t bytes, int iters,
                          cudaStream_t s) {
  double t0 = now_us();
  for (int i = 0; i < iters; i++) {
    if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s) != cudaSuccess) return -1;
    if (cudaStreamSynchronize(s) != cudaSuccess) return -1;
  }
  return (now_us() - t0) / iters;
}

__global__ void tiny_kernel(int *p) {
  if (threadIdx.x == 0) *p += 1;
}

static double time_kernels(int *dev, int iters, cudaStream_t s) {
  double t0 = now_us();
  for (int i = 0; i < iters; i++) {
    tiny_kernel<<<1, 32, 0, s>>>(dev);
    if (cudaStreamSynchronize(s) != cudaSuccess) return -1;
  }
  return (now_us() - t0) / iters;
}

static void CUDART_CB block_on_word(void *arg) {
  volatile uint64_t *w = (volatile uint64_t *)arg;
  while (__atomic_load_n(w, __ATOMIC_ACQUIRE) < 1) sched_yield();
}

static int released_within(cudaStream_t s, double us) {
  double end = now_us() + us;
  while (now_us() < end) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return 1;
    if (e != cudaErrorNotReady) return 0;
  }
  return 0;
}

static int child(struct shared *sh, int me, int nproc, size_t bytes, int iters) {
  CK(cudaSetDevice(0));
  void *fn = NULL;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &fn, 12000, cudaEnableDefault,
                                      &q));
  if (q != cudaDriverEntryPointSuccess || !fn) {
    fprintf(stderr, "cuStreamWaitValue64 not found\n");
    return 1;
  }
  wait_value64_fn wait64 = (wait_value64_fn)fn;
  CK(cudaHostRegister((void *)sh, 4096, cudaHostRegisterMapped | cudaHostRegisterPortable));
  void *dsh = NULL;
  CK(cudaHostGetDevicePointer(&dsh, (void *)sh, 0));
  void *dev = NULL, *host = NULL;
  CK(cudaMalloc(&dev, bytes));
  CK(cudaMemset(dev, 1, bytes));
  CK(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
  cudaStream_t copy, blocked;
  CK(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&blocked, cudaStreamNonBlocking));
  time_copies(host, dev, bytes, 100, copy);  // warm-up

  barrier(sh, 0, nproc);
  double base = time_copies(host, dev, bytes, iters, copy);

  // phase wait: the other stream waits on go[0] (device view of the shared page)
  unsigned long long go0 = (unsigned long long)(uintptr_t)dsh + offsetof(struct shared, go[0]);
  if (wait64(blocked, go0, 1, 0 /* GEQ */) != 0) {
    fprintf(stderr, "cuStreamWaitValue64 failed\n");
    return 1;
  }
  CK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, blocked));
  barrier(sh, 1, nproc);
  double waiting = time_copies(host, dev, bytes, iters, copy);
  barrier(sh, 2, nproc);
  if (me == 0) __atomic_store_n(&sh->go[0], 1, __ATOMIC_RELEASE);
  int ok_wait = released_within(blocked, 5e6);

  // phase hostfn: a host function on the other stream blocks until go[1]
  CK(cudaLaunchHostFunc(blocked, block_on_word, (void *)&sh->go[1]));
  CK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, blocked));
  double hostfn = time_copies(host, dev, bytes, iters, copy);
  barrier(sh, 3, nproc);
  if (me == 0) __atomic_store_n(&sh->go[1], 1, __ATOMIC_RELEASE);
  int ok_hostfn = released_within(blocked, 5e6);

  // phase kernels: every process but 0 blocks a stream in cuStreamWaitValue64; process 0
  // times tiny kernels (the compute engine rather than the copy engines). A blocked wait
  // that kept its context on the compute engine would stall them (a timeslice each, or for
  // good).
  int *counter = NULL;
  CK(cudaMalloc(&counter, sizeof(int)));
  time_kernels(counter, 50, copy);
  barrier(sh, 4, nproc);
  double kbase = time_kernels(counter, iters / 4 + 1, copy);
  unsigned long long go2 = (unsigned long long)(uintptr_t)dsh + offsetof(struct shared, go[2]);
  if (me != 0 && wait64(blocked, go2, 1, 0) != 0) return 1;
  if (me != 0) tiny_kernel<<<1, 32, 0, blocked>>>(counter);
  barrier(sh, 5, nproc);
  double kwait = -2;
  if (me == 0) {
    kwait = time_kernels(counter, iters / 4 + 1, copy);
    __atomic_store_n(&sh->go[2], 1, __ATOMIC_RELEASE);
  }
  int ok_k = released_within(blocked, 10e6);

  printf("probe_streamwait: proc %d/%d bytes %zu: base %.1f us, with a stream blocked in "
         "cuStreamWaitValue64 %.1f us (released: %s), with a blocked host function %.1f us "
         "(released: %s); tiny kernels %.1f us, %.1f us while the others block in "
         "cuStreamWaitValue64 (released: %s)\n", me, nproc, bytes, base, waiting,
         ok_wait ? "yes" : "NO", hostfn, ok_hostfn ? "yes" : "NO", kbase, kwait,
         ok_k ? "yes" : "NO");
  fflush(stdout);
  return base > 0 && waiting > 0 && hostfn > 0 && ok_wait && ok_hostfn && ok_k ? 0 : 1;
}

int main(int argc, char **argv) {
  int nproc = argc > 1 ? atoi(argv[1]) : 2;
  size_t bytes = argc > 2 ? (size_t)atoll(argv[2]) : 8;
  int iters = argc > 3 ? atoi(argv[3]) : 2000;
  if (nproc < 1 || nproc > 16 || !bytes || iters < 1) {
    fprintf(stderr, "usage: probe_streamwait [nproc 1..16] [bytes] [iters]\n");
    return 2;
  }
  struct shared *sh = (struct shared *)mmap(NULL, 4096, PROT_READ | PROT_WRITE,
                                            MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED) return 1;
  for (int i = 0; i < nproc; i++) {
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) _exit(child(sh, i, nproc, bytes, iters));
  }
  int bad = 0;
  for (int i = 0; i < nproc; i++) {
    int status = 0;
    if (wait(&status) < 0 || !WIFEXITED(status) || WEXITSTATUS(status)) bad++;
  }
  printf("probe_streamwait: %d of %d processes failed\n", bad, nproc);
  return bad ? 1 : 0;
}
