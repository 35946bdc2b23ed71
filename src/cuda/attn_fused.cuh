/* The fused CUDA decode/verify kernel (contiguous or BLOCK_TABLE layout, L <= 16, causal
 * family masks), split over token blocks, and its merge kernel.
 *   math: for the QW query vectors (GQA heads x rows) of one KV head, each K
 *         row is decoded once into registers and dotted with all of them
 *         (quantized, where QW * 2 <= E: q.k = scale * (q . codes) +
 *         bias * sum(q) and p * v = (p * scale) * codes + p * bias per
 *         lane's group; else dequantized per element; fp8 rows: codes to
 *         f32 exactly, q.k = scale * (q . codes), p * v = (p * scale) * codes
 *         with the row's f32 scale);
 *         s = softcap(scale * q.k) in log2 units, online softmax
 *         {m, l, o} per query vector, o += p * v with V decoded once.
 *         Splits write {m (natural log), l, o} to the workspace and a second
 *         launch merges them (core/softmax_state.h), adds the sink, divides;
 *         one split writes o / l itself. A rotated output (a.rot_out): each
 *         block's combined o rotated in shared memory first, o <- H_Dv o
 *         (kvc_emit_block), so states and outputs leave rotated.
 *   memory: every K/V byte of a (sequence, KV head) is read once per query
 *         tile (one tile when rep * L <= QW; other tiles re-read it, from L2
 *         when they run together); E elements per lane and row in one to four vector loads of
 *         up to 16 bytes (2 bytes for q2 at E = 8), coalesced over the lanes
 *         of a row, plus the group's scale and bias; 2 x U rows per lane in flight
 *         (the next step's loads are issued before this step's math); over a
 *         block table each token's row is located through its table entry.
 *         Staged instances (RING: bf16 / f16 rows, E = 16, QW <= 2, block
 *         tables of power-of-two blocks): each warp copies whole chunks of
 *         C table rows (~8 KB of K and V, inside one pool block) into its
 *         own shared-memory ring by cp.async, KVC_RING_SLOTS - 1 chunks
 *         (~16 KB) ahead of its math, which reads the rows from there; one
 *         table load per 32 chunks per lane.
 *   launch: grid (qtiles, nsplit, B * KVH), KVC_FUSED_THREADS threads; a
 *         token row is spread over P = 2^lanes_log2 lanes of E elements each
 *         (E = 16 for head dims > 256 or rep * L <= 2 at head dims >= 128,
 *         else 8), a warp holds 32 / P rows at once; static shared memory up
 *         to 32 KB (4 warps x QW x 32E floats) for the cross-warp merge;
 *         staged instances also kvc_fused_ring_smem() bytes of dynamic
 *         shared memory (96 KB at D = 256 and 128: 2 blocks per SM). */
#ifndef KVA_CUDA_ATTN_FUSED_CUH
#define KVA_CUDA_ATTN_FUSED_CUH

#include "cuda/launch.cuh"
#include "cuda/mma.cuh" /* cp.async (the staged BLOCK_TABLE loop) */
#include "cuda/rows.cuh"

/* ---- formats as data: bits per element, quantized or float ---- */
/* FP8: fp8 codes with one f32 scale per row (applied to the row's dot
 * product and to p, as the affine map of quantized rows without a bias). */
template <int FMT> struct kvc_fmt_traits;
template <> struct kvc_fmt_traits<KVC_F32> { static constexpr int BPE = 32, QBITS = 0, FP8 = 0; };
template <> struct kvc_fmt_traits<KVC_F16> { static constexpr int BPE = 16, QBITS = 0, FP8 = 0; };
template <> struct kvc_fmt_traits<KVC_BF16> { static constexpr int BPE = 16, QBITS = 0, FP8 = 0; };
template <> struct kvc_fmt_traits<KVC_Q2> { static constexpr int BPE = 2, QBITS = 2, FP8 = 0; };
template <> struct kvc_fmt_traits<KVC_Q4> { static constexpr int BPE = 4, QBITS = 4, FP8 = 0; };
template <> struct kvc_fmt_traits<KVC_Q8> { static constexpr int BPE = 8, QBITS = 8, FP8 = 0; };
template <> struct kvc_fmt_traits<KVC_E4M3> { static constexpr int BPE = 8, QBITS = 0, FP8 = 1; };
template <> struct kvc_fmt_traits<KVC_E5M2> { static constexpr int BPE = 8, QBITS = 0, FP8 = 1; };

/* One lane's E elements of one row, as loaded: raw words and the raw bits
 * of its group's scale/bias (converted only when used, so the loads of a
 * step are all in flight before the first consumer waits). */
template <int FMT, int E> struct kvc_chunk {
  static constexpr int BYTES = kvc_fmt_traits<FMT>::BPE * E / 8;
  static constexpr int WORDS = BYTES >= 4 ? BYTES / 4 : 1;
  uint32_t w[WORDS];
  uint32_t s, z; /* scale, bias bits of the chunk's group (quantized); fp8: the row's scale (s) */
};

/* Compile-time layout tag of a token loop (BLOCK_TABLE or contiguous). */
template <bool B> struct kvc_table_tag {
  static constexpr bool value = B;
};

/* One lane's view of an operand: its chunk of row 0 of (b, h) and the row
 * strides (hoisted out of the token loop: row t is base + t * stride). For a
 * BLOCK_TABLE operand the bases hold (h, chunk) only and each token is
 * located through the table (one table load per token, shared by its K and
 * V rows); the table fields
 * are read from the kernel's parameters (kvc_operand), not held here, so
 * the contiguous loop keeps its registers. */
struct kvc_lane_rows {
  const char *data, *scale, *bias;
  long long ds, ss, bs; /* byte strides between tokens (rows of a block) */
  int fo;               /* BLOCK_TABLE: rows before token 0 in the first block */
};
template <int FMT, int E>
__device__ __forceinline__ kvc_lane_rows kvc_lane_rows_of(const kvc_operand &op, int b, int h, int c) {
  kvc_lane_rows r;
  const int ob = op.tbl ? 0 : b; /* the table supplies the block */
  r.fo = kvc_first_offset(op, b);
  r.data = op.data + ob * op.ds[0] + h * op.ds[1] + c * kvc_chunk<FMT, E>::BYTES;
  r.ds = op.ds[2];
  r.scale = r.bias = NULL;
  r.ss = r.bs = 0;
  if (kvc_fmt_traits<FMT>::QBITS) {
    const int g = c * E / op.group, es = kvc_dtype_size(op.sdtype);
    r.scale = op.scales + ob * op.ss[0] + h * op.ss[1] + g * es;
    r.bias = op.biases + ob * op.bs[0] + h * op.bs[1] + g * es;
    r.ss = op.ss[2];
    r.bs = op.bs[2];
  }
  if (kvc_fmt_traits<FMT>::FP8 && op.scales) { /* one f32 per (token, head); strides 0 broadcast */
    r.scale = op.scales + ob * op.ss[0] + h * op.ss[1];
    r.ss = op.ss[2];
  }
  return r;
}

/* Loads this lane's chunk of row t with one vector load of BYTES (the host
 * routes unaligned operands to the general path) and the raw scale/bias.
 * op: the operand r was made from; TABLE: op is a BLOCK_TABLE operand and l
 * is token t's location (kvc_table_loc; unused for contiguous rows). The
 * caller branches once per step, so the contiguous loads stay straight-line
 * code. */
template <int FMT, int E, bool TABLE>
__device__ __forceinline__ void kvc_load_chunk(kvc_chunk<FMT, E> &ch, const kvc_lane_rows &r, const kvc_operand &op,
                                               const kvc_loc &l, long long t) {
  typedef kvc_chunk<FMT, E> C;
  long long od = t * r.ds, os = t * r.ss, ob = t * r.bs;
  if (TABLE) {
    od = l.outer * op.ds[0] + l.row * r.ds;
    os = l.outer * op.ss[0] + l.row * r.ss;
    ob = l.outer * op.bs[0] + l.row * r.bs;
  }
  const int sdt = op.sdtype;
  const char *p = r.data + od;
  if (C::BYTES >= 16) {
#pragma unroll
    for (int k = 0; k < C::BYTES / 16; ++k) {
      const uint4 v = __ldg((const uint4 *)p + k);
      ch.w[4 * k] = v.x; ch.w[4 * k + 1] = v.y; ch.w[4 * k + 2] = v.z; ch.w[4 * k + 3] = v.w;
    }
  } else if (C::BYTES == 8) {
    const uint2 v = __ldg((const uint2 *)p);
    ch.w[0] = v.x; ch.w[C::WORDS - 1] = v.y;
  } else if (C::BYTES == 4) {
    ch.w[0] = __ldg((const unsigned int *)p);
  } else {
    ch.w[0] = __ldg((const unsigned short *)p);
  }
  if (kvc_fmt_traits<FMT>::FP8) /* the row's scale; 1.0f without scales */
    ch.s = r.scale ? __ldg((const unsigned int *)(r.scale + os)) : 0x3f800000u;
  if (kvc_fmt_traits<FMT>::QBITS) {
    if (sdt == KVA_F32) {
      ch.s = __ldg((const unsigned int *)(r.scale + os));
      ch.z = __ldg((const unsigned int *)(r.bias + ob));
    } else {
      ch.s = __ldg((const unsigned short *)(r.scale + os));
      ch.z = __ldg((const unsigned short *)(r.bias + ob));
    }
  }
}

template <int FMT, int E> __device__ __forceinline__ void kvc_zero_chunk(kvc_chunk<FMT, E> &ch) {
#pragma unroll
  for (int k = 0; k < kvc_chunk<FMT, E>::WORDS; ++k) ch.w[k] = 0;
  ch.s = 0;
  ch.z = 0;
}

/* Raw scale/bias bits -> float (dtype uniform over the launch: selects). */
__device__ __forceinline__ float kvc_scale_bits(uint32_t bits, int dt) {
  return dt == KVA_F32 ? __uint_as_float(bits) : dt == KVA_BF16 ? kvc_bf16_bits(bits) : kvc_f16_bits(bits);
}
/* A code 0 <= n < 2^23 as an exact float without I2F: (2^23 + n) - 2^23. */
#define KVC_MAGIC_BITS 0x4B000000u
#define KVC_MAGIC 8388608.0f
__device__ __forceinline__ float kvc_code_float(uint32_t n) { return __uint_as_float(KVC_MAGIC_BITS | n) - KVC_MAGIC; }

/* Byte y of w (a code < 256) as an exact float: one PRMT under the 2^23
 * exponent, then - 2^23. */
#define KVC_NIBBLES 0x0F0F0F0Fu
#define KVC_PRMT_MAGIC 0x7650u /* result bytes 1..3 from 0x4B000000, byte 0 from w */
__device__ __forceinline__ float kvc_byte_float(uint32_t w, int y) {
  return __uint_as_float(__byte_perm(w, KVC_MAGIC_BITS, KVC_PRMT_MAGIC + y)) - KVC_MAGIC;
}

/* Float rows as floats, quantized rows as their codes. */
template <int FMT, int E>
__device__ __forceinline__ void kvc_decode_codes(const kvc_chunk<FMT, E> &ch, float (&x)[E]) {
  constexpr int QB = kvc_fmt_traits<FMT>::QBITS;
  if constexpr (kvc_fmt_traits<FMT>::FP8) {
    /* two codes per conversion (cvt.rn.f16x2.e4m3x2 / e5m2x2 on sm_89+), then f16 -> f32 */
#pragma unroll
    for (int k = 0; k < kvc_chunk<FMT, E>::WORDS; ++k)
#pragma unroll
      for (int y = 0; y < 2; ++y) {
        const uint32_t h2 = kvc_fp8x2_f16x2<FMT == KVC_E4M3>(ch.w[k] >> (16 * y));
        const float2 f = __half22float2(*(const __half2 *)&h2);
        x[4 * k + 2 * y] = f.x;
        x[4 * k + 2 * y + 1] = f.y;
      }
  } else if constexpr (QB == 8 || QB == 4) {
    /* codes byte by byte: PRMT puts a code byte under the 2^23 exponent */
#pragma unroll
    for (int k = 0; k < kvc_chunk<FMT, E>::WORDS; ++k) {
      const uint32_t w = ch.w[k];
      if (QB == 8) {
#pragma unroll
        for (int y = 0; y < 4; ++y) x[4 * k + y] = kvc_byte_float(w, y);
      } else {
        const uint32_t even = w & KVC_NIBBLES, odd = (w >> 4) & KVC_NIBBLES; /* codes 0,2,4,6 / 1,3,5,7 */
#pragma unroll
        for (int y = 0; y < 4; ++y) {
          x[8 * k + 2 * y] = kvc_byte_float(even, y);
          x[8 * k + 2 * y + 1] = kvc_byte_float(odd, y);
        }
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if (FMT == KVC_F32) x[e] = __uint_as_float(ch.w[e]);
      else if (FMT == KVC_F16) x[e] = kvc_f16_bits((ch.w[e / 2] >> (16 * (e % 2))) & 0xffffu);
      else if (FMT == KVC_BF16)
        x[e] = __uint_as_float(e % 2 ? (ch.w[e / 2] & 0xffff0000u) : (ch.w[e / 2] << 16));
      else {
        const uint32_t code = (ch.w[(e * QB) / 32] >> ((e * QB) % 32)) & ((1u << QB) - 1u);
        x[e] = kvc_code_float(code);
      }
    }
  }
}

/* Chunk -> E floats. Float rows as they are. Quantized rows: CODES = false
 * dequantizes (scale * code + bias, f32); CODES = true leaves the codes
 * (exact small integers) with the group's scale and bias in sc, bi, for a
 * kernel that applies the affine map once per row and query vector:
 * q.k = scale * (q . codes) + bias * sum(q), p * v = (p * scale) * codes + p * bias. */
template <int FMT, int E, bool CODES>
__device__ __forceinline__ void kvc_decode(const kvc_chunk<FMT, E> &ch, int sdt, float (&x)[E], float &sc,
                                           float &bi) {
  constexpr int QB = kvc_fmt_traits<FMT>::QBITS;
  sc = 1.0f;
  bi = 0.0f;
  if (kvc_fmt_traits<FMT>::FP8) sc = __uint_as_float(ch.s); /* applied per row by the caller */
  if (QB) {
    sc = kvc_scale_bits(ch.s, sdt);
    bi = kvc_scale_bits(ch.z, sdt);
  }
  kvc_decode_codes(ch, x);
  if (QB && !CODES) { /* dequantize here: scale * code + bias */
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = fmaf(sc, x[e], bi);
    sc = 1.0f;
    bi = 0.0f;
  }
}

/* U token rows of one lane: the unit of loading, double-buffered. */
template <int FMT, int E, int U> struct kvc_step {
  kvc_chunk<FMT, E> k[U], v[U];
  long long t[U];
  bool valid[U];
};

/* 2^x with the MUFU unit (ex2.approx.ftz: ~2 ulp; 2^-inf = 0). */
__device__ __forceinline__ float kvc_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* kva_softmax_factors in log2 units: factors bringing maxima m1, m2 to their
 * common (NaN-propagating) max; an empty side (-inf) contributes 0. */
__device__ __forceinline__ void kvc_factors2(float m1, float m2, float &mn, float &f1, float &f2) {
  mn = kvc_max(m1, m2);
  if (mn == -INFINITY) {
    f1 = 0.0f;
    f2 = 0.0f;
  } else {
    f1 = exp2f(m1 - mn);
    f2 = exp2f(m2 - mn);
  }
}

/* Where a query vector's result goes, found once per vector: with one split
 * the output row (the sink joined: the outputs are O f1 / Ls), otherwise
 * the split's state slot for the merge kernel. A rotated output (a.rot_out)
 * arrives here already rotated (kvc_emit_block: O <- H_Dv O, linear, so the
 * merge of rotated states and the division by l are the unrotated ones). */
struct kvc_emit_row {
  char *out; /* output row (one split), else nullptr */
  float *st; /* split state [m, l, o[Dv]] (several splits) */
  float f1, Ls;
  float M2;  /* one split: the log2-domain max after the sink joined (for lse) */
  int b, h, i;
};
__device__ __forceinline__ kvc_emit_row kvc_emit_row_of(const kvc_args &a, int split, int b, int hk, int qv, float M,
                                                        float Ls) {
  const int h = hk * a.rep + qv / a.L, i = qv % a.L;
  kvc_emit_row r;
  r.out = nullptr;
  r.st = nullptr;
  r.f1 = 1.0f;
  r.Ls = Ls;
  r.M2 = M;
  r.b = b;
  r.h = h;
  r.i = i;
  if (a.nsplit == 1) {
    if (a.sinks && M != -INFINITY) {
      float f2;
      kvc_factors2(M, a.sinks[h] * KVC_LOG2E, r.M2, r.f1, f2);
      r.Ls = Ls * r.f1 + f2;
    }
    r.out = kvc_out_at(a, b, h, i, 0);
  } else {
    r.st = kvc_state_at(a, split, b, h, i);
  }
  return r;
}
/* Element d (output O) of a row; the state's m and l go with d = 0. */
__device__ __forceinline__ void kvc_emit_elem(const kvc_args &a, const kvc_emit_row &r, int d, float M, float O) {
  if (r.out) {
    kvc_store(r.out + d * a.os[3], a.out_dtype, kvc_finish(O * r.f1, r.Ls));
    if (d == 0 && a.lse) kvc_store_lse2(a, r.b, r.h, r.i, r.M2, r.Ls);
  } else {
    if (d == 0) {
      r.st[0] = M * KVC_LN2; /* natural log units, as core/softmax_state.h */
      r.st[1] = r.Ls;
    }
    r.st[2 + d] = O;
  }
}
/* Element d of query vector qv's combined state (log2-domain max M, sum
 * Ls, output O): with one split, the sink joins and the output is written;
 * otherwise the state goes to the split's slot for the merge kernel. */
__device__ __forceinline__ void kvc_emit(const kvc_args &a, int split, int b, int hk, int qv, int d, float M,
                                         float Ls, float O) {
  kvc_emit_elem(a, kvc_emit_row_of(a, split, b, hk, qv, M, Ls), d, M, O);
}

/* A block's final states from shared memory: ost [nq][ld >= D] the outputs
 * of vectors q0 .. q0 + nq - 1, ms and ls [nq] their max and sum; a warp per
 * vector (its row located once), lanes over the dims (coalesced), in loops
 * kept rolled. Unrolled per accumulator register, the emits of the 32-vector
 * tensor-core instance were ~5,000 instructions of straight-line code that
 * every block fetched cold (H200, a 2k-token verify: 67 % of the stall
 * samples were instruction fetches). A rotated output (a.rot_out): the
 * warp first rotates its row, O <- H_D O in f32 (D = Dv): with D known at
 * compile time (DC = D, a power of two) in registers, lane t holding dims
 * t + 32 j (kvc_hadamard_lanes: five shuffle stages, no sync) and emitted
 * from there; else in place in shared memory (kvc_hadamard_warp: a
 * __syncwarp per stage, any rotatable D); the emit writes the split's state
 * or, with one split, out = H O / l directly (no merge launch; the merge of
 * rotated states is the plain one). Dim d of row v sits at ost[v ld +
 * col(d)] (col other than the natural order with DC only). The caller's
 * barrier precedes (ost written by the block). */
struct kvc_col_natural { /* dim d of a row at column d */
  static constexpr bool natural = true;
  __device__ int operator()(int d) const { return d; }
};
template <int DC = 0, typename Col = kvc_col_natural>
__device__ __forceinline__ void kvc_emit_block(const kvc_args &a, int split, int b, int hk, int q0, int nq, int D,
                                               int ld, float *ost, const float *ms, const float *ls, int nthreads,
                                               Col col = Col()) {
  static_assert(DC == 0 || (DC >= KVC_WARP && (DC & (DC - 1)) == 0), "DC: a power of two from 32, or 0");
  static_assert(DC > 0 || Col::natural, "rows in another column order (col): DC > 0 only");
  const int lane = threadIdx.x % KVC_WARP;
#pragma unroll 1
  for (int v = threadIdx.x / KVC_WARP; v < nq; v += nthreads / KVC_WARP) {
    const kvc_emit_row r = kvc_emit_row_of(a, split, b, hk, q0 + v, ms[v], ls[v]);
    float *row = ost + v * ld;
    if constexpr (DC > 0) {
      if (a.rot_out) { /* lane t: dims t + 32 j, the emit loop's own order */
        constexpr int DPT = DC / KVC_WARP;
        float x[DPT];
#pragma unroll
        for (int j = 0; j < DPT; ++j) x[j] = row[col(lane + KVC_WARP * j)];
        kvc_hadamard_lanes<DPT>(x, lane, a.rot_oc);
#pragma unroll
        for (int j = 0; j < DPT; ++j) kvc_emit_elem(a, r, lane + KVC_WARP * j, ms[v], x[j]);
        continue;
      }
    } else if (a.rot_out) {
      kvc_hadamard_warp(row, D, a.rot_om, a.rot_oc, lane);
    }
#pragma unroll 1
    for (int d = lane; d < D; d += KVC_WARP) kvc_emit_elem(a, r, d, ms[v], row[col(d)]);
  }
}

/* Blocks per SM the register budget is capped for (more warps, more loads in
 * flight): the decode instances (QW <= 2) of 16-bit and quantized rows, 4
 * blocks at E = 8 and 3 at E = 16 (under 64 bytes of spills); else uncapped. */
__host__ __device__ constexpr int kvc_min_blocks(int FMT, int E, int QW) {
  return FMT == KVC_F32 || QW > 2 ? 1 : E == 8 ? 4 : 3;
}

/* The instances with a staged BLOCK_TABLE loop (RING, kvc_plan.ring): 16-bit float rows, 16 elements
 * per lane, 1 or 2 query vectors per block (the bf16 / f16 decode instances). */
__host__ __device__ constexpr bool kvc_fused_ring_inst(int FMT, int E, int QW) {
  return (FMT == KVC_BF16 || FMT == KVC_F16) && E == 16 && QW <= 2;
}

/* RING: the instance for BLOCK_TABLE views whose rows the warps stage in shared memory (the token
 * loop run_ring below; its own instance, so the contiguous and per-lane table loops are unchanged). */
template <int FMT, int E, int QW, bool RING = false>
__global__ void __launch_bounds__(KVC_FUSED_THREADS, kvc_min_blocks(FMT, E, QW)) kvc_fused_kernel(const kvc_args a) {
  static_assert(!RING || kvc_fused_ring_inst(FMT, E, QW), "a staged instance of another format or tile");
  constexpr int U = kvc_unroll(E, QW);
  constexpr int DMAX = E * KVC_WARP;
  __shared__ float sm_ml[KVC_FUSED_WARPS][QW][2];
  __shared__ float sm_o[KVC_FUSED_WARPS][QW][DMAX];
  __shared__ float sm_fin[2][QW]; /* a rotated output's combined max and sum per vector */
  extern __shared__ __align__(16) unsigned char kvc_fused_ring[]; /* RING: the warps' rings (run_ring) */

  const int lane = threadIdx.x % KVC_WARP, warp = threadIdx.x / KVC_WARP;
  const int qtile = kvc_qtile(), split = blockIdx.y;
  const int b = blockIdx.z / a.KVH, hk = blockIdx.z % a.KVH;
  const int lg = a.lanes_log2, P = 1 << lg, TPW = KVC_WARP >> lg;
  const int slot = lane >> lg, c = lane & (P - 1);
  const bool kact = c * E < a.Dk, vact = c * E < a.Dv;
  const long long len = kvc_seq_len(a, b);
  const int Q = a.rep * a.L;
  const kvc_lane_rows krows = kvc_lane_rows_of<FMT, E>(a.k, b, hk, c);
  const kvc_lane_rows vrows = kvc_lane_rows_of<FMT, E>(a.v, b, hk, c);
  const int ksdt = a.k.sdtype, vsdt = a.v.sdtype;

  /* a rotated call's queries: each warp forms q' = H q of the tile's
   * vectors in its own slice of sm_o (unused until the final merge, which
   * this warp alone writes); its lanes take their dims from there */
  if (a.rot_q)
    for (int j = 0; j < QW; ++j) {
      const int qv = qtile * QW + j; /* warp-uniform */
      if (qv < Q)
        kvc_rotated_query_warp(kvc_q_at(a, b, hk * a.rep + qv / a.L, qv % a.L, 0), a.qs[3], a.q_dtype, a.Dk, a.rot_qm,
                               a.rot_qc, a.rot_qdt, &sm_o[warp][j][0], lane);
    }
  /* The tile's query vectors: qv = r * L + i -> head hk * rep + r, row i. */
  float qr[QW][E];
  long long pos[QW];
  int32_t segp[QW];
  bool qok[QW];
#pragma unroll
  for (int j = 0; j < QW; ++j) {
    const int qv = qtile * QW + j;
    qok[j] = qv < Q;
    const int h = hk * a.rep + (qok[j] ? qv / a.L : 0), i = qok[j] ? qv % a.L : 0;
    pos[j] = len - a.L + i;
    segp[j] = qok[j] ? kvc_seg_of_row(a, b, pos[j]) : 0;
    /* the row as loaded: q, or q' (f32) in sm_o (a generic address either way) */
    const char *qrow = a.rot_q ? (const char *)&sm_o[warp][j][0] : kvc_q_at(a, b, h, i, 0);
    const long long qes = a.rot_q ? 4 : a.qs[3];
    const int qdt = a.rot_q ? KVA_F32 : a.q_dtype;
#pragma unroll
    for (int e = 0; e < E; ++e) qr[j][e] = (qok[j] && kact) ? kvc_load(qrow + (c * E + e) * qes, qdt) : 0.0f;
  }
  __syncwarp(); /* the reads of sm_o above before this warp's final writes of it */

  long long t_lo, t_hi;
  kvc_split_range(a, split, len, qtile * QW, QW, &t_lo, &t_hi);

  /* The affine map per row and query vector (2 operations per query and row)
   * instead of per element (2 per element) where that is fewer operations. */
  constexpr bool QUANT = kvc_fmt_traits<FMT>::QBITS != 0 && QW * 2 <= E;
  /* fp8 rows: the row's scale times q . codes, and p times it for V */
  constexpr bool FP8 = kvc_fmt_traits<FMT>::FP8 != 0;
  /* sum of this lane's q elements per query vector (the bias term of q.k) */
  float qsum[QW];
#pragma unroll
  for (int j = 0; j < QW; ++j) {
    qsum[j] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) qsum[j] += qr[j][e];
  }
  /* o: sum p * v over this lane's E dims; oz: sum p * bias of its V group
   * (quantized rows; added to every o element at the end) */
  float m[QW], l[QW], o[QW][E], oz[QW];
#pragma unroll
  for (int j = 0; j < QW; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
    oz[j] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) o[j][e] = 0.0f;
  }

  const int step = KVC_FUSED_WARPS * TPW * U;
  typedef kvc_step<FMT, E, U> S;
  /* Issues the loads of the step starting at token `base` (none past t_hi);
   * tb: kvc_table_tag<true> for a BLOCK_TABLE view (the token loop below
   * is instantiated once per layout, so the contiguous loop is unchanged). */
  auto load = [&](S &st, long long base, auto tb) {
    constexpr bool TB = decltype(tb)::value;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      st.t[u] = base + (long long)(u * KVC_FUSED_WARPS + warp) * TPW + slot;
      st.valid[u] = st.t[u] < t_hi;
      kvc_zero_chunk(st.k[u]);
      kvc_zero_chunk(st.v[u]);
      kvc_loc l = {0, 0};
      if (TB && st.valid[u]) /* K and V rows share the table (and its first offsets): one lookup */
        l = kvc_table_loc(a.k.tbl + b * a.k.tbl_rs, krows.fo, a.k.bsz, a.k.bsh, a.k.nblk, st.t[u]);
      if (st.valid[u] && kact) kvc_load_chunk<FMT, E, TB>(st.k[u], krows, a.k, l, st.t[u]);
      if (st.valid[u] && vact) kvc_load_chunk<FMT, E, TB>(st.v[u], vrows, a.v, l, st.t[u]);
    }
  };
  /* Logits, online softmax and P.V of one loaded step. */
  auto compute = [&](const S &st) {
    /* partial dots over this lane's E elements, then over the row's P lanes */
    float x[U][QW];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[E], ks, kz;
      kvc_decode<FMT, E, QUANT>(st.k[u], ksdt, kf, ks, kz);
#pragma unroll
      for (int j = 0; j < QW; ++j) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) d = fmaf(qr[j][e], kf[e], d);
        x[u][j] = QUANT ? fmaf(ks, d, kz * qsum[j]) : FP8 ? ks * d : d;
      }
    }
    for (int off = P >> 1; off > 0; off >>= 1)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < QW; ++j) x[u][j] += __shfl_xor_sync(KVC_FULL_MASK, x[u][j], off);
    /* masks, logits (log2 units), online softmax */
    bool vis[U][QW];
#pragma unroll
    for (int j = 0; j < QW; ++j) {
      float mx = m[j];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        bool v = st.valid[u] && qok[j];
        if (v && kvc_causal_family(a)) v = kvc_causal_visible(a, b, st.t[u], pos[j], segp[j], len);
        const float xl = v ? kvc_logit(a, x[u][j]) * KVC_LOG2E : -INFINITY;
        if (xl == -INFINITY) v = false;
        vis[u][j] = v;
        x[u][j] = xl;
        mx = kvc_max(mx, xl);
      }
      if (mx != -INFINITY) {
        if (!(mx == m[j])) { /* the max grew (or is NaN): rescale l and o */
          const float corr = kvc_exp2(m[j] - mx); /* 0 when m = -inf */
          m[j] = mx;
          l[j] *= corr;
#pragma unroll
          for (int e = 0; e < E; ++e) o[j][e] *= corr;
          oz[j] *= corr;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          x[u][j] = vis[u][j] ? kvc_exp2(x[u][j] - mx) : 0.0f;
          l[j] += x[u][j];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[E], vs, vz;
      kvc_decode<FMT, E, QUANT>(st.v[u], vsdt, vf, vs, vz);
#pragma unroll
      for (int j = 0; j < QW; ++j)
        if (vis[u][j]) {
          const float w = QUANT || FP8 ? x[u][j] * vs : x[u][j];
          if (QUANT) oz[j] = fmaf(x[u][j], vz, oz[j]);
#pragma unroll
          for (int e = 0; e < E; ++e) o[j][e] = fmaf(w, vf[e], o[j][e]);
        }
    }
  };
  /* Two steps in flight: the next step's loads are issued before this one's
   * math (ping-pong buffers, so no register copy waits on a load). */
  auto run = [&](auto tb) {
    S sa, sb;
    long long base = t_lo;
    if (base < t_hi) load(sa, base, tb);
    while (base < t_hi) {
      load(sb, base + step, tb);
      compute(sa);
      base += step;
      if (base >= t_hi) break;
      load(sa, base + step, tb);
      compute(sb);
      base += step;
    }
  };
  /* BLOCK_TABLE rows staged per warp (RING; the view's block size a power of two that a.ring_tok
   * divides). The split's table rows r = t + fo go in chunks of C = a.ring_tok rows aligned to C, so
   * each chunk lies in one pool block: chunk k holds rows R0 + k C .. R0 + k C + C - 1, R0 = (t_lo +
   * fo) rounded down to C, tokens outside [t_lo, t_hi) masked. Warp w takes chunks w, w + 4, ..; it
   * copies a chunk's K and V rows into slot i % NS of its own ring (cp.async, 16-byte pieces: lane
   * (slot, c) takes pieces c and c + P of rows slot, slot + TPW, .., so a warp instruction covers
   * TPW rows' 16 P contiguous bytes each) NS - 1 chunks ahead of its math, which loads each lane's
   * E elements of a row from the slot into the step registers and runs compute() on them. The block
   * ids of 32 of the warp's chunks come in one load (lane i: its chunk 32 n + i), handed to the
   * copies by a shuffle; no table load or address arithmetic per row in the math. Per chunk and
   * lane: 4 C / TPW cp.async, one 64-bit multiply-add per operand; the warp's own
   * cp.async.wait_group and __syncwarp order the slot's reuse (no block barrier). */
  auto run_ring = [&]() {
   if constexpr (RING) { /* (compiled in the staged instances only) */
    constexpr int NS = KVC_RING_SLOTS;
    const int C = a.ring_tok, fo = krows.fo;
    const long long R0 = (t_lo + fo) / C * C, nch = t_hi > t_lo ? (t_hi + fo - R0 + C - 1) / C : 0;
    const long long mine = nch > warp ? (nch - warp + KVC_FUSED_WARPS - 1) / KVC_FUSED_WARPS : 0;
    const int RK = 2 * a.Dk, RV = 2 * a.Dv, slot_bytes = C * (RK + RV); /* staged row bytes, slot bytes */
    unsigned char *ring = kvc_fused_ring + warp * NS * slot_bytes;
    const uint32_t ring_sh = (uint32_t)__cvta_generic_to_shared(ring);
    const int32_t *trow = a.k.tbl + b * a.k.tbl_rs;
    /* this lane's pieces c, c + P of K and V rows (16 bytes = 8 elements each) */
    const bool k0 = 8 * c < a.Dk, k1 = 8 * (c + P) < a.Dk, v0 = 8 * c < a.Dv, v1 = 8 * (c + P) < a.Dv;
    const char *kb = a.k.data + hk * a.k.ds[1] + slot * a.k.ds[2] + 16 * c;
    const char *vb = a.v.data + hk * a.v.ds[1] + slot * a.v.ds[2] + 16 * c;
    const uint32_t dk0 = 16 * c, dv0 = C * RK + 16 * c; /* a slot's K rows [C][RK], then V rows [C][RV] */
    /* the block id of the warp's chunk 32 n + lane (0 past the split: nothing read) */
    auto ids_of = [&](long long n) -> int {
      const long long k = warp + (long long)KVC_FUSED_WARPS * (32 * n + lane);
      if (k >= nch) return 0;
      const int id = __ldg(trow + ((R0 + k * C) >> a.k.bsh));
      return id < 0 ? 0 : (id >= a.k.nblk ? a.k.nblk - 1 : id);
    };
    int id_cur = 0, id_next = ids_of(0);
    long long issued = 0;
    /* the copies of the warp's next chunk into its slot, one commit group (empty past the split) */
    auto issue_next = [&]() {
      if ((issued & 31) == 0) {
        id_cur = id_next;
        id_next = ids_of((issued >> 5) + 1);
      }
      const int id = __shfl_sync(KVC_FULL_MASK, id_cur, (int)(issued & 31));
      const long long k = warp + (long long)KVC_FUSED_WARPS * issued;
      if (k < nch) {
        const long long r0 = R0 + k * C, rb = r0 & (a.k.bsz - 1);
        const char *ks = kb + id * a.k.ds[0] + rb * a.k.ds[2], *vs = vb + id * a.v.ds[0] + rb * a.v.ds[2];
        const uint32_t d = ring_sh + (uint32_t)((issued % NS) * slot_bytes);
        for (int j = slot; j < C; j += TPW) {
          const long long t = r0 + j - fo;
          if (t >= t_lo && t < t_hi) {
            const uint32_t dk = d + dk0 + j * RK, dv = d + dv0 + j * RV;
            if (k0) kvc_cp_async<16>(dk, ks, 16);
            if (k1) kvc_cp_async<16>(dk + 16 * P, ks + 16 * P, 16);
            if (v0) kvc_cp_async<16>(dv, vs, 16);
            if (v1) kvc_cp_async<16>(dv + 16 * P, vs + 16 * P, 16);
          }
          ks += TPW * a.k.ds[2];
          vs += TPW * a.v.ds[2];
        }
      }
      kvc_cp_commit();
      ++issued;
    };
    for (int s = 0; s < NS - 1; ++s) issue_next();
    for (long long i = 0; i < mine; ++i) {
      kvc_cp_wait<NS - 2>(); /* this lane's copies of chunk i landed */
      __syncwarp();          /* every lane's; and every lane is done with slot (i - 1) % NS */
      issue_next();          /* chunk i + NS - 1 into slot (i - 1) % NS */
      const unsigned char *sl = ring + (i % NS) * slot_bytes;
      const long long r0 = R0 + (warp + (long long)KVC_FUSED_WARPS * i) * C;
      for (int j0 = 0; j0 < C; j0 += TPW * U) {
        S st;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int j = j0 + u * TPW + slot;
          st.t[u] = r0 + j - fo;
          st.valid[u] = st.t[u] >= t_lo && st.t[u] < t_hi;
          kvc_zero_chunk(st.k[u]);
          kvc_zero_chunk(st.v[u]);
          if (st.valid[u] && kact) {
            const uint4 *p = (const uint4 *)(sl + j * RK + 32 * c);
            const uint4 x = p[0], y = p[1];
            st.k[u].w[0] = x.x; st.k[u].w[1] = x.y; st.k[u].w[2] = x.z; st.k[u].w[3] = x.w;
            st.k[u].w[4] = y.x; st.k[u].w[5] = y.y; st.k[u].w[6] = y.z; st.k[u].w[7] = y.w;
          }
          if (st.valid[u] && vact) {
            const uint4 *p = (const uint4 *)(sl + C * RK + j * RV + 32 * c);
            const uint4 x = p[0], y = p[1];
            st.v[u].w[0] = x.x; st.v[u].w[1] = x.y; st.v[u].w[2] = x.z; st.v[u].w[3] = x.w;
            st.v[u].w[4] = y.x; st.v[u].w[5] = y.y; st.v[u].w[6] = y.z; st.v[u].w[7] = y.w;
          }
        }
        compute(st);
      }
    }
    kvc_cp_wait<0>(); /* no copy outstanding at exit (the empty tail groups) */
   }
  };
  if constexpr (RING) run_ring();
  else if (a.k.tbl) run(kvc_table_tag<true>());
  else run(kvc_table_tag<false>());
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  /* the merge launch (programmatic dependent launch) may start now; it waits
   * for this grid's completion before reading the workspace */
  cudaTriggerProgrammaticLaunchCompletion();
#endif

  if (QUANT)
#pragma unroll
    for (int j = 0; j < QW; ++j)
#pragma unroll
      for (int e = 0; e < E; ++e) o[j][e] += oz[j];

  /* merge the warp's token slots (lanes c, c + P, ...) */
  for (int off = P; off < KVC_WARP; off <<= 1) {
#pragma unroll
    for (int j = 0; j < QW; ++j) {
      const float mo = __shfl_xor_sync(KVC_FULL_MASK, m[j], off);
      const float lo = __shfl_xor_sync(KVC_FULL_MASK, l[j], off);
      float mn, f1, f2;
      kvc_factors2(m[j], mo, mn, f1, f2);
      m[j] = mn;
      l[j] = l[j] * f1 + lo * f2;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float oo = __shfl_xor_sync(KVC_FULL_MASK, o[j][e], off);
        o[j][e] = o[j][e] * f1 + oo * f2;
      }
    }
  }
  /* merge the warps in shared memory, in a fixed order */
  if (slot == 0 && vact)
#pragma unroll
    for (int j = 0; j < QW; ++j)
#pragma unroll
      for (int e = 0; e < E; ++e) sm_o[warp][j][c * E + e] = o[j][e];
  if (lane == 0)
#pragma unroll
    for (int j = 0; j < QW; ++j) {
      sm_ml[warp][j][0] = m[j];
      sm_ml[warp][j][1] = l[j];
    }
  __syncthreads();
  /* vector j's state, dim d, over the warps (fixed order) */
  auto combine = [&](int j, int d, float &M, float &Ls, float &O) {
    M = -INFINITY, Ls = 0.0f, O = 0.0f;
    for (int w = 0; w < KVC_FUSED_WARPS; ++w) {
      float mn, f1, f2;
      kvc_factors2(M, sm_ml[w][j][0], mn, f1, f2);
      M = mn;
      Ls = Ls * f1 + sm_ml[w][j][1] * f2;
      O = O * f1 + sm_o[w][j][d] * f2;
    }
  };
  if (a.rot_out) { /* the combined rows into warp 0's slice (a thread alone reads its (j, d) there), rotated */
    for (int idx = threadIdx.x; idx < QW * a.Dv; idx += KVC_FUSED_THREADS) {
      const int j = idx / a.Dv, d = idx % a.Dv;
      if (qtile * QW + j >= Q) continue;
      float M, Ls, O;
      combine(j, d, M, Ls, O);
      sm_o[0][j][d] = O;
      if (d == 0) {
        sm_fin[0][j] = M;
        sm_fin[1][j] = Ls;
      }
    }
    __syncthreads();
    kvc_emit_block(a, split, b, hk, qtile * QW, min(QW, Q - qtile * QW), a.Dv, DMAX, &sm_o[0][0][0], sm_fin[0],
                   sm_fin[1], KVC_FUSED_THREADS);
    return;
  }
  for (int idx = threadIdx.x; idx < QW * a.Dv; idx += KVC_FUSED_THREADS) {
    const int j = idx / a.Dv, d = idx % a.Dv, qv = qtile * QW + j;
    if (qv >= Q) continue;
    float M, Ls, O;
    combine(j, d, M, Ls, O);
    kvc_emit(a, split, b, hk, qv, d, M, Ls, O);
  }
}

/* Resident blocks per SM of the instance for (E, QW), 0 if none. */
template <int FMT> int kvc_fused_occupancy_fmt(int E, int QW) {
  int n = 0;
  cudaError_t e = cudaErrorInvalidValue;
#define KVC_OCC(E_, QW_)                                                                           \
  if (E == E_ && QW == QW_)                                                                        \
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kvc_fused_kernel<FMT, E_, QW_>, KVC_FUSED_THREADS, 0);
  KVC_OCC(8, 1) KVC_OCC(8, 2) KVC_OCC(8, 4) KVC_OCC(8, 8)
  KVC_OCC(16, 1) KVC_OCC(16, 2) KVC_OCC(16, 4)
#undef KVC_OCC
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

/* The staged instances (kvc_fused_ring_inst): resident blocks per SM with smem bytes of dynamic
 * shared memory, 0 if none; the instance's dynamic shared-memory limit is raised first to the most
 * it may ask for beside its static shared memory (every caller sets the same value). */
template <int FMT, int QW> static cudaError_t kvc_fused_ring_occupancy_inst(int smem, int *n) {
  const auto kern = kvc_fused_kernel<FMT, 16, QW, true>;
  cudaFuncAttributes fa;
  cudaError_t e = cudaFuncGetAttributes(&fa, kern);
  if (e != cudaSuccess) return e;
  if ((size_t)smem + fa.sharedSizeBytes > (size_t)KVC_TC_SMEM_MAX) return cudaErrorInvalidValue;
  e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           KVC_TC_SMEM_MAX - (int)fa.sharedSizeBytes);
  if (e != cudaSuccess) return e;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, kern, KVC_FUSED_THREADS, smem);
}
template <int FMT> int kvc_fused_ring_occupancy_fmt(int QW, int smem) {
  int n = 0;
  cudaError_t e = cudaErrorInvalidValue;
  if constexpr (kvc_fused_ring_inst(FMT, 16, 1)) {
    if (QW == 1) e = kvc_fused_ring_occupancy_inst<FMT, 1>(smem, &n);
    else if (QW == 2) e = kvc_fused_ring_occupancy_inst<FMT, 2>(smem, &n);
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

/* Launches the instance of format FMT for the plan's E and QW (the staged one for plan.ring). */
template <int FMT> int kvc_launch_fused_fmt(const kvc_args &a, const kvc_plan &plan, cudaStream_t stream) {
  dim3 grid(plan.qtiles, plan.nsplit, a.B * a.KVH);
  if constexpr (kvc_fused_ring_inst(FMT, 16, 1)) {
    if (plan.ring) {
      const int smem = kvc_fused_ring_smem(a.Dk, a.Dv, plan.ring);
      if (plan.E == 16 && plan.QW == 1) kvc_fused_kernel<FMT, 16, 1, true><<<grid, KVC_FUSED_THREADS, smem, stream>>>(a);
      else if (plan.E == 16 && plan.QW == 2)
        kvc_fused_kernel<FMT, 16, 2, true><<<grid, KVC_FUSED_THREADS, smem, stream>>>(a);
      else
        return kva_seterr(KVA_EINTERNAL, "CUDA fused kernel: no staged instance for E = %d, QW = %d", plan.E, plan.QW);
      goto launched;
    }
  }
#define KVC_CASE(E_, QW_)                                                                          \
  if (plan.E == E_ && plan.QW == QW_) {                                                            \
    kvc_fused_kernel<FMT, E_, QW_><<<grid, KVC_FUSED_THREADS, 0, stream>>>(a);                     \
    goto launched;                                                                                 \
  }
  KVC_CASE(8, 1) KVC_CASE(8, 2) KVC_CASE(8, 4) KVC_CASE(8, 8)
  KVC_CASE(16, 1) KVC_CASE(16, 2) KVC_CASE(16, 4)
#undef KVC_CASE
  return kva_seterr(KVA_EINTERNAL, "CUDA fused kernel: no instance for E = %d, QW = %d", plan.E, plan.QW);
launched:
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return kva_seterr(KVA_ECUDA, "fused attention kernel launch: %s", cudaGetErrorString(e));
  return 0;
}
#endif
