/* Engine KV pool layouts read and written through strides, no copies:
 * vLLM's NHD pools (num_blocks, block_size, KVH, D), one tensor (2,
 * num_blocks, block_size, KVH, D) holding K and V, FlashInfer's (num_blocks,
 * 2, block_size, KVH, D) and its HND form (num_blocks, 2, KVH, block_size, D).
 * Each is described to kvattn as kva_kv [num_blocks, KVH, block_size, W]
 * with the layout's strides: float pools (f32, bf16, f16) and MLX-packed
 * q4 / q8 pools, whose packed words, scales and biases each take the
 * layout. Attention over a block table of shuffled block ids (ragged
 * lengths, decode and verify rows) against the oracle over the same tokens
 * in a contiguous cache, at the allowance of the kernel that ran; and
 * kva_cache_write's slot mapping into such pools (the source rows a strided
 * slice of a fused qkv buffer, padding slots -1), bit for bit against the
 * rows' own format and nothing written elsewhere, then attended. CPU, and
 * the same on CUDA (skipped without a device). */
#include "attn_check.h"

#define F32 KVA_F32
#define F16 KVA_F16
#define BF16 KVA_BF16

enum { EL_NHD, EL_KV_FIRST, EL_KV_INNER, EL_HND_KV_INNER, EL_LAYOUTS };
static const char *const el_names[EL_LAYOUTS] = {
    "NHD k,v (nb, bs, KVH, D)", "(2, nb, bs, KVH, D)", "(nb, 2, bs, KVH, D)", "(nb, 2, KVH, bs, D)"};

/* K and V pools of one format in an engine layout. Each array family
 * (0 data, 1 scales, 2 biases) lives in one buffer holding K and V (the
 * combined layouts) or in two (EL_NHD); every byte starts as `fill`. */
typedef struct el_pools {
  int lay;
  kva_kv k, v; /* [nb, KVH, bs, W] views into mem */
  void *mem[3][2];
  size_t bytes[3][2];
  int nbuf; /* buffers per family: 2 for EL_NHD, else 1 */
  int64_t nb, bs;
} el_pools;

/* One family's K and V descriptors in layout lay over fresh buffers. */
static int el_family(el_pools *p, int f, const kva_tensor *like, int64_t KVH) {
  const int64_t es = (int64_t)kva_dtype_size(like->dtype), W = like->shape[3], row = W * es, nb = p->nb, bs = p->bs;
  kva_tensor k = *like;
  k.ndim = 4;
  k.shape[0] = nb;
  k.shape[1] = KVH;
  k.shape[2] = bs;
  k.shape[3] = W;
  k.stride[3] = es;
  int64_t voff = 0, total = 0;
  switch (p->lay) {
  case EL_NHD:
  case EL_KV_FIRST: /* [.., nb, bs, KVH, W]: token rows KVH * W apart */
    k.stride[0] = bs * KVH * row;
    k.stride[1] = row;
    k.stride[2] = KVH * row;
    voff = nb * k.stride[0];
    total = 2 * voff;
    break;
  case EL_KV_INNER: /* [nb, 2, bs, KVH, W] */
    k.stride[0] = 2 * bs * KVH * row;
    k.stride[1] = row;
    k.stride[2] = KVH * row;
    voff = bs * KVH * row;
    total = nb * k.stride[0];
    break;
  default: /* EL_HND_KV_INNER: [nb, 2, KVH, bs, W] */
    k.stride[0] = 2 * KVH * bs * row;
    k.stride[1] = bs * row;
    k.stride[2] = row;
    voff = KVH * bs * row;
    total = nb * k.stride[0];
    break;
  }
  kva_tensor v = k;
  if (p->lay == EL_NHD) {
    p->bytes[f][0] = p->bytes[f][1] = (size_t)voff;
    p->mem[f][0] = malloc((size_t)voff);
    p->mem[f][1] = malloc((size_t)voff);
    if (!p->mem[f][0] || !p->mem[f][1]) return -1;
    k.data = p->mem[f][0];
    v.data = p->mem[f][1];
  } else {
    p->bytes[f][0] = (size_t)total;
    p->mem[f][0] = malloc((size_t)total);
    if (!p->mem[f][0]) return -1;
    k.data = p->mem[f][0];
    v.data = (char *)p->mem[f][0] + voff;
  }
  if (f == 0) p->k.data = k, p->v.data = v;
  else if (f == 1) p->k.scales = k, p->v.scales = v;
  else p->k.biases = k, p->v.biases = v;
  return 0;
}

static void el_pools_free(el_pools *p) {
  for (int f = 0; f < 3; ++f)
    for (int i = 0; i < 2; ++i) free(p->mem[f][i]);
  memset(p, 0, sizeof *p);
}

/* Pools of like's format (a [B, KVH, N, W] operand; K and V alike). */
static int el_pools_make(el_pools *p, int lay, const kva_kv *like, int64_t nb, int64_t bs, unsigned char fill) {
  memset(p, 0, sizeof *p);
  p->lay = lay;
  p->nb = nb;
  p->bs = bs;
  p->nbuf = lay == EL_NHD ? 2 : 1;
  p->k = p->v = *like;
  const int64_t KVH = like->data.shape[1];
  if (el_family(p, 0, &like->data, KVH) ||
      (like->bits && (el_family(p, 1, &like->scales, KVH) || el_family(p, 2, &like->biases, KVH)))) {
    el_pools_free(p);
    return -1;
  }
  for (int f = 0; f < 3; ++f)
    for (int i = 0; i < 2; ++i)
      if (p->mem[f][i]) memset(p->mem[f][i], fill, p->bytes[f][i]);
  return 0;
}

static void el_copy_row(const kva_tensor *dst, int64_t blk, int64_t hk, int64_t row, const kva_tensor *src,
                        int64_t b, int64_t t) {
  memcpy((char *)dst->data + blk * dst->stride[0] + hk * dst->stride[1] + row * dst->stride[2],
         (const char *)src->data + b * src->stride[0] + hk * src->stride[1] + t * src->stride[2],
         (size_t)src->shape[3] * kva_dtype_size(src->dtype));
}
/* Token (b, t) of the contiguous operand src into pool row (blk, row), every KV head. */
static void el_put(kva_kv *pool, const kva_kv *src, int64_t blk, int64_t row, int64_t b, int64_t t) {
  for (int64_t hk = 0; hk < src->data.shape[1]; ++hk) {
    el_copy_row(&pool->data, blk, hk, row, &src->data, b, t);
    if (src->bits) {
      el_copy_row(&pool->scales, blk, hk, row, &src->scales, b, t);
      el_copy_row(&pool->biases, blk, hk, row, &src->biases, b, t);
    }
  }
}

/* An engine's block table: sequence b's blocks a run of a random
 * permutation of the pool (3 spare blocks), table columns past its last
 * block -1 plus one spare column, first_offset random (offsets) or none. */
typedef struct el_table {
  int32_t *blocks, *lens, *fo;
  int64_t nb, mb, bs;
  kva_block_table t;
} el_table;

static void el_table_free(el_table *tb) {
  free(tb->blocks);
  free(tb->lens);
  free(tb->fo);
  memset(tb, 0, sizeof *tb);
}

static int el_table_make(el_table *tb, const att_data *d, int64_t bs, int offsets) {
  const att_case *c = &d->c;
  memset(tb, 0, sizeof *tb);
  tb->bs = bs;
  tb->lens = (int32_t *)malloc(sizeof(int32_t) * (size_t)c->B);
  tb->fo = (int32_t *)malloc(sizeof(int32_t) * (size_t)c->B);
  if (!tb->lens || !tb->fo) return -1;
  tb->nb = 3;
  for (int b = 0; b < c->B; ++b) {
    tb->lens[b] = d->lens ? d->lens[b] : (int32_t)c->N;
    tb->fo[b] = offsets ? (int32_t)(test_rand_u64() % (uint64_t)bs) : 0;
    const int64_t n = (tb->fo[b] + tb->lens[b] + bs - 1) / bs;
    tb->nb += n;
    if (n > tb->mb) tb->mb = n;
  }
  tb->mb += 1;
  int32_t *perm = (int32_t *)malloc(sizeof(int32_t) * (size_t)tb->nb);
  tb->blocks = (int32_t *)malloc(sizeof(int32_t) * (size_t)(c->B * tb->mb));
  if (!perm || !tb->blocks) {
    free(perm);
    return -1;
  }
  att_random_perm(perm, tb->nb);
  int64_t next = 0;
  for (int b = 0; b < c->B; ++b) {
    const int64_t n = (tb->fo[b] + tb->lens[b] + bs - 1) / bs;
    for (int64_t i = 0; i < tb->mb; ++i) tb->blocks[b * tb->mb + i] = i < n ? perm[next++] : -1;
  }
  free(perm);
  tb->t = (kva_block_table){c->B, tb->mb, 0, tb->blocks, tb->lens, offsets ? tb->fo : NULL};
  return 0;
}

/* The pool slot of token t of sequence b. */
static int32_t el_slot(const el_table *tb, int b, int64_t t) {
  const int64_t r = tb->fo[b] + t;
  return (int32_t)(tb->blocks[b * tb->mb + r / tb->bs] * tb->bs + r % tb->bs);
}

/* d's tokens copied into the pools at the table's slots. */
static void el_fill(el_pools *p, const el_table *tb, const att_data *d) {
  for (int b = 0; b < d->c.B; ++b)
    for (int64_t t = 0; t < tb->lens[b]; ++t) {
      const int32_t s = el_slot(tb, b, t);
      el_put(&p->k, &d->k, s / tb->bs, s % tb->bs, b, t);
      el_put(&p->v, &d->v, s / tb->bs, s % tb->bs, b, t);
    }
}

/* Same bytes in every buffer of two pools of one layout and format. */
static int el_same_pools(const el_pools *a, const el_pools *b, const char *name) {
  static const char *fam[3] = {"data", "scales", "biases"};
  for (int f = 0; f < 3; ++f)
    for (int i = 0; i < 2; ++i) {
      if (!a->mem[f][i]) continue;
      const unsigned char *x = (const unsigned char *)a->mem[f][i], *y = (const unsigned char *)b->mem[f][i];
      for (size_t e = 0; e < a->bytes[f][i]; ++e)
        if (x[e] != y[e]) {
          FAIL_("%s: pool %s buffer %d differs at byte %zu (%02x, expected %02x)", name, fam[f], i, e, x[e], y[e]);
          return 0;
        }
    }
  return 1;
}

/* B, H, KVH, L, N, Dk, Dv, q, out, kbits, vbits, group, kv/scale dtype, mask, window, softcap, sinks, ragged,
 * strided; block size, random first offsets */
typedef struct el_case {
  att_case c;
  int bs, offsets;
} el_case;
static const el_case cpu_cases[] = {
    /* float pools: decode f32, bf16 with sinks, f16 verify rows with a window, odd block size */
    {{3, 8, 2, 1, 100, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 0},
    {{3, 8, 2, 1, 150, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 1, 1}, 16, 1},
    {{2, 8, 4, 4, 120, 64, 64, F16, F16, 0, 0, 0, F16, MASK_WINDOW, 37, 0, 0, 1, 0}, 8, 0},
    {{2, 4, 2, 3, 70, 128, 128, F32, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 5.0f, 0, 1, 0}, 5, 1},
    /* MLX-packed pools: q4 decode and verify (bf16 queries), q8 with f16 / f32 scales */
    {{3, 8, 2, 1, 200, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 0},
    {{2, 8, 2, 8, 160, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 1},
    {{2, 8, 8, 1, 130, 64, 64, F32, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 1, 1, 0}, 32, 0},
    {{2, 4, 2, 3, 90, 128, 128, F32, F32, 8, 8, 64, F32, MASK_WINDOW, 20, 0, 0, 1, 1}, 5, 1},
};
#define N_CPU_CASES ((int)(sizeof cpu_cases / sizeof cpu_cases[0]))

/* One CPU call over view against the oracle over d's contiguous cache, at
 * every SIMD pass (--quick: the best level). */
static int el_attend_cpu(kva_context *ctx, att_data *d, const kva_kv_view *view, const char *name) {
  int ok = 0;
  kva_tensor ref = att_alloc_like(d, &d->out), ref_t = att_alloc_like(d, &d->out), rref = att_alloc_like(d, &d->out);
  if (kva_reference_attention(&d->q, &d->view, &d->params, &ref) ||
      kva_reference_attention(&d->q, view, &d->params, &ref_t)) {
    FAIL_("%s: oracle: %s", name, kva_last_error());
    return 0;
  }
  /* The oracle reads the strided pools as the contiguous cache, bit for bit. */
  if (memcmp(ref.data, ref_t.data, (size_t)(ref.shape[0] * ref.stride[0]))) {
    FAIL_("%s: the oracle over the pools differs from the oracle over the contiguous cache", name);
    return 0;
  }
  for (int li = test_quick ? 2 : 0; li < (test_quick ? 3 : ATT_PASSES); ++li) {
    if (test_quick ? kva_cpu_set_simd(NULL) : att_set_pass(li)) continue;
    const char *lv = att_pass_now();
    att_poison(d);
    double err = 0;
    const double atol = att_kernel_atol(ctx, &d->q, view, &d->params, &d->out);
    const kva_tensor *oref = att_oracle_for(ctx, &d->q, view, &d->params, &d->out, &ref, &rref);
    if (!oref) goto done;
    if (kva_attention(ctx, &d->q, view, &d->params, &d->out, NULL, 0)) {
      FAIL_("%s [%s]: kva_attention: %s", name, lv, kva_last_error());
      goto done;
    }
    if (!att_out_untouched_ok(d)) {
      FAIL_("%s [%s]: memory around out or between its rows overwritten", name, lv);
      goto done;
    }
    if (!att_compare(&d->out, oref, atol, att_rtol(d->c.odt), &err, NULL)) {
      FAIL_("%s [%s]: differs from the oracle (max err %.3g, allowed %.3g of max|ref|)", name, lv, err, atol);
      goto done;
    }
  }
  ok = 1;
done:
  att_end_passes();
  return ok;
}

TEST(engine_layouts_attention) {
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  for (int ci = 0; ci < N_CPU_CASES && !test_failed_flag; ++ci)
    for (int lay = 0; lay < EL_LAYOUTS && !test_failed_flag; ++lay)
      for (int pr = 0; pr < ATT_PROBES && !test_failed_flag; ++pr) {
        if (!test_case_sampled((ci * EL_LAYOUTS + lay) * ATT_PROBES + pr, N_CPU_CASES * EL_LAYOUTS * ATT_PROBES)) continue;
        const el_case *ec = &cpu_cases[ci];
        char cs[256], name[400];
        att_case_str(&ec->c, cs, sizeof cs);
        snprintf(name, sizeof name, "%s %s block=%d%s q=%s", el_names[lay], cs, ec->bs,
                 ec->offsets ? " offsets" : "", att_query_names[pr]);
        att_data d;
        el_table tb;
        el_pools p;
        ASSERT_TRUE(att_make_q(&d, &ec->c, pr) == 0);
        ASSERT_TRUE(el_table_make(&tb, &d, ec->bs, ec->offsets) == 0);
        ASSERT_TRUE(el_pools_make(&p, lay, &d.k, tb.nb, ec->bs, 0xff) == 0); /* 0xff: NaN in unread float rows */
        el_fill(&p, &tb, &d);
        const kva_kv_view view = kva_view_block_table(&p.k, &p.v, &tb.t);
        if (el_attend_cpu(ctx, &d, &view, name) && pr == 0) printf("  %s\n", name);
        el_pools_free(&p);
        el_table_free(&tb);
        att_free(&d);
      }
  kva_context_destroy(ctx);
}

/* ------------------------------------------------ cache_write through strides */
/* The engine's append: every sequence's tokens but its last written in one
 * call (prefill; tokens of the sequences interleaved, padding slots -1
 * between them), then one token per sequence (decode). The source rows k,
 * v [n, KVH, D] are slices of one fused qkv buffer [n, H + 2 KVH, D] of the
 * pool's float dtype (f32 for packed pools): token stride (H + 2 KVH) D. */
typedef struct el_writes {
  void *qkv;
  kva_tensor k, v;
  int32_t *slots;
  int64_t n, n1; /* tokens in all, in the first call */
} el_writes;

static void el_writes_free(el_writes *w) {
  free(w->qkv);
  free(w->slots);
  memset(w, 0, sizeof *w);
}

/* Write i of el_writes_make: token t of sequence b (float: d's row; packed:
 * the raw f32 row) into w's k and v rows, its slot from the table. */
static void el_put_token(el_writes *w, const att_data *d, const el_table *tb, const float *rawk, const float *rawv,
                         int b, int64_t t, int64_t i) {
  const att_case *c = &d->c;
  const int64_t KVH = c->KVH, D = c->Dk;
  const kva_dtype sdt = w->k.dtype;
  const int64_t es = (int64_t)kva_dtype_size(sdt);
  w->slots[i] = el_slot(tb, b, t);
  for (int64_t h = 0; h < KVH; ++h)
    for (int64_t e = 0; e < D; ++e) {
      float kx, vx;
      if (c->kbits) {
        kx = rawk[((b * KVH + h) * c->N + t) * D + e];
        vx = rawv[((b * KVH + h) * c->N + t) * D + e];
      } else {
        kx = test_load((const char *)d->k.data.data + b * d->k.data.stride[0] + h * d->k.data.stride[1] +
                           t * d->k.data.stride[2] + e * d->k.data.stride[3], c->kvdt);
        vx = test_load((const char *)d->v.data.data + b * d->v.data.stride[0] + h * d->v.data.stride[1] +
                           t * d->v.data.stride[2] + e * d->v.data.stride[3], c->kvdt);
      }
      test_store((char *)w->k.data + i * w->k.stride[0] + h * w->k.stride[1] + e * es, sdt, kx);
      test_store((char *)w->v.data + i * w->v.stride[0] + h * w->v.stride[1] + e * es, sdt, vx);
    }
}

/* The writes that put d's tokens (float: its rows; packed: raw, the f32 rows
 * d's cache was quantized from) at the table's slots. */
static int el_writes_make(el_writes *w, const att_data *d, const el_table *tb, const float *rawk, const float *rawv) {
  const att_case *c = &d->c;
  memset(w, 0, sizeof *w);
  const int64_t KVH = c->KVH, D = c->Dk, H = c->H, per = H + 2 * KVH;
  int64_t tokens = 0;
  for (int b = 0; b < c->B; ++b) tokens += tb->lens[b];
  const int64_t pads = c->B;
  w->n = tokens + pads;
  const kva_dtype sdt = c->kbits ? F32 : c->kvdt;
  const int64_t es = (int64_t)kva_dtype_size(sdt);
  w->qkv = malloc((size_t)(w->n * per * D * es));
  w->slots = (int32_t *)malloc(sizeof(int32_t) * (size_t)w->n);
  if (!w->qkv || !w->slots) return -1;
  memset(w->qkv, 0x7f, (size_t)(w->n * per * D * es));
  const int64_t ts[3] = {per * D * es, D * es, es};
  w->k = (kva_tensor){(char *)w->qkv + H * D * es, sdt, 3, {w->n, KVH, D, 0}, {ts[0], ts[1], ts[2], 0}};
  w->v = w->k;
  w->v.data = (char *)w->qkv + (H + KVH) * D * es;
  /* token order: prefill round robin over the sequences with a pad now and
   * then, then each sequence's last token */
  int64_t *next = (int64_t *)calloc((size_t)c->B, sizeof(int64_t));
  if (!next) return -1;
  int64_t i = 0, left = tokens - c->B;
  int pads_left = (int)pads;
  while (left > 0) {
    for (int b = 0; b < c->B; ++b) {
      if (next[b] >= tb->lens[b] - 1) continue;
      const int64_t t = next[b]++;
      el_put_token(w, d, tb, rawk, rawv, b, t, i++);
      --left;
      if (pads_left > 0 && test_rand_u64() % 8 == 0) {
        w->slots[i++] = -1;
        --pads_left;
      }
    }
  }
  while (pads_left-- > 0) w->slots[i++] = -1;
  w->n1 = i;
  for (int b = 0; b < c->B; ++b) { /* the decode step */
    const int64_t t = tb->lens[b] - 1;
    el_put_token(w, d, tb, rawk, rawv, b, t, i++);
  }
  free(next);
  return i == w->n ? 0 : -1;
}

/* The first n rows of a [n_all, KVH, D] source, from row r0. */
static kva_tensor el_rows(const kva_tensor *t, int64_t r0, int64_t n) {
  kva_tensor s = *t;
  s.data = (char *)t->data + r0 * t->stride[0];
  s.shape[0] = n;
  return s;
}

/* Packed cases: d's K and V caches replaced by kva_quantize of fresh f32
 * rows raw [B, KVH, N, D] (returned), the rows cache_write quantizes. */
static int el_requantize(att_data *d, float **rawk, float **rawv) {
  const att_case *c = &d->c;
  const size_t cnt = (size_t)(c->B * c->KVH * c->N * c->Dk);
  *rawk = (float *)malloc(cnt * sizeof(float));
  *rawv = (float *)malloc(cnt * sizeof(float));
  if (!*rawk || !*rawv) return -1;
  for (size_t i = 0; i < cnt; ++i) (*rawk)[i] = test_randn(), (*rawv)[i] = test_randn();
  kva_tensor wk = kva_tensor_4d(*rawk, F32, c->B, c->KVH, c->N, c->Dk), wv = wk;
  wv.data = *rawv;
  return kva_quantize(&wk, &d->k) || kva_quantize(&wv, &d->v) ? -1 : 0;
}

/* Cases: K and V of one format (one combined tensor); no strided K/V
 * operands (the packed ones are rewritten by kva_quantize). */
static const el_case cw_cases[] = {
    {{3, 8, 2, 1, 90, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 0},
    {{2, 8, 4, 1, 70, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 0},
    {{2, 8, 2, 2, 50, 64, 64, F16, F16, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 7, 0},
    {{3, 8, 2, 1, 120, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 0},
    {{2, 4, 2, 3, 80, 64, 64, F32, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 8, 0},
};
#define N_CW_CASES ((int)(sizeof cw_cases / sizeof cw_cases[0]))

TEST(engine_layouts_cache_write) {
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  for (int ci = 0; ci < N_CW_CASES && !test_failed_flag; ++ci)
    for (int lay = 0; lay < EL_LAYOUTS && !test_failed_flag; ++lay) {
      const el_case *ec = &cw_cases[ci];
      char cs[256], name[400];
      att_case_str(&ec->c, cs, sizeof cs);
      snprintf(name, sizeof name, "cache_write %s %s block=%d", el_names[lay], cs, ec->bs);
      att_data d;
      el_table tb;
      el_pools p, want;
      el_writes w;
      float *rawk = NULL, *rawv = NULL;
      ASSERT_TRUE(att_make(&d, &ec->c) == 0);
      if (ec->c.kbits) ASSERT_TRUE(el_requantize(&d, &rawk, &rawv) == 0);
      ASSERT_TRUE(el_table_make(&tb, &d, ec->bs, 0) == 0);
      ASSERT_TRUE(el_pools_make(&p, lay, &d.k, tb.nb, ec->bs, 0xff) == 0);
      ASSERT_TRUE(el_pools_make(&want, lay, &d.k, tb.nb, ec->bs, 0xff) == 0);
      el_fill(&want, &tb, &d);
      ASSERT_TRUE(el_writes_make(&w, &d, &tb, rawk, rawv) == 0);
      const kva_tensor k1 = el_rows(&w.k, 0, w.n1), v1 = el_rows(&w.v, 0, w.n1);
      const kva_tensor k2 = el_rows(&w.k, w.n1, w.n - w.n1), v2 = el_rows(&w.v, w.n1, w.n - w.n1);
      ASSERT_OK(kva_cache_write(ctx, &p.k, &p.v, &k1, &v1, w.slots, w.n1));
      ASSERT_OK(kva_cache_write(ctx, &p.k, &p.v, &k2, &v2, w.slots + w.n1, w.n - w.n1));
      /* the rows in the pool format bit for bit where the slots say, the
       * rest of every buffer untouched */
      if (el_same_pools(&p, &want, name)) {
        const kva_kv_view view = kva_view_block_table(&p.k, &p.v, &tb.t);
        if (el_attend_cpu(ctx, &d, &view, name)) printf("  %s\n", name);
      }
      /* a slot past the pools: an error naming it, nothing written */
      int32_t bad[2] = {w.slots[0], (int32_t)(tb.nb * tb.bs)};
      const kva_tensor kb = el_rows(&w.k, 0, 2), vb = el_rows(&w.v, 0, 2);
      ASSERT_ERR(kva_cache_write(ctx, &p.k, &p.v, &kb, &vb, bad, 2), KVA_EINVAL, "slots[1] =");
      el_same_pools(&p, &want, name);
      el_writes_free(&w);
      el_pools_free(&p);
      el_pools_free(&want);
      el_table_free(&tb);
      free(rawk);
      free(rawv);
      att_free(&d);
    }
  kva_context_destroy(ctx);
}

/* ---------------------------------------------------------------- CUDA */
#ifndef KVA_HAVE_CUDA
TEST(engine_layouts_cuda_attention) { SKIP("built without CUDA (nvcc not found)"); }
TEST(engine_layouts_cuda_cache_write) { SKIP("built without CUDA (nvcc not found)"); }
TEST(engine_layouts_cuda_graph) { SKIP("built without CUDA (nvcc not found)"); }
#else
#include <cuda_runtime_api.h>

#define EL_DEV_MAX 32
typedef struct el_dev {
  void *mem[EL_DEV_MAX];
  int n;
} el_dev;

static void el_dev_free(el_dev *m) {
  for (int i = 0; i < m->n; ++i) cudaFree(m->mem[i]);
  m->n = 0;
}
/* A device copy of n bytes at h (h NULL: uninitialized); NULL on failure. */
static void *el_dev_copy(el_dev *m, const void *h, size_t n) {
  void *p = NULL;
  if (m->n == EL_DEV_MAX || cudaMalloc(&p, n ? n : 1) != cudaSuccess) return NULL;
  m->mem[m->n++] = p;
  if (h && cudaMemcpy(p, h, n, cudaMemcpyHostToDevice) != cudaSuccess) return NULL;
  return p;
}
static size_t el_extent(const kva_tensor *t) {
  size_t e = kva_dtype_size(t->dtype);
  for (int i = 0; i < t->ndim; ++i) e += (size_t)((t->shape[i] - 1) * t->stride[i]);
  return e;
}
static int el_dev_tensor(el_dev *m, kva_tensor *t) {
  if (!t->data) return 0;
  void *p = el_dev_copy(m, t->data, el_extent(t));
  if (!p) return -1;
  t->data = p;
  return 0;
}

/* Device pools: h's buffers mirrored, descriptors at the same offsets. */
static int el_dev_pools(el_dev *m, const el_pools *h, el_pools *d) {
  *d = *h;
  kva_tensor *kt[3] = {&d->k.data, &d->k.scales, &d->k.biases}, *vt[3] = {&d->v.data, &d->v.scales, &d->v.biases};
  for (int f = 0; f < 3; ++f) {
    if (!h->mem[f][0]) continue;
    void *dm[2] = {NULL, NULL};
    for (int i = 0; i < h->nbuf; ++i)
      if (!(dm[i] = el_dev_copy(m, h->mem[f][i], h->bytes[f][i]))) return -1;
    kt[f]->data = (char *)dm[0] + ((char *)kt[f]->data - (char *)h->mem[f][0]);
    const int vi = h->nbuf == 2;
    vt[f]->data = (char *)dm[vi] + ((char *)vt[f]->data - (char *)h->mem[f][vi]);
    for (int i = 0; i < 2; ++i) d->mem[f][i] = dm[i];
  }
  return 0;
}
/* The device pools' bytes back into the host buffers of h. */
static int el_fetch_pools(const el_pools *dp, el_pools *h) {
  for (int f = 0; f < 3; ++f)
    for (int i = 0; i < h->nbuf; ++i)
      if (h->mem[f][i] && cudaMemcpy(h->mem[f][i], dp->mem[f][i], h->bytes[f][i], cudaMemcpyDeviceToHost) != cudaSuccess)
        return -1;
  return 0;
}

/* The call's operands on the device: q, sinks, lengths and table; out a
 * device buffer of d's out buffer's size at the same offset. */
typedef struct el_call {
  kva_tensor q, out;
  kva_attn_params params;
  kva_block_table t;
  kva_kv_view view;
  char *out_base;
} el_call;

static int el_dev_call(el_dev *m, const att_data *hd, const el_table *tb, const el_pools *dp, el_call *dc) {
  const att_case *c = &hd->c;
  dc->q = hd->q;
  dc->params = hd->params;
  if (el_dev_tensor(m, &dc->q)) return -1;
  if (hd->sinks && !(dc->params.sinks = (const float *)el_dev_copy(m, hd->sinks, sizeof(float) * (size_t)c->H)))
    return -1;
  dc->t = tb->t;
  if (!(dc->t.blocks = (const int32_t *)el_dev_copy(m, tb->blocks, sizeof(int32_t) * (size_t)(c->B * tb->mb))) ||
      !(dc->t.seq_lens = (const int32_t *)el_dev_copy(m, tb->lens, sizeof(int32_t) * (size_t)c->B)))
    return -1;
  if (tb->t.first_offset &&
      !(dc->t.first_offset = (const int32_t *)el_dev_copy(m, tb->fo, sizeof(int32_t) * (size_t)c->B)))
    return -1;
  if (!(dc->out_base = (char *)el_dev_copy(m, NULL, hd->out_bytes))) return -1;
  dc->out = hd->out;
  dc->out.data = dc->out_base + ((const char *)hd->out.data - (const char *)hd->out_buf);
  dc->view = kva_view_block_table(&dp->k, &dp->v, &dc->t);
  return 0;
}

/* One device call against the oracle over the host pools (the same bytes),
 * with the roundings and the allowance of the kernel that runs; out poisoned
 * first, nothing written between its rows. */
static int el_attend_cuda(kva_context *ctx, att_data *hd, const kva_kv_view *hview, el_call *dc, const char *name) {
  char kname[160] = "";
  kva_tensor ref = att_alloc_like(hd, &hd->out), ref_c = att_alloc_like(hd, &hd->out);
  if (kva_reference_attention(&hd->q, &hd->view, &hd->params, &ref_c) ||
      kva_reference_attention(&hd->q, hview, &hd->params, &ref) ||
      memcmp(ref.data, ref_c.data, (size_t)(ref.shape[0] * ref.stride[0]))) {
    FAIL_("%s: the oracle over the pools differs from the contiguous cache's %s", name, kva_last_error());
    return 0;
  }
  if (kva_attention_kernel(ctx, &dc->q, &dc->view, &dc->params, &dc->out, kname, sizeof kname) < 0 ||
      att_kernel_reference(ctx, &dc->q, &dc->view, &dc->params, &dc->out, &hd->q, hview, &hd->params, &ref)) {
    FAIL_("%s: kernel / oracle: %s", name, kva_last_error());
    return 0;
  }
  const double atol = att_kernel_atol(ctx, &dc->q, &dc->view, &dc->params, &dc->out);
  if (cudaMemset(dc->out_base, 0xff, hd->out_bytes) != cudaSuccess) {
    FAIL_("%s: poison out", name);
    return 0;
  }
  if (kva_attention(ctx, &dc->q, &dc->view, &dc->params, &dc->out, NULL, 0)) {
    FAIL_("%s: kva_attention(CUDA): %s", name, kva_last_error());
    return 0;
  }
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpy(hd->out_buf, dc->out_base, hd->out_bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
    FAIL_("%s: running or fetching: %s", name, cudaGetErrorString(cudaGetLastError()));
    return 0;
  }
  if (!att_out_padding_is(hd, 0xff)) {
    FAIL_("%s: CUDA wrote between the rows of out", name);
    return 0;
  }
  double err = 0;
  if (!att_compare(&hd->out, &ref, atol, att_rtol(hd->c.odt), &err, NULL)) {
    FAIL_("%s: %s differs from the oracle (max err %.3g, allowed %.3g of max|ref|)", name, kname, err, atol);
    return 0;
  }
  printf("  %s: %s\n", name, kname);
  return 1;
}

/* The tensor-core kernels (bf16 queries over q4 / q8 with bf16 scales, 2 to
 * 8 groups per row; bf16 / f16 rows with >= 3 query vectors per KV head),
 * the fused kernel (f32 queries; one group per row, whose scale entries
 * the NHD layouts put KVH * 2 bytes apart, not 2: kvc_one_group_rows) and
 * the general one (L > 16). */
static const el_case cuda_cases[] = {
    {{3, 8, 2, 1, 700, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 0},
    {{2, 16, 4, 4, 500, 128, 128, BF16, BF16, 4, 4, 32, BF16, MASK_WINDOW, 90, 0, 1, 1, 0}, 16, 1},
    {{2, 32, 8, 1, 600, 128, 128, BF16, BF16, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 0},
    {{2, 24, 4, 2, 600, 256, 256, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 0},
    {{2, 8, 2, 4, 300, 128, 128, F16, F16, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 32, 1},
    {{2, 8, 4, 1, 400, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 0},
    {{2, 8, 4, 1, 400, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, 16, 0},
    {{2, 8, 2, 3, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 5.0f, 1, 1, 0}, 8, 1},
    {{1, 4, 2, 20, 200, 64, 64, F32, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 0, 0, 0}, 16, 0},
};
#define N_CUDA_CASES ((int)(sizeof cuda_cases / sizeof cuda_cases[0]))

TEST(engine_layouts_cuda_attention) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  for (int ci = 0; ci < N_CUDA_CASES && !test_failed_flag; ++ci)
    for (int lay = 0; lay < EL_LAYOUTS && !test_failed_flag; ++lay)
      for (int pr = 0; pr < ATT_PROBES && !test_failed_flag; ++pr) {
        const el_case *ec = &cuda_cases[ci];
        char cs[256], name[400];
        att_case_str(&ec->c, cs, sizeof cs);
        snprintf(name, sizeof name, "CUDA %s %s block=%d%s q=%s", el_names[lay], cs, ec->bs,
                 ec->offsets ? " offsets" : "", att_query_names[pr]);
        att_data d;
        el_table tb;
        el_pools p, dp;
        el_dev m = {{0}, 0};
        el_call dc;
        ASSERT_TRUE(att_make_q(&d, &ec->c, pr) == 0);
        ASSERT_TRUE(el_table_make(&tb, &d, ec->bs, ec->offsets) == 0);
        ASSERT_TRUE(el_pools_make(&p, lay, &d.k, tb.nb, ec->bs, 0xff) == 0);
        el_fill(&p, &tb, &d);
        const kva_kv_view hview = kva_view_block_table(&p.k, &p.v, &tb.t);
        if (el_dev_pools(&m, &p, &dp) || el_dev_call(&m, &d, &tb, &dp, &dc)) FAIL_("%s: device copies", name);
        else el_attend_cuda(ctx, &d, &hview, &dc, name);
        el_dev_free(&m);
        el_pools_free(&p);
        el_table_free(&tb);
        att_free(&d);
      }
  kva_context_destroy(ctx);
}

/* kva_cache_write on the device into each layout: the pools' bytes against
 * the host image, then attention over them. */
TEST(engine_layouts_cuda_cache_write) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  for (int ci = 0; ci < N_CW_CASES && !test_failed_flag; ++ci)
    for (int lay = 0; lay < EL_LAYOUTS && !test_failed_flag; ++lay) {
      const el_case *ec = &cw_cases[ci];
      char cs[256], name[400];
      att_case_str(&ec->c, cs, sizeof cs);
      snprintf(name, sizeof name, "CUDA cache_write %s %s block=%d", el_names[lay], cs, ec->bs);
      att_data d;
      el_table tb;
      el_pools p, want, dp;
      el_writes w;
      el_dev m = {{0}, 0};
      el_call dc;
      float *rawk = NULL, *rawv = NULL;
      ASSERT_TRUE(att_make(&d, &ec->c) == 0);
      if (ec->c.kbits) ASSERT_TRUE(el_requantize(&d, &rawk, &rawv) == 0);
      ASSERT_TRUE(el_table_make(&tb, &d, ec->bs, 0) == 0);
      ASSERT_TRUE(el_pools_make(&p, lay, &d.k, tb.nb, ec->bs, 0xff) == 0);
      ASSERT_TRUE(el_pools_make(&want, lay, &d.k, tb.nb, ec->bs, 0xff) == 0);
      el_fill(&want, &tb, &d);
      ASSERT_TRUE(el_writes_make(&w, &d, &tb, rawk, rawv) == 0);
      const size_t qkv_bytes = (size_t)(w.n * w.k.stride[0]);
      char *dqkv = (char *)el_dev_copy(&m, w.qkv, qkv_bytes);
      int32_t *dslots = (int32_t *)el_dev_copy(&m, w.slots, sizeof(int32_t) * (size_t)w.n);
      if (!dqkv || !dslots || el_dev_pools(&m, &p, &dp)) {
        FAIL_("%s: device copies", name);
      } else {
        kva_tensor dk = w.k, dv = w.v;
        dk.data = dqkv + ((char *)w.k.data - (char *)w.qkv);
        dv.data = dqkv + ((char *)w.v.data - (char *)w.qkv);
        const kva_tensor k1 = el_rows(&dk, 0, w.n1), v1 = el_rows(&dv, 0, w.n1);
        const kva_tensor k2 = el_rows(&dk, w.n1, w.n - w.n1), v2 = el_rows(&dv, w.n1, w.n - w.n1);
        if (kva_cache_write(ctx, &dp.k, &dp.v, &k1, &v1, dslots, w.n1) ||
            kva_cache_write(ctx, &dp.k, &dp.v, &k2, &v2, dslots + w.n1, w.n - w.n1))
          FAIL_("%s: kva_cache_write(CUDA): %s", name, kva_last_error());
        else if (cudaDeviceSynchronize() != cudaSuccess || el_fetch_pools(&dp, &p))
          FAIL_("%s: running or fetching the pools", name);
        else if (el_same_pools(&p, &want, name)) {
          const kva_kv_view hview = kva_view_block_table(&p.k, &p.v, &tb.t);
          if (el_dev_call(&m, &d, &tb, &dp, &dc)) FAIL_("%s: device copies", name);
          else el_attend_cuda(ctx, &d, &hview, &dc, name);
        }
      }
      el_dev_free(&m);
      el_writes_free(&w);
      el_pools_free(&p);
      el_pools_free(&want);
      el_table_free(&tb);
      free(rawk);
      free(rawv);
      att_free(&d);
    }
  kva_context_destroy(ctx);
}

/* An engine's decode step captured once in a CUDA graph (cache_write of one
 * token per sequence, then attention over the NHD pools of a (2, nb, bs,
 * KVH, D) tensor) and replayed with new tokens: the slots, lengths and
 * rows change in device memory between replays, the pointers do not. Each
 * replay against the oracle over the host image of the pools. */
TEST(engine_layouts_cuda_graph) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  const att_case ac = {3, 16, 4, 1, 300, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0};
  const int64_t bs = 16, steps = 3;
  att_data d;
  el_table tb;
  el_pools p, dp;
  el_dev m = {{0}, 0};
  el_call dc;
  float *rawk = NULL, *rawv = NULL;
  ASSERT_TRUE(att_make(&d, &ac) == 0);
  ASSERT_TRUE(el_requantize(&d, &rawk, &rawv) == 0);
  /* each sequence starts at its length less the decode steps (at least 1 token) */
  for (int b = 0; b < ac.B; ++b) {
    if (d.lens[b] > ac.N - steps) d.lens[b] = (int32_t)(ac.N - steps);
    d.lens[b] = d.lens[b] < 1 ? 1 : d.lens[b];
  }
  int32_t start[8];
  for (int b = 0; b < ac.B; ++b) start[b] = d.lens[b], d.lens[b] += (int32_t)steps;
  ASSERT_TRUE(el_table_make(&tb, &d, bs, 0) == 0); /* sized for start + steps tokens */
  for (int b = 0; b < ac.B; ++b) d.lens[b] = start[b], tb.lens[b] = start[b];
  ASSERT_TRUE(el_pools_make(&p, EL_KV_FIRST, &d.k, tb.nb, bs, 0xff) == 0);
  for (int b = 0; b < ac.B; ++b)
    for (int64_t t = 0; t < start[b]; ++t) {
      const int32_t s = el_slot(&tb, b, t);
      el_put(&p.k, &d.k, s / bs, s % bs, b, t);
      el_put(&p.v, &d.v, s / bs, s % bs, b, t);
    }
  kva_context *ctx;
  cudaStream_t st;
  ASSERT_TRUE(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) == cudaSuccess);
  kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, st};
  ASSERT_OK(kva_context_create(&ctx, &o));
  /* one token per sequence: rows [B, KVH, D] f32, slots [B] */
  const size_t rows = (size_t)(ac.B * ac.KVH * ac.Dk);
  float *hk = (float *)malloc(rows * sizeof(float)), *hv = (float *)malloc(rows * sizeof(float));
  int32_t hslots[8];
  ASSERT_TRUE(hk && hv);
  float *dkr = (float *)el_dev_copy(&m, NULL, rows * sizeof(float)), *dvr = (float *)el_dev_copy(&m, NULL, rows * sizeof(float));
  int32_t *dslots = (int32_t *)el_dev_copy(&m, NULL, sizeof hslots);
  ASSERT_TRUE(dkr && dvr && dslots && el_dev_pools(&m, &p, &dp) == 0);
  kva_tensor k3 = {dkr, F32, 3, {ac.B, ac.KVH, ac.Dk, 0}, {ac.KVH * ac.Dk * 4, ac.Dk * 4, 4, 0}}, v3 = k3;
  v3.data = dvr;
  /* lengths as they will be at the first replay */
  for (int b = 0; b < ac.B; ++b) tb.lens[b] = start[b] + 1;
  ASSERT_TRUE(el_dev_call(&m, &d, &tb, &dp, &dc) == 0);
  /* the engine's own workspace, sized once (fixed pointers in the graph) */
  size_t ws_bytes = 0;
  ASSERT_OK(kva_attention_workspace_size(ctx, &dc.q, &dc.view, &dc.params, &ws_bytes));
  void *ws = ws_bytes ? el_dev_copy(&m, NULL, ws_bytes) : NULL;
  ASSERT_TRUE(!ws_bytes || ws);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_TRUE(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal) == cudaSuccess);
  const int rc_w = kva_cache_write(ctx, &dp.k, &dp.v, &k3, &v3, dslots, ac.B);
  const int rc_a = kva_attention(ctx, &dc.q, &dc.view, &dc.params, &dc.out, ws, ws_bytes);
  ASSERT_TRUE(cudaStreamEndCapture(st, &graph) == cudaSuccess);
  ASSERT_OK(rc_w);
  ASSERT_OK(rc_a);
  ASSERT_TRUE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  for (int64_t s = 0; s < steps && !test_failed_flag; ++s) {
    /* the new token of every sequence: fresh rows, quantized on the host for the image */
    for (size_t i = 0; i < rows; ++i) hk[i] = test_randn(), hv[i] = test_randn();
    for (int b = 0; b < ac.B; ++b) {
      const int64_t t = start[b] + s;
      hslots[b] = el_slot(&tb, b, t);
      tb.lens[b] = (int32_t)(t + 1);
      d.lens[b] = (int32_t)(t + 1);
      /* the contiguous cache's row t: kva_quantize of the same f32 rows */
      kva_tensor wk = kva_tensor_4d(hk + (size_t)b * ac.KVH * ac.Dk, F32, 1, ac.KVH, 1, ac.Dk), wv = wk;
      wv.data = hv + (size_t)b * ac.KVH * ac.Dk;
      kva_kv qk = d.k, qv = d.v;
      kva_tensor *pk[3] = {&qk.data, &qk.scales, &qk.biases}, *pv[3] = {&qv.data, &qv.scales, &qv.biases};
      for (int f = 0; f < 3; ++f) {
        pk[f]->data = (char *)pk[f]->data + b * pk[f]->stride[0] + t * pk[f]->stride[2];
        pv[f]->data = (char *)pv[f]->data + b * pv[f]->stride[0] + t * pv[f]->stride[2];
        pk[f]->shape[0] = pv[f]->shape[0] = 1;
        pk[f]->shape[2] = pv[f]->shape[2] = 1;
      }
      ASSERT_OK(kva_quantize(&wk, &qk));
      ASSERT_OK(kva_quantize(&wv, &qv));
      el_put(&p.k, &d.k, hslots[b] / bs, hslots[b] % bs, b, t);
      el_put(&p.v, &d.v, hslots[b] / bs, hslots[b] % bs, b, t);
    }
    ASSERT_TRUE(cudaMemcpyAsync(dkr, hk, rows * sizeof(float), cudaMemcpyHostToDevice, st) == cudaSuccess);
    ASSERT_TRUE(cudaMemcpyAsync(dvr, hv, rows * sizeof(float), cudaMemcpyHostToDevice, st) == cudaSuccess);
    ASSERT_TRUE(cudaMemcpyAsync(dslots, hslots, sizeof(int32_t) * ac.B, cudaMemcpyHostToDevice, st) == cudaSuccess);
    ASSERT_TRUE(cudaMemcpyAsync((void *)dc.t.seq_lens, tb.lens, sizeof(int32_t) * ac.B, cudaMemcpyHostToDevice, st) ==
                cudaSuccess);
    ASSERT_TRUE(cudaMemsetAsync(dc.out_base, 0xff, d.out_bytes, st) == cudaSuccess);
    ASSERT_TRUE(cudaGraphLaunch(exec, st) == cudaSuccess);
    ASSERT_TRUE(cudaStreamSynchronize(st) == cudaSuccess);
    ASSERT_TRUE(cudaMemcpy(d.out_buf, dc.out_base, d.out_bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    el_pools got = p;
    for (int f = 0; f < 3; ++f)
      for (int i = 0; i < 2; ++i) got.mem[f][i] = p.mem[f][i] ? malloc(p.bytes[f][i]) : NULL;
    ASSERT_TRUE(el_fetch_pools(&dp, &got) == 0);
    char name[96];
    snprintf(name, sizeof name, "graph replay %lld", (long long)s);
    const int same = el_same_pools(&got, &p, name);
    for (int f = 0; f < 3; ++f)
      for (int i = 0; i < 2; ++i) free(got.mem[f][i]);
    if (!same) break;
    /* the oracle over the host image, with the kernel's roundings */
    const kva_kv_view hview = kva_view_block_table(&p.k, &p.v, &tb.t);
    kva_tensor ref = att_alloc_like(&d, &d.out);
    ASSERT_OK(att_kernel_reference(ctx, &dc.q, &dc.view, &dc.params, &dc.out, &d.q, &hview, &d.params, &ref));
    const double atol = att_kernel_atol(ctx, &dc.q, &dc.view, &dc.params, &dc.out);
    double err = 0;
    if (!att_compare(&d.out, &ref, atol, att_rtol(ac.odt), &err, NULL))
      FAIL_("%s: differs from the oracle (max err %.3g, allowed %.3g)", name, err, atol);
    else printf("  %s: cache_write + attention over (2, nb, bs, KVH, D) q4 pools, max err %.3g\n", name, err);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  kva_context_destroy(ctx);
  cudaStreamDestroy(st);
  free(hk);
  free(hv);
  free(rawk);
  free(rawv);
  el_dev_free(&m);
  el_pools_free(&p);
  el_table_free(&tb);
  att_free(&d);
}
#endif

/* ------------------------------------------------ descriptors engines get wrong */
/* An NHD pool passed without its axes permuted (shape [nb, bs, KVH, D]:
 * block_size read as KVH), one whose head dim is not innermost, and K/V
 * descriptors whose strides overlap: an error naming the operand and the
 * rule, the output untouched. */
TEST(engine_layouts_bad_descriptors) {
  const att_case ac = {2, 8, 2, 1, 60, 64, 64, F32, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0};
  att_data d;
  el_table tb;
  el_pools p;
  ASSERT_TRUE(att_make(&d, &ac) == 0);
  ASSERT_TRUE(el_table_make(&tb, &d, 16, 0) == 0);
  ASSERT_TRUE(el_pools_make(&p, EL_KV_FIRST, &d.k, tb.nb, 16, 0) == 0);
  el_fill(&p, &tb, &d);
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  kva_kv k = p.k, v = p.v;
  kva_kv_view view = kva_view_block_table(&k, &v, &tb.t);
  ASSERT_OK(kva_attention(ctx, &d.q, &view, &d.params, &d.out, NULL, 0));
  att_poison(&d);
  unsigned char *snap = (unsigned char *)malloc(d.out_bytes);
  ASSERT_TRUE(snap != NULL);
  memcpy(snap, d.out_buf, d.out_bytes);
  /* unpermuted: [nb, bs, KVH, D] with its natural strides */
  for (int i = 0; i < 2; ++i) {
    kva_tensor *t = i ? &v.data : &k.data;
    t->shape[1] = 16;
    t->shape[2] = ac.KVH;
    const int64_t s1 = t->stride[1];
    t->stride[1] = t->stride[2];
    t->stride[2] = s1;
  }
  view = kva_view_block_table(&k, &v, &tb.t);
  ASSERT_ERR(kva_attention(ctx, &d.q, &view, &d.params, &d.out, NULL, 0), KVA_ESHAPE,
             "q heads H = 8 is not a multiple of KV heads KVH = 16 (k_pool.shape[1]: pools are [num_blocks, KVH, "
             "block_size, D]; an NHD pool [num_blocks, block_size, KVH, D] is passed with axes 1 and 2 swapped");
  k = p.k, v = p.v;
  k.data.stride[3] = 2 * k.data.stride[3];
  view = kva_view_block_table(&k, &v, &tb.t);
  ASSERT_ERR(kva_attention(ctx, &d.q, &view, &d.params, &d.out, NULL, 0), KVA_ESTRIDE,
             "k_pool.data: innermost stride 4 must equal the element size 2");
  k = p.k;
  k.data.stride[2] = k.data.stride[1];
  view = kva_view_block_table(&k, &v, &tb.t);
  ASSERT_ERR(kva_attention(ctx, &d.q, &view, &d.params, &d.out, NULL, 0), KVA_ESTRIDE,
             "k_pool.data: stride[2] = 128 overlaps the inner dimensions");
  /* cache_write names the same rules */
  kva_tensor rows = kva_tensor_4d(d.q.data, F32, 2, ac.KVH, 64, 1);
  rows.ndim = 3;
  const int32_t slots[2] = {0, 1};
  ASSERT_ERR(kva_cache_write(ctx, &k, &p.v, &rows, &rows, slots, 2), KVA_ESTRIDE,
             "k_pool.data: stride[2] = 128 overlaps the inner dimensions");
  ASSERT_TRUE(memcmp(snap, d.out_buf, d.out_bytes) == 0 && att_sentinel_ok(&d));
  free(snap);
  kva_context_destroy(ctx);
  el_pools_free(&p);
  el_table_free(&tb);
  att_free(&d);
}
