/* Helpers for attention tests: random operands built from a printable case,
 * strided views into padded buffers, sentinels after outputs, and the
 * comparison with the oracle (NaN/Inf positions exact, then max error and
 * relative L2). Shared by the CPU, paged and CUDA test files. */
#ifndef KVA_ATTN_CHECK_H
#define KVA_ATTN_CHECK_H

#include "test.h"

/* MASK_TREE: KVA_MASK_TREE with window c->window over random trees
 * (att_random_tree: sequence b of depth L, 1 or random for b % 3 = 0, 1,
 * 2; strided cases broadcast one tree over the batch and pad its rows);
 * MASK_TREE_SEG: the same with segments on the prefix (clamped when
 * c->window > 0). */
enum { MASK_NONE, MASK_CAUSAL, MASK_WINDOW, MASK_SEG, MASK_SEG_CLAMP, MASK_BOOL, MASK_ADD, MASK_TREE, MASK_TREE_SEG };
extern const char *const mask_names[];

typedef struct att_case {
  int B, H, KVH, L;
  int64_t N;
  int Dk, Dv;
  kva_dtype qdt, odt;
  int kbits, vbits, group; /* bits 0 = float K/V of dtype kvdt */
  kva_dtype kvdt;          /* float K/V dtype, or the scales/biases dtype */
  int mask, window;
  float softcap;
  int sinks, ragged, strided;
} att_case;
/* kvdt fp8 (KVA_F8E4M3 / KVA_F8E5M2) with kbits = vbits = 0: K and V fp8
 * rows, and `group` (unused by float rows) names their scales:
 * ATT_FP8_TOKEN per-(token, head) scales [B, KVH, N, 1] (a strided view when
 * strided), ATT_FP8_TENSOR one scale for all (strides 0), ATT_FP8_NONE
 * none (scale 1). */
enum { ATT_FP8_TOKEN, ATT_FP8_TENSOR, ATT_FP8_NONE };
/* The query variants every oracle table runs each case with (att_make_q):
 * 0 random queries, 1 peaked probes. */
#define ATT_PROBES 2
extern const char *const att_query_names[ATT_PROBES]; /* "random", "probe" */

/* One case's operands (host memory). */
typedef struct att_data {
  att_case c;
  int probe; /* the queries are peaked probes (att_make_q) */
  kva_tensor q, out;
  kva_kv k, v;
  int32_t *lens;
  kva_tensor segments, array;
  float *sinks;
  kva_attn_params params;
  kva_kv_view view;
  void *bufs[24];
  int nbufs;
  void *out_buf;    /* the buffer out views into (guards of 64 bytes before and after it) */
  size_t out_bytes; /* its bytes, between the guards */
  unsigned char *out_image; /* out_buf as att_poison left it */
} att_data;

void att_case_str(const att_case *c, char *buf, size_t n);
/* Builds fresh random operands; returns 0 or -1 (allocation failure). */
int att_make(att_data *d, const att_case *c);
/* The same with query variant probe (ATT_PROBES): 0 as att_make, 1 every query vector is a probe aligned with one key of its
 * row, q = a * k_j (the dequantized K row), so that key takes ~90 % of the
 * row's softmax weight (the softmax of random queries is diffuse and would
 * hide a kernel that sees one key too many or too few): per vector, at
 * random, j = the row's own key p (the last it sees), a random key of its
 * causal window, or p + 1 (the first key the causal mask hides; the own key
 * for the last row). a = T / (scale |k_j|^2), T the logit for which the
 * other n - 1 visible keys' logits, ~N(0, T^2 / Dk) for random keys, leave
 * 0.9 to key j: T - T^2 / (2 Dk) = ln(9 n). */
int att_make_q(att_data *d, const att_case *c, int probe);
void att_free(att_data *d);
/* Poisons out's elements (NaN pattern), sets its padding (strided views)
 * to make_view's 0x7f pattern and re-arms the guards before and after. */
void att_poison(att_data *d);
/* The guards before and after out's buffer intact since att_poison (prints
 * what was hit). */
int att_sentinel_ok(const att_data *d);
/* Nothing written outside out's elements since att_poison: the guards and
 * the padding between its rows (strided views) intact. (Not for calls whose
 * out descriptor differs from d->out: the mutation tests.) */
int att_out_untouched_ok(const att_data *d);
/* Every byte of out's buffer outside its elements equals pad (a device
 * output poisoned whole with pad, fetched into out_buf). */
int att_out_padding_is(const att_data *d, unsigned char pad);
/* NaN in every K/V row no query row sees: past each sequence's length and,
 * with a window, before row 0's window (a paged engine's freed or never
 * written blocks): the row itself for float formats, its scale and bias
 * entries for quantized ones (the codes hold no NaN). The oracle never
 * reads them, so any NaN in a kernel's output is a read it must not make. */
void att_plant_unseen(att_data *d);
/* x (NaN, Inf) in the V row of each sequence's last key, the key only the
 * last query row sees when L > 1 (causal): element 0 for float rows, group
 * 0's scale for quantized ones. */
void att_plant_last_v(att_data *d, float x);
/* Compares out with ref (same shape): NaN/Inf exact, then
 * |out - ref| <= atol_rel * max|ref| + rtol * |ref| everywhere.
 * Prints the first mismatch, then the count, the max error and the worst
 * err / allowed ratio. Returns 1 when within tolerance. */
int att_compare(const kva_tensor *out, const kva_tensor *ref, double atol_rel, double rtol, double *max_err,
                double *rel_l2);
/* Absolute allowance, relative to max|ref|, for the arithmetic of the kernel
 * that runs against the oracle with the kernel's modelled roundings
 * (att_kernel_reference), read from the trailing bracket of its name
 * (kva_attention_kernel, kvattn.h): "[exact f32]", "q intN" with N >=
 * ATT_QINT_EXACT_BITS (q rounded below 2^-20 of its largest element) and
 * "q intN" with N <= ATT_QINT_ORACLE_BITS (the oracle applies that very
 * rounding): f32 products over up to a few thousand keys against the double
 * oracle (3e-5); any operand rounded to bf16 or f16, and q rounded to bits
 * in between (always paired with a 16-bit P): bf16 products (2^-7; f16 is
 * not given a tighter allowance); "P int16": ATT_ATOL_PINT16. The largest
 * over the bracket's items. */
#define ATT_ATOL_F32 3e-5
#define ATT_ATOL_BF16 (1.0 / 128)
#define ATT_QINT_EXACT_BITS 21
/* "P int16" (kvattn.h: p times the V group scale rounded to s16 per (query
 * vector, tile of 32 keys, group), each weight within 1 / 32767.5 of its
 * tile's largest): per tile at most 32 / 32767.5 of the tile's largest weight times
 * the group's code span |s| (2^bits - 1), the tiles' largest weights summing
 * to at most the softmax denominator, so |out - ref| <= 2^-10 * span <=
 * 2^-9 max|v|: the form of the bf16-P bound (2^-9 of each weight times
 * |v|), with the same 4x margin that ATT_ATOL_BF16 takes over it. */
#define ATT_ATOL_PINT16 (1.0 / 256)
/* The allowance of a kernel name; -1 (fails every comparison) when the name
 * has no bracket or one this table does not know. */
double att_name_atol(const char *name);
/* The kernel name ends in "[exact f32]" (what KVA_ATTN_EXACT promises). */
int att_name_exact(const char *name);
/* The allowance of the kernel kva_attention(ctx, q, kv, params, out) runs
 * (ask after att_set_pass: the pass picks the kernel); -1 on error (printed). */
double att_kernel_atol(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *params,
                       const kva_tensor *out);
/* The roundings of a kernel name's bracket that the oracle models
 * (kva_ref_rounding): "K ..."/"V ..." items of bf16 or f16 round K / V, "q
 * intN" with N <= ATT_QINT_ORACLE_BITS rounds the query per (vector, group);
 * "q bf16" / "q f16" (a rotated call's query H q rounded to 16 bits) sets
 * q_dtype (the oracle applies it: the f32 allowance); q rounded to more bits
 * (the two-part 15-bit queries: one scale per vector)
 * and P are left to the allowance. Returns 0, or -1 for
 * a name without a bracket. */
#define ATT_QINT_ORACLE_BITS 8
int att_name_rounding(const char *name, kva_ref_rounding *r);
/* The oracle for the kernel that kva_attention(ctx, kq, kkv, kp, kout) runs
 * (the descriptors the kernel gets: device ones on CUDA), computed on the
 * host descriptors q, kv, p with that kernel's modelled roundings
 * (att_name_rounding) into ref. 0, or the failing call's status (printed). */
int att_kernel_reference(kva_context *ctx, const kva_tensor *kq, const kva_kv_view *kkv, const kva_attn_params *kp,
                         const kva_tensor *kout, const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *p,
                         kva_tensor *ref);
/* The same for a case's base call over a contiguous cache on the default CPU
 * context and the current SIMD level (for callers without the call at hand:
 * the mutation tests). */
double att_case_atol(const att_case *c);
/* The oracle to compare a host call kva_attention(ctx, q, kv, p, out) with:
 * exact, the caller's (from kva_reference_attention), when the kernel that
 * runs models no rounding (att_name_rounding), else the oracle with its
 * roundings, computed into scratch (out's shape and dtype). Returns exact
 * or scratch; NULL on error (printed). Ask after att_set_pass (the pass
 * picks the kernel). */
const kva_tensor *att_oracle_for(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *p,
                                 const kva_tensor *out, const kva_tensor *exact, kva_tensor *scratch);
/* Output-dtype rounding allowance: relative half-ulp-ish bound per element. */
double att_rtol(kva_dtype out);
/* A second output tensor of the same shape/dtype (contiguous, owned by d). */
kva_tensor att_alloc_like(att_data *d, const kva_tensor *t);

/* The caller-owned block pools of a case (KVA_LAYOUT_BLOCK_TABLE, host
 * memory): d's K/V rows copied into pools [nblk, KVH, bs, W] of the same
 * formats with padded strides (every other byte `fill`: 0xff is NaN in every
 * float dtype, so a row read by mistake shows in the output),
 * blocks a random permutation of the pool, a random first offset per
 * sequence, table columns past a sequence's last block -1 and one spare
 * column (max_blocks = the longest sequence's blocks + 1). view reads the
 * same tokens as d.view. */
typedef struct att_table {
  kva_kv k, v; /* the pools */
  void *mem[6];
  int32_t *blocks, *lens, *fo;
  int64_t nblk, bs;
  kva_block_table t;
  kva_kv_view view;
} att_table;
/* A random tree of L <= KVA_TREE_MAX_ROWS nodes of exactly `depth` levels
 * (1..L): node j's parent among 0..j-1 (-1: a root; depth 1 makes every node
 * a root), drawn by the test generator. */
void att_random_tree(int L, int depth, int *parent);
/* Its KVA_MASK_TREE rows: row i sees itself and its ancestors; row i at
 * bits + i * row_words (ceil(L / 32) words written). */
void att_tree_bits(int L, const int *parent, uint32_t *bits, int64_t row_words);
/* Random bits in place of a MASK_TREE case's trees: a quarter of the rows
 * see no new token, the others each new token (earlier or later) with
 * probability 1/3; with window 1 a row without bits sees no key at all. */
void att_tree_random_bits(att_data *d);
/* Bit j of row i of sequence b of KVA_MASK_TREE bits t ([B or 1, L, W] u32). */
int att_tree_bit(const kva_tensor *t, int64_t b, int64_t i, int64_t j);
/* The explicit mask equal to a MASK_TREE case's mask (d->params, TREE):
 * bool [B, 1, L, N] (broadcast over heads; memory owned by d), row i of
 * sequence b at p = len - L + i seeing key t < len - L iff t <= p inside
 * the window, or by its image segment (clamped to the window with the
 * clamp), and key len - L + j iff bit j of its row is set. data NULL when
 * out of memory. */
kva_tensor att_tree_array(att_data *d);
/* perm = a random permutation of 0..n-1 (the test generator) */
void att_random_perm(int32_t *perm, int64_t n);
int att_table_make(att_table *tb, const att_data *d, int64_t bs, unsigned char fill);
/* The same with every row stride a multiple of 16 bytes (16-bit rows padded
 * by 16 bytes rather than 8: the rows the CUDA backend's vector kernels take). */
int att_table_make_aligned(att_table *tb, const att_data *d, int64_t bs, unsigned char fill);
void att_table_free(att_table *tb);

/* Random mutations of descriptors for the bad-input tests (test_mutations.c,
 * test_cache_write.c). A mutation never makes a view larger than its buffer
 * by accident: shapes only shrink or become absurd (att_absurd: a distinct
 * huge value each time, so two mutations never agree by chance), strides
 * only become invalid (negative, zero, overlapping, misaligned) or absurd
 * (2^40 .. 2^63: a dim of more than one element then spans 2^62 bytes and
 * more, refused: KVA_MAX_SPAN; on a dim of one element it is unused); ranks, dtypes, pointers,
 * bits and group sizes take valid and invalid values. */
int64_t att_absurd(void);
int att_pick(int n); /* 0 .. n-1 */
void att_mutate_tensor(kva_tensor *t);
void att_mutate_kv(kva_kv *kv); /* its data, scales or biases tensor, bits or group size */
/* The CPU passes of the oracle tests: pass 0..3 the SIMD levels portable,
 * avx2, avx512, avxvnni (those this CPU has), pass 4 the general kernel
 * alone at the best level (kva_cpu_general_only: the fallback path's kernel, which
 * otherwise runs only for array masks and long L). att_set_pass returns
 * nonzero when the pass does not apply on this CPU, and then prints a skip
 * line naming the level (once per test); att_end_passes restores the
 * defaults. */
#define ATT_PASSES 5
int att_set_pass(int pass);
const char *att_pass_name(int pass);
const char *att_pass_now(void); /* the current pass's name (the SIMD level outside passes) */
void att_end_passes(void);
#endif
