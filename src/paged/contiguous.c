/* kva_source over the contiguous layout (K [B, KVH, N, D] strided views):
 * the span at token t of (sequence b, KV head hk) runs from t to t_end with
 * the tensors' stride[2] between rows; the row map is one block (ids NULL)
 * with base at (b, hk, token 0). And the cache length of a sequence in each
 * layout (kva_problem_len). */
#include "paged/paged.h"
#include "paged/source.h"

#include <string.h>

int64_t kva_problem_len(const kva_problem *p, int64_t b) {
  if (p->kv->layout == KVA_LAYOUT_PAGED) return kva_paged_view_len(p->kv, b);
  if (p->kv->layout == KVA_LAYOUT_BLOCK_TABLE) return kva_block_table_len(p->kv, b);
  return p->seq_lens ? p->seq_lens[b] : p->N;
}

static void contiguous_span_at(const kva_source *src, int64_t b, int64_t hk, int64_t t, int64_t t_end,
                               kva_span *sp) {
  const kva_kv_view *v = (const kva_kv_view *)src->impl;
  const kva_kv *K = &v->k, *V = &v->v;
  memset(sp, 0, sizeof *sp);
  sp->k = kva_at4(&K->data, b, hk, t, 0);
  sp->k_rs = K->data.stride[2];
  if (kva_kv_scaled(K)) { /* quantized rows, fp8 rows with scales */
    sp->ks = kva_at4(&K->scales, b, hk, t, 0);
    sp->ks_rs = K->scales.stride[2];
  }
  if (K->bits) {
    sp->kb = kva_at4(&K->biases, b, hk, t, 0);
    sp->kb_rs = K->biases.stride[2];
  }
  sp->v = kva_at4(&V->data, b, hk, t, 0);
  sp->v_rs = V->data.stride[2];
  if (kva_kv_scaled(V)) { /* quantized rows, fp8 rows with scales */
    sp->vs = kva_at4(&V->scales, b, hk, t, 0);
    sp->vs_rs = V->scales.stride[2];
  }
  if (V->bits) {
    sp->vb = kva_at4(&V->biases, b, hk, t, 0);
    sp->vb_rs = V->biases.stride[2];
  }
  sp->t0 = t;
  sp->n = t_end - t;
}

/* One array's base at (b, hk, token 0) and row stride; NULL when unused. */
static void contiguous_array(const kva_tensor *t, int used, int64_t b, int64_t hk, kva_seqmap *m, int a) {
  m->base[a] = used ? kva_at4(t, b, hk, 0, 0) : NULL;
  m->rstride[a] = used ? t->stride[2] : 0;
  m->bstride[a] = 0;
}

static void contiguous_seqmap(const kva_source *src, int64_t b, int64_t hk, kva_seqmap *m) {
  const kva_kv_view *v = (const kva_kv_view *)src->impl;
  const kva_kv *K = &v->k, *V = &v->v;
  m->ids = NULL;
  m->first = 0;
  m->bs = 0;
  m->shift = -1;
  contiguous_array(&K->data, 1, b, hk, m, KVA_ARR_K);
  contiguous_array(&K->scales, kva_kv_scaled(K), b, hk, m, KVA_ARR_KS);
  contiguous_array(&K->biases, K->bits != 0, b, hk, m, KVA_ARR_KB);
  contiguous_array(&V->data, 1, b, hk, m, KVA_ARR_V);
  contiguous_array(&V->scales, kva_kv_scaled(V), b, hk, m, KVA_ARR_VS);
  contiguous_array(&V->biases, V->bits != 0, b, hk, m, KVA_ARR_VB);
}

void kva_source_contiguous(kva_source *src, const kva_kv_view *view) {
  src->kf = kva_rowfmt_of(&view->k);
  src->vf = kva_rowfmt_of(&view->v);
  src->span_at = contiguous_span_at;
  src->seqmap = contiguous_seqmap;
  src->impl = view;
}
