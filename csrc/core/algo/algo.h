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
