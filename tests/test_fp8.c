/* fp8 K/V (KVA_F8E4M3, KVA_F8E5M2) on the CPU backend: the host conversions
 * against PyTorch's bits (a torch-derived table, tests/fp8_cases.h) and
 * exhaustive properties of all 256 codes (round trip, ties to even,
 * saturation, NaN); attention over fp8 rows with per-(token, head), per-tensor
 * and no scales against the double-precision oracle (which decodes fp8 on its
 * own) over contiguous caches and caller pools addressed by a block table,
 * every SIMD pass, random and probe queries, NaN codes in the rows no query
 * sees, sentinels; and bad input: an error code, a message naming the
 * argument, nothing written. */
#include "attn_check.h"
#include "fp8_cases.h"

#define F32 KVA_F32
#define F16 KVA_F16
#define BF16 KVA_BF16
#define E4 KVA_F8E4M3
#define E5 KVA_F8E5M2

static float u2f(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}

typedef uint8_t (*enc_fn)(float);
typedef float (*dec_fn)(uint8_t);

TEST(fp8_conversions_match_torch) {
  for (size_t i = 0; i < sizeof fp8_torch_e4m3 / sizeof fp8_torch_e4m3[0]; ++i) {
    const float x = u2f(fp8_torch_e4m3[i].x);
    if (kva_f32_to_f8e4m3(x) != fp8_torch_e4m3[i].code) {
      FAIL_("e4m3(%a) = 0x%02x, torch 0x%02x", (double)x, kva_f32_to_f8e4m3(x), fp8_torch_e4m3[i].code);
      return;
    }
  }
  for (size_t i = 0; i < sizeof fp8_torch_e5m2 / sizeof fp8_torch_e5m2[0]; ++i) {
    const float x = u2f(fp8_torch_e5m2[i].x);
    if (kva_f32_to_f8e5m2(x) != fp8_torch_e5m2[i].code) {
      FAIL_("e5m2(%a) = 0x%02x, torch 0x%02x", (double)x, kva_f32_to_f8e5m2(x), fp8_torch_e5m2[i].code);
      return;
    }
  }
}

/* Every code: decode (against the format's fields), re-encode (the same
 * code; NaN codes give sign | 0x7f), ties between neighbours to the even
 * code, the f32 neighbours of each midpoint to the nearer code, saturation
 * past max and at inf, NaN to a NaN code of its sign. */
static void check_format(const char *nm, enc_fn enc, dec_fn dec, int M, int bias, int has_inf, float maxv,
                         uint8_t top) {
  for (int c = 0; c < 256; ++c) {
    const float x = dec((uint8_t)c);
    const int e = (c & 0x7f) >> M, m = c & ((1 << M) - 1);
    const int nan = has_inf ? e == (1 << (7 - M)) - 1 && m : (c & 0x7f) == 0x7f;
    const int inf = has_inf && e == (1 << (7 - M)) - 1 && !m;
    double want = nan ? NAN : inf ? INFINITY : e ? ldexp(m + (1 << M), e - bias - M) : ldexp(m, 1 - bias - M);
    if (c & 0x80) want = -want;
    if (nan ? !isnan(x) : (double)x != want || !!signbit(x) != !!(c & 0x80)) {
      FAIL_("%s decode 0x%02x = %a, expected %a", nm, c, (double)x, want);
      return;
    }
    const uint8_t back = enc(x);
    const uint8_t wantc = nan ? (uint8_t)((c & 0x80) | 0x7f) : inf ? (uint8_t)((c & 0x80) | top) : (uint8_t)c;
    if (back != wantc) {
      FAIL_("%s round trip 0x%02x -> %a -> 0x%02x (expected 0x%02x)", nm, c, (double)x, back, wantc);
      return;
    }
  }
  /* neighbours c, c + 1 among the positive finite codes */
  for (int c = 0; c < top; ++c) {
    const float a = dec((uint8_t)c), b = dec((uint8_t)(c + 1));
    const float mid = (float)(((double)a + b) / 2); /* exact in f32 */
    const uint8_t even = (c & 1) ? (uint8_t)(c + 1) : (uint8_t)c;
    if (enc(mid) != even || enc(-mid) != (0x80 | even)) {
      FAIL_("%s tie %a between 0x%02x and 0x%02x -> 0x%02x", nm, (double)mid, c, c + 1, enc(mid));
      return;
    }
    if (enc(nextafterf(mid, 0)) != c || enc(nextafterf(mid, INFINITY)) != c + 1) {
      FAIL_("%s neighbours of the midpoint %a -> 0x%02x, 0x%02x", nm, (double)mid, enc(nextafterf(mid, 0)),
            enc(nextafterf(mid, INFINITY)));
      return;
    }
  }
  const float big[] = {maxv * 1.01f, maxv * 2.0f, 1e30f, 3.4e38f, INFINITY};
  for (size_t i = 0; i < sizeof big / sizeof big[0]; ++i)
    if (enc(big[i]) != top || enc(-big[i]) != (0x80 | top)) {
      FAIL_("%s saturation of %g -> 0x%02x (expected 0x%02x)", nm, (double)big[i], enc(big[i]), top);
      return;
    }
  if (dec(top) != maxv) FAIL_("%s max code 0x%02x = %g, expected %g", nm, top, (double)dec(top), (double)maxv);
  if (enc(NAN) != 0x7f || enc(-NAN) != 0xff) FAIL_("%s NaN -> 0x%02x / -NaN -> 0x%02x", nm, enc(NAN), enc(-NAN));
  if (enc(-0.0f) != 0x80 || enc(0.0f) != 0) FAIL_("%s signed zeros", nm);
  /* below half the smallest subnormal: zero (ties to even at exactly half) */
  const float tiny = dec(1);
  if (enc(tiny / 2) != 0 || enc(nextafterf(tiny / 2, 1)) != 1 || enc(1e-30f) != 0)
    FAIL_("%s underflow around %a", nm, (double)(tiny / 2));
}

TEST(fp8_conversions_exhaustive) {
  check_format("e4m3", kva_f32_to_f8e4m3, kva_f8e4m3_to_f32, 3, 7, 0, 448.0f, 0x7e);
  if (test_failed_flag) return;
  check_format("e5m2", kva_f32_to_f8e5m2, kva_f8e5m2_to_f32, 2, 15, 1, 57344.0f, 0x7b);
  ASSERT_EQ(kva_dtype_size(E4), 1);
  ASSERT_EQ(kva_dtype_size(E5), 1);
  ASSERT_TRUE(!strcmp(kva_dtype_name(E4), "f8e4m3") && !strcmp(kva_dtype_name(E5), "f8e5m2"));
}

/* B, H, KVH, L, N, Dk, Dv, q, out, kbits, vbits, scales (ATT_FP8_*), K/V fp8 dtype, mask, window, softcap,
 * sinks, ragged, strided */
static const att_case cases[] = {
    /* decode, both formats, each scale kind, odd lengths */
    {1, 8, 4, 1, 1, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 4, 1, 113, 256, 256, BF16, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 4, 1, 113, 256, 256, F32, F32, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 4, 4, 1, 300, 128, 128, F16, F32, 0, 0, ATT_FP8_TENSOR, E4, MASK_NONE, 0, 0, 0, 0, 1},
    {1, 8, 2, 1, 4097, 128, 128, BF16, F32, 0, 0, ATT_FP8_TENSOR, E5, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 2, 1, 200, 64, 64, F32, F32, 0, 0, ATT_FP8_NONE, E4, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 2, 1, 200, 64, 64, F32, BF16, 0, 0, ATT_FP8_NONE, E5, MASK_CAUSAL, 0, 0, 0, 0, 1},
    /* head dims, Dk != Dv */
    {1, 4, 2, 2, 150, 80, 80, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 4, 2, 3, 150, 192, 128, F32, F32, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 2, 1, 200, 512, 512, BF16, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 1, 1, 200, 96, 96, F32, F32, 0, 0, ATT_FP8_TENSOR, E4, MASK_CAUSAL, 0, 0, 0, 0, 0},
    /* verify L = 3, 8, 16, GQA 1..6 */
    {1, 8, 4, 3, 500, 128, 128, BF16, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 4, 8, 1000, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 24, 4, 8, 300, 256, 256, BF16, F32, 0, 0, ATT_FP8_TENSOR, E5, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 8, 8, 16, 600, 128, 128, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 1},
    {1, 8, 4, 16, 40, 128, 128, BF16, F32, 0, 0, ATT_FP8_NONE, E5, MASK_CAUSAL, 0, 0, 0, 0, 0},
    /* batches with different lengths, window, segments, softcap, sinks */
    {3, 8, 4, 1, 1000, 128, 128, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 1, 0},
    {3, 8, 2, 4, 700, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 1, 1},
    {2, 8, 4, 1, 1000, 128, 128, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_WINDOW, 100, 0, 0, 1, 0},
    {1, 8, 4, 8, 700, 128, 128, F32, F32, 0, 0, ATT_FP8_TENSOR, E5, MASK_WINDOW, 5, 0, 0, 0, 0},
    {1, 8, 2, 4, 60, 64, 64, BF16, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_SEG, 0, 20.0f, 0, 0, 0},
    {1, 8, 4, 1, 500, 256, 256, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 30.0f, 1, 0, 0},
    {2, 8, 4, 3, 500, 128, 128, F32, F32, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 5.0f, 1, 1, 0},
    /* explicit masks and long L (the fallback path) */
    {2, 4, 2, 5, 200, 64, 64, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_BOOL, 0, 0, 0, 1, 0},
    {1, 4, 2, 40, 300, 64, 64, F32, F32, 0, 0, ATT_FP8_TOKEN, E5, MASK_CAUSAL, 0, 0, 0, 0, 0},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

/* One call over view against the oracle over d's contiguous cache (the same
 * tokens): sentinels, NaN exact, the kernel's allowance. */
static int run_view(kva_context *ctx, att_data *d, const kva_kv_view *view, const kva_tensor *ref, const char *what,
                    const char *name) {
  char kname[160];
  if (kva_attention_kernel(ctx, &d->q, view, &d->params, &d->out, kname, sizeof kname) < 0) {
    FAIL_("%s [%s, %s]: kva_attention_kernel: %s", name, what, att_pass_now(), kva_last_error());
    return 0;
  }
  const double atol = att_name_atol(kname);
  att_poison(d);
  if (kva_attention(ctx, &d->q, view, &d->params, &d->out, NULL, 0)) {
    FAIL_("%s [%s, %s]: kva_attention: %s", name, what, att_pass_now(), kva_last_error());
    return 0;
  }
  if (!att_out_untouched_ok(d)) {
    FAIL_("%s [%s, %s]: memory around out or between its rows overwritten", name, what, att_pass_now());
    return 0;
  }
  double max_err = 0, l2 = 0;
  if (!att_compare(&d->out, ref, atol, att_rtol(d->c.odt), &max_err, &l2)) {
    FAIL_("%s [%s, %s, %s]: out differs from the oracle (max err %.3g, allowed %.3g of max|ref|)", name, what,
          att_pass_now(), kname, max_err, atol);
    return 0;
  }
  return 1;
}

TEST(fp8_attention_cpu_vs_oracle) {
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  int ok = 1;
  for (int ci = 0; ci < NCASES && ok; ++ci) {
    const att_case *c = &cases[ci];
    if (test_quick && c->N > 1000) continue;
    for (int pr = 0; pr < ATT_PROBES && ok; ++pr) {
      att_data d;
      char cs[256], name[300];
      att_case_str(c, cs, sizeof cs);
      snprintf(name, sizeof name, "%s q=%s", cs, att_query_names[pr]);
      if (att_make_q(&d, c, pr)) {
        FAIL_("%s: could not build operands", name);
        att_free(&d);
        break;
      }
      att_table tb;
      const int64_t bs = pr ? 16 : 7;
      if (att_table_make(&tb, &d, bs, 0xff)) {
        FAIL_("%s: could not build the pools", name);
        att_free(&d);
        break;
      }
      att_plant_unseen(&d); /* NaN codes in the rows no query row sees */
      kva_tensor ref = att_alloc_like(&d, &d.out);
      if (kva_reference_attention(&d.q, &d.view, &d.params, &ref)) {
        FAIL_("%s: oracle: %s", name, kva_last_error());
        ok = 0;
      }
      for (int li = 0; li < ATT_PASSES && ok; ++li) {
        if (att_set_pass(li)) continue;
        char kname[160];
        if (pr == 0 && kva_attention_kernel(ctx, &d.q, &d.view, &d.params, &d.out, kname, sizeof kname) >= 0)
          printf("  %-8s %-44s %s\n", att_pass_name(li), kname, cs);
        /* (segment ids and array masks are [.., N] of the view's capacity: contiguous only) */
        const int seg = c->mask == MASK_SEG || c->mask == MASK_SEG_CLAMP || c->mask == MASK_BOOL || c->mask == MASK_ADD;
        ok = run_view(ctx, &d, &d.view, &ref, "contiguous", name) &&
             (seg || run_view(ctx, &d, &tb.view, &ref, "block table", name));
      }
      att_end_passes();
      att_table_free(&tb);
      att_free(&d);
    }
  }
  kva_context_destroy(ctx);
}

/* A NaN code that a query row sees makes exactly the outputs the oracle
 * says NaN (K: the row's logits; V: every row that gives it weight). */
TEST(fp8_nan_codes_seen) {
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  const att_case c = {1, 4, 2, 3, 70, 64, 64, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0};
  for (int which = 0; which < 2; ++which) {
    att_data d;
    ASSERT_TRUE(att_make(&d, &c) == 0);
    kva_kv *kv = which ? &d.v : &d.k;
    for (int hk = 0; hk < c.KVH; ++hk) /* the last key's element 5: seen by the last row only */
      *((uint8_t *)kv->data.data + hk * kv->data.stride[1] + (c.N - 1) * kv->data.stride[2] + 5) = 0xff;
    kva_tensor ref = att_alloc_like(&d, &d.out);
    ASSERT_OK(kva_reference_attention(&d.q, &d.view, &d.params, &ref));
    for (int li = 0; li < ATT_PASSES; ++li) {
      if (att_set_pass(li)) continue;
      att_poison(&d);
      ASSERT_OK(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, NULL, 0));
      double me, l2;
      if (!att_compare(&d.out, &ref, ATT_ATOL_F32, att_rtol(c.odt), &me, &l2))
        FAIL_("NaN code in %s [%s]: out differs from the oracle", which ? "V" : "K", att_pass_now());
    }
    att_end_passes();
    /* the oracle itself: rows 0, 1 see no NaN, row 2 does (K: the whole row; V: element 5) */
    const float r0 = *(const float *)((const char *)ref.data + 5 * ref.stride[3]);
    const float r2 = *(const float *)((const char *)ref.data + 2 * ref.stride[2] + 5 * ref.stride[3]);
    if (isnan(r0) || !isnan(r2)) FAIL_("oracle: NaN code of the last key: row 0 %g, row 2 %g", (double)r0, (double)r2);
    att_free(&d);
    if (test_failed_flag) break;
  }
  kva_context_destroy(ctx);
}

/* Bad fp8 operands: an error naming the argument, out untouched. */
TEST(fp8_errors) {
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  const att_case c = {2, 4, 2, 1, 40, 64, 64, F32, F32, 0, 0, ATT_FP8_TOKEN, E4, MASK_CAUSAL, 0, 0, 0, 0, 0};
  att_data d;
  ASSERT_TRUE(att_make(&d, &c) == 0);
  att_poison(&d);
  float *ks = (float *)((char *)d.k.scales.data + 1 * d.k.scales.stride[0] + 1 * d.k.scales.stride[1] +
                        17 * d.k.scales.stride[2]);
  const float keep = *ks;
  const float bad[] = {0.0f, -1.0f, -0.0f, NAN, INFINITY, -INFINITY};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    *ks = bad[i];
    ASSERT_ERR(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, NULL, 0), KVA_EINVAL, "k.scales");
    ASSERT_ERR(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, NULL, 0), KVA_EINVAL, "token 17");
    kva_tensor ref = att_alloc_like(&d, &d.out);
    ASSERT_ERR(kva_reference_attention(&d.q, &d.view, &d.params, &ref), KVA_EINVAL, "k.scales");
  }
  *ks = keep;
  /* a bad scale past the sequence's length is never read: no error */
  kva_tensor ok_out = att_alloc_like(&d, &d.out);
  int32_t lens[2] = {17, 40};
  kva_kv_view short_view = kva_view_contiguous(&d.k, &d.v, lens);
  float *vs = (float *)((char *)d.v.scales.data + 0 * d.v.scales.stride[0] + 20 * d.v.scales.stride[2]);
  const float vkeep = *vs;
  *vs = NAN;
  ASSERT_OK(kva_attention(ctx, &d.q, &short_view, &d.params, &ok_out, NULL, 0));
  ASSERT_ERR(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, NULL, 0), KVA_EINVAL, "v.scales");
  *vs = vkeep;
  /* one per-tensor scale */
  float one = -2.0f;
  kva_kv k1 = d.k;
  k1.scales = kva_tensor_4d(&one, F32, c.B, c.KVH, c.N, 1);
  for (int e = 0; e < 4; ++e) k1.scales.stride[e] = 0;
  kva_kv_view v1 = kva_view_contiguous(&k1, &d.v, NULL);
  ASSERT_ERR(kva_attention(ctx, &d.q, &v1, &d.params, &d.out, NULL, 0), KVA_EINVAL, "k.scales");
  /* scales of the wrong dtype or shape */
  kva_kv kb = d.k;
  kb.scales.dtype = BF16;
  kva_kv_view vb = kva_view_contiguous(&kb, &d.v, NULL);
  ASSERT_ERR(kva_attention(ctx, &d.q, &vb, &d.params, &d.out, NULL, 0), KVA_EDTYPE, "k.scales");
  kb = d.k;
  kb.scales.shape[3] = 2;
  vb = kva_view_contiguous(&kb, &d.v, NULL);
  ASSERT_ERR(kva_attention(ctx, &d.q, &vb, &d.params, &d.out, NULL, 0), KVA_ESHAPE, "k.scales");
  kb = d.k;
  kb.scales.shape[2] = c.N - 1;
  vb = kva_view_contiguous(&kb, &d.v, NULL);
  ASSERT_ERR(kva_attention(ctx, &d.q, &vb, &d.params, &d.out, NULL, 0), KVA_ESHAPE, "k.scales");
  kb = d.k;
  kb.scales.ndim = 3;
  vb = kva_view_contiguous(&kb, &d.v, NULL);
  ASSERT_ERR(kva_attention(ctx, &d.q, &vb, &d.params, &d.out, NULL, 0), KVA_ESHAPE, "k.scales");
  /* fp8 q or out */
  kva_tensor q8 = d.q, o8 = d.out;
  q8.dtype = E4;
  ASSERT_ERR(kva_attention(ctx, &q8, &d.view, &d.params, &d.out, NULL, 0), KVA_EDTYPE, "q");
  o8.dtype = E5;
  ASSERT_ERR(kva_attention(ctx, &d.q, &d.view, &d.params, &o8, NULL, 0), KVA_EDTYPE, "out");
  /* fp8 quantized scales are not a format: bits with fp8 data */
  kb = d.k;
  kb.bits = 4;
  kb.group_size = 64;
  vb = kva_view_contiguous(&kb, &d.v, NULL);
  ASSERT_ERR(kva_attention(ctx, &d.q, &vb, &d.params, &d.out, NULL, 0), KVA_EDTYPE, "k.data");
  /* out overlapping the scales */
  kva_kv ko = d.k;
  ko.scales.data = d.out.data;
  vb = kva_view_contiguous(&ko, &d.v, NULL);
  ASSERT_ERR(kva_attention(ctx, &d.q, &vb, &d.params, &d.out, NULL, 0), KVA_EINVAL, "overlaps");
  /* nothing written by any of the failing calls */
  const unsigned char *ob = (const unsigned char *)d.out.data;
  for (int64_t i = 0; i < 4 * (int64_t)sizeof(float); ++i)
    if (ob[i] != 0xff) {
      FAIL_("out written by a failing call (byte %lld = 0x%02x)", (long long)i, ob[i]);
      break;
    }
  if (!att_out_untouched_ok(&d)) FAIL_("a failing call wrote around out");
  att_free(&d);
  kva_context_destroy(ctx);
}
