/* Internal helpers shared by the library's layers (not the public API). */
#ifndef KVA_INTERNAL_H
#define KVA_INTERNAL_H

#include "kvattn.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__GNUC__)
#define KVA_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define KVA_PRINTF(a, b)
#endif

/* Records a message for kva_last_error() and returns status (negative). */
int kva_seterr(int status, const char *fmt, ...) KVA_PRINTF(2, 3);
void kva_clearerr(void);

/* Element loads (host); fp8 elements as codes (unscaled). */
static inline float kva_load_f(const void *p, kva_dtype dt) {
  switch (dt) {
  case KVA_F32: return *(const float *)p;
  case KVA_F16: return kva_f16_to_f32(*(const uint16_t *)p);
  case KVA_BF16: return kva_bf16_to_f32(*(const uint16_t *)p);
  case KVA_F8E4M3: return kva_f8e4m3_to_f32(*(const uint8_t *)p);
  case KVA_F8E5M2: return kva_f8e5m2_to_f32(*(const uint8_t *)p);
  default: return 0.0f;
  }
}
static inline void kva_store_f(void *p, kva_dtype dt, float x) {
  switch (dt) {
  case KVA_F32: *(float *)p = x; break;
  case KVA_F16: *(uint16_t *)p = kva_f32_to_f16(x); break;
  case KVA_BF16: *(uint16_t *)p = kva_f32_to_bf16(x); break;
  case KVA_F8E4M3: *(uint8_t *)p = kva_f32_to_f8e4m3(x); break;
  case KVA_F8E5M2: *(uint8_t *)p = kva_f32_to_f8e5m2(x); break;
  default: break;
  }
}
static inline bool kva_is_float(kva_dtype dt) {
  return dt == KVA_F32 || dt == KVA_F16 || dt == KVA_BF16;
}
static inline bool kva_is_fp8(kva_dtype dt) { return dt == KVA_F8E4M3 || dt == KVA_F8E5M2; }
/* Largest finite fp8 magnitude (448 / 57344). */
static inline float kva_fp8_max(kva_dtype dt) { return dt == KVA_F8E4M3 ? 448.0f : 57344.0f; }
/* Does the operand read its scales array? Quantized rows, and fp8 rows
 * with scales (scales.data NULL: scale 1). */
static inline bool kva_kv_scaled(const kva_kv *kv) {
  return kv->bits != 0 || (kva_is_fp8(kv->data.dtype) && kv->scales.data != NULL);
}
/* Address of element (i0, i1, i2, i3) of a rank-4 tensor. */
static inline char *kva_at4(const kva_tensor *t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  return (char *)t->data + i0 * t->stride[0] + i1 * t->stride[1] + i2 * t->stride[2] +
         i3 * t->stride[3];
}

/* Checks a tensor descriptor: non-null data (when it has elements), dtype in
 * the allowed set (bitmask of 1u << dtype), rank, positive shape, contiguous
 * innermost dim, and (unless allow_broadcast) non-overlapping strides. `name`
 * names the argument in the error message. */
#define KVA_DT(x) (1u << (x))
#define KVA_MAX_SPAN ((int64_t)1 << 62) /* bytes a tensor view may span (kva_check_tensor) */
#define KVA_DT_FLOAT (KVA_DT(KVA_F32) | KVA_DT(KVA_F16) | KVA_DT(KVA_BF16))
#define KVA_DT_FP8 (KVA_DT(KVA_F8E4M3) | KVA_DT(KVA_F8E5M2))
int kva_check_tensor(const kva_tensor *t, const char *name, unsigned dtypes, int ndim,
                     bool allow_broadcast);
/* Checks a K/V operand: returns its logical head dim in *dim. */
int kva_check_kv(const kva_kv *kv, const char *name, int64_t *dim);
/* Row format of one K/V operand: what a kernel needs to read its rows. */
typedef struct kva_rowfmt {
  int bits;          /* 0 = float rows */
  int group;         /* group size when quantized */
  kva_dtype dtype;   /* float rows: element dtype (f32/f16/bf16, or fp8) */
  kva_dtype sdtype;  /* quantized: scales/biases dtype; fp8 rows: f32 (their scales) */
  int64_t D;         /* logical elements per row */
  int scaled;        /* the scales array is read: quantized rows, fp8 rows with scales
                        (fp8 rows without: scale 1) */
} kva_rowfmt;
/* Row format of a kva_kv. */
kva_rowfmt kva_rowfmt_of(const kva_kv *kv);
/* Do [a, a+an) and [b, b+bn) byte ranges of two tensors overlap? */
bool kva_tensors_overlap(const kva_tensor *a, const kva_tensor *b);

/* Checked arithmetic on caller numbers (shapes, strides, counts): every
 * product or sum of values a caller passes goes through these, so a corrupt
 * descriptor yields an error instead of signed overflow. Each returns false
 * (and leaves *r unspecified) when the exact result does not fit. */
static inline bool kva_mul_ok(int64_t a, int64_t b, int64_t *r) { return !__builtin_mul_overflow(a, b, r); }
static inline bool kva_add_ok(int64_t a, int64_t b, int64_t *r) { return !__builtin_add_overflow(a, b, r); }
static inline bool kva_size_mul_ok(size_t a, size_t b, size_t *r) { return !__builtin_mul_overflow(a, b, r); }
static inline bool kva_size_add_ok(size_t a, size_t b, size_t *r) { return !__builtin_add_overflow(a, b, r); }
/* The same as running expressions: a * b (a + b) when *ok and it fits,
 * else 0 and *ok = false; a chain of them needs one test at its end. */
static inline int64_t kva_mul_chk(int64_t a, int64_t b, bool *ok) {
  int64_t r;
  if (!*ok || __builtin_mul_overflow(a, b, &r)) return *ok = false, 0;
  return r;
}
static inline int64_t kva_add_chk(int64_t a, int64_t b, bool *ok) {
  int64_t r;
  if (!*ok || __builtin_add_overflow(a, b, &r)) return *ok = false, 0;
  return r;
}
static inline size_t kva_size_mul_chk(size_t a, size_t b, bool *ok) {
  size_t r;
  if (!*ok || __builtin_mul_overflow(a, b, &r)) return *ok = false, 0;
  return r;
}
static inline size_t kva_size_add_chk(size_t a, size_t b, bool *ok) {
  size_t r;
  if (!*ok || __builtin_add_overflow(a, b, &r)) return *ok = false, 0;
  return r;
}
/* The largest workspace a backend asks for (2^48 bytes, past any machine's
 * memory): a problem that needs more is refused before any allocation. */
#define KVA_MAX_WORKSPACE ((size_t)1 << 48)
/* A stride no valid view has (a multiple of 8 near INT64_MAX): what the
 * contiguous constructors store when a shape's byte size overflows, so
 * kva_check_tensor refuses the descriptor by its span. */
#define KVA_STRIDE_OVERFLOW (INT64_MAX - 7)

/* Number of u32 words per row of D elements at `bits` (D * bits / 32 for
 * D >= 0, without forming D * bits). */
static inline int64_t kva_packed_words(int64_t D, int bits) { return D / 32 * bits + D % 32 * bits / 32; }
/* Logical elements held by `words` u32 words at `bits` (2, 4 or 8), or -1
 * when that count does not fit int64. */
static inline int64_t kva_unpacked_dim(int64_t words, int bits) {
  int64_t D;
  return kva_mul_ok(words, 32 / bits, &D) ? D : -1;
}

#endif
