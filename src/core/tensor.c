/* Tensor descriptors: constructors, validation, dtype conversions (exact,
 * round to nearest even). */
#include "internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

size_t kva_dtype_size(kva_dtype dt) {
  switch (dt) {
  case KVA_F32: case KVA_U32: case KVA_I32: return 4;
  case KVA_F16: case KVA_BF16: return 2;
  case KVA_BOOL: case KVA_F8E4M3: case KVA_F8E5M2: return 1;
  }
  return 0;
}

const char *kva_dtype_name(kva_dtype dt) {
  switch (dt) {
  case KVA_F32: return "f32";
  case KVA_F16: return "f16";
  case KVA_BF16: return "bf16";
  case KVA_U32: return "u32";
  case KVA_I32: return "i32";
  case KVA_BOOL: return "bool";
  case KVA_F8E4M3: return "f8e4m3";
  case KVA_F8E5M2: return "f8e5m2";
  }
  return "?";
}

static kva_tensor make_contiguous(void *data, kva_dtype dt, int ndim, const int64_t *shape) {
  kva_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dt;
  t.ndim = ndim;
  int64_t s = (int64_t)kva_dtype_size(dt);
  for (int d = ndim - 1; d >= 0; --d) {
    t.shape[d] = shape[d];
    t.stride[d] = s;
    if (!kva_mul_ok(s, shape[d], &s)) s = KVA_STRIDE_OVERFLOW; /* refused by kva_check_tensor */
  }
  return t;
}

kva_tensor kva_tensor_1d(void *data, kva_dtype dt, int64_t n0) {
  int64_t s[1] = {n0};
  return make_contiguous(data, dt, 1, s);
}
kva_tensor kva_tensor_2d(void *data, kva_dtype dt, int64_t n0, int64_t n1) {
  int64_t s[2] = {n0, n1};
  return make_contiguous(data, dt, 2, s);
}
kva_tensor kva_tensor_4d(void *data, kva_dtype dt, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
  int64_t s[4] = {n0, n1, n2, n3};
  return make_contiguous(data, dt, 4, s);
}

/* ---- conversions ---- */
static inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

uint16_t kva_f32_to_bf16(float x) {
  uint32_t u = f2u(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);                                            /* RNE */
  return (uint16_t)(u >> 16);
}

float kva_bf16_to_f32(uint16_t b) { return u2f((uint32_t)b << 16); }

uint16_t kva_f32_to_f16(float x) {
  uint32_t u = f2u(x);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
  if (a < 0x38800000u) {                                  /* result subnormal or zero */
    /* value = a as float; f16 subnormal unit = 2^-24. Round a * 2^24 to integer (RNE). */
    float v = u2f(a) * 16777216.0f; /* exact: scaling by a power of two */
    float r = nearbyintf(v);        /* current rounding mode: nearest even by default */
    return (uint16_t)(sign | (uint32_t)r);
  }
  /* normal: rebias exponent 127 -> 15, round mantissa 23 -> 10 bits */
  uint32_t m = a + 0xfffu + ((a >> 13) & 1u);
  return (uint16_t)(sign | ((m - 0x38000000u) >> 13));
}

float kva_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    float v = (float)m * (1.0f / 16777216.0f); /* exact */
    return sign ? -v : v;
  }
  if (e == 31) return u2f(sign | 0x7f800000u | (m << 13));
  return u2f(sign | ((e + 112u) << 23) | (m << 13));
}

/* fp8 with M mantissa bits and exponent bias `bias`, largest finite
 * magnitude code maxc: RNE, saturating, NaN -> sign | 0x7f. Normal results:
 * the f16 method (rebias the exponent, round the mantissa 23 -> M bits by
 * adding half an ulp minus one plus the kept lsb); below 2^(1-bias) the
 * code is |x| / 2^(1-bias-M) rounded to an integer (the scaling is exact,
 * nearbyintf rounds to even), which also yields the smallest normal code
 * when a subnormal rounds up. */
static uint8_t f32_to_f8(float x, int M, int bias, uint32_t maxc) {
  const uint32_t u = f2u(x), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
  uint32_t c;
  if (a < (uint32_t)(128 - bias) << 23) {
    c = (uint32_t)nearbyintf(u2f(a) * u2f((uint32_t)(127 + bias - 1 + M) << 23));
  } else {
    const int sh = 23 - M;
    const uint32_t m = a + ((1u << (sh - 1)) - 1u) + ((a >> sh) & 1u);
    c = (m >> sh) - ((uint32_t)(127 - bias) << M);
  }
  return (uint8_t)(sign | (c > maxc ? maxc : c));
}
uint8_t kva_f32_to_f8e4m3(float x) { return f32_to_f8(x, 3, 7, 0x7eu); }
uint8_t kva_f32_to_f8e5m2(float x) { return f32_to_f8(x, 2, 15, 0x7bu); }

float kva_f8e4m3_to_f32(uint8_t c) {
  const uint32_t sign = (uint32_t)(c & 0x80u) << 24, e = (c >> 3) & 15u, m = c & 7u;
  if (e == 15 && m == 7) return u2f(sign | 0x7fc00000u);
  if (e == 0) {
    const float v = (float)m * 0x1p-9f; /* exact */
    return sign ? -v : v;
  }
  return u2f(sign | ((e + 120u) << 23) | (m << 20));
}
float kva_f8e5m2_to_f32(uint8_t c) { return kva_f16_to_f32((uint16_t)((uint16_t)c << 8)); }

/* ---- validation ---- */
int kva_check_tensor(const kva_tensor *t, const char *name, unsigned dtypes, int ndim,
                     bool allow_broadcast) {
  if (!t) return kva_seterr(KVA_EINVAL, "%s is NULL", name);
  if (ndim > 0 && t->ndim != ndim)
    return kva_seterr(KVA_ESHAPE, "%s must have rank %d, got %d", name, ndim, t->ndim);
  if (t->ndim < 1 || t->ndim > KVA_MAX_DIMS)
    return kva_seterr(KVA_ESHAPE, "%s has invalid rank %d", name, t->ndim);
  if ((unsigned)t->dtype > KVA_F8E5M2 || !(dtypes & KVA_DT(t->dtype)))
    return kva_seterr(KVA_EDTYPE, "%s has unsupported dtype %s", name, kva_dtype_name(t->dtype));
  int64_t es = (int64_t)kva_dtype_size(t->dtype);
  for (int d = 0; d < t->ndim; ++d)
    if (t->shape[d] <= 0)
      return kva_seterr(KVA_ESHAPE, "%s.shape[%d] = %lld must be positive", name, d,
                        (long long)t->shape[d]);
  if (!t->data) return kva_seterr(KVA_EINVAL, "%s.data is NULL", name);
  if ((uintptr_t)t->data % (uintptr_t)es) /* elements are loaded as typed values */
    return kva_seterr(KVA_EINVAL, "%s: data pointer %p is not aligned to its element size %lld (%s)", name, t->data,
                      (long long)es, kva_dtype_name(t->dtype));
  if (t->stride[t->ndim - 1] != es && !(allow_broadcast && t->stride[t->ndim - 1] == 0))
    return kva_seterr(KVA_ESTRIDE, "%s: innermost stride %lld must equal the element size %lld",
                      name, (long long)t->stride[t->ndim - 1], (long long)es);
  for (int d = 0; d < t->ndim; ++d) {
    if (t->stride[d] < 0 || (!allow_broadcast && t->stride[d] == 0 && t->shape[d] > 1))
      return kva_seterr(KVA_ESTRIDE, "%s.stride[%d] = %lld is not allowed", name, d,
                        (long long)t->stride[d]);
    if (t->stride[d] % es) /* elements stay aligned to their size */
      return kva_seterr(KVA_ESTRIDE, "%s.stride[%d] = %lld is not a multiple of the element size %lld", name, d,
                        (long long)t->stride[d], (long long)es);
  }
  /* The bytes the view spans, checked against overflow: no real view spans
   * 2^62 bytes or more (a larger shape or stride is a corrupted descriptor,
   * and the sums below must not wrap). */
  int64_t span = es;
  for (int d = 0; d < t->ndim; ++d) {
    const int64_t n1 = t->shape[d] - 1;
    if (n1 > 0 && t->stride[d] > (KVA_MAX_SPAN - span) / n1)
      return kva_seterr(KVA_ESHAPE, "%s spans 2^62 bytes or more (shape[%d] = %lld, stride[%d] = %lld)", name, d,
                        (long long)t->shape[d], d, (long long)t->stride[d]);
    span += t->stride[d] * n1;
  }
  if (allow_broadcast) return 0;
  /* Non-overlap: sort dims (shape > 1) by stride; each stride must cover the
   * extent of all smaller-stride dims. */
  int idx[KVA_MAX_DIMS], n = 0;
  for (int d = 0; d < t->ndim; ++d)
    if (t->shape[d] > 1) idx[n++] = d;
  for (int i = 1; i < n; ++i)
    for (int j = i; j > 0 && t->stride[idx[j]] < t->stride[idx[j - 1]]; --j) {
      int tmp = idx[j]; idx[j] = idx[j - 1]; idx[j - 1] = tmp;
    }
  int64_t extent = es;
  for (int i = 0; i < n; ++i) {
    int d = idx[i];
    if (t->stride[d] < extent)
      return kva_seterr(KVA_ESTRIDE, "%s: stride[%d] = %lld overlaps the inner dimensions (extent %lld)",
                        name, d, (long long)t->stride[d], (long long)extent);
    extent = t->stride[d] * (t->shape[d] - 1) + extent;
  }
  return 0;
}

static void byte_range(const kva_tensor *t, uintptr_t *lo, uintptr_t *hi) {
  int64_t ext = (int64_t)kva_dtype_size(t->dtype);
  for (int d = 0; d < t->ndim; ++d) ext += t->stride[d] * (t->shape[d] - 1);
  *lo = (uintptr_t)t->data;
  *hi = *lo + (uintptr_t)ext;
}

bool kva_tensors_overlap(const kva_tensor *a, const kva_tensor *b) {
  uintptr_t alo, ahi, blo, bhi;
  byte_range(a, &alo, &ahi);
  byte_range(b, &blo, &bhi);
  return alo < bhi && blo < ahi;
}

int64_t kva_kv_dim(const kva_kv *kv) {
  if (!kv || kv->data.ndim < 1 || kv->data.ndim > KVA_MAX_DIMS) return 0;
  int64_t last = kv->data.shape[kv->data.ndim - 1];
  if (kv->bits == 0) return last;
  if (kv->bits != 2 && kv->bits != 4 && kv->bits != 8) return 0;
  const int64_t D = kva_unpacked_dim(last, kv->bits);
  return D > 0 ? D : 0;
}

kva_rowfmt kva_rowfmt_of(const kva_kv *kv) {
  kva_rowfmt f;
  f.bits = kv->bits;
  f.group = kv->group_size;
  f.dtype = kv->data.dtype;
  f.sdtype = kv->bits ? kv->scales.dtype : kva_is_fp8(kv->data.dtype) ? KVA_F32 : kv->data.dtype;
  f.D = kva_kv_dim(kv);
  f.scaled = kva_kv_scaled(kv);
  return f;
}

int kva_check_kv(const kva_kv *kv, const char *name, int64_t *dim) {
  char nm[64];
  if (!kv) return kva_seterr(KVA_EINVAL, "%s is NULL", name);
  if (kv->bits == 0) {
    snprintf(nm, sizeof nm, "%s.data", name);
    int rc = kva_check_tensor(&kv->data, nm, KVA_DT_FLOAT | KVA_DT_FP8, 4, false);
    if (rc) return rc;
    if (kva_is_fp8(kv->data.dtype) && kv->scales.data) {
      /* [B, KVH, N, 1] f32, strides free (0 broadcasts) */
      snprintf(nm, sizeof nm, "%s.scales", name);
      if ((rc = kva_check_tensor(&kv->scales, nm, KVA_DT(KVA_F32), 4, true))) return rc;
      for (int d = 0; d < 4; ++d)
        if (kv->scales.shape[d] != (d < 3 ? kv->data.shape[d] : 1))
          return kva_seterr(KVA_ESHAPE, "%s.scales.shape[%d] = %lld, expected %lld (fp8 scales are f32 [B, KVH, N, 1]; "
                            "strides 0 broadcast)", name, d, (long long)kv->scales.shape[d],
                            (long long)(d < 3 ? kv->data.shape[d] : 1));
    }
    *dim = kv->data.shape[3];
    return 0;
  }
  if (kv->bits != 2 && kv->bits != 4 && kv->bits != 8)
    return kva_seterr(KVA_EUNSUPPORTED, "%s.bits = %d (supported: 0 = float, 2, 4, 8)", name, kv->bits);
  if (kv->group_size != 32 && kv->group_size != 64 && kv->group_size != 128)
    return kva_seterr(KVA_EUNSUPPORTED, "%s.group_size = %d (supported: 32, 64, 128)", name,
                      kv->group_size);
  snprintf(nm, sizeof nm, "%s.data", name);
  int rc = kva_check_tensor(&kv->data, nm, KVA_DT(KVA_U32), 4, false);
  if (rc) return rc;
  const int64_t D = kva_unpacked_dim(kv->data.shape[3], kv->bits);
  if (D < 0)
    return kva_seterr(KVA_ESHAPE, "%s.data.shape[3] = %lld words: the head dim (words * 32 / bits = %d) does not fit int64",
                      name, (long long)kv->data.shape[3], kv->bits);
  if (D % kv->group_size)
    return kva_seterr(KVA_ESHAPE, "%s: head dim %lld is not a multiple of group_size %d", name,
                      (long long)D, kv->group_size);
  snprintf(nm, sizeof nm, "%s.scales", name);
  rc = kva_check_tensor(&kv->scales, nm, KVA_DT_FLOAT, 4, false);
  if (rc) return rc;
  snprintf(nm, sizeof nm, "%s.biases", name);
  rc = kva_check_tensor(&kv->biases, nm, KVA_DT_FLOAT, 4, false);
  if (rc) return rc;
  if (kv->scales.dtype != kv->biases.dtype)
    return kva_seterr(KVA_EDTYPE, "%s: scales (%s) and biases (%s) dtypes differ", name,
                      kva_dtype_name(kv->scales.dtype), kva_dtype_name(kv->biases.dtype));
  for (int d = 0; d < 3; ++d)
    if (kv->scales.shape[d] != kv->data.shape[d] || kv->biases.shape[d] != kv->data.shape[d])
      return kva_seterr(KVA_ESHAPE, "%s: scales/biases dim %d (%lld/%lld) != packed dim %d (%lld)", name,
                        d, (long long)kv->scales.shape[d], (long long)kv->biases.shape[d], d,
                        (long long)kv->data.shape[d]);
  if (kv->scales.shape[3] != D / kv->group_size || kv->biases.shape[3] != D / kv->group_size)
    return kva_seterr(KVA_ESHAPE, "%s: scales/biases last dim must be D/group_size = %lld", name,
                      (long long)(D / kv->group_size));
  *dim = D;
  return 0;
}

kva_kv kva_kv_float(void *data, kva_dtype dt, int64_t B, int64_t KVH, int64_t N, int64_t D) {
  kva_kv kv;
  memset(&kv, 0, sizeof kv);
  kv.data = kva_tensor_4d(data, dt, B, KVH, N, D);
  return kv;
}

kva_kv kva_kv_quantized(void *packed, void *scales, void *biases, kva_dtype scale_dt, int bits,
                        int group_size, int64_t B, int64_t KVH, int64_t N, int64_t D) {
  kva_kv kv;
  memset(&kv, 0, sizeof kv);
  kv.bits = bits;
  kv.group_size = group_size;
  /* (a format other than bits 2/4/8, group 32/64/128 is refused by kva_check_kv) */
  int64_t words = bits == 2 || bits == 4 || bits == 8 ? kva_packed_words(D, bits) : D;
  int64_t groups = (group_size > 0) ? D / group_size : 0;
  kv.data = kva_tensor_4d(packed, KVA_U32, B, KVH, N, words);
  kv.scales = kva_tensor_4d(scales, scale_dt, B, KVH, N, groups);
  kv.biases = kva_tensor_4d(biases, scale_dt, B, KVH, N, groups);
  return kv;
}

kva_kv kva_kv_fp8(void *data, kva_dtype dt, const float *scales, int per_token, int64_t B, int64_t KVH, int64_t N,
                  int64_t D) {
  kva_kv kv = kva_kv_float(data, dt, B, KVH, N, D);
  if (scales) {
    kv.scales = kva_tensor_4d((void *)(uintptr_t)scales, KVA_F32, B, KVH, N, 1);
    if (!per_token)
      for (int d = 0; d < 4; ++d) kv.scales.stride[d] = 0;
  }
  return kv;
}

kva_kv_view kva_view_contiguous(const kva_kv *k, const kva_kv *v, const int32_t *seq_lens) {
  kva_kv_view view;
  memset(&view, 0, sizeof view);
  view.layout = KVA_LAYOUT_CONTIGUOUS;
  if (k) view.k = *k;
  if (v) view.v = *v;
  view.seq_lens = seq_lens;
  return view;
}

/* Iterate over all elements of a tensor of rank <= 4 in row-major order. */
int kva_convert(const kva_tensor *src, kva_tensor *dst) {
  kva_clearerr();
  int rc = kva_check_tensor(src, "src", KVA_DT_FLOAT, 0, false);
  if (rc) return rc;
  rc = kva_check_tensor(dst, "dst", KVA_DT_FLOAT, src->ndim, false);
  if (rc) return rc;
  for (int d = 0; d < src->ndim; ++d)
    if (src->shape[d] != dst->shape[d])
      return kva_seterr(KVA_ESHAPE, "dst.shape[%d] = %lld != src.shape[%d] = %lld", d,
                        (long long)dst->shape[d], d, (long long)src->shape[d]);
  int64_t shp[4] = {1, 1, 1, 1}, ss[4] = {0, 0, 0, 0}, ds[4] = {0, 0, 0, 0};
  int off = 4 - src->ndim;
  for (int d = 0; d < src->ndim; ++d) {
    shp[off + d] = src->shape[d];
    ss[off + d] = src->stride[d];
    ds[off + d] = dst->stride[d];
  }
  for (int64_t a = 0; a < shp[0]; ++a)
    for (int64_t b = 0; b < shp[1]; ++b)
      for (int64_t c = 0; c < shp[2]; ++c)
        for (int64_t e = 0; e < shp[3]; ++e) {
          const char *s = (const char *)src->data + a * ss[0] + b * ss[1] + c * ss[2] + e * ss[3];
          char *t = (char *)dst->data + a * ds[0] + b * ds[1] + c * ds[2] + e * ds[3];
          kva_store_f(t, dst->dtype, kva_load_f(s, src->dtype));
        }
  return 0;
}
