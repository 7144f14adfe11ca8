/* bench_kernels.cu - bandwidth of the core's reduction kernels against the device-to-device
 * copy, measured in the same run: a = b + c over buffers of SIZE bytes (default 1 GiB) for
 * bfloat16 and float32 (every dtype with --all), and cudaMemcpyAsync of SIZE bytes. Bytes
 * counted are bytes read plus bytes written: 2 x SIZE for the copy, 3 x SIZE for the
 * two-input reduction. Each figure is the best of ITERS timed runs (CUDA events) after two
 * warm-up runs. Prints one line per measurement and exits 1 when a reduction reaches less
 * than MIN (default 0.85) of the copy bandwidth.
 *   usage: bench_kernels [--size BYTES] [--iters N] [--min RATIO] [--all] */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_kernels.h"

#define CUDA_CHECK(call)                                                               \
  do {                                                                                 \
    cudaError_t e_ = (call);                                                           \
    if (e_ != cudaSuccess) {                                                           \
      fprintf(stderr, "bench_kernels: %s:%d: %s: %s\n", __FILE__, __LINE__, #call,     \
              cudaGetErrorString(e_));                                                 \
      exit(2);                                                                         \
    }                                                                                  \
  } while (0)

static const char *const DTYPE_NAME[] = {"int8",     "uint8",   "int16",   "int32",  "int64",
                                         "float16", "bfloat16", "float32", "float64", "bool",
                                         "float8_e4m3fn", "float8_e5m2"};
static const size_t ES[] = {1, 1, 2, 4, 8, 2, 2, 4, 8, 1, 1, 1};

static cudaStream_t stream;
static cudaEvent_t ev0, ev1;

/* Best time in ms of iters runs of what(arg), each timed alone with events. */
static float best_ms(void (*what)(void *), void *arg, int iters) {
  float best = 1e30f;
  for (int i = -2; i < iters; i++) {
    CUDA_CHECK(cudaEventRecord(ev0, stream));
    what(arg);
    CUDA_CHECK(cudaEventRecord(ev1, stream));
    CUDA_CHECK(cudaEventSynchronize(ev1));
    float ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, ev0, ev1));
    if (i >= 0 && ms < best) best = ms;
  }
  return best;
}

struct job {
  void *a;
  const void *in[2];
  size_t bytes;
  chorus_dtype_t dtype;
};

static void run_copy(void *p) {
  struct job *j = (struct job *)p;
  CUDA_CHECK(cudaMemcpyAsync(j->a, j->in[0], j->bytes, cudaMemcpyDeviceToDevice, stream));
}

static void run_reduce(void *p) {
  struct job *j = (struct job *)p;
  int e = chorus_cuda_reduce(j->a, j->in, 2, j->bytes / ES[j->dtype], j->dtype, CHORUS_SUM, 1,
                             stream);
  CUDA_CHECK((cudaError_t)e);
}

int main(int argc, char **argv) {
  size_t size = (size_t)1 << 30;
  int iters = 10, all = 0;
  double min_ratio = 0.85;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--size") && i + 1 < argc) {
      size = strtoull(argv[++i], NULL, 0);
    } else if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--min") && i + 1 < argc) {
      min_ratio = atof(argv[++i]);
    } else if (!strcmp(argv[i], "--all")) {
      all = 1;
    } else {
      fprintf(stderr, "usage: bench_kernels [--size BYTES] [--iters N] [--min RATIO] [--all]\n");
      return 2;
    }
  }
  size &= ~(size_t)15;
  if (size == 0 || iters < 1) {
    fprintf(stderr, "bench_kernels: --size must be at least 16 and --iters at least 1\n");
    return 2;
  }
  cudaDeviceProp prop;
  int dev;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  printf("bench_kernels: %s, %zu bytes per buffer, best of %d\n", prop.name, size, iters);
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreate(&ev0));
  CUDA_CHECK(cudaEventCreate(&ev1));
  void *a, *b, *c;
  CUDA_CHECK(cudaMalloc(&a, size));
  CUDA_CHECK(cudaMalloc(&b, size));
  CUDA_CHECK(cudaMalloc(&c, size));
  CUDA_CHECK(cudaMemsetAsync(b, 0x11, size, stream));
  CUDA_CHECK(cudaMemsetAsync(c, 0x22, size, stream));

  struct job j = {a, {b, c}, size, CHORUS_FLOAT32};
  double copy_gbs = 2.0 * (double)size / (best_ms(run_copy, &j, iters) * 1e6);
  printf("copy      %9.1f GB/s (read + write)\n", copy_gbs);
  int bad = 0;
  for (int dt = 0; dt < CHORUS_DTYPE_COUNT; dt++) {
    if (!all && dt != CHORUS_BFLOAT16 && dt != CHORUS_FLOAT32) continue;
    j.dtype = (chorus_dtype_t)dt;
    double gbs = 3.0 * (double)size / (best_ms(run_reduce, &j, iters) * 1e6);
    double ratio = gbs / copy_gbs;
    int gated = dt == CHORUS_BFLOAT16 || dt == CHORUS_FLOAT32;
    printf("sum %-8s %9.1f GB/s (2 reads + 1 write) = %.3f of copy%s\n", DTYPE_NAME[dt], gbs,
           ratio, gated && ratio < min_ratio ? "  BELOW THE BAR" : "");
    if (gated && ratio < min_ratio) bad = 1;
  }
  CUDA_CHECK(cudaFree(a));
  CUDA_CHECK(cudaFree(b));
  CUDA_CHECK(cudaFree(c));
  CUDA_CHECK(cudaEventDestroy(ev0));
  CUDA_CHECK(cudaEventDestroy(ev1));
  CUDA_CHECK(cudaStreamDestroy(stream));
  printf("bench_kernels: %s (bar: bfloat16 and float32 at least %.2f of copy)\n",
         bad ? "FAILED" : "ok", min_ratio);
  return bad;
}
