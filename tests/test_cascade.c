/* kva_cascade_attention (CPU): against the oracle over each sequence's whole
 * cache (the shared prefix then its own suffix), for float and 4-bit K/V,
 * no mask and causal, sinks, softcap, lse, ragged suffixes, one and several
 * prefix chunks (256 rows each), contiguous and paged prefixes; bad input. */
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
  int32_t full_len[16], suf_len[16]; /* B <= 16 (cz_make) */
  float *q, *out, *ref, *lse, *rlse, sinks[64];
} cdata;

/* The oracle (with lse) over the whole caches, with the roundings of the
 * kernel a CPU call over full takes (att_name_rounding): the cascade's
 * prefix and suffix calls take the same kernel ("[q int8]" for quantized K
 * at the avx2 level: a per-query rounding, the same whatever the split). */
static int cz_oracle(kva_context *ctx, const kva_tensor *q, const kva_kv_view *full, const kva_attn_params *p,
                     kva_tensor *ref, kva_tensor *rlse) {
  char name[256];
  kva_ref_rounding r = {0, KVA_F32, KVA_F32, KVA_F32};
  if (kva_attention_kernel(ctx, q, full, p, ref, name, sizeof name) < 0) return -1;
  att_name_rounding(name, &r);
  return kva_reference_attention_rounded(q, full, p, ref, rlse, 0, &r);
}

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
  if (c->B > (int64_t)(sizeof d->suf_len / sizeof d->suf_len[0]) || c->H > (int64_t)(sizeof d->sinks / sizeof d->sinks[0]))
    return -1;
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
  if (cz_oracle(ctx, &q, &full, &p, &ref, &rlse)) {
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
      {5, 8, 2, 4, 200, 30, 64, 4, KVA_MASK_CAUSAL, 0, 1},
      {16, 2, 1, 17, 300, 20, 64, 4, KVA_MASK_CAUSAL, 0, 0}, /* 272 rows: two prefix chunks (256 + 16) */
      {2, 6, 6, 2, 100, 20, 256, 0, KVA_MASK_NONE, 1, 1},
      {1, 4, 1, 8, 64, 16, 128, 4, KVA_MASK_CAUSAL, 1, 0},
      {4, 4, 2, 1, 33, 1, 64, 0, KVA_MASK_CAUSAL, 0, 0}, /* one-token suffixes */
  };
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  for (size_t i = 0; i < sizeof cs / sizeof cs[0] && !test_failed_flag; ++i)
    for (int paged = 0; paged < 2 && !test_failed_flag; ++paged)
      if (test_case_sampled((long)(2 * i) + paged, (long)(2 * (sizeof cs / sizeof cs[0]))) && !cz_case(ctx, &cs[i], paged))
        FAIL_("case %zu (paged prefix %d)", i, paged);
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

/* ---- forked paged sequences: the shared prefix, the split, cascade over the
 * split views (paged, and block tables made from them) against the oracle
 * over the whole sequences */

typedef struct forks {
  kva_pool *pool;
  int32_t parent, seqs[8];
  int64_t B, P0, bs;
} forks;

/* f32 rows [KVH, T, D] of random values appended to seq (rows freed). */
static int fk_append(kva_pool *pool, int32_t seq, int64_t KVH, int64_t T, int64_t D) {
  float *k = malloc(sizeof(float) * (size_t)(KVH * T * D)), *v = malloc(sizeof(float) * (size_t)(KVH * T * D));
  int rc = -1;
  if (k && v) {
    for (int64_t i = 0; i < KVH * T * D; ++i) k[i] = test_randn(), v[i] = test_randn();
    kva_tensor tk = kva_tensor_4d(k, KVA_F32, 1, KVH, T, D), tv = tk;
    tk.ndim = 3, tk.shape[0] = KVH, tk.shape[1] = T, tk.shape[2] = D, tk.stride[0] = T * D * 4, tk.stride[1] = D * 4,
    tk.stride[2] = 4;
    tv = tk, tv.data = v;
    rc = kva_seq_append(pool, seq, &tk, &tv);
  }
  free(k), free(v);
  return rc;
}

/* A parent of P0 tokens (P0 + trim appended, the first trim dropped) forked
 * B times; child b appends suffix[b] tokens; bits 0: f32 pool, 4: q4 group
 * 64 bf16 scales. */
static int fk_make(forks *f, int64_t B, int64_t KVH, int64_t D, int64_t P0, const int64_t *suffix, int64_t bs,
                   int bits, int64_t trim) {
  memset(f, 0, sizeof *f);
  f->B = B, f->P0 = P0, f->bs = bs;
  kva_pool_desc d = {.num_blocks = 4096, .block_size = bs, .kv_heads = KVH, .dk = D, .dv = D,
                     .dtype = bits ? KVA_BF16 : KVA_F32, .bits = bits, .group_size = bits ? 64 : 0};
  if (kva_pool_create(&f->pool, &d, NULL) || kva_seq_create(f->pool, &f->parent) ||
      fk_append(f->pool, f->parent, KVH, P0 + trim, D) || kva_seq_trim(f->pool, f->parent, P0))
    return -1; /* trim > 0: the parent's window starts trim rows into its first blocks */
  for (int64_t b = 0; b < B; ++b)
    if (kva_seq_fork(f->pool, f->parent, &f->seqs[b]) || fk_append(f->pool, f->seqs[b], KVH, suffix[b], D)) return -1;
  return 0;
}

/* kva_cascade_attention(prefix, suffix) against the oracle over full, on the
 * CPU: q [B, H, L, D] token-major, causal, sinks; out and lse. */
static int fk_check(kva_context *ctx, const kva_kv_view *full, const kva_kv_view *prefix, const kva_kv_view *suffix,
                    int64_t B, int64_t H, int64_t L, int64_t D, const char *what) {
  const cz c = {B, H, 1, L, 1, 1, D, 0, KVA_MASK_CAUSAL, 1, 0};
  const size_t n = (size_t)(B * H * L * D);
  float *q = malloc(n * 4), *o = malloc(n * 4), *r = malloc(n * 4), *l = malloc(n / D * 4), *rl = malloc(n / D * 4);
  float sinks[64];
  int ok = 0;
  if (!q || !o || !r || !l || !rl) goto done;
  for (size_t i = 0; i < n; ++i) q[i] = test_randn();
  for (int64_t h = 0; h < H; ++h) sinks[h] = test_randn();
  kva_tensor tq = cz_q(&c, q), to = kva_tensor_4d(o, KVA_F32, B, H, L, D), tr = kva_tensor_4d(r, KVA_F32, B, H, L, D);
  kva_tensor tl = cz_lse(&c, l), trl = cz_lse(&c, rl);
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = KVA_MASK_CAUSAL;
  p.sinks = sinks;
  if (cz_oracle(ctx, &tq, full, &p, &tr, &trl)) {
    FAIL_("%s: oracle: %s", what, kva_last_error());
    goto done;
  }
  if (kva_cascade_attention(ctx, &tq, prefix, suffix, &p, &to, &tl, 0, NULL, 0)) {
    FAIL_("%s: kva_cascade_attention: %s", what, kva_last_error());
    goto done;
  }
  double err = 0;
  if (!att_compare(&to, &tr, ATT_ATOL_F32, 0, &err, NULL)) {
    FAIL_("%s: out differs from the oracle over the whole sequences (max err %.3g)", what, err);
    goto done;
  }
  for (size_t i = 0; i < n / D; ++i)
    if (!(fabs((double)l[i] - rl[i]) <= 1e-5 * (1 + fabs((double)rl[i])))) {
      FAIL_("%s: lse[%zu] = %.7g, oracle %.7g", what, i, l[i], rl[i]);
      goto done;
    }
  ok = 1;
done:
  free(q), free(o), free(r), free(l), free(rl);
  return ok;
}

TEST(cascade_shared_prefix_of_forks) {
  const int64_t suffix[4] = {20, 7, 33, 1};
  forks f;
  ASSERT_TRUE(fk_make(&f, 4, 2, 64, 100, suffix, 16, 0, 0) == 0);
  int64_t P = -1;
  /* 100 tokens: 6 whole blocks shared; the partial 7th was copied on each child's first append */
  ASSERT_OK(kva_seq_shared_prefix(f.pool, f.seqs, 4, 0, &P));
  ASSERT_EQ(P, 96);
  ASSERT_OK(kva_seq_shared_prefix(f.pool, f.seqs, 3, 0, &P));
  ASSERT_EQ(P, 96);
  /* with the parent (still holding its partial block) */
  int32_t with_parent[2] = {f.parent, f.seqs[0]};
  ASSERT_OK(kva_seq_shared_prefix(f.pool, with_parent, 2, 0, &P));
  ASSERT_EQ(P, 96);
  /* capped: every sequence keeps min_suffix own tokens (the shortest, the parent, has 100) */
  ASSERT_OK(kva_seq_shared_prefix(f.pool, with_parent, 2, 10, &P));
  ASSERT_EQ(P, 90);
  ASSERT_OK(kva_seq_shared_prefix(f.pool, f.seqs, 4, 5, &P)); /* seqs[3] holds 101 tokens */
  ASSERT_EQ(P, 96);
  ASSERT_OK(kva_seq_shared_prefix(f.pool, f.seqs, 4, 6, &P));
  ASSERT_EQ(P, 95);
  /* one sequence: all of it but min_suffix; the same sequence twice: likewise */
  ASSERT_OK(kva_seq_shared_prefix(f.pool, f.seqs, 1, 1, &P));
  ASSERT_EQ(P, 119);
  int32_t twice[2] = {f.seqs[2], f.seqs[2]};
  ASSERT_OK(kva_seq_shared_prefix(f.pool, twice, 2, 0, &P));
  ASSERT_EQ(P, 133);
  /* an unrelated sequence shares nothing; a trimmed fork (another first offset) neither */
  int32_t other, mix[2];
  ASSERT_OK(kva_seq_create(f.pool, &other));
  ASSERT_TRUE(fk_append(f.pool, other, 2, 50, 64) == 0);
  mix[0] = f.seqs[0], mix[1] = other;
  ASSERT_OK(kva_seq_shared_prefix(f.pool, mix, 2, 0, &P));
  ASSERT_EQ(P, 0);
  int32_t trimmed;
  ASSERT_OK(kva_seq_fork(f.pool, f.seqs[0], &trimmed));
  ASSERT_OK(kva_seq_trim(f.pool, trimmed, 110)); /* drops 10 tokens: first offset 10 */
  mix[1] = trimmed;
  ASSERT_OK(kva_seq_shared_prefix(f.pool, mix, 2, 0, &P));
  ASSERT_EQ(P, 0);
  /* a view reports the same; bad input */
  kva_paged_view *pv;
  ASSERT_OK(kva_paged_view_create(f.pool, f.seqs, 4, &pv));
  const kva_kv_view view = kva_view_paged(pv);
  ASSERT_OK(kva_view_shared_prefix(&view, 0, &P));
  ASSERT_EQ(P, 96);
  ASSERT_ERR(kva_view_shared_prefix(&view, -1, &P), KVA_EINVAL, "min_suffix");
  ASSERT_ERR(kva_view_shared_prefix(&view, 0, NULL), KVA_EINVAL, "tokens");
  ASSERT_ERR(kva_seq_shared_prefix(f.pool, f.seqs, 0, 0, &P), KVA_EINVAL, "B");
  ASSERT_OK(kva_seq_free(f.pool, other));
  mix[1] = other;
  ASSERT_ERR(kva_seq_shared_prefix(f.pool, mix, 2, 0, &P), KVA_ENOSEQ, "seqs[1]");
  const kva_kv_view contig = kva_view_contiguous(&view.k, &view.v, NULL);
  ASSERT_ERR(kva_view_shared_prefix(&contig, 0, &P), KVA_EINVAL, "layout");
  kva_paged_view_release(pv);
  ASSERT_OK(kva_pool_check(f.pool));
  kva_pool_destroy(f.pool);
  /* forks of a trimmed parent: 37 rows dropped (2 blocks and 5 rows), 100
   * left over blocks 2..8 from row 5: 6 whole blocks shared less 5 rows */
  ASSERT_TRUE(fk_make(&f, 3, 2, 64, 100, suffix, 16, 0, 37) == 0);
  ASSERT_OK(kva_seq_shared_prefix(f.pool, f.seqs, 3, 0, &P));
  ASSERT_EQ(P, 91);
  kva_pool_destroy(f.pool);
}

/* Split views of forks attended by kva_cascade_attention equal the oracle
 * over the whole sequences: paged prefix + paged suffix, and both as block
 * tables (kva_block_table_split), at the shared prefix (block-aligned) and
 * inside a block (suffixes then start mid-block), float and 4-bit pools. */
TEST(cascade_split_views_vs_oracle) {
  static const struct {
    int64_t B, H, KVH, L, D, P0, bs;
    int bits;
    int64_t suffix[5], trim;
  } cs[] = {
      {4, 8, 2, 1, 64, 100, 16, 0, {20, 7, 33, 1, 0}, 0},
      {3, 8, 4, 4, 128, 300, 32, 4, {40, 9, 4, 0, 0}, 0},
      {5, 4, 2, 4, 64, 70, 8, 4, {12, 30, 5, 6, 4}, 3}, /* 20 rows; first offset 3 */
      {2, 4, 1, 8, 128, 40, 16, 0, {8, 21, 0, 0, 0}, 0},
      {3, 8, 2, 2, 64, 90, 16, 0, {5, 18, 2, 0, 0}, 21}, /* first offset 5 */
  };
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  for (size_t ci = 0; ci < sizeof cs / sizeof cs[0] && !test_failed_flag; ++ci) {
    forks f;
    ASSERT_TRUE(fk_make(&f, cs[ci].B, cs[ci].KVH, cs[ci].D, cs[ci].P0, cs[ci].suffix, cs[ci].bs, cs[ci].bits, cs[ci].trim) == 0);
    kva_paged_view *pv;
    ASSERT_OK(kva_paged_view_create(f.pool, f.seqs, f.B, &pv));
    const kva_kv_view full = kva_view_paged(pv);
    int64_t shared;
    ASSERT_OK(kva_view_shared_prefix(&full, cs[ci].L, &shared));
    ASSERT_TRUE(shared >= 1);
    kva_pool_stats st0, st1;
    ASSERT_OK(kva_pool_stats_get(f.pool, &st0));
    const int64_t Ps[2] = {shared, shared > 5 ? shared - 5 : 1};
    for (int pi = 0; pi < 2 && !test_failed_flag; ++pi) {
      char what[96];
      snprintf(what, sizeof what, "case %zu, P = %lld of %lld shared", ci, (long long)Ps[pi], (long long)shared);
      kva_paged_view *pp = NULL, *ps = NULL;
      ASSERT_OK(kva_paged_view_split(pv, Ps[pi], &pp, &ps));
      kva_paged_csr pc, sc;
      ASSERT_OK(kva_paged_view_csr(pp, &pc));
      ASSERT_OK(kva_paged_view_csr(ps, &sc));
      ASSERT_EQ(pc.batch, 1);
      ASSERT_EQ(pc.lens[0], Ps[pi]);
      ASSERT_EQ(sc.batch, f.B);
      for (int64_t b = 0; b < f.B; ++b) ASSERT_EQ(sc.lens[b], f.P0 + cs[ci].suffix[b] - Ps[pi]);
      const kva_kv_view prefix = kva_view_paged(pp), suffix = kva_view_paged(ps);
      if (!fk_check(ctx, &full, &prefix, &suffix, f.B, cs[ci].H, cs[ci].L, cs[ci].D, what)) break;
      /* the same split as block tables over the pool's arrays */
      int64_t mb = 0;
      for (int64_t b = 0; b < f.B; ++b) {
        const int64_t nb = kva_seq_blocks(f.pool, f.seqs[b]);
        if (nb > mb) mb = nb;
      }
      int32_t *blocks = malloc(sizeof(int32_t) * (size_t)(f.B * (mb + 3))), lens[9], first[9], tl[8], tf[8];
      ASSERT_TRUE(blocks != NULL);
      /* row stride mb + 3: a table with padded rows */
      for (int64_t b = 0; b < f.B; ++b) {
        kva_paged_view *one;
        ASSERT_OK(kva_paged_view_create(f.pool, &f.seqs[b], 1, &one));
        ASSERT_OK(kva_paged_view_block_table(one, mb + 3, blocks + b * (mb + 3), &tl[b], &tf[b]));
        kva_paged_view_release(one);
      }
      const kva_kv kp = kva_pool_k(f.pool), vp = kva_pool_v(f.pool);
      const kva_block_table table = {f.B, mb, mb + 3, blocks, tl, tf};
      const kva_kv_view tfull = kva_view_block_table(&kp, &vp, &table);
      int64_t tshared;
      ASSERT_OK(kva_view_shared_prefix(&tfull, cs[ci].L, &tshared));
      ASSERT_EQ(tshared, shared);
      kva_block_table tpre, tsuf;
      ASSERT_OK(kva_block_table_split(&tfull, Ps[pi], lens, first, &tpre, &tsuf));
      const kva_kv_view tprefix = kva_view_block_table(&kp, &vp, &tpre), tsuffix = kva_view_block_table(&kp, &vp, &tsuf);
      snprintf(what + strlen(what), sizeof what - strlen(what), " (block tables)");
      fk_check(ctx, &full, &tprefix, &tsuffix, f.B, cs[ci].H, cs[ci].L, cs[ci].D, what);
      /* mixed layouts: a paged prefix, a block-table suffix */
      fk_check(ctx, &full, &prefix, &tsuffix, f.B, cs[ci].H, cs[ci].L, cs[ci].D, "paged prefix, table suffix");
      /* a split past the shared prefix, or of nothing, is refused and makes no view */
      kva_paged_view *x = NULL, *y = NULL;
      ASSERT_ERR(kva_paged_view_split(pv, shared + cs[ci].L, &x, &y), KVA_EINVAL, "prefix_tokens");
      ASSERT_ERR(kva_paged_view_split(pv, 0, &x, &y), KVA_EINVAL, "prefix_tokens");
      ASSERT_ERR(kva_block_table_split(&tfull, shared + cs[ci].L, lens, first, &tpre, &tsuf), KVA_EINVAL,
                 "prefix_tokens");
      ASSERT_TRUE(x == NULL && y == NULL);
      free(blocks);
      kva_paged_view_release(pp);
      kva_paged_view_release(ps);
      ASSERT_OK(kva_pool_stats_get(f.pool, &st1));
      ASSERT_EQ(st1.views, st0.views);
      ASSERT_EQ(st1.used_blocks, st0.used_blocks);
    }
    kva_paged_view_release(pv);
    ASSERT_OK(kva_pool_check(f.pool));
    kva_pool_destroy(f.pool);
  }
  kva_context_destroy(ctx);
}

/* A prefix shorter than a chunk of stacked rows (5 tokens, 20 rows), its
 * length known only from host arrays (seq_lens, a block table): the CPU
 * bounds the chunk by it. */
TEST(cascade_short_prefix) {
  const cz c = {5, 8, 4, 4, 5, 12, 64, 0, KVA_MASK_CAUSAL, 0, 0};
  cdata d;
  ASSERT_TRUE(cz_make(&d, &c) == 0);
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  const kva_kv_view full = kva_view_contiguous(&d.fk, &d.fv, d.full_len);
  const kva_kv_view suffix = kva_view_contiguous(&d.ks, &d.vs, d.suf_len);
  /* the 5 prefix tokens inside a 9-token cache: seq_lens [1] = 5 */
  const int64_t N = 9;
  float *pk = calloc((size_t)(c.KVH * N * c.D), 4), *pv = calloc((size_t)(c.KVH * N * c.D), 4);
  ASSERT_TRUE(pk && pv);
  for (int64_t h = 0; h < c.KVH; ++h) {
    memcpy(pk + h * N * c.D, d.pk + h * c.P * c.D, (size_t)(c.P * c.D) * 4);
    memcpy(pv + h * N * c.D, d.pv + h * c.P * c.D, (size_t)(c.P * c.D) * 4);
  }
  kva_kv k9 = kva_kv_float(pk, KVA_F32, 1, c.KVH, N, c.D), v9 = kva_kv_float(pv, KVA_F32, 1, c.KVH, N, c.D);
  const int32_t plen = 5;
  const kva_kv_view pre = kva_view_contiguous(&k9, &v9, &plen);
  char what[] = "prefix of 5 tokens, seq_lens";
  (void)full;
  /* fk_check's oracle runs over `full` with its own q: use it directly */
  ASSERT_TRUE(fk_check(ctx, &full, &pre, &suffix, c.B, c.H, c.L, c.D, what));
  /* as a block table: the 9-token cache as one pool block of 9 rows */
  kva_kv kpool = kva_kv_float(pk, KVA_F32, 1, c.KVH, N, c.D), vpool = kva_kv_float(pv, KVA_F32, 1, c.KVH, N, c.D);
  const int32_t blk = 0;
  const kva_block_table t = {1, 1, 0, &blk, &plen, NULL};
  const kva_kv_view tpre = kva_view_block_table(&kpool, &vpool, &t);
  ASSERT_TRUE(fk_check(ctx, &full, &tpre, &suffix, c.B, c.H, c.L, c.D, "prefix of 5 tokens, block table"));
  free(pk), free(pv);
  kva_context_destroy(ctx);
  cz_free(&d);
}

/* ---- CUDA: the same cascade on the device against the host oracle over the
 * whole caches: contiguous prefix and suffix (bf16 rows and bf16 q on the
 * tensor cores, q4 with bf16 q, f32 q over q4: the exact kernels), device
 * lengths and sinks, lse, two prefix chunks, a graph capture replayed;
 * split forks as device block tables. Skips without a device. */
#ifndef KVA_HAVE_CUDA
TEST(cascade_cuda_vs_oracle) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cascade_cuda_block_tables) { SKIP("built without CUDA (nvcc not found)"); }
#else
#include <cuda_runtime_api.h>

#define CZ_DEV_MAX 48
typedef struct cz_dev {
  void *mem[CZ_DEV_MAX];
  int n;
} cz_dev;

static size_t cz_extent(const kva_tensor *t) {
  size_t e = kva_dtype_size(t->dtype);
  for (int d = 0; d < t->ndim; ++d) e += (size_t)((t->shape[d] - 1) * t->stride[d]);
  return e;
}
/* A device copy of n bytes at h (NULL on failure). */
static void *cz_dev_copy(cz_dev *m, const void *h, size_t n) {
  void *p = NULL;
  if (m->n == CZ_DEV_MAX || cudaMalloc(&p, n ? n : 1) != cudaSuccess) return NULL;
  m->mem[m->n++] = p;
  if (h && cudaMemcpy(p, h, n, cudaMemcpyHostToDevice) != cudaSuccess) return NULL;
  return p;
}
/* t's memory mirrored with the same strides (t itself rewritten to point at it). */
static int cz_dev_tensor(cz_dev *m, kva_tensor *t) {
  if (!t->data) return 0;
  void *p = cz_dev_copy(m, t->data, cz_extent(t));
  if (!p) return -1;
  t->data = p;
  return 0;
}
static int cz_dev_kv(cz_dev *m, kva_kv *kv) {
  return cz_dev_tensor(m, &kv->data) || (kv->bits && (cz_dev_tensor(m, &kv->scales) || cz_dev_tensor(m, &kv->biases)));
}
static void cz_dev_free(cz_dev *m) {
  for (int i = 0; i < m->n; ++i) cudaFree(m->mem[i]);
  m->n = 0;
}
/* float K/V rows converted to dt (new host buffers owned by d). */
static int cz_to_dtype(cdata *d, kva_kv *kv, kva_dtype dt) {
  if (kv->bits || kv->data.dtype == dt) return 0;
  const kva_tensor *s = &kv->data;
  void *buf = cz_alloc(d, (size_t)(s->shape[0] * s->shape[1] * s->shape[2] * s->shape[3]) * kva_dtype_size(dt));
  if (!buf) return -1;
  kva_tensor t = kva_tensor_4d(buf, dt, s->shape[0], s->shape[1], s->shape[2], s->shape[3]);
  if (kva_convert(s, &t)) return -1;
  kv->data = t;
  return 0;
}
/* The allowance of a cascade on ctx: f32 when both passes (the stacked
 * prefix rows, the suffix call) run "[exact f32]" kernels, else bf16 products. */
static double cz_cuda_atol(kva_context *ctx, const kva_tensor *q, const kva_kv_view *prefix,
                           const kva_kv_view *suffix, const kva_attn_params *p, const kva_tensor *out) {
  const int64_t B = q->shape[0], L = q->shape[2], rows = B * L < 16 ? B * L : 16;
  kva_tensor qc = *q, oc = kva_tensor_4d(NULL, KVA_F32, 1, q->shape[1], rows, out->shape[3]);
  qc.shape[0] = 1, qc.shape[2] = rows;
  if (L == 1) qc.stride[2] = q->stride[0];
  oc.data = out->data;
  kva_attn_params pp = *p;
  memset(&pp.mask, 0, sizeof pp.mask);
  kva_attn_params ps = *p;
  ps.sinks = NULL;
  char a[200], b[200];
  if (kva_attention_kernel(ctx, &qc, prefix, &pp, &oc, a, sizeof a) < 0 ||
      kva_attention_kernel(ctx, q, suffix, &ps, out, b, sizeof b) < 0) {
    FAIL_("kva_attention_kernel(CUDA): %s", kva_last_error());
    return -1;
  }
  return att_name_exact(a) && att_name_exact(b) ? ATT_ATOL_F32 : ATT_ATOL_BF16;
}

/* Device out / lse fetched and compared with the host oracle's. */
static int cz_fetch_compare(const kva_tensor *dout, const kva_tensor *dlse, float *hout, float *hlse,
                            const kva_tensor *ref, const float *rlse, int64_t rows, double atol, const char *what) {
  const size_t n = (size_t)(rows * dout->shape[3]);
  if (cudaDeviceSynchronize() != cudaSuccess || cudaMemcpy(hout, dout->data, n * 4, cudaMemcpyDeviceToHost) ||
      cudaMemcpy(hlse, dlse->data, (size_t)rows * 4, cudaMemcpyDeviceToHost)) {
    FAIL_("%s: device run or copy: %s", what, cudaGetErrorString(cudaGetLastError()));
    return 0;
  }
  kva_tensor got = *ref;
  got.data = hout;
  double err = 0;
  if (!att_compare(&got, ref, atol, 0, &err, NULL)) {
    FAIL_("%s: CUDA cascade differs from the oracle over the whole caches (max err %.3g, allowed %.3g)", what, err,
          atol);
    return 0;
  }
  /* lse: f32 sums over the same logits; bf16-product kernels round the logits' inputs */
  const double lt = atol > ATT_ATOL_F32 ? 2e-2 : 1e-5;
  for (int64_t i = 0; i < rows; ++i)
    if (!(fabs((double)hlse[i] - rlse[i]) <= lt * (1 + fabs((double)rlse[i])))) {
      FAIL_("%s: lse[%lld] = %.7g, oracle %.7g", what, (long long)i, hlse[i], rlse[i]);
      return 0;
    }
  return 1;
}

typedef struct czc {
  cz c;
  kva_dtype qdt; /* q (and float K/V rows) dtype */
  int graph;     /* also capture the call into a graph and replay it */
} czc;

static int cz_cuda_case(kva_context *ctx, const czc *cc) {
  const cz *c = &cc->c;
  cdata d;
  cz_dev m = {{0}, 0};
  int ok = 0;
  char what[160];
  snprintf(what, sizeof what, "CUDA B%lld H%lld/%lld L%lld P%lld S%lld D%lld bits %d q %s", (long long)c->B,
           (long long)c->H, (long long)c->KVH, (long long)c->L, (long long)c->P, (long long)c->S, (long long)c->D,
           c->bits, kva_dtype_name(cc->qdt));
  if (cz_make(&d, c) || cz_to_dtype(&d, &d.fk, cc->qdt) || cz_to_dtype(&d, &d.fv, cc->qdt) ||
      cz_to_dtype(&d, &d.kp, cc->qdt) || cz_to_dtype(&d, &d.vp, cc->qdt) || cz_to_dtype(&d, &d.ks, cc->qdt) ||
      cz_to_dtype(&d, &d.vs, cc->qdt)) {
    FAIL_("%s: could not build operands", what);
    goto done;
  }
  const int64_t rows = c->B * c->H * c->L, n = rows * c->D;
  kva_tensor qf = cz_q(c, d.q), q = qf;
  if (cc->qdt != KVA_F32) { /* the same token-major layout in 2-byte elements */
    void *qb = cz_alloc(&d, (size_t)n * 2);
    q.data = qb, q.dtype = cc->qdt;
    for (int k = 0; k < 4; ++k) q.stride[k] /= 2;
    if (!qb || kva_convert(&qf, &q)) {
      FAIL_("%s: q to %s: %s", what, kva_dtype_name(cc->qdt), qb ? kva_last_error() : "out of memory");
      goto done;
    }
  }
  kva_tensor ref = kva_tensor_4d(d.ref, KVA_F32, c->B, c->H, c->L, c->D), rlse = cz_lse(c, d.rlse);
  const kva_kv_view full = kva_view_contiguous(&d.fk, &d.fv, d.full_len);
  const kva_attn_params hp = cz_params(c, &d);
  if (kva_reference_attention_lse(&q, &full, &hp, &ref, &rlse, 0)) {
    FAIL_("%s: oracle: %s", what, kva_last_error());
    goto done;
  }
  /* device operands */
  kva_tensor dq = q, dout = kva_tensor_4d(NULL, KVA_F32, c->B, c->H, c->L, c->D), dlse = cz_lse(c, NULL);
  kva_kv kp = d.kp, vp = d.vp, ks = d.ks, vs = d.vs;
  int32_t *dlen = (int32_t *)cz_dev_copy(&m, d.suf_len, sizeof(int32_t) * (size_t)c->B);
  float *dsinks = (float *)cz_dev_copy(&m, d.sinks, sizeof d.sinks);
  dout.data = cz_dev_copy(&m, NULL, (size_t)n * 4);
  dlse.data = cz_dev_copy(&m, NULL, (size_t)rows * 4);
  if (cz_dev_tensor(&m, &dq) || cz_dev_kv(&m, &kp) || cz_dev_kv(&m, &vp) || cz_dev_kv(&m, &ks) || cz_dev_kv(&m, &vs) ||
      !dlen || !dsinks || !dout.data || !dlse.data) {
    FAIL_("%s: could not mirror operands to the device", what);
    goto done;
  }
  const kva_kv_view prefix = kva_view_contiguous(&kp, &vp, NULL), suffix = kva_view_contiguous(&ks, &vs, dlen);
  kva_attn_params p = hp;
  if (p.sinks) p.sinks = dsinks;
  const double atol = cz_cuda_atol(ctx, &dq, &prefix, &suffix, &p, &dout);
  if (atol < 0) goto done;
  cudaMemset(dout.data, 0xff, (size_t)n * 4);
  if (kva_cascade_attention(ctx, &dq, &prefix, &suffix, &p, &dout, &dlse, 0, NULL, 0)) {
    FAIL_("%s: kva_cascade_attention(CUDA): %s", what, kva_last_error());
    goto done;
  }
  if (!cz_fetch_compare(&dout, &dlse, d.out, d.lse, &ref, d.rlse, rows, atol, what)) goto done;
  if (cc->graph) { /* captured (the workspace exists now) and replayed on a stream */
    cudaStream_t s;
    cudaGraph_t g;
    cudaGraphExec_t ge;
    if (cudaStreamCreate(&s) != cudaSuccess || kva_context_set_stream(ctx, s)) {
      FAIL_("%s: stream", what);
      goto done;
    }
    cudaMemset(dout.data, 0xff, (size_t)n * 4);
    int rc = -1;
    if (cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess) {
      rc = kva_cascade_attention(ctx, &dq, &prefix, &suffix, &p, &dout, &dlse, 0, NULL, 0);
      if (cudaStreamEndCapture(s, &g) != cudaSuccess) rc = -1;
    }
    int launched = rc == 0 && cudaGraphInstantiate(&ge, g, 0) == cudaSuccess;
    if (launched) launched = cudaGraphLaunch(ge, s) == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess;
    kva_context_set_stream(ctx, NULL);
    if (!launched) FAIL_("%s: graph capture / replay failed (%s)", what, rc ? kva_last_error() : "CUDA");
    else ok = cz_fetch_compare(&dout, &dlse, d.out, d.lse, &ref, d.rlse, rows, atol, "graph replay");
    if (rc == 0) {
      if (launched) cudaGraphExecDestroy(ge);
      cudaGraphDestroy(g);
    }
    cudaStreamDestroy(s);
    if (!ok) goto done;
  }
  ok = 1;
done:
  cz_dev_free(&m);
  cz_free(&d);
  return ok;
}

TEST(cascade_cuda_vs_oracle) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  static const czc cs[] = {
      {{3, 8, 4, 1, 3000, 40, 128, 0, KVA_MASK_CAUSAL, 0, 0}, KVA_BF16, 1},  /* bf16 rows, tensor cores */
      {{4, 8, 4, 4, 2000, 40, 256, 4, KVA_MASK_CAUSAL, 1, 0}, KVA_BF16, 0},  /* q4, 32 stacked vectors */
      {{5, 8, 2, 4, 700, 30, 128, 4, KVA_MASK_CAUSAL, 0, 1}, KVA_BF16, 0},   /* 20 rows, 80 vectors */
      {{16, 4, 2, 17, 700, 24, 128, 4, KVA_MASK_CAUSAL, 0, 0}, KVA_BF16, 0}, /* two prefix chunks (256 + 16 rows) */
      {{3, 8, 4, 2, 1000, 20, 128, 4, KVA_MASK_CAUSAL, 1, 0}, KVA_F32, 0},   /* f32 q: exact kernels */
      {{16, 32, 8, 1, 4096, 64, 128, 4, KVA_MASK_CAUSAL, 0, 0}, KVA_BF16, 1}, /* the bench's 32/8/128 shape */
      {{2, 6, 6, 2, 100, 20, 64, 0, KVA_MASK_NONE, 1, 1}, KVA_F32, 0},
  };
  kva_context *ctx;
  const kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  for (size_t i = 0; i < sizeof cs / sizeof cs[0] && !test_failed_flag; ++i)
    if (!cz_cuda_case(ctx, &cs[i])) FAIL_("case %zu", i);
  kva_context_destroy(ctx);
}

/* Forks split as block tables (kva_block_table_split on the host mirror)
 * over device pools: cascade on the device against the oracle over the
 * whole sequences (host view); q4 pool, bf16 q; aligned and mid-block splits. */
TEST(cascade_cuda_block_tables) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  const int64_t B = 4, H = 16, KVH = 4, L = 2, D = 128, bs = 16, suffix[4] = {20, 7, 33, 2};
  forks f;
  ASSERT_TRUE(fk_make(&f, B, KVH, D, 900, suffix, bs, 4, 11) == 0);
  kva_context *ctx;
  const kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  kva_paged_view *pv;
  ASSERT_OK(kva_paged_view_create(f.pool, f.seqs, B, &pv));
  const kva_kv_view full = kva_view_paged(pv);
  int64_t shared, mb = 0;
  ASSERT_OK(kva_view_shared_prefix(&full, L, &shared));
  for (int64_t b = 0; b < B; ++b)
    if (kva_seq_blocks(f.pool, f.seqs[b]) > mb) mb = kva_seq_blocks(f.pool, f.seqs[b]);
  int32_t *blocks = malloc(sizeof(int32_t) * (size_t)(B * mb)), tl[4], tf[4], lens[5], first[5];
  ASSERT_TRUE(blocks != NULL);
  ASSERT_OK(kva_paged_view_block_table(pv, mb, blocks, tl, tf));
  const kva_kv hk = kva_pool_k(f.pool), hv = kva_pool_v(f.pool);
  const kva_block_table table = {B, mb, 0, blocks, tl, tf};
  const kva_kv_view tfull = kva_view_block_table(&hk, &hv, &table);
  cz_dev m = {{0}, 0};
  kva_kv dk = hk, dv = hv;
  int32_t *dblocks = (int32_t *)cz_dev_copy(&m, blocks, sizeof(int32_t) * (size_t)(B * mb));
  ASSERT_TRUE(dblocks && !cz_dev_kv(&m, &dk) && !cz_dev_kv(&m, &dv));
  const size_t n = (size_t)(B * H * L * D);
  const cz c = {B, H, KVH, L, 1, 1, D, 4, KVA_MASK_CAUSAL, 0, 0};
  float *qf = malloc(n * 4), *hout = malloc(n * 4), *ref = malloc(n * 4), *hl = malloc(n / D * 4), *rl = malloc(n / D * 4);
  uint16_t *qb = malloc(n * 2);
  ASSERT_TRUE(qf && hout && ref && hl && rl && qb);
  for (size_t i = 0; i < n; ++i) qf[i] = test_randn();
  kva_tensor tqf = cz_q(&c, qf), tq = tqf;
  tq.data = qb, tq.dtype = KVA_BF16;
  for (int k = 0; k < 4; ++k) tq.stride[k] /= 2;
  ASSERT_OK(kva_convert(&tqf, &tq));
  kva_tensor tref = kva_tensor_4d(ref, KVA_F32, B, H, L, D), trl = cz_lse(&c, rl);
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = KVA_MASK_CAUSAL;
  ASSERT_OK(kva_reference_attention_lse(&tq, &full, &p, &tref, &trl, 0));
  kva_tensor dq = tq, dout = kva_tensor_4d(cz_dev_copy(&m, NULL, n * 4), KVA_F32, B, H, L, D), dlse = cz_lse(&c, NULL);
  dlse.data = cz_dev_copy(&m, NULL, n / D * 4);
  ASSERT_TRUE(!cz_dev_tensor(&m, &dq) && dout.data && dlse.data);
  const int64_t Ps[2] = {shared, shared - 9};
  for (int pi = 0; pi < 2 && !test_failed_flag; ++pi) {
    kva_block_table hpre, hsuf;
    ASSERT_OK(kva_block_table_split(&tfull, Ps[pi], lens, first, &hpre, &hsuf));
    int32_t *dlens = (int32_t *)cz_dev_copy(&m, lens, sizeof lens), *dfirst = (int32_t *)cz_dev_copy(&m, first, sizeof first);
    ASSERT_TRUE(dlens && dfirst);
    kva_block_table dpre = hpre, dsuf = hsuf;
    dpre.blocks = dblocks + (hpre.blocks - blocks), dsuf.blocks = dblocks + (hsuf.blocks - blocks);
    dpre.seq_lens = dlens, dpre.first_offset = dfirst, dsuf.seq_lens = dlens + 1, dsuf.first_offset = dfirst + 1;
    const kva_kv_view prefix = kva_view_block_table(&dk, &dv, &dpre), sfx = kva_view_block_table(&dk, &dv, &dsuf);
    const double atol = cz_cuda_atol(ctx, &dq, &prefix, &sfx, &p, &dout);
    ASSERT_TRUE(atol > 0);
    ASSERT_OK(kva_cascade_attention(ctx, &dq, &prefix, &sfx, &p, &dout, &dlse, 0, NULL, 0));
    char what[64];
    snprintf(what, sizeof what, "CUDA block tables, P = %lld", (long long)Ps[pi]);
    if (!cz_fetch_compare(&dout, &dlse, hout, hl, &tref, rl, B * H * L, atol, what)) break;
  }
  free(qf), free(hout), free(ref), free(hl), free(rl), free(qb), free(blocks);
  cz_dev_free(&m);
  kva_paged_view_release(pv);
  kva_context_destroy(ctx);
  kva_pool_destroy(f.pool);
}
#endif
