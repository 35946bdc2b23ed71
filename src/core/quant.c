/* Math: per group s, b from min/max (MLX's CPU rule), q = clamp(rint((w-b)/s), 0, 2^bits-1).
 * Traffic: quantize reads D values/row, writes D*bits/8 bytes + 2 params/group; dequant reverses.
 * Loops: rows (leading dims, any strides) -> groups (independent, f32) -> u32 words, low first. */
#include "internal.h"
#include "quant.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* Dequantize must not fuse s*q + b into an fma (MLX rounds the product).
 * GCC does not contract in ISO C mode (-std=c11, as the Makefile builds). */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#define KVA_QMAX_GROUP 128

/* ---- shared validation ---- */

static int check_format(const kva_kv *kv, const char *name) {
  if (kv->bits != 2 && kv->bits != 4 && kv->bits != 8)
    return kva_seterr(KVA_EUNSUPPORTED, "%s.bits = %d (supported: 2, 4, 8)", name, kv->bits);
  if (kv->group_size != 32 && kv->group_size != 64 && kv->group_size != 128)
    return kva_seterr(KVA_EUNSUPPORTED, "%s.group_size = %d (supported: 32, 64, 128)", name,
                      kv->group_size);
  return 0;
}

/* t must have the leading dims of `shape` (rank ndim) and last dim `last`. */
static int check_shape(const kva_tensor *t, const char *name, const int64_t *shape, int ndim,
                       const char *ref, int64_t last) {
  for (int d = 0; d < ndim - 1; ++d)
    if (t->shape[d] != shape[d])
      return kva_seterr(KVA_ESHAPE, "%s.shape[%d] = %lld != %s.shape[%d] = %lld", name, d,
                        (long long)t->shape[d], ref, d, (long long)shape[d]);
  if (t->shape[ndim - 1] != last)
    return kva_seterr(KVA_ESHAPE, "%s.shape[%d] = %lld, expected %lld", name, ndim - 1,
                      (long long)t->shape[ndim - 1], (long long)last);
  return 0;
}

/* Packed data, scales and biases of a quantized operand of logical shape
 * `shape` (rank ndim, last dim D); data itself already checked when
 * data_checked. */
static int check_parts(const kva_kv *kv, const char *name, const int64_t *shape, int ndim,
                       const char *ref, bool data_checked) {
  char nm[3][64];
  snprintf(nm[0], sizeof nm[0], "%s.data", name);
  snprintf(nm[1], sizeof nm[1], "%s.scales", name);
  snprintf(nm[2], sizeof nm[2], "%s.biases", name);
  int64_t D = shape[ndim - 1];
  int rc;
  if (!data_checked) {
    rc = kva_check_tensor(&kv->data, nm[0], KVA_DT(KVA_U32), ndim, false);
    if (rc) return rc;
    rc = check_shape(&kv->data, nm[0], shape, ndim, ref, kva_packed_words(D, kv->bits));
    if (rc) return rc;
  }
  rc = kva_check_tensor(&kv->scales, nm[1], KVA_DT_FLOAT, ndim, false);
  if (rc) return rc;
  rc = check_shape(&kv->scales, nm[1], shape, ndim, ref, D / kv->group_size);
  if (rc) return rc;
  rc = kva_check_tensor(&kv->biases, nm[2], KVA_DT_FLOAT, ndim, false);
  if (rc) return rc;
  rc = check_shape(&kv->biases, nm[2], shape, ndim, ref, D / kv->group_size);
  if (rc) return rc;
  if (kv->scales.dtype != kv->biases.dtype)
    return kva_seterr(KVA_EDTYPE, "%s: dtype %s differs from %s dtype %s", nm[2],
                      kva_dtype_name(kv->biases.dtype), nm[1], kva_dtype_name(kv->scales.dtype));
  return 0;
}

static int check_apart(const kva_tensor *a, const char *an, const kva_tensor *b, const char *bn) {
  if (kva_tensors_overlap(a, b)) return kva_seterr(KVA_EINVAL, "%s overlaps %s", an, bn);
  return 0;
}

/* Leading (row) dims of a rank 1..4 tensor, right-aligned into 3 slots. */
static void lead_dims(const kva_tensor *t, int64_t n[3], int64_t st[3]) {
  int nl = t->ndim - 1, off = 3 - nl;
  for (int d = 0; d < 3; ++d) { n[d] = 1; st[d] = 0; }
  for (int d = 0; d < nl; ++d) {
    n[off + d] = t->shape[d];
    st[off + d] = t->stride[d];
  }
}

static inline char *row_ptr(const kva_tensor *t, const int64_t st[3], int64_t a, int64_t b,
                            int64_t c) {
  return (char *)t->data + a * st[0] + b * st[1] + c * st[2];
}

/* ---- quantize ---- */

static void load_row(const void *src, kva_dtype dt, int64_t n, float *dst) {
  switch (dt) {
  case KVA_F32: memcpy(dst, src, (size_t)n * sizeof(float)); break;
  case KVA_F16:
    for (int64_t i = 0; i < n; ++i) dst[i] = kva_f16_to_f32(((const uint16_t *)src)[i]);
    break;
  case KVA_BF16:
    for (int64_t i = 0; i < n; ++i) dst[i] = kva_bf16_to_f32(((const uint16_t *)src)[i]);
    break;
  default: break;
  }
}

/* One group of gs values: the operations of MLX's CPU `quantize`
 * (mlx/backend/cpu/quantized.cpp) in its order, all in f32. Its std::max(a, b)
 * is (a < b ? b : a) and std::min(a, b) is (b < a ? b : a), written out here:
 * NaN elements take no part in min/max, a NaN range leaves the scale NaN, and a
 * NaN code passes the clamp and is stored as 0 (MLX casts it to an integer,
 * undefined in C++; 0 is what its arm64 and x86-64 builds give).
 * src/cuda/cache_write.cu repeats these operations on the device, in this
 * order and rounding: a change here must be made there too. */
static void quantize_group(const float *w, int gs, int bits, float *scale_out, float *bias_out,
                           uint32_t *words) {
  const float n_bins = (float)((1 << bits) - 1);
  const float eps = (float)1e-7; /* MLX: `float eps = 1e-7;` */
  float wmin = INFINITY, wmax = -INFINITY;
  for (int j = 0; j < gs; ++j) {
    if (wmax < w[j]) wmax = w[j];
    if (w[j] < wmin) wmin = w[j];
  }
  const bool min_edge = fabsf(wmin) > fabsf(wmax);
  float scale = (wmax - wmin) / n_bins;
  if (scale < eps) scale = eps;
  if (!min_edge) scale = -scale;
  const float edge = min_edge ? wmin : wmax;
  const float q0 = rintf(edge / scale);
  float bias = 0.0f;
  if (q0 != 0.0f) {
    scale = edge / q0;
    bias = edge;
  }
  const int per_word = 32 / bits;
  for (int k = 0; k < gs / per_word; ++k) {
    uint32_t word = 0;
    for (int e = 0; e < per_word; ++e) {
      float v = rintf((w[k * per_word + e] - bias) / scale);
      v = v < 0.0f ? 0.0f : v;
      v = n_bins < v ? n_bins : v;
      uint32_t q = isnan(v) ? 0u : (uint32_t)v;
      word |= q << (e * bits);
    }
    words[k] = word;
  }
  *scale_out = scale;
  *bias_out = bias;
}

void kva_quantize_row(const void *w, kva_dtype wdt, int64_t D, int bits, int group_size, uint32_t *q,
                      void *scales, void *biases, kva_dtype sdt) {
  const int64_t wsz = (int64_t)kva_dtype_size(wdt), ssz = (int64_t)kva_dtype_size(sdt);
  const int64_t words_per_group = group_size * bits / 32;
  float buf[KVA_QMAX_GROUP];
  for (int64_t g = 0; g < D / group_size; ++g) {
    float scale, bias;
    load_row((const char *)w + g * group_size * wsz, wdt, group_size, buf);
    quantize_group(buf, group_size, bits, &scale, &bias, q + g * words_per_group);
    kva_store_f((char *)scales + g * ssz, sdt, scale);
    kva_store_f((char *)biases + g * ssz, sdt, bias);
  }
}

int kva_quantize(const kva_tensor *w, kva_kv *out) {
  kva_clearerr();
  if (!w) return kva_seterr(KVA_EINVAL, "w is NULL");
  if (!out) return kva_seterr(KVA_EINVAL, "out is NULL");
  int rc = kva_check_tensor(w, "w", KVA_DT_FLOAT, 0, false);
  if (rc) return rc;
  rc = check_format(out, "out");
  if (rc) return rc;
  const int nd = w->ndim, bits = out->bits, gs = out->group_size;
  const int64_t D = w->shape[nd - 1];
  if (D % gs)
    return kva_seterr(KVA_ESHAPE, "w: last dim %lld is not a multiple of out.group_size = %d",
                      (long long)D, gs);
  if (D % 32 * bits % 32) /* (D * bits) % 32, without forming D * bits */
    return kva_seterr(KVA_ESHAPE, "w: last dim %lld * out.bits = %d is not a multiple of 32",
                      (long long)D, bits);
  rc = check_parts(out, "out", w->shape, nd, "w", false);
  if (rc) return rc;
  if ((rc = check_apart(&out->data, "out.data", w, "w")) ||
      (rc = check_apart(&out->scales, "out.scales", w, "w")) ||
      (rc = check_apart(&out->biases, "out.biases", w, "w")) ||
      (rc = check_apart(&out->scales, "out.scales", &out->data, "out.data")) ||
      (rc = check_apart(&out->biases, "out.biases", &out->data, "out.data")) ||
      (rc = check_apart(&out->biases, "out.biases", &out->scales, "out.scales")))
    return rc;

  int64_t n[3], sw[3], sq[3], ss[3], sb[3];
  lead_dims(w, n, sw);
  lead_dims(&out->data, n, sq);
  lead_dims(&out->scales, n, ss);
  lead_dims(&out->biases, n, sb);
  for (int64_t a = 0; a < n[0]; ++a)
    for (int64_t b = 0; b < n[1]; ++b)
      for (int64_t c = 0; c < n[2]; ++c)
        kva_quantize_row(row_ptr(w, sw, a, b, c), w->dtype, D, bits, gs,
                         (uint32_t *)row_ptr(&out->data, sq, a, b, c), row_ptr(&out->scales, ss, a, b, c),
                         row_ptr(&out->biases, sb, a, b, c), out->scales.dtype);
  return 0;
}

/* ---- fp8 rows ---- */
float kva_fp8_row_scale(const void *w, kva_dtype wdt, int64_t D, kva_dtype f8) {
  const int64_t es = (int64_t)kva_dtype_size(wdt);
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float a = fabsf(kva_load_f((const char *)w + d * es, wdt));
    if (a <= FLT_MAX && a > amax) amax = a; /* finite values only (NaN compares false) */
  }
  if (amax == 0.0f) return 1.0f;
  const float s = amax / kva_fp8_max(f8);
  return s < FLT_MIN ? FLT_MIN : s;
}

void kva_fp8_quantize_row(const void *w, kva_dtype wdt, int64_t D, kva_dtype f8, float scale, uint8_t *q) {
  const int64_t es = (int64_t)kva_dtype_size(wdt);
  for (int64_t d = 0; d < D; ++d) {
    const float x = kva_load_f((const char *)w + d * es, wdt);
    if (isnan(x)) q[d] = signbit(x) ? 0xff : 0x7f;
    else q[d] = f8 == KVA_F8E4M3 ? kva_f32_to_f8e4m3(x / scale) : kva_f32_to_f8e5m2(x / scale);
  }
}

/* fp8 rows -> float: out = scale * code in f32, stored rounded to out's dtype. */
static int dequantize_fp8(const kva_kv *q, kva_tensor *out) {
  int64_t D;
  int rc = kva_check_kv(q, "q", &D);
  if (rc) return rc;
  if ((rc = kva_check_tensor(out, "out", KVA_DT_FLOAT, 4, false))) return rc;
  for (int d = 0; d < 4; ++d)
    if (out->shape[d] != q->data.shape[d])
      return kva_seterr(KVA_ESHAPE, "out.shape[%d] = %lld != q.data.shape[%d] = %lld", d, (long long)out->shape[d], d,
                        (long long)q->data.shape[d]);
  if ((rc = check_apart(out, "out", &q->data, "q.data")) ||
      (q->scales.data && (rc = check_apart(out, "out", &q->scales, "q.scales"))))
    return rc;
  for (int64_t a = 0; a < q->data.shape[0] && q->scales.data; ++a)
    for (int64_t b = 0; b < q->data.shape[1]; ++b)
      for (int64_t c = 0; c < q->data.shape[2]; ++c) {
        const float s = *(const float *)kva_at4(&q->scales, a, b, c, 0);
        if (!(s > 0.0f) || s == INFINITY)
          return kva_seterr(KVA_EINVAL, "q.scales[%lld, %lld, %lld] = %g (fp8 scales must be finite and > 0)",
                            (long long)a, (long long)b, (long long)c, (double)s);
      }
  const int64_t osz = (int64_t)kva_dtype_size(out->dtype);
  for (int64_t a = 0; a < q->data.shape[0]; ++a)
    for (int64_t b = 0; b < q->data.shape[1]; ++b)
      for (int64_t c = 0; c < q->data.shape[2]; ++c) {
        const float s = q->scales.data ? *(const float *)kva_at4(&q->scales, a, b, c, 0) : 1.0f;
        const char *row = kva_at4(&q->data, a, b, c, 0);
        char *orow = kva_at4(out, a, b, c, 0);
        for (int64_t d = 0; d < D; ++d) kva_store_f(orow + d * osz, out->dtype, s * kva_load_f(row + d, q->data.dtype));
      }
  return 0;
}

/* ---- dequantize ---- */

static inline float round_to(kva_dtype dt, float x) {
  switch (dt) {
  case KVA_F16: return kva_f16_to_f32(kva_f32_to_f16(x));
  case KVA_BF16: return kva_bf16_to_f32(kva_f32_to_bf16(x));
  default: return x;
  }
}

/* MLX's CPU dequantize is `multiply(q, scales)` then `add(.., biases)` in the
 * scales' dtype T (uint32 promotes to T): the product is rounded to T, then the
 * sum, no fma. For T = f32 that is f32 arithmetic; for f16/bf16 each f32
 * operation rounded to T equals the correctly rounded T operation. */
static inline float dequant_one(float s, float b, uint32_t q, kva_dtype T) {
  float p = round_to(T, s * (float)q);
  float v = round_to(T, p + b);
  return v;
}

int kva_dequantize(const kva_kv *q, kva_tensor *out) {
  kva_clearerr();
  if (!q) return kva_seterr(KVA_EINVAL, "q is NULL");
  if (!out) return kva_seterr(KVA_EINVAL, "out is NULL");
  if (q->bits == 0 && kva_is_fp8(q->data.dtype)) return dequantize_fp8(q, out);
  int rc = check_format(q, "q");
  if (rc) return rc;
  rc = kva_check_tensor(&q->data, "q.data", KVA_DT(KVA_U32), 0, false);
  if (rc) return rc;
  const int nd = q->data.ndim, bits = q->bits, gs = q->group_size;
  int64_t shape[KVA_MAX_DIMS];
  for (int d = 0; d < nd; ++d) shape[d] = q->data.shape[d];
  const int64_t D = kva_unpacked_dim(shape[nd - 1], bits);
  if (D < 0)
    return kva_seterr(KVA_ESHAPE, "q.data: last dim %lld words would hold more than 2^63 values at q.bits = %d",
                      (long long)shape[nd - 1], bits);
  shape[nd - 1] = D;
  if (D % gs)
    return kva_seterr(KVA_ESHAPE, "q.data: last dim %lld holds %lld values, not a multiple of "
                      "q.group_size = %d", (long long)q->data.shape[nd - 1], (long long)D, gs);
  rc = check_parts(q, "q", shape, nd, "q.data", true);
  if (rc) return rc;
  rc = kva_check_tensor(out, "out", KVA_DT_FLOAT, nd, false);
  if (rc) return rc;
  rc = check_shape(out, "out", shape, nd, "q.data", D);
  if (rc) return rc;
  if ((rc = check_apart(out, "out", &q->data, "q.data")) ||
      (rc = check_apart(out, "out", &q->scales, "q.scales")) ||
      (rc = check_apart(out, "out", &q->biases, "q.biases")))
    return rc;

  int64_t n[3], sq[3], ss[3], sb[3], so[3];
  lead_dims(&q->data, n, sq);
  lead_dims(&q->scales, n, ss);
  lead_dims(&q->biases, n, sb);
  lead_dims(out, n, so);
  const kva_dtype T = q->scales.dtype, odt = out->dtype;
  const int64_t tsz = (int64_t)kva_dtype_size(T), osz = (int64_t)kva_dtype_size(odt);
  const int per_word = 32 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  for (int64_t a = 0; a < n[0]; ++a)
    for (int64_t b = 0; b < n[1]; ++b)
      for (int64_t c = 0; c < n[2]; ++c) {
        const uint32_t *qr = (const uint32_t *)row_ptr(&q->data, sq, a, b, c);
        const char *sr = row_ptr(&q->scales, ss, a, b, c), *br = row_ptr(&q->biases, sb, a, b, c);
        char *orow = row_ptr(out, so, a, b, c);
        for (int64_t g = 0; g < D / gs; ++g) {
          const float s = kva_load_f(sr + g * tsz, T), bias = kva_load_f(br + g * tsz, T);
          for (int64_t d = g * gs; d < (g + 1) * gs; ++d) {
            uint32_t code = (qr[d / per_word] >> ((d % per_word) * bits)) & mask;
            kva_store_f(orow + d * osz, odt, dequant_one(s, bias, code, T));
          }
        }
      }
  return 0;
}
