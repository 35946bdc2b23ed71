/* Device-side pieces shared by the CUDA attention kernels: the flattened call
 * (kvc_args, built on the host from a kva_problem), element loads per dtype,
 * K/V row addressing, the mask rule and the logit transform. No kernels here.
 * The online-softmax state and its merge come from core/softmax_state.h (the
 * one shared with the CPU kernels and the tests); kernels keep running maxima
 * in log2 units internally and store natural-log maxima in the workspace. */
#ifndef KVA_CUDA_COMMON_CUH
#define KVA_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "core/backend.h"
#include "core/softmax_state.h"
}

#define KVC_LOG2E 1.4426950408889634f
#define KVC_LN2 0.6931471805599453f
#define KVC_WARP 32
#define KVC_FULL_MASK 0xffffffffu

/* One K or V operand: device pointers, byte strides of dims b, h, t. */
struct kvc_operand {
  const char *data, *scales, *biases;
  long long ds[3], ss[3], bs[3];
  int dtype;  /* element dtype of float rows (bits == 0), fp8 included */
  int sdtype; /* scales/biases dtype (quantized); fp8 rows: f32 scales (scales NULL: scale 1) */
  int bits;   /* 0, 2, 4, 8 */
  int group;  /* group size (quantized) */
  int vec;    /* rows aligned for the fused kernel's vector loads */
  /* BLOCK_TABLE layout (tbl != NULL): the arrays are pools [num_blocks, KVH,
   * bs, D] and ds[0]/ss[0]/bs[0] their block strides. Token t of sequence b
   * is table row r = fo[b] + t, in block tbl[b * tbl_rs + r / bs] (clamped
   * into [0, nblk): a bad id never faults) at row r % bs. */
  const int32_t *tbl, *fo;
  long long tbl_rs;
  int bsz, nblk;
  int bsh; /* log2(bsz) when bsz is a power of two, else -1 */
};

/* A validated call, flattened for the device (passed by value). */
struct kvc_args {
  int B, H, KVH, rep, L, Dk, Dv;
  long long N;
  float scale, softcap;
  float softcap_inv;            /* 1 / softcap (0 when none) */
  int mask_kind, window, clamp;
  const int32_t *seg;          /* [B, N] segment ids or NULL */
  long long seg_s[2];          /* byte strides */
  const char *tree;            /* TREE bits u32 [B, L, ceil(L/32)] (device memory) */
  long long tree_s[2];         /* its byte strides of dims b (0: one tree for all) and i */
  const char *mask_arr;        /* ARRAY mask [B, H, L, N] */
  int mask_dtype;
  long long mask_s[4];         /* byte strides, 0 where broadcast */
  const float *sinks;          /* [H] or NULL */
  const char *q;
  int q_dtype;
  long long qs[4];
  char *out;
  int out_dtype;
  long long os[4];
  float *lse;                  /* [B, H, L] f32 log-sum-exp per row, or NULL */
  long long lse_s[3];          /* its byte strides */
  int lse_base2;               /* write lse / ln 2 (KVA_LSE_BASE2) */
  kvc_operand k, v;
  const int32_t *seq_lens;     /* [B] or NULL */
  /* fused plan */
  int lanes_log2;              /* log2 of lanes per token */
  int nsplit;                  /* token splits per (b, KV head) */
  long long chunk;             /* tokens per split */
  float *ws;                   /* partial states [nsplit][B][H][L][Dv + 2] */
  /* A Hadamard-rotated call run fused (kvattn.h KVA_ATTN_ROTATED_K / _V;
   * kva_cuda_rotate_fused): rot_q, the kernel rotates each query vector on
   * load, q' = H_Dk q in f32 (kva_hadamard's arithmetic) rounded once to
   * rot_qdt (the pass's q' dtype: q's, f32 for f32 q and exact calls), before
   * its own roundings; rot_out, each block rotates its combined f32 o,
   * o <- H_Dv o, before it stores it (kvc_emit_block): split states that the
   * plain merge takes as they are (it is linear), or with one split out =
   * H o / l. m and c: kva_hadamard_block and kva_hadamard_scale of Dk (q)
   * and Dv (out). */
  int rot_q, rot_qdt, rot_qm, rot_out, rot_om;
  float rot_qc, rot_oc;
  int ring_tok; /* the fused kernel's staged BLOCK_TABLE loop: table rows per ring slot (kvc_plan.ring) */
};

/* ---- element loads / stores ---- */
__device__ __forceinline__ float kvc_bf16_bits(uint32_t b) { return __uint_as_float(b << 16); }
__device__ __forceinline__ float kvc_f16_bits(uint32_t h) {
  return __half2float(__ushort_as_half((unsigned short)h));
}
/* Two fp8 codes (low byte: element 0) -> two f16 (low half: element 0),
 * exact: cvt.rn.f16x2.{e4m3x2,e5m2x2}, one instruction on sm_89 and later.
 * Elsewhere by fields: e5m2 is the high byte of an f16; e4m3 moves its
 * exponent and mantissa under the f16 ones (value / 2^8) and is scaled by
 * 2^8 in f16 (exact), with 0x7f (NaN) kept NaN. */
template <bool E4M3> __device__ __forceinline__ uint32_t kvc_fp8x2_f16x2(uint32_t two) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t r;
  const unsigned short v = (unsigned short)two;
  if (E4M3) asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
  else asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"(v));
  return r;
#else
  uint32_t r = 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t c = (two >> (8 * i)) & 0xffu;
    uint32_t h;
    if (!E4M3) {
      h = c << 8;
    } else if ((c & 0x7fu) == 0x7fu) {
      h = ((c & 0x80u) << 8) | 0x7e00u;
    } else {
      const __half x = __hmul(__ushort_as_half((unsigned short)(((c & 0x80u) << 8) | ((c & 0x7fu) << 7))),
                              __ushort_as_half((unsigned short)0x5c00u)); /* 2^8 */
      h = __half_as_ushort(x);
    }
    r |= h << (16 * i);
  }
  return r;
#endif
}
__device__ __forceinline__ float kvc_fp8_code(uint32_t c, int dt) {
  const uint32_t h = dt == KVA_F8E4M3 ? kvc_fp8x2_f16x2<true>(c) : kvc_fp8x2_f16x2<false>(c);
  return kvc_f16_bits(h & 0xffffu);
}
/* One element; fp8 as its code's value (the row's scale applied by the caller). */
__device__ __forceinline__ float kvc_load(const char *p, int dt) {
  switch (dt) {
  case KVA_F32: return *(const float *)p;
  case KVA_F16: return kvc_f16_bits(*(const unsigned short *)p);
  case KVA_BF16: return kvc_bf16_bits(*(const unsigned short *)p);
  case KVA_F8E4M3: case KVA_F8E5M2: return kvc_fp8_code(*(const unsigned char *)p, dt);
  default: return 0.0f;
  }
}
__device__ __forceinline__ void kvc_store(char *p, int dt, float x) {
  switch (dt) {
  case KVA_F32: *(float *)p = x; break;
  case KVA_F16: *(__half *)p = __float2half_rn(x); break;
  case KVA_BF16: *(__nv_bfloat16 *)p = __float2bfloat16_rn(x); break;
  default: break;
  }
}
__device__ __forceinline__ int kvc_dtype_size(int dt) {
  return dt == KVA_F32 ? 4 : dt == KVA_F8E4M3 || dt == KVA_F8E5M2 ? 1 : 2;
}

/* ---- addressing: one helper per formula ---- */
/* Rows of sequence b before its token 0 in its first table block (0 when
 * contiguous), clamped into [0, bsz). */
__device__ __forceinline__ int kvc_first_offset(const kvc_operand &op, int b) {
  if (!op.tbl || !op.fo) return 0;
  const int f = __ldg(op.fo + b);
  return f < 0 ? 0 : (f >= op.bsz ? op.bsz - 1 : f);
}
/* Where token t of sequence b lives: (outer index, row) such that its
 * address is base + outer * stride[0] + row * stride[2]. Contiguous: (b, t);
 * BLOCK_TABLE: (block, row in block) through the table. fo = kvc_first_offset. */
struct kvc_loc {
  long long outer, row;
};
/* Table row r = t + fo of a sequence sits in column r / bsz (a shift for
 * power-of-two blocks, bsh = log2(bsz), else a division), row r % bsz of
 * that column's block; a block id is clamped into [0, nblk). */
__device__ __forceinline__ long long kvc_table_col(long long r, int bsz, int bsh) {
  return bsh >= 0 ? r >> bsh : r / bsz;
}
__device__ __forceinline__ kvc_loc kvc_loc_of(int id, long long r, long long j, int bsz, int nblk) {
  kvc_loc l;
  l.outer = id < 0 ? 0 : (id >= nblk ? nblk - 1 : id);
  l.row = r - j * bsz;
  return l;
}
/* The table entry of token t of sequence b (the load alone, so a kernel can
 * issue it ahead of use), and the location from such an entry. */
__device__ __forceinline__ int kvc_table_id(const kvc_operand &op, int b, int fo, long long t) {
  return __ldg(op.tbl + b * op.tbl_rs + kvc_table_col(t + fo, op.bsz, op.bsh));
}
__device__ __forceinline__ kvc_loc kvc_table_loc_id(const kvc_operand &op, int fo, int id, long long t) {
  const long long r = t + fo;
  return kvc_loc_of(id, r, kvc_table_col(r, op.bsz, op.bsh), op.bsz, op.nblk);
}
/* Both steps in one, from a sequence's table row and the raw fields (the
 * fused kernel's per-lane form). */
__device__ __forceinline__ kvc_loc kvc_table_loc(const int32_t *tbl_row, int fo, int bsz, int bsh, int nblk,
                                                 long long t) {
  const long long r = t + fo, j = kvc_table_col(r, bsz, bsh);
  return kvc_loc_of(__ldg(tbl_row + j), r, j, bsz, nblk);
}
__device__ __forceinline__ kvc_loc kvc_locate(const kvc_operand &op, int b, int fo, long long t) {
  if (op.tbl) return kvc_table_loc_id(op, fo, kvc_table_id(op, b, fo, t), t);
  kvc_loc l;
  l.outer = b;
  l.row = t;
  return l;
}
__device__ __forceinline__ const char *kvc_row(const kvc_operand &op, int b, int h, long long t) {
  const kvc_loc l = kvc_locate(op, b, kvc_first_offset(op, b), t);
  return op.data + l.outer * op.ds[0] + h * op.ds[1] + l.row * op.ds[2];
}
__device__ __forceinline__ const char *kvc_srow(const kvc_operand &op, int b, int h, long long t) {
  const kvc_loc l = kvc_locate(op, b, kvc_first_offset(op, b), t);
  return op.scales + l.outer * op.ss[0] + h * op.ss[1] + l.row * op.ss[2];
}
__device__ __forceinline__ const char *kvc_brow(const kvc_operand &op, int b, int h, long long t) {
  const kvc_loc l = kvc_locate(op, b, kvc_first_offset(op, b), t);
  return op.biases + l.outer * op.bs[0] + h * op.bs[1] + l.row * op.bs[2];
}
__device__ __forceinline__ const char *kvc_q_at(const kvc_args &a, int b, int h, int i, int d) {
  return a.q + b * a.qs[0] + h * a.qs[1] + i * a.qs[2] + d * a.qs[3];
}
/* A rotated call's query on load (a.rot_q): x[0 .. DPT) of each of the TPQ
 * adjacent lanes t = 0 .. TPQ - 1 of one vector (lane t holds dims t DPT ..
 * t DPT + DPT - 1 of the 16-bit query, bf16 or f16 as a.q_dtype, D = TPQ DPT
 * a power of two) <- H_D q rounded to that type (a.rot_qdt is q's dtype
 * here), the transform in f32 in kva_hadamard's operation order (stages
 * h = 1, 2, .., D / 2: in the lane for h < DPT, with lane t ^ (h / DPT) by a
 * shuffle beyond; the lower element of a pair takes a + b, the upper a - b;
 * then one multiply by c), so q' equals the pass's bit for bit (NaN payloads
 * aside). All lanes of the warp take part (the shuffles). */
template <int DPT, int TPQ>
__device__ __forceinline__ void kvc_rotate_query16(const kvc_args &a, int t, unsigned short (&x)[DPT]) {
  const bool f16 = a.q_dtype == KVA_F16;
  float u[DPT];
#pragma unroll
  for (int d = 0; d < DPT; ++d) u[d] = f16 ? kvc_f16_bits(x[d]) : kvc_bf16_bits(x[d]);
#pragma unroll
  for (int h = 1; h < DPT; h <<= 1)
#pragma unroll
    for (int d = 0; d < DPT; ++d)
      if ((d & h) == 0) {
        const float p = u[d], q = u[d + h];
        u[d] = __fadd_rn(p, q);
        u[d + h] = __fsub_rn(p, q);
      }
#pragma unroll
  for (int o = 1; o < TPQ; o <<= 1) {
    const bool upper = (t & o) != 0;
#pragma unroll
    for (int d = 0; d < DPT; ++d) {
      const float y = __shfl_xor_sync(KVC_FULL_MASK, u[d], o);
      u[d] = upper ? __fsub_rn(y, u[d]) : __fadd_rn(u[d], y);
    }
  }
#pragma unroll
  for (int d = 0; d < DPT; ++d) {
    const float y = __fmul_rn(u[d], a.rot_qc);
    x[d] = f16 ? __half_as_ushort(__float2half_rn(y)) : __bfloat16_as_ushort(__float2bfloat16_rn(y));
  }
}
/* A rotated call's query vectors q0 .. q0 + nrows - 1 of KV head hk (a.rot_q,
 * bf16 or f16 queries, D a power of two, 64 <= D): one warp per vector (rows
 * warp, warp + nwarps, ..; the whole warp takes each row, so the shuffles
 * see every lane), lane t with dims t D / 32 .. of the 16-bit query, rotated
 * by kvc_rotate_query16; store(r, d, x) takes element d of row r (16-bit
 * bits; zeros for vectors at or past Q). */
template <int D, typename Store>
__device__ __forceinline__ void kvc_rotated_query_rows(const kvc_args &a, int b, int hk, int q0, int nrows, int Q,
                                                       int warp, int nwarps, int lane, Store store) {
  constexpr int DPT = D / KVC_WARP;
  const long long qds = a.qs[3] / 2; /* 16-bit elements between dims */
  for (int r = warp; r < nrows; r += nwarps) {
    const int qv = q0 + r; /* warp-uniform */
    unsigned short x[DPT];
    const unsigned short *qp =
        qv < Q ? (const unsigned short *)kvc_q_at(a, b, hk * a.rep + qv / a.L, qv % a.L, 0) : nullptr;
#pragma unroll
    for (int d = 0; d < DPT; ++d) x[d] = qp ? qp[(lane * DPT + d) * qds] : (unsigned short)0;
    if (qp) kvc_rotate_query16<DPT, KVC_WARP>(a, lane, x);
#pragma unroll
    for (int d = 0; d < DPT; ++d) store(r, lane * DPT + d, x[d]);
  }
}
/* The tensor-core kernels' query staging: thread pd / DPT of query vector
 * qv (one of TPQ adjacent lanes per vector) copies dims pd .. pd + DPT - 1
 * of the bf16 query (zeros when qv >= Q) into row (bf16, shared memory) and
 * returns the vector's max |q| (over its TPQ threads) and the sum of its
 * quantization group (over the tpg threads of the group) by shuffles; a
 * rotated call's query (a.rot_q) rotated first (kvc_rotate_query16 over
 * the vector's TPV adjacent lanes, D = TPV DPT; TPV = TPQ unless max |q|
 * is taken over fewer lanes). */
template <int DPT, int TPQ, int TPV = TPQ>
__device__ __forceinline__ void kvc_stage_query(const kvc_args &a, int b, int hk, int qv, int Q, int pd, int tpg,
                                                unsigned short *row, float *amax_out, float *sum_out) {
  const long long qds = a.qs[3] / 2; /* bf16 elements between dims */
  const unsigned short *qp =
      qv < Q ? (const unsigned short *)kvc_q_at(a, b, hk * a.rep + qv / a.L, qv % a.L, 0) : nullptr;
  float amax = 0.0f, sum = 0.0f;
  unsigned short xs[DPT];
#pragma unroll
  for (int d = 0; d < DPT; ++d) xs[d] = qp ? qp[(pd + d) * qds] : (unsigned short)0;
  if (a.rot_q) kvc_rotate_query16<DPT, TPV>(a, pd / DPT, xs);
#pragma unroll
  for (int d = 0; d < DPT; ++d) {
    const unsigned short x = xs[d];
    row[pd + d] = x;
    amax = fmaxf(amax, fabsf(kvc_bf16_bits(x)));
    sum += kvc_bf16_bits(x);
  }
#pragma unroll
  for (int off = TPQ / 2; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(KVC_FULL_MASK, amax, off));
  for (int off = 1; off < tpg; off <<= 1) sum += __shfl_xor_sync(KVC_FULL_MASK, sum, off);
  *amax_out = amax;
  *sum_out = sum;
}
/* sigma of a query vector with max |q| = amax: q / sigma fits 127 * 128
 * (two s8 parts); 1 for a zero or non-finite q (NaN / Inf reach the output
 * through the group sums). */
__device__ __forceinline__ float kvc_query_sigma(float amax) {
  return amax > 0.0f && amax <= 3.0e38f ? amax / 16256.0f : 1.0f;
}
/* sigma of one query group for one s8 part: q / sigma fits 127 (the
 * oracle's q int8 rounding, kva_ref_rounding); 1 for a zero or non-finite
 * max. */
__device__ __forceinline__ float kvc_query_sigma8(float amax) {
  return amax > 0.0f && amax <= 3.0e38f ? amax / 127.0f : 1.0f;
}
__device__ __forceinline__ char *kvc_out_at(const kvc_args &a, int b, int h, int i, int d) {
  return a.out + b * a.os[0] + h * a.os[1] + i * a.os[2] + d * a.os[3];
}
/* The lse of row (b, h, i) from a final max and sum in log2 units (M2,
 * sink joined, and its sum L2 = sum exp2(s log2e - M2)): lse2 = M2 + log2 L2,
 * stored as lse2 ln 2 (natural log) or lse2 (base 2); -inf for an empty row.
 * The natural-log form takes m in natural units: kvc_store_lse_ln. */
__device__ __forceinline__ void kvc_store_lse2(const kvc_args &a, int b, int h, int i, float M2, float L2) {
  const float lse2 = M2 == -INFINITY ? -INFINITY : M2 + log2f(L2);
  *(float *)((char *)a.lse + b * a.lse_s[0] + h * a.lse_s[1] + i * a.lse_s[2]) = a.lse_base2 ? lse2 : lse2 * KVC_LN2;
}
__device__ __forceinline__ void kvc_store_lse_ln(const kvc_args &a, int b, int h, int i, float m, float l) {
  const float lse = m == -INFINITY ? -INFINITY : m + logf(l);
  *(float *)((char *)a.lse + b * a.lse_s[0] + h * a.lse_s[1] + i * a.lse_s[2]) = a.lse_base2 ? lse * KVC_LOG2E : lse;
}
/* Partial state of split s for query row (b, h, i): [m, l, o[Dv]] floats. */
__device__ __forceinline__ float *kvc_state_at(const kvc_args &a, int s, int b, int h, int i) {
  size_t idx = (((size_t)s * a.B + b) * a.H + h) * a.L + i;
  return a.ws + idx * (size_t)KVA_STATE_FLOATS(a.Dv);
}
__device__ __forceinline__ int32_t kvc_seg_at(const kvc_args &a, int b, long long t) {
  return *(const int32_t *)((const char *)a.seg + b * a.seg_s[0] + t * a.seg_s[1]);
}
__device__ __forceinline__ const char *kvc_mask_at(const kvc_args &a, int b, int h, int i, long long t) {
  return a.mask_arr + b * a.mask_s[0] + h * a.mask_s[1] + i * a.mask_s[2] + t * a.mask_s[3];
}

/* Element d of one K/V row (any format; the general path's load). */
__device__ __forceinline__ float kvc_kv_elem(const kvc_operand &op, int b, int h, long long t, int d) {
  const char *row = kvc_row(op, b, h, t);
  if (op.bits == 0 && op.scales) /* fp8 rows with scales: scale * code */
    return *(const float *)kvc_srow(op, b, h, t) * kvc_load(row + d, op.dtype);
  if (op.bits == 0) return kvc_load(row + d * kvc_dtype_size(op.dtype), op.dtype);
  int per = 32 / op.bits;
  uint32_t w = *(const uint32_t *)(row + (d / per) * 4);
  uint32_t code = (w >> ((d % per) * op.bits)) & ((1u << op.bits) - 1u);
  int g = d / op.group, es = kvc_dtype_size(op.sdtype);
  float s = kvc_load(kvc_srow(op, b, h, t) + g * es, op.sdtype);
  float bias = kvc_load(kvc_brow(op, b, h, t) + g * es, op.sdtype);
  return fmaf(s, (float)code, bias);
}

/* Cache length of sequence b, clamped into [0, N] (BLOCK_TABLE: into
 * [0, N - first_offset]; lengths live on the device and cannot be validated
 * on the host; out-of-range values never fault). */
__device__ __forceinline__ long long kvc_seq_len(const kvc_args &a, int b) {
  if (!a.seq_lens) return a.N;
  long long n = a.seq_lens[b];
  const long long hi = a.N - kvc_first_offset(a.k, b);
  return n < 0 ? 0 : (n > hi ? hi : n);
}

/* The causal family: CAUSAL, and TREE (CAUSAL on the prefix, bits on the
 * L new keys). */
__device__ __forceinline__ bool kvc_causal_family(const kvc_args &a) {
  return a.mask_kind == KVA_MASK_CAUSAL || a.mask_kind == KVA_MASK_TREE;
}
/* The causal-family rule (docs/semantics.md): row at position p sees key t iff
 * t <= p and (no window or t > p - w), or seg[t] == seg[p] != 0 (and, with
 * clamp, t > p - w). segp = seg[p] (0 when there are no segments). TREE: a
 * new key t >= n0 = len - L is visible iff bit t - n0 of row i = p - n0 is
 * set (bits >= L are never asked); the prefix follows the rule above. */
__device__ __forceinline__ bool kvc_causal_visible(const kvc_args &a, int b, long long t, long long p,
                                                   int32_t segp, long long len) {
  const long long n0 = len - a.L;
  if (a.mask_kind == KVA_MASK_TREE && t >= n0) {
    const long long j = t - n0;
    const uint32_t w = __ldg((const uint32_t *)(a.tree + b * a.tree_s[0] + (p - n0) * a.tree_s[1]) + (j >> 5));
    return (w >> (j & 31)) & 1u;
  }
  bool in_window = a.window <= 0 || t > p - a.window;
  if (t <= p && in_window) return true;
  if (segp != 0 && (!a.clamp || in_window) && kvc_seg_at(a, b, t) == segp) return true;
  return false;
}
__device__ __forceinline__ int32_t kvc_seg_of_row(const kvc_args &a, int b, long long p) {
  return (kvc_causal_family(a) && a.seg && p >= 0) ? kvc_seg_at(a, b, p) : 0;
}

/* This block's query tile (kernels that take long L: fused, narrow / wide
 * tensor-core, warpgroup): the grid's x index in reverse, so that with
 * causal long L (prefill) the later tiles, which see the most keys
 * (kvc_split_range), are scheduled first and the short ones fill the tail;
 * decode and verify have one tile, or tiles of equal work. */
__device__ __forceinline__ int kvc_qtile() { return (int)(gridDim.x - 1 - blockIdx.x); }

/* The token range [*t_lo, *t_hi) of a split of a.chunk tokens that a block's
 * query vectors q0 .. q0 + nq - 1 (vector v: row v % L of head v / L) can
 * see. Causal family without segments: keys before the first row's sliding
 * window skipped, and after the last row's position; the rows are those of
 * one head when the block's vectors are (long L: a query tile of one head's
 * rows, as chunked prefill), else all L. TREE: rows 0 .. L - 1 (row 0's
 * window bound lies before the new keys, which follow the bits). */
__device__ __forceinline__ void kvc_split_range(const kvc_args &a, int split, long long len, int q0, int nq,
                                                long long *t_lo, long long *t_hi) {
  *t_lo = (long long)split * a.chunk;
  *t_hi = min(*t_lo + a.chunk, len);
  if (!kvc_causal_family(a) || a.seg) return;
  const int v1 = min(q0 + nq, a.rep * a.L) - 1;
  const bool one = a.mask_kind == KVA_MASK_CAUSAL && q0 / a.L == v1 / a.L;
  const long long r_lo = one ? q0 % a.L : 0, r_hi = one ? v1 % a.L : a.L - 1;
  *t_hi = min(*t_hi, len - a.L + r_hi + 1); /* TREE: r_hi = L - 1, t_hi <= len */
  if (a.window > 0) *t_lo = max(*t_lo, len - a.L + r_lo - a.window + 1);
}
/* Are keys t0 .. t0 + n - 1 all inside the split (below t_hi) and visible
 * to every row (no mask, or causal without segments and inside each row's
 * window; TREE: prefix keys only, inside the windows)? Then a kernel skips
 * the per-key mask test (the common case). */
__device__ __forceinline__ bool kvc_keys_all_visible(const kvc_args &a, long long t0, int n, long long t_hi,
                                                     long long len) {
  const long long upto = a.mask_kind == KVA_MASK_TREE ? len - a.L - 1 : len - a.L; /* kva_causal_all_upto */
  return t0 + n <= t_hi &&
         (a.mask_kind == KVA_MASK_NONE ||
          (kvc_causal_family(a) && !a.seg && t0 + n - 1 <= upto && (a.window <= 0 || t0 > len - 1 - a.window)));
}

/* scale, then softcap: the logit in natural units. */
__device__ __forceinline__ float kvc_logit(const kvc_args &a, float dot) {
  float x = a.scale * dot;
  if (a.softcap > 0.0f) x = a.softcap * tanhf(x * a.softcap_inv);
  return x;
}

/* NaN-propagating max (a NaN logit makes the row NaN, as in the oracle):
 * one max.NaN instruction from sm_80 on. */
__device__ __forceinline__ float kvc_max(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
#else
  return (a > b || a != a) ? a : b;
#endif
}

/* Final output element of a state {m, l, o} after the sink joined:
 * o / l, or 0 for a row that saw no key (kva_softmax_out). */
__device__ __forceinline__ float kvc_finish(float o, float l) {
  return (l > 0.0f || l != l) ? o / l : 0.0f;
}
#endif
