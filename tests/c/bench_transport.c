/* bench_transport.c - measures the constants of the tuner's cost model (algo/tune.c) on
 * this machine: per-message latency, per-message overhead and streaming bandwidth of the
 * shm and socket transports between two forked ranks (through the public point-to-point
 * API, so the engine's hand-off is included, as it is in every algorithm step), and the
 * rate of reduce_n and memcpy. `make -C tests/c bench_transport && tests/c/build/bench_transport`.
 * Medians of REPS runs; the last line is a CHORUS_TUNE_MODEL string with the results. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "free_port.h"

#define REPS 5
#define PINGS 2000            /* round trips per latency run */
#define BURST 2000            /* back-to-back small messages per overhead run */
#define STREAM_BYTES ((size_t)64 << 20)
#define STREAM_MSGS 4         /* messages of STREAM_BYTES per bandwidth run */
#define REDUCE_BYTES ((size_t)32 << 20) /* one input; larger than the caches */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return v[n / 2];
}

static int wait_free(chorus_request_t *r) {
  chorus_result_t res = chorus_wait(r, -1);
  if (res != CHORUS_SUCCESS) fprintf(stderr, "op failed: %s\n", chorus_request_error(r));
  chorus_request_free(r);
  return res != CHORUS_SUCCESS;
}

static int xfer(chorus_comm_t *c, int send, void *buf, size_t n, int peer) {
  chorus_request_t *r;
  chorus_result_t res = send ? chorus_isend(c, buf, n, CHORUS_UINT8, peer, 0, &r)
                             : chorus_irecv(c, buf, n, CHORUS_UINT8, peer, 0, &r);
  if (res != CHORUS_SUCCESS) return 1;
  return wait_free(r);
}

/* Rank 0 reports {latency_us, overhead_us, bandwidth_GBps} through the pipe fd. */
static int rank_main(int rank, int port, int out_fd) {
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  chorus_bootstrap_t bs;
  if (chorus_bootstrap_tcp(addr, rank, 2, 20000, &bs) != CHORUS_SUCCESS) return 1;
  chorus_comm_t *c;
  chorus_comm_options_t o = {120000, "bench_transport"};
  if (chorus_comm_create(rank, 2, &bs, &o, &c) != CHORUS_SUCCESS) {
    fprintf(stderr, "create failed: %s\n", chorus_comm_error(NULL));
    return 1;
  }
  int peer = 1 - rank;
  uint8_t small[8] = {0};
  uint8_t *big = malloc(STREAM_BYTES);
  chorus_request_t **reqs = malloc(BURST * sizeof *reqs);
  if (!big || !reqs) return 1;
  memset(big, 1, STREAM_BYTES);
  double lat[REPS], ovh[REPS], bw[REPS];
  for (int rep = 0; rep < REPS; rep++) {
    /* latency: half a round trip of 8 bytes */
    double t = now_s();
    for (int i = 0; i < PINGS; i++) {
      if (xfer(c, rank == 0, small, sizeof small, peer)) return 1;
      if (xfer(c, rank != 0, small, sizeof small, peer)) return 1;
    }
    lat[rep] = (now_s() - t) / (2.0 * PINGS) * 1e6;
    /* overhead: BURST messages posted at once, then one reply; per message */
    t = now_s();
    for (int i = 0; i < BURST; i++) {
      chorus_result_t res = rank == 0 ? chorus_isend(c, small, 8, CHORUS_UINT8, peer, 0, &reqs[i])
                                      : chorus_irecv(c, small, 8, CHORUS_UINT8, peer, 0, &reqs[i]);
      if (res != CHORUS_SUCCESS) return 1;
    }
    for (int i = 0; i < BURST; i++)
      if (wait_free(reqs[i])) return 1;
    if (xfer(c, rank != 0, small, sizeof small, peer)) return 1;
    ovh[rep] = (now_s() - t) / BURST * 1e6;
    /* streaming bandwidth: STREAM_MSGS large messages one way, then an 8-byte ack */
    t = now_s();
    for (int i = 0; i < STREAM_MSGS; i++)
      if (xfer(c, rank == 0, big, STREAM_BYTES, peer)) return 1;
    if (xfer(c, rank != 0, small, sizeof small, peer)) return 1;
    bw[rep] = (double)STREAM_BYTES * STREAM_MSGS / (now_s() - t) / 1e9;
  }
  if (rank == 0) {
    double res[3] = {median(lat, REPS), median(ovh, REPS), median(bw, REPS)};
    if (write(out_fd, res, sizeof res) != (ssize_t)sizeof res) return 1;
  }
  free(big);
  free(reqs);
  chorus_comm_destroy(c);
  if (bs.release) bs.release(bs.ctx);
  return 0;
}

/* Runs the two-rank measurement with CHORUS_SHM_DISABLE set to shm_disable. */
static int measure_transport(int shm_disable, double res[3]) {
  int fds[2];
  if (pipe(fds) != 0) return 1;
  int port = free_port();
  pid_t pids[2];
  for (int r = 0; r < 2; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      setenv("CHORUS_SHM_DISABLE", shm_disable ? "1" : "0", 1);
      _exit(rank_main(r, port, fds[1]));
    }
  }
  close(fds[1]);
  int bad = read(fds[0], res, 3 * sizeof(double)) != (ssize_t)(3 * sizeof(double));
  close(fds[0]);
  for (int r = 0; r < 2; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    bad |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  }
  return bad;
}

/* GB/s of input bytes consumed by reduce_n(float32 sum) over nin inputs of REDUCE_BYTES. */
static double reduce_rate(int nin) {
  const void *in[8];
  void *bufs[9];
  for (int i = 0; i <= nin; i++) {
    bufs[i] = aligned_alloc(64, REDUCE_BYTES);
    if (!bufs[i]) exit(2);
    float *f = bufs[i];
    for (size_t k = 0; k < REDUCE_BYTES / 4; k++) f[k] = (float)(k % 97) * 0.25f;
    if (i < nin) in[i] = bufs[i];
  }
  double v[REPS * 4];
  for (int r = 0; r < REPS * 4; r++) {
    double t = now_s();
    reduce_n(bufs[nin], in, nin, REDUCE_BYTES / 4, CHORUS_FLOAT32, CHORUS_SUM);
    v[r] = (double)REDUCE_BYTES * nin / (now_s() - t) / 1e9;
  }
  for (int i = 0; i <= nin; i++) free(bufs[i]);
  return median(v, REPS * 4);
}

/* GB/s of memcpy from a large buffer into a 4 MiB staging window, chunk by chunk: what a
 * copy into a shared-memory scratch or a ring costs. */
static volatile unsigned sink;
static double memcpy_rate(void) {
  const size_t chunk = (size_t)4 << 20;
  void *a = aligned_alloc(64, REDUCE_BYTES), *b = aligned_alloc(64, chunk);
  if (!a || !b) exit(2);
  memset(a, 3, REDUCE_BYTES);
  memset(b, 4, chunk);
  double v[REPS * 4];
  for (int r = 0; r < REPS * 4; r++) {
    double t = now_s();
    for (size_t off = 0; off < REDUCE_BYTES; off += chunk) {
      memcpy(b, (char *)a + off, chunk);
      sink += ((volatile unsigned char *)b)[(off / chunk * 4099) % chunk]; /* keep the copy */
    }
    v[r] = (double)REDUCE_BYTES / (now_s() - t) / 1e9;
  }
  free(a);
  free(b);
  return median(v, REPS * 4);
}

int main(void) {
  setenv("CHORUS_SOCKET_IFNAME", "=lo", 0);
  double shm[3], sock[3];
  if (measure_transport(0, shm) || measure_transport(1, sock)) {
    fprintf(stderr, "bench_transport: a measurement failed\n");
    return 1;
  }
  double r2 = reduce_rate(2), r8 = reduce_rate(8), mc = memcpy_rate();
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  printf("machine: %ld online cores; medians of %d runs, 2 ranks\n", cores, REPS);
  printf("shm     latency %7.2f us  overhead %6.2f us/msg  bandwidth %6.2f GB/s\n", shm[0],
         shm[1], shm[2]);
  printf("socket  latency %7.2f us  overhead %6.2f us/msg  bandwidth %6.2f GB/s  (loopback)\n",
         sock[0], sock[1], sock[2]);
  printf("reduce  float32 sum: 2 inputs %6.2f GB/s, 8 inputs %6.2f GB/s (input bytes)\n", r2, r8);
  printf("memcpy  %6.2f GB/s (%zu MiB source into a 4 MiB window)\n", mc, REDUCE_BYTES >> 20);
  printf("CHORUS_TUNE_MODEL=shm=%.2f:%.2f:%.2f,socket=%.2f:%.2f:%.2f,reduce=%.2f,copy=%.2f\n",
         shm[0], shm[1], shm[2], sock[0], sock[1], sock[2], (r2 + r8) / 2, mc);
  return 0;
}
