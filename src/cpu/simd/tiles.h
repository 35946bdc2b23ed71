/* Tiles of KVA_TILE tokens over an item's rows and the software prefetch of
 * the next tile, shared by the fast kernels (fast.c, fast8.c, amx.c);
 * ISA-neutral (__builtin_prefetch with locality 2: prefetcht1 on x86). */
#ifndef KVA_CPU_TILES_H
#define KVA_CPU_TILES_H

#include "cpu/simd/simd.h"

/* Software prefetch of the rows of the next tile, spread over the current
 * one: while a kernel handles row t of this tile, it prefetches row t of
 * the next tile, about one tile (32 rows, 1-2 microseconds on one core)
 * before use. Blocks of a paged pool sit at random places where the
 * hardware prefetchers cannot follow (block 16 ran at about half speed
 * without any software prefetch), and contiguous caches gain too. A burst
 * of the whole next tile (about 140 lines for q4 D = 256) at the start of
 * each tile, the earlier form, keeps the L1 fill buffers full for a
 * stretch and stalls the kernel: one row at a time measured 20-40 % faster
 * (hot and cold, contiguous and paged; BENCHMARKS.md).
 * Each phase prefetches its own arrays (K, its scales and biases while K
 * rows are used; V's while V rows are used) into L2 (prefetcht1): 5-10 %
 * faster than all six arrays into L1 during the K phase for bf16 decode
 * (cold, 2 threads, calls alternated; bf16 verify on AMX 6-7 %;
 * BENCHMARKS.md), where the prefetches of a 1 KiB K+V row per K row
 * stalled on full fill buffers. */
typedef struct kva_prefetch {
  const kva_rows *rows;    /* the next tile's rows */
  int64_t n;               /* how many (0: nothing to prefetch) */
  int64_t bytes[KVA_ARRS]; /* bytes of one row of each array (0: unused array) */
} kva_prefetch;

/* Bytes of one bias row; 0 for float rows. */
static inline int64_t rowfmt_group_bytes(const kva_rowfmt *f) {
  return f->bits ? f->D / f->group * (int64_t)kva_dtype_size(f->sdtype) : 0;
}
/* Bytes of one scale row: as the biases; fp8 rows with scales: one f32; else 0. */
static inline int64_t rowfmt_scale_bytes(const kva_rowfmt *f) { return f->bits ? rowfmt_group_bytes(f) : f->scaled ? 4 : 0; }
/* Bytes of one data row. */
static inline int64_t rowfmt_row_bytes(const kva_rowfmt *f) {
  return f->bits ? f->D * f->bits / 8 : f->D * (int64_t)kva_dtype_size(f->dtype);
}
static inline void prefetch_init(kva_prefetch *pf, const kva_rowfmt *kf, const kva_rowfmt *vf) {
  pf->rows = NULL;
  pf->n = 0;
  pf->bytes[KVA_ARR_K] = rowfmt_row_bytes(kf);
  pf->bytes[KVA_ARR_KS] = rowfmt_scale_bytes(kf);
  pf->bytes[KVA_ARR_KB] = rowfmt_group_bytes(kf);
  pf->bytes[KVA_ARR_V] = rowfmt_row_bytes(vf);
  pf->bytes[KVA_ARR_VS] = rowfmt_scale_bytes(vf);
  pf->bytes[KVA_ARR_VB] = rowfmt_group_bytes(vf);
}

/* Row r of the prefetch tile, arrays [a0, a1), into L2: the cache lines of
 * each array's row, less the line that row r-1 ended in (scale/bias rows of
 * a few bytes share lines: one prefetch per line, not per row). */
ALWAYS void prefetch_row(const kva_prefetch *pf, int64_t r, int a0, int a1) {
  for (int a = a0; a < a1; ++a) {
    const int64_t bytes = pf->bytes[a];
    if (!bytes) continue;
    const uintptr_t p = (uintptr_t)pf->rows[r].a[a], end = p + (uintptr_t)bytes;
    uintptr_t line = p & ~(uintptr_t)63;
    if (r > 0) {
      const uintptr_t prev_last = ((uintptr_t)pf->rows[r - 1].a[a] + (uintptr_t)bytes - 1) & ~(uintptr_t)63;
      if (prev_last == line) line += 64;
    }
    for (; line < end; line += 64) __builtin_prefetch((const char *)line, 0, 2);
  }
}

/* Row r of the prefetch tile's arrays a (data), a + 1, a + 2 (its group
 * scales and biases) into L2, as prefetch_row with the arrays unrolled:
 * the data row's lines and the line of each group row, unconditionally
 * (the group rows of adjacent tokens share a line; one more prefetch of it
 * costs less than the test against row r - 1). Quantized rows. */
ALWAYS void prefetch_row3(const kva_prefetch *pf, int64_t r, int a) {
  const uintptr_t p = (uintptr_t)pf->rows[r].a[a], end = p + (uintptr_t)pf->bytes[a];
  for (uintptr_t line = p & ~(uintptr_t)63; line < end; line += 64) __builtin_prefetch((const char *)line, 0, 2);
  __builtin_prefetch(pf->rows[r].a[a + 1], 0, 2);
  __builtin_prefetch(pf->rows[r].a[a + 2], 0, 2);
}

/* prefetch_row3 for data rows of at most two lines (q4 at head dim <= 256,
 * q8 at <= 128); longer rows keep prefetch_row's one prefetch per new line
 * of the group rows (AVX-512 host, cold: q8 at head dim 256 ran 5-25 %
 * slower with prefetch_row3, q4 6-30 % faster). */
ALWAYS void prefetch_row_q(const kva_prefetch *pf, int64_t r, int a) {
  if (pf->bytes[a] <= 128) prefetch_row3(pf, r, a);
  else prefetch_row(pf, r, a, a + 3);
}

/* The first line of each array at each block start of the prefetch tile
 * (paged layouts: tokens [t, t + pf->n) of the row map m), all at once into
 * L2 when the tile is located, before the current tile's K phase. Blocks
 * sit at random places of a pool, so a block start is usually a new page
 * and a new DRAM row in each of the six arrays; the per-row prefetch
 * reaches the K arrays' block starts during the K phase and the V arrays'
 * during the V phase, one block at a time. Issued together, their misses
 * (and presumably page walks) overlap: the ragged batch at block 16 on a
 * shuffled pool ran 2-5 % faster (cold, 2 threads, paired calls; ~3 % in
 * `make bench-paged`), bf16 decode at block 16 ~4 %; neutral within noise
 * on a pool in table order. Block starts come from the table,
 * not from a scan of the tile's rows (a 32-row scan cost ~2 % on the
 * in-order pool). Two or four tiles ahead, or K's or V's arrays alone,
 * measured slower. */
ALWAYS void prefetch_block_starts(const kva_seqmap *m, const kva_prefetch *pf, int64_t t) {
  const int64_t r = m->first + t;
  int64_t slot = m->shift >= 0 ? r >> m->shift : r / m->bs;
  int64_t u = slot * m->bs - r; /* row of the tile where block `slot` starts (<= 0) */
  if (u < 0) { /* the tile begins inside a block, already being read: the next one */
    u += m->bs;
    ++slot;
  }
  for (; u < pf->n; u += m->bs, ++slot) {
    const int64_t blk = m->ids[slot];
    for (int a = 0; a < KVA_ARRS; ++a)
      if (pf->bytes[a]) __builtin_prefetch(m->base[a] + blk * m->bstride[a], 0, 2);
  }
}

/* The tiles of an item's token range [t0, t1), KVA_TILE tokens each,
 * across span (paged block) boundaries: row addresses come from a cursor one
 * tile ahead, and pf holds the next tile's rows for prefetch_row while the
 * current tile runs (the kernels prefetch one row per row they process). */
typedef struct kva_tiles {
  kva_cursor cur;
  kva_rows buf[2][KVA_TILE];
  kva_prefetch pf;
  int64_t t, t1, i; /* the next tile's first token, the end, its index */
} kva_tiles;
static inline void tiles_init(kva_tiles *w, const kva_item *it) {
  kva_cursor_init(&w->cur, it->src, it->b, it->hk, it->t1);
  prefetch_init(&w->pf, &it->src->kf, &it->src->vf);
  w->t = it->t0;
  w->t1 = it->t1;
  w->i = 0;
  kva_cursor_tile(&w->cur, w->t, w->t1 - w->t < KVA_TILE ? w->t1 - w->t : KVA_TILE, w->buf[0]);
}
/* The next tile's rows (NULL past the end), its first token and size; the
 * tile after it is located into w->pf (and, for paged layouts, the first
 * lines of its blocks prefetched: prefetch_block_starts). */
static inline const kva_rows *tiles_next(kva_tiles *w, int64_t *tf, int64_t *n) {
  if (w->t >= w->t1) return NULL;
  *tf = w->t;
  *n = w->t1 - w->t < KVA_TILE ? w->t1 - w->t : KVA_TILE;
  const kva_rows *rows = w->buf[w->i & 1];
  w->pf.rows = w->buf[(w->i + 1) & 1];
  w->pf.n = w->t1 - w->t - *n < KVA_TILE ? w->t1 - w->t - *n : KVA_TILE;
  kva_cursor_tile(&w->cur, w->t + *n, w->pf.n, w->buf[(w->i + 1) & 1]);
  if (w->cur.m.ids) prefetch_block_starts(&w->cur.m, &w->pf, w->t + *n);
  w->t += *n;
  w->i++;
  return rows;
}
#endif
