/* The oracle's modelled roundings (kva_reference_attention_rounded): each
 * against the plain oracle on inputs that carry the rounding already, so
 * the two must agree bit for bit, and the parse of kernel names into
 * roundings (att_name_rounding). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn_check.h"
#include "test.h"

enum { RB = 1, RH = 4, RKVH = 2, RL = 3, RN = 37, RD = 128, RG = 64 };

static uint16_t bf16_rne(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static float bf16_val(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static int same_f32(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof *a) == 0; }

/* q int8: one element of every group is +-127 2^-6 (sigma = 2^-6, 1 / sigma
 * exact), so rint(q 64) / 64 is the rounded query exactly in f32; one group
 * too small for 1 / sigma stays as it is. */
TEST(oracle_rounding_query_int8) {
  const size_t nq = (size_t)RB * RH * RL * RD, nk = (size_t)RB * RKVH * RN * RD;
  float *q = malloc(nq * 4), *qr = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4);
  float *o1 = malloc(nq * 4), *o2 = malloc(nq * 4), *o3 = malloc(nq * 4);
  ASSERT_TRUE(q && qr && k && v && o1 && o2 && o3);
  for (size_t i = 0; i < nk; ++i) k[i] = test_randn(), v[i] = test_randn();
  for (size_t i = 0; i < nq; ++i) q[i] = test_randu(-1.9f, 1.9f);
  for (size_t g = 0; g < nq; g += RG) q[g + (g / RG) % RG] = (g / RG) % 2 ? 127.0f / 64 : -127.0f / 64;
  for (size_t i = 0; i < nq; ++i) qr[i] = rintf(q[i] * 64.0f) / 64.0f;
  /* vector 0, group 0: max |q| 2^-125, too small for 1 / sigma (it would
   * overflow to inf, and a zero element times it is NaN): left unrounded */
  for (size_t i = 0; i < RG; ++i) q[i] = qr[i] = (i == 0 ? 1.0f : i == 1 ? 0.0f : test_randu(-1.0f, 1.0f)) * 0x1p-125f;
  kva_tensor tq = kva_tensor_4d(q, KVA_F32, RB, RH, RL, RD), tqr = kva_tensor_4d(qr, KVA_F32, RB, RH, RL, RD);
  kva_tensor t1 = kva_tensor_4d(o1, KVA_F32, RB, RH, RL, RD), t2 = kva_tensor_4d(o2, KVA_F32, RB, RH, RL, RD);
  kva_tensor t3 = kva_tensor_4d(o3, KVA_F32, RB, RH, RL, RD);
  /* float K: one group per row, so use a quantized K with group 64 */
  const int64_t W = RD / 8; /* 4-bit words per row */
  uint32_t *kp = malloc((size_t)RB * RKVH * RN * W * 4);
  uint16_t *ks = malloc((size_t)RB * RKVH * RN * (RD / RG) * 2), *kb = malloc((size_t)RB * RKVH * RN * (RD / RG) * 2);
  ASSERT_TRUE(kp && ks && kb);
  for (int64_t i = 0; i < RB * RKVH * RN * W; ++i) kp[i] = (uint32_t)test_rand_u64();
  for (int64_t i = 0; i < RB * RKVH * RN * (RD / RG); ++i)
    ks[i] = bf16_rne(test_randu(0.05f, 0.3f)), kb[i] = bf16_rne(test_randu(-1.0f, 1.0f));
  const kva_kv K = kva_kv_quantized(kp, ks, kb, KVA_BF16, 4, RG, RB, RKVH, RN, RD);
  const kva_kv V = kva_kv_float(v, KVA_F32, RB, RKVH, RN, RD);
  const kva_kv_view view = kva_view_contiguous(&K, &V, NULL);
  kva_attn_params p = kva_attn_defaults();
  p.scale = 0.3f;
  const kva_ref_rounding r8 = {8, KVA_F32, KVA_F32, KVA_F32};
  ASSERT_OK(kva_reference_attention_rounded(&tq, &view, &p, &t1, NULL, 0, &r8));
  ASSERT_OK(kva_reference_attention(&tqr, &view, &p, &t2));
  ASSERT_OK(kva_reference_attention(&tq, &view, &p, &t3));
  if (!same_f32(o1, o2, nq)) FAIL_("q int8 rounding differs from the oracle on the rounded query");
  if (same_f32(o1, o3, nq)) FAIL_("q int8 rounding changed nothing");
  const kva_ref_rounding bad = {1, KVA_F32, KVA_F32, KVA_F32}, badk = {0, KVA_U32, KVA_F32, KVA_F32};
  ASSERT_ERR(kva_reference_attention_rounded(&tq, &view, &p, &t1, NULL, 0, &bad), KVA_EINVAL, "q_int_bits");
  ASSERT_ERR(kva_reference_attention_rounded(&tq, &view, &p, &t1, NULL, 0, &badk), KVA_EINVAL, "k_dtype");
  free(q), free(qr), free(k), free(v), free(o1), free(o2), free(o3), free(kp), free(ks), free(kb);
}

/* K, V bf16: f32 rows rounded, against the oracle on bf16 rows. */
TEST(oracle_rounding_kv_bf16) {
  const size_t nq = (size_t)RB * RH * RL * RD, nk = (size_t)RB * RKVH * RN * RD;
  float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), *o1 = malloc(nq * 4), *o2 = malloc(nq * 4);
  uint16_t *kh = malloc(nk * 2), *vh = malloc(nk * 2);
  ASSERT_TRUE(q && k && v && o1 && o2 && kh && vh);
  for (size_t i = 0; i < nq; ++i) q[i] = test_randn();
  for (size_t i = 0; i < nk; ++i) {
    k[i] = test_randn(), v[i] = test_randn();
    kh[i] = bf16_rne(k[i]), vh[i] = bf16_rne(v[i]);
  }
  kva_tensor tq = kva_tensor_4d(q, KVA_F32, RB, RH, RL, RD);
  kva_tensor t1 = kva_tensor_4d(o1, KVA_F32, RB, RH, RL, RD), t2 = kva_tensor_4d(o2, KVA_F32, RB, RH, RL, RD);
  const kva_kv K = kva_kv_float(k, KVA_F32, RB, RKVH, RN, RD), V = kva_kv_float(v, KVA_F32, RB, RKVH, RN, RD);
  const kva_kv Kh = kva_kv_float(kh, KVA_BF16, RB, RKVH, RN, RD), Vh = kva_kv_float(vh, KVA_BF16, RB, RKVH, RN, RD);
  const kva_kv_view view = kva_view_contiguous(&K, &V, NULL), hview = kva_view_contiguous(&Kh, &Vh, NULL);
  kva_attn_params p = kva_attn_defaults();
  const kva_ref_rounding rkv = {0, KVA_BF16, KVA_BF16, KVA_F32};
  ASSERT_OK(kva_reference_attention_rounded(&tq, &view, &p, &t1, NULL, 0, &rkv));
  ASSERT_OK(kva_reference_attention(&tq, &hview, &p, &t2));
  if (!same_f32(o1, o2, nq)) FAIL_("K,V bf16 rounding differs from the oracle on bf16 rows");
  /* one value per rounding: ties to even, and 2^-130 (bf16 subnormal) kept */
  if (bf16_val(bf16_rne(1.0f + 0x1p-8f)) != 1.0f) FAIL_("test helper: ties to even");
  free(q), free(k), free(v), free(o1), free(o2), free(kh), free(vh);
}

TEST(oracle_rounding_names) {
  kva_ref_rounding r;
  ASSERT_OK(att_name_rounding("cuda q4 warpgroup verify kernel [K,V,P bf16]", &r));
  ASSERT_TRUE(r.q_int_bits == 0 && r.k_dtype == KVA_BF16 && r.v_dtype == KVA_BF16);
  ASSERT_OK(att_name_rounding("cuda q4 per-warp kernel [q int8, P bf16]", &r));
  ASSERT_TRUE(r.q_int_bits == 8 && r.k_dtype == KVA_F32 && r.v_dtype == KVA_F32);
  ASSERT_OK(att_name_rounding("x [q int15, V,P bf16]", &r)); /* 15 bits: the allowance, not the oracle */
  ASSERT_TRUE(r.q_int_bits == 0 && r.k_dtype == KVA_F32 && r.v_dtype == KVA_BF16);
  ASSERT_OK(att_name_rounding("x [P f16]", &r));
  ASSERT_TRUE(r.q_int_bits == 0 && r.k_dtype == KVA_F32 && r.v_dtype == KVA_F32);
  ASSERT_OK(att_name_rounding("x [exact f32]", &r));
  ASSERT_TRUE(r.q_int_bits == 0 && r.k_dtype == KVA_F32 && r.v_dtype == KVA_F32);
  ASSERT_OK(att_name_rounding("cpu avx512 fused kernel [q int8, P int16]", &r)); /* P: the allowance */
  ASSERT_TRUE(r.q_int_bits == 8 && r.k_dtype == KVA_F32 && r.v_dtype == KVA_F32);
  ASSERT_TRUE(att_name_rounding("no bracket", &r) == -1);
  /* the allowances: the largest item's */
  ASSERT_TRUE(att_name_atol("x [q int8]") == ATT_ATOL_F32);
  ASSERT_TRUE(att_name_atol("x [q int8, P int16]") == ATT_ATOL_PINT16);
  ASSERT_TRUE(att_name_atol("x [P int16]") == ATT_ATOL_PINT16);
  ASSERT_TRUE(att_name_atol("x [q int8, P bf16]") == ATT_ATOL_BF16);
  ASSERT_TRUE(att_name_atol("x [q int16]") == ATT_ATOL_BF16 && att_name_atol("x [V int16]") < 0);
}
