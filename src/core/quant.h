/* The per-row entry of the MLX affine quantizer (src/core/quant.c), shared by
 * kva_quantize and kva_cache_write so both run the one algorithm. */
#ifndef KVA_QUANT_H
#define KVA_QUANT_H

#include "internal.h"

/* Quantizes one row of D contiguous values w (f32/f16/bf16 wdt) exactly as
 * kva_quantize does: q receives D*bits/32 words, scales and biases D/group_size
 * contiguous values of dtype sdt. Arguments are trusted (validated by the
 * caller): bits 2/4/8, group_size 32/64/128 dividing D. */
void kva_quantize_row(const void *w, kva_dtype wdt, int64_t D, int bits, int group_size, uint32_t *q,
                      void *scales, void *biases, kva_dtype sdt);

/* fp8 rows (kva_cache_write into fp8 pools). The scale of a per-(token,
 * head) row: amax = max |x| over its finite values (loaded from wdt);
 * scale = amax / max_fp8 in f32 (448 / 57344), at least FLT_MIN (2^-126);
 * 1 when amax is 0 (an all-zero row, or one of only NaN / inf). */
float kva_fp8_row_scale(const void *w, kva_dtype wdt, int64_t D, kva_dtype f8);
/* q[d] = the fp8 code (f8) of x / scale (f32 division, then round to
 * nearest even, saturating: kva_f32_to_f8e4m3 / _e5m2), x = w[d] loaded
 * from wdt; a NaN x gives the NaN code of its sign (sign | 0x7f), inf the
 * saturated max. */
void kva_fp8_quantize_row(const void *w, kva_dtype wdt, int64_t D, kva_dtype f8, float scale, uint8_t *q);
/* Are fp8 scales written by kva_cache_write (one per (token, head), no
 * broadcast dim: every dim 0..2 of more than one element has a nonzero
 * stride) rather than read (a caller's fixed scales: a broadcast dim)? */
static inline bool kva_fp8_scales_per_row(const kva_tensor *s) {
  if (!s->data) return false;
  for (int d = 0; d < 3; ++d)
    if (s->shape[d] > 1 && s->stride[d] == 0) return false;
  return true;
}
#endif
