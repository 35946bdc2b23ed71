/* Shared prefixes of paged sequences (forks of one parent) and the split of
 * a view into the two views of kva_cascade_attention.
 * Token t of sequence b is table row r = first_offset_b + t of its block
 * list; two sequences hold token t in the same pool rows iff their first
 * offsets agree and their lists name the same block at r / block_size. The
 * shared prefix of a batch is therefore
 *   P = min(k * block_size - first_offset, min_b len_b - min_suffix), >= 0,
 * k the number of leading list entries equal in every sequence. Within
 * min_b len_b every such row holds the same data for all of them (one
 * memory). The split is two CSR views made with kva_paged_view_from_csr
 * (validated there; the source view's references keep the blocks allocated
 * meanwhile); a block table is split by offsetting its row pointers. */
#include "paged/paged.h"

#include <stdlib.h>
#include <string.h>

/* One sequence's block list: token t at list[(first + t) / bs]. */
typedef struct prefix_row {
  const int32_t *blocks;
  int64_t nblocks, first, len;
} prefix_row;

/* P of rows[0..B) (see the file comment). */
static int64_t shared_tokens(const prefix_row *rows, int64_t B, int64_t bs, int64_t min_suffix) {
  int64_t min_len = rows[0].len, k = rows[0].nblocks;
  for (int64_t b = 1; b < B; ++b) {
    if (rows[b].first != rows[0].first) return 0;
    if (rows[b].len < min_len) min_len = rows[b].len;
    if (rows[b].nblocks < k) k = rows[b].nblocks;
  }
  for (int64_t b = 1; b < B; ++b) {
    int64_t i = 0;
    while (i < k && rows[b].blocks[i] == rows[0].blocks[i]) ++i;
    k = i;
  }
  int64_t p = k * bs - rows[0].first;
  if (p > min_len - min_suffix) p = min_len - min_suffix;
  return p > 0 ? p : 0;
}

static int check_min_suffix(int64_t min_suffix, int64_t *tokens) {
  if (!tokens) return kva_seterr(KVA_EINVAL, "tokens (output pointer) is NULL");
  if (min_suffix < 0) return kva_seterr(KVA_EINVAL, "min_suffix = %lld must be >= 0", (long long)min_suffix);
  return 0;
}

int kva_seq_shared_prefix(kva_pool *p, const int32_t *seqs, int64_t B, int64_t min_suffix, int64_t *tokens) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  if (!seqs) return kva_seterr(KVA_EINVAL, "seqs is NULL");
  if (B < 1) return kva_seterr(KVA_EINVAL, "B = %lld must be >= 1", (long long)B);
  int rc = check_min_suffix(min_suffix, tokens);
  if (rc) return rc;
  prefix_row *rows = (prefix_row *)malloc((size_t)B * sizeof *rows);
  if (!rows) return kva_seterr(KVA_ENOMEM, "%lld sequences", (long long)B);
  kva_pool_lock(p);
  for (int64_t b = 0; b < B && !rc; ++b) {
    const kva_seq_state *q = kva_pool_seq_find(p, seqs[b]);
    if (!q)
      rc = kva_seterr(KVA_ENOSEQ, "seqs[%lld] = %d is not a live sequence of this pool (unknown or freed)",
                      (long long)b, seqs[b]);
    else
      rows[b] = (prefix_row){q->blocks, q->nblocks, q->first_offset, q->len};
  }
  if (!rc) *tokens = shared_tokens(rows, B, p->desc.block_size, min_suffix);
  kva_pool_unlock(p);
  free(rows);
  return rc;
}

/* The block lists of a checked PAGED or BLOCK_TABLE view (host arrays). */
static int view_rows(const kva_kv_view *view, prefix_row **out, int64_t *B, int64_t *bs) {
  int64_t KVH, Dk, Dv, N;
  int rc;
  *out = NULL;
  if (view->layout == KVA_LAYOUT_PAGED) {
    if (!view->paged) return kva_seterr(KVA_EINVAL, "view.paged is NULL for a paged view");
    if ((rc = kva_paged_view_check(view, B, &KVH, &Dk, &Dv, &N))) return rc;
  } else if (view->layout == KVA_LAYOUT_BLOCK_TABLE) {
    if ((rc = kva_block_table_check(view, B, &KVH, &Dk, &Dv, &N)) || (rc = kva_block_table_check_entries(view, 1)))
      return rc;
  } else {
    return kva_seterr(KVA_EINVAL, "view.layout = %d: a paged or block-table view (contiguous sequences share no rows)",
                      (int)view->layout);
  }
  prefix_row *rows = (prefix_row *)malloc((size_t)*B * sizeof *rows);
  if (!rows) return kva_seterr(KVA_ENOMEM, "%lld sequences", (long long)*B);
  if (view->layout == KVA_LAYOUT_PAGED) {
    const kva_paged_view *v = view->paged;
    *bs = v->block_size;
    for (int64_t b = 0; b < *B; ++b)
      rows[b] = (prefix_row){v->indices + v->indptr[b], v->indptr[b + 1] - v->indptr[b], v->first_offset[b], v->lens[b]};
  } else {
    const kva_block_table *t = view->table;
    *bs = view->k.data.shape[2];
    for (int64_t b = 0; b < *B; ++b) {
      const int64_t first = kva_block_table_first(t, b), len = t->seq_lens[b];
      rows[b] = (prefix_row){t->blocks + b * kva_block_table_stride(t), kva_blocks_for(first + len, *bs), first, len};
    }
  }
  *out = rows;
  return 0;
}

int kva_view_shared_prefix(const kva_kv_view *view, int64_t min_suffix, int64_t *tokens) {
  kva_clearerr();
  if (!view) return kva_seterr(KVA_EINVAL, "view is NULL");
  int rc = check_min_suffix(min_suffix, tokens);
  if (rc) return rc;
  prefix_row *rows;
  int64_t B, bs;
  if ((rc = view_rows(view, &rows, &B, &bs))) return rc;
  *tokens = shared_tokens(rows, B, bs, min_suffix);
  free(rows);
  return 0;
}

/* prefix_tokens against the view's shared prefix with one own token kept. */
static int check_split(const prefix_row *rows, int64_t B, int64_t bs, int64_t P) {
  const int64_t shared = shared_tokens(rows, B, bs, 1);
  if (P < 1 || P > shared)
    return kva_seterr(KVA_EINVAL, "prefix_tokens = %lld must be in [1, %lld] (the tokens every sequence holds in the "
                      "same pool rows, leaving each at least one own token)", (long long)P, (long long)shared);
  return 0;
}

int kva_paged_view_split(const kva_paged_view *view, int64_t prefix_tokens, kva_paged_view **prefix,
                         kva_paged_view **suffix) {
  kva_clearerr();
  if (!view) return kva_seterr(KVA_EINVAL, "view is NULL");
  if (!prefix || !suffix) return kva_seterr(KVA_EINVAL, "prefix and suffix (output pointers) are required");
  const kva_kv_view kv = kva_view_paged(view);
  prefix_row *rows;
  int64_t B, bs;
  int rc = view_rows(&kv, &rows, &B, &bs);
  if (rc) return rc;
  if ((rc = check_split(rows, B, bs, prefix_tokens))) {
    free(rows);
    return rc;
  }
  const int64_t P = prefix_tokens, fo = rows[0].first, skip = (fo + P) / bs, sfo = (fo + P) % bs;
  const int64_t pblocks = kva_blocks_for(fo + P, bs);
  int64_t nnz = 0;
  for (int64_t b = 0; b < B; ++b) nnz += rows[b].nblocks - skip;
  /* arrays: prefix indptr[2], last_len, start; suffix indptr[B+1], indices, last_len[B], first[B], start[B] */
  int32_t *a32 = (int32_t *)malloc((size_t)(2 + 1 + (B + 1) + nnz + 2 * B) * sizeof(int32_t));
  int64_t *a64 = (int64_t *)malloc((size_t)(1 + B) * sizeof(int64_t));
  if (!a32 || !a64) {
    free(a32), free(a64), free(rows);
    return kva_seterr(KVA_ENOMEM, "split of a view of %lld sequences", (long long)B);
  }
  int32_t *pind = a32, *plast = a32 + 2, *sind = plast + 1, *sidx = sind + B + 1, *slast = sidx + nnz,
          *sfirst = slast + B;
  const kva_paged_view *v = view;
  pind[0] = 0, pind[1] = (int32_t)pblocks;
  plast[0] = (int32_t)(fo + P - (pblocks - 1) * bs);
  a64[0] = v->start[0];
  int32_t pos = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = rows[b].nblocks - skip;
    sind[b] = pos;
    memcpy(sidx + pos, rows[b].blocks + skip, (size_t)n * sizeof *sidx);
    pos += (int32_t)n;
    slast[b] = v->last_len[b];
    sfirst[b] = (int32_t)sfo;
    a64[1 + b] = v->start[b] + P;
  }
  sind[B] = pos;
  int32_t pfirst = (int32_t)fo;
  const kva_paged_csr pc = {1, pind, rows[0].blocks, plast, &pfirst, a64, NULL};
  const kva_paged_csr sc = {B, sind, sidx, slast, sfirst, a64 + 1, NULL};
  kva_paged_view *pv = NULL, *sv = NULL;
  rc = kva_paged_view_from_csr(v->pool, &pc, &pv);
  if (!rc && (rc = kva_paged_view_from_csr(v->pool, &sc, &sv)) < 0) {
    kva_paged_view_release(pv);
    pv = NULL;
  }
  free(a32), free(a64), free(rows);
  if (rc) return rc;
  *prefix = pv, *suffix = sv;
  return 0;
}

int kva_block_table_split(const kva_kv_view *view, int64_t prefix_tokens, int32_t *lens, int32_t *first_offset,
                          kva_block_table *prefix, kva_block_table *suffix) {
  kva_clearerr();
  if (!view) return kva_seterr(KVA_EINVAL, "view is NULL");
  if (view->layout != KVA_LAYOUT_BLOCK_TABLE)
    return kva_seterr(KVA_EINVAL, "view.layout = %d: a block-table view (kva_view_block_table)", (int)view->layout);
  if (!lens || !first_offset || !prefix || !suffix)
    return kva_seterr(KVA_EINVAL, "lens, first_offset, prefix and suffix (outputs) are required");
  prefix_row *rows;
  int64_t B, bs;
  int rc = view_rows(view, &rows, &B, &bs);
  if (rc) return rc;
  if ((rc = check_split(rows, B, bs, prefix_tokens))) {
    free(rows);
    return rc;
  }
  const kva_block_table *t = view->table;
  const int64_t P = prefix_tokens, fo = rows[0].first, skip = (fo + P) / bs;
  lens[0] = (int32_t)P, first_offset[0] = (int32_t)fo;
  for (int64_t b = 0; b < B; ++b) lens[1 + b] = (int32_t)(rows[b].len - P), first_offset[1 + b] = (int32_t)((fo + P) % bs);
  free(rows);
  memset(prefix, 0, sizeof *prefix);
  prefix->batch = 1;
  prefix->max_blocks = kva_blocks_for(fo + P, bs);
  prefix->row_stride = 0;
  prefix->blocks = t->blocks;
  prefix->seq_lens = lens;
  prefix->first_offset = first_offset;
  *suffix = *t;
  suffix->max_blocks = t->max_blocks - skip;
  suffix->row_stride = kva_block_table_stride(t);
  suffix->blocks = t->blocks + skip;
  suffix->seq_lens = lens + 1;
  suffix->first_offset = first_offset + 1;
  return 0;
}
