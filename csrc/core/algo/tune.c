/* tune.c - choosing an algorithm per collective. */
#include <stdlib.h>
#include "algo.h"

chorus_result_t tune_init(struct chorus_comm *comm) {
  for (int k = 0; k < OP_KIND_COUNT; k++) comm->algo_force[k] = -1;
  return CHORUS_SUCCESS;
}

int algo_select(struct chorus_comm *comm, const struct op *op) {
  size_t bytes = op->count * dtype_size(op->dtype);
  if (op->kind == OP_ALLREDUCE && bytes > (getenv("X_TS") ? (size_t)atoll(getenv("X_TS")) : 131072) && algo_usable(comm, op, ALGO_TWOSHOT))
    return ALGO_TWOSHOT;
  if (algo_usable(comm, op, ALGO_ONESHOT)) return ALGO_ONESHOT;
  return ALGO_DIRECT;
}
