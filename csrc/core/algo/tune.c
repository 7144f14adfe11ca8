/* tune.c - choosing an algorithm per collective. */
#include "algo.h"

int algo_select(struct chorus_comm *comm, const struct op *op) {
  (void)comm;
  (void)op;
  return ALGO_DIRECT;
}
