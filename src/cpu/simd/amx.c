/* The multi-vector kernel on AMX tiles: bf16 queries with >= AMX_MIN_NQ
 * vectors per KV head (speculative verify rows, GQA >= 6).
 * Math: per tile of 32 keys and per block of 16 query vectors,
 *   Sᵀ[16 keys × 16 q] = K[16 keys × Dk] · Qᵀ (tdpbf16ps over Dk/32 steps),
 *   online softmax with the queries in vector lanes (vector exp),
 *   O[16 q × Dv] += P[16 q × 32 keys] · V[32 keys × Dv] (one tdpbf16ps per
 *   16 output dims). K and V are dequantized (or converted) to bf16 tiles and
 *   P is rounded to bf16: bf16 products, f32 accumulation, as tensor-core
 *   kernels do; so this path is taken only when q itself is bf16. A masked
 *   key's V row is multiplied by P = 0 in the tile product, so a NaN stored
 *   in it would reach the output (the vector kernels skip masked keys).
 * Traffic: each K/V row of the item's range is read once for all nq vectors;
 *   the bf16 K/V tiles (32 rows) and the f32 O block stay in L1/L2.
 * Geometry: tmm0 = accumulator (16×16 f32), tmm1 = A (16×32 bf16),
 *   tmm2 = B (16 pair-rows × 16 dwords); configured once per item. */
#include "cpu/simd/simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) &&               \
    defined(__AMX_BF16__) && defined(__linux__)
#include "cpu/simd/avx512.h"

#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#define QT 16          /* query vectors per AMX block */
#define KT 16          /* keys per QK tile */
#define AMX_MIN_NQ 6 /* measured crossover: below it the f32 vector kernel is faster (and exact in f32) */
#define AMX_MAX_P 2048 /* longest permuted row (bf16 elements) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct tile_config {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* AMX needs the CPU feature and the kernel's permission to use tile state. */
static int amx_usable(void) {
  static atomic_int state; /* 0 unknown, 1 yes, -1 no */
  int s = atomic_load(&state);
  if (s) return s > 0;
  unsigned a, b, c, d;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  int ok = (d >> 24 & 1) && (d >> 22 & 1); /* AMX-TILE, AMX-BF16 */
  if (ok) ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  atomic_store(&state, ok ? 1 : -1);
  return ok;
}

/* One quantized row, dequantized in the format's permuted order, as bf16
 * into dst[P]; bits is a constant after inlining. */
ALWAYS void qrow_to_bf16(const fmt_plan *fp, const char *row, const char *sc, const char *bi, uint16_t *dst, int bits) {
  const int E = 32 / bits;
  const __m512 Sv = load_groups(sc, fp->sdt, fp->ngroups), Bv = load_groups(bi, fp->sdt, fp->ngroups);
  for (int c = 0; c < fp->nch; ++c) {
    const __m512i x = _mm512_maskz_loadu_epi32(fp->chmask[c], row + c * 64);
    __m512 sv = _mm512_permutexvar_ps(fp->gidx[c], Sv), bv = _mm512_permutexvar_ps(fp->gidx[c], Bv);
    affine_f(&sv, &bv, bits);
    for (int k = 0; k < E; k += 2) {
      const __m512 a = _mm512_fmadd_ps(code_f(x, k, bits), sv, bv);
      const __m512 b = _mm512_fmadd_ps(code_f(x, k + 1, bits), sv, bv);
      _mm512_storeu_si512(dst + (int64_t)(c * E + k) * LANES, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

/* One row of values (dequantized or converted) in the format's permuted
 * order, as bf16 into dst[P]. */
static inline void row_to_bf16(const fmt_plan *fp, const char *row, const char *sc, const char *bi, uint16_t *dst) {
  switch (fp->bits) {
  case 2: qrow_to_bf16(fp, row, sc, bi, dst, 2); return;
  case 4: qrow_to_bf16(fp, row, sc, bi, dst, 4); return;
  case 8: qrow_to_bf16(fp, row, sc, bi, dst, 8); return;
  default: break;
  }
  if (fp->sdt == KVA_BF16) { /* already bf16: a copy */
    memcpy(dst, row, sizeof(uint16_t) * (size_t)fp->P);
    return;
  }
  const int64_t es = (int64_t)kva_dtype_size(fp->sdt);
  for (int d = 0; d < fp->P; d += 2 * LANES) {
    const __m512 a = load_f16x(row + d * es, fp->sdt), b = load_f16x(row + (d + LANES) * es, fp->sdt);
    _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
}

/* Two rows a, b (NULL: a zero row) of a quantized V, dequantized in the
 * format's permuted order and interleaved as a token pair for the B tiles:
 * dword l of block i (permuted positions 16i..16i+15) = (a[16i+l],
 * b[16i+l]) as bf16, stored at vp + i*16*32 (vp: this pair's row of block 0).
 * The same values as row_to_bf16 of each row (f32 FMA, one rounding to
 * bf16), without the round trip through two row buffers; bits is a
 * constant after inlining. */
ALWAYS void qpair_to_vp(const fmt_plan *fp, const kva_rows *a, const kva_rows *b, uint16_t *vp, __m512i interleave,
                        int bits) {
  const int E = 32 / bits;
  const __m512 Sa = load_groups(a->vs, fp->sdt, fp->ngroups), Ba = load_groups(a->vb, fp->sdt, fp->ngroups);
  const __m512 Sb = b ? load_groups(b->vs, fp->sdt, fp->ngroups) : _mm512_setzero_ps();
  const __m512 Bb = b ? load_groups(b->vb, fp->sdt, fp->ngroups) : _mm512_setzero_ps();
  for (int c = 0; c < fp->nch; ++c) {
    const __m512i xa = _mm512_maskz_loadu_epi32(fp->chmask[c], a->v + c * 64);
    const __m512i xb = b ? _mm512_maskz_loadu_epi32(fp->chmask[c], b->v + c * 64) : _mm512_setzero_si512();
    __m512 sa = _mm512_permutexvar_ps(fp->gidx[c], Sa), ba = _mm512_permutexvar_ps(fp->gidx[c], Ba);
    __m512 sb = _mm512_permutexvar_ps(fp->gidx[c], Sb), bb = _mm512_permutexvar_ps(fp->gidx[c], Bb);
    affine_f(&sa, &ba, bits);
    affine_f(&sb, &bb, bits); /* a zero row: s = b = 0, so every value is 0 */
    for (int k = 0; k < E; ++k) {
      const __m512 va = _mm512_fmadd_ps(code_f(xa, k, bits), sa, ba);
      const __m512 vb = _mm512_fmadd_ps(code_f(xb, k, bits), sb, bb);
      _mm512_storeu_si512(vp + (int64_t)(c * E + k) * 16 * 32,
                          _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(vb, va)));
    }
  }
}

/* In-register transpose of a 16×16 matrix of dwords (rows r[0..15]). */
static inline void transpose16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

/* P [16 q][32 keys] bf16 from Pᵀ [32 keys][16 q] f32: dword i of row q is
 * (P[q][2i], P[q][2i+1]) = keys 2i, 2i+1 of query q, i.e. rows 2i, 2i+1 of
 * Pᵀ interleaved; a 16×16 dword transpose then gives the rows of P. */
static inline void pt_to_p_bf16(const float *st, uint16_t *pb, __m512i interleave) {
  __m512i d[16];
  for (int i = 0; i < 16; ++i) {
    const __m512i two =
        (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(st + (2 * i + 1) * QT), _mm512_loadu_ps(st + 2 * i * QT));
    d[i] = _mm512_permutexvar_epi16(interleave, two);
  }
  transpose16_epi32(d);
  for (int q = 0; q < 16; ++q)
    _mm512_storeu_si512(pb + q * KVA_TILE, d[q]);
}

/* Scratch layout (bytes, 64-aligned): qt[nqt][Dk/32][16 rows][64 B] | kb[32][Pk] bf16 |
 * vp[Pv/16][16 pair rows][64 B] | o[nqp][Pv] f32 | st[32][16] f32 | pb[16][32] bf16 | m, l [nqp]. */
static void attend_amx(const kva_item *it) {
  const kva_problem *p = it->p;
  const kva_source *src = it->src;
  const int64_t rows = it->rows, nq = p->rep * rows, nqt = (nq + QT - 1) / QT, nqp = nqt * QT;
  const int64_t SF = KVA_STATE_FLOATS(p->Dv);
  fmt_plan kf, vf;
  plan_format(&src->kf, &kf);
  plan_format(&src->vf, &vf);
  const int ksteps = kf.P / 32, vblocks = vf.P / 16;
  char *base = (char *)it->scratch;
  uint16_t *qt = (uint16_t *)base;
  uint16_t *kb = qt + nqt * ksteps * 16 * 32;
  uint16_t *vp = kb + KVA_TILE * kf.P;
  float *o = (float *)(vp + (int64_t)vblocks * 16 * 32);
  float *st = o + nqp * vf.P, *m = st + KVA_TILE * QT, *l = m + nqp;
  uint16_t *pb = (uint16_t *)(l + nqp);
  /* Qᵀ in VNNI pairs: qt[blk][s][kk][q] = (q[2kk], q[2kk+1]) of dims 32s.., permuted like K. */
  float qrow[KVA_MAX_HEAD_DIM], qperm[AMX_MAX_P];
  uint32_t qpair[AMX_MAX_P / 2] __attribute__((aligned(64))), *qt32 = (uint32_t *)qt;
  for (int64_t j = 0; j < nqp; ++j) {
    const int64_t blk = j / QT, q = j % QT;
    if (j < nq) {
      const int64_t h = it->hk * p->rep + j / rows, i = it->i0 + j % rows;
      load_row_f32(kva_at4(p->q, it->b, h, i, 0), p->q->dtype, p->Dk, qrow);
      permute_row(&kf, p->Dk, qrow, p->scale, qperm);
    } else {
      memset(qperm, 0, sizeof(float) * (size_t)kf.P);
    }
    /* bf16 pair w = positions (2w, 2w+1) = dword kk = w % 16 of step s = w / 16;
     * vcvtne2ps2bf16 rounds to nearest even like kva_f32_to_bf16 (denormals
     * become zero, as in the K tiles and the tile products) */
    for (int64_t d = 0; d < kf.P; d += 32)
      _mm512_storeu_si512(qpair + d / 2,
                          (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qperm + d + 16), _mm512_loadu_ps(qperm + d)));
    for (int64_t w = 0; w < kf.P / 2; ++w) qt32[(blk * ksteps * 16 + w) * 16 + q] = qpair[w];
    m[j] = -INFINITY;
    l[j] = 0.0f;
  }
  memset(o, 0, sizeof(float) * (size_t)(nqp * vf.P));
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 3; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const int32_t *seg = simd_segments_row(p, it->b);
  const int64_t pos0 = it->len - p->L, pmin = pos0 + it->i0, pmax = pmin + rows - 1;
  const int32_t win = p->mask.window;
  const __m512i pair_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                           37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i pair_hi = _mm512_add_epi16(pair_lo, _mm512_set1_epi16(16));
  /* word 2q <- word q, word 2q+1 <- word 16+q (one source) */
  const __m512i halves_interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                                     7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  /* Tiles of 32 tokens across span (paged block) boundaries; the next
   * tile's K rows are prefetched (into L2) one per K row converted, its V
   * rows one per V row (tiles.h, kva_tiles). */
  kva_tiles tl;
  tiles_init(&tl, it);
  const kva_rows *trow;
  int64_t tf, n;
  while ((trow = tiles_next(&tl, &tf, &n))) {
    /* bf16 K rows (zero rows past n), and V as token pairs interleaved per 16 dims. */
    for (int64_t r = 0; r < KVA_TILE; ++r) {
      if (r < tl.pf.n) prefetch_row(&tl.pf, r, KVA_ARR_K, KVA_ARR_V);
      if (r < n) {
        row_to_bf16(&kf, trow[r].k, trow[r].ks, trow[r].kb, kb + r * kf.P);
      } else {
        memset(kb + r * kf.P, 0, sizeof(uint16_t) * (size_t)kf.P);
      }
    }
    for (int64_t r = 0; r < KVA_TILE; r += 2) {
      for (int64_t u = r; u < r + 2 && u < tl.pf.n; ++u) prefetch_row(&tl.pf, u, KVA_ARR_V, KVA_ARRS);
      if (vf.bits && r < n) { /* quantized: dequantized straight into pairs */
        const kva_rows *rb = r + 1 < n ? &trow[r + 1] : NULL;
        switch (vf.bits) {
        case 2: qpair_to_vp(&vf, &trow[r], rb, vp + r / 2 * 32, halves_interleave, 2); break;
        case 4: qpair_to_vp(&vf, &trow[r], rb, vp + r / 2 * 32, halves_interleave, 4); break;
        default: qpair_to_vp(&vf, &trow[r], rb, vp + r / 2 * 32, halves_interleave, 8); break;
        }
        continue;
      }
      uint16_t va[AMX_MAX_P] __attribute__((aligned(64))), vb2[AMX_MAX_P] __attribute__((aligned(64)));
      if (r < n) {
        row_to_bf16(&vf, trow[r].v, trow[r].vs, trow[r].vb, va);
      } else {
        memset(va, 0, sizeof(uint16_t) * (size_t)vf.P);
      }
      if (r + 1 < n) {
        row_to_bf16(&vf, trow[r + 1].v, trow[r + 1].vs, trow[r + 1].vb, vb2);
      } else {
        memset(vb2, 0, sizeof(uint16_t) * (size_t)vf.P);
      }
      for (int d = 0; d < vf.P; d += 32) {
        const __m512i a = _mm512_loadu_si512(va + d), b = _mm512_loadu_si512(vb2 + d);
        _mm512_storeu_si512(vp + ((int64_t)(d / 16) * 16 + r / 2) * 32, _mm512_permutex2var_epi16(a, pair_lo, b));
        _mm512_storeu_si512(vp + ((int64_t)(d / 16 + 1) * 16 + r / 2) * 32, _mm512_permutex2var_epi16(a, pair_hi, b));
      }
    }
    const int full = p->mask.kind != KVA_MASK_CAUSAL || simd_tile_all_visible(tf, n, pmin, pmax, win);
    for (int64_t blk = 0; blk < nqt; ++blk) {
      /* Sᵀ for 32 keys: two 16-key halves. */
      for (int half = 0; half < 2; ++half) {
        _tile_zero(0);
        for (int s = 0; s < ksteps; ++s) {
          _tile_loadd(1, kb + (half * KT) * kf.P + s * 32, kf.P * 2);
          _tile_loadd(2, qt + ((blk * ksteps + s) * 16) * 32, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, st + half * KT * QT, QT * 4);
      }
      /* softcap, mask, online softmax with queries in lanes */
      if (p->softcap > 0.0f) simd_softcap(st, KVA_TILE, QT, QT, p->softcap);
      for (int64_t r = n; r < KVA_TILE; ++r)
        _mm512_storeu_ps(st + r * QT, _mm512_set1_ps(-INFINITY));
      if (!full)
        for (int64_t r = 0; r < n; ++r)
          for (int q = 0; q < QT; ++q) {
            const int64_t j = blk * QT + q;
            if (j < nq && !kva_causal_visible(tf + r, pos0 + it->i0 + j % rows, win, seg, p->mask.segments_clamp))
              st[r * QT + q] = -INFINITY;
          }
      __m512 mx = _mm512_set1_ps(-INFINITY);
      __mmask16 nan = 0;
      for (int r = 0; r < KVA_TILE; ++r) {
        const __m512 x = _mm512_loadu_ps(st + r * QT);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, x);
      }
      const __m512 mold = _mm512_loadu_ps(m + blk * QT);
      nan |= _mm512_cmp_ps_mask(mold, mold, _CMP_UNORD_Q);
      __m512 mnew = _mm512_mask_mov_ps(_mm512_max_ps(mold, mx), nan, _mm512_set1_ps(NAN));
      const __mmask16 seen = _mm512_cmp_ps_mask(mnew, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
      const __m512 corr = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(mold, mnew)));
      __m512 lsum = _mm512_setzero_ps();
      for (int r = 0; r < KVA_TILE; r += 2) {
        const __m512 e0 = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(_mm512_loadu_ps(st + r * QT), mnew)));
        const __m512 e1 = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(_mm512_loadu_ps(st + (r + 1) * QT), mnew)));
        lsum = _mm512_add_ps(lsum, _mm512_add_ps(e0, e1));
        _mm512_storeu_ps(st + r * QT, e0);
        _mm512_storeu_ps(st + (r + 1) * QT, e1);
      }
      _mm512_storeu_ps(m + blk * QT, _mm512_mask_mov_ps(mnew, ~seen, mold));
      _mm512_storeu_ps(l + blk * QT, _mm512_fmadd_ps(_mm512_loadu_ps(l + blk * QT), corr, lsum));
      /* rescale O rows whose max moved */
      float cf[QT];
      _mm512_storeu_ps(cf, corr);
      for (int q = 0; q < QT; ++q)
        if (cf[q] != 1.0f) {
          float *orow = o + (blk * QT + q) * vf.P;
          const __m512 f = _mm512_set1_ps(cf[q]);
          for (int d = 0; d < vf.P; d += LANES)
            _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), f));
        }
      /* P (16 q × 32 keys) as bf16 rows */
      pt_to_p_bf16(st, pb, halves_interleave);
      _tile_loadd(1, pb, 64);
      for (int vb = 0; vb < vblocks; ++vb) {
        _tile_loadd(0, o + blk * QT * vf.P + vb * 16, vf.P * 4);
        _tile_loadd(2, vp + (int64_t)vb * 16 * 32, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, o + blk * QT * vf.P + vb * 16, vf.P * 4);
      }
    }
  }
  _tile_release();
  for (int64_t j = 0; j < nq; ++j) {
    float *s = it->state + j * SF;
    s[0] = m[j];
    s[1] = l[j];
    unpermute_row(&vf, p->Dv, o + j * vf.P, NULL, s + 2);
  }
}

kva_item_fn KFN(select_amx)(const kva_problem *p, const kva_rowfmt *kf, const kva_rowfmt *vf) {
  if (p->q->dtype != KVA_BF16 || p->rep * p->L < AMX_MIN_NQ || !amx_usable()) return NULL;
  fmt_plan k, v;
  plan_format(kf, &k);
  plan_format(vf, &v);
  if (k.P % 32 || v.P % 32 || v.P > AMX_MAX_P || k.P > AMX_MAX_P) return NULL;
  return attend_amx;
}

#else
kva_item_fn KFN(select_amx)(const kva_problem *p, const kva_rowfmt *kf, const kva_rowfmt *vf) {
  (void)p;
  (void)kf;
  (void)vf;
  return NULL;
}
#endif
