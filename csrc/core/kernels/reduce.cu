/* reduce.cu - the element-wise reduction kernels on CUDA device memory behind
 * cuda_kernels.h: chorus_cuda_reduce (out = op(in[0], ..., in[n-1]), optionally divided
 * for AVG) and chorus_cuda_premul (out = in * factor). Every result is bit-identical to the
 * CPU path in reduce.c (reduce_n + reduce_divide, reduce_premul): the same accumulator
 * types, the same combining order, fp16/bf16 converted to the same bits (reduce.c's bit
 * manipulation, or the hardware conversion where it was checked equal on every input),
 * floating-point operations with explicit round-to-nearest intrinsics (so that nvcc never
 * contracts them into FMAs), and NaN results rebuilt the way the x86 host produces them
 * (the GPU's own canonical NaN 0x7fffffff would differ). One kernel template is
 * instantiated per dtype and base op; each thread of a grid-stride loop does two 16-byte
 * vectors at a time when all pointers share their alignment, single elements otherwise. */
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_kernels.h"

/* Fast math flushes subnormals and approximates division: no longer the CPU's results. */
#ifdef __USE_FAST_MATH__
#error "reduce.cu must be built without --use_fast_math (results must match the CPU bit for bit)"
#endif

/* Named chorus:: so that profilers show whose kernels these are ("chorus::(anonymous
 * namespace)::reduce_kernel<...>" on a CUDA timeline). */
namespace chorus {
namespace {

const int THREADS = 256;

/* Set by chorus_cuda_preload on its thread: the launch helpers then load their kernel
 * (cudaFuncGetAttributes) instead of launching it. */
thread_local bool t_preload = false;
thread_local int t_preloaded = 0;
template <class F>
int preload_kernel(F *kernel) {
  cudaFuncAttributes fa;
  cudaError_t e = cudaFuncGetAttributes(&fa, kernel);
  if (e == cudaSuccess) t_preloaded++;
  return (int)e;
}
/* Blocks per multiprocessor we launch at most; the grid-stride loop covers the rest, so a
 * huge count never turns into millions of blocks. On an H200, 8 (with two vectors per
 * thread) gave 3.3-4.2 TB/s for 2..16 inputs of int8, bf16, float32 and float64 and
 * 2.9-3.2 for fp16, against 4.2 for a device copy; 4 gave about 3.0 for bf16/float32. */
const int BLOCKS_PER_SM = 8;
const int MAX_DEVICES = 64;

/* ------------------------------------------------------------------ bits and NaNs */
__device__ __forceinline__ uint32_t f32_bits(float f) { return __float_as_uint(f); }
__device__ __forceinline__ float f32_from(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ uint64_t f64_bits(double d) {
  return (uint64_t)__double_as_longlong(d);
}
__device__ __forceinline__ double f64_from(uint64_t u) {
  return __longlong_as_double((long long)u);
}
/* By bits, so no compiler flag can make the test assume NaNs away. */
__device__ __forceinline__ bool is_nan32(float f) {
  return (f32_bits(f) & 0x7fffffffu) > 0x7f800000u;
}
__device__ __forceinline__ bool is_nan64(double d) {
  return (f64_bits(d) & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
}

/* The host's SSE rules, which reduce.c runs under: an operation with a NaN operand returns
 * the first NaN operand with its quiet bit set; an invalid operation (inf - inf, 0 * inf)
 * returns the "default NaN" with the sign bit set. (Which of two different NaNs the CPU
 * returns depends on how gcc ordered the operands; we take the first, source order.) */
__device__ __noinline__ float nan_result32(float a, float b) {
  uint32_t q = is_nan32(a) ? f32_bits(a) : is_nan32(b) ? f32_bits(b) : 0xffc00000u;
  return f32_from(q | 0x00400000u);
}
__device__ __noinline__ double nan_result64(double a, double b) {
  uint64_t q = is_nan64(a) ? f64_bits(a) : is_nan64(b) ? f64_bits(b) : 0xfff8000000000000ull;
  return f64_from(q | 0x0008000000000000ull);
}

/* IEEE operations, correctly rounded; the _rn intrinsics are never fused into an FMA. */
__device__ __forceinline__ float add32(float a, float b) {
  float r = __fadd_rn(a, b);
  return is_nan32(r) ? nan_result32(a, b) : r;
}
__device__ __forceinline__ float mul32(float a, float b) {
  float r = __fmul_rn(a, b);
  return is_nan32(r) ? nan_result32(a, b) : r;
}
__device__ __forceinline__ float div32(float a, float b) {
  float r = __fdiv_rn(a, b);
  return is_nan32(r) ? nan_result32(a, b) : r;
}
__device__ __forceinline__ double add64(double a, double b) {
  double r = __dadd_rn(a, b);
  return is_nan64(r) ? nan_result64(a, b) : r;
}
__device__ __forceinline__ double mul64(double a, double b) {
  double r = __dmul_rn(a, b);
  return is_nan64(r) ? nan_result64(a, b) : r;
}
__device__ __forceinline__ double div64(double a, double b) {
  double r = __ddiv_rn(a, b);
  return is_nan64(r) ? nan_result64(a, b) : r;
}

/* float <-> double as cvtss2sd / cvtsd2ss do it: a NaN keeps its sign and (the top of)
 * its payload and becomes quiet; everything else converts exactly / rounds to nearest. */
__device__ __forceinline__ double widen32(float f) {
  if (!is_nan32(f)) return (double)f;
  uint32_t u = f32_bits(f);
  return f64_from(((uint64_t)(u >> 31) << 63) | 0x7ff8000000000000ull |
                  ((uint64_t)(u & 0x7fffffu) << 29));
}
__device__ __forceinline__ float narrow64(double d) {
  if (!is_nan64(d)) return __double2float_rn(d);
  uint64_t u = f64_bits(d);
  return f32_from(((uint32_t)(u >> 63) << 31) | 0x7fc00000u | (uint32_t)((u >> 29) & 0x7fffffu));
}

/* ------------------------------------------------------------------ fp16 / bf16 */
/* reduce.c's half_load / half_store / bf16_load / bf16_store. For fp16 the hardware
 * conversions give the same bits on every non-NaN: half -> float is exact, and
 * float -> half rounds to nearest even, subnormals and overflow to inf included, which is
 * what half_store computes with its bit arithmetic (checked for all 2^16 halves and all
 * 2^32 floats against reduce.c). NaNs take reduce.c's bit path, since the hardware does
 * not keep payloads that way: half_load keeps sign and payload (a signalling NaN stays
 * signalling), half_store sets the quiet bit and truncates the payload. */
__device__ __forceinline__ float half_load(uint16_t h) {
  uint32_t x = h;
  if ((x & 0x7fffu) > 0x7c00u)
    return f32_from(((x & 0x8000u) << 16) | 0x7f800000u | ((x & 0x3ffu) << 13));
  return __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ uint16_t half_store(float value) {
  uint32_t f = f32_bits(value);
  if ((f & 0x7fffffffu) > 0x7f800000u)
    return (uint16_t)(((f >> 16) & 0x8000u) | 0x7e00u | ((f >> 13) & 0x3ffu));
  return __half_as_ushort(__float2half_rn(value));
}

/* bf16: a bf16 is the top half of a float; rounding adds just under half an ulp plus the
 * lowest kept bit; a NaN keeps sign and upper payload and becomes quiet. */
__device__ __forceinline__ float bf16_load(uint16_t b) { return f32_from((uint32_t)b << 16); }

__device__ __forceinline__ uint16_t bf16_store(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u | 0x00400000u) >> 16);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ------------------------------------------------------------------ float8 */
/* The results of reduce.c's e4m3_* / e5m2_* (torch's conversions: round to nearest even,
 * e4m3fn saturates at 448, e5m2 overflows to inf, NaN -> 0x7f | sign), computed for speed:
 * a float8 value's bits shifted under a float's exponent and multiplied by 2^(127 - bias)
 * is the value (the multiplication normalises subnormals, exactly), and on sm_89 and later
 * the conversion instruction (cvt.rn.satfinite) rounds, fixed up where torch's rule differs
 * from "satfinite" (NaN keeps its sign; e5m2 overflow is inf). Only sign and NaN-ness of a
 * NaN matter: every result is stored back to float8. */
__device__ __forceinline__ float e4m3_load(uint8_t x) {
  uint32_t v = x & 0x7fu, sign = (uint32_t)(x & 0x80u) << 24;
  float m = __fmul_rn(f32_from(v << 20), 0x1p120f);
  return f32_from((v == 0x7fu ? 0x7fc00000u : f32_bits(m)) | sign);
}
__device__ __forceinline__ float e5m2_load(uint8_t x) {
  uint32_t v = x & 0x7fu, sign = (uint32_t)(x & 0x80u) << 24;
  float m = __fmul_rn(f32_from(v << 21), 0x1p112f);
  uint32_t special = (v & 3u) ? 0x7fc00000u : 0x7f800000u;
  return f32_from((v >= 0x7cu ? special : f32_bits(m)) | sign);
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
__device__ __forceinline__ uint8_t cvt_e4m3(float x) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(r) : "f"(x), "f"(0.0f));
  return (uint8_t)r;
}
__device__ __forceinline__ uint8_t cvt_e5m2(float x) {
  unsigned short r;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %2, %1;" : "=h"(r) : "f"(x), "f"(0.0f));
  return (uint8_t)r;
}
__device__ __forceinline__ uint8_t e4m3_store(float value) {
  uint32_t f = f32_bits(value);
  uint8_t nan = (uint8_t)(((f >> 24) & 0x80u) | 0x7fu);
  return (f & 0x7fffffffu) > 0x7f800000u ? nan : cvt_e4m3(value);
}
__device__ __forceinline__ uint8_t e5m2_store(float value) {
  uint32_t f = f32_bits(value), a = f & 0x7fffffffu, sign = (f >> 24) & 0x80u;
  uint8_t hw = cvt_e5m2(value);
  /* 61440 (halfway from 57344 to 2^16) and up round to inf; satfinite would give 57344 */
  return (uint8_t)(a > 0x7f800000u ? sign | 0x7fu : a >= 0x47700000u ? sign | 0x7cu : hw);
}
#else
/* reduce.c's bit arithmetic, with branches where reduce.c selects */
__device__ __forceinline__ uint8_t e4m3_store(float value) {
  uint32_t f = f32_bits(value);
  uint32_t sign = (f >> 24) & 0x80u;
  f &= 0x7fffffffu;
  uint32_t o;
  if (f >= 0x43e80000u)
    o = f > 0x7f800000u ? 0x7fu : 0x7eu;
  else if (f < (121u << 23))
    o = f32_bits(__fadd_rn(f32_from(f), 16384.0f)) - (141u << 23);
  else
    o = (f - ((uint32_t)(127 - 7) << 23) + 0x7ffffu + ((f >> 20) & 1u)) >> 20;
  return (uint8_t)(o | sign);
}
__device__ __forceinline__ uint8_t e5m2_store(float value) {
  uint32_t f = f32_bits(value);
  uint32_t sign = (f >> 24) & 0x80u;
  f &= 0x7fffffffu;
  uint32_t o;
  if (f >= (143u << 23))
    o = f > 0x7f800000u ? 0x7fu : 0x7cu;
  else if (f < (113u << 23))
    o = f32_bits(__fadd_rn(f32_from(f), 128.0f)) - (134u << 23);
  else
    o = (f - ((uint32_t)(127 - 15) << 23) + 0xfffffu + ((f >> 21) & 1u)) >> 21;
  return (uint8_t)(o | sign);
}
#endif

/* ------------------------------------------------------------------ dtypes */
/* A dtype: its stored type T, how a reduced value is divided (reduce_divide, divisor > 1)
 * and how an element is pre-multiplied (reduce_premul). */

/* double -> integer as reduce.c's trunc_*: NaN gives 0, out of range saturates, the rest
 * truncates toward zero. For int64, (double)hi is 2^63, so ">=" is the overflow test. */
template <class T>
__device__ __forceinline__ T trunc_sat(double v) {
  const T hi = std::is_signed<T>::value ? (T)(~0ull >> (65 - 8 * sizeof(T))) : (T)~0ull;
  const T lo = std::is_signed<T>::value ? (T)(-hi - 1) : (T)0;
  if (v != v) return 0;
  if (v <= (double)lo) return lo;
  if (v >= (double)hi) return hi;
  return (T)(long long)v;
}

/* Up to 32 bits: divide in double, truncate through int64 (exactly DIVIDE_LOOP). */
template <class T>
__device__ __forceinline__ T int_divide(T v, int d) {
  return (T)(long long)__ddiv_rn((double)v, (double)d);
}
__device__ __forceinline__ int64_t int_divide(int64_t v, int d) { return v / d; }

template <class TT, class UU>
struct IntDt {
  typedef TT T;
  typedef UU U; /* sums, products and bit operations wrap in the unsigned twin */
  static __device__ T divide(T v, int d) { return int_divide(v, d); }
  static __device__ T premul(T v, double f) {
    return trunc_sat<T>(__dmul_rn((double)v, f));
  }
};
typedef IntDt<int8_t, uint8_t> I8;
typedef IntDt<uint8_t, uint8_t> U8;
typedef IntDt<int16_t, uint16_t> I16;
typedef IntDt<int32_t, uint32_t> I32;
typedef IntDt<int64_t, uint64_t> I64;

/* The narrow float formats: the stored type, its widening to float and the one rounding
 * back. Divide and premultiply go through float / double as reduce.c's do. */
#define CODEC(NAME, TYPE, LOAD, STORE)                                       \
  struct NAME {                                                              \
    typedef TYPE T;                                                          \
    static __device__ float load(T x) { return LOAD(x); }                    \
    static __device__ T store(float a) { return STORE(a); }                  \
  };
CODEC(HalfCodec, uint16_t, half_load, half_store)
CODEC(Bf16Codec, uint16_t, bf16_load, bf16_store)
CODEC(E4m3Codec, uint8_t, e4m3_load, e4m3_store)
CODEC(E5m2Codec, uint8_t, e5m2_load, e5m2_store)
#undef CODEC
template <class C>
struct Narrow {
  typedef typename C::T T;
  static __device__ T divide(T v, int d) { return C::store(div32(C::load(v), (float)d)); }
  static __device__ T premul(T v, double f) {
    return C::store(narrow64(mul64(widen32(C::load(v)), f)));
  }
};
typedef Narrow<HalfCodec> F16;
typedef Narrow<Bf16Codec> BF16;
typedef Narrow<E4m3Codec> E4M3;
typedef Narrow<E5m2Codec> E5M2;
struct F32 {
  typedef float T;
  static __device__ T divide(T v, int d) { return narrow64(div64(widen32(v), (double)d)); }
  static __device__ T premul(T v, double f) { return narrow64(mul64(widen32(v), f)); }
};
struct F64 {
  typedef double T;
  static __device__ T divide(T v, int d) { return div64(v, (double)d); }
  static __device__ T premul(T v, double f) { return mul64(v, f); }
};
struct Bool {
  typedef uint8_t T;
  static __device__ T divide(T v, int) { return v; } /* reduce_divide leaves bool alone */
  static __device__ T premul(T v, double f) {
    return (T)(__dmul_rn((double)(v != 0), f) != 0.0);
  }
};

/* ------------------------------------------------------------------ accumulators */
/* How a dtype is reduced: the accumulator A, load (stored -> A) and store (A -> stored,
 * the one rounding). Dt names the dtype for the divide step. */
template <class D>
struct Raw { /* accumulate in the stored type itself: copies, integer MIN/MAX, floats */
  typedef D Dt;
  typedef typename D::T T;
  typedef T A;
  static __device__ A load(T x) { return x; }
  static __device__ T store(A a) { return a; }
};
template <class D>
struct Wrap { /* integers in their unsigned twin, so overflow wraps */
  typedef D Dt;
  typedef typename D::T T;
  typedef typename D::U A;
  static __device__ A load(T x) { return (A)x; }
  static __device__ T store(A a) { return (T)a; }
};
struct BoolAcc { /* inputs are true when non-zero, results 0 or 1 */
  typedef Bool Dt;
  typedef uint8_t T;
  typedef uint8_t A;
  static __device__ A load(T x) { return (A)(x != 0); }
  static __device__ T store(A a) { return a; }
};
template <class C>
struct NarrowAcc { /* fp16, bf16, float8: in float, rounded once */
  typedef Narrow<C> Dt;
  typedef typename C::T T;
  typedef float A;
  static __device__ A load(T x) { return C::load(x); }
  static __device__ T store(A a) { return C::store(a); }
};
struct F32Wide { /* float32 SUM/PROD of more than two inputs: in double, rounded once */
  typedef F32 Dt;
  typedef float T;
  typedef double A;
  static __device__ A load(T x) { return widen32(x); }
  static __device__ T store(A a) { return narrow64(a); }
};

/* ------------------------------------------------------------------ ops */
/* acc = op(acc, x); the integer overloads get unsigned operands (Wrap) except MIN/MAX. */
struct Sum {
  template <class A>
  __device__ A operator()(A a, A b) const { return (A)(a + b); }
  __device__ float operator()(float a, float b) const { return add32(a, b); }
  __device__ double operator()(double a, double b) const { return add64(a, b); }
};
struct Prod { /* "* 1u" keeps 8/16-bit products out of signed int */
  template <class A>
  __device__ A operator()(A a, A b) const { return (A)(a * 1u * b); }
  __device__ float operator()(float a, float b) const { return mul32(a, b); }
  __device__ double operator()(double a, double b) const { return mul64(a, b); }
};
/* Floats as OP_FMIN / OP_FMAX: take x when smaller (larger) or NaN, so a NaN wins and on
 * ties (-0 vs +0 too) the earlier input stays. A selection: the bits pass unchanged. */
struct Min {
  template <class A>
  __device__ A operator()(A a, A b) const { return b < a ? b : a; }
  __device__ float operator()(float a, float b) const { return (b < a || is_nan32(b)) ? b : a; }
  __device__ double operator()(double a, double b) const {
    return (b < a || is_nan64(b)) ? b : a;
  }
};
struct Max {
  template <class A>
  __device__ A operator()(A a, A b) const { return b > a ? b : a; }
  __device__ float operator()(float a, float b) const { return (b > a || is_nan32(b)) ? b : a; }
  __device__ double operator()(double a, double b) const {
    return (b > a || is_nan64(b)) ? b : a;
  }
};
struct And {
  template <class A>
  __device__ A operator()(A a, A b) const { return (A)(a & b); }
};
struct Or {
  template <class A>
  __device__ A operator()(A a, A b) const { return (A)(a | b); }
};
struct Xor {
  template <class A>
  __device__ A operator()(A a, A b) const { return (A)(a ^ b); }
};
struct Copy { /* n == 1: nothing is combined */
  template <class A>
  __device__ A operator()(A a, A) const { return a; }
};

/* ------------------------------------------------------------------ kernels */
/* Element layout shared by both kernels: [0, head) single elements up to the common
 * 16-byte boundary, then nvec vectors of 16 bytes, then single elements to count. With
 * pointers of different alignment, head == count and nvec == 0. */
struct Layout {
  size_t count, head, nvec;
};

struct ReduceArgs {
  const void *in[CUDA_REDUCE_MAX_IN];
  void *out[CUDA_REDUCE_MAX_IN]; /* every output receives the same result */
  int n, nout;
  int divisor;
  Layout lay;
};

struct PremulArgs {
  const void *in;
  void *out;
  double factor;
  Layout lay;
};

template <class T>
union Vec {
  uint4 u;
  T e[sizeof(uint4) / sizeof(T)];
};

template <class T>
__device__ __forceinline__ uint4 load_vec(const void *p, const Layout &lay, size_t v) {
  return ((const uint4 *)((const T *)p + lay.head))[v];
}
template <class T>
__device__ __forceinline__ void store_vec(void *p, const Layout &lay, size_t v, uint4 x) {
  ((uint4 *)((T *)p + lay.head))[v] = x;
}

/* The one rounding to the dtype, then the AVG division of the rounded value. */
template <class K>
__device__ __forceinline__ typename K::T finish(typename K::A acc, int divisor) {
  typename K::T v = K::store(acc);
  return divisor > 1 ? K::Dt::divide(v, divisor) : v;
}

template <class K, class Op>
__device__ void reduce_elem(const ReduceArgs &a, size_t i) {
  typedef typename K::T T;
  typename K::A acc = K::load(((const T *)a.in[0])[i]);
  for (int k = 1; k < a.n; k++) acc = Op()(acc, K::load(((const T *)a.in[k])[i]));
  const T v = finish<K>(acc, a.divisor);
  for (int o = 0; o < a.nout; o++) ((T *)a.out[o])[i] = v;
}

/* U vectors, v + u * stride for u < U, handled together so that each thread has 2U
 * loads in flight (the memory system needs many more bytes in flight than one 16-byte
 * load per thread gives). All inputs of a vector are read before it is written, so an
 * output may be any in[k]. */
template <class K, class Op, int U>
__device__ void reduce_vecs(const ReduceArgs &a, size_t v, size_t stride) {
  typedef typename K::T T;
  const int L = sizeof(uint4) / sizeof(T);
  typename K::A acc[U][L];
  Vec<T> x[U];
#pragma unroll
  for (int u = 0; u < U; u++) {
    x[u].u = load_vec<T>(a.in[0], a.lay, v + u * stride);
#pragma unroll
    for (int l = 0; l < L; l++) acc[u][l] = K::load(x[u].e[l]);
  }
#pragma unroll 2
  for (int k = 1; k < a.n; k++) {
#pragma unroll
    for (int u = 0; u < U; u++) x[u].u = load_vec<T>(a.in[k], a.lay, v + u * stride);
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
      for (int l = 0; l < L; l++) acc[u][l] = Op()(acc[u][l], K::load(x[u].e[l]));
  }
#pragma unroll
  for (int u = 0; u < U; u++) {
#pragma unroll
    for (int l = 0; l < L; l++) x[u].e[l] = finish<K>(acc[u][l], a.divisor);
  }
  for (int o = 0; o < a.nout; o++)
#pragma unroll
    for (int u = 0; u < U; u++) store_vec<T>(a.out[o], a.lay, v + u * stride, x[u].u);
}

/* Index of the j-th single element: the head, then the tail after the vectors. */
__device__ __forceinline__ size_t single_index(const Layout &lay, size_t j, size_t per_vec) {
  return j < lay.head ? j : j + lay.nvec * per_vec;
}

__device__ __forceinline__ size_t thread_index() {
  return (size_t)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t grid_threads() { return (size_t)gridDim.x * blockDim.x; }

/* __grid_constant__: the pointer array is indexed at run time straight from the
 * parameter space instead of being copied to local memory. */
template <class K, class Op>
__global__ void __launch_bounds__(THREADS) reduce_kernel(const __grid_constant__ ReduceArgs a) {
  const size_t per_vec = sizeof(uint4) / sizeof(typename K::T);
  size_t start = thread_index(), stride = grid_threads();
  size_t v = start;
  for (; v + stride < a.lay.nvec; v += 2 * stride) reduce_vecs<K, Op, 2>(a, v, stride);
  for (; v < a.lay.nvec; v += stride) reduce_vecs<K, Op, 1>(a, v, stride);
  size_t singles = a.lay.count - a.lay.nvec * per_vec;
  for (size_t j = start; j < singles; j += stride)
    reduce_elem<K, Op>(a, single_index(a.lay, j, per_vec));
}

template <class D>
__global__ void __launch_bounds__(THREADS) premul_kernel(const __grid_constant__ PremulArgs a) {
  typedef typename D::T T;
  const int L = sizeof(uint4) / sizeof(T);
  size_t start = thread_index(), stride = grid_threads();
  for (size_t v = start; v < a.lay.nvec; v += stride) {
    Vec<T> x;
    x.u = load_vec<T>(a.in, a.lay, v);
#pragma unroll
    for (int l = 0; l < L; l++) x.e[l] = D::premul(x.e[l], a.factor);
    store_vec<T>(a.out, a.lay, v, x.u);
  }
  size_t singles = a.lay.count - a.lay.nvec * L;
  for (size_t j = start; j < singles; j += stride) {
    size_t i = single_index(a.lay, j, L);
    ((T *)a.out)[i] = D::premul(((const T *)a.in)[i], a.factor);
  }
}

/* Copies of a batch: entry blockIdx.y, laid out as the reductions' elements are (Layout,
 * bytes as elements): 16-byte vectors when both ends share a 16-byte alignment, single
 * bytes otherwise. */
struct CopyArgs {
  const void *src[CUDA_COPY_BATCH_MAX];
  void *dst[CUDA_COPY_BATCH_MAX];
  Layout lay[CUDA_COPY_BATCH_MAX];
};

__global__ void __launch_bounds__(THREADS) copy_kernel(const __grid_constant__ CopyArgs a) {
  const int e = blockIdx.y;
  const uint8_t *s = (const uint8_t *)a.src[e];
  uint8_t *d = (uint8_t *)a.dst[e];
  const Layout &lay = a.lay[e];
  size_t start = thread_index(), stride = grid_threads();
  const uint4 *sv = (const uint4 *)(s + lay.head);
  uint4 *dv = (uint4 *)(d + lay.head);
  size_t v = start;
  for (; v + stride < lay.nvec; v += 2 * stride) {
    uint4 x0 = sv[v], x1 = sv[v + stride];
    dv[v] = x0;
    dv[v + stride] = x1;
  }
  for (; v < lay.nvec; v += stride) dv[v] = sv[v];
  const size_t singles = lay.count - lay.nvec * 16;
  for (size_t j = start; j < singles; j += stride) {
    size_t i = single_index(lay, j, 16);
    d[i] = s[i];
  }
}

/* ------------------------------------------------------------------ host side */
size_t dtype_bytes(chorus_dtype_t d) {
  static const size_t sz[CHORUS_DTYPE_COUNT] = {1, 1, 2, 4, 8, 2, 2, 4, 8, 1, 1, 1};
  return (unsigned)d < CHORUS_DTYPE_COUNT ? sz[d] : 0;
}

/* Vectors only when every pointer reaches a 16-byte boundary at the same element. */
Layout plan_layout(const void *const *ptrs, int np, size_t es, size_t count) {
  Layout lay = {count, count, 0};
  uintptr_t mis = (uintptr_t)ptrs[0] & 15u;
  if (mis % es) return lay;
  for (int k = 1; k < np; k++)
    if (((uintptr_t)ptrs[k] & 15u) != mis) return lay;
  size_t head = ((16 - mis) & 15u) / es, per_vec = 16 / es;
  if (head > count) head = count;
  lay.head = head;
  lay.nvec = (count - head) / per_vec;
  return lay;
}

/* Multiprocessors of the current device, asked once per device. A race only repeats the
 * (idempotent) query. */
int sm_count(int *out) {
  static std::atomic<int> cache[MAX_DEVICES];
  int dev;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return (int)e;
  int n = dev >= 0 && dev < MAX_DEVICES ? cache[dev].load(std::memory_order_relaxed) : 0;
  if (n <= 0) {
    e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return (int)e;
    if (dev >= 0 && dev < MAX_DEVICES) cache[dev].store(n, std::memory_order_relaxed);
  }
  *out = n;
  return 0;
}

/* One thread per vector or single element, up to BLOCKS_PER_SM blocks per SM. */
int grid_for(const Layout &lay, size_t es, unsigned *blocks) {
  int sms;
  int e = sm_count(&sms);
  if (e) return e;
  size_t work = lay.nvec + (lay.count - lay.nvec * (16 / es));
  size_t b = (work + THREADS - 1) / THREADS, cap = (size_t)BLOCKS_PER_SM * (sms > 0 ? sms : 1);
  *blocks = (unsigned)(b < 1 ? 1 : b > cap ? cap : b);
  return 0;
}

template <class K, class Op>
int launch_reduce(const ReduceArgs &a, cudaStream_t s) {
  if (t_preload) return preload_kernel(reduce_kernel<K, Op>);
  unsigned blocks;
  int e = grid_for(a.lay, sizeof(typename K::T), &blocks);
  if (e) return e;
  reduce_kernel<K, Op><<<blocks, THREADS, 0, s>>>(a);
  return (int)cudaGetLastError();
}

template <class D>
int reduce_int(chorus_op_kind_t op, const ReduceArgs &a, cudaStream_t s) {
  if (a.n == 1) return launch_reduce<Raw<D>, Copy>(a, s);
  switch (op) {
    case CHORUS_SUM: return launch_reduce<Wrap<D>, Sum>(a, s);
    case CHORUS_PROD: return launch_reduce<Wrap<D>, Prod>(a, s);
    case CHORUS_MIN: return launch_reduce<Raw<D>, Min>(a, s);
    case CHORUS_MAX: return launch_reduce<Raw<D>, Max>(a, s);
    case CHORUS_BAND: return launch_reduce<Wrap<D>, And>(a, s);
    case CHORUS_BOR: return launch_reduce<Wrap<D>, Or>(a, s);
    case CHORUS_BXOR: return launch_reduce<Wrap<D>, Xor>(a, s);
    default: return (int)cudaErrorInvalidValue;
  }
}

/* K: SUM/PROD accumulator, M: MIN/MAX accumulator (they differ for float32). */
template <class D, class K, class M>
int reduce_float(chorus_op_kind_t op, const ReduceArgs &a, cudaStream_t s) {
  if (a.n == 1) return launch_reduce<Raw<D>, Copy>(a, s);
  switch (op) {
    case CHORUS_SUM: return launch_reduce<K, Sum>(a, s);
    case CHORUS_PROD: return launch_reduce<K, Prod>(a, s);
    case CHORUS_MIN: return launch_reduce<M, Min>(a, s);
    case CHORUS_MAX: return launch_reduce<M, Max>(a, s);
    default: return (int)cudaErrorInvalidValue;
  }
}

template <class C>
int reduce_narrow(chorus_op_kind_t op, const ReduceArgs &a, cudaStream_t s) {
  return reduce_float<Narrow<C>, NarrowAcc<C>, NarrowAcc<C>>(op, a, s);
}

/* reduce.c sums and multiplies two distinct float32 inputs in float (one IEEE operation
 * is correctly rounded) and everything else in double; follow the same split. */
int reduce_f32(chorus_op_kind_t op, const ReduceArgs &a, cudaStream_t s) {
  if (a.n == 2 && a.in[0] != a.in[1]) return reduce_float<F32, Raw<F32>, Raw<F32>>(op, a, s);
  return reduce_float<F32, F32Wide, Raw<F32>>(op, a, s);
}

/* n == 1 too: bool outputs are normalised to 0/1 even then. */
int reduce_bool(chorus_op_kind_t op, const ReduceArgs &a, cudaStream_t s) {
  switch (op) {
    case CHORUS_SUM:
    case CHORUS_MAX:
    case CHORUS_BOR: return launch_reduce<BoolAcc, Or>(a, s);
    case CHORUS_PROD:
    case CHORUS_MIN:
    case CHORUS_BAND: return launch_reduce<BoolAcc, And>(a, s);
    case CHORUS_BXOR: return launch_reduce<BoolAcc, Xor>(a, s);
    default: return (int)cudaErrorInvalidValue;
  }
}

int reduce_dispatch(chorus_dtype_t dtype, chorus_op_kind_t op, const ReduceArgs &a,
                    cudaStream_t s) {
  switch (dtype) {
    case CHORUS_INT8: return reduce_int<I8>(op, a, s);
    case CHORUS_UINT8: return reduce_int<U8>(op, a, s);
    case CHORUS_INT16: return reduce_int<I16>(op, a, s);
    case CHORUS_INT32: return reduce_int<I32>(op, a, s);
    case CHORUS_INT64: return reduce_int<I64>(op, a, s);
    case CHORUS_FLOAT16: return reduce_narrow<HalfCodec>(op, a, s);
    case CHORUS_BFLOAT16: return reduce_narrow<Bf16Codec>(op, a, s);
    case CHORUS_FLOAT32: return reduce_f32(op, a, s);
    case CHORUS_FLOAT64: return reduce_float<F64, Raw<F64>, Raw<F64>>(op, a, s);
    case CHORUS_BOOL: return reduce_bool(op, a, s);
    case CHORUS_FLOAT8_E4M3: return reduce_narrow<E4m3Codec>(op, a, s);
    case CHORUS_FLOAT8_E5M2: return reduce_narrow<E5m2Codec>(op, a, s);
    default: return (int)cudaErrorInvalidValue;
  }
}

bool is_float(chorus_dtype_t d) {
  return d == CHORUS_FLOAT16 || d == CHORUS_BFLOAT16 || d == CHORUS_FLOAT32 ||
         d == CHORUS_FLOAT64 || d == CHORUS_FLOAT8_E4M3 || d == CHORUS_FLOAT8_E5M2;
}

/* The op reduce_n would run: AVG and PREMUL_SUM reduce as SUM (reduce_op_supported's
 * table); -1 for a pair reduce_op_supported refuses or values out of range. */
int base_op(chorus_dtype_t dtype, chorus_op_kind_t op) {
  if ((unsigned)dtype >= CHORUS_DTYPE_COUNT || (unsigned)op >= CHORUS_OP_COUNT) return -1;
  switch (op) {
    case CHORUS_BAND:
    case CHORUS_BOR:
    case CHORUS_BXOR: return is_float(dtype) ? -1 : (int)op;
    case CHORUS_AVG:
    case CHORUS_PREMUL_SUM: return dtype == CHORUS_BOOL ? -1 : (int)CHORUS_SUM;
    default: return (int)op;
  }
}

template <class D>
int launch_premul(PremulArgs &a, cudaStream_t s) {
  if (t_preload) return preload_kernel(premul_kernel<D>);
  unsigned blocks;
  int e = grid_for(a.lay, sizeof(typename D::T), &blocks);
  if (e) return e;
  premul_kernel<D><<<blocks, THREADS, 0, s>>>(a);
  return (int)cudaGetLastError();
}

}  // namespace
}  // namespace chorus
using namespace chorus;

extern "C" int chorus_cuda_reduce(void *out, const void *const *in, int n, size_t count,
                                  chorus_dtype_t dtype, chorus_op_kind_t op, int divisor,
                                  void *stream) {
  int base = base_op(dtype, op);
  if (base < 0 || n < 1 || n > CUDA_REDUCE_MAX_IN || !out || !in) return (int)cudaErrorInvalidValue;
  for (int k = 0; k < n; k++)
    if (!in[k]) return (int)cudaErrorInvalidValue;
  if (count == 0) return 0;
  /* One input, already in place and nothing to divide: reduce_n would not touch it. */
  if (n == 1 && out == in[0] && dtype != CHORUS_BOOL && divisor <= 1) return 0;

  return chorus_cuda_reduce_multi(&out, 1, in, n, count, dtype, op, divisor, stream);
}

extern "C" int chorus_cuda_reduce_multi(void *const *out, int nout, const void *const *in,
                                        int n, size_t count, chorus_dtype_t dtype,
                                        chorus_op_kind_t op, int divisor, void *stream) {
  int base = base_op(dtype, op);
  if (base < 0 || n < 1 || n > CUDA_REDUCE_MAX_IN || nout < 1 || nout > CUDA_REDUCE_MAX_IN ||
      !out || !in)
    return (int)cudaErrorInvalidValue;
  for (int k = 0; k < n; k++)
    if (!in[k]) return (int)cudaErrorInvalidValue;
  for (int o = 0; o < nout; o++)
    if (!out[o]) return (int)cudaErrorInvalidValue;
  if (count == 0) return 0;
  ReduceArgs a;
  const void *ptrs[2 * CUDA_REDUCE_MAX_IN];
  for (int k = 0; k < n; k++) a.in[k] = ptrs[k] = in[k];
  for (int k = n; k < CUDA_REDUCE_MAX_IN; k++) a.in[k] = NULL;
  /* One input and nothing to divide or normalise: an output at the input's address is
   * already what reduce_n would leave there. */
  const int identity = n == 1 && dtype != CHORUS_BOOL && divisor <= 1;
  a.nout = 0;
  for (int o = 0; o < nout; o++)
    if (!(identity && out[o] == in[0])) {
      ptrs[n + a.nout] = out[o];
      a.out[a.nout++] = out[o];
    }
  if (a.nout == 0) return 0;
  for (int o = a.nout; o < CUDA_REDUCE_MAX_IN; o++) a.out[o] = NULL;
  a.n = n;
  a.divisor = divisor;
  a.lay = plan_layout(ptrs, n + a.nout, dtype_bytes(dtype), count);
  return reduce_dispatch(dtype, (chorus_op_kind_t)base, a, (cudaStream_t)stream);
}

extern "C" int chorus_cuda_copy_batch(void *const *dst, const void *const *src,
                                      const size_t *bytes, int n, void *stream) {
  if (n < 0 || (n && (!dst || !src || !bytes))) return (int)cudaErrorInvalidValue;
  int sms;
  int e = sm_count(&sms);
  if (e) return e;
  for (int first = 0; first < n; first += CUDA_COPY_BATCH_MAX) {
    CopyArgs a;
    int m = 0;
    size_t most = 0;
    for (int k = first; k < n && k < first + CUDA_COPY_BATCH_MAX; k++) {
      if (!bytes[k] || dst[k] == src[k]) continue;
      if (!dst[k] || !src[k]) return (int)cudaErrorInvalidValue;
      const void *ends[2] = {src[k], dst[k]};
      a.src[m] = src[k];
      a.dst[m] = dst[k];
      a.lay[m] = plan_layout(ends, 2, 1, bytes[k]);
      if (bytes[k] > most) most = bytes[k];
      m++;
    }
    if (!m) continue;
    for (int k = m; k < CUDA_COPY_BATCH_MAX; k++) {
      a.src[k] = NULL;
      a.dst[k] = NULL;
      a.lay[k] = Layout{0, 0, 0};
    }
    /* as many blocks per entry as its largest piece needs, all entries together within
     * BLOCKS_PER_SM per multiprocessor */
    size_t want = (most / 16 + THREADS - 1) / THREADS;
    size_t cap = (size_t)BLOCKS_PER_SM * (sms > 0 ? sms : 1) / (size_t)m;
    unsigned bx = (unsigned)(want < 1 ? 1 : want > cap ? (cap < 1 ? 1 : cap) : want);
    copy_kernel<<<dim3(bx, (unsigned)m), THREADS, 0, (cudaStream_t)stream>>>(a);
    e = (int)cudaGetLastError();
    if (e) return e;
  }
  return 0;
}

extern "C" int chorus_cuda_load_kernels(int *loaded) {
  /* every kernel a dispatch below can reach: each dtype x base op x input count (one input
   * copies, two distinct float32 inputs take the narrow accumulator, more the wide one) */
  t_preload = true;
  t_preloaded = 0;
  int err = 0;
  const void *in[3] = {(const void *)16, (const void *)32, (const void *)48};
  for (int d = 0; d < CHORUS_DTYPE_COUNT && !err; d++) {
    for (int op = 0; op < CHORUS_OP_COUNT && !err; op++) {
      if (base_op((chorus_dtype_t)d, (chorus_op_kind_t)op) != op) continue;
      for (int n = 1; n <= 3 && !err; n++) {
        ReduceArgs a;
        memset(&a, 0, sizeof a);
        for (int k = 0; k < n; k++) a.in[k] = in[k];
        a.n = n;
        err = reduce_dispatch((chorus_dtype_t)d, (chorus_op_kind_t)op, a, 0);
      }
    }
    PremulArgs p;
    memset(&p, 0, sizeof p);
    if (!err) err = chorus_cuda_premul(&p, &p, 1, (chorus_dtype_t)d, 1.0, 0);
  }
  if (!err) err = preload_kernel(copy_kernel);
  t_preload = false;
  if (loaded) *loaded = t_preloaded;
  return err;
}

extern "C" int chorus_cuda_premul(void *out, const void *in, size_t count, chorus_dtype_t dtype,
                                  double factor, void *stream) {
  if ((unsigned)dtype >= CHORUS_DTYPE_COUNT || !out || !in) return (int)cudaErrorInvalidValue;
  if (count == 0) return 0;
  PremulArgs a;
  const void *ptrs[2] = {in, out};
  a.in = in;
  a.out = out;
  a.factor = factor;
  a.lay = plan_layout(ptrs, 2, dtype_bytes(dtype), count);
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case CHORUS_INT8: return launch_premul<I8>(a, s);
    case CHORUS_UINT8: return launch_premul<U8>(a, s);
    case CHORUS_INT16: return launch_premul<I16>(a, s);
    case CHORUS_INT32: return launch_premul<I32>(a, s);
    case CHORUS_INT64: return launch_premul<I64>(a, s);
    case CHORUS_FLOAT16: return launch_premul<F16>(a, s);
    case CHORUS_BFLOAT16: return launch_premul<BF16>(a, s);
    case CHORUS_FLOAT32: return launch_premul<F32>(a, s);
    case CHORUS_FLOAT64: return launch_premul<F64>(a, s);
    case CHORUS_FLOAT8_E4M3: return launch_premul<E4M3>(a, s);
    case CHORUS_FLOAT8_E5M2: return launch_premul<E5M2>(a, s);
    default: return launch_premul<Bool>(a, s);
  }
}
