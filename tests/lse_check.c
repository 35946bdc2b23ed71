/* lse test helpers (see lse_check.h). */
#include "lse_check.h"

#define LSE_SENTINEL 0x5e17u
#define LSE_POISON 0x7fc0dead /* a quiet NaN */

int lse_buf_make(lse_buf *b, int64_t B, int64_t H, int64_t L, int padded) {
  const int64_t ld = padded ? L + 3 : L, hs = padded ? H + 1 : H;
  b->n = (size_t)(B * hs * ld);
  b->mem = (float *)malloc((b->n + 4) * sizeof(float));
  if (!b->mem) return -1;
  const uint32_t poison = LSE_POISON;
  for (size_t k = 0; k < b->n; ++k) memcpy(b->mem + k, &poison, 4);
  for (int k = 0; k < 4; ++k) {
    uint32_t s = LSE_SENTINEL + k;
    memcpy(b->mem + b->n + k, &s, 4);
  }
  b->t = (kva_tensor){b->mem, KVA_F32, 3, {B, H, L, 0}, {hs * ld * 4, ld * 4, 4, 0}};
  return 0;
}
void lse_buf_free(lse_buf *b) { free(b->mem); b->mem = NULL; }

float lse_get(const kva_tensor *t, int64_t b, int64_t h, int64_t i) {
  float x;
  memcpy(&x, (const char *)t->data + b * t->stride[0] + h * t->stride[1] + i * t->stride[2], 4);
  return x;
}
void lse_set(kva_tensor *t, int64_t b, int64_t h, int64_t i, float x) {
  memcpy((char *)t->data + b * t->stride[0] + h * t->stride[1] + i * t->stride[2], &x, 4);
}

int lse_sentinel_ok(const lse_buf *b) {
  for (int k = 0; k < 4; ++k) {
    uint32_t s;
    memcpy(&s, b->mem + b->n + k, 4);
    if (s != LSE_SENTINEL + (uint32_t)k) {
      fprintf(stderr, "    lse sentinel overwritten\n");
      return 0;
    }
  }
  return 1;
}

int lse_untouched(const lse_buf *b) {
  for (size_t k = 0; k < b->n; ++k) {
    uint32_t u;
    memcpy(&u, b->mem + k, 4);
    if (u != LSE_POISON) return 0;
  }
  return lse_sentinel_ok(b);
}

int lse_compare(const kva_tensor *got, const kva_tensor *ref, double rtol, const char *what) {
  double worst = 0;
  for (int64_t b = 0; b < ref->shape[0]; ++b)
    for (int64_t h = 0; h < ref->shape[1]; ++h)
      for (int64_t i = 0; i < ref->shape[2]; ++i) {
        const double g = lse_get(got, b, h, i), r = lse_get(ref, b, h, i);
        int ok;
        if (isnan(r) || isinf(r)) ok = isnan(r) ? isnan(g) : g == r;
        else {
          const double e = fabs(g - r) / (fabs(r) > 1 ? fabs(r) : 1);
          worst = e > worst ? e : worst;
          ok = e <= rtol;
        }
        if (!ok) {
          fprintf(stderr, "    %s: lse[%lld, %lld, %lld] = %.9g, oracle %.9g (rtol %g)\n", what, (long long)b,
                  (long long)h, (long long)i, g, r, rtol);
          return 0;
        }
      }
  (void)worst;
  return 1;
}
