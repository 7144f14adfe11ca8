/* coll.c - the public non-blocking entry points: argument checks (each failure a clear
 * CHORUS_ERR_INVALID with text in chorus_comm_error), then an op queued on the engine. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

static _Thread_local char arg_error[512];

#define ARG_FAIL(...)                                          \
  do {                                                         \
    snprintf(arg_error, sizeof arg_error, __VA_ARGS__);        \
    comm_set_error(NULL, CHORUS_ERR_INVALID, "%s", arg_error); \
    return CHORUS_ERR_INVALID;                                 \
  } while (0)

static chorus_result_t check_common(chorus_comm_t *comm, chorus_dtype_t dtype,
                                    chorus_request_t **req, const char *what) {
  if (!req) return CHORUS_ERR_INVALID;
  *req = NULL;
  if (!comm) ARG_FAIL("%s: communicator is NULL", what);
  if ((unsigned)dtype >= CHORUS_DTYPE_COUNT) ARG_FAIL("%s: invalid dtype %d", what, (int)dtype);
  if (atomic_load(&comm->failed)) {
    comm_set_error(NULL, comm->err, "%s", comm->errbuf);
    return comm->err != CHORUS_SUCCESS ? comm->err : CHORUS_ERR_ABORTED;
  }
  return CHORUS_SUCCESS;
}

static chorus_result_t check_op(chorus_dtype_t dtype, chorus_redop_t op, const char *what) {
  if ((unsigned)op.kind >= CHORUS_OP_COUNT) ARG_FAIL("%s: invalid reduce op %d", what, (int)op.kind);
  if (!reduce_op_supported(dtype, op.kind))
    ARG_FAIL("%s: reduce op %s is not defined for %s", what, chorus_op_name(op.kind),
             chorus_dtype_name(dtype));
  return CHORUS_SUCCESS;
}

static chorus_result_t check_root(chorus_comm_t *comm, int root, const char *what) {
  if (root < 0 || root >= comm->nranks)
    ARG_FAIL("%s: root %d is not a rank of this group (size %d)", what, root, comm->nranks);
  return CHORUS_SUCCESS;
}

static struct op *op_new(enum op_kind kind, const void *sendbuf, void *recvbuf, size_t count,
                         chorus_dtype_t dtype) {
  struct op *op = calloc(1, sizeof(*op));
  if (!op) return NULL;
  op->kind = kind;
  op->sendbuf = sendbuf;
  op->recvbuf = recvbuf;
  op->count = count;
  op->dtype = dtype;
  op->op.kind = CHORUS_SUM;
  op->op.factor = 1.0;
  return op;
}

static size_t *dup_counts(const size_t *src, int n) {
  size_t *d = malloc((size_t)(n > 0 ? n : 1) * sizeof(size_t));
  if (d && src) memcpy(d, src, (size_t)n * sizeof(size_t));
  return d;
}

static chorus_result_t submit(chorus_comm_t *comm, struct op *op, chorus_request_t **req) {
  if (!op) return CHORUS_ERR_NOMEM;
  cuda_tag_op(comm, op);
  return engine_submit(comm, op, req);
}

#define NEED_BUF(buf, bytes, what, name) \
  if (!(buf) && (bytes) > 0) ARG_FAIL("%s: %s is NULL", what, name)

chorus_result_t chorus_iallreduce(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                                  size_t count, chorus_dtype_t dtype, chorus_redop_t op,
                                  chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "all_reduce"));
  CHECK(check_op(dtype, op, "all_reduce"));
  NEED_BUF(sendbuf, count, "all_reduce", "sendbuf");
  NEED_BUF(recvbuf, count, "all_reduce", "recvbuf");
  struct op *o = op_new(OP_ALLREDUCE, sendbuf, recvbuf, count, dtype);
  if (o) o->op = op;
  return submit(comm, o, req);
}

chorus_result_t chorus_ibroadcast(chorus_comm_t *comm, void *buf, size_t count,
                                  chorus_dtype_t dtype, int root, chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "broadcast"));
  CHECK(check_root(comm, root, "broadcast"));
  NEED_BUF(buf, count, "broadcast", "buf");
  struct op *o = op_new(OP_BROADCAST, buf, buf, count, dtype);
  if (o) o->root = root;
  return submit(comm, o, req);
}

chorus_result_t chorus_ireduce(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                               size_t count, chorus_dtype_t dtype, chorus_redop_t op, int root,
                               chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "reduce"));
  CHECK(check_op(dtype, op, "reduce"));
  CHECK(check_root(comm, root, "reduce"));
  NEED_BUF(sendbuf, count, "reduce", "sendbuf");
  if (comm->rank == root) NEED_BUF(recvbuf, count, "reduce", "recvbuf");
  struct op *o = op_new(OP_REDUCE, sendbuf, recvbuf, count, dtype);
  if (o) {
    o->op = op;
    o->root = root;
  }
  return submit(comm, o, req);
}

chorus_result_t chorus_iallgatherv(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                                   const size_t *recvcounts, const size_t *displs,
                                   chorus_dtype_t dtype, chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "all_gather"));
  if (!recvcounts || !displs) ARG_FAIL("all_gather: recvcounts/displs are NULL");
  size_t total = 0;
  for (int p = 0; p < comm->nranks; p++) total += recvcounts[p];
  NEED_BUF(sendbuf, recvcounts[comm->rank], "all_gather", "sendbuf");
  NEED_BUF(recvbuf, total, "all_gather", "recvbuf");
  struct op *o = op_new(OP_ALLGATHER, sendbuf, recvbuf, total, dtype);
  if (o) {
    o->counts = dup_counts(recvcounts, comm->nranks);
    o->displs = dup_counts(displs, comm->nranks);
    if (!o->counts || !o->displs) {
      free(o->counts);
      free(o->displs);
      free(o);
      return CHORUS_ERR_NOMEM;
    }
  }
  return submit(comm, o, req);
}

chorus_result_t chorus_iallgather(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                                  size_t sendcount, chorus_dtype_t dtype,
                                  chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "all_gather"));
  int n = comm->nranks;
  size_t *c = malloc((size_t)n * sizeof(size_t)), *d = malloc((size_t)n * sizeof(size_t));
  if (!c || !d) {
    free(c);
    free(d);
    return CHORUS_ERR_NOMEM;
  }
  for (int p = 0; p < n; p++) {
    c[p] = sendcount;
    d[p] = sendcount * (size_t)p;
  }
  chorus_result_t res = chorus_iallgatherv(comm, sendbuf, recvbuf, c, d, dtype, req);
  free(c);
  free(d);
  return res;
}

chorus_result_t chorus_ireduce_scatterv(chorus_comm_t *comm, const void *sendbuf,
                                        void *recvbuf, const size_t *recvcounts,
                                        chorus_dtype_t dtype, chorus_redop_t op,
                                        chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "reduce_scatter"));
  CHECK(check_op(dtype, op, "reduce_scatter"));
  if (!recvcounts) ARG_FAIL("reduce_scatter: recvcounts is NULL");
  size_t total = 0;
  for (int p = 0; p < comm->nranks; p++) total += recvcounts[p];
  NEED_BUF(sendbuf, total, "reduce_scatter", "sendbuf");
  NEED_BUF(recvbuf, recvcounts[comm->rank], "reduce_scatter", "recvbuf");
  struct op *o = op_new(OP_REDUCE_SCATTER, sendbuf, recvbuf, total, dtype);
  if (o) {
    o->op = op;
    o->counts = dup_counts(recvcounts, comm->nranks);
    if (!o->counts) {
      free(o);
      return CHORUS_ERR_NOMEM;
    }
  }
  return submit(comm, o, req);
}

chorus_result_t chorus_ireduce_scatter(chorus_comm_t *comm, const void *sendbuf,
                                       void *recvbuf, size_t recvcount, chorus_dtype_t dtype,
                                       chorus_redop_t op, chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "reduce_scatter"));
  size_t *c = malloc((size_t)comm->nranks * sizeof(size_t));
  if (!c) return CHORUS_ERR_NOMEM;
  for (int p = 0; p < comm->nranks; p++) c[p] = recvcount;
  chorus_result_t res = chorus_ireduce_scatterv(comm, sendbuf, recvbuf, c, dtype, op, req);
  free(c);
  return res;
}

chorus_result_t chorus_igather(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                               size_t count, chorus_dtype_t dtype, int root,
                               chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "gather"));
  CHECK(check_root(comm, root, "gather"));
  NEED_BUF(sendbuf, count, "gather", "sendbuf");
  if (comm->rank == root) NEED_BUF(recvbuf, count, "gather", "recvbuf");
  struct op *o = op_new(OP_GATHER, sendbuf, recvbuf, count, dtype);
  if (o) o->root = root;
  return submit(comm, o, req);
}

chorus_result_t chorus_iscatter(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                                size_t count, chorus_dtype_t dtype, int root,
                                chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "scatter"));
  CHECK(check_root(comm, root, "scatter"));
  NEED_BUF(recvbuf, count, "scatter", "recvbuf");
  if (comm->rank == root) NEED_BUF(sendbuf, count, "scatter", "sendbuf");
  struct op *o = op_new(OP_SCATTER, sendbuf, recvbuf, count, dtype);
  if (o) o->root = root;
  return submit(comm, o, req);
}

/* uniform: issued through chorus_ialltoall, so every rank sends and receives equal counts
 * (a fact the tuner may use; per-peer counts of an alltoallv differ between ranks). */
static chorus_result_t alltoallv_submit(chorus_comm_t *comm, const void *sendbuf,
                                        const size_t *sendcounts, const size_t *sdispls,
                                        void *recvbuf, const size_t *recvcounts,
                                        const size_t *rdispls, chorus_dtype_t dtype,
                                        int uniform, chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "all_to_all"));
  if (!sendcounts || !sdispls || !recvcounts || !rdispls)
    ARG_FAIL("all_to_all: count or displacement arrays are NULL");
  size_t st = 0, rt = 0;
  for (int p = 0; p < comm->nranks; p++) {
    st += sendcounts[p];
    rt += recvcounts[p];
  }
  NEED_BUF(sendbuf, st, "all_to_all", "sendbuf");
  NEED_BUF(recvbuf, rt, "all_to_all", "recvbuf");
  struct op *o = op_new(OP_ALLTOALL, sendbuf, recvbuf, 0, dtype);
  if (o) {
    int n = comm->nranks;
    o->uniform = uniform;
    o->counts = dup_counts(sendcounts, n);
    o->displs = dup_counts(sdispls, n);
    o->counts2 = dup_counts(recvcounts, n);
    o->displs2 = dup_counts(rdispls, n);
    if (!o->counts || !o->displs || !o->counts2 || !o->displs2) {
      free(o->counts);
      free(o->displs);
      free(o->counts2);
      free(o->displs2);
      free(o);
      return CHORUS_ERR_NOMEM;
    }
  }
  return submit(comm, o, req);
}

chorus_result_t chorus_ialltoallv(chorus_comm_t *comm, const void *sendbuf,
                                  const size_t *sendcounts, const size_t *sdispls,
                                  void *recvbuf, const size_t *recvcounts,
                                  const size_t *rdispls, chorus_dtype_t dtype,
                                  chorus_request_t **req) {
  return alltoallv_submit(comm, sendbuf, sendcounts, sdispls, recvbuf, recvcounts, rdispls,
                          dtype, 0, req);
}

chorus_result_t chorus_ialltoall(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                                 size_t count, chorus_dtype_t dtype, chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "all_to_all"));
  int n = comm->nranks;
  size_t *c = malloc((size_t)n * sizeof(size_t)), *d = malloc((size_t)n * sizeof(size_t));
  if (!c || !d) {
    free(c);
    free(d);
    return CHORUS_ERR_NOMEM;
  }
  for (int p = 0; p < n; p++) {
    c[p] = count;
    d[p] = count * (size_t)p;
  }
  chorus_result_t res = alltoallv_submit(comm, sendbuf, c, d, recvbuf, c, d, dtype, 1, req);
  free(c);
  free(d);
  return res;
}

chorus_result_t chorus_ibarrier(chorus_comm_t *comm, chorus_request_t **req) {
  CHECK(check_common(comm, CHORUS_UINT8, req, "barrier"));
  return submit(comm, op_new(OP_BARRIER, NULL, NULL, 0, CHORUS_UINT8), req);
}

static chorus_result_t check_peer(chorus_comm_t *comm, int peer, int any_ok, const char *what) {
  if (any_ok && peer == CHORUS_ANY_SOURCE) return CHORUS_SUCCESS;
  if (peer < 0 || peer >= comm->nranks)
    ARG_FAIL("%s: peer %d is not a rank of this group (size %d)", what, peer, comm->nranks);
  if (peer == comm->rank) ARG_FAIL("%s: peer %d is this rank itself", what, peer);
  return CHORUS_SUCCESS;
}

chorus_result_t chorus_isend(chorus_comm_t *comm, const void *buf, size_t count,
                             chorus_dtype_t dtype, int peer, int tag, chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "send"));
  CHECK(check_peer(comm, peer, 0, "send"));
  NEED_BUF(buf, count, "send", "buf");
  struct op *o = op_new(OP_SEND, buf, NULL, count, dtype);
  if (o) {
    o->root = peer;
    o->tag = tag;
  }
  return submit(comm, o, req);
}

chorus_result_t chorus_irecv(chorus_comm_t *comm, void *buf, size_t count,
                             chorus_dtype_t dtype, int peer, int tag, chorus_request_t **req) {
  CHECK(check_common(comm, dtype, req, "recv"));
  CHECK(check_peer(comm, peer, 1, "recv"));
  NEED_BUF(buf, count, "recv", "buf");
  struct op *o = op_new(OP_RECV, NULL, buf, count, dtype);
  if (o) {
    o->root = peer;
    o->tag = tag;
  }
  return submit(comm, o, req);
}
