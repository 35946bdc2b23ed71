/* The general CUDA path: any format per operand, any head dims, any L,
 * explicit (array) masks; correct first, simple.
 *   math: for one query row, s_t = softcap(scale * q.k_t) + mask_t over the
 *         visible keys, online softmax in f32 over tiles of GEN_THREADS keys,
 *         out = sum_t p_t v_t / (sum_t p_t + exp(sink)).
 *   memory: every K row is read once per query row (no GQA sharing): rep * L
 *         times the cache per call; elements are loaded one by one.
 *   launch: grid (L, H, B), GEN_THREADS threads; thread = one key of the tile
 *         for the logits, then output dims d = tid, tid + GEN_THREADS, ...;
 *         dynamic shared memory: q (Dk floats) + the tile's p and flags. */
#include "cuda/launch.cuh"

#define GEN_THREADS 128
#define GEN_WARPS (GEN_THREADS / KVC_WARP)
#define GEN_MAX_DV 512
#define GEN_DV_PER_THREAD (GEN_MAX_DV / GEN_THREADS)

/* Block-wide reduction of one float (max, NaN-propagating, or sum). */
template <bool IS_MAX>
__device__ float gen_block_reduce(float x, float *red) {
  for (int off = KVC_WARP / 2; off > 0; off >>= 1) {
    float y = __shfl_xor_sync(KVC_FULL_MASK, x, off);
    x = IS_MAX ? kvc_max(x, y) : x + y;
  }
  int warp = threadIdx.x / KVC_WARP, lane = threadIdx.x % KVC_WARP;
  __syncthreads(); /* red[] may still be read by the previous reduction */
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < GEN_WARPS; ++w) r = IS_MAX ? kvc_max(r, red[w]) : r + red[w];
  return r;
}

__global__ void __launch_bounds__(GEN_THREADS) kvc_generic_kernel(const kvc_args a) {
  extern __shared__ float gen_smem[];
  float *qs = gen_smem;                      /* [Dk] */
  float *ps = qs + a.Dk;                     /* [GEN_THREADS] weights of the tile */
  float *red = ps + GEN_THREADS;             /* [GEN_WARPS] */
  int *vis_s = (int *)(red + GEN_WARPS);     /* [GEN_THREADS] visibility of the tile */
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const int hk = h / a.rep;
  const long long len = kvc_seq_len(a, b);
  const long long pos = len - a.L + i;
  for (int d = tid; d < a.Dk; d += GEN_THREADS) qs[d] = kvc_load(kvc_q_at(a, b, h, i, d), a.q_dtype);
  const int32_t segp = kvc_seg_of_row(a, b, pos);
  __syncthreads();

  float m = -INFINITY, l = 0.0f; /* natural units */
  float o[GEN_DV_PER_THREAD];
#pragma unroll
  for (int k = 0; k < GEN_DV_PER_THREAD; ++k) o[k] = 0.0f;

  for (long long t0 = 0; t0 < len; t0 += GEN_THREADS) {
    const long long t = t0 + tid;
    float x = -INFINITY;
    bool vis = t < len;
    if (vis && kvc_causal_family(a)) vis = kvc_causal_visible(a, b, t, pos, segp, len);
    float add = 0.0f;
    if (vis && a.mask_kind == KVA_MASK_ARRAY) {
      const char *e = kvc_mask_at(a, b, h, i, t);
      if (a.mask_dtype == KVA_BOOL) vis = *(const uint8_t *)e != 0;
      else add = kvc_load(e, a.mask_dtype);
    }
    if (vis) {
      float dot = 0.0f;
      for (int d = 0; d < a.Dk; ++d) dot = fmaf(qs[d], kvc_kv_elem(a.k, b, hk, t, d), dot);
      x = kvc_logit(a, dot) + add;
      if (x == -INFINITY) vis = false;
    }
    const float tmax = gen_block_reduce<true>(vis ? x : -INFINITY, red);
    const float mn = kvc_max(m, tmax);
    if (mn == -INFINITY) continue; /* nothing visible yet: uniform over the block */
    const float corr = expf(m - mn); /* 0 when m = -inf */
    const float p = vis ? expf(x - mn) : 0.0f;
    ps[tid] = p;
    vis_s[tid] = vis;
    const float tsum = gen_block_reduce<false>(p, red); /* its barriers publish ps, vis_s */
    l = l * corr + tsum;
    const int nt = (int)min((long long)GEN_THREADS, len - t0);
#pragma unroll
    for (int k = 0; k < GEN_DV_PER_THREAD; ++k) {
      const int d = tid + k * GEN_THREADS;
      if (d >= a.Dv) break;
      float acc = o[k] * corr;
      for (int tt = 0; tt < nt; ++tt)
        if (vis_s[tt]) acc = fmaf(ps[tt], kvc_kv_elem(a.v, b, hk, t0 + tt, d), acc);
      o[k] = acc;
    }
    m = mn;
    __syncthreads(); /* ps / vis_s are rewritten next tile */
  }
  if (a.sinks && m != -INFINITY) { /* the sink joins the denominator only */
    float z = a.sinks[h], mn, f1, f2;
    kva_softmax_factors(m, z, &mn, &f1, &f2);
    m = mn;
    l = l * f1 + f2;
#pragma unroll
    for (int k = 0; k < GEN_DV_PER_THREAD; ++k) o[k] *= f1;
  }
#pragma unroll
  for (int k = 0; k < GEN_DV_PER_THREAD; ++k) {
    const int d = tid + k * GEN_THREADS;
    if (d < a.Dv) kvc_store(kvc_out_at(a, b, h, i, d), a.out_dtype, kvc_finish(o[k], l));
  }
  if (a.lse && tid == 0) kvc_store_lse_ln(a, b, h, i, m, l); /* natural-log m, sink joined */
}

int kvc_launch_generic(const kvc_args &a, cudaStream_t stream) {
  if (a.Dv > GEN_MAX_DV)
    return kva_seterr(KVA_EUNSUPPORTED, "CUDA general path: Dv = %d > %d", a.Dv, GEN_MAX_DV);
  size_t smem = sizeof(float) * (a.Dk + GEN_THREADS + GEN_WARPS) + sizeof(int) * GEN_THREADS;
  dim3 grid(a.L, a.H, a.B);
  kvc_generic_kernel<<<grid, GEN_THREADS, smem, stream>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return kva_seterr(KVA_ECUDA, "general attention kernel launch: %s", cudaGetErrorString(e));
  return 0;
}
