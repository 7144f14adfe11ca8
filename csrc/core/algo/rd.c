/* rd.c - recursive doubling (butterfly) for small messages: all-reduce exchanging the whole
 * vector log2(p) times, all-gather (the doubling of rhd.c), and barrier. Non-powers of two
 * fold member 2i into 2i+1 (i < n - p) first and unfold at the end. Partners always combine
 * the lower virtual index first, so both compute the same bits. */
#include <stdlib.h>
#include <string.h>

#include "algo.h"

static int pow2_floor(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

/* Real member that holds virtual member v after the fold. */
static int vreal(int v, int rem) { return v < rem ? 2 * v + 1 : v + rem; }

static chorus_result_t rd_allreduce_group(struct chorus_comm *comm, struct op *op,
                                          const struct group *g, const void *in, void *out,
                                          size_t count, int divisor) {
  const int n = g->n, me = g->me, p = pow2_floor(n), rem = n - p;
  const size_t bytes = count * dtype_size(op->dtype);
  if (n == 1) {
    if (out != in && bytes) memmove(out, in, bytes);
    if (divisor > 0) reduce_divide(out, count, op->dtype, divisor);
    return CHORUS_SUCCESS;
  }
  if (me < 2 * rem && (me & 1) == 0) { /* folded away: send, then wait for the result */
    CHECK(sched_sendrecv(comm, op, g, me + 1, in, bytes, -1, NULL, 0));
    return sched_sendrecv(comm, op, g, -1, NULL, 0, me + 1, out, bytes);
  }
  void *scratch = NULL;
  if (p > 1) CHECK(algo_alloc(comm, bytes, &scratch));
  const uint8_t *cur = in;
  chorus_result_t res = CHORUS_SUCCESS;
  if (me < 2 * rem) {
    CHECK_GOTO(sched_sendrecv_reduce(comm, op, g, -1, NULL, 0, me - 1, in, out, count, 0), res,
               done);
    cur = out;
  }
  int v = me < 2 * rem ? me / 2 : me - rem;
  for (int d = 1; d < p; d *= 2) {
    int pv = v ^ d;
    /* never reduce into the buffer being sent */
    uint8_t *nxt = cur == (const uint8_t *)out ? scratch : out;
    CHECK_GOTO(sched_sendrecv_reduce(comm, op, g, vreal(pv, rem), cur, bytes, vreal(pv, rem), cur,
                                     nxt, count, v < pv),
               res, done);
    cur = nxt;
  }
  if (cur != (const uint8_t *)out && bytes) memcpy(out, cur, bytes);
  if (divisor > 0) reduce_divide(out, count, op->dtype, divisor);
  if (me < 2 * rem) CHECK_GOTO(sched_sendrecv(comm, op, g, me - 1, out, bytes, -1, NULL, 0), res, done);
done:
  free(scratch);
  return res;
}

chorus_result_t rd_allreduce(struct chorus_comm *comm, struct op *op) {
  void *scaled;
  CHECK(prescale_input(comm, op, op->sendbuf, op->count, &scaled));
  struct group g = group_world(comm);
  chorus_result_t res =
      rd_allreduce_group(comm, op, &g, scaled ? scaled : op->sendbuf, op->recvbuf, op->count,
                         op->op.kind == CHORUS_AVG ? comm->nranks : 0);
  free(scaled);
  return res;
}

chorus_result_t rd_allgather(struct chorus_comm *comm, struct op *op) {
  return rhd_allgather(comm, op); /* the doubling half of halving-doubling, packed blocks */
}

chorus_result_t rd_barrier(struct chorus_comm *comm, struct op *op) {
  const int n = comm->nranks, me = comm->rank, p = pow2_floor(n), rem = n - p;
  struct group g = group_world(comm);
  if (me < 2 * rem && (me & 1) == 0) {
    CHECK(sched_sendrecv(comm, op, &g, me + 1, NULL, 0, -1, NULL, 0));
    return sched_sendrecv(comm, op, &g, -1, NULL, 0, me + 1, NULL, 0);
  }
  if (me < 2 * rem) CHECK(sched_sendrecv(comm, op, &g, -1, NULL, 0, me - 1, NULL, 0));
  int v = me < 2 * rem ? me / 2 : me - rem;
  for (int d = 1; d < p; d *= 2) {
    int peer = vreal(v ^ d, rem);
    CHECK(sched_sendrecv(comm, op, &g, peer, NULL, 0, peer, NULL, 0));
  }
  if (me < 2 * rem) CHECK(sched_sendrecv(comm, op, &g, me - 1, NULL, 0, -1, NULL, 0));
  return CHORUS_SUCCESS;
}
