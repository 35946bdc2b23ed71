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
#endif
