/* engine.c - the progress engine: one thread per communicator runs collectives in issue
 * order and progresses point-to-point messages beside them; requests, waiting (spin, then
 * yield, then sleep on the doorbell futex or poll), deadlines and failure propagation. */
#include <errno.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

const char *op_kind_name(enum op_kind k) {
  static const char *names[OP_KIND_COUNT] = {
      "all_reduce", "broadcast", "reduce",  "all_gather", "reduce_scatter", "gather",
      "scatter",    "all_to_all", "barrier", "send",       "recv"};
  return (unsigned)k < OP_KIND_COUNT ? names[k] : "unknown";
}

int op_describe(const struct op *op, char *buf, size_t cap) {
  if (!op) return snprintf(buf, cap, "(no operation)");
  if (op->kind == OP_SEND || op->kind == OP_RECV)
    return snprintf(buf, cap, "%s #%llu %s %d tag %d (%zu x %s)", op_kind_name(op->kind),
                    (unsigned long long)op->seq, op->kind == OP_SEND ? "to" : "from", op->root,
                    op->tag, op->count, chorus_dtype_name(op->dtype));
  return snprintf(buf, cap, "%s seq %llu (%zu x %s)", op_kind_name(op->kind),
                  (unsigned long long)op->seq, op->count, chorus_dtype_name(op->dtype));
}

/* ---------------------------------------------------------------- requests */
#define WAIT_SPIN_NS 50000LL
static void cpu_relax(void);

static chorus_request_t *req_new(struct chorus_comm *comm, uint64_t seq) {
  chorus_request_t *r = calloc(1, sizeof(*r));
  if (!r) return NULL;
  atomic_init(&r->refs, 2);
  atomic_init(&r->state, REQ_QUEUED);
  r->seq = seq;
  r->source = -1;
  r->comm = comm;
  /* With a core per local rank to spare (the engine spins then, see engine_start), a waiter
   * spins briefly too: a small collective completes within tens of microseconds, less than
   * a sleeping thread takes to be woken on a virtual machine. Oversubscribed, it sleeps at
   * once and leaves the core to the threads doing the work. */
  r->spin_ns = comm->spin > 0 ? WAIT_SPIN_NS : 0;
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  return r;
}

static void req_unref(chorus_request_t *r) {
  if (atomic_fetch_sub(&r->refs, 1) == 1) {
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
  }
}

static void req_complete(chorus_request_t *r, chorus_result_t res, const char *msg) {
  void (*cb)(void *, chorus_result_t);
  void *arg;
  pthread_mutex_lock(&r->mu);
  r->result = res;
  if (res != CHORUS_SUCCESS) snprintf(r->error, sizeof r->error, "%s", msg ? msg : "");
  atomic_store(&r->state, REQ_DONE);
  cb = r->cb;
  arg = r->cb_arg;
  r->cb = NULL;
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
  if (cb) cb(arg, res);
  req_unref(r);
}

static void run_inline(chorus_request_t *req);
static void kick_deferred(chorus_request_t *req);

chorus_result_t chorus_test(chorus_request_t *req, int *done) {
  if (!req || !done) return CHORUS_ERR_INVALID;
  *done = atomic_load(&req->state) == REQ_DONE;
  if (!*done && req->runs_inline) kick_deferred(req); /* a poller waits for the engine */
  return *done ? req->result : CHORUS_SUCCESS;
}

chorus_result_t chorus_wait(chorus_request_t *req, int timeout_ms) {
  if (!req) return CHORUS_ERR_INVALID;
  if (atomic_load(&req->state) == REQ_DONE) return req->result;
  /* a waiter with a time limit does not run the op (it might outlast the limit): it starts
   * the engine instead */
  if (req->runs_inline) {
    if (timeout_ms < 0) run_inline(req);
    else kick_deferred(req);
  }
  if (req->spin_ns > 0 && timeout_ms != 0) {
    int64_t end = now_ns() + req->spin_ns;
    for (unsigned i = 1;; i++) {
      if (atomic_load_explicit(&req->state, memory_order_acquire) == REQ_DONE) {
        /* req_complete stores the state under the lock after the result: take the lock so
         * that the result and error text are read after it is released */
        pthread_mutex_lock(&req->mu);
        pthread_mutex_unlock(&req->mu);
        return req->result;
      }
      cpu_relax();
      if ((i & 63) == 0 && now_ns() >= end) break;
    }
  }
  pthread_mutex_lock(&req->mu);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  int64_t end = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec + (int64_t)timeout_ms * 1000000LL;
  while (atomic_load(&req->state) != REQ_DONE) {
    if (timeout_ms < 0) {
      pthread_cond_wait(&req->cv, &req->mu);
    } else {
      struct timespec dl = {.tv_sec = end / 1000000000LL, .tv_nsec = end % 1000000000LL};
      if (pthread_cond_timedwait(&req->cv, &req->mu, &dl) == ETIMEDOUT &&
          atomic_load(&req->state) != REQ_DONE) {
        pthread_mutex_unlock(&req->mu);
        return CHORUS_INPROGRESS;
      }
    }
  }
  pthread_mutex_unlock(&req->mu);
  return req->result;
}

chorus_result_t chorus_request_on_complete(chorus_request_t *req,
                                           void (*fn)(void *arg, chorus_result_t res),
                                           void *arg) {
  if (!req || !fn) return CHORUS_ERR_INVALID;
  pthread_mutex_lock(&req->mu);
  if (req->cb) {
    pthread_mutex_unlock(&req->mu);
    return CHORUS_ERR_INVALID;
  }
  if (atomic_load(&req->state) == REQ_DONE) {
    pthread_mutex_unlock(&req->mu);
    fn(arg, req->result);
    return CHORUS_SUCCESS;
  }
  req->cb = fn;
  req->cb_arg = arg;
  pthread_mutex_unlock(&req->mu);
  return CHORUS_SUCCESS;
}

const char *chorus_request_error(chorus_request_t *req) {
  if (!req || atomic_load(&req->state) != REQ_DONE) return "";
  return req->error;
}
uint64_t chorus_request_seq(const chorus_request_t *req) { return req ? req->seq : 0; }
int chorus_request_source(const chorus_request_t *req) { return req ? req->source : -1; }
void chorus_request_free(chorus_request_t *req) {
  if (req) req_unref(req);
}

/* ---------------------------------------------------------------- ops */
static void op_free(struct op *op) {
  if (op->staging) cuda_p2p_release(NULL, op);
  free(op->counts);
  free(op->displs);
  free(op->counts2);
  free(op->displs2);
  free(op);
}

static void op_finish(struct chorus_comm *comm, struct op *op, chorus_result_t res) {
  char msg[1400];
  msg[0] = 0;
  trace_op_end(comm, op, res);
  if (res != CHORUS_SUCCESS) {
    trace_on_failure(comm, res); /* on disk before the caller learns of the failure */
    pthread_mutex_lock(&comm->err_mu);
    if (comm->errbuf[0]) snprintf(msg, sizeof msg, "chorus: %s", comm->errbuf);
    pthread_mutex_unlock(&comm->err_mu);
    if (!msg[0]) {
      char d[200];
      op_describe(op, d, sizeof d);
      snprintf(msg, sizeof msg, "chorus: %s failed on rank %d: %s", d, comm->rank,
               chorus_result_string(res));
    }
  }
  req_complete(op->req, res, msg);
  op_free(op);
}

/* Per-peer point-to-point state: the head send and the head (or any-source) receive. */
struct p2p_peer {
  struct msg_tx tx;
  struct op *tx_op;
  struct msg_rx rx;
  struct op *rx_op;   /* op bound to rx (after the header matched for any-source) */
  int probing;        /* rx holds a header read for an any-source receive */
};

static void list_push(struct op **head, struct op *op) {
  op->next = NULL;
  while (*head) head = &(*head)->next;
  *head = op;
}

static void p2p_take_incoming(struct chorus_comm *comm) {
  pthread_mutex_lock(&comm->mu);
  struct op *in = comm->p2p_incoming;
  comm->p2p_incoming = NULL;
  pthread_mutex_unlock(&comm->mu);
  while (in) {
    struct op *next = in->next;
    trace_op_begin(comm, in, 0);
    if (in->kind == OP_SEND) list_push(&comm->p2p_send[in->root], in);
    else if (in->root == CHORUS_ANY_SOURCE) list_push(&comm->p2p_any, in);
    else list_push(&comm->p2p_recv[in->root], in);
    in = next;
  }
}

static int p2p_pending(struct chorus_comm *comm) {
  if (comm->p2p_any) return 1;
  for (int p = 0; p < comm->nranks; p++)
    if (comm->p2p_send[p] || comm->p2p_recv[p]) return 1;
  return 0;
}

static void p2p_fail_all(struct chorus_comm *comm, chorus_result_t res) {
  struct p2p_peer *st = comm->engine_priv;
  for (int p = 0; p < comm->nranks; p++) {
    while (comm->p2p_send[p]) {
      struct op *o = comm->p2p_send[p];
      comm->p2p_send[p] = o->next;
      op_finish(comm, o, res);
    }
    while (comm->p2p_recv[p]) {
      struct op *o = comm->p2p_recv[p];
      comm->p2p_recv[p] = o->next;
      op_finish(comm, o, res);
    }
    if (st) {
      st[p].tx_op = NULL;
      st[p].rx_op = NULL;
      st[p].probing = 0;
    }
  }
  while (comm->p2p_any) {
    struct op *o = comm->p2p_any;
    comm->p2p_any = o->next;
    op_finish(comm, o, res);
  }
}

chorus_result_t p2p_progress(struct chorus_comm *comm, int *progressed) {
  struct p2p_peer *st = comm->engine_priv;
  int64_t now = 0;
  for (int p = 0; p < comm->nranks; p++) {
    if (p == comm->rank) continue;
    conn_t *c = comm->conns[CHAN_P2P][p];
    struct p2p_peer *s = &st[p];
    /* sends */
    while (comm->p2p_send[p]) {
      struct op *o = comm->p2p_send[p];
      if (s->tx_op != o) {
        if (o->on_device) {
          /* device memory goes out of a pinned host copy, made once the caller's stream
           * has produced the data */
          int ready = 0;
          CHECK(cuda_p2p_send_ready(comm, o, &ready));
          if (!ready) break;
        }
        s->tx_op = o;
        o->seq = comm->p2p_send_seq[p]++;
        msg_tx_init(&s->tx, c, o, o->on_device ? o->staging : o->sendbuf,
                    o->count * dtype_size(o->dtype));
        if (!now) now = now_ns();
        o->deadline_ns = now + (int64_t)comm->timeout_ms * 1000000LL;
        atomic_store(&o->req->state, REQ_STARTED);
        trace_op_start(comm, o, now);
      }
      CHECK(msg_tx_progress(&s->tx, progressed));
      if (!s->tx.done) break;
      comm->p2p_send[p] = o->next;
      s->tx_op = NULL;
      op_finish(comm, o, CHORUS_SUCCESS);
    }
    /* receives: bind the head specific receive, or probe for an any-source one */
    for (;;) {
      if (!s->rx_op) {
        struct op *o = comm->p2p_recv[p];
        if (!o && comm->p2p_any) {
          /* read the next header from p to see whether it matches an any-source recv */
          if (!s->probing) {
            struct op probe = *comm->p2p_any;
            probe.seq = comm->p2p_recv_seq[p];
            msg_rx_init(&s->rx, c, &probe, 0);
            s->probing = 1;
          }
          int ready = 0;
          CHECK(msg_rx_header(&s->rx, &ready));
          if (!ready) break;
          /* match the first any-source receive with this tag */
          struct op **pp = &comm->p2p_any;
          while (*pp && (*pp)->tag != s->rx.got.root) pp = &(*pp)->next;
          if (!*pp) break;
          o = *pp;
          *pp = o->next;
          o->next = NULL;
          o->root = p;
          o->req->source = p;
          comm->p2p_recv[p] = o;
        }
        if (!o) break;
        struct msg_hdr got = s->rx.got;
        size_t hp = s->probing ? s->rx.hdr_pos : 0;
        o->seq = comm->p2p_recv_seq[p]++;
        msg_rx_init(&s->rx, c, o, o->count * dtype_size(o->dtype));
        s->rx.got = got;
        s->rx.hdr_pos = hp;
        s->probing = 0;
        s->rx_op = o;
        o->req->source = p;
        if (o->on_device) CHECK(cuda_p2p_recv_begin(comm, o));
        if (!now) now = now_ns();
        o->deadline_ns = now + (int64_t)comm->timeout_ms * 1000000LL;
        atomic_store(&o->req->state, REQ_STARTED);
        trace_op_start(comm, o, now);
      }
      struct op *o = s->rx_op;
      CHECK(msg_rx_copy(&s->rx, o->on_device ? o->staging : o->recvbuf, progressed));
      if (!s->rx.done) break;
      if (o->on_device) CHECK(cuda_p2p_recv_end(comm, o));
      comm->p2p_recv[p] = o->next;
      s->rx_op = NULL;
      op_finish(comm, o, CHORUS_SUCCESS);
    }
  }
  return CHORUS_SUCCESS;
}

/* Earliest deadline of the active point-to-point ops, 0 if none. */
static int64_t p2p_deadline(struct chorus_comm *comm, struct op **which) {
  struct p2p_peer *st = comm->engine_priv;
  int64_t d = 0;
  for (int p = 0; p < comm->nranks; p++) {
    struct op *o[2] = {st[p].tx_op, st[p].rx_op};
    for (int k = 0; k < 2; k++)
      if (o[k] && (d == 0 || o[k]->deadline_ns < d)) {
        d = o[k]->deadline_ns;
        *which = o[k];
      }
  }
  return d;
}

/* ---------------------------------------------------------------- waiting */
static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static uint32_t doorbell_value(struct chorus_comm *comm) {
  return comm->shm ? shm_doorbell_value(comm) : atomic_load(&comm->local_doorbell);
}

void engine_wake(struct chorus_comm *comm) {
  if (comm->shm) {
    shm_ring_own_doorbell(comm);
  } else {
    atomic_fetch_add(&comm->local_doorbell, 1);
    syscall(SYS_futex, &comm->local_doorbell, FUTEX_WAKE, 1, NULL, NULL, 0);
  }
  if (comm->wake_fd >= 0 && comm->wake_polled) {
    uint64_t one = 1;
    ssize_t w = write(comm->wake_fd, &one, sizeof one);
    (void)w;
  }
}

/* Sleeps until a peer or the user rings, a socket is ready, or timeout_us passes. */
static void engine_block(struct chorus_comm *comm, uint32_t seen, int timeout_us) {
  int nsock = 0;
  struct pollfd pfd[2 * CHAN_COUNT * 64 + 1];
  if (comm->sock) {
    for (int ch = 0; ch < CHAN_COUNT; ch++)
      for (int p = 0; p < comm->nranks && nsock < (int)(sizeof pfd / sizeof pfd[0]) - 1; p++) {
        conn_t *c = comm->conns[ch][p];
        if (c && c->ops->pollfd && c->ops->pollfd(c, &pfd[nsock])) nsock++;
      }
  }
  if (nsock > 0) {
    int shm_too = comm->shm != NULL;
    pfd[nsock].fd = comm->wake_fd;
    pfd[nsock].events = POLLIN;
    pfd[nsock].revents = 0;
    int ms = shm_too ? 0 : timeout_us / 1000;
    int r = poll(pfd, (nfds_t)(nsock + 1), ms > 0 ? ms : (shm_too ? 0 : 1));
    if (r > 0 && (pfd[nsock].revents & POLLIN)) {
      uint64_t v;
      ssize_t rd = read(comm->wake_fd, &v, sizeof v);
      (void)rd;
    }
    if (!shm_too) return;
    timeout_us = 200; /* shm peers too: short futex sleeps keep sockets polled */
  }
  if (comm->shm) {
    shm_wait_doorbell(comm, seen, timeout_us);
  } else {
    struct timespec ts = {.tv_sec = timeout_us / 1000000, .tv_nsec = (timeout_us % 1000000) * 1000L};
    syscall(SYS_futex, &comm->local_doorbell, FUTEX_WAIT, seen, &ts, NULL, 0);
  }
}

static chorus_result_t progress_conns(struct chorus_comm *comm, int *progressed) {
  for (int ch = 0; ch < CHAN_COUNT; ch++)
    for (int p = 0; p < comm->nranks; p++) {
      conn_t *c = comm->conns[ch][p];
      if (c && c->ops->progress) CHECK(c->ops->progress(c, progressed));
    }
  return CHORUS_SUCCESS;
}

/* Does any connection still hold outgoing bytes or owe its peer something (socket tx
 * rings; verbs chunks not yet posted, credits not yet returned, a send from a registered
 * buffer not yet completed)? They must be flushed before the engine sleeps or stops, or
 * the peer would wait forever. */
static int conns_flushing(struct chorus_comm *comm) {
  for (int ch = 0; ch < CHAN_COUNT; ch++)
    for (int p = 0; p < comm->nranks; p++) {
      conn_t *c = comm->conns[ch][p];
      struct pollfd pfd;
      if (c && c->ops->pollfd && c->ops->pollfd(c, &pfd) && (pfd.events & POLLOUT)) return 1;
    }
  return 0;
}

static chorus_result_t failed_result(struct chorus_comm *comm) {
  return comm->err != CHORUS_SUCCESS ? comm->err : CHORUS_ERR_ABORTED;
}

/* Who a timed-out op waited for. A collective asks the store which ranks reached it: each
 * rank that times out marks <prefix>/stuck/<seq>/<rank>, then looks for the others' marks
 * (1 s for all of them together, enough for ranks whose deadlines are a little later); ranks
 * without a mark never reached this collective, which names a silent or dead rank even to
 * ranks that waited on somebody else. Point-to-point: the peer. */
#define STUCK_WAIT_MS 1000
static void describe_awaited(struct chorus_comm *comm, const struct op *op, char *buf,
                             size_t cap) {
  snprintf(buf, cap, "peers");
  if (!op) return;
  if (op->kind == OP_SEND || op->kind == OP_RECV) {
    if (op->root >= 0) snprintf(buf, cap, "rank %d", op->root);
    else snprintf(buf, cap, "any peer");
    return;
  }
  if (comm->nranks < 2) return;
  const unsigned long long seq = (unsigned long long)op->seq;
  char key[64], v[8], list[200] = "";
  snprintf(key, sizeof key, "stuck/%llu/%d", seq, comm->rank);
  if (bs_try_set(comm, key, "1", 1) != CHORUS_SUCCESS) return;
  int64_t end = now_ns() + (int64_t)STUCK_WAIT_MS * 1000000LL;
  size_t used = 0;
  int missing = 0;
  for (int p = 0; p < comm->nranks; p++) {
    if (p == comm->rank) continue;
    snprintf(key, sizeof key, "stuck/%llu/%d", seq, p);
    int64_t left = (end - now_ns()) / 1000000LL;
    size_t got;
    if (bs_try_get(comm, key, v, sizeof v, &got, left > 20 ? (int)left : 20) == CHORUS_SUCCESS)
      continue;
    if (used + 16 < sizeof list)
      used += (size_t)snprintf(list + used, sizeof list - used, "%s%d", missing ? ", " : "", p);
    missing++;
  }
  if (!missing)
    snprintf(buf, cap, "peers (every rank reached this collective)");
  else
    snprintf(buf, cap, "rank%s %s, which never reached %s seq %llu", missing > 1 ? "s" : "", list,
             op_kind_name(op->kind), seq);
}

/* Fails the op (or the oldest point-to-point op) whose deadline has passed. */
static chorus_result_t check_deadline(struct chorus_comm *comm, struct op *op) {
  int64_t now = now_ns();
  struct op *late = op;
  int64_t dl = op ? op->deadline_ns : 0;
  struct op *p2p_late = NULL;
  int64_t pdl = p2p_deadline(comm, &p2p_late);
  if (pdl && (!dl || pdl < dl)) {
    dl = pdl;
    late = p2p_late;
  }
  if (dl && now > dl) {
    char d[200], who[300];
    op_describe(late, d, sizeof d);
    describe_awaited(comm, late, who, sizeof who);
    return comm_set_error(comm, CHORUS_ERR_TIMEOUT,
                          "%s timed out on rank %d after %d ms waiting for %s", d, comm->rank,
                          comm->timeout_ms, who);
  }
  return CHORUS_SUCCESS;
}

/* One pass over the connections and the point-to-point queues, unless the communicator
 * failed. */
static chorus_result_t progress_all(struct chorus_comm *comm, int *progressed) {
  if (atomic_load(&comm->failed)) return failed_result(comm);
  CHECK(progress_conns(comm, progressed));
  return p2p_progress(comm, progressed);
}

/* While the GPU works for op: a device completion rings no doorbell, so this never sleeps
 * (engine_poll's futex sleeps would add up to milliseconds per copy); it spins, then
 * yields the core, and checks the deadline every few hundred calls. */
chorus_result_t engine_poll_device(struct chorus_comm *comm, struct op *op, int *idle_iters) {
  int progressed = 0;
  CHECK(progress_all(comm, &progressed));
  int n = ++*idle_iters;
  if (n >= 1 << 30) *idle_iters = 1;
  if (progressed) *idle_iters = 0;
  else if (n < comm->spin || n < 32) cpu_relax();
  else sched_yield();
  if ((n & 255) == 0) CHECK(check_deadline(comm, op));
  return CHORUS_SUCCESS;
}

chorus_result_t engine_poll(struct chorus_comm *comm, struct op *op, int *idle_iters) {
  int progressed = 0;
  CHECK(progress_all(comm, &progressed));
  if (progressed) {
    *idle_iters = 0;
    comm->db_seen = doorbell_value(comm);
    return CHORUS_SUCCESS;
  }
  int n = ++*idle_iters;
  int spin = comm->spin;
  if (n < spin) {
    cpu_relax();
  } else if (n < spin + (spin ? 64 : 2)) {
    sched_yield();
  } else {
    CHECK(check_deadline(comm, op));
    /* sleep longer the longer we have been idle, but stay responsive */
    int us = n < spin + 200 ? 50 : 2000;
    engine_block(comm, comm->db_seen, us);
  }
  comm->db_seen = doorbell_value(comm);
  if (atomic_load(&comm->failed)) return failed_result(comm);
  return CHORUS_SUCCESS;
}

/* ---------------------------------------------------------------- running ops */
#define IDLE_WATCH_MS 500
/* How long an engine with a core of its own spins for the next post before it sleeps. */
#define IDLE_SPIN_NS 100000LL

/* Waking a thread asleep on a condition variable costs 5..30 us on a virtual machine, more
 * than a small collective itself takes; back-to-back small collectives (a training step's
 * gradient buckets, a benchmark) leave the engine idle for a few microseconds between
 * posts. With a core to spare (comm->spin > 0) the engine therefore watches the post
 * counter for a while before it sleeps. Returns 1 when something was posted (or the
 * communicator is stopping) within the spin. */
static int engine_idle_spin(struct chorus_comm *comm, uint64_t submits) {
  if (comm->spin <= 0) return 0;
  int64_t end = now_ns() + IDLE_SPIN_NS;
  for (unsigned i = 1;; i++) {
    if (atomic_load_explicit(&comm->submits, memory_order_acquire) != submits ||
        atomic_load(&comm->stop) || atomic_load(&comm->aborted) || atomic_load(&comm->failed))
      return 1;
    cpu_relax();
    if ((i & 63) == 0 && now_ns() >= end) return 0;
  }
}
/* Runs the collective op, which the caller (holding run_mu) took off the queue and made
 * comm->current, and completes its request. */
static void run_op(struct chorus_comm *comm, struct op *op) {
  chorus_result_t res;
  if (atomic_load(&comm->failed)) {
    trace_op_begin(comm, op, 0);
    res = failed_result(comm);
  } else {
    atomic_store(&op->req->state, REQ_STARTED);
    int64_t start = now_ns();
    trace_op_begin(comm, op, start);
    op->deadline_ns = start + (int64_t)comm->timeout_ms * 1000000LL;
    TRACE(SUB_COLL, comm->rank, "%s seq %llu count %zu %s", op_kind_name(op->kind),
          (unsigned long long)op->seq, op->count, chorus_dtype_name(op->dtype));
    res = op->on_device ? cuda_run(comm, op) : algo_run(comm, op);
    if (res != CHORUS_SUCCESS) comm->failed_seq = op->seq;
    if (res != CHORUS_SUCCESS && !atomic_load(&comm->failed)) {
      char d[200];
      op_describe(op, d, sizeof d);
      comm_set_error(comm, res, "%s failed on rank %d: %s", d, comm->rank,
                     chorus_result_string(res));
    }
  }
  /* verbs peers learn of the failure before the caller does (it may exit at once) */
  if (res != CHORUS_SUCCESS) {
    ib_abort_conns(comm);
    socket_stop_io(comm); /* before op_finish hands the buffers back */
  }
  pthread_mutex_lock(&comm->mu);
  comm->current = NULL;
  pthread_mutex_unlock(&comm->mu);
  atomic_store_explicit(&comm->last_run_ns, now_ns(), memory_order_relaxed);
  op_finish(comm, op, res);
}

/* ---------------------------------------------------------------- waiters
 *
 * Where the local ranks outnumber half the cores (comm->spin == 0: nobody spins), every
 * hand-off between threads is a wake-up and a context switch, and a small collective paid
 * several of them per rank: the caller woke the engine, the engine woke the caller. A
 * caller that waits (without a time limit) for a CPU collective the engine has not started
 * therefore runs it itself, with the collectives queued before it, while no other thread
 * runs ops (run_mu). The engine keeps everything else: point-to-point, device work,
 * flushing, failures; a waiter that leaves it any of that kicks it.
 *
 * For a waiter to find its collective unstarted, the engine must not be woken by the post:
 * for NAP_WINDOW_NS after a collective ends, an idle engine naps (timed sleeps of NAP_NS)
 * and a CPU collective posted meanwhile wakes nobody. Its caller most likely waits for it
 * at once; if it polls (chorus_test) the poll kicks the engine, and if it does neither the
 * engine starts it at the end of the nap. Collectives left queued behind a waiter's are left
 * the same way, to the next waiter or the nap. */
#define NAP_NS 500000LL            /* one nap: the longest an unwaited post waits to start */
#define NAP_WINDOW_NS 20000000LL   /* the engine naps this long after the last collective */

/* Takes the next collective off the queue and makes it comm->current (mu held); NULL if
 * there is none, or (cpu_only) if it is device work, which only the engine runs. */
static struct op *queue_take_locked(struct chorus_comm *comm, int cpu_only) {
  struct op *op = comm->queue_head;
  if (!op || (cpu_only && op->on_device)) return NULL;
  comm->queue_head = op->next;
  if (!comm->queue_head) comm->queue_tail = NULL;
  comm->current = op;
  return op;
}

/* A waiter that will use req's communicator counts itself in inline_users; 0 if req is no
 * longer queued (then comm may already be gone). The communicator outlives every request
 * it has not completed, and engine_stop waits for inline_users to drop to 0 after
 * completing them all: counted under req->mu while req is still queued, the caller may use
 * comm until it gives the count back (inline_leave). */
static int inline_enter(chorus_request_t *req) {
  if (atomic_load(&req->state) != REQ_QUEUED) return 0; /* started: nothing to take over */
  pthread_mutex_lock(&req->mu);
  int queued = atomic_load(&req->state) == REQ_QUEUED;
  if (queued) atomic_fetch_add(&req->comm->inline_users, 1);
  pthread_mutex_unlock(&req->mu);
  return queued;
}
static void inline_leave(struct chorus_comm *comm) { atomic_fetch_sub(&comm->inline_users, 1); }

/* Wakes the engine from its idle sleep or nap to look at its work (mu held). */
static void kick_locked(struct chorus_comm *comm) {
  comm->kick = 1;
  pthread_cond_signal(&comm->idle_cv);
}

/* Wakes the engine if req's collective sits deferred in the queue (chorus_test). */
static void kick_deferred(chorus_request_t *req) {
  if (!inline_enter(req)) return;
  struct chorus_comm *comm = req->comm;
  pthread_mutex_lock(&comm->mu);
  if (comm->napping) kick_locked(comm);
  pthread_mutex_unlock(&comm->mu);
  inline_leave(comm);
}

static void run_inline(chorus_request_t *req) {
  if (!inline_enter(req)) return;
  struct chorus_comm *comm = req->comm;
  if (pthread_mutex_trylock(&comm->run_mu) != 0) { /* the engine (or a waiter) runs ops */
    inline_leave(comm);
    return;
  }
  while (atomic_load_explicit(&req->state, memory_order_acquire) == REQ_QUEUED) {
    if (atomic_load(&comm->failed) || atomic_load(&comm->stop) || atomic_load(&comm->aborted))
      break;
    p2p_take_incoming(comm); /* progressed beside the collective, as the engine would */
    pthread_mutex_lock(&comm->mu);
    struct op *op = queue_take_locked(comm, 1);
    pthread_mutex_unlock(&comm->mu);
    if (!op) break;
    run_op(comm, op);
  }
  int kick = p2p_pending(comm) || conns_flushing(comm);
  pthread_mutex_unlock(&comm->run_mu);
  pthread_mutex_lock(&comm->mu);
  kick = kick || comm->p2p_incoming || atomic_load(&comm->failed) ||
         atomic_load(&comm->stop) || atomic_load(&comm->aborted) ||
         (comm->queue_head && !comm->napping);
  if (kick) kick_locked(comm);
  pthread_mutex_unlock(&comm->mu);
  if (kick) engine_wake(comm);
  inline_leave(comm);
}

/* ---------------------------------------------------------------- the thread */
static void *engine_main(void *arg) {
  struct chorus_comm *comm = arg;
  int idle = 0;
  for (;;) {
    /* read before the queue is looked at: a post the look misses changes it afterwards */
    uint64_t submits = atomic_load_explicit(&comm->submits, memory_order_acquire);
    pthread_mutex_lock(&comm->run_mu);
    p2p_take_incoming(comm);
    pthread_mutex_lock(&comm->mu);
    struct op *op = queue_take_locked(comm, 0);
    comm->kick = 0;
    int stopping = atomic_load(&comm->stop);
    pthread_mutex_unlock(&comm->mu);

    if (atomic_load(&comm->failed)) {
      socket_abort_conns(comm); /* peers waiting on other ranks learn it now */
      ib_abort_conns(comm);
      p2p_fail_all(comm, failed_result(comm));
    }
    if (op) {
      run_op(comm, op);
      pthread_mutex_unlock(&comm->run_mu);
      idle = 0;
      continue;
    }
    if ((p2p_pending(comm) || conns_flushing(comm)) && !atomic_load(&comm->failed)) {
      chorus_result_t res = engine_poll(comm, NULL, &idle);
      if (res != CHORUS_SUCCESS) {
        socket_stop_io(comm);
        p2p_fail_all(comm, res);
      }
      pthread_mutex_unlock(&comm->run_mu);
      continue;
    }
    if (stopping || atomic_load(&comm->aborted)) break; /* run_mu stays held */
    pthread_mutex_unlock(&comm->run_mu);
    if (engine_idle_spin(comm, submits)) continue;
    /* nothing to do: sleep until an op is submitted (with the flight recorder's idle watch,
     * waking every IDLE_WATCH_MS to see whether a peer failed meanwhile), or nap */
    int watch = trace_idle_watch(comm), woke = 0;
    pthread_mutex_lock(&comm->mu);
    while (!comm->queue_head && !comm->p2p_incoming && !comm->kick && !atomic_load(&comm->stop) &&
           !atomic_load(&comm->aborted) && !woke) {
      int nap = comm->spin == 0 &&
                now_ns() - atomic_load_explicit(&comm->last_run_ns, memory_order_relaxed) <
                    NAP_WINDOW_NS;
      comm->napping = nap;
      if (!watch && !nap) {
        pthread_cond_wait(&comm->idle_cv, &comm->mu);
        continue;
      }
      struct timespec until;
      clock_gettime(CLOCK_REALTIME, &until);
      until.tv_nsec += nap ? (long)NAP_NS : IDLE_WATCH_MS * 1000000L;
      if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += until.tv_nsec / 1000000000L;
        until.tv_nsec %= 1000000000L;
      }
      if (pthread_cond_timedwait(&comm->idle_cv, &comm->mu, &until) == ETIMEDOUT && !nap)
        woke = 1;
    }
    comm->napping = 0;
    pthread_mutex_unlock(&comm->mu);
    if (woke) trace_idle_check(comm);
    idle = 0;
  }
  /* fail whatever is left (abort path) */
  chorus_result_t res = failed_result(comm);
  socket_stop_io(comm);
  p2p_take_incoming(comm);
  p2p_fail_all(comm, res);
  pthread_mutex_lock(&comm->mu);
  struct op *op = comm->queue_head;
  comm->queue_head = comm->queue_tail = NULL;
  pthread_mutex_unlock(&comm->mu);
  while (op) {
    struct op *next = op->next;
    op_finish(comm, op, res);
    op = next;
  }
  pthread_mutex_unlock(&comm->run_mu);
  return NULL;
}

chorus_result_t engine_start(struct chorus_comm *comm) {
  int n = comm->nranks;
  comm->p2p_send = calloc((size_t)n, sizeof(struct op *));
  comm->p2p_recv = calloc((size_t)n, sizeof(struct op *));
  comm->p2p_send_seq = calloc((size_t)n, sizeof(uint64_t));
  comm->p2p_recv_seq = calloc((size_t)n, sizeof(uint64_t));
  comm->engine_priv = calloc((size_t)n, sizeof(struct p2p_peer));
  if (!comm->p2p_send || !comm->p2p_recv || !comm->p2p_send_seq || !comm->p2p_recv_seq ||
      !comm->engine_priv)
    return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory in engine start",
                          comm->rank);
  comm->spin = spin_count_for(param_int(PARAM_SPIN_COUNT), comm->nlocal, host_cores(comm));
  /* engine_block polls wake_fd only beside connections that have a pollfd (sockets, verbs
   * completion channels); without any, the write on every post would be a wasted call */
  for (int ch = 0; ch < CHAN_COUNT; ch++)
    for (int p = 0; p < n; p++)
      if (comm->conns[ch] && comm->conns[ch][p] && comm->conns[ch][p]->ops->pollfd)
        comm->wake_polled = 1;
  comm->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (comm->wake_fd < 0)
    return comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: eventfd failed: %s", comm->rank,
                          strerror(errno));
  if (pthread_create(&comm->thread, NULL, engine_main, comm) != 0)
    return comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: cannot start progress thread",
                          comm->rank);
  pthread_setname_np(comm->thread, "chorus-engine");
  comm->thread_started = 1;
  return CHORUS_SUCCESS;
}

/* A graceful stop lets queued and in-flight operations finish for this long, then aborts
 * them: destroying a communicator while a collective waits on a rank that will never call it
 * must not hang until the operation's timeout. */
#define DESTROY_GRACE_MS 3000

/* The error says why, then chorus_comm_abort (whose own text comes second) fails the rest. */
static void set_abort(struct chorus_comm *comm) {
  comm_set_error(comm, CHORUS_ERR_ABORTED,
                 "communicator destroyed on rank %d while operations were in flight (after "
                 "a %d ms grace)", comm->rank, DESTROY_GRACE_MS);
  chorus_comm_abort(comm);
}

void engine_stop(struct chorus_comm *comm, int abort_now) {
  if (comm->thread_started) {
    pthread_mutex_lock(&comm->mu);
    atomic_store(&comm->stop, 1);
    if (abort_now) atomic_store(&comm->aborted, 1);
    pthread_cond_broadcast(&comm->idle_cv);
    pthread_mutex_unlock(&comm->mu);
    engine_wake(comm);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += DESTROY_GRACE_MS / 1000;
    until.tv_nsec += (long)(DESTROY_GRACE_MS % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
      until.tv_sec++;
      until.tv_nsec -= 1000000000L;
    }
    if (abort_now || pthread_timedjoin_np(comm->thread, NULL, &until) != 0) {
      if (!abort_now)
        INFO(SUB_INIT, comm->rank, "rank %d: operations still in flight %d ms into destroy: "
             "aborting them", comm->rank, DESTROY_GRACE_MS);
      set_abort(comm);
      pthread_join(comm->thread, NULL);
    }
    comm->thread_started = 0;
  }
  /* every request is complete now; a waiter still inside run_inline or kick_deferred is
   * on its way out (an op it runs fails at once: the communicator stopped) */
  while (atomic_load(&comm->inline_users) > 0) {
    struct timespec ms = {0, 1000000L};
    nanosleep(&ms, NULL);
  }
  socket_stop_io(comm); /* its threads ring wake_fd */
  if (comm->wake_fd >= 0) close(comm->wake_fd);
  comm->wake_fd = -1;
  free(comm->p2p_send);
  free(comm->p2p_recv);
  free(comm->p2p_send_seq);
  free(comm->p2p_recv_seq);
  free(comm->engine_priv);
  comm->p2p_send = comm->p2p_recv = NULL;
  comm->p2p_send_seq = comm->p2p_recv_seq = NULL;
  comm->engine_priv = NULL;
}

chorus_result_t engine_submit(struct chorus_comm *comm, struct op *op, chorus_request_t **req) {
  int p2p = op->kind == OP_SEND || op->kind == OP_RECV;
  if (!p2p) op->seq = atomic_fetch_add(&comm->seq, 1);
  chorus_request_t *r = req_new(comm, p2p ? 0 : op->seq);
  if (!r) {
    op_free(op);
    return CHORUS_ERR_NOMEM;
  }
  op->req = r;
  op->next = NULL;
  r->runs_inline = !p2p && !op->on_device && comm->spin == 0;
  if (comm->trace) op->t_queued = now_ns();
  pthread_mutex_lock(&comm->mu);
  if (atomic_load(&comm->stop) || atomic_load(&comm->aborted)) {
    pthread_mutex_unlock(&comm->mu);
    atomic_store(&comm->failed, 1);
    op_finish(comm, op, CHORUS_ERR_ABORTED);
    *req = r;
    return CHORUS_SUCCESS;
  }
  if (p2p) {
    struct op **pp = &comm->p2p_incoming; /* FIFO: posting order is matching order */
    while (*pp) pp = &(*pp)->next;
    *pp = op;
  } else {
    if (comm->queue_tail) comm->queue_tail->next = op;
    else comm->queue_head = op;
    comm->queue_tail = op;
  }
  atomic_fetch_add_explicit(&comm->submits, 1, memory_order_release);
  /* a napping engine is left alone: the caller is expected to wait (see "Waiters") */
  int defer = r->runs_inline && comm->napping;
  if (!defer) pthread_cond_signal(&comm->idle_cv);
  pthread_mutex_unlock(&comm->mu);
  if (!defer) engine_wake(comm);
  *req = r;
  return CHORUS_SUCCESS;
}
