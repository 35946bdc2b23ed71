/* Where K/V rows come from, kept apart from the attention math.
 *
 * A kva_span is a run of consecutive tokens of one (sequence, KV head) whose
 * rows are equally strided in memory: a contiguous cache gives one span per
 * token range, a paged cache (view or block table) one span per block. The
 * kernels consume spans; a kva_source produces them. */
#ifndef KVA_CPU_SOURCE_H
#define KVA_CPU_SOURCE_H

#include "core/problem.h"

/* Row format of one operand (K or V). */
typedef struct kva_rowfmt {
  int bits;          /* 0 = float rows */
  int group;         /* group size when quantized */
  kva_dtype dtype;   /* float rows: element dtype */
  kva_dtype sdtype;  /* quantized: scales/biases dtype */
  int64_t D;         /* logical elements per row */
} kva_rowfmt;

typedef struct kva_span {
  const char *k, *ks, *kb; /* first row of K data / scales / biases (ks, kb NULL if float) */
  const char *v, *vs, *vb; /* first row of V */
  int64_t k_rs, ks_rs, kb_rs; /* byte strides between consecutive rows */
  int64_t v_rs, vs_rs, vb_rs;
  int64_t t0;              /* view index of the first row */
  int64_t n;               /* rows in the span */
} kva_span;

typedef struct kva_source kva_source;
struct kva_source {
  kva_rowfmt kf, vf;
  /* Fills *sp with the span that starts at token t of (b, hk) and ends at the
   * first of t_end or the end of the run of equally strided rows. */
  void (*span_at)(const kva_source *src, int64_t b, int64_t hk, int64_t t, int64_t t_end,
                  kva_span *sp);
  const void *impl; /* the layout's own data (e.g. the kva_kv_view) */
};

/* A source over the contiguous layout of a view. */
void kva_source_contiguous(kva_source *src, const kva_kv_view *view);
/* A source over a paged view (src/paged/). */
void kva_source_paged(kva_source *src, const kva_kv_view *view);
/* A source over caller pools addressed by a block table (src/paged/). */
void kva_source_block_table(kva_source *src, const kva_kv_view *view);
/* Row format of a kva_kv. */
kva_rowfmt kva_rowfmt_of(const kva_kv *kv);
#endif
