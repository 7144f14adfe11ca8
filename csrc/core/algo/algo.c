/* algo.c - algorithm dispatch and the pieces every schedule uses: the step runner and
 * the ordered reduction that reads peers' contributions straight from transport rings. */
#include <stdlib.h>
#include <string.h>

#include "algo.h"

chorus_op_kind_t base_op(chorus_op_kind_t k) {
  return (k == CHORUS_AVG || k == CHORUS_PREMUL_SUM) ? CHORUS_SUM : k;
}

chorus_result_t prescale_input(struct chorus_comm *comm, struct op *op, const void *in,
                               size_t count, void **scaled) {
  *scaled = NULL;
  if (op->op.kind != CHORUS_PREMUL_SUM) return CHORUS_SUCCESS;
  size_t bytes = count * dtype_size(op->dtype);
  void *buf = malloc(bytes ? bytes : 1);
  if (!buf)
    return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: cannot allocate %zu bytes",
                          comm->rank, bytes);
  reduce_premul(buf, in, count, op->dtype, op->op.factor);
  *scaled = buf;
  return CHORUS_SUCCESS;
}

chorus_result_t step_run(struct chorus_comm *comm, struct op *op, struct step *s) {
  int idle = 0;
  for (;;) {
    int progressed = 0, pending = 0;
    for (int i = 0; i < s->ntx; i++) {
      if (s->tx[i].done) continue;
      CHECK(msg_tx_progress(&s->tx[i], &progressed));
      pending |= !s->tx[i].done;
    }
    for (int i = 0; i < s->nrx; i++) {
      if (s->rx[i].done || !s->rx[i].c) continue;
      CHECK(msg_rx_copy(&s->rx[i], s->rx_dst[i], &progressed));
      pending |= !s->rx[i].done;
    }
    if (!pending) return CHORUS_SUCCESS;
    if (progressed) idle = 0;
    CHECK(engine_poll(comm, op, &idle));
  }
}

chorus_result_t reduce_from_peers(struct chorus_comm *comm, struct op *op, struct msg_rx *rx,
                                  int nin, int self_pos, const void *own, void *out,
                                  size_t count, struct msg_tx *tx, int ntx) {
  const size_t es = dtype_size(op->dtype);
  const size_t total = count * es;
  const void **in = calloc((size_t)nin, sizeof(void *));
  if (!in) return CHORUS_ERR_NOMEM;
  chorus_op_kind_t kind = base_op(op->op.kind);
  size_t pos = 0;
  int idle = 0;
  chorus_result_t res = CHORUS_SUCCESS;
  for (int k = 0; k < nin; k++) rx[k].stage = k != self_pos; /* read through peek */
  for (;;) {
    int progressed = 0, pending = 0;
    for (int i = 0; i < ntx; i++) {
      if (tx[i].done) continue;
      CHECK_GOTO(msg_tx_progress(&tx[i], &progressed), res, out);
      pending |= !tx[i].done;
    }
    if (pos < total || total == 0) {
      /* bytes every contributor has ready, whole elements only */
      size_t avail = total - pos;
      int all_done = 1;
      for (int k = 0; k < nin; k++) {
        if (k == self_pos) continue;
        size_t n;
        CHECK_GOTO(msg_rx_peek(&rx[k], &in[k], &n), res, out);
        if (!rx[k].done) all_done = 0;
        if (n < avail) avail = n;
      }
      if (total == 0) {
        if (!all_done) pending = 1;
      } else {
        avail -= avail % es;
        if (avail > 0) {
          in[self_pos] = (const uint8_t *)own + pos;
          reduce_n((uint8_t *)out + pos, in, nin, avail / es, op->dtype, kind);
          for (int k = 0; k < nin; k++)
            if (k != self_pos) CHECK_GOTO(msg_rx_consume(&rx[k], avail), res, out);
          pos += avail;
          progressed = 1;
        }
        if (pos < total) pending = 1;
      }
    }
    if (pos == total && total > 0) {
      /* drain padding so the next message starts clean */
      for (int k = 0; k < nin; k++) {
        if (k == self_pos || rx[k].done) continue;
        const void *p;
        size_t n;
        CHECK_GOTO(msg_rx_peek(&rx[k], &p, &n), res, out);
        if (!rx[k].done) pending = 1;
      }
    }
    if (!pending) break;
    if (progressed) idle = 0;
    CHECK_GOTO(engine_poll(comm, op, &idle), res, out);
  }
out:
  free(in);
  return res;
}

/* ------------------------------------------------------------------ steps over a group */
void sched_begin(struct sched_step *s, struct chorus_comm *comm, struct op *op,
                 const struct group *g) {
  s->comm = comm;
  s->op = op;
  s->g = g;
  s->ntx = s->nrx = s->nred = s->nrxq = s->overflow = 0;
}

static conn_t *member_conn(const struct sched_step *s, int peer) {
  return s->comm->conns[CHAN_COLL][group_rank(s->g, peer)];
}

void sched_send(struct sched_step *s, int peer, const void *buf, size_t bytes) {
  if (s->ntx == STEP_MAX_XFER) {
    s->overflow = 1;
    return;
  }
  msg_tx_init(&s->tx[s->ntx++], member_conn(s, peer), s->op, buf, bytes);
}

void sched_recv(struct sched_step *s, int peer, void *dst, size_t bytes) {
  if (s->nrx == STEP_MAX_XFER) {
    s->overflow = 1;
    return;
  }
  msg_rx_init(&s->rx[s->nrx], member_conn(s, peer), s->op, bytes);
  s->rxq[s->nrxq++] = &s->rx[s->nrx];
  s->rx_dst[s->nrx++] = dst;
}

int sched_reduce(struct sched_step *s, const void *own, void *out, size_t count, int own_pos) {
  if (s->nred == STEP_MAX_RED) {
    s->overflow = 1;
    return 0;
  }
  struct red_recv *r = &s->red[s->nred];
  r->nrx = 0;
  r->own = own;
  r->own_pos = own_pos;
  r->out = out;
  r->count = count;
  r->pos = 0;
  return s->nred++;
}

void sched_reduce_add(struct sched_step *s, int red, int peer) {
  struct red_recv *r = &s->red[red];
  if (r->nrx == STEP_MAX_IN - 1) {
    s->overflow = 1;
    return;
  }
  msg_rx_init(&r->rx[r->nrx], member_conn(s, peer), s->op, r->count * dtype_size(s->op->dtype));
  r->rx[r->nrx].stage = 1;
  s->rxq[s->nrxq++] = &r->rx[r->nrx++];
}

/* May this receive read its connection, i.e. is no earlier receive of the step on it? */
static int rx_turn(const struct sched_step *s, const struct msg_rx *rx) {
  for (int k = 0; k < s->nrxq && s->rxq[k] != rx; k++)
    if (s->rxq[k]->c == rx->c && !s->rxq[k]->done) return 0;
  return 1;
}

static int tx_turn(const struct sched_step *s, int i) {
  for (int k = 0; k < i; k++)
    if (s->tx[k].c == s->tx[i].c && !s->tx[k].done) return 0;
  return 1;
}

/* One pass over a reducing receive: reduce what every contributor has ready. */
static chorus_result_t red_progress(struct sched_step *s, struct red_recv *r, int *progressed,
                                    int *pending) {
  const size_t es = dtype_size(s->op->dtype), total = r->count * es;
  const void *in[STEP_MAX_IN];
  int nin = r->nrx + 1;
  if (r->pos < total) {
    size_t avail = total - r->pos;
    for (int k = 0; k < r->nrx; k++) {
      const void *p = NULL;
      size_t n = 0;
      if (rx_turn(s, &r->rx[k])) CHECK(msg_rx_peek(&r->rx[k], &p, &n));
      in[k < r->own_pos ? k : k + 1] = p;
      if (n < avail) avail = n;
    }
    avail -= avail % es;
    if (avail > 0) {
      in[r->own_pos] = (const uint8_t *)r->own + r->pos;
      reduce_n((uint8_t *)r->out + r->pos, in, nin, avail / es, s->op->dtype,
               base_op(s->op->op.kind));
      for (int k = 0; k < r->nrx; k++) CHECK(msg_rx_consume(&r->rx[k], avail));
      r->pos += avail;
      *progressed = 1;
    }
  }
  if (r->pos < total) {
    *pending = 1;
    return CHORUS_SUCCESS;
  }
  /* all reduced: read the headers of empty messages and skip padding */
  for (int k = 0; k < r->nrx; k++) {
    if (r->rx[k].done) continue;
    if (!rx_turn(s, &r->rx[k])) {
      *pending = 1;
      continue;
    }
    const void *p;
    size_t n;
    CHECK(msg_rx_peek(&r->rx[k], &p, &n));
    if (!r->rx[k].done) *pending = 1;
    else *progressed = 1;
  }
  return CHORUS_SUCCESS;
}

chorus_result_t sched_run(struct sched_step *s) {
  struct chorus_comm *comm = s->comm;
  if (s->overflow)
    return comm_set_error(comm, CHORUS_ERR_INTERNAL, "rank %d: schedule step too large",
                          comm->rank);
  int idle = 0;
  for (;;) {
    int progressed = 0, pending = 0;
    for (int i = 0; i < s->ntx; i++) {
      if (s->tx[i].done) continue;
      if (tx_turn(s, i)) CHECK(msg_tx_progress(&s->tx[i], &progressed));
      pending |= !s->tx[i].done;
    }
    for (int i = 0; i < s->nrx; i++) {
      if (s->rx[i].done) continue;
      if (rx_turn(s, &s->rx[i])) CHECK(msg_rx_copy(&s->rx[i], s->rx_dst[i], &progressed));
      pending |= !s->rx[i].done;
    }
    for (int i = 0; i < s->nred; i++) CHECK(red_progress(s, &s->red[i], &progressed, &pending));
    if (!pending) return CHORUS_SUCCESS;
    if (progressed) idle = 0;
    CHECK(engine_poll(comm, s->op, &idle));
  }
}

chorus_result_t sched_sendrecv(struct chorus_comm *comm, struct op *op, const struct group *g,
                               int to, const void *sbuf, size_t sbytes, int from, void *rbuf,
                               size_t rbytes) {
  struct sched_step s;
  sched_begin(&s, comm, op, g);
  if (to >= 0) sched_send(&s, to, sbuf, sbytes);
  if (from >= 0) sched_recv(&s, from, rbuf, rbytes);
  return sched_run(&s);
}

chorus_result_t sched_sendrecv_reduce(struct chorus_comm *comm, struct op *op,
                                      const struct group *g, int to, const void *sbuf,
                                      size_t sbytes, int from, const void *own, void *out,
                                      size_t count, int own_first) {
  struct sched_step s;
  sched_begin(&s, comm, op, g);
  if (to >= 0) sched_send(&s, to, sbuf, sbytes);
  int r = sched_reduce(&s, own, out, count, own_first ? 0 : 1);
  sched_reduce_add(&s, r, from);
  return sched_run(&s);
}

size_t algo_chunk_elems(chorus_dtype_t dtype) {
  int64_t ring = param_int(PARAM_BUFFSIZE);
  if (ring < 4096) ring = 4096; /* the transports' minimum */
  size_t bytes = ((size_t)ring / 4) & ~(size_t)63;
  size_t es = dtype_size(dtype);
  size_t n = es ? bytes / es : 1;
  return n ? n : 1;
}

void even_slice(size_t count, int n, int p, size_t *cnt, size_t *off) {
  size_t base = count / (size_t)n, extra = count % (size_t)n;
  *cnt = base + ((size_t)p < extra ? 1 : 0);
  *off = base * (size_t)p + ((size_t)p < extra ? (size_t)p : extra);
}

chorus_result_t algo_alloc(struct chorus_comm *comm, size_t bytes, void **out) {
  *out = malloc(bytes ? bytes : 1);
  if (!*out)
    return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: cannot allocate %zu bytes",
                          comm->rank, bytes);
  return CHORUS_SUCCESS;
}

int counts_uniform(const size_t *counts, int n) {
  for (int i = 1; i < n; i++)
    if (counts[i] != counts[0]) return 0;
  return 1;
}

int displs_packed(const size_t *counts, const size_t *displs, int n) {
  size_t off = 0;
  for (int i = 0; i < n; i++) {
    if (displs[i] != off) return 0;
    off += counts[i];
  }
  return 1;
}

int alltoall_blocks(const struct op *op, int n) {
  for (int p = 0; p < n; p++)
    if (op->counts[p] != op->counts[0] || op->counts2[p] != op->counts[0] ||
        op->displs[p] != (size_t)p * op->counts[0] ||
        op->displs2[p] != (size_t)p * op->counts[0])
      return 0;
  return 1;
}

const struct algo_desc algo_table[ALGO_COUNT] = {
    [ALGO_DIRECT] = {"direct",
                     {[OP_ALLREDUCE] = direct_allreduce,
                      [OP_BROADCAST] = direct_broadcast,
                      [OP_REDUCE] = direct_reduce,
                      [OP_ALLGATHER] = direct_allgatherv,
                      [OP_REDUCE_SCATTER] = direct_reduce_scatterv,
                      [OP_GATHER] = direct_gather,
                      [OP_SCATTER] = direct_scatter,
                      [OP_ALLTOALL] = direct_alltoallv,
                      [OP_BARRIER] = direct_barrier}},
    [ALGO_RING] = {"ring",
                   {[OP_ALLREDUCE] = ring_allreduce,
                    [OP_BROADCAST] = ring_broadcast,
                    [OP_REDUCE] = ring_reduce,
                    [OP_ALLGATHER] = ring_allgather,
                    [OP_REDUCE_SCATTER] = ring_reduce_scatter}},
    [ALGO_TREE] = {"tree",
                   {[OP_ALLREDUCE] = tree_allreduce,
                    [OP_BROADCAST] = tree_broadcast,
                    [OP_REDUCE] = tree_reduce}},
    [ALGO_RHD] = {"rhd",
                  {[OP_ALLREDUCE] = rhd_allreduce,
                   [OP_ALLGATHER] = rhd_allgather,
                   [OP_REDUCE_SCATTER] = rhd_reduce_scatter}},
    [ALGO_RD] = {"rd",
                 {[OP_ALLREDUCE] = rd_allreduce,
                  [OP_ALLGATHER] = rd_allgather,
                  [OP_BARRIER] = rd_barrier}},
    [ALGO_BRUCK] = {"bruck",
                    {[OP_ALLGATHER] = bruck_allgather,
                     [OP_ALLTOALL] = bruck_alltoall,
                     [OP_BARRIER] = bruck_barrier}},
    [ALGO_PAIRWISE] = {"pairwise", {[OP_ALLTOALL] = pairwise_alltoall}},
    [ALGO_ONESHOT] = {"oneshot",
                      {[OP_ALLREDUCE] = oneshot_allreduce,
                       [OP_BROADCAST] = oneshot_broadcast,
                       [OP_REDUCE] = oneshot_reduce,
                       [OP_ALLGATHER] = oneshot_allgatherv,
                       [OP_REDUCE_SCATTER] = oneshot_reduce_scatterv,
                       [OP_ALLTOALL] = oneshot_alltoall,
                       [OP_BARRIER] = oneshot_barrier}},
    [ALGO_TWOSHOT] = {"twoshot", {[OP_ALLREDUCE] = twoshot_allreduce}},
    [ALGO_HIER] = {"hier",
                   {[OP_ALLREDUCE] = hier_allreduce,
                    [OP_BROADCAST] = hier_broadcast,
                    [OP_REDUCE] = hier_reduce}},
};

const char *algo_name(int id) {
  return id >= 0 && id < ALGO_COUNT ? algo_table[id].name : "unknown";
}

int algo_from_name(const char *name) {
  for (int i = 0; i < ALGO_COUNT; i++)
    if (strcmp(algo_table[i].name, name) == 0) return i;
  return -1;
}

/* ------------------------------------------------------------------ shape constraints
 * What each algorithm needs of the op's shape beyond having an entry for the collective and
 * passing the topology checks (tune.c: algo_usable calls this). Every input must be equal on
 * every rank of a correct program, or ranks would choose differently. */
int algo_shape_ok(const struct chorus_comm *comm, const struct op *op, int id) {
  const int n = comm->nranks;
  switch (id) {
    case ALGO_RHD:
    case ALGO_RD:
      /* recursive doubling moves ranges of blocks: all-gather blocks must be packed */
      if (op->kind == OP_ALLGATHER) return displs_packed(op->counts, op->displs, n);
      return 1;
    case ALGO_BRUCK:
      /* the Bruck all-to-all packs equal blocks; all-to-all-v goes elsewhere */
      if (op->kind == OP_ALLTOALL)
        return op->uniform && counts_uniform(op->counts, n) && counts_uniform(op->counts2, n) &&
               op->counts[0] == op->counts2[0];
      return 1;
    case ALGO_ONESHOT:
    case ALGO_TWOSHOT:
      /* every rank on this host with shared memory; all-to-all with equal blocks only */
      if (op->kind == OP_ALLTOALL && !op->uniform) return 0;
      return shm_direct_ok(comm, op, id);
    case ALGO_HIER:
      /* several hosts, and some host with more than one rank */
      return comm->nhosts > 1 && comm->max_per_host > 1 && comm->host_of != NULL;
    default:
      return 1;
  }
}

chorus_result_t algo_run(struct chorus_comm *comm, struct op *op) {
  if ((unsigned)op->kind >= OP_BARRIER + 1)
    return comm_set_error(comm, CHORUS_ERR_INTERNAL, "rank %d: %s is not a collective",
                          comm->rank, op_kind_name(op->kind));
  int id = algo_select(comm, op); /* CHORUS_ALGO's choice where it can run, else the tuner */
  /* comm->algo_force holds CHORUS_ALGO's single choices, and tests set it directly */
  int f = comm->algo_force[op->kind];
  if (f >= 0 && f != id && algo_usable(comm, op, f)) id = f;
  if (!algo_usable(comm, op, id)) id = ALGO_DIRECT;
  op->algo = id;
  comm->last_algo = id;
  trace_op_algo(comm, op);
  return algo_table[id].run[op->kind](comm, op);
}
