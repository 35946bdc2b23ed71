/* Paged KV: the pool, sequence state and views (contents bit for bit against
 * caches written by kva_quantize/kva_convert over whole chunks, reference
 * counts through kva_pool_check and kva_pool_block_refs, copy-on-write,
 * trims, immutable views, exhaustion and bad input with nothing changed),
 * then attention over views against the oracle and the contiguous path. */
#include "attn_check.h"
#include "test_paged.h"

#include <pthread.h>
#include <stdatomic.h>

#define F32 KVA_F32
#define F16 KVA_F16
#define BF16 KVA_BF16

/* Every float dtype, and every bits / group / scale dtype at least once. */
static const tp_fmt formats[] = {
    {F32, 0, 0}, {F16, 0, 0}, {BF16, 0, 0}, {F16, 2, 32}, {BF16, 4, 64}, {F32, 8, 128}, {F32, 4, 32}, {BF16, 8, 64},
};
#define NFORMATS ((int)(sizeof formats / sizeof formats[0]))

/* Expected contents of one sequence: K/V caches [1, KVH, cap, D] and the
 * token count. */
typedef struct expect {
  tp_kv k, v;
  int64_t len;
} expect;

static int expect_init(expect *e, const kva_pool_desc *d, int64_t cap) {
  e->len = 0;
  return tp_kv_alloc(&e->k, d, 0, 1, cap) || tp_kv_alloc(&e->v, d, 1, 1, cap) ? -1 : 0;
}
static void expect_free(expect *e) {
  tp_kv_free(&e->k);
  tp_kv_free(&e->v);
}

/* Appends T fresh random tokens to seq (input dtype in_dt, strided or not)
 * and to the expectation. Returns the kva_seq_append status. */
static int append_random(kva_pool *pool, int32_t seq, expect *e, const kva_pool_desc *d, int64_t T, kva_dtype in_dt,
                         int strided) {
  kva_tensor k = tp_rows(in_dt, d->kv_heads, T, d->dk, strided), v = tp_rows(in_dt, d->kv_heads, T, d->dv, strided);
  int rc = kva_seq_append(pool, seq, &k, &v);
  if (rc == 0 && e) {
    if (tp_kv_store(&e->k, 0, e->len, &k) || tp_kv_store(&e->v, 0, e->len, &v)) rc = KVA_EINTERNAL;
    e->len += T;
  }
  tp_rows_free(&k);
  tp_rows_free(&v);
  return rc;
}

/* Sequence contents (through a temporary view) equal the expectation's
 * tokens [from, from + len). */
static int seq_matches(kva_pool *pool, int32_t seq, const expect *e, int64_t from, const kva_pool_desc *d,
                       const char *what) {
  kva_paged_view *pv;
  if (kva_paged_view_create(pool, &seq, 1, &pv)) return 0;
  tp_kv gk, gv;
  int64_t len = kva_seq_len(pool, seq);
  int ok = len == e->len - from && !tp_kv_alloc(&gk, d, 0, 1, len) && !tp_kv_alloc(&gv, d, 1, 1, len) &&
           !tp_gather(pv, 0, &gk, &gv, 0) && tp_kv_equal(&gk, 0, 0, &e->k, 0, from, len, what) &&
           tp_kv_equal(&gv, 0, 0, &e->v, 0, from, len, what);
  if (len != e->len - from) fprintf(stderr, "    %s: length %lld, expected %lld\n", what, (long long)len,
                                    (long long)(e->len - from));
  tp_kv_free(&gk);
  tp_kv_free(&gv);
  kva_paged_view_release(pv);
  return ok;
}

/* Block ids of a sequence's table (through a temporary view). */
static int64_t seq_table(kva_pool *pool, int32_t seq, int32_t *out, int64_t cap) {
  kva_paged_view *pv;
  kva_paged_csr c;
  if (kva_paged_view_create(pool, &seq, 1, &pv) || kva_paged_view_csr(pv, &c)) return -1;
  int64_t n = c.indptr[1];
  for (int64_t i = 0; i < n && i < cap; ++i) out[i] = c.indices[i];
  kva_paged_view_release(pv);
  return n;
}

static int32_t refs_of(kva_pool *pool, int32_t blk) {
  int32_t r = -1;
  kva_pool_block_refs(pool, blk, &r);
  return r;
}

/* ------------------------------------------------------------ the pool */
TEST(paged_pool_desc) {
  kva_pool_desc d = tp_desc(formats[4], 10, 16, 2, 128, 64);
  size_t bytes;
  ASSERT_OK(kva_pool_memory_size(&d, &bytes));
  /* K words, V words, K/V scales and biases; each array 64-byte aligned. */
  size_t rows = 10 * 2 * 16;
  size_t want = rows * 128 / 2 + rows * 64 / 2 + 2 * ((rows * 2 * 2 + 63) / 64 * 64) + 2 * ((rows * 1 * 2 + 63) / 64 * 64);
  ASSERT_EQ(bytes, want);
  kva_pool *pool;
  void *mem = aligned_alloc(KVA_POOL_ALIGN, bytes);
  ASSERT_TRUE(mem != NULL);
  ASSERT_ERR(kva_pool_create(&pool, &d, (char *)mem + 4), KVA_EINVAL, "aligned");
  ASSERT_OK(kva_pool_create(&pool, &d, mem));
  kva_kv k = kva_pool_k(pool), v = kva_pool_v(pool);
  ASSERT_EQ(kva_kv_dim(&k), 128);
  ASSERT_EQ(kva_kv_dim(&v), 64);
  ASSERT_EQ(k.data.shape[0], 10);
  ASSERT_EQ(k.data.shape[1], 2);
  ASSERT_EQ(k.data.shape[2], 16);
  ASSERT_TRUE(k.data.data == mem);
  ASSERT_EQ(k.bits, 4);
  ASSERT_EQ(k.group_size, 64);
  ASSERT_EQ(k.scales.dtype, BF16);
  ASSERT_TRUE((uintptr_t)v.biases.data % KVA_POOL_ALIGN == 0);
  ASSERT_TRUE((char *)v.biases.data + 10 * 2 * 16 * 2 <= (char *)mem + bytes);
  kva_pool_stats st;
  ASSERT_OK(kva_pool_stats_get(pool, &st));
  ASSERT_EQ(st.free_blocks, 10);
  ASSERT_EQ(st.used_blocks, 0);
  kva_pool_destroy(pool);
  free(mem);

  /* Bad descriptors. */
  kva_pool_desc b = d;
  b.block_size = 7;
  ASSERT_ERR(kva_pool_create(&pool, &b, NULL), KVA_EINVAL, "block_size");
  b.block_size = 257;
  ASSERT_ERR(kva_pool_memory_size(&b, &bytes), KVA_EINVAL, "block_size");
  b = d;
  b.num_blocks = 0;
  ASSERT_ERR(kva_pool_create(&pool, &b, NULL), KVA_EINVAL, "num_blocks");
  b = d;
  b.bits = 3;
  ASSERT_ERR(kva_pool_create(&pool, &b, NULL), KVA_EUNSUPPORTED, "bits");
  b = d;
  b.group_size = 16;
  ASSERT_ERR(kva_pool_create(&pool, &b, NULL), KVA_EUNSUPPORTED, "group_size");
  b = d;
  b.dv = 96;
  ASSERT_ERR(kva_pool_create(&pool, &b, NULL), KVA_ESHAPE, "group_size");
  b = d;
  b.dtype = KVA_U32;
  ASSERT_ERR(kva_pool_create(&pool, &b, NULL), KVA_EDTYPE, "dtype");
  b = d;
  b.kv_heads = 0;
  ASSERT_ERR(kva_pool_create(&pool, &b, NULL), KVA_EINVAL, "kv_heads");
  /* too large for size_t: each array alone (~3e18 bytes) below the bound, K and V together above it */
  b = d;
  b.bits = 0;
  b.num_blocks = INT32_MAX;
  b.block_size = 256;
  b.kv_heads = 1376;
  b.dk = b.dv = 1000;
  b.dtype = KVA_F32;
  ASSERT_ERR(kva_pool_memory_size(&b, &bytes), KVA_EINVAL, "is too large");
  b.kv_heads = (int64_t)1 << 40;
  ASSERT_ERR(kva_pool_create(&pool, &b, NULL), KVA_EINVAL, "is too large");
  ASSERT_ERR(kva_pool_create(&pool, NULL, NULL), KVA_EINVAL, "desc");
  ASSERT_ERR(kva_pool_create(NULL, &d, NULL), KVA_EINVAL, "pool");
}

/* ------------------------------------------------------------ sequences */
/* Appending in random pieces (1 token .. more than a block, mixed input dtypes
 * and strides) stores exactly what one kva_quantize/kva_convert of the whole
 * cache stores. */
TEST(paged_append_bit_identical) {
  static const int64_t block_sizes[] = {8, 16, 64};
  for (int fi = 0; fi < NFORMATS; ++fi)
    for (int bi = 0; bi < 3; ++bi) {
      const tp_fmt *f = &formats[fi];
      const int64_t bs = block_sizes[bi], dk = f->group == 128 ? 256 : 128, dv = f->group == 128 ? 128 : 64;
      const int64_t total = 3 * bs + bs / 2 + 1;
      char name[64];
      tp_fmt_str(f, name, sizeof name);
      kva_pool_desc d = tp_desc(*f, 8, bs, 2, dk, dv);
      kva_pool *pool;
      ASSERT_OK(kva_pool_create(&pool, &d, NULL));
      int32_t s;
      ASSERT_OK(kva_seq_create(pool, &s));
      /* The whole cache's float rows, then appended in pieces. */
      kva_tensor K = tp_rows(F32, 2, total, dk, 0), V = tp_rows(F32, 2, total, dv, 0);
      expect e;
      ASSERT_TRUE(expect_init(&e, &d, total) == 0);
      ASSERT_OK(tp_kv_store(&e.k, 0, 0, &K));
      ASSERT_OK(tp_kv_store(&e.v, 0, 0, &V));
      e.len = total;
      int ok = 1;
      for (int64_t t = 0; t < total && ok;) {
        int64_t n = 1 + (int64_t)(test_rand_u64() % (uint64_t)(bs + 3));
        if (n > total - t) n = total - t;
        kva_tensor ks = tp_rows_slice(&K, t, n), vs = tp_rows_slice(&V, t, n);
        ok = kva_seq_append(pool, s, &ks, &vs) == 0;
        t += n;
      }
      ok = ok && kva_seq_len(pool, s) == total && kva_seq_blocks(pool, s) == 4 && kva_seq_start(pool, s) == 0 &&
           seq_matches(pool, s, &e, 0, &d, name) && kva_pool_check(pool) == 0;
      if (!ok) FAIL_("%s block %lld: appended pieces differ from the whole cache quantized at once: %s", name,
                     (long long)bs, kva_last_error());
      /* bf16 / strided inputs: same rule (convert/quantize each row). */
      int32_t s2;
      expect e2;
      ASSERT_TRUE(expect_init(&e2, &d, 40) == 0);
      ASSERT_OK(kva_seq_create(pool, &s2));
      ok = ok && append_random(pool, s2, &e2, &d, 5, BF16, 1) == 0 && append_random(pool, s2, &e2, &d, 9, F16, 0) == 0 &&
           seq_matches(pool, s2, &e2, 0, &d, name);
      if (!ok) FAIL_("%s block %lld: bf16/f16/strided input rows", name, (long long)bs);
      expect_free(&e);
      expect_free(&e2);
      tp_rows_free(&K);
      tp_rows_free(&V);
      kva_pool_destroy(pool);
      if (!ok) return;
    }
}

/* Fork shares every block; an append to a shared partial last block copies
 * it first (copy-on-write); a partial block shared only with a view is
 * appended in place and the view keeps its rows. */
TEST(paged_fork_copy_on_write) {
  kva_pool_desc d = tp_desc(formats[4], 16, 8, 2, 64, 64);
  kva_pool *pool;
  ASSERT_OK(kva_pool_create(&pool, &d, NULL));
  expect ea, eb;
  ASSERT_TRUE(expect_init(&ea, &d, 64) == 0 && expect_init(&eb, &d, 64) == 0);
  int32_t a, b, ta[8], tb[8], t2[8];
  ASSERT_OK(kva_seq_create(pool, &a));
  ASSERT_OK(append_random(pool, a, &ea, &d, 20, F32, 0)); /* blocks: 8 + 8 + 4 */
  ASSERT_OK(kva_seq_fork(pool, a, &b));
  ASSERT_TRUE(a != b);
  ASSERT_EQ(kva_seq_len(pool, b), 20);
  ASSERT_EQ(seq_table(pool, a, ta, 8), 3);
  ASSERT_EQ(seq_table(pool, b, tb, 8), 3);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(ta[i], tb[i]);
    ASSERT_EQ(refs_of(pool, ta[i]), 2);
  }
  ASSERT_OK(kva_pool_check(pool));
  /* The child's expectation: the parent's 20 tokens. */
  tp_kv_copy(&eb.k, 0, 0, &ea.k, 0, 0, 20);
  tp_kv_copy(&eb.v, 0, 0, &ea.v, 0, 0, 20);
  eb.len = 20;
  /* Parent appends into the shared partial block: copy-on-write. */
  kva_pool_stats st0, st1;
  ASSERT_OK(kva_pool_stats_get(pool, &st0));
  ASSERT_OK(append_random(pool, a, &ea, &d, 1, F32, 0));
  ASSERT_OK(kva_pool_stats_get(pool, &st1));
  ASSERT_EQ(st1.free_blocks, st0.free_blocks - 1);
  ASSERT_EQ(seq_table(pool, a, t2, 8), 3);
  ASSERT_EQ(t2[0], ta[0]);
  ASSERT_EQ(t2[1], ta[1]);
  ASSERT_TRUE(t2[2] != ta[2]);
  ASSERT_EQ(refs_of(pool, ta[2]), 1); /* now the child's alone */
  ASSERT_EQ(refs_of(pool, t2[2]), 1);
  ASSERT_EQ(refs_of(pool, ta[0]), 2);
  ASSERT_TRUE(seq_matches(pool, a, &ea, 0, &d, "parent after copy-on-write"));
  ASSERT_TRUE(seq_matches(pool, b, &eb, 0, &d, "child after the parent's append"));
  /* The child owns its partial block alone now: appends in place. */
  ASSERT_OK(append_random(pool, b, &eb, &d, 3, F32, 0));
  ASSERT_EQ(seq_table(pool, b, t2, 8), 3);
  ASSERT_EQ(t2[2], ta[2]);
  ASSERT_TRUE(seq_matches(pool, b, &eb, 0, &d, "child in place"));
  ASSERT_TRUE(seq_matches(pool, a, &ea, 0, &d, "parent after the child's append"));
  ASSERT_OK(kva_pool_check(pool));
  /* A view shares b's partial block; b appends in place; the view keeps its 23 rows. */
  kva_paged_view *pv;
  ASSERT_OK(kva_paged_view_create(pool, &b, 1, &pv));
  ASSERT_EQ(refs_of(pool, ta[2]), 2);
  ASSERT_OK(append_random(pool, b, &eb, &d, 2, F32, 0));
  ASSERT_EQ(seq_table(pool, b, t2, 8), 4);
  ASSERT_EQ(t2[2], ta[2]); /* no copy: only a view shared it */
  tp_kv gk, gv;
  ASSERT_TRUE(tp_kv_alloc(&gk, &d, 0, 1, 23) == 0 && tp_kv_alloc(&gv, &d, 1, 1, 23) == 0);
  ASSERT_OK(tp_gather(pv, 0, &gk, &gv, 0));
  ASSERT_TRUE(tp_kv_equal(&gk, 0, 0, &eb.k, 0, 0, 23, "view K after in-place append"));
  ASSERT_TRUE(tp_kv_equal(&gv, 0, 0, &eb.v, 0, 0, 23, "view V after in-place append"));
  tp_kv_free(&gk);
  tp_kv_free(&gv);
  /* Free both sequences: only the view's blocks stay; release: all free. */
  ASSERT_OK(kva_seq_free(pool, a));
  ASSERT_OK(kva_seq_free(pool, b));
  ASSERT_OK(kva_pool_check(pool));
  ASSERT_OK(kva_pool_stats_get(pool, &st1));
  ASSERT_EQ(st1.used_blocks, 3);
  ASSERT_EQ(st1.sequences, 0);
  ASSERT_EQ(st1.views, 1);
  kva_paged_view_release(pv);
  ASSERT_OK(kva_pool_stats_get(pool, &st1));
  ASSERT_EQ(st1.free_blocks, 16);
  ASSERT_OK(kva_pool_check(pool));
  /* Fork of a sequence whose last block is full: the next append needs no copy. */
  int32_t c, c2;
  ASSERT_OK(kva_seq_create(pool, &c));
  ASSERT_OK(append_random(pool, c, NULL, &d, 16, F32, 0));
  ASSERT_OK(kva_seq_fork(pool, c, &c2));
  ASSERT_OK(kva_pool_stats_get(pool, &st0));
  ASSERT_OK(append_random(pool, c, NULL, &d, 1, F32, 0));
  ASSERT_OK(kva_pool_stats_get(pool, &st1));
  ASSERT_EQ(st1.free_blocks, st0.free_blocks - 1);
  ASSERT_OK(kva_pool_check(pool));
  expect_free(&ea);
  expect_free(&eb);
  kva_pool_destroy(pool);
}

/* Sliding-window trims: whole blocks before the window return to the pool,
 * the first block keeps an offset, start positions advance. */
TEST(paged_trim) {
  kva_pool_desc d = tp_desc(formats[1], 12, 8, 2, 64, 96);
  kva_pool *pool;
  ASSERT_OK(kva_pool_create(&pool, &d, NULL));
  expect e;
  ASSERT_TRUE(expect_init(&e, &d, 200) == 0);
  int32_t s, f;
  ASSERT_OK(kva_seq_create(pool, &s));
  ASSERT_OK(append_random(pool, s, &e, &d, 50, F32, 0)); /* 7 blocks */
  kva_pool_stats st;
  ASSERT_OK(kva_seq_fork(pool, s, &f));
  ASSERT_OK(kva_seq_trim(pool, s, 30)); /* drops tokens 0..19: rows 0..19, blocks 0, 1 */
  ASSERT_EQ(kva_seq_len(pool, s), 30);
  ASSERT_EQ(kva_seq_start(pool, s), 20);
  ASSERT_EQ(kva_seq_blocks(pool, s), 5);
  ASSERT_TRUE(seq_matches(pool, s, &e, 20, &d, "trimmed to 30"));
  ASSERT_TRUE(seq_matches(pool, f, &e, 0, &d, "fork of the trimmed sequence"));
  kva_paged_view *pv;
  kva_paged_csr c;
  ASSERT_OK(kva_paged_view_create(pool, &s, 1, &pv));
  ASSERT_OK(kva_paged_view_csr(pv, &c));
  ASSERT_EQ(c.first_offset[0], 4);
  ASSERT_EQ(c.last_len[0], 2);
  ASSERT_EQ(c.lens[0], 30);
  ASSERT_EQ(c.start[0], 20);
  kva_paged_view_release(pv);
  ASSERT_OK(kva_seq_free(pool, f)); /* the two dropped blocks were only the fork's */
  ASSERT_OK(kva_pool_stats_get(pool, &st));
  ASSERT_EQ(st.used_blocks, 5);
  ASSERT_OK(kva_seq_trim(pool, s, 30)); /* no-op */
  ASSERT_OK(kva_seq_trim(pool, s, 1000));
  ASSERT_EQ(kva_seq_len(pool, s), 30);
  ASSERT_OK(kva_seq_trim(pool, s, 27)); /* offset 7 within the first block */
  ASSERT_EQ(kva_seq_blocks(pool, s), 5);
  ASSERT_TRUE(seq_matches(pool, s, &e, 23, &d, "trimmed to 27"));
  ASSERT_OK(kva_seq_trim(pool, s, 26)); /* offset reaches the block end: one block goes */
  ASSERT_EQ(kva_seq_blocks(pool, s), 4);
  ASSERT_EQ(kva_seq_start(pool, s), 24);
  ASSERT_TRUE(seq_matches(pool, s, &e, 24, &d, "trimmed to 26"));
  /* Appends continue after a trim; the window keeps moving. */
  ASSERT_OK(append_random(pool, s, &e, &d, 13, F32, 0));
  ASSERT_TRUE(seq_matches(pool, s, &e, 24, &d, "append after trim"));
  ASSERT_OK(kva_seq_trim(pool, s, 5));
  ASSERT_EQ(kva_seq_start(pool, s), 58);
  ASSERT_TRUE(seq_matches(pool, s, &e, 58, &d, "trimmed to 5"));
  ASSERT_OK(kva_pool_check(pool));
  /* Trim to nothing: every block returns; the next append starts a new block. */
  ASSERT_OK(kva_seq_trim(pool, s, 0));
  ASSERT_EQ(kva_seq_len(pool, s), 0);
  ASSERT_EQ(kva_seq_blocks(pool, s), 0);
  ASSERT_EQ(kva_seq_start(pool, s), 63);
  ASSERT_OK(kva_pool_stats_get(pool, &st));
  ASSERT_EQ(st.free_blocks, 12);
  ASSERT_OK(append_random(pool, s, &e, &d, 3, F32, 0));
  ASSERT_EQ(kva_seq_blocks(pool, s), 1);
  ASSERT_TRUE(seq_matches(pool, s, &e, 63, &d, "append after trim to 0"));
  ASSERT_ERR(kva_seq_trim(pool, s, -1), KVA_EINVAL, "keep_last");
  ASSERT_OK(kva_pool_check(pool));
  expect_free(&e);
  kva_pool_destroy(pool);
}

/* A view returns what it returned when made, whatever happens to its
 * sequences afterwards. */
TEST(paged_view_immutable) {
  kva_pool_desc d = tp_desc(formats[5], 40, 16, 2, 128, 128);
  kva_pool *pool;
  ASSERT_OK(kva_pool_create(&pool, &d, NULL));
  expect e[3];
  int32_t s[3];
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(expect_init(&e[i], &d, 200) == 0);
    ASSERT_OK(kva_seq_create(pool, &s[i]));
    ASSERT_OK(append_random(pool, s[i], &e[i], &d, 10 + 23 * i, F32, 0));
  }
  int32_t batch[4] = {s[2], s[0], s[1], s[0]}; /* any order, repeats allowed */
  kva_paged_view *pv;
  ASSERT_OK(kva_paged_view_create(pool, batch, 4, &pv));
  /* Change everything. */
  int32_t f;
  ASSERT_OK(append_random(pool, s[0], &e[0], &d, 7, F32, 0));
  ASSERT_OK(kva_seq_fork(pool, s[2], &f));
  ASSERT_OK(append_random(pool, f, NULL, &d, 30, F32, 0));
  ASSERT_OK(append_random(pool, s[2], NULL, &d, 3, F32, 0));
  ASSERT_OK(kva_seq_trim(pool, s[1], 4));
  ASSERT_OK(kva_seq_free(pool, s[2]));
  ASSERT_OK(kva_seq_free(pool, f));
  int32_t g;
  ASSERT_OK(kva_seq_create(pool, &g)); /* reuses freed blocks */
  ASSERT_OK(append_random(pool, g, NULL, &d, 100, F32, 0));
  kva_paged_csr c;
  ASSERT_OK(kva_paged_view_csr(pv, &c));
  ASSERT_EQ(c.batch, 4);
  const int src[4] = {2, 0, 1, 0};
  const int64_t lens[4] = {56, 10, 33, 10};
  tp_kv gk, gv;
  ASSERT_TRUE(tp_kv_alloc(&gk, &d, 0, 1, 64) == 0 && tp_kv_alloc(&gv, &d, 1, 1, 64) == 0);
  for (int b = 0; b < 4; ++b) {
    ASSERT_EQ(c.lens[b], lens[b]);
    ASSERT_OK(tp_gather(pv, b, &gk, &gv, 0));
    ASSERT_TRUE(tp_kv_equal(&gk, 0, 0, &e[src[b]].k, 0, 0, lens[b], "view K"));
    ASSERT_TRUE(tp_kv_equal(&gv, 0, 0, &e[src[b]].v, 0, 0, lens[b], "view V"));
  }
  ASSERT_OK(kva_pool_check(pool));
  kva_paged_view_release(pv);
  ASSERT_OK(kva_pool_check(pool));
  tp_kv_free(&gk);
  tp_kv_free(&gv);
  for (int i = 0; i < 3; ++i) expect_free(&e[i]);
  kva_pool_destroy(pool);
}

/* Out of blocks: ENOBLOCKS, a message with the counts, nothing changed. */
TEST(paged_out_of_blocks) {
  kva_pool_desc d = tp_desc(formats[3], 6, 8, 2, 64, 64);
  kva_pool *pool;
  ASSERT_OK(kva_pool_create(&pool, &d, NULL));
  expect e;
  ASSERT_TRUE(expect_init(&e, &d, 64) == 0);
  int32_t s, f;
  ASSERT_OK(kva_seq_create(pool, &s));
  ASSERT_OK(append_random(pool, s, &e, &d, 36, F32, 0)); /* 5 blocks, last with 4 rows */
  kva_pool_stats st0, st1;
  ASSERT_OK(kva_pool_stats_get(pool, &st0));
  ASSERT_ERR(append_random(pool, s, NULL, &d, 13, F32, 0), KVA_ENOBLOCKS, "needs 2 free blocks");
  ASSERT_OK(kva_pool_stats_get(pool, &st1));
  ASSERT_TRUE(memcmp(&st0, &st1, sizeof st0) == 0);
  ASSERT_EQ(kva_seq_len(pool, s), 36);
  ASSERT_TRUE(seq_matches(pool, s, &e, 0, &d, "after a failed append"));
  ASSERT_OK(kva_pool_check(pool));
  /* Copy-on-write needs a block too. */
  expect ef;
  ASSERT_TRUE(expect_init(&ef, &d, 64) == 0);
  tp_kv_copy(&ef.k, 0, 0, &e.k, 0, 0, 36);
  tp_kv_copy(&ef.v, 0, 0, &e.v, 0, 0, 36);
  ef.len = 36;
  ASSERT_OK(kva_seq_fork(pool, s, &f));
  int32_t blocks[2];
  ASSERT_OK(kva_pool_reserve(pool, 1, blocks));
  ASSERT_ERR(append_random(pool, s, NULL, &d, 1, F32, 0), KVA_ENOBLOCKS, "copy-on-write");
  ASSERT_ERR(kva_pool_reserve(pool, 1, blocks + 1), KVA_ENOBLOCKS, "only 0 free");
  ASSERT_OK(kva_pool_check(pool));
  ASSERT_OK(kva_pool_unreserve(pool, 1, blocks));
  ASSERT_OK(append_random(pool, s, &e, &d, 1, F32, 0)); /* takes the last free block (the copy) */
  ASSERT_OK(append_random(pool, f, &ef, &d, 4, F32, 0)); /* f's block is its own now: in place */
  ASSERT_ERR(append_random(pool, f, NULL, &d, 5, F32, 0), KVA_ENOBLOCKS, "needs 1 free blocks, the pool has 0");
  ASSERT_EQ(kva_seq_len(pool, f), 40);
  ASSERT_OK(kva_pool_check(pool));
  ASSERT_TRUE(seq_matches(pool, s, &e, 0, &d, "parent"));
  ASSERT_TRUE(seq_matches(pool, f, &ef, 0, &d, "fork after a failed append"));
  /* Freeing the fork returns its own blocks only. */
  ASSERT_OK(kva_seq_free(pool, f));
  ASSERT_OK(kva_pool_stats_get(pool, &st1));
  ASSERT_EQ(st1.free_blocks, 1);
  expect_free(&ef);
  expect_free(&e);
  kva_pool_destroy(pool);
}

/* Every bad input: an error code, a message naming the argument, and the
 * pool exactly as before (stats, refcounts, contents). */
TEST(paged_bad_input) {
  kva_pool_desc d = tp_desc(formats[4], 12, 8, 2, 64, 64);
  kva_pool *pool;
  ASSERT_OK(kva_pool_create(&pool, &d, NULL));
  expect e;
  ASSERT_TRUE(expect_init(&e, &d, 64) == 0);
  int32_t s, dead, empty;
  ASSERT_OK(kva_seq_create(pool, &s));
  ASSERT_OK(append_random(pool, s, &e, &d, 20, F32, 0));
  ASSERT_OK(kva_seq_create(pool, &dead));
  ASSERT_OK(append_random(pool, dead, NULL, &d, 9, F32, 0));
  ASSERT_OK(kva_seq_free(pool, dead));
  ASSERT_OK(kva_seq_create(pool, &empty));
  ASSERT_TRUE(dead != empty); /* the freed slot is reused under a new id */
  kva_pool_stats st0, st1;
  ASSERT_OK(kva_pool_stats_get(pool, &st0));
  kva_tensor k = tp_rows(F32, 2, 3, 64, 0), v = tp_rows(F32, 2, 3, 64, 0);
  kva_tensor k3 = tp_rows(F32, 3, 3, 64, 0), kd = tp_rows(F32, 2, 3, 96, 0), v4 = tp_rows(F32, 2, 4, 64, 0);
  /* Unknown and freed sequences. */
  ASSERT_ERR(kva_seq_append(pool, dead, &k, &v), KVA_ENOSEQ, "seq");
  ASSERT_ERR(kva_seq_append(pool, 12345, &k, &v), KVA_ENOSEQ, "12345");
  ASSERT_ERR(kva_seq_append(pool, -1, &k, &v), KVA_ENOSEQ, "seq");
  ASSERT_ERR(kva_seq_free(pool, dead), KVA_ENOSEQ, "seq");
  ASSERT_ERR(kva_seq_trim(pool, dead, 1), KVA_ENOSEQ, "seq");
  int32_t child;
  ASSERT_ERR(kva_seq_fork(pool, dead, &child), KVA_ENOSEQ, "parent");
  ASSERT_EQ(kva_seq_len(pool, dead), KVA_ENOSEQ);
  ASSERT_EQ(kva_seq_start(pool, dead), KVA_ENOSEQ);
  ASSERT_EQ(kva_seq_blocks(pool, 999999), KVA_ENOSEQ);
  /* Views of freed or empty sequences. */
  kva_paged_view *pv = NULL;
  int32_t batch[2] = {s, dead};
  ASSERT_ERR(kva_paged_view_create(pool, batch, 2, &pv), KVA_ENOSEQ, "seqs[1]");
  batch[1] = empty;
  ASSERT_ERR(kva_paged_view_create(pool, batch, 2, &pv), KVA_EINVAL, "empty");
  ASSERT_ERR(kva_paged_view_create(pool, batch, 0, &pv), KVA_EINVAL, "B");
  ASSERT_TRUE(pv == NULL);
  /* Mismatched rows. */
  ASSERT_ERR(kva_seq_append(pool, s, &k3, &v), KVA_ESHAPE, "k must be [KVH, T, D]");
  ASSERT_ERR(kva_seq_append(pool, s, &k, &kd), KVA_ESHAPE, "v must be");
  ASSERT_ERR(kva_seq_append(pool, s, &k, &v4), KVA_ESHAPE, "tokens");
  kva_tensor ku = k;
  ku.dtype = KVA_U32;
  ASSERT_ERR(kva_seq_append(pool, s, &ku, &v), KVA_EDTYPE, "k");
  ASSERT_ERR(kva_seq_append(pool, s, NULL, &v), KVA_EINVAL, "k");
  /* Raw rows of another format: mismatched pool formats. */
  kva_pool_desc d8 = tp_desc(formats[5], 4, 8, 2, 128, 128);
  d8.dk = d8.dv = 64;
  d8.group_size = 32;
  tp_kv rk, rv;
  ASSERT_TRUE(tp_kv_alloc(&rk, &d8, 0, 1, 3) == 0 && tp_kv_alloc(&rv, &d8, 1, 1, 3) == 0);
  ASSERT_OK(tp_kv_store(&rk, 0, 0, &k));
  ASSERT_OK(tp_kv_store(&rv, 0, 0, &v));
  ASSERT_ERR(kva_seq_append_raw(pool, s, &rk.kv, &rv.kv), KVA_EDTYPE, "mismatched pool formats");
  /* CSR views: indices out of range, free blocks, lengths beyond a table. */
  int32_t tbl[8];
  ASSERT_EQ(seq_table(pool, s, tbl, 8), 3);
  int32_t indptr[2] = {0, 3}, last[1] = {4}, fo[1] = {0};
  int32_t idx[3] = {tbl[0], tbl[1], tbl[2]};
  kva_paged_csr c = {1, indptr, idx, last, fo, NULL, NULL};
  idx[1] = 12;
  ASSERT_ERR(kva_paged_view_from_csr(pool, &c, &pv), KVA_EINVAL, "indices[1] = 12 is out of range");
  idx[1] = -3;
  ASSERT_ERR(kva_paged_view_from_csr(pool, &c, &pv), KVA_EINVAL, "indices[1]");
  int32_t freeblk = -1;
  for (int32_t b = 0; b < 12 && freeblk < 0; ++b)
    if (refs_of(pool, b) == 0) freeblk = b;
  ASSERT_TRUE(freeblk >= 0);
  idx[1] = freeblk;
  ASSERT_ERR(kva_paged_view_from_csr(pool, &c, &pv), KVA_EINVAL, "free block");
  idx[1] = tbl[1];
  last[0] = 9;
  ASSERT_ERR(kva_paged_view_from_csr(pool, &c, &pv), KVA_EINVAL, "last_len[0] = 9 is beyond the table");
  last[0] = 0;
  ASSERT_ERR(kva_paged_view_from_csr(pool, &c, &pv), KVA_EINVAL, "last_len[0]");
  last[0] = 4;
  fo[0] = 8;
  ASSERT_ERR(kva_paged_view_from_csr(pool, &c, &pv), KVA_EINVAL, "first_offset[0]");
  fo[0] = 0;
  indptr[0] = 1;
  ASSERT_ERR(kva_paged_view_from_csr(pool, &c, &pv), KVA_EINVAL, "indptr[0]");
  indptr[0] = 0;
  indptr[1] = 0;
  ASSERT_ERR(kva_paged_view_from_csr(pool, &c, &pv), KVA_EINVAL, "at least one block");
  indptr[1] = 3;
  c.batch = 0;
  ASSERT_ERR(kva_paged_view_from_csr(pool, &c, &pv), KVA_EINVAL, "batch");
  c.batch = 1;
  int64_t start[1] = {-1};
  c.start = start;
  ASSERT_ERR(kva_paged_view_from_csr(pool, &c, &pv), KVA_EINVAL, "csr.start[0] = -1 must be an absolute position");
  start[0] = INT64_MAX - 5;
  ASSERT_ERR(kva_paged_view_from_csr(pool, &c, &pv), KVA_EINVAL, "csr.start[0]");
  c.start = NULL;
  ASSERT_TRUE(pv == NULL);
  /* Reservations: only reserved blocks go back, all or nothing. */
  int32_t un[2] = {tbl[0], tbl[0]};
  ASSERT_ERR(kva_pool_unreserve(pool, 1, un), KVA_EINVAL, "not reserved");
  int32_t r[2];
  ASSERT_OK(kva_pool_reserve(pool, 1, r));
  un[0] = un[1] = r[0];
  ASSERT_ERR(kva_pool_unreserve(pool, 2, un), KVA_EINVAL, "repeated");
  ASSERT_OK(kva_pool_unreserve(pool, 1, un));
  /* Nothing changed. */
  ASSERT_OK(kva_pool_stats_get(pool, &st1));
  ASSERT_TRUE(memcmp(&st0, &st1, sizeof st0) == 0);
  ASSERT_OK(kva_pool_check(pool));
  ASSERT_TRUE(seq_matches(pool, s, &e, 0, &d, "after bad input"));
  ASSERT_EQ(kva_seq_len(pool, empty), 0);
  /* A good CSR view of the same table works, and gathers the same rows. */
  ASSERT_OK(kva_paged_view_from_csr(pool, &c, &pv));
  tp_kv gk, gv;
  ASSERT_TRUE(tp_kv_alloc(&gk, &d, 0, 1, 20) == 0 && tp_kv_alloc(&gv, &d, 1, 1, 20) == 0);
  ASSERT_OK(tp_gather(pv, 0, &gk, &gv, 0));
  ASSERT_TRUE(tp_kv_equal(&gk, 0, 0, &e.k, 0, 0, 20, "csr view K"));
  /* Gather into a destination of the wrong format or size. */
  kva_kv small = tp_kv_slice(&gk, 0, 0, 19), gvs = tp_kv_slice(&gv, 0, 0, 20);
  ASSERT_ERR(kva_paged_view_gather(pv, 0, &small, &gvs), KVA_ESHAPE, "k must be");
  kva_kv rks = tp_kv_slice(&rk, 0, 0, 3);
  ASSERT_ERR(kva_paged_view_gather(pv, 0, &rks, &gvs), KVA_ESHAPE, "k");
  ASSERT_ERR(kva_paged_view_gather(pv, 1, &gk.kv, &gv.kv), KVA_EINVAL, "b = 1");
  ASSERT_ERR(kva_paged_view_gather(NULL, 0, &gk.kv, &gv.kv), KVA_EINVAL, "view");
  /* Attention over a view whose k/v do not describe its pool. */
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  float qbuf[4 * 64], obuf[4 * 64];
  for (int i = 0; i < 4 * 64; ++i) qbuf[i] = test_randn();
  kva_tensor q = kva_tensor_4d(qbuf, F32, 1, 4, 1, 64), out = kva_tensor_4d(obuf, F32, 1, 4, 1, 64);
  kva_kv_view view = kva_view_paged(pv);
  ASSERT_OK(kva_attention(ctx, &q, &view, NULL, &out, NULL, 0));
  kva_kv_view bad = view;
  bad.k.bits = 8;
  ASSERT_ERR(kva_attention(ctx, &q, &bad, NULL, &out, NULL, 0), KVA_EDTYPE, "mismatched pool formats");
  bad = view;
  bad.v = rk.kv;
  ASSERT_ERR(kva_attention(ctx, &q, &bad, NULL, &out, NULL, 0), KVA_EDTYPE, "mismatched pool formats");
  bad = view;
  bad.paged = NULL;
  ASSERT_ERR(kva_attention(ctx, &q, &bad, NULL, &out, NULL, 0), KVA_EINVAL, "paged");
  kva_context_destroy(ctx);
  kva_paged_view_release(pv);
  ASSERT_OK(kva_pool_check(pool));
  ASSERT_OK(kva_pool_stats_get(pool, &st1));
  ASSERT_TRUE(memcmp(&st0, &st1, sizeof st0) == 0);
  tp_kv_free(&gk);
  tp_kv_free(&gv);
  tp_kv_free(&rk);
  tp_kv_free(&rv);
  tp_rows_free(&k);
  tp_rows_free(&v);
  tp_rows_free(&k3);
  tp_rows_free(&kd);
  tp_rows_free(&v4);
  expect_free(&e);
  kva_pool_destroy(pool);
}

/* Randomized bad input to the state layer. Appends whose K/V row
 * descriptors carry one to three random mutations (att_mutate_tensor:
 * ranks, dtypes, shapes, strides, NULL pointers; now and then a bad
 * sequence id) must fail with a message and change nothing (pool
 * statistics, kva_pool_check, the sequence's length and contents), or
 * succeed and store bit for bit what kva_quantize / kva_convert make of
 * the same descriptors (tp_kv_store). CSR views from the arrays of a live
 * view with one random bad entry (batch, indptr, a block id, last length,
 * first offset, start) must fail the same way, or, accepted, hold their
 * references until released (kva_pool_check). Run under ASan and UBSan by
 * `make test`. */
static int paged_stats_same(kva_pool *pool, const kva_pool_stats *a) {
  kva_pool_stats b;
  return kva_pool_stats_get(pool, &b) == 0 && memcmp(a, &b, sizeof b) == 0;
}

static void mutate_csr(kva_paged_csr *c, int32_t *indptr, int32_t *indices, int32_t *last, int32_t *fo,
                       int64_t *start, int64_t nblk, int64_t bs) {
  const int64_t n = indptr[1];
  switch (att_pick(7)) {
  case 0: { /* (a larger batch or index count describes arrays the caller does not have) */
    const int64_t vals[] = {0, -1, INT64_MIN};
    c->batch = vals[att_pick(3)];
    break;
  }
  case 1: {
    const int32_t vals[] = {-1, 1, INT32_MIN};
    indptr[0] = vals[att_pick(3)];
    break;
  }
  case 2: { /* n + 1: one more entry of the 64-entry array (a valid block id or -1) */
    const int32_t vals[] = {0, -1, INT32_MIN, (int32_t)n - 1, (int32_t)n + 1};
    indptr[1] = vals[att_pick(5)];
    break;
  }
  case 3: { /* a block id: out of the pool, or any block (free or not) */
    const int64_t vals[] = {-1, nblk, INT32_MAX, INT32_MIN, att_pick((int)nblk)};
    indices[att_pick((int)n)] = (int32_t)vals[att_pick(5)];
    break;
  }
  case 4: {
    const int64_t vals[] = {INT32_MIN, -1, 0, 1, bs - 1, bs, bs + 1};
    last[0] = (int32_t)vals[att_pick(7)];
    break;
  }
  case 5: {
    const int64_t vals[] = {INT32_MIN, -1, 0, 1, bs - 1, bs};
    fo[0] = (int32_t)vals[att_pick(6)];
    c->first_offset = fo;
    break;
  }
  default: {
    const int64_t vals[] = {-1, 0, 5, INT64_MAX - 3, INT64_MIN};
    start[0] = vals[att_pick(5)];
    c->start = start;
    break;
  }
  }
}

TEST(paged_random_mutations) {
  const int iters = test_quick ? 300 : 1500;
  const tp_fmt fmts[] = {formats[4], formats[2], formats[3]}; /* q4 g64 bf16 scales, bf16 rows, q2 g32 f16 scales */
  for (size_t fi = 0; fi < sizeof fmts / sizeof fmts[0]; ++fi) {
    const kva_pool_desc d = tp_desc(fmts[fi], 96, 8, 2, 64, 64);
    const int64_t cap = 512;
    kva_pool *pool;
    ASSERT_OK(kva_pool_create(&pool, &d, NULL));
    expect e;
    ASSERT_TRUE(expect_init(&e, &d, cap) == 0);
    int32_t s, gone;
    ASSERT_OK(kva_seq_create(pool, &gone));
    ASSERT_OK(kva_seq_free(pool, gone));
    ASSERT_OK(kva_seq_create(pool, &s));
    ASSERT_OK(append_random(pool, s, &e, &d, 11, F32, 0));
    int accepted = 0, csr_accepted = 0;
    for (int it = 0; it < iters; ++it) {
      if (e.len > cap - 16) { /* start over with a fresh sequence */
        ASSERT_OK(kva_seq_free(pool, s));
        ASSERT_OK(kva_seq_create(pool, &s));
        e.len = 0;
        ASSERT_OK(append_random(pool, s, &e, &d, 1 + att_pick(9), F32, 0));
      }
      kva_pool_stats st0;
      ASSERT_OK(kva_pool_stats_get(pool, &st0));
      const int64_t len0 = kva_seq_len(pool, s);
      if (att_pick(4)) { /* a mutated append */
        static const kva_dtype dts[] = {F32, F16, BF16};
        const int64_t T = 1 + att_pick(6);
        const kva_dtype dt = dts[att_pick(3)];
        kva_tensor k = tp_rows(dt, d.kv_heads, T, d.dk, att_pick(2)), v = tp_rows(dt, d.kv_heads, T, d.dv, att_pick(2));
        kva_tensor km = k, vm = v;
        int32_t seq = s;
        const int nm = att_pick(4) ? 1 : 2 + att_pick(2); /* mostly one: some are valid */
        for (int m = 0; m < nm; ++m) {
          const int w = att_pick(9);
          if (w == 8) {
            const int32_t ids[] = {-1, gone, INT32_MAX, s + 1000};
            seq = ids[att_pick(4)];
          } else
            att_mutate_tensor(w % 2 ? &vm : &km);
        }
        const int rc = kva_seq_append(pool, seq, &km, &vm);
        if (rc < 0) {
          if (!kva_last_error()[0]) FAIL_("iteration %d: append failed (%d) without a message", it, rc);
          if (!paged_stats_same(pool, &st0) || kva_seq_len(pool, s) != len0)
            FAIL_("iteration %d: a failed append (%s) changed the pool", it, kva_last_error());
        } else {
          ++accepted;
          const int64_t Tm = km.ndim == 3 ? km.shape[1] : -1;
          if (km.ndim != 3 || vm.ndim != 3 || vm.shape[1] != Tm || kva_seq_len(pool, s) != len0 + Tm) {
            FAIL_("iteration %d: accepted rows of rank %d / %d, %lld tokens, length %lld -> %lld", it, km.ndim,
                  vm.ndim, (long long)Tm, (long long)len0, (long long)kva_seq_len(pool, s));
          } else if (tp_kv_store(&e.k, 0, e.len, &km) || tp_kv_store(&e.v, 0, e.len, &vm)) {
            FAIL_("iteration %d: append accepted rows kva_quantize/kva_convert refuse: %s", it, kva_last_error());
          } else {
            e.len += Tm;
          }
        }
        tp_rows_free(&k);
        tp_rows_free(&v);
      } else { /* a CSR view with one bad entry */
        kva_paged_view *pv, *bad = NULL;
        kva_paged_csr c;
        ASSERT_OK(kva_paged_view_create(pool, &s, 1, &pv));
        ASSERT_OK(kva_paged_view_csr(pv, &c));
        ASSERT_OK(kva_pool_stats_get(pool, &st0));
        const int32_t nb = c.indptr[1];
        int32_t indptr[2] = {c.indptr[0], c.indptr[1]}, last[1] = {c.last_len[0]};
        int32_t fo[1] = {c.first_offset ? c.first_offset[0] : 0}, idx[65];
        int64_t start[1] = {c.start ? c.start[0] : 0};
        ASSERT_TRUE(nb <= 64);
        for (int32_t i = 0; i < 65; ++i) idx[i] = i < nb ? c.indices[i] : (i % 2 ? -1 : i);
        kva_paged_csr m = {1, indptr, idx, last, c.first_offset ? fo : NULL, c.start ? start : NULL, NULL};
        mutate_csr(&m, indptr, idx, last, fo, start, d.num_blocks, d.block_size);
        const int rc = kva_paged_view_from_csr(pool, &m, &bad);
        if (rc < 0) {
          if (!kva_last_error()[0]) FAIL_("iteration %d: CSR view failed (%d) without a message", it, rc);
          if (bad || !paged_stats_same(pool, &st0))
            FAIL_("iteration %d: a failed CSR view (%s) changed the pool", it, kva_last_error());
        } else {
          ++csr_accepted;
          if (kva_pool_check(pool)) FAIL_("iteration %d: after an accepted CSR view: %s", it, kva_last_error());
          kva_paged_view_release(bad);
          if (!paged_stats_same(pool, &st0)) FAIL_("iteration %d: a released CSR view left references", it);
        }
        kva_paged_view_release(pv);
      }
      if (test_failed_flag) break;
      if (it % 50 == 49 && (kva_pool_check(pool) || !seq_matches(pool, s, &e, 0, &d, "after mutated calls"))) {
        FAIL_("iteration %d: pool check or contents", it);
        break;
      }
    }
    char fs[64];
    tp_fmt_str(&fmts[fi], fs, sizeof fs);
    fprintf(stderr, "  %s: %d mutated calls, %d appends and %d CSR views accepted\n", fs, iters, accepted,
            csr_accepted);
    if (!test_failed_flag) {
      ASSERT_OK(kva_pool_check(pool));
      ASSERT_TRUE(seq_matches(pool, s, &e, 0, &d, "at the end"));
      if (accepted == 0) FAIL_("%s: no mutated append was accepted", fs);
    }
    expect_free(&e);
    kva_pool_destroy(pool);
    if (test_failed_flag) return;
  }
}

/* Destroying a pool with live views: the views stay readable until released
 * (the pool's memory goes with the last one; ASan sees any leak). */
TEST(paged_destroy_with_live_views) {
  kva_pool_desc d = tp_desc(formats[0], 8, 8, 1, 64, 64);
  kva_pool *pool;
  ASSERT_OK(kva_pool_create(&pool, &d, NULL));
  expect e;
  ASSERT_TRUE(expect_init(&e, &d, 32) == 0);
  int32_t s;
  ASSERT_OK(kva_seq_create(pool, &s));
  ASSERT_OK(append_random(pool, s, &e, &d, 19, F32, 0));
  kva_paged_view *v1, *v2;
  ASSERT_OK(kva_paged_view_create(pool, &s, 1, &v1));
  ASSERT_OK(kva_paged_view_create(pool, &s, 1, &v2));
  int32_t r[2];
  ASSERT_OK(kva_pool_reserve(pool, 2, r));
  kva_pool_destroy(pool);
  tp_kv gk, gv;
  ASSERT_TRUE(tp_kv_alloc(&gk, &d, 0, 1, 19) == 0 && tp_kv_alloc(&gv, &d, 1, 1, 19) == 0);
  kva_paged_view_release(v1);
  ASSERT_OK(tp_gather(v2, 0, &gk, &gv, 0));
  ASSERT_TRUE(tp_kv_equal(&gk, 0, 0, &e.k, 0, 0, 19, "view after kva_pool_destroy"));
  ASSERT_TRUE(tp_kv_equal(&gv, 0, 0, &e.v, 0, 0, 19, "view after kva_pool_destroy"));
  kva_paged_view_release(v2);
  kva_paged_view_release(NULL);
  kva_pool_destroy(NULL);
  tp_kv_free(&gk);
  tp_kv_free(&gv);
  expect_free(&e);
}

/* Caller-managed blocks: reserve, write rows through kva_pool_k/v, describe
 * them with CSR arrays; the view keeps them alive past kva_pool_unreserve. */
TEST(paged_reserve_and_csr) {
  kva_pool_desc d = tp_desc(formats[6], 10, 16, 2, 64, 64);
  kva_pool *pool;
  ASSERT_OK(kva_pool_create(&pool, &d, NULL));
  int32_t blk[3];
  ASSERT_OK(kva_pool_reserve(pool, 3, blk));
  /* Tokens 5..40 of a 3-block table (first_offset 5, last_len 9). */
  expect e;
  ASSERT_TRUE(expect_init(&e, &d, 48) == 0);
  kva_tensor K = tp_rows(F32, 2, 48, 64, 0), V = tp_rows(F32, 2, 48, 64, 0);
  ASSERT_OK(tp_kv_store(&e.k, 0, 0, &K));
  ASSERT_OK(tp_kv_store(&e.v, 0, 0, &V));
  kva_kv pk = kva_pool_k(pool), pvv = kva_pool_v(pool);
  for (int i = 0; i < 3; ++i)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t r = 0; r < 16; ++r) {
        const kva_tensor *src[6] = {&e.k.kv.data, &e.k.kv.scales, &e.k.kv.biases, &e.v.kv.data, &e.v.kv.scales, &e.v.kv.biases};
        const kva_tensor *dst[6] = {&pk.data, &pk.scales, &pk.biases, &pvv.data, &pvv.scales, &pvv.biases};
        for (int a = 0; a < 6; ++a)
          memcpy((char *)dst[a]->data + blk[i] * dst[a]->stride[0] + h * dst[a]->stride[1] + r * dst[a]->stride[2],
                 (char *)src[a]->data + h * src[a]->stride[1] + (i * 16 + r) * src[a]->stride[2],
                 (size_t)(dst[a]->shape[3] * (int64_t)kva_dtype_size(dst[a]->dtype)));
      }
  int32_t indptr[2] = {0, 3}, last[1] = {9}, fo[1] = {5};
  int64_t start[1] = {1000};
  kva_paged_csr c = {1, indptr, blk, last, fo, start, NULL};
  kva_paged_view *pv;
  ASSERT_OK(kva_paged_view_from_csr(pool, &c, &pv));
  ASSERT_OK(kva_pool_unreserve(pool, 3, blk));
  ASSERT_EQ(refs_of(pool, blk[0]), 1);
  kva_paged_csr out;
  ASSERT_OK(kva_paged_view_csr(pv, &out));
  ASSERT_EQ(out.lens[0], 36);
  ASSERT_EQ(out.start[0], 1000);
  tp_kv gk, gv;
  ASSERT_TRUE(tp_kv_alloc(&gk, &d, 0, 1, 36) == 0 && tp_kv_alloc(&gv, &d, 1, 1, 36) == 0);
  ASSERT_OK(tp_gather(pv, 0, &gk, &gv, 0));
  ASSERT_TRUE(tp_kv_equal(&gk, 0, 0, &e.k, 0, 5, 36, "csr view K"));
  ASSERT_TRUE(tp_kv_equal(&gv, 0, 0, &e.v, 0, 5, 36, "csr view V"));
  ASSERT_OK(kva_pool_check(pool));
  kva_paged_view_release(pv);
  kva_pool_stats st;
  ASSERT_OK(kva_pool_stats_get(pool, &st));
  ASSERT_EQ(st.free_blocks, 10);
  ASSERT_OK(kva_pool_check(pool));
  tp_kv_free(&gk);
  tp_kv_free(&gv);
  tp_rows_free(&K);
  tp_rows_free(&V);
  expect_free(&e);
  kva_pool_destroy(pool);
}

/* kva_pool_from_contiguous copies each sequence bit for bit (quantized K/V
 * as they are), in order or scattered over the pool. */
TEST(paged_from_contiguous) {
  for (int fi = 0; fi < NFORMATS; ++fi) {
    const tp_fmt *f = &formats[fi];
    kva_pool_desc d = tp_desc(*f, 1, 8, 2, 128, 128);
    const int64_t B = 3, N = 77;
    tp_kv ck, cv;
    ASSERT_TRUE(tp_kv_alloc(&ck, &d, 0, B, N) == 0 && tp_kv_alloc(&cv, &d, 1, B, N) == 0);
    for (int64_t b = 0; b < B; ++b) {
      kva_tensor K = tp_rows(F32, 2, N, 128, 0), V = tp_rows(F32, 2, N, 128, 0);
      ASSERT_OK(tp_kv_store(&ck, b, 0, &K));
      ASSERT_OK(tp_kv_store(&cv, b, 0, &V));
      tp_rows_free(&K);
      tp_rows_free(&V);
    }
    int32_t lens[3] = {77, 1, 40}, seqs[3];
    kva_kv_view cview = kva_view_contiguous(&ck.kv, &cv.kv, lens);
    for (int shuffle = 0; shuffle < 2; ++shuffle) {
      kva_pool *pool;
      ASSERT_OK(kva_pool_from_contiguous(&pool, &cview, 16, 2, shuffle ? 0x1234 : 0, seqs));
      kva_pool_desc pd = kva_pool_get_desc(pool);
      ASSERT_EQ(pd.num_blocks, 5 + 1 + 3 + 2);
      ASSERT_EQ(pd.bits, f->bits);
      kva_paged_view *pv;
      ASSERT_OK(kva_paged_view_create(pool, seqs, 3, &pv));
      tp_kv gk, gv;
      ASSERT_TRUE(tp_kv_alloc(&gk, &d, 0, 1, N) == 0 && tp_kv_alloc(&gv, &d, 1, 1, N) == 0);
      for (int64_t b = 0; b < B; ++b) {
        ASSERT_OK(tp_gather(pv, b, &gk, &gv, 0));
        ASSERT_TRUE(tp_kv_equal(&gk, 0, 0, &ck, b, 0, lens[b], "from_contiguous K"));
        ASSERT_TRUE(tp_kv_equal(&gv, 0, 0, &cv, b, 0, lens[b], "from_contiguous V"));
      }
      kva_paged_csr c;
      ASSERT_OK(kva_paged_view_csr(pv, &c));
      int in_order = 1;
      for (int32_t i = 0; i < c.indptr[3]; ++i) in_order &= c.indices[i] == i;
      ASSERT_EQ(in_order, !shuffle);
      ASSERT_OK(kva_pool_check(pool));
      tp_kv_free(&gk);
      tp_kv_free(&gv);
      kva_paged_view_release(pv);
      kva_pool_destroy(pool);
    }
    /* K and V of different formats cannot share a pool. */
    kva_pool_desc d2 = tp_desc(formats[(fi + 1) % NFORMATS], 1, 8, 2, 128, 128);
    tp_kv cv2;
    ASSERT_TRUE(tp_kv_alloc(&cv2, &d2, 1, B, N) == 0);
    kva_kv_view mixed = kva_view_contiguous(&ck.kv, &cv2.kv, lens);
    kva_pool *pool = NULL;
    ASSERT_ERR(kva_pool_from_contiguous(&pool, &mixed, 16, 0, 0, seqs), KVA_EDTYPE, "mismatched pool formats");
    tp_kv_free(&cv2);
    lens[1] = 0;
    ASSERT_ERR(kva_pool_from_contiguous(&pool, &cview, 16, 0, 0, seqs), KVA_ESHAPE, "seq_lens[1]");
    ASSERT_TRUE(pool == NULL);
    tp_kv_free(&ck);
    tp_kv_free(&cv);
  }
}

/* Pool calls from two threads at once (the pool's mutex): appends, forks,
 * views and frees on separate sequences, then a full invariant check. */
typedef struct thr_arg {
  kva_pool *pool;
  int rounds, failed;
} thr_arg;

static void *thr_main(void *p) {
  thr_arg *a = (thr_arg *)p;
  kva_pool_desc d = kva_pool_get_desc(a->pool);
  float kbuf[2 * 3 * 64], vbuf[2 * 3 * 64];
  for (int i = 0; i < 2 * 3 * 64; ++i) kbuf[i] = vbuf[i] = (float)(i % 17) * 0.25f - 2.0f;
  kva_tensor k = kva_tensor_4d(kbuf, F32, 1, 2, 3, 64), v = kva_tensor_4d(vbuf, F32, 1, 2, 3, 64);
  k.ndim = v.ndim = 3; /* [KVH, T, D] */
  for (int d2 = 0; d2 < 3; ++d2) {
    k.shape[d2] = k.shape[d2 + 1];
    k.stride[d2] = k.stride[d2 + 1];
    v.shape[d2] = v.shape[d2 + 1];
    v.stride[d2] = v.stride[d2 + 1];
  }
  (void)d;
  for (int r = 0; r < a->rounds; ++r) {
    int32_t s, f;
    kva_paged_view *pv;
    if (kva_seq_create(a->pool, &s)) { a->failed = 1; return NULL; }
    for (int i = 0; i < 5; ++i)
      if (kva_seq_append(a->pool, s, &k, &v)) a->failed = 1;
    if (kva_seq_fork(a->pool, s, &f) || kva_seq_append(a->pool, f, &k, &v)) a->failed = 1;
    if (kva_paged_view_create(a->pool, &f, 1, &pv)) a->failed = 1;
    else kva_paged_view_release(pv);
    if (kva_seq_trim(a->pool, s, 4) || kva_seq_free(a->pool, s) || kva_seq_free(a->pool, f)) a->failed = 1;
  }
  return NULL;
}

/* Appends, forks, trims and frees on a sequence while another thread
 * attends over an older view of it: the view's results never change. */
typedef struct writer_arg {
  kva_pool *pool;
  int32_t seq;
  atomic_int stop;
  int failed;
} writer_arg;

static void *writer_main(void *p) {
  writer_arg *a = (writer_arg *)p;
  float buf[2 * 5 * 64];
  for (int i = 0; i < 2 * 5 * 64; ++i) buf[i] = (float)(i % 13) * 0.5f - 3.0f;
  kva_tensor k = kva_tensor_2d(buf, F32, 2, 5 * 64);
  k.ndim = 3;
  k.shape[1] = 5;
  k.shape[2] = 64;
  k.stride[2] = 4;
  k.stride[1] = 64 * 4;
  k.stride[0] = 5 * 64 * 4;
  while (!atomic_load(&a->stop)) {
    int32_t f;
    if (kva_seq_append(a->pool, a->seq, &k, &k) != 0 && kva_seq_trim(a->pool, a->seq, 7) != 0) a->failed = 1;
    if (kva_seq_fork(a->pool, a->seq, &f) == 0) {
      kva_seq_append(a->pool, f, &k, &k);
      kva_seq_free(a->pool, f);
    }
    if (kva_seq_len(a->pool, a->seq) > 200) kva_seq_trim(a->pool, a->seq, 3);
  }
  return NULL;
}

TEST(paged_attention_while_writing) {
  kva_pool_desc d = tp_desc(formats[4], 256, 16, 2, 64, 64);
  kva_pool *pool;
  ASSERT_OK(kva_pool_create(&pool, &d, NULL));
  writer_arg a = {pool, 0, 0, 0};
  ASSERT_OK(kva_seq_create(pool, &a.seq));
  ASSERT_OK(append_random(pool, a.seq, NULL, &d, 37, F32, 0)); /* partial last block: appended in place */
  kva_paged_view *pv;
  ASSERT_OK(kva_paged_view_create(pool, &a.seq, 1, &pv));
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 1, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  float qb[4 * 2 * 64], first[4 * 2 * 64], ob[4 * 2 * 64];
  for (int i = 0; i < 4 * 2 * 64; ++i) qb[i] = test_randn();
  kva_tensor q = kva_tensor_4d(qb, F32, 1, 4, 2, 64), out = kva_tensor_4d(ob, F32, 1, 4, 2, 64);
  kva_tensor out1 = kva_tensor_4d(first, F32, 1, 4, 2, 64);
  kva_kv_view view = kva_view_paged(pv);
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = KVA_MASK_CAUSAL;
  ASSERT_OK(kva_attention(ctx, &q, &view, &p, &out1, NULL, 0));
  pthread_t t;
  ASSERT_TRUE(pthread_create(&t, NULL, writer_main, &a) == 0);
  int same = 1, rounds = test_quick ? 200 : 2000;
  for (int r = 0; r < rounds && same; ++r) {
    if (kva_attention(ctx, &q, &view, &p, &out, NULL, 0)) same = 0;
    same = same && memcmp(ob, first, sizeof ob) == 0;
  }
  atomic_store(&a.stop, 1);
  pthread_join(t, NULL);
  ASSERT_TRUE(same);
  ASSERT_EQ(a.failed, 0);
  kva_context_destroy(ctx);
  kva_paged_view_release(pv);
  ASSERT_OK(kva_pool_check(pool));
  kva_pool_destroy(pool);
}

TEST(paged_threads) {
  kva_pool_desc d = tp_desc(formats[0], 64, 8, 2, 64, 64);
  kva_pool *pool;
  ASSERT_OK(kva_pool_create(&pool, &d, NULL));
  thr_arg a[2] = {{pool, test_quick ? 50 : 500, 0}, {pool, test_quick ? 50 : 500, 0}};
  pthread_t t[2];
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(pthread_create(&t[i], NULL, thr_main, &a[i]) == 0);
  for (int i = 0; i < 2; ++i) pthread_join(t[i], NULL);
  ASSERT_EQ(a[0].failed + a[1].failed, 0);
  ASSERT_OK(kva_pool_check(pool));
  kva_pool_stats st;
  ASSERT_OK(kva_pool_stats_get(pool, &st));
  ASSERT_EQ(st.free_blocks, 64);
  ASSERT_EQ(st.sequences, 0);
  kva_pool_destroy(pool);
}

/* ------------------------------------------------------------ attention */
typedef struct paged_case {
  att_case c;
  int block; /* block size */
} paged_case;

/* B, H, KVH, L, N, Dk, Dv, q, out, kbits, vbits, group, kv/scale dtype, mask, window, softcap, sinks, ragged, strided; block */
static const paged_case pcases[] = {
    /* decode over float and quantized pools, every block size class */
    {{1, 8, 4, 1, 113, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 16},
    {{3, 8, 2, 1, 700, 64, 64, F32, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 1, 1}, 8},
    {{3, 8, 4, 1, 1000, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16},
    {{2, 8, 4, 1, 4097, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 64},
    {{2, 6, 2, 4, 300, 128, 128, F32, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 0, 1, 1}, 256},
    {{2, 6, 2, 8, 300, 128, 128, F32, F32, 2, 2, 128, F32, MASK_CAUSAL, 0, 0, 0, 1, 0}, 24},
    /* verify rows, GQA 6 and 1 */
    {{1, 24, 4, 8, 1000, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 16},
    {{3, 8, 8, 16, 600, 128, 128, F32, F32, 8, 8, 64, F32, MASK_CAUSAL, 0, 0, 0, 1, 0}, 64},
    /* Dk != Dv, head dim 80 */
    {{2, 4, 2, 3, 150, 192, 128, F32, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 8},
    {{1, 4, 2, 2, 150, 80, 80, F32, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1}, 16},
    {{2, 4, 2, 2, 150, 256, 512, F32, F32, 4, 4, 64, F32, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16},
    /* window, segments, softcap, sinks, no mask */
    {{2, 8, 4, 1, 1000, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_WINDOW, 100, 0, 0, 1, 0}, 16},
    {{2, 8, 4, 8, 700, 128, 128, F32, F32, 0, 0, 0, F32, MASK_WINDOW, 5, 0, 0, 1, 0}, 8},
    {{2, 4, 2, 12, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_SEG, 0, 0, 0, 1, 0}, 16},
    {{1, 4, 2, 12, 300, 64, 64, F32, F32, 4, 4, 32, F32, MASK_SEG_CLAMP, 7, 0, 0, 0, 1}, 64},
    {{2, 8, 4, 3, 500, 128, 128, F32, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 5.0f, 1, 1, 0}, 16},
    {{2, 8, 2, 1, 300, 64, 64, F32, F32, 8, 8, 64, BF16, MASK_NONE, 0, 0, 1, 1, 0}, 64},
    /* the fallback (explicit masks) and long L (row groups) */
    {{2, 4, 2, 5, 200, 64, 64, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, 0, 1, 0}, 16},
    {{2, 4, 2, 5, 200, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_ADD, 0, 0, 1, 1, 1}, 64},
    {{2, 4, 2, 40, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16},
    {{3, 4, 4, 17, 17, 128, 128, F32, F32, 4, 4, 32, F32, MASK_CAUSAL, 0, 0, 0, 1, 0}, 8},
};
#define NPCASES ((int)(sizeof pcases / sizeof pcases[0]))



/* Runs attention over the paged view and checks the sentinel, the oracle,
 * and the contiguous path run at the same SIMD level and thread count
 * (into `contig`): equal up to f32 summation order and one output rounding. */
static int paged_run(const char *name, kva_context *ctx, const char *level, att_data *d, const kva_kv_view *view,
                     const kva_tensor *exact, kva_tensor *rref, kva_tensor *contig) {
  const kva_tensor *ref = att_oracle_for(ctx, &d->q, view, &d->params, &d->out, exact, rref);
  if (!ref || kva_attention(ctx, &d->q, &d->view, &d->params, contig, NULL, 0)) {
    FAIL_("%s [%s]: contiguous attention: %s", name, level, kva_last_error());
    return 0;
  }
  att_poison(d);
  const double atol = att_kernel_atol(ctx, &d->q, view, &d->params, &d->out);
  const double atol_c = att_kernel_atol(ctx, &d->q, &d->view, &d->params, contig);
  int rc = kva_attention(ctx, &d->q, view, &d->params, &d->out, NULL, 0);
  double err = 0;
  if (rc) FAIL_("%s [%s, %d threads]: kva_attention: %s", name, level, kva_context_threads(ctx), kva_last_error());
  else if (!att_out_untouched_ok(d)) FAIL_("%s [%s]: memory around out or between its rows overwritten", name, level);
  else if (!att_compare(&d->out, ref, atol, att_rtol(d->c.odt), &err, NULL))
    FAIL_("%s [%s, %d threads]: paged out differs from the oracle (max err %.3g, allowed %.3g of max|ref|)%s", name,
          level, kva_context_threads(ctx), err, atol,
          att_compare(contig, ref, atol_c, att_rtol(d->c.odt), NULL, NULL)
              ? ""
              : "; so does the contiguous path on the same data (a kernel issue, not the paged layout)");
  else if (!att_compare(&d->out, contig, atol > atol_c ? atol : atol_c, att_rtol(d->c.odt), &err, NULL))
    FAIL_("%s [%s, %d threads]: paged out differs from the contiguous path (max err %.3g)", name, level,
          kva_context_threads(ctx), err);
  else return 1;
  return 0;
}

/* The same sequences as a contiguous cache and as a (scattered) paged pool:
 * attention over the view matches the oracle and the contiguous path; the
 * oracle reads the view exactly as the contiguous cache. */
TEST(paged_attention_vs_oracle) {
  kva_context *ctx1, *ctx2;
  kva_context_opts o = {KVA_BACKEND_CPU, 1, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx1, &o));
  o.threads = 2;
  ASSERT_OK(kva_context_create(&ctx2, &o));
  /* the cases --quick keeps, numbered for the sample among themselves */
  int eidx[NPCASES], n_eligible = 0;
  for (int ci = 0; ci < NPCASES; ++ci) eidx[ci] = test_quick && pcases[ci].c.N > 300 ? -1 : n_eligible++;
  /* each case with random queries, then with probes (att_make_q) */
  for (int cq = 0; cq < NPCASES * ATT_PROBES; ++cq) {
    const int ci = cq / ATT_PROBES, pr = cq % ATT_PROBES;
    const att_case *c = &pcases[ci].c;
    if (eidx[ci] < 0 || !test_case_sampled(eidx[ci], n_eligible)) continue;
    char name[320], cs[256];
    att_case_str(c, cs, sizeof cs);
    snprintf(name, sizeof name, "%s block=%d q=%s", cs, pcases[ci].block, att_query_names[pr]);
    att_data d;
    kva_pool *pool = NULL;
    kva_paged_view *pv = NULL;
    int ok = 0;
    if (att_make_q(&d, c, pr)) {
      FAIL_("%s: could not build operands", name);
      goto done;
    }
    kva_tensor ref = att_alloc_like(&d, &d.out), ref_paged = att_alloc_like(&d, &d.out);
    kva_tensor contig = att_alloc_like(&d, &d.out), rref = att_alloc_like(&d, &d.out);
    if (kva_reference_attention(&d.q, &d.view, &d.params, &ref)) {
      FAIL_("%s: oracle: %s", name, kva_last_error());
      goto done;
    }
    int32_t seqs[8];
    if (kva_pool_from_contiguous(&pool, &d.view, pcases[ci].block, 1, 0x9e37 + (uint64_t)ci, seqs) ||
        kva_paged_view_create(pool, seqs, c->B, &pv)) {
      FAIL_("%s: building the pool: %s", name, kva_last_error());
      goto done;
    }
    kva_kv_view pview = kva_view_paged(pv);
    if (kva_reference_attention(&d.q, &pview, &d.params, &ref_paged) ||
        !att_compare(&ref_paged, &ref, 0, 0, NULL, NULL)) {
      FAIL_("%s: the oracle over the paged view differs from the oracle over the contiguous cache: %s", name,
            kva_last_error());
      goto done;
    }
    int path_c = kva_attention_path(ctx1, &d.q, &d.view, &d.params, &d.out);
    int path_p = kva_attention_path(ctx1, &d.q, &pview, &d.params, &d.out);
    printf("  case %2d %-8s %s\n", ci, path_p == KVA_PATH_FUSED ? "fused" : "fallback", name);
    if (path_c != path_p) {
      FAIL_("%s: paged path %d != contiguous path %d", name, path_p, path_c);
      goto done;
    }
    ok = 1;
    /* Every SIMD level this CPU has and the general kernel alone (att_set_pass) at
     * 1 and 2 threads; --quick (sanitizers):
     * the best level at 2 threads (the paged source is the same code at every level). */
    for (int li = test_quick ? 2 : 0; li < (test_quick ? 3 : ATT_PASSES) && ok; ++li) {
      if (test_quick ? kva_cpu_set_simd(NULL) : att_set_pass(li)) continue; /* this CPU lacks the level */
      const char *lv = att_pass_now();
      ok = (test_quick || paged_run(name, ctx1, lv, &d, &pview, &ref, &rref, &contig)) &&
           paged_run(name, ctx2, lv, &d, &pview, &ref, &rref, &contig);
    }
    att_end_passes();
  done:
    kva_paged_view_release(pv);
    kva_pool_destroy(pool);
    att_free(&d);
    if (!ok) break;
  }
  kva_context_destroy(ctx1);
  kva_context_destroy(ctx2);
}

/* Attention over sequences that were trimmed (first block partly outside
 * the window), forked and appended in pieces, against the oracle over
 * contiguous caches written from the same float rows. */
TEST(paged_attention_after_state_ops) {
  static const tp_fmt fmts[] = {{BF16, 4, 64}, {F16, 0, 0}, {F32, 8, 32}};
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  for (int fi = 0; fi < 3; ++fi) {
    kva_pool_desc d = tp_desc(fmts[fi], 80, 16, 2, 128, 64);
    kva_pool *pool;
    ASSERT_OK(kva_pool_create(&pool, &d, NULL));
    expect e[3];
    int32_t s[3];
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(expect_init(&e[i], &d, 400) == 0);
    ASSERT_OK(kva_seq_create(pool, &s[0]));
    for (int i = 0; i < 6; ++i) ASSERT_OK(append_random(pool, s[0], &e[0], &d, 50, F32, 0));
    ASSERT_OK(kva_seq_trim(pool, s[0], 200)); /* window starts at 100: first_offset 4 */
    ASSERT_OK(kva_seq_fork(pool, s[0], &s[1]));
    tp_kv_copy(&e[1].k, 0, 0, &e[0].k, 0, 100, 200);
    tp_kv_copy(&e[1].v, 0, 0, &e[0].v, 0, 100, 200);
    e[1].len = 200;
    ASSERT_OK(append_random(pool, s[1], &e[1], &d, 37, BF16, 1));
    ASSERT_OK(append_random(pool, s[0], &e[0], &d, 3, F32, 0)); /* after the fork: copy-on-write */
    ASSERT_OK(kva_seq_create(pool, &s[2]));
    for (int i = 0; i < 7; ++i) ASSERT_OK(append_random(pool, s[2], &e[2], &d, 1 + i * 3, F32, 0));
    ASSERT_OK(kva_seq_trim(pool, s[2], 45));
    const int64_t from[3] = {100, 0, e[2].len - 45}, lens[3] = {203, 237, 45};
    kva_paged_view *pv;
    ASSERT_OK(kva_paged_view_create(pool, s, 3, &pv));
    /* Expected contiguous caches [3, KVH, 237, D] and lengths. */
    tp_kv ck, cv;
    ASSERT_TRUE(tp_kv_alloc(&ck, &d, 0, 3, 237) == 0 && tp_kv_alloc(&cv, &d, 1, 3, 237) == 0);
    int32_t clens[3];
    for (int b = 0; b < 3; ++b) {
      tp_kv_copy(&ck, b, 0, &e[b].k, 0, from[b], lens[b]);
      tp_kv_copy(&cv, b, 0, &e[b].v, 0, from[b], lens[b]);
      clens[b] = (int32_t)lens[b];
      ASSERT_EQ(kva_seq_len(pool, s[b]), lens[b]);
    }
    kva_kv_view cview = kva_view_contiguous(&ck.kv, &cv.kv, clens), pview = kva_view_paged(pv);
    const int64_t H = 4, L = 3;
    float *qb = (float *)malloc(sizeof(float) * 3 * H * L * 128);
    float *ob = (float *)malloc(sizeof(float) * (3 * H * L * 64 + 16));
    float *rb = (float *)malloc(sizeof(float) * 3 * H * L * 64);
    ASSERT_TRUE(qb && ob && rb);
    for (int64_t i = 0; i < 3 * H * L * 128; ++i) qb[i] = 1.5f * test_randn();
    kva_tensor q = kva_tensor_4d(qb, F32, 3, H, L, 128), out = kva_tensor_4d(ob, F32, 3, H, L, 64);
    kva_tensor ref = kva_tensor_4d(rb, F32, 3, H, L, 64);
    for (int mk = 0; mk < 3; ++mk) {
      kva_attn_params p = kva_attn_defaults();
      if (mk) p.mask.kind = KVA_MASK_CAUSAL;
      if (mk == 2) p.mask.window = 20;
      ASSERT_OK(att_kernel_reference(ctx, &q, &pview, &p, &out, &q, &cview, &p, &ref)); /* the kernel's roundings */
      memset(ob, 0xff, sizeof(float) * (3 * H * L * 64 + 16));
      ASSERT_OK(kva_attention(ctx, &q, &pview, &p, &out, NULL, 0));
      for (int i = 0; i < 16; ++i) {
        uint32_t u;
        memcpy(&u, &ob[3 * H * L * 64 + i], 4);
        ASSERT_EQ(u, 0xffffffffu); /* nothing written after out */
      }
      double err = 0;
      if (!att_compare(&out, &ref, att_kernel_atol(ctx, &q, &pview, &p, &out), 0, &err, NULL)) {
        char fs[32];
        tp_fmt_str(&fmts[fi], fs, sizeof fs);
        FAIL_("%s mask %d: attention over trimmed/forked sequences differs from the oracle (max err %.3g)", fs, mk,
              err);
      }
    }
    free(qb);
    free(ob);
    free(rb);
    tp_kv_free(&ck);
    tp_kv_free(&cv);
    kva_paged_view_release(pv);
    for (int i = 0; i < 3; ++i) expect_free(&e[i]);
    kva_pool_destroy(pool);
    if (test_failed_flag) break;
  }
  kva_context_destroy(ctx);
}
