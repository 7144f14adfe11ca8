/* cuda_kernels.h - C entry points of the core's CUDA kernels (the .cu files in kernels/), used by
 * cuda.c. No torch headers; every function is asynchronous on `stream` (a cudaStream_t)
 * and returns a cudaError_t value (0 = cudaSuccess) from the launch. Pointers are device
 * memory (or memory mapped into this device through CUDA IPC). The results are the CPU
 * path's results: the same accumulation types (fp16/bf16 in float32, float32 in float64),
 * the same combining order (in[0], in[1], ... in[n-1]), the same bool and integer rules
 * (reduce.c), so a collective gives bit-identical results on either device. */
#ifndef CHORUS_CUDA_KERNELS_H
#define CHORUS_CUDA_KERNELS_H

#include <stddef.h>

#include "chorus.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most inputs one reduction launch combines (more: the caller reduces in passes). */
#define CUDA_REDUCE_MAX_IN 16

/* out[i] = op(in[0][i], ..., in[n-1][i]) for i < count, then, when divisor > 1 (AVG),
 * divided exactly as reduce_divide does after reduce_n on the CPU: the reduced value is
 * rounded to the dtype first, then divided (fp16/bf16 in float, float32 and integers up to
 * 32 bits in double with truncation for integers, int64 by integer division). op is a base op (SUM, PROD, MIN, MAX, BAND, BOR, BXOR); bool:
 * SUM/MAX/BOR = or, PROD/MIN/BAND = and, BXOR = xor, results 0/1. 1 <= n <=
 * CUDA_REDUCE_MAX_IN. out may equal any in[k] (same address); no other overlap. */
int chorus_cuda_reduce(void *out, const void *const *in, int n, size_t count,
                       chorus_dtype_t dtype, chorus_op_kind_t op, int divisor, void *stream);
/* chorus_cuda_reduce with the one result written to each of out[0..nout-1] (1 <= nout <=
 * CUDA_REDUCE_MAX_IN): every input element is read once, whatever the number of outputs.
 * Each output may equal any in[k]; no other overlap. */
int chorus_cuda_reduce_multi(void *const *out, int nout, const void *const *in, int n,
                             size_t count, chorus_dtype_t dtype, chorus_op_kind_t op,
                             int divisor, void *stream);
/* Most copies one copy launch carries (more: several launches). */
#define CUDA_COPY_BATCH_MAX 64
/* dst[k][0..bytes[k]) = src[k][...] for k < n, byte for byte, in as few launches as the
 * batch size allows. Entries with dst == src or no bytes are skipped. No destination may
 * overlap another entry's source or destination. */
int chorus_cuda_copy_batch(void *const *dst, const void *const *src, const size_t *bytes,
                           int n, void *stream);
/* out[i] = in[i] * factor, rounded as reduce_premul does on the CPU. out may equal in. */
int chorus_cuda_premul(void *out, const void *in, size_t count, chorus_dtype_t dtype,
                       double factor, void *stream);
/* Loads every kernel above into the current device's context (CUDA loads kernels lazily, at
 * their first launch, and a load waits for the device to finish what it runs: a first
 * collective behind a long kernel would hold the host). Launches nothing. *loaded: how
 * many kernels. */
int chorus_cuda_load_kernels(int *loaded);

#ifdef __cplusplus
}
#endif

#endif /* CHORUS_CUDA_KERNELS_H */
