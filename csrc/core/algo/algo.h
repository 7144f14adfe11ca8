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
/* tune.c: the one place for per-algorithm constraints (topology, shape of the op). Defaults:
 * oneshot/twoshot need every rank on one host with shm; hier needs several hosts with
 * several ranks on one; only direct takes v-variants (unequal counts, alltoallv). Inputs
 * must be equal on every rank, so that every rank chooses alike. */
int algo_constraints_ok(const struct chorus_comm *comm, const struct op *op, int id);

/* tune.c: the algorithm for op (an override from CHORUS_ALGO, else the cost model). Always
 * returns a usable id (ALGO_DIRECT as the last resort). Depends only on facts that agree on
 * every rank of a correct program: the collective, its byte count, nranks and topology. */
int algo_select(struct chorus_comm *comm, const struct op *op);

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

#endif
