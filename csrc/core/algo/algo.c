/* algo.c - algorithm dispatch and the pieces every schedule uses: the step runner and
 * the ordered reduction that reads peers' contributions straight from transport rings. */
#include <stdlib.h>
#include <string.h>

#include "algo.h"

chorus_op_kind_t base_op(chorus_op_kind_t k) {
  return (k == CHORUS_AVG || k == CHORUS_PREMUL_SUM) ? CHORUS_SUM : k;
}

chorus_result_t prescale_input(struct chorus_comm *comm, struct op *op, const void *in,
                               size_t count, void **scaled) {
  *scaled = NULL;
  if (op->op.kind != CHORUS_PREMUL_SUM) return CHORUS_SUCCESS;
  size_t bytes = count * dtype_size(op->dtype);
  void *buf = malloc(bytes ? bytes : 1);
  if (!buf)
    return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: cannot allocate %zu bytes",
                          comm->rank, bytes);
  reduce_premul(buf, in, count, op->dtype, op->op.factor);
  *scaled = buf;
  return CHORUS_SUCCESS;
}

chorus_result_t step_run(struct chorus_comm *comm, struct op *op, struct step *s) {
  int idle = 0;
  for (;;) {
    int progressed = 0, pending = 0;
    for (int i = 0; i < s->ntx; i++) {
      if (s->tx[i].done) continue;
      CHECK(msg_tx_progress(&s->tx[i], &progressed));
      pending |= !s->tx[i].done;
    }
    for (int i = 0; i < s->nrx; i++) {
      if (s->rx[i].done || !s->rx[i].c) continue;
      CHECK(msg_rx_copy(&s->rx[i], s->rx_dst[i], &progressed));
      pending |= !s->rx[i].done;
    }
    if (!pending) return CHORUS_SUCCESS;
    if (progressed) idle = 0;
    CHECK(engine_poll(comm, op, &idle));
  }
}

chorus_result_t reduce_from_peers(struct chorus_comm *comm, struct op *op, struct msg_rx *rx,
                                  int nin, int self_pos, const void *own, void *out,
                                  size_t count, struct msg_tx *tx, int ntx) {
  const size_t es = dtype_size(op->dtype);
  const size_t total = count * es;
  const void **in = calloc((size_t)nin, sizeof(void *));
  if (!in) return CHORUS_ERR_NOMEM;
  chorus_op_kind_t kind = base_op(op->op.kind);
  size_t pos = 0;
  int idle = 0;
  chorus_result_t res = CHORUS_SUCCESS;
  for (;;) {
    int progressed = 0, pending = 0;
    for (int i = 0; i < ntx; i++) {
      if (tx[i].done) continue;
      CHECK_GOTO(msg_tx_progress(&tx[i], &progressed), res, out);
      pending |= !tx[i].done;
    }
    if (pos < total || total == 0) {
      /* bytes every contributor has ready, whole elements only */
      size_t avail = total - pos;
      int all_done = 1;
      for (int k = 0; k < nin; k++) {
        if (k == self_pos) continue;
        size_t n;
        CHECK_GOTO(msg_rx_peek(&rx[k], &in[k], &n), res, out);
        if (!rx[k].done) all_done = 0;
        if (n < avail) avail = n;
      }
      if (total == 0) {
        if (!all_done) pending = 1;
      } else {
        avail -= avail % es;
        if (avail > 0) {
          in[self_pos] = (const uint8_t *)own + pos;
          reduce_n((uint8_t *)out + pos, in, nin, avail / es, op->dtype, kind);
          for (int k = 0; k < nin; k++)
            if (k != self_pos) CHECK_GOTO(msg_rx_consume(&rx[k], avail), res, out);
          pos += avail;
          progressed = 1;
        }
        if (pos < total) pending = 1;
      }
    }
    if (pos == total && total > 0) {
      /* drain padding so the next message starts clean */
      for (int k = 0; k < nin; k++) {
        if (k == self_pos || rx[k].done) continue;
        const void *p;
        size_t n;
        CHECK_GOTO(msg_rx_peek(&rx[k], &p, &n), res, out);
        if (!rx[k].done) pending = 1;
      }
    }
    if (!pending) break;
    if (progressed) idle = 0;
    CHECK_GOTO(engine_poll(comm, op, &idle), res, out);
  }
out:
  free(in);
  return res;
}

const struct algo_desc algo_table[ALGO_COUNT] = {
    [ALGO_DIRECT] = {"direct",
                     {[OP_ALLREDUCE] = direct_allreduce,
                      [OP_BROADCAST] = direct_broadcast,
                      [OP_REDUCE] = direct_reduce,
                      [OP_ALLGATHER] = direct_allgatherv,
                      [OP_REDUCE_SCATTER] = direct_reduce_scatterv,
                      [OP_GATHER] = direct_gather,
                      [OP_SCATTER] = direct_scatter,
                      [OP_ALLTOALL] = direct_alltoallv,
                      [OP_BARRIER] = direct_barrier}},
    [ALGO_RING] = {"ring", {0}},
    [ALGO_TREE] = {"tree", {0}},
    [ALGO_RHD] = {"rhd", {0}},
    [ALGO_RD] = {"rd", {0}},
    [ALGO_BRUCK] = {"bruck", {0}},
    [ALGO_PAIRWISE] = {"pairwise", {0}},
    [ALGO_ONESHOT] = {"oneshot", {0}},
    [ALGO_TWOSHOT] = {"twoshot", {0}},
    [ALGO_HIER] = {"hier", {0}},
};

const char *algo_name(int id) {
  return id >= 0 && id < ALGO_COUNT ? algo_table[id].name : "unknown";
}

int algo_from_name(const char *name) {
  for (int i = 0; i < ALGO_COUNT; i++)
    if (strcmp(algo_table[i].name, name) == 0) return i;
  return -1;
}

chorus_result_t algo_run(struct chorus_comm *comm, struct op *op) {
  if ((unsigned)op->kind >= OP_BARRIER + 1)
    return comm_set_error(comm, CHORUS_ERR_INTERNAL, "rank %d: %s is not a collective",
                          comm->rank, op_kind_name(op->kind));
  int id = algo_select(comm, op); /* CHORUS_ALGO's choice where it can run, else the tuner */
  if (!algo_usable(comm, op, id)) id = ALGO_DIRECT;
  op->algo = id;
  return algo_table[id].run[op->kind](comm, op);
}
