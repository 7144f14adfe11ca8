/* fakeverbs.c - a TEST DOUBLE for libibverbs (see README.md): the entry points Chorus's verbs
 * transport uses, implementing reliable-connected (RC) semantics between processes of one
 * machine so the real transport code runs end to end without RDMA hardware.
 *
 * Each QP owns a Unix-domain stream socket in the abstract namespace named after its QP
 * number and a service thread. Moving to RTR connects to the destination QP's socket and
 * checks the address vector against the port the peer reports (a wrong LID or GID makes every
 * later send fail with RETRY_EXC_ERR, as a real fabric would after its retries). An RDMA write
 * is a message to the target's thread, which checks the rkey, the access rights and the
 * bounds against the target process's memory regions, copies the bytes, consumes a posted
 * receive for a write with immediate, and answers with an ack or a NAK status that becomes
 * the requester's completion. Any failed completion moves the QP to the error state and
 * flushes what is outstanding.
 *
 * Environment: FAKEVERBS_DEVICES (devices, "fake0,fake1/roce"; default "fake0"),
 * FAKEVERBS_FAIL_AFTER=N (after N successful send completions in this process, the next send
 * fails with FAKEVERBS_FAIL_STATUS, default 12 = RETRY_EXC_ERR, vendor error 0x81),
 * FAKEVERBS_QP_ERROR=N (the (N+1)-th send posted in this process finds its QP in the error
 * state: it and everything outstanding complete with WR_FLUSH_ERR).
 *
 * Stricter than hardware, to catch a poster that reuses memory too early: a send's source
 * bytes are compared at its ack with what was sent, and a send whose source changed before
 * its completion fails with LOC_PROT_ERR (vendor error 0xc4a9) and a line on stderr. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "ib_verbs.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVS 8
#define MAX_IN 4
#define GID_TBL 3

struct fake_dev {
  char name[64];
  int roce;
  int index;
};
static struct fake_dev devs[MAX_DEVS];
static struct fake_dev *dev_ptrs[MAX_DEVS + 1];
static int ndevs;
static pthread_once_t devs_once = PTHREAD_ONCE_INIT;

static long fail_after = -1, qp_error_after = -1;
static int fail_status = CV_WC_RETRY_EXC_ERR;
static _Atomic long ok_sends, posted_sends;

static void parse_env(void) {
  const char *s = getenv("FAKEVERBS_DEVICES");
  if (!s || !*s) s = "fake0";
  char buf[512];
  snprintf(buf, sizeof buf, "%s", s);
  char *save = NULL;
  for (char *t = strtok_r(buf, ",", &save); t && ndevs < MAX_DEVS; t = strtok_r(NULL, ",", &save)) {
    struct fake_dev *d = &devs[ndevs];
    char *slash = strchr(t, '/');
    if (slash) {
      *slash = 0;
      d->roce = strcmp(slash + 1, "roce") == 0;
    }
    snprintf(d->name, sizeof d->name, "%s", t);
    d->index = ndevs;
    dev_ptrs[ndevs] = d;
    ndevs++;
  }
  dev_ptrs[ndevs] = NULL;
  const char *f = getenv("FAKEVERBS_FAIL_AFTER");
  if (f && *f) fail_after = atol(f);
  f = getenv("FAKEVERBS_FAIL_STATUS");
  if (f && *f) fail_status = atoi(f);
  f = getenv("FAKEVERBS_QP_ERROR");
  if (f && *f) qp_error_after = atol(f);
}

/* LID and GIDs of a device's port 1: derived from the name, so every process agrees. */
static uint16_t dev_lid(const struct fake_dev *d) {
  uint32_t h = 2166136261u;
  for (const char *p = d->name; *p; p++) h = (h ^ (uint8_t)*p) * 16777619u;
  return (uint16_t)(1 + h % 60000);
}
static void dev_gid(const struct fake_dev *d, int idx, union cv_gid *g) {
  memset(g, 0, sizeof *g);
  uint16_t lid = dev_lid(d);
  if (idx == 2) { /* RoCE v2, IPv4-mapped 10.77.x.y */
    g->raw[10] = g->raw[11] = 0xff;
    g->raw[12] = 10, g->raw[13] = 77, g->raw[14] = (uint8_t)(lid >> 8), g->raw[15] = (uint8_t)lid;
  } else { /* 0: RoCE v1 link-local, 1: RoCE v2 link-local */
    g->raw[0] = 0xfe, g->raw[1] = 0x80;
    g->raw[14] = (uint8_t)(lid >> 8), g->raw[15] = (uint8_t)lid;
  }
}

/* ------------------------------------------------------------ objects */
struct fake_ctx {
  struct cv_context base;
  struct fake_dev *dev;
  _Atomic int refs; /* PDs and CQs */
};
struct fake_pd {
  struct cv_pd base;
  _Atomic int refs; /* MRs and QPs */
};
struct fake_mr {
  struct cv_mr base;
  int access;
  struct fake_mr *next;
};
static struct fake_mr *mrs;
static pthread_mutex_t mr_mu = PTHREAD_MUTEX_INITIALIZER;
static uint32_t next_key = 0x1000;

struct fake_cq {
  struct cv_cq base;
  pthread_mutex_t mu;
  struct cv_wc *wc;
  int cap, head, count;
  int overflow;
};

/* An outstanding send; copy holds the bytes it sent from src (one scatter entry), which must
 * not change before the send completes (checked at the ack). */
struct pending {
  uint64_t wr_id;
  uint64_t seq;
  int signaled;
  uint8_t *copy;
  const uint8_t *src;
  uint32_t len;
};

struct fake_qp {
  struct cv_qp base;
  struct fake_ctx *ctx;
  struct fake_pd *pd;
  struct fake_cq *scq, *rcq;
  pthread_mutex_t mu;       /* state, queues */
  pthread_mutex_t send_mu;  /* posting order on the outgoing socket */
  int state, port, access, unreachable, peer_gone, out_dead;
  struct cv_qp_cap cap;
  uint32_t dest_qpn;
  uint64_t *recvq; int rq_head, rq_count;
  struct pending *sendq; int sq_head, sq_count;
  uint64_t next_seq;
  int listen_fd, out_fd, in_fd[MAX_IN], nin;
  int wake[2];
  pthread_t thread;
  int thread_started, stop;
};

struct wire_hdr {
  uint32_t kind;   /* 1 write, 2 ack, 3 hello */
  uint32_t len;
  uint64_t seq;
  uint64_t raddr;
  uint32_t rkey, imm, has_imm, status;
  uint32_t qpn, lid;
  uint8_t gid[16];
};

static int io_all(int fd, void *buf, size_t len, int writing) {
  uint8_t *p = buf;
  while (len) {
    ssize_t r = writing ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    p += r;
    len -= (size_t)r;
  }
  return 0;
}

static void cq_push(struct fake_cq *cq, const struct cv_wc *wc) {
  pthread_mutex_lock(&cq->mu);
  if (cq->count == cq->cap) {
    if (!cq->overflow) fprintf(stderr, "fakeverbs: completion queue overflow (%d entries)\n", cq->cap);
    cq->overflow = 1;
  } else {
    cq->wc[(cq->head + cq->count) % cq->cap] = *wc;
    cq->count++;
  }
  pthread_mutex_unlock(&cq->mu);
}

static void complete_send(struct fake_qp *qp, const struct pending *p, int status, uint32_t vendor) {
  free(p->copy); /* every pending send leaves the queue through here once */
  if (status == CV_WC_SUCCESS && !p->signaled) return;
  struct cv_wc wc;
  memset(&wc, 0, sizeof wc);
  wc.wr_id = p->wr_id;
  wc.status = status;
  wc.opcode = CV_WC_RDMA_WRITE;
  wc.vendor_err = vendor;
  wc.qp_num = qp->base.qp_num;
  cq_push(qp->scq, &wc);
}

/* QP to the error state: outstanding sends and posted receives complete as flushed. Called
 * with qp->mu held. */
static void qp_to_error(struct fake_qp *qp) {
  qp->state = CV_QPS_ERR;
  while (qp->sq_count) {
    complete_send(qp, &qp->sendq[qp->sq_head], CV_WC_WR_FLUSH_ERR, 0);
    qp->sq_head = (qp->sq_head + 1) % (int)qp->cap.max_send_wr;
    qp->sq_count--;
  }
  while (qp->rq_count) {
    struct cv_wc wc;
    memset(&wc, 0, sizeof wc);
    wc.wr_id = qp->recvq[qp->rq_head];
    wc.status = CV_WC_WR_FLUSH_ERR;
    wc.opcode = CV_WC_RECV;
    wc.qp_num = qp->base.qp_num;
    cq_push(qp->rcq, &wc);
    qp->rq_head = (qp->rq_head + 1) % (int)qp->cap.max_recv_wr;
    qp->rq_count--;
  }
}

/* The oldest outstanding send completes with status (an ack or a NAK from the target). */
static void ack_oldest(struct fake_qp *qp, int status, uint32_t vendor) {
  pthread_mutex_lock(&qp->mu);
  if (qp->sq_count) {
    struct pending p = qp->sendq[qp->sq_head];
    qp->sq_head = (qp->sq_head + 1) % (int)qp->cap.max_send_wr;
    qp->sq_count--;
    if (status == CV_WC_SUCCESS && p.copy && memcmp(p.copy, p.src, p.len) != 0) {
      /* the poster rewrote the source before the completion: a NIC could have sent either */
      fprintf(stderr, "fakeverbs: QP 0x%x: the %u source bytes at %p of send %llu changed "
              "before its completion\n", qp->base.qp_num, p.len, (const void *)p.src,
              (unsigned long long)p.wr_id);
      status = CV_WC_LOC_PROT_ERR;
      vendor = 0xc4a9;
    }
    complete_send(qp, &p, status, vendor);
    if (status == CV_WC_SUCCESS) atomic_fetch_add(&ok_sends, 1);
    else qp_to_error(qp);
  }
  pthread_mutex_unlock(&qp->mu);
}

static struct fake_mr *mr_by_rkey(uint32_t rkey) {
  for (struct fake_mr *m = mrs; m; m = m->next)
    if (m->base.rkey == rkey) return m;
  return NULL;
}

/* A NIC's DMA into memory the host may be polling: words land whole, one by one (relaxed
 * atomic stores: a reader's atomic loads, as ib.c's clear-to-send FIFO makes, see each word
 * old or new, and ThreadSanitizer sees no race with them). */
static void dma_copy(void *dst, const void *src, size_t len) {
  uint8_t *d = dst;
  const uint8_t *s = src;
  for (; len && ((uintptr_t)d & 7); len--) __atomic_store_n(d++, *s++, __ATOMIC_RELAXED);
  for (; len >= 8; len -= 8, d += 8, s += 8) {
    uint64_t w;
    memcpy(&w, s, 8);
    __atomic_store_n((uint64_t *)(void *)d, w, __ATOMIC_RELAXED);
  }
  for (; len; len--) __atomic_store_n(d++, *s++, __ATOMIC_RELAXED);
}

/* Target side of one RDMA write: the status of the ack. */
static int apply_write(struct fake_qp *qp, const struct wire_hdr *h, const uint8_t *data) {
  /* a QP that is not ready (or in error) drops the packets: the requester's retries run out */
  pthread_mutex_lock(&qp->mu); /* a poster's thread may move the QP to error meanwhile */
  int state = qp->state, access = qp->access;
  pthread_mutex_unlock(&qp->mu);
  if (state != CV_QPS_RTR && state != CV_QPS_RTS) return CV_WC_RETRY_EXC_ERR;
  if (!(access & CV_ACCESS_REMOTE_WRITE)) return CV_WC_REM_ACCESS_ERR;
  if (h->len) {
    pthread_mutex_lock(&mr_mu);
    struct fake_mr *m = mr_by_rkey(h->rkey);
    int ok = m && m->base.pd == qp->base.pd && (m->access & CV_ACCESS_REMOTE_WRITE) &&
             h->raddr >= (uint64_t)(uintptr_t)m->base.addr &&
             h->raddr + h->len <= (uint64_t)(uintptr_t)m->base.addr + m->base.length &&
             h->raddr + h->len >= h->raddr;
    if (ok) dma_copy((void *)(uintptr_t)h->raddr, data, h->len);
    pthread_mutex_unlock(&mr_mu);
    if (!ok) return CV_WC_REM_ACCESS_ERR;
  }
  if (h->has_imm) {
    pthread_mutex_lock(&qp->mu);
    if (!qp->rq_count) {
      pthread_mutex_unlock(&qp->mu);
      return CV_WC_RNR_RETRY_EXC_ERR; /* stricter than hardware: no receive posted is an error */
    }
    struct cv_wc wc;
    memset(&wc, 0, sizeof wc);
    wc.wr_id = qp->recvq[qp->rq_head];
    qp->rq_head = (qp->rq_head + 1) % (int)qp->cap.max_recv_wr;
    qp->rq_count--;
    wc.status = CV_WC_SUCCESS;
    wc.opcode = CV_WC_RECV_RDMA_WITH_IMM;
    wc.byte_len = h->len;
    wc.imm_data = h->imm;
    wc.wc_flags = CV_WC_WITH_IMM;
    wc.qp_num = qp->base.qp_num;
    wc.src_qp = qp->dest_qpn;
    cq_push(qp->rcq, &wc);
    pthread_mutex_unlock(&qp->mu);
  }
  return CV_WC_SUCCESS;
}

static void port_identity(struct fake_qp *qp, struct wire_hdr *h) {
  h->qpn = qp->base.qp_num;
  h->lid = qp->ctx->dev->roce ? 0 : dev_lid(qp->ctx->dev);
  union cv_gid g;
  dev_gid(qp->ctx->dev, 2, &g);
  memcpy(h->gid, g.raw, 16);
}

static void *service(void *arg) {
  struct fake_qp *qp = arg;
  uint8_t *buf = NULL;
  size_t bufcap = 0;
  for (;;) {
    struct pollfd pfd[3 + MAX_IN];
    int n = 0;
    pfd[n++] = (struct pollfd){qp->wake[0], POLLIN, 0};
    pfd[n++] = (struct pollfd){qp->listen_fd, POLLIN, 0};
    /* -1 until RTR, and after the peer went away: ignored */
    /* set by ibv_modify_qp (RTR) on the caller's thread, under mu */
    pthread_mutex_lock(&qp->mu);
    int out_fd = qp->out_fd;
    pthread_mutex_unlock(&qp->mu);
    pfd[n++] = (struct pollfd){qp->out_dead ? -1 : out_fd, POLLIN, 0};
    const int polled_in = qp->nin; /* an accept below may add one that was not polled */
    for (int i = 0; i < polled_in; i++) pfd[n++] = (struct pollfd){qp->in_fd[i], POLLIN, 0};
    if (poll(pfd, (nfds_t)n, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (pfd[0].revents) { /* 1: destroy; 0: out_fd changed */
      char x = 1;
      if (read(qp->wake[0], &x, 1) != 1 || x == 1) break;
      continue;
    }
    if (pfd[1].revents & POLLIN) {
      int fd = accept4(qp->listen_fd, NULL, NULL, SOCK_CLOEXEC);
      if (fd >= 0) {
        struct wire_hdr h;
        memset(&h, 0, sizeof h);
        h.kind = 3;
        port_identity(qp, &h);
        if (qp->nin < MAX_IN && io_all(fd, &h, sizeof h, 1) == 0) qp->in_fd[qp->nin++] = fd;
        else close(fd);
      }
    }
    if (pfd[2].revents) {
      struct wire_hdr h;
      if (io_all(out_fd, &h, sizeof h, 0) != 0) {
        /* the peer QP is gone: what is outstanding fails as after exhausted retries */
        pthread_mutex_lock(&qp->mu);
        qp->peer_gone = 1;
        if (qp->sq_count) {
          struct pending p = qp->sendq[qp->sq_head];
          qp->sq_head = (qp->sq_head + 1) % (int)qp->cap.max_send_wr;
          qp->sq_count--;
          complete_send(qp, &p, CV_WC_RETRY_EXC_ERR, 0);
          qp_to_error(qp);
        }
        pthread_mutex_unlock(&qp->mu);
        qp->out_dead = 1; /* closed by destroy: a poster may still be writing to it */
      } else if (h.kind == 2) {
        ack_oldest(qp, (int)h.status, 0);
      }
    }
    for (int i = 0; i < polled_in; i++) {
      if (!pfd[3 + i].revents) continue;
      int fd = qp->in_fd[i];
      struct wire_hdr h;
      int bad = io_all(fd, &h, sizeof h, 0) != 0 || h.kind != 1;
      if (!bad && h.len > bufcap) {
        free(buf);
        bufcap = h.len;
        buf = malloc(bufcap);
        if (!buf) bufcap = 0, bad = 1;
      }
      if (!bad && h.len) bad = io_all(fd, buf, h.len, 0) != 0;
      if (bad) {
        close(fd);
        qp->in_fd[i] = qp->in_fd[--qp->nin];
        break; /* pfd indices moved: poll again */
      }
      struct wire_hdr a;
      memset(&a, 0, sizeof a);
      a.kind = 2;
      a.seq = h.seq;
      a.status = (uint32_t)apply_write(qp, &h, buf);
      if (io_all(fd, &a, sizeof a, 1) != 0) {
        close(fd);
        qp->in_fd[i] = qp->in_fd[--qp->nin];
        break;
      }
    }
  }
  free(buf);
  return NULL;
}

/* ------------------------------------------------------------ exported verbs */
EXPORT struct cv_device **ibv_get_device_list(int *num) {
  pthread_once(&devs_once, parse_env);
  struct cv_device **list = calloc((size_t)ndevs + 1, sizeof *list);
  if (!list) return NULL;
  for (int i = 0; i < ndevs; i++) list[i] = (struct cv_device *)dev_ptrs[i];
  if (num) *num = ndevs;
  return list;
}
EXPORT void ibv_free_device_list(struct cv_device **list) { free(list); }
EXPORT const char *ibv_get_device_name(struct cv_device *d) { return ((struct fake_dev *)d)->name; }

static int fake_poll_cq(struct cv_cq *bcq, int n, struct cv_wc *wc);
static int fake_post_send(struct cv_qp *bqp, struct cv_send_wr *wr, struct cv_send_wr **bad);
static int fake_post_recv(struct cv_qp *bqp, struct cv_recv_wr *wr, struct cv_recv_wr **bad);

EXPORT struct cv_context *ibv_open_device(struct cv_device *d) {
  struct fake_ctx *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->dev = (struct fake_dev *)d;
  c->base.device = d;
  c->base.cmd_fd = c->base.async_fd = -1;
  c->base.ops.poll_cq = fake_poll_cq;
  c->base.ops.post_send = fake_post_send;
  c->base.ops.post_recv = fake_post_recv;
  pthread_mutex_init(&c->base.mutex, NULL);
  return &c->base;
}
EXPORT int ibv_close_device(struct cv_context *bc) {
  struct fake_ctx *c = (struct fake_ctx *)bc;
  if (atomic_load(&c->refs)) return EBUSY;
  pthread_mutex_destroy(&c->base.mutex);
  free(c);
  return 0;
}
EXPORT int ibv_query_port(struct cv_context *bc, uint8_t port, struct cv_port_attr *a) {
  struct fake_ctx *c = (struct fake_ctx *)bc;
  if (port != 1) return EINVAL;
  /* the exported call fills the compat layout: every member up to link_layer */
  memset(a, 0, offsetof(struct cv_port_attr, flags));
  a->state = CV_PORT_ACTIVE;
  a->max_mtu = a->active_mtu = CV_MTU_4096;
  a->gid_tbl_len = c->dev->roce ? GID_TBL : 1;
  a->lid = c->dev->roce ? 0 : dev_lid(c->dev);
  a->active_width = 2;  /* 4x */
  a->active_speed = 64; /* HDR-class figure; the transport only logs it */
  a->link_layer = c->dev->roce ? CV_LINK_LAYER_ETHERNET : CV_LINK_LAYER_INFINIBAND;
  return 0;
}
EXPORT int ibv_query_gid(struct cv_context *bc, uint8_t port, int index, union cv_gid *g) {
  struct fake_ctx *c = (struct fake_ctx *)bc;
  if (port != 1 || index < 0 || index >= (c->dev->roce ? GID_TBL : 1)) return EINVAL;
  if (c->dev->roce) dev_gid(c->dev, index, g);
  else {
    memset(g, 0, sizeof *g);
    g->raw[0] = 0xfe, g->raw[1] = 0x80, g->raw[15] = (uint8_t)c->dev->index;
  }
  return 0;
}
EXPORT int _ibv_query_gid_ex(struct cv_context *bc, uint32_t port, uint32_t index,
                             struct cv_gid_entry *e, uint32_t flags, size_t size) {
  struct fake_ctx *c = (struct fake_ctx *)bc;
  if (flags || size < sizeof *e) return EINVAL;
  memset(e, 0, sizeof *e);
  if (ibv_query_gid(bc, (uint8_t)port, (int)index, &e->gid) != 0) return EINVAL;
  e->gid_index = index;
  e->port_num = port;
  e->gid_type = !c->dev->roce ? CV_GID_TYPE_IB : index == 0 ? CV_GID_TYPE_ROCE_V1 : CV_GID_TYPE_ROCE_V2;
  return 0;
}
EXPORT struct cv_pd *ibv_alloc_pd(struct cv_context *bc) {
  struct fake_pd *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->base.context = bc;
  atomic_fetch_add(&((struct fake_ctx *)bc)->refs, 1);
  return &p->base;
}
EXPORT int ibv_dealloc_pd(struct cv_pd *bp) {
  struct fake_pd *p = (struct fake_pd *)bp;
  if (atomic_load(&p->refs)) return EBUSY;
  atomic_fetch_sub(&((struct fake_ctx *)bp->context)->refs, 1);
  free(p);
  return 0;
}
EXPORT struct cv_mr *ibv_reg_mr(struct cv_pd *pd, void *addr, size_t len, int access) {
  if (!len || ((access & CV_ACCESS_REMOTE_WRITE) && !(access & CV_ACCESS_LOCAL_WRITE))) {
    errno = EINVAL;
    return NULL;
  }
  struct fake_mr *m = calloc(1, sizeof *m);
  if (!m) return NULL;
  m->base.context = pd->context;
  m->base.pd = pd;
  m->base.addr = addr;
  m->base.length = len;
  m->access = access;
  pthread_mutex_lock(&mr_mu);
  m->base.lkey = m->base.rkey = (next_key += 0x101);
  m->next = mrs;
  mrs = m;
  pthread_mutex_unlock(&mr_mu);
  atomic_fetch_add(&((struct fake_pd *)pd)->refs, 1);
  return &m->base;
}
EXPORT int ibv_dereg_mr(struct cv_mr *bm) {
  pthread_mutex_lock(&mr_mu);
  struct fake_mr **pp = &mrs;
  while (*pp && &(*pp)->base != bm) pp = &(*pp)->next;
  if (!*pp) {
    pthread_mutex_unlock(&mr_mu);
    return EINVAL;
  }
  struct fake_mr *m = *pp;
  *pp = m->next;
  pthread_mutex_unlock(&mr_mu);
  atomic_fetch_sub(&((struct fake_pd *)m->base.pd)->refs, 1);
  free(m);
  return 0;
}
EXPORT struct cv_cq *ibv_create_cq(struct cv_context *bc, int cqe, void *cq_context,
                                   void *channel, int vec) {
  (void)vec;
  if (cqe < 1 || channel) {
    errno = EINVAL;
    return NULL;
  }
  struct fake_cq *q = calloc(1, sizeof *q);
  if (!q) return NULL;
  q->wc = calloc((size_t)cqe, sizeof *q->wc);
  if (!q->wc) {
    free(q);
    return NULL;
  }
  q->cap = cqe;
  q->base.context = bc;
  q->base.cq_context = cq_context;
  q->base.cqe = cqe;
  pthread_mutex_init(&q->mu, NULL);
  atomic_fetch_add(&((struct fake_ctx *)bc)->refs, 1);
  return &q->base;
}
EXPORT int ibv_destroy_cq(struct cv_cq *bq) {
  struct fake_cq *q = (struct fake_cq *)bq;
  atomic_fetch_sub(&((struct fake_ctx *)bq->context)->refs, 1);
  pthread_mutex_destroy(&q->mu);
  free(q->wc);
  free(q);
  return 0;
}
static int fake_poll_cq(struct cv_cq *bq, int n, struct cv_wc *wc) {
  struct fake_cq *q = (struct fake_cq *)bq;
  pthread_mutex_lock(&q->mu);
  int got = 0;
  if (q->overflow) got = -1;
  while (got >= 0 && got < n && q->count) {
    wc[got++] = q->wc[q->head];
    q->head = (q->head + 1) % q->cap;
    q->count--;
  }
  pthread_mutex_unlock(&q->mu);
  return got;
}

EXPORT struct cv_qp *ibv_create_qp(struct cv_pd *pd, struct cv_qp_init_attr *ia) {
  if (ia->qp_type != CV_QPT_RC || !ia->send_cq || !ia->recv_cq || ia->srq ||
      !ia->cap.max_send_wr || !ia->cap.max_recv_wr || ia->cap.max_send_wr > 4096 ||
      ia->cap.max_recv_wr > 4096 || ia->cap.max_send_sge > 4 || ia->cap.max_recv_sge > 4) {
    errno = EINVAL;
    return NULL;
  }
  struct fake_qp *qp = calloc(1, sizeof *qp);
  if (!qp) return NULL;
  qp->recvq = calloc(ia->cap.max_recv_wr, sizeof *qp->recvq);
  qp->sendq = calloc(ia->cap.max_send_wr, sizeof *qp->sendq);
  qp->listen_fd = qp->out_fd = qp->wake[0] = qp->wake[1] = -1;
  if (!qp->recvq || !qp->sendq || pipe2(qp->wake, O_CLOEXEC) != 0) goto fail;
  qp->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (qp->listen_fd < 0) goto fail;
  for (int tries = 0;; tries++) {
    uint32_t r;
    if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r) goto fail;
    uint32_t qpn = 1 + r % 0xfffffe;
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    int l = snprintf(a.sun_path + 1, sizeof a.sun_path - 1, "fakeverbs-%u", qpn);
    if (bind(qp->listen_fd, (struct sockaddr *)&a, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)l)) == 0) {
      qp->base.qp_num = qpn;
      break;
    }
    if (errno != EADDRINUSE || tries > 100) goto fail;
  }
  if (listen(qp->listen_fd, 8) != 0) goto fail;
  qp->ctx = (struct fake_ctx *)pd->context;
  qp->pd = (struct fake_pd *)pd;
  qp->scq = (struct fake_cq *)ia->send_cq;
  qp->rcq = (struct fake_cq *)ia->recv_cq;
  qp->cap = ia->cap;
  qp->state = CV_QPS_RESET;
  qp->base.context = pd->context;
  qp->base.pd = pd;
  qp->base.send_cq = ia->send_cq;
  qp->base.recv_cq = ia->recv_cq;
  qp->base.qp_type = CV_QPT_RC;
  qp->base.qp_context = ia->qp_context;
  pthread_mutex_init(&qp->mu, NULL);
  pthread_mutex_init(&qp->send_mu, NULL);
  if (pthread_create(&qp->thread, NULL, service, qp) != 0) goto fail;
  qp->thread_started = 1;
  atomic_fetch_add(&qp->pd->refs, 1);
  return &qp->base;
fail:
  if (qp->listen_fd >= 0) close(qp->listen_fd);
  if (qp->wake[0] >= 0) close(qp->wake[0]), close(qp->wake[1]);
  free(qp->recvq);
  free(qp->sendq);
  free(qp);
  if (!errno) errno = ENOMEM;
  return NULL;
}

EXPORT int ibv_destroy_qp(struct cv_qp *bqp) {
  struct fake_qp *qp = (struct fake_qp *)bqp;
  char x = 1;
  if (write(qp->wake[1], &x, 1) != 1) return EIO;
  pthread_join(qp->thread, NULL);
  close(qp->wake[0]);
  close(qp->wake[1]);
  close(qp->listen_fd);
  if (qp->out_fd >= 0) close(qp->out_fd);
  for (int i = 0; i < qp->nin; i++) close(qp->in_fd[i]);
  for (int i = 0; i < qp->sq_count; i++) /* never completed */
    free(qp->sendq[(qp->sq_head + i) % (int)qp->cap.max_send_wr].copy);
  atomic_fetch_sub(&qp->pd->refs, 1);
  pthread_mutex_destroy(&qp->mu);
  pthread_mutex_destroy(&qp->send_mu);
  free(qp->recvq);
  free(qp->sendq);
  free(qp);
  return 0;
}

/* RTR: connect to the destination QP and compare the address vector with its port. */
static int connect_dest(struct fake_qp *qp, const struct cv_qp_attr *a) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  struct sockaddr_un sa;
  memset(&sa, 0, sizeof sa);
  sa.sun_family = AF_UNIX;
  int l = snprintf(sa.sun_path + 1, sizeof sa.sun_path - 1, "fakeverbs-%u", a->dest_qp_num);
  struct wire_hdr h;
  if (connect(fd, (struct sockaddr *)&sa, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)l)) != 0 ||
      io_all(fd, &h, sizeof h, 0) != 0 || h.kind != 3 || h.qpn != a->dest_qp_num) {
    close(fd);
    qp->unreachable = 1; /* no such QP: sends will exhaust their retries */
    return 0;
  }
  int ok = qp->ctx->dev->roce ? a->ah_attr.is_global && memcmp(a->ah_attr.grh.dgid.raw, h.gid, 16) == 0
                              : a->ah_attr.dlid == h.lid && h.lid != 0;
  if (!ok) {
    close(fd);
    qp->unreachable = 1; /* wrong address: nobody answers */
    return 0;
  }
  pthread_mutex_lock(&qp->mu);
  qp->out_fd = fd;
  pthread_mutex_unlock(&qp->mu);
  char x = 0; /* the service thread polls out_fd from now on */
  if (write(qp->wake[1], &x, 1) != 1) return errno;
  return 0;
}

EXPORT int ibv_modify_qp(struct cv_qp *bqp, struct cv_qp_attr *a, int mask) {
  struct fake_qp *qp = (struct fake_qp *)bqp;
  if (!(mask & CV_QP_STATE)) return EINVAL;
  int from = qp->state, to = a->qp_state, need = 0, rc = 0;
  if (to == CV_QPS_ERR || to == CV_QPS_RESET) {
    pthread_mutex_lock(&qp->mu);
    if (to == CV_QPS_ERR) qp_to_error(qp);
    else qp->state = CV_QPS_RESET;
    pthread_mutex_unlock(&qp->mu);
    bqp->state = qp->state;
    return 0;
  }
  if (from == CV_QPS_RESET && to == CV_QPS_INIT)
    need = CV_QP_PKEY_INDEX | CV_QP_PORT | CV_QP_ACCESS_FLAGS;
  else if (from == CV_QPS_INIT && to == CV_QPS_RTR)
    need = CV_QP_AV | CV_QP_PATH_MTU | CV_QP_DEST_QPN | CV_QP_RQ_PSN | CV_QP_MAX_DEST_RD_ATOMIC |
           CV_QP_MIN_RNR_TIMER;
  else if (from == CV_QPS_RTR && to == CV_QPS_RTS)
    need = CV_QP_TIMEOUT | CV_QP_RETRY_CNT | CV_QP_RNR_RETRY | CV_QP_SQ_PSN | CV_QP_MAX_QP_RD_ATOMIC;
  else
    return EINVAL; /* not a legal transition */
  if ((mask & need) != need) return EINVAL;
  if (to == CV_QPS_INIT) {
    if (a->port_num != 1) return EINVAL;
    pthread_mutex_lock(&qp->mu); /* read by the service thread */
    qp->port = 1;
    qp->access = (int)a->qp_access_flags;
    pthread_mutex_unlock(&qp->mu);
  } else if (to == CV_QPS_RTR) {
    if (a->path_mtu < CV_MTU_256 || a->path_mtu > CV_MTU_4096 || a->ah_attr.port_num != 1)
      return EINVAL;
    if (qp->ctx->dev->roce && (!a->ah_attr.is_global || a->ah_attr.grh.sgid_index >= GID_TBL))
      return EINVAL;
    qp->dest_qpn = a->dest_qp_num;
    rc = connect_dest(qp, a);
    if (rc) return rc;
  } else if (to == CV_QPS_RTS) {
    if (a->retry_cnt > 7 || a->rnr_retry > 7 || a->timeout > 31) return EINVAL;
  }
  pthread_mutex_lock(&qp->mu);
  qp->state = to;
  pthread_mutex_unlock(&qp->mu);
  bqp->state = to;
  return 0;
}

static struct fake_mr *mr_by_lkey(uint32_t lkey) {
  for (struct fake_mr *m = mrs; m; m = m->next)
    if (m->base.lkey == lkey) return m;
  return NULL;
}

static int fake_post_send(struct cv_qp *bqp, struct cv_send_wr *wr, struct cv_send_wr **bad) {
  struct fake_qp *qp = (struct fake_qp *)bqp;
  for (; wr; wr = wr->next) {
    if (wr->opcode != CV_WR_RDMA_WRITE && wr->opcode != CV_WR_RDMA_WRITE_WITH_IMM) goto inval;
    if (wr->num_sge < 0 || (uint32_t)wr->num_sge > qp->cap.max_send_sge) goto inval;
    pthread_mutex_lock(&qp->mu);
    int state = qp->state;
    if (state != CV_QPS_RTS && state != CV_QPS_ERR) {
      pthread_mutex_unlock(&qp->mu);
      goto inval;
    }
    if (qp->sq_count == (int)qp->cap.max_send_wr) {
      pthread_mutex_unlock(&qp->mu);
      *bad = wr;
      return ENOMEM;
    }
    struct pending p = {wr->wr_id, qp->next_seq++, (wr->send_flags & CV_SEND_SIGNALED) != 0,
                        NULL, NULL, 0};
    long nposted = atomic_fetch_add(&posted_sends, 1);
    if (qp_error_after >= 0 && nposted >= qp_error_after && state != CV_QPS_ERR) {
      qp_error_after = -1; /* once */
      qp_to_error(qp);     /* an asynchronous QP error, as if the port failed */
      state = CV_QPS_ERR;
    }
    if (state == CV_QPS_ERR) {
      complete_send(qp, &p, CV_WC_WR_FLUSH_ERR, 0);
      pthread_mutex_unlock(&qp->mu);
      continue;
    }
    if (fail_after >= 0 && atomic_load(&ok_sends) >= fail_after) {
      fail_after = -1; /* once */
      complete_send(qp, &p, fail_status, 0x81);
      qp_to_error(qp);
      pthread_mutex_unlock(&qp->mu);
      continue;
    }
    if (qp->unreachable || qp->peer_gone) {
      complete_send(qp, &p, CV_WC_RETRY_EXC_ERR, 0);
      qp_to_error(qp);
      pthread_mutex_unlock(&qp->mu);
      continue;
    }
    /* gather the local bytes: every sge must lie inside a memory region with its lkey */
    size_t total = 0;
    int prot = 0;
    pthread_mutex_lock(&mr_mu);
    for (int i = 0; i < wr->num_sge; i++) {
      struct fake_mr *m = mr_by_lkey(wr->sg_list[i].lkey);
      uint64_t s = wr->sg_list[i].addr, e = s + wr->sg_list[i].length;
      if (!m || m->base.pd != bqp->pd || s < (uint64_t)(uintptr_t)m->base.addr ||
          e > (uint64_t)(uintptr_t)m->base.addr + m->base.length)
        prot = 1;
      total += wr->sg_list[i].length;
    }
    uint8_t *msg = prot ? NULL : malloc(sizeof(struct wire_hdr) + total);
    if (msg) {
      size_t off = sizeof(struct wire_hdr);
      for (int i = 0; i < wr->num_sge; i++) {
        memcpy(msg + off, (void *)(uintptr_t)wr->sg_list[i].addr, wr->sg_list[i].length);
        off += wr->sg_list[i].length;
      }
      if (wr->num_sge == 1 && total && (p.copy = malloc(total)) != NULL) {
        memcpy(p.copy, msg + sizeof(struct wire_hdr), total);
        p.src = (const uint8_t *)(uintptr_t)wr->sg_list[0].addr;
        p.len = (uint32_t)total;
      }
    }
    pthread_mutex_unlock(&mr_mu);
    if (prot || !msg) {
      complete_send(qp, &p, prot ? CV_WC_LOC_PROT_ERR : CV_WC_GENERAL_ERR, 0);
      qp_to_error(qp);
      pthread_mutex_unlock(&qp->mu);
      continue;
    }
    struct wire_hdr h;
    memset(&h, 0, sizeof h);
    h.kind = 1;
    h.len = (uint32_t)total;
    h.seq = p.seq;
    h.raddr = wr->wr.rdma.remote_addr;
    h.rkey = wr->wr.rdma.rkey;
    h.has_imm = wr->opcode == CV_WR_RDMA_WRITE_WITH_IMM;
    h.imm = wr->imm_data;
    memcpy(msg, &h, sizeof h);
    qp->sendq[(qp->sq_head + qp->sq_count) % (int)qp->cap.max_send_wr] = p;
    qp->sq_count++;
    /* keep the socket order equal to the queue order, without holding mu while writing */
    pthread_mutex_lock(&qp->send_mu);
    pthread_mutex_unlock(&qp->mu);
    int werr = io_all(qp->out_fd, msg, sizeof h + total, 1);
    pthread_mutex_unlock(&qp->send_mu);
    free(msg);
    (void)werr; /* a broken connection shows as EOF to the service thread: retries exhausted */
  }
  return 0;
inval:
  *bad = wr;
  return EINVAL;
}

static int fake_post_recv(struct cv_qp *bqp, struct cv_recv_wr *wr, struct cv_recv_wr **bad) {
  struct fake_qp *qp = (struct fake_qp *)bqp;
  for (; wr; wr = wr->next) {
    pthread_mutex_lock(&qp->mu);
    if (qp->state == CV_QPS_RESET || wr->num_sge < 0 ||
        (uint32_t)wr->num_sge > qp->cap.max_recv_sge) {
      pthread_mutex_unlock(&qp->mu);
      *bad = wr;
      return EINVAL;
    }
    if (qp->rq_count == (int)qp->cap.max_recv_wr) {
      pthread_mutex_unlock(&qp->mu);
      *bad = wr;
      return ENOMEM;
    }
    qp->recvq[(qp->rq_head + qp->rq_count) % (int)qp->cap.max_recv_wr] = wr->wr_id;
    qp->rq_count++;
    if (qp->state == CV_QPS_ERR) qp_to_error(qp); /* flushed at once */
    pthread_mutex_unlock(&qp->mu);
  }
  return 0;
}

EXPORT const char *ibv_wc_status_str(int status) {
  static const char *const names[] = {
      "success", "local length error", "local QP operation error", "local EE context operation error",
      "local protection error", "Work Request Flushed Error", "memory management operation error",
      "bad response error", "local access error", "remote invalid request error",
      "remote access error", "remote operation error", "transport retry counter exceeded",
      "RNR retry counter exceeded", "local RDD violation error", "remote invalid RD request",
      "aborted error", "invalid EE context number", "invalid EE context state", "fatal error",
      "response timeout error", "general error"};
  if (status < 0 || status >= (int)(sizeof names / sizeof names[0])) return "unknown";
  return names[status];
}
