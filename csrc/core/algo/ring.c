/* ring.c - pipelined ring schedules: all-reduce (reduce-scatter ring, then all-gather ring),
 * reduce-scatter(v), all-gather(v), and the pipelined chains for broadcast and reduce. Data
 * moves in chunks of algo_chunk_elems() so a large slice streams instead of waiting. */
#include <stdlib.h>
#include <string.h>

#include "algo.h"

static size_t chunk_len(size_t cnt, size_t lo, size_t chunk) {
  if (lo >= cnt) return 0;
  return cnt - lo < chunk ? cnt - lo : chunk;
}

static size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

/* The two ring phases over g. Slice j is cnt[j] elements at off[j] of in / out.
 * do_rs: reduce slice me of in over all members into rs_out (divided by divisor if > 0).
 * do_ag: every member's slice of out (own already in place) reaches every member.
 * Rounds go chunk by chunk: round c moves chunk c of every slice through all 2(n-1) steps,
 * so neighbours work on consecutive chunks at once. */
static chorus_result_t ring_phases(struct chorus_comm *comm, struct op *op, const struct group *g,
                                   const void *in, void *out, void *rs_out, const size_t *cnt,
                                   const size_t *off, int do_rs, int do_ag, int divisor) {
  const int n = g->n, me = g->me, next = (me + 1) % n, prev = (me + n - 1) % n;
  const size_t es = dtype_size(op->dtype);
  const uint8_t *src = in;
  uint8_t *dst = out, *rso = rs_out;
  if (n == 1) {
    if (do_rs) {
      if (rso != src + off[0] * es && cnt[0]) memmove(rso, src + off[0] * es, cnt[0] * es);
      if (divisor > 0) reduce_divide(rso, cnt[0], op->dtype, divisor);
    }
    return CHORUS_SUCCESS;
  }
  const size_t C = algo_chunk_elems(op->dtype);
  size_t maxcnt = 0;
  for (int j = 0; j < n; j++)
    if (cnt[j] > maxcnt) maxcnt = cnt[j];
  size_t rounds = maxcnt ? ceil_div(maxcnt, C) : 1;
  uint8_t *scratch = NULL;
  if (do_rs && n > 2) CHECK(algo_alloc(comm, 2 * C * es, (void **)&scratch));
  chorus_result_t res = CHORUS_SUCCESS;
  for (size_t c = 0; c < rounds; c++) {
    size_t lo = c * C;
    if (do_rs) {
      for (int s = 0; s < n - 1; s++) {
        int sj = ((me - 1 - s) % n + n) % n, rj = ((me - 2 - s) % n + n) % n;
        size_t sl = chunk_len(cnt[sj], lo, C), rl = chunk_len(cnt[rj], lo, C);
        const uint8_t *sb = s == 0 ? src + (off[sj] + lo) * es : scratch + ((s - 1) & 1) * C * es;
        uint8_t *ob = s == n - 2 ? rso + lo * es : scratch + (s & 1) * C * es;
        CHECK_GOTO(sched_sendrecv_reduce(comm, op, g, next, sb, sl * es, prev,
                                         src + (off[rj] + lo) * es, ob, rl, 0),
                   res, done);
      }
      size_t ml = chunk_len(cnt[me], lo, C);
      if (divisor > 0 && ml) reduce_divide(rso + lo * es, ml, op->dtype, divisor);
    }
    if (do_ag) {
      for (int s = 0; s < n - 1; s++) {
        int sj = ((me - s) % n + n) % n, rj = ((me - 1 - s) % n + n) % n;
        size_t sl = chunk_len(cnt[sj], lo, C), rl = chunk_len(cnt[rj], lo, C);
        CHECK_GOTO(sched_sendrecv(comm, op, g, next, dst + (off[sj] + lo) * es, sl * es, prev,
                                  dst + (off[rj] + lo) * es, rl * es),
                   res, done);
      }
    }
  }
done:
  free(scratch);
  return res;
}

static chorus_result_t even_slices(struct chorus_comm *comm, size_t count, int n, size_t **cnt,
                                   size_t **off) {
  *cnt = NULL;
  *off = NULL;
  chorus_result_t res = algo_alloc(comm, (size_t)n * sizeof(size_t), (void **)cnt);
  if (res == CHORUS_SUCCESS) res = algo_alloc(comm, (size_t)n * sizeof(size_t), (void **)off);
  if (res != CHORUS_SUCCESS) {
    free(*cnt);
    return res;
  }
  for (int p = 0; p < n; p++) even_slice(count, n, p, &(*cnt)[p], &(*off)[p]);
  return CHORUS_SUCCESS;
}

chorus_result_t ring_allreduce_group(struct chorus_comm *comm, struct op *op,
                                     const struct group *g, const void *in, void *out,
                                     size_t count, int divisor) {
  size_t *cnt, *off;
  CHECK(even_slices(comm, count, g->n, &cnt, &off));
  size_t es = dtype_size(op->dtype);
  chorus_result_t res = ring_phases(comm, op, g, in, out, (uint8_t *)out + off[g->me] * es, cnt,
                                    off, 1, 1, divisor);
  free(cnt);
  free(off);
  return res;
}

chorus_result_t ring_allreduce(struct chorus_comm *comm, struct op *op) {
  void *scaled;
  CHECK(prescale_input(comm, op, op->sendbuf, op->count, &scaled));
  struct group g = group_world(comm);
  chorus_result_t res =
      ring_allreduce_group(comm, op, &g, scaled ? scaled : op->sendbuf, op->recvbuf, op->count,
                           op->op.kind == CHORUS_AVG ? comm->nranks : 0);
  free(scaled);
  return res;
}

chorus_result_t ring_reduce_scatter(struct chorus_comm *comm, struct op *op) {
  int n = comm->nranks;
  size_t *off;
  CHECK(algo_alloc(comm, (size_t)n * sizeof(size_t), (void **)&off));
  size_t total = 0;
  for (int p = 0; p < n; p++) {
    off[p] = total;
    total += op->counts[p];
  }
  void *scaled;
  chorus_result_t res = prescale_input(comm, op, op->sendbuf, total, &scaled);
  if (res == CHORUS_SUCCESS) {
    struct group g = group_world(comm);
    res = ring_phases(comm, op, &g, scaled ? scaled : op->sendbuf, NULL, op->recvbuf, op->counts,
                      off, 1, 0, op->op.kind == CHORUS_AVG ? n : 0);
  }
  free(scaled);
  free(off);
  return res;
}

chorus_result_t ring_allgather(struct chorus_comm *comm, struct op *op) {
  size_t es = dtype_size(op->dtype);
  int me = comm->rank;
  uint8_t *mine = (uint8_t *)op->recvbuf + op->displs[me] * es;
  if (mine != op->sendbuf && op->counts[me]) memmove(mine, op->sendbuf, op->counts[me] * es);
  struct group g = group_world(comm);
  return ring_phases(comm, op, &g, NULL, op->recvbuf, NULL, op->counts, op->displs, 0, 1, 0);
}

chorus_result_t ring_broadcast_group(struct chorus_comm *comm, struct op *op,
                                     const struct group *g, void *buf, size_t count, int root) {
  const int n = g->n, me = g->me;
  if (n == 1) return CHORUS_SUCCESS;
  const size_t es = dtype_size(op->dtype), C = algo_chunk_elems(op->dtype);
  const size_t nchunks = count ? ceil_div(count, C) : 1;
  const int pos = (me - root + n) % n, last = pos == n - 1;
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  uint8_t *b = buf;
  /* step k: receive chunk k from prev, forward chunk k-1 (the root sends chunk k) */
  for (size_t k = 0; k <= nchunks; k++) {
    struct sched_step s;
    sched_begin(&s, comm, op, g);
    long sk = pos == 0 ? (long)k : (long)k - 1;
    if (!last && sk >= 0 && (size_t)sk < nchunks) {
      size_t lo = (size_t)sk * C;
      sched_send(&s, next, b + lo * es, chunk_len(count, lo, C) * es);
    }
    if (pos > 0 && k < nchunks) {
      size_t lo = k * C;
      sched_recv(&s, prev, b + lo * es, chunk_len(count, lo, C) * es);
    }
    if (s.ntx || s.nrx) CHECK(sched_run(&s));
  }
  return CHORUS_SUCCESS;
}

chorus_result_t ring_broadcast(struct chorus_comm *comm, struct op *op) {
  struct group g = group_world(comm);
  return ring_broadcast_group(comm, op, &g, op->recvbuf, op->count, op->root);
}

chorus_result_t ring_reduce_group(struct chorus_comm *comm, struct op *op, const struct group *g,
                                  const void *in, void *out, size_t count, int root,
                                  int divisor) {
  const int n = g->n, me = g->me;
  const size_t es = dtype_size(op->dtype), C = algo_chunk_elems(op->dtype);
  const uint8_t *src = in;
  uint8_t *dst = out;
  if (n == 1) {
    if (dst != src && count) memmove(dst, src, count * es);
    if (divisor > 0) reduce_divide(dst, count, op->dtype, divisor);
    return CHORUS_SUCCESS;
  }
  /* chain root+1 -> root+2 -> ... -> root: pos 0 starts, pos n-1 is the root */
  const int pos = (me - root - 1 + 2 * n) % n, is_root = me == root;
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  const size_t nchunks = count ? ceil_div(count, C) : 1;
  uint8_t *scratch = NULL;
  if (pos > 0 && !is_root) CHECK(algo_alloc(comm, 2 * C * es, (void **)&scratch));
  chorus_result_t res = CHORUS_SUCCESS;
  for (size_t k = 0; k <= nchunks; k++) {
    struct sched_step s;
    sched_begin(&s, comm, op, g);
    if (pos == 0) {
      if (k < nchunks) sched_send(&s, next, src + k * C * es, chunk_len(count, k * C, C) * es);
    } else {
      if (!is_root && k >= 1)
        sched_send(&s, next, scratch + ((k - 1) & 1) * C * es,
                   chunk_len(count, (k - 1) * C, C) * es);
      if (k < nchunks) {
        size_t lo = k * C;
        uint8_t *ob = is_root ? dst + lo * es : scratch + (k & 1) * C * es;
        int r = sched_reduce(&s, src + lo * es, ob, chunk_len(count, lo, C), 1);
        sched_reduce_add(&s, r, prev);
      }
    }
    if (s.ntx || s.nred) CHECK_GOTO(sched_run(&s), res, done);
  }
  if (is_root && divisor > 0) reduce_divide(dst, count, op->dtype, divisor);
done:
  free(scratch);
  return res;
}

chorus_result_t ring_reduce(struct chorus_comm *comm, struct op *op) {
  void *scaled;
  CHECK(prescale_input(comm, op, op->sendbuf, op->count, &scaled));
  struct group g = group_world(comm);
  chorus_result_t res =
      ring_reduce_group(comm, op, &g, scaled ? scaled : op->sendbuf, op->recvbuf, op->count,
                        op->root, op->op.kind == CHORUS_AVG ? comm->nranks : 0);
  free(scaled);
  return res;
}
