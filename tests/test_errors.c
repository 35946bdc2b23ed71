/* Bad input to kva_attention: each case returns its negative code with a
 * message naming the argument, and leaves the output untouched. */
#include "attn_check.h"

/* A valid base call that each case breaks in one way. */
typedef struct bad_call {
  att_data d;
  kva_context *ctx;
  kva_tensor q, out;
  kva_kv_view view;
  kva_attn_params params;
  unsigned char *snapshot;
} bad_call;

static int bad_setup(bad_call *c, const att_case *ac) {
  memset(c, 0, sizeof *c);
  if (att_make(&c->d, ac)) return -1;
  if (kva_context_create(&c->ctx, NULL)) return -1;
  att_poison(&c->d);
  c->snapshot = (unsigned char *)malloc(c->d.out_bytes);
  memcpy(c->snapshot, c->d.out_buf, c->d.out_bytes);
  c->q = c->d.q;
  c->out = c->d.out;
  c->view = c->d.view;
  c->params = c->d.params;
  return 0;
}
static int bad_run(bad_call *c) { return kva_attention(c->ctx, &c->q, &c->view, &c->params, &c->out, NULL, 0); }
static int out_untouched(const bad_call *c) {
  return memcmp(c->snapshot, c->d.out_buf, c->d.out_bytes) == 0 && att_sentinel_ok(&c->d);
}
static void bad_reset(bad_call *c) {
  c->q = c->d.q;
  c->out = c->d.out;
  c->view = c->d.view;
  c->params = c->d.params;
}
static void bad_teardown(bad_call *c) {
  kva_context_destroy(c->ctx);
  free(c->snapshot);
  att_free(&c->d);
}

#define EXPECT_BAD(c, code, needle)                                              \
  do {                                                                           \
    ASSERT_ERR(bad_run(c), code, needle);                                        \
    if (!out_untouched(c)) { FAIL_("output modified on error (%s)", needle); return; } \
    bad_reset(c);                                                                \
  } while (0)

static const att_case base_q4 = {2, 8, 4, 2, 64, 128, 128, KVA_F32, KVA_F32, 4, 4, 64, KVA_BF16, MASK_CAUSAL,
                                 0, 0, 0, 1, 0};

TEST(errors_shapes_and_dtypes) {
  bad_call c;
  ASSERT_TRUE(bad_setup(&c, &base_q4) == 0);
  c.q.ndim = 3;                          EXPECT_BAD(&c, KVA_ESHAPE, "q must have rank 4");
  c.q.shape[0] = 3;                      EXPECT_BAD(&c, KVA_ESHAPE, "q.shape[0]");
  c.q.shape[3] = 64;                     EXPECT_BAD(&c, KVA_ESHAPE, "q.shape[3]");
  c.q.shape[1] = 6;                      EXPECT_BAD(&c, KVA_ESHAPE, "not a multiple of KV heads");
  c.q.dtype = KVA_U32;                   EXPECT_BAD(&c, KVA_EDTYPE, "q has unsupported dtype");
  c.out.dtype = KVA_I32;                 EXPECT_BAD(&c, KVA_EDTYPE, "out has unsupported dtype");
  c.out.shape[3] = 64;                   EXPECT_BAD(&c, KVA_ESHAPE, "out.shape[3]");
  c.q.shape[0] = 0;                      EXPECT_BAD(&c, KVA_ESHAPE, "q.shape[0] = 0");
  c.q.shape[2] = 0;                      EXPECT_BAD(&c, KVA_ESHAPE, "q.shape[2] = 0");
  c.view.k.data.dtype = KVA_F32;         EXPECT_BAD(&c, KVA_EDTYPE, "k.data has unsupported dtype");
  c.view.k.biases.dtype = KVA_F16;       EXPECT_BAD(&c, KVA_EDTYPE, "k: scales (bf16) and biases (f16)");
  c.view.v.bits = 3;                     EXPECT_BAD(&c, KVA_EUNSUPPORTED, "v.bits = 3");
  c.view.k.group_size = 16;              EXPECT_BAD(&c, KVA_EUNSUPPORTED, "k.group_size = 16");
  c.view.k.scales.shape[3] = 1;          EXPECT_BAD(&c, KVA_ESHAPE, "k: scales/biases last dim");
  c.view.v.data.shape[2] = c.view.v.scales.shape[2] = c.view.v.biases.shape[2] = 63;
  EXPECT_BAD(&c, KVA_ESHAPE, "v.shape[2] = 63");
  c.view.layout = (kva_layout)7;         EXPECT_BAD(&c, KVA_EINVAL, "kv.layout");
  bad_teardown(&c);
}

TEST(errors_head_dims_and_groups) {
  /* head dim not supported (float 100), and head dim not a multiple of the group (96 with g64) */
  bad_call c;
  const att_case f100 = {1, 4, 2, 1, 32, 64, 64, KVA_F32, KVA_F32, 0, 0, 0, KVA_F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  ASSERT_TRUE(bad_setup(&c, &f100) == 0);
  c.q.shape[3] = 48;
  c.view.k.data.shape[3] = 48;
  c.view.k.data.stride[2] = 48 * 4;
  EXPECT_BAD(&c, KVA_EUNSUPPORTED, "head dim Dk = 48");
  bad_teardown(&c);
  const att_case q96 = {1, 4, 2, 1, 32, 96, 96, KVA_F32, KVA_F32, 8, 8, 32, KVA_F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  ASSERT_TRUE(bad_setup(&c, &q96) == 0);
  c.view.k.group_size = 64;
  c.view.k.scales.shape[3] = 1;
  c.view.k.biases.shape[3] = 1;
  EXPECT_BAD(&c, KVA_ESHAPE, "head dim 96 is not a multiple of group_size 64");
  bad_teardown(&c);
}

TEST(errors_strides_and_pointers) {
  bad_call c;
  ASSERT_TRUE(bad_setup(&c, &base_q4) == 0);
  c.out.stride[3] = 8;                   EXPECT_BAD(&c, KVA_ESTRIDE, "out: innermost stride");
  c.q.stride[2] = 4;                     EXPECT_BAD(&c, KVA_ESTRIDE, "q: stride[");
  c.out.stride[1] = c.out.stride[2];     EXPECT_BAD(&c, KVA_ESTRIDE, "out: stride[");
  c.view.k.data.stride[2] = 0;           EXPECT_BAD(&c, KVA_ESTRIDE, "k.data.stride[2] = 0");
  c.view.v.scales.stride[0] = -4;        EXPECT_BAD(&c, KVA_ESTRIDE, "v.scales.stride[0]");
  c.q.stride[1] += 2;                    EXPECT_BAD(&c, KVA_ESTRIDE, "not a multiple of the element size 4");
  c.view.k.data.stride[0] = (int64_t)1 << 62; EXPECT_BAD(&c, KVA_ESHAPE, "k.data spans 2^62 bytes or more");
  c.view.v.data.shape[2] = INT64_MAX;    EXPECT_BAD(&c, KVA_ESHAPE, "v.data spans 2^62 bytes or more");
  c.q.data = NULL;                       EXPECT_BAD(&c, KVA_EINVAL, "q.data is NULL");
  c.view.v.biases.data = NULL;           EXPECT_BAD(&c, KVA_EINVAL, "v.biases.data is NULL");
  c.out.data = c.q.data;                 EXPECT_BAD(&c, KVA_EINVAL, "out overlaps q");
  ASSERT_ERR(kva_attention(c.ctx, NULL, &c.view, &c.params, &c.out, NULL, 0), KVA_EINVAL, "q is NULL");
  ASSERT_ERR(kva_attention(c.ctx, &c.q, NULL, &c.params, &c.out, NULL, 0), KVA_EINVAL, "kv");
  ASSERT_ERR(kva_attention(c.ctx, &c.q, &c.view, &c.params, NULL, NULL, 0), KVA_EINVAL, "out is NULL");
  ASSERT_ERR(kva_attention(NULL, &c.q, &c.view, &c.params, &c.out, NULL, 0), KVA_EINVAL, "ctx is NULL");
  ASSERT_TRUE(out_untouched(&c));
  bad_teardown(&c);
}

TEST(errors_lengths_and_params) {
  bad_call c;
  ASSERT_TRUE(bad_setup(&c, &base_q4) == 0);
  int32_t lens[2] = {64, 65};
  c.view.seq_lens = lens;                EXPECT_BAD(&c, KVA_ESHAPE, "seq_lens[1] = 65");
  lens[1] = 1;
  c.view.seq_lens = lens;                EXPECT_BAD(&c, KVA_ESHAPE, "seq_lens[1] = 1");
  float *bigq = (float *)calloc(2 * 8 * 65 * 128, sizeof(float));
  c.q = kva_tensor_4d(bigq, KVA_F32, 2, 8, 65, 128);
  EXPECT_BAD(&c, KVA_ESHAPE, "exceed the cache length");
  free(bigq);
  c.params.mask.window = -1;             EXPECT_BAD(&c, KVA_EINVAL, "mask.window = -1");
  c.params.mask.kind = KVA_MASK_NONE;
  c.params.mask.window = 4;              EXPECT_BAD(&c, KVA_EINVAL, "mask.window needs");
  c.params.scale = NAN;                  EXPECT_BAD(&c, KVA_EINVAL, "scale = nan");
  c.params.scale = INFINITY;             EXPECT_BAD(&c, KVA_EINVAL, "scale = inf");
  c.params.softcap = -1.0f;              EXPECT_BAD(&c, KVA_EINVAL, "softcap = -1");
  c.params.softcap = NAN;                EXPECT_BAD(&c, KVA_EINVAL, "softcap = nan");
  c.params.softcap = INFINITY;           EXPECT_BAD(&c, KVA_EINVAL, "softcap = inf must be finite and > 0");
  c.params.mask.kind = (kva_mask_kind)9; EXPECT_BAD(&c, KVA_EINVAL, "mask.kind = 9");
  int32_t seg[2 * 64];
  for (int i = 0; i < 128; ++i) seg[i] = i % 3;
  c.params.mask.segments = kva_tensor_2d(seg, KVA_I32, 2, 63);
  EXPECT_BAD(&c, KVA_ESHAPE, "mask.segments must be [B, N]");
  c.params.mask.segments = kva_tensor_2d(seg, KVA_I32, 2, 64);
  c.params.mask.kind = KVA_MASK_NONE;    EXPECT_BAD(&c, KVA_EINVAL, "mask.segments needs");
  c.params.mask.segments_clamp = 1;      EXPECT_BAD(&c, KVA_EINVAL, "segments_clamp is set");
  uint8_t m[2 * 8 * 2 * 64];
  memset(m, 1, sizeof m);
  c.params.mask.kind = KVA_MASK_ARRAY;
  c.params.mask.array = kva_tensor_4d(m, KVA_BOOL, 2, 8, 2, 63);
  EXPECT_BAD(&c, KVA_ESHAPE, "mask.array.shape[3] = 63");
  c.params.mask.kind = KVA_MASK_ARRAY;
  c.params.mask.array = kva_tensor_4d(m, KVA_BOOL, 2, 3, 2, 64);
  EXPECT_BAD(&c, KVA_ESHAPE, "mask.array.shape[1] = 3");
  c.params.mask.kind = KVA_MASK_ARRAY;
  c.params.mask.array = kva_tensor_4d(m, KVA_I32, 1, 1, 1, 64);
  EXPECT_BAD(&c, KVA_EDTYPE, "mask.array has unsupported dtype");
  bad_teardown(&c);
}

TEST(errors_workspace_queries) {
  bad_call c;
  ASSERT_TRUE(bad_setup(&c, &base_q4) == 0);
  size_t bytes = 0;
  ASSERT_ERR(kva_attention_workspace_size(c.ctx, &c.q, &c.view, &c.params, NULL), KVA_EINVAL, "bytes");
  c.q.shape[1] = 7;
  ASSERT_ERR(kva_attention_workspace_size(c.ctx, &c.q, &c.view, &c.params, &bytes), KVA_ESHAPE, "multiple of KV heads");
  bad_reset(&c);
  ASSERT_ERR(kva_attention_path(c.ctx, &c.q, &c.view, &c.params, NULL), KVA_EINVAL, "out is NULL");
  ASSERT_EQ(kva_attention_path(c.ctx, &c.q, &c.view, &c.params, &c.out), KVA_PATH_FUSED);
  /* kva_attention_kernel: the same validation and path, plus a description */
  char kname[128], small[8];
  memset(kname, 'x', sizeof kname);
  ASSERT_ERR(kva_attention_kernel(c.ctx, &c.q, &c.view, &c.params, &c.out, NULL, 16), KVA_EINVAL, "name is NULL");
  ASSERT_ERR(kva_attention_kernel(c.ctx, &c.q, &c.view, &c.params, &c.out, kname, 0), KVA_EINVAL, "size is 0");
  ASSERT_ERR(kva_attention_kernel(c.ctx, &c.q, &c.view, &c.params, NULL, kname, sizeof kname), KVA_EINVAL, "out is NULL");
  c.q.shape[1] = 7;
  ASSERT_ERR(kva_attention_kernel(c.ctx, &c.q, &c.view, &c.params, &c.out, kname, sizeof kname), KVA_ESHAPE,
             "multiple of KV heads");
  bad_reset(&c);
  ASSERT_TRUE(kname[0] == 'x' && kname[sizeof kname - 1] == 'x'); /* not written on error */
  ASSERT_EQ(kva_attention_kernel(c.ctx, &c.q, &c.view, &c.params, &c.out, kname, sizeof kname), KVA_PATH_FUSED);
  ASSERT_TRUE(strncmp(kname, "cpu ", 4) == 0 && strstr(kname, kva_cpu_simd()) && strstr(kname, " kernel"));
  ASSERT_EQ(kva_attention_kernel(c.ctx, &c.q, &c.view, &c.params, &c.out, small, sizeof small), KVA_PATH_FUSED);
  ASSERT_TRUE(strlen(small) == sizeof small - 1 && strncmp(small, kname, sizeof small - 1) == 0); /* truncated */
  ASSERT_OK(kva_cpu_set_simd("portable")); /* the fused kernel on generic vectors (fast8.c) */
  ASSERT_EQ(kva_attention_kernel(c.ctx, &c.q, &c.view, &c.params, &c.out, kname, sizeof kname), KVA_PATH_FUSED);
  ASSERT_TRUE(strcmp(kname, "cpu portable fused kernel [exact f32]") == 0);
  kva_cpu_set_simd(NULL);
  ASSERT_TRUE(strcmp(kva_strerror(KVA_ESHAPE), "shape mismatch") == 0);
  ASSERT_TRUE(strcmp(kva_strerror(12345), "unknown error") == 0);
  bad_teardown(&c);
}

TEST(errors_context_and_masks) {
  kva_context *ctx = NULL;
  kva_context_opts o = {KVA_BACKEND_CPU, -2, 0, NULL};
  ASSERT_ERR(kva_context_create(&ctx, &o), KVA_EINVAL, "opts.threads = -2");
  o.threads = KVA_MAX_THREADS + 1;
  ASSERT_ERR(kva_context_create(&ctx, &o), KVA_EINVAL, "exceeds KVA_MAX_THREADS");
  ASSERT_ERR(kva_context_create(NULL, NULL), KVA_EINVAL, "ctx");
  o.threads = 1;
  o.backend = (kva_backend)5;
  ASSERT_ERR(kva_context_create(&ctx, &o), KVA_EINVAL, "opts.backend = 5");
  uint8_t m[4 * 6];
  kva_tensor mt = kva_tensor_2d(m, KVA_BOOL, 4, 6);
  ASSERT_ERR(kva_causal_mask(4, 2, -1, &mt), KVA_EINVAL, "window = -1");
  ASSERT_ERR(kva_causal_mask(4, 1, 0, &mt), KVA_ESHAPE, "out must be [4, 5]");
  ASSERT_ERR(kva_causal_mask(0, 1, 0, &mt), KVA_EINVAL, "n = 0");
  int32_t seg[5] = {0, 1, 1, 0, 2};
  kva_tensor st = kva_tensor_1d(seg, KVA_I32, 5);
  ASSERT_ERR(kva_image_mask(&st, 0, 0, &mt), KVA_ESHAPE, "segments length");
  ASSERT_OK(kva_causal_mask(4, 2, 0, &mt));
  /* the seed's rule: row r (position 2 + r) sees keys j <= 2 + r */
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 6; ++j) ASSERT_EQ(m[r * 6 + j], j <= 2 + r);
  ASSERT_OK(kva_causal_mask(4, 2, 2, &mt));
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 6; ++j) ASSERT_EQ(m[r * 6 + j], j <= 2 + r && j > r);
}

/* The seed's bidirMask(L, window, bidir) is image_mask with one image. */
TEST(masks_image_reproduces_seed_bidir) {
  enum { L = 12 };
  const int bidir[L] = {0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0};
  int32_t seg[L];
  for (int i = 0; i < L; ++i) seg[i] = bidir[i];
  uint8_t m[L * L];
  kva_tensor st = kva_tensor_1d(seg, KVA_I32, L), mt = kva_tensor_2d(m, KVA_BOOL, L, L);
  for (int w = 0; w <= 4; w += 4) {
    ASSERT_OK(kva_image_mask(&st, w, 0, &mt));
    for (int i = 0; i < L; ++i)
      for (int j = 0; j < L; ++j) {
        int causal = j <= i && (w == 0 || i < j + w); /* createCausalMask(L, 0, w) */
        int want = causal || (bidir[i] && bidir[j]);
        ASSERT_EQ(m[i * L + j], want);
      }
  }
  /* two images never see each other; clamp keeps the image exception inside the window */
  const int32_t seg2[L] = {0, 1, 1, 1, 0, 2, 2, 2, 2, 2, 0, 0};
  memcpy(seg, seg2, sizeof seg);
  ASSERT_OK(kva_image_mask(&st, 2, 1, &mt));
  for (int i = 0; i < L; ++i)
    for (int j = 0; j < L; ++j) {
      int inwin = j > i - 2, causal = j <= i && inwin;
      int want = causal || (seg[i] && seg[i] == seg[j] && inwin);
      ASSERT_EQ(m[i * L + j], want);
    }
}

/* An output that lies inside a paged pool is refused like one inside a
 * contiguous cache, and the pool is not written. */
TEST(errors_out_overlaps_paged_pool) {
  const att_case c = {1, 4, 2, 1, 64, 64, 64, KVA_F32, KVA_F32, 0, 0, 0, KVA_F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  att_data d;
  ASSERT_TRUE(att_make(&d, &c) == 0);
  kva_pool *pool = NULL;
  kva_paged_view *pv = NULL;
  int32_t seq;
  ASSERT_OK(kva_pool_from_contiguous(&pool, &d.view, 16, 0, 1, &seq));
  ASSERT_OK(kva_paged_view_create(pool, &seq, 1, &pv));
  kva_kv_view view = kva_view_paged(pv);
  kva_kv pk = kva_pool_k(pool);
  kva_tensor out = kva_tensor_4d(pk.data.data, KVA_F32, 1, 4, 1, 64);
  const size_t probe = 4 * 64 * sizeof(float);
  unsigned char *before = (unsigned char *)malloc(probe);
  memcpy(before, pk.data.data, probe);
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  ASSERT_ERR(kva_attention(ctx, &d.q, &view, &d.params, &out, NULL, 0), KVA_EINVAL, "out overlaps k");
  ASSERT_TRUE(memcmp(before, pk.data.data, probe) == 0);
  free(before);
  kva_context_destroy(ctx);
  kva_paged_view_release(pv);
  kva_pool_destroy(pool);
  att_free(&d);
}
