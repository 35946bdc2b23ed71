/* Staging of quantized or 16-bit K/V rows for the tensor-core kernels
 * (attn_tc.cu, attn_wg.cu): where a stage of 64 token rows comes from
 * (contiguous rows or a block table) and how it lands in shared memory
 * (raw rows with their scale and bias rows, by cp.async), apart from the
 * attention math. No kernels here. */
#ifndef KVA_CUDA_TC_STAGE_CUH
#define KVA_CUDA_TC_STAGE_CUH

#include "cuda/attn_fused.cuh" /* kvc_args helpers, kvc_exp2 */
#include "cuda/mma.cuh"

#define KVC_TC_TOK KVC_TC_STEP        /* tokens per stage (4 warps x 16) */
#define KVC_TC_ROWPAD 16              /* bytes after each raw row: conflict-free fragment reads */
/* 16-bit float K/V rows (bf16, f16): the rows are the mma operands, no scale rows. */
__host__ __device__ constexpr bool kvc_tc_float(int f) { return f == KVC_BF16 || f == KVC_F16; }
/* fp8 K/V rows (e4m3, e5m2): D code bytes a row, one f32 scale per row
 * (kvc_operand: strides 0 for one shared scale; scales NULL: none, scale 1,
 * nothing staged), no bias rows. */
__host__ __device__ constexpr bool kvc_tc_fp8(int f) { return f == KVC_E4M3 || f == KVC_E5M2; }
/* 16-byte pieces per row: D bytes of fp8 or q8 codes, D / 2 of q4, 2 D of bf16 / f16 */
__host__ __device__ constexpr int kvc_tc_cpr(int f, int D) {
  return kvc_tc_float(f) ? D / 8 : f == KVC_Q8 || kvc_tc_fp8(f) ? D / 16 : D / 32;
}
/* Codes (k, k + 4) of word w (k < 4) -> bf16x2 of scale * code + bias. */
__device__ __forceinline__ uint32_t kvc_deq_pair(uint32_t w, int k, uint32_t s2, uint32_t b2) {
  const uint32_t x = kvc_and_or(w >> (4 * k), KVC_NIB_PAIR, KVC_BF16X2_128); /* 128 + c, exact */
  const uint32_t c = kvc_fma_bf16x2(x, KVC_BF16X2_ONE, KVC_BF16X2_M128);     /* c, exact */
  return kvc_fma_bf16x2(c, s2, b2);                                          /* s c + b, one rounding */
}

/* Two fp8 codes of format F (low byte: element lo) -> bf16x2 of (sl code_lo,
 * sh code_hi): code to f16 exactly (one cvt for both), to f32, times the
 * row's f32 scale, rounded to bf16 (a NaN code stays NaN). */
template <int F> __device__ __forceinline__ uint32_t kvc_deq_fp8x2(uint32_t two, float sl, float sh) {
  const uint32_t h = kvc_fp8x2_f16x2<F == KVC_E4M3>(two);
  const float2 f = __half22float2(*(const __half2 *)&h);
  return kvc_bf16x2_of(f.x * sl, f.y * sh);
}
/* The f32 scale of staged row r (scale rows at offset off of stage st): 1
 * without scales. */
__device__ __forceinline__ float kvc_fp8_scale(const unsigned char *st, int off, int r, bool has) {
  return has ? *(const float *)(st + off + 4 * r) : 1.0f;
}

/* Shared-memory layout of one block (bytes), from D, the groups per row
 * and the n-tiles: a ring of stages {K rows, V rows, K scales, K biases,
 * V scales, V biases}, then the query fragments, P, the per-warp maxima and
 * sums. Host and device compute it alike. */
struct kvc_tc_layout {
  int rs;                 /* bytes per raw row in shared memory */
  int kd, vd, ks, kb, vs, vb, stage; /* offsets within a stage, stage bytes */
  int qf, p, wmax, lsum, qsig, qsum, corr, mrow, ids, total;
};
/* BLOCK_TABLE views: the block ids of a stage's rows (table columns of 64
 * consecutive tokens: up to 64 at block size 1, plus one for the offset),
 * staged in a ring of 2 x STAGES slots of KVC_TC_IDS ints (kvc_tc_issue_ids). */
#define KVC_TC_IDS 68
/* One group per row (head dim 64 with MLX's group 64, 128 with 128): a
 * scale row is 2 bytes, below cp.async's 4, so the loader copies the scale
 * and bias entries of 8 tokens at a time, as 16-byte pieces aligned in
 * memory (the selector, kvc_one_group_rows: adjacent tokens' entries 2
 * bytes apart; block tables: 16-byte aligned block and head starts, blocks
 * of a multiple of 8 tokens, so no piece spans two blocks; contiguous rows:
 * the four scale / bias arrays alike modulo 16 bytes). Token 0 of a
 * sequence's head sits e0 entries into its piece (kvc_tc_e0: the first
 * offset fo of a table, the address's for contiguous rows), so a stage's
 * first row t0 sits so = (t0 + e0) % 8 entries in, and the stage's arrays
 * (KVC_TC_TOK + 8 entries each) hold row r at entry r + so: for one group
 * the usual index r * g + gi with the group index gi + so (so = 0 with 2
 * or more groups). */
__host__ __device__ inline int kvc_tc_scale_rows(int g) { return g == 1 ? KVC_TC_TOK + 8 : KVC_TC_TOK; }
__device__ __forceinline__ int kvc_tc_e0(const kvc_args &a, int b, int hk, int fo) {
  return a.k.tbl ? fo : (int)(((uintptr_t)(a.k.scales + b * a.k.ss[0] + hk * a.k.ss[1]) >> 1) & 7);
}
__device__ __forceinline__ int kvc_tc_so(int gk, long long t0, int e0) { return gk == 1 ? (int)((t0 + e0) & 7) : 0; }
/* The ring's stage part, common to the narrow, wide and warpgroup kernels.
 * fp8 rows: the K and V scale rows are one f32 per token (ks, vs), no bias
 * rows (gk, gv unused). */
__host__ __device__ inline void kvc_tc_stage_layout(kvc_tc_layout &l, int f, int D, int gk, int gv) {
  l.rs = 16 * kvc_tc_cpr(f, D) + KVC_TC_ROWPAD; /* float rows: no scale rows (gk = gv = 0) */
  l.kd = 0;
  l.vd = l.kd + KVC_TC_TOK * l.rs;
  l.ks = l.vd + KVC_TC_TOK * l.rs;
  if (kvc_tc_fp8(f)) {
    l.kb = l.ks + KVC_TC_TOK * 4;
    l.vs = l.vb = l.kb;
    l.stage = (l.vs + KVC_TC_TOK * 4 + 127) / 128 * 128;
    return;
  }
  l.kb = l.ks + kvc_tc_scale_rows(gk) * gk * 2;
  l.vs = l.kb + kvc_tc_scale_rows(gk) * gk * 2;
  l.vb = l.vs + kvc_tc_scale_rows(gv) * gv * 2;
  l.stage = (l.vb + kvc_tc_scale_rows(gv) * gv * 2 + 127) / 128 * 128;
}

/* A thread's share of the stage copies, set up once per block so that a
 * stage costs its cp.async instructions and a few pointer increments.
 * Contiguous rows: 16-byte piece p = thread + 128 k of a stage is piece
 * p % CPR of row p / CPR, so one instruction of a warp copies 512
 * contiguous bytes; the thread's pieces are TSTEP rows apart. BLOCK_TABLE
 * rows, IDS (the narrow kernel): the same pieces (a warp instruction
 * covers whole rows, as many lines as contiguous rows), each row located
 * through the stage's block ids, which kvc_tc_issue_ids copied into shared
 * memory STAGES - 1 stages earlier (no load latency, no register held
 * across the stage).
 * BLOCK_TABLE rows, !IDS (the wide kernel, whose loads run on 4 of its 8
 * warps: the per-row lookups are slower there): thread pair
 * (2 tok, 2 tok + 1) copies row tok, half of it each, from the block id
 * that kvc_tc_table_id loaded one stage earlier. Scale rows: thread 2 tok
 * copies the K scale/bias rows of row tok, 2 tok + 1 the V ones (rb bytes
 * each: one cp.async). */
struct kvc_tc_loader {
  const char *k, *v;       /* its first K / V piece: of the next stage (contiguous), of head hk in block 0 row 0 (table) */
  const char *s, *z;       /* its scale / bias rows: of the next stage (contiguous), of head hk (table) */
  long long kstep, vstep;  /* contiguous: bytes between its pieces */
  long long kst, vst;      /* contiguous: bytes per stage */
  long long sst, zst;      /* bytes per stage (contiguous), per pool block (table) */
  long long srs, zrs;      /* table: bytes per scale / bias row */
  uint32_t dk, ds, dz;     /* shared offsets in a slot: its first K piece (its V piece at + vd - kd), scale and bias rows */
  int tk;                  /* stage row of its first piece */
  int rb;                  /* bytes of a scale row: 2 (kvc_tc_so), 4, 8 or 16 */
  int e0;                  /* one group per row: kvc_tc_e0 */
};

template <int F, int D, int G = 0, bool IDS = true>
__device__ __forceinline__ kvc_tc_loader kvc_tc_loader_of(const kvc_args &a, const kvc_tc_layout &L, int b, int hk,
                                                         long long t_lo) {
  constexpr int CPR = kvc_tc_cpr(F, D); /* 16-byte pieces per row */
  constexpr int TSTEP = KVC_TC_THREADS / CPR;  /* rows between a thread's pieces */
  const kvc_operand &K = a.k, &V = a.v;
  const int tok = threadIdx.x >> 1, half = threadIdx.x & 1;
  const kvc_operand &O = half ? V : K;
  kvc_tc_loader ld;
  ld.rb = kvc_tc_float(F) ? 0 : kvc_tc_fp8(F) ? 4 : 2 * (D / (G ? G : O.group));
  ld.e0 = kvc_tc_e0(a, b, hk, kvc_first_offset(K, b));
  ld.ds = (half ? L.vs : L.ks) + tok * ld.rb;
  ld.dz = (half ? L.vb : L.kb) + tok * ld.rb;
  if (!K.tbl) {
    const int c = threadIdx.x % CPR;
    ld.tk = threadIdx.x / CPR;
    ld.dk = L.kd + ld.tk * L.rs + 16 * c;
    ld.k = K.data + b * K.ds[0] + hk * K.ds[1] + (t_lo + ld.tk) * K.ds[2] + 16 * c;
    ld.v = V.data + b * V.ds[0] + hk * V.ds[1] + (t_lo + ld.tk) * V.ds[2] + 16 * c;
    ld.kstep = TSTEP * K.ds[2];
    ld.vstep = TSTEP * V.ds[2];
    ld.kst = KVC_TC_TOK * K.ds[2];
    ld.vst = KVC_TC_TOK * V.ds[2];
    ld.s = O.scales + b * O.ss[0] + hk * O.ss[1] + (t_lo + tok) * O.ss[2];
    ld.z = O.biases + b * O.bs[0] + hk * O.bs[1] + (t_lo + tok) * O.bs[2];
    ld.sst = KVC_TC_TOK * O.ss[2];
    ld.zst = KVC_TC_TOK * O.bs[2];
  } else {
    const int c = IDS ? threadIdx.x % CPR : half * (CPR / 2); /* first piece */
    ld.tk = IDS ? threadIdx.x / CPR : tok;
    ld.dk = L.kd + ld.tk * L.rs + 16 * c;
    if (IDS) { /* (!IDS: from the operands at each stage: fewer registers held) */
      ld.k = K.data + hk * K.ds[1] + 16 * c;
      ld.v = V.data + hk * V.ds[1] + 16 * c;
    }
    ld.s = O.scales + hk * O.ss[1];
    ld.z = O.biases + hk * O.bs[1];
    ld.sst = O.ss[0];
    ld.zst = O.bs[0];
    ld.srs = O.ss[2];
    ld.zrs = O.bs[2];
  }
  return ld;
}

/* cp.async of one scale row of rb bytes (4, 8 or 16; n = rb or 0). */
__device__ __forceinline__ void kvc_cp_async_rb(uint32_t d, const char *src, int rb, int n) {
  if (rb == 16)
    kvc_cp_async<16>(d, src, n);
  else if (rb == 8)
    kvc_cp_async<8>(d, src, n);
  else
    kvc_cp_async<4>(d, src, n);
}

/* Copies stage rows t0..t0+63 (zeros past t_hi) into the ring slot at shared
 * address `slot`, and moves the loader on to the next stage. BLOCK_TABLE
 * views: IDS: ids holds the block ids of the stage's table columns (from
 * the column of token t0), landed and visible (kvc_tc_issue_ids); !IDS: id
 * is the block of this thread's row (kvc_tc_table_id). */
/* LAYOUT: 0 = the view's layout read at run time, 1 = contiguous rows only,
 * 2 = BLOCK_TABLE rows only (an instance per layout: less code in the loop). */
template <int F, int D, bool IDS = true, int LAYOUT = 0>
__device__ __forceinline__ void kvc_tc_load_stage(const kvc_args &a, const kvc_tc_layout &L, kvc_tc_loader &ld,
                                                  uint32_t slot, int fo, long long t0, long long t_hi,
                                                  const int *ids, int id = 0) {
  constexpr int CPR = kvc_tc_cpr(F, D);
  constexpr int PER = KVC_TC_TOK * CPR / KVC_TC_THREADS; /* pieces per thread and operand */
  constexpr int TSTEP = KVC_TC_THREADS / CPR;
  const uint32_t dv = L.vd - L.kd, rstep = TSTEP * L.rs;
  const bool full = t0 + KVC_TC_TOK <= t_hi;
  const char *sr, *zr;
  bool sok;
  if (LAYOUT == 1 || (LAYOUT == 0 && !a.k.tbl)) {
    if (full) {
#pragma unroll
      for (int k = 0; k < PER; ++k) {
        kvc_cp_async<16>(slot + ld.dk + k * rstep, ld.k + k * ld.kstep, 16);
        kvc_cp_async<16>(slot + ld.dk + dv + k * rstep, ld.v + k * ld.vstep, 16);
      }
    } else { /* the last stage of a split: rows past t_hi read nothing (and a valid address) */
#pragma unroll
      for (int k = 0; k < PER; ++k) {
        const bool ok = t0 + ld.tk + TSTEP * k < t_hi;
        kvc_cp_async<16>(slot + ld.dk + k * rstep, ok ? ld.k + k * ld.kstep : a.k.data, ok ? 16 : 0);
        kvc_cp_async<16>(slot + ld.dk + dv + k * rstep, ok ? ld.v + k * ld.vstep : a.v.data, ok ? 16 : 0);
      }
    }
    ld.k += ld.kst;
    ld.v += ld.vst;
    sok = full || t0 + (threadIdx.x >> 1) < t_hi;
    sr = sok ? ld.s : a.k.scales;
    zr = sok ? ld.z : a.k.biases;
    ld.s += ld.sst;
    ld.z += ld.zst;
  } else if (!IDS) {
    const kvc_operand &K = a.k, &V = a.v;
    const long long t = t0 + ld.tk;
    sok = t < t_hi;
    kvc_loc l = {0, 0};
    if (sok) l = kvc_table_loc_id(K, fo, id, t); /* the id was loaded a stage ahead */
    const int hk = blockIdx.z % a.KVH;
    const char *kr = K.data + l.outer * K.ds[0] + hk * K.ds[1] + l.row * K.ds[2] + 16 * (threadIdx.x & 1) * (CPR / 2);
    const char *vr = V.data + l.outer * V.ds[0] + hk * V.ds[1] + l.row * V.ds[2] + 16 * (threadIdx.x & 1) * (CPR / 2);
#pragma unroll
    for (int c = 0; c < CPR / 2; ++c) {
      kvc_cp_async<16>(slot + ld.dk + 16 * c, kr + 16 * c, sok ? 16 : 0);
      kvc_cp_async<16>(slot + ld.dk + dv + 16 * c, vr + 16 * c, sok ? 16 : 0);
    }
    sr = ld.s + l.outer * ld.sst + l.row * ld.srs;
    zr = ld.z + l.outer * ld.zst + l.row * ld.zrs;
  } else {
    const kvc_operand &K = a.k, &V = a.v;
    const long long jf = kvc_table_col(t0 + fo, K.bsz, K.bsh); /* ids[0]'s column */
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const long long t = t0 + ld.tk + TSTEP * k;
      const bool ok = t < t_hi;
      const char *kr = K.data, *vr = V.data; /* rows past t_hi: a valid address, nothing read */
      if (ok) {
        const long long r = t + fo, j = kvc_table_col(r, K.bsz, K.bsh);
        const kvc_loc l = kvc_loc_of(ids[j - jf], r, j, K.bsz, K.nblk);
        kr = ld.k + l.outer * K.ds[0] + l.row * K.ds[2];
        vr = ld.v + l.outer * V.ds[0] + l.row * V.ds[2];
      }
      kvc_cp_async<16>(slot + ld.dk + k * rstep, kr, ok ? 16 : 0);
      kvc_cp_async<16>(slot + ld.dk + dv + k * rstep, vr, ok ? 16 : 0);
    }
    const long long t = t0 + (threadIdx.x >> 1); /* the scale rows' token */
    sok = t < t_hi;
    kvc_loc l = {0, 0};
    if (sok) {
      const long long r = t + fo, j = kvc_table_col(r, K.bsz, K.bsh);
      l = kvc_loc_of(ids[j - jf], r, j, K.bsz, K.nblk);
    }
    sr = ld.s + l.outer * ld.sst + l.row * ld.srs;
    zr = ld.z + l.outer * ld.zst + l.row * ld.zrs;
  }
  if (kvc_tc_float(F)) return; /* no scale rows */
  if (kvc_tc_fp8(F)) {
    /* the row's f32 scale: thread 2 tok the K one, 2 tok + 1 the V one (rows
     * past t_hi: zeros, so their zero codes stay 0); none without scales */
    const char *base = (threadIdx.x & 1) ? a.v.scales : a.k.scales;
    if (base) kvc_cp_async<4>(slot + ld.ds, sok ? sr : base, sok ? 4 : 0);
    return;
  }
  if (ld.rb == 2) {
    /* one group per row (see kvc_tc_so): the thread of the first row of
     * each 8-entry piece copies the piece, from its own row's entry back to
     * the piece's start (the same pool block); entries of tokens at or past
     * t_hi are zero-filled */
    const int tok = threadIdx.x >> 1, so = kvc_tc_so(1, t0, ld.e0), off = (tok + so) & 7;
    if (tok != 0 && off != 0) return;
    const long long nv = sok ? t_hi - (t0 + tok - off) : 0; /* tokens of the piece before t_hi */
    const uint32_t dd = 2 * (so - off);
    if (nv <= 0 || nv >= 8) {
      const int n = nv > 0 ? 16 : 0;
      kvc_cp_async<16>(slot + ld.ds + dd, n ? sr - 2 * off : a.k.scales, n);
      kvc_cp_async<16>(slot + ld.dz + dd, n ? zr - 2 * off : a.k.biases, n);
    } else {
      /* the piece that t_hi cuts (one per split): its entries before t_hi by
       * plain loads, zeros after; no read past t_hi, which may be the end
       * of the caller's array */
      const unsigned short *s16 = (const unsigned short *)(sr - 2 * off), *z16 = (const unsigned short *)(zr - 2 * off);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        kvc_sts16(slot + ld.ds + dd + 2 * e, e < nv ? __ldg(s16 + e) : (unsigned short)0);
        kvc_sts16(slot + ld.dz + dd + 2 * e, e < nv ? __ldg(z16 + e) : (unsigned short)0);
      }
    }
    return;
  }
  const int n = sok ? ld.rb : 0;
  kvc_cp_async_rb(slot + ld.ds, sr, ld.rb, n);
  kvc_cp_async_rb(slot + ld.dz, zr, ld.rb, n);
}

/* The block ids of the stage at t0 (its table columns up to token t_hi - 1;
 * none past t_hi), one per thread below the column count: copied into the
 * ids slot at shared address d by cp.async in the caller's commit group
 * (kvc_tc_issue_ids), or loaded and stored at dst (kvc_tc_store_ids, the
 * prologue's first stages). */
__device__ __forceinline__ int kvc_tc_id_cols(const kvc_args &a, int fo, long long t0, long long t_hi, long long *jf) {
  if (t0 >= t_hi) return 0;
  *jf = kvc_table_col(t0 + fo, a.k.bsz, a.k.bsh);
  return (int)(kvc_table_col(min(t0 + KVC_TC_TOK, t_hi) - 1 + fo, a.k.bsz, a.k.bsh) - *jf + 1);
}
__device__ __forceinline__ void kvc_tc_issue_ids(const kvc_args &a, int b, int fo, long long t0, long long t_hi,
                                                 uint32_t d) {
  long long jf = 0;
  if ((int)threadIdx.x < kvc_tc_id_cols(a, fo, t0, t_hi, &jf))
    kvc_cp_async<4>(d + 4 * threadIdx.x, a.k.tbl + b * a.k.tbl_rs + jf + threadIdx.x, 4);
}
__device__ __forceinline__ void kvc_tc_store_ids(const kvc_args &a, int b, int fo, long long t0, long long t_hi,
                                                 int *dst) {
  long long jf = 0;
  if ((int)threadIdx.x < kvc_tc_id_cols(a, fo, t0, t_hi, &jf))
    dst[threadIdx.x] = __ldg(a.k.tbl + b * a.k.tbl_rs + jf + threadIdx.x);
}
/* The block id of this thread's loader row in the stage at t0 (0 when
 * contiguous or past t_hi), for the !IDS loader: loaded a stage before
 * kvc_tc_load_stage uses it. */
__device__ __forceinline__ int kvc_tc_table_id(const kvc_args &a, int b, int fo, long long t0, long long t_hi) {
  const long long t = t0 + (threadIdx.x >> 1);
  return a.k.tbl && t < t_hi ? kvc_table_id(a.k, b, fo, t) : 0;
}

/* The token range of a split for query vectors q0 .. q0 + nq - 1 and its
 * 64-token stages; is the stage at t0 wholly visible (common.cuh). */
__device__ __forceinline__ int kvc_tc_range(const kvc_args &a, int split, long long len, int q0, int nq,
                                            long long *t_lo, long long *t_hi) {
  kvc_split_range(a, split, len, q0, nq, t_lo, t_hi);
  return *t_hi > *t_lo ? (int)((*t_hi - *t_lo + KVC_TC_TOK - 1) / KVC_TC_TOK) : 0;
}
__device__ __forceinline__ bool kvc_tc_stage_full(const kvc_args &a, long long t0, long long t_hi, long long len) {
  return kvc_keys_all_visible(a, t0, KVC_TC_TOK, t_hi, len);
}
#endif
