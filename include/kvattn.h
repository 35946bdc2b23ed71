/* kvattn — fused attention of a few query rows over a long, possibly quantized
 * and/or paged, KV cache (LLM decode and speculative verify).
 *
 * Example (CPU, one sequence, 4-bit cache, causal decode of one row):
 *
 *   kva_context *ctx;  kva_context_create(&ctx, NULL);          // CPU, all cores
 *   kva_tensor q   = kva_tensor_4d(qbuf, KVA_BF16, 1, H, 1, D);
 *   kva_kv k = kva_kv_quantized(kp, ks, kb, KVA_BF16, 4, 64, 1, KVH, N, D);
 *   kva_kv v = kva_kv_quantized(vp, vs, vb, KVA_BF16, 4, 64, 1, KVH, N, D);
 *   kva_kv_view view = kva_view_contiguous(&k, &v, NULL);       // all sequences length N
 *   kva_attn_params p = kva_attn_defaults();  p.mask.kind = KVA_MASK_CAUSAL;
 *   kva_tensor out = kva_tensor_4d(obuf, KVA_BF16, 1, H, 1, D);
 *   int rc = kva_attention(ctx, &q, &view, &p, &out, NULL, 0);
 *   if (rc < 0) fprintf(stderr, "%s\n", kva_last_error());
 *
 * Conventions: every function returns 0 or a negative kva_status; on error
 * nothing the caller owns is modified and kva_last_error() (thread-local)
 * names the argument. Strides are in bytes; the innermost dimension of every
 * tensor must be contiguous. Shapes below are written [dim0, dim1, ...].
 *
 * ABI rule: within a major version, functions and enum values are only added;
 * struct layouts change only with the major version.
 */
#ifndef KVATTN_H
#define KVATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVA_VERSION_MAJOR 0
#define KVA_VERSION_MINOR 3
#define KVA_VERSION_PATCH 0
#define KVA_VERSION_HEX ((KVA_VERSION_MAJOR << 16) | (KVA_VERSION_MINOR << 8) | KVA_VERSION_PATCH)

/* "MAJOR.MINOR.PATCH" of the library actually linked. */
const char *kva_version(void);
/* One line describing the build (compiler, SIMD levels compiled, CUDA targets). */
const char *kva_build_info(void);

/* ---------------------------------------------------------------- errors */
/* X(name, value, message): the one list behind kva_status and kva_strerror. */
#define KVA_STATUS_LIST(X)                                                       \
  X(OK, 0, "success")                                                            \
  X(EINVAL, -1, "invalid argument")                                              \
  X(ESHAPE, -2, "shape mismatch")                                                \
  X(EDTYPE, -3, "unsupported or mismatched dtype")                               \
  X(ESTRIDE, -4, "invalid strides")                                              \
  X(EUNSUPPORTED, -5, "unsupported configuration")                               \
  X(ENOMEM, -6, "out of memory")                                                 \
  X(ENOBLOCKS, -7, "block pool exhausted")                                       \
  X(ENOSEQ, -8, "unknown or freed sequence")                                     \
  X(EWORKSPACE, -9, "workspace too small")                                       \
  X(ENODEVICE, -10, "backend or device not available")                           \
  X(ECUDA, -11, "CUDA runtime error")                                            \
  X(EINTERNAL, -12, "internal error")

typedef enum kva_status {
#define KVA_X_ENUM(name, value, msg) KVA_##name = value,
  KVA_STATUS_LIST(KVA_X_ENUM)
#undef KVA_X_ENUM
} kva_status;

/* Static message of a status code ("unknown error" for other values). */
const char *kva_strerror(int status);
/* Message of the last error on this thread: names the offending argument. */
const char *kva_last_error(void);

/* --------------------------------------------------------------- tensors */
typedef enum kva_dtype {
  KVA_F32 = 0,
  KVA_F16 = 1,
  KVA_BF16 = 2,
  KVA_U32 = 3,  /* packed quantized words */
  KVA_I32 = 4,  /* segment ids, lengths */
  KVA_BOOL = 5, /* one byte, 0 or non-zero: explicit masks */
  /* fp8 K/V elements (kva_kv with bits == 0 only; never q, out or masks):
   * OCP e4m3fn (sign, 4 exponent bits with bias 7, 3 mantissa bits; no inf,
   * 0x7f / 0xff are NaN, max 448, smallest subnormal 2^-9), the bits of
   * PyTorch's torch.float8_e4m3fn and ml_dtypes' float8_e4m3fn. */
  KVA_F8E4M3 = 6,
  /* e5m2 (bias 15, 2 mantissa bits, IEEE-like: 0x7c inf, 0x7d..0x7f NaN,
   * max 57344, smallest subnormal 2^-16): torch.float8_e5m2; the high byte
   * of an f16. */
  KVA_F8E5M2 = 7,
} kva_dtype;

/* Bytes of one element (0 for an unknown dtype). */
size_t kva_dtype_size(kva_dtype dt);
const char *kva_dtype_name(kva_dtype dt);

#define KVA_MAX_DIMS 4
/* A strided view of memory. data aligned to the element size; stride[] in
 * bytes, each a multiple of the element size; stride[ndim-1] == element
 * size; a view spans less than 2^62 bytes. */
typedef struct kva_tensor {
  void *data;
  kva_dtype dtype;
  int ndim;
  int64_t shape[KVA_MAX_DIMS];
  int64_t stride[KVA_MAX_DIMS];
} kva_tensor;

/* Contiguous (row-major) descriptors. */
kva_tensor kva_tensor_1d(void *data, kva_dtype dt, int64_t n0);
kva_tensor kva_tensor_2d(void *data, kva_dtype dt, int64_t n0, int64_t n1);
kva_tensor kva_tensor_4d(void *data, kva_dtype dt, int64_t n0, int64_t n1, int64_t n2, int64_t n3);

/* Exact conversions, round to nearest even (NaN stays NaN, overflow -> inf). */
uint16_t kva_f32_to_f16(float x);
float kva_f16_to_f32(uint16_t h);
uint16_t kva_f32_to_bf16(float x);
float kva_bf16_to_f32(uint16_t b);
/* f32 <-> fp8, exact: round to nearest even, saturating: a finite value
 * beyond the largest finite code, and +-inf, become +-max (448 for e4m3,
 * 57344 for e5m2); NaN becomes a NaN code of its sign (0x7f / 0xff for
 * both); -0 keeps its sign. For |x| up to the largest finite value plus
 * half a step (464 / 61440) the bits are those of PyTorch's
 * x.to(torch.float8_e4m3fn / float8_e5m2); beyond that torch gives NaN (e4m3)
 * or inf (e5m2) where these saturate. fp8 -> f32 is exact. */
uint8_t kva_f32_to_f8e4m3(float x);
float kva_f8e4m3_to_f32(uint8_t c);
uint8_t kva_f32_to_f8e5m2(float x);
float kva_f8e5m2_to_f32(uint8_t c);
/* Elementwise dtype conversion between same-shape f32/f16/bf16 tensors. */
int kva_convert(const kva_tensor *src, kva_tensor *dst);

/* ---------------------------------------------------- K/V cache operands */
/* One K or V cache of a batch, float, fp8 or MLX-affine quantized.
 *   bits == 0: data is f32/f16/bf16 [B, KVH, N, D] (scales, biases unused),
 *   or fp8 (KVA_F8E4M3 / KVA_F8E5M2) [B, KVH, N, D] with scales f32
 *   [B, KVH, N, 1]: one scale per (token, head), any strides, 0 to
 *   broadcast (all strides 0: one per-tensor scale); scales.data NULL means
 *   scale 1. The value is scale * fp8 (f32, exact); biases unused. Scales
 *   must be finite and > 0: the CPU backend checks every scale a call reads
 *   (KVA_EINVAL, nothing written); on CUDA they are device memory and not
 *   checked (a bad scale gives meaningless output, not an error).
 *   bits in {2,4,8}: data is u32 [B, KVH, N, D*bits/32] (element k of a word
 *   at bits k*bits.., lowest first); scales and biases are f32/f16/bf16
 *   [B, KVH, N, D/group_size]; w = scale*q + bias.  */
typedef struct kva_kv {
  kva_tensor data;
  kva_tensor scales; /* unused when bits == 0 */
  kva_tensor biases; /* unused when bits == 0 */
  int bits;          /* 0, 2, 4 or 8 */
  int group_size;    /* 32, 64 or 128 when quantized */
} kva_kv;

/* Logical head dim D of a K/V operand (derived from data and bits; 0 if invalid). */
int64_t kva_kv_dim(const kva_kv *kv);
/* Contiguous descriptors. */
kva_kv kva_kv_float(void *data, kva_dtype dt, int64_t B, int64_t KVH, int64_t N, int64_t D);
kva_kv kva_kv_quantized(void *packed, void *scales, void *biases, kva_dtype scale_dt, int bits,
                        int group_size, int64_t B, int64_t KVH, int64_t N, int64_t D);
/* fp8 rows (dt KVA_F8E4M3 / KVA_F8E5M2) with f32 scales: per_token != 0,
 * scales [B, KVH, N, 1] contiguous; 0, one float (all scale strides 0);
 * scales NULL: scale 1. */
kva_kv kva_kv_fp8(void *data, kva_dtype dt, const float *scales, int per_token, int64_t B, int64_t KVH, int64_t N,
                  int64_t D);

/* ------------------------------------------------------ quantization */
/* MLX affine quantization along the last axis, bit for bit with MLX's CPU
 * algorithm (docs/mlx-format.md). w: f32/f16/bf16, rank 1..4, last dim D.
 * out->data: u32 [.., D*bits/32]; out->scales/biases: [.., D/group_size] in
 * f32/f16/bf16; out->bits and out->group_size select the format. */
int kva_quantize(const kva_tensor *w, kva_kv *out);
/* Inverse, as MLX computes it: out[..., d] = round_T(round_T(scale * q) + bias)
 * with T the scales' dtype (plain f32 arithmetic for f32 scales), then
 * converted to out's dtype. fp8 rows (bits 0, data KVA_F8E4M3 / KVA_F8E5M2,
 * rank 4): out [B, KVH, N, D] f32/f16/bf16 = scale * code in f32, rounded to
 * out's dtype; a scale that is not finite and > 0 is KVA_EINVAL (nothing
 * written). */
int kva_dequantize(const kva_kv *q, kva_tensor *out);

/* ------------------------------------------------------------- masks */
typedef enum kva_mask_kind {
  KVA_MASK_NONE = 0,   /* every key visible */
  KVA_MASK_CAUSAL = 1, /* key j visible iff j <= p; p = len - L + i (row i) */
  KVA_MASK_ARRAY = 2,  /* explicit array (bool: visible iff != 0; float: added to the logit) */
  KVA_MASK_TREE = 3,   /* speculative tree verify: CAUSAL on the prefix, packed bits on the L new keys */
} kva_mask_kind;

/* KVA_MASK_TREE (tree-shaped speculative verify of L <= KVA_TREE_MAX_ROWS
 * new tokens, e.g. EAGLE / Medusa draft trees): the last L keys of each
 * sequence are the L query rows' own tokens (key len - L + j is new token
 * j). mask.array holds the tree as packed bits: u32 [B, L, W] with
 * W = ceil(L / 32) (shape[0] = 1 or stride[0] = 0 broadcasts one tree to
 * every sequence; the innermost dim contiguous); row i sees new token j iff
 * bit j % 32 of word j / 32 of row i is set (lowest bit first; set bit i
 * for a row to see itself). Every row sees the committed prefix (keys
 * t < len - L) by the CAUSAL rules: mask.window and mask.segments (with
 * segments_clamp) apply there exactly as for KVA_MASK_CAUSAL, with p =
 * len - L + i; no other rule applies to the new keys. L above
 * KVA_TREE_MAX_ROWS is KVA_EUNSUPPORTED; a wrong dtype KVA_EDTYPE, a wrong
 * shape KVA_ESHAPE. Bits at j >= L (the last word's high bits): KVA_EINVAL
 * naming the row on the CPU; on CUDA the bits are device memory, not read by
 * the host, and bits >= L are ignored. The fused kernels take it (every K/V
 * row of the prefix read once per KV head for the query vectors a kernel
 * block holds, as for a causal verify); the result equals the same call
 * with an explicit KVA_MASK_ARRAY bool mask built from the rule. Both
 * backends run it (CUDA: the fused, per-warp, tensor-core and warpgroup
 * kernels; array masks only on the general kernel). */
#define KVA_TREE_MAX_ROWS 64

typedef struct kva_mask {
  kva_mask_kind kind;
  /* CAUSAL and TREE (its prefix keys). window > 0: also require j > p - window
   * (window 1 sees only itself); 0: no window. */
  int32_t window;
  /* CAUSAL and TREE (its prefix keys), optional (data NULL = none): i32 [B, N] per-token segment ids,
   * 0 = text, k > 0 = image k. Adds: visible if seg[p] == seg[j] != 0 (an image
   * attends to itself both ways, never to another image). A negative id is
   * KVA_EINVAL on the CPU; on CUDA the ids are device memory, not checked. */
  kva_tensor segments;
  /* With segments and a window: the image exception also requires j > p - window. */
  int segments_clamp;
  /* ARRAY: [B, H, L, N] bool or f32/f16/bf16 additive; stride 0 broadcasts.
   * TREE: u32 [B, L, ceil(L / 32)] packed bits (see KVA_MASK_TREE). */
  kva_tensor array;
} kva_mask;

/* Materialize the seed's createCausalMask: bool [n, offset + n], row r is
 * position offset + r; window 0 = none. out must be KVA_BOOL [n, offset+n]. */
int kva_causal_mask(int64_t n, int64_t offset, int32_t window, kva_tensor *out);
/* Materialize the image mask of n tokens: i32 segments [n] -> bool [n, n],
 * allow = causal_window OR (seg[i] == seg[j] != 0 [AND j > i - window if clamp]). */
int kva_image_mask(const kva_tensor *segments, int32_t window, int clamp, kva_tensor *out);

/* --------------------------------------------------------- KV views */
typedef enum kva_layout {
  KVA_LAYOUT_CONTIGUOUS = 0, /* one [B, KVH, N, D] cache per operand */
  KVA_LAYOUT_PAGED = 1,      /* a kva_paged_view of a library pool (CPU) */
  KVA_LAYOUT_BLOCK_TABLE = 2 /* caller-owned pools + a kva_block_table (CPU and CUDA) */
} kva_layout;

struct kva_paged_view;  /* opaque, see the paged API */
struct kva_block_table; /* see the paged API */

/* What one attention call reads: K and V of B sequences. The kernels ask the
 * view for rows; the same call serves every layout. */
typedef struct kva_kv_view {
  kva_layout layout;
  kva_kv k, v; /* CONTIGUOUS: [B, KVH, N, Dk] and [B, KVH, N, Dv] */
  /* CONTIGUOUS: optional [B] cache length per sequence (1 <= len <= N);
   * NULL: every sequence has length N. Host memory on the CPU backend,
   * device memory on CUDA. */
  const int32_t *seq_lens;
  const struct kva_paged_view *paged;  /* PAGED only */
  const struct kva_block_table *table; /* BLOCK_TABLE only (k, v are then the pools) */
} kva_kv_view;

kva_kv_view kva_view_contiguous(const kva_kv *k, const kva_kv *v, const int32_t *seq_lens);

/* -------------------------------------------------------- attention */
typedef struct kva_attn_params {
  float scale;        /* logit scale; 0 means 1/sqrt(Dk); must be finite */
  float softcap;      /* 0: none; > 0: logit = softcap * tanh(logit / softcap) */
  kva_mask mask;      /* applied after the softcap */
  const float *sinks; /* optional [H] f32 per-head sink logits (join the denominator only). CPU:
                         each finite or -inf (no effect), else KVA_EINVAL; CUDA: device memory,
                         not checked (+inf or NaN: NaN outputs for the head's rows that see a key) */
  unsigned flags;     /* KVA_ATTN_EXACT, KVA_ATTN_ROTATED_K, KVA_ATTN_ROTATED_V (any OR of them);
                         any other bit is KVA_EINVAL */
} kva_attn_params;

/* Flags of kva_attn_params. KVA_ATTN_EXACT (for validation): the selector
 * takes only kernels whose kva_attention_kernel bracket is "[exact f32]"
 * (f32 products everywhere: no query rounding, no bf16/f16 rounding of K,
 * V or P); without it the same call may take a faster kernel that rounds.
 * Results need not match the default call's bit for bit. */
#define KVA_ATTN_EXACT 1u
/* Hadamard-rotated caches (kva_hadamard, kva_cache_write_ex): K rows stored
 * as k' = H_Dk k (KVA_ATTN_ROTATED_K) and/or V rows as v' = H_Dv v
 * (KVA_ATTN_ROTATED_V). H is symmetric and orthonormal (H H = I), so
 * q.k = (H q).k' and out = sum_j p_j v_j = H (sum_j p_j v'_j): the call
 * rotates q on load (q' = H_Dk q) and, with ROTATED_V, stores out = H_Dv of
 * the kernel's f32 output in out's dtype; none of it touches K/V. CUDA: both
 * inside the kernels (q as a block stages it, out as a block stores its
 * f32 result: a split state for the merge, or with one split the output;
 * no extra launch or workspace); the CPU and the CUDA general kernel run
 * passes around the kernel instead (q' and the f32 output in the
 * workspace). kva_attention_kernel says which: "(q rotated on load, out
 * rotated back on store)" after the rotation words for the fused parts.
 * Results equal the unrotated call on the unrotated cache within rounding;
 * lse is unchanged (the logits are). q' has q's dtype, so a 16-bit q is
 * rounded once more after the rotation ("q bf16" / "q f16" in the kernel
 * name's bracket; the oracle models it: kva_ref_rounding.q_dtype); f32
 * queries and KVA_ATTN_EXACT keep q' in f32. Head dims as kva_hadamard
 * (every attention head dim but 80): another is KVA_EUNSUPPORTED naming it.
 * Cascade and context-parallel calls pass the flags to each part (the
 * merge is linear, so merging un-rotated parts is exact). */
#define KVA_ATTN_ROTATED_K 2u
#define KVA_ATTN_ROTATED_V 4u

/* scale 0 (default), no softcap, no mask, no sinks, flags 0. */
kva_attn_params kva_attn_defaults(void);

typedef enum kva_backend { KVA_BACKEND_CPU = 0, KVA_BACKEND_CUDA = 1 } kva_backend;

#define KVA_MAX_THREADS 1024 /* the most CPU worker threads a context may ask for */
typedef struct kva_context_opts {
  kva_backend backend;
  int threads;  /* CPU: worker threads, 0 = all cores, at most KVA_MAX_THREADS */
  int device;   /* CUDA: device ordinal */
  void *stream; /* CUDA: cudaStream_t, NULL = default stream */
} kva_context_opts;

typedef struct kva_context kva_context;

/* Creates a context (CPU: a thread pool started once). opts NULL = CPU, all cores.
 * Threads: any call may take a context shared between threads; calls that
 * use its state (kva_attention, kva_cache_write, kva_context_set_stream)
 * run one at a time per context (a mutex), so use one context per thread
 * for parallel calls. kva_context_destroy must not race with any call on
 * the context. fork(): a CPU context made before a fork works in the child
 * (its first call starts new workers; a fork waits for calls in flight); a
 * CUDA context does not (the CUDA runtime does not survive a fork). */
int kva_context_create(kva_context **ctx, const kva_context_opts *opts);
void kva_context_destroy(kva_context *ctx);
int kva_context_threads(const kva_context *ctx);
/* CUDA: stream for later calls (cudaStream_t as void *), shared by every
 * thread that calls on ctx. The context's workspace is used in stream
 * order: before switching streams while earlier calls that used it may
 * still run, order the streams (an event) or pass caller workspaces. */
int kva_context_set_stream(kva_context *ctx, void *stream);

/* ---------------------------------------------------- Hadamard rotation */
/* y = H_D x on the last dim (D = x->shape[last]): H_D the normalized
 * Walsh-Hadamard matrix, symmetric and orthonormal (H H = I).
 *   D = 2^k, 16 <= D <= 512: Sylvester order, H[a][b] = (-1)^popcount(a & b) / sqrt(D).
 *   D = 3 * 2^k (48, 96, 192, 384): H_D = H_3 (x) H_m, m = D / 3, element
 *     (i m + a, j m + b) = H_3[i][j] H_m[a][b], with the 3x3 Householder
 *     reflection H_3 = (2/3) J - I (diagonal -1/3, elsewhere 2/3; J the all-ones
 *     matrix): symmetric, orthogonal, H_3 H_3 = I.
 *   any other D: KVA_EUNSUPPORTED naming it (kva_hadamard_dim_supported).
 * Arithmetic (in f32, the same on every backend, bit for bit): the fast
 * transform u = x; for h = 1, 2, 4, .., m/2: (u[i], u[i+h]) = (u[i] + u[i+h],
 * u[i] - u[i+h]) for i % 2h < h; for D = 3m, per a < m with u_i = u[i m + a]:
 * s = (u_0 + u_1) + u_2, u_i = (s + s) - ((u_i + u_i) + u_i); then
 * y = u * c, c = (float)(1 / sqrt(D)) (2^k) or (float)(1 / (3 sqrt(m))) (3m),
 * rounded once to y's dtype (no fma anywhere). NaN or Inf in a row: NaN or
 * Inf in its outputs (payloads unspecified).
 * x, y: f32/f16/bf16 (dtypes may differ), rank 1..4, the same shape, any
 * strides (innermost contiguous); y == x (same data, dtype and strides) is
 * in place, any other overlap KVA_EINVAL. Memory of ctx's backend: host on
 * the CPU, device memory on ctx's stream on CUDA (asynchronous,
 * graph-capturable, no allocation). Nothing is written on error. */
int kva_hadamard(kva_context *ctx, const kva_tensor *x, kva_tensor *y);
/* 1 when kva_hadamard supports head dim D, else 0. */
int kva_hadamard_dim_supported(int64_t D);

/* Attention: q [B, H, L, Dk] (f32/f16/bf16), out [B, H, L, Dv] (f32/f16/bf16).
 * Row i of sequence b sits at position p = len_b - L + i. A row that sees no
 * key outputs zeros. Workspace: NULL uses a buffer owned by the context
 * (grown on first need); otherwise at least kva_attention_workspace_size()
 * bytes in the backend's memory, and no allocation happens in the call.
 * Precision: f32 accumulation, f32 products, except where a kernel uses
 * 16-bit matrix units or integer query products; kva_attention_kernel's
 * trailing bracket names each kernel's roundings. CPU: bf16 queries with
 * >= 6 query vectors per KV head on AMX (>= 16 over 4-bit K and V in groups
 * of a multiple of 64 or 8-bit in groups of 32: below, the integer kernels
 * named next) ("[K,V,P bf16]" for float rows:
 * K and V rounded to bf16 where their rows are not bf16, P always;
 * "[P bf16]" for quantized rows: the codes exact, q.k exact up to f32
 * accumulation, P times the V group scale rounded to bf16, multiplying the
 * centered codes c - 2^(bits-1)); on AVX-512
 * VNNI, 16-bit queries over quantized K, and on AVX2, 4-bit and 8-bit K
 * ("[q int8]": q
 * rounded to 8 bits with one scale per vector and K group, the rounding
 * kva_ref_rounding describes, exact integer q.k on the codes); on AVX-512
 * VNNI, 16-bit queries over 4-bit or 8-bit V whose groups span a multiple
 * of 8 code words (q4: groups of 64 or more; q8: 32 or more), and on AVX2
 * 16-bit queries over such V, at any number of query vectors, also round P ("P int16", "[q int8, P int16]"
 * with quantized K): w = p * s_g (the V group scale) rounded to s16 per
 * (query vector, tile of 32 keys, group) with a power-of-two step, each
 * weight within max|w| / 32767.5 of the tile's largest, the sum over the
 * tile exact integer work on the codes, the biases b_g * sum(p) in f32
 * (|out error| <= 2^-10 * |s_g| (2^bits - 1); tiles with a non-finite V
 * scale or bias stay f32; not modelled by the oracle), except that on
 * AVX-512 BF16 4-bit such V with >= 16 query vectors per KV head is
 * dequantized in f32 (s c + b, one fma) and rounded to bf16, P too, for a
 * bf16-pair P.V ("V,P bf16", "[q int8, V,P bf16]" with quantized K; tiles
 * with a non-finite V scale, bias or value stay f32); on AVX-512 BF16
 * (without AMX), >= 5 query vectors per KV head: bf16 queries over bf16 K
 * take q.k on bf16 pairs (products exact, f32 sums, denormals flushed to
 * zero as in AMX tiles), and 16-bit queries over bf16 V round P to bf16
 * for a bf16-pair P.V ("[P bf16]"; tiles with a NaN or Inf V value stay
 * f32). CUDA: bf16 queries over 4-bit or 8-bit K/V
 * with bf16 scales and biases, and bf16 (f16) queries over bf16 (f16) K/V
 * with >= 3 query vectors per KV head (>= 2 at head dim 64, over block
 * tables at 128 and, on sm_90, at 256; at head dim 512 on sm_90 only), run
 * on tensor cores:
 * 16-bit rows round P only ("[P bf16]",
 * "[P f16]"); 4-bit and 8-bit K with up to 8 query vectors per KV head take
 * exact integer q.k on the codes with the query rounded to 15 bits (two s8
 * parts, one scale per vector), with V dequantized to bf16 ("[q int15,
 * V,P bf16]", 4-bit narrow kernel; at head dim 512 for any number of
 * query vectors, in blocks of 8) or P times the V scale in bf16, the
 * codes exact ("[q int15, P bf16]": 8-bit, and the per-warp 4-bit kernel);
 * the per-warp 4-bit kernel at 9 to 32 query vectors per KV head (16 at
 * head dim 256) rounds the query to 8 bits with one scale per vector and
 * K group, exact integer q.k on the codes ("[q int8, P bf16]", the
 * rounding kva_ref_rounding describes); beyond that K and V are
 * dequantized to bf16 ("[K,V,P bf16]").
 * fp8 K/V rows (kva_kv_fp8) run the CPU fused vector kernel (not AMX) and
 * the CUDA fused kernel's fp8 instances (decode, verify and longer L),
 * else the general kernels: codes converted to f32 exactly, the row's scale
 * applied to q.codes and to p in f32, "[exact f32]"; on CUDA, bf16 queries
 * over fp8 rows at head dims 64 / 128 / 256 (Dk = Dv, rows 16-byte
 * aligned) run on tensor cores instead (from 16 query vectors per KV head
 * on sm_90 the warpgroup kernel), K and V as bf16 of scale * code (the code
 * exact, times the f32 row scale in f32, rounded to bf16), "[K,V,P bf16]".
 * The other kernels are "[exact f32]";
 * params->flags = KVA_ATTN_EXACT selects only those, on both backends.
 * README.md lists the shapes each path takes. out may not overlap any array
 * the call reads (q, K, V, scales, biases, mask array, segments, sinks,
 * lengths, block table). A problem whose workspace would exceed 2^48 bytes
 * is KVA_ESHAPE. CUDA: B and H at most 65535 (the grid), rep * L below
 * 2^31 (else KVA_EUNSUPPORTED); B * KVH above 65535 runs the general kernel. */
int kva_attention(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                  const kva_attn_params *params, kva_tensor *out, void *workspace,
                  size_t workspace_bytes);
int kva_attention_workspace_size(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                                 const kva_attn_params *params, size_t *bytes);

/* Flags of kva_attention_lse and kva_merge_states. */
#define KVA_LSE_BASE2 1u /* lse in base 2: lse2 = lse / ln 2 (default: natural log) */
/* kva_attention that also writes each row's log-sum-exp: lse [B, H, L] f32
 * (any strides, innermost contiguous; no overlap with q, K/V or out),
 * lse = log sum_j exp(s_j) over the row's visible keys, s_j the final logits
 * (after scale, softcap and additive masks), plus the sink term exp(sink_h)
 * when sinks are passed (so the sink belongs to this call's lse); a row that
 * sees no key has out 0 and lse = -inf (its sink contributes nothing). Same
 * kernels, workspace (kva_attention_workspace_size) and errors as
 * kva_attention; lse NULL is kva_attention; flags: 0 or KVA_LSE_BASE2, else
 * KVA_EINVAL. Nothing is written on error. */
int kva_attention_lse(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                      const kva_attn_params *params, kva_tensor *out, kva_tensor *lse, unsigned flags,
                      void *workspace, size_t workspace_bytes);

/* The most parts one kva_merge_states call takes (merge is associative:
 * merge more in steps). */
#define KVA_MERGE_MAX_PARTS 32
/* Merges R partial results of attention over disjoint key sets (e.g. the
 * lse outputs of kva_attention_lse over pieces of a cache):
 *   lse = log sum_r exp(lse_r),  out = sum_r exp(lse_r - lse) * o_r,
 * the softmax-state merge of the parts {m = lse_r, l = 1, o = o_r} folded in
 * order r = 0..R-1; a part at lse_r = -inf is skipped (its o_r never read
 * into the sum); all parts -inf: out 0 and lse -inf; NaN propagates.
 * parts_o[r]: [B, H, L, Dv] f32/f16/bf16 (same shape for every r, dtypes may
 * differ), parts_lse[r]: [B, H, L] f32; out: [B, H, L, Dv] f32/f16/bf16;
 * lse_out: [B, H, L] f32 or NULL. Any strides, innermost contiguous; memory of
 * ctx's backend (CUDA: device memory, ctx's stream, asynchronous, graph-
 * capturable, no allocation). Aliasing: out may be exactly one of the
 * parts_o[r] (same data pointer, dtype and strides: in place), lse_out may be
 * exactly one of the parts_lse[r]; any other overlap between out, lse_out and
 * the parts is KVA_EINVAL. flags: KVA_LSE_BASE2 = every lse (in and out) is in
 * base 2. 1 <= R <= KVA_MERGE_MAX_PARTS. Errors name the argument; nothing is
 * written on error. */
int kva_merge_states(kva_context *ctx, int64_t R, const kva_tensor *parts_o, const kva_tensor *parts_lse,
                     kva_tensor *out, kva_tensor *lse_out, unsigned flags);

/* Cascade (shared-prefix) attention: B sequences whose caches begin with the
 * same P tokens, held once. prefix: a view of those P tokens as one sequence
 * (B = 1; any layout); suffix: a view of the B sequences' own tokens after
 * them (any layout, lengths s_b). Row i of sequence b sits at position
 * P + s_b - L + i. The result is that of kva_attention over each sequence's
 * whole cache (prefix then suffix): the prefix is attended once for all B L
 * rows of each head (the rows stacked as one sequence of B L rows, in calls
 * of at most 256 rows: each reads the prefix once per KV head for its rows'
 * query vectors; the CPU in items of up to 256 vectors), the suffix as
 * kva_attention does, and the two states merged (kva_merge_states). Requirements: the rows of consecutive
 * sequences evenly spaced, q->stride[0] == L * q->stride[2] (e.g. q stored
 * token-major, [B, L, H, Dk]; any q when B = 1 or L = 1), else KVA_ESTRIDE; mask none
 * or causal without window or segments (else KVA_EUNSUPPORTED), so that
 * every row sees the whole prefix (the suffix holds the rows' own tokens:
 * s_b >= L, as kva_attention requires). Forked paged sequences:
 * kva_paged_view_split / kva_block_table_split give the two views. On CUDA
 * a prefix whose length is device memory (seq_lens, a block table) must
 * hold at least min(B L, 16) tokens (the host cannot check it); the CPU
 * takes any length >= 1. Softcap, scale,
 * flags (KVA_ATTN_EXACT) apply to both parts; sinks join once. lse: [B, H,
 * L] f32 or NULL, flags 0 or KVA_LSE_BASE2, as kva_attention_lse. Workspace:
 * NULL uses the context's (grown on first need), else at least
 * kva_cascade_workspace_size() bytes in the backend's memory. Errors name
 * the argument; nothing is written to out or lse on error. */
int kva_cascade_attention(kva_context *ctx, const kva_tensor *q, const kva_kv_view *prefix,
                          const kva_kv_view *suffix, const kva_attn_params *params, kva_tensor *out, kva_tensor *lse,
                          unsigned lse_flags, void *workspace, size_t workspace_bytes);
int kva_cascade_workspace_size(kva_context *ctx, const kva_tensor *q, const kva_kv_view *prefix,
                               const kva_kv_view *suffix, const kva_attn_params *params, size_t *bytes);

/* Context parallelism: a sequence batch's KV sharded over R ranks
 * (contiguous ranges, round-robin blocks: any split of the keys). Each rank
 * attends its shard for all heads into its send buffer (kva_cp_attend), the
 * partials are exchanged, and each rank merges the R parts it received
 * (kva_cp_merge): the heads it owns (by_head: rank r ends with heads
 * [r H/R, (r+1) H/R), an all-to-all) or all heads (all-gather). The
 * exchange is the caller's (kva_cp_plan's offsets: simulated ranks, any
 * transport) or NCCL's (kva_cp_attention). Buffers, f32, in ctx's memory:
 *   send: o at 0 and lse at send_lse_offset; the part for rank d (by_head;
 *     all-gather: the one part, d = 0) is o_bytes at d * o_bytes and
 *     lse_bytes at send_lse_offset + d * lse_bytes;
 *   recv: the part from rank s at s * o_bytes and at recv_lse_offset +
 *     s * lse_bytes.
 * The result equals attention over the unsharded keys within rounding when
 * the shards are disjoint, cover the keys, and each rank's params state
 * what its rows see of its shard: the shard that ends with the query rows'
 * own tokens (>= L of them) takes the caller's mask, a shard wholly before
 * them mask none (or, with a window, none when the window covers it, kv
 * NULL when it excludes it); sinks on one rank only. */
typedef struct kva_cp_plan {
  int64_t ranks, rank;               /* R (1..KVA_MERGE_MAX_PARTS) and this rank */
  int by_head;                       /* 1: all-to-all by head owner; 0: all-gather */
  int64_t B, H, L, Dv;               /* the call's shape */
  int64_t heads;                     /* heads per part: H / R (by_head) or H */
  unsigned lse_flags;                /* 0 or KVA_LSE_BASE2: the base of every lse (parts and out) */
  size_t o_bytes, lse_bytes;         /* one part: heads B L Dv and heads B L floats */
  size_t send_lse_offset, send_bytes; /* send buffer layout */
  size_t recv_lse_offset, recv_bytes; /* receive buffer layout */
} kva_cp_plan;
/* The plan of one call shape (by_head needs R | H). */
int kva_cp_plan_init(kva_cp_plan *plan, int64_t ranks, int64_t rank, int by_head, int64_t B, int64_t H, int64_t L,
                     int64_t Dv, unsigned lse_flags);
/* This rank's part: kva_attention_lse of q [B, H, L, Dk] over its shard kv
 * (NULL: no key, out 0 and lse -inf) into send (>= plan->send_bytes;
 * workspace as kva_attention). Errors as kva_attention's; nothing written on error. */
int kva_cp_attend(kva_context *ctx, const kva_cp_plan *plan, const kva_tensor *q, const kva_kv_view *kv,
                  const kva_attn_params *params, void *send, size_t send_bytes, void *workspace,
                  size_t workspace_bytes);
/* Merges the R received parts into out [B, heads, L, Dv] (f32/f16/bf16) and
 * lse [B, heads, L] f32 or NULL (kva_merge_states; recv >= plan->recv_bytes). */
int kva_cp_merge(kva_context *ctx, const kva_cp_plan *plan, const void *recv, size_t recv_bytes, kva_tensor *out,
                 kva_tensor *lse);
/* The three steps over NCCL on ctx's stream (CUDA context; no host
 * synchronization, no allocation: CUDA-graph capturable): kva_cp_attend
 * into send, the exchange (by_head: a send / receive per peer in one
 * group; else all-gather), kva_cp_merge from recv into out, lse (checked
 * first). comm: the caller's ncclComm_t (as void *) of plan->ranks ranks in
 * which this is plan->rank (else KVA_EINVAL); send, recv: device buffers of
 * plan->send_bytes and plan->recv_bytes. Every rank calls it with the same
 * plan shape. Built with NCCL when the Makefile finds it (NCCL_HOME), else
 * KVA_EUNSUPPORTED. On an NCCL error (KVA_ECUDA) send may hold this rank's part. */
int kva_cp_attention(kva_context *ctx, void *comm, const kva_cp_plan *plan, const kva_tensor *q,
                     const kva_kv_view *kv, const kva_attn_params *params, kva_tensor *out, kva_tensor *lse,
                     void *send, void *recv, void *workspace, size_t workspace_bytes);

typedef enum kva_path {
  KVA_PATH_FUSED = 1,    /* one pass over K/V for all query vectors of a KV head (CPU: up to 256 per pass) */
  KVA_PATH_FALLBACK = 2, /* correct general path (explicit mask arrays) */
} kva_path;
/* Validates the arguments like kva_attention and says which path would run
 * (the same selector kva_attention uses). Returns a kva_path or a negative status. */
int kva_attention_path(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                       const kva_attn_params *params, const kva_tensor *out);
/* The same, and a one-line description of the kernel kva_attention would run
 * (the same selector) in name: at most size - 1 characters, NUL-terminated
 * (truncated when longer). E.g. "cpu avx512 fused kernel [exact f32]", "cpu
 * avx512 AMX kernel (bf16 tiles) [K,V,P bf16]", "cpu portable general kernel
 * [exact f32]", "cuda q4 tensor-core kernel: decode instance, 8 query vectors
 * per block, group compiled in, 128 splits [q int15, V,P bf16]", "cuda bf16
 * fused kernel: 2 query vectors per block, 16 elements per lane, 6 splits
 * [exact f32]", "cuda general kernel [exact f32]". The words before the
 * bracket are for reading and may change between versions; the trailing
 * bracket states the kernel's roundings (see kva_attention, Precision) and
 * is stable: "[exact f32]" (f32 products everywhere), or a comma-separated
 * list of "OPERANDS TYPE" items: operands K, V, P (the softmax weights
 * before P.V) rounded to TYPE bf16 or f16, or q rounded to a signed integer
 * of N bits with one scale per query vector and group ("q int15", "q
 * int8": exact integer q.k on quantized K codes), e.g. "[q int15, P bf16]",
 * or "q bf16" / "q f16" first: a rotated call's query H q rounded to that
 * type (KVA_ATTN_ROTATED_K with a 16-bit q; "[exact f32]" then reads "[q
 * bf16]"); a rotated call's words end in ", Hadamard-rotated K,V" (or K, V),
 * then "(q rotated on load, out rotated back on store)" (the parts the
 * kernel runs fused; none: passes around it).
 * Operands not named are not rounded below f32. name NULL or size 0:
 * KVA_EINVAL; on error name is not written. Returns a kva_path or a negative
 * status. */
int kva_attention_kernel(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                         const kva_attn_params *params, const kva_tensor *out, char *name, size_t size);

/* The oracle: naive double-precision attention over the same descriptors
 * (host memory only). Shares only argument validation with kva_attention
 * (it refuses what kva_attention refuses); element loads, row addresses of
 * every layout (paged views through kva_paged_view_csr's arrays), lengths,
 * dequantization, masks and the output rounding are its own. */
int kva_reference_attention(const kva_tensor *q, const kva_kv_view *kv,
                            const kva_attn_params *params, kva_tensor *out);
/* The oracle with lse (as kva_attention_lse: lse [B, H, L] f32 or NULL,
 * flags 0 or KVA_LSE_BASE2), computed in double from the same logits. */
int kva_reference_attention_lse(const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *params,
                                kva_tensor *out, kva_tensor *lse, unsigned flags);
/* Roundings the oracle applies on request: those a fast kernel documents in
 * its kva_attention_kernel() bracket (DESIGN "Precision"), so that the kernel
 * can be checked tightly against the oracle with the same roundings.
 * q_int_bits: 0 = none; 2..24 = each query vector rounded to signed
 *   integers of that many bits with one scale per group of K's group_size
 *   dims (float K: the whole row), in f32 arithmetic on the query as loaded:
 *   amax = max |q| over the group, sigma = amax / (2^(bits-1) - 1),
 *   inv = 1 / sigma (0 when sigma is 0), c = rint(q * inv) clamped to
 *   +-(2^(bits-1) - 1), q' = c * sigma; a group holding a NaN or Inf, or
 *   one whose inv overflows to inf (max |q| below ~2^-121 at 8 bits), is
 *   left unrounded. ("q int8": the 4-bit per-warp CUDA kernel, the AVX2
 *   CPU kernel over 4-bit and 8-bit K.)
 * k_dtype, v_dtype: KVA_F32 = none; KVA_BF16 / KVA_F16 = each K (V)
 *   element, dequantized exactly, rounded once to that type (nearest even).
 * q_dtype: KVA_F32 = none; KVA_BF16 / KVA_F16 = the query as a rotated call
 *   (KVA_ATTN_ROTATED_K) hands it to its kernel: H q computed with
 *   kva_hadamard's f32 arithmetic, rounded once to that type ("q bf16",
 *   "q f16" in a kernel name's bracket); q_int_bits then rounds that query.
 *   Unrotated calls: the query rounded to that type. A rotated query is H q
 *   in double unless q_dtype or q_int_bits is set: then it is formed with
 *   kva_hadamard's f32 arithmetic, as the kernel receives it.
 * P rounding depends on a kernel's running maximum and is not modelled: the
 * tests allow for it. */
typedef struct kva_ref_rounding {
  int q_int_bits;
  kva_dtype k_dtype;
  kva_dtype v_dtype;
  kva_dtype q_dtype;
} kva_ref_rounding;
/* kva_reference_attention_lse with the roundings r (NULL: none, the exact
 * oracle); a field out of range is KVA_EINVAL. */
int kva_reference_attention_rounded(const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *params,
                                    kva_tensor *out, kva_tensor *lse, unsigned flags, const kva_ref_rounding *r);

/* ------------------------------------------------------------- info */
/* SIMD level the CPU kernels use: "avx512", "avxvnni" (AVX2 with AVX-VNNI's
 * integer dot products), "avx2" or "portable": the best the CPU has, capped
 * by the environment variable KVATTN_SIMD (one of those names, read once
 * per process; a level above the CPU's or one it lacks is ignored). */
const char *kva_cpu_simd(void);
/* Override the SIMD level (for tests and A/B runs): "avx512", "avxvnni",
 * "avx2", "portable" (the fused kernel on generic vectors; the only level built on
 * non-x86 targets); NULL = best available. Process-wide; calls read it
 * when they start (a change applies to calls that start after it). Fails with KVA_EUNSUPPORTED if the CPU lacks the
 * level or the build does not have it (x86 levels on other architectures),
 * KVA_EINVAL for an unknown name. */
int kva_cpu_set_simd(const char *level);
/* Number of CUDA devices visible (0 when the backend is not built or none). */
int kva_cuda_device_count(void);
/* Name and memory of a CUDA device, for `kvattn info`. */
int kva_cuda_device_info(int device, char *name, size_t name_len, size_t *total_bytes);

/* ---- paged KV (src/paged) ---- */
/* A block pool holds the K/V caches of many sequences in fixed-size blocks:
 *   K [num_blocks, KVH, block_size, Dk], V [num_blocks, KVH, block_size, Dv],
 * float, or MLX-affine quantized (packed words + scales + biases pools with
 * the same leading dims). Sequences own block tables (refcounted blocks, fork
 * shares them, copy-on-write of a shared partial last block). A view is an
 * immutable CSR snapshot of a batch of sequences that keeps its blocks alive
 * until released; kva_attention reads it through kva_view_paged().
 *
 *   kva_pool_desc d = {.num_blocks = 4096, .block_size = 16, .kv_heads = KVH,
 *                      .dk = 128, .dv = 128, .dtype = KVA_BF16, .bits = 4, .group_size = 64};
 *   kva_pool *pool;  kva_pool_create(&pool, &d, NULL);
 *   int32_t s;  kva_seq_create(pool, &s);
 *   kva_seq_append(pool, s, &k_rows, &v_rows);      // float [KVH, T, D], quantized on write
 *   kva_paged_view *pv;  kva_paged_view_create(pool, &s, 1, &pv);
 *   kva_kv_view view = kva_view_paged(pv);
 *   kva_attention(ctx, &q, &view, &params, &out, NULL, 0);
 *   kva_paged_view_release(pv);
 *
 * Positions: attention indexes a sequence by view index 0..len-1 (its window
 * after trims); kva_seq_start() / csr.start give the absolute position of view
 * index 0. Causal and window masks depend only on differences, so results
 * are the same; segment ids (mask.segments) are indexed by view index.
 * Threads: every pool, sequence and view call takes the pool's mutex, so they
 * may come from several threads. kva_attention over a view may run while
 * other threads append/fork/trim/free: it reads only rows the view holds,
 * which nothing rewrites. kva_pool_destroy must not race with other calls on
 * the same pool. Sequence ids are opaque (a freed id is rejected with
 * KVA_ENOSEQ; at most 262144 live sequences per pool; an id can repeat
 * only after its slot was reused 8191 times, dead slots being reused oldest first). */
typedef struct kva_pool kva_pool;
typedef struct kva_paged_view kva_paged_view;

#define KVA_BLOCK_SIZE_MIN 8
#define KVA_BLOCK_SIZE_MAX 256
#define KVA_POOL_ALIGN 64 /* byte alignment of caller memory and of each pool array */

typedef struct kva_pool_desc {
  int64_t num_blocks; /* blocks per pool; each holds block_size tokens of every KV head */
  int64_t block_size; /* tokens per block, KVA_BLOCK_SIZE_MIN..KVA_BLOCK_SIZE_MAX */
  int64_t kv_heads;   /* KVH */
  int64_t dk, dv;     /* head dims of K and V (may differ) */
  kva_dtype dtype;    /* float pools: f32/f16/bf16 elements, or fp8 (KVA_F8E4M3 / KVA_F8E5M2: one f32
                         scale per (token, head) in the scales arrays, computed on append as
                         kva_cache_write does); quantized: scales/biases dtype */
  int bits;           /* 0 = float (or fp8); 2, 4, 8 = MLX affine */
  int group_size;     /* quantized: 32, 64 or 128 (divides dk and dv) */
} kva_pool_desc;

/* Bytes of block memory for desc: K, V (and K/V scales, biases) arrays, each
 * KVA_POOL_ALIGN-aligned, in that order. */
int kva_pool_memory_size(const kva_pool_desc *desc, size_t *bytes);
/* Creates a pool with every block free. memory: NULL = the pool allocates;
 * otherwise >= kva_pool_memory_size() bytes, KVA_POOL_ALIGN-aligned, owned by
 * the caller and kept alive until the pool and its last view are gone. */
int kva_pool_create(kva_pool **pool, const kva_pool_desc *desc, void *memory);
/* Frees the sequences and reservations at once and the pool when its last
 * view is released (views stay valid). NULL is a no-op. */
void kva_pool_destroy(kva_pool *pool);
/* The pool's descriptor and its K/V arrays as kva_kv [num_blocks, KVH, block_size, D]. */
kva_pool_desc kva_pool_get_desc(const kva_pool *pool);
kva_kv kva_pool_k(const kva_pool *pool);
kva_kv kva_pool_v(const kva_pool *pool);

typedef struct kva_pool_stats {
  int64_t free_blocks; /* on the free list */
  int64_t used_blocks; /* referenced by a sequence, a view or a reservation */
  int64_t sequences;   /* live sequences */
  int64_t views;       /* live (unreleased) views */
} kva_pool_stats;
int kva_pool_stats_get(kva_pool *pool, kva_pool_stats *stats);
/* References on one block (sequence tables + views + reservations); 0 = free. */
int kva_pool_block_refs(kva_pool *pool, int32_t block, int32_t *refs);
/* Recounts every reference from the sequence tables, live views and
 * reservations and checks the refcounts, the free list (each free block once,
 * no used block) and every sequence's table; KVA_EINTERNAL names the first
 * mismatch. O(num_blocks + table sizes); for tests and debugging. */
int kva_pool_check(kva_pool *pool);
/* Permutes the free list pseudo-randomly (seed), so later allocations scatter
 * over the pool (a fragmented pool, for benchmarks and tests). Contents and
 * references are unchanged. */
int kva_pool_shuffle(kva_pool *pool, uint64_t seed);
/* Takes n free blocks for the caller's own use (one reference each, written
 * directly through kva_pool_k/v, named by kva_paged_view_from_csr) and gives
 * them back. ENOBLOCKS and nothing taken when fewer than n are free. */
int kva_pool_reserve(kva_pool *pool, int64_t n, int32_t *blocks);
int kva_pool_unreserve(kva_pool *pool, int64_t n, const int32_t *blocks);

/* ---- sequences (ids are int32) */
int kva_seq_create(kva_pool *pool, int32_t *seq);
/* Appends T tokens: k [KVH, T, Dk], v [KVH, T, Dv], f32/f16/bf16, any strides
 * (innermost contiguous). Float pools store them rounded to the pool dtype;
 * quantized pools quantize each row (kva_quantize), bit-identical to
 * quantizing the whole cache at once. Needs the new blocks (+1 when the last
 * block is partial and shared with another sequence: copy-on-write; a view
 * sharing it needs no copy, the rows it sees are never rewritten); ENOBLOCKS
 * and nothing changed when the pool has fewer free. */
int kva_seq_append(kva_pool *pool, int32_t seq, const kva_tensor *k, const kva_tensor *v);
/* Appends T rows already in the pool's format, copied bit for bit: k, v are
 * kva_kv [1, KVH, T, D] (e.g. a slice of a contiguous cache); EDTYPE when the
 * format (bits, group_size, dtype) differs from the pool's. */
int kva_seq_append_raw(kva_pool *pool, int32_t seq, const kva_kv *k, const kva_kv *v);
/* A new sequence sharing all of parent's blocks (no copy, no block needed). */
int kva_seq_fork(kva_pool *pool, int32_t parent, int32_t *child);
/* Drops the sequence; its blocks return to the pool unless still referenced. */
int kva_seq_free(kva_pool *pool, int32_t seq);
/* Sliding window: keeps the last keep_last tokens (>= 0; >= len is a no-op);
 * blocks wholly before the window return to the pool, start advances. */
int kva_seq_trim(kva_pool *pool, int32_t seq, int64_t keep_last);
/* Tokens in the window, absolute position of its first token, blocks in the
 * table; a negative kva_status for an unknown or freed sequence. */
int64_t kva_seq_len(kva_pool *pool, int32_t seq);
int64_t kva_seq_start(kva_pool *pool, int32_t seq);
int64_t kva_seq_blocks(kva_pool *pool, int32_t seq);

/* Builds a pool holding a contiguous view's sequences (for the bench and for
 * tests): the pool gets contig's format (quantized K/V are copied bit for bit,
 * float K/V in their dtype), blocks enough for every sequence plus
 * spare_blocks, and one sequence per batch entry b (length seq_lens[b] or N)
 * whose id is written to seqs[b]. shuffle_seed != 0 scatters the blocks over
 * the pool (kva_pool_shuffle first: a fragmented pool); 0 keeps them in order.
 * K and V formats must match (bits, group_size, dtype). */
int kva_pool_from_contiguous(kva_pool **pool, const kva_kv_view *contig, int64_t block_size,
                             int64_t spare_blocks, uint64_t shuffle_seed, int32_t *seqs);

/* ---- views: CSR snapshots */
typedef struct kva_paged_csr {
  int64_t batch;               /* B */
  const int32_t *indptr;       /* [B+1], indptr[0] = 0: sequence b's blocks are indices[indptr[b]..indptr[b+1]) */
  const int32_t *indices;      /* [indptr[B]] block ids, in token order */
  const int32_t *last_len;     /* [B] valid rows of the last block, 1..block_size */
  const int32_t *first_offset; /* [B] rows of the first block before the window (trims); NULL = 0 */
  const int64_t *start;        /* [B] absolute position of view index 0; NULL = 0 */
  const int32_t *lens;         /* [B] tokens: (blocks-1)*block_size + last_len - first_offset
                                  (filled by kva_paged_view_csr; ignored on input) */
} kva_paged_csr;

/* Snapshot of sequences seqs[0..B) (non-empty, repeats allowed): copies their
 * tables and takes a reference on every block. A block holds at most
 * INT32_MAX references: a view or fork past that is KVA_EUNSUPPORTED ("too
 * many references") and takes none. */
int kva_paged_view_create(kva_pool *pool, const int32_t *seqs, int64_t B, kva_paged_view **view);
/* A view from caller arrays (copied): every index must name an allocated
 * block (held by a sequence, view or reservation), on which it takes a
 * reference. Bad indices, lengths beyond a table: an error and no view. */
int kva_paged_view_from_csr(kva_pool *pool, const kva_paged_csr *csr, kva_paged_view **view);
/* Drops the view's references (and the pool if destroyed and this was its last view). NULL: no-op.
 * Releasing a view twice is caller error: while its pool lives the handle
 * stays pool memory and a second release is ignored (unless the handle was
 * reused by a newer view); after the pool is freed it is undefined. */
void kva_paged_view_release(kva_paged_view *view);
/* The kva_kv_view for kva_attention (k, v: the pool's arrays; layout PAGED). */
kva_kv_view kva_view_paged(const kva_paged_view *view);
/* The view's arrays (owned by the view, valid until it is released). */
int kva_paged_view_csr(const kva_paged_view *view, kva_paged_csr *csr);
/* Copies sequence b's rows (view indices 0..len-1) bit for bit into k, v:
 * kva_kv [1, KVH, >= len, D] in the pool's format. */
int kva_paged_view_gather(const kva_paged_view *view, int64_t b, kva_kv *k, kva_kv *v);

/* ---- caller-owned pools addressed by a block table (vLLM-style) */
/* The layout for engines that manage blocks themselves, and the paged layout
 * of the CUDA backend: the pools are kva_kv [num_blocks, KVH, block_size, D]
 * (kva_pool_k/v of a library pool, or the caller's own arrays of that shape
 * and any strides) and the table names each sequence's blocks in token
 * order. Sequence b's tokens are the rows first_offset[b] ..
 * first_offset[b] + seq_lens[b] - 1 of its table row read as one long array:
 * row r lives in block blocks[b * row_stride + r / block_size], at row
 * r % block_size. The CPU backend reads host arrays and validates every
 * entry it will use (a bad id or length: an error, nothing written). On CUDA
 * the pools and the three arrays are device memory, read by the kernels (so
 * a captured graph follows later changes of lengths and tables); there a
 * length is clamped into [0, max_blocks * block_size - first_offset], a
 * first_offset into [0, block_size) and a block id into [0, num_blocks), so
 * bad values never fault (the result is then meaningless, not an error). */
typedef struct kva_block_table {
  int64_t batch;               /* B */
  int64_t max_blocks;          /* table columns: a sequence spans at most max_blocks blocks */
  int64_t row_stride;          /* int32 elements between table rows; 0 = max_blocks */
  const int32_t *blocks;       /* [B, max_blocks] block ids; entries past a sequence's last block are never read */
  const int32_t *seq_lens;     /* [B] tokens, 1 <= len <= max_blocks * block_size - first_offset */
  const int32_t *first_offset; /* [B] rows of the first block before token 0 (window trims); NULL = 0 */
} kva_block_table;

/* The kva_kv_view for kva_attention (layout BLOCK_TABLE; the longest
 * possible sequence, max_blocks * block_size, plays the role of N). */
kva_kv_view kva_view_block_table(const kva_kv *k_pool, const kva_kv *v_pool, const kva_block_table *table);
/* Fills a block table in host memory from a view of a library pool (to copy
 * to the device with the pool's memory): blocks [B, max_blocks] (row stride
 * max_blocks; unused entries -1), seq_lens [B], first_offset [B]. ESHAPE when
 * a sequence has more than max_blocks blocks; nothing written on error. */
int kva_paged_view_block_table(const kva_paged_view *view, int64_t max_blocks, int32_t *blocks,
                               int32_t *seq_lens, int32_t *first_offset);

/* ---- shared prefixes (forks) for kva_cascade_attention */
/* The tokens that sequences share in memory: the longest P such that tokens
 * 0..P-1 of every sequence live in the same pool rows (the same first
 * offset and the same block ids at the same table positions: forks of one
 * parent before they diverge), capped so that every sequence keeps at least
 * min_suffix (>= 0) own tokens after it (e.g. L, the query rows of a
 * cascade call); *tokens >= 0 (0: nothing shared). */
int kva_seq_shared_prefix(kva_pool *pool, const int32_t *seqs, int64_t B, int64_t min_suffix, int64_t *tokens);
/* The same over a view's sequences: layout PAGED, or BLOCK_TABLE with host
 * arrays (every entry validated as for kva_attention); CONTIGUOUS is KVA_EINVAL. */
int kva_view_shared_prefix(const kva_kv_view *view, int64_t min_suffix, int64_t *tokens);
/* The two views of kva_cascade_attention from a paged view of B sequences:
 * *prefix (B = 1) holds tokens 0..P-1 of sequence 0, *suffix sequence b's
 * tokens P..len_b-1 (start advanced by P), P = prefix_tokens in [1, the
 * shared prefix with min_suffix 1] (else KVA_EINVAL). Both are new views
 * with their own references (release each); nothing is made on error. */
int kva_paged_view_split(const kva_paged_view *view, int64_t prefix_tokens, kva_paged_view **prefix,
                         kva_paged_view **suffix);
/* The same for a block-table view (host arrays, checked as above): fills
 * lens [B + 1] and first_offset [B + 1] (caller memory: entry 0 the
 * prefix's, 1..B the suffixes') and the tables *prefix (batch 1, sequence
 * 0's row) and *suffix (each row advanced by whole blocks), whose blocks
 * pointers are offsets of view->table->blocks and whose lengths and offsets
 * point into lens and first_offset. For a device table, split its host
 * mirror and offset the device pointers alike (copy lens, first_offset). */
int kva_block_table_split(const kva_kv_view *view, int64_t prefix_tokens, int32_t *lens, int32_t *first_offset,
                          kva_block_table *prefix, kva_block_table *suffix);

/* Writes n new tokens into pool slots (the engine's append step):
 * k [n, KVH, Dk] and v [n, KVH, Dv] (f32/f16/bf16, any strides, innermost
 * contiguous), slots [n] int32 = block * block_size + row; a negative slot
 * skips its token (padding). Float pools store the rows rounded to the pool
 * dtype; quantized pools store kva_quantize of each row, bit for bit (also
 * on CUDA). k_pool, v_pool: kva_kv [num_blocks, KVH, block_size, D] as for
 * kva_view_block_table. Runs on ctx's backend: host memory on the CPU;
 * device memory and ctx's stream on CUDA (asynchronous, graph-capturable;
 * there an out-of-range slot is skipped, on the CPU it is an error). Two
 * tokens naming the same slot: one of them wins.
 * fp8 pools (data KVA_F8E4M3 / KVA_F8E5M2, bits 0) store round(x / scale)
 * (f32 division, round to nearest even, saturating to +-max; NaN to the NaN
 * code of its sign), bit for bit the same on CPU and CUDA, with scale
 *   - per (token, head) when the pool's scales [num_blocks, KVH, block_size,
 *     1] broadcast no dim (no zero stride on a dim of more than one
 *     element): computed and stored, scale = max |x| over the row's finite
 *     values / max_fp8 (448 or 57344) in f32, at least FLT_MIN, 1 for a row
 *     of zeros (or of only NaN / inf);
 *   - fixed when they broadcast (e.g. all strides 0: one per-tensor scale):
 *     read, not written; the CPU checks each scale used is finite and > 0
 *     (else KVA_EINVAL, nothing written), CUDA reads device memory unchecked;
 *   - 1 without scales (scales.data NULL). */
int kva_cache_write(kva_context *ctx, const kva_kv *k_pool, const kva_kv *v_pool, const kva_tensor *k,
                    const kva_tensor *v, const int32_t *slots, int64_t n);
/* Flags of kva_cache_write_ex. */
#define KVA_WRITE_ROTATE_K 1u /* store H_Dk k (kva_hadamard) instead of k: a cache for KVA_ATTN_ROTATED_K */
#define KVA_WRITE_ROTATE_V 2u /* store H_Dv v: a cache for KVA_ATTN_ROTATED_V */
/* kva_cache_write with flags (0: kva_cache_write). A rotated row is
 * computed in f32 with kva_hadamard's arithmetic and then stored as that
 * f32 row would be (one rounding to a float pool's dtype, or kva_quantize
 * of the f32 row): bit for bit kva_hadamard into an f32 tensor followed by
 * kva_cache_write, on both backends (quantized pools equal CPU vs CUDA for
 * finite rows). A rotated operand's head dim must be one kva_hadamard
 * supports, else KVA_EUNSUPPORTED naming it; other flag bits KVA_EINVAL;
 * nothing written on error. */
int kva_cache_write_ex(kva_context *ctx, const kva_kv *k_pool, const kva_kv *v_pool, const kva_tensor *k,
                       const kva_tensor *v, const int32_t *slots, int64_t n, unsigned flags);
/* ---- end paged ---- */

#ifdef __cplusplus
}
#endif
#endif /* KVATTN_H */
