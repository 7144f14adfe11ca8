/* bruck.c - Bruck's algorithms for any rank count in ceil(log2 n) steps: all-gather(v, any
 * displacements) by doubling a rotated prefix, all-to-all (equal blocks) by sending the
 * blocks whose index has bit k set at step k, and the dissemination barrier. */
#include <stdlib.h>
#include <string.h>

#include "algo.h"

static int mod(int a, int n) { return ((a % n) + n) % n; }

chorus_result_t bruck_allgather(struct chorus_comm *comm, struct op *op) {
  const int n = comm->nranks, me = comm->rank;
  const size_t es = dtype_size(op->dtype);
  struct group g = group_world(comm);
  /* tmp holds the blocks of ranks me, me+1, ... packed in that order */
  size_t *toff;
  CHECK(algo_alloc(comm, (size_t)(n + 1) * sizeof(size_t), (void **)&toff));
  toff[0] = 0;
  for (int j = 0; j < n; j++) toff[j + 1] = toff[j] + op->counts[mod(me + j, n)];
  uint8_t *tmp = NULL;
  chorus_result_t res;
  CHECK_GOTO(algo_alloc(comm, toff[n] * es, (void **)&tmp), res, done);
  if (op->counts[me]) memcpy(tmp, op->sendbuf, op->counts[me] * es);
  for (int have = 1; have < n; have *= 2) {
    int take = have < n - have ? have : n - have; /* blocks received this step */
    int to = mod(me - have, n), from = mod(me + have, n);
    /* our first `take` blocks become blocks have.. of rank me - have; the first `take`
     * blocks of rank me + have are our blocks have..have+take-1 */
    size_t sbytes = 0, rbytes = toff[have + take] - toff[have];
    for (int j = 0; j < take; j++) sbytes += op->counts[mod(me + j, n)];
    CHECK_GOTO(sched_sendrecv(comm, op, &g, to, tmp, sbytes * es, from, tmp + toff[have] * es,
                              rbytes * es),
               res, done);
  }
  for (int j = 0; j < n; j++) {
    int p = mod(me + j, n);
    if (op->counts[p])
      memcpy((uint8_t *)op->recvbuf + op->displs[p] * es, tmp + toff[j] * es, op->counts[p] * es);
  }
done:
  free(tmp);
  free(toff);
  return res;
}

chorus_result_t bruck_alltoall(struct chorus_comm *comm, struct op *op) {
  const int n = comm->nranks, me = comm->rank;
  const size_t es = dtype_size(op->dtype), bs = op->counts[0] * es; /* equal blocks */
  struct group g = group_world(comm);
  /* tmp[j]: the block travelling a distance j (from me to me+j at the start) */
  uint8_t *tmp = NULL, *pack = NULL, *unpack = NULL;
  chorus_result_t res;
  size_t half = (size_t)(n / 2 + 1) * bs;
  CHECK_GOTO(algo_alloc(comm, (size_t)n * bs, (void **)&tmp), res, done);
  CHECK_GOTO(algo_alloc(comm, half, (void **)&pack), res, done);
  CHECK_GOTO(algo_alloc(comm, half, (void **)&unpack), res, done);
  for (int j = 0; j < n && bs; j++)
    memcpy(tmp + (size_t)j * bs, (const uint8_t *)op->sendbuf + op->displs[mod(me + j, n)] * es, bs);
  for (int d = 1; d < n; d *= 2) {
    size_t k = 0;
    for (int j = 1; j < n; j++)
      if (j & d) {
        if (bs) memcpy(pack + k * bs, tmp + (size_t)j * bs, bs);
        k++;
      }
    CHECK_GOTO(sched_sendrecv(comm, op, &g, mod(me + d, n), pack, k * bs, mod(me - d, n), unpack,
                              k * bs),
               res, done);
    k = 0;
    for (int j = 1; j < n; j++)
      if (j & d) {
        if (bs) memcpy(tmp + (size_t)j * bs, unpack + k * bs, bs);
        k++;
      }
  }
  /* now tmp[j] came from rank me - j */
  for (int j = 0; j < n && bs; j++)
    memcpy((uint8_t *)op->recvbuf + op->displs2[mod(me - j, n)] * es, tmp + (size_t)j * bs, bs);
done:
  free(tmp);
  free(pack);
  free(unpack);
  return res;
}

chorus_result_t bruck_barrier(struct chorus_comm *comm, struct op *op) {
  const int n = comm->nranks, me = comm->rank;
  struct group g = group_world(comm);
  for (int d = 1; d < n; d *= 2)
    CHECK(sched_sendrecv(comm, op, &g, mod(me + d, n), NULL, 0, mod(me - d, n), NULL, 0));
  return CHORUS_SUCCESS;
}
