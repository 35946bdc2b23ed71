/* Merge of the split states (flash-decoding's second pass).
 *   math: per query row, the nsplit states {m_s, l_s, o_s[Dv]} of
 *         core/softmax_state.h fold into one with kva_softmax_factors
 *         (M = max_s m_s, NaN-propagating; l = sum_s exp(m_s - M) l_s;
 *         o = sum_s exp(m_s - M) o_s; an empty split, m_s = -inf, adds
 *         nothing); the sink then joins and out = o / l (0 for a row that
 *         saw no key). The folding order differs from a pairwise left fold
 *         only by rounding.
 *   memory: reads nsplit * (Dv + 2) floats per query row (from L2: the split
 *         kernel wrote them just before), writes Dv outputs.
 *   launch: grid (L * ceil(Dv / MERGE_DIMS), H, B), MERGE_THREADS threads,
 *         launched as a programmatic dependent of the split kernel (sm_90).
 *         A block takes MERGE_DIMS output dims of one row: thread (r, c)
 *         takes splits r, r + MERGE_ROWS, ... for dims 4c .. 4c + 3 of the
 *         slice, merge_chunk of them at a time: their loads all issued
 *         before any is used (one round trip to L2 per chunk: one in all
 *         for up to MERGE_ROWS * merge_chunk = 64 splits), the chunk's max,
 *         weights and sums, one fold per chunk; then the MERGE_ROWS partial
 *         states of a dim fold in a fixed order through shared memory: one
 *         barrier, no second pass over the splits. A rotated output
 *         (a.rot_out) takes this merge as it is: the split kernels store
 *         rotated states (H o_s; kvc_emit_block), and the merge is linear
 *         in them, so it yields H o / l. */
#include "cuda/launch.cuh"

#define MERGE_THREADS 128
#define MERGE_DIMS KVC_MERGE_DIMS               /* output dims per block (launch.cuh) */
#define MERGE_COLS (MERGE_DIMS / 4)             /* threads per split row: 4 dims each */
#define MERGE_ROWS (MERGE_THREADS / MERGE_COLS) /* split rows folded in parallel */
static constexpr int merge_chunk = 8;           /* splits per thread loaded together */

/* state (m, l, o[0..3]) <- fold with (ms, ls, os[0..3]) */
__device__ __forceinline__ void merge_fold(float &m, float &l, float (&o)[4], float ms, float ls, const float (&os)[4]) {
  if (ms == -INFINITY) return; /* empty: nothing to add */
  float mn, f1, f2;
  kva_softmax_factors(m, ms, &mn, &f1, &f2);
  m = mn;
  l = l * f1 + ls * f2;
#pragma unroll
  for (int j = 0; j < 4; ++j) o[j] = o[j] * f1 + os[j] * f2;
}

/* Splits s0, s0 + step, .., s0 + (merge_chunk - 1) step (those below nsplit)
 * of dims d0 .. d0 + nd - 1 (nd <= 4) folded into the running (m, l, o):
 * the chunk's loads all issued before its max and weighted sums. */
__device__ __forceinline__ void merge_chunk_fold(const float *st0, size_t split_stride, int s0, int step, int nsplit,
                                                 int d0, int nd, float &m, float &l, float (&o)[4]) {
  float cm[merge_chunk], cl[merge_chunk], co[merge_chunk][4];
#pragma unroll
  for (int k = 0; k < merge_chunk; ++k) {
    const int sk = s0 + step * k;
    const float *st = st0 + (size_t)sk * split_stride;
    const bool ok = sk < nsplit;
    cm[k] = ok ? st[0] : -INFINITY;
    cl[k] = ok ? st[1] : 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) co[k][j] = ok && j < nd ? st[2 + d0 + j] : 0.0f;
  }
  float M = cm[0];
#pragma unroll
  for (int k = 1; k < merge_chunk; ++k) M = kvc_max(M, cm[k]);
  float L = 0.0f, O[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (M != -INFINITY) {
#pragma unroll
    for (int k = 0; k < merge_chunk; ++k) {
      const float w = cm[k] == -INFINITY ? 0.0f : expf(cm[k] - M); /* NaN when M is NaN */
      L = fmaf(w, cl[k], L);
#pragma unroll
      for (int j = 0; j < 4; ++j) O[j] = fmaf(w, co[k][j], O[j]);
    }
  }
  merge_fold(m, l, o, M, L, O);
}

/* One output element from the rows' partial states (po[k * ps], pm[k],
 * pl[k], k < rows, folded in a fixed order), the sink joined: o / l, or 0
 * when no split saw a key; M and Ls the final state (for lse). */
__device__ __forceinline__ float merge_rows_out(const float *po, int ps, const float *pm, const float *pl, int rows,
                                                const float *sinks, int h, float &M, float &Ls) {
  M = -INFINITY, Ls = 0.0f;
  float O[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int k = 0; k < rows; ++k) {
    const float os[4] = {po[k * ps], 0.0f, 0.0f, 0.0f};
    merge_fold(M, Ls, O, pm[k], pl[k], os);
  }
  float Od = O[0];
  if (sinks && M != -INFINITY) {
    float mn, f1, f2;
    kva_softmax_factors(M, sinks[h], &mn, &f1, &f2);
    M = mn;
    Ls = Ls * f1 + f2;
    Od *= f1;
  }
  if (M == -INFINITY) Ls = 0.0f; /* no key visible in any split: zeros */
  return kvc_finish(Od, Ls);
}

__global__ void __launch_bounds__(MERGE_THREADS) kvc_merge_kernel(const kvc_args a) {
  __shared__ float part_m[MERGE_ROWS], part_l[MERGE_ROWS], part_o[MERGE_ROWS][MERGE_DIMS + 1];
  const int nch = (a.Dv + MERGE_DIMS - 1) / MERGE_DIMS;
  const int i = blockIdx.x / nch, d_lo = (blockIdx.x % nch) * MERGE_DIMS;
  const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize(); /* launched early (PDL): wait for the split states */
#endif
  const size_t split_stride = (size_t)a.B * a.H * a.L * KVA_STATE_FLOATS(a.Dv); /* floats */
  const float *st0 = kvc_state_at(a, 0, b, h, i);
  const int r = tid / MERGE_COLS, c = tid % MERGE_COLS, d0 = d_lo + 4 * c;
  const int nd = min(4, a.Dv - d0); /* dims of this thread (<= 0: none, its m and l still count) */
  float m = -INFINITY, l = 0.0f, o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int s0 = r; s0 < a.nsplit; s0 += MERGE_ROWS * merge_chunk) {
    /* a chunk of this thread's splits: all loads first, then its max and
     * independent weights (no exp chain from split to split) */
    merge_chunk_fold(st0, split_stride, s0, MERGE_ROWS, a.nsplit, d0, nd, m, l, o);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) part_o[r][4 * c + j] = o[j];
  if (c == 0) {
    part_m[r] = m;
    part_l[r] = l;
  }
  __syncthreads();
  const int d = d_lo + tid;
  if (tid >= MERGE_DIMS || d >= a.Dv) return;
  float M, Ls;
  const float od = merge_rows_out(&part_o[0][tid], MERGE_DIMS + 1, part_m, part_l, MERGE_ROWS, a.sinks, h, M, Ls);
  kvc_store(kvc_out_at(a, b, h, i, d), a.out_dtype, od);
  if (a.lse && d == 0) kvc_store_lse_ln(a, b, h, i, M, Ls); /* the states' m is natural-log */
}

int kvc_launch_merge(const kvc_args &a, cudaStream_t stream) {
  dim3 grid(a.L * ((a.Dv + MERGE_DIMS - 1) / MERGE_DIMS), a.H, a.B);
  /* programmatic dependent launch: the launch overlaps the split kernel's tail */
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(MERGE_THREADS);
  cfg.dynamicSmemBytes = 0;
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
