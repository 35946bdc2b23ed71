/* Randomized bad input to kva_attention (CPU): valid calls over contiguous
 * caches and over caller-owned block pools broken by one to three random
 * mutations of their descriptors (ranks, dtypes, shapes, strides, pointers,
 * bits, group sizes, layouts, lengths, scale, softcap, mask fields; block
 * tables: batch, columns, row stride, block ids, lengths, first offsets).
 * Each mutated call must either fail with a negative code and a message,
 * leaving the output and its sentinel untouched, or succeed, be accepted by
 * the oracle (kva_reference_attention) too, and (strides unchanged) agree
 * with it. Run under ASan and UBSan by `make test`, so an out-of-bounds read
 * or an overflowing size computation in validation fails here too.
 *
 * Tensor mutations (att_mutate_tensor / att_mutate_kv, attn_check.h) never
 * make a view larger than its buffer; a table's columns and row stride only
 * shrink or become invalid, its block ids stay in the pool or become
 * invalid; what is left valid therefore stays inside the buffers att_make
 * and att_table_make allocated. */
#include "attn_check.h"

#include <stdint.h>

enum { MUT_ITERS = 2500, MUT_ITERS_QUICK = 400 };

/* One call's descriptors, mutable copies of the base call's (and of its
 * block table and the table's arrays). */
typedef struct mut_call {
  kva_tensor q, out;
  kva_kv_view view;
  kva_attn_params p;
  int32_t *lens;               /* contiguous lengths (view.seq_lens once mutated) */
  kva_block_table t;           /* BLOCK_TABLE: view.table points here */
  int32_t *blocks, *tlens, *fo; /* its arrays */
} mut_call;

/* The base call: a case's operands and, with a block size, its pools. */
typedef struct mut_base {
  att_data d;
  att_table tb;
  int table;
  const kva_kv_view *view;
} mut_base;

static void mutate_table(mut_call *c, const mut_base *m) {
  const int B = m->d.c.B, L = m->d.c.L;
  const int64_t mb = m->tb.t.max_blocks, bs = m->tb.bs, nblk = m->tb.nblk;
  const int b = att_pick(B);
  switch (att_pick(8)) {
  case 0: {
    const int64_t vals[] = {0, -1, B - 1, B + 1, att_absurd()};
    c->t.batch = vals[att_pick(5)];
    break;
  }
  case 1: { /* fewer columns, or none */
    const int64_t vals[] = {0, -1, mb - 1, att_absurd()};
    c->t.max_blocks = vals[att_pick(4)];
    break;
  }
  case 2: { /* row stride: never past the table's rows */
    const int64_t vals[] = {-1, -mb, 1, mb - 1, 0};
    c->t.row_stride = vals[att_pick(5)];
    break;
  }
  case 3: { /* a block id: out of the pool, or another block's */
    const int64_t vals[] = {-1, nblk, INT32_MAX, INT32_MIN, att_pick((int)nblk)};
    c->blocks[b * mb + att_pick((int)mb)] = (int32_t)vals[att_pick(5)];
    break;
  }
  case 4: { /* a length */
    const int64_t cap = mb * bs - c->fo[b];
    const int64_t vals[] = {INT32_MIN, -1, 0, 1, L - 1, L, cap, cap + 1, INT32_MAX};
    c->tlens[b] = (int32_t)vals[att_pick(9)];
    break;
  }
  case 5: { /* a first offset */
    const int64_t vals[] = {INT32_MIN, -1, 0, bs - 1, bs, INT32_MAX};
    c->fo[b] = (int32_t)vals[att_pick(6)];
    break;
  }
  case 6: c->t.first_offset = NULL; break; /* valid: no offsets */
  default:
    if (att_pick(2)) c->t.blocks = NULL;
    else c->t.seq_lens = NULL;
    break;
  }
}

/* One mutation somewhere in the call. */
static void mutate_call(mut_call *c, const mut_base *m) {
  static const float scales[] = {NAN, INFINITY, -INFINITY, 0.0f, -1.0f, 1e30f, 1e-30f};
  static const float caps[] = {NAN, INFINITY, -INFINITY, -1.0f, 0.0f, 1e-30f, 50.0f};
  static const int32_t windows[] = {INT32_MIN, -1, 0, 1, 5, INT32_MAX};
  const int B = m->d.c.B, L = m->d.c.L;
  const int64_t N = m->d.c.N;
  kva_attn_params *p = &c->p;
  switch (att_pick(m->table ? 15 : 12)) {
  case 0: att_mutate_tensor(&c->q); break;
  case 1: att_mutate_tensor(&c->out); break;
  case 2: att_mutate_kv(&c->view.k); break;
  case 3: att_mutate_kv(&c->view.v); break;
  case 4: { /* layout without its view or table */
    static const int layouts[] = {-1, KVA_LAYOUT_CONTIGUOUS, KVA_LAYOUT_PAGED, KVA_LAYOUT_BLOCK_TABLE, 3};
    const int l = layouts[att_pick(5)];
    /* (contiguous over a table's pools would read them as [B, KVH, N, D]: past their end) */
    if (!(m->table && l == KVA_LAYOUT_CONTIGUOUS)) c->view.layout = (kva_layout)l;
    break;
  }
  case 5: { /* a length */
    const int64_t vals[] = {INT32_MIN, -1, 0, 1, L - 1, L, N - 1, N, N + 1, INT32_MAX};
    c->view.seq_lens = c->lens;
    c->lens[att_pick(B)] = (int32_t)vals[att_pick(10)];
    break;
  }
  case 6: p->scale = scales[att_pick(7)]; break;
  case 7: p->softcap = caps[att_pick(7)]; break;
  case 8: {
    static const int kinds[] = {-1, KVA_MASK_NONE, KVA_MASK_CAUSAL, KVA_MASK_ARRAY, 3, 99};
    p->mask.kind = (kva_mask_kind)kinds[att_pick(6)];
    break;
  }
  case 9: p->mask.window = windows[att_pick(6)]; break;
  case 10:
    if (p->mask.segments.data) att_mutate_tensor(&p->mask.segments);
    else if (p->mask.array.data) att_mutate_tensor(&p->mask.array);
    else p->sinks = NULL;
    break;
  case 11: p->mask.segments_clamp = att_pick(2); break;
  default: mutate_table(c, m); break;
  }
}

/* Prints the fields of a mutated call that differ from the base call. */
static void tensor_diff(const char *name, const kva_tensor *a, const kva_tensor *b) {
  if (a->data != b->data) fprintf(stderr, "    %s.data %p -> %p\n", name, b->data, a->data);
  if (a->dtype != b->dtype) fprintf(stderr, "    %s.dtype %d -> %d\n", name, (int)b->dtype, (int)a->dtype);
  if (a->ndim != b->ndim) fprintf(stderr, "    %s.ndim %d -> %d\n", name, b->ndim, a->ndim);
  for (int d = 0; d < KVA_MAX_DIMS; ++d) {
    if (a->shape[d] != b->shape[d])
      fprintf(stderr, "    %s.shape[%d] %lld -> %lld\n", name, d, (long long)b->shape[d], (long long)a->shape[d]);
    if (a->stride[d] != b->stride[d])
      fprintf(stderr, "    %s.stride[%d] %lld -> %lld\n", name, d, (long long)b->stride[d], (long long)a->stride[d]);
  }
}
static void kv_diff(const char *name, const kva_kv *a, const kva_kv *b) {
  char n[32];
  snprintf(n, sizeof n, "%s.data", name);
  tensor_diff(n, &a->data, &b->data);
  snprintf(n, sizeof n, "%s.scales", name);
  tensor_diff(n, &a->scales, &b->scales);
  snprintf(n, sizeof n, "%s.biases", name);
  tensor_diff(n, &a->biases, &b->biases);
  if (a->bits != b->bits) fprintf(stderr, "    %s.bits %d -> %d\n", name, b->bits, a->bits);
  if (a->group_size != b->group_size) fprintf(stderr, "    %s.group %d -> %d\n", name, b->group_size, a->group_size);
}
static void call_diff(const mut_call *c, const mut_base *m) {
  const att_data *d = &m->d;
  const kva_kv_view *v = &c->view, *bv = m->view;
  const kva_attn_params *p = &c->p;
  tensor_diff("q", &c->q, &d->q);
  tensor_diff("out", &c->out, &d->out);
  kv_diff("k", &v->k, &bv->k);
  kv_diff("v", &v->v, &bv->v);
  if (v->layout != bv->layout) fprintf(stderr, "    layout %d -> %d\n", (int)bv->layout, (int)v->layout);
  for (int b = 0; b < d->c.B; ++b)
    if (v->seq_lens && v->seq_lens != bv->seq_lens) fprintf(stderr, "    len[%d] -> %d\n", b, (int)c->lens[b]);
  if (m->table) {
    const kva_block_table *t = &c->t, *bt = &m->tb.t;
    if (t->batch != bt->batch) fprintf(stderr, "    table.batch -> %lld\n", (long long)t->batch);
    if (t->max_blocks != bt->max_blocks) fprintf(stderr, "    table.max_blocks -> %lld\n", (long long)t->max_blocks);
    if (t->row_stride != bt->row_stride) fprintf(stderr, "    table.row_stride -> %lld\n", (long long)t->row_stride);
    if (!t->blocks || !t->seq_lens || !t->first_offset) fprintf(stderr, "    a table pointer -> NULL\n");
    for (int64_t i = 0; i < d->c.B * bt->max_blocks; ++i)
      if (c->blocks[i] != bt->blocks[i]) fprintf(stderr, "    table.blocks[%lld] -> %d\n", (long long)i, (int)c->blocks[i]);
    for (int b = 0; b < d->c.B; ++b) {
      if (c->tlens[b] != bt->seq_lens[b]) fprintf(stderr, "    table.seq_lens[%d] -> %d\n", b, (int)c->tlens[b]);
      if (c->fo[b] != bt->first_offset[b])
        fprintf(stderr, "    table.first_offset[%d] %d -> %d (length %d, block %lld, %lld columns)\n", b,
                (int)bt->first_offset[b], (int)c->fo[b], (int)c->tlens[b], (long long)m->tb.bs,
                (long long)bt->max_blocks);
    }
  }
  if (!(p->scale == d->params.scale)) fprintf(stderr, "    scale -> %g\n", (double)p->scale);
  if (!(p->softcap == d->params.softcap)) fprintf(stderr, "    softcap -> %g\n", (double)p->softcap);
  if (p->mask.kind != d->params.mask.kind) fprintf(stderr, "    mask.kind -> %d\n", (int)p->mask.kind);
  if (p->mask.window != d->params.mask.window) fprintf(stderr, "    mask.window -> %d\n", (int)p->mask.window);
  if (p->mask.segments_clamp != d->params.mask.segments_clamp) fprintf(stderr, "    mask.clamp -> %d\n", p->mask.segments_clamp);
  tensor_diff("mask.segments", &p->mask.segments, &d->params.mask.segments);
  tensor_diff("mask.array", &p->mask.array, &d->params.mask.array);
  if (p->sinks != d->params.sinks) fprintf(stderr, "    sinks -> %p\n", (const void *)p->sinks);
}

/* Whether a mutated call addresses its elements as the base call does
 * (same strides everywhere). A changed stride that is still valid reads the
 * padding of att_make's strided views, a loud 0x7f pattern (~3.4e38) whose
 * products overflow f32 where the double oracle does not: such calls are
 * checked for their status, sentinel and memory safety, not compared. */
static int same_strides(const kva_tensor *a, const kva_tensor *b) {
  return memcmp(a->stride, b->stride, sizeof a->stride) == 0;
}
static int strides_kept(const mut_call *c, const mut_base *m) {
  const kva_kv_view *v = &c->view, *bv = m->view;
  const kva_attn_params *p = &c->p, *bp = &m->d.params;
  return same_strides(&c->q, &m->d.q) && same_strides(&v->k.data, &bv->k.data) &&
         same_strides(&v->k.scales, &bv->k.scales) && same_strides(&v->k.biases, &bv->k.biases) &&
         same_strides(&v->v.data, &bv->v.data) && same_strides(&v->v.scales, &bv->v.scales) &&
         same_strides(&v->v.biases, &bv->v.biases) && same_strides(&p->mask.segments, &bp->mask.segments) &&
         same_strides(&p->mask.array, &bp->mask.array);
}

static int64_t elems(const kva_tensor *t) {
  int64_t n = 1;
  for (int d = 0; d < 4; ++d) n *= t->shape[d];
  return n;
}

/* The base call's descriptors into c (fresh copies of the table arrays). */
static void call_reset(mut_call *c, const mut_base *m) {
  const int B = m->d.c.B;
  c->q = m->d.q;
  c->out = m->d.out;
  c->view = *m->view;
  c->p = m->d.params;
  for (int b = 0; b < B; ++b) c->lens[b] = m->d.lens ? m->d.lens[b] : (int32_t)m->d.c.N;
  if (m->table) {
    const kva_block_table *bt = &m->tb.t;
    memcpy(c->blocks, bt->blocks, sizeof(int32_t) * (size_t)(B * bt->max_blocks));
    memcpy(c->tlens, bt->seq_lens, sizeof(int32_t) * (size_t)B);
    memcpy(c->fo, bt->first_offset, sizeof(int32_t) * (size_t)B);
    c->t = (kva_block_table){bt->batch, bt->max_blocks, bt->row_stride, c->blocks, c->tlens, c->fo};
    c->view.table = &c->t;
  }
}

/* Runs the mutated calls of one base case (over pools of block size bs when
 * bs > 0); returns 0 when all held. */
static int run_mutations(const att_case *ac, int64_t bs, int iters, int *accepted, int *compared) {
  mut_base m;
  memset(&m, 0, sizeof m);
  if (att_make(&m.d, ac)) { FAIL_("att_make"); return -1; }
  m.view = &m.d.view;
  if (bs > 0) {
    /* unused pool rows finite (0x3c bytes: ~0.01 in bf16 and f32, ~1 in f16):
     * a valid mutation (another block id, another first offset) reads them,
     * and a NaN there would reach rows that do not see it on the AMX kernel
     * (README, Semantics), where the oracle skips it */
    if (att_table_make(&m.tb, &m.d, bs, 0x3c)) { att_free(&m.d); FAIL_("att_table_make"); return -1; }
    m.table = 1;
    m.view = &m.tb.view;
  }
  kva_context *ctx = NULL;
  int rc_all = kva_context_create(&ctx, NULL) ? -1 : 0;
  att_data *d = &m.d;
  const int B = ac->B;
  unsigned char *snap = (unsigned char *)malloc(d->out_bytes);
  mut_call c;
  memset(&c, 0, sizeof c);
  c.lens = (int32_t *)malloc(sizeof(int32_t) * (size_t)B);
  c.tlens = (int32_t *)malloc(sizeof(int32_t) * (size_t)B);
  c.fo = (int32_t *)malloc(sizeof(int32_t) * (size_t)B);
  c.blocks = (int32_t *)malloc(sizeof(int32_t) * (size_t)(B * (m.table ? m.tb.t.max_blocks : 1)));
  if (!snap || !c.lens || !c.tlens || !c.fo || !c.blocks) rc_all = -1;
  for (int it = 0; it < iters && rc_all == 0; ++it) {
    att_poison(d);
    memcpy(snap, d->out_buf, d->out_bytes);
    call_reset(&c, &m);
    const int nm = 1 + att_pick(3);
    for (int k = 0; k < nm; ++k) mutate_call(&c, &m);
    if (getenv("KVA_MUT_TRACE")) { /* a crash's last mutations, for whoever debugs one */
      fprintf(stderr, "iteration %d:\n", it);
      call_diff(&c, &m);
    }
    const int rc = kva_attention(ctx, &c.q, &c.view, &c.p, &c.out, NULL, 0);
    if (rc < 0) {
      if (!kva_last_error()[0]) { FAIL_("iteration %d: code %d without a message", it, rc); rc_all = -1; }
      if (memcmp(snap, d->out_buf, d->out_bytes) != 0 || !att_sentinel_ok(d)) {
        FAIL_("iteration %d: output modified on error %d (%s); the mutations:", it, rc, kva_last_error());
        call_diff(&c, &m);
        rc_all = -1;
      }
      continue;
    }
    ++*accepted;
    if (!att_sentinel_ok(d)) { FAIL_("iteration %d: sentinel overwritten", it); rc_all = -1; break; }
    /* accepted: the oracle must accept the same descriptors and agree */
    if (c.out.ndim != 4 || elems(&c.out) > elems(&d->out)) {
      FAIL_("iteration %d: accepted a larger output", it);
      rc_all = -1;
      break;
    }
    kva_tensor ref = kva_tensor_4d(NULL, c.out.dtype, c.out.shape[0], c.out.shape[1], c.out.shape[2], c.out.shape[3]);
    ref.data = malloc((size_t)elems(&c.out) * kva_dtype_size(c.out.dtype));
    if (!ref.data) { rc_all = -1; break; }
    const int rrc = kva_reference_attention(&c.q, &c.view, &c.p, &ref);
    const int compare = strides_kept(&c, &m);
    *compared += compare;
    if (rrc < 0) {
      FAIL_("iteration %d: kva_attention accepted what the oracle refuses (%d: %s); the mutations:", it, rrc,
            kva_last_error());
      call_diff(&c, &m);
      rc_all = -1;
    } else if (compare) {
      double max_err, rel_l2;
      if (!att_compare(&c.out, &ref, att_case_atol(ac), att_rtol(c.out.dtype), &max_err, &rel_l2)) {
        FAIL_("iteration %d: accepted call differs from the oracle (max err %.3g); the mutations:", it, max_err);
        call_diff(&c, &m);
        rc_all = -1;
      }
    }
    free(ref.data);
  }
  free(c.lens);
  free(c.tlens);
  free(c.fo);
  free(c.blocks);
  free(snap);
  kva_context_destroy(ctx);
  if (m.table) att_table_free(&m.tb);
  att_free(d);
  return rc_all;
}

TEST(errors_random_mutations) {
  /* q4 with bf16 scales (ragged, strided views), bf16 rows with a window and
   * sinks, q8 with f16 scales and segments, f16 rows with a bool mask array;
   * each over contiguous caches and over caller pools of blocks of 8 and 5 */
  static const struct {
    att_case c;
    int block;
  } cases[] = {
      {{2, 8, 4, 2, 64, 128, 128, KVA_F32, KVA_F32, 4, 4, 64, KVA_BF16, MASK_CAUSAL, 0, 0, 0, 1, 1}, 0},
      {{2, 4, 2, 3, 50, 64, 64, KVA_BF16, KVA_BF16, 0, 0, 0, KVA_BF16, MASK_WINDOW, 9, 20.0f, 1, 1, 0}, 0},
      {{1, 6, 2, 2, 40, 64, 64, KVA_BF16, KVA_F32, 8, 8, 32, KVA_F16, MASK_SEG, 0, 0, 0, 0, 1}, 0},
      {{2, 4, 4, 2, 30, 64, 64, KVA_F32, KVA_F16, 0, 0, 0, KVA_F16, MASK_BOOL, 0, 0, 0, 1, 0}, 0},
      {{2, 8, 4, 2, 64, 128, 128, KVA_F32, KVA_F32, 4, 4, 64, KVA_BF16, MASK_CAUSAL, 0, 0, 0, 1, 1}, 8},
      {{3, 4, 2, 3, 50, 64, 64, KVA_BF16, KVA_BF16, 0, 0, 0, KVA_BF16, MASK_WINDOW, 9, 20.0f, 1, 1, 0}, 5},
  };
  const int iters = test_quick ? MUT_ITERS_QUICK : MUT_ITERS;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    int accepted = 0, compared = 0;
    if (run_mutations(&cases[i].c, cases[i].block, iters, &accepted, &compared) < 0) {
      char s[256];
      att_case_str(&cases[i].c, s, sizeof s);
      FAIL_("case %s, block %d", s, cases[i].block);
      return;
    }
    fprintf(stderr, "  case %zu (block %d): %d mutated calls, %d accepted, %d of them compared with the oracle\n", i,
            cases[i].block, iters, accepted, compared);
    /* some mutations (a shrink, a valid dtype, scale 1e30, no mask, another
     * block id) leave a valid call with the base strides: compared too */
    if (compared == 0) { FAIL_("case %zu: no mutated call was accepted and compared (%d accepted)", i, accepted); return; }
  }
}
