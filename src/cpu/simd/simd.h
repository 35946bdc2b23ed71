/* Shared by the kernel files of src/cpu/simd/, each compiled once per SIMD
 * level (KVA_SIMD_LEVEL = portable | avx2 | avx512): symbol naming, element
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

/* Specialized kernels of this level (fast.c); NULL when none applies. */
kva_item_fn KFN(select_fast)(const kva_problem *p);
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

static inline const int32_t *simd_segments_row(const kva_problem *p, int64_t b) {
  if (!p->mask.segments.data) return NULL;
  return (const int32_t *)((const char *)p->mask.segments.data + b * p->mask.segments.stride[0]);
}

/* Row addresses of token t of one (sequence, KV head), looked up through the
 * source's spans (one span_at per run of equally strided rows), for kernels
 * whose tiles may cross span (paged block) boundaries. */
typedef struct kva_rows {
  const char *k, *ks, *kb, *v, *vs, *vb; /* ks..vb NULL for float rows */
} kva_rows;
typedef struct kva_cursor {
  const kva_source *src;
  int64_t b, hk, t1;
  kva_span sp;
} kva_cursor;

static inline void kva_cursor_init(kva_cursor *c, const kva_source *src, int64_t b, int64_t hk, int64_t t1) {
  c->src = src;
  c->b = b;
  c->hk = hk;
  c->t1 = t1;
  c->sp.t0 = 0;
  c->sp.n = 0;
}
static inline kva_rows kva_cursor_row(kva_cursor *c, int64_t t) {
  if (t < c->sp.t0 || t >= c->sp.t0 + c->sp.n) c->src->span_at(c->src, c->b, c->hk, t, c->t1, &c->sp);
  const int64_t r = t - c->sp.t0;
  const kva_span *sp = &c->sp;
  kva_rows w = {sp->k + r * sp->k_rs, sp->ks ? sp->ks + r * sp->ks_rs : NULL, sp->kb ? sp->kb + r * sp->kb_rs : NULL,
                sp->v + r * sp->v_rs, sp->vs ? sp->vs + r * sp->vs_rs : NULL, sp->vb ? sp->vb + r * sp->vb_rs : NULL};
  return w;
}

/* Row addresses of tokens [t, t+n): by stride within a span, with a lookup
 * at each span boundary. */
static inline void kva_cursor_tile(kva_cursor *c, int64_t t, int64_t n, kva_rows *rows) {
  for (int64_t r = 0; r < n;) {
    rows[r] = kva_cursor_row(c, t + r);
    const kva_span *sp = &c->sp;
    int64_t run = sp->t0 + sp->n - (t + r); /* rows left in this span */
    if (run > n - r) run = n - r;
    for (int64_t u = 1; u < run; ++u) {
      const kva_rows *a = &rows[r + u - 1];
      kva_rows *w = &rows[r + u];
      w->k = a->k + sp->k_rs;
      w->v = a->v + sp->v_rs;
      w->ks = a->ks ? a->ks + sp->ks_rs : NULL;
      w->kb = a->kb ? a->kb + sp->kb_rs : NULL;
      w->vs = a->vs ? a->vs + sp->vs_rs : NULL;
      w->vb = a->vb ? a->vb + sp->vb_rs : NULL;
    }
    r += run;
  }
}

/* Causal family: are keys [tf, tf+n) visible to every row with positions
 * pmin..pmax? (Segments only add visibility, so this stays exact.) */
static inline int simd_tile_all_visible(int64_t tf, int64_t n, int64_t pmin, int64_t pmax, int32_t win) {
  return tf + n - 1 <= pmin && (win <= 0 || tf > pmax - win);
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
