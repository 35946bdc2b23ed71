/* Context parallelism: a sequence batch's KV sharded over R ranks. Each rank
 * attends its shard for all heads (kva_attention_lse) straight into its send
 * buffer; the partials travel to their owners (all-to-all by head owner, or
 * all-gather); each rank merges the R parts it receives (kva_merge_states
 * over strided views of its receive buffer). The transport is the caller's
 * (simulated ranks, custom) or NCCL (kva_cp_attention, when built with it).
 * Buffers (f32, byte offsets in the plan):
 *   send: o [H, B, L, Dv] at 0, lse [H, B, L] at send_lse_offset: head h
 *     of chunk c = h / heads, so chunk c (the part for rank c, or the one
 *     all-gather chunk) is one contiguous range of each region;
 *   recv: o [R, heads, B, L, Dv] at 0, lse [R, heads, B, L] at
 *     recv_lse_offset: chunk s from rank s.
 * Traffic per rank: (R - 1) chunks of heads B L (Dv + 1) floats each way
 * (all-to-all), or R - 1 chunks of H B L (Dv + 1) received (all-gather). */
#include "api/attention.h"
#include "core/backend.h"
#include "core/internal.h"

#include <math.h>
#include <string.h>

#define CP_ALIGN 256

static size_t cp_up(size_t x) { return (x + CP_ALIGN - 1) / CP_ALIGN * CP_ALIGN; }

int kva_cp_plan_init(kva_cp_plan *plan, int64_t ranks, int64_t rank, int by_head, int64_t B, int64_t H, int64_t L,
                     int64_t Dv, unsigned lse_flags) {
  kva_clearerr();
  if (!plan) return kva_seterr(KVA_EINVAL, "plan is NULL");
  if (ranks < 1 || ranks > KVA_MERGE_MAX_PARTS)
    return kva_seterr(KVA_EINVAL, "ranks = %lld (allowed: 1 .. KVA_MERGE_MAX_PARTS = %d)", (long long)ranks,
                      KVA_MERGE_MAX_PARTS);
  if (rank < 0 || rank >= ranks)
    return kva_seterr(KVA_EINVAL, "rank = %lld must be in [0, ranks = %lld)", (long long)rank, (long long)ranks);
  if (by_head != 0 && by_head != 1) return kva_seterr(KVA_EINVAL, "by_head = %d must be 0 or 1", by_head);
  if (B < 1 || H < 1 || L < 1 || Dv < 1)
    return kva_seterr(KVA_ESHAPE, "B, H, L, Dv = %lld, %lld, %lld, %lld must be >= 1", (long long)B, (long long)H,
                      (long long)L, (long long)Dv);
  if (by_head && H % ranks)
    return kva_seterr(KVA_ESHAPE, "by_head: H = %lld heads must be a multiple of ranks = %lld", (long long)H,
                      (long long)ranks);
  if (lse_flags & ~KVA_LSE_BASE2) return kva_seterr(KVA_EINVAL, "lse_flags = 0x%x (allowed: KVA_LSE_BASE2)", lse_flags);
  bool ok = true;
  const int64_t rows = kva_mul_chk(kva_mul_chk(B, H, &ok), L, &ok), o_elems = kva_mul_chk(rows, Dv, &ok);
  if (!ok || o_elems > ((int64_t)1 << 40) / ranks)
    return kva_seterr(KVA_ESHAPE, "cp: buffers of %lld ranks x B H L Dv exceed 2^42 bytes", (long long)ranks);
  memset(plan, 0, sizeof *plan);
  plan->ranks = ranks, plan->rank = rank, plan->by_head = by_head;
  plan->B = B, plan->H = H, plan->L = L, plan->Dv = Dv;
  plan->heads = by_head ? H / ranks : H;
  plan->lse_flags = lse_flags;
  plan->o_bytes = (size_t)(plan->heads * B * L * Dv) * 4;
  plan->lse_bytes = (size_t)(plan->heads * B * L) * 4;
  plan->send_lse_offset = cp_up((size_t)o_elems * 4);
  plan->send_bytes = plan->send_lse_offset + (size_t)rows * 4;
  plan->recv_lse_offset = cp_up((size_t)ranks * plan->o_bytes);
  plan->recv_bytes = plan->recv_lse_offset + (size_t)ranks * plan->lse_bytes;
  return 0;
}

/* The send buffer's regions as this rank's out [B, H, L, Dv] and lse [B, H, L]. */
static void send_views(const kva_cp_plan *p, void *send, kva_tensor *o, kva_tensor *l) {
  memset(o, 0, sizeof *o);
  memset(l, 0, sizeof *l);
  o->data = send, o->dtype = KVA_F32, o->ndim = 4;
  o->shape[0] = p->B, o->shape[1] = p->H, o->shape[2] = p->L, o->shape[3] = p->Dv;
  o->stride[0] = p->L * p->Dv * 4, o->stride[1] = p->B * p->L * p->Dv * 4, o->stride[2] = p->Dv * 4, o->stride[3] = 4;
  l->data = (char *)send + p->send_lse_offset, l->dtype = KVA_F32, l->ndim = 3;
  l->shape[0] = p->B, l->shape[1] = p->H, l->shape[2] = p->L;
  l->stride[0] = p->L * 4, l->stride[1] = p->B * p->L * 4, l->stride[2] = 4;
}

static int check_plan(const kva_cp_plan *p) {
  if (!p) return kva_seterr(KVA_EINVAL, "plan is NULL");
  if (p->ranks < 1 || p->rank < 0 || p->rank >= p->ranks || p->heads < 1 || p->B < 1 || p->L < 1 || p->Dv < 1)
    return kva_seterr(KVA_EINVAL, "plan is not initialized (kva_cp_plan_init)");
  return 0;
}

int kva_cp_attend(kva_context *ctx, const kva_cp_plan *plan, const kva_tensor *q, const kva_kv_view *kv,
                  const kva_attn_params *params, void *send, size_t send_bytes, void *workspace,
                  size_t workspace_bytes) {
  kva_clearerr();
  if (!ctx) return kva_seterr(KVA_EINVAL, "ctx is NULL");
  int rc = check_plan(plan);
  if (rc) return rc;
  if (!send) return kva_seterr(KVA_EINVAL, "send is NULL");
  if (send_bytes < plan->send_bytes)
    return kva_seterr(KVA_EWORKSPACE, "send_bytes = %zu < plan->send_bytes = %zu", send_bytes, plan->send_bytes);
  if ((rc = kva_check_tensor(q, "q", KVA_DT_FLOAT, 4, false))) return rc;
  const int64_t want[3] = {plan->B, plan->H, plan->L};
  for (int d = 0; d < 3; ++d)
    if (q->shape[d] != want[d])
      return kva_seterr(KVA_ESHAPE, "q.shape[%d] = %lld, expected %lld (the plan's [B, H, L])", d,
                        (long long)q->shape[d], (long long)want[d]);
  kva_tensor o, l;
  send_views(plan, send, &o, &l);
  if (kva_tensors_overlap(&o, q)) return kva_seterr(KVA_EINVAL, "send overlaps q");
  if (!kv) { /* no key on this rank: out 0, lse -inf */
    if (ctx->backend == KVA_BACKEND_CUDA) return kva_cuda_cp_fill_empty(ctx, send, plan->send_lse_offset,
                                                                        (size_t)(plan->B * plan->H * plan->L));
    memset(send, 0, plan->send_lse_offset);
    float *z = (float *)((char *)send + plan->send_lse_offset);
    for (int64_t i = 0; i < plan->B * plan->H * plan->L; ++i) z[i] = -INFINITY;
    return 0;
  }
  return kva_attention_lse(ctx, q, kv, params, &o, &l, plan->lse_flags, workspace, workspace_bytes);
}

int kva_cp_merge(kva_context *ctx, const kva_cp_plan *plan, const void *recv, size_t recv_bytes, kva_tensor *out,
                 kva_tensor *lse) {
  kva_clearerr();
  if (!ctx) return kva_seterr(KVA_EINVAL, "ctx is NULL");
  int rc = check_plan(plan);
  if (rc) return rc;
  if (!recv) return kva_seterr(KVA_EINVAL, "recv is NULL");
  if (recv_bytes < plan->recv_bytes)
    return kva_seterr(KVA_EWORKSPACE, "recv_bytes = %zu < plan->recv_bytes = %zu", recv_bytes, plan->recv_bytes);
  kva_tensor po[KVA_MERGE_MAX_PARTS], pl[KVA_MERGE_MAX_PARTS];
  const int64_t B = plan->B, Hc = plan->heads, L = plan->L, Dv = plan->Dv;
  for (int64_t s = 0; s < plan->ranks; ++s) { /* chunk s: o [heads, B, L, Dv] and lse [heads, B, L] seen as [B, heads, L, ...] */
    memset(&po[s], 0, sizeof po[s]);
    memset(&pl[s], 0, sizeof pl[s]);
    po[s].data = (char *)recv + (size_t)s * plan->o_bytes, po[s].dtype = KVA_F32, po[s].ndim = 4;
    po[s].shape[0] = B, po[s].shape[1] = Hc, po[s].shape[2] = L, po[s].shape[3] = Dv;
    po[s].stride[0] = L * Dv * 4, po[s].stride[1] = B * L * Dv * 4, po[s].stride[2] = Dv * 4, po[s].stride[3] = 4;
    pl[s].data = (char *)recv + plan->recv_lse_offset + (size_t)s * plan->lse_bytes, pl[s].dtype = KVA_F32;
    pl[s].ndim = 3;
    pl[s].shape[0] = B, pl[s].shape[1] = Hc, pl[s].shape[2] = L;
    pl[s].stride[0] = L * 4, pl[s].stride[1] = B * L * 4, pl[s].stride[2] = 4;
  }
  return kva_merge_states(ctx, plan->ranks, po, pl, out, lse, plan->lse_flags);
}
