/* hier.c - hierarchical composition for many hosts: a phase inside each host (over the
 * intra-host connections), a phase between one head rank per host, and a phase inside each
 * host again, built from the group pieces of ring.c. All-reduce: reduce to the head, ring
 * all-reduce between heads, broadcast from the head. Broadcast and reduce use the root as the
 * head of its host, so data crosses hosts once per host. */
#include <stdlib.h>
#include <string.h>

#include "algo.h"

struct hier {
  int *host_ranks, *head_ranks;
  struct group host, heads;  /* this rank's host; one head per host, in host order */
  int head_idx;              /* index of this host's head in host */
  int is_head;
};

static void hier_free(struct hier *h) {
  free(h->host_ranks);
  free(h->head_ranks);
}

/* root < 0: heads are the lowest rank of each host; else root heads its host. */
static chorus_result_t hier_setup(struct chorus_comm *comm, int root, struct hier *h) {
  const int n = comm->nranks, me = comm->rank, H = comm->nhosts, mine = comm->host_of[me];
  memset(h, 0, sizeof *h);
  CHECK(algo_alloc(comm, (size_t)n * sizeof(int), (void **)&h->host_ranks));
  chorus_result_t res = algo_alloc(comm, (size_t)H * sizeof(int), (void **)&h->head_ranks);
  if (res != CHORUS_SUCCESS) {
    free(h->host_ranks);
    return res;
  }
  for (int k = 0; k < H; k++) h->head_ranks[k] = -1;
  for (int r = 0; r < n; r++) {
    int k = comm->host_of[r];
    if (h->head_ranks[k] < 0) h->head_ranks[k] = r;
  }
  if (root >= 0) h->head_ranks[comm->host_of[root]] = root;
  int m = 0;
  for (int r = 0; r < n; r++)
    if (comm->host_of[r] == mine) {
      if (r == me) h->host.me = m;
      if (r == h->head_ranks[mine]) h->head_idx = m;
      h->host_ranks[m++] = r;
    }
  h->host.n = m;
  h->host.ranks = h->host_ranks;
  h->heads.n = H;
  h->heads.me = mine;
  h->heads.ranks = h->head_ranks;
  h->is_head = h->head_ranks[mine] == me;
  return CHORUS_SUCCESS;
}

chorus_result_t hier_allreduce(struct chorus_comm *comm, struct op *op) {
  struct hier h;
  CHECK(hier_setup(comm, -1, &h));
  void *scaled = NULL;
  chorus_result_t res;
  CHECK_GOTO(prescale_input(comm, op, op->sendbuf, op->count, &scaled), res, done);
  const void *in = scaled ? scaled : op->sendbuf;
  CHECK_GOTO(ring_reduce_group(comm, op, &h.host, in, op->recvbuf, op->count, h.head_idx, 0), res,
             done);
  if (h.is_head)
    CHECK_GOTO(ring_allreduce_group(comm, op, &h.heads, op->recvbuf, op->recvbuf, op->count,
                                    op->op.kind == CHORUS_AVG ? comm->nranks : 0),
               res, done);
  CHECK_GOTO(ring_broadcast_group(comm, op, &h.host, op->recvbuf, op->count, h.head_idx), res,
             done);
done:
  free(scaled);
  hier_free(&h);
  return res;
}

chorus_result_t hier_broadcast(struct chorus_comm *comm, struct op *op) {
  struct hier h;
  CHECK(hier_setup(comm, op->root, &h));
  chorus_result_t res = CHORUS_SUCCESS;
  if (h.is_head)
    res = ring_broadcast_group(comm, op, &h.heads, op->recvbuf, op->count,
                               comm->host_of[op->root]);
  if (res == CHORUS_SUCCESS)
    res = ring_broadcast_group(comm, op, &h.host, op->recvbuf, op->count, h.head_idx);
  hier_free(&h);
  return res;
}

chorus_result_t hier_reduce(struct chorus_comm *comm, struct op *op) {
  struct hier h;
  CHECK(hier_setup(comm, op->root, &h));
  const int me = comm->rank;
  void *scaled = NULL, *part = NULL;
  chorus_result_t res;
  CHECK_GOTO(prescale_input(comm, op, op->sendbuf, op->count, &scaled), res, done);
  const void *in = scaled ? scaled : op->sendbuf;
  /* the host's partial lands at its head: the root's output, or a scratch buffer */
  if (h.is_head && me != op->root)
    CHECK_GOTO(algo_alloc(comm, op->count * dtype_size(op->dtype), &part), res, done);
  void *hbuf = me == op->root ? op->recvbuf : part;
  CHECK_GOTO(ring_reduce_group(comm, op, &h.host, in, hbuf, op->count, h.head_idx, 0), res, done);
  if (h.is_head)
    CHECK_GOTO(ring_reduce_group(comm, op, &h.heads, hbuf, op->recvbuf, op->count,
                                 comm->host_of[op->root],
                                 op->op.kind == CHORUS_AVG ? comm->nranks : 0),
               res, done);
done:
  free(scaled);
  free(part);
  hier_free(&h);
  return res;
}
