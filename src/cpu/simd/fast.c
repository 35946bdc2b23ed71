/* The fused decode/verify kernel for AVX-512 (the avx2 and portable levels:
 * fast8.c).
 * Math: per tile of KVA_TILE keys, S = (scale*q)·Kᵀ for the nq = rep*rows
 *   query vectors, softcap, causal-family mask, online softmax (vector exp),
 *   O += P·V. Quantized K uses the affine algebra: with k = s_g*c + b_g,
 *   q·k = sum_g s_g (q_g·c_g) + b_g sum(q_g); for 16-bit queries q_g·c_g is
 *   an exact integer dot product (vpdpbusd: kphase_rl, kphase_tok, chunk_dots_vnni) of
 *   the codes with q rounded to s8 per (vector, K group) ("[q int8]"; f32
 *   products in exact mode, p->exact).
 *   Quantized V accumulates (p*s_g)*c per element and p*b_g once per group
 *   lane; for 4-bit / 8-bit V with 16-bit queries outside exact mode p*s_g
 *   is rounded to s16 per (vector, tile, group) and summed over the tile's
 *   codes by vpdpwssd (vphase_pint; vphase_pint_direct below 8 (4-bit)
 *   or 5 vectors, "[P int16]"); 4-bit V with
 *   >= 16 vectors instead: each element s_g*c + b_g (f32) rounded to bf16,
 *   P to bf16, two tokens per vdpbf16ps (vphase_bfv, "[V,P bf16]").
 *   bf16 K with bf16 queries and >= 5 vectors: q.k on bf16 pairs by
 *   vdpbf16ps (kphase_bft; products exact, f32 sums, denormals flushed),
 *   the scale on the dot; bf16 V with 16-bit queries and >= 5 vectors
 *   (not exact mode): P rounded to bf16, two tokens per vdpbf16ps
 *   (vphase_bfp, "[P bf16]").
 * Layout: a quantized row is read 16 u32 words (one zmm) at a time; code k of
 *   word w lands in lane w of vector k, so q (and the V accumulator) live in
 *   that permuted order: position (chunk*E + k)*16 + lane <-> element
 *   (chunk*16 + lane)*E + k, E = 32/bits codes per word. bf16 rows are
 *   converted 32 elements at a time, even elements then odd (split order,
 *   load_bf16_split), and q / the V accumulator follow.
 * Traffic: each K/V row of the item's range is read once for all nq vectors
 *   (tiles run across paged blocks; the next tile's K rows are prefetched
 *   into L2 one per row of the K phase, its V rows one per row of the V
 *   phase, tiles.h; kphase_bft and vphase_bfp spread them over their
 *   register blocks); K codes are decoded in registers per block of <= 8
 *   query vectors (16-bit queries over 4-bit / 8-bit K, < 5 vectors:
 *   kphase_rl, 4 rows per block, blocks of <= 4 vectors), or (kphase_tok:
 *   >= 5 vectors of 16-bit queries) once per tile into L1 as bytes with
 *   tokens in lanes (16 D bytes per 16 tokens);
 *   V codes in registers per block of <= 2 vectors when nq <= 4 (integer
 *   V: below PINT_MIN_VECTORS), else once
 *   per tile into L1 (as f32, or for vphase_pint as two tokens' s16 codes
 *   per u32 lane; for vphase_bfv as two tokens' bf16 values per u32 lane,
 *   looked up in per-(pair, group) tables of the 16 code values).
 *   kphase_bft: bf16 K rows transposed to tokens in lanes per 16 tokens
 *   (L1, 64 D bytes); vphase_bfp: bf16 V rows as token pairs per u32 lane
 *   once per tile (L1).
 *   Codes become floats exactly for f32 queries and in exact mode, by
 *   mantissa placement for other 16-bit queries (code_as_float). bf16
 *   queries with >= 6 vectors per KV head go to the AMX kernel (amx.c)
 *   instead, except in exact mode (p->exact).
 * Geometry: one call = one work item (driver: src/cpu/attend.c). */
#include "cpu/simd/simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "cpu/simd/avx512.h"

#define KQB 8      /* query vectors per register block in the K phase */
#define VJB 4      /* query vectors per register block in the V phase */
#define VKB 4      /* accumulator vectors per query in the V phase */

/* ---- K phase: S[j][t] = q_j · k_t for a block of J query vectors ---- */
/* Row t's J lane-partial score vectors into part; after every 16th row (or
 * the last, n - 1) the 16-row block is transposed and summed (reduce16) into
 * S[j][t0 .. t0 + 16). */
ALWAYS void put_scores(__m512 (*part)[LANES], const __m512 *sc, int J, int64_t t, int64_t n, float *S) {
  for (int j = 0; j < J; ++j) part[j][t % LANES] = sc[j];
  if (t % LANES != LANES - 1 && t != n - 1) return;
  const int64_t t0 = t - t % LANES;
  for (int j = 0; j < J; ++j) {
    for (int64_t u = t + 1; u < t0 + LANES; ++u) part[j][u % LANES] = _mm512_setzero_ps();
    const __m512 r = reduce16(part[j]);
    _mm512_storeu_ps(S + j * KVA_TILE + t0, r);
  }
}

/* The lane partial dots of chunk c of a row (16 words x, code k of word w
 * in lane w of vector k) with the J query vectors in their permuted order,
 * as f32: codes as floats (code_as_float) times q by FMAs. */
ALWAYS void chunk_dots_float(const fmt_plan *fp, __m512i x, int c, const float *qp, int J, int bits, int exact,
                             __m512 *acc) {
  const int E = 32 / bits;
  for (int j = 0; j < J; ++j) acc[j] = _mm512_setzero_ps();
  for (int k = 0; k < E; ++k) {
    const __m512 f = code_as_float(x, k, bits, exact);
    const float *qk = qp + (int64_t)(c * E + k) * LANES;
    for (int j = 0; j < J; ++j) acc[j] = _mm512_fmadd_ps(f, _mm512_loadu_ps(qk + (int64_t)j * fp->P), acc[j]);
  }
}

ALWAYS void kphase_float(const fmt_plan *fp, const kva_rows *rows, int64_t n, const float *qp, int J,
                         float *S, const kva_prefetch *pf) {
  const int64_t es = (int64_t)kva_dtype_size(fp->sdt);
  __m512 part[KQB][LANES];
  for (int64_t t = 0; t < n; ++t) {
    if (pf && t < pf->n) prefetch_row(pf, t, KVA_ARR_K, KVA_ARR_V);
    const char *row = rows[t].k;
    __m512 acc[KQB], acc2[KQB]; /* two chains per vector (the FMA latency) */
    for (int j = 0; j < J; ++j) acc[j] = acc2[j] = _mm512_setzero_ps();
    int d = 0;
    if (fp->split) /* bf16: q is in split order */
#pragma GCC unroll 4
      for (; d + 2 * LANES <= fp->P; d += 2 * LANES) {
        __m512 ke, ko;
        load_bf16_split(row + d * es, &ke, &ko);
        for (int j = 0; j < J; ++j) {
          acc[j] = _mm512_fmadd_ps(ke, _mm512_loadu_ps(qp + (int64_t)j * fp->P + d), acc[j]);
          acc2[j] = _mm512_fmadd_ps(ko, _mm512_loadu_ps(qp + (int64_t)j * fp->P + d + LANES), acc2[j]);
        }
      }
    for (; d < fp->P; d += LANES) {
      const __m512 kv = load_f16x(row + d * es, fp->sdt);
      for (int j = 0; j < J; ++j) acc[j] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(qp + (int64_t)j * fp->P + d), acc[j]);
    }
    for (int j = 0; j < J; ++j) acc[j] = _mm512_add_ps(acc[j], acc2[j]);
    if (fp->fp8 && rows[t].ks) /* the row's scale times q . codes */
      for (int j = 0; j < J; ++j) acc[j] = _mm512_mul_ps(acc[j], _mm512_set1_ps(*(const float *)rows[t].ks));
    put_scores(part, acc, J, t, n, S);
  }
}

#ifdef __AVX512VNNI__
/* Quantized K and 16-bit queries by integer dot products (vpdpbusd: 4 u8
 * codes x 4 s8 query bytes summed into an int32 lane, exact). Query j is
 * rounded to s8 per K group g as kva_ref_rounding with q_int_bits = 8
 * models it (kvattn.h; the f32 steps of the avx2 level's query_int8:
 * sigma_g = max|q_g| / 127, c = rint(q / sigma_g) clamped to +-127, on q as
 * loaded). Codes are unpacked to bytes by a shift and an and per code of
 * each byte (CB = 8/bits byte vectors per chunk); byte m of lane w of byte
 * vector i holds code m*CB + i of word w, and the query bytes follow that
 * order. Per chunk and lane (word) I = sum_word code*c in int32 (|I| <=
 * 16*3*127 at 2 bits, 8*15*127, 4*255*127: no overflow), times the lane's
 * factor f = scale*sigma_g of its group, then sc += s_lane*(f*I) +
 * b_lane*qs_lane with qs the lane's sum of f*c (kphase_q). The roundings:
 * q to s8, and the f32 epilogue; 8-bit codes need no unpacking. Vector j at
 * qp + j*P floats: the bytes [chunk][i][64], then the lane factors
 * [chunk][16] f32 (query_int8). Here: the chunk's lane values f*I. */
ALWAYS void chunk_dots_vnni(const fmt_plan *fp, __m512i x, int c, const float *qp, int J, int bits, __m512 *acc) {
  const int CB = 8 / bits;
  const __m512i cmask = _mm512_set1_epi8((char)((1 << bits) - 1));
  __m512i a[KQB];
  for (int j = 0; j < J; ++j) a[j] = _mm512_setzero_si512();
  for (int i = 0; i < CB; ++i) {
    const __m512i v = bits == 8 ? x : _mm512_and_si512(i ? _mm512_srli_epi32(x, (unsigned)(bits * i)) : x, cmask);
    for (int j = 0; j < J; ++j) {
      const char *qb = (const char *)(qp + (int64_t)j * fp->P) + (int64_t)(c * CB + i) * 64;
      a[j] = _mm512_dpbusd_epi32(a[j], v, _mm512_loadu_si512(qb));
    }
  }
  for (int j = 0; j < J; ++j) {
    const float *f = (const float *)((const char *)(qp + (int64_t)j * fp->P) + (int64_t)fp->nch * CB * 64) + c * LANES;
    acc[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(a[j]), _mm512_loadu_ps(f));
  }
}
#endif

/* A K row's group scales, NaN where the scale or the bias is ±inf: that
 * key's logit is then NaN, as dequantizing the row gives (inf times a zero
 * code, or inf - inf across the dot product), where the affine algebra
 * alone could give ±inf and drop or pick the key. */
ALWAYS __m512 k_scales_nan(__m512 sv, __m512 bv) {
  const __mmask16 inf = _mm512_fpclass_ps_mask(sv, 0x18) | _mm512_fpclass_ps_mask(bv, 0x18);
  return _mm512_mask_mov_ps(sv, inf, _mm512_set1_ps(NAN));
}

/* Scores of a block of J vectors against n rows of quantized K: per chunk
 * the lane partial dots (chunk_dots_vnni when vnni, else chunk_dots_float),
 * then sc += s_lane * dot + b_lane * qs_lane; row t's J lane-partial score
 * vectors are reduced 16 rows at a time (put_scores). pf (or NULL): row t
 * of the next tile is prefetched with row t. vnni, bits and exact are constants after inlining. */
ALWAYS void kphase_q(const fmt_plan *fp, const kva_rows *rows, int64_t n, const float *qp, const float *qs,
                     int J, int bits, int exact, int vnni, float *S, const kva_prefetch *pf) {
  __m512 part[KQB][LANES];
  for (int64_t t = 0; t < n; ++t) {
    if (pf && t < pf->n) prefetch_row_q(pf, t, KVA_ARR_K);
    const char *row = rows[t].k;
    const __m512 Bv = load_groups(rows[t].kb, fp->sdt, fp->ngroups);
    const __m512 Sv = k_scales_nan(load_groups(rows[t].ks, fp->sdt, fp->ngroups), Bv);
    __m512 sc[KQB];
    for (int j = 0; j < J; ++j) sc[j] = _mm512_setzero_ps();
    for (int c = 0; c < fp->nch; ++c) {
      const __m512i x = _mm512_maskz_loadu_epi32(fp->chmask[c], row + c * 64);
      __m512 acc[KQB];
#ifdef __AVX512VNNI__
      if (vnni)
        chunk_dots_vnni(fp, x, c, qp, J, bits, acc);
      else
#endif
        chunk_dots_float(fp, x, c, qp, J, bits, exact, acc);
      __m512 sv = _mm512_permutexvar_ps(fp->gidx[c], Sv), bv = _mm512_permutexvar_ps(fp->gidx[c], Bv);
      if (!vnni) affine_for(&sv, &bv, bits, exact);
      for (int j = 0; j < J; ++j) {
        sc[j] = _mm512_fmadd_ps(sv, acc[j], sc[j]);
        sc[j] = _mm512_fmadd_ps(bv, _mm512_loadu_ps(qs + ((int64_t)j * fp->nch + c) * LANES), sc[j]);
      }
    }
    put_scores(part, sc, J, t, n, S);
  }
}
#define KPHASE_VNNI(J_, B_) kphase_q(fp, rows, n, qp, qs, J_, B_, 0, 1, S, pf)

/* One block of J <= KQB vectors; J is a constant after inlining. */
#define KPHASE_BLOCK(J_)                                                                                       \
  static void kphase_block_##J_(const fmt_plan *fp, const kva_rows *rows, int64_t n, const float *qp,          \
                                const float *qs, float *S, const kva_prefetch *pf) {                           \
    if (fp->vnni) {                                                                                            \
      if (fp->bits == 4) KPHASE_VNNI(J_, 4);                                                                   \
      else if (fp->bits == 8) KPHASE_VNNI(J_, 8);                                                              \
      else KPHASE_VNNI(J_, 2);                                                                                 \
      return;                                                                                                  \
    }                                                                                                          \
    switch (fp->bits * 2 + fp->exact) {                                                                        \
    case 4: kphase_q(fp, rows, n, qp, qs, J_, 2, 0, 0, S, pf); break;                                   \
    case 5: kphase_q(fp, rows, n, qp, qs, J_, 2, 1, 0, S, pf); break;                                   \
    case 8: kphase_q(fp, rows, n, qp, qs, J_, 4, 0, 0, S, pf); break;                                   \
    case 9: kphase_q(fp, rows, n, qp, qs, J_, 4, 1, 0, S, pf); break;                                   \
    case 16: kphase_q(fp, rows, n, qp, qs, J_, 8, 0, 0, S, pf); break;                                  \
    case 17: kphase_q(fp, rows, n, qp, qs, J_, 8, 1, 0, S, pf); break;                                  \
    default: kphase_float(fp, rows, n, qp, J_, S, pf); break;                                                  \
    }                                                                                                          \
  }
KPHASE_BLOCK(1)
KPHASE_BLOCK(2)
KPHASE_BLOCK(4)
KPHASE_BLOCK(8)

#ifdef __AVX512VNNI__
/* ---- K phase with tokens in lanes (fp->tok) ----
 * The integer dots of chunk_dots_vnni (q rounded to s8 per vector and K
 * group, the same codes x bytes products), with lane t of every vector
 * holding token t of a block of 16: per (query vector j, group g) the int32
 * dot I_jg[t] = sum over the group's words of vpdpbusd(codes of word w of
 * the 16 tokens, q_j's 4 bytes of that word broadcast), exact (|I| <= G *
 * 255 * 127 < 2^24, so also exact as f32), then
 *   S_j[t] += s_g[t] * (f_jg * I_jg[t]) + b_g[t] * Q_jg
 * with f_jg = scale * sigma_jg and Q_jg = f_jg * (sum of q_j's s8 codes
 * over group g) (query_int8_tok). The roundings: q to s8, and the f32
 * epilogue. No lane reduction: each score is one lane.
 * kphase_tok_codes moves a tile's codes to token-in-lanes order once for
 * all nq vectors: per chunk a 16 x 16 dword transpose of 16 rows (64
 * shuffles), unpacked to CB = 8/bits byte vectors per word (byte m of
 * vector i = code m*CB + i of the word, as chunk_dots_vnni), into ct
 * [block of 16][word][i][64 bytes] (L1, 16 D bytes per block); the group
 * scales and biases (NaN as k_scales_nan) into st/bt [block][g][16 tokens]
 * by 4 x 4 transposes of 4 groups at a time. Per (vector, 16 tokens):
 * D/4 vpdpbusd and 4 epilogue operations per group; per 16 tokens and
 * chunk: 16 loads, 64 shuffles, (2 CB - 1) * 16 unpack operations (none
 * at 8 bits), CB * 16 stores; per 16 tokens and 4 groups ~70 operations
 * for the scales and biases. Query
 * vector j at qv + j*P floats: its s8 bytes [word][i] (one u32 each), then
 * f[16] and Q[16] per group (query_int8_tok). */
#define KTJ 8 /* query vectors per register block in kphase_tok */
#define KTOK_MIN_VECTORS 5 /* kphase_tok from this many query vectors (fewer: kphase_q) */

/* acc += the u8 x s8 dots of codes with the 4 bytes at q broadcast
 * (vpdpbusd, memory operand {1to16}); as asm because GCC 12 copies the
 * accumulator around the intrinsic and broadcasts q in a separate
 * instruction. */
ALWAYS __m512i dpbusd_bcast(__m512i acc, __m512i codes, const int32_t *q) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*q));
  return acc;
}

/* r[t] (word w in lane w) -> r[w] (token t in lane t), 16 x 16 dwords. */
ALWAYS void transpose16x16(__m512i r[16]) {
  __m512i a[16], c[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  /* c[4A + k], 128-bit lane L, dword r: word 4L + k of token 4A + r */
  for (int A = 0; A < 4; ++A) {
    c[4 * A + 0] = _mm512_unpacklo_epi64(a[4 * A], a[4 * A + 2]);
    c[4 * A + 1] = _mm512_unpackhi_epi64(a[4 * A], a[4 * A + 2]);
    c[4 * A + 2] = _mm512_unpacklo_epi64(a[4 * A + 1], a[4 * A + 3]);
    c[4 * A + 3] = _mm512_unpackhi_epi64(a[4 * A + 1], a[4 * A + 3]);
  }
  /* the 4 x 4 transpose of 128-bit blocks: r[4L + k] block A = c[4A + k] block L */
  for (int k = 0; k < 4; ++k) {
    const __m512i e0 = _mm512_shuffle_i32x4(c[k], c[4 + k], 0x44), e1 = _mm512_shuffle_i32x4(c[k], c[4 + k], 0xEE);
    const __m512i e2 = _mm512_shuffle_i32x4(c[8 + k], c[12 + k], 0x44),
                  e3 = _mm512_shuffle_i32x4(c[8 + k], c[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(e0, e2, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(e0, e2, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(e1, e3, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(e1, e3, 0xDD);
  }
}

/* Groups 4q .. 4q+3 (those below ng, else 0) of the scale row at p, as f32. */
ALWAYS __m128 groups4(const char *p, kva_dtype dt, int q, int ng) {
  const int left = ng - 4 * q;
  const __mmask8 m = (__mmask8)(left >= 4 ? 0xF : (1u << left) - 1u);
  if (dt == KVA_F32) return _mm_maskz_loadu_ps(m, p + 16 * q);
  const __m128i h = _mm_maskz_loadu_epi16(m, p + 8 * q);
  if (dt == KVA_F16) return _mm_cvtph_ps(h);
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}

/* out[g] lane t = group 4q + g of the scale rows of tokens t0 + t (t < nt; 0 past). */
ALWAYS void groups_t16(const kva_rows *rows, int a, int64_t t0, int nt, kva_dtype dt, int q, int ng, __m512 out[4]) {
  __m512 z[4];
  for (int r = 0; r < 4; ++r) {
    __m128 x[4];
    for (int L = 0; L < 4; ++L) {
      const int t = 4 * L + r;
      x[L] = t < nt ? groups4(rows[t0 + t].a[a], dt, q, ng) : _mm_setzero_ps();
    }
    z[r] = _mm512_insertf32x4(_mm512_insertf32x4(_mm512_insertf32x4(_mm512_castps128_ps512(x[0]), x[1], 1), x[2], 2),
                              x[3], 3);
  }
  const __m512 t0v = _mm512_unpacklo_ps(z[0], z[1]), t1v = _mm512_unpackhi_ps(z[0], z[1]);
  const __m512 t2v = _mm512_unpacklo_ps(z[2], z[3]), t3v = _mm512_unpackhi_ps(z[2], z[3]);
  out[0] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0v), _mm512_castps_pd(t2v)));
  out[1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0v), _mm512_castps_pd(t2v)));
  out[2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t1v), _mm512_castps_pd(t3v)));
  out[3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t1v), _mm512_castps_pd(t3v)));
}

/* The tile's K codes, scales and biases in token-in-lanes order (see above);
 * row t of the next tile is prefetched with row t. */
ALWAYS void kphase_tok_codes(const fmt_plan *fp, const kva_rows *rows, int64_t n, int bits, uint8_t *ct, float *st,
                             float *bt, const kva_prefetch *pf) {
  const int CB = 8 / bits, words = fp->nch * LANES, ng = fp->ngroups;
  const __m512i cmask = _mm512_set1_epi8((char)((1 << bits) - 1));
  for (int64_t t0 = 0; t0 < n; t0 += LANES) {
    const int nt = n - t0 < LANES ? (int)(n - t0) : LANES;
    uint8_t *cb = ct + (t0 / LANES) * (int64_t)words * CB * 64;
    for (int c = 0; c < fp->nch; ++c) {
      __m512i r[LANES];
      for (int t = 0; t < LANES; ++t) {
        if (c == 0 && pf && t0 + t < pf->n) prefetch_row_q(pf, t0 + t, KVA_ARR_K);
        r[t] = t < nt ? _mm512_maskz_loadu_epi32(fp->chmask[c], rows[t0 + t].k + c * 64) : _mm512_setzero_si512();
      }
      transpose16x16(r);
      for (int w = 0; w < LANES; ++w)
        for (int i = 0; i < CB; ++i) {
          const __m512i v =
              bits == 8 ? r[w] : _mm512_and_si512(i ? _mm512_srli_epi32(r[w], (unsigned)(bits * i)) : r[w], cmask);
          _mm512_store_si512(cb + ((int64_t)(c * LANES + w) * CB + i) * 64, v);
        }
    }
    float *sb = st + (t0 / LANES) * LANES * LANES, *bb = bt + (t0 / LANES) * LANES * LANES;
    for (int q = 0; 4 * q < ng; ++q) {
      __m512 s[4], b[4];
      groups_t16(rows, KVA_ARR_KS, t0, nt, fp->sdt, q, ng, s);
      groups_t16(rows, KVA_ARR_KB, t0, nt, fp->sdt, q, ng, b);
      for (int g = 0; g < 4 && 4 * q + g < ng; ++g) {
        _mm512_store_ps(sb + (4 * q + g) * LANES, k_scales_nan(s[g], b[g]));
        _mm512_store_ps(bb + (4 * q + g) * LANES, b[g]);
      }
    }
  }
}

/* S[j][t] for J vectors (at qv + j*P) and the tile's n tokens from
 * kphase_tok_codes' ct/st/bt; tokens past n get 0. NA = 2: two accumulator
 * chains per vector (few vectors: the vpdpbusd latency). */
ALWAYS void kphase_tok(const fmt_plan *fp, const uint8_t *ct, const float *st, const float *bt, int64_t n,
                       const float *qv, int J, int bits, float *S) {
  const int CB = 8 / bits, words = fp->nch * LANES, ng = fp->ngroups, WG = fp->G / fp->E;
  const int NA = J <= 2 ? 2 : 1;
  const int64_t fo = (int64_t)words * CB; /* f[16], Q[16] after the bytes (floats) */
  for (int64_t t0 = 0; t0 < n; t0 += LANES) {
    const uint8_t *cb = ct + (t0 / LANES) * (int64_t)words * CB * 64;
    const float *sb = st + (t0 / LANES) * LANES * LANES, *bb = bt + (t0 / LANES) * LANES * LANES;
    __m512 sc[KTJ];
    for (int j = 0; j < J; ++j) sc[j] = _mm512_setzero_ps();
    for (int g = 0; g < ng; ++g) {
      __m512i I[2][KTJ];
      for (int a = 0; a < NA; ++a)
        for (int j = 0; j < J; ++j) I[a][j] = _mm512_setzero_si512();
      for (int u = 0; u < WG * CB; u += NA) /* word g*WG + u / CB, byte vector u % CB (WG*CB = G/4: even) */
        for (int a = 0; a < NA; ++a) {
          const int64_t wi = (int64_t)g * WG * CB + u + a;
          const __m512i x = _mm512_load_si512(cb + wi * 64);
          for (int j = 0; j < J; ++j)
            I[a][j] = dpbusd_bcast(I[a][j], x, (const int32_t *)(qv + (int64_t)j * fp->P) + wi);
        }
      const __m512 s = _mm512_load_ps(sb + g * LANES), b = _mm512_load_ps(bb + g * LANES);
      for (int j = 0; j < J; ++j) {
        const float *fq = qv + (int64_t)j * fp->P + fo;
        const __m512i Ij = NA == 2 ? _mm512_add_epi32(I[0][j], I[1][j]) : I[0][j];
        const __m512 X = _mm512_mul_ps(_mm512_cvtepi32_ps(Ij), _mm512_set1_ps(fq[g]));
        sc[j] = _mm512_fmadd_ps(b, _mm512_set1_ps(fq[LANES + g]), _mm512_fmadd_ps(X, s, sc[j]));
      }
    }
    const __mmask16 live = n - t0 >= LANES ? 0xffff : (__mmask16)((1u << (n - t0)) - 1u);
    for (int j = 0; j < J; ++j) _mm512_storeu_ps(S + j * KVA_TILE + t0, _mm512_maskz_mov_ps(live, sc[j]));
  }
}

/* kphase_tok for a tile of more than 16 tokens and J <= 4 vectors: both
 * 16-token blocks at once, each query word broadcast once into a register
 * for the two blocks' code vectors (kphase_tok: one {1to16} memory operand
 * per vpdpbusd). */
ALWAYS void kphase_tok2(const fmt_plan *fp, const uint8_t *ct, const float *st, const float *bt, int64_t n,
                        const float *qv, int J, int bits, float *S) {
  const int CB = 8 / bits, words = fp->nch * LANES, ng = fp->ngroups, WG = fp->G / fp->E;
  const int64_t fo = (int64_t)words * CB, bstride = (int64_t)words * CB * 64;
  __m512 sc[2][4];
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < J; ++j) sc[h][j] = _mm512_setzero_ps();
  for (int g = 0; g < ng; ++g) {
    __m512i I[2][4];
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < J; ++j) I[h][j] = _mm512_setzero_si512();
    for (int u = 0; u < WG * CB; ++u) {
      const int64_t wi = (int64_t)g * WG * CB + u;
      const __m512i x0 = _mm512_load_si512(ct + wi * 64), x1 = _mm512_load_si512(ct + bstride + wi * 64);
      for (int j = 0; j < J; ++j) {
        const __m512i w = _mm512_set1_epi32(((const int32_t *)(qv + (int64_t)j * fp->P))[wi]);
        __asm__("vpdpbusd %1, %2, %0" : "+v"(I[0][j]) : "v"(w), "v"(x0));
        __asm__("vpdpbusd %1, %2, %0" : "+v"(I[1][j]) : "v"(w), "v"(x1));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m512 s = _mm512_load_ps(st + h * LANES * LANES + g * LANES), b = _mm512_load_ps(bt + h * LANES * LANES + g * LANES);
      for (int j = 0; j < J; ++j) {
        const float *fq = qv + (int64_t)j * fp->P + fo;
        const __m512 X = _mm512_mul_ps(_mm512_cvtepi32_ps(I[h][j]), _mm512_set1_ps(fq[g]));
        sc[h][j] = _mm512_fmadd_ps(b, _mm512_set1_ps(fq[LANES + g]), _mm512_fmadd_ps(X, s, sc[h][j]));
      }
    }
  }
  const __mmask16 live = n >= 2 * LANES ? 0xffff : (__mmask16)((1u << (n - LANES)) - 1u);
  for (int j = 0; j < J; ++j) {
    _mm512_storeu_ps(S + j * KVA_TILE, sc[0][j]);
    _mm512_storeu_ps(S + j * KVA_TILE + LANES, _mm512_maskz_mov_ps(live, sc[1][j]));
  }
}
static void kphase_tok2_4(const fmt_plan *fp, const uint8_t *ct, const float *st, const float *bt, int64_t n,
                          const float *qv, float *S) {
  if (fp->bits == 4) kphase_tok2(fp, ct, st, bt, n, qv, 4, 4, S);
  else if (fp->bits == 8) kphase_tok2(fp, ct, st, bt, n, qv, 4, 8, S);
  else kphase_tok2(fp, ct, st, bt, n, qv, 4, 2, S);
}

#define KPHASE_TOK(J_)                                                                                         \
  static void kphase_tok_##J_(const fmt_plan *fp, const uint8_t *ct, const float *st, const float *bt,         \
                              int64_t n, const float *qv, float *S) {                                          \
    if (fp->bits == 4) kphase_tok(fp, ct, st, bt, n, qv, J_, 4, S);                                            \
    else if (fp->bits == 8) kphase_tok(fp, ct, st, bt, n, qv, J_, 8, S);                                       \
    else kphase_tok(fp, ct, st, bt, n, qv, J_, 2, S);                                                          \
  }
KPHASE_TOK(1)
KPHASE_TOK(2)
KPHASE_TOK(4)
KPHASE_TOK(6)
KPHASE_TOK(8)

static void kphase_tok_tile(const fmt_plan *fp, const kva_rows *rows, int64_t n, uint8_t *ct, float *st, float *bt,
                            const kva_prefetch *pf) {
  if (fp->bits == 4) kphase_tok_codes(fp, rows, n, 4, ct, st, bt, pf);
  else if (fp->bits == 8) kphase_tok_codes(fp, rows, n, 8, ct, st, bt, pf);
  else kphase_tok_codes(fp, rows, n, 2, ct, st, bt, pf);
}

/* All nq vectors by kphase_tok: the tile's codes once, then blocks of 4
 * (kphase_tok2, tiles of more than 16 tokens) or 8, 6, 4, and 2, 1 vectors
 * (its L1 staging lives in this frame only). */
__attribute__((noinline)) static void kphase_tok_all(const fmt_plan *fp, const kva_rows *rows, int64_t n,
                                                     const float *qp, int64_t nq, float *S, const kva_prefetch *pf) {
  _Alignas(64) uint8_t ct[KVA_TILE * KVA_MAX_HEAD_DIM];
  _Alignas(64) float st[2 * LANES * LANES], bt[2 * LANES * LANES];
  kphase_tok_tile(fp, rows, n, ct, st, bt, pf);
  int64_t j = 0;
#define TARGS(J) ct, st, bt, n, qp + (J) * fp->P, S + (J) * KVA_TILE
  if (n > LANES) /* full tiles: blocks of 4 on both token blocks at once (the q4 prefix pass ~3 % faster) */
    for (; j + 4 <= nq; j += 4) kphase_tok2_4(fp, TARGS(j));
  for (; j + 8 <= nq; j += 8) kphase_tok_8(fp, TARGS(j));
  if (j + 6 <= nq) { kphase_tok_6(fp, TARGS(j)); j += 6; }
  if (j + 4 <= nq) { kphase_tok_4(fp, TARGS(j)); j += 4; }
  if (j + 2 <= nq) { kphase_tok_2(fp, TARGS(j)); j += 2; }
  if (j < nq) kphase_tok_1(fp, TARGS(j));
#undef TARGS
}
#endif

#ifdef __AVX512VNNI__
#define FPCLASS_NONFINITE 0x99 /* QNaN | SNaN | +Inf | -Inf */
/* The tile's group scales and biases of one operand (row arrays as, ab)
 * transposed into st/bt[g][KVA_TILE] (zero past n); K (knan): the scales
 * NaN where the scale or the bias is not finite (k_scales_nan). Returns
 * whether any is NaN or Inf. */
ALWAYS int groups_tile(const fmt_plan *fp, const kva_rows *rows, int64_t n, int as, int ab, int knan, float *st,
                       float *bt) {
  const int ng = fp->ngroups;
  __mmask16 bad = 0;
  for (int64_t t0 = 0; t0 < KVA_TILE; t0 += LANES) { /* groups_t16: 4 groups of 16 tokens at a time */
    const int nt = n - t0 >= LANES ? LANES : n > t0 ? (int)(n - t0) : 0;
    for (int q = 0; 4 * q < ng; ++q) {
      __m512 sv[4], bv[4];
      groups_t16(rows, as, t0, nt, fp->sdt, q, ng, sv);
      groups_t16(rows, ab, t0, nt, fp->sdt, q, ng, bv);
      for (int g = 0; g < 4 && 4 * q + g < ng; ++g) {
        bad |= _mm512_fpclass_ps_mask(sv[g], FPCLASS_NONFINITE) | _mm512_fpclass_ps_mask(bv[g], FPCLASS_NONFINITE);
        _mm512_storeu_ps(st + (4 * q + g) * KVA_TILE + t0, knan ? k_scales_nan(sv[g], bv[g]) : sv[g]);
        _mm512_storeu_ps(bt + (4 * q + g) * KVA_TILE + t0, bv[g]);
      }
    }
  }
  return bad != 0;
}
static int v_groups_tile(const fmt_plan *fp, const kva_rows *rows, int64_t n, float *st, float *bt) {
  return groups_tile(fp, rows, n, KVA_ARR_VS, KVA_ARR_VB, 0, st, bt);
}

/* ---- quantized K with rows in lanes (fp->rl: 4-bit / 8-bit codes, each
 * 128-bit lane of 4 words in one group) ----
 * The integer dots of chunk_dots_vnni (q rounded to s8 per vector and K
 * group, the same codes x bytes products) with 4 rows in the dwords of each
 * 128-bit lane: per block of 4 rows and chunk c, two unpack levels turn the
 * rows' 16 words into X_i (i = 0..3; lane L, dword r = word 4L + i of row
 * r); the CB = 8/bits byte vectors of X_i (4-bit: low, high nibbles) times
 * the query's 4 bytes of that word broadcast to the lane (query_int8_rl) by
 * vpdpbusd: per lane and row the exact int32 dot of the lane's 4 words;
 * the lanes of one group (LPG = G / 4E of them) added by one or two lane
 * shuffles, the chunks of one group summed, into I[j][g][t]. Then per 16
 * rows S_j = sum_g s_g (f_jg I_jg) + b_g Q_jg (kphase_tok's epilogue; the
 * tile's group scales and biases by groups_tile). The same exact I and
 * roundings as kphase_q (q to s8, the f32 epilogue), with no per-row
 * reduction: per 4 rows and chunk 4 loads, 8 unpacks, 3 (CB - 1) nibble
 * operations, and per vector 4 CB vpdpbusd and <= 6 lane operations. Rows
 * past n read zero codes (rows to the next multiple of 16 are computed).
 * NCH, LPG: constants for the common rows (NCH full chunks, LPG lanes per
 * group), else 0. */
#define KRJ 4 /* query vectors per register block in kphase_rl */
static int rl_format(const fmt_plan *fp) {
  if (fp->bits != 4 && fp->bits != 8) return 0;
  if (fp->G % (4 * fp->E)) return 0;
  const int lpg = fp->G / (4 * fp->E);
  return lpg == 1 || lpg == 2 || lpg % 4 == 0;
}
static const uint8_t kzero_row[MAXCH * 64] __attribute__((aligned(64)));
ALWAYS void kphase_rl(const fmt_plan *fp, const kva_rows *rows, int64_t n, const char *qb, int64_t qst,
                      const float *fq, int64_t fqst, const float *st, const float *bt, int J, int bits, float *S,
                      const kva_prefetch *pf, int NCH, int LPG) {
  const int CB = 8 / bits, E = 32 / bits, ng = fp->ngroups, lpg = LPG ? LPG : fp->G / (4 * E);
  const int nch = NCH ? NCH : fp->nch;
  const int NA = J <= 2 ? 2 : 1; /* accumulator chains per vector (the vpdpbusd latency) */
  const int64_t n16 = (n + LANES - 1) / LANES * LANES;
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  _Alignas(64) int32_t I[KRJ][LANES][KVA_TILE];
  for (int64_t t0 = 0; t0 < n16; t0 += 4) {
    const char *r[4];
    for (int u = 0; u < 4; ++u) {
      const int64_t t = t0 + u;
      if (pf && t < pf->n) prefetch_row_q(pf, t, KVA_ARR_K);
      r[u] = t < n ? rows[t].k : (const char *)kzero_row;
    }
    __m128i gacc[KRJ] = {0};
    for (int c = 0; c < nch; ++c) {
      __m512i x[4];
      for (int u = 0; u < 4; ++u)
        x[u] = NCH ? _mm512_loadu_si512(r[u] + c * 64) : _mm512_maskz_loadu_epi32(fp->chmask[c], r[u] + c * 64);
      const __m512i ab0 = _mm512_unpacklo_epi32(x[0], x[1]), ab1 = _mm512_unpackhi_epi32(x[0], x[1]);
      const __m512i cd0 = _mm512_unpacklo_epi32(x[2], x[3]), cd1 = _mm512_unpackhi_epi32(x[2], x[3]);
      const __m512i X[4] = {_mm512_unpacklo_epi64(ab0, cd0), _mm512_unpackhi_epi64(ab0, cd0),
                            _mm512_unpacklo_epi64(ab1, cd1), _mm512_unpackhi_epi64(ab1, cd1)};
      __m512i v[4][2];
      for (int i = 0; i < 4; ++i) {
        if (bits == 8) v[i][0] = X[i];
        else {
          v[i][0] = _mm512_and_si512(X[i], m4);
          v[i][1] = _mm512_and_si512(_mm512_srli_epi16(X[i], 4), m4);
        }
      }
      const int g0 = c * LANES * E / fp->G;
      for (int j = 0; j < J; ++j) {
        const __m512i *q = (const __m512i *)(qb + (int64_t)j * qst) + (int64_t)c * 4 * CB;
        __m512i a[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int i = 0; i < 4; ++i)
          for (int b = 0; b < CB; ++b) {
            const int ch = NA == 2 ? i >> 1 : 0;
            a[ch] = _mm512_dpbusd_epi32(a[ch], v[i][b], _mm512_load_si512(q + i * CB + b));
          }
        __m512i w = NA == 2 ? _mm512_add_epi32(a[0], a[1]) : a[0];
        if (lpg == 1) {
          const __m128i l[4] = {_mm512_castsi512_si128(w), _mm512_extracti32x4_epi32(w, 1),
                                _mm512_extracti32x4_epi32(w, 2), _mm512_extracti32x4_epi32(w, 3)};
          for (int L = 0; L < 4; ++L)
            if (g0 + L < ng) _mm_store_si128((__m128i *)&I[j][g0 + L][t0], l[L]);
          continue;
        }
        w = _mm512_add_epi32(w, _mm512_shuffle_i32x4(w, w, 0xB1)); /* lanes 0, 2: the sums of lanes 0-1, 2-3 */
        if (lpg == 2) {
          _mm_store_si128((__m128i *)&I[j][g0][t0], _mm512_castsi512_si128(w));
          if (g0 + 1 < ng) _mm_store_si128((__m128i *)&I[j][g0 + 1][t0], _mm512_extracti32x4_epi32(w, 2));
          continue;
        }
        w = _mm512_add_epi32(w, _mm512_shuffle_i32x4(w, w, 0x4E)); /* lane 0: the chunk's sum */
        const int cpg = lpg / 4, first = c % cpg == 0, last = c % cpg == cpg - 1;
        gacc[j] = first ? _mm512_castsi512_si128(w) : _mm_add_epi32(gacc[j], _mm512_castsi512_si128(w));
        if (last) _mm_store_si128((__m128i *)&I[j][g0][t0], gacc[j]);
      }
    }
  }
  for (int64_t t0 = 0; t0 < n16; t0 += LANES) {
    const __mmask16 live = n - t0 >= LANES ? 0xffff : (__mmask16)((1u << (n - t0)) - 1u);
    for (int j = 0; j < J; ++j) {
      const float *f = fq + (int64_t)j * fqst;
      __m512 sc = _mm512_setzero_ps();
      for (int g = 0; g < ng; ++g) {
        const __m512 X = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(&I[j][g][t0])), _mm512_set1_ps(f[g]));
        sc = _mm512_fmadd_ps(_mm512_loadu_ps(bt + g * KVA_TILE + t0), _mm512_set1_ps(f[ng + g]),
                             _mm512_fmadd_ps(X, _mm512_loadu_ps(st + g * KVA_TILE + t0), sc));
      }
      _mm512_storeu_ps(S + j * KVA_TILE + t0, _mm512_maskz_mov_ps(live, sc));
    }
  }
}
#define KPHASE_RL(J_)                                                                                          \
  __attribute__((noinline)) static void kphase_rl_##J_(const fmt_plan *fp, const kva_rows *rows, int64_t n,   \
                                                       const char *qb, const float *fq, const float *st,      \
                                                       const float *bt, float *S, const kva_prefetch *pf) {   \
    const int64_t qst = (int64_t)fp->P * 4, fqst = (int64_t)fp->nch * LANES;                                   \
    const int g64 = fp->bits == 4 && fp->G == 64 && fp->chmask[fp->nch - 1] == 0xffff;                         \
    if (g64 && fp->nch == 2) kphase_rl(fp, rows, n, qb, qst, fq, fqst, st, bt, J_, 4, S, pf, 2, 2);            \
    else if (g64 && fp->nch == 1) kphase_rl(fp, rows, n, qb, qst, fq, fqst, st, bt, J_, 4, S, pf, 1, 2);       \
    else if (fp->bits == 4) kphase_rl(fp, rows, n, qb, qst, fq, fqst, st, bt, J_, 4, S, pf, 0, 0);             \
    else kphase_rl(fp, rows, n, qb, qst, fq, fqst, st, bt, J_, 8, S, pf, 0, 0);                                \
  }
KPHASE_RL(1)
KPHASE_RL(2)
KPHASE_RL(4)
/* All nq vectors by kphase_rl in blocks of 4, 2, 1 (the first prefetches);
 * qp / qs: query_int8_rl's bytes and factors per vector. */
static void kphase_rl_all(const fmt_plan *fp, const kva_rows *rows, int64_t n, const float *qp, const float *qs,
                          int64_t nq, float *S, const kva_prefetch *pf) {
  _Alignas(64) float st[LANES * KVA_TILE], bt[LANES * KVA_TILE];
  groups_tile(fp, rows, n, KVA_ARR_KS, KVA_ARR_KB, 1, st, bt);
  const int64_t fqst = (int64_t)fp->nch * LANES;
  int64_t j = 0;
#define RARGS(J) rows, n, (const char *)(qp + (J) * fp->P), qs + (J) * fqst, st, bt, S + (J) * KVA_TILE, pf
  for (; j + 4 <= nq; j += 4, pf = NULL) kphase_rl_4(fp, RARGS(j));
  if (j + 2 <= nq) { kphase_rl_2(fp, RARGS(j)); j += 2; pf = NULL; }
  if (j < nq) kphase_rl_1(fp, RARGS(j));
#undef RARGS
}

#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
/* ---- bf16 K with bf16 queries on bf16 pairs (fp->bft) ----
 * S_j[t] = scale * sum_w dot2(q_j word w, k_t word w), word w = the bf16
 * pair of dims 2w, 2w+1 (one u32 of the row), by vdpbf16ps: each pair's two
 * products are exact in f32 and added to the f32 lane one at a time (round
 * to nearest even), bf16 denormal inputs and denormal results flushed to
 * zero (as in the AMX tiles); no rounding of q or K (both are bf16). Tokens
 * in lanes: per 16 tokens the rows' words are transposed (transpose16x16 per
 * 16 words: D/32 x 64 shuffles) into ct[word][16 tokens] (L1, 64 D bytes),
 * then per (query vector, 16 tokens) D/2 vdpbf16ps with the query's word
 * broadcast, one mul by the scale. Query vector j at qv + j*P floats: its
 * bf16 row as D/2 words. */
#define KBT_MIN_VECTORS 5 /* kphase_bft from this many query vectors (fewer: kphase_float) */
#define KBJ 8             /* query vectors per register block */

/* acc += the bf16 pair products of a and the u32 (two bf16) at w broadcast
 * (vdpbf16ps, memory operand {1to16}; asm as dpbusd_bcast). */
ALWAYS __m512 dpbf16_bcast(__m512 acc, __m512i a, const int32_t *w) {
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*w));
  return acc;
}

/* S[j][0..16) of J vectors against the 16 tokens of ct (live: the valid
 * ones; others get 0). NA accumulator chains per vector (few vectors: the
 * vdpbf16ps latency). */
ALWAYS void kbft_block(const int32_t *ct, int words, const float *qv, int64_t qstride, float scale, __mmask16 live,
                       float *S, int J) {
  const int NA = 2;
  __m512 acc[2][KBJ];
  for (int a = 0; a < NA; ++a)
    for (int j = 0; j < J; ++j) acc[a][j] = _mm512_setzero_ps();
  for (int w = 0; w < words; w += NA) /* words: a multiple of 16 */
    for (int a = 0; a < NA; ++a) {
      const __m512i x = _mm512_load_si512(ct + (int64_t)(w + a) * LANES);
      for (int j = 0; j < J; ++j) acc[a][j] = dpbf16_bcast(acc[a][j], x, (const int32_t *)(qv + j * qstride) + w + a);
    }
  for (int j = 0; j < J; ++j) {
    const __m512 r = NA == 2 ? _mm512_add_ps(acc[0][j], acc[1][j]) : acc[0][j];
    _mm512_storeu_ps(S + j * KVA_TILE, _mm512_maskz_mul_ps(live, r, _mm512_set1_ps(scale)));
  }
}
#define KBFT_BLOCK(J_)                                                                                  \
  static void kbft_block_##J_(const int32_t *ct, int words, const float *qv, int64_t qstride, float scale, \
                              __mmask16 live, float *S) {                                               \
    kbft_block(ct, words, qv, qstride, scale, live, S, J_);                                             \
  }
KBFT_BLOCK(8)
KBFT_BLOCK(4)
KBFT_BLOCK(2)
KBFT_BLOCK(1)

/* All nq vectors, 16 tokens at a time: transpose, then blocks of 8, 4, 2, 1
 * vectors; rows t0 .. t0 + 15 of the next tile are prefetched spread over
 * the blocks of 8 (at once, 8 lines a row at D = 256, they stall on the
 * fill buffers: K 118 -> 91 ns per token-head spread, 32 vectors, one
 * thread, N = 64k). */
static void kphase_bft(const fmt_plan *fp, const kva_rows *rows, int64_t n, const float *qp, int64_t nq, float *S,
                       const kva_prefetch *pf) {
  _Alignas(64) int32_t ct[KVA_MAX_HEAD_DIM / 2 * LANES];
  const int words = fp->P / 2;
  for (int64_t t0 = 0; t0 < n; t0 += LANES) {
    const int nt = n - t0 < LANES ? (int)(n - t0) : LANES;
    for (int c = 0; c < words / LANES; ++c) {
      __m512i r[LANES];
      for (int t = 0; t < LANES; ++t)
        r[t] = t < nt ? _mm512_loadu_si512(rows[t0 + t].k + c * 64) : _mm512_setzero_si512();
      transpose16x16(r);
      for (int w = 0; w < LANES; ++w) _mm512_store_si512(ct + (int64_t)(c * LANES + w) * LANES, r[w]);
    }
    const __mmask16 live = (__mmask16)(nt == LANES ? 0xffff : (1u << nt) - 1u);
    int64_t j = 0, r = t0; /* rows t0 .. t0 + 15 of the next tile prefetched, spread over the blocks */
    const int64_t per = (LANES * 8 + nq - 1) / nq, r1 = pf && t0 + LANES < pf->n ? t0 + LANES : pf ? pf->n : 0;
#define BARGS(J) ct, words, qp + (J) * fp->P, fp->P, fp->qscale, live, S + (J) * KVA_TILE + t0
    for (; j + 8 <= nq; j += 8) {
      for (int64_t e = r + per < r1 ? r + per : r1; r < e; ++r) prefetch_row(pf, r, KVA_ARR_K, KVA_ARR_V);
      kbft_block_8(BARGS(j));
    }
    for (; r < r1; ++r) prefetch_row(pf, r, KVA_ARR_K, KVA_ARR_V);
    if (j + 4 <= nq) { kbft_block_4(BARGS(j)); j += 4; }
    if (j + 2 <= nq) { kbft_block_2(BARGS(j)); j += 2; }
    if (j < nq) kbft_block_1(BARGS(j));
#undef BARGS
  }
}
#endif

/* All nq vectors, in register blocks of 8, 4, 2, 1 (or kphase_tok_all); the
 * first block issues the prefetch. */
static void kphase(const fmt_plan *fp, const kva_rows *rows, int64_t n, const float *qp,
                   const float *qs, int64_t nq, float *S, const kva_prefetch *pf) {
  int64_t j = 0;
#ifdef __AVX512VNNI__
  if (fp->tok) {
    kphase_tok_all(fp, rows, n, qp, nq, S, pf);
    return;
  }
  if (fp->rl) {
    kphase_rl_all(fp, rows, n, qp, qs, nq, S, pf);
    return;
  }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  if (fp->bft) {
    kphase_bft(fp, rows, n, qp, nq, S, pf);
    return;
  }
#endif
#define KARGS(J) rows, n, qp + (J) * fp->P, qs + (J) * fp->nch * LANES, S + (J) * KVA_TILE, pf
  for (; j + 8 <= nq; j += 8, pf = NULL) kphase_block_8(fp, KARGS(j));
  if (j + 4 <= nq) { kphase_block_4(fp, KARGS(j)); j += 4; pf = NULL; }
  if (j + 2 <= nq) { kphase_block_2(fp, KARGS(j)); j += 2; pf = NULL; }
  if (j < nq) kphase_block_1(fp, KARGS(j));
#undef KARGS
}

/* ---- V phase ---- */
/* A V scale that is not finite: mantissa placement (code_as_float) would
 * turn s c + b into s' f + (b - s') = inf - inf = NaN for every code, where
 * the oracle's s c + b is +-inf (NaN only for code 0), so such a row (or
 * chunk) takes the exact form. */
ALWAYS int v_scales_nonfinite(__m512 s) { return _mm512_fpclass_ps_mask(s, FPCLASS_NONFINITE) != 0; }
/* Decodes the tile's V rows into vt[t][P] (codes, or values for float rows)
 * and, when quantized, per-token group scale/bias lanes svt/bvt[t][chunk].
 * Returns whether any value (float rows) or scale/bias lane (quantized: the
 * codes are finite) is NaN or Inf, so that vphase takes its masked form. */
static int decode_v_tile(const fmt_plan *fp, const kva_rows *rows, int64_t n, float *vt, float *svt,
                         float *bvt, const kva_prefetch *pf) {
  __mmask16 bad = 0;
  if (!fp->bits) {
    const int64_t es = (int64_t)kva_dtype_size(fp->sdt);
    for (int64_t t = 0; t < n; ++t) {
      if (pf && t < pf->n) prefetch_row(pf, t, KVA_ARR_V, KVA_ARRS);
      const char *row = rows[t].v;
      int d = 0;
      if (fp->split)
        for (; d + 2 * LANES <= fp->P; d += 2 * LANES) {
          __m512 ve, vo;
          load_bf16_split(row + d * es, &ve, &vo);
          bad |= _mm512_fpclass_ps_mask(ve, FPCLASS_NONFINITE) | _mm512_fpclass_ps_mask(vo, FPCLASS_NONFINITE);
          _mm512_storeu_ps(vt + t * fp->P + d, ve);
          _mm512_storeu_ps(vt + t * fp->P + d + LANES, vo);
        }
      const __m512 vsc = _mm512_set1_ps(fp->fp8 && rows[t].vs ? *(const float *)rows[t].vs : 1.0f); /* fp8 */
      for (; d < fp->P; d += LANES) {
        const __m512 v = fp->fp8 ? _mm512_mul_ps(load_f16x(row + d * es, fp->sdt), vsc) : load_f16x(row + d * es, fp->sdt);
        bad |= _mm512_fpclass_ps_mask(v, FPCLASS_NONFINITE);
        _mm512_storeu_ps(vt + t * fp->P + d, v);
      }
    }
    return bad != 0;
  }
  for (int64_t t = 0; t < n; ++t) {
    if (pf && t < pf->n) prefetch_row_q(pf, t, KVA_ARR_V);
    const char *row = rows[t].v;
    const __m512 Sv = load_groups(rows[t].vs, fp->sdt, fp->ngroups);
    const __m512 Bv = load_groups(rows[t].vb, fp->sdt, fp->ngroups);
    const int ex = fp->exact || v_scales_nonfinite(Sv); /* the row in the exact form (v_scales_nonfinite) */
    for (int c = 0; c < fp->nch; ++c) {
      const __m512i x = _mm512_maskz_loadu_epi32(fp->chmask[c], row + c * 64);
      for (int k = 0; k < fp->E; ++k)
        _mm512_storeu_ps(vt + t * fp->P + (int64_t)(c * fp->E + k) * LANES, code_as_float(x, k, fp->bits, ex));
      __m512 sv = _mm512_permutexvar_ps(fp->gidx[c], Sv), bv = _mm512_permutexvar_ps(fp->gidx[c], Bv);
      affine_for(&sv, &bv, fp->bits, ex);
      bad |= _mm512_fpclass_ps_mask(sv, FPCLASS_NONFINITE) | _mm512_fpclass_ps_mask(bv, FPCLASS_NONFINITE);
      _mm512_storeu_ps(svt + (t * fp->nch + c) * LANES, sv);
      _mm512_storeu_ps(bvt + (t * fp->nch + c) * LANES, bv);
    }
  }
  return bad != 0;
}

/* o[j][pos] += sum_t w(j,t,pos) * vt[t][pos] for J vectors and VKB*16
 * positions from pos0, where w = P[j][t] * (quantized ? scale lane : 1);
 * ob[j][chunk lanes] += P[j][t] * bias lane. MASK (a tile with a NaN or Inf
 * in its V values or lanes): keys with P == 0 (masked for that vector) add
 * exactly nothing, as in the direct paths, so a NaN or Inf in the V row of a
 * key that only other vectors see stays out (0 * NaN would not); else plain
 * FMAs (masking every tile measured 5-15 % slower on hot one-thread verify
 * L=8 calls at 8k tokens, q4 and bf16; this form is as fast as before). */
ALWAYS void vphase_block(const fmt_plan *fp, int64_t n, const float *P, const float *vt, const float *svt,
                         const float *bvt, float *o, float *ob, int64_t pos0, int J, int KB, int MASK) {
  __m512 acc[VJB][VKB];
  const int quant = fp->bits != 0;
  const int c = quant ? (int)(pos0 / LANES / fp->E) : 0;
  for (int j = 0; j < J; ++j)
    for (int kb = 0; kb < KB; ++kb) acc[j][kb] = _mm512_loadu_ps(o + (int64_t)j * fp->P + pos0 + kb * LANES);
  for (int64_t t = 0; t < n; ++t) {
    __m512 w[VJB];
    __mmask16 pm[VJB];
    const __m512 sv = quant ? _mm512_loadu_ps(svt + (t * fp->nch + c) * LANES) : _mm512_set1_ps(1.0f);
    for (int j = 0; j < J; ++j) {
      pm[j] = !MASK || P[j * KVA_TILE + t] != 0.0f ? 0xffff : 0;
      w[j] = _mm512_mul_ps(_mm512_set1_ps(P[j * KVA_TILE + t]), sv);
    }
    for (int kb = 0; kb < KB; ++kb) {
      const __m512 v = _mm512_loadu_ps(vt + t * fp->P + pos0 + kb * LANES);
      for (int j = 0; j < J; ++j)
        acc[j][kb] = MASK ? _mm512_mask3_fmadd_ps(w[j], v, acc[j][kb], pm[j]) : _mm512_fmadd_ps(w[j], v, acc[j][kb]);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int kb = 0; kb < KB; ++kb) _mm512_storeu_ps(o + (int64_t)j * fp->P + pos0 + kb * LANES, acc[j][kb]);
  /* bias lanes: once per chunk (the caller passes the first k-block of a chunk) */
  if (quant && pos0 % ((int64_t)fp->E * LANES) == 0) {
    for (int j = 0; j < J; ++j) {
      __m512 b = _mm512_loadu_ps(ob + ((int64_t)j * fp->nch + c) * LANES);
      for (int64_t t = 0; t < n; ++t)
        b = _mm512_mask3_fmadd_ps(_mm512_set1_ps(P[j * KVA_TILE + t]), _mm512_loadu_ps(bvt + (t * fp->nch + c) * LANES),
                                  b, !MASK || P[j * KVA_TILE + t] != 0.0f ? 0xffff : 0);
      _mm512_storeu_ps(ob + ((int64_t)j * fp->nch + c) * LANES, b);
    }
  }
}

#define VPHASE_BLOCK(J_, KB_)                                                                          \
  static void vphase_block_##J_##_##KB_(const fmt_plan *fp, int64_t n, const float *P, const float *vt, \
                                        const float *svt, const float *bvt, float *o, float *ob,        \
                                        int64_t pos0, int mask) {                                       \
    if (mask) vphase_block(fp, n, P, vt, svt, bvt, o, ob, pos0, J_, KB_, 1);                            \
    else vphase_block(fp, n, P, vt, svt, bvt, o, ob, pos0, J_, KB_, 0);                                 \
  }
VPHASE_BLOCK(4, 4)
VPHASE_BLOCK(2, 4)
VPHASE_BLOCK(1, 4)
VPHASE_BLOCK(4, 1)
VPHASE_BLOCK(2, 1)
VPHASE_BLOCK(1, 1)

static void vphase(const fmt_plan *fp, int64_t n, const float *P, const float *vt, const float *svt,
                   const float *bvt, float *o, float *ob, int64_t nq, int mask) {
  /* k-blocks of 4 vectors never straddle a chunk: E*16 is a multiple of 64 for bits <= 8. */
  for (int64_t pos = 0; pos < fp->P;) {
    const int wide = pos + VKB * LANES <= fp->P;
    int64_t j = 0;
    for (; j + 4 <= nq; j += 4) {
      const float *Pj = P + j * KVA_TILE;
      float *oj = o + j * fp->P, *obj = ob + j * fp->nch * LANES;
      if (wide) vphase_block_4_4(fp, n, Pj, vt, svt, bvt, oj, obj, pos, mask);
      else vphase_block_4_1(fp, n, Pj, vt, svt, bvt, oj, obj, pos, mask);
    }
    for (; j + 2 <= nq; j += 2) {
      const float *Pj = P + j * KVA_TILE;
      float *oj = o + j * fp->P, *obj = ob + j * fp->nch * LANES;
      if (wide) vphase_block_2_4(fp, n, Pj, vt, svt, bvt, oj, obj, pos, mask);
      else vphase_block_2_1(fp, n, Pj, vt, svt, bvt, oj, obj, pos, mask);
    }
    for (; j < nq; ++j) {
      const float *Pj = P + j * KVA_TILE;
      float *oj = o + j * fp->P, *obj = ob + j * fp->nch * LANES;
      if (wide) vphase_block_1_4(fp, n, Pj, vt, svt, bvt, oj, obj, pos, mask);
      else vphase_block_1_1(fp, n, Pj, vt, svt, bvt, oj, obj, pos, mask);
    }
    pos += wide ? VKB * LANES : LANES;
  }
}

#ifdef __AVX512VNNI__
/* ---- V phase on 16-bit integers ----
 * Quantized V (4-bit, 8-bit; groups of a multiple of 8 code words) with 16-bit
 * queries outside exact mode: per element of group g,
 *   o_j += sum_t p_jt (s_tg c_t + b_tg) = sum_t w_jtg c_t + b_tg sum_t p_jt,
 * with w = p * s rounded to s16 per (vector j, tile, group g), the bias
 * sums in f32 (the bias lanes, as the f32 path).
 * The rounding ("P int16"): with M = max_t |w_jtg| over the tile's tokens,
 * sigma = 2^-k, k = 14 - floor(log2 M) (one less where M 2^k would round
 * to 2^15), w' = rint(w / sigma) (|w'| <= 32767), the scaling exact (powers
 * of two), so |w' sigma - w| <= M / 32767.5. A group whose M is 0 adds nothing,
 * one whose M is below 2^-135 (sigma below f32's range) is lost; a NaN
 * weight (NaN logits) gives garbage codes, but its NaN reaches the bias sum
 * and the vector's l, so the output is NaN as in the f32 path.
 * Codes of two tokens sit in adjacent s16 halves of each u32 lane (token
 * 2i low, 2i + 1 high) and vpdpwssd adds w'_2i c_2i + w'_2i+1 c_2i+1 into
 * int32 lanes: per tile at most 16 pairs of 2 * 32767 * 255 < 2^28, no
 * overflow; the int32 sums times sigma go to o in f32 once per tile. Tiles
 * whose V rows hold a non-finite scale or bias take the f32 path (masked:
 * keys with P == 0 add exactly nothing).
 * Layout: ct[pair][pos] u32 lanes, decoded once per tile into L1 for all
 * nq vectors, in o's permuted order (vector v = c*E + k: code k of the 16
 * words of chunk c), except that with 8 words per group (two groups per
 * vector) vectors 2m and 2m+1 of a chunk exchange halves: 2m holds the low
 * 8 lanes (group 2c) of both, 2m+1 the high 8 (group 2c+1), so that every
 * vector is one group's and its weights are one broadcast u32 (the two
 * tokens' s16 weights); the int32 sums are exchanged back before they are
 * added to o. Weights wg[vector][group][pair] (u32) for a block of PWJ
 * vectors at a time. */
/* Query vectors per KV head from which the codes go through the L1 tile
 * (vphase_pint); fewer take the direct form (vphase_pint_direct, which
 * decodes them once per block of 2 vectors): 8 for 4-bit V, 5 for 8-bit
 * (development host, one thread: at 6 vectors q4 35.2 -> 31.5 ns per
 * token-head direct, q8 41.6 -> 43.0; at 8 equal). */
#define PINT_MIN_VECTORS(bits) ((bits) == 4 ? 8 : 5)
#define PJB 4              /* query vectors per register block */
#define PWJ 8              /* query vectors per pint_weights call: 16 / ngroups (16 maxima per reduction),
                              at least PJB */
#define PKB 4              /* code vectors (of 16 positions) per register block */

/* acc += the s16 pair products of a and the u32 (two s16 weights) at w
 * broadcast (vpdpwssd, memory operand {1to16}); as asm because GCC 12 copies
 * the accumulator around the intrinsic in the unrolled block loop (two
 * register moves per vpdpwssd) and broadcasts w in a separate instruction. */
ALWAYS __m512i dpwssd_bcast(__m512i acc, __m512i a, const int32_t *w) {
  __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*w));
  return acc;
}

/* pint_codes' vpermt2w indices (u32 lane l: its low s16 from x0, its high one
 * from x1, index 32 + ...): word w's low (hw 0) or high (hw 1) 16 bits; plain:
 * word l; halves: words l % 8 (tables 0, 2) or 8 + l % 8 (1, 3). */
#define PIW(w, hw) ((2 * (w) + (hw)) | (32 + 2 * (w) + (hw)) << 16)
static const int32_t pint_iw_plain[2][LANES] = {
    {PIW(0, 0), PIW(1, 0), PIW(2, 0), PIW(3, 0), PIW(4, 0), PIW(5, 0), PIW(6, 0), PIW(7, 0), PIW(8, 0), PIW(9, 0),
     PIW(10, 0), PIW(11, 0), PIW(12, 0), PIW(13, 0), PIW(14, 0), PIW(15, 0)},
    {PIW(0, 1), PIW(1, 1), PIW(2, 1), PIW(3, 1), PIW(4, 1), PIW(5, 1), PIW(6, 1), PIW(7, 1), PIW(8, 1), PIW(9, 1),
     PIW(10, 1), PIW(11, 1), PIW(12, 1), PIW(13, 1), PIW(14, 1), PIW(15, 1)}};
static const int32_t pint_iw_halves[4][LANES] = {
    {PIW(0, 0), PIW(1, 0), PIW(2, 0), PIW(3, 0), PIW(4, 0), PIW(5, 0), PIW(6, 0), PIW(7, 0), PIW(0, 0), PIW(1, 0),
     PIW(2, 0), PIW(3, 0), PIW(4, 0), PIW(5, 0), PIW(6, 0), PIW(7, 0)},
    {PIW(8, 0), PIW(9, 0), PIW(10, 0), PIW(11, 0), PIW(12, 0), PIW(13, 0), PIW(14, 0), PIW(15, 0), PIW(8, 0), PIW(9, 0),
     PIW(10, 0), PIW(11, 0), PIW(12, 0), PIW(13, 0), PIW(14, 0), PIW(15, 0)},
    {PIW(0, 1), PIW(1, 1), PIW(2, 1), PIW(3, 1), PIW(4, 1), PIW(5, 1), PIW(6, 1), PIW(7, 1), PIW(0, 1), PIW(1, 1),
     PIW(2, 1), PIW(3, 1), PIW(4, 1), PIW(5, 1), PIW(6, 1), PIW(7, 1)},
    {PIW(8, 1), PIW(9, 1), PIW(10, 1), PIW(11, 1), PIW(12, 1), PIW(13, 1), PIW(14, 1), PIW(15, 1), PIW(8, 1), PIW(9, 1),
     PIW(10, 1), PIW(11, 1), PIW(12, 1), PIW(13, 1), PIW(14, 1), PIW(15, 1)}};
#undef PIW

/* Code vectors of a token pair (chunks x0, x1): code k of each word of x0
 * in the low s16 of its lane, of x1 in the high one, into v[k]; HALVES:
 * vectors 2m, 2m+1 with their halves exchanged (see above). One vpermt2w
 * pairs the two tokens' low (codes 0 .. C-1, C = 16/bits) or high 16 bits
 * of each word (with HALVES: of words 0-7 or 8-15, each twice); a shift
 * (per half, with HALVES) and an and then give each vector. */
ALWAYS void pint_codes(__m512i x0, __m512i x1, int bits, int halves, __m512i *v) {
  const int C = 16 / bits, E = 32 / bits;
  const __m512i m = _mm512_set1_epi32(bits == 8 ? 0x00FF00FF : 0x000F000F);
  __m512i src[4]; /* halves: y words 0-7, y words 8-15, z 0-7, z 8-15; else y, z */
  const int nsrc = halves ? 4 : 2;
  for (int h = 0; h < nsrc; ++h)
    src[h] = _mm512_permutex2var_epi16(x0, _mm512_loadu_si512(halves ? pint_iw_halves[h] : pint_iw_plain[h]), x1);
  for (int k = 0; k < E; ++k) {
    const int kk = k % C; /* code kk of its 16-bit half */
    if (halves) { /* vector k: code k - (k & 1) of words 0-7 and code k - (k & 1) + 1 of words 0-7 (k even), or
                     of words 8-15 (k odd) */
      const int k0 = (k & ~1) % C;
      const __m512i x = src[((k & ~1) >= C) * 2 + (k & 1)];
      const __m512i sh =
          _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(bits * k0), _mm512_set1_epi32(bits * (k0 + 1)));
      v[k] = _mm512_and_si512(_mm512_srlv_epi32(x, sh), m);
    } else {
      const __m512i x = src[k >= C];
      v[k] = _mm512_and_si512(kk ? _mm512_srli_epi32(x, (unsigned)(bits * kk)) : x, m);
    }
  }
}

/* The tile's V codes as token pairs into ct[pair][P] and its group scales
 * and biases into st/bt (v_groups_tile). Returns whether any scale or bias
 * is NaN or Inf. */
ALWAYS int pint_decode(const fmt_plan *fp, const kva_rows *rows, int64_t n, int bits, int halves, int32_t *ct,
                       float *st, float *bt, const kva_prefetch *pf) {
  const int E = 32 / bits;
  const int bad = v_groups_tile(fp, rows, n, st, bt);
  for (int64_t t = 0; t < n; t += 2) {
    const int two = t + 1 < n;
    if (pf && t < pf->n) prefetch_row_q(pf, t, KVA_ARR_V);
    if (pf && two && t + 1 < pf->n) prefetch_row_q(pf, t + 1, KVA_ARR_V);
    int32_t *dst = ct + (t / 2) * fp->P;
    for (int c = 0; c < fp->nch; ++c) {
      const __m512i x0 = _mm512_maskz_loadu_epi32(fp->chmask[c], rows[t].v + c * 64);
      const __m512i x1 = two ? _mm512_maskz_loadu_epi32(fp->chmask[c], rows[t + 1].v + c * 64) : _mm512_setzero_si512();
      __m512i v[8];
      pint_codes(x0, x1, bits, halves, v);
      for (int k = 0; k < E; ++k) _mm512_storeu_si512(dst + (int64_t)(c * E + k) * LANES, v[k]);
    }
  }
  return bad;
}

/* round to nearest even, no exceptions (an integer constant expression: clang
 * takes the rounding of _mm512_cvt_roundps_epi32 only as one) */
#define PINT_RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* The weights of J <= PWJ vectors (J * ngroups <= 4 * LANES) for the tile (P: vector j's 32 weights
 * at P + j*KVA_TILE, zero past n): for vector j, wg[j][g][pair] s16 pairs,
 * sigma per group into sig[j][16], sum_t p b into ob's chunk lanes (at ob +
 * j*obn). The J*ngroups (vector, group) maxima M and bias sums are reduced
 * 16 at a time (reduce16_op), the exponents k computed for 16 at once. */
static void pint_weights(const fmt_plan *fp, const float *P, int J, const float *st, const float *bt, int32_t *wg,
                         float *sig, float *ob, int64_t obn) {
  const int ng = fp->ngroups, npair = J * ng;
  float kk[4 * LANES], bs[4 * LANES + LANES], sgv[4 * LANES];
  __m512 mv[4 * LANES], bv[4 * LANES]; /* pair x = j*ng + g: max |p s| lanes, p b lanes */
  int x = 0;
  for (int j = 0; j < J; ++j) {
    const __m512 p0 = _mm512_loadu_ps(P + j * KVA_TILE), p1 = _mm512_loadu_ps(P + j * KVA_TILE + LANES);
    for (int g = 0; g < ng; ++g, ++x) {
      const float *sg = st + g * KVA_TILE, *bg = bt + g * KVA_TILE;
      const __m512 w0 = _mm512_mul_ps(p0, _mm512_loadu_ps(sg)), w1 = _mm512_mul_ps(p1, _mm512_loadu_ps(sg + LANES));
      mv[x] = _mm512_range_ps(w0, w1, 0x0B); /* max(|w0|, |w1|) (vrangeps: larger magnitude, sign cleared) */
      bv[x] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(bg + LANES), _mm512_mul_ps(p0, _mm512_loadu_ps(bg)));
    }
  }
  for (; x % LANES; ++x) mv[x] = bv[x] = _mm512_setzero_ps();
  for (int u0 = 0; u0 < npair; u0 += LANES) {
    /* k = 14 - floor(log2 M), one less where M 2^k rounds to 2^15; 0 where M is not > 0 */
    const __m512 M = reduce16_op(mv + u0, 1);
    const __mmask16 pos = _mm512_cmp_ps_mask(M, _mm512_setzero_ps(), _CMP_GT_OQ);
    __m512 k = _mm512_maskz_sub_ps(pos, _mm512_set1_ps(14.0f), _mm512_getexp_ps(M));
    const __mmask16 over = _mm512_mask_cmp_ps_mask(pos, _mm512_scalef_ps(M, k), _mm512_set1_ps(32767.5f), _CMP_GE_OQ);
    k = _mm512_mask_sub_ps(k, over, k, _mm512_set1_ps(1.0f));
    _mm512_storeu_ps(kk + u0, k);
    _mm512_storeu_ps(bs + u0, reduce16_op(bv + u0, 0));
    _mm512_storeu_ps(sgv + u0, _mm512_scalef_ps(_mm512_set1_ps(1.0f), _mm512_sub_ps(_mm512_setzero_ps(), k)));
  }
  const __m512i qord = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0); /* packs' 128-bit interleave back to token order */
  for (int j = 0; j < J; ++j) {
    const __m512 p0 = _mm512_loadu_ps(P + j * KVA_TILE), p1 = _mm512_loadu_ps(P + j * KVA_TILE + LANES);
    int32_t *wj = wg + j * LANES * LANES;
    for (int g = 0; g < ng; ++g) {
      const float *sg = st + g * KVA_TILE;
      sig[j * LANES + g] = sgv[j * ng + g];
      const __m512 kv = _mm512_set1_ps(kk[j * ng + g]);
      const __m512 w0 = _mm512_mul_ps(p0, _mm512_loadu_ps(sg)), w1 = _mm512_mul_ps(p1, _mm512_loadu_ps(sg + LANES));
      const __m512i c0 = _mm512_cvt_roundps_epi32(_mm512_scalef_ps(w0, kv), PINT_RN);
      const __m512i c1 = _mm512_cvt_roundps_epi32(_mm512_scalef_ps(w1, kv), PINT_RN);
      _mm512_storeu_si512(wj + g * LANES, _mm512_permutexvar_epi64(qord, _mm512_packs_epi32(c0, c1)));
    }
    if (ng & 1) { /* two groups per vector: the last chunk's missing second group (codes 0) */
      sig[j * LANES + ng] = 0.0f;
      _mm512_storeu_si512(wj + ng * LANES, _mm512_setzero_si512());
    }
    const __m512 bj = _mm512_loadu_ps(bs + j * ng);
    float *obj = ob + j * obn;
    for (int c = 0; c < fp->nch; ++c)
      _mm512_storeu_ps(obj + c * LANES,
                       _mm512_add_ps(_mm512_loadu_ps(obj + c * LANES), _mm512_permutexvar_ps(fp->gidx[c], bj)));
  }
}

/* o[0 .. 16 n) += sigma * float(acc[0 .. n)) for one vector (n even), one FMA
 * per vector of o; HALVES: the int32 sums are first moved back to o's order
 * (the low halves of a vector pair, then the high halves), whose lanes 0-7
 * then take the pair's first group's sigma (sig[g0]) and lanes 8-15 the
 * second's. */
ALWAYS void pint_flush(float *o, const __m512i *acc, int n, const float *sig, int g0, int HALVES) {
  const __m512 s0 = _mm512_set1_ps(sig[g0]);
  const __m512 sv = HALVES ? _mm512_mask_blend_ps(0xFF00, s0, _mm512_set1_ps(sig[g0 + 1])) : s0;
  for (int k = 0; k < n; k += 2) {
    __m512i a = acc[k], b = acc[k + 1];
    if (HALVES) {
      const __m512i lo = _mm512_shuffle_i32x4(a, b, 0x44), hi = _mm512_shuffle_i32x4(a, b, 0xEE);
      a = lo;
      b = hi;
    }
    _mm512_storeu_ps(o + k * LANES, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), sv, _mm512_loadu_ps(o + k * LANES)));
    _mm512_storeu_ps(o + (k + 1) * LANES, _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), sv, _mm512_loadu_ps(o + (k + 1) * LANES)));
  }
}

/* o[j][pos0 .. pos0 + 16 PKB) += sigma_jg * sum_pairs w'_jg . codes for J
 * vectors (wg, sig: PJB vectors' weights and sigmas); HALVES: the block's
 * vectors alternate between the chunk's two groups. */
ALWAYS void pint_block(const fmt_plan *fp, int64_t np, const int32_t *ct, const int32_t *wg, const float *sig,
                       float *o, int64_t pos0, int J, int HALVES) {
  const int v0 = (int)(pos0 / LANES), c = v0 / fp->E;
  const int g0 = HALVES ? 2 * c : (c * LANES * fp->E) / fp->G;
  __m512i acc[PJB][PKB];
  for (int j = 0; j < J; ++j)
    for (int kb = 0; kb < PKB; ++kb) acc[j][kb] = _mm512_setzero_si512();
  for (int64_t i = 0; i < np; ++i) {
    for (int kb = 0; kb < PKB; ++kb) {
      const __m512i x = _mm512_loadu_si512(ct + i * fp->P + pos0 + kb * LANES);
      for (int j = 0; j < J; ++j)
        acc[j][kb] = dpwssd_bcast(acc[j][kb], x, wg + ((int64_t)j * LANES + g0 + (HALVES ? kb & 1 : 0)) * LANES + i);
    }
  }
  for (int j = 0; j < J; ++j) pint_flush(o + (int64_t)j * fp->P + pos0, acc[j], PKB, sig + j * LANES, g0, HALVES);
}
#define PINT_BLOCK(J_)                                                                                 \
  static void pint_block_##J_(const fmt_plan *fp, int64_t np, const int32_t *ct, const int32_t *wg,     \
                              const float *sig, float *o, int64_t pos0) {                               \
    if (fp->pint == 2) pint_block(fp, np, ct, wg, sig, o, pos0, J_, 1);                                 \
    else pint_block(fp, np, ct, wg, sig, o, pos0, J_, 0);                                               \
  }
PINT_BLOCK(4)
PINT_BLOCK(2)
PINT_BLOCK(1)

/* The integer V phase for one tile (fp->pint: 1, or 2 with 8 words per
 * group); 0 without touching o or ob when a scale or bias of the tile is
 * not finite (the caller then takes the f32 path). Scratch: ct (n/2 rows of
 * P u32) in vt, st/bt in svt/bvt. */
static int vphase_pint(const fmt_plan *fp, const kva_rows *rows, int64_t n, const float *S, float *vt, float *svt,
                       float *bvt, float *o, float *ob, int64_t nq, const kva_prefetch *pf) {
  int32_t *ct = (int32_t *)vt;
  const int64_t np = (n + 1) / 2, obn = (int64_t)fp->nch * LANES;
  const int h = fp->pint == 2;
  const int bad = fp->bits == 4 ? (h ? pint_decode(fp, rows, n, 4, 1, ct, svt, bvt, pf) : pint_decode(fp, rows, n, 4, 0, ct, svt, bvt, pf))
                                : (h ? pint_decode(fp, rows, n, 8, 1, ct, svt, bvt, pf) : pint_decode(fp, rows, n, 8, 0, ct, svt, bvt, pf));
  if (bad) return 0;
  int32_t wg[PWJ * LANES * LANES];
  float sig[PWJ * LANES];
  /* weights for WJ vectors at a time: 16 (vector, group) maxima per reduction in pint_weights */
  const int WJ = fp->ngroups >= LANES / PJB ? PJB : LANES / fp->ngroups < PWJ ? LANES / fp->ngroups : PWJ;
  for (int64_t w0 = 0; w0 < nq; w0 += WJ) {
    const int JW = nq - w0 < WJ ? (int)(nq - w0) : WJ;
    pint_weights(fp, S + w0 * KVA_TILE, JW, svt, bvt, wg, sig, ob + w0 * obn, obn);
    for (int jb = 0; jb < JW; jb += PJB) {
      const int J = JW - jb < PJB ? JW - jb : PJB;
      const int32_t *wj = wg + jb * LANES * LANES;
      const float *sj = sig + jb * LANES;
      float *oj = o + (w0 + jb) * fp->P;
      for (int64_t pos = 0; pos < fp->P; pos += PKB * LANES) {
        int j = 0;
        if (J == 4) { pint_block_4(fp, np, ct, wj, sj, oj, pos); continue; }
        if (J - j >= 2) { pint_block_2(fp, np, ct, wj, sj, oj, pos); j += 2; }
        if (J - j >= 1) pint_block_1(fp, np, ct, wj + j * LANES * LANES, sj + j * LANES, oj + (int64_t)j * fp->P, pos);
      }
    }
  }
  return 1;
}
#endif

#ifdef __AVX512VNNI__
/* The direct form of vphase_pint for few vectors (decode): the token
 * pairs' code vectors built in registers (pint_codes) and consumed at once
 * by blocks of <= 2 vectors (J E int32 accumulators per chunk, flushed to o
 * times sigma per chunk as pint_block does), no L1 round trip; the same
 * roundings and results as vphase_pint. The first block's first chunk
 * prefetches the next tile's V rows. */
ALWAYS void pint_direct(const fmt_plan *fp, const kva_rows *rows, int64_t n, const int32_t *wg, const float *sig,
                        float *o, int J, int bits, int HALVES, const kva_prefetch *pf) {
  enum { EMAX = 8 };
  const int E = 32 / bits, KH = J * E > 16 ? E / 2 : E; /* code vectors per pass: <= 16 accumulators */
  for (int c = 0; c < fp->nch; ++c) {
    const int g0 = HALVES ? 2 * c : (c * LANES * E) / fp->G;
    for (int k0 = 0; k0 < E; k0 += KH) {
      __m512i acc[4][EMAX];
      for (int j = 0; j < J; ++j)
        for (int k = 0; k < KH; ++k) acc[j][k] = _mm512_setzero_si512();
      for (int64_t t = 0; t < n; t += 2) {
        const int two = t + 1 < n;
        if (pf && c == 0 && k0 == 0 && t < pf->n) {
          prefetch_row_q(pf, t, KVA_ARR_V);
          if (two && t + 1 < pf->n) prefetch_row_q(pf, t + 1, KVA_ARR_V);
        }
        const __m512i x0 = _mm512_maskz_loadu_epi32(fp->chmask[c], rows[t].v + c * 64);
        const __m512i x1 = two ? _mm512_maskz_loadu_epi32(fp->chmask[c], rows[t + 1].v + c * 64) : _mm512_setzero_si512();
        __m512i v[EMAX]; /* (the pass's KH of them are used) */
        pint_codes(x0, x1, bits, HALVES, v);
        for (int k = 0; k < KH; ++k)
          for (int j = 0; j < J; ++j)
            acc[j][k] = dpwssd_bcast(acc[j][k], v[k0 + k],
                                     wg + ((int64_t)j * LANES + g0 + (HALVES ? k & 1 : 0)) * LANES + t / 2);
      }
      for (int j = 0; j < J; ++j)
        pint_flush(o + (int64_t)j * fp->P + (int64_t)(c * E + k0) * LANES, acc[j], KH, sig + j * LANES, g0, HALVES);
    }
  }
}
#define PINT_DIRECT(BITS, J_, H_)                                                                          \
  __attribute__((noinline)) static void pint_direct_##BITS##_##J_##_##H_(                                  \
      const fmt_plan *fp, const kva_rows *rows, int64_t n, const int32_t *wg, const float *sig, float *o, \
      const kva_prefetch *pf) {                                                                            \
    pint_direct(fp, rows, n, wg, sig, o, J_, BITS, H_, pf);                                                \
  }
PINT_DIRECT(4, 1, 0)
PINT_DIRECT(4, 2, 0)
PINT_DIRECT(4, 1, 1)
PINT_DIRECT(4, 2, 1)
#define PINT_DIRECTS8(H_) PINT_DIRECT(8, 1, H_) PINT_DIRECT(8, 2, H_) PINT_DIRECT(8, 4, H_)
PINT_DIRECTS8(0)
PINT_DIRECTS8(1)

/* vphase_pint's direct form for nq < PINT_MIN_VECTORS (pint_direct): 0 without touching
 * o or ob when a scale or bias of the tile is not finite. */
static int vphase_pint_direct(const fmt_plan *fp, const kva_rows *rows, int64_t n, const float *S, float *svt,
                              float *bvt, float *o, float *ob, int64_t nq, const kva_prefetch *pf) {
  if (v_groups_tile(fp, rows, n, svt, bvt)) return 0;
  const int64_t obn = (int64_t)fp->nch * LANES;
  int32_t wg[PWJ * LANES * LANES];
  float sig[PWJ * LANES];
  for (int64_t j0 = 0; j0 < nq; j0 += PJB) /* PJB * ngroups <= 4 LANES maxima per pint_weights call */
    pint_weights(fp, S + j0 * KVA_TILE, nq - j0 < PJB ? (int)(nq - j0) : PJB, svt, bvt, wg + j0 * LANES * LANES,
                 sig + j0 * LANES, ob + j0 * obn, obn);
  const int h = fp->pint == 2;
  for (int64_t j = 0; j < nq;) {
    /* blocks of 4 (8-bit), 2, 1: the codes built once per block (4-bit in blocks of 4, two passes over
     * half the code vectors each: 21.8 -> 25.8 ns per token-head at 4 vectors; 8-bit 34.2 -> 30.1) */
    const int J = nq - j >= 4 && fp->bits == 8 ? 4 : nq - j >= 2 ? 2 : 1;
    const int32_t *wj = wg + j * LANES * LANES;
    const float *sj = sig + j * LANES;
    float *oj = o + j * fp->P;
    const kva_prefetch *bpf = j == 0 ? pf : NULL;
#define PDCALL(B, JJ) (h ? pint_direct_##B##_##JJ##_1 : pint_direct_##B##_##JJ##_0)(fp, rows, n, wj, sj, oj, bpf)
    if (fp->bits == 4) {
      if (J == 2) PDCALL(4, 2);
      else PDCALL(4, 1);
    } else {
      if (J == 4) PDCALL(8, 4);
      else if (J == 2) PDCALL(8, 2);
      else PDCALL(8, 1);
    }
#undef PDCALL
    j += J;
  }
  return 1;
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
/* ---- V phase on bf16 pairs (fp->bfp: bf16 V rows, 16-bit queries, >= 5
 * query vectors, not exact mode) ----
 * o_j += sum_t p_jt v_t with p rounded to bf16 ("P bf16", round to nearest
 * even, as the AMX kernel's P) and two tokens per vdpbf16ps: ct[pair
 * i][pos] u32 = (v_2i[elem], v_2i+1[elem]) (token 2i low, a zero row past
 * n), pos in the split order of o (float_pos), decoded once per tile into
 * L1 for all nq vectors (two vpermt2w per 32 elements of a pair);
 * wb[j][i] u32 = (p_j,2i, p_j,2i+1) in bf16 (one vcvtne2ps2bf16 per vector).
 * The products are exact and summed into the f32 accumulators (o itself)
 * one at a time (denormals flushed, as kphase_bft). The vector's l stays
 * the f32 sum of the unrounded p (tile_softmax). A tile with a NaN or Inf in
 * its V rows takes the f32 path (masked: keys with P == 0 add exactly
 * nothing). Per (vector, pair, 16 positions): one vdpbf16ps; per tile and
 * (vector, 16 positions): one load and one store of o. */
#define BPJ 4 /* query vectors per register block */
#define BPK 4 /* accumulator vectors (16 positions) per query per register block */


/* o[j][pos0 .. pos0 + 16 KB) += sum_pairs wb[j][i] . ct[i] for J vectors;
 * each pair's J weights broadcast once into registers for the KB code
 * vectors (against vdpbf16ps with a {1to16} memory operand per product:
 * q4 verify L=8 GQA 2 54 -> 46 ns per token-head, one thread). */
ALWAYS void bfp_block(int64_t np, int64_t P, const int32_t *ct, const int32_t *wb, float *o, int64_t pos0, int J,
                      int KB) {
  __m512 acc[BPJ][BPK];
  for (int j = 0; j < J; ++j)
    for (int kb = 0; kb < KB; ++kb) acc[j][kb] = _mm512_loadu_ps(o + j * P + pos0 + kb * LANES);
#pragma GCC unroll 2 /* two pairs per iteration: the q4 prefix pass 3-4 % faster (4: no more) */
  for (int64_t i = 0; i < np; ++i) {
    __m512i w[BPJ];
    for (int j = 0; j < J; ++j) w[j] = _mm512_set1_epi32(wb[j * LANES + i]);
    for (int kb = 0; kb < KB; ++kb) {
      const __m512i x = _mm512_loadu_si512(ct + i * P + pos0 + kb * LANES);
      for (int j = 0; j < J; ++j) acc[j][kb] = _mm512_dpbf16_ps(acc[j][kb], (__m512bh)x, (__m512bh)w[j]);
    }
  }
  for (int j = 0; j < J; ++j)
    for (int kb = 0; kb < KB; ++kb) _mm512_storeu_ps(o + j * P + pos0 + kb * LANES, acc[j][kb]);
}
#define BFP_BLOCK(J_, KB_)                                                                                 \
  static void bfp_block_##J_##_##KB_(int64_t np, int64_t P, const int32_t *ct, const int32_t *wb, float *o, \
                                     int64_t pos0) {                                                        \
    bfp_block(np, P, ct, wb, o, pos0, J_, KB_);                                                             \
  }
BFP_BLOCK(4, 4)
BFP_BLOCK(2, 4)
BFP_BLOCK(1, 4)
BFP_BLOCK(4, 2)
BFP_BLOCK(2, 2)
BFP_BLOCK(1, 2)

/* o[j] += sum_pairs bf16(p_j pair) . ct[pair] for the nq vectors of the
 * tile's n keys (ct: the token pairs of bf16 V values in o's order). The
 * next tile's V rows are prefetched spread over the register blocks (as
 * kphase_bft; with the pairing instead, 32 rows of 8 lines at once: V 113
 * -> 97 ns spread). */
static void bfp_accumulate(const fmt_plan *fp, const int32_t *ct, int64_t n, const float *S, float *o, int64_t nq,
                           const kva_prefetch *pf) {
  const int64_t np = (n + 1) / 2, P = fp->P;
  _Alignas(64) int32_t wb[BPJ * LANES];
  /* the next tile's V rows prefetched, spread over the register blocks */
  const int64_t nblk = (nq + BPJ - 1) / BPJ * ((P + BPK * LANES - 1) / (BPK * LANES)), pn = pf ? pf->n : 0;
  const int64_t per = (pn + nblk - 1) / (nblk ? nblk : 1);
  int64_t r = 0;
#define BFP_PF1(r) (fp->bits ? prefetch_row_q(pf, r, KVA_ARR_V) : prefetch_row(pf, r, KVA_ARR_V, KVA_ARRS))
#define BFP_PF() for (int64_t e = r + per < pn ? r + per : pn; r < e; ++r) BFP_PF1(r)
  for (int64_t j0 = 0; j0 < nq; j0 += BPJ) {
    const int J = nq - j0 < BPJ ? (int)(nq - j0) : BPJ;
    for (int j = 0; j < J; ++j) { /* P is 0 past n (tile_softmax) */
      const float *Pj = S + (j0 + j) * KVA_TILE;
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(Pj + LANES), _mm512_loadu_ps(Pj));
      _mm512_store_si512(wb + j * LANES, (__m512i)w);
    }
    float *oj = o + j0 * P;
    int64_t pos = 0;
    /* J vectors (3: 2 + 1) over the positions pos .. of K accumulators */
#define BFP_BLOCKS(K)                                                                 \
  do {                                                                                \
    BFP_PF();                                                                         \
    if (J == 4) bfp_block_4_##K(np, P, ct, wb, oj, pos);                              \
    else if (J == 2) bfp_block_2_##K(np, P, ct, wb, oj, pos);                         \
    else if (J == 1) bfp_block_1_##K(np, P, ct, wb, oj, pos);                         \
    else {                                                                            \
      bfp_block_2_##K(np, P, ct, wb, oj, pos);                                        \
      bfp_block_1_##K(np, P, ct, wb + 2 * LANES, oj + 2 * P, pos);                    \
    }                                                                                 \
  } while (0)
    for (; pos + BPK * LANES <= P; pos += BPK * LANES) BFP_BLOCKS(4);
    if (pos < P) BFP_BLOCKS(2); /* the last 32 positions (P: a multiple of 32) */
#undef BFP_BLOCKS
  }
  for (; r < pn; ++r) BFP_PF1(r);
#undef BFP_PF
#undef BFP_PF1
}

/* Returns 0 without touching o when a V value of the tile is NaN or Inf.
 * Scratch: ct (n/2 rows of P u32) in vt. */
static int vphase_bfp(const fmt_plan *fp, const kva_rows *rows, int64_t n, const float *S, float *vt, float *o,
                      int64_t nq, const kva_prefetch *pf) {
  int32_t *ct = (int32_t *)vt;
  const int64_t P = fp->P;
  /* u32 lane l = (element 2 l + par of x0, the same of x1): pint_codes' plain indices */
  const __m512i i0 = _mm512_loadu_si512(pint_iw_plain[0]), i1 = _mm512_loadu_si512(pint_iw_plain[1]);
  const __m512i ex = _mm512_set1_epi16(0x7F80); /* bf16 exponent bits: all set for NaN and Inf */
  __mmask32 bad = 0;
  for (int64_t t = 0; t < n; t += 2) {
    const int two = t + 1 < n;
    int32_t *dst = ct + (t / 2) * P;
    for (int64_t d = 0; d < P; d += 2 * LANES) {
      const __m512i x0 = _mm512_loadu_si512(rows[t].v + 2 * d);
      const __m512i x1 = two ? _mm512_loadu_si512(rows[t + 1].v + 2 * d) : _mm512_setzero_si512();
      bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(x0, ex), ex) | _mm512_cmpeq_epi16_mask(_mm512_and_si512(x1, ex), ex);
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x0, i0, x1));
      _mm512_storeu_si512(dst + d + LANES, _mm512_permutex2var_epi16(x0, i1, x1));
    }
  }
  if (bad) return 0;
  bfp_accumulate(fp, ct, n, S, o, nq, pf);
  return 1;
}

/* ---- V phase on bf16 values of 4-bit codes (fp->bfv: 4-bit V whose
 * groups span a multiple of 8 code words, 16-bit queries, >= BFV_MIN_VECTORS
 * query vectors, not exact mode) ----
 * Each V element dequantized in f32 (s c + b, one fma) and rounded to bf16
 * (nearest even; "V bf16"), then vphase_bfp's P.V with P rounded to bf16
 * ("P bf16"): o_j += sum_t bf16(p_jt) bf16(v_t), products exact, f32 sums;
 * the biases are in the values (ob untouched). Per token pair and group the
 * 32 values bf16(s c + b), c = 0..15, of both tokens form one table (two fmas
 * and one vcvtne2ps2bf16: token 2i's in words 0-15, 2i+1's in 16-31);
 * pint_codes' token-pair code vectors (o's permuted order) index the tables
 * of their chunk's groups (lanes 0-7: that of words 0-7, + 32: lanes 8-15,
 * that of words 8-15), one vpermt2w per 16 u32 lanes into ct[pair][P] (L1). */
#define BFV_MIN_VECTORS 16
static int bfv_kind(const kva_rowfmt *vf, int q16, int64_t nq) {
  return q16 && vf->bits == 4 && (vf->group * 4 / 32) % 8 == 0 && nq >= BFV_MIN_VECTORS;
}

/* Returns 0 without touching o when a scale, bias or value of the tile is
 * NaN or Inf. Scratch: ct (n/2 rows of P u32) in vt, scales in svt/bvt. */
static int vphase_bfv(const fmt_plan *fp, const kva_rows *rows, int64_t n, const float *S, float *vt, float *svt,
                      float *bvt, float *o, int64_t nq, const kva_prefetch *pf) {
  int32_t *ct = (int32_t *)vt;
  const int ng = fp->ngroups, wpg = fp->G * 4 / 32; /* code words per group: 8 or more */
  if (v_groups_tile(fp, rows, n, svt, bvt)) return 0;
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  /* vpermt2w index bits over the code: 16 for token 2i + 1's words, 32 for the second table (lanes 8-15) */
  const __m512i sel = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(0x00100000), _mm512_set1_epi32(0x00300020));
  const __m512i ex = _mm512_set1_epi16(0x7F80); /* bf16 exponent bits: all set for NaN and Inf */
  __mmask32 bad = 0;
  for (int64_t t = 0; t < n; t += 2) {
    const int two = t + 1 < n;
    __m512i tab[LANES + 1]; /* [ng]: zeros, the groups past the row (D < 128: padding lanes) */
    for (int g = 0; g < ng; ++g) {
      const float *sg = svt + g * KVA_TILE + t, *bg = bvt + g * KVA_TILE + t; /* zero past n */
      const __m512 v0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(sg[0]), _mm512_set1_ps(bg[0]));
      const __m512 v1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(sg[1]), _mm512_set1_ps(bg[1]));
      tab[g] = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
      bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(tab[g], ex), ex);
    }
    tab[ng] = _mm512_setzero_si512();
    int32_t *dst = ct + (t / 2) * fp->P;
    for (int c = 0; c < fp->nch; ++c) {
      const int g0 = c * LANES / wpg, g1 = (c * LANES + 8) / wpg < ng ? (c * LANES + 8) / wpg : ng;
      const __m512i x0 = _mm512_maskz_loadu_epi32(fp->chmask[c], rows[t].v + c * 64);
      const __m512i x1 = two ? _mm512_maskz_loadu_epi32(fp->chmask[c], rows[t + 1].v + c * 64) : _mm512_setzero_si512();
      __m512i v[8];
      pint_codes(x0, x1, 4, 0, v);
      for (int k = 0; k < 8; ++k)
        _mm512_storeu_si512(dst + (int64_t)(c * 8 + k) * LANES,
                            _mm512_permutex2var_epi16(tab[g0], _mm512_or_si512(v[k], sel), tab[g1]));
    }
  }
  if (bad) return 0;
  bfp_accumulate(fp, ct, n, S, o, nq, pf);
  return 1;
}
#endif

/* Direct V accumulation for small blocks (J <= 2 vectors): codes or values
 * are decoded in registers and consumed at once, no L1 round trip.
 * w = P*scale lane; keys with P == 0 add exactly nothing (masked lanes). */
#define VDIRECT_QUANT(BITS, J, EXACT)                                                                 \
  static void vdirect_q##BITS##_##J##_##EXACT(const fmt_plan *fp, const kva_rows *rows, int64_t n,     \
                                    const float *P, float *o, float *ob, const kva_prefetch *pf) {    \
    enum { E = 32 / BITS };                                                                           \
    for (int c = 0; c < fp->nch; ++c) {                                                               \
      __m512 acc[J][E], bacc[J];                                                                      \
      for (int j = 0; j < J; ++j) {                                                                   \
        for (int k = 0; k < E; ++k) acc[j][k] = _mm512_loadu_ps(o + (int64_t)j * fp->P + (c * E + k) * LANES); \
        bacc[j] = _mm512_loadu_ps(ob + ((int64_t)j * fp->nch + c) * LANES);                           \
      }                                                                                               \
      for (int64_t t = 0; t < n; ++t) {                                                               \
        if (pf && c == 0 && t < pf->n) prefetch_row_q(pf, t, KVA_ARR_V);                      \
        __mmask16 pm[J];                                                                              \
        int live = 0;                                                                                 \
        for (int j = 0; j < J; ++j) live |= (pm[j] = P[j * KVA_TILE + t] != 0.0f ? 0xffff : 0) != 0;  \
        if (!live) continue;                                                                          \
        const __m512i x = _mm512_maskz_loadu_epi32(fp->chmask[c], rows[t].v + c * 64);                 \
        __m512 sv = chunk_groups(fp, rows[t].vs, c), bv = chunk_groups(fp, rows[t].vb, c);            \
        const int ex = EXACT || v_scales_nonfinite(sv); /* the exact form (v_scales_nonfinite) */      \
        affine_for(&sv, &bv, BITS, ex);                                                               \
        __m512 w[J];                                                                                  \
        for (int j = 0; j < J; ++j) {                                                                 \
          const __m512 pj = _mm512_set1_ps(P[j * KVA_TILE + t]);                                      \
          w[j] = _mm512_maskz_mul_ps(pm[j], pj, sv);                                                  \
          bacc[j] = _mm512_mask3_fmadd_ps(pj, bv, bacc[j], pm[j]);                                    \
        }                                                                                             \
        for (int k = 0; k < E; ++k) {                                                                 \
          const __m512 code = code_as_float(x, k, BITS, ex);                                          \
          for (int j = 0; j < J; ++j) acc[j][k] = _mm512_fmadd_ps(w[j], code, acc[j][k]);             \
        }                                                                                             \
      }                                                                                               \
      for (int j = 0; j < J; ++j) {                                                                   \
        for (int k = 0; k < E; ++k) _mm512_storeu_ps(o + (int64_t)j * fp->P + (c * E + k) * LANES, acc[j][k]); \
        _mm512_storeu_ps(ob + ((int64_t)j * fp->nch + c) * LANES, bacc[j]);                           \
      }                                                                                               \
    }                                                                                                 \
  }
VDIRECT_QUANT(8, 1, 0)
VDIRECT_QUANT(8, 2, 0)
VDIRECT_QUANT(4, 1, 0)
VDIRECT_QUANT(4, 2, 0)
VDIRECT_QUANT(2, 1, 0)
VDIRECT_QUANT(8, 1, 1)
VDIRECT_QUANT(8, 2, 1)
VDIRECT_QUANT(4, 1, 1)
VDIRECT_QUANT(4, 2, 1)
VDIRECT_QUANT(2, 1, 1)

#define VFB 8 /* vectors of 16 values per pass over the tile (float V) */
/* acc[j][0..NV) += P[j][t] * v_t[d0 .. d0 + 16*NV) over the tile's tokens;
 * split: positions in split order, NV even (full 32-element blocks). */
ALWAYS void vdirect_float_pass(const fmt_plan *fp, const kva_rows *rows, int64_t n, const float *P,
                               float *o, int d0, int J, int NV, int split, const kva_prefetch *pf) {
  const int64_t es = (int64_t)kva_dtype_size(fp->sdt);
  __m512 acc[2][VFB];
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < NV; ++k) acc[j][k] = _mm512_loadu_ps(o + (int64_t)j * fp->P + d0 + k * LANES);
  for (int64_t t = 0; t < n; ++t) {
    if (pf && t < pf->n) prefetch_row(pf, t, KVA_ARR_V, KVA_ARRS);
    __mmask16 pm[2];
    __m512 w[2];
    int live = 0;
    const float vsc = fp->fp8 && rows[t].vs ? *(const float *)rows[t].vs : 1.0f; /* fp8: P times the row's scale */
    for (int j = 0; j < J; ++j) {
      pm[j] = P[j * KVA_TILE + t] != 0.0f ? 0xffff : 0;
      live |= pm[j] != 0;
      w[j] = _mm512_set1_ps(P[j * KVA_TILE + t] * vsc);
    }
    if (!live) continue;
    const char *row = rows[t].v + d0 * es;
    if (split)
      for (int k = 0; k < NV; k += 2) {
        __m512 ve, vo;
        load_bf16_split(row + k * LANES * es, &ve, &vo);
        for (int j = 0; j < J; ++j) {
          acc[j][k] = _mm512_mask3_fmadd_ps(w[j], ve, acc[j][k], pm[j]);
          acc[j][k + 1] = _mm512_mask3_fmadd_ps(w[j], vo, acc[j][k + 1], pm[j]);
        }
      }
    else
      for (int k = 0; k < NV; ++k) {
        const __m512 v = load_f16x(row + k * LANES * es, fp->sdt);
        for (int j = 0; j < J; ++j) acc[j][k] = _mm512_mask3_fmadd_ps(w[j], v, acc[j][k], pm[j]);
      }
  }
  for (int j = 0; j < J; ++j)
    for (int k = 0; k < NV; ++k) _mm512_storeu_ps(o + (int64_t)j * fp->P + d0 + k * LANES, acc[j][k]);
}

#define VDIRECT_FLOAT(J)                                                                              \
  static void vdirect_f_##J(const fmt_plan *fp, const kva_rows *rows, int64_t n,             \
                            const float *P, float *o, const kva_prefetch *pf) {                       \
    int d0 = 0;                                                                                       \
    if (fp->split) {                                                                                  \
      for (; d0 + VFB * LANES <= fp->P; d0 += VFB * LANES, pf = NULL) vdirect_float_pass(fp, rows, n, P, o, d0, J, VFB, 1, pf); \
      for (; d0 + 2 * LANES <= fp->P; d0 += 2 * LANES, pf = NULL) vdirect_float_pass(fp, rows, n, P, o, d0, J, 2, 1, pf); \
    }                                                                                                 \
    for (; d0 + VFB * LANES <= fp->P; d0 += VFB * LANES, pf = NULL) vdirect_float_pass(fp, rows, n, P, o, d0, J, VFB, 0, pf); \
    for (; d0 < fp->P; d0 += LANES, pf = NULL) vdirect_float_pass(fp, rows, n, P, o, d0, J, 1, 0, pf); \
  }
VDIRECT_FLOAT(1)
VDIRECT_FLOAT(2)

/* V phase for one tile: direct for blocks of <= 2 vectors, else via an L1 tile. */
static void vphase_tile(const fmt_plan *fp, const kva_rows *rows, int64_t n, const float *S, float *vt,
                        float *svt, float *bvt, float *o, float *ob, int64_t nq, const kva_prefetch *pf) {
  /* direct in blocks of two vectors up to 4 (codes decoded once per block);
   * q2 takes one vector per block (16 codes per word: too many registers) */
  const int direct = nq == 1 || (nq <= 4 && fp->bits != 2);
#ifdef __AVX512VNNI__
  if (fp->pint && nq < PINT_MIN_VECTORS(fp->bits) && vphase_pint_direct(fp, rows, n, S, svt, bvt, o, ob, nq, pf)) return;
#endif
  if (direct) {
    const int64_t obn = (int64_t)fp->nch * LANES;
    for (int64_t j = 0; j < nq; j += 2) {
      const int two = j + 1 < nq;
      const float *Pj = S + j * KVA_TILE;
      float *oj = o + j * fp->P, *obj = ob + j * obn;
      const kva_prefetch *vpf = j == 0 ? pf : NULL; /* the first block prefetches */
      switch ((fp->bits * 2 + two) * 2 + fp->exact) {
      case 0: case 1: vdirect_f_1(fp, rows, n, Pj, oj, vpf); break;
      case 2: case 3: vdirect_f_2(fp, rows, n, Pj, oj, vpf); break;
      case 8: vdirect_q2_1_0(fp, rows, n, Pj, oj, obj, vpf); break;
      case 9: vdirect_q2_1_1(fp, rows, n, Pj, oj, obj, vpf); break;
      case 16: vdirect_q4_1_0(fp, rows, n, Pj, oj, obj, vpf); break;
      case 17: vdirect_q4_1_1(fp, rows, n, Pj, oj, obj, vpf); break;
      case 18: vdirect_q4_2_0(fp, rows, n, Pj, oj, obj, vpf); break;
      case 19: vdirect_q4_2_1(fp, rows, n, Pj, oj, obj, vpf); break;
      case 32: vdirect_q8_1_0(fp, rows, n, Pj, oj, obj, vpf); break;
      case 33: vdirect_q8_1_1(fp, rows, n, Pj, oj, obj, vpf); break;
      case 34: vdirect_q8_2_0(fp, rows, n, Pj, oj, obj, vpf); break;
      case 35: vdirect_q8_2_1(fp, rows, n, Pj, oj, obj, vpf); break;
      default: break;
      }
    }
    return;
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  if (fp->bfv && vphase_bfv(fp, rows, n, S, vt, svt, bvt, o, nq, pf)) return;
  if (fp->bfp && vphase_bfp(fp, rows, n, S, vt, o, nq, pf)) return;
#endif
#ifdef __AVX512VNNI__
  if (fp->pint && vphase_pint(fp, rows, n, S, vt, svt, bvt, o, ob, nq, pf)) return;
#endif
  const int nonfinite = decode_v_tile(fp, rows, n, vt, svt, bvt, pf);
  vphase(fp, n, S, vt, svt, bvt, o, ob, nq, nonfinite);
}

/* ---- online softmax over a tile (vector exp) ---- */
/* One vector's accumulators o[P] and bias lanes ob[obn] times f. */
ALWAYS void scale_acc(float *o, float *ob, int64_t P, int64_t obn, float f) {
  const __m512 fv = _mm512_set1_ps(f);
  for (int64_t d = 0; d < P; d += LANES) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), fv));
  for (int64_t d = 0; d < obn; d += LANES) _mm512_storeu_ps(ob + d, _mm512_mul_ps(_mm512_loadu_ps(ob + d), fv));
}
/* tile_softmax's update for 16 vectors at once (S, m, l, o, ob at the
 * first): the 16 maxima and the 16 sums each reduced by one shuffle tree
 * (reduce16_op), the old-state factors by one exp512; the scores are
 * read twice (max, then exp). Returns whether any vector saw a key. */
static int softmax16(float *S, __mmask16 m0, __mmask16 m1, float *m, float *l, float *o, float *ob, int64_t P,
                     int64_t obn) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY), one = _mm512_set1_ps(1.0f);
  __m512 t[LANES];
  __mmask16 nan = 0;
  for (int j = 0; j < LANES; ++j) {
    const __m512 a = _mm512_mask_loadu_ps(ninf, m0, S + j * KVA_TILE);
    const __m512 b = _mm512_mask_loadu_ps(ninf, m1, S + j * KVA_TILE + LANES);
    nan |= (__mmask16)((_mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) != 0) << j);
    t[j] = _mm512_max_ps(a, b);
  }
  const __m512 mx = _mm512_mask_mov_ps(reduce16_op(t, 1), nan, _mm512_set1_ps(NAN)), mo = _mm512_loadu_ps(m);
  const __mmask16 seen = _mm512_cmp_ps_mask(mx, ninf, _CMP_NEQ_UQ); /* else nothing visible in this tile */
  /* the loop's new max mn and old-state factor (1 where the max is unchanged) */
  const __mmask16 keep = _mm512_cmp_ps_mask(mo, mx, _CMP_GT_OQ) | _mm512_cmp_ps_mask(mo, mo, _CMP_UNORD_Q);
  const __m512 mn = _mm512_mask_mov_ps(mx, keep, mo);
  const __mmask16 same =
      _mm512_cmp_ps_mask(mn, mo, _CMP_EQ_OQ) & _mm512_cmp_ps_mask(mn, _mm512_set1_ps(INFINITY), _CMP_NEQ_UQ);
  const __m512 aold = _mm512_mask_mov_ps(exp512(_mm512_sub_ps(mo, mn)), same, one);
  for (int j = 0; j < LANES; ++j) {
    float *s = S + j * KVA_TILE;
    if (!(seen >> j & 1)) {
      _mm512_storeu_ps(s, _mm512_setzero_ps());
      _mm512_storeu_ps(s + LANES, _mm512_setzero_ps());
      t[j] = _mm512_setzero_ps();
      continue;
    }
    const __m512 vmn = _mm512_permutexvar_ps(_mm512_set1_epi32(j), mn);
    const __m512 a = exp512(_mm512_sub_ps(_mm512_mask_loadu_ps(ninf, m0, s), vmn));
    const __m512 b = exp512(_mm512_sub_ps(_mm512_mask_loadu_ps(ninf, m1, s + LANES), vmn));
    _mm512_storeu_ps(s, a);
    _mm512_storeu_ps(s + LANES, b);
    t[j] = _mm512_add_ps(a, b);
  }
  _mm512_storeu_ps(l, _mm512_mask_fmadd_ps(_mm512_loadu_ps(l), seen, aold, reduce16_op(t, 0)));
  _mm512_storeu_ps(m, _mm512_mask_mov_ps(mo, seen, mn));
  _Alignas(64) float f[LANES];
  _mm512_store_ps(f, aold);
  for (unsigned r = seen & _mm512_cmp_ps_mask(aold, one, _CMP_NEQ_UQ); r; r &= r - 1) {
    const int j = __builtin_ctz(r);
    scale_acc(o + j * P, ob + j * obn, P, obn, f[j]);
  }
  return seen != 0;
}

/* S[j] <- exp(S[j] - m_j) for the tile's n keys (0 past n), the running max
 * m, sum l and the accumulators o, ob rescaled; blocks of 16 vectors by
 * softmax16. Returns whether any vector saw a key. */
static int tile_softmax(float *S, int64_t n, int64_t nq, float *m, float *l, float *o, float *ob, int64_t P,
                        int64_t obn) {
  int any = 0;
  const __mmask16 m0 = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1u);
  const __mmask16 m1 = n <= 16 ? 0 : n >= 32 ? 0xffff : (__mmask16)((1u << (n - 16)) - 1u);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  int64_t j0 = 0;
  for (; j0 + LANES <= nq; j0 += LANES)
    any |= softmax16(S + j0 * KVA_TILE, m0, m1, m + j0, l + j0, o + j0 * P, ob + j0 * obn, P, obn);
  for (int64_t j = j0; j < nq; ++j) {
    float *s = S + j * KVA_TILE;
    __m512 a = _mm512_mask_loadu_ps(ninf, m0, s), b = _mm512_mask_loadu_ps(ninf, m1, s + 16);
    __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    float mx = nan ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(a, b));
    if (mx == -INFINITY) { /* nothing visible for this vector in this tile */
      _mm512_storeu_ps(s, _mm512_setzero_ps());
      _mm512_storeu_ps(s + 16, _mm512_setzero_ps());
      continue;
    }
    any = 1;
    /* kva_softmax_factors' new max and old-state factor, without its calls
     * where the max did not change: exp(0) = 1 (exp(inf - inf) stays NaN) */
    const float mn = (m[j] > mx || m[j] != m[j]) ? m[j] : mx;
    const float a_old = mn == m[j] && mn != INFINITY ? 1.0f : expf(m[j] - mn);
    const __m512 vmn = _mm512_set1_ps(mn);
    a = exp512(_mm512_sub_ps(a, vmn));
    b = exp512(_mm512_sub_ps(b, vmn));
    _mm512_storeu_ps(s, a);
    _mm512_storeu_ps(s + 16, b);
    m[j] = mn;
    l[j] = l[j] * a_old + _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    if (a_old != 1.0f) scale_acc(o + j * P, ob + j * obn, P, obn, a_old);
  }
  return any;
}

#ifdef __AVX512VNNI__
/* One query as chunk_dots_vnni's s8 bytes and lane factors (at qb) and its
 * lane sums qs = f * sum(c) over each lane's codes (f = scale * sigma_g of
 * the lane's group; 0 for a group whose 1 / sigma is not finite: all zeros,
 * or max|q_g| below ~2^-119, which then adds nothing; NaN for every group of
 * a query with a non-finite element, whose scores are then NaN). */
/* The s8 codes c8 of one query and, per K group, its factor fg and code sum gs. */
static void query_s8_groups(const fmt_plan *fp, int64_t D, const float *q, float scale, int8_t *c8, float *fg, int *gs) {
  int finite = 1;
  for (int64_t d = 0; d < D; ++d) finite &= isfinite(q[d]) != 0;
  for (int g = 0; g < fp->ngroups; ++g)
    fg[g] = finite && fp->G % 32 == 0 ? simd_query_group_s8_32(q, (int64_t)g * fp->G, fp->G, scale, c8, &gs[g])
                                      : simd_query_group_s8(q, (int64_t)g * fp->G, fp->G, finite, scale, c8, &gs[g]);
}
/* The query's s8 codes in word order into qbw (the row's nch * 16 words
 * of E bytes, zero past D): byte i*4 + m of word w = code m*CB + i of the
 * word (CB = 8/bits byte vectors: the nibble / crumb position i of the
 * codes' bytes, as chunk_dots_vnni, kphase_tok and kphase_rl read them), by
 * one in-lane byte shuffle per 64 bytes; the group factors into fg, code
 * sums into gs (query_s8_groups). */
static void query_word_bytes(const fmt_plan *fp, int64_t D, const float *q, float scale, uint8_t *qbw, float *fg,
                             int *gs) {
  _Alignas(64) int8_t c8[KVA_MAX_HEAD_DIM + 256];
  query_s8_groups(fp, D, q, scale, c8, fg, gs);
  const int64_t nbytes = (int64_t)fp->nch * LANES * fp->E;
  memset(c8 + D, 0, (size_t)(nbytes - D));
  if (fp->bits == 8) {
    memcpy(qbw, c8, (size_t)nbytes);
    return;
  }
  const __m512i sh = fp->bits == 4 ? _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15))
                                   : _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  for (int64_t b = 0; b < nbytes; b += 64)
    _mm512_storeu_si512(qbw + b, _mm512_shuffle_epi8(_mm512_load_si512(c8 + b), sh));
}

/* One query as chunk_dots_vnni's s8 bytes and lane factors (at qb) and its
 * lane sums qs = f * sum(c) over each lane's codes (f = scale * sigma_g of
 * the lane's group; 0 for a group whose 1 / sigma is not finite: all zeros,
 * or max|q_g| below ~2^-119, which then adds nothing; NaN for every group of
 * a query with a non-finite element, whose scores are then NaN): byte
 * vector i of chunk c, lane l = dword i of word 16c + l of query_word_bytes
 * (a dword transpose per chunk). */
static void query_int8(const fmt_plan *fp, int64_t D, const float *q, float scale, char *qb, float *qs) {
  _Alignas(64) uint32_t d[MAXCH * LANES * 4];
  float fg[LANES];
  int gs[LANES];
  query_word_bytes(fp, D, q, scale, (uint8_t *)d, fg, gs);
  const int CB = 8 / fp->bits;
  float *f = (float *)(qb + (int64_t)fp->nch * CB * 64);
  const __m512 fgv = _mm512_loadu_ps(fg);
  const __m512i ones = _mm512_set1_epi8(1), iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int c = 0; c < fp->nch; ++c) {
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < CB; ++i) {
      __m512i v;
      if (CB == 1) v = _mm512_load_si512(d + c * LANES);
      else if (CB == 2)
        v = _mm512_permutex2var_epi32(_mm512_load_si512(d + 2 * c * LANES), _mm512_add_epi32(_mm512_slli_epi32(iota, 1), _mm512_set1_epi32(i)),
                                      _mm512_load_si512(d + (2 * c + 1) * LANES));
      else
        v = _mm512_i32gather_epi32(_mm512_add_epi32(_mm512_slli_epi32(iota, 2), _mm512_set1_epi32(4 * c * LANES + i)), d, 4);
      _mm512_storeu_si512(qb + (int64_t)(c * CB + i) * 64, v);
      sum = _mm512_dpbusd_epi32(sum, ones, v);
    }
    const __m512 fl = _mm512_maskz_permutexvar_ps(fp->chmask[c], fp->gidx[c], fgv);
    _mm512_storeu_ps(f + c * LANES, fl);
    _mm512_storeu_ps(qs + c * LANES, _mm512_mul_ps(fl, _mm512_cvtepi32_ps(sum)));
  }
}
#endif

#ifdef __AVX512VNNI__
/* One query as kphase_rl's s8 bytes at qb, [chunk c][i][byte vector b]
 * (64 bytes each; 4 i, CB = 8/bits b): every dword of 128-bit lane L holds
 * dword b of word 16c + 4L + i of query_word_bytes (the bytes m = 0..3 of
 * code m*CB + b of that word; 0 past the row), one dword permute per
 * vector; then at fq the factors f = scale * sigma of the ngroups groups
 * (query_int8's) and their Q = f * sum(c). */
static void query_int8_rl(const fmt_plan *fp, int64_t D, const float *q, float scale, char *qb, float *fq) {
  _Alignas(64) uint32_t d[MAXCH * LANES * 4];
  float fg[LANES];
  int gs[LANES];
  query_word_bytes(fp, D, q, scale, (uint8_t *)d, fg, gs);
  const int CB = 8 / fp->bits;
  const __m512i L4 = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12); /* 4L */
  for (int c = 0; c < fp->nch; ++c)
    for (int i = 0; i < 4; ++i)
      for (int b = 0; b < CB; ++b) {
        const __m512i w = _mm512_add_epi32(L4, _mm512_set1_epi32(i)); /* word 4L + i of the chunk */
        const __m512i v =
            CB == 1 ? _mm512_permutexvar_epi32(w, _mm512_load_si512(d + c * LANES))
                    : _mm512_permutex2var_epi32(_mm512_load_si512(d + 2 * c * LANES),
                                                _mm512_add_epi32(_mm512_slli_epi32(w, 1), _mm512_set1_epi32(b)),
                                                _mm512_load_si512(d + (2 * c + 1) * LANES));
        _mm512_storeu_si512(qb + ((int64_t)(c * 4 + i) * CB + b) * 64, v);
      }
  for (int g = 0; g < fp->ngroups; ++g) {
    fq[g] = fg[g];
    fq[fp->ngroups + g] = fg[g] * (float)gs[g];
  }
}

/* One query as kphase_tok's s8 bytes (word w, byte vector i: the codes of
 * dims w*E + m*CB + i, m = 0..3, one u32: query_word_bytes as it is), then
 * per group f = scale * sigma (query_int8's factor) and Q = f * sum(c) (0
 * past ngroups), at qv. */
static void query_int8_tok(const fmt_plan *fp, int64_t D, const float *q, float scale, float *qv) {
  float fg[LANES];
  int gs[LANES];
  query_word_bytes(fp, D, q, scale, (uint8_t *)qv, fg, gs);
  float *f = qv + (int64_t)fp->nch * LANES * (8 / fp->bits);
  for (int g = 0; g < LANES; ++g) {
    f[g] = g < fp->ngroups ? fg[g] : 0.0f;
    f[LANES + g] = g < fp->ngroups ? fg[g] * (float)gs[g] : 0.0f;
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
/* Whether an item of nq vectors takes kphase_bft: bf16 K rows (D a multiple
 * of 32), bf16 queries, not exact mode. */
static int bft_kind(const kva_rowfmt *kf, const kva_problem *p, int64_t nq) {
  return !kf->bits && kf->dtype == KVA_BF16 && kf->D % 32 == 0 && p->q->dtype == KVA_BF16 && !p->exact &&
         nq >= KBT_MIN_VECTORS;
}
/* Whether it takes vphase_bfp: bf16 V rows (D a multiple of 32), 16-bit
 * queries, not exact mode (q16). */
static int bfp_kind(const kva_rowfmt *vf, int q16, int64_t nq) {
  return !vf->bits && vf->dtype == KVA_BF16 && vf->D % 32 == 0 && q16 && nq >= KBT_MIN_VECTORS;
}
#endif

/* Scratch (floats, 64-byte aligned pieces): qp[nq][Pk], qs[nq][nchk*16],
 * o[nq][Pv], ob[nq][nchv*16], m/l[nq], S[nq][T], vt[T][Pv], svt/bvt[T][nchv*16]. */
static void attend_fast(const kva_item *it) {
  const kva_problem *p = it->p;
  const kva_source *src = it->src;
  const int64_t nrows = it->rows, nq = p->rep * nrows, SF = KVA_STATE_FLOATS(p->Dv);
  fmt_plan kf, vf;
  plan_format(&src->kf, &kf);
  plan_format(&src->vf, &vf);
  kf.exact = vf.exact = p->q->dtype == KVA_F32 || p->exact; /* see code_as_float */
  kf.split = !kf.bits && kf.sdt == KVA_BF16; /* one conversion per 16 values (load_bf16_split) */
  vf.split = !vf.bits && vf.sdt == KVA_BF16;
  const int64_t kqs = (int64_t)kf.nch * LANES, vbn = (int64_t)vf.nch * LANES;
  float *qp = it->scratch, *qs = qp + nq * kf.P, *o = qs + nq * kqs, *ob = o + nq * vf.P;
  float *m = ob + nq * vbn, *l = m + nq, *S = l + nq, *vt = S + nq * KVA_TILE;
  float *svt = vt + KVA_TILE * vf.P, *bvt = svt + KVA_TILE * vbn;
  /* Queries, scaled, in K's permuted order and their per-lane sums per
   * chunk; or, for chunk_dots_vnni, as integer bytes (query_vnni). */
  float qrow[KVA_MAX_HEAD_DIM];
#ifdef __AVX512VNNI__
  kf.vnni = kf.bits && !kf.exact; /* never in exact mode (kf.exact) */
  vf.pint = pint_kind(&src->vf, !vf.exact); /* vphase_pint (vf.exact: f32 queries or exact mode) */
  kf.tok = kf.vnni && nq >= KTOK_MIN_VECTORS;
  kf.rl = kf.vnni && !kf.tok && rl_format(&kf);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  kf.bft = bft_kind(&src->kf, p, nq);
  kf.qscale = p->scale;
  vf.bfp = bfp_kind(&src->vf, !vf.exact, nq);
  vf.bfv = bfv_kind(&src->vf, !vf.exact, nq);
  if (vf.bfv) vf.pint = 0; /* a tile vphase_bfv refuses (non-finite) takes the f32 path */
#endif
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t h = it->hk * p->rep + j / nrows, i = it->i0 + j % nrows;
    m[j] = -INFINITY;
    l[j] = 0.0f;
    load_row_f32(kva_at4(p->q, it->b, h, i, 0), p->q->dtype, p->Dk, qrow);
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
    if (kf.bft) { /* the bf16 row as loaded (qrow holds its exact f32 values) */
      uint16_t *qb = (uint16_t *)(qp + j * kf.P);
      for (int64_t d = 0; d < p->Dk; ++d) {
        uint32_t u;
        memcpy(&u, &qrow[d], 4);
        qb[d] = (uint16_t)(u >> 16);
      }
      continue;
    }
#endif
#ifdef __AVX512VNNI__
    if (kf.tok) {
      query_int8_tok(&kf, p->Dk, qrow, p->scale, qp + j * kf.P);
      continue;
    }
    if (kf.rl) {
      query_int8_rl(&kf, p->Dk, qrow, p->scale, (char *)(qp + j * kf.P), qs + j * kqs);
      continue;
    }
    if (kf.vnni) {
      query_int8(&kf, p->Dk, qrow, p->scale, (char *)(qp + j * kf.P), qs + j * kqs);
      continue;
    }
#endif
    permute_row(&kf, p->Dk, qrow, p->scale, qp + j * kf.P);
    for (int c = 0; c < kf.nch; ++c) {
      __m512 sum = _mm512_setzero_ps();
      for (int k = 0; k < kf.E; ++k) sum = _mm512_add_ps(sum, _mm512_loadu_ps(qp + j * kf.P + (c * kf.E + k) * LANES));
      _mm512_storeu_ps(qs + j * kqs + c * LANES, sum);
    }
  }
  memset(o, 0, sizeof(float) * (size_t)(nq * (vf.P + vbn)));
  const int32_t *seg = simd_segments_row(p, it->b);
  /* Tiles across span (paged block) boundaries; the next tile's rows are
   * prefetched during this tile's K phase (tiles.h, kva_tiles). */
  kva_tiles tl;
  tiles_init(&tl, it);
  const kva_rows *rows;
  int64_t tf, n;
  while ((rows = tiles_next(&tl, &tf, &n))) {
    kphase(&kf, rows, n, qp, qs, nq, S, &tl.pf);
    if (p->softcap > 0.0f) simd_softcap(S, nq, KVA_TILE, n, p->softcap);
    simd_mask_tile(it, seg, S, nq, tf, n);
    /* Masked keys have P == 0 exactly; a NaN V row behind a mask must not leak. */
    if (tile_softmax(S, n, nq, m, l, o, ob, vf.P, vbn)) vphase_tile(&vf, rows, n, S, vt, svt, bvt, o, ob, nq, &tl.pf);
  }
  /* Back to element order, bias lanes added: the kva_softmax_state layout. */
  for (int64_t j = 0; j < nq; ++j) {
    float *st = it->state + j * SF;
    st[0] = m[j];
    st[1] = l[j];
    unpermute_row(&vf, p->Dv, o + j * vf.P, vf.bits ? ob + j * vbn : NULL, st + 2);
  }
}

static int fast_format_ok(const kva_rowfmt *f) {
  if (f->bits) return f->D * f->bits / 32 <= (int64_t)MAXCH * LANES && f->D / f->group <= LANES;
  return f->D % LANES == 0;
}

kva_item_fn KFN(select_fast)(const kva_problem *p) {
  kva_rowfmt kf, vf;
  simd_rowfmts(p, &kf, &vf);
  if (p->path != KVA_PATH_FUSED || !fast_format_ok(&kf) || !fast_format_ok(&vf)) return NULL;
  kva_item_fn amx = p->exact ? NULL : KFN(select_amx)(p, &kf, &vf); /* AMX rounds P to bf16 */
  return amx ? amx : attend_fast;
}

/* The name with its roundings in brackets (kvattn.h, kva_attention_kernel):
 * the AMX kernel rounds float K and V rows to bf16 where they are not bf16
 * already (quantized rows: exact codes) and P always (times the V group
 * scale for quantized V); the vector kernel multiplies in f32, with quantized
 * K and 16-bit queries on integer dot products (q rounded to s8 per
 * vector and K group, chunk_dots_vnni) except in exact mode (p->exact: f32 products only), and
 * for 4-bit / 8-bit V in groups of a multiple of 8 code words P times the V
 * scale on s16 (vphase_pint, vphase_pint_direct), for 4-bit V with >= BFV_MIN_VECTORS V and P on bf16
 * (vphase_bfv); for bf16 V with 16-bit queries and >= KBT_MIN_VECTORS
 * vectors P on bf16 (vphase_bfp; bf16 K with bf16 queries: exact products on bf16
 * pairs, kphase_bft, no item). */
const char *KFN(fast_name)(const kva_problem *p) {
  const kva_item_fn f = KFN(select_fast)(p);
  if (!f) return NULL;
  if (f == attend_fast) {
#ifdef __AVX512VNNI__
    kva_rowfmt kr, vr;
    simd_rowfmts(p, &kr, &vr);
    /* the first row group's vectors, or at least 16 of them: every bar below is at most 16 */
    const int64_t nq = p->rep * (p->L < KVA_MAX_FUSED_ROWS ? p->L : KVA_MAX_FUSED_ROWS);
    const int q16 = p->q->dtype != KVA_F32 && !p->exact;
    const int pint = pint_kind(&vr, q16) != 0;
#ifdef __AVX512BF16__
    if (bfp_kind(&vr, q16, nq)) return q16 && kr.bits ? "fused kernel [q int8, P bf16]" : "fused kernel [P bf16]";
    if (bfv_kind(&vr, q16, nq)) return kr.bits ? "fused kernel [q int8, V,P bf16]" : "fused kernel [V,P bf16]";
#endif
    if (q16 && kr.bits) return pint ? "fused kernel [q int8, P int16]" : "fused kernel [q int8]";
    if (pint) return "fused kernel [P int16]";
#endif
    return "fused kernel [exact f32]";
  }
  /* exact on the tiles: bf16 rows and quantized codes (their scales applied in f32) */
  const int kx = p->kv->k.bits || p->kv->k.data.dtype == KVA_BF16, vx = p->kv->v.bits || p->kv->v.data.dtype == KVA_BF16;
  return kx && vx ? "AMX kernel (bf16 tiles) [P bf16]"
         : kx     ? "AMX kernel (bf16 tiles) [V,P bf16]"
         : vx     ? "AMX kernel (bf16 tiles) [K,P bf16]"
                  : "AMX kernel (bf16 tiles) [K,V,P bf16]";
}

#endif
