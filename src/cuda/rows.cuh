/* Device row helpers shared by the cache write (cache_write.cu) and the
 * Hadamard transform (hadamard.cu): the CPU's f32/f16/bf16 conversions bit
 * for bit, and the normalized Walsh-Hadamard transform of one row staged in
 * shared memory by one warp, in the operation order of src/core/hadamard.c
 * (adds and subtracts through __fadd_rn/__fsub_rn, one __fmul_rn: no fma),
 * so the bits equal the CPU's. */
#ifndef KVA_CUDA_ROWS_CUH
#define KVA_CUDA_ROWS_CUH

#include "cuda/common.cuh"

/* ---- the CPU's conversions (src/core/tensor.c), bit for bit, NaN payloads
 * included (the cuda_fp16/bf16 intrinsics canonicalize NaNs) */
__device__ __forceinline__ float kvc_cw_f16_to_f32(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return __uint_as_float(sign | __float_as_uint(__fmul_rn((float)m, 1.0f / 16777216.0f)));
  if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
  return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}
__device__ __forceinline__ uint16_t kvc_cw_f32_to_f16(float x) {
  const uint32_t u = __float_as_uint(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
  if (a < 0x38800000u) return (uint16_t)(sign | (uint32_t)rintf(__fmul_rn(__uint_as_float(a), 16777216.0f)));
  const uint32_t m = a + 0xfffu + ((a >> 13) & 1u);
  return (uint16_t)(sign | ((m - 0x38000000u) >> 13));
}
__device__ __forceinline__ uint16_t kvc_cw_f32_to_bf16(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
__device__ __forceinline__ float kvc_cw_load(const char *p, int dt) {
  switch (dt) {
  case KVA_F32: return __uint_as_float(*(const uint32_t *)p);
  case KVA_F16: return kvc_cw_f16_to_f32(*(const uint16_t *)p);
  case KVA_BF16: return __uint_as_float((uint32_t)*(const uint16_t *)p << 16);
  default: return 0.0f;
  }
}
__device__ __forceinline__ void kvc_cw_store(char *p, int dt, float x) {
  switch (dt) {
  case KVA_F32: *(uint32_t *)p = __float_as_uint(x); break;
  case KVA_F16: *(uint16_t *)p = kvc_cw_f32_to_f16(x); break;
  case KVA_BF16: *(uint16_t *)p = kvc_cw_f32_to_bf16(x); break;
  default: break;
  }
}
__device__ __forceinline__ int kvc_cw_size(int dt) { return dt == KVA_F32 ? 4 : 2; }

/* u[0 .. D) <- H_D u in shared memory by n threads (thread t: a warp's
 * lanes, BLOCK false, or the block's threads, BLOCK true): m the
 * power-of-two block (D = m or 3m), c the final scale (kva_hadamard_scale).
 * Stage h = 2^s pairs (i, i + h), i % 2h < h: pair p of the D/2 is
 * i = (p / h) 2h + p % h (shifts and a mask); a __syncwarp / barrier after
 * each stage and at the end. */
template <bool BLOCK>
__device__ __forceinline__ void kvc_hadamard_par(float *u, int D, int m, float c, int t, int n) {
  auto sync = [] {
    if (BLOCK) __syncthreads();
    else __syncwarp();
  };
  for (int s = 0, h = 1; h < m; ++s, h <<= 1) {
    for (int p = t; p < D / 2; p += n) {
      const int i = ((p >> s) << (s + 1)) | (p & (h - 1));
      const float a = u[i], b = u[i + h];
      u[i] = __fadd_rn(a, b);
      u[i + h] = __fsub_rn(a, b);
    }
    sync();
  }
  if (m != D) {
    for (int a = t; a < m; a += n) {
      const float u0 = u[a], u1 = u[m + a], u2 = u[2 * m + a];
      const float s = __fadd_rn(__fadd_rn(u0, u1), u2), s2 = __fadd_rn(s, s);
      u[a] = __fsub_rn(s2, __fadd_rn(__fadd_rn(u0, u0), u0));
      u[m + a] = __fsub_rn(s2, __fadd_rn(__fadd_rn(u1, u1), u1));
      u[2 * m + a] = __fsub_rn(s2, __fadd_rn(__fadd_rn(u2, u2), u2));
    }
    sync();
  }
  for (int i = t; i < D; i += n) u[i] = __fmul_rn(u[i], c);
  sync();
}
/* u <- H_D u (f32) for a row spread over a warp's lanes, lane t holding
 * dims t + 32 j, j < DPT (D = 32 DPT a power of two; loads and stores of
 * such a row in shared memory are free of bank conflicts): stages h = 1 ..
 * 16 with lane t ^ h by a shuffle, h = 32 .. D / 2 in the lane (element
 * j ^ h / 32); the lower element of a pair takes a + b, the upper a - b
 * (__fadd_rn / __fsub_rn), then one __fmul_rn by c: kvc_hadamard_par's
 * operations on every element, so the bits are its bits. All lanes take
 * part (the shuffles). */
template <int DPT> __device__ __forceinline__ void kvc_hadamard_lanes(float (&u)[DPT], int t, float c) {
#pragma unroll
  for (int h = 1; h < KVC_WARP; h <<= 1) {
    const bool upper = (t & h) != 0;
#pragma unroll
    for (int j = 0; j < DPT; ++j) {
      const float y = __shfl_xor_sync(KVC_FULL_MASK, u[j], h);
      u[j] = upper ? __fsub_rn(y, u[j]) : __fadd_rn(u[j], y);
    }
  }
#pragma unroll
  for (int s = 1; s < DPT; s <<= 1)
#pragma unroll
    for (int j = 0; j < DPT; ++j)
      if ((j & s) == 0) {
        const float p = u[j], q = u[j + s];
        u[j] = __fadd_rn(p, q);
        u[j + s] = __fsub_rn(p, q);
      }
#pragma unroll
  for (int j = 0; j < DPT; ++j) u[j] = __fmul_rn(u[j], c);
}
/* One warp (lane 0..31) on a row it may have just written; ends with
 * __syncwarp (u readable by all lanes). */
__device__ __forceinline__ void kvc_hadamard_warp(float *u, int D, int m, float c, int lane) {
  __syncwarp();
  kvc_hadamard_par<false>(u, D, m, c, lane, KVC_WARP);
}
/* The same operations per element by all nthreads threads of the block
 * (u written by the block before: the caller's barrier); ends with a barrier. */
__device__ __forceinline__ void kvc_hadamard_block(float *u, int D, int m, float c, int tid, int nthreads) {
  kvc_hadamard_par<true>(u, D, m, c, tid, nthreads);
}

/* A rotated call's query vector as its kernel takes it (kvc_args rot_q):
 * u[0 .. D) <- H_D q in f32 (kvc_hadamard_warp on the row qrow, elements
 * qs3 bytes apart, of dtype qdt), rounded once to rdt (rot_qdt) and read
 * back as f32: the bits the pass (kva_hadamard into q' of that dtype) hands
 * the kernel. One warp; ends with __syncwarp. Not inlined: the kernels'
 * registers stay as they are for unrotated calls. */
static __device__ __noinline__ void kvc_rotated_query_warp(const char *qrow, long long qs3, int qdt, int D, int m,
                                                           float c, int rdt, float *u, int lane) {
  __syncwarp(); /* earlier reads of u */
  for (int d = lane; d < D; d += KVC_WARP) u[d] = kvc_cw_load(qrow + d * qs3, qdt);
  kvc_hadamard_warp(u, D, m, c, lane);
  for (int d = lane; d < D; d += KVC_WARP) {
    const float x = u[d];
    u[d] = rdt == KVA_BF16  ? kvc_bf16_bits(kvc_cw_f32_to_bf16(x))
           : rdt == KVA_F16 ? kvc_cw_f16_to_f32(kvc_cw_f32_to_f16(x))
                            : x;
  }
  __syncwarp();
}
#endif
