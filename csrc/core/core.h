/* core.h - internal declarations shared by the C core: results and check macros,
 * logging, parameters, dtype helpers, reduction kernels, the transport vtable and
 * the communicator/operation structures. Not installed; not part of the public API. */
#ifndef CHORUS_CORE_H
#define CHORUS_CORE_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chorus.h"

/* ------------------------------------------------------------------ logging (log.c) */
enum log_level { LOG_NONE = 0, LOG_WARN = 1, LOG_INFO = 2, LOG_TRACE = 3 };
enum log_subsys {
  SUB_INIT = 1 << 0,
  SUB_COLL = 1 << 1,
  SUB_TRANSPORT = 1 << 2,
  SUB_NET = 1 << 3,
  SUB_SHM = 1 << 4,
  SUB_TUNE = 1 << 5,
  SUB_ALLOC = 1 << 6,
  SUB_P2P = 1 << 7,
  SUB_ALL = 0xff
};
/* Lines look like "host:pid:rank chorus LEVEL SUBSYS message". rank < 0 prints "-". */
void chorus_log(int level, int subsys, int rank, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int chorus_log_enabled(int level, int subsys);
#define WARN(rank, ...) chorus_log(LOG_WARN, SUB_ALL, (rank), __VA_ARGS__)
#define INFO(sub, rank, ...)                                                                 \
  do {                                                                                       \
    if (chorus_log_enabled(LOG_INFO, (sub))) chorus_log(LOG_INFO, (sub), (rank), __VA_ARGS__); \
  } while (0)
#define TRACE(sub, rank, ...)                                                                  \
  do {                                                                                         \
    if (chorus_log_enabled(LOG_TRACE, (sub))) chorus_log(LOG_TRACE, (sub), (rank), __VA_ARGS__); \
  } while (0)

/* ------------------------------------------------------------- parameters (param.c) */
/* X(ID, NAME, TYPE, DEFAULT, NCCL_FALLBACK, DOC). TYPE is one of int, size, bool, string.
 * size accepts K/M/G suffixes (powers of 1024). The README table is printed from this. */
#define CHORUS_PARAM_TABLE(X)                                                                 \
  X(DEBUG, "DEBUG", "string", "WARN", 1, "Log level: NONE, WARN, INFO or TRACE.")              \
  X(DEBUG_SUBSYS, "DEBUG_SUBSYS", "string", "ALL", 1,                                         \
    "Comma list of subsystems to log (INIT,COLL,TRANSPORT,NET,SHM,TUNE,ALLOC,P2P or ALL); "   \
    "^ in front excludes.")                                                                    \
  X(DEBUG_FILE, "DEBUG_FILE", "string", "", 1,                                                \
    "Write the log to this file instead of stderr; %h is replaced by the host name, %p by "  \
    "the pid.")                                                                               \
  X(TIMEOUT, "TIMEOUT", "int", "0", 0,                                                        \
    "Seconds any wait may last before the operation fails; 0 takes the process group's "      \
    "timeout (or 1800 s for pure-C users who pass none).")                                    \
  X(BUFFSIZE, "BUFFSIZE", "size", "4M", 1,                                                    \
    "Bytes of the staging ring of each connection and direction (shared memory and "          \
    "sockets).")                                                                               \
  X(SHM_DISABLE, "SHM_DISABLE", "bool", "0", 1,                                               \
    "1 disables the shared-memory transport: ranks on one host talk over TCP sockets.")       \
  X(SOCKET_IFNAME, "SOCKET_IFNAME", "string", "", 1,                                          \
    "Network interfaces to use for sockets between hosts: prefix list, ^ to exclude, = for "  \
    "an exact name. Empty: the first interface that is up and not loopback.")                 \
  X(SOCKET_FAMILY, "SOCKET_FAMILY", "string", "", 1,                                          \
    "Address family advertised for sockets between hosts: AF_INET or AF_INET6. Empty: IPv4 "  \
    "where the chosen interface has it, else IPv6 (link-local only if nothing else).")        \
  X(NSOCKS_PERTHREAD, "NSOCKS_PERTHREAD", "int", "-1", 1,                                     \
    "TCP connections per peer and channel, striped in fixed chunks (1 to 16); -1: 1 on the "  \
    "same host, 4 between hosts.")                                                            \
  X(SPIN_COUNT, "SPIN_COUNT", "int", "-1", 0,                                                \
    "Polls of an idle connection before the waiting thread yields the core, then sleeps; "    \
    "-1: 2000 when the host has two cores per local rank (its engine thread and its own), "   \
    "else 0. Above 0, an idle engine also watches for the next post for 100 us, and a wait "  \
    "polls its request for 50 us, before sleeping. The tuner uses faster socket constants "   \
    "when every rank's engine spins.")                                                        \
  X(SHM_SCRATCH, "SHM_SCRATCH", "size", "4M", 0,                                              \
    "Bytes of shared memory per rank for the same-host direct-access algorithms (oneshot, "  \
    "twoshot), rounded up to 8 KiB; messages are processed in chunks of half of it. 0, or "  \
    "a half under 64 bytes per rank, turns them off (chorus.tune's plan too).")              \
  X(SHM_THREADS, "SHM_THREADS", "int", "-1", 0,                                             \
    "Threads per rank (the engine's own included) that split big same-host copies and "      \
    "reductions; -1: 3/4 of the cores the host's ranks may use (the union of their "         \
    "affinity masks) divided by their number, 1 to 4.")                                      \
  X(CUDA_SCRATCH, "CUDA_SCRATCH", "size", "32M", 0,                                         \
    "Bytes of device memory per rank that same-host peers map through CUDA IPC for device "   \
    "collectives; messages are processed in chunks of half of it.")                          \
  X(CUDA_IPC, "CUDA_IPC", "bool", "1", 0,                                                     \
    "0: device collectives never map peers' memory; they are staged through pinned host "     \
    "memory and the host algorithms (the path used between hosts).")                         \
  X(CUDA_HOST_MAX, "CUDA_HOST_MAX", "size", "64K", 0,                                       \
    "Device collectives whose buffers are at most this many bytes per rank go through "      \
    "pinned host memory and the host algorithms even where CUDA IPC maps peers (two copies "   \
    "beat several device synchronisations for small messages).")                             \
  X(CUDA_SAME_GPU, "CUDA_SAME_GPU", "bool", "1", 0,                                         \
    "1: when every rank of a communicator is on one GPU, its lowest rank runs each device "     \
    "collective alone, straight on every rank's buffers (mapped through CUDA IPC), ordered "   \
    "by IPC events: no host copy, and no rank's host waits for the GPU. 0: the IPC scratch "   \
    "or staged paths.")                                                                     \
  X(SOCKET_THREADS, "SOCKET_THREADS", "int", "-1", 0,                                      \
    "Helper threads per rank that make the system calls of socket payloads of 1 MiB or "  \
    "more (sends, receives, and receives a reduction reads as they arrive), so that peers "  \
    "and directions move at once; 0: the engine makes every call. -1: the cores per local rank " \
    "less one, at most 4 and one per peer (0 on hosts with a core or less per rank).")       \
  X(SOCKET_SNDBUF, "SOCKET_SNDBUF", "size", "0", 0,                                          \
    "SO_SNDBUF/SO_RCVBUF for data sockets; 0 leaves the kernel's autotuning.")              \
  X(ALGO, "ALGO", "string", "", 1,                                                            \
    "Algorithms to use: a name for every collective (ring), or per collective "              \
    "(allreduce:ring,allgather:rd); a list lets the tuner choose among it, ^ excludes. "      \
    "Empty: the tuner chooses. Unknown names fail communicator creation.")                   \
  X(TUNE_MODEL, "TUNE_MODEL", "string", "", 0,                                                \
    "Override the tuner's measured constants: shm=, socket=, socket_spin=, "                   \
    "net=LAT_US:OVERHEAD_US:GBPS, reduce=GBPS, copy=GBPS (comma list; empty fields keep the "  \
    "measured value). socket= also sets socket_spin=, the link used where every rank's "      \
    "engine spins.")                                                                          \
  X(TRACE_BUFFER_SIZE, "TRACE_BUFFER_SIZE", "int", "2000", 0,                                 \
    "Operations each communicator's flight recorder keeps (the last ones: kind, sizes, "      \
    "state, timestamps); 0 disables the recorder.")                                          \
  X(TRACE_DIR, "TRACE_DIR", "string", "", 0,                                                  \
    "Directory for flight records: when an operation fails or times out, each rank writes "  \
    "one JSON file per communicator there (python -m chorus.trace DIR reads them); also the " \
    "default of on-demand dumps. Empty: no automatic dumps.")                                 \
  X(TRACE_SIGNAL, "TRACE_SIGNAL", "string", "", 0,                                            \
    "Signal (SIGUSR2, USR2 or a number) on which every communicator of the process writes " \
    "its flight record to CHORUS_TRACE_DIR; installed with the first communicator. Empty: "  \
    "none.")                                                                                 \
  X(HOSTID, "HOSTID", "string", "", 0,                                                      \
    "Host identity ranks compare to find same-host peers; empty: host name and boot id. "    \
    "For containers sharing a kernel, and tests that simulate several hosts.")              \
  X(IB_DISABLE, "IB_DISABLE", "bool", "0", 1,                                               \
    "1: never use InfiniBand/RoCE verbs; ranks on different hosts use TCP sockets.")        \
  X(IBVERBS_LIB, "IBVERBS_LIB", "string", "", 0,                                            \
    "libibverbs to load with dlopen (a file name or path); empty: libibverbs.so.1.")        \
  X(IB_HCA, "IB_HCA", "string", "", 1,                                                      \
    "RDMA devices to use: prefix list with optional :port (mlx5_0:1,mlx5_1), ^ to "         \
    "exclude, = for exact names. Empty: every device with an active port.")                 \
  X(IB_GID_INDEX, "IB_GID_INDEX", "int", "-1", 1,                                          \
    "RoCE GID table index; -1 picks a RoCE v2 GID (IPv4-mapped first).")                    \
  X(IB_TIMEOUT, "IB_TIMEOUT", "int", "20", 1,                                               \
    "RC QP local ACK timeout exponent (4.096 us x 2^value).")                               \
  X(IB_RETRY_CNT, "IB_RETRY_CNT", "int", "7", 1, "RC QP transport retry count (0-7).")     \
  X(IB_SL, "IB_SL", "int", "0", 1, "InfiniBand service level of the QPs.")                  \
  X(IB_TC, "IB_TC", "int", "0", 1, "RoCE traffic class of the QPs (GRH).")                 \
  X(IB_QPS_PER_CONNECTION, "IB_QPS_PER_CONNECTION", "int", "1", 1,                          \
    "Queue pairs per verbs connection (1-8); chunks go round-robin over them and over the "  \
    "selected NICs.")                                                                       \
  X(NET_GDR_LEVEL, "NET_GDR_LEVEL", "string", "", 1,                                        \
    "GPUDirect RDMA for device buffers: LOC (never) or PIX/PXB/PHB/SYS (allowed); empty: "   \
    "allowed when dma-buf or nvidia-peermem is present. Only logged: device buffers are "    \
    "staged through host memory between hosts for now.")

enum param_id {
#define X_ENUM(ID, NAME, TYPE, DEF, NCCL, DOC) PARAM_##ID,
  CHORUS_PARAM_TABLE(X_ENUM)
#undef X_ENUM
  PARAM_COUNT
};
/* Values are read from the environment once (first use) and cached. */
int64_t param_int(enum param_id id);       /* int, size and bool parameters */
const char *param_str(enum param_id id);   /* string parameters; never NULL */
/* Parsers, exposed for unit tests and fuzzing. Return 0 on success, -1 on bad input. */
int param_parse_int(const char *s, int64_t *out);
int param_parse_size(const char *s, int64_t *out);
int param_parse_bool(const char *s, int64_t *out);
/* Re-reads the environment (tests only). */
void param_reset_cache(void);

/* ------------------------------------------------------ results and checks */
/* Internal error reporting: record a formatted message into the communicator's error
 * buffer (first error wins) and return res. */
struct chorus_comm;
chorus_result_t comm_set_error(struct chorus_comm *comm, chorus_result_t res, const char *fmt,
                               ...) __attribute__((format(printf, 3, 4)));

#define CHECK(call)                                 \
  do {                                              \
    chorus_result_t res_ = (call);                  \
    if (res_ != CHORUS_SUCCESS) return res_;        \
  } while (0)
#define CHECK_GOTO(call, res, label)                \
  do {                                              \
    (res) = (call);                                 \
    if ((res) != CHORUS_SUCCESS) goto label;        \
  } while (0)

/* ------------------------------------------------------ dtypes and reductions (reduce.c) */
static inline size_t dtype_size(chorus_dtype_t d) {
  static const size_t sz[CHORUS_DTYPE_COUNT] = {1, 1, 2, 4, 8, 2, 2, 4, 8, 1, 1, 1};
  return (unsigned)d < CHORUS_DTYPE_COUNT ? sz[d] : 0;
}
/* Is op valid for dtype (BAND/BOR/BXOR only on integers and bool)? */
bool reduce_op_supported(chorus_dtype_t dtype, chorus_op_kind_t op);
/* out[i] = op(in[0][i], in[1][i], ..., in[n-1][i]) for i < count, combining inputs in
 * the order given. fp16/bf16 accumulate in float32, float32 in float64, so the result is
 * rounded once. out may alias any in[k]. AVG and PREMUL_SUM are not handled here: they
 * are SUM plus reduce_scale / reduce_premul. bool: SUM/MAX/BOR = or, PROD/MIN/BAND = and,
 * BXOR = xor. n >= 1. */
void reduce_n(void *out, const void *const *in, int n, size_t count, chorus_dtype_t dtype,
              chorus_op_kind_t op);
/* out[i] = in[i] * factor (rounded to dtype); integers: truncated toward zero after the
 * multiplication in double. out may equal in. */
void reduce_premul(void *out, const void *in, size_t count, chorus_dtype_t dtype,
                   double factor);
/* buf[i] = buf[i] / divisor: floats divide in their accumulator type, integers truncate. */
void reduce_divide(void *buf, size_t count, chorus_dtype_t dtype, int divisor);
/* memcpy that bypasses the caches for the destination (non-temporal stores) where the
 * CPU has them: for outputs too big to stay cached, it saves the read-for-ownership. */
void copy_stream(void *dst, const void *src, size_t n);

/* workers.c: helper threads of a communicator for big same-host copies and reductions.
 * workers_for runs fn over [0, count) split into cache-line aligned ranges, one per
 * thread (the caller's included), and returns when all are done; small jobs run in the
 * caller alone. Engine thread only. */
typedef void (*workers_fn)(void *ctx, size_t begin, size_t end);
void workers_for(struct chorus_comm *comm, size_t count, size_t elem_size, workers_fn fn,
                 void *ctx);
void workers_copy(struct chorus_comm *comm, void *dst, const void *src, size_t bytes,
                  int stream);
/* reduce_n over ranges, then reduce_divide by divisor where divisor > 1 (AVG) */
void workers_reduce(struct chorus_comm *comm, void *out, const void *const *in, int n,
                    size_t count, chorus_dtype_t dtype, chorus_op_kind_t kind, int divisor);
void workers_premul(struct chorus_comm *comm, void *dst, const void *src, size_t count,
                    chorus_dtype_t dtype, double factor);
/* dst[i] = src[i / slice][i] for i < bytes: the slices of a chunk gathered from the
 * buffers that hold them (each src[p] is addressed from the chunk's start) */
void workers_gather(struct chorus_comm *comm, void *dst, const uint8_t *const *src,
                    size_t slice, size_t bytes, int stream);
/* Several copies as one job: the helpers split their total, not each copy, so n small
 * copies cost one hand-off instead of n. */
struct copy_seg {
  void *dst;
  const void *src;
  size_t len;
};
void workers_copy_list(struct chorus_comm *comm, const struct copy_seg *segs, int nseg,
                       int stream);
void workers_stop(struct chorus_comm *comm);
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);     /* round to nearest even */
float bf16_to_float(uint16_t b);
uint16_t float_to_bf16(float f);     /* round to nearest even, NaN preserved */
/* float8 as torch converts: round to nearest even; e4m3fn has no infinity and saturates
 * (values beyond 448, inf too, give +-448); e5m2 overflows to inf; a NaN becomes
 * 0x7f | sign in both */
float e4m3_to_float(uint8_t x);
uint8_t float_to_e4m3(float f);
float e5m2_to_float(uint8_t x);
uint8_t float_to_e5m2(float f);

/* ------------------------------------------------------ netutil.c */
int64_t now_ns(void);                             /* CLOCK_MONOTONIC in ns */
/* Cores this process may run on: its affinity mask (a cpuset, taskset, a launcher's
 * binding), else the online count. */
long cores_usable(void);
/* The same as a bit mask of CPU_MASK_BYTES bytes (bit c of byte c/8: CPU c may run us);
 * returns the count, cores_usable()'s. */
#define CPU_MASK_BYTES 128
long cpu_mask_of_process(uint8_t *mask);
int ms_until(int64_t deadline_ns, int cap_ms);    /* ms left, at most cap_ms, 0 if past */
/* Moves exactly len bytes on a non-blocking fd, waiting with poll until deadline_ns.
 * Returns 0, -1 on EOF while reading, or an errno value (ETIMEDOUT at the deadline). */
int io_full(int fd, void *buf, size_t len, int64_t deadline_ns, int writing);
void put32(uint8_t *p, uint32_t v);               /* big-endian wire integers */
uint32_t get32(const uint8_t *p);

/* ------------------------------------------------------ transports */
/* A connection is one ordered byte stream in each direction between two ranks. The
 * sending side writes through reserve/commit, the receiving side reads through
 * peek/consume; both are non-blocking and may return 0 bytes. Transports never
 * interpret the bytes. Every call returns CHORUS_SUCCESS or an error that the
 * transport has already described with comm_set_error (peer named).
 * Alignment contract: a receive window may end anywhere inside the bytes received so far,
 * but where it ends because of the ring's end, that point is a multiple of 16 bytes in the
 * stream (ring sizes are multiples of 16 and ring index == stream position mod 16), so a
 * 16-byte-aligned payload never has an element split across the wrap. */
typedef struct conn conn_t;
struct pollfd;
struct transport_ops {
  const char *name;
  /* Contiguous writable space at the tail of the outgoing stream (len may be 0). */
  chorus_result_t (*reserve)(conn_t *c, void **ptr, size_t *len);
  chorus_result_t (*commit)(conn_t *c, size_t len);
  /* Contiguous readable bytes at the head of the incoming stream (len may be 0). */
  chorus_result_t (*peek)(conn_t *c, const void **ptr, size_t *len);
  chorus_result_t (*consume)(conn_t *c, size_t len);
  /* Move bytes (sockets do their system calls here) and check the peer is alive.
   * *progressed is set to 1 if any byte moved. */
  chorus_result_t (*progress)(conn_t *c, int *progressed);
  /* For poll(): fill *pfd and return 1, or return 0 if this transport has no fd. */
  int (*pollfd)(conn_t *c, struct pollfd *pfd);
  void (*close)(conn_t *c);
  /* Optional (NULL where a transport has none), for big payloads without the rings' copy:
   * write_direct sends what the outgoing ring still holds and then up to n bytes of src
   * (sockets: in one system call; verbs: the NIC reads a registered src itself), *wrote
   * counting the bytes of src the transport is done with (the caller may reuse them; a
   * call that returns fewer is repeated with the rest); read_direct, only when no received byte is
   * buffered, receives up to n bytes of the stream straight into dst, and what follows
   * them into the ring (*got: bytes of dst filled). Both set *progressed when any byte
   * moved, and leave the connection polled for the direction they still need. */
  chorus_result_t (*write_direct)(conn_t *c, const void *src, size_t n, size_t *wrote,
                                  int *progressed);
  chorus_result_t (*read_direct)(conn_t *c, void *dst, size_t n, size_t *got, int *progressed);
  /* Optional hint: the next n bytes of the incoming stream are one payload that will be
   * read through peek/consume (a reducing receive). Sockets with I/O threads receive it
   * into a buffer of the connection on a thread; peek then returns those bytes as they
   * arrive. Never fails the connection by itself. */
  chorus_result_t (*stage)(conn_t *c, size_t n);
};
struct conn {
  const struct transport_ops *ops;
  struct chorus_comm *comm;
  int peer;          /* rank of the other side in comm */
  int channel;       /* CHAN_COLL or CHAN_P2P */
};
enum { CHAN_COLL = 0, CHAN_P2P = 1, CHAN_COUNT = 2 };

/* Per-peer facts exchanged at init (bootstrap all-gather). */
#define HOSTID_LEN 96
#define ADDR_LEN 64
struct peer_info {
  char hostid[HOSTID_LEN];   /* hostname + boot id */
  int32_t pid;
  int32_t shm_ok;            /* shared memory usable by this rank */
  char sock_addr[ADDR_LEN];  /* "ip:port" of its listening socket, "" if none */
  char hostname[64];
  uint8_t cpus[CPU_MASK_BYTES]; /* its affinity mask (cpu_mask_of_process) */
  int32_t spin_param;        /* its CHORUS_SPIN_COUNT (-1: automatic), see spin_count_for */
};

/* comm.c: host_of[r] for every rank, hosts numbered in order of their lowest rank; returns
 * the number of hosts, -1 when out of memory. */
int number_hosts(const struct peer_info *peers, int n, int *host_of);

/* The spin count of an engine: CHORUS_SPIN_COUNT where set (>= 0), else 2000 where the host
 * has two cores per local rank (the engine thread and the rank's own), else 0: spinning
 * only pays when nobody waits for a core, since a spinning rank would steal the one the
 * peer it waits for needs. engine_start applies it to this rank; comm.c to every rank of the
 * peer table, so that the tuner's choice of constants is the same on every rank. */
static inline int spin_count_for(int64_t param, int nlocal, long cores) {
  if (param >= 0) return param > 1000000000 ? 1000000000 : (int)param;
  return (long)nlocal * 2 <= cores ? 2000 : 0;
}

/* The call fingerprint's measurement switch (tools/fp_cost.sh; never in a shipped build,
 * where FP_OFF() is the constant 0 and the code under it compiles away): built with
 * -DCHORUS_FP_SWITCH, the fingerprint is on or off at run time, as chorus_fp_off (comm.c)
 * says. tests/c/bench_comm flips it between calls, on every rank before the same call, so
 * that one run times calls with and without it, interleaved. While it is off, ranks that
 * disagree about a call go undetected. */
#ifdef CHORUS_FP_SWITCH
extern _Atomic int chorus_fp_off;
#define FP_OFF() atomic_load_explicit(&chorus_fp_off, memory_order_relaxed)
#else
#define FP_OFF() 0
#endif

/* shm.c */
struct shm_state;
/* Published by each rank in its own segment for the direct-access algorithms: progress
 * counters (chunk generations) and, per scratch half, the fingerprint of what it holds.
 * The two fingerprints share the cache line of `posted`, the flag a peer polls before it
 * reads them, so checking a peer's fingerprint costs no cache miss of its own (they had lines
 * of their own before, fp[1] straddling two: docs/PERFORMANCE.md has tools/fp_cost.sh's
 * before and after). Hence 32-bit fields: the 64-bit sequence number and count in halves,
 * the low 32 bits of the generation (a peer's is at most one generation from ours when read). */
struct shm_fp {
  uint32_t seq_lo, seq_hi, count_lo, count_hi;
  uint32_t gen;   /* low 32 bits */
  int32_t root;
  uint8_t kind, dtype, redop, algo;
};
struct shm_flags {
  _Atomic uint64_t posted;   /* generation whose input is in the scratch half gen % 2 */
  struct shm_fp fp[2];       /* 56 bytes: the rest of posted's cache line */
  _Atomic uint64_t reduced;  /* generation whose owned slice is reduced (two-shot) */
  char pad1[56];
  _Atomic uint64_t done;     /* generation this rank finished reading from everyone */
  char pad2[56];
  _Atomic uint64_t gpu_idle; /* cuda.c teardown: this rank's device work is all finished */
  char pad3[56];
};
_Static_assert(sizeof(struct shm_fp) == 28 && offsetof(struct shm_flags, reduced) == 64,
               "the fingerprints must fill posted's cache line exactly");
size_t shm_scratch_half(const struct chorus_comm *comm);  /* 0 without shm */
/* The scratch a segment gets from CHORUS_SHM_SCRATCH: two page-aligned halves. */
uint64_t shm_scratch_bytes(void);
void *shm_scratch(struct chorus_comm *comm, int local, int half);
struct shm_flags *shm_flags_of(struct chorus_comm *comm, int local);
void shm_notify_local(struct chorus_comm *comm);          /* rings every local doorbell */
void shm_mark_waiting(struct chorus_comm *comm, int peer); /* check its liveness while idle */
chorus_result_t shm_setup(struct chorus_comm *comm);  /* connects every same-host peer */
void shm_teardown(struct chorus_comm *comm);
/* Futex word of this rank; rung by peers when they write to or read from us. */
void shm_wait_doorbell(struct chorus_comm *comm, uint32_t seen, int timeout_us);
uint32_t shm_doorbell_value(struct chorus_comm *comm);
void shm_ring_own_doorbell(struct chorus_comm *comm);
/* Tells every local peer that this rank failed (they fail their waits at once). */
void shm_publish_error(struct chorus_comm *comm, const char *msg);
/* A local peer that published a failure, or -1. Any thread. */
int shm_failed_peer(struct chorus_comm *comm);

/* socket.c */
struct sock_state;
/* Opens the listening socket, chooses the interface; fills info->sock_addr. */
chorus_result_t socket_listen(struct chorus_comm *comm, struct peer_info *info);
/* Connects (CHAN_COUNT connections) to every peer p with comm->conns[c][p] still NULL
 * and p != rank, authenticating with comm->secret; closes the listener afterwards. */
chorus_result_t socket_connect_all(struct chorus_comm *comm);
void socket_teardown(struct chorus_comm *comm);
/* After this rank's communicator failed (engine thread): publishes the error in the store
 * (key failure/<rank>) and ends its side of every socket connection, so that peers blocked
 * on other ranks fail, once they have read what it sent, with this rank's reason instead of
 * at their timeout. Once. */
void socket_abort_conns(struct chorus_comm *comm);
/* Stops the rank's socket I/O threads for good (engine thread, or after it stopped): once it
 * returns, no thread moves a user's buffer; later big payloads go by the engine. */
void socket_stop_io(struct chorus_comm *comm);
/* Connection setup messages (exposed for tests/fuzz/fuzz_wire.c). The acceptor checks a
 * complete hello (SOCK_HELLO_LEN bytes at h) against comm: NULL if acceptable, else the
 * reason (static text, or written into why). The connector checks the ack of peer on
 * channel for sub-connection stream (SOCK_ACK_LEN bytes): 1 if it is right. */
#define SOCK_HELLO_LEN 64
#define SOCK_ACK_LEN 20
const char *socket_hello_problem(struct chorus_comm *comm, const uint8_t *h, char *why,
                                 size_t cap);
int socket_ack_ok(const uint8_t *ack, int peer, int channel, int stream);

/* ib.c: the InfiniBand/RoCE verbs transport (libibverbs loaded at run time). ib_setup, after
 * the host map is known: where both ranks of a pair on different hosts have a usable NIC,
 * connects them over verbs (comm->conns set; sockets take the rest). ib_abort_conns
 * publishes this rank's failure for verbs peers (engine thread, once); ib_teardown frees the
 * NICs after the connections are closed. */
struct ib_state;
chorus_result_t ib_setup(struct chorus_comm *comm);
void ib_abort_conns(struct chorus_comm *comm);
void ib_teardown(struct chorus_comm *comm);

/* reg.c: buffers registered by the caller (chorus_comm_register). refs counts the caller's
 * registrations (user) plus the sends that use the buffer now; the entry and its memory
 * regions go with the last reference. ib_reg_create registers [start, end) on every opened
 * NIC (nothing where verbs is not in use); ib_reg_release deregisters it. reg_find returns
 * the registration covering [ptr, ptr + bytes) with a reference taken (reg_put drops it), or
 * NULL. reg_teardown releases what is left at destroy (after the connections closed). */
struct chorus_reg {
  struct chorus_reg *next;
  uintptr_t start, end;       /* page-aligned */
  int user, refs;
  void *ib;                   /* ib.c: one memory region per opened device, or NULL */
};
chorus_result_t ib_reg_create(struct chorus_comm *comm, struct chorus_reg *r);
void ib_reg_release(struct chorus_comm *comm, struct chorus_reg *r);
struct chorus_reg *reg_find(struct chorus_comm *comm, const void *ptr, size_t bytes);
void reg_put(struct chorus_comm *comm, struct chorus_reg *r);
void reg_teardown(struct chorus_comm *comm);

/* ------------------------------------------------------ bootstrap (bootstrap.c) */
/* Key/value helpers that prefix keys with comm->prefix. */
chorus_result_t bs_set(struct chorus_comm *comm, const char *key, const void *val, size_t len);
chorus_result_t bs_get(struct chorus_comm *comm, const char *key, void *buf, size_t len);
/* The same without recording an error in the communicator, for the failure path: try_get
 * waits at most timeout_ms and reports the stored length in *len. */
chorus_result_t bs_try_set(struct chorus_comm *comm, const char *key, const void *val,
                           size_t len);
chorus_result_t bs_try_get(struct chorus_comm *comm, const char *key, void *buf, size_t cap,
                           size_t *len, int timeout_ms);
/* Every rank contributes len bytes; out holds nranks * len bytes in rank order. */
chorus_result_t bs_allgather(struct chorus_comm *comm, const char *tag, const void *mine,
                             void *out, size_t len);
chorus_result_t bs_barrier(struct chorus_comm *comm, const char *tag);

/* ------------------------------------------------------ operations and requests */
enum op_kind {
  OP_ALLREDUCE = 0,
  OP_BROADCAST,
  OP_REDUCE,
  OP_ALLGATHER,
  OP_REDUCE_SCATTER,
  OP_GATHER,
  OP_SCATTER,
  OP_ALLTOALL,
  OP_BARRIER,
  OP_SEND,
  OP_RECV,
  OP_KIND_COUNT
};
const char *op_kind_name(enum op_kind k);

enum req_state { REQ_QUEUED = 0, REQ_STARTED = 1, REQ_DONE = 2 };
struct chorus_request {
  _Atomic int refs;           /* user + engine */
  _Atomic int state;
  chorus_result_t result;
  uint64_t seq;
  int source;
  char error[512];
  pthread_mutex_t mu;
  pthread_cond_t cv;
  void (*cb)(void *, chorus_result_t);
  void *cb_arg;
  struct chorus_comm *comm;
  int64_t spin_ns;            /* chorus_wait spins this long before it sleeps */
  int runs_inline;            /* chorus_wait may run the op itself (engine.c, "Waiters") */
};

struct op {
  enum op_kind kind;
  uint64_t seq;               /* collectives: comm sequence; p2p: per-peer message index */
  const void *sendbuf;
  void *recvbuf;
  size_t count;               /* elements (per-rank count where counts is NULL) */
  chorus_dtype_t dtype;
  chorus_redop_t op;
  int root;                   /* root, or peer for send/recv */
  int tag;
  size_t *counts;             /* v-variants: nranks entries (owned) */
  size_t *displs;             /* nranks entries (owned) */
  size_t *counts2;            /* alltoallv receive side (owned) */
  size_t *displs2;
  chorus_request_t *req;
  int64_t deadline_ns;        /* set when the op starts */
  size_t done_bytes;          /* p2p progress */
  int hdr_done;               /* p2p: header sent/received */
  int algo;                   /* collectives: enum algo_id chosen by algo_run (header flags) */
  int uniform;                /* all_to_all: issued as chorus_ialltoall (equal counts on every
                               * rank), so algorithms that need equal counts may be chosen */
  int on_device;              /* buffers are CUDA memory of device `device` (cuda.c) */
  int device;
  void *start_event;          /* cudaEvent_t the op waits for before touching the buffers */
  void *end_event;            /* cudaEvent_t recorded when the device work outlives the op */
  void *staging;              /* cuda.c: pinned host copy of a point-to-point payload */
  int64_t t_queued;           /* CLOCK_MONOTONIC ns at submission (flight recorder only) */
  uint64_t trace_id;          /* flight-recorder record + 1, 0 if none (trace.c) */
  struct op *next;
};

/* ------------------------------------------------------ the communicator */
struct chorus_comm {
  int rank, nranks;
  chorus_bootstrap_t bs;
  int bs_owner;               /* release bs when destroyed */
  char prefix[96];            /* bootstrap key prefix of this communicator */
  char name[64];
  int timeout_ms;
  uint64_t nsplits;
  uint8_t secret[32];         /* per-communicator secret from the store */
  uint64_t job_nonce;         /* random, names shm segments */

  struct peer_info *peers;    /* nranks entries */
  int nlocal;                 /* ranks on this host (this one included) */
  long local_cores;           /* cores of the union of their affinity masks (0: unknown) */
  int *local_rank_of;         /* rank -> index among local ranks, -1 if remote */
  int *host_of;               /* rank -> host index (hosts numbered by their lowest rank) */
  int nhosts;
  int max_per_host;           /* most ranks on any one host */
  int algo_force[OP_KIND_COUNT]; /* enum algo_id per collective from CHORUS_ALGO, -1: tuner */
  int last_algo;              /* enum algo_id of the last collective started (tests read it) */
  int stepwise_halves_ok;     /* tests: a forced schedule may round fp16/bf16 sums in steps
                               * (the simulator's inputs add exactly in any order) */
  struct tune_state *tune;    /* tune.c: model, overrides, what has been logged */
  struct workers *workers;    /* workers.c: helper threads, NULL until a big job needs them */
  int workers_tried;
  struct cuda_state *cuda;    /* cuda.c: stream, IPC scratch, staging; NULL until used */
  conn_t **conns[CHAN_COUNT]; /* [channel][peer], NULL for self */
  struct shm_state *shm;
  struct sock_state *sock;
  struct ib_state *ib;        /* ib.c: verbs NICs, NULL when not used */
  pthread_mutex_t reg_mu;     /* reg.c: guards regs */
  struct chorus_reg *regs;    /* buffers the caller registered */
  _Atomic uint64_t nregs_made; /* registrations made (a new one may cover a destination) */

  /* engine */
  pthread_t thread;
  int thread_started;
  pthread_mutex_t mu;
  pthread_cond_t idle_cv;
  pthread_mutex_t run_mu;               /* held by the thread running ops: engine or waiter */
  int napping;                          /* mu: the engine naps between ops (posts defer) */
  int kick;                             /* mu: a waiter left the engine work to finish */
  _Atomic int64_t last_run_ns;          /* when the last collective ended (engine or waiter) */
  _Atomic int inline_users;             /* waiters using comm from chorus_wait / chorus_test */
  struct op *queue_head, *queue_tail;   /* collectives, run in order */
  struct op *p2p_incoming;              /* posted p2p ops not yet taken by the engine */
  _Atomic uint64_t submits;             /* ops posted so far: an idle engine spins on it */
  struct op **p2p_send, **p2p_recv;     /* per peer FIFO heads (engine thread only) */
  struct op *p2p_any;                   /* receives from CHORUS_ANY_SOURCE */
  uint64_t *p2p_send_seq, *p2p_recv_seq;
  _Atomic uint64_t seq;                 /* next collective sequence number */
  _Atomic int stop;                     /* destroy: engine exits when the queue drains */
  _Atomic int aborted;
  _Atomic int failed;                   /* error recorded; every op fails */
  _Atomic uint32_t local_doorbell;      /* wake word when no shm segment exists */
  int wake_fd;                          /* eventfd, written on enqueue (sockets poll it) */
  int wake_polled;                      /* some connection has a pollfd: wake_fd is polled */
  chorus_result_t err;
  char errbuf[1024];
  pthread_mutex_t err_mu;
  struct op *current;                   /* op the engine runs now (for error text) */
  uint64_t failed_seq;                  /* collective whose failure failed the communicator
                                         * (0: none, or not a collective) */
  void *engine_priv;                    /* engine.c's per-peer p2p state */
  uint32_t db_seen;                     /* doorbell value at the last progress check */
  int spin;                             /* polls before yielding (SPIN_COUNT or auto) */
  int all_spin;                         /* every rank's engine spins (comm.c; the tuner) */
  uint64_t dgen;                        /* last direct-access chunk generation */

  /* flight recorder (trace.c) */
  struct trace_ring *trace;             /* NULL when CHORUS_TRACE_BUFFER_SIZE=0 */
  int *global_ranks;                    /* rank -> rank of the job, NULL if never given */
  struct chorus_comm *trace_next_comm;  /* the process's list of communicators */
  int trace_registered;
};

/* Cores the ranks of this host share, for the defaults that size spinning and threads: the
 * union of their affinity masks, so that a cpuset or taskset shared by every rank counts
 * once and per-rank bindings add up; this process's own count before the ranks met. */
static inline long host_cores(const struct chorus_comm *comm) {
  return comm->local_cores > 0 ? comm->local_cores : cores_usable();
}

/* engine.c */
chorus_result_t engine_start(struct chorus_comm *comm);
void engine_stop(struct chorus_comm *comm, int abort_now);
chorus_result_t engine_submit(struct chorus_comm *comm, struct op *op, chorus_request_t **req);
/* One turn of waiting inside an operation: progresses every connection and pending p2p
 * op, sleeps when nothing moves, checks deadline / abort / failure. Returns an error if
 * the current op must stop. */
chorus_result_t engine_poll_device(struct chorus_comm *comm, struct op *op, int *idle_iters);
chorus_result_t engine_poll(struct chorus_comm *comm, struct op *op, int *idle_iters);
void engine_wake(struct chorus_comm *comm);

/* msg.c: framed messages on a connection. Each message is a 32-byte header followed by
 * the payload, padded to 16 bytes so every payload starts 16-byte aligned in the stream. */
#define MSG_MAGIC 0x43485231u  /* "CHR1" */
struct msg_hdr {
  uint32_t magic;
  uint32_t seq;
  uint8_t kind;
  uint8_t dtype;
  uint8_t redop;
  uint8_t flags;
  int32_t root;              /* root, or tag for p2p */
  uint64_t count;            /* elements of the whole operation on the sender */
  uint64_t len;              /* payload bytes of this message */
};
/* Sending state of one message. */
struct msg_tx {
  conn_t *c;
  struct msg_hdr hdr;
  const uint8_t *buf;
  size_t len, pos;           /* pos counts header + payload + padding bytes written */
  int done;
  int direct;                /* the payload goes by write_direct, to its end */
};
struct msg_rx {
  conn_t *c;
  struct msg_hdr expect;     /* what this rank expects (len checked exactly) */
  struct msg_hdr got;
  size_t hdr_pos;
  size_t len, pos;           /* payload bytes expected / consumed */
  int hdr_ok, done;
  int direct;                /* the payload comes by read_direct, to its end */
  int stage;                 /* read through peek: offer the payload to ops->stage ... */
  int staged;                /* ... once (done) */
};
void msg_tx_init(struct msg_tx *tx, conn_t *c, const struct op *op, const void *buf, size_t len);
void msg_rx_init(struct msg_rx *rx, conn_t *c, const struct op *op, size_t len);
/* Writes as much as possible; sets tx->done at the end. */
chorus_result_t msg_tx_progress(struct msg_tx *tx, int *progressed);
/* Copies up to n bytes of src (zeros if src is NULL) into c's outgoing stream through its
 * ring (reserve / commit), as far as the ring has room; *wrote: bytes taken. */
chorus_result_t msg_stream_write(conn_t *c, const void *src, size_t n, size_t *wrote);
/* Copies as much as possible into dst (payload offset rx->pos); sets rx->done. */
chorus_result_t msg_rx_copy(struct msg_rx *rx, void *dst, int *progressed);
/* Zero-copy access: after the header is validated, the contiguous payload bytes
 * available now (at most the remaining payload). */
chorus_result_t msg_rx_peek(struct msg_rx *rx, const void **ptr, size_t *len);
chorus_result_t msg_rx_consume(struct msg_rx *rx, size_t len);
/* Reads just the header if available (for p2p matching); *ready = 1 once read. */
chorus_result_t msg_rx_header(struct msg_rx *rx, int *ready);

/* algo/ files: each collective's schedule. Run on the engine thread. */
const char *algo_name(int id); /* enum algo_id in algo/algo.h */
/* tune.c: reads CHORUS_ALGO into comm->algo_force and the cost model's inputs (after the
 * topology is known); a bad CHORUS_ALGO or CHORUS_TUNE_MODEL is CHORUS_ERR_INVALID.
 * tune_fini frees what tune_init made (safe if it never ran). */
chorus_result_t tune_init(struct chorus_comm *comm);
/* The same parameter checks alone, before any rank talks to another: every rank then fails
 * with the parameter's own message, not with the store error of a rank that left first. */
chorus_result_t tune_check_params(struct chorus_comm *comm);
void tune_fini(struct chorus_comm *comm);
chorus_result_t algo_run(struct chorus_comm *comm, struct op *op);
/* p2p progress (engine.c) */
chorus_result_t p2p_progress(struct chorus_comm *comm, int *progressed);

/* ------------------------------------------------------ CUDA (cuda.c) */
/* Builds without CHORUS_WITH_CUDA keep these entry points: an op can never be on a device
 * there (chorus_cuda_begin refuses), so they are not reached. */
/* Marks op as device memory when the calling thread is inside chorus_cuda_begin for comm. */
void cuda_tag_op(struct chorus_comm *comm, struct op *op);
/* Runs a device collective (engine thread): CUDA IPC over the direct-access algorithms
 * when every rank is on this host and maps the others' scratch, else staged through
 * pinned host memory and the host algorithms. */
chorus_result_t cuda_run(struct chorus_comm *comm, struct op *op);
/* Point-to-point on device memory, staged through pinned host memory (engine thread).
 * send_ready: 0 while the op's start event is pending, 1 once op->staging holds the
 * payload (sendbuf is then read from there). recv_begin points the receive at staging;
 * recv_end copies it to the device buffer. release frees the staging. */
chorus_result_t cuda_p2p_send_ready(struct chorus_comm *comm, struct op *op, int *ready);
chorus_result_t cuda_p2p_recv_begin(struct chorus_comm *comm, struct op *op);
chorus_result_t cuda_p2p_recv_end(struct chorus_comm *comm, struct op *op);
void cuda_p2p_release(struct chorus_comm *comm, struct op *op);
/* After the engine stopped: waits (briefly) until peers are done reading this rank's
 * scratch, then frees every CUDA resource of comm. */
void cuda_teardown(struct chorus_comm *comm);
/* The direct-access algorithms (algo/shm_direct.c) on device memory: */
size_t cuda_scratch_half(const struct chorus_comm *comm);
void *cuda_scratch(struct chorus_comm *comm, int local, int half);
chorus_result_t cuda_copy(struct chorus_comm *comm, void *dst, const void *src, size_t bytes);
chorus_result_t cuda_reduce(struct chorus_comm *comm, void *out, const void *const *in, int n,
                            size_t count, chorus_dtype_t dtype, chorus_op_kind_t kind,
                            int divisor);
chorus_result_t cuda_premul(struct chorus_comm *comm, void *out, const void *in, size_t count,
                            chorus_dtype_t dtype, double factor);
/* Waits (progressing the engine, so timeouts and aborts hold) until the device work queued
 * so far is done: before a rank tells its peers that its scratch holds data, or that it is
 * done reading theirs. */
chorus_result_t cuda_drain(struct chorus_comm *comm, struct op *op);

/* ------------------------------------------------------ flight recorder (trace.c) */
/* A ring of the last CHORUS_TRACE_BUFFER_SIZE operations per communicator. Every write
 * comes from the engine thread (no lock, no allocation); dumps read it from any thread. */
chorus_result_t trace_init(struct chorus_comm *comm);
void trace_fini(struct chorus_comm *comm);
/* The engine took op: a new record, started at started_ns (0: still queued, p2p). */
void trace_op_begin(struct chorus_comm *comm, struct op *op, int64_t started_ns);
void trace_op_start(struct chorus_comm *comm, struct op *op, int64_t now); /* p2p bound */
void trace_op_algo(struct chorus_comm *comm, struct op *op);               /* op->algo set */
void trace_op_end(struct chorus_comm *comm, struct op *op, chorus_result_t res);
/* An op failed: writes the record to CHORUS_TRACE_DIR (once per communicator). */
void trace_on_failure(struct chorus_comm *comm, chorus_result_t res);
/* The process's list of communicators, for dumps of all of them (signal, API). */
void trace_register(struct chorus_comm *comm);
void trace_unregister(struct chorus_comm *comm);
/* While the engine is idle: should it wake now and then to call trace_idle_check, which
 * writes the record (once) when a same-host peer has published a failure? A rank that is in
 * no operation when the others fail writes its record too. */
int trace_idle_watch(struct chorus_comm *comm);
void trace_idle_check(struct chorus_comm *comm);
/* Installs the CHORUS_TRACE_SIGNAL handler (once per process). */
chorus_result_t trace_signal_setup(struct chorus_comm *comm);

/* Error text helpers: "all_reduce seq 12 rank 3" etc. */
int op_describe(const struct op *op, char *buf, size_t cap);

#endif /* CHORUS_CORE_H */
