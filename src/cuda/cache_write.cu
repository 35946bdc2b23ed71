/* Math: kva_cache_write on the device: float pools store each row converted to the
 *   pool dtype; quantized pools store MLX's affine quantization of each row, the
 *   operations of src/core/quant.c in its order and rounding (no fma), so the bits
 *   equal the CPU's; fp8 pools store round(x / scale) (RNE, saturating) with the
 *   row's scale amax / max_fp8 computed and stored (per-row scales) or read (a
 *   fixed scale), as src/core/quant.c does (exact f32 max, IEEE division: the
 *   same bits). Out-of-range slots (device memory: not validated) are skipped.
 * Traffic: reads n*KVH*(Dk+Dv) input values once, writes those rows of the pools.
 * Launch: one block per token (grid n), KVC_CW_WARPS warps; a warp per (K|V, KV head)
 *   row; shared memory only for rotated rows (kva_cache_write_ex: a row of max(Dk, Dv)
 *   floats per warp, transformed as src/core/hadamard.c does, rows.cuh); no
 *   allocation, no sync (graph-capturable). Two tokens
 *   naming one slot: the later wins (each block scans the later slots). */
#include "cuda/common.cuh"
#include "cuda/rows.cuh"

extern "C" {
#include "core/hadamard.h"
#include "core/quant.h" /* kva_fp8_scales_per_row */
}

#include <cuda_runtime.h>
#include <string.h>

#define KVC_CW_WARPS 8
#define KVC_CW_THREADS (KVC_CW_WARPS * KVC_WARP)

/* One pool and the rows written into it. */
struct kvc_cw_operand {
  char *data, *scales, *biases;    /* pool arrays [num_blocks, KVH, block_size, *] */
  long long ds[3], ss[3], bs[3];   /* their byte strides of dims block, head, row */
  const char *src;                 /* [n, KVH, D] input rows */
  long long src_s[2];              /* byte strides of dims token, head */
  int src_dtype, pool_dtype;       /* pool_dtype: float pools' element dtype */
  int sdtype;                      /* quantized: scales/biases dtype */
  int bits, group;                 /* 0 = float pool */
  int fp8_scales;                  /* fp8 pools: 0 = none (scale 1), 1 = fixed (read), 2 = per row (written) */
  int D;
  int rotate;                      /* store H_D of each row (kva_cache_write_ex) */
  int hd_m;                        /* rotate: the transform's power-of-two block */
  float hd_c;                      /* rotate: its final scale */
};

struct kvc_cw_args {
  kvc_cw_operand op[2]; /* K, V */
  const int32_t *slots; /* [n] */
  long long n, nslots;  /* nslots = num_blocks * block_size */
  long long KVH, block_size;
  int rot_dim; /* floats of shared memory per warp (0 without rotation) */
};

/* f32 -> fp8 (M mantissa bits, exponent bias, largest finite code maxc),
 * src/core/tensor.c's f32_to_f8 operation for operation: RNE, saturating,
 * NaN -> sign | 0x7f. */
__device__ __forceinline__ uint32_t kvc_cw_f32_to_f8(float x, int M, int bias, uint32_t maxc) {
  const uint32_t u = __float_as_uint(x), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;
  uint32_t c;
  if (a < (uint32_t)(128 - bias) << 23) {
    c = (uint32_t)rintf(__fmul_rn(__uint_as_float(a), __uint_as_float((uint32_t)(127 + bias - 1 + M) << 23)));
  } else {
    const int sh = 23 - M;
    const uint32_t m = a + ((1u << (sh - 1)) - 1u) + ((a >> sh) & 1u);
    c = (m >> sh) - ((uint32_t)(127 - bias) << M);
  }
  return sign | (c > maxc ? maxc : c);
}

/* An fp8 pool row (src/core/quant.c's kva_fp8_row_scale and
 * kva_fp8_quantize_row): per-row scales from the warp's max |x| over the
 * finite values (exact, any order), amax / max_fp8 (IEEE division), at
 * least FLT_MIN, 1 for amax 0; codes of x / scale, NaN to its sign's NaN. */
__device__ void kvc_cw_fp8_row(const kvc_cw_operand &o, const char *src, uint8_t *dst, char *srow, int lane) {
  const int ss = kvc_cw_size(o.src_dtype);
  const bool e4 = o.pool_dtype == KVA_F8E4M3;
  float scale = 1.0f;
  if (o.fp8_scales == 2) {
    float amax = 0.0f;
    for (int e = lane; e < o.D; e += KVC_WARP) {
      const float a = fabsf(kvc_cw_load(src + e * ss, o.src_dtype));
      if (a <= 3.402823466e38f && a > amax) amax = a;
    }
    for (int off = KVC_WARP / 2; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(KVC_FULL_MASK, amax, off));
    if (amax != 0.0f) {
      scale = __fdiv_rn(amax, e4 ? 448.0f : 57344.0f);
      if (scale < 1.175494351e-38f) scale = 1.175494351e-38f;
    }
    if (lane == 0) *(float *)srow = scale;
  } else if (o.fp8_scales == 1) {
    scale = *(const float *)srow;
  }
  for (int e = lane; e < o.D; e += KVC_WARP) {
    const float x = kvc_cw_load(src + e * ss, o.src_dtype);
    const float y = __fdiv_rn(x, scale);
    dst[e] = (uint8_t)(isnan(x) ? (__float_as_uint(x) >> 24 & 0x80u) | 0x7fu
                       : e4 ? kvc_cw_f32_to_f8(y, 3, 7, 0x7eu) : kvc_cw_f32_to_f8(y, 2, 15, 0x7bu));
  }
}

/* ---- f32 operations with x86-64 SSE's NaN results. A group's scale is NaN
 * only for non-finite inputs (inf - inf, inf / inf); the CPU backend then
 * stores the NaN SSE makes: an operand NaN, quieted (the first operand's when
 * both are), else the default NaN 0xffc00000. The GPU's is 0x7fffffff, so the
 * scale's few operations are written through these. */
#define KVC_X86_DEFAULT_NAN 0xffc00000u
__device__ __forceinline__ float kvc_quiet(float a) { return __uint_as_float(__float_as_uint(a) | 0x00400000u); }
__device__ __forceinline__ float kvc_x86_result(float a, float b, float r) {
  if (isnan(a)) return kvc_quiet(a);
  if (isnan(b)) return kvc_quiet(b);
  return isnan(r) ? __uint_as_float(KVC_X86_DEFAULT_NAN) : r;
}
__device__ __forceinline__ float kvc_x86_sub(float a, float b) { return kvc_x86_result(a, b, __fsub_rn(a, b)); }
__device__ __forceinline__ float kvc_x86_div(float a, float b) { return kvc_x86_result(a, b, __fdiv_rn(a, b)); }
__device__ __forceinline__ float kvc_x86_rint(float a) { return isnan(a) ? kvc_quiet(a) : rintf(a); }
__device__ __forceinline__ float kvc_neg(float a) { return __uint_as_float(__float_as_uint(a) ^ 0x80000000u); }

/* ---- addressing */
__device__ __forceinline__ char *kvc_cw_at(char *base, const long long *s, long long blk, int h, long long row) {
  return base + blk * s[0] + h * s[1] + row * s[2];
}

/* A float pool row: lanes stride over the D elements. */
__device__ void kvc_cw_float_row(const kvc_cw_operand &o, const char *src, char *dst, int lane) {
  const int ss = kvc_cw_size(o.src_dtype), ds = kvc_cw_size(o.pool_dtype);
  for (int e = lane; e < o.D; e += KVC_WARP)
    kvc_cw_store(dst + e * ds, o.pool_dtype, kvc_cw_load(src + e * ss, o.src_dtype));
}

/* A quantized row: lane l owns one packed word (32/bits elements) of each
 * 32-word chunk; a group's words (gs*bits/32 in {2..32}, a power of two) are
 * consecutive aligned lanes, which reduce min/max among themselves. Min/max
 * skip NaN as quant.c's comparisons do; the sign of a zero extreme never
 * reaches the output (a zero edge gives bias 0, a zero range the eps scale). */
__device__ void kvc_cw_quant_row(const kvc_cw_operand &o, const char *src, uint32_t *q, char *srow, char *brow,
                                 int lane) {
  const int bits = o.bits, per_word = 32 / bits, wpg = o.group * bits / 32;
  const int words = o.D * bits / 32, ss = kvc_cw_size(o.src_dtype), sz = kvc_cw_size(o.sdtype);
  const float n_bins = (float)((1 << bits) - 1);
  const float eps = (float)1e-7; /* quant.c, after MLX */
  for (int w0 = 0; w0 < words; w0 += KVC_WARP) {
    const int w = w0 + lane;
    const bool active = w < words; /* whole groups: words and 32 are multiples of wpg */
    float x[16];                   /* per_word <= 16 */
    float wmin = INFINITY, wmax = -INFINITY;
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      if (e < per_word && active) {
        x[e] = kvc_cw_load(src + (long long)(w * per_word + e) * ss, o.src_dtype);
        if (wmax < x[e]) wmax = x[e];
        if (x[e] < wmin) wmin = x[e];
      }
    }
    for (int off = wpg >> 1; off > 0; off >>= 1) {
      const float omin = __shfl_xor_sync(KVC_FULL_MASK, wmin, off);
      const float omax = __shfl_xor_sync(KVC_FULL_MASK, wmax, off);
      if (wmax < omax) wmax = omax;
      if (omin < wmin) wmin = omin;
    }
    if (!active) continue;
    /* quant.c's quantize_group, operation for operation */
    const bool min_edge = fabsf(wmin) > fabsf(wmax);
    float scale = kvc_x86_div(kvc_x86_sub(wmax, wmin), n_bins);
    if (scale < eps) scale = eps;
    if (!min_edge) scale = kvc_neg(scale);
    const float edge = min_edge ? wmin : wmax;
    const float q0 = kvc_x86_rint(kvc_x86_div(edge, scale));
    float bias = 0.0f;
    if (q0 != 0.0f) {
      scale = kvc_x86_div(edge, q0);
      bias = edge;
    }
    uint32_t word = 0;
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      if (e < per_word) {
        float v = rintf(__fdiv_rn(__fsub_rn(x[e], bias), scale));
        v = v < 0.0f ? 0.0f : v;
        v = n_bins < v ? n_bins : v;
        const uint32_t c = isnan(v) ? 0u : (uint32_t)v;
        word |= c << (e * bits);
      }
    }
    q[w] = word;
    if (w % wpg == 0) {
      const int g = w / wpg;
      kvc_cw_store(srow + g * sz, o.sdtype, scale);
      kvc_cw_store(brow + g * sz, o.sdtype, bias);
    }
  }
}

/* Does a later token name the same slot? Then this one is skipped (the last
 * token wins, as on the CPU). The block's threads read slots[i+1..n) together,
 * KVC_CW_SCAN_UNROLL loads in flight per thread: O(n / threads) per token. */
#define KVC_CW_SCAN_UNROLL 4
__device__ bool kvc_cw_superseded(const kvc_cw_args &a, long long i, int32_t slot) {
  int dup = 0;
  for (long long j0 = i + 1; j0 < a.n; j0 += (long long)KVC_CW_THREADS * KVC_CW_SCAN_UNROLL) {
#pragma unroll
    for (int u = 0; u < KVC_CW_SCAN_UNROLL; ++u) {
      const long long j = j0 + (long long)u * KVC_CW_THREADS + threadIdx.x;
      if (j < a.n) dup |= a.slots[j] == slot;
    }
  }
  return __syncthreads_or(dup) != 0;
}

/* Dynamic shared memory: with a rotated operand, one row of max(Dk, Dv)
 * floats per warp (the rotated row in f32, then written as an f32 row). */
__global__ void __launch_bounds__(KVC_CW_THREADS) kvc_cache_write_kernel(const kvc_cw_args a) {
  extern __shared__ float kvc_cw_rot[];
  const long long i = blockIdx.x; /* token */
  const int32_t slot = a.slots[i];
  if (slot < 0 || slot >= a.nslots) return; /* padding, or out of range: skipped */
  if (kvc_cw_superseded(a, i, slot)) return;
  const long long blk = slot / a.block_size, row = slot % a.block_size;
  const int lane = threadIdx.x % KVC_WARP;
  for (long long r = threadIdx.x / KVC_WARP; r < 2 * a.KVH; r += KVC_CW_WARPS) { /* rows (K|V, head) */
    const int which = (int)(r / a.KVH), h = (int)(r % a.KVH);                   /* KVH < 2^31: a pool dim */
    kvc_cw_operand o = a.op[which];
    const char *src = o.src + i * o.src_s[0] + (long long)h * o.src_s[1];
    if (o.rotate) { /* kva_cache_write_ex: H_D of the row in f32, then written as an f32 row */
      float *u = kvc_cw_rot + (threadIdx.x / KVC_WARP) * a.rot_dim;
      const int ss = kvc_cw_size(o.src_dtype);
      for (int e = lane; e < o.D; e += KVC_WARP) u[e] = kvc_cw_load(src + (long long)e * ss, o.src_dtype);
      kvc_hadamard_warp(u, o.D, o.hd_m, o.hd_c, lane);
      src = (const char *)u;
      o.src_dtype = KVA_F32;
    }
    if (o.bits == 0 && (o.pool_dtype == KVA_F8E4M3 || o.pool_dtype == KVA_F8E5M2)) {
      kvc_cw_fp8_row(o, src, (uint8_t *)kvc_cw_at(o.data, o.ds, blk, h, row),
                     o.fp8_scales ? kvc_cw_at(o.scales, o.ss, blk, h, row) : NULL, lane);
    } else if (o.bits == 0) {
      kvc_cw_float_row(o, src, kvc_cw_at(o.data, o.ds, blk, h, row), lane);
    } else {
      kvc_cw_quant_row(o, src, (uint32_t *)kvc_cw_at(o.data, o.ds, blk, h, row),
                       kvc_cw_at(o.scales, o.ss, blk, h, row), kvc_cw_at(o.biases, o.bs, blk, h, row), lane);
    }
    __syncwarp(); /* the row's reads of u before the warp's next row */
  }
}

static kvc_cw_operand kvc_cw_operand_of(const kva_kv *pool, const kva_tensor *src) {
  kvc_cw_operand o;
  memset(&o, 0, sizeof o);
  o.data = (char *)pool->data.data;
  for (int d = 0; d < 3; ++d) o.ds[d] = pool->data.stride[d];
  o.src = (const char *)src->data;
  o.src_s[0] = src->stride[0];
  o.src_s[1] = src->stride[1];
  o.src_dtype = src->dtype;
  o.pool_dtype = pool->data.dtype;
  o.bits = pool->bits;
  o.D = (int)src->shape[2];
  if (pool->bits) {
    o.scales = (char *)pool->scales.data;
    o.biases = (char *)pool->biases.data;
    for (int d = 0; d < 3; ++d) {
      o.ss[d] = pool->scales.stride[d];
      o.bs[d] = pool->biases.stride[d];
    }
    o.sdtype = pool->scales.dtype;
    o.group = pool->group_size;
  } else if (kva_kv_scaled(pool)) { /* fp8 rows with scales */
    o.scales = (char *)pool->scales.data;
    for (int d = 0; d < 3; ++d) o.ss[d] = pool->scales.stride[d];
    o.fp8_scales = kva_fp8_scales_per_row(&pool->scales) ? 2 : 1;
  }
  return o;
}

extern "C" int kva_cuda_cache_write_ex(kva_context *ctx, const kva_kv *k_pool, const kva_kv *v_pool,
                                       const kva_tensor *k, const kva_tensor *v, const int32_t *slots, int64_t n,
                                       unsigned flags) {
  if (!ctx->cuda) return kva_seterr(KVA_ENODEVICE, "ctx: CUDA context not initialized");
  if (n > 0x7fffffffLL)
    return kva_seterr(KVA_EUNSUPPORTED, "n = %lld tokens: at most 2^31 - 1 per call on CUDA", (long long)n);
  if (k->shape[2] > 0x7fffffffLL / 32 || v->shape[2] > 0x7fffffffLL / 32)
    return kva_seterr(KVA_EUNSUPPORTED, "head dim %lld / %lld is too large", (long long)k->shape[2],
                      (long long)v->shape[2]);
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess && dev != ctx->device) e = cudaSetDevice(ctx->device);
  if (e != cudaSuccess)
    return kva_seterr(KVA_ECUDA, "selecting ctx's device: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
  kvc_cw_args a;
  memset(&a, 0, sizeof a);
  a.op[0] = kvc_cw_operand_of(k_pool, k);
  a.op[1] = kvc_cw_operand_of(v_pool, v);
  a.slots = slots;
  a.n = n;
  a.KVH = k_pool->data.shape[1];
  a.block_size = k_pool->data.shape[2];
  a.nslots = (long long)k_pool->data.shape[0] * k_pool->data.shape[2];
  for (int w = 0; w < 2; ++w) {
    kvc_cw_operand &o = a.op[w];
    o.rotate = (flags & (w ? KVA_WRITE_ROTATE_V : KVA_WRITE_ROTATE_K)) != 0;
    if (!o.rotate) continue;
    o.hd_m = kva_hadamard_block(o.D);
    o.hd_c = kva_hadamard_scale(o.D);
    if (o.D > a.rot_dim) a.rot_dim = o.D;
  }
  const size_t smem = (size_t)KVC_CW_WARPS * (size_t)a.rot_dim * sizeof(float);
  kvc_cache_write_kernel<<<(unsigned)n, KVC_CW_THREADS, smem, (cudaStream_t)ctx->stream>>>(a);
  e = cudaGetLastError();
  if (e != cudaSuccess) return kva_seterr(KVA_ECUDA, "cache write kernel launch: %s", cudaGetErrorString(e));
  return 0;
}
