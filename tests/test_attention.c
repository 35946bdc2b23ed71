/* CPU attention against the double-precision oracle on an explicit case
 * table, at every SIMD level this CPU has and at 1 and 2 threads. */
#include "attn_check.h"

#define F32 KVA_F32
#define F16 KVA_F16
#define BF16 KVA_BF16

/* B, H, KVH, L, N, Dk, Dv, q, out, kbits, vbits, group, kv/scale dtype, mask, window, softcap, sinks, ragged, strided */
static const att_case cases[] = {
    /* decode, every float format, odd lengths */
    {1, 8, 4, 1, 1, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 4, 1, 17, 256, 256, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 4, 1, 113, 128, 128, F16, F16, 0, 0, 0, F16, MASK_NONE, 0, 0, 0, 0, 1},
    {1, 8, 2, 1, 4097, 64, 64, F32, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    /* quantized: every bits x group x scale dtype */
    {1, 8, 4, 1, 113, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 4, 1, 4097, 256, 256, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 6, 2, 1, 17, 128, 128, F32, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 6, 2, 1, 113, 128, 128, F32, F32, 2, 2, 128, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 1, 1, 300, 64, 64, F32, F32, 2, 2, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 1, 1, 300, 96, 96, F32, F32, 8, 8, 32, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 2, 1, 200, 512, 512, BF16, F32, 4, 8, 128, F16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 2, 1, 200, 192, 192, F32, BF16, 8, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    /* 16-bit decode over every group layout of AVX-512's rows-in-lanes K phase (one, two, four,
     * eight 128-bit lanes per group; a partial chunk) and its direct integer V */
    {1, 4, 2, 1, 301, 64, 64, BF16, F32, 4, 4, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 2, 1, 2, 77, 128, 128, F16, F32, 4, 4, 32, F16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 4, 2, 1, 300, 128, 128, BF16, F32, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 4, 1, 129, 256, 256, BF16, F32, 8, 8, 128, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 1, 1, 95, 256, 256, F16, F32, 4, 8, 128, F16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 6, 1, 1, 150, 256, 256, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 7, 1, 1, 97, 128, 128, F16, F32, 4, 4, 128, F16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 4, 1, 1, 130, 128, 128, BF16, F32, 8, 8, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    /* Dk != Dv, head dim 80 (float only: 80 is no multiple of 32) */
    {1, 4, 2, 3, 150, 192, 128, F32, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 2, 2, 150, 80, 80, F32, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 4, 2, 2, 150, 256, 512, F32, F32, 4, 4, 64, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    /* verify rows L = 8 and 16, GQA 2 and 6 */
    {1, 8, 4, 8, 4097, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 24, 4, 8, 1000, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 8, 16, 600, 128, 128, F32, F32, 8, 8, 64, F32, MASK_CAUSAL, 0, 0, 0, 0, 1},
    /* bf16 verify (AMX when present) on short caches, where one wrong key shows */
    {1, 8, 4, 8, 40, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {2, 12, 2, 8, 113, 256, 256, BF16, F32, 8, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 1},
    {1, 16, 2, 3, 90, 128, 64, BF16, F32, 0, 0, 0, BF16, MASK_WINDOW, 9, 0, 0, 0, 0},
    {1, 8, 2, 4, 60, 64, 64, BF16, F32, 0, 0, 0, F16, MASK_SEG, 0, 20.0f, 0, 0, 0},
    /* batches with different lengths */
    {3, 8, 4, 1, 1000, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
    {3, 8, 2, 4, 700, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 1},
    /* sliding window, segments, softcap, sinks */
    {2, 8, 4, 1, 1000, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_WINDOW, 100, 0, 0, 1, 0},
    {1, 8, 4, 8, 700, 128, 128, F32, F32, 0, 0, 0, F32, MASK_WINDOW, 1, 0, 0, 0, 0},
    {1, 8, 4, 8, 700, 128, 128, F32, F32, 0, 0, 0, F32, MASK_WINDOW, 5, 0, 0, 0, 0},
    {2, 4, 2, 12, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_SEG, 0, 0, 0, 1, 0},
    {1, 4, 2, 12, 300, 64, 64, F32, F32, 4, 4, 32, F32, MASK_SEG_CLAMP, 7, 0, 0, 0, 1},
    {1, 4, 2, 12, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_SEG, 9, 0, 0, 0, 0},
    {1, 8, 4, 1, 500, 256, 256, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 30.0f, 0, 0, 0},
    {2, 8, 4, 3, 500, 128, 128, F32, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 5.0f, 1, 1, 0},
    {1, 8, 2, 1, 300, 64, 64, F32, F32, 8, 8, 64, BF16, MASK_NONE, 0, 0, 1, 0, 0},
    /* AVX-512 variants with f32 outputs (the strict allowance): bf16 rows in
     * split order (D = 80: a 16-element tail; nq = 5: V through the L1 tile),
     * integer q.k (kphase_vnni) for 16-bit queries and 2/4/8-bit K */
    {1, 8, 4, 1, 4097, 256, 256, BF16, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 2, 2, 150, 80, 80, BF16, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 5, 1, 1, 300, 128, 128, F16, F32, 0, 0, 0, BF16, MASK_WINDOW, 50, 0, 0, 0, 0},
    {1, 8, 4, 1, 4097, 256, 256, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 2, 1, 500, 128, 128, F16, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 4, 2, 1, 300, 64, 64, BF16, F32, 2, 2, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 4, 1, 200, 512, 512, BF16, F32, 2, 4, 128, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    /* kphase_tok's blocks of 8, 6, 4, 2, 1 vectors at 8, 4 and 2 bits (nq 7,
     * 10, 6; partial 16-token blocks) and vphase_pint with two groups per
     * code vector (q8 g32) and one (q4 g128, q8 g64) */
    {1, 7, 1, 1, 300, 128, 128, BF16, F32, 8, 8, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 5, 1, 2, 200, 128, 128, BF16, F32, 4, 8, 64, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 6, 1, 1, 300, 256, 256, F16, F32, 2, 4, 128, F16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 5, 1, 1, 200, 256, 256, F16, F32, 4, 4, 64, BF16, MASK_WINDOW, 50, 0, 0, 0, 0},
    {1, 8, 4, 1, 500, 256, 256, BF16, F32, 4, 8, 64, BF16, MASK_CAUSAL, 0, 30.0f, 1, 0, 0},
    /* 4-bit V with >= 16 vectors (AVX-512: "V,P bf16") over groups of 128 (one
     * group per code vector; D 128: one per chunk), an odd tile, float K */
    {1, 8, 1, 2, 301, 256, 256, F16, F32, 4, 4, 128, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 16, 2, 2, 77, 128, 128, F16, F32, 8, 4, 128, F16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 8, 1, 2, 150, 128, 128, F16, F32, 0, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    /* AVX2 variants: quantized K through the dequantized L1 tile (> 4
     * vectors) with partial chunks of 8 words (q2 D 96: 6 words; q4 D 96:
     * 12) and with Dk > Dv (the tile sized for K) */
    {1, 8, 2, 4, 300, 96, 96, F32, F32, 2, 4, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 6, 1, 2, 250, 512, 128, F32, F32, 4, 8, 64, F16, MASK_CAUSAL, 0, 0, 1, 0, 0},
    /* explicit array masks (fallback) and long L (the fused kernels in row groups) */
    {2, 4, 2, 5, 200, 64, 64, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, 0, 1, 0},
    {1, 4, 2, 5, 200, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_ADD, 0, 0, 1, 0, 1},
    {1, 4, 2, 5, 200, 128, 128, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, 0, 0, 1},
    {1, 4, 2, 40, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 4, 17, 17, 128, 128, F32, F32, 4, 4, 32, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 4, 24, 700, 256, 256, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
    {2, 8, 2, 33, 500, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_WINDOW, 20, 0, 0, 1, 0},
    {1, 6, 1, 20, 400, 128, 128, F16, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 10.0f, 0, 0, 1},
    /* items of up to 256 query vectors: one group of 100 rows (200 vectors), groups of 256 and 44 rows */
    {1, 4, 2, 100, 600, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
    {2, 2, 2, 300, 700, 64, 64, F32, F32, 0, 0, 0, F32, MASK_WINDOW, 50, 0, 0, 1, 0},
    /* prefill (L = N): each row group's keys end at its last row, a window's
     * start at its first row's window (chunks past them skipped, with sinks) */
    {1, 4, 1, 700, 700, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
    {1, 8, 2, 600, 600, 64, 64, F32, F32, 0, 0, 0, F32, MASK_WINDOW, 100, 0, 0, 0, 1},
    {2, 4, 2, 500, 800, 64, 64, BF16, BF16, 8, 8, 32, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

/* The allowance of the kernel that runs (att_kernel_atol: the rounding
 * bracket of kva_attention_kernel's name; f32 products: 3e-5 of max|ref|). */
#define ATOL_REL ATT_ATOL_F32

/* Against the oracle with the kernel's modelled roundings (att_oracle_for:
 * exact, or computed into scratch). */
static int run_case(const char *name, kva_context *ctx, const char *level, att_data *d, const kva_tensor *exact,
                    kva_tensor *scratch) {
  char kname[160];
  kva_attention_kernel(ctx, &d->q, &d->view, &d->params, &d->out, kname, sizeof kname);
  const double atol = att_kernel_atol(ctx, &d->q, &d->view, &d->params, &d->out);
  const kva_tensor *ref = att_oracle_for(ctx, &d->q, &d->view, &d->params, &d->out, exact, scratch);
  if (!ref) {
    FAIL_("%s [%s]: no oracle", name, level);
    return 0;
  }
  att_poison(d);
  int rc = kva_attention(ctx, &d->q, &d->view, &d->params, &d->out, NULL, 0);
  if (rc) {
    FAIL_("%s [%s, %d threads]: kva_attention: %s", name, level, kva_context_threads(ctx), kva_last_error());
    return 0;
  }
  double max_err = 0, l2 = 0;
  if (!att_out_untouched_ok(d)) {
    FAIL_("%s [%s]: memory around out or between its rows overwritten", name, level);
    return 0;
  }
  if (!att_compare(&d->out, ref, atol, att_rtol(d->c.odt), &max_err, &l2)) {
    FAIL_("%s [%s, %d threads, %s]: out differs from the oracle (max err %.3g, allowed %.3g of max|ref|)", name,
          level, kva_context_threads(ctx), kname, max_err, atol);
    return 0;
  }
  return 1;
}

TEST(attention_cpu_vs_oracle) {
  kva_context *ctx1, *ctx2;
  kva_context_opts o = {KVA_BACKEND_CPU, 1, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx1, &o));
  o.threads = 2;
  ASSERT_OK(kva_context_create(&ctx2, &o));
  int ok = 1, eligible = 0, n_eligible = 0; /* the cases --quick keeps, sampled among themselves */
  for (int ci = 0; ci < NCASES; ++ci) n_eligible += !(test_quick && cases[ci].N > 1000);
  for (int ci = 0; ci < NCASES && ok; ++ci) {
    const att_case *c = &cases[ci];
    if (test_quick && c->N > 1000) continue;
    if (!test_case_sampled(eligible++, n_eligible)) continue;
    for (int pr = 0; pr < ATT_PROBES && ok; ++pr) {
      att_data d;
      char cs[256], name[300];
      att_case_str(c, cs, sizeof cs);
      snprintf(name, sizeof name, "%s q=%s", cs, att_query_names[pr]);
      if (att_make_q(&d, c, pr)) {
        FAIL_("%s: could not build operands", name);
        att_free(&d);
        ok = 0;
        break;
      }
      kva_tensor ref = att_alloc_like(&d, &d.out), rref = att_alloc_like(&d, &d.out);
      if (kva_reference_attention(&d.q, &d.view, &d.params, &ref)) {
        FAIL_("%s: oracle: %s", name, kva_last_error());
        att_free(&d);
        ok = 0;
        break;
      }
      char kname[160];
      int path = kva_attention_kernel(ctx1, &d.q, &d.view, &d.params, &d.out, kname, sizeof kname);
      if (pr == 0) printf("  case %2d %-8s %-36s %s\n", ci, path == KVA_PATH_FUSED ? "fused" : "fallback", kname, cs);
      for (int li = 0; li < ATT_PASSES && ok; ++li) {
        if (att_set_pass(li)) continue; /* this CPU lacks the level (said once per test) */
        ok = run_case(name, ctx1, att_pass_name(li), &d, &ref, &rref) &&
             run_case(name, ctx2, att_pass_name(li), &d, &ref, &rref);
      }
      att_end_passes();
      att_free(&d);
    }
  }
  kva_context_destroy(ctx1);
  kva_context_destroy(ctx2);
}

/* d (operands with planted values) through kva_attention against the oracle
 * (NaN/Inf exact; the allowance of the kernel that runs, att_kernel_atol;
 * the output type's rounding, att_rtol)
 * with a poisoned output and its sentinel;
 * frees d. Returns 1 when they match (0 also when a call fails: reported). */
static int planted_matches_oracle(kva_context *ctx, att_data *d) {
  kva_tensor exact = att_alloc_like(d, &d->out), rref = att_alloc_like(d, &d->out);
  int ok = kva_reference_attention(&d->q, &d->view, &d->params, &exact) == 0;
  if (!ok) fprintf(stderr, "    oracle: %s\n", kva_last_error());
  const kva_tensor *ref = ok ? att_oracle_for(ctx, &d->q, &d->view, &d->params, &d->out, &exact, &rref) : NULL;
  ok = ok && ref;
  att_poison(d);
  if (ok && kva_attention(ctx, &d->q, &d->view, &d->params, &d->out, NULL, 0) != 0) {
    fprintf(stderr, "    kva_attention: %s\n", kva_last_error());
    ok = 0;
  }
  ok = ok && att_compare(&d->out, ref, att_kernel_atol(ctx, &d->q, &d->view, &d->params, &d->out), att_rtol(d->c.odt), NULL, NULL) &&
       att_out_untouched_ok(d);
  att_free(d);
  return ok;
}

/* NaN and Inf propagate exactly as in the oracle; nothing is written beyond out. */
TEST(attention_nan_inf) {
  const att_case c = {1, 4, 2, 2, 100, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  for (int variant = 0; variant < 4; ++variant) {
    att_data d;
    ASSERT_TRUE(att_make(&d, &c) == 0);
    float *q = (float *)d.q.data, *k = (float *)d.k.data.data, *v = (float *)d.v.data.data;
    switch (variant) {
    case 0: q[3] = NAN; break;                         /* head 0, row 0: whole row NaN */
    case 1: k[(int64_t)(c.N - 1) * c.Dk + 5] = NAN; break; /* last key of KV head 0: every row sees it */
    case 2: v[7] = INFINITY; break;                    /* first key's V element 7 = +inf */
    case 3: k[(int64_t)(c.N - 1) * c.Dk] = INFINITY; k[(int64_t)(c.N - 1) * c.Dk + 1] = INFINITY; break;
    }
    const int ok = planted_matches_oracle(ctx, &d);
    if (!ok) {
      FAIL_("variant %d", variant);
      break;
    }
  }
  kva_context_destroy(ctx);
}

/* The same with 16-bit queries, bf16 or 4-bit K/V (the split-order and
 * integer-query kernels): NaN/Inf propagate as in the oracle, and queries
 * or keys of denormal size give the oracle's result (no flush to zero, or,
 * on the bf16-pair path, a flush below what the output resolves).
 * Integer queries need finite values of normal size: non-finite or
 * all-tiny queries take the float path. */
TEST(attention_nan_inf_16bit) {
  const att_case cases16[] = {
      {1, 4, 2, 1, 100, 64, 64, BF16, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {1, 4, 2, 1, 100, 64, 64, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      /* 16 vectors per KV head: V dequantized to bf16 on AVX-512 ("V,P bf16", from 16; "P int16" below) */
      {1, 4, 2, 8, 100, 64, 64, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
      /* 16 vectors over bf16 K/V: bf16 pairs on AVX-512 without AMX (denormals flushed there: a
       * denormal query's scores differ from the oracle's by less than f32 resolves after exp) */
      {1, 4, 2, 8, 100, 64, 64, BF16, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
  };
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  for (int ci = 0; ci < (int)(sizeof cases16 / sizeof cases16[0]); ++ci) {
    const att_case *c = &cases16[ci];
    for (int variant = 0; variant < 6; ++variant) {
      att_data d;
      ASSERT_TRUE(att_make(&d, c) == 0);
      char *q = (char *)d.q.data, *k = (char *)d.k.data.data, *v = (char *)d.v.data.data;
      const int64_t qrow = d.q.stride[2], krow = d.k.data.stride[2];
      switch (variant) {
      case 0: test_store(q + 3 * 2, BF16, NAN); break;   /* head 0: NaN query */
      case 1: test_store(q + 5 * 2, BF16, INFINITY); break; /* head 0: Inf query */
      case 2: /* head 0: every element denormal (integer queries not usable) */
        for (int e = 0; e < c->Dk; ++e) test_store(q + e * 2, BF16, (e % 3 - 1) * 0x1p-130f);
        break;
      case 3: /* head 1: one normal element, the others denormal */
        for (int e = 0; e < c->Dk; ++e) test_store(q + qrow + e * 2, BF16, e ? 0x1p-128f : 1.5f);
        break;
      case 4: /* last key of KV head 0: Inf (float K) or an Inf scale (4-bit K) */
        if (c->kbits) test_store((char *)d.k.scales.data + (c->N - 1) * d.k.scales.stride[2], BF16, INFINITY);
        else test_store(k + (c->N - 1) * krow + 2 * 2, BF16, INFINITY);
        break;
      case 5: /* first key's V: NaN (float V) or a NaN bias (4-bit V) */
        if (c->vbits) test_store(d.v.biases.data, BF16, NAN);
        else test_store(v + 7 * 2, BF16, NAN);
        break;
      }
      const int ok = planted_matches_oracle(ctx, &d);
      if (!ok) {
        FAIL_("case %d variant %d", ci, variant);
        break;
      }
    }
  }
  kva_context_destroy(ctx);
}

/* Each case with each of `variants` plantings (plant(d, variant)) against
 * the oracle (planted_matches_oracle) on the default context. */
static void run_planted(const att_case *cases, size_t n, void (*plant)(att_data *, int), int variants) {
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  for (size_t ci = 0; ci < n && !test_failed_flag; ++ci)
    for (int var = 0; var < variants && !test_failed_flag; ++var) {
      if (!test_case_sampled((long)(ci * (size_t)variants) + var, (long)(n * (size_t)variants))) continue;
      att_data d;
      if (att_make(&d, &cases[ci])) { FAIL_("att_make"); break; }
      plant(&d, var);
      if (!planted_matches_oracle(ctx, &d)) {
        char name[256];
        att_case_str(&cases[ci], name, sizeof name);
        FAIL_("%s (planting %d)", name, var);
      }
    }
  kva_context_destroy(ctx);
}
static void plant_unseen(att_data *d, int var) {
  (void)var;
  att_plant_unseen(d);
}
static void plant_last_v(att_data *d, int var) { att_plant_last_v(d, var ? INFINITY : NAN); }

/* Keys no query row sees (past each length, before row 0's window) hold NaN
 * (att_plant_unseen): the output matches the oracle, which never reads
 * them. Float and quantized K/V, ragged batches, windows, verify rows, the
 * AMX kernel (bf16 queries, 16 vectors per KV head), threads splitting the
 * tokens (the default context: all cores). */
TEST(attention_unseen_nan) {
  static const att_case uc[] = {
      {3, 4, 2, 1, 700, 64, 64, F32, F32, 0, 0, 0, F32, MASK_WINDOW, 100, 0, 0, 1, 0},
      {3, 8, 4, 3, 900, 128, 128, BF16, F32, 0, 0, 0, BF16, MASK_WINDOW, 150, 0, 1, 1, 0},
      {3, 8, 4, 1, 1100, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 300, 0, 0, 1, 0},
      {2, 8, 2, 4, 800, 128, 128, F32, F32, 8, 8, 32, F32, MASK_CAUSAL, 0, 0, 0, 1, 0},
      {2, 16, 2, 8, 600, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_WINDOW, 200, 0, 0, 1, 0},
      {2, 4, 4, 2, 500, 64, 64, F16, F16, 2, 2, 32, F16, MASK_WINDOW, 60, 0, 0, 1, 1},
  };
  run_planted(uc, sizeof uc / sizeof uc[0], plant_unseen, 1);
}

/* A NaN or Inf in the V row of a key that only the last query row sees
 * (the last key, causal, L > 1: a speculative token's) reaches that row
 * only, as in the oracle: the rows it is masked for skip it (0 times NaN
 * would not). Direct (<= 4 vectors) and L1-tile (> 4) V phases, float and
 * quantized rows, f32 queries, and bf16 queries (with >= 6 vectors per KV
 * head, >= 16 over 4/8-bit rows, the AMX kernel where present: weights exactly 0 for masked keys on
 * quantized V, f32 FMAs over the seen keys for a tile whose float V rows
 * hold such a value; elsewhere an Inf V scale takes the exact code form,
 * whose s c + b is the oracle's +-inf). */
TEST(attention_masked_key_nan) {
  static const att_case mc[] = {
      {2, 8, 2, 2, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 1, 0},
      {2, 8, 2, 4, 300, 128, 128, F32, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
      {2, 4, 2, 2, 300, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
      {2, 12, 2, 3, 300, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_WINDOW, 50, 0, 0, 1, 0},
      {1, 8, 2, 8, 200, 64, 64, F32, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 0, 0, 1},
      {1, 4, 4, 3, 200, 64, 64, F32, F32, 2, 2, 32, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
      {2, 8, 2, 4, 300, 128, 128, BF16, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
      {2, 16, 2, 4, 300, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
      {2, 4, 2, 2, 300, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, /* direct V, bf16 q */
      {1, 12, 2, 3, 200, 64, 128, BF16, F32, 8, 8, 32, F16, MASK_WINDOW, 40, 0, 0, 0, 1},
      {2, 8, 1, 8, 300, 256, 256, BF16, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 1, 0},
  };
  run_planted(mc, sizeof mc / sizeof mc[0], plant_last_v, 2);
}

/* Rows that see no key output zeros (exactly, with or without a sink), and
 * every other row matches the oracle: array masks all false for a few
 * (head, row) pairs (bool, and additive -inf), at every pass and both
 * thread counts; strided outputs, so the padding between rows and the
 * guards around out are checked too (att_out_untouched_ok). */
TEST(attention_row_without_keys_is_zero) {
  static const att_case ec[] = {
      {1, 2, 1, 3, 50, 64, 64, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, 1, 0, 1},
      {2, 4, 2, 5, 90, 128, 128, F32, BF16, 4, 4, 64, BF16, MASK_ADD, 0, 0, 0, 1, 1},
      {1, 8, 2, 2, 40, 64, 64, BF16, F32, 0, 0, 0, BF16, MASK_BOOL, 0, 0, 1, 0, 0},
  };
  kva_context *ctx[2];
  for (int t = 0; t < 2; ++t) {
    kva_context_opts o = {KVA_BACKEND_CPU, t + 1, 0, NULL};
    ASSERT_OK(kva_context_create(&ctx[t], &o));
  }
  for (size_t ci = 0; ci < sizeof ec / sizeof ec[0] && !test_failed_flag; ++ci) {
    const att_case *c = &ec[ci];
    att_data d;
    ASSERT_TRUE(att_make(&d, c) == 0);
    /* empty rows: (b, h, i) with (b + h + i) % 3 == 0; the array may
     * broadcast over heads (strided cases), then every head of that row */
    kva_tensor *m = &d.params.mask.array;
    const int64_t mh = m->shape[1];
    const size_t es = kva_dtype_size(m->dtype);
    int64_t nempty = 0;
    for (int64_t b = 0; b < c->B; ++b)
      for (int64_t h = 0; h < mh; ++h)
        for (int64_t i = 0; i < c->L; ++i) {
          if ((b + h + i) % 3) continue;
          char *row = (char *)m->data + b * m->stride[0] + h * m->stride[1] + i * m->stride[2];
          for (int64_t j = 0; j < c->N; ++j) {
            if (m->dtype == KVA_BOOL) row[j * m->stride[3]] = 0;
            else {
              const float x = -INFINITY;
              memcpy(row + j * m->stride[3], &x, es);
            }
          }
          ++nempty;
        }
    ASSERT_TRUE(nempty > 0);
    kva_tensor ref = att_alloc_like(&d, &d.out), rref = att_alloc_like(&d, &d.out);
    ASSERT_OK(kva_reference_attention(&d.q, &d.view, &d.params, &ref));
    for (int li = 0; li < ATT_PASSES && !test_failed_flag; ++li) {
      if (att_set_pass(li)) continue;
      for (int t = 0; t < 2 && !test_failed_flag; ++t) {
        att_poison(&d);
        const double atol = att_kernel_atol(ctx[t], &d.q, &d.view, &d.params, &d.out);
        const kva_tensor *oref = att_oracle_for(ctx[t], &d.q, &d.view, &d.params, &d.out, &ref, &rref);
        ASSERT_TRUE(oref != NULL);
        if (kva_attention(ctx[t], &d.q, &d.view, &d.params, &d.out, NULL, 0)) {
          FAIL_("case %zu [%s]: %s", ci, att_pass_now(), kva_last_error());
          break;
        }
        if (!att_out_untouched_ok(&d)) FAIL_("case %zu [%s]: memory around out or between its rows written", ci, att_pass_now());
        if (!att_compare(&d.out, oref, atol, att_rtol(c->odt), NULL, NULL))
          FAIL_("case %zu [%s, %d threads]: differs from the oracle", ci, att_pass_now(), t + 1);
        for (int64_t b = 0; b < c->B; ++b)
          for (int64_t h = 0; h < c->H; ++h)
            for (int64_t i = 0; i < c->L; ++i) {
              if ((b + (mh == 1 ? 0 : h) + i) % 3) continue;
              for (int64_t e = 0; e < c->Dv; ++e) {
                const float x =
                    test_load((const char *)d.out.data + b * d.out.stride[0] + h * d.out.stride[1] +
                                  i * d.out.stride[2] + e * d.out.stride[3],
                              c->odt);
                if (x != 0.0f) {
                  FAIL_("case %zu [%s]: row (%lld, %lld, %lld) sees no key but out[%lld] = %g", ci, att_pass_now(),
                        (long long)b, (long long)h, (long long)i, (long long)e, (double)x);
                  goto next;
                }
              }
            }
      next:;
      }
    }
    att_end_passes();
    att_free(&d);
  }
  for (int t = 0; t < 2; ++t) kva_context_destroy(ctx[t]);
}

/* Non-finite sinks. A -inf sink adds nothing: its heads' outputs equal, bit
 * for bit, those of the same call without sinks, and the call matches the
 * oracle. A +inf or NaN sink is refused on the CPU (KVA_EINVAL naming the
 * head, out untouched). Fused and general kernels at every pass. */
TEST(attention_sinks_nonfinite) {
  static const att_case sc[] = {
      {2, 8, 2, 3, 300, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},
      {1, 6, 2, 2, 200, 64, 64, BF16, F32, 0, 0, 0, BF16, MASK_WINDOW, 30, 0, 1, 0, 1},
      {1, 4, 2, 5, 120, 64, 64, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, 1, 0, 0},
  };
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  for (size_t ci = 0; ci < sizeof sc / sizeof sc[0] && !test_failed_flag; ++ci) {
    const att_case *c = &sc[ci];
    att_data d;
    ASSERT_TRUE(att_make(&d, c) == 0);
    /* head h: sink -inf (h even), finite (h odd) */
    for (int h = 0; h < c->H; h += 2) d.sinks[h] = -INFINITY;
    kva_tensor ref = att_alloc_like(&d, &d.out), nosink = att_alloc_like(&d, &d.out), rref = att_alloc_like(&d, &d.out);
    ASSERT_OK(kva_reference_attention(&d.q, &d.view, &d.params, &ref));
    kva_attn_params p0 = d.params;
    p0.sinks = NULL;
    for (int li = 0; li < ATT_PASSES && !test_failed_flag; ++li) {
      if (att_set_pass(li)) continue;
      ASSERT_OK(kva_attention(ctx, &d.q, &d.view, &p0, &nosink, NULL, 0));
      att_poison(&d);
      const double atol = att_kernel_atol(ctx, &d.q, &d.view, &d.params, &d.out);
      const kva_tensor *oref = att_oracle_for(ctx, &d.q, &d.view, &d.params, &d.out, &ref, &rref);
      ASSERT_TRUE(oref != NULL);
      ASSERT_OK(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, NULL, 0));
      if (!att_out_untouched_ok(&d)) FAIL_("case %zu [%s]: memory around out written", ci, att_pass_now());
      if (!att_compare(&d.out, oref, atol, att_rtol(c->odt), NULL, NULL))
        FAIL_("case %zu [%s]: differs from the oracle", ci, att_pass_now());
      for (int64_t b = 0; b < c->B; ++b)
        for (int64_t h = 0; h < c->H; h += 2)
          for (int64_t i = 0; i < c->L; ++i)
            for (int64_t e = 0; e < c->Dv; ++e) {
              const int64_t off = b * d.out.stride[0] + h * d.out.stride[1] + i * d.out.stride[2] + e * d.out.stride[3];
              const int64_t noff = ((b * c->H + h) * c->L + i) * c->Dv + e;
              const float x = test_load((const char *)d.out.data + off, c->odt);
              const float y = test_load((const char *)nosink.data + noff * (int64_t)kva_dtype_size(c->odt), c->odt);
              if (memcmp(&x, &y, sizeof x) != 0) {
                FAIL_("case %zu [%s]: -inf sink changed out[%lld,%lld,%lld,%lld]: %g, without sinks %g", ci,
                      att_pass_now(), (long long)b, (long long)h, (long long)i, (long long)e, (double)x, (double)y);
                goto next;
              }
            }
      /* +inf and NaN: refused, out untouched */
      for (int k = 0; k < 2 && !test_failed_flag; ++k) {
        const float saved = d.sinks[1];
        d.sinks[1] = k ? NAN : INFINITY;
        att_poison(&d);
        const int rc = kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, NULL, 0);
        if (rc != KVA_EINVAL || !strstr(kva_last_error(), "sinks[1]"))
          FAIL_("case %zu [%s]: %s sink gave %d (%s), expected KVA_EINVAL naming sinks[1]", ci, att_pass_now(),
                k ? "NaN" : "+inf", rc, kva_last_error());
        if (!att_sentinel_ok(&d) || memcmp(d.out_buf, d.out_image, d.out_bytes) != 0) FAIL_("case %zu: out written on error", ci);
        d.sinks[1] = saved;
      }
    next:;
    }
    att_end_passes();
    att_free(&d);
  }
  kva_context_destroy(ctx);
}

/* The oracle's own output rounding (src/ref/reference.c) is the library's
 * f32 -> f16 / bf16 rounding: its f16 and bf16 outputs are, bit for bit, its
 * f32 output converted by kva_f32_to_f16 / kva_f32_to_bf16 (rows of
 * magnitudes from 2^-30 to 2^10 by output column, f16 subnormals included). */
TEST(reference_output_rounding) {
  const att_case c = {1, 4, 2, 3, 60, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  att_data d;
  ASSERT_TRUE(att_make(&d, &c) == 0);
  float *v = (float *)d.v.data.data;
  for (int64_t i = 0; i < (int64_t)c.KVH * c.N * c.Dv; ++i) v[i] = ldexpf(v[i], (int)(i % c.Dv % 41) - 30);
  kva_tensor r32 = att_alloc_like(&d, &d.out);
  ASSERT_OK(kva_reference_attention(&d.q, &d.view, &d.params, &r32));
  const float *x = (const float *)r32.data;
  const int64_t n = (int64_t)c.H * c.L * c.Dv;
  for (int k = 0; k < 2; ++k) {
    const kva_dtype dt = k ? KVA_BF16 : KVA_F16;
    kva_tensor r16 = kva_tensor_4d(NULL, dt, 1, c.H, c.L, c.Dv);
    uint16_t *y = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)n);
    ASSERT_TRUE(y != NULL);
    r16.data = y;
    int64_t bad = 0, sub = 0;
    if (kva_reference_attention(&d.q, &d.view, &d.params, &r16) == 0)
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t want = k ? kva_f32_to_bf16(x[i]) : kva_f32_to_f16(x[i]);
        bad += y[i] != want;
        sub += !k && (want & 0x7c00) == 0 && (want & 0x3ff) != 0;
      }
    else
      bad = n;
    free(y);
    if (bad) FAIL_("%s: %lld of %lld oracle outputs differ from the rounded f32 output", k ? "bf16" : "f16",
                   (long long)bad, (long long)n);
    if (!k && sub == 0) FAIL_("no f16 subnormal among the outputs (the case does not test them)");
  }
  att_free(&d);
}

/* A caller workspace: exact size works, one byte less is refused. */
TEST(attention_caller_workspace) {
  const att_case c = {2, 8, 4, 2, 900, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0};
  att_data d;
  ASSERT_TRUE(att_make(&d, &c) == 0);
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  size_t bytes = 0;
  ASSERT_OK(kva_attention_workspace_size(ctx, &d.q, &d.view, &d.params, &bytes));
  ASSERT_TRUE(bytes > 0);
  void *ws = malloc(bytes);
  kva_tensor ref = att_alloc_like(&d, &d.out), rref = att_alloc_like(&d, &d.out);
  ASSERT_OK(kva_reference_attention(&d.q, &d.view, &d.params, &ref));
  const kva_tensor *oref = att_oracle_for(ctx, &d.q, &d.view, &d.params, &d.out, &ref, &rref);
  ASSERT_TRUE(oref != NULL);
  att_poison(&d);
  ASSERT_ERR(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, ws, bytes - 1), KVA_EWORKSPACE, "workspace");
  ASSERT_OK(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, ws, bytes));
  ASSERT_TRUE(att_compare(&d.out, oref, att_kernel_atol(ctx, &d.q, &d.view, &d.params, &d.out), 0, NULL, NULL));
  free(ws);
  kva_context_destroy(ctx);
  att_free(&d);
}

/* The CPU selector's AMX bar: bf16 queries over 4-bit (group 64) and 8-bit
 * (group 32) K/V with 6 to 15 query vectors per KV head never take the AMX
 * kernel (the integer kernels are faster there: amx.c, AMX_MIN_NQ_INT);
 * such calls still match the oracle. (On a host without AMX the name has
 * no AMX either way: the check bites on AMX hosts.) */
TEST(attention_amx_bar_quantized) {
  static const att_case bc[] = {
      {1, 24, 4, 1, 300, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, /* q4, 6 vectors */
      {1, 8, 4, 6, 300, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},  /* q4, 12 */
      {1, 32, 8, 3, 200, 128, 128, BF16, F32, 8, 8, 32, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},  /* q8, 12 */
  };
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  for (size_t i = 0; i < sizeof bc / sizeof bc[0]; ++i) {
    att_data d;
    ASSERT_OK(att_make(&d, &bc[i]));
    char kname[160];
    ASSERT_TRUE(kva_attention_kernel(ctx, &d.q, &d.view, &d.params, &d.out, kname, sizeof kname) >= 0);
    if (strstr(kname, "AMX")) FAIL_("case %zu: %s (6 to 15 vectors over quantized rows)", i, kname);
    ASSERT_TRUE(planted_matches_oracle(ctx, &d)); /* frees d */
  }
  kva_context_destroy(ctx);
}

/* KVA_ATTN_EXACT on the CPU: on shapes that take the AMX kernel ("[K,V,P
 * bf16]", "[P bf16]": bf16 queries, >= 6 vectors per KV head, 16 over 4/8-bit rows) or integer
 * query products ("[q int8]": 16-bit queries over quantized K, AVX-512
 * VNNI; any query at AVX2) where the host has them, every SIMD level and the general kernel
 * name "[exact f32]" and match the oracle at the f32 allowance (f32 out).
 * (On a host without AMX/VNNI this checks the contract, not the switch.) */
TEST(attention_exact_mode) {
  static const att_case ec[] = {
      {1, 8, 4, 8, 300, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},  /* q4, nq 16 */
      {2, 12, 2, 1, 257, 128, 128, BF16, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 1, 1, 1},   /* q8, nq 6, decode */
      {1, 6, 1, 2, 200, 128, 128, F16, F32, 4, 4, 64, BF16, MASK_WINDOW, 50, 0, 0, 0, 0},   /* f16 q (VNNI only) */
      {1, 8, 2, 3, 190, 128, 128, BF16, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},    /* bf16 rows, nq 12 */
      {1, 8, 4, 4, 150, 128, 128, BF16, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 20.0f, 0, 0, 1}, /* f32 rows, softcap */
  };
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  for (size_t ci = 0; ci < sizeof ec / sizeof ec[0] && !test_failed_flag; ++ci)
    for (int pr = 0; pr < ATT_PROBES && !test_failed_flag; ++pr) {
      att_data d;
      char cs[256], kname[160];
      att_case_str(&ec[ci], cs, sizeof cs);
      if (att_make_q(&d, &ec[ci], pr)) {
        FAIL_("%s: could not build operands", cs);
        att_free(&d);
        break;
      }
      kva_tensor ref = att_alloc_like(&d, &d.out);
      d.params.flags = KVA_ATTN_EXACT; /* the oracle takes it too (always exact) */
      if (kva_reference_attention(&d.q, &d.view, &d.params, &ref)) {
        FAIL_("%s: oracle: %s", cs, kva_last_error());
        att_free(&d);
        break;
      }
      for (int li = 0; li < ATT_PASSES && !test_failed_flag; ++li) {
        if (att_set_pass(li)) continue;
        if (kva_attention_kernel(ctx, &d.q, &d.view, &d.params, &d.out, kname, sizeof kname) < 0) {
          FAIL_("%s [%s]: kva_attention_kernel: %s", cs, att_pass_name(li), kva_last_error());
          break;
        }
        if (pr == 0) printf("  %-8s %-40s %s\n", att_pass_name(li), kname, cs);
        if (!att_name_exact(kname)) {
          FAIL_("%s [%s]: KVA_ATTN_EXACT runs \"%s\"", cs, att_pass_name(li), kname);
          break;
        }
        att_poison(&d);
        double max_err = 0, l2 = 0;
        if (kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, NULL, 0)) {
          FAIL_("%s [%s]: kva_attention: %s", cs, att_pass_name(li), kva_last_error());
        } else if (!att_out_untouched_ok(&d)) {
          FAIL_("%s [%s]: memory around out or between its rows overwritten", cs, att_pass_name(li));
        } else if (!att_compare(&d.out, &ref, ATT_ATOL_F32, att_rtol(d.c.odt), &max_err, &l2)) {
          FAIL_("%s [%s, %s]: out differs from the oracle (max err %.3g, allowed %.3g of max|ref|)", cs,
                att_pass_name(li), kname, max_err, ATT_ATOL_F32);
        }
      }
      att_end_passes();
      att_free(&d);
    }
  kva_context_destroy(ctx);
}
