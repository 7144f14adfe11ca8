/* test_socket.c - tests of the TCP bootstrap (chorus_bootstrap_tcp with 3 forked ranks on
 * 127.0.0.1: blocking gets, large values, timeouts, malformed frames from raw sockets) and
 * of the SOCKET_IFNAME matcher. Prints "N passed, M failed"; exits non-zero on failure. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "transport/socket_ifname.h"
#include "free_port.h"

/* Weak stand-ins so this test links before (or without) log.c and param.c; the real
 * definitions win when linked. */
__attribute__((weak)) void chorus_log(int level, int subsys, int rank, const char *fmt, ...) {
  (void)subsys;
  if (level > LOG_WARN && !getenv("TEST_VERBOSE")) return;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "[test log %d rank %d] ", level, rank);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}
__attribute__((weak)) int chorus_log_enabled(int level, int subsys) {
  (void)subsys;
  return level <= LOG_WARN || getenv("TEST_VERBOSE") != NULL;
}
__attribute__((weak)) int64_t param_int(enum param_id id) {
  (void)id;
  return 0;
}
__attribute__((weak)) const char *param_str(enum param_id id) {
  (void)id;
  return "";
}

/* engine.c: the socket transport's I/O threads ring the engine when a payload is done;
 * without an engine there is nobody to wake (callers here poll). */
__attribute__((weak)) void engine_wake(struct chorus_comm *comm) { (void)comm; }

/* socket.c (linked for ifname_matches) reports errors through this. */
__attribute__((weak)) chorus_result_t comm_set_error(struct chorus_comm *comm,
                                                     chorus_result_t res, const char *fmt, ...) {
  (void)comm;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return res;
}

static int g_pass, g_fail;
#define T(cond)                                                                   \
  do {                                                                            \
    if (cond) {                                                                   \
      g_pass++;                                                                   \
    } else {                                                                      \
      g_fail++;                                                                   \
      fprintf(stderr, "FAIL [pid %d] %s:%d: %s\n", (int)getpid(), __FILE__, __LINE__, #cond); \
    }                                                                             \
  } while (0)

static int64_t ms_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}
static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------ ifname matcher */
static void test_ifname(void) {
  T(ifname_matches("eth", "eth0") == 1);
  T(ifname_matches("eth", "ens3") == 0);
  T(ifname_matches("eth0", "eth") == 0);          /* prefix longer than the name */
  T(ifname_matches("^eth", "eth0") == 0);
  T(ifname_matches("^eth", "ens3") == 1);
  T(ifname_matches("=eth0", "eth0") == 1);
  T(ifname_matches("=eth0", "eth01") == 0);
  T(ifname_matches("=eth", "eth0") == 0);
  T(ifname_matches("eth,ib", "ib0") == 1);
  T(ifname_matches("eth,ib", "eth1") == 1);
  T(ifname_matches("eth,ib", "lo") == 0);
  T(ifname_matches("^docker,lo", "lo") == 0);
  T(ifname_matches("^docker,lo", "docker0") == 0);
  T(ifname_matches("^docker,lo", "eth0") == 1);
  T(ifname_matches("^=eth0,eth1", "eth0") == 0);
  T(ifname_matches("^=eth0,eth1", "eth10") == 1);
  T(ifname_matches("=eth0,ib0", "ib0") == 1);
  T(ifname_matches("=eth0,ib0", "ib") == 0);
  T(ifname_matches(" eth , ib ", "ib0") == 1);    /* blanks around entries */
  T(ifname_matches("", "anything") == 1);         /* empty list selects all */
  T(ifname_matches(",,", "anything") == 1);
  T(ifname_matches("^", "anything") == 1);
  T(ifname_matches(NULL, "eth0") == 0);
  T(ifname_matches("eth", NULL) == 0);
}

/* ------------------------------------------------------------ raw-socket helpers */
static void put64(uint8_t *p, uint64_t v) {
  put32(p, (uint32_t)(v >> 32));
  put32(p + 4, (uint32_t)v);
}

static int raw_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

static int raw_send(int fd, const void *b, size_t n) {
  return send(fd, b, n, MSG_NOSIGNAL) == (ssize_t)n ? 0 : -1;
}

/* 1 if the server closes fd within ms (EOF or reset), 0 if it stays open. */
static int closed_within(int fd, int ms) {
  struct pollfd p = {fd, POLLIN, 0};
  if (poll(&p, 1, ms) <= 0) return 0;
  char b[64];
  ssize_t r = recv(fd, b, sizeof b, 0);
  return r == 0 || (r < 0 && errno == ECONNRESET);
}

static void req_hdr(uint8_t *h, uint32_t magic, uint32_t op, uint32_t keylen, uint32_t tmo,
                    uint64_t vallen) {
  put32(h, magic);
  put32(h + 4, op);
  put32(h + 8, keylen);
  put32(h + 12, tmo);
  put64(h + 16, vallen);
}

/* Reads one response header; returns status or -1. */
static int raw_response(int fd, uint64_t *vl, int ms) {
  uint8_t r[16];
  size_t got = 0;
  while (got < 16) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, ms) <= 0) return -1;
    ssize_t n = recv(fd, r + got, 16 - got, 0);
    if (n <= 0) return -1;
    got += (size_t)n;
  }
  if (get32(r) != 0x43424b56u) return -1;
  *vl = (uint64_t)get32(r + 8) << 32 | get32(r + 12);
  return (int)get32(r + 4);
}

/* Malformed and hostile clients; the server must survive all of them. */
static void attack_server(int port, chorus_bootstrap_t *bs) {
  uint8_t h[24];
  int fd;

  fd = raw_connect(port); /* garbage magic */
  T(fd >= 0);
  memset(h, 'x', sizeof h);
  T(raw_send(fd, h, sizeof h) == 0);
  T(closed_within(fd, 3000));
  close(fd);

  fd = raw_connect(port); /* key too long */
  req_hdr(h, 0x43424b56u, 1, 5000, 0, 4);
  T(fd >= 0 && raw_send(fd, h, sizeof h) == 0);
  T(closed_within(fd, 3000));
  close(fd);

  fd = raw_connect(port); /* zero-length key */
  req_hdr(h, 0x43424b56u, 2, 0, 100, 0);
  T(fd >= 0 && raw_send(fd, h, sizeof h) == 0);
  T(closed_within(fd, 3000));
  close(fd);

  fd = raw_connect(port); /* value far above the cap */
  req_hdr(h, 0x43424b56u, 1, 3, 0, (uint64_t)1 << 40);
  T(fd >= 0 && raw_send(fd, h, sizeof h) == 0);
  T(closed_within(fd, 3000));
  close(fd);

  fd = raw_connect(port); /* value just above 64 MiB */
  req_hdr(h, 0x43424b56u, 1, 3, 0, ((uint64_t)64 << 20) + 1);
  T(fd >= 0 && raw_send(fd, h, sizeof h) == 0);
  T(closed_within(fd, 3000));
  close(fd);

  fd = raw_connect(port); /* GET carrying a value length */
  req_hdr(h, 0x43424b56u, 2, 3, 100, 7);
  T(fd >= 0 && raw_send(fd, h, sizeof h) == 0);
  T(closed_within(fd, 3000));
  close(fd);

  fd = raw_connect(port); /* unknown op */
  req_hdr(h, 0x43424b56u, 99, 3, 0, 0);
  T(fd >= 0 && raw_send(fd, h, sizeof h) == 0);
  T(closed_within(fd, 3000));
  close(fd);

  fd = raw_connect(port); /* half a header, then gone */
  req_hdr(h, 0x43424b56u, 1, 3, 0, 10);
  T(fd >= 0 && raw_send(fd, h, 10) == 0);
  close(fd);

  fd = raw_connect(port); /* SET cut off in the middle of its value */
  req_hdr(h, 0x43424b56u, 1, 3, 0, 100);
  T(fd >= 0 && raw_send(fd, h, sizeof h) == 0 && raw_send(fd, "cutabcd", 7) == 0);
  close(fd);

  fd = raw_connect(port); /* GET that waits, then its client vanishes */
  req_hdr(h, 0x43424b56u, 2, 7, 5000, 0);
  T(fd >= 0 && raw_send(fd, h, sizeof h) == 0 && raw_send(fd, "missing", 7) == 0);
  sleep_ms(50);
  close(fd);

  int silent = raw_connect(port); /* connects and says nothing, kept open */
  T(silent >= 0);

  for (int i = 0; i < 100; i++) { /* connection churn */
    int f = raw_connect(port);
    if (f >= 0) close(f);
  }

  /* A well-formed raw SET and GET, and a GET that times out on the server. */
  fd = raw_connect(port);
  T(fd >= 0);
  uint64_t vl = 99;
  req_hdr(h, 0x43424b56u, 1, 6, 0, 5);
  T(raw_send(fd, h, sizeof h) == 0 && raw_send(fd, "rawkey", 6) == 0 &&
    raw_send(fd, "12345", 5) == 0);
  T(raw_response(fd, &vl, 3000) == 0 && vl == 0);
  req_hdr(h, 0x43424b56u, 2, 6, 1000, 0);
  T(raw_send(fd, h, sizeof h) == 0 && raw_send(fd, "rawkey", 6) == 0);
  char v[8] = {0};
  T(raw_response(fd, &vl, 3000) == 0 && vl == 5 && recv(fd, v, 5, MSG_WAITALL) == 5 &&
    memcmp(v, "12345", 5) == 0);
  int64_t t0 = ms_now();
  req_hdr(h, 0x43424b56u, 2, 4, 150, 0);
  T(raw_send(fd, h, sizeof h) == 0 && raw_send(fd, "nope", 4) == 0);
  T(raw_response(fd, &vl, 3000) == 1 && vl == 0);
  T(ms_now() - t0 >= 140);
  close(fd);

  /* The real client still works while the silent connection is open. */
  char buf[16];
  size_t len = 0;
  T(bs->set(bs->ctx, "after-attack", "ok", 2) == CHORUS_SUCCESS);
  T(bs->get(bs->ctx, "rawkey", buf, sizeof buf, &len, 2000) == CHORUS_SUCCESS && len == 5 &&
    memcmp(buf, "12345", 5) == 0);
  close(silent);
}

/* ------------------------------------------------------------ 3-rank bootstrap test */
#define BIG (16u << 20)
static uint8_t big_pat(size_t i) { return (uint8_t)(i * 2654435761u >> 13); }

struct thr_arg {
  chorus_bootstrap_t *bs;
  int rank, id, errors;
};
static void *hammer(void *p) {
  struct thr_arg *a = p;
  for (int i = 0; i < 200; i++) {
    char k[64], v[64], got[64];
    size_t len = 0;
    snprintf(k, sizeof k, "thr-%d-%d-%d", a->rank, a->id, i);
    int n = snprintf(v, sizeof v, "value %d %d %d", a->rank, a->id, i);
    if (a->bs->set(a->bs->ctx, k, v, (size_t)n) != CHORUS_SUCCESS) a->errors++;
    if (a->bs->get(a->bs->ctx, k, got, sizeof got, &len, 2000) != CHORUS_SUCCESS ||
        len != (size_t)n || memcmp(got, v, (size_t)n) != 0)
      a->errors++;
  }
  return NULL;
}

static void rank_main(int rank, int port) {
  char addr[64], key[64], val[64], buf[256];
  size_t len = 0;
  chorus_bootstrap_t bs;
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  if (rank == 0) sleep_ms(300); /* the clients must retry until the server exists */
  T(chorus_bootstrap_tcp(addr, rank, 3, 20000, &bs) == CHORUS_SUCCESS);
  if (g_fail) return;

  /* get before set, from another rank. Rank 2 starts its 400 ms only once rank 1 says it is
   * about to ask (a fixed sleep from the bootstrap alone was not enough on a loaded machine:
   * rank 1 could reach its get after the set, and see no wait) */
  if (rank == 1) {
    int64_t t0 = ms_now();
    T(bs.set(bs.ctx, "asking", "1", 1) == CHORUS_SUCCESS);
    T(bs.get(bs.ctx, "late", buf, sizeof buf, &len, 10000) == CHORUS_SUCCESS);
    T(len == 5 && memcmp(buf, "hello", 5) == 0);
    T(ms_now() - t0 >= 150);
  } else if (rank == 2) {
    T(bs.get(bs.ctx, "asking", buf, sizeof buf, &len, 10000) == CHORUS_SUCCESS);
    sleep_ms(400);
    T(bs.set(bs.ctx, "late", "hello", 5) == CHORUS_SUCCESS);
  }

  /* every rank publishes and reads everyone's value */
  snprintf(key, sizeof key, "r%d", rank);
  int n = snprintf(val, sizeof val, "value-of-%d", rank);
  T(bs.set(bs.ctx, key, val, (size_t)n) == CHORUS_SUCCESS);
  for (int p = 0; p < 3; p++) {
    snprintf(key, sizeof key, "r%d", p);
    n = snprintf(val, sizeof val, "value-of-%d", p);
    T(bs.get(bs.ctx, key, buf, sizeof buf, &len, 10000) == CHORUS_SUCCESS);
    T(len == (size_t)n && memcmp(buf, val, (size_t)n) == 0);
  }

  /* large value */
  uint8_t *big = malloc(BIG);
  T(big != NULL);
  if (!big) return;
  if (rank == 2) {
    for (size_t i = 0; i < BIG; i++) big[i] = big_pat(i);
    T(bs.set(bs.ctx, "big", big, BIG) == CHORUS_SUCCESS);
  } else {
    memset(big, 0, BIG);
    T(bs.get(bs.ctx, "big", big, BIG, &len, 20000) == CHORUS_SUCCESS && len == BIG);
    size_t bad = 0;
    for (size_t i = 0; i < BIG; i++) bad += big[i] != big_pat(i);
    T(bad == 0);
    /* smaller buffer: truncated copy, full length reported, stream stays in sync */
    memset(buf, 0, sizeof buf);
    T(bs.get(bs.ctx, "big", buf, 100, &len, 1000) == CHORUS_SUCCESS && len == BIG);
    size_t bad2 = 0;
    for (size_t i = 0; i < 100; i++) bad2 += (uint8_t)buf[i] != big_pat(i);
    T(bad2 == 0 && buf[100] == 0);
    T(bs.get(bs.ctx, "r0", buf, sizeof buf, &len, 1000) == CHORUS_SUCCESS && len == 10);
  }
  free(big);

  /* timeout, then the connection is still usable */
  int64_t t0 = ms_now();
  T(bs.get(bs.ctx, "never-set", buf, sizeof buf, &len, 300) == CHORUS_ERR_TIMEOUT);
  int64_t dt = ms_now() - t0;
  T(dt >= 280 && dt < 5000);
  T(bs.get(bs.ctx, "r1", buf, sizeof buf, &len, 1000) == CHORUS_SUCCESS && len == 10);

  /* overwrite: the later value wins */
  snprintf(key, sizeof key, "ow%d", rank);
  T(bs.set(bs.ctx, key, "first", 5) == CHORUS_SUCCESS);
  T(bs.set(bs.ctx, key, "second!", 7) == CHORUS_SUCCESS);
  T(bs.get(bs.ctx, key, buf, sizeof buf, &len, 1000) == CHORUS_SUCCESS && len == 7 &&
    memcmp(buf, "second!", 7) == 0);
  /* empty value */
  snprintf(key, sizeof key, "empty%d", rank);
  T(bs.set(bs.ctx, key, NULL, 0) == CHORUS_SUCCESS);
  len = 99;
  T(bs.get(bs.ctx, key, buf, sizeof buf, &len, 1000) == CHORUS_SUCCESS && len == 0);

  /* bad arguments are refused on the client side */
  char longkey[2000];
  memset(longkey, 'k', sizeof longkey - 1);
  longkey[sizeof longkey - 1] = 0;
  T(bs.set(bs.ctx, "", "x", 1) == CHORUS_ERR_INVALID);
  T(bs.set(bs.ctx, longkey, "x", 1) == CHORUS_ERR_INVALID);
  T(bs.set(bs.ctx, NULL, "x", 1) == CHORUS_ERR_INVALID);
  T(bs.set(bs.ctx, "k", buf, ((size_t)64 << 20) + 1) == CHORUS_ERR_INVALID);
  T(bs.set(bs.ctx, "k", NULL, 5) == CHORUS_ERR_INVALID);
  T(bs.get(bs.ctx, longkey, buf, sizeof buf, &len, 100) == CHORUS_ERR_INVALID);
  T(bs.set(bs.ctx, "still-fine", "y", 1) == CHORUS_SUCCESS);

  /* threads sharing one client */
  pthread_t th[3];
  struct thr_arg ta[3];
  for (int i = 0; i < 3; i++) {
    ta[i] = (struct thr_arg){&bs, rank, i, 0};
    T(pthread_create(&th[i], NULL, hammer, &ta[i]) == 0);
  }
  for (int i = 0; i < 3; i++) {
    pthread_join(th[i], NULL);
    T(ta[i].errors == 0);
  }

  if (rank == 0) attack_server(port, &bs);
  /* other ranks see what rank 0 set after the attack */
  T(bs.get(bs.ctx, "after-attack", buf, sizeof buf, &len, 20000) == CHORUS_SUCCESS &&
    len == 2);

  /* barrier, so rank 0 stops the server only after everyone is done */
  snprintf(key, sizeof key, "done%d", rank);
  T(bs.set(bs.ctx, key, "1", 1) == CHORUS_SUCCESS);
  for (int p = 0; p < 3; p++) {
    snprintf(key, sizeof key, "done%d", p);
    T(bs.get(bs.ctx, key, buf, sizeof buf, &len, 20000) == CHORUS_SUCCESS);
  }
  if (rank != 0) {
    snprintf(key, sizeof key, "bye%d", rank);
    T(bs.set(bs.ctx, key, "1", 1) == CHORUS_SUCCESS);
    bs.release(bs.ctx);
    return;
  }
  for (int p = 1; p < 3; p++) {
    snprintf(key, sizeof key, "bye%d", p);
    T(bs.get(bs.ctx, key, buf, sizeof buf, &len, 20000) == CHORUS_SUCCESS);
  }
  bs.release(bs.ctx);
  int fd = raw_connect(port); /* the server is gone after release */
  T(fd < 0);
  if (fd >= 0) close(fd);
}

static void test_bootstrap_multi(void) {
  int port = free_port();
  T(port > 0);
  if (port <= 0) return;
  int pipes[3][2];
  pid_t pids[3];
  for (int r = 0; r < 3; r++) {
    if (pipe(pipes[r]) != 0) {
      T(0);
      return;
    }
    pids[r] = fork();
    if (pids[r] == 0) {
      close(pipes[r][0]);
      g_pass = g_fail = 0;
      alarm(120); /* a hang must not stall the test run forever */
      rank_main(r, port);
      int counts[2] = {g_pass, g_fail};
      if (write(pipes[r][1], counts, sizeof counts) != (ssize_t)sizeof counts) _exit(3);
      if (getenv("TEST_CHILD_EXIT")) exit(g_fail ? 1 : 0); /* lets LeakSanitizer run */
      _exit(g_fail ? 1 : 0);
    }
    close(pipes[r][1]);
    T(pids[r] > 0);
  }
  for (int r = 0; r < 3; r++) {
    int counts[2] = {0, 0}, st = 0;
    ssize_t n = read(pipes[r][0], counts, sizeof counts);
    close(pipes[r][0]);
    if (pids[r] > 0) waitpid(pids[r], &st, 0);
    if (n != (ssize_t)sizeof counts) {
      fprintf(stderr, "FAIL rank %d died (status 0x%x)\n", r, st);
      g_fail++;
      continue;
    }
    g_pass += counts[0];
    g_fail += counts[1];
    /* a child's exit status counts too: valgrind and LeakSanitizer report at exit */
    T(WIFEXITED(st) && (WEXITSTATUS(st) == 0 || counts[1] != 0));
  }
}

static void test_bootstrap_single(void) {
  chorus_bootstrap_t bs;
  char buf[16];
  size_t len = 0;
  /* bad arguments */
  T(chorus_bootstrap_tcp("127.0.0.1:0", 0, 2, 1000, &bs) == CHORUS_ERR_INVALID);
  T(chorus_bootstrap_tcp("nocolon", 0, 1, 1000, &bs) == CHORUS_ERR_INVALID);
  T(chorus_bootstrap_tcp("127.0.0.1:99999", 0, 1, 1000, &bs) == CHORUS_ERR_INVALID);
  T(chorus_bootstrap_tcp("127.0.0.1:12x", 0, 1, 1000, &bs) == CHORUS_ERR_INVALID);
  T(chorus_bootstrap_tcp(":1234", 0, 1, 1000, &bs) == CHORUS_ERR_INVALID);
  T(chorus_bootstrap_tcp("127.0.0.1:1234", 2, 2, 1000, &bs) == CHORUS_ERR_INVALID);
  T(chorus_bootstrap_tcp("127.0.0.1:1234", -1, 2, 1000, &bs) == CHORUS_ERR_INVALID);
  T(chorus_bootstrap_tcp(NULL, 0, 1, 1000, &bs) == CHORUS_ERR_INVALID);
  /* a single rank may use port 0 */
  T(chorus_bootstrap_tcp("127.0.0.1:0", 0, 1, 5000, &bs) == CHORUS_SUCCESS);
  T(bs.set(bs.ctx, "a", "b", 1) == CHORUS_SUCCESS);
  T(bs.get(bs.ctx, "a", buf, sizeof buf, &len, 1000) == CHORUS_SUCCESS && len == 1);
  bs.release(bs.ctx);
  /* a second server on a port in use fails cleanly */
  int port = free_port();
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  chorus_bootstrap_t a, b;
  T(chorus_bootstrap_tcp(addr, 0, 2, 5000, &a) == CHORUS_SUCCESS);
  T(chorus_bootstrap_tcp(addr, 0, 2, 5000, &b) == CHORUS_ERR_SYSTEM);
  a.release(a.ctx);
  /* nobody serving: a client gives up after its timeout */
  int64_t t0 = ms_now();
  T(chorus_bootstrap_tcp(addr, 1, 2, 400, &b) == CHORUS_ERR_TIMEOUT);
  T(ms_now() - t0 >= 350);
}

/* Rank 0's release serves the ranks still connected until they release theirs, at most
 * about a second (BS_LINGER_MS), and takes no new client meanwhile. The child is rank 1:
 * it waits until rank 0 is about to release, stays stay_ms, then (unless it stays past the
 * linger) uses the store once more and releases. */
static void linger_child(int port, int stay_ms, int wfd) {
  g_pass = g_fail = 0;
  alarm(60);
  chorus_bootstrap_t bs;
  char addr[64], buf[8];
  size_t len = 0;
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  T(chorus_bootstrap_tcp(addr, 1, 2, 10000, &bs) == CHORUS_SUCCESS);
  T(bs.set(bs.ctx, "up", "1", 1) == CHORUS_SUCCESS);
  T(bs.get(bs.ctx, "releasing", buf, sizeof buf, &len, 10000) == CHORUS_SUCCESS);
  sleep_ms(stay_ms);
  int fd = raw_connect(port); /* rank 0 is releasing (or done): no new clients */
  T(fd < 0);
  if (fd >= 0) close(fd);
  if (stay_ms < 500) { /* still served */
    T(bs.set(bs.ctx, "late", "22", 2) == CHORUS_SUCCESS);
    T(bs.get(bs.ctx, "late", buf, sizeof buf, &len, 1000) == CHORUS_SUCCESS && len == 2);
  } else { /* the linger ran out: the server is gone */
    fprintf(stderr, "(a warning that the server closed the connection is expected next)\n");
    T(bs.set(bs.ctx, "late", "22", 2) != CHORUS_SUCCESS);
  }
  bs.release(bs.ctx);
  int counts[2] = {g_pass, g_fail};
  if (write(wfd, counts, sizeof counts) != (ssize_t)sizeof counts) _exit(3);
  _exit(g_fail ? 1 : 0);
}

static void test_bootstrap_linger(int stay_ms, int64_t min_ms, int64_t max_ms) {
  int port = free_port(), p[2];
  T(port > 0 && pipe(p) == 0);
  if (port <= 0) return;
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    linger_child(port, stay_ms, p[1]);
  }
  close(p[1]);
  T(pid > 0);
  chorus_bootstrap_t bs;
  char addr[64], buf[8];
  size_t len = 0;
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  T(chorus_bootstrap_tcp(addr, 0, 2, 10000, &bs) == CHORUS_SUCCESS);
  T(bs.get(bs.ctx, "up", buf, sizeof buf, &len, 10000) == CHORUS_SUCCESS);
  T(bs.set(bs.ctx, "releasing", "1", 1) == CHORUS_SUCCESS);
  int64_t t0 = ms_now();
  bs.release(bs.ctx);
  int64_t took = ms_now() - t0;
  T(took >= min_ms && took <= max_ms);
  if (took < min_ms || took > max_ms)
    fprintf(stderr, "release took %lld ms, expected %lld..%lld (child stays %d ms)\n",
            (long long)took, (long long)min_ms, (long long)max_ms, stay_ms);
  int fd = raw_connect(port); /* gone after release */
  T(fd < 0);
  if (fd >= 0) close(fd);
  int counts[2] = {0, 0}, st = 0;
  ssize_t n = read(p[0], counts, sizeof counts);
  close(p[0]);
  if (pid > 0) waitpid(pid, &st, 0);
  T(n == (ssize_t)sizeof counts && WIFEXITED(st) && WEXITSTATUS(st) == 0);
  g_pass += counts[0];
  g_fail += counts[1];
}

int main(void) {
  signal(SIGPIPE, SIG_DFL); /* the library must never raise it */
  test_ifname();
  test_bootstrap_single();
  test_bootstrap_multi();
  test_bootstrap_linger(300, 250, 950);   /* the child releases after 300 ms: served */
  test_bootstrap_linger(2000, 900, 1900); /* the child stays connected: 1 s at most */
  printf("test_socket: %d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
