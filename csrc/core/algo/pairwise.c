/* pairwise.c - pairwise-exchange all-to-all(v): n-1 steps, step k sends to rank + k and
 * receives from rank - k, so every rank has exactly one partner each way per step. */
#include <stdlib.h>
#include <string.h>

#include "algo.h"

chorus_result_t pairwise_alltoall(struct chorus_comm *comm, struct op *op) {
  const int n = comm->nranks, me = comm->rank;
  const size_t es = dtype_size(op->dtype);
  if (op->counts[me] != op->counts2[me])
    return comm_set_error(comm, CHORUS_ERR_INVALID,
                          "all_to_all seq %llu rank %d: sends %zu elements to itself but expects "
                          "%zu",
                          (unsigned long long)op->seq, me, op->counts[me], op->counts2[me]);
  /* in-place (overlapping) use: send from a private copy */
  const uint8_t *src = op->sendbuf, *rb = op->recvbuf;
  size_t sbytes = 0, rbytes = 0;
  for (int p = 0; p < n; p++) {
    size_t se = (op->displs[p] + op->counts[p]) * es, re = (op->displs2[p] + op->counts2[p]) * es;
    if (se > sbytes) sbytes = se;
    if (re > rbytes) rbytes = re;
  }
  uint8_t *copy = NULL;
  if (sbytes && rbytes && src < rb + rbytes && rb < src + sbytes) {
    CHECK(algo_alloc(comm, sbytes, (void **)&copy));
    memcpy(copy, src, sbytes);
    src = copy;
  }
  if (op->counts[me])
    memmove((uint8_t *)op->recvbuf + op->displs2[me] * es, src + op->displs[me] * es,
            op->counts[me] * es);
  struct group g = group_world(comm);
  chorus_result_t res = CHORUS_SUCCESS;
  for (int k = 1; k < n && res == CHORUS_SUCCESS; k++) {
    int to = (me + k) % n, from = (me - k + n) % n;
    res = sched_sendrecv(comm, op, &g, to, src + op->displs[to] * es, op->counts[to] * es, from,
                         (uint8_t *)op->recvbuf + op->displs2[from] * es, op->counts2[from] * es);
  }
  free(copy);
  return res;
}
