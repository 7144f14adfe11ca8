/* workers.c - helper threads for the memory-bound steps of the same-host algorithms.
 *
 * On a host with more cores than local ranks, one thread per rank cannot saturate the
 * memory system: a single core copies at a fraction of what the sockets' memory
 * controllers deliver. The engine thread therefore splits big copies and reductions into
 * equal element ranges (cache-line aligned, one per thread) that it and a few helper
 * threads of its own take one at a time, and returns when every range is done. Whoever
 * is free takes the next range, so a helper that is asleep or waiting for a core holds
 * nothing up: the engine does its range.
 *
 * Helpers start at the first job big enough to be split (a communicator that only moves
 * small messages never starts one), spin for a while after each job so that the next
 * chunk of the same collective finds them awake, then sleep on a condition variable.
 * They stop when the communicator is destroyed. A helper that cannot be started leaves
 * the work to the engine thread: correctness never depends on them. */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include "algo/algo.h"
#include "core.h"

/* Ranges smaller than this are not worth a hand-off (a few microseconds). */
#define MIN_PART_BYTES ((size_t)64 << 10)
/* How long an idle helper spins before it sleeps. */
#define SPIN_NS 200000LL

struct workers {
  int nhelpers;
  pthread_t *threads;
  int started;                 /* helpers running */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  _Atomic uint64_t gen;        /* job number; helpers look for parts when it changes */
  _Atomic uint64_t claim;      /* job (high 32 bits), its parts (16), next part to take (16) */
  _Atomic int done;            /* parts of the current job finished */
  _Atomic int sleeping;        /* helpers waiting on cv */
  _Atomic int stop;
  /* the current job: written only while no part of it (or of the last one) is in flight */
  workers_fn fn;
  void *ctx;
  size_t count, unit;
  int nparts;
};

/* Range p of nparts over count elements, in multiples of unit elements. */
static void part_range(size_t count, size_t unit, int nparts, int p, size_t *b, size_t *e) {
  size_t units = (count + unit - 1) / unit;
  size_t per = units / (size_t)nparts, extra = units % (size_t)nparts;
  size_t ub = per * (size_t)p + ((size_t)p < extra ? (size_t)p : extra);
  size_t ue = ub + per + ((size_t)p < extra ? 1 : 0);
  *b = ub * unit < count ? ub * unit : count;
  *e = ue * unit < count ? ue * unit : count;
}

/* p < nparts: take_part hands out only the current job's parts */
static void run_part(struct workers *w, int p) {
  size_t b, e;
  part_range(w->count, w->unit, w->nparts, p, &b, &e);
  if (e > b) w->fn(w->ctx, b, e);
}

/* Takes the next part of job `job`, or returns -1 when it has none left (or another job
 * is current). A part taken belongs to the current job, whose fields therefore stay as
 * they are until the part is reported done. */
static int take_part(struct workers *w, uint32_t job) {
  uint64_t c = atomic_load_explicit(&w->claim, memory_order_acquire);
  for (;;) {
    if ((uint32_t)(c >> 32) != job) return -1;
    unsigned parts = (unsigned)(c >> 16) & 0xffffu, next = (unsigned)c & 0xffffu;
    if (next >= parts) return -1;
    if (atomic_compare_exchange_weak_explicit(&w->claim, &c, c + 1, memory_order_acq_rel,
                                              memory_order_acquire))
      return (int)next;
  }
}

/* Runs parts of job `job` until none is left. */
static void run_parts(struct workers *w, uint32_t job) {
  int p;
  while ((p = take_part(w, job)) >= 0) {
    run_part(w, p);
    atomic_fetch_add_explicit(&w->done, 1, memory_order_release);
  }
}

static void *helper_main(void *arg) {
  struct workers *w = arg;
  uint64_t seen = 0;
  for (;;) {
    int64_t spin_end = now_ns() + SPIN_NS;
    uint64_t g;
    unsigned polls = 0;
    while ((g = atomic_load_explicit(&w->gen, memory_order_acquire)) == seen &&
           !atomic_load_explicit(&w->stop, memory_order_acquire)) {
      CPU_RELAX();
      if ((++polls & 255) == 0 && now_ns() > spin_end) {
        pthread_mutex_lock(&w->mu);
        atomic_fetch_add(&w->sleeping, 1);
        while (atomic_load(&w->gen) == seen && !atomic_load(&w->stop))
          pthread_cond_wait(&w->cv, &w->mu);
        atomic_fetch_sub(&w->sleeping, 1);
        pthread_mutex_unlock(&w->mu);
        spin_end = now_ns() + SPIN_NS;
      }
    }
    if (atomic_load_explicit(&w->stop, memory_order_acquire)) return NULL;
    seen = g;
    run_parts(w, (uint32_t)g); /* a helper woken late finds the parts taken: nothing waits */
  }
}

/* Helper threads wanted by a communicator with nlocal ranks on this host. */
static int helpers_wanted(const struct chorus_comm *comm) {
  int64_t t = param_int(PARAM_SHM_THREADS);
  if (t < 0) {
    long cores = host_cores(comm);
    /* Three quarters of the cores per local rank: the rest stays with the ranks' own
     * Python threads (spinning helpers that outnumber the cores make everything slower).
     * On the 16-core GPU host with 4 ranks, 3 threads per rank beat 2 (all_reduce and
     * all-to-all of 1-16 MB 10-30% faster), and 4 made medium sizes erratic
     * (docs/design.md, "Same-host direct-access algorithms"). */
    int local = comm->nlocal > 0 ? comm->nlocal : 1;
    t = 3 * cores / (4 * (long)local);
    if (t > 4) t = 4;
  }
  if (t < 1) t = 1;
  if (t > 16) t = 16;
  return (int)t - 1;
}

static void workers_start(struct chorus_comm *comm) {
  comm->workers_tried = 1;
  int want = helpers_wanted(comm);
  if (want <= 0) return;
  struct workers *w = calloc(1, sizeof *w);
  if (!w) return;
  w->threads = calloc((size_t)want, sizeof(pthread_t));
  if (!w->threads) {
    free(w);
    return;
  }
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
  for (int i = 0; i < want; i++) {
    if (pthread_create(&w->threads[i], NULL, helper_main, w) != 0) break;
    w->started++;
  }
  if (w->started == 0) {
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w->threads);
    free(w);
    return;
  }
  w->nhelpers = w->started;
  comm->workers = w;
  INFO(SUB_INIT, comm->rank, "rank %d: %d helper thread(s) for same-host copies",
      comm->rank, w->nhelpers);
}

/* weight: bytes touched per byte of the range (a reduction of n inputs reads n) */
static void workers_run(struct chorus_comm *comm, size_t count, size_t elem_size, size_t weight,
                        workers_fn fn, void *ctx) {
  if (count == 0) return;
  size_t bytes = count * elem_size * weight;
  if (bytes < 2 * MIN_PART_BYTES) {
    fn(ctx, 0, count);
    return;
  }
  if (!comm->workers && !comm->workers_tried) workers_start(comm);
  struct workers *w = comm->workers;
  if (!w) {
    fn(ctx, 0, count);
    return;
  }
  /* One part per thread (fewer where parts would be under MIN_PART_BYTES), which whoever
   * is free takes, the engine included: a job never waits for a particular thread, so a
   * helper that is asleep or waiting for a core delays nothing (the engine takes its part),
   * and helpers a small job leaves without a part need not wake up for it at all. */
  size_t fit = bytes / MIN_PART_BYTES;
  size_t most = (size_t)w->nhelpers + 1;
  int parts = (int)(fit < most ? fit : most);
  w->fn = fn;
  w->ctx = ctx;
  w->count = count;
  w->unit = elem_size < 64 ? 64 / elem_size : 1; /* whole cache lines per range */
  w->nparts = parts;
  atomic_store_explicit(&w->done, 0, memory_order_relaxed);
  uint64_t gen = atomic_load_explicit(&w->gen, memory_order_relaxed) + 1;
  uint32_t job = (uint32_t)gen;
  atomic_store_explicit(&w->claim, ((uint64_t)job << 32) | ((uint64_t)parts << 16),
                        memory_order_release);
  atomic_store_explicit(&w->gen, gen, memory_order_release);
  int asleep = atomic_load(&w->sleeping);
  if (asleep > 0 && parts > 1) { /* wake as many as there are parts besides the engine's */
    pthread_mutex_lock(&w->mu);
    if (parts - 1 >= asleep) pthread_cond_broadcast(&w->cv);
    else
      for (int k = 0; k < parts - 1; k++) pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
  }
  run_parts(w, job);
  unsigned polls = 0;
  while (atomic_load_explicit(&w->done, memory_order_acquire) < parts)
    if ((++polls & 1023) == 0) sched_yield();
    else CPU_RELAX();
}

void workers_for(struct chorus_comm *comm, size_t count, size_t elem_size, workers_fn fn,
                 void *ctx) {
  workers_run(comm, count, elem_size, 1, fn, ctx);
}

void workers_stop(struct chorus_comm *comm) {
  struct workers *w = comm->workers;
  if (!w) return;
  pthread_mutex_lock(&w->mu);
  atomic_store(&w->stop, 1);
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  for (int i = 0; i < w->started; i++) pthread_join(w->threads[i], NULL);
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->cv);
  free(w->threads);
  free(w);
  comm->workers = NULL;
}

/* ------------------------------------------------------------------ common jobs */
struct copy_job {
  uint8_t *dst;
  const uint8_t *src;
  int stream;
};

static void copy_range(void *ctx, size_t b, size_t e) {
  struct copy_job *j = ctx;
  if (j->stream) copy_stream(j->dst + b, j->src + b, e - b);
  else memcpy(j->dst + b, j->src + b, e - b);
}

void workers_copy(struct chorus_comm *comm, void *dst, const void *src, size_t bytes,
                  int stream) {
  struct copy_job j = {dst, src, stream};
  workers_for(comm, bytes, 1, copy_range, &j);
}

struct reduce_job {
  void *out;
  const void *const *in;
  int n;
  chorus_dtype_t dtype;
  chorus_op_kind_t kind;
  int divisor;
  size_t es;
};

static void reduce_range(void *ctx, size_t b, size_t e) {
  struct reduce_job *j = ctx;
  const void *in[CHORUS_MAX_LOCAL_DIRECT];
  for (int p = 0; p < j->n; p++) in[p] = (const uint8_t *)j->in[p] + b * j->es;
  uint8_t *out = (uint8_t *)j->out + b * j->es;
  reduce_n(out, in, j->n, e - b, j->dtype, j->kind);
  if (j->divisor > 1) reduce_divide(out, e - b, j->dtype, j->divisor);
}

void workers_reduce(struct chorus_comm *comm, void *out, const void *const *in, int n,
                    size_t count, chorus_dtype_t dtype, chorus_op_kind_t kind, int divisor) {
  struct reduce_job j = {out, in, n, dtype, kind, divisor, dtype_size(dtype)};
  workers_run(comm, count, j.es, (size_t)n + 1, reduce_range, &j);
}

struct premul_job {
  uint8_t *dst;
  const uint8_t *src;
  chorus_dtype_t dtype;
  double factor;
  size_t es;
};

static void premul_range(void *ctx, size_t b, size_t e) {
  struct premul_job *j = ctx;
  reduce_premul(j->dst + b * j->es, j->src + b * j->es, e - b, j->dtype, j->factor);
}

void workers_premul(struct chorus_comm *comm, void *dst, const void *src, size_t count,
                    chorus_dtype_t dtype, double factor) {
  struct premul_job j = {dst, src, dtype, factor, dtype_size(dtype)};
  workers_for(comm, count, j.es, premul_range, &j);
}

struct gather_job {
  uint8_t *dst;
  const uint8_t *const *src;
  size_t slice;
  int stream;
};

static void gather_range(void *ctx, size_t b, size_t e) {
  struct gather_job *j = ctx;
  while (b < e) {
    size_t p = b / j->slice, end = (p + 1) * j->slice < e ? (p + 1) * j->slice : e;
    if (j->stream) copy_stream(j->dst + b, j->src[p] + b, end - b);
    else memcpy(j->dst + b, j->src[p] + b, end - b);
    b = end;
  }
}

void workers_gather(struct chorus_comm *comm, void *dst, const uint8_t *const *src,
                    size_t slice, size_t bytes, int stream) {
  struct gather_job j = {dst, src, slice, stream};
  workers_for(comm, bytes, 1, gather_range, &j);
}

/* ------------------------------------------------------------------ copy lists */
#define COPY_LIST_MAX 512
struct list_job {
  const struct copy_seg *segs;
  size_t start[COPY_LIST_MAX + 1]; /* start[i]: offset of segs[i] in the concatenation */
  int nseg;
  int stream;
};

static void list_range(void *ctx, size_t b, size_t e) {
  struct list_job *j = ctx;
  int i = 0;
  while (i + 1 < j->nseg && j->start[i + 1] <= b) i++;
  for (; b < e && i < j->nseg; i++) {
    size_t end = j->start[i + 1] < e ? j->start[i + 1] : e;
    if (end <= b) continue;
    size_t o = b - j->start[i];
    uint8_t *d = (uint8_t *)j->segs[i].dst + o;
    const uint8_t *src = (const uint8_t *)j->segs[i].src + o;
    if (j->stream) copy_stream(d, src, end - b);
    else memcpy(d, src, end - b);
    b = end;
  }
}

void workers_copy_list(struct chorus_comm *comm, const struct copy_seg *segs, int nseg,
                       int stream) {
  while (nseg > 0) {
    struct list_job j;
    j.segs = segs;
    j.nseg = nseg < COPY_LIST_MAX ? nseg : COPY_LIST_MAX;
    j.stream = stream;
    j.start[0] = 0;
    for (int i = 0; i < j.nseg; i++) j.start[i + 1] = j.start[i] + segs[i].len;
    workers_for(comm, j.start[j.nseg], 1, list_range, &j);
    segs += j.nseg;
    nseg -= j.nseg;
  }
}
