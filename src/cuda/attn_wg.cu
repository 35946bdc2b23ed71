/* Warpgroup verify kernel ("wg", Hopper wgmma): bf16 queries, 4-bit
 * MLX-affine K/V with bf16 scales and biases (1 to 8 groups per row, as the
 * stage loader of tc_stage.cuh takes them), Dk = Dv = D in {64, 128, 256}, up
 * to 64 query vectors per block (the selector, context.cu, sends q4 calls
 * with >= KVC_WG_MIN_Q query vectors per KV head here: speculative verify,
 * wide GQA, the stacked prefix rows of a cascade); the causal mask with or
 * without a window, the tree mask (KVA_MASK_TREE: the causal rule on the
 * prefix, each row's bits held in a register pair for the L <= 64 new
 * keys), or no mask (no image segments), softcap, sinks;
 * contiguous or BLOCK_TABLE rows. A second family of instances takes bf16
 * or f16 K/V rows with queries of the same type (>= KVC_WG_FLOAT_MIN_Q
 * vectors per KV head, KVC_WG256_MIN_Q at head dim 256): "16-bit rows"
 * below; at head dim 512 those rows
 * take kvc_wg512_kernel (value dims split between the warpgroups: its
 * comment below); a third fp8 rows (e4m3 or e5m2 codes, one f32 scale per
 * token and KV head, bf16 queries, >= KVC_WG_FP8_MIN_Q vectors): "fp8
 * rows" below.
 * sm_90a only: selected on compute capability 9.0 when the build carries
 * sm_90a code (kvc_wg_compiled); splits are merged by the merge launch. A
 * rotated call: q rotated as it is staged (kvc_rotated_query_rows), each
 * block's combined O rotated before it is written (kvc_emit_block).
 *
 * Why another kernel: the narrow and wide kernels of attn_tc.cu give each
 * warp a share of a stage's tokens (S) and of its head dims (P.V), so every
 * stage needs the row maxima and P through shared memory, three barriers,
 * and each warp's mma.sync fragments built per warp: at 48 query vectors the
 * wide kernel issued ~1,260 instructions per warp and stage at 0.39 per
 * cycle.
 * Here each warpgroup multiplies whole tiles from shared memory and each
 * query row's softmax stays inside one warp.
 *
 *   memory: raw stages of 64 token rows (packed codes and scale / bias rows,
 *         ~20 KB at D = 256) land by cp.async in a ring of KVC_WG_RAW slots
 *         (tc_stage.cuh's loader, run by warpgroup 0; KVC_WG_RAW - 1 stages
 *         in flight); each is converted once per element into bf16 K and V
 *         tiles (double buffered). Each K/V byte is read from DRAM once per
 *         block of up to 64 query vectors. Shared memory ~224 KB at D = 256
 *         (one block per SM), ~119 KB at 128, ~65 KB at 64 (two blocks per
 *         SM: the registers capped at 128 there).
 *   bf16 tiles: [D / 64 column chunks][64 rows][128 B], the 16-byte unit u
 *         of row r stored at u ^ (r % 8): the 128-byte swizzle of wgmma
 *         descriptors (tile bases 1024-byte aligned). K and V tiles have
 *         tokens as rows (K: the K-major B of S; V: the N-major B of P.V);
 *         the Q tile has query vectors as rows (the K-major A of S).
 *   dim order: inside each unit of 8 dims, logical dim 2 k + h holds dim
 *         k + 4 h, the pair order of a q4 word (codes k and k + 4 become one
 *         bf16x2 by a shift and one LOP3: kvc_deq_pair). Q is staged in the
 *         same order; output column n is dim 8 (n / 8) + (n % 8) / 2 +
 *         4 (n % 2).
 *   work split: KVC_WG_WGS = 2 warpgroups; warpgroup w owns tokens 32 w ..
 *         32 w + 31 of every stage: it converts their rows, multiplies them
 *         and keeps its own softmax state (m, l, O for all 64 query rows);
 *         the two states are combined once at the end.
 *   conversion: thread i of warpgroup w takes token row 32 w + i % 32 and
 *         16-byte pieces (32 codes) i / 32 + 4 j of its K and V rows: one
 *         LDS.128, its group's scale and bias, 16 pairs (shift, LOP3, two
 *         bf16x2 FMAs: 128 + c, c exact, then s c + b with one rounding),
 *         four STS.128 (rows of a quarter-warp are 8 consecutive tokens: no
 *         bank conflicts).
 *   math: S = Q K^T by wgmma m64n32k16 (both operands from shared memory),
 *         D / 16 k-steps, f32. Softmax in registers, log2 units: warp w of a
 *         warpgroup holds query rows 16 w + g and + 8 (lane (g, t)), 8
 *         tokens each; row maxima by two quad shuffles. The running maximum
 *         moves only when a stage's exceeds it by more than KVC_WG_SLACK, so
 *         O is rarely rescaled and P <= 2^KVC_WG_SLACK. P rounded to bf16
 *         stays in registers as the A operand of O += P V: wgmma m64n64k16
 *         per 64-dim chunk and 16-token k-step, B the V tile (N-major).
 *   pipeline, stage s (each warpgroup): issue S(s); warpgroup 0 issues the
 *         copies of stage s + 2 into the slot of stage s - 1 once warpgroup
 *         1 has converted that (its "converted" mbarrier), each of its
 *         threads arriving on the slot's "landed" mbarrier when its copies
 *         complete; wait for stage s + 1 to land (mbarrier) and for
 *         P.V(s - 1), convert stage s + 1 into the other tile buffer while
 *         S(s) runs (warpgroup 1 then arrives on "converted"); wait for
 *         S(s); softmax; issue P.V(s); fence to the async proxy, warpgroup
 *         barrier. No block barrier in the loop: each warpgroup converts
 *         and multiplies its own token rows, so the two drift up to a stage
 *         apart and their softmax and conversion phases interleave on the
 *         schedulers.
 *   precision: K, V and P rounded to bf16 (2^-9 relative), f32 sums: the
 *         bf16 allowance, as the wide kernel.
 *   launch: grid (ceil(rep L / 64), nsplit, B KVH) x 256 threads; an
 *         instance per head dim and layout (contiguous or BLOCK_TABLE: one
 *         loader path in the loop, with whole stages skipping the
 *         per-element mask compares).
 *   issue: warpgroup index, descriptors and their per-k-step offsets are
 *         warp-uniform (the index through a shuffle from lane 0), so each
 *         wgmma costs its uniform-register adds only; the softcap and the
 *         mask branch once per stage, not per element; P = 2^(x - m') with
 *         m' = m, or 0 while m is -inf (no compare per element). SASS of the
 *         loop at D = 256 (contiguous rows), per warp and stage on the usual
 *         path (whole stage, no softcap): ~675 instructions (S issue 70,
 *         conversion 305, softmax 170, P and P.V 110), ~5,400 per SM; the
 *         conversion's per-thread offsets are computed once (kvc_wg_cv).
 *         The conversion is at its floor for s c + b rounded once: per 32
 *         codes 12 shifts, 16 LOP3, 32 HFMA2, one LDS.128, four STS.128.
 *         Folding V's scale into P instead (V tile 128 + c, no HFMA2; A =
 *         bf16(P s) per 64-dim group) costs one HMUL2 per two (row, token,
 *         group) items plus the scale loads and the bias and -128 terms, and
 *         at 64 query rows those items are as many as V's elements: it saves
 *         at most a quarter of V's HFMA2 before the corrections. Folding K's
 *         scale needs a per-group S accumulator (16 registers per group) and
 *         two FFMA per (row, token, group): more than the two HFMA2 per pair
 *         it saves.
 *
 * 16-bit rows (bf16, f16; instances kvc_wg_kernel<KVC_BF16 / KVC_F16, D, TBL>):
 *   the rows are the wgmma operands, so the tiles ARE the stages: a ring of
 *         NS = KVC_WG_NS(D) slots {K tile, V tile} (3 at D = 256: 32 KB Q
 *         tile + 192 KB; 4 at 128 and 64), no raw ring, no conversion.
 *         Shared memory ~227 KB at D = 256, ~147 KB at 128, ~75 KB at 64
 *         (two blocks per SM).
 *   copies: warpgroup w copies its own token rows 32 w .. 32 w + 31 of both
 *         tiles by cp.async (16-byte units straight to unit u ^ (r % 8) of
 *         row r: kvc_wg_copy_stage), contiguous or through its own ring of
 *         staged block ids, so the two warpgroups share nothing in the loop
 *         (the Q tile is written once): warpgroup barriers only.
 *   dim order: natural (dims 8 u .. 8 u + 7 in unit u) in Q, K and V; output
 *         column n of chunk c is dim 64 c + n (stored at the end in the q4
 *         column order, reordered when the warpgroups' states combine).
 *   pipeline, stage s (each warpgroup): wait for its copies of stage s (NS -
 *         2 groups left in flight), fence to the async proxy, warpgroup
 *         barrier; issue S(s); wait for P.V(s - 1), warpgroup barrier, issue
 *         the copies of stage s + NS - 1 into slot (s - 1) % NS (and the
 *         block ids of stage s + 2 NS - 2); wait for S(s); softmax (the same
 *         code as q4); issue P.V(s).
 *   precision: P rounded to bf16 (f16 rows: f16 wgmma, P in f16), f32 sums;
 *         q, K and V as given.
 *
 * fp8 rows (e4m3, e5m2; instances kvc_wg_kernel<KVC_E4M3 / KVC_E5M2, D, TBL>):
 *   the q4 pipeline with fp8 stages: raw code rows of D bytes (no row pad)
 *         and the f32 row scales (tc_stage.cuh's loader, warpgroup 0) in a
 *         ring of RAW = KVC_WG_RAW8(D) slots (2 at D = 256, 4 at 128 and
 *         64), converted once per element into the double-buffered bf16
 *         tiles. Shared memory ~227 KB at D = 256 (a third raw slot would
 *         not fit: 33 KB a stage), ~149 KB at 128, ~77 KB at 64 (two
 *         blocks per SM).
 *   pipeline: as q4 (mbarriers per slot), but the copies of stage s + RAW
 *         go out after stage s + 1 has landed, into the slot of stage s
 *         (converted at stage s - 1); the block ids of stage s + 2 RAW - 1
 *         with them (KVC_WG_IDS8(D) = 2 RAW - 1 slots: the prologue's first
 *         2 RAW - 1 stages distinct). RAW stages in flight while a stage is
 *         converted.
 *   conversion (kvc_wg_convert_fp8, offsets kvc_wg_cv8): thread i of
 *         warpgroup w takes token row 32 w + i / 4 and D / 64 pieces of 16
 *         codes, the quarter-warp's two rows in complementary halves of
 *         each 128-byte span, so the LDS.128 of the unpadded rows and the
 *         STS.128 into the swizzled tiles are free of bank conflicts; per 2
 *         codes one cvt.rn.f16x2.{e4m3x2,e5m2x2} (exact), two f32 products
 *         with the row scale (1 without scales), one bf16x2 rounding
 *         (kvc_deq_fp8x2, as the narrow and wide kernels).
 *   dim order: natural in Q, K and V, as the 16-bit rows (their output
 *         columns and their end: three O over the Q tile, tiles and ring).
 *   precision: K, V (bf16 of scale * code) and P rounded to bf16, f32 sums:
 *         "[K,V,P bf16]", the other fp8 tensor-core instances' contract. */
#include "cuda/launch.cuh"
#include "cuda/tc_stage.cuh"

#define KVC_WG_THREADS 128   /* one warpgroup */
#define KVC_WG_WGS 2         /* warpgroups per block: each takes 32 tokens of a stage */
#define KVC_WG_QV 64         /* query vectors per block: the wgmma M */
#define KVC_WG_RAW 3         /* raw stage slots in the cp.async ring */
#define KVC_WG_SLACK 8.0f    /* log2 units: P <= 2^8 between rescales */
#define KVC_WG_CHUNK 8192    /* bytes of a 64-row x 128-byte column chunk of a tile */

/* The column of dim d in the 16-bit rows' O staging (accumulator (j, e) of
 * lane t4 at column 8 j + t4 + 4 (e & 1) for dim 8 j + 2 t4 + (e & 1):
 * kvc_wg_kernel's NAT order and kvc_wg512_kernel's) */
struct kvc_wg_col {
  static constexpr bool natural = false;
  __device__ int operator()(int d) const { return (d & ~7) | ((d & 7) >> 1) | ((d & 1) << 2); }
};

/* Shared-memory layout (bytes from the 1024-aligned base): the Q tile, K/V
 * tile buffers 0 and 1, the raw ring (stage layout of tc_stage.cuh), the
 * block ids of BLOCK_TABLE views, the final maxima and sums. fp8 rows (f =
 * KVC_E4M3 / KVC_E5M2): a ring of KVC_WG_RAW8(D) slots of unpadded rows (D
 * bytes; kvc_wg_cv8_of reads them without bank conflicts), KVC_WG_IDS8(D)
 * id slots, and the three outputs, maxima and sums of the end over the Q
 * tile, the tiles and the ring (as the 16-bit rows': ost), so that D = 256
 * fits (~227 KB). */
#define KVC_WG_RAW8(D) ((D) == 256 ? 2 : 4) /* fp8: raw stage slots (stage s + RAW8 copied into the slot stage s left) */
#define KVC_WG_IDS8(D) (2 * KVC_WG_RAW8(D) - 1) /* fp8: block-id slots */
struct kvc_wg_layout {
  int tile; /* bytes of one bf16 tile: 64 rows x 2 D */
  int qt, raw, ids, ost, ms, ls, mw, mb, total;
  kvc_tc_layout st;
};
__host__ __device__ inline kvc_wg_layout kvc_wg_layout_of(int f, int D, int gk, int gv) {
  kvc_wg_layout w;
  w.tile = 64 * 2 * D;
  w.qt = 0;
  w.raw = 5 * w.tile;
  if (kvc_tc_fp8(f)) {
    kvc_tc_layout &l = w.st;
    l.rs = D;
    l.kd = 0;
    l.vd = KVC_TC_TOK * D;
    l.ks = 2 * KVC_TC_TOK * D;
    l.kb = l.vs = l.vb = l.ks + KVC_TC_TOK * 4;
    l.stage = l.vs + KVC_TC_TOK * 4;
    w.ids = w.raw + KVC_WG_RAW8(D) * l.stage;
    w.mb = w.ids + KVC_WG_IDS8(D) * KVC_TC_IDS * 4; /* the raw slots' mbarriers: landed, converted */
    w.total = w.mb + 2 * KVC_WG_RAW8(D) * 8;
    w.ost = 0; /* three O [64][D + 4], then the maxima and sums (after the loop) */
    w.ms = w.ost + 3 * KVC_WG_QV * (D + 4) * 4;
    w.ls = w.ms + KVC_WG_QV * 4;
    w.mw = w.ls + KVC_WG_QV * 4;
    return w;
  }
  kvc_tc_stage_layout(w.st, KVC_Q4, D, gk, gv);
  w.ids = w.raw + KVC_WG_RAW * w.st.stage;
  w.ost = w.tile; /* both warpgroups' O [64][D + 4] over the tiles and the ring (after the loop) */
  w.ms = w.ids + 2 * KVC_WG_RAW * KVC_TC_IDS * 4;
  w.ls = w.ms + KVC_WG_QV * 4;
  w.mw = w.ls + KVC_WG_QV * 4; /* both warpgroups' m and l before they combine */
  w.mb = w.mw + 4 * KVC_WG_QV * 4; /* the raw slots' mbarriers: KVC_WG_RAW "landed", then KVC_WG_RAW "converted" */
  w.total = w.mb + 2 * KVC_WG_RAW * 8;
  return w;
}
__host__ __device__ inline int kvc_wg_kt(const kvc_wg_layout &w, int buf) { return w.tile * (1 + 2 * buf); }
__host__ __device__ inline int kvc_wg_vt(const kvc_wg_layout &w, int buf) { return w.tile * (2 + 2 * buf); }
/* dynamic shared memory: the layout plus the base's alignment (16-bit rows,
 * kvc_wgf_layout_of below, and fp8 rows: gk, gv unused) */
static int kvc_wgf_total(int D);
static int kvc_wg512_total(void);
int kvc_wg_smem(int f, int D, int gk, int gv) {
  return (kvc_tc_float(f) ? (D == 512 ? kvc_wg512_total() : kvc_wgf_total(D)) : kvc_wg_layout_of(f, D, gk, gv).total) +
         1024;
}

/* A thread's share of the conversion (see the file comment), fixed for the
 * block: its row r = 32 wg + wt % 32 and pieces c = c0 + 4 i (c0 = wt /
 * 32); ld: byte offset of piece c0 in a raw K (V) row block (r rs + 16 c0;
 * piece c at + 16 (c - c0)); st: offset of its first unit in a tile (r 128
 * + (c0 / 2) chunks + unit ((c0 % 2) 4 ^ (r % 8)): unit j of piece c is
 * at (st + (c / 2 - c0 / 2) chunks) ^ 16 j, the 128-byte swizzle, as the
 * tile base and the chunks are 1024-byte multiples and st's unit has its
 * two low bits r's); ks[i], vs[i]: offset of its K (V) scale entry for
 * piece c0 + 4 i in the scale rows (2 (r groups + (32 c >> group shift))). */
template <int D> struct kvc_wg_cv {
  static constexpr int NP = (D + 127) / 128; /* pieces per thread and row (D = 64: threads c0 < 2) */
  uint32_t ld, st, ks[NP], vs[NP];
};
template <int D>
__device__ __forceinline__ kvc_wg_cv<D> kvc_wg_cv_of(const kvc_tc_layout &L, int wg, int wt, int gk, int gv, int gk_sh,
                                                     int gv_sh) {
  kvc_wg_cv<D> v;
  const int r = 32 * wg + (wt & 31), c0 = wt >> 5;
  v.ld = r * L.rs + 16 * c0;
  v.st = r * 128 + (c0 >> 1) * KVC_WG_CHUNK + ((((c0 & 1) * 4) ^ (r & 7)) << 4);
#pragma unroll
  for (int i = 0; i < kvc_wg_cv<D>::NP; ++i) {
    v.ks[i] = 2 * (r * gk + ((32 * (c0 + 4 * i)) >> gk_sh));
    v.vs[i] = 2 * (r * gv + ((32 * (c0 + 4 * i)) >> gv_sh));
  }
  return v;
}
/* One 16-byte piece of 32 codes (word j: dims 8 j .. 8 j + 7 of the piece)
 * with its group's scale s1 and bias z1 -> four bf16 units of s c + b at
 * dst + 2 i chunks + (st ^ 16 j). */
__device__ __forceinline__ void kvc_wg_deq_piece(uint4 w, uint32_t s1, uint32_t z1, unsigned char *dst, int i,
                                                 uint32_t st) {
  const uint32_t s2 = s1 | (s1 << 16), z2 = z1 | (z1 << 16);
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint4 o = make_uint4(kvc_deq_pair(ws[j], 0, s2, z2), kvc_deq_pair(ws[j], 1, s2, z2),
                               kvc_deq_pair(ws[j], 2, s2, z2), kvc_deq_pair(ws[j], 3, s2, z2));
    *(uint4 *)(dst + 2 * i * KVC_WG_CHUNK + (st ^ (j << 4))) = o;
  }
}
/* Warpgroup w's token rows 32 w .. 32 w + 31 of the raw stage at slot ->
 * bf16 K and V tiles at kt and kt + the tile size (see the file comment);
 * so: where the stage's scale entries start with one group per row
 * (kvc_tc_so). At D = 256 (two pieces per operand) every piece and scale
 * entry is loaded first, so that their latencies overlap; below, piece by
 * piece (registers capped at 128 at D = 64; measured faster at 128 too). */
template <int D>
__device__ __forceinline__ void kvc_wg_convert(const unsigned char *slot, const kvc_tc_layout &L, unsigned char *kt,
                                               const kvc_wg_cv<D> &cv, int wt, int so) {
  constexpr int NP = kvc_wg_cv<D>::NP;
  const int c0 = wt >> 5;
  const unsigned char *row[2] = {slot + L.kd + cv.ld, slot + L.vd + cv.ld};
  const unsigned char *sr[2] = {slot + L.ks + 2 * so, slot + L.vs + 2 * so};
  const unsigned char *zr[2] = {slot + L.kb + 2 * so, slot + L.vb + 2 * so};
  if constexpr (D == 256) {
    uint4 w[2][NP];
    uint32_t s1[2][NP], z1[2][NP];
#pragma unroll
    for (int op = 0; op < 2; ++op)
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        const uint32_t e = op ? cv.vs[i] : cv.ks[i]; /* piece c = c0 + 4 i: dims 32 c .. 32 c + 31; its scale entry */
        w[op][i] = *(const uint4 *)(row[op] + 64 * i);
        s1[op][i] = kvc_lds16(sr[op] + e), z1[op][i] = kvc_lds16(zr[op] + e);
      }
#pragma unroll
    for (int op = 0; op < 2; ++op)
#pragma unroll
      for (int i = 0; i < NP; ++i) kvc_wg_deq_piece(w[op][i], s1[op][i], z1[op][i], kt + op * 64 * 2 * D, i, cv.st);
  } else {
#pragma unroll
    for (int op = 0; op < 2; ++op)
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        if (D < 128 && c0 + 4 * i >= D / 32) break; /* D = 64: two pieces per row, threads c0 < 2 */
        const uint32_t e = op ? cv.vs[i] : cv.ks[i];
        kvc_wg_deq_piece(*(const uint4 *)(row[op] + 64 * i), kvc_lds16(sr[op] + e), kvc_lds16(zr[op] + e),
                         kt + op * 64 * 2 * D, i, cv.st);
      }
  }
}
/* fp8 rows: a thread's share of the conversion, fixed for the block. Thread
 * wt of warpgroup wg takes token row r = 32 wg + wt / 4 and the 16-byte
 * pieces (16 codes, dims 16 p .. 16 p + 15: units 2 p, 2 p + 1 of chunk p /
 * 4) p = wt % 4 + 4 (i ^ h), i < D / 64, h = r % 2 (D = 64: p = wt % 4): a
 * quarter-warp (rows r, r + 1) reads pieces in 8 distinct 16-byte bank
 * groups of the unpadded rows and stores units 2 p % 8 ^ r % 8, even for
 * one row, odd for the other: no bank conflicts. ld[i & 1] + 128 (i / 2):
 * piece i's offset in a raw K (V) row block; st[i & 1] + 2 (i / 2) chunks:
 * its first unit in a tile (the second at ^ 16); sc: the row's scale entry. */
struct kvc_wg_cv8 {
  uint32_t ld[2], st[2], sc;
};
template <int D> __device__ __forceinline__ kvc_wg_cv8 kvc_wg_cv8_of(int wg, int wt) {
  kvc_wg_cv8 v;
  const int r = 32 * wg + (wt >> 2), pl = wt & 3, h = D >= 128 ? r & 1 : 0;
  const uint32_t ld = r * D + 16 * pl, st = r * 128 + (((2 * pl) ^ (r & 7)) << 4);
  v.ld[0] = ld + 64 * h;
  v.ld[1] = ld + 64 * (1 - h);
  v.st[0] = st + KVC_WG_CHUNK * h;
  v.st[1] = st + KVC_WG_CHUNK * (1 - h);
  v.sc = 4 * r;
  return v;
}
/* Warpgroup w's token rows of the fp8 raw stage at slot -> bf16 K and V
 * tiles at kt and kt + the tile size, natural dim order: bf16 of the row's
 * f32 scale (1 without scales: ksc, vsc) times the code (exact in f16,
 * kvc_deq_fp8x2). */
template <int F, int D>
__device__ __forceinline__ void kvc_wg_convert_fp8(const unsigned char *slot, const kvc_tc_layout &L, unsigned char *kt,
                                                   const kvc_wg_cv8 &cv, bool ksc, bool vsc) {
#pragma unroll
  for (int op = 0; op < 2; ++op) {
    const unsigned char *row = slot + (op ? L.vd : L.kd);
    const float sf = kvc_fp8_scale(slot + cv.sc, op ? L.vs : L.ks, 0, op ? vsc : ksc);
    unsigned char *dst = kt + op * 64 * 2 * D;
#pragma unroll
    for (int i = 0; i < D / 64; ++i) {
      const uint4 w = *(const uint4 *)(row + cv.ld[i & 1] + 128 * (i >> 1));
      unsigned char *o = dst + 2 * (i >> 1) * KVC_WG_CHUNK;
      *(uint4 *)(o + cv.st[i & 1]) = make_uint4(kvc_deq_fp8x2<F>(w.x, sf, sf), kvc_deq_fp8x2<F>(w.x >> 16, sf, sf),
                                                kvc_deq_fp8x2<F>(w.y, sf, sf), kvc_deq_fp8x2<F>(w.y >> 16, sf, sf));
      *(uint4 *)(o + (cv.st[i & 1] ^ 16)) = make_uint4(kvc_deq_fp8x2<F>(w.z, sf, sf), kvc_deq_fp8x2<F>(w.z >> 16, sf, sf),
                                                       kvc_deq_fp8x2<F>(w.w, sf, sf), kvc_deq_fp8x2<F>(w.w >> 16, sf, sf));
    }
  }
}
/* Barrier of one warpgroup's 128 threads (named barrier 1 + wg). */
__device__ __forceinline__ void kvc_wg_sync(int wg) {
  if (wg == 0)
    asm volatile("bar.sync 1, %0;" ::"n"(KVC_WG_THREADS) : "memory");
  else
    asm volatile("bar.sync 2, %0;" ::"n"(KVC_WG_THREADS) : "memory");
}

/* 16-bit float rows (bf16, f16): the K/V tiles are the stages, a ring of
 * KVC_WG_NS(D) slots {K tile, V tile} after the Q tile, then each
 * warpgroup's ring of block-id slots (BLOCK_TABLE views); both warpgroups'
 * output states, their combination, the final maxima and sums reuse the Q
 * tile and the ring after the loop. */
#define KVC_WG_NS(D) ((D) == 256 ? 3 : 4)
struct kvc_wgf_layout {
  int tile, qt, ring, stage, ids, ost, ms, ls, mw, total;
};
__host__ __device__ inline kvc_wgf_layout kvc_wgf_layout_of(int D) {
  kvc_wgf_layout w;
  w.tile = 64 * 2 * D;
  w.qt = 0;
  w.ring = w.tile;
  w.stage = 2 * w.tile;
  w.ids = w.ring + KVC_WG_NS(D) * w.stage;
  w.total = w.ids + KVC_WG_WGS * KVC_WG_NS(D) * KVC_TC_IDS * 4;
  w.ost = 0; /* the Q tile and the ring: three O [64][D + 4] (see the kernel's end) */
  w.ms = w.ost + 3 * KVC_WG_QV * (D + 4) * 4;
  w.ls = w.ms + KVC_WG_QV * 4;
  w.mw = w.ls + KVC_WG_QV * 4;
  return w;
}
/* A thread's run of N consecutive rows r0 .. r0 + N - 1 of the stage at t0
 * (rows from lim on are past t_hi): rows k < sp in block o0 from its row
 * rb + k, rows k >= sp in the block of id slot i1 from its row k - sp.
 * Contiguous: one run (o0 = b, rb = t0 + r0, sp = N). BLOCK_TABLE through
 * the stage's block ids (ids: landed, from the column of t0 + fo), blocks
 * of >= N rows (the selector: KVC_WG_FLOAT_RUN): at most two blocks, the
 * second looked up only where the run reaches it. */
struct kvc_wg_run {
  long long o0, rb;
  int sp, i1;
};
template <int N, bool TBL>
__device__ __forceinline__ kvc_wg_run kvc_wg_run_of(const kvc_operand &K, int b, int fo, long long t0, int r0, int lim,
                                                    const int *ids) {
  kvc_wg_run w;
  w.sp = N, w.i1 = 0;
  if (!TBL) {
    w.o0 = b, w.rb = t0 + r0;
    return w;
  }
  w.o0 = 0, w.rb = 0;
  if (lim <= 0) return w; /* nothing read: no lookup past the landed ids */
  const long long rw = t0 + r0 + fo, jf = kvc_table_col(t0 + fo, K.bsz, K.bsh), j = kvc_table_col(rw, K.bsz, K.bsh);
  const int rb = (int)(rw - j * K.bsz), sp = K.bsz - rb, i0 = (int)(j - jf);
  w.o0 = kvc_loc_of(ids[i0], 0, 0, K.bsz, K.nblk).outer;
  w.rb = rb, w.sp = sp < N ? sp : N, w.i1 = i0 + 1;
  return w;
}
/* Unit copies of run w's rows k < lim of operand O (head hk, byte u16 of a
 * row) to shared addresses dst(k): 16 bytes each, rows from lim on read
 * nothing (a valid address). One pointer add per row within a block. */
template <int N, bool TBL, class Dst>
__device__ __forceinline__ void kvc_wg_run_copy(const kvc_operand &O, const kvc_wg_run &w, const int *ids, int nblk,
                                                int hk, int u16, int lim, Dst dst) {
  const char *head = O.data + hk * O.ds[1] + u16;
  const long long st = O.ds[2];
  const char *p = head + w.o0 * O.ds[0] + w.rb * st;
  if (lim == N && (!TBL || w.sp >= N)) { /* every row, one block: no per-row test */
#pragma unroll
    for (int k = 0; k < N; ++k, p += st) kvc_cp_async<16>(dst(k), p, 16);
  } else if (!TBL || w.sp >= lim) { /* contiguous, or one block */
#pragma unroll
    for (int k = 0; k < N; ++k, p += st) kvc_cp_async<16>(dst(k), k < lim ? p : O.data, k < lim ? 16 : 0);
  } else { /* rows sp .. lim - 1 in the next block: row k at q + k st */
    const long long o1 = kvc_loc_of(ids[w.i1], 0, 0, 1, nblk).outer;
    const char *q = head + o1 * O.ds[0] - w.sp * st;
#pragma unroll
    for (int k = 0; k < N; ++k, p += st, q += st)
      kvc_cp_async<16>(dst(k), k < lim ? (k < w.sp ? p : q) : O.data, k < lim ? 16 : 0);
  }
}

/* Warpgroup wg's token rows 32 wg .. 32 wg + 31 of the stage at t0 (zeros
 * from t_hi on), by cp.async of 16-byte units straight into the K and V
 * tiles at shared addresses kt, vt: thread wt copies unit u = wt % (D / 8)
 * (dims 8 u .. 8 u + 7, natural order) of its run of PER = D / 32 rows from
 * 32 wg + PER (wt / (D / 8)) (kvc_wg_run), to chunk u / 8, unit (u % 8) ^ (r
 * % 8) of tile row r. A warp's copy of one k takes whole rows: one (512
 * bytes) at D = 256, two at 128, four at 64. */
static int kvc_wgf_total(int D) { return kvc_wgf_layout_of(D).total; }
template <int D, bool TBL>
__device__ __forceinline__ void kvc_wg_copy_stage(const kvc_args &a, int b, int hk, int fo, int wg, int wt,
                                                  uint32_t kt, uint32_t vt, long long t0, long long t_hi,
                                                  const int *ids) {
  constexpr int UPR = D / 8, PER = KVC_WG_FLOAT_RUN(D);
  static_assert(PER * KVC_WG_THREADS == 32 * UPR, "a warpgroup's 32 rows: one run per thread");
  const int u = wt % UPR, r0 = 32 * wg + PER * (wt / UPR);
  const long long left = t_hi - t0 - r0;
  const int lim = left <= 0 ? 0 : left >= PER ? PER : (int)left;
  const kvc_wg_run w = kvc_wg_run_of<PER, TBL>(a.k, b, fo, t0, r0, lim, ids);
  auto dst = [&](int k) {
    const int r = r0 + k;
    return (uint32_t)((u >> 3) * KVC_WG_CHUNK + r * 128 + (((u & 7) ^ (r & 7)) << 4));
  };
  kvc_wg_run_copy<PER, TBL>(a.k, w, ids, a.k.nblk, hk, 16 * u, lim, [&](int k) { return kt + dst(k); });
  kvc_wg_run_copy<PER, TBL>(a.v, w, ids, a.k.nblk, hk, 16 * u, lim, [&](int k) { return vt + dst(k); });
}
/* The block ids of the stage at t0 (kvc_tc_id_cols), one per thread wt of a
 * warpgroup below the column count: by cp.async into the ids slot at shared
 * address d (the caller's commit group), or loaded and stored at dst. */
__device__ __forceinline__ void kvc_wg_issue_ids(const kvc_args &a, int b, int fo, long long t0, long long t_hi,
                                                 uint32_t d, int wt) {
  long long jf = 0;
  if (wt < kvc_tc_id_cols(a, fo, t0, t_hi, &jf)) kvc_cp_async<4>(d + 4 * wt, a.k.tbl + b * a.k.tbl_rs + jf + wt, 4);
}
__device__ __forceinline__ void kvc_wg_store_ids(const kvc_args &a, int b, int fo, long long t0, long long t_hi,
                                                 int *dst, int wt) {
  long long jf = 0;
  if (wt < kvc_tc_id_cols(a, fo, t0, t_hi, &jf)) dst[wt] = __ldg(a.k.tbl + b * a.k.tbl_rs + jf + wt);
}

/* Two softmax weights as one A-fragment word of P.V, f16 (H) or bf16; the
 * row's sum l takes them as rounded, so that l and P.V see the same P. */
template <bool H> __device__ __forceinline__ uint32_t kvc_wg_pack_p(float p0, float p1, float &l) {
  if constexpr (H) {
    const uint32_t pk = kvc_f16x2_of(p0, p1);
    l += kvc_f16_lo(pk) + kvc_f16_lo(pk >> 16);
    return pk;
  } else {
    const uint32_t pk = kvc_bf16x2_of(p0, p1);
    l += __uint_as_float(pk << 16) + __uint_as_float(pk & 0xffff0000u);
    return pk;
  }
}

/* This thread's query rows q = qr + 8 r (r = 0, 1: rows g and g + 8 of its
 * warp's 16) before the loop: pos[r] the row's position (-1: no query
 * vector, sees nothing, as a row before token 0; no mask: every key up to
 * t_hi), tbits[r] its tree bits (KVA_MASK_TREE, L <= 64: two words in a
 * register pair), the empty softmax state and O accumulators. */
template <int NC>
__device__ __forceinline__ void kvc_wg_rows_init(const kvc_args &a, int b, long long len, int Q, int qr,
                                                 long long (&pos)[2], uint64_t (&tbits)[2], float (&m)[2],
                                                 float (&l)[2], float (&oacc)[NC][32]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int qv = qr + 8 * r;
    pos[r] = qv >= Q ? -1 : a.mask_kind == KVA_MASK_NONE ? (1LL << 62) : len - a.L + qv % a.L;
    tbits[r] = 0;
    if (a.mask_kind == KVA_MASK_TREE && qv < Q) {
      const uint32_t *row = (const uint32_t *)(a.tree + b * a.tree_s[0] + (qv % a.L) * a.tree_s[1]);
      tbits[r] = (uint64_t)__ldg(row) | (a.L > 32 ? (uint64_t)__ldg(row + 1) << 32 : 0ull);
    }
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
#pragma unroll
  for (int c = 0; c < NC; ++c)
#pragma unroll
    for (int i = 0; i < 32; ++i) oacc[c][i] = 0.0f;
}

/* A stage's row maxima mx (this lane's two rows, g and g + 8 of its warp's
 * 16) reduced over the quad, and the running state (m, l, O) moved to them
 * when a maximum exceeds m by more than KVC_WG_SLACK or turns NaN (then it
 * stays): l and the lane's O accumulators (NC chunks of 64 dims) scaled by
 * 2^(m - mx), 0 from -inf; the warp skips the O scaling when no row moved. */
template <int NC>
__device__ __forceinline__ void kvc_wg_rescale(float (&mx)[2], float (&m)[2], float (&l)[2], float (&oacc)[NC][32]) {
  float corr[2];
  bool moved = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = kvc_max(mx[r], __shfl_xor_sync(KVC_FULL_MASK, mx[r], 1));
    mx[r] = kvc_max(mx[r], __shfl_xor_sync(KVC_FULL_MASK, mx[r], 2));
    corr[r] = 1.0f;
    if (mx[r] > m[r] + KVC_WG_SLACK || (mx[r] != mx[r] && m[r] == m[r])) {
      corr[r] = kvc_exp2(m[r] - mx[r]);
      m[r] = mx[r];
      l[r] *= corr[r];
      moved = true;
    }
  }
  if (__any_sync(KVC_FULL_MASK, moved))
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        oacc[c][4 * j] *= corr[0];
        oacc[c][4 * j + 1] *= corr[0];
        oacc[c][4 * j + 2] *= corr[1];
        oacc[c][4 * j + 3] *= corr[1];
      }
}

/* F: KVC_Q4 or KVC_E4M3 / KVC_E5M2 (raw stages converted into
 * double-buffered tiles) or KVC_BF16 / KVC_F16 (rows copied into a ring of
 * tiles; f16: f16 wgmma, P in f16); the S / softmax / P.V loop is the same
 * code for all. */
template <int F, int D, bool TBL>
__global__ void __launch_bounds__(KVC_WG_WGS * KVC_WG_THREADS, D == 64 ? 2 : 1) kvc_wg_kernel(const kvc_args a) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int NC = D / 64, KS = D / 16;
  constexpr bool FL = kvc_tc_float(F), H = F == KVC_F16; /* 16-bit rows; f16 operands */
  constexpr bool FP8 = kvc_tc_fp8(F), NAT = FL || FP8;  /* fp8 rows; natural dim order in the tiles */
  constexpr int NS = KVC_WG_NS(D);                      /* FL: tile slots of the ring */
  constexpr int RAW = FP8 ? KVC_WG_RAW8(D) : KVC_WG_RAW, NI = FP8 ? KVC_WG_IDS8(D) : 2 * KVC_WG_RAW; /* raw, id slots */
  constexpr int PRO = FP8 ? RAW : KVC_WG_RAW - 1; /* stages the prologue copies */
  extern __shared__ unsigned char kvc_wg_buf[];
  const uint32_t sraw = (uint32_t)__cvta_generic_to_shared(kvc_wg_buf);
  const uint32_t sbase = (sraw + 1023u) & ~1023u;
  unsigned char *base = kvc_wg_buf + (sbase - sraw);
  const int tid = threadIdx.x, wt = tid % KVC_WG_THREADS;
  /* warpgroup: through a shuffle, warp-uniform to the compiler (the wgmma descriptors in uniform registers) */
  const int wg = __shfl_sync(KVC_FULL_MASK, tid / KVC_WG_THREADS, 0);
  const int lane = tid % KVC_WARP, warp = wt / KVC_WARP, g = lane >> 2, t4 = lane & 3;
  const bool loads = wg == 0; /* warpgroup 0 issues the copies (the stage loader is laid out for 128 threads) */
  const int qg = kvc_qtile(), split = blockIdx.y;
  const int b = blockIdx.z / a.KVH, hk = blockIdx.z % a.KVH;
  const int gk = NAT ? 0 : D / a.k.group, gv = NAT ? 0 : D / a.v.group;
  const int gk_sh = NAT ? 0 : 31 - __clz(a.k.group), gv_sh = NAT ? 0 : 31 - __clz(a.v.group);
  const kvc_wg_layout W = kvc_wg_layout_of(F, D, gk, gv);
  const kvc_wgf_layout WF = kvc_wgf_layout_of(D);
  const kvc_tc_layout &L = W.st;
  const uint32_t mbf = sbase + W.mb, mbe = mbf + 8 * RAW; /* raw slot landed / converted by warpgroup 1 */
  kvc_wg_cv<D> cv{}; /* q4: this thread's conversion offsets */
  if constexpr (!NAT) cv = kvc_wg_cv_of<D>(L, wg, wt, gk, gv, gk_sh, gv_sh);
  kvc_wg_cv8 cv8{}; /* fp8: this thread's conversion offsets */
  if constexpr (FP8) cv8 = kvc_wg_cv8_of<D>(wg, wt);
  const bool ksc = a.k.scales != nullptr, vsc = a.v.scales != nullptr; /* fp8: rows with scales */
  const long long len = kvc_seq_len(a, b);
  const int fo = kvc_first_offset(a.k, b), e0 = NAT ? 0 : kvc_tc_e0(a, b, hk, fo);
  const int Q = a.rep * a.L, q0 = qg * KVC_WG_QV;
  long long t_lo, t_hi;
  const int nst = kvc_tc_range(a, split, len, q0, KVC_WG_QV, &t_lo, &t_hi);
  const float scl2 = a.scale * KVC_LOG2E, cap2 = a.softcap * KVC_LOG2E, cap2_inv = a.softcap_inv * (1.0f / KVC_LOG2E);
  const bool capped = a.softcap > 0.0f;

  constexpr bool tbl = TBL; /* an instance per layout */
  kvc_tc_loader ld;
  uint32_t ring = 0, ids_sh = 0;
  int *ids = nullptr;
  if constexpr (!FL) {
    /* prologue: the first PRO stages in flight (one commit group each: q4
     * KVC_WG_RAW - 1, fp8 RAW); BLOCK_TABLE ids as in the narrow kernel
     * (stage x's in slot x % NI; those of stages PRO .. 2 PRO - 1 issued
     * here, fp8: PRO .. 2 PRO - 2) */
    ring = sbase + W.raw;
    if (tid < 2 * RAW) kvc_mbar_init(mbf + 8 * tid, KVC_WG_THREADS); /* the raw slots' mbarriers (see the loop) */
    __syncthreads();
    ld = kvc_tc_loader_of<F, D>(a, L, b, hk, t_lo);
    ids = (int *)(base + W.ids);
    ids_sh = sbase + W.ids;
    if (tbl) {
      if (loads)
        for (int s = 0; s < PRO; ++s)
          kvc_tc_store_ids(a, b, fo, t_lo + (long long)s * KVC_TC_TOK, t_hi, ids + s * KVC_TC_IDS);
      __syncthreads();
    }
#pragma unroll
    for (int s = 0; s < PRO; ++s) {
      const long long ts = t_lo + (long long)s * KVC_TC_TOK;
      if (loads && s < nst) kvc_tc_load_stage<F, D, true, TBL ? 2 : 1>(a, L, ld, ring + s * L.stage, fo, ts, t_hi, ids + s * KVC_TC_IDS);
      if (loads && tbl && (!FP8 || s < PRO - 1))
        kvc_tc_issue_ids(a, b, fo, ts + (long long)PRO * KVC_TC_TOK, t_hi, ids_sh + ((s + PRO) % NI) * KVC_TC_IDS * 4);
      if (loads && s < nst) kvc_mbar_arrive_cp(mbf + 8 * s);
      kvc_cp_commit();
    }
  } else {
    /* prologue: the first NS - 1 stages of this warpgroup's rows in flight
     * (one commit group each), with the block ids of stages NS - 1 .. 2 NS - 3
     * (stage x's in this warpgroup's slot x % NS; a warpgroup barrier after
     * each stage: slot reuse) */
    ring = sbase + WF.ring;
    ids = (int *)(base + WF.ids) + wg * NS * KVC_TC_IDS;
    ids_sh = sbase + WF.ids + wg * NS * KVC_TC_IDS * 4;
    if (tbl) {
      for (int s = 0; s < NS - 1; ++s)
        kvc_wg_store_ids(a, b, fo, t_lo + (long long)s * KVC_TC_TOK, t_hi, ids + s * KVC_TC_IDS, wt);
      kvc_wg_sync(wg);
    }
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
      const long long ts = t_lo + (long long)s * KVC_TC_TOK;
      if (s < nst)
        kvc_wg_copy_stage<D, TBL>(a, b, hk, fo, wg, wt, ring + s * WF.stage, ring + s * WF.stage + WF.tile, ts, t_hi,
                                  ids + s * KVC_TC_IDS);
      if (tbl) {
        kvc_wg_issue_ids(a, b, fo, ts + (long long)(NS - 1) * KVC_TC_TOK, t_hi,
                         ids_sh + ((s + NS - 1) % NS) * KVC_TC_IDS * 4, wt);
        kvc_wg_sync(wg);
      }
      kvc_cp_commit();
    }
  }

  /* the Q tile: row r = query vector q0 + r (zeros past Q), logical unit u of
   * 8 dims from dims 8 u .. 8 u + 7 in the order (0, 4, 1, 5, 2, 6, 3, 7)
   * (q4), in natural order (16-bit and fp8 rows); a rotated call's query rotated
   * first (a warp per vector) */
  if (a.rot_q)
    kvc_rotated_query_rows<D>(a, b, hk, q0, KVC_WG_QV, Q, tid / KVC_WARP, KVC_WG_WGS * KVC_WG_THREADS / KVC_WARP,
                              tid % KVC_WARP, [&](int r, int d, unsigned short x) {
                                const int un = d / 8, k = d % 8;
                                *(unsigned short *)(base + W.qt + (un >> 3) * KVC_WG_CHUNK + r * 128 +
                                                    (((un & 7) ^ (r & 7)) << 4) +
                                                    2 * (NAT ? k : k < 4 ? 2 * k : 2 * k - 7)) = x;
                              });
  const int q_units = a.rot_q ? 0 : KVC_WG_QV * D / 8; /* rotated: staged above */
  for (int u = tid; u < q_units; u += KVC_WG_WGS * KVC_WG_THREADS) {
    const int r = u / (D / 8), un = u % (D / 8), qv = q0 + r;
    uint4 o = make_uint4(0u, 0u, 0u, 0u);
    if (qv < Q) {
      const unsigned short *qp = (const unsigned short *)kvc_q_at(a, b, hk * a.rep + qv / a.L, qv % a.L, 8 * un);
      uint32_t w[4];
      if (((uintptr_t)qp & 15) == 0) {
        const uint4 x = *(const uint4 *)qp;
        w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = (uint32_t)qp[2 * k] | ((uint32_t)qp[2 * k + 1] << 16);
      }
      if constexpr (NAT)
        o = make_uint4(w[0], w[1], w[2], w[3]);
      else
        o = make_uint4(__byte_perm(w[0], w[2], 0x5410), __byte_perm(w[0], w[2], 0x7632),
                       __byte_perm(w[1], w[3], 0x5410), __byte_perm(w[1], w[3], 0x7632));
    }
    *(uint4 *)(base + W.qt + (un >> 3) * KVC_WG_CHUNK + r * 128 + (((un & 7) ^ (r & 7)) << 4)) = o;
  }

  const bool tree = a.mask_kind == KVA_MASK_TREE;
  const long long n0 = len - a.L; /* TREE: the first new key */
  long long pos[2];
  uint64_t tbits[2];
  float m[2], l[2], oacc[NC][32];
  kvc_wg_rows_init<NC>(a, b, len, Q, q0 + 16 * warp + g, pos, tbits, m, l, oacc);

  if (!FL && nst > 0) { /* q4, fp8: stage 0 into tile buffer 0 (16-bit rows: stage 0 landed at the loop's top) */
    kvc_cp_wait<PRO - 1>();
    __syncthreads();
    if constexpr (FP8)
      kvc_wg_convert_fp8<F, D>(base + W.raw, L, base + kvc_wg_kt(W, 0), cv8, ksc, vsc);
    else
      kvc_wg_convert<D>(base + W.raw, L, base + kvc_wg_kt(W, 0), cv, wt, kvc_tc_so(gk, t_lo, e0));
    if (!loads) kvc_mbar_arrive(mbe);
  }
  kvc_fence_proxy_async();
  __syncthreads(); /* the Q tile and tile buffer 0 written, visible to the async proxy */

  /* descriptors: the Q tile; this warpgroup's 32 K rows and V rows of each
   * buffer (q4: buffers 0 and 1; 16-bit rows: ring slot 0, slot i at
   * + i * stage bytes) */
  const uint64_t dq = kvc_wg_desc(sbase + W.qt, 16, 1024);
  const uint64_t dk0 = kvc_wg_desc(FL ? ring + 4096 * wg : sbase + kvc_wg_kt(W, 0) + 4096 * wg, 16, 1024),
                 dk1 = kvc_wg_desc(sbase + kvc_wg_kt(W, 1) + 4096 * wg, 16, 1024);
  const uint64_t dv0 = kvc_wg_desc(FL ? ring + WF.tile + 4096 * wg : sbase + kvc_wg_vt(W, 0) + 4096 * wg,
                                   KVC_WG_CHUNK, 1024),
                 dv1 = kvc_wg_desc(sbase + kvc_wg_vt(W, 1) + 4096 * wg, KVC_WG_CHUNK, 1024);
  int slot = 0; /* 16-bit rows: stage s's ring slot, s % NS */
  for (int s = 0; s < nst; ++s) {
    const int cb = s & 1;
    if constexpr (FL) { /* this warpgroup's rows of stage s landed, visible to the async proxy */
      kvc_cp_wait<NS - 2>();
      kvc_fence_proxy_async();
      kvc_wg_sync(wg);
    }
    const uint64_t soff = FL ? (uint64_t)((slot * WF.stage) >> 4) : 0;
    const uint64_t dkc = FL ? dk0 + soff : cb ? dk1 : dk0, dvc = FL ? dv0 + soff : cb ? dv1 : dv0;
    /* S(s) = Q K^T over this warpgroup's 32 tokens (k-step kk: chunk kk / 4, + 32 (kk % 4) bytes) */
    float sacc[16];
    kvc_wg_fence();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      const uint64_t off = ((kk >> 2) * KVC_WG_CHUNK + (kk & 3) * 32) >> 4;
      if (kk == 0)
        kvc_wgmma_ss32<0, H>(sacc, dq + off, dkc + off);
      else
        kvc_wgmma_ss32<1, H>(sacc, dq + off, dkc + off);
    }
    kvc_wg_commit();
    if constexpr (FL) {
      /* the copies of stage s + NS - 1 into slot (s - 1) % NS once P.V(s - 1),
       * its last reader, is done (and the block ids of stage s + 2 NS - 2) */
      const int sn = s + NS - 1, sl = slot == 0 ? NS - 1 : slot - 1;
      if (sn < nst) { /* (the wait here, not before the branch: an unconditional one made ptxas serialize the wgmmas) */
        kvc_wg_wait<1>();
        kvc_wg_sync(wg); /* every warp's share of P.V(s - 1) done */
        kvc_wg_copy_stage<D, TBL>(a, b, hk, fo, wg, wt, ring + sl * WF.stage, ring + sl * WF.stage + WF.tile,
                                  t_lo + (long long)sn * KVC_TC_TOK, t_hi, ids + (sn % NS) * KVC_TC_IDS);
      }
      if (tbl)
        kvc_wg_issue_ids(a, b, fo, t_lo + (long long)(sn + NS - 1) * KVC_TC_TOK, t_hi,
                         ids_sh + ((sn + NS - 1) % NS) * KVC_TC_IDS * 4, wt);
      kvc_cp_commit();
      slot = slot + 1 == NS ? 0 : slot + 1;
    } else {
      if constexpr (!FP8) { /* the copies of stage s + RAW - 1 (and the block ids of stage s + 2 RAW - 2) */
        const int sn = s + KVC_WG_RAW - 1;
        if (loads && sn < nst) { /* into the slot of stage s - 1, once warpgroup 1 has converted it */
          if (s > 0) kvc_mbar_wait(mbe + 8 * ((s - 1) % KVC_WG_RAW), ((s - 1) / KVC_WG_RAW) & 1);
          kvc_tc_load_stage<F, D, true, TBL ? 2 : 1>(a, L, ld, ring + (sn % KVC_WG_RAW) * L.stage, fo,
                                       t_lo + (long long)sn * KVC_TC_TOK, t_hi, ids + (sn % NI) * KVC_TC_IDS);
          if (tbl)
            kvc_tc_issue_ids(a, b, fo, t_lo + (long long)(sn + KVC_WG_RAW - 1) * KVC_TC_TOK, t_hi,
                             ids_sh + ((sn + KVC_WG_RAW - 1) % NI) * KVC_TC_IDS * 4);
          kvc_mbar_arrive_cp(mbf + 8 * (sn % KVC_WG_RAW)); /* its copies and the ids landed */
        }
        kvc_cp_commit();
      }
      if (s + 1 < nst) { /* stage s + 1 into the other buffer while S(s) runs */
        kvc_mbar_wait(mbf + 8 * ((s + 1) % RAW), ((s + 1) / RAW) & 1); /* stage s + 1 landed */
        if constexpr (FP8) {
          /* the copies of stage s + RAW into the slot of stage s once
           * warpgroup 1 has converted it, and the block ids of stage s + 2
           * RAW - 1 (landed with stage s + RAW, waited for before the loads
           * that read them) */
          const int sn = s + RAW;
          if (loads && sn < nst) {
            kvc_mbar_wait(mbe + 8 * (s % RAW), (s / RAW) & 1);
            kvc_tc_load_stage<F, D, true, TBL ? 2 : 1>(a, L, ld, ring + (s % RAW) * L.stage, fo,
                                                       t_lo + (long long)sn * KVC_TC_TOK, t_hi,
                                                       ids + (sn % NI) * KVC_TC_IDS);
            if (tbl)
              kvc_tc_issue_ids(a, b, fo, t_lo + (long long)(sn + RAW - 1) * KVC_TC_TOK, t_hi,
                               ids_sh + ((sn + RAW - 1) % NI) * KVC_TC_IDS * 4);
            kvc_mbar_arrive_cp(mbf + 8 * (sn % RAW));
          }
          kvc_cp_commit();
        }
        kvc_wg_wait<1>(); /* P.V(s - 1), the last reader of this warpgroup's rows there, done */
        if constexpr (FP8)
          kvc_wg_convert_fp8<F, D>(base + W.raw + ((s + 1) % RAW) * L.stage, L, base + kvc_wg_kt(W, cb ^ 1), cv8, ksc,
                                   vsc);
        else
          kvc_wg_convert<D>(base + W.raw + ((s + 1) % KVC_WG_RAW) * L.stage, L, base + kvc_wg_kt(W, cb ^ 1), cv, wt,
                            kvc_tc_so(gk, t_lo + (long long)(s + 1) * KVC_TC_TOK, e0));
        if (!loads) kvc_mbar_arrive(mbe + 8 * ((s + 1) % RAW)); /* its slot free */
      }
    }
    kvc_wg_wait<0>();
    kvc_wg_fence_regs(sacc);
#pragma unroll
    for (int c = 0; c < NC; ++c) kvc_wg_fence_regs(oacc[c]);

    /* masks and logits (log2 units): sacc[4 j + e] is (row 16 warp + g + 8 (e >> 1),
     * stage token 32 wg + 8 j + 2 t4 + (e & 1)); a row sees stage tokens [lo, hi) */
    const long long t0 = t_lo + (long long)s * KVC_TC_TOK;
    const bool full = kvc_tc_stage_full(a, t0, t_hi, len);
    int lo[2] = {0, 0}, hi[2] = {KVC_TC_TOK, KVC_TC_TOK};
    /* the stage's tokens [tb, tb + 64) that are new keys (TREE): from n0 on, below t_hi */
    const int nlo = tree ? (int)min(max(n0 - t0, 0LL), (long long)KVC_TC_TOK) : KVC_TC_TOK;
    const int nhi = tree ? (int)min(max(t_hi - t0, 0LL), (long long)KVC_TC_TOK) : 0;
    if (!full) /* causal: t <= pos, t > pos - window; TREE: the same below n0, the bits from n0; no mask: t < t_hi
                  (the selector sends no other mask here) */
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const long long h = min(tree ? min(t_hi, n0) : t_hi, pos[r] + 1);
        const long long o = a.window > 0 && a.mask_kind != KVA_MASK_NONE ? pos[r] - a.window + 1 : t0;
        hi[r] = (int)(min(max(h - t0, 0LL), (long long)KVC_TC_TOK));
        lo[r] = (int)(min(max(o - t0, 0LL), (long long)KVC_TC_TOK));
      }
    /* the scale, the softcap and the mask each in a loop of its own: one
     * branch per stage for the softcap and one for the mask */
#pragma unroll
    for (int i = 0; i < 16; ++i) sacc[i] *= scl2;
    if (capped)
#pragma unroll
      for (int i = 0; i < 16; ++i) sacc[i] = cap2 * tanhf(sacc[i] * cap2_inv);
    if (!full)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1, tok = 32 * wg + 8 * j + 2 * t4 + (e & 1);
          const bool vis = (tok >= lo[r] && tok < hi[r]) ||
                           (tok >= nlo && tok < nhi && ((tbits[r] >> (t0 + tok - n0)) & 1ull));
          sacc[4 * j + e] = vis ? sacc[4 * j + e] : -INFINITY;
        }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = kvc_max(mx[e >> 1], sacc[4 * j + e]);
    kvc_wg_rescale<NC>(mx, m, l, oacc);
    /* the exponent's offset: m, or 0 while m is -inf (the row has seen no
     * key: its logits are all -inf, and 2^(-inf - 0) = 0 without a compare
     * per element; a NaN m gives NaN for every key, masked ones included:
     * the row's output is NaN either way) */
    const float mp[2] = {m[0] == -INFINITY ? 0.0f : m[0], m[1] == -INFINITY ? 0.0f : m[1]};
    /* P in bf16 (f16 rows: f16) as the A fragments of the 2 P.V k-steps:
     * a[2 h + r] = tokens 16 kq + 8 h + 2 t4, + 1 of row r; l sums the
     * rounded values */
    uint32_t pa[2][4];
#pragma unroll
    for (int kq = 0; kq < 2; ++kq)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int j = 2 * kq + h;
          const float x0 = sacc[4 * j + 2 * r], x1 = sacc[4 * j + 2 * r + 1];
          const float p0 = kvc_exp2(x0 - mp[r]), p1 = kvc_exp2(x1 - mp[r]); /* -inf (masked): 0 */
          pa[kq][2 * h + r] = kvc_wg_pack_p<H>(p0, p1, l[r]);
        }
    /* O += P V (k-step kq: this warpgroup's V rows 16 kq .., chunk c) */
    kvc_wg_fence();
#pragma unroll
    for (int kq = 0; kq < 2; ++kq)
#pragma unroll
      for (int c = 0; c < NC; ++c)
        kvc_wgmma_rs<H>(oacc[c], pa[kq], dvc + ((c * KVC_WG_CHUNK + kq * 2048) >> 4));
    kvc_wg_commit();
    if constexpr (!FL) {
      /* this warpgroup's conversion of stage s + 1 published to the async proxy
       * (the fence waits for its stores: placed here, after the softmax, it
       * finds them done) */
      kvc_fence_proxy_async();
      kvc_wg_sync(wg);
    }
  }
  kvc_wg_wait<0>();
#pragma unroll
  for (int c = 0; c < NC; ++c) kvc_wg_fence_regs(oacc[c]);
  kvc_cp_wait<0>();
  cudaTriggerProgrammaticLaunchCompletion(); /* the merge waits for this grid's completion */
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(KVC_FULL_MASK, l[r], 1);
    l[r] += __shfl_xor_sync(KVC_FULL_MASK, l[r], 2);
  }
  __syncthreads(); /* every warp done with the tiles and the ring */
  /* the two warpgroups' states through the idle tiles and ring: O [64][D + 4]
   * each (padded: no bank conflicts), accumulator (c, j, e) of lane (g, t4)
   * at column 64 c + 8 j + t4 + 4 (e & 1). q4 (V in pair order): that column
   * is its dim; combined into warpgroup 0's. 16-bit and fp8 rows (V in dim order):
   * the accumulator is dim 64 c + 8 j + 2 t4 + (e & 1), so dim d sits at
   * column dc(d); combined into a third O in dim order (stores in dim order
   * made ptxas serialize the loop's wgmmas: C7515) */
  constexpr int OLD = D + 4;
  float *ost = (float *)(base + (FL ? WF.ost : W.ost)), *ms = (float *)(base + (FL ? WF.ms : W.ms)),
        *ls = (float *)(base + (FL ? WF.ls : W.ls));
  float *own = ost + wg * KVC_WG_QV * OLD, *mw = (float *)(base + (FL ? WF.mw : W.mw));
  static_assert(KVC_WG_WGS * KVC_WG_QV * (D + 4) * 4 <= 4 * 64 * 2 * D + KVC_WG_RAW * 64 * (D / 2 + KVC_TC_ROWPAD),
                "the tiles and the ring hold both warpgroups' outputs");
  static_assert(3 * KVC_WG_QV * (D + 4) * 4 + 6 * KVC_WG_QV * 4 <= (1 + 2 * KVC_WG_NS(D)) * 64 * 2 * D,
                "16-bit rows: the Q tile and the ring hold three outputs, the maxima and sums");
  static_assert(3 * KVC_WG_QV * (D + 4) * 4 + 6 * KVC_WG_QV * 4 <= 5 * 64 * 2 * D + KVC_WG_RAW8(D) * 64 * 2 * D,
                "fp8 rows: the Q tile, the tiles and the ring hold three outputs, the maxima and sums");
#pragma unroll
  for (int c = 0; c < NC; ++c)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        own[(16 * warp + g + 8 * (e >> 1)) * OLD + 64 * c + 8 * j + t4 + 4 * (e & 1)] = oacc[c][4 * j + e];
  if (t4 == 0)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mw[wg * KVC_WG_QV + 16 * warp + g + 8 * r] = m[r];
      mw[(2 + wg) * KVC_WG_QV + 16 * warp + g + 8 * r] = l[r];
    }
  __syncthreads();
  const int nq = min(KVC_WG_QV, Q - q0);
  float *fin = NAT ? ost + KVC_WG_WGS * KVC_WG_QV * OLD : ost; /* the combined O */
  for (int i = tid; i < nq * D; i += KVC_WG_WGS * KVC_WG_THREADS) {
    const int v = i / D, d = i % D;
    float mn, f0, f1;
    kvc_factors2(mw[v], mw[KVC_WG_QV + v], mn, f0, f1);
    const int dc = NAT ? kvc_wg_col()(d) : d; /* where dim d's column is */
    fin[v * OLD + d] = ost[v * OLD + dc] * f0 + ost[(KVC_WG_QV + v) * OLD + dc] * f1;
    if (d == 0) {
      ms[v] = mn;
      ls[v] = mw[2 * KVC_WG_QV + v] * f0 + mw[3 * KVC_WG_QV + v] * f1;
    }
  }
  __syncthreads();
  kvc_emit_block<D>(a, split, b, hk, q0, nq, D, OLD, fin, ms, ls, KVC_WG_WGS * KVC_WG_THREADS);
#else
  __trap(); /* built without sm_90a code: the selector does not pick this kernel (kvc_wg_compiled) */
#endif
}

/* ---- head dim 512, 16-bit rows (instances kvc_wg512_kernel<KVC_BF16 / KVC_F16, TBL>) ----
 * At D = 512 a full O state [64 rows x 512] per warpgroup would take 256 f32
 * registers per thread. Here both warpgroups compute the same S = Q K^T for
 * all tokens of a stage (identical inputs and code: the same maxima, P and
 * sums in both), and warpgroup w accumulates O only for value dims 256 w ..
 * 256 w + 255 (4 chunks of 64: 128 accumulator registers per thread); no
 * end-of-block combination: each warpgroup writes its dims, warpgroup 0 the
 * maxima and sums.
 *   memory: stages of KVC_WG512_TOK = 32 tokens; K tile [8 chunks][32 rows]
 *         [128 B] and V tile alike (32 KB each), two slots of each, after the
 *         Q tile [8 chunks][64 rows][128 B] (64 KB): 192 KB, the block-id
 *         ring (BLOCK_TABLE) and the 1024-byte alignment: ~194 KB, one block
 *         per SM. Each K/V byte is read from DRAM once per block of up to 64
 *         query vectors.
 *   copies: cp.async of 16-byte units straight to unit u ^ (r % 8) of row r
 *         (the 128-byte swizzle); warpgroup w copies K rows 16 w .. 16 w + 15
 *         (read by both: block barriers) and V dims 256 w .. 256 w + 255 of
 *         all 32 rows (read by it alone: warpgroup barriers).
 *   pipeline, stage s (slot s % 2; each warpgroup): wait for the copies of
 *         stage s (those of K(s + 1) left in flight), fence to the async
 *         proxy, block barrier; issue S(s) (32 k-steps of m64n32k16); once
 *         P.V(s - 1) is done (warpgroup barrier) issue V(s + 1) into the
 *         other V slot, and the block ids of stage s + 3; once S(s) is done
 *         in both (block barrier) issue K(s + 2) into K slot s % 2; softmax
 *         (the q4 / 16-bit code of kvc_wg_kernel on 32 tokens); issue P.V(s)
 *         (2 k-steps x 4 chunks of m64n64k16, P the register A operand).
 *         K(s + 2) and V(s + 1) load while S and P.V of stage s run: 32 to
 *         96 KB in flight per SM.
 *   precision: P rounded to bf16 (f16 rows: f16 wgmma, P in f16), f32 sums;
 *         q, K and V as given (a rotated call's q rotated on load, as at the
 *         smaller head dims).
 *   launch: grid (ceil(rep L / 64), nsplit, B KVH) x 256 threads. */
#define KVC_WG512_TOK 32 /* tokens per stage */
#define KVC_WG512_IDS 4  /* block-id slots (stage x's in slot x % 4) */
struct kvc_wg512_layout {
  int qt, kt, vt, tile, ids, total; /* tile: bytes of one K or V tile (slot i at kt / vt + i tile) */
  int ost, ms, ls;                  /* after the loop: O [64][512 + 4] f32, maxima, sums over the Q tile and slots */
};
__host__ __device__ inline kvc_wg512_layout kvc_wg512_layout_of(void) {
  kvc_wg512_layout w;
  w.tile = KVC_WG512_TOK * 2 * 512;
  w.qt = 0;
  w.kt = KVC_WG_QV * 2 * 512;
  w.vt = w.kt + 2 * w.tile;
  w.ids = w.vt + 2 * w.tile;
  w.total = w.ids + KVC_WG512_IDS * KVC_TC_IDS * 4;
  w.ost = 0;
  w.ms = w.ost + KVC_WG_QV * (512 + 4) * 4;
  w.ls = w.ms + KVC_WG_QV * 4;
  return w;
}
static int kvc_wg512_total(void) { return kvc_wg512_layout_of().total; }
/* Unit u (dims 8 u .. 8 u + 7) of K or V tile rows r0 .. r0 + 7 of the
 * stage at t0 (zeros from t_hi on; kvc_wg_run) from operand O into the tile
 * at shared address t: row r at chunk u / 8, byte r * 128 + 16 ((u % 8) ^ (r
 * % 8)). */
template <bool TBL>
__device__ __forceinline__ void kvc_wg512_copy(const kvc_args &a, const kvc_operand &O, int b, int hk, int fo,
                                               uint32_t t, long long t0, long long t_hi, const int *ids, int u,
                                               int r0) {
  const long long left = t_hi - t0 - r0;
  const int lim = left <= 0 ? 0 : left >= 8 ? 8 : (int)left;
  const kvc_wg_run w = kvc_wg_run_of<KVC_WG_FLOAT_RUN(512), TBL>(a.k, b, fo, t0, r0, lim, ids);
  t += (u >> 3) * (KVC_WG512_TOK * 128);
  kvc_wg_run_copy<8, TBL>(O, w, ids, a.k.nblk, hk, 16 * u, lim, [&](int k) {
    const int r = r0 + k;
    return t + r * 128 + (((u & 7) ^ (r & 7)) << 4);
  });
}
/* warpgroup wg's K rows 16 wg + 8 (wt / 64) .. + 7 (unit wt % 64); its V
 * dims 256 wg .. 256 wg + 255 (unit 32 wg + wt % 32) of rows 8 (wt / 32) ..
 * + 7: a warp's copy of one k takes 512 contiguous bytes of a row */
template <bool TBL>
__device__ __forceinline__ void kvc_wg512_copy_k(const kvc_args &a, int b, int hk, int fo, int wg, int wt, uint32_t t,
                                                 long long t0, long long t_hi, const int *ids) {
  kvc_wg512_copy<TBL>(a, a.k, b, hk, fo, t, t0, t_hi, ids, wt % 64, 16 * wg + 8 * (wt / 64));
}
template <bool TBL>
__device__ __forceinline__ void kvc_wg512_copy_v(const kvc_args &a, int b, int hk, int fo, int wg, int wt, uint32_t t,
                                                 long long t0, long long t_hi, const int *ids) {
  kvc_wg512_copy<TBL>(a, a.v, b, hk, fo, t, t0, t_hi, ids, 32 * wg + wt % 32, 8 * (wt / 32));
}

template <int F, bool TBL>
__global__ void __launch_bounds__(KVC_WG_WGS * KVC_WG_THREADS, 1) kvc_wg512_kernel(const kvc_args a) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = 512, NC = 4, KS = D / 16, T = KVC_WG512_TOK; /* NC: value chunks per warpgroup */
  constexpr int QCH = KVC_WG_QV * 128, KCH = T * 128;           /* bytes of a column chunk: Q, K / V tiles */
  constexpr bool H = F == KVC_F16;
  static_assert(kvc_tc_float(F), "16-bit rows only");
  extern __shared__ unsigned char kvc_wg_buf[];
  const uint32_t sraw = (uint32_t)__cvta_generic_to_shared(kvc_wg_buf);
  const uint32_t sbase = (sraw + 1023u) & ~1023u;
  unsigned char *base = kvc_wg_buf + (sbase - sraw);
  const int tid = threadIdx.x, wg = tid / KVC_WG_THREADS, wt = tid % KVC_WG_THREADS;
  const int lane = tid % KVC_WARP, warp = wt / KVC_WARP, g = lane >> 2, t4 = lane & 3;
  const int qg = kvc_qtile(), split = blockIdx.y;
  const int b = blockIdx.z / a.KVH, hk = blockIdx.z % a.KVH;
  const kvc_wg512_layout W = kvc_wg512_layout_of();
  const long long len = kvc_seq_len(a, b);
  const int fo = kvc_first_offset(a.k, b);
  const int Q = a.rep * a.L, q0 = qg * KVC_WG_QV;
  long long t_lo, t_hi;
  kvc_split_range(a, split, len, q0, KVC_WG_QV, &t_lo, &t_hi);
  const int nst = t_hi > t_lo ? (int)((t_hi - t_lo + T - 1) / T) : 0;
  const float scl2 = a.scale * KVC_LOG2E, cap2 = a.softcap * KVC_LOG2E, cap2_inv = a.softcap_inv * (1.0f / KVC_LOG2E);
  const bool capped = a.softcap > 0.0f;
  const uint32_t kt = sbase + W.kt, vt = sbase + W.vt;
  int *ids = (int *)(base + W.ids);
  const uint32_t ids_sh = sbase + W.ids;

  /* prologue: the block ids of stages 0 .. 2 (stage x's in slot x % 4, then
   * by cp.async three stages ahead); K(0), V(0) and K(1) in flight */
  if (TBL) {
    if (wg == 0)
      for (int s = 0; s < 3; ++s)
        kvc_wg_store_ids(a, b, fo, t_lo + (long long)s * T, t_hi, ids + s * KVC_TC_IDS, wt);
    __syncthreads();
  }
  if (nst > 0) {
    kvc_wg512_copy_k<TBL>(a, b, hk, fo, wg, wt, kt, t_lo, t_hi, ids);
    kvc_wg512_copy_v<TBL>(a, b, hk, fo, wg, wt, vt, t_lo, t_hi, ids);
  }
  kvc_cp_commit();
  if (nst > 1) kvc_wg512_copy_k<TBL>(a, b, hk, fo, wg, wt, kt + W.tile, t_lo + T, t_hi, ids + KVC_TC_IDS);
  kvc_cp_commit();

  /* the Q tile: row r = query vector q0 + r (zeros past Q), unit u of row r
   * dims 8 u .. 8 u + 7 (natural order); a rotated call's query rotated
   * first (a warp per vector) */
  if (a.rot_q)
    kvc_rotated_query_rows<D>(a, b, hk, q0, KVC_WG_QV, Q, tid / KVC_WARP, KVC_WG_WGS * KVC_WG_THREADS / KVC_WARP,
                              tid % KVC_WARP, [&](int r, int d, unsigned short x) {
                                const int un = d / 8;
                                *(unsigned short *)(base + W.qt + (un >> 3) * QCH + r * 128 +
                                                    (((un & 7) ^ (r & 7)) << 4) + 2 * (d % 8)) = x;
                              });
  const int q_units = a.rot_q ? 0 : KVC_WG_QV * D / 8; /* rotated: staged above */
  for (int u = tid; u < q_units; u += KVC_WG_WGS * KVC_WG_THREADS) {
    const int r = u / (D / 8), un = u % (D / 8), qv = q0 + r;
    uint4 o = make_uint4(0u, 0u, 0u, 0u);
    if (qv < Q) {
      const unsigned short *qp = (const unsigned short *)kvc_q_at(a, b, hk * a.rep + qv / a.L, qv % a.L, 8 * un);
      if (((uintptr_t)qp & 15) == 0) {
        o = *(const uint4 *)qp;
      } else {
        uint32_t w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = (uint32_t)qp[2 * k] | ((uint32_t)qp[2 * k + 1] << 16);
        o = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
    *(uint4 *)(base + W.qt + (un >> 3) * QCH + r * 128 + (((un & 7) ^ (r & 7)) << 4)) = o;
  }

  const bool tree = a.mask_kind == KVA_MASK_TREE;
  const long long n0 = len - a.L; /* TREE: the first new key */
  long long pos[2];
  uint64_t tbits[2];
  float m[2], l[2], oacc[NC][32];
  kvc_wg_rows_init<NC>(a, b, len, Q, q0 + 16 * warp + g, pos, tbits, m, l, oacc);
#pragma unroll /* opaque zeros: folded into the first P.V, their moves into its accumulators made ptxas serialize the wgmmas (C7515) */
  for (int c = 0; c < NC; ++c) kvc_wg_fence_regs(oacc[c]);
  kvc_fence_proxy_async();
  __syncthreads(); /* the Q tile written, visible to the async proxy */

  /* descriptors: the Q tile (K-major A), K slot 0 (K-major B), this
   * warpgroup's first V chunk of slot 0 (N-major B); slot i at + i tile bytes */
  const uint64_t dq = kvc_wg_desc(sbase + W.qt, 16, 1024);
  const uint64_t dk = kvc_wg_desc(kt, 16, 1024);
  const uint64_t dv = kvc_wg_desc(vt + NC * KCH * wg, KCH, 1024);
  for (int s = 0; s < nst; ++s) {
    const int sl = s & 1;
    const uint64_t soff = (uint64_t)((sl * W.tile) >> 4);
    kvc_cp_wait<1>(); /* K(s), V(s) landed (K(s + 1) may be in flight) */
    kvc_fence_proxy_async();
    __syncthreads(); /* both warpgroups' rows visible */
    /* S(s) = Q K^T over the stage's 32 tokens (k-step kk: chunk kk / 4, + 32 (kk % 4) bytes) */
    float sacc[16];
    kvc_wg_fence();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      const uint64_t oq = ((kk >> 2) * QCH + (kk & 3) * 32) >> 4, ok = ((kk >> 2) * KCH + (kk & 3) * 32) >> 4;
      if (kk == 0)
        kvc_wgmma_ss32<0, H>(sacc, dq + oq, dk + soff + ok);
      else
        kvc_wgmma_ss32<1, H>(sacc, dq + oq, dk + soff + ok);
    }
    kvc_wg_commit();
    if (s + 1 < nst) { /* V(s + 1) into the other slot once this warpgroup's P.V(s - 1), its last reader, is done */
      kvc_wg_wait<1>();
      kvc_wg_sync(wg);
      kvc_wg512_copy_v<TBL>(a, b, hk, fo, wg, wt, vt + (sl ^ 1) * W.tile, t_lo + (long long)(s + 1) * T, t_hi,
                            ids + ((s + 1) % KVC_WG512_IDS) * KVC_TC_IDS);
    }
    if (TBL && wg == 0)
      kvc_wg_issue_ids(a, b, fo, t_lo + (long long)(s + 3) * T, t_hi,
                       ids_sh + ((s + 3) % KVC_WG512_IDS) * KVC_TC_IDS * 4, wt);
    kvc_cp_commit();
    kvc_wg_wait<0>();
    kvc_wg_fence_regs(sacc);
#pragma unroll
    for (int c = 0; c < NC; ++c) kvc_wg_fence_regs(oacc[c]);
    __syncthreads(); /* S(s) done in both warpgroups: K slot sl free */
    if (s + 2 < nst)
      kvc_wg512_copy_k<TBL>(a, b, hk, fo, wg, wt, kt + sl * W.tile, t_lo + (long long)(s + 2) * T, t_hi,
                            ids + ((s + 2) % KVC_WG512_IDS) * KVC_TC_IDS);
    kvc_cp_commit();

    /* masks and logits (log2 units): sacc[4 j + e] is (row 16 warp + g + 8 (e >> 1),
     * stage token 8 j + 2 t4 + (e & 1)); a row sees stage tokens [lo, hi) */
    const long long t0 = t_lo + (long long)s * T;
    const bool full = kvc_keys_all_visible(a, t0, T, t_hi, len);
    int lo[2] = {0, 0}, hi[2] = {T, T};
    /* the stage's tokens that are new keys (TREE): from n0 on, below t_hi */
    const int nlo = tree ? (int)min(max(n0 - t0, 0LL), (long long)T) : T;
    const int nhi = tree ? (int)min(max(t_hi - t0, 0LL), (long long)T) : 0;
    if (!full) /* causal: t <= pos, t > pos - window; TREE: the same below n0, the bits from n0; no mask: t < t_hi */
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const long long h = min(tree ? min(t_hi, n0) : t_hi, pos[r] + 1);
        const long long o = a.window > 0 && a.mask_kind != KVA_MASK_NONE ? pos[r] - a.window + 1 : t0;
        hi[r] = (int)(min(max(h - t0, 0LL), (long long)T));
        lo[r] = (int)(min(max(o - t0, 0LL), (long long)T));
      }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, tok = 8 * j + 2 * t4 + (e & 1);
        float x = sacc[4 * j + e] * scl2;
        if (capped) x = cap2 * tanhf(x * cap2_inv);
        if (!full)
          x = (tok >= lo[r] && tok < hi[r]) ||
                      (tok >= nlo && tok < nhi && ((tbits[r] >> (t0 + tok - n0)) & 1ull))
                  ? x
                  : -INFINITY;
        sacc[4 * j + e] = x;
        mx[r] = kvc_max(mx[r], x);
      }
    kvc_wg_rescale<NC>(mx, m, l, oacc);
    /* P in bf16 (f16 rows: f16) as the A fragments of the 2 P.V k-steps:
     * a[2 h + r] = tokens 16 kq + 8 h + 2 t4, + 1 of row r; l sums the
     * rounded values */
    uint32_t pa[2][4];
#pragma unroll
    for (int kq = 0; kq < 2; ++kq)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int j = 2 * kq + h;
          const float x0 = sacc[4 * j + 2 * r], x1 = sacc[4 * j + 2 * r + 1];
          const float p0 = x0 == -INFINITY ? 0.0f : kvc_exp2(x0 - m[r]);
          const float p1 = x1 == -INFINITY ? 0.0f : kvc_exp2(x1 - m[r]);
          pa[kq][2 * h + r] = kvc_wg_pack_p<H>(p0, p1, l[r]);
        }
    /* O += P V over this warpgroup's dims (k-step kq: V rows 16 kq .., chunk c) */
    kvc_wg_fence();
#pragma unroll
    for (int kq = 0; kq < 2; ++kq)
#pragma unroll
      for (int c = 0; c < NC; ++c) kvc_wgmma_rs<H>(oacc[c], pa[kq], dv + soff + ((c * KCH + kq * 2048) >> 4));
    kvc_wg_commit();
  }
  kvc_wg_wait<0>();
#pragma unroll
  for (int c = 0; c < NC; ++c) kvc_wg_fence_regs(oacc[c]);
  kvc_cp_wait<0>();
  cudaTriggerProgrammaticLaunchCompletion(); /* the merge waits for this grid's completion */
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(KVC_FULL_MASK, l[r], 1);
    l[r] += __shfl_xor_sync(KVC_FULL_MASK, l[r], 2);
  }
  __syncthreads(); /* every warp done with the tiles */
  /* the state through the idle Q tile and slots: O [64][D + 4] (padded: no
   * bank conflicts); accumulator (c, j, e) of lane (g, t4), dim 256 wg + 64 c
   * + 8 j + 2 t4 + (e & 1), stored at column 256 wg + 64 c + 8 j + t4 + 4 (e
   * & 1) (as kvc_wg_kernel: stores in dim order made ptxas serialize the
   * loop's wgmmas), so dim d sits at column dc(d); m and l are the same in
   * both warpgroups: warpgroup 0's */
  constexpr int OLD = D + 4;
  static_assert(KVC_WG_QV * (D + 4) * 4 + 2 * KVC_WG_QV * 4 <= (KVC_WG_QV + 4 * KVC_WG512_TOK) * 2 * D,
                "the Q tile and the slots hold the output, the maxima and sums");
  float *ost = (float *)(base + W.ost), *ms = (float *)(base + W.ms), *ls = (float *)(base + W.ls);
#pragma unroll
  for (int c = 0; c < NC; ++c)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        ost[(16 * warp + g + 8 * (e >> 1)) * OLD + 256 * wg + 64 * c + 8 * j + t4 + 4 * (e & 1)] = oacc[c][4 * j + e];
  if (wg == 0 && t4 == 0)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      ms[16 * warp + g + 8 * r] = m[r];
      ls[16 * warp + g + 8 * r] = l[r];
    }
  __syncthreads();
  kvc_emit_block<D>(a, split, b, hk, q0, min(KVC_WG_QV, Q - q0), D, OLD, ost, ms, ls, KVC_WG_WGS * KVC_WG_THREADS,
                    kvc_wg_col());
#else
  __trap(); /* built without sm_90a code: the selector does not pick this kernel (kvc_wg_compiled) */
#endif
}

/* ---- host side ---- */
/* A marker kernel whose static shared memory says, through
 * cudaFuncGetAttributes (no launch, no synchronization: capture-safe),
 * whether the code this device runs was compiled with the sm_90a features:
 * a build for Hopper without sm_90a code (a compute_90 PTX build, say) has
 * the warpgroup kernel compiled out (a trap), and the selector must not
 * pick it. Never launched. */
#define KVC_WG_MARK_WORDS 4
__global__ void kvc_wg_mark_kernel(int *out) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ volatile int mark[KVC_WG_MARK_WORDS];
  mark[threadIdx.x % KVC_WG_MARK_WORDS] = (int)threadIdx.x;
  __syncthreads();
  if (out) *out = mark[0];
#else
  if (out) *out = 0;
#endif
}
static int kvc_wg_compiled(void) {
  cudaFuncAttributes fa;
  if (cudaFuncGetAttributes(&fa, kvc_wg_mark_kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return fa.sharedSizeBytes == KVC_WG_MARK_WORDS * sizeof(int);
}

/* The dynamic shared memory limit of an instance, set to the opt-in maximum
 * (every layout fits under it or is not selected). */
template <int F, int D, bool T> static cudaError_t kvc_wg_prepare(void) {
  return cudaFuncSetAttribute(kvc_wg_kernel<F, D, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, KVC_TC_SMEM_MAX);
}
/* (rows, head dim, BLOCK_TABLE rows): an instance per layout, so the loop holds one loader path */
#define KVC_WG_INSTANCES_F(X, F) X(F, 64, false) X(F, 64, true) X(F, 128, false) X(F, 128, true) X(F, 256, false) X(F, 256, true)
#define KVC_WG_INSTANCES(X)                                                                                             \
  KVC_WG_INSTANCES_F(X, KVC_Q4) KVC_WG_INSTANCES_F(X, KVC_BF16) KVC_WG_INSTANCES_F(X, KVC_F16)                         \
  KVC_WG_INSTANCES_F(X, KVC_E4M3) KVC_WG_INSTANCES_F(X, KVC_E5M2)

/* Both layouts' instances get the limit; their residency is the same (one
 * block per SM: shared memory at D = 256, registers at 128; two at 64). */
template <int F, int D> static cudaError_t kvc_wg_occupancy_d(int *n, int smem) {
  cudaError_t e = kvc_wg_prepare<F, D, false>();
  if (e == cudaSuccess) e = kvc_wg_prepare<F, D, true>();
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, kvc_wg_kernel<F, D, false>, KVC_WG_WGS * KVC_WG_THREADS, smem);
  return e;
}
/* head dim 512 (16-bit rows): kvc_wg512_kernel, one block per SM */
template <int F> static cudaError_t kvc_wg512_occupancy(int *n, int smem) {
  cudaError_t e = cudaFuncSetAttribute(kvc_wg512_kernel<F, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       KVC_TC_SMEM_MAX);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(kvc_wg512_kernel<F, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, KVC_TC_SMEM_MAX);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, kvc_wg512_kernel<F, false>, KVC_WG_WGS * KVC_WG_THREADS, smem);
  return e;
}
template <int F> static cudaError_t kvc_wg_occupancy_f(int D, int *n, int smem) {
  if constexpr (kvc_tc_float(F))
    if (D == 512) return kvc_wg512_occupancy<F>(n, smem);
  return D == 64    ? kvc_wg_occupancy_d<F, 64>(n, smem)
         : D == 128 ? kvc_wg_occupancy_d<F, 128>(n, smem)
         : D == 256 ? kvc_wg_occupancy_d<F, 256>(n, smem)
                    : cudaErrorInvalidValue;
}
int kvc_wg_occupancy(int f, int D, int smem) {
  int n = 0;
  if (!kvc_wg_compiled()) return 0;
  const cudaError_t e = f == KVC_Q4     ? kvc_wg_occupancy_f<KVC_Q4>(D, &n, smem)
                        : f == KVC_BF16 ? kvc_wg_occupancy_f<KVC_BF16>(D, &n, smem)
                        : f == KVC_F16  ? kvc_wg_occupancy_f<KVC_F16>(D, &n, smem)
                        : f == KVC_E4M3 ? kvc_wg_occupancy_f<KVC_E4M3>(D, &n, smem)
                        : f == KVC_E5M2 ? kvc_wg_occupancy_f<KVC_E5M2>(D, &n, smem)
                                        : cudaErrorInvalidValue;
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

int kvc_launch_wg(const kvc_args &a, const kvc_plan &plan, cudaStream_t stream) {
  dim3 grid(plan.qtiles, plan.nsplit, a.B * a.KVH);
  const bool nat = kvc_tc_float(plan.fmt) || kvc_tc_fp8(plan.fmt); /* no groups */
  const int smem = kvc_wg_smem(plan.fmt, a.Dk, nat ? 0 : a.Dk / a.k.group, nat ? 0 : a.Dv / a.v.group);
  cudaError_t e = cudaErrorInvalidValue;
#define KVC_CASE(F_, D_, T_)                                                                       \
  if (plan.fmt == F_ && a.Dk == D_ && (a.k.tbl != nullptr) == T_) {                                \
    kvc_wg_kernel<F_, D_, T_><<<grid, KVC_WG_WGS * KVC_WG_THREADS, smem, stream>>>(a);             \
    e = cudaGetLastError();                                                                        \
  }
  KVC_WG_INSTANCES(KVC_CASE)
#undef KVC_CASE
#define KVC_CASE(F_, T_)                                                                           \
  if (plan.fmt == F_ && a.Dk == 512 && (a.k.tbl != nullptr) == T_) {                               \
    kvc_wg512_kernel<F_, T_><<<grid, KVC_WG_WGS * KVC_WG_THREADS, smem, stream>>>(a);              \
    e = cudaGetLastError();                                                                        \
  }
  KVC_CASE(KVC_BF16, false) KVC_CASE(KVC_BF16, true) KVC_CASE(KVC_F16, false) KVC_CASE(KVC_F16, true)
#undef KVC_CASE
  if (e != cudaSuccess)
    return kva_seterr(KVA_ECUDA, "%s warpgroup verify kernel (D = %d, %d query vectors): %s",
                      plan.fmt == KVC_BF16   ? "bf16"
                      : plan.fmt == KVC_F16  ? "f16"
                      : plan.fmt == KVC_E4M3 ? "f8e4m3"
                      : plan.fmt == KVC_E5M2 ? "f8e5m2"
                                             : "q4",
                      a.Dk, a.rep * a.L,
                      cudaGetErrorString(e));
  return 0;
}
