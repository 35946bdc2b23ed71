/* AVX-512 helpers shared by the fast kernels of this level (fast.c, amx.c):
 * the permuted layout of quantized rows, group scale/bias loads, float row
 * loads and a vector exp (tiles and software prefetch: tiles.h). Included
 * only where __AVX512F__/__AVX512BW__/__AVX512VL__ are defined. */
#ifndef KVA_CPU_AVX512_H
#define KVA_CPU_AVX512_H

#include "cpu/simd/simd.h"
#include "cpu/simd/tiles.h"

#define LANES 16
#define MAXCH 32   /* chunks of 16 words per row: 512 dims at 8 bits */

/* Whether an item over V rows vf takes fast.c's vphase_pint (16-bit
 * queries, not exact mode: q16): 0 no, 1 yes, 2 yes with two groups per
 * code vector (8 words per group). Rows it takes in integers: 4-bit in
 * groups of a multiple of 64, 8-bit of 32 (amx.c's selector bar too). */
static inline int pint_kind(const kva_rowfmt *vf, int q16) {
  const int64_t wpg = vf->bits ? vf->group * vf->bits / 32 : 0; /* code words per group */
  if (!q16 || (vf->bits != 4 && vf->bits != 8) || wpg % 8) return 0;
  return wpg == 8 ? 2 : 1;
}

typedef struct fmt_plan {
  int bits, E, nch, ngroups, G;  /* E codes per word; nch chunks of 16 words */
  int P;                          /* permuted row length: nch * E * 16 (float rows: D) */
  int exact;                      /* codes converted exactly (f32 queries, exact mode), see code_as_float */
  int vnni;                       /* quantized K, 16-bit queries (fast.c only): q.k in integers (chunk_dots_vnni) */
  int tok;                        /* vnni with enough query vectors (fast.c only): q.k with tokens in lanes
                                     (kphase_tok) */
  int rl;                         /* vnni, fewer vectors, 4-bit / 8-bit codes (fast.c only): q.k with rows in
                                     lanes (kphase_rl) */
  int pint;                       /* 4-bit or 8-bit V, 16-bit queries, verify-sized groups (fast.c only): P.V on
                                     s16 weights and the codes (vphase_pint) */
  int bft;                        /* bf16 K rows, bf16 queries, enough query vectors (fast.c only): q.k on
                                     bf16 pairs with tokens in lanes (kphase_bft); qscale scales the dots */
  float qscale;
  int bfp;                        /* bf16 V rows, 16-bit queries, enough query vectors (fast.c only): P.V on
                                     bf16 pairs of two tokens (vphase_bfp) */
  int bfv;                        /* 4-bit V, 16-bit queries, enough query vectors (fast.c only): V values
                                     rounded to bf16, then vphase_bfp's P.V (vphase_bfv) */
  int split;                      /* bf16 float rows (fast.c only): each full block of 32 elements is held
                                     as its 16 even elements, then its 16 odd ones (load_bf16_split) */
  int fp8;                        /* fp8 float rows: codes as f32, the row's scale (rows[t].ks / vs; NULL: 1)
                                     on its scores (K) and on P (V) */
  kva_dtype sdt;                  /* scales dtype (quantized) or element dtype (float) */
  __mmask16 chmask[MAXCH];        /* valid words of each chunk */
  __m512i gidx[MAXCH];            /* group of each lane of each chunk */
  __m512i gidxw[MAXCH];           /* the same as vpermw indices: word 2l+1 = group of lane l (chunk_groups) */
  __mmask32 gmask;                /* the ngroups low words */
} fmt_plan;

static inline void plan_format(const kva_rowfmt *f, fmt_plan *fp) {
  memset(fp, 0, sizeof *fp);
  fp->bits = f->bits;
  if (!f->bits) {
    fp->P = (int)f->D;
    fp->sdt = f->dtype;
    fp->fp8 = kva_is_fp8(f->dtype);
    return;
  }
  const int words = (int)(f->D * f->bits / 32);
  fp->E = 32 / f->bits;
  fp->G = f->group;
  fp->ngroups = (int)(f->D / f->group);
  fp->nch = (words + LANES - 1) / LANES;
  fp->P = fp->nch * fp->E * LANES;
  fp->sdt = f->sdtype;
  for (int c = 0; c < fp->nch; ++c) {
    int valid = words - c * LANES < LANES ? words - c * LANES : LANES;
    fp->chmask[c] = (__mmask16)((1u << valid) - 1u);
    int32_t idx[LANES];
    for (int l = 0; l < LANES; ++l) {
      int g = ((c * LANES + l) * fp->E) / fp->G;
      idx[l] = g < fp->ngroups ? g : fp->ngroups - 1;
    }
    fp->gidx[c] = _mm512_loadu_si512(idx);
    int16_t widx[2 * LANES];
    for (int l = 0; l < LANES; ++l) {
      widx[2 * l] = 0;
      widx[2 * l + 1] = (int16_t)idx[l];
    }
    fp->gidxw[c] = _mm512_loadu_si512(widx);
  }
  fp->gmask = (__mmask32)((1u << fp->ngroups) - 1u);
}

/* Position of element e of a float row of D elements: e itself, or in the
 * split order of a full 32-element block (even elements first). */
static inline int64_t float_pos(const fmt_plan *fp, int64_t D, int64_t e) {
  const int64_t b0 = e - e % 32;
  if (!fp->split || b0 + 32 > D) return e;
  return b0 + (e & 1) * 16 + (e % 32) / 2;
}

/* dst[pos] = src[elem(pos)] * scale in the format's permuted order (zero on
 * padding lanes): element d = w*E + k of word w goes to position
 * ((w / 16) * E + k) * 16 + w % 16. */
static inline void permute_row(const fmt_plan *fp, int64_t D, const float *src, float scale, float *dst) {
  if (!fp->bits) {
    for (int64_t d = 0; d < D; ++d) dst[float_pos(fp, D, d)] = src[d] * scale;
    return;
  }
  memset(dst, 0, sizeof(float) * (size_t)fp->P);
  const int64_t words = D / fp->E;
  for (int64_t w = 0; w < words; ++w)
    for (int k = 0; k < fp->E; ++k) dst[((w / LANES) * fp->E + k) * LANES + w % LANES] = src[w * fp->E + k] * scale;
}
/* The inverse: dst[d] = src[pos(d)] + (bias lane of pos, when given). A
 * whole chunk at E = 8 (4-bit) is an 8 x 16 transpose: per 8 lanes an 8 x 8
 * one (24 shuffles) gives each word's 8 values; at E = 4 (8-bit) 4 x 4
 * ones per 4 lanes. */
static inline void unpermute_row(const fmt_plan *fp, int64_t D, const float *src, const float *bias, float *dst) {
  if (!fp->bits) {
    for (int64_t d = 0; d < D; ++d) dst[d] = src[float_pos(fp, D, d)];
    return;
  }
  const int64_t words = D / fp->E;
  if (bias && (fp->E == 8 || fp->E == 4) && words % LANES == 0) {
    for (int64_t c = 0; c < words / LANES; ++c) {
      const float *sc = src + c * fp->E * LANES, *bc = bias + c * LANES;
      float *dc = dst + c * LANES * fp->E;
      if (fp->E == 8)
        for (int h = 0; h < 2; ++h) {
          __m256 r[8], t[8], u[8];
          for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(sc + k * LANES + 8 * h);
          for (int k = 0; k < 8; k += 2) {
            t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
            t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
          }
          for (int k = 0; k < 8; k += 4) {
            u[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44);
            u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
            u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44);
            u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
          }
          for (int l = 0; l < 4; ++l) { /* lanes 8h + l and 8h + l + 4: words 16c + 8h + l (+ 4) */
            const __m256 v0 = _mm256_permute2f128_ps(u[l], u[4 + l], 0x20), v1 = _mm256_permute2f128_ps(u[l], u[4 + l], 0x31);
            _mm256_storeu_ps(dc + (8 * h + l) * 8, _mm256_add_ps(v0, _mm256_set1_ps(bc[8 * h + l])));
            _mm256_storeu_ps(dc + (8 * h + l + 4) * 8, _mm256_add_ps(v1, _mm256_set1_ps(bc[8 * h + l + 4])));
          }
        }
      else
        for (int g = 0; g < 4; ++g) {
          __m128 r0 = _mm_loadu_ps(sc + 4 * g), r1 = _mm_loadu_ps(sc + LANES + 4 * g);
          __m128 r2 = _mm_loadu_ps(sc + 2 * LANES + 4 * g), r3 = _mm_loadu_ps(sc + 3 * LANES + 4 * g);
          _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
          const __m128 rr[4] = {r0, r1, r2, r3};
          for (int l = 0; l < 4; ++l) _mm_storeu_ps(dc + (4 * g + l) * 4, _mm_add_ps(rr[l], _mm_set1_ps(bc[4 * g + l])));
        }
    }
    return;
  }
  for (int64_t w = 0; w < words; ++w) {
    const int64_t lane = w % LANES, c = w / LANES;
    const float b = bias ? bias[c * LANES + lane] : 0.0f;
    for (int k = 0; k < fp->E; ++k) dst[w * fp->E + k] = src[(c * fp->E + k) * LANES + lane] + b;
  }
}

/* 32 bf16 elements as f32 in split order: the even ones (bf16 in the low
 * half of each dword: a shift left by 16) and the odd ones (already in the
 * high half: an and), one operation per 16 values instead of two. */
ALWAYS void load_bf16_split(const char *p, __m512 *even, __m512 *odd) {
  const __m512i x = _mm512_loadu_si512(p);
  *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}

/* One row of D (a multiple of 16) f32/f16/bf16 values as f32. */
static inline void load_row_f32(const char *row, kva_dtype dt, int64_t D, float *dst);

/* Up to 16 scales/biases of one row as f32 lanes. */
ALWAYS __m512 load_groups(const char *p, kva_dtype dt, int n) {
  const __mmask16 m = (__mmask16)((1u << n) - 1u);
  if (dt == KVA_F32) return _mm512_maskz_loadu_ps(m, p);
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  if (dt == KVA_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The group scales (or biases) at p for the 16 lanes of chunk c, as f32.
 * bf16 groups: one vpermw moves each lane's group value to the high half of
 * its dword (the f32 of a bf16) and zeroes the low half; other dtypes:
 * load_groups and a permute. */
ALWAYS __m512 chunk_groups(const fmt_plan *fp, const char *p, int c) {
  if (fp->sdt == KVA_BF16)
    return _mm512_castsi512_ps(
        _mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, fp->gidxw[c], _mm512_maskz_loadu_epi16(fp->gmask, p)));
  return _mm512_permutexvar_ps(fp->gidx[c], load_groups(p, fp->sdt, fp->ngroups));
}

/* 16 fp8 codes as f32, exact: e5m2 is the high byte of an f16; e4m3's
 * exponent and mantissa go under the f16 ones (the value / 2^8, exact in
 * f16, subnormal codes as f16 subnormals), then times 2^8; 0x7f / 0xff NaN. */
ALWAYS __m512 load_fp8x16(const char *p, kva_dtype dt) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
  if (dt == KVA_F8E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
  const __m256i em = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(em, 7));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
  return _mm512_mask_mov_ps(v, _mm256_cmpeq_epi16_mask(em, _mm256_set1_epi16(0x7f)), _mm512_set1_ps(NAN));
}

/* 16 float elements of a row as f32 (fp8: the codes' values). */
ALWAYS __m512 load_f16x(const char *p, kva_dtype dt) {
  if (dt == KVA_F32) return _mm512_loadu_ps(p);
  if (dt == KVA_F8E4M3 || dt == KVA_F8E5M2) return load_fp8x16(p, dt);
  __m256i h = _mm256_loadu_si256((const __m256i *)p);
  if (dt == KVA_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void load_row_f32(const char *row, kva_dtype dt, int64_t D, float *dst) {
  const int64_t es = (int64_t)kva_dtype_size(dt);
  for (int64_t d = 0; d < D; d += LANES) _mm512_storeu_ps(dst + d, load_f16x(row + d * es, dt));
}

/* exp(x) for a vector: 2^n * p(f), |rel err| < 2e-7; -inf -> 0, NaN -> NaN. */
ALWAYS __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-104.0f), hi = _mm512_set1_ps(88.7f);
  __mmask16 finite_or_nan = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
  __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  xc = _mm512_mask_mov_ps(xc, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x); /* keep NaN */
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(finite_or_nan, _mm512_scalef_ps(p, n));
}

/* Codes as floats in [1, 2): code k (bits wide, lowest first) of each word is
 * moved to the top of the mantissa and given the exponent of 1.0, so
 * f = 1 + c / 2^bits, two operations instead of shift/and/convert. With
 * affine_f the group's affine map is rewritten for f: s*c + b = s'*f + b'. */
ALWAYS __m512 code_f(__m512i x, int k, int bits) {
  const int sh = 23 - bits * (k + 1);
  const __m512i y = sh >= 0 ? _mm512_slli_epi32(x, (unsigned)sh) : _mm512_srli_epi32(x, (unsigned)-sh);
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(y, _mm512_set1_epi32(((1 << bits) - 1) << (23 - bits)),
                                                       _mm512_set1_epi32(0x3f800000), 0xEA)); /* (y & m) | one */
}
/* s' = s * 2^bits, b' = b - s * 2^bits. */
ALWAYS void affine_f(__m512 *sv, __m512 *bv, int bits) {
  const __m512 m = _mm512_set1_ps((float)(1 << bits));
  *bv = _mm512_fnmadd_ps(*sv, m, *bv);
  *sv = _mm512_mul_ps(*sv, m);
}

/* Code k of each word as a float, exact (c itself: shift, mask, convert) or
 * by mantissa placement (f = 1 + c/2^bits with affine_f: one operation
 * fewer, about 3x the rounding error of the plain form). The kernels take
 * the exact form for f32 queries and in exact mode (p->exact), whose callers
 * expect f32 accuracy. */
ALWAYS __m512 code_as_float(__m512i x, int k, int bits, int exact) {
  if (exact)
    return _mm512_cvtepi32_ps(
        _mm512_and_si512(_mm512_srli_epi32(x, (unsigned)(k * bits)), _mm512_set1_epi32((1 << bits) - 1)));
  return code_f(x, k, bits);
}
ALWAYS void affine_for(__m512 *sv, __m512 *bv, int bits, int exact) {
  if (!exact) affine_f(sv, bv, bits);
}

/* Lane t of the result = the sum (MAX: the maximum) of the 16 lanes of v[t]
 * (a shuffle tree; MAX is a constant after inlining). */
ALWAYS __m512 reduce16_op(const __m512 v[16], int MAX) {
#define R16OP(x, y) (MAX ? _mm512_max_ps(x, y) : _mm512_add_ps(x, y))
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] =
        R16OP(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    b[i] =
        R16OP(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = R16OP(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 d = R16OP(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
#undef R16OP
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), d);
}
ALWAYS __m512 reduce16(const __m512 v[16]) { return reduce16_op(v, 0); }
#endif
