/* The fused decode/verify kernel on 8 f32 lanes (vec8.h), compiled at the
 * avx2 level (AVX2 + FMA + F16C: AMD Zen 2/3, Intel client cores) and at
 * the avxvnni level (the same with AVX-VNNI's vpdpbusd for 4-bit K codes
 * in place of vpmaddubsw + vpmaddwd: Intel client cores since Alder Lake,
 * Sierra Forest, AMD Zen 5), and at the portable level
 * (generic vectors: SSE2 pairs on x86-64, NEON pairs on aarch64 such as
 * Grace or Graviton); the AVX-512 level has its own (fast.c).
 * Math: per tile of KVA_TILE keys, S = (scale*q)·Kᵀ for the nq = rep*rows
 *   query vectors, softcap, causal-family mask, online softmax (vector exp),
 *   O += P·V. Quantized K uses the affine algebra: with k = s_g*c + b_g,
 *   q·k = sum_g s_g (q_g·c_g) + b_g sum(q_g). At the avx2 level, 4-bit and
 *   8-bit K outside exact mode: q rounded to s8 per (vector, group) and
 *   q_g·c_g an exact integer dot product (kphase_i8: vpmaddubsw / vpmaddwd,
 *   "[q int8]"); otherwise (exact mode, 2-bit K, the portable level) the
 *   codes converted to f32 exactly (shift, and, convert) times f32 q.
 *   Quantized V at the avx2 level with 16-bit queries outside exact mode,
 *   4-bit codes in groups of >= 64 or 8-bit in groups of >= 32: P*s_g
 *   rounded to s16 per (vector, tile, group) and summed over the tile's
 *   codes by vpmaddwd on token pairs of 16-bit codes (vphase_int, "[P
 *   int16]"; the pairs built in registers for <= 2 vectors, else once per
 *   tile into L1, 16 KiB at D = 256), sum_t P*b_g in f32. Otherwise, for <= 4 vectors, O +=
 *   (P*s_g)*c per element with the codes decoded in registers and sum_t
 *   P*b_g kept per group (vweights8); for more vectors the tile's rows are
 *   dequantized once into L1 as s*c + b and every vector reads them from
 *   there.
 * Layout: a quantized row is read 8 u32 words (one v8i, a "chunk") at a
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
 *   scales and biases are converted to f32 once per tile (for the integer
 *   phases straight into token-major tables per group, groups_t).
 * Geometry: one call = one work item (driver: src/cpu/attend.c). */
#include "cpu/simd/simd.h"

#if !defined(__AVX512F__) /* the avx512 level: fast.c */
#include "cpu/simd/tiles.h"
#include "cpu/simd/vec8.h"

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
  int wpg;                         /* words per group, G/E: 2 or 4 unless one_group (v8f_groups) */
  int split;                       /* bf16 float rows in split order (full 16-element blocks) */
  int fp8;                         /* fp8 float rows: codes as f32, the row's scale (rows[t].ks / vs; NULL: 1)
                                      on its scores (K) and on P (V) */
  int iq;                          /* K: the integer K phase (kphase_int8) runs */
  int iv;                          /* V: the integer V phase (vphase_int) runs */
  int halves;                      /* two groups per chunk (4-bit codes in groups of 32) */
  kva_dtype sdt;                   /* scales dtype (quantized) or element dtype (float) */
  int g0[MAXCH];                   /* first group of each chunk */
  int gend[MAXCH];                 /* chunk c is the last of its group (8E <= G) */
  int full[MAXCH];                 /* all 8 words of the chunk are in the row */
  v8i chmask[MAXCH];               /* valid words (maskload) */
  v8i gidx[MAXCH];                 /* group - g0 of each lane (word) of the chunk */
} fmt8;

static void plan8(const kva_rowfmt *f, fmt8 *fp) {
  memset(fp, 0, sizeof *fp);
  fp->bits = f->bits;
  if (!f->bits) {
    fp->P = (int)f->D;
    fp->sdt = f->dtype;
    fp->split = f->dtype == KVA_BF16;
    fp->fp8 = kva_is_fp8(f->dtype);
    return;
  }
  const int words = (int)(f->D * f->bits / 32);
  fp->E = 32 / f->bits;
  fp->G = f->group;
  fp->ngroups = (int)(f->D / f->group);
  fp->nch = (words + L8 - 1) / L8;
  fp->P = fp->nch * fp->E * L8;
  fp->one_group = L8 * fp->E <= fp->G;
  fp->halves = L8 * fp->E == 2 * fp->G;
  fp->wpg = fp->G / fp->E;
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
    fp->gend[c] = c + 1 == fp->nch || (c + 1) * L8 * fp->E / fp->G != fp->g0[c];
    fp->chmask[c] = v8i_load(m);
    fp->gidx[c] = v8i_load(idx);
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
ALWAYS v8f load8(const char *p, kva_dtype dt) {
  if (dt == KVA_F32) return v8f_load((const float *)p);
  if (dt == KVA_F16) return v8f_from_f16((const uint16_t *)p);
  if (dt == KVA_F8E4M3 || dt == KVA_F8E5M2) return v8f_from_fp8((const uint8_t *)p, dt == KVA_F8E4M3);
  return v8f_from_bf16((const uint16_t *)p);
}
/* 16 bf16 elements as f32 in split order: even (shift) and odd (and). */
ALWAYS void load_bf16_split8(const char *p, v8f *even, v8f *odd) {
  const v8i x = v8i_load(p);
  *even = v8i_as_f(v8i_sll(x, 16));
  *odd = v8i_as_f(v8i_and(x, v8i_set1((int)0xffff0000u)));
}
static void load_row8(const char *row, kva_dtype dt, int64_t D, float *dst) {
  const int64_t es = (int64_t)kva_dtype_size(dt);
  for (int64_t d = 0; d < D; d += L8) v8f_store(dst + d, load8(row + d * es, dt));
}

/* Chunk c of a quantized row (8 words; masked past the row's end). */
ALWAYS v8i load_chunk(const fmt8 *fp, const char *row, int c) {
  if (fp->full[c]) return v8i_load(row + c * 32);
  return v8i_maskload(row + c * 32, fp->chmask[c]);
}

/* n (<= MAXG) group scales or biases of a row as f32. */
ALWAYS void groups_f32(const char *p, kva_dtype dt, int n, float *dst) {
  int g = 0;
  if (dt == KVA_F32) {
    for (; g + 8 <= n; g += 8) v8f_store(dst + g, v8f_load((const float *)p + g));
    for (; g < n; ++g) dst[g] = ((const float *)p)[g];
    return;
  }
  const uint16_t *h = (const uint16_t *)p;
  for (; g + 8 <= n; g += 8) v8f_store(dst + g, load8(p + 2 * g, dt));
  if (g + 4 <= n) {
    v4_from_half(h + g, dt == KVA_F16, dst + g);
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
/* K rows: a group scale becomes NaN where it or its bias is ±inf, so that
 * key's logit is NaN, as dequantizing the row gives (inf times a zero code,
 * or inf - inf across the dot product), where the affine algebra alone
 * could give ±inf and drop or pick the key. */
static void k_groups_nan(float *gs, const float *gb, int64_t n, int ng) {
  for (int64_t t = 0; t < n; ++t)
    for (int g = 0; g < ng; ++g)
      if (isinf(gs[t * GLD + g]) || isinf(gb[t * GLD + g])) gs[t * GLD + g] = NAN;
}
/* The group values of chunk c's 8 word lanes (a row of a tile group table). */
ALWAYS v8f chunk_lanes(const fmt8 *fp, const float *g, int c) {
  if (fp->one_group) return v8f_bcast(g + fp->g0[c]);
  return v8f_groups(g + fp->g0[c], fp->gidx[c], fp->wpg);
}

/* Code k of each word of x as f32, exactly. */
ALWAYS v8f code8(v8i x, int k, int bits) {
  const v8i y = k ? v8i_srl(x, k * bits) : x;
  return v8i_to_f(k * bits + bits == 32 ? y : v8i_and(y, v8i_set1((1 << bits) - 1)));
}
/* Row t's J lane-partial score vectors into part; after every 8th row (or
 * the last, n - 1) the block is reduced into S[j][t0 .. t0 + 8). */
ALWAYS void put_scores8(v8f (*part)[L8], const v8f *sc, int J, int64_t t, int64_t n, float *S) {
  for (int j = 0; j < J; ++j) part[j][t % L8] = sc[j];
  if (t % L8 != L8 - 1 && t != n - 1) return;
  const int64_t t0 = t - t % L8;
  for (int j = 0; j < J; ++j) {
    for (int64_t u = t + 1; u < t0 + L8; ++u) part[j][u % L8] = v8f_zero();
    v8f_store(S + j * KVA_TILE + t0, v8f_reduce8(part[j]));
  }
}

/* ---- K phase: S[j][t] = q_j · k_t for a block of J query vectors ---- */
/* Quantized K: per chunk, codes as f32 times the permuted query, then
 * sc += s_lane*dot + b_lane*qs_lane (qs: the query's sums per word lane). */
ALWAYS void kphase_q8(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *qp, const float *qs,
                      const float *gs, const float *gb, int J, int bits, float *S, const kva_prefetch *pf) {
  v8f part[KQB][L8];
  const int E = 32 / bits;
  for (int64_t t = 0; t < n; ++t) {
    if (pf && t < pf->n) prefetch_row(pf, t, KVA_ARR_K, KVA_ARR_V);
    const char *row = rows[t].k;
    v8f sc[KQB];
    for (int j = 0; j < J; ++j) sc[j] = v8f_zero();
    for (int c = 0; c < fp->nch; ++c) {
      const v8i x = load_chunk(fp, row, c);
      v8f dot[KQB][2]; /* two chains per vector: codes k even / odd (FMA latency) */
      for (int j = 0; j < J; ++j) dot[j][0] = dot[j][1] = v8f_zero();
      for (int k = 0; k < E; k += 2) { /* E is even; constant chain indices keep dot in registers */
        const v8f f0 = code8(x, k, bits), f1 = code8(x, k + 1, bits);
        const float *qk = qp + (int64_t)(c * E + k) * L8;
        for (int j = 0; j < J; ++j) {
          dot[j][0] = v8f_fma(f0, v8f_load(qk + (int64_t)j * fp->P), dot[j][0]);
          dot[j][1] = v8f_fma(f1, v8f_load(qk + L8 + (int64_t)j * fp->P), dot[j][1]);
        }
      }
      const v8f sv = chunk_lanes(fp, gs + t * GLD, c), bv = chunk_lanes(fp, gb + t * GLD, c);
      for (int j = 0; j < J; ++j) {
        sc[j] = v8f_fma(sv, v8f_add(dot[j][0], dot[j][1]), sc[j]);
        sc[j] = v8f_fma(bv, v8f_load(qs + ((int64_t)j * fp->nch + c) * L8), sc[j]);
      }
    }
    put_scores8(part, sc, J, t, n, S);
  }
}

/* Float K rows (bf16 in split order). */
ALWAYS void kphase_f8(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *qp, int J, float *S,
                      const kva_prefetch *pf) {
  const int64_t es = (int64_t)kva_dtype_size(fp->sdt);
  v8f part[KQB][L8];
  for (int64_t t = 0; t < n; ++t) {
    if (pf && t < pf->n) prefetch_row(pf, t, KVA_ARR_K, KVA_ARR_V);
    const char *row = rows[t].k;
    v8f acc[KQB][2]; /* two chains per vector (FMA latency) */
    for (int j = 0; j < J; ++j) acc[j][0] = acc[j][1] = v8f_zero();
    int d = 0;
    if (fp->split)
#pragma GCC unroll 4
      for (; d + 16 <= fp->P; d += 16) {
        v8f ke, ko;
        load_bf16_split8(row + d * es, &ke, &ko);
        for (int j = 0; j < J; ++j) {
          acc[j][0] = v8f_fma(ke, v8f_load(qp + (int64_t)j * fp->P + d), acc[j][0]);
          acc[j][1] = v8f_fma(ko, v8f_load(qp + (int64_t)j * fp->P + d + L8), acc[j][1]);
        }
      }
    /* constant chain indices (a run-time index put the accumulators on the stack) */
    for (; d + 2 * L8 <= fp->P; d += 2 * L8) {
      const v8f k0 = load8(row + d * es, fp->sdt), k1 = load8(row + (d + L8) * es, fp->sdt);
      for (int j = 0; j < J; ++j) {
        acc[j][0] = v8f_fma(k0, v8f_load(qp + (int64_t)j * fp->P + d), acc[j][0]);
        acc[j][1] = v8f_fma(k1, v8f_load(qp + (int64_t)j * fp->P + d + L8), acc[j][1]);
      }
    }
    if (d < fp->P) {
      const v8f kv = load8(row + d * es, fp->sdt);
      for (int j = 0; j < J; ++j) acc[j][0] = v8f_fma(kv, v8f_load(qp + (int64_t)j * fp->P + d), acc[j][0]);
    }
    v8f sc[KQB];
    for (int j = 0; j < J; ++j) sc[j] = v8f_add(acc[j][0], acc[j][1]);
    if (fp->fp8 && rows[t].ks) /* the row's scale times q . codes */
      for (int j = 0; j < J; ++j) sc[j] = v8f_mul(sc[j], v8f_bcast((const float *)rows[t].ks));
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

#if defined(__AVX2__)

/* ---- K phase on integers (avx2; never in exact mode) ----
 * The query rounded to s8 per (vector, K group) as kva_ref_rounding with
 * q_int_bits = 8 models it (kvattn.h; the same f32 steps: sigma = max|q| /
 * 127, c = rint(q / sigma) clamped to +-127, on q as loaded, before the
 * logit scale), then q.codes as exact integer dot products: 4-bit codes by
 * vpmaddubsw of the u8 codes (the low and high nibbles of each byte: one
 * and, one shift + and per chunk) with the s8 query bytes (a pair sums to
 * at most 2*15*127, no saturation), the two nibble halves added in s16 and
 * vpmaddwd by ones into one int32 per word lane; 8-bit codes zero-extended
 * to s16 (unpack) and vpmaddwd with the query as s16. Per block of 8 rows
 * the word lanes of each group are reduced (phaddd) to one int32 I per
 * (row, group), and S[j][t] = sum_g sg_jg (s_tg I_jtg) + beta_jg b_tg with
 * sg = scale*sigma and beta = sg * sum(c) over the group. Group layouts:
 * every chunk in one group (8E <= G: a group is cpg whole chunks) or, for
 * 4-bit codes in groups of 32, two groups per chunk (halves: words 0-3 and
 * 4-7, the two 128-bit halves of the reduction). */

/* Lane t of the low (high) half of *lo (*hi) = the sum of lanes 0-3 (4-7)
 * of v[t]: the two halves of 8 rows' lane sums; their sum is the full sum. */
ALWAYS void reduce8_halves_i(const __m256i v[8], __m256i *lo, __m256i *hi) {
  const __m256i a0 = _mm256_hadd_epi32(v[0], v[1]), a1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i a2 = _mm256_hadd_epi32(v[4], v[5]), a3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
  *lo = _mm256_permute2x128_si256(b0, b1, 0x20);
  *hi = _mm256_permute2x128_si256(b0, b1, 0x31);
}

/* sc += sg * (s[t] * I[t]) + beta * b[t] for the 8 rows of a block (s, b:
 * the group's transposed scale and bias rows at the block's first row). */
ALWAYS __m256 iq_group_term(__m256i I, const float *s, const float *b, const float *sg, const float *beta, __m256 sc) {
  const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(I), _mm256_loadu_ps(s));
  sc = _mm256_fmadd_ps(f, _mm256_broadcast_ss(sg), sc);
  return _mm256_fmadd_ps(_mm256_loadu_ps(b), _mm256_broadcast_ss(beta), sc);
}

/* Scores of J vectors against n rows of quantized K (bits 4 or 8) with the
 * integer query qb (vector j at qb + j*qst bytes; query_int8's layout) and
 * its group factors sgb (vector j: sg[ng] then beta[ng] at sgb + j*sgst);
 * kst/kbt: the tile's K group scales/biases transposed, [g][KVA_TILE], zero
 * past n. */
ALWAYS void kphase_i8(const fmt8 *fp, const kva_rows *rows, int64_t n, const char *qb, int64_t qst,
                      const float *sgb, int64_t sgst, const float *kst, const float *kbt, int J, int bits,
                      float *S, const kva_prefetch *pf, int NCH, int CG) {
  /* NCH: a constant chunk count, every chunk full; CG: every chunk is one whole group (g = c) */
  const int nch = NCH ? NCH : fp->nch;
  const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), z = _mm256_setzero_si256();
  (void)ones; /* (unused at the avxvnni level) */
  __m256i part[KQB][MAXCH][L8]; /* [vector][chunk][row of the block]: int32 word-lane sums */
  for (int64_t t = 0; t < n; ++t) {
    if (pf && t < pf->n) prefetch_row3(pf, t, KVA_ARR_K);
    const char *row = rows[t].k;
    for (int c = 0; c < nch; ++c) {
      const __m256i x = NCH ? v8i_load(row + c * 32) : load_chunk(fp, row, c);
      if (bits == 4) {
        const __m256i lo = _mm256_and_si256(x, m4), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
        for (int j = 0; j < J; ++j) {
          const __m256i *q = (const __m256i *)(qb + (int64_t)j * qst) + 2 * c;
#if defined(__AVXVNNI__)
          part[j][c][t % L8] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(z, lo, _mm256_load_si256(q)), hi,
                                                       _mm256_load_si256(q + 1));
#else
          const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_load_si256(q)),
                                             _mm256_maddubs_epi16(hi, _mm256_load_si256(q + 1)));
          part[j][c][t % L8] = _mm256_madd_epi16(d, ones);
#endif
        }
      } else {
        const __m256i lo = _mm256_unpacklo_epi8(x, z), hi = _mm256_unpackhi_epi8(x, z);
        for (int j = 0; j < J; ++j) {
          const __m256i *q = (const __m256i *)(qb + (int64_t)j * qst) + 2 * c;
          part[j][c][t % L8] = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_load_si256(q)),
                                                _mm256_madd_epi16(hi, _mm256_load_si256(q + 1)));
        }
      }
    }
    if (t % L8 != L8 - 1 && t != n - 1) continue;
    /* the block's 8 rows: per chunk the lane sums of each group (int32, exact),
     * chunks of one group added, then the group's term */
    const int64_t t0 = t - t % L8;
    if (t % L8 != L8 - 1) /* the last, partial block: its missing rows add 0 */
      for (int j = 0; j < J; ++j)
        for (int c = 0; c < nch; ++c)
          for (int64_t r = t + 1; r < t0 + L8; ++r) part[j][c][r % L8] = z;
    const float *ks = kst + t0, *kb = kbt + t0;
    for (int j = 0; j < J; ++j) {
      const float *sg = sgb + (int64_t)j * sgst, *beta = sg + fp->ngroups;
      __m256 sc = _mm256_setzero_ps();
      __m256i I = z;
      for (int c = 0; c < nch; ++c) {
        __m256i lo, hi;
        reduce8_halves_i(part[j][c], &lo, &hi);
        if (CG) {
          sc = iq_group_term(_mm256_add_epi32(lo, hi), ks + c * KVA_TILE, kb + c * KVA_TILE, sg + c, beta + c, sc);
          continue;
        }
        if (fp->halves) {
          const int g = 2 * c;
          sc = iq_group_term(lo, ks + g * KVA_TILE, kb + g * KVA_TILE, sg + g, beta + g, sc);
          if (g + 1 < fp->ngroups)
            sc = iq_group_term(hi, ks + (g + 1) * KVA_TILE, kb + (g + 1) * KVA_TILE, sg + g + 1, beta + g + 1, sc);
          continue;
        }
        I = _mm256_add_epi32(I, _mm256_add_epi32(lo, hi));
        if (!fp->gend[c]) continue; /* the group goes on in the next chunk */
        const int g = fp->g0[c];
        sc = iq_group_term(I, ks + g * KVA_TILE, kb + g * KVA_TILE, sg + g, beta + g, sc);
        I = z;
      }
      _mm256_storeu_ps(S + j * KVA_TILE + t0, sc);
    }
  }
}
/* 4-bit K with every chunk in one group (groups of >= 64): rows in lanes.
 * Per block of 4 rows and chunk c, two unpack levels turn the rows' 8 words
 * into X_i = [word i of rows 0-3 | word i+4 of rows 0-3] (i = 0..3); the
 * low / high nibbles of X_i times the query bytes of those words, broadcast
 * per 128-bit half (query_int8's row-lane layout: 8 vectors per chunk, 2i
 * low nibbles, 2i+1 high), by vpmaddubsw, the chunk's 8 products added in
 * s16 (at most 8*2*15*127 = 30480), vpmaddwd by ones (avxvnni: the 8
 * products by vpdpbusd straight into int32) and the two halves added: the
 * exact int32 I of each (row, chunk), summed over the chunks of a group
 * into I[j][g][t]. Then per 8 rows S = sum_g the group term, as
 * kphase_i8 (the same values: I is exact either way), with no per-row
 * horizontal reduction. Rows past n read zero codes. CG: every chunk is
 * one whole group (g = c) and the row has NCH chunks. */
static const uint8_t kzero_row[MAXCH * 32] __attribute__((aligned(32)));
ALWAYS void kphase_i4t(const fmt8 *fp, const kva_rows *rows, int64_t n, const char *qb, int64_t qst,
                       const float *sgb, int64_t sgst, const float *kst, const float *kbt, int J, float *S,
                       const kva_prefetch *pf, int NCH, int CG) {
  const int nch = NCH ? NCH : fp->nch, ng = CG ? NCH : fp->ngroups;
  const int64_t n8 = (n + L8 - 1) / L8 * L8;
  const __m256i m4 = _mm256_set1_epi8(0x0f);
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  int32_t I[KQB][MAXG][KVA_TILE] __attribute__((aligned(32)));
  for (int64_t t0 = 0; t0 < n8; t0 += 4) {
    const char *r[4];
    for (int u = 0; u < 4; ++u) {
      const int64_t t = t0 + u;
      if (pf && t < pf->n) prefetch_row3(pf, t, KVA_ARR_K);
      r[u] = t < n ? rows[t].k : (const char *)kzero_row;
    }
    __m128i gacc[KQB] = {0};
    for (int c = 0; c < nch; ++c) {
      __m256i x[4];
      for (int u = 0; u < 4; ++u) x[u] = NCH ? v8i_load(r[u] + c * 32) : load_chunk(fp, r[u], c);
      const __m256i ab0 = _mm256_unpacklo_epi32(x[0], x[1]), ab1 = _mm256_unpackhi_epi32(x[0], x[1]);
      const __m256i cd0 = _mm256_unpacklo_epi32(x[2], x[3]), cd1 = _mm256_unpackhi_epi32(x[2], x[3]);
      const __m256i X[4] = {_mm256_unpacklo_epi64(ab0, cd0), _mm256_unpackhi_epi64(ab0, cd0),
                            _mm256_unpacklo_epi64(ab1, cd1), _mm256_unpackhi_epi64(ab1, cd1)};
      __m256i lo[4], hi[4];
      for (int i = 0; i < 4; ++i) {
        lo[i] = _mm256_and_si256(X[i], m4);
        hi[i] = _mm256_and_si256(_mm256_srli_epi16(X[i], 4), m4);
      }
      const int first = CG || c == 0 || fp->gend[c - 1], last = CG || fp->gend[c];
      for (int j = 0; j < J; ++j) {
        const __m256i *q = (const __m256i *)(qb + (int64_t)j * qst) + 8 * c;
#if defined(__AVXVNNI__)
        __m256i d[4]; /* four chains (the vpdpbusd latency) */
        for (int i = 0; i < 4; ++i) {
          d[i] = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo[i], _mm256_load_si256(q + 2 * i));
          d[i] = _mm256_dpbusd_avx_epi32(d[i], hi[i], _mm256_load_si256(q + 2 * i + 1));
        }
        const __m256i w = _mm256_add_epi32(_mm256_add_epi32(d[0], d[1]), _mm256_add_epi32(d[2], d[3]));
#else
        __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], _mm256_load_si256(q)),
                                     _mm256_maddubs_epi16(hi[0], _mm256_load_si256(q + 1)));
        for (int i = 1; i < 4; ++i) {
          s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[i], _mm256_load_si256(q + 2 * i)));
          s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[i], _mm256_load_si256(q + 2 * i + 1)));
        }
        const __m256i w = _mm256_madd_epi16(s, ones);
#endif
        const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        gacc[j] = first ? h : _mm_add_epi32(gacc[j], h);
        if (last) _mm_store_si128((__m128i *)&I[j][CG ? c : fp->g0[c]][t0], gacc[j]);
      }
    }
  }
  for (int64_t t0 = 0; t0 < n8; t0 += L8) {
    const float *ks = kst + t0, *kb = kbt + t0;
    for (int j = 0; j < J; ++j) {
      const float *sg = sgb + (int64_t)j * sgst, *beta = sg + fp->ngroups;
      __m256 sc = _mm256_setzero_ps();
      for (int g = 0; g < ng; ++g)
        sc = iq_group_term(_mm256_load_si256((const __m256i *)&I[j][g][t0]), ks + g * KVA_TILE, kb + g * KVA_TILE,
                           sg + g, beta + g, sc);
      _mm256_storeu_ps(S + j * KVA_TILE + t0, sc);
    }
  }
}

/* kphase_i4t applies: 4-bit codes, every chunk in one group. */
static int i4t_format(const fmt8 *fp) { return fp->bits == 4 && fp->one_group; }

#define KIBLOCK(J_)                                                                                             \
  static void kiblock8_##J_(const fmt8 *fp, const kva_rows *rows, int64_t n, const char *qb, int64_t qst,      \
                            const float *sgb, int64_t sgst, const float *kst, const float *kbt, float *S,      \
                            const kva_prefetch *pf) {                                                          \
    const int full4 = fp->nch == 4 && fp->full[3]; /* head dim 256 at 4 bits, 128 at 8 */                     \
    const int cg = full4 && fp->G == L8 * fp->E;   /* and groups of one chunk: q4 g64, q8 g32 */               \
    if (i4t_format(fp) && cg) kphase_i4t(fp, rows, n, qb, qst, sgb, sgst, kst, kbt, J_, S, pf, 4, 1);          \
    else if (i4t_format(fp)) kphase_i4t(fp, rows, n, qb, qst, sgb, sgst, kst, kbt, J_, S, pf, 0, 0);          \
    else if (fp->bits == 4 && full4) kphase_i8(fp, rows, n, qb, qst, sgb, sgst, kst, kbt, J_, 4, S, pf, 4, 0); \
    else if (fp->bits == 4) kphase_i8(fp, rows, n, qb, qst, sgb, sgst, kst, kbt, J_, 4, S, pf, 0, 0);         \
    else if (cg) kphase_i8(fp, rows, n, qb, qst, sgb, sgst, kst, kbt, J_, 8, S, pf, 4, 1);                    \
    else if (full4) kphase_i8(fp, rows, n, qb, qst, sgb, sgst, kst, kbt, J_, 8, S, pf, 4, 0);                 \
    else kphase_i8(fp, rows, n, qb, qst, sgb, sgst, kst, kbt, J_, 8, S, pf, 0, 0);                            \
  }
KIBLOCK(1)
KIBLOCK(2)
KIBLOCK(4)

/* All nq vectors in register blocks of 4, 2, 1 on the integer query (qp:
 * bytes of query_int8 per vector, P floats apart; qs: sg, beta per vector,
 * nch*8 floats apart). */
static void kphase_int8(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *qp, const float *qs,
                        const float *kst, const float *kbt, int64_t nq, float *S, const kva_prefetch *pf) {
  const int64_t qst = (int64_t)fp->P * 4, sgst = (int64_t)fp->nch * L8;
  int64_t j = 0;
#define KIARGS(J) rows, n, (const char *)(qp + (J) * fp->P), qst, qs + (J) * sgst, sgst, kst, kbt, S + (J) * KVA_TILE, pf
  for (; j + 4 <= nq; j += 4, pf = NULL) kiblock8_4(fp, KIARGS(j));
  if (j + 2 <= nq) { kiblock8_2(fp, KIARGS(j)); j += 2; pf = NULL; }
  if (j < nq) kiblock8_1(fp, KIARGS(j));
#undef KIARGS
}

/* The integer K phase applies: 4-bit codes with every chunk in one group or
 * in two (groups of 32), or 8-bit codes. */
static int iq_format_ok(const fmt8 *fp) {
  if (fp->bits == 4) return fp->one_group || fp->G == 32;
  return fp->bits == 8;
}

/* One query (D elements, as loaded) for kphase_i8: per group sigma = max|q|
 * / 127, c = rint(q * (1 / sigma)) clamped to +-127 (kva_ref_rounding's
 * f32 steps); sg[g] = scale * sigma, beta[g] = sg[g] * sum(c). A query
 * with a NaN or Inf element gets sg = beta = NaN (its logits NaN, as the
 * oracle's are); a group too small for 1 / sigma (max |q| below ~2^-121,
 * which the oracle leaves unrounded) gets c = 0 (its term below 2^-121 of
 * sum |k|). Bytes at qb, per chunk: 4-bit codes with every chunk in one
 * group (kphase_i4t), s8, 8 vectors of 32, vector v byte b = element
 * (c*8 + v/2 + 4*(b/16))*8 + (b%4)*2 + v%2; other 4-bit codes, s8, 2
 * vectors, vector i byte b = element (c*8 + b/4)*8 + (b%4)*2 + i (the low
 * / high nibble of byte b); 8-bit
 * codes, s16, vector h element k = the query element of chunk byte
 * (k/8)*16 + h*8 + k%8 (unpacklo / unpackhi within each 128-bit half),
 * byte b = element (c*8 + b/4)*4 + b%4. Words past the row: 0. */
static void query_int8(const fmt8 *fp, int64_t D, const float *q, float scale, char *qb, float *sg) {
  int8_t c8[KVA_MAX_HEAD_DIM + 64] __attribute__((aligned(32))); /* zero past D to the last chunk's end */
  float *beta = sg + fp->ngroups;
  int finite = 1;
  for (int64_t d = 0; d < D; ++d) finite &= isfinite(q[d]) != 0;
  for (int g = 0; g < fp->ngroups; ++g) {
    int sum;
    if (finite && fp->G % 32 == 0) sg[g] = simd_query_group_s8_32(q, (int64_t)g * fp->G, fp->G, scale, c8, &sum);
    else sg[g] = simd_query_group_s8(q, (int64_t)g * fp->G, fp->G, finite, scale, c8, &sum);
    beta[g] = sg[g] * (float)sum;
  }
  const int64_t words = D / fp->E;
  if (i4t_format(fp)) memset(c8 + D, 0, (size_t)(fp->nch * 64 - D)); /* 4-bit chunks: 64 codes */
  for (int c = 0; c < fp->nch; ++c) {
    if (i4t_format(fp)) {
      /* the 2-vector layout below by byte shuffles (per 128-bit lane: even
       * bytes of 2 words, then odd: dwords e0 e1 o0 o1), then word i of
       * each half broadcast */
      const __m256i sel = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                                           14, 1, 3, 5, 7, 9, 11, 13, 15);
      const __m256i eo = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
      const __m256i y0 = _mm256_permutevar8x32_epi32(
                        _mm256_shuffle_epi8(_mm256_load_si256((const __m256i *)(c8 + c * 64)), sel), eo),
                    y1 = _mm256_permutevar8x32_epi32(
                        _mm256_shuffle_epi8(_mm256_load_si256((const __m256i *)(c8 + c * 64 + 32)), sel), eo);
      const __m256i lh[2] = {_mm256_permute2x128_si256(y0, y1, 0x20), _mm256_permute2x128_si256(y0, y1, 0x31)};
      __m256i *dst = (__m256i *)(qb + (int64_t)c * 8 * 32);
      for (int h = 0; h < 2; ++h) {
        const __m256i x = lh[h];
        _mm256_storeu_si256(dst + h, _mm256_shuffle_epi32(x, 0x00));
        _mm256_storeu_si256(dst + 2 + h, _mm256_shuffle_epi32(x, 0x55));
        _mm256_storeu_si256(dst + 4 + h, _mm256_shuffle_epi32(x, 0xAA));
        _mm256_storeu_si256(dst + 6 + h, _mm256_shuffle_epi32(x, 0xFF));
      }
    } else if (fp->bits == 4) {
      for (int i = 0; i < 2; ++i)
        for (int b = 0; b < 32; ++b) {
          const int64_t w = (int64_t)c * L8 + b / 4;
          qb[((int64_t)c * 2 + i) * 32 + b] = w < words ? c8[w * 8 + (b % 4) * 2 + i] : 0;
        }
    } else {
      int16_t *q16 = (int16_t *)qb;
      for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 16; ++k) {
          const int b = (k / 8) * 16 + h * 8 + k % 8;
          const int64_t w = (int64_t)c * L8 + b / 4;
          q16[((int64_t)c * 2 + h) * 16 + k] = w < words ? c8[w * 4 + b % 4] : 0;
        }
    }
  }
}

/* The tile's group scales and biases of one operand (arrays as, ab of the
 * rows) as f32 straight into st/bt[g][KVA_TILE] (token-major per group, as
 * the integer phases read them), zero past n; one loop per scale dtype and
 * for 4 groups (head dim 256 in groups of 64). */
#define GROUPS_T_LOOP(LOAD, NG)                                                                                \
  for (int64_t t = 0; t < n; ++t) {                                                                            \
    const char *sp = rows[t].a[as], *bp = rows[t].a[ab];                                                       \
    for (int g = 0; g < (NG); ++g) {                                                                           \
      st[g * KVA_TILE + t] = LOAD(sp, g);                                                                      \
      bt[g * KVA_TILE + t] = LOAD(bp, g);                                                                      \
    }                                                                                                          \
  }
#define LOAD_BF16(p, g) simd_bf16f(((const uint16_t *)(p))[g])
#define LOAD_ANY(p, g) simd_load_scale((p), fp->sdt, (g))
/* 8 rows' 4 bf16 values (p[u]: row u's 8 bytes) as f32, transposed: value
 * g of rows 0-7 into dst[g * KVA_TILE .. + 8) (16-, 32-, 64-bit unpacks). */
ALWAYS void bf16x4_t8(const char *const p[8], float *dst) {
  __m128i r[8], a[4], b[4];
  for (int u = 0; u < 8; ++u) r[u] = _mm_loadl_epi64((const __m128i *)p[u]);
  for (int u = 0; u < 4; ++u) a[u] = _mm_unpacklo_epi16(r[2 * u], r[2 * u + 1]); /* rows 2u, 2u+1: g0 g0 g1 g1 .. */
  b[0] = _mm_unpacklo_epi32(a[0], a[1]); /* rows 0-3: g0 x4, g1 x4 */
  b[1] = _mm_unpackhi_epi32(a[0], a[1]); /* rows 0-3: g2, g3 */
  b[2] = _mm_unpacklo_epi32(a[2], a[3]);
  b[3] = _mm_unpackhi_epi32(a[2], a[3]);
  const __m128i g[4] = {_mm_unpacklo_epi64(b[0], b[2]), _mm_unpackhi_epi64(b[0], b[2]), _mm_unpacklo_epi64(b[1], b[3]),
                        _mm_unpackhi_epi64(b[1], b[3])};
  for (int k = 0; k < 4; ++k)
    _mm256_storeu_ps(dst + k * KVA_TILE, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(g[k]), 16)));
}
static void groups_t(const fmt8 *fp, const kva_rows *rows, int64_t n, int as, int ab, float *st, float *bt) {
  const int ng = fp->ngroups;
  if (fp->sdt == KVA_BF16 && ng == 4 && n == KVA_TILE) { /* whole tiles, head dim 256 in groups of 64 */
    for (int64_t t = 0; t < n; t += L8) {
      const char *ps[8], *pb[8];
      for (int u = 0; u < 8; ++u) {
        ps[u] = rows[t + u].a[as];
        pb[u] = rows[t + u].a[ab];
      }
      bf16x4_t8(ps, st + t);
      bf16x4_t8(pb, bt + t);
    }
    return;
  }
  if (fp->sdt == KVA_BF16 && ng == 4) GROUPS_T_LOOP(LOAD_BF16, 4)
  else if (fp->sdt == KVA_BF16) GROUPS_T_LOOP(LOAD_BF16, ng)
  else GROUPS_T_LOOP(LOAD_ANY, ng)
  if (n < KVA_TILE)
    for (int g = 0; g < ng; ++g) {
      memset(st + g * KVA_TILE + n, 0, sizeof(float) * (size_t)(KVA_TILE - n));
      memset(bt + g * KVA_TILE + n, 0, sizeof(float) * (size_t)(KVA_TILE - n));
    }
}
#undef GROUPS_T_LOOP
#undef LOAD_BF16
#undef LOAD_ANY
/* K: as k_groups_nan on the transposed tables (a scale NaN where it or its
 * bias is +-inf). */
static void k_groups_nan_t(const fmt8 *fp, float *st, const float *bt) {
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), inf = _mm256_set1_ps(INFINITY);
  for (int g = 0; g < fp->ngroups; ++g)
    for (int t = 0; t < KVA_TILE; t += L8) {
      const __m256 sv = _mm256_loadu_ps(st + g * KVA_TILE + t), bv = _mm256_loadu_ps(bt + g * KVA_TILE + t);
      const __m256 bad = _mm256_or_ps(_mm256_cmp_ps(_mm256_and_ps(sv, absm), inf, _CMP_EQ_OQ),
                                      _mm256_cmp_ps(_mm256_and_ps(bv, absm), inf, _CMP_EQ_OQ));
      _mm256_storeu_ps(st + g * KVA_TILE + t, _mm256_blendv_ps(sv, _mm256_set1_ps(NAN), bad));
    }
}

#endif

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
ALWAYS v8f fma_keep(v8f w, v8f v, v8f acc, v8f keep, int masked) {
  const v8f r = v8f_fma(w, v, acc);
  return masked ? v8f_blend(acc, r, keep) : r;
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
 * (faster for each, cold, on the AVX2 host). */
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
  const v8i gidx = fp->gidx[c];
  v8f acc[4][4];
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < KB; ++k) acc[j][k] = v8f_load(oc + (int64_t)j * fp->P + k * L8);
  int64_t next = pf.pf ? pf.p : n; /* the next row this pass prefetches */
  for (int64_t t = 0; t < n; ++t) {
    if (t == next) {
      if (t < pf.pf->n) prefetch_row(pf.pf, t, KVA_ARR_V, KVA_ARRS);
      next += pf.np;
    }
    const v8i x = load_chunk(fp, rows[t].v, c);
    v8f w[4];
    for (int j = 0; j < J; ++j) {
      const float *wt = wc + ((int64_t)j * KVA_TILE + t) * GLD;
      w[j] = ONE ? v8f_bcast(wt) : v8f_groups(wt, gidx, fp->wpg);
    }
    for (int k = 0; k < KB; ++k) {
      const v8f f = code8(x, k0 + k, bits);
      for (int j = 0; j < J; ++j) acc[j][k] = v8f_fma(w[j], f, acc[j][k]);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < KB; ++k) v8f_store(oc + (int64_t)j * fp->P + k * L8, acc[j][k]);
}
/* All chunks and passes of one block of J vectors (4 codes per word per
 * pass for J <= 2, 2 for J = 4: 8 accumulators); k0 and ONE are constants. */
#define VDIRECT_Q(BITS, J)                                                                                     \
  static void vdirect_q##BITS##_##J(const fmt8 *fp, const kva_rows *rows, int64_t n,                         \
                                    const float *ws, float *o, const kva_prefetch *pf) {                       \
    enum { KB = J == 4 ? 2 : 4, KP = 32 / BITS / KB }; /* codes per pass, passes per chunk */                  \
    const int np = fp->nch * KP;                                                                               \
    for (int c = 0; c < fp->nch; ++c)                                                                          \
      _Pragma("GCC unroll 8") for (int kp = 0; kp < KP; ++kp) { /* k0 a constant: immediate shifts */          \
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
/* acc[j][0..NV) += P[j][t] * v_t[d0 .. d0 + 8*NV); split: NV even. Only
 * the keys some vector of the block sees (the tile's list live, nl of
 * them); a key seen by one of two adds to that one only (0 x NaN must not
 * leak). The prefetch share runs on the list position, the rows the list
 * skips after it. */
ALWAYS void vdirect_f_pass(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *P, const int8_t *live,
                           int nl, float *o, int d0, int J, int NV, int split, int SAME, vshare pf) {
  const int64_t es = (int64_t)kva_dtype_size(fp->sdt);
  v8f acc[2][VFB];
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < NV; ++k) acc[j][k] = v8f_load(o + (int64_t)j * fp->P + d0 + k * L8);
  int64_t next = pf.pf ? pf.p : n; /* the next row this pass prefetches */
  for (int i = 0; i < nl; ++i) {
    if (i == next) {
      if (i < pf.pf->n) prefetch_row(pf.pf, i, KVA_ARR_V, KVA_ARRS);
      next += pf.np;
    }
    const int t = live[i];
    const float p0 = P[t], p1 = J == 2 ? P[KVA_TILE + t] : 0.0f;
    const char *row = rows[t].v + d0 * es;
    v8f v[VFB];
    for (int k = 0; k < NV; k += split ? 2 : 1) {
      if (split) load_bf16_split8(row + k * L8 * es, &v[k], &v[k + 1]);
      else v[k] = load8(row + k * L8 * es, fp->sdt);
    }
    /* fp8: P times the row's scale (split rows are bf16) */
    const float vsc = !split && fp->fp8 && rows[t].vs ? *(const float *)rows[t].vs : 1.0f;
    const v8f w0 = v8f_set1(p0 * vsc), w1 = v8f_set1(p1 * vsc);
    if (J == 1 || SAME || (p0 != 0.0f && p1 != 0.0f)) {
      for (int k = 0; k < NV; ++k) {
        acc[0][k] = v8f_fma(w0, v[k], acc[0][k]);
        if (J == 2) acc[1][k] = v8f_fma(w1, v[k], acc[1][k]);
      }
    } else if (p0 != 0.0f) {
      for (int k = 0; k < NV; ++k) acc[0][k] = v8f_fma(w0, v[k], acc[0][k]);
    } else {
      for (int k = 0; k < NV; ++k) acc[1][k] = v8f_fma(w1, v[k], acc[1][k]);
    }
  }
  for (; pf.pf && next < n && next < pf.pf->n; next += pf.np) prefetch_row(pf.pf, next, KVA_ARR_V, KVA_ARRS);
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < NV; ++k) v8f_store(o + (int64_t)j * fp->P + d0 + k * L8, acc[j][k]);
}
/* Passes of VFB vectors (split: pairs of full 16-element blocks first),
 * then single vectors. SAME: every key of the tile is seen by both vectors
 * of the block or by neither (always at L = 1): no per-key branch between
 * the FMAs (with it the compiler kept accumulators on the stack). */
#define VDIRECT_F_PASSES(J, SAME)                                                                              \
  for (int i = 0; i < big; ++i, d0 += VFB * L8, ++ip) {                                                        \
    if (fp->split) vdirect_f_pass(fp, rows, n, P, live, nl, o, d0, J, VFB, 1, SAME, vshare_of(pf, ip, np));    \
    else vdirect_f_pass(fp, rows, n, P, live, nl, o, d0, J, VFB, 0, SAME, vshare_of(pf, ip, np));              \
  }                                                                                                            \
  for (int i = 0; i < pairs; ++i, d0 += 2 * L8, ++ip)                                                          \
    vdirect_f_pass(fp, rows, n, P, live, nl, o, d0, J, 2, 1, SAME, vshare_of(pf, ip, np));                     \
  for (int i = 0; i < singles; ++i, d0 += L8, ++ip)                                                            \
    vdirect_f_pass(fp, rows, n, P, live, nl, o, d0, J, 1, 0, SAME, vshare_of(pf, ip, np));
#define VDIRECT_F(J)                                                                                           \
  static void vdirect_f8_##J(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *P, float *o,       \
                             const kva_prefetch *pf) {                                                         \
    const int big = fp->P / (VFB * L8), rest = fp->P % (VFB * L8);                                             \
    const int pairs = fp->split ? rest / (2 * L8) : 0, singles = (rest - pairs * 2 * L8) / L8;                 \
    const int np = big + pairs + singles;                                                                      \
    int same = 1, nl = 0;                                                                                      \
    int8_t live[KVA_TILE]; /* the keys some vector sees (KVA_TILE <= 127) */                                   \
    for (int64_t t = 0; t < n; ++t) {                                                                          \
      const int s0 = P[t] != 0.0f, s1 = J == 2 && P[KVA_TILE + t] != 0.0f;                                    \
      if (J == 2) same &= s0 == s1;                                                                            \
      live[nl] = (int8_t)t;                                                                                    \
      nl += s0 | s1;                                                                                           \
    }                                                                                                          \
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
#define NONFINITE(v) v8i_eq(v8i_and(v8f_as_i(v), expo), expo)
/* s*c + b of the E codes per word of chunk x into dst[k][8]; the lanes that are NaN or Inf. */
ALWAYS v8i dequant_chunk(v8i x, v8f sv, v8f bv, int bits, float *dst) {
  const v8i expo = v8i_set1(0x7f800000);
  v8i bad = v8i_zero();
  for (int k = 0; k < 32 / bits; ++k) {
    const v8f v = v8f_fma(sv, code8(x, k, bits), bv);
    bad = v8i_or(bad, NONFINITE(v));
    v8f_store(dst + k * L8, v);
  }
  return bad;
}
static int decode_v_tile8(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *gs, const float *gb,
                          float *vt, const kva_prefetch *pf) {
  const v8i expo = v8i_set1(0x7f800000);
  v8i bad = v8i_zero();
  for (int64_t t = 0; t < n; ++t) {
    if (pf && t < pf->n) prefetch_row(pf, t, KVA_ARR_V, KVA_ARRS);
    const char *row = rows[t].v;
    float *dst = vt + t * VT_LD(fp);
    if (!fp->bits) {
      const int64_t es = (int64_t)kva_dtype_size(fp->sdt);
      int d = 0;
      if (fp->split)
        for (; d + 16 <= fp->P; d += 16) {
          v8f ve, vo;
          load_bf16_split8(row + d * es, &ve, &vo);
          bad = v8i_or(bad, v8i_or(NONFINITE(ve), NONFINITE(vo)));
          v8f_store(dst + d, ve);
          v8f_store(dst + d + L8, vo);
        }
      const v8f vsc = v8f_set1(fp->fp8 && rows[t].vs ? *(const float *)rows[t].vs : 1.0f); /* fp8: the row's scale */
      for (; d < fp->P; d += L8) {
        const v8f v = fp->fp8 ? v8f_mul(load8(row + d * es, fp->sdt), vsc) : load8(row + d * es, fp->sdt);
        bad = v8i_or(bad, NONFINITE(v));
        v8f_store(dst + d, v);
      }
      continue;
    }
    for (int c = 0; c < fp->nch; ++c) {
      const v8i x = load_chunk(fp, row, c);
      const v8f sv = chunk_lanes(fp, gs + t * GLD, c), bv = chunk_lanes(fp, gb + t * GLD, c);
      switch (fp->bits) {
      case 4: bad = v8i_or(bad, dequant_chunk(x, sv, bv, 4, dst + c * 8 * L8)); break;
      case 8: bad = v8i_or(bad, dequant_chunk(x, sv, bv, 8, dst + c * 4 * L8)); break;
      default: bad = v8i_or(bad, dequant_chunk(x, sv, bv, 2, dst + c * 16 * L8)); break;
      }
    }
  }
  return v8i_any(bad);
}

/* o[j][pos0 .. pos0 + 8*KB) += sum_t P[j][t] * vt[t][...] for J vectors;
 * MASK: keys with P == 0 add exactly nothing (tiles with a NaN or Inf). */
ALWAYS void vtile_block(const fmt8 *fp, int64_t n, const float *P, const float *vt, float *o, int64_t pos0, int J,
                        int KB, int MASK) {
  v8f acc[VJB][2];
  for (int j = 0; j < J; ++j)
    for (int kb = 0; kb < KB; ++kb) acc[j][kb] = v8f_load(o + (int64_t)j * fp->P + pos0 + kb * L8);
  for (int64_t t = 0; t < n; ++t) {
    v8f w[VJB], keep[VJB];
    for (int j = 0; j < J; ++j) {
      w[j] = v8f_bcast(P + j * KVA_TILE + t);
      if (MASK) keep[j] = v8f_neq0(w[j]);
    }
    for (int kb = 0; kb < KB; ++kb) {
      const v8f v = v8f_load(vt + t * VT_LD(fp) + pos0 + kb * L8);
      for (int j = 0; j < J; ++j) acc[j][kb] = fma_keep(w[j], v, acc[j][kb], MASK ? keep[j] : w[j], MASK);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int kb = 0; kb < KB; ++kb) v8f_store(o + (int64_t)j * fp->P + pos0 + kb * L8, acc[j][kb]);
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
    v8f a0 = v8f_load(obj), a1 = v8f_load(obj + L8);
    for (int64_t t = 0; t < n; ++t) {
      const float pj = S[j * KVA_TILE + t];
      float *w = ws + (j * KVA_TILE + t) * GLD;
      if (pj == 0.0f) {
        v8f_store(w, v8f_zero());
        if (two) v8f_store(w + L8, v8f_zero());
        continue;
      }
      const v8f pv = v8f_set1(pj);
      v8f_store(w, v8f_mul(pv, v8f_load(gs + t * GLD)));
      a0 = v8f_fma(pv, v8f_load(gb + t * GLD), a0);
      if (two) {
        v8f_store(w + L8, v8f_mul(pv, v8f_load(gs + t * GLD + L8)));
        a1 = v8f_fma(pv, v8f_load(gb + t * GLD + L8), a1);
      }
    }
    v8f_store(obj, a0);
    v8f_store(obj + L8, a1);
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

#if defined(__AVX2__)
/* ---- V phase on 16-bit integers (avx2; never in exact mode) ----
 * Quantized V with every chunk of 8 words in one group (4-bit codes in
 * groups of >= 64, 8-bit in groups of >= 32): per element of group g,
 *   o_j += sum_t p_jt (s_tg c_t + b_tg) = sum_t w_jtg c_t + b_tg sum_t p_jt,
 * with w = p * s rounded to s16 per (vector j, tile, group g) ("P int16",
 * the rounding of the AVX-512 level's vphase_pint): with M = max_t |w_jtg|
 * over the tile's tokens, sigma = 2^-k, k = 14 - floor(log2 M) (one less
 * where M 2^k would round to 2^15), w' = rint(w / sigma) (|w'| <= 32767),
 * the scaling exact (powers of two), so |w' sigma - w| <= M / 32767.5. A
 * group whose M is 0 adds nothing, one whose M is below 2^-135 (sigma below
 * f32's range) is lost; a NaN weight (NaN logits) gives garbage codes, but
 * its NaN reaches the bias sum and the vector's l, so the output is NaN as
 * in the f32 path. The bias sums sum_t p b stay f32 (ob, as the f32 path).
 * Codes of two tokens sit in the s16 halves of each u32 lane (token 2i low,
 * 2i + 1 high), decoded once per tile into L1 (ct[pair][P], o's permuted
 * order: 16 KiB at P = 256); vpmaddwd with the u32 of the two tokens' s16
 * weights broadcast adds w'_2i c_2i + w'_2i+1 c_2i+1 into int32 lanes, at
 * most 16 pairs of 2 * 32767 * 255 < 2^28 per tile (no overflow); the
 * int32 sums times sigma go to o in f32 once per tile. Tiles whose V rows
 * hold a non-finite scale or bias take the f32 path (vphase8). Per token
 * pair and chunk: two loads, a shift and a blend per 16-bit half (the two
 * tokens' low or high halves of each word), a 16-bit shift and an and per
 * code vector (the shift alone for each half's top code); per vector and code vector one vpmaddwd and one
 * vpaddd (16 products), the weight one broadcast per block. */
#define IVB 4 /* query vectors per weight block */

/* Whether problem p takes the integer V phase on V rows fp: 16-bit
 * queries, not exact mode, 4-bit / 8-bit codes with whole chunks in one
 * group (any number of query vectors: at 16 and 48 per KV head it also
 * ran fewer instructions than the f32 tile, callgrind). */
static int iv_on(const kva_problem *p, const fmt8 *fp) {
  return !p->exact && p->q->dtype != KVA_F32 && (fp->bits == 4 || fp->bits == 8) && fp->one_group;
}

/* x * 2^k, exactly, for |x| 2^k below 2^15 and k in [-126, 190]. */
ALWAYS __m256 iv_scale(__m256 x, int k) {
  if (k > 127) {
    x = _mm256_mul_ps(x, _mm256_set1_ps(0x1p64f));
    k -= 64;
  }
  return _mm256_mul_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32((k + 127) << 23)));
}

/* Whether any of the tile's V group scales or biases (st/bt[g][KVA_TILE],
 * zero past n) is NaN or Inf. */
static int iv_nonfinite(const fmt8 *fp, const float *st, const float *bt) {
  const v8i expo = v8i_set1(0x7f800000);
  v8i bad = v8i_zero();
  for (int g = 0; g < fp->ngroups; ++g)
    for (int t = 0; t < KVA_TILE; t += L8)
      bad = v8i_or(bad, v8i_or(NONFINITE(v8f_load(st + g * KVA_TILE + t)), NONFINITE(v8f_load(bt + g * KVA_TILE + t))));
  return v8i_any(bad);
}

/* Code vectors of a token pair (chunks x0 of token 2i, x1 of 2i + 1): code
 * k of each word of x0 in the low s16 of its lane, of x1 in the high one,
 * into dst[k][8]. */
ALWAYS void iv_codes(__m256i x0, __m256i x1, int bits, int32_t *dst) {
  const int C = 16 / bits; /* codes per 16-bit half */
  const __m256i m = _mm256_set1_epi32(bits == 8 ? 0x00FF00FF : 0x000F000F);
  const __m256i lo = _mm256_blend_epi16(x0, _mm256_slli_epi32(x1, 16), 0xAA);
  const __m256i hi = _mm256_blend_epi16(_mm256_srli_epi32(x0, 16), x1, 0xAA);
  for (int k = 0; k < 2 * C; ++k) {
    const __m256i y = k < C ? lo : hi;
    const int s = (k % C) * bits; /* the top code of each half: a 16-bit shift alone */
    _mm256_storeu_si256((__m256i *)(dst + k * L8),
                        s + bits == 16 ? _mm256_srli_epi16(y, s) : _mm256_and_si256(s ? _mm256_srli_epi16(y, s) : y, m));
  }
}
ALWAYS void iv_decode(const fmt8 *fp, const kva_rows *rows, int64_t n, int bits, int32_t *ct,
                      const kva_prefetch *pf) {
  const int E = 32 / bits;
  for (int64_t t = 0; t < n; t += 2) {
    const int two = t + 1 < n;
    if (pf && t < pf->n) prefetch_row(pf, t, KVA_ARR_V, KVA_ARRS);
    if (pf && two && t + 1 < pf->n) prefetch_row(pf, t + 1, KVA_ARR_V, KVA_ARRS);
    int32_t *dst = ct + (t / 2) * fp->P;
    for (int c = 0; c < fp->nch; ++c) {
      const __m256i x0 = v8i_load(rows[t].v + c * 32);
      const __m256i x1 = two ? v8i_load(rows[t + 1].v + c * 32) : _mm256_setzero_si256();
      iv_codes(x0, x1, bits, dst + (int64_t)c * E * L8);
    }
  }
}

/* The weights of J <= IVB vectors for the tile (P: vector j's 32 weights
 * at P + j*KVA_TILE, zero past n): wg[j][g][pair] (two s16 weights per
 * u32), sigma into sig[j][g], sum_t p b added to ob[j][g] (MAXG apart). */
static void iv_weights(const fmt8 *fp, const float *P, int J, const float *st, const float *bt, int32_t *wg,
                       float *sig, float *ob) {
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int j = 0; j < J; ++j) {
    __m256 p[4];
    for (int u = 0; u < 4; ++u) p[u] = _mm256_loadu_ps(P + j * KVA_TILE + u * L8);
    for (int g = 0; g < fp->ngroups; ++g) {
      const float *sg = st + g * KVA_TILE, *bg = bt + g * KVA_TILE;
      __m256 w[4], mx = _mm256_setzero_ps(), bs = _mm256_setzero_ps();
      for (int u = 0; u < 4; ++u) {
        w[u] = _mm256_mul_ps(p[u], _mm256_loadu_ps(sg + u * L8));
        mx = _mm256_max_ps(mx, _mm256_and_ps(w[u], absm));
        bs = _mm256_fmadd_ps(p[u], _mm256_loadu_ps(bg + u * L8), bs);
      }
      ob[j * MAXG + g] += v8f_hsum(bs);
      const float M = v8f_hmax(mx);
      int32_t *wj = wg + (j * MAXG + g) * (KVA_TILE / 2);
      if (!(M > 0.0f) || !isfinite(M)) { /* nothing to add, or NaN weights (ob is NaN) */
        sig[j * MAXG + g] = 0.0f;
        memset(wj, 0, sizeof(int32_t) * KVA_TILE / 2);
        continue;
      }
      uint32_t u;
      memcpy(&u, &M, 4);
      const int fl = (u >> 23) ? (int)(u >> 23) - 127 : 31 - __builtin_clz(u) - 149; /* floor(log2 M) */
      int k = 14 - fl;
      if (_mm256_cvtss_f32(iv_scale(_mm256_set1_ps(M), k)) >= 32767.5f) --k;
      sig[j * MAXG + g] = -k >= -126 ? (float)_mm256_cvtss_f32(iv_scale(_mm256_set1_ps(1.0f), -k)) : ldexpf(1.0f, -k);
      __m256i c[4];
      for (int v = 0; v < 4; ++v) c[v] = _mm256_cvtps_epi32(iv_scale(w[v], k)); /* nearest even */
      /* packs interleaves 128-bit halves: 64-bit elements back to token order */
      _mm256_storeu_si256((__m256i *)wj, _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8));
      _mm256_storeu_si256((__m256i *)(wj + L8), _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8));
    }
  }
}

/* acc += vpmaddwd(a, b), the sum in place (as asm: GCC 12 otherwise adds
 * into a new register and copies it back, one move per accumulator); also
 * at the avxvnni level, where vpdpwssd would put its whole latency on the
 * accumulator chains. */
ALWAYS __m256i iv_madd_acc(__m256i acc, __m256i a, __m256i b) {
  const __m256i t = _mm256_madd_epi16(a, b);
  __asm__("vpaddd %1, %0, %0" : "+x"(acc) : "x"(t));
  return acc;
}
/* o[j][pos0 .. pos0 + 8 KB) += sigma_jg * sum_pairs w'_jg . codes for J
 * vectors over np token pairs (the block's KB code vectors in one chunk,
 * so one group g). */
ALWAYS void iv_block(const fmt8 *fp, int64_t np, const int32_t *ct, const int32_t *wg, const float *sig, float *o,
                     int64_t pos0, int J, int KB) {
  const int g = fp->g0[pos0 / (L8 * fp->E)];
  __m256i acc[IVB][4];
  for (int j = 0; j < J; ++j)
    for (int kb = 0; kb < KB; ++kb) acc[j][kb] = _mm256_setzero_si256();
  for (int64_t i = 0; i < np; ++i) {
    __m256i w[IVB];
    for (int j = 0; j < J; ++j) w[j] = _mm256_set1_epi32(wg[(j * MAXG + g) * (KVA_TILE / 2) + i]);
    for (int kb = 0; kb < KB; ++kb) {
      const __m256i x = _mm256_loadu_si256((const __m256i *)(ct + i * fp->P + pos0 + kb * L8));
      for (int j = 0; j < J; ++j) acc[j][kb] = iv_madd_acc(acc[j][kb], x, w[j]);
    }
  }
  for (int j = 0; j < J; ++j) {
    float *oj = o + (int64_t)j * fp->P + pos0;
    const __m256 sv = _mm256_set1_ps(sig[j * MAXG + g]);
    for (int kb = 0; kb < KB; ++kb)
      _mm256_storeu_ps(oj + kb * L8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[j][kb]), sv, _mm256_loadu_ps(oj + kb * L8)));
  }
}
/* (out of line, as iv_direct_*) */
#define IV_BLOCK(J_, KB_)                                                                                      \
  __attribute__((noinline)) static void iv_block_##J_(const fmt8 *fp, int64_t np, const int32_t *ct, const int32_t *wg, const float *sig, \
                            float *o, int64_t pos0) {                                                          \
    iv_block(fp, np, ct, wg, sig, o, pos0, J_, KB_);                                                           \
  }
IV_BLOCK(4, 2)
IV_BLOCK(2, 4)
IV_BLOCK(1, 4)

/* Direct form for J <= 2 vectors (decode): the token pairs' code vectors
 * built in registers and consumed at once, no L1 round trip; passes of 4
 * code vectors per chunk (4-bit: the two tokens' low 16-bit halves, then
 * the high ones; 8-bit: both), 4 J int32 accumulators, flushed to o times
 * sigma per pass. The first pass prefetches the next tile's V rows. */
ALWAYS void iv_pair(__m256i x0, __m256i x1, const int32_t *wp, int h, int J, int bits, __m256i (*acc)[4]) {
  const __m256i m = _mm256_set1_epi32(bits == 8 ? 0x00FF00FF : 0x000F000F);
  __m256i w[2];
  for (int j = 0; j < J; ++j) w[j] = _mm256_set1_epi32(wp[j * MAXG * (KVA_TILE / 2)]);
  for (int k = 0; k < 4; ++k) {
    __m256i y; /* the 16-bit halves that hold code vector k */
    if (bits == 4 ? h == 0 : k < 2) y = _mm256_blend_epi16(x0, _mm256_slli_epi32(x1, 16), 0xAA);
    else y = _mm256_blend_epi16(_mm256_srli_epi32(x0, 16), x1, 0xAA);
    const int sh = bits == 4 ? 4 * k : 8 * (k & 1); /* the top code of each half: a 16-bit shift alone */
    const __m256i v = sh + bits == 16 ? _mm256_srli_epi16(y, sh) : _mm256_and_si256(sh ? _mm256_srli_epi16(y, sh) : y, m);
    for (int j = 0; j < J; ++j) acc[j][k] = iv_madd_acc(acc[j][k], v, w[j]);
  }
}
/* One pass: chunk c, half h (a constant), over the tile's token pairs; PF:
 * this pass prefetches the next tile's V rows (pf). */
ALWAYS void iv_pass(const fmt8 *fp, const kva_rows *rows, int64_t n, const int32_t *wg, const float *sig, float *o,
                    int c, int h, int J, int bits, const kva_prefetch *pf, int PF) {
  const int E = 32 / bits, g = fp->g0[c];
  const int32_t *wc = wg + g * (KVA_TILE / 2);
  __m256i acc[2][4];
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < 4; ++k) acc[j][k] = _mm256_setzero_si256();
  int64_t t = 0;
  for (; t + 1 < n; t += 2) {
    if (PF && t < pf->n) {
      prefetch_row3(pf, t, KVA_ARR_V);
      if (t + 1 < pf->n) prefetch_row3(pf, t + 1, KVA_ARR_V);
    }
    iv_pair(v8i_load(rows[t].v + c * 32), v8i_load(rows[t + 1].v + c * 32), wc + t / 2, h, J, bits, acc);
  }
  if (t < n) { /* odd n: the last token alone (its pair's weight 0) */
    if (PF && t < pf->n) prefetch_row3(pf, t, KVA_ARR_V);
    iv_pair(v8i_load(rows[t].v + c * 32), _mm256_setzero_si256(), wc + t / 2, h, J, bits, acc);
  }
  for (int j = 0; j < J; ++j) {
    float *oj = o + (int64_t)j * fp->P + (c * E + 4 * h) * L8;
    const __m256 sv = _mm256_set1_ps(sig[j * MAXG + g]);
    for (int k = 0; k < 4; ++k)
      _mm256_storeu_ps(oj + k * L8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[j][k]), sv, _mm256_loadu_ps(oj + k * L8)));
  }
}
ALWAYS void iv_direct(const fmt8 *fp, const kva_rows *rows, int64_t n, const int32_t *wg, const float *sig, float *o,
                      int J, int bits, const kva_prefetch *pf) {
  for (int c = 0; c < fp->nch; ++c) {
    if (c == 0 && pf) iv_pass(fp, rows, n, wg, sig, o, c, 0, J, bits, pf, 1);
    else iv_pass(fp, rows, n, wg, sig, o, c, 0, J, bits, pf, 0);
    if (bits == 4) iv_pass(fp, rows, n, wg, sig, o, c, 1, J, bits, pf, 0);
  }
}
/* (out of line: inlined into attend_fast8, GCC 12 spills the accumulators) */
#define IV_DIRECT(BITS, J_)                                                                                     \
  __attribute__((noinline)) static void iv_direct_##BITS##_##J_(const fmt8 *fp, const kva_rows *rows,        \
                                      int64_t n, const int32_t *wg, const float *sig, float *o,                \
                                      const kva_prefetch *pf) {                                                \
    iv_direct(fp, rows, n, wg, sig, o, J_, BITS, pf);                                                          \
  }
IV_DIRECT(4, 1)
IV_DIRECT(4, 2)
IV_DIRECT(8, 1)
IV_DIRECT(8, 2)

/* The integer V phase for one tile; 0 without touching o or ob when a scale
 * or bias of the tile is not finite (the caller then takes the f32 path).
 * Scratch: ct (n/2 rows of P u32) in vt, the tile's V group scales and
 * biases st/bt [MAXG][T] (groups_t), wg/sig in ws. */
static int vphase_int(const fmt8 *fp, const kva_rows *rows, int64_t n, const float *S, float *vt, float *st,
                      float *bt, float *ws, float *o, float *ob, int64_t nq, const kva_prefetch *pf) {
  groups_t(fp, rows, n, KVA_ARR_VS, KVA_ARR_VB, st, bt);
  if (iv_nonfinite(fp, st, bt)) return 0;
  int32_t *ct = (int32_t *)vt, *wg = (int32_t *)ws;
  float *sig = ws + IVB * MAXG * (KVA_TILE / 2);
  if (nq <= 2) {
    iv_weights(fp, S, (int)nq, st, bt, wg, sig, ob);
    switch (fp->bits * 2 + (int)nq) {
    case 9: iv_direct_4_1(fp, rows, n, wg, sig, o, pf); break;
    case 10: iv_direct_4_2(fp, rows, n, wg, sig, o, pf); break;
    case 17: iv_direct_8_1(fp, rows, n, wg, sig, o, pf); break;
    default: iv_direct_8_2(fp, rows, n, wg, sig, o, pf); break;
    }
    return 1;
  }
  if (fp->bits == 4) iv_decode(fp, rows, n, 4, ct, pf);
  else iv_decode(fp, rows, n, 8, ct, pf);
  const int64_t np = (n + 1) / 2;
  for (int64_t j0 = 0; j0 < nq; j0 += IVB) {
    const int J = nq - j0 < IVB ? (int)(nq - j0) : IVB;
    iv_weights(fp, S + j0 * KVA_TILE, J, st, bt, wg, sig, ob + j0 * MAXG);
    float *oj = o + j0 * fp->P;
    int j = 0;
    if (J == 4) {
      for (int64_t pos = 0; pos < fp->P; pos += 2 * L8) iv_block_4(fp, np, ct, wg, sig, oj, pos);
      continue;
    }
    for (; j + 2 <= J; j += 2)
      for (int64_t pos = 0; pos < fp->P; pos += 4 * L8)
        iv_block_2(fp, np, ct, wg + j * MAXG * (KVA_TILE / 2), sig + j * MAXG, oj + j * fp->P, pos);
    for (; j < J; ++j)
      for (int64_t pos = 0; pos < fp->P; pos += 4 * L8)
        iv_block_1(fp, np, ct, wg + j * MAXG * (KVA_TILE / 2), sig + j * MAXG, oj + j * fp->P, pos);
  }
  return 1;
}
#endif

/* ---- online softmax over a tile ---- */
/* exp(x) for x <= 88 (NaN -> NaN, -inf -> 0, below -87 -> 0): 2^n * p(f). */
ALWAYS v8f exp8(v8f x) {
  const v8f keep = v8f_nlt(x, v8f_set1(-87.0f)); /* x >= -87 or NaN */
  const v8f xc = v8f_min(v8f_max(x, v8f_set1(-87.0f)), v8f_set1(88.0f));
  const v8f n = v8f_round(v8f_mul(xc, v8f_set1(1.44269504088896341f)));
  v8f f = v8f_fnma(n, v8f_set1(0.693145751953125f), xc);
  f = v8f_fnma(n, v8f_set1(1.428606765330187e-06f), f);
  v8f p = v8f_set1(1.0f / 720);
  p = v8f_fma(p, f, v8f_set1(1.0f / 120));
  p = v8f_fma(p, f, v8f_set1(1.0f / 24));
  p = v8f_fma(p, f, v8f_set1(1.0f / 6));
  p = v8f_fma(p, f, v8f_set1(0.5f));
  p = v8f_fma(p, f, v8f_set1(1.0f));
  p = v8f_fma(p, f, v8f_set1(1.0f));
  const v8f two_n = v8i_as_f(v8i_sll(v8i_add(v8f_to_i(n), v8i_set1(127)), 23));
  const v8f r = v8f_mul(p, two_n);
  return v8f_and(v8f_blend(r, x, v8f_isnan(x)), keep);
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
    v8f v[KVA_TILE / L8], mx8 = v8f_set1(-INFINITY), nan = v8f_zero();
    for (int u = 0; u < KVA_TILE / L8; ++u) {
      v[u] = v8f_load(s + u * L8);
      mx8 = v8f_max(mx8, v[u]);
      nan = v8f_or(nan, v8f_isnan(v[u]));
    }
    const float mx = v8f_any(nan) ? NAN : v8f_hmax(mx8);
    if (mx == -INFINITY) { /* nothing visible for this vector in this tile */
      memset(s, 0, sizeof(float) * KVA_TILE);
      continue;
    }
    any = 1;
    float mn, a_old, a_new;
    kva_softmax_factors(m[j], mx, &mn, &a_old, &a_new);
    const v8f vmn = v8f_set1(mn);
    v8f sum = v8f_zero();
    for (int u = 0; u < KVA_TILE / L8; ++u) {
      const v8f e = exp8(v8f_sub(v[u], vmn));
      v8f_store(s + u * L8, e);
      sum = v8f_add(sum, e);
    }
    m[j] = mn;
    l[j] = l[j] * a_old + v8f_hsum(sum);
    if (a_old != 1.0f) {
      const v8f f = v8f_set1(a_old);
      float *oj = o + j * P, *obj = ob + j * obn;
      for (int64_t d = 0; d < P; d += L8) v8f_store(oj + d, v8f_mul(v8f_load(oj + d), f));
      for (int64_t d = 0; d < obn; d += L8) v8f_store(obj + d, v8f_mul(v8f_load(obj + d), f));
    }
  }
  return any;
}

/* Scratch (floats): qp[nq][Pk], qs[nq][nchk*8] (the integer K phase: the
 * query bytes in qp, sg/beta in qs), o[nq][Pv], ob[nq][MAXG] (V's group bias
 * sums), m/l[nq], S[nq][T], vt[T][Pv], kgs/kgb/vgs/vgb[T][GLD], ws[4][T][GLD]
 * (vweights8; vphase_int's weights), kst/kbt/vst/vbt[MAXG][T] (avx2). vt: T
 * rows of VT_LD (vphase_int: its token-pair codes). */
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
#if defined(__AVX2__)
  float *kst = ws + 4 * KVA_TILE * GLD, *kbt = kst + MAXG * KVA_TILE, *vst = kbt + MAXG * KVA_TILE,
        *vbt = vst + MAXG * KVA_TILE;
  kf.iq = !p->exact && iq_format_ok(&kf);
  vf.iv = iv_on(p, &vf);
#endif
  float qrow[KVA_MAX_HEAD_DIM];
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t h = it->hk * p->rep + j / nrows, i = it->i0 + j % nrows;
    m[j] = -INFINITY;
    l[j] = 0.0f;
    load_row8(kva_at4(p->q, it->b, h, i, 0), p->q->dtype, p->Dk, qrow);
#if defined(__AVX2__)
    if (kf.iq) {
      query_int8(&kf, p->Dk, qrow, p->scale, (char *)(qp + j * kf.P), qs + j * kqs);
      continue;
    }
#endif
    permute8(&kf, p->Dk, qrow, p->scale, qp + j * kf.P);
    for (int c = 0; c < kf.nch; ++c) {
      v8f sum = v8f_zero();
      for (int k = 0; k < kf.E; ++k) sum = v8f_add(sum, v8f_load(qp + j * kf.P + (c * kf.E + k) * L8));
      v8f_store(qs + j * kqs + c * L8, sum);
    }
  }
  memset(o, 0, sizeof(float) * (size_t)(nq * (vf.P + vbn)));
  memset(kgs, 0, sizeof(float) * 4 * KVA_TILE * GLD); /* group tables: padding lanes stay 0 */
  const int32_t *seg = simd_segments_row(p, it->b);
  kva_tiles tl;
  tiles_init(&tl, it);
  const kva_rows *rows;
  int64_t tf, n;
  while ((rows = tiles_next(&tl, &tf, &n))) {
#if defined(__AVX2__)
    if (kf.iq) {
      groups_t(&kf, rows, n, KVA_ARR_KS, KVA_ARR_KB, kst, kbt);
      k_groups_nan_t(&kf, kst, kbt);
      kphase_int8(&kf, rows, n, qp, qs, kst, kbt, nq, S, &tl.pf);
    } else
#endif
    {
      if (kf.bits) {
        tile_groups(&kf, rows, n, KVA_ARR_KS, KVA_ARR_KB, kgs, kgb);
        k_groups_nan(kgs, kgb, n, kf.ngroups);
      }
      kphase8(&kf, rows, n, qp, qs, kgs, kgb, nq, S, &tl.pf);
    }
    if (p->softcap > 0.0f) simd_softcap(S, nq, KVA_TILE, n, p->softcap);
    simd_mask_tile(it, seg, S, nq, tf, n);
    if (!tile_softmax8(S, n, nq, m, l, o, ob, vf.P, vbn)) continue;
#if defined(__AVX2__)
    if (vf.iv && vphase_int(&vf, rows, n, S, vt, vst, vbt, ws, o, ob, nq, &tl.pf)) continue;
#endif
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

/* The name with its roundings in brackets (kvattn.h, kva_attention_kernel):
 * at the avx2 level, quantized K that the integer K phase takes (4-bit,
 * 8-bit) rounds the query to s8 per (vector, group) ("[q int8]", the
 * rounding kva_ref_rounding models); quantized V that the integer V phase
 * takes (16-bit queries) rounds P times the group scale to s16 per
 * (vector, tile, group) ("P int16", the tests' ATT_ATOL_PINT16);
 * everything else, and exact mode, multiplies in f32. */
const char *KFN(fast_name)(const kva_problem *p) {
  if (!KFN(select_fast)(p)) return NULL;
#if defined(__AVX2__)
  kva_rowfmt kr, vr;
  simd_rowfmts(p, &kr, &vr);
  fmt8 kf, vf;
  plan8(&kr, &kf);
  plan8(&vr, &vf);
  const int iq = !p->exact && iq_format_ok(&kf), iv = iv_on(p, &vf);
  if (iq) return iv ? "fused kernel [q int8, P int16]" : "fused kernel [q int8]";
  if (iv) return "fused kernel [P int16]";
#endif
  return "fused kernel [exact f32]";
}
#endif
