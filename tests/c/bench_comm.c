/* bench_comm.c - times all-reduce through the C API without Python: forks N ranks that meet
 * on 127.0.0.1 and prints the average time per call for a range of sizes.
 * Usage: bench_comm NRANKS [MIN_BYTES MAX_BYTES] (float32 sum; CHORUS_* variables apply;
 * BENCH_INPLACE=1 reduces in place; BENCH_ITERS=N times N calls per size instead of the
 * default 400, 40 from 1 MiB, 10 from 16 MiB; BENCH_PIN=1 pins rank r to the r-th CPU it
 * may use, round robin). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
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
  for (size_t b = lo; b <= hi; b *= 4) {
    size_t count = b / 4 ? b / 4 : 1;
    int iters = fixed_iters > 0 ? fixed_iters : b >= (1 << 24) ? 10 : b >= (1 << 20) ? 40 : 400;
    for (int i = 0; i < 3; i++)
      if (run(c, in, out, count)) return 1;
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
