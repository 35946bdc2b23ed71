/* Helpers of the paged KV tests (test_paged.c, test_paged_model.c): pool
 * formats, random float rows, and contiguous caches in a pool's format that
 * hold the expected contents, written by kva_quantize / kva_convert over a
 * whole chunk at once (independently of the pool's own write path). */
#ifndef KVA_TEST_PAGED_H
#define KVA_TEST_PAGED_H

#include "test.h"

typedef struct tp_fmt {
  kva_dtype dtype; /* float pools: element dtype; quantized: scales/biases dtype */
  int bits, group;
} tp_fmt;

void tp_fmt_str(const tp_fmt *f, char *buf, size_t n);
kva_pool_desc tp_desc(tp_fmt f, int64_t blocks, int64_t block_size, int64_t KVH, int64_t dk, int64_t dv);

/* Random float rows [KVH, T, D] of dtype dt (N(0,1) plus a per-row offset);
 * strided: rows padded (row stride > D). Free with tp_rows_free. */
kva_tensor tp_rows(kva_dtype dt, int64_t KVH, int64_t T, int64_t D, int strided);
void tp_rows_free(kva_tensor *t);
/* Rows [t0, t0+n) of a [KVH, T, D] tensor (a strided sub-view). */
kva_tensor tp_rows_slice(const kva_tensor *t, int64_t t0, int64_t n);

/* A contiguous [B, KVH, cap, D] K or V operand in a pool's format. */
typedef struct tp_kv {
  kva_kv kv;
  void *mem[3];
} tp_kv;
int tp_kv_alloc(tp_kv *c, const kva_pool_desc *d, int is_v, int64_t B, int64_t cap);
void tp_kv_free(tp_kv *c);
/* [1, KVH, n, D] slice: batch b, tokens t0..t0+n. */
kva_kv tp_kv_slice(const tp_kv *c, int64_t b, int64_t t0, int64_t n);
/* Encodes float rows [KVH, T, D] into tokens t0.. of batch b: one kva_quantize
 * (or kva_convert) call for the whole chunk. Returns 0 or a kva_status. */
int tp_kv_store(tp_kv *c, int64_t b, int64_t t0, const kva_tensor *rows);
/* Bitwise equality of n tokens (every head, data and scales/biases): a's
 * batch ba from token ta against b's batch bb from token tb. Prints the first
 * difference under `what`. */
int tp_kv_equal(const tp_kv *a, int64_t ba, int64_t ta, const tp_kv *b, int64_t bb, int64_t tb, int64_t n,
                const char *what);
/* Copies n tokens (every head, every part) from src batch sb token st to dst batch db token dt. */
void tp_kv_copy(tp_kv *dst, int64_t db, int64_t dt, const tp_kv *src, int64_t sb, int64_t st, int64_t n);
/* Gathers sequence b of a view into batch cb of contiguous caches k, v. */
int tp_gather(const kva_paged_view *view, int64_t b, tp_kv *k, tp_kv *v, int64_t cb);
#endif
