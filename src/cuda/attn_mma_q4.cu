/* Tensor-core decode/verify kernel over 4-bit MLX-affine K/V with bf16
 * scales and biases (contiguous layout, bf16 queries, Dk = Dv = D in {64, 128, 256}, group % 32 == 0,
 * causal-family masks, L <= 16), split over token blocks like the fused
 * kernel and merged by the same merge launch (attn_merge.cu).
 *   math: per warp tile of 16 tokens, K and V rows are dequantized to bf16 in
 *         registers (code -> bf16 by LOP3 under the 2^7 exponent: (128 + c),
 *         minus 128 exactly, then scale * c + bias in one bf16x2 FMA) and
 *         stored to the warp's shared tile; S^T = K Q^T with mma.sync
 *         m16n8k16 (tokens as M, the block's 8 query vectors as N, f32
 *         accumulation), online softmax in f32 per query column (log2 units),
 *         P rounded to bf16 (l sums the rounded P), O^T += V^T P^T with the
 *         same mma (head dims as M, tokens as K), f32 accumulators.
 *         Products are bf16 x bf16: K, V and P carry bf16 rounding (2^-9
 *         relative), so tests compare this path at the bf16 allowance.
 *         Dims are permuted inside each 8-dim block (smem column p holds dim
 *         (p >> 1) + 4 (p & 1)); Q fragments and the output use the same map.
 *   memory: every K/V byte of a (sequence, KV head) is read once per block of
 *         8 query vectors (qtiles = ceil(rep * L / 8)); one 16-byte load per
 *         lane and row chunk plus the chunk's scale and bias; the next tile's
 *         loads are issued right after this tile is staged in shared memory,
 *         so they overlap its mma and softmax work.
 *   launch: grid (qtiles, nsplit, B * KVH), KVC_MMA_THREADS threads; warp w
 *         takes tiles t_lo + 16 (4 k + w); dynamic shared memory: per warp a
 *         K tile, a V tile (16 x (D + 8) bf16) and P (8 x 24 bf16), reused
 *         for the cross-warp merge after the loop. */
#include "cuda/attn_fused.cuh" /* kvc_exp2, kvc_factors2 */

/* ---- tiling constants ---- */
#define KVC_MMA_TOK 16      /* tokens per warp tile (mma M of S^T, K of O^T) */
#define KVC_MMA_PAD 8       /* bf16 padding per smem row: ldmatrix rows hit distinct banks */
#define KVC_MMA_PS_STRIDE 24 /* bf16 per P row (8 query rows x 16 tokens, conflict-free reads) */
#define KVC_Q4_DIMS_PER_CHUNK 32 /* dims in one 16-byte load of packed 4-bit codes */
#define KVC_DIMS_PER_WORD 8
/* bf16x2 constants (both halves) */
#define KVC_BF16X2_128 0x43004300u  /* 128.0: codes OR'ed into its mantissa are 128 + c */
#define KVC_BF16X2_ONE 0x3F803F80u
#define KVC_BF16X2_M128 0xC300C300u /* -128.0 */
#define KVC_NIB_PAIR 0x000F000Fu    /* a code in each 16-bit half */

template <int D> struct kvc_mma_cfg {
  static constexpr int ROW_BYTES = D / 2;                    /* packed 4-bit row */
  static constexpr int CPR = ROW_BYTES / 16;                 /* 16-byte chunks per row */
  static constexpr int RPP = KVC_WARP / CPR;                 /* rows per load pass of a warp */
  static constexpr int PASSES = KVC_MMA_TOK / RPP;           /* loads per lane per operand and tile */
  static constexpr int RS = D + KVC_MMA_PAD;                 /* smem row stride (bf16) */
  static constexpr int KS = D / 16;                          /* mma k-steps of S, m-tiles of O */
  static constexpr int TILE = KVC_MMA_TOK * RS;              /* bf16 per operand tile */
  static constexpr int WARP_ELEMS = 2 * TILE + KVC_MMA_QN * KVC_MMA_PS_STRIDE; /* bf16 per warp */
  static constexpr size_t LOOP_BYTES = (size_t)KVC_MMA_WARPS * WARP_ELEMS * 2;
  static constexpr size_t MERGE_BYTES = (size_t)KVC_MMA_WARPS * KVC_MMA_QN * (D + 2) * 4;
  static constexpr size_t SMEM = LOOP_BYTES > MERGE_BYTES ? LOOP_BYTES : MERGE_BYTES;
};

/* ---- PTX helpers ---- */
__device__ __forceinline__ uint32_t kvc_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d; /* (a & b) | c in one LOP3 */
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t kvc_fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ void kvc_ldsm_x4(uint32_t (&r)[4], const __nv_bfloat16 *p) {
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void kvc_ldsm_x4_trans(uint32_t (&r)[4], const __nv_bfloat16 *p) {
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
/* d += a (16x16, row) * b (16x8, col), bf16 operands, f32 accumulators. */
__device__ __forceinline__ void kvc_mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* One word of 8 codes -> 4 bf16x2 of scale * code + bias, holding the dims
 * (0, 4), (1, 5), (2, 6), (3, 7) of the word. */
__device__ __forceinline__ uint4 kvc_q4_word_bf16(uint32_t w, uint32_t s2, uint32_t b2) {
  uint32_t r[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t x = kvc_and_or(w >> (4 * k), KVC_NIB_PAIR, KVC_BF16X2_128); /* 128 + c, exact */
    const uint32_t c = kvc_fma_bf16x2(x, KVC_BF16X2_ONE, KVC_BF16X2_M128);     /* c, exact */
    r[k] = kvc_fma_bf16x2(c, s2, b2);                                          /* s c + b, one rounding */
  }
  return make_uint4(r[0], r[1], r[2], r[3]);
}
/* The head dim held by permuted smem column p (see the header). */
__device__ __forceinline__ int kvc_mma_dim(int p) { return (p & ~7) + ((p & 7) >> 1) + 4 * (p & 1); }

/* Raw bits of one lane's share of a 16-token tile: K and V chunks, their scales and biases. */
template <int D> struct kvc_mma_raw {
  uint4 kw[kvc_mma_cfg<D>::PASSES], vw[kvc_mma_cfg<D>::PASSES];
  uint32_t ks[kvc_mma_cfg<D>::PASSES], kb[kvc_mma_cfg<D>::PASSES];
  uint32_t vs[kvc_mma_cfg<D>::PASSES], vb[kvc_mma_cfg<D>::PASSES];
};

/* bf16 scale/bias bits at p. */
__device__ __forceinline__ uint32_t kvc_ld_scale_bits(const char *p) { return __ldg((const unsigned short *)p); }

template <int D>
__global__ void __launch_bounds__(KVC_MMA_THREADS, kvc_mma_min_blocks(D)) kvc_mma_q4_kernel(const kvc_args a) {
  typedef kvc_mma_cfg<D> C;
  extern __shared__ __align__(16) unsigned char kvc_mma_smem[];
  const int lane = threadIdx.x % KVC_WARP, warp = threadIdx.x / KVC_WARP;
  const int g = lane >> 2, tq = lane & 3; /* mma fragment row group and thread-in-group */
  const int qtile = blockIdx.x, split = blockIdx.y;
  const int b = blockIdx.z / a.KVH, hk = blockIdx.z % a.KVH;
  const long long len = kvc_seq_len(a, b);
  const int Q = a.rep * a.L;
  __nv_bfloat16 *ks = (__nv_bfloat16 *)kvc_mma_smem + warp * C::WARP_ELEMS;
  __nv_bfloat16 *vs = ks + C::TILE;
  __nv_bfloat16 *ps = vs + C::TILE;

  /* B fragments of Q^T (query column g of the block), in the permuted dim order */
  uint32_t qf[C::KS][2];
  {
    const int qv = qtile * KVC_MMA_QN + g;
    const bool ok = qv < Q;
    const int h = hk * a.rep + (ok ? qv / a.L : 0), i = ok ? qv % a.L : 0;
#pragma unroll
    for (int kk = 0; kk < C::KS; ++kk)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d0 = 16 * kk + 8 * half + tq; /* smem columns 2tq, 2tq + 1 -> dims tq, tq + 4 */
        const uint32_t lo = ok ? *(const unsigned short *)kvc_q_at(a, b, h, i, d0) : 0u;
        const uint32_t hi = ok ? *(const unsigned short *)kvc_q_at(a, b, h, i, d0 + 4) : 0u;
        qf[kk][half] = lo | (hi << 16);
      }
  }
  /* this thread's two query columns 2tq, 2tq + 1 */
  bool qok[2];
  long long pos[2];
  int32_t segp[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int qv = qtile * KVC_MMA_QN + 2 * tq + j;
    qok[j] = qv < Q;
    pos[j] = len - a.L + (qok[j] ? qv % a.L : 0);
    segp[j] = qok[j] ? kvc_seg_of_row(a, b, pos[j]) : 0;
  }

  long long t_lo = (long long)split * a.chunk, t_hi = min(t_lo + a.chunk, len);
  if (a.mask_kind == KVA_MASK_CAUSAL && a.window > 0 && !a.seg) /* keys before row 0's window */
    t_lo = max(t_lo, len - a.L - a.window + 1);

  /* this lane's load slots: chunk cc of rows r0 + RPP p */
  const int cc = lane % C::CPR, r0 = lane / C::CPR;
  const int kes = kvc_dtype_size(KVA_BF16), ves = kes;
  const char *kdat = kvc_row(a.k, b, hk, 0) + cc * 16, *vdat = kvc_row(a.v, b, hk, 0) + cc * 16;
  const char *ksc = kvc_srow(a.k, b, hk, 0) + (cc * KVC_Q4_DIMS_PER_CHUNK / a.k.group) * kes;
  const char *kbi = kvc_brow(a.k, b, hk, 0) + (cc * KVC_Q4_DIMS_PER_CHUNK / a.k.group) * kes;
  const char *vsc = kvc_srow(a.v, b, hk, 0) + (cc * KVC_Q4_DIMS_PER_CHUNK / a.v.group) * ves;
  const char *vbi = kvc_brow(a.v, b, hk, 0) + (cc * KVC_Q4_DIMS_PER_CHUNK / a.v.group) * ves;
  const long long kds = a.k.ds[2], vds = a.v.ds[2];
  const long long kss = a.k.ss[2], kbs = a.k.bs[2], vss = a.v.ss[2], vbs = a.v.bs[2];

  typedef kvc_mma_raw<D> R;
  auto load = [&](R &r, long long t0) {
#pragma unroll
    for (int p = 0; p < C::PASSES; ++p) {
      const long long t = t0 + r0 + p * C::RPP;
      if (t < t_hi) {
        r.kw[p] = __ldg((const uint4 *)(kdat + t * kds));
        r.vw[p] = __ldg((const uint4 *)(vdat + t * vds));
        r.ks[p] = kvc_ld_scale_bits(ksc + t * kss);
        r.kb[p] = kvc_ld_scale_bits(kbi + t * kbs);
        r.vs[p] = kvc_ld_scale_bits(vsc + t * vss);
        r.vb[p] = kvc_ld_scale_bits(vbi + t * vbs);
      } else { /* past the split or the sequence: never read; zeros dequantize to 0 */
        r.kw[p] = r.vw[p] = make_uint4(0, 0, 0, 0);
        r.ks[p] = r.kb[p] = r.vs[p] = r.vb[p] = 0;
      }
    }
  };
  /* dequantize the loaded tile into the warp's K and V tiles */
  auto stage = [&](const R &r) {
#pragma unroll
    for (int p = 0; p < C::PASSES; ++p) {
      const int row = r0 + p * C::RPP;
      uint4 *kd = (uint4 *)(ks + row * C::RS + cc * KVC_Q4_DIMS_PER_CHUNK);
      uint4 *vd = (uint4 *)(vs + row * C::RS + cc * KVC_Q4_DIMS_PER_CHUNK);
      const uint32_t ks2 = r.ks[p] | (r.ks[p] << 16), kb2 = r.kb[p] | (r.kb[p] << 16); /* bf16 bits, splat */
      const uint32_t vs2 = r.vs[p] | (r.vs[p] << 16), vb2 = r.vb[p] | (r.vb[p] << 16);
      kd[0] = kvc_q4_word_bf16(r.kw[p].x, ks2, kb2);
      kd[1] = kvc_q4_word_bf16(r.kw[p].y, ks2, kb2);
      kd[2] = kvc_q4_word_bf16(r.kw[p].z, ks2, kb2);
      kd[3] = kvc_q4_word_bf16(r.kw[p].w, ks2, kb2);
      vd[0] = kvc_q4_word_bf16(r.vw[p].x, vs2, vb2);
      vd[1] = kvc_q4_word_bf16(r.vw[p].y, vs2, vb2);
      vd[2] = kvc_q4_word_bf16(r.vw[p].z, vs2, vb2);
      vd[3] = kvc_q4_word_bf16(r.vw[p].w, vs2, vb2);
    }
  };

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float acc[C::KS][4];
#pragma unroll
  for (int mt = 0; mt < C::KS; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;

  /* ldmatrix row addresses of this lane: matrix j = lane / 8, its row lane % 8 */
  const int lj = lane >> 3, lr = lane & 7;
  const __nv_bfloat16 *ka = ks + (lr + 8 * (lj & 1)) * C::RS + 8 * (lj >> 1); /* A = K tile (tokens x dims) */
  const __nv_bfloat16 *va = vs + (lr + 8 * (lj >> 1)) * C::RS + 8 * (lj & 1); /* A = V^T via .trans */

  const long long step = (long long)KVC_MMA_WARPS * KVC_MMA_TOK;
  R raw;
  long long t0 = t_lo + warp * KVC_MMA_TOK;
  if (t0 < t_hi) load(raw, t0);
  for (; t0 < t_hi; t0 += step) {
    stage(raw);
    __syncwarp();
    if (t0 + step < t_hi) load(raw, t0 + step); /* in flight during this tile's math */
    /* S^T = K Q^T: c0 (token g, query 2tq), c1 (g, 2tq + 1), c2 (g + 8, 2tq), c3 (g + 8, 2tq + 1) */
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s2[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* even / odd k-steps */
#pragma unroll
    for (int kk = 0; kk < C::KS; kk += 2) {
      uint32_t af[4], bf[4];
      kvc_ldsm_x4(af, ka + 16 * kk);
      kvc_ldsm_x4(bf, ka + 16 * (kk + 1));
      kvc_mma_bf16(s, af, qf[kk][0], qf[kk][1]);
      kvc_mma_bf16(s2, bf, qf[kk + 1][0], qf[kk + 1][1]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] += s2[e];
    /* masks, logits (log2 units), online softmax per query column */
    bool vis[4];
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = e & 1;
      const long long t = t0 + g + 8 * (e >> 1);
      bool v = t < t_hi && qok[j];
      if (v && a.mask_kind == KVA_MASK_CAUSAL) v = kvc_causal_visible(a, b, t, pos[j], segp[j]);
      const float xl = v ? kvc_logit(a, s[e]) * KVC_LOG2E : -INFINITY;
      vis[e] = v && xl != -INFINITY;
      s[e] = xl;
      mx[j] = kvc_max(mx[j], xl);
    }
#pragma unroll
    for (int off = 4; off < KVC_WARP; off <<= 1)
#pragma unroll
      for (int j = 0; j < 2; ++j) mx[j] = kvc_max(mx[j], __shfl_xor_sync(KVC_FULL_MASK, mx[j], off));
    float corr[2] = {1.0f, 1.0f};
    bool grew = false;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float mn = kvc_max(m[j], mx[j]);
      if (mn != -INFINITY && !(mn == m[j])) { /* the max grew (or is NaN) */
        corr[j] = kvc_exp2(m[j] - mn);        /* 0 when m = -inf */
        m[j] = mn;
        l[j] *= corr[j];
        grew = true;
      }
    }
    if (__any_sync(KVC_FULL_MASK, grew))
#pragma unroll
      for (int mt = 0; mt < C::KS; ++mt) {
        acc[mt][0] *= corr[0];
        acc[mt][1] *= corr[1];
        acc[mt][2] *= corr[0];
        acc[mt][3] *= corr[1];
      }
    /* P (bf16) to the warp's P tile [query][token]; l sums the rounded values */
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = e & 1;
      const float p = vis[e] ? kvc_exp2(s[e] - m[j]) : 0.0f;
      const __nv_bfloat16 pb = __float2bfloat16_rn(p);
      l[j] += __bfloat162float(pb);
      ps[(2 * tq + j) * KVC_MMA_PS_STRIDE + g + 8 * (e >> 1)] = pb;
    }
    __syncwarp();
    const uint32_t pb0 = *(const uint32_t *)(ps + g * KVC_MMA_PS_STRIDE + 2 * tq);
    const uint32_t pb1 = *(const uint32_t *)(ps + g * KVC_MMA_PS_STRIDE + 2 * tq + 8);
    /* O^T += V^T P^T: acc[mt] c0 (dim col 16 mt + g, query 2tq), c1 (.., 2tq + 1), c2/c3 (dim + 8) */
#pragma unroll
    for (int mt = 0; mt < C::KS; ++mt) {
      uint32_t af[4];
      kvc_ldsm_x4_trans(af, va + 16 * mt);
      kvc_mma_bf16(acc[mt], af, pb0, pb1);
    }
    __syncwarp(); /* the next stage overwrites the tiles */
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion(); /* the merge waits for this grid's completion */
#endif
  /* l: sum over the 8 lanes of a query column (same m) */
#pragma unroll
  for (int off = 4; off < KVC_WARP; off <<= 1)
#pragma unroll
    for (int j = 0; j < 2; ++j) l[j] += __shfl_xor_sync(KVC_FULL_MASK, l[j], off);

  /* merge the warps in shared memory (the tiles' space), in a fixed order */
  __syncthreads();
  float *sm_o = (float *)kvc_mma_smem;                     /* [warp][query][D] */
  float *sm_ml = sm_o + KVC_MMA_WARPS * KVC_MMA_QN * D;    /* [warp][query][2] */
#pragma unroll
  for (int mt = 0; mt < C::KS; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = kvc_mma_dim(16 * mt + g + 8 * (e >> 1)), q = 2 * tq + (e & 1);
      sm_o[(warp * KVC_MMA_QN + q) * D + d] = acc[mt][e];
    }
  if (g == 0)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      sm_ml[(warp * KVC_MMA_QN + 2 * tq + j) * 2] = m[j];
      sm_ml[(warp * KVC_MMA_QN + 2 * tq + j) * 2 + 1] = l[j];
    }
  __syncthreads();
  for (int idx = threadIdx.x; idx < KVC_MMA_QN * D; idx += KVC_MMA_THREADS) {
    const int j = idx / D, d = idx % D, qv = qtile * KVC_MMA_QN + j;
    if (qv >= Q) continue;
    float M = -INFINITY, Ls = 0.0f, O = 0.0f;
    for (int w = 0; w < KVC_MMA_WARPS; ++w) {
      float mn, f1, f2;
      kvc_factors2(M, sm_ml[(w * KVC_MMA_QN + j) * 2], mn, f1, f2);
      M = mn;
      Ls = Ls * f1 + sm_ml[(w * KVC_MMA_QN + j) * 2 + 1] * f2;
      O = O * f1 + sm_o[(w * KVC_MMA_QN + j) * D + d] * f2;
    }
    kvc_emit(a, split, b, hk, qv, d, M, Ls, O);
  }
}

/* Opts the instance into its dynamic shared memory (idempotent host call). */
template <int D> static cudaError_t kvc_mma_prepare(void) {
  return cudaFuncSetAttribute(kvc_mma_q4_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              (int)kvc_mma_cfg<D>::SMEM);
}

int kvc_mma_occupancy(int D) {
  int n = 0;
  cudaError_t e = cudaErrorInvalidValue;
#define KVC_OCC(D_)                                                                                \
  if (D == D_ && (e = kvc_mma_prepare<D_>()) == cudaSuccess)                                       \
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kvc_mma_q4_kernel<D_>, KVC_MMA_THREADS,  \
                                                      kvc_mma_cfg<D_>::SMEM);
  KVC_OCC(64) KVC_OCC(128) KVC_OCC(256)
#undef KVC_OCC
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

int kvc_launch_mma(const kvc_args &a, const kvc_plan &plan, cudaStream_t stream) {
  dim3 grid(plan.qtiles, plan.nsplit, a.B * a.KVH);
  cudaError_t e = cudaErrorInvalidValue;
#define KVC_CASE(D_)                                                                               \
  if (a.Dk == D_ && (e = kvc_mma_prepare<D_>()) == cudaSuccess) {                                  \
    kvc_mma_q4_kernel<D_><<<grid, KVC_MMA_THREADS, kvc_mma_cfg<D_>::SMEM, stream>>>(a);             \
    e = cudaGetLastError();                                                                        \
  }
  KVC_CASE(64) KVC_CASE(128) KVC_CASE(256)
#undef KVC_CASE
  if (e != cudaSuccess) return kva_seterr(KVA_ECUDA, "q4 mma attention kernel (D = %d): %s", a.Dk, cudaGetErrorString(e));
  return 0;
}
