/* Shared by the kernel files of src/cpu/simd/, each compiled once per SIMD
 * level (KVA_SIMD_LEVEL = portable | avx2 | avxvnni | avx512): symbol naming, element
 * loads, mask classification of a tile and the online-softmax tile update. */
#ifndef KVA_CPU_SIMD_H
#define KVA_CPU_SIMD_H

#include "cpu/kernel.h"

#include <math.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define CAT2(a, b) a##_##b
#define CAT(a, b) CAT2(a, b)
#define KFN(name) CAT(name, KVA_SIMD_LEVEL)
#define STR2(x) #x
#define STR(x) STR2(x)
#define KVA_LEVEL_NAME STR(KVA_SIMD_LEVEL)
#define ALWAYS static inline __attribute__((always_inline))

/* Specialized kernels of this level (fast.c); NULL when none applies. */
kva_item_fn KFN(select_fast)(const kva_problem *p);
/* The name of what KFN(select_fast) picks ("fused kernel" or "AMX kernel
 * (bf16 tiles)"), NULL for none. */
const char *KFN(fast_name)(const kva_problem *p);
/* The AMX verify kernel (amx.c) for these row formats, or NULL. */
kva_item_fn KFN(select_amx)(const kva_problem *p, const kva_rowfmt *kf, const kva_rowfmt *vf);

static inline float simd_bf16f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float simd_load_scale(const char *base, kva_dtype dt, int64_t g) {
  switch (dt) {
  case KVA_F32: return ((const float *)base)[g];
  case KVA_BF16: return simd_bf16f(((const uint16_t *)base)[g]);
  default: return kva_f16_to_f32(((const uint16_t *)base)[g]);
  }
}

/* The integer kernels' query rounding ("q int8", kvattn.h kva_ref_rounding):
 * dims g0 .. g0 + G - 1 of q as s8 codes c8[d] = rint(q[d] / sigma) clamped
 * to +-127, sigma = max|q_g| / 127 (in f32); *sum: their sum. Returns the
 * group's factor scale * sigma: 0 when 1 / sigma is 0 or not finite (the
 * codes then all 0: an all-zero group, or max|q_g| below ~2^-119), NaN when
 * the query has a non-finite element (finite == 0). */
static inline float simd_query_group_s8(const float *q, int64_t g0, int64_t G, int finite, float scale, int8_t *c8,
                                        int *sum) {
  float amax = 0.0f;
  for (int64_t d = g0; d < g0 + G; ++d) amax = fabsf(q[d]) > amax ? fabsf(q[d]) : amax;
  const float sig = amax / 127.0f;
  float inv = sig > 0.0f ? 1.0f / sig : 0.0f;
  if (!finite || isinf(inv)) inv = 0.0f;
  int s = 0;
  for (int64_t d = g0; d < g0 + G; ++d) {
    float c = inv == 0.0f ? 0.0f : rintf(q[d] * inv); /* (inv 0: also where q[d] is infinite) */
    c = c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c;
    c8[d] = (int8_t)c;
    s += (int)c;
  }
  *sum = s;
  return !finite ? NAN : inv == 0.0f ? 0.0f : scale * sig;
}

#ifdef __AVX2__
/* simd_query_group_s8 for a finite query and a group of a multiple of 32
 * elements, 8 lanes at a time (AVX2 and above): the same f32 steps (max
 * |q|, sigma = max / 127, inv = 1 / sigma, rint(q * inv) clamped), bit for
 * bit. */
static inline float simd_query_group_s8_32(const float *q, int64_t g0, int64_t G, float scale, int8_t *c8, int *sum) {
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_setzero_ps();
  for (int64_t d = g0; d < g0 + G; d += 8) mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(q + d), absm), mx);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))), sig = amax / 127.0f;
  float inv = sig > 0.0f ? 1.0f / sig : 0.0f;
  if (isinf(inv)) inv = 0.0f;
  if (inv == 0.0f) {
    memset(c8 + g0, 0, (size_t)G);
    *sum = 0;
    return 0.0f;
  }
  const __m256 iv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i acc = _mm256_setzero_si256();
  for (int64_t d = g0; d < g0 + G; d += 32) {
    __m256i c[4];
    for (int u = 0; u < 4; ++u) {
      const __m256 x = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(q + d + u * 8), iv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[u] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(x, lo), hi));
      acc = _mm256_add_epi32(acc, c[u]);
    }
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i *)(c8 + d), _mm256_permutevar8x32_epi32(b, order));
  }
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  *sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
  return scale * sig;
}

#endif

static inline const int32_t *simd_segments_row(const kva_problem *p, int64_t b) {
  if (!p->mask.segments.data) return NULL;
  return (const int32_t *)((const char *)p->mask.segments.data + b * p->mask.segments.stride[0]);
}

/* The row formats of a problem's K and V (a paged view's come from its pool). */
static inline void simd_rowfmts(const kva_problem *p, kva_rowfmt *kf, kva_rowfmt *vf) {
  if (p->kv->layout == KVA_LAYOUT_PAGED) {
    kva_source s;
    kva_source_paged(&s, p->kv);
    *kf = s.kf;
    *vf = s.vf;
    return;
  }
  *kf = kva_rowfmt_of(&p->kv->k);
  *vf = kva_rowfmt_of(&p->kv->v);
}

/* Row addresses of token t of one (sequence, KV head): k, ks, kb, v, vs, vb
 * (the order of KVA_ARR_*; ks..vb NULL for float rows). */
typedef union kva_rows {
  struct {
    const char *k, *ks, *kb, *v, *vs, *vb;
  };
  const char *a[KVA_ARRS];
} kva_rows;

/* A row cursor over one (sequence, KV head), for kernels whose tiles run
 * across span (paged block) boundaries. It keeps the span that holds the
 * last token looked up (the rest of its block, or [t, t1) when contiguous)
 * and computes the next span inline from the source's row map: one table
 * load, a shift (power-of-two blocks) and two multiply-adds per array; rows
 * inside a span are one add of the row stride apart. */
typedef struct kva_cursor {
  kva_seqmap m;
  int64_t t1;              /* end of the item's range: spans stop there */
  int64_t s0, s1;          /* tokens [s0, s1) of the current span */
  const char *a[KVA_ARRS]; /* row addresses of token s0 (NULL: unused array) */
} kva_cursor;

static inline void kva_cursor_init(kva_cursor *c, const kva_source *src, int64_t b, int64_t hk, int64_t t1) {
  src->seqmap(src, b, hk, &c->m);
  c->t1 = t1;
  c->s0 = c->s1 = 0;
}
/* Moves the cursor to the span that starts at token t. */
static inline void kva_cursor_seek(kva_cursor *c, int64_t t) {
  const kva_seqmap *m = &c->m;
  int64_t blk = 0, row = t, end = c->t1;
  if (m->ids) {
    const int64_t r = m->first + t, slot = m->shift >= 0 ? r >> m->shift : r / m->bs;
    row = r - slot * m->bs;
    blk = m->ids[slot];
    if (t + m->bs - row < end) end = t + m->bs - row;
  }
  for (int a = 0; a < KVA_ARRS; ++a)
    c->a[a] = m->base[a] ? m->base[a] + blk * m->bstride[a] + row * m->rstride[a] : NULL;
  c->s0 = t;
  c->s1 = end;
}
/* Row addresses of tokens [t, t+n): by stride within a span, with a seek
 * at each span boundary; the six arrays' addresses of a row as two integer
 * vectors (4 + 2 lanes) advanced by their strides, one add and one store
 * each per row (an unused array: address and stride 0, NULL throughout). */
typedef uintptr_t kva_addr4 __attribute__((vector_size(4 * sizeof(uintptr_t))));
typedef uintptr_t kva_addr2 __attribute__((vector_size(2 * sizeof(uintptr_t))));
_Static_assert(KVA_ARRS == 6, "kva_cursor_tile: 4 + 2 arrays");
static inline void kva_cursor_tile(kva_cursor *c, int64_t t, int64_t n, kva_rows *rows) {
  for (int64_t r = 0; r < n;) {
    const int64_t tt = t + r;
    if (tt < c->s0 || tt >= c->s1) kva_cursor_seek(c, tt);
    const int64_t off = tt - c->s0, run = c->s1 - tt < n - r ? c->s1 - tt : n - r;
    uintptr_t x[KVA_ARRS], s[KVA_ARRS];
    for (int a = 0; a < KVA_ARRS; ++a) {
      s[a] = c->a[a] ? (uintptr_t)c->m.rstride[a] : 0;
      x[a] = c->a[a] ? (uintptr_t)c->a[a] + (uintptr_t)off * s[a] : 0;
    }
    kva_addr4 x4 = {x[0], x[1], x[2], x[3]}, s4 = {s[0], s[1], s[2], s[3]};
    kva_addr2 x2 = {x[4], x[5]}, s2 = {s[4], s[5]};
    for (int64_t u = 0; u < run; ++u, x4 += s4, x2 += s2) {
      memcpy(&rows[r + u].a[0], &x4, sizeof x4);
      memcpy(&rows[r + u].a[4], &x2, sizeof x2);
    }
    r += run;
  }
}

/* Causal family: are keys [tf, tf+n) visible to every row with positions
 * pmin..pmax? upto = kva_causal_all_upto (pmin for CAUSAL, the last prefix
 * key for TREE). (Segments only add visibility, so this stays exact.) */
static inline int simd_tile_all_visible(int64_t tf, int64_t n, int64_t upto, int64_t pmax, int32_t win) {
  return tf + n - 1 <= upto && (win <= 0 || tf > pmax - win);
}

/* Causal family for a fused kernel's tile: S[j][r] = -inf (row stride KVA_TILE)
 * for each key tf + r (r < n) that query vector j (row it->i0 + j % rows, at
 * position len - L + that row) does not see; nothing to do when every row
 * of the item sees the whole tile. seg: simd_segments_row of the item. */
static inline void simd_mask_tile(const kva_item *it, const int32_t *seg, float *S, int64_t nq, int64_t tf,
                                  int64_t n) {
  const kva_problem *p = it->p;
  if (!kva_causal_family(p->mask.kind)) return;
  const int64_t n0 = it->len - p->L, pmin = n0 + it->i0, pmax = pmin + it->rows - 1;
  const int32_t win = p->mask.window;
  if (simd_tile_all_visible(tf, n, kva_causal_all_upto(p, it->len, pmin), pmax, win)) return;
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t i = it->i0 + j % it->rows;
    const uint32_t *tree = kva_tree_row(p, it->b, i);
    for (int64_t r = 0; r < n; ++r)
      if (!kva_causal_visible(tf + r, n0 + i, win, seg, p->mask.segments_clamp, tree, n0))
        S[j * KVA_TILE + r] = -INFINITY;
  }
}

/* S[j][r] = c * tanh(S[j][r] / c) for the n valid columns. */
static inline void simd_softcap(float *S, int64_t nq, int64_t ld, int64_t n, float c) {
  const float inv = 1.0f / c;
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t r = 0; r < n; ++r) S[j * ld + r] = c * tanhf(S[j * ld + r] * inv);
}

/* Online-softmax update for one tile: for each vector j, S[j] (logits, -inf
 * where masked) becomes P = exp(S - m_new), and its state's m, l, o are
 * rescaled. Returns 0 when no vector sees any key of the tile. */
static inline int simd_online_softmax(float *S, int64_t ld, int64_t n, int64_t nq, float *state,
                                      int64_t SF, int64_t Dv) {
  int any = 0;
  for (int64_t j = 0; j < nq; ++j) {
    float *st = state + j * SF, *s = S + j * ld;
    float mx = -INFINITY;
    for (int64_t r = 0; r < n; ++r) mx = (s[r] > mx || s[r] != s[r]) ? s[r] : mx;
    if (mx == -INFINITY) { /* nothing visible for this vector in this tile */
      for (int64_t r = 0; r < n; ++r) s[r] = 0.0f;
      continue;
    }
    any = 1;
    float mn, a_old, a_new;
    kva_softmax_factors(st[0], mx, &mn, &a_old, &a_new);
    float sum = 0.0f;
    for (int64_t r = 0; r < n; ++r) {
      s[r] = expf(s[r] - mn);
      sum += s[r];
    }
    st[0] = mn;
    st[1] = st[1] * a_old + sum;
    if (a_old != 1.0f)
      for (int64_t d = 0; d < Dv; ++d) st[2 + d] *= a_old;
  }
  return any;
}
#endif
