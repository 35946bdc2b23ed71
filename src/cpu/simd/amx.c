/* The multi-vector kernel on AMX tiles: bf16 queries with >= AMX_MIN_NQ
 * vectors per KV head over float rows, >= AMX_MIN_NQ_INT over 4-bit and
 * 8-bit rows that the vector kernel takes in integers (speculative verify
 * rows, wide GQA).
 * Math: per tile of 32 keys and per block of 16 query vectors (q exact:
 * bf16 in memory, the logit scale applied in f32 after the products),
 *   Sᵀ[16 keys × 16 q] = K[16 keys × Dk] · Qᵀ (tdpbf16ps, 32 dims a step):
 *     float K rows as bf16 (exact for bf16 rows); quantized K as its integer
 *     codes (exact in bf16), one tile product per group g, combined in f32:
 *     s = scale · Σ_g (s_g · (q_g · c_g) + b_g · Σ q_g);
 *   online softmax with the queries in vector lanes (vector exp);
 *   O[16 q × Dv] += W[16 q × 32 keys] · V[32 keys × Dv] (one tdpbf16ps per
 *     16 output dims): float V rows as bf16 with W = P rounded to bf16;
 *     quantized V as its centered codes c - 2^(bits-1) (exact) with W =
 *     P·s_g rounded to bf16 per group, and Σ_t p_t·(b_g + 2^(bits-1) s_g)
 *     per (vector, group) in f32, added on output: W's rounding multiplies
 *     values of about the dequantized value's size (rows with a non-finite
 *     scale or bias keep c and b_g).
 *   A masked key's weight is exactly 0 and its quantized scale and bias are
 *   never multiplied; a tile whose float V rows hold a NaN/Inf in a key that
 *   some vector does not see takes P·V in f32 vector FMAs over the keys each
 *   vector sees, so such a value reaches only the rows that see it.
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
/* Measured crossovers (query vectors per KV head): float rows from 6 (below,
 * the f32 vector kernel is faster); 4-bit rows in groups of a multiple of
 * 64 and 8-bit rows of 32 (K and V) from 16 (below,
 * the AVX-512 level's integer-query kernel is faster: Xeon, 16 threads,
 * 32k, q4 at 6 / 8 / 12 vectors 1.6x / 1.7x / 1.45x, q8 at 6 / 12 1.3x /
 * 1.05x; at 16 AMX 1.08x faster, at 32 1.16x). -D for A/B builds. */
#ifndef AMX_MIN_NQ
#define AMX_MIN_NQ 6
#endif
#ifndef AMX_MIN_NQ_INT
#define AMX_MIN_NQ_INT 16
#endif
#define AMX_MAX_D 512  /* longest row (head dim) */
#define MAXG 16        /* groups per quantized row: 512 dims / 32 */
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

/* A row format. Quantized rows are read 32 dims (one tile step, inside one
 * group) at a time as two vectors of 16 codes, in the step order of the
 * format: 8-bit and 2-bit rows in natural order, 4-bit rows the 16 even
 * dims, then the 16 odd ones (one byte per lane: low and high nibble). The
 * query follows the same order (K) and the output is put back (V). */
typedef struct amx_fmt {
  int bits, G, ngroups;
  int64_t D;
  kva_dtype dt; /* float rows: element dtype; quantized: scales' and biases' dtype */
} amx_fmt;

static void amx_plan(const kva_rowfmt *f, amx_fmt *a) {
  memset(a, 0, sizeof *a);
  a->bits = f->bits;
  a->D = f->D;
  a->dt = f->bits ? f->sdtype : f->dtype;
  if (!f->bits) return;
  a->G = f->group;
  a->ngroups = (int)(f->D / f->group);
}

/* Position of dim d in the step order. */
static inline int64_t step_pos(const amx_fmt *a, int64_t d) {
  if (a->bits != 4) return d;
  const int64_t e = d % 32;
  return d - e + (e % 2) * 16 + e / 2;
}

/* The codes of dims [32s, 32s + 32) of a quantized row as exact f32
 * integers: positions 0..15 of the step order in lo, 16..31 in hi. */
ALWAYS void codes32(int bits, const char *row, int64_t s, __m512 *lo, __m512 *hi) {
  if (bits == 8) { /* one byte per code */
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + s * 32))));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + s * 32 + 16))));
  } else if (bits == 4) { /* byte i: dims 2i (low nibble), 2i + 1 */
    const __m512i y = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + s * 16)));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(y, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(y, 4));
  } else { /* 2 bits: word 0 holds dims 0..15, word 1 dims 16..31 */
    uint32_t w[2];
    memcpy(w, row + s * 8, sizeof w);
    const __m512i sh = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0), m3 = _mm512_set1_epi32(3);
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)w[0]), sh), m3));
    *hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)w[1]), sh), m3));
  }
}

/* A K row as bf16 dst[D]: the codes of a quantized row in the step order
 * (exact), or the float row rounded to bf16 (a copy for bf16 rows). */
ALWAYS void krow_to_bf16(const amx_fmt *a, const char *row, uint16_t *dst, int bits) {
  if (!bits) {
    if (a->dt == KVA_BF16) {
      memcpy(dst, row, sizeof(uint16_t) * (size_t)a->D);
      return;
    }
    const int64_t es = (int64_t)kva_dtype_size(a->dt);
    for (int64_t d = 0; d < a->D; d += 2 * LANES) {
      const __m512 lo = load_f16x(row + d * es, a->dt), hi = load_f16x(row + (d + LANES) * es, a->dt);
      _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    return;
  }
  for (int64_t s = 0; s < a->D / 32; ++s) {
    __m512 lo, hi;
    codes32(bits, row, s, &lo, &hi);
    _mm512_storeu_si512(dst + s * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

/* The codes of two quantized V rows ra, rb (NULL: zeros) less their
 * offsets oa, ob (exact: |c - o| <= 2^bits) as the token pair of the B
 * tiles: dword l of block vb = (ra's code at step position 16vb+l, rb's),
 * at vp + vb*16*32 (vp: this pair's row of block 0). */
ALWAYS void vcodes_pair(const amx_fmt *a, const char *ra, const char *rb, float oa, float ob, uint16_t *vp,
                        __m512i interleave, int bits) {
  const __m512 va = _mm512_set1_ps(oa), vb = _mm512_set1_ps(ob);
  for (int64_t s = 0; s < a->D / 32; ++s) {
    __m512 alo, ahi, blo = _mm512_setzero_ps(), bhi = _mm512_setzero_ps();
    codes32(bits, ra, s, &alo, &ahi);
    alo = _mm512_sub_ps(alo, va);
    ahi = _mm512_sub_ps(ahi, va);
    if (rb) {
      codes32(bits, rb, s, &blo, &bhi);
      blo = _mm512_sub_ps(blo, vb);
      bhi = _mm512_sub_ps(bhi, vb);
    }
    _mm512_storeu_si512(vp + (2 * s) * 16 * 32, _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(blo, alo)));
    _mm512_storeu_si512(vp + (2 * s + 1) * 16 * 32,
                        _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(bhi, ahi)));
  }
}
static inline void krow_any(const amx_fmt *a, const char *row, uint16_t *dst) {
  switch (a->bits) {
  case 2: krow_to_bf16(a, row, dst, 2); return;
  case 4: krow_to_bf16(a, row, dst, 4); return;
  case 8: krow_to_bf16(a, row, dst, 8); return;
  default: krow_to_bf16(a, row, dst, 0); return;
  }
}
static inline void vpair_any(const amx_fmt *a, const char *ra, const char *rb, float oa, float ob, uint16_t *vp,
                             __m512i interleave) {
  switch (a->bits) {
  case 2: vcodes_pair(a, ra, rb, oa, ob, vp, interleave, 2); return;
  case 4: vcodes_pair(a, ra, rb, oa, ob, vp, interleave, 4); return;
  default: vcodes_pair(a, ra, rb, oa, ob, vp, interleave, 8); return;
  }
}

/* Does bf16 x[n] (n a multiple of 32) hold a NaN or an Inf? */
static inline int bf16_nonfinite(const uint16_t *x, int64_t n) {
  const __m512i e = _mm512_set1_epi16(0x7f80);
  __mmask32 m = 0;
  for (int64_t d = 0; d < n; d += 32) m |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(_mm512_loadu_si512(x + d), e), e);
  return m != 0;
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

/* P [16 q][32 keys] f32 from Pᵀ [32 keys][16 q] (two 16×16 transposes):
 * pq[2q] = keys 0..15 of query q, pq[2q + 1] = keys 16..31. */
static inline void transpose_p(const float *st, __m512 pq[32]) {
  __m512i d[16];
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 16; ++i) d[i] = _mm512_castps_si512(_mm512_loadu_ps(st + (h * 16 + i) * QT));
    transpose16_epi32(d);
    for (int q = 0; q < 16; ++q) pq[2 * q + h] = _mm512_castsi512_ps(d[q]);
  }
}

/* One 16-query block's O[16 q][16 dims] tiles vb0..vb1-1 += W (wb, tmm1) · V pairs. */
static inline void pv_tiles(float *oblk, int64_t Dv, const uint16_t *vp, const uint16_t *wb, int vb0, int vb1) {
  _tile_loadd(1, wb, 64);
  for (int vb = vb0; vb < vb1; ++vb) {
    _tile_loadd(0, oblk + vb * 16, Dv * 4);
    _tile_loadd(2, vp + (int64_t)vb * 16 * 32, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, oblk + vb * 16, Dv * 4);
  }
}

/* Scratch layout (floats; every part a multiple of 64 bytes):
 * qt[nqt][Dk/32][16 rows][32 bf16] | kb[32][Dk] bf16 | vp[Dv/16][16 pair rows][32 bf16] |
 * o[nqp][Dv] | st[32][16] | m, l [nqp] | qs, bacc [nqt][MAXG][16] |
 * K scales, K biases, V biases of the tile's rows [32][MAXG], V scales [MAXG][32] |
 * tmp[16][16] | w[16][32] bf16. kva_cpu_scratch_floats (src/cpu/attend.c) sizes it. */
static void attend_amx(const kva_item *it) {
  const kva_problem *p = it->p;
  const kva_source *src = it->src;
  const int64_t rows = it->rows, nq = p->rep * rows, nqt = (nq + QT - 1) / QT, nqp = nqt * QT;
  const int64_t SF = KVA_STATE_FLOATS(p->Dv), Dk = p->Dk, Dv = p->Dv;
  amx_fmt kf, vf;
  amx_plan(&src->kf, &kf);
  amx_plan(&src->vf, &vf);
  const int ksteps = (int)(Dk / 32), vblocks = (int)(Dv / 16);
  const float vcenter = vf.bits ? (float)(1 << (vf.bits - 1)) : 0.0f;
  uint16_t *qt = (uint16_t *)it->scratch;
  uint16_t *kb = qt + nqt * ksteps * 16 * 32;
  uint16_t *vp = kb + KVA_TILE * Dk;
  float *o = (float *)(vp + (int64_t)vblocks * 16 * 32);
  float *st = o + nqp * Dv, *m = st + KVA_TILE * QT, *l = m + nqp;
  float *qs = l + nqp, *bacc = qs + nqt * MAXG * QT;
  float *ksf = bacc + nqt * MAXG * QT, *kbf = ksf + KVA_TILE * MAXG, *vbf = kbf + KVA_TILE * MAXG,
        *vst = vbf + KVA_TILE * MAXG, *tmp = vst + KVA_TILE * MAXG;
  uint16_t *wb = (uint16_t *)(tmp + KT * QT);
  /* Qᵀ in VNNI pairs, in K's step order: qt[blk][s][kk][q] = (q at step
   * positions 2kk, 2kk+1 of dims 32s..); qs[blk][g][q] = Σ_{d in g} q[d]. */
  uint16_t qperm[AMX_MAX_D] __attribute__((aligned(64)));
  uint32_t *qt32 = (uint32_t *)qt;
  memset(qs, 0, sizeof(float) * (size_t)(nqt * MAXG * QT));
  for (int64_t j = 0; j < nqp; ++j) {
    const int64_t blk = j / QT, q = j % QT;
    if (j < nq) {
      const uint16_t *qrow =
          (const uint16_t *)kva_at4(p->q, it->b, it->hk * p->rep + j / rows, it->i0 + j % rows, 0);
      for (int64_t d = 0; d < Dk; ++d) qperm[step_pos(&kf, d)] = qrow[d];
      for (int g = 0; g < kf.ngroups; ++g) {
        float sum = 0.0f;
        for (int64_t d = (int64_t)g * kf.G; d < (int64_t)(g + 1) * kf.G; ++d) sum += simd_bf16f(qrow[d]);
        qs[(blk * MAXG + g) * QT + q] = sum;
      }
    } else {
      memset(qperm, 0, sizeof(uint16_t) * (size_t)Dk);
    }
    for (int64_t w = 0; w < Dk / 2; ++w)
      qt32[(blk * ksteps * 16 + w) * 16 + q] = (uint32_t)qperm[2 * w] | (uint32_t)qperm[2 * w + 1] << 16;
    m[j] = -INFINITY;
    l[j] = 0.0f;
  }
  memset(o, 0, sizeof(float) * (size_t)(nqp * Dv));
  memset(bacc, 0, sizeof(float) * (size_t)(nqt * MAXG * QT));
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
  const __m512 scale = _mm512_set1_ps(p->scale);
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
    /* bf16 K rows (zero rows past n) and their group scales/biases. */
    for (int64_t r = 0; r < KVA_TILE; ++r) {
      if (r < tl.pf.n) prefetch_row(&tl.pf, r, KVA_ARR_K, KVA_ARR_V);
      if (r < n) {
        krow_any(&kf, trow[r].k, kb + r * Dk);
        if (kf.bits) {
          const __m512 bv = load_groups(trow[r].kb, kf.dt, kf.ngroups), sv = load_groups(trow[r].ks, kf.dt, kf.ngroups);
          /* ±inf scale or bias: NaN logit, as dequantizing the row gives */
          const __mmask16 inf = _mm512_fpclass_ps_mask(sv, 0x18) | _mm512_fpclass_ps_mask(bv, 0x18);
          _mm512_storeu_ps(ksf + r * MAXG, _mm512_mask_mov_ps(sv, inf, _mm512_set1_ps(NAN)));
          _mm512_storeu_ps(kbf + r * MAXG, bv);
        }
      } else {
        memset(kb + r * Dk, 0, sizeof(uint16_t) * (size_t)Dk);
        _mm512_storeu_ps(ksf + r * MAXG, _mm512_setzero_ps());
        _mm512_storeu_ps(kbf + r * MAXG, _mm512_setzero_ps());
      }
    }
    /* V as token pairs interleaved per 16 dims: codes, or float rows as bf16. */
    int vnan = 0;
    for (int64_t r = 0; r < KVA_TILE; r += 2) {
      for (int64_t u = r; u < r + 2 && u < tl.pf.n; ++u) prefetch_row(&tl.pf, u, KVA_ARR_V, KVA_ARRS);
      if (vf.bits) {
        /* centered codes c - 2^(bits-1) with the bias b + 2^(bits-1) s when a
         * row's scales, biases and moved biases are all finite (else c and b:
         * a non-finite scale or bias reaches exactly the elements that
         * dequantizing the row makes non-finite) */
        float off[2] = {0.0f, 0.0f};
        for (int64_t u = r; u < r + 2; ++u) {
          float sg[MAXG];
          const __m512 sv = u < n ? load_groups(trow[u].vs, vf.dt, vf.ngroups) : _mm512_setzero_ps();
          const __m512 bv = u < n ? load_groups(trow[u].vb, vf.dt, vf.ngroups) : _mm512_setzero_ps();
          const __m512 bc = _mm512_fmadd_ps(sv, _mm512_set1_ps(vcenter), bv);
          const int cen = !(_mm512_fpclass_ps_mask(sv, 0x99) | _mm512_fpclass_ps_mask(bv, 0x99) |
                            _mm512_fpclass_ps_mask(bc, 0x99));
          off[u - r] = cen ? vcenter : 0.0f;
          _mm512_storeu_ps(vbf + u * MAXG, cen ? bc : bv);
          _mm512_storeu_ps(sg, sv);
          for (int g = 0; g < vf.ngroups; ++g) vst[g * KVA_TILE + u] = sg[g];
        }
        if (r < n)
          vpair_any(&vf, trow[r].v, r + 1 < n ? trow[r + 1].v : NULL, off[0], off[1], vp + r / 2 * 32, halves_interleave);
        else
          for (int vb = 0; vb < vblocks; ++vb)
            _mm512_storeu_si512(vp + ((int64_t)vb * 16 + r / 2) * 32, _mm512_setzero_si512());
        continue;
      }
      uint16_t va[AMX_MAX_D] __attribute__((aligned(64))), vb2[AMX_MAX_D] __attribute__((aligned(64)));
      if (r < n) {
        krow_any(&vf, trow[r].v, va);
        vnan |= bf16_nonfinite(va, Dv);
      } else {
        memset(va, 0, sizeof(uint16_t) * (size_t)Dv);
      }
      if (r + 1 < n) {
        krow_any(&vf, trow[r + 1].v, vb2);
        vnan |= bf16_nonfinite(vb2, Dv);
      } else {
        memset(vb2, 0, sizeof(uint16_t) * (size_t)Dv);
      }
      for (int64_t d = 0; d < Dv; d += 32) {
        const __m512i a = _mm512_loadu_si512(va + d), b = _mm512_loadu_si512(vb2 + d);
        _mm512_storeu_si512(vp + ((d / 16) * 16 + r / 2) * 32, _mm512_permutex2var_epi16(a, pair_lo, b));
        _mm512_storeu_si512(vp + ((d / 16 + 1) * 16 + r / 2) * 32, _mm512_permutex2var_epi16(a, pair_hi, b));
      }
    }
    const int full = !kva_causal_family(p->mask.kind) ||
                     simd_tile_all_visible(tf, n, kva_causal_all_upto(p, it->len, pmin), pmax, win);
    for (int64_t blk = 0; blk < nqt; ++blk) {
      const uint16_t *qblk = qt + blk * ksteps * 16 * 32;
      /* Sᵀ for 32 keys: two 16-key halves. */
      for (int half = 0; half < 2; ++half) {
        const uint16_t *khalf = kb + half * KT * Dk;
        float *sh = st + half * KT * QT;
        if (!kf.bits) {
          _tile_zero(0);
          for (int s = 0; s < ksteps; ++s) {
            _tile_loadd(1, khalf + s * 32, Dk * 2);
            _tile_loadd(2, qblk + s * 16 * 32, 64);
            _tile_dpbf16ps(0, 1, 2);
          }
          _tile_stored(0, sh, QT * 4);
          continue;
        }
        for (int g = 0; g < kf.ngroups; ++g) { /* q_g · c_g, then s_g and b_g · Σ q_g */
          _tile_zero(0);
          for (int s = g * kf.G / 32; s < (g + 1) * kf.G / 32; ++s) {
            _tile_loadd(1, khalf + s * 32, Dk * 2);
            _tile_loadd(2, qblk + s * 16 * 32, 64);
            _tile_dpbf16ps(0, 1, 2);
          }
          _tile_stored(0, tmp, QT * 4);
          const __m512 qsg = _mm512_loadu_ps(qs + (blk * MAXG + g) * QT);
          for (int r = 0; r < KT; ++r) {
            const int64_t row = half * KT + r;
            const __m512 acc = g ? _mm512_loadu_ps(sh + r * QT) : _mm512_setzero_ps();
            const __m512 bias = _mm512_fmadd_ps(qsg, _mm512_set1_ps(kbf[row * MAXG + g]), acc);
            _mm512_storeu_ps(sh + r * QT,
                             _mm512_fmadd_ps(_mm512_loadu_ps(tmp + r * QT), _mm512_set1_ps(ksf[row * MAXG + g]), bias));
          }
        }
      }
      for (int r = 0; r < KVA_TILE; ++r) _mm512_storeu_ps(st + r * QT, _mm512_mul_ps(_mm512_loadu_ps(st + r * QT), scale));
      /* softcap, mask, online softmax with queries in lanes */
      if (p->softcap > 0.0f) simd_softcap(st, KVA_TILE, QT, QT, p->softcap);
      for (int64_t r = n; r < KVA_TILE; ++r) _mm512_storeu_ps(st + r * QT, _mm512_set1_ps(-INFINITY));
      if (!full)
        for (int64_t r = 0; r < n; ++r)
          for (int q = 0; q < QT; ++q) {
            const int64_t j = blk * QT + q;
            if (j < nq && !kva_causal_visible(tf + r, pmin + j % rows, win, seg, p->mask.segments_clamp,
                                              kva_tree_row(p, it->b, it->i0 + j % rows), pos0))
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
      float *oblk = o + blk * QT * Dv;
      for (int q = 0; q < QT; ++q)
        if (cf[q] != 1.0f) {
          float *orow = oblk + q * Dv;
          const __m512 f = _mm512_set1_ps(cf[q]);
          for (int64_t d = 0; d < Dv; d += LANES) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), f));
        }
      if (vf.bits) { /* per group: W = P·s_g (exactly 0 where P is) on the codes, Σ p·b_g in f32 */
        __m512 pq[32];
        __mmask16 nzq[32], nzr[KVA_TILE];
        transpose_p(st, pq);
        for (int i = 0; i < 32; ++i) nzq[i] = _mm512_cmp_ps_mask(pq[i], _mm512_setzero_ps(), _CMP_NEQ_UQ);
        for (int r = 0; r < KVA_TILE; ++r) nzr[r] = _mm512_cmp_ps_mask(_mm512_loadu_ps(st + r * QT), _mm512_setzero_ps(), _CMP_NEQ_UQ);
        for (int g = 0; g < vf.ngroups; ++g) {
          const __m512 slo = _mm512_loadu_ps(vst + g * KVA_TILE), shi = _mm512_loadu_ps(vst + g * KVA_TILE + 16);
          for (int q = 0; q < QT; ++q)
            _mm512_storeu_si512(wb + q * KVA_TILE, (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_mul_ps(nzq[2 * q + 1], pq[2 * q + 1], shi),
                                                                             _mm512_maskz_mul_ps(nzq[2 * q], pq[2 * q], slo)));
          float *ba = bacc + (blk * MAXG + g) * QT;
          __m512 bsum = _mm512_setzero_ps();
          for (int r = 0; r < KVA_TILE; ++r)
            bsum = _mm512_mask3_fmadd_ps(_mm512_loadu_ps(st + r * QT), _mm512_set1_ps(vbf[r * MAXG + g]), bsum, nzr[r]);
          _mm512_storeu_ps(ba, _mm512_fmadd_ps(_mm512_loadu_ps(ba), corr, bsum));
          pv_tiles(oblk, Dv, vp, wb, g * vf.G / 16, (g + 1) * vf.G / 16);
        }
      } else if (vnan && !full) { /* f32 FMAs over the keys each vector sees */
        float vrow[AMX_MAX_D];
        for (int64_t r = 0; r < n; ++r) {
          load_row_f32(trow[r].v, vf.dt, Dv, vrow);
          for (int q = 0; q < QT; ++q) {
            const int64_t j = blk * QT + q;
            if (j >= nq || !kva_causal_visible(tf + r, pmin + j % rows, win, seg, p->mask.segments_clamp,
                                               kva_tree_row(p, it->b, it->i0 + j % rows), pos0))
              continue;
            const __m512 pv = _mm512_set1_ps(st[r * QT + q]);
            float *orow = oblk + q * Dv;
            for (int64_t d = 0; d < Dv; d += LANES)
              _mm512_storeu_ps(orow + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(vrow + d), _mm512_loadu_ps(orow + d)));
          }
        }
      } else { /* P (16 q × 32 keys) as bf16 rows */
        __m512 pq[32];
        transpose_p(st, pq);
        for (int q = 0; q < QT; ++q)
          _mm512_storeu_si512(wb + q * KVA_TILE, (__m512i)_mm512_cvtne2ps_pbh(pq[2 * q + 1], pq[2 * q]));
        pv_tiles(oblk, Dv, vp, wb, 0, vblocks);
      }
    }
  }
  _tile_release();
  for (int64_t j = 0; j < nq; ++j) {
    float *s = it->state + j * SF;
    const float *orow = o + j * Dv;
    s[0] = m[j];
    s[1] = l[j];
    if (!vf.bits) {
      memcpy(s + 2, orow, sizeof(float) * (size_t)Dv);
      continue;
    }
    const float *ba = bacc + ((j / QT) * MAXG) * QT + j % QT;
    for (int64_t d = 0; d < Dv; ++d) s[2 + d] = orow[step_pos(&vf, d)] + ba[(d / vf.G) * QT];
  }
}

kva_item_fn KFN(select_amx)(const kva_problem *p, const kva_rowfmt *kf, const kva_rowfmt *vf) {
  /* K and V rows the vector kernel takes in integers ("[q int8, P int16]") */
  const int int_rows = pint_kind(kf, 1) && pint_kind(vf, 1);
  if (p->q->dtype != KVA_BF16 || p->rep * p->L < (int_rows ? AMX_MIN_NQ_INT : AMX_MIN_NQ) || !amx_usable())
    return NULL;
  if (p->Dk % 32 || p->Dv % 32 || p->Dk > AMX_MAX_D || p->Dv > AMX_MAX_D) return NULL;
  if ((kf->bits && kf->D / kf->group > MAXG) || (vf->bits && vf->D / vf->group > MAXG)) return NULL;
  if (kva_is_fp8(kf->dtype) || kva_is_fp8(vf->dtype)) return NULL; /* fp8 rows: the vector kernel */
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
