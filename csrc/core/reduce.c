/* reduce.c - the element-wise reduction kernels behind every reducing collective
 * (reduce_n, reduce_premul, reduce_divide), the fp16/bf16 <-> float conversions and the
 * dtype / op names of the public API. */
#include <math.h>
#include <string.h>

#include "core.h"

/* CHORUS_REDUCE_PORTABLE compiles out the x86 AVX2/F16C kernels, so that the portable
 * fp16/bf16 kernels can be tested on machines that have those instructions. */
#if defined(__x86_64__) && !defined(CHORUS_REDUCE_PORTABLE)
#define REDUCE_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define REDUCE_X86 0
#endif

/* Elements per block of the n > 2 kernels: a double accumulator of 8 KiB stays in L1. */
#define BLOCK 1024
/* Inner loops run over a constant CHUNK so that even -O2 (gcc's "very cheap" vector cost
 * model, which refuses loops of unknown trip count) vectorises them; a scalar loop takes
 * the remainder. */
#define CHUNK 32

/* ------------------------------------------------------------------ conversions */
static inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
static inline float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* cond ? a : b as bit masks. A ternary lets gcc sink the float arithmetic of the unused
 * arm into a branch, and a branch with float operations blocks vectorisation. */
static inline uint32_t select_u32(int cond, uint32_t a, uint32_t b) {
  uint32_t mask = 0u - (uint32_t)(cond != 0);
  return (a & mask) | (b & ~mask);
}

static inline float bf16_load(uint16_t b) { return f32_from_bits((uint32_t)b << 16); }

/* Round to nearest even by adding just under half an ulp (plus the lowest kept bit).
 * NaN keeps sign and upper payload; the quiet bit guarantees it does not become inf. */
static inline uint16_t bf16_store(float f) {
  uint32_t u = f32_bits(f);
  uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  uint32_t quiet_nan = u | 0x00400000u;
  return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded) >> 16);
}

/* Branch-free half -> float (after F. Giesen): move exponent and mantissa into place,
 * rebias, then fix up inf/NaN (exponent 31) and zero/subnormal (exponent 0). */
static inline float half_load(uint16_t h) {
  const uint32_t exp_mask = 0x7c00u << 13;
  uint32_t o = ((uint32_t)h & 0x7fffu) << 13;
  uint32_t exp = o & exp_mask;
  o += (uint32_t)(127 - 15) << 23;
  uint32_t special = o + ((uint32_t)(128 - 16) << 23);
  /* Subnormal: mant * 2^-24, computed exactly as (2^-14 + mant * 2^-24) - 2^-14. */
  uint32_t subnormal = f32_bits(f32_from_bits(o + (1u << 23)) - f32_from_bits(113u << 23));
  o = select_u32(exp == exp_mask, special, select_u32(exp == 0, subnormal, o));
  return f32_from_bits(o | (((uint32_t)h & 0x8000u) << 16));
}

/* float -> half, round to nearest even. NaN: quiet bit set, payload truncated, which is
 * what F16C's vcvtps2ph produces, so both paths give the same bits. All three cases are
 * computed and one selected, so the portable kernels vectorise. */
static inline uint16_t half_store(float value) {
  uint32_t f = f32_bits(value);
  uint32_t sign = (f >> 16) & 0x8000u;
  f &= 0x7fffffffu;
  /* >= 2^16 (rounds to inf), inf or NaN */
  uint32_t special = 0x7c00u | select_u32(f > 0x7f800000u, 0x200u | ((f >> 13) & 0x3ffu), 0);
  /* < 2^-14, subnormal or zero: adding 0.5 aligns the ten result bits at the bottom of
   * the mantissa and the FPU's round-to-nearest-even does the rounding. */
  uint32_t subnormal = f32_bits(f32_from_bits(f) + 0.5f) - (126u << 23);
  /* Normal: rebias, add just under half an ulp plus the lowest kept bit; the carry may
   * bump the exponent, up to inf. */
  uint32_t normal = (f + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((f >> 13) & 1u)) >> 13;
  uint32_t o = select_u32(f >= (143u << 23), special, select_u32(f < (113u << 23), subnormal, normal));
  return (uint16_t)(o | sign);
}

/* float8 e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities; 0x7f and 0xff
 * are its only NaNs. Decoding moves the seven value bits under the float's exponent and
 * rebiases; a subnormal (exponent 0) is mant * 2^-9, computed exactly as
 * (2^14 + mant * 2^-9) - 2^14 (2^14 has an ulp of 2^-9). */
static inline float e4m3_load(uint8_t x) {
  uint32_t v = x & 0x7fu;
  uint32_t normal = (v << 20) + ((uint32_t)(127 - 7) << 23);
  uint32_t subnormal = f32_bits(f32_from_bits((141u << 23) | v) - 16384.0f);
  uint32_t o = select_u32(v == 0x7fu, 0x7fc00000u, select_u32(v < 8, subnormal, normal));
  return f32_from_bits(o | ((uint32_t)(x & 0x80u) << 24));
}

/* Round to nearest even, saturating as torch does: everything from 464 (halfway between
 * 448, the largest value, and the NaN pattern above it) up, inf included, gives 448; NaN
 * gives NaN. Below 2^-6 adding 2^14 leaves the subnormal result in the low mantissa bits,
 * rounded by the FPU. */
static inline uint8_t e4m3_store(float value) {
  uint32_t f = f32_bits(value);
  uint32_t sign = (f >> 24) & 0x80u;
  f &= 0x7fffffffu;
  uint32_t subnormal = f32_bits(f32_from_bits(f) + 16384.0f) - (141u << 23);
  uint32_t normal = (f - ((uint32_t)(127 - 7) << 23) + 0x7ffffu + ((f >> 20) & 1u)) >> 20;
  uint32_t special = select_u32(f > 0x7f800000u, 0x7fu, 0x7eu);
  uint32_t o = select_u32(f >= 0x43e80000u, special, select_u32(f < (121u << 23), subnormal, normal));
  return (uint8_t)(o | sign);
}

/* float8 e5m2 is the top byte of a float16 (5 exponent bits, 2 mantissa bits). */
static inline float e5m2_load(uint8_t x) { return half_load((uint16_t)((uint16_t)x << 8)); }

/* As half_store with two mantissa bits: overflow rounds to inf (the carry out of the
 * mantissa reaches exponent 31); 2^16 and up, inf and NaN handled apart. Subnormals
 * (below 2^-14) through 2^7, whose ulp is 2^-16. */
static inline uint8_t e5m2_store(float value) {
  uint32_t f = f32_bits(value);
  uint32_t sign = (f >> 24) & 0x80u;
  f &= 0x7fffffffu;
  uint32_t special = select_u32(f > 0x7f800000u, 0x7fu, 0x7cu);
  uint32_t subnormal = f32_bits(f32_from_bits(f) + 128.0f) - (134u << 23);
  uint32_t normal = (f - ((uint32_t)(127 - 15) << 23) + 0xfffffu + ((f >> 21) & 1u)) >> 21;
  uint32_t o = select_u32(f >= (143u << 23), special, select_u32(f < (113u << 23), subnormal, normal));
  return (uint8_t)(o | sign);
}

float e4m3_to_float(uint8_t x) { return e4m3_load(x); }
uint8_t float_to_e4m3(float f) { return e4m3_store(f); }
float e5m2_to_float(uint8_t x) { return e5m2_load(x); }
uint8_t float_to_e5m2(float f) { return e5m2_store(f); }
float half_to_float(uint16_t h) { return half_load(h); }
uint16_t float_to_half(float f) { return half_store(f); }
float bf16_to_float(uint16_t b) { return bf16_load(b); }
uint16_t float_to_bf16(float f) { return bf16_store(f); }

/* ------------------------------------------------------------------ kernel building blocks */
/* LOAD turns a stored element into its accumulator value, STORE rounds it back. */
#define LD_PLAIN(x) (x)
#define LD_BOOL(x) ((x) != 0)
#define LD_BF16(x) bf16_load(x)
#define LD_HALF(x) half_load(x)
#define ST_CAST(T, x) ((T)(x))
#define ST_BF16(T, x) bf16_store(x)
#define ST_HALF(T, x) half_store(x)
#define LD_E4M3(x) e4m3_load(x)
#define LD_E5M2(x) e5m2_load(x)
#define ST_E4M3(T, x) e4m3_store(x)
#define ST_E5M2(T, x) e5m2_store(x)

/* COMBINE(acc, x) folds the next input x into acc. Integer SUM/PROD run on the unsigned
 * type so overflow wraps without UB; "* 1u" keeps 16-bit products out of signed int. */
#define OP_ADD(a, b) ((a) + (b))
#define OP_MUL(a, b) ((a) * (b))
#define OP_UMUL(a, b) ((a) * 1u * (b))
#define OP_AND(a, b) ((a) & (b))
#define OP_OR(a, b) ((a) | (b))
#define OP_XOR(a, b) ((a) ^ (b))
#define OP_IMIN(a, b) ((b) < (a) ? (b) : (a))
#define OP_IMAX(a, b) ((b) > (a) ? (b) : (a))
/* Floats: a NaN input makes the result NaN (like torch.minimum/maximum); on ties,
 * including -0 vs +0, the earlier input wins. */
#define OP_FMIN(a, b) ((((b) < (a)) | isnan(b)) ? (b) : (a))
#define OP_FMAX(a, b) ((((b) > (a)) | isnan(b)) ? (b) : (a))

typedef void (*reduce_fn)(void *out, const void *const *in, int n, size_t count);

/* One dtype x op. T is the stored type, ACC2 the accumulator for two inputs, ACCN for
 * more. Generated functions:
 *   NAME##_2 / _2a / _2b  two inputs; out distinct, out == a, out == b. restrict lets the
 *                         compiler vectorise without runtime alias checks (which would
 *                         fall back to scalar code exactly in the in-place case).
 *   NAME##_n              any n, blockwise through a stack accumulator; every read of a
 *                         block precedes its writes, so out may alias any input.
 *   NAME                  picks one of the above. */
#define DEFINE_REDUCE(NAME, T, ACC2, ACCN, LOAD, STORE, COMBINE)                            \
  static inline T NAME##_one2(T a, T b) {                                                  \
    ACC2 x = (ACC2)LOAD(a), y = (ACC2)LOAD(b);                                             \
    ACC2 r = COMBINE(x, y);                                                                \
    return STORE(T, r);                                                                    \
  }                                                                                        \
  static void NAME##_2(T *restrict out, const T *restrict a, const T *restrict b,          \
                       size_t count) {                                                     \
    size_t i = 0;                                                                          \
    for (; i + CHUNK <= count; i += CHUNK)                                                 \
      for (size_t j = 0; j < CHUNK; j++) out[i + j] = NAME##_one2(a[i + j], b[i + j]);     \
    for (; i < count; i++) out[i] = NAME##_one2(a[i], b[i]);                               \
  }                                                                                        \
  static void NAME##_2a(T *restrict a, const T *restrict b, size_t count) {                \
    size_t i = 0;                                                                          \
    for (; i + CHUNK <= count; i += CHUNK)                                                 \
      for (size_t j = 0; j < CHUNK; j++) a[i + j] = NAME##_one2(a[i + j], b[i + j]);       \
    for (; i < count; i++) a[i] = NAME##_one2(a[i], b[i]);                                 \
  }                                                                                        \
  static void NAME##_2b(const T *restrict a, T *restrict b, size_t count) {                \
    size_t i = 0;                                                                          \
    for (; i + CHUNK <= count; i += CHUNK)                                                 \
      for (size_t j = 0; j < CHUNK; j++) b[i + j] = NAME##_one2(a[i + j], b[i + j]);       \
    for (; i < count; i++) b[i] = NAME##_one2(a[i], b[i]);                                 \
  }                                                                                        \
  /* Inlined twice: with len == BLOCK (constant, vectorises at -O2) and for the tail. */   \
  static inline __attribute__((always_inline)) void NAME##_block(                          \
      T *out, const void *const *in, int n, size_t base, size_t len) {                     \
    ACCN acc[BLOCK];                                                                       \
    const T *src = (const T *)in[0] + base;                                                \
    for (size_t i = 0; i < len; i++) acc[i] = (ACCN)LOAD(src[i]);                          \
    for (int k = 1; k < n; k++) {                                                          \
      src = (const T *)in[k] + base;                                                       \
      for (size_t i = 0; i < len; i++) {                                                   \
        ACCN x = (ACCN)LOAD(src[i]);                                                       \
        acc[i] = COMBINE(acc[i], x);                                                       \
      }                                                                                    \
    }                                                                                      \
    for (size_t i = 0; i < len; i++) out[base + i] = STORE(T, acc[i]);                     \
  }                                                                                        \
  static void NAME##_n(T *out, const void *const *in, int n, size_t count) {               \
    size_t base = 0;                                                                       \
    for (; base + BLOCK <= count; base += BLOCK) NAME##_block(out, in, n, base, BLOCK);    \
    if (base < count) NAME##_block(out, in, n, base, count - base);                        \
  }                                                                                        \
  static void NAME(void *out, const void *const *in, int n, size_t count) {                \
    if (n == 2 && in[0] != in[1]) {                                                        \
      if (out == in[0])                                                                    \
        NAME##_2a((T *)out, (const T *)in[1], count);                                      \
      else if (out == in[1])                                                               \
        NAME##_2b((const T *)in[0], (T *)out, count);                                      \
      else                                                                                 \
        NAME##_2((T *)out, (const T *)in[0], (const T *)in[1], count);                     \
      return;                                                                              \
    }                                                                                      \
    NAME##_n((T *)out, in, n, count);                                                      \
  }

/* Integers: P is the name prefix, T the type, U its unsigned twin. */
#define DEFINE_INT_KERNELS(P, T, U)                                      \
  DEFINE_REDUCE(P##_sum, T, U, U, LD_PLAIN, ST_CAST, OP_ADD)             \
  DEFINE_REDUCE(P##_prod, T, U, U, LD_PLAIN, ST_CAST, OP_UMUL)           \
  DEFINE_REDUCE(P##_min, T, T, T, LD_PLAIN, ST_CAST, OP_IMIN)            \
  DEFINE_REDUCE(P##_max, T, T, T, LD_PLAIN, ST_CAST, OP_IMAX)            \
  DEFINE_REDUCE(P##_band, T, U, U, LD_PLAIN, ST_CAST, OP_AND)            \
  DEFINE_REDUCE(P##_bor, T, U, U, LD_PLAIN, ST_CAST, OP_OR)              \
  DEFINE_REDUCE(P##_bxor, T, U, U, LD_PLAIN, ST_CAST, OP_XOR)

DEFINE_INT_KERNELS(i8, int8_t, uint8_t)
DEFINE_INT_KERNELS(u8, uint8_t, uint8_t)
DEFINE_INT_KERNELS(i16, int16_t, uint16_t)
DEFINE_INT_KERNELS(i32, int32_t, uint32_t)
DEFINE_INT_KERNELS(i64, int64_t, uint64_t)

/* Floats: ACC2 float for float32 is exact enough (one IEEE op is correctly rounded);
 * with more inputs SUM/PROD accumulate in double and round once. */
DEFINE_REDUCE(f32_sum, float, float, double, LD_PLAIN, ST_CAST, OP_ADD)
DEFINE_REDUCE(f32_prod, float, float, double, LD_PLAIN, ST_CAST, OP_MUL)
DEFINE_REDUCE(f32_min, float, float, float, LD_PLAIN, ST_CAST, OP_FMIN)
DEFINE_REDUCE(f32_max, float, float, float, LD_PLAIN, ST_CAST, OP_FMAX)
DEFINE_REDUCE(f64_sum, double, double, double, LD_PLAIN, ST_CAST, OP_ADD)
DEFINE_REDUCE(f64_prod, double, double, double, LD_PLAIN, ST_CAST, OP_MUL)
DEFINE_REDUCE(f64_min, double, double, double, LD_PLAIN, ST_CAST, OP_FMIN)
DEFINE_REDUCE(f64_max, double, double, double, LD_PLAIN, ST_CAST, OP_FMAX)
DEFINE_REDUCE(bf16_sum, uint16_t, float, float, LD_BF16, ST_BF16, OP_ADD)
DEFINE_REDUCE(bf16_prod, uint16_t, float, float, LD_BF16, ST_BF16, OP_MUL)
DEFINE_REDUCE(bf16_min, uint16_t, float, float, LD_BF16, ST_BF16, OP_FMIN)
DEFINE_REDUCE(bf16_max, uint16_t, float, float, LD_BF16, ST_BF16, OP_FMAX)
/* Portable fp16 (and bf16 above); x86 machines with AVX2 + F16C use the kernels further
 * down instead. */
DEFINE_REDUCE(f16_sum, uint16_t, float, float, LD_HALF, ST_HALF, OP_ADD)
DEFINE_REDUCE(f16_prod, uint16_t, float, float, LD_HALF, ST_HALF, OP_MUL)
DEFINE_REDUCE(f16_min, uint16_t, float, float, LD_HALF, ST_HALF, OP_FMIN)
DEFINE_REDUCE(f16_max, uint16_t, float, float, LD_HALF, ST_HALF, OP_FMAX)
/* float8: in float, rounded once. */
DEFINE_REDUCE(e4m3_sum, uint8_t, float, float, LD_E4M3, ST_E4M3, OP_ADD)
DEFINE_REDUCE(e4m3_prod, uint8_t, float, float, LD_E4M3, ST_E4M3, OP_MUL)
DEFINE_REDUCE(e4m3_min, uint8_t, float, float, LD_E4M3, ST_E4M3, OP_FMIN)
DEFINE_REDUCE(e4m3_max, uint8_t, float, float, LD_E4M3, ST_E4M3, OP_FMAX)
DEFINE_REDUCE(e5m2_sum, uint8_t, float, float, LD_E5M2, ST_E5M2, OP_ADD)
DEFINE_REDUCE(e5m2_prod, uint8_t, float, float, LD_E5M2, ST_E5M2, OP_MUL)
DEFINE_REDUCE(e5m2_min, uint8_t, float, float, LD_E5M2, ST_E5M2, OP_FMIN)
DEFINE_REDUCE(e5m2_max, uint8_t, float, float, LD_E5M2, ST_E5M2, OP_FMAX)
/* bool: inputs are true when non-zero, outputs are 0 or 1. */
DEFINE_REDUCE(b_or, uint8_t, uint8_t, uint8_t, LD_BOOL, ST_CAST, OP_OR)
DEFINE_REDUCE(b_and, uint8_t, uint8_t, uint8_t, LD_BOOL, ST_CAST, OP_AND)
DEFINE_REDUCE(b_xor, uint8_t, uint8_t, uint8_t, LD_BOOL, ST_CAST, OP_XOR)

/* AVG and PREMUL_SUM reduce as SUM: the caller divides or pre-multiplies. A NULL entry
 * (bitwise ops on floats) leaves out untouched. */
#define INT_ROW(P)                                                                 \
  {                                                                                \
    [CHORUS_SUM] = P##_sum, [CHORUS_PROD] = P##_prod, [CHORUS_MIN] = P##_min,      \
    [CHORUS_MAX] = P##_max, [CHORUS_AVG] = P##_sum, [CHORUS_PREMUL_SUM] = P##_sum, \
    [CHORUS_BAND] = P##_band, [CHORUS_BOR] = P##_bor, [CHORUS_BXOR] = P##_bxor     \
  }
#define FLOAT_ROW(P)                                                              \
  {                                                                               \
    [CHORUS_SUM] = P##_sum, [CHORUS_PROD] = P##_prod, [CHORUS_MIN] = P##_min,     \
    [CHORUS_MAX] = P##_max, [CHORUS_AVG] = P##_sum, [CHORUS_PREMUL_SUM] = P##_sum \
  }
static const reduce_fn kernel_table[CHORUS_DTYPE_COUNT][CHORUS_OP_COUNT] = {
    [CHORUS_INT8] = INT_ROW(i8),
    [CHORUS_UINT8] = INT_ROW(u8),
    [CHORUS_INT16] = INT_ROW(i16),
    [CHORUS_INT32] = INT_ROW(i32),
    [CHORUS_INT64] = INT_ROW(i64),
    [CHORUS_FLOAT16] = FLOAT_ROW(f16),
    [CHORUS_BFLOAT16] = FLOAT_ROW(bf16),
    [CHORUS_FLOAT32] = FLOAT_ROW(f32),
    [CHORUS_FLOAT64] = FLOAT_ROW(f64),
    [CHORUS_FLOAT8_E4M3] = FLOAT_ROW(e4m3),
    [CHORUS_FLOAT8_E5M2] = FLOAT_ROW(e5m2),
    [CHORUS_BOOL] = {[CHORUS_SUM] = b_or, [CHORUS_PROD] = b_and, [CHORUS_MIN] = b_and,
                     [CHORUS_MAX] = b_or, [CHORUS_BAND] = b_and, [CHORUS_BOR] = b_or,
                     [CHORUS_BXOR] = b_xor},
};

/* ------------------------------------------------------------------ x86: fp16 / bf16 */
/* Compiled for AVX2 + F16C and chosen at run time. fp16 needs F16C for its conversions;
 * bf16 needs AVX2 because without packusdw the 32 -> 16 bit narrowing costs more shuffles
 * than the memory system leaves time for. Sixteen elements (one 256-bit load) at a time,
 * as two vectors of eight floats. */
#if REDUCE_X86
#define X86_FN __attribute__((target("avx2,f16c")))

X86_FN static inline void load16_half(const uint16_t *p, __m256 *lo, __m256 *hi) {
  *lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
  *hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
}
X86_FN static inline void store16_half(uint16_t *p, __m256 lo, __m256 hi) {
  _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128((__m128i *)(p + 8), _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT));
}
/* A bf16 is the top half of a float: interleaving with zeros widens sixteen of them into
 * two vectors, in an order permuted within 128-bit lanes that packus undoes on store. */
X86_FN static inline void load16_bf16(const uint16_t *p, __m256 *lo, __m256 *hi) {
  __m256i x = _mm256_loadu_si256((const __m256i *)p), zero = _mm256_setzero_si256();
  *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x));
  *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x));
}
/* Same arithmetic as bf16_store; the result is in the low 16 bits of each lane. */
X86_FN static inline __m256i round8_bf16(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                      _mm256_set1_epi32(0x7f800000));
  return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, is_nan), 16);
}
X86_FN static inline void store16_bf16(uint16_t *p, __m256 lo, __m256 hi) {
  _mm256_storeu_si256((__m256i *)p, _mm256_packus_epi32(round8_bf16(lo), round8_bf16(hi)));
}
X86_FN static inline __m256 v_add(__m256 acc, __m256 x) { return _mm256_add_ps(acc, x); }
X86_FN static inline __m256 v_mul(__m256 acc, __m256 x) { return _mm256_mul_ps(acc, x); }
/* Same rule as OP_FMIN / OP_FMAX: take x if it is smaller (larger) or NaN. */
X86_FN static inline __m256 v_min(__m256 acc, __m256 x) {
  __m256 take = _mm256_or_ps(_mm256_cmp_ps(x, acc, _CMP_LT_OQ), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_ps(acc, x, take);
}
X86_FN static inline __m256 v_max(__m256 acc, __m256 x) {
  __m256 take = _mm256_or_ps(_mm256_cmp_ps(x, acc, _CMP_GT_OQ), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_ps(acc, x, take);
}

/* Sixteen elements at a time across all inputs: the loads of a group precede its store,
 * so out may alias any input. The tail goes through a zero-padded lane buffer. */
#define DEFINE_VEC16(NAME, T, LOAD16, STORE16, VCOMBINE)                                 \
  X86_FN static void NAME(void *outv, const void *const *in, int n, size_t count) {      \
    T *out = outv;                                                                       \
    __m256 lo, hi, xlo, xhi;                                                             \
    size_t i = 0;                                                                        \
    for (; i + 16 <= count; i += 16) {                                                   \
      LOAD16((const T *)in[0] + i, &lo, &hi);                                            \
      for (int k = 1; k < n; k++) {                                                      \
        LOAD16((const T *)in[k] + i, &xlo, &xhi);                                        \
        lo = VCOMBINE(lo, xlo);                                                          \
        hi = VCOMBINE(hi, xhi);                                                          \
      }                                                                                  \
      STORE16(out + i, lo, hi);                                                          \
    }                                                                                    \
    if (i < count) {                                                                     \
      size_t rest = count - i;                                                           \
      T lane[16] = {0};                                                                  \
      memcpy(lane, (const T *)in[0] + i, rest * sizeof(T));                              \
      LOAD16(lane, &lo, &hi);                                                            \
      for (int k = 1; k < n; k++) {                                                      \
        memcpy(lane, (const T *)in[k] + i, rest * sizeof(T));                            \
        LOAD16(lane, &xlo, &xhi);                                                        \
        lo = VCOMBINE(lo, xlo);                                                          \
        hi = VCOMBINE(hi, xhi);                                                          \
      }                                                                                  \
      STORE16(lane, lo, hi);                                                             \
      memcpy(out + i, lane, rest * sizeof(T));                                           \
    }                                                                                    \
  }
/* The four kernels of one dtype (P_sum, P_prod, P_min, P_max) and its row of the table
 * (AVG and PREMUL_SUM reduce as sums; the divide and the premultiply are separate passes). */
#define DEFINE_VEC16_ROW(P, T, LOAD16, STORE16)                                   \
  DEFINE_VEC16(P##_sum, T, LOAD16, STORE16, v_add)                                \
  DEFINE_VEC16(P##_prod, T, LOAD16, STORE16, v_mul)                               \
  DEFINE_VEC16(P##_min, T, LOAD16, STORE16, v_min)                                \
  DEFINE_VEC16(P##_max, T, LOAD16, STORE16, v_max)                                \
  static const reduce_fn P##_row[CHORUS_OP_COUNT] = {                             \
      [CHORUS_SUM] = P##_sum, [CHORUS_PROD] = P##_prod, [CHORUS_MIN] = P##_min,   \
      [CHORUS_MAX] = P##_max, [CHORUS_AVG] = P##_sum, [CHORUS_PREMUL_SUM] = P##_sum};
DEFINE_VEC16_ROW(x86_f16, uint16_t, load16_half, store16_half)
DEFINE_VEC16_ROW(x86_bf16, uint16_t, load16_bf16, store16_bf16)

/* float8 through F16C. e5m2 is the top byte of a half, so widening is a byte shuffle and
 * vcvtph2ps. An e4m3fn code shifted into a half's fields (same exponent field, three
 * mantissa bits on top) is the value times 2^-8, subnormals included (e4m3's quantum 2^-9
 * lands on the half's 2^-17 = 2^7 subnormal quanta): widen, multiply by 256, and turn the
 * one value that comes out as 480 (the NaN code 0x7f) into NaN.
 * Narrowing rounds twice without the double-rounding error: float -> half toward zero with
 * the lowest bit set when inexact ("round to odd", exact enough since a half keeps at least
 * seven more bits than the target, subnormals too), then the half's magnitude rounded to
 * nearest even at bit 8 (e5m2) or bit 7 (e4m3fn, after scaling by 2^-8, which lines its
 * exponents and subnormals up with the half's). Overflow: e5m2's carry reaches inf, e4m3fn
 * is clamped to 448; NaN becomes 0x7f | sign. reduce.c's scalar e4m3_store / e5m2_store
 * give the same bits (tests/c/test_reduce.c runs both). */
X86_FN static inline void load16_e5m2(const uint8_t *p, __m256 *lo, __m256 *hi) {
  __m128i x = _mm_loadu_si128((const __m128i *)p), zero = _mm_setzero_si128();
  *lo = _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, x));
  *hi = _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, x));
}
X86_FN static inline __m256 e4m3_fix(__m256 v) {
  __m256 scaled = _mm256_mul_ps(v, _mm256_set1_ps(256.0f));
  __m256 mag = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), scaled);
  __m256 nan = _mm256_cmp_ps(mag, _mm256_set1_ps(480.0f), _CMP_EQ_OQ);
  return _mm256_or_ps(scaled, _mm256_and_ps(nan, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000))));
}
X86_FN static inline void load16_e4m3(const uint8_t *p, __m256 *lo, __m256 *hi) {
  __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7),
                              _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  *lo = e4m3_fix(_mm256_cvtph_ps(_mm256_castsi256_si128(h)));
  *hi = e4m3_fix(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}
/* Two vectors of 32-bit masks as one of sixteen 16-bit masks, in element order. */
X86_FN static inline __m256i mask16(__m256 lo, __m256 hi) {
  __m256i m = _mm256_packs_epi32(_mm256_castps_si256(lo), _mm256_castps_si256(hi));
  return _mm256_permute4x64_epi64(m, 0xd8);
}
X86_FN static inline void store16_fp8(uint8_t *p, __m256 lo, __m256 hi, int e4m3) {
  if (e4m3) {
    lo = _mm256_mul_ps(lo, _mm256_set1_ps(0x1p-8f));
    hi = _mm256_mul_ps(hi, _mm256_set1_ps(0x1p-8f));
  }
  /* the rounding mode is an immediate: a macro, not a const int (clang insists) */
#define ROUND_TOWARD_ZERO (_MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC)
  __m128i hlo = _mm256_cvtps_ph(lo, ROUND_TOWARD_ZERO), hhi = _mm256_cvtps_ph(hi, ROUND_TOWARD_ZERO);
#undef ROUND_TOWARD_ZERO
  __m256i inexact = mask16(_mm256_cmp_ps(_mm256_cvtph_ps(hlo), lo, _CMP_NEQ_UQ),
                           _mm256_cmp_ps(_mm256_cvtph_ps(hhi), hi, _CMP_NEQ_UQ));
  __m256i nan = mask16(_mm256_cmp_ps(lo, lo, _CMP_UNORD_Q), _mm256_cmp_ps(hi, hi, _CMP_UNORD_Q));
  __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(hlo), hhi, 1);
  h = _mm256_or_si256(h, _mm256_and_si256(inexact, _mm256_set1_epi16(1)));
  __m256i sign = _mm256_srli_epi16(_mm256_and_si256(h, _mm256_set1_epi16((short)0x8000)), 8);
  __m256i mag = _mm256_and_si256(h, _mm256_set1_epi16(0x7fff)), r;
  if (e4m3) {
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi16(mag, 7), _mm256_set1_epi16(1));
    r = _mm256_srli_epi16(_mm256_add_epi16(_mm256_add_epi16(mag, _mm256_set1_epi16(0x3f)), lsb), 7);
    r = _mm256_min_epu16(r, _mm256_set1_epi16(0x7e));
  } else {
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi16(mag, 8), _mm256_set1_epi16(1));
    r = _mm256_srli_epi16(_mm256_add_epi16(_mm256_add_epi16(mag, _mm256_set1_epi16(0x7f)), lsb), 8);
  }
  r = _mm256_or_si256(_mm256_or_si256(r, _mm256_and_si256(nan, _mm256_set1_epi16(0x7f))), sign);
  _mm_storeu_si128((__m128i *)p, _mm_packus_epi16(_mm256_castsi256_si128(r),
                                                  _mm256_extracti128_si256(r, 1)));
}
X86_FN static inline void store16_e4m3(uint8_t *p, __m256 lo, __m256 hi) { store16_fp8(p, lo, hi, 1); }
X86_FN static inline void store16_e5m2(uint8_t *p, __m256 lo, __m256 hi) { store16_fp8(p, lo, hi, 0); }

DEFINE_VEC16_ROW(x86_e4m3, uint8_t, load16_e4m3, store16_e4m3)
DEFINE_VEC16_ROW(x86_e5m2, uint8_t, load16_e5m2, store16_e5m2)

/* v * f with the product in double, rounded to float (the premul contract). */
X86_FN static inline __m256 mul_in_double(__m256 v, __m256d f) {
  __m128 lo = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)), f));
  __m128 hi = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)), f));
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}
#define DEFINE_VEC16_PREMUL(NAME, LOAD16, STORE16, SCALAR_LOAD, SCALAR_STORE)               \
  X86_FN static void NAME(uint16_t *out, const uint16_t *in, size_t count, double factor) { \
    __m256d f = _mm256_set1_pd(factor);                                                     \
    __m256 lo, hi;                                                                          \
    size_t i = 0;                                                                           \
    for (; i + 16 <= count; i += 16) {                                                      \
      LOAD16(in + i, &lo, &hi);                                                             \
      STORE16(out + i, mul_in_double(lo, f), mul_in_double(hi, f));                         \
    }                                                                                       \
    for (; i < count; i++) out[i] = SCALAR_STORE((float)((double)SCALAR_LOAD(in[i]) * factor)); \
  }
DEFINE_VEC16_PREMUL(x86_f16_premul, load16_half, store16_half, half_load, half_store)
DEFINE_VEC16_PREMUL(x86_bf16_premul, load16_bf16, store16_bf16, bf16_load, bf16_store)

#define DEFINE_VEC16_DIVIDE(NAME, LOAD16, STORE16, SCALAR_LOAD, SCALAR_STORE)               \
  X86_FN static void NAME(uint16_t *buf, size_t count, float divisor) {                     \
    __m256 d = _mm256_set1_ps(divisor), lo, hi;                                             \
    size_t i = 0;                                                                           \
    for (; i + 16 <= count; i += 16) {                                                      \
      LOAD16(buf + i, &lo, &hi);                                                            \
      STORE16(buf + i, _mm256_div_ps(lo, d), _mm256_div_ps(hi, d));                         \
    }                                                                                       \
    for (; i < count; i++) buf[i] = SCALAR_STORE(SCALAR_LOAD(buf[i]) / divisor);            \
  }
DEFINE_VEC16_DIVIDE(x86_f16_divide, load16_half, store16_half, half_load, half_store)
DEFINE_VEC16_DIVIDE(x86_bf16_divide, load16_bf16, store16_bf16, bf16_load, bf16_store)

/* CPUID rather than __builtin_cpu_supports, which clang does not know "f16c" for. YMM
 * registers also need the OS to save them (OSXSAVE + XCR0 bits 1 and 2). */
static bool detect_avx2_f16c(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const unsigned f16c = 1u << 29, osxsave = 1u << 27, avx = 1u << 28;
  if ((c & (f16c | osxsave | avx)) != (f16c | osxsave | avx)) return false;
  unsigned xcr0_lo, xcr0_hi;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & 6u) != 6u) return false;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (b & (1u << 5)) != 0; /* AVX2 */
}

/* Decided once; relaxed is enough because every thread computes the same answer. */
static bool have_avx2_f16c(void) {
  static _Atomic int cached = -1;
  int v = atomic_load_explicit(&cached, memory_order_relaxed);
  if (v < 0) {
    v = detect_avx2_f16c();
    atomic_store_explicit(&cached, v, memory_order_relaxed);
  }
  return v != 0;
}
#endif /* REDUCE_X86 */

/* ------------------------------------------------------------------ streaming copy */
void copy_stream(void *dst, const void *src, size_t n) {
#if REDUCE_X86
  uint8_t *d = dst;
  const uint8_t *s = src;
  if (n < 4096) {
    memcpy(d, s, n);
    return;
  }
  size_t head = (16 - ((uintptr_t)d & 15)) & 15;
  memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t body = n & ~(size_t)63;
  for (size_t i = 0; i < body; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
    __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
    _mm_stream_si128((__m128i *)(d + i), a);
    _mm_stream_si128((__m128i *)(d + i + 16), b);
    _mm_stream_si128((__m128i *)(d + i + 32), c);
    _mm_stream_si128((__m128i *)(d + i + 48), e);
  }
  _mm_sfence();
  memcpy(d + body, s + body, n - body);
#else
  memcpy(dst, src, n);
#endif
}

/* ------------------------------------------------------------------ public entry points */
bool reduce_op_supported(chorus_dtype_t dtype, chorus_op_kind_t op) {
  if ((unsigned)dtype >= CHORUS_DTYPE_COUNT || (unsigned)op >= CHORUS_OP_COUNT) return false;
  bool is_float = dtype == CHORUS_FLOAT16 || dtype == CHORUS_BFLOAT16 ||
                  dtype == CHORUS_FLOAT32 || dtype == CHORUS_FLOAT64 ||
                  dtype == CHORUS_FLOAT8_E4M3 || dtype == CHORUS_FLOAT8_E5M2;
  switch (op) {
    case CHORUS_BAND:
    case CHORUS_BOR:
    case CHORUS_BXOR:
      return !is_float;
    case CHORUS_AVG:
    case CHORUS_PREMUL_SUM:
      return dtype != CHORUS_BOOL;
    default:
      return true;
  }
}

/* out may be any of the inputs (same address); partial overlap is not supported. */
void reduce_n(void *out, const void *const *in, int n, size_t count, chorus_dtype_t dtype,
              chorus_op_kind_t op) {
  if (count == 0 || n < 1 || (unsigned)dtype >= CHORUS_DTYPE_COUNT ||
      (unsigned)op >= CHORUS_OP_COUNT)
    return;
  /* One input is a copy, except bool, whose outputs are normalised to 0/1. */
  if (n == 1 && dtype != CHORUS_BOOL) {
    if (out != in[0]) memmove(out, in[0], count * dtype_size(dtype));
    return;
  }
  reduce_fn fn = kernel_table[dtype][op];
#if REDUCE_X86
  if (dtype == CHORUS_FLOAT16 && have_avx2_f16c()) fn = x86_f16_row[op];
  if (dtype == CHORUS_BFLOAT16 && have_avx2_f16c()) fn = x86_bf16_row[op];
  if (dtype == CHORUS_FLOAT8_E4M3 && have_avx2_f16c()) fn = x86_e4m3_row[op];
  if (dtype == CHORUS_FLOAT8_E5M2 && have_avx2_f16c()) fn = x86_e5m2_row[op];
#endif
  if (fn) fn(out, in, n, count);
}

/* double -> integer, truncating toward zero; out-of-range values saturate and NaN gives 0
 * (a plain cast would be undefined behaviour there). */
#define DEFINE_TRUNC(NAME, T, LO, HI)              \
  static inline T NAME(double v) {                 \
    if (!(v == v)) return 0;                       \
    if (v <= (double)(LO)) return (LO);            \
    if (v >= (double)(HI)) return (HI);            \
    return (T)v;                                   \
  }
DEFINE_TRUNC(trunc_i8, int8_t, INT8_MIN, INT8_MAX)
DEFINE_TRUNC(trunc_u8, uint8_t, 0, UINT8_MAX)
DEFINE_TRUNC(trunc_i16, int16_t, INT16_MIN, INT16_MAX)
DEFINE_TRUNC(trunc_i32, int32_t, INT32_MIN, INT32_MAX)
/* (double)INT64_MAX rounds up to 2^63, so ">= 2^63" is the exact overflow test. */
static inline int64_t trunc_i64(double v) {
  if (!(v == v)) return 0;
  if (v >= 9223372036854775808.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

#define PREMUL_LOOP(T, EXPR)                                  \
  do {                                                        \
    T *o_ = out;                                              \
    const T *s_ = in;                                         \
    for (size_t i = 0; i < count; i++) {                      \
      T x = s_[i];                                            \
      o_[i] = (EXPR);                                         \
    }                                                         \
  } while (0)

void reduce_premul(void *out, const void *in, size_t count, chorus_dtype_t dtype,
                   double factor) {
  switch (dtype) {
    case CHORUS_INT8: PREMUL_LOOP(int8_t, trunc_i8(x * factor)); break;
    case CHORUS_UINT8: PREMUL_LOOP(uint8_t, trunc_u8(x * factor)); break;
    case CHORUS_INT16: PREMUL_LOOP(int16_t, trunc_i16(x * factor)); break;
    case CHORUS_INT32: PREMUL_LOOP(int32_t, trunc_i32(x * factor)); break;
    case CHORUS_INT64: PREMUL_LOOP(int64_t, trunc_i64((double)x * factor)); break;
    case CHORUS_FLOAT16:
#if REDUCE_X86
      if (have_avx2_f16c()) {
        x86_f16_premul(out, in, count, factor);
        break;
      }
#endif
      PREMUL_LOOP(uint16_t, half_store((float)((double)half_load(x) * factor)));
      break;
    case CHORUS_BFLOAT16:
#if REDUCE_X86
      if (have_avx2_f16c()) {
        x86_bf16_premul(out, in, count, factor);
        break;
      }
#endif
      PREMUL_LOOP(uint16_t, bf16_store((float)((double)bf16_load(x) * factor)));
      break;
    case CHORUS_FLOAT32: PREMUL_LOOP(float, (float)((double)x * factor)); break;
    case CHORUS_FLOAT64: PREMUL_LOOP(double, x * factor); break;
    case CHORUS_FLOAT8_E4M3: PREMUL_LOOP(uint8_t, e4m3_store((float)((double)e4m3_load(x) * factor))); break;
    case CHORUS_FLOAT8_E5M2: PREMUL_LOOP(uint8_t, e5m2_store((float)((double)e5m2_load(x) * factor))); break;
    case CHORUS_BOOL: PREMUL_LOOP(uint8_t, (uint8_t)((double)(x != 0) * factor != 0)); break;
    default: break;
  }
}

/* Integers of up to 32 bits divide in double: for |x| < 2^32 the rounded quotient
 * cannot cross an integer, so truncating it equals C's truncating division, and it
 * vectorises where integer division does not. Going through int64_t makes INT_MIN / -1
 * wrap (2^31 -> INT32_MIN) instead of trapping like the integer instruction would. */
#define DIVIDE_LOOP(T)                                                            \
  do {                                                                            \
    T *b_ = buf;                                                                  \
    double d_ = divisor;                                                          \
    for (size_t i = 0; i < count; i++) b_[i] = (T)(int64_t)((double)b_[i] / d_); \
  } while (0)

void reduce_divide(void *buf, size_t count, chorus_dtype_t dtype, int divisor) {
  /* Integer division by zero would trap; leave the data as it is. Floats give inf/NaN. */
  bool is_int = dtype == CHORUS_INT8 || dtype == CHORUS_UINT8 || dtype == CHORUS_INT16 ||
                dtype == CHORUS_INT32 || dtype == CHORUS_INT64;
  if (is_int && divisor == 0) return;
  switch (dtype) {
    case CHORUS_INT8: DIVIDE_LOOP(int8_t); break;
    case CHORUS_UINT8: DIVIDE_LOOP(uint8_t); break;
    case CHORUS_INT16: DIVIDE_LOOP(int16_t); break;
    case CHORUS_INT32: DIVIDE_LOOP(int32_t); break;
    case CHORUS_INT64: {
      int64_t *b = buf;
      if (divisor == -1) {
        for (size_t i = 0; i < count; i++) b[i] = (int64_t)(0u - (uint64_t)b[i]);
      } else {
        for (size_t i = 0; i < count; i++) b[i] /= divisor;
      }
      break;
    }
    case CHORUS_FLOAT16: {
      uint16_t *b = buf;
      float d = (float)divisor;
#if REDUCE_X86
      if (have_avx2_f16c()) {
        x86_f16_divide(b, count, d);
        break;
      }
#endif
      for (size_t i = 0; i < count; i++) b[i] = half_store(half_load(b[i]) / d);
      break;
    }
    case CHORUS_BFLOAT16: {
      uint16_t *b = buf;
      float d = (float)divisor;
#if REDUCE_X86
      if (have_avx2_f16c()) {
        x86_bf16_divide(b, count, d);
        break;
      }
#endif
      for (size_t i = 0; i < count; i++) b[i] = bf16_store(bf16_load(b[i]) / d);
      break;
    }
    case CHORUS_FLOAT32: {
      float *b = buf;
      double d = divisor;
      for (size_t i = 0; i < count; i++) b[i] = (float)((double)b[i] / d);
      break;
    }
    case CHORUS_FLOAT64: {
      double *b = buf;
      double d = divisor;
      for (size_t i = 0; i < count; i++) b[i] /= d;
      break;
    }
    case CHORUS_FLOAT8_E4M3: {
      uint8_t *b = buf;
      float d = (float)divisor;
      for (size_t i = 0; i < count; i++) b[i] = e4m3_store(e4m3_load(b[i]) / d);
      break;
    }
    case CHORUS_FLOAT8_E5M2: {
      uint8_t *b = buf;
      float d = (float)divisor;
      for (size_t i = 0; i < count; i++) b[i] = e5m2_store(e5m2_load(b[i]) / d);
      break;
    }
    default: /* bool: AVG is not supported; nothing sensible to do */
      break;
  }
}

/* ------------------------------------------------------------------ names */
size_t chorus_dtype_size(chorus_dtype_t dtype) { return dtype_size(dtype); }

const char *chorus_dtype_name(chorus_dtype_t dtype) {
  static const char *const names[CHORUS_DTYPE_COUNT] = {
      [CHORUS_INT8] = "int8",        [CHORUS_UINT8] = "uint8",     [CHORUS_INT16] = "int16",
      [CHORUS_INT32] = "int32",      [CHORUS_INT64] = "int64",     [CHORUS_FLOAT16] = "float16",
      [CHORUS_BFLOAT16] = "bfloat16", [CHORUS_FLOAT32] = "float32", [CHORUS_FLOAT64] = "float64",
      [CHORUS_BOOL] = "bool",        [CHORUS_FLOAT8_E4M3] = "float8_e4m3fn",
      [CHORUS_FLOAT8_E5M2] = "float8_e5m2"};
  return (unsigned)dtype < CHORUS_DTYPE_COUNT ? names[dtype] : "unknown";
}

const char *chorus_op_name(chorus_op_kind_t op) {
  static const char *const names[CHORUS_OP_COUNT] = {
      [CHORUS_SUM] = "sum",   [CHORUS_PROD] = "prod",     [CHORUS_MIN] = "min",
      [CHORUS_MAX] = "max",   [CHORUS_AVG] = "avg",       [CHORUS_PREMUL_SUM] = "premul_sum",
      [CHORUS_BAND] = "band", [CHORUS_BOR] = "bor",       [CHORUS_BXOR] = "bxor"};
  return (unsigned)op < CHORUS_OP_COUNT ? names[op] : "unknown";
}
