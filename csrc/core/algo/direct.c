/* direct.c - direct (all-pairs) schedules: every rank exchanges its share with every other
 * rank in one step. Reductions are done by the owner of each slice, combining the inputs
 * in rank order from the peers' rings with one rounding, so every rank ends with
 * bit-identical results. Correct for any rank count; the baseline other algorithms
 * are checked against. */
#include <stdlib.h>
#include <string.h>

#include "algo.h"

#define CONN(comm, p) ((comm)->conns[CHAN_COLL][(p)])

struct direct_bufs {
  struct msg_tx *tx;
  struct msg_rx *rx;
  void **dst;
};

static chorus_result_t bufs_alloc(struct chorus_comm *comm, struct direct_bufs *b) {
  int n = comm->nranks;
  b->tx = calloc((size_t)n, sizeof(struct msg_tx));
  b->rx = calloc((size_t)n, sizeof(struct msg_rx));
  b->dst = calloc((size_t)n, sizeof(void *));
  if (!b->tx || !b->rx || !b->dst) {
    free(b->tx);
    free(b->rx);
    free(b->dst);
    return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", comm->rank);
  }
  return CHORUS_SUCCESS;
}

static void bufs_free(struct direct_bufs *b) {
  free(b->tx);
  free(b->rx);
  free(b->dst);
}

/* Element count and offset of slice p when count elements are split over n ranks. */
static void slice(size_t count, int n, int p, size_t *cnt, size_t *off) {
  size_t base = count / (size_t)n, extra = count % (size_t)n;
  *cnt = base + ((size_t)p < extra ? 1 : 0);
  *off = base * (size_t)p + ((size_t)p < extra ? (size_t)p : extra);
}

/* Reduce-scatter of slices given by cnt/off: this rank ends with the reduction of its
 * slice at out. Sends every other slice of in to its owner. */
static chorus_result_t reduce_scatter_slices(struct chorus_comm *comm, struct op *op,
                                             const void *in, void *out, const size_t *cnt,
                                             const size_t *off) {
  int n = comm->nranks, me = comm->rank;
  size_t es = dtype_size(op->dtype);
  struct direct_bufs b;
  CHECK(bufs_alloc(comm, &b));
  int ntx = 0;
  for (int p = 0; p < n; p++) {
    if (p == me) continue;
    msg_tx_init(&b.tx[ntx++], CONN(comm, p), op, (const uint8_t *)in + off[p] * es, cnt[p] * es);
    msg_rx_init(&b.rx[p], CONN(comm, p), op, cnt[me] * es);
  }
  chorus_result_t res = reduce_from_peers(comm, op, b.rx, n, me,
                                          (const uint8_t *)in + off[me] * es, out, cnt[me],
                                          b.tx, ntx);
  bufs_free(&b);
  return res;
}

/* All-gather of slices: this rank's slice (already at buf + off[me]) goes to everyone. */
static chorus_result_t allgather_slices(struct chorus_comm *comm, struct op *op,
                                        const void *mine, void *buf, const size_t *cnt,
                                        const size_t *off) {
  int n = comm->nranks, me = comm->rank;
  size_t es = dtype_size(op->dtype);
  struct direct_bufs b;
  CHECK(bufs_alloc(comm, &b));
  int k = 0;
  for (int p = 0; p < n; p++) {
    if (p == me) continue;
    msg_tx_init(&b.tx[k], CONN(comm, p), op, mine, cnt[me] * es);
    msg_rx_init(&b.rx[k], CONN(comm, p), op, cnt[p] * es);
    b.dst[k] = (uint8_t *)buf + off[p] * es;
    k++;
  }
  struct step s = {b.tx, k, b.rx, b.dst, k};
  chorus_result_t res = step_run(comm, op, &s);
  bufs_free(&b);
  return res;
}

static chorus_result_t slices_of(struct chorus_comm *comm, size_t count, size_t **cnt,
                                 size_t **off) {
  int n = comm->nranks;
  *cnt = malloc((size_t)n * sizeof(size_t));
  *off = malloc((size_t)n * sizeof(size_t));
  if (!*cnt || !*off) {
    free(*cnt);
    free(*off);
    return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", comm->rank);
  }
  for (int p = 0; p < n; p++) slice(count, n, p, &(*cnt)[p], &(*off)[p]);
  return CHORUS_SUCCESS;
}

chorus_result_t direct_allreduce(struct chorus_comm *comm, struct op *op) {
  size_t es = dtype_size(op->dtype);
  int me = comm->rank;
  size_t *cnt, *off;
  CHECK(slices_of(comm, op->count, &cnt, &off));
  void *scaled = NULL;
  chorus_result_t res;
  CHECK_GOTO(prescale_input(comm, op, op->sendbuf, op->count, &scaled), res, done);
  const void *in = scaled ? scaled : op->sendbuf;
  uint8_t *mine = (uint8_t *)op->recvbuf + off[me] * es;
  CHECK_GOTO(reduce_scatter_slices(comm, op, in, mine, cnt, off), res, done);
  if (op->op.kind == CHORUS_AVG) reduce_divide(mine, cnt[me], op->dtype, comm->nranks);
  CHECK_GOTO(allgather_slices(comm, op, mine, op->recvbuf, cnt, off), res, done);
done:
  free(scaled);
  free(cnt);
  free(off);
  return res;
}

chorus_result_t direct_reduce_scatterv(struct chorus_comm *comm, struct op *op) {
  int n = comm->nranks;
  size_t total = 0;
  size_t *off = malloc((size_t)n * sizeof(size_t));
  if (!off) return CHORUS_ERR_NOMEM;
  for (int p = 0; p < n; p++) {
    off[p] = total;
    total += op->counts[p];
  }
  void *scaled = NULL;
  chorus_result_t res;
  CHECK_GOTO(prescale_input(comm, op, op->sendbuf, total, &scaled), res, done);
  CHECK_GOTO(reduce_scatter_slices(comm, op, scaled ? scaled : op->sendbuf, op->recvbuf,
                                   op->counts, off),
             res, done);
  if (op->op.kind == CHORUS_AVG)
    reduce_divide(op->recvbuf, op->counts[comm->rank], op->dtype, comm->nranks);
done:
  free(scaled);
  free(off);
  return res;
}

chorus_result_t direct_allgatherv(struct chorus_comm *comm, struct op *op) {
  size_t es = dtype_size(op->dtype);
  int me = comm->rank;
  uint8_t *dst = (uint8_t *)op->recvbuf + op->displs[me] * es;
  if (dst != op->sendbuf && op->counts[me] > 0) memmove(dst, op->sendbuf, op->counts[me] * es);
  return allgather_slices(comm, op, dst, op->recvbuf, op->counts, op->displs);
}

chorus_result_t direct_reduce(struct chorus_comm *comm, struct op *op) {
  int n = comm->nranks, me = comm->rank, root = op->root;
  size_t es = dtype_size(op->dtype), bytes = op->count * es;
  void *scaled = NULL;
  chorus_result_t res;
  CHECK(prescale_input(comm, op, op->sendbuf, op->count, &scaled));
  const void *in = scaled ? scaled : op->sendbuf;
  struct direct_bufs b;
  CHECK_GOTO(bufs_alloc(comm, &b), res, done);
  if (me == root) {
    for (int p = 0; p < n; p++)
      if (p != me) msg_rx_init(&b.rx[p], CONN(comm, p), op, bytes);
    res = reduce_from_peers(comm, op, b.rx, n, me, in, op->recvbuf, op->count, NULL, 0);
    if (res == CHORUS_SUCCESS && op->op.kind == CHORUS_AVG)
      reduce_divide(op->recvbuf, op->count, op->dtype, n);
  } else {
    msg_tx_init(&b.tx[0], CONN(comm, root), op, in, bytes);
    struct step s = {b.tx, 1, NULL, NULL, 0};
    res = step_run(comm, op, &s);
  }
  bufs_free(&b);
done:
  free(scaled);
  return res;
}

chorus_result_t direct_broadcast(struct chorus_comm *comm, struct op *op) {
  int n = comm->nranks, me = comm->rank, root = op->root;
  size_t bytes = op->count * dtype_size(op->dtype);
  struct direct_bufs b;
  CHECK(bufs_alloc(comm, &b));
  struct step s = {b.tx, 0, b.rx, b.dst, 0};
  if (me == root) {
    for (int p = 0; p < n; p++)
      if (p != me) msg_tx_init(&b.tx[s.ntx++], CONN(comm, p), op, op->recvbuf, bytes);
  } else {
    msg_rx_init(&b.rx[0], CONN(comm, root), op, bytes);
    b.dst[0] = op->recvbuf;
    s.nrx = 1;
  }
  chorus_result_t res = step_run(comm, op, &s);
  bufs_free(&b);
  return res;
}

chorus_result_t direct_gather(struct chorus_comm *comm, struct op *op) {
  int n = comm->nranks, me = comm->rank, root = op->root;
  size_t bytes = op->count * dtype_size(op->dtype);
  struct direct_bufs b;
  CHECK(bufs_alloc(comm, &b));
  struct step s = {b.tx, 0, b.rx, b.dst, 0};
  if (me == root) {
    uint8_t *own = (uint8_t *)op->recvbuf + (size_t)me * bytes;
    if (own != op->sendbuf && bytes) memmove(own, op->sendbuf, bytes);
    for (int p = 0; p < n; p++) {
      if (p == me) continue;
      msg_rx_init(&b.rx[s.nrx], CONN(comm, p), op, bytes);
      b.dst[s.nrx++] = (uint8_t *)op->recvbuf + (size_t)p * bytes;
    }
  } else {
    msg_tx_init(&b.tx[s.ntx++], CONN(comm, root), op, op->sendbuf, bytes);
  }
  chorus_result_t res = step_run(comm, op, &s);
  bufs_free(&b);
  return res;
}

chorus_result_t direct_scatter(struct chorus_comm *comm, struct op *op) {
  int n = comm->nranks, me = comm->rank, root = op->root;
  size_t bytes = op->count * dtype_size(op->dtype);
  struct direct_bufs b;
  CHECK(bufs_alloc(comm, &b));
  struct step s = {b.tx, 0, b.rx, b.dst, 0};
  if (me == root) {
    const uint8_t *own = (const uint8_t *)op->sendbuf + (size_t)me * bytes;
    if (own != op->recvbuf && bytes) memmove(op->recvbuf, own, bytes);
    for (int p = 0; p < n; p++)
      if (p != me)
        msg_tx_init(&b.tx[s.ntx++], CONN(comm, p), op,
                    (const uint8_t *)op->sendbuf + (size_t)p * bytes, bytes);
  } else {
    msg_rx_init(&b.rx[0], CONN(comm, root), op, bytes);
    b.dst[0] = op->recvbuf;
    s.nrx = 1;
  }
  chorus_result_t res = step_run(comm, op, &s);
  bufs_free(&b);
  return res;
}

chorus_result_t direct_alltoallv(struct chorus_comm *comm, struct op *op) {
  int n = comm->nranks, me = comm->rank;
  size_t es = dtype_size(op->dtype);
  const uint8_t *src = op->sendbuf;
  uint8_t *copy = NULL;
  /* in-place (or overlapping) use: send from a private copy */
  size_t sbytes = 0, rbytes = 0;
  for (int p = 0; p < n; p++) {
    size_t se = (op->displs[p] + op->counts[p]) * es, re = (op->displs2[p] + op->counts2[p]) * es;
    if (se > sbytes) sbytes = se;
    if (re > rbytes) rbytes = re;
  }
  const uint8_t *rb = op->recvbuf;
  if (sbytes && rbytes && src < rb + rbytes && rb < src + sbytes) {
    copy = malloc(sbytes);
    if (!copy) return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", me);
    memcpy(copy, src, sbytes);
    src = copy;
  }
  if (op->counts[me] != op->counts2[me]) {
    free(copy);
    return comm_set_error(comm, CHORUS_ERR_INVALID,
                          "all_to_all seq %llu rank %d: sends %zu elements to itself but expects "
                          "%zu",
                          (unsigned long long)op->seq, me, op->counts[me], op->counts2[me]);
  }
  if (op->counts[me])
    memmove((uint8_t *)op->recvbuf + op->displs2[me] * es, src + op->displs[me] * es,
            op->counts[me] * es);
  struct direct_bufs b;
  chorus_result_t res;
  CHECK_GOTO(bufs_alloc(comm, &b), res, done);
  int k = 0;
  for (int p = 0; p < n; p++) {
    if (p == me) continue;
    msg_tx_init(&b.tx[k], CONN(comm, p), op, src + op->displs[p] * es, op->counts[p] * es);
    msg_rx_init(&b.rx[k], CONN(comm, p), op, op->counts2[p] * es);
    b.dst[k] = (uint8_t *)op->recvbuf + op->displs2[p] * es;
    k++;
  }
  struct step s = {b.tx, k, b.rx, b.dst, k};
  res = step_run(comm, op, &s);
  bufs_free(&b);
done:
  free(copy);
  return res;
}

chorus_result_t direct_barrier(struct chorus_comm *comm, struct op *op) {
  int n = comm->nranks, me = comm->rank;
  struct direct_bufs b;
  CHECK(bufs_alloc(comm, &b));
  int k = 0;
  for (int p = 0; p < n; p++) {
    if (p == me) continue;
    msg_tx_init(&b.tx[k], CONN(comm, p), op, NULL, 0);
    msg_rx_init(&b.rx[k], CONN(comm, p), op, 0);
    b.dst[k] = NULL;
    k++;
  }
  struct step s = {b.tx, k, b.rx, b.dst, k};
  chorus_result_t res = step_run(comm, op, &s);
  bufs_free(&b);
  return res;
}
