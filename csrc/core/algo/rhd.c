/* rhd.c - recursive halving-doubling (Rabenseifner): reduce-scatter by recursive halving,
 * all-gather by recursive doubling, for all-reduce, reduce-scatter(v) and all-gather(v with
 * packed displacements). Member counts that are not a power of two fold first: with
 * p = 2^floor(log2 n) and rem = n - p, members 2i and 2i+1 (i < rem) merge into virtual
 * member i (held by 2i+1), and the pair is unfolded at the end. */
#include <stdlib.h>
#include <string.h>

#include "algo.h"

/* Fold layout: virtual member v is held by real member vreal(v); its block spans the real
 * slices vfirst(v) .. vreal(v). */
static int vreal(int v, int rem) { return v < rem ? 2 * v + 1 : v + rem; }
static int vfirst(int v, int rem) { return v < rem ? 2 * v : v + rem; }
/* Virtual index of real member i, -1 for the even member of a folded pair. */
static int virt_of(int i, int rem) {
  if (i < 2 * rem) return (i & 1) ? i / 2 : -1;
  return i - rem;
}
static int pow2_floor(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

/* boff[v] for v = 0..p: element offset of virtual block v (blocks packed in order). */
static chorus_result_t virtual_offsets(struct chorus_comm *comm, int n, const size_t *cnt,
                                       size_t **boff_out) {
  int p = pow2_floor(n), rem = n - p;
  size_t *boff;
  CHECK(algo_alloc(comm, (size_t)(p + 1) * sizeof(size_t), (void **)&boff));
  size_t off = 0;
  for (int v = 0; v < p; v++) {
    boff[v] = off;
    for (int i = vfirst(v, rem); i <= vreal(v, rem); i++) off += cnt[i];
  }
  boff[p] = off;
  *boff_out = boff;
  return CHORUS_SUCCESS;
}

/* Fold + recursive halving. On return, a virtual member v holds the reduction of virtual
 * block v in work[boff[v], boff[v+1]); the even member of a folded pair did nothing more
 * than send its input. in may equal work. */
static chorus_result_t halving(struct chorus_comm *comm, struct op *op, const struct group *g,
                               const void *in, void *work, const size_t *boff) {
  const int n = g->n, me = g->me, p = pow2_floor(n), rem = n - p;
  const size_t es = dtype_size(op->dtype), total = boff[p];
  const uint8_t *cur = in;
  uint8_t *w = work;
  if (me < 2 * rem) {
    if ((me & 1) == 0) return sched_sendrecv(comm, op, g, me + 1, in, total * es, -1, NULL, 0);
    CHECK(sched_sendrecv_reduce(comm, op, g, -1, NULL, 0, me - 1, in, w, total, 0));
    cur = w;
  }
  const int v = virt_of(me, rem);
  int lo = 0, hi = p;
  for (int d = p / 2; d >= 1; d /= 2) {
    int pv = v ^ d, mid = lo + d;
    int klo = (v & d) ? mid : lo, khi = (v & d) ? hi : mid;
    int slo = (v & d) ? lo : mid, shi = (v & d) ? mid : hi;
    CHECK(sched_sendrecv_reduce(comm, op, g, vreal(pv, rem), cur + boff[slo] * es,
                                (boff[shi] - boff[slo]) * es, vreal(pv, rem), cur + boff[klo] * es,
                                w + boff[klo] * es, boff[khi] - boff[klo], v < pv));
    cur = w;
    lo = klo;
    hi = khi;
  }
  if (cur != w && boff[v + 1] > boff[v]) /* p == 1: nothing moved */
    memmove(w + boff[v] * es, cur + boff[v] * es, (boff[v + 1] - boff[v]) * es);
  return CHORUS_SUCCESS;
}

/* Recursive doubling over virtual blocks: v's block is in buf; afterwards every virtual
 * member has all p blocks. */
static chorus_result_t doubling(struct chorus_comm *comm, struct op *op, const struct group *g,
                                void *buf, const size_t *boff) {
  const int n = g->n, me = g->me, p = pow2_floor(n), rem = n - p;
  const int v = virt_of(me, rem);
  const size_t es = dtype_size(op->dtype);
  uint8_t *b = buf;
  for (int d = 1; d < p; d *= 2) {
    int pv = v ^ d, mlo = v & ~(d - 1), plo = pv & ~(d - 1);
    CHECK(sched_sendrecv(comm, op, g, vreal(pv, rem), b + boff[mlo] * es,
                         (boff[mlo + d] - boff[mlo]) * es, vreal(pv, rem), b + boff[plo] * es,
                         (boff[plo + d] - boff[plo]) * es));
  }
  return CHORUS_SUCCESS;
}

chorus_result_t rhd_allreduce_group(struct chorus_comm *comm, struct op *op,
                                    const struct group *g, const void *in, void *out,
                                    size_t count, int divisor) {
  const int n = g->n, me = g->me, p = pow2_floor(n), rem = n - p;
  const size_t es = dtype_size(op->dtype);
  size_t *cnt, *boff = NULL;
  CHECK(algo_alloc(comm, (size_t)n * sizeof(size_t), (void **)&cnt));
  for (int i = 0; i < n; i++) {
    size_t o;
    even_slice(count, n, i, &cnt[i], &o);
  }
  chorus_result_t res;
  CHECK_GOTO(virtual_offsets(comm, n, cnt, &boff), res, done);
  CHECK_GOTO(halving(comm, op, g, in, out, boff), res, done);
  int v = virt_of(me, rem);
  if (v >= 0) {
    if (divisor > 0)
      reduce_divide((uint8_t *)out + boff[v] * es, boff[v + 1] - boff[v], op->dtype, divisor);
    CHECK_GOTO(doubling(comm, op, g, out, boff), res, done);
  }
  if (me < 2 * rem) {
    int odd = me & 1;
    CHECK_GOTO(sched_sendrecv(comm, op, g, odd ? me - 1 : -1, out, count * es,
                              odd ? -1 : me + 1, out, count * es),
               res, done);
  }
done:
  free(cnt);
  free(boff);
  return res;
}

chorus_result_t rhd_allreduce(struct chorus_comm *comm, struct op *op) {
  void *scaled;
  CHECK(prescale_input(comm, op, op->sendbuf, op->count, &scaled));
  struct group g = group_world(comm);
  chorus_result_t res =
      rhd_allreduce_group(comm, op, &g, scaled ? scaled : op->sendbuf, op->recvbuf, op->count,
                          op->op.kind == CHORUS_AVG ? comm->nranks : 0);
  free(scaled);
  return res;
}

chorus_result_t rhd_reduce_scatter(struct chorus_comm *comm, struct op *op) {
  const int n = comm->nranks, me = comm->rank, p = pow2_floor(n), rem = n - p;
  const size_t es = dtype_size(op->dtype);
  struct group g = group_world(comm);
  size_t *boff = NULL, total = 0;
  for (int i = 0; i < n; i++) total += op->counts[i];
  void *scaled = NULL, *work = NULL;
  chorus_result_t res;
  CHECK_GOTO(virtual_offsets(comm, n, op->counts, &boff), res, done);
  CHECK_GOTO(prescale_input(comm, op, op->sendbuf, total, &scaled), res, done);
  CHECK_GOTO(algo_alloc(comm, total * es, &work), res, done);
  CHECK_GOTO(halving(comm, op, &g, scaled ? scaled : op->sendbuf, work, boff), res, done);
  int v = virt_of(me, rem);
  /* virtual v holds slices vfirst(v)..vreal(v); the first one of a folded pair goes back */
  size_t myoff = 0;
  for (int i = 0; i < me; i++) myoff += op->counts[i];
  if (v < 0) {
    CHECK_GOTO(sched_sendrecv(comm, op, &g, -1, NULL, 0, me + 1, op->recvbuf,
                              op->counts[me] * es),
               res, done);
  } else {
    if (me < 2 * rem)
      CHECK_GOTO(sched_sendrecv(comm, op, &g, me - 1, (uint8_t *)work + boff[v] * es,
                                op->counts[me - 1] * es, -1, NULL, 0),
                 res, done);
    if (op->counts[me]) memcpy(op->recvbuf, (uint8_t *)work + myoff * es, op->counts[me] * es);
  }
  if (op->op.kind == CHORUS_AVG) reduce_divide(op->recvbuf, op->counts[me], op->dtype, n);
done:
  free(boff);
  free(scaled);
  free(work);
  return res;
}

chorus_result_t rhd_allgather_group(struct chorus_comm *comm, struct op *op,
                                    const struct group *g, void *buf, const size_t *cnt) {
  const int n = g->n, me = g->me, p = pow2_floor(n), rem = n - p;
  const size_t es = dtype_size(op->dtype);
  uint8_t *b = buf;
  size_t *off, *boff = NULL;
  CHECK(algo_alloc(comm, (size_t)(n + 1) * sizeof(size_t), (void **)&off));
  off[0] = 0;
  for (int i = 0; i < n; i++) off[i + 1] = off[i] + cnt[i];
  chorus_result_t res;
  CHECK_GOTO(virtual_offsets(comm, n, cnt, &boff), res, done);
  if (me < 2 * rem) {
    int odd = me & 1;
    CHECK_GOTO(sched_sendrecv(comm, op, g, odd ? -1 : me + 1, b + off[me] * es, cnt[me] * es,
                              odd ? me - 1 : -1, b + off[me - odd] * es,
                              odd ? cnt[me - 1] * es : 0),
               res, done);
  }
  if (virt_of(me, rem) >= 0) CHECK_GOTO(doubling(comm, op, g, buf, boff), res, done);
  if (me < 2 * rem) {
    /* the even member of a pair gets everything but its own block: the part before it,
     * then the part after it (two messages, so two steps: one message per peer and step) */
    int odd = me & 1, even = me & ~1;
    size_t part[2][2] = {{0, off[even]}, {off[even + 1], off[n]}};
    for (int k = 0; k < 2; k++) {
      uint8_t *pb = b + part[k][0] * es;
      size_t bytes = (part[k][1] - part[k][0]) * es;
      CHECK_GOTO(sched_sendrecv(comm, op, g, odd ? even : -1, pb, bytes, odd ? -1 : me + 1, pb,
                                bytes),
                 res, done);
    }
  }
done:
  free(off);
  free(boff);
  return res;
}

chorus_result_t rhd_allgather(struct chorus_comm *comm, struct op *op) {
  const size_t es = dtype_size(op->dtype);
  const int me = comm->rank;
  uint8_t *mine = (uint8_t *)op->recvbuf + op->displs[me] * es;
  if (mine != op->sendbuf && op->counts[me]) memmove(mine, op->sendbuf, op->counts[me] * es);
  struct group g = group_world(comm);
  return rhd_allgather_group(comm, op, &g, op->recvbuf, op->counts);
}
