/* kva_cascade_attention: shared-prefix attention composed of the library's
 * own calls, inside the context's lock, on slices of one workspace:
 *   prefix pass: q's B L rows of each head stacked as one sequence ([1, H,
 *     B L, Dk], a view: q->stride[0] == L q->stride[2]), no mask (the prefix
 *     is visible to every row), the sinks; chunks of CASCADE_MAX_ROWS rows
 *     (one pass over the prefix each): o1 [H, B L, Dv] f32, lse1 [H, B L];
 *   suffix pass: q over the suffix view, the caller's mask, no sinks: o2
 *     [B, H, L, Dv] f32, lse2 [B, H, L];
 *   merge: (o1 seen as [B, H, L, Dv], lse1) and (o2, lse2) into out, lse.
 * Workspace: o1, lse1, o2, lse2, then the larger of the two passes' own. */
#include "api/attention.h"
#include "core/backend.h"
#include "core/internal.h"
#include "paged/paged.h"

#include <string.h>

#define CASCADE_ALIGN 256
#define CASCADE_MAX_ROWS 256 /* stacked rows per prefix call (its partial states grow with them) */

typedef struct cascade {
  kva_tensor qc;          /* q's rows as one sequence: [1, H, B L, Dk] */
  kva_attn_params pp, ps; /* prefix: no mask, the sinks; suffix: the mask, no sinks */
  int64_t B, H, L, Dv, rows, chunk;
  size_t o1, l1, o2, l2, inner, inner_bytes, total; /* byte offsets and sizes in the workspace */
} cascade;

static size_t cascade_up(size_t x) { return (x + CASCADE_ALIGN - 1) / CASCADE_ALIGN * CASCADE_ALIGN; }

/* The stacked query rows r0 .. r0 + n - 1. */
static kva_tensor cascade_rows(const cascade *c, int64_t r0, int64_t n) {
  kva_tensor t = c->qc;
  t.data = (char *)t.data + r0 * t.stride[2];
  t.shape[2] = n;
  return t;
}

/* A contiguous f32 [1, H, rows, X] (X = Dv) or [1, H, rows] (X = 0) slice
 * of the workspace at base, rows r0 .. r0 + n - 1. */
static kva_tensor cascade_part(char *base, const cascade *c, int64_t X, int64_t r0, int64_t n) {
  const int64_t x = X ? X : 1;
  kva_tensor t;
  memset(&t, 0, sizeof t);
  t.data = base + (size_t)(r0 * x) * sizeof(float);
  t.dtype = KVA_F32;
  t.ndim = X ? 4 : 3;
  t.shape[0] = 1, t.shape[1] = c->H, t.shape[2] = n;
  t.stride[0] = c->H * c->rows * x * 4, t.stride[1] = c->rows * x * 4, t.stride[2] = x * 4;
  if (X) t.shape[3] = X, t.stride[3] = 4;
  return t;
}

static int cascade_plan(kva_context *ctx, const kva_tensor *q, const kva_kv_view *prefix, const kva_kv_view *suffix,
                        const kva_attn_params *params, const kva_tensor *out, cascade *c) {
  memset(c, 0, sizeof *c);
  if (!ctx) return kva_seterr(KVA_EINVAL, "ctx is NULL");
  if (!q) return kva_seterr(KVA_EINVAL, "q is NULL");
  if (!prefix) return kva_seterr(KVA_EINVAL, "prefix is NULL");
  if (!suffix) return kva_seterr(KVA_EINVAL, "suffix is NULL");
  const kva_attn_params defaults = kva_attn_defaults();
  if (!params) params = &defaults;
  int rc = kva_check_tensor(q, "q", KVA_DT_FLOAT, 4, false);
  if (rc) return rc;
  const kva_mask *m = &params->mask;
  if (m->kind != KVA_MASK_NONE && m->kind != KVA_MASK_CAUSAL)
    return kva_seterr(KVA_EUNSUPPORTED, "cascade: params->mask.kind = %d: none or causal only (the prefix is "
                      "visible to every row)", (int)m->kind);
  if (m->kind == KVA_MASK_CAUSAL && (m->window != 0 || m->segments.data))
    return kva_seterr(KVA_EUNSUPPORTED, "cascade: params->mask: no window or segments (the prefix is visible to "
                      "every row)");
  c->B = q->shape[0], c->H = q->shape[1], c->L = q->shape[2];
  if (c->B > 1 && c->L > 1 && q->stride[0] != c->L * q->stride[2])
    return kva_seterr(KVA_ESTRIDE, "cascade: q->stride[0] = %lld must be L * q->stride[2] = %lld (the rows of "
                      "consecutive sequences evenly spaced, e.g. q stored [B, L, H, Dk]) to be read as one sequence",
                      (long long)q->stride[0], (long long)(c->L * q->stride[2]));
  bool ok = true;
  c->rows = kva_mul_chk(c->B, c->L, &ok);
  if (!ok) return kva_seterr(KVA_ESHAPE, "cascade: B * L overflows");
  c->qc = *q;
  c->qc.shape[0] = 1;
  c->qc.shape[2] = c->rows;
  if (c->L == 1) c->qc.stride[2] = q->stride[0]; /* one row per sequence: the rows are q's batch entries */
  c->pp = *params;
  memset(&c->pp.mask, 0, sizeof c->pp.mask);
  c->pp.mask.kind = KVA_MASK_NONE;
  c->ps = *params;
  c->ps.sinks = NULL;

  /* the suffix pass: the caller's call shape (also checks out when given);
   * its lengths s_b >= L (kva_problem_init), so every row sees the whole prefix */
  kva_problem ps;
  if ((rc = kva_problem_init(&ps, ctx->backend, q, suffix, &c->ps, out)) < 0) return rc;
  c->Dv = ps.Dv;
  /* the prefix pass: one row first (the prefix's capacity N bounds a chunk), then the chunk shape */
  kva_problem pp;
  kva_tensor q1 = cascade_rows(c, 0, 1);
  if ((rc = kva_problem_init(&pp, ctx->backend, &q1, prefix, &c->pp, NULL)) < 0) return rc;
  if (pp.Dv != c->Dv)
    return kva_seterr(KVA_ESHAPE, "cascade: prefix head dim Dv = %lld differs from the suffix's %lld",
                      (long long)pp.Dv, (long long)c->Dv);
  /* a chunk of rows is at most the prefix's length (L <= len for every call):
   * its capacity N, or on the CPU its length (host memory, checked by
   * kva_problem_init above) */
  int64_t plen = pp.N;
  if (ctx->backend == KVA_BACKEND_CPU) {
    if (prefix->layout == KVA_LAYOUT_CONTIGUOUS && prefix->seq_lens) plen = prefix->seq_lens[0];
    else if (prefix->layout == KVA_LAYOUT_PAGED) plen = kva_paged_view_len(prefix, 0);
    else if (prefix->layout == KVA_LAYOUT_BLOCK_TABLE) plen = kva_block_table_len(prefix, 0);
  }
  c->chunk = c->rows < CASCADE_MAX_ROWS ? c->rows : CASCADE_MAX_ROWS;
  if (c->chunk > plen) c->chunk = plen;
  size_t wp = 0, ws = 0;
  kva_tensor qk = cascade_rows(c, 0, c->chunk);
  if ((rc = kva_attention_workspace_size(ctx, &qk, prefix, &c->pp, &wp)) < 0 ||
      (rc = kva_attention_workspace_size(ctx, q, suffix, &c->ps, &ws)) < 0)
    return rc;
  /* sizes: each part at most 2^48 bytes (the problems' own workspaces are bounded likewise) */
  int64_t o_elems = kva_mul_chk(kva_mul_chk(c->rows, c->H, &ok), c->Dv, &ok), l_elems = kva_mul_chk(c->rows, c->H, &ok);
  if (!ok || o_elems > ((int64_t)1 << 46) || l_elems > ((int64_t)1 << 46))
    return kva_seterr(KVA_ESHAPE, "cascade: partial states of B L H = %lld rows exceed the workspace limit",
                      (long long)l_elems);
  const size_t ob = cascade_up((size_t)o_elems * 4), lb = cascade_up((size_t)l_elems * 4);
  c->o1 = 0, c->l1 = ob, c->o2 = ob + lb, c->l2 = 2 * ob + lb, c->inner = 2 * (ob + lb);
  c->inner_bytes = wp > ws ? wp : ws;
  c->total = c->inner + c->inner_bytes;
  return 0;
}

int kva_cascade_workspace_size(kva_context *ctx, const kva_tensor *q, const kva_kv_view *prefix,
                               const kva_kv_view *suffix, const kva_attn_params *params, size_t *bytes) {
  kva_clearerr();
  if (!bytes) return kva_seterr(KVA_EINVAL, "bytes is NULL");
  *bytes = 0;
  cascade c;
  const int rc = cascade_plan(ctx, q, prefix, suffix, params, NULL, &c);
  if (rc < 0) return rc;
  *bytes = c.total;
  return 0;
}

/* The passes and the merge (ctx->mu held). */
static int cascade_run(kva_context *ctx, const cascade *c, const kva_tensor *q, const kva_kv_view *prefix,
                       const kva_kv_view *suffix, kva_tensor *out, kva_tensor *lse, unsigned lse_flags, char *w) {
  int rc = 0;
  for (int64_t r0 = 0; r0 < c->rows && rc >= 0; r0 += c->chunk) {
    const int64_t n = c->rows - r0 < c->chunk ? c->rows - r0 : c->chunk;
    kva_tensor qr = cascade_rows(c, r0, n), o1 = cascade_part(w + c->o1, c, c->Dv, r0, n),
               l1 = cascade_part(w + c->l1, c, 0, r0, n);
    rc = kva_attention_lse_unlocked(ctx, &qr, prefix, &c->pp, &o1, &l1, lse_flags, w + c->inner, c->inner_bytes);
  }
  if (rc < 0) return rc;
  kva_tensor o2 = kva_tensor_4d(w + c->o2, KVA_F32, c->B, c->H, c->L, c->Dv), l2 = o2;
  l2.data = w + c->l2;
  l2.ndim = 3;
  l2.shape[3] = 0;
  l2.stride[2] = 4, l2.stride[1] = c->L * 4, l2.stride[0] = c->H * c->L * 4, l2.stride[3] = 0;
  rc = kva_attention_lse_unlocked(ctx, q, suffix, &c->ps, &o2, &l2, lse_flags, w + c->inner, c->inner_bytes);
  if (rc < 0) return rc;
  /* o1 [H, B L, Dv] seen as [B, H, L, Dv] */
  kva_tensor po[2], pl[2];
  po[0] = cascade_part(w + c->o1, c, c->Dv, 0, c->rows);
  pl[0] = cascade_part(w + c->l1, c, 0, 0, c->rows);
  po[0].shape[0] = pl[0].shape[0] = c->B;
  po[0].shape[2] = pl[0].shape[2] = c->L;
  po[0].stride[0] = c->L * c->Dv * 4;
  pl[0].stride[0] = c->L * 4;
  po[1] = o2, pl[1] = l2;
  return kva_merge_states_unlocked(ctx, 2, po, pl, out, lse, lse_flags);
}

int kva_cascade_attention(kva_context *ctx, const kva_tensor *q, const kva_kv_view *prefix,
                          const kva_kv_view *suffix, const kva_attn_params *params, kva_tensor *out, kva_tensor *lse,
                          unsigned lse_flags, void *workspace, size_t workspace_bytes) {
  kva_clearerr();
  if (!out) return kva_seterr(KVA_EINVAL, "out is NULL");
  cascade c;
  int rc = cascade_plan(ctx, q, prefix, suffix, params, out, &c);
  if (rc < 0) return rc;
  /* out and lse against the prefix's arrays (the suffix's: kva_problem_init above; lse: the merge) */
  const kva_kv *kvs[2] = {&prefix->k, &prefix->v};
  for (int i = 0; i < 2; ++i) {
    const kva_tensor *ts[3] = {&kvs[i]->data, &kvs[i]->scales, &kvs[i]->biases};
    for (int j = 0; j < (kvs[i]->bits ? 3 : kva_kv_scaled(kvs[i]) ? 2 : 1); ++j)
      if (ts[j]->data && (kva_tensors_overlap(out, ts[j]) || (lse && kva_tensors_overlap(lse, ts[j]))))
        return kva_seterr(KVA_EINVAL, "out or lse overlaps the prefix's %s", i ? "V" : "K");
  }
  if (lse) {
    kva_problem pl;
    if ((rc = kva_problem_init(&pl, ctx->backend, q, suffix, &c.ps, out)) < 0 ||
        (rc = kva_problem_set_lse(&pl, lse, lse_flags)) < 0)
      return rc;
  } else if (lse_flags & ~KVA_LSE_BASE2) {
    return kva_seterr(KVA_EINVAL, "lse_flags = 0x%x (allowed: KVA_LSE_BASE2)", lse_flags);
  }
  if (workspace && workspace_bytes < c.total)
    return kva_seterr(KVA_EWORKSPACE, "workspace_bytes = %zu < %zu needed", workspace_bytes, c.total);
  pthread_mutex_lock(&ctx->mu);
  if (!workspace && (rc = kva_context_workspace(ctx, c.total)) >= 0) workspace = ctx->ws;
  if (rc >= 0) rc = cascade_run(ctx, &c, q, prefix, suffix, out, lse, lse_flags, (char *)workspace);
  pthread_mutex_unlock(&ctx->mu);
  return rc;
}
