/* test_kernels.cu - checks the CUDA reduction kernels (the .cu files of csrc/core/kernels)
 * against the CPU path they must reproduce bit for bit: chorus_cuda_reduce against
 * reduce_n followed by reduce_divide, chorus_cuda_premul against reduce_premul (reduce.c,
 * linked as C). It runs every dtype x op that reduce_op_supported allows over input counts
 * from 0 to 2^20 + 3, 1 to 16 inputs, pointer alignments (aligned, all shifted by one
 * element, mixed), in-place outputs, AVG divisors and PREMUL factors, on random inputs full
 * of extreme integers and of NaN, inf, -0 and subnormal floats. Results are compared with
 * memcmp and the elements around each output are checked for stray writes; the first
 * mismatches are printed, and the run ends with "test_kernels: N cases passed, M failed"
 * (exit status 1 on any failure). Needs a GPU; device memory stays under 300 MB. Optional
 * argument: a random seed. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "cuda_kernels.h"

/* reduce.c (C; core.h itself is C11-only) */
extern "C" {
bool reduce_op_supported(chorus_dtype_t dtype, chorus_op_kind_t op);
void reduce_n(void *out, const void *const *in, int n, size_t count, chorus_dtype_t dtype,
              chorus_op_kind_t op);
void reduce_premul(void *out, const void *in, size_t count, chorus_dtype_t dtype,
                   double factor);
void reduce_divide(void *buf, size_t count, chorus_dtype_t dtype, int divisor);
}

#define MAXN CUDA_REDUCE_MAX_IN
#define MAXC (((size_t)1 << 20) + 3)
#define GUARD 16       /* elements after (and one before) the output checked untouched */
#define FILL 0xa5      /* byte the output buffer is filled with before each case */
#define MAX_REPORTS 20 /* mismatch lines printed */

static const size_t COUNTS[] = {0, 1, 7, 8, 15, 16, 17, 1000, 65537, MAXC};
static const int NS[] = {1, 2, 3, 4, 7, 16};
static const int AVG_DIVISORS[] = {2, 3, 7};
static const double FACTORS[] = {0.5, 3.0, -1.25, 0.0, 1e10, 1e-30};
#define LEN(a) (sizeof(a) / sizeof((a)[0]))

enum align_mode { ALIGNED, SHIFTED, MIXED, ALIGN_MODES };
static const char *const ALIGN_NAME[] = {"aligned", "shifted", "mixed"};
enum inplace_mode { OUT_SEPARATE, OUT_IN0, OUT_INLAST, INPLACE_MODES };
static const char *const INPLACE_NAME[] = {"separate", "out=in[0]", "out=in[n-1]"};

/* Float inputs come in flavours, because the CPU's choice between two *different* NaNs
 * meeting in one addition or multiplication depends on how gcc ordered the operands (it
 * differs even between the vector body and the scalar tail of one loop), so no device can
 * match it there:
 *   ARITH    every special value, but each NaN is the x86 default NaN, so NaNs that meet
 *            are the same bits (SUM/PROD/AVG, MIN/MAX)
 *   PAYLOAD  NaNs of random payload (signalling too), at most one per element, and finite
 *            values too small to overflow into inf - inf or 0 * inf (SUM/PROD/AVG)
 *   ANY      anything anywhere (MIN/MAX select without arithmetic; premul has one NaN
 *            source per element) */
enum flavour { INTS, ARITH, PAYLOAD, ANY };
static const char *const FLAVOUR_NAME[] = {"ints", "arith", "payload", "any"};

static const char *const DTYPE_NAME[] = {"int8",     "uint8",   "int16",   "int32",  "int64",
                                         "float16", "bfloat16", "float32", "float64", "bool",
                                         "float8_e4m3fn", "float8_e5m2"};
static const char *const OP_NAME[] = {"sum", "prod",  "min", "max", "avg",
                                      "premul_sum", "band", "bor", "bxor"};

static const size_t ES[] = {1, 1, 2, 4, 8, 2, 2, 4, 8, 1, 1, 1};

/* ------------------------------------------------------------------ state */
static uint8_t *h_in[MAXN];           /* host inputs, MAXC elements each */
static uint8_t *d_al[MAXN], *d_sh[MAXN]; /* the same data on the device: at an aligned
                                            address, and one element past one */
static uint8_t *d_out;                /* output area: (1 + MAXC + GUARD) elements */
static uint8_t *h_ref, *h_div, *h_got; /* CPU result, CPU result divided, GPU result */
static cudaStream_t stream;
static long passed, failed, reports;

#define CUDA_CHECK(call)                                                             \
  do {                                                                               \
    cudaError_t e_ = (call);                                                         \
    if (e_ != cudaSuccess) {                                                         \
      fprintf(stderr, "test_kernels: %s:%d: %s: %s\n", __FILE__, __LINE__, #call,    \
              cudaGetErrorString(e_));                                               \
      exit(2);                                                                       \
    }                                                                                \
  } while (0)

/* ------------------------------------------------------------------ random inputs */
static uint64_t rng = 0x243f6a8885a308d3ull;
static uint64_t rnd(void) { /* xorshift64* */
  rng ^= rng >> 12;
  rng ^= rng << 25;
  rng ^= rng >> 27;
  return rng * 0x2545f4914f6cdd1dull;
}

static void put(uint8_t *buf, size_t i, size_t es, uint64_t v) {
  memcpy(buf + i * es, &v, es); /* little endian: the low es bytes */
}

/* Integers: random bits, the extremes and their neighbours, small values. */
static uint64_t gen_int(int bits, int is_signed) {
  uint64_t r = rnd(), mask = bits == 64 ? ~0ull : (1ull << bits) - 1;
  uint64_t lo = is_signed ? 1ull << (bits - 1) : 0, hi = is_signed ? mask >> 1 : mask;
  switch (r & 7) {
    case 0: return lo;
    case 1: return hi;
    case 2: return (lo + 1) & mask;
    case 3: return (hi - 1) & mask;
    case 4: return (uint64_t)((int64_t)((r >> 8) % 9) - 4) & mask; /* -4 .. 4 */
    default: return (r >> 8) & mask;
  }
}

/* Bool: zero, one, or any other non-zero byte (inputs are true when non-zero). */
static uint64_t gen_bool(void) {
  uint64_t r = rnd();
  switch (r & 3) {
    case 0:
    case 1: return 0;
    case 2: return 1;
    default: return ((r >> 8) & 0xff) | 1;
  }
}

struct fmt {
  int ebits, mbits;
  int no_inf; /* float8_e4m3fn: the top exponent holds numbers, S.1111.111 is the only NaN */
};
static const struct fmt FMT_F16 = {5, 10, 0}, FMT_BF16 = {8, 7, 0}, FMT_F32 = {8, 23, 0},
                        FMT_F64 = {11, 52, 0}, FMT_E4M3 = {4, 3, 1}, FMT_E5M2 = {5, 2, 0};

static struct fmt fmt_of(chorus_dtype_t dt) {
  switch (dt) {
    case CHORUS_FLOAT16: return FMT_F16;
    case CHORUS_BFLOAT16: return FMT_BF16;
    case CHORUS_FLOAT32: return FMT_F32;
    case CHORUS_FLOAT8_E4M3: return FMT_E4M3;
    case CHORUS_FLOAT8_E5M2: return FMT_E5M2;
    default: return FMT_F64;
  }
}

static uint64_t make_float(struct fmt f, uint64_t sign, uint64_t exp, uint64_t mant) {
  return (sign << (f.ebits + f.mbits)) | (exp << f.mbits) | (mant & ((1ull << f.mbits) - 1));
}

static uint64_t gen_nan(struct fmt f, int any_payload) {
  uint64_t emax = (1ull << f.ebits) - 1, quiet = 1ull << (f.mbits - 1);
  /* e4m3fn: 0xff decodes to the x86 default NaN (sign set, quiet) */
  if (f.no_inf) return any_payload ? ((rnd() & 1) << 7) | 0x7f : 0xff;
  if (!any_payload) return make_float(f, 1, emax, quiet); /* x86 default NaN */
  uint64_t r = rnd(), mant = (r >> 2) & ((1ull << f.mbits) - 1);
  if (!mant) mant = 1;
  return make_float(f, r & 1, emax, mant); /* quiet or signalling, either sign */
}

/* A finite value: mostly within 2^-spread..2^spread so sums round, or anywhere. */
static uint64_t gen_finite(struct fmt f, int spread, int wide) {
  uint64_t r = rnd(), bias = (1ull << (f.ebits - 1)) - 1, emax = (1ull << f.ebits) - 1;
  uint64_t sign = r & 1, mant = r >> 11, exp;
  switch ((r >> 1) % 16) {
    case 0: exp = 0, mant = mant ? mant : 1; break; /* subnormal */
    case 1: exp = 0, mant = 0; break;               /* +-0 */
    case 2: exp = 1 + ((r >> 5) & 1); break;        /* smallest normals */
    case 3: exp = wide ? 1 + (r >> 6) % (emax - 1) : bias; break;
    case 4: exp = wide ? emax - 1 : bias + 1; break; /* largest binade */
    default: exp = bias - spread + (r >> 6) % (2 * spread + 1); break;
  }
  return make_float(f, sign, exp, mant);
}

static uint64_t gen_float(struct fmt f, enum flavour fl) {
  uint64_t r = rnd() % 32, emax = (1ull << f.ebits) - 1;
  if (r == 0) /* +-inf, or the largest finite value where the format has no inf */
    return make_float(f, rnd() & 1, emax, f.no_inf ? (1ull << f.mbits) - 2 : 0);
  if (r == 1 || r == 2) return gen_nan(f, fl == ANY);
  return gen_finite(f, f.ebits >= 8 ? 10 : 6, 1);
}

/* PAYLOAD: per element, at most one input is a NaN; the rest stay within 2^-3..2^3 (16
 * factors of that cannot overflow a float accumulator). */
static void fill_payload(struct fmt f, size_t es, int nin) {
  for (size_t i = 0; i < MAXC; i++) {
    int nan_at = (rnd() & 3) == 0 ? (int)(rnd() % (uint64_t)nin) : -1;
    for (int k = 0; k < nin; k++)
      put(h_in[k], i, es, k == nan_at ? gen_nan(f, 1) : gen_finite(f, 3, 0));
  }
}

static void fill_inputs(chorus_dtype_t dt, enum flavour fl) {
  static const int bits[] = {8, 8, 16, 32, 64};
  size_t es = ES[dt];
  if (fl == PAYLOAD) {
    fill_payload(fmt_of(dt), es, MAXN);
  } else {
    for (int k = 0; k < MAXN; k++)
      for (size_t i = 0; i < MAXC; i++) {
        uint64_t v = dt == CHORUS_BOOL         ? gen_bool()
                     : dt <= CHORUS_INT64      ? gen_int(bits[dt], dt != CHORUS_UINT8)
                                               : gen_float(fmt_of(dt), fl);
        put(h_in[k], i, es, v);
      }
  }
  for (int k = 0; k < MAXN; k++) {
    CUDA_CHECK(cudaMemcpy(d_al[k], h_in[k], MAXC * es, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_sh[k] + es, h_in[k], MAXC * es, cudaMemcpyHostToDevice));
  }
}

/* ------------------------------------------------------------------ one case */
struct test_case {
  chorus_dtype_t dt;
  chorus_op_kind_t op;  /* what is tested (AVG, PREMUL_SUM included) */
  enum flavour fl;
  int n;                /* 0: premul */
  size_t count;
  enum align_mode align;
  enum inplace_mode inplace;
  int dup;              /* n == 2 with in[1] == in[0] */
  int divisor;
  double factor;
};

static void describe(const struct test_case *c, char *buf, size_t cap) {
  if (c->n == 0)
    snprintf(buf, cap, "premul dtype=%s factor=%g count=%zu %s %s flavour=%s",
             DTYPE_NAME[c->dt], c->factor, c->count, ALIGN_NAME[c->align],
             c->inplace ? "in-place" : "separate", FLAVOUR_NAME[c->fl]);
  else
    snprintf(buf, cap, "dtype=%s op=%s n=%d count=%zu %s %s%s divisor=%d flavour=%s",
             DTYPE_NAME[c->dt], OP_NAME[c->op], c->n, c->count, ALIGN_NAME[c->align],
             INPLACE_NAME[c->inplace], c->dup ? " in[1]=in[0]" : "", c->divisor,
             FLAVOUR_NAME[c->fl]);
}

static uint64_t get(const uint8_t *buf, size_t i, size_t es) {
  uint64_t v = 0;
  memcpy(&v, buf + i * es, es);
  return v;
}

static void fail(const struct test_case *c, const char *what, size_t index, uint64_t gpu,
                 uint64_t cpu) { /* index: an element of out; (size_t)-1 is the one before */
  failed++;
  if (reports++ >= MAX_REPORTS) return;
  char d[256];
  describe(c, d, sizeof d);
  int w = (int)ES[c->dt] * 2;
  printf("MISMATCH %s: %s index=%zu gpu=0x%0*llx cpu=0x%0*llx\n", d, what, index, w,
         (unsigned long long)gpu, w, (unsigned long long)cpu);
}

/* Output at element 1 of d_out when shifted, else at 0; the element before it (when
 * shifted) and GUARD after it must keep FILL. */
static void check_output(const struct test_case *c, int rc, const uint8_t *want) {
  size_t es = ES[c->dt], off = c->align == ALIGNED ? 0 : 1, span = (off + c->count + GUARD) * es;
  if (rc != 0) {
    fail(c, cudaGetErrorString((cudaError_t)rc), 0, (uint64_t)rc, 0);
    return;
  }
  CUDA_CHECK(cudaMemcpyAsync(h_got, d_out, span, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  const uint8_t *got = h_got + off * es;
  if (memcmp(got, want, c->count * es) != 0) {
    size_t i = 0;
    while (get(got, i, es) == get(want, i, es)) i++;
    fail(c, "value", i, get(got, i, es), get(want, i, es));
    return;
  }
  for (size_t b = 0; b < span; b++) {
    if (b == off * es) b += c->count * es;
    if (b < span && h_got[b] != FILL) {
      fail(c, "write outside the output (index relative to out)", (size_t)(b / es) - off,
           h_got[b], FILL);
      return;
    }
  }
  passed++;
}

/* Input k at the place the alignment mode gives it. MIXED: odd inputs shifted like the
 * output, even ones aligned, so no common alignment exists. */
static const void *input_ptr(const struct test_case *c, int k) {
  int shifted = c->align == SHIFTED || (c->align == MIXED && (k & 1));
  return shifted ? d_sh[k] + ES[c->dt] : d_al[k];
}

static void run_reduce(const struct test_case *c, const uint8_t *want) {
  size_t es = ES[c->dt];
  uint8_t *out = d_out + (c->align == ALIGNED ? 0 : es);
  const void *in[MAXN];
  for (int k = 0; k < c->n; k++) in[k] = input_ptr(c, k);
  if (c->dup) in[1] = in[0];
  CUDA_CHECK(cudaMemsetAsync(d_out, FILL, (1 + c->count + GUARD) * es, stream));
  if (c->inplace != OUT_SEPARATE) {
    int k = c->inplace == OUT_IN0 ? 0 : c->n - 1;
    CUDA_CHECK(cudaMemcpyAsync(out, in[k], c->count * es, cudaMemcpyDeviceToDevice, stream));
    if (c->dup) in[1] = out;
    in[k] = out;
  }
  chorus_op_kind_t op = c->op == CHORUS_AVG ? CHORUS_SUM : c->op; /* as cuda.c calls it */
  int rc = chorus_cuda_reduce(out, in, c->n, c->count, c->dt, op, c->divisor, stream);
  check_output(c, rc, want);
}

static void run_premul(const struct test_case *c, const uint8_t *want) {
  size_t es = ES[c->dt];
  uint8_t *out = d_out + (c->align == ALIGNED ? 0 : es);
  const void *in = c->align == SHIFTED ? d_sh[0] + es : d_al[0];
  CUDA_CHECK(cudaMemsetAsync(d_out, FILL, (1 + c->count + GUARD) * es, stream));
  if (c->inplace) {
    CUDA_CHECK(cudaMemcpyAsync(out, in, c->count * es, cudaMemcpyDeviceToDevice, stream));
    in = out;
  }
  int rc = chorus_cuda_premul(out, in, c->count, c->dt, c->factor, stream);
  check_output(c, rc, want);
}

/* ------------------------------------------------------------------ sweeps */
/* Every alignment and output placement of one reduction, against one CPU result. */
static void reduce_placements(struct test_case *c, const uint8_t *want) {
  for (int a = 0; a < ALIGN_MODES; a++)
    for (int p = 0; p < INPLACE_MODES; p++) {
      if (p == OUT_INLAST && (c->n == 1 || c->dup)) continue; /* same as out=in[0] */
      c->align = (enum align_mode)a;
      c->inplace = (enum inplace_mode)p;
      run_reduce(c, want);
    }
}

static void sweep_reduce(chorus_dtype_t dt, chorus_op_kind_t op, enum flavour fl) {
  size_t es = ES[dt];
  for (size_t ni = 0; ni < LEN(NS); ni++)
    for (int dup = 0; dup <= (NS[ni] == 2); dup++)
      for (size_t ci = 0; ci < LEN(COUNTS); ci++) {
        struct test_case c = {dt, op, fl, NS[ni], COUNTS[ci], ALIGNED, OUT_SEPARATE, dup, 1, 0};
        const void *in[MAXN];
        for (int k = 0; k < c.n; k++) in[k] = h_in[k];
        if (dup) in[1] = in[0];
        reduce_n(h_ref, in, c.n, c.count, dt, op);
        if (op != CHORUS_AVG) {
          /* A divisor of 0 or 1 must divide nothing (the caller divides only for AVG). */
          c.divisor = ci & 1 ? 0 : 1;
          reduce_placements(&c, h_ref);
          continue;
        }
        for (size_t di = 0; di < LEN(AVG_DIVISORS); di++) {
          c.divisor = AVG_DIVISORS[di];
          memcpy(h_div, h_ref, c.count * es);
          reduce_divide(h_div, c.count, dt, c.divisor);
          reduce_placements(&c, h_div);
        }
      }
}

static void sweep_premul(chorus_dtype_t dt, enum flavour fl) {
  for (size_t fi = 0; fi < LEN(FACTORS); fi++)
    for (size_t ci = 0; ci < LEN(COUNTS); ci++) {
      struct test_case c = {dt, CHORUS_PREMUL_SUM, fl, 0, COUNTS[ci], ALIGNED, OUT_SEPARATE,
                            0, 1, FACTORS[fi]};
      reduce_premul(h_ref, h_in[0], c.count, dt, c.factor);
      for (int a = 0; a < ALIGN_MODES; a++)
        for (int p = 0; p < 2; p++) {
          if (p && a == MIXED) continue; /* in-place needs in == out */
          c.align = (enum align_mode)a;
          c.inplace = (enum inplace_mode)p;
          run_premul(&c, h_ref);
        }
    }
}

static int is_float(chorus_dtype_t dt) {
  return dt == CHORUS_FLOAT16 || dt == CHORUS_BFLOAT16 || dt == CHORUS_FLOAT32 ||
         dt == CHORUS_FLOAT64 || dt == CHORUS_FLOAT8_E4M3 || dt == CHORUS_FLOAT8_E5M2;
}

/* Which ops a flavour of inputs is valid for (see enum flavour). */
static int flavour_fits(enum flavour fl, chorus_op_kind_t op) {
  int minmax = op == CHORUS_MIN || op == CHORUS_MAX;
  return fl == INTS || fl == ARITH || (fl == PAYLOAD && !minmax) || (fl == ANY && minmax);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sweep_dtype(chorus_dtype_t dt) {
  static const enum flavour float_flavours[] = {ARITH, PAYLOAD, ANY};
  int nfl = is_float(dt) ? 3 : 1;
  long p0 = passed, f0 = failed;
  double t0 = now_s();
  for (int f = 0; f < nfl; f++) {
    enum flavour fl = is_float(dt) ? float_flavours[f] : INTS;
    fill_inputs(dt, fl);
    for (int op = 0; op < CHORUS_OP_COUNT; op++)
      if (reduce_op_supported(dt, (chorus_op_kind_t)op) && flavour_fits(fl, (chorus_op_kind_t)op))
        sweep_reduce(dt, (chorus_op_kind_t)op, fl);
    if (fl == INTS || fl == ANY) sweep_premul(dt, fl);
  }
  printf("  %-8s %7ld cases, %ld failed (%.1f s)\n", DTYPE_NAME[dt], passed - p0 + failed - f0,
         failed - f0, now_s() - t0);
  fflush(stdout);
}

/* ------------------------------------------------------------------ argument checks */
static void expect_rc(const char *what, int got, int want) {
  if (got == want) {
    passed++;
    return;
  }
  failed++;
  printf("MISMATCH %s: returned %d, want %d\n", what, got, want);
}

/* chorus_cuda_reduce over the first n aligned inputs (a 17th repeats the first). */
static int try_reduce(int n, size_t count, chorus_dtype_t dt, chorus_op_kind_t op) {
  const void *in[MAXN + 1];
  for (int k = 0; k <= MAXN; k++) in[k] = d_al[k % MAXN];
  return chorus_cuda_reduce(d_out, in, n, count, dt, op, 1, stream);
}

static void check_arguments(void) {
  const int inval = (int)cudaErrorInvalidValue;
  expect_rc("bad dtype", try_reduce(2, 8, CHORUS_DTYPE_COUNT, CHORUS_SUM), inval);
  expect_rc("bad op", try_reduce(2, 8, CHORUS_INT32, CHORUS_OP_COUNT), inval);
  expect_rc("band on float32", try_reduce(2, 8, CHORUS_FLOAT32, CHORUS_BAND), inval);
  expect_rc("avg on bool", try_reduce(2, 8, CHORUS_BOOL, CHORUS_AVG), inval);
  expect_rc("n = 0", try_reduce(0, 8, CHORUS_INT32, CHORUS_SUM), inval);
  expect_rc("n = 17", try_reduce(MAXN + 1, 8, CHORUS_INT32, CHORUS_SUM), inval);
  expect_rc("count = 0", try_reduce(2, 0, CHORUS_INT32, CHORUS_SUM), 0);
  expect_rc("in = NULL",
            chorus_cuda_reduce(d_out, NULL, 2, 8, CHORUS_INT32, CHORUS_SUM, 1, stream), inval);
  expect_rc("premul bad dtype",
            chorus_cuda_premul(d_out, d_al[0], 8, CHORUS_DTYPE_COUNT, 2.0, stream), inval);
  expect_rc("premul count = 0",
            chorus_cuda_premul(d_out, d_al[0], 0, CHORUS_FLOAT32, 2.0, stream), 0);
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

/* ------------------------------------------------------------------ several outputs, copies */
static void expect_same(const char *what, const uint8_t *dev_a, const uint8_t *dev_b,
                        size_t bytes) {
  static uint8_t *ha, *hb;
  if (!ha) {
    ha = (uint8_t *)malloc(MAXC * 8 + 64);
    hb = (uint8_t *)malloc(MAXC * 8 + 64);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaMemcpy(ha, dev_a, bytes, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(hb, dev_b, bytes, cudaMemcpyDeviceToHost));
  if (memcmp(ha, hb, bytes) == 0) {
    passed++;
    return;
  }
  size_t i = 0;
  while (ha[i] == hb[i]) i++;
  failed++;
  if (reports++ < MAX_REPORTS)
    printf("MISMATCH %s: byte %zu of %zu: 0x%02x, want 0x%02x\n", what, i, bytes, ha[i], hb[i]);
}

/* chorus_cuda_reduce_multi writes chorus_cuda_reduce's (CPU-checked) result to every output,
 * an output at an input's address included (the same-GPU all_reduce, in place); and
 * chorus_cuda_copy_batch copies every entry byte for byte at any alignment. */
static void check_multi_and_copy(void) {
  static const chorus_dtype_t dts[] = {CHORUS_FLOAT32, CHORUS_BFLOAT16, CHORUS_INT8,
                                       CHORUS_FLOAT64};
  static const size_t counts[] = {0, 1, 17, 4099, MAXC - 3};
  const int n = 4, nout = 4;
  uint8_t *ref, *outs[4], *ins[4];
  size_t bytes = (MAXC + 1) * 8;
  CUDA_CHECK(cudaMalloc((void **)&ref, bytes));
  for (int o = 0; o < nout; o++) CUDA_CHECK(cudaMalloc((void **)&outs[o], bytes));
  for (int k = 0; k < n; k++) CUDA_CHECK(cudaMalloc((void **)&ins[k], bytes));
  for (size_t di = 0; di < LEN(dts); di++) {
    chorus_dtype_t dt = dts[di];
    fill_inputs(dt, dt == CHORUS_INT8 ? INTS : ARITH);
    for (size_t ci = 0; ci < LEN(counts); ci++) {
      size_t count = counts[ci], es = ES[dt];
      for (int k = 0; k < n; k++)
        CUDA_CHECK(cudaMemcpy(ins[k], h_in[k], count * es, cudaMemcpyHostToDevice));
      /* a copy from pageable memory may return before its DMA is done, and `stream` does
       * not wait for the legacy stream */
      CUDA_CHECK(cudaDeviceSynchronize());
      const void *in[4] = {ins[0], ins[1], ins[2], ins[3]};
      int rc = chorus_cuda_reduce(ref, in, n, count, dt, CHORUS_SUM, 1, stream);
      expect_rc("reduce for reduce_multi", rc, 0);
      /* outputs: three separate ones and, in place, input 2 */
      void *out[4] = {outs[0], outs[1], outs[2], ins[2]};
      rc = chorus_cuda_reduce_multi(out, nout, in, n, count, dt, CHORUS_SUM, 1, stream);
      expect_rc("reduce_multi", rc, 0);
      char what[96];
      for (int o = 0; o < nout; o++) {
        snprintf(what, sizeof what, "reduce_multi %s count %zu output %d", DTYPE_NAME[dt],
                 count, o);
        expect_same(what, (const uint8_t *)out[o], ref, count * es);
      }
    }
  }
  /* copies: entries of many sizes and (mis)alignments, one batch of more than one launch */
  const int entries = CUDA_COPY_BATCH_MAX + 5;
  void *dst[CUDA_COPY_BATCH_MAX + 5];
  const void *src[CUDA_COPY_BATCH_MAX + 5];
  size_t len[CUDA_COPY_BATCH_MAX + 5];
  fill_inputs(CHORUS_UINT8, INTS);
  CUDA_CHECK(cudaMemcpy(ins[0], h_in[0], MAXC, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(outs[0], 0, bytes));
  CUDA_CHECK(cudaDeviceSynchronize());
  size_t at = 0;
  for (int k = 0; k < entries; k++) {
    size_t l = k == 0 ? 0 : k % 7 == 0 ? 65537 + (size_t)k : (size_t)(rnd() % 300);
    size_t so = rnd() % 32, dof = rnd() % 32;
    if (at + dof + l + 64 > MAXC * 8 || so + l > MAXC) l = 1;
    src[k] = ins[0] + so;
    dst[k] = outs[0] + at + dof;
    len[k] = l;
    at += dof + l + 64;
  }
  expect_rc("copy_batch", chorus_cuda_copy_batch(dst, src, len, entries, stream), 0);
  for (int k = 0; k < entries; k++) {
    char what[64];
    snprintf(what, sizeof what, "copy_batch entry %d (%zu bytes)", k, len[k]);
    if (len[k]) expect_same(what, (const uint8_t *)dst[k], (const uint8_t *)src[k], len[k]);
  }
  expect_rc("copy_batch n < 0", chorus_cuda_copy_batch(dst, src, len, -1, stream),
            (int)cudaErrorInvalidValue);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaFree(ref));
  for (int o = 0; o < nout; o++) CUDA_CHECK(cudaFree(outs[o]));
  for (int k = 0; k < n; k++) CUDA_CHECK(cudaFree(ins[k]));
}

/* ------------------------------------------------------------------ main */
static void *host_alloc(size_t bytes) {
  void *p = malloc(bytes);
  if (!p) {
    fprintf(stderr, "test_kernels: out of host memory\n");
    exit(2);
  }
  return p;
}

static void setup(void) {
  size_t bytes = (MAXC + 1) * 8, out_bytes = (1 + MAXC + GUARD) * 8;
  for (int k = 0; k < MAXN; k++) {
    h_in[k] = (uint8_t *)host_alloc(MAXC * 8);
    CUDA_CHECK(cudaMalloc((void **)&d_al[k], bytes));
    CUDA_CHECK(cudaMalloc((void **)&d_sh[k], bytes));
  }
  CUDA_CHECK(cudaMalloc((void **)&d_out, out_bytes));
  h_ref = (uint8_t *)host_alloc(MAXC * 8);
  h_div = (uint8_t *)host_alloc(MAXC * 8);
  CUDA_CHECK(cudaMallocHost((void **)&h_got, out_bytes)); /* pinned: fast read-back */
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
}

static void teardown(void) {
  for (int k = 0; k < MAXN; k++) {
    free(h_in[k]);
    CUDA_CHECK(cudaFree(d_al[k]));
    CUDA_CHECK(cudaFree(d_sh[k]));
  }
  CUDA_CHECK(cudaFree(d_out));
  free(h_ref);
  free(h_div);
  CUDA_CHECK(cudaFreeHost(h_got));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

int main(int argc, char **argv) {
  if (argc > 1) rng = strtoull(argv[1], NULL, 0) | 1;
  int dev;
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  printf("test_kernels: %s, seed 0x%llx\n", prop.name, (unsigned long long)rng);
  setup();
  check_arguments();
  check_multi_and_copy();
  for (int dt = 0; dt < CHORUS_DTYPE_COUNT; dt++) sweep_dtype((chorus_dtype_t)dt);
  teardown();
  printf("test_kernels: %ld cases passed, %ld failed\n", passed, failed);
  return failed ? 1 : 0;
}
