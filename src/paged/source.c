/* kva_source over the two paged layouts: a paged view (PAGED) and caller
 * pools addressed by a block table (BLOCK_TABLE). The span at token t of
 * (sequence b, KV head hk) is the run of rows of t's block, from t to the
 * end of the block or t_end. Rows of one (block, head) are equally strided
 * (the pool's stride[2]), so kernels read blocks in place, with no gather.
 * Address of view index t: table row r = first_offset[b] + t, block
 *   PAGED:       indices[indptr[b] + r / bs]
 *   BLOCK_TABLE: blocks[b * row_stride + r / bs]
 * at row r % bs. span_at (the general kernel, the oracle) pays two divisions
 * and six address computations per span; the fast kernels' row cursors take
 * the row map of (b, hk) once per item (seqmap: table row pointer, first
 * row, per-array bases and strides, log2 bs for power-of-two blocks) and
 * then one table load, a shift and two multiply-adds per array per block. */
#include "paged/paged.h"
#include "paged/source.h"

/* Row addresses of one array at (blk, hk, row), or NULL for an unused array. */
static const char *row_or_null(const kva_tensor *t, int used, int64_t blk, int64_t hk, int64_t row) {
  return used ? kva_pool_row(t, blk, hk, row) : NULL;
}

/* The span of pools k, v that starts at row `row` of block blk, head hk,
 * for view index t: up to the end of the block (bs rows) or t_end. */
static void pool_span(const kva_kv *k, const kva_kv *v, int64_t bs, int64_t blk, int64_t hk, int64_t row, int64_t t,
                      int64_t t_end, kva_span *sp) {
  const int kq = k->bits != 0, vq = v->bits != 0, ksc = kva_kv_scaled(k), vsc = kva_kv_scaled(v);
  sp->k = kva_pool_row(&k->data, blk, hk, row);
  sp->ks = row_or_null(&k->scales, ksc, blk, hk, row);
  sp->kb = row_or_null(&k->biases, kq, blk, hk, row);
  sp->v = kva_pool_row(&v->data, blk, hk, row);
  sp->vs = row_or_null(&v->scales, vsc, blk, hk, row);
  sp->vb = row_or_null(&v->biases, vq, blk, hk, row);
  sp->k_rs = k->data.stride[2];
  sp->ks_rs = ksc ? k->scales.stride[2] : 0;
  sp->kb_rs = kq ? k->biases.stride[2] : 0;
  sp->v_rs = v->data.stride[2];
  sp->vs_rs = vsc ? v->scales.stride[2] : 0;
  sp->vb_rs = vq ? v->biases.stride[2] : 0;
  sp->t0 = t;
  sp->n = bs - row < t_end - t ? bs - row : t_end - t;
}

static void paged_span_at(const kva_source *src, int64_t b, int64_t hk, int64_t t, int64_t t_end, kva_span *sp) {
  const kva_paged_view *v = (const kva_paged_view *)src->impl;
  const int64_t bs = v->block_size;
  const int64_t r = v->first_offset[b] + t, slot = r / bs, row = r - slot * bs;
  const int64_t blk = v->indices[v->indptr[b] + slot];
  pool_span(&v->k, &v->v, bs, blk, hk, row, t, t_end, sp);
}

/* The row map of head hk over pools k, v [num_blocks, KVH, bs, D] (block ids
 * and first row filled by the caller). */
static void pool_array(const kva_tensor *t, int used, int64_t hk, kva_seqmap *m, int a) {
  m->base[a] = used ? kva_pool_row(t, 0, hk, 0) : NULL;
  m->bstride[a] = used ? t->stride[0] : 0;
  m->rstride[a] = used ? t->stride[2] : 0;
}
static void pool_seqmap(const kva_kv *k, const kva_kv *v, int64_t bs, int64_t hk, kva_seqmap *m) {
  const int kq = k->bits != 0, vq = v->bits != 0;
  m->bs = bs;
  m->shift = -1;
  for (int s = 0; s < 62 && m->shift < 0; ++s)
    if ((int64_t)1 << s == bs) m->shift = s;
  pool_array(&k->data, 1, hk, m, KVA_ARR_K);
  pool_array(&k->scales, kva_kv_scaled(k), hk, m, KVA_ARR_KS);
  pool_array(&k->biases, kq, hk, m, KVA_ARR_KB);
  pool_array(&v->data, 1, hk, m, KVA_ARR_V);
  pool_array(&v->scales, kva_kv_scaled(v), hk, m, KVA_ARR_VS);
  pool_array(&v->biases, vq, hk, m, KVA_ARR_VB);
}

static void paged_seqmap(const kva_source *src, int64_t b, int64_t hk, kva_seqmap *m) {
  const kva_paged_view *v = (const kva_paged_view *)src->impl;
  m->ids = v->indices + v->indptr[b];
  m->first = v->first_offset[b];
  pool_seqmap(&v->k, &v->v, v->block_size, hk, m);
}

void kva_source_paged(kva_source *src, const kva_kv_view *view) {
  const kva_paged_view *v = view->paged;
  src->kf = kva_rowfmt_of(&v->k);
  src->vf = kva_rowfmt_of(&v->v);
  src->span_at = paged_span_at;
  src->seqmap = paged_seqmap;
  src->impl = v;
}

/* impl: the kva_kv_view (k, v are the pools [num_blocks, KVH, bs, D]). */
static void table_span_at(const kva_source *src, int64_t b, int64_t hk, int64_t t, int64_t t_end, kva_span *sp) {
  const kva_kv_view *view = (const kva_kv_view *)src->impl;
  const kva_block_table *tb = view->table;
  const int64_t bs = view->k.data.shape[2];
  const int64_t r = kva_block_table_first(tb, b) + t, slot = r / bs, row = r - slot * bs;
  const int64_t blk = tb->blocks[b * kva_block_table_stride(tb) + slot];
  pool_span(&view->k, &view->v, bs, blk, hk, row, t, t_end, sp);
}

static void table_seqmap(const kva_source *src, int64_t b, int64_t hk, kva_seqmap *m) {
  const kva_kv_view *view = (const kva_kv_view *)src->impl;
  const kva_block_table *tb = view->table;
  m->ids = tb->blocks + b * kva_block_table_stride(tb);
  m->first = kva_block_table_first(tb, b);
  pool_seqmap(&view->k, &view->v, view->k.data.shape[2], hk, m);
}

void kva_source_block_table(kva_source *src, const kva_kv_view *view) {
  src->kf = kva_rowfmt_of(&view->k);
  src->vf = kva_rowfmt_of(&view->v);
  src->span_at = table_span_at;
  src->seqmap = table_seqmap;
  src->impl = view;
}
