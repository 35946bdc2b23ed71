/* Merge of the fused kernel's split states (flash-decoding's second pass).
 *   math: per query row, the nsplit states {m_s, l_s, o_s[Dv]} of
 *         core/softmax_state.h fold into M = max_s m_s (NaN-propagating),
 *         w_s = exp(m_s - M) (0 for an empty split, whose o_s is 0), l = sum_s w_s l_s,
 *         o = sum_s w_s o_s, the same result as folding them pairwise with
 *         kva_softmax_merge, computed in parallel; the sink then joins with
 *         kva_softmax_factors and out = o / l (0 for a row that saw no key).
 *   memory: reads nsplit * (Dv + 2) floats per query row, writes Dv outputs.
 *   launch: grid (L, H, B), MERGE_THREADS threads, launched as a programmatic
 *         dependent of the fused kernel (sm_90); splits spread over the
 *         threads for M and the weights (dynamic shared memory: nsplit
 *         floats), then output dims over the threads, splits in a loop. */
#include "cuda/launch.cuh"

#define MERGE_THREADS 128
#define MERGE_WARPS (MERGE_THREADS / KVC_WARP)
#define MERGE_MAX_DV 512
#define MERGE_DV_PER_THREAD (MERGE_MAX_DV / MERGE_THREADS)
static constexpr int merge_unroll = 8; /* split loads in flight per thread */

template <bool IS_MAX> __device__ float merge_block_reduce(float x, float *red) {
  for (int off = KVC_WARP / 2; off > 0; off >>= 1) {
    const float y = __shfl_xor_sync(KVC_FULL_MASK, x, off);
    x = IS_MAX ? kvc_max(x, y) : x + y;
  }
  __syncthreads(); /* red[] may still be read by an earlier reduction */
  if (threadIdx.x % KVC_WARP == 0) red[threadIdx.x / KVC_WARP] = x;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < MERGE_WARPS; ++w) r = IS_MAX ? kvc_max(r, red[w]) : r + red[w];
  return r;
}

__global__ void __launch_bounds__(MERGE_THREADS) kvc_merge_kernel(const kvc_args a) {
  extern __shared__ float merge_w[]; /* [nsplit] weights w_s */
  __shared__ float red[MERGE_WARPS];
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize(); /* launched early (PDL): wait for the split states */
#endif
  const size_t split_stride = (size_t)a.B * a.H * a.L * KVA_STATE_FLOATS(a.Dv); /* floats */
  const float *st0 = kvc_state_at(a, 0, b, h, i);
  float mloc = -INFINITY;
  for (int s = tid; s < a.nsplit; s += MERGE_THREADS) mloc = kvc_max(mloc, st0[s * split_stride]);
  const float M = merge_block_reduce<true>(mloc, red);
  float lloc = 0.0f;
  for (int s = tid; s < a.nsplit; s += MERGE_THREADS) {
    const float ms = st0[s * split_stride];
    const float w = ms == -INFINITY ? 0.0f : expf(ms - M); /* NaN when M is NaN */
    merge_w[s] = w;
    lloc += w * st0[s * split_stride + 1];
  }
  const int padded = (a.nsplit + merge_unroll - 1) / merge_unroll * merge_unroll;
  for (int s = a.nsplit + tid; s < padded; s += MERGE_THREADS) merge_w[s] = 0.0f;
  float Ls = merge_block_reduce<false>(lloc, red); /* its barriers publish merge_w */
  float O[MERGE_DV_PER_THREAD];
#pragma unroll
  for (int k = 0; k < MERGE_DV_PER_THREAD; ++k) {
    const int d = tid + k * MERGE_THREADS;
    float acc = 0.0f;
    if (d < a.Dv && M != -INFINITY) {
#pragma unroll merge_unroll
      for (int s = 0; s < a.nsplit; ++s) acc = fmaf(merge_w[s], st0[s * split_stride + 2 + d], acc);
    }
    O[k] = acc;
  }
  if (a.sinks && M != -INFINITY) {
    float mn, f1, f2;
    kva_softmax_factors(M, a.sinks[h], &mn, &f1, &f2);
    Ls = Ls * f1 + f2;
#pragma unroll
    for (int k = 0; k < MERGE_DV_PER_THREAD; ++k) O[k] *= f1;
  }
  if (M == -INFINITY) Ls = 0.0f; /* no key visible in any split: zeros */
#pragma unroll
  for (int k = 0; k < MERGE_DV_PER_THREAD; ++k) {
    const int d = tid + k * MERGE_THREADS;
    if (d < a.Dv) kvc_store(kvc_out_at(a, b, h, i, d), a.out_dtype, kvc_finish(O[k], Ls));
  }
}

int kvc_launch_merge(const kvc_args &a, cudaStream_t stream) {
  if (a.Dv > MERGE_MAX_DV)
    return kva_seterr(KVA_EUNSUPPORTED, "CUDA merge: Dv = %d > %d", a.Dv, MERGE_MAX_DV);
  dim3 grid(a.L, a.H, a.B);
  /* whole unrolled groups of weights: the unrolled loop may read them as vectors */
  const size_t nw = (size_t)(a.nsplit + merge_unroll - 1) / merge_unroll * merge_unroll;
  /* programmatic dependent launch: the launch overlaps the fused kernel's tail */
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(MERGE_THREADS);
  cfg.dynamicSmemBytes = sizeof(float) * nw;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kvc_merge_kernel, a);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) return kva_seterr(KVA_ECUDA, "merge kernel launch: %s", cudaGetErrorString(e));
  return 0;
}
