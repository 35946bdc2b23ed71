/* kva_cp_attention: context parallelism over NCCL on the context's stream.
 *   attend: this rank's shard into send (kva_cp_attend);
 *   exchange: by head owner, one ncclSend / ncclRecv pair per peer and
 *     region (o, lse) in one group (the part for rank d at d * o_bytes; the
 *     part from rank s lands at s * o_bytes of recv); all-gather, one
 *     ncclAllGather per region (send's one part, recv's R parts in rank
 *     order); the own part goes through NCCL too (self send / recv);
 *   merge: the R parts into out (kva_cp_merge).
 * Everything is stream-ordered on ctx's stream: no host synchronization, no
 * allocation (caller buffers and workspace), so a CUDA graph can capture it.
 * Built when NCCL is found (KVA_HAVE_NCCL, Makefile); else KVA_EUNSUPPORTED. */
#include "core/backend.h"
#include "core/internal.h"

#ifdef KVA_HAVE_NCCL
#include <nccl.h>

static int nccl_err(ncclResult_t r, const char *what) {
  return kva_seterr(KVA_ECUDA, "cp: %s: %s", what, ncclGetErrorString(r));
}
#endif

int kva_cp_attention(kva_context *ctx, void *comm, const kva_cp_plan *plan, const kva_tensor *q,
                     const kva_kv_view *kv, const kva_attn_params *params, kva_tensor *out, kva_tensor *lse,
                     void *send, void *recv, void *workspace, size_t workspace_bytes) {
  kva_clearerr();
  if (!ctx) return kva_seterr(KVA_EINVAL, "ctx is NULL");
#ifndef KVA_HAVE_NCCL
  (void)comm, (void)plan, (void)q, (void)kv, (void)params, (void)out, (void)lse, (void)send, (void)recv;
  (void)workspace, (void)workspace_bytes;
  return kva_seterr(KVA_EUNSUPPORTED, "kva_cp_attention: this build of kvattn has no NCCL (nccl.h was not found "
                    "at build time; NCCL_HOME names it)");
#else
  if (ctx->backend != KVA_BACKEND_CUDA) return kva_seterr(KVA_EINVAL, "ctx: kva_cp_attention needs a CUDA context");
  if (!comm) return kva_seterr(KVA_EINVAL, "comm (an ncclComm_t) is NULL");
  if (!plan) return kva_seterr(KVA_EINVAL, "plan is NULL");
  if (!send || !recv) return kva_seterr(KVA_EINVAL, "send and recv (device buffers of the plan's sizes) are required");
  if (!out) return kva_seterr(KVA_EINVAL, "out is NULL");
  ncclComm_t c = (ncclComm_t)comm;
  int n = 0, me = -1;
  ncclResult_t r = ncclCommCount(c, &n);
  if (r == ncclSuccess) r = ncclCommUserRank(c, &me);
  if (r != ncclSuccess) return nccl_err(r, "comm");
  if (n != plan->ranks || me != plan->rank)
    return kva_seterr(KVA_EINVAL, "comm has %d ranks and this is rank %d; plan says %lld and %lld", n, me,
                      (long long)plan->ranks, (long long)plan->rank);
  /* the merge's arguments first, so that a bad out or lse fails before anything runs */
  {
    const int64_t want[4] = {plan->B, plan->heads, plan->L, plan->Dv};
    int rc = kva_check_tensor(out, "out", KVA_DT_FLOAT, 4, false);
    if (rc) return rc;
    for (int d = 0; d < 4; ++d)
      if (out->shape[d] != want[d])
        return kva_seterr(KVA_ESHAPE, "out.shape[%d] = %lld, expected %lld ([B, heads, L, Dv] of the plan)", d,
                          (long long)out->shape[d], (long long)want[d]);
    if (lse) {
      if ((rc = kva_check_tensor(lse, "lse", KVA_DT(KVA_F32), 3, false))) return rc;
      for (int d = 0; d < 3; ++d)
        if (lse->shape[d] != want[d])
          return kva_seterr(KVA_ESHAPE, "lse.shape[%d] = %lld, expected %lld ([B, heads, L] of the plan)", d,
                            (long long)lse->shape[d], (long long)want[d]);
    }
  }
  int rc = kva_cp_attend(ctx, plan, q, kv, params, send, plan->send_bytes, workspace, workspace_bytes);
  if (rc < 0) return rc;
  cudaStream_t s = (cudaStream_t)ctx->stream;
  char *sb = (char *)send, *rb = (char *)recv;
  const size_t of = plan->o_bytes / 4, lf = plan->lse_bytes / 4;
  if ((r = ncclGroupStart()) != ncclSuccess) return nccl_err(r, "ncclGroupStart");
  if (plan->by_head) {
    for (int64_t d = 0; d < plan->ranks && r == ncclSuccess; ++d) {
      const int peer = (int)d;
      r = ncclSend(sb + d * plan->o_bytes, of, ncclFloat32, peer, c, s);
      if (r == ncclSuccess) r = ncclRecv(rb + d * plan->o_bytes, of, ncclFloat32, peer, c, s);
      if (r == ncclSuccess) r = ncclSend(sb + plan->send_lse_offset + d * plan->lse_bytes, lf, ncclFloat32, peer, c, s);
      if (r == ncclSuccess) r = ncclRecv(rb + plan->recv_lse_offset + d * plan->lse_bytes, lf, ncclFloat32, peer, c, s);
    }
  } else {
    r = ncclAllGather(sb, rb, of, ncclFloat32, c, s);
    if (r == ncclSuccess) r = ncclAllGather(sb + plan->send_lse_offset, rb + plan->recv_lse_offset, lf, ncclFloat32, c, s);
  }
  const ncclResult_t e = ncclGroupEnd();
  if (r != ncclSuccess) return nccl_err(r, "exchange");
  if (e != ncclSuccess) return nccl_err(e, "ncclGroupEnd");
  return kva_cp_merge(ctx, plan, recv, plan->recv_bytes, out, lse);
#endif
}
