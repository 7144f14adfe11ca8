/* trace.c - the flight recorder: a fixed ring per communicator of its last operations
 * (written by the engine thread alone, read by anyone through a per-entry sequence lock),
 * the JSON dump of it (on failure, on request, on a signal), and the process's list of
 * communicators that a dump of "everything" walks. */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

/* One entry is TW_WORDS atomic words, readers on other threads stay data-race free.
 * TW_VER is odd while the engine writes. A sequence lock without fences (TSan does not model
 * them): the engine's stores to the words are release stores and a reader's loads acquire
 * loads, so a reader that sees any word of a write in progress also sees the odd counter when
 * it re-reads it. On x86 both are plain moves. */
enum {
  TW_VER = 0,
  TW_ID,        /* record number + 1 (0: empty slot) */
  TW_SEQ,
  TW_META,      /* kind | dtype << 8 | redop << 16 | state << 24 | algo << 32 | result << 40 */
  TW_PEER,      /* (uint32)root-or-peer | (uint64)(uint32)tag << 32 */
  TW_COUNT,     /* elements */
  TW_BYTES,     /* bytes this rank contributes (send side) */
  TW_QUEUED,    /* CLOCK_MONOTONIC ns; 0 = not reached */
  TW_STARTED,
  TW_ENDED,
  TW_WORDS
};
enum { TS_QUEUED = 0, TS_STARTED = 1, TS_DONE = 2, TS_FAILED = 3 };
#define ALGO_NONE 0xff

struct trace_ring {
  uint32_t size;
  _Atomic uint64_t next;          /* records handed out; written by the engine thread only */
  _Atomic int failure_dumped;     /* the failure dump of this communicator was written */
  int idle_dumped;                /* engine thread: written because a peer failed */
  _Atomic uint64_t *w;            /* size * TW_WORDS */
};

#define RELAXED memory_order_relaxed

static inline _Atomic uint64_t *slot_of(struct trace_ring *t, uint64_t id1) {
  return t->w + (size_t)((id1 - 1) % t->size) * TW_WORDS;
}

static inline void entry_lock(_Atomic uint64_t *e) {
  atomic_store_explicit(&e[TW_VER], atomic_load_explicit(&e[TW_VER], RELAXED) + 1, RELAXED);
}
#define PUT(e, k, v) atomic_store_explicit(&(e)[k], (v), memory_order_release)
static inline void entry_unlock(_Atomic uint64_t *e) {
  atomic_store_explicit(&e[TW_VER], atomic_load_explicit(&e[TW_VER], RELAXED) + 1,
                        memory_order_release);
}
/* The entry of op if the ring still holds it (more than size newer records evict it). */
static inline _Atomic uint64_t *entry_of(struct trace_ring *t, const struct op *op) {
  if (!op->trace_id) return NULL;
  _Atomic uint64_t *e = slot_of(t, op->trace_id);
  return atomic_load_explicit(&e[TW_ID], RELAXED) == op->trace_id ? e : NULL;
}

static uint64_t op_bytes(const struct chorus_comm *comm, const struct op *op) {
  size_t es = dtype_size(op->dtype);
  switch (op->kind) {
    case OP_ALLGATHER:
      return op->counts ? (uint64_t)op->counts[comm->rank] * es : (uint64_t)op->count * es;
    case OP_ALLTOALL: {
      uint64_t s = 0;
      if (op->counts)
        for (int p = 0; p < comm->nranks; p++) s += op->counts[p];
      return s * es;
    }
    case OP_BARRIER: return 0;
    default: return (uint64_t)op->count * es;
  }
}

chorus_result_t trace_init(struct chorus_comm *comm) {
  int64_t n = param_int(PARAM_TRACE_BUFFER_SIZE);
  if (n <= 0) return CHORUS_SUCCESS; /* disabled */
  if (n > 10000000)
    return comm_set_error(comm, CHORUS_ERR_INVALID,
                          "rank %d: CHORUS_TRACE_BUFFER_SIZE=%lld is too large (at most 10000000)",
                          comm->rank, (long long)n);
  struct trace_ring *t = calloc(1, sizeof(*t));
  /* calloc: pages are touched only as the ring fills */
  _Atomic uint64_t *w = calloc((size_t)n * TW_WORDS, sizeof(*w));
  if (!t || !w) {
    free(t);
    free(w);
    return comm_set_error(comm, CHORUS_ERR_NOMEM, "rank %d: no memory for a flight recorder of "
                          "%lld entries", comm->rank, (long long)n);
  }
  t->size = (uint32_t)n;
  t->w = w;
  comm->trace = t;
  return CHORUS_SUCCESS;
}

void trace_fini(struct chorus_comm *comm) {
  if (!comm->trace) return;
  free(comm->trace->w);
  free(comm->trace);
  comm->trace = NULL;
}

void trace_op_begin(struct chorus_comm *comm, struct op *op, int64_t started_ns) {
  struct trace_ring *t = comm->trace;
  if (!t) return;
  uint64_t id1 = atomic_load_explicit(&t->next, RELAXED) + 1;
  atomic_store_explicit(&t->next, id1, RELAXED);
  op->trace_id = id1;
  _Atomic uint64_t *e = slot_of(t, id1);
  int p2p = op->kind == OP_SEND || op->kind == OP_RECV;
  int state = started_ns ? TS_STARTED : TS_QUEUED;
  uint64_t meta = (uint64_t)op->kind | (uint64_t)op->dtype << 8 |
                  (uint64_t)(p2p ? 0xff : (unsigned)op->op.kind & 0xff) << 16 |
                  (uint64_t)state << 24 | (uint64_t)ALGO_NONE << 32;
  entry_lock(e);
  PUT(e, TW_ID, id1);
  PUT(e, TW_SEQ, p2p && !started_ns ? UINT64_MAX : op->seq);
  PUT(e, TW_META, meta);
  PUT(e, TW_PEER, (uint64_t)(uint32_t)op->root | (uint64_t)(uint32_t)op->tag << 32);
  PUT(e, TW_COUNT, op->count);
  PUT(e, TW_BYTES, op_bytes(comm, op));
  PUT(e, TW_QUEUED, (uint64_t)op->t_queued);
  PUT(e, TW_STARTED, (uint64_t)started_ns);
  PUT(e, TW_ENDED, 0);
  entry_unlock(e);
}

/* Point-to-point: bound to the stream (its per-peer number and peer are final now). */
void trace_op_start(struct chorus_comm *comm, struct op *op, int64_t now) {
  _Atomic uint64_t *e = comm->trace ? entry_of(comm->trace, op) : NULL;
  if (!e) return;
  uint64_t meta = atomic_load_explicit(&e[TW_META], RELAXED);
  meta = (meta & ~(0xffull << 24)) | (uint64_t)TS_STARTED << 24;
  entry_lock(e);
  PUT(e, TW_SEQ, op->seq);
  PUT(e, TW_META, meta);
  PUT(e, TW_PEER, (uint64_t)(uint32_t)op->root | (uint64_t)(uint32_t)op->tag << 32);
  PUT(e, TW_STARTED, (uint64_t)now);
  entry_unlock(e);
}

void trace_op_algo(struct chorus_comm *comm, struct op *op) {
  _Atomic uint64_t *e = comm->trace ? entry_of(comm->trace, op) : NULL;
  if (!e) return;
  uint64_t meta = atomic_load_explicit(&e[TW_META], RELAXED);
  meta = (meta & ~(0xffull << 32)) | (uint64_t)(op->algo & 0xff) << 32;
  entry_lock(e);
  PUT(e, TW_META, meta);
  entry_unlock(e);
}

void trace_op_end(struct chorus_comm *comm, struct op *op, chorus_result_t res) {
  _Atomic uint64_t *e = comm->trace ? entry_of(comm->trace, op) : NULL;
  if (!e) return;
  uint64_t meta = atomic_load_explicit(&e[TW_META], RELAXED);
  meta &= ~(0xffull << 24 | 0xffull << 40);
  meta |= (uint64_t)(res == CHORUS_SUCCESS ? TS_DONE : TS_FAILED) << 24 |
          (uint64_t)((unsigned)res & 0xff) << 40;
  entry_lock(e);
  PUT(e, TW_META, meta);
  PUT(e, TW_ENDED, (uint64_t)now_ns());
  entry_unlock(e);
}

/* A consistent copy of one slot; 0 if empty or still changing after a few tries. */
static int entry_read(_Atomic uint64_t *e, uint64_t out[TW_WORDS]) {
  for (int tries = 0; tries < 1000; tries++) {
    uint64_t v1 = atomic_load_explicit(&e[TW_VER], memory_order_acquire);
    if (v1 & 1) {
      sched_yield();
      continue;
    }
    for (int k = 1; k < TW_WORDS; k++) out[k] = atomic_load_explicit(&e[k], memory_order_acquire);
    if (atomic_load_explicit(&e[TW_VER], RELAXED) == v1) return out[TW_ID] != 0;
  }
  return 0;
}

/* ------------------------------------------------------------------ JSON output */
static void json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; s && *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c == '\n') fputs("\\n", f);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

static const char *state_name(int s) {
  static const char *names[] = {"queued", "started", "done", "failed"};
  return s >= 0 && s <= TS_FAILED ? names[s] : "unknown";
}

struct clock_pair {
  int64_t mono, wall;
};
/* A monotonic time as Unix seconds, through the pair read at the dump. */
static void json_time(FILE *f, const char *key, int64_t t, const struct clock_pair *cp) {
  if (!t) {
    fprintf(f, ", \"%s_ns\": null, \"%s_wall\": null", key, key);
    return;
  }
  double wall = (double)(cp->wall - (cp->mono - t)) / 1e9;
  fprintf(f, ", \"%s_ns\": %lld, \"%s_wall\": %.6f", key, (long long)t, key, wall);
}

static void json_entry(FILE *f, const uint64_t *w, const struct clock_pair *cp) {
  unsigned kind = (unsigned)(w[TW_META] & 0xff), dtype = (unsigned)(w[TW_META] >> 8 & 0xff);
  unsigned redop = (unsigned)(w[TW_META] >> 16 & 0xff), state = (unsigned)(w[TW_META] >> 24 & 0xff);
  unsigned algo = (unsigned)(w[TW_META] >> 32 & 0xff), result = (unsigned)(w[TW_META] >> 40 & 0xff);
  int p2p = kind == OP_SEND || kind == OP_RECV;
  int32_t peer = (int32_t)(uint32_t)(w[TW_PEER] & 0xffffffffu);
  int32_t tag = (int32_t)(uint32_t)(w[TW_PEER] >> 32);
  fprintf(f, "{\"id\": %llu, \"seq\": ", (unsigned long long)(w[TW_ID] - 1));
  if (w[TW_SEQ] == UINT64_MAX) fputs("null", f);
  else fprintf(f, "%llu", (unsigned long long)w[TW_SEQ]);
  fprintf(f, ", \"op\": \"%s\", \"p2p\": %s, \"count\": %llu, \"bytes\": %llu, \"dtype\": \"%s\"",
          op_kind_name((enum op_kind)kind), p2p ? "true" : "false",
          (unsigned long long)w[TW_COUNT], (unsigned long long)w[TW_BYTES],
          chorus_dtype_name((chorus_dtype_t)dtype));
  if (!p2p && kind != OP_BARRIER &&
      (kind == OP_ALLREDUCE || kind == OP_REDUCE || kind == OP_REDUCE_SCATTER))
    fprintf(f, ", \"redop\": \"%s\"", chorus_op_name((chorus_op_kind_t)redop));
  else
    fputs(", \"redop\": null", f);
  if (p2p) fprintf(f, ", \"peer\": %d, \"tag\": %d, \"root\": null", peer, tag);
  else if (kind == OP_BROADCAST || kind == OP_REDUCE || kind == OP_GATHER || kind == OP_SCATTER)
    fprintf(f, ", \"peer\": null, \"tag\": null, \"root\": %d", peer);
  else
    fputs(", \"peer\": null, \"tag\": null, \"root\": null", f);
  fputs(", \"algo\": ", f);
  if (algo == ALGO_NONE) fputs("null", f);
  else json_str(f, algo_name((int)algo));
  fprintf(f, ", \"state\": \"%s\", \"result\": ", state_name((int)state));
  if (state == TS_FAILED) json_str(f, chorus_result_string((chorus_result_t)result));
  else fputs("null", f);
  json_time(f, "queued", (int64_t)w[TW_QUEUED], cp);
  json_time(f, "started", (int64_t)w[TW_STARTED], cp);
  json_time(f, "ended", (int64_t)w[TW_ENDED], cp);
  fputc('}', f);
}

/* An op still in the engine's queue (never started): from the op itself. */
static void json_queued_op(FILE *f, const struct chorus_comm *comm, const struct op *op,
                           const struct clock_pair *cp) {
  uint64_t w[TW_WORDS] = {0};
  int p2p = op->kind == OP_SEND || op->kind == OP_RECV;
  w[TW_ID] = 0; /* printed as id -1: not in the ring */
  w[TW_SEQ] = p2p ? UINT64_MAX : op->seq;
  w[TW_META] = (uint64_t)op->kind | (uint64_t)op->dtype << 8 |
               (uint64_t)(p2p ? 0xff : (unsigned)op->op.kind & 0xff) << 16 |
               (uint64_t)TS_QUEUED << 24 | (uint64_t)ALGO_NONE << 32;
  w[TW_PEER] = (uint64_t)(uint32_t)op->root | (uint64_t)(uint32_t)op->tag << 32;
  w[TW_COUNT] = op->count;
  w[TW_BYTES] = op_bytes(comm, op);
  w[TW_QUEUED] = (uint64_t)op->t_queued;
  json_entry(f, w, cp);
}

static void sanitize(char *dst, size_t cap, const char *src) {
  size_t j = 0;
  for (; src && *src && j + 1 < cap; src++) {
    char c = *src;
    dst[j++] = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                       c == '-' || c == '_'
                   ? c
                   : '_';
  }
  dst[j] = 0;
}

static int64_t wall_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static const char *trace_dir_or(const char *dir) {
  return dir && *dir ? dir : param_str(PARAM_TRACE_DIR);
}

/* Writes the record of comm to dir/chorus-trace.r<rank>.<comm>.<pid>.json (through a
 * temporary name, so a reader never sees half a file). */
static chorus_result_t trace_write(struct chorus_comm *comm, const char *dir, const char *reason,
                                   char *path_out, size_t cap) {
  struct trace_ring *t = comm->trace;
  if (!dir || !*dir) {
    comm_set_error(NULL, CHORUS_ERR_INVALID,
                   "flight recorder dump: no directory given and CHORUS_TRACE_DIR is not set");
    return CHORUS_ERR_INVALID;
  }
  if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
    comm_set_error(NULL, CHORUS_ERR_SYSTEM, "flight recorder dump: cannot create %s: %s", dir,
                   strerror(errno));
    return CHORUS_ERR_SYSTEM;
  }
  int grank = comm->global_ranks ? comm->global_ranks[comm->rank] : comm->rank;
  char name[80], path[4096], tmp[4200];
  sanitize(name, sizeof name, comm->name[0] ? comm->name : comm->prefix);
  snprintf(path, sizeof path, "%s/chorus-trace.r%d.%s.%d.json", dir, grank, name, (int)getpid());
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    comm_set_error(NULL, CHORUS_ERR_SYSTEM, "flight recorder dump: cannot write %s: %s", tmp,
                   strerror(errno));
    return CHORUS_ERR_SYSTEM;
  }
  FILE *f = fdopen(fd, "w");
  if (!f) {
    close(fd);
    unlink(tmp);
    comm_set_error(NULL, CHORUS_ERR_SYSTEM, "flight recorder dump: fdopen: %s", strerror(errno));
    return CHORUS_ERR_SYSTEM;
  }
  struct clock_pair cp = {now_ns(), wall_ns()};
  char err[sizeof comm->errbuf];
  pthread_mutex_lock(&comm->err_mu);
  snprintf(err, sizeof err, "%s", comm->errbuf);
  pthread_mutex_unlock(&comm->err_mu);
  const char *host = comm->peers ? comm->peers[comm->rank].hostname : "";
  fprintf(f, "{\"format\": \"chorus-flight-recorder\", \"version\": 1, \"reason\": ");
  json_str(f, reason ? reason : "api");
  fprintf(f, ", \"rank\": %d, \"world\": %d, \"global_rank\": %d, \"global_ranks\": ", comm->rank,
          comm->nranks, grank);
  if (comm->global_ranks) {
    fputc('[', f);
    for (int r = 0; r < comm->nranks; r++)
      fprintf(f, "%s%d", r ? ", " : "", comm->global_ranks[r]);
    fputc(']', f);
  } else {
    fputs("null", f);
  }
  fputs(", \"comm\": ", f);
  json_str(f, comm->name);
  fputs(", \"prefix\": ", f);
  json_str(f, comm->prefix);
  fputs(", \"host\": ", f);
  json_str(f, host);
  fprintf(f, ", \"pid\": %d, \"timeout_ms\": %d, \"next_seq\": %llu, \"failed\": %s, \"error\": ",
          (int)getpid(), comm->timeout_ms, (unsigned long long)atomic_load(&comm->seq),
          atomic_load(&comm->failed) ? "true" : "false");
  if (err[0]) json_str(f, err);
  else fputs("null", f);
  uint64_t next = t ? atomic_load_explicit(&t->next, RELAXED) : 0;
  uint32_t size = t ? t->size : 0;
  fprintf(f, ", \"buffer_size\": %u, \"recorded\": %llu, \"dumped_ns\": %lld, "
          "\"dumped_wall\": %.6f,\n \"entries\": [",
          size, (unsigned long long)next, (long long)cp.mono, (double)cp.wall / 1e9);
  int first = 1;
  if (t) {
    uint64_t lo = next > size ? next - size + 1 : 1;
    for (uint64_t id1 = lo; id1 <= next; id1++) {
      uint64_t w[TW_WORDS];
      if (!entry_read(slot_of(t, id1), w) || w[TW_ID] != id1) continue; /* overwritten */
      fputs(first ? "\n  " : ",\n  ", f);
      first = 0;
      json_entry(f, w, &cp);
    }
    /* what the engine has not taken yet */
    pthread_mutex_lock(&comm->mu);
    const struct op *lists[2] = {comm->queue_head, comm->p2p_incoming};
    for (int l = 0; l < 2; l++)
      for (const struct op *op = lists[l]; op; op = op->next) {
        fputs(first ? "\n  " : ",\n  ", f);
        first = 0;
        json_queued_op(f, comm, op, &cp);
      }
    pthread_mutex_unlock(&comm->mu);
  }
  fputs("\n]}\n", f);
  int bad = ferror(f);
  if (fclose(f) != 0) bad = 1;
  if (bad || rename(tmp, path) != 0) {
    int e = errno;
    unlink(tmp);
    comm_set_error(NULL, CHORUS_ERR_SYSTEM, "flight recorder dump: writing %s failed: %s", path,
                   strerror(e));
    return CHORUS_ERR_SYSTEM;
  }
  if (path_out && cap) snprintf(path_out, cap, "%s", path);
  INFO(SUB_COLL, comm->rank, "flight recorder (%s) written to %s", reason ? reason : "api", path);
  return CHORUS_SUCCESS;
}

/* ------------------------------------------------------------------ every communicator */
/* Held around every dump: a communicator is not freed, nor its global ranks replaced, while
 * a dump reads it. Never taken with a communicator's own locks held. */
static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static struct chorus_comm *registry_head;

chorus_result_t chorus_trace_dump(chorus_comm_t *comm, const char *dir, const char *reason,
                                  char *path_out, size_t cap) {
  if (path_out && cap) path_out[0] = 0;
  if (!comm) return CHORUS_ERR_INVALID;
  pthread_mutex_lock(&registry_mu);
  chorus_result_t res = trace_write(comm, trace_dir_or(dir), reason, path_out, cap);
  pthread_mutex_unlock(&registry_mu);
  return res;
}

void trace_register(struct chorus_comm *comm) {
  pthread_mutex_lock(&registry_mu);
  comm->trace_next_comm = registry_head;
  registry_head = comm;
  comm->trace_registered = 1;
  pthread_mutex_unlock(&registry_mu);
}

void trace_unregister(struct chorus_comm *comm) {
  pthread_mutex_lock(&registry_mu);
  if (comm->trace_registered) {
    struct chorus_comm **pp = &registry_head;
    while (*pp && *pp != comm) pp = &(*pp)->trace_next_comm;
    if (*pp) *pp = comm->trace_next_comm;
    comm->trace_registered = 0;
  }
  pthread_mutex_unlock(&registry_mu);
}

chorus_result_t chorus_trace_dump_all(const char *dir, const char *reason, char *paths,
                                      size_t cap, int *written) {
  if (paths && cap) paths[0] = 0;
  if (written) *written = 0;
  dir = trace_dir_or(dir);
  chorus_result_t res = CHORUS_SUCCESS;
  size_t used = 0;
  pthread_mutex_lock(&registry_mu); /* held: no communicator is freed meanwhile */
  for (struct chorus_comm *c = registry_head; c; c = c->trace_next_comm) {
    char path[4096];
    chorus_result_t r = trace_write(c, dir, reason, path, sizeof path);
    if (r != CHORUS_SUCCESS) {
      res = r;
      continue;
    }
    if (written) (*written)++;
    if (paths && used + strlen(path) + 2 < cap)
      used += (size_t)snprintf(paths + used, cap - used, "%s\n", path);
  }
  pthread_mutex_unlock(&registry_mu);
  return res;
}

/* On a failed operation (engine thread, before its request completes, so the record is on
 * disk before the caller sees the error): once per communicator, when CHORUS_TRACE_DIR is
 * set. An abort the user asked for (destroy, abort()) is not a failure worth a record. */
void trace_on_failure(struct chorus_comm *comm, chorus_result_t res) {
  struct trace_ring *t = comm->trace;
  if (!t || res == CHORUS_SUCCESS) return;
  if (comm->err == CHORUS_ERR_ABORTED || (comm->err == CHORUS_SUCCESS && res == CHORUS_ERR_ABORTED))
    return;
  const char *dir = param_str(PARAM_TRACE_DIR);
  if (!*dir || atomic_exchange(&t->failure_dumped, 1)) return;
  const char *why = comm->err == CHORUS_ERR_TIMEOUT ? "timeout" : "failure";
  pthread_mutex_lock(&registry_mu);
  chorus_result_t r = trace_write(comm, dir, why, NULL, 0);
  pthread_mutex_unlock(&registry_mu);
  if (r != CHORUS_SUCCESS)
    WARN(comm->rank, "flight recorder: %s", chorus_comm_error(NULL));
}

int trace_idle_watch(struct chorus_comm *comm) {
  struct trace_ring *t = comm->trace;
  return t && comm->shm && !t->idle_dumped && !atomic_load(&t->failure_dumped) &&
         !atomic_load(&comm->failed) && *param_str(PARAM_TRACE_DIR);
}

void trace_idle_check(struct chorus_comm *comm) {
  if (!trace_idle_watch(comm)) return;
  int peer = shm_failed_peer(comm);
  if (peer < 0) return;
  comm->trace->idle_dumped = 1;
  char why[64];
  snprintf(why, sizeof why, "peer %d failed", peer);
  pthread_mutex_lock(&registry_mu);
  chorus_result_t r = trace_write(comm, param_str(PARAM_TRACE_DIR), why, NULL, 0);
  pthread_mutex_unlock(&registry_mu);
  if (r != CHORUS_SUCCESS) WARN(comm->rank, "flight recorder: %s", chorus_comm_error(NULL));
}

/* ------------------------------------------------------------------ the dump signal */
/* The handler only writes a byte to a pipe (async-signal-safe); a thread of ours reads it
 * and writes every communicator's record with ordinary (locking, allocating) code. */
static int signal_pipe[2] = {-1, -1};
static int signal_installed;
static pthread_mutex_t signal_mu = PTHREAD_MUTEX_INITIALIZER;

static void on_dump_signal(int sig) {
  (void)sig;
  int saved = errno;
  char b = 1;
  ssize_t w = write(signal_pipe[1], &b, 1);
  (void)w; /* pipe full: a dump is pending anyway */
  errno = saved;
}

static void *signal_thread(void *arg) {
  (void)arg;
  for (;;) {
    char buf[64];
    ssize_t n = read(signal_pipe[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return NULL;
    int written = 0;
    if (chorus_trace_dump_all(NULL, "signal", NULL, 0, &written) != CHORUS_SUCCESS)
      WARN(-1, "flight recorder: dump on signal failed: %s", chorus_comm_error(NULL));
  }
}

/* "SIGUSR2", "USR2" or a number; -1 if not a signal name this knows. */
static int parse_signal(const char *s) {
  static const struct {
    const char *name;
    int sig;
  } names[] = {{"USR1", SIGUSR1}, {"USR2", SIGUSR2}, {"HUP", SIGHUP}, {"QUIT", SIGQUIT},
               {"PWR", SIGPWR},   {"URG", SIGURG},   {"WINCH", SIGWINCH}};
  if (strncasecmp(s, "SIG", 3) == 0) s += 3;
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (strcasecmp(s, names[i].name) == 0) return names[i].sig;
  int64_t v;
  if (param_parse_int(s, &v) == 0 && v > 0 && v < NSIG && v != SIGKILL && v != SIGSTOP)
    return (int)v;
  return -1;
}

chorus_result_t trace_signal_setup(struct chorus_comm *comm) {
  const char *s = param_str(PARAM_TRACE_SIGNAL);
  if (!*s) return CHORUS_SUCCESS;
  int sig = parse_signal(s);
  if (sig < 0)
    return comm_set_error(comm, CHORUS_ERR_INVALID,
                          "rank %d: CHORUS_TRACE_SIGNAL=%s is not a signal (e.g. SIGUSR2 or 12)",
                          comm->rank, s);
  chorus_result_t res = CHORUS_SUCCESS;
  pthread_mutex_lock(&signal_mu);
  if (!signal_installed) {
    pthread_t th;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_dump_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (pipe2(signal_pipe, O_CLOEXEC) != 0) {
      res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: pipe for CHORUS_TRACE_SIGNAL: %s",
                           comm->rank, strerror(errno));
    } else if (fcntl(signal_pipe[1], F_SETFL, O_NONBLOCK) != 0 ||
               pthread_create(&th, NULL, signal_thread, NULL) != 0) {
      res = comm_set_error(comm, CHORUS_ERR_SYSTEM,
                           "rank %d: cannot start the CHORUS_TRACE_SIGNAL thread", comm->rank);
      close(signal_pipe[0]);
      close(signal_pipe[1]);
      signal_pipe[0] = signal_pipe[1] = -1;
    } else {
      pthread_detach(th);
      if (sigaction(sig, &sa, NULL) != 0) {
        /* the thread stays, blocked on a pipe nobody writes */
        res = comm_set_error(comm, CHORUS_ERR_SYSTEM, "rank %d: sigaction(%d): %s", comm->rank,
                             sig, strerror(errno));
      } else {
        signal_installed = 1;
        INFO(SUB_INIT, comm->rank, "flight recorder: signal %d dumps every communicator", sig);
      }
    }
  }
  pthread_mutex_unlock(&signal_mu);
  return res;
}

chorus_result_t chorus_comm_set_global_ranks(chorus_comm_t *comm, const int *ranks, int n) {
  if (!comm || !ranks || n != comm->nranks) return CHORUS_ERR_INVALID;
  int *copy = malloc((size_t)n * sizeof(int));
  if (!copy) return CHORUS_ERR_NOMEM;
  memcpy(copy, ranks, (size_t)n * sizeof(int));
  pthread_mutex_lock(&registry_mu); /* a dump may be reading the old array */
  free(comm->global_ranks);
  comm->global_ranks = copy;
  pthread_mutex_unlock(&registry_mu);
  return CHORUS_SUCCESS;
}
