/* Immutable CSR views of a batch of sequences: creation from live sequences
 * or from caller arrays (validated), release, the kva_kv_view wrapper, CSR
 * accessors, the host block table of a view (kva_paged_view_block_table),
 * gather into contiguous rows, and the checks kva_attention calls
 * (kva_paged_view_check / kva_paged_view_len). A view copies the block tables
 * and holds one reference per block entry, so later appends, forks, trims and
 * frees cannot change what it reads: appends into a partial last block that
 * a view shares write only rows past the view's last_len. */
#include "paged/paged.h"

#include <stdlib.h>
#include <string.h>

/* View handles: a released handle is not freed but kept by its pool
 * (oldest first) for a later view, and freed with the pool. So a handle
 * released twice, or used after its release, still points at pool-owned
 * memory whose magic is 0, and is refused (ignored by release) instead of
 * reading freed memory, as long as the pool lives and the handle was not
 * reused. That remains caller error: a reused handle names the newer view,
 * and after the pool is freed the use is undefined. */
static kva_paged_view *handle_take(kva_pool *p) {
  kva_paged_view *v = p->spare_views;
  if (!v) return (kva_paged_view *)calloc(1, sizeof *v);
  p->spare_views = v->next;
  if (!p->spare_views) p->spare_tail = NULL;
  memset(v, 0, sizeof *v);
  return v;
}
static void handle_give(kva_pool *p, kva_paged_view *v) {
  v->next = v->prev = NULL;
  if (p->spare_tail) p->spare_tail->next = v;
  else p->spare_views = v;
  p->spare_tail = v;
}

/* A handle and one allocation for its arrays (lock held). */
static kva_paged_view *view_alloc(kva_pool *p, int64_t B, int64_t nnz) {
  size_t n32 = (size_t)(B + 1) + (size_t)nnz + 3 * (size_t)B;
  size_t bytes = (size_t)B * sizeof(int64_t) + n32 * sizeof(int32_t);
  void *arrays = calloc(1, bytes);
  kva_paged_view *v = arrays ? handle_take(p) : NULL;
  if (!v) {
    free(arrays);
    return NULL;
  }
  v->arrays = arrays;
  v->start = (int64_t *)arrays;
  v->indptr = (int32_t *)(v->start + B);
  v->indices = v->indptr + B + 1;
  v->last_len = v->indices + nnz;
  v->first_offset = v->last_len + B;
  v->lens = v->first_offset + B;
  v->B = B;
  v->pool = p;
  v->k = p->k;
  v->v = p->v;
  v->block_size = p->desc.block_size;
  v->KVH = p->desc.kv_heads;
  v->Dk = p->desc.dk;
  v->Dv = p->desc.dv;
  return v;
}

/* Takes a reference on each of n block entries (repeats count each time),
 * or none: KVA_EUNSUPPORTED when a count would pass INT32_MAX (lock held). */
int kva_pool_ref_all(kva_pool *p, const int32_t *blocks, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (p->ref[blocks[i]] == INT32_MAX) {
      const int32_t full = blocks[i];
      while (i-- > 0) p->ref[blocks[i]]--; /* each was >= 1 before: none returns to the free list */
      return kva_seterr(KVA_EUNSUPPORTED, "block %d has %d references: too many references", full, INT32_MAX);
    }
    p->ref[blocks[i]]++;
  }
  return 0;
}

/* Takes the references and links the view into the pool (lock held); on
 * error (too many references) nothing is taken and the view is freed. */
static int view_publish(kva_pool *p, kva_paged_view *v) {
  int rc = kva_pool_ref_all(p, v->indices, v->indptr[v->B]);
  if (rc < 0) {
    free(v->arrays);
    handle_give(p, v);
    return rc;
  }
  v->max_len = 0;
  for (int64_t b = 0; b < v->B; ++b)
    if (v->lens[b] > v->max_len) v->max_len = v->lens[b];
  v->next = p->views;
  if (p->views) p->views->prev = v;
  p->views = v;
  p->live_views++;
  v->magic = KVA_PAGED_VIEW_MAGIC;
  return 0;
}

int kva_paged_view_create(kva_pool *p, const int32_t *seqs, int64_t B, kva_paged_view **out) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  if (!out) return kva_seterr(KVA_EINVAL, "view (output pointer) is NULL");
  if (B < 1 || B > INT32_MAX) return kva_seterr(KVA_EINVAL, "B = %lld must be in [1, %d]", (long long)B, INT32_MAX);
  if (!seqs) return kva_seterr(KVA_EINVAL, "seqs is NULL");
  kva_pool_lock(p);
  int rc = 0;
  int64_t nnz = 0;
  for (int64_t b = 0; b < B && !rc; ++b) {
    kva_seq_state *q = kva_pool_seq_find(p, seqs[b]);
    if (!q)
      rc = kva_seterr(KVA_ENOSEQ, "seqs[%lld] = %d is not a live sequence of this pool (unknown or freed)",
                      (long long)b, seqs[b]);
    else if (q->len == 0)
      rc = kva_seterr(KVA_EINVAL, "seqs[%lld] = %d is empty (a view needs at least one token)", (long long)b, seqs[b]);
    else nnz += q->nblocks;
  }
  if (!rc && nnz > INT32_MAX) rc = kva_seterr(KVA_EINVAL, "view of %lld block entries is too large", (long long)nnz);
  kva_paged_view *v = NULL;
  if (!rc && !(v = view_alloc(p, B, nnz))) rc = kva_seterr(KVA_ENOMEM, "view of %lld sequences", (long long)B);
  if (!rc) {
    const int64_t bs = p->desc.block_size;
    int32_t pos = 0;
    for (int64_t b = 0; b < B; ++b) {
      const kva_seq_state *q = kva_pool_seq_find(p, seqs[b]);
      v->indptr[b] = pos;
      memcpy(v->indices + pos, q->blocks, (size_t)q->nblocks * sizeof *q->blocks);
      pos += (int32_t)q->nblocks;
      v->first_offset[b] = q->first_offset;
      v->last_len[b] = (int32_t)(q->first_offset + q->len - (q->nblocks - 1) * bs);
      v->lens[b] = (int32_t)q->len;
      v->start[b] = q->start;
    }
    v->indptr[B] = pos;
    if (!(rc = view_publish(p, v))) *out = v;
  }
  kva_pool_unlock(p);
  return rc;
}

/* Checks caller CSR arrays against the pool (lock held). */
static int check_csr(const kva_pool *p, const kva_paged_csr *c) {
  const int64_t B = c->batch, bs = p->desc.block_size;
  if (B < 1 || B > INT32_MAX) return kva_seterr(KVA_EINVAL, "csr.batch = %lld must be in [1, %d]", (long long)B, INT32_MAX);
  if (!c->indptr || !c->indices || !c->last_len)
    return kva_seterr(KVA_EINVAL, "csr.indptr, csr.indices and csr.last_len are required");
  if (c->indptr[0] != 0) return kva_seterr(KVA_EINVAL, "csr.indptr[0] = %d must be 0", c->indptr[0]);
  for (int64_t b = 0; b < B; ++b) {
    int64_t nb = (int64_t)c->indptr[b + 1] - c->indptr[b];
    if (nb < 1)
      return kva_seterr(KVA_EINVAL, "csr.indptr[%lld..%lld] = %d..%d: sequence %lld needs at least one block",
                        (long long)b, (long long)b + 1, c->indptr[b], c->indptr[b + 1], (long long)b);
    int64_t last = c->last_len[b], first = c->first_offset ? c->first_offset[b] : 0;
    if (last < 1 || last > bs)
      return kva_seterr(KVA_EINVAL, "csr.last_len[%lld] = %lld is beyond the table: must be in [1, block_size = %lld]",
                        (long long)b, (long long)last, (long long)bs);
    if (first < 0 || first >= (nb - 1) * bs + last)
      return kva_seterr(KVA_EINVAL, "csr.first_offset[%lld] = %lld is beyond the table: must be in [0, %lld)",
                        (long long)b, (long long)first, (long long)((nb - 1) * bs + last));
    if (first >= bs)
      return kva_seterr(KVA_EINVAL, "csr.first_offset[%lld] = %lld must be < block_size = %lld (drop whole blocks)",
                        (long long)b, (long long)first, (long long)bs);
    if ((nb - 1) * bs + last - first > INT32_MAX)
      return kva_seterr(KVA_EINVAL, "csr: sequence %lld is longer than %d tokens", (long long)b, INT32_MAX);
    if (c->start && (c->start[b] < 0 || c->start[b] > INT64_MAX - INT32_MAX)) /* start + any length fits */
      return kva_seterr(KVA_EINVAL, "csr.start[%lld] = %lld must be an absolute position in [0, 2^63 - 2^31]",
                        (long long)b, (long long)c->start[b]);
  }
  for (int64_t i = 0; i < c->indptr[B]; ++i) {
    int32_t blk = c->indices[i];
    if (blk < 0 || blk >= p->desc.num_blocks)
      return kva_seterr(KVA_EINVAL, "csr.indices[%lld] = %d is out of range [0, %lld)", (long long)i, blk,
                        (long long)p->desc.num_blocks);
    if (p->ref[blk] == 0)
      return kva_seterr(KVA_EINVAL, "csr.indices[%lld] = %d names a free block (not held by a sequence, view or reservation)",
                        (long long)i, blk);
  }
  return 0;
}

int kva_paged_view_from_csr(kva_pool *p, const kva_paged_csr *c, kva_paged_view **out) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  if (!c) return kva_seterr(KVA_EINVAL, "csr is NULL");
  if (!out) return kva_seterr(KVA_EINVAL, "view (output pointer) is NULL");
  kva_pool_lock(p);
  int rc = check_csr(p, c);
  kva_paged_view *v = NULL;
  if (!rc && !(v = view_alloc(p, c->batch, c->indptr[c->batch])))
    rc = kva_seterr(KVA_ENOMEM, "view of %lld sequences", (long long)c->batch);
  if (!rc) {
    const int64_t B = c->batch, bs = p->desc.block_size;
    memcpy(v->indptr, c->indptr, (size_t)(B + 1) * sizeof *v->indptr);
    memcpy(v->indices, c->indices, (size_t)c->indptr[B] * sizeof *v->indices);
    for (int64_t b = 0; b < B; ++b) {
      v->last_len[b] = c->last_len[b];
      v->first_offset[b] = c->first_offset ? c->first_offset[b] : 0;
      v->start[b] = c->start ? c->start[b] : 0;
      v->lens[b] = (int32_t)((c->indptr[b + 1] - c->indptr[b] - 1) * bs + v->last_len[b] - v->first_offset[b]);
    }
    if (!(rc = view_publish(p, v))) *out = v;
  }
  kva_pool_unlock(p);
  return rc;
}

void kva_paged_view_release(kva_paged_view *v) {
  kva_clearerr();
  if (!v) return;
  kva_pool *p = v->pool; /* a released handle keeps its pool (see handle_take) */
  kva_pool_lock(p);
  if (v->magic != KVA_PAGED_VIEW_MAGIC) { /* released already: caller error, nothing to do */
    kva_pool_unlock(p);
    return;
  }
  for (int32_t i = 0; i < v->indptr[v->B]; ++i) kva_pool_unref(p, v->indices[i]);
  if (v->prev) v->prev->next = v->next;
  else p->views = v->next;
  if (v->next) v->next->prev = v->prev;
  p->live_views--;
  v->magic = 0;
  free(v->arrays);
  v->arrays = NULL;
  v->indptr = v->indices = v->last_len = v->first_offset = v->lens = NULL;
  v->start = NULL;
  v->B = 0;
  handle_give(p, v);
  int last = p->destroyed && p->live_views == 0;
  kva_pool_unlock(p);
  if (last) kva_pool_free_all(p);
}

kva_kv_view kva_view_paged(const kva_paged_view *v) {
  kva_kv_view view;
  memset(&view, 0, sizeof view);
  view.layout = KVA_LAYOUT_PAGED;
  view.paged = v;
  if (v) {
    view.k = v->k;
    view.v = v->v;
  }
  return view;
}

static int check_handle(const kva_paged_view *v, const char *name) {
  if (!v) return kva_seterr(KVA_EINVAL, "%s is NULL", name);
  if (v->magic != KVA_PAGED_VIEW_MAGIC) return kva_seterr(KVA_EINVAL, "%s is not a live paged view (released?)", name);
  return 0;
}

int kva_paged_view_csr(const kva_paged_view *v, kva_paged_csr *c) {
  kva_clearerr();
  int rc = check_handle(v, "view");
  if (rc) return rc;
  if (!c) return kva_seterr(KVA_EINVAL, "csr (output pointer) is NULL");
  c->batch = v->B;
  c->indptr = v->indptr;
  c->indices = v->indices;
  c->last_len = v->last_len;
  c->first_offset = v->first_offset;
  c->start = v->start;
  c->lens = v->lens;
  return 0;
}

int kva_paged_view_block_table(const kva_paged_view *v, int64_t max_blocks, int32_t *blocks, int32_t *seq_lens,
                               int32_t *first_offset) {
  kva_clearerr();
  int rc = check_handle(v, "view");
  if (rc) return rc;
  if (max_blocks < 1) return kva_seterr(KVA_EINVAL, "max_blocks = %lld must be >= 1", (long long)max_blocks);
  if (!blocks || !seq_lens || !first_offset)
    return kva_seterr(KVA_EINVAL, "blocks, seq_lens and first_offset (output arrays) are required");
  for (int64_t b = 0; b < v->B; ++b) {
    int64_t nb = (int64_t)v->indptr[b + 1] - v->indptr[b];
    if (nb > max_blocks)
      return kva_seterr(KVA_ESHAPE, "sequence %lld of the view has %lld blocks > max_blocks = %lld", (long long)b,
                        (long long)nb, (long long)max_blocks);
  }
  /* Row b of blocks [B, max_blocks]: the view's indices, then -1. */
  for (int64_t b = 0; b < v->B; ++b) {
    int32_t *row = blocks + b * max_blocks;
    int64_t nb = (int64_t)v->indptr[b + 1] - v->indptr[b];
    memcpy(row, v->indices + v->indptr[b], (size_t)nb * sizeof *row);
    for (int64_t i = nb; i < max_blocks; ++i) row[i] = -1;
    seq_lens[b] = v->lens[b];
    first_offset[b] = v->first_offset[b];
  }
  return 0;
}

static int check_gather_dst(const kva_paged_view *v, const kva_kv *dst, const kva_kv *pool_kv, int64_t len,
                            const char *name) {
  int64_t D;
  int rc = kva_check_kv(dst, name, &D);
  if (rc) return rc;
  if (dst->data.shape[0] != 1 || dst->data.shape[1] != v->KVH || dst->data.shape[2] < len ||
      D != kva_kv_dim(pool_kv))
    return kva_seterr(KVA_ESHAPE, "%s must be [1, KVH = %lld, >= %lld, D = %lld]", name, (long long)v->KVH,
                      (long long)len, (long long)kva_kv_dim(pool_kv));
  if (!kva_pool_same_format(dst, pool_kv))
    return kva_seterr(KVA_EDTYPE, "%s: mismatched pool formats (must be the pool's bits, group_size and dtype)", name);
  return 0;
}

/* Copies one array's rows of sequence b (every head) to dst [1, KVH, >= len, row]. */
static void gather_array(const kva_paged_view *v, int64_t b, const kva_tensor *src, const kva_tensor *dst) {
  const int64_t bs = v->block_size, len = v->lens[b];
  const size_t rb = (size_t)kva_pool_row_bytes(src);
  for (int64_t hk = 0; hk < v->KVH; ++hk)
    for (int64_t t = 0; t < len;) {
      int64_t r = v->first_offset[b] + t, off = r % bs;
      int32_t blk = v->indices[v->indptr[b] + r / bs];
      int64_t n = bs - off < len - t ? bs - off : len - t;
      for (int64_t i = 0; i < n; ++i)
        memcpy(kva_at4(dst, 0, hk, t + i, 0), kva_pool_row(src, blk, hk, off + i), rb);
      t += n;
    }
}

int kva_paged_view_gather(const kva_paged_view *v, int64_t b, kva_kv *k, kva_kv *vv) {
  kva_clearerr();
  int rc = check_handle(v, "view");
  if (rc) return rc;
  if (b < 0 || b >= v->B) return kva_seterr(KVA_EINVAL, "b = %lld is out of range [0, %lld)", (long long)b, (long long)v->B);
  if ((rc = check_gather_dst(v, k, &v->k, v->lens[b], "k"))) return rc;
  if ((rc = check_gather_dst(v, vv, &v->v, v->lens[b], "v"))) return rc;
  gather_array(v, b, &v->k.data, &k->data);
  gather_array(v, b, &v->v.data, &vv->data);
  if (!v->k.bits && kva_kv_scaled(&v->k)) { /* fp8 pools: the scale rows */
    gather_array(v, b, &v->k.scales, &k->scales);
    gather_array(v, b, &v->v.scales, &vv->scales);
  }
  if (v->k.bits) {
    gather_array(v, b, &v->k.scales, &k->scales);
    gather_array(v, b, &v->k.biases, &k->biases);
    gather_array(v, b, &v->v.scales, &vv->scales);
    gather_array(v, b, &v->v.biases, &vv->biases);
  }
  return 0;
}

/* ---- for kva_attention (src/api/attention.c) */
static int same_tensor(const kva_tensor *a, const kva_tensor *b) {
  if (a->data != b->data || a->dtype != b->dtype || a->ndim != b->ndim) return 0;
  for (int d = 0; d < a->ndim && d < KVA_MAX_DIMS; ++d)
    if (a->shape[d] != b->shape[d] || a->stride[d] != b->stride[d]) return 0;
  return 1;
}
static int same_kv(const kva_kv *a, const kva_kv *b) {
  if (a->bits != b->bits || !same_tensor(&a->data, &b->data)) return 0;
  if (!a->bits) return kva_kv_scaled(a) == kva_kv_scaled(b) && (!kva_kv_scaled(a) || same_tensor(&a->scales, &b->scales));
  return (a->group_size == b->group_size && same_tensor(&a->scales, &b->scales) &&
                      same_tensor(&a->biases, &b->biases));
}

int kva_paged_view_check(const kva_kv_view *view, int64_t *B, int64_t *KVH, int64_t *Dk, int64_t *Dv,
                         int64_t *max_len) {
  if (!view) return kva_seterr(KVA_EINVAL, "kv is NULL");
  if (view->layout != KVA_LAYOUT_PAGED) return kva_seterr(KVA_EINVAL, "kv.layout is not KVA_LAYOUT_PAGED");
  const kva_paged_view *v = view->paged;
  int rc = check_handle(v, "kv.paged");
  if (rc) return rc;
  if (!same_kv(&view->k, &v->k) || !same_kv(&view->v, &v->v))
    return kva_seterr(KVA_EDTYPE, "kv.k / kv.v do not describe the pool of kv.paged (mismatched pool formats; "
                      "make the view with kva_view_paged)");
  *B = v->B;
  *KVH = v->KVH;
  *Dk = v->Dk;
  *Dv = v->Dv;
  *max_len = v->max_len;
  return 0;
}

int64_t kva_paged_view_len(const kva_kv_view *view, int64_t b) { return view->paged->lens[b]; }
