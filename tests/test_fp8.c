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

#include <float.h>

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
    /* explicit masks (the fallback path) and long L (row groups) */
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

/* ------------------------------------------------------------ cache write */
static char *at4(const kva_tensor *t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return (char *)t->data + a * t->stride[0] + b * t->stride[1] + c * t->stride[2] + d * t->stride[3];
}
/* The spec of an fp8 pool row, written out here: scale = max |x| over the
 * finite values / max_fp8, at least FLT_MIN, 1 for 0; code = RNE saturating
 * fp8 of x / scale, NaN -> its sign's NaN code. */
static float spec_scale(const float *x, int64_t D, kva_dtype f8) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d)
    if (isfinite(x[d]) && fabsf(x[d]) > amax) amax = fabsf(x[d]);
  if (amax == 0.0f) return 1.0f;
  const float s = amax / (f8 == E4 ? 448.0f : 57344.0f);
  return s < FLT_MIN ? FLT_MIN : s;
}
static uint8_t spec_code(float x, float s, kva_dtype f8) {
  if (isnan(x)) return signbit(x) ? 0xff : 0x7f;
  return f8 == E4 ? kva_f32_to_f8e4m3(x / s) : kva_f32_to_f8e5m2(x / s);
}

/* One fp8 pool [nblk, KVH, bs, D] (rows padded by 8 bytes) and its scales:
 * ATT_FP8_TOKEN [nblk, KVH, bs, 1] (padded), ATT_FP8_TENSOR one float, or none. */
typedef struct fp8_pool {
  kva_kv kv;
  uint8_t *mem;
  float *smem;
  size_t bytes, sbytes;
} fp8_pool;
static int fp8_pool_make(fp8_pool *p, kva_dtype dt, int sk, float fixed, int64_t nblk, int64_t KVH, int64_t bs,
                         int64_t D) {
  memset(p, 0, sizeof *p);
  p->bytes = (size_t)(nblk * KVH * bs * (D + 8));
  p->mem = (uint8_t *)malloc(p->bytes);
  p->sbytes = sk == ATT_FP8_TOKEN ? (size_t)(nblk * KVH * (bs + 1)) * 4 : 4;
  p->smem = (float *)malloc(p->sbytes);
  if (!p->mem || !p->smem) return -1;
  memset(p->mem, 0x5a, p->bytes);
  memset(p->smem, 0x5a, p->sbytes);
  p->smem[0] = fixed;
  p->kv = kva_kv_fp8(p->mem, dt, sk == ATT_FP8_NONE ? NULL : p->smem, sk == ATT_FP8_TOKEN, nblk, KVH, bs, D);
  p->kv.data.stride[2] = D + 8;
  p->kv.data.stride[1] = bs * (D + 8);
  p->kv.data.stride[0] = KVH * bs * (D + 8);
  if (sk == ATT_FP8_TOKEN) {
    p->kv.scales.stride[1] = (bs + 1) * 4;
    p->kv.scales.stride[0] = KVH * (bs + 1) * 4;
  }
  return 0;
}
static void fp8_pool_free(fp8_pool *p) {
  free(p->mem);
  free(p->smem);
}

/* n tokens' rows [n, KVH, D] of dtype dt: random values of mixed amplitude,
 * with special rows: token 0 head 0 all zero, token 1 head 0 a NaN, -NaN,
 * +-inf and a value past max, token 2 head 0 f32-subnormal values (the
 * FLT_MIN clamp; f32 sources only), token 3 head 0 a single nonzero. */
static kva_tensor cw_rows(kva_dtype dt, int64_t n, int64_t KVH, int64_t D, void **mem) {
  const size_t es = kva_dtype_size(dt);
  *mem = malloc((size_t)(n * KVH * D) * es);
  kva_tensor t = kva_tensor_4d(*mem, dt, 1, n, KVH, D);
  t.ndim = 3;
  for (int d = 0; d < 3; ++d) {
    t.shape[d] = t.shape[d + 1];
    t.stride[d] = t.stride[d + 1];
  }
  if (!*mem) return t;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < KVH; ++h) {
      const float amp = ldexpf(1.0f, (int)(test_rand_u64() % 21) - 10);
      for (int64_t e = 0; e < D; ++e) {
        float x = amp * test_randn();
        if (h == 0 && i == 0) x = 0.0f;
        if (h == 0 && i == 1 && e < 5) {
          const float sp[5] = {NAN, -NAN, INFINITY, -INFINITY, 1e30f};
          x = sp[e];
        }
        if (h == 0 && i == 2 && dt == F32) x = 1e-40f * test_randn();
        if (h == 0 && i == 3) x = e == 7 ? -3.0f : 0.0f;
        test_store((char *)*mem + (size_t)((i * KVH + h) * D + e) * es, dt, x);
      }
    }
  return t;
}

/* Pools written by kva_cache_write (CPU) equal the spec bit for bit:
 * codes, per-row scales, a fixed scale left as it was, rows not named by a
 * slot untouched; K e4m3 and V e5m2 (and the reverse), every source dtype,
 * every scale kind. */
TEST(fp8_cache_write_bits) {
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  const int64_t nblk = 7, KVH = 3, bs = 8, n = 37, Dk = 128, Dv = 64;
  const kva_dtype srcs[3] = {F32, BF16, F16};
  for (int si = 0; si < 3 && !test_failed_flag; ++si)
    for (int sk = 0; sk < 3 && !test_failed_flag; ++sk)
      for (int swap = 0; swap < 2 && !test_failed_flag; ++swap) {
        const kva_dtype kdt = swap ? E5 : E4, vdt = swap ? E4 : E5;
        fp8_pool kp, vp;
        void *km, *vm;
        const float fk = 0.75f, fv = 3.0e-3f;
        if (fp8_pool_make(&kp, kdt, sk, fk, nblk, KVH, bs, Dk) || fp8_pool_make(&vp, vdt, sk, fv, nblk, KVH, bs, Dv)) {
          FAIL_("allocation");
          break;
        }
        kva_tensor k = cw_rows(srcs[si], n, KVH, Dk, &km), v = cw_rows(srcs[si], n, KVH, Dv, &vm);
        int32_t slots[37], perm[56];
        att_random_perm(perm, nblk * bs);
        for (int64_t i = 0; i < n; ++i) slots[i] = i % 9 == 4 ? -1 : perm[i];
        if (!km || !vm) FAIL_("allocation");
        else if (kva_cache_write(ctx, &kp.kv, &vp.kv, &k, &v, slots, n)) FAIL_("kva_cache_write: %s", kva_last_error());
        for (int w = 0; w < 2 && !test_failed_flag; ++w) {
          const fp8_pool *p = w ? &vp : &kp;
          const kva_tensor *src = w ? &v : &k;
          const int64_t D = w ? Dv : Dk;
          const kva_dtype f8 = p->kv.data.dtype;
          int written[56] = {0};
          for (int64_t i = 0; i < n; ++i)
            if (slots[i] >= 0) written[slots[i]] = 1;
          for (int64_t slot = 0; slot < nblk * bs && !test_failed_flag; ++slot)
            for (int64_t h = 0; h < KVH && !test_failed_flag; ++h) {
              const uint8_t *row = (const uint8_t *)at4(&p->kv.data, slot / bs, h, slot % bs, 0);
              const float *sp = p->kv.scales.data ? (const float *)at4(&p->kv.scales, slot / bs, h, slot % bs, 0) : NULL;
              int64_t tok = -1;
              for (int64_t i = 0; i < n; ++i)
                if (slots[i] == slot) tok = i;
              if (!written[slot]) {
                for (int64_t e = 0; e < D + 8; ++e)
                  if (row[e] != 0x5a) {
                    FAIL_("%s: slot %lld (no token) written", w ? "v_pool" : "k_pool", (long long)slot);
                    break;
                  }
                continue;
              }
              float x[512];
              for (int64_t e = 0; e < D; ++e)
                x[e] = test_load((const char *)src->data + tok * src->stride[0] + h * src->stride[1] +
                                     e * src->stride[2],
                                 src->dtype);
              const float s = sk == ATT_FP8_TOKEN ? spec_scale(x, D, f8) : sk == ATT_FP8_TENSOR ? (w ? fv : fk) : 1.0f;
              if (sp && memcmp(sp, &s, 4)) {
                FAIL_("%s (src %s, %s): slot %lld head %lld scale %a, spec %a", w ? "v_pool" : "k_pool",
                      kva_dtype_name(srcs[si]), kva_dtype_name(f8), (long long)slot, (long long)h, (double)*sp, (double)s);
                break;
              }
              for (int64_t e = 0; e < D; ++e)
                if (row[e] != spec_code(x[e], s, f8)) {
                  FAIL_("%s (src %s, %s, scales %d): slot %lld head %lld elem %lld: 0x%02x, spec 0x%02x (x %a, scale %a)",
                        w ? "v_pool" : "k_pool", kva_dtype_name(srcs[si]), kva_dtype_name(f8), sk, (long long)slot,
                        (long long)h, (long long)e, row[e], spec_code(x[e], s, f8), (double)x[e], (double)s);
                  break;
                }
              for (int64_t e = D; e < D + 8; ++e)
                if (row[e] != 0x5a) {
                  FAIL_("%s: padding after slot %lld written", w ? "v_pool" : "k_pool", (long long)slot);
                  break;
                }
            }
          if (sk == ATT_FP8_TENSOR && p->smem[0] != (w ? fv : fk)) FAIL_("the fixed scale was overwritten");
        }
        free(km);
        free(vm);
        fp8_pool_free(&kp);
        fp8_pool_free(&vp);
      }
  kva_context_destroy(ctx);
}

/* Bad fp8 pools: an error naming the argument, nothing written. */
TEST(fp8_cache_write_errors) {
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  fp8_pool kp, vp;
  ASSERT_TRUE(fp8_pool_make(&kp, E4, ATT_FP8_TENSOR, 0.5f, 4, 2, 8, 64) == 0);
  ASSERT_TRUE(fp8_pool_make(&vp, E5, ATT_FP8_TOKEN, 0.0f, 4, 2, 8, 64) == 0);
  void *km, *vm;
  kva_tensor k = cw_rows(F32, 5, 2, 64, &km), v = cw_rows(F32, 5, 2, 64, &vm);
  ASSERT_TRUE(km && vm);
  int32_t slots[5] = {3, 9, -1, 30, 0};
  unsigned char *kimg = (unsigned char *)malloc(kp.bytes), *vimg = (unsigned char *)malloc(vp.bytes);
  unsigned char *vsimg = (unsigned char *)malloc(vp.sbytes);
  ASSERT_TRUE(kimg && vimg && vsimg);
  memcpy(kimg, kp.mem, kp.bytes);
  memcpy(vimg, vp.mem, vp.bytes);
  memcpy(vsimg, vp.smem, vp.sbytes);
  const float bad[] = {0.0f, -0.5f, NAN, INFINITY};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
    kp.smem[0] = bad[i];
    ASSERT_ERR(kva_cache_write(ctx, &kp.kv, &vp.kv, &k, &v, slots, 5), KVA_EINVAL, "k_pool.scales");
  }
  kp.smem[0] = 0.5f;
  kva_kv kb = kp.kv;
  kb.scales.dtype = BF16;
  ASSERT_ERR(kva_cache_write(ctx, &kb, &vp.kv, &k, &v, slots, 5), KVA_EDTYPE, "k_pool.scales");
  kb = vp.kv;
  kb.scales.shape[3] = 4;
  ASSERT_ERR(kva_cache_write(ctx, &kp.kv, &kb, &k, &v, slots, 5), KVA_ESHAPE, "v_pool.scales");
  kb = vp.kv;
  kb.scales.stride[2] = 2; /* misaligned */
  ASSERT_ERR(kva_cache_write(ctx, &kp.kv, &kb, &k, &v, slots, 5), KVA_ESTRIDE, "v_pool.scales");
  kb = vp.kv;
  kb.scales.stride[1] = 4; /* written per-row scales of two heads that overlap */
  ASSERT_ERR(kva_cache_write(ctx, &kp.kv, &kb, &k, &v, slots, 5), KVA_ESTRIDE, "v_pool.scales");
  kb = vp.kv;
  kb.scales.data = (char *)km + 16; /* scales written over the input rows */
  ASSERT_ERR(kva_cache_write(ctx, &kp.kv, &kb, &k, &v, slots, 5), KVA_EINVAL, "v_pool.scales overlaps k");
  kva_tensor k8 = k;
  k8.dtype = E4; /* fp8 input rows are not a source format */
  ASSERT_ERR(kva_cache_write(ctx, &kp.kv, &vp.kv, &k8, &v, slots, 5), KVA_EDTYPE, "k");
  if (memcmp(kimg, kp.mem, kp.bytes) || memcmp(vimg, vp.mem, vp.bytes) || memcmp(vsimg, vp.smem, vp.sbytes))
    FAIL_("a failing kva_cache_write wrote into a pool");
  ASSERT_OK(kva_cache_write(ctx, &kp.kv, &vp.kv, &k, &v, slots, 5));
  free(kimg);
  free(vimg);
  free(vsimg);
  free(km);
  free(vm);
  fp8_pool_free(&kp);
  fp8_pool_free(&vp);
  kva_context_destroy(ctx);
}

/* kva_dequantize of fp8 rows: scale * code, rounded to out's dtype. */
TEST(fp8_dequantize) {
  const att_case c = {2, 4, 2, 1, 30, 64, 64, F32, F32, 0, 0, ATT_FP8_TOKEN, E5, MASK_NONE, 0, 0, 0, 0, 1};
  att_data d;
  ASSERT_TRUE(att_make(&d, &c) == 0);
  float *out = (float *)malloc(sizeof(float) * 2 * 2 * 30 * 64);
  uint16_t *ob = (uint16_t *)malloc(2 * 2 * 2 * 30 * 64);
  ASSERT_TRUE(out && ob);
  kva_tensor t = kva_tensor_4d(out, F32, 2, 2, 30, 64), tb = kva_tensor_4d(ob, BF16, 2, 2, 30, 64);
  ASSERT_OK(kva_dequantize(&d.k, &t));
  ASSERT_OK(kva_dequantize(&d.k, &tb));
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t n = 0; n < 30; ++n)
        for (int64_t e = 0; e < 64; ++e) {
          const float s = *(const float *)at4(&d.k.scales, b, h, n, 0);
          const float want = s * kva_f8e5m2_to_f32(*(const uint8_t *)at4(&d.k.data, b, h, n, e));
          const int64_t i = ((b * 2 + h) * 30 + n) * 64 + e;
          if (memcmp(&out[i], &want, 4) || ob[i] != kva_f32_to_bf16(want)) {
            FAIL_("dequantize [%lld,%lld,%lld,%lld]: %g, want %g", (long long)b, (long long)h, (long long)n,
                  (long long)e, (double)out[i], (double)want);
            goto done;
          }
        }
  *(float *)at4(&d.k.scales, 1, 0, 3, 0) = -1.0f;
  memset(out, 0x33, sizeof(float) * 2 * 2 * 30 * 64);
  ASSERT_ERR(kva_dequantize(&d.k, &t), KVA_EINVAL, "q.scales");
  for (int64_t i = 0; i < 2 * 2 * 30 * 64; ++i)
    if (((const unsigned char *)out)[4 * i] != 0x33) {
      FAIL_("a failing kva_dequantize wrote out");
      break;
    }
  t.dtype = E4;
  ASSERT_ERR(kva_dequantize(&d.k, &t), KVA_EDTYPE, "out");
done:
  free(out);
  free(ob);
  att_free(&d);
}

/* The library pool with fp8 rows (desc.dtype fp8, bits 0: one f32 scale per
 * (token, head), computed on append): kva_seq_append's rows equal
 * kva_cache_write's bit for bit (codes and scales), kva_pool_from_contiguous
 * copies an fp8 cache (per-token or one shared scale) bit for bit, and
 * attention over the paged views, forks and trims matches the oracle. */
TEST(fp8_library_pool) {
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  const int64_t KVH = 2, D = 128, T = 45;
  for (int fi = 0; fi < 2 && !test_failed_flag; ++fi) {
    const kva_dtype f8 = fi ? E5 : E4;
    kva_pool_desc desc = {.num_blocks = 20, .block_size = 16, .kv_heads = KVH, .dk = D, .dv = D, .dtype = f8};
    kva_pool *pool;
    ASSERT_OK(kva_pool_create(&pool, &desc, NULL));
    const kva_kv pk = kva_pool_k(pool), pv = kva_pool_v(pool);
    ASSERT_TRUE(pk.data.dtype == f8 && pk.scales.data && pk.scales.dtype == F32 && pk.scales.shape[3] == 1);
    /* rows [KVH, T, D] bf16 appended; the same rows [T, KVH, D] through kva_cache_write into caller pools */
    void *km, *vm;
    kva_tensor kr = cw_rows(BF16, T, KVH, D, &km), vr = cw_rows(BF16, T, KVH, D, &vm);
    ASSERT_TRUE(km && vm);
    kva_tensor ka = kr, va = vr; /* [KVH, T, D] views of the same memory */
    ka.shape[0] = KVH, ka.shape[1] = T, ka.stride[0] = kr.stride[1], ka.stride[1] = kr.stride[0];
    va.shape[0] = KVH, va.shape[1] = T, va.stride[0] = vr.stride[1], va.stride[1] = vr.stride[0];
    int32_t s;
    ASSERT_OK(kva_seq_create(pool, &s));
    ASSERT_OK(kva_seq_append(pool, s, &ka, &va));
    fp8_pool ck, cv;
    ASSERT_TRUE(fp8_pool_make(&ck, f8, ATT_FP8_TOKEN, 0, 4, KVH, 16, D) == 0);
    ASSERT_TRUE(fp8_pool_make(&cv, f8, ATT_FP8_TOKEN, 0, 4, KVH, 16, D) == 0);
    int32_t slots[45];
    for (int i = 0; i < T; ++i) slots[i] = i;
    ASSERT_OK(kva_cache_write(ctx, &ck.kv, &cv.kv, &kr, &vr, slots, T));
    kva_paged_view *pvw;
    ASSERT_OK(kva_paged_view_create(pool, &s, 1, &pvw));
    kva_paged_csr csr;
    ASSERT_OK(kva_paged_view_csr(pvw, &csr));
    for (int64_t t = 0; t < T && !test_failed_flag; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        const int32_t blk = csr.indices[t / 16];
        if (memcmp(at4(&pk.data, blk, h, t % 16, 0), at4(&ck.kv.data, t / 16, h, t % 16, 0), (size_t)D) ||
            memcmp(at4(&pv.data, blk, h, t % 16, 0), at4(&cv.kv.data, t / 16, h, t % 16, 0), (size_t)D) ||
            memcmp(at4(&pk.scales, blk, h, t % 16, 0), at4(&ck.kv.scales, t / 16, h, t % 16, 0), 4) ||
            memcmp(at4(&pv.scales, blk, h, t % 16, 0), at4(&cv.kv.scales, t / 16, h, t % 16, 0), 4)) {
          FAIL_("%s pool: token %lld head %lld differs from kva_cache_write", kva_dtype_name(f8), (long long)t,
                (long long)h);
          break;
        }
      }
    kva_paged_view_release(pvw);
    /* attention over a fork with its own tokens and a trim, against the oracle */
    int32_t child;
    ASSERT_OK(kva_seq_fork(pool, s, &child));
    kva_tensor k2 = ka, v2 = va;
    k2.shape[1] = v2.shape[1] = 7;
    ASSERT_OK(kva_seq_append(pool, child, &k2, &v2));
    ASSERT_OK(kva_seq_trim(pool, s, 30));
    int32_t seqs[2] = {s, child};
    ASSERT_OK(kva_paged_view_create(pool, seqs, 2, &pvw));
    kva_kv_view view = kva_view_paged(pvw);
    const int64_t H = 8, L = 3;
    float *q = (float *)malloc(sizeof(float) * 2 * H * L * D), *o = (float *)malloc(sizeof(float) * 2 * H * L * D),
          *r = (float *)malloc(sizeof(float) * 2 * H * L * D);
    ASSERT_TRUE(q && o && r);
    /* q / 256: the K rows' amplitudes reach 2^10 (cw_rows), so the logits
     * stay within ~12 (std 4 on the largest rows), where f32 logits round
     * within the f32 allowance (at std 1000 their rounding alone, 1000 x
     * 2^-24 in the exponent, reaches it) */
    for (int64_t i = 0; i < 2 * H * L * D; ++i) q[i] = test_randn() / 256.0f;
    kva_tensor qt = kva_tensor_4d(q, F32, 2, H, L, D), ot = kva_tensor_4d(o, F32, 2, H, L, D),
               rt = kva_tensor_4d(r, F32, 2, H, L, D);
    kva_attn_params prm = kva_attn_defaults();
    prm.mask.kind = KVA_MASK_CAUSAL;
    ASSERT_OK(kva_reference_attention(&qt, &view, &prm, &rt));
    for (int li = 0; li < ATT_PASSES; ++li) {
      if (att_set_pass(li)) continue;
      ASSERT_OK(kva_attention(ctx, &qt, &view, &prm, &ot, NULL, 0));
      double me, l2;
      if (!att_compare(&ot, &rt, ATT_ATOL_F32, att_rtol(F32), &me, &l2))
        FAIL_("%s paged view [%s]: out differs from the oracle", kva_dtype_name(f8), att_pass_now());
    }
    att_end_passes();
    kva_paged_view_release(pvw);
    free(q);
    free(o);
    free(r);
    fp8_pool_free(&ck);
    fp8_pool_free(&cv);
    free(km);
    free(vm);
    kva_pool_destroy(pool);
  }
  /* kva_pool_from_contiguous: the codes and scales (a shared scale: on every row) */
  for (int sk = 0; sk < 2 && !test_failed_flag; ++sk) {
    const att_case c = {2, 4, 2, 1, 50, 64, 64, F32, F32, 0, 0, sk ? ATT_FP8_TENSOR : ATT_FP8_TOKEN, E4,
                        MASK_CAUSAL, 0, 0, 0, 0, 1};
    att_data d;
    ASSERT_TRUE(att_make(&d, &c) == 0);
    kva_pool *pool;
    int32_t seqs[2];
    ASSERT_OK(kva_pool_from_contiguous(&pool, &d.view, 8, 1, 99, seqs));
    kva_paged_view *pvw;
    ASSERT_OK(kva_paged_view_create(pool, seqs, 2, &pvw));
    kva_paged_csr csr;
    ASSERT_OK(kva_paged_view_csr(pvw, &csr));
    const kva_kv pk = kva_pool_k(pool);
    for (int64_t b = 0; b < 2 && !test_failed_flag; ++b)
      for (int64_t t = 0; t < 50; ++t)
        for (int64_t h = 0; h < 2; ++h) {
          const int32_t blk = csr.indices[csr.indptr[b] + t / 8];
          if (memcmp(at4(&pk.data, blk, h, t % 8, 0), at4(&d.k.data, b, h, t, 0), 64) ||
              memcmp(at4(&pk.scales, blk, h, t % 8, 0), at4(&d.k.scales, b, h, t, 0), 4)) {
            FAIL_("kva_pool_from_contiguous (scales %d): [%lld, %lld, %lld] differs", sk, (long long)b, (long long)h,
                  (long long)t);
            goto next;
          }
        }
    kva_kv_view view = kva_view_paged(pvw);
    kva_tensor ref = att_alloc_like(&d, &d.out);
    ASSERT_OK(kva_reference_attention(&d.q, &d.view, &d.params, &ref));
    att_poison(&d);
    ASSERT_OK(kva_attention(ctx, &d.q, &view, &d.params, &d.out, NULL, 0));
    double me, l2;
    if (!att_out_untouched_ok(&d) || !att_compare(&d.out, &ref, ATT_ATOL_F32, att_rtol(F32), &me, &l2))
      FAIL_("paged copy of a contiguous fp8 cache (scales %d): out differs from the oracle", sk);
  next:
    kva_paged_view_release(pvw);
    kva_pool_destroy(pool);
    att_free(&d);
  }
  kva_context_destroy(ctx);
}
