/* Tensor-core decode/verify kernel, template on the K/V format F: 4-bit
 * MLX-affine K/V with bf16 scales and biases (KVC_Q4: 1 to 8 groups per
 * row, scale rows of 4, 8 or 16 bytes, one cp.async each; one group: 8
 * tokens' entries per cp.async, kvc_tc_so in tc_stage.cuh), 16-bit float
 * rows (KVC_BF16, KVC_F16 with queries of the same type: the rows are the
 * mma operands, no dequantization, no scale rows; 2 ring slots of 64 rows x
 * 2 D bytes per operand), or 8-bit K/V with bf16 scales (KVC_Q8: in this
 * narrow kernel the decode instance only, D 128/256, each warp's V dims
 * inside one group; S on the bytes as they are, P.V by kvc_pv_step_q8),
 * or fp8 K/V (KVC_E4M3, KVC_E5M2: D code bytes a row and its f32 scale,
 * one 4-byte cp.async per row and operand, none without scales; decode
 * instance and wide kernel): K and V fragments converted in registers as
 * they are read, two codes per cvt.rn.f16x2.{e4m3x2,e5m2x2} (exact), to
 * f32, times the row's scale in f32, rounded to bf16 ("[K,V,P bf16]", the
 * q4/q8 wide instances' contract); fragments in the q8 dim order (S) and
 * the bf16 rows' dim pairs (P.V, one PRMT pairing two tokens' bytes).
 * Quantized and fp8 formats take bf16 queries. Dk = Dv = D in {64, 128, 256} (and
 * 512 for the q4 decode instance: 2 blocks per SM, 16 V codes per lane),
 * causal-family masks, L <= 16; contiguous or BLOCK_TABLE layout. Split
 * over token blocks like the fused kernel and merged by the same merge
 * launch (attn_merge.cu); a rotated output (a.rot_out) leaves each block
 * rotated (kvc_emit_block). What follows describes the q4 format; for float
 * rows, S takes K fragments straight from the staged rows (dims 16 kk +
 * 2 tq, + 8 of the k-step) and P.V pairs two tokens of a dim by one PRMT of
 * their words. Beyond 32 query vectors per KV head (q4; float rows and q8
 * beyond 8) the wide kernel further down takes the call. Long q4 decode
 * with MLX's group 64 at head dims 128 / 256 runs on the per-warp kernel of
 * attn_tcd.cu instead (the selector, context.cu).
 *
 *   memory: the packed K/V rows and their scales/biases of a 64-token stage
 *         (18 KB at D = 256, group 64) are copied raw into shared memory with
 *         cp.async, in a ring of STAGES slots: STAGES - 1 stages are in
 *         flight per block while it computes on one, without holding
 *         registers (decode instance: 2 slots, 4 blocks per SM, ~80 KB in
 *         flight per SM). Each K/V byte is read from DRAM once per block of
 *         up to 8 * NTM query vectors (all rep * L vectors of a KV head when
 *         rep * L <= 8 * NTM). Each thread's copy addresses are set up once
 *         (kvc_tc_loader); contiguous rows: a warp copies 512 contiguous
 *         bytes per instruction; BLOCK_TABLE rows: the same pieces, each
 *         row located through the stage's block ids, which cp.async copied
 *         into a ring of 2 STAGES id slots (KVC_TC_IDS ints each) STAGES - 1
 *         stages earlier (the wide kernel: one table entry per thread and
 *         stage, loaded a stage ahead).
 *   math, S = K Q^T (tokens as mma M, query vectors as N; warp w takes
 *         tokens 16w..16w+15 of the stage):
 *         - decode instance (I8): u8 codes straight from the raw words
 *           (w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F) times the query split
 *           into two s8 parts, q ~= sigma (128 qh + ql), with mma.m16n8k32
 *           into s32: exact integer dots per group; per group and token
 *           dot += scale * (128 dot_h + dot_l) and the bias term
 *           bias * sum_group(q) in f32. K is never rounded. When the
 *           block's query vectors times the groups per row fit the 8 mma
 *           columns (decode at rep 2 with 4 groups, rep 4 with 2), each
 *           column holds one (query, group) pair and its query fragment is
 *           zero outside that group: one accumulator pair over all dims,
 *           the scales applied once per stage, the groups summed across
 *           lane pairs (H200: 6-10 % faster on 8/4/256).
 *         - 32-vector instance: K dequantized to bf16 in registers (LOP3 under
 *           the 2^7 exponent gives 128 + c exactly, minus 128, then
 *           scale * c + bias in one bf16x2 FMA), mma.m16n8k16 bf16.
 *         Query fragments are stored once per block in shared memory in the
 *         dim order the K words yield (the decode instance stages the raw
 *         queries in the free ring slot first: one round of loads, sigma
 *         and the group sums by shuffles).
 *   softmax: scale, softcap and mask in f32 (log2 units: the scale folded into
 *         sigma and the group sums of q); the stage maximum
 *         per query goes through shared memory, so every warp applies the
 *         same running max m; P = 2^(s - m) rounded to bf16 (f16 for f16
 *         rows; l sums the rounded values) goes to shared memory.
 *   math, O^T += V^T P^T: warp w takes head dims [w D / 4, (w + 1) D / 4)
 *         over all 64 tokens; its V fragments (two tokens of one dim per
 *         register) come from a PRMT that interleaves two tokens' code
 *         halves, then the LOP3/FMA dequantization with the two tokens'
 *         scales and biases. V and P carry bf16 rounding (2^-9 relative):
 *         tests compare this path at the bf16 allowance.
 *   group size: read at run time, or compiled in (G = KVC_TC_GROUP, the q4
 *         decode instance with MLX's default group): constant shared-memory
 *         offsets and group arithmetic, 5-9 % faster on the H200.
 *   launch: grid (qgroups, nsplit, B * KVH) of KVC_TC_THREADS threads;
 *         qgroups = ceil(rep * L / (8 * NTM)), NTM in {1, 4} n-tiles of 8
 *         query vectors per block; three __syncthreads per stage; dynamic
 *         shared memory kvc_tc_smem() (~45 KB at D = 256 for the decode
 *         instance, whose 128 registers let 4 blocks = 16 warps share an SM;
 *         ~100 KB for the 32-vector q4 one: 2 blocks per SM). Measured on the H200
 *         (BENCHMARKS.md): 2 slots x 4 blocks beat 3 slots x 3 blocks by
 *         3-8 %. */
#include "cuda/tc_stage.cuh" /* the stage ring and its loader; kvc_exp2, kvc_emit */

#define KVC_TC_PS (KVC_TC_TOK + 8)    /* bf16 per P row */
#define KVC_TC_SUB 16                 /* tokens per warp in the S phase (mma M) */
/* Stages in the cp.async ring: 2 for the decode instance (q4: its ~45 KB at
 * D = 256 and 128 registers let 4 blocks share an SM: 16 warps, 4 stages in
 * flight; bf16 rows: ~140 KB at D = 256), 4 for the 32-vector q4 instance
 * (registers allow 2 blocks per SM). */
__host__ __device__ constexpr int kvc_tc_stages(int ntm) { return ntm == 1 ? 2 : 4; }
/* The mma of format F's 16-bit operands: f16 for f16 rows (and f16 queries
 * and P), bf16 for every other format. */
template <int F> __device__ __forceinline__ void kvc_mma16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if (F == KVC_F16) kvc_mma_f16(d, a, b0, b1);
  else kvc_mma_bf16(d, a, b0, b1);
}
/* P rounded to format F's 16-bit type (bits); *r: the rounded value, which
 * the softmax sum l adds. */
template <int F> __device__ __forceinline__ unsigned short kvc_p16(float p, float *r) {
  if (F == KVC_F16) {
    const __half h = __float2half_rn(p);
    *r = __half2float(h);
    return __half_as_ushort(h);
  }
  const __nv_bfloat16 h = __float2bfloat16_rn(p);
  *r = __bfloat162float(h);
  return __bfloat16_as_ushort(h);
}
/* q8 code byte k of w -> bf16 of scale * code + bias (f32, one rounding) for
 * two words (lo, hi): the A/B register of two tokens or two dims. */
__device__ __forceinline__ uint32_t kvc_deq8_pair(uint32_t wl, int kl, float sl, float zl, uint32_t wh, int kh, float sh,
                                                  float zh) {
  return kvc_bf16x2_of(fmaf(sl, kvc_byte_float(wl, kl), zl), fmaf(sh, kvc_byte_float(wh, kh), zh));
}

__host__ __device__ inline kvc_tc_layout kvc_tc_layout_of(int f, int D, int gk, int gv, int ntm) {
  const int stages = kvc_tc_stages(ntm);
  kvc_tc_layout l;
  kvc_tc_stage_layout(l, f, D, gk, gv);
  l.qf = stages * l.stage;
  l.p = l.qf + (D / 32) * 2 * ntm * KVC_WARP * 8;
  l.wmax = l.p + ntm * 8 * KVC_TC_PS * 2;
  l.lsum = l.wmax + KVC_TC_WARPS * ntm * 8 * 4;
  l.qsig = l.lsum + KVC_TC_WARPS * ntm * 8 * 4;
  l.qsum = l.qsig + ntm * 8 * 4;
  l.ids = l.qsum + gk * ntm * 8 * 4;
  l.total = l.ids + 2 * stages * KVC_TC_IDS * 4;
  l.corr = l.mrow = l.total;
  return l;
}


/* ---- pieces shared by the narrow and the wide kernel ---- */
/* u8 A fragments of S k-step kj (32 dims) for rows r0 (p0) and r1 (p1),
 * p0/p1 at word tq of the staged rows. q4: K word 4 kj + tq, low nibbles
 * (dims 8 w + 0, 2, 4, 6) as k columns 4 tq.., high ones as 16 + 4 tq..;
 * q8: words 8 kj + tq and 8 kj + 4 + tq (dims in order). The query B
 * fragments follow the same dim order (kvc_i8_dim). */
template <int F>
__device__ __forceinline__ void kvc_s_codes(const uint32_t *p0, const uint32_t *p1, int kj, uint32_t (&af)[4]) {
  if (F == KVC_Q8) {
    af[0] = p0[8 * kj], af[1] = p1[8 * kj], af[2] = p0[8 * kj + 4], af[3] = p1[8 * kj + 4];
  } else {
    const uint32_t w0 = p0[4 * kj], w1 = p1[4 * kj];
    af[0] = w0 & KVC_NIBBLES, af[1] = w1 & KVC_NIBBLES, af[2] = (w0 >> 4) & KVC_NIBBLES, af[3] = (w1 >> 4) & KVC_NIBBLES;
  }
}
/* The dim of byte i of query B register hh (k rows 4 t4 + i, or 16 + 4 t4 +
 * i) in S k-step kj: the order kvc_s_codes gives the codes. */
template <int F> __device__ __forceinline__ int kvc_i8_dim(int kj, int t4, int hh, int i) {
  return F == KVC_Q8 ? 32 * kj + 16 * hh + 4 * t4 + i : 8 * (4 * kj + t4) + 2 * i + hh;
}

/* The V scales and biases (bf16 bits) of group vgi of the four token rows
 * of a P.V k-step: tokens ta, ta + 1 in the low / high halves of s01, b01;
 * ta + 8, ta + 9 in s89, b89. */
struct kvc_vsb {
  uint32_t s01, b01, s89, b89;
};
__device__ __forceinline__ kvc_vsb kvc_v_scales(const unsigned char *sv, const kvc_tc_layout &L, int ta, int gv,
                                                int vgi) {
  kvc_vsb r;
  const unsigned char *s = sv + L.vs + vgi * 2, *b = sv + L.vb + vgi * 2;
  r.s01 = kvc_lds16(s + ta * gv * 2) | (kvc_lds16(s + (ta + 1) * gv * 2) << 16);
  r.b01 = kvc_lds16(b + ta * gv * 2) | (kvc_lds16(b + (ta + 1) * gv * 2) << 16);
  r.s89 = kvc_lds16(s + (ta + 8) * gv * 2) | (kvc_lds16(s + (ta + 9) * gv * 2) << 16);
  r.b89 = kvc_lds16(b + (ta + 8) * gv * 2) | (kvc_lds16(b + (ta + 9) * gv * 2) << 16);
  return r;
}

/* One k-step of O^T += V^T P^T for q8 V (the warp's dims inside one group):
 * with v = s c + b and c = 16 h + l (the code's nibbles),
 *   sum_t p_t v_t = sum_t 16 P'_t (128 + h_t) + sum_t P'_t (128 + l_t)
 *                   - 2176 sum_t P'_t + sum_t p_t b_t,   P'_t = bf16(p_t s_t),
 * so the A fragments are 128 + h and 128 + l (one shift and one LOP3 each:
 * a byte has no exact bf16 magic), two mma per m-tile, and the corrections
 * (equal for every dim) go through the one-m-tile accumulator accc: A = the
 * tokens' biases times P, A = -2176 times P'. Products exact, sums f32; the
 * rounding is P' (2^-9). m-tile i of this lane: word xq + 8 (i / 2) of the
 * rows, codes 2 (i % 2) (row g) and 2 (i % 2) + 1 (row g + 8). */
template <int MT, int NT>
__device__ __forceinline__ void kvc_pv_step_q8(const unsigned char *sv, const kvc_tc_layout &L, int ta, int xq, int vgi,
                                               int gv, const uint32_t (&pb)[NT][2], int ntc, float (&acc)[MT][NT][4],
                                               float (&accc)[NT][4]) {
  const uint32_t *r0 = (const uint32_t *)(sv + L.vd + ta * L.rs), *r1 = (const uint32_t *)(sv + L.vd + (ta + 1) * L.rs);
  const uint32_t *r8 = (const uint32_t *)(sv + L.vd + (ta + 8) * L.rs), *r9 = (const uint32_t *)(sv + L.vd + (ta + 9) * L.rs);
  const kvc_vsb sb = kvc_v_scales(sv, L, ta, gv, vgi);
  const uint32_t s01 = sb.s01, b01 = sb.b01, s89 = sb.s89, b89 = sb.b89;
  uint32_t pf[NT][2], pf16[NT][2]; /* P' = P s and 16 P' (exact) */
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    if (nt < ntc) {
      pf[nt][0] = kvc_mul_bf16x2(pb[nt][0], s01);
      pf[nt][1] = kvc_mul_bf16x2(pb[nt][1], s89);
      pf16[nt][0] = kvc_mul_bf16x2(pf[nt][0], KVC_BF16X2_16);
      pf16[nt][1] = kvc_mul_bf16x2(pf[nt][1], KVC_BF16X2_16);
    }
#pragma unroll
  for (int w = 0; w < (MT + 1) / 2; ++w) {
    const int x = xq + 8 * w;
    /* the two tokens' bytes of codes 0, 1 (lo) and 2, 3 (hi), by 16-bit halves */
    const uint32_t lo01 = __byte_perm(r0[x], r1[x], 0x5410), hi01 = __byte_perm(r0[x], r1[x], 0x7632);
    const uint32_t lo89 = __byte_perm(r8[x], r9[x], 0x5410), hi89 = __byte_perm(r8[x], r9[x], 0x7632);
#pragma unroll
    for (int u = 0; u < 2 && 2 * w + u < MT; ++u) {
      const int i = 2 * w + u; /* codes 2 u (row g) and 2 u + 1 (row g + 8) */
      const uint32_t a01 = u ? hi01 : lo01, a89 = u ? hi89 : lo89;
      const uint32_t al[4] = {kvc_and_or(a01, KVC_NIB_PAIR, KVC_BF16X2_128), kvc_and_or(a01 >> 8, KVC_NIB_PAIR, KVC_BF16X2_128),
                              kvc_and_or(a89, KVC_NIB_PAIR, KVC_BF16X2_128), kvc_and_or(a89 >> 8, KVC_NIB_PAIR, KVC_BF16X2_128)};
      const uint32_t ah[4] = {kvc_and_or(a01 >> 4, KVC_NIB_PAIR, KVC_BF16X2_128),
                              kvc_and_or(a01 >> 12, KVC_NIB_PAIR, KVC_BF16X2_128),
                              kvc_and_or(a89 >> 4, KVC_NIB_PAIR, KVC_BF16X2_128),
                              kvc_and_or(a89 >> 12, KVC_NIB_PAIR, KVC_BF16X2_128)};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (nt < ntc) {
          kvc_mma_bf16(acc[i][nt], ah, pf16[nt][0], pf16[nt][1]);
          kvc_mma_bf16(acc[i][nt], al, pf[nt][0], pf[nt][1]);
        }
    }
  }
  const uint32_t ab[4] = {b01, b01, b89, b89};
  const uint32_t an[4] = {KVC_BF16X2_M2176, KVC_BF16X2_M2176, KVC_BF16X2_M2176, KVC_BF16X2_M2176};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    if (nt < ntc) {
      kvc_mma_bf16(accc[nt], ab, pb[nt][0], pb[nt][1]);
      kvc_mma_bf16(accc[nt], an, pf[nt][0], pf[nt][1]);
    }
}

/* The 16-bit query dim pairs of mma k columns (2 t4, 2 t4 + 1) -> .x and
 * (2 t4 + 8, 2 t4 + 9) -> .y of k-step kk, in the dim order the staged K
 * yields: float rows: dims (16 kk + 2 t4, + 1) and (16 kk + 8 + 2 t4, + 1)
 * (the mma's own order); q8 rows (the bytes of word 4 kk + t4, wide
 * kernel): (d0, d0 + 1) and (d0 + 2, d0 + 3), d0 = 16 kk + 4 t4; q4 rows
 * (kvc_deq_pair of word t4 WPL + kk / 2): (d0, d0 + 4) and (d0 + 1, d0 + 5),
 * d0 = 8 (t4 WPL + kk / 2) + 2 (kk % 2); fp8 rows as q8 (both kernels). */
template <int F, int WPL>
__device__ __forceinline__ uint2 kvc_q_pairs(const unsigned short *qp, long long qds, int kk, int t4) {
  constexpr bool B8 = F == KVC_Q8 || kvc_tc_fp8(F); /* byte codes: 4 dims per K word */
  const int d0 = kvc_tc_float(F) ? 16 * kk + 2 * t4 : B8 ? 16 * kk + 4 * t4 : 8 * (t4 * WPL + (kk >> 1)) + 2 * (kk & 1);
  const int dx = F == KVC_Q4 ? 4 : 1, dy = kvc_tc_float(F) ? 8 : B8 ? 2 : 1; /* second dim of .x; first dim of .y */
  uint2 f;
  f.x = (uint32_t)qp[d0 * qds] | ((uint32_t)qp[(d0 + dx) * qds] << 16);
  f.y = (uint32_t)qp[(d0 + dy) * qds] | ((uint32_t)qp[(d0 + dy + dx) * qds] << 16);
  return f;
}

/* P^T as mma B fragments for tokens (t, t + 1) and (t + 8, t + 9) of query
 * column 8 nt + g (t = the k-step's first token + 2 tq), n-tiles below ntc. */
template <int NT>
__device__ __forceinline__ void kvc_p_frags(const unsigned short *ps, int stride, int t, int g, int ntc,
                                            uint32_t (&pb)[NT][2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    if (nt < ntc) {
      const unsigned short *pr = ps + (8 * nt + g) * stride + t;
      pb[nt][0] = *(const uint32_t *)pr;
      pb[nt][1] = *(const uint32_t *)(pr + 8);
    }
}

/* q4 V words per lane in the P.V phase: a lane's m-tiles take 2 MT codes,
 * 8 per word. */
__host__ __device__ constexpr int kvc_tc_vpl(int mt) { return mt > 4 ? mt / 4 : 1; }

/* One k-step of O^T += V^T P^T: 16 tokens of a staged slot (this lane's rows
 * ta, ta + 1 (a0, a1) and ta + 8, ta + 9 (a2, a3)), MT m-tiles of 16 dims,
 * the n-tiles below ntc. A register pairs two tokens of one dim (PRMT of
 * the two tokens' words).
 *   q4: V words xw .. xw + VPL - 1 of each row (kvc_tc_vpl: 2 when the
 *       lane's 2 MT codes outgrow one word, head dim 512); m-tile
 *       i = j MPW + u rows g, g + 8 are codes cb + 2 u, cb + 2 u + 1 of word
 *       xw + j, dequantized with the two tokens' scales and biases of group
 *       vgi (gv groups per row; a lane's words lie in one group);
 *   bf16 / f16: m-tile i rows g, g + 8 are dims 2 x, 2 x + 1 of word x = xw + 8 i;
 *   fp8: the same dims, bytes 2 (x % 2), + 1 of word x / 2 (one PRMT pairs
 *       the two tokens' bytes), scaled by the tokens' row scales (vsc: V
 *       has scales) and rounded to bf16 (kvc_deq_fp8x2);
 *   q8 (the wide kernel; the narrow one takes kvc_pv_step_q8): the same dims
 *       2 x, 2 x + 1, bytes 2 (x % 2), + 1 of word x / 2, dequantized to
 *       bf16 in f32 (scale * code + bias, one rounding) with the tokens'
 *       scales and biases of group vgi (the m-tiles' dims lie in one group). */
template <int F, int MT, int NT>
__device__ __forceinline__ void kvc_pv_step(const unsigned char *sv, const kvc_tc_layout &L, int ta, int xw, int cb,
                                            int vgi, int gv, const uint32_t (&pb)[NT][2], int ntc,
                                            float (&acc)[MT][NT][4], bool vsc = true) {
  const uint32_t *r0 = (const uint32_t *)(sv + L.vd + ta * L.rs), *r1 = (const uint32_t *)(sv + L.vd + (ta + 1) * L.rs);
  const uint32_t *r8 = (const uint32_t *)(sv + L.vd + (ta + 8) * L.rs), *r9 = (const uint32_t *)(sv + L.vd + (ta + 9) * L.rs);
  if (F == KVC_Q8) {
    const kvc_vsb sb = kvc_v_scales(sv, L, ta, gv, vgi);
    const float s[4] = {kvc_bf16_bits(sb.s01 & 0xffffu), kvc_bf16_bits(sb.s01 >> 16), kvc_bf16_bits(sb.s89 & 0xffffu),
                        kvc_bf16_bits(sb.s89 >> 16)}; /* tokens ta, ta + 1, ta + 8, ta + 9 */
    const float z[4] = {kvc_bf16_bits(sb.b01 & 0xffffu), kvc_bf16_bits(sb.b01 >> 16), kvc_bf16_bits(sb.b89 & 0xffffu),
                        kvc_bf16_bits(sb.b89 >> 16)};
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const int x = xw + 8 * i, wi = x >> 1, k0 = 2 * (x & 1);
      const uint32_t w0 = r0[wi], w1 = r1[wi], w8 = r8[wi], w9 = r9[wi];
      const uint32_t af[4] = {kvc_deq8_pair(w0, k0, s[0], z[0], w1, k0, s[1], z[1]),
                              kvc_deq8_pair(w0, k0 + 1, s[0], z[0], w1, k0 + 1, s[1], z[1]),
                              kvc_deq8_pair(w8, k0, s[2], z[2], w9, k0, s[3], z[3]),
                              kvc_deq8_pair(w8, k0 + 1, s[2], z[2], w9, k0 + 1, s[3], z[3])};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (nt < ntc) kvc_mma_bf16(acc[i][nt], af, pb[nt][0], pb[nt][1]);
    }
    return;
  }
  if (kvc_tc_fp8(F)) {
    const float s[4] = {kvc_fp8_scale(sv, L.vs, ta, vsc), kvc_fp8_scale(sv, L.vs, ta + 1, vsc),
                        kvc_fp8_scale(sv, L.vs, ta + 8, vsc), kvc_fp8_scale(sv, L.vs, ta + 9, vsc)};
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const int x = xw + 8 * i, wi = x >> 1, k0 = 2 * (x & 1);
      /* bytes {t dim 2x, t+1 dim 2x, t dim 2x+1, t+1 dim 2x+1} of the two token rows */
      const uint32_t sel = (uint32_t)(k0 | ((4 + k0) << 4) | ((k0 + 1) << 8) | ((5 + k0) << 12));
      const uint32_t c01 = __byte_perm(r0[wi], r1[wi], sel), c89 = __byte_perm(r8[wi], r9[wi], sel);
      const uint32_t af[4] = {kvc_deq_fp8x2<F>(c01, s[0], s[1]), kvc_deq_fp8x2<F>(c01 >> 16, s[0], s[1]),
                              kvc_deq_fp8x2<F>(c89, s[2], s[3]), kvc_deq_fp8x2<F>(c89 >> 16, s[2], s[3])};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (nt < ntc) kvc_mma_bf16(acc[i][nt], af, pb[nt][0], pb[nt][1]);
    }
    return;
  }
  if (kvc_tc_float(F)) {
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      const int x = xw + 8 * i;
      const uint32_t w0 = r0[x], w1 = r1[x], w8 = r8[x], w9 = r9[x];
      const uint32_t af[4] = {__byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632),
                              __byte_perm(w8, w9, 0x5410), __byte_perm(w8, w9, 0x7632)};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (nt < ntc) kvc_mma16<F>(acc[i][nt], af, pb[nt][0], pb[nt][1]);
    }
    return;
  }
  const kvc_vsb sb = kvc_v_scales(sv, L, ta, gv, vgi);
  const uint32_t s01 = sb.s01, b01 = sb.b01, s89 = sb.s89, b89 = sb.b89;
  constexpr int VPL = kvc_tc_vpl(MT), MPW = MT / VPL; /* words per lane, m-tiles per word */
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    const uint32_t w0 = r0[xw + j], w1 = r1[xw + j], w8 = r8[xw + j], w9 = r9[xw + j];
    /* two tokens' codes 0-3 (lo) and 4-7 (hi) interleaved by 16-bit halves */
    const uint32_t lo01 = __byte_perm(w0, w1, 0x5410), hi01 = __byte_perm(w0, w1, 0x7632);
    const uint32_t lo89 = __byte_perm(w8, w9, 0x5410), hi89 = __byte_perm(w8, w9, 0x7632);
#pragma unroll
    for (int u = 0; u < MPW; ++u) {
      const int i = j * MPW + u, c0 = cb + 2 * u, c1 = c0 + 1; /* m-tile; codes of rows g and g + 8 */
      uint32_t af[4];
      af[0] = kvc_deq_pair((c0 & 4) ? hi01 : lo01, c0 & 3, s01, b01);
      af[1] = kvc_deq_pair((c1 & 4) ? hi01 : lo01, c1 & 3, s01, b01);
      af[2] = kvc_deq_pair((c0 & 4) ? hi89 : lo89, c0 & 3, s89, b89);
      af[3] = kvc_deq_pair((c1 & 4) ? hi89 : lo89, c1 & 3, s89, b89);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (nt < ntc) kvc_mma_bf16(acc[i][nt], af, pb[nt][0], pb[nt][1]);
    }
  }
}

template <int F, int D, int NTM, int G>
__global__ void __launch_bounds__(KVC_TC_THREADS, F == KVC_Q4 && NTM == 1 ? (D <= 256 ? 4 : 2)
                                                  : !kvc_tc_float(F) || D < 256 ? 2 : 1)
    kvc_tc_kernel(const kvc_args a) {
  constexpr int STAGES = kvc_tc_stages(NTM);
  constexpr bool BF = kvc_tc_float(F); /* bf16 / f16 K/V rows: mma operands as they are, no scale rows */
  constexpr bool FP8 = kvc_tc_fp8(F);  /* fp8 rows: K, V to bf16 (row scale applied), the bf16 rows' fragment order */
  constexpr bool PR = BF || FP8;       /* P.V m-tile rows are dim pairs (2 x, 2 x + 1) */
  /* q.k: exact integer products (split queries) for the decode instance;
   * bf16 dequantized K for the wide one (its per-group epilogue would cost
   * more than the dequantization it saves at 4 n-tiles) */
  constexpr bool I8 = !PR && NTM == 1;
  constexpr int WPL = D / 32; /* K words per lane and token row (S phase); V words per warp slice */
  constexpr int MT = D / 64;  /* m-tiles (16 dims) of O^T per warp */
  /* PV k-steps unrolled in the decode instance only: with NTM n-tiles the
   * unrolled body outgrows the instruction caches (H200, 2k-token verify:
   * 67 % of the stalls were instruction fetches) */
  constexpr int PVU = NTM == 1 ? KVC_TC_TOK / 16 : 1;
  extern __shared__ __align__(128) unsigned char kvc_tc_buf[];
  const int lane = threadIdx.x % KVC_WARP, warp = threadIdx.x / KVC_WARP;
  const int g = lane >> 2, tq = lane & 3; /* mma fragment row group and thread-in-group */
  const int qg = kvc_qtile(), split = blockIdx.y;
  const int b = blockIdx.z / a.KVH, hk = blockIdx.z % a.KVH;
  const int kgs = G ? G : a.k.group, vgs = G ? G : a.v.group; /* group sizes: compiled (G) or read */
  const int gk = PR ? 0 : D / kgs, gv = PR ? 0 : D / vgs;
  const int gk_sh = PR ? 0 : 31 - __clz(kgs), gv_sh = PR ? 0 : 31 - __clz(vgs); /* log2 of the group sizes */
  const kvc_tc_layout L = kvc_tc_layout_of(F, D, gk, gv, NTM);
  const bool ksc = a.k.scales != nullptr, vsc = a.v.scales != nullptr; /* fp8: rows with scales */
  const long long len = kvc_seq_len(a, b);
  const int fo = kvc_first_offset(a.k, b), e0 = kvc_tc_e0(a, b, hk, fo);
  const int Q = a.rep * a.L, q0 = qg * NTM * 8;
  const int ntc = min(NTM, (Q - q0 + 7) / 8); /* n-tiles with query vectors in this block */
  /* decode instance with (query vectors of the block) x (groups per row) <= 8,
   * 2 or more groups: the groups go into the mma columns (see the S phase) */
  const bool packed = I8 && gk >= 2 && min(Q - q0, 8) * gk <= 8;

  long long t_lo, t_hi;
  const int nst = kvc_tc_range(a, split, len, q0, NTM * 8, &t_lo, &t_hi);

  /* logits in log2 units: x = scl2 * q.k, a softcap c as (c log2 e) tanh(x / (c log2 e)) */
  const float scl2 = a.scale * KVC_LOG2E, cap2 = a.softcap * KVC_LOG2E, cap2_inv = a.softcap_inv * (1.0f / KVC_LOG2E);
  const bool capped = a.softcap > 0.0f;

  /* prologue: the first STAGES - 1 stages in flight (one commit group each) */
  const uint32_t ring = (uint32_t)__cvta_generic_to_shared(kvc_tc_buf);
  kvc_tc_loader ld = kvc_tc_loader_of<F, D, G>(a, L, b, hk, t_lo);
  /* BLOCK_TABLE: the ids of stage x in slot x % (2 STAGES): stored here for
   * the first STAGES - 1 stages, then copied with the data of stage
   * x - STAGES + 1 (so they have landed when stage x is issued) */
  const bool tbl = a.k.tbl != nullptr;
  int *ids = (int *)(kvc_tc_buf + L.ids);
  const uint32_t ids_sh = ring + L.ids;
  if (tbl) {
    for (int s = 0; s < STAGES - 1; ++s)
      kvc_tc_store_ids(a, b, fo, t_lo + (long long)s * KVC_TC_TOK, t_hi, ids + s * KVC_TC_IDS);
    __syncthreads();
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    const long long ts = t_lo + (long long)s * KVC_TC_TOK;
    if (s < nst) kvc_tc_load_stage<F, D>(a, L, ld, ring + s * L.stage, fo, ts, t_hi, ids + s * KVC_TC_IDS);
    if (tbl)
      kvc_tc_issue_ids(a, b, fo, ts + (long long)(STAGES - 1) * KVC_TC_TOK, t_hi,
                       ids_sh + ((s + STAGES - 1) % (2 * STAGES)) * KVC_TC_IDS * 4);
    kvc_cp_commit();
  }

  float *qsig = (float *)(kvc_tc_buf + L.qsig), *qsum = (float *)(kvc_tc_buf + L.qsum);
  uint2 *qf = (uint2 *)(kvc_tc_buf + L.qf);
  const long long qds = a.qs[3] / 2; /* bf16 elements between dims (1: innermost contiguous) */
  if constexpr (I8) {
    /* Queries as two int8 parts: q ~= sigma (128 qh + ql), sigma = max|q| /
     * (127 * 128), |qh| <= 127, |ql| <= 64 (error <= sigma / 2 per dim), so
     * q.codes per group is exact integer mma work; plus sigma and the exact
     * per-group sums of q (the bias term) in shared memory. */
    /* Stage the block's query vectors in ring slot STAGES - 1 (free until
     * the first stage of the loop is issued, after a barrier): TPQ threads
     * per vector, DPT dims each, one round of independent loads; sigma and
     * the group sums by shuffles over those threads. */
    constexpr int TPQ = KVC_TC_THREADS / (NTM * 8), DPT = D / TPQ;
    unsigned short *qst = (unsigned short *)(kvc_tc_buf + (STAGES - 1) * L.stage); /* [NTM * 8][D] bf16 */
    {
      const int j = threadIdx.x / TPQ, pd = (threadIdx.x % TPQ) * DPT;
      float amax, sum;
      /* threads per quantization group: 2 .. TPQ / 2 */
      kvc_stage_query<DPT, TPQ>(a, b, hk, q0 + j, Q, pd, kgs / DPT, qst + j * D, &amax, &sum);
      if ((pd & (kgs - 1)) == 0) qsum[(pd >> gk_sh) * NTM * 8 + j] = sum * scl2; /* pre-scaled bias term */
      if (pd == 0) qsig[j] = kvc_query_sigma(amax);
    }
    __syncthreads();
    /* B fragments of k-step kj (32 dims) for lane (g, tq): byte i of b0, b1
     * holds dim kvc_i8_dim(kj, tq, 0 / 1, i) of query 8 nt + g (q4: d0 + 2 i
     * and d0 + 2 i + 1, d0 = 8 (4 kj + tq), the codes the K word 4 kj + tq
     * yields; q8: 32 kj + 4 tq + i and 16 more) */
    for (int idx = threadIdx.x; idx < (D / 32) * 2 * NTM * KVC_WARP; idx += KVC_TC_THREADS) {
      const int kj = idx / (2 * NTM * KVC_WARP), part = (idx / (NTM * KVC_WARP)) % 2;
      const int nt = (idx / KVC_WARP) % NTM, ln = idx % KVC_WARP;
      /* packed groups: column n = ln >> 2 holds query n / gk, zero outside group n % gk */
      const int n = ln >> 2, jq = packed ? n / gk : 8 * nt + n, qv = q0 + jq;
      uint32_t f[2] = {0u, 0u};
      if (qv < Q && (!packed || ((kj * 32) >> gk_sh) == n % gk)) {
        const unsigned short *qp = qst + jq * D;
        const float inv = 1.0f / qsig[jq];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const float y = kvc_bf16_bits(qp[kvc_i8_dim<F>(kj, ln & 3, hh, i)]) * inv;
            const float qh = rintf(y * (1.0f / 128.0f));
            const float v = part ? rintf(y - 128.0f * qh) : qh;
            const int iv = (v == v) ? (int)fminf(fmaxf(v, -127.0f), 127.0f) : 0;
            f[hh] |= (uint32_t)(iv & 0xff) << (8 * i);
          }
      }
      qf[idx] = make_uint2(f[0], f[1]);
    }
  } else {
    /* bf16 query fragments (mma B of S^T per k-step, n-tile, lane). q4 K
     * (dequantized): k-step 2P + h of lane (g, tq) pairs dims (d0, d0 + 4)
     * and (d0 + 1, d0 + 5), d0 = 8 (tq WPL + P) + 2 h: the dims its K word
     * yields. bf16 K: the mma's own order, dims (16 kk + 2 tq, + 1) and
     * (16 kk + 8 + 2 tq, + 1). */
    /* a rotated call's queries: rotated (a warp per vector) into ring slot
     * STAGES - 1 as bf16 rows [NTM * 8][D] (16 NTM D bytes <= a stage), read
     * from there */
    unsigned short *qst = (unsigned short *)(kvc_tc_buf + (STAGES - 1) * L.stage);
    if (a.rot_q) {
      kvc_rotated_query_rows<D>(a, b, hk, q0, NTM * 8, Q, threadIdx.x / KVC_WARP, KVC_TC_WARPS, threadIdx.x % KVC_WARP,
                                [&](int r, int d, unsigned short x) { qst[r * D + d] = x; });
      __syncthreads();
    }
    for (int idx = threadIdx.x; idx < (D / 16) * NTM * KVC_WARP; idx += KVC_TC_THREADS) {
      const int kk = idx / (NTM * KVC_WARP), nt = (idx / KVC_WARP) % NTM, ln = idx % KVC_WARP;
      const int qv = q0 + 8 * nt + (ln >> 2);
      uint2 f = make_uint2(0u, 0u);
      if (qv < Q) {
        f = a.rot_q ? kvc_q_pairs<F, WPL>(qst + (qv - q0) * D, 1, kk, ln & 3)
                    : kvc_q_pairs<F, WPL>((const unsigned short *)kvc_q_at(a, b, hk * a.rep + qv / a.L, qv % a.L, 0),
                                          qds, kk, ln & 3);
      }
      qf[idx] = f;
    }
    for (int j = threadIdx.x; j < NTM * 8; j += KVC_TC_THREADS) qsig[j] = 1.0f;
    __syncthreads();
  }

  /* this lane's query columns 8 nt + 2 tq + j: positions, segments, state */
  long long pos[NTM][2];
  int32_t segp[NTM][2];
  float m[NTM][2], l[NTM][2], sig[NTM][2];
#pragma unroll
  for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int qv = q0 + 8 * nt + 2 * tq + j;
      sig[nt][j] = qsig[8 * nt + 2 * tq + j] * scl2; /* q.k -> logit in log2 units in the same multiply */
      const bool ok = qv < Q;
      pos[nt][j] = len - a.L + (ok ? qv % a.L : 0);
      segp[nt][j] = ok ? kvc_seg_of_row(a, b, pos[nt][j]) : 0;
      m[nt][j] = -INFINITY;
      l[nt][j] = 0.0f;
    }
  /* packed groups: this lane's columns 2 tq, 2 tq + 1 are query pq, groups pg, pg + 1 */
  const int pq = packed ? (2 * tq) / gk : 0, pg = packed ? (2 * tq) % gk : 0;
  const bool pok = packed && q0 + pq < Q;
  const float psig = packed ? qsig[pq] * scl2 : 0.0f;
  const float pqs[2] = {packed ? qsum[pg * 8 + pq] : 0.0f, packed ? qsum[(pg + 1) * 8 + pq] : 0.0f};
  float acc[MT][NTM][4], accc[NTM][4]; /* accc: q8's correction sums (kvc_pv_step_q8) */
#pragma unroll
  for (int nt = 0; nt < NTM; ++nt) {
    accc[nt][0] = accc[nt][1] = accc[nt][2] = accc[nt][3] = 0.0f;
#pragma unroll
    for (int i = 0; i < MT; ++i) acc[i][nt][0] = acc[i][nt][1] = acc[i][nt][2] = acc[i][nt][3] = 0.0f;
  }

  unsigned short *ps = (unsigned short *)(kvc_tc_buf + L.p);
  float *wmax = (float *)(kvc_tc_buf + L.wmax), *lsum = (float *)(kvc_tc_buf + L.lsum);
  /* V slice of this lane: words xw .. xw + VPL - 1 of each token row, codes cb .. of each */
  constexpr int VPL = kvc_tc_vpl(MT), MPW = MT / VPL;
  const int xw = VPL > 1 ? warp * WPL + VPL * g : warp * WPL + g % WPL, cb = VPL > 1 ? 0 : (g / WPL) * 2 * MT;
  /* q8: word xq + 8 w of each token row (m-tiles 2 w, 2 w + 1), all in the group of the warp's dims */
  const int xq = warp * (D / 16) + g;
  const int vgi = ((F == KVC_Q8 ? 4 * xq : 8 * xw)) >> gv_sh;

  for (int s = 0; s < nst; ++s) {
    kvc_cp_wait<STAGES - 2>(); /* this thread's copies of stage s landed */
    __syncthreads();                  /* everyone's; and slot (s - 1) % STAGES is free */
    {
      const int sn = s + STAGES - 1;
      if (sn < nst)
        kvc_tc_load_stage<F, D>(a, L, ld, ring + (sn % STAGES) * L.stage, fo, t_lo + (long long)sn * KVC_TC_TOK, t_hi,
                                ids + (sn % (2 * STAGES)) * KVC_TC_IDS);
      if (tbl) /* the ids of stage sn + STAGES - 1, in this stage's commit group */
        kvc_tc_issue_ids(a, b, fo, t_lo + (long long)(sn + STAGES - 1) * KVC_TC_TOK, t_hi,
                         ids_sh + ((sn + STAGES - 1) % (2 * STAGES)) * KVC_TC_IDS * 4);
      kvc_cp_commit();
    }
    const unsigned char *st = kvc_tc_buf + (s % STAGES) * L.stage;
    const long long t0 = t_lo + (long long)s * KVC_TC_TOK;
    const int so = kvc_tc_so(gk, t0, e0); /* one group per row: the stage's scale entries start so in */

    /* ---- S phase: tokens r0 = 16 warp + g and r1 = r0 + 8 of the stage ----
     * k-step kj (32 dims, inside one group): lane tq's K word 4 kj + tq of
     * each token gives the u8 codes (even codes: w & 0x0F0F0F0F, odd:
     * (w >> 4) & 0x0F0F0F0F) of mma A; integer dots with qh and ql; at the
     * group's end dot += scale * (128 dot_h + dot_l) and the bias term
     * bias * sum(q over the group) accumulates apart; q.k = sigma dot + bias terms. */
    float sc[NTM][4], sbias[NTM][4];
    if (I8 && packed) {
      /* groups packed into the mma columns (col n = query n / gk, group n % gk;
       * the query fragments are zero outside their column's group): one s32
       * accumulator pair over all D dims, no per-group epilogue in the
       * k-loop. Per stage: x(t, q) = sum over the gk columns of q of
       * scale(t, G) sigma_q (128 dot_h + dot_l) + bias(t, G) sum_G(q), in
       * lane pairs, then moved to the standard layout (lane tq: queries 2 tq,
       * 2 tq + 1). */
      const int r0 = KVC_TC_SUB * warp + g, r1 = r0 + 8;
      const uint32_t *p0 = (const uint32_t *)(st + L.kd + r0 * L.rs) + tq;
      const uint32_t *p1 = (const uint32_t *)(st + L.kd + r1 * L.rs) + tq;
      int ah[4] = {0, 0, 0, 0}, al[4] = {0, 0, 0, 0};
#pragma unroll
      for (int kj = 0; kj < D / 32; ++kj) {
        uint32_t af[4];
        kvc_s_codes<F>(p0, p1, kj, af);
        const uint2 fh = qf[(2 * kj) * KVC_WARP + lane], fl = qf[(2 * kj + 1) * KVC_WARP + lane];
        kvc_mma_u8s8(ah, af, fh.x, fh.y);
        kvc_mma_u8s8(al, af, fl.x, fl.y);
      }
      /* this lane's columns 2 tq, 2 tq + 1: groups pg, pg + 1 of one query */
      const uint32_t s0 = *(const uint32_t *)(st + L.ks + (r0 * gk + pg) * 2);
      const uint32_t s1 = *(const uint32_t *)(st + L.ks + (r1 * gk + pg) * 2);
      const uint32_t z0 = *(const uint32_t *)(st + L.kb + (r0 * gk + pg) * 2);
      const uint32_t z1 = *(const uint32_t *)(st + L.kb + (r1 * gk + pg) * 2);
      float tot[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t sw = r ? s1 : s0, zw = r ? z1 : z0;
        const float x0 = fmaf(kvc_bf16_bits(sw & 0xffffu) * psig, (float)(128 * ah[2 * r] + al[2 * r]),
                              kvc_bf16_bits(zw & 0xffffu) * pqs[0]);
        const float x1 = fmaf(kvc_bf16_bits(sw >> 16) * psig, (float)(128 * ah[2 * r + 1] + al[2 * r + 1]),
                              kvc_bf16_bits(zw >> 16) * pqs[1]);
        tot[r] = pok ? x0 + x1 : 0.0f;
        for (int off = 1; off < gk / 2; off <<= 1) tot[r] += __shfl_xor_sync(KVC_FULL_MASK, tot[r], off);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) { /* query 2 tq + (e & 1) sits on quad lane (2 tq + (e & 1)) gk / 2 */
        const int src = (lane & ~3) | ((((2 * tq + (e & 1)) * gk) >> 1) & 3);
        sc[0][e] = __shfl_sync(KVC_FULL_MASK, tot[e >> 1], src);
      }
    } else if (I8) {
      const int r0 = KVC_TC_SUB * warp + g, r1 = r0 + 8;
      const uint32_t *p0 = (const uint32_t *)(st + L.kd + r0 * L.rs) + tq;
      const uint32_t *p1 = (const uint32_t *)(st + L.kd + r1 * L.rs) + tq;
      int ah[NTM][4], al[NTM][4];
#pragma unroll
      for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sc[nt][e] = sbias[nt][e] = 0.0f;
          ah[nt][e] = al[nt][e] = 0;
        }
#pragma unroll
      for (int kj = 0; kj < D / 32; ++kj) {
        uint32_t af[4];
        kvc_s_codes<F>(p0, p1, kj, af);
#pragma unroll
        for (int nt = 0; nt < NTM; ++nt)
          if (nt < ntc) {
            const uint2 fh = qf[((2 * kj) * NTM + nt) * KVC_WARP + lane];
            const uint2 fl = qf[((2 * kj + 1) * NTM + nt) * KVC_WARP + lane];
            kvc_mma_u8s8(ah[nt], af, fh.x, fh.y);
            kvc_mma_u8s8(al[nt], af, fl.x, fl.y);
          }
        if ((((kj + 1) * 32) & (kgs - 1)) == 0) { /* the group ends with this k-step */
          const int gi = (kj * 32) >> gk_sh, ge = gi + so; /* ge: its scale entry (kvc_tc_so) */
          const float s0 = kvc_bf16_bits(kvc_lds16(st + L.ks + (r0 * gk + ge) * 2));
          const float z0 = kvc_bf16_bits(kvc_lds16(st + L.kb + (r0 * gk + ge) * 2));
          const float s1 = kvc_bf16_bits(kvc_lds16(st + L.ks + (r1 * gk + ge) * 2));
          const float z1 = kvc_bf16_bits(kvc_lds16(st + L.kb + (r1 * gk + ge) * 2));
#pragma unroll
          for (int nt = 0; nt < NTM; ++nt)
            if (nt < ntc) {
              const float2 qs = *(const float2 *)(qsum + gi * NTM * 8 + 8 * nt + 2 * tq);
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float sv = (e >> 1) ? s1 : s0, zv = (e >> 1) ? z1 : z0;
                sc[nt][e] = fmaf(sv, (float)(128 * ah[nt][e] + al[nt][e]), sc[nt][e]);
                sbias[nt][e] = fmaf(zv, (e & 1) ? qs.y : qs.x, sbias[nt][e]);
                ah[nt][e] = al[nt][e] = 0;
              }
            }
        }
      }
#pragma unroll
      for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] = fmaf(sc[nt][e], sig[nt][e & 1], sbias[nt][e]); /* x = scl2 q.k */
    }
    else if (FP8) {
      /* fp8 K rows: word 4 kk + tq of rows r0, r1 holds dims 16 kk + 4 tq .. + 3
       * (k columns 2 tq, + 1 and 2 tq + 8, + 9: the q8 order of the query
       * fragments), times the row's scale in f32, rounded to bf16 */
      const int r0 = KVC_TC_SUB * warp + g, r1 = r0 + 8;
      const uint32_t *p0 = (const uint32_t *)(st + L.kd + r0 * L.rs) + tq;
      const uint32_t *p1 = (const uint32_t *)(st + L.kd + r1 * L.rs) + tq;
      const float s0 = kvc_fp8_scale(st, L.ks, r0, ksc), s1 = kvc_fp8_scale(st, L.ks, r1, ksc);
#pragma unroll
      for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] = sbias[nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t w0 = p0[4 * kk], w1 = p1[4 * kk];
        const uint32_t af[4] = {kvc_deq_fp8x2<F>(w0, s0, s0), kvc_deq_fp8x2<F>(w1, s1, s1),
                                kvc_deq_fp8x2<F>(w0 >> 16, s0, s0), kvc_deq_fp8x2<F>(w1 >> 16, s1, s1)};
#pragma unroll
        for (int nt = 0; nt < NTM; ++nt)
          if (nt < ntc) {
            const uint2 f = qf[(kk * NTM + nt) * KVC_WARP + lane];
            kvc_mma_bf16((kk & 1) ? sbias[nt] : sc[nt], af, f.x, f.y); /* two chains; summed below */
          }
      }
#pragma unroll
      for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] = (sc[nt][e] + sbias[nt][e]) * sig[nt][e & 1]; /* x = scl2 q.k */
    }
    else if (BF) { /* float K rows: A fragments straight from shared memory (dims 16 kk + 2 tq, + 8) */
      const int r0 = KVC_TC_SUB * warp + g, r1 = r0 + 8;
      const uint32_t *p0 = (const uint32_t *)(st + L.kd + r0 * L.rs) + tq;
      const uint32_t *p1 = (const uint32_t *)(st + L.kd + r1 * L.rs) + tq;
#pragma unroll
      for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] = sbias[nt][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t af[4] = {p0[8 * kk], p1[8 * kk], p0[8 * kk + 4], p1[8 * kk + 4]};
#pragma unroll
        for (int nt = 0; nt < NTM; ++nt)
          if (nt < ntc) {
            const uint2 f = qf[(kk * NTM + nt) * KVC_WARP + lane];
            kvc_mma16<F>((kk & 1) ? sbias[nt] : sc[nt], af, f.x, f.y); /* two chains; summed below */
          }
      }
#pragma unroll
      for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] = (sc[nt][e] + sbias[nt][e]) * sig[nt][e & 1]; /* x = scl2 q.k */
    }
    else { /* q4 K dequantized to bf16 into mma A registers, one rounding per element */
      const int r0 = KVC_TC_SUB * warp + g, r1 = r0 + 8;
      const uint32_t *p0 = (const uint32_t *)(st + L.kd + r0 * L.rs) + tq * WPL;
      const uint32_t *p1 = (const uint32_t *)(st + L.kd + r1 * L.rs) + tq * WPL;
#pragma unroll
      for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] = sbias[nt][e] = 0.0f;
      /* not unrolled: the loop body (8 NTM mma) is the kernel's largest code;
       * unrolled, its instructions outgrow the instruction caches */
#pragma unroll 1
      for (int P = 0; P < WPL; ++P) {
        const uint32_t kw0 = p0[P], kw1 = p1[P];
        const int gi = ((8 * (tq * WPL + P)) >> gk_sh) + so;
        const uint32_t sa = kvc_lds16(st + L.ks + (r0 * gk + gi) * 2), ba = kvc_lds16(st + L.kb + (r0 * gk + gi) * 2);
        const uint32_t sb = kvc_lds16(st + L.ks + (r1 * gk + gi) * 2), bb = kvc_lds16(st + L.kb + (r1 * gk + gi) * 2);
        const uint32_t sa2 = sa | (sa << 16), ba2 = ba | (ba << 16), sb2 = sb | (sb << 16), bb2 = bb | (bb << 16);
#pragma unroll
        for (int h = 0; h < 2; ++h) { /* k-step 2P + h: codes (2h, 2h + 4) and (2h + 1, 2h + 5) */
          uint32_t af[4];
          af[0] = kvc_deq_pair(kw0, 2 * h, sa2, ba2);
          af[1] = kvc_deq_pair(kw1, 2 * h, sb2, bb2);
          af[2] = kvc_deq_pair(kw0, 2 * h + 1, sa2, ba2);
          af[3] = kvc_deq_pair(kw1, 2 * h + 1, sb2, bb2);
          const int kk = 2 * P + h;
#pragma unroll
          for (int nt = 0; nt < NTM; ++nt)
            if (nt < ntc) {
              const uint2 f = qf[(kk * NTM + nt) * KVC_WARP + lane];
              kvc_mma_bf16(h ? sbias[nt] : sc[nt], af, f.x, f.y); /* two chains; summed below */
            }
        }
      }
#pragma unroll
      for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] = (sc[nt][e] + sbias[nt][e]) * sig[nt][e & 1]; /* x = scl2 q.k */
    }
    /* masks and logits (log2 units); c0 (token g, query 2tq), c1 (g, 2tq + 1),
     * c2/c3 (token g + 8). A stage wholly inside every row's causal window
     * (the common case) skips the per-key mask test. */
    const bool full = kvc_tc_stage_full(a, t0, t_hi, len);
    bool vis[NTM][4];
#pragma unroll
    for (int nt = 0; nt < NTM; ++nt) {
      if (capped)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] = cap2 * tanhf(sc[nt][e] * cap2_inv);
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = e & 1, qv = q0 + 8 * nt + 2 * tq + j;
        bool v = qv < Q;
        if (!full) {
          const long long t = t0 + KVC_TC_SUB * warp + g + 8 * (e >> 1);
          v = v && t < t_hi;
          if (v && kvc_causal_family(a)) v = kvc_causal_visible(a, b, t, pos[nt][j], segp[nt][j], len);
        }
        const float xl = v ? sc[nt][e] : -INFINITY;
        vis[nt][e] = v && xl != -INFINITY;
        sc[nt][e] = xl;
        mx[j] = kvc_max(mx[j], xl);
      }
#pragma unroll
      for (int off = 4; off < KVC_WARP; off <<= 1)
#pragma unroll
        for (int j = 0; j < 2; ++j) mx[j] = kvc_max(mx[j], __shfl_xor_sync(KVC_FULL_MASK, mx[j], off));
      if (g == 0)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmax[warp * NTM * 8 + 8 * nt + 2 * tq + j] = mx[j];
    }
    __syncthreads();
    /* the stage max over the warps (fixed order: every warp gets the same m) */
    float corr[NTM][2];
#pragma unroll
    for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < KVC_TC_WARPS; ++w) mx = kvc_max(mx, wmax[w * NTM * 8 + 8 * nt + 2 * tq + j]);
        const float mn = kvc_max(m[nt][j], mx);
        corr[nt][j] = 1.0f;
        if (mn != -INFINITY && !(mn == m[nt][j])) { /* the max grew (or is NaN) */
          corr[nt][j] = kvc_exp2(m[nt][j] - mn);    /* 0 when m = -inf */
          m[nt][j] = mn;
          l[nt][j] *= corr[nt][j];
        }
      }
    /* P (bf16; f16 for f16 rows) to [query][token]; l sums the rounded values */
#pragma unroll
    for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = e & 1;
        const float p = vis[nt][e] ? kvc_exp2(sc[nt][e] - m[nt][j]) : 0.0f;
        float pr;
        const unsigned short pb = kvc_p16<F>(p, &pr);
        l[nt][j] += pr;
        ps[(8 * nt + 2 * tq + j) * KVC_TC_PS + KVC_TC_SUB * warp + g + 8 * (e >> 1)] = pb;
      }
#pragma unroll
    for (int nt = 0; nt < NTM; ++nt) {
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        acc[i][nt][0] *= corr[nt][0];
        acc[i][nt][1] *= corr[nt][1];
        acc[i][nt][2] *= corr[nt][0];
        acc[i][nt][3] *= corr[nt][1];
      }
      if (F == KVC_Q8) accc[nt][0] *= corr[nt][0], accc[nt][1] *= corr[nt][1]; /* rows all equal: r = 0 suffices */
    }
    __syncthreads();

    /* ---- PV phase: O^T[dims of this warp] += V^T P^T over the 64 tokens ---- */
#pragma unroll PVU
    for (int kq = 0; kq < KVC_TC_TOK / 16; ++kq) {
      uint32_t pb[NTM][2];
      kvc_p_frags<NTM>(ps, KVC_TC_PS, 16 * kq + 2 * tq, g, ntc, pb);
      /* bf16 / fp8: the warp's dims are dim pairs warp D/8 .. of the rows */
      if (F == KVC_Q8)
        kvc_pv_step_q8<MT, NTM>(st, L, 16 * kq + 2 * tq, xq, vgi + so, gv, pb, ntc, acc, accc);
      else
        kvc_pv_step<F, MT, NTM>(st, L, 16 * kq + 2 * tq, PR ? warp * (D / 8) + g : xw, cb, vgi + so, gv, pb, ntc, acc,
                                vsc);
    }
  }
  kvc_cp_wait<0>(); /* no copy outstanding at exit (the empty tail groups) */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion(); /* the merge waits for this grid's completion */
#endif
  /* l: over the 8 lanes of a query column, then over the warps (fixed order) */
#pragma unroll
  for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int off = 4; off < KVC_WARP; off <<= 1) l[nt][j] += __shfl_xor_sync(KVC_FULL_MASK, l[nt][j], off);
      if (g == 0) lsum[warp * NTM * 8 + 8 * nt + 2 * tq + j] = l[nt][j];
    }
  __syncthreads(); /* also: every warp is done with the ring */
  /* the final states through the idle ring: O [NTM 8][D], then m and L per
   * vector (m is the same in every warp) */
  static_assert(kvc_tc_stages(NTM) * KVC_TC_TOK * D >= (NTM * 8 * (D + 2)) * 4,
                "the ring (stages of 64 K and V rows, >= D bytes a row pair) holds the final states");
  float *ost = (float *)kvc_tc_buf, *ms = ost + NTM * 8 * D, *ls = ms + NTM * 8;
#pragma unroll
  for (int nt = 0; nt < NTM; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int qr = 8 * nt + 2 * tq + j;
      if (warp == 0 && g == 0) {
        float Ls = 0.0f;
#pragma unroll
        for (int w = 0; w < KVC_TC_WARPS; ++w) Ls += lsum[w * NTM * 8 + qr];
        ms[qr] = m[nt][j];
        ls[qr] = Ls;
      }
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) { /* rows g (code c0) and g + 8 (code c0 + 1) */
          const int d = PR ? 2 * (warp * (D / 8) + 8 * i + g) + r
                           : F == KVC_Q8 ? 4 * (xq + 8 * (i / 2)) + 2 * (i % 2) + r
                                         : 8 * (xw + i / MPW) + cb + 2 * (i % MPW) + r;
          ost[qr * D + d] = acc[i][nt][2 * r + j] + (F == KVC_Q8 ? accc[nt][j] : 0.0f);
        }
    }
  __syncthreads();
  kvc_emit_block<D>(a, split, b, hk, q0, min(NTM * 8, Q - q0), D, D, ost, ms, ls, KVC_TC_THREADS);
}

/* ---- the wide kernel: up to 48 query vectors per KV head (verify, GQA x L) ----
 * One block of 8 warps takes all KVC_TCW_QV query vectors of a KV head over
 * a token split, so each K/V byte is staged and dequantized once per block
 * (the narrow kernel's 32-vector instance re-read and re-dequantized K/V for
 * every 32 vectors). Same ring, loader (warps 0-3 issue the copies) and stage
 * layout as kvc_tc_kernel.
 *   S^T = Q K^T with the queries as mma M (KVC_TCW_MQ m-tiles of 16) and the
 *         tokens as N: warp w takes tokens 8w..8w+7 of the stage, so each K
 *         element is dequantized by one lane of one warp (q4: LOP3 magic +
 *         two bf16x2 FMAs per pair; q8: byte to f32, scale * code + bias,
 *         rounded to bf16; fp8: two codes per cvt to f16, times the row
 *         scale in f32, rounded to bf16; bf16: the row words are the B
 *         fragments).
 *         The query A fragments sit in shared memory in the dim order the K
 *         words yield (16 B per lane, k-step and m-tile); a rotated call's
 *         query (a.rot_q) rotated in registers first, a warp per vector
 *         (kvc_rotated_query_rows), its elements stored into those slots.
 *   softmax: per query, the max over the warp's 8 tokens by two shuffles,
 *         over the 8 warps through shared memory (every warp computes the
 *         same running max; warp 0 publishes the correction factors);
 *         P = 2^(s - m) in bf16 to shared memory.
 *   O^T += V^T P^T: warp w takes a slice of 16 MTV head dims (D >= 128: 8
 *         slices over the 64 tokens; D = 64: 4 slices x 2 token halves,
 *         added at the end) for all 6 n-tiles of 8 query vectors; V
 *         dequantized as K (q4, q8) or taken as it is (bf16).
 *   launch: grid (ceil(rep L / 48), nsplit, B KVH) x 256 threads, one block
 *         per SM (shared memory ~115 KB at q4 D = 256, 4 slots; q8 ~185 KB,
 *         4 slots; bf16 D = 256 2 slots of 66 KB); three __syncthreads per
 *         stage. */
#define KVC_TCW_WARPS 8
#define KVC_TCW_THREADS (KVC_TCW_WARPS * KVC_WARP)
#define KVC_TCW_MQ 3                /* query m-tiles of 16 in S */
#define KVC_TCW_QV (16 * KVC_TCW_MQ) /* query vectors per block */
__host__ __device__ constexpr int kvc_tcw_stages(int f, int D) { return kvc_tc_float(f) && D == 256 ? 2 : 4; }
__host__ __device__ inline kvc_tc_layout kvc_tcw_layout_of(int f, int D, int gk, int gv) {
  kvc_tc_layout l;
  kvc_tc_stage_layout(l, f, D, gk, gv);
  l.qf = kvc_tcw_stages(f, D) * l.stage;
  l.p = l.qf + (D / 16) * KVC_TCW_MQ * KVC_WARP * 16;
  l.wmax = l.p + KVC_TCW_QV * KVC_TC_PS * 2;
  l.lsum = l.wmax + KVC_TCW_QV * KVC_TCW_WARPS * 4;
  l.corr = l.lsum + KVC_TCW_QV * KVC_TCW_WARPS * 4;
  l.mrow = l.corr + KVC_TCW_QV * 4;
  l.total = l.mrow + KVC_TCW_QV * 4;
  l.ids = l.total; /* not used: the wide kernel loads a thread's block id a stage ahead */
  l.qsig = l.qsum = l.total;
  return l;
}

/* One k-step of the wide kernel's S^T: the query A fragments of m-tiles
 * below mqc (shared memory, k-step kk) times this lane's K B fragment
 * (b0, b1), in format F's 16-bit type (bf16 for the quantized formats). */
template <int F, int MQ>
__device__ __forceinline__ void kvc_tcw_s_kstep(float (&sc)[MQ][4], const uint4 *qa, int kk, int lane, int mqc,
                                                uint32_t b0, uint32_t b1) {
#pragma unroll
  for (int mq = 0; mq < MQ; ++mq)
    if (mq < mqc) {
      const uint4 f = qa[(kk * MQ + mq) * KVC_WARP + lane];
      const uint32_t af[4] = {f.x, f.y, f.z, f.w};
      kvc_mma16<F>(sc[mq], af, b0, b1);
    }
}

/* Where element d of the block's query vector r (< KVC_TCW_QV) sits among
 * the wide kernel's query A fragments (qa, uint4 [KS][MQ][32], as 16-bit
 * halves): the slot the unrotated load below fills with it, i.e. the
 * inverse of kvc_q_pairs' dim order (component 2 y + r / 8 of lane
 * 4 (r % 8) + t4, m-tile r / 16; the low half the pair's first dim):
 * float rows d = 16 kk + 8 y + 2 t4 + hi; q8 / fp8 d = 16 kk + 4 t4 + 2 y
 * + hi; q4 d = 8 (t4 WPL + kk / 2) + 2 (kk % 2) + y + 4 hi. */
template <int F, int WPL, int MQ> __device__ __forceinline__ int kvc_tcw_q_slot(int r, int d) {
  constexpr bool B8 = F == KVC_Q8 || kvc_tc_fp8(F);
  int kk, t4, y, hi;
  if (kvc_tc_float(F) || B8) {
    const int w = d & 15;
    kk = d >> 4;
    t4 = kvc_tc_float(F) ? (w & 7) >> 1 : w >> 2;
    y = kvc_tc_float(F) ? w >> 3 : (w >> 1) & 1;
    hi = w & 1;
  } else {
    const int blk = d >> 3, w = d & 7;
    t4 = blk / WPL;
    kk = 2 * (blk % WPL) + ((w >> 1) & 1);
    y = w & 1;
    hi = w >> 2;
  }
  const int mq = r >> 4, rr = r & 15, ln = 4 * (rr & 7) + t4;
  return (((kk * MQ + mq) * KVC_WARP + ln) * 4 + 2 * y + (rr >> 3)) * 2 + hi;
}

template <int F, int D>
__global__ void __launch_bounds__(KVC_TCW_THREADS, 1) kvc_tcw_kernel(const kvc_args a) {
  constexpr int STAGES = kvc_tcw_stages(F, D);
  constexpr bool BF = kvc_tc_float(F); /* bf16 / f16 rows */
  constexpr bool FP8 = kvc_tc_fp8(F);  /* fp8 rows: no groups, one f32 scale per row */
  constexpr bool PAIRS = BF || F == KVC_Q8 || FP8; /* P.V m-tile rows are dim pairs (2 x, 2 x + 1) */
  constexpr int MQ = KVC_TCW_MQ, NT = 2 * MQ; /* query m-tiles (S), n-tiles (PV) */
  constexpr int KS = D / 16;                  /* k-steps of S */
  constexpr int WPL = D / 32;                 /* q4: K words per lane and token (S) */
  constexpr int NSL = D / 16 < KVC_TCW_WARPS ? D / 16 : KVC_TCW_WARPS; /* PV dim slices */
  constexpr int MTV = D / 16 / NSL;           /* m-tiles (16 dims) per slice */
  constexpr int TSL = KVC_TCW_WARPS / NSL;    /* PV token slices: 2 at D = 64, else 1 */
  constexpr int KQ = KVC_TC_TOK / 16 / TSL;   /* PV k-steps (16 tokens) per warp */
  constexpr int WPS = 2 * MTV;                /* q4 V words per slice */
  extern __shared__ __align__(128) unsigned char kvc_tc_buf[];
  const int lane = threadIdx.x % KVC_WARP, warp = threadIdx.x / KVC_WARP;
  const int g = lane >> 2, tq = lane & 3;
  const int qg = kvc_qtile(), split = blockIdx.y;
  const int b = blockIdx.z / a.KVH, hk = blockIdx.z % a.KVH;
  const int gk = BF || FP8 ? 0 : D / a.k.group, gv = BF || FP8 ? 0 : D / a.v.group;
  const int gk_sh = BF || FP8 ? 0 : 31 - __clz(a.k.group), gv_sh = BF || FP8 ? 0 : 31 - __clz(a.v.group);
  const kvc_tc_layout L = kvc_tcw_layout_of(F, D, gk, gv);
  const bool ksc = a.k.scales != nullptr, vsc = a.v.scales != nullptr; /* fp8: rows with scales */
  const long long len = kvc_seq_len(a, b);
  const int fo = kvc_first_offset(a.k, b), e0 = kvc_tc_e0(a, b, hk, fo);
  const int Q = a.rep * a.L, q0 = qg * KVC_TCW_QV;
  const int mqc = min(MQ, (Q - q0 + 15) / 16), ntc = min(NT, (Q - q0 + 7) / 8); /* tiles with query vectors */

  long long t_lo, t_hi;
  const int nst = kvc_tc_range(a, split, len, q0, KVC_TCW_QV, &t_lo, &t_hi);
  const float scl2 = a.scale * KVC_LOG2E, cap2 = a.softcap * KVC_LOG2E, cap2_inv = a.softcap_inv * (1.0f / KVC_LOG2E);
  const bool capped = a.softcap > 0.0f;

  /* warps 0-3 run the narrow kernel's loader (it is laid out for 128 threads) */
  const bool loads = threadIdx.x < KVC_TC_THREADS;
  const uint32_t ring = (uint32_t)__cvta_generic_to_shared(kvc_tc_buf);
  kvc_tc_loader ld = kvc_tc_loader_of<F, D, 0, false>(a, L, b, hk, t_lo);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    const long long ts = t_lo + (long long)s * KVC_TC_TOK;
    if (loads && s < nst)
      kvc_tc_load_stage<F, D, false>(a, L, ld, ring + s * L.stage, fo, ts, t_hi, nullptr,
                                     kvc_tc_table_id(a, b, fo, ts, t_hi));
    kvc_cp_commit();
  }
  int id_next = loads ? kvc_tc_table_id(a, b, fo, t_lo + (long long)(STAGES - 1) * KVC_TC_TOK, t_hi) : 0;

  /* query A fragments of k-step kk, m-tile mq for lane (g, tq): {x(16 mq + g),
   * x(16 mq + g + 8), y(16 mq + g), y(16 mq + g + 8)} with x, y the dim pairs
   * of k columns (2 tq, 2 tq + 1) and (2 tq + 8, 2 tq + 9): q4, k-step
   * 2P + h: (d0, d0 + 4) and (d0 + 1, d0 + 5), d0 = 8 (tq WPL + P) + 2 h (the
   * codes kvc_deq_pair takes from K word tq WPL + P); bf16: (16 kk + 2 tq,
   * + 1) and (16 kk + 8 + 2 tq, + 1); q8: (16 kk + 4 tq, + 1) and (+ 2, + 3) */
  uint4 *qa = (uint4 *)(kvc_tc_buf + L.qf);
  const long long qds = a.qs[3] / 2;
  if (a.rot_q) { /* a rotated call's queries: a warp per vector, rotated in registers (rows past Q zeros), each
                  * element stored straight into its fragment slot */
    unsigned short *qh = (unsigned short *)qa;
    kvc_rotated_query_rows<D>(a, b, hk, q0, KVC_TCW_QV, Q, warp, KVC_TCW_WARPS, lane,
                              [&](int r, int d, unsigned short x) { qh[kvc_tcw_q_slot<F, WPL, MQ>(r, d)] = x; });
  } else {
    for (int idx = threadIdx.x; idx < KS * MQ * KVC_WARP; idx += KVC_TCW_THREADS) {
      const int kk = idx / (MQ * KVC_WARP), mq = (idx / KVC_WARP) % MQ, ln = idx % KVC_WARP, t4 = ln & 3;
      uint32_t f[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int qv = q0 + 16 * mq + (ln >> 2) + 8 * r;
        if (qv >= Q) continue;
        const uint2 x = kvc_q_pairs<F, WPL>((const unsigned short *)kvc_q_at(a, b, hk * a.rep + qv / a.L, qv % a.L, 0),
                                            qds, kk, t4);
        f[r] = x.x;
        f[2 + r] = x.y;
      }
      qa[idx] = make_uint4(f[0], f[1], f[2], f[3]);
    }
  }
  __syncthreads();

  /* S layout: this lane's queries 16 mq + g + 8 r (rows of the S^T tiles) */
  long long pos[MQ][2];
  int32_t segp[MQ][2];
  float m[MQ][2], l[MQ][2];
#pragma unroll
  for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int qv = q0 + 16 * mq + g + 8 * r;
      const bool ok = qv < Q;
      pos[mq][r] = len - a.L + (ok ? qv % a.L : 0);
      segp[mq][r] = ok ? kvc_seg_of_row(a, b, pos[mq][r]) : 0;
      m[mq][r] = -INFINITY;
      l[mq][r] = 0.0f;
    }
  /* PV layout: dim slice sl, token slice th; acc columns 8 nt + 2 tq + j */
  const int sl = warp % NSL, th = warp / NSL;
  /* q4: V word and first code of this lane; bf16 / q8: its dim pair of m-tile 0 */
  const int xw = PAIRS ? sl * 8 * MTV + g : sl * WPS + g % WPS, cb = PAIRS ? 0 : (g / WPS) * 2 * MTV;
  const int vgi = BF || FP8 ? 0 : ((PAIRS ? 2 : 8) * xw) >> gv_sh;
  float acc[MTV][NT][4];
#pragma unroll
  for (int i = 0; i < MTV; ++i)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[i][nt][0] = acc[i][nt][1] = acc[i][nt][2] = acc[i][nt][3] = 0.0f;

  unsigned short *ps = (unsigned short *)(kvc_tc_buf + L.p);
  float *wmax = (float *)(kvc_tc_buf + L.wmax), *lsum = (float *)(kvc_tc_buf + L.lsum);
  float *corrs = (float *)(kvc_tc_buf + L.corr), *mrow = (float *)(kvc_tc_buf + L.mrow);

  for (int s = 0; s < nst; ++s) {
    kvc_cp_wait<STAGES - 2>();
    __syncthreads();
    {
      const int sn = s + STAGES - 1;
      if (loads && sn < nst)
        kvc_tc_load_stage<F, D, false>(a, L, ld, ring + (sn % STAGES) * L.stage, fo, t_lo + (long long)sn * KVC_TC_TOK,
                                       t_hi, nullptr, id_next);
      kvc_cp_commit();
      if (loads) id_next = kvc_tc_table_id(a, b, fo, t_lo + (long long)(sn + 1) * KVC_TC_TOK, t_hi);
    }
    const unsigned char *st = kvc_tc_buf + (s % STAGES) * L.stage;
    const long long t0 = t_lo + (long long)s * KVC_TC_TOK;
    const int so = kvc_tc_so(gk, t0, e0); /* one group per row: the stage's scale entries start so in */

    /* ---- S^T phase: token row 8 warp + g is this lane's B column ---- */
    const int tok = 8 * warp + g;
    float sc[MQ][4];
#pragma unroll
    for (int mq = 0; mq < MQ; ++mq) sc[mq][0] = sc[mq][1] = sc[mq][2] = sc[mq][3] = 0.0f;
    if (BF) {
      const uint32_t *kr = (const uint32_t *)(st + L.kd + tok * L.rs) + tq;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        const uint32_t b0 = kr[8 * kk], b1 = kr[8 * kk + 4];
        kvc_tcw_s_kstep<F, MQ>(sc, qa, kk, lane, mqc, b0, b1);
      }
    } else if (FP8) {
      /* k-step kk: K word 4 kk + tq of the token gives dims 16 kk + 4 tq .. + 3
       * (k rows 2 tq, + 1 and 2 tq + 8, + 9), to bf16 times the row's scale */
      const uint32_t *kr = (const uint32_t *)(st + L.kd + tok * L.rs) + tq;
      const float s1 = kvc_fp8_scale(st, L.ks, tok, ksc);
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        const uint32_t w = kr[4 * kk];
        const uint32_t b0 = kvc_deq_fp8x2<F>(w, s1, s1), b1 = kvc_deq_fp8x2<F>(w >> 16, s1, s1);
        kvc_tcw_s_kstep<F, MQ>(sc, qa, kk, lane, mqc, b0, b1);
      }
    } else if (F == KVC_Q8) {
      /* k-step kk: K word 4 kk + tq of the token gives dims 16 kk + 4 tq .. + 3
       * (k rows 2 tq, + 1 and 2 tq + 8, + 9), dequantized in f32 and rounded
       * to bf16 once; the 16 dims lie in one group */
      const uint32_t *kr = (const uint32_t *)(st + L.kd + tok * L.rs) + tq;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        const int gi = ((16 * kk) >> gk_sh) + so;
        const float s1 = kvc_bf16_bits(kvc_lds16(st + L.ks + (tok * gk + gi) * 2));
        const float z1 = kvc_bf16_bits(kvc_lds16(st + L.kb + (tok * gk + gi) * 2));
        const uint32_t w = kr[4 * kk];
        const uint32_t b0 = kvc_deq8_pair(w, 0, s1, z1, w, 1, s1, z1), b1 = kvc_deq8_pair(w, 2, s1, z1, w, 3, s1, z1);
        kvc_tcw_s_kstep<F, MQ>(sc, qa, kk, lane, mqc, b0, b1);
      }
    } else {
      const uint32_t *kr = (const uint32_t *)(st + L.kd + tok * L.rs) + tq * WPL;
      uint32_t kw[WPL];
#pragma unroll
      for (int k = 0; k < WPL; k += 2) {
        const uint2 x = *(const uint2 *)(kr + k);
        kw[k] = x.x;
        kw[k + 1] = x.y;
      }
      /* unrolled: rolled (code size) it measured 8 % slower at 128k tokens */
#pragma unroll
      for (int P = 0; P < WPL; ++P) {
        const int gi = ((8 * (tq * WPL + P)) >> gk_sh) + so;
        const uint32_t s1 = kvc_lds16(st + L.ks + (tok * gk + gi) * 2), z1 = kvc_lds16(st + L.kb + (tok * gk + gi) * 2);
        const uint32_t s2 = s1 | (s1 << 16), z2 = z1 | (z1 << 16);
#pragma unroll
        for (int h = 0; h < 2; ++h) { /* k-step 2P + h: k rows (2 tq, + 1) = codes (2h, 2h + 4), (2 tq + 8, + 9) = (2h + 1, 2h + 5) */
          const uint32_t b0 = kvc_deq_pair(kw[P], 2 * h, s2, z2), b1 = kvc_deq_pair(kw[P], 2 * h + 1, s2, z2);
          const int kk = 2 * P + h;
          kvc_tcw_s_kstep<F, MQ>(sc, qa, kk, lane, mqc, b0, b1);
        }
      }
    }
    /* masks and logits (log2 units): sc[mq][e] is (query 16 mq + g + 8 (e >> 1),
     * token 8 warp + 2 tq + (e & 1)) */
    const bool full = kvc_tc_stage_full(a, t0, t_hi, len);
    bool vis[MQ][4];
#pragma unroll
    for (int mq = 0; mq < MQ; ++mq) {
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, qv = q0 + 16 * mq + g + 8 * r;
        float x = sc[mq][e] * scl2;
        if (capped) x = cap2 * tanhf(x * cap2_inv);
        bool v = qv < Q;
        if (!full) {
          const long long t = t0 + 8 * warp + 2 * tq + (e & 1);
          v = v && t < t_hi;
          if (v && kvc_causal_family(a)) v = kvc_causal_visible(a, b, t, pos[mq][r], segp[mq][r], len);
        }
        const float xl = v ? x : -INFINITY;
        vis[mq][e] = v && xl != -INFINITY;
        sc[mq][e] = xl;
        mx[r] = kvc_max(mx[r], xl);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = kvc_max(mx[r], __shfl_xor_sync(KVC_FULL_MASK, mx[r], 1));
        mx[r] = kvc_max(mx[r], __shfl_xor_sync(KVC_FULL_MASK, mx[r], 2));
        if (tq == 0) wmax[(16 * mq + g + 8 * r) * KVC_TCW_WARPS + warp] = mx[r];
      }
    }
    __syncthreads();
    /* the stage max over the 8 warps (fixed order: every warp the same m);
     * warp 0 publishes the correction factors for the P.V warps */
#pragma unroll
    for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int qr = 16 * mq + g + 8 * r;
        const float4 w0 = *(const float4 *)(wmax + qr * KVC_TCW_WARPS);
        const float4 w1 = *(const float4 *)(wmax + qr * KVC_TCW_WARPS + 4);
        const float mx = kvc_max(kvc_max(kvc_max(w0.x, w0.y), kvc_max(w0.z, w0.w)),
                                 kvc_max(kvc_max(w1.x, w1.y), kvc_max(w1.z, w1.w)));
        const float mn = kvc_max(m[mq][r], mx);
        float corr = 1.0f;
        if (mn != -INFINITY && !(mn == m[mq][r])) {
          corr = kvc_exp2(m[mq][r] - mn);
          m[mq][r] = mn;
          l[mq][r] *= corr;
        }
        if (warp == 0 && tq == 0) corrs[qr] = corr;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int e = 2 * r + c;
          const float p = vis[mq][e] ? kvc_exp2(sc[mq][e] - m[mq][r]) : 0.0f;
          float pr;
          const unsigned short pb = kvc_p16<F>(p, &pr);
          l[mq][r] += pr;
          ps[qr * KVC_TC_PS + 8 * warp + 2 * tq + c] = pb;
        }
      }
    __syncthreads();

    /* ---- PV phase: O^T[slice sl] += V^T P^T over this warp's tokens ---- */
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float2 c = *(const float2 *)(corrs + 8 * nt + 2 * tq);
#pragma unroll
      for (int i = 0; i < MTV; ++i) {
        acc[i][nt][0] *= c.x;
        acc[i][nt][1] *= c.y;
        acc[i][nt][2] *= c.x;
        acc[i][nt][3] *= c.y;
      }
    }
#pragma unroll
    for (int kq = 0; kq < KQ; ++kq) {
      const int tb = 16 * (th * KQ + kq);
      uint32_t pb[NT][2];
      kvc_p_frags<NT>(ps, KVC_TC_PS, tb + 2 * tq, g, ntc, pb);
      kvc_pv_step<F, MTV, NT>(st, L, tb + 2 * tq, xw, cb, vgi + so, gv, pb, ntc, acc, vsc);
    }
  }
  kvc_cp_wait<0>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
  /* l over the 4 lanes of a row and the 8 warps (fixed order); m from warp 0 */
#pragma unroll
  for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float v = l[mq][r];
      v += __shfl_xor_sync(KVC_FULL_MASK, v, 1);
      v += __shfl_xor_sync(KVC_FULL_MASK, v, 2);
      const int qr = 16 * mq + g + 8 * r;
      if (tq == 0) lsum[qr * KVC_TCW_WARPS + warp] = v;
      if (tq == 0 && warp == 0) mrow[qr] = m[mq][r];
    }
  __syncthreads();
  if (TSL > 1) { /* D = 64: token half 1 hands its accumulators to half 0 through the (idle) ring */
    float *xa = (float *)kvc_tc_buf + (sl * KVC_WARP + lane) * (MTV * NT * 4);
    if (th == 1)
#pragma unroll
      for (int i = 0; i < MTV; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) xa[(i * NT + nt) * 4 + e] = acc[i][nt][e];
    __syncthreads();
    if (th == 0)
#pragma unroll
      for (int i = 0; i < MTV; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][nt][e] += xa[(i * NT + nt) * 4 + e];
    __syncthreads(); /* xa read: the ring is free again */
  }
  /* the final states through the idle ring: O [48][D] from token half 0, L
   * per vector in the corr slots, m in mrow */
  static_assert(kvc_tcw_stages(F, D) * KVC_TC_TOK * (kvc_tc_float(F) ? 4 * D : F == KVC_Q8 ? 2 * D : D) >=
                    KVC_TCW_QV * D * 4,
                "the ring (stages of 64 K and V rows) holds the final outputs");
  float *ost = (float *)kvc_tc_buf, *ls = (float *)(kvc_tc_buf + L.corr);
  if (th == 0)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int qr = 8 * nt + 2 * tq + j;
        if (nt < ntc)
#pragma unroll
          for (int i = 0; i < MTV; ++i)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int d = PAIRS ? 2 * (xw + 8 * i) + r : 8 * xw + cb + 2 * i + r;
              ost[qr * D + d] = acc[i][nt][2 * r + j];
            }
      }
  for (int qr = threadIdx.x; qr < KVC_TCW_QV; qr += KVC_TCW_THREADS) {
    const float4 l0 = *(const float4 *)(lsum + qr * KVC_TCW_WARPS), l1 = *(const float4 *)(lsum + qr * KVC_TCW_WARPS + 4);
    ls[qr] = ((l0.x + l0.y) + (l0.z + l0.w)) + ((l1.x + l1.y) + (l1.z + l1.w));
  }
  __syncthreads();
  kvc_emit_block<D>(a, split, b, hk, q0, min(KVC_TCW_QV, Q - q0), D, D, ost, mrow, ls, KVC_TCW_THREADS);
}

/* ---- host side ---- */
/* The instance's dynamic shared memory limit, set to its largest layout (8
 * groups per row) so that every caller sets the same value; the selector
 * calls it (through kvc_tc_occupancy) before an instance's first launch in a
 * context, so launches do not repeat it. */
template <int F, int D, int NTM, int G> static cudaError_t kvc_tc_prepare(void) {
  return cudaFuncSetAttribute(kvc_tc_kernel<F, D, NTM, G>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              kvc_tc_float(F) ? kvc_tc_layout_of(F, D, 0, 0, NTM).total
                                            : kvc_tc_layout_of(F, D, 8, 8, NTM).total);
}

/* (format, head dim, n-tiles, compiled group size or 0) */
#define KVC_TC_INSTANCES(X)                                                                              \
  X(KVC_Q4, 64, 1, 0) X(KVC_Q4, 64, 4, 0) X(KVC_Q4, 128, 1, 0) X(KVC_Q4, 128, 4, 0) X(KVC_Q4, 256, 1, 0)    \
  X(KVC_Q4, 256, 4, 0) X(KVC_Q4, 64, 1, KVC_TC_GROUP) X(KVC_Q4, 128, 1, KVC_TC_GROUP)                      \
  X(KVC_Q4, 256, 1, KVC_TC_GROUP) X(KVC_Q4, 64, 4, KVC_TC_GROUP) X(KVC_Q4, 128, 4, KVC_TC_GROUP)            \
  X(KVC_Q4, 256, 4, KVC_TC_GROUP) X(KVC_BF16, 64, 1, 0) X(KVC_BF16, 128, 1, 0) X(KVC_BF16, 256, 1, 0)      \
  X(KVC_Q8, 128, 1, 0) X(KVC_Q8, 256, 1, 0) X(KVC_Q8, 128, 1, KVC_TC_GROUP) X(KVC_Q8, 256, 1, KVC_TC_GROUP) \
  X(KVC_F16, 64, 1, 0) X(KVC_F16, 128, 1, 0) X(KVC_F16, 256, 1, 0) X(KVC_Q4, 512, 1, 0)                  \
  X(KVC_Q4, 512, 1, KVC_TC_GROUP) X(KVC_E4M3, 64, 1, 0) X(KVC_E4M3, 128, 1, 0) X(KVC_E4M3, 256, 1, 0)        \
  X(KVC_E5M2, 64, 1, 0) X(KVC_E5M2, 128, 1, 0) X(KVC_E5M2, 256, 1, 0)

template <int F, int D> static cudaError_t kvc_tcw_prepare(void) {
  return cudaFuncSetAttribute(kvc_tcw_kernel<F, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              kvc_tc_float(F) ? kvc_tcw_layout_of(F, D, 0, 0).total
                                            : kvc_tcw_layout_of(F, D, 8, 8).total);
}
#define KVC_TCW_INSTANCES(X)                                                                       \
  X(KVC_Q4, 64) X(KVC_Q4, 128) X(KVC_Q4, 256) X(KVC_BF16, 64) X(KVC_BF16, 128) X(KVC_BF16, 256)    \
  X(KVC_Q8, 64) X(KVC_Q8, 128) X(KVC_Q8, 256) X(KVC_F16, 64) X(KVC_F16, 128) X(KVC_F16, 256)     \
  X(KVC_E4M3, 64) X(KVC_E4M3, 128) X(KVC_E4M3, 256) X(KVC_E5M2, 64) X(KVC_E5M2, 128) X(KVC_E5M2, 256)

/* ntm = KVC_TCW_QV / 8: the wide kernel */
int kvc_tc_smem(int f, int D, int gk, int gv, int ntm) {
  return ntm * 8 == KVC_TCW_QV ? kvc_tcw_layout_of(f, D, gk, gv).total : kvc_tc_layout_of(f, D, gk, gv, ntm).total;
}

int kvc_tc_occupancy(int f, int D, int ntm, int g, int smem) {
  int n = 0;
  cudaError_t e = cudaErrorInvalidValue;
#define KVC_OCC(F_, D_, N_, G_)                                                                          \
  if (f == F_ && D == D_ && ntm == N_ && g == G_ && (e = kvc_tc_prepare<F_, D_, N_, G_>()) == cudaSuccess) \
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kvc_tc_kernel<F_, D_, N_, G_>, KVC_TC_THREADS, smem);
  KVC_TC_INSTANCES(KVC_OCC)
#undef KVC_OCC
#define KVC_OCC(F_, D_)                                                                            \
  if (f == F_ && D == D_ && ntm * 8 == KVC_TCW_QV && (e = kvc_tcw_prepare<F_, D_>()) == cudaSuccess) \
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kvc_tcw_kernel<F_, D_>, KVC_TCW_THREADS, smem);
  KVC_TCW_INSTANCES(KVC_OCC)
#undef KVC_OCC
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

int kvc_launch_tc(const kvc_args &a, const kvc_plan &plan, cudaStream_t stream) {
  dim3 grid(plan.qtiles, plan.nsplit, a.B * a.KVH);
  const int f = plan.fmt, ntm = plan.QW / 8;
  const int smem = kvc_tc_float(f) || kvc_tc_fp8(f) ? kvc_tc_smem(f, a.Dk, 0, 0, ntm)
                                 : kvc_tc_smem(f, a.Dk, a.Dk / a.k.group, a.Dv / a.v.group, ntm);
  cudaError_t e = cudaErrorInvalidValue;
#define KVC_CASE(F_, D_, N_, G_)                                                                   \
  if (f == F_ && a.Dk == D_ && ntm == N_ && plan.group == G_) {                                    \
    kvc_tc_kernel<F_, D_, N_, G_><<<grid, KVC_TC_THREADS, smem, stream>>>(a);                      \
    e = cudaGetLastError();                                                                        \
  }
  KVC_TC_INSTANCES(KVC_CASE)
#undef KVC_CASE
#define KVC_CASE(F_, D_)                                                                           \
  if (f == F_ && a.Dk == D_ && ntm * 8 == KVC_TCW_QV) {                                            \
    kvc_tcw_kernel<F_, D_><<<grid, KVC_TCW_THREADS, smem, stream>>>(a);                            \
    e = cudaGetLastError();                                                                        \
  }
  KVC_TCW_INSTANCES(KVC_CASE)
#undef KVC_CASE
  if (e != cudaSuccess)
    return kva_seterr(KVA_ECUDA, "%s tensor-core attention kernel (D = %d, %d query vectors per block): %s",
                      f == KVC_BF16 ? "bf16" : f == KVC_F16 ? "f16" : f == KVC_Q8 ? "q8" : f == KVC_E4M3 ? "f8e4m3"
                      : f == KVC_E5M2 ? "f8e5m2" : "q4", a.Dk, plan.QW, cudaGetErrorString(e));
  return 0;
}
