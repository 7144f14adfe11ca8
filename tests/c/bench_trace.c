/* bench_trace.c - what the flight recorder adds to one operation on the engine thread: the
 * calls the engine makes per collective (queue stamp, record, algorithm, end), in a loop on a
 * communicator with the default ring (CHORUS_TRACE_BUFFER_SIZE) and on one without, and the
 * difference per operation in nanoseconds. No other thread; the ring is larger than the
 * caches only if the buffer size makes it so. Usage: bench_trace [ITERS] (default 10000000). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

static double run(struct chorus_comm *comm, long iters) {
  struct op op;
  memset(&op, 0, sizeof op);
  op.kind = OP_ALLREDUCE;
  op.count = 2;
  op.dtype = CHORUS_FLOAT32;
  op.op.kind = CHORUS_SUM;
  int64_t t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    /* engine_submit stamps the queue time only when the recorder is on */
    if (comm->trace) op.t_queued = now_ns();
    op.seq = (uint64_t)i;
    int64_t start = now_ns(); /* the engine reads the clock here anyway (the deadline) */
    trace_op_begin(comm, &op, start);
    op.algo = 0;
    trace_op_algo(comm, &op);
    trace_op_end(comm, &op, CHORUS_SUCCESS);
  }
  return (double)(now_ns() - t0) / (double)iters;
}

int main(int argc, char **argv) {
  long iters = argc > 1 ? atol(argv[1]) : 10000000L;
  struct chorus_comm *on = calloc(1, sizeof(*on)), *off = calloc(1, sizeof(*off));
  if (!on || !off) return 1;
  on->nranks = off->nranks = 4;
  pthread_mutex_init(&on->err_mu, NULL);
  if (trace_init(on) != CHORUS_SUCCESS || !on->trace) {
    fprintf(stderr, "trace_init failed (CHORUS_TRACE_BUFFER_SIZE=0?)\n");
    return 1;
  }
  double best_on = 1e9, best_off = 1e9;
  for (int round = 0; round < 5; round++) {
    double a = run(on, iters), b = run(off, iters);
    if (a < best_on) best_on = a;
    if (b < best_off) best_off = b;
  }
  printf("per operation: %.1f ns with the recorder (%lld entries), %.1f ns without: "
         "the recorder adds %.1f ns\n", best_on, (long long)param_int(PARAM_TRACE_BUFFER_SIZE),
         best_off, best_on - best_off);
  trace_fini(on);
  free(on);
  free(off);
  return 0;
}
