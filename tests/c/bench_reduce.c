/* bench_reduce.c - throughput of reduce_n for two inputs (the all-reduce inner loop) on
 * 64 MiB buffers, next to memcpy. Reduce traffic counts 3 buffers (2 read, 1 written),
 * memcpy 2, so the ratio compares bytes moved per second. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"

#define BUF_BYTES ((size_t)64 << 20)
#define REPS 7

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *alloc_filled(int seed) {
  unsigned char *p = aligned_alloc(64, BUF_BYTES);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  /* Small positive values of every dtype (bytes 0x10..0x3f) so sums stay finite. */
  for (size_t i = 0; i < BUF_BYTES; i++) p[i] = (unsigned char)(0x10 + (i * 7 + (size_t)seed) % 0x30);
  return p;
}

/* Best of REPS: the least disturbed run on a shared machine. */
static double best_memcpy(void *dst, const void *src) {
  double best = 1e30;
  for (int r = 0; r < REPS; r++) {
    double t = now_s();
    memcpy(dst, src, BUF_BYTES);
    t = now_s() - t;
    if (t < best) best = t;
  }
  return best;
}

static double best_reduce(void *out, const void *a, const void *b, chorus_dtype_t dt) {
  const void *in[2] = {a, b};
  size_t count = BUF_BYTES / dtype_size(dt);
  double best = 1e30;
  for (int r = 0; r < REPS; r++) {
    double t = now_s();
    reduce_n(out, in, 2, count, dt, CHORUS_SUM);
    t = now_s() - t;
    if (t < best) best = t;
  }
  return best;
}

int main(void) {
  void *a = alloc_filled(1), *b = alloc_filled(2), *out = alloc_filled(3);
  double gb = (double)BUF_BYTES / 1e9;
  double memcpy_gbs = 2 * gb / best_memcpy(out, a);
  printf("memcpy                 %7.2f GB/s (2 buffers of traffic)\n", memcpy_gbs);
  const chorus_dtype_t dts[] = {CHORUS_FLOAT32, CHORUS_BFLOAT16, CHORUS_FLOAT16};
  for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++) {
    double oop = 3 * gb / best_reduce(out, a, b, dts[d]);
    /* In place (out == in[0]): the all-reduce case; a is overwritten, refill not needed
     * for timing since values stay finite for a few repetitions. */
    memcpy(out, a, BUF_BYTES);
    double inp = 3 * gb / best_reduce(out, out, b, dts[d]);
    printf("sum n=2 %-9s out-of-place %7.2f GB/s (%3.0f%% of memcpy)   in-place %7.2f GB/s (%3.0f%%)\n",
           chorus_dtype_name(dts[d]), oop, 100 * oop / memcpy_gbs, inp, 100 * inp / memcpy_gbs);
  }
  free(a);
  free(b);
  free(out);
  return 0;
}
