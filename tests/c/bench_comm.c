/* bench_comm.c - times all-reduce through the C API without Python: forks N ranks that meet
 * on 127.0.0.1 and prints the average time per call for a range of sizes.
 * Usage: bench_comm NRANKS [MIN_BYTES MAX_BYTES] (float32 sum; CHORUS_* variables apply;
 * BENCH_INPLACE=1 reduces in place; BENCH_ITERS=N times N calls per size instead of the
 * default 400, 40 from 1 MiB, 10 from 16 MiB; BENCH_PIN=1 pins rank r to the r-th CPU it
 * may use, round robin; BENCH_FP_AB=K times the calls in blocks of K, half with the call
 * fingerprint on and half with it off, in shuffled order, and prints both times: see fp_ab
 * below). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "free_port.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int run(chorus_comm_t *c, float *in, float *out, size_t count) {
  chorus_request_t *req;
  chorus_redop_t sum = {CHORUS_SUM, 1.0};
  if (chorus_iallreduce(c, in, out, count, CHORUS_FLOAT32, sum, &req) != CHORUS_SUCCESS) return 1;
  chorus_result_t r = chorus_wait(req, -1);
  if (r != CHORUS_SUCCESS) fprintf(stderr, "all_reduce failed: %s\n", chorus_request_error(req));
  chorus_request_free(req);
  return r != CHORUS_SUCCESS;
}

#ifdef CHORUS_FP_SWITCH
extern _Atomic int chorus_fp_off; /* core.h: the fingerprint's run-time switch */
#endif

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median_of(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* BENCH_FP_AB=K (tools/fp_cost.sh): `iters` calls (rounded up to a multiple of 16K) in
 * blocks of K, half of them with the call fingerprint on and half with it off, in an order
 * shuffled anew for every 16 blocks from a seed that every rank derives from the run's port
 * (so every rank switches before the same call, and a run's order differs from the next
 * run's). A fixed pattern would alias with whatever repeats from call to call: with on, off,
 * off, on (ABBA) the A/A check below (identical code in both halves) gave 1.017-1.020 at 4
 * ranks; shuffled, it stays within 1% of 1. Built with -DCHORUS_FP_SWITCH the switch is
 * real; in any other build the "off" calls run with the fingerprint on as well, which times
 * the method's own noise (an A/A check). Every call is timed; rank 0 prints the mean time
 * per call of each kind, their ratio, and the medians. The two kinds share the run's
 * placement and scheduling, which on a small, oversubscribed machine move one run's time by
 * up to 2x from run to run. */
static int fp_ab(chorus_comm_t *c, int rank, float *in, float *out, size_t count, int iters,
                 int k, uint64_t *seed) {
  int blocks = (iters + 16 * k - 1) / (16 * k) * 16, half = blocks / 2 * k, m[2] = {0, 0};
  double *t[2] = {malloc((size_t)half * sizeof(double)), malloc((size_t)half * sizeof(double))};
  double sum[2] = {0, 0};
  int bad = !t[0] || !t[1];
  int order[16];
  for (int b = 0; b < blocks && !bad; b++) {
    if (b % 16 == 0) { /* the next 16 blocks: 8 of each kind, shuffled (Fisher-Yates) */
      for (int i = 0; i < 16; i++) order[i] = i % 2;
      for (int i = 15; i > 0; i--) {
        *seed ^= *seed << 13, *seed ^= *seed >> 7, *seed ^= *seed << 17; /* xorshift64 */
        int j = (int)(*seed % (uint64_t)(i + 1)), o = order[i];
        order[i] = order[j];
        order[j] = o;
      }
    }
    int off = order[b % 16];
#ifdef CHORUS_FP_SWITCH
    atomic_store(&chorus_fp_off, off);
#endif
    for (int i = 0; i < k && !bad; i++) {
      double t0 = now();
      bad = run(c, in, out, count);
      double dt = now() - t0;
      t[off][m[off]++] = dt;
      sum[off] += dt;
    }
  }
#ifdef CHORUS_FP_SWITCH
  atomic_store(&chorus_fp_off, 0);
#endif
  if (!bad && rank == 0) {
    double on = sum[0] / half, off = sum[1] / half;
    printf("%10zu B fp on %10.3f us  off %10.3f us  ratio %.4f  calls %d  medians %.3f %.3f us\n",
           count * 4, on * 1e6, off * 1e6, on / off, 2 * half, median_of(t[0], half) * 1e6,
           median_of(t[1], half) * 1e6);
  }
  free(t[0]);
  free(t[1]);
  return bad;
}

static int rank_main(int rank, int n, int port, size_t lo, size_t hi) {
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  chorus_bootstrap_t bs;
  if (chorus_bootstrap_tcp(addr, rank, n, 20000, &bs) != CHORUS_SUCCESS) return 1;
  chorus_comm_t *c;
  chorus_comm_options_t o = {60000, "bench"};
  if (chorus_comm_create(rank, n, &bs, &o, &c) != CHORUS_SUCCESS) {
    fprintf(stderr, "create failed: %s\n", chorus_comm_error(NULL));
    return 1;
  }
  size_t maxc = hi / 4 ? hi / 4 : 1;
  float *in = malloc(maxc * 4), *out = getenv("BENCH_INPLACE") ? in : malloc(maxc * 4);
  for (size_t i = 0; i < maxc; i++) in[i] = out[i] = 1.0f;
  int fixed_iters = getenv("BENCH_ITERS") ? atoi(getenv("BENCH_ITERS")) : 0;
  int fp_block = getenv("BENCH_FP_AB") ? atoi(getenv("BENCH_FP_AB")) : 0;
  uint64_t seed = 0x9e3779b97f4a7c15ull ^ (uint64_t)port; /* the same on every rank */
  for (size_t b = lo; b <= hi; b *= 4) {
    size_t count = b / 4 ? b / 4 : 1;
    int iters = fixed_iters > 0 ? fixed_iters : b >= (1 << 24) ? 10 : b >= (1 << 20) ? 40 : 400;
    for (int i = 0; i < 3; i++)
      if (run(c, in, out, count)) return 1;
    if (fp_block > 0) {
      if (fp_ab(c, rank, in, out, count, iters, fp_block, &seed)) return 1;
      fflush(stdout);
      continue;
    }
    double t0 = now();
    for (int i = 0; i < iters; i++)
      if (run(c, in, out, count)) return 1;
    double dt = (now() - t0) / iters;
    if (rank == 0)
      printf("%10zu B %10.3f us  busbw %6.2f GB/s\n", count * 4, dt * 1e6,
             2.0 * (n - 1) / n * (double)count * 4 / dt / 1e9);
    fflush(stdout);
  }
  if (out != in) free(out);
  free(in);
  chorus_comm_destroy(c);
  if (bs.release) bs.release(bs.ctx);
  return 0;
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 4;
  size_t lo = argc > 2 ? (size_t)atoll(argv[2]) : 8, hi = argc > 3 ? (size_t)atoll(argv[3]) : 64 << 20;
  if (n < 1 || n > 64 || lo < 1 || hi < lo) {
    fprintf(stderr, "usage: bench_comm NRANKS [MIN_BYTES MAX_BYTES]\n");
    return 2;
  }
  setenv("CHORUS_SOCKET_IFNAME", "=lo", 0); /* loopback only unless told otherwise */
  int port = free_port();
  int pin = getenv("BENCH_PIN") && atoi(getenv("BENCH_PIN")) > 0;
  pid_t pids[64];
  for (int r = 0; r < n; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      if (pin) { /* rank r on the r-th CPU it may use, round robin */
        cpu_set_t all, one;
        if (sched_getaffinity(0, sizeof all, &all) == 0 && CPU_COUNT(&all) > 0) {
          int k = r % CPU_COUNT(&all);
          for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
            if (CPU_ISSET(cpu, &all) && k-- == 0) {
              CPU_ZERO(&one);
              CPU_SET(cpu, &one);
              sched_setaffinity(0, sizeof one, &one);
              break;
            }
        }
      }
      _exit(rank_main(r, n, port, lo, hi));
    }
  }
  int bad = 0;
  for (int r = 0; r < n; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    bad |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  }
  return bad;
}
