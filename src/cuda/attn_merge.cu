/* Merge of the split states (flash-decoding's second pass).
 *   math: per query row, the nsplit states {m_s, l_s, o_s[Dv]} of
 *         core/softmax_state.h fold into M = max_s m_s (NaN-propagating),
 *         w_s = exp(m_s - M) (0 for an empty split, whose o_s is 0), l = sum_s w_s l_s,
 *         o = sum_s w_s o_s, the same result as folding them pairwise with
 *         kva_softmax_merge up to rounding; the sink then joins with
 *         kva_softmax_factors and out = o / l (0 for a row that saw no key).
 *   memory: reads nsplit * (Dv + 2) floats per query row (from L2: the split
 *         kernel wrote them just before), writes Dv outputs.
 *   launch: grid (L * ceil(Dv / MERGE_DIMS), H, B), MERGE_THREADS threads,
 *         launched as a programmatic dependent of the split kernel (sm_90).
 *         Each block takes MERGE_DIMS output dims of one row: M, the
 *         weights (dynamic shared memory, nsplit floats) and l over the
 *         threads (every block of the row computes them again: 2 nsplit
 *         floats), then thread (r, c) sums splits r, r + MERGE_ROWS, ... for
 *         dims 4c .. 4c + 3 of the block's slice, all its loads independent
 *         (the states come from L2: latency, not bandwidth, is what a
 *         serial split loop would pay), and the MERGE_ROWS partial sums
 *         are added in a fixed order. */
#include "cuda/launch.cuh"

#define MERGE_THREADS 128
#define MERGE_WARPS (MERGE_THREADS / KVC_WARP)
#define MERGE_DIMS 64                              /* output dims per block */
#define MERGE_COLS (MERGE_DIMS / 4)                /* threads per split row: 4 dims each */
#define MERGE_ROWS (MERGE_THREADS / MERGE_COLS)    /* splits summed in parallel */
static constexpr int merge_unroll = 4;             /* splits in flight per thread (x 4 dims) */

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
  __shared__ float part[MERGE_ROWS][MERGE_DIMS + 1];
  const int nch = (a.Dv + MERGE_DIMS - 1) / MERGE_DIMS;
  const int i = blockIdx.x / nch, d_lo = (blockIdx.x % nch) * MERGE_DIMS;
  const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
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
  float Ls = merge_block_reduce<false>(lloc, red); /* its barriers publish merge_w */

  /* o over the splits: thread (r, c) takes splits r + MERGE_ROWS k, dims d_lo + 4c + j */
  const int r = tid / MERGE_COLS, c = tid % MERGE_COLS, d0 = d_lo + 4 * c;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (M != -INFINITY && d0 < a.Dv) {
    const float *o = st0 + 2 + d0;
    if (d0 + 4 <= a.Dv) {
#pragma unroll merge_unroll
      for (int s = r; s < a.nsplit; s += MERGE_ROWS) {
        const float w = merge_w[s], *os = o + s * split_stride;
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[j] = fmaf(w, os[j], acc[j]);
      }
    } else {
      for (int s = r; s < a.nsplit; s += MERGE_ROWS)
        for (int j = 0; d0 + j < a.Dv; ++j) acc[j] = fmaf(merge_w[s], o[s * split_stride + j], acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) part[r][4 * c + j] = acc[j];
  __syncthreads();
  const int d = d_lo + tid;
  if (tid >= MERGE_DIMS || d >= a.Dv) return;
  float O = 0.0f;
#pragma unroll
  for (int k = 0; k < MERGE_ROWS; ++k) O += part[k][tid]; /* fixed order */
  if (a.sinks && M != -INFINITY) {
    float mn, f1, f2;
    kva_softmax_factors(M, a.sinks[h], &mn, &f1, &f2);
    Ls = Ls * f1 + f2;
    O *= f1;
  }
  if (M == -INFINITY) Ls = 0.0f; /* no key visible in any split: zeros */
  kvc_store(kvc_out_at(a, b, h, i, d), a.out_dtype, kvc_finish(O, Ls));
}

int kvc_launch_merge(const kvc_args &a, cudaStream_t stream) {
  dim3 grid(a.L * ((a.Dv + MERGE_DIMS - 1) / MERGE_DIMS), a.H, a.B);
  /* programmatic dependent launch: the launch overlaps the split kernel's tail */
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(MERGE_THREADS);
  cfg.dynamicSmemBytes = sizeof(float) * (size_t)a.nsplit;
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
