/* kva_cascade_attention (CPU): against the oracle over each sequence's whole
 * cache (the shared prefix then its own suffix), for float and 4-bit K/V,
 * no mask and causal, sinks, softcap, lse, ragged suffixes, one and several
 * 16-row prefix chunks, contiguous and paged prefixes; bad input. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn_check.h"
#include "test.h"

typedef struct cz {
  int64_t B, H, KVH, L, P, S, D;
  int bits;              /* 0: f32 rows, 4: q4 g64 bf16 scales */
  kva_mask_kind mask;
  int sinks, softcap;
} cz;

typedef struct cdata {
  float *full_k, *full_v;            /* [B, KVH, P + S, D] f32 */
  float *pk, *pv, *sk, *sv;          /* prefix [1, KVH, P, D], suffix [B, KVH, S, D] (f32 sources) */
  kva_kv fk, fv, kp, vp, ks, vs;     /* full, prefix, suffix K/V (quantized when bits) */
  void *mem[48];
  int nmem;
  int32_t full_len[8], suf_len[8];
  float *q, *out, *ref, *lse, *rlse, sinks[64];
} cdata;

static void *cz_alloc(cdata *d, size_t n) {
  if (d->nmem == (int)(sizeof d->mem / sizeof d->mem[0])) return NULL;
  void *p = calloc(1, n ? n : 1);
  if (p) d->mem[d->nmem++] = p;
  return p;
}
static void cz_free(cdata *d) {
  for (int i = 0; i < d->nmem; ++i) free(d->mem[i]);
}
/* K/V of [B, KVH, N, D] f32 rows src: float rows as they are, or quantized (q4, group 64, bf16 scales). */
static int cz_kv(cdata *d, float *src, int64_t B, int64_t KVH, int64_t N, int64_t D, int bits, kva_kv *kv) {
  if (!bits) {
    *kv = kva_kv_float(src, KVA_F32, B, KVH, N, D);
    return 0;
  }
  const size_t words = (size_t)(B * KVH * N * D * bits / 32), groups = (size_t)(B * KVH * N * D / 64);
  void *w = cz_alloc(d, words * 4), *s = cz_alloc(d, groups * 2), *z = cz_alloc(d, groups * 2);
  if (!w || !s || !z) return -1;
  *kv = kva_kv_quantized(w, s, z, KVA_BF16, bits, 64, B, KVH, N, D);
  const kva_tensor t = kva_tensor_4d(src, KVA_F32, B, KVH, N, D);
  return kva_quantize(&t, kv);
}

static int cz_make(cdata *d, const cz *c) {
  memset(d, 0, sizeof *d);
  const int64_t T = c->P + c->S, D = c->D;
  const size_t full = (size_t)(c->B * c->KVH * T * D), pre = (size_t)(c->KVH * c->P * D),
               suf = (size_t)(c->B * c->KVH * c->S * D);
  d->full_k = cz_alloc(d, full * 4), d->full_v = cz_alloc(d, full * 4);
  d->pk = cz_alloc(d, pre * 4), d->pv = cz_alloc(d, pre * 4), d->sk = cz_alloc(d, suf * 4), d->sv = cz_alloc(d, suf * 4);
  const size_t nq = (size_t)(c->B * c->H * c->L * D);
  d->q = cz_alloc(d, nq * 4), d->out = cz_alloc(d, nq * 4), d->ref = cz_alloc(d, nq * 4);
  d->lse = cz_alloc(d, nq / D * 4), d->rlse = cz_alloc(d, nq / D * 4);
  if (!d->full_k || !d->full_v || !d->pk || !d->pv || !d->sk || !d->sv || !d->q || !d->out || !d->ref || !d->lse ||
      !d->rlse)
    return -1;
  for (size_t i = 0; i < pre; ++i) d->pk[i] = test_randn(), d->pv[i] = test_randn();
  for (size_t i = 0; i < suf; ++i) d->sk[i] = test_randn(), d->sv[i] = test_randn();
  for (size_t i = 0; i < nq; ++i) d->q[i] = test_randn();
  for (int64_t h = 0; h < c->H; ++h) d->sinks[h] = test_randn();
  for (int64_t b = 0; b < c->B; ++b) {
    /* ragged suffixes: S, S - 3, ... (>= L: the rows' own tokens) */
    int64_t s = c->S - 3 * b;
    if (s < c->L) s = c->L;
    d->suf_len[b] = (int32_t)s, d->full_len[b] = (int32_t)(c->P + s);
    for (int64_t hk = 0; hk < c->KVH; ++hk)
      for (int64_t t = 0; t < T; ++t) {
        const float *kk = t < c->P ? d->pk + (hk * c->P + t) * D : d->sk + ((b * c->KVH + hk) * c->S + t - c->P) * D;
        const float *vv = t < c->P ? d->pv + (hk * c->P + t) * D : d->sv + ((b * c->KVH + hk) * c->S + t - c->P) * D;
        memcpy(d->full_k + ((b * c->KVH + hk) * T + t) * D, kk, (size_t)D * 4);
        memcpy(d->full_v + ((b * c->KVH + hk) * T + t) * D, vv, (size_t)D * 4);
      }
  }
  if (cz_kv(d, d->full_k, c->B, c->KVH, T, D, c->bits, &d->fk) || cz_kv(d, d->full_v, c->B, c->KVH, T, D, c->bits, &d->fv) ||
      cz_kv(d, d->pk, 1, c->KVH, c->P, D, c->bits, &d->kp) || cz_kv(d, d->pv, 1, c->KVH, c->P, D, c->bits, &d->vp) ||
      cz_kv(d, d->sk, c->B, c->KVH, c->S, D, c->bits, &d->ks) || cz_kv(d, d->sv, c->B, c->KVH, c->S, D, c->bits, &d->vs))
    return -1;
  return 0;
}

/* q stored token-major [B, L, H, D], described as [B, H, L, D]. */
static kva_tensor cz_q(const cz *c, float *data) {
  kva_tensor t = kva_tensor_4d(data, KVA_F32, c->B, c->H, c->L, c->D);
  t.stride[0] = c->L * c->H * c->D * 4, t.stride[1] = c->D * 4, t.stride[2] = c->H * c->D * 4, t.stride[3] = 4;
  return t;
}
static kva_tensor cz_lse(const cz *c, float *data) {
  kva_tensor t = kva_tensor_4d(data, KVA_F32, c->B, c->H, c->L, 1);
  t.ndim = 3;
  t.shape[3] = 0;
  t.stride[0] = c->H * c->L * 4, t.stride[1] = c->L * 4, t.stride[2] = 4, t.stride[3] = 0;
  return t;
}
static kva_attn_params cz_params(const cz *c, cdata *d) {
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = c->mask;
  if (c->sinks) p.sinks = d->sinks;
  if (c->softcap) p.softcap = 20.0f;
  return p;
}

static int cz_case(kva_context *ctx, const cz *c, int paged_prefix) {
  cdata d;
  int ok = 0;
  kva_pool *pool = NULL;
  kva_paged_view *pv = NULL;
  if (cz_make(&d, c)) {
    FAIL_("could not build operands");
    goto done;
  }
  kva_tensor q = cz_q(c, d.q), out = kva_tensor_4d(d.out, KVA_F32, c->B, c->H, c->L, c->D);
  kva_tensor ref = kva_tensor_4d(d.ref, KVA_F32, c->B, c->H, c->L, c->D);
  kva_tensor lse = cz_lse(c, d.lse), rlse = cz_lse(c, d.rlse);
  const kva_kv_view full = kva_view_contiguous(&d.fk, &d.fv, d.full_len);
  kva_kv_view prefix = kva_view_contiguous(&d.kp, &d.vp, NULL);
  const kva_kv_view suffix = kva_view_contiguous(&d.ks, &d.vs, d.suf_len);
  if (paged_prefix) {
    int32_t s;
    if (kva_pool_from_contiguous(&pool, &prefix, 16, 0, 5, &s) || kva_paged_view_create(pool, &s, 1, &pv)) {
      FAIL_("paged prefix: %s", kva_last_error());
      goto done;
    }
    prefix = kva_view_paged(pv);
  }
  const kva_attn_params p = cz_params(c, &d);
  if (kva_reference_attention_lse(&q, &full, &p, &ref, &rlse, 0)) {
    FAIL_("oracle: %s", kva_last_error());
    goto done;
  }
  memset(d.out, 0xff, (size_t)(c->B * c->H * c->L * c->D) * 4);
  if (kva_cascade_attention(ctx, &q, &prefix, &suffix, &p, &out, &lse, 0, NULL, 0)) {
    FAIL_("kva_cascade_attention: %s", kva_last_error());
    goto done;
  }
  double err = 0;
  if (!att_compare(&out, &ref, ATT_ATOL_F32, 0, &err, NULL)) {
    FAIL_("B%lld H%lld/%lld L%lld P%lld S%lld D%lld bits %d mask %d sinks %d cap %d paged %d: out differs from the "
          "oracle over the whole caches (max err %.3g)", (long long)c->B, (long long)c->H, (long long)c->KVH,
          (long long)c->L, (long long)c->P, (long long)c->S, (long long)c->D, c->bits, (int)c->mask, c->sinks,
          c->softcap, paged_prefix, err);
    goto done;
  }
  for (int64_t i = 0; i < c->B * c->H * c->L; ++i)
    if (!(fabs((double)d.lse[i] - d.rlse[i]) <= 1e-5 * (1 + fabs((double)d.rlse[i])))) {
      FAIL_("lse[%lld] = %.7g, oracle %.7g", (long long)i, d.lse[i], d.rlse[i]);
      goto done;
    }
  ok = 1;
done:
  if (pv) kva_paged_view_release(pv);
  if (pool) kva_pool_destroy(pool);
  cz_free(&d);
  return ok;
}

TEST(cascade_vs_oracle) {
  static const cz cs[] = {
      {3, 8, 4, 1, 300, 40, 128, 0, KVA_MASK_CAUSAL, 0, 0},
      {3, 8, 4, 4, 300, 40, 128, 4, KVA_MASK_CAUSAL, 1, 0},
      {5, 8, 2, 4, 200, 30, 64, 4, KVA_MASK_CAUSAL, 0, 1}, /* 20 rows: two prefix chunks */
      {2, 6, 6, 2, 100, 20, 256, 0, KVA_MASK_NONE, 1, 1},
      {1, 4, 1, 8, 64, 16, 128, 4, KVA_MASK_CAUSAL, 1, 0},
      {4, 4, 2, 1, 33, 1, 64, 0, KVA_MASK_CAUSAL, 0, 0}, /* one-token suffixes */
  };
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  for (size_t i = 0; i < sizeof cs / sizeof cs[0] && !test_failed_flag; ++i)
    for (int paged = 0; paged < 2 && !test_failed_flag; ++paged)
      if (!cz_case(ctx, &cs[i], paged)) FAIL_("case %zu (paged prefix %d)", i, paged);
  kva_context_destroy(ctx);
}

TEST(cascade_bad_arguments) {
  const cz c = {2, 8, 4, 4, 64, 16, 64, 0, KVA_MASK_CAUSAL, 0, 0};
  cdata d;
  ASSERT_TRUE(cz_make(&d, &c) == 0);
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  kva_tensor q = cz_q(&c, d.q), out = kva_tensor_4d(d.out, KVA_F32, c.B, c.H, c.L, c.D);
  const kva_kv_view prefix = kva_view_contiguous(&d.kp, &d.vp, NULL), suffix = kva_view_contiguous(&d.ks, &d.vs, d.suf_len);
  kva_attn_params p = cz_params(&c, &d);
  memset(d.out, 0x7f, (size_t)(c.B * c.H * c.L * c.D) * 4);
  size_t bytes = 0;
  ASSERT_OK(kva_cascade_workspace_size(ctx, &q, &prefix, &suffix, &p, &bytes));
  ASSERT_TRUE(bytes > 0);
  /* [B, H, L, D] storage: sequences' rows not evenly spaced */
  kva_tensor qh = kva_tensor_4d(d.q, KVA_F32, c.B, c.H, c.L, c.D);
  ASSERT_ERR(kva_cascade_attention(ctx, &qh, &prefix, &suffix, &p, &out, NULL, 0, NULL, 0), KVA_ESTRIDE, "stride[0]");
  kva_attn_params pw = p;
  pw.mask.window = 8;
  ASSERT_ERR(kva_cascade_attention(ctx, &q, &prefix, &suffix, &pw, &out, NULL, 0, NULL, 0), KVA_EUNSUPPORTED, "window");
  /* a suffix shorter than L (its rows' own tokens) */
  int32_t short_len[2] = {2, 16};
  const kva_kv_view sshort = kva_view_contiguous(&d.ks, &d.vs, short_len);
  ASSERT_ERR(kva_cascade_attention(ctx, &q, &prefix, &sshort, &p, &out, NULL, 0, NULL, 0), KVA_ESHAPE, "seq_lens[0]");
  /* a prefix of two sequences */
  const kva_kv_view two = kva_view_contiguous(&d.ks, &d.vs, NULL);
  ASSERT_TRUE(kva_cascade_attention(ctx, &q, &two, &suffix, &p, &out, NULL, 0, NULL, 0) < 0);
  char ws[64];
  ASSERT_ERR(kva_cascade_attention(ctx, &q, &prefix, &suffix, &p, &out, NULL, 0, ws, sizeof ws), KVA_EWORKSPACE,
             "workspace");
  ASSERT_ERR(kva_cascade_attention(ctx, &q, &prefix, &suffix, &p, NULL, NULL, 0, NULL, 0), KVA_EINVAL, "out");
  ASSERT_ERR(kva_cascade_attention(ctx, &q, &prefix, &suffix, &p, &out, NULL, 4, NULL, 0), KVA_EINVAL, "lse_flags");
  ASSERT_ERR(kva_cascade_attention(NULL, &q, &prefix, &suffix, &p, &out, NULL, 0, NULL, 0), KVA_EINVAL, "ctx");
  const unsigned char *ob = (const unsigned char *)d.out;
  for (size_t i = 0; i < (size_t)(c.B * c.H * c.L * c.D) * 4; ++i)
    if (ob[i] != 0x7f) {
      FAIL_("out written by a failing call (byte %zu)", i);
      break;
    }
  /* a caller workspace of exactly the size asked for */
  void *w = malloc(bytes);
  ASSERT_TRUE(w != NULL);
  ASSERT_OK(kva_cascade_attention(ctx, &q, &prefix, &suffix, &p, &out, NULL, 0, w, bytes));
  free(w);
  kva_context_destroy(ctx);
  cz_free(&d);
}
