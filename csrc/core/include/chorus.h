/* chorus.h - the public C API of the Chorus collective-communication library.
 * Everything a C program (or the PyTorch binding) needs: communicators, non-blocking
 * collectives and point-to-point ops returning requests, errors and parameters. */
#ifndef CHORUS_H
#define CHORUS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CHORUS_VERSION_MAJOR 0
#define CHORUS_VERSION_MINOR 1
#define CHORUS_VERSION_PATCH 0
#define CHORUS_VERSION_STRING "0.1.0"

typedef enum {
  CHORUS_SUCCESS = 0,
  CHORUS_ERR_INVALID = 1,     /* bad argument from the caller */
  CHORUS_ERR_SYSTEM = 2,      /* a system call failed */
  CHORUS_ERR_TIMEOUT = 3,     /* a wait passed its deadline */
  CHORUS_ERR_PEER = 4,        /* a peer died, closed its connection or reported failure */
  CHORUS_ERR_MISMATCH = 5,    /* ranks called different collectives / counts / dtypes */
  CHORUS_ERR_ABORTED = 6,     /* the communicator was aborted or destroyed */
  CHORUS_ERR_NOMEM = 7,
  CHORUS_ERR_INTERNAL = 8,
  CHORUS_ERR_UNSUPPORTED = 9, /* valid request the library does not implement */
  CHORUS_INPROGRESS = 10      /* returned by chorus_test / chorus_wait with timeout */
} chorus_result_t;

typedef enum {
  CHORUS_INT8 = 0,
  CHORUS_UINT8,
  CHORUS_INT16,
  CHORUS_INT32,
  CHORUS_INT64,
  CHORUS_FLOAT16,
  CHORUS_BFLOAT16,
  CHORUS_FLOAT32,
  CHORUS_FLOAT64,
  CHORUS_BOOL,
  CHORUS_FLOAT8_E4M3, /* torch.float8_e4m3fn: no infinities, 0x7f/0xff NaN, max 448 */
  CHORUS_FLOAT8_E5M2, /* torch.float8_e5m2: IEEE-like, max 57344 */
  CHORUS_DTYPE_COUNT
} chorus_dtype_t;

typedef enum {
  CHORUS_SUM = 0,
  CHORUS_PROD,
  CHORUS_MIN,
  CHORUS_MAX,
  CHORUS_AVG,        /* sum divided by the number of ranks (integer types: truncated) */
  CHORUS_PREMUL_SUM, /* each rank's input multiplied by its own factor, then summed */
  CHORUS_BAND,
  CHORUS_BOR,
  CHORUS_BXOR,
  CHORUS_OP_COUNT
} chorus_op_kind_t;

/* A reduction: the kind and, for CHORUS_PREMUL_SUM, this rank's factor. */
typedef struct {
  chorus_op_kind_t kind;
  double factor;
} chorus_redop_t;

typedef struct chorus_comm chorus_comm_t;
typedef struct chorus_request chorus_request_t;

/* Out-of-band key/value exchange used while creating and splitting communicators.
 * get() blocks until the key exists (or timeout_ms passes) and copies at most cap
 * bytes, reporting the stored length in *len. Keys are plain strings; the core
 * prefixes them per communicator. */
typedef struct chorus_bootstrap {
  void *ctx;
  chorus_result_t (*set)(void *ctx, const char *key, const void *val, size_t len);
  chorus_result_t (*get)(void *ctx, const char *key, void *buf, size_t cap, size_t *len,
                         int timeout_ms);
  /* Frees ctx. Never called by the core: the owner calls it after destroying every
   * communicator built on this bootstrap (chorus_bootstrap_tcp fills it in). */
  void (*release)(void *ctx);
} chorus_bootstrap_t;

/* The built-in TCP rendezvous for pure-C use: rank 0 serves a key/value store on
 * addr ("host:port"), every rank (0 included) is a client. Rank 0's server runs until
 * the bootstrap is released (after the last communicator built on it is destroyed); its
 * release then takes no new clients but serves the connected ones until every other rank
 * has released its bootstrap or exited, for at most a second, so that a rank still
 * destroying its communicator finds the store. */
chorus_result_t chorus_bootstrap_tcp(const char *addr, int rank, int nranks, int timeout_ms,
                                     chorus_bootstrap_t *out);

typedef struct {
  int timeout_ms;      /* bound on every wait; <= 0 takes CHORUS_TIMEOUT */
  const char *name;    /* shown in logs and errors; may be NULL */
} chorus_comm_options_t;

/* Creates a communicator of nranks ranks. Collective over all ranks. The bootstrap is
 * copied; its ctx must stay valid until the communicator (and its splits) are destroyed. */
chorus_result_t chorus_comm_create(int rank, int nranks, const chorus_bootstrap_t *bootstrap,
                                   const chorus_comm_options_t *opts, chorus_comm_t **comm);
/* Waits for queued operations (bounded by the timeout), then frees everything. */
chorus_result_t chorus_comm_destroy(chorus_comm_t *comm);
/* Fails every pending and later operation at once; the communicator must still be
 * destroyed. Safe to call from any thread, also while a collective is in flight. */
chorus_result_t chorus_comm_abort(chorus_comm_t *comm);
/* Collective over comm: ranks with equal color form a new communicator ordered by
 * (key, old rank). color < 0 returns *newcomm = NULL. */
#define CHORUS_SPLIT_NOCOLOR (-1)
chorus_result_t chorus_comm_split(chorus_comm_t *comm, int color, int key,
                                  const chorus_comm_options_t *opts, chorus_comm_t **newcomm);

/* Registers bytes of host memory at ptr with the communicator's network transports, so
 * that sends from inside it skip the copy into the transport's buffers where one can (over
 * InfiniBand/RoCE the NIC reads the bytes straight from this memory; TCP and shared memory
 * copy either way). Registering pins the pages (the locked-memory limit applies) and is not
 * cheap: register buffers that are used many times, such as gradient buckets. Ranges are
 * rounded out to pages; registering a range inside an existing registration shares it.
 * The memory must stay allocated, at the same address, until chorus_comm_deregister(handle):
 * a buffer freed and reallocated while registered would be sent from its old pages.
 * Deregistering while an operation still sends from the buffer is safe (the pages stay
 * pinned until that send completes). Registrations still held at destroy are released.
 * Succeeds (a valid handle, nothing pinned) where no transport of comm uses it. */
chorus_result_t chorus_comm_register(chorus_comm_t *comm, const void *ptr, size_t bytes,
                                     void **handle);
chorus_result_t chorus_comm_deregister(chorus_comm_t *comm, void *handle);

/* An RDMA port as the verbs transport sees it (chorus_verbs_nics). */
typedef struct {
  char name[64];         /* device name, e.g. mlx5_0 */
  int port;
  int active;            /* port state ACTIVE */
  int usable;            /* active, addressable, selected by CHORUS_IB_HCA, verbs not disabled */
  int roce;              /* link layer Ethernet (RoCE); else InfiniBand */
  int width;             /* lanes (1, 2, 4, 8, 12), 0 if unknown */
  double lane_gbps;      /* data rate of one lane in Gb/s, 0 if unknown */
  int lid;               /* InfiniBand LID */
  int gid_index;         /* RoCE: the GID index the transport would use, else -1 */
  char why[128];         /* why it is not usable ("" if it is) */
} chorus_nic_info_t;
/* Lists up to cap ports of the devices libibverbs (CHORUS_IBVERBS_LIB) shows on this host;
 * *count gets how many were written. CHORUS_ERR_UNSUPPORTED, with the reason in
 * chorus_comm_error(NULL), where libibverbs cannot be loaded. */
chorus_result_t chorus_verbs_nics(chorus_nic_info_t *nics, int cap, int *count);

int chorus_comm_rank(const chorus_comm_t *comm);
int chorus_comm_size(const chorus_comm_t *comm);
/* Number of collectives issued so far (the next one gets this sequence number). */
uint64_t chorus_comm_seq(const chorus_comm_t *comm);
void chorus_comm_set_timeout(chorus_comm_t *comm, int timeout_ms);
/* The first error that put the communicator in its failed state, or "" if none.
 * chorus_comm_error(NULL) returns the last error of this thread: the reason a create or
 * split failed, or why the last call was rejected with CHORUS_ERR_INVALID. */
const char *chorus_comm_error(const chorus_comm_t *comm);
const char *chorus_result_string(chorus_result_t res);
size_t chorus_dtype_size(chorus_dtype_t dtype);
const char *chorus_dtype_name(chorus_dtype_t dtype);
const char *chorus_op_name(chorus_op_kind_t op);

/* ---- Non-blocking operations. Each returns a request the caller must free. ----
 * Counts are in elements. sendbuf == recvbuf means in-place. Buffers must stay valid
 * until the request completes. Operations run in issue order per communicator. */
chorus_result_t chorus_iallreduce(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                                  size_t count, chorus_dtype_t dtype, chorus_redop_t op,
                                  chorus_request_t **req);
chorus_result_t chorus_ibroadcast(chorus_comm_t *comm, void *buf, size_t count,
                                  chorus_dtype_t dtype, int root, chorus_request_t **req);
/* recvbuf is used on the root only. */
chorus_result_t chorus_ireduce(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                               size_t count, chorus_dtype_t dtype, chorus_redop_t op, int root,
                               chorus_request_t **req);
/* Rank r contributes recvcounts[r] elements, placed at recvbuf + displs[r] elements. */
chorus_result_t chorus_iallgatherv(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                                   const size_t *recvcounts, const size_t *displs,
                                   chorus_dtype_t dtype, chorus_request_t **req);
chorus_result_t chorus_iallgather(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                                  size_t sendcount, chorus_dtype_t dtype,
                                  chorus_request_t **req);
/* sendbuf holds sum(recvcounts) elements; rank r receives the reduction of
 * the slice [sum(recvcounts[0..r)), +recvcounts[r]). */
chorus_result_t chorus_ireduce_scatterv(chorus_comm_t *comm, const void *sendbuf,
                                        void *recvbuf, const size_t *recvcounts,
                                        chorus_dtype_t dtype, chorus_redop_t op,
                                        chorus_request_t **req);
chorus_result_t chorus_ireduce_scatter(chorus_comm_t *comm, const void *sendbuf,
                                       void *recvbuf, size_t recvcount, chorus_dtype_t dtype,
                                       chorus_redop_t op, chorus_request_t **req);
/* recvbuf (root only) holds nranks * count elements. */
chorus_result_t chorus_igather(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                               size_t count, chorus_dtype_t dtype, int root,
                               chorus_request_t **req);
/* sendbuf (root only) holds nranks * count elements. */
chorus_result_t chorus_iscatter(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                                size_t count, chorus_dtype_t dtype, int root,
                                chorus_request_t **req);
/* Rank r sends sendcounts[p] elements from sendbuf + sdispls[p] to peer p and receives
 * recvcounts[p] elements at recvbuf + rdispls[p] from p. */
chorus_result_t chorus_ialltoallv(chorus_comm_t *comm, const void *sendbuf,
                                  const size_t *sendcounts, const size_t *sdispls,
                                  void *recvbuf, const size_t *recvcounts,
                                  const size_t *rdispls, chorus_dtype_t dtype,
                                  chorus_request_t **req);
chorus_result_t chorus_ialltoall(chorus_comm_t *comm, const void *sendbuf, void *recvbuf,
                                 size_t count, chorus_dtype_t dtype, chorus_request_t **req);
chorus_result_t chorus_ibarrier(chorus_comm_t *comm, chorus_request_t **req);

/* Point-to-point. Messages between a pair are matched in order; the tags of a send and
 * the receive it matches must be equal. peer CHORUS_ANY_SOURCE receives from whichever
 * peer's next message carries the tag first. Point-to-point ops progress independently
 * of collectives and of each other (a send never waits for a later receive). */
#define CHORUS_ANY_SOURCE (-1)
chorus_result_t chorus_isend(chorus_comm_t *comm, const void *buf, size_t count,
                             chorus_dtype_t dtype, int peer, int tag, chorus_request_t **req);
chorus_result_t chorus_irecv(chorus_comm_t *comm, void *buf, size_t count,
                             chorus_dtype_t dtype, int peer, int tag, chorus_request_t **req);

/* ---- Requests ---- */
/* *done = 1 once complete; returns the operation's result then (CHORUS_SUCCESS else).
 * Polling starts a collective that was left for a waiter to run (below). */
chorus_result_t chorus_test(chorus_request_t *req, int *done);
/* Blocks until complete or timeout_ms passes (< 0: no limit beyond the op's own
 * deadline). Returns the operation's result or CHORUS_INPROGRESS on timeout. Where the
 * host's ranks outnumber half its cores (no spinning), a CPU collective posted right after
 * another is left queued for its waiter, and a wait without a limit runs it (and any
 * queued before it) on the calling thread; one nobody waits for or polls starts within
 * half a millisecond. */
chorus_result_t chorus_wait(chorus_request_t *req, int timeout_ms);
/* Calls fn(arg, result) once when the request completes, on the thread that completes it:
 * the library's, or one waiting in chorus_wait that ran the collective (at once, on the
 * caller's thread, if already complete). At most one callback. */
chorus_result_t chorus_request_on_complete(chorus_request_t *req,
                                           void (*fn)(void *arg, chorus_result_t res),
                                           void *arg);
/* The error text of a failed request ("" while pending or on success). */
const char *chorus_request_error(chorus_request_t *req);
uint64_t chorus_request_seq(const chorus_request_t *req);
/* For a completed receive from CHORUS_ANY_SOURCE: the sending rank. */
int chorus_request_source(const chorus_request_t *req);
void chorus_request_free(chorus_request_t *req);

/* ---- Parameters (CHORUS_<NAME>, else NCCL_<NAME> where marked) ---- */
typedef struct {
  const char *name;     /* without prefix, e.g. "BUFFSIZE" */
  const char *type;     /* "int", "size", "string", "bool" */
  const char *default_value;
  const char *doc;
  int nccl_fallback;    /* 1 if NCCL_<NAME> is honoured when CHORUS_<NAME> is unset */
} chorus_param_info_t;
int chorus_param_count(void);
const chorus_param_info_t *chorus_param_get_info(int index);
/* The value in force and where it came from ("CHORUS_X", "NCCL_X" or "default").
 * Writes at most cap bytes of value (NUL-terminated). Returns 0, or -1 if unknown. */
int chorus_param_value(const char *name, char *value, size_t cap, const char **source);

/* ---- Tuner: which algorithm a collective would use, without a communicator ----
 * The same decision a communicator makes for each collective (one code path): the forced
 * algorithm from CHORUS_ALGO where it can run, else the cheapest by the cost model among
 * the algorithms this build implements whose constraints the topology passes. */
#define CHORUS_TUNE_NAME_MAX 16
#define CHORUS_TUNE_MAX_CANDIDATES 16
typedef struct {
  int nranks;          /* >= 1 */
  int ranks_per_host;  /* 1..nranks: hosts hold this many ranks, the last one the remainder */
  int shm;             /* 1: ranks of one host use shared memory; 0: TCP (CHORUS_SHM_DISABLE=1) */
  int spin;            /* 1: every rank's engine spins (CHORUS_SPIN_COUNT > 0, or by default
                        * two cores per rank on every host), which makes socket steps cheaper;
                        * 0: not every one; -1: as ranks_per_host ranks on this machine would
                        * (its CHORUS_SPIN_COUNT and this process's cores) */
} chorus_tune_topology_t;
typedef struct {
  char algo[CHORUS_TUNE_NAME_MAX];
  double predicted_us;     /* < 0: the model has no estimate for this algorithm */
  int implemented;         /* 0 only with CHORUS_TUNE_UNIMPLEMENTED */
} chorus_tune_candidate_t;
typedef struct {
  char algo[CHORUS_TUNE_NAME_MAX];  /* the choice */
  double predicted_us;              /* its predicted time (< 0: no estimate) */
  int forced;                       /* 1: chosen because CHORUS_ALGO names it */
  int fell_back;                    /* 1: CHORUS_ALGO names algorithms that cannot run here */
  int nhosts;
  int spin;                         /* the topology's spin, -1 resolved */
  int ncandidates;                  /* every algorithm that could run, cheapest first */
  chorus_tune_candidate_t candidates[CHORUS_TUNE_MAX_CANDIDATES];
} chorus_tune_plan_t;
/* flags: also consider algorithms this build does not implement (model only). */
#define CHORUS_TUNE_UNIMPLEMENTED 1u
/* collective: "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
 * "all_to_all", "gather", "scatter", "barrier" (any case, underscores optional).
 * bytes: the larger buffer of one rank, as in nccl-tests: the vector of all_reduce,
 * broadcast and reduce; the whole output of all_gather and gather; the whole input of
 * reduce_scatter, scatter and all_to_all; ignored for barrier. algo_override: NULL reads
 * CHORUS_ALGO (else NCCL_ALGO) as a communicator would; "" ignores it; else a value in
 * CHORUS_ALGO's syntax. Thread-safe, allocates nothing. Returns CHORUS_ERR_INVALID with the
 * reason in chorus_comm_error(NULL) for a bad argument, override or CHORUS_TUNE_MODEL. */
chorus_result_t chorus_tune_plan(const char *collective, size_t bytes,
                                 const chorus_tune_topology_t *topo, const char *algo_override,
                                 unsigned flags, chorus_tune_plan_t *plan);

/* ---- CUDA device memory ----
 * Builds with CUDA only (chorus_cuda_built() == 1); elsewhere chorus_cuda_begin returns
 * CHORUS_ERR_UNSUPPORTED. Between chorus_cuda_begin and chorus_cuda_end on one thread, every
 * operation that thread issues on comm takes its buffers as memory of CUDA device `device`
 * and starts only after `event` (a cudaEvent_t the caller recorded on its stream, or NULL)
 * has completed: the operation is ordered after the caller's stream without blocking the
 * caller. When its request completes, the operation's device work is queued but may still
 * run: it is finished once `end_event` (a cudaEvent_t the caller created, or NULL) has
 * completed. The core records end_event (on its own stream) before the request completes,
 * or never records it when the data was already final at completion (an event never
 * recorded counts as complete). So: a caller's stream that waits on end_event after the
 * request completed is ordered after the operation, and the buffers may be reused once
 * end_event has completed. Both events must stay valid until then. One communicator serves
 * one device. */
int chorus_cuda_built(void);
chorus_result_t chorus_cuda_begin(chorus_comm_t *comm, int device, void *event,
                                  void *end_event);
chorus_result_t chorus_cuda_end(chorus_comm_t *comm);
/* Loads Chorus's CUDA kernels into the context of `device` (-1: the calling thread's
 * current device) if that context exists, or, with make_context, into a context made for
 * it (the device a group was bound to). CUDA loads a kernel at its first
 * launch, and the load waits for everything the device runs: done early (group creation,
 * a communicator's first device operation), no later operation waits for the device that
 * way. Once per device and process. Returns how many kernels it loaded now (0: none, none
 * needed, or no context yet), or -1 on a CUDA error (the operation that first launches a
 * kernel reports it). Without CUDA: 0. */
int chorus_cuda_preload(int device, int make_context);

/* ---- Flight recorder ----
 * Each communicator keeps its last CHORUS_TRACE_BUFFER_SIZE operations (sequence number,
 * kind, counts, dtype, reduce op, root or peer, algorithm, state, timestamps). They are
 * written as JSON to CHORUS_TRACE_DIR when an operation fails, on CHORUS_TRACE_SIGNAL, and
 * by these calls. dir: NULL or "" takes CHORUS_TRACE_DIR (CHORUS_ERR_INVALID if that is
 * unset too); created if missing. reason is stored in the file ("api" if NULL). The file's
 * path goes to path_out (cap bytes, may be NULL). The reason of a failure is in
 * chorus_comm_error(NULL). */
chorus_result_t chorus_trace_dump(chorus_comm_t *comm, const char *dir, const char *reason,
                                  char *path_out, size_t cap);
/* The same for every communicator of the process; paths (may be NULL) receives their file
 * names, one per line, as far as cap allows; *written (may be NULL) how many were written. */
chorus_result_t chorus_trace_dump_all(const char *dir, const char *reason, char *paths,
                                      size_t cap, int *written);
/* The job-wide rank of each member (n == size), shown in the records and used in their file
 * names; splits inherit them. Optional. */
chorus_result_t chorus_comm_set_global_ranks(chorus_comm_t *comm, const int *ranks, int n);

const char *chorus_version(void);

#ifdef __cplusplus
}
#endif
#endif /* CHORUS_H */
