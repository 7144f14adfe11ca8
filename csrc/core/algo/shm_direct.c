/* shm_direct.c - same-host direct-access algorithms. Every rank owns a scratch area of two
 * halves in its shared-memory segment that all local ranks map. A collective is cut into
 * chunks of at most one half; chunk g uses half g % 2. For each chunk a rank copies its
 * contribution into its own scratch once, publishes the generation (and the fingerprint of
 * the call), and then reads what it needs straight out of the peers' scratch:
 *   oneshot: every rank reduces all n inputs itself (one synchronisation; small messages).
 *   twoshot: rank r reduces slice r of the chunk from all inputs into its own scratch, then
 *            every rank copies the n reduced slices out (two synchronisations, each byte
 *            reduced once; large messages).
 * Reductions combine the inputs in rank order with one rounding, so every rank gets
 * bit-identical results. A rank may refill a half only after every peer has said it is done
 * reading the chunk that used it before (two generations ago), so a fast rank never
 * overwrites what a slow one still reads. Only usable when every rank of the communicator
 * is on this host and shared memory is on. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algo.h"

enum { F_POSTED = 0, F_REDUCED = 1, F_DONE = 2 };

struct dx {
  struct chorus_comm *comm;
  struct op *op;
  int n, me;
  size_t es;
  size_t half;
  int dev;   /* CUDA: scratch halves are device memory mapped through CUDA IPC (cuda.c) */
};

static _Atomic uint64_t *flag_of(struct dx *x, int rank, int which) {
  struct shm_flags *f = shm_flags_of(x->comm, x->comm->local_rank_of[rank]);
  return which == F_POSTED ? &f->posted : which == F_REDUCED ? &f->reduced : &f->done;
}

static uint8_t *scratch_of(struct dx *x, int rank, uint64_t g) {
  int local = x->comm->local_rank_of[rank], half = (int)(g & 1);
  return x->dev ? cuda_scratch(x->comm, local, half) : shm_scratch(x->comm, local, half);
}

/* Data movement of either memory: host work runs on the helper threads and is done when
 * the call returns; device work is queued on the communicator's stream and is done once
 * publish() drained it. */
static chorus_result_t dx_copy(struct dx *x, void *dst, const void *src, size_t n, int stream) {
  if (x->dev) return cuda_copy(x->comm, dst, src, n);
  workers_copy(x->comm, dst, src, n, stream);
  return CHORUS_SUCCESS;
}

static chorus_result_t dx_copy_list(struct dx *x, const struct copy_seg *segs, int nseg,
                                    int stream) {
  if (!x->dev) {
    workers_copy_list(x->comm, segs, nseg, stream);
    return CHORUS_SUCCESS;
  }
  for (int i = 0; i < nseg; i++)
    if (segs[i].len) CHECK(cuda_copy(x->comm, segs[i].dst, segs[i].src, segs[i].len));
  return CHORUS_SUCCESS;
}

static chorus_result_t dx_reduce(struct dx *x, void *out, const void *const *in, size_t count,
                                 chorus_op_kind_t kind, int divisor) {
  if (x->dev) return cuda_reduce(x->comm, out, in, x->n, count, x->op->dtype, kind, divisor);
  workers_reduce(x->comm, out, in, x->n, count, x->op->dtype, kind, divisor);
  return CHORUS_SUCCESS;
}

static chorus_result_t dx_gather(struct dx *x, void *dst, const uint8_t *const *src,
                                 size_t slice, size_t bytes, int stream) {
  if (!x->dev) {
    workers_gather(x->comm, dst, src, slice, bytes, stream);
    return CHORUS_SUCCESS;
  }
  for (int p = 0; p < x->n && (size_t)p * slice < bytes; p++) {
    size_t o = (size_t)p * slice, len = bytes - o < slice ? bytes - o : slice;
    CHECK(cuda_copy(x->comm, (uint8_t *)dst + o, src[p] + o, len));
  }
  return CHORUS_SUCCESS;
}

_Static_assert(OP_KIND_COUNT < 256 && CHORUS_DTYPE_COUNT < 256 && CHORUS_OP_COUNT < 256 &&
                   ALGO_COUNT < 256,
               "a fingerprint stores the kind, dtype, reduction and algorithm in a byte each");

/* With the fingerprint switched off (FP_OFF, core.h: measurement builds only) fp_check
 * always succeeds and fp_fill writes no fingerprint, only a placeholder ("unknown", all
 * ones) for check_no_message's error text, which would otherwise print uninitialised
 * memory. */
static void fp_fill(struct dx *x, struct shm_fp *fp, uint64_t g) {
  if (FP_OFF()) {
    memset(fp, 0xff, sizeof *fp);
    return;
  }
  const struct op *op = x->op;
  /* all-to-all carries no total: its (uniform) block size stands in */
  uint64_t count = op->kind == OP_ALLTOALL && op->counts ? op->counts[0] : op->count;
  fp->seq_lo = (uint32_t)op->seq;
  fp->seq_hi = (uint32_t)(op->seq >> 32);
  fp->count_lo = (uint32_t)count;
  fp->count_hi = (uint32_t)(count >> 32);
  fp->gen = (uint32_t)g;
  fp->root = op->root;
  fp->kind = (uint8_t)op->kind;
  fp->dtype = (uint8_t)op->dtype;
  fp->redop = (uint8_t)op->op.kind;
  fp->algo = (uint8_t)op->algo;
}

static int fp_describe(const struct shm_fp *f, char *buf, size_t cap) {
  return snprintf(buf, cap, "%s seq %llu count %llu %s %s root %d with algorithm %s (chunk %u)",
                  f->kind < OP_KIND_COUNT ? op_kind_name((enum op_kind)f->kind) : "unknown",
                  (unsigned long long)f->seq_hi << 32 | f->seq_lo,
                  (unsigned long long)f->count_hi << 32 | f->count_lo,
                  f->dtype < CHORUS_DTYPE_COUNT ? chorus_dtype_name((chorus_dtype_t)f->dtype)
                                                : "unknown",
                  f->redop < CHORUS_OP_COUNT ? chorus_op_name((chorus_op_kind_t)f->redop)
                                             : "unknown",
                  f->root, algo_name((int)f->algo), f->gen);
}

/* `want` is this rank's fingerprint of generation g (fp_fill), made once for all peers. */
static chorus_result_t fp_check(struct dx *x, int peer, uint64_t g, const struct shm_fp *want) {
  if (FP_OFF()) return CHORUS_SUCCESS;
  const struct shm_fp *got = &shm_flags_of(x->comm, x->comm->local_rank_of[peer])->fp[g & 1];
  int red = x->op->kind == OP_ALLREDUCE || x->op->kind == OP_REDUCE ||
            x->op->kind == OP_REDUCE_SCATTER;
  if (got->seq_lo == want->seq_lo && got->seq_hi == want->seq_hi &&
      got->count_lo == want->count_lo && got->count_hi == want->count_hi &&
      got->gen == want->gen && got->kind == want->kind && got->dtype == want->dtype &&
      got->algo == want->algo && got->root == want->root && (!red || got->redop == want->redop))
    return CHORUS_SUCCESS;
  char mine[256], theirs[256];
  fp_describe(want, mine, sizeof mine);
  fp_describe(got, theirs, sizeof theirs);
  return comm_set_error(x->comm, CHORUS_ERR_MISMATCH,
                        "mismatched calls: rank %d called %s but rank %d called %s", x->me, mine,
                        peer, theirs);
}

/* A peer we still wait for has written a framed message to us: it runs a message-based
 * algorithm for this call, so the two ranks disagree about the call. */
static chorus_result_t check_no_message(struct dx *x, int peer) {
  conn_t *c = x->comm->conns[CHAN_COLL][peer];
  const void *p;
  size_t len;
  if (!c) return CHORUS_SUCCESS;
  CHECK(c->ops->peek(c, &p, &len));
  if (len < sizeof(struct msg_hdr)) return CHORUS_SUCCESS;
  struct msg_hdr h;
  memcpy(&h, p, sizeof h);
  struct shm_fp want;
  fp_fill(x, &want, x->comm->dgen);
  char mine[256];
  fp_describe(&want, mine, sizeof mine);
  return comm_set_error(x->comm, CHORUS_ERR_MISMATCH,
                        "mismatched calls: rank %d called %s but rank %d sent a message for "
                        "%s seq %u count %llu with algorithm %s",
                        x->me, mine, peer,
                        h.kind < OP_KIND_COUNT ? op_kind_name((enum op_kind)h.kind) : "unknown",
                        h.seq, (unsigned long long)h.count, algo_name(h.flags));
}

/* Waits until flag `which` of `only` (or of every peer when only < 0) reaches g. */
static chorus_result_t wait_flag(struct dx *x, int which, uint64_t g, int only) {
  int idle = 0;
  for (;;) {
    int missing = -1;
    for (int p = only < 0 ? 0 : only; p < (only < 0 ? x->n : only + 1); p++) {
      if (p == x->me) continue;
      if (atomic_load_explicit(flag_of(x, p, which), memory_order_acquire) < g) {
        missing = p;
        break;
      }
    }
    if (missing < 0) break;
    CHECK(check_no_message(x, missing));
    shm_mark_waiting(x->comm, missing);
    CHECK(engine_poll(x->comm, x->op, &idle));
  }
  if (which == F_POSTED) {
    struct shm_fp want;
    fp_fill(x, &want, g);
    for (int p = only < 0 ? 0 : only; p < (only < 0 ? x->n : only + 1); p++)
      if (p != x->me) CHECK(fp_check(x, p, g, &want));
  }
  return CHORUS_SUCCESS;
}

static chorus_result_t publish(struct dx *x, int which, uint64_t g) {
  /* device: what the flag announces (our scratch written, or peers' scratch read) must have
   * happened on the GPU before the host says so */
  if (x->dev) CHECK(cuda_drain(x->comm, x->op));
  struct shm_flags *f = shm_flags_of(x->comm, x->comm->local_rank_of[x->me]);
  if (which == F_POSTED) fp_fill(x, &f->fp[g & 1], g);
  atomic_store_explicit(flag_of(x, x->me, which), g, memory_order_release);
  shm_notify_local(x->comm);
  return CHORUS_SUCCESS;
}

/* Starts the next chunk. A rank that writes its scratch or posts a fingerprint (both live
 * per half) first waits until every peer is done with the chunk that used the same half. */
static chorus_result_t chunk_begin(struct dx *x, int writes, uint64_t *g, uint8_t **mine) {
  uint64_t gen = ++x->comm->dgen;
  if (writes && gen > 2) CHECK(wait_flag(x, F_DONE, gen - 2, -1));
  *g = gen;
  if (mine) *mine = scratch_of(x, x->me, gen);
  return CHORUS_SUCCESS;
}

static void dx_init(struct dx *x, struct chorus_comm *comm, struct op *op) {
  x->comm = comm;
  x->op = op;
  x->n = comm->nranks;
  x->me = comm->rank;
  x->es = dtype_size(op->dtype);
  x->dev = op->on_device;
  x->half = x->dev ? cuda_scratch_half(comm) : shm_scratch_half(comm);
}

/* Copies count elements of the caller's input into shared memory, pre-scaled for
 * PREMUL_SUM. */
static chorus_result_t copy_in(struct dx *x, void *dst, const void *src, size_t count) {
  if (!count) return CHORUS_SUCCESS;
  if (x->op->kind != OP_BROADCAST && x->op->op.kind == CHORUS_PREMUL_SUM &&
      x->op->kind != OP_ALLGATHER && x->op->kind != OP_ALLTOALL) {
    if (x->dev) return cuda_premul(x->comm, dst, src, count, x->op->dtype, x->op->op.factor);
    workers_premul(x->comm, dst, src, count, x->op->dtype, x->op->op.factor);
    return CHORUS_SUCCESS;
  }
  return dx_copy(x, dst, src, count * x->es, 0);
}

static size_t div_up(size_t a, size_t b) { return (a + b - 1) / b; }

/* Outputs at least this big leave the caches anyway: write them with streaming stores. */
#define STREAM_MIN_BYTES ((size_t)512 << 10)
static int stream_out(size_t total) { return total >= STREAM_MIN_BYTES; }
static chorus_result_t copy_out(struct dx *x, void *dst, const void *src, size_t n,
                                size_t total) {
  return dx_copy(x, dst, src, n, stream_out(total));
}

static int divisor_of(struct dx *x) { return x->op->op.kind == CHORUS_AVG ? x->n : 1; }

/* ------------------------------------------------------------------ all-reduce */
static chorus_result_t allreduce(struct chorus_comm *comm, struct op *op, int two) {
  struct dx x;
  dx_init(&x, comm, op);
  const size_t per = x.half / x.es; /* elements per chunk */
  const size_t nch = op->count ? div_up(op->count, per) : 1;
  const chorus_op_kind_t kind = base_op(op->op.kind);
  const void *in[CHORUS_MAX_LOCAL_DIRECT];
  const size_t unit = 64 / x.es;
  for (size_t k = 0; k < nch; k++) {
    size_t off = k * per, cnt = op->count - off < per ? op->count - off : per;
    if (!op->count) cnt = 0;
    uint64_t g;
    uint8_t *mine;
    CHECK(chunk_begin(&x, 1, &g, &mine));
    CHECK(copy_in(&x, mine, (const uint8_t *)op->sendbuf + off * x.es, cnt));
    CHECK(publish(&x, F_POSTED, g));
    CHECK(wait_flag(&x, F_POSTED, g, -1));
    uint8_t *out = (uint8_t *)op->recvbuf + off * x.es;
    if (!two) {
      for (int p = 0; p < x.n; p++) in[p] = scratch_of(&x, p, g);
      if (cnt) CHECK(dx_reduce(&x, out, in, cnt, kind, divisor_of(&x)));
    } else {
      /* slice p: [p * q, (p + 1) * q) clipped, q rounded up to a cache line */
      size_t q = div_up(div_up(cnt, (size_t)x.n), unit) * unit;
      size_t s0 = (size_t)x.me * q < cnt ? (size_t)x.me * q : cnt;
      size_t s1 = s0 + q < cnt ? s0 + q : cnt;
      if (s1 > s0) {
        for (int p = 0; p < x.n; p++) in[p] = scratch_of(&x, p, g) + s0 * x.es;
        CHECK(dx_reduce(&x, mine + s0 * x.es, in, s1 - s0, kind, divisor_of(&x)));
      }
      CHECK(publish(&x, F_REDUCED, g));
      CHECK(wait_flag(&x, F_REDUCED, g, -1));
      const uint8_t *src[CHORUS_MAX_LOCAL_DIRECT];
      for (int p = 0; p < x.n; p++) src[p] = scratch_of(&x, p, g);
      CHECK(dx_gather(&x, out, src, q * x.es, cnt * x.es, op->count * x.es >= STREAM_MIN_BYTES));
    }
    CHECK(publish(&x, F_DONE, g));
  }
  return CHORUS_SUCCESS;
}

chorus_result_t oneshot_allreduce(struct chorus_comm *comm, struct op *op) {
  return allreduce(comm, op, 0);
}
chorus_result_t twoshot_allreduce(struct chorus_comm *comm, struct op *op) {
  return allreduce(comm, op, 1);
}

/* ------------------------------------------------------------------ reduce */
/* Every rank posts its chunk; the root reduces all of them into its output. */
chorus_result_t oneshot_reduce(struct chorus_comm *comm, struct op *op) {
  struct dx x;
  dx_init(&x, comm, op);
  const size_t per = x.half / x.es;
  const size_t nch = op->count ? div_up(op->count, per) : 1;
  const void *in[CHORUS_MAX_LOCAL_DIRECT];
  for (size_t k = 0; k < nch; k++) {
    size_t off = k * per, cnt = op->count ? (op->count - off < per ? op->count - off : per) : 0;
    uint64_t g;
    uint8_t *mine;
    CHECK(chunk_begin(&x, 1, &g, &mine));
    CHECK(copy_in(&x, mine, (const uint8_t *)op->sendbuf + off * x.es, cnt));
    CHECK(publish(&x, F_POSTED, g));
    if (x.me == op->root) {
      CHECK(wait_flag(&x, F_POSTED, g, -1));
      for (int p = 0; p < x.n; p++) in[p] = scratch_of(&x, p, g);
      uint8_t *out = (uint8_t *)op->recvbuf + off * x.es;
      if (cnt) CHECK(dx_reduce(&x, out, in, cnt, base_op(op->op.kind), divisor_of(&x)));
    }
    CHECK(publish(&x, F_DONE, g));
  }
  return CHORUS_SUCCESS;
}

/* ------------------------------------------------------------------ broadcast */
chorus_result_t oneshot_broadcast(struct chorus_comm *comm, struct op *op) {
  struct dx x;
  dx_init(&x, comm, op);
  const size_t per = x.half / x.es;
  const size_t nch = op->count ? div_up(op->count, per) : 1;
  int root = op->root;
  for (size_t k = 0; k < nch; k++) {
    size_t off = k * per, cnt = op->count ? (op->count - off < per ? op->count - off : per) : 0;
    uint64_t g;
    uint8_t *mine;
    uint8_t *buf = (uint8_t *)op->recvbuf + off * x.es;
    CHECK(chunk_begin(&x, x.me == root, &g, &mine));
    if (x.me == root) {
      CHECK(copy_in(&x, mine, buf, cnt));
      CHECK(publish(&x, F_POSTED, g));
    } else {
      CHECK(wait_flag(&x, F_POSTED, g, root));
      if (cnt) CHECK(copy_out(&x, buf, scratch_of(&x, root, g), cnt * x.es, op->count * x.es));
    }
    CHECK(publish(&x, F_DONE, g));
  }
  return CHORUS_SUCCESS;
}

/* ------------------------------------------------------------------ all-gather(v) */
chorus_result_t oneshot_allgatherv(struct chorus_comm *comm, struct op *op) {
  struct dx x;
  dx_init(&x, comm, op);
  size_t maxb = 0;
  for (int p = 0; p < x.n; p++)
    if (op->counts[p] * x.es > maxb) maxb = op->counts[p] * x.es;
  const size_t per = x.half / x.es * x.es; /* bytes of each contribution per chunk */
  const size_t nch = maxb ? div_up(maxb, per) : 1;
  const uint8_t *src = op->sendbuf;
  struct copy_seg segs[CHORUS_MAX_LOCAL_DIRECT];
  for (size_t k = 0; k < nch; k++) {
    uint64_t g;
    uint8_t *mine;
    CHECK(chunk_begin(&x, 1, &g, &mine));
    size_t off = k * per;
    size_t myb = op->counts[x.me] * x.es;
    size_t mylen = myb > off ? (myb - off < per ? myb - off : per) : 0;
    if (mylen) CHECK(dx_copy(&x, mine, src + off, mylen, 0));
    CHECK(publish(&x, F_POSTED, g));
    CHECK(wait_flag(&x, F_POSTED, g, -1));
    int nseg = 0;
    for (int p = 0; p < x.n; p++) {
      size_t b = op->counts[p] * x.es;
      size_t len = b > off ? (b - off < per ? b - off : per) : 0;
      uint8_t *dst = (uint8_t *)op->recvbuf + op->displs[p] * x.es + off;
      if (!len) continue;
      if (p == x.me) {
        if (dst == src + off) continue;
        if (x.dev) CHECK(cuda_copy(comm, dst, src + off, len));
        else memmove(dst, src + off, len);
      } else {
        segs[nseg++] = (struct copy_seg){dst, scratch_of(&x, p, g), len};
      }
    }
    CHECK(dx_copy_list(&x, segs, nseg, stream_out(op->count * x.es)));
    CHECK(publish(&x, F_DONE, g));
  }
  return CHORUS_SUCCESS;
}

/* Pieces for the block-structured collectives: chunk k carries bytes [k*h, (k+1)*h) of
 * every block, block p's piece at offset p*h of the scratch half. */
static size_t block_piece(struct dx *x) {
  size_t h = x->half / (size_t)x->n;
  h -= h % 64;
  return h;
}

/* ------------------------------------------------------------------ reduce-scatter(v) */
chorus_result_t oneshot_reduce_scatterv(struct chorus_comm *comm, struct op *op) {
  struct dx x;
  dx_init(&x, comm, op);
  const size_t h = block_piece(&x);
  size_t maxb = 0;
  size_t *off = malloc((size_t)x.n * sizeof(size_t));
  if (!off) return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", x.me);
  size_t t = 0;
  for (int p = 0; p < x.n; p++) {
    off[p] = t;
    t += op->counts[p];
    if (op->counts[p] * x.es > maxb) maxb = op->counts[p] * x.es;
  }
  const size_t nch = maxb ? div_up(maxb, h) : 1;
  const void *in[CHORUS_MAX_LOCAL_DIRECT];
  struct copy_seg segs[CHORUS_MAX_LOCAL_DIRECT];
  const int premul = op->op.kind == CHORUS_PREMUL_SUM;
  chorus_result_t res = CHORUS_SUCCESS;
  for (size_t k = 0; k < nch; k++) {
    uint64_t g;
    uint8_t *mine;
    CHECK_GOTO(chunk_begin(&x, 1, &g, &mine), res, out);
    size_t pos = k * h;
    int nseg = 0;
    for (int p = 0; p < x.n; p++) {
      size_t b = op->counts[p] * x.es;
      size_t len = b > pos ? (b - pos < h ? b - pos : h) : 0;
      const uint8_t *from = (const uint8_t *)op->sendbuf + off[p] * x.es + pos;
      if (premul)
        CHECK_GOTO(copy_in(&x, mine + (size_t)p * h, from, len / x.es), res, out);
      else if (len)
        segs[nseg++] = (struct copy_seg){mine + (size_t)p * h, from, len};
    }
    CHECK_GOTO(dx_copy_list(&x, segs, nseg, 0), res, out);
    CHECK_GOTO(publish(&x, F_POSTED, g), res, out);
    CHECK_GOTO(wait_flag(&x, F_POSTED, g, -1), res, out);
    size_t b = op->counts[x.me] * x.es;
    size_t len = b > pos ? (b - pos < h ? b - pos : h) : 0;
    if (len) {
      for (int p = 0; p < x.n; p++) in[p] = scratch_of(&x, p, g) + (size_t)x.me * h;
      uint8_t *dst = (uint8_t *)op->recvbuf + pos;
      CHECK_GOTO(dx_reduce(&x, dst, in, len / x.es, base_op(op->op.kind), divisor_of(&x)),
                 res, out);
    }
    CHECK_GOTO(publish(&x, F_DONE, g), res, out);
  }
out:
  free(off);
  return res;
}

/* ------------------------------------------------------------------ all-to-all */
/* Uniform all-to-all only (algo_usable checks): block p of every rank's input goes to p. */
chorus_result_t oneshot_alltoall(struct chorus_comm *comm, struct op *op) {
  struct dx x;
  dx_init(&x, comm, op);
  const size_t h = block_piece(&x);
  const size_t blk = op->counts[0] * x.es;
  const size_t nch = blk ? div_up(blk, h) : 1;
  const uint8_t *sb = op->sendbuf;
  uint8_t *rb = op->recvbuf;
  const size_t total = blk * (size_t)x.n;
  /* Our own block goes straight from the input to the output (one copy instead of two
   * through the scratch), unless the buffers overlap without being the same: then writing
   * it early could clobber input a later chunk still reads. In place it stays where it is. */
  const int same = sb == rb;
  const int disjoint = sb + total <= rb || rb + total <= sb;
  const int own_direct = same || disjoint;
  struct copy_seg segs[CHORUS_MAX_LOCAL_DIRECT];
  for (size_t k = 0; k < nch; k++) {
    uint64_t g;
    uint8_t *mine;
    CHECK(chunk_begin(&x, 1, &g, &mine));
    size_t pos = k * h, len = blk > pos ? (blk - pos < h ? blk - pos : h) : 0;
    int nseg = 0;
    if (len)
      for (int p = 0; p < x.n; p++)
        if (p != x.me || !own_direct)
          segs[nseg++] = (struct copy_seg){mine + (size_t)p * h, sb + (size_t)p * blk + pos, len};
    CHECK(dx_copy_list(&x, segs, nseg, 0));
    CHECK(publish(&x, F_POSTED, g));
    if (len && own_direct && !same)
      CHECK(copy_out(&x, rb + (size_t)x.me * blk + pos, sb + (size_t)x.me * blk + pos, len,
                     total));
    CHECK(wait_flag(&x, F_POSTED, g, -1));
    nseg = 0;
    if (len)
      for (int q = 0; q < x.n; q++)
        if (q != x.me || !own_direct)
          segs[nseg++] = (struct copy_seg){rb + (size_t)q * blk + pos,
                                           scratch_of(&x, q, g) + (size_t)x.me * h, len};
    CHECK(dx_copy_list(&x, segs, nseg, stream_out(total)));
    CHECK(publish(&x, F_DONE, g));
  }
  return CHORUS_SUCCESS;
}

/* ------------------------------------------------------------------ barrier */
chorus_result_t oneshot_barrier(struct chorus_comm *comm, struct op *op) {
  struct dx x;
  dx_init(&x, comm, op);
  uint64_t g;
  /* no scratch data, but the posted fingerprint takes the half's slot, which a slow peer may
   * still be checking for the chunk two generations back: wait as a writer does */
  CHECK(chunk_begin(&x, 1, &g, NULL));
  CHECK(publish(&x, F_POSTED, g));
  CHECK(wait_flag(&x, F_POSTED, g, -1));
  CHECK(publish(&x, F_DONE, g));
  return CHORUS_SUCCESS;
}

/* ------------------------------------------------------------------ delegation */
/* One exchange of host-memory descriptors through the scratch halves, for a collective
 * that one rank (exec) runs for everyone (cuda.c's same-GPU path): every rank posts `len`
 * bytes, with the call's fingerprint, in its own half; exec waits for all of them, `run`
 * turns them into device work and writes `rlen` bytes of reply after its own descriptor;
 * every other rank waits for the reply. Nobody waits for the device. The halves and flags
 * follow the chunk discipline above, so a mismatched call, a dead or a silent peer fail
 * this exchange the way they fail any direct-access collective. */
chorus_result_t shm_delegate(struct chorus_comm *comm, struct op *op, int exec, const void *mine,
                             size_t len, void *reply, size_t rlen, delegate_fn run, void *arg) {
  struct dx x;
  dx_init(&x, comm, op);
  x.dev = 0; /* the descriptors live in host memory: nothing to drain before publishing */
  x.half = shm_scratch_half(comm);
  const size_t roff = (len + 63) & ~(size_t)63;
  if (x.half < roff + rlen || x.n > CHORUS_MAX_LOCAL_DIRECT)
    return comm_set_error(comm, CHORUS_ERR_INTERNAL, "rank %d: %s seq %llu: %zu bytes of "
                          "shared scratch are too few for the same-GPU exchange", x.me,
                          op_kind_name(op->kind), (unsigned long long)op->seq, x.half);
  uint64_t g;
  uint8_t *own;
  CHECK(chunk_begin(&x, 1, &g, &own));
  memcpy(own, mine, len);
  CHECK(publish(&x, F_POSTED, g));
  if (x.me == exec) {
    const void *descs[CHORUS_MAX_LOCAL_DIRECT];
    CHECK(wait_flag(&x, F_POSTED, g, -1));
    for (int p = 0; p < x.n; p++) descs[p] = scratch_of(&x, p, g);
    CHECK(run(comm, op, descs, own + roff, arg));
    memcpy(reply, own + roff, rlen);
    CHECK(publish(&x, F_REDUCED, g));
  } else {
    CHECK(wait_flag(&x, F_POSTED, g, exec)); /* checks exec's fingerprint */
    CHECK(wait_flag(&x, F_REDUCED, g, exec));
    memcpy(reply, scratch_of(&x, exec, g) + roff, rlen);
  }
  return publish(&x, F_DONE, g);
}

/* ------------------------------------------------------------------ usability */
int shm_direct_scratch_ok(size_t half, int nranks) {
  return half >= (size_t)nranks * 64 && half >= 4096;
}

int shm_direct_ok(const struct chorus_comm *comm, const struct op *op, int id) {
  if (!comm->shm || comm->nlocal != comm->nranks || comm->nranks > CHORUS_MAX_LOCAL_DIRECT)
    return 0;
  size_t half = op->on_device ? cuda_scratch_half(comm) : shm_scratch_half(comm);
  if (!shm_direct_scratch_ok(half, comm->nranks)) return 0;
  if (id == ALGO_TWOSHOT && op->kind != OP_ALLREDUCE) return 0;
  /* all-to-all: in-place with overlapping but unequal buffers is handled by the direct
   * algorithm */
  return op->kind != OP_ALLTOALL || alltoall_blocks(op, comm->nranks);
}
