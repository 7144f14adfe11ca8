/* test_reduce.c - unit tests of reduce.c: every dtype x op x input count against a
 * reference computed here from first principles (no code shared with reduce.c), aliasing,
 * NaN and overflow rules, fp16/bf16/float8 conversions, reduce_premul, reduce_divide, names. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

static int checks, failures;

#define EXPECT(cond, ...)                                      \
  do {                                                         \
    checks++;                                                  \
    if (!(cond)) {                                             \
      failures++;                                              \
      if (failures <= 40) {                                    \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);   \
        fprintf(stderr, __VA_ARGS__);                          \
        fputc('\n', stderr);                                   \
      }                                                        \
    }                                                          \
  } while (0)

/* ------------------------------------------------------------------ helpers */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void) { /* xorshift64* */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 2685821657736338717ull;
}

static uint32_t fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float ffrom(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static int is_fp8(chorus_dtype_t d) { return d == CHORUS_FLOAT8_E4M3 || d == CHORUS_FLOAT8_E5M2; }
static int is_float_dtype(chorus_dtype_t d) {
  return d == CHORUS_FLOAT16 || d == CHORUS_BFLOAT16 || d == CHORUS_FLOAT32 ||
         d == CHORUS_FLOAT64 || is_fp8(d);
}

/* ------------------------------------------------------------------ reference 16-bit floats */
/* Decoding and rounding from the definitions of the formats, in double arithmetic. */
static double ref_half_value(uint16_t h) {
  int exp = (h >> 10) & 31, mant = h & 1023;
  double v;
  if (exp == 31)
    v = mant ? NAN : INFINITY;
  else if (exp == 0)
    v = ldexp(mant, -24);
  else
    v = ldexp(1024 + mant, exp - 25);
  return (h & 0x8000) ? -v : v;
}
static double ref_bf16_value(uint16_t b) {
  int exp = (b >> 7) & 255, mant = b & 127;
  double v;
  if (exp == 255)
    v = mant ? NAN : INFINITY;
  else if (exp == 0)
    v = ldexp(mant, -133);
  else
    v = ldexp(128 + mant, exp - 134);
  return (b & 0x8000) ? -v : v;
}

/* Nearest value of a format with mant_bits stored mantissa bits, exponent range
 * [emin, emax], ties to even, as bits; NaN -> canonical quiet NaN. */
static uint16_t ref_round(double v, int mant_bits, int emin, int bias, int exp_bits) {
  uint16_t inf = (uint16_t)(((1u << exp_bits) - 1) << mant_bits);
  if (isnan(v)) return (uint16_t)(inf | (1u << (mant_bits - 1)));
  uint16_t sign = signbit(v) ? 0x8000 : 0;
  double a = fabs(v);
  if (isinf(a)) return sign | inf;
  if (a == 0) return sign;
  int e;
  frexp(a, &e);
  int E = e - 1 < emin ? emin : e - 1;
  double quantum = ldexp(1.0, E - mant_bits);
  double r = nearbyint(a / quantum) * quantum; /* default rounding mode: ties to even */
  int emax = (1 << exp_bits) - 2 - bias;
  if (r >= ldexp(1.0, emax + 1)) return sign | inf;
  if (r < ldexp(1.0, emin)) return sign | (uint16_t)(r / ldexp(1.0, emin - mant_bits));
  frexp(r, &e);
  E = e - 1;
  uint16_t mant = (uint16_t)((r / ldexp(1.0, E) - 1.0) * (1 << mant_bits));
  return (uint16_t)(sign | ((E + bias) << mant_bits) | mant);
}
static uint16_t ref_to_half(double v) { return ref_round(v, 10, -14, 15, 5); }
static uint16_t ref_to_bf16(double v) { return ref_round(v, 7, -126, 127, 8); }
static int half_is_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff); }
static int bf16_is_nan(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f); }

/* ------------------------------------------------------------------ reference float8 */
/* e4m3fn: bias 7, no infinities, S.1111.111 is NaN. e5m2: bias 15, IEEE rules. */
static double ref_e4m3_value(uint8_t b) {
  int exp = (b >> 3) & 15, mant = b & 7;
  double v = exp == 15 && mant == 7 ? NAN : exp == 0 ? ldexp(mant, -9) : ldexp(8 + mant, exp - 10);
  return (b & 0x80) ? -v : v;
}
static double ref_e5m2_value(uint8_t b) {
  int exp = (b >> 2) & 31, mant = b & 3;
  double v = exp == 31 ? (mant ? NAN : INFINITY) : exp == 0 ? ldexp(mant, -16) : ldexp(4 + mant, exp - 17);
  return (b & 0x80) ? -v : v;
}
/* Nearest value with mant_bits mantissa bits and exponents down to emin, ties to even;
 * above max_finite (and inf): overflow_code (e4m3fn saturates to 448 as torch does, e5m2
 * gives inf); NaN -> 0x7f | sign. */
static uint8_t ref_to_fp8(double v, int mant_bits, int emin, int bias, double max_finite,
                          uint8_t overflow_code) {
  uint8_t sign = signbit(v) ? 0x80 : 0;
  if (isnan(v)) return sign | 0x7f; /* torch keeps a NaN's sign */
  double a = fabs(v);
  if (isinf(a)) return sign | overflow_code;
  if (a == 0) return sign;
  int e;
  frexp(a, &e);
  int E = e - 1 < emin ? emin : e - 1;
  double quantum = ldexp(1.0, E - mant_bits);
  double r = nearbyint(a / quantum) * quantum;
  if (r > max_finite) return sign | overflow_code;
  if (r < ldexp(1.0, emin)) return sign | (uint8_t)(r / ldexp(1.0, emin - mant_bits));
  frexp(r, &e);
  E = e - 1;
  uint8_t mant = (uint8_t)((r / ldexp(1.0, E) - 1.0) * (1 << mant_bits));
  return (uint8_t)(sign | ((E + bias) << mant_bits) | mant);
}
static uint8_t ref_to_e4m3(double v) { return ref_to_fp8(v, 3, -6, 7, 448.0, 0x7e); }
static uint8_t ref_to_e5m2(double v) { return ref_to_fp8(v, 2, -14, 15, 57344.0, 0x7c); }
static int e4m3_is_nan(uint8_t b) { return (b & 0x7f) == 0x7f; }
static int e5m2_is_nan(uint8_t b) { return (b & 0x7c) == 0x7c && (b & 3); }

static void test_fp8_conversions(void) {
  int bad_decode = 0, bad_trip = 0;
  for (int b = 0; b < 256; b++) {
    double w4 = ref_e4m3_value((uint8_t)b), w5 = ref_e5m2_value((uint8_t)b);
    float g4 = e4m3_to_float((uint8_t)b), g5 = e5m2_to_float((uint8_t)b);
    if (isnan(w4) ? !isnan(g4) : (double)g4 != w4 || !signbit(g4) != !signbit(w4)) bad_decode++;
    if (isnan(w5) ? !isnan(g5) : (double)g5 != w5 || !signbit(g5) != !signbit(w5)) bad_decode++;
    uint8_t t4 = float_to_e4m3(g4), t5 = float_to_e5m2(g5);
    /* every NaN comes back as 0x7f with its sign */
    if (e4m3_is_nan((uint8_t)b) ? t4 != ((b & 0x80) | 0x7f) : t4 != b) bad_trip++;
    if (e5m2_is_nan((uint8_t)b) ? t5 != ((b & 0x80) | 0x7f) : t5 != b) bad_trip++;
  }
  EXPECT(bad_decode == 0, "float8 decode wrong for %d values", bad_decode);
  EXPECT(bad_trip == 0, "float8 round trip wrong for %d values", bad_trip);

  /* Midpoints between neighbours (the top one against 480 / 65536, the first value past
   * the largest finite) round to the even code; a float ulp either side decides. e4m3fn
   * saturates: past the top midpoint is still 448 (0x7e). */
  int bad_tie = 0;
  for (int fmt = 0; fmt < 2; fmt++) {
    uint8_t top = fmt == 0 ? 0x7e : 0x7b;
    for (int b = 0; b <= top; b++) {
      double lo = fmt == 0 ? ref_e4m3_value((uint8_t)b) : ref_e5m2_value((uint8_t)b);
      double hi = b == top ? (fmt == 0 ? 480.0 : 65536.0)
                           : fmt == 0 ? ref_e4m3_value((uint8_t)(b + 1)) : ref_e5m2_value((uint8_t)(b + 1));
      float mid = (float)((lo + hi) / 2); /* exact: at most 5 significant bits */
      uint8_t even = (b & 1) ? (uint8_t)(b + 1) : (uint8_t)b;
      uint8_t (*to)(float) = fmt == 0 ? float_to_e4m3 : float_to_e5m2;
      if (to(mid) != even) bad_tie++;
      if (to(nextafterf(mid, INFINITY)) != (fmt == 0 && b == top ? top : b + 1)) bad_tie++;
      if (to(nextafterf(mid, 0)) != b) bad_tie++;
      if (to(-mid) != (even | 0x80)) bad_tie++;
    }
  }
  EXPECT(bad_tie == 0, "float8 ties wrong %d times", bad_tie);

  /* A sweep over the float bit patterns against the reference rounding. */
  int bad4 = 0, bad5 = 0;
  for (uint64_t u = 0; u < (1ull << 32); u += 1021) {
    float f = ffrom((uint32_t)u);
    if (float_to_e4m3(f) != ref_to_e4m3(f)) bad4++;
    if (float_to_e5m2(f) != ref_to_e5m2(f)) bad5++;
  }
  EXPECT(bad4 == 0, "float_to_e4m3 differs from reference %d times", bad4);
  EXPECT(bad5 == 0, "float_to_e5m2 differs from reference %d times", bad5);

  /* Named cases. */
  EXPECT(float_to_e4m3(448.0f) == 0x7e && float_to_e4m3(464.0f) == 0x7e, "448, 464 ties down");
  EXPECT(float_to_e4m3(464.5f) == 0x7e && float_to_e4m3(1e6f) == 0x7e, "e4m3 saturates");
  EXPECT(float_to_e4m3(-INFINITY) == 0xfe && float_to_e4m3(NAN) == 0x7f, "e4m3 inf, NaN");
  EXPECT(float_to_e4m3(-NAN) == 0xff, "e4m3 NaN keeps its sign");
  EXPECT(float_to_e4m3(0x1p-9f) == 0x01 && float_to_e4m3(0x1p-10f) == 0x00, "e4m3 smallest subnormal");
  EXPECT(float_to_e4m3(0x3p-10f) == 0x02 && float_to_e4m3(-0.0f) == 0x80, "e4m3 subnormal tie, -0");
  EXPECT(float_to_e5m2(57344.0f) == 0x7b && float_to_e5m2(61440.0f) == 0x7c, "e5m2 top, tie to inf");
  EXPECT(float_to_e5m2(-INFINITY) == 0xfc && float_to_e5m2(-NAN) == 0xff, "e5m2 inf, NaN");
  EXPECT(float_to_e5m2(0x1p-16f) == 0x01 && float_to_e5m2(0x1p-17f) == 0x00, "e5m2 smallest subnormal");
  EXPECT(float_to_e5m2(ffrom(0x7f800001)) == 0x7f, "e5m2 NaN with low payload stays NaN");
  EXPECT(e4m3_to_float(0x7f) != e4m3_to_float(0x7f) && e4m3_to_float(0x7e) == 448.0f, "e4m3 decode");
  EXPECT(isinf(e5m2_to_float(0x7c)) && e5m2_to_float(0x01) == 0x1p-16f, "e5m2 decode");
}

/* ------------------------------------------------------------------ conversions */
static void test_conversions(void) {
  /* Every half and bf16 value decodes exactly and survives the round trip. */
  int bad_decode = 0, bad_trip = 0, bad_bdecode = 0, bad_btrip = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    double want = ref_half_value((uint16_t)h);
    float got = half_to_float((uint16_t)h);
    if (isnan(want) ? !isnan(got) : (double)got != want || !signbit(got) != !signbit(want))
      bad_decode++;
    uint16_t back = float_to_half(got);
    if (half_is_nan((uint16_t)h) ? !(half_is_nan(back) && (back & 0x8000) == (h & 0x8000))
                                 : back != h)
      bad_trip++;
    want = ref_bf16_value((uint16_t)h);
    got = bf16_to_float((uint16_t)h);
    if (fbits(got) != h << 16) bad_bdecode++;
    if (!isnan(want) && (double)got != want) bad_bdecode++;
    back = float_to_bf16(got);
    if (bf16_is_nan((uint16_t)h) ? !(bf16_is_nan(back) && (back & 0x8000) == (h & 0x8000))
                                 : back != h)
      bad_btrip++;
  }
  EXPECT(bad_decode == 0, "half_to_float wrong for %d values", bad_decode);
  EXPECT(bad_trip == 0, "half round trip wrong for %d values", bad_trip);
  EXPECT(bad_bdecode == 0, "bf16_to_float wrong for %d values", bad_bdecode);
  EXPECT(bad_btrip == 0, "bf16 round trip wrong for %d values", bad_btrip);

  /* Midpoints between neighbours round to the even one; a float ulp either side decides. */
  int bad_tie = 0, bad_btie = 0;
  for (uint32_t h = 0; h < 0x7c00; h++) {
    float lo = (float)ref_half_value((uint16_t)h);
    float hi = h + 1 == 0x7c00 ? 65536.0f : (float)ref_half_value((uint16_t)(h + 1));
    float mid = (lo + hi) / 2; /* exact: 12 significant bits */
    uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
    if (float_to_half(mid) != even) bad_tie++;
    if (float_to_half(nextafterf(mid, INFINITY)) != h + 1) bad_tie++;
    if (float_to_half(nextafterf(mid, 0)) != h) bad_tie++;
    if (float_to_half(-mid) != (even | 0x8000)) bad_tie++;
  }
  for (uint32_t b = 0; b < 0x7f80; b++) {
    float lo = bf16_to_float((uint16_t)b), hi = bf16_to_float((uint16_t)(b + 1));
    float mid = ffrom(fbits(lo) + 0x8000); /* halfway in the bit pattern is halfway in value */
    uint16_t even = (b & 1) ? (uint16_t)(b + 1) : (uint16_t)b;
    if (float_to_bf16(mid) != even) bad_btie++;
    if (float_to_bf16(nextafterf(mid, INFINITY)) != b + 1) bad_btie++;
    if (float_to_bf16(nextafterf(mid, 0)) != b) bad_btie++;
    if (float_to_bf16(-mid) != (even | 0x8000)) bad_btie++;
    (void)hi;
  }
  EXPECT(bad_tie == 0, "float_to_half ties wrong %d times", bad_tie);
  EXPECT(bad_btie == 0, "float_to_bf16 ties wrong %d times", bad_btie);

  /* A sweep over the float bit patterns against the reference rounding. */
  int bad_sweep = 0, bad_bsweep = 0;
  for (uint64_t u = 0; u < (1ull << 32); u += 1021) {
    float f = ffrom((uint32_t)u);
    uint16_t h = float_to_half(f), want = ref_to_half(f);
    if (isnan(f) ? !half_is_nan(h) : h != want) bad_sweep++;
    uint16_t b = float_to_bf16(f), bwant = ref_to_bf16(f);
    if (isnan(f) ? !bf16_is_nan(b) : b != bwant) bad_bsweep++;
  }
  EXPECT(bad_sweep == 0, "float_to_half differs from reference %d times", bad_sweep);
  EXPECT(bad_bsweep == 0, "float_to_bf16 differs from reference %d times", bad_bsweep);

  /* Named cases. */
  EXPECT(float_to_half(65504.0f) == 0x7bff, "65504");
  EXPECT(float_to_half(65519.996f) == 0x7bff, "just below 65520");
  EXPECT(float_to_half(65520.0f) == 0x7c00, "65520 ties to inf");
  EXPECT(float_to_half(1e6f) == 0x7c00 && float_to_half(-1e6f) == 0xfc00, "overflow");
  EXPECT(float_to_half(INFINITY) == 0x7c00 && float_to_half(-INFINITY) == 0xfc00, "inf");
  EXPECT(half_is_nan(float_to_half(NAN)) && half_is_nan(float_to_half(-NAN)), "NaN");
  EXPECT(half_is_nan(float_to_half(ffrom(0x7f800001))), "NaN with low payload stays NaN");
  EXPECT(float_to_half(-0.0f) == 0x8000 && float_to_half(0.0f) == 0, "signed zero");
  EXPECT(float_to_half(0x1p-24f) == 0x0001, "smallest subnormal");
  EXPECT(float_to_half(0x1p-25f) == 0x0000, "half the smallest subnormal ties to zero");
  EXPECT(float_to_half(nextafterf(0x1p-25f, 1)) == 0x0001, "above the tie");
  EXPECT(float_to_half(0x3p-25f) == 0x0002, "1.5 subnormal ulps ties to even (2)");
  EXPECT(float_to_half(0x1p-14f) == 0x0400, "smallest normal");
  EXPECT(float_to_half(0x1.ffcp-15f) == 0x0400, "largest subnormal + half ulp rounds up");
  EXPECT(float_to_half(1e-10f) == 0 && float_to_half(FLT_MIN) == 0, "underflow to zero");
  EXPECT(float_to_half(ffrom(1)) == 0, "float subnormal to zero");
  EXPECT(half_to_float(0x0001) == 0x1p-24f && half_to_float(0x03ff) == 0x3ffp-24f, "subnormals");
  EXPECT(half_to_float(0x3c00) == 1.0f && half_to_float(0xc000) == -2.0f, "normals");
  EXPECT(isinf(half_to_float(0x7c00)) && isnan(half_to_float(0x7c01)), "inf/NaN decode");
  EXPECT(float_to_bf16(1.0f) == 0x3f80 && float_to_bf16(-2.0f) == 0xc000, "bf16 normals");
  EXPECT(float_to_bf16(FLT_MAX) == 0x7f80, "FLT_MAX rounds to inf");
  EXPECT(float_to_bf16(ffrom(0x7f7f7fff)) == 0x7f7f, "just below the top tie");
  EXPECT(float_to_bf16(INFINITY) == 0x7f80 && float_to_bf16(-INFINITY) == 0xff80, "bf16 inf");
  EXPECT(float_to_bf16(ffrom(0x7f800001)) != 0x7f80 && bf16_is_nan(float_to_bf16(ffrom(0x7f800001))),
         "bf16 NaN with only low payload must not become inf");
  EXPECT(float_to_bf16(ffrom(0xffc12345)) == 0xffc1, "bf16 NaN keeps sign and payload");
  EXPECT(float_to_bf16(ffrom(0x00018000)) == 0x0002, "bf16 subnormal tie to even (up)");
  EXPECT(float_to_bf16(ffrom(0x00008000)) == 0x0000, "bf16 subnormal tie to even (down)");
  EXPECT(float_to_bf16(ffrom(0x80000001)) == 0x8000, "bf16 tiny negative to -0");
}

/* ------------------------------------------------------------------ reduce_n reference */
static int64_t get_int(const void *p, size_t i, chorus_dtype_t d) {
  switch (d) {
    case CHORUS_INT8: return ((const int8_t *)p)[i];
    case CHORUS_UINT8: return ((const uint8_t *)p)[i];
    case CHORUS_INT16: return ((const int16_t *)p)[i];
    case CHORUS_INT32: return ((const int32_t *)p)[i];
    case CHORUS_INT64: return ((const int64_t *)p)[i];
    case CHORUS_BOOL: return ((const uint8_t *)p)[i];
    default: return 0;
  }
}
static void put_int(void *p, size_t i, chorus_dtype_t d, uint64_t v) {
  switch (d) { /* keeps the low bits: the wrap-around the contract asks for */
    case CHORUS_INT8: case CHORUS_UINT8: case CHORUS_BOOL: ((uint8_t *)p)[i] = (uint8_t)v; break;
    case CHORUS_INT16: ((uint16_t *)p)[i] = (uint16_t)v; break;
    case CHORUS_INT32: ((uint32_t *)p)[i] = (uint32_t)v; break;
    case CHORUS_INT64: ((uint64_t *)p)[i] = v; break;
    default: break;
  }
}
/* Float MIN/MAX rule of the contract: x replaces acc if it is smaller/larger or NaN. */
static double fpick(chorus_op_kind_t op, double acc, double x) {
  if (isnan(x)) return x;
  if (op == CHORUS_MIN) return x < acc ? x : acc;
  return x > acc ? x : acc;
}

static void ref_reduce(void *out, void *const *in, int n, size_t count, chorus_dtype_t d,
                       chorus_op_kind_t op) {
  if (op == CHORUS_AVG || op == CHORUS_PREMUL_SUM) op = CHORUS_SUM;
  for (size_t i = 0; i < count; i++) {
    if (d == CHORUS_BOOL) {
      int acc = get_int(in[0], i, d) != 0;
      for (int k = 1; k < n; k++) {
        int x = get_int(in[k], i, d) != 0;
        if (op == CHORUS_SUM || op == CHORUS_MAX || op == CHORUS_BOR) acc = acc || x;
        else if (op == CHORUS_BXOR) acc = acc != x;
        else acc = acc && x;
      }
      put_int(out, i, d, (uint64_t)acc);
    } else if (!is_float_dtype(d)) {
      int64_t first = get_int(in[0], i, d);
      uint64_t acc = (uint64_t)first;
      int64_t best = first;
      for (int k = 1; k < n; k++) {
        int64_t x = get_int(in[k], i, d);
        switch (op) {
          case CHORUS_SUM: acc += (uint64_t)x; break;
          case CHORUS_PROD: acc *= (uint64_t)x; break;
          case CHORUS_BAND: acc &= (uint64_t)x; break;
          case CHORUS_BOR: acc |= (uint64_t)x; break;
          case CHORUS_BXOR: acc ^= (uint64_t)x; break;
          case CHORUS_MIN: if (x < best) best = x; break;
          case CHORUS_MAX: if (x > best) best = x; break;
          default: break;
        }
      }
      put_int(out, i, d, op == CHORUS_MIN || op == CHORUS_MAX ? (uint64_t)best : acc);
    } else if (d == CHORUS_FLOAT16 || d == CHORUS_BFLOAT16) {
      double (*val)(uint16_t) = d == CHORUS_FLOAT16 ? ref_half_value : ref_bf16_value;
      float acc = (float)val(((const uint16_t *)in[0])[i]);
      for (int k = 1; k < n; k++) {
        float x = (float)val(((const uint16_t *)in[k])[i]);
        if (op == CHORUS_SUM) acc = acc + x;
        else if (op == CHORUS_PROD) acc = acc * x;
        else acc = (float)fpick(op, acc, x);
      }
      ((uint16_t *)out)[i] = d == CHORUS_FLOAT16 ? ref_to_half(acc) : ref_to_bf16(acc);
    } else if (is_fp8(d)) {
      double (*val)(uint8_t) = d == CHORUS_FLOAT8_E4M3 ? ref_e4m3_value : ref_e5m2_value;
      float acc = (float)val(((const uint8_t *)in[0])[i]);
      for (int k = 1; k < n; k++) {
        float x = (float)val(((const uint8_t *)in[k])[i]);
        if (op == CHORUS_SUM) acc = acc + x;
        else if (op == CHORUS_PROD) acc = acc * x;
        else acc = (float)fpick(op, acc, x);
      }
      ((uint8_t *)out)[i] = d == CHORUS_FLOAT8_E4M3 ? ref_to_e4m3(acc) : ref_to_e5m2(acc);
    } else if (d == CHORUS_FLOAT32) {
      const float *const *fin = (const float *const *)in;
      float result;
      if (op == CHORUS_MIN || op == CHORUS_MAX) {
        result = fin[0][i];
        for (int k = 1; k < n; k++) result = (float)fpick(op, result, fin[k][i]);
      } else if (n == 2) {
        result = op == CHORUS_SUM ? fin[0][i] + fin[1][i] : fin[0][i] * fin[1][i];
      } else {
        double acc = fin[0][i];
        for (int k = 1; k < n; k++) acc = op == CHORUS_SUM ? acc + fin[k][i] : acc * fin[k][i];
        result = (float)acc;
      }
      ((float *)out)[i] = result;
    } else {
      const double *const *din = (const double *const *)in;
      double acc = din[0][i];
      for (int k = 1; k < n; k++) {
        if (op == CHORUS_SUM) acc += din[k][i];
        else if (op == CHORUS_PROD) acc *= din[k][i];
        else acc = fpick(op, acc, din[k][i]);
      }
      ((double *)out)[i] = acc;
    }
  }
}

/* Elements equal, where "equal" for floats means same bits, or both NaN. */
static int element_matches(const void *got, const void *want, size_t i, chorus_dtype_t d) {
  switch (d) {
    case CHORUS_FLOAT16: {
      uint16_t g = ((const uint16_t *)got)[i], w = ((const uint16_t *)want)[i];
      return half_is_nan(w) ? half_is_nan(g) : g == w;
    }
    case CHORUS_BFLOAT16: {
      uint16_t g = ((const uint16_t *)got)[i], w = ((const uint16_t *)want)[i];
      return bf16_is_nan(w) ? bf16_is_nan(g) : g == w;
    }
    case CHORUS_FLOAT32: {
      float g = ((const float *)got)[i], w = ((const float *)want)[i];
      return isnan(w) ? isnan(g) : fbits(g) == fbits(w);
    }
    case CHORUS_FLOAT8_E4M3: {
      uint8_t g = ((const uint8_t *)got)[i], w = ((const uint8_t *)want)[i];
      return e4m3_is_nan(w) ? e4m3_is_nan(g) : g == w;
    }
    case CHORUS_FLOAT8_E5M2: {
      uint8_t g = ((const uint8_t *)got)[i], w = ((const uint8_t *)want)[i];
      return e5m2_is_nan(w) ? e5m2_is_nan(g) : g == w;
    }
    case CHORUS_FLOAT64: {
      double g = ((const double *)got)[i], w = ((const double *)want)[i];
      return isnan(w) ? isnan(g) : memcmp(&g, &w, 8) == 0;
    }
    default: {
      size_t sz = dtype_size(d);
      return memcmp((const char *)got + i * sz, (const char *)want + i * sz, sz) == 0;
    }
  }
}

/* ------------------------------------------------------------------ input generation */
static float gen_float(void) {
  uint64_t r = rng();
  int kind = (int)(r % 100);
  if (kind < 5) {
    static const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1.0f, -1.0f,
                                    FLT_MAX, -FLT_MAX, FLT_MIN, 1e-40f, -1e-42f};
    return special[(r >> 8) % (sizeof special / sizeof special[0])];
  }
  if (kind < 12) return ffrom((uint32_t)(r >> 20));
  /* Moderate magnitudes with full mantissas: sums and products round, rarely overflow. */
  float m = 1.0f + (float)((r >> 8) & 0x7fffff) * 0x1p-23f;
  float v = ldexpf(m, (int)((r >> 40) % 24) - 12);
  return (r >> 63) ? -v : v;
}
static uint16_t gen_16(chorus_dtype_t d) {
  uint64_t r = rng();
  int kind = (int)(r % 100);
  if (kind < 10) return (uint16_t)(r >> 16); /* anything, NaN and inf included */
  if (d == CHORUS_FLOAT16) { /* exponent field 8..22: values 2^-7 .. 2^7 */
    return (uint16_t)(((r >> 20) & 0x8000) | ((8 + (r >> 24) % 15) << 10) | ((r >> 32) & 0x3ff));
  }
  return (uint16_t)(((r >> 20) & 0x8000) | ((120 + (r >> 24) % 15) << 7) | ((r >> 32) & 0x7f));
}
static uint8_t gen_8(chorus_dtype_t d) {
  uint64_t r = rng();
  if (r % 100 < 15) return (uint8_t)(r >> 16); /* anything, NaN and inf included */
  /* exponent fields around 1.0: values 2^-3 .. 2^3 */
  if (d == CHORUS_FLOAT8_E4M3)
    return (uint8_t)(((r >> 20) & 0x80) | ((4 + (r >> 24) % 7) << 3) | ((r >> 32) & 7));
  return (uint8_t)(((r >> 20) & 0x80) | ((12 + (r >> 24) % 7) << 2) | ((r >> 32) & 3));
}
static void gen_input(void *p, size_t count, chorus_dtype_t d) {
  for (size_t i = 0; i < count; i++) {
    switch (d) {
      case CHORUS_FLOAT8_E4M3: case CHORUS_FLOAT8_E5M2: ((uint8_t *)p)[i] = gen_8(d); break;
      case CHORUS_FLOAT16: case CHORUS_BFLOAT16: ((uint16_t *)p)[i] = gen_16(d); break;
      case CHORUS_FLOAT32: ((float *)p)[i] = gen_float(); break;
      case CHORUS_FLOAT64: {
        double v = (double)gen_float() * (1.0 + (double)(rng() >> 11) * 0x1p-60);
        ((double *)p)[i] = v;
        break;
      }
      case CHORUS_BOOL: { /* mostly 0/1, sometimes another non-zero byte */
        uint64_t r = rng();
        ((uint8_t *)p)[i] = (r % 8 == 0) ? (uint8_t)(2 + (r >> 8) % 254) : (uint8_t)((r >> 8) & 1);
        break;
      }
      default: {
        uint64_t r = rng();
        /* Half the time small values, so MIN/MAX/PROD see ties and non-wrapping results. */
        put_int(p, i, d, (r & 1) ? r >> 1 : (uint64_t)((int64_t)((r >> 8) % 7) - 3));
      }
    }
  }
}

/* ------------------------------------------------------------------ reduce_n matrix */
#define MAXN 17
#define GUARD 64
enum alias_mode { SEPARATE, OUT_IS_FIRST, OUT_IS_LAST, MISALIGNED, ALL_SAME, MODE_COUNT };
static const char *const mode_names[] = {"separate", "out==in[0]", "out==in[n-1]",
                                         "misaligned", "all-same"};

static void run_case(chorus_dtype_t d, chorus_op_kind_t op, int n, size_t count,
                     enum alias_mode mode) {
  size_t esz = dtype_size(d), bytes = count * esz;
  size_t offset = mode == MISALIGNED ? esz : 0;
  unsigned char *mem[MAXN + 1], *orig[MAXN];
  void *in[MAXN], *orig_ptrs[MAXN];
  for (int k = 0; k <= n; k++) {
    mem[k] = malloc(offset + bytes + GUARD);
    memset(mem[k], 0xCD, offset + bytes + GUARD);
  }
  for (int k = 0; k < n; k++) {
    in[k] = mem[k] + offset;
    orig[k] = malloc(bytes + 1);
    if (mode == ALL_SAME && k > 0) {
      memcpy(orig[k], orig[0], bytes);
    } else {
      gen_input(in[k], count, d);
      memcpy(orig[k], in[k], bytes);
    }
    orig_ptrs[k] = orig[k];
  }
  unsigned char *want = malloc(bytes + 1);
  ref_reduce(want, orig_ptrs, n, count, d, op);

  void *out = mem[n] + offset; /* poisoned with 0xCD */
  if (mode == OUT_IS_FIRST) out = in[0];
  if (mode == OUT_IS_LAST) out = in[n - 1];
  if (mode == ALL_SAME) {
    for (int k = 1; k < n; k++) in[k] = in[0];
    out = in[0];
  }
  reduce_n(out, (const void *const *)in, n, count, d, op);

  size_t bad = count;
  for (size_t i = 0; i < count && bad == count; i++)
    if (!element_matches(out, want, i, d)) bad = i;
  if (bad < count) {
    uint64_t g = 0, w = 0;
    memcpy(&g, (char *)out + bad * esz, esz);
    memcpy(&w, want + bad * esz, esz);
    EXPECT(0, "%s %s n=%d count=%zu %s: element %zu is 0x%llx, want 0x%llx", chorus_dtype_name(d),
           chorus_op_name(op), n, count, mode_names[mode], bad, (unsigned long long)g,
           (unsigned long long)w);
  } else {
    EXPECT(1, "ok");
  }
  /* Nothing written outside out, no input changed unless it is out. */
  int clobbered = 0;
  for (int k = 0; k <= n; k++) {
    for (size_t j = 0; j < offset; j++) clobbered |= mem[k][j] != 0xCD;
    for (size_t j = offset + bytes; j < offset + bytes + GUARD; j++) clobbered |= mem[k][j] != 0xCD;
    if (k < n && (void *)(mem[k] + offset) != out && !(mode == ALL_SAME && k > 0))
      clobbered |= memcmp(mem[k] + offset, orig[k], bytes) != 0;
  }
  EXPECT(!clobbered, "%s %s n=%d count=%zu %s: wrote outside out", chorus_dtype_name(d),
         chorus_op_name(op), n, count, mode_names[mode]);
  for (int k = 0; k <= n; k++) free(mem[k]);
  for (int k = 0; k < n; k++) free(orig[k]);
  free(want);
}

static void test_reduce_matrix(void) {
  static const int ns[] = {1, 2, 3, 5, 17};
  static const size_t counts[] = {0, 1, 7, 31, 1000, 4099};
  for (int d = 0; d < CHORUS_DTYPE_COUNT; d++)
    for (int op = 0; op < CHORUS_OP_COUNT; op++) {
      if (!reduce_op_supported((chorus_dtype_t)d, (chorus_op_kind_t)op)) continue;
      /* AVG / PREMUL_SUM reduce as SUM (the caller scales); one n suffices for them. */
      int scaled = op == CHORUS_AVG || op == CHORUS_PREMUL_SUM;
      for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
        if (scaled && ns[ni] != 3) continue;
        for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
          for (int m = 0; m < MODE_COUNT; m++)
            run_case((chorus_dtype_t)d, (chorus_op_kind_t)op, ns[ni], counts[ci],
                     (enum alias_mode)m);
      }
    }
}

static void test_op_supported(void) {
  for (int d = 0; d < CHORUS_DTYPE_COUNT; d++)
    for (int op = 0; op < CHORUS_OP_COUNT; op++) {
      int bitwise = op == CHORUS_BAND || op == CHORUS_BOR || op == CHORUS_BXOR;
      int scaled = op == CHORUS_AVG || op == CHORUS_PREMUL_SUM;
      int want = bitwise ? !is_float_dtype((chorus_dtype_t)d)
                         : scaled ? d != CHORUS_BOOL : 1;
      EXPECT(reduce_op_supported((chorus_dtype_t)d, (chorus_op_kind_t)op) == want,
             "reduce_op_supported(%s, %s)", chorus_dtype_name((chorus_dtype_t)d),
             chorus_op_name((chorus_op_kind_t)op));
    }
  EXPECT(!reduce_op_supported(CHORUS_DTYPE_COUNT, CHORUS_SUM), "bad dtype");
  EXPECT(!reduce_op_supported(CHORUS_FLOAT32, CHORUS_OP_COUNT), "bad op");
  EXPECT(!reduce_op_supported((chorus_dtype_t)-1, CHORUS_SUM), "negative dtype");
}

/* ------------------------------------------------------------------ targeted cases */
static void test_nan_propagation(void) {
  static const chorus_dtype_t dts[] = {CHORUS_FLOAT16, CHORUS_BFLOAT16, CHORUS_FLOAT32,
                                       CHORUS_FLOAT64};
  static const chorus_op_kind_t ops[] = {CHORUS_MIN, CHORUS_MAX, CHORUS_SUM, CHORUS_PROD};
  enum { COUNT = 37 };
  for (size_t di = 0; di < 4; di++)
    for (size_t oi = 0; oi < 4; oi++)
      for (int n = 2; n <= 5; n++)
        for (int pos = 0; pos < n; pos++) {
          chorus_dtype_t d = dts[di];
          void *in[5];
          for (int k = 0; k < n; k++) {
            in[k] = malloc(COUNT * sizeof(double));
            for (int i = 0; i < COUNT; i++) {
              double v = 1.0 + k, nan_or_v = (i % 9 == 4 && k == pos) ? NAN : v;
              if (d == CHORUS_FLOAT16) ((uint16_t *)in[k])[i] = ref_to_half(nan_or_v);
              if (d == CHORUS_BFLOAT16) ((uint16_t *)in[k])[i] = ref_to_bf16(nan_or_v);
              if (d == CHORUS_FLOAT32) ((float *)in[k])[i] = (float)nan_or_v;
              if (d == CHORUS_FLOAT64) ((double *)in[k])[i] = nan_or_v;
            }
          }
          void *out = malloc(COUNT * sizeof(double));
          reduce_n(out, (const void *const *)in, n, COUNT, d, ops[oi]);
          int bad = 0;
          for (int i = 0; i < COUNT; i++) {
            double v = d == CHORUS_FLOAT16    ? ref_half_value(((uint16_t *)out)[i])
                       : d == CHORUS_BFLOAT16 ? ref_bf16_value(((uint16_t *)out)[i])
                       : d == CHORUS_FLOAT32  ? ((float *)out)[i]
                                              : ((double *)out)[i];
            double want = ops[oi] == CHORUS_MIN ? 1.0 : ops[oi] == CHORUS_MAX ? n : 0;
            if (i % 9 == 4 ? !isnan(v) : (want != 0 && v != want)) bad++;
          }
          EXPECT(!bad, "NaN %s %s n=%d NaN in input %d: %d wrong", chorus_dtype_name(d),
                 chorus_op_name(ops[oi]), n, pos, bad);
          for (int k = 0; k < n; k++) free(in[k]);
          free(out);
        }
  /* Ties, -0 against +0 included, keep the earlier input: the same in every kernel. */
  for (size_t di = 0; di < 4; di++)
    for (int n = 2; n <= 3; n++)
      for (int op = CHORUS_MIN; op <= CHORUS_MAX; op++) {
        chorus_dtype_t d = dts[di];
        size_t esz = dtype_size(d);
        unsigned char *in0 = calloc(20, esz), *in1 = calloc(20, esz), *out = calloc(20, esz);
        const void *in[3] = {in0, in1, in1};
        for (int i = 0; i < 20; i++) { /* in0 = +0 or -0 alternately, in1 the opposite */
          unsigned char *neg = (i % 2 ? in0 : in1) + (size_t)i * esz;
          neg[esz - 1] = 0x80; /* little-endian sign bit */
        }
        reduce_n(out, in, n, 20, d, (chorus_op_kind_t)op);
        EXPECT(memcmp(out, in0, 20 * esz) == 0, "%s %s n=%d of +0/-0 keeps the first input",
               chorus_dtype_name(d), chorus_op_name((chorus_op_kind_t)op), n);
        free(in0);
        free(in1);
        free(out);
      }
  /* Infinities without NaN stay ordered. */
  float a[3] = {INFINITY, -INFINITY, 1}, b[3] = {1, 1, -INFINITY}, out[3];
  const void *in[2] = {a, b};
  reduce_n(out, in, 2, 3, CHORUS_FLOAT32, CHORUS_MIN);
  EXPECT(out[0] == 1 && out[1] == -INFINITY && out[2] == -INFINITY, "min with inf");
  reduce_n(out, in, 2, 3, CHORUS_FLOAT32, CHORUS_SUM);
  EXPECT(out[0] == INFINITY && out[1] == -INFINITY && out[2] == -INFINITY, "sum with inf");
}

static void test_integer_wrap(void) {
  {
    int32_t a[2] = {INT32_MAX, INT32_MIN}, b[2] = {1, -1}, out[2];
    const void *in[2] = {a, b};
    reduce_n(out, in, 2, 2, CHORUS_INT32, CHORUS_SUM);
    EXPECT(out[0] == INT32_MIN && out[1] == INT32_MAX, "int32 sum wraps");
    int32_t c[2] = {65536, INT32_MIN};
    const void *in2[2] = {c, c};
    reduce_n(out, in2, 2, 2, CHORUS_INT32, CHORUS_PROD);
    EXPECT(out[0] == 0 && out[1] == 0, "int32 prod wraps");
  }
  {
    int8_t a[3] = {127, -128, 100}, b[3] = {1, -1, 3}, c[3] = {0, 0, 1}, out[3];
    const void *in[3] = {a, b, c};
    reduce_n(out, in, 3, 3, CHORUS_INT8, CHORUS_SUM);
    EXPECT(out[0] == -128 && out[1] == 127 && out[2] == 104, "int8 sum wraps");
    reduce_n(out, in, 2, 3, CHORUS_INT8, CHORUS_PROD);
    EXPECT(out[0] == 127 && out[1] == -128 && out[2] == 44, "int8 prod wraps (300 -> 44)");
    reduce_n(out, in, 2, 3, CHORUS_INT8, CHORUS_MIN);
    EXPECT(out[0] == 1 && out[1] == -128 && out[2] == 3, "int8 min is signed");
  }
  {
    uint8_t a[2] = {200, 255}, b[2] = {100, 255}, out[2];
    const void *in[2] = {a, b};
    reduce_n(out, in, 2, 2, CHORUS_UINT8, CHORUS_SUM);
    EXPECT(out[0] == 44 && out[1] == 254, "uint8 sum wraps");
    reduce_n(out, in, 2, 2, CHORUS_UINT8, CHORUS_MAX);
    EXPECT(out[0] == 200 && out[1] == 255, "uint8 max is unsigned");
  }
  {
    int16_t a[40], b[40], out[40];
    for (int i = 0; i < 40; i++) a[i] = b[i] = (int16_t)(i % 2 ? -300 : 300);
    const void *in[2] = {a, b};
    reduce_n(out, in, 2, 40, CHORUS_INT16, CHORUS_PROD); /* 90000 mod 65536 */
    int bad = 0;
    for (int i = 0; i < 40; i++) bad += out[i] != 24464;
    EXPECT(!bad, "int16 prod wraps without signed overflow");
  }
  {
    int64_t a[2] = {INT64_MAX, INT64_MIN}, b[2] = {1, INT64_MIN}, out[2];
    const void *in[2] = {a, b};
    reduce_n(out, in, 2, 2, CHORUS_INT64, CHORUS_SUM);
    EXPECT(out[0] == INT64_MIN && out[1] == 0, "int64 sum wraps");
    reduce_n(out, in, 2, 2, CHORUS_INT64, CHORUS_PROD);
    EXPECT(out[0] == INT64_MAX && out[1] == 0, "int64 prod wraps");
  }
  {
    uint8_t a[4] = {2, 0, 2, 255}, b[4] = {4, 0, 0, 1}, out[4];
    const void *in[2] = {a, b};
    reduce_n(out, in, 2, 4, CHORUS_BOOL, CHORUS_BAND);
    EXPECT(out[0] == 1 && out[1] == 0 && out[2] == 0 && out[3] == 1, "bool and of non-zero bytes");
    reduce_n(out, in, 2, 4, CHORUS_BOOL, CHORUS_BXOR);
    EXPECT(out[0] == 0 && out[1] == 0 && out[2] == 1 && out[3] == 0, "bool xor of non-zero bytes");
    reduce_n(out, in, 2, 4, CHORUS_BOOL, CHORUS_SUM);
    EXPECT(out[0] == 1 && out[1] == 0 && out[2] == 1 && out[3] == 1, "bool sum is or");
    reduce_n(out, in, 1, 4, CHORUS_BOOL, CHORUS_SUM);
    EXPECT(out[0] == 1 && out[1] == 0 && out[2] == 1 && out[3] == 1, "bool n=1 normalises");
  }
  {
    /* Bitwise ops on floats are unsupported: out is left alone. */
    float a[2] = {1, 2}, out[2] = {7, 7};
    const void *in[2] = {a, a};
    reduce_n(out, in, 2, 2, CHORUS_FLOAT32, CHORUS_BAND);
    EXPECT(out[0] == 7 && out[1] == 7, "float band leaves out untouched");
  }
}

/* ------------------------------------------------------------------ premul and divide */
static double sat_trunc(double v, double lo, double hi) {
  if (isnan(v)) return 0;
  if (v <= lo) return lo;
  if (v >= hi) return hi;
  return trunc(v);
}

static void test_premul(void) {
  static const double factors[] = {0.5, 3.0, -1.25, 1.0 / 3, 0.0, 1e30};
  enum { COUNT = 1003 };
  for (int d = 0; d < CHORUS_DTYPE_COUNT; d++)
    for (size_t fi = 0; fi < sizeof factors / sizeof factors[0]; fi++)
      for (int in_place = 0; in_place < 2; in_place++) {
        double f = factors[fi];
        size_t bytes = COUNT * dtype_size((chorus_dtype_t)d);
        /* malloc'ed, so the typed accesses below give the memory its type (no aliasing UB) */
        unsigned char *src = malloc(bytes), *dst = malloc(bytes + GUARD), *want = malloc(bytes);
        gen_input(src, COUNT, (chorus_dtype_t)d);
        for (size_t i = 0; i < COUNT; i++) {
          double x;
          switch (d) {
            case CHORUS_INT8: ((int8_t *)want)[i] = (int8_t)sat_trunc(((int8_t *)src)[i] * f, -128, 127); break;
            case CHORUS_UINT8: ((uint8_t *)want)[i] = (uint8_t)sat_trunc(((uint8_t *)src)[i] * f, 0, 255); break;
            case CHORUS_INT16: ((int16_t *)want)[i] = (int16_t)sat_trunc(((int16_t *)src)[i] * f, -32768, 32767); break;
            case CHORUS_INT32: ((int32_t *)want)[i] = (int32_t)sat_trunc(((int32_t *)src)[i] * f, -2147483648.0, 2147483647.0); break;
            case CHORUS_INT64: {
              x = (double)((int64_t *)src)[i] * f;
              ((int64_t *)want)[i] = isnan(x) ? 0 : x >= 0x1p63 ? INT64_MAX : x <= -0x1p63 ? INT64_MIN : (int64_t)x;
              break;
            }
            case CHORUS_FLOAT16: ((uint16_t *)want)[i] = ref_to_half((float)(ref_half_value(((uint16_t *)src)[i]) * f)); break;
            case CHORUS_BFLOAT16: ((uint16_t *)want)[i] = ref_to_bf16((float)(ref_bf16_value(((uint16_t *)src)[i]) * f)); break;
            case CHORUS_FLOAT32: ((float *)want)[i] = (float)((double)((float *)src)[i] * f); break;
            case CHORUS_FLOAT64: ((double *)want)[i] = ((double *)src)[i] * f; break;
            case CHORUS_BOOL: ((uint8_t *)want)[i] = ((uint8_t *)src)[i] != 0 && f != 0; break;
            case CHORUS_FLOAT8_E4M3: ((uint8_t *)want)[i] = ref_to_e4m3((float)(ref_e4m3_value(((uint8_t *)src)[i]) * f)); break;
            case CHORUS_FLOAT8_E5M2: ((uint8_t *)want)[i] = ref_to_e5m2((float)(ref_e5m2_value(((uint8_t *)src)[i]) * f)); break;
          }
        }
        memset(dst, 0xCD, bytes + GUARD);
        if (in_place) {
          memcpy(dst, src, bytes);
          reduce_premul(dst, dst, COUNT, (chorus_dtype_t)d, f);
        } else {
          reduce_premul(dst, src, COUNT, (chorus_dtype_t)d, f);
        }
        size_t bad = COUNT;
        for (size_t i = 0; i < COUNT && bad == COUNT; i++)
          if (!element_matches(dst, want, i, (chorus_dtype_t)d)) bad = i;
        EXPECT(bad == COUNT, "premul %s factor %g%s: element %zu wrong",
               chorus_dtype_name((chorus_dtype_t)d), f, in_place ? " in place" : "", bad);
        int clobbered = 0;
        for (size_t j = bytes; j < bytes + GUARD; j++) clobbered |= dst[j] != 0xCD;
        EXPECT(!clobbered, "premul %s wrote past the end", chorus_dtype_name((chorus_dtype_t)d));
        free(src);
        free(dst);
        free(want);
      }
}

static void test_divide(void) {
  static const int divisors[] = {1, 2, 3, 7, 16, -1, -3, 0};
  enum { COUNT = 1003 };
  for (int d = 0; d < CHORUS_DTYPE_COUNT; d++)
    for (size_t di = 0; di < sizeof divisors / sizeof divisors[0]; di++) {
      int v = divisors[di];
      size_t bytes = COUNT * dtype_size((chorus_dtype_t)d);
      unsigned char *buf = malloc(bytes + GUARD), *want = malloc(bytes);
      memset(buf + bytes, 0xCD, GUARD);
      gen_input(buf, COUNT, (chorus_dtype_t)d);
      if (d == CHORUS_INT32) ((int32_t *)buf)[0] = INT32_MIN;
      if (d == CHORUS_INT64) ((int64_t *)buf)[0] = INT64_MIN;
      if (d == CHORUS_INT8) ((int8_t *)buf)[0] = INT8_MIN;
      memcpy(want, buf, bytes);
      for (size_t i = 0; i < COUNT; i++) {
        switch (d) {
          case CHORUS_FLOAT16: ((uint16_t *)want)[i] = ref_to_half((float)ref_half_value(((uint16_t *)buf)[i]) / (float)v); break;
          case CHORUS_BFLOAT16: ((uint16_t *)want)[i] = ref_to_bf16((float)ref_bf16_value(((uint16_t *)buf)[i]) / (float)v); break;
          case CHORUS_FLOAT32: ((float *)want)[i] = (float)((double)((float *)buf)[i] / v); break;
          case CHORUS_FLOAT64: ((double *)want)[i] = ((double *)buf)[i] / v; break;
          case CHORUS_BOOL: break; /* unchanged */
          case CHORUS_FLOAT8_E4M3: ((uint8_t *)want)[i] = ref_to_e4m3((float)ref_e4m3_value(buf[i]) / (float)v); break;
          case CHORUS_FLOAT8_E5M2: ((uint8_t *)want)[i] = ref_to_e5m2((float)ref_e5m2_value(buf[i]) / (float)v); break;
          default: {
            if (v == 0) break; /* integers: division by zero leaves the data */
            int64_t x = get_int(buf, i, (chorus_dtype_t)d);
            /* INT64_MIN / -1 wraps to itself; computed without the overflow. */
            uint64_t q = (x == INT64_MIN && v == -1) ? (uint64_t)x : (uint64_t)(x / v);
            put_int(want, i, (chorus_dtype_t)d, q);
          }
        }
      }
      reduce_divide(buf, COUNT, (chorus_dtype_t)d, v);
      size_t bad = COUNT;
      for (size_t i = 0; i < COUNT && bad == COUNT; i++)
        if (!element_matches(buf, want, i, (chorus_dtype_t)d)) bad = i;
      EXPECT(bad == COUNT, "divide %s by %d: element %zu wrong", chorus_dtype_name((chorus_dtype_t)d), v, bad);
      int clobbered = 0;
      for (size_t j = bytes; j < bytes + GUARD; j++) clobbered |= buf[j] != 0xCD;
      EXPECT(!clobbered, "divide %s wrote past the end", chorus_dtype_name((chorus_dtype_t)d));
      free(buf);
      free(want);
    }
  int32_t t[4] = {7, -7, 6, -6};
  reduce_divide(t, 4, CHORUS_INT32, 4);
  EXPECT(t[0] == 1 && t[1] == -1 && t[2] == 1 && t[3] == -1, "integer division truncates toward zero");
  int64_t big[2] = {INT64_MAX, -INT64_MAX};
  reduce_divide(big, 2, CHORUS_INT64, 3);
  EXPECT(big[0] == INT64_MAX / 3 && big[1] == -INT64_MAX / 3, "int64 divides exactly");
}

/* ------------------------------------------------------------------ names */
static void test_names(void) {
  static const char *const dnames[] = {"int8", "uint8", "int16", "int32", "int64",
                                       "float16", "bfloat16", "float32", "float64", "bool",
                                       "float8_e4m3fn", "float8_e5m2"};
  static const size_t sizes[] = {1, 1, 2, 4, 8, 2, 2, 4, 8, 1, 1, 1};
  static const char *const onames[] = {"sum", "prod", "min", "max", "avg",
                                       "premul_sum", "band", "bor", "bxor"};
  for (int d = 0; d < CHORUS_DTYPE_COUNT; d++) {
    EXPECT(strcmp(chorus_dtype_name((chorus_dtype_t)d), dnames[d]) == 0, "dtype name %d", d);
    EXPECT(chorus_dtype_size((chorus_dtype_t)d) == sizes[d], "dtype size %d", d);
  }
  for (int op = 0; op < CHORUS_OP_COUNT; op++)
    EXPECT(strcmp(chorus_op_name((chorus_op_kind_t)op), onames[op]) == 0, "op name %d", op);
  EXPECT(strcmp(chorus_dtype_name(CHORUS_DTYPE_COUNT), "unknown") == 0, "bad dtype name");
  EXPECT(strcmp(chorus_op_name(CHORUS_OP_COUNT), "unknown") == 0, "bad op name");
  EXPECT(chorus_dtype_size(CHORUS_DTYPE_COUNT) == 0, "bad dtype size");
}

int main(void) {
  test_names();
  test_op_supported();
  test_conversions();
  test_fp8_conversions();
  test_reduce_matrix();
  test_nan_propagation();
  test_integer_wrap();
  test_premul();
  test_divide();
  printf("test_reduce%s: %d checks, %d failed\n",
#ifdef CHORUS_REDUCE_PORTABLE
         " (portable kernels)",
#else
         "",
#endif
         checks, failures);
  return failures ? 1 : 0;
}
