/* The CUDA backend's entry points (core/backend.h): context state, workspace,
 * device queries, and kva_cuda_attention, which flattens a validated
 * kva_problem into kvc_args, picks the kernel (the one selector, kvc_select)
 * and enqueues it on the context's stream. Nothing here allocates,
 * synchronizes or depends on cache lengths per call: lengths and block
 * tables (BLOCK_TABLE views) stay in device memory, so a captured CUDA graph
 * replays across changing lengths and tables. */
#include "cuda/launch.cuh"

extern "C" {
#include "core/hadamard.h"
}

#include <stdlib.h>
#include <stdio.h>
#include <string.h>

/* Fused grid sizing (tuning only; never changes results beyond rounding). */
#define KVC_MAX_WAVES 4             /* waves of resident blocks considered */
#define KVC_WAVE_TOKENS 96          /* a wave's fixed cost in tokens per block (H200, bf16 fused decode: ~90) */
#define KVC_MIN_SPLIT_TOKENS 64     /* fewest tokens per split (fused kernel): short caches spread over more
                                       SMs */
#define KVC_TC_MIN_SPLIT_TOKENS 128 /* q4 tensor-core kernel: two stages, so short caches use more SMs */
#define KVC_MAX_SPLITS 4096         /* the merge keeps one weight per split in shared memory */
#define KVC_WS_ALIGN 256
#define KVC_TC_WAVES 1            /* one wave of long-running q4 tensor-core blocks: the cp.async prologue amortized */
#define KVC_TC_MAX_WAVES 16       /* the most KVA_CUDA_TC_WAVES may ask for */
#define KVC_TC_NDIMS 4            /* head dims of the tensor-core kernel: 64 << i (512: q4, 8 vectors per block; bf16 / f16: the warpgroup kernel only) */
#define KVC_TC_MIN_D 64
#define KVC_TC_NTM_MID 4          /* n-tiles per block of the narrow kernel's 32-vector instance */
#define KVC_TC_NTM_WIDE 6         /* n-tiles of 8 per block of the wide kernel (48 query vectors) */
#define KVC_TC_Q4_WIDE_MIN_Q 33   /* q4: the wide kernel from 33 query vectors per KV head (H200: below, the
                                     32-vector instance is faster) */
#define KVC_TCD_MIN_WORK (1LL << 18) /* ... and from B * KVH * N >= this many token-heads (the default; the
                                        environment variable KVA_CUDA_TCD_MIN_WORK sets it per context, < 0:
                                        never): below, its per-block fixed cost loses (H200, 8/4/256) */
#define KVC_TCD_MAX_Q 32             /* q4 on the per-warp kernel up to this many query vectors per KV head at head
                                        dims 64 and 128 (in blocks of 16 beyond 8; the environment variable
                                        KVA_CUDA_TCD_MAX_Q sets it per context at every head dim) */
#define KVC_TCD256_MAX_Q 16          /* ... at head dim 256: beyond, the warpgroup kernel is faster (H200, 8/4/256
                                        128k L=16: 126.2 us against 148.3; 24/4/256 128k L=4: 124.0 against 146.2;
                                        at 32/8/128 128k L=8 the per-warp kernel stays ahead: 160.3 against 179.1) */
#define KVC_WG_MIN_Q 9               /* q4 at head dims 64 / 128 / 256 on the warpgroup verify kernel from this many
                                        query vectors per KV head, where the per-warp kernel does not take the call
                                        (sm_90 only; the environment variable KVA_CUDA_WG_MIN_Q sets it per
                                        context, < 0: never): faster than the narrow kernel (H200, 16 vectors:
                                        8/4/256 32k 44.1 us against 63.5, 32/8/128 16k 33.7 against 43.2, 32/8/64
                                        16k 26.2 against 35.4; 12 vectors: 24/4/256 32k 43.4 against 62.5) */
#define KVC_WG_FLOAT_MIN_Q 16        /* bf16 / f16 rows (queries of the same type) at head dims 64 / 128 on the
                                        warpgroup kernel from this many query vectors per KV head (sm_90 only; the
                                        environment variable KVA_CUDA_WG_BF16_MIN_Q sets it per context at every
                                        head dim, < 0: never); below, the narrow kernel (H100, 4 vectors: 32/8/128
                                        paged/16 128k 199.5 us against 210.0 there; 32/8/64 paged 387 vs 411) */
#define KVC_WG256_MIN_Q 2            /* ... at head dim 256 from this many: faster there than the fused kernel's
                                        2-vector instance (H200, bf16 8/4/256 32k B=16 paged/16: 673.2 us against
                                        724.5) and the narrow kernel (H100, 24/4/256: 736.7 against 1064.7); one
                                        vector: the fused kernel */
#define KVC_WG512_MIN_Q 3            /* ... at head dim 512 (kvc_wg512_kernel) from this many (the same variable sets
                                        it): below, the fused kernel (H200, 16/8/512 bf16 32k: 2 vectors at 86.7 %
                                        of copy); from 3 its 4-vector instance reads at ~31 % (8/2/512 bf16 32k:
                                        103.2 us where the warpgroup kernel takes 32 vectors in 75.7) */
#define KVC_WG_FP8_MIN_Q 16          /* fp8 rows (e4m3 or e5m2, both alike) at head dims 64 / 128 / 256 on the
                                        warpgroup kernel from this many query vectors per KV head (sm_90 only; the
                                        environment variable KVA_CUDA_WG_FP8_MIN_Q sets it per context, < 0:
                                        never); below, the decode instance (up to 8) and the wide kernel */
#define KVC_TC_FLOAT_MIN_Q 3         /* bf16 / f16 K/V on the tensor-core kernel from 3 query vectors per KV
                                        head (P in bf16 / f16: the bf16 allowance); at 2 vectors the fused
                                        kernel reads at the copy bandwidth (H200) */
#define KVC_TC_FLOAT_MIN_Q_TABLE 2   /* ... and from 2 over BLOCK_TABLE views at head dims <= 128, where the
                                        fused kernel's 2-vector instance read late through per-lane table
                                        loads (at D = 256 it stays; the environment variable
                                        KVA_CUDA_TC_TABLE_MIN_Q sets it per context: 3 sends 2 vectors at
                                        D = 128 to the fused kernel, whose staged loop KVA_CUDA_FUSED_RING
                                        turns on) */
#define KVC_TC_FLOAT_MIN_Q_D64 2     /* ... and from 2 at head dim 64, where the fused kernel reads at 61 % of
                                        copy */

#define KVC_GRID_YZ_MAX 65535LL /* gridDim.y and gridDim.z of a launch */
#define KVC_INT_MAX 0x7fffffffLL  /* gridDim.x, and the int fields of kvc_args */

#define KVC_NQW 4 /* QW in {1, 2, 4, 8} */
struct kvc_state {
  int sm_count;
  int cc_major, cc_minor;
  int occupancy[KVC_NFMT][2][KVC_NQW]; /* resident fused blocks per SM by [fmt][E/16][log2 QW]; 0 = not asked */
  int tc_occupancy[6][KVC_TC_NDIMS][5]; /* resident tensor-core blocks per SM by [q4, bf16, q8, f16, e4m3, e5m2][head dim]
                                          [8, 32, 48 vectors, 8 and 32 with the compiled group size] */
  int tc_smem[6][KVC_TC_NDIMS][5];      /* ... for this dynamic shared memory (re-asked when it changes) */
  int tcd_occupancy[3][4][2];           /* resident per-warp q4 blocks per SM by [head dim 128, 256, 64][log2 gpt, 3: 16
                                           vectors][table] */
  long long tcd_min_work;               /* token-heads from which q4 decode takes the per-warp kernel (< 0: never) */
  int tcd_max_q[2];                     /* query vectors per KV head up to which q4 takes the per-warp kernel, by
                                           [head dim < 256, 256] */
  int wg_min_q;                         /* query vectors per KV head from which q4 takes the warpgroup kernel (< 0: never) */
  int wg_float_min_q;                   /* ... bf16 / f16 rows at head dims 64 / 128 (< 0: never) */
  int wg256_min_q;                      /* ... bf16 / f16 rows at head dim 256 (< 0: never) */
  int wg512_min_q;                      /* ... bf16 / f16 rows at head dim 512 (< 0: never) */
  int wg_fp8_min_q;                     /* ... fp8 rows (< 0: never) */
  int wg_occupancy[5][4], wg_smem[5][4]; /* its resident blocks per SM by [q4, bf16, f16, e4m3, e5m2][head dim 128,
                                            256, 64, 512 (16-bit rows)], for that shared memory */
  int ring_bytes;                       /* the fused kernel's staged BLOCK_TABLE loop (kvc_fused_ring_tok): bytes a ring
                                           slot aims at (KVA_CUDA_FUSED_RING), 0: off */
  int tc_table_min_q;                   /* KVC_TC_FLOAT_MIN_Q_TABLE, or the environment's value */
  int tc_waves;                         /* the tensor-core kernels' split plan: waves considered (KVC_TC_WAVES) */
  long long tc_min_split;               /* ... fewest tokens per split (KVC_TC_MIN_SPLIT_TOKENS) */
  int ring_occupancy[2][2], ring_smem[2][2]; /* its resident blocks per SM by [bf16, f16][QW 1, 2], for that shared
                                                memory */
};

static int kvc_cuda_err(cudaError_t e, const char *what) {
  return kva_seterr(KVA_ECUDA, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
}

extern "C" int kva_cuda_device_count(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError(); /* no driver / no device: not an error here */
    return 0;
  }
  return n;
}

extern "C" int kva_cuda_device_info(int device, char *name, size_t name_len, size_t *total_bytes) {
  kva_clearerr();
  int n = kva_cuda_device_count();
  if (device < 0 || device >= n)
    return kva_seterr(KVA_ENODEVICE, "device = %d, but %d CUDA device(s) are visible", device, n);
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return kvc_cuda_err(e, "cudaGetDeviceProperties");
  if (name && name_len) {
    strncpy(name, prop.name, name_len - 1);
    name[name_len - 1] = '\0';
  }
  if (total_bytes) *total_bytes = prop.totalGlobalMem;
  return 0;
}

extern "C" int kva_cuda_context_init(kva_context *ctx) {
  int n = kva_cuda_device_count();
  if (n == 0) return kva_seterr(KVA_ENODEVICE, "opts.backend = CUDA, but no CUDA device is visible");
  if (ctx->device < 0 || ctx->device >= n)
    return kva_seterr(KVA_ENODEVICE, "opts.device = %d, but %d CUDA device(s) are visible", ctx->device, n);
  cudaError_t e = cudaSetDevice(ctx->device);
  if (e != cudaSuccess) return kvc_cuda_err(e, "cudaSetDevice(opts.device)");
  kvc_state *st = (kvc_state *)calloc(1, sizeof *st);
  if (!st) return kva_seterr(KVA_ENOMEM, "CUDA context state");
  if ((e = cudaDeviceGetAttribute(&st->sm_count, cudaDevAttrMultiProcessorCount, ctx->device)) != cudaSuccess ||
      (e = cudaDeviceGetAttribute(&st->cc_major, cudaDevAttrComputeCapabilityMajor, ctx->device)) !=
          cudaSuccess ||
      (e = cudaDeviceGetAttribute(&st->cc_minor, cudaDevAttrComputeCapabilityMinor, ctx->device)) !=
          cudaSuccess) {
    free(st);
    return kvc_cuda_err(e, "cudaDeviceGetAttribute");
  }
  const char *ev = getenv("KVA_CUDA_TCD_MIN_WORK"); /* tuning and tests: see KVC_TCD_MIN_WORK */
  st->tcd_min_work = ev && *ev ? strtoll(ev, NULL, 0) : KVC_TCD_MIN_WORK;
  ev = getenv("KVA_CUDA_TCD_MAX_Q"); /* tuning and tests: see KVC_TCD_MAX_Q (below 8: 8) */
  st->tcd_max_q[0] = ev && *ev ? (int)strtol(ev, NULL, 0) : KVC_TCD_MAX_Q;
  st->tcd_max_q[1] = ev && *ev ? st->tcd_max_q[0] : KVC_TCD256_MAX_Q;
  for (int i = 0; i < 2; ++i)
    if (st->tcd_max_q[i] < 8) st->tcd_max_q[i] = 8;
  ev = getenv("KVA_CUDA_WG_MIN_Q"); /* tuning and tests: see KVC_WG_MIN_Q */
  st->wg_min_q = st->cc_major == 9 && st->cc_minor == 0 ? (ev && *ev ? (int)strtol(ev, NULL, 0) : KVC_WG_MIN_Q) : -1;
  ev = getenv("KVA_CUDA_WG_BF16_MIN_Q"); /* tuning and tests: see KVC_WG_FLOAT_MIN_Q */
  st->wg_float_min_q =
      st->cc_major == 9 && st->cc_minor == 0 ? (ev && *ev ? (int)strtol(ev, NULL, 0) : KVC_WG_FLOAT_MIN_Q) : -1;
  st->wg256_min_q = st->cc_major == 9 && st->cc_minor == 0 ? (ev && *ev ? (int)strtol(ev, NULL, 0) : KVC_WG256_MIN_Q) : -1;
  st->wg512_min_q = st->cc_major == 9 && st->cc_minor == 0 ? (ev && *ev ? (int)strtol(ev, NULL, 0) : KVC_WG512_MIN_Q) : -1;
  ev = getenv("KVA_CUDA_FUSED_RING"); /* tuning and tests: the bytes a slot of the staged BLOCK_TABLE loop aims
                                        at; unset or 0: the loop off (launch.cuh, KVC_RING_SLOTS) */
  st->ring_bytes = ev && *ev ? (int)strtol(ev, NULL, 0) : 0;
  if (st->ring_bytes < 0) st->ring_bytes = 0;
  ev = getenv("KVA_CUDA_TC_TABLE_MIN_Q"); /* tuning: see KVC_TC_FLOAT_MIN_Q_TABLE (below 2: 2) */
  st->tc_table_min_q = ev && *ev ? (int)strtol(ev, NULL, 0) : KVC_TC_FLOAT_MIN_Q_TABLE;
  if (st->tc_table_min_q < 2) st->tc_table_min_q = 2;
  ev = getenv("KVA_CUDA_TC_WAVES"); /* tuning: see KVC_TC_WAVES (1 to KVC_TC_MAX_WAVES) */
  st->tc_waves = ev && *ev ? (int)strtol(ev, NULL, 0) : KVC_TC_WAVES;
  if (st->tc_waves < 1) st->tc_waves = 1;
  if (st->tc_waves > KVC_TC_MAX_WAVES) st->tc_waves = KVC_TC_MAX_WAVES;
  ev = getenv("KVA_CUDA_TC_MIN_SPLIT"); /* tuning: see KVC_TC_MIN_SPLIT_TOKENS (whole stages, >= one) */
  st->tc_min_split = ev && *ev ? strtoll(ev, NULL, 0) : KVC_TC_MIN_SPLIT_TOKENS;
  if (st->tc_min_split < KVC_TC_STEP) st->tc_min_split = KVC_TC_STEP;
  ev = getenv("KVA_CUDA_WG_FP8_MIN_Q"); /* tuning and tests: see KVC_WG_FP8_MIN_Q */
  st->wg_fp8_min_q =
      st->cc_major == 9 && st->cc_minor == 0 ? (ev && *ev ? (int)strtol(ev, NULL, 0) : KVC_WG_FP8_MIN_Q) : -1;
  ctx->cuda = st;
  return 0;
}

extern "C" void kva_cuda_context_free(kva_context *ctx) {
  free(ctx->cuda);
  ctx->cuda = NULL;
}

extern "C" int kva_cuda_workspace_alloc(kva_context *ctx, size_t bytes, void **ptr) {
  (void)ctx;
  *ptr = NULL;
  cudaError_t e = cudaMalloc(ptr, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return kva_seterr(KVA_ENOMEM, "cudaMalloc of a %zu-byte workspace: %s", bytes, cudaGetErrorString(e));
  }
  return 0;
}

extern "C" void kva_cuda_workspace_free(kva_context *ctx, void *ptr) {
  (void)ctx;
  cudaFree(ptr);
}

/* ---- the selector and the plan ---- */
static int kvc_fmt_of(const kva_kv *kv) {
  switch (kv->bits) {
  case 0:
    switch (kv->data.dtype) {
    case KVA_F32: return KVC_F32;
    case KVA_F16: return KVC_F16;
    case KVA_F8E4M3: return KVC_E4M3;
    case KVA_F8E5M2: return KVC_E5M2;
    default: return KVC_BF16;
    }
  case 2: return KVC_Q2;
  case 4: return KVC_Q4;
  case 8: return KVC_Q8;
  default: return -1;
  }
}
static int kvc_bits_per_elem(int fmt) {
  static const int bpe[KVC_NFMT] = {32, 16, 16, 2, 4, 8, 8, 8};
  return bpe[fmt];
}
static int kvc_pow2_ceil(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}
static int kvc_log2(int x) {
  int l = 0;
  while ((1 << l) < x) ++l;
  return l;
}

/* Are all rows of kv aligned for the fused kernel's E-element vector loads? */
static bool kvc_rows_aligned(const kva_kv *kv, int E) {
  const int fmt = kvc_fmt_of(kv);
  const int bytes = kvc_bits_per_elem(fmt) * E / 8;
  const long long align = bytes >= 16 ? 16 : bytes;
  if ((uintptr_t)kv->data.data % align) return false;
  for (int d = 0; d < 3; ++d)
    if (kv->data.stride[d] % align) return false;
  return true;
}

static int kvc_fused_occupancy(int fmt, int E, int QW) {
  switch (fmt) {
  case KVC_F32: return kvc_fused_occupancy_fmt<KVC_F32>(E, QW);
  case KVC_F16: return kvc_fused_occupancy_fmt<KVC_F16>(E, QW);
  case KVC_BF16: return kvc_fused_occupancy_fmt<KVC_BF16>(E, QW);
  case KVC_Q2: return kvc_fused_occupancy_fmt<KVC_Q2>(E, QW);
  case KVC_Q4: return kvc_fused_occupancy_fmt<KVC_Q4>(E, QW);
  case KVC_Q8: return kvc_fused_occupancy_fmt<KVC_Q8>(E, QW);
  case KVC_E4M3: return kvc_fused_occupancy_fmt<KVC_E4M3>(E, QW);
  case KVC_E5M2: return kvc_fused_occupancy_fmt<KVC_E5M2>(E, QW);
  default: return 0;
  }
}

/* Resident blocks per SM of an instance, asked once per context. */
static int kvc_blocks_per_sm(const kva_context *ctx, int fmt, int E, int QW) {
  kvc_state *st = ctx ? (kvc_state *)ctx->cuda : NULL;
  if (!st) return 1;
  int *slot = &st->occupancy[fmt][E == 16][kvc_log2(QW)];
  if (*slot == 0) *slot = kvc_fused_occupancy(fmt, E, QW);
  return *slot > 0 ? *slot : 1;
}

/* Does the tensor-core kernel cover the problem? Dk = Dv in {64, 128,
 * 256}, rows aligned for 16-byte copies, the query's dims contiguous, and
 * either bf16 or f16 K/V rows with queries of the same type for at least
 * KVC_TC_FLOAT_MIN_Q query vectors per KV head (KVC_TC_FLOAT_MIN_Q_D64 at head
 * dim 64, KVC_TC_FLOAT_MIN_Q_TABLE for block tables at 128; the fused kernel reads
 * 16-bit decode at 1-2 vectors at the copy bandwidth already; from 3 its
 * register-heavy 4-vector instances hold too few loads in flight: 32 % of
 * copy),
 * or bf16 queries over 4-bit or 8-bit K/V with bf16 scales and biases (with
 * f16/f32 ones the bf16 rounding of K measured up to 1.5x the bf16
 * allowance: fused path), 2 to 8 groups per row (scale rows of 4, 8 or 16
 * bytes: one cp.async each) or one (head dim 64 with group 64, 128 with
 * 128: entries of 8 tokens per cp.async, kvc_one_group_rows). Its products are bf16 (f16 for f16 rows):
 * tests compare it at the bf16 allowance. Or bf16 queries over fp8 K/V rows
 * (e4m3 / e5m2 alike for K and V, head dims 64 to 256, every query count:
 * the fused kernel read fp8 decode at 46 % of copy on the H200), their f32
 * scales per row, shared (strides 0) or none, 4-byte aligned: K and V
 * converted to bf16 with the row scale applied ("[K,V,P bf16]"). Returns
 * the head-dim index or -1 and sets *fmt (KVC_Q4, KVC_Q8, KVC_BF16,
 * KVC_F16, KVC_E4M3 or KVC_E5M2). (The caller has checked the fused path.) */
static bool kvc_aligned(const kva_tensor *t, long long align) {
  if ((uintptr_t)t->data % align) return false;
  for (int d = 0; d < 3; ++d)
    if (t->stride[d] % align) return false;
  return true;
}
/* Scale and bias entries of one group per row, as the stage loader copies
 * them (8 tokens per 16-byte cp.async, aligned in memory: kvc_tc_e0 in
 * tc_stage.cuh): adjacent tokens 2 bytes apart in all four arrays; over a
 * block table, 16-byte aligned block and head starts and blocks of a
 * multiple of 8 tokens (no piece spans two blocks); contiguous, the four
 * arrays alike modulo 16 bytes (base and strides), so one entry offset per
 * sequence and head holds for all. */
static bool kvc_one_group_rows(const kva_kv_view *kv) {
  const kva_tensor *t[4] = {&kv->k.scales, &kv->k.biases, &kv->v.scales, &kv->v.biases};
  const bool tbl = kv->layout == KVA_LAYOUT_BLOCK_TABLE;
  if (tbl && kv->k.data.shape[2] % 8) return false;
  const long long r0[3] = {(long long)((uintptr_t)t[0]->data % 16), t[0]->stride[0] % 16, t[0]->stride[1] % 16};
  for (int i = 0; i < 4; ++i) {
    if (t[i]->stride[2] != 2) return false;
    const long long r[3] = {(long long)((uintptr_t)t[i]->data % 16), t[i]->stride[0] % 16, t[i]->stride[1] % 16};
    for (int j = 0; j < 3; ++j)
      if (tbl ? r[j] != 0 : r[j] != r0[j]) return false;
  }
  return true;
}
/* q8 on the narrow kernel's decode instance: head dim 128 or 256 with the
 * warp's D / 4 dims of V inside one group (kvc_pv_step_q8: an even number of
 * 16-dim m-tiles per warp). At head dim 64 up to 8 query vectors run the
 * wide kernel (K and V dequantized to bf16 once per stage; its mma columns
 * mostly padding), faster there than the fused kernel; at D 256 with group
 * 32 the fused kernel stays. */
static bool kvc_q8_narrow(const kva_problem *p) {
  return p->Dk >= 128 && p->Dk / 4 <= p->kv->v.group_size;
}
static int kvc_tc_dim_index(const kva_problem *p, int table_min_q, int wg_min_q, int *fmt) {
  const kva_kv_view *kv = p->kv;
  if (p->q->stride[3] != 2 || p->Dk != p->Dv) return -1;
  const kva_kv *ops[2] = {&kv->k, &kv->v};
  const kva_dtype qt = p->q->dtype;
  const kva_dtype kt = kv->k.data.dtype;
  if (kv->k.bits == 0 && kv->v.bits == 0 && (kt == KVA_F8E4M3 || kt == KVA_F8E5M2)) {
    if (qt != KVA_BF16 || kv->v.data.dtype != kt || p->Dk == 512) return -1;
    for (int i = 0; i < 2; ++i)
      if (!kvc_aligned(&ops[i]->data, 16) || (ops[i]->scales.data && !kvc_aligned(&ops[i]->scales, 4))) return -1;
    *fmt = kt == KVA_F8E4M3 ? KVC_E4M3 : KVC_E5M2;
  } else if (kv->k.bits == 0 && kv->v.bits == 0) {
    /* bf16 or f16 rows with queries of the same type (the mma's operands) */
    if ((qt != KVA_BF16 && qt != KVA_F16) || kv->k.data.dtype != qt || kv->v.data.dtype != qt) return -1;
    /* head dim 512: the warpgroup kernel only (kvc_wg512_kernel; two 64-row slots of K and V rows would take
     * 266 KB of the narrow kernel's shared memory), from KVC_WG512_MIN_Q vectors (kvc_select) */
    int minq = p->Dk == 64                                          ? KVC_TC_FLOAT_MIN_Q_D64
               : kv->layout == KVA_LAYOUT_BLOCK_TABLE && p->Dk <= 128 ? table_min_q
                                                                      : KVC_TC_FLOAT_MIN_Q;
    /* the warpgroup kernel from fewer (kvc_select: its masks) */
    if (wg_min_q > 0 && wg_min_q < minq && p->mask.kind != KVA_MASK_ARRAY && !p->mask.segments.data) minq = wg_min_q;
    if (p->rep * p->L < minq || !kvc_aligned(&kv->k.data, 16) || !kvc_aligned(&kv->v.data, 16)) return -1;
    *fmt = qt == KVA_BF16 ? KVC_BF16 : KVC_F16;
  } else {
    if (qt != KVA_BF16 || kv->k.bits != kv->v.bits || (kv->k.bits != 4 && kv->k.bits != 8)) return -1;
    if (kv->k.scales.dtype != KVA_BF16 || kv->v.scales.dtype != KVA_BF16) return -1;
    /* q8: up to 8 query vectors the decode instance where it applies
     * (kvc_q8_narrow), at head dim 64 the wide kernel, else the fused one;
     * beyond 8 the wide kernel (K and V dequantized to bf16) */
    if (kv->k.bits == 8 && p->rep * p->L <= 8 && p->Dk != 64 && !kvc_q8_narrow(p)) return -1;
    *fmt = kv->k.bits == 8 ? KVC_Q8 : KVC_Q4;
    if (p->Dk == 512 && *fmt != KVC_Q4) return -1; /* head dim 512: the q4 decode instance only */
    const int gk = (int)(p->Dk / kv->k.group_size), gv = (int)(p->Dv / kv->v.group_size);
    if ((gk == 1) != (gv == 1)) return -1; /* one group per row: K and V alike (one stage layout) */
    if (gk == 1 && !kvc_one_group_rows(kv)) return -1;
    for (int i = 0; i < 2; ++i) {
      const int groups = i ? gv : gk;
      if (groups > 8 || !kvc_aligned(&ops[i]->data, 16)) return -1;
      if (groups > 1 && (!kvc_aligned(&ops[i]->scales, 2 * groups) || !kvc_aligned(&ops[i]->biases, 2 * groups)))
        return -1;
    }
  }
  for (int i = 0; i < KVC_TC_NDIMS; ++i)
    if (p->Dk == (KVC_TC_MIN_D << i)) return i;
  return -1;
}

/* kind: 0, 1, 2 for ntm = 1, KVC_TC_NTM_MID, KVC_TC_NTM_WIDE; g: the compiled group size (0: run time; kinds 0, 1 only) */
static int kvc_tc_blocks_per_sm(const kva_context *ctx, int fmt, int di, int kind, int ntm, int g, int smem) {
  kvc_state *st = ctx ? (kvc_state *)ctx->cuda : NULL;
  if (!st) return 1;
  const int fi = fmt == KVC_BF16 ? 1 : fmt == KVC_Q8 ? 2 : fmt == KVC_F16 ? 3 : fmt == KVC_E4M3 ? 4 : fmt == KVC_E5M2 ? 5 : 0;
  const int ki = g ? 3 + kind : kind;
  int *slot = &st->tc_occupancy[fi][di][ki];
  if (*slot == 0 || st->tc_smem[fi][di][ki] != smem) {
    *slot = kvc_tc_occupancy(fmt, KVC_TC_MIN_D << di, ntm, g, smem);
    st->tc_smem[fi][di][ki] = smem;
  }
  return *slot > 0 ? *slot : 1;
}

/* The fused kernel's staged BLOCK_TABLE loop (attn_fused.cuh, run_ring) for plan pl (E, QW, lanes
 * set): table rows per ring slot, or 0 (rows loaded per lane through the table). It takes bf16 / f16
 * rows at E = 16 and QW <= 2 (kvc_fused_ring_inst) over a block size that is a power of two; a
 * slot holds C rows of K and V, C the power of two nearest below st->ring_bytes / (2 (Dk + Dv))
 * (the bytes KVA_CUDA_FUSED_RING sets), at least one step of a warp (TPW U rows) and at most a block (so a chunk of C rows aligned
 * to C lies in one pool block). */
static int kvc_fused_ring_tok(const kva_context *ctx, const kva_problem *p, const kvc_plan &pl) {
  const kvc_state *st = ctx ? (const kvc_state *)ctx->cuda : NULL;
  const kva_kv_view *kv = p->kv;
  if (!st || st->ring_bytes <= 0 || kv->layout != KVA_LAYOUT_BLOCK_TABLE) return 0;
  if ((pl.fmt != KVC_BF16 && pl.fmt != KVC_F16) || pl.E != 16 || pl.QW > 2) return 0;
  const long long bsz = kv->k.data.shape[2];
  if (bsz <= 0 || (bsz & (bsz - 1))) return 0;
  int C = 1;
  while (2LL * C * 2 * (p->Dk + p->Dv) <= st->ring_bytes && C < (1 << 20)) C *= 2;
  const int step = (KVC_WARP >> pl.lanes_log2) * pl.unroll;
  if (C < step) C = step;
  if (C > bsz) C = (int)bsz;
  return C >= step ? C : 0;
}
static int kvc_ring_blocks_per_sm(const kva_context *ctx, int fmt, int QW, int smem) {
  kvc_state *st = ctx ? (kvc_state *)ctx->cuda : NULL;
  if (!st) return 0;
  const int fi = fmt == KVC_F16, qi = QW == 2;
  if (st->ring_smem[fi][qi] != smem) {
    st->ring_occupancy[fi][qi] = fmt == KVC_F16 ? kvc_fused_ring_occupancy_fmt<KVC_F16>(QW, smem)
                                                : kvc_fused_ring_occupancy_fmt<KVC_BF16>(QW, smem);
    st->ring_smem[fi][qi] = smem;
  }
  return st->ring_occupancy[fi][qi];
}

/* Splits: the count whose whole waves of `resident` blocks finish first,
 * costing a wave as its chunk plus KVC_WAVE_TOKENS (the fixed cost of a
 * block: queries, the first loads' latency, the state write), over 1 to
 * max_waves waves; each split at least min_tokens tokens, chunks whole steps. */
static void kvc_plan_splits(kvc_plan *pl, const kva_problem *p, long long base, long long resident, long long step,
                            int max_waves, long long min_tokens) {
  long long most = (p->N + min_tokens - 1) / min_tokens;
  if (most > KVC_MAX_SPLITS) most = KVC_MAX_SPLITS;
  long long best_chunk = 0, best_cost = 0;
  for (int waves = 1; waves <= max_waves; ++waves) {
    long long ns = waves * resident / base;
    if (ns > most) ns = most;
    if (ns < 1) ns = 1;
    long long chunk = (p->N + ns - 1) / ns;
    chunk = (chunk + step - 1) / step * step;
    const long long blocks = (p->N + chunk - 1) / chunk * base;
    const long long cost = (blocks + resident - 1) / resident * (chunk + KVC_WAVE_TOKENS);
    if (best_chunk == 0 || cost < best_cost) {
      best_chunk = chunk;
      best_cost = cost;
    }
  }
  pl->chunk = best_chunk;
  pl->nsplit = (int)((p->N + best_chunk - 1) / best_chunk);
}

/* The launch limits every kernel of a problem stays within (the general
 * kernel's grid is (L, H, B), the merge's (L * ceil(Dv / KVC_MERGE_DIMS), H,
 * B), the others' (query tiles, splits, B * KVH); kvc_args holds B, H, KVH,
 * rep, L and the pools' block size as int): KVA_EUNSUPPORTED naming the
 * dimension past its limit. B * KVH above the grid limit takes the general
 * kernel (kvc_select) rather than an error. */
static int kvc_check_limits(const kva_problem *p) {
  if (p->B > KVC_GRID_YZ_MAX)
    return kva_seterr(KVA_EUNSUPPORTED, "CUDA backend: batch B = %lld exceeds the grid limit %lld (gridDim.z)",
                      (long long)p->B, KVC_GRID_YZ_MAX);
  if (p->H > KVC_GRID_YZ_MAX)
    return kva_seterr(KVA_EUNSUPPORTED, "CUDA backend: query heads H = %lld exceed the grid limit %lld (gridDim.y)",
                      (long long)p->H, KVC_GRID_YZ_MAX);
  const long long merge_x = (long long)p->L * ((p->Dv + KVC_MERGE_DIMS - 1) / KVC_MERGE_DIMS);
  if (merge_x > KVC_INT_MAX || (long long)p->rep * p->L > KVC_INT_MAX)
    return kva_seterr(KVA_EUNSUPPORTED, "CUDA backend: query rows L = %lld: L * ceil(Dv / %d) and (H / KVH) * L = %lld "
                      "must stay below 2^31", (long long)p->L, KVC_MERGE_DIMS, (long long)p->rep * p->L);
  if (p->kv->layout == KVA_LAYOUT_BLOCK_TABLE && p->kv->k.data.shape[2] > KVC_INT_MAX)
    return kva_seterr(KVA_EUNSUPPORTED, "CUDA backend: block size %lld exceeds 2^31 - 1", (long long)p->kv->k.data.shape[2]);
  return 0;
}

/* The one selector: the per-warp q4 decode kernel, a tensor-core kernel (q4,
 * q8, bf16, f16) or the fused kernel when one covers the problem, else the
 * general kernel (plan.fmt = -1). Exact mode (p->exact) skips the
 * tensor-core kernels (pl.tc 1-3: they round P, and q or K/V): the fused or
 * general kernel, both "[exact f32]" (kvc_roundings). */
static kvc_plan kvc_select(const kva_context *ctx, const kva_problem *p) {
  kvc_plan pl;
  memset(&pl, 0, sizeof pl);
  pl.fmt = -1;
  const kva_kv_view *kv = p->kv;
  if (p->path != KVA_PATH_FUSED || kv->layout == KVA_LAYOUT_PAGED) return pl;
  if (p->B * p->KVH > KVC_GRID_YZ_MAX) return pl; /* their gridDim.z: the general kernel's grid is (L, H, B) */
  const int fk = kvc_fmt_of(&kv->k), fv = kvc_fmt_of(&kv->v);
  if (fk < 0 || fk != fv) return pl;
  const int dmax = (int)(p->Dk > p->Dv ? p->Dk : p->Dv);
  const int Q = (int)(p->rep * p->L);
  kvc_state *st = ctx ? (kvc_state *)ctx->cuda : NULL;
  const int sms = st ? st->sm_count : 1;
  int tcf = -1;
  const int wg16_min = !st ? -1 : p->Dk == 512 ? st->wg512_min_q : p->Dk == 256 ? st->wg256_min_q : st->wg_float_min_q;
  const int di =
      p->exact ? -1 : kvc_tc_dim_index(p, st ? st->tc_table_min_q : KVC_TC_FLOAT_MIN_Q_TABLE, wg16_min, &tcf);
  /* di < 0: no tensor-core kernel */
  const long long tcd_min = st ? st->tcd_min_work : KVC_TCD_MIN_WORK;
  const int tc_waves = st ? st->tc_waves : KVC_TC_WAVES;
  const long long tc_min_split = st ? st->tc_min_split : KVC_TC_MIN_SPLIT_TOKENS;
  const int tcd_max_q = st ? st->tcd_max_q[p->Dk == 256] : p->Dk == 256 ? KVC_TCD256_MAX_Q : KVC_TCD_MAX_Q;
  if (di >= 0 && tcf == KVC_Q4 && Q <= tcd_max_q &&
      (p->Dk == 64 || p->Dk == 128 || p->Dk == 256) &&
      kv->k.group_size == KVC_TC_GROUP && kv->v.group_size == KVC_TC_GROUP && tcd_min >= 0 &&
      p->B * p->KVH * p->N >= tcd_min) {
    /* q4 decode and short verify (up to tcd_max_q query vectors per KV head) with MLX's default group at head
     * dims 64 (one group per row: kvc_tc_dim_index checked kvc_one_group_rows), 128 and 256: the
     * per-warp kernel (each warp owns whole 16-token tiles: no barrier,
     * stage max or P round trip per stage) */
    pl.fmt = KVC_Q4;
    pl.tc = 2;
    pl.QW = kvc_tcd_hi(Q) ? 16 : 8;
    pl.qtiles = (Q + pl.QW - 1) / pl.QW;
    pl.group = KVC_TC_GROUP;
    const int gpt = kvc_tcd_gpt((int)p->Dk, Q);
    int per_sm = 1;
    if (st) {
      const int tbl = kv->layout == KVA_LAYOUT_BLOCK_TABLE;
      const int hi = kvc_tcd_hi(Q);
      int *slot = &st->tcd_occupancy[p->Dk == 256 ? 1 : p->Dk == 128 ? 0 : 2][hi ? 3 : kvc_log2(gpt)][tbl];
      if (*slot == 0) *slot = kvc_tcd_occupancy((int)p->Dk, gpt, hi, tbl);
      per_sm = *slot > 0 ? *slot : 1;
    }
    kvc_plan_splits(&pl, p, p->B * p->KVH * pl.qtiles, (long long)sms * per_sm, KVC_TC_STEP, tc_waves,
                    tc_min_split);
    return pl;
  }
  const bool wg_float = tcf == KVC_BF16 || tcf == KVC_F16, wg_fp8 = tcf == KVC_E4M3 || tcf == KVC_E5M2;
  const int wg_min = !st         ? -1
                     : wg_float  ? wg16_min
                     : wg_fp8    ? st->wg_fp8_min_q
                     : tcf == KVC_Q4 ? st->wg_min_q
                                     : -1;
  const bool wg512 = wg_float && p->Dk == 512; /* 16-bit rows at head dim 512: the warpgroup kernel or the fused one */
  const bool wg_blocks = !wg_float || kv->layout != KVA_LAYOUT_BLOCK_TABLE ||
                         kv->k.data.shape[2] >= KVC_WG_FLOAT_RUN(p->Dk); /* 16-bit rows: a copy run in <= 2 blocks */
  if (di >= 0 && (p->Dk <= 256 || wg512) && wg_min >= 0 && Q >= wg_min && p->mask.kind != KVA_MASK_ARRAY &&
      !p->mask.segments.data && wg_blocks) {
    /* q4, fp8, bf16 and f16 verify-sized calls (and wide GQA, cascade prefixes, tree verify) on Hopper, causal or
     * tree without image segments, or no mask:
     * the warpgroup kernel (wgmma on bf16 tiles converted once per element
     * from q4 or fp8, or the 16-bit rows copied into the tiles; 64 query
     * vectors per block) when its shared memory fits */
    const int smem = wg_float || wg_fp8 ? kvc_wg_smem(tcf, (int)p->Dk, 0, 0)
                                        : kvc_wg_smem(tcf, (int)p->Dk, (int)(p->Dk / kv->k.group_size),
                                                      (int)(p->Dv / kv->v.group_size));
    const int wi = p->Dk == 512 ? 3 : p->Dk == 256 ? 1 : p->Dk == 128 ? 0 : 2,
              wf = tcf == KVC_BF16 ? 1 : tcf == KVC_F16 ? 2 : tcf == KVC_E4M3 ? 3 : tcf == KVC_E5M2 ? 4 : 0;
    if (smem <= KVC_TC_SMEM_MAX) {
      if (st->wg_smem[wf][wi] != smem) {
        st->wg_occupancy[wf][wi] = kvc_wg_occupancy(tcf, (int)p->Dk, smem);
        st->wg_smem[wf][wi] = smem;
      }
      if (st->wg_occupancy[wf][wi] > 0) {
        pl.fmt = tcf;
        pl.tc = 3;
        pl.QW = 64;
        pl.qtiles = (Q + pl.QW - 1) / pl.QW;
        kvc_plan_splits(&pl, p, p->B * p->KVH * pl.qtiles, (long long)sms * st->wg_occupancy[wf][wi], KVC_TC_STEP,
                        tc_waves, tc_min_split);
        return pl;
      }
    }
  }
  if (di >= 0 && !wg512) {
    /* the narrow kernel with one n-tile of 8 query vectors per block for
     * decode-sized rep * L; q4 up to 32 vectors: its 4-n-tile instance; else
     * the wide kernel (48 vectors per block: K/V staged and dequantized once
     * per 48); q4 at head dim 512: the decode instance, 8 vectors per block */
    const int kind = p->Dk == 512 || (Q <= 8 && (tcf != KVC_Q8 || kvc_q8_narrow(p))) ? 0
                     : tcf == KVC_Q4 && Q < KVC_TC_Q4_WIDE_MIN_Q     ? 1
                                                                     : 2;
    const int ntm = kind == 0 ? 1 : kind == 1 ? KVC_TC_NTM_MID : KVC_TC_NTM_WIDE;
    const int smem = tcf == KVC_BF16 || tcf == KVC_F16 || tcf == KVC_E4M3 || tcf == KVC_E5M2
                         ? kvc_tc_smem(tcf, (int)p->Dk, 0, 0, ntm)
                                     : kvc_tc_smem(tcf, (int)p->Dk, (int)(p->Dk / kv->k.group_size),
                                                   (int)(p->Dv / kv->v.group_size), ntm);
    if (smem <= KVC_TC_SMEM_MAX) {
      pl.fmt = tcf;
      pl.tc = 1;
      pl.QW = 8 * ntm;
      pl.qtiles = (Q + pl.QW - 1) / pl.QW;
      /* the narrow kernel's quantized instances with MLX's default group:
       * those with it compiled in (q4 decode and 32-vector, q8 decode) */
      pl.group = (tcf == KVC_Q4 || tcf == KVC_Q8) && kind <= 1 && kv->k.group_size == KVC_TC_GROUP &&
                         kv->v.group_size == KVC_TC_GROUP
                     ? KVC_TC_GROUP
                     : 0;
      const long long resident = (long long)sms * kvc_tc_blocks_per_sm(ctx, tcf, di, kind, ntm, pl.group, smem);
      kvc_plan_splits(&pl, p, p->B * p->KVH * pl.qtiles, resident, KVC_TC_STEP, tc_waves, tc_min_split);
      return pl;
    }
  }
  /* 16 elements per lane for wide rows, and for small query tiles (fewer
   * lanes per row: per-row shuffles and softmax work amortized over more
   * rows); 8 otherwise (registers: QW * E q values and outputs per lane). */
  int E = dmax > 8 * KVC_WARP || (Q <= 2 && dmax >= 128) ? 16 : 8;
  /* fp8 rows 8- but not 16-byte aligned (row strides of D + 8 bytes): 8 elements per lane */
  if (E == 16 && dmax <= 8 * KVC_WARP && (fk == KVC_E4M3 || fk == KVC_E5M2) &&
      (!kvc_rows_aligned(&kv->k, 16) || !kvc_rows_aligned(&kv->v, 16)))
    E = 8;
  if (dmax > E * KVC_WARP || p->Dk % E || p->Dv % E) return pl;
  if (!kvc_rows_aligned(&kv->k, E) || !kvc_rows_aligned(&kv->v, E)) return pl;
  const int qw_max = E == 8 ? KVC_FUSED_QW_E8 : KVC_FUSED_QW_E16;
  pl.fmt = fk;
  pl.E = E;
  pl.QW = Q >= qw_max ? qw_max : kvc_pow2_ceil(Q);
  pl.qtiles = (Q + pl.QW - 1) / pl.QW;
  pl.unroll = kvc_unroll(E, pl.QW);
  pl.lanes_log2 = kvc_log2(kvc_pow2_ceil(dmax / E));
  long long step = (long long)KVC_FUSED_WARPS * (KVC_WARP >> pl.lanes_log2) * pl.unroll;
  const long long base = p->B * p->KVH * pl.qtiles;
  int per_sm = 0;
  pl.ring = kvc_fused_ring_tok(ctx, p, pl);
  if (pl.ring) { /* the staged instance where its shared memory lets it run: a step is a chunk per warp */
    per_sm = kvc_ring_blocks_per_sm(ctx, pl.fmt, pl.QW, kvc_fused_ring_smem((int)p->Dk, (int)p->Dv, pl.ring));
    if (per_sm > 0) step = (long long)KVC_FUSED_WARPS * pl.ring;
    else pl.ring = 0;
  }
  if (!pl.ring) per_sm = kvc_blocks_per_sm(ctx, pl.fmt, E, pl.QW);
  /* Splits: whole waves of resident blocks with the least idle tail. */
  const long long resident = (long long)sms * per_sm;
  kvc_plan_splits(&pl, p, base, resident, step, KVC_MAX_WAVES, KVC_MIN_SPLIT_TOKENS);
  return pl;
}

/* Workspace bytes of a plan: the partial states [nsplit][B][H][L][Dv + 2]
 * when it has several splits (KVA_ESHAPE when that does not fit size_t);
 * a fused rotated output needs none of its own (the kernels store rotated
 * states or, with one split, the rotated output). */
static int kvc_ws_bytes(const kva_problem *p, const kvc_plan &pl, size_t *bytes) {
  *bytes = 0;
  if (pl.fmt < 0 || pl.nsplit <= 1) return 0;
  bool ok = true;
  size_t n = kva_size_mul_chk((size_t)pl.nsplit, (size_t)p->B, &ok);
  n = kva_size_mul_chk(n, (size_t)p->H, &ok);
  n = kva_size_mul_chk(n, (size_t)p->L, &ok);
  n = kva_size_mul_chk(n, (size_t)KVA_STATE_FLOATS(p->Dv) * sizeof(float), &ok);
  if (!ok || n > KVA_MAX_WORKSPACE)
    return kva_seterr(KVA_ESHAPE, "problem too large: its CUDA workspace (%d splits, B = %lld, H = %lld, L = %lld) "
                      "exceeds 2^48 bytes", pl.nsplit, (long long)p->B, (long long)p->H, (long long)p->L);
  *bytes = (n + KVC_WS_ALIGN - 1) / KVC_WS_ALIGN * KVC_WS_ALIGN;
  return 0;
}

/* The roundings of the kernel pl runs, as kva_attention_kernel's trailing
 * bracket (kvattn.h): the fused and general kernels multiply in f32; the
 * tensor-core kernels round P to the rows' 16-bit type, and
 * - 16-bit float rows: nothing else (q, K, V are the mma operands as given);
 * - q4 / q8 decode instances (narrow, up to 8 query vectors) and the
 *   per-warp q4 kernel up to 8 vectors: q to 15 bits (two s8 parts, one
 *   scale per vector, exact integer q.k on the codes); the per-warp q4
 *   kernel at 9 to 16 vectors: q to 8 bits (one s8 part, one scale per
 *   vector and group); q4 narrow: V dequantized to bf16; q8 narrow and
 *   per-warp q4: P times the V scale in bf16, the codes exact;
 * - the 32- and 48-vector instances and the warpgroup kernel: K and V
 *   dequantized to bf16 (the warpgroup kernel over 16-bit rows: P only);
 * - fp8 rows (decode and wide instances, the warpgroup kernel): K and V as bf16 of scale * code
 *   (code exact in f16, times the f32 row scale in f32, then rounded to bf16). */
static const char *kvc_roundings(const kvc_plan &pl) {
  if (pl.fmt < 0 || !pl.tc) return "[exact f32]";
  if (pl.tc == 2) return pl.QW > 8 ? "[q int8, P bf16]" : "[q int15, P bf16]";
  if (pl.tc == 3) return pl.fmt == KVC_BF16 ? "[P bf16]" : pl.fmt == KVC_F16 ? "[P f16]" : "[K,V,P bf16]";
  if (pl.fmt == KVC_BF16) return "[P bf16]";
  if (pl.fmt == KVC_F16) return "[P f16]";
  if (pl.fmt == KVC_E4M3 || pl.fmt == KVC_E5M2) return "[K,V,P bf16]";
  if (pl.QW == 8) return pl.fmt == KVC_Q4 ? "[q int15, V,P bf16]" : "[q int15, P bf16]";
  return "[K,V,P bf16]";
}

/* Rotated calls fused (kvattn.h KVA_ATTN_ROTATED_K / _V) by every kernel
 * but the general one (the API's passes around it): V, each block's
 * combined o rotated before it is stored (kvc_emit_block: o <- H_Dv o, a
 * warp per vector, in registers), as a split state for the plain merge
 * (linear in the states) or, with one split, as out = H o / l (no merge
 * launch, no workspace); K, q rotated on load as each block stages its
 * query vectors, by the fused kernel (kvc_rotated_query_warp, any rotatable
 * head dim), the per-warp q4 kernel and the narrow kernel's q4 / q8 decode
 * instances (kvc_stage_query), the narrow kernel's other instances, the
 * wide kernel (straight into its fragment slots) and the warpgroup kernel
 * (kvc_rotated_query_rows). */
static unsigned kvc_rotate_fused(const kvc_plan &pl) {
  if (pl.fmt < 0) return 0;
  return KVA_ATTN_ROTATED_V | KVA_ATTN_ROTATED_K;
}

extern "C" unsigned kva_cuda_rotate_fused(const kva_context *ctx, const kva_problem *p) {
  if (kvc_check_limits(p) < 0) return 0;
  return kvc_rotate_fused(kvc_select(ctx, p)) & p->rotate;
}

extern "C" int kva_cuda_kernel_name(const kva_context *ctx, const kva_problem *p, char *name, size_t size) {
  static const char *const fmts[KVC_NFMT] = {"f32", "f16", "bf16", "q2", "q4", "q8", "f8e4m3", "f8e5m2"};
  const int rc = kvc_check_limits(p);
  if (rc < 0) return rc;
  const kvc_plan pl = kvc_select(ctx, p);
  const char *r = kvc_roundings(pl);
  if (pl.fmt < 0)
    snprintf(name, size, "cuda general kernel %s", r);
  else if (pl.tc == 3)
    snprintf(name, size, "cuda %s tensor-core kernel: warpgroup (wgmma), head dim %d, %d query vectors per block, %d split%s %s",
             fmts[pl.fmt], (int)p->Dk, pl.QW, pl.nsplit, pl.nsplit == 1 ? "" : "s", r);
  else if (pl.tc == 2)
    snprintf(name, size, "cuda q4 tensor-core kernel: per-warp, %d query vectors, group compiled in, %d split%s %s",
             (int)(p->rep * p->L), pl.nsplit, pl.nsplit == 1 ? "" : "s", r);
  else if (pl.tc)
    snprintf(name, size, "cuda %s tensor-core kernel: %s, %d query vectors per block%s, %d split%s %s", fmts[pl.fmt],
             pl.QW == 8 * KVC_TC_NTM_WIDE ? "wide (8 warps)" : pl.QW == 8 ? "decode instance" : "narrow",
             pl.QW, pl.group ? ", group compiled in" : "", pl.nsplit, pl.nsplit == 1 ? "" : "s", r);
  else if (pl.ring)
    snprintf(name, size,
             "cuda %s fused kernel: %d query vectors per block, %d elements per lane via a shared-memory ring (%d "
             "rows a slot), %d split%s %s",
             fmts[pl.fmt], pl.QW, pl.E, pl.ring, pl.nsplit, pl.nsplit == 1 ? "" : "s", r);
  else
    snprintf(name, size, "cuda %s fused kernel: %d query vectors per block, %d elements per lane, %d split%s %s",
             fmts[pl.fmt], pl.QW, pl.E, pl.nsplit, pl.nsplit == 1 ? "" : "s", r);
  return 0;
}

extern "C" int kva_cuda_workspace_size(const kva_context *ctx, const kva_problem *p, size_t *bytes) {
  *bytes = 0;
  const int rc = kvc_check_limits(p);
  if (rc < 0) return rc;
  return kvc_ws_bytes(p, kvc_select(ctx, p), bytes);
}

/* ---- kva_problem -> kvc_args ---- */
static void kvc_copy_strides(long long *dst, const kva_tensor *t, int n) {
  for (int d = 0; d < n; ++d) dst[d] = t->stride[d];
}

static kvc_operand kvc_operand_of(const kva_kv *kv, int E) {
  kvc_operand op;
  memset(&op, 0, sizeof op);
  op.data = (const char *)kv->data.data;
  kvc_copy_strides(op.ds, &kv->data, 3);
  op.dtype = kv->data.dtype;
  op.bits = kv->bits;
  if (kv->bits) {
    op.scales = (const char *)kv->scales.data;
    op.biases = (const char *)kv->biases.data;
    kvc_copy_strides(op.ss, &kv->scales, 3);
    kvc_copy_strides(op.bs, &kv->biases, 3);
    op.sdtype = kv->scales.dtype;
    op.group = kv->group_size;
  } else if (kv->scales.data && (kv->data.dtype == KVA_F8E4M3 || kv->data.dtype == KVA_F8E5M2)) {
    /* fp8 rows: one f32 scale per (token, head), strides 0 where broadcast */
    op.scales = (const char *)kv->scales.data;
    kvc_copy_strides(op.ss, &kv->scales, 3);
    op.sdtype = KVA_F32;
  }
  op.vec = kvc_rows_aligned(kv, E);
  return op;
}

static void kvc_args_of(const kva_problem *p, const kvc_plan &pl, void *ws, kvc_args *a) {
  memset(a, 0, sizeof *a);
  a->B = (int)p->B;
  a->H = (int)p->H;
  a->KVH = (int)p->KVH;
  a->rep = (int)p->rep;
  a->L = (int)p->L;
  a->Dk = (int)p->Dk;
  a->Dv = (int)p->Dv;
  a->N = p->N;
  a->scale = p->scale;
  a->softcap = p->softcap;
  a->softcap_inv = p->softcap > 0.0f ? 1.0f / p->softcap : 0.0f;
  a->mask_kind = p->mask.kind;
  a->window = p->mask.window;
  a->clamp = p->mask.segments_clamp;
  if (kva_causal_family(p->mask.kind) && p->mask.segments.data) {
    a->seg = (const int32_t *)p->mask.segments.data;
    kvc_copy_strides(a->seg_s, &p->mask.segments, 2);
  }
  if (p->mask.kind == KVA_MASK_TREE) { /* device bits; mask_stride[0] = 0 broadcasts one tree */
    a->tree = (const char *)p->mask.array.data;
    a->tree_s[0] = p->mask_stride[0];
    a->tree_s[1] = p->mask_stride[1];
  }
  if (p->mask.kind == KVA_MASK_ARRAY) {
    a->mask_arr = (const char *)p->mask.array.data;
    a->mask_dtype = p->mask.array.dtype;
    for (int d = 0; d < 4; ++d) a->mask_s[d] = p->mask_stride[d];
  }
  a->sinks = p->sinks;
  a->q = (const char *)p->q->data;
  a->q_dtype = p->q->dtype;
  kvc_copy_strides(a->qs, p->q, 4);
  a->out = (char *)p->out->data;
  a->out_dtype = p->out->dtype;
  kvc_copy_strides(a->os, p->out, 4);
  if (p->lse) {
    a->lse = (float *)p->lse->data;
    kvc_copy_strides(a->lse_s, p->lse, 3);
    a->lse_base2 = p->lse_base2;
  }
  const int E = pl.fmt >= 0 && !pl.tc ? pl.E : 8;
  a->k = kvc_operand_of(&p->kv->k, E);
  a->v = kvc_operand_of(&p->kv->v, E);
  a->seq_lens = p->seq_lens;
  if (p->kv->layout == KVA_LAYOUT_BLOCK_TABLE) { /* pools + table: device arrays, read by the kernels */
    const kva_block_table *bt = p->kv->table;
    kvc_operand *ops[2] = {&a->k, &a->v};
    for (int i = 0; i < 2; ++i) {
      ops[i]->tbl = bt->blocks;
      ops[i]->fo = bt->first_offset;
      ops[i]->tbl_rs = bt->row_stride ? bt->row_stride : bt->max_blocks;
      ops[i]->bsz = (int)p->kv->k.data.shape[2];
      /* block ids are int32: a larger pool's blocks past INT32_MAX are never named */
      ops[i]->nblk = (int)(p->kv->k.data.shape[0] > KVC_INT_MAX ? KVC_INT_MAX : p->kv->k.data.shape[0]);
      ops[i]->bsh = (ops[i]->bsz & (ops[i]->bsz - 1)) == 0 ? kvc_log2(ops[i]->bsz) : -1;
    }
    a->seq_lens = bt->seq_lens;
  }
  if (p->rotate & KVA_ATTN_ROTATED_K) {
    a->rot_q = 1;
    a->rot_qdt = p->exact || p->q->dtype == KVA_F32 ? KVA_F32 : p->q->dtype; /* the pass's q' dtype */
    a->rot_qm = kva_hadamard_block(p->Dk);
    a->rot_qc = kva_hadamard_scale(p->Dk);
  }
  if (p->rotate & KVA_ATTN_ROTATED_V) {
    a->rot_out = 1;
    a->rot_om = kva_hadamard_block(p->Dv);
    a->rot_oc = kva_hadamard_scale(p->Dv);
  }
  a->lanes_log2 = pl.lanes_log2;
  a->nsplit = pl.nsplit > 0 ? pl.nsplit : 1;
  a->chunk = pl.chunk;
  a->ring_tok = pl.ring;
  a->ws = (float *)ws;
}

extern "C" int kva_cuda_attention(kva_context *ctx, const kva_problem *p, void *ws, size_t ws_bytes) {
  if (!ctx->cuda) return kva_seterr(KVA_ENODEVICE, "ctx: CUDA context not initialized");
  if (p->kv->layout == KVA_LAYOUT_PAGED)
    return kva_seterr(KVA_EUNSUPPORTED, "kv: a kva_paged_view lives in host memory; on the CUDA backend use "
                                        "a BLOCK_TABLE view of device pools (kva_view_block_table)");
  int rc = kvc_check_limits(p);
  if (rc < 0) return rc;
  const kvc_plan pl = kvc_select(ctx, p);
  if (p->rotate & ~kvc_rotate_fused(pl))
    return kva_seterr(KVA_EINTERNAL, "CUDA backend: rotation 0x%x handed to a kernel that does not fuse it", p->rotate);
  size_t need;
  if ((rc = kvc_ws_bytes(p, pl, &need)) < 0) return rc;
  if (ws_bytes < need || (need && !ws))
    return kva_seterr(KVA_EWORKSPACE, "workspace_bytes = %zu < %zu needed", ws_bytes, need);
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess && dev != ctx->device) e = cudaSetDevice(ctx->device);
  if (e != cudaSuccess) return kvc_cuda_err(e, "selecting ctx's device");
  kvc_args a;
  kvc_args_of(p, pl, ws, &a);
  cudaStream_t stream = (cudaStream_t)ctx->stream;
  if (pl.fmt < 0) return kvc_launch_generic(a, stream);
  rc = pl.tc == 3   ? kvc_launch_wg(a, pl, stream)
           : pl.tc == 2 ? kvc_launch_tcd(a, pl, stream)
           : pl.tc      ? kvc_launch_tc(a, pl, stream)
                        : kvc_launch_fused(a, pl, stream);
  if (rc < 0 || pl.nsplit <= 1) return rc;
  return kvc_launch_merge(a, stream);
}

int kvc_launch_fused(const kvc_args &a, const kvc_plan &plan, cudaStream_t stream) {
  switch (plan.fmt) {
  case KVC_F32: return kvc_launch_fused_fmt<KVC_F32>(a, plan, stream);
  case KVC_F16: return kvc_launch_fused_fmt<KVC_F16>(a, plan, stream);
  case KVC_BF16: return kvc_launch_fused_fmt<KVC_BF16>(a, plan, stream);
  case KVC_Q2: return kvc_launch_fused_fmt<KVC_Q2>(a, plan, stream);
  case KVC_Q4: return kvc_launch_fused_fmt<KVC_Q4>(a, plan, stream);
  case KVC_Q8: return kvc_launch_fused_fmt<KVC_Q8>(a, plan, stream);
  case KVC_E4M3: return kvc_launch_fused_fmt<KVC_E4M3>(a, plan, stream);
  case KVC_E5M2: return kvc_launch_fused_fmt<KVC_E5M2>(a, plan, stream);
  default: return kva_seterr(KVA_EINTERNAL, "CUDA fused kernel: format %d", plan.fmt);
  }
}
