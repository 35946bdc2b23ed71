/* Helpers of the lse and merge tests (test_lse.c, test_cuda.c): lse tensors
 * [B, H, L] f32 in padded host buffers (NaN-poisoned, a sentinel after),
 * and the comparison with the oracle's lse. */
#ifndef KVA_LSE_CHECK_H
#define KVA_LSE_CHECK_H

#include "test.h"

/* lse allowance: f32 rounding of m + log l, relative to max(1, |lse|). */
#define LSE_RTOL 1e-5

typedef struct lse_buf {
  kva_tensor t;
  float *mem;
  size_t n; /* floats before the sentinel */
} lse_buf;
/* padded: rows of L + 3 floats and heads of H + 1 rows (strides > shape). */
int lse_buf_make(lse_buf *b, int64_t B, int64_t H, int64_t L, int padded);
void lse_buf_free(lse_buf *b);
float lse_get(const kva_tensor *t, int64_t b, int64_t h, int64_t i);
void lse_set(kva_tensor *t, int64_t b, int64_t h, int64_t i, float x);
int lse_sentinel_ok(const lse_buf *b);
/* Every float of the buffer still the poison (nothing written). */
int lse_untouched(const lse_buf *b);
/* -inf / +inf / NaN exact, else |got - ref| <= rtol * max(1, |ref|); prints
 * the first mismatch under `what`. */
int lse_compare(const kva_tensor *got, const kva_tensor *ref, double rtol, const char *what);
#endif
