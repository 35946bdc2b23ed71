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
    {1, 4, 2, 24, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 1, 0, 0}, /* L > 16: fallback */
};
#define NLSE (int)(sizeof lse_cases / sizeof lse_cases[0])

/* d through kva_attention_lse (view `view`) against the oracle's out and
 * lse; poisoned outputs, sentinels. */
static int lse_run(kva_context *ctx, att_data *d, const kva_kv_view *view, unsigned flags, const char *what) {
  kva_tensor ref = att_alloc_like(d, &d->out);
  lse_buf rl, kl;
  int ok = lse_buf_make(&rl, d->c.B, d->c.H, d->c.L, 0) == 0 && lse_buf_make(&kl, d->c.B, d->c.H, d->c.L, 1) == 0;
  if (ok && kva_reference_attention_lse(&d->q, view, &d->params, &ref, &rl.t, flags)) {
    fprintf(stderr, "    oracle: %s\n", kva_last_error());
    ok = 0;
  }
  att_poison(d);
  if (ok && kva_attention_lse(ctx, &d->q, view, &d->params, &d->out, &kl.t, flags, NULL, 0)) {
    fprintf(stderr, "    kva_attention_lse (%s): %s\n", what, kva_last_error());
    ok = 0;
  }
  ok = ok && att_compare(&d->out, &ref, att_case_atol(&d->c), att_rtol(d->c.odt), NULL, NULL) && att_sentinel_ok(d);
  ok = ok && lse_compare(&kl.t, &rl.t, LSE_RTOL, what) && lse_sentinel_ok(&kl);
  lse_buf_free(&rl);
  lse_buf_free(&kl);
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
  for (int ci = 0; ci < NLSE; ++ci) {
    if (test_quick && lse_cases[ci].N > 1000) continue;
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
