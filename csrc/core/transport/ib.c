/* ib.c - the InfiniBand / RoCE verbs transport: NIC discovery (CHORUS_IB_HCA), link layer and
 * GID choice, RC queue pairs through INIT -> RTR -> RTS, the out-of-band exchange through the
 * store, and the byte stream of a connection as an RDMA ring per direction with a
 * receiver-driven clear-to-send FIFO (design in docs/design.md, "Verbs transport").
 *
 * Per connection and direction the receiver owns a registered ring of S bytes; stream byte
 * `pos` lives at index pos % S on both sides (the sender's local ring mirrors it). The sender
 * RDMA-writes committed bytes into the receiver's ring with RDMA_WRITE_WITH_IMM, one work
 * request per chunk (immediate = chunk length); chunk k goes on QP k % nqp, so the receiver
 * reassembles the stream by taking chunk lengths from the QPs in the same round-robin order.
 * The receiver returns credits by RDMA-writing a record {seq, consumed, reposted, check} into
 * one of CTS_SLOTS slots of the sender's FIFO; the sender believes the valid record with the
 * highest seq. One record is in flight at a time, so the newest complete record is never the
 * one being overwritten. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core.h"
#include "ib_gdr.h"
#include "ib_verbs.h"

#define IB_MAX_NICS 16
#define IB_MAX_QPS 8
#define CTS_SLOTS 4
#define RECV_DEPTH 64            /* receives posted per QP; chunks in flight per connection */
#define SEND_DEPTH 128           /* send work requests per QP */
#define CQ_DEPTH (SEND_DEPTH + RECV_DEPTH + 16)
#define CHUNK_LOG (IB_MAX_QPS * SEND_DEPTH) /* data chunks that may await completion */
#define CHUNK_MAX ((size_t)512 << 10)
#define RING_MIN ((size_t)64 << 10)
#define RING_MAX ((size_t)1 << 30)
#define SIDE_BYTES 4096          /* FIFO / credit source area after each ring */
#define PROBE_NS 1000000000LL    /* a starving connection asks the store about its peer */
#define FAILURE_WAIT_MS 300
#define NOTICE_GRACE_NS 1000000000LL /* after a peer's notice, how long a connection waiting on
                                      * it gives bytes still in flight before failing */
#define CTS_MAGIC 0x4348524356425331ull
#define ABORT_MAGIC 0x41424f5254214221ull /* struct notice: the peer failed */
#define RDV_MAGIC 0x5244565245515531ull   /* struct rdv_rec */
#define NOTICE_OFF 256                     /* where the notice lies in the FIFO area */
#define RDV_OFF 1024                       /* where a receive buffer's record lies in it */
#define RDV_FLAG 0x80000000u               /* immediate: the chunk landed in that buffer */

enum { WR_DATA = 1, WR_CTS = 2, WR_RECV = 3, WR_RDV = 4 };
#define WRID(kind, q, n) ((uint64_t)(kind) | ((uint64_t)(q) << 4) | ((uint64_t)(n) << 8))

struct ib_nic {
  char name[64];
  int port;
  int dev_index;                /* index of the opened context in ib_state */
  struct cv_context *ctx;
  struct cv_pd *pd;
  int link_layer;
  uint16_t lid;
  int gid_index;                /* -1 on InfiniBand */
  int gid_type;
  union cv_gid gid;
  int mtu;
  int width, speed;             /* port attributes as reported (for the log) */
};

struct ib_state {
  const struct ib_api *api;
  int nnics;
  struct ib_nic nic[IB_MAX_NICS];
  int nctx;
  struct cv_context *ctx[IB_MAX_NICS];
  struct cv_pd *pd[IB_MAX_NICS];
  int next_nic;                 /* round-robin start of the next connection */
  int aborted;
  int nconns;
  _Atomic uint64_t zc_bytes;    /* sent straight from registered buffers */
  _Atomic uint64_t ring_bytes;  /* sent from the rings */
  _Atomic uint64_t rdv_bytes;   /* sent straight into the peers' registered buffers */
  _Atomic uint64_t rz_bytes;    /* received straight into registered buffers */
};

/* A registered buffer's memory regions (struct chorus_reg's ib), one per opened device;
 * writable: registered for remote writes too (it can receive without a copy). */
struct ib_mrs {
  struct cv_mr *mr[IB_MAX_NICS];
  int writable;
};

/* A receiver's request, written into the sender's FIFO area at RDV_OFF: stream bytes
 * [pos, pos + len) belong at addr + (byte - pos) (rkey per QP of the connection). The sender
 * acts on it once, when it reads it: bytes it already posted went to the ring; from its next
 * byte to the end of the range every chunk goes to addr instead, flagged RDV_FLAG. A request
 * read after the sender passed the range's end changes nothing. */
struct rdv_rec {
  uint64_t seq, pos, addr, len;
  uint32_t rkey[IB_MAX_QPS];
  uint64_t check;
};

struct cts_rec {
  uint64_t seq, consumed, reposted, check;
};
/* A failing rank's notice: its error text, then a record {1, failed collective, hash of the
 * text, check} that is valid only once every byte has landed. */
struct notice {
  char text[480];
  struct cts_rec rec;
};

struct ib_q {
  struct cv_qp *qp;
  struct cv_cq *cq;
  int nic;
  int sends;                    /* send work requests not yet completed */
  uint32_t peer_rkey;           /* the peer's ring MR on the peer's NIC of this QP */
  uint64_t data_done;           /* data chunks of this QP completed (in order, RC) */
  uint32_t arrived[RECV_DEPTH + 1]; /* chunk lengths received, not yet in the stream */
  unsigned arr_head, arr_tail;
};

struct ib_conn {
  conn_t base;
  int nqp;
  struct ib_q q[IB_MAX_QPS];
  struct cv_mr *rmr[IB_MAX_NICS], *lmr[IB_MAX_NICS]; /* per NIC used: remote-writable, local */
  uint8_t *mem;
  size_t size;                  /* ring bytes */
  uint8_t *rx, *tx;
  struct cts_rec *fifo;         /* CTS_SLOTS records the peer writes (our sending credits),
                                 * then its failure notice */
  struct cts_rec *cts_src;      /* the record we write to the peer, then our failure notice */
  uint64_t peer_rx, peer_fifo;  /* the peer's addresses */
  /* sending: stream positions committed (tx_tail), posted to the NIC, consumed by the peer
   * (tx_acked) and completed here (tx_done: the NIC no longer reads them) */
  uint64_t tx_tail, tx_posted, tx_acked, tx_done, chunks_sent, chunks_done, peer_reposted,
      cts_seen;
  uint64_t chunk_end[CHUNK_LOG];  /* stream end of chunk k at k % CHUNK_LOG */
  /* a direct run (write_direct from a registered buffer): d_len bytes of d_src from stream
   * position d_pos, d_posted of them posted, d_reported handed back as written */
  struct chorus_reg *d_reg;
  const uint8_t *d_src;
  uint64_t d_pos, d_len, d_posted, d_reported;
  /* the receive buffer the peer asked us to write into (struct rdv_rec), while active */
  uint64_t rdv_seen, rdv_pos, rdv_addr, rdv_len;
  uint32_t rdv_rkey[IB_MAX_QPS];  /* (in force while tx_posted lies in the range: rdv_covers) */
  /* a direct receive (read_direct into a registered buffer): stream bytes [r_pos, r_pos +
   * r_len) were requested into r_dst; from r_x on (once r_started) they land there, r_landed
   * so far; bytes before r_x came through the ring */
  struct chorus_reg *r_reg;
  uint8_t *r_dst;
  uint64_t r_pos, r_len, r_x, r_landed, rdv_seq;
  int r_started;
  int rdv_inflight;             /* our request's RDMA write has not completed */
  const void *r_nodst;          /* the last destination found unregistered ... */
  uint64_t r_nodst_gen;         /* ... while the communicator had made this many registrations */
  /* receiving */
  uint64_t rx_head, rx_tail, chunks_rcvd, reposted, cts_seq, cts_consumed, cts_reposted;
  int cts_inflight;
  int starving;
  int64_t next_probe;
  chorus_result_t err;
  int broken;                   /* a completion failed; fatal once the peer is needed */
  int own;                      /* ... and why describes our own failed completion */
  int peer_failed;              /* the peer wrote its failure notice into our FIFO ... */
  uint64_t peer_failed_seq;     /* ... at this collective (0: outside one) */
  int abort_posted;
  char peer_notice[480];        /* the text of the peer's notice */
  int64_t peer_failed_at;       /* when the notice was read */
  int64_t last_moved;           /* when this connection last moved anything */
  char why[1024];
  char peer_desc[96];
};

static const struct transport_ops ib_ops;
static _Atomic int unavailable_said;

static const char *chan_name(int ch) { return ch == CHAN_COLL ? "coll" : "p2p"; }
static const char *ll_name(int ll) {
  return ll == CV_LINK_LAYER_ETHERNET ? "RoCE" : ll == CV_LINK_LAYER_INFINIBAND ? "IB" : "?";
}

/* ------------------------------------------------------------ NIC selection */
/* NCCL's list syntax: entries "name[:port]" separated by commas; a leading ^ excludes the
 * listed ones, = makes names exact instead of prefixes. Exposed for the unit test. */
int ib_hca_matches(const char *spec, const char *dev, int port) {
  if (!spec) return 1;
  const char *p = spec;
  int exclude = 0, exact = 0, entries = 0, hit = 0;
  while (*p == ' ') p++;
  if (*p == '^') exclude = 1, p++;
  if (*p == '=') exact = 1, p++;
  size_t dl = strlen(dev);
  while (*p) {
    const char *e = strchr(p, ',');
    if (!e) e = p + strlen(p);
    const char *b = p, *colon = NULL;
    while (b < e && *b == ' ') b++;
    const char *end = e;
    while (end > b && end[-1] == ' ') end--;
    for (const char *x = b; x < end; x++)
      if (*x == ':') colon = x;
    const char *name_end = colon ? colon : end;
    while (name_end > b && name_end[-1] == ' ') name_end--;
    size_t n = (size_t)(name_end - b);
    if (n) {
      entries++;
      int want_port = colon ? atoi(colon + 1) : 0;
      int name_ok = exact ? (dl == n && memcmp(dev, b, n) == 0) : (dl >= n && memcmp(dev, b, n) == 0);
      if (name_ok && (!want_port || want_port == port)) hit = 1;
    }
    if (!*e) break;
    p = e + 1;
  }
  if (!entries) return 1;
  return exclude ? !hit : hit;
}

static int gid_is_zero(const union cv_gid *g) {
  for (int i = 0; i < 16; i++)
    if (g->raw[i]) return 0;
  return 1;
}

static int gid_is_v4mapped(const union cv_gid *g) {
  static const uint8_t pre[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(g->raw, pre, 12) == 0;
}

/* The GID type: the extended query where the library has it, else sysfs (as rdma-core
 * itself does). -1 if unknown. */
static int gid_type(const struct ib_api *api, struct ib_nic *n, int idx) {
  if (api->query_gid_ex) {
    struct cv_gid_entry e;
    memset(&e, 0, sizeof e);
    if (api->query_gid_ex(n->ctx, (uint32_t)n->port, (uint32_t)idx, &e, 0, sizeof e) == 0)
      return (int)e.gid_type;
    return -1;
  }
  char path[256], buf[64];
  snprintf(path, sizeof path, "/sys/class/infiniband/%s/ports/%d/gid_attrs/types/%d", n->name,
           n->port, idx);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  ssize_t r = read(fd, buf, sizeof buf - 1);
  if (close(fd) != 0) return -1; /* type unknown */
  if (r <= 0) return -1;
  buf[r] = 0;
  if (strstr(buf, "v2")) return CV_GID_TYPE_ROCE_V2;
  if (strstr(buf, "RoCE") || strstr(buf, "IB/RoCE")) return CV_GID_TYPE_ROCE_V1;
  return -1;
}

/* RoCE: the GID to address this port with. Returns 0 or -1 (message in why). */
static int choose_gid(const struct ib_api *api, struct ib_nic *n, int tbl_len, char *why,
                      size_t cap) {
  int64_t want = param_int(PARAM_IB_GID_INDEX);
  if (want >= 0) {
    if (want >= tbl_len || api->query_gid(n->ctx, (uint8_t)n->port, (int)want, &n->gid) != 0 ||
        gid_is_zero(&n->gid)) {
      snprintf(why, cap, "%s:%d: IB_GID_INDEX %lld is not a valid GID (table of %d)", n->name,
               n->port, (long long)want, tbl_len);
      return -1;
    }
    n->gid_index = (int)want;
    n->gid_type = gid_type(api, n, (int)want);
    return 0;
  }
  /* auto: RoCE v2 first (routable), IPv4-mapped before IPv6; then any non-zero GID */
  int best = -1, best_score = -1, best_type = -1;
  union cv_gid best_gid;
  memset(&best_gid, 0, sizeof best_gid);
  for (int i = 0; i < tbl_len && i < 256; i++) {
    union cv_gid g;
    if (api->query_gid(n->ctx, (uint8_t)n->port, i, &g) != 0 || gid_is_zero(&g)) continue;
    int t = gid_type(api, n, i);
    int score = (t == CV_GID_TYPE_ROCE_V2 ? 4 : 0) + (gid_is_v4mapped(&g) ? 2 : 0) + 1;
    if (score > best_score) best = i, best_score = score, best_gid = g, best_type = t;
  }
  if (best < 0) {
    snprintf(why, cap, "%s:%d: RoCE port without any GID", n->name, n->port);
    return -1;
  }
  n->gid_index = best;
  n->gid = best_gid;
  n->gid_type = best_type;
  return 0;
}

/* Describes an active port in n (RoCE: with the GID chosen). 0 when it is addressable; else
 * why says what is missing: -1 a RoCE port without a usable GID, 1 an IB port without a LID. */
static int nic_from_port(const struct ib_api *api, struct cv_context *ctx, const char *name,
                         int port, const struct cv_port_attr *pa, struct ib_nic *n, char *why,
                         size_t cap) {
  memset(n, 0, sizeof *n);
  snprintf(n->name, sizeof n->name, "%s", name);
  n->port = port;
  n->ctx = ctx;
  n->link_layer = pa->link_layer == CV_LINK_LAYER_ETHERNET ? CV_LINK_LAYER_ETHERNET
                                                           : CV_LINK_LAYER_INFINIBAND;
  n->lid = pa->lid;
  n->mtu = pa->active_mtu >= CV_MTU_256 && pa->active_mtu <= CV_MTU_4096 ? pa->active_mtu
                                                                         : CV_MTU_1024;
  n->width = pa->active_width;
  n->speed = pa->active_speed;
  n->gid_index = -1;
  n->gid_type = CV_GID_TYPE_IB;
  if (n->link_layer == CV_LINK_LAYER_ETHERNET)
    return choose_gid(api, n, pa->gid_tbl_len, why, cap) != 0 ? -1 : 0;
  if (pa->lid == 0) {
    snprintf(why, cap, "%s:%d is active but has no LID (no subnet manager?)", name, port);
    return 1;
  }
  return 0;
}

/* Lanes of ibv_port_attr.active_width, and the data rate of one lane in Gb/s from
 * active_speed (after line coding: SDR 2, DDR 4, QDR 8, FDR10 10, FDR 13.64, EDR 25,
 * HDR 50, NDR 100). 0 where the code is unknown. */
static int width_lanes(int w) {
  return w == 1 ? 1 : w == 2 ? 4 : w == 4 ? 8 : w == 8 ? 12 : w == 16 ? 2 : 0;
}
static double lane_gbps(int s) {
  switch (s) {
    case 1: return 2.0;
    case 2: return 4.0;
    case 4: return 8.0;
    case 8: return 10.0;
    case 16: return 13.64;
    case 32: return 25.0;
    case 64: return 50.0;
    case 128: return 100.0;
    default: return 0.0;
  }
}

chorus_result_t chorus_verbs_nics(chorus_nic_info_t *nics, int cap, int *count) {
  if (!count || cap < 0 || (cap > 0 && !nics))
    return comm_set_error(NULL, CHORUS_ERR_INVALID, "verbs_nics: bad arguments");
  *count = 0;
  const char *lib_why = "";
  const struct ib_api *api = ib_api_get(&lib_why);
  if (!api) return comm_set_error(NULL, CHORUS_ERR_UNSUPPORTED, "%s", lib_why);
  const char *spec = param_str(PARAM_IB_HCA);
  int ndev = 0;
  struct cv_device **list = api->get_device_list(&ndev);
  if (!list)
    return comm_set_error(NULL, CHORUS_ERR_SYSTEM, "ibv_get_device_list failed: %s",
                          strerror(errno));
  for (int d = 0; d < ndev && *count < cap; d++) {
    const char *name = api->get_device_name(list[d]);
    if (!name) continue;
    struct cv_context *ctx = api->open_device(list[d]);
    if (!ctx) continue;
    for (int port = 1; port <= 8 && *count < cap; port++) {
      struct cv_port_attr pa;
      memset(&pa, 0, sizeof pa);
      if (api->query_port(ctx, (uint8_t)port, &pa) != 0) break; /* no such port */
      chorus_nic_info_t *o = &nics[(*count)++];
      memset(o, 0, sizeof *o);
      snprintf(o->name, sizeof o->name, "%s", name);
      o->port = port;
      o->active = pa.state == CV_PORT_ACTIVE;
      o->roce = pa.link_layer == CV_LINK_LAYER_ETHERNET;
      o->width = width_lanes(pa.active_width);
      o->lane_gbps = lane_gbps(pa.active_speed);
      o->lid = pa.lid;
      o->gid_index = -1;
      if (!o->active) {
        snprintf(o->why, sizeof o->why, "port not active");
        continue;
      }
      struct ib_nic n;
      if (nic_from_port(api, ctx, name, port, &pa, &n, o->why, sizeof o->why) != 0) continue;
      o->gid_index = n.gid_index;
      if (spec[0] && !ib_hca_matches(spec, name, port)) {
        snprintf(o->why, sizeof o->why, "not selected by IB_HCA=%s", spec);
        continue;
      }
      o->why[0] = 0;
      o->usable = !param_int(PARAM_IB_DISABLE);
      if (!o->usable) snprintf(o->why, sizeof o->why, "verbs disabled by IB_DISABLE");
    }
    (void)api->close_device(ctx); /* the listing is complete either way */
  }
  api->free_device_list(list);
  return CHORUS_SUCCESS;
}

/* Opens every device with an active port that CHORUS_IB_HCA selects. 0 NICs is not an
 * error (verbs are then simply not used); a failure of the library is logged. */
static void discover(struct chorus_comm *comm, struct ib_state *st) {
  const struct ib_api *api = st->api;
  const char *spec = param_str(PARAM_IB_HCA);
  int ndev = 0;
  struct cv_device **list = api->get_device_list(&ndev);
  if (!list) {
    INFO(SUB_NET, comm->rank, "verbs: ibv_get_device_list failed: %s", strerror(errno));
    return;
  }
  for (int d = 0; d < ndev && st->nnics < IB_MAX_NICS; d++) {
    const char *name = api->get_device_name(list[d]);
    if (!name) continue;
    if (spec[0] && !ib_hca_matches(spec, name, 0) && spec[0] != '^') {
      /* a name not listed at all (ports checked below for listed names) */
      int any = 0;
      for (int port = 1; port <= 8 && !any; port++) any = ib_hca_matches(spec, name, port);
      if (!any) continue;
    }
    struct cv_context *ctx = api->open_device(list[d]);
    if (!ctx) {
      INFO(SUB_NET, comm->rank, "verbs: cannot open %s: %s", name, strerror(errno));
      continue;
    }
    struct cv_pd *pd = api->alloc_pd(ctx);
    if (!pd) {
      INFO(SUB_NET, comm->rank, "verbs: cannot allocate a protection domain on %s", name);
      if (api->close_device(ctx) != 0) INFO(SUB_NET, comm->rank, "verbs: closing %s failed", name);
      continue;
    }
    int used = 0;
    for (int port = 1; port <= 8 && st->nnics < IB_MAX_NICS; port++) {
      struct cv_port_attr pa;
      memset(&pa, 0, sizeof pa);
      if (api->query_port(ctx, (uint8_t)port, &pa) != 0) break; /* no such port */
      if (pa.state != CV_PORT_ACTIVE) continue;
      if (spec[0] && !ib_hca_matches(spec, name, port)) continue;
      struct ib_nic *n = &st->nic[st->nnics];
      char why[200];
      int bad = nic_from_port(api, ctx, name, port, &pa, n, why, sizeof why);
      n->pd = pd;
      n->dev_index = st->nctx;
      if (bad < 0) {
        WARN(comm->rank, "verbs: %s; port skipped", why);
        continue;
      }
      if (bad > 0) {
        INFO(SUB_NET, comm->rank, "verbs: %s", why);
        continue;
      }
      st->nnics++;
      used = 1;
    }
    if (used) {
      st->ctx[st->nctx] = ctx;
      st->pd[st->nctx] = pd;
      st->nctx++;
    } else {
      if (api->dealloc_pd(pd) != 0 || api->close_device(ctx) != 0)
        INFO(SUB_NET, comm->rank, "verbs: releasing %s failed", name);
    }
  }
  api->free_device_list(list);
}

/* ------------------------------------------------------------ errors */
static void describe_current(struct chorus_comm *comm, char *buf, size_t cap) {
  buf[0] = 0;
  const struct op *cur = comm->current;
  if (cur) {
    char d[200];
    op_describe(cur, d, sizeof d);
    snprintf(buf, cap, " during %s", d);
  }
}

static chorus_result_t conn_fatal(struct ib_conn *c) {
  if (c->err) return c->err;
  c->err = comm_set_error(c->base.comm, CHORUS_ERR_PEER, "%s", c->why);
  return c->err;
}

/* A failed work completion: described once (the first failure is the cause; later ones are
 * usually flushes). Data writes are fatal at once; a failed credit write or flushed receive
 * becomes fatal when this connection is needed (the peer may have finished and closed). */
static chorus_result_t completion_failed(struct ib_conn *c, int qi, const struct cv_wc *wc,
                                         int kind) {
  struct chorus_comm *comm = c->base.comm;
  if (!c->broken) {
    char during[240];
    const char *what = kind == WR_DATA  ? "RDMA write with immediate (data)"
                       : kind == WR_CTS ? "RDMA write (clear-to-send credit)"
                       : kind == WR_RDV ? "RDMA write (receive buffer request)"
                                        : "receive of a write with immediate";
    describe_current(comm, during, sizeof during);
    struct ib_nic *n = &comm->ib->nic[c->q[qi].nic];
    char which[48] = "";
    if (kind != WR_RECV) snprintf(which, sizeof which, " #%llu", (unsigned long long)(wc->wr_id >> 8));
    snprintf(c->why, sizeof c->why,
             "rank %d peer %d (verbs, %s channel, QP %d/%d 0x%x on %s:%d): %s%s %s rank %d "
             "(%s) failed: %s (status %d, vendor error 0x%x)%s",
             comm->rank, c->base.peer, chan_name(c->base.channel), qi, c->nqp, wc->qp_num,
             n->name, n->port, what, which, kind == WR_RECV ? "from" : "to", c->base.peer,
             c->peer_desc, ib_wc_status_name(wc->status), wc->status, wc->vendor_err, during);
    c->broken = 1;
    c->own = 1;
  }
  if (kind == WR_DATA) return conn_fatal(c);
  return CHORUS_SUCCESS;
}

/* ------------------------------------------------------------ data path */
static chorus_result_t post_recv(struct ib_conn *c, int qi) {
  struct cv_recv_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof wr);
  wr.wr_id = WRID(WR_RECV, qi, 0);
  int rc = ib_post_recv(c->q[qi].qp, &wr, &bad);
  if (rc) {
    struct chorus_comm *comm = c->base.comm;
    snprintf(c->why, sizeof c->why, "rank %d peer %d (verbs, %s channel): ibv_post_recv on QP "
             "%d failed: %s", comm->rank, c->base.peer, chan_name(c->base.channel), qi,
             strerror(rc));
    c->broken = 1;
    return conn_fatal(c);
  }
  return CHORUS_SUCCESS;
}

static uint64_t cts_check(const struct cts_rec *r) {
  return (r->seq * 0x9E3779B97F4A7C15ull) ^ (r->consumed * 0xC2B2AE3D27D4EB4Full) ^
         (r->reposted * 0x165667B19E3779F9ull) ^ CTS_MAGIC;
}

static chorus_result_t post_failed(struct ib_conn *c, int qi, int rc, const char *what) {
  struct chorus_comm *comm = c->base.comm;
  if (!c->broken) {
    snprintf(c->why, sizeof c->why, "rank %d peer %d (verbs, %s channel): ibv_post_send of %s "
             "on QP %d failed: %s", comm->rank, c->base.peer, chan_name(c->base.channel), what,
             qi, strerror(rc));
    c->broken = 1;
  }
  return conn_fatal(c);
}

/* Whether stream byte pos lies in [start, start + len). */
static int in_range(uint64_t pos, uint64_t start, uint64_t len) {
  return pos >= start && pos - start < len;
}

/* Where the chunk starting at stream byte tx_posted goes, for at most `want` bytes: into the
 * receive buffer the peer published (rdv_*) while tx_posted lies in it (flag RDV_FLAG in the
 * immediate), else into the peer's ring (never across its end, never beyond the space it
 * has consumed). Returns the chunk's length, 0 when the ring has no room now. */
static size_t chunk_dest(struct ib_conn *c, int qi, size_t want, uint64_t *raddr,
                         uint32_t *rkey, uint32_t *flag) {
  if (in_range(c->tx_posted, c->rdv_pos, c->rdv_len)) {
    uint64_t off = c->tx_posted - c->rdv_pos;
    if (want > c->rdv_len - off) want = (size_t)(c->rdv_len - off);
    *raddr = c->rdv_addr + off;
    *rkey = c->rdv_rkey[qi];
    *flag = RDV_FLAG;
    return want;
  }
  uint64_t used = c->tx_posted - c->tx_acked;
  size_t room = used >= c->size ? 0 : c->size - (size_t)used;
  size_t idx = (size_t)(c->tx_posted % c->size);
  if (want > c->size - idx) want = c->size - idx;
  if (want > room) want = room;
  *raddr = c->peer_rx + idx;
  *rkey = c->q[qi].peer_rkey;
  *flag = 0;
  return want;
}

/* Posts one data chunk of len bytes from src (lkey) as stream bytes [tx_posted, +len). */
static chorus_result_t post_chunk(struct ib_conn *c, int qi, const void *src, uint32_t lkey,
                                  size_t len, uint64_t raddr, uint32_t rkey, uint32_t flag,
                                  const char *what) {
  struct ib_q *q = &c->q[qi];
  struct cv_sge sge = {(uint64_t)(uintptr_t)src, (uint32_t)len, lkey};
  struct cv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof wr);
  wr.wr_id = WRID(WR_DATA, qi, c->chunks_sent);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = CV_WR_RDMA_WRITE_WITH_IMM;
  wr.send_flags = CV_SEND_SIGNALED;
  wr.imm_data = htonl((uint32_t)len | flag);
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  int rc = ib_post_send(q->qp, &wr, &bad);
  if (rc) return post_failed(c, qi, rc, what);
  q->sends++;
  c->chunk_end[c->chunks_sent % CHUNK_LOG] = c->tx_posted + len;
  c->chunks_sent++;
  c->tx_posted += len;
  if (flag) atomic_fetch_add_explicit(&c->base.comm->ib->rdv_bytes, len, memory_order_relaxed);
  return CHORUS_SUCCESS;
}

/* Posts the stream's next bytes as chunks while the receiver's ring (or requested buffer)
 * and receive queues have room: first what the local ring holds, then the direct run's bytes
 * straight from its registered buffer (reserve hands out no ring space while one is open). */
static chorus_result_t post_stream(struct ib_conn *c, int *progressed) {
  struct ib_state *st = c->base.comm->ib;
  size_t chunk = c->size / 4 < CHUNK_MAX ? c->size / 4 : CHUNK_MAX;
  for (;;) {
    const int from_ring = c->tx_posted < c->tx_tail;
    if (!from_ring && !(c->d_reg && c->d_posted < c->d_len)) break;
    if (c->chunks_sent - c->peer_reposted >= RECV_DEPTH) break;
    int qi = (int)(c->chunks_sent % (uint64_t)c->nqp);
    struct ib_q *q = &c->q[qi];
    if (q->sends >= SEND_DEPTH - 1) break; /* one slot kept for credits on QP 0 */
    size_t idx = (size_t)(c->tx_posted % c->size);
    size_t len = (size_t)(from_ring ? c->tx_tail - c->tx_posted : c->d_len - c->d_posted);
    if (len > chunk) len = chunk;
    if (from_ring && len > c->size - idx) len = c->size - idx; /* the local copy wraps there */
    uint64_t raddr;
    uint32_t rkey, flag;
    len = chunk_dest(c, qi, len, &raddr, &rkey, &flag);
    if (len == 0) break;
    if (from_ring) {
      CHECK(post_chunk(c, qi, c->tx + idx, c->lmr[q->nic]->lkey, len, raddr, rkey, flag,
                       "a data chunk"));
      atomic_fetch_add_explicit(&st->ring_bytes, len, memory_order_relaxed);
    } else {
      const struct ib_mrs *m = c->d_reg->ib;
      CHECK(post_chunk(c, qi, c->d_src + c->d_posted, m->mr[st->nic[q->nic].dev_index]->lkey,
                       len, raddr, rkey, flag, "a data chunk from a registered buffer"));
      c->tx_tail += len;
      c->d_posted += len;
      atomic_fetch_add_explicit(&st->zc_bytes, len, memory_order_relaxed);
    }
    *progressed = 1;
  }
  return CHORUS_SUCCESS;
}

/* A control record (credit, receive-buffer request, failure notice): len bytes of our side
 * area at src, RDMA-written to offset off of the peer's FIFO area on QP 0. Returns the
 * post's error number (0: posted, counted in the QP's sends). */
static int post_control(struct ib_conn *c, const void *src, size_t len, uint64_t off,
                        uint64_t wr_id) {
  struct ib_q *q = &c->q[0];
  struct cv_sge sge = {(uint64_t)(uintptr_t)src, (uint32_t)len, c->lmr[q->nic]->lkey};
  struct cv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof wr);
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = CV_WR_RDMA_WRITE;
  wr.send_flags = CV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = c->peer_fifo + off;
  wr.wr.rdma.rkey = q->peer_rkey;
  int rc = ib_post_send(q->qp, &wr, &bad);
  if (rc == 0) q->sends++;
  return rc;
}

/* Tells the sender what we consumed and how many receives we reposted (one in flight). */
static chorus_result_t post_cts(struct ib_conn *c, int *progressed) {
  if (c->cts_inflight) return CHORUS_SUCCESS;
  if (c->rx_head == c->cts_consumed && c->reposted == c->cts_reposted) return CHORUS_SUCCESS;
  struct ib_q *q = &c->q[0];
  if (q->sends >= SEND_DEPTH) return CHORUS_SUCCESS;
  struct cts_rec *r = c->cts_src;
  r->seq = ++c->cts_seq;
  r->consumed = c->rx_head;
  r->reposted = c->reposted;
  r->check = cts_check(r);
  int rc = post_control(c, r, sizeof *r, (r->seq % CTS_SLOTS) * sizeof *r,
                        WRID(WR_CTS, 0, r->seq));
  if (rc) return post_failed(c, 0, rc, "a clear-to-send credit");
  c->cts_inflight = 1;
  c->cts_consumed = r->consumed;
  c->cts_reposted = r->reposted;
  *progressed = 1;
  return CHORUS_SUCCESS;
}

static uint64_t abort_check(const struct cts_rec *r) { return cts_check(r) ^ ABORT_MAGIC; }

static uint64_t rdv_check(const struct rdv_rec *r) {
  uint64_t h = (r->seq * 0x9E3779B97F4A7C15ull) ^ (r->pos * 0xC2B2AE3D27D4EB4Full) ^
               (r->addr * 0x165667B19E3779F9ull) ^ (r->len * 0x27D4EB2F165667C5ull) ^ RDV_MAGIC;
  for (int q = 0; q < IB_MAX_QPS; q++) h = (h ^ r->rkey[q]) * 0x100000001B3ull;
  return h;
}

static uint64_t text_hash(const char *t, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)t[i]) * 1099511628211ull;
  return h;
}

/* The newest valid credit record the peer wrote into our FIFO, and its failure notice. */
static void read_fifo(struct ib_conn *c, int *progressed) {
  if (!c->peer_failed) {
    struct cts_rec r;
    const struct notice *nt = (const struct notice *)((const uint8_t *)c->fifo + NOTICE_OFF);
    r.seq = __atomic_load_n(&nt->rec.seq, __ATOMIC_ACQUIRE);
    if (r.seq == 1) {
      r.consumed = __atomic_load_n(&nt->rec.consumed, __ATOMIC_ACQUIRE);
      r.reposted = __atomic_load_n(&nt->rec.reposted, __ATOMIC_ACQUIRE);
      r.check = __atomic_load_n(&nt->rec.check, __ATOMIC_ACQUIRE);
      char text[sizeof nt->text];
      /* the peer's NIC may be writing it: byte loads, the record's check decides */
      for (size_t i = 0; i < sizeof text; i++)
        text[i] = __atomic_load_n(&nt->text[i], __ATOMIC_RELAXED);
      text[sizeof text - 1] = 0;
      if (r.check == abort_check(&r) && r.reposted == text_hash(text, sizeof text)) {
        /* the notice holds for both connections to this peer (it may reach us on either) */
        for (int ch = 0; ch < CHAN_COUNT; ch++) {
          conn_t *bc = c->base.comm->conns[ch][c->base.peer];
          if (!bc || bc->ops != &ib_ops) continue;
          struct ib_conn *x = (struct ib_conn *)bc;
          if (x->peer_failed) continue;
          x->peer_failed = 1;
          x->peer_failed_seq = r.consumed;
          x->peer_failed_at = now_ns();
          snprintf(x->peer_notice, sizeof x->peer_notice, "%s", text);
        }
        *progressed = 1;
      }
    }
  }
  {
    const struct rdv_rec *rr = (const struct rdv_rec *)((const uint8_t *)c->fifo + RDV_OFF);
    struct rdv_rec r;
    r.seq = __atomic_load_n(&rr->seq, __ATOMIC_ACQUIRE);
    if (r.seq > c->rdv_seen) {
      r.pos = __atomic_load_n(&rr->pos, __ATOMIC_ACQUIRE);
      r.addr = __atomic_load_n(&rr->addr, __ATOMIC_ACQUIRE);
      r.len = __atomic_load_n(&rr->len, __ATOMIC_ACQUIRE);
      for (int q = 0; q < IB_MAX_QPS; q++)
        r.rkey[q] = __atomic_load_n(&rr->rkey[q], __ATOMIC_ACQUIRE);
      r.check = __atomic_load_n(&rr->check, __ATOMIC_ACQUIRE);
      if (r.check == rdv_check(&r)) { /* else still landing: read again next time */
        c->rdv_seen = r.seq;
        if (!in_range(c->tx_posted, c->rdv_pos, c->rdv_len) &&
            in_range(c->tx_posted, r.pos, r.len)) {
          c->rdv_pos = r.pos;
          c->rdv_addr = r.addr;
          c->rdv_len = r.len;
          memcpy(c->rdv_rkey, r.rkey, sizeof c->rdv_rkey);
          *progressed = 1;
        }
      }
    }
  }
  for (int s = 0; s < CTS_SLOTS; s++) {
    struct cts_rec r;
    r.seq = __atomic_load_n(&c->fifo[s].seq, __ATOMIC_ACQUIRE);
    r.consumed = __atomic_load_n(&c->fifo[s].consumed, __ATOMIC_ACQUIRE);
    r.reposted = __atomic_load_n(&c->fifo[s].reposted, __ATOMIC_ACQUIRE);
    r.check = __atomic_load_n(&c->fifo[s].check, __ATOMIC_ACQUIRE);
    if (r.seq <= c->cts_seen || r.check != cts_check(&r)) continue; /* old, or being written */
    if (r.consumed > c->tx_posted || r.reposted > c->chunks_sent) continue; /* impossible */
    c->cts_seen = r.seq;
    if (r.consumed > c->tx_acked) c->tx_acked = r.consumed, *progressed = 1;
    if (r.reposted > c->peer_reposted) c->peer_reposted = r.reposted, *progressed = 1;
  }
}

static chorus_result_t poll_cqs(struct ib_conn *c, int *progressed) {
  struct cv_wc wc[16];
  for (int qi = 0; qi < c->nqp; qi++) {
    struct ib_q *q = &c->q[qi];
    for (;;) {
      int n = ib_poll_cq(q->cq, 16, wc);
      if (n < 0) {
        struct chorus_comm *comm = c->base.comm;
        if (!c->broken)
          snprintf(c->why, sizeof c->why, "rank %d peer %d (verbs, %s channel): polling the "
                   "completion queue of QP %d failed (%d)", comm->rank, c->base.peer,
                   chan_name(c->base.channel), qi, n);
        c->broken = 1;
        return conn_fatal(c);
      }
      for (int i = 0; i < n; i++) {
        int kind = (int)(wc[i].wr_id & 15);
        if (kind == WR_DATA || kind == WR_CTS || kind == WR_RDV) q->sends--;
        if (kind == WR_CTS && (wc[i].wr_id >> 8) != 0) c->cts_inflight = 0;
        if (kind == WR_RDV) c->rdv_inflight = 0;
        if (wc[i].status != CV_WC_SUCCESS) {
          CHECK(completion_failed(c, qi, &wc[i], kind));
          continue;
        }
        if (kind == WR_DATA) q->data_done++;
        if (kind == WR_RECV) {
          if (!(wc[i].wc_flags & CV_WC_WITH_IMM)) continue;
          unsigned next = (q->arr_tail + 1) % (RECV_DEPTH + 1);
          if (next == q->arr_head) { /* the sender broke the receive-credit rule */
            snprintf(c->why, sizeof c->why, "rank %d peer %d (verbs): more chunks in flight "
                     "on QP %d than receives posted", c->base.comm->rank, c->base.peer, qi);
            c->broken = 1;
            return conn_fatal(c);
          }
          q->arrived[q->arr_tail] = ntohl(wc[i].imm_data);
          q->arr_tail = next;
          c->reposted++;
          CHECK(post_recv(c, qi));
        }
        *progressed = 1;
      }
      if (n < 16) break;
    }
  }
  /* Completed prefix of the chunks sent: chunk k went on QP k % nqp as that QP's
   * (k / nqp)-th, so the first chunk not yet completed is the least data_done * nqp + q. */
  uint64_t first = c->chunks_sent;
  for (int qi = 0; qi < c->nqp; qi++) {
    uint64_t k = c->q[qi].data_done * (uint64_t)c->nqp + (uint64_t)qi;
    if (k < first) first = k;
  }
  if (first > c->chunks_done) {
    c->chunks_done = first;
    c->tx_done = c->chunk_end[(first - 1) % CHUNK_LOG];
  }
  /* Chunks join the stream in the order they were sent: chunk k came on QP k % nqp. */
  for (;;) {
    struct ib_q *q = &c->q[c->chunks_rcvd % (uint64_t)c->nqp];
    if (q->arr_head == q->arr_tail) break;
    uint32_t len = q->arrived[q->arr_head] & ~RDV_FLAG;
    int into_buffer = (q->arrived[q->arr_head] & RDV_FLAG) != 0;
    q->arr_head = (q->arr_head + 1) % (RECV_DEPTH + 1);
    if (into_buffer) {
      uint64_t end = c->r_pos + c->r_len;
      if (!c->r_reg || c->rx_tail < c->r_pos || len > end - c->rx_tail ||
          (c->r_started && c->rx_tail != c->r_x + c->r_landed)) {
        snprintf(c->why, sizeof c->why, "rank %d peer %d (verbs): a chunk of %u bytes at "
                 "stream byte %llu landed in a receive buffer not requested for it",
                 c->base.comm->rank, c->base.peer, len, (unsigned long long)c->rx_tail);
        c->broken = 1;
        return conn_fatal(c);
      }
      if (!c->r_started) c->r_started = 1, c->r_x = c->rx_tail;
      c->r_landed += len;
      c->rx_tail += len;
      c->chunks_rcvd++;
      atomic_fetch_add_explicit(&c->base.comm->ib->rz_bytes, len, memory_order_relaxed);
      continue;
    }
    if (c->r_reg && c->r_started && c->rx_tail < c->r_pos + c->r_len) {
      snprintf(c->why, sizeof c->why, "rank %d peer %d (verbs): a chunk of %u bytes at stream "
               "byte %llu came through the ring inside a range the sender was writing into "
               "the requested buffer", c->base.comm->rank, c->base.peer, len,
               (unsigned long long)c->rx_tail);
      c->broken = 1;
      return conn_fatal(c);
    }
    if (len > c->size - (size_t)(c->rx_tail - c->rx_head)) {
      snprintf(c->why, sizeof c->why, "rank %d peer %d (verbs): chunk of %u bytes overflows "
               "the receive ring", c->base.comm->rank, c->base.peer, len);
      c->broken = 1;
      return conn_fatal(c);
    }
    c->rx_tail += len;
    c->chunks_rcvd++;
  }
  return CHORUS_SUCCESS;
}

/* The peer failed at collective seq (0: outside one): has this rank reached it? Earlier
 * collectives, which the peer completed, still finish here. */
static int failure_reached(struct chorus_comm *comm, uint64_t seq) {
  const struct op *cur = comm->current;
  return seq == 0 || (cur && cur->kind != OP_SEND && cur->kind != OP_RECV && cur->seq >= seq);
}

/* Fails the connection with the reason the peer published in the store (waiting wait_ms at
 * most), or without it where the store has none (the failed rank may have hosted it). */
static chorus_result_t fail_peer_reported(struct ib_conn *c, const char *why_text) {
  struct chorus_comm *comm = c->base.comm;
  /* a completion of ours that failed on a connection to this peer is the first-hand cause */
  for (int ch = 0; ch < CHAN_COUNT; ch++) {
    conn_t *bc = comm->conns[ch][c->base.peer];
    if (!bc || bc->ops != &ib_ops || !((struct ib_conn *)bc)->own) continue;
    c->err = conn_fatal((struct ib_conn *)bc);
    return c->err;
  }
  snprintf(c->why, sizeof c->why, "rank %d peer %d (verbs, %s channel): rank %d reported a "
           "failure: %.700s", comm->rank, c->base.peer, chan_name(c->base.channel), c->base.peer,
           why_text);
  c->broken = 1;
  return conn_fatal(c);
}

static int read_failure(struct ib_conn *c, int wait_ms, char *why, size_t cap) {
  char key[32];
  size_t got = 0;
  snprintf(key, sizeof key, "failure/%d", c->base.peer);
  if (bs_try_get(c->base.comm, key, why, cap - 1, &got, wait_ms) != CHORUS_SUCCESS || got == 0)
    return 0;
  why[got < cap ? got : cap - 1] = 0;
  return 1;
}

/* Has the peer published a failure (ib_abort_conns / socket_abort_conns) that this rank has
 * reached? Then fail with its reason rather than at the timeout. Asked once a second while
 * the connection waits (the FIFO notice is the fast path; this covers a notice that could
 * not be written). */
static chorus_result_t probe_peer(struct ib_conn *c) {
  int64_t now = now_ns();
  if (now < c->next_probe) return CHORUS_SUCCESS;
  c->next_probe = now + PROBE_NS;
  char why[700];
  if (!read_failure(c, 1, why, sizeof why)) return CHORUS_SUCCESS;
  if (!failure_reached(c->base.comm, strtoull(why, NULL, 10))) return CHORUS_SUCCESS;
  const char *text = strchr(why, '|');
  return fail_peer_reported(c, text ? text + 1 : why);
}

static chorus_result_t ib_progress(conn_t *bc, int *progressed) {
  struct ib_conn *c = (struct ib_conn *)bc;
  int moved = 0;
  if (c->err) return c->err;
  CHECK(poll_cqs(c, &moved));
  read_fifo(c, &moved);
  CHECK(post_stream(c, &moved));
  CHECK(post_cts(c, &moved));
  if (moved && progressed) *progressed = 1;
  int waiting = (c->starving && c->rx_head == c->rx_tail) || c->tx_posted < c->tx_tail ||
                (c->d_reg && c->tx_done < c->d_pos + c->d_len);
  if (c->peer_failed) {
    /* fail at the collective the peer failed at; or earlier, when this rank waits on the
     * peer and nothing has come for a while: bytes the peer committed before it failed may
     * have been flushed with its queue pair, and will never arrive */
    int64_t now = now_ns();
    if (moved) c->last_moved = now;
    int64_t since = c->last_moved > c->peer_failed_at ? c->last_moved : c->peer_failed_at;
    if (failure_reached(c->base.comm, c->peer_failed_seq) ||
        (waiting && now - since > NOTICE_GRACE_NS))
      return fail_peer_reported(c, c->peer_notice);
  }
  if (c->broken && waiting) return conn_fatal(c);
  if (waiting && !moved) CHECK(probe_peer(c));
  return CHORUS_SUCCESS;
}

/* Ends the direct receive (its range consumed, or the connection closes). */
static void rdv_end(struct ib_conn *c) {
  reg_put(c->base.comm, c->r_reg);
  c->r_reg = NULL;
  c->r_started = 0;
}

/* Bytes of the local ring still in use: until the peer consumed them (its ring holds them
 * until then) and the NIC completed them (it may read the local copy until then). */
static size_t tx_used(const struct ib_conn *c) {
  uint64_t freed = c->tx_acked < c->tx_done ? c->tx_acked : c->tx_done;
  return (size_t)(c->tx_tail - freed);
}

static chorus_result_t ib_reserve(conn_t *bc, void **ptr, size_t *len) {
  struct ib_conn *c = (struct ib_conn *)bc;
  size_t used = tx_used(c);
  size_t idx = (size_t)(c->tx_tail % c->size);
  /* bytes that went to a requested buffer count until the peer reports them: used may
   * exceed the ring for a while */
  size_t space = used >= c->size ? 0 : c->size - used, contig = c->size - idx;
  *ptr = c->tx + idx;
  *len = c->d_reg ? 0 : space < contig ? space : contig; /* a direct run goes first */
  return c->err;
}

static chorus_result_t ib_commit(conn_t *bc, size_t len) {
  struct ib_conn *c = (struct ib_conn *)bc;
  size_t used = c->d_reg ? c->size : tx_used(c);
  size_t idx = (size_t)(c->tx_tail % c->size);
  if (used > c->size || len > c->size - used || len > c->size - idx)
    return comm_set_error(bc->comm, CHORUS_ERR_INTERNAL, "rank %d peer %d: verbs commit of %zu "
                          "bytes exceeds the reserved space", bc->comm->rank, bc->peer, len);
  c->tx_tail += len;
  int moved = 0;
  if (c->err) return c->err;
  return post_stream(c, &moved);
}

static chorus_result_t ib_peek(conn_t *bc, const void **ptr, size_t *len) {
  struct ib_conn *c = (struct ib_conn *)bc;
  size_t avail = (size_t)(c->rx_tail - c->rx_head);
  if (c->r_reg && c->r_started) /* from r_x on, the stream is in the requested buffer */
    avail = c->rx_head >= c->r_x ? 0 : (size_t)((c->rx_tail < c->r_x ? c->rx_tail : c->r_x) -
                                               c->rx_head);
  size_t idx = (size_t)(c->rx_head % c->size);
  size_t contig = c->size - idx;
  *ptr = c->rx + idx;
  *len = avail < contig ? avail : contig;
  c->starving = *len == 0;
  return CHORUS_SUCCESS;
}

static chorus_result_t ib_consume(conn_t *bc, size_t len) {
  struct ib_conn *c = (struct ib_conn *)bc;
  if (len > c->rx_tail - c->rx_head)
    return comm_set_error(bc->comm, CHORUS_ERR_INTERNAL, "rank %d peer %d: verbs consume of %zu "
                          "bytes exceeds the %llu readable", bc->comm->rank, bc->peer, len,
                          (unsigned long long)(c->rx_tail - c->rx_head));
  c->rx_head += len;
  if (c->r_reg && c->rx_head >= c->r_pos + c->r_len) rdv_end(c); /* all came by the ring */
  int moved = 0;
  if (c->err) return c->err;
  return post_cts(c, &moved);
}

/* No file descriptor: completions are polled. An entry with fd -1 (poll() ignores it) asks
 * the engine to keep progressing while bytes or credits still have to go out. */
static int ib_pollfd(conn_t *bc, struct pollfd *pfd) {
  struct ib_conn *c = (struct ib_conn *)bc;
  if (c->err || c->broken) return 0; /* nothing more will reach the peer */
  pfd->fd = -1;
  pfd->events = 0;
  pfd->revents = 0;
  /* posted chunks count until they complete: a QP destroyed before may drop them */
  if (c->tx_posted < c->tx_tail || c->chunks_done < c->chunks_sent ||
      c->rx_head != c->cts_consumed || c->reposted != c->cts_reposted || c->d_reg)
    pfd->events = POLLOUT;
  return 1;
}

static void conn_free(struct ib_conn *c) {
  struct chorus_comm *comm = c->base.comm;
  const struct ib_api *api = comm->ib ? comm->ib->api : NULL;
  if (api) {
    for (int i = 0; i < c->nqp; i++) {
      if (c->q[i].qp && api->destroy_qp(c->q[i].qp) != 0)
        TRACE(SUB_NET, comm->rank, "verbs: destroying a QP failed");
      if (c->q[i].cq && api->destroy_cq(c->q[i].cq) != 0)
        TRACE(SUB_NET, comm->rank, "verbs: destroying a CQ failed");
    }
    /* the QPs are gone: nothing reads a registered buffer any more */
    reg_put(comm, c->d_reg);
    c->d_reg = NULL;
    rdv_end(c);
    for (int i = 0; i < IB_MAX_NICS; i++) {
      if (c->rmr[i] && api->dereg_mr(c->rmr[i]) != 0)
        TRACE(SUB_NET, comm->rank, "verbs: deregistering a ring failed");
      if (c->lmr[i] && api->dereg_mr(c->lmr[i]) != 0)
        TRACE(SUB_NET, comm->rank, "verbs: deregistering a ring failed");
    }
  }
  free(c->mem);
  free(c);
}

static void ib_close(conn_t *bc) { conn_free((struct ib_conn *)bc); }

/* Big payloads: from a registered buffer (chorus_comm_register) the NIC reads the bytes
 * itself, after what the ring still holds; *wrote counts only bytes whose writes have
 * completed, so the caller may reuse them. Anything else is copied through the ring. */
static chorus_result_t ib_write_direct(conn_t *bc, const void *src, size_t n, size_t *wrote,
                                       int *progressed) {
  struct ib_conn *c = (struct ib_conn *)bc;
  struct chorus_comm *comm = bc->comm;
  int moved = 0;
  *wrote = 0;
  if (c->err) return c->err;
  if (!c->d_reg) {
    CHECK(post_stream(c, &moved)); /* the ring's bytes come first in the stream */
    if (c->tx_posted < c->tx_tail) goto out;
    struct chorus_reg *r = reg_find(comm, src, n);
    if (!r || !r->ib) { /* not registered: through the ring */
      reg_put(comm, r);
      CHECK(msg_stream_write(bc, src, n, wrote));
      goto out;
    }
    c->d_reg = r;
    c->d_src = src;
    c->d_pos = c->tx_tail;
    c->d_len = n;
    c->d_posted = c->d_reported = 0;
  } else if ((const uint8_t *)src != c->d_src + c->d_reported || n != c->d_len - c->d_reported) {
    return comm_set_error(comm, CHORUS_ERR_INTERNAL, "rank %d peer %d: a verbs send from a "
                          "registered buffer was resumed at another buffer", comm->rank, bc->peer);
  }
  CHECK(post_stream(c, &moved));
  CHECK(poll_cqs(c, &moved));
  uint64_t done = c->tx_done > c->d_pos ? c->tx_done - c->d_pos : 0;
  if (done > c->d_len) done = c->d_len;
  *wrote = (size_t)(done - c->d_reported);
  c->d_reported = done;
  if (done == c->d_len) { /* the NIC is done with the buffer */
    reg_put(comm, c->d_reg);
    c->d_reg = NULL;
  }
out:
  if (moved || *wrote) *progressed = 1;
  return CHORUS_SUCCESS;
}

/* Writes our receive-buffer request (struct rdv_rec) into the sender's FIFO area on QP 0. */
static chorus_result_t post_rdv(struct ib_conn *c, const struct ib_mrs *m) {
  struct ib_state *st = c->base.comm->ib;
  struct rdv_rec *r = (struct rdv_rec *)((uint8_t *)c->cts_src + RDV_OFF);
  memset(r, 0, sizeof *r);
  r->seq = ++c->rdv_seq;
  r->pos = c->r_pos;
  r->addr = (uint64_t)(uintptr_t)c->r_dst;
  r->len = c->r_len;
  for (int qi = 0; qi < c->nqp; qi++) r->rkey[qi] = m->mr[st->nic[c->q[qi].nic].dev_index]->rkey;
  r->check = rdv_check(r);
  int rc = post_control(c, r, sizeof *r, RDV_OFF, WRID(WR_RDV, 0, r->seq));
  if (rc) return post_failed(c, 0, rc, "a receive buffer request");
  c->rdv_inflight = 1;
  return CHORUS_SUCCESS;
}

/* Big receives into a registered buffer: asks the sender to write the rest of the payload
 * straight into dst (struct rdv_rec) and reports the bytes that landed there. Without a
 * registration, or when the sender had already sent the bytes to the ring, nothing comes
 * here and the caller copies from the ring (peek) as usual. */
static chorus_result_t ib_read_direct(conn_t *bc, void *dst, size_t n, size_t *got,
                                      int *progressed) {
  struct ib_conn *c = (struct ib_conn *)bc;
  struct chorus_comm *comm = bc->comm;
  int moved = 0;
  *got = 0;
  if (c->err) return c->err;
  if (c->r_reg) {
    if ((uint8_t *)dst != c->r_dst + (c->rx_head - c->r_pos) ||
        n != c->r_pos + c->r_len - c->rx_head)
      /* the sender may still write the rest into the old buffer: it cannot be dropped */
      return comm_set_error(comm, CHORUS_ERR_INTERNAL, "rank %d peer %d: a verbs receive into "
                            "a registered buffer was resumed at another buffer", comm->rank,
                            bc->peer);
  } else {
    uint64_t gen = atomic_load(&comm->nregs_made);
    if (c->rx_head != c->rx_tail || c->rdv_inflight || c->q[0].sends >= SEND_DEPTH ||
        (dst == c->r_nodst && gen == c->r_nodst_gen))
      goto out; /* (a full send queue: asked again on the next call) */
    struct chorus_reg *r = reg_find(comm, dst, n);
    const struct ib_mrs *m = r ? r->ib : NULL;
    if (!m || !m->writable) {
      reg_put(comm, r);
      c->r_nodst = dst;
      c->r_nodst_gen = gen;
      goto out;
    }
    c->r_reg = r;
    c->r_dst = dst;
    c->r_pos = c->rx_head;
    c->r_len = n;
    c->r_started = 0;
    c->r_landed = 0;
    CHECK(post_rdv(c, m));
    moved = 1;
  }
  CHECK(poll_cqs(c, &moved));
  if (c->r_started && c->rx_head >= c->r_x && c->rx_head < c->r_x + c->r_landed) {
    size_t k = (size_t)(c->r_x + c->r_landed - c->rx_head);
    c->rx_head += k; /* consumed where it landed: the credit covers it */
    *got = k;
    CHECK(post_cts(c, &moved));
  }
  if (c->r_reg && c->rx_head >= c->r_pos + c->r_len) rdv_end(c);
out:
  if (moved || *got) *progressed = 1;
  return CHORUS_SUCCESS;
}

static const struct transport_ops ib_ops = {
    .name = "verbs",
    .reserve = ib_reserve,
    .commit = ib_commit,
    .peek = ib_peek,
    .consume = ib_consume,
    .progress = ib_progress,
    .pollfd = ib_pollfd,
    .close = ib_close,
    .write_direct = ib_write_direct,
    .read_direct = ib_read_direct,
};

/* For tests: the NIC QP qp of a verbs connection uses, and the connection's QP count. */
const char *ib_conn_nic(const conn_t *bc, int qp, int *nqp) {
  if (!bc || bc->ops != &ib_ops) return NULL;
  const struct ib_conn *c = (const struct ib_conn *)bc;
  *nqp = c->nqp;
  if (qp < 0 || qp >= c->nqp) return NULL;
  return bc->comm->ib->nic[c->q[qp].nic].name;
}

/* ------------------------------------------------------------ connection setup */
struct wire_qp {
  uint32_t qpn, rkey;
  uint16_t lid;
  uint8_t link_layer, mtu;
  uint8_t gid[16];
  uint32_t pad;
};
struct wire_conn {
  uint64_t rx_addr, fifo_addr, size;
  uint32_t nqp, pad;
  struct wire_qp qp[IB_MAX_QPS];
};
struct wire_rank {
  int32_t ok, nqp;
};

static size_t ring_size(void) {
  int64_t v = param_int(PARAM_BUFFSIZE);
  size_t s = v < (int64_t)RING_MIN ? RING_MIN : (uint64_t)v > RING_MAX ? RING_MAX : (size_t)v;
  return (s + 4095) & ~(size_t)4095;
}

/* Allocates the rings, registers them on every NIC the QPs use, creates the QPs (INIT) and
 * posts their receives; fills *w with what the peer needs. */
static chorus_result_t conn_create(struct chorus_comm *comm, int peer, int ch, int nqp,
                                   struct ib_conn **out, struct wire_conn *w) {
  struct ib_state *st = comm->ib;
  const struct ib_api *api = st->api;
  struct ib_conn *c = calloc(1, sizeof *c);
  if (!c) return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", comm->rank);
  c->base.ops = &ib_ops;
  c->base.comm = comm;
  c->base.peer = peer;
  c->base.channel = ch;
  c->nqp = nqp;
  c->size = ring_size();
  snprintf(c->peer_desc, sizeof c->peer_desc, "%s", comm->peers[peer].hostname);
  size_t half = c->size + SIDE_BYTES;
  if (posix_memalign((void **)&c->mem, 4096, 2 * half) != 0) {
    free(c);
    return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d peer %d: cannot allocate 2 x %zu "
                          "bytes of verbs rings", comm->rank, peer, half);
  }
  memset(c->mem, 0, 2 * half);
  c->rx = c->mem;
  c->fifo = (struct cts_rec *)(c->mem + c->size);
  c->tx = c->mem + half;
  c->cts_src = (struct cts_rec *)(c->mem + half + c->size);
  memset(w, 0, sizeof *w);
  w->rx_addr = (uint64_t)(uintptr_t)c->rx;
  w->fifo_addr = (uint64_t)(uintptr_t)c->fifo;
  w->size = c->size;
  w->nqp = (uint32_t)nqp;
  chorus_result_t res = CHORUS_SUCCESS;
  int first = st->next_nic;
  st->next_nic = (st->next_nic + 1) % st->nnics;
  for (int qi = 0; qi < nqp; qi++) {
    int ni = (first + qi) % st->nnics;
    struct ib_nic *n = &st->nic[ni];
    struct ib_q *q = &c->q[qi];
    q->nic = ni;
    if (!c->rmr[ni]) {
      c->rmr[ni] = api->reg_mr(n->pd, c->rx, half, CV_ACCESS_LOCAL_WRITE | CV_ACCESS_REMOTE_WRITE);
      c->lmr[ni] = c->rmr[ni] ? api->reg_mr(n->pd, c->tx, half, CV_ACCESS_LOCAL_WRITE) : NULL;
      if (!c->rmr[ni] || !c->lmr[ni]) {
        res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d peer %d: ibv_reg_mr of %zu bytes "
                             "on %s failed: %s (locked-memory limit? ulimit -l)", comm->rank,
                             peer, half, n->name, strerror(errno));
        goto fail;
      }
    }
    q->cq = api->create_cq(n->ctx, CQ_DEPTH, NULL, NULL, 0);
    if (!q->cq) {
      res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d peer %d: ibv_create_cq on %s "
                           "failed: %s", comm->rank, peer, n->name, strerror(errno));
      goto fail;
    }
    struct cv_qp_init_attr ia;
    memset(&ia, 0, sizeof ia);
    ia.send_cq = q->cq;
    ia.recv_cq = q->cq;
    ia.cap.max_send_wr = SEND_DEPTH;
    ia.cap.max_recv_wr = RECV_DEPTH;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    ia.qp_type = CV_QPT_RC;
    q->qp = api->create_qp(n->pd, &ia);
    if (!q->qp) {
      res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d peer %d: ibv_create_qp (RC) on %s "
                           "failed: %s", comm->rank, peer, n->name, strerror(errno));
      goto fail;
    }
    struct cv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = CV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = (uint8_t)n->port;
    a.qp_access_flags = CV_ACCESS_REMOTE_WRITE;
    int rc = api->modify_qp(q->qp, &a, CV_QP_STATE | CV_QP_PKEY_INDEX | CV_QP_PORT |
                                           CV_QP_ACCESS_FLAGS);
    if (rc) {
      res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d peer %d: QP %d on %s: RESET -> "
                           "INIT failed: %s", comm->rank, peer, qi, n->name, strerror(rc));
      goto fail;
    }
    for (int i = 0; i < RECV_DEPTH; i++) {
      res = post_recv(c, qi);
      if (res != CHORUS_SUCCESS) goto fail;
    }
    struct wire_qp *wq = &w->qp[qi];
    wq->qpn = q->qp->qp_num;
    wq->rkey = c->rmr[ni]->rkey;
    wq->lid = n->lid;
    wq->link_layer = (uint8_t)n->link_layer;
    wq->mtu = (uint8_t)n->mtu;
    memcpy(wq->gid, n->gid.raw, 16);
  }
  *out = c;
  return CHORUS_SUCCESS;
fail:
  conn_free(c);
  return res;
}

/* INIT -> RTR -> RTS against the peer's description. */
static chorus_result_t conn_connect(struct ib_conn *c, const struct wire_conn *w) {
  struct chorus_comm *comm = c->base.comm;
  struct ib_state *st = comm->ib;
  int peer = c->base.peer;
  if (w->size != c->size || (int)w->nqp != c->nqp)
    return comm_set_error(comm, CHORUS_ERR_INVALID, "rank %d peer %d: verbs rings of %llu "
                          "bytes and %u QPs there, %zu and %d here (CHORUS_BUFFSIZE and "
                          "CHORUS_IB_QPS_PER_CONNECTION must agree)", comm->rank, peer,
                          (unsigned long long)w->size, w->nqp, c->size, c->nqp);
  c->peer_rx = w->rx_addr;
  c->peer_fifo = w->fifo_addr;
  for (int qi = 0; qi < c->nqp; qi++) {
    struct ib_q *q = &c->q[qi];
    struct ib_nic *n = &st->nic[q->nic];
    const struct wire_qp *wq = &w->qp[qi];
    if (wq->link_layer != n->link_layer)
      return comm_set_error(comm, CHORUS_ERR_INVALID, "rank %d peer %d: QP %d joins %s on %s:%d "
                            "with %s at rank %d", comm->rank, peer, qi, ll_name(n->link_layer),
                            n->name, n->port, ll_name(wq->link_layer), peer);
    q->peer_rkey = wq->rkey;
    struct cv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = CV_QPS_RTR;
    a.path_mtu = wq->mtu < n->mtu ? wq->mtu : n->mtu;
    a.dest_qp_num = wq->qpn;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = (uint8_t)n->port;
    a.ah_attr.sl = (uint8_t)param_int(PARAM_IB_SL);
    if (n->link_layer == CV_LINK_LAYER_ETHERNET) {
      a.ah_attr.is_global = 1;
      memcpy(a.ah_attr.grh.dgid.raw, wq->gid, 16);
      a.ah_attr.grh.sgid_index = (uint8_t)n->gid_index;
      a.ah_attr.grh.hop_limit = 255;
      a.ah_attr.grh.traffic_class = (uint8_t)param_int(PARAM_IB_TC);
    } else {
      a.ah_attr.dlid = wq->lid;
    }
    int rc = st->api->modify_qp(q->qp, &a, CV_QP_STATE | CV_QP_AV | CV_QP_PATH_MTU |
                                               CV_QP_DEST_QPN | CV_QP_RQ_PSN |
                                               CV_QP_MAX_DEST_RD_ATOMIC | CV_QP_MIN_RNR_TIMER);
    if (rc)
      return comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d peer %d: QP %d on %s:%d: INIT -> "
                            "RTR to QP 0x%x failed: %s", comm->rank, peer, qi, n->name, n->port,
                            wq->qpn, strerror(rc));
    memset(&a, 0, sizeof a);
    a.qp_state = CV_QPS_RTS;
    a.timeout = (uint8_t)param_int(PARAM_IB_TIMEOUT);
    a.retry_cnt = (uint8_t)param_int(PARAM_IB_RETRY_CNT);
    a.rnr_retry = 7;
    a.sq_psn = 0;
    a.max_rd_atomic = 1;
    rc = st->api->modify_qp(q->qp, &a, CV_QP_STATE | CV_QP_TIMEOUT | CV_QP_RETRY_CNT |
                                           CV_QP_RNR_RETRY | CV_QP_SQ_PSN |
                                           CV_QP_MAX_QP_RD_ATOMIC);
    if (rc)
      return comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d peer %d: QP %d on %s:%d: RTR -> "
                            "RTS failed: %s", comm->rank, peer, qi, n->name, n->port,
                            strerror(rc));
  }
  return CHORUS_SUCCESS;
}

static void log_nics(struct chorus_comm *comm, struct ib_state *st) {
  char list[600];
  size_t len = 0;
  list[0] = 0;
  for (int i = 0; i < st->nnics && len + 100 < sizeof list; i++) {
    struct ib_nic *n = &st->nic[i];
    if (n->link_layer == CV_LINK_LAYER_ETHERNET)
      len += (size_t)snprintf(list + len, sizeof list - len, "%s%s:%d (RoCE%s, GID index %d)",
                              i ? ", " : "", n->name, n->port,
                              n->gid_type == CV_GID_TYPE_ROCE_V2   ? " v2"
                              : n->gid_type == CV_GID_TYPE_ROCE_V1 ? " v1" : "",
                              n->gid_index);
    else
      len += (size_t)snprintf(list + len, sizeof list - len, "%s%s:%d (IB, LID %u)",
                              i ? ", " : "", n->name, n->port, n->lid);
  }
  INFO(SUB_NET, comm->rank, "verbs: %d NIC%s: %s", st->nnics, st->nnics == 1 ? "" : "s", list);
  char buf[160];
  const char *why = "";
  enum ib_gdr_mode m = ib_gdr_mode(st->api, param_str(PARAM_NET_GDR_LEVEL), "", buf, sizeof buf, &why);
  INFO(SUB_NET, comm->rank, "verbs: GPUDirect RDMA %s (%s); device buffers are staged through "
       "host memory for now", m == IB_GDR_OFF ? "unavailable" : ib_gdr_mode_name(m), why);
}

/* Creates every verbs connection (QPs in INIT), publishes them, then connects them. */
static chorus_result_t connect_peers(struct chorus_comm *comm, const struct wire_rank *all,
                                     int nqp, struct wire_conn *w) {
  int me = comm->rank, n = comm->nranks;
  chorus_result_t res = CHORUS_SUCCESS;
  int count = 0;
  /* create every connection (QPs in INIT) and publish them, then connect */
  for (int p = 0; p < n; p++) {
    if (p == me || comm->host_of[p] == comm->host_of[me] || !all[p].ok) continue;
    if (all[p].nqp != nqp) {
      res = comm_set_error(comm, CHORUS_ERR_INVALID, "rank %d: CHORUS_IB_QPS_PER_CONNECTION is "
                           "%d here and %d on rank %d; it must agree", me, nqp,
                           all[p].nqp, p);
      return res;
    }
    for (int ch = 0; ch < CHAN_COUNT; ch++) {
      struct ib_conn *c = NULL;
      CHECK_GOTO(conn_create(comm, p, ch, nqp, &c, &w[ch]), res, done);
      comm->conns[ch][p] = &c->base;
      comm->ib->nconns++;
    }
    char key[48];
    snprintf(key, sizeof key, "ib/%d/%d", me, p);
    CHECK_GOTO(bs_set(comm, key, w, CHAN_COUNT * sizeof *w), res, done);
    count++;
  }
  for (int p = 0; p < n; p++) {
    conn_t *c0 = comm->conns[CHAN_COLL][p];
    if (p == me || !c0 || c0->ops != &ib_ops) continue;
    char key[48];
    snprintf(key, sizeof key, "ib/%d/%d", p, me);
    CHECK_GOTO(bs_get(comm, key, w, CHAN_COUNT * sizeof *w), res, done);
    for (int ch = 0; ch < CHAN_COUNT; ch++)
      CHECK_GOTO(conn_connect((struct ib_conn *)comm->conns[ch][p], &w[ch]), res, done);
  }
  INFO(SUB_NET, me, "verbs: connected to %d peer%s, %d QP%s per connection", count,
       count == 1 ? "" : "s", nqp, nqp == 1 ? "" : "s");
done:
  return res;
}

chorus_result_t ib_setup(struct chorus_comm *comm) {
  int me = comm->rank, n = comm->nranks;
  if (comm->nhosts < 2) return CHORUS_SUCCESS;
  struct wire_rank mine = {0, 0};
  int64_t nqp = param_int(PARAM_IB_QPS_PER_CONNECTION);
  if (nqp < 1 || nqp > IB_MAX_QPS)
    return comm_set_error(comm, CHORUS_ERR_INVALID, "rank %d: CHORUS_IB_QPS_PER_CONNECTION "
                          "must be 1 to %d, not %lld", me, IB_MAX_QPS, (long long)nqp);
  mine.nqp = (int32_t)nqp;
  if (param_int(PARAM_IB_DISABLE)) {
    INFO(SUB_NET, me, "verbs: disabled by IB_DISABLE");
  } else {
    const char *why = "";
    const struct ib_api *api = ib_api_get(&why);
    if (!api) {
      if (!atomic_exchange(&unavailable_said, 1))
        INFO(SUB_NET, me, "verbs unavailable (%s); hosts talk over TCP", why);
    } else {
      struct ib_state *st = calloc(1, sizeof *st);
      if (!st) return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", me);
      st->api = api;
      comm->ib = st;
      discover(comm, st);
      TRACE(SUB_NET, me, "verbs: %s", why);
      if (st->nnics == 0) {
        if (!atomic_exchange(&unavailable_said, 1))
          INFO(SUB_NET, me, "verbs: no usable NIC%s%s; hosts talk over TCP",
               param_str(PARAM_IB_HCA)[0] ? " matches IB_HCA " : "", param_str(PARAM_IB_HCA));
      } else {
        log_nics(comm, st);
        mine.ok = 1;
      }
    }
  }
  struct wire_rank *all = calloc((size_t)n, sizeof *all);
  struct wire_conn *w = calloc(CHAN_COUNT, sizeof *w);
  chorus_result_t res = CHORUS_SUCCESS;
  if (!all || !w) {
    res = comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", me);
    goto out;
  }
  CHECK_GOTO(bs_allgather(comm, "ib", &mine, all, sizeof mine), res, out);
  if (mine.ok) CHECK_GOTO(connect_peers(comm, all, mine.nqp, w), res, out);
  /* Every QP is in RTS before anybody writes: a write reaching a QP still in INIT is dropped
   * (hardware retries it until its retry count runs out; the test double fails it at once). */
  CHECK_GOTO(bs_barrier(comm, "ib-ready"), res, out);
out:
  free(all);
  free(w);
  return res;
}

/* Writes this rank's failure notice into the peer's FIFO (slot CTS_SLOTS) on QP 0. */
static void post_abort(struct ib_conn *c, uint64_t failed_seq, const char *text) {
  struct ib_q *q = &c->q[0];
  if (q->sends >= SEND_DEPTH) return;
  struct notice *nt = (struct notice *)((uint8_t *)c->cts_src + NOTICE_OFF);
  memset(nt, 0, sizeof *nt);
  snprintf(nt->text, sizeof nt->text, "%s", text);
  struct cts_rec *r = &nt->rec;
  r->seq = 1;
  r->consumed = failed_seq;
  r->reposted = text_hash(nt->text, sizeof nt->text);
  r->check = abort_check(r);
  if (post_control(c, nt, sizeof *nt, NOTICE_OFF, WRID(WR_CTS, 0, 0)) == 0) c->abort_posted = 1;
}

void ib_abort_conns(struct chorus_comm *comm) {
  struct ib_state *st = comm->ib;
  if (!st || st->aborted || !st->nconns) return;
  st->aborted = 1;
  char key[32], msg[700];
  pthread_mutex_lock(&comm->err_mu);
  snprintf(msg, sizeof msg, "%llu|%.600s", (unsigned long long)comm->failed_seq,
           comm->errbuf[0] ? comm->errbuf : "communicator failed");
  uint64_t failed_seq = comm->failed_seq;
  pthread_mutex_unlock(&comm->err_mu);
  snprintf(key, sizeof key, "failure/%d", comm->rank);
  if (bs_try_set(comm, key, msg, strlen(msg)) != CHORUS_SUCCESS)
    INFO(SUB_NET, comm->rank, "verbs: could not publish the failure in the store");
  /* The notice in every verbs peer's FIFO, on every connection (the one that failed may be
   * broken; the peer reads all of them). Then a short wait for the writes to leave. */
  int pending = 0;
  for (int ch = 0; ch < CHAN_COUNT; ch++)
    for (int p = 0; comm->conns[ch] && p < comm->nranks; p++) {
      conn_t *bc = comm->conns[ch][p];
      if (!bc || bc->ops != &ib_ops) continue;
      post_abort((struct ib_conn *)bc, failed_seq, strchr(msg, '|') + 1);
      pending += ((struct ib_conn *)bc)->abort_posted;
    }
  int64_t end = now_ns() + 200 * 1000000LL;
  while (pending && now_ns() < end) {
    pending = 0;
    for (int ch = 0; ch < CHAN_COUNT; ch++)
      for (int p = 0; comm->conns[ch] && p < comm->nranks; p++) {
        conn_t *bc = comm->conns[ch][p];
        if (!bc || bc->ops != &ib_ops) continue;
        struct ib_conn *c = (struct ib_conn *)bc;
        struct cv_wc wc[16];
        for (int qi = 0; qi < c->nqp; qi++) {
          int n = ib_poll_cq(c->q[qi].cq, 16, wc);
          for (int i = 0; i < n; i++) {
            int kind = (int)(wc[i].wr_id & 15);
            if (kind == WR_DATA || kind == WR_CTS) c->q[qi].sends--;
            if (kind == WR_CTS && (wc[i].wr_id >> 8) == 0) c->abort_posted = 0;
          }
        }
        pending += c->abort_posted;
      }
    if (pending) sched_yield();
  }
  INFO(SUB_NET, comm->rank, "verbs: failure notice written to the peers%s",
       pending ? " (some writes still in flight)" : "");
}

/* ------------------------------------------------------------ registered buffers */
static const char *ctx_name(const struct ib_state *st, int dev) {
  for (int i = 0; i < st->nnics; i++)
    if (st->nic[i].dev_index == dev) return st->nic[i].name;
  return "?";
}

chorus_result_t ib_reg_create(struct chorus_comm *comm, struct chorus_reg *r) {
  struct ib_state *st = comm->ib;
  if (!st || st->nctx == 0 || st->nconns == 0) return CHORUS_SUCCESS; /* verbs not in use */
  struct ib_mrs *m = calloc(1, sizeof *m);
  if (!m) return comm_set_error(NULL, CHORUS_ERR_NOMEM, "register: rank %d: out of memory",
                                comm->rank);
  size_t len = (size_t)(r->end - r->start);
  /* writable by the peers (receives land in it), or else read-only memory: sources only */
  m->writable = 1;
  for (int i = 0; i < st->nctx; i++) {
    int access = m->writable ? CV_ACCESS_LOCAL_WRITE | CV_ACCESS_REMOTE_WRITE : 0;
    m->mr[i] = st->api->reg_mr(st->pd[i], (void *)r->start, len, access);
    if (!m->mr[i] && m->writable && i == 0) {
      m->writable = 0;
      m->mr[i] = st->api->reg_mr(st->pd[i], (void *)r->start, len, 0);
    }
    if (!m->mr[i]) {
      int e = errno;
      for (int j = 0; j < i; j++)
        if (st->api->dereg_mr(m->mr[j]) != 0)
          TRACE(SUB_NET, comm->rank, "verbs: deregistering a buffer failed");
      free(m);
      return comm_set_error(NULL, CHORUS_ERR_SYSTEM, "register: rank %d: ibv_reg_mr of %zu "
                            "bytes at %p on %s failed: %s (locked-memory limit? ulimit -l)",
                            comm->rank, len, (void *)r->start, ctx_name(st, i), strerror(e));
    }
  }
  r->ib = m;
  TRACE(SUB_NET, comm->rank, "verbs: registered %zu bytes at %p on %d device%s", len,
        (void *)r->start, st->nctx, st->nctx == 1 ? "" : "s");
  return CHORUS_SUCCESS;
}

void ib_reg_release(struct chorus_comm *comm, struct chorus_reg *r) {
  struct ib_mrs *m = r->ib;
  r->ib = NULL;
  if (!m) return;
  for (int i = 0; i < IB_MAX_NICS; i++)
    if (m->mr[i] && comm->ib && comm->ib->api->dereg_mr(m->mr[i]) != 0)
      TRACE(SUB_NET, comm->rank, "verbs: deregistering a buffer failed");
  free(m);
}

/* For tests: bytes sent over verbs straight from registered buffers and from the rings;
 * bytes received straight into registered buffers. */
void ib_sent_bytes(const struct chorus_comm *comm, uint64_t *zero_copy, uint64_t *ring) {
  *zero_copy = comm->ib ? atomic_load(&comm->ib->zc_bytes) : 0;
  *ring = comm->ib ? atomic_load(&comm->ib->ring_bytes) : 0;
}
uint64_t ib_received_direct_bytes(const struct chorus_comm *comm) {
  return comm->ib ? atomic_load(&comm->ib->rz_bytes) : 0;
}

void ib_teardown(struct chorus_comm *comm) {
  struct ib_state *st = comm ? comm->ib : NULL;
  if (!st) return;
  if (st->nconns) {
    uint64_t zc = atomic_load(&st->zc_bytes), ring = atomic_load(&st->ring_bytes);
    INFO(SUB_NET, comm->rank, "verbs: sent %llu bytes straight from registered buffers and "
         "%llu through the rings, %llu of them into the peers' registered buffers; received "
         "%llu bytes straight into registered buffers", (unsigned long long)zc,
         (unsigned long long)ring, (unsigned long long)atomic_load(&st->rdv_bytes),
         (unsigned long long)atomic_load(&st->rz_bytes));
  }
  for (int i = 0; i < st->nctx; i++) {
    if (st->pd[i] && st->api->dealloc_pd(st->pd[i]) != 0)
      TRACE(SUB_NET, comm->rank, "verbs: deallocating a protection domain failed");
    if (st->ctx[i] && st->api->close_device(st->ctx[i]) != 0)
      TRACE(SUB_NET, comm->rank, "verbs: closing a device failed");
  }
  free(st);
  comm->ib = NULL;
}
