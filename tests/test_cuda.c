/* CUDA backend against the double-precision oracle: an explicit case table
 * (odd N, ragged batches, strided views, every mask, format and head-dim
 * family, fused and general paths), NaN/Inf exact, poisoned outputs and a
 * sentinel after them in device memory, a CUDA-graph capture replayed
 * over changing cache lengths, and randomized bad input (cuda_random_mutations). Operands are built on the host
 * (attn_check.h), mirrored to the device with the same strides, and the
 * device output is copied back into the host view for the comparison.
 * Every GPU test reports SKIP when no device is visible (or no CUDA build). */
#include "attn_check.h"
#include "mutate_call.h"
#include "lse_check.h"

#define F32 KVA_F32
#define F16 KVA_F16
#define BF16 KVA_BF16

/* Without a device, creating a CUDA context fails cleanly (stubs or runtime). */
TEST(cuda_no_device_is_an_error) {
  if (kva_cuda_device_count() > 0) SKIP("a CUDA device is visible");
  kva_context *ctx = NULL;
  kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, NULL};
  ASSERT_ERR(kva_context_create(&ctx, &o), KVA_ENODEVICE, "CUDA");
  ASSERT_TRUE(ctx == NULL);
  char name[64];
  size_t mem = 0;
  ASSERT_ERR(kva_cuda_device_info(0, name, sizeof name, &mem), KVA_ENODEVICE, "CUDA");
}

#ifndef KVA_HAVE_CUDA
TEST(cuda_vs_oracle) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_nan_inf) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_graph_replay_changing_lengths) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_caller_workspace) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_q4_tc_path) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_q4_wg_path) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_q4_tc_nan_inf) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_tc_unseen_nan) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_block_table) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_block_table_staged) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_q4_tcd_path) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_random_mutations) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_grid_limits) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_rows_without_keys) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_sinks_nonfinite) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_lse) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_lse_merge) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_exact_mode) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_tree) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_tree_high_bits_ignored) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_tree_wg) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_bf16_wg_path) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_f16_wg_path) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_bf16_wg512) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_f16_wg512) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_fp8_vs_oracle) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_fp8_block_table) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_fp8_cache_write_bits) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_fp8_wg_path) { SKIP("built without CUDA (nvcc not found)"); }
#else
#include <cuda_runtime_api.h>

/* Under AddressSanitizer (make test-c's second run) the CUDA driver needs the
 * shadow gap unprotected to map device memory, and its own allocations that
 * live until exit are not leaks of ours. ASan/LSan read these at startup. */
#if defined(__SANITIZE_ADDRESS__)
#define TEST_CUDA_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TEST_CUDA_ASAN 1
#endif
#endif
#ifdef TEST_CUDA_ASAN
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "protect_shadow_gap=0"; }
const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void) { return "leak:libcuda.so\nleak:libcudart.so\nleak:libnvidia\n"; }
#endif

/* B, H, KVH, L, N, Dk, Dv, q, out, kbits, vbits, group, kv/scale dtype, mask, window, softcap, sinks, ragged, strided */
static const att_case cases[] = {
    /* decode, every float format, odd lengths (N = 1, 17, 113, 4097) */
    {1, 8, 4, 1, 1, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 4, 1, 17, 256, 256, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 4, 1, 113, 128, 128, F16, F16, 0, 0, 0, F16, MASK_NONE, 0, 0, 0, 0, 1},
    {3, 8, 2, 1, 4097, 64, 64, F32, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
    /* quantized: bits x group x scale dtype, head dims 64..512 */
    {1, 8, 4, 1, 4097, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {3, 8, 4, 1, 4097, 256, 256, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
    {1, 6, 2, 1, 17, 128, 128, F32, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 6, 2, 1, 113, 128, 128, F32, F32, 2, 2, 128, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 1, 1, 300, 64, 64, F32, F32, 2, 2, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 1, 1, 300, 96, 96, F32, F32, 8, 8, 32, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 2, 1, 2000, 512, 512, BF16, F32, 4, 4, 128, F16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 2, 1, 200, 192, 192, F32, BF16, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    /* K and V in different formats (general path) */
    {1, 4, 2, 1, 200, 512, 512, BF16, F32, 4, 8, 128, F16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    /* Dk != Dv, head dim 80 */
    {1, 4, 2, 3, 150, 192, 128, F32, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 2, 2, 150, 80, 80, F32, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 4, 2, 2, 1500, 256, 512, F32, F32, 4, 4, 64, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    /* verify rows L = 8 and 16, GQA 1, 2, 3, 6, 8 (several query tiles) */
    {1, 8, 4, 8, 4097, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 24, 4, 8, 3000, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 8, 16, 600, 128, 128, F32, F32, 8, 8, 64, F32, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 6, 2, 3, 2500, 256, 256, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 1, 0, 1},
    {1, 16, 2, 1, 3000, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    /* batches with different lengths, many splits */
    {3, 8, 4, 1, 1000, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
    {3, 8, 2, 4, 700, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 1},
    {2, 32, 4, 1, 20000, 128, 128, F16, F16, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 1, 1, 0},
    /* sliding window, segments, softcap, sinks */
    {2, 8, 4, 1, 1000, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_WINDOW, 100, 0, 0, 1, 0},
    {1, 8, 4, 8, 700, 128, 128, F32, F32, 0, 0, 0, F32, MASK_WINDOW, 1, 0, 0, 0, 0},
    {1, 8, 4, 8, 4097, 128, 128, F32, F32, 0, 0, 0, F32, MASK_WINDOW, 5, 0, 0, 0, 0},
    {2, 4, 2, 12, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_SEG, 0, 0, 0, 1, 0},
    {1, 4, 2, 12, 300, 64, 64, F32, F32, 4, 4, 32, F32, MASK_SEG_CLAMP, 7, 0, 0, 0, 1},
    {1, 4, 2, 12, 2000, 64, 64, F32, F32, 0, 0, 0, F32, MASK_SEG, 9, 0, 0, 0, 0},
    {1, 8, 4, 1, 500, 256, 256, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 30.0f, 0, 0, 0},
    {2, 8, 4, 3, 500, 128, 128, F32, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 5.0f, 1, 1, 0},
    {1, 8, 2, 1, 3000, 64, 64, F32, F32, 8, 8, 64, BF16, MASK_NONE, 0, 0, 1, 0, 0},
    /* explicit array masks (general path) */
    {2, 4, 2, 5, 200, 64, 64, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, 0, 1, 0},
    {1, 4, 2, 5, 200, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_ADD, 0, 0, 1, 0, 1},
    {1, 4, 2, 5, 200, 128, 128, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, 0, 0, 1},
    /* long L (beyond 16 rows: the fused and tensor-core kernels' query tiles):
     * f32 q (fused kernel), q4 at D 256 / 128 / 512 (warpgroup, narrow),
     * 16-bit rows (warpgroup), q8 (wide), q2 (fused), a window shorter than
     * L, no mask, 600 query vectors per KV head */
    {1, 4, 2, 40, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 4, 17, 17, 128, 128, F32, F32, 4, 4, 32, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 4, 32, 3000, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {2, 8, 8, 24, 1500, 256, 256, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
    {2, 16, 4, 20, 900, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 13, 20.0f, 1, 1, 0},
    {1, 4, 2, 20, 1200, 512, 512, BF16, BF16, 4, 4, 128, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 16, 4, 33, 2000, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
    {1, 4, 4, 48, 1000, 256, 256, F16, F16, 0, 0, 0, F16, MASK_NONE, 0, 0, 1, 0, 0},
    {2, 8, 4, 24, 800, 128, 128, BF16, BF16, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 1},
    {1, 4, 2, 20, 300, 64, 64, F32, F32, 2, 2, 32, F32, MASK_WINDOW, 30, 0, 0, 0, 0},
    {1, 24, 4, 100, 1100, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    /* prefill (L near N): a query tile's keys end at its last row and start
     * at its first row's window (splits past them empty) on each family */
    {1, 8, 4, 500, 500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
    {2, 8, 2, 400, 600, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_WINDOW, 64, 0, 0, 1, 0},
    {1, 4, 2, 300, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 2, 400, 400, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_WINDOW, 90, 0, 0, 0, 0},
    {1, 8, 2, 300, 500, 128, 128, BF16, BF16, 8, 8, 64, BF16, MASK_WINDOW, 50, 0, 0, 0, 0},
    {1, 4, 2, 200, 300, 512, 512, BF16, BF16, 4, 4, 128, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 4, 30, 40, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    /* the q4 tensor-core path (bf16 q, head dims 64/128/256, groups 32..128) */
    {2, 8, 2, 3, 1500, 128, 128, BF16, BF16, 4, 4, 32, F16, MASK_CAUSAL, 0, 0, 1, 1, 0},
    {1, 8, 8, 1, 777, 64, 64, BF16, F32, 4, 4, 64, F32, MASK_WINDOW, 100, 20.0f, 0, 0, 1},
    {1, 4, 2, 12, 300, 64, 64, BF16, BF16, 4, 4, 32, BF16, MASK_SEG, 0, 0, 0, 0, 0},
    {1, 4, 2, 1, 1, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {3, 24, 4, 8, 999, 256, 256, BF16, BF16, 4, 4, 128, BF16, MASK_CAUSAL, 0, 0, 1, 1, 1},
    /* one group per row: on the tensor cores, and strided (scale entries 18
     * bytes apart: the fused kernel) */
    {2, 16, 4, 2, 999, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
    {2, 16, 4, 2, 999, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 1},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

/* f32 arithmetic over up to 20k keys vs the double oracle (same bound as the CPU). */
#define ATOL_REL 3e-5

/* Groups per row the quantized tensor-core kernels take: 2 to 8, or 1 when
 * the scale entries can be copied 8 tokens at a time (kvc_one_group_rows:
 * not the strided views, whose entries are 18 bytes apart; block tables of
 * a multiple of 8 tokens; table_bs = 0: contiguous). */
static int tc_groups(const att_case *c, int64_t table_bs) {
  const int groups = c->group ? c->Dk / c->group : 0;
  return (groups >= 2 && groups <= 8) || (groups == 1 && !c->strided && table_bs % 8 == 0);
}

/* The mutation test's allowance (cuda_random_mutations: the mutated calls
 * may take another kernel than the base call, so the shape rule below);
 * the oracle tests take the allowance of the kernel that runs
 * (att_kernel_atol on the device descriptors). Bf16 products
 * (ATT_ATOL_BF16 = 2^-7 of max|ref|) where the selector takes the
 * tensor-core kernel (src/cuda/context.cu, kvc_tc_dim_index: bf16 q, Dk = Dv
 * in {64, 128, 256}, fused path: no array mask, L <= 16; and 4-bit K and V
 * with bf16 scales and biases, 1 to 8 groups per row (tc_groups), or 8-bit ones (up to
 * 8 query vectors per KV head: D 128 / 256 with D / 4 <= group; any D beyond),
 * or bf16 K and V with at least 3 query vectors per KV head
 * (KVC_TC_FLOAT_MIN_Q; 2 at head dim 64, and over block tables at 128), or
 * f16 ones with f16 queries); K, V and P (8-bit decode: P times the V scale) enter
 * its mma as bf16 (f16 for f16 rows).
 * Else f32 products. */
static double cuda_case_atol_layout(const att_case *c, int64_t table_bs) {
  const int table = table_bs > 0;
  const int fused = c->mask != MASK_BOOL && c->mask != MASK_ADD && c->L <= 16;
  const int dims = c->Dk == c->Dv && (c->Dk == 64 || c->Dk == 128 || c->Dk == 256);
  if (fused && dims && c->qdt == BF16 && c->kbits == 4 && c->vbits == 4 && c->kvdt == BF16 && tc_groups(c, table_bs))
    return ATT_ATOL_BF16;
  if (fused && dims && (c->qdt == BF16 || c->qdt == F16) && c->kbits == 0 && c->vbits == 0 && c->kvdt == c->qdt &&
      (int64_t)(c->H / c->KVH) * c->L >= (c->Dk == 64 || (table && c->Dk <= 128) ? 2 : 3))
    return ATT_ATOL_BF16; /* bf16 / f16 rows and queries: P rounded to their type */
  /* q8 on the tensor-core kernels: the decode instance up to 8 query
   * vectors at D 128 / 256 with D / 4 <= group (P' = p s in bf16), the wide
   * kernel at D 64 and beyond 8 vectors (K, V, P in bf16) */
  const int64_t qv = (int64_t)(c->H / c->KVH) * c->L;
  if (fused && dims && c->qdt == BF16 && c->kbits == 8 && c->vbits == 8 && c->kvdt == BF16 && tc_groups(c, table_bs) &&
      (qv > 8 || c->Dk == 64 || c->Dk / 4 <= c->group))
    return ATT_ATOL_BF16;
  return ATOL_REL;
}
#define DEV_SENTINEL_BYTES 256
#define DEV_SENTINEL_BYTE 0xA5
#define DEV_POISON_BYTE 0xff /* NaN in every float dtype */
#define MAX_DEV_BUFS 32

/* A case's operands mirrored to the device with the same strides. */
typedef struct dev_data {
  kva_tensor q, out;
  kva_kv k, v;
  int32_t *lens;
  float *sinks;
  kva_attn_params params;
  kva_kv_view view;
  void *bufs[MAX_DEV_BUFS];
  int nbufs;
  char *out_base;     /* device copy of the host out buffer: guards before and after it */
  size_t out_bytes;
} dev_data;

static int cuda_ok(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return 1;
  FAIL_("%s: %s", what, cudaGetErrorString(e));
  return 0;
}

static void *dev_keep(dev_data *dd, size_t bytes) {
  void *p = NULL;
  if (dd->nbufs >= MAX_DEV_BUFS || cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) return NULL;
  dd->bufs[dd->nbufs++] = p;
  return p;
}

/* Bytes from t->data to the end of its last element (strides >= 0). */
static size_t extent(const kva_tensor *t) {
  size_t e = kva_dtype_size(t->dtype);
  for (int d = 0; d < t->ndim; ++d) e += (size_t)((t->shape[d] - 1) * t->stride[d]);
  return e;
}

static int mirror_tensor(dev_data *dd, const kva_tensor *h, kva_tensor *d) {
  *d = *h;
  if (!h->data) return 1;
  size_t n = extent(h);
  d->data = dev_keep(dd, n);
  return d->data && cudaMemcpy(d->data, h->data, n, cudaMemcpyHostToDevice) == cudaSuccess;
}

static int mirror_kv(dev_data *dd, const kva_kv *h, kva_kv *d) {
  *d = *h;
  if (!h->bits) /* float rows; fp8 rows with their scales (NULL: none) */
    return mirror_tensor(dd, &h->data, &d->data) && mirror_tensor(dd, &h->scales, &d->scales);
  return mirror_tensor(dd, &h->data, &d->data) && (!h->bits || (mirror_tensor(dd, &h->scales, &d->scales) &&
                                                                 mirror_tensor(dd, &h->biases, &d->biases)));
}

static int mirror_array(dev_data *dd, const void *h, size_t bytes, void **d) {
  *d = NULL;
  if (!h) return 1;
  *d = dev_keep(dd, bytes);
  return *d && cudaMemcpy(*d, h, bytes, cudaMemcpyHostToDevice) == cudaSuccess;
}

static void dev_free(dev_data *dd) {
  for (int i = 0; i < dd->nbufs; ++i) cudaFree(dd->bufs[i]);
  dd->nbufs = 0;
}

static int dev_make(dev_data *dd, const att_data *hd) {
  memset(dd, 0, sizeof *dd);
  const att_case *c = &hd->c;
  if (!mirror_tensor(dd, &hd->q, &dd->q) || !mirror_kv(dd, &hd->k, &dd->k) || !mirror_kv(dd, &hd->v, &dd->v))
    return 0;
  if (!mirror_array(dd, hd->lens, sizeof(int32_t) * (size_t)c->B, (void **)&dd->lens) ||
      !mirror_array(dd, hd->sinks, sizeof(float) * (size_t)c->H, (void **)&dd->sinks))
    return 0;
  dd->params = hd->params;
  dd->params.sinks = dd->sinks;
  if (!mirror_tensor(dd, &hd->params.mask.segments, &dd->params.mask.segments) ||
      !mirror_tensor(dd, &hd->params.mask.array, &dd->params.mask.array))
    return 0;
  dd->out_bytes = hd->out_bytes;
  /* guards of DEV_SENTINEL_BYTES before and after the output buffer */
  dd->out_base = (char *)dev_keep(dd, DEV_SENTINEL_BYTES + hd->out_bytes + DEV_SENTINEL_BYTES);
  if (!dd->out_base) return 0;
  dd->out_base += DEV_SENTINEL_BYTES;
  dd->out = hd->out;
  dd->out.data = dd->out_base + ((const char *)hd->out.data - (const char *)hd->out_buf);
  dd->view = kva_view_contiguous(&dd->k, &dd->v, dd->lens);
  return 1;
}

/* Poisons the device output and re-arms its sentinel (stream-ordered). */
static int dev_poison(dev_data *dd, cudaStream_t s) {
  return cuda_ok(cudaMemsetAsync(dd->out_base, DEV_POISON_BYTE, dd->out_bytes, s), "poison out") &&
         cuda_ok(cudaMemsetAsync(dd->out_base + dd->out_bytes, DEV_SENTINEL_BYTE, DEV_SENTINEL_BYTES, s),
                 "arm sentinel") &&
         cuda_ok(cudaMemsetAsync(dd->out_base - DEV_SENTINEL_BYTES, DEV_SENTINEL_BYTE, DEV_SENTINEL_BYTES, s),
                 "arm the guard before out");
}

/* Copies the device output into the host view's buffer; checks the sentinel. */
static int dev_fetch(dev_data *dd, att_data *hd, const char *name) {
  unsigned char tail[DEV_SENTINEL_BYTES], head[DEV_SENTINEL_BYTES];
  if (!cuda_ok(cudaDeviceSynchronize(), "kernel execution") ||
      !cuda_ok(cudaMemcpy(hd->out_buf, dd->out_base, dd->out_bytes, cudaMemcpyDeviceToHost), "fetch out") ||
      !cuda_ok(cudaMemcpy(tail, dd->out_base + dd->out_bytes, sizeof tail, cudaMemcpyDeviceToHost), "fetch tail") ||
      !cuda_ok(cudaMemcpy(head, dd->out_base - DEV_SENTINEL_BYTES, sizeof head, cudaMemcpyDeviceToHost), "fetch head"))
    return 0;
  for (int i = 0; i < DEV_SENTINEL_BYTES; ++i)
    if (head[i] != DEV_SENTINEL_BYTE) {
      FAIL_("%s: guard byte %d before out overwritten", name, i);
      return 0;
    }
  for (int i = 0; i < DEV_SENTINEL_BYTES; ++i)
    if (tail[i] != DEV_SENTINEL_BYTE) {
      FAIL_("%s: sentinel byte %d after out overwritten", name, i);
      return 0;
    }
  return 1;
}

static int make_cuda_ctx(kva_context **ctx, void *stream) {
  kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, stream};
  int rc = kva_context_create(ctx, &o);
  if (rc) FAIL_("kva_context_create(CUDA): %s", kva_last_error());
  return rc == 0;
}

/* Does the call dd would make run a kernel whose name contains want (NULL:
 * any)? Fails the test with the kernel's name if not. */
static int runs_kernel(kva_context *ctx, const dev_data *dd, const char *name, const char *want) {
  if (!want) return 1;
  char kname[160];
  if (kva_attention_kernel(ctx, &dd->q, &dd->view, &dd->params, &dd->out, kname, sizeof kname) < 0) {
    FAIL_("%s: kva_attention_kernel(CUDA): %s", name, kva_last_error());
    return 0;
  }
  if (!strstr(kname, want)) {
    FAIL_("%s: runs \"%s\", not a \"%s\"", name, kname, want);
    return 0;
  }
  return 1;
}

/* Runs one case on the device against the oracle; `tweak` edits host operands first. */
/* want: NULL, or a text the case's kernel name (kva_attention_kernel) must
 * contain: the case runs the kernel it is meant to test. */
static int run_case_q(kva_context *ctx, const att_case *c, void (*tweak)(att_data *, int), int variant,
                      const char *want, int probe) {
  char cs[256], name[300];
  att_case_str(c, cs, sizeof cs);
  snprintf(name, sizeof name, "%s q=%s", cs, att_query_names[probe]);
  att_data hd;
  dev_data dd;
  memset(&dd, 0, sizeof dd);
  int ok = 0;
  if (att_make_q(&hd, c, probe)) {
    FAIL_("%s: could not build operands", name);
    goto done;
  }
  if (tweak) tweak(&hd, variant);
  kva_tensor ref = att_alloc_like(&hd, &hd.out);
  if (!dev_make(&dd, &hd)) {
    FAIL_("%s: could not mirror operands to the device", name);
    goto done;
  }
  if (att_kernel_reference(ctx, &dd.q, &dd.view, &dd.params, &dd.out, &hd.q, &hd.view, &hd.params, &ref)) {
    FAIL_("%s: oracle: %s", name, kva_last_error());
    goto done;
  }
  if (!dev_poison(&dd, 0)) goto done;
  if (!runs_kernel(ctx, &dd, name, want)) goto done;
  const double atol = att_kernel_atol(ctx, &dd.q, &dd.view, &dd.params, &dd.out);
  int rc = kva_attention(ctx, &dd.q, &dd.view, &dd.params, &dd.out, NULL, 0);
  if (rc) {
    FAIL_("%s: kva_attention(CUDA): %s", name, kva_last_error());
    goto done;
  }
  if (!dev_fetch(&dd, &hd, name)) goto done;
  if (!att_out_padding_is(&hd, DEV_POISON_BYTE)) {
    FAIL_("%s: CUDA wrote between the rows of out", name);
    goto done;
  }
  double max_err = 0, l2 = 0;
  if (!att_compare(&hd.out, &ref, atol, att_rtol(c->odt), &max_err, &l2)) {
    FAIL_("%s%s: CUDA out differs from the oracle (max err %.3g, allowed %.3g of max|ref|)", name,
          tweak ? " (tweaked)" : "", max_err, atol);
    goto done;
  }
  ok = 1;
done:
  dev_free(&dd);
  att_free(&hd);
  return ok;
}

/* run_case_q with random queries, then with probes (att_make_q). */
static int run_case_want(kva_context *ctx, const att_case *c, void (*tweak)(att_data *, int), int variant,
                         const char *want) {
  for (int pr = 0; pr < ATT_PROBES; ++pr)
    if (!run_case_q(ctx, c, tweak, variant, want, pr)) return 0;
  return 1;
}

static int run_case(kva_context *ctx, const att_case *c, void (*tweak)(att_data *, int), int variant) {
  return run_case_want(ctx, c, tweak, variant, NULL);
}

TEST(cuda_vs_oracle) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  kva_context *ctx;
  if (!make_cuda_ctx(&ctx, NULL)) return;
  for (int ci = 0; ci < NCASES; ++ci) {
    const att_case *c = &cases[ci];
    if (test_quick && c->N > 1000) continue;
    char name[256];
    att_case_str(c, name, sizeof name);
    printf("  case %2d %s\n", ci, name);
    fflush(stdout);
    if (!run_case(ctx, c, NULL, 0)) break;
  }
  kva_context_destroy(ctx);
}

/* Each case of a table with each variant 0 .. variants - 1 of tweak (NULL:
 * as made), on one CUDA context; stops at the first failure. want: as in
 * run_case_want (NULL: any kernel). */
static void run_case_table(const att_case *cs, size_t n, void (*tweak)(att_data *, int), int variants,
                           const char *want) {
  kva_context *ctx;
  if (!make_cuda_ctx(&ctx, NULL)) return;
  for (size_t ci = 0; ci < n; ++ci)
    for (int variant = 0; variant < variants; ++variant)
      if (!run_case_want(ctx, &cs[ci], tweak, variant, want)) {
        FAIL_("case %zu, variant %d", ci, variant);
        goto done;
      }
done:
  kva_context_destroy(ctx);
}

/* The q4 tensor-core path alone, small (racecheck runs it): decode GQA 2,
 * verify GQA 6 with splits, head dims 64/128/256. */
TEST(cuda_q4_tc_path) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  static const att_case mcases[] = {
      {1, 8, 4, 1, 700, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 24, 4, 8, 600, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
      {2, 6, 2, 2, 333, 128, 128, BF16, F32, 4, 4, 32, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
      {1, 4, 4, 4, 150, 64, 64, BF16, BF16, 4, 4, 32, BF16, MASK_NONE, 0, 0, 0, 0, 1},
      {2, 24, 4, 1, 2100, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, /* rep 6, sinks, ragged */
      /* the wide kernel (q4 from 33 vectors): D = 128 with window, softcap,
       * sinks, ragged (40 vectors); D = 64 with 64 vectors (two blocks of 48
       * per KV head), strided */
      {2, 16, 2, 5, 333, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 100, 30.0f, 1, 1, 0},
      {1, 16, 2, 8, 500, 64, 64, BF16, F32, 4, 4, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
      /* image segments, and no mask, at 24 vectors: the narrow kernel (the
       * warpgroup one, on sm_90, takes no mask too: cuda_q4_wg_path) */
      {1, 24, 4, 4, 400, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_SEG, 0, 0, 0, 0, 0},
      {2, 24, 4, 4, 400, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_NONE, 0, 0, 0, 1, 0},
      /* bf16 K/V on the same kernel (>= 3 query vectors per KV head): decode
       * instance, wide instance (verify), D = 128 / 64, window, softcap, sinks, ragged, strided */
      {1, 24, 4, 1, 700, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 24, 4, 8, 600, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
      {2, 12, 2, 2, 333, 128, 128, BF16, F32, 0, 0, 0, BF16, MASK_WINDOW, 100, 30.0f, 1, 1, 0},
      {1, 8, 1, 3, 150, 64, 64, BF16, BF16, 0, 0, 0, BF16, MASK_NONE, 0, 0, 0, 0, 1},
      /* f16 K/V with f16 queries, the same instances (f16 mma, P in f16) */
      {1, 24, 4, 1, 700, 256, 256, F16, F16, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 24, 4, 8, 600, 256, 256, F16, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 1, 0, 0},
      {2, 12, 2, 2, 333, 128, 128, F16, F16, 0, 0, 0, F16, MASK_WINDOW, 100, 30.0f, 1, 1, 0},
      {1, 8, 1, 3, 150, 64, 64, F16, BF16, 0, 0, 0, F16, MASK_NONE, 0, 0, 0, 0, 1},
      /* q8 K/V on the decode instance: groups in the mma columns (rep 2, 4
       * groups); per-group S with window, softcap, sinks, ragged (D = 128,
       * group 32); 8 vectors with group 128, strided */
      {1, 8, 4, 1, 700, 256, 256, BF16, BF16, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 24, 4, 1, 333, 128, 128, BF16, F32, 8, 8, 32, BF16, MASK_WINDOW, 100, 30.0f, 1, 1, 0},
      {1, 8, 2, 2, 500, 256, 256, BF16, BF16, 8, 8, 128, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
      /* q8 on the wide kernel (more than 8 vectors): verify at GQA 6; window,
       * softcap, sinks, ragged at D = 128 with 18 vectors; D = 64 with 64
       * vectors (two blocks per KV head), group 32, strided */
      {1, 24, 4, 8, 600, 256, 256, BF16, BF16, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
      {2, 12, 2, 3, 333, 128, 128, BF16, F32, 8, 8, 64, BF16, MASK_WINDOW, 100, 30.0f, 1, 1, 0},
      {1, 16, 2, 8, 500, 64, 64, BF16, BF16, 8, 8, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
      /* q8 decode at head dim 64 (the decode instance needs D >= 128): the
       * wide kernel at 1 to 8 vectors; window, softcap, sinks, ragged; one
       * group per row */
      {1, 8, 4, 1, 700, 64, 64, BF16, BF16, 8, 8, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 8, 2, 2, 333, 64, 64, BF16, F32, 8, 8, 64, BF16, MASK_WINDOW, 100, 30.0f, 1, 1, 0},
      {1, 4, 4, 1, 515, 64, 64, BF16, BF16, 8, 8, 64, BF16, MASK_NONE, 0, 0, 0, 0, 0},
      /* one group per row (group 64 at D = 64, 128 at 128: scale entries
       * copied 8 tokens at a time; odd lengths put each head's token 0 at a
       * different entry of its 16-byte piece): q4 decode at rep 2 (the
       * compiled-group instance, groups not in the mma columns), 16 vectors
       * with window, softcap, sinks, ragged, f32 out; 64 vectors (the wide
       * kernel, two blocks); segments at 24 vectors; no mask; D = 128 at 6
       * vectors (run-time group); q8 decode at D = 128 and wide at D = 64 */
      {1, 8, 4, 1, 701, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 16, 4, 4, 333, 64, 64, BF16, F32, 4, 4, 64, BF16, MASK_WINDOW, 100, 30.0f, 1, 1, 0},
      {1, 32, 4, 8, 501, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
      {1, 12, 2, 4, 300, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_SEG, 0, 0, 0, 0, 0},
      {1, 4, 4, 4, 151, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_NONE, 0, 0, 0, 0, 0},
      {2, 24, 4, 1, 603, 128, 128, BF16, BF16, 4, 4, 128, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
      {1, 8, 4, 1, 705, 128, 128, BF16, BF16, 8, 8, 128, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
      {1, 16, 2, 8, 499, 64, 64, BF16, BF16, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      /* q4 at head dim 512 (the decode instance, two V words per lane): rep
       * 2 with the compiled group; 16 vectors (two blocks) with group 128,
       * window, softcap, sinks, ragged, f32 out; one vector (8 groups in the
       * mma columns), strided */
      {1, 16, 8, 1, 1500, 512, 512, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 8, 2, 4, 700, 512, 512, BF16, F32, 4, 4, 128, BF16, MASK_WINDOW, 100, 30.0f, 1, 1, 0},
      {1, 8, 8, 1, 333, 512, 512, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
  };
  run_case_table(mcases, sizeof mcases / sizeof mcases[0], NULL, 1, "tensor-core kernel");
}

/* The warpgroup q4 kernel (src/cuda/attn_wg.cu: wgmma, by default from 17
 * query vectors per KV head at head dims 128 / 256 on sm_90; here from 1;
 * elsewhere these cases run the narrow and wide kernels, which the second
 * pass, with the warpgroup kernel off, checks here too): 16 vectors (8/4/256 L = 8); 80 vectors (two blocks
 * per KV head) with group 32 at 128, sinks, ragged, strided; group 128 at
 * 256 with window, softcap, f32 out; strided; 48 vectors with splits, ragged.
 * The f32-out cases have full-length sequences: with K, V and P in bf16 a
 * row that sees one to three keys (ragged lengths) gets no averaging, and
 * over 30 seeds the narrow kernel's max error on such a case reached 0.0151
 * against a bf16 allowance of ~0.0134 (this kernel's 0.0129); with bf16 out
 * the allowance includes the output's own rounding. */
TEST(cuda_q4_wg_path) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  static const att_case wcases[] = {
      {1, 8, 4, 8, 700, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 40, 2, 4, 300, 128, 128, BF16, BF16, 4, 4, 32, BF16, MASK_CAUSAL, 0, 0, 1, 1, 1},
      {2, 12, 4, 4, 500, 256, 256, BF16, F32, 4, 4, 128, BF16, MASK_WINDOW, 70, 20.0f, 0, 0, 0},
      {1, 16, 4, 4, 400, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
      {1, 24, 4, 8, 2600, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
      {2, 12, 2, 3, 333, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_WINDOW, 100, 30.0f, 0, 0, 0},
      /* one group per row (group 128 at D = 128), odd length, ragged */
      {2, 24, 4, 8, 1001, 128, 128, BF16, BF16, 4, 4, 128, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
      /* head dim 64 (one 64-dim tile chunk; half the threads convert): one
       * group per row at 16 vectors; window, softcap, sinks, ragged at 48;
       * group 32, strided, 64 vectors; 80 vectors (two blocks), ragged */
      {1, 32, 8, 4, 700, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 24, 4, 8, 501, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 100, 20.0f, 1, 1, 0},
      {1, 16, 2, 8, 400, 64, 64, BF16, BF16, 4, 4, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
      {2, 40, 2, 4, 333, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
      /* no mask (a cascade's stacked prefix rows): ragged; 80 vectors (two
       * blocks) with softcap, sinks, f32 out, strided */
      {2, 24, 4, 4, 400, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_NONE, 0, 0, 0, 1, 0},
      {1, 40, 2, 4, 300, 128, 128, BF16, F32, 4, 4, 32, BF16, MASK_NONE, 0, 30.0f, 1, 0, 1},
      /* windows of 1 and 2 keys: each row's running maximum stays -inf
       * through every stage and split before its keys (P = 2^(x - 0) on
       * all -inf logits), then a partial stage; softcap and sinks at 256,
       * ragged; group 32 at 128, strided */
      {2, 16, 4, 4, 700, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 1, 25.0f, 1, 1, 0},
      {1, 24, 4, 8, 900, 128, 128, BF16, BF16, 4, 4, 32, BF16, MASK_WINDOW, 2, 0, 0, 0, 1},
  };
  setenv("KVA_CUDA_WG_MIN_Q", "1", 1); /* every case on it, whatever its vector count */
  run_case_table(wcases, sizeof wcases / sizeof wcases[0], NULL, 1, "warpgroup");
  setenv("KVA_CUDA_WG_MIN_Q", "-1", 1);
  run_case_table(wcases, sizeof wcases / sizeof wcases[0], NULL, 1, "tensor-core kernel");
  unsetenv("KVA_CUDA_WG_MIN_Q");
}

/* NaN/Inf planted in q, in visible K/V rows, and beyond each sequence's
 * length (never read: must not reach the output). */
static void plant(att_data *d, int variant) {
  const att_case *c = &d->c;
  float *q = (float *)d->q.data;
  char *k = (char *)d->k.data.data, *v = (char *)d->v.data.data;
  switch (variant) {
  case 0: q[3] = NAN; break;                                         /* (b0, h0, row 0): row NaN */
  case 1: ((float *)(k + (c->N - 1) * d->k.data.stride[2]))[5] = NAN; break; /* last key of (b0, hk0) */
  case 2: ((float *)v)[7] = INFINITY; break;                            /* first key, V element 7 */
  case 3: {
    float *kr = (float *)(k + (c->N - 1) * d->k.data.stride[2]);
    kr[0] = INFINITY;
    kr[1] = INFINITY;
    break;
  }
  case 4: /* NaN in every K/V row past the length of each sequence */
    for (int b = 0; b < c->B; ++b)
      for (int hk = 0; hk < c->KVH; ++hk)
        for (int64_t t = d->lens ? d->lens[b] : c->N; t < c->N; ++t) {
          float *kr = (float *)(k + b * d->k.data.stride[0] + hk * d->k.data.stride[1] + t * d->k.data.stride[2]);
          float *vr = (float *)(v + b * d->v.data.stride[0] + hk * d->v.data.stride[1] + t * d->v.data.stride[2]);
          for (int e = 0; e < c->Dk; ++e) kr[e] = NAN;
          for (int e = 0; e < c->Dv; ++e) vr[e] = NAN;
        }
    break;
  }
}

TEST(cuda_nan_inf) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  /* fused path (causal, L = 2 and L = 20) and general path (bool mask); f32 K/V */
  const att_case fused = {1, 4, 2, 2, 1000, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  const att_case ragged = {3, 8, 2, 2, 3000, 128, 128, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 1, 1, 1};
  const att_case long_l = {1, 4, 2, 20, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  const att_case general = {1, 4, 2, 5, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, 0, 0, 0};
  kva_context *ctx;
  if (!make_cuda_ctx(&ctx, NULL)) return;
  for (int variant = 0; variant < 4; ++variant)
    if (!run_case(ctx, &fused, plant, variant) || !run_case(ctx, &long_l, plant, variant) ||
        !run_case(ctx, &general, plant, variant)) {
      FAIL_("variant %d", variant);
      break;
    }
  if (!run_case(ctx, &ragged, plant, 4)) FAIL_("NaN past the sequence lengths reached the output");
  kva_context_destroy(ctx);
}

/* NaN/Inf on the q4 tensor-core path (bf16 queries, 4-bit K/V, bf16
 * scales): a NaN query element (that row NaN, the other query vectors of the
 * block untouched), a NaN K scale in one visible row (every row of that KV
 * head NaN), an Inf V bias in one visible row (Inf in its group's dims). */
static void plant_q4(att_data *d, int variant) {
  const att_case *c = &d->c;
  uint16_t *q = (uint16_t *)d->q.data;
  const int64_t last = (c->N - 1);
  switch (variant) {
  case 0: q[3] = 0x7FC0u; break; /* NaN in (b0, h0, row 0) */
  case 1: /* NaN scale of group 1 in the last K row of (b0, hk0) */
    ((uint16_t *)((char *)d->k.scales.data + last * d->k.scales.stride[2]))[1] = 0x7FC0u;
    break;
  case 2: /* +Inf bias of group 0 in the first V row of (b0, hk0) */
    ((uint16_t *)d->v.biases.data)[0] = 0x7F80u;
    break;
  }
}

TEST(cuda_q4_tc_nan_inf) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  /* rep 2 x 4 groups = 8 columns: the groups-in-columns S phase; rep 6: the per-group one; 48 vectors: the wide kernel */
  static const att_case qc[] = {
      {1, 8, 4, 1, 500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 24, 4, 1, 500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 8, 2, 2, 300, 128, 128, BF16, BF16, 4, 4, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 24, 4, 8, 500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, /* warpgroup kernel (sm_90; else the wide one) */
      {1, 8, 4, 1, 500, 256, 256, BF16, BF16, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},  /* q8 */
      {1, 24, 4, 8, 500, 256, 256, BF16, BF16, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, /* q8 wide */
  };
  run_case_table(qc, sizeof qc / sizeof qc[0], plant_q4, 3, "tensor-core kernel");
}

/* NaN in every key no query row sees (att_plant_unseen): must not reach
 * the output on any tensor-core kernel. */
static void plant_unseen(att_data *d, int variant) {
  (void)variant;
  att_plant_unseen(d);
}

TEST(cuda_tc_unseen_nan) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  /* ragged lengths and windows on each tensor-core kernel: the narrow one
   * (q4 decode, 6 and 16 vectors, one group per row; q8; bf16 rows), the
   * wide one (q8 at head dim 64), the warpgroup one (causal and window,
   * KVA_CUDA_WG_MIN_Q = 1) and the per-warp one (KVA_CUDA_TCD_MIN_WORK = 0) */
  static const att_case nc[] = {
      {3, 8, 4, 1, 700, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 150, 0, 0, 1, 0},
      {3, 24, 4, 1, 900, 128, 128, BF16, BF16, 4, 4, 32, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
      {2, 16, 4, 4, 333, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 90, 0, 1, 1, 0},
      {3, 8, 4, 2, 600, 256, 256, BF16, BF16, 8, 8, 64, BF16, MASK_WINDOW, 120, 0, 0, 1, 0},
      {3, 24, 4, 2, 600, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_WINDOW, 200, 0, 0, 1, 0},
      {2, 8, 4, 2, 555, 64, 64, BF16, BF16, 8, 8, 64, BF16, MASK_WINDOW, 77, 0, 0, 1, 0},
  };
  static const att_case wc[] = {
      {3, 24, 4, 8, 900, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
      {2, 24, 4, 8, 700, 128, 128, BF16, BF16, 4, 4, 128, BF16, MASK_WINDOW, 130, 0, 0, 1, 0},
      {2, 24, 4, 8, 700, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 130, 0, 0, 1, 0},
  };
  static const att_case dc[] = {
      {3, 8, 4, 1, 1300, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 300, 0, 0, 1, 0},
      {3, 32, 8, 2, 900, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
      {3, 8, 4, 1, 1301, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 300, 0, 0, 1, 0},
  };
  run_case_table(nc, sizeof nc / sizeof nc[0], plant_unseen, 1, "tensor-core kernel");
  setenv("KVA_CUDA_WG_MIN_Q", "1", 1);
  run_case_table(wc, sizeof wc / sizeof wc[0], plant_unseen, 1, "warpgroup");
  unsetenv("KVA_CUDA_WG_MIN_Q");
  setenv("KVA_CUDA_TCD_MIN_WORK", "0", 1);
  setenv("KVA_CUDA_TCD_MAX_Q", "32", 1); /* its 17-32 vector blocks at every head dim */
  run_case_table(dc, sizeof dc / sizeof dc[0], plant_unseen, 1, "per-warp,");
  unsetenv("KVA_CUDA_TCD_MIN_WORK");
  unsetenv("KVA_CUDA_TCD_MAX_Q");
}

/* One capture, replayed while the lengths in device memory change; on a
 * caller's workspace, or (ctx_ws) on the context's own, sized by one call
 * before the capture (the per-warp kernel then merges its splits itself,
 * with arrival counters that every replay must leave at zero). */
static void graph_replay(int tcd, int wg, int ctx_ws) {
  const att_case c = {2, 8, 2, 2, 3000, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0};
  static const int32_t lens_sets[][2] = {{3000, 2}, {17, 2999}, {1000, 1500}, {2, 3000}};
  att_data hd;
  dev_data dd;
  memset(&dd, 0, sizeof dd);
  cudaStream_t s = NULL;
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  kva_context *ctx = NULL;
  void *ws = NULL;
  ASSERT_TRUE(att_make(&hd, &c) == 0);
  if (!dev_make(&dd, &hd)) {
    FAIL_("could not mirror operands");
    goto done;
  }
  if (tcd) setenv("KVA_CUDA_TCD_MIN_WORK", "0", 1); /* the per-warp q4 kernel at this size */
  if (tcd) setenv("KVA_CUDA_TCD_MAX_Q", "32", 1); /* its 17-32 vector blocks at every head dim */
  if (wg) setenv("KVA_CUDA_WG_MIN_Q", "1", 1);       /* the warpgroup q4 kernel (sm_90) */
  const int made = cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream") && make_cuda_ctx(&ctx, s);
  if (tcd) unsetenv("KVA_CUDA_TCD_MIN_WORK");
  if (tcd) unsetenv("KVA_CUDA_TCD_MAX_Q");
  if (wg) unsetenv("KVA_CUDA_WG_MIN_Q");
  if (!made) goto done;
  size_t bytes = 0;
  if (kva_attention_workspace_size(ctx, &dd.q, &dd.view, &dd.params, &bytes)) {
    FAIL_("workspace size: %s", kva_last_error());
    goto done;
  }
  if (ctx_ws) {
    if (kva_attention(ctx, &dd.q, &dd.view, &dd.params, &dd.out, NULL, 0) ||
        !cuda_ok(cudaStreamSynchronize(s), "sizing call")) {
      FAIL_("sizing call: %s", kva_last_error());
      goto done;
    }
    bytes = 0;
  } else if (bytes && !cuda_ok(cudaMalloc(&ws, bytes), "workspace"))
    goto done;
  if (!cuda_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "begin capture")) goto done;
  int rc = kva_attention(ctx, &dd.q, &dd.view, &dd.params, &dd.out, ws, bytes);
  cudaError_t ce = cudaStreamEndCapture(s, &graph);
  if (rc) {
    FAIL_("kva_attention under capture: %s", kva_last_error());
    goto done;
  }
  if (!cuda_ok(ce, "end capture") || !cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate")) goto done;
  for (size_t si = 0; si < sizeof lens_sets / sizeof lens_sets[0]; ++si) {
    for (int b = 0; b < c.B; ++b) hd.lens[b] = lens_sets[si][b];
    kva_tensor ref = att_alloc_like(&hd, &hd.out); /* the oracle with the kernel's roundings */
    if (att_kernel_reference(ctx, &dd.q, &dd.view, &dd.params, &dd.out, &hd.q, &hd.view, &hd.params, &ref)) {
      FAIL_("oracle: %s", kva_last_error());
      goto done;
    }
    if (!cuda_ok(cudaMemcpyAsync(dd.lens, hd.lens, sizeof(int32_t) * c.B, cudaMemcpyHostToDevice, s), "lens") ||
        !dev_poison(&dd, s) || !cuda_ok(cudaGraphLaunch(exec, s), "graph launch") ||
        !cuda_ok(cudaStreamSynchronize(s), "replay") || !dev_fetch(&dd, &hd, "replay"))
      goto done;
    double max_err = 0;
    if (!att_compare(&hd.out, &ref, att_kernel_atol(ctx, &dd.q, &dd.view, &dd.params, &dd.out), att_rtol(c.odt),
                     &max_err, NULL)) {
      FAIL_("replay with lengths {%d, %d} differs from the oracle (max err %.3g)", lens_sets[si][0],
            lens_sets[si][1], max_err);
      goto done;
    }
  }
done:
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  if (ws) cudaFree(ws);
  kva_context_destroy(ctx);
  if (s) cudaStreamDestroy(s);
  dev_free(&dd);
  att_free(&hd);
}

TEST(cuda_graph_replay_changing_lengths) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  graph_replay(0, 0, 0);
  graph_replay(1, 0, 0);
  graph_replay(1, 0, 1);
  graph_replay(0, 1, 0);
}

/* A caller workspace one byte short is refused before anything is enqueued. */
TEST(cuda_caller_workspace) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  const att_case c = {1, 8, 4, 1, 5000, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0};
  att_data hd;
  dev_data dd;
  kva_context *ctx = NULL;
  void *ws = NULL;
  ASSERT_TRUE(att_make(&hd, &c) == 0);
  if (!dev_make(&dd, &hd)) {
    FAIL_("could not mirror operands");
    goto done;
  }
  if (!make_cuda_ctx(&ctx, NULL)) goto done;
  size_t bytes = 0;
  if (kva_attention_workspace_size(ctx, &dd.q, &dd.view, &dd.params, &bytes) || bytes == 0) {
    FAIL_("expected a split plan with a workspace for N = 5000 (bytes %zu): %s", bytes, kva_last_error());
    goto done;
  }
  if (!cuda_ok(cudaMalloc(&ws, bytes), "workspace")) goto done;
  int rc = kva_attention(ctx, &dd.q, &dd.view, &dd.params, &dd.out, ws, bytes - 1);
  if (rc != KVA_EWORKSPACE || !strstr(kva_last_error(), "workspace"))
    FAIL_("short workspace: rc %d (%s)", rc, kva_last_error());
  kva_tensor ref = att_alloc_like(&hd, &hd.out);
  if (!dev_poison(&dd, 0) || kva_reference_attention(&hd.q, &hd.view, &hd.params, &ref) ||
      kva_attention(ctx, &dd.q, &dd.view, &dd.params, &dd.out, ws, bytes) || !dev_fetch(&dd, &hd, "ws"))
    FAIL_("exact workspace: %s", kva_last_error());
  else if (!att_compare(&hd.out, &ref, att_kernel_atol(ctx, &dd.q, &dd.view, &dd.params, &dd.out), 0, NULL, NULL))
    FAIL_("exact workspace: out differs from the oracle");
done:
  if (ws) cudaFree(ws);
  kva_context_destroy(ctx);
  dev_free(&dd);
  att_free(&hd);
}

/* BLOCK_TABLE views on the device: each case's cache goes into a library
 * pool (kva_pool_from_contiguous, blocks shuffled), its table is read out
 * (kva_paged_view_block_table), every sequence gets a first_offset and a
 * shorter length (rows of its first block before token 0), and the pool
 * arrays and the table are mirrored to device memory. The oracle reads the
 * same table over the host pool. Covers the q4 tensor-core kernel (block 16,
 * 64, 8), the fused kernel (bf16, q8, q4 with f32 queries) and the general
 * kernel (bool mask, L > 16). want: a part of the name of the kernel the case
 * must run (kva_attention_kernel), or NULL. */
static int run_table_case_q(kva_context *ctx, const att_case *c, int64_t bs, uint64_t seed, const char *want,
                            int probe) {
  char cs[256], name[300];
  att_case_str(c, cs, sizeof cs);
  snprintf(name, sizeof name, "%s q=%s", cs, att_query_names[probe]);
  att_data hd;
  dev_data dd;
  memset(&dd, 0, sizeof dd);
  kva_pool *pool = NULL;
  kva_paged_view *pv = NULL;
  int32_t *blocks = NULL, *lens = NULL, *fo = NULL;
  int ok = 0;
  if (att_make_q(&hd, c, probe)) {
    FAIL_("%s: could not build operands", name);
    goto done;
  }
  int32_t seqs[64];
  if (c->B > 64 || kva_pool_from_contiguous(&pool, &hd.view, bs, 3, seed, seqs) ||
      kva_paged_view_create(pool, seqs, c->B, &pv)) {
    FAIL_("%s: pool/view: %s", name, kva_last_error());
    goto done;
  }
  const int64_t maxb = (c->N + bs - 1) / bs + 1; /* a spare column: row_stride > blocks used */
  blocks = (int32_t *)malloc(sizeof(int32_t) * (size_t)(c->B * maxb));
  lens = (int32_t *)malloc(sizeof(int32_t) * (size_t)c->B);
  fo = (int32_t *)malloc(sizeof(int32_t) * (size_t)c->B);
  if (!blocks || !lens || !fo || kva_paged_view_block_table(pv, maxb, blocks, lens, fo)) {
    FAIL_("%s: block table: %s", name, kva_last_error());
    goto done;
  }
  for (int b = 0; b < c->B; ++b) { /* start inside the first block, keep >= L tokens */
    const int32_t f = (int32_t)((seed + 7 * (uint64_t)b) % (uint64_t)bs);
    if (lens[b] - f >= c->L) {
      fo[b] += f;
      lens[b] -= f;
    }
  }
  const kva_kv hk = kva_pool_k(pool), hv = kva_pool_v(pool);
  const kva_block_table hbt = {c->B, maxb, 0, blocks, lens, fo};
  const kva_kv_view hview = kva_view_block_table(&hk, &hv, &hbt);
  kva_tensor ref = att_alloc_like(&hd, &hd.out);
  if (!dev_make(&dd, &hd)) {
    FAIL_("%s: could not mirror operands to the device", name);
    goto done;
  }
  kva_kv dk, dv;
  void *dblocks, *dlens, *dfo;
  if (!mirror_kv(&dd, &hk, &dk) || !mirror_kv(&dd, &hv, &dv) ||
      !mirror_array(&dd, blocks, sizeof(int32_t) * (size_t)(c->B * maxb), &dblocks) ||
      !mirror_array(&dd, lens, sizeof(int32_t) * (size_t)c->B, &dlens) ||
      !mirror_array(&dd, fo, sizeof(int32_t) * (size_t)c->B, &dfo)) {
    FAIL_("%s: could not mirror the pool to the device", name);
    goto done;
  }
  const kva_block_table dbt = {c->B, maxb, 0, (const int32_t *)dblocks, (const int32_t *)dlens,
                               (const int32_t *)dfo};
  dd.view = kva_view_block_table(&dk, &dv, &dbt);
  if (att_kernel_reference(ctx, &dd.q, &dd.view, &dd.params, &dd.out, &hd.q, &hview, &hd.params, &ref)) {
    FAIL_("%s: oracle over the table: %s", name, kva_last_error());
    goto done;
  }
  if (!dev_poison(&dd, 0)) goto done;
  if (!runs_kernel(ctx, &dd, name, want)) goto done;
  const double atol = att_kernel_atol(ctx, &dd.q, &dd.view, &dd.params, &dd.out);
  if (kva_attention(ctx, &dd.q, &dd.view, &dd.params, &dd.out, NULL, 0)) {
    FAIL_("%s block %lld: kva_attention(CUDA, BLOCK_TABLE): %s", name, (long long)bs, kva_last_error());
    goto done;
  }
  if (!dev_fetch(&dd, &hd, name)) goto done;
  if (!att_out_padding_is(&hd, DEV_POISON_BYTE)) {
    FAIL_("%s block %lld: CUDA wrote between the rows of out", name, (long long)bs);
    goto done;
  }
  double max_err = 0;
  if (!att_compare(&hd.out, &ref, atol, att_rtol(c->odt), &max_err, NULL)) {
    FAIL_("%s block %lld: CUDA over the block table differs from the oracle (max err %.3g, allowed %.3g of "
          "max|ref|)",
          name, (long long)bs, max_err, atol);
    goto done;
  }
  ok = 1;
done:
  free(blocks);
  free(lens);
  free(fo);
  kva_paged_view_release(pv);
  kva_pool_destroy(pool);
  dev_free(&dd);
  att_free(&hd);
  return ok;
}

/* run_table_case_q with random queries, then with probes. */
static int run_table_case(kva_context *ctx, const att_case *c, int64_t bs, uint64_t seed, const char *want) {
  for (int pr = 0; pr < ATT_PROBES; ++pr)
    if (!run_table_case_q(ctx, c, bs, seed, want, pr)) return 0;
  return 1;
}

TEST(cuda_block_table) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  static const struct {
    att_case c;
    int64_t bs;
  } tcases[] = {
      {{1, 8, 4, 1, 3001, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 16},
      {{3, 24, 4, 8, 1500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 64},
      {{2, 8, 2, 3, 700, 128, 128, BF16, BF16, 4, 4, 32, BF16, MASK_WINDOW, 50, 0, 0, 1, 0}, 8},
      {{2, 4, 2, 2, 500, 64, 64, BF16, BF16, 4, 4, 32, BF16, MASK_CAUSAL, 0, 10.0f, 1, 1, 0}, 16},
      {{2, 8, 4, 1, 900, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16},
      {{2, 8, 4, 2, 900, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 64},
      {{2, 24, 4, 2, 900, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16}, /* bf16 tensor-core kernel */
      {{1, 6, 2, 4, 800, 128, 128, F32, F32, 8, 8, 64, F16, MASK_CAUSAL, 0, 0, 1, 0, 0}, 32},
      {{1, 4, 2, 20, 300, 64, 64, F32, F32, 4, 4, 32, F32, MASK_CAUSAL, 0, 0, 0, 0, 0}, 16},
      /* the tensor-core kernel's staged block ids at their edges: block size 8
       * (the pools' smallest: 8 ids per stage), a block size that is no power of two (the
       * division path), blocks longer than a stage; bf16 at 2 vectors and
       * head dim 128 takes the tensor cores over a table */
      {{2, 8, 4, 1, 300, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 8},
      {{2, 16, 8, 1, 700, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 24},
      {{1, 32, 8, 1, 1000, 128, 128, BF16, BF16, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 128},
      /* the warpgroup q4 kernel over tables (20 vectors at 256, 24 at 128 with a block size that is no power of two) */
      {{2, 16, 4, 5, 900, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16},
      {{1, 32, 4, 3, 700, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 24},
  };
  /* one group per row (group 64 at D = 64, 128 at 128) over tables: block
   * sizes 8, 24, 16, 64 with first offsets that start a stage anywhere in an
   * 8-token piece of scale entries: q4 decode, 16 vectors with a window,
   * sinks, ragged; the wide kernel (64 vectors); 48 vectors at D = 128 (the
   * warpgroup kernel on sm_90); q8 at 16 vectors; block 12 (no multiple of
   * 8: pieces would span blocks) runs the fused kernel */
  static const struct {
    att_case c;
    int64_t bs;
    const char *want;
  } ocases[] = {
      {{2, 8, 4, 1, 700, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 8, "tensor-core kernel"},
      {{2, 16, 4, 4, 500, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 90, 0, 1, 1, 0}, 24, "tensor-core kernel"},
      {{1, 32, 4, 8, 400, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 16, "tensor-core kernel"},
      {{2, 24, 4, 8, 900, 128, 128, BF16, BF16, 4, 4, 128, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 64, "tensor-core kernel"},
      {{1, 8, 4, 8, 300, 128, 128, BF16, BF16, 8, 8, 128, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 16, "tensor-core kernel"},
      {{2, 8, 4, 1, 500, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 12, "fused"},
  };
  kva_context *ctx;
  if (!make_cuda_ctx(&ctx, NULL)) return;
  for (size_t ci = 0; ci < sizeof tcases / sizeof tcases[0]; ++ci)
    if (!run_table_case(ctx, &tcases[ci].c, tcases[ci].bs, 11 + ci, NULL)) goto done;
  for (size_t ci = 0; ci < sizeof ocases / sizeof ocases[0]; ++ci)
    for (uint64_t seed = 41; seed < 44; ++seed) /* three sets of first offsets */
      if (!run_table_case(ctx, &ocases[ci].c, ocases[ci].bs, seed + 5 * ci, ocases[ci].want)) goto done;
done:
  kva_context_destroy(ctx);
}

/* The fused kernel's staged BLOCK_TABLE loop (attn_fused.cuh, run_ring: bf16 / f16 rows, 1 or 2
 * query vectors per KV head at 16 elements per lane, block sizes a power of two): the rows of each
 * chunk of table rows copied into the warp's shared-memory ring. Pools with shuffled blocks, first
 * offsets (chunks and splits that start inside a block), a partial last block, B = 3 with ragged
 * lengths, random and probe queries (run_table_case). Slots of 16 rows (D = 128), 8 (D = 256; block
 * 8 at 256 and at 128: a chunk is a whole block, at 128 one step of the warp), 4 (D = 512: four
 * chunks a block), head dim 192 (lanes with one 16-byte piece of a row), Dk != Dv with f32 queries,
 * f16 rows, L = 2, window, softcap, sinks, no mask, a 5-token cache (image segments over a table: test_paged.c); 2 vectors at D = 128
 * (KVA_CUDA_TC_TABLE_MIN_Q=3); then the first table with the loop off (KVA_CUDA_FUSED_RING=0: rows
 * loaded per lane through the table). */
TEST(cuda_block_table_staged) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  static const struct {
    att_case c;
    int64_t bs;
  } sc[] = {
      {{3, 8, 4, 1, 1500, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16},
      {{3, 8, 4, 1, 2100, 256, 256, BF16, F32, 0, 0, 0, BF16, MASK_WINDOW, 300, 30.0f, 1, 1, 0}, 64},
      {{3, 4, 4, 2, 700, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 8},
      {{3, 8, 8, 1, 1000, 128, 128, F16, F16, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 16},
      {{2, 4, 4, 1, 600, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_NONE, 0, 0, 0, 1, 0}, 8},
      {{3, 8, 4, 1, 900, 192, 192, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 32},
      {{2, 8, 4, 1, 500, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16},
      {{3, 8, 4, 1, 800, 128, 256, F32, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16},
      {{3, 8, 4, 1, 400, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_WINDOW, 37, 0, 0, 1, 0}, 8},
      {{3, 8, 4, 1, 5, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16},
      {{3, 8, 4, 1, 1300, 256, 256, F16, F16, 0, 0, 0, F16, MASK_CAUSAL, 0, 20.0f, 1, 1, 0}, 64},
  };
  kva_context *ctx;
  /* the loop on, whatever the default; 2 vectors at head dim 256 on the fused kernel, not the warpgroup one */
  setenv("KVA_CUDA_FUSED_RING", "8192", 1);
  setenv("KVA_CUDA_WG_BF16_MIN_Q", "-1", 1);
  const int made1 = make_cuda_ctx(&ctx, NULL);
  unsetenv("KVA_CUDA_FUSED_RING");
  unsetenv("KVA_CUDA_WG_BF16_MIN_Q");
  if (!made1) return;
  for (size_t ci = 0; ci < sizeof sc / sizeof sc[0]; ++ci)
    if (!run_table_case(ctx, &sc[ci].c, sc[ci].bs, 61 + ci, "shared-memory ring")) {
      FAIL_("staged case %zu", ci);
      goto done;
    }
  kva_context_destroy(ctx);
  /* 2 vectors at head dim 128 over a table (the tensor-core kernel by default): the staged loop
   * with KVA_CUDA_TC_TABLE_MIN_Q=3 (QW 2 at 8 lanes a row, 16 rows a slot) */
  static const struct {
    att_case c;
    int64_t bs;
  } s2[] = {
      {{3, 16, 8, 1, 900, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 16},
      {{3, 8, 4, 1, 1100, 128, 128, F16, F32, 0, 0, 0, F16, MASK_WINDOW, 200, 25.0f, 0, 1, 0}, 64},
  };
  setenv("KVA_CUDA_TC_TABLE_MIN_Q", "3", 1);
  setenv("KVA_CUDA_FUSED_RING", "8192", 1);
  const int made3 = make_cuda_ctx(&ctx, NULL);
  unsetenv("KVA_CUDA_TC_TABLE_MIN_Q");
  unsetenv("KVA_CUDA_FUSED_RING");
  if (!made3) return;
  for (size_t ci = 0; ci < sizeof s2 / sizeof s2[0]; ++ci)
    if (!run_table_case(ctx, &s2[ci].c, s2[ci].bs, 81 + ci, "shared-memory ring")) {
      FAIL_("2-vector D = 128 case %zu", ci);
      goto done;
    }
  kva_context_destroy(ctx);
  setenv("KVA_CUDA_FUSED_RING", "0", 1);
  setenv("KVA_CUDA_WG_BF16_MIN_Q", "-1", 1);
  const int made = make_cuda_ctx(&ctx, NULL);
  unsetenv("KVA_CUDA_FUSED_RING");
  unsetenv("KVA_CUDA_WG_BF16_MIN_Q");
  if (!made) return;
  for (size_t ci = 0; ci < sizeof sc / sizeof sc[0]; ++ci)
    if (!run_table_case(ctx, &sc[ci].c, sc[ci].bs, 61 + ci, "elements per lane, ")) { /* (not "lane via") */
      FAIL_("case %zu with the staged loop off", ci);
      goto done;
    }
done:
  kva_context_destroy(ctx);
}

/* The per-warp q4 decode kernel (src/cuda/attn_tcd.cu: bf16 queries, MLX's
 * group 64, head dims 128 / 256, up to 8 query vectors per KV head, 4 at
 * 256; contiguous or block-table rows). The selector sends only large calls
 * there (B KVH N >= KVC_TCD_MIN_WORK token-heads); this context lowers the bar to 0
 * through KVA_CUDA_TCD_MIN_WORK, so that small cases run it, and every case
 * asserts it did. */
TEST(cuda_q4_tcd_path) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  /* groups per S m-tile: 4 (1-2 vectors), 2 (3-4) and 1 (6, 8) at D = 256,
   * 2 (1-4 vectors) and 1 (6, 8) at D = 128; 9 to 32 vectors (blocks of 16,
   * one s8 query part); window, softcap, sinks, segments, ragged, strided,
   * a split shorter than a tile */
  static const att_case tc[] = {
      {1, 8, 4, 1, 700, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 16, 4, 1, 1333, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 300, 30.0f, 1, 1, 0},
      {1, 8, 4, 2, 900, 256, 256, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
      {1, 4, 4, 1, 2000, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_NONE, 0, 0, 0, 0, 1},
      {2, 32, 8, 1, 1500, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
      {2, 32, 8, 2, 1000, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
      {1, 4, 4, 8, 300, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_SEG, 0, 0, 0, 0, 0},
      {1, 8, 4, 3, 64, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 5, 0, 0, 0, 0},
      {1, 8, 4, 1, 1, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 12, 4, 1, 900, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 24, 4, 1, 1100, 256, 256, BF16, F32, 4, 4, 64, BF16, MASK_WINDOW, 300, 30.0f, 1, 1, 1},
      {1, 8, 4, 4, 700, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 16, 4, 2, 600, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_SEG, 0, 0, 1, 0, 0},
      {1, 24, 4, 1, 800, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
      /* head dim 64, one group per row (contiguous only): odd lengths put
       * each head's token 0 at a different entry of its 16-byte scale piece;
       * window, softcap, sinks, ragged (splits cut pieces); 7 vectors with
       * f32 out; 8 vectors; segments; no mask; a single token */
      {1, 8, 4, 1, 701, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 32, 8, 2, 1001, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 300, 30.0f, 1, 1, 0},
      {1, 14, 2, 1, 1503, 64, 64, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 4, 2, 4, 333, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_SEG, 0, 0, 0, 0, 0},
      {1, 8, 8, 1, 517, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_NONE, 0, 0, 0, 0, 0},
      {1, 8, 4, 1, 1, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {3, 16, 4, 2, 2999, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
      /* 9 to 16 query vectors (one s8 part, rows g + 8: "q int8"), D = 256,
       * 128, 64: verify L = 8, 4, 3, wide GQA; window, softcap, sinks,
       * segments, ragged, strided, no mask, a short cache */
      {1, 8, 4, 8, 700, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 12, 4, 3, 1333, 256, 256, BF16, F32, 4, 4, 64, BF16, MASK_WINDOW, 300, 30.0f, 1, 1, 0},
      {1, 40, 4, 1, 900, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_NONE, 0, 0, 0, 0, 1},
      {1, 32, 8, 4, 900, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
      {1, 16, 2, 2, 600, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_SEG, 0, 0, 1, 0, 0},
      {2, 20, 2, 1, 1001, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 300, 30.0f, 1, 1, 0},
      {1, 16, 1, 1, 517, 64, 64, BF16, F32, 4, 4, 64, BF16, MASK_NONE, 0, 0, 0, 0, 0},
      {1, 8, 4, 8, 9, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      /* 17 to 32 vectors: blocks of 16 (blockIdx.x), the last one partial */
      {1, 32, 8, 8, 700, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 24, 4, 4, 600, 256, 256, BF16, F32, 4, 4, 64, BF16, MASK_WINDOW, 200, 30.0f, 1, 1, 1},
      {2, 20, 1, 1, 901, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
  };
  /* NaN / Inf (plant_q4) at each kind of m-tile and P.V */
  static const att_case nc[] = {
      {1, 8, 4, 1, 500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 16, 4, 1, 500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 32, 8, 1, 500, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 32, 8, 2, 500, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 24, 4, 1, 500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 8, 4, 8, 500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 32, 8, 4, 500, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 24, 4, 4, 500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
  };
  /* BLOCK_TABLE rows: block sizes 24 (the division), 64, 16 and 8; at
   * D = 256 tiles across blocks (first offsets 1 and 2..: the lane-pair
   * copies) and, at block 64, tiles inside one block (the coalesced copies) */
  static const struct {
    att_case c;
    int64_t bs;
  } tt[] = {
      {{2, 32, 8, 2, 900, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 200, 0, 1, 1, 0}, 24},
      {{2, 16, 8, 1, 700, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 20.0f, 0, 1, 0}, 64},
      {{1, 8, 4, 1, 1100, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 16},
      {{2, 16, 4, 1, 900, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 300, 0, 1, 1, 0}, 8},
      {{2, 8, 4, 1, 1500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 64},
      {{2, 24, 4, 1, 1000, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 250, 0, 1, 1, 0}, 16},
      {{1, 8, 4, 4, 1300, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 64},
      /* head dim 64 (one group per row: 8-entry scale pieces, each in one
       * block): blocks 16, 8, 24 (the division) and 64, windows, ragged */
      {{2, 32, 8, 1, 1100, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16},
      {{2, 16, 4, 2, 900, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 250, 0, 1, 1, 0}, 8},
      {{2, 14, 2, 1, 1000, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 24},
      {{1, 8, 4, 1, 1300, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 700, 0, 0, 0, 0}, 64},
      /* 16 query vectors per KV head */
      {{2, 8, 4, 8, 900, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 16},
      {{1, 8, 4, 8, 1300, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 64},
      {{1, 32, 8, 4, 1100, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 64},
      {{2, 16, 2, 4, 900, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 250, 0, 1, 1, 0}, 24},
      {{2, 32, 4, 2, 1000, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16},
      {{2, 32, 8, 8, 900, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 16},
  };
  setenv("KVA_CUDA_TCD_MIN_WORK", "0", 1);
  setenv("KVA_CUDA_TCD_MAX_Q", "32", 1); /* its 17-32 vector blocks at every head dim */
  kva_context *ctx;
  const int made = make_cuda_ctx(&ctx, NULL);
  unsetenv("KVA_CUDA_TCD_MIN_WORK");
  unsetenv("KVA_CUDA_TCD_MAX_Q");
  if (!made) return;
  for (size_t ci = 0; ci < sizeof tc / sizeof tc[0]; ++ci)
    if (!run_case_want(ctx, &tc[ci], NULL, 0, "per-warp,")) {
      FAIL_("case %zu", ci);
      goto done;
    }
  for (size_t ci = 0; ci < sizeof nc / sizeof nc[0]; ++ci)
    for (int variant = 0; variant < 3; ++variant)
      if (!run_case_want(ctx, &nc[ci], plant_q4, variant, "per-warp,")) {
        FAIL_("NaN/Inf case %zu, variant %d", ci, variant);
        goto done;
      }
  for (size_t ci = 0; ci < sizeof tt / sizeof tt[0]; ++ci)
    if (!run_table_case(ctx, &tt[ci].c, tt[ci].bs, 31 + ci, "per-warp,")) break;
done:
  kva_context_destroy(ctx);
}

/* Randomized bad input on the device: test_mutations.c's mutations
 * (mutate_call.c) of the same host descriptors, each mutated call mirrored:
 * its pointers to the device copies of the base call's buffers (or NULL
 * where a mutation made them NULL), its lengths, block ids and first
 * offsets copied into device arrays. A call must fail with a message and
 * leave the device output and its sentinel untouched, or succeed without a
 * fault (a kernel fault is sticky: the fetch after the call reports it) and
 * agree with the oracle, except where a mutated device value is one the
 * oracle refuses: CUDA reads those arrays in the kernels and clamps them
 * (kvattn.h, kva_block_table), so such a call only has to stay inside its
 * buffers. Run under compute-sanitizer memcheck by bench/cuda_all.sh, which
 * turns a read past a clamped value into a failure. */
typedef struct mut_dev {
  dev_data dd;                          /* q, out + sentinel, contiguous K/V, masks, sinks */
  kva_kv pk, pv;                        /* the pools (block-table cases) */
  int32_t *lens, *blocks, *tlens, *fo;  /* device arrays each call's values go to */
  unsigned char *poison;                /* the host image of a poisoned output */
} mut_dev;

/* A mutated descriptor on the device: its fields, the device copy's pointer
 * (a mutation only ever sets a pointer to NULL). */
static kva_tensor mut_dev_tensor(const kva_tensor *mut, const kva_tensor *dev) {
  kva_tensor t = *mut;
  t.data = mut->data ? dev->data : NULL;
  return t;
}
static kva_kv mut_dev_kv(const kva_kv *mut, const kva_kv *dev) {
  kva_kv k = *mut;
  k.data = mut_dev_tensor(&mut->data, &dev->data);
  k.scales = mut_dev_tensor(&mut->scales, &dev->scales);
  k.biases = mut_dev_tensor(&mut->biases, &dev->biases);
  return k;
}

static int mut_dev_make(mut_dev *md, const mut_base *m) {
  memset(md, 0, sizeof *md);
  const int B = m->d.c.B;
  const int64_t mb = m->table ? m->tb.t.max_blocks : 1;
  if (!dev_make(&md->dd, &m->d)) return 0;
  md->lens = (int32_t *)dev_keep(&md->dd, sizeof(int32_t) * (size_t)B);
  md->blocks = (int32_t *)dev_keep(&md->dd, sizeof(int32_t) * (size_t)(B * mb));
  md->tlens = (int32_t *)dev_keep(&md->dd, sizeof(int32_t) * (size_t)B);
  md->fo = (int32_t *)dev_keep(&md->dd, sizeof(int32_t) * (size_t)B);
  md->poison = (unsigned char *)malloc(m->d.out_bytes);
  if (!md->lens || !md->blocks || !md->tlens || !md->fo || !md->poison) return 0;
  memset(md->poison, DEV_POISON_BYTE, m->d.out_bytes);
  return !m->table || (mirror_kv(&md->dd, &m->tb.k, &md->pk) && mirror_kv(&md->dd, &m->tb.v, &md->pv));
}
static void mut_dev_free(mut_dev *md) {
  dev_free(&md->dd);
  free(md->poison);
}

/* Runs the mutated calls of one base case on ctx; 0 when all held. */
static int run_cuda_mutations(kva_context *ctx, const att_case *ac, int64_t bs, int iters, int *accepted,
                              int *compared) {
  mut_base m;
  if (mut_base_make(&m, ac, bs)) return -1;
  mut_call c;
  mut_dev md;
  const int made_call = mut_call_alloc(&c, &m) == 0, made_dev = mut_dev_make(&md, &m);
  int rc_all = made_call && made_dev ? 0 : -1;
  if (rc_all) FAIL_("could not mirror the base call to the device");
  const int B = ac->B;
  const int64_t mb = m.table ? m.tb.t.max_blocks : 1;
  for (int it = 0; it < iters && rc_all == 0; ++it) {
    mut_call_reset(&c, &m);
    const int nm = 1 + att_pick(3);
    for (int k = 0; k < nm; ++k) mut_call_mutate(&c, &m);
    if (getenv("KVA_MUT_TRACE")) {
      fprintf(stderr, "iteration %d:\n", it);
      mut_call_diff(&c, &m);
    }
    /* the call's descriptors on the device */
    const dev_data *dd = &md.dd;
    kva_tensor q = mut_dev_tensor(&c.q, &dd->q), out = mut_dev_tensor(&c.out, &dd->out);
    kva_kv_view view = c.view;
    view.k = mut_dev_kv(&c.view.k, m.table ? &md.pk : &dd->k);
    view.v = mut_dev_kv(&c.view.v, m.table ? &md.pv : &dd->v);
    kva_block_table t = c.t;
    int ok = 1;
    if (c.view.seq_lens) {
      ok &= cuda_ok(cudaMemcpy(md.lens, c.view.seq_lens, sizeof(int32_t) * (size_t)B, cudaMemcpyHostToDevice), "lens");
      view.seq_lens = md.lens;
    }
    if (c.view.table) { /* points at c.t (mut_call_reset) */
      ok &= cuda_ok(cudaMemcpy(md.blocks, c.blocks, sizeof(int32_t) * (size_t)(B * mb), cudaMemcpyHostToDevice),
                    "blocks") &&
            cuda_ok(cudaMemcpy(md.tlens, c.tlens, sizeof(int32_t) * (size_t)B, cudaMemcpyHostToDevice), "lens") &&
            cuda_ok(cudaMemcpy(md.fo, c.fo, sizeof(int32_t) * (size_t)B, cudaMemcpyHostToDevice), "offsets");
      t.blocks = c.t.blocks ? md.blocks : NULL;
      t.seq_lens = c.t.seq_lens ? md.tlens : NULL;
      t.first_offset = c.t.first_offset ? md.fo : NULL;
      view.table = &t;
    }
    kva_attn_params p = c.p;
    p.sinks = c.p.sinks ? dd->sinks : NULL;
    p.mask.segments = mut_dev_tensor(&c.p.mask.segments, &dd->params.mask.segments);
    p.mask.array = mut_dev_tensor(&c.p.mask.array, &dd->params.mask.array);
    if (!ok || !dev_poison(&md.dd, 0)) { rc_all = -1; break; }

    const int rc = kva_attention(ctx, &q, &view, &p, &out, NULL, 0);
    if (!dev_fetch(&md.dd, &m.d, "mutated call")) { /* a fault, or the sentinel */
      FAIL_("iteration %d (code %d); the mutations:", it, rc);
      mut_call_diff(&c, &m);
      rc_all = -1;
      break;
    }
    if (rc < 0) {
      if (!kva_last_error()[0]) { FAIL_("iteration %d: code %d without a message", it, rc); rc_all = -1; }
      if (memcmp(md.poison, m.d.out_buf, m.d.out_bytes) != 0) {
        FAIL_("iteration %d: output modified on error %d (%s); the mutations:", it, rc, kva_last_error());
        mut_call_diff(&c, &m);
        rc_all = -1;
      }
      continue;
    }
    ++*accepted;
    if (mut_check_accepted(NULL, &c, &m, cuda_case_atol_layout(ac, bs), c.dev_values, it, compared)) rc_all = -1;
  }
  mut_dev_free(&md);
  mut_call_free(&c);
  mut_base_free(&m);
  return rc_all;
}

TEST(cuda_random_mutations) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  /* test_mutations.c's base cases, then q4 with bf16 queries (the
   * tensor-core kernels) over contiguous rows and blocks of 16 */
  static const att_case q4 = {2, 8, 4, 2, 300, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0};
  kva_context *ctx;
  if (!make_cuda_ctx(&ctx, NULL)) return;
  const int iters = test_quick ? MUT_ITERS_QUICK : MUT_ITERS;
  for (int i = 0; i < MUT_NCASES + 2; ++i) {
    const att_case *ac = i < MUT_NCASES ? &mut_cases[i].c : &q4;
    const int bs = i < MUT_NCASES ? mut_cases[i].block : i == MUT_NCASES ? 0 : 16;
    int accepted = 0, compared = 0;
    if (run_cuda_mutations(ctx, ac, bs, iters, &accepted, &compared) < 0) {
      char s[256];
      att_case_str(ac, s, sizeof s);
      FAIL_("case %s, block %d", s, bs);
      break;
    }
    fprintf(stderr, "  case %d (block %d): %d mutated calls, %d accepted, %d of them compared with the oracle\n", i,
            bs, iters, accepted, compared);
    if (compared == 0) { FAIL_("case %d: no mutated call was accepted and compared (%d accepted)", i, accepted); break; }
  }
  kva_context_destroy(ctx);
}
/* Grid limits (gridDim.y/z <= 65535): B * KVH beyond it (the fast kernels'
 * gridDim.z) runs the general kernel and matches the oracle; B or H beyond
 * it (the general and merge kernels' gridDim.z / .y) is KVA_EUNSUPPORTED
 * naming the dimension, before anything is read or launched (the
 * descriptors may then point at host memory). Tiny N keeps it cheap. */
TEST(cuda_grid_limits) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  kva_context *ctx;
  if (!make_cuda_ctx(&ctx, NULL)) return;
  /* B * KVH = 3 * 32768 > 65535, H = 32768: the general kernel, against the oracle */
  const att_case wide = {3, 32768, 32768, 1, 3, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  const int ok = run_case_want(ctx, &wide, NULL, 0, "general");
  const att_case big_b = {65536, 1, 1, 1, 1, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  const att_case big_h = {1, 65536, 1, 1, 1, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  const att_case *bad[2] = {&big_b, &big_h};
  const char *needle[2] = {"batch B = 65536 exceeds the grid limit 65535", "query heads H = 65536 exceed the grid limit"};
  for (int i = 0; ok && i < 2; ++i) {
    att_data d;
    if (att_make(&d, bad[i])) { FAIL_("could not build operands"); break; }
    size_t bytes = 0;
    char kname[128];
    int rc = kva_attention_workspace_size(ctx, &d.q, &d.view, &d.params, &bytes);
    int rc2 = kva_attention_kernel(ctx, &d.q, &d.view, &d.params, &d.out, kname, sizeof kname);
    int rc3 = kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, NULL, 0);
    if (rc != KVA_EUNSUPPORTED || rc2 != KVA_EUNSUPPORTED || rc3 != KVA_EUNSUPPORTED || !strstr(kva_last_error(), needle[i]))
      FAIL_("case %d: %d / %d / %d (%s), expected KVA_EUNSUPPORTED naming \"%s\"", i, rc, rc2, rc3, kva_last_error(),
            needle[i]);
    att_free(&d);
  }
  kva_context_destroy(ctx);
}
/* Rows that see no key on the device: lengths in device memory below L
 * (clamped into [0, N]: row i sits at p = len - L + i, and rows with p < 0
 * see nothing) output zeros, sinks or not; the other rows match the oracle
 * over the sequence's first len tokens with the last len query rows (a
 * call with L = len, whose rows sit at the same positions). Tensor-core
 * (bf16 q, q4 and bf16 K/V) and fused (f32; L = 3 and L = 20) kernels. */
TEST(cuda_rows_without_keys) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  static const att_case rc[] = {
      {3, 8, 2, 4, 300, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
      {3, 12, 2, 4, 300, 128, 128, BF16, F32, 0, 0, 0, BF16, MASK_WINDOW, 40, 0, 0, 1, 0},
      {3, 4, 2, 3, 200, 64, 64, F32, F32, 4, 4, 32, BF16, MASK_CAUSAL, 0, 0, 1, 1, 1},
      {3, 4, 2, 20, 100, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 1, 1, 0},
  };
  kva_context *ctx;
  if (!make_cuda_ctx(&ctx, NULL)) return;
  for (size_t ci = 0; ci < sizeof rc / sizeof rc[0] && !test_failed_flag; ++ci) {
    const att_case *c = &rc[ci];
    char name[256];
    att_case_str(c, name, sizeof name);
    att_data hd;
    dev_data dd;
    memset(&dd, 0, sizeof dd);
    if (att_make(&hd, c) || !dev_make(&dd, &hd)) {
      FAIL_("%s: operands", name);
      dev_free(&dd);
      att_free(&hd);
      break;
    }
    /* lengths: 0 (no row sees a key), L - 1 (row 0 sees none), the case's own */
    hd.lens[0] = 0;
    hd.lens[1] = c->L - 1;
    kva_tensor ref = att_alloc_like(&hd, &hd.out);
    memset(ref.data, 0, (size_t)(c->B * c->H * c->L * c->Dv) * kva_dtype_size(c->odt));
    int ok = 1;
    for (int b = 0; b < c->B && ok; ++b) {
      const int64_t len = hd.lens[b];
      if (len == 0) continue;
      /* the oracle over sequence b's first len tokens, its last min(len, L) rows */
      const int64_t rows = len < c->L ? len : c->L;
      kva_tensor q = hd.q, out = ref;
      q.shape[0] = out.shape[0] = 1;
      q.shape[2] = out.shape[2] = rows;
      q.data = (char *)hd.q.data + b * hd.q.stride[0] + (c->L - rows) * hd.q.stride[2];
      out.data = (char *)ref.data + b * ref.stride[0] + (c->L - rows) * ref.stride[2];
      kva_kv k = hd.k, v = hd.v;
      kva_tensor *ts[6] = {&k.data, &k.scales, &k.biases, &v.data, &v.scales, &v.biases};
      for (int i = 0; i < 6; ++i) {
        if (!ts[i]->data) continue;
        ts[i]->data = (char *)ts[i]->data + b * ts[i]->stride[0];
        ts[i]->shape[0] = 1;
        ts[i]->shape[2] = len;
      }
      const kva_kv_view view = kva_view_contiguous(&k, &v, NULL);
      if (kva_reference_attention(&q, &view, &hd.params, &out)) {
        FAIL_("%s: oracle for sequence %d: %s", name, b, kva_last_error());
        ok = 0;
      }
    }
    if (ok && (!cuda_ok(cudaMemcpy(dd.lens, hd.lens, sizeof(int32_t) * (size_t)c->B, cudaMemcpyHostToDevice), "lens") ||
               !dev_poison(&dd, 0)))
      ok = 0;
    if (ok) {
      const double atol = att_kernel_atol(ctx, &dd.q, &dd.view, &dd.params, &dd.out);
      if (kva_attention(ctx, &dd.q, &dd.view, &dd.params, &dd.out, NULL, 0)) {
        FAIL_("%s: kva_attention(CUDA): %s", name, kva_last_error());
      } else if (dev_fetch(&dd, &hd, name)) {
        double err = 0;
        /* the empty rows: exactly zero (the reference holds zeros there) */
        if (!att_compare(&hd.out, &ref, atol, att_rtol(c->odt), &err, NULL))
          FAIL_("%s: lengths {0, %d, %d}: differs from the oracle (max err %.3g)", name, c->L - 1, hd.lens[2], err);
        for (int b = 0; b < 2 && !test_failed_flag; ++b)
          for (int64_t h = 0; h < c->H; ++h)
            for (int64_t i = 0; i < c->L - hd.lens[b]; ++i)
              for (int64_t e = 0; e < c->Dv; ++e)
                if (test_load((const char *)hd.out.data + b * hd.out.stride[0] + h * hd.out.stride[1] +
                                  i * hd.out.stride[2] + e * hd.out.stride[3],
                              c->odt) != 0.0f) {
                  FAIL_("%s: sequence %d (length %d), head %lld, row %lld sees no key but is not zero", name, b,
                        hd.lens[b], (long long)h, (long long)i);
                  goto next;
                }
      next:;
      }
    }
    dev_free(&dd);
    att_free(&hd);
  }
  kva_context_destroy(ctx);
}

/* Sinks of -inf (no effect) on every other head, against the oracle:
 * tensor-core, per-warp, fused, general. (+inf and NaN sinks, which the
 * oracle refuses, are device memory the CUDA backend does not check.) */
static void plant_sinks(att_data *d, int variant) {
  (void)variant;
  for (int h = 0; h < d->c.H; h += 2) d->sinks[h] = -INFINITY;
}
TEST(cuda_sinks_nonfinite) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  static const att_case sc[] = {
      {2, 8, 2, 2, 900, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
      {2, 24, 4, 8, 700, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
      {2, 24, 4, 2, 500, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
      {2, 8, 4, 3, 600, 128, 128, F32, F32, 8, 8, 64, F16, MASK_WINDOW, 70, 0, 1, 1, 0},
      {1, 4, 2, 5, 200, 64, 64, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, 1, 0, 0},
  };
  run_case_table(sc, sizeof sc / sizeof sc[0], plant_sinks, 1, NULL);
}

/* ---- lse and merge ---- */
/* lse allowance on CUDA, from the kernel's name: f32 rounding (LSE_RTOL)
 * for "[exact f32]" and exact integer q.k; where a kernel rounds the query,
 * K, or P (l summed from rounded weights), the bf16 allowance. */
static double cuda_lse_rtol(const char *kname) {
  return att_name_atol(kname) == ATT_ATOL_F32 ? LSE_RTOL : ATT_ATOL_BF16;
}

/* One case through kva_attention_lse on the device (lse in a padded device
 * buffer with a sentinel) against the oracle with the kernel's roundings (out and lse). */
static int run_lse_case(kva_context *ctx, const att_case *c, unsigned flags) {
  char name[256];
  att_case_str(c, name, sizeof name);
  att_data hd;
  dev_data dd;
  memset(&dd, 0, sizeof dd);
  lse_buf rl, kl;
  memset(&rl, 0, sizeof rl);
  memset(&kl, 0, sizeof kl);
  int ok = 0;
  if (att_make(&hd, c) || lse_buf_make(&rl, c->B, c->H, c->L, 0) || lse_buf_make(&kl, c->B, c->H, c->L, 1)) {
    FAIL_("%s: could not build operands", name);
    goto done;
  }
  kva_tensor ref = att_alloc_like(&hd, &hd.out);
  if (!dev_make(&dd, &hd)) {
    FAIL_("%s: could not mirror operands to the device", name);
    goto done;
  }
  char kname[160];
  kva_attention_kernel(ctx, &dd.q, &dd.view, &dd.params, &dd.out, kname, sizeof kname);
  kva_ref_rounding rr; /* the oracle with the kernel's modelled roundings, out and lse */
  att_name_rounding(kname, &rr);
  if (kva_reference_attention_rounded(&hd.q, &hd.view, &hd.params, &ref, &rl.t, flags, &rr)) {
    FAIL_("%s: oracle: %s", name, kva_last_error());
    goto done;
  }
  const size_t lb = (kl.n + 4) * sizeof(float); /* poison and sentinel as on the host */
  void *dl = dev_keep(&dd, lb);
  if (!dl || !cuda_ok(cudaMemcpy(dl, kl.mem, lb, cudaMemcpyHostToDevice), "lse to device")) goto done;
  kva_tensor dlse = kl.t;
  dlse.data = dl;
  if (!dev_poison(&dd, 0)) goto done;
  printf("  %-90s %s\n", kname, name);
  fflush(stdout);
  if (kva_attention_lse(ctx, &dd.q, &dd.view, &dd.params, &dd.out, &dlse, flags, NULL, 0)) {
    FAIL_("%s: kva_attention_lse(CUDA): %s", name, kva_last_error());
    goto done;
  }
  if (!dev_fetch(&dd, &hd, name) ||
      !cuda_ok(cudaMemcpy(kl.mem, dl, lb, cudaMemcpyDeviceToHost), "lse from device"))
    goto done;
  if (!att_compare(&hd.out, &ref, att_kernel_atol(ctx, &dd.q, &dd.view, &dd.params, &dd.out), att_rtol(c->odt), NULL, NULL)) {
    FAIL_("%s: CUDA out differs from the oracle", name);
    goto done;
  }
  if (!lse_compare(&kl.t, &rl.t, cuda_lse_rtol(kname), kname) || !lse_sentinel_ok(&kl)) {
    FAIL_("%s: CUDA lse differs from the oracle", name);
    goto done;
  }
  ok = 1;
done:
  lse_buf_free(&rl);
  lse_buf_free(&kl);
  dev_free(&dd);
  att_free(&hd);
  return ok;
}

/* Kernel families the lse must reach: the table above (fused, general,
 * tensor-core, split merge and one-split direct writes), the warpgroup
 * verify (q4, 48 vectors per KV head), the per-warp decode (a context with
 * KVA_CUDA_TCD_MIN_WORK=0), a row-without-keys array mask, sinks, base 2. */
static const att_case lse_extra[] = {
    {1, 24, 4, 8, 1000, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 24, 4, 8, 3000, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
    {2, 8, 4, 1, 5000, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
    {2, 8, 4, 4, 700, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_WINDOW, 50, 0, 1, 1, 0},
    {2, 4, 2, 5, 200, 64, 64, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, 1, 1, 0},
    {1, 4, 2, 24, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 5.0f, 1, 0, 0},
};

TEST(cuda_lse) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  kva_context *ctx, *tcd;
  if (!make_cuda_ctx(&ctx, NULL)) return;
  setenv("KVA_CUDA_TCD_MIN_WORK", "0", 1); /* read at context creation */
  setenv("KVA_CUDA_TCD_MAX_Q", "32", 1); /* its 17-32 vector blocks at every head dim */
  int made = make_cuda_ctx(&tcd, NULL);
  unsetenv("KVA_CUDA_TCD_MIN_WORK");
  unsetenv("KVA_CUDA_TCD_MAX_Q");
  if (!made) { kva_context_destroy(ctx); return; }
  int ok = 1;
  for (int ci = 0; ci < NCASES && ok; ++ci) {
    if (test_quick && cases[ci].N > 1000) continue;
    ok = run_lse_case(ctx, &cases[ci], ci & 1 ? KVA_LSE_BASE2 : 0);
  }
  for (size_t ci = 0; ci < sizeof lse_extra / sizeof lse_extra[0] && ok; ++ci)
    ok = run_lse_case(ctx, &lse_extra[ci], ci & 1 ? 0 : KVA_LSE_BASE2) && run_lse_case(tcd, &lse_extra[ci], 0);
  kva_context_destroy(tcd);
  kva_context_destroy(ctx);
}

/* kva_merge_states on the device against the CPU's (the same left fold:
 * equal up to expf / logf rounding): random parts with some rows -inf in some
 * parts and one row -inf in all, mixed part dtypes, padded lse strides, in
 * place over part 0, and a graph capture of the merge replayed. */
TEST(cuda_lse_merge) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  kva_context *ctx, *cpu;
  if (!make_cuda_ctx(&ctx, NULL)) return;
  ASSERT_OK(kva_context_create(&cpu, NULL));
  enum { R = 5, B = 2, H = 6, L = 3, D = 128 };
  const kva_dtype odt[R] = {KVA_F32, KVA_BF16, KVA_F16, KVA_F32, KVA_F32};
  kva_tensor ho[R], hl[R], dov[R], dlv[R];
  lse_buf lb[R];
  void *dmem[2 * R + 2];
  int nd = 0;
  for (int r = 0; r < R; ++r) {
    const size_t n = (size_t)B * H * L * D, es = kva_dtype_size(odt[r]);
    void *m = malloc(n * es);
    ho[r] = kva_tensor_4d(m, odt[r], B, H, L, D);
    for (size_t k = 0; k < n; ++k) test_store((char *)m + k * es, odt[r], test_randn());
    ASSERT_TRUE(lse_buf_make(&lb[r], B, H, L, r & 1) == 0);
    hl[r] = lb[r].t;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < L; ++i) {
          float z = 3.0f * test_randn();
          if ((b + h + i + r) % 4 == 0 || (b == 1 && h == 2 && i == 1)) z = -INFINITY; /* empty parts, one row all */
          lse_set(&hl[r], b, h, i, z);
        }
    dov[r] = ho[r];
    dlv[r] = hl[r];
    ASSERT_TRUE(cudaMalloc(&dmem[nd], n * es) == cudaSuccess);
    dov[r].data = dmem[nd++];
    ASSERT_TRUE(cudaMemcpy(dov[r].data, ho[r].data, n * es, cudaMemcpyHostToDevice) == cudaSuccess);
    ASSERT_TRUE(cudaMalloc(&dmem[nd], lb[r].n * 4) == cudaSuccess);
    dlv[r].data = dmem[nd++];
    ASSERT_TRUE(cudaMemcpy(dlv[r].data, lb[r].mem, lb[r].n * 4, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  const size_t on = (size_t)B * H * L * D;
  float *href = (float *)malloc(on * 4), *hout = (float *)malloc(on * 4);
  kva_tensor ref = kva_tensor_4d(href, KVA_F32, B, H, L, D), got = kva_tensor_4d(hout, KVA_F32, B, H, L, D);
  lse_buf rl, gl;
  ASSERT_TRUE(lse_buf_make(&rl, B, H, L, 0) == 0 && lse_buf_make(&gl, B, H, L, 1) == 0);
  ASSERT_OK(kva_merge_states(cpu, R, ho, hl, &ref, &rl.t, 0));
  kva_tensor dout = got, dlo = gl.t;
  ASSERT_TRUE(cudaMalloc(&dmem[nd], on * 4) == cudaSuccess);
  dout.data = dmem[nd++];
  ASSERT_TRUE(cudaMalloc(&dmem[nd], (gl.n + 4) * 4) == cudaSuccess);
  dlo.data = dmem[nd++];
  ASSERT_TRUE(cudaMemcpy(dlo.data, gl.mem, (gl.n + 4) * 4, cudaMemcpyHostToDevice) == cudaSuccess);
  /* captured into a graph and replayed */
  cudaStream_t s;
  ASSERT_TRUE(cudaStreamCreate(&s) == cudaSuccess);
  ASSERT_OK(kva_context_set_stream(ctx, s));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  ASSERT_TRUE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
  int rc = kva_merge_states(ctx, R, dov, dlv, &dout, &dlo, 0);
  ASSERT_TRUE(cudaStreamEndCapture(s, &g) == cudaSuccess);
  ASSERT_OK(rc);
  ASSERT_TRUE(cudaGraphInstantiate(&ge, g, 0) == cudaSuccess);
  ASSERT_TRUE(cudaGraphLaunch(ge, s) == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess);
  ASSERT_TRUE(cudaMemcpy(hout, dout.data, on * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  ASSERT_TRUE(cudaMemcpy(gl.mem, dlo.data, (gl.n + 4) * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  ASSERT_TRUE(att_compare(&got, &ref, 1e-6, 0, NULL, NULL));
  ASSERT_TRUE(lse_compare(&gl.t, &rl.t, 1e-6, "cuda merge") && lse_sentinel_ok(&gl));
  ASSERT_TRUE(lse_get(&gl.t, 1, 2, 1) == -INFINITY && hout[((1 * H + 2) * L + 1) * D] == 0.0f);
  /* in place over part 0 (f32) with lse_out = parts_lse[0] */
  ASSERT_OK(kva_merge_states(ctx, R, dov, dlv, &dov[0], &dlv[0], 0));
  ASSERT_TRUE(cudaStreamSynchronize(s) == cudaSuccess);
  ASSERT_TRUE(cudaMemcpy(hout, dov[0].data, on * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  ASSERT_TRUE(cudaMemcpy(lb[0].mem, dlv[0].data, lb[0].n * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  ASSERT_TRUE(att_compare(&got, &ref, 1e-6, 0, NULL, NULL));
  ASSERT_TRUE(lse_compare(&lb[0].t, &rl.t, 1e-6, "cuda merge in place"));
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  kva_context_set_stream(ctx, NULL);
  cudaStreamDestroy(s);
  for (int k = 0; k < nd; ++k) cudaFree(dmem[k]);
  for (int r = 0; r < R; ++r) {
    free(ho[r].data);
    lse_buf_free(&lb[r]);
  }
  lse_buf_free(&rl);
  lse_buf_free(&gl);
  free(href);
  free(hout);
  kva_context_destroy(cpu);
  kva_context_destroy(ctx);
}

/* ---- exact mode ---- */
static void set_exact(att_data *d, int variant) {
  (void)variant;
  d->params.flags = KVA_ATTN_EXACT;
}
/* The kernel name of a case's call on the device with params.flags = flags. */
static int cuda_case_kernel(kva_context *ctx, const att_case *c, unsigned flags, char *kname, size_t n) {
  att_data hd;
  dev_data dd;
  memset(&dd, 0, sizeof dd);
  int ok = !att_make(&hd, c) && dev_make(&dd, &hd);
  dd.params.flags = flags;
  if (ok && kva_attention_kernel(ctx, &dd.q, &dd.view, &dd.params, &dd.out, kname, n) < 0) {
    FAIL_("kva_attention_kernel(CUDA): %s", kva_last_error());
    ok = 0;
  }
  dev_free(&dd);
  att_free(&hd);
  return ok;
}
/* KVA_ATTN_EXACT on CUDA: q4 decode / verify shapes (and bf16 rows) that
 * take a tensor-core kernel by default (narrow or 32-vector tc, per-warp
 * tcd at B KVH N >= 2^18, warpgroup on Hopper) run the fused CUDA-core
 * kernel instead, named "[exact f32]", within the f32 allowance of the
 * oracle (f32 out; att_kernel_atol reads the name). */
TEST(cuda_exact_mode) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  static const att_case ec[] = {
      {1, 8, 4, 1, 4096, 256, 256, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 8, 4, 8, 4096, 256, 256, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 8, 4, 1, 65536, 256, 256, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 24, 4, 2, 600, 128, 128, BF16, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
  };
  kva_context *ctx;
  if (!make_cuda_ctx(&ctx, NULL)) return;
  for (size_t ci = 0; ci < sizeof ec / sizeof ec[0] && !test_failed_flag; ++ci) {
    char cs[256], dflt[160], exact[160];
    att_case_str(&ec[ci], cs, sizeof cs);
    if (!cuda_case_kernel(ctx, &ec[ci], 0, dflt, sizeof dflt) ||
        !cuda_case_kernel(ctx, &ec[ci], KVA_ATTN_EXACT, exact, sizeof exact))
      break;
    printf("  %-60s -> %-60s %s\n", dflt, exact, cs);
    fflush(stdout);
    if (att_name_exact(dflt)) FAIL_("%s: runs \"%s\" without the flag (the case tests nothing)", cs, dflt);
    else if (!att_name_exact(exact)) FAIL_("%s: KVA_ATTN_EXACT runs \"%s\"", cs, exact);
    else if (att_name_atol(exact) != ATT_ATOL_F32) FAIL_("%s: \"%s\" is not given the f32 allowance", cs, exact);
    else if (!run_case_want(ctx, &ec[ci], set_exact, 0, "[exact f32]")) FAIL_("%s: exact mode", cs);
  }
  kva_context_destroy(ctx);
}

/* ---------------------------------------------------------- tree verify */
/* Variant 0: the case's trees (attn_check.c, MASK_TREE: depth L, 1 or random
 * per sequence); 1: random bits (rows that see no new token, or later ones);
 * 2: the trees as the explicit bool mask of the same rule (att_tree_array:
 * the same call through the general kernel). */
static void tree_bits(att_data *d, int variant) {
  if (variant == 1) att_tree_random_bits(d);
  if (variant == 2) {
    kva_mask m = {0};
    m.kind = KVA_MASK_ARRAY;
    m.array = att_tree_array(d);
    d->params.mask = m;
  }
}

/* KVA_MASK_TREE on the device against the oracle (whose TREE result the CPU
 * tests check equal to the explicit ARRAY mask's): odd L 1..64, B = 3 with
 * different trees and lengths, windows and segments on the prefix, float
 * and 4/8-bit K/V, contiguous and block-table rows; the bench's shapes
 * (q4 8/4/256 and 32/8/128 at 16, 33 and 64 nodes) must run a tensor-core
 * kernel, never the general one; the per-warp q4 kernel at up to 32 query
 * vectors (KVA_CUDA_TCD_MIN_WORK = 0). */
TEST(cuda_tree) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
#define TR MASK_TREE
  static const struct {
    att_case c;
    const char *want;
  } tc[] = {
      /* a window starting inside a split that ends before the new keys */
      {{2, 16, 4, 33, 3000, 128, 128, BF16, BF16, 4, 4, 64, BF16, TR, 1501, 0, 0, 1, 0}, NULL},
      /* the bench's shapes, smaller caches */
      {{3, 32, 8, 16, 1500, 128, 128, BF16, BF16, 4, 4, 64, BF16, TR, 0, 0, 0, 1, 0}, "tensor-core kernel"},
      {{3, 32, 8, 33, 1200, 128, 128, BF16, BF16, 4, 4, 64, BF16, TR, 0, 0, 0, 1, 0}, "tensor-core kernel"},
      {{2, 32, 8, 64, 2000, 128, 128, BF16, F32, 4, 4, 64, BF16, TR, 0, 0, 1, 1, 0}, "tensor-core kernel"},
      {{3, 8, 4, 16, 1500, 256, 256, BF16, BF16, 4, 4, 64, BF16, TR, 0, 0, 0, 1, 0}, "tensor-core kernel"},
      {{1, 8, 4, 64, 3000, 256, 256, BF16, BF16, 4, 4, 64, BF16, TR, 0, 0, 0, 0, 0}, "tensor-core kernel"},
      {{3, 8, 4, 33, 900, 256, 256, BF16, BF16, 4, 4, 64, BF16, TR, 0, 0, 0, 1, 1}, NULL},
      /* odd L, windows, segments, other formats and kernels */
      {{3, 8, 4, 1, 700, 256, 256, BF16, BF16, 4, 4, 64, BF16, TR, 0, 0, 0, 1, 0}, NULL},
      {{3, 8, 4, 7, 900, 256, 256, BF16, BF16, 4, 4, 64, BF16, TR, 50, 0, 0, 1, 0}, NULL},
      {{2, 8, 4, 17, 800, 128, 128, BF16, BF16, 4, 4, 64, BF16, TR, 1, 0, 0, 1, 0}, NULL},
      {{2, 8, 4, 3, 600, 128, 128, BF16, F32, 4, 4, 32, F16, TR, 0, 10.0f, 1, 1, 0}, "fused"},
      {{3, 8, 2, 17, 700, 128, 128, BF16, BF16, 0, 0, 0, BF16, TR, 0, 0, 0, 1, 0}, "tensor-core kernel"},
      {{2, 8, 4, 33, 500, 64, 64, F32, F32, 0, 0, 0, F32, TR, 20, 0, 0, 1, 0}, "fused"},
      {{2, 6, 2, 17, 300, 128, 128, BF16, BF16, 8, 8, 64, BF16, TR, 0, 0, 0, 1, 0}, "tensor-core kernel"},
      {{3, 4, 2, 12, 300, 64, 64, BF16, F32, 4, 4, 32, BF16, MASK_TREE_SEG, 0, 0, 0, 1, 0}, NULL},
      {{2, 4, 2, 33, 400, 128, 128, F32, F32, 8, 8, 32, F32, MASK_TREE_SEG, 9, 0, 0, 1, 0}, "fused"},
      {{1, 4, 2, 64, 64, 128, 128, BF16, BF16, 4, 4, 64, BF16, TR, 0, 0, 0, 0, 0}, NULL},
      {{2, 16, 4, 9, 700, 128, 128, F32, F32, 2, 2, 64, F32, TR, 0, 0, 0, 1, 0}, "fused"},
  };
  /* the per-warp q4 kernel (up to 32 query vectors) and block tables */
  static const att_case wc[] = {
      {2, 8, 4, 8, 700, 256, 256, BF16, BF16, 4, 4, 64, BF16, TR, 0, 0, 0, 1, 0},
      {1, 32, 8, 4, 900, 128, 128, BF16, BF16, 4, 4, 64, BF16, TR, 0, 0, 0, 0, 0},
      {2, 8, 4, 16, 600, 256, 256, BF16, F32, 4, 4, 64, BF16, TR, 30, 0, 1, 1, 0},
  };
  static const struct {
    att_case c;
    int64_t bs;
  } bt[] = {
      {{3, 32, 8, 16, 1100, 128, 128, BF16, BF16, 4, 4, 64, BF16, TR, 0, 0, 0, 1, 0}, 16},
      {{2, 8, 4, 64, 1500, 256, 256, BF16, BF16, 4, 4, 64, BF16, TR, 0, 0, 0, 1, 0}, 16},
      {{3, 8, 4, 33, 900, 256, 256, BF16, BF16, 4, 4, 64, BF16, TR, 70, 0, 0, 1, 0}, 24},
      {{2, 8, 2, 17, 700, 128, 128, BF16, BF16, 0, 0, 0, BF16, TR, 0, 0, 0, 1, 0}, 16},
      {{2, 8, 4, 7, 500, 128, 128, F32, F32, 8, 8, 64, F16, TR, 0, 0, 0, 1, 0}, 8},
  };
#undef TR
  kva_context *ctx;
  if (!make_cuda_ctx(&ctx, NULL)) return;
  for (size_t ci = 0; ci < sizeof tc / sizeof tc[0]; ++ci) {
    char cs[256];
    att_case_str(&tc[ci].c, cs, sizeof cs);
    printf("  tree case %2zu %s\n", ci, cs);
    fflush(stdout);
    for (int variant = 0; variant < 3; ++variant)
      if (!run_case_want(ctx, &tc[ci].c, tree_bits, variant, variant == 2 ? "general" : tc[ci].want)) {
        FAIL_("tree case %zu, variant %d", ci, variant);
        goto done;
      }
  }
  for (size_t ci = 0; ci < sizeof bt / sizeof bt[0]; ++ci)
    if (!run_table_case(ctx, &bt[ci].c, bt[ci].bs, 51 + ci, NULL)) {
      FAIL_("tree table case %zu", ci);
      goto done;
    }
  kva_context_destroy(ctx);
  setenv("KVA_CUDA_TCD_MIN_WORK", "0", 1);
  setenv("KVA_CUDA_TCD_MAX_Q", "32", 1); /* its 17-32 vector blocks at every head dim */
  const int made = make_cuda_ctx(&ctx, NULL);
  unsetenv("KVA_CUDA_TCD_MIN_WORK");
  unsetenv("KVA_CUDA_TCD_MAX_Q");
  if (!made) return;
  for (size_t ci = 0; ci < sizeof wc / sizeof wc[0]; ++ci)
    if (!run_case_want(ctx, &wc[ci], tree_bits, (int)(ci % 2), "per-warp,") ||
        !run_table_case(ctx, &wc[ci], 16, 61 + ci, "per-warp,")) {
      FAIL_("tree per-warp case %zu", ci);
      break;
    }
done:
  kva_context_destroy(ctx);
}

/* ------------------------------------------------------------------ fp8 */
#define E4 KVA_F8E4M3
#define E5 KVA_F8E5M2
#define DEC4_ "f8e4m3 tensor-core kernel: decode instance"
#define DEC5_ "f8e5m2 tensor-core kernel: decode instance"
#define W4_ "f8e4m3 tensor-core kernel: wide (8 warps)"
#define W5_ "f8e5m2 tensor-core kernel: wide (8 warps)"
#define F4_ "f8e4m3 fused"
#define F5_ "f8e5m2 fused"
/* fp8 K/V (kvattn.h: e4m3 / e5m2 rows, f32 scales per (token, head), one
 * shared scale, or none), each case twice: as it runs by default (want:
 * bf16 queries over 16-byte aligned rows at head dims 64-256 the
 * tensor-core kernels, "[K,V,P bf16]", at the bf16 allowance; else the
 * fused or general kernel) and with KVA_ATTN_EXACT (exact: the fused
 * kernel's fp8 instances (decode, verify and longer L, GQA, masks,
 * softcap, sinks, ragged, strided) and the general kernel (array masks)
 * at "[exact f32]": the row scale applied to q . codes and to p,
 * f32 rounding only), each asserted by its name, against the oracle, random
 * and probe queries, NaN codes in the rows no query sees. Then cases for
 * the tensor-core kernels alone (fp8_tc_cases). The warpgroup kernel is
 * off here (KVA_CUDA_WG_FP8_MIN_Q=-1: on sm_90 it takes 16 and more vectors
 * by default): cuda_fp8_wg_path checks it. */
static const struct {
  att_case c;
  const char *want, *exact;
} fp8_cases[] = {
    {{1, 8, 4, 1, 1, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, DEC4_, F4_},
    {{1, 8, 4, 1, 3001, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, DEC4_, F4_},
    {{1, 8, 4, 1, 3001, 256, 256, BF16, F32, 0, 0, ATT_FP8_TENSOR, E5, MASK_CAUSAL, 0, 0, 0, 0, 1}, F5_, F5_},
    {{2, 32, 8, 1, 1000, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 1, 0}, DEC4_, F4_},
    {{1, 24, 4, 1, 2000, 256, 256, BF16, BF16, 0, 0, ATT_FP8_NONE, E5, MASK_CAUSAL, 0, 0, 0, 0, 0}, DEC5_, F5_},
    {{1, 4, 2, 1, 300, 64, 64, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_NONE, 0, 0, 0, 0, 1}, F4_, F4_},
    {{1, 4, 2, 2, 150, 80, 80, F32, F32, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 0, 0}, F5_, F5_},
    {{1, 4, 2, 1, 200, 512, 512, BF16, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, F4_, F4_},
    {{1, 4, 2, 3, 150, 192, 128, F32, F32, 0, 0, ATT_FP8_TENSOR, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, F4_, F4_},
    {{1, 8, 4, 3, 500, 128, 128, BF16, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, DEC4_, F4_},
    {{1, 8, 4, 8, 2000, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, W4_, F4_},
    {{2, 32, 8, 8, 700, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 1, 1, 1}, F5_, F5_},
    {{1, 8, 8, 16, 600, 128, 128, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 1}, F4_, F4_},
    {{1, 8, 4, 16, 40, 128, 128, BF16, F32, 0, 0, ATT_FP8_NONE, E5, MASK_CAUSAL, 0, 0, 0, 0, 0}, W5_, F5_},
    {{3, 8, 4, 1, 1000, 128, 128, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_WINDOW, 100, 0, 0, 1, 0}, F4_, F4_},
    {{1, 8, 4, 8, 700, 128, 128, F32, F32, 0, 0, ATT_FP8_TENSOR, E5, MASK_WINDOW, 5, 0, 0, 0, 0}, F5_, F5_},
    {{1, 8, 2, 4, 60, 64, 64, BF16, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_SEG, 0, 20.0f, 0, 0, 0}, W4_, F4_},
    {{1, 8, 4, 1, 500, 256, 256, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 30.0f, 1, 0, 0}, F4_, F4_},
    {{2, 8, 4, 3, 500, 128, 128, F32, F32, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 5.0f, 1, 1, 0}, F5_, F5_},
    {{2, 4, 2, 5, 200, 64, 64, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_BOOL, 0, 0, 0, 1, 0}, "general", "general"},
    {{1, 4, 2, 40, 300, 64, 64, F32, F32, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 0, 0}, F5_, F5_},
    {{1, 8, 4, 24, 900, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, W4_, F4_},
};

/* The tensor-core kernels' fp8 instances: the decode instance (up to 8
 * query vectors per KV head) and the wide kernel (9 and more), head dims
 * 64 / 128 / 256, e4m3 and e5m2, per-row / shared / no scales, windows,
 * softcap, sinks, ragged lengths, splits (long N, full runs only). */
static const struct {
  att_case c;
  const char *want;
} fp8_tc_cases[] = {
    {{1, 8, 4, 1, 1000, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, DEC4_},
    {{1, 24, 4, 8, 1000, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, W4_},
    {{4, 32, 8, 1, 900, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 1, 0}, DEC5_},
    {{2, 8, 4, 1, 700, 64, 64, BF16, F32, 0, 0, ATT_FP8_TENSOR, E4, MASK_WINDOW, 100, 0, 1, 1, 0}, DEC4_},
    {{1, 8, 2, 3, 600, 64, 64, BF16, BF16, 0, 0, ATT_FP8_NONE, E5, MASK_CAUSAL, 0, 0, 0, 0, 0}, W5_},
    {{2, 16, 4, 4, 800, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_WINDOW, 150, 20.0f, 1, 1, 0}, W4_},
    {{1, 8, 4, 2, 999, 256, 256, BF16, F32, 0, 0, ATT_FP8_TENSOR, E5, MASK_CAUSAL, 0, 30.0f, 0, 0, 0}, DEC5_},
    {{1, 8, 8, 1, 500, 128, 128, BF16, BF16, 0, 0, ATT_FP8_NONE, E4, MASK_NONE, 0, 0, 0, 0, 0}, DEC4_},
    {{1, 32, 8, 1, 1, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 1, 0, 0}, DEC5_},
    {{3, 16, 4, 1, 777, 64, 64, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 1, 0}, DEC5_},
    {{2, 8, 2, 6, 640, 256, 256, BF16, BF16, 0, 0, ATT_FP8_NONE, E4, MASK_WINDOW, 33, 0, 0, 1, 0}, W4_},
    {{1, 8, 4, 1, 3001, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 0, 0}, DEC5_},
    {{2, 24, 4, 8, 2500, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 1, 1, 0}, W5_},
    {{1, 16, 2, 5, 4100, 64, 64, BF16, F32, 0, 0, ATT_FP8_TENSOR, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, W4_},
};

/* variant 1: KVA_ATTN_EXACT */
static void fp8_plant_unseen(att_data *d, int variant) {
  att_plant_unseen(d);
  if (variant) d->params.flags |= KVA_ATTN_EXACT;
}

/* A CUDA context with the fp8 warpgroup path at min_q (read at creation). */
static int make_cuda_ctx_wg8(kva_context **ctx, const char *min_q) {
  setenv("KVA_CUDA_WG_FP8_MIN_Q", min_q, 1);
  const int made = make_cuda_ctx(ctx, NULL);
  unsetenv("KVA_CUDA_WG_FP8_MIN_Q");
  return made;
}

TEST(cuda_fp8_vs_oracle) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  kva_context *ctx;
  if (!make_cuda_ctx_wg8(&ctx, "-1")) return;
  for (size_t ci = 0; ci < sizeof fp8_cases / sizeof fp8_cases[0]; ++ci) {
    const att_case *c = &fp8_cases[ci].c;
    if (test_quick && c->N > 1000) continue;
    char name[256];
    att_case_str(c, name, sizeof name);
    printf("  case %2zu %s\n", ci, name);
    fflush(stdout);
    if (!run_case_want(ctx, c, fp8_plant_unseen, 0, fp8_cases[ci].want) ||
        !run_case_want(ctx, c, fp8_plant_unseen, 1, fp8_cases[ci].exact))
      goto done;
  }
  for (size_t ci = 0; ci < sizeof fp8_tc_cases / sizeof fp8_tc_cases[0]; ++ci) {
    const att_case *c = &fp8_tc_cases[ci].c;
    if (test_quick && c->N > 1000) continue;
    char name[256];
    att_case_str(c, name, sizeof name);
    printf("  tc case %2zu %s\n", ci, name);
    fflush(stdout);
    if (!run_case_want(ctx, c, fp8_plant_unseen, 0, fp8_tc_cases[ci].want)) goto done;
  }
done:
  kva_context_destroy(ctx);
}

/* Caller pools [blocks, KVH, bs, D] of the case's rows and their scales
 * (rows padded by 16 bytes, unused rows 0xff: NaN codes and NaN scales; any
 * block size, below the pools' KVA_BLOCK_SIZE_MIN too), a shuffled block
 * table with first offsets (att_table_make_aligned), mirrored to the device; the
 * oracle over the host's contiguous cache (the same tokens). */
static int run_caller_table_case(kva_context *ctx, const att_case *c, int64_t bs, const char *want, int probe,
                              unsigned flags) {
  char cs[256], name[300];
  att_case_str(c, cs, sizeof cs);
  snprintf(name, sizeof name, "%s q=%s block %lld%s", cs, att_query_names[probe], (long long)bs,
           flags & KVA_ATTN_EXACT ? " exact" : "");
  att_data hd;
  att_table tb;
  dev_data dd;
  memset(&dd, 0, sizeof dd);
  memset(&tb, 0, sizeof tb);
  int ok = 0;
  if (att_make_q(&hd, c, probe) || att_table_make_aligned(&tb, &hd, bs, 0xff)) {
    FAIL_("%s: could not build operands", name);
    goto done;
  }
  hd.params.flags |= flags;
  kva_tensor ref = att_alloc_like(&hd, &hd.out);
  kva_kv dk, dv;
  void *dblocks, *dlens, *dfo;
  if (!dev_make(&dd, &hd) || !mirror_kv(&dd, &tb.k, &dk) || !mirror_kv(&dd, &tb.v, &dv) ||
      !mirror_array(&dd, tb.blocks, sizeof(int32_t) * (size_t)(c->B * tb.t.max_blocks), &dblocks) ||
      !mirror_array(&dd, tb.lens, sizeof(int32_t) * (size_t)c->B, &dlens) ||
      !mirror_array(&dd, tb.fo, sizeof(int32_t) * (size_t)c->B, &dfo)) {
    FAIL_("%s: could not mirror the pools to the device", name);
    goto done;
  }
  const kva_block_table dbt = {c->B, tb.t.max_blocks, 0, (const int32_t *)dblocks, (const int32_t *)dlens,
                               (const int32_t *)dfo};
  dd.view = kva_view_block_table(&dk, &dv, &dbt);
  if (att_kernel_reference(ctx, &dd.q, &dd.view, &dd.params, &dd.out, &hd.q, &hd.view, &hd.params, &ref)) {
    FAIL_("%s: oracle: %s", name, kva_last_error());
    goto done;
  }
  if (!dev_poison(&dd, 0) || !runs_kernel(ctx, &dd, name, want)) goto done;
  const double atol = att_kernel_atol(ctx, &dd.q, &dd.view, &dd.params, &dd.out);
  if (kva_attention(ctx, &dd.q, &dd.view, &dd.params, &dd.out, NULL, 0)) {
    FAIL_("%s: kva_attention(CUDA, BLOCK_TABLE): %s", name, kva_last_error());
    goto done;
  }
  if (!dev_fetch(&dd, &hd, name)) goto done;
  if (!att_out_padding_is(&hd, DEV_POISON_BYTE)) {
    FAIL_("%s: CUDA wrote between the rows of out", name);
    goto done;
  }
  double max_err = 0;
  if (!att_compare(&hd.out, &ref, atol, att_rtol(c->odt), &max_err, NULL)) {
    FAIL_("%s: CUDA over the caller block table differs from the oracle (max err %.3g, allowed %.3g of max|ref|)", name,
          max_err, atol);
    goto done;
  }
  ok = 1;
done:
  att_table_free(&tb);
  dev_free(&dd);
  att_free(&hd);
  return ok;
}

TEST(cuda_fp8_block_table) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  /* want: the default kernel (tensor-core: decode instance up to 8 query
   * vectors per KV head, else wide; the warpgroup kernel off); exact: with KVA_ATTN_EXACT (NULL: not run) */
  static const struct {
    att_case c;
    int64_t bs;
    const char *want, *exact;
  } tc[] = {
      {{1, 8, 4, 1, 3001, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, 16, DEC4_, F4_},
      {{3, 24, 4, 8, 1500, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 1, 1, 0}, 64, W5_, F5_},
      {{2, 8, 2, 3, 700, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TENSOR, E4, MASK_WINDOW, 50, 0, 0, 1, 0}, 8, W4_, F4_},
      {{2, 32, 8, 1, 900, 128, 128, BF16, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 10.0f, 1, 1, 0}, 24, DEC4_, F4_},
      {{2, 8, 4, 16, 500, 128, 128, F32, F32, 0, 0, ATT_FP8_NONE, E5, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, F5_, F5_},
      {{1, 4, 2, 20, 300, 64, 64, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, 16, F4_, F4_},
      /* tensor-core: block sizes 16, 64 and 1, head dims 64 / 256, no scales, GQA x L */
      {{4, 32, 8, 1, 900, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, DEC5_, F5_},
      {{2, 8, 4, 1, 800, 256, 256, BF16, BF16, 0, 0, ATT_FP8_NONE, E4, MASK_WINDOW, 200, 0, 1, 1, 0}, 64, DEC4_, F4_},
      {{2, 8, 4, 2, 600, 64, 64, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 25.0f, 0, 1, 0}, 1, DEC4_, F4_},
      {{2, 24, 4, 8, 700, 64, 64, BF16, BF16, 0, 0, ATT_FP8_TENSOR, E5, MASK_CAUSAL, 0, 0, 1, 1, 0}, 16, W5_, NULL},
      {{1, 24, 4, 4, 999, 256, 256, BF16, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0}, 64, W4_, NULL},
  };
  kva_context *ctx;
  if (!make_cuda_ctx_wg8(&ctx, "-1")) return; /* the decode / wide instances (cuda_fp8_wg_path: the warpgroup one) */
  for (size_t ci = 0; ci < sizeof tc / sizeof tc[0]; ++ci) {
    if (test_quick && tc[ci].c.N > 1000) continue;
    for (int pr = 0; pr < ATT_PROBES; ++pr)
      if (!run_caller_table_case(ctx, &tc[ci].c, tc[ci].bs, tc[ci].want, pr, 0) ||
          (tc[ci].exact && !run_caller_table_case(ctx, &tc[ci].c, tc[ci].bs, tc[ci].exact, pr, KVA_ATTN_EXACT)))
        goto done;
  }
done:
  kva_context_destroy(ctx);
}

/* KVA_MASK_TREE on the warpgroup q4 kernel (sm_90: the row's bits in a
 * register pair), every case forced there (KVA_CUDA_WG_MIN_Q = 1), then the
 * same cases with it off (the narrow / wide kernels): trees and random bits,
 * windows, softcap, sinks, ragged, strided (a broadcast tree), block tables. */
TEST(cuda_tree_wg) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  static const att_case wc[] = {
      {3, 32, 8, 16, 1100, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_TREE, 0, 0, 0, 1, 0},
      {2, 8, 4, 64, 1500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_TREE, 100, 0, 0, 1, 0},
      {2, 16, 4, 33, 700, 64, 64, BF16, F32, 4, 4, 64, BF16, MASK_TREE, 0, 20.0f, 1, 1, 0},
      {1, 8, 4, 7, 500, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_TREE, 0, 0, 1, 0, 0},
      {3, 16, 4, 17, 600, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_TREE, 3, 0, 0, 1, 1},
      {1, 32, 8, 64, 64, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_TREE, 0, 0, 0, 0, 0},
      /* a window that starts inside a split ending before the new keys: that split's last stage is partial */
      {2, 16, 4, 33, 3000, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_TREE, 1501, 0, 0, 1, 0},
      {1, 8, 4, 17, 4000, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_TREE, 999, 0, 0, 0, 0},
  };
  const char *mins[2] = {"1", "-1"}, *wants[2] = {"warpgroup", "tensor-core kernel"};
  for (int pass = 0; pass < 2 && !test_failed_flag; ++pass) {
    setenv("KVA_CUDA_WG_MIN_Q", mins[pass], 1);
    kva_context *ctx;
    const int made = make_cuda_ctx(&ctx, NULL);
    unsetenv("KVA_CUDA_WG_MIN_Q");
    if (!made) return;
    for (size_t ci = 0; ci < sizeof wc / sizeof wc[0]; ++ci) {
      int ok = 1;
      for (int variant = 0; variant < 2 && ok; ++variant) ok = run_case_want(ctx, &wc[ci], tree_bits, variant, wants[pass]);
      if (ok && wc[ci].N > 64) ok = run_table_case(ctx, &wc[ci], ci % 2 ? 16 : 24, 71 + ci, wants[pass]);
      if (!ok) {
        FAIL_("tree %s case %zu", wants[pass], ci);
        break;
      }
    }
    kva_context_destroy(ctx);
  }
}

/* On CUDA the bits are device memory: bits at j >= L (the last word's high
 * bits) are ignored, so a tree with them set gives the same output bit for
 * bit as without (the host checks only shapes: the call succeeds). */
static void tree_high_bits_body(void);
TEST(cuda_tree_high_bits_ignored) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  tree_high_bits_body();
}
static void tree_high_bits_body(void) {
  static const att_case cs[] = {
      {2, 32, 8, 17, 900, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_TREE, 0, 0, 0, 1, 0},
      {2, 8, 4, 7, 500, 64, 64, F32, F32, 0, 0, 0, F32, MASK_TREE, 0, 0, 0, 1, 0},
  };
  kva_context *ctx;
  if (!make_cuda_ctx(&ctx, NULL)) return;
  for (size_t ci = 0; ci < sizeof cs / sizeof cs[0] && !test_failed_flag; ++ci) {
    att_data hd;
    dev_data dd;
    memset(&dd, 0, sizeof dd);
    if (att_make(&hd, &cs[ci]) || !dev_make(&dd, &hd)) {
      FAIL_("case %zu: operands", ci);
      att_free(&hd);
      dev_free(&dd);
      break;
    }
    unsigned char *clean = (unsigned char *)malloc(hd.out_bytes);
    int ok = clean && dev_poison(&dd, 0) && kva_attention(ctx, &dd.q, &dd.view, &dd.params, &dd.out, NULL, 0) == 0 &&
             dev_fetch(&dd, &hd, "clean bits");
    if (ok) memcpy(clean, hd.out_buf, hd.out_bytes);
    /* the same bits with every bit j >= L of the last word set, on the device */
    const kva_tensor *m = &hd.params.mask.array;
    const int64_t W = m->shape[2];
    for (int64_t b = 0; ok && b < m->shape[0]; ++b)
      for (int64_t i = 0; i < m->shape[1]; ++i)
        *(uint32_t *)((char *)m->data + b * m->stride[0] + i * m->stride[1] + (W - 1) * 4) |= ~0u << (cs[ci].L % 32);
    ok = ok && cuda_ok(cudaMemcpy(dd.params.mask.array.data, m->data, extent(m), cudaMemcpyHostToDevice), "bits") &&
         dev_poison(&dd, 0);
    if (ok && kva_attention(ctx, &dd.q, &dd.view, &dd.params, &dd.out, NULL, 0)) {
      FAIL_("case %zu: high bits on CUDA: %s", ci, kva_last_error());
      ok = 0;
    }
    ok = ok && dev_fetch(&dd, &hd, "high bits");
    if (ok && memcmp(clean, hd.out_buf, hd.out_bytes)) {
      FAIL_("case %zu: bits >= L changed the output", ci);
      ok = 0;
    }
    free(clean);
    if (!ok && !test_failed_flag) FAIL_("case %zu: a call failed", ci);
    dev_free(&dd);
    att_free(&hd);
  }
  kva_context_destroy(ctx);
}

/* kva_cache_write into fp8 pools on the device equals the CPU's write bit
 * for bit (codes and per-row scales; the CPU's is checked against the
 * written rule in test_fp8.c): e4m3 K / e5m2 V and the reverse, per-row,
 * fixed and no scales, f32 / bf16 / f16 rows holding zeros, NaN, inf, values
 * past max and f32 subnormals, skipped (-1) and repeated slots. */
TEST(cuda_fp8_cache_write_bits) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  kva_context *cpu, *gpu;
  ASSERT_OK(kva_context_create(&cpu, NULL));
  if (!make_cuda_ctx(&gpu, NULL)) return;
  const int64_t nblk = 9, KVH = 4, bs = 16, n = 61, D[2] = {256, 128};
  const kva_dtype srcs[3] = {F32, BF16, F16};
  for (int si = 0; si < 3 && !test_failed_flag; ++si)
    for (int sk = 0; sk < 3 && !test_failed_flag; ++sk)
      for (int swap = 0; swap < 2 && !test_failed_flag; ++swap) {
        const kva_dtype f8[2] = {swap ? E5 : E4, swap ? E4 : E5};
        dev_data dd;
        memset(&dd, 0, sizeof dd);
        void *hmem[2][2] = {{NULL, NULL}, {NULL, NULL}}, *rows[2] = {NULL, NULL};
        kva_kv hp[2], dp[2];
        kva_tensor hr[2], dr[2];
        size_t bytes[2][2];
        for (int w = 0; w < 2; ++w) { /* pools: data [nblk, KVH, bs, D] padded rows, scales per sk */
          bytes[w][0] = (size_t)(nblk * KVH * bs * (D[w] + 16));
          bytes[w][1] = sk == ATT_FP8_TOKEN ? (size_t)(nblk * KVH * bs) * 4 : 4;
          hmem[w][0] = malloc(bytes[w][0]);
          hmem[w][1] = malloc(bytes[w][1]);
          memset(hmem[w][0], 0x5a, bytes[w][0]);
          memset(hmem[w][1], 0x5a, bytes[w][1]);
          ((float *)hmem[w][1])[0] = w ? 2.5e-3f : 0.6f;
          hp[w] = kva_kv_fp8(hmem[w][0], f8[w], sk == ATT_FP8_NONE ? NULL : (float *)hmem[w][1], sk == ATT_FP8_TOKEN,
                             nblk, KVH, bs, D[w]);
          hp[w].data.stride[2] = D[w] + 16;
          hp[w].data.stride[1] = bs * (D[w] + 16);
          hp[w].data.stride[0] = KVH * bs * (D[w] + 16);
          const size_t es = kva_dtype_size(srcs[si]);
          rows[w] = malloc((size_t)(n * KVH * D[w]) * es);
          for (int64_t i = 0; i < n * KVH; ++i)
            for (int64_t e = 0; e < D[w]; ++e) {
              float x = ldexpf(test_randn(), (int)(i % 17) - 8);
              if (i == 0) x = 0.0f;
              if (i == 1 && e < 5) x = (const float[5]){NAN, -NAN, INFINITY, -INFINITY, 1e30f}[e];
              if (i == 2 && srcs[si] == F32) x = 1e-40f * test_randn();
              test_store((char *)rows[w] + (size_t)(i * D[w] + e) * es, srcs[si], x);
            }
          hr[w] = kva_tensor_4d(rows[w], srcs[si], 1, n, KVH, D[w]);
          hr[w].ndim = 3;
          for (int d = 0; d < 3; ++d) {
            hr[w].shape[d] = hr[w].shape[d + 1];
            hr[w].stride[d] = hr[w].stride[d + 1];
          }
        }
        int32_t slots[61], perm[144];
        att_random_perm(perm, nblk * bs);
        for (int64_t i = 0; i < n; ++i) slots[i] = i % 11 == 5 ? -1 : i % 13 == 7 ? perm[i - 1] : perm[i];
        void *dslots;
        int ok = mirror_kv(&dd, &hp[0], &dp[0]) && mirror_kv(&dd, &hp[1], &dp[1]) &&
                 mirror_tensor(&dd, &hr[0], &dr[0]) && mirror_tensor(&dd, &hr[1], &dr[1]) &&
                 mirror_array(&dd, slots, sizeof slots, &dslots);
        if (!ok) FAIL_("could not mirror the pools");
        else if (kva_cache_write(gpu, &dp[0], &dp[1], &dr[0], &dr[1], (const int32_t *)dslots, n))
          FAIL_("kva_cache_write(CUDA): %s", kva_last_error());
        else if (kva_cache_write(cpu, &hp[0], &hp[1], &hr[0], &hr[1], slots, n))
          FAIL_("kva_cache_write(CPU): %s", kva_last_error());
        else if (cuda_ok(cudaDeviceSynchronize(), "cache write"))
          for (int w = 0; w < 2 && ok; ++w)
            for (int a = 0; a < 2 && ok; ++a) {
              const kva_tensor *dt = a ? &dp[w].scales : &dp[w].data;
              if (a && sk == ATT_FP8_NONE) continue;
              const size_t nb = extent(dt); /* the mirrored bytes (the last row's padding is not) */
              unsigned char *got = (unsigned char *)malloc(nb);
              ok = got && cuda_ok(cudaMemcpy(got, dt->data, nb, cudaMemcpyDeviceToHost), "fetch pool");
              if (ok && memcmp(got, hmem[w][a], nb)) {
                size_t i = 0;
                while (((const unsigned char *)hmem[w][a])[i] == got[i]) ++i;
                FAIL_("src %s, scales %d, %s pool (%s) %s: CUDA differs from the CPU at byte %zu (0x%02x, CPU 0x%02x)",
                      kva_dtype_name(srcs[si]), sk, w ? "V" : "K", kva_dtype_name(f8[w]), a ? "scales" : "codes", i,
                      got[i], ((const unsigned char *)hmem[w][a])[i]);
                ok = 0;
              }
              free(got);
            }
        dev_free(&dd);
        for (int w = 0; w < 2; ++w) {
          free(hmem[w][0]);
          free(hmem[w][1]);
          free(rows[w]);
        }
      }
  kva_context_destroy(gpu);
  kva_context_destroy(cpu);
}
/* A case over caller block tables of bs tokens per block. */
typedef struct {
  att_case c;
  int64_t bs;
} wg_run_case;
/* The 16-bit warpgroup kernel's caller-table cases, rows and queries of type
 * t, every probe: blocks of at least one copy run (D / 32 tokens, 8 at head
 * dim 512: a run crosses a block at every first offset but 0) on `want`,
 * smaller blocks on `other` (the selector's alternative). */
static void wg_run_cases(kva_context *ctx, const wg_run_case *rc, size_t n, kva_dtype t, const char *want,
                         const char *other) {
  for (size_t ci = 0; ci < n && !test_failed_flag; ++ci) {
    att_case c = rc[ci].c;
    c.qdt = c.kvdt = t;
    const char *w = rc[ci].bs < (c.Dk == 512 ? 8 : c.Dk / 32) ? other : want;
    for (int pr = 0; pr < ATT_PROBES && !test_failed_flag; ++pr)
      if (!run_caller_table_case(ctx, &c, rc[ci].bs, w, pr, 0)) FAIL_("%s run case %zu", w, ci);
  }
}
/* The warpgroup kernel over 16-bit rows (attn_wg.cu: bf16 / f16 K/V copied
 * into the wgmma tiles, P rounded to the rows' type; by default from 16 query
 * vectors per KV head, KVA_CUDA_WG_BF16_MIN_Q; here from 1), t = BF16 or
 * F16 for the queries and rows: 8/4/256 L = 8 (16 vectors), 24/4/256 L = 8
 * (48) with sinks, 32/8/128 (32) strided, 8/2/64 L = 16 (64); B = 3 ragged
 * at D = 128 with window, softcap, sinks; fewer keys than one stage; no
 * mask (80 vectors: two blocks per KV head, softcap, sinks, f32 out,
 * strided); splits (N 3001 - 4100) at 256 and 64; block tables of 16, 24
 * and 64 tokens, caller tables of one copy run (8, 4, 2 tokens at head dims
 * 256, 128, 64) and of half a run (the tensor-core kernel); lse (natural
 * and base 2, splits); tree masks. A second pass with the kernel off
 * (KVA_CUDA_WG_BF16_MIN_Q=-1) runs the same cases on the narrow / wide
 * tensor-core kernels. */
static int wg_case_runs(kva_context *ctx, const att_case *c, const char *want) {
  char name[256];
  att_case_str(c, name, sizeof name);
  att_data hd;
  dev_data dd;
  memset(&dd, 0, sizeof dd);
  int ok = 0;
  if (att_make(&hd, c) || !dev_make(&dd, &hd))
    FAIL_("%s: could not build operands", name);
  else
    ok = runs_kernel(ctx, &dd, name, want);
  dev_free(&dd);
  att_free(&hd);
  return ok;
}
static void wg_float_body(kva_dtype t) {
  static const att_case wc[] = {
      {1, 8, 4, 8, 700, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 24, 4, 8, 600, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
      {1, 32, 8, 8, 500, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
      {1, 8, 2, 16, 400, 64, 64, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {3, 16, 4, 8, 1001, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_WINDOW, 100, 30.0f, 1, 1, 0},
      {2, 24, 4, 8, 501, 64, 64, BF16, BF16, 0, 0, 0, BF16, MASK_WINDOW, 100, 20.0f, 1, 1, 0},
      {1, 16, 4, 4, 37, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 24, 4, 4, 400, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_NONE, 0, 0, 0, 1, 0},
      {1, 40, 2, 4, 300, 128, 128, BF16, F32, 0, 0, 0, BF16, MASK_NONE, 0, 30.0f, 1, 0, 1},
      {1, 24, 4, 8, 4100, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
      {2, 16, 4, 8, 3001, 64, 64, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
  };
  static const struct {
    att_case c;
    int64_t bs;
  } tc[] = {
      {{3, 24, 4, 8, 1500, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 64},
      {{2, 16, 2, 8, 700, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_WINDOW, 50, 0, 0, 1, 0}, 16},
      {{2, 16, 4, 8, 900, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 10.0f, 1, 1, 0}, 24},
      {{2, 8, 2, 16, 3000, 64, 64, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16},
  };
  /* caller tables: blocks of one copy run at head dims 256, 128, 64 and of
   * half a run at 256 (the tensor-core kernel) */
  static const wg_run_case rc[] = {
      {{2, 8, 4, 8, 300, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 8},
      {{2, 16, 4, 8, 250, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_WINDOW, 40, 0, 1, 1, 0}, 4},
      {{2, 8, 2, 16, 200, 64, 64, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 2},
      {{1, 8, 4, 8, 130, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 4},
  };
  static const att_case lc[] = {
      {1, 24, 4, 8, 1000, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 24, 4, 8, 3000, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
      {2, 8, 2, 8, 700, 64, 64, BF16, BF16, 0, 0, 0, BF16, MASK_NONE, 0, 0, 1, 1, 0},
  };
  static const att_case trc[] = {
      {3, 16, 4, 17, 600, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_TREE, 0, 0, 0, 1, 0},
      {2, 8, 4, 64, 1500, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_TREE, 100, 0, 0, 1, 0},
      {2, 16, 4, 33, 700, 64, 64, BF16, BF16, 0, 0, 0, BF16, MASK_TREE, 0, 20.0f, 1, 1, 0},
  };
  const char *mins[2] = {"1", "-1"}, *wants[2] = {"warpgroup", "tensor-core kernel"};
  for (int pass = 0; pass < 2 && !test_failed_flag; ++pass) {
    setenv("KVA_CUDA_WG_BF16_MIN_Q", mins[pass], 1); /* read at context creation */
    kva_context *ctx;
    const int made = make_cuda_ctx(&ctx, NULL);
    unsetenv("KVA_CUDA_WG_BF16_MIN_Q");
    if (!made) return;
    att_case c;
    for (size_t ci = 0; ci < sizeof wc / sizeof wc[0] && !test_failed_flag; ++ci) {
      c = wc[ci];
      c.qdt = c.kvdt = t;
      if (!run_case_want(ctx, &c, NULL, 0, wants[pass])) FAIL_("%s case %zu", wants[pass], ci);
    }
    for (size_t ci = 0; ci < sizeof tc / sizeof tc[0] && !test_failed_flag; ++ci) {
      c = tc[ci].c;
      c.qdt = c.kvdt = t;
      if (!run_table_case(ctx, &c, tc[ci].bs, 31 + ci, wants[pass])) FAIL_("%s table case %zu", wants[pass], ci);
    }
    wg_run_cases(ctx, rc, sizeof rc / sizeof rc[0], t, wants[pass], wants[1]);
    for (size_t ci = 0; ci < sizeof lc / sizeof lc[0] && !test_failed_flag; ++ci) {
      c = lc[ci];
      c.qdt = c.kvdt = t;
      if (!wg_case_runs(ctx, &c, wants[pass]) || !run_lse_case(ctx, &c, ci & 1 ? KVA_LSE_BASE2 : 0))
        FAIL_("%s lse case %zu", wants[pass], ci);
    }
    for (size_t ci = 0; ci < sizeof trc / sizeof trc[0] && !test_failed_flag; ++ci) {
      c = trc[ci];
      c.qdt = c.kvdt = t;
      int ok = 1;
      for (int variant = 0; variant < 2 && ok; ++variant) ok = run_case_want(ctx, &c, tree_bits, variant, wants[pass]);
      if (ok) ok = run_table_case(ctx, &c, ci % 2 ? 16 : 24, 71 + ci, wants[pass]);
      if (!ok) FAIL_("tree %s case %zu", wants[pass], ci);
    }
    kva_context_destroy(ctx);
  }
}
TEST(cuda_bf16_wg_path) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  wg_float_body(BF16);
}
TEST(cuda_f16_wg_path) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  wg_float_body(F16);
}
/* The warpgroup kernel at head dim 512 over 16-bit rows (attn_wg.cu
 * kvc_wg512_kernel: S duplicated in both warpgroups, each accumulating half
 * the value dims; 32-token stages; by default from 16 query vectors per KV
 * head, here from 1), t = BF16 or F16 for the queries and rows: L = 8 at GQA
 * 2 and 4 (16 and 32 vectors) with N 1000 and 3000 (no multiple of 32),
 * causal and window, softcap, sinks; B = 3 ragged; 128 vectors (two blocks
 * per KV head) strided; fewer keys than one stage; no mask; splits (N 4100);
 * block tables of 16 and 24 tokens, caller tables of 8 (one copy run) and 4
 * (the fused kernel); lse (natural and base 2); tree masks
 * (L 17 and 64). Random and probe queries (run_case_want), against the
 * oracle with the kernel's roundings ([P bf16] / [P f16]: its name). A
 * second pass with the kernel off (KVA_CUDA_WG_BF16_MIN_Q=-1) runs the same
 * cases on the fused kernel. */
static void wg512_body(kva_dtype t) {
  static const att_case wc[] = {
      {1, 16, 8, 8, 1000, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 16, 4, 8, 3000, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_WINDOW, 100, 0, 1, 0, 0},
      {1, 16, 8, 8, 3000, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 30.0f, 0, 0, 0},
      {3, 8, 2, 8, 1001, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_WINDOW, 300, 30.0f, 1, 1, 0},
      {1, 8, 1, 16, 777, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
      {1, 16, 4, 4, 37, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 8, 2, 8, 400, 512, 512, BF16, F32, 0, 0, 0, BF16, MASK_NONE, 0, 20.0f, 1, 1, 0},
      {1, 8, 4, 8, 4100, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
  };
  static const struct {
    att_case c;
    int64_t bs;
  } tc[] = {
      {{3, 16, 4, 8, 1500, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 16},
      {{2, 16, 8, 8, 1000, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_WINDOW, 50, 10.0f, 0, 1, 0}, 24},
  };
  /* caller tables: blocks of one copy run (8 rows) and of half a run (the fused kernel) */
  static const wg_run_case rc[] = {
      {{2, 16, 8, 8, 300, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 8},
      {{1, 8, 2, 8, 100, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 4},
  };
  static const att_case lc[] = {
      {1, 16, 8, 8, 1000, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 8, 2, 8, 700, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_NONE, 0, 0, 1, 1, 0},
  };
  static const att_case trc[] = {
      {3, 8, 4, 17, 600, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_TREE, 0, 0, 0, 1, 0},
      {2, 4, 2, 64, 1500, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_TREE, 100, 20.0f, 1, 1, 0},
  };
  const char *mins[2] = {"1", "-1"}, *wants[2] = {"warpgroup (wgmma), head dim 512", "fused kernel"};
  for (int pass = 0; pass < 2 && !test_failed_flag; ++pass) {
    setenv("KVA_CUDA_WG_BF16_MIN_Q", mins[pass], 1); /* read at context creation */
    kva_context *ctx;
    const int made = make_cuda_ctx(&ctx, NULL);
    unsetenv("KVA_CUDA_WG_BF16_MIN_Q");
    if (!made) return;
    att_case c;
    for (size_t ci = 0; ci < sizeof wc / sizeof wc[0] && !test_failed_flag; ++ci) {
      c = wc[ci];
      c.qdt = c.kvdt = t;
      if (!run_case_want(ctx, &c, NULL, 0, wants[pass])) FAIL_("%s case %zu", wants[pass], ci);
    }
    for (size_t ci = 0; ci < sizeof tc / sizeof tc[0] && !test_failed_flag; ++ci) {
      c = tc[ci].c;
      c.qdt = c.kvdt = t;
      if (!run_table_case(ctx, &c, tc[ci].bs, 131 + ci, wants[pass])) FAIL_("%s table case %zu", wants[pass], ci);
    }
    wg_run_cases(ctx, rc, sizeof rc / sizeof rc[0], t, wants[pass], wants[1]);
    for (size_t ci = 0; ci < sizeof lc / sizeof lc[0] && !test_failed_flag; ++ci) {
      c = lc[ci];
      c.qdt = c.kvdt = t;
      if (!wg_case_runs(ctx, &c, wants[pass]) || !run_lse_case(ctx, &c, ci & 1 ? KVA_LSE_BASE2 : 0))
        FAIL_("%s lse case %zu", wants[pass], ci);
    }
    for (size_t ci = 0; ci < sizeof trc / sizeof trc[0] && !test_failed_flag; ++ci) {
      c = trc[ci];
      c.qdt = c.kvdt = t;
      int ok = 1;
      for (int variant = 0; variant < 2 && ok; ++variant) ok = run_case_want(ctx, &c, tree_bits, variant, wants[pass]);
      if (ok) ok = run_table_case(ctx, &c, ci % 2 ? 16 : 24, 171 + ci, wants[pass]);
      if (!ok) FAIL_("tree %s case %zu", wants[pass], ci);
    }
    kva_context_destroy(ctx);
  }
}
TEST(cuda_bf16_wg512) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  wg512_body(BF16);
}
TEST(cuda_f16_wg512) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  wg512_body(F16);
}

/* The warpgroup kernel over fp8 rows (attn_wg.cu: e4m3 / e5m2 codes times
 * the row's f32 scale, rounded to bf16 into the wgmma tiles, "[K,V,P
 * bf16]"; by default from 16 query vectors per KV head on sm_90,
 * KVA_CUDA_WG_FP8_MIN_Q; here from 1), e4m3 and e5m2, per-token, shared and
 * no scales: 8/4/256 L = 8 (16 vectors), 24/4/256 L = 8 (48) with sinks;
 * GQA 2 at 128 with B = 3 ragged, window, softcap, sinks; GQA 6 at 64 (48
 * vectors) ragged with window, softcap, sinks; GQA 4 at 128; 64 vectors at
 * 64 (f32 out); no mask (ragged; 80 vectors: two blocks per KV head,
 * softcap, sinks, f32 out); fewer keys than one stage; windows of 1 and 2
 * keys; splits (N 3000 - 4100) at 256, 128 and 64; NaN codes in the rows no
 * query sees (att_plant_unseen), random and probe queries; tree masks; block
 * tables of 64, 16, 24 and 1 tokens (unused pool rows NaN). A second pass
 * with the kernel off (-1) runs the same cases on the decode / wide
 * tensor-core instances. */
TEST(cuda_fp8_wg_path) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  static const att_case wc[] = {
      {1, 8, 4, 8, 700, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 8, 4, 8, 700, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 24, 4, 8, 600, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 1, 0, 0},
      {1, 24, 4, 8, 600, 256, 256, BF16, F32, 0, 0, ATT_FP8_TENSOR, E4, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {3, 16, 8, 8, 1001, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_WINDOW, 100, 30.0f, 1, 1, 0},
      {3, 16, 8, 8, 1001, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TENSOR, E5, MASK_WINDOW, 100, 30.0f, 1, 1, 0},
      {2, 12, 2, 8, 501, 64, 64, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_WINDOW, 70, 20.0f, 1, 1, 0},
      {2, 12, 2, 8, 501, 64, 64, BF16, BF16, 0, 0, ATT_FP8_NONE, E4, MASK_CAUSAL, 0, 0, 0, 1, 0},
      {1, 32, 8, 8, 500, 128, 128, BF16, F32, 0, 0, ATT_FP8_NONE, E5, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 8, 2, 16, 400, 64, 64, BF16, F32, 0, 0, ATT_FP8_TENSOR, E4, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 24, 4, 4, 400, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_NONE, 0, 0, 0, 1, 0},
      {1, 40, 2, 4, 300, 128, 128, BF16, F32, 0, 0, ATT_FP8_TOKEN, E5, MASK_NONE, 0, 30.0f, 1, 0, 0},
      {1, 16, 4, 4, 37, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 16, 4, 4, 700, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_WINDOW, 1, 25.0f, 1, 1, 0},
      {1, 24, 4, 8, 900, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TENSOR, E5, MASK_WINDOW, 2, 0, 0, 0, 0},
      {1, 24, 4, 8, 4100, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 1, 1, 0},
      {1, 16, 8, 8, 3000, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 16, 4, 8, 3001, 64, 64, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 1, 0},
  };
  static const att_case trc[] = {
      {3, 16, 4, 17, 600, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_TREE, 0, 0, 0, 1, 0},
      {2, 8, 4, 64, 1500, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_TREE, 100, 0, 0, 1, 0},
      {2, 16, 4, 33, 700, 64, 64, BF16, BF16, 0, 0, ATT_FP8_TENSOR, E4, MASK_TREE, 0, 20.0f, 1, 1, 0},
  };
  static const struct {
    att_case c;
    int64_t bs;
  } tc[] = {
      {{3, 24, 4, 8, 1500, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 1, 1, 0}, 64},
      {{2, 16, 8, 8, 700, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TENSOR, E4, MASK_WINDOW, 50, 0, 0, 1, 0}, 16},
      {{2, 24, 4, 8, 900, 64, 64, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 10.0f, 1, 1, 0}, 24},
      {{2, 8, 4, 8, 600, 128, 128, BF16, BF16, 0, 0, ATT_FP8_NONE, E5, MASK_CAUSAL, 0, 0, 0, 1, 0}, 1},
  };
  const char *mins[2] = {"1", "-1"}, *wants[2] = {"warpgroup", "tensor-core kernel"};
  for (int pass = 0; pass < 2 && !test_failed_flag; ++pass) {
    kva_context *ctx;
    if (!make_cuda_ctx_wg8(&ctx, mins[pass])) return;
    for (size_t ci = 0; ci < sizeof wc / sizeof wc[0] && !test_failed_flag; ++ci)
      if (!run_case_want(ctx, &wc[ci], fp8_plant_unseen, 0, wants[pass])) FAIL_("%s case %zu", wants[pass], ci);
    for (size_t ci = 0; ci < sizeof trc / sizeof trc[0] && !test_failed_flag; ++ci)
      for (int variant = 0; variant < 2; ++variant)
        if (!run_case_want(ctx, &trc[ci], tree_bits, variant, wants[pass])) {
          FAIL_("tree %s case %zu, variant %d", wants[pass], ci, variant);
          break;
        }
    for (size_t ci = 0; ci < sizeof tc / sizeof tc[0] && !test_failed_flag; ++ci)
      for (int pr = 0; pr < ATT_PROBES; ++pr)
        if (!run_caller_table_case(ctx, &tc[ci].c, tc[ci].bs, wants[pass], pr, 0)) {
          FAIL_("%s table case %zu", wants[pass], ci);
          break;
        }
    kva_context_destroy(ctx);
  }
}
#endif
