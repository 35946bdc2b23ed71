/* kva_merge_states: argument validation (shapes, dtypes, the allowed
 * aliasing) into a kva_merge_problem and backend dispatch. The math lives in
 * core/softmax_state.h; the backends fold the parts with it. */
#include "core/backend.h"

#include <stdio.h>
#include <string.h>

/* Same memory, dtype and strides: the only overlap kva_merge_states allows
 * (an output written in place over one part). */
static int same_view(const kva_tensor *a, const kva_tensor *b) {
  if (a->data != b->data || a->dtype != b->dtype || a->ndim != b->ndim) return 0;
  for (int d = 0; d < a->ndim; ++d)
    if (a->shape[d] != b->shape[d] || a->stride[d] != b->stride[d]) return 0;
  return 1;
}

static int check_shape(const kva_tensor *t, const char *name, const int64_t *want, int n) {
  for (int d = 0; d < n; ++d)
    if (t->shape[d] != want[d])
      return kva_seterr(KVA_ESHAPE, "%s.shape[%d] = %lld, expected %lld (%s)", name, d, (long long)t->shape[d],
                        (long long)want[d], n == 4 ? "[B, H, L, Dv] of parts_o[0]" : "[B, H, L] of parts_o[0]");
  return 0;
}

int kva_merge_states_unlocked(kva_context *ctx, int64_t R, const kva_tensor *parts_o, const kva_tensor *parts_lse,
                              kva_tensor *out, kva_tensor *lse_out, unsigned flags) {
  kva_clearerr();
  if (!ctx) return kva_seterr(KVA_EINVAL, "ctx is NULL");
  if (R < 1 || R > KVA_MERGE_MAX_PARTS)
    return kva_seterr(KVA_EINVAL, "R = %lld parts (allowed: 1 .. KVA_MERGE_MAX_PARTS = %d)", (long long)R,
                      KVA_MERGE_MAX_PARTS);
  if (!parts_o) return kva_seterr(KVA_EINVAL, "parts_o is NULL");
  if (!parts_lse) return kva_seterr(KVA_EINVAL, "parts_lse is NULL");
  if (!out) return kva_seterr(KVA_EINVAL, "out is NULL");
  if (flags & ~KVA_LSE_BASE2) return kva_seterr(KVA_EINVAL, "flags = 0x%x (allowed: KVA_LSE_BASE2)", flags);
  char nm[48];
  int rc = kva_check_tensor(&parts_o[0], "parts_o[0]", KVA_DT_FLOAT, 4, false);
  if (rc) return rc;
  const int64_t *sh = parts_o[0].shape;
  for (int64_t r = 0; r < R; ++r) {
    snprintf(nm, sizeof nm, "parts_o[%lld]", (long long)r);
    if ((rc = kva_check_tensor(&parts_o[r], nm, KVA_DT_FLOAT, 4, false)) || (rc = check_shape(&parts_o[r], nm, sh, 4)))
      return rc;
    snprintf(nm, sizeof nm, "parts_lse[%lld]", (long long)r);
    if ((rc = kva_check_tensor(&parts_lse[r], nm, KVA_DT(KVA_F32), 3, false)) ||
        (rc = check_shape(&parts_lse[r], nm, sh, 3)))
      return rc;
  }
  if ((rc = kva_check_tensor(out, "out", KVA_DT_FLOAT, 4, false)) || (rc = check_shape(out, "out", sh, 4))) return rc;
  if (lse_out && ((rc = kva_check_tensor(lse_out, "lse_out", KVA_DT(KVA_F32), 3, false)) ||
                  (rc = check_shape(lse_out, "lse_out", sh, 3))))
    return rc;
  if (lse_out && kva_tensors_overlap(out, lse_out)) return kva_seterr(KVA_EINVAL, "out overlaps lse_out");
  for (int64_t r = 0; r < R; ++r) {
    if (kva_tensors_overlap(out, &parts_o[r]) && !same_view(out, &parts_o[r]))
      return kva_seterr(KVA_EINVAL, "out overlaps parts_o[%lld] without being exactly it (in place)", (long long)r);
    if (kva_tensors_overlap(out, &parts_lse[r])) return kva_seterr(KVA_EINVAL, "out overlaps parts_lse[%lld]", (long long)r);
    if (!lse_out) continue;
    if (kva_tensors_overlap(lse_out, &parts_lse[r]) && !same_view(lse_out, &parts_lse[r]))
      return kva_seterr(KVA_EINVAL, "lse_out overlaps parts_lse[%lld] without being exactly it (in place)",
                        (long long)r);
    if (kva_tensors_overlap(lse_out, &parts_o[r]))
      return kva_seterr(KVA_EINVAL, "lse_out overlaps parts_o[%lld]", (long long)r);
  }
  kva_merge_problem m;
  memset(&m, 0, sizeof m);
  m.R = R;
  m.B = sh[0];
  m.H = sh[1];
  m.L = sh[2];
  m.Dv = sh[3];
  m.o = parts_o;
  m.lse = parts_lse;
  m.out = out;
  m.lse_out = lse_out;
  m.base2 = (flags & KVA_LSE_BASE2) != 0;
  return ctx->backend == KVA_BACKEND_CPU ? kva_cpu_merge_states(ctx, &m) : kva_cuda_merge_states(ctx, &m);
}

/* The CPU merge runs on the context's pool and the CUDA one on its stream:
 * one call at a time per context, as kva_attention. */
int kva_merge_states(kva_context *ctx, int64_t R, const kva_tensor *parts_o, const kva_tensor *parts_lse,
                     kva_tensor *out, kva_tensor *lse_out, unsigned flags) {
  if (!ctx) return kva_merge_states_unlocked(ctx, R, parts_o, parts_lse, out, lse_out, flags);
  pthread_mutex_lock(&ctx->mu);
  const int rc = kva_merge_states_unlocked(ctx, R, parts_o, parts_lse, out, lse_out, flags);
  pthread_mutex_unlock(&ctx->mu);
  return rc;
}
