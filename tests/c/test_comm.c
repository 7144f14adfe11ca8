/* test_comm.c - end-to-end test of the C API without Python: forks N ranks that meet
 * through the built-in TCP rendezvous on 127.0.0.1 and run every collective and
 * point-to-point op over shared memory and over sockets, checking values; then a world
 * and the dead-peer check again with spinning waits (CHORUS_SPIN_COUNT=2000), the path of
 * hosts with cores to spare; then the socket worlds with I/O threads (CHORUS_SOCKET_THREADS,
 * also off by default on small machines), and a peer that dies in the middle of big
 * payloads those threads move both ways. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "free_port.h"

static int failures;
#define EXPECT(cond, ...)                                         \
  do {                                                            \
    if (!(cond)) {                                                \
      fprintf(stderr, "rank %d: FAIL %s:%d: ", g_rank, __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                               \
      fprintf(stderr, "\n");                                      \
      failures++;                                                 \
    }                                                             \
  } while (0)
#define OK(call)                                                                   \
  do {                                                                             \
    chorus_result_t r_ = (call);                                                   \
    if (r_ != CHORUS_SUCCESS) {                                                    \
      fprintf(stderr, "rank %d: %s failed: %s (%s)\n", g_rank, #call,              \
              chorus_result_string(r_), chorus_comm_error(NULL));                  \
      failures++;                                                                  \
      return;                                                                      \
    }                                                                              \
  } while (0)

static int g_rank;

static chorus_result_t run_req(chorus_request_t *req) {
  chorus_result_t r = chorus_wait(req, -1);
  chorus_request_free(req);
  return r;
}

static void check_allreduce(chorus_comm_t *c, int n, size_t count) {
  int me = chorus_comm_rank(c);
  float *in = malloc((count + 1) * sizeof(float)), *out = malloc((count + 1) * sizeof(float));
  for (size_t i = 0; i < count; i++) in[i] = (float)(me + 1) * (float)(i % 97);
  for (size_t i = 0; i < count; i++) out[i] = -1234.f;
  chorus_request_t *req;
  chorus_redop_t sum = {CHORUS_SUM, 1.0};
  OK(chorus_iallreduce(c, in, out, count, CHORUS_FLOAT32, sum, &req));
  OK(run_req(req));
  float f = (float)(n * (n + 1) / 2);
  for (size_t i = 0; i < count; i++) {
    if (out[i] != f * (float)(i % 97)) {
      EXPECT(0, "allreduce count %zu: out[%zu] = %g, expected %g", count, i, out[i],
             f * (float)(i % 97));
      break;
    }
  }
  /* in place, MAX over int32 */
  int32_t *v = malloc((count + 1) * sizeof(int32_t));
  for (size_t i = 0; i < count; i++) v[i] = (int32_t)((me * 7 + (int)i) % 13);
  chorus_redop_t mx = {CHORUS_MAX, 1.0};
  OK(chorus_iallreduce(c, v, v, count, CHORUS_INT32, mx, &req));
  OK(run_req(req));
  for (size_t i = 0; i < count; i++) {
    int32_t e = 0;
    for (int r = 0; r < n; r++) {
      int32_t x = (int32_t)((r * 7 + (int)i) % 13);
      if (x > e) e = x;
    }
    if (v[i] != e) {
      EXPECT(0, "allreduce max count %zu: v[%zu] = %d, expected %d", count, i, v[i], e);
      break;
    }
  }
  free(v);
  free(in);
  free(out);
}

static void check_others(chorus_comm_t *c, int n) {
  size_t count = 1000;
  chorus_request_t *req;
  /* broadcast from the last rank */
  int64_t *b = malloc(count * sizeof(int64_t));
  for (size_t i = 0; i < count; i++) b[i] = g_rank == n - 1 ? (int64_t)i * 3 : -1;
  OK(chorus_ibroadcast(c, b, count, CHORUS_INT64, n - 1, &req));
  OK(run_req(req));
  for (size_t i = 0; i < count; i++)
    if (b[i] != (int64_t)i * 3) {
      EXPECT(0, "broadcast b[%zu] = %lld", i, (long long)b[i]);
      break;
    }
  /* allgather */
  int32_t mine[5];
  int32_t *all = malloc((size_t)n * 5 * sizeof(int32_t));
  for (int i = 0; i < 5; i++) mine[i] = g_rank * 100 + i;
  OK(chorus_iallgather(c, mine, all, 5, CHORUS_INT32, &req));
  OK(run_req(req));
  for (int r = 0; r < n; r++)
    for (int i = 0; i < 5; i++) EXPECT(all[r * 5 + i] == r * 100 + i, "allgather [%d][%d]", r, i);
  /* reduce_scatter */
  double *rs_in = malloc((size_t)n * 3 * sizeof(double)), rs_out[3];
  for (int i = 0; i < n * 3; i++) rs_in[i] = i + g_rank;
  chorus_redop_t sum = {CHORUS_SUM, 1.0};
  OK(chorus_ireduce_scatter(c, rs_in, rs_out, 3, CHORUS_FLOAT64, sum, &req));
  OK(run_req(req));
  for (int i = 0; i < 3; i++) {
    double e = 0;
    for (int r = 0; r < n; r++) e += g_rank * 3 + i + r;
    EXPECT(rs_out[i] == e, "reduce_scatter [%d] = %g expected %g", i, rs_out[i], e);
  }
  /* alltoall */
  int32_t *a_in = malloc((size_t)n * 2 * sizeof(int32_t)), *a_out = malloc((size_t)n * 2 * sizeof(int32_t));
  for (int p = 0; p < n; p++) {
    a_in[p * 2] = g_rank * 1000 + p;
    a_in[p * 2 + 1] = -g_rank;
  }
  OK(chorus_ialltoall(c, a_in, a_out, 2, CHORUS_INT32, &req));
  OK(run_req(req));
  for (int p = 0; p < n; p++) {
    EXPECT(a_out[p * 2] == p * 1000 + g_rank, "alltoall from %d", p);
    EXPECT(a_out[p * 2 + 1] == -p, "alltoall from %d second", p);
  }
  /* alltoall of 1 MiB blocks (several scratch chunks), out of place and then in place (the
   * same buffer for input and output: every block but our own is replaced) */
  {
    const size_t bc = (size_t)1 << 18;
    int32_t *bi = malloc((size_t)n * bc * sizeof(int32_t)),
            *bo = malloc((size_t)n * bc * sizeof(int32_t));
    for (int pass = 0; pass < 2; pass++) {
      for (int p = 0; p < n; p++)
        for (size_t i = 0; i < bc; i++) bi[(size_t)p * bc + i] = (int32_t)(g_rank * 100000 + p * 7 + (int)(i % 1013));
      int32_t *out = pass ? bi : bo;
      OK(chorus_ialltoall(c, bi, out, bc, CHORUS_INT32, &req));
      OK(run_req(req));
      int bad = 0;
      for (int p = 0; p < n && !bad; p++)
        for (size_t i = 0; i < bc; i++)
          if (out[(size_t)p * bc + i] != (int32_t)(p * 100000 + g_rank * 7 + (int)(i % 1013))) {
            EXPECT(0, "alltoall %s: block %d element %zu = %d", pass ? "in place" : "out of place",
                   p, i, out[(size_t)p * bc + i]);
            bad = 1;
            break;
          }
    }
    free(bi);
    free(bo);
  }
  /* ring of send/recv posted both ways before waiting (must not deadlock) */
  if (n > 1) {
    size_t big = 300000;
    uint8_t *sb = malloc(big), *rb = malloc(big);
    for (size_t i = 0; i < big; i++) sb[i] = (uint8_t)(i + (size_t)g_rank);
    chorus_request_t *rs, *rr;
    int to = (g_rank + 1) % n, from = (g_rank + n - 1) % n;
    OK(chorus_isend(c, sb, big, CHORUS_UINT8, to, 7, &rs));
    OK(chorus_irecv(c, rb, big, CHORUS_UINT8, from, 7, &rr));
    OK(run_req(rs));
    OK(run_req(rr));
    for (size_t i = 0; i < big; i++)
      if (rb[i] != (uint8_t)(i + (size_t)from)) {
        EXPECT(0, "recv byte %zu", i);
        break;
      }
    free(sb);
    free(rb);
  }
  OK(chorus_ibarrier(c, &req));
  OK(run_req(req));
  free(b);
  free(all);
  free(rs_in);
  free(a_in);
  free(a_out);
}

static int rank_main(int rank, int n, int port) {
  g_rank = rank;
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  chorus_bootstrap_t bs;
  if (chorus_bootstrap_tcp(addr, rank, n, 20000, &bs) != CHORUS_SUCCESS) {
    fprintf(stderr, "rank %d: bootstrap failed: %s\n", rank, chorus_comm_error(NULL));
    return 1;
  }
  chorus_comm_t *c;
  chorus_comm_options_t o = {20000, "test"};
  if (chorus_comm_create(rank, n, &bs, &o, &c) != CHORUS_SUCCESS) {
    fprintf(stderr, "rank %d: create failed: %s\n", rank, chorus_comm_error(NULL));
    return 1;
  }
  size_t sizes[] = {0, 1, 7, 4099, 300000};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) check_allreduce(c, n, sizes[i]);
  /* with socket I/O threads: slices of 1.5 MiB and more, which the threads send, receive
   * straight into the output, or stage for the reduction */
  if (getenv("CHORUS_SOCKET_THREADS")) check_allreduce(c, n, (size_t)6 << 20);
  check_others(c, n);
  /* split into even/odd ranks and reduce there */
  chorus_comm_t *sub = NULL;
  if (chorus_comm_split(c, rank % 2, rank, &o, &sub) != CHORUS_SUCCESS)
    EXPECT(0, "split: %s", chorus_comm_error(NULL));
  if (sub) {
    EXPECT(chorus_comm_size(sub) == (n + 1 - rank % 2) / 2, "split size %d", chorus_comm_size(sub));
    check_allreduce(sub, chorus_comm_size(sub), 777);
    chorus_comm_destroy(sub);
  }
  chorus_request_t *req;
  if (chorus_ibarrier(c, &req) == CHORUS_SUCCESS) run_req(req);
  chorus_comm_destroy(c);
  if (bs.release) bs.release(bs.ctx);
  return failures ? 1 : 0;
}

/* A communicator of 2 ranks over the rendezvous at port (20 s timeout), or NULL. */
static chorus_comm_t *pair_comm(int rank, int port, const char *name, chorus_bootstrap_t *bs) {
  g_rank = rank;
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  if (chorus_bootstrap_tcp(addr, rank, 2, 20000, bs) != CHORUS_SUCCESS) return NULL;
  chorus_comm_t *c;
  chorus_comm_options_t o = {20000, name};
  return chorus_comm_create(rank, 2, bs, &o, &c) == CHORUS_SUCCESS ? c : NULL;
}

/* Rank 1 exits without a word; rank 0's all-reduce must fail naming it long before the
 * 20 s timeout, although rank 1 stays an unreaped zombie meanwhile. */
static int dead_peer_main(int rank, int port) {
  chorus_bootstrap_t bs;
  chorus_comm_t *c = pair_comm(rank, port, "dead", &bs);
  if (!c) return 1;
  if (rank == 1) _exit(0);
  sleep(1);
  float x[16] = {0};
  chorus_request_t *req;
  chorus_redop_t sum = {CHORUS_SUM, 1.0};
  time_t t0 = time(NULL);
  if (chorus_iallreduce(c, x, x, 16, CHORUS_FLOAT32, sum, &req) != CHORUS_SUCCESS) return 1;
  chorus_result_t r = chorus_wait(req, -1);
  int ok = r == CHORUS_ERR_PEER && time(NULL) - t0 < 5 && strstr(chorus_request_error(req), "rank 1");
  if (!ok)
    fprintf(stderr, "dead peer: result %d after %lds: %s\n", (int)r, (long)(time(NULL) - t0),
            chorus_request_error(req));
  chorus_request_free(req);
  chorus_comm_destroy(c);
  if (bs.release) bs.release(bs.ctx);
  return ok ? 0 : 1;
}

/* Both ranks send each other 64 MiB at once (payloads an I/O thread moves). Rank 0 watches
 * its receive buffer: once the middle of the payload has arrived but not its end, it kills
 * rank 1 (SIGKILL: the kernel closes its sockets mid-transfer). Rank 0's receive must then
 * fail, naming rank 1, in seconds; its send may have finished into the kernel's buffers.
 * Exit 2: the receive finished before the kill landed (the caller tries again). */
#define MID_BYTES ((size_t)64 << 20)
static pid_t g_victim;
static int dead_mid_payload_main(int rank, int port) {
  chorus_bootstrap_t bs;
  chorus_comm_t *c = pair_comm(rank, port, "dead-mid", &bs);
  if (!c) return 1;
  uint8_t *sb = malloc(MID_BYTES), *rb = calloc(MID_BYTES, 1);
  if (!sb || !rb) return 1;
  memset(sb, 0xab, MID_BYTES);
  chorus_request_t *req;
  if (chorus_ibarrier(c, &req) != CHORUS_SUCCESS || run_req(req) != CHORUS_SUCCESS) return 1;
  chorus_request_t *rs, *rr;
  if (chorus_isend(c, sb, MID_BYTES, CHORUS_UINT8, 1 - rank, 3, &rs) != CHORUS_SUCCESS ||
      chorus_irecv(c, rb, MID_BYTES, CHORUS_UINT8, 1 - rank, 3, &rr) != CHORUS_SUCCESS)
    return 1;
  if (rank == 1) { /* killed by rank 0 in the middle */
    chorus_wait(rs, -1);
    chorus_wait(rr, -1);
    return 1;
  }
  /* An I/O thread fills rb while the request runs: look at it through /proc/self/mem (a
   * copy by the kernel, no load racing with that thread's writes) */
  int mem = open("/proc/self/mem", O_RDONLY | O_CLOEXEC);
  if (mem < 0) return 1;
  int killed = 0, done = 0;
  time_t t0 = time(NULL);
  while (!done && time(NULL) - t0 < 10) {
    uint8_t mid = 0, end = 0;
    if (pread(mem, &mid, 1, (off_t)(uintptr_t)(rb + MID_BYTES / 2)) != 1 ||
        pread(mem, &end, 1, (off_t)(uintptr_t)(rb + MID_BYTES - 1)) != 1)
      break;
    if (mid && !end) {
      kill(g_victim, SIGKILL);
      killed = 1;
      break;
    }
    chorus_test(rr, &done);
  }
  close(mem);
  chorus_result_t r1 = chorus_wait(rs, -1), r2 = chorus_wait(rr, -1);
  int rc;
  if (!killed) {
    rc = r2 == CHORUS_SUCCESS ? 2 : 1;
    if (rc == 1) fprintf(stderr, "dead peer mid-payload: receive failed before the kill\n");
  } else {
    int ok = (r1 == CHORUS_SUCCESS || r1 == CHORUS_ERR_PEER) &&
             (r2 == CHORUS_ERR_PEER || r2 == CHORUS_SUCCESS) && time(NULL) - t0 < 15 &&
             (r2 == CHORUS_SUCCESS || strstr(chorus_request_error(rr), "rank 1"));
    if (!ok)
      fprintf(stderr, "dead peer mid-payload: send %d, receive %d after %lds: %s\n", (int)r1,
              (int)r2, (long)(time(NULL) - t0), chorus_request_error(rr));
    rc = !ok ? 1 : r2 == CHORUS_SUCCESS ? 2 : 0; /* the last bytes won the race: again */
  }
  chorus_request_free(rs);
  chorus_request_free(rr);
  chorus_comm_destroy(c);
  free(sb);
  free(rb);
  if (bs.release) bs.release(bs.ctx);
  return rc;
}

static int run_dead_mid_payload(void) {
  setenv("CHORUS_SHM_DISABLE", "1", 1);
  for (int attempt = 1;; attempt++) {
    int port = free_port();
    fflush(stdout);
    pid_t p1 = fork();
    if (p1 == 0) _exit(dead_mid_payload_main(1, port));
    g_victim = p1;
    pid_t p0 = fork();
    if (p0 == 0) {
      int rc = dead_mid_payload_main(0, port);
      if (getenv("TEST_CHILD_EXIT")) exit(rc);
      _exit(rc);
    }
    int st0, st1;
    waitpid(p0, &st0, 0);
    if (WIFEXITED(st0) && WEXITSTATUS(st0) == 2) kill(p1, SIGKILL); /* still waiting */
    waitpid(p1, &st1, 0);
    if (WIFEXITED(st0) && WEXITSTATUS(st0) == 2 && attempt < 5) {
      printf("     (attempt %d: the payload arrived before the kill landed; again)\n", attempt);
      continue;
    }
    int bad = !WIFEXITED(st0) || WEXITSTATUS(st0) != 0;
    printf("%s dead peer in the middle of big payloads noticed (socket)\n", bad ? "FAIL" : "ok  ");
    return bad;
  }
}

static int run_dead_peer(int shm) {
  int port = free_port();
  if (!shm) setenv("CHORUS_SHM_DISABLE", "1", 1);
  else unsetenv("CHORUS_SHM_DISABLE");
  fflush(stdout);
  pid_t p0 = fork();
  if (p0 == 0) _exit(dead_peer_main(0, port));
  pid_t p1 = fork();
  if (p1 == 0) _exit(dead_peer_main(1, port));
  int st0, st1;
  waitpid(p0, &st0, 0); /* rank 1 stays a zombie until rank 0 is done */
  waitpid(p1, &st1, 0);
  int bad = !WIFEXITED(st0) || WEXITSTATUS(st0) != 0;
  printf("%s dead peer noticed %s\n", bad ? "FAIL" : "ok  ", shm ? "shm" : "socket");
  return bad;
}

static int run_world(int n, int shm) {
  int port = free_port();
  if (!shm) setenv("CHORUS_SHM_DISABLE", "1", 1);
  else unsetenv("CHORUS_SHM_DISABLE");
  pid_t pids[16];
  fflush(stdout); /* nothing buffered is copied into the children */
  for (int r = 0; r < n; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      int rc = rank_main(r, n, port);
      if (getenv("TEST_CHILD_EXIT")) exit(rc); /* lets LeakSanitizer run */
      _exit(rc);
    }
  }
  int bad = 0;
  for (int r = 0; r < n; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) bad = 1;
  }
  printf("%s world %d %s\n", bad ? "FAIL" : "ok  ", n, shm ? "shm" : "socket");
  return bad;
}

int main(void) {
  int passed = 0, failed = 0;
  setenv("CHORUS_SOCKET_IFNAME", "=lo", 1); /* tests talk over loopback only */
  const char *only = getenv("TEST_COMM_ONLY"); /* e.g. "socket:2" to debug one world */
  for (int shm = 1; shm >= 0; shm--)
    for (int n = 1; n <= 4; n++) {
      if (only) {
        char want[32];
        snprintf(want, sizeof want, "%s:%d", shm ? "shm" : "socket", n);
        if (strcmp(only, want) != 0) continue;
      }
      if (run_world(n, shm)) failed++;
      else passed++;
    }
  if (!only)
    for (int shm = 1; shm >= 0; shm--) {
      if (run_dead_peer(shm)) failed++;
      else passed++;
    }
  /* the path of hosts with cores to spare, which a 2-core machine never takes by itself:
   * engines spin before they sleep and chorus_wait polls the request before it does */
  if (!only) {
    setenv("CHORUS_SPIN_COUNT", "2000", 1);
    printf("with CHORUS_SPIN_COUNT=2000:\n");
    for (int shm = 1; shm >= 0; shm--) {
      if (run_world(3, shm)) failed++;
      else passed++;
      if (run_dead_peer(shm)) failed++;
      else passed++;
    }
    unsetenv("CHORUS_SPIN_COUNT");
    /* big socket payloads through I/O threads: 2 threads (3 and 4 ranks: one serves two
     * peers), then 1 (one thread serves every peer, both directions) */
    for (int t = 2; t >= 1; t--) {
      char v[8];
      snprintf(v, sizeof v, "%d", t);
      setenv("CHORUS_SOCKET_THREADS", v, 1);
      printf("with CHORUS_SOCKET_THREADS=%d:\n", t);
      for (int n = 2; n <= 4; n++) {
        if (run_world(n, 0)) failed++;
        else passed++;
      }
      if (run_dead_mid_payload()) failed++;
      else passed++;
    }
    unsetenv("CHORUS_SOCKET_THREADS");
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
