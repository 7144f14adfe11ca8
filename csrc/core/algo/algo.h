/* algo.h - what every algorithm file shares: the step runner that drives a set of framed
 * sends and receives to completion, and the ordered multi-input reduction from rings. */
#ifndef CHORUS_ALGO_H
#define CHORUS_ALGO_H

#include "../core.h"

/* One receive of a step: copy into dst, or (reduce_into) feed an ordered reduction. */
struct step {
  struct msg_tx *tx;
  int ntx;
  struct msg_rx *rx;
  void **rx_dst;
  int nrx;
};

/* Runs the sends and copy-receives of a step until all are complete. */
chorus_result_t step_run(struct chorus_comm *comm, struct op *op, struct step *s);

/* Receives one message of `count` elements from each rank in `from` (self excluded via
 * own == input of this rank at position `self_pos`) and writes
 * out = op(inputs in rank order) while also driving the sends in `tx`. inputs[k] for
 * k != self_pos come from rx[k]. */
chorus_result_t reduce_from_peers(struct chorus_comm *comm, struct op *op, struct msg_rx *rx,
                                  int nin, int self_pos, const void *own, void *out,
                                  size_t count, struct msg_tx *tx, int ntx);

/* Reduction kind that the transport-level schedule performs (AVG and PREMUL_SUM become
 * SUM with a post-divide or a pre-scaled copy of the input). */
chorus_op_kind_t base_op(chorus_op_kind_t k);
/* For PREMUL_SUM: a scaled copy of count elements of in (caller frees); else NULL. */
chorus_result_t prescale_input(struct chorus_comm *comm, struct op *op, const void *in,
                               size_t count, void **scaled);

/* ------------------------------------------------------------------ groups and steps
 * Building blocks run over an ordered subset of the communicator's ranks, so hier.c can
 * compose them over a host's ranks or over one leader per host. Member i of a group is
 * comm rank ranks[i] (ranks NULL: the identity, i.e. the whole communicator). */
struct group {
  int n, me;          /* members, index of this rank */
  const int *ranks;   /* n comm ranks, or NULL for 0..n-1 */
};
static inline int group_rank(const struct group *g, int i) { return g->ranks ? g->ranks[i] : i; }
static inline struct group group_world(const struct chorus_comm *comm) {
  struct group g = {comm->nranks, comm->rank, NULL};
  return g;
}

/* A step of a schedule: sends, copy-receives and reducing receives (out = op over own and
 * one or more received inputs, in a given order), all progressed together so a message
 * larger than the connection ring never deadlocks. Peers are group member indices. Several
 * messages to (or from) one peer in a step go in the order they were added: a later one
 * waits until the earlier one is complete, and the peer must add them in the same order. */
#define STEP_MAX_XFER 8  /* sends, copy-receives per step */
#define STEP_MAX_RED 2   /* reducing receives per step */
#define STEP_MAX_IN 4    /* inputs of one reducing receive (own included) */
struct red_recv {
  struct msg_rx rx[STEP_MAX_IN - 1];
  int nrx;
  const void *own;
  int own_pos;        /* position of own among the inputs (0..nrx) */
  void *out;
  size_t count, pos;  /* elements; bytes reduced so far */
};
struct sched_step {
  struct chorus_comm *comm;
  struct op *op;
  const struct group *g;
  struct msg_tx tx[STEP_MAX_XFER];
  struct msg_rx rx[STEP_MAX_XFER];
  void *rx_dst[STEP_MAX_XFER];
  struct red_recv red[STEP_MAX_RED];
  struct msg_rx *rxq[STEP_MAX_XFER + STEP_MAX_RED * (STEP_MAX_IN - 1)]; /* in added order */
  int ntx, nrx, nred, nrxq, overflow;
};
void sched_begin(struct sched_step *s, struct chorus_comm *comm, struct op *op,
                 const struct group *g);
void sched_send(struct sched_step *s, int peer, const void *buf, size_t bytes);
void sched_recv(struct sched_step *s, int peer, void *dst, size_t bytes);
/* Starts a reducing receive: out[0..count) = op(inputs), own at position own_pos. Add its
 * contributors with sched_reduce_add in input order (own excluded). Returns its index. */
int sched_reduce(struct sched_step *s, const void *own, void *out, size_t count, int own_pos);
void sched_reduce_add(struct sched_step *s, int red, int peer);
/* Runs the step to completion (or error). */
chorus_result_t sched_run(struct sched_step *s);
/* Common one-liners: exchange with one peer (either side may be -1 for none). */
chorus_result_t sched_sendrecv(struct chorus_comm *comm, struct op *op, const struct group *g,
                               int to, const void *sbuf, size_t sbytes, int from, void *rbuf,
                               size_t rbytes);
/* Send sbuf to `to` while out = op(own, data from `from`), own first when own_first. */
chorus_result_t sched_sendrecv_reduce(struct chorus_comm *comm, struct op *op,
                                      const struct group *g, int to, const void *sbuf,
                                      size_t sbytes, int from, const void *own, void *out,
                                      size_t count, int own_first);

/* Elements per pipelined chunk: a quarter of the connection ring (CHORUS_BUFFSIZE), so a
 * few chunks are in flight per connection. At least one element. */
size_t algo_chunk_elems(chorus_dtype_t dtype);
/* Element count and offset of block p when count elements are split over n blocks. */
void even_slice(size_t count, int n, int p, size_t *cnt, size_t *off);
/* malloc that records an out-of-memory error on the communicator. */
chorus_result_t algo_alloc(struct chorus_comm *comm, size_t bytes, void **out);
/* Are counts all equal / displs the packed prefix sums of counts (n entries)? */
int counts_uniform(const size_t *counts, int n);
int displs_packed(const size_t *counts, const size_t *displs, int n);
/* An all-to-all of n ranks whose every send and receive block has counts[0] elements, block p
 * at p * counts[0]. */
int alltoall_blocks(const struct op *op, int n);

/* ------------------------------------------------------------------ the algorithm registry
 * Every algorithm has an id, a name (what CHORUS_ALGO and the logs use) and one entry per
 * collective it implements (NULL where it does not). An entry runs the whole collective
 * described by op on the engine thread. algo_run() asks algo_select() (tune.c) which id to
 * use and stamps it into op->algo, which travels in every message header (flags byte), so
 * ranks that chose differently (because their counts differ) fail with a mismatch. */
enum algo_id {
  ALGO_DIRECT = 0, /* direct.c: all-pairs, one step */
  ALGO_RING,       /* ring.c: pipelined chunked ring */
  ALGO_TREE,       /* tree.c: double binary tree */
  ALGO_RHD,        /* rhd.c: recursive halving-doubling (Rabenseifner) */
  ALGO_RD,         /* rd.c: recursive doubling (butterfly) */
  ALGO_BRUCK,      /* bruck.c: Bruck / dissemination, any rank count */
  ALGO_PAIRWISE,   /* pairwise.c: pairwise exchange */
  ALGO_ONESHOT,    /* shm_direct.c: same host, every rank reads every input from shm */
  ALGO_TWOSHOT,    /* shm_direct.c: same host, each rank reduces a slice, then all gather */
  ALGO_HIER,       /* hier.c: inside each host, across hosts between leaders, inside again */
  ALGO_COUNT
};

typedef chorus_result_t (*algo_fn)(struct chorus_comm *comm, struct op *op);
struct algo_desc {
  const char *name;
  algo_fn run[OP_KIND_COUNT]; /* indexed by enum op_kind; NULL: not implemented */
};
extern const struct algo_desc algo_table[ALGO_COUNT];
const char *algo_name(int id);
int algo_from_name(const char *name); /* -1 if unknown */
/* tune.c: can algorithm id run op on this communicator: implemented for op->kind and
 * algo_constraints_ok? */
int algo_usable(const struct chorus_comm *comm, const struct op *op, int id);
/* tune.c: the per-algorithm constraints: topology (tune_topo_ok: oneshot/twoshot need every
 * rank on one host with shm; hier several hosts with several ranks on one), v-variants
 * (unequal counts, alltoallv: only the algorithms in tune.c's algo_v_ok) and the op's shape
 * (algo_shape_ok). Inputs must be equal on every rank, so that every rank chooses alike. */
int algo_constraints_ok(const struct chorus_comm *comm, const struct op *op, int id);
/* algo.c: what each algorithm needs of the op's shape (packed displacements, equal blocks). */
int algo_shape_ok(const struct chorus_comm *comm, const struct op *op, int id);

/* tune.c: the algorithm for op (an override from CHORUS_ALGO, else the cost model). Always
 * returns a usable id (ALGO_DIRECT as the last resort). Depends only on facts that agree on
 * every rank of a correct program: the collective, its byte count, nranks and topology. */
int algo_select(struct chorus_comm *comm, const struct op *op);

/* Same-host direct-access schedules: algo/shm_direct.c */
#define CHORUS_MAX_LOCAL_DIRECT 256 /* most ranks the direct-access algorithms serve */
chorus_result_t oneshot_allreduce(struct chorus_comm *comm, struct op *op);
chorus_result_t twoshot_allreduce(struct chorus_comm *comm, struct op *op);
chorus_result_t oneshot_reduce(struct chorus_comm *comm, struct op *op);
chorus_result_t oneshot_broadcast(struct chorus_comm *comm, struct op *op);
chorus_result_t oneshot_allgatherv(struct chorus_comm *comm, struct op *op);
chorus_result_t oneshot_reduce_scatterv(struct chorus_comm *comm, struct op *op);
chorus_result_t oneshot_alltoall(struct chorus_comm *comm, struct op *op);
chorus_result_t oneshot_barrier(struct chorus_comm *comm, struct op *op);
/* Topology and shape checks of the two ids above. */
int shm_direct_ok(const struct chorus_comm *comm, const struct op *op, int id);
/* Whether a scratch half of `half` bytes serves nranks ranks (part of shm_direct_ok; the
 * plan, which has no segment, asks it of CHORUS_SHM_SCRATCH's half). */
int shm_direct_scratch_ok(size_t half, int nranks);
/* Runs on the executing rank with every rank's descriptor (descs[rank], own included) and
 * writes the reply every rank receives. */
typedef chorus_result_t (*delegate_fn)(struct chorus_comm *comm, struct op *op,
                                       const void *const *descs, void *reply, void *arg);
/* Every rank posts a descriptor, rank exec runs `run` over all of them, every rank gets its
 * reply (shm_direct.c, for cuda.c's same-GPU path). Every rank of the communicator must be
 * on this host with shared memory on. */
chorus_result_t shm_delegate(struct chorus_comm *comm, struct op *op, int exec, const void *mine,
                             size_t len, void *reply, size_t rlen, delegate_fn run, void *arg);

/* Direct (all-pairs) schedules: algo/direct.c */
chorus_result_t direct_allreduce(struct chorus_comm *comm, struct op *op);
chorus_result_t direct_broadcast(struct chorus_comm *comm, struct op *op);
chorus_result_t direct_reduce(struct chorus_comm *comm, struct op *op);
chorus_result_t direct_allgatherv(struct chorus_comm *comm, struct op *op);
chorus_result_t direct_reduce_scatterv(struct chorus_comm *comm, struct op *op);
chorus_result_t direct_gather(struct chorus_comm *comm, struct op *op);
chorus_result_t direct_scatter(struct chorus_comm *comm, struct op *op);
chorus_result_t direct_alltoallv(struct chorus_comm *comm, struct op *op);
chorus_result_t direct_barrier(struct chorus_comm *comm, struct op *op);

/* Network algorithms. Entries of algo_table (whole communicator, op semantics). */
chorus_result_t ring_allreduce(struct chorus_comm *comm, struct op *op);
chorus_result_t ring_reduce_scatter(struct chorus_comm *comm, struct op *op);
chorus_result_t ring_allgather(struct chorus_comm *comm, struct op *op);
chorus_result_t ring_broadcast(struct chorus_comm *comm, struct op *op);
chorus_result_t ring_reduce(struct chorus_comm *comm, struct op *op);
chorus_result_t tree_allreduce(struct chorus_comm *comm, struct op *op);
chorus_result_t tree_broadcast(struct chorus_comm *comm, struct op *op);
chorus_result_t tree_reduce(struct chorus_comm *comm, struct op *op);
chorus_result_t rhd_allreduce(struct chorus_comm *comm, struct op *op);
chorus_result_t rhd_reduce_scatter(struct chorus_comm *comm, struct op *op);
chorus_result_t rhd_allgather(struct chorus_comm *comm, struct op *op);
chorus_result_t rd_allreduce(struct chorus_comm *comm, struct op *op);
chorus_result_t rd_allgather(struct chorus_comm *comm, struct op *op);
chorus_result_t rd_barrier(struct chorus_comm *comm, struct op *op);
chorus_result_t bruck_allgather(struct chorus_comm *comm, struct op *op);
chorus_result_t bruck_alltoall(struct chorus_comm *comm, struct op *op);
chorus_result_t bruck_barrier(struct chorus_comm *comm, struct op *op);
chorus_result_t pairwise_alltoall(struct chorus_comm *comm, struct op *op);
chorus_result_t hier_allreduce(struct chorus_comm *comm, struct op *op);
chorus_result_t hier_broadcast(struct chorus_comm *comm, struct op *op);
chorus_result_t hier_reduce(struct chorus_comm *comm, struct op *op);

/* Building blocks over a group, for composition (hier.c). They use the op only for its
 * dtype, reduction kind (base_op: no pre-scaling, no divide unless `divisor` > 0) and message
 * fingerprint; buffers and counts are explicit. in may equal out. */
/* out (count elements) = allreduce of in over g; each slice is finalised once (divided by
 * divisor when > 0) and copied, so every member ends with the same bits. */
chorus_result_t ring_allreduce_group(struct chorus_comm *comm, struct op *op,
                                     const struct group *g, const void *in, void *out,
                                     size_t count, int divisor);
/* Pipelined chain broadcast of buf from member root. */
chorus_result_t ring_broadcast_group(struct chorus_comm *comm, struct op *op,
                                     const struct group *g, void *buf, size_t count, int root);
/* Pipelined chain reduction of in to member root's out (out used only at root). */
chorus_result_t ring_reduce_group(struct chorus_comm *comm, struct op *op, const struct group *g,
                                  const void *in, void *out, size_t count, int root,
                                  int divisor);
/* Recursive halving-doubling allreduce over g (any member count). */
chorus_result_t rhd_allreduce_group(struct chorus_comm *comm, struct op *op,
                                    const struct group *g, const void *in, void *out,
                                    size_t count, int divisor);
/* Recursive-doubling allgather over g: member i's block is buf[off(i), +cnt[i]) with the blocks
 * packed in member order; member me's block is already in place. */
chorus_result_t rhd_allgather_group(struct chorus_comm *comm, struct op *op,
                                    const struct group *g, void *buf, const size_t *cnt);
/* Double-binary-tree reduce (to member 0 of each tree) + broadcast over g. */
chorus_result_t tree_allreduce_group(struct chorus_comm *comm, struct op *op,
                                     const struct group *g, const void *in, void *out,
                                     size_t count, int divisor);

#endif
