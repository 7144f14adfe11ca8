/* test_algo_sim.c - the schedule simulator: every network algorithm x every collective it
 * implements x N = 1..17 ranks, run as N threads of one process (an in-memory bootstrap,
 * shared memory between all ranks, a 4 KiB connection ring so chunking and ring wrap are
 * exercised). Each output element is checked against a reference computed here from all
 * ranks' inputs; all-reduce results must be bit-identical across ranks; the algorithm that
 * ran is read back from the communicator. TEST_ALGO_SIM_N=5 runs one world only. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "algo/algo.h"
#include "core.h"

#define MAX_N 17
#define RING_BYTES 4096

/* ------------------------------------------------------------ in-memory bootstrap */
struct kv {
  char *key;
  void *val;
  size_t len;
  struct kv *next;
};
struct store {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct kv *head;
};

static chorus_result_t kv_set(void *ctx, const char *key, const void *val, size_t len) {
  struct store *st = ctx;
  struct kv *e = calloc(1, sizeof *e);
  if (!e) return CHORUS_ERR_NOMEM;
  e->key = strdup(key);
  e->val = malloc(len ? len : 1);
  if (!e->key || !e->val) return CHORUS_ERR_NOMEM;
  memcpy(e->val, val, len);
  e->len = len;
  pthread_mutex_lock(&st->mu);
  e->next = st->head;
  st->head = e; /* newest first: a re-set key shadows the old value */
  pthread_cond_broadcast(&st->cv);
  pthread_mutex_unlock(&st->mu);
  return CHORUS_SUCCESS;
}

static chorus_result_t kv_get(void *ctx, const char *key, void *buf, size_t cap, size_t *len,
                              int timeout_ms) {
  struct store *st = ctx;
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += timeout_ms / 1000 + 1;
  pthread_mutex_lock(&st->mu);
  for (;;) {
    for (struct kv *e = st->head; e; e = e->next)
      if (strcmp(e->key, key) == 0) {
        memcpy(buf, e->val, e->len < cap ? e->len : cap);
        *len = e->len;
        pthread_mutex_unlock(&st->mu);
        return CHORUS_SUCCESS;
      }
    if (pthread_cond_timedwait(&st->cv, &st->mu, &dl) != 0) {
      pthread_mutex_unlock(&st->mu);
      return CHORUS_ERR_TIMEOUT;
    }
  }
}

static void store_free(struct store *st) {
  while (st->head) {
    struct kv *e = st->head;
    st->head = e->next;
    free(e->key);
    free(e->val);
    free(e);
  }
}

/* ------------------------------------------------------------ typed values */
static double get_val(chorus_dtype_t d, const void *buf, size_t i) {
  switch (d) {
    case CHORUS_INT32: return ((const int32_t *)buf)[i];
    case CHORUS_INT64: return (double)((const int64_t *)buf)[i];
    case CHORUS_FLOAT16: return half_to_float(((const uint16_t *)buf)[i]);
    case CHORUS_BFLOAT16: return bf16_to_float(((const uint16_t *)buf)[i]);
    case CHORUS_FLOAT32: return ((const float *)buf)[i];
    case CHORUS_FLOAT64: return ((const double *)buf)[i];
    default: return ((const uint8_t *)buf)[i];
  }
}

static void put_val(chorus_dtype_t d, void *buf, size_t i, double v) {
  switch (d) {
    case CHORUS_INT32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case CHORUS_INT64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case CHORUS_FLOAT16: ((uint16_t *)buf)[i] = float_to_half((float)v); break;
    case CHORUS_BFLOAT16: ((uint16_t *)buf)[i] = float_to_bf16((float)v); break;
    case CHORUS_FLOAT32: ((float *)buf)[i] = (float)v; break;
    case CHORUS_FLOAT64: ((double *)buf)[i] = v; break;
    default: ((uint8_t *)buf)[i] = (uint8_t)v; break;
  }
}

static int is_float(chorus_dtype_t d) {
  return d == CHORUS_FLOAT16 || d == CHORUS_BFLOAT16 || d == CHORUS_FLOAT32 ||
         d == CHORUS_FLOAT64;
}

/* Input of rank r, element i (exactly representable in every dtype used). */
static double gen(chorus_dtype_t d, chorus_op_kind_t op, int r, size_t i, int seed) {
  unsigned h = (unsigned)(r * 131 + seed * 7) + (unsigned)i * 2654435761u;
  h ^= h >> 13;
  if (op == CHORUS_PROD) {
    static const double pv[5] = {1, 2, -1, 1, 1};
    return pv[h % 5];
  }
  if (is_float(d)) return ((double)(h % 64) - 32.0) * 0.25;
  return (double)(h % 201) - 100.0;
}

static double factor_of(int r) { return 0.5 * (r % 4 + 1); }

/* Reference of op over all n ranks for element i, and a tolerance. */
static double reference(chorus_dtype_t d, chorus_op_kind_t op, int n, size_t i, int seed,
                        double *tol) {
  double acc = 0, mag = 0;
  for (int r = 0; r < n; r++) {
    double v = gen(d, op, r, i, seed);
    if (op == CHORUS_PREMUL_SUM) v *= factor_of(r);
    mag += fabs(v);
    if (r == 0) acc = v;
    else if (op == CHORUS_PROD) acc *= v;
    else if (op == CHORUS_MIN) acc = v < acc ? v : acc;
    else if (op == CHORUS_MAX) acc = v > acc ? v : acc;
    else acc += v;
  }
  if (op == CHORUS_AVG) acc = is_float(d) ? acc / n : trunc(acc / n);
  double eps = d == CHORUS_FLOAT16 ? 1e-3 : d == CHORUS_BFLOAT16 ? 8e-3 : d == CHORUS_FLOAT32 ? 2e-7 : 0;
  *tol = eps * (mag + 1) * 2;
  return acc;
}

/* ------------------------------------------------------------ cases */
enum variant { V_PLAIN = 0, V_INPLACE, V_UNEVEN, V_UNPACKED };
struct tcase {
  int algo;
  enum op_kind kind;
  enum variant var;
  chorus_dtype_t dtype;
  chorus_op_kind_t redop;
  size_t count;
  int root;
  int fake_hosts; /* 0: real topology; k: pretend hosts of k ranks (hier) */
};

struct world {
  int n;
  struct store st;
  pthread_barrier_t bar;
  struct tcase *cases;
  int ncases;
  void *outs[MAX_N];
  size_t out_bytes[MAX_N];
  int fail[MAX_N];        /* per rank, current case */
  int case_failed;        /* aggregated by rank 0 */
  int passed, failed;
};

static int g_passed, g_failed;

static void add_case(struct world *w, struct tcase c) {
  if (w->ncases % 256 == 0) w->cases = realloc(w->cases, (size_t)(w->ncases + 256) * sizeof(c));
  w->cases[w->ncases++] = c;
}

static const char *var_name(enum variant v) {
  static const char *names[] = {"plain", "in-place", "uneven", "unpacked"};
  return names[v];
}

/* Per-rank counts for v-variants: uneven, some zero. */
static size_t vcount(size_t base, int r, int salt) { return base * (size_t)((r + salt) % 3) / 2 + (size_t)(r % 2); }

static void build_cases(struct world *w) {
  int n = w->n;
  size_t big = 6 * RING_BYTES / 4 + 5; /* six rings of float32, not a multiple of anything */
  size_t sizes[] = {0, 1, (size_t)(n > 1 ? n - 1 : 2), 3001, big};
  const int ns = 5;
  static const int ar_algos[] = {ALGO_RING, ALGO_TREE,    ALGO_RHD,    ALGO_RD,
                                 ALGO_HIER, ALGO_ONESHOT, ALGO_TWOSHOT};
  struct {
    chorus_dtype_t d;
    chorus_op_kind_t op;
  } matrix[] = {{CHORUS_INT32, CHORUS_MAX},   {CHORUS_INT32, CHORUS_MIN},
                {CHORUS_INT64, CHORUS_PROD},  {CHORUS_FLOAT32, CHORUS_AVG},
                {CHORUS_INT32, CHORUS_AVG},   {CHORUS_FLOAT32, CHORUS_PREMUL_SUM},
                {CHORUS_FLOAT16, CHORUS_SUM}, {CHORUS_BFLOAT16, CHORUS_SUM},
                {CHORUS_FLOAT64, CHORUS_SUM}};
  for (size_t a = 0; a < sizeof ar_algos / sizeof ar_algos[0]; a++) {
    int algo = ar_algos[a], fh = algo == ALGO_HIER ? 3 : 0;
    for (int s = 0; s < ns; s++)
      add_case(w, (struct tcase){algo, OP_ALLREDUCE, V_PLAIN, CHORUS_FLOAT32, CHORUS_SUM, sizes[s], 0, fh});
    add_case(w, (struct tcase){algo, OP_ALLREDUCE, V_INPLACE, CHORUS_FLOAT32, CHORUS_SUM, 3001, 0, fh});
    for (size_t m = 0; m < sizeof matrix / sizeof matrix[0]; m++) {
      add_case(w, (struct tcase){algo, OP_ALLREDUCE, V_PLAIN, matrix[m].d, matrix[m].op, 7, 0, fh});
      add_case(w, (struct tcase){algo, OP_ALLREDUCE, V_PLAIN, matrix[m].d, matrix[m].op, big, 0, fh});
    }
  }
  /* hier with a round-robin host split (ranks of one host not contiguous) */
  add_case(w, (struct tcase){ALGO_HIER, OP_ALLREDUCE, V_PLAIN, CHORUS_FLOAT32, CHORUS_SUM, 3001, 0, -2});
  add_case(w, (struct tcase){ALGO_HIER, OP_ALLREDUCE, V_PLAIN, CHORUS_FLOAT32, CHORUS_AVG, big, 0, -3});
  /* broadcast and reduce, several roots */
  static const int br_algos[] = {ALGO_RING, ALGO_TREE, ALGO_HIER, ALGO_ONESHOT};
  for (size_t a = 0; a < sizeof br_algos / sizeof br_algos[0]; a++) {
    int algo = br_algos[a], fh = algo == ALGO_HIER ? 3 : 0;
    for (int s = 0; s < ns; s++) {
      int root = (int)((sizes[s] + (size_t)a) % (size_t)n);
      add_case(w, (struct tcase){algo, OP_BROADCAST, V_PLAIN, CHORUS_INT32, CHORUS_SUM, sizes[s], root, fh});
      add_case(w, (struct tcase){algo, OP_REDUCE, V_PLAIN, CHORUS_FLOAT32, CHORUS_SUM, sizes[s], (root + 1) % n, fh});
    }
    add_case(w, (struct tcase){algo, OP_REDUCE, V_PLAIN, CHORUS_FLOAT32, CHORUS_AVG, 3001, n - 1, fh ? -2 : 0});
    add_case(w, (struct tcase){algo, OP_REDUCE, V_PLAIN, CHORUS_INT32, CHORUS_MAX, 3001, n / 2, fh});
    add_case(w, (struct tcase){algo, OP_REDUCE, V_PLAIN, CHORUS_FLOAT16, CHORUS_PREMUL_SUM, 513, 0, fh});
    add_case(w, (struct tcase){algo, OP_BROADCAST, V_PLAIN, CHORUS_FLOAT64, CHORUS_SUM, 3001, n / 2, fh ? -2 : 0});
  }
  /* reduce-scatter */
  static const int rs_algos[] = {ALGO_RING, ALGO_RHD, ALGO_ONESHOT};
  for (size_t a = 0; a < sizeof rs_algos / sizeof rs_algos[0]; a++) {
    for (int s = 0; s < ns; s++)
      add_case(w, (struct tcase){rs_algos[a], OP_REDUCE_SCATTER, V_PLAIN, CHORUS_FLOAT32, CHORUS_SUM, sizes[s], 0, 0});
    add_case(w, (struct tcase){rs_algos[a], OP_REDUCE_SCATTER, V_UNEVEN, CHORUS_FLOAT32, CHORUS_SUM, 1500, 0, 0});
    add_case(w, (struct tcase){rs_algos[a], OP_REDUCE_SCATTER, V_UNEVEN, CHORUS_INT32, CHORUS_AVG, 2, 0, 0});
    add_case(w, (struct tcase){rs_algos[a], OP_REDUCE_SCATTER, V_PLAIN, CHORUS_INT32, CHORUS_MAX, 301, 0, 0});
    add_case(w, (struct tcase){rs_algos[a], OP_REDUCE_SCATTER, V_PLAIN, CHORUS_FLOAT32, CHORUS_PREMUL_SUM, 301, 0, 0});
  }
  /* all-gather */
  static const int ag_algos[] = {ALGO_RING, ALGO_RHD, ALGO_RD, ALGO_BRUCK, ALGO_ONESHOT};
  for (size_t a = 0; a < sizeof ag_algos / sizeof ag_algos[0]; a++) {
    for (int s = 0; s < ns; s++)
      add_case(w, (struct tcase){ag_algos[a], OP_ALLGATHER, V_PLAIN, CHORUS_INT32, CHORUS_SUM, sizes[s] / (s == ns - 1 ? 2 : 1), 0, 0});
    add_case(w, (struct tcase){ag_algos[a], OP_ALLGATHER, V_UNEVEN, CHORUS_INT32, CHORUS_SUM, 1000, 0, 0});
    add_case(w, (struct tcase){ag_algos[a], OP_ALLGATHER, V_UNPACKED, CHORUS_INT32, CHORUS_SUM, 1000, 0, 0});
  }
  /* all-to-all */
  static const int aa_algos[] = {ALGO_BRUCK, ALGO_PAIRWISE, ALGO_ONESHOT};
  for (size_t a = 0; a < sizeof aa_algos / sizeof aa_algos[0]; a++) {
    size_t asz[] = {0, 1, 3, 301, 1500};
    for (int s = 0; s < 5; s++)
      add_case(w, (struct tcase){aa_algos[a], OP_ALLTOALL, V_PLAIN, CHORUS_INT32, CHORUS_SUM, asz[s], 0, 0});
    add_case(w, (struct tcase){aa_algos[a], OP_ALLTOALL, V_INPLACE, CHORUS_INT32, CHORUS_SUM, 301, 0, 0});
    add_case(w, (struct tcase){aa_algos[a], OP_ALLTOALL, V_UNEVEN, CHORUS_INT32, CHORUS_SUM, 300, 0, 0});
  }
  /* barriers */
  add_case(w, (struct tcase){ALGO_RD, OP_BARRIER, V_PLAIN, CHORUS_UINT8, CHORUS_SUM, 0, 0, 0});
  add_case(w, (struct tcase){ALGO_BRUCK, OP_BARRIER, V_PLAIN, CHORUS_UINT8, CHORUS_SUM, 0, 0, 0});
  add_case(w, (struct tcase){ALGO_ONESHOT, OP_BARRIER, V_PLAIN, CHORUS_UINT8, CHORUS_SUM, 0, 0, 0});
}

/* Would algo_usable accept this case? (what the test expects, written independently) */
static int expect_usable(const struct world *w, const struct tcase *c) {
  if (!algo_table[c->algo].run[c->kind]) return 0;
  if (c->algo == ALGO_HIER) {
    int k = c->fake_hosts < 0 ? -c->fake_hosts : c->fake_hosts;
    int nhosts = (w->n + k - 1) / k;
    if (c->fake_hosts < 0) nhosts = w->n < k ? w->n : k;
    return nhosts > 1 && nhosts < w->n;
  }
  if ((c->algo == ALGO_RHD || c->algo == ALGO_RD) && c->kind == OP_ALLGATHER)
    return c->var != V_UNPACKED;
  if (c->algo == ALGO_BRUCK && c->kind == OP_ALLTOALL) return c->var != V_UNEVEN; /* alltoallv: no */
  /* direct access needs shared memory, i.e. a second rank; all-to-all with equal blocks */
  if (c->algo == ALGO_ONESHOT || c->algo == ALGO_TWOSHOT)
    return w->n > 1 && !(c->kind == OP_ALLTOALL && c->var == V_UNEVEN);
  return 1;
}

/* Fake topology: k > 0 hosts of k consecutive ranks; k < 0: |k| hosts, round-robin. */
static void set_fake_hosts(struct chorus_comm *comm, int k, int *saved_nhosts, int *saved_max,
                           int *saved_host) {
  int n = comm->nranks;
  *saved_nhosts = comm->nhosts;
  *saved_max = comm->max_per_host;
  memcpy(saved_host, comm->host_of, (size_t)n * sizeof(int));
  int hosts = 0, maxph = 0;
  for (int r = 0; r < n; r++) {
    comm->host_of[r] = k > 0 ? r / k : r % -k;
    if (comm->host_of[r] + 1 > hosts) hosts = comm->host_of[r] + 1;
  }
  for (int h = 0; h < hosts; h++) {
    int c = 0;
    for (int r = 0; r < n; r++) c += comm->host_of[r] == h;
    if (c > maxph) maxph = c;
  }
  comm->nhosts = hosts;
  comm->max_per_host = maxph;
}

struct rank_arg {
  struct world *w;
  int rank;
};

#define FAIL(...)                                                        \
  do {                                                                   \
    if (nfail++ < 3) {                                                   \
      fprintf(stderr, "  N=%d rank %d %s/%s %s %s %s count %zu root %d: ", n, me, \
              algo_name(c->algo), op_kind_name(c->kind), var_name(c->var), \
              chorus_dtype_name(c->dtype), chorus_op_name(c->redop), c->count, c->root); \
      fprintf(stderr, __VA_ARGS__);                                      \
      fprintf(stderr, "\n");                                             \
    }                                                                    \
  } while (0)

static int check_elem(chorus_dtype_t d, double got, double ref, double tol) {
  if (is_float(d)) return fabs(got - ref) <= tol || (isnan(got) && isnan(ref));
  return got == ref;
}

/* Runs case c on this rank; returns the number of failures and leaves the output buffer
 * (for the bit-identity check) in *out_keep. */
static int run_case(struct world *w, chorus_comm_t *comm, int me, const struct tcase *c,
                    void **out_keep, size_t *out_bytes) {
  const int n = w->n;
  const chorus_dtype_t d = c->dtype;
  const size_t es = dtype_size(d);
  int nfail = 0;
  int seed = (int)(c - w->cases);
  size_t *cnt = calloc(MAX_N, sizeof(size_t)), *dsp = calloc(MAX_N, sizeof(size_t));
  size_t *cnt2 = calloc(MAX_N, sizeof(size_t)), *dsp2 = calloc(MAX_N, sizeof(size_t));
  size_t in_elems = 0, out_elems = 0;
  /* shapes */
  switch (c->kind) {
    case OP_ALLREDUCE:
    case OP_BROADCAST:
    case OP_REDUCE: in_elems = out_elems = c->count; break;
    case OP_REDUCE_SCATTER:
      for (int r = 0; r < n; r++) cnt[r] = c->var == V_UNEVEN ? vcount(c->count, r, 1) : c->count;
      for (int r = 0; r < n; r++) dsp[r] = r ? dsp[r - 1] + cnt[r - 1] : 0;
      in_elems = dsp[n - 1] + cnt[n - 1];
      out_elems = cnt[me];
      break;
    case OP_ALLGATHER:
      for (int r = 0; r < n; r++) cnt[r] = c->var != V_PLAIN ? vcount(c->count, r, 2) : c->count;
      if (c->var == V_UNPACKED) { /* reverse order with one-element gaps */
        size_t off = 1;
        for (int r = n - 1; r >= 0; r--) {
          dsp[r] = off;
          off += cnt[r] + 1;
        }
        out_elems = off;
      } else {
        for (int r = 0; r < n; r++) dsp[r] = r ? dsp[r - 1] + cnt[r - 1] : 0;
        out_elems = dsp[n - 1] + cnt[n - 1];
      }
      in_elems = cnt[me];
      break;
    case OP_ALLTOALL: {
      size_t so = 0, ro = 0;
      for (int p = 0; p < n; p++) {
        cnt[p] = c->var == V_UNEVEN ? vcount(c->count, me + p, 0) : c->count;  /* me -> p */
        cnt2[p] = c->var == V_UNEVEN ? vcount(c->count, p + me, 0) : c->count; /* p -> me */
        dsp[p] = so;
        so += cnt[p] + (c->var == V_UNEVEN);
        dsp2[p] = ro;
        ro += cnt2[p] + (c->var == V_UNEVEN);
      }
      in_elems = so;
      out_elems = ro;
      if (c->var == V_INPLACE) in_elems = out_elems = so > ro ? so : ro;
      break;
    }
    default: break;
  }
  void *in = malloc(in_elems * es + 16), *out = malloc(out_elems * es + 16);
  memset(out, 0xA5, out_elems * es + 16);
  /* inputs */
  switch (c->kind) {
    case OP_ALLREDUCE:
    case OP_REDUCE:
    case OP_REDUCE_SCATTER:
      for (size_t i = 0; i < in_elems; i++) put_val(d, in, i, gen(d, c->redop, me, i, seed));
      break;
    case OP_BROADCAST:
      for (size_t i = 0; i < out_elems; i++)
        put_val(d, out, i, me == c->root ? gen(d, c->redop, c->root, i, seed) : -7);
      break;
    case OP_ALLGATHER:
      for (size_t i = 0; i < in_elems; i++) put_val(d, in, i, gen(d, c->redop, me, i, seed));
      break;
    case OP_ALLTOALL:
      for (int p = 0; p < n; p++)
        for (size_t i = 0; i < cnt[p]; i++)
          put_val(d, in, dsp[p] + i, (double)(me * 1000 + p * 10) + (double)(i % 7));
      break;
    default: break;
  }
  if (c->var == V_INPLACE) memcpy(out, in, in_elems * es);
  const void *sb = c->var == V_INPLACE ? out : in;
  chorus_redop_t rop = {c->redop, c->redop == CHORUS_PREMUL_SUM ? factor_of(me) : 1.0};
  chorus_request_t *req = NULL;
  chorus_result_t r = CHORUS_SUCCESS;
  comm->algo_force[c->kind] = c->algo;
  comm->last_algo = -1;
  switch (c->kind) {
    case OP_ALLREDUCE: r = chorus_iallreduce(comm, sb, out, c->count, d, rop, &req); break;
    case OP_BROADCAST: r = chorus_ibroadcast(comm, out, c->count, d, c->root, &req); break;
    case OP_REDUCE: r = chorus_ireduce(comm, in, out, c->count, d, rop, c->root, &req); break;
    case OP_REDUCE_SCATTER: r = chorus_ireduce_scatterv(comm, in, out, cnt, d, rop, &req); break;
    case OP_ALLGATHER: r = chorus_iallgatherv(comm, in, out, cnt, dsp, d, &req); break;
    case OP_ALLTOALL: /* equal blocks go through the uniform entry point, as users call it */
      r = c->var == V_UNEVEN ? chorus_ialltoallv(comm, sb, cnt, dsp, out, cnt2, dsp2, d, &req)
                             : chorus_ialltoall(comm, sb, out, cnt[0], d, &req);
      break;
    case OP_BARRIER: r = chorus_ibarrier(comm, &req); break;
    default: break;
  }
  if (r == CHORUS_SUCCESS) {
    r = chorus_wait(req, -1);
    if (r != CHORUS_SUCCESS) FAIL("failed: %s", chorus_request_error(req));
    chorus_request_free(req);
  } else {
    FAIL("submit failed: %s", chorus_comm_error(NULL));
  }
  comm->algo_force[c->kind] = -1;
  int usable = expect_usable(w, c);
  if (r == CHORUS_SUCCESS) {
    if (usable && comm->last_algo != c->algo)
      FAIL("ran algorithm %s instead", algo_name(comm->last_algo));
    if (!usable && comm->last_algo == c->algo) FAIL("should have been refused");
  }
  /* outputs */
  if (r == CHORUS_SUCCESS) switch (c->kind) {
      case OP_ALLREDUCE:
      case OP_REDUCE:
        if (c->kind == OP_REDUCE && me != c->root) break;
        for (size_t i = 0; i < c->count; i++) {
          double tol, ref = reference(d, c->redop, n, i, seed, &tol), got = get_val(d, out, i);
          if (!check_elem(d, got, ref, tol)) FAIL("out[%zu] = %.9g, expected %.9g", i, got, ref);
        }
        break;
      case OP_BROADCAST:
        for (size_t i = 0; i < c->count; i++) {
          double ref = gen(d, c->redop, c->root, i, seed), got = get_val(d, out, i);
          if (got != ref) FAIL("buf[%zu] = %g, expected %g", i, got, ref);
        }
        break;
      case OP_REDUCE_SCATTER:
        for (size_t i = 0; i < cnt[me]; i++) {
          double tol, ref = reference(d, c->redop, n, dsp[me] + i, seed, &tol);
          double got = get_val(d, out, i);
          if (!check_elem(d, got, ref, tol)) FAIL("out[%zu] = %.9g, expected %.9g", i, got, ref);
        }
        if (memcmp((uint8_t *)out + cnt[me] * es, "\xA5\xA5\xA5\xA5", 4) != 0) FAIL("wrote past the end");
        break;
      case OP_ALLGATHER:
        for (int p = 0; p < n; p++)
          for (size_t i = 0; i < cnt[p]; i++) {
            double ref = gen(d, c->redop, p, i, seed), got = get_val(d, out, dsp[p] + i);
            if (got != ref) FAIL("block %d [%zu] = %g, expected %g", p, i, got, ref);
          }
        if (c->var == V_UNPACKED && memcmp(out, "\xA5\xA5\xA5\xA5", 4) != 0) FAIL("wrote a gap");
        break;
      case OP_ALLTOALL:
        for (int p = 0; p < n; p++)
          for (size_t i = 0; i < cnt2[p]; i++) {
            double ref = (double)(p * 1000 + me * 10) + (double)(i % 7), got = get_val(d, out, dsp2[p] + i);
            if (got != ref) FAIL("from %d [%zu] = %g, expected %g", p, i, got, ref);
          }
        break;
      default: break;
    }
  free(in);
  free(cnt);
  free(dsp);
  free(cnt2);
  free(dsp2);
  *out_keep = out;
  *out_bytes = c->kind == OP_ALLREDUCE ? c->count * es : 0;
  return nfail + (r != CHORUS_SUCCESS);
}

static void *rank_main(void *p) {
  struct rank_arg *a = p;
  struct world *w = a->w;
  int me = a->rank, n = w->n;
  chorus_bootstrap_t bs = {&w->st, kv_set, kv_get, NULL};
  chorus_comm_options_t o = {30000, "sim"};
  chorus_comm_t *comm = NULL;
  chorus_result_t r = chorus_comm_create(me, n, &bs, &o, &comm);
  w->fail[me] = r != CHORUS_SUCCESS;
  /* the inputs add exactly in any order, so forced schedules run fp16/bf16 sums too */
  if (r == CHORUS_SUCCESS) comm->stepwise_halves_ok = 1;
  if (r != CHORUS_SUCCESS) fprintf(stderr, "rank %d: create failed: %s\n", me, chorus_comm_error(NULL));
  pthread_barrier_wait(&w->bar);
  int any = 0;
  for (int k = 0; k < n; k++) any |= w->fail[k];
  /* every rank has read fail[] before any rank writes it again (for the first case) */
  pthread_barrier_wait(&w->bar);
  if (any) {
    if (me == 0) w->failed++;
    if (comm) chorus_comm_destroy(comm);
    return NULL;
  }
  int *saved_host = calloc((size_t)n, sizeof(int));
  for (int ci = 0; ci < w->ncases; ci++) {
    const struct tcase *c = &w->cases[ci];
    int sn = 0, sm = 0;
    if (c->fake_hosts) set_fake_hosts(comm, c->fake_hosts, &sn, &sm, saved_host);
    void *out = NULL;
    size_t ob = 0;
    w->fail[me] = run_case(w, comm, me, c, &out, &ob);
    if (c->fake_hosts) {
      comm->nhosts = sn;
      comm->max_per_host = sm;
      memcpy(comm->host_of, saved_host, (size_t)n * sizeof(int));
    }
    w->outs[me] = out;
    w->out_bytes[me] = ob;
    pthread_barrier_wait(&w->bar);
    if (me == 0) {
      int bad = 0;
      for (int k = 0; k < n; k++) bad |= w->fail[k] != 0;
      for (int k = 1; k < n && !bad; k++)
        if (ob && memcmp(w->outs[k], w->outs[0], ob) != 0) {
          fprintf(stderr, "  N=%d %s/%s %s %s count %zu: rank %d result differs from rank 0\n", n,
                  algo_name(c->algo), op_kind_name(c->kind), chorus_dtype_name(c->dtype),
                  chorus_op_name(c->redop), c->count, k);
          bad = 1;
        }
      if (bad) w->failed++;
      else w->passed++;
    }
    pthread_barrier_wait(&w->bar);
    free(out);
  }
  free(saved_host);
  chorus_comm_destroy(comm);
  return NULL;
}

static void run_world(int n) {
  struct world w;
  memset(&w, 0, sizeof w);
  w.n = n;
  pthread_mutex_init(&w.st.mu, NULL);
  pthread_cond_init(&w.st.cv, NULL);
  pthread_barrier_init(&w.bar, NULL, (unsigned)n);
  build_cases(&w);
  pthread_t th[MAX_N];
  struct rank_arg args[MAX_N];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int r = 0; r < n; r++) {
    args[r] = (struct rank_arg){&w, r};
    pthread_create(&th[r], NULL, rank_main, &args[r]);
  }
  for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  printf("%s N=%2d: %d cases passed, %d failed (%.2f s)\n", w.failed ? "FAIL" : "ok  ", n,
         w.passed, w.failed, secs);
  fflush(stdout);
  g_passed += w.passed;
  g_failed += w.failed;
  pthread_barrier_destroy(&w.bar);
  store_free(&w.st);
  free(w.cases);
}

int main(void) {
  char ring[32];
  snprintf(ring, sizeof ring, "%d", RING_BYTES);
  setenv("CHORUS_BUFFSIZE", ring, 1);
  /* direct-access halves of 4 KiB: the big cases take several chunks */
  setenv("CHORUS_SHM_SCRATCH", "8192", 1);
  unsetenv("CHORUS_SHM_DISABLE");
  unsetenv("CHORUS_ALGO");
  param_reset_cache();
  const char *only = getenv("TEST_ALGO_SIM_N");
  /* SIM_MAX_N shortens the sweep to worlds of 1..SIM_MAX_N ranks (tsan and valgrind runs) */
  const char *max_s = getenv("SIM_MAX_N");
  int max_n = max_s && atoi(max_s) >= 1 && atoi(max_s) < MAX_N ? atoi(max_s) : MAX_N;
  for (int n = 1; n <= max_n; n++) {
    if (only && atoi(only) != n) continue;
    run_world(n);
  }
  printf("test_algo_sim: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
