/* The general CPU kernel, compiled once per SIMD level (portable, avx2,
 * avxvnni, avx512; the loops are written for the compiler's vectorizer).
 * Math: per tile of KVA_TILE keys, S = (scale*q)·Kᵀ for the nq = rep*rows
 *   query vectors, softcap, mask, online-softmax update, O += P·V.
 * Traffic: every K/V row of the item's token range is read once (converted
 *   or dequantized into an L1 tile) for all nq query vectors.
 * Geometry: one call = one work item; scratch = queries + K/V tiles + scores. */
#include "cpu/simd/simd.h"

/* ---- row decoding: one K/V row to f32 ---- */
static void decode_float_row(const char *row, kva_dtype dt, int64_t D, float *restrict dst) {
  if (dt == KVA_F32) {
    memcpy(dst, row, (size_t)D * 4);
  } else if (dt == KVA_BF16) {
    const uint16_t *s = (const uint16_t *)row;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = simd_bf16f(s[d]);
  } else {
    const uint16_t *s = (const uint16_t *)row;
    int64_t d = 0;
#if defined(__F16C__)
    for (; d + 8 <= D; d += 8)
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + d))));
#endif
    for (; d < D; ++d) dst[d] = kva_f16_to_f32(s[d]);
  }
}

/* w = scale*q + bias per group (q the bits-wide code, lowest bits first). */
static void decode_quant_row(const char *row, const char *sc, const char *bi, const kva_rowfmt *f,
                             float *restrict dst) {
  const uint32_t *w = (const uint32_t *)row;
  const int bits = f->bits, per = 32 / bits, G = f->group;
  const uint32_t mask = (1u << bits) - 1u;
  for (int64_t g = 0; g < f->D / G; ++g) {
    const float s = simd_load_scale(sc, f->sdtype, g), b = simd_load_scale(bi, f->sdtype, g);
    const uint32_t *wg = w + g * G / per;
    float *dg = dst + g * G;
#pragma omp simd
    for (int e = 0; e < G; ++e) dg[e] = s * (float)((wg[e / per] >> ((e % per) * bits)) & mask) + b;
  }
}

/* fp8 rows: scale * code in f32 (the code exact; sc NULL: scale 1). */
static void decode_fp8_row(const char *row, const char *sc, const kva_rowfmt *f, float *restrict dst) {
  const uint8_t *c = (const uint8_t *)row;
  const float s = sc ? *(const float *)sc : 1.0f;
  if (f->dtype == KVA_F8E4M3)
    for (int64_t d = 0; d < f->D; ++d) dst[d] = s * kva_f8e4m3_to_f32(c[d]);
  else
    for (int64_t d = 0; d < f->D; ++d) dst[d] = s * kva_f8e5m2_to_f32(c[d]);
}

static inline void decode_row(const kva_rowfmt *f, const char *row, const char *sc, const char *bi,
                              float *restrict dst) {
  if (f->bits) decode_quant_row(row, sc, bi, f, dst);
  else if (kva_is_fp8(f->dtype)) decode_fp8_row(row, sc, f, dst);
  else decode_float_row(row, f->dtype, f->D, dst);
}

/* Logit adjustment for the explicit-array mask: 0 (visible), -inf or the additive value. */
static inline float array_mask_add(const kva_problem *p, int64_t b, int64_t h, int64_t i, int64_t t) {
  const char *e = (const char *)p->mask.array.data + b * p->mask_stride[0] + h * p->mask_stride[1] +
                  i * p->mask_stride[2] + t * p->mask_stride[3];
  switch (p->mask.array.dtype) {
  case KVA_BOOL: return *(const uint8_t *)e ? 0.0f : -INFINITY;
  case KVA_F32: return *(const float *)e;
  case KVA_BF16: return simd_bf16f(*(const uint16_t *)e);
  default: return kva_f16_to_f32(*(const uint16_t *)e);
  }
}

static void KFN(attend_generic)(const kva_item *it) {
  const kva_problem *p = it->p;
  const kva_source *src = it->src;
  const int64_t Dk = p->Dk, Dv = p->Dv, rows = it->rows, nq = p->rep * rows;
  const int64_t SF = KVA_STATE_FLOATS(Dv);
  float *qf = it->scratch;        /* [nq][Dk] scaled queries */
  float *kt = qf + nq * Dk;       /* [T][Dk] */
  float *vt = kt + KVA_TILE * Dk; /* [T][Dv] */
  float *S = vt + KVA_TILE * Dv;  /* [nq][T] */
  for (int64_t j = 0; j < nq; ++j) {
    int64_t h = it->hk * p->rep + j / rows, i = it->i0 + j % rows;
    for (int64_t d = 0; d < Dk; ++d)
      qf[j * Dk + d] = p->scale * kva_load_f(kva_at4(p->q, it->b, h, i, d), p->q->dtype);
    kva_softmax_init(it->state + j * SF, (int)Dv);
  }
  const int32_t *seg = simd_segments_row(p, it->b);
  const int64_t pos0 = it->len - p->L; /* position of row 0 */
  const int64_t pmin = pos0 + it->i0, pmax = pos0 + it->i0 + rows - 1;
  const int32_t win = p->mask.window;
  kva_span sp;
  for (int64_t t = it->t0; t < it->t1; t += sp.n) {
    src->span_at(src, it->b, it->hk, t, it->t1, &sp);
    for (int64_t r0 = 0; r0 < sp.n; r0 += KVA_TILE) {
      const int64_t n = sp.n - r0 < KVA_TILE ? sp.n - r0 : KVA_TILE, tf = sp.t0 + r0;
      /* Mask class of the tile: all visible, or per element. */
      int full = 1;
      if (p->mask.kind == KVA_MASK_ARRAY) full = 0;
      else if (kva_causal_family(p->mask.kind))
        full = simd_tile_all_visible(tf, n, kva_causal_all_upto(p, it->len, pmin), pmax, win);
      for (int64_t r = 0; r < n; ++r) {
        int64_t rr = r0 + r;
        decode_row(&src->kf, sp.k + rr * sp.k_rs, sp.ks ? sp.ks + rr * sp.ks_rs : NULL,
                   sp.kb ? sp.kb + rr * sp.kb_rs : NULL, kt + r * Dk);
      }
      for (int64_t j = 0; j < nq; ++j) {
        const float *qj = qf + j * Dk;
        for (int64_t r = 0; r < n; ++r) {
          const float *kr = kt + r * Dk;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < Dk; ++d) acc += qj[d] * kr[d];
          S[j * KVA_TILE + r] = acc;
        }
      }
      if (p->softcap > 0.0f) simd_softcap(S, nq, KVA_TILE, n, p->softcap);
      if (!full) {
        for (int64_t j = 0; j < nq; ++j) {
          const int64_t h = it->hk * p->rep + j / rows, i = it->i0 + j % rows;
          for (int64_t r = 0; r < n; ++r) {
            float *s = &S[j * KVA_TILE + r];
            if (p->mask.kind == KVA_MASK_ARRAY) {
              const float add = array_mask_add(p, it->b, h, i, tf + r);
              *s = add == -INFINITY ? -INFINITY : *s + add;
            } else if (!kva_causal_visible(tf + r, pos0 + i, win, seg, p->mask.segments_clamp,
                                           kva_tree_row(p, it->b, i), pos0)) {
              *s = -INFINITY;
            }
          }
        }
      }
      if (!simd_online_softmax(S, KVA_TILE, n, nq, it->state, SF, Dv)) continue;
      for (int64_t r = 0; r < n; ++r) {
        int64_t rr = r0 + r;
        decode_row(&src->vf, sp.v + rr * sp.v_rs, sp.vs ? sp.vs + rr * sp.vs_rs : NULL,
                   sp.vb ? sp.vb + rr * sp.vb_rs : NULL, vt + r * Dv);
      }
      for (int64_t j = 0; j < nq; ++j) {
        float *o = it->state + j * SF + 2;
        const float *pj = S + j * KVA_TILE;
        for (int64_t r = 0; r < n; ++r) {
          const float pr = pj[r];
          if (pr == 0.0f) continue; /* masked (or underflowed) keys add nothing */
          const float *vr = vt + r * Dv;
#pragma omp simd
          for (int64_t d = 0; d < Dv; ++d) o[d] += pr * vr[d];
        }
      }
    }
  }
}

const kva_cpu_kernels CAT(kva_cpu_kernels, KVA_SIMD_LEVEL) = {
    .level = KVA_LEVEL_NAME,
    .generic = KFN(attend_generic),
    .fast = KFN(select_fast),
    .fast_name = KFN(fast_name),
};
