/* The descriptor mutations of the bad-input tests (mutate_call.h). */
#include "mutate_call.h"

#include <stdint.h>

const mut_case mut_cases[MUT_NCASES] = {
    {{2, 8, 4, 2, 64, 128, 128, KVA_F32, KVA_F32, 4, 4, 64, KVA_BF16, MASK_CAUSAL, 0, 0, 0, 1, 1}, 0},
    {{2, 4, 2, 3, 50, 64, 64, KVA_BF16, KVA_BF16, 0, 0, 0, KVA_BF16, MASK_WINDOW, 9, 20.0f, 1, 1, 0}, 0},
    {{1, 6, 2, 2, 40, 64, 64, KVA_BF16, KVA_F32, 8, 8, 32, KVA_F16, MASK_SEG, 0, 0, 0, 0, 1}, 0},
    {{2, 4, 4, 2, 30, 64, 64, KVA_F32, KVA_F16, 0, 0, 0, KVA_F16, MASK_BOOL, 0, 0, 0, 1, 0}, 0},
    {{2, 8, 4, 2, 64, 128, 128, KVA_F32, KVA_F32, 4, 4, 64, KVA_BF16, MASK_CAUSAL, 0, 0, 0, 1, 1}, 8},
    {{3, 4, 2, 3, 50, 64, 64, KVA_BF16, KVA_BF16, 0, 0, 0, KVA_BF16, MASK_WINDOW, 9, 20.0f, 1, 1, 0}, 5},
};

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
  case 1: { /* fewer columns, or none (the columns and the row stride decide which device entries are read) */
    c->dev_values = 1;
    const int64_t vals[] = {0, -1, mb - 1, att_absurd()};
    c->t.max_blocks = vals[att_pick(4)];
    break;
  }
  case 2: { /* row stride: never past the table's rows */
    c->dev_values = 1;
    const int64_t vals[] = {-1, -mb, 1, mb - 1, 0};
    c->t.row_stride = vals[att_pick(5)];
    break;
  }
  case 3: { /* a block id: out of the pool, or another block's */
    c->dev_values = 1;
    const int64_t vals[] = {-1, nblk, INT32_MAX, INT32_MIN, att_pick((int)nblk)};
    c->blocks[b * mb + att_pick((int)mb)] = (int32_t)vals[att_pick(5)];
    break;
  }
  case 4: { /* a length */
    c->dev_values = 1;
    const int64_t cap = mb * bs - c->fo[b];
    const int64_t vals[] = {INT32_MIN, -1, 0, 1, L - 1, L, cap, cap + 1, INT32_MAX};
    c->tlens[b] = (int32_t)vals[att_pick(9)];
    break;
  }
  case 5: { /* a first offset */
    c->dev_values = 1;
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
void mut_call_mutate(mut_call *c, const mut_base *m) {
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
    c->dev_values = 1;
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
void mut_call_diff(const mut_call *c, const mut_base *m) {
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
  if (p->flags != d->params.flags) fprintf(stderr, "    flags -> 0x%x\n", p->flags);
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

static int64_t mut_elems(const kva_tensor *t) {
  int64_t n = 1;
  for (int d = 0; d < 4; ++d) n *= t->shape[d];
  return n;
}

/* The base call's descriptors into c (fresh copies of the table arrays). */
void mut_call_reset(mut_call *c, const mut_base *m) {
  const int B = m->d.c.B;
  c->dev_values = 0;
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

int mut_base_make(mut_base *m, const att_case *ac, int64_t bs) {
  memset(m, 0, sizeof *m);
  if (att_make(&m->d, ac)) { FAIL_("att_make"); return -1; }
  m->view = &m->d.view;
  if (bs > 0) {
    /* unused pool rows finite (0x3c bytes: ~0.01 in bf16 and f32, ~1 in f16):
     * a valid mutation (another block id, another first offset) reads them,
     * and a NaN there would reach rows that do not see it on the AMX kernel
     * (README, Semantics), where the oracle skips it */
    if (att_table_make(&m->tb, &m->d, bs, 0x3c)) { att_free(&m->d); FAIL_("att_table_make"); return -1; }
    m->table = 1;
    m->view = &m->tb.view;
  }
  return 0;
}

void mut_base_free(mut_base *m) {
  if (m->table) att_table_free(&m->tb);
  att_free(&m->d);
}

int mut_call_alloc(mut_call *c, const mut_base *m) {
  const int B = m->d.c.B;
  memset(c, 0, sizeof *c);
  c->lens = (int32_t *)malloc(sizeof(int32_t) * (size_t)B);
  c->tlens = (int32_t *)malloc(sizeof(int32_t) * (size_t)B);
  c->fo = (int32_t *)malloc(sizeof(int32_t) * (size_t)B);
  c->blocks = (int32_t *)malloc(sizeof(int32_t) * (size_t)(B * (m->table ? m->tb.t.max_blocks : 1)));
  return c->lens && c->tlens && c->fo && c->blocks ? 0 : -1;
}

void mut_call_free(mut_call *c) {
  free(c->lens);
  free(c->tlens);
  free(c->fo);
  free(c->blocks);
  memset(c, 0, sizeof *c);
}

int mut_check_accepted(kva_context *ctx, const mut_call *c, const mut_base *m, double atol, int lenient, int it,
                       int *compared) {
  const att_data *d = &m->d;
  if (c->out.ndim != 4 || mut_elems(&c->out) > mut_elems(&d->out)) {
    FAIL_("iteration %d: accepted a larger output", it);
    return -1;
  }
  kva_tensor ref = kva_tensor_4d(NULL, c->out.dtype, c->out.shape[0], c->out.shape[1], c->out.shape[2], c->out.shape[3]);
  ref.data = malloc((size_t)mut_elems(&c->out) * kva_dtype_size(c->out.dtype));
  if (!ref.data) { FAIL_("iteration %d: out of memory", it); return -1; }
  int rc = 0;
  kva_ref_rounding rr = {0, KVA_F32, KVA_F32, KVA_F32};
  char kname[256];
  if (ctx && kva_attention_kernel(ctx, &c->q, &c->view, &c->p, &c->out, kname, sizeof kname) >= 0)
    att_name_rounding(kname, &rr);
  const int rrc = kva_reference_attention_rounded(&c->q, &c->view, &c->p, &ref, NULL, 0, &rr);
  /* |scale| >= 1e20 makes the softmax an argmax over the keys (under a
   * softcap over cap * sign(q.k)): dots within the kernel's rounding of
   * each other (or of zero) swap the winners, so the output is not a
   * continuous function of the roundings and no tolerance bounds its
   * values; such calls are held to the oracle's NaN / Inf pattern only */
  const int argmax = fabsf(c->p.scale) >= 1e20f;
  const int compare = rrc == 0 && strides_kept(c, m);
  *compared += compare;
  if (rrc < 0 && !lenient) {
    FAIL_("iteration %d: kva_attention accepted what the oracle refuses (%d: %s); the mutations:", it, rrc,
          kva_last_error());
    mut_call_diff(c, m);
    rc = -1;
  } else if (compare) {
    double max_err, rel_l2;
    if (!att_compare(&c->out, &ref, argmax ? INFINITY : atol, att_rtol(c->out.dtype), &max_err, &rel_l2)) {
      FAIL_("iteration %d: accepted call differs from the oracle (max err %.3g); the mutations:", it, max_err);
      mut_call_diff(c, m);
      rc = -1;
    }
  }
  free(ref.data);
  return rc;
}
