/* Eight f32 / i32 lanes for the fused kernel of fast8.c, the operations it
 * needs and no more:
 * - at the avx2 level one ymm register each, AVX2 + FMA + F16C intrinsics
 *   (the same instructions the kernel used before this layer existed);
 * - elsewhere (the portable level: any C11 compiler with GCC's vector
 *   extensions, i.e. gcc and clang) a pair of 16-byte generic vectors per
 *   8 lanes, each a register: SSE2 on x86-64, NEON (with fused
 *   multiply-add) on aarch64. f16 lanes are converted by aarch64's __fp16,
 *   else one at a time (kva_f16_to_f32).
 * Masks (v8f_nlt, v8f_neq0, v8f_isnan, v8i_eq) are all-ones / all-zero
 * lanes; v8f_blend and v8f_and take such masks. Lane order is memory order;
 * little-endian only (the bf16 split loads take element 2i from the low
 * half of 32-bit word i). */
#ifndef KVA_CPU_VEC8_H
#define KVA_CPU_VEC8_H

#include "cpu/simd/simd.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the fused CPU kernel assumes a little-endian target"
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
typedef __m256 v8f;
typedef __m256i v8i;

ALWAYS v8f v8f_load(const float *p) { return _mm256_loadu_ps(p); }
ALWAYS void v8f_store(float *p, v8f v) { _mm256_storeu_ps(p, v); }
ALWAYS v8f v8f_set1(float x) { return _mm256_set1_ps(x); }
ALWAYS v8f v8f_bcast(const float *p) { return _mm256_broadcast_ss(p); }
ALWAYS v8f v8f_zero(void) { return _mm256_setzero_ps(); }
ALWAYS v8f v8f_add(v8f a, v8f b) { return _mm256_add_ps(a, b); }
ALWAYS v8f v8f_sub(v8f a, v8f b) { return _mm256_sub_ps(a, b); }
ALWAYS v8f v8f_mul(v8f a, v8f b) { return _mm256_mul_ps(a, b); }
ALWAYS v8f v8f_fma(v8f a, v8f b, v8f c) { return _mm256_fmadd_ps(a, b, c); }   /* a*b + c */
ALWAYS v8f v8f_fnma(v8f a, v8f b, v8f c) { return _mm256_fnmadd_ps(a, b, c); } /* c - a*b */
ALWAYS v8f v8f_max(v8f a, v8f b) { return _mm256_max_ps(a, b); }
ALWAYS v8f v8f_min(v8f a, v8f b) { return _mm256_min_ps(a, b); }
ALWAYS v8f v8f_and(v8f a, v8f m) { return _mm256_and_ps(a, m); }
ALWAYS v8f v8f_or(v8f a, v8f b) { return _mm256_or_ps(a, b); }
ALWAYS v8f v8f_nlt(v8f a, v8f b) { return _mm256_cmp_ps(a, b, _CMP_NLT_UQ); } /* !(a < b): a >= b or NaN */
ALWAYS v8f v8f_neq0(v8f a) { return _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_NEQ_UQ); }
ALWAYS v8f v8f_isnan(v8f a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
ALWAYS v8f v8f_blend(v8f a, v8f b, v8f m) { return _mm256_blendv_ps(a, b, m); } /* m ? b : a */
ALWAYS int v8f_any(v8f m) { return _mm256_movemask_ps(m) != 0; }
/* Nearest integer (ties to even) as float. */
ALWAYS v8f v8f_round(v8f a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* Lane w = g[idx[w]]: the group values of a chunk's 8 words, idx the
 * chunk's group pattern (wpg words per group: 2 or 4, groups whole within a
 * chunk; the generic form uses wpg, AVX2 one permute by idx). g has 8
 * readable floats (the kernel's group tables are padded). */
ALWAYS v8f v8f_groups(const float *g, v8i idx, int wpg) {
  (void)wpg;
  return _mm256_permutevar8x32_ps(_mm256_loadu_ps(g), idx);
}

ALWAYS v8i v8i_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* Lanes whose mask is set loaded, the others 0 (no access past them). */
ALWAYS v8i v8i_maskload(const void *p, v8i m) { return _mm256_maskload_epi32((const int *)p, m); }
ALWAYS v8i v8i_set1(int32_t x) { return _mm256_set1_epi32(x); }
ALWAYS v8i v8i_zero(void) { return _mm256_setzero_si256(); }
ALWAYS v8i v8i_add(v8i a, v8i b) { return _mm256_add_epi32(a, b); }
ALWAYS v8i v8i_and(v8i a, v8i b) { return _mm256_and_si256(a, b); }
ALWAYS v8i v8i_or(v8i a, v8i b) { return _mm256_or_si256(a, b); }
ALWAYS v8i v8i_srl(v8i a, int n) { return _mm256_srli_epi32(a, n); } /* logical */
ALWAYS v8i v8i_sll(v8i a, int n) { return _mm256_slli_epi32(a, n); }
ALWAYS v8i v8i_eq(v8i a, v8i b) { return _mm256_cmpeq_epi32(a, b); }
ALWAYS int v8i_any(v8i a) { return !_mm256_testz_si256(a, a); }
ALWAYS v8f v8i_as_f(v8i a) { return _mm256_castsi256_ps(a); }
ALWAYS v8i v8f_as_i(v8f a) { return _mm256_castps_si256(a); }
ALWAYS v8f v8i_to_f(v8i a) { return _mm256_cvtepi32_ps(a); }
/* Integral lanes (v8f_round's results) as int32. */
ALWAYS v8i v8f_to_i(v8f a) { return _mm256_cvtps_epi32(a); }

/* 8 f16 / bf16 values as f32. */
ALWAYS v8f v8f_from_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
/* 8 fp8 codes as f32, exact: e5m2 is the high byte of an f16; e4m3's
 * exponent and mantissa go under the f16 ones (the value / 2^8, exact in
 * f16, subnormal codes as f16 subnormals), then times 2^8; 0x7f / 0xff NaN. */
ALWAYS v8f v8f_from_fp8(const uint8_t *p, int e4m3) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
  if (!e4m3) return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
  const __m128i em = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(em, 7));
  const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(em, _mm_set1_epi16(0x7f))));
  return _mm256_blendv_ps(v, _mm256_set1_ps(NAN), nan);
}
ALWAYS v8f v8f_from_bf16(const uint16_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
/* 4 f16 (f16 != 0) or bf16 values as f32 into dst[0..4). */
ALWAYS void v4_from_half(const uint16_t *p, int f16, float *dst) {
  const __m128i x = _mm_loadl_epi64((const __m128i *)p);
  _mm_storeu_ps(dst, f16 ? _mm_cvtph_ps(x) : _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), x)));
}
/* Lane t of the result = the sum of the 8 lanes of v[t]. */
ALWAYS v8f v8f_reduce8(const v8f v[8]) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
ALWAYS float v8f_hmax(v8f v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
ALWAYS float v8f_hsum(v8f v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#else /* generic vectors: two 16-byte halves */
/* 16-byte vectors are native on every SIMD target (SSE2, NEON), so each
 * half lives in a register; 32-byte generic vectors did not: GCC kept them
 * in memory and converted int -> float one lane at a time on aarch64. */
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef uint32_t v4u __attribute__((vector_size(16)));
typedef struct v8f {
  v4f lo, hi; /* lanes 0-3, 4-7 */
} v8f;
typedef struct v8i {
  v4i lo, hi;
} v8i;
#define V8_HALVES(T, a, b) ((T){(a), (b)})

ALWAYS v8f v8f_load(const float *p) {
  v8f r;
  memcpy(&r.lo, p, 16);
  memcpy(&r.hi, p + 4, 16);
  return r;
}
ALWAYS void v8f_store(float *p, v8f v) {
  memcpy(p, &v.lo, 16);
  memcpy(p + 4, &v.hi, 16);
}
ALWAYS v8f v8f_set1(float x) {
  const v4f h = {x, x, x, x};
  return V8_HALVES(v8f, h, h);
}
ALWAYS v8f v8f_bcast(const float *p) { return v8f_set1(*p); }
ALWAYS v8f v8f_zero(void) { return v8f_set1(0.0f); }
ALWAYS v8f v8f_add(v8f a, v8f b) { return V8_HALVES(v8f, a.lo + b.lo, a.hi + b.hi); }
ALWAYS v8f v8f_sub(v8f a, v8f b) { return V8_HALVES(v8f, a.lo - b.lo, a.hi - b.hi); }
ALWAYS v8f v8f_mul(v8f a, v8f b) { return V8_HALVES(v8f, a.lo * b.lo, a.hi * b.hi); }
/* Contracted to one fused operation where the target has it (-ffp-contract=fast). */
ALWAYS v8f v8f_fma(v8f a, v8f b, v8f c) { return V8_HALVES(v8f, a.lo * b.lo + c.lo, a.hi * b.hi + c.hi); }
ALWAYS v8f v8f_fnma(v8f a, v8f b, v8f c) { return V8_HALVES(v8f, c.lo - a.lo * b.lo, c.hi - a.hi * b.hi); }
ALWAYS v8i v8f_as_i(v8f a) { return V8_HALVES(v8i, (v4i)a.lo, (v4i)a.hi); } /* same-size vector casts: bits */
ALWAYS v8f v8i_as_f(v8i a) { return V8_HALVES(v8f, (v4f)a.lo, (v4f)a.hi); }
ALWAYS v4f v4_select(v4i m, v4f a, v4f b) { return (v4f)(((v4i)a & m) | ((v4i)b & ~m)); } /* m ? a : b */
/* As the x86 instructions: the second operand when either is NaN. */
ALWAYS v8f v8f_max(v8f a, v8f b) {
  return V8_HALVES(v8f, v4_select(a.lo > b.lo, a.lo, b.lo), v4_select(a.hi > b.hi, a.hi, b.hi));
}
ALWAYS v8f v8f_min(v8f a, v8f b) {
  return V8_HALVES(v8f, v4_select(a.lo < b.lo, a.lo, b.lo), v4_select(a.hi < b.hi, a.hi, b.hi));
}
ALWAYS v8f v8f_and(v8f a, v8f m) {
  return V8_HALVES(v8f, (v4f)((v4i)a.lo & (v4i)m.lo), (v4f)((v4i)a.hi & (v4i)m.hi));
}
ALWAYS v8f v8f_or(v8f a, v8f b) { return V8_HALVES(v8f, (v4f)((v4i)a.lo | (v4i)b.lo), (v4f)((v4i)a.hi | (v4i)b.hi)); }
ALWAYS v8f v8f_nlt(v8f a, v8f b) { return V8_HALVES(v8f, (v4f)~(a.lo < b.lo), (v4f)~(a.hi < b.hi)); }
ALWAYS v8f v8f_neq0(v8f a) { /* true for NaN */
  const v4f z = {0.0f, 0.0f, 0.0f, 0.0f};
  return V8_HALVES(v8f, (v4f)(a.lo != z), (v4f)(a.hi != z));
}
ALWAYS v8f v8f_isnan(v8f a) { return V8_HALVES(v8f, (v4f)(a.lo != a.lo), (v4f)(a.hi != a.hi)); }
ALWAYS v8f v8f_blend(v8f a, v8f b, v8f m) { /* m ? b : a */
  return V8_HALVES(v8f, v4_select((v4i)m.lo, b.lo, a.lo), v4_select((v4i)m.hi, b.hi, a.hi));
}
ALWAYS int v4i_any(v4i m) { return (m[0] | m[1] | m[2] | m[3]) != 0; }
ALWAYS int v8f_any(v8f m) { return v4i_any((v4i)m.lo | (v4i)m.hi); }
/* Nearest integer (ties to even) as float, for |a| < 2^22 (exp8's range):
 * adding and subtracting 1.5 * 2^23 rounds in the current (nearest) mode
 * (the build has no -ffast-math, so the two are not folded). */
ALWAYS v8f v8f_round(v8f a) {
  const v8f magic = v8f_set1(12582912.0f);
  return v8f_sub(v8f_add(a, magic), magic);
}
/* Lane w = g[idx[w]] (see the AVX2 form): with 4 words per group each half
 * is one group, with 2 each half holds two (constant shuffles); idx itself
 * only for other patterns (lane by lane). Lanes past a row's last group
 * read the table's zero padding where idx repeats the last group: those
 * words' codes are 0 (masked loads) and their lanes are discarded. */
ALWAYS v8f v8f_groups(const float *g, v8i idx, int wpg) {
  if (wpg == 4) {
    const v4f a = {g[0], g[0], g[0], g[0]}, b = {g[1], g[1], g[1], g[1]};
    return V8_HALVES(v8f, a, b);
  }
  v4f x;
  memcpy(&x, g, 16);
  if (wpg == 2) return V8_HALVES(v8f, __builtin_shufflevector(x, x, 0, 0, 1, 1), __builtin_shufflevector(x, x, 2, 2, 3, 3));
  float t[8], r[8];
  int32_t ix[8];
  memcpy(t, g, sizeof t);
  memcpy(ix, &idx.lo, 16);
  memcpy(ix + 4, &idx.hi, 16);
  for (int i = 0; i < 8; ++i) r[i] = t[ix[i] & 7];
  return v8f_load(r);
}

ALWAYS v8i v8i_load(const void *p) {
  v8i v;
  memcpy(&v.lo, p, 16);
  memcpy(&v.hi, (const char *)p + 16, 16);
  return v;
}
/* Lanes whose mask is set loaded, the others 0 (no access past them). */
ALWAYS v8i v8i_maskload(const void *p, v8i m) {
  int32_t w[8] = {0}, k[8];
  memcpy(k, &m.lo, 16);
  memcpy(k + 4, &m.hi, 16);
  for (int i = 0; i < 8; ++i)
    if (k[i]) memcpy(&w[i], (const char *)p + 4 * i, 4);
  return v8i_load(w);
}
ALWAYS v8i v8i_set1(int32_t x) {
  const v4i h = {x, x, x, x};
  return V8_HALVES(v8i, h, h);
}
ALWAYS v8i v8i_zero(void) { return v8i_set1(0); }
ALWAYS v8i v8i_add(v8i a, v8i b) { return V8_HALVES(v8i, a.lo + b.lo, a.hi + b.hi); }
ALWAYS v8i v8i_and(v8i a, v8i b) { return V8_HALVES(v8i, a.lo & b.lo, a.hi & b.hi); }
ALWAYS v8i v8i_or(v8i a, v8i b) { return V8_HALVES(v8i, a.lo | b.lo, a.hi | b.hi); }
ALWAYS v8i v8i_srl(v8i a, int n) { /* logical */
  return V8_HALVES(v8i, (v4i)((v4u)a.lo >> (uint32_t)n), (v4i)((v4u)a.hi >> (uint32_t)n));
}
ALWAYS v8i v8i_sll(v8i a, int n) {
  return V8_HALVES(v8i, (v4i)((v4u)a.lo << (uint32_t)n), (v4i)((v4u)a.hi << (uint32_t)n));
}
ALWAYS v8i v8i_eq(v8i a, v8i b) { return V8_HALVES(v8i, a.lo == b.lo, a.hi == b.hi); }
ALWAYS int v8i_any(v8i a) { return v4i_any(a.lo | a.hi); }
ALWAYS v8f v8i_to_f(v8i a) {
  return V8_HALVES(v8f, __builtin_convertvector(a.lo, v4f), __builtin_convertvector(a.hi, v4f));
}
/* Integral lanes (v8f_round's results) as int32: exact. */
ALWAYS v8i v8f_to_i(v8f a) {
  return V8_HALVES(v8i, __builtin_convertvector(a.lo, v4i), __builtin_convertvector(a.hi, v4i));
}

/* 8 f16 / bf16 values as f32 (f16: the target's half type where it has
 * one, aarch64's __fp16, exact; else lane by lane). */
/* 8 fp8 codes as f32, exact (the library's conversions, one at a time). */
ALWAYS v8f v8f_from_fp8(const uint8_t *p, int e4m3) {
  float x[8];
  for (int i = 0; i < 8; ++i) x[i] = e4m3 ? kva_f8e4m3_to_f32(p[i]) : kva_f8e5m2_to_f32(p[i]);
  return v8f_load(x);
}
ALWAYS v8f v8f_from_f16(const uint16_t *p) {
  float r[8];
#if defined(__aarch64__)
  __fp16 h[8];
  memcpy(h, p, sizeof h);
  for (int i = 0; i < 8; ++i) r[i] = (float)h[i];
#else
  for (int i = 0; i < 8; ++i) r[i] = kva_f16_to_f32(p[i]);
#endif
  return v8f_load(r);
}
ALWAYS v8f v8f_from_bf16(const uint16_t *p) {
  uint32_t u[8];
  for (int i = 0; i < 8; ++i) u[i] = (uint32_t)p[i] << 16;
  return v8i_as_f(v8i_load(u));
}
ALWAYS void v4_from_half(const uint16_t *p, int f16, float *dst) {
  for (int i = 0; i < 4; ++i) dst[i] = f16 ? kva_f16_to_f32(p[i]) : simd_bf16f(p[i]);
}
ALWAYS float v4_hsum(v4f v) { return (v[0] + v[1]) + (v[2] + v[3]); }
/* Lane t of the result = the sum of the 8 lanes of v[t]. */
ALWAYS v8f v8f_reduce8(const v8f v[8]) {
  float r[8];
  for (int t = 0; t < 8; ++t) r[t] = v4_hsum(v[t].lo + v[t].hi);
  return v8f_load(r);
}
ALWAYS float v8f_hmax(v8f v) {
  const v4f m = v4_select(v.lo > v.hi, v.lo, v.hi);
  const float a = m[0] > m[1] ? m[0] : m[1], b = m[2] > m[3] ? m[2] : m[3];
  return a > b ? a : b;
}
ALWAYS float v8f_hsum(v8f v) { return v4_hsum(v.lo + v.hi); }
#endif

#endif
