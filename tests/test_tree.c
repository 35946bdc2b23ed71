/* KVA_MASK_TREE (tree speculative verify) on the CPU backend: every case
 * equals the same call with an explicit KVA_MASK_ARRAY bool mask built from
 * the rule (written again here: causal prefix with window / segments, the
 * bits on the last L keys), and both equal the double-precision oracle
 * within the allowance of the kernel that runs, at every SIMD level, the
 * general kernel alone, 1 and 2 threads; odd L (1, 3, 7, 17, 33, 64),
 * random trees of depth L, 1 and random (attn_check.c, MASK_TREE), B = 3
 * with different trees and lengths, windows and segments on the prefix,
 * float and 2/4/8-bit K/V, probe queries, rows without visible keys
 * (random bits), contiguous, block-table and paged views; bad input: an
 * error code, a message naming the argument, out untouched. */
#include "attn_check.h"

/* The reduced tables (those of --quick) also under AddressSanitizer, where
 * the full ones run past CI's 10-minute limit for the full binary. */
static bool tree_light(void) {
#if defined(__SANITIZE_ADDRESS__)
  return true;
#else
  return test_quick;
#endif
}

#define F32 KVA_F32
#define F16 KVA_F16
#define BF16 KVA_BF16
#define TREE MASK_TREE
#define TSEG MASK_TREE_SEG

/* B, H, KVH, L, N, Dk, Dv, q, out, kbits, vbits, group, kv/scale dtype, mask, window, softcap, sinks, ragged, strided */
static const att_case cases[] = {
    /* odd L over float caches */
    {1, 8, 4, 1, 100, 128, 128, BF16, BF16, 0, 0, 0, BF16, TREE, 0, 0, 0, 0, 0},
    {3, 8, 4, 3, 200, 128, 128, F32, F32, 0, 0, 0, F32, TREE, 0, 0, 0, 1, 0},
    {3, 8, 2, 7, 300, 64, 64, BF16, F32, 0, 0, 0, BF16, TREE, 0, 0, 1, 1, 0},
    {3, 4, 2, 17, 250, 128, 128, F32, F32, 0, 0, 0, F16, TREE, 0, 0, 0, 1, 1},
    {3, 8, 4, 33, 300, 64, 64, BF16, BF16, 0, 0, 0, BF16, TREE, 0, 0, 0, 1, 0},
    {3, 4, 1, 64, 400, 128, 128, F32, F32, 0, 0, 0, F32, TREE, 0, 0, 0, 1, 0},
    /* quantized: 4-bit (the bench's format), 8-bit, 2-bit, mixed */
    {3, 8, 4, 16, 700, 128, 128, BF16, BF16, 4, 4, 64, BF16, TREE, 0, 0, 0, 1, 0},
    {3, 8, 2, 33, 500, 256, 256, BF16, F32, 4, 4, 64, BF16, TREE, 0, 0, 0, 1, 0},
    {3, 32, 8, 64, 600, 128, 128, BF16, BF16, 4, 4, 64, BF16, TREE, 0, 0, 0, 1, 0},
    {3, 6, 2, 17, 300, 128, 128, F32, F32, 8, 8, 32, F16, TREE, 0, 0, 1, 1, 1},
    {2, 4, 2, 7, 200, 64, 64, F16, F32, 2, 4, 32, BF16, TREE, 0, 10.0f, 0, 1, 0},
    {3, 16, 2, 64, 300, 64, 64, BF16, F32, 8, 8, 64, BF16, TREE, 0, 0, 0, 1, 0},
    /* window and segments on the prefix */
    {3, 8, 4, 7, 300, 128, 128, F32, F32, 0, 0, 0, F32, TREE, 20, 0, 0, 1, 0},
    {3, 8, 4, 33, 400, 128, 128, BF16, BF16, 4, 4, 64, BF16, TREE, 5, 0, 0, 1, 0},
    {2, 8, 4, 17, 300, 64, 64, F32, F32, 0, 0, 0, F32, TREE, 1, 0, 0, 1, 1},
    {3, 4, 2, 12, 300, 64, 64, F32, F32, 0, 0, 0, F32, TSEG, 0, 0, 0, 1, 0},
    {3, 4, 2, 33, 300, 64, 64, BF16, F32, 4, 4, 32, F32, TSEG, 9, 0, 0, 1, 1},
    /* L = N: no prefix at all */
    {1, 4, 2, 17, 17, 128, 128, F32, F32, 4, 4, 32, F32, TREE, 0, 0, 0, 0, 0},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

/* One TREE call against the oracle (the kernel's modelled roundings) and
 * against the ARRAY call's output arr_out (both allowances summed). */
static int run_tree(const char *name, kva_context *ctx, att_data *d, const kva_kv_view *view, const kva_tensor *exact,
                    kva_tensor *scratch, const kva_tensor *arr_out, double arr_atol, const kva_attn_params *ap,
                    void *arr_scratch) {
  char kname[160];
  const char *lv = att_pass_now();
  if (kva_attention_kernel(ctx, &d->q, view, &d->params, &d->out, kname, sizeof kname) != KVA_PATH_FUSED) {
    FAIL_("%s [%s]: TREE does not take the fused path: %s", name, lv, kva_last_error());
    return 0;
  }
  if (strcmp(lv, "general") && strstr(kname, "general")) {
    FAIL_("%s [%s]: TREE runs \"%s\", not a fused kernel", name, lv, kname);
    return 0;
  }
  const double atol = att_kernel_atol(ctx, &d->q, view, &d->params, &d->out);
  const kva_tensor *ref = att_oracle_for(ctx, &d->q, view, &d->params, &d->out, exact, scratch);
  if (!ref || atol < 0) {
    FAIL_("%s [%s]: no oracle", name, lv);
    return 0;
  }
  att_poison(d);
  if (kva_attention(ctx, &d->q, view, &d->params, &d->out, NULL, 0)) {
    FAIL_("%s [%s, %d threads]: kva_attention(TREE): %s", name, lv, kva_context_threads(ctx), kva_last_error());
    return 0;
  }
  double err = 0;
  if (!att_out_untouched_ok(d)) {
    FAIL_("%s [%s]: memory around out or between its rows overwritten", name, lv);
    return 0;
  }
  if (!att_compare(&d->out, ref, atol, att_rtol(d->c.odt), &err, NULL)) {
    FAIL_("%s [%s, %d threads, %s]: TREE out differs from the oracle (max err %.3g, allowed %.3g of max|ref|)", name,
          lv, kva_context_threads(ctx), kname, err, atol);
    return 0;
  }
  if (!arr_out) return 1;
  kva_ref_rounding r;
  if (att_name_rounding(kname, &r)) {
    FAIL_("%s: kernel name without a rounding bracket: %s", name, kname);
    return 0;
  }
  if (r.q_int_bits || r.k_dtype != KVA_F32 || r.v_dtype != KVA_F32) {
    /* a kernel with modelled roundings: the ARRAY call's oracle with the
     * same roundings equals the TREE call's bit for bit (ref, rounded) */
    kva_tensor ra = *scratch;
    ra.data = arr_scratch;
    if (kva_reference_attention_rounded(&d->q, view, ap, &ra, NULL, 0, &r) || !att_compare(&ra, ref, 0, 0, NULL, NULL)) {
      FAIL_("%s [%s, %s]: the rounded oracles of TREE and ARRAY differ", name, lv, kname);
      return 0;
    }
  } else if (!att_compare(&d->out, arr_out, atol + arr_atol, 2 * att_rtol(d->c.odt), &err, NULL)) {
    FAIL_("%s [%s, %d threads, %s]: TREE out differs from the ARRAY call's (max err %.3g)", name, lv,
          kva_context_threads(ctx), kname, err);
    return 0;
  }
  return 1;
}

/* One case (variant 0: the trees; 1: random bits) with query variant pr. */
static int run_case(kva_context *ctx1, kva_context *ctx2, const att_case *c, int variant, int pr) {
  char cs[256], name[320];
  att_case_str(c, cs, sizeof cs);
  snprintf(name, sizeof name, "%s %s q=%s", cs, variant ? "random-bits" : "trees", att_query_names[pr]);
  att_data d;
  kva_pool *pool = NULL;
  kva_paged_view *pv = NULL;
  att_table tb;
  int have_tb = 0, ok = 0;
  int32_t *sbuf = NULL;
  kva_tensor tseg;
  if (att_make_q(&d, c, pr)) {
    FAIL_("%s: could not build operands", name);
    goto done;
  }
  if (variant) att_tree_random_bits(&d);
  kva_attn_params ap = d.params; /* the same call with the explicit mask */
  ap.mask.kind = KVA_MASK_ARRAY;
  ap.mask.window = 0;
  ap.mask.segments = (kva_tensor){0};
  ap.mask.segments_clamp = 0;
  ap.mask.array = att_tree_array(&d);
  if (!ap.mask.array.data) goto done;
  kva_tensor ref = att_alloc_like(&d, &d.out), ref_a = att_alloc_like(&d, &d.out);
  kva_tensor scratch = att_alloc_like(&d, &d.out), arr_out = att_alloc_like(&d, &d.out), ref_r = att_alloc_like(&d, &d.out);
  if (kva_reference_attention(&d.q, &d.view, &d.params, &ref) || kva_reference_attention(&d.q, &d.view, &ap, &ref_a)) {
    FAIL_("%s: oracle: %s", name, kva_last_error());
    goto done;
  }
  if (!att_compare(&ref, &ref_a, 0, 0, NULL, NULL)) {
    FAIL_("%s: the oracle's TREE and ARRAY results differ", name);
    goto done;
  }
  if (variant && c->window == 1) { /* rows without any visible key: zeros */
    for (int b = 0; b < c->B; ++b)
      for (int i = 0; i < c->L; ++i) {
        int any = 0;
        for (int j = 0; j < c->L; ++j) any |= att_tree_bit(&d.params.mask.array, b, i, j);
        for (int h = 0; h < c->H && !any; ++h)
          for (int e = 0; e < c->Dv; ++e)
            if (test_load((const char *)ref.data + b * ref.stride[0] + h * ref.stride[1] + i * ref.stride[2] +
                              e * ref.stride[3],
                          ref.dtype) != 0.0f) {
              FAIL_("%s: row %d of sequence %d sees no key but is not zero in the oracle", name, i, b);
              goto done;
            }
      }
  }
  ok = 1;
  for (int li = tree_light() ? 2 : 0; li < (tree_light() ? 3 : ATT_PASSES) && ok; ++li) {
    if (test_quick ? kva_cpu_set_simd(NULL) : att_set_pass(li)) continue;
    for (int ti = tree_light() ? 1 : 0; ti < 2 && ok; ++ti) {
      kva_context *ctx = ti ? ctx2 : ctx1;
      const double aatol = att_kernel_atol(ctx, &d.q, &d.view, &ap, &arr_out);
      if (kva_attention(ctx, &d.q, &d.view, &ap, &arr_out, NULL, 0) ||
          !att_compare(&arr_out, &ref_a, aatol, att_rtol(c->odt), NULL, NULL)) {
        FAIL_("%s [%s]: the ARRAY call: %s", name, att_pass_now(), kva_last_error());
        ok = 0;
        break;
      }
      ok = run_tree(name, ctx, &d, &d.view, &ref, &scratch, &arr_out, aatol, &ap, ref_r.data);
    }
  }
  att_end_passes();
  if (!ok) goto done;
  /* block table (caller pools, odd block size, NaN-filled padding, random
   * first offsets) and a scattered library pool, at the best level */
  ok = 0;
  if (att_table_make(&tb, &d, c->L % 2 ? 7 : 16, 0xff)) {
    FAIL_("%s: block table", name);
    goto done;
  }
  have_tb = 1;
  if (d.params.mask.segments.data) { /* segments over the table's capacity N (ids past the cache: 0) */
    const int64_t nt = tb.t.max_blocks * tb.bs;
    const kva_tensor *sg = &d.params.mask.segments;
    sbuf = (int32_t *)calloc((size_t)(c->B * nt), sizeof(int32_t));
    if (!sbuf) goto done;
    for (int b = 0; b < c->B; ++b)
      for (int64_t t = 0; t < c->N; ++t) memcpy(sbuf + b * nt + t, (const char *)sg->data + b * sg->stride[0] + t * 4, 4);
    tseg = *sg;
    d.params.mask.segments = kva_tensor_2d(sbuf, KVA_I32, c->B, nt);
  }
  const int tok = run_tree(name, ctx2, &d, &tb.view, &ref, &scratch, NULL, 0, NULL, NULL);
  if (sbuf) d.params.mask.segments = tseg;
  if (!tok) goto done;
  if (c->kbits == c->vbits) { /* a library pool holds one format */
    int32_t seqs[8];
    if (kva_pool_from_contiguous(&pool, &d.view, 16, 1, 0x7ee + (uint64_t)c->L, seqs) ||
        kva_paged_view_create(pool, seqs, c->B, &pv)) {
      FAIL_("%s: pool: %s", name, kva_last_error());
      goto done;
    }
    const kva_kv_view pview = kva_view_paged(pv);
    if (!run_tree(name, ctx2, &d, &pview, &ref, &scratch, NULL, 0, NULL, NULL)) goto done;
  }
  ok = 1;
done:
  if (have_tb) att_table_free(&tb);
  kva_paged_view_release(pv);
  kva_pool_destroy(pool);
  free(sbuf);
  att_free(&d);
  return ok;
}

TEST(tree_cpu_vs_array_and_oracle) {
  kva_context *ctx1, *ctx2;
  kva_context_opts o = {KVA_BACKEND_CPU, 1, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx1, &o));
  o.threads = 2;
  ASSERT_OK(kva_context_create(&ctx2, &o));
  int n_eligible = 0; /* the cases a light run keeps, sampled among themselves */
  for (int ci = 0; ci < NCASES; ++ci) n_eligible += !(tree_light() && cases[ci].N > 400);
  for (int ci = 0, eligible = 0; ci < NCASES; ++ci) {
    const att_case *c = &cases[ci];
    if (tree_light() && c->N > 400) continue;
    if (!test_case_sampled(eligible++, n_eligible)) continue;
    char cs[256];
    att_case_str(c, cs, sizeof cs);
    printf("  case %2d %s\n", ci, cs);
    fflush(stdout);
    int ok = 1;
    for (int v = 0; v < 2 && ok; ++v)
      for (int pr = 0; pr < ATT_PROBES && ok; ++pr) ok = run_case(ctx1, ctx2, c, v, pr);
    if (!ok) break;
  }
  kva_context_destroy(ctx1);
  kva_context_destroy(ctx2);
}

/* Trees of every depth 1..L at L = 33 over one short cache: each depth
 * against the oracle (and the ARRAY call), best level, 2 threads. */
TEST(tree_cpu_every_depth) {
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  const att_case c = {1, 8, 4, 33, 120, 64, 64, BF16, F32, 4, 4, 32, BF16, TREE, 0, 0, 0, 0, 0};
  for (int depth = 1; depth <= c.L && !test_failed_flag; ++depth) {
    att_data d;
    ASSERT_TRUE(att_make_q(&d, &c, depth % 2) == 0);
    int parent[KVA_TREE_MAX_ROWS];
    att_random_tree(c.L, depth, parent);
    int deepest = 0;
    for (int j = 0; j < c.L; ++j) {
      int k = 0;
      for (int a = j; a >= 0; a = parent[a]) ++k;
      if (k > deepest) deepest = k;
      if (parent[j] >= j) FAIL_("depth %d: parent[%d] = %d is not among 0..%d", depth, j, parent[j], j - 1);
    }
    if (deepest != depth) FAIL_("att_random_tree(depth %d) made a tree of depth %d", depth, deepest);
    att_tree_bits(c.L, parent, (uint32_t *)d.params.mask.array.data, d.params.mask.array.stride[1] / 4);
    char name[64];
    snprintf(name, sizeof name, "L33 tree of depth %d", depth);
    kva_tensor ref = att_alloc_like(&d, &d.out), scratch = att_alloc_like(&d, &d.out);
    if (kva_reference_attention(&d.q, &d.view, &d.params, &ref)) FAIL_("%s: oracle: %s", name, kva_last_error());
    else run_tree(name, ctx, &d, &d.view, &ref, &scratch, NULL, 0, NULL, NULL);
    att_free(&d);
  }
  kva_context_destroy(ctx);
}

/* A TREE over L = 1 with its bit set is the causal decode; a chain tree
 * (depth L) is the causal verify: equal to the CAUSAL call within the two
 * kernels' allowances (the same kernel family runs both). */
TEST(tree_cpu_chain_is_causal) {
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  static const att_case cs[] = {
      {2, 8, 4, 1, 300, 128, 128, BF16, F32, 4, 4, 64, BF16, TREE, 0, 0, 0, 1, 0},
      {2, 8, 4, 8, 300, 128, 128, BF16, F32, 4, 4, 64, BF16, TREE, 30, 0, 0, 1, 0},
      {1, 4, 2, 16, 300, 64, 64, F32, F32, 0, 0, 0, F32, TREE, 0, 0, 1, 0, 0},
  };
  for (size_t ci = 0; ci < sizeof cs / sizeof cs[0] && !test_failed_flag; ++ci) {
    att_data d;
    ASSERT_TRUE(att_make_q(&d, &cs[ci], 0) == 0);
    int parent[KVA_TREE_MAX_ROWS];
    att_random_tree(cs[ci].L, cs[ci].L, parent);
    for (int b = 0; b < cs[ci].B; ++b)
      att_tree_bits(cs[ci].L, parent, (uint32_t *)((char *)d.params.mask.array.data + b * d.params.mask.array.stride[0]),
                    d.params.mask.array.stride[1] / 4);
    kva_attn_params cp = d.params;
    cp.mask.kind = KVA_MASK_CAUSAL;
    cp.mask.array = (kva_tensor){0};
    kva_tensor causal = att_alloc_like(&d, &d.out);
    const double a1 = att_kernel_atol(ctx, &d.q, &d.view, &d.params, &d.out);
    const double a2 = att_kernel_atol(ctx, &d.q, &d.view, &cp, &causal);
    ASSERT_OK(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, NULL, 0));
    ASSERT_OK(kva_attention(ctx, &d.q, &d.view, &cp, &causal, NULL, 0));
    double err = 0;
    if (!att_compare(&d.out, &causal, a1 + a2, 2 * att_rtol(cs[ci].odt), &err, NULL))
      FAIL_("case %zu: a chain TREE differs from CAUSAL (max err %.3g)", ci, err);
    att_free(&d);
  }
  kva_context_destroy(ctx);
}

/* Bad tree masks: an error code, a message naming the argument, and out
 * (its elements and the bytes around them) untouched. */
TEST(tree_bad_input) {
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  const att_case c = {3, 4, 2, 7, 50, 64, 64, F32, F32, 0, 0, 0, F32, TREE, 0, 0, 0, 1, 0};
  att_data d;
  ASSERT_TRUE(att_make(&d, &c) == 0);
  const kva_tensor good = d.params.mask.array;
  uint32_t big[3 * 70 * 3];
  memset(big, 0, sizeof big);
  struct {
    const char *what;
    int code;
    const char *needle;
  } bad[] = {
      {"i32 bits", KVA_EDTYPE, "mask.array"},     {"rank 2", KVA_ESHAPE, "mask.array"},
      {"L - 1 rows", KVA_ESHAPE, "mask.array"},    {"W + 1 words", KVA_ESHAPE, "mask.array"},
      {"batch 2 of 3", KVA_ESHAPE, "mask.array"},  {"bit 7 of L = 7", KVA_EINVAL, "mask.array (tree bits)[1][4]"},
      {"bit 31 of L = 7", KVA_EINVAL, "[2][0]"},   {"NULL bits", KVA_EINVAL, "mask.array"},
      {"innermost stride 8", KVA_ESTRIDE, "mask.array"},
  };
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; ++k) {
    kva_attn_params p = d.params;
    kva_tensor *a = &p.mask.array;
    uint32_t *rowbits = (uint32_t *)good.data;
    switch (k) {
    case 0: a->dtype = KVA_I32; break;
    case 1: a->ndim = 2; a->shape[0] = 7; a->shape[1] = 1; a->stride[0] = 4; a->stride[1] = 4; break;
    case 2: a->shape[1] = 6; break;
    case 3: a->shape[2] = 2; a->stride[1] = 8; a->stride[0] = 56; break;
    case 4: a->shape[0] = 2; break;
    case 5: rowbits[1 * 7 + 4] |= 1u << 7; break;
    case 6: rowbits[2 * 7 + 0] |= 1u << 31; break;
    case 7: a->data = NULL; break;
    case 8: a->stride[2] = 8; break;
    }
    att_poison(&d);
    const int rc = kva_attention(ctx, &d.q, &d.view, &p, &d.out, NULL, 0);
    if (rc != bad[k].code || !strstr(kva_last_error(), bad[k].needle))
      FAIL_("%s: rc %d (want %d), message \"%s\" (want \"%s\")", bad[k].what, rc, bad[k].code, kva_last_error(),
            bad[k].needle);
    if (memcmp(d.out_buf, d.out_image, d.out_bytes) || !att_sentinel_ok(&d))
      FAIL_("%s: out was written by a failing call", bad[k].what);
    if (k == 5) rowbits[1 * 7 + 4] &= ~(1u << 7);
    if (k == 6) rowbits[2 * 7 + 0] &= ~(1u << 31);
  }
  /* L = 65 > KVA_TREE_MAX_ROWS: KVA_EUNSUPPORTED */
  const att_case c65 = {1, 2, 1, 64, 100, 64, 64, F32, F32, 0, 0, 0, F32, TREE, 0, 0, 0, 0, 0};
  att_data d65;
  ASSERT_TRUE(att_make(&d65, &c65) == 0);
  float qbuf[2 * 65 * 64], obuf[2 * 65 * 64];
  for (size_t i = 0; i < sizeof qbuf / sizeof qbuf[0]; ++i) qbuf[i] = test_randn(), obuf[i] = 7.0f;
  kva_tensor q65 = kva_tensor_4d(qbuf, KVA_F32, 1, 2, 65, 64), o65 = kva_tensor_4d(obuf, KVA_F32, 1, 2, 65, 64);
  kva_attn_params p65 = d65.params;
  p65.mask.array.data = big;
  p65.mask.array.shape[1] = 65;
  p65.mask.array.shape[2] = 3;
  p65.mask.array.stride[1] = 12;
  p65.mask.array.stride[0] = 65 * 12;
  ASSERT_ERR(kva_attention(ctx, &q65, &d65.view, &p65, &o65, NULL, 0), KVA_EUNSUPPORTED, "L = 65");
  for (size_t i = 0; i < sizeof obuf / sizeof obuf[0]; ++i)
    if (obuf[i] != 7.0f) {
      FAIL_("L = 65: out written at %zu", i);
      break;
    }
  /* the oracle refuses the same */
  ASSERT_ERR(kva_reference_attention(&q65, &d65.view, &p65, &o65), KVA_EUNSUPPORTED, "KVA_MASK_TREE");
  /* window / segments are taken with TREE; the bits with other kinds are not */
  kva_attn_params pc = d.params;
  pc.mask.kind = KVA_MASK_CAUSAL;
  ASSERT_ERR(kva_attention(ctx, &d.q, &d.view, &pc, &d.out, NULL, 0), KVA_EINVAL, "mask.array");
  att_free(&d65);
  att_free(&d);
  kva_context_destroy(ctx);
}
