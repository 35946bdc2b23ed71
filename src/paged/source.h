/* Where K/V rows come from, kept apart from the attention math (the
 * layouts layer: contiguous in src/paged/contiguous.c, paged views and
 * block tables in src/paged/source.c).
 *
 * A kva_span is a run of consecutive tokens of one (sequence, KV head) whose
 * rows are equally strided in memory: a contiguous cache gives one span per
 * token range, a paged cache (view or block table) one span per block. The
 * kernels consume spans; a kva_source produces them, one by one (span_at)
 * or as a row map of a whole (sequence, KV head) that a kernel's cursor
 * walks inline (seqmap). */
#ifndef KVA_PAGED_SOURCE_H
#define KVA_PAGED_SOURCE_H

#include "core/problem.h"

typedef struct kva_span {
  const char *k, *ks, *kb; /* first row of K data / scales / biases (ks, kb NULL if float) */
  const char *v, *vs, *vb; /* first row of V */
  int64_t k_rs, ks_rs, kb_rs; /* byte strides between consecutive rows */
  int64_t v_rs, vs_rs, vb_rs;
  int64_t t0;              /* view index of the first row */
  int64_t n;               /* rows in the span */
} kva_span;

/* Where the rows of one (sequence, KV head) lie, for lookups inlined in the
 * kernels' row cursors (src/cpu/simd/simd.h): token t of the view is table
 * row r = first + t, in block ids[r / bs] at row r % bs; row `row` of block
 * `blk` of array a (K data, K scales, K biases, V data, V scales, V biases)
 * starts at base[a] + blk * bstride[a] + row * rstride[a]. A contiguous
 * cache is one block: ids NULL, base[a] at (b, hk, token 0). base[a] is NULL
 * for an unused array (scales and biases of float rows). */
enum { KVA_ARR_K, KVA_ARR_KS, KVA_ARR_KB, KVA_ARR_V, KVA_ARR_VS, KVA_ARR_VB, KVA_ARRS };
typedef struct kva_seqmap {
  const int32_t *ids;   /* the sequence's block ids in table order; NULL: contiguous */
  int64_t first;        /* table rows before token 0 */
  int64_t bs;           /* rows per block */
  int shift;            /* log2(bs) when bs is a power of two, else -1 */
  const char *base[KVA_ARRS];
  int64_t bstride[KVA_ARRS], rstride[KVA_ARRS];
} kva_seqmap;

typedef struct kva_source kva_source;
struct kva_source {
  kva_rowfmt kf, vf;
  /* Fills *sp with the span that starts at token t of (b, hk) and ends at the
   * first of t_end or the end of the run of equally strided rows. */
  void (*span_at)(const kva_source *src, int64_t b, int64_t hk, int64_t t, int64_t t_end,
                  kva_span *sp);
  /* Fills *m with the row map of (b, hk) (the same rows span_at gives). */
  void (*seqmap)(const kva_source *src, int64_t b, int64_t hk, kva_seqmap *m);
  const void *impl; /* the layout's own data (e.g. the kva_kv_view) */
};

/* A source over the contiguous layout of a view. */
void kva_source_contiguous(kva_source *src, const kva_kv_view *view);
/* A source over a paged view. */
void kva_source_paged(kva_source *src, const kva_kv_view *view);
/* A source over caller pools addressed by a block table. */
void kva_source_block_table(kva_source *src, const kva_kv_view *view);

/* Cache length of sequence b (host-side views only). */
int64_t kva_problem_len(const kva_problem *p, int64_t b);
#endif
