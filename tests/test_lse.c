/* kva_attention_lse and kva_merge_states on the CPU: lse against the
 * oracle's (double, same logits) over contiguous, block-table and paged
 * views, every mask kind, softcap, sinks, ragged lengths, rows without keys
 * and base 2; merges of attention over disjoint key ranges against one call
 * over all keys; merge orders; empty parts; bad arguments. */
#include "attn_check.h"
#include "lse_check.h"

#define F32 KVA_F32
#define F16 KVA_F16
#define BF16 KVA_BF16

/* B, H, KVH, L, N, Dk, Dv, q, out, kbits, vbits, group, kv/scale dtype, mask, window, softcap, sinks, ragged, strided */
static const att_case lse_cases[] = {
    {1, 8, 4, 1, 17, 256, 256, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 4, 1, 113, 128, 128, F16, F16, 0, 0, 0, F16, MASK_NONE, 0, 0, 0, 0, 1},
    {1, 8, 2, 1, 4097, 64, 64, F32, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 4, 1, 113, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 6, 2, 1, 17, 128, 128, F32, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 6, 2, 1, 113, 128, 128, F32, F32, 2, 2, 128, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 24, 4, 8, 1000, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 4, 8, 40, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {2, 12, 2, 8, 113, 256, 256, BF16, F32, 8, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 1},
    {1, 16, 2, 3, 90, 128, 64, BF16, F32, 0, 0, 0, BF16, MASK_WINDOW, 9, 0, 0, 0, 0},
    {1, 8, 2, 4, 60, 64, 64, BF16, F32, 0, 0, 0, F16, MASK_SEG, 0, 20.0f, 0, 0, 0},
    {3, 8, 4, 1, 1000, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
    {2, 8, 4, 1, 1000, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_WINDOW, 100, 0, 0, 1, 0},
    {1, 8, 4, 8, 700, 128, 128, F32, F32, 0, 0, 0, F32, MASK_WINDOW, 1, 0, 0, 0, 0},
    {1, 4, 2, 12, 300, 64, 64, F32, F32, 4, 4, 32, F32, MASK_SEG_CLAMP, 7, 0, 0, 0, 1},
    {2, 8, 4, 3, 500, 128, 128, F32, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 5.0f, 1, 1, 0},
    {1, 8, 2, 1, 300, 64, 64, F32, F32, 8, 8, 64, BF16, MASK_NONE, 0, 0, 1, 0, 0},
    {1, 4, 2, 1, 500, 128, 128, F16, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {2, 4, 2, 5, 200, 64, 64, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, 1, 1, 0},
    {2, 4, 2, 5, 200, 128, 128, F32, BF16, 4, 4, 64, F32, MASK_ADD, 0, 0, 0, 0, 1},
    {1, 4, 2, 24, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 1, 0, 0}, /* L > 16: row groups */
};
#define NLSE (int)(sizeof lse_cases / sizeof lse_cases[0])

/* d through kva_attention_lse (view `view`) against the oracle's out and
 * lse; poisoned outputs, sentinels. */
static int lse_run(kva_context *ctx, att_data *d, const kva_kv_view *view, unsigned flags, const char *what) {
  const size_t ob = (size_t)(d->c.B * d->c.H * d->c.L * d->c.Dv) * kva_dtype_size(d->c.odt);
  kva_tensor ref = kva_tensor_4d(malloc(ob), d->c.odt, d->c.B, d->c.H, d->c.L, d->c.Dv);
  lse_buf rl, kl;
  int ok = lse_buf_make(&rl, d->c.B, d->c.H, d->c.L, 0) == 0 && lse_buf_make(&kl, d->c.B, d->c.H, d->c.L, 1) == 0;
  char kname[160] = "";
  kva_attention_kernel(ctx, &d->q, view, &d->params, &d->out, kname, sizeof kname);
  kva_ref_rounding rr; /* the oracle with the kernel's modelled roundings */
  att_name_rounding(kname, &rr);
  if (ok && kva_reference_attention_rounded(&d->q, view, &d->params, &ref, &rl.t, flags, &rr)) {
    fprintf(stderr, "    oracle: %s\n", kva_last_error());
    ok = 0;
  }
  att_poison(d);
  if (ok && kva_attention_lse(ctx, &d->q, view, &d->params, &d->out, &kl.t, flags, NULL, 0)) {
    fprintf(stderr, "    kva_attention_lse (%s): %s\n", what, kva_last_error());
    ok = 0;
  }
  ok = ok && att_compare(&d->out, &ref, att_kernel_atol(ctx, &d->q, view, &d->params, &d->out), att_rtol(d->c.odt), NULL, NULL) && att_sentinel_ok(d);
  /* f32 rounding of log for exact products; a kernel that rounds K or P moves l by up to the bf16 allowance */
  const double lrt = att_name_atol(kname) == ATT_ATOL_F32 ? LSE_RTOL : ATT_ATOL_BF16;
  ok = ok && lse_compare(&kl.t, &rl.t, lrt, what) && lse_sentinel_ok(&kl);
  lse_buf_free(&rl);
  lse_buf_free(&kl);
  free(ref.data);
  return ok;
}

static int lse_case(kva_context *ctx, const att_case *c, int layouts) {
  char name[256];
  att_case_str(c, name, sizeof name);
  att_data d;
  if (att_make(&d, c)) {
    FAIL_("%s: could not build operands", name);
    att_free(&d);
    return 0;
  }
  int ok = 1;
  for (int base2 = 0; base2 < 2 && ok; ++base2) ok = lse_run(ctx, &d, &d.view, base2 ? KVA_LSE_BASE2 : 0, "contiguous");
  /* masks indexed by N (segments, arrays) stay on the contiguous view: a table's N differs */
  if (ok && layouts && c->mask <= MASK_WINDOW) {
    att_table tb;
    if (att_table_make(&tb, &d, 16, 0xff) == 0) {
      ok = lse_run(ctx, &d, &tb.view, 0, "block table");
      att_table_free(&tb);
    } else ok = 0;
    if (ok && c->kbits == c->vbits) { /* a pool has one format for K and V */
      kva_pool *pool = NULL;
      int32_t seqs[16];
      kva_paged_view *pv = NULL;
      if (kva_pool_from_contiguous(&pool, &d.view, 16, 0, 7, seqs) == 0 &&
          kva_paged_view_create(pool, seqs, c->B, &pv) == 0) {
        kva_kv_view v = kva_view_paged(pv);
        ok = lse_run(ctx, &d, &v, KVA_LSE_BASE2, "paged");
      } else {
        fprintf(stderr, "    paged view: %s\n", kva_last_error());
        ok = 0;
      }
      kva_paged_view_release(pv);
      kva_pool_destroy(pool);
    }
  }
  if (!ok) FAIL_("%s", name);
  att_free(&d);
  return ok;
}

TEST(lse_cpu_vs_oracle) {
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  int n_eligible = 0; /* the cases --quick keeps, sampled among themselves */
  for (int ci = 0; ci < NLSE; ++ci) n_eligible += !(test_quick && lse_cases[ci].N > 1000);
  for (int ci = 0, eligible = 0; ci < NLSE; ++ci) {
    if (test_quick && lse_cases[ci].N > 1000) continue;
    if (!test_case_sampled(eligible++, n_eligible)) continue;
    int ok = 1;
    for (int li = 0; li < ATT_PASSES && ok; ++li) {
      if (att_set_pass(li)) continue;
      ok = lse_case(ctx, &lse_cases[ci], li == ATT_PASSES - 1 || li == 0);
    }
    att_end_passes();
    if (!ok) break;
  }
  kva_context_destroy(ctx);
}

/* Rows that see no key: lse -inf exactly and out zeros, with or without a sink. */
TEST(lse_row_without_keys) {
  for (int sinks = 0; sinks < 2; ++sinks) {
    const att_case c = {1, 2, 1, 3, 50, 64, 64, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, sinks, 0, 0};
    att_data d;
    ASSERT_TRUE(att_make(&d, &c) == 0);
    memset((uint8_t *)d.params.mask.array.data + 1 * c.N, 0, (size_t)c.N); /* head 0, row 1 */
    kva_context *ctx;
    ASSERT_OK(kva_context_create(&ctx, NULL));
    lse_buf kl;
    ASSERT_TRUE(lse_buf_make(&kl, 1, 2, 3, 1) == 0);
    att_poison(&d);
    ASSERT_OK(kva_attention_lse(ctx, &d.q, &d.view, &d.params, &d.out, &kl.t, 0, NULL, 0));
    const float *o = (const float *)d.out.data;
    for (int e = 0; e < c.Dv; ++e) ASSERT_TRUE(o[1 * c.Dv + e] == 0.0f);
    ASSERT_TRUE(lse_get(&kl.t, 0, 0, 1) == -INFINITY);
    ASSERT_TRUE(isfinite(lse_get(&kl.t, 0, 0, 0)) && isfinite(lse_get(&kl.t, 0, 1, 1)));
    ASSERT_TRUE(lse_sentinel_ok(&kl));
    lse_buf_free(&kl);
    kva_context_destroy(ctx);
    att_free(&d);
  }
}

/* Bad lse arguments: a clear error and nothing written. */
TEST(lse_bad_arguments) {
  const att_case c = {1, 4, 2, 2, 64, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  att_data d;
  ASSERT_TRUE(att_make(&d, &c) == 0);
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  lse_buf kl;
  ASSERT_TRUE(lse_buf_make(&kl, 1, 4, 2, 1) == 0);
  att_poison(&d);
  kva_tensor bad = kl.t;
  bad.dtype = KVA_F16;
  ASSERT_ERR(kva_attention_lse(ctx, &d.q, &d.view, &d.params, &d.out, &bad, 0, NULL, 0), KVA_EDTYPE, "lse");
  bad = kl.t;
  bad.shape[1] = 3;
  ASSERT_ERR(kva_attention_lse(ctx, &d.q, &d.view, &d.params, &d.out, &bad, 0, NULL, 0), KVA_ESHAPE, "lse.shape[1]");
  bad = kl.t;
  bad.ndim = 4;
  ASSERT_TRUE(kva_attention_lse(ctx, &d.q, &d.view, &d.params, &d.out, &bad, 0, NULL, 0) < 0);
  bad = kl.t;
  bad.stride[2] = 8;
  ASSERT_TRUE(kva_attention_lse(ctx, &d.q, &d.view, &d.params, &d.out, &bad, 0, NULL, 0) < 0);
  ASSERT_ERR(kva_attention_lse(ctx, &d.q, &d.view, &d.params, &d.out, &kl.t, 2u, NULL, 0), KVA_EINVAL, "flags");
  kva_tensor over = kva_tensor_4d(d.q.data, KVA_F32, 1, 1, 1, 1);
  over = (kva_tensor){d.q.data, KVA_F32, 3, {1, 4, 2, 0}, {32, 8, 4, 0}};
  ASSERT_ERR(kva_attention_lse(ctx, &d.q, &d.view, &d.params, &d.out, &over, 0, NULL, 0), KVA_EINVAL, "lse overlaps q");
  over.data = d.out.data;
  ASSERT_ERR(kva_attention_lse(ctx, &d.q, &d.view, &d.params, &d.out, &over, 0, NULL, 0), KVA_EINVAL, "lse overlaps out");
  ASSERT_TRUE(lse_untouched(&kl) && att_sentinel_ok(&d));
  /* out untouched: still the poison pattern (NaN) */
  ASSERT_TRUE(isnan(((const float *)d.out.data)[0]));
  lse_buf_free(&kl);
  kva_context_destroy(ctx);
  att_free(&d);
}

/* ---- merge ---- */
/* Keys [t0, t0 + n) of a contiguous operand (a sub-view: same strides). */
static kva_kv kv_range(const kva_kv *kv, int64_t t0, int64_t n) {
  kva_kv r = *kv;
  kva_tensor *ts[3] = {&r.data, &r.scales, &r.biases};
  for (int k = 0; k < (kv->bits ? 3 : 1); ++k) {
    ts[k]->data = (char *)ts[k]->data + t0 * ts[k]->stride[2];
    ts[k]->shape[2] = n;
  }
  return r;
}

/* Attention over all N keys against the merge of R parts over contiguous key
 * ranges (cuts), each part its own call. Causal: the full call causal, parts
 * before the last with no mask (every row sees all their keys: L <= the last
 * part's length), the last part causal (its positions line up). Sinks go to
 * part 0 only. */
typedef struct merge_fix {
  att_data d;
  int R;
  kva_kv_view views[4];
  kva_kv pk[4], pv[4];
  kva_tensor o[4];
  lse_buf l[4];
  kva_tensor lse[4];
  lse_buf full_lse;
  kva_tensor full_out;
  void *mem[16]; /* outputs owned here (att_data holds few buffers) */
  int nmem;
} merge_fix;

/* A zeroed f32/f16/bf16 tensor shaped like t, owned by f. */
static kva_tensor fix_like(merge_fix *f, const kva_tensor *t) {
  size_t bytes = (size_t)(t->shape[0] * t->shape[1] * t->shape[2] * t->shape[3]) * kva_dtype_size(t->dtype);
  void *mem = f->nmem < 16 ? calloc(1, bytes) : NULL;
  if (mem) f->mem[f->nmem++] = mem;
  return kva_tensor_4d(mem, t->dtype, t->shape[0], t->shape[1], t->shape[2], t->shape[3]);
}

static int merge_fix_make(merge_fix *f, kva_context *ctx, const att_case *c, const int64_t *cuts, int R) {
  memset(f, 0, sizeof *f);
  if (att_make(&f->d, c)) return -1;
  f->R = R;
  f->full_out = fix_like(f, &f->d.out);
  if (lse_buf_make(&f->full_lse, c->B, c->H, c->L, 1)) return -1;
  if (kva_attention_lse(ctx, &f->d.q, &f->d.view, &f->d.params, &f->full_out, &f->full_lse.t, 0, NULL, 0)) return -2;
  for (int r = 0; r < R; ++r) {
    const int64_t t0 = r ? cuts[r - 1] : 0, t1 = r < R - 1 ? cuts[r] : c->N;
    f->pk[r] = kv_range(&f->d.k, t0, t1 - t0);
    f->pv[r] = kv_range(&f->d.v, t0, t1 - t0);
    f->views[r] = kva_view_contiguous(&f->pk[r], &f->pv[r], NULL);
    kva_attn_params pp = f->d.params;
    if (r < R - 1) pp.mask.kind = KVA_MASK_NONE;
    if (r > 0) pp.sinks = NULL;
    f->o[r] = fix_like(f, &f->d.out);
    if (lse_buf_make(&f->l[r], c->B, c->H, c->L, r & 1)) return -1;
    f->lse[r] = f->l[r].t;
    if (kva_attention_lse(ctx, &f->d.q, &f->views[r], &pp, &f->o[r], &f->lse[r], 0, NULL, 0)) return -2;
  }
  return 0;
}
static void merge_fix_free(merge_fix *f) {
  for (int k = 0; k < f->nmem; ++k) free(f->mem[k]);
  for (int r = 0; r < f->R; ++r) lse_buf_free(&f->l[r]);
  lse_buf_free(&f->full_lse);
  att_free(&f->d);
}

static const att_case merge_cases[] = {
    {2, 8, 4, 1, 700, 128, 128, F32, F32, 0, 0, 0, F32, MASK_NONE, 0, 0, 1, 0, 0},
    {1, 8, 2, 4, 600, 64, 64, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 1},
    {2, 4, 2, 3, 500, 128, 128, BF16, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 10.0f, 0, 0, 0},
};

TEST(merge_equals_one_call) {
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  for (size_t ci = 0; ci < sizeof merge_cases / sizeof merge_cases[0]; ++ci) {
    const att_case *c = &merge_cases[ci];
    const int64_t cuts[3] = {c->N / 3, c->N / 3 + c->L, c->N / 2 + 7}; /* parts of N/3, L (the fewest a call takes), ... keys */
    merge_fix f;
    ASSERT_TRUE(merge_fix_make(&f, ctx, c, cuts, 4) == 0);
    kva_tensor out = fix_like(&f, &f.d.out);
    lse_buf lo;
    ASSERT_TRUE(lse_buf_make(&lo, c->B, c->H, c->L, 1) == 0);
    ASSERT_OK(kva_merge_states(ctx, 4, f.o, f.lse, &out, &lo.t, 0));
    ASSERT_TRUE(att_compare(&out, &f.full_out, att_case_atol(c), att_rtol(c->odt), NULL, NULL));
    ASSERT_TRUE(lse_compare(&lo.t, &f.full_lse.t, LSE_RTOL, "merge of 4") && lse_sentinel_ok(&lo));
    /* groupings and orders: ((0 1) (2 3)), (3 1 0 2) */
    kva_tensor o01 = fix_like(&f, &f.d.out), o23 = fix_like(&f, &f.d.out);
    lse_buf l01, l23, l2;
    ASSERT_TRUE(lse_buf_make(&l01, c->B, c->H, c->L, 0) == 0 && lse_buf_make(&l23, c->B, c->H, c->L, 1) == 0 &&
                lse_buf_make(&l2, c->B, c->H, c->L, 0) == 0);
    ASSERT_OK(kva_merge_states(ctx, 2, f.o, f.lse, &o01, &l01.t, 0));
    ASSERT_OK(kva_merge_states(ctx, 2, f.o + 2, f.lse + 2, &o23, &l23.t, 0));
    kva_tensor po[2] = {o01, o23}, pl[2] = {l01.t, l23.t};
    kva_tensor out2 = fix_like(&f, &f.d.out);
    ASSERT_OK(kva_merge_states(ctx, 2, po, pl, &out2, &l2.t, 0));
    ASSERT_TRUE(att_compare(&out2, &out, att_case_atol(c), att_rtol(c->odt), NULL, NULL));
    ASSERT_TRUE(lse_compare(&l2.t, &lo.t, LSE_RTOL, "grouped"));
    kva_tensor ro[4] = {f.o[3], f.o[1], f.o[0], f.o[2]}, rl[4] = {f.lse[3], f.lse[1], f.lse[0], f.lse[2]};
    ASSERT_OK(kva_merge_states(ctx, 4, ro, rl, &out2, &l2.t, 0));
    ASSERT_TRUE(att_compare(&out2, &out, att_case_atol(c), att_rtol(c->odt), NULL, NULL));
    ASSERT_TRUE(lse_compare(&l2.t, &lo.t, LSE_RTOL, "reordered"));
    /* base 2 in and out: the same merge */
    for (int r = 0; r < 4; ++r)
      for (int64_t b = 0; b < c->B; ++b)
        for (int64_t h = 0; h < c->H; ++h)
          for (int64_t i = 0; i < c->L; ++i) lse_set(&f.lse[r], b, h, i, lse_get(&f.lse[r], b, h, i) * (float)(1 / M_LN2));
    ASSERT_OK(kva_merge_states(ctx, 4, f.o, f.lse, &out2, &l2.t, KVA_LSE_BASE2));
    ASSERT_TRUE(att_compare(&out2, &out, att_case_atol(c), att_rtol(c->odt), NULL, NULL));
    for (int64_t b = 0; b < c->B; ++b)
      for (int64_t h = 0; h < c->H; ++h)
        for (int64_t i = 0; i < c->L; ++i) lse_set(&l2.t, b, h, i, lse_get(&l2.t, b, h, i) * (float)M_LN2);
    ASSERT_TRUE(lse_compare(&l2.t, &lo.t, LSE_RTOL, "base 2"));
    lse_buf_free(&lo);
    lse_buf_free(&l01);
    lse_buf_free(&l23);
    lse_buf_free(&l2);
    merge_fix_free(&f);
  }
  kva_context_destroy(ctx);
}

/* Empty parts (-inf) are skipped: the result is bit for bit that without
 * them; all empty: zeros and -inf; in place over part 0; NaN propagates. */
TEST(merge_empty_inplace_nan) {
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  const att_case c = {1, 4, 2, 2, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_NONE, 0, 0, 0, 0, 0};
  const int64_t cuts[1] = {120};
  merge_fix f;
  ASSERT_TRUE(merge_fix_make(&f, ctx, &c, cuts, 2) == 0);
  const size_t ob = (size_t)(c.B * c.H * c.L * c.Dv) * 4;
  /* an empty part: random o (never read), lse -inf */
  kva_tensor eo = fix_like(&f, &f.d.out);
  for (size_t k = 0; k < ob / 4; ++k) ((float *)eo.data)[k] = test_randn();
  lse_buf el;
  ASSERT_TRUE(lse_buf_make(&el, c.B, c.H, c.L, 0) == 0);
  for (int64_t h = 0; h < c.H; ++h)
    for (int64_t i = 0; i < c.L; ++i) lse_set(&el.t, 0, h, i, -INFINITY);
  kva_tensor out = fix_like(&f, &f.d.out), out2 = fix_like(&f, &f.d.out);
  lse_buf l1, l2;
  ASSERT_TRUE(lse_buf_make(&l1, c.B, c.H, c.L, 0) == 0 && lse_buf_make(&l2, c.B, c.H, c.L, 0) == 0);
  ASSERT_OK(kva_merge_states(ctx, 2, f.o, f.lse, &out, &l1.t, 0));
  kva_tensor po[3] = {eo, f.o[0], f.o[1]}, pl[3] = {el.t, f.lse[0], f.lse[1]};
  ASSERT_OK(kva_merge_states(ctx, 3, po, pl, &out2, &l2.t, 0));
  ASSERT_TRUE(memcmp(out.data, out2.data, ob) == 0 && memcmp(l1.mem, l2.mem, l1.n * 4) == 0);
  /* all empty */
  kva_tensor ao[2] = {eo, eo}, al[2] = {el.t, el.t};
  ASSERT_OK(kva_merge_states(ctx, 2, ao, al, &out2, &l2.t, 0));
  for (size_t k = 0; k < ob / 4; ++k) ASSERT_TRUE(((float *)out2.data)[k] == 0.0f);
  ASSERT_TRUE(lse_get(&l2.t, 0, 1, 1) == -INFINITY && lse_get(&l2.t, 0, 3, 0) == -INFINITY);
  /* in place: out = parts_o[0], lse_out = parts_lse[0] */
  ASSERT_OK(kva_merge_states(ctx, 2, f.o, f.lse, &f.o[0], &f.lse[0], 0));
  ASSERT_TRUE(memcmp(out.data, f.o[0].data, ob) == 0);
  ASSERT_TRUE(lse_compare(&f.lse[0], &l1.t, 0.0, "in place"));
  /* NaN in one part's lse / o reaches the row */
  lse_set(&f.lse[1], 0, 2, 1, NAN);
  ((float *)f.o[1].data)[(0 * c.L + 0) * c.Dv + 5] = NAN; /* head 0, row 0, dim 5 */
  ASSERT_OK(kva_merge_states(ctx, 2, f.o, f.lse, &out2, &l2.t, 0));
  ASSERT_TRUE(isnan(lse_get(&l2.t, 0, 2, 1)) && isnan(((float *)out2.data)[(2 * c.L + 1) * c.Dv]));
  ASSERT_TRUE(isnan(((float *)out2.data)[5]) && !isnan(((float *)out2.data)[4]));
  lse_buf_free(&el);
  lse_buf_free(&l1);
  lse_buf_free(&l2);
  merge_fix_free(&f);
  kva_context_destroy(ctx);
}

TEST(merge_bad_arguments) {
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  const att_case c = {1, 4, 2, 2, 64, 64, 64, F32, F32, 0, 0, 0, F32, MASK_NONE, 0, 0, 0, 0, 0};
  att_data d;
  ASSERT_TRUE(att_make(&d, &c) == 0);
  kva_tensor o[2] = {att_alloc_like(&d, &d.out), att_alloc_like(&d, &d.out)};
  lse_buf lb[2];
  ASSERT_TRUE(lse_buf_make(&lb[0], 1, 4, 2, 0) == 0 && lse_buf_make(&lb[1], 1, 4, 2, 1) == 0);
  kva_tensor l[2] = {lb[0].t, lb[1].t};
  for (int r = 0; r < 2; ++r)
    for (int64_t h = 0; h < 4; ++h)
      for (int64_t i = 0; i < 2; ++i) lse_set(&l[r], 0, h, i, test_randn());
  att_poison(&d);
  lse_buf lo;
  ASSERT_TRUE(lse_buf_make(&lo, 1, 4, 2, 1) == 0);
  kva_tensor *out = &d.out;
  ASSERT_ERR(kva_merge_states(ctx, 0, o, l, out, &lo.t, 0), KVA_EINVAL, "R = 0");
  ASSERT_ERR(kva_merge_states(ctx, KVA_MERGE_MAX_PARTS + 1, o, l, out, &lo.t, 0), KVA_EINVAL, "R =");
  ASSERT_ERR(kva_merge_states(ctx, 2, NULL, l, out, &lo.t, 0), KVA_EINVAL, "parts_o");
  ASSERT_ERR(kva_merge_states(ctx, 2, o, NULL, out, &lo.t, 0), KVA_EINVAL, "parts_lse");
  ASSERT_ERR(kva_merge_states(ctx, 2, o, l, NULL, &lo.t, 0), KVA_EINVAL, "out");
  ASSERT_ERR(kva_merge_states(ctx, 2, o, l, out, &lo.t, 4u), KVA_EINVAL, "flags");
  kva_tensor bo[2] = {o[0], o[1]};
  bo[1].shape[3] = 32;
  ASSERT_ERR(kva_merge_states(ctx, 2, bo, l, out, &lo.t, 0), KVA_ESHAPE, "parts_o[1].shape[3]");
  kva_tensor bl[2] = {l[0], l[1]};
  bl[1].dtype = KVA_BF16;
  ASSERT_ERR(kva_merge_states(ctx, 2, o, bl, out, &lo.t, 0), KVA_EDTYPE, "parts_lse[1]");
  bl[1] = l[1];
  bl[1].shape[2] = 1;
  ASSERT_ERR(kva_merge_states(ctx, 2, o, bl, out, &lo.t, 0), KVA_ESHAPE, "parts_lse[1].shape[2]");
  kva_tensor blo = lo.t;
  blo.shape[0] = 2;
  ASSERT_ERR(kva_merge_states(ctx, 2, o, l, out, &blo, 0), KVA_ESHAPE, "lse_out");
  kva_tensor part = o[1]; /* partial overlap with a part: refused */
  part.data = (char *)o[1].data + 4;
  ASSERT_ERR(kva_merge_states(ctx, 2, o, l, &part, &lo.t, 0), KVA_EINVAL, "out overlaps parts_o[1]");
  kva_tensor lpart = l[1];
  lpart.data = (char *)l[1].data + 4;
  ASSERT_ERR(kva_merge_states(ctx, 2, o, l, out, &lpart, 0), KVA_EINVAL, "lse_out overlaps parts_lse[1]");
  ASSERT_TRUE(lse_untouched(&lo) && att_sentinel_ok(&d) && isnan(((const float *)d.out.data)[0]));
  ASSERT_OK(kva_merge_states(ctx, 2, o, l, &o[0], &lo.t, 0)); /* exactly a part: allowed (in place) */
  for (int r = 0; r < 2; ++r) lse_buf_free(&lb[r]);
  lse_buf_free(&lo);
  att_free(&d);
  kva_context_destroy(ctx);
}
