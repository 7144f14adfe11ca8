/* socket.c - the TCP transport: the listening socket and choice of the advertised
 * interface (IPv4 or IPv6), authenticated connection setup between ranks (hello / ack, one
 * per TCP sub-connection), and the per-connection user-space tx/rx rings that progress()
 * moves with send()/recv(), over one TCP connection or striped over several. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "socket_ifname.h"

#define HELLO_MAGIC 0x43534b48u   /* "CSKH": connector -> acceptor */
#define ACK_MAGIC 0x43534b41u     /* "CSKA": acceptor -> connector */
#define SOCK_VERSION 2u           /* 2: sub-connection fields in hello and ack */
#define HELLO_LEN SOCK_HELLO_LEN  /* magic, version, secret[32], rank, channel, nranks,
                                     stream, nstreams, chunk */
#define ACK_LEN SOCK_ACK_LEN      /* magic, version, rank, channel, stream */
#define MAX_STREAMS 16            /* TCP sub-connections of one connection */
#define FD_HEADROOM 64            /* descriptors left for whatever else the process opens */
#define STREAMS_REMOTE 4          /* NSOCKS_PERTHREAD=-1 between hosts (docs/design.md) */
#define CHUNK_MIN 4096u           /* stripe unit bounds, as the hello may carry them */
#define CHUNK_MAX (1u << 20)
#define HELLO_WAIT_MS 5000        /* a silent stranger is dropped after this */
#define MAX_PENDING 256           /* accepted sockets still owing their hello */
#define FAILURE_WAIT_MS 300       /* how long a closed connection looks for the peer's reason */
#define FLUSH_WAIT_MS 1000        /* a failing rank's last try to send what it still holds */
#define REFUSED_RETRY_MS 5000     /* the peer listens before the all-gather; refusals are
                                     retried only briefly (e.g. SYN races), not forever */
/* Payloads handed to an I/O thread from here: below it the hand-off (a thread's wake-up, the
 * engine's wait for its "done") cost more than the copy it moves off the engine (measured on
 * the 16-core host with 256 KiB and 1 MiB, docs/PERFORMANCE.md). */
#define IO_MIN ((size_t)1 << 20)
#define IO_MAX 8                  /* I/O threads per rank */
#define IO_SPIN_NS 200000LL       /* an idle I/O thread spins this long before it sleeps */
#define STAGE_MAX ((size_t)64 << 20)   /* largest reducing payload staged by an I/O thread */
#define STAGE_TOTAL ((size_t)256 << 20) /* staging buffers of a rank, all connections */
#define RING_MIN (64u << 10)
#define RX_PEEK ((size_t)64 << 10)
#define RING_MAX ((size_t)1 << 30)

union sockaddr_any {
  struct sockaddr sa;
  struct sockaddr_in in4;
  struct sockaddr_in6 in6;
  struct sockaddr_storage ss;
};

/* A big direct payload whose system calls an I/O thread makes (see "I/O threads"). The
 * engine fills it and publishes it ACTIVE; the thread moves bytes, publishing done, and
 * sets DONE at the end or on an error; the engine reads the result and sets IDLE. */
enum { JOB_IDLE = 0, JOB_ACTIVE = 1, JOB_DONE = 2 };
struct sock_job {
  _Atomic int state;
  int fd;
  int is_recv;
  uint8_t *buf;
  size_t n;
  _Atomic size_t done;       /* bytes of buf moved (thread writes, engine reads) */
  int err;                   /* at DONE: 0, an errno, or -1 for the peer's EOF */
  size_t reported;           /* engine only: bytes of done already returned to the caller */
  struct sock_job *next;     /* in the thread's posted or active list */
};

struct sock_io {
  struct chorus_comm *comm;
  pthread_t thread;
  int efd;                   /* eventfd: a job was posted, or stop */
  pthread_mutex_t mu;
  struct sock_job *posted;   /* mu: posted, not yet taken by the thread */
  _Atomic int nposted;       /* posted is not empty (read without mu) */
  int sleeping;              /* mu: the thread is about to block in poll() */
  _Atomic int stop;
};

struct sock_state {
  int listen_fd;             /* -1 once closed */
  int aborted;               /* socket_abort_conns ran */
  int family;                /* of the advertised address: AF_INET or AF_INET6 */
  unsigned ifindex;          /* of the chosen interface: scope of IPv6 link-local peers */
  uint16_t port;
  char addr[ADDR_LEN];       /* advertised "ip:port" */
  char ifname[IF_NAMESIZE];
  /* I/O threads: nio wanted (0: none), started lazily at the first big payload */
  int nio, io_started, io_next, io_stopped;
  size_t stage_total;        /* bytes of the connections' staging buffers */
  /* Received bytes of the closed connections by where they landed: the caller's buffer
   * (read_direct), a receive ring, a staging buffer (reductions' I/O threads). */
  uint64_t rx_direct, rx_ring, rx_staged;
  struct sock_io io[IO_MAX];
};

/* One TCP connection of a striped connection. The byte stream of each direction is cut
 * into chunks of `chunk` bytes; chunk k travels on sub-connection k % nsub, so each side
 * knows where every byte belongs without any framing. Positions are stream offsets. */
struct sock_sub {
  int fd;
  int eof;                   /* recv() returned 0 */
  uint32_t events;           /* registered with the connection's epoll set */
  uint64_t spos, rpos;       /* next stream byte to send / to receive on this one */
};

struct sock_conn {
  conn_t base;               /* first, so conn_t * and struct sock_conn * convert */
  int fd;                    /* the one TCP connection when nsub == 1, else -1 */
  int nsub;                  /* TCP connections; > 1: striped over sub[] */
  int nready;                /* accept side: sub-connections installed so far */
  int epfd;                  /* striped: epoll set of the sub-connections, polled as one */
  uint64_t chunk;            /* striped: bytes per stripe */
  uint64_t direct_end;       /* striped: stream position where the unfinished direct write
                                ends (sub-connections may run ahead inside it) */
  struct sock_sub *sub;      /* striped: nsub entries */
  size_t size;               /* bytes of each ring */
  uint8_t *tx, *rx;
  uint64_t tx_head, tx_tail; /* free-running: head = sent, tail = committed */
  uint64_t rx_head, rx_tail; /* head = consumed, tail = received */
  int eof;                   /* recv() returned 0 */
  int starving;              /* the last peek found nothing: the reader wants bytes */
  int awaiting_ack;          /* connector side, until the acceptor's ack is read */
  int direct_tx;             /* a direct write is unfinished: poll for POLLOUT */
  int direct_rx;             /* a direct read is unfinished: progress leaves recv to it */
  int eof_probed;            /* after EOF, the store was asked whether the peer failed */
  int peer_failed;           /* ... and it had: at collective peer_failed_seq (0: at once) */
  int io;                    /* index of the I/O thread serving this connection, -1: none */
  struct sock_job txj, rxj;  /* direct payloads an I/O thread moves ... */
  int tx_job, rx_job;        /* ... while these are set (engine's view) */
  /* A staged payload (sock_stage): rxj receives it into stage; peek and consume serve it
   * once the ring's bytes before it are consumed. */
  int staging;
  /* Collective connections read ahead only RX_PEEK bytes past what was consumed (enough
   * for headers and small payloads), except through a payload announced by ops->stage:
   * up to rx_want. A copied payload's bytes then wait in the kernel for read_direct. */
  uint64_t rx_want;
  uint64_t n_direct, n_ring, n_staged; /* received bytes by where they landed */
  uint8_t *stage;
  size_t stage_cap, stage_len, stage_got, stage_pos;
  uint64_t peer_failed_seq;
  chorus_result_t err;       /* sticky: reported once through comm_set_error */
  char peer_addr[ADDR_LEN + 80]; /* for messages: advertised address and host name */
};

static const struct transport_ops sock_ops, sock_striped_ops;

static const char *chan_name(int ch) { return ch == CHAN_COLL ? "coll" : "p2p"; }

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* Constant-time so a stranger cannot learn the secret byte by byte from timing. */
static int secret_equal(const uint8_t *a, const uint8_t *b, size_t n) {
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < n; i++) diff |= (uint8_t)(a[i] ^ b[i]);
  return diff == 0;
}

/* ------------------------------------------------------------ addresses */
static void addr_format(const union sockaddr_any *a, char *buf, size_t cap) {
  char ip[INET6_ADDRSTRLEN] = "?";
  if (a->sa.sa_family == AF_INET6) {
    if (!inet_ntop(AF_INET6, &a->in6.sin6_addr, ip, sizeof ip)) snprintf(ip, sizeof ip, "?");
    snprintf(buf, cap, "[%s]:%u", ip, (unsigned)ntohs(a->in6.sin6_port));
  } else if (a->sa.sa_family == AF_INET) {
    if (!inet_ntop(AF_INET, &a->in4.sin_addr, ip, sizeof ip)) snprintf(ip, sizeof ip, "?");
    snprintf(buf, cap, "%s:%u", ip, (unsigned)ntohs(a->in4.sin_port));
  } else {
    snprintf(buf, cap, "(family %d)", (int)a->sa.sa_family);
  }
}

static socklen_t addr_len(const union sockaddr_any *a) {
  return a->sa.sa_family == AF_INET6 ? (socklen_t)sizeof a->in6 : (socklen_t)sizeof a->in4;
}

/* "a.b.c.d:port" or "[v6]:port" -> sockaddr. Returns 0 or -1. */
static int addr_parse(const char *s, union sockaddr_any *out) {
  char host[INET6_ADDRSTRLEN + 2];
  const char *colon, *hs = s;
  size_t hl;
  memset(out, 0, sizeof *out);
  if (!s) return -1;
  if (s[0] == '[') {
    const char *close = strchr(s, ']');
    if (!close || close[1] != ':') return -1;
    hs = s + 1;
    hl = (size_t)(close - hs);
    colon = close + 1;
  } else {
    colon = strrchr(s, ':');
    if (!colon) return -1;
    hl = (size_t)(colon - s);
  }
  if (hl == 0 || hl >= sizeof host) return -1;
  memcpy(host, hs, hl);
  host[hl] = 0;
  char *end;
  errno = 0;
  unsigned long port = strtoul(colon + 1, &end, 10);
  if (errno || end == colon + 1 || *end || port == 0 || port > 65535) return -1;
  if (inet_pton(AF_INET, host, &out->in4.sin_addr) == 1) {
    out->in4.sin_family = AF_INET;
    out->in4.sin_port = htons((uint16_t)port);
    return 0;
  }
  if (inet_pton(AF_INET6, host, &out->in6.sin6_addr) == 1) {
    out->in6.sin6_family = AF_INET6;
    out->in6.sin6_port = htons((uint16_t)port);
    return 0;
  }
  return -1;
}

static void addr_set_loopback(union sockaddr_any *a) {
  if (a->sa.sa_family == AF_INET6)
    a->in6.sin6_addr = in6addr_loopback;
  else
    a->in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
}

/* ------------------------------------------------------------ interface choice */
int ifname_matches(const char *spec, const char *name) {
  if (!spec || !name) return 0;
  const char *p = spec;
  int exclude = 0, exact = 0;
  while (*p == ' ' || *p == '\t') p++;
  if (*p == '^') exclude = 1, p++;
  if (*p == '=') exact = 1, p++;
  int hit = 0, entries = 0;
  size_t nl = strlen(name);
  while (*p) {
    const char *comma = strchr(p, ',');
    const char *e = comma ? comma : p + strlen(p);
    const char *b = p;
    while (b < e && (*b == ' ' || *b == '\t')) b++;
    while (e > b && (e[-1] == ' ' || e[-1] == '\t')) e--;
    size_t n = (size_t)(e - b);
    if (n) {
      entries++;
      if (exact ? (nl == n && memcmp(name, b, n) == 0) : (nl >= n && memcmp(name, b, n) == 0))
        hit = 1;
    }
    if (!comma) break;
    p = comma + 1;
  }
  if (!entries) return 1;
  return exclude ? !hit : hit;
}

/* Lower is better. With the user's list, loopback is taken only if nothing else
 * matches; by default container bridges come after real interfaces (as NCCL does). */
static int if_rank(const struct ifaddrs *ifa, int user_spec) {
  if (ifa->ifa_flags & IFF_LOOPBACK) return 2;
  if (!user_spec && (strncmp(ifa->ifa_name, "docker", 6) == 0 ||
                     strncmp(ifa->ifa_name, "virbr", 5) == 0))
    return 1;
  return 0;
}

/* Within one interface class, IPv4 first (what a mixed cluster most surely shares), then
 * global or unique-local IPv6, then IPv6 link-local: its scope is per host, so a peer can
 * only reach it through its own interface on that link (see connect_fd). */
static int family_rank(const struct sockaddr *sa) {
  if (sa->sa_family == AF_INET) return 0;
  const struct in6_addr *a6 = &((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr;
  return IN6_IS_ADDR_LINKLOCAL(a6) ? 2 : 1;
}

/* SOCKET_FAMILY: 0 (any), AF_INET or AF_INET6; -1 if the value is not understood. */
static int family_param(void) {
  const char *f = param_str(PARAM_SOCKET_FAMILY);
  if (!f[0]) return 0;
  if (!strcasecmp(f, "AF_INET") || !strcasecmp(f, "inet") || !strcmp(f, "4")) return AF_INET;
  if (!strcasecmp(f, "AF_INET6") || !strcasecmp(f, "inet6") || !strcmp(f, "6")) return AF_INET6;
  return -1;
}

static chorus_result_t choose_interface(struct chorus_comm *comm, struct sock_state *st,
                                        union sockaddr_any *ip) {
  const char *spec = param_str(PARAM_SOCKET_IFNAME);
  int user_spec = spec[0] != 0;
  int want_family = family_param();
  if (want_family < 0)
    return comm_set_error(comm, CHORUS_ERR_INVALID, "rank %d: SOCKET_FAMILY '%s' is not "
                          "AF_INET or AF_INET6", comm->rank, param_str(PARAM_SOCKET_FAMILY));
  struct ifaddrs *list = NULL, *best = NULL;
  int best_rank = 99;
  if (getifaddrs(&list) != 0)
    return comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: getifaddrs failed: %s",
                          comm->rank, strerror(errno));
  char seen[256] = "";
  for (struct ifaddrs *ifa = list; ifa; ifa = ifa->ifa_next) {
    if (!ifa->ifa_addr) continue;
    int fam = ifa->ifa_addr->sa_family;
    if (fam != AF_INET && fam != AF_INET6) continue;
    if (!(ifa->ifa_flags & IFF_UP)) continue;
    size_t sl = strlen(seen);
    if (!strstr(seen, ifa->ifa_name) && sl + strlen(ifa->ifa_name) + 3 < sizeof seen)
      snprintf(seen + sl, sizeof seen - sl, "%s%s", sl ? ", " : "", ifa->ifa_name);
    if (want_family && fam != want_family) continue;
    if (user_spec && !ifname_matches(spec, ifa->ifa_name)) continue;
    int r = if_rank(ifa, user_spec) * 10 + family_rank(ifa->ifa_addr);
    if (r < best_rank) best = ifa, best_rank = r;
  }
  chorus_result_t res = CHORUS_SUCCESS;
  const char *fam_name = want_family == AF_INET ? "an IPv4 address"
                         : want_family == AF_INET6 ? "an IPv6 address"
                                                   : "an IPv4 or IPv6 address";
  memset(ip, 0, sizeof *ip);
  if (best) {
    if (best->ifa_addr->sa_family == AF_INET6) {
      memcpy(&ip->in6, best->ifa_addr, sizeof ip->in6);
      ip->in6.sin6_scope_id = 0; /* advertised to other hosts: the scope is ours only */
    } else {
      memcpy(&ip->in4, best->ifa_addr, sizeof ip->in4);
    }
    snprintf(st->ifname, sizeof st->ifname, "%s", best->ifa_name);
    st->ifindex = if_nametoindex(best->ifa_name);
  } else if (user_spec || want_family == AF_INET6) {
    res = comm_set_error(comm, CHORUS_ERR_INVALID,
                         "rank %d: SOCKET_IFNAME '%s' / SOCKET_FAMILY '%s' match no interface "
                         "that is up with %s (up: %s)", comm->rank, spec,
                         param_str(PARAM_SOCKET_FAMILY), fam_name, seen[0] ? seen : "none");
  } else {
    WARN(comm->rank, "socket: no interface is up with %s; advertising 127.0.0.1", fam_name);
    ip->in4.sin_family = AF_INET;
    ip->in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    snprintf(st->ifname, sizeof st->ifname, "lo");
  }
  freeifaddrs(list);
  st->family = ip->sa.sa_family ? ip->sa.sa_family : AF_INET;
  if (best && best_rank % 10 == 2)
    INFO(SUB_NET, comm->rank, "socket: only an IPv6 link-local address matches (interface "
         "%s): peers on other hosts reach it through their own interface", st->ifname);
  return res;
}

/* ------------------------------------------------------------ socket helpers */
static void set_bufsizes(struct chorus_comm *comm, int fd) {
  int64_t want = param_int(PARAM_SOCKET_SNDBUF);
  if (want <= 0) return;
  int v = want > INT_MAX ? INT_MAX : (int)want;
  if (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof v) != 0 ||
      setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof v) != 0)
    WARN(comm->rank, "socket: setting SO_SNDBUF/SO_RCVBUF to %d failed: %s", v,
         strerror(errno));
}

static void set_nodelay(struct chorus_comm *comm, int fd) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0)
    WARN(comm->rank, "socket: TCP_NODELAY failed: %s", strerror(errno));
}

static size_t ring_size(void) {
  int64_t v = param_int(PARAM_BUFFSIZE);
  size_t s = v < (int64_t)RING_MIN ? RING_MIN : (uint64_t)v > RING_MAX ? RING_MAX : (size_t)v;
  return (s + 4095) & ~(size_t)4095;
}

static void sock_close(conn_t *c);

/* A connection over nsub TCP connections; with nsub == 1 fd is that connection, else the
 * sub-connections are added one by one (sub_add) and fd is unused. */
static chorus_result_t conn_new(struct chorus_comm *comm, int fd, int peer, int ch,
                                const char *addr, int nsub, uint64_t chunk,
                                struct sock_conn **out) {
  struct sock_conn *s = calloc(1, sizeof *s);
  size_t size = ring_size();
  if (s) {
    s->fd = -1;
    s->epfd = -1;
    s->tx = malloc(size);
    s->rx = malloc(size);
    if (nsub > 1) s->sub = calloc((size_t)nsub, sizeof *s->sub);
  }
  if (!s || !s->tx || !s->rx || (nsub > 1 && !s->sub)) {
    if (s) {
      free(s->tx);
      free(s->rx);
      free(s->sub);
      free(s);
    }
    return comm_set_error(comm, CHORUS_ERR_NOMEM,
                          "rank %d peer %d: cannot allocate 2 x %zu bytes of socket rings",
                          comm->rank, peer, size);
  }
  s->base.ops = nsub > 1 ? &sock_striped_ops : &sock_ops;
  s->base.comm = comm;
  s->base.peer = peer;
  s->base.channel = ch;
  s->nsub = nsub > 1 ? nsub : 1;
  s->size = size;
  if (nsub > 1) {
    s->chunk = chunk;
    for (int i = 0; i < nsub; i++) {
      s->sub[i].fd = -1;
      s->sub[i].spos = s->sub[i].rpos = (uint64_t)i * chunk;
    }
    s->epfd = epoll_create1(EPOLL_CLOEXEC);
    if (s->epfd < 0) {
      chorus_result_t r = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d peer %d: "
                                         "epoll_create1 failed: %s", comm->rank, peer,
                                         strerror(errno));
      sock_close(&s->base);
      return r;
    }
  } else {
    s->fd = fd;
    s->nready = 1;
  }
  s->io = -1;
  /* Name the peer by what identifies it (its listening address and host), not by the
   * ephemeral port an accepted socket shows. */
  const struct peer_info *pi = comm->peers ? &comm->peers[peer] : NULL;
  if (pi && pi->sock_addr[0])
    snprintf(s->peer_addr, sizeof s->peer_addr, "%.*s%s%.*s", ADDR_LEN, pi->sock_addr,
             pi->hostname[0] ? " on " : "", (int)sizeof pi->hostname, pi->hostname);
  else
    snprintf(s->peer_addr, sizeof s->peer_addr, "%s", addr);
  *out = s;
  return CHORUS_SUCCESS;
}

/* Installs fd as sub-connection i of a striped connection (owned by it from now on, also
 * on failure). */
static chorus_result_t sub_add(struct sock_conn *s, int i, int fd) {
  struct epoll_event ev = {.events = 0, .data.u32 = (uint32_t)i};
  s->sub[i].fd = fd;
  s->nready++;
  if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, fd, &ev) != 0)
    return comm_set_error(s->base.comm, CHORUS_ERR_SYSTEM, "rank %d peer %d: epoll_ctl(ADD) "
                          "of TCP sub-connection %d failed: %s", s->base.comm->rank,
                          s->base.peer, i, strerror(errno));
  return CHORUS_SUCCESS;
}

static int is_sock(const conn_t *c) {
  return c && (c->ops == &sock_ops || c->ops == &sock_striped_ops);
}
static int conn_complete(const conn_t *c) {
  return c && (!is_sock(c) || ((const struct sock_conn *)c)->nready ==
                                  ((const struct sock_conn *)c)->nsub);
}

/* ------------------------------------------------------------ transport ops */
static chorus_result_t conn_fail(struct sock_conn *s, int err, const char *what) {
  struct chorus_comm *comm = s->base.comm;
  int peer = s->base.peer;
  if (s->err) return s->err;
  if (err == 0 || err == ECONNRESET || err == EPIPE || err == ECONNABORTED) {
    /* A peer whose communicator failed published why before resetting its connections
     * (socket_abort_conns); a peer that died published nothing: the short wait is all that
     * costs. */
    char key[32], why[700];
    size_t got = 0;
    snprintf(key, sizeof key, "failure/%d", peer);
    if (bs_try_get(comm, key, why, sizeof why - 1, &got, FAILURE_WAIT_MS) == CHORUS_SUCCESS &&
        got > 0) {
      why[got < sizeof why ? got : sizeof why - 1] = 0;
      const char *text = strchr(why, '|');
      s->err = comm_set_error(comm, CHORUS_ERR_PEER,
                              "rank %d peer %d (socket, %s channel): rank %d reported a "
                              "failure: %s", comm->rank, peer, chan_name(s->base.channel),
                              peer, text ? text + 1 : why);
      return s->err;
    }
    s->err = comm_set_error(comm, CHORUS_ERR_PEER,
                            "rank %d peer %d (socket, %s channel): connection to rank %d (%s) "
                            "closed: peer process exited or failed%s%s%s",
                            comm->rank, peer, chan_name(s->base.channel), peer, s->peer_addr,
                            err ? " (" : "", err ? strerror(err) : "", err ? ")" : "");
  } else {
    chorus_result_t kind =
        (err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH || err == ENETDOWN)
            ? CHORUS_ERR_PEER
            : CHORUS_ERR_SYSTEM;
    s->err = comm_set_error(comm, kind, "rank %d peer %d (socket, %s channel): %s to rank %d (%s) "
                            "failed: %s", comm->rank, peer, chan_name(s->base.channel), what,
                            peer, s->peer_addr, strerror(err));
  }
  return s->err;
}

/* Fills iov with the ring bytes [pos, pos + len) (len <= size): one or two pieces. */
static int ring_iov(uint8_t *ring, size_t size, uint64_t pos, size_t len, struct iovec *iov) {
  size_t idx = (size_t)(pos % size);
  size_t first = size - idx < len ? size - idx : len;
  iov[0].iov_base = ring + idx;
  iov[0].iov_len = first;
  if (first == len) return 1;
  iov[1].iov_base = ring;
  iov[1].iov_len = len - first;
  return 2;
}

/* ------------------------------------------------------------ I/O threads
 *
 * One engine thread per rank makes every system call of its connections; sending and
 * receiving a big payload then take turns on one core, and the kernel's copies (user to
 * socket buffer and back) are most of the work. Where the host has cores to spare
 * (CHORUS_SOCKET_THREADS), direct payloads of IO_MIN bytes or more are handed to a few
 * helper threads of the rank instead: a connection is served by one of them (round robin
 * at its first big payload), so different peers and the two directions of one peer move at
 * once while the engine runs the algorithm, reduces, and moves everything small itself.
 * A thread never blocks on one payload: it makes non-blocking calls for all its jobs and
 * polls their sockets together, so ranks that send to each other cannot deadlock it. */
static void cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* Moves the posted jobs onto the thread's list act; returns the new list. */
static struct sock_job *io_take(struct sock_io *io, struct sock_job *act) {
  pthread_mutex_lock(&io->mu);
  while (io->posted) {
    struct sock_job *j = io->posted;
    io->posted = j->next;
    j->next = act;
    act = j;
  }
  atomic_store_explicit(&io->nposted, 0, memory_order_relaxed);
  pthread_mutex_unlock(&io->mu);
  return act;
}

static void *io_main(void *arg) {
  struct sock_io *io = arg;
  struct sock_job *act = NULL; /* jobs taken from posted, still moving */
  struct pollfd *pfd = NULL;
  size_t pcap = 0;
  int64_t idle_since = now_ns();
  while (!atomic_load_explicit(&io->stop, memory_order_acquire)) {
    if (atomic_load_explicit(&io->nposted, memory_order_acquire)) act = io_take(io, act);
    int moved = 0, finished = 0;
    size_t nact = 0;
    for (struct sock_job **pp = &act; *pp;) {
      struct sock_job *j = *pp;
      size_t done = atomic_load_explicit(&j->done, memory_order_relaxed);
      ssize_t r = j->is_recv ? recv(j->fd, j->buf + done, j->n - done, MSG_DONTWAIT)
                             : send(j->fd, j->buf + done, j->n - done, MSG_NOSIGNAL | MSG_DONTWAIT);
      int err = 0;
      if (r > 0) {
        done += (size_t)r;
        atomic_store_explicit(&j->done, done, memory_order_release);
        moved = 1;
      } else if (r == 0) {
        err = -1; /* recv: the peer closed (a send of a non-empty range never returns 0) */
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        err = errno;
      }
      if (done == j->n || err) {
        j->err = err;
        *pp = j->next; /* read before DONE: the engine may reuse j at once */
        j->next = NULL;
        atomic_store_explicit(&j->state, JOB_DONE, memory_order_release);
        finished = 1;
        continue;
      }
      nact++;
      pp = &j->next;
    }
    if (finished) engine_wake(io->comm);
    if (moved || finished) {
      idle_since = now_ns();
      continue;
    }
    if (!act && now_ns() - idle_since < IO_SPIN_NS) {
      cpu_pause();
      continue;
    }
    if (nact + 1 > pcap) {
      size_t cap = (nact + 1) * 2;
      struct pollfd *np = realloc(pfd, cap * sizeof *np);
      if (np) {
        pfd = np;
        pcap = cap;
      }
    }
    nfds_t n = 0;
    if (pfd && nact + 1 <= pcap) {
      for (struct sock_job *j = act; j; j = j->next)
        pfd[n++] = (struct pollfd){j->fd, (short)(j->is_recv ? POLLIN : POLLOUT), 0};
      pfd[n++] = (struct pollfd){io->efd, POLLIN, 0};
    }
    pthread_mutex_lock(&io->mu);
    int sleep_now = !io->posted && !atomic_load(&io->stop);
    if (sleep_now) io->sleeping = 1;
    pthread_mutex_unlock(&io->mu);
    if (!sleep_now) continue;
    if (n) {
      /* a bounded wait: a missed wake-up costs at most this */
      if (poll(pfd, n, act ? 100 : 1000) > 0 && (pfd[n - 1].revents & POLLIN)) {
        uint64_t v;
        ssize_t rd = read(io->efd, &v, sizeof v);
        (void)rd;
      }
    } else {
      sleep_ms(1); /* no memory for the poll set: retry shortly */
    }
    pthread_mutex_lock(&io->mu);
    io->sleeping = 0;
    pthread_mutex_unlock(&io->mu);
  }
  /* Stopped (the communicator failed or is going away): whatever is left will not move. */
  act = io_take(io, act);
  while (act) {
    struct sock_job *j = act;
    act = j->next;
    j->next = NULL;
    j->err = ECANCELED;
    atomic_store_explicit(&j->state, JOB_DONE, memory_order_release);
  }
  free(pfd);
  return NULL;
}

/* CHORUS_SOCKET_THREADS, or by default one per core this rank has beyond the engine's
 * (the host's cores over its local ranks, less one), at most one per peer and 4. */
static int io_threads_for(const struct chorus_comm *comm, int peers) {
  int64_t v = param_int(PARAM_SOCKET_THREADS);
  if (v < 0) {
    long cores = host_cores(comm);
    int local = comm->nlocal > 0 ? comm->nlocal : 1;
    v = cores / local - 1;
    if (v > 4) v = 4;
  }
  if (v > peers) v = peers;
  if (v > IO_MAX) v = IO_MAX;
  return v > 0 ? (int)v : 0;
}

/* How far ahead of the reader progress() fills the receive ring: all of it, or with I/O
 * threads IO_MIN bytes, so that the rest of a big payload waits in the kernel until its
 * message is read and a thread receives it (read_direct, stage) instead of the engine.
 * On collective connections, RX_PEEK bytes unless the reader announced a payload it reads
 * through the ring (rx_want): a payload copied out of the ring would cost one
 * memcpy more than read_direct's receive straight into the destination.
 * Single-stream connections only (striped ones fill their ring by stripes). */
static size_t rx_window(const struct sock_conn *s) {
  const struct sock_state *st = s->base.comm->sock;
  size_t w = s->size;
  if (st && st->nio > 0 && !st->io_stopped && w > IO_MIN) w = IO_MIN;
  if (s->base.channel == CHAN_COLL) {
    size_t want = s->rx_want > s->rx_head ? (size_t)(s->rx_want - s->rx_head) : 0;
    if (want < RX_PEEK) want = RX_PEEK;
    if (want < w) w = want;
  }
  return w;
}

/* Starts the rank's I/O threads (first big payload); 0 if there are none to use. */
static int io_ready(struct chorus_comm *comm) {
  struct sock_state *st = comm->sock;
  if (st->io_started) return 1;
  if (st->io_stopped || st->nio <= 0) return 0;
  sigset_t all, old;
  sigfillset(&all);
  int masked = pthread_sigmask(SIG_SETMASK, &all, &old) == 0; /* signals stay with the app */
  int started = 0;
  for (int i = 0; i < st->nio; i++) {
    struct sock_io *io = &st->io[i];
    memset(io, 0, sizeof *io);
    io->comm = comm;
    io->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (io->efd < 0) break;
    pthread_mutex_init(&io->mu, NULL);
    if (pthread_create(&io->thread, NULL, io_main, io) != 0) {
      pthread_mutex_destroy(&io->mu);
      close(io->efd);
      break;
    }
    pthread_setname_np(io->thread, "chorus-sockio");
    started++;
  }
  if (masked) pthread_sigmask(SIG_SETMASK, &old, NULL);
  INFO(SUB_NET, comm->rank, "socket: started %d of %d I/O threads", started, st->nio);
  st->nio = started;
  st->io_started = started;
  if (!started) st->io_stopped = 1;
  return started > 0;
}

/* Should a payload of n bytes of s go to an I/O thread (starting them if need be)? Only
 * single-stream connections (sock_ops) ask. */
static int io_wanted(struct sock_conn *s, size_t n) {
  struct chorus_comm *comm = s->base.comm;
  return n >= IO_MIN && comm->sock && io_ready(comm);
}

/* Hands the payload [buf, buf + n) of s to its I/O thread as job j; io_wanted said yes. */
static void io_post(struct sock_conn *s, struct sock_job *j, int is_recv, void *buf, size_t n) {
  struct sock_state *st = s->base.comm->sock;
  if (s->io < 0) s->io = st->io_next++ % st->io_started;
  struct sock_io *io = &st->io[s->io];
  j->fd = s->fd;
  j->is_recv = is_recv;
  j->buf = buf;
  j->n = n;
  j->err = 0;
  j->reported = 0;
  atomic_store_explicit(&j->done, 0, memory_order_relaxed);
  atomic_store_explicit(&j->state, JOB_ACTIVE, memory_order_relaxed);
  pthread_mutex_lock(&io->mu);
  j->next = io->posted;
  io->posted = j;
  atomic_store_explicit(&io->nposted, 1, memory_order_release);
  int wake = io->sleeping;
  pthread_mutex_unlock(&io->mu);
  if (wake) {
    uint64_t one = 1;
    ssize_t w = write(io->efd, &one, sizeof one);
    (void)w;
  }
}

/* Engine: what the I/O thread did for j since the last call (*delta bytes); 1 once the job
 * has ended, with *err its error (0, an errno, or -1 for EOF), and j is idle again. */
static int io_collect(struct sock_job *j, size_t *delta, int *err) {
  int state = atomic_load_explicit(&j->state, memory_order_acquire);
  size_t d = atomic_load_explicit(&j->done, memory_order_acquire);
  /* The last byte counts only once the thread has let go of j (DONE): the caller's next
   * payload may reuse j as soon as this one looks finished. */
  if (state != JOB_DONE && d == j->n) d--;
  *delta = d - j->reported;
  j->reported = d;
  if (state != JOB_DONE) return 0;
  *err = j->err;
  atomic_store_explicit(&j->state, JOB_IDLE, memory_order_relaxed);
  return 1;
}

/* Engine, for the job j of s (*active set while it runs) the caller passes buf, where it
 * expects the job to be: the bytes moved since the last call (*delta), and once the job has
 * ended, *active cleared and the job's error turned into the connection's (what: "send" or
 * "recv"; the peer's EOF as a closed connection). */
static chorus_result_t direct_collect(struct sock_conn *s, struct sock_job *j, int *active,
                                      const void *buf, const char *what, size_t *delta) {
  *delta = 0;
  if ((const uint8_t *)buf != j->buf + j->reported)
    return comm_set_error(s->base.comm, CHORUS_ERR_INTERNAL, "rank %d peer %d: a %s an I/O "
                          "thread moves changed its buffer", s->base.comm->rank, s->base.peer,
                          what);
  int e = 0;
  if (!io_collect(j, delta, &e)) return CHORUS_SUCCESS;
  *active = 0;
  if (e < 0) {
    s->eof = 1;
    s->starving = 1;
    return conn_fail(s, 0, what);
  }
  return e ? conn_fail(s, e, what) : CHORUS_SUCCESS;
}

void socket_stop_io(struct chorus_comm *comm) {
  struct sock_state *st = comm ? comm->sock : NULL;
  if (!st) return;
  st->io_stopped = 1;
  for (int i = 0; i < st->io_started; i++) {
    atomic_store(&st->io[i].stop, 1);
    uint64_t one = 1;
    ssize_t w = write(st->io[i].efd, &one, sizeof one);
    (void)w;
  }
  for (int i = 0; i < st->io_started; i++) {
    pthread_join(st->io[i].thread, NULL);
    close(st->io[i].efd);
    pthread_mutex_destroy(&st->io[i].mu);
  }
  st->io_started = 0;
}

static chorus_result_t sock_reserve(conn_t *c, void **ptr, size_t *len) {
  struct sock_conn *s = (struct sock_conn *)c;
  /* An empty ring restarts near offset 0 so the caller gets (almost) the whole ring
   * contiguous; index == stream position mod 16 is kept as on the receive side, so a
   * window that ends at the ring's end ends on a 16-byte boundary of the stream. Striped
   * connections never restart: their positions are stream offsets that pick the stripe. */
  if (s->tx_head == s->tx_tail && s->nsub == 1) s->tx_head = s->tx_tail = s->tx_tail % 16;
  size_t used = (size_t)(s->tx_tail - s->tx_head);
  size_t idx = (size_t)(s->tx_tail % s->size);
  size_t space = s->size - used, contig = s->size - idx;
  *ptr = s->tx + idx;
  *len = space < contig ? space : contig;
  return CHORUS_SUCCESS;
}

static chorus_result_t sock_commit(conn_t *c, size_t len) {
  struct sock_conn *s = (struct sock_conn *)c;
  size_t used = (size_t)(s->tx_tail - s->tx_head);
  size_t idx = (size_t)(s->tx_tail % s->size);
  if (len > s->size - used || len > s->size - idx)
    return comm_set_error(c->comm, CHORUS_ERR_INTERNAL,
                          "rank %d peer %d: socket commit of %zu bytes exceeds the reserved "
                          "space", c->comm->rank, c->peer, len);
  s->tx_tail += len;
  return CHORUS_SUCCESS;
}

/* Collects the staging job's progress; clears staging once all of it is consumed. */
static chorus_result_t stage_collect(struct sock_conn *s) {
  if (s->rx_job) {
    size_t d = 0;
    chorus_result_t r = direct_collect(s, &s->rxj, &s->rx_job, s->stage + s->stage_got, "recv",
                                       &d);
    s->stage_got += d;
    s->n_staged += d;
    if (r != CHORUS_SUCCESS) return r;
  }
  if (!s->rx_job && s->stage_pos == s->stage_len) s->staging = 0;
  return CHORUS_SUCCESS;
}

static chorus_result_t sock_peek(conn_t *c, const void **ptr, size_t *len) {
  struct sock_conn *s = (struct sock_conn *)c;
  if (s->staging && s->rx_tail == s->rx_head) {
    *ptr = NULL;
    *len = 0;
    if (s->err) return s->err;
    CHECK(stage_collect(s));
    if (s->staging) {
      *ptr = s->stage + s->stage_pos;
      *len = s->stage_got - s->stage_pos;
      s->starving = 0; /* the thread reads the socket */
      return CHORUS_SUCCESS;
    }
  }
  size_t avail = (size_t)(s->rx_tail - s->rx_head);
  size_t idx = (size_t)(s->rx_head % s->size);
  size_t contig = s->size - idx;
  *ptr = s->rx + idx;
  *len = avail < contig ? avail : contig;
  s->starving = *len == 0;
  return CHORUS_SUCCESS;
}

static chorus_result_t sock_consume(conn_t *c, size_t len) {
  struct sock_conn *s = (struct sock_conn *)c;
  if (s->staging && s->rx_tail == s->rx_head && len) {
    if (len > s->stage_got - s->stage_pos)
      return comm_set_error(c->comm, CHORUS_ERR_INTERNAL,
                            "rank %d peer %d: socket consume of %zu bytes exceeds the %zu "
                            "staged", c->comm->rank, c->peer, len, s->stage_got - s->stage_pos);
    s->stage_pos += len;
    s->rx_head = s->rx_tail = s->rx_tail + len; /* the stream moved on past them */
    if (!s->rx_job && s->stage_pos == s->stage_len) s->staging = 0;
    return CHORUS_SUCCESS;
  }
  if (len > s->rx_tail - s->rx_head)
    return comm_set_error(c->comm, CHORUS_ERR_INTERNAL,
                          "rank %d peer %d: socket consume of %zu bytes exceeds the %llu "
                          "readable", c->comm->rank, c->peer, len,
                          (unsigned long long)(s->rx_tail - s->rx_head));
  s->rx_head += len;
  return CHORUS_SUCCESS;
}

/* ------------------------------------------------------------ striping */
static uint64_t chunk_end(const struct sock_conn *s, uint64_t pos) {
  return (pos / s->chunk + 1) * s->chunk;
}

/* Moves *pos by n bytes (never past its chunk); from the end of a chunk a sub-connection
 * goes on with its next one, nsub - 1 chunks further. */
static void sub_advance(const struct sock_conn *s, uint64_t *pos, uint64_t n) {
  uint64_t end = chunk_end(s, *pos);
  *pos += n;
  if (*pos == end) *pos += (uint64_t)(s->nsub - 1) * s->chunk;
}

/* Each sub-connection sends what the tx ring holds of its chunks (two system calls at
 * most: a chunk may end inside its window); the ring frees up to the lowest position any
 * sub-connection still has to send. */
static chorus_result_t striped_send(struct sock_conn *s, int *moved) {
  struct iovec iov[2];
  uint64_t head = s->tx_tail;
  for (int i = 0; i < s->nsub; i++) {
    struct sock_sub *u = &s->sub[i];
    for (int k = 0; k < 2 && u->spos < s->tx_tail; k++) {
      uint64_t end = chunk_end(s, u->spos);
      size_t len = (size_t)((end < s->tx_tail ? end : s->tx_tail) - u->spos);
      struct msghdr mh = {0};
      mh.msg_iov = iov;
      mh.msg_iovlen = (size_t)ring_iov(s->tx, s->size, u->spos, len, iov);
      ssize_t r = sendmsg(u->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        return conn_fail(s, errno, "send");
      }
      sub_advance(s, &u->spos, (uint64_t)r);
      *moved = 1;
      if ((size_t)r < len) break;
    }
    if (u->spos < head) head = u->spos;
  }
  s->tx_head = head;
  return CHORUS_SUCCESS;
}

/* Each sub-connection receives into the ring at the places of its chunks, within the
 * ring's free window; bytes are readable up to the lowest position still missing. */
static chorus_result_t striped_recv(struct sock_conn *s, int *moved) {
  struct iovec iov[2];
  uint64_t tail = UINT64_MAX;
  for (int i = 0; i < s->nsub; i++) {
    struct sock_sub *u = &s->sub[i];
    for (int k = 0; k < 2 && !u->eof; k++) {
      uint64_t limit = s->rx_head + s->size;
      if (u->rpos >= limit) break;
      uint64_t end = chunk_end(s, u->rpos);
      size_t len = (size_t)((end < limit ? end : limit) - u->rpos);
      struct msghdr mh = {0};
      mh.msg_iov = iov;
      mh.msg_iovlen = (size_t)ring_iov(s->rx, s->size, u->rpos, len, iov);
      ssize_t r = recvmsg(u->fd, &mh, MSG_DONTWAIT);
      if (r == 0) {
        u->eof = 1;
      } else if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        return conn_fail(s, errno, "recv");
      } else {
        sub_advance(s, &u->rpos, (uint64_t)r);
        s->n_ring += (uint64_t)r;
        *moved = 1;
        if ((size_t)r < len) break;
      }
    }
    if (u->rpos < tail) tail = u->rpos;
  }
  s->rx_tail = tail;
  /* the stream has ended once the sub-connection that owes its next byte has */
  s->eof = s->sub[(tail / s->chunk) % (uint64_t)s->nsub].eof;
  return CHORUS_SUCCESS;
}

/* The sub-connections are polled as one fd, their epoll set: interest is kept per
 * sub-connection (changed only when it changes). The set is readable when any of them is
 * ready for what it is registered for, sending included; POLLOUT in the answer only tells
 * callers that bytes wait to be sent. */
static int striped_pollfd(struct sock_conn *s, struct pollfd *pfd) {
  int owner = (int)((s->rx_tail / s->chunk) % (uint64_t)s->nsub), any = 0;
  for (int i = 0; i < s->nsub; i++) {
    struct sock_sub *u = &s->sub[i];
    uint32_t ev = 0;
    if (!u->eof ? u->rpos < s->rx_head + s->size : (i == owner && s->starving)) ev |= EPOLLIN;
    if (u->spos < (s->direct_tx ? s->direct_end : s->tx_tail)) ev |= EPOLLOUT;
    if (ev != u->events) {
      struct epoll_event e = {.events = ev, .data.u32 = (uint32_t)i};
      if (epoll_ctl(s->epfd, EPOLL_CTL_MOD, u->fd, &e) != 0) {
        conn_fail(s, errno, "epoll_ctl(MOD) of a TCP sub-connection");
        return 0;
      }
      u->events = ev;
    }
    any |= ev != 0;
  }
  pfd->fd = s->epfd;
  pfd->events =
      (short)((any ? POLLIN : 0) | (s->tx_tail != s->tx_head || s->direct_tx ? POLLOUT : 0));
  pfd->revents = 0;
  return 1;
}

/* write_direct of a striped connection: src is the stream from tx_tail on. Each
 * sub-connection sends its part, from the ring below tx_tail and from src above it, in one
 * sendmsg per chunk piece; *wrote is the prefix of src that every sub-connection has
 * passed. Sub-connections that ran further ahead inside src remember it (their positions):
 * the caller passes the rest of the same buffer next time (msg.c: once direct, direct to
 * the end), and commits nothing to the ring before it is all written. */
static chorus_result_t striped_write_direct(conn_t *c, const void *src, size_t n, size_t *wrote,
                                            int *progressed) {
  struct sock_conn *s = (struct sock_conn *)c;
  *wrote = 0;
  if (s->err) return s->err;
  const uint64_t base = s->tx_tail, end = base + n;
  uint64_t low = end;
  int moved = 0;
  s->direct_end = end;
  for (int i = 0; i < s->nsub; i++) {
    struct sock_sub *u = &s->sub[i];
    for (int k = 0; k < 2 && u->spos < end; k++) {
      uint64_t ce = chunk_end(s, u->spos), stop = ce < end ? ce : end;
      struct iovec iov[3];
      int niov = 0;
      if (u->spos < base)
        niov = ring_iov(s->tx, s->size, u->spos, (size_t)((stop < base ? stop : base) - u->spos),
                        iov);
      if (stop > base) {
        uint64_t from = u->spos > base ? u->spos : base;
        iov[niov].iov_base = (uint8_t *)(uintptr_t)src + (from - base);
        iov[niov].iov_len = (size_t)(stop - from);
        niov++;
      }
      size_t len = (size_t)(stop - u->spos);
      struct msghdr mh = {0};
      mh.msg_iov = iov;
      mh.msg_iovlen = (size_t)niov;
      ssize_t r = sendmsg(u->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        return conn_fail(s, errno, "send");
      }
      sub_advance(s, &u->spos, (uint64_t)r);
      moved = 1;
      if ((size_t)r < len) break;
    }
    if (u->spos < low) low = u->spos;
  }
  if (low > base) {
    /* the ring is empty and the stream moved on by the direct bytes: positions follow */
    *wrote = (size_t)(low - base);
    s->tx_head = s->tx_tail = low;
  } else {
    s->tx_head = low;
  }
  if (moved) *progressed = 1;
  s->direct_tx = *wrote < n;
  return CHORUS_SUCCESS;
}

/* Has the peer published a failure? Asked once per closed connection; the failing peer
 * publishes before it closes, so a short look suffices. Sets s->peer_failed_seq to the
 * collective it failed at (0: at once). */
static int peer_published_failure(struct sock_conn *s) {
  char key[32], v[32];
  size_t got = 0;
  snprintf(key, sizeof key, "failure/%d", s->base.peer);
  if (bs_try_get(s->base.comm, key, v, sizeof v - 1, &got, 1) != CHORUS_SUCCESS || got == 0)
    return 0;
  v[got < sizeof v ? got : sizeof v - 1] = 0;
  s->peer_failed_seq = strtoull(v, NULL, 10);
  return 1;
}

/* The closed peer failed at a collective this rank has reached (or failed outside one). */
static int peer_failure_reached(const struct sock_conn *s) {
  const struct op *cur = s->base.comm->current;
  return s->peer_failed_seq == 0 ||
         (cur && cur->kind != OP_SEND && cur->kind != OP_RECV && cur->seq >= s->peer_failed_seq);
}

/* One sendmsg() of what the outgoing ring holds (two iovecs over its wrap); sets *moved
 * (never clears it) if bytes went. */
static chorus_result_t ring_send(struct sock_conn *s, int *moved) {
  struct iovec iov[2];
  struct msghdr mh = {0};
  mh.msg_iov = iov;
  mh.msg_iovlen = (size_t)ring_iov(s->tx, s->size, s->tx_head,
                                   (size_t)(s->tx_tail - s->tx_head), iov);
  ssize_t r = sendmsg(s->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (r > 0) {
    s->tx_head += (uint64_t)r;
    *moved = 1;
  } else if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
    return conn_fail(s, errno, "send");
  }
  return CHORUS_SUCCESS;
}

/* One sendmsg() and one recvmsg() at most; both cover the ring's wrap with two iovecs.
 * *progressed is only ever set, never cleared (the engine ORs it over connections). */
static chorus_result_t sock_progress(conn_t *c, int *progressed) {
  struct sock_conn *s = (struct sock_conn *)c;
  struct iovec iov[2];
  int moved = 0;
  if (s->err) return s->err;

  size_t pending = (size_t)(s->tx_tail - s->tx_head);
  if (s->nsub > 1) {
    CHECK(striped_send(s, &moved));
    CHECK(striped_recv(s, &moved));
  } else {
    if (pending && !s->tx_job) CHECK(ring_send(s, &moved));

    if (!s->eof && !s->rx_job && !s->staging && !(s->direct_rx && s->rx_head == s->rx_tail)) {
      /* Restart an empty ring near offset 0 but keep index == stream position mod 16: the
       * ring end must stay a 16-byte boundary of the stream so no element straddles it. */
      if (s->rx_head == s->rx_tail) {
        uint64_t to = s->rx_tail % 16, by = s->rx_tail - to;
        s->rx_want = s->rx_want > s->rx_tail ? s->rx_want - by : 0; /* moves along */
        s->rx_head = s->rx_tail = to;
      }
      size_t used = (size_t)(s->rx_tail - s->rx_head), win = rx_window(s);
      size_t space = used < win ? win - used : 0;
      if (space) {
        struct msghdr mh = {0};
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)ring_iov(s->rx, s->size, s->rx_tail, space, iov);
        ssize_t r = recvmsg(s->fd, &mh, MSG_DONTWAIT);
        if (r > 0) {
          s->rx_tail += (uint64_t)r;
          s->n_ring += (uint64_t)r;
          moved = 1;
        } else if (r == 0) {
          s->eof = 1;
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          return conn_fail(s, errno, "recv");
        }
      }
    }
  }
  if (progressed && moved) *progressed = 1; /* never clear: the engine ORs over conns */
  /* After the peer closed, bytes that arrived before stay readable, and the close is an
   * error only once we need that peer: the reader found nothing to read, or we have bytes
   * for it. A peer that finished its part and exited must not fail an operation that no
   * longer involves it merely because the engine progresses every connection. */
  if (s->eof && s->rx_head == s->rx_tail && (s->starving || s->tx_tail != s->tx_head))
    return conn_fail(s, 0, "recv");
  /* Everything a closed peer sent has been read: if it closed because its communicator
   * failed (socket_abort_conns publishes that before closing), fail once this rank reaches
   * the collective it failed at, rather than when this rank next needs the peer, which may
   * be never (it may be waiting on a third rank). Earlier collectives still finish. */
  if (s->eof && s->rx_head == s->rx_tail) {
    if (!s->eof_probed) {
      s->eof_probed = 1;
      s->peer_failed = peer_published_failure(s);
    }
    if (s->peer_failed && peer_failure_reached(s)) return conn_fail(s, 0, "recv");
  }
  return CHORUS_SUCCESS;
}

static int sock_pollfd(conn_t *c, struct pollfd *pfd) {
  struct sock_conn *s = (struct sock_conn *)c;
  if (s->err) return 0; /* failed: nothing more to move */
  if (s->nsub > 1) return striped_pollfd(s, pfd);
  pfd->fd = s->fd;
  pfd->events = 0;
  pfd->revents = 0;
  /* After EOF, POLLIN would spin; but a starving reader must wake to see the error. */
  /* an I/O thread polls for the direction it moves (and wakes the engine when done) */
  if (!s->rx_job && !s->staging && (s->eof ? s->starving : s->rx_tail - s->rx_head < rx_window(s)))
    pfd->events |= POLLIN;
  if (!s->tx_job && (s->tx_tail != s->tx_head || s->direct_tx)) pfd->events |= POLLOUT;
  return 1;
}

static chorus_result_t sock_write_direct(conn_t *c, const void *src, size_t n, size_t *wrote,
                                         int *progressed) {
  struct sock_conn *s = (struct sock_conn *)c;
  *wrote = 0;
  if (s->err) return s->err;
  if (s->tx_job) {
    size_t d = 0;
    chorus_result_t r = direct_collect(s, &s->txj, &s->tx_job, src, "send", &d);
    if (d) {
      *wrote = d;
      s->tx_head = s->tx_tail = s->tx_tail + d;
      *progressed = 1;
    }
    return r;
  }
  struct iovec iov[3];
  size_t pending = (size_t)(s->tx_tail - s->tx_head);
  if (io_wanted(s, n)) {
    /* the ring's bytes (the message header) first, then the payload by the thread */
    if (pending) {
      CHECK(ring_send(s, progressed));
      s->direct_tx = s->tx_head != s->tx_tail;
      if (s->direct_tx) return CHORUS_SUCCESS;
    }
    io_post(s, &s->txj, 0, (void *)src, n);
    s->tx_job = 1;
    s->direct_tx = 0; /* the thread polls the socket, not the engine */
    return CHORUS_SUCCESS;
  }
  int k = pending ? ring_iov(s->tx, s->size, s->tx_head, pending, iov) : 0;
  iov[k].iov_base = (void *)src;
  iov[k].iov_len = n;
  struct msghdr mh = {0};
  mh.msg_iov = iov;
  mh.msg_iovlen = (size_t)k + 1;
  ssize_t r = sendmsg(s->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (r < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return conn_fail(s, errno, "send");
    r = 0;
  }
  if ((size_t)r <= pending) {
    s->tx_head += (uint64_t)r;
  } else {
    /* the ring is empty and the stream moved on by the direct bytes: positions follow */
    *wrote = (size_t)r - pending;
    s->tx_head = s->tx_tail = s->tx_tail + *wrote;
  }
  if (r > 0) *progressed = 1;
  s->direct_tx = *wrote < n;
  return CHORUS_SUCCESS;
}

static chorus_result_t sock_read_direct(conn_t *c, void *dst, size_t n, size_t *got,
                                        int *progressed) {
  struct sock_conn *s = (struct sock_conn *)c;
  *got = 0;
  if (s->err) return s->err;
  if (s->staging) return CHORUS_SUCCESS; /* staged bytes come first, through peek */
  if (s->rx_job) {
    size_t d = 0;
    chorus_result_t r = direct_collect(s, &s->rxj, &s->rx_job, dst, "recv", &d);
    if (d) {
      *got = d;
      s->n_direct += d;
      s->rx_head = s->rx_tail = s->rx_tail + d;
      *progressed = 1;
    }
    if (!s->rx_job) s->direct_rx = 0;
    return r;
  }
  if (s->rx_tail != s->rx_head) return CHORUS_SUCCESS; /* buffered bytes come first */
  if (s->eof) {
    s->starving = 1;
    return conn_fail(s, 0, "recv");
  }
  if (io_wanted(s, n)) {
    io_post(s, &s->rxj, 1, dst, n);
    s->rx_job = 1;
    s->direct_rx = 1; /* progress() leaves the socket's bytes to the thread */
    s->starving = 0;
    return CHORUS_SUCCESS;
  }
  /* dst first, then the (empty) ring's window from the stream position after dst */
  struct iovec iov[3];
  iov[0].iov_base = dst;
  iov[0].iov_len = n;
  int k = ring_iov(s->rx, s->size, s->rx_tail + n, rx_window(s), iov + 1);
  struct msghdr mh = {0};
  mh.msg_iov = iov;
  mh.msg_iovlen = (size_t)k + 1;
  ssize_t r = recvmsg(s->fd, &mh, MSG_DONTWAIT);
  if (r == 0) {
    s->eof = 1;
    s->starving = 1;
    return conn_fail(s, 0, "recv");
  }
  if (r < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return conn_fail(s, errno, "recv");
    r = 0;
  }
  if ((size_t)r <= n) {
    *got = (size_t)r;
    s->n_direct += (uint64_t)r;
    s->rx_head = s->rx_tail = s->rx_tail + (uint64_t)r;
  } else {
    *got = n;
    s->n_direct += n;
    s->n_ring += (uint64_t)r - n;
    s->rx_head = s->rx_tail + n;
    s->rx_tail += (uint64_t)r;
  }
  if (r > 0) *progressed = 1;
  s->direct_rx = *got < n;
  s->starving = *got < n;
  return CHORUS_SUCCESS;
}

/* ops->stage: the next n stream bytes are a payload read through peek. Whatever of it the
 * ring does not hold yet goes to an I/O thread, which receives it into the connection's
 * staging buffer while the engine reduces what has arrived (the engine would otherwise
 * make those receive calls itself between reductions). */
static chorus_result_t sock_stage(conn_t *c, size_t n) {
  struct sock_conn *s = (struct sock_conn *)c;
  if (s->err || s->staging || s->rx_job || s->eof || s->direct_rx) return CHORUS_SUCCESS;
  s->rx_want = s->rx_head + n; /* the ring may read ahead through this payload */
  size_t have = (size_t)(s->rx_tail - s->rx_head);
  if (have >= n) return CHORUS_SUCCESS;
  /* The payload starts on a 16-byte boundary of the stream and the ring keeps index ==
   * stream position mod 16: the ring's last r bytes are an unfinished 16-byte group, which
   * moves to the staging buffer's head so that no element straddles ring and stage. */
  size_t r = (size_t)(s->rx_tail % 16);
  if (r > have) r = have;
  size_t need = n - have; /* what the thread receives, after the r bytes moved over */
  if (need > STAGE_MAX || !io_wanted(s, need)) return CHORUS_SUCCESS;
  struct sock_state *st = c->comm->sock;
  if (s->stage_cap < r + need) {
    size_t cap = need + 16 < ((size_t)1 << 20) ? ((size_t)1 << 20) : need + 16;
    if (st->stage_total - s->stage_cap + cap > STAGE_TOTAL) return CHORUS_SUCCESS;
    uint8_t *b = malloc(cap); /* no realloc: the old bytes are not needed */
    if (!b) return CHORUS_SUCCESS; /* the ring route works without it */
    free(s->stage);
    st->stage_total = st->stage_total - s->stage_cap + cap;
    s->stage = b;
    s->stage_cap = cap;
  }
  if (r) memcpy(s->stage, s->rx + (size_t)((s->rx_tail - r) % s->size), r);
  io_post(s, &s->rxj, 1, s->stage + r, need);
  s->rx_tail -= r;
  s->rx_job = 1;
  s->staging = 1;
  s->stage_len = r + need;
  s->stage_got = r;
  s->stage_pos = 0;
  return CHORUS_SUCCESS;
}

/* Frees the connection itself too: the caller must drop its pointer. */
static void sock_close(conn_t *c) {
  struct sock_conn *s = (struct sock_conn *)c;
  if (!s) return;
  if (s->tx_job || s->rx_job) socket_stop_io(c->comm); /* no thread may touch s after */
  if (s->fd >= 0 && close(s->fd) != 0)
    TRACE(SUB_NET, c->comm ? c->comm->rank : -1, "socket: close: %s", strerror(errno));
  s->fd = -1;
  for (int i = 0; s->sub && i < s->nsub; i++)
    if (s->sub[i].fd >= 0 && close(s->sub[i].fd) != 0)
      TRACE(SUB_NET, c->comm ? c->comm->rank : -1, "socket: close: %s", strerror(errno));
  if (s->epfd >= 0 && close(s->epfd) != 0)
    TRACE(SUB_NET, c->comm ? c->comm->rank : -1, "socket: close: %s", strerror(errno));
  if (s->stage && c->comm && c->comm->sock) c->comm->sock->stage_total -= s->stage_cap;
  if (c->comm && c->comm->sock) {
    c->comm->sock->rx_direct += s->n_direct;
    c->comm->sock->rx_ring += s->n_ring;
    c->comm->sock->rx_staged += s->n_staged;
  }
  free(s->stage);
  free(s->sub);
  free(s->tx);
  free(s->rx);
  free(s);
}

static const struct transport_ops sock_ops = {
    .name = "socket",
    .reserve = sock_reserve,
    .commit = sock_commit,
    .peek = sock_peek,
    .consume = sock_consume,
    .progress = sock_progress,
    .pollfd = sock_pollfd,
    .close = sock_close,
    .write_direct = sock_write_direct,
    .read_direct = sock_read_direct,
    .stage = sock_stage,
};

/* Striped connections send large payloads straight from the caller's buffer but receive
 * everything through the ring (docs/design.md, "Sockets between hosts"). */
static const struct transport_ops sock_striped_ops = {
    .name = "socket",
    .reserve = sock_reserve,
    .commit = sock_commit,
    .peek = sock_peek,
    .consume = sock_consume,
    .progress = sock_progress,
    .pollfd = sock_pollfd,
    .close = sock_close,
    .write_direct = striped_write_direct,
};

/* ------------------------------------------------------------ listen */
chorus_result_t socket_listen(struct chorus_comm *comm, struct peer_info *info) {
  if (comm->sock)
    return comm_set_error(comm, CHORUS_ERR_INTERNAL, "rank %d: socket_listen called twice",
                          comm->rank);
  struct sock_state *st = calloc(1, sizeof *st);
  if (!st)
    return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", comm->rank);
  st->listen_fd = -1;
  comm->sock = st;
  info->sock_addr[0] = 0;

  union sockaddr_any ip, bind_addr;
  chorus_result_t res = choose_interface(comm, st, &ip);
  if (res != CHORUS_SUCCESS) goto fail;

  memset(&bind_addr, 0, sizeof bind_addr);
  if (st->family == AF_INET6) {
    bind_addr.in6.sin6_family = AF_INET6;
    bind_addr.in6.sin6_addr = in6addr_any;
  } else {
    bind_addr.in4.sin_family = AF_INET;
    bind_addr.in4.sin_addr.s_addr = htonl(INADDR_ANY);
  }
  st->listen_fd = socket(st->family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (st->listen_fd < 0) {
    res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: socket() failed: %s", comm->rank,
                         strerror(errno));
    goto fail;
  }
  /* Accepted sockets inherit the buffer sizes; setting them before listen() lets the
   * window scale be negotiated for them. */
  set_bufsizes(comm, st->listen_fd);
  if (bind(st->listen_fd, &bind_addr.sa, addr_len(&bind_addr)) != 0) {
    res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: bind() of the listening socket "
                         "failed: %s", comm->rank, strerror(errno));
    goto fail;
  }
  /* Every higher rank connects before we accept: the backlog must hold them all. */
  long backlog = (long)comm->nranks * CHAN_COUNT * MAX_STREAMS + 64;
  if (listen(st->listen_fd, backlog > 65535 ? 65535 : (int)backlog) != 0) {
    res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: listen() failed: %s", comm->rank,
                         strerror(errno));
    goto fail;
  }
  union sockaddr_any bound;
  socklen_t bl = sizeof bound;
  if (getsockname(st->listen_fd, &bound.sa, &bl) != 0) {
    res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: getsockname() failed: %s",
                         comm->rank, strerror(errno));
    goto fail;
  }
  st->port = ntohs(bound.sa.sa_family == AF_INET6 ? bound.in6.sin6_port : bound.in4.sin_port);
  if (ip.sa.sa_family == AF_INET6)
    ip.in6.sin6_port = htons(st->port);
  else
    ip.in4.sin_port = htons(st->port);
  addr_format(&ip, st->addr, sizeof st->addr);
  snprintf(info->sock_addr, sizeof info->sock_addr, "%s", st->addr);
  INFO(SUB_NET, comm->rank, "socket: listening on port %u, advertising %s (interface %s)",
       (unsigned)st->port, st->addr, st->ifname);
  return CHORUS_SUCCESS;
fail:
  socket_teardown(comm);
  return res;
}

/* ------------------------------------------------------------ connect side */
static int same_host(const struct chorus_comm *comm, int p) {
  const char *a = comm->peers[comm->rank].hostid, *b = comm->peers[p].hostid;
  return a[0] && strncmp(a, b, HOSTID_LEN) == 0;
}

/* TCP connections to peer p: NSOCKS_PERTHREAD, or by default 1 on the same host (loopback
 * gains nothing from more) and STREAMS_REMOTE between hosts. */
static int streams_for(const struct chorus_comm *comm, int p) {
  int64_t v = param_int(PARAM_NSOCKS_PERTHREAD);
  if (v > 0) return v > MAX_STREAMS ? MAX_STREAMS : (int)v;
  return same_host(comm, p) ? 1 : STREAMS_REMOTE;
}

/* The stripe: small enough that the ring holds two rounds of every sub-connection, so
 * each has a chunk to fill while the reader drains another. */
static uint64_t chunk_for(int nsub) {
  if (nsub <= 1) return 0;
  uint64_t c = ((uint64_t)ring_size() / (2u * (uint64_t)nsub)) & ~(uint64_t)4095;
  return c < CHUNK_MIN ? CHUNK_MIN : c > CHUNK_MAX ? CHUNK_MAX : c;
}

/* One connected, non-blocking TCP socket to `to`, or an error naming rank p and addr. */
static chorus_result_t connect_fd(struct chorus_comm *comm, int p, const union sockaddr_any *to,
                                  const char *addr, int64_t deadline, int *out) {
  int64_t refused_until = now_ns() + (int64_t)REFUSED_RETRY_MS * 1000000;
  int fd = -1, err = 0;
  for (;;) {
    fd = socket(to->sa.sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
      return comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d peer %d: socket() failed: %s",
                            comm->rank, p, strerror(errno));
    set_bufsizes(comm, fd);
    err = 0;
    if (connect(fd, &to->sa, addr_len(to)) != 0) err = errno;
    if (err == EINPROGRESS || err == EINTR) {
      for (;;) {
        int ms = ms_until(deadline, 1000);
        if (ms == 0) {
          err = ETIMEDOUT;
          break;
        }
        struct pollfd pfd = {fd, POLLOUT, 0};
        int r = poll(&pfd, 1, ms);
        if (r < 0 && errno != EINTR) {
          err = errno;
          break;
        }
        if (r > 0) {
          socklen_t el = sizeof err;
          if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0) err = errno;
          break;
        }
      }
    }
    if (err == 0) break;
    close(fd);
    fd = -1;
    if (err == ECONNREFUSED && now_ns() < refused_until && ms_until(deadline, 100) > 0) {
      sleep_ms(50);
      continue;
    }
    if (err == ETIMEDOUT && now_ns() >= deadline)
      return comm_set_error(comm, CHORUS_ERR_TIMEOUT, "rank %d peer %d: connecting to rank %d "
                            "at %s timed out after %d ms", comm->rank, p, p, addr,
                            comm->timeout_ms);
    return comm_set_error(comm, err == ECONNREFUSED ? CHORUS_ERR_PEER : CHORUS_ERR_SYSTEM,
                          "rank %d peer %d: connecting to rank %d at %s failed: %s", comm->rank,
                          p, p, addr, strerror(err));
  }
  set_nodelay(comm, fd);
  *out = fd;
  return CHORUS_SUCCESS;
}

static chorus_result_t send_hello(struct chorus_comm *comm, int fd, int p, int ch, int stream,
                                  int nsub, uint64_t chunk, const char *addr, int64_t deadline) {
  uint8_t hello[HELLO_LEN];
  put32(hello, HELLO_MAGIC);
  put32(hello + 4, SOCK_VERSION);
  memcpy(hello + 8, comm->secret, 32);
  put32(hello + 40, (uint32_t)comm->rank);
  put32(hello + 44, (uint32_t)ch);
  put32(hello + 48, (uint32_t)comm->nranks);
  put32(hello + 52, (uint32_t)stream);
  put32(hello + 56, (uint32_t)nsub);
  put32(hello + 60, (uint32_t)chunk);
  int err = io_full(fd, hello, sizeof hello, deadline, 1);
  if (err)
    return comm_set_error(comm, err == ETIMEDOUT ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_PEER,
                          "rank %d peer %d: sending the hello to rank %d at %s failed: %s",
                          comm->rank, p, p, addr, err > 0 ? strerror(err) : "closed");
  return CHORUS_SUCCESS;
}

static chorus_result_t connect_one(struct chorus_comm *comm, int p, int ch, int64_t deadline,
                                   struct sock_conn **out) {
  union sockaddr_any to;
  char addr[ADDR_LEN];
  if (addr_parse(comm->peers[p].sock_addr, &to) != 0)
    return comm_set_error(comm, CHORUS_ERR_INVALID, "rank %d peer %d: peer advertised no "
                          "usable socket address ('%.*s')", comm->rank, p, ADDR_LEN,
                          comm->peers[p].sock_addr);
  /* Same host: loopback works whatever interface the peer advertised. */
  if (same_host(comm, p))
    addr_set_loopback(&to);
  else if (to.sa.sa_family == AF_INET6 && IN6_IS_ADDR_LINKLOCAL(&to.in6.sin6_addr))
    to.in6.sin6_scope_id = comm->sock ? comm->sock->ifindex : 0; /* out of our own link */
  addr_format(&to, addr, sizeof addr);

  int nsub = streams_for(comm, p);
  uint64_t chunk = chunk_for(nsub);
  struct sock_conn *s = NULL;
  chorus_result_t res;
  if (nsub == 1) {
    int fd = -1;
    CHECK(connect_fd(comm, p, &to, addr, deadline, &fd));
    res = send_hello(comm, fd, p, ch, 0, 1, 0, addr, deadline);
    if (res == CHORUS_SUCCESS) res = conn_new(comm, fd, p, ch, addr, 1, 0, &s);
    if (res != CHORUS_SUCCESS) {
      close(fd);
      return res;
    }
  } else {
    CHECK(conn_new(comm, -1, p, ch, addr, nsub, chunk, &s));
    for (int i = 0; i < nsub; i++) {
      int fd = -1;
      res = connect_fd(comm, p, &to, addr, deadline, &fd);
      if (res == CHORUS_SUCCESS) res = sub_add(s, i, fd);
      if (res == CHORUS_SUCCESS) res = send_hello(comm, fd, p, ch, i, nsub, chunk, addr, deadline);
      if (res != CHORUS_SUCCESS) {
        sock_close(&s->base);
        return res;
      }
    }
  }
  s->awaiting_ack = 1;
  *out = s;
  TRACE(SUB_NET, comm->rank, "socket: connected to rank %d (%s channel) at %s", p,
        chan_name(ch), addr);
  return CHORUS_SUCCESS;
}

int socket_ack_ok(const uint8_t *ack, int peer, int channel, int stream) {
  return get32(ack) == ACK_MAGIC && get32(ack + 4) == SOCK_VERSION &&
         get32(ack + 8) == (uint32_t)peer && get32(ack + 12) == (uint32_t)channel &&
         get32(ack + 16) == (uint32_t)stream;
}

/* Reads exactly the ack of every sub-connection (never more: data may follow right
 * behind it). */
static chorus_result_t wait_ack(struct sock_conn *s, int64_t deadline) {
  struct chorus_comm *comm = s->base.comm;
  int p = s->base.peer;
  for (int i = 0; i < s->nsub; i++) {
    uint8_t ack[ACK_LEN];
    int err = io_full(s->nsub > 1 ? s->sub[i].fd : s->fd, ack, sizeof ack, deadline, 0);
    if (err == ETIMEDOUT)
      return comm_set_error(comm, CHORUS_ERR_TIMEOUT, "rank %d peer %d: rank %d (%s) did not "
                            "accept our %s connection within %d ms", comm->rank, p, p,
                            s->peer_addr, chan_name(s->base.channel), comm->timeout_ms);
    if (err)
      return comm_set_error(comm, CHORUS_ERR_PEER, "rank %d peer %d: rank %d (%s) closed our "
                            "%s connection during setup (%s): it rejected the hello (different "
                            "job, communicator or version?) or exited", comm->rank, p, p,
                            s->peer_addr, chan_name(s->base.channel),
                            err > 0 ? strerror(err) : "EOF");
    if (!socket_ack_ok(ack, p, s->base.channel, i))
      return comm_set_error(comm, CHORUS_ERR_PEER, "rank %d peer %d: bad connection ack from "
                            "%s", comm->rank, p, s->peer_addr);
  }
  s->awaiting_ack = 0;
  return CHORUS_SUCCESS;
}

/* ------------------------------------------------------------ accept side */
struct pending {
  int fd;
  int64_t deadline;
  size_t got;
  uint8_t buf[HELLO_LEN];
  char addr[ADDR_LEN];
};

static void reject(struct chorus_comm *comm, struct pending *pd, const char *why) {
  WARN(comm->rank, "socket: rank %d rejected connection from %s: %s", comm->rank, pd->addr,
       why);
  close(pd->fd);
  pd->fd = -1;
}

/* Validates a complete hello; returns NULL if acceptable, else the reason. */
const char *socket_hello_problem(struct chorus_comm *comm, const uint8_t *h, char *why,
                                 size_t cap) {
  if (get32(h) != HELLO_MAGIC) return "bad magic (not a chorus peer)";
  if (get32(h + 4) != SOCK_VERSION) {
    snprintf(why, cap, "protocol version %u, expected %u", get32(h + 4), SOCK_VERSION);
    return why;
  }
  if (!secret_equal(h + 8, comm->secret, 32))
    return "wrong secret (another job or communicator)";
  uint32_t rank = get32(h + 40), ch = get32(h + 44), n = get32(h + 48);
  if (n != (uint32_t)comm->nranks) {
    snprintf(why, cap, "peer has %u ranks, we have %d", n, comm->nranks);
    return why;
  }
  if (rank >= (uint32_t)comm->nranks || (int)rank <= comm->rank) {
    snprintf(why, cap, "rank %u out of range (expected %d..%d)", rank, comm->rank + 1,
             comm->nranks - 1);
    return why;
  }
  if (ch >= CHAN_COUNT) {
    snprintf(why, cap, "bad channel %u", ch);
    return why;
  }
  uint32_t stream = get32(h + 52), nsub = get32(h + 56), chunk = get32(h + 60);
  if (nsub < 1 || nsub > MAX_STREAMS || stream >= nsub) {
    snprintf(why, cap, "sub-connection %u of %u (at most %d)", stream, nsub, MAX_STREAMS);
    return why;
  }
  if (nsub > 1 && (chunk < CHUNK_MIN || chunk > CHUNK_MAX || chunk % 16)) {
    snprintf(why, cap, "stripe of %u bytes (expected a multiple of 16 in %u..%u)", chunk,
             CHUNK_MIN, CHUNK_MAX);
    return why;
  }
  const conn_t *c = comm->conns[ch][rank];
  if (c) {
    /* only a striped connection still missing this sub-connection takes it */
    const struct sock_conn *sc = (const struct sock_conn *)c;
    if (!is_sock(c) || conn_complete(c) || sc->nsub != (int)nsub || sc->sub[stream].fd >= 0) {
      snprintf(why, cap, "duplicate or unexpected connection for rank %u %s channel", rank,
               chan_name((int)ch));
      return why;
    }
    if (sc->chunk != chunk) {
      snprintf(why, cap, "stripe of %u bytes differs from the %llu of its other "
               "sub-connections", chunk, (unsigned long long)sc->chunk);
      return why;
    }
  }
  return NULL;
}

/* The hello of pd is complete: validate, ack, install. Returns 1 if installed. */
static int hello_done(struct chorus_comm *comm, struct pending *pd, chorus_result_t *res) {
  char why[160];
  const char *bad = socket_hello_problem(comm, pd->buf, why, sizeof why);
  if (bad) {
    reject(comm, pd, bad);
    return 0;
  }
  int rank = (int)get32(pd->buf + 40), ch = (int)get32(pd->buf + 44);
  int stream = (int)get32(pd->buf + 52), nsub = (int)get32(pd->buf + 56);
  uint64_t chunk = get32(pd->buf + 60);
  uint8_t ack[ACK_LEN];
  put32(ack, ACK_MAGIC);
  put32(ack + 4, SOCK_VERSION);
  put32(ack + 8, (uint32_t)comm->rank);
  put32(ack + 12, (uint32_t)ch);
  put32(ack + 16, (uint32_t)stream);
  int err = io_full(pd->fd, ack, sizeof ack, pd->deadline, 1);
  if (err) {
    reject(comm, pd, err > 0 ? strerror(err) : "closed while sending the ack");
    return 0;
  }
  set_nodelay(comm, pd->fd);
  struct sock_conn *s = (struct sock_conn *)comm->conns[ch][rank];
  if (!s) {
    *res = conn_new(comm, nsub > 1 ? -1 : pd->fd, rank, ch, pd->addr, nsub, chunk, &s);
    if (*res != CHORUS_SUCCESS) return 0;   /* pd->fd is closed by the caller's cleanup */
    comm->conns[ch][rank] = &s->base;      /* striped: partial until every one is in */
  }
  if (nsub > 1) {
    int fd = pd->fd;
    pd->fd = -1;
    *res = sub_add(s, stream, fd);
    if (*res != CHORUS_SUCCESS) return 0;
  } else {
    pd->fd = -1;
  }
  TRACE(SUB_NET, comm->rank, "socket: accepted rank %d (%s channel, sub-connection %d of %d) "
        "from %s", rank, chan_name(ch), stream, nsub, s->peer_addr);
  return conn_complete(&s->base);
}

static chorus_result_t accept_timeout(struct chorus_comm *comm, const uint8_t *need) {
  char list[512];
  size_t len = 0;
  int shown = 0, missing = 0;
  list[0] = 0;
  for (int p = comm->rank + 1; p < comm->nranks; p++) {
    int m = 0;
    for (int ch = 0; ch < CHAN_COUNT; ch++)
      if (need[(size_t)p * CHAN_COUNT + ch] && !conn_complete(comm->conns[ch][p])) m = 1;
    if (!m) continue;
    missing++;
    if (len + 16 < sizeof list) {
      len += (size_t)snprintf(list + len, sizeof list - len, "%s%d", shown ? ", " : "", p);
      shown++;
    }
  }
  if (shown < missing)
    snprintf(list + len, sizeof list - len, " and %d more", missing - shown);
  return comm_set_error(comm, CHORUS_ERR_TIMEOUT, "rank %d: timed out after %d ms waiting for "
                        "socket connections from rank%s %s", comm->rank, comm->timeout_ms,
                        missing > 1 ? "s" : "", list);
}

static chorus_result_t accept_all(struct chorus_comm *comm, const uint8_t *need, int expected,
                                  int64_t deadline) {
  struct sock_state *st = comm->sock;
  struct pending *pend = calloc(MAX_PENDING, sizeof *pend);
  struct pollfd *pfd = calloc(MAX_PENDING + 1, sizeof *pfd);
  chorus_result_t res = CHORUS_SUCCESS;
  int npend = 0, got = 0;
  if (!pend || !pfd) {
    res = comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", comm->rank);
    goto out;
  }
  while (got < expected) {
    int64_t now = now_ns();
    if (now >= deadline) {
      res = accept_timeout(comm, need);
      goto out;
    }
    int64_t wake = deadline;
    int nfds = 0;
    if (npend < MAX_PENDING) pfd[nfds++] = (struct pollfd){st->listen_fd, POLLIN, 0};
    int first_pend = nfds;
    for (int i = 0; i < npend; i++) {
      pfd[nfds++] = (struct pollfd){pend[i].fd, POLLIN, 0};
      if (pend[i].deadline < wake) wake = pend[i].deadline;
    }
    int r = poll(pfd, (nfds_t)nfds, ms_until(wake, 1000));
    if (r < 0) {
      if (errno == EINTR) continue;
      res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: poll() failed: %s", comm->rank,
                           strerror(errno));
      goto out;
    }
    now = now_ns();
    /* Hellos first: they may complete expected connections. */
    for (int i = 0; i < npend; i++) {
      struct pending *pd = &pend[i];
      if (pfd[first_pend + i].revents) {
        ssize_t n = recv(pd->fd, pd->buf + pd->got, HELLO_LEN - pd->got, MSG_DONTWAIT);
        if (n > 0) {
          pd->got += (size_t)n;
          if (pd->got == HELLO_LEN) {
            got += hello_done(comm, pd, &res);
            if (res != CHORUS_SUCCESS) goto out;
          }
        } else if (n == 0) {
          reject(comm, pd, "closed before completing the hello");
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          reject(comm, pd, strerror(errno));
        }
      }
      if (pd->fd >= 0 && now >= pd->deadline)
        reject(comm, pd, "no complete hello within the time limit");
    }
    int k = 0;
    for (int i = 0; i < npend; i++)
      if (pend[i].fd >= 0) pend[k++] = pend[i];
    npend = k;
    /* Then new connections, as many as are queued and fit. */
    if (first_pend == 1 && pfd[0].revents) {
      while (npend < MAX_PENDING) {
        union sockaddr_any from;
        socklen_t fl = sizeof from;
        int fd = accept4(st->listen_fd, &from.sa, &fl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO || errno == EPERM)
            continue;
          res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: accept() failed: %s",
                               comm->rank, strerror(errno));
          goto out;
        }
        struct pending *pd = &pend[npend++];
        memset(pd, 0, sizeof *pd);
        pd->fd = fd;
        int64_t hd = now + (int64_t)HELLO_WAIT_MS * 1000000;
        pd->deadline = hd < deadline ? hd : deadline;
        addr_format(&from, pd->addr, sizeof pd->addr);
      }
    }
  }
out:
  if (pend)
    for (int i = 0; i < npend; i++)
      if (pend[i].fd >= 0) close(pend[i].fd);
  free(pend);
  free(pfd);
  return res;
}

/* ------------------------------------------------------------ connect_all */
/* Descriptors this process has open now. */
static long open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return 256; /* no /proc: a generous guess */
  long k = 0;
  while (readdir(d)) k++;
  closedir(d);
  return k;
}

/* The connections about to be made need `want` more file descriptors: raise the soft
 * RLIMIT_NOFILE towards the hard one when it is short (a large job between hosts opens
 * streams x channels per remote peer), and say so; warn, with what to change, when even the
 * hard limit is short (connecting then fails with EMFILE, naming the peer). */
static void ensure_fd_room(struct chorus_comm *comm, long want) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  const rlim_t need = (rlim_t)(open_fds() + want + FD_HEADROOM);
  if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= need) return;
  const rlim_t old = rl.rlim_cur;
  rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= need ? need : rl.rlim_max;
  if (rl.rlim_cur > old && setrlimit(RLIMIT_NOFILE, &rl) == 0)
    INFO(SUB_NET, comm->rank, "socket: raised the open-file limit (RLIMIT_NOFILE) from %llu to "
         "%llu for the %ld descriptors of TCP connections", (unsigned long long)old,
         (unsigned long long)rl.rlim_cur, want);
  else
    rl.rlim_cur = old;
  if (rl.rlim_cur < need)
    WARN(comm->rank, "socket: %ld descriptors needed for TCP connections, but the open-file limit "
         "(RLIMIT_NOFILE) is %llu: raise `ulimit -n` (hard limit) or use fewer connections per "
         "peer (CHORUS_NSOCKS_PERTHREAD=1)", want, (unsigned long long)rl.rlim_cur);
}

chorus_result_t socket_connect_all(struct chorus_comm *comm) {
  struct sock_state *st = comm->sock;
  int n = comm->nranks, me = comm->rank;
  chorus_result_t res = CHORUS_SUCCESS;
  if (!comm->peers || !comm->conns[CHAN_COLL] || !comm->conns[CHAN_P2P])
    return comm_set_error(comm, CHORUS_ERR_INTERNAL, "rank %d: socket_connect_all before the "
                          "peer table and connection arrays exist", me);
  uint8_t *need = calloc((size_t)n * CHAN_COUNT, 1);
  if (!need) return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", me);
  int nconnect = 0, naccept = 0;
  for (int p = 0; p < n; p++) {
    if (p == me || comm->conns[CHAN_COLL][p]) continue;
    for (int ch = 0; ch < CHAN_COUNT; ch++) {
      if (comm->conns[ch][p]) continue;
      need[(size_t)p * CHAN_COUNT + ch] = 1;
      if (p < me)
        nconnect++;
      else
        naccept++;
    }
  }
  if (nconnect + naccept == 0) goto done;
  long fds = 0; /* TCP connections, plus an epoll set per striped connection */
  for (int p = 0; p < n; p++)
    for (int ch = 0; ch < CHAN_COUNT; ch++)
      if (need[(size_t)p * CHAN_COUNT + ch]) {
        int k = streams_for(comm, p);
        fds += k + (k > 1);
      }
  ensure_fd_room(comm, fds);
  if (naccept && (!st || st->listen_fd < 0)) {
    res = comm_set_error(comm, CHORUS_ERR_INTERNAL, "rank %d: socket_connect_all without a "
                         "listening socket (socket_listen not called or failed)", me);
    goto done;
  }
  int timeout_ms = comm->timeout_ms > 0 ? comm->timeout_ms : 1800 * 1000;
  int64_t deadline = now_ns() + (int64_t)timeout_ms * 1000000;
  INFO(SUB_NET, me, "socket: connecting to %d and accepting %d connections", nconnect,
       naccept);

  /* Connect to lower ranks first: their kernels complete our connects from the backlog
   * even before they accept, so no rank waits on another here. */
  for (int p = 0; p < me; p++)
    for (int ch = 0; ch < CHAN_COUNT; ch++) {
      if (!need[(size_t)p * CHAN_COUNT + ch]) continue;
      struct sock_conn *s = NULL;
      CHECK_GOTO(connect_one(comm, p, ch, deadline, &s), res, done);
      comm->conns[ch][p] = &s->base;
    }
  if (naccept) CHECK_GOTO(accept_all(comm, need, naccept, deadline), res, done);
  /* The acks confirm our hellos were accepted; lower ranks send them from their accept
   * phase, which never waits on us. */
  for (int p = 0; p < me; p++)
    for (int ch = 0; ch < CHAN_COUNT; ch++) {
      conn_t *c = comm->conns[ch][p];
      if (!need[(size_t)p * CHAN_COUNT + ch] || !is_sock(c)) continue;
      CHECK_GOTO(wait_ack((struct sock_conn *)c, deadline), res, done);
    }
  INFO(SUB_NET, me, "socket: %d connections established", nconnect + naccept);
  int single = 0; /* peers over one TCP connection per channel: what I/O threads serve */
  for (int p = 0; p < n; p++) {
    const struct sock_conn *s = (const struct sock_conn *)comm->conns[CHAN_COLL][p];
    if (p == me || !need[(size_t)p * CHAN_COUNT + CHAN_COLL] || !is_sock(&s->base)) continue;
    single += s->nsub == 1;
    if (s->nsub > 1)
      INFO(SUB_NET, me, "socket: peer %d (%s): %d TCP connections per channel, striped in "
           "%llu-byte chunks", p, s->peer_addr, s->nsub, (unsigned long long)s->chunk);
    else
      INFO(SUB_NET, me, "socket: peer %d (%s): 1 TCP connection per channel", p, s->peer_addr);
  }
  if (st && single) {
    st->nio = io_threads_for(comm, single);
    INFO(SUB_NET, me, "socket: %d I/O thread%s for payloads of %zu bytes or more", st->nio,
         st->nio == 1 ? "" : "s", IO_MIN);
  }
done:
  free(need);
  if (res == CHORUS_SUCCESS && st && st->listen_fd >= 0) {
    if (close(st->listen_fd) != 0)
      TRACE(SUB_NET, me, "socket: closing the listener: %s", strerror(errno));
    st->listen_fd = -1;
  }
  return res;
}

/* Sends what the outgoing ring still holds (bytes of operations that completed here, which
 * the peer may still be waiting for), until deadline at most: a peer that reads nothing
 * more cannot hold a failing rank for long. */
static void flush_tx(struct sock_conn *s, int64_t deadline) {
  while (s->tx_tail != s->tx_head && !s->err) {
    struct pollfd pfd[MAX_STREAMS];
    int npfd = 0;
    if (s->nsub > 1) {
      int moved = 0;
      if (striped_send(s, &moved) != CHORUS_SUCCESS) return;
      if (moved) continue;
      for (int i = 0; i < s->nsub; i++)
        if (s->sub[i].spos < s->tx_tail) pfd[npfd++] = (struct pollfd){s->sub[i].fd, POLLOUT, 0};
    } else {
      struct iovec iov[2];
      struct msghdr mh = {0};
      mh.msg_iov = iov;
      mh.msg_iovlen = (size_t)ring_iov(s->tx, s->size, s->tx_head,
                                       (size_t)(s->tx_tail - s->tx_head), iov);
      ssize_t r = sendmsg(s->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (r > 0) {
        s->tx_head += (uint64_t)r;
        continue;
      }
      if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return;
      pfd[npfd++] = (struct pollfd){s->fd, POLLOUT, 0};
    }
    int ms = ms_until(deadline, 100);
    if (ms <= 0) return;
    if (poll(pfd, (nfds_t)npfd, ms) < 0 && errno != EINTR) return;
  }
}

void socket_abort_conns(struct chorus_comm *comm) {
  if (!comm->sock || comm->sock->aborted) return;
  comm->sock->aborted = 1;
  socket_stop_io(comm); /* nothing moves a user's buffer after its operation fails */
  int any = 0;
  for (int ch = 0; ch < CHAN_COUNT; ch++)
    for (int p = 0; comm->conns[ch] && p < comm->nranks; p++)
      if (is_sock(comm->conns[ch][p])) any = 1;
  if (!any) return;
  char key[32], msg[700];
  pthread_mutex_lock(&comm->err_mu);
  /* "<seq>|<text>": peers fail at that collective, not at earlier ones still finishing */
  snprintf(msg, sizeof msg, "%llu|%.600s", (unsigned long long)comm->failed_seq,
           comm->errbuf[0] ? comm->errbuf : "communicator failed");
  chorus_result_t err = comm->err ? comm->err : CHORUS_ERR_PEER;
  pthread_mutex_unlock(&comm->err_mu);
  snprintf(key, sizeof key, "failure/%d", comm->rank);
  if (bs_try_set(comm, key, msg, strlen(msg)) != CHORUS_SUCCESS)
    INFO(SUB_NET, comm->rank, "socket: could not publish the failure in the store");
  const int64_t flush_end = now_ns() + (int64_t)FLUSH_WAIT_MS * 1000000LL;
  for (int ch = 0; ch < CHAN_COUNT; ch++) {
    for (int p = 0; comm->conns[ch] && p < comm->nranks; p++) {
      conn_t *c = comm->conns[ch][p];
      if (!is_sock(c)) continue;
      struct sock_conn *s = (struct sock_conn *)c;
      if (!conn_complete(c)) continue;
      /* An orderly end of our direction (FIN after every byte already sent), not a reset: a
       * reset would discard bytes of earlier, completed exchanges the peer has not read yet.
       * The fd stays open (closed with the connection), so what the peer still sends is
       * absorbed rather than answered with a reset. The peer fails once it has read all
       * we sent and finds our failure in the store. */
      flush_tx(s, flush_end);
      for (int i = 0; i < s->nsub; i++) {
        int fd = s->nsub > 1 ? s->sub[i].fd : s->fd;
        if (fd >= 0 && shutdown(fd, SHUT_WR) != 0)
          TRACE(SUB_NET, comm->rank, "socket: shutdown: %s", strerror(errno));
      }
      if (!s->err) s->err = err;
    }
  }
  INFO(SUB_NET, comm->rank, "socket: connections closed after the failure: %s", msg);
}

void socket_teardown(struct chorus_comm *comm) {
  if (!comm || !comm->sock) return;
  struct sock_state *st = comm->sock;
  socket_stop_io(comm);
  uint64_t rx = st->rx_direct + st->rx_ring + st->rx_staged;
  if (rx)
    INFO(SUB_NET, comm->rank, "socket: received %llu bytes: %.1f%% straight into the callers' "
         "buffers, %.1f%% through receive rings, %.1f%% through staging buffers",
         (unsigned long long)rx, 100.0 * (double)st->rx_direct / (double)rx,
         100.0 * (double)st->rx_ring / (double)rx, 100.0 * (double)st->rx_staged / (double)rx);
  if (st->listen_fd >= 0 && close(st->listen_fd) != 0)
    TRACE(SUB_NET, comm->rank, "socket: closing the listener: %s", strerror(errno));
  free(st);
  comm->sock = NULL;
}
