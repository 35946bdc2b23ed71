/* Randomized bad input to kva_attention (CPU): valid calls broken by one to
 * three random mutations of their descriptors (ranks, dtypes, shapes,
 * strides, pointers, bits, group sizes, layouts, lengths, scale, softcap,
 * mask fields). Each mutated call must either fail with a negative code and
 * a message, leaving the output and its sentinel untouched, or succeed and
 * agree with the oracle (kva_reference_attention) on the same descriptors;
 * the oracle must accept exactly what the fast path accepts. Run under ASan
 * and UBSan by `make test`, so an out-of-bounds read or an overflowing size
 * computation in validation fails here too.
 *
 * A mutation never makes a view larger than its buffer by accident: shapes
 * only shrink or become absurd (a distinct huge value per mutation, so two
 * mutations never agree by chance), strides only become invalid (negative,
 * zero, overlapping, misaligned innermost) or span 2^62 bytes and more
 * (refused: KVA_MAX_SPAN); what is left valid therefore stays inside the
 * buffers att_make allocated. */
#include "attn_check.h"

#include <stdint.h>

enum { MUT_ITERS = 2500, MUT_ITERS_QUICK = 400 };

/* A distinct absurd value: 2^40 and up, or near INT64_MAX. */
static int64_t absurd(void) {
  const uint64_t r = test_rand_u64();
  return r & 1 ? ((int64_t)1 << 40) + (int64_t)(r >> 24) : INT64_MAX - (int64_t)(r >> 40);
}
static int pick(int n) { return (int)(test_rand_u64() % (uint64_t)n); }

static void mutate_tensor(kva_tensor *t) {
  const int nd = t->ndim >= 1 && t->ndim <= KVA_MAX_DIMS ? t->ndim : 1;
  const int d = pick(nd);
  switch (pick(7)) {
  case 0: { /* rank */
    static const int ranks[] = {-1, 0, 1, 2, 3, 5, 100};
    t->ndim = ranks[pick(7)];
    break;
  }
  case 1: { /* dtype, valid or not */
    static const int dts[] = {-1, 0, 1, 2, 3, 4, 5, 6, 1000};
    t->dtype = (kva_dtype)dts[pick(9)];
    break;
  }
  case 2: /* shape: shrink */
    if (t->shape[d] > 1) t->shape[d] -= 1 + pick((int)(t->shape[d] - 1 < 8 ? t->shape[d] - 1 : 8));
    break;
  case 3: { /* shape: zero, negative, absurd */
    const int k = pick(3);
    t->shape[d] = k == 0 ? 0 : k == 1 ? -1 - pick(100) : absurd();
    break;
  }
  case 4: { /* stride: negative, zero, overlapping, one byte off */
    const int64_t s = t->stride[d];
    const int k = pick(4);
    /* (halving only a real stride: half of an absurd one would be a valid
     * view far outside the buffer) */
    const int64_t es = (int64_t)kva_dtype_size(t->dtype);
    t->stride[d] = k == 0   ? -s - 1
                   : k == 1 ? 0
                   : k == 2 ? (s > 1 && s < ((int64_t)1 << 40) ? s / 2 : 0)
                            : s + (pick(2) && es > 1 ? 1 : -1); /* one byte more only where it misaligns */
    break;
  }
  case 5: /* stride: a span of 2^62 bytes or more (when shape[d] > 1; else unused) */
    t->stride[d] = ((int64_t)1 << 62) + (int64_t)(test_rand_u64() >> 24);
    break;
  default: /* pointer */
    t->data = NULL;
    break;
  }
}

static void mutate_kv(kva_kv *kv) {
  switch (pick(5)) {
  case 0: mutate_tensor(&kv->data); break;
  case 1: mutate_tensor(&kv->scales); break;
  case 2: mutate_tensor(&kv->biases); break;
  case 3: {
    static const int bits[] = {-1, 0, 1, 2, 3, 4, 8, 16, 32};
    kv->bits = bits[pick(9)];
    break;
  }
  default: {
    static const int groups[] = {-64, 0, 1, 16, 32, 48, 64, 128, 256, 1 << 30};
    kv->group_size = groups[pick(10)];
    break;
  }
  }
}

/* One mutation somewhere in the call; lens: a writable copy of the lengths. */
static void mutate_call(kva_tensor *q, kva_tensor *out, kva_kv_view *view, kva_attn_params *p, int32_t *lens,
                        int B, int64_t N, int L) {
  static const float scales[] = {NAN, INFINITY, -INFINITY, 0.0f, -1.0f, 1e30f, 1e-30f};
  static const float caps[] = {NAN, INFINITY, -INFINITY, -1.0f, 0.0f, 1e-30f, 50.0f};
  static const int32_t windows[] = {INT32_MIN, -1, 0, 1, 5, INT32_MAX};
  switch (pick(12)) {
  case 0: mutate_tensor(q); break;
  case 1: mutate_tensor(out); break;
  case 2: mutate_kv(&view->k); break;
  case 3: mutate_kv(&view->v); break;
  case 4: { /* layout without its view or table */
    static const int layouts[] = {-1, KVA_LAYOUT_PAGED, KVA_LAYOUT_BLOCK_TABLE, 3};
    view->layout = (kva_layout)layouts[pick(4)];
    break;
  }
  case 5: { /* a length */
    const int64_t vals[] = {INT32_MIN, -1, 0, 1, L - 1, L, N - 1, N, N + 1, INT32_MAX};
    view->seq_lens = lens;
    lens[pick(B)] = (int32_t)vals[pick(10)];
    break;
  }
  case 6: p->scale = scales[pick(7)]; break;
  case 7: p->softcap = caps[pick(7)]; break;
  case 8: {
    static const int kinds[] = {-1, KVA_MASK_NONE, KVA_MASK_CAUSAL, KVA_MASK_ARRAY, 3, 99};
    p->mask.kind = (kva_mask_kind)kinds[pick(6)];
    break;
  }
  case 9: p->mask.window = windows[pick(6)]; break;
  case 10:
    if (p->mask.segments.data) mutate_tensor(&p->mask.segments);
    else if (p->mask.array.data) mutate_tensor(&p->mask.array);
    else p->sinks = NULL;
    break;
  default: p->mask.segments_clamp = pick(2); break;
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
static void call_diff(const att_data *d, const kva_tensor *q, const kva_tensor *out, const kva_kv_view *v,
                      const kva_attn_params *p, const int32_t *lens) {
  tensor_diff("q", q, &d->q);
  tensor_diff("out", out, &d->out);
  kv_diff("k", &v->k, &d->view.k);
  kv_diff("v", &v->v, &d->view.v);
  if (v->layout != d->view.layout) fprintf(stderr, "    layout %d -> %d\n", (int)d->view.layout, (int)v->layout);
  for (int b = 0; b < d->c.B; ++b)
    if (v->seq_lens && (!d->lens || lens[b] != d->lens[b])) fprintf(stderr, "    len[%d] -> %d\n", b, (int)lens[b]);
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
static int strides_kept(const att_data *d, const kva_tensor *q, const kva_kv_view *v, const kva_attn_params *p) {
  return same_strides(q, &d->q) && same_strides(&v->k.data, &d->view.k.data) &&
         same_strides(&v->k.scales, &d->view.k.scales) && same_strides(&v->k.biases, &d->view.k.biases) &&
         same_strides(&v->v.data, &d->view.v.data) && same_strides(&v->v.scales, &d->view.v.scales) &&
         same_strides(&v->v.biases, &d->view.v.biases) && same_strides(&p->mask.segments, &d->params.mask.segments) &&
         same_strides(&p->mask.array, &d->params.mask.array);
}

static int64_t elems(const kva_tensor *t) {
  int64_t n = 1;
  for (int d = 0; d < 4; ++d) n *= t->shape[d];
  return n;
}

/* Runs the mutated calls of one base case; returns 0 when all held. */
static int run_mutations(const att_case *ac, int iters, int *accepted, int *compared) {
  att_data d;
  if (att_make(&d, ac)) { FAIL_("att_make"); return -1; }
  kva_context *ctx = NULL;
  if (kva_context_create(&ctx, NULL)) { att_free(&d); FAIL_("context"); return -1; }
  unsigned char *snap = (unsigned char *)malloc(d.out_bytes);
  int32_t *lens = (int32_t *)malloc(sizeof(int32_t) * (size_t)ac->B);
  int rc_all = snap && lens ? 0 : -1;
  for (int it = 0; it < iters && rc_all == 0; ++it) {
    att_poison(&d);
    memcpy(snap, d.out_buf, d.out_bytes);
    kva_tensor q = d.q, out = d.out;
    kva_kv_view view = d.view;
    kva_attn_params p = d.params;
    for (int b = 0; b < ac->B; ++b) lens[b] = d.lens ? d.lens[b] : (int32_t)ac->N;
    const int nm = 1 + pick(3);
    for (int m = 0; m < nm; ++m) mutate_call(&q, &out, &view, &p, lens, ac->B, ac->N, ac->L);
    if (getenv("KVA_MUT_TRACE")) { /* a crash's last mutations, for whoever debugs one */
      fprintf(stderr, "iteration %d:\n", it);
      call_diff(&d, &q, &out, &view, &p, lens);
    }
    const int rc = kva_attention(ctx, &q, &view, &p, &out, NULL, 0);
    if (rc < 0) {
      if (!kva_last_error()[0]) { FAIL_("iteration %d: code %d without a message", it, rc); rc_all = -1; }
      if (memcmp(snap, d.out_buf, d.out_bytes) != 0 || !att_sentinel_ok(&d)) {
        FAIL_("iteration %d: output modified on error %d (%s); the mutations:", it, rc, kva_last_error());
        call_diff(&d, &q, &out, &view, &p, lens);
        rc_all = -1;
      }
      continue;
    }
    ++*accepted;
    if (!att_sentinel_ok(&d)) { FAIL_("iteration %d: sentinel overwritten", it); rc_all = -1; break; }
    /* accepted: the oracle must accept the same descriptors and agree */
    if (out.ndim != 4 || elems(&out) > elems(&d.out)) { FAIL_("iteration %d: accepted a larger output", it); rc_all = -1; break; }
    kva_tensor ref = kva_tensor_4d(NULL, out.dtype, out.shape[0], out.shape[1], out.shape[2], out.shape[3]);
    ref.data = malloc((size_t)elems(&out) * kva_dtype_size(out.dtype));
    if (!ref.data) { rc_all = -1; break; }
    const int rrc = kva_reference_attention(&q, &view, &p, &ref);
    const int compare = strides_kept(&d, &q, &view, &p);
    *compared += compare;
    if (rrc < 0) {
      FAIL_("iteration %d: kva_attention accepted what the oracle refuses (%d: %s); the mutations:", it, rrc,
            kva_last_error());
      call_diff(&d, &q, &out, &view, &p, lens);
      rc_all = -1;
    } else if (compare) {
      double max_err, rel_l2;
      if (!att_compare(&out, &ref, att_case_atol(ac), att_rtol(out.dtype), &max_err, &rel_l2)) {
        FAIL_("iteration %d: accepted call differs from the oracle (max err %.3g); the mutations:", it, max_err);
        call_diff(&d, &q, &out, &view, &p, lens);
        rc_all = -1;
      }
    }
    free(ref.data);
  }
  free(lens);
  free(snap);
  kva_context_destroy(ctx);
  att_free(&d);
  return rc_all;
}

TEST(errors_random_mutations) {
  /* q4 with bf16 scales (ragged, strided views), bf16 rows with a window and
   * sinks, q8 with f16 scales and segments, f16 rows with a bool mask array */
  static const att_case cases[] = {
      {2, 8, 4, 2, 64, 128, 128, KVA_F32, KVA_F32, 4, 4, 64, KVA_BF16, MASK_CAUSAL, 0, 0, 0, 1, 1},
      {2, 4, 2, 3, 50, 64, 64, KVA_BF16, KVA_BF16, 0, 0, 0, KVA_BF16, MASK_WINDOW, 9, 20.0f, 1, 1, 0},
      {1, 6, 2, 2, 40, 64, 64, KVA_BF16, KVA_F32, 8, 8, 32, KVA_F16, MASK_SEG, 0, 0, 0, 0, 1},
      {2, 4, 4, 2, 30, 64, 64, KVA_F32, KVA_F16, 0, 0, 0, KVA_F16, MASK_BOOL, 0, 0, 0, 1, 0},
  };
  const int iters = test_quick ? MUT_ITERS_QUICK : MUT_ITERS;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
    int accepted = 0, compared = 0;
    if (run_mutations(&cases[i], iters, &accepted, &compared) < 0) {
      char s[256];
      att_case_str(&cases[i], s, sizeof s);
      FAIL_("case %s", s);
      return;
    }
    /* some mutations (a shrink, a valid dtype, scale 1e30, no mask) leave a
     * valid call with the base strides: the comparison ran too */
    fprintf(stderr, "  case %zu: %d mutated calls, %d accepted, %d of them compared with the oracle\n", i, iters,
            accepted, compared);
    if (compared == 0) { FAIL_("case %zu: no mutated call was accepted and compared (%d accepted)", i, accepted); return; }
  }
}
