/* The block-table layout (KVA_LAYOUT_BLOCK_TABLE) on the CPU backend:
 * kva_paged_view_block_table against the view's CSR arrays; attention over a
 * table of a library pool equal bit for bit to the PAGED view of the same
 * sequences (shuffled pools, ragged lengths, trims so first_offset != 0, a
 * table with row_stride > max_blocks and junk past each sequence's last
 * block) and to the oracle at the usual tolerance; caller-built pools of odd
 * block sizes (1, 3, 5, 7), padded strides and K/V of different formats,
 * whose unused rows are NaN, against the oracle over the contiguous cache;
 * and bad input: an error code, a message, the output untouched. */
#include "attn_check.h"
#include "test_paged.h"

#define F32 KVA_F32
#define F16 KVA_F16
#define BF16 KVA_BF16


/* Bitwise equality of two same-shape tensors (any strides). */
static int same_bits(const kva_tensor *a, const kva_tensor *b) {
  const size_t es = kva_dtype_size(a->dtype);
  for (int64_t i0 = 0; i0 < a->shape[0]; ++i0)
    for (int64_t i1 = 0; i1 < a->shape[1]; ++i1)
      for (int64_t i2 = 0; i2 < a->shape[2]; ++i2)
        for (int64_t i3 = 0; i3 < a->shape[3]; ++i3) {
          const char *pa = (const char *)a->data + i0 * a->stride[0] + i1 * a->stride[1] + i2 * a->stride[2] +
                           i3 * a->stride[3];
          const char *pb = (const char *)b->data + i0 * b->stride[0] + i1 * b->stride[1] + i2 * b->stride[2] +
                           i3 * b->stride[3];
          if (memcmp(pa, pb, es)) {
            fprintf(stderr, "    bits differ at [%lld,%lld,%lld,%lld]\n", (long long)i0, (long long)i1,
                    (long long)i2, (long long)i3);
            return 0;
          }
        }
  return 1;
}

/* ------------------------------------------------- the host table of a view */
TEST(block_table_from_view) {
  kva_pool_desc d = tp_desc((tp_fmt){BF16, 4, 64}, 30, 8, 2, 64, 64);
  kva_pool *pool;
  ASSERT_OK(kva_pool_create(&pool, &d, NULL));
  ASSERT_OK(kva_pool_shuffle(pool, 77));
  int32_t s[3];
  const int64_t T[3] = {20, 1, 41};
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(kva_seq_create(pool, &s[i]));
    kva_tensor k = tp_rows(F32, 2, T[i], 64, 0), v = tp_rows(F32, 2, T[i], 64, 0);
    ASSERT_OK(kva_seq_append(pool, s[i], &k, &v));
    tp_rows_free(&k);
    tp_rows_free(&v);
  }
  ASSERT_OK(kva_seq_trim(pool, s[2], 30)); /* drops 11 tokens: one block, first_offset 3 */
  int32_t batch[4] = {s[2], s[0], s[1], s[2]};
  kva_paged_view *pv;
  ASSERT_OK(kva_paged_view_create(pool, batch, 4, &pv));
  kva_paged_csr c;
  ASSERT_OK(kva_paged_view_csr(pv, &c));
  enum { MB = 6 };
  int32_t blocks[4 * MB], lens[4], fo[4];
  ASSERT_OK(kva_paged_view_block_table(pv, MB, blocks, lens, fo));
  for (int b = 0; b < 4; ++b) {
    int32_t nb = c.indptr[b + 1] - c.indptr[b];
    ASSERT_EQ(lens[b], c.lens[b]);
    ASSERT_EQ(fo[b], c.first_offset[b]);
    for (int i = 0; i < MB; ++i) ASSERT_EQ(blocks[b * MB + i], i < nb ? c.indices[c.indptr[b] + i] : -1);
  }
  ASSERT_EQ(fo[0], 3);
  ASSERT_EQ(lens[0], 30);
  ASSERT_EQ(lens[2], 1);
  /* The longest sequence has 5 blocks: max_blocks 4 is too small; nothing is written. */
  int32_t b2[4 * MB], l2[4], f2[4];
  memset(b2, 0x5a, sizeof b2);
  memset(l2, 0x5a, sizeof l2);
  memset(f2, 0x5a, sizeof f2);
  ASSERT_ERR(kva_paged_view_block_table(pv, 4, b2, l2, f2), KVA_ESHAPE, "sequence 0 of the view has 5 blocks > max_blocks = 4");
  ASSERT_ERR(kva_paged_view_block_table(pv, 0, b2, l2, f2), KVA_EINVAL, "max_blocks = 0");
  ASSERT_ERR(kva_paged_view_block_table(pv, MB, NULL, l2, f2), KVA_EINVAL, "blocks");
  ASSERT_ERR(kva_paged_view_block_table(pv, MB, b2, l2, NULL), KVA_EINVAL, "first_offset");
  ASSERT_ERR(kva_paged_view_block_table(NULL, MB, b2, l2, f2), KVA_EINVAL, "view");
  for (size_t i = 0; i < sizeof b2; ++i) ASSERT_EQ(((unsigned char *)b2)[i], 0x5a);
  for (size_t i = 0; i < sizeof l2; ++i) ASSERT_EQ(((unsigned char *)l2)[i] & ((unsigned char *)f2)[i], 0x5a);
  /* Exactly enough columns. */
  ASSERT_OK(kva_paged_view_block_table(pv, 5, b2, l2, f2));
  for (int i = 0; i < 5; ++i) ASSERT_EQ(b2[i], blocks[i]);
  kva_paged_view_release(pv);
  ASSERT_OK(kva_pool_check(pool));
  kva_pool_destroy(pool);
}

/* ------------------------------------- a library pool: table vs PAGED view */
typedef struct bt_case {
  att_case c;
  int block;    /* pool block size */
  int trim;     /* up to this many leading tokens trimmed per sequence (0: none) */
  int extra;    /* table columns beyond the longest sequence's blocks */
} bt_case;

/* B, H, KVH, L, N, Dk, Dv, q, out, kbits, vbits, group, kv/scale dtype, mask, window, softcap, sinks, ragged,
 * strided; block, trim, extra */
static const bt_case bcases[] = {
    /* decode: q4 / q8 / q2 / float pools, GQA 4, 2, 1 */
    {{3, 8, 2, 1, 300, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 1}, 16, 21, 0},
    {{2, 8, 8, 1, 200, 64, 64, BF16, BF16, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 8, 13, 2},
    {{2, 4, 2, 1, 150, 128, 128, F32, F32, 2, 2, 128, F32, MASK_NONE, 0, 0, 0, 1, 0}, 32, 0, 1},
    {{3, 8, 4, 1, 250, 128, 128, F16, F16, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 30, 0},
    /* verify rows: L = 8, causal + window, bf16 queries on the AMX-eligible shape, Dk != Dv */
    {{2, 8, 2, 8, 300, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_WINDOW, 37, 0, 0, 1, 0}, 16, 25, 1},
    {{2, 8, 4, 8, 200, 128, 128, F32, F32, 0, 0, 0, BF16, MASK_WINDOW, 9, 0, 0, 1, 1}, 8, 11, 0},
    {{2, 4, 2, 3, 150, 192, 128, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 5.0f, 1, 1, 0}, 64, 40, 0},
    /* segments (N-shaped masks sized to each layout) */
    {{2, 4, 2, 12, 200, 64, 64, F32, F32, 4, 4, 32, F32, MASK_SEG_CLAMP, 7, 0, 0, 1, 0}, 16, 19, 1},
    /* the fallback (explicit masks) and long L (row groups) */
    {{2, 4, 2, 5, 180, 64, 64, F32, F32, 0, 0, 0, F32, MASK_BOOL, 0, 0, 0, 1, 0}, 16, 9, 0},
    {{2, 4, 2, 5, 180, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_ADD, 0, 0, 1, 1, 1}, 8, 17, 1},
    {{2, 4, 2, 20, 200, 64, 64, F32, F32, 8, 8, 64, F16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 23, 0},
};
#define NBCASES ((int)(sizeof bcases / sizeof bcases[0]))

/* Random segment ids [B, n]: text and image runs. */
static void fill_segments(int32_t *s, int64_t B, int64_t n) {
  for (int64_t b = 0; b < B; ++b) {
    int32_t img = 0;
    for (int64_t j = 0; j < n;) {
      int64_t run = 1 + (int64_t)(test_rand_u64() % 12);
      int is_img = test_rand_u64() % 2 == 0;
      img += is_img;
      for (int64_t e = 0; e < run && j < n; ++e, ++j) s[b * n + j] = is_img ? img : 0;
    }
  }
}

/* The case's N-shaped masks (segments [B, N], arrays [B, H, L, N]) over n
 * columns of mem for the table (N = max_blocks * block_size); the paged
 * view's copy is the same memory cut to its longest sequence (the rows
 * either layout reads are the same view indices). */
static int make_n_masks(att_data *d, int64_t n, int64_t maxlen, kva_attn_params *pt, kva_attn_params *pp,
                        void **mem) {
  const att_case *c = &d->c;
  *pt = *pp = d->params;
  *mem = NULL;
  if (c->mask == MASK_SEG || c->mask == MASK_SEG_CLAMP) {
    int32_t *s = (int32_t *)malloc(sizeof(int32_t) * (size_t)(c->B * n));
    if (!s) return -1;
    fill_segments(s, c->B, n);
    pt->mask.segments = kva_tensor_2d(s, KVA_I32, c->B, n);
    pp->mask.segments = pt->mask.segments;
    pp->mask.segments.shape[1] = maxlen;
    *mem = s;
  } else if (c->mask == MASK_BOOL || c->mask == MASK_ADD) {
    const int64_t cnt = (int64_t)c->B * c->H * c->L * n;
    kva_dtype dt = c->mask == MASK_BOOL ? KVA_BOOL : F32;
    char *a = (char *)malloc(kva_dtype_size(dt) * (size_t)cnt);
    if (!a) return -1;
    for (int64_t i = 0; i < cnt; ++i) {
      if (dt == KVA_BOOL) a[i] = (char)(test_rand_u64() % 10 < 7);
      else {
        float x = test_rand_u64() % 10 < 2 ? -INFINITY : test_randu(-2.0f, 2.0f);
        memcpy(a + 4 * i, &x, 4);
      }
    }
    pt->mask.array = kva_tensor_4d(a, dt, c->B, c->H, c->L, n);
    pp->mask.array = pt->mask.array;
    pp->mask.array.shape[3] = maxlen;
    *mem = a;
  }
  return 0;
}

/* One case at one SIMD level: PAGED and both tables, bit for bit; the table
 * within tolerance of the oracle; nothing written past out. */
static int bt_run(const char *name, kva_context *ctx, att_data *d, const kva_kv_view *pview,
                  const kva_attn_params *pp, const kva_kv_view *tviews, const kva_attn_params *pt,
                  const kva_tensor *exact, kva_tensor *rref, kva_tensor *paged_out) {
  const char *lvl = att_pass_now();
  const kva_tensor *ref = att_oracle_for(ctx, &d->q, &tviews[0], pt, &d->out, exact, rref);
  if (!ref) {
    FAIL_("%s [%s]: no oracle", name, lvl);
    return 0;
  }
  if (kva_attention(ctx, &d->q, pview, pp, paged_out, NULL, 0)) {
    FAIL_("%s [%s]: paged attention: %s", name, lvl, kva_last_error());
    return 0;
  }
  for (int ti = 0; ti < 2; ++ti) {
    att_poison(d);
    double err = 0, atol = 0;
    if (kva_attention(ctx, &d->q, &tviews[ti], pt, &d->out, NULL, 0))
      FAIL_("%s [%s] table %d: kva_attention: %s", name, lvl, ti, kva_last_error());
    else if (!att_out_untouched_ok(d)) FAIL_("%s [%s] table %d: memory around out or between its rows overwritten", name, lvl, ti);
    else if (!same_bits(&d->out, paged_out))
      FAIL_("%s [%s] table %d: output differs from the PAGED view's bit for bit", name, lvl, ti);
    else if (!att_compare(&d->out, ref, atol = att_kernel_atol(ctx, &d->q, &tviews[ti], pt, &d->out),
                          att_rtol(d->c.odt), &err, NULL))
      FAIL_("%s [%s] table %d: differs from the oracle (max err %.3g, allowed %.3g of max|ref|)", name, lvl, ti, err,
            atol);
    else continue;
    return 0;
  }
  return 1;
}

TEST(block_table_vs_paged) {
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  /* each case with random queries, then with probes (att_make_q) */
  for (int cq = 0; cq < NBCASES * ATT_PROBES; ++cq) {
    const int ci = cq / ATT_PROBES, pr = cq % ATT_PROBES;
    const bt_case *bc = &bcases[ci];
    const att_case *c = &bc->c;
    if (!test_case_sampled(ci, NBCASES)) continue;
    char name[340], cs[256];
    att_case_str(c, cs, sizeof cs);
    snprintf(name, sizeof name, "%s block=%d trim=%d extra=%d q=%s", cs, bc->block, bc->trim, bc->extra,
             att_query_names[pr]);
    att_data d;
    kva_pool *pool = NULL;
    kva_paged_view *pv = NULL;
    int32_t *tbl = NULL, *wide = NULL;
    void *maskmem = NULL;
    int ok = 0;
    if (att_make_q(&d, c, pr)) {
      FAIL_("%s: could not build operands", name);
      goto done;
    }
    int32_t seqs[8], lens[8], fo[8];
    if (kva_pool_from_contiguous(&pool, &d.view, bc->block, 2, 0x5eed + (uint64_t)ci, seqs)) {
      FAIL_("%s: building the pool: %s", name, kva_last_error());
      goto done;
    }
    /* Trim leading tokens (the window moves; first_offset = trimmed % block). */
    int any_offset = 0;
    for (int b = 0; b < c->B && bc->trim; ++b) {
      int64_t len = d.lens ? d.lens[b] : c->N, room = len - c->L < bc->trim ? len - c->L : bc->trim;
      int64_t tr = room > 0 ? 1 + (int64_t)(test_rand_u64() % (uint64_t)room) : 0;
      if (tr > 1 && tr % bc->block == 0) tr--; /* leave an offset in the first block */
      if (kva_seq_trim(pool, seqs[b], len - tr)) {
        FAIL_("%s: trim: %s", name, kva_last_error());
        goto done;
      }
      any_offset |= tr % bc->block != 0;
    }
    if (kva_paged_view_create(pool, seqs, c->B, &pv)) {
      FAIL_("%s: view: %s", name, kva_last_error());
      goto done;
    }
    kva_paged_csr csr;
    kva_paged_view_csr(pv, &csr);
    int64_t nbmax = 0, maxlen = 0;
    for (int b = 0; b < c->B; ++b) {
      if (csr.indptr[b + 1] - csr.indptr[b] > nbmax) nbmax = csr.indptr[b + 1] - csr.indptr[b];
      if (csr.lens[b] > maxlen) maxlen = csr.lens[b];
    }
    if (bc->trim && !any_offset) {
      FAIL_("%s: no trim left a first_offset != 0 (the case does not test offsets)", name);
      goto done;
    }
    /* Table 0: from the view (unused entries -1). Table 1: row_stride =
     * max_blocks + 3, junk in every entry past a sequence's last block. */
    const int64_t mb = nbmax + bc->extra, rs = mb + 3, bs = bc->block;
    tbl = (int32_t *)malloc(sizeof(int32_t) * (size_t)(c->B * mb));
    wide = (int32_t *)malloc(sizeof(int32_t) * (size_t)(c->B * rs));
    if (!tbl || !wide || kva_paged_view_block_table(pv, mb, tbl, lens, fo)) {
      FAIL_("%s: kva_paged_view_block_table: %s", name, kva_last_error());
      goto done;
    }
    for (int64_t i = 0; i < c->B * rs; ++i) wide[i] = i % 2 ? INT32_MAX : -5;
    for (int b = 0; b < c->B; ++b)
      memcpy(wide + b * rs, tbl + b * mb, sizeof(int32_t) * (size_t)(csr.indptr[b + 1] - csr.indptr[b]));
    kva_block_table t0 = {c->B, mb, 0, tbl, lens, fo}, t1 = {c->B, mb, rs, wide, lens, any_offset ? fo : NULL};
    if (!any_offset) t0.first_offset = NULL;
    kva_kv k = kva_pool_k(pool), v = kva_pool_v(pool);
    kva_kv_view tviews[2] = {kva_view_block_table(&k, &v, &t0), kva_view_block_table(&k, &v, &t1)};
    kva_kv_view pview = kva_view_paged(pv);
    kva_attn_params pt, pp;
    if (make_n_masks(&d, mb * bs, maxlen, &pt, &pp, &maskmem)) {
      FAIL_("%s: masks", name);
      goto done;
    }
    /* The oracle reads both layouts alike, bit for bit; without trims and
     * N-shaped masks, also as the contiguous cache. */
    kva_tensor ref = att_alloc_like(&d, &d.out), ref_p = att_alloc_like(&d, &d.out);
    kva_tensor ref_c = att_alloc_like(&d, &d.out), paged_out = att_alloc_like(&d, &d.out), rref = att_alloc_like(&d, &d.out);
    if (kva_reference_attention(&d.q, &tviews[1], &pt, &ref) || kva_reference_attention(&d.q, &pview, &pp, &ref_p)) {
      FAIL_("%s: oracle: %s", name, kva_last_error());
      goto done;
    }
    if (!same_bits(&ref, &ref_p)) {
      FAIL_("%s: the oracle over the table differs from the oracle over the PAGED view", name);
      goto done;
    }
    if (!bc->trim && !maskmem &&
        (kva_reference_attention(&d.q, &d.view, &d.params, &ref_c) || !same_bits(&ref, &ref_c))) {
      FAIL_("%s: the oracle over the table differs from the oracle over the contiguous cache %s", name,
            kva_last_error());
      goto done;
    }
    int path_t = kva_attention_path(ctx, &d.q, &tviews[0], &pt, &d.out);
    int path_p = kva_attention_path(ctx, &d.q, &pview, &pp, &d.out);
    printf("  case %2d %-8s %s\n", ci, path_t == KVA_PATH_FUSED ? "fused" : "fallback", name);
    if (path_t != path_p) {
      FAIL_("%s: table path %d != paged path %d (%s)", name, path_t, path_p, kva_last_error());
      goto done;
    }
    ok = 1;
    /* Every SIMD level this CPU has and the general kernel alone (att_set_pass);
     * --quick (sanitizers): the best level. */
    for (int li = test_quick ? 2 : 0; li < (test_quick ? 3 : ATT_PASSES) && ok; ++li) {
      if (test_quick ? kva_cpu_set_simd(NULL) : att_set_pass(li)) continue;
      ok = bt_run(name, ctx, &d, &pview, &pp, tviews, &pt, &ref, &rref, &paged_out);
    }
    att_end_passes();
  done:
    free(tbl);
    free(wide);
    free(maskmem);
    kva_paged_view_release(pv);
    kva_pool_destroy(pool);
    att_free(&d);
    if (!ok) break;
  }
  kva_context_destroy(ctx);
}

/* --------------------------------------------------------- caller pools */
/* B, H, KVH, L, N, Dk, Dv, q, out, kbits, vbits, group, kv/scale dtype, mask, window, softcap, sinks, ragged,
 * strided; block (any size >= 1 for caller pools) */
static const struct {
  att_case c;
  int block;
} ccases[] = {
    {{3, 8, 2, 1, 100, 128, 128, F32, F32, 4, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 1}, 5},
    {{2, 8, 4, 8, 77, 64, 64, BF16, BF16, 0, 0, 0, F16, MASK_WINDOW, 9, 0, 1, 1, 0}, 3},
    {{2, 4, 1, 4, 40, 128, 64, F32, F32, 0, 0, 0, F32, MASK_NONE, 0, 0, 0, 1, 0}, 1},
    {{2, 4, 2, 20, 60, 64, 64, F32, F32, 4, 4, 32, F32, MASK_CAUSAL, 0, 0, 0, 1, 0}, 7},
};

/* The caller's own pools (odd block sizes, padded strides, K q4 / V q8),
 * blocks scattered, random first_offset: against the oracle over the
 * contiguous cache the pools were copied from. */
TEST(block_table_caller_pools) {
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  for (size_t cq = 0; cq < sizeof ccases / sizeof ccases[0] * ATT_PROBES && !test_failed_flag; ++cq) {
    const size_t ci = cq / ATT_PROBES;
    const int pr = (int)(cq % ATT_PROBES);
    const att_case *c = &ccases[ci].c;
    const int64_t bs = ccases[ci].block;
    char name[320], cs[256];
    att_case_str(c, cs, sizeof cs);
    snprintf(name, sizeof name, "%s block=%lld q=%s", cs, (long long)bs, att_query_names[pr]);
    att_data d;
    ASSERT_TRUE(att_make_q(&d, c, pr) == 0);
    att_table tb;
    ASSERT_TRUE(att_table_make(&tb, &d, bs, 0xff) == 0);
    const kva_kv_view view = tb.view;
    kva_tensor ref = att_alloc_like(&d, &d.out), ref_t = att_alloc_like(&d, &d.out), rref = att_alloc_like(&d, &d.out);
    ASSERT_OK(kva_reference_attention(&d.q, &d.view, &d.params, &ref));
    ASSERT_OK(kva_reference_attention(&d.q, &view, &d.params, &ref_t));
    if (!same_bits(&ref, &ref_t)) FAIL_("%s: the oracle over the table differs from the contiguous cache's", name);
    for (int li = test_quick ? 2 : 0; li < (test_quick ? 3 : ATT_PASSES) && !test_failed_flag; ++li) {
      if (test_quick ? kva_cpu_set_simd(NULL) : att_set_pass(li)) continue;
      const char *lv = att_pass_now();
      att_poison(&d);
      double err = 0;
      const double atol = att_kernel_atol(ctx, &d.q, &view, &d.params, &d.out);
      const kva_tensor *oref = att_oracle_for(ctx, &d.q, &view, &d.params, &d.out, &ref, &rref);
      int rc = oref ? kva_attention(ctx, &d.q, &view, &d.params, &d.out, NULL, 0) : -1;
      if (rc) FAIL_("%s [%s]: kva_attention: %s", name, lv, kva_last_error());
      else if (!att_out_untouched_ok(&d)) FAIL_("%s [%s]: memory around out or between its rows overwritten", name, lv);
      else if (!att_compare(&d.out, oref, atol, att_rtol(c->odt), &err, NULL))
        FAIL_("%s [%s]: differs from the oracle (max err %.3g, allowed %.3g of max|ref|)", name, lv, err, atol);
    }
    att_end_passes();
    printf("  caller pools %s\n", name);
    att_table_free(&tb);
    att_free(&d);
  }
  kva_context_destroy(ctx);
}

/* ------------------------------------------------------------ bad input */
TEST(block_table_bad_input) {
  /* B 2, H 4 / KVH 2, L 3, N 40, D 64, q4 K/V; pool blocks of 8. */
  const att_case ac = {2, 4, 2, 3, 40, 64, 64, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0};
  att_data d;
  ASSERT_TRUE(att_make(&d, &ac) == 0);
  d.lens[0] = 40; /* 5 blocks */
  d.lens[1] = 29; /* trimmed to 27: first_offset 2, 4 blocks */
  kva_pool *pool;
  int32_t seqs[2], blocks[2 * 6], lens[2], fo[2];
  ASSERT_OK(kva_pool_from_contiguous(&pool, &d.view, 8, 2, 99, seqs));
  ASSERT_OK(kva_seq_trim(pool, seqs[1], d.lens[1] - 2)); /* first_offset 2 */
  kva_paged_view *pv;
  ASSERT_OK(kva_paged_view_create(pool, seqs, 2, &pv));
  ASSERT_OK(kva_paged_view_block_table(pv, 6, blocks, lens, fo));
  const int64_t nblk = kva_pool_get_desc(pool).num_blocks;
  kva_kv k = kva_pool_k(pool), v = kva_pool_v(pool);
  kva_block_table t = {2, 6, 0, blocks, lens, fo}, t0 = t;
  kva_kv_view view = kva_view_block_table(&k, &v, &t), view0 = view;
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  kva_attn_params p = d.params;
  ASSERT_OK(kva_attention(ctx, &d.q, &view, &p, &d.out, NULL, 0)); /* the valid call */
  att_poison(&d);
  unsigned char *snap = (unsigned char *)malloc(d.out_bytes);
  ASSERT_TRUE(snap != NULL);
  memcpy(snap, d.out_buf, d.out_bytes);
  kva_tensor q = d.q;
  size_t ws;
  /* Each case: kva_attention, _path, _workspace_size and the oracle fail
   * alike (same code and message); out untouched. */
#define EXPECT_BAD(code, needle)                                                                 \
  do {                                                                                           \
    ASSERT_ERR(kva_attention(ctx, &q, &view, &p, &d.out, NULL, 0), code, needle);                \
    ASSERT_ERR(kva_attention_path(ctx, &q, &view, &p, &d.out), code, needle);                    \
    ASSERT_ERR(kva_attention_workspace_size(ctx, &q, &view, &p, &ws), code, needle);             \
    ASSERT_ERR(kva_reference_attention(&q, &view, &p, &d.out), code, needle);                    \
    if (memcmp(snap, d.out_buf, d.out_bytes) || !att_sentinel_ok(&d)) {                         \
      FAIL_("output modified on error (%s)", needle);                                            \
      return;                                                                                    \
    }                                                                                            \
    t = t0;                                                                                      \
    view = view0;                                                                                \
    p = d.params;                                                                                \
    q = d.q;                                                                                     \
  } while (0)
  /* The descriptors. */
  view.table = NULL;                     EXPECT_BAD(KVA_EINVAL, "kv.table is NULL");
  t.batch = 0;                           EXPECT_BAD(KVA_EINVAL, "table.batch = 0");
  t.batch = 3;                           EXPECT_BAD(KVA_ESHAPE, "q.shape[0] = 2 != batch B = 3");
  t.max_blocks = 0;                      EXPECT_BAD(KVA_EINVAL, "table.max_blocks = 0");
  t.row_stride = 5;                      EXPECT_BAD(KVA_EINVAL, "table.row_stride = 5");
  t.row_stride = -1;                     EXPECT_BAD(KVA_EINVAL, "table.row_stride = -1");
  t.row_stride = INT64_MAX / 2;          EXPECT_BAD(KVA_EINVAL, "would not fit in memory");
  t.blocks = NULL;                       EXPECT_BAD(KVA_EINVAL, "table.blocks");
  t.seq_lens = NULL;                     EXPECT_BAD(KVA_EINVAL, "table.seq_lens");
  t.max_blocks = INT32_MAX / 4;          EXPECT_BAD(KVA_EINVAL, "exceeds");
  /* Mismatched pools. */
  view.v.data.shape[0] = view.v.scales.shape[0] = view.v.biases.shape[0] = nblk - 1;
  EXPECT_BAD(KVA_ESHAPE, "v_pool.shape[0]");
  view.v.data.shape[1] = view.v.scales.shape[1] = view.v.biases.shape[1] = 1;
  EXPECT_BAD(KVA_ESHAPE, "v_pool.shape[1]");
  view.k.data.shape[2] = view.k.scales.shape[2] = view.k.biases.shape[2] = 4;
  EXPECT_BAD(KVA_ESHAPE, "v_pool.shape[2] = 8 != k_pool.shape[2] = 4");
  view.v.bits = 3;                       EXPECT_BAD(KVA_EUNSUPPORTED, "v_pool.bits = 3");
  view.k.data.ndim = 3;                  EXPECT_BAD(KVA_ESHAPE, "k_pool.data must have rank 4");
  view.k.scales.dtype = KVA_F16;         EXPECT_BAD(KVA_EDTYPE, "k_pool: scales (f16) and biases (bf16)");
  view.layout = (kva_layout)3;           EXPECT_BAD(KVA_EINVAL, "kv.layout = 3");
  /* L beyond N = max_blocks * block_size. */
  float *q9 = (float *)calloc(2 * 4 * 9 * 64, sizeof(float)), *o9 = (float *)calloc(2 * 4 * 9 * 64, sizeof(float));
  ASSERT_TRUE(q9 && o9);
  kva_tensor q9t = kva_tensor_4d(q9, F32, 2, 4, 9, 64), o9t = kva_tensor_4d(o9, F32, 2, 4, 9, 64);
  t.max_blocks = 1;
  ASSERT_ERR(kva_attention(ctx, &q9t, &view, &p, &o9t, NULL, 0), KVA_ESHAPE, "exceed the cache length N = 8");
  t.max_blocks = 6; /* N = 48: the same 9 rows are fine (both sequences have >= 9 tokens) */
  ASSERT_OK(kva_attention(ctx, &q9t, &view, &p, &o9t, NULL, 0));
  free(q9);
  free(o9);
  t = t0;
  /* The out tensor inside a pool: one query row, its out within the V
   * codes (the full out is longer than the pool's arrays and would also
   * reach whatever the allocator put after them) */
  float *q1 = (float *)calloc(2 * 4 * 64, sizeof(float));
  ASSERT_TRUE(q1);
  ASSERT_TRUE(nblk * 2 * 8 * 32 >= 2 * 4 * 64 * 4 + 128); /* V codes [nblk, 2, 8, 32 bytes]; out f32 [2, 4, 1, 64] */
  kva_tensor q1t = kva_tensor_4d(q1, F32, 2, 4, 1, 64), inside = kva_tensor_4d((char *)v.data.data + 128, F32, 2, 4, 1, 64);
  ASSERT_ERR(kva_attention(ctx, &q1t, &view, &p, &inside, NULL, 0), KVA_EINVAL, "out overlaps v");
  free(q1);
  /* Table entries (host arrays on the CPU). */
  int32_t bad_lens[2], bad_fo[2], bad_blocks[2 * 6];
  memcpy(bad_blocks, blocks, sizeof blocks);
  memcpy(bad_lens, lens, sizeof lens);
  memcpy(bad_fo, fo, sizeof fo);
  const int64_t used1 = (fo[1] + lens[1] + 7) / 8; /* blocks sequence 1 reads */
  t0.blocks = bad_blocks;
  t0.seq_lens = bad_lens;
  t0.first_offset = bad_fo;
  t = t0;
  bad_blocks[6 + used1 - 1] = (int32_t)nblk;
  EXPECT_BAD(KVA_EINVAL, "table.blocks[1][");
  char msg[160];
  snprintf(msg, sizeof msg, "table.blocks[1][%lld] = %lld is out of range [0, num_blocks = %lld)",
           (long long)(used1 - 1), (long long)nblk, (long long)nblk);
  ASSERT_ERR(kva_attention(ctx, &q, &view, &p, &d.out, NULL, 0), KVA_EINVAL, msg);
  bad_blocks[6 + used1 - 1] = -2;        EXPECT_BAD(KVA_EINVAL, "= -2 is out of range");
  bad_blocks[6 + used1 - 1] = blocks[6 + used1 - 1];
  bad_lens[1] = 0;                       EXPECT_BAD(KVA_ESHAPE, "table.seq_lens[1] = 0");
  bad_lens[1] = -4;                      EXPECT_BAD(KVA_ESHAPE, "table.seq_lens[1] = -4");
  bad_lens[0] = 6 * 8 - fo[0] + 1;       EXPECT_BAD(KVA_ESHAPE, "table.seq_lens[0] = 49");
  bad_lens[0] = lens[0];
  bad_lens[1] = 2;                       EXPECT_BAD(KVA_ESHAPE, "table.seq_lens[1] = 2 < L = 3");
  bad_lens[1] = lens[1];
  bad_fo[1] = 8;                         EXPECT_BAD(KVA_EINVAL, "table.first_offset[1] = 8");
  bad_fo[1] = -1;                        EXPECT_BAD(KVA_EINVAL, "table.first_offset[1] = -1");
  bad_fo[1] = fo[1];
  /* first_offset + len over the table's columns. */
  t.max_blocks = used1 - 1 > 0 ? used1 - 1 : 1;
  ASSERT_ERR(kva_attention(ctx, &q, &view, &p, &d.out, NULL, 0), KVA_ESHAPE, "table.seq_lens[");
  t = t0;
  /* Entries past a sequence's last block are never read: junk there is fine. */
  for (int64_t i = used1; i < 6; ++i) bad_blocks[6 + i] = INT32_MIN + (int32_t)i;
  ASSERT_OK(kva_attention(ctx, &q, &view, &p, &d.out, NULL, 0));
  ASSERT_TRUE(att_sentinel_ok(&d));
#undef EXPECT_BAD
  kva_context_destroy(ctx);
  free(snap);
  kva_paged_view_release(pv);
  kva_pool_destroy(pool);
  att_free(&d);
}
