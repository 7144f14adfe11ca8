/* test_trace.c - the flight recorder through the C API: two forked ranks over shared memory
 * with a ring of 4 entries run 6 all_reduce calls and a send/recv while a thread dumps the
 * record again and again (the lock-free ring read beside the engine's writes: TSan covers
 * it); the record then holds the last 4 operations with their fields and the job-wide ranks;
 * finally rank 1 stops calling and rank 0's all_reduce times out: its record (reason
 * "timeout", the op failed) is on disk by the time chorus_wait returns, and rank 1, idle,
 * writes its own when it sees rank 0's failure notice (reason "peer 0 failed"). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chorus.h"
#include "expect.h"
#include "free_port.h"

static char *slurp(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return NULL;
  static char buf[1 << 16];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = 0;
  fclose(f);
  return buf;
}

static char g_dump_dir[512];
static chorus_comm_t *g_comm;
static atomic_int g_stop;
static atomic_int g_dumps;

static void *dumper(void *arg) {
  (void)arg;
  while (!atomic_load(&g_stop)) {
    char path[1024];
    if (chorus_trace_dump(g_comm, g_dump_dir, "concurrent", path, sizeof path) == CHORUS_SUCCESS)
      atomic_fetch_add(&g_dumps, 1);
  }
  return NULL;
}

static int rank_main(int rank, int port, const char *dir) {
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  chorus_bootstrap_t bs;
  if (chorus_bootstrap_tcp(addr, rank, 2, 20000, &bs) != CHORUS_SUCCESS) return 1;
  chorus_comm_t *c;
  chorus_comm_options_t o = {20000, "trace test"};
  if (chorus_comm_create(rank, 2, &bs, &o, &c) != CHORUS_SUCCESS) {
    fprintf(stderr, "rank %d: create: %s\n", rank, chorus_comm_error(NULL));
    return 1;
  }
  int global[2] = {10, 11};
  EXPECT(chorus_comm_set_global_ranks(c, global, 2) == CHORUS_SUCCESS, "set_global_ranks");
  g_comm = c;
  snprintf(g_dump_dir, sizeof g_dump_dir, "%s/concurrent", dir);
  pthread_t th;
  pthread_create(&th, NULL, dumper, NULL);
  /* the calls below take well under a millisecond: let the dumper get going first (a loaded
   * 2-core machine under ASan may not schedule the thread before they are all done) */
  for (int i = 0; i < 20000 && atomic_load(&g_dumps) == 0; i++) usleep(500);
  chorus_redop_t sum = {CHORUS_SUM, 1.0};
  for (int i = 0; i < 6; i++) {
    float x[3] = {1, 2, 3};
    chorus_request_t *req;
    EXPECT(chorus_iallreduce(c, x, x, 3, CHORUS_FLOAT32, sum, &req) == CHORUS_SUCCESS, "ar");
    EXPECT(chorus_wait(req, -1) == CHORUS_SUCCESS && x[2] == 6.f, "all_reduce %d", i);
    chorus_request_free(req);
  }
  int32_t v[5] = {7, 7, 7, 7, 7};
  chorus_request_t *req;
  if (rank == 0) EXPECT(chorus_isend(c, v, 5, CHORUS_INT32, 1, 9, &req) == CHORUS_SUCCESS, "send");
  else EXPECT(chorus_irecv(c, v, 5, CHORUS_INT32, 0, 9, &req) == CHORUS_SUCCESS, "recv");
  EXPECT(chorus_wait(req, -1) == CHORUS_SUCCESS, "p2p");
  chorus_request_free(req);
  atomic_store(&g_stop, 1);
  pthread_join(th, NULL);
  EXPECT(atomic_load(&g_dumps) > 0, "no concurrent dump succeeded");

  char path[1024];
  EXPECT(chorus_trace_dump(c, NULL, "unit", path, sizeof path) == CHORUS_SUCCESS, "dump: %s",
         chorus_comm_error(NULL));
  char want[256];
  snprintf(want, sizeof want, "%s/chorus-trace.r%d.trace_test.%d.json", dir, 10 + rank,
           (int)getpid());
  EXPECT(strcmp(path, want) == 0, "path %s, expected %s", path, want);
  const char *j = slurp(path);
  EXPECT(j != NULL, "cannot read %s", path);
  if (j) {
    static const char *has[] = {
        "\"reason\": \"unit\"", "\"world\": 2", "\"global_ranks\": [10, 11]",
        "\"buffer_size\": 4", "\"recorded\": 7", "\"next_seq\": 6",
        "{\"id\": 3, \"seq\": 3, \"op\": \"all_reduce\", \"p2p\": false, \"count\": 3, "
        "\"bytes\": 12, \"dtype\": \"float32\", \"redop\": \"sum\"",
        "\"seq\": 5, \"op\": \"all_reduce\"", "\"state\": \"done\""};
    for (size_t k = 0; k < sizeof has / sizeof has[0]; k++)
      EXPECT(strstr(j, has[k]) != NULL, "rank %d: record lacks %s:\n%s", rank, has[k], j);
    EXPECT(strstr(j, "\"seq\": 2,") == NULL, "rank %d: seq 2 should have left the ring:\n%s",
           rank, j);
    snprintf(want, sizeof want, "\"seq\": 0, \"op\": \"%s\", \"p2p\": true, \"count\": 5, "
             "\"bytes\": 20, \"dtype\": \"int32\", \"redop\": null, \"peer\": %d, \"tag\": 9",
             rank == 0 ? "send" : "recv", 1 - rank);
    EXPECT(strstr(j, want) != NULL, "rank %d: record lacks %s:\n%s", rank, want, j);
  }

  /* rank 1 goes silent: rank 0 times out, and its record is there when the wait returns */
  if (rank == 0) {
    chorus_comm_set_timeout(c, 400);
    float x[3] = {1, 2, 3};
    EXPECT(chorus_iallreduce(c, x, x, 3, CHORUS_FLOAT32, sum, &req) == CHORUS_SUCCESS, "ar");
    EXPECT(chorus_wait(req, -1) == CHORUS_ERR_TIMEOUT, "expected a timeout");
    chorus_request_free(req);
    j = slurp(path);
    EXPECT(j && strstr(j, "\"reason\": \"timeout\"") && strstr(j, "\"failed\": true") &&
               strstr(j, "\"seq\": 6, \"op\": \"all_reduce\"") &&
               strstr(j, "\"state\": \"failed\", \"result\": \"timed out\""),
           "failure record:\n%s", j ? j : "(none)");
  } else {
    /* idle meanwhile: the engine's watch sees rank 0's failure notice and writes (polled for
     * up to 30 s: slow under valgrind) */
    for (int i = 0; i < 300; i++) {
      j = slurp(path);
      if (j && strstr(j, "\"reason\": \"peer 0 failed\"")) break;
      usleep(100000);
    }
    EXPECT(j && strstr(j, "\"reason\": \"peer 0 failed\"") && strstr(j, "\"failed\": false"),
           "rank 1's record after rank 0 failed:\n%s", j ? j : "(none)");
  }
  chorus_comm_destroy(c);
  if (bs.release) bs.release(bs.ctx);
  printf("test_trace rank %d: %d checks, %d failed\n", rank, checks, failures);
  fflush(stdout);
  return failures ? 1 : 0;
}

int main(void) {
  char dir[] = "/tmp/chorus-trace-test.XXXXXX";
  if (!mkdtemp(dir)) return 1;
  setenv("CHORUS_SOCKET_IFNAME", "=lo", 1);
  setenv("CHORUS_TRACE_BUFFER_SIZE", "4", 1);
  setenv("CHORUS_TRACE_DIR", dir, 1);
  int port = free_port();
  fflush(stdout);
  pid_t pids[2];
  for (int r = 0; r < 2; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      int rc = rank_main(r, port, dir);
      if (getenv("TEST_CHILD_EXIT")) exit(rc);
      _exit(rc);
    }
  }
  int bad = 0;
  for (int r = 0; r < 2; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) bad = 1;
  }
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) bad = 1;
  printf("test_trace: %s\n", bad ? "FAILED" : "passed");
  return bad;
}
