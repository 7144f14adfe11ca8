/* test_socket_conn.c - end-to-end test of the socket transport without the engine:
 * forked ranks with hand-filled communicators run socket_listen / socket_connect_all,
 * move data through reserve/commit/progress/peek/consume, see peers die, and reject
 * strangers; over one TCP connection per peer and striped over several, IPv4 (127.0.0.1)
 * and IPv6 (::1). Loopback only. Prints "N passed, M failed". Optional argv[1]: MiB for
 * the throughput runs (0 skips them). */
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

/* engine.c: the socket transport's I/O threads ring the engine when a payload is done;
 * without an engine there is nobody to wake (callers here poll). */
__attribute__((weak)) void engine_wake(struct chorus_comm *comm) { (void)comm; }

/* Weak stand-ins for comm.c, log.c and param.c (real definitions win when linked). */
__attribute__((weak)) chorus_result_t comm_set_error(struct chorus_comm *comm,
                                                     chorus_result_t res, const char *fmt, ...) {
  if (comm && comm->err == CHORUS_SUCCESS) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(comm->errbuf, sizeof comm->errbuf, fmt, ap);
    va_end(ap);
    comm->err = res;
    if (getenv("TEST_VERBOSE")) fprintf(stderr, "[comm error] %s\n", comm->errbuf);
  }
  return res;
}
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
static const char *env_param(enum param_id id) {
  const char *n = id == PARAM_BUFFSIZE ? "BUFFSIZE"
                  : id == PARAM_SOCKET_IFNAME ? "SOCKET_IFNAME"
                  : id == PARAM_SOCKET_SNDBUF ? "SOCKET_SNDBUF"
                  : id == PARAM_SOCKET_FAMILY ? "SOCKET_FAMILY"
                  : id == PARAM_NSOCKS_PERTHREAD ? "NSOCKS_PERTHREAD"
                                              : NULL;
  char k[64];
  if (!n) return NULL;
  snprintf(k, sizeof k, "CHORUS_%s", n);
  return getenv(k);
}
__attribute__((weak)) int64_t param_int(enum param_id id) {
  const char *v = env_param(id);
  if (v) return strtoll(v, NULL, 0);
  return id == PARAM_BUFFSIZE ? 4 << 20 : id == PARAM_NSOCKS_PERTHREAD ? -1 : 0;
}
__attribute__((weak)) const char *param_str(enum param_id id) {
  const char *v = env_param(id);
  return v ? v : "";
}
__attribute__((weak)) void param_reset_cache(void) {}

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
static int full_io(int fd, void *b, size_t n, int wr) {
  uint8_t *p = b;
  while (n) {
    ssize_t r = wr ? write(fd, p, n) : read(fd, p, n);
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      return -1;
    }
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

static const uint8_t SECRET[32] = {7,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10,
                                   11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                   22, 23, 24, 25, 26, 27, 28, 29, 30, 31};

static struct chorus_comm *make_comm(int rank, int nranks, int timeout_ms) {
  struct chorus_comm *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->rank = rank;
  c->nranks = nranks;
  c->timeout_ms = timeout_ms;
  memcpy(c->secret, SECRET, 32);
  c->peers = calloc((size_t)nranks, sizeof *c->peers);
  for (int ch = 0; ch < CHAN_COUNT; ch++) c->conns[ch] = calloc((size_t)nranks, sizeof(conn_t *));
  pthread_mutex_init(&c->err_mu, NULL);
  return c;
}

static void free_comm(struct chorus_comm *c) {
  for (int ch = 0; ch < CHAN_COUNT; ch++) {
    for (int p = 0; p < c->nranks; p++)
      if (c->conns[ch][p]) {
        c->conns[ch][p]->ops->close(c->conns[ch][p]);
        c->conns[ch][p] = NULL;
      }
    free(c->conns[ch]);
  }
  socket_teardown(c);
  socket_teardown(c); /* must be harmless */
  pthread_mutex_destroy(&c->err_mu);
  free(c->peers);
  free(c);
}

/* ------------------------------------------------------------ data movement */
/* The ring size socket.c derives from BUFFSIZE (multiple of 4096, at least 64 KiB). */
static size_t ring_bytes(void) {
  int64_t v = param_int(PARAM_BUFFSIZE);
  size_t s = v < 65536 ? 65536 : (size_t)v;
  return (s + 4095) & ~(size_t)4095;
}

static uint8_t pat(uint64_t off, int src, int dst, int ch) {
  return (uint8_t)(off * 131u + (off >> 11) + (uint64_t)src * 7 + (uint64_t)dst * 13 +
                   (uint64_t)ch * 29);
}

struct stream {
  conn_t *c;
  uint64_t sent, recvd, total;
  size_t bad, misaligned;
  /* a direct write in progress (write_direct): its buffer holds the pattern of stream
   * positions [dstart, dstart + dlen); once begun it is written to its end */
  uint8_t *dsrc;
  uint64_t dstart, dlen;
  size_t ndirect;
};
#define DIRECT_MAX 300000

/* The tx ring is empty exactly when pollfd() asks for no POLLOUT (the engine relies on
 * this before it sleeps). */
static int tx_drained(conn_t *c) {
  struct pollfd pfd;
  return c->ops->pollfd(c, &pfd) == 1 && !(pfd.events & POLLOUT);
}

/* Every stream sends and receives `total` bytes of the pattern, in odd-sized pieces so
 * ring wrap-around is hit at many offsets. Returns 0 on success. */
static int pump_streams(struct chorus_comm *comm, struct stream *st, int n, int timeout_ms) {
  int64_t end = ms_now() + timeout_ms;
  unsigned iter = 0;
  for (;;) {
    int done = 1, any = 0;
    for (int i = 0; i < n; i++) {
      struct stream *s = &st[i];
      conn_t *c = s->c;
      int me = comm->rank, peer = c->peer, ch = c->channel;
      void *wp;
      const void *rp;
      size_t len;
      /* every fifth piece (when the transport has it) a direct write of up to DIRECT_MAX */
      if (s->sent < s->total && c->ops->write_direct && !s->dlen && iter % 5 == 0) {
        if (!s->dsrc && !(s->dsrc = malloc(DIRECT_MAX))) return -1;
        uint64_t l = 1 + (iter * 2654435761u + (unsigned)i * 40503u) % DIRECT_MAX;
        if (l > s->total - s->sent) l = s->total - s->sent;
        for (uint64_t k = 0; k < l; k++) s->dsrc[k] = pat(s->sent + k, me, peer, ch);
        s->dstart = s->sent;
        s->dlen = l;
        s->ndirect++;
      }
      if (s->dlen) {
        size_t w = 0;
        int prog = 0;
        uint64_t off = s->sent - s->dstart;
        if (c->ops->write_direct(c, s->dsrc + off, (size_t)(s->dlen - off), &w, &prog) !=
            CHORUS_SUCCESS)
          return -1;
        s->sent += w;
        any |= prog;
        if (s->sent == s->dstart + s->dlen) s->dlen = 0;
      } else if (s->sent < s->total) {
        if (c->ops->reserve(c, &wp, &len) != CHORUS_SUCCESS) return -1;
        size_t lim = 1 + (iter * 7919u + (unsigned)i * 104729u) % 70000u;
        if (len > lim) len = lim;
        if (len > s->total - s->sent) len = (size_t)(s->total - s->sent);
        /* core.h alignment contract: ring index == stream position mod 16 (the rings are
         * malloc'd, hence 16-byte aligned) */
        if (len && (uintptr_t)wp % 16 != s->sent % 16) s->misaligned++;
        for (size_t k = 0; k < len; k++) ((uint8_t *)wp)[k] = pat(s->sent + k, me, peer, ch);
        if (len && c->ops->commit(c, len) != CHORUS_SUCCESS) return -1;
        s->sent += len;
      }
      int prog = 0;
      if (c->ops->progress(c, &prog) != CHORUS_SUCCESS) return -1;
      any |= prog;
      if (s->recvd < s->total) {
        if (c->ops->peek(c, &rp, &len) != CHORUS_SUCCESS) return -1;
        if (len > s->total - s->recvd) len = (size_t)(s->total - s->recvd);
        if (len && (uintptr_t)rp % 16 != s->recvd % 16) s->misaligned++;
        size_t lim = 1 + (iter * 104729u + (unsigned)i * 7919u) % 90000u;
        if (len > lim) len = lim;
        for (size_t k = 0; k < len; k++)
          s->bad += ((const uint8_t *)rp)[k] != pat(s->recvd + k, peer, me, ch);
        if (len && c->ops->consume(c, len) != CHORUS_SUCCESS) return -1;
        s->recvd += len;
      }
      if (s->sent < s->total || s->recvd < s->total || s->dlen) done = 0;
      /* finished only once our tx ring has drained into the kernel */
      if (!tx_drained(c)) done = 0;
    }
    if (done) return 0;
    if (ms_now() > end) {
      fprintf(stderr, "rank %d: pump timed out\n", comm->rank);
      return -1;
    }
    iter++;
    if (!any) {
      struct pollfd pfd[16];
      int np = 0;
      for (int i = 0; i < n && np < 16; i++)
        if (st[i].c->ops->pollfd(st[i].c, &pfd[np])) np++;
      poll(pfd, (nfds_t)np, 50);
    }
  }
}

static int pump(struct chorus_comm *comm, struct stream *st, int n, int timeout_ms) {
  int r = pump_streams(comm, st, n, timeout_ms);
  for (int i = 0; i < n; i++) {
    free(st[i].dsrc);
    st[i].dsrc = NULL;
  }
  return r;
}

/* ------------------------------------------------------------ helpers for strangers */
static void make_hello_sub(uint8_t *h, const uint8_t *secret, int rank, int ch, int nranks,
                           int stream, int nstreams, uint32_t chunk) {
  put32(h, 0x43534b48u);
  put32(h + 4, 2);
  memcpy(h + 8, secret, 32);
  put32(h + 40, (uint32_t)rank);
  put32(h + 44, (uint32_t)ch);
  put32(h + 48, (uint32_t)nranks);
  put32(h + 52, (uint32_t)stream);
  put32(h + 56, (uint32_t)nstreams);
  put32(h + 60, chunk);
}
static void make_hello(uint8_t *h, const uint8_t *secret, int rank, int ch, int nranks) {
  make_hello_sub(h, secret, rank, ch, nranks, 0, 1, 0);
}

/* "127.0.0.1" or "::1", as the tests' SOCKET_FAMILY asks */
static int v6_mode(void) {
  const char *f = getenv("CHORUS_SOCKET_FAMILY");
  return f && strcmp(f, "AF_INET6") == 0;
}

static int parse_port(const char *addr) {
  const char *c = strrchr(addr, ':');
  return c ? atoi(c + 1) : -1;
}

static int loop_connect(int port) {
  int v6 = v6_mode();
  int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {0};
  struct sockaddr_in6 a6 = {0};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a6.sin6_family = AF_INET6;
  a6.sin6_port = htons((uint16_t)port);
  a6.sin6_addr = in6addr_loopback;
  struct sockaddr *sa = v6 ? (struct sockaddr *)&a6 : (struct sockaddr *)&a;
  socklen_t sl = v6 ? (socklen_t)sizeof a6 : (socklen_t)sizeof a;
  if (fd >= 0 && connect(fd, sa, sl) != 0) {
    close(fd);
    fd = -1;
  }
  return fd;
}

/* 1 if the peer closes fd within ms without sending anything first. */
static int closed_no_ack(int fd, int ms) {
  struct pollfd p = {fd, POLLIN, 0};
  if (poll(&p, 1, ms) <= 0) return 0;
  char b[16];
  ssize_t r = recv(fd, b, sizeof b, 0);
  return r == 0 || (r < 0 && errno == ECONNRESET);
}

/* ------------------------------------------------------------ child processes */
typedef void (*child_fn)(int rank, int rfd, int wfd, uint64_t bytes);

static void run_children(int nr, child_fn body, uint64_t bytes, int to_child[][2],
                         int from_child[][2], pid_t *pids) {
  for (int r = 0; r < nr; r++)
    if (pipe(to_child[r]) != 0 || pipe(from_child[r]) != 0) {
      perror("pipe");
      exit(2);
    }
  for (int r = 0; r < nr; r++) {
    pids[r] = fork();
    if (pids[r] < 0) {
      perror("fork");
      exit(2);
    }
    if (pids[r] == 0) {
      for (int q = 0; q < nr; q++) {
        close(to_child[q][1]);
        close(from_child[q][0]);
        if (q != r) {
          close(to_child[q][0]);
          close(from_child[q][1]);
        }
      }
      g_pass = g_fail = 0;
      alarm(120); /* a hang must not stall the test run forever */
      param_reset_cache();
      body(r, to_child[r][0], from_child[r][1], bytes);
      int counts[2] = {g_pass, g_fail};
      /* the counts go after everything the parent's protocol expects */
      if (full_io(from_child[r][1], counts, sizeof counts, 1) != 0) _exit(3);
      if (getenv("TEST_CHILD_EXIT")) exit(g_fail ? 1 : 0); /* lets LeakSanitizer run */
      _exit(g_fail ? 1 : 0);
    }
  }
  for (int r = 0; r < nr; r++) {
    close(to_child[r][0]);
    close(from_child[r][1]);
  }
}

static void collect(int nr, int from_child[][2], int to_child[][2], pid_t *pids) {
  for (int r = 0; r < nr; r++) {
    int counts[2] = {0, 0}, st = 0;
    int ok = full_io(from_child[r][0], counts, sizeof counts, 0) == 0;
    close(from_child[r][0]);
    close(to_child[r][1]);
    waitpid(pids[r], &st, 0);
    if (!ok) {
      fprintf(stderr, "FAIL child %d died (status 0x%x)\n", r, st);
      g_fail++;
      continue;
    }
    g_pass += counts[0];
    g_fail += counts[1];
    /* a child's exit status counts too: valgrind and LeakSanitizer report at exit */
    if (!WIFEXITED(st) || (WEXITSTATUS(st) != 0 && counts[1] == 0)) {
      fprintf(stderr, "FAIL child %d exited with status 0x%x\n", r, st);
      g_fail++;
    }
  }
}

/* ------------------------------------------------------------ 3-rank test */
#define NR 3
static void rank3_main(int rank, int rfd, int wfd, uint64_t bytes) {
  struct chorus_comm *comm = make_comm(rank, NR, 20000);
  struct peer_info me = {0};
  /* ranks 0 and 1 share a host (loopback rewrite); 2 is "remote" (advertised address) */
  snprintf(me.hostid, sizeof me.hostid, "%s", rank < 2 ? "hostA" : "hostB");
  snprintf(me.hostname, sizeof me.hostname, "%s", rank < 2 ? "nodeA" : "nodeB");
  me.pid = (int32_t)getpid();
  T(socket_listen(comm, &me) == CHORUS_SUCCESS);
  /* CHORUS_SOCKET_IFNAME is =lo */
  T(v6_mode() ? strncmp(me.sock_addr, "[::1]:", 6) == 0
              : strncmp(me.sock_addr, "127.0.0.1:", 10) == 0);
  struct peer_info again;
  T(socket_listen(comm, &again) == CHORUS_ERR_INTERNAL); /* twice is refused */
  T(comm->sock != NULL);
  comm->err = CHORUS_SUCCESS;
  comm->errbuf[0] = 0;
  T(full_io(wfd, &me, sizeof me, 1) == 0);
  T(full_io(rfd, comm->peers, NR * sizeof *comm->peers, 0) == 0);

  int64_t t0 = ms_now();
  chorus_result_t res = socket_connect_all(comm);
  T(res == CHORUS_SUCCESS);
  if (res != CHORUS_SUCCESS) fprintf(stderr, "rank %d: %s\n", rank, comm->errbuf);
  /* a stranger that sent nothing is pending at rank 0; it must not hold us up */
  T(ms_now() - t0 < 4000);
  struct stream st[2 * (NR - 1)];
  int n = 0;
  for (int p = 0; p < NR; p++)
    for (int ch = 0; ch < CHAN_COUNT; ch++) {
      conn_t *c = comm->conns[ch][p];
      if (p == rank) {
        T(c == NULL);
        continue;
      }
      T(c != NULL);
      if (!c) continue;
      T(strcmp(c->ops->name, "socket") == 0 && c->peer == p && c->channel == ch &&
        c->comm == comm);
      st[n++] = (struct stream){.c = c, .total = bytes};
    }
  /* running connect_all again finds nothing to do */
  T(socket_connect_all(comm) == CHORUS_SUCCESS);
  if (n == 2 * (NR - 1)) {
    T(pump(comm, st, n, 60000) == 0);
    for (int i = 0; i < n; i++)
      T(st[i].bad == 0 && st[i].recvd == bytes && st[i].misaligned == 0 && st[i].ndirect > 0);
  }
  T(comm->err == CHORUS_SUCCESS);
  char ok = 1;
  T(full_io(wfd, &ok, 1, 1) == 0); /* data phase done */
  T(full_io(rfd, &ok, 1, 0) == 0); /* everyone done: rank 2 leaves now */

  if (rank == 2) {
    free_comm(comm);
    return;
  }
  /* Rank 2 is gone. Its bytes sent before leaving were all read; an idle connection to
   * it is no error (nobody needs it), but a reader that wants bytes from it, or a writer
   * with bytes for it, gets CHORUS_ERR_PEER (and no SIGPIPE). */
  sleep_ms(200);
  for (int ch = 0; ch < CHAN_COUNT; ch++) {
    conn_t *c = comm->conns[ch][2];
    int prog = 1;
    for (int i = 0; i < 20; i++) T(c->ops->progress(c, &prog) == CHORUS_SUCCESS);
    T(prog == 1); /* progress sets the flag, never clears it: the engine ORs it */
    struct pollfd pfd;
    T(c->ops->pollfd(c, &pfd) == 1 && !(pfd.events & POLLIN)); /* EOF must not spin poll */
  }
  T(comm->err == CHORUS_SUCCESS);
  {
    conn_t *c = comm->conns[CHAN_COLL][2];
    const void *q;
    size_t len = 1;
    int prog = 5;
    T(c->ops->peek(c, &q, &len) == CHORUS_SUCCESS && len == 0);
    struct pollfd pfd;
    T(c->ops->pollfd(c, &pfd) == 1 && (pfd.events & POLLIN)); /* wakes the waiter */
    T(c->ops->progress(c, &prog) == CHORUS_ERR_PEER && prog == 5); /* never cleared */
    T(c->ops->progress(c, &prog) == CHORUS_ERR_PEER); /* sticky */
  }
  {
    conn_t *c = comm->conns[CHAN_P2P][2];
    chorus_result_t r = CHORUS_SUCCESS;
    int64_t end = ms_now() + 10000;
    while (r == CHORUS_SUCCESS && ms_now() < end) {
      void *p;
      size_t len;
      int prog;
      c->ops->reserve(c, &p, &len);
      if (len) {
        memset(p, 1, len);
        c->ops->commit(c, len);
      }
      r = c->ops->progress(c, &prog);
      if (r == CHORUS_SUCCESS && !prog) sleep_ms(1);
    }
    T(r == CHORUS_ERR_PEER);
  }
  T(comm->err == CHORUS_ERR_PEER);
  char wantaddr[200];
  snprintf(wantaddr, sizeof wantaddr, "connection to rank 2 (%s on nodeB) closed",
           comm->peers[2].sock_addr);
  T(strstr(comm->errbuf, wantaddr) != NULL);
  T(strstr(comm->errbuf, "closed: peer process exited or failed") != NULL);
  char want[32];
  snprintf(want, sizeof want, "rank %d peer 2", rank);
  T(strstr(comm->errbuf, want) != NULL);
  if (getenv("TEST_VERBOSE")) fprintf(stderr, "rank %d error: %s\n", rank, comm->errbuf);
  /* the link between 0 and 1 still works */
  struct stream s01[2] = {{.c = comm->conns[0][1 - rank], .total = 100000},
                          {.c = comm->conns[1][1 - rank], .total = 100000}};
  T(pump(comm, s01, 2, 20000) == 0 && s01[0].bad == 0 && s01[1].bad == 0);
  free_comm(comm);
}

static void test_three_ranks(uint64_t bytes) {
  int to[NR][2], from[NR][2];
  pid_t pids[NR];
  struct peer_info peers[NR];
  run_children(NR, rank3_main, bytes, to, from, pids);
  for (int r = 0; r < NR; r++) T(full_io(from[r][0], &peers[r], sizeof peers[r], 0) == 0);
  /* rank 0 starts accepting first; strangers knock while it does */
  T(full_io(to[0][1], peers, sizeof peers, 1) == 0);
  int port0 = parse_port(peers[0].sock_addr);
  int silent = loop_connect(port0);
  T(silent >= 0);
  uint8_t junk[SOCK_HELLO_LEN], wrong[32], hs[7][SOCK_HELLO_LEN];
  memset(junk, 'x', sizeof junk);
  memcpy(wrong, SECRET, 32);
  wrong[31] ^= 1;
  make_hello(hs[0], wrong, 1, 0, NR);      /* wrong secret */
  make_hello(hs[1], SECRET, 0, 0, NR);     /* rank 0 does not accept from itself */
  make_hello(hs[2], SECRET, 1, 0, NR + 2); /* different communicator size */
  make_hello(hs[3], SECRET, 2, 7, NR);     /* bad channel */
  make_hello_sub(hs[4], SECRET, 1, 0, NR, 2, 2, 8192);  /* sub-connection out of range */
  make_hello_sub(hs[5], SECRET, 1, 0, NR, 0, 17, 8192); /* too many sub-connections */
  make_hello_sub(hs[6], SECRET, 1, 0, NR, 0, 2, 100);   /* stripe too small */
  const uint8_t *bad[8] = {junk, hs[0], hs[1], hs[2], hs[3], hs[4], hs[5], hs[6]};
  for (int i = 0; i < 8; i++) {
    int fd = loop_connect(port0);
    T(fd >= 0);
    if (fd < 0) continue;
    T(send(fd, bad[i], SOCK_HELLO_LEN, MSG_NOSIGNAL) == SOCK_HELLO_LEN);
    T(closed_no_ack(fd, 5000));
    close(fd);
  }
  int half = loop_connect(port0); /* half a hello, then gone */
  if (half >= 0) {
    T(send(half, hs[1], 20, MSG_NOSIGNAL) == 20);
    close(half);
  }
  for (int r = 1; r < NR; r++) T(full_io(to[r][1], peers, sizeof peers, 1) == 0);
  char b;
  for (int r = 0; r < NR; r++) T(full_io(from[r][0], &b, 1, 0) == 0);
  for (int r = 0; r < NR; r++) T(full_io(to[r][1], &b, 1, 1) == 0);
  collect(NR, from, to, pids);
  if (silent >= 0) close(silent);
}

/* ------------------------------------------------------------ duplicates and timeout */
/* Rank 0 of 2 waits for rank 1, which the parent impersonates: one valid hello on the
 * coll channel (acked), a duplicate of it (rejected); on the p2p channel sub-connection 0
 * of 2 (acked), a duplicate of it and a sub-connection 1 with another stripe (both
 * rejected), so that connection never completes. */
static void dup_main(int rank, int rfd, int wfd, uint64_t bytes) {
  (void)rank;
  (void)bytes;
  struct chorus_comm *comm = make_comm(0, 2, 1500);
  struct peer_info me = {0};
  snprintf(me.hostid, sizeof me.hostid, "hostA");
  T(socket_listen(comm, &me) == CHORUS_SUCCESS);
  T(full_io(wfd, &me, sizeof me, 1) == 0);
  char go;
  T(full_io(rfd, &go, 1, 0) == 0);
  comm->peers[0] = me;
  int64_t t0 = ms_now();
  T(socket_connect_all(comm) == CHORUS_ERR_TIMEOUT);
  int64_t dt = ms_now() - t0;
  T(dt >= 1400 && dt < 4000);
  T(strstr(comm->errbuf, "timed out") != NULL && strstr(comm->errbuf, "from rank 1") != NULL);
  if (getenv("TEST_VERBOSE")) fprintf(stderr, "timeout error: %s\n", comm->errbuf);
  T(comm->conns[CHAN_COLL][1] != NULL && comm->conns[CHAN_P2P][1] != NULL); /* partial */
  free_comm(comm);
}

static void test_duplicate_and_timeout(void) {
  int to[1][2], from[1][2];
  pid_t pids[1];
  struct peer_info p0;
  run_children(1, dup_main, 0, to, from, pids);
  T(full_io(from[0][0], &p0, sizeof p0, 0) == 0);
  char go = 1;
  T(full_io(to[0][1], &go, 1, 1) == 0);
  int port = parse_port(p0.sock_addr);
  uint8_t h[SOCK_HELLO_LEN], ack[SOCK_ACK_LEN];
  make_hello(h, SECRET, 1, 0, 2);
  int a = loop_connect(port), b = loop_connect(port);
  T(a >= 0 && b >= 0);
  if (a >= 0 && b >= 0) {
    T(send(a, h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h);
    T(recv(a, ack, sizeof ack, MSG_WAITALL) == (ssize_t)sizeof ack);
    T(ack[0] == 'C' && ack[3] == 'A');
    T(send(b, h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h);
    T(closed_no_ack(b, 3000));
  }
  int sub[3];
  for (int i = 0; i < 3; i++) {
    sub[i] = loop_connect(port);
    T(sub[i] >= 0);
  }
  if (sub[0] >= 0 && sub[1] >= 0 && sub[2] >= 0) {
    make_hello_sub(h, SECRET, 1, 1, 2, 0, 2, 8192);
    T(send(sub[0], h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h);
    T(recv(sub[0], ack, sizeof ack, MSG_WAITALL) == (ssize_t)sizeof ack);
    T(ack[0] == 'C' && ack[3] == 'A' && get32(ack + 16) == 0);
    T(send(sub[1], h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h); /* same sub again */
    T(closed_no_ack(sub[1], 3000));
    make_hello_sub(h, SECRET, 1, 1, 2, 1, 2, 4096); /* another stripe */
    T(send(sub[2], h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h);
    T(closed_no_ack(sub[2], 3000));
  }
  collect(1, from, to, pids);
  for (int i = 0; i < 3; i++)
    if (sub[i] >= 0) close(sub[i]);
  if (a >= 0) close(a);
  if (b >= 0) close(b);
}

/* ------------------------------------------------------------ single process */
static void test_local(void) {
  /* default interface choice: some address is advertised (nothing connects to it) */
  unsetenv("CHORUS_SOCKET_IFNAME");
  param_reset_cache();
  struct chorus_comm *c = make_comm(0, 1, 1000);
  struct peer_info me = {0};
  T(socket_listen(c, &me) == CHORUS_SUCCESS && strchr(me.sock_addr, ':') != NULL);
  if (getenv("TEST_VERBOSE")) fprintf(stderr, "default advertised address: %s\n", me.sock_addr);
  T(socket_connect_all(c) == CHORUS_SUCCESS); /* one rank: nothing to connect */
  T(c->sock != NULL);
  free_comm(c);
  /* an interface list that matches nothing is an error naming the setting */
  setenv("CHORUS_SOCKET_IFNAME", "=no-such-if0", 1);
  param_reset_cache();
  c = make_comm(0, 2, 1000);
  T(socket_listen(c, &me) == CHORUS_ERR_INVALID && strstr(c->errbuf, "no-such-if0"));
  T(c->sock == NULL);
  free_comm(c);
  setenv("CHORUS_SOCKET_IFNAME", "=lo", 1);
  param_reset_cache();
  /* connect_all without a listener, when something must be accepted */
  c = make_comm(0, 2, 1000);
  T(socket_connect_all(c) == CHORUS_ERR_INTERNAL);
  free_comm(c);
  /* a peer whose advertised address is unusable */
  c = make_comm(1, 2, 1000);
  T(socket_connect_all(c) == CHORUS_ERR_INVALID && strstr(c->errbuf, "rank 1 peer 0"));
  free_comm(c);
}

/* ------------------------------------------------------------ throughput */
static void bench_main(int rank, int rfd, int wfd, uint64_t bytes) {
  struct chorus_comm *comm = make_comm(rank, 2, 20000);
  struct peer_info me = {0};
  snprintf(me.hostid, sizeof me.hostid, "hostA");
  T(socket_listen(comm, &me) == CHORUS_SUCCESS);
  T(full_io(wfd, &me, sizeof me, 1) == 0);
  T(full_io(rfd, comm->peers, 2 * sizeof *comm->peers, 0) == 0);
  T(socket_connect_all(comm) == CHORUS_SUCCESS);
  conn_t *c = comm->conns[CHAN_COLL][1 - rank];
  if (!c) return;
  /* rank 1 sends, rank 0 receives; this times the transport: the ring's bytes are written
   * only on its first laps (16 MiB), so that no uninitialised byte reaches send (valgrind) */
  int64_t t0 = ms_now();
  uint64_t moved = 0;
  int ok = 1;
  while (ok && moved < bytes) {
    void *p;
    const void *q;
    size_t len;
    int prog = 0;
    if (rank == 1) {
      c->ops->reserve(c, &p, &len);
      if (len > bytes - moved) len = (size_t)(bytes - moved);
      if (moved < (16u << 20)) memset(p, (int)(moved & 0xff), len);
      c->ops->commit(c, len);
      moved += len;
    }
    if (c->ops->progress(c, &prog) != CHORUS_SUCCESS) ok = 0;
    if (rank == 0) {
      c->ops->peek(c, &q, &len);
      c->ops->consume(c, len);
      moved += len;
    }
    if (!prog) {
      struct pollfd pfd;
      c->ops->pollfd(c, &pfd);
      poll(&pfd, 1, 100);
    }
  }
  /* flush what is still in the tx ring */
  while (ok && rank == 1 && !tx_drained(c)) {
    int prog = 0;
    if (c->ops->progress(c, &prog) != CHORUS_SUCCESS) ok = 0;
    if (!prog && !tx_drained(c)) {
      struct pollfd pfd;
      c->ops->pollfd(c, &pfd);
      poll(&pfd, 1, 100);
    }
  }
  int64_t dt = ms_now() - t0;
  T(ok && moved == bytes);
  if (rank == 0)
    printf("socket transport: %llu MiB in %lld ms = %.2f GB/s (ring %zu KiB, %d TCP "
           "connection%s)\n", (unsigned long long)(bytes >> 20), (long long)dt,
           dt > 0 ? (double)bytes / ((double)dt * 1e6) : 0.0, ring_bytes() >> 10,
           getenv("CHORUS_NSOCKS_PERTHREAD") ? atoi(getenv("CHORUS_NSOCKS_PERTHREAD")) : 1,
           getenv("CHORUS_NSOCKS_PERTHREAD") ? "s" : "");
  char b = 1;
  T(full_io(wfd, &b, 1, 1) == 0);
  T(full_io(rfd, &b, 1, 0) == 0);
  free_comm(comm);
}

static void test_bench(uint64_t bytes) {
  int to[2][2], from[2][2];
  pid_t pids[2];
  struct peer_info peers[2];
  fflush(stdout);
  run_children(2, bench_main, bytes, to, from, pids);
  for (int r = 0; r < 2; r++) T(full_io(from[r][0], &peers[r], sizeof peers[r], 0) == 0);
  for (int r = 0; r < 2; r++) T(full_io(to[r][1], peers, sizeof peers, 1) == 0);
  char b;
  for (int r = 0; r < 2; r++) T(full_io(from[r][0], &b, 1, 0) == 0);
  for (int r = 0; r < 2; r++) T(full_io(to[r][1], &b, 1, 1) == 0);
  collect(2, from, to, pids);
}

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_DFL); /* the transport must never raise it */
  setvbuf(stdout, NULL, _IOLBF, 0);
  setenv("CHORUS_SOCKET_IFNAME", "=lo", 1); /* tests talk over loopback only */
  param_reset_cache();
  test_local();
  /* small rings: constant wrap-around */
  setenv("CHORUS_BUFFSIZE", "65536", 1);
  param_reset_cache();
  test_three_ranks(4u << 20);
  test_duplicate_and_timeout();
  /* a ring size that is not a power of two */
  setenv("CHORUS_BUFFSIZE", "200000", 1);
  param_reset_cache();
  test_three_ranks(3u << 20);
  /* striped over 3 TCP connections per peer and channel, 8 KiB stripes in a 64 KiB ring:
   * sub-connections run ahead of each other and wrap the ring constantly */
  setenv("CHORUS_NSOCKS_PERTHREAD", "3", 1);
  setenv("CHORUS_BUFFSIZE", "65536", 1);
  param_reset_cache();
  test_three_ranks(4u << 20);
  /* IPv6 over ::1, striped over 2 (and, by default below, 1 on the same host) */
  setenv("CHORUS_SOCKET_FAMILY", "AF_INET6", 1);
  setenv("CHORUS_NSOCKS_PERTHREAD", "2", 1);
  setenv("CHORUS_BUFFSIZE", "200000", 1);
  param_reset_cache();
  test_three_ranks(3u << 20);
  setenv("CHORUS_NSOCKS_PERTHREAD", "-1", 1);
  param_reset_cache();
  test_three_ranks(1u << 20);
  unsetenv("CHORUS_SOCKET_FAMILY");
  unsetenv("CHORUS_NSOCKS_PERTHREAD");
  uint64_t mb = argc > 1 ? strtoull(argv[1], NULL, 0) : 256;
  if (mb) {
    unsetenv("CHORUS_BUFFSIZE");
    param_reset_cache();
    test_bench(mb << 20);
    setenv("CHORUS_NSOCKS_PERTHREAD", "4", 1);
    param_reset_cache();
    test_bench(mb << 20);
    unsetenv("CHORUS_NSOCKS_PERTHREAD");
  }
  printf("test_socket_conn: %d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
