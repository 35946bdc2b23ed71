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

/* params->flags: KVA_ATTN_EXACT, KVA_ATTN_ROTATED_K and _V are flags;
 * another bit fails every entry point that validates params (the oracle
 * included), out untouched. */
TEST(errors_attn_flags) {
  bad_call c;
  ASSERT_TRUE(bad_setup(&c, &base_q4) == 0);
  c.params.flags = 8;                    EXPECT_BAD(&c, KVA_EINVAL, "params->flags = 0x8");
  c.params.flags = KVA_ATTN_EXACT | 8u;  EXPECT_BAD(&c, KVA_EINVAL, "params->flags = 0x9");
  c.params.flags = 1u << 31;             EXPECT_BAD(&c, KVA_EINVAL, "params->flags");
  size_t bytes = 0;
  char kname[64] = "x";
  c.params.flags = 8;
  ASSERT_ERR(kva_attention_workspace_size(c.ctx, &c.q, &c.view, &c.params, &bytes), KVA_EINVAL, "params->flags");
  ASSERT_ERR(kva_attention_kernel(c.ctx, &c.q, &c.view, &c.params, &c.out, kname, sizeof kname), KVA_EINVAL,
             "params->flags");
  ASSERT_TRUE(strcmp(kname, "x") == 0);
  ASSERT_ERR(kva_reference_attention(&c.q, &c.view, &c.params, &c.out), KVA_EINVAL, "params->flags");
  ASSERT_TRUE(out_untouched(&c));
  c.params.flags = KVA_ATTN_EXACT; /* the one valid bit */
  ASSERT_OK(kva_attention_workspace_size(c.ctx, &c.q, &c.view, &c.params, &bytes));
  ASSERT_OK(bad_run(&c));
  ASSERT_EQ(kva_attn_defaults().flags, 0);
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

/* Misaligned data pointers and strides (elements are loaded as typed
 * values), out aliasing the call's other arrays (sinks, seq_lens, segments,
 * mask array, block table), non-finite sinks and negative segment ids: each
 * a negative code naming the argument, out and those arrays untouched. For
 * the aliasing cases the array is copied to the start of an arena of its
 * own, larger than out, and out put there: out overlaps that array alone. */
#define ARENA_BYTES (1 << 16)
TEST(errors_alignment_aliasing_sinks_segments) {
  bad_call c;
  char needle[160];
  /* f32 q/out/K/V, per-head sinks, image segments, ragged lengths */
  const att_case seg = {2, 8, 4, 2, 64, 64, 64, KVA_F32, KVA_F32, 0, 0, 0, KVA_F32, MASK_SEG, 0, 0, 1, 1, 0};
  ASSERT_TRUE(bad_setup(&c, &seg) == 0);
  ASSERT_TRUE(c.params.sinks && c.view.seq_lens && c.params.mask.segments.data);
  ASSERT_TRUE(c.d.out_bytes < ARENA_BYTES / 2);
  float *sinks = c.d.sinks;
  c.q.data = (char *)c.q.data + 2;                   EXPECT_BAD(&c, KVA_EINVAL, "q: data pointer");
  c.out.data = (char *)c.out.data + 1;               EXPECT_BAD(&c, KVA_EINVAL, "out: data pointer");
  c.view.k.data.data = (char *)c.view.k.data.data + 2; EXPECT_BAD(&c, KVA_EINVAL, "k.data: data pointer");
  c.params.mask.segments.data = (char *)c.params.mask.segments.data + 1;
  EXPECT_BAD(&c, KVA_EINVAL, "mask.segments: data pointer");
  c.params.sinks = (const float *)((const char *)sinks + 2); EXPECT_BAD(&c, KVA_EINVAL, "sinks = ");
  c.view.seq_lens = (const int32_t *)((const char *)c.d.lens + 1); EXPECT_BAD(&c, KVA_EINVAL, "seq_lens = ");
  /* out aliasing what the call reads besides q, K and V */
  unsigned char *arena = (unsigned char *)malloc(ARENA_BYTES), *arena_copy = (unsigned char *)malloc(ARENA_BYTES);
  ASSERT_TRUE(arena && arena_copy);
  memset(arena, 0, ARENA_BYTES);
#define IN_ARENA(field, src, bytes, what)                                        \
  do {                                                                           \
    memcpy(arena, (src), (bytes));                                               \
    memcpy(arena_copy, arena, ARENA_BYTES);                                      \
    field;                                                                       \
    c.out.data = arena;                                                          \
    EXPECT_BAD(&c, KVA_EINVAL, "out overlaps " what);                            \
    ASSERT_TRUE(memcmp(arena, arena_copy, ARENA_BYTES) == 0);                    \
  } while (0)
  IN_ARENA(c.params.sinks = (const float *)arena, sinks, 8 * sizeof(float), "sinks");
  IN_ARENA(c.view.seq_lens = (const int32_t *)arena, c.d.lens, 2 * sizeof(int32_t), "seq_lens");
  IN_ARENA(c.params.mask.segments.data = arena, c.params.mask.segments.data, 2 * 64 * sizeof(int32_t), "mask.segments");
  /* host sinks must be finite or -inf (no sink; attention_sinks_nonfinite) */
  const float sink5 = sinks[5], bad_sinks[2] = {NAN, INFINITY};
  static const char *const bad_names[2] = {"sinks[5] = nan must be finite or -inf", "sinks[5] = inf must be finite"};
  for (int i = 0; i < 2; ++i) {
    sinks[5] = bad_sinks[i];
    EXPECT_BAD(&c, KVA_EINVAL, bad_names[i]);
  }
  sinks[5] = sink5;
  /* host segment ids are 0 (text) or k > 0 (image k), in every row a sequence reads */
  int32_t *id = (int32_t *)((char *)c.params.mask.segments.data + c.params.mask.segments.stride[0]);
  const int32_t id0 = *id;
  *id = -3;                                          EXPECT_BAD(&c, KVA_EINVAL, "mask.segments[1][0] = -3");
  *id = INT32_MIN;                                   EXPECT_BAD(&c, KVA_EINVAL, "mask.segments[1][0] = -2147483648");
  *id = id0;
  ASSERT_OK(bad_run(&c)); /* and the base call is valid */
  bad_teardown(&c);

  /* quantized operands: u32 words and bf16 scales, pointers and strides */
  ASSERT_TRUE(bad_setup(&c, &base_q4) == 0);
  c.view.v.data.data = (char *)c.view.v.data.data + 2;     EXPECT_BAD(&c, KVA_EINVAL, "v.data: data pointer");
  c.view.k.scales.data = (char *)c.view.k.scales.data + 1; EXPECT_BAD(&c, KVA_EINVAL, "k.scales: data pointer");
  c.view.v.biases.data = (char *)c.view.v.biases.data + 1; EXPECT_BAD(&c, KVA_EINVAL, "v.biases: data pointer");
  c.view.k.data.stride[2] += 2;
  snprintf(needle, sizeof needle, "k.data.stride[2] = %lld is not a multiple of the element size 4",
           (long long)c.view.k.data.stride[2]);
  EXPECT_BAD(&c, KVA_ESTRIDE, needle);
  c.view.k.scales.stride[1] += 1;
  snprintf(needle, sizeof needle, "k.scales.stride[1] = %lld is not a multiple of the element size 2",
           (long long)c.view.k.scales.stride[1]);
  EXPECT_BAD(&c, KVA_ESTRIDE, needle);
  /* an explicit mask array that out aliases */
  uint8_t *m = (uint8_t *)malloc(2 * 8 * 2 * 64);
  ASSERT_TRUE(m != NULL);
  memset(m, 1, 2 * 8 * 2 * 64);
  IN_ARENA((c.params.mask.kind = KVA_MASK_ARRAY, c.params.mask.array = kva_tensor_4d(arena, KVA_BOOL, 2, 8, 2, 64)), m,
           2 * 8 * 2 * 64, "mask.array");
  free(m);
  bad_teardown(&c);

  /* block-table arrays (caller pools of 16-token blocks) */
  const att_case tb_case = {2, 8, 4, 2, 64, 64, 64, KVA_F32, KVA_F32, 0, 0, 0, KVA_F32, MASK_CAUSAL, 0, 0, 0, 1, 0};
  ASSERT_TRUE(bad_setup(&c, &tb_case) == 0);
  att_table tb;
  ASSERT_TRUE(att_table_make(&tb, &c.d, 16, 0x3c) == 0);
  kva_block_table t = tb.t;
  c.d.view = tb.view;
  c.d.view.table = &t;
  bad_reset(&c);
  ASSERT_OK(bad_run(&c));
  att_poison(&c.d);
  memcpy(c.snapshot, c.d.out_buf, c.d.out_bytes);
  const size_t nblk_bytes = (size_t)(2 * t.max_blocks) * sizeof(int32_t);
  IN_ARENA(t.blocks = (const int32_t *)arena, tb.t.blocks, nblk_bytes, "table.blocks");
  t = tb.t;
  IN_ARENA(t.seq_lens = (const int32_t *)arena, tb.t.seq_lens, 2 * sizeof(int32_t), "table.seq_lens");
  t = tb.t;
  IN_ARENA(t.first_offset = (const int32_t *)arena, tb.t.first_offset, 2 * sizeof(int32_t), "table.first_offset");
  t = tb.t;
  t.seq_lens = (const int32_t *)((const char *)tb.t.seq_lens + 2);
  EXPECT_BAD(&c, KVA_EINVAL, "table.seq_lens = ");
  t = tb.t;
#undef IN_ARENA
  att_table_free(&tb);
  free(arena);
  free(arena_copy);
  bad_teardown(&c);
}

/* Shapes and strides of 2^50 .. 2^63 whose products (shape * 32 / bits,
 * D * bits, offset + n, workspace sizes, pool sizes) overflow int64: each
 * an error, no signed overflow (UBSan) and no allocation attempted. */
TEST(errors_absurd_sizes) {
  static uint32_t words[64];
  static uint16_t half[64];
  /* K/V head dims from packed words: 2^59 words of 2-bit codes are 2^63 values */
  kva_kv kv = kva_kv_quantized(words, half, half, KVA_BF16, 2, 64, 1, 1, 1, 64);
  kv.data = kva_tensor_4d(words, KVA_U32, 1, 1, 1, ((int64_t)1 << 59) + 3);
  ASSERT_EQ(kva_kv_dim(&kv), 0);
  bad_call c;
  ASSERT_TRUE(bad_setup(&c, &base_q4) == 0);
  int32_t seqs[2];
  kva_pool *pp = NULL;
  ASSERT_ERR(kva_pool_from_contiguous(&pp, &c.d.view, 16, INT64_MAX - 1, 0, seqs), KVA_EINVAL, "spare_blocks");
  ASSERT_TRUE(pp == NULL);
  c.view.k.bits = 2;
  c.view.k.data = kv.data;
  EXPECT_BAD(&c, KVA_ESHAPE, "k.data.shape[3] = 576460752303423491 words");
  /* the contiguous constructors: a byte size past int64 leaves a stride that is refused */
  c.view.v = kva_kv_float(words, KVA_F32, (int64_t)1 << 40, (int64_t)1 << 40, 2, 64);
  EXPECT_BAD(&c, KVA_ESHAPE, "v.data spans 2^62 bytes or more");
  c.view.v = kva_kv_quantized(words, half, half, KVA_BF16, 4, 64, 2, 4, 64, INT64_MAX);
  EXPECT_BAD(&c, KVA_ESHAPE, "v.data spans 2^62 bytes or more");
  /* absurd query heads: a valid descriptor (2^52 bf16 vectors of 64, spans 2^59
   * bytes) whose CPU workspace would not fit size_t */
  const att_case h64 = {1, 4, 4, 1, 64, 64, 64, KVA_BF16, KVA_BF16, 0, 0, 0, KVA_BF16, MASK_CAUSAL, 0, 0, 0, 0, 0};
  bad_teardown(&c);
  ASSERT_TRUE(bad_setup(&c, &h64) == 0);
  const int64_t H = (int64_t)1 << 52;
  /* (out at an address 2^60 bytes past q: apart from q, never written) */
  kva_tensor q = kva_tensor_4d(c.q.data, KVA_BF16, 1, H, 1, 64),
             out = kva_tensor_4d((void *)((uintptr_t)c.q.data + ((uintptr_t)1 << 60)), KVA_BF16, 1, H, 1, 64);
  size_t bytes = 0;
  ASSERT_ERR(kva_attention_workspace_size(c.ctx, &q, &c.view, &c.params, &bytes), KVA_ESHAPE, "problem too large");
  ASSERT_EQ(bytes, 0);
  ASSERT_ERR(kva_attention(c.ctx, &q, &c.view, &c.params, &out, NULL, 0), KVA_ESHAPE, "problem too large");
  ASSERT_TRUE(out_untouched(&c));
  for (int k = 50; k <= 62; ++k) { /* H of every magnitude: refused or too large, never allocated */
    const int64_t big = ((int64_t)1 << k) + 4;
    q = kva_tensor_4d(c.q.data, KVA_BF16, 1, big, 1, 64);
    const int rc = kva_attention_workspace_size(c.ctx, &q, &c.view, &c.params, &bytes);
    if (rc != KVA_ESHAPE) { FAIL_("H = 2^%d + 4: %d (%s)", k, rc, kva_last_error()); break; }
  }
  bad_teardown(&c);
  /* quantize / dequantize: D * bits and words * 32 / bits past int64 */
  kva_tensor w = kva_tensor_1d(half, KVA_F16, (int64_t)1 << 60);
  kva_kv qo = kva_kv_quantized(words, half + 32, half + 48, KVA_BF16, 8, 64, 1, 1, 1, 64);
  qo.data = kva_tensor_1d(words, KVA_U32, 16);
  qo.scales = kva_tensor_1d(half + 32, KVA_BF16, 1);
  qo.biases = kva_tensor_1d(half + 48, KVA_BF16, 1);
  ASSERT_ERR(kva_quantize(&w, &qo), KVA_ESHAPE, "out.data.shape[0] = 16, expected 288230376151711744");
  qo.bits = 2;
  qo.data = kva_tensor_1d(words, KVA_U32, ((int64_t)1 << 59) + 1);
  kva_tensor dq = kva_tensor_1d(half, KVA_F16, 64);
  ASSERT_ERR(kva_dequantize(&qo, &dq), KVA_ESHAPE, "would hold more than 2^63 values");
  /* masks: offset + n */
  uint8_t m[8];
  kva_tensor mt = kva_tensor_2d(m, KVA_BOOL, 2, 4);
  ASSERT_ERR(kva_causal_mask(2, INT64_MAX - 1, 0, &mt), KVA_EINVAL, "offset + n");
  /* pool descriptors: head dims whose packed rows overflow int64 */
  kva_pool_desc d = {16, 16, 1, (int64_t)1 << 61, 64, KVA_BF16, 8, 64};
  ASSERT_ERR(kva_pool_memory_size(&d, &bytes), KVA_EINVAL, "too large");
  d.dk = 64;
  d.kv_heads = ((int64_t)1 << 62) + 1;
  ASSERT_ERR(kva_pool_memory_size(&d, &bytes), KVA_EINVAL, "too large");
}

/* A success clears the last error: every public entry point clears it on
 * entry, so kva_last_error() is empty after a call that returns >= 0. */
TEST(errors_cleared_on_success) {
#define SET_ERR() ASSERT_TRUE(kva_causal_mask(0, 0, 0, NULL) < 0 && kva_last_error()[0])
#define CLEARS(call)                                                             \
  do {                                                                           \
    SET_ERR();                                                                   \
    ASSERT_OK(call);                                                             \
    if (kva_last_error()[0]) { FAIL_("%s left \"%s\"", #call, kva_last_error()); return; } \
  } while (0)
  float w[2 * 64], back[2 * 64];
  for (int i = 0; i < 128; ++i) w[i] = test_randn();
  uint32_t pk[2 * 8];
  uint16_t sc[2], bi[2];
  kva_tensor wt = kva_tensor_2d(w, KVA_F32, 2, 64), bt = kva_tensor_2d(back, KVA_F32, 2, 64);
  kva_kv q = kva_kv_quantized(pk, sc, bi, KVA_BF16, 4, 64, 1, 1, 2, 64);
  q.data = kva_tensor_2d(pk, KVA_U32, 2, 8);
  q.scales = kva_tensor_2d(sc, KVA_BF16, 2, 1);
  q.biases = kva_tensor_2d(bi, KVA_BF16, 2, 1);
  CLEARS(kva_quantize(&wt, &q));
  CLEARS(kva_dequantize(&q, &bt));
  CLEARS(kva_convert(&wt, &bt));
  uint8_t m[4 * 6];
  kva_tensor mt = kva_tensor_2d(m, KVA_BOOL, 4, 6), m4 = kva_tensor_2d(m, KVA_BOOL, 4, 4);
  int32_t seg[4] = {0, 1, 1, 0};
  kva_tensor st = kva_tensor_1d(seg, KVA_I32, 4);
  CLEARS(kva_causal_mask(4, 2, 0, &mt));
  CLEARS(kva_image_mask(&st, 0, 0, &m4));
  CLEARS(kva_cpu_set_simd(NULL));
  kva_context *ctx = NULL;
  CLEARS(kva_context_create(&ctx, NULL));
  bad_call c;
  ASSERT_TRUE(bad_setup(&c, &base_q4) == 0);
  size_t bytes;
  char kname[64];
  CLEARS(kva_attention_workspace_size(ctx, &c.q, &c.view, &c.params, &bytes));
  CLEARS(kva_attention_path(ctx, &c.q, &c.view, &c.params, &c.out));
  CLEARS(kva_attention_kernel(ctx, &c.q, &c.view, &c.params, &c.out, kname, sizeof kname));
  CLEARS(kva_attention(ctx, &c.q, &c.view, &c.params, &c.out, NULL, 0));
  CLEARS(kva_reference_attention(&c.q, &c.view, &c.params, &c.out));
  /* the paged API */
  kva_pool_desc d = {8, 16, 4, 128, 128, KVA_BF16, 4, 64};
  kva_pool *pool = NULL;
  int32_t s, child;
  CLEARS(kva_pool_memory_size(&d, &bytes));
  CLEARS(kva_pool_create(&pool, &d, NULL));
  CLEARS(kva_seq_create(pool, &s));
  float kr[4 * 3 * 128];
  for (int i = 0; i < 4 * 3 * 128; ++i) kr[i] = test_randn();
  kva_tensor rows = {kr, KVA_F32, 3, {4, 3, 128}, {3 * 128 * 4, 128 * 4, 4}};
  CLEARS(kva_seq_append(pool, s, &rows, &rows));
  CLEARS(kva_seq_fork(pool, s, &child));
  CLEARS((int)kva_seq_len(pool, child));
  CLEARS(kva_seq_trim(pool, child, 2));
  kva_paged_view *pv = NULL;
  kva_paged_csr csr;
  kva_pool_stats stats;
  int32_t refs;
  CLEARS(kva_paged_view_create(pool, &s, 1, &pv));
  CLEARS(kva_paged_view_csr(pv, &csr));
  CLEARS(kva_pool_stats_get(pool, &stats));
  CLEARS(kva_pool_block_refs(pool, csr.indices[0], &refs));
  CLEARS(kva_pool_check(pool));
  SET_ERR();
  kva_paged_view_release(pv);
  ASSERT_TRUE(kva_last_error()[0] == 0);
  CLEARS(kva_seq_free(pool, child));
  kva_pool_destroy(pool);
  kva_context_destroy(ctx);
  bad_teardown(&c);
#undef CLEARS
#undef SET_ERR
}

/* Reference counts stop at INT32_MAX: a view or fork that would pass it is
 * KVA_EUNSUPPORTED ("too many references") with nothing taken (a view over
 * the same block twice takes back the first reference). A view released
 * twice is ignored the second time (its handle stays with the pool), and a
 * released view is refused by the accessors. */
#include "paged/paged.h"
TEST(errors_paged_refcounts_and_double_release) {
  kva_pool_desc d = {8, 16, 2, 64, 64, KVA_F32, 0, 0};
  kva_pool *pool = NULL;
  int32_t s;
  ASSERT_OK(kva_pool_create(&pool, &d, NULL));
  ASSERT_OK(kva_seq_create(pool, &s));
  float kr[2 * 5 * 64];
  for (int i = 0; i < 2 * 5 * 64; ++i) kr[i] = test_randn();
  kva_tensor rows = {kr, KVA_F32, 3, {2, 5, 64}, {5 * 64 * 4, 64 * 4, 4}};
  ASSERT_OK(kva_seq_append(pool, s, &rows, &rows));
  kva_paged_view *v1 = NULL;
  kva_paged_csr csr;
  kva_pool_stats st;
  ASSERT_OK(kva_paged_view_create(pool, &s, 1, &v1));
  ASSERT_OK(kva_paged_view_csr(v1, &csr));
  const int32_t blk = csr.indices[0];
  kva_paged_view_release(v1);
  kva_paged_view_release(v1); /* caller error, ignored: no double unref, no use after free (ASan) */
  ASSERT_OK(kva_pool_stats_get(pool, &st));
  ASSERT_EQ(st.views, 0);
  ASSERT_OK(kva_pool_check(pool));
  ASSERT_ERR(kva_paged_view_csr(v1, &csr), KVA_EINVAL, "not a live paged view");
  kva_kv_view released = kva_view_paged(v1);
  ASSERT_ERR(kva_paged_view_gather(v1, 0, &released.k, &released.v), KVA_EINVAL, "not a live paged view");

  const int32_t orig = pool->ref[blk];
  pool->ref[blk] = INT32_MAX - 1;
  kva_paged_view *v2 = NULL, *v3 = (kva_paged_view *)&d; /* sentinel: must stay */
  ASSERT_OK(kva_paged_view_create(pool, &s, 1, &v2));
  ASSERT_EQ(pool->ref[blk], INT32_MAX);
  ASSERT_ERR(kva_paged_view_create(pool, &s, 1, &v3), KVA_EUNSUPPORTED, "too many references");
  ASSERT_TRUE(v3 == (kva_paged_view *)&d);
  ASSERT_EQ(pool->ref[blk], INT32_MAX);
  ASSERT_OK(kva_pool_stats_get(pool, &st));
  ASSERT_EQ(st.views, 1);
  kva_paged_view_release(v2);
  ASSERT_EQ(pool->ref[blk], INT32_MAX - 1);
  const int32_t twice[2] = {s, s}; /* the first reference fits, the second does not: both undone */
  ASSERT_ERR(kva_paged_view_create(pool, twice, 2, &v3), KVA_EUNSUPPORTED, "too many references");
  ASSERT_EQ(pool->ref[blk], INT32_MAX - 1);
  const int32_t indptr[3] = {0, 1, 2}, indices[2] = {blk, blk}, last[2] = {5, 5};
  const kva_paged_csr c2 = {2, indptr, indices, last, NULL, NULL, NULL};
  ASSERT_ERR(kva_paged_view_from_csr(pool, &c2, &v3), KVA_EUNSUPPORTED, "too many references");
  ASSERT_EQ(pool->ref[blk], INT32_MAX - 1);
  ASSERT_TRUE(v3 == (kva_paged_view *)&d);
  pool->ref[blk] = INT32_MAX;
  int32_t child = -12345;
  ASSERT_ERR(kva_seq_fork(pool, s, &child), KVA_EUNSUPPORTED, "too many references");
  ASSERT_EQ(child, -12345);
  ASSERT_OK(kva_pool_stats_get(pool, &st));
  ASSERT_EQ(st.sequences, 1);
  ASSERT_EQ(st.views, 0);
  pool->ref[blk] = orig;
  ASSERT_OK(kva_pool_check(pool));
  ASSERT_OK(kva_seq_fork(pool, s, &child)); /* and with room, both work again */
  ASSERT_OK(kva_paged_view_create(pool, twice, 2, &v2));
  kva_paged_view_release(v2);
  ASSERT_OK(kva_pool_check(pool));
  kva_pool_destroy(pool);
}
