/* cuda.c - operations on CUDA device memory. The caller's stream order is kept with an
 * event (chorus_cuda_begin): the communicator's own stream waits for it, so the caller never
 * blocks. Collectives then take one of three paths, the same decision on every rank:
 *   same GPU: every rank of the communicator is on this host and on one GPU. The lowest
 *     rank (the executor) runs each collective alone, straight on every rank's buffers,
 *     which it maps through CUDA IPC (a cache keyed by allocation). Ranks post descriptors
 *     of their buffers through host shared memory (shm_delegate); each records an IPC event
 *     after the caller's work, the executor's stream waits for all of them, runs one kernel
 *     (all_reduce: every input read once, every output written once) and records its own
 *     IPC event, which every rank's stream then waits for. Nothing waits for the GPU on
 *     the host, and only one process launches kernels, so ranks that share a GPU do not
 *     time-slice kernels against each other.
 *   CUDA IPC scratch: every rank is on this host (different GPUs, or CHORUS_CUDA_SAME_GPU=0).
 *     Each rank owns a device scratch area of two halves that all peers map
 *     (cudaIpcOpenMemHandle), and the direct-access algorithms of algo/shm_direct.c run over
 *     it with device copies and the reduction kernels (kernels/reduce.cu). Ranks
 *     synchronise through the host: the engine drains its stream, then raises the same
 *     shared-memory flags the host algorithms use. No kernel ever spins on another
 *     process's memory.
 *   staged: the data goes through pinned host memory and the host algorithms (between hosts,
 *     with CHORUS_CUDA_IPC=0, or where peers cannot map each other).
 * Point-to-point messages are always staged. Without CHORUS_WITH_CUDA only the entry points
 * remain: chorus_cuda_begin refuses, so no op is ever on a device. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algo/algo.h"
#include "core.h"

/* The calling thread's chorus_cuda_begin scope. */
static _Thread_local struct {
  chorus_comm_t *comm;
  int device;
  void *event, *end_event;
} scope;

static void cuda_prepare(struct chorus_comm *comm, const struct op *op);

void cuda_tag_op(struct chorus_comm *comm, struct op *op) {
  if (scope.comm != comm || op->kind == OP_BARRIER) return;
  op->on_device = 1;
  op->device = scope.device;
  op->start_event = scope.event;
  op->end_event = scope.end_event;
  cuda_prepare(comm, op);
}

#ifndef CHORUS_WITH_CUDA

static void cuda_prepare(struct chorus_comm *comm, const struct op *op) {
  (void)comm;
  (void)op;
}

int chorus_cuda_built(void) { return 0; }
int chorus_cuda_preload(int device, int make_context) {
  (void)device;
  (void)make_context;
  return 0;
}

chorus_result_t chorus_cuda_begin(chorus_comm_t *comm, int device, void *event,
                                  void *end_event) {
  (void)comm;
  (void)device;
  (void)event;
  (void)end_event;
  comm_set_error(NULL, CHORUS_ERR_UNSUPPORTED,
                 "this build of chorus has no CUDA support (built without CUDA)");
  return CHORUS_ERR_UNSUPPORTED;
}

chorus_result_t chorus_cuda_end(chorus_comm_t *comm) {
  (void)comm;
  return CHORUS_ERR_UNSUPPORTED;
}

static chorus_result_t no_cuda(struct chorus_comm *comm) {
  return comm_set_error(comm, CHORUS_ERR_UNSUPPORTED, "rank %d: device operation in a build "
                        "without CUDA", comm->rank);
}
chorus_result_t cuda_run(struct chorus_comm *comm, struct op *op) {
  (void)op;
  return no_cuda(comm);
}
chorus_result_t cuda_p2p_send_ready(struct chorus_comm *comm, struct op *op, int *ready) {
  (void)op;
  *ready = 0;
  return no_cuda(comm);
}
chorus_result_t cuda_p2p_recv_begin(struct chorus_comm *comm, struct op *op) {
  (void)op;
  return no_cuda(comm);
}
chorus_result_t cuda_p2p_recv_end(struct chorus_comm *comm, struct op *op) {
  (void)op;
  return no_cuda(comm);
}
void cuda_p2p_release(struct chorus_comm *comm, struct op *op) {
  (void)comm;
  (void)op;
}
void cuda_teardown(struct chorus_comm *comm) { (void)comm; }
size_t cuda_scratch_half(const struct chorus_comm *comm) {
  (void)comm;
  return 0;
}
void *cuda_scratch(struct chorus_comm *comm, int local, int half) {
  (void)comm;
  (void)local;
  (void)half;
  return NULL;
}
chorus_result_t cuda_copy(struct chorus_comm *comm, void *dst, const void *src, size_t bytes) {
  (void)dst;
  (void)src;
  (void)bytes;
  return no_cuda(comm);
}
chorus_result_t cuda_reduce(struct chorus_comm *comm, void *out, const void *const *in, int n,
                            size_t count, chorus_dtype_t dtype, chorus_op_kind_t kind,
                            int divisor) {
  (void)out;
  (void)in;
  (void)n;
  (void)count;
  (void)dtype;
  (void)kind;
  (void)divisor;
  return no_cuda(comm);
}
chorus_result_t cuda_premul(struct chorus_comm *comm, void *out, const void *in, size_t count,
                            chorus_dtype_t dtype, double factor) {
  (void)out;
  (void)in;
  (void)count;
  (void)dtype;
  (void)factor;
  return no_cuda(comm);
}
chorus_result_t cuda_drain(struct chorus_comm *comm, struct op *op) {
  (void)op;
  return no_cuda(comm);
}

#else /* CHORUS_WITH_CUDA */

#include <cuda.h> /* types of cuPointerGetAttributes, reached through the runtime */
#include <cuda_runtime_api.h>

#include "cuda_kernels.h"

/* all_reduce up to this size reduces every input on every rank (one synchronisation);
 * above it each rank reduces its slice and gathers the others (two). */
#define CUDA_ONESHOT_MAX ((size_t)256 << 10)
/* How long destroy waits for peers to finish reading this rank's scratch. */
#define TEARDOWN_WAIT_MS 2000

struct cuda_state {
  int device;
  cudaStream_t stream;   /* collectives */
  cudaStream_t p2p;      /* staging copies of point-to-point messages */
  int ipc_tried, ipc_ok;
  uint8_t *scratch;      /* this rank's two halves */
  size_t half;
  uint8_t **peer;        /* [local rank] -> mapped scratch (own included), NULL if unmapped */
  void *pinned;          /* staging of the staged path: CUDA_SCRATCH bytes, made at first use */
  size_t pinned_cap;
  int pinned_tried;
  void *big;             /* pageable staging for what does not fit in `pinned` */
  size_t big_cap;
  _Atomic int ready;     /* setup done: no call from now on synchronises the device */
  /* same GPU (every rank on this one device): the executor runs every eligible collective */
  int same_gpu;
  cudaEvent_t ev_mine;   /* IPC event: this rank's inputs ready / the executor's work done */
  cudaEvent_t *ev_peer;  /* [rank] -> the peer's IPC event opened here (own: ev_mine) */
  struct sg_export *exports; /* rank side: IPC handles of this rank's allocations */
  struct sg_import *imports; /* executor: peers' allocations mapped here */
  uint64_t use_clock;    /* LRU clock of both caches */
  uint64_t n_sg[4], ns_sg[4], n_sg_fallback;
  /* of ns_sg: waiting for the caller's event, the executor's run (sg_run), its drain */
  uint64_t ns_sg_ready[4], n_sg_run[4], ns_sg_run[4], ns_sg_drain[4];
  /* cuPointerGetAttributes, found through the runtime (no link against libcuda) */
  CUresult (*get_attrs)(unsigned, CUpointer_attribute *, void **, CUdeviceptr);
  /* where the time of device collectives goes, per size class (bytes <= 4K, 64K, 1M, more),
   * logged at teardown (INFO) */
  uint64_t n_staged[4], ns_in[4], ns_host[4], ns_out[4]; /* to the host, host algo, back */
  uint64_t n_ipc[4], ns_ipc[4];
};

static int size_class(size_t bytes) {
  return bytes <= 4096 ? 0 : bytes <= 65536 ? 1 : bytes <= (1 << 20) ? 2 : 3;
}

int chorus_cuda_built(void) { return 1; }

/* ------------------------------------------------------------------ kernel preload */
#define PRELOAD_DEVICES 64
static _Atomic int preloaded[PRELOAD_DEVICES]; /* 1: kernels loaded in that device's context */
static pthread_mutex_t preload_mu = PTHREAD_MUTEX_INITIALIZER;

/* A driver function, found through the runtime (no link against libcuda); NULL if absent. */
static void *driver_fn(const char *name) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return NULL;
  }
  return fn;
}

/* make_context: the caller knows a context exists (it holds memory on the device) or may
 * make one */
int chorus_cuda_preload(int device, int make_context) {
  int old = -1;
  if (cudaGetDevice(&old) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  if (device < 0) device = old;
  if (device < 0 || device >= PRELOAD_DEVICES) return 0;
  if (atomic_load(&preloaded[device])) return 0;
  if (!make_context) {
    /* no context made here: a process that never uses this device keeps none there */
    CUresult (*get_state)(CUdevice, unsigned *, int *) =
        (CUresult(*)(CUdevice, unsigned *, int *))driver_fn("cuDevicePrimaryCtxGetState");
    unsigned flags = 0;
    int active = 0;
    if (!get_state || get_state((CUdevice)device, &flags, &active) != CUDA_SUCCESS || !active)
      return 0;
  }
  pthread_mutex_lock(&preload_mu);
  int loaded = 0, res = 0;
  if (!atomic_load(&preloaded[device])) {
    const int64_t t0 = now_ns();
    if (device != old && cudaSetDevice(device) != cudaSuccess) {
      res = -1;
    } else {
      res = chorus_cuda_load_kernels(&loaded) == 0 ? loaded : -1;
      if (device != old) cudaSetDevice(old);
    }
    if (res < 0) {
      cudaGetLastError();
      INFO(SUB_INIT, -1, "cuda: loading the kernels on cuda:%d failed (the first launch will "
           "report it)", device);
    } else {
      atomic_store(&preloaded[device], 1);
      INFO(SUB_INIT, -1, "cuda: %d kernels loaded on cuda:%d in %.1f ms", loaded, device,
           (double)(now_ns() - t0) / 1e6);
    }
  }
  pthread_mutex_unlock(&preload_mu);
  return res;
}

/* Calls that may wait for the whole device (cudaFree, cudaFreeHost, cudaHostAlloc, the IPC
 * calls) stall whichever thread makes them behind whatever the GPU runs (a caller's long
 * kernel). The streams, IPC events and scratch are made in cuda_prepare, on the thread that
 * submits the first device operation (and the first device collective); the pinned staging
 * buffer at the first staged collective and the same-GPU buffer mappings at a buffer's
 * first use, both on the engine thread, where they only delay that op; the rest at teardown.
 * No stream ever waits for something the host has yet to do: every event a stream waits on
 * was recorded before the wait was queued, so none of these calls can deadlock. */
chorus_result_t chorus_cuda_begin(chorus_comm_t *comm, int device, void *event,
                                  void *end_event) {
  if (!comm) {
    comm_set_error(NULL, CHORUS_ERR_INVALID, "chorus_cuda_begin: communicator is NULL");
    return CHORUS_ERR_INVALID;
  }
  if (scope.comm) {
    comm_set_error(NULL, CHORUS_ERR_INVALID, "chorus_cuda_begin: already inside a scope on "
                   "this thread (rank %d)", comm->rank);
    return CHORUS_ERR_INVALID;
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || device < 0 || device >= ndev) {
    comm_set_error(NULL, CHORUS_ERR_INVALID, "chorus_cuda_begin: rank %d: no CUDA device %d "
                   "(%d visible)", comm->rank, device, ndev);
    return CHORUS_ERR_INVALID;
  }
  if (comm->cuda && comm->cuda->device != device) {
    comm_set_error(NULL, CHORUS_ERR_INVALID, "rank %d: this communicator serves cuda:%d; "
                   "tensors on cuda:%d need a group of their own", comm->rank,
                   comm->cuda->device, device);
    return CHORUS_ERR_INVALID;
  }
  scope.comm = comm;
  scope.device = device;
  scope.event = event;
  scope.end_event = end_event;
  return CHORUS_SUCCESS;
}

chorus_result_t chorus_cuda_end(chorus_comm_t *comm) {
  if (scope.comm != comm) return CHORUS_ERR_INVALID;
  scope.comm = NULL;
  scope.event = NULL;
  scope.end_event = NULL;
  return CHORUS_SUCCESS;
}

static chorus_result_t cuda_fail(struct chorus_comm *comm, const struct op *op, cudaError_t e,
                                 const char *what) {
  char d[200];
  op_describe(op, d, sizeof d);
  return comm_set_error(comm, CHORUS_ERR_SYSTEM, "%s on rank %d: %s failed: %s (%s)", d,
                        comm->rank, what, cudaGetErrorName(e), cudaGetErrorString(e));
}
#define CU(comm, op, call, what)                                      \
  do {                                                                \
    cudaError_t e_ = (call);                                          \
    if (e_ != cudaSuccess) return cuda_fail((comm), (op), e_, what);  \
  } while (0)

/* The communicator's CUDA state, as the engine thread sees it: made by cuda_prepare on the
 * submitting thread before the first device operation was queued. */
static chorus_result_t state_get(struct chorus_comm *comm, const struct op *op,
                                 struct cuda_state **out) {
  static _Thread_local int thread_device = -1;
  struct cuda_state *st = comm->cuda;
  if (!st || !atomic_load(&st->ready)) {
    char d[200];
    op_describe(op, d, sizeof d);
    return comm_set_error(comm, CHORUS_ERR_SYSTEM, "%s on rank %d: the communicator's CUDA "
                          "setup failed (see the first error)", d, comm->rank);
  }
  if (st->device != op->device)
    return comm_set_error(comm, CHORUS_ERR_INVALID, "rank %d: this communicator serves "
                          "cuda:%d; an operation on cuda:%d needs a group of its own",
                          comm->rank, st->device, op->device);
  if (thread_device != st->device) {
    CU(comm, op, cudaSetDevice(st->device), "cudaSetDevice");
    thread_device = st->device;
  }
  *out = st;
  return CHORUS_SUCCESS;
}

/* ------------------------------------------------------------------ CUDA IPC setup */
/* the same-GPU caches (see "same GPU" below) */
#define SG_EXPORTS 16
#define SG_IMPORTS 64
struct sg_export {
  uint64_t id, last;
  cudaIpcMemHandle_t h;
};
struct sg_import {
  int rank;
  uint64_t id, last;
  uint8_t *base;
  size_t size;
};

static void sg_release(struct cuda_state *st);
struct ipc_card {
  int32_t ok;       /* scratch allocated and exported */
  int32_t device;
  cudaIpcMemHandle_t handle;
};
struct gpu_card {
  int32_t ev_ok;    /* IPC event made and exported, pointer attributes readable */
  int32_t device;
  unsigned char uuid[16]; /* which GPU (a MIG instance has its own) */
  cudaIpcEventHandle_t event;
};

static void ipc_release(struct cuda_state *st, int nlocal, int me) {
  for (int l = 0; l < nlocal; l++)
    if (st->peer[l] && l != me) cudaIpcCloseMemHandle(st->peer[l]);
  memset(st->peer, 0, (size_t)nlocal * sizeof(uint8_t *));
  if (st->scratch) cudaFree(st->scratch);
  st->scratch = NULL;
  st->ipc_ok = 0;
}

static void events_release(struct cuda_state *st, int nranks) {
  if (st->ev_peer)
    for (int p = 0; p < nranks; p++)
      if (st->ev_peer[p] && st->ev_peer[p] != st->ev_mine) cudaEventDestroy(st->ev_peer[p]);
  free(st->ev_peer);
  st->ev_peer = NULL;
  if (st->ev_mine) cudaEventDestroy(st->ev_mine);
  st->ev_mine = NULL;
  st->same_gpu = 0;
}

/* How this rank reaches the device of a peer, for the log. */
static const char *link_name(int mine, int theirs) {
  if (mine == theirs) return "same GPU";
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, mine, theirs) != cudaSuccess || !can) return "no P2P";
  return "P2P";
}

/* *all = 1 on every rank iff `mine` is nonzero on every rank (oks: nranks entries). */
static chorus_result_t agree(struct chorus_comm *comm, const char *key, int32_t mine,
                             int32_t *oks, int *all) {
  CHECK(bs_allgather(comm, key, &mine, oks, sizeof mine));
  *all = 1;
  for (int p = 0; p < comm->nranks; p++)
    if (!oks[p]) *all = 0;
  return CHORUS_SUCCESS;
}

/* Collective over the communicator: are all ranks on one GPU? Each makes and exports an
 * IPC event, opens everyone else's, and all agree (st->same_gpu). No call here waits for
 * the device, so the first collective behind a long kernel does not hold the caller. */
static chorus_result_t same_gpu_setup(struct chorus_comm *comm, struct cuda_state *st) {
  struct gpu_card mine;
  memset(&mine, 0, sizeof mine);
  mine.device = st->device;
  if (!param_int(PARAM_CUDA_SAME_GPU)) return CHORUS_SUCCESS;
  struct cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, st->device) == cudaSuccess &&
      cudaEventCreateWithFlags(&st->ev_mine, cudaEventDisableTiming | cudaEventInterprocess) ==
          cudaSuccess &&
      cudaIpcGetEventHandle(&mine.event, st->ev_mine) == cudaSuccess) {
    memcpy(mine.uuid, prop.uuid.bytes, sizeof mine.uuid);
    void *fn = driver_fn("cuPointerGetAttributes");
    st->exports = calloc(SG_EXPORTS, sizeof *st->exports);
    st->imports = calloc(SG_IMPORTS, sizeof *st->imports);
    if (fn && st->exports && st->imports) {
      st->get_attrs = (CUresult(*)(unsigned, CUpointer_attribute *, void **, CUdeviceptr))fn;
      mine.ev_ok = 1;
    }
  }
  cudaGetLastError(); /* a failure above is reported through the agreement, not later */
  struct gpu_card *all = calloc((size_t)comm->nranks, sizeof *all);
  int32_t *oks = calloc((size_t)comm->nranks, sizeof *oks);
  st->ev_peer = calloc((size_t)comm->nranks, sizeof *st->ev_peer);
  chorus_result_t res = CHORUS_SUCCESS;
  if (!all || !oks || !st->ev_peer) {
    res = comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", comm->rank);
    goto out;
  }
  CHECK_GOTO(bs_allgather(comm, "cuda-gpu", &mine, all, sizeof mine), res, out);
  int32_t same = 1;
  for (int p = 0; p < comm->nranks; p++)
    if (!all[p].ev_ok || memcmp(all[p].uuid, mine.uuid, sizeof mine.uuid)) same = 0;
  for (int p = 0; same && p < comm->nranks; p++) {
    if (p == comm->rank) continue;
    if (cudaIpcOpenEventHandle(&st->ev_peer[p], all[p].event) != cudaSuccess) {
      cudaGetLastError();
      st->ev_peer[p] = NULL;
      INFO(SUB_TRANSPORT, comm->rank, "cuda: cannot open the IPC event of rank %d", p);
      same = 0;
    }
  }
  st->ev_peer[comm->rank] = st->ev_mine;
  CHECK_GOTO(agree(comm, "cuda-gpu-ok", same, oks, &st->same_gpu), res, out);
  if (st->same_gpu)
    INFO(SUB_TRANSPORT, comm->rank, "cuda: all %d ranks on one GPU (cuda:%d here): rank %d "
         "runs device collectives on every rank's buffers through CUDA IPC", comm->nranks,
         st->device, 0);
out:
  if (!st->same_gpu) {
    events_release(st, comm->nranks);
    sg_release(st);
  }
  free(all);
  free(oks);
  return res;
}

/* Collective over the communicator (every rank reaches it at the same device collective):
 * all ranks on one GPU (same_gpu_setup), or else allocate and export the scratch, map every
 * peer's, and agree whether all of it worked. */
static chorus_result_t ipc_setup(struct chorus_comm *comm, struct cuda_state *st,
                                 const struct op *op) {
  st->ipc_tried = 1;
  const int me = comm->local_rank_of[comm->rank];
  if (!comm->shm || comm->nlocal != comm->nranks || comm->nranks < 2 ||
      comm->nranks > CUDA_REDUCE_MAX_IN || !param_int(PARAM_CUDA_IPC)) {
    INFO(SUB_TRANSPORT, comm->rank, "cuda: device collectives staged through host memory (%s)",
         !param_int(PARAM_CUDA_IPC) ? "CHORUS_CUDA_IPC=0"
         : comm->nranks < 2         ? "one rank"
         : comm->nlocal != comm->nranks ? "ranks on several hosts"
         : !comm->shm               ? "shared memory disabled"
                                    : "more ranks than one reduction reads");
    return CHORUS_SUCCESS;
  }
  CHECK(same_gpu_setup(comm, st));
  /* on one GPU, what the executor does not run is staged: no scratch (its cudaMalloc and
   * IPC mappings may wait for the device) */
  if (st->same_gpu) return CHORUS_SUCCESS;
  int64_t total = param_int(PARAM_CUDA_SCRATCH);
  st->half = (size_t)(total > 0 ? total : 0) / 2;
  st->half -= st->half % 4096;
  struct ipc_card mine;
  memset(&mine, 0, sizeof mine);
  mine.device = st->device;
  if (st->half >= 4096 && cudaMalloc((void **)&st->scratch, 2 * st->half) == cudaSuccess &&
      cudaIpcGetMemHandle(&mine.handle, st->scratch) == cudaSuccess)
    mine.ok = 1;
  cudaGetLastError(); /* a failure above is reported through the agreement, not later */
  struct ipc_card *all = calloc((size_t)comm->nranks, sizeof *all);
  int32_t *oks = calloc((size_t)comm->nranks, sizeof *oks);
  chorus_result_t res = CHORUS_SUCCESS;
  if (!all || !oks) {
    res = comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", comm->rank);
    goto out;
  }
  CHECK_GOTO(bs_allgather(comm, "cuda-ipc", &mine, all, sizeof mine), res, out);
  int32_t ok = 1;
  char links[256] = "";
  size_t used = 0;
  for (int p = 0; p < comm->nranks; p++)
    if (!all[p].ok) ok = 0;
  for (int p = 0; p < comm->nranks && ok; p++) {
    if (p == comm->rank) continue;
    void *ptr = NULL;
    if (cudaIpcOpenMemHandle(&ptr, all[p].handle, cudaIpcMemLazyEnablePeerAccess) !=
        cudaSuccess) {
      cudaGetLastError();
      INFO(SUB_TRANSPORT, comm->rank, "cuda: cannot map the scratch of rank %d (cuda:%d, %s)",
           p, all[p].device, link_name(st->device, all[p].device));
      ok = 0;
      continue;
    }
    st->peer[comm->local_rank_of[p]] = ptr;
    if (used + 40 < sizeof links)
      used += (size_t)snprintf(links + used, sizeof links - used, "%s%d:%s", used ? " " : "", p,
                               link_name(st->device, all[p].device));
  }
  st->peer[me] = st->scratch;
  CHECK_GOTO(agree(comm, "cuda-ipc-ok", ok, oks, &st->ipc_ok), res, out);
  if (st->ipc_ok)
    INFO(SUB_TRANSPORT, comm->rank, "cuda: rank %d on cuda:%d maps %d peers through CUDA IPC "
         "(%s), scratch 2 x %zu bytes", comm->rank, st->device, comm->nranks - 1, links,
         st->half);
  else
    INFO(SUB_TRANSPORT, comm->rank, "cuda: a rank cannot map its peers' memory: device "
         "collectives staged through host memory");
out:
  if (!st->ipc_ok) ipc_release(st, comm->nlocal, me);
  free(all);
  free(oks);
  (void)op;
  return res;
}

/* ------------------------------------------------------------------ pieces for shm_direct */
size_t cuda_scratch_half(const struct chorus_comm *comm) {
  return comm->cuda && comm->cuda->ipc_ok ? comm->cuda->half : 0;
}

void *cuda_scratch(struct chorus_comm *comm, int local, int half) {
  return comm->cuda->peer[local] + (size_t)half * comm->cuda->half;
}

chorus_result_t cuda_copy(struct chorus_comm *comm, void *dst, const void *src, size_t bytes) {
  if (!bytes) return CHORUS_SUCCESS;
  CU(comm, comm->current, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault,
                                          comm->cuda->stream), "cudaMemcpyAsync");
  return CHORUS_SUCCESS;
}

chorus_result_t cuda_reduce(struct chorus_comm *comm, void *out, const void *const *in, int n,
                            size_t count, chorus_dtype_t dtype, chorus_op_kind_t kind,
                            int divisor) {
  cudaError_t e = (cudaError_t)chorus_cuda_reduce(out, in, n, count, dtype, kind, divisor,
                                                  comm->cuda->stream);
  if (e != cudaSuccess) return cuda_fail(comm, comm->current, e, "reduction kernel");
  return CHORUS_SUCCESS;
}

chorus_result_t cuda_premul(struct chorus_comm *comm, void *out, const void *in, size_t count,
                            chorus_dtype_t dtype, double factor) {
  cudaError_t e = (cudaError_t)chorus_cuda_premul(out, in, count, dtype, factor,
                                                  comm->cuda->stream);
  if (e != cudaSuccess) return cuda_fail(comm, comm->current, e, "premul kernel");
  return CHORUS_SUCCESS;
}

static chorus_result_t drain_stream(struct chorus_comm *comm, struct op *op, cudaStream_t s) {
  int idle = 0;
  for (;;) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return CHORUS_SUCCESS;
    if (e != cudaErrorNotReady) return cuda_fail(comm, op, e, "device work");
    CHECK(engine_poll_device(comm, op, &idle));
  }
}

chorus_result_t cuda_drain(struct chorus_comm *comm, struct op *op) {
  return drain_stream(comm, op, comm->cuda->stream);
}

/* ------------------------------------------------------------------ the staged path */
/* The pinned buffer is made at the first staged collective; bigger staging uses pageable
 * memory, grown with realloc (no CUDA call): copies from and to it are slower but never
 * wait for the device. */
static chorus_result_t staging_nomem(struct chorus_comm *comm, const struct op *op,
                                     size_t bytes) {
  char d[200];
  op_describe(op, d, sizeof d);
  return comm_set_error(comm, CHORUS_ERR_NOMEM, "%s on rank %d: out of host memory for %zu "
                        "bytes of staging", d, comm->rank, bytes);
}

static chorus_result_t staging_for(struct chorus_comm *comm, struct cuda_state *st,
                                   const struct op *op, size_t bytes, uint8_t **out) {
  if (!st->pinned_tried) {
    /* made at the first staged collective, on the engine thread: cudaHostAlloc may wait for
     * the device, which must not hold the caller (without it, staging is pageable) */
    st->pinned_tried = 1;
    size_t cap = (size_t)param_int(PARAM_CUDA_SCRATCH);
    if (cap < ((size_t)1 << 20)) cap = (size_t)1 << 20;
    if (cudaHostAlloc(&st->pinned, cap, cudaHostAllocPortable) == cudaSuccess) {
      st->pinned_cap = cap;
    } else {
      cudaGetLastError();
      st->pinned = NULL;
    }
  }
  if (st->pinned && bytes <= st->pinned_cap) {
    *out = st->pinned;
    return CHORUS_SUCCESS;
  }
  if (bytes > st->big_cap) {
    void *p = realloc(st->big, bytes);
    if (!p) return staging_nomem(comm, op, bytes);
    st->big = p;
    st->big_cap = bytes;
  }
  *out = st->big;
  return CHORUS_SUCCESS;
}

/* On the thread that submits a device operation, before it is queued (see the note above
 * chorus_cuda_begin): makes the state at the first device operation and sets up CUDA IPC at
 * the first device collective (a collective step: every rank submits its collectives in the
 * same order). A failure fails the communicator. */
static void cuda_prepare(struct chorus_comm *comm, const struct op *op) {
  struct cuda_state *st = comm->cuda;
  const int collective = op->kind != OP_SEND && op->kind != OP_RECV;
  if (st && (st->ipc_tried || !collective)) return;
  int old = -1;
  if (cudaGetDevice(&old) != cudaSuccess) old = -1;
  cudaError_t e = cudaSetDevice(op->device);
  if (e != cudaSuccess) {
    cuda_fail(comm, op, e, "cudaSetDevice");
    return;
  }
  if (!st) {
    st = calloc(1, sizeof *st);
    if (st) st->peer = calloc((size_t)comm->nlocal, sizeof(uint8_t *));
    if (!st || !st->peer) {
      free(st);
      comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: out of memory", comm->rank);
      goto restore;
    }
    st->device = op->device;
    comm->cuda = st;
    if ((e = cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&st->p2p, cudaStreamNonBlocking)) != cudaSuccess) {
      cuda_fail(comm, op, e, "cudaStreamCreate");
      goto restore;
    }
    atomic_store(&st->ready, 1);
  }
  /* the kernels, before an op needs one: this op still waits for them if the device is
   * busy now, no later op does (a no-op where group creation loaded them) */
  if (collective) chorus_cuda_preload(op->device, 1);
  if (collective && !st->ipc_tried) ipc_setup(comm, st, op);
restore:
  if (old >= 0 && old != op->device) cudaSetDevice(old);
}

static size_t extent(const size_t *counts, const size_t *displs, int n) {
  size_t e = 0;
  for (int p = 0; p < n; p++)
    if (counts[p] && displs[p] + counts[p] > e) e = displs[p] + counts[p];
  return e;
}

/* Bytes of input (sbytes) and output (rbytes) rank `rank` has in op (as this rank sees the
 * op: the per-rank parts of the v-variants are this rank's). */
static void rank_extents(const struct chorus_comm *comm, const struct op *op, int rank,
                         size_t *sbytes, size_t *rbytes) {
  const size_t es = dtype_size(op->dtype);
  const int n = comm->nranks, root_me = rank == op->root;
  size_t s = 0, r = 0;
  switch (op->kind) {
    case OP_ALLREDUCE: s = r = op->count; break;
    case OP_BROADCAST: s = r = op->count; break;
    case OP_REDUCE: s = op->count; r = root_me ? op->count : 0; break;
    case OP_ALLGATHER: s = op->counts[rank]; r = extent(op->counts, op->displs, n); break;
    case OP_REDUCE_SCATTER: s = op->count; r = op->counts[rank]; break;
    case OP_GATHER: s = op->count; r = root_me ? op->count * (size_t)n : 0; break;
    case OP_SCATTER: s = root_me ? op->count * (size_t)n : 0; r = op->count; break;
    case OP_ALLTOALL:
      s = extent(op->counts, op->displs, n);
      r = extent(op->counts2, op->displs2, n);
      break;
    default: break;
  }
  *sbytes = s * es;
  *rbytes = r * es;
}

/* This rank's own extents; none for a buffer it did not pass. */
static void extents(const struct chorus_comm *comm, const struct op *op, size_t *sbytes,
                    size_t *rbytes) {
  rank_extents(comm, op, comm->rank, sbytes, rbytes);
  if (!op->sendbuf) *sbytes = 0;
  if (!op->recvbuf) *rbytes = 0;
}

/* The size of a collective as every rank sees it (the path chosen from it must be the same
 * on every rank): the whole buffer for the rooted and reducing kinds, everything gathered for
 * all_gather, every block for a (uniform) alltoall. */
static size_t coll_bytes(const struct chorus_comm *comm, const struct op *op) {
  const size_t es = dtype_size(op->dtype), n = (size_t)comm->nranks;
  size_t c = op->count;
  if (op->kind == OP_ALLGATHER) {
    c = 0;
    for (size_t p = 0; p < n; p++) c += op->counts[p];
  } else if (op->kind == OP_ALLTOALL) {
    c = op->counts[0] * n;
  } else if (op->kind == OP_GATHER || op->kind == OP_SCATTER) {
    c = op->count * n;
  }
  return c * es;
}

static int inside(const void *p, const void *base, size_t len) {
  return p && base && (const uint8_t *)p >= (const uint8_t *)base &&
         (const uint8_t *)p < (const uint8_t *)base + len;
}

static chorus_result_t copy_back(struct chorus_comm *comm, struct cuda_state *st,
                                 struct op *op, uint8_t *hrecv, size_t rbytes) {
  const size_t es = dtype_size(op->dtype);
  uint8_t *d = op->recvbuf;
  const size_t *c = op->kind == OP_ALLGATHER ? op->counts
                    : op->kind == OP_ALLTOALL ? op->counts2 : NULL;
  const size_t *o = op->kind == OP_ALLGATHER ? op->displs
                    : op->kind == OP_ALLTOALL ? op->displs2 : NULL;
  if (!c) {
    CU(comm, op, cudaMemcpyAsync(d, hrecv, rbytes, cudaMemcpyHostToDevice, st->stream),
       "cudaMemcpyAsync to the device");
    return CHORUS_SUCCESS;
  }
  /* only the pieces the collective writes: gaps between them keep the caller's data */
  for (int p = 0; p < comm->nranks; p++)
    if (c[p])
      CU(comm, op, cudaMemcpyAsync(d + o[p] * es, hrecv + o[p] * es, c[p] * es,
                                   cudaMemcpyHostToDevice, st->stream),
         "cudaMemcpyAsync to the device");
  return CHORUS_SUCCESS;
}

/* cls: the op's size class (size_class of coll_bytes), for the timing kept per class. */
static chorus_result_t staged(struct chorus_comm *comm, struct cuda_state *st, struct op *op,
                              int cls) {
  size_t sbytes, rbytes;
  extents(comm, op, &sbytes, &rbytes);
  const size_t ralign = (rbytes + 63) & ~(size_t)63;
  /* in-place forms keep their aliasing in host memory: input inside the output (all_gather
   * into a tensor, all_reduce), or output inside the input (reduce_scatter into a chunk) */
  int send_in_recv = sbytes && inside(op->sendbuf, op->recvbuf, rbytes) &&
                     (const uint8_t *)op->sendbuf + sbytes <= (uint8_t *)op->recvbuf + rbytes;
  int recv_in_send = !send_in_recv && rbytes && inside(op->recvbuf, op->sendbuf, sbytes) &&
                     (uint8_t *)op->recvbuf + rbytes <= (const uint8_t *)op->sendbuf + sbytes;
  size_t need = send_in_recv ? ralign : recv_in_send ? sbytes : ralign + sbytes;
  uint8_t *base = NULL;
  CHECK(staging_for(comm, st, op, need, &base));
  uint8_t *hrecv, *hsend;
  if (send_in_recv) {
    hrecv = base;
    hsend = base + ((const uint8_t *)op->sendbuf - (uint8_t *)op->recvbuf);
  } else if (recv_in_send) {
    hsend = base;
    hrecv = base + ((uint8_t *)op->recvbuf - (const uint8_t *)op->sendbuf);
  } else {
    hrecv = base;
    hsend = base + ralign;
  }
  if (op->kind == OP_BROADCAST) hsend = hrecv;
  const int has_input = sbytes && (op->kind != OP_BROADCAST || comm->rank == op->root);
  const int64_t t0 = now_ns();
  if (has_input)
    CU(comm, op, cudaMemcpyAsync(hsend, op->sendbuf, sbytes, cudaMemcpyDeviceToHost,
                                 st->stream), "cudaMemcpyAsync from the device");
  CHECK(drain_stream(comm, op, st->stream));
  const int64_t t1 = now_ns();
  const void *dsend = op->sendbuf;
  void *drecv = op->recvbuf;
  op->sendbuf = op->sendbuf ? hsend : NULL;
  op->recvbuf = op->recvbuf ? hrecv : NULL;
  op->on_device = 0; /* the host algorithms see host memory */
  chorus_result_t res = algo_run(comm, op);
  op->on_device = 1;
  op->sendbuf = dsend;
  op->recvbuf = drecv;
  CHECK(res);
  const int64_t t2 = now_ns();
  if (rbytes) CHECK(copy_back(comm, st, op, hrecv, rbytes));
  CHECK(drain_stream(comm, op, st->stream));
  st->n_staged[cls]++;
  st->ns_in[cls] += (uint64_t)(t1 - t0);
  st->ns_host[cls] += (uint64_t)(t2 - t1);
  st->ns_out[cls] += (uint64_t)(now_ns() - t2);
  return CHORUS_SUCCESS;
}

/* The communicator's stream waits for the caller's work before the op (its event). */
static chorus_result_t after_caller(struct chorus_comm *comm, struct cuda_state *st,
                                    struct op *op) {
  if (op->start_event)
    CU(comm, op, cudaStreamWaitEvent(st->stream, (cudaEvent_t)op->start_event, 0),
       "cudaStreamWaitEvent on the caller's event");
  return CHORUS_SUCCESS;
}

/* ------------------------------------------------------------------ same GPU */
/* The caches: IPC handles of this rank's allocations (handing a handle out again is free),
 * and, on the executor, peers' allocations mapped here. Both keyed by the driver's buffer
 * id, unique per allocation within a process, so a freed and reallocated range is never
 * mistaken for the old one. */
#define SG_EXEC 0 /* the executing rank */

/* One buffer as its owner describes it; id 0: no buffer. */
struct sg_ref {
  uint64_t id, off, bytes;
  cudaIpcMemHandle_t h;
};
struct sg_desc {
  int32_t ok;    /* 0: a buffer cannot be exported (e.g. not from cudaMalloc) */
  int32_t ready; /* the caller's work before the op had finished on the GPU */
  struct sg_ref send, recv;
};
enum { SG_OTHER = 0, SG_QUEUED = 1, SG_DONE = 2 };
struct sg_reply {
  int32_t run; /* SG_DONE: the executor ran it and it is finished; SG_QUEUED: queued behind
                * every rank's IPC event, ranks wait for the executor's; SG_OTHER: every rank
                * takes another path */
  int32_t pad;
};
/* How long a rank waits on the host for its caller's earlier GPU work before it lets the
 * executor queue the collective behind it instead (see same_gpu). */
#define SG_READY_WAIT_NS 5000000LL

static int sg_attrs(struct cuda_state *st, const void *ptr, unsigned long long *id,
                    CUdeviceptr *start, size_t *size) {
  CUpointer_attribute at[3] = {CU_POINTER_ATTRIBUTE_BUFFER_ID,
                               CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                               CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void *data[3] = {id, start, size};
  *id = 0;
  *start = 0;
  *size = 0;
  return st->get_attrs && st->get_attrs(3, at, data, (CUdeviceptr)(uintptr_t)ptr) ==
                              CUDA_SUCCESS && *id && *start;
}

/* Fills ref for `bytes` at ptr (nothing when there is no buffer); 0 if it cannot be shared. */
static int sg_describe(struct cuda_state *st, const void *ptr, size_t bytes,
                       struct sg_ref *ref) {
  memset(ref, 0, sizeof *ref);
  if (!ptr || !bytes) return 1;
  unsigned long long id;
  CUdeviceptr start;
  size_t size;
  if (!sg_attrs(st, ptr, &id, &start, &size)) return 0;
  ref->id = id;
  ref->off = (uint64_t)((uintptr_t)ptr - (uintptr_t)start);
  ref->bytes = bytes;
  if (ref->off + bytes > size) return 0;
  struct sg_export *e = NULL, *lru = &st->exports[0];
  for (int i = 0; i < SG_EXPORTS; i++) {
    if (st->exports[i].id == id) e = &st->exports[i];
    if (st->exports[i].last < lru->last) lru = &st->exports[i];
  }
  if (!e) {
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, (void *)(uintptr_t)start) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    e = lru;
    e->id = id;
    e->h = h;
  }
  e->last = ++st->use_clock;
  ref->h = e->h;
  return 1;
}

/* The executor's address of a peer's buffer, or NULL (then every rank takes another path).
 * The mapping's real size bounds what the peer may name. */
static uint8_t *sg_import(struct cuda_state *st, int rank, const struct sg_ref *ref) {
  struct sg_import *m = NULL, *lru = &st->imports[0];
  for (int i = 0; i < SG_IMPORTS; i++) {
    struct sg_import *c = &st->imports[i];
    if (c->base && c->rank == rank && c->id == ref->id) m = c;
    /* an empty slot, else the least recently used */
    if (lru->base && (!c->base || c->last < lru->last)) lru = c;
  }
  if (!m) {
    if (lru->base) {
      /* queued work may still use the mapping */
      if (cudaStreamSynchronize(st->stream) != cudaSuccess) return NULL;
      cudaIpcCloseMemHandle(lru->base);
      lru->base = NULL;
    }
    void *base = NULL;
    if (cudaIpcOpenMemHandle(&base, ref->h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
      cudaGetLastError();
      return NULL;
    }
    unsigned long long id;
    CUdeviceptr start;
    size_t size = 0;
    if (!sg_attrs(st, base, &id, &start, &size) || (uintptr_t)start != (uintptr_t)base) {
      cudaIpcCloseMemHandle(base);
      return NULL;
    }
    m = lru;
    m->rank = rank;
    m->id = ref->id;
    m->base = base;
    m->size = size;
  }
  m->last = ++st->use_clock;
  if (ref->off > m->size || ref->bytes > m->size - ref->off) return NULL;
  return m->base + ref->off;
}

static void sg_release(struct cuda_state *st) {
  if (st->imports)
    for (int i = 0; i < SG_IMPORTS; i++)
      if (st->imports[i].base) cudaIpcCloseMemHandle(st->imports[i].base);
  free(st->imports);
  free(st->exports);
  st->imports = NULL;
  st->exports = NULL;
}

/* Which collectives the executor runs: the decision must be the same on every rank, so it
 * depends on the call alone (what each rank's buffers allow is settled in the exchange). */
static int sg_eligible(const struct chorus_comm *comm, const struct op *op) {
  const int n = comm->nranks;
  const int premul = op->op.kind == CHORUS_PREMUL_SUM;
  switch (op->kind) {
    case OP_ALLREDUCE:
    case OP_REDUCE: return !premul;
    case OP_BROADCAST: return 1;
    case OP_ALLGATHER:
      return counts_uniform(op->counts, n) && displs_packed(op->counts, op->displs, n);
    case OP_REDUCE_SCATTER:
      return !premul && counts_uniform(op->counts, n) && op->counts[0] * (size_t)n == op->count;
    case OP_ALLTOALL: return op->uniform && alltoall_blocks(op, n);
    default: return 0;
  }
}

static int disjoint(const uint8_t *a, size_t na, const uint8_t *b, size_t nb) {
  return !na || !nb || a + na <= b || b + nb <= a;
}

/* The executor: every rank's buffers in its address space, then the device work. */
static chorus_result_t sg_run(struct chorus_comm *comm, struct op *op, const void *const *descs,
                              void *reply_out, void *arg) {
  struct cuda_state *st = arg;
  struct sg_reply rep = {0, 0};
  const int n = comm->nranks;
  const int64_t t_run = now_ns();
  const int cls = size_class(coll_bytes(comm, op));
  const size_t es = dtype_size(op->dtype);
  uint8_t *S[CUDA_REDUCE_MAX_IN], *R[CUDA_REDUCE_MAX_IN];
  size_t sb[CUDA_REDUCE_MAX_IN], rb[CUDA_REDUCE_MAX_IN];
  const char *why = NULL;
  for (int p = 0; p < n; p++) {
    rank_extents(comm, op, p, &sb[p], &rb[p]);
    if (op->kind == OP_BROADCAST) sb[p] = 0; /* one buffer: the root's is the source */
    if (op->kind == OP_REDUCE && p != op->root) rb[p] = 0;
    if (p == comm->rank) {
      S[p] = sb[p] ? (uint8_t *)op->sendbuf : NULL;
      R[p] = rb[p] ? (uint8_t *)op->recvbuf : NULL;
      continue;
    }
    const struct sg_desc *d = descs[p];
    S[p] = R[p] = NULL;
    if (!d->ok) {
      why = "a rank's buffer cannot be shared through CUDA IPC";
      goto out;
    }
    /* what the peer names must be what the call needs */
    if ((sb[p] && (d->send.bytes != sb[p] || !d->send.id)) ||
        (rb[p] && (d->recv.bytes != rb[p] || !d->recv.id))) {
      why = "a rank described buffers of other sizes";
      goto out;
    }
    if ((sb[p] && !(S[p] = sg_import(st, p, &d->send))) ||
        (rb[p] && !(R[p] = sg_import(st, p, &d->recv)))) {
      why = "a rank's buffer cannot be mapped here";
      goto out;
    }
  }
  /* the block of the block-structured kinds (sg_eligible: all blocks are alike) */
  const size_t blk = op->kind == OP_ALLGATHER || op->kind == OP_ALLTOALL ||
                             op->kind == OP_REDUCE_SCATTER
                         ? op->counts[0] * es
                         : 0;
  /* aliasing: the in-place forms, or none at all */
  for (int p = 0; p < n; p++) {
    int ok;
    switch (op->kind) {
      case OP_ALLGATHER: ok = S[p] == R[p] + (size_t)p * blk || disjoint(S[p], sb[p], R[p], rb[p]); break;
      case OP_REDUCE_SCATTER: ok = R[p] == S[p] + (size_t)p * blk || disjoint(S[p], sb[p], R[p], rb[p]); break;
      case OP_ALLTOALL: ok = disjoint(S[p], sb[p], R[p], rb[p]); break;
      default: ok = S[p] == R[p] || disjoint(S[p], sb[p], R[p], rb[p]); break;
    }
    if (!ok) {
      why = "a rank's input and output overlap";
      goto out;
    }
  }
  /* Every rank's inputs final already (the usual case, an idle GPU): run it and wait for
   * it here, so no stream of one process ever waits for another's: ranks sharing a GPU
   * without MPS time-slice, and each such cross-process wait cost about a time slice
   * (1.7 ms per all_reduce on the H200). Else queue it behind every rank's IPC event, and
   * nobody's host waits for the GPU. */
  int all_ready = 1;
  for (int p = 0; p < n; p++)
    if (!((const struct sg_desc *)descs[p])->ready) all_ready = 0;
  if (!all_ready)
    for (int p = 0; p < n; p++)
      if (p != comm->rank)
        CU(comm, op, cudaStreamWaitEvent(st->stream, st->ev_peer[p], 0),
           "cudaStreamWaitEvent on a peer's IPC event");
  const chorus_op_kind_t kind = base_op(op->op.kind);
  const int divisor = op->op.kind == CHORUS_AVG ? n : 1;
  cudaError_t e = cudaSuccess;
  void *dst[CUDA_REDUCE_MAX_IN * CUDA_REDUCE_MAX_IN];
  const void *src[CUDA_REDUCE_MAX_IN * CUDA_REDUCE_MAX_IN];
  size_t len[CUDA_REDUCE_MAX_IN * CUDA_REDUCE_MAX_IN];
  int m = 0;
  switch (coll_bytes(comm, op) ? op->kind : OP_KIND_COUNT) { /* nothing to move: no kernel */
    case OP_ALLREDUCE:
      e = (cudaError_t)chorus_cuda_reduce_multi((void *const *)R, n, (const void *const *)S, n,
                                                op->count, op->dtype, kind, divisor,
                                                st->stream);
      break;
    case OP_REDUCE:
      e = (cudaError_t)chorus_cuda_reduce_multi((void *const *)&R[op->root], 1,
                                                (const void *const *)S, n, op->count,
                                                op->dtype, kind, divisor, st->stream);
      break;
    case OP_REDUCE_SCATTER:
      for (int r = 0; r < n && e == cudaSuccess; r++) {
        if (!op->counts[r]) continue;
        const void *in[CUDA_REDUCE_MAX_IN];
        for (int p = 0; p < n; p++) in[p] = S[p] + (size_t)r * blk;
        e = (cudaError_t)chorus_cuda_reduce_multi((void *const *)&R[r], 1, in, n,
                                                  op->counts[r], op->dtype, kind, divisor,
                                                  st->stream);
      }
      break;
    case OP_BROADCAST:
      for (int p = 0; p < n; p++) {
        dst[m] = R[p];
        src[m] = R[op->root];
        len[m++] = rb[p];
      }
      break;
    case OP_ALLGATHER:
      for (int r = 0; r < n; r++)
        for (int p = 0; p < n; p++) {
          dst[m] = R[r] + (size_t)p * blk;
          src[m] = S[p];
          len[m++] = blk;
        }
      break;
    case OP_ALLTOALL:
      for (int q = 0; q < n; q++)
        for (int p = 0; p < n; p++) {
          dst[m] = R[q] + (size_t)p * blk;
          src[m] = S[p] + (size_t)q * blk;
          len[m++] = blk;
        }
      break;
    default: break;
  }
  if (e == cudaSuccess && m)
    e = (cudaError_t)chorus_cuda_copy_batch(dst, src, len, m, st->stream);
  if (e != cudaSuccess) return cuda_fail(comm, op, e, "same-GPU collective kernel");
  if (all_ready) {
    const int64_t t_drain = now_ns();
    CHECK(drain_stream(comm, op, st->stream));
    st->ns_sg_drain[cls] += (uint64_t)(now_ns() - t_drain);
    rep.run = SG_DONE;
  } else {
    CU(comm, op, cudaEventRecord(st->ev_mine, st->stream), "cudaEventRecord of the IPC event");
    rep.run = SG_QUEUED;
  }
out:
  st->n_sg_run[cls]++;
  st->ns_sg_run[cls] += (uint64_t)(now_ns() - t_run);
  if (why)
    INFO(SUB_COLL, comm->rank, "cuda: %s seq %llu not run on the shared GPU (%s): taking "
         "another path", op_kind_name(op->kind), (unsigned long long)op->seq, why);
  memcpy(reply_out, &rep, sizeof rep);
  return CHORUS_SUCCESS;
}

/* Every rank: describe, exchange, and (when the executor ran it) order this rank's stream
 * after the executor's work. *ran = 0: nothing was queued, the caller takes another path. */
static chorus_result_t same_gpu(struct chorus_comm *comm, struct cuda_state *st, struct op *op,
                                int cls, int *ran) {
  struct sg_desc d;
  memset(&d, 0, sizeof d);
  *ran = 0;
  /* has the caller's work before this op finished? (a moment's grace: the event was just
   * recorded, and an idle GPU reaches it within microseconds) */
  d.ready = 1;
  const int64_t t_ready = now_ns();
  if (op->start_event) {
    const int64_t until = now_ns() + SG_READY_WAIT_NS;
    int idle = 0;
    for (;;) {
      cudaError_t e = cudaEventQuery((cudaEvent_t)op->start_event);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) return cuda_fail(comm, op, e, "the caller's event");
      if (now_ns() >= until) {
        d.ready = 0;
        break;
      }
      CHECK(engine_poll_device(comm, op, &idle));
    }
  }
  st->ns_sg_ready[cls] += (uint64_t)(now_ns() - t_ready);
  if (!d.ready) {
    /* the executor may queue the op behind this rank's IPC event: this stream reaches it
     * once the caller's work before the op is done (a ready rank records nothing: the last
     * record, if any, is older and complete whenever the op's inputs are) */
    CHECK(after_caller(comm, st, op));
    if (comm->rank != SG_EXEC)
      CU(comm, op, cudaEventRecord(st->ev_mine, st->stream), "cudaEventRecord of the IPC event");
  }
  if (comm->rank != SG_EXEC) {
    size_t sbytes, rbytes;
    extents(comm, op, &sbytes, &rbytes);
    if (op->kind == OP_BROADCAST) sbytes = 0;
    d.ok = sg_describe(st, op->sendbuf, sbytes, &d.send) &&
           sg_describe(st, op->recvbuf, rbytes, &d.recv);
  }
  op->algo = ALGO_ONESHOT; /* the fingerprint's algorithm: every rank takes this path */
  struct sg_reply rep;
  CHECK(shm_delegate(comm, op, SG_EXEC, &d, sizeof d, &rep, sizeof rep, sg_run, st));
  if (rep.run == SG_OTHER) return CHORUS_SUCCESS;
  *ran = 1;
  if (rep.run == SG_DONE) return CHORUS_SUCCESS; /* the data is final: nothing to order */
  if (comm->rank != SG_EXEC)
    CU(comm, op, cudaStreamWaitEvent(st->stream, st->ev_peer[SG_EXEC], 0),
       "cudaStreamWaitEvent on the executor's IPC event");
  if (op->end_event)
    CU(comm, op, cudaEventRecord((cudaEvent_t)op->end_event, st->stream),
       "cudaEventRecord of the end event");
  return CHORUS_SUCCESS;
}

/* ------------------------------------------------------------------ collectives */
chorus_result_t cuda_run(struct chorus_comm *comm, struct op *op) {
  struct cuda_state *st = NULL;
  CHECK(state_get(comm, op, &st));
  chorus_result_t (*fn)(struct chorus_comm *, struct op *) = NULL;
  int id = ALGO_ONESHOT;
  const size_t bytes = coll_bytes(comm, op);
  const int cls = size_class(bytes);
  if (st->same_gpu && sg_eligible(comm, op)) {
    int ran = 0;
    const int64_t t0 = now_ns();
    comm->last_algo = ALGO_ONESHOT;
    trace_op_algo(comm, op);
    CHECK(same_gpu(comm, st, op, cls, &ran));
    if (ran) {
      TRACE(SUB_COLL, comm->rank, "cuda: %s seq %llu queued on the shared GPU by rank %d",
            op_kind_name(op->kind), (unsigned long long)op->seq, SG_EXEC);
      st->n_sg[cls]++;
      st->ns_sg[cls] += (uint64_t)(now_ns() - t0);
      return CHORUS_SUCCESS;
    }
    st->n_sg_fallback++;
  }
  CHECK(after_caller(comm, st, op));
  if (comm->nranks == 1 && (op->kind == OP_ALLREDUCE || op->kind == OP_REDUCE ||
                            op->kind == OP_BROADCAST)) {
    /* alone: the result is the input (PREMUL_SUM: scaled), a device copy at most */
    const size_t es = dtype_size(op->dtype);
    if (op->kind != OP_BROADCAST && op->op.kind == CHORUS_PREMUL_SUM)
      CHECK(cuda_premul(comm, op->recvbuf, op->sendbuf, op->count, op->dtype,
                        op->op.factor));
    else if (op->recvbuf != op->sendbuf && op->count)
      CU(comm, op, cudaMemcpyAsync(op->recvbuf, op->sendbuf, op->count * es,
                                   cudaMemcpyDeviceToDevice, st->stream),
         "cudaMemcpyAsync");
    return drain_stream(comm, op, st->stream);
  }
  if (st->ipc_ok && bytes > (size_t)param_int(PARAM_CUDA_HOST_MAX)) {
    switch (op->kind) {
      case OP_ALLREDUCE:
        if (op->count * dtype_size(op->dtype) > CUDA_ONESHOT_MAX) id = ALGO_TWOSHOT;
        fn = id == ALGO_TWOSHOT ? twoshot_allreduce : oneshot_allreduce;
        break;
      case OP_REDUCE: fn = oneshot_reduce; break;
      case OP_BROADCAST: fn = oneshot_broadcast; break;
      case OP_ALLGATHER: fn = oneshot_allgatherv; break;
      case OP_REDUCE_SCATTER: fn = oneshot_reduce_scatterv; break;
      /* only an alltoall issued as uniform on every rank: one rank's splits may happen to be
       * even while another's are not, and both must take the same path */
      case OP_ALLTOALL:
        if (op->uniform) fn = oneshot_alltoall;
        break;
      default: break;
    }
    if (fn && !shm_direct_ok(comm, op, id)) fn = NULL;
  }
  if (!fn) {
    TRACE(SUB_COLL, comm->rank, "cuda: %s seq %llu staged through host memory",
          op_kind_name(op->kind), (unsigned long long)op->seq);
    return staged(comm, st, op, cls);
  }
  op->algo = id;
  comm->last_algo = id;
  trace_op_algo(comm, op);
  TRACE(SUB_COLL, comm->rank, "cuda: %s seq %llu %s over CUDA IPC", op_kind_name(op->kind),
        (unsigned long long)op->seq, algo_name(id));
  const int64_t t0 = now_ns();
  CHECK(fn(comm, op));
  CHECK(drain_stream(comm, op, st->stream));
  st->n_ipc[cls]++;
  st->ns_ipc[cls] += (uint64_t)(now_ns() - t0);
  return CHORUS_SUCCESS;
}

/* ------------------------------------------------------------------ point-to-point */
static chorus_result_t p2p_staging(struct chorus_comm *comm, struct op *op) {
  /* pageable: cudaHostAlloc and cudaFreeHost would synchronise the device (see
   * the note above chorus_cuda_begin) */
  size_t bytes = op->count * dtype_size(op->dtype);
  op->staging = malloc(bytes ? bytes : 1);
  if (!op->staging) return staging_nomem(comm, op, bytes);
  return CHORUS_SUCCESS;
}

chorus_result_t cuda_p2p_send_ready(struct chorus_comm *comm, struct op *op, int *ready) {
  *ready = 0;
  if (op->staging) {
    *ready = 1;
    return CHORUS_SUCCESS;
  }
  struct cuda_state *st = NULL;
  CHECK(state_get(comm, op, &st));
  if (op->start_event) {
    /* polled, so that a send whose data is not produced yet holds up nothing else */
    cudaError_t e = cudaEventQuery((cudaEvent_t)op->start_event);
    if (e == cudaErrorNotReady) return CHORUS_SUCCESS;
    if (e != cudaSuccess) return cuda_fail(comm, op, e, "the caller's event");
  }
  CHECK(p2p_staging(comm, op));
  size_t bytes = op->count * dtype_size(op->dtype);
  if (bytes)
    CU(comm, op, cudaMemcpyAsync(op->staging, op->sendbuf, bytes, cudaMemcpyDeviceToHost,
                                 st->p2p), "cudaMemcpyAsync from the device");
  CU(comm, op, cudaStreamSynchronize(st->p2p), "cudaStreamSynchronize");
  *ready = 1;
  return CHORUS_SUCCESS;
}

chorus_result_t cuda_p2p_recv_begin(struct chorus_comm *comm, struct op *op) {
  struct cuda_state *st = NULL;
  CHECK(state_get(comm, op, &st));
  return p2p_staging(comm, op);
}

chorus_result_t cuda_p2p_recv_end(struct chorus_comm *comm, struct op *op) {
  struct cuda_state *st = NULL;
  CHECK(state_get(comm, op, &st));
  size_t bytes = op->count * dtype_size(op->dtype);
  /* the caller's stream may use the buffer until the point the receive was posted at */
  if (op->start_event)
    CU(comm, op, cudaStreamWaitEvent(st->p2p, (cudaEvent_t)op->start_event, 0),
       "cudaStreamWaitEvent on the caller's event");
  if (bytes)
    CU(comm, op, cudaMemcpyAsync(op->recvbuf, op->staging, bytes, cudaMemcpyHostToDevice,
                                 st->p2p), "cudaMemcpyAsync to the device");
  CU(comm, op, cudaStreamSynchronize(st->p2p), "cudaStreamSynchronize");
  return CHORUS_SUCCESS;
}

void cuda_p2p_release(struct chorus_comm *comm, struct op *op) {
  (void)comm;
  free(op->staging);
  op->staging = NULL;
}

/* ------------------------------------------------------------------ teardown */
void cuda_teardown(struct chorus_comm *comm) {
  struct cuda_state *st = comm->cuda;
  if (!st) return;
  static const char *const cls[4] = {"<= 4K", "<= 64K", "<= 1M", "> 1M"};
  for (int c = 0; c < 4; c++) {
    const double ns = st->n_staged[c] ? (double)st->n_staged[c] : 1.0;
    const double ni = st->n_ipc[c] ? (double)st->n_ipc[c] : 1.0;
    const double ng = st->n_sg[c] ? (double)st->n_sg[c] : 1.0;
    if (st->n_staged[c] || st->n_ipc[c] || st->n_sg[c])
      INFO(SUB_COLL, comm->rank, "cuda: %llu collectives of %s bytes staged (mean us: %.1f to "
           "the host, %.1f host algorithm, %.1f back), %llu over CUDA IPC (mean %.1f us), "
           "%llu queued on the shared GPU (mean %.1f us of host time)",
           (unsigned long long)st->n_staged[c], cls[c], st->ns_in[c] / 1e3 / ns,
           st->ns_host[c] / 1e3 / ns, st->ns_out[c] / 1e3 / ns,
           (unsigned long long)st->n_ipc[c], st->ns_ipc[c] / 1e3 / ni,
           (unsigned long long)st->n_sg[c], st->ns_sg[c] / 1e3 / ng);
  }
  for (int c = 0; c < 4; c++) {
    const double ng = st->n_sg[c] ? (double)st->n_sg[c] : 1.0;
    const double nr = st->n_sg_run[c] ? (double)st->n_sg_run[c] : 1.0;
    if (st->n_sg[c] || st->n_sg_run[c])
      INFO(SUB_COLL, comm->rank, "cuda: shared GPU, %s bytes: mean us per op %.1f waiting for "
           "the caller's event; %llu executor runs, mean us %.1f per run, %.1f of it waiting "
           "for the device", cls[c], st->ns_sg_ready[c] / 1e3 / ng,
           (unsigned long long)st->n_sg_run[c], st->ns_sg_run[c] / 1e3 / nr,
           st->ns_sg_drain[c] / 1e3 / nr);
  }
  if (st->n_sg_fallback)
    INFO(SUB_COLL, comm->rank, "cuda: %llu collectives could not run on the shared GPU (see "
         "the earlier lines for why)", (unsigned long long)st->n_sg_fallback);
  cudaSetDevice(st->device);
  if (st->ipc_ok && comm->shm) {
    /* peers may still read this rank's scratch for the last chunks: wait (bounded, a peer
     * may be dead) until each says it is done with every generation this rank reached */
    int64_t end = now_ns() + (int64_t)TEARDOWN_WAIT_MS * 1000000LL;
    for (int p = 0; p < comm->nranks; p++) {
      if (p == comm->rank) continue;
      struct shm_flags *f = shm_flags_of(comm, comm->local_rank_of[p]);
      while (atomic_load_explicit(&f->done, memory_order_acquire) < comm->dgen &&
             now_ns() < end && !atomic_load(&comm->failed))
        shm_wait_doorbell(comm, shm_doorbell_value(comm), 1000);
    }
  }
  if (st->stream) cudaStreamSynchronize(st->stream);
  if (st->same_gpu && comm->shm) {
    /* peers' streams may still wait on this rank's IPC event, and the executor's kernels
     * read every rank's buffers: each rank says when its device work is all done, and the
     * events and mappings go once every rank has said so (bounded: a peer may be dead) */
    atomic_store_explicit(&shm_flags_of(comm, comm->local_rank_of[comm->rank])->gpu_idle, 1,
                          memory_order_release);
    shm_notify_local(comm);
    int64_t end = now_ns() + (int64_t)TEARDOWN_WAIT_MS * 1000000LL;
    for (int p = 0; p < comm->nranks; p++) {
      if (p == comm->rank) continue;
      struct shm_flags *f = shm_flags_of(comm, comm->local_rank_of[p]);
      while (!atomic_load_explicit(&f->gpu_idle, memory_order_acquire) && now_ns() < end &&
             shm_failed_peer(comm) < 0)
        shm_wait_doorbell(comm, shm_doorbell_value(comm), 1000);
    }
  }
  sg_release(st);
  events_release(st, comm->nranks);
  ipc_release(st, comm->nlocal, comm->local_rank_of[comm->rank]);
  if (st->stream) cudaStreamDestroy(st->stream);
  if (st->p2p) cudaStreamDestroy(st->p2p);
  if (st->pinned) cudaFreeHost(st->pinned);
  free(st->big);
  free(st->peer);
  free(st);
  comm->cuda = NULL;
}

#endif /* CHORUS_WITH_CUDA */
