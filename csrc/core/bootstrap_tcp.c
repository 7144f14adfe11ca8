/* bootstrap_tcp.c - the built-in TCP rendezvous behind chorus_bootstrap_tcp(): rank 0's
 * key/value server thread (one poll() loop, length-prefixed frames, GETs that wait for
 * their key) and the per-rank client that implements chorus_bootstrap_t. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

/* Wire format (big endian).
 * Request, 24 bytes: magic, op, keylen, timeout_ms (GET), vallen (u64, SET); then key
 * bytes, then value bytes. Response, 16 bytes: magic, status, vallen (u64); then value.
 * A client has at most one request outstanding; the server answers in order. */
#define BS_MAGIC 0x43424b56u /* "CBKV" */
#define BS_OP_SET 1u
#define BS_OP_GET 2u
#define BS_REQ_LEN 24
#define BS_RESP_LEN 16
#define BS_OK 0u
#define BS_TIMEOUT 1u
#define BS_BAD 2u
#define BS_FULL 3u
#define BS_MAX_KEY 1024u
#define BS_MAX_VAL ((uint64_t)64 << 20)
#define BS_MAX_TOTAL ((uint64_t)4 << 30) /* whole store; guards against runaway clients */
#define BS_MAX_CLIENTS 4096
/* Rank 0's release stops taking new clients but serves the connected ones until they have all
 * released theirs (or exited), at most this long: a peer still destroying its communicator
 * may ask the store why a connection closed, and should find it there. */
#define BS_LINGER_MS 1000
#define BS_BUCKETS 1024
#define BS_MAX_WAIT_MS (24 * 3600 * 1000)
#define BS_REPLY_SLACK_MS 30000          /* client waits this much past its GET timeout */

static void put64(uint8_t *p, uint64_t v) {
  put32(p, (uint32_t)(v >> 32));
  put32(p + 4, (uint32_t)v);
}
static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) << 32 | get32(p + 4); }

/* ================================================================ server */
/* Values are immutable and shared between the store and responses being sent. */
struct bs_value {
  int refs; /* server thread only */
  size_t len;
  uint8_t data[];
};
struct bs_entry {
  struct bs_entry *next;
  char *key;
  size_t keylen;
  struct bs_value *val;
};

enum { CL_HDR = 0, CL_BODY, CL_WAIT, CL_WRITE };
struct srv_client {
  int fd; /* -1: closed, removed at the end of the loop turn */
  int state;
  uint8_t hdr[BS_REQ_LEN];
  size_t hdr_got;
  uint32_t op, keylen, timeout_ms;
  uint64_t vallen;
  char *key;               /* keylen + 1 bytes */
  struct bs_value *inval;  /* SET value being received */
  size_t body_got;         /* key bytes, then value bytes */
  int64_t wait_deadline;
  uint8_t resp[BS_RESP_LEN];
  size_t resp_pos;
  struct bs_value *outval; /* value being sent (holds a reference) */
  size_t out_pos;
  char addr[64];
};

struct bs_server {
  int listen_fd;
  int wake[2]; /* pipe: release() writes one byte to stop the thread */
  pthread_t thread;
  int thread_started;
  struct bs_entry *buckets[BS_BUCKETS];
  uint64_t total;
  struct srv_client **cl;
  int ncl, capcl;
  int64_t accept_pause_until; /* after EMFILE: back off instead of spinning */
  int64_t linger_until;       /* release asked to stop: serve until then, or no client is left */
};

static void val_unref(struct bs_value *v) {
  if (v && --v->refs == 0) free(v);
}

static uint32_t key_hash(const char *k, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)k[i]) * 16777619u;
  return h;
}

static struct bs_entry *store_find(struct bs_server *s, const char *k, size_t n) {
  for (struct bs_entry *e = s->buckets[key_hash(k, n) % BS_BUCKETS]; e; e = e->next)
    if (e->keylen == n && memcmp(e->key, k, n) == 0) return e;
  return NULL;
}

/* The store takes its own reference to v on success. Returns BS_OK or BS_FULL;
 * *key_taken is set when key became the new entry's key. */
static uint32_t store_set(struct bs_server *s, char *key, size_t n, struct bs_value *v,
                          char **key_taken) {
  struct bs_entry *e = store_find(s, key, n);
  uint64_t old = e ? e->val->len : 0;
  if (s->total - old + v->len > BS_MAX_TOTAL) return BS_FULL;
  if (!e) {
    e = calloc(1, sizeof *e);
    if (!e) return BS_FULL;
    e->key = key;
    e->keylen = n;
    *key_taken = key;
    uint32_t b = key_hash(key, n) % BS_BUCKETS;
    e->next = s->buckets[b];
    s->buckets[b] = e;
  } else {
    val_unref(e->val);
  }
  v->refs++;
  e->val = v;
  s->total = s->total - old + v->len;
  return BS_OK;
}

static void client_reset(struct srv_client *c) {
  free(c->key);
  c->key = NULL;
  val_unref(c->inval);
  c->inval = NULL;
  val_unref(c->outval);
  c->outval = NULL;
  c->hdr_got = c->body_got = c->resp_pos = c->out_pos = 0;
  c->state = CL_HDR;
}

static void client_drop(struct srv_client *c, const char *why) {
  if (why) WARN(0, "bootstrap server: dropping client %s: %s", c->addr, why);
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
  client_reset(c);
}

static void respond(struct srv_client *c, uint32_t status, struct bs_value *v) {
  put32(c->resp, BS_MAGIC);
  put32(c->resp + 4, status);
  put64(c->resp + 8, v ? v->len : 0);
  c->resp_pos = c->out_pos = 0;
  free(c->key);
  c->key = NULL;
  if (v) v->refs++;
  c->outval = v;
  c->state = CL_WRITE;
}

/* A complete request has arrived. */
static void handle_request(struct bs_server *s, struct srv_client *c) {
  if (c->op == BS_OP_GET) {
    struct bs_entry *e = store_find(s, c->key, c->keylen);
    if (e) {
      respond(c, BS_OK, e->val);
    } else if (c->timeout_ms == 0) {
      respond(c, BS_TIMEOUT, NULL);
    } else {
      uint32_t ms = c->timeout_ms > BS_MAX_WAIT_MS ? BS_MAX_WAIT_MS : c->timeout_ms;
      c->wait_deadline = now_ns() + (int64_t)ms * 1000000;
      c->state = CL_WAIT;
    }
    return;
  }
  struct bs_value *v = c->inval;
  char *taken = NULL;
  c->inval = NULL; /* our reference, dropped at the end */
  uint32_t st = store_set(s, c->key, c->keylen, v, &taken);
  if (taken) c->key = NULL; /* now owned by the store entry */
  if (st == BS_OK) {
    const char *k = store_find(s, taken ? taken : c->key, c->keylen)->key;
    for (int i = 0; i < s->ncl; i++) {
      struct srv_client *w = s->cl[i];
      if (w->fd >= 0 && w->state == CL_WAIT && w->keylen == c->keylen &&
          memcmp(w->key, k, c->keylen) == 0)
        respond(w, BS_OK, v);
    }
  } else {
    WARN(0, "bootstrap server: store full, refusing a value of %zu bytes from %s", v->len,
         c->addr);
  }
  val_unref(v);
  respond(c, st, NULL);
}

static void client_write(struct srv_client *c);

/* Reads what is available of the current request. */
static void client_read(struct bs_server *s, struct srv_client *c) {
  for (int turns = 0; turns < 16 && c->fd >= 0 && (c->state == CL_HDR || c->state == CL_BODY);
       turns++) {
    void *dst;
    size_t want;
    if (c->state == CL_HDR) {
      dst = c->hdr + c->hdr_got;
      want = BS_REQ_LEN - c->hdr_got;
    } else if (c->body_got < c->keylen) {
      dst = c->key + c->body_got;
      want = c->keylen - c->body_got;
    } else {
      size_t vpos = c->body_got - c->keylen;
      dst = c->inval->data + vpos;
      want = c->inval->len - vpos;
    }
    ssize_t r = recv(c->fd, dst, want, MSG_DONTWAIT);
    if (r == 0) {
      /* A clean disconnect between requests is normal; mid-request is worth a line. */
      client_drop(c, c->state == CL_HDR && c->hdr_got == 0 ? NULL
                                                           : "disconnected mid-request");
      return;
    }
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
      client_drop(c, strerror(errno));
      return;
    }
    if (c->state == CL_HDR) {
      c->hdr_got += (size_t)r;
      if (c->hdr_got < BS_REQ_LEN) continue;
      c->op = get32(c->hdr + 4);
      c->keylen = get32(c->hdr + 8);
      c->timeout_ms = get32(c->hdr + 12);
      c->vallen = get64(c->hdr + 16);
      const char *bad = NULL;
      if (get32(c->hdr) != BS_MAGIC)
        bad = "bad magic";
      else if (c->op != BS_OP_SET && c->op != BS_OP_GET)
        bad = "unknown request";
      else if (c->keylen == 0 || c->keylen > BS_MAX_KEY)
        bad = "bad key length";
      else if (c->vallen > BS_MAX_VAL || (c->op == BS_OP_GET && c->vallen))
        bad = "bad value length";
      if (!bad) {
        c->key = calloc(1, (size_t)c->keylen + 1);
        if (c->op == BS_OP_SET) {
          c->inval = malloc(sizeof *c->inval + (size_t)c->vallen);
          if (c->inval) {
            c->inval->refs = 1;
            c->inval->len = (size_t)c->vallen;
          }
        }
        if (!c->key || (c->op == BS_OP_SET && !c->inval)) bad = "out of memory";
      }
      if (bad) {
        client_drop(c, bad);
        return;
      }
      c->body_got = 0;
      c->state = CL_BODY;
    } else {
      c->body_got += (size_t)r;
    }
    if (c->state == CL_BODY && c->body_got == c->keylen + (size_t)c->vallen) {
      handle_request(s, c);
      if (c->state == CL_WRITE) client_write(c); /* usually fits the socket buffer now */
      return;
    }
  }
}

static void client_write(struct srv_client *c) {
  struct iovec iov[2];
  int n = 0;
  if (c->resp_pos < BS_RESP_LEN)
    iov[n++] = (struct iovec){c->resp + c->resp_pos, BS_RESP_LEN - c->resp_pos};
  if (c->outval && c->out_pos < c->outval->len)
    iov[n++] = (struct iovec){c->outval->data + c->out_pos, c->outval->len - c->out_pos};
  if (n) {
    struct msghdr mh = {0};
    mh.msg_iov = iov;
    mh.msg_iovlen = (size_t)n;
    ssize_t r = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
        client_drop(c, strerror(errno));
      return;
    }
    size_t w = (size_t)r, h = BS_RESP_LEN - c->resp_pos;
    if (w <= h) {
      c->resp_pos += w;
    } else {
      c->resp_pos = BS_RESP_LEN;
      c->out_pos += w - h;
    }
  }
  if (c->resp_pos == BS_RESP_LEN && (!c->outval || c->out_pos == c->outval->len))
    client_reset(c); /* ready for the next request */
}

static void server_accept(struct bs_server *s) {
  while (s->ncl < BS_MAX_CLIENTS) {
    struct sockaddr_storage from;
    socklen_t fl = sizeof from;
    int fd = accept4(s->listen_fd, (struct sockaddr *)&from, &fl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      WARN(0, "bootstrap server: accept failed: %s", strerror(errno));
      s->accept_pause_until = now_ns() + 100 * 1000000LL;
      return;
    }
    if (s->ncl == s->capcl) {
      int cap = s->capcl ? s->capcl * 2 : 16;
      struct srv_client **n = realloc(s->cl, (size_t)cap * sizeof *n);
      if (!n) {
        WARN(0, "bootstrap server: out of memory accepting a client");
        close(fd);
        return;
      }
      s->cl = n;
      s->capcl = cap;
    }
    struct srv_client *c = calloc(1, sizeof *c);
    if (!c) {
      WARN(0, "bootstrap server: out of memory accepting a client");
      close(fd);
      return;
    }
    c->fd = fd;
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0)
      TRACE(SUB_INIT, 0, "bootstrap server: TCP_NODELAY: %s", strerror(errno));
    char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
    if (getnameinfo((struct sockaddr *)&from, fl, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0)
      snprintf(host, sizeof host, "?");
    snprintf(c->addr, sizeof c->addr, "%.46s:%.8s", host, serv);
    s->cl[s->ncl++] = c;
  }
}

static void *server_main(void *arg) {
  struct bs_server *s = arg;
  struct pollfd *pfd = NULL;
  int cap = 0;
  for (;;) {
    int want = s->ncl + 2;
    if (want > cap) {
      struct pollfd *n = realloc(pfd, (size_t)want * sizeof *n);
      if (!n) {
        WARN(0, "bootstrap server: out of memory; retrying");
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
        continue;
      }
      pfd = n;
      cap = want;
    }
    int64_t now = now_ns(), wake = now + 1000 * 1000000LL;
    if (s->linger_until) {
      if (s->ncl == 0 || now >= s->linger_until) break;
      if (s->linger_until < wake) wake = s->linger_until;
    }
    int nf = 0;
    pfd[nf++] = (struct pollfd){s->wake[0], s->linger_until ? 0 : POLLIN, 0};
    int lidx = -1;
    if (!s->linger_until && s->ncl < BS_MAX_CLIENTS && now >= s->accept_pause_until) {
      lidx = nf;
      pfd[nf++] = (struct pollfd){s->listen_fd, POLLIN, 0};
    } else if (s->accept_pause_until > now && s->accept_pause_until < wake) {
      wake = s->accept_pause_until;
    }
    int first = nf, ncl = s->ncl;
    for (int i = 0; i < ncl; i++) {
      struct srv_client *c = s->cl[i];
      short ev = c->state == CL_WRITE ? POLLOUT : c->state == CL_WAIT ? POLLRDHUP : POLLIN;
      pfd[nf++] = (struct pollfd){c->fd, ev, 0};
      if (c->state == CL_WAIT && c->wait_deadline < wake) wake = c->wait_deadline;
    }
    int r = poll(pfd, (nfds_t)nf, ms_until(wake, 1000));
    if (r < 0 && errno != EINTR) {
      WARN(0, "bootstrap server: poll failed: %s", strerror(errno));
      struct timespec ts = {0, 10 * 1000000L};
      nanosleep(&ts, NULL);
      continue;
    }
    if (r > 0 && pfd[0].revents) { /* release() asked us to stop: no new clients from now */
      s->linger_until = now_ns() + BS_LINGER_MS * 1000000LL;
      close(s->listen_fd);
      s->listen_fd = -1;
      lidx = -1;
    }
    now = now_ns();
    for (int i = 0; i < ncl; i++) {
      struct srv_client *c = s->cl[i];
      short rev = r > 0 ? pfd[first + i].revents : 0;
      if (c->fd < 0) continue;
      if (c->state == CL_WAIT) {
        /* A waiter that hung up is gone; one whose time ran out gets TIMEOUT. */
        if (rev & (POLLRDHUP | POLLHUP | POLLERR)) {
          client_drop(c, NULL);
          continue;
        }
        if (now >= c->wait_deadline) respond(c, BS_TIMEOUT, NULL);
        continue; /* written next turn, when poll says POLLOUT */
      }
      if (!rev) continue;
      if (c->state == CL_WRITE)
        client_write(c);
      else
        client_read(s, c);
    }
    if (lidx >= 0 && r > 0 && pfd[lidx].revents) server_accept(s);
    int k = 0;
    for (int i = 0; i < s->ncl; i++) {
      if (s->cl[i]->fd >= 0)
        s->cl[k++] = s->cl[i];
      else
        free(s->cl[i]);
    }
    s->ncl = k;
  }
  free(pfd);
  return NULL;
}

static void server_free(struct bs_server *s) {
  if (!s) return;
  if (s->listen_fd >= 0) close(s->listen_fd);
  for (int i = 0; i < 2; i++)
    if (s->wake[i] >= 0) close(s->wake[i]);
  for (int i = 0; i < s->ncl; i++) {
    client_drop(s->cl[i], NULL);
    free(s->cl[i]);
  }
  free(s->cl);
  for (int b = 0; b < BS_BUCKETS; b++)
    for (struct bs_entry *e = s->buckets[b], *n; e; e = n) {
      n = e->next;
      val_unref(e->val);
      free(e->key);
      free(e);
    }
  free(s);
}

static void server_stop(struct bs_server *s) {
  if (!s) return;
  if (s->thread_started) {
    char b = 1;
    ssize_t w;
    do {
      w = write(s->wake[1], &b, 1);
    } while (w < 0 && errno == EINTR);
    if (w != 1) WARN(0, "bootstrap server: cannot wake the server thread: %s", strerror(errno));
    else if ((errno = pthread_join(s->thread, NULL)) != 0)
      WARN(0, "bootstrap server: pthread_join: %s", strerror(errno));
    /* If waking failed the thread still runs; leaking beats freeing under its feet. */
    if (w != 1) return;
  }
  server_free(s);
}

/* ================================================================ address parsing */
/* "host:port" or "[v6]:port" -> host, port strings. Returns 0 or -1. */
static int split_hostport(const char *addr, char *host, size_t hcap, char *port, size_t pcap) {
  const char *colon, *hs = addr;
  size_t hl;
  if (addr[0] == '[') {
    const char *close = strchr(addr, ']');
    if (!close || close[1] != ':') return -1;
    hs = addr + 1;
    hl = (size_t)(close - hs);
    colon = close + 1;
  } else {
    colon = strrchr(addr, ':');
    if (!colon) return -1;
    hl = (size_t)(colon - addr);
  }
  if (hl == 0 || hl >= hcap) return -1;
  memcpy(host, hs, hl);
  host[hl] = 0;
  const char *p = colon + 1;
  size_t pl = strlen(p);
  if (pl == 0 || pl >= pcap || pl > 5) return -1;
  unsigned long v = 0;
  for (size_t i = 0; i < pl; i++) {
    if (p[i] < '0' || p[i] > '9') return -1;
    v = v * 10 + (unsigned long)(p[i] - '0');
  }
  if (v > 65535) return -1;
  snprintf(port, pcap, "%lu", v);
  return 0;
}

static int is_loopback(const struct sockaddr *sa) {
  if (sa->sa_family == AF_INET)
    return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
  if (sa->sa_family == AF_INET6)
    return IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)sa)->sin6_addr);
  return 0;
}

/* Binds rank 0's listener. A loopback host binds loopback only; any other binds the
 * wildcard of its family (a hostname may resolve differently on the server itself). */
static chorus_result_t server_start(const char *host, const char *port, int nranks,
                                    struct bs_server **out, unsigned *bound_port) {
  struct addrinfo hints = {0}, *ai = NULL;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  int gr = getaddrinfo(host, port, &hints, &ai);
  if (gr != 0) {
    WARN(0, "bootstrap: cannot resolve '%s': %s", host, gai_strerror(gr));
    return CHORUS_ERR_INVALID;
  }
  struct bs_server *s = calloc(1, sizeof *s);
  if (!s) {
    freeaddrinfo(ai);
    return CHORUS_ERR_NOMEM;
  }
  s->listen_fd = s->wake[0] = s->wake[1] = -1;
  chorus_result_t res = CHORUS_ERR_SYSTEM;
  struct sockaddr_storage ss;
  socklen_t sl = (socklen_t)ai->ai_addrlen;
  memcpy(&ss, ai->ai_addr, ai->ai_addrlen);
  int family = ai->ai_family;
  freeaddrinfo(ai);
  if (!is_loopback((struct sockaddr *)&ss)) {
    uint16_t p = htons((uint16_t)atoi(port));
    memset(&ss, 0, sizeof ss);
    if (family == AF_INET6) {
      struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
      a->sin6_family = AF_INET6;
      a->sin6_addr = in6addr_any;
      a->sin6_port = p;
      sl = sizeof *a;
    } else {
      struct sockaddr_in *a = (struct sockaddr_in *)&ss;
      a->sin_family = AF_INET;
      a->sin_addr.s_addr = htonl(INADDR_ANY);
      a->sin_port = p;
      sl = sizeof *a;
    }
  }
  int one = 1, zero = 0;
  s->listen_fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s->listen_fd < 0) {
    WARN(0, "bootstrap: socket() failed: %s", strerror(errno));
    goto fail;
  }
  /* Restarting a job on the same port must not wait for TIME_WAIT. */
  if (setsockopt(s->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0)
    WARN(0, "bootstrap: SO_REUSEADDR failed: %s", strerror(errno));
  if (family == AF_INET6 &&
      setsockopt(s->listen_fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero) != 0)
    TRACE(SUB_INIT, 0, "bootstrap: IPV6_V6ONLY off failed: %s", strerror(errno));
  if (bind(s->listen_fd, (struct sockaddr *)&ss, sl) != 0) {
    WARN(0, "bootstrap: cannot listen on %s:%s: %s", host, port, strerror(errno));
    goto fail;
  }
  int backlog = nranks + 64 > 4096 ? 4096 : nranks + 64;
  if (listen(s->listen_fd, backlog) != 0) {
    WARN(0, "bootstrap: listen() failed: %s", strerror(errno));
    goto fail;
  }
  sl = sizeof ss;
  if (getsockname(s->listen_fd, (struct sockaddr *)&ss, &sl) != 0) {
    WARN(0, "bootstrap: getsockname() failed: %s", strerror(errno));
    goto fail;
  }
  *bound_port = ntohs(family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                         : ((struct sockaddr_in *)&ss)->sin_port);
  if (pipe2(s->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    s->wake[0] = s->wake[1] = -1;
    WARN(0, "bootstrap: pipe2() failed: %s", strerror(errno));
    goto fail;
  }
  /* Signals go to the application's threads, never to this helper. */
  sigset_t all, old;
  sigfillset(&all);
  int e = pthread_sigmask(SIG_SETMASK, &all, &old);
  int ce = pthread_create(&s->thread, NULL, server_main, s);
  if (e == 0) pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (ce != 0) {
    WARN(0, "bootstrap: cannot start the server thread: %s", strerror(ce));
    goto fail;
  }
  s->thread_started = 1;
  INFO(SUB_INIT, 0, "bootstrap: serving on %s:%u", host, *bound_port);
  *out = s;
  return CHORUS_SUCCESS;
fail:
  server_free(s);
  return res;
}

/* ================================================================ client */
struct bs_client {
  int fd;
  int rank;
  int broken; /* stream out of sync or server gone: every later call fails */
  int timeout_ms;
  pthread_mutex_t mu;
  struct bs_server *server; /* rank 0 only */
  char addr[300];
};

static chorus_result_t client_io_error(struct bs_client *c, int err, const char *what) {
  c->broken = 1;
  WARN(c->rank, "bootstrap: %s with the server at %s failed: %s", what, c->addr,
       err == -1 ? "server closed the connection (rank 0 exited or released the bootstrap)"
                 : strerror(err));
  return err == ETIMEDOUT ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_PEER;
}

static chorus_result_t check_key(struct bs_client *c, const char *key, size_t *kl) {
  if (!key) return CHORUS_ERR_INVALID;
  *kl = strnlen(key, BS_MAX_KEY + 1);
  if (*kl == 0 || *kl > BS_MAX_KEY) {
    WARN(c->rank, "bootstrap: key length %zu outside 1..%u", *kl, BS_MAX_KEY);
    return CHORUS_ERR_INVALID;
  }
  return CHORUS_SUCCESS;
}

static chorus_result_t send_request(struct bs_client *c, uint32_t op, const char *key,
                                    size_t kl, uint32_t tmo, const void *val, size_t vl,
                                    int64_t deadline) {
  uint8_t hdr[BS_REQ_LEN];
  put32(hdr, BS_MAGIC);
  put32(hdr + 4, op);
  put32(hdr + 8, (uint32_t)kl);
  put32(hdr + 12, tmo);
  put64(hdr + 16, vl);
  int err = io_full(c->fd, hdr, sizeof hdr, deadline, 1);
  if (!err) err = io_full(c->fd, (void *)key, kl, deadline, 1);
  if (!err && vl) err = io_full(c->fd, (void *)val, vl, deadline, 1);
  return err ? client_io_error(c, err, "sending a request") : CHORUS_SUCCESS;
}

static chorus_result_t read_response(struct bs_client *c, uint32_t *status, uint64_t *vl,
                                     int64_t deadline) {
  uint8_t r[BS_RESP_LEN];
  int err = io_full(c->fd, r, sizeof r, deadline, 0);
  if (err) return client_io_error(c, err, "reading a response");
  *status = get32(r + 4);
  *vl = get64(r + 8);
  if (get32(r) != BS_MAGIC || *status > BS_FULL || *vl > BS_MAX_VAL) {
    c->broken = 1;
    WARN(c->rank, "bootstrap: malformed response from the server at %s", c->addr);
    return CHORUS_ERR_PEER;
  }
  return CHORUS_SUCCESS;
}

static chorus_result_t status_result(struct bs_client *c, uint32_t st, const char *key) {
  switch (st) {
  case BS_OK: return CHORUS_SUCCESS;
  case BS_TIMEOUT: return CHORUS_ERR_TIMEOUT;
  case BS_FULL:
    WARN(c->rank, "bootstrap: the server refused key '%s': store full", key);
    return CHORUS_ERR_NOMEM;
  default:
    WARN(c->rank, "bootstrap: the server rejected the request for key '%s'", key);
    return CHORUS_ERR_INVALID;
  }
}

static chorus_result_t cl_set(void *ctx, const char *key, const void *val, size_t len) {
  struct bs_client *c = ctx;
  size_t kl;
  if (!c) return CHORUS_ERR_INVALID;
  CHECK(check_key(c, key, &kl));
  if (!val && len) {
    WARN(c->rank, "bootstrap: NULL value of %zu bytes for key '%s'", len, key);
    return CHORUS_ERR_INVALID;
  }
  if (len > BS_MAX_VAL) {
    WARN(c->rank, "bootstrap: value of %zu bytes for key '%s' exceeds the limit of %llu", len,
         key, (unsigned long long)BS_MAX_VAL);
    return CHORUS_ERR_INVALID;
  }
  pthread_mutex_lock(&c->mu);
  chorus_result_t res = CHORUS_ERR_PEER;
  if (!c->broken) {
    int64_t deadline = now_ns() + (int64_t)c->timeout_ms * 1000000;
    uint32_t st;
    uint64_t vl;
    res = send_request(c, BS_OP_SET, key, kl, 0, val, len, deadline);
    if (res == CHORUS_SUCCESS) res = read_response(c, &st, &vl, deadline);
    if (res == CHORUS_SUCCESS && vl != 0) {
      c->broken = 1;
      res = CHORUS_ERR_PEER;
    }
    if (res == CHORUS_SUCCESS) res = status_result(c, st, key);
  }
  pthread_mutex_unlock(&c->mu);
  return res;
}

static chorus_result_t cl_get(void *ctx, const char *key, void *buf, size_t cap, size_t *len,
                              int timeout_ms) {
  struct bs_client *c = ctx;
  size_t kl;
  if (!c) return CHORUS_ERR_INVALID;
  CHECK(check_key(c, key, &kl));
  if (!buf && cap) return CHORUS_ERR_INVALID;
  if (timeout_ms <= 0) timeout_ms = c->timeout_ms;
  pthread_mutex_lock(&c->mu);
  chorus_result_t res = CHORUS_ERR_PEER;
  if (!c->broken) {
    int64_t now = now_ns();
    /* The server answers TIMEOUT itself; our own limit only catches a dead server. */
    int64_t deadline = now + ((int64_t)timeout_ms + BS_REPLY_SLACK_MS) * 1000000;
    uint32_t st;
    uint64_t vl;
    res = send_request(c, BS_OP_GET, key, kl, (uint32_t)timeout_ms, NULL, 0,
                       now + (int64_t)c->timeout_ms * 1000000);
    if (res == CHORUS_SUCCESS) res = read_response(c, &st, &vl, deadline);
    if (res == CHORUS_SUCCESS && st == BS_OK) {
      size_t take = vl < cap ? (size_t)vl : cap;
      int err = io_full(c->fd, buf, take, deadline, 0);
      uint8_t scratch[4096];
      for (uint64_t rest = vl - take; !err && rest;) {
        size_t n = rest < sizeof scratch ? (size_t)rest : sizeof scratch;
        err = io_full(c->fd, scratch, n, deadline, 0);
        rest -= n;
      }
      if (err)
        res = client_io_error(c, err, "reading a value");
      else if (len)
        *len = (size_t)vl;
    } else if (res == CHORUS_SUCCESS) {
      if (vl != 0) {
        c->broken = 1;
        res = CHORUS_ERR_PEER;
      } else {
        res = status_result(c, st, key);
      }
      if (st == BS_TIMEOUT)
        INFO(SUB_INIT, c->rank, "bootstrap: key '%s' not set within %d ms", key, timeout_ms);
    }
  }
  pthread_mutex_unlock(&c->mu);
  return res;
}

static void cl_release(void *ctx) {
  struct bs_client *c = ctx;
  if (!c) return;
  if (c->fd >= 0) close(c->fd);
  server_stop(c->server);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

/* Retries until deadline: rank 0 may start its server after the others start. */
static chorus_result_t client_connect(struct bs_client *c, const char *host, const char *port,
                                      int64_t deadline) {
  int delay_ms = 20, warned = 0;
  int64_t start = now_ns();
  const char *last = "no attempt";
  char lastbuf[400];
  for (;;) {
    struct addrinfo hints = {0}, *ai = NULL;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    int gr = getaddrinfo(host, port, &hints, &ai);
    if (gr != 0) {
      snprintf(lastbuf, sizeof lastbuf, "resolving '%s': %s", host, gai_strerror(gr));
      last = lastbuf;
    }
    for (struct addrinfo *a = gr == 0 ? ai : NULL; a; a = a->ai_next) {
      int fd = socket(a->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        snprintf(lastbuf, sizeof lastbuf, "socket(): %s", strerror(errno));
        last = lastbuf;
        continue;
      }
      int err = 0;
      if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) err = errno;
      if (err == EINPROGRESS || err == EINTR) {
        int64_t att = now_ns() + 5000 * 1000000LL;
        struct pollfd pfd = {fd, POLLOUT, 0};
        int r = poll(&pfd, 1, ms_until(att < deadline ? att : deadline, 5000));
        if (r > 0) {
          socklen_t el = sizeof err;
          if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0) err = errno;
        } else {
          err = r == 0 ? ETIMEDOUT : errno;
        }
      }
      if (err == 0) {
        int one = 1;
        if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0)
          TRACE(SUB_INIT, c->rank, "bootstrap: TCP_NODELAY: %s", strerror(errno));
        c->fd = fd;
        freeaddrinfo(ai);
        INFO(SUB_INIT, c->rank, "bootstrap: connected to %s", c->addr);
        return CHORUS_SUCCESS;
      }
      close(fd);
      snprintf(lastbuf, sizeof lastbuf, "%s", strerror(err));
      last = lastbuf;
    }
    if (ai) freeaddrinfo(ai);
    int64_t now = now_ns();
    if (now >= deadline) break;
    if (!warned && now - start > 10000 * 1000000LL) {
      warned = 1;
      WARN(c->rank, "bootstrap: still trying to reach the server at %s (%s)", c->addr, last);
    }
    int ms = ms_until(deadline, delay_ms);
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    if (delay_ms < 500) delay_ms *= 2;
  }
  WARN(c->rank, "bootstrap: cannot reach the server at %s within %d ms (%s)", c->addr,
       c->timeout_ms, last);
  return CHORUS_ERR_TIMEOUT;
}

chorus_result_t chorus_bootstrap_tcp(const char *addr, int rank, int nranks, int timeout_ms,
                                     chorus_bootstrap_t *out) {
  char host[256], port[8];
  if (!addr || !out || nranks < 1 || rank < 0 || rank >= nranks) return CHORUS_ERR_INVALID;
  memset(out, 0, sizeof *out);
  if (split_hostport(addr, host, sizeof host, port, sizeof port) != 0) {
    WARN(rank, "bootstrap: address '%s' is not host:port", addr);
    return CHORUS_ERR_INVALID;
  }
  if (strcmp(port, "0") == 0 && nranks > 1) {
    WARN(rank, "bootstrap: port 0 is only allowed for a single rank (others cannot find it)");
    return CHORUS_ERR_INVALID;
  }
  if (timeout_ms <= 0) {
    int64_t t = param_int(PARAM_TIMEOUT);
    timeout_ms = t > 0 && t < 0x7fffffff / 1000 ? (int)(t * 1000) : 1800 * 1000;
  }
  struct bs_client *c = calloc(1, sizeof *c);
  if (!c) return CHORUS_ERR_NOMEM;
  int e = pthread_mutex_init(&c->mu, NULL);
  if (e != 0) {
    free(c);
    return CHORUS_ERR_SYSTEM;
  }
  c->fd = -1;
  c->rank = rank;
  c->timeout_ms = timeout_ms;
  chorus_result_t res = CHORUS_SUCCESS;
  if (rank == 0) {
    unsigned bound = 0;
    res = server_start(host, port, nranks, &c->server, &bound);
    if (res != CHORUS_SUCCESS) goto fail;
    snprintf(port, sizeof port, "%u", bound);
  }
  snprintf(c->addr, sizeof c->addr, "%s%s%s:%s", strchr(host, ':') ? "[" : "", host,
           strchr(host, ':') ? "]" : "", port);
  res = client_connect(c, host, port, now_ns() + (int64_t)timeout_ms * 1000000);
  if (res != CHORUS_SUCCESS) goto fail;
  out->ctx = c;
  out->set = cl_set;
  out->get = cl_get;
  out->release = cl_release;
  return CHORUS_SUCCESS;
fail:
  cl_release(c);
  return res;
}
