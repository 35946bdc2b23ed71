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

/* Element loads (host). */
static inline float kva_load_f(const void *p, kva_dtype dt) {
  switch (dt) {
  case KVA_F32: return *(const float *)p;
  case KVA_F16: return kva_f16_to_f32(*(const uint16_t *)p);
  case KVA_BF16: return kva_bf16_to_f32(*(const uint16_t *)p);
  default: return 0.0f;
  }
}
static inline void kva_store_f(void *p, kva_dtype dt, float x) {
  switch (dt) {
  case KVA_F32: *(float *)p = x; break;
  case KVA_F16: *(uint16_t *)p = kva_f32_to_f16(x); break;
  case KVA_BF16: *(uint16_t *)p = kva_f32_to_bf16(x); break;
  default: break;
  }
}
static inline bool kva_is_float(kva_dtype dt) {
  return dt == KVA_F32 || dt == KVA_F16 || dt == KVA_BF16;
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
int kva_check_tensor(const kva_tensor *t, const char *name, unsigned dtypes, int ndim,
                     bool allow_broadcast);
/* Checks a K/V operand: returns its logical head dim in *dim. */
int kva_check_kv(const kva_kv *kv, const char *name, int64_t *dim);
/* Do [a, a+an) and [b, b+bn) byte ranges of two tensors overlap? */
bool kva_tensors_overlap(const kva_tensor *a, const kva_tensor *b);

/* Number of u32 words per row of D elements at `bits`. */
static inline int64_t kva_packed_words(int64_t D, int bits) { return D * bits / 32; }

#endif
