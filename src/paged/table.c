/* The BLOCK_TABLE layout: caller pools K [num_blocks, KVH, block_size, Dk],
 * V [num_blocks, KVH, block_size, Dv] (any strides, innermost contiguous)
 * and a kva_block_table naming each sequence's blocks. Token t of sequence b
 * is table row r = first_offset[b] + t, in block
 * blocks[b * row_stride + r / block_size] at row r % block_size.
 * Here: the kva_kv_view constructor and the checks kva_attention calls
 * (descriptors on every backend; table entries on the CPU backend only,
 * where the arrays are host memory). block_size is the pools' shape[2]: any
 * value >= 1 (caller pools need not follow KVA_BLOCK_SIZE_MIN..MAX). */
#include "paged/paged.h"

#include <stddef.h>
#include <string.h>

kva_kv_view kva_view_block_table(const kva_kv *k_pool, const kva_kv *v_pool, const kva_block_table *table) {
  kva_kv_view view;
  memset(&view, 0, sizeof view);
  view.layout = KVA_LAYOUT_BLOCK_TABLE;
  if (k_pool) view.k = *k_pool;
  if (v_pool) view.v = *v_pool;
  view.table = table;
  return view;
}

int kva_block_table_check(const kva_kv_view *view, int64_t *B, int64_t *KVH, int64_t *Dk, int64_t *Dv, int64_t *N) {
  const kva_block_table *t = view->table;
  if (!t) return kva_seterr(KVA_EINVAL, "kv.table is NULL for a block-table view (make it with kva_view_block_table)");
  if (t->batch < 1 || t->batch > INT32_MAX)
    return kva_seterr(KVA_EINVAL, "table.batch = %lld must be in [1, %d]", (long long)t->batch, INT32_MAX);
  if (t->max_blocks < 1)
    return kva_seterr(KVA_EINVAL, "table.max_blocks = %lld must be >= 1", (long long)t->max_blocks);
  if (t->row_stride != 0 && t->row_stride < t->max_blocks)
    return kva_seterr(KVA_EINVAL, "table.row_stride = %lld must be 0 (= max_blocks) or >= max_blocks = %lld",
                      (long long)t->row_stride, (long long)t->max_blocks);
  if (t->row_stride > PTRDIFF_MAX / (int64_t)sizeof(int32_t) / t->batch)
    return kva_seterr(KVA_EINVAL, "table.row_stride = %lld: a table of %lld rows would not fit in memory",
                      (long long)t->row_stride, (long long)t->batch);
  if (!t->blocks || !t->seq_lens)
    return kva_seterr(KVA_EINVAL, "table.blocks and table.seq_lens are required (table.first_offset may be NULL)");
  int rc = kva_check_kv(&view->k, "k_pool", Dk);
  if (rc) return rc;
  if ((rc = kva_check_kv(&view->v, "v_pool", Dv))) return rc;
  static const char *dims[3] = {"num_blocks", "KVH", "block_size"};
  for (int d = 0; d < 3; ++d)
    if (view->v.data.shape[d] != view->k.data.shape[d])
      return kva_seterr(KVA_ESHAPE, "v_pool.shape[%d] = %lld != k_pool.shape[%d] = %lld (the pools must share %s)", d,
                        (long long)view->v.data.shape[d], d, (long long)view->k.data.shape[d], dims[d]);
  const int64_t bs = view->k.data.shape[2];
  if (t->max_blocks > INT32_MAX / bs)
    return kva_seterr(KVA_EINVAL, "table.max_blocks * block_size = %lld * %lld exceeds %d tokens (int32 lengths)",
                      (long long)t->max_blocks, (long long)bs, INT32_MAX);
  *B = t->batch;
  *KVH = view->k.data.shape[1];
  *N = t->max_blocks * bs;
  return 0;
}

int kva_block_table_check_entries(const kva_kv_view *view, int64_t L) {
  const kva_block_table *t = view->table;
  const int64_t bs = view->k.data.shape[2], nblk = view->k.data.shape[0], cap = t->max_blocks * bs;
  const int64_t stride = kva_block_table_stride(t);
  for (int64_t b = 0; b < t->batch; ++b) {
    const int64_t first = kva_block_table_first(t, b), len = t->seq_lens[b];
    if (first < 0 || first >= bs)
      return kva_seterr(KVA_EINVAL, "table.first_offset[%lld] = %lld must be in [0, block_size = %lld)", (long long)b,
                        (long long)first, (long long)bs);
    if (len < 1 || len > cap - first)
      return kva_seterr(KVA_ESHAPE,
                        "table.seq_lens[%lld] = %lld must be in [1, max_blocks * block_size - first_offset] = [1, %lld]",
                        (long long)b, (long long)len, (long long)(cap - first));
    if (len < L)
      return kva_seterr(KVA_ESHAPE, "table.seq_lens[%lld] = %lld < L = %lld query rows", (long long)b, (long long)len,
                        (long long)L);
    const int32_t *row = t->blocks + b * stride;
    for (int64_t i = 0; i < kva_blocks_for(first + len, bs); ++i)
      if (row[i] < 0 || row[i] >= nblk)
        return kva_seterr(KVA_EINVAL, "table.blocks[%lld][%lld] = %d is out of range [0, num_blocks = %lld)",
                          (long long)b, (long long)i, row[i], (long long)nblk);
  }
  return 0;
}

int64_t kva_block_table_len(const kva_kv_view *view, int64_t b) { return view->table->seq_lens[b]; }
