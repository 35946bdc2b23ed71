/* The fused decode/verify kernel for AVX2 (+FMA, F16C): 8 f32 lanes. The
 * AVX-512 level has its own (fast.c); this one serves processors without
 * AVX-512 (AMD Zen 2/3, Intel client cores), where the general kernel ran
 * 20-50x slower on quantized caches.
 * Math: per tile of KVA_TILE keys, S = (scale*q)·Kᵀ for the nq = rep*rows
 *   query vectors, softcap, causal-family mask, online softmax (vector exp),
 *   O += P·V. Quantized K uses the affine algebra: with k = s_g*c + b_g,
 *   q·k = sum_g s_g (q_g·c_g) + b_g sum(q_g), the codes converted to f32
 *   exactly (shift, and, convert; the same for every query dtype: 16-bit
 *   integer queries by vpmaddwd measured no faster and rounded q to 2^-15
 *   of its largest element, past the f32 tolerance at head dim 512).
 *   Quantized V: for <= 4 vectors, O += (P*s_g)*c per element with the
 *   codes decoded in registers and sum_t P*b_g kept per group (vweights8);
 *   for more vectors the tile's rows are dequantized once into L1 as
 *   s*c + b and every vector reads them from there.
 * Layout: a quantized row is read 8 u32 words (one ymm, a "chunk") at a
 *   time; code k of word w lands in lane w of vector k: position
 *   (chunk*E + k)*8 + w <-> element (chunk*8 + w)*E + k (E = 32/bits codes
 *   per word); q and the V accumulator live in that permuted order. bf16
 *   rows are converted 16 elements at a time, even elements then odd (split
 *   order, one operation per 8 values), and q / the V accumulator follow.
 * Traffic: each K/V row of the item's range is read once for all nq
 *   vectors (tiles run across paged blocks; the next tile's rows are
 *   prefetched into L2 one per row handled, tiles.h: K rows during the K
 *   phase, V rows during the V phase's first pass, or spread over all its
 *   passes when a row spans 4 lines or more, vshare_of); the rows' group
 *   scales and biases are converted to f32 once per tile.
 * Geometry: one call = one work item (driver: src/cpu/attend.c). */
#include "cpu/simd/simd.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include "cpu/simd/tiles.h"

#define L8 8      /* f32 lanes */
#define MAXCH 16  /* chunks of 8 words per row: 512 dims at 8 bits */
#define MAXG 16   /* groups per row: 512 dims in groups of 32 */
#define GLD 24    /* floats per row of the tile's group tables (MAXG + 8: whole-vector loads) */
#define KQB 4     /* query vectors per register block in the K phase */
#define VJB 4     /* query vectors per register block in the tiled V phase */

typedef struct fmt8 {
  int bits, E, nch, ngroups, G;    /* E codes per word; nch chunks of 8 words */
  int P;                           /* permuted row length (floats): nch*E*8 quantized, D float */
  int one_group;                   /* every chunk lies in one group (8*E <= G) */
  int split;                       /* bf16 float rows in split order (full 16-element blocks) */
  kva_dtype sdt;                   /* scales dtype (quantized) or element dtype (float) */
  int g0[MAXCH];                   /* first group of each chunk */
  int full[MAXCH];                 /* all 8 words of the chunk are in the row */
  __m256i chmask[MAXCH];           /* valid words (maskload) */
  __m256i gidx[MAXCH];             /* group - g0 of each lane (word) of the chunk */
} fmt8;

static void plan8(const kva_rowfmt *f, fmt8 *fp) {
  memset(fp, 0, sizeof *fp);
  fp->bits = f->bits;
  if (!f->bits) {
    fp->P = (int)f->D;
    fp->sdt = f->dtype;
    fp->split = f->dtype == KVA_BF16;
    return;
  }
  const int words = (int)(f->D * f->bits / 32);
  fp->E = 32 / f->bits;
  fp->G = f->group;
  fp->ngroups = (int)(f->D / f->group);
  fp->nch = (words + L8 - 1) / L8;
  fp->P = fp->nch * fp->E * L8;
  fp->one_group = L8 * fp->E <= fp->G;
  fp->sdt = f->sdtype;
  for (int c = 0; c < fp->nch; ++c) {
    int32_t m[L8], idx[L8];
    fp->g0[c] = c * L8 * fp->E / fp->G;
    for (int l = 0; l < L8; ++l) {
      const int w = c * L8 + l, g = w * fp->E / fp->G;
      m[l] = w < words ? -1 : 0;
      idx[l] = (g < fp->ngroups ? g : fp->ngroups - 1) - fp->g0[c];
    }
    fp->full[c] = words - c * L8 >= L8;
    fp->chmask[c] = _mm256_loadu_si256((const __m256i *)m);
    fp->gidx[c] = _mm256_loadu_si256((const __m256i *)idx);
  }
}

/* Position of element e of a float row of D elements: e itself, or in the
 * split order of a full 16-element block (even elements first). */
static inline int64_t float_pos8(const fmt8 *fp, int64_t D, int64_t e) {
  const int64_t b0 = e - e % 16;
  if (!fp->split || b0 + 16 > D) return e;
  return b0 + (e & 1) * 8 + (e % 16) / 2;
}

/* dst[pos] = src[elem(pos)] * scale in the float permuted order (zero on padding). */
static void permute8(const fmt8 *fp, int64_t D, const float *src, float scale, float *dst) {
  if (!fp->bits) {
    for (int64_t d = 0; d < D; ++d) dst[float_pos8(fp, D, d)] = src[d] * scale;
    return;
  }
  memset(dst, 0, sizeof(float) * (size_t)fp->P);
  const int64_t words = D / fp->E;
  for (int64_t w = 0; w < words; ++w)
    for (int k = 0; k < fp->E; ++k) dst[((w / L8) * fp->E + k) * L8 + w % L8] = src[w * fp->E + k] * scale;
}
/* The inverse: dst[d] = src[pos(d)] (+ bias[group of d], quantized). */
static void unpermute8(const fmt8 *fp, int64_t D, const float *src, const float *bias, float *dst) {
  if (!fp->bits) {
    for (int64_t d = 0; d < D; ++d) dst[d] = src[float_pos8(fp, D, d)];
    return;
  }
  const int64_t words = D / fp->E;
  for (int64_t w = 0; w < words; ++w)
    for (int k = 0; k < fp->E; ++k)
      dst[w * fp->E + k] = src[((w / L8) * fp->E + k) * L8 + w % L8] + bias[w * fp->E / fp->G];
}

/* 8 elements of a float row as f32 (not split). */
ALWAYS __m256 load8(const char *p, kva_dtype dt) {
  if (dt == KVA_F32) return _mm256_loadu_ps((const float *)p);
  const __m128i h = _mm_loadu_si128((const __m128i *)p);
  if (dt == KVA_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* 16 bf16 elements as f32 in split order: even (shift) and odd (and). */
ALWAYS void load_bf16_split8(const char *p, __m256 *even, __m256 *odd) {
  const __m256i x = _mm256_loadu_si256((const __m256i *)p);
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
}
static void load_row8(const char *row, kva_dtype dt, int64_t D, float *dst) {
  const int64_t es = (int64_t)kva_dtype_size(dt);
  for (int64_t d = 0; d < D; d += L8) _mm256_storeu_ps(dst + d, load8(row + d * es, dt));
}

/* Chunk c of a quantized row (8 words; masked past the row's end). */
ALWAYS __m256i load_chunk(const fmt8 *fp, const char *row, int c) {
  if (fp->full[c]) return _mm256_loadu_si256((const __m256i *)(row + c * 32));
  return _mm256_maskload_epi32((const int *)(row + c * 32), fp->chmask[c]);
}

/* n (<= MAXG) group scales or biases of a row as f32. */
ALWAYS void groups_f32(const char *p, kva_dtype dt, int n, float *dst) {
  int g = 0;
  if (dt == KVA_F32) {
    for (; g + 8 <= n; g += 8) _mm256_storeu_ps(dst + g, _mm256_loadu_ps((const float *)p + g));
    for (; g < n; ++g) dst[g] = ((const float *)p)[g];
    return;
  }
  const uint16_t *h = (const uint16_t *)p;
  for (; g + 8 <= n; g += 8) _mm256_storeu_ps(dst + g, load8(p + 2 * g, dt));
  if (g + 4 <= n) {
    const __m128i x = _mm_loadl_epi64((const __m128i *)(h + g));
    _mm_storeu_ps(dst + g, dt == KVA_F16 ? _mm_cvtph_ps(x) : _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), x)));
    g += 4;
  }
  for (; g < n; ++g) dst[g] = dt == KVA_F16 ? kva_f16_to_f32(h[g]) : simd_bf16f(h[g]);
}
/* The tile's scales and biases of one operand (arrays as, ab of the rows)
 * into gs/gb[t][GLD]; one loop per scale dtype and for the common 4 and 2
 * groups (head dims 256 and 128 in groups of 64). */
#define TILE_GROUPS_LOOP(DT, NG)                                                                               \
  for (int64_t t = 0; t < n; ++t) {                                                                            \
    groups_f32(rows[t].a[as], DT, NG, gs + t * GLD);                                                           \
    groups_f32(rows[t].a[ab], DT, NG, gb + t * GLD);                                                           \
  }
static void tile_groups(const fmt8 *fp, const kva_rows *rows, int64_t n, int as, int ab, float *gs, float *gb) {
  const int ng = fp->ngroups;
  switch (fp->sdt) {
  case KVA_BF16:
    if (ng == 4) TILE_GROUPS_LOOP(KVA_BF16, 4)
    else if (ng == 2) TILE_GROUPS_LOOP(KVA_BF16, 2)
    else TILE_GROUPS_LOOP(KVA_BF16, ng)
    break;
  case KVA_F16: TILE_GROUPS_LOOP(KVA_F16, ng) break;
  default: TILE_GROUPS_LOOP(KVA_F32, ng) break;
  }
}
#undef TILE_GROUPS_LOOP
/* The group values of chunk c's 8 word lanes (a row of a tile group table). */
ALWAYS __m256 chunk_lanes(const fmt8 *fp, const float *g, int c) {
  if (fp->one_group) return _mm256_broadcast_ss(g + fp->g0[c]);
  return _mm256_permutevar8x32_ps(_mm256_loadu_ps(g + fp->g0[c]), fp->gidx[c]);
}

/* Code k of each word of x as f32, exactly. */
ALWAYS __m256 code8(__m256i x, int k, int bits) {
  const __m256i y = k ? _mm256_srli_epi32(x, k * bits) : x;
  return _mm256_cvtepi32_ps(k * bits + bits == 32 ? y : _mm256_and_si256(y, _mm256_set1_epi32((1 << bits) - 1)));
}
/* Lane t of the result = the sum of the 8 lanes of v[t]. */
ALWAYS __m256 reduce8(const __m256 v[8]) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
/* Row t's J lane-partial score vectors into part; after every 8th row (or
 * the last, n - 1) the block is reduced into S[j][t0 .. t0 + 8). */
ALWAYS void put_scores8(__m256 (*part)[L8], const __m256 *sc, int J, int64_t t, int64_t n, float *S) {
  for (int j = 0; j < J; ++j) part[j][t % L8] = sc[j];
  if (t % L8 != L8 - 1 && t != n - 1) return;
  const int64_t t0 = t - t % L8;
  for (int j = 0; j < J; ++j) {
    for (int64_t u = t + 1; u < t0 + L8; ++u) part[j][u % L8] = _mm256_setzero_ps();
    _mm256_storeu_ps(S + j * KVA_TILE + t0, reduce8(part[j]));
  }
}

/* ---- K phase: S[j][t] = q_j · k_t for a block of J query vectors ---- */
/* Quantized K: per chunk, codes as f32 times the permuted query, then
 * sc += s_lane*dot + b_lane*qs_lane (qs: the query's sums per word lane). */
ALWAYS void kphase_q8(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *qp, const float *qs,
                      const float *gs, const float *gb, int J, int bits, float *S, const kva_prefetch *pf) {
  __m256 part[KQB][L8];
  const int E = 32 / bits;
  for (int64_t t = 0; t < n; ++t) {
    if (pf && t < pf->n) prefetch_row(pf, t, KVA_ARR_K, KVA_ARR_V);
    const char *row = rows[t].k;
    __m256 sc[KQB];
    for (int j = 0; j < J; ++j) sc[j] = _mm256_setzero_ps();
    for (int c = 0; c < fp->nch; ++c) {
      const __m256i x = load_chunk(fp, row, c);
      __m256 dot[KQB][2]; /* two chains per vector: codes k even / odd (FMA latency) */
      for (int j = 0; j < J; ++j) dot[j][0] = dot[j][1] = _mm256_setzero_ps();
      for (int k = 0; k < E; k += 2) { /* E is even; constant chain indices keep dot in registers */
        const __m256 f0 = code8(x, k, bits), f1 = code8(x, k + 1, bits);
        const float *qk = qp + (int64_t)(c * E + k) * L8;
        for (int j = 0; j < J; ++j) {
          dot[j][0] = _mm256_fmadd_ps(f0, _mm256_loadu_ps(qk + (int64_t)j * fp->P), dot[j][0]);
          dot[j][1] = _mm256_fmadd_ps(f1, _mm256_loadu_ps(qk + L8 + (int64_t)j * fp->P), dot[j][1]);
        }
      }
      const __m256 sv = chunk_lanes(fp, gs + t * GLD, c), bv = chunk_lanes(fp, gb + t * GLD, c);
      for (int j = 0; j < J; ++j) {
        sc[j] = _mm256_fmadd_ps(sv, _mm256_add_ps(dot[j][0], dot[j][1]), sc[j]);
        sc[j] = _mm256_fmadd_ps(bv, _mm256_loadu_ps(qs + ((int64_t)j * fp->nch + c) * L8), sc[j]);
      }
    }
    put_scores8(part, sc, J, t, n, S);
  }
}

/* Float K rows (bf16 in split order). */
ALWAYS void kphase_f8(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *qp, int J, float *S,
                      const kva_prefetch *pf) {
  const int64_t es = (int64_t)kva_dtype_size(fp->sdt);
  __m256 part[KQB][L8];
  for (int64_t t = 0; t < n; ++t) {
    if (pf && t < pf->n) prefetch_row(pf, t, KVA_ARR_K, KVA_ARR_V);
    const char *row = rows[t].k;
    __m256 acc[KQB][2]; /* two chains per vector (FMA latency) */
    for (int j = 0; j < J; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    int d = 0;
    if (fp->split)
      for (; d + 16 <= fp->P; d += 16) {
        __m256 ke, ko;
        load_bf16_split8(row + d * es, &ke, &ko);
        for (int j = 0; j < J; ++j) {
          acc[j][0] = _mm256_fmadd_ps(ke, _mm256_loadu_ps(qp + (int64_t)j * fp->P + d), acc[j][0]);
          acc[j][1] = _mm256_fmadd_ps(ko, _mm256_loadu_ps(qp + (int64_t)j * fp->P + d + L8), acc[j][1]);
        }
      }
    /* constant chain indices (a run-time index put the accumulators on the stack) */
    for (; d + 2 * L8 <= fp->P; d += 2 * L8) {
      const __m256 k0 = load8(row + d * es, fp->sdt), k1 = load8(row + (d + L8) * es, fp->sdt);
      for (int j = 0; j < J; ++j) {
        acc[j][0] = _mm256_fmadd_ps(k0, _mm256_loadu_ps(qp + (int64_t)j * fp->P + d), acc[j][0]);
        acc[j][1] = _mm256_fmadd_ps(k1, _mm256_loadu_ps(qp + (int64_t)j * fp->P + d + L8), acc[j][1]);
      }
    }
    if (d < fp->P) {
      const __m256 kv = load8(row + d * es, fp->sdt);
      for (int j = 0; j < J; ++j) acc[j][0] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(qp + (int64_t)j * fp->P + d), acc[j][0]);
    }
    __m256 sc[KQB];
    for (int j = 0; j < J; ++j) sc[j] = _mm256_add_ps(acc[j][0], acc[j][1]);
    put_scores8(part, sc, J, t, n, S);
  }
}

#define KBLOCK(J_)                                                                                              \
  static void kblock8_##J_(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *qp, const float *qs,   \
                           const float *gs, const float *gb, float *S, const kva_prefetch *pf) {                \
    switch (fp->bits) {                                                                                         \
    case 2: kphase_q8(fp, rows, n, qp, qs, gs, gb, J_, 2, S, pf); break;                                        \
    case 4: kphase_q8(fp, rows, n, qp, qs, gs, gb, J_, 4, S, pf); break;                                        \
    case 8: kphase_q8(fp, rows, n, qp, qs, gs, gb, J_, 8, S, pf); break;                                        \
    default: kphase_f8(fp, rows, n, qp, J_, S, pf); break;                                                      \
    }                                                                                                           \
  }
KBLOCK(1)
KBLOCK(2)
KBLOCK(4)

/* All nq vectors in register blocks of 4, 2, 1; the first block issues the prefetch. */
static void kphase8(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *qp, const float *qs,
                    const float *gs, const float *gb, int64_t nq, float *S, const kva_prefetch *pf) {
  int64_t j = 0;
#define KARGS(J) rows, n, qp + (J) * fp->P, qs + (J) * fp->nch * L8, gs, gb, S + (J) * KVA_TILE, pf
  for (; j + 4 <= nq; j += 4, pf = NULL) kblock8_4(fp, KARGS(j));
  if (j + 2 <= nq) { kblock8_2(fp, KARGS(j)); j += 2; pf = NULL; }
  if (j < nq) kblock8_1(fp, KARGS(j));
#undef KARGS
}

/* ---- V phase ---- */
/* acc += w * v; masked: only where keep is set (the tiled V phase on a tile
 * holding a NaN or Inf: keys with P == 0 must add exactly nothing). */
ALWAYS __m256 fma_keep(__m256 w, __m256 v, __m256 acc, __m256 keep, int masked) {
  const __m256 r = _mm256_fmadd_ps(w, v, acc);
  return masked ? _mm256_blendv_ps(acc, r, keep) : r;
}

/* A pass's share of the next tile's V prefetch (pf NULL: none): pass p of
 * np over the tile prefetches rows p, p + np, ..., so that the rows are
 * requested evenly over the V phase rather than all in its first pass
 * (tiles.h: bursts stall on full fill buffers). */
typedef struct vshare {
  const kva_prefetch *pf;
  int p, np;
} vshare;
/* Pass p's share when the V phase makes np passes: rows of 4 or more cache
 * lines go out spread over all passes, smaller rows all in the first pass
 * (cold 2-thread decode 8/4/256 32k on the AVX2 host, calls alternated:
 * bf16 (8 lines) spread 9.0 -> 6.5-6.8 ms; q4 (2 lines) spread 4.69 -> 4.93
 * ms, over the first 2 passes 5.24). */
static inline vshare vshare_of(const kva_prefetch *pf, int p, int np) {
  const int spread = pf && pf->bytes[KVA_ARR_V] >= 4 * 64 ? np : 1;
  const vshare v = {p < spread ? pf : NULL, p, spread};
  return v;
}

/* Direct V accumulation for J <= 2 vectors, quantized: per chunk, passes of
 * 4 codes per word (from code k0) over the tile's tokens, codes decoded in
 * registers and multiplied by the weights ws[j][t][g] = P*scale (vweights8:
 * exactly 0 for keys the vector does not see, so that, codes being finite,
 * they add exactly nothing; the biases: vbias8). ONE: the chunk lies in one
 * group (its weight a broadcast). */
ALWAYS void vdirect_q_pass(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *ws, float *o, int c,
                           int k0, int KB, int J, int bits, int ONE, vshare pf) {
  const int E = 32 / bits;
  float *oc = o + (c * E + k0) * L8;
  const float *wc = ws + fp->g0[c];
  const __m256i gidx = fp->gidx[c];
  __m256 acc[4][4];
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < KB; ++k) acc[j][k] = _mm256_loadu_ps(oc + (int64_t)j * fp->P + k * L8);
  int64_t next = pf.pf ? pf.p : n; /* the next row this pass prefetches */
  for (int64_t t = 0; t < n; ++t) {
    if (t == next) {
      if (t < pf.pf->n) prefetch_row(pf.pf, t, KVA_ARR_V, KVA_ARRS);
      next += pf.np;
    }
    const __m256i x = load_chunk(fp, rows[t].v, c);
    __m256 w[4];
    for (int j = 0; j < J; ++j) {
      const float *wt = wc + ((int64_t)j * KVA_TILE + t) * GLD;
      w[j] = ONE ? _mm256_broadcast_ss(wt) : _mm256_permutevar8x32_ps(_mm256_loadu_ps(wt), gidx);
    }
    for (int k = 0; k < KB; ++k) {
      const __m256 f = code8(x, k0 + k, bits);
      for (int j = 0; j < J; ++j) acc[j][k] = _mm256_fmadd_ps(w[j], f, acc[j][k]);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < KB; ++k) _mm256_storeu_ps(oc + (int64_t)j * fp->P + k * L8, acc[j][k]);
}
/* All chunks and passes of one block of J vectors (4 codes per word per
 * pass for J <= 2, 2 for J = 4: 8 accumulators); k0 and ONE are constants. */
#define VDIRECT_Q(BITS, J)                                                                                     \
  static void vdirect_q##BITS##_##J(const fmt8 *fp, const kva_rows *rows, int64_t n,                         \
                                    const float *ws, float *o, const kva_prefetch *pf) {                       \
    enum { KB = J == 4 ? 2 : 4, KP = 32 / BITS / KB }; /* codes per pass, passes per chunk */                  \
    const int np = fp->nch * KP;                                                                               \
    for (int c = 0; c < fp->nch; ++c)                                                                          \
      for (int kp = 0; kp < KP; ++kp) {                                                                        \
        const vshare sh = vshare_of(pf, c * KP + kp, np);                                                      \
        if (fp->one_group) vdirect_q_pass(fp, rows, n, ws, o, c, KB * kp, KB, J, BITS, 1, sh);                  \
        else vdirect_q_pass(fp, rows, n, ws, o, c, KB * kp, KB, J, BITS, 0, sh);                                \
      }                                                                                                        \
  }
VDIRECT_Q(8, 1)
VDIRECT_Q(8, 2)
VDIRECT_Q(4, 1)
VDIRECT_Q(4, 2)
VDIRECT_Q(2, 1)
VDIRECT_Q(2, 2)
VDIRECT_Q(8, 4)
VDIRECT_Q(4, 4)
VDIRECT_Q(2, 4)

#define VFB 4 /* vectors of 8 values per pass over the tile (float V, J <= 2) */
/* acc[j][0..NV) += P[j][t] * v_t[d0 .. d0 + 8*NV); split: NV even. Keys
 * that no vector of the block sees are skipped; a key seen by one of two
 * adds to that one only (0 x NaN must not leak). */
ALWAYS void vdirect_f_pass(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *P, float *o, int d0, int J,
                           int NV, int split, int SAME, vshare pf) {
  const int64_t es = (int64_t)kva_dtype_size(fp->sdt);
  __m256 acc[2][VFB];
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < NV; ++k) acc[j][k] = _mm256_loadu_ps(o + (int64_t)j * fp->P + d0 + k * L8);
  int64_t next = pf.pf ? pf.p : n; /* the next row this pass prefetches */
  for (int64_t t = 0; t < n; ++t) {
    if (t == next) {
      if (t < pf.pf->n) prefetch_row(pf.pf, t, KVA_ARR_V, KVA_ARRS);
      next += pf.np;
    }
    const float p0 = P[t], p1 = J == 2 ? P[KVA_TILE + t] : 0.0f;
    if (p0 == 0.0f && p1 == 0.0f) continue;
    const char *row = rows[t].v + d0 * es;
    __m256 v[VFB];
    for (int k = 0; k < NV; k += split ? 2 : 1) {
      if (split) load_bf16_split8(row + k * L8 * es, &v[k], &v[k + 1]);
      else v[k] = load8(row + k * L8 * es, fp->sdt);
    }
    const __m256 w0 = _mm256_set1_ps(p0), w1 = _mm256_set1_ps(p1);
    if (J == 1 || SAME || (p0 != 0.0f && p1 != 0.0f)) {
      for (int k = 0; k < NV; ++k) {
        acc[0][k] = _mm256_fmadd_ps(w0, v[k], acc[0][k]);
        if (J == 2) acc[1][k] = _mm256_fmadd_ps(w1, v[k], acc[1][k]);
      }
    } else if (p0 != 0.0f) {
      for (int k = 0; k < NV; ++k) acc[0][k] = _mm256_fmadd_ps(w0, v[k], acc[0][k]);
    } else {
      for (int k = 0; k < NV; ++k) acc[1][k] = _mm256_fmadd_ps(w1, v[k], acc[1][k]);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < NV; ++k) _mm256_storeu_ps(o + (int64_t)j * fp->P + d0 + k * L8, acc[j][k]);
}
/* Passes of VFB vectors (split: pairs of full 16-element blocks first),
 * then single vectors. SAME: every key of the tile is seen by both vectors
 * of the block or by neither (always at L = 1): no per-key branch between
 * the FMAs (with it the compiler kept accumulators on the stack). */
#define VDIRECT_F_PASSES(J, SAME)                                                                              \
  for (int i = 0; i < big; ++i, d0 += VFB * L8, ++ip) {                                                        \
    if (fp->split) vdirect_f_pass(fp, rows, n, P, o, d0, J, VFB, 1, SAME, vshare_of(pf, ip, np));               \
    else vdirect_f_pass(fp, rows, n, P, o, d0, J, VFB, 0, SAME, vshare_of(pf, ip, np));                         \
  }                                                                                                            \
  for (int i = 0; i < pairs; ++i, d0 += 2 * L8, ++ip)                                                          \
    vdirect_f_pass(fp, rows, n, P, o, d0, J, 2, 1, SAME, vshare_of(pf, ip, np));                               \
  for (int i = 0; i < singles; ++i, d0 += L8, ++ip)                                                            \
    vdirect_f_pass(fp, rows, n, P, o, d0, J, 1, 0, SAME, vshare_of(pf, ip, np));
#define VDIRECT_F(J)                                                                                           \
  static void vdirect_f8_##J(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *P, float *o,       \
                             const kva_prefetch *pf) {                                                         \
    const int big = fp->P / (VFB * L8), rest = fp->P % (VFB * L8);                                             \
    const int pairs = fp->split ? rest / (2 * L8) : 0, singles = (rest - pairs * 2 * L8) / L8;                 \
    const int np = big + pairs + singles;                                                                      \
    int same = 1;                                                                                              \
    for (int64_t t = 0; J == 2 && t < n; ++t) same &= (P[t] != 0.0f) == (P[KVA_TILE + t] != 0.0f);            \
    int d0 = 0, ip = 0;                                                                                        \
    if (same) {                                                                                                \
      VDIRECT_F_PASSES(J, 1)                                                                                   \
    } else {                                                                                                   \
      VDIRECT_F_PASSES(J, 0)                                                                                   \
    }                                                                                                          \
  }
VDIRECT_F(1)
VDIRECT_F(2)

/* Row stride (floats) of the dequantized V tile: one line more than P, as
 * rows 1 KiB apart (P = 256) would all fall into 4 of the 64 sets of a
 * 32 KiB 8-way L1 (the 32 KiB tile then misses to L2 on every pass). */
#define VT_LD(fp) ((fp)->P + 16)

/* The tile's V rows as f32 values into vt[t][VT_LD] (quantized: s*c + b in the
 * permuted order). Returns whether any value is NaN or Inf, so that the
 * tiled V phase takes its masked form. */
#define NONFINITE(v) _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), expo), expo)
/* s*c + b of the E codes per word of chunk x into dst[k][8]; the lanes that are NaN or Inf. */
ALWAYS __m256i dequant_chunk(__m256i x, __m256 sv, __m256 bv, int bits, float *dst) {
  const __m256i expo = _mm256_set1_epi32(0x7f800000);
  __m256i bad = _mm256_setzero_si256();
  for (int k = 0; k < 32 / bits; ++k) {
    const __m256 v = _mm256_fmadd_ps(sv, code8(x, k, bits), bv);
    bad = _mm256_or_si256(bad, NONFINITE(v));
    _mm256_storeu_ps(dst + k * L8, v);
  }
  return bad;
}
static int decode_v_tile8(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *gs, const float *gb,
                          float *vt, const kva_prefetch *pf) {
  const __m256i expo = _mm256_set1_epi32(0x7f800000);
  __m256i bad = _mm256_setzero_si256();
  for (int64_t t = 0; t < n; ++t) {
    if (pf && t < pf->n) prefetch_row(pf, t, KVA_ARR_V, KVA_ARRS);
    const char *row = rows[t].v;
    float *dst = vt + t * VT_LD(fp);
    if (!fp->bits) {
      const int64_t es = (int64_t)kva_dtype_size(fp->sdt);
      int d = 0;
      if (fp->split)
        for (; d + 16 <= fp->P; d += 16) {
          __m256 ve, vo;
          load_bf16_split8(row + d * es, &ve, &vo);
          bad = _mm256_or_si256(bad, _mm256_or_si256(NONFINITE(ve), NONFINITE(vo)));
          _mm256_storeu_ps(dst + d, ve);
          _mm256_storeu_ps(dst + d + L8, vo);
        }
      for (; d < fp->P; d += L8) {
        const __m256 v = load8(row + d * es, fp->sdt);
        bad = _mm256_or_si256(bad, NONFINITE(v));
        _mm256_storeu_ps(dst + d, v);
      }
      continue;
    }
    for (int c = 0; c < fp->nch; ++c) {
      const __m256i x = load_chunk(fp, row, c);
      const __m256 sv = chunk_lanes(fp, gs + t * GLD, c), bv = chunk_lanes(fp, gb + t * GLD, c);
      switch (fp->bits) {
      case 4: bad = _mm256_or_si256(bad, dequant_chunk(x, sv, bv, 4, dst + c * 8 * L8)); break;
      case 8: bad = _mm256_or_si256(bad, dequant_chunk(x, sv, bv, 8, dst + c * 4 * L8)); break;
      default: bad = _mm256_or_si256(bad, dequant_chunk(x, sv, bv, 2, dst + c * 16 * L8)); break;
      }
    }
  }
  return !_mm256_testz_si256(bad, bad);
}

/* o[j][pos0 .. pos0 + 8*KB) += sum_t P[j][t] * vt[t][...] for J vectors;
 * MASK: keys with P == 0 add exactly nothing (tiles with a NaN or Inf). */
ALWAYS void vtile_block(const fmt8 *fp, int64_t n, const float *P, const float *vt, float *o, int64_t pos0, int J,
                        int KB, int MASK) {
  __m256 acc[VJB][2];
  for (int j = 0; j < J; ++j)
    for (int kb = 0; kb < KB; ++kb) acc[j][kb] = _mm256_loadu_ps(o + (int64_t)j * fp->P + pos0 + kb * L8);
  for (int64_t t = 0; t < n; ++t) {
    __m256 w[VJB], keep[VJB];
    for (int j = 0; j < J; ++j) {
      w[j] = _mm256_broadcast_ss(P + j * KVA_TILE + t);
      if (MASK) keep[j] = _mm256_cmp_ps(w[j], _mm256_setzero_ps(), _CMP_NEQ_UQ);
    }
    for (int kb = 0; kb < KB; ++kb) {
      const __m256 v = _mm256_loadu_ps(vt + t * VT_LD(fp) + pos0 + kb * L8);
      for (int j = 0; j < J; ++j) acc[j][kb] = fma_keep(w[j], v, acc[j][kb], MASK ? keep[j] : w[j], MASK);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int kb = 0; kb < KB; ++kb) _mm256_storeu_ps(o + (int64_t)j * fp->P + pos0 + kb * L8, acc[j][kb]);
}
#define VTILE(J_, KB_)                                                                                         \
  static void vtile_##J_##_##KB_(const fmt8 *fp, int64_t n, const float *P, const float *vt, float *o,        \
                                 int64_t pos0, int mask) {                                                     \
    if (mask) vtile_block(fp, n, P, vt, o, pos0, J_, KB_, 1);                                                  \
    else vtile_block(fp, n, P, vt, o, pos0, J_, KB_, 0);                                                       \
  }
VTILE(4, 2)
VTILE(2, 2)
VTILE(1, 2)
VTILE(4, 1)
VTILE(2, 1)
VTILE(1, 1)

static void vtile8(const fmt8 *fp, int64_t n, const float *P, const float *vt, float *o, int64_t nq, int mask) {
  for (int64_t pos = 0; pos < fp->P;) {
    const int wide = pos + 2 * L8 <= fp->P;
    int64_t j = 0;
    for (; j + 4 <= nq; j += 4) {
      if (wide) vtile_4_2(fp, n, P + j * KVA_TILE, vt, o + j * fp->P, pos, mask);
      else vtile_4_1(fp, n, P + j * KVA_TILE, vt, o + j * fp->P, pos, mask);
    }
    for (; j + 2 <= nq; j += 2) {
      if (wide) vtile_2_2(fp, n, P + j * KVA_TILE, vt, o + j * fp->P, pos, mask);
      else vtile_2_1(fp, n, P + j * KVA_TILE, vt, o + j * fp->P, pos, mask);
    }
    for (; j < nq; ++j) {
      if (wide) vtile_1_2(fp, n, P + j * KVA_TILE, vt, o + j * fp->P, pos, mask);
      else vtile_1_1(fp, n, P + j * KVA_TILE, vt, o + j * fp->P, pos, mask);
    }
    pos += wide ? 2 * L8 : L8;
  }
}

/* For the direct quantized V phase: ws[j][t][g] = P[j][t] * scale[t][g],
 * exactly 0 where P == 0 (a key vector j does not see: a NaN or Inf scale
 * or bias of that key stays out), and ob[j][g] += sum_t P[j][t] * bias[t][g]
 * over the keys vector j sees. */
static void vweights8(const fmt8 *fp, int64_t n, const float *S, const float *gs, const float *gb, float *ws,
                      float *ob, int64_t nq) {
  const int two = fp->ngroups > L8;
  for (int64_t j = 0; j < nq; ++j) {
    float *obj = ob + j * MAXG;
    __m256 a0 = _mm256_loadu_ps(obj), a1 = _mm256_loadu_ps(obj + L8);
    for (int64_t t = 0; t < n; ++t) {
      const float pj = S[j * KVA_TILE + t];
      float *w = ws + (j * KVA_TILE + t) * GLD;
      if (pj == 0.0f) {
        _mm256_storeu_ps(w, _mm256_setzero_ps());
        if (two) _mm256_storeu_ps(w + L8, _mm256_setzero_ps());
        continue;
      }
      const __m256 pv = _mm256_set1_ps(pj);
      _mm256_storeu_ps(w, _mm256_mul_ps(pv, _mm256_loadu_ps(gs + t * GLD)));
      a0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(gb + t * GLD), a0);
      if (two) {
        _mm256_storeu_ps(w + L8, _mm256_mul_ps(pv, _mm256_loadu_ps(gs + t * GLD + L8)));
        a1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(gb + t * GLD + L8), a1);
      }
    }
    _mm256_storeu_ps(obj, a0);
    _mm256_storeu_ps(obj + L8, a1);
  }
}

/* V phase for one tile: direct (codes in registers) for <= 4 vectors, in
 * blocks of two or, for quantized rows and exactly 4 vectors, one block of
 * 4 (weights and group bias sums from vweights8); else through the
 * dequantized L1 tile. */
static void vphase8(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *S, const float *gs,
                    const float *gb, float *vt, float *ws, float *o, float *ob, int64_t nq,
                    const kva_prefetch *pf) {
  if (nq <= 4) {
    if (fp->bits) vweights8(fp, n, S, gs, gb, ws, ob, nq);
    if (fp->bits && nq == 4) { /* one block of 4: the codes decoded once */
      switch (fp->bits) {
      case 2: vdirect_q2_4(fp, rows, n, ws, o, pf); break;
      case 4: vdirect_q4_4(fp, rows, n, ws, o, pf); break;
      default: vdirect_q8_4(fp, rows, n, ws, o, pf); break;
      }
      return;
    }
    for (int64_t j = 0; j < nq; j += 2) {
      const int two = j + 1 < nq;
      const float *Pj = S + j * KVA_TILE;
      float *oj = o + j * fp->P;
      const kva_prefetch *vpf = j == 0 ? pf : NULL; /* the first block prefetches */
      switch (fp->bits * 2 + two) {
      case 0: vdirect_f8_1(fp, rows, n, Pj, oj, vpf); break;
      case 1: vdirect_f8_2(fp, rows, n, Pj, oj, vpf); break;
      case 4: vdirect_q2_1(fp, rows, n, ws + j * KVA_TILE * GLD, oj, vpf); break;
      case 5: vdirect_q2_2(fp, rows, n, ws + j * KVA_TILE * GLD, oj, vpf); break;
      case 8: vdirect_q4_1(fp, rows, n, ws + j * KVA_TILE * GLD, oj, vpf); break;
      case 9: vdirect_q4_2(fp, rows, n, ws + j * KVA_TILE * GLD, oj, vpf); break;
      case 16: vdirect_q8_1(fp, rows, n, ws + j * KVA_TILE * GLD, oj, vpf); break;
      default: vdirect_q8_2(fp, rows, n, ws + j * KVA_TILE * GLD, oj, vpf); break;
      }
    }
    return;
  }
  const int nonfinite = decode_v_tile8(fp, rows, n, gs, gb, vt, pf);
  vtile8(fp, n, S, vt, o, nq, nonfinite);
}

/* ---- online softmax over a tile ---- */
/* exp(x) for x <= 88 (NaN -> NaN, -inf -> 0, below -87 -> 0): 2^n * p(f). */
ALWAYS __m256 exp8(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ); /* x >= -87 or NaN */
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), xc);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), f);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  const __m256 r = _mm256_mul_ps(p, two_n);
  return _mm256_and_ps(_mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)), keep);
}
ALWAYS float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
ALWAYS float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* For each vector j: S[j] (logits, -inf where masked) becomes P = exp(S -
 * m_new); m, l and the accumulators o, ob are rescaled. Returns 0 when no
 * vector sees any key of the tile. */
static int tile_softmax8(float *S, int64_t n, int64_t nq, float *m, float *l, float *o, float *ob, int64_t P,
                         int64_t obn) {
  int any = 0;
  for (int64_t j = 0; j < nq; ++j) {
    float *s = S + j * KVA_TILE;
    for (int64_t r = n; r < KVA_TILE; ++r) s[r] = -INFINITY;
    __m256 v[KVA_TILE / L8], mx8 = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    for (int u = 0; u < KVA_TILE / L8; ++u) {
      v[u] = _mm256_loadu_ps(s + u * L8);
      mx8 = _mm256_max_ps(mx8, v[u]);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[u], v[u], _CMP_UNORD_Q));
    }
    const float mx = _mm256_movemask_ps(nan) ? NAN : hmax8(mx8);
    if (mx == -INFINITY) { /* nothing visible for this vector in this tile */
      memset(s, 0, sizeof(float) * KVA_TILE);
      continue;
    }
    any = 1;
    float mn, a_old, a_new;
    kva_softmax_factors(m[j], mx, &mn, &a_old, &a_new);
    const __m256 vmn = _mm256_set1_ps(mn);
    __m256 sum = _mm256_setzero_ps();
    for (int u = 0; u < KVA_TILE / L8; ++u) {
      const __m256 e = exp8(_mm256_sub_ps(v[u], vmn));
      _mm256_storeu_ps(s + u * L8, e);
      sum = _mm256_add_ps(sum, e);
    }
    m[j] = mn;
    l[j] = l[j] * a_old + hsum8(sum);
    if (a_old != 1.0f) {
      const __m256 f = _mm256_set1_ps(a_old);
      float *oj = o + j * P, *obj = ob + j * obn;
      for (int64_t d = 0; d < P; d += L8) _mm256_storeu_ps(oj + d, _mm256_mul_ps(_mm256_loadu_ps(oj + d), f));
      for (int64_t d = 0; d < obn; d += L8) _mm256_storeu_ps(obj + d, _mm256_mul_ps(_mm256_loadu_ps(obj + d), f));
    }
  }
  return any;
}

/* Scratch (floats): qp[nq][Pk], qs[nq][nchk*8],
 * o[nq][Pv], ob[nq][MAXG] (V's group bias sums), m/l[nq], S[nq][T], vt[T][Pv],
 * kgs/kgb/vgs/vgb[T][GLD], ws[4][T][GLD] (vweights8). vt: T rows of VT_LD. */
static void attend_fast8(const kva_item *it) {
  const kva_problem *p = it->p;
  const kva_source *src = it->src;
  const int64_t nrows = it->rows, nq = p->rep * nrows, SF = KVA_STATE_FLOATS(p->Dv);
  fmt8 kf, vf;
  plan8(&src->kf, &kf);
  plan8(&src->vf, &vf);
  const int64_t kqs = (int64_t)kf.nch * L8, vbn = MAXG;
  float *qp = it->scratch, *qs = qp + nq * kf.P, *o = qs + nq * kqs, *ob = o + nq * vf.P;
  float *m = ob + nq * vbn, *l = m + nq, *S = l + nq, *vt = S + nq * KVA_TILE;
  float *kgs = vt + KVA_TILE * VT_LD(&vf), *kgb = kgs + KVA_TILE * GLD, *vgs = kgb + KVA_TILE * GLD,
        *vgb = vgs + KVA_TILE * GLD, *ws = vgb + KVA_TILE * GLD;
  float qrow[KVA_MAX_HEAD_DIM];
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t h = it->hk * p->rep + j / nrows, i = it->i0 + j % nrows;
    m[j] = -INFINITY;
    l[j] = 0.0f;
    load_row8(kva_at4(p->q, it->b, h, i, 0), p->q->dtype, p->Dk, qrow);
    permute8(&kf, p->Dk, qrow, p->scale, qp + j * kf.P);
    for (int c = 0; c < kf.nch; ++c) {
      __m256 sum = _mm256_setzero_ps();
      for (int k = 0; k < kf.E; ++k) sum = _mm256_add_ps(sum, _mm256_loadu_ps(qp + j * kf.P + (c * kf.E + k) * L8));
      _mm256_storeu_ps(qs + j * kqs + c * L8, sum);
    }
  }
  memset(o, 0, sizeof(float) * (size_t)(nq * (vf.P + vbn)));
  memset(kgs, 0, sizeof(float) * 4 * KVA_TILE * GLD); /* group tables: padding lanes stay 0 */
  const int32_t *seg = simd_segments_row(p, it->b);
  const int64_t pos0 = it->len - p->L, pmin = pos0 + it->i0, pmax = pmin + nrows - 1;
  const int32_t win = p->mask.window;
  kva_tiles tl;
  tiles_init(&tl, it);
  const kva_rows *rows;
  int64_t tf, n;
  while ((rows = tiles_next(&tl, &tf, &n))) {
    if (kf.bits) tile_groups(&kf, rows, n, KVA_ARR_KS, KVA_ARR_KB, kgs, kgb);
    kphase8(&kf, rows, n, qp, qs, kgs, kgb, nq, S, &tl.pf);
    if (p->softcap > 0.0f) simd_softcap(S, nq, KVA_TILE, n, p->softcap);
    if (p->mask.kind == KVA_MASK_CAUSAL && !simd_tile_all_visible(tf, n, pmin, pmax, win))
      for (int64_t j = 0; j < nq; ++j)
        for (int64_t r = 0; r < n; ++r)
          if (!kva_causal_visible(tf + r, pos0 + it->i0 + j % nrows, win, seg, p->mask.segments_clamp))
            S[j * KVA_TILE + r] = -INFINITY;
    if (!tile_softmax8(S, n, nq, m, l, o, ob, vf.P, vbn)) continue;
    if (vf.bits) tile_groups(&vf, rows, n, KVA_ARR_VS, KVA_ARR_VB, vgs, vgb);
    vphase8(&vf, rows, n, S, vgs, vgb, vt, ws, o, ob, nq, &tl.pf);
  }
  /* Back to element order, bias lanes added: the kva_softmax_state layout. */
  for (int64_t j = 0; j < nq; ++j) {
    float *st = it->state + j * SF;
    st[0] = m[j];
    st[1] = l[j];
    unpermute8(&vf, p->Dv, o + j * vf.P, ob + j * vbn, st + 2);
  }
}

static int format_ok8(const kva_rowfmt *f) {
  if (f->bits) return f->D * f->bits / 32 <= (int64_t)MAXCH * L8 && f->D / f->group <= MAXG;
  return f->D % L8 == 0;
}

kva_item_fn KFN(select_fast)(const kva_problem *p) {
  kva_rowfmt kf, vf;
  simd_rowfmts(p, &kf, &vf);
  if (p->path != KVA_PATH_FUSED || !format_ok8(&kf) || !format_ok8(&vf)) return NULL;
  return attend_fast8;
}

const char *KFN(fast_name)(const kva_problem *p) { return KFN(select_fast)(p) ? "fused kernel" : NULL; }
#endif
