/* Per-warp q4 kernel ("tcd"): bf16 queries, 4-bit MLX-affine K and V with
 * bf16 scales and biases in groups of 64 (MLX's default), Dk = Dv = D in
 * {64, 128, 256} (at 64 one group per row: kvc_tcd_so), rep * L query
 * vectors per KV head: up to 8 in one block (decode: two s8 query parts),
 * or blocks of 16 (verify, wide GQA: one s8 part, "HI" below; each block
 * reads the KV head's tiles, the blocks of one head run side by side and
 * share them in L2), causal-family masks, softcap, sinks;
 * contiguous or BLOCK_TABLE rows (paged views). The selector (context.cu)
 * sends these calls here rather than to the narrow kernel of attn_tc.cu
 * when they are large enough (B * KVH * N >= KVC_TCD_MIN_WORK token-heads:
 * below, this kernel's per-block fixed cost loses); splits are merged by the
 * same merge launch (attn_merge.cu). A rotated call (a.rot_q, a.rot_out):
 * q rotated as it is staged (kvc_stage_query), each block's combined O
 * rotated before it is written (kvc_emit_block).
 *
 * Why a second decode kernel: the narrow kernel's warps share each 64-token
 * stage (S by tokens, P.V by head dims), so every stage costs three block
 * barriers, a stage maximum through shared memory and P through shared
 * memory, ~600 of its ~1100 instructions per warp and stage (Nsight Compute).
 * Here each warp owns whole 16-token tiles (tokens, all head
 * dims, its own softmax state): no barrier in the loop, P stays in
 * registers (the S accumulator layout is the P.V B-fragment layout), and
 * the warps' states are merged once at the end of the block.
 *
 *   memory: per warp a ring of KVC_TCD_NS tiles in shared memory, filled by
 *         the warp's own cp.async (KVC_TCD_NS - 1 tiles in flight, ~16 KB at
 *         D = 256); a tile is 16 packed K rows, 16 packed V rows and their
 *         scale and bias rows (5.4 KB at D = 256). Each K/V byte is read
 *         from DRAM once for all rep * L query vectors of its KV head.
 *         Who copies what: kvc_tcd_loader (coalesced pieces over contiguous
 *         rows and one-block tiles, lane pairs per token over tables).
 *   math, S = Q K^T with query slots as mma M and tokens as N
 *         (mma.m16n8k32, s8 x u8 -> s32, exact): up to 8 vectors, a query
 *         vector v is split into two s8 parts, q ~= sigma_v (128 qh + ql);
 *         slot r < 8 of an m-tile is (vector r / GPT, group r % GPT of the
 *         m-tile's GPT groups), its qh part in row r and its ql part in row
 *         r + 8, the query bytes zero outside the slot's group. HI (9 to 16
 *         vectors, GPT = 1): one part per (vector, group), q ~= sigma_vc c
 *         (sigma_vc = max|q| of the group / 127), vector r in row r, so
 *         each lane holds two slot rows (g, g + 8) through the softmax and
 *         P.V takes two n-tiles; the S mma count is that of decode. K codes come straight
 *         from the words: k-step (group c, half h) takes word 8 c + 2 t + h
 *         of a token (lane t of a quad): w & 0x0F0F0F0F and (w >> 4) &
 *         0x0F0F0F0F. Per token and slot: x = 128 dot_h + dot_l, then
 *         score += scale * x, bias term += bias * sum_group(q) in f32; the
 *         GPT groups of an m-tile summed across lanes (shuffles), the m-tiles
 *         in the thread. K is never rounded.
 *   softmax: per warp, in log2 units (the softmax scale folded into sigma
 *         and the group sums); the running maximum moves only when a tile's
 *         maximum exceeds it by more than KVC_TCD_SLACK (then O, l and the
 *         column sums are rescaled), so P <= 2^KVC_TCD_SLACK.
 *   math, O^T += V^T P^T (mma.m16n8k16, bf16, f32 accumulators): A = V^T
 *         (head dims as M, tokens as K): lane (g, t) takes words w(g, wj)
 *         of tokens 2t, 2t+1, 2t+8, 2t+9 (kvc_tcd_word); m-tile 4 wj + i
 *         holds element 2 i of word w(g, wj) in row g and 2 i + 1 in row
 *         g + 8. One PRMT pairs two tokens' code bytes, a LOP3 under the 2^7
 *         exponent gives 128 + c, one bf16x2 FMA c - 8 (exact: centered, so
 *         the mma's f32 sums stay near the result). B = the thread's
 *         P x V scale rounded to bf16, column g = S slot (vector, group c)
 *         scaled by group c's scale (the S accumulators of tokens 2t..,
 *         2t+8.. are exactly the B fragment): with one S m-tile (GPT = G)
 *         one B for all V m-tiles, the output of row d and column (v, c)
 *         kept when d lies in group c; with G / GPT > 1 S m-tiles one B
 *         per S m-tile, and each lane's V words one per group, so that a V
 *         m-tile lies in one group and takes the B of the S m-tile holding
 *         it (GPT = 1: every column kept; 2: half). O[d] of vector v is
 *         that column plus sum(P (bias + 8 scale)) of (v, group of d), summed
 *         in f32 from the unrounded P. One rounding per token and group (P x
 *         scale), none per element, and it multiplies c - 8, about the
 *         value's size (with A = 128 + c and the correction from the rounded
 *         P x scale the bench's relative L2 error was 2-3x the narrow
 *         kernel's: the error then scaled with the codes, not the values).
 *         Tests compare at the bf16 allowance (P, V rounding 2^-9).
 *   launch: grid (1, nsplit, B * KVH), KVC_TCD_WARPS warps per block, warp w
 *         takes tiles w, w + 4, ... of the split's chunk; dynamic shared
 *         memory kvc_tcd_smem() (90,272 bytes at D = 256, 51,296 at 128,
 *         29,760 at 64); 2 blocks (8 warps) per SM at D = 256 by registers
 *         (~200) and memory, 3 at D = 128, 4 at 64 (~120 registers) (H200:
 *         3 slots and 3 blocks at D = 256, or 4 blocks at D = 128, measured
 *         no faster). */
#include "cuda/attn_fused.cuh" /* kvc_exp2, kvc_emit */
#include "cuda/launch.cuh"
#include "cuda/mma.cuh"
#include "cuda/tc_stage.cuh" /* kvc_tc_e0, kvc_tc_so: where one-group-per-row scale pieces start */

#define KVC_TCD_TOK 16     /* tokens per warp tile */
/* build-time knobs for experiments (-D...): */
#ifndef KVC_TCD_NS
#define KVC_TCD_NS 4       /* ring slots per warp: 3 tiles in flight */
#endif
#ifndef KVC_TCD_MINB
#define KVC_TCD_MINB 2     /* blocks per SM the registers are capped for (3 for the decode instances at D = 128) */
#endif
#define KVC_TCD_SLACK 8.0f /* log2 units the running max may trail a tile's max */
#define KVC_TCD_QV 16      /* query vectors per KV head, at most */
#ifndef KVC_TCD_COAL_MIN_D
/* block-table tiles inside one block: coalesced copies from this head dim
 * (slower at 128) */
#define KVC_TCD_COAL_MIN_D 256
#endif

/* Shared-memory layout (bytes) for head dim D: per warp a ring of tiles
 * {K codes, V codes, K scales, K biases, V scales, V biases}; then the
 * block's queries (bf16 [16][D]), sigma and group sums [G][16]. Row
 * strides padded so that fragment reads are free of bank conflicts (K: a
 * quad of lanes reads 32 bytes of each of 8 rows; V: 8 lanes read 16 bytes
 * of rows 2t and 2t + 8). The ring is reused for the warps' final states. */
template <int D> struct kvc_tcd_geom {
  static constexpr int G = D / KVC_TC_GROUP;      /* groups per row */
  static constexpr int SB = 2 * G;                /* bytes of a scale / bias row */
  /* K rows: 8 rows of 32 bytes per quad read; at D = 64 (32-byte rows) a
   * 48-byte stride spreads 8 rows over all banks twice (the minimum) */
  static constexpr int RSK = D == 64 ? 48 : D / 2 + 32, RSV = D / 2 + 16;
  /* bytes of one scale / bias array of a tile: 16 rows, or at one group
   * per row (D = 64) three 16-byte pieces of 8 entries (kvc_tcd_issue) */
  static constexpr int SR = G == 1 ? 48 : KVC_TCD_TOK * SB;
  static constexpr int KD = 0, VD = KVC_TCD_TOK * RSK, KS = VD + KVC_TCD_TOK * RSV;
  static constexpr int KB = KS + SR, VS = KB + SR, VB = VS + SR;
  static constexpr int STAGE = (VB + SR + 127) / 128 * 128;
  static constexpr int WARP_BYTES = KVC_TCD_NS * STAGE;
  static constexpr int QST = KVC_TCD_WARPS * WARP_BYTES; /* queries */
  static constexpr int QSIG = QST + KVC_TCD_QV * D * 2, QSUM = QSIG + G * KVC_TCD_QV * 4;
  static constexpr int TOTAL = QSUM + G * KVC_TCD_QV * 4;
  /* the final states: [warp][QV] (m, l), then [warp][QV][D] O; a rotated
   * output's combined max and sum [2][QV] after them */
  static constexpr int OST = KVC_TCD_WARPS * KVC_TCD_QV * 8;
  static constexpr int FIN = OST + KVC_TCD_WARPS * KVC_TCD_QV * D * 4;
  static_assert(FIN + 2 * KVC_TCD_QV * 4 <= QST, "final states fit the ring");
};

/* A lane's share of the tile copies, in one of two patterns (both fill the
 * same padded slot layout):
 * - coalesced: code rows as 16-byte pieces, piece p = lane + 32 k is piece
 *   p % CPR of row p / CPR, so a warp instruction covers whole rows (512
 *   contiguous bytes of contiguous rows); lane i < 16 copies the K scale
 *   and bias rows of tile token i, lane 16 + i the V ones. Contiguous rows
 *   (running pointers: a tile costs its cp.async and four pointer
 *   additions); BLOCK_TABLE tiles at D = 128 when every tile of the
 *   block lies in one block (kvc_tcd_aligned: one base per tile from the
 *   id of its first token, loaded by every lane), and at D = 256 whole
 *   tiles that lie in one block (lane 0's id).
 * - pair (the other BLOCK_TABLE tiles):
 *   lane l takes token r = l / 2, the pair (2 r, 2 r + 1) its K and V rows
 *   (lane h = l % 2 the pieces 2 j + h: a warp instruction covers 32 whole
 *   32-byte sectors), even lanes its K scale and bias rows, odd lanes the V
 *   ones; each lane locates its own token only (no shuffles).
 * Over contiguous rows the pair pattern is slower (four times the sectors
 * per instruction). The block ids (kvc_tcd_id) are
 * those of token t0 + l / 2 (aligned tiles: of t0), loaded a tile ahead;
 * lane 0's is the tile's first token's. */
struct kvc_tcd_loader {
  const char *k, *v, *s, *z; /* contiguous: this lane's first piece / scale row in the next tile */
  const char *hk, *hv, *hs, *hz; /* block tiles: the same in block 0 at row 0 (head and lane parts) */
  long long so0, so2, zo0, zo2;  /* block tiles: block and row strides of this lane's scale / bias pool */
  const int32_t *trow;       /* block tables: this sequence's table row */
  long long kp, vp;          /* bytes between this lane's pieces (rows 32 / CPR apart) */
  long long kt, vt, st, zt;  /* bytes per advance of W tiles */
  int ptok, pdst;            /* one group per row: this lane's piece's first token - t0, its slot offset */
  bool al;                   /* block tables, every tile of the block inside one block (kvc_tcd_aligned) */
};
/* Block tables whose tiles each lie in one block, at head dim 128: blocks
 * of a multiple of 16 rows, the split's first tile at a multiple of 16 rows
 * into its block ((t_lo + fo) % 16 = 0, so every tile t_lo + 16 n is), and
 * the row offsets inside a block within 32 bits (bsz * stride < 2^31 for
 * the codes, scales and biases of K and V). Then each tile costs one block
 * id (the same for the warp's lanes) and the coalesced copies of contiguous
 * rows, with 32-bit block-row products. (At 256 the per-tile test of the
 * coalesced path measured faster; at 64 the scale pieces have their own
 * copies.) */
template <int D> __device__ __forceinline__ bool kvc_tcd_aligned(const kvc_args &a, int fo, long long t_lo) {
  if (D != 128 || a.k.bsz % KVC_TCD_TOK != 0 || (t_lo + fo) % KVC_TCD_TOK != 0) return false;
  const long long lim = 1ll << 31, n = a.k.bsz;
  const long long st[6] = {a.k.ds[2], a.v.ds[2], a.k.ss[2], a.v.ss[2], a.k.bs[2], a.v.bs[2]};
  bool ok = true;
#pragma unroll
  for (int i = 0; i < 6; ++i) ok = ok && st[i] >= 0 && st[i] * n < lim;
  return ok;
}
/* One group per row (D = 64 with group 64): a scale or bias row is 2
 * bytes, below cp.async's 4, so the entries of 8 tokens are copied as one
 * aligned 16-byte piece (the selector's kvc_one_group_rows: adjacent tokens
 * 2 bytes apart; contiguous rows: the four arrays alike modulo 16 bytes;
 * block tables: blocks of a multiple of 8 tokens, 16-byte aligned block and
 * head starts, so no piece spans two blocks). Token 0 of a head sits e0
 * entries into its piece (contiguous: the address's; tables: the first
 * offset fo), a warp's tiles start 64 tokens apart, so all of them sit so =
 * (t0 + e0) % 8 entries into their first piece: a tile's 16 tokens span
 * three pieces (two when so = 0), and token r of the tile is entry r + so
 * of the slot's array. Lanes 0 .. 11 copy them: lane 3 x + p piece p of
 * array x (K scales, K biases, V scales, V biases). */
__device__ __forceinline__ int kvc_tcd_so(const kvc_args &a, int b, int hk, int fo, long long t0) {
  return (int)((t0 + kvc_tc_e0(a, b, hk, fo)) & 7); /* e0: the tensor-core kernels' rule (tc_stage.cuh) */
}
template <int D>
__device__ __forceinline__ kvc_tcd_loader kvc_tcd_loader_of(const kvc_args &a, int b, int hk, int fo, long long t0) {
  constexpr int CPR = D / 32, RPI = KVC_WARP / CPR;
  const int lane = threadIdx.x % KVC_WARP, row = lane / CPR, col = lane % CPR, ti = lane % KVC_TCD_TOK;
  const kvc_operand &K = a.k, &V = a.v, &O = lane < KVC_TCD_TOK ? a.k : a.v;
  const long long adv = (long long)KVC_TCD_WARPS * KVC_TCD_TOK;
  kvc_tcd_loader ld;
  const long long ko = row * K.ds[2] + 16 * col, vo = row * V.ds[2] + 16 * col;
  const long long so = ti * O.ss[2], zo = ti * O.bs[2];
  ld.hk = K.data + hk * K.ds[1] + ko;
  ld.hv = V.data + hk * V.ds[1] + vo;
  ld.hs = O.scales + hk * O.ss[1] + so;
  ld.hz = O.biases + hk * O.bs[1] + zo;
  ld.so0 = O.ss[0], ld.so2 = O.ss[2], ld.zo0 = O.bs[0], ld.zo2 = O.bs[2];
  ld.trow = K.tbl ? K.tbl + b * K.tbl_rs : nullptr;
  ld.k = ld.hk + b * K.ds[0] + t0 * K.ds[2];
  ld.v = ld.hv + b * V.ds[0] + t0 * V.ds[2];
  ld.s = ld.hs + b * O.ss[0] + t0 * O.ss[2];
  ld.z = ld.hz + b * O.bs[0] + t0 * O.bs[2];
  ld.kp = RPI * K.ds[2];
  ld.vp = RPI * V.ds[2];
  ld.kt = adv * K.ds[2];
  ld.vt = adv * V.ds[2];
  ld.st = adv * O.ss[2];
  ld.zt = adv * O.bs[2];
  ld.ptok = 0, ld.pdst = 0;
  ld.al = ld.trow && kvc_tcd_aligned<D>(a, fo, t0);
  if constexpr (D / KVC_TC_GROUP == 1) {
    using Gm = kvc_tcd_geom<D>;
    const int x = lane / 3, p = lane % 3, so = kvc_tcd_so(a, b, hk, fo, t0);
    const kvc_operand &X = x < 2 ? K : V;
    const char *base = x % 2 ? X.biases : X.scales;
    const long long *xs = x % 2 ? X.bs : X.ss;
    ld.ptok = 8 * p - so;
    ld.pdst = (x == 0 ? Gm::KS : x == 1 ? Gm::KB : x == 2 ? Gm::VS : Gm::VB) + 16 * p;
    ld.s = base + b * xs[0] + hk * xs[1] + (t0 + ld.ptok) * 2; /* xs[2] == 2; tables: set per tile */
    ld.st = adv * 2;
  }
  return ld;
}

/* Copies tile rows t0 .. t0 + 15 (zeros past t_hi) into the warp's ring
 * slot at shared address slot; id: the block id of token t0 + lane / 2
 * (BLOCK_TABLE). A whole tile (all but a split's last) skips the per-row
 * test. */
template <int D, bool TBL>
__device__ __forceinline__ void kvc_tcd_issue(const kvc_args &a, kvc_tcd_loader &ld, uint32_t slot, long long t0,
                                              long long t_hi, int hk, int fo, int id) {
  using Gm = kvc_tcd_geom<D>;
  constexpr int CPR = D / 32, RPI = KVC_WARP / CPR;
  const int lane = threadIdx.x % KVC_WARP, col = lane % CPR, ti = lane % KVC_TCD_TOK;
  const kvc_operand &K = a.k, &V = a.v;
  const bool whole = t0 + KVC_TCD_TOK <= t_hi;
  const char *kb = ld.k, *vb = ld.v, *sb = ld.s, *zb = ld.z;
  bool coal = true;
  if constexpr (TBL) {
    const long long r0 = t0 + fo, c0 = kvc_table_col(r0, K.bsz, K.bsh);
    if (ld.al) { /* the tile's rows: rb .. rb + 15 of block id (the lanes' common id) */
      const unsigned outer = (unsigned)(id < 0 ? 0 : id >= K.nblk ? K.nblk - 1 : id);
      const int rb = (int)(r0 - c0 * K.bsz);
      kb = ld.hk + outer * (unsigned long long)K.ds[0] + rb * (int)K.ds[2];
      vb = ld.hv + outer * (unsigned long long)V.ds[0] + rb * (int)V.ds[2];
      sb = ld.hs + outer * (unsigned long long)ld.so0 + rb * (int)ld.so2;
      zb = ld.hz + outer * (unsigned long long)ld.zo0 + rb * (int)ld.zo2;
    }
    coal = ld.al || (D >= KVC_TCD_COAL_MIN_D && whole && kvc_table_col(r0 + KVC_TCD_TOK - 1, K.bsz, K.bsh) == c0);
    if (coal && !ld.al) { /* the tile lies in one block: its rows are consecutive; the
                 * head and lane parts of the addresses were added once (the
                 * loader), each array adds block and row offsets (64-bit
                 * products: 32-bit ones, pools permitting, measured 1.5 %
                 * slower, BENCHMARKS.md) */
      const kvc_loc l = kvc_loc_of(__shfl_sync(KVC_FULL_MASK, id, 0), r0, c0, K.bsz, K.nblk);
      kb = ld.hk + l.outer * K.ds[0] + l.row * K.ds[2];
      vb = ld.hv + l.outer * V.ds[0] + l.row * V.ds[2];
      sb = ld.hs + l.outer * ld.so0 + l.row * ld.so2;
      zb = ld.hz + l.outer * ld.zo0 + l.row * ld.zo2;
    }
  }
  if (coal) {
    const kvc_operand &O = lane < KVC_TCD_TOK ? K : V;
    const uint32_t so = slot + (lane < KVC_TCD_TOK ? Gm::KS : Gm::VS) + ti * Gm::SB;
    const uint32_t zo = slot + (lane < KVC_TCD_TOK ? Gm::KB : Gm::VB) + ti * Gm::SB;
    if (whole) {
#pragma unroll
      for (int k = 0; k < KVC_TCD_TOK / RPI; ++k) {
        const int row = lane / CPR + k * RPI;
        kvc_cp_async<16>(slot + Gm::KD + row * Gm::RSK + 16 * col, kb + k * ld.kp, 16);
        kvc_cp_async<16>(slot + Gm::VD + row * Gm::RSV + 16 * col, vb + k * ld.vp, 16);
      }
      if constexpr (Gm::G > 1) {
        kvc_cp_async<Gm::SB>(so, sb, Gm::SB);
        kvc_cp_async<Gm::SB>(zo, zb, Gm::SB);
      }
    } else { /* contiguous rows, or an aligned block tile (a partial unaligned one takes the pair pattern) */
#pragma unroll
      for (int k = 0; k < KVC_TCD_TOK / RPI; ++k) {
        const int row = lane / CPR + k * RPI;
        const bool ok = t0 + row < t_hi;
        kvc_cp_async<16>(slot + Gm::KD + row * Gm::RSK + 16 * col, ok ? kb + k * ld.kp : K.data, ok ? 16 : 0);
        kvc_cp_async<16>(slot + Gm::VD + row * Gm::RSV + 16 * col, ok ? vb + k * ld.vp : V.data, ok ? 16 : 0);
      }
      if constexpr (Gm::G > 1) {
        const bool ok = t0 + ti < t_hi;
        kvc_cp_async<Gm::SB>(so, ok ? sb : O.scales, ok ? Gm::SB : 0);
        kvc_cp_async<Gm::SB>(zo, ok ? zb : O.biases, ok ? Gm::SB : 0);
      }
    }
  }
  if constexpr (Gm::G == 1) { /* the 8-entry pieces (kvc_tcd_so) */
    const long long tp = t0 + ld.ptok, nv = t_hi - tp; /* the piece's first token; its entries before t_hi */
    const char *src = ld.s;
    if constexpr (TBL) { /* the piece's block: that of its first token in the tile (lane 2 off's id) */
      const int off = ld.ptok > 0 ? ld.ptok : 0;
      const int pid = __shfl_sync(KVC_FULL_MASK, id, 2 * off); /* off < 16 */
      const int x = lane / 3;
      const kvc_operand &X = x < 2 ? K : V;
      const long long r = tp + fo; /* >= 0: so <= t0 + fo */
      const kvc_loc l = kvc_loc_of(pid, r, kvc_table_col(r, K.bsz, K.bsh), K.bsz, K.nblk);
      src = x % 2 ? X.biases + l.outer * X.bs[0] + hk * X.bs[1] + l.row * 2
                  : X.scales + l.outer * X.ss[0] + hk * X.ss[1] + l.row * 2;
    }
    if (lane < 12 && ld.ptok < KVC_TCD_TOK) {
      if (nv <= 0 || nv >= 8) {
        kvc_cp_async<16>(slot + ld.pdst, nv > 0 ? src : K.scales, nv > 0 ? 16 : 0);
      } else { /* the piece that t_hi cuts (one per split): no read past t_hi, maybe the array's end */
        const unsigned short *s16 = (const unsigned short *)src;
#pragma unroll
        for (int e = 0; e < 8; ++e) kvc_sts16(slot + ld.pdst + 2 * e, e < nv ? __ldg(s16 + e) : (unsigned short)0);
      }
    }
  }
  if constexpr (!TBL) {
    ld.k += ld.kt;
    ld.v += ld.vt;
    ld.s += ld.st;
    ld.z += ld.zt;
  } else if (!coal) { /* the pair pattern: this lane's token r */
    constexpr int PH = D / 64; /* pieces per lane and row (a row: 2 PH pieces) */
    const int r = lane / 2, h = lane % 2;
    const kvc_operand &O = h ? V : K;
    const kvc_loc l = kvc_table_loc_id(K, fo, id, t0 + r);
    const char *kr = K.data + l.outer * K.ds[0] + hk * K.ds[1] + l.row * K.ds[2] + 16 * h;
    const char *vr = V.data + l.outer * V.ds[0] + hk * V.ds[1] + l.row * V.ds[2] + 16 * h;
    const char *sr = O.scales + l.outer * O.ss[0] + hk * O.ss[1] + l.row * O.ss[2];
    const char *zr = O.biases + l.outer * O.bs[0] + hk * O.bs[1] + l.row * O.bs[2];
    const uint32_t kd = slot + Gm::KD + r * Gm::RSK + 16 * h, vd = slot + Gm::VD + r * Gm::RSV + 16 * h;
    const uint32_t so = slot + (h ? Gm::VS : Gm::KS) + r * Gm::SB, zo = slot + (h ? Gm::VB : Gm::KB) + r * Gm::SB;
    const bool ok = t0 + r < t_hi;
#pragma unroll
    for (int j = 0; j < PH; ++j) {
      kvc_cp_async<16>(kd + 32 * j, ok ? kr + 32 * j : K.data, ok ? 16 : 0);
      kvc_cp_async<16>(vd + 32 * j, ok ? vr + 32 * j : V.data, ok ? 16 : 0);
    }
    if constexpr (Gm::G > 1) {
      kvc_cp_async<Gm::SB>(so, ok ? sr : O.scales, ok ? Gm::SB : 0);
      kvc_cp_async<Gm::SB>(zo, ok ? zr : O.biases, ok ? Gm::SB : 0);
    }
  }
}

/* The block id of token t0 + lane / 2, or of t0 in every lane with aligned
 * tiles (0 when contiguous or past t_hi). */
__device__ __forceinline__ int kvc_tcd_id(const kvc_args &a, const kvc_tcd_loader &ld, int fo, long long t0,
                                          long long t_hi) {
  const long long t = t0 + (ld.al ? 0 : (threadIdx.x % KVC_WARP) / 2);
  return ld.trow && t < t_hi ? __ldg(ld.trow + kvc_table_col(t + fo, a.k.bsz, a.k.bsh)) : 0;
}

/* Word of a packed V row whose 8 codes lane row g takes as its wj-th word
 * (wj < D / 64): SPREAD, word 8 wj + g (group wj: every V m-tile of a word
 * lies in one group, so it can take the B of the S m-tile holding that
 * group); else words D / 64 g .. (contiguous: one 16- or 8-byte load per
 * token, the m-tiles' rows in different groups). Both are free of bank
 * conflicts with the padded rows (8 consecutive words per quad, rows 2 t4
 * apart shift the banks by 8 t4). */
template <int D, bool SPREAD> __device__ __forceinline__ int kvc_tcd_word(int g, int wj) {
  return SPREAD ? 8 * wj + g : (D / 64) * g + wj;
}

/* out[mt] = the bf16 value of group mt GPT + gi in a scale or bias row of G
 * values (MTK = G / GPT of them; GPT = 1: the whole row in one load). The
 * rows are 8-byte aligned (kvc_tcd_geom: SB-byte rows from 128-aligned
 * slots and 16-multiple offsets). */
template <int G, int GPT>
__device__ __forceinline__ void kvc_tcd_row(const unsigned char *row, int gi, float (&out)[G / GPT]) {
  if constexpr (GPT == 1 && G == 4) {
    const uint2 u = *(const uint2 *)row;
    out[0] = __uint_as_float(u.x << 16), out[1] = __uint_as_float(u.x & 0xffff0000u);
    out[2] = __uint_as_float(u.y << 16), out[3] = __uint_as_float(u.y & 0xffff0000u);
  } else if constexpr (GPT == 1 && G == 2) {
    const uint32_t u = *(const uint32_t *)row;
    out[0] = __uint_as_float(u << 16), out[1] = __uint_as_float(u & 0xffff0000u);
  } else {
#pragma unroll
    for (int mt = 0; mt < G / GPT; ++mt) out[mt] = kvc_bf16_bits(kvc_lds16(row + 2 * (mt * GPT + gi)));
  }
}

/* GPT: groups per S m-tile (kvc_tcd_gpt), V scales folded into P in every
 * case (see the header). HI: the mma rows g + 8 hold query vectors 8 .. 15
 * (one s8 query part, "q int8": up to 16 vectors, GPT = 1) instead of the
 * low parts of vectors 0 .. 7 ("q int15"). TBL: BLOCK_TABLE rows (an
 * instance each: one copy of the loop per kernel; the two copies in one
 * kernel measured 4-17 % slower at D = 256, H200). */
template <int D, int GPT, bool HI, bool TBL> __device__ __forceinline__ void kvc_tcd_body(const kvc_args &a) {
  using Gm = kvc_tcd_geom<D>;
  constexpr int G = Gm::G, MTK = G / GPT, KSTEPS = D / 32, MTV = D / 16, WV = D / 64;
  constexpr int R = HI ? 2 : 1; /* S rows per lane holding query slots: g (and g + 8) */
  static_assert(!HI || GPT == 1, "16 query vectors: one group per S m-tile");
  constexpr bool SPREAD = MTK > 1; /* V words of a lane one per group (see kvc_tcd_word) */
  constexpr int NS = KVC_TCD_NS, W = KVC_TCD_WARPS, QV = KVC_TCD_QV;
  extern __shared__ __align__(128) unsigned char kvc_tcd_buf[];
  const int lane = threadIdx.x % KVC_WARP, warp = threadIdx.x / KVC_WARP;
  const int g = lane >> 2, t4 = lane & 3;
  const int split = blockIdx.y, b = blockIdx.z / a.KVH, hk = blockIdx.z % a.KVH;
  const long long len = kvc_seq_len(a, b);
  const int fo = kvc_first_offset(a.k, b);
  /* this block's query vectors v0 .. v0 + Q - 1 of the KV head's rep L (HI:
   * chunks of 16, blockIdx.x; else all, at most 8 / GPT: the selector) */
  const int v0 = blockIdx.x * QV, Qall = a.rep * a.L, Q = HI && Qall - v0 > QV ? QV : Qall - v0;

  long long t_lo, t_hi;
  kvc_split_range(a, split, len, v0, Q, &t_lo, &t_hi);
  /* one group per row: token r of each of this warp's tiles is entry r + so of the slot's scale arrays */
  const int so = G == 1 ? kvc_tcd_so(a, b, hk, fo, t_lo + (long long)warp * KVC_TCD_TOK) : 0;
  const int ntiles = t_hi > t_lo ? (int)((t_hi - t_lo + KVC_TCD_TOK - 1) / KVC_TCD_TOK) : 0;
  const int nmine = ntiles > warp ? (ntiles - warp + W - 1) / W : 0; /* tiles warp + W n */
  const uint32_t ring = (uint32_t)__cvta_generic_to_shared(kvc_tcd_buf) + warp * Gm::WARP_BYTES;
  const unsigned char *wbuf = kvc_tcd_buf + warp * Gm::WARP_BYTES;
#define KVC_TCD_T0(n) (t_lo + (long long)(warp + W * (n)) * KVC_TCD_TOK)

  /* prologue: the first NS - 1 tiles in flight (one commit group each); the
   * block ids of each tile loaded before its copies, the next one's ahead */
  int nid = 0;
  kvc_tcd_loader ld = kvc_tcd_loader_of<D>(a, b, hk, fo, KVC_TCD_T0(0));
#pragma unroll
  for (int n = 0; n < NS - 1; ++n) {
    const int id = TBL && n < nmine ? kvc_tcd_id(a, ld, fo, KVC_TCD_T0(n), t_hi) : 0;
    if (n < nmine) kvc_tcd_issue<D, TBL>(a, ld, ring + n * Gm::STAGE, KVC_TCD_T0(n), t_hi, hk, fo, id);
    kvc_cp_commit();
  }
  if (TBL && NS - 1 < nmine) nid = kvc_tcd_id(a, ld, fo, KVC_TCD_T0(NS - 1), t_hi);

  /* logits in log2 units: x = scl2 q.k, a softcap c as (c log2 e) tanh(x / (c log2 e)) */
  const float scl2 = a.scale * KVC_LOG2E, cap2 = a.softcap * KVC_LOG2E, cap2_inv = a.softcap_inv * (1.0f / KVC_LOG2E);
  const bool capped = a.softcap > 0.0f;

  /* Queries: staged as bf16 (TPQ threads per vector, D / TPQ dims each);
   * sigma per vector and group, qsig[c QV + v]: HI, max|q| of the group /
   * 127 (one s8 part); else max|q| of the vector / (127 * 128) (two parts),
   * the same for every group; the per-group sums (times scl2) by shuffles. */
  unsigned short *qst = (unsigned short *)(kvc_tcd_buf + Gm::QST);
  float *qsig = (float *)(kvc_tcd_buf + Gm::QSIG), *qsum = (float *)(kvc_tcd_buf + Gm::QSUM);
  {
    constexpr int NQ = HI ? 16 : 8, TPQ = KVC_TCD_THREADS / NQ, DPT = D / TPQ, TPG = KVC_TC_GROUP / DPT;
    const int j = threadIdx.x / TPQ, pd = (threadIdx.x % TPQ) * DPT;
    float amax, sum;
    kvc_stage_query<DPT, HI ? TPG : TPQ, TPQ>(a, b, hk, v0 + j, Qall, pd, TPG, qst + j * D, &amax, &sum);
    const float sg = HI ? kvc_query_sigma8(amax) : kvc_query_sigma(amax);
    if constexpr (HI) { /* the bias term takes the rounded query's sum, sigma sum(c) (exact: |sum c| < 2^24),
                         * so that S is q'.k of the rounded q' (a NaN / Inf sum stays as it is) */
      const float inv = 1.0f / sg;
      int cs = 0;
#pragma unroll
      for (int d = 0; d < DPT; ++d) {
        const float c = rintf(kvc_bf16_bits(qst[j * D + pd + d]) * inv);
        cs += (c == c) ? (int)fminf(fmaxf(c, -127.0f), 127.0f) : 0;
      }
#pragma unroll
      for (int off = 1; off < TPG; off <<= 1) cs += __shfl_xor_sync(KVC_FULL_MASK, cs, off);
      if (isfinite(sum)) sum = sg * (float)cs;
    }
    if (pd % KVC_TC_GROUP == 0) {
      qsum[(pd / KVC_TC_GROUP) * QV + j] = sum * scl2;
      qsig[(pd / KVC_TC_GROUP) * QV + j] = sg;
    }
  }
  __syncthreads();

  /* This lane's slots g (and g + 8 with HI): vector vq[r], group gi of each
   * m-tile. Query A fragments of k-step kj = 2 c + h (group c, word 8 c + 2
   * t4 + h): a0/a2 the bytes of the word's even / odd dims for row g, a1/a3
   * for row g + 8 (HI: vector vq[1]; else the low part of vector vq[0]);
   * zero unless c % GPT == gi. */
  const int gi = g % GPT;
  int vq[R];
  bool vok[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    vq[r] = (g + 8 * r) / GPT;
    vok[r] = vq[r] < Q;
  }
  uint32_t qa[KSTEPS][4];
#pragma unroll
  for (int kj = 0; kj < KSTEPS; ++kj) {
    qa[kj][0] = qa[kj][1] = qa[kj][2] = qa[kj][3] = 0u;
    if ((kj / 2) % GPT != gi) continue;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (!vok[r]) continue;
      const float inv = 1.0f / qsig[(kj / 2) * QV + vq[r]];
      const unsigned short *qp = qst + vq[r] * D + 8 * (8 * (kj / 2) + 2 * t4 + (kj & 1));
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int odd = 0; odd < 2; ++odd) {
          const float y = kvc_bf16_bits(qp[2 * i + odd]) * inv;
          if constexpr (HI) {
            const float c = rintf(y);
            const int ic = (c == c) ? (int)fminf(fmaxf(c, -127.0f), 127.0f) : 0;
            qa[kj][2 * odd + r] |= (uint32_t)(ic & 0xff) << (8 * i);
          } else {
            const float qh = rintf(y * (1.0f / 128.0f));
            const float ql = rintf(y - 128.0f * qh);
            const int ih = (qh == qh) ? (int)fminf(fmaxf(qh, -127.0f), 127.0f) : 0;
            const int il = (ql == ql) ? (int)fminf(fmaxf(ql, -127.0f), 127.0f) : 0;
            qa[kj][2 * odd] |= (uint32_t)(ih & 0xff) << (8 * i);
            qa[kj][2 * odd + 1] |= (uint32_t)(il & 0xff) << (8 * i);
          }
        }
    }
  }
  float sig[R][MTK], qs[R][MTK]; /* sigma scl2 and the group sums of slot (r, m-tile) */
  long long pos[R];
  int32_t segp[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int mt = 0; mt < MTK; ++mt) {
      sig[r][mt] = vok[r] ? qsig[(mt * GPT + gi) * QV + vq[r]] * scl2 : 0.0f;
      qs[r][mt] = vok[r] ? qsum[(mt * GPT + gi) * QV + vq[r]] : 0.0f;
    }
    pos[r] = len - a.L + (vok[r] ? (v0 + vq[r]) % a.L : 0);
    segp[r] = vok[r] ? kvc_seg_of_row(a, b, pos[r]) : 0;
  }
  float o[MTV][R][4];
#pragma unroll
  for (int j = 0; j < MTV; ++j)
#pragma unroll
    for (int r = 0; r < R; ++r) o[j][r][0] = o[j][r][1] = o[j][r][2] = o[j][r][3] = 0.0f;
  /* cs[r][mt]: sum(P (bias + 8 scale)) of slot (r, S m-tile mt) */
  float m[R], l[R], cs[R][MTK];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY, l[r] = 0.0f;
#pragma unroll
    for (int mt = 0; mt < MTK; ++mt) cs[r][mt] = 0.0f;
  }

  for (int n = 0; n < nmine; ++n) {
    kvc_cp_wait<NS - 2>(); /* this lane's copies of tile n landed */
    __syncwarp();          /* the warp's; and slot (n - 1) % NS is read */
    {
      const int nn = n + NS - 1;
      if (nn < nmine) {
        kvc_tcd_issue<D, TBL>(a, ld, ring + (nn % NS) * Gm::STAGE, KVC_TCD_T0(nn), t_hi, hk, fo, nid);
        if (TBL) nid = nn + 1 < nmine ? kvc_tcd_id(a, ld, fo, KVC_TCD_T0(nn + 1), t_hi) : 0;
      }
      kvc_cp_commit();
    }
    const unsigned char *st = wbuf + (n % NS) * Gm::STAGE;
    const long long t0 = KVC_TCD_T0(n);

    /* ---- S: tokens 8 nt + g as mma columns ---- */
    /* one m-tile: the two k-steps of a group into two accumulators (chains
     * of G mma instead of 2 G), summed after */
    constexpr int CH = MTK == 1 ? 2 : 1;
    int acc[MTK][2][4], acc2[CH][2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int mt = 0; mt < MTK; ++mt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0;
#pragma unroll
      for (int i = 0; i < CH; ++i) acc2[i][nt][0] = acc2[i][nt][1] = acc2[i][nt][2] = acc2[i][nt][3] = 0;
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint32_t *kr = (const uint32_t *)(st + Gm::KD + (8 * nt + g) * Gm::RSK) + 2 * t4;
#pragma unroll
      for (int c = 0; c < G; ++c) {
        const uint2 w = *(const uint2 *)(kr + 8 * c);
        kvc_mma_s8u8(acc[c / GPT][nt], qa[2 * c], w.x & KVC_NIBBLES, (w.x >> 4) & KVC_NIBBLES);
        kvc_mma_s8u8(CH == 2 ? acc2[0][nt] : acc[c / GPT][nt], qa[2 * c + 1], w.y & KVC_NIBBLES,
                     (w.y >> 4) & KVC_NIBBLES);
      }
      if (CH == 2)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][nt][e] += acc2[0][nt][e];
    }
    /* sc[r][e]: slot row r, tokens 2 t4 + (e & 1) + 8 (e >> 1) (the B layout of P.V) */
    float sc[R][4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int nt = e >> 1, x = e & 1, tok = 8 * nt + 2 * t4 + x;
      float ks[MTK], kz[MTK];
      kvc_tcd_row<G, GPT>(st + Gm::KS + (tok + so) * Gm::SB, gi, ks);
      kvc_tcd_row<G, GPT>(st + Gm::KB + (tok + so) * Gm::SB, gi, kz);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float ss = 0.0f, sz = 0.0f;
#pragma unroll
        for (int mt = 0; mt < MTK; ++mt) {
          if constexpr (HI) /* per-group sigma: x_c sigma_c scale_c */
            ss = fmaf(ks[mt] * sig[r][mt], (float)acc[mt][nt][2 * r + x], ss);
          else
            ss = fmaf(ks[mt], (float)(128 * acc[mt][nt][x] + acc[mt][nt][2 + x]), ss);
          sz = fmaf(kz[mt], qs[r][mt], sz);
        }
        sc[r][e] = HI ? ss + sz : fmaf(ss, sig[r][0], sz);
#pragma unroll
        for (int off = 4; off < 4 * GPT; off <<= 1) sc[r][e] += __shfl_xor_sync(KVC_FULL_MASK, sc[r][e], off);
      }
    }

    /* ---- softmax (log2 units), per slot row ---- */
    /* one uniform branch each for the softcap and the per-key mask test
     * (not one per element) */
    bool vis[R][4];
    float tmax[R];
    if (capped)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[r][e] = cap2 * tanhf(sc[r][e] * cap2_inv);
    if (kvc_keys_all_visible(a, t0, KVC_TCD_TOK, t_hi, len)) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int e = 0; e < 4; ++e) vis[r][e] = vok[r];
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const long long t = t0 + 8 * (e >> 1) + 2 * t4 + (e & 1);
          bool v = vok[r] && t < t_hi;
          if (v && kvc_causal_family(a)) v = kvc_causal_visible(a, b, t, pos[r], segp[r], len);
          vis[r][e] = v;
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      tmax[r] = -INFINITY;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool v = vis[r][e];
        const float xl = v ? sc[r][e] : -INFINITY;
        vis[r][e] = v && xl != -INFINITY;
        sc[r][e] = xl;
        tmax[r] = kvc_max(tmax[r], xl);
      }
      tmax[r] = kvc_max(tmax[r], __shfl_xor_sync(KVC_FULL_MASK, tmax[r], 1));
      tmax[r] = kvc_max(tmax[r], __shfl_xor_sync(KVC_FULL_MASK, tmax[r], 2));
    }
    bool moved = false;
#pragma unroll
    for (int r = 0; r < R; ++r) moved = moved || !(tmax[r] <= m[r] + KVC_TCD_SLACK);
    if (__any_sync(KVC_FULL_MASK, moved)) { /* a max moved (or is NaN): rescale */
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float mn = kvc_max(m[r], tmax[r]);
        const float corr = mn == m[r] ? 1.0f : kvc_exp2(m[r] - mn); /* 0 when m = -inf */
        m[r] = mn;
        l[r] *= corr;
#pragma unroll
        for (int mt = 0; mt < MTK; ++mt) cs[r][mt] *= corr;
        /* O columns 2 t4, 2 t4 + 1 of n-tile r belong to the slots (lanes 4 col) of those columns */
        const float c0 = __shfl_sync(KVC_FULL_MASK, corr, 8 * t4), c1 = __shfl_sync(KVC_FULL_MASK, corr, 8 * t4 + 4);
#pragma unroll
        for (int j = 0; j < MTV; ++j) {
          o[j][r][0] *= c0;
          o[j][r][1] *= c1;
          o[j][r][2] *= c0;
          o[j][r][3] *= c1;
        }
      }
    }
    float p[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p[r][e] = vis[r][e] ? kvc_exp2(sc[r][e] - m[r]) : 0.0f;
        l[r] += p[r][e];
      }

    /* ---- P times the V scale as the B fragment of column g (tokens 2 t4, + 1 | + 8, + 9) of
     * n-tile r, one per S m-tile: B[r][mt] feeds the V m-tiles of the groups of S m-tile mt ---- */
    uint32_t pb0[R][MTK], pb1[R][MTK];
    {
      /* bf16(P scale) feeds the mma with A = c - 8; the 8 scale + bias
       * part is summed here in f32 from the unrounded P: the rounding of
       * P scale then only scales c - 8 (about the value's size, as for a
       * rounded V) */
      float rr[R][MTK][4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = 8 * (e >> 1) + 2 * t4 + (e & 1);
        float sv[MTK], z[MTK];
        kvc_tcd_row<G, GPT>(st + Gm::VS + (tok + so) * Gm::SB, gi, sv);
        kvc_tcd_row<G, GPT>(st + Gm::VB + (tok + so) * Gm::SB, gi, z);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int mt = 0; mt < MTK; ++mt) {
            rr[r][mt][e] = vis[r][e] ? p[r][e] * sv[mt] : 0.0f;
            if (vis[r][e]) cs[r][mt] = fmaf(p[r][e], fmaf(8.0f, sv[mt], z[mt]), cs[r][mt]);
          }
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int mt = 0; mt < MTK; ++mt) {
          pb0[r][mt] = kvc_bf16x2_of(rr[r][mt][0], rr[r][mt][1]);
          pb1[r][mt] = kvc_bf16x2_of(rr[r][mt][2], rr[r][mt][3]);
        }
    }

    /* ---- O^T += V^T P^T: m-tile j = 4 wj + (j % 4): element 2 (j % 4) of word w(g, wj) (row g), + 1
     * (row g + 8); n-tile r: the slots of S row r ---- */
    uint32_t wa[WV], wb[WV], wc[WV], wd[WV]; /* words w(g, 0 ..) of tokens 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9 */
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int tok = 2 * t4 + (x & 1) + 8 * (x >> 1);
      uint32_t *dst = x == 0 ? wa : x == 1 ? wb : x == 2 ? wc : wd;
      const unsigned char *vr = st + Gm::VD + tok * Gm::RSV;
      if constexpr (SPREAD) { /* word 8 wj + g: group wj */
#pragma unroll
        for (int wj = 0; wj < WV; ++wj) dst[wj] = *(const uint32_t *)(vr + 4 * kvc_tcd_word<D, SPREAD>(g, wj));
      } else if constexpr (WV == 4) { /* words 4 g ..: one 16-byte load */
        const uint4 u = *(const uint4 *)(vr + 4 * kvc_tcd_word<D, SPREAD>(g, 0));
        dst[0] = u.x, dst[1] = u.y, dst[2] = u.z, dst[3] = u.w;
      } else if constexpr (WV == 2) {
        const uint2 u = *(const uint2 *)(vr + 4 * kvc_tcd_word<D, SPREAD>(g, 0));
        dst[0] = u.x, dst[1] = u.y;
      } else { /* D = 64: word g */
        dst[0] = *(const uint32_t *)(vr + 4 * kvc_tcd_word<D, SPREAD>(g, 0));
      }
    }
#pragma unroll
    for (int wj = 0; wj < WV; ++wj) {
      const int mb = SPREAD ? wj / GPT : 0; /* the B of this word's group */
#pragma unroll
      for (int hb = 0; hb < 2; ++hb) {
        const uint32_t sel = hb ? 0x7632u : 0x5410u; /* bytes 2 hb, 2 hb + 1 of both tokens */
        const uint32_t y01 = __byte_perm(wa[wj], wb[wj], sel), y89 = __byte_perm(wc[wj], wd[wj], sel);
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
          const int j = 4 * wj + 2 * hb + bb, sh = 8 * bb;
          uint32_t af[4] = {kvc_and_or(y01 >> sh, KVC_NIB_PAIR, KVC_BF16X2_128),
                            kvc_and_or(y01 >> (sh + 4), KVC_NIB_PAIR, KVC_BF16X2_128),
                            kvc_and_or(y89 >> sh, KVC_NIB_PAIR, KVC_BF16X2_128),
                            kvc_and_or(y89 >> (sh + 4), KVC_NIB_PAIR, KVC_BF16X2_128)};
          /* c - 8, exact: centered, so the f32 sums in the mma stay near the result */
#pragma unroll
          for (int i = 0; i < 4; ++i) af[i] = kvc_fma_bf16x2(af[i], KVC_BF16X2_ONE, KVC_BF16X2_M136);
#pragma unroll
          for (int r = 0; r < R; ++r) kvc_mma_bf16(o[j][r], af, pb0[r][mb], pb1[r][mb]);
        }
      }
    }
  }
#undef KVC_TCD_T0
  kvc_cp_wait<0>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion(); /* the merge waits for this grid's completion */
#endif

  /* ---- the warps' states -> shared memory -> one state per vector ---- */
  float csc[R][MTK][2]; /* cs of columns 2 t4, 2 t4 + 1 of n-tile r */
#pragma unroll
  for (int r = 0; r < R; ++r) {
    l[r] += __shfl_xor_sync(KVC_FULL_MASK, l[r], 1);
    l[r] += __shfl_xor_sync(KVC_FULL_MASK, l[r], 2);
#pragma unroll
    for (int mt = 0; mt < MTK; ++mt) {
      cs[r][mt] += __shfl_xor_sync(KVC_FULL_MASK, cs[r][mt], 1);
      cs[r][mt] += __shfl_xor_sync(KVC_FULL_MASK, cs[r][mt], 2);
      csc[r][mt][0] = __shfl_sync(KVC_FULL_MASK, cs[r][mt], 8 * t4);
      csc[r][mt][1] = __shfl_sync(KVC_FULL_MASK, cs[r][mt], 8 * t4 + 4);
    }
  }
  __syncthreads(); /* every warp is done with its ring */
  float *ml = (float *)kvc_tcd_buf, *ost = (float *)(kvc_tcd_buf + Gm::OST), *fin = (float *)(kvc_tcd_buf + Gm::FIN);
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (t4 == 0 && gi == 0 && vok[r]) {
      ml[(warp * QV + vq[r]) * 2] = m[r];
      ml[(warp * QV + vq[r]) * 2 + 1] = l[r];
    }
#pragma unroll
  for (int j = 0; j < MTV; ++j)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 2 * t4 + (e & 1), d = 8 * kvc_tcd_word<D, SPREAD>(g, j / 4) + 2 * (j % 4) + (e >> 1);
        const int slot = 8 * r + col, v = slot / GPT, gd = d / KVC_TC_GROUP; /* slot: vector v, group mt GPT + slot % GPT */
        if (slot % GPT == gd % GPT && v < Q) ost[(warp * QV + v) * D + d] = o[j][r][e] + csc[r][gd / GPT][e & 1];
      }
  __syncthreads();
  /* one state per vector: M, Ls and O of dim d over the warps (fixed order) */
  auto combine = [&](int v, int d, float &M, float &Ls, float &O) {
    M = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w) M = kvc_max(M, ml[(w * QV + v) * 2]);
    Ls = 0.0f, O = 0.0f;
    if (M != -INFINITY)
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float f = kvc_exp2(ml[(w * QV + v) * 2] - M); /* 0 for a warp without keys */
        Ls = fmaf(ml[(w * QV + v) * 2 + 1], f, Ls);
        O = fmaf(ost[(w * QV + v) * D + d], f, O);
      }
  };
  if (a.rot_out) { /* the combined rows into warp 0's slots (a thread alone reads its (v, d) there), rotated */
    for (int idx = threadIdx.x; idx < Q * D; idx += KVC_TCD_THREADS) {
      const int v = idx / D, d = idx % D;
      float M, Ls, O;
      combine(v, d, M, Ls, O);
      ost[v * D + d] = O;
      if (d == 0) {
        fin[v] = M;
        fin[QV + v] = Ls;
      }
    }
    __syncthreads();
    kvc_emit_block<D>(a, split, b, hk, v0, Q, D, D, ost, fin, fin + QV, KVC_TCD_THREADS);
    return;
  }
  for (int idx = threadIdx.x; idx < Q * D; idx += KVC_TCD_THREADS) {
    const int v = idx / D, d = idx % D;
    float M, Ls, O;
    combine(v, d, M, Ls, O);
    kvc_emit(a, split, b, hk, v0 + v, d, M, Ls, O);
  }
}

template <int D, int GPT, bool HI, bool TBL>
__global__ void __launch_bounds__(KVC_TCD_THREADS, D == 128 && !HI ? 3 : KVC_TCD_MINB) kvc_tcd_kernel(const kvc_args a) {
  kvc_tcd_body<D, GPT, HI, TBL>(a);
}

/* ---- host side ---- */
/* (D, groups per S m-tile, 16 query vectors, BLOCK_TABLE rows) */
#define KVC_TCD_INSTANCES(X)                                                                                \
  X(256, 4, false, false) X(256, 2, false, false) X(256, 1, false, false) X(256, 1, true, false)              \
  X(256, 4, false, true) X(256, 2, false, true) X(256, 1, false, true) X(256, 1, true, true)                  \
  X(128, 2, false, false) X(128, 1, false, false) X(128, 1, true, false) X(128, 2, false, true)               \
  X(128, 1, false, true) X(128, 1, true, true) X(64, 1, false, false) X(64, 1, true, false)                   \
  X(64, 1, false, true) X(64, 1, true, true)

int kvc_tcd_smem(int D) {
  return D == 256 ? kvc_tcd_geom<256>::TOTAL : D == 128 ? kvc_tcd_geom<128>::TOTAL : kvc_tcd_geom<64>::TOTAL;
}

/* Groups per S m-tile for q <= 16 query vectors per KV head at head dim D:
 * up to 8 vectors (two query parts, the slots in rows g), all G while q G
 * <= 8 (one S m-tile, one B for P.V), else G / 2 while q G <= 16, else 1
 * (G m-tiles, one B per group); 9 to 16 vectors (one part, rows g and g + 8:
 * kvc_tcd_hi): 1. */
int kvc_tcd_gpt(int D, int q) {
  const int G = D / KVC_TC_GROUP;
  return q > 8 ? 1 : q * G <= 8 ? G : q * G <= 16 ? G / 2 : 1;
}
int kvc_tcd_hi(int q) { return q > 8; }

template <int D, int GPT, bool HI, bool TBL> static cudaError_t kvc_tcd_prepare(void) {
  return cudaFuncSetAttribute(kvc_tcd_kernel<D, GPT, HI, TBL>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              kvc_tcd_smem(D));
}

int kvc_tcd_occupancy(int D, int gpt, int hi, int tbl) {
  int n = 0;
  cudaError_t e = cudaErrorInvalidValue;
#define KVC_OCC(D_, P_, H_, T_)                                                                    \
  if (D == D_ && gpt == P_ && (hi != 0) == H_ && (tbl != 0) == T_ &&                               \
      (e = kvc_tcd_prepare<D_, P_, H_, T_>()) == cudaSuccess)                                      \
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kvc_tcd_kernel<D_, P_, H_, T_>, KVC_TCD_THREADS, \
                                                      kvc_tcd_smem(D));
  KVC_TCD_INSTANCES(KVC_OCC)
#undef KVC_OCC
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

int kvc_launch_tcd(const kvc_args &a, const kvc_plan &plan, cudaStream_t stream) {
  dim3 grid(plan.qtiles, plan.nsplit, a.B * a.KVH);
  const int q = a.rep * a.L, gpt = kvc_tcd_gpt(a.Dk, q);
  const bool hi = kvc_tcd_hi(q), tbl = a.k.tbl != nullptr;
  cudaError_t e = cudaErrorInvalidValue;
#define KVC_CASE(D_, P_, H_, T_)                                                                   \
  if (a.Dk == D_ && gpt == P_ && hi == H_ && tbl == T_) {                                          \
    kvc_tcd_kernel<D_, P_, H_, T_><<<grid, KVC_TCD_THREADS, kvc_tcd_smem(D_), stream>>>(a);        \
    e = cudaGetLastError();                                                                        \
  }
  KVC_TCD_INSTANCES(KVC_CASE)
#undef KVC_CASE
  if (e != cudaSuccess)
    return kva_seterr(KVA_ECUDA, "q4 per-warp kernel (D = %d, %d query vectors): %s", a.Dk, q,
                      cudaGetErrorString(e));
  return 0;
}
