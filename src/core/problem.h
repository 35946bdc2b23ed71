/* A validated attention call in normalized form: what every backend receives
 * after kva_attention has checked the arguments (src/api/attention.c). */
#ifndef KVA_PROBLEM_H
#define KVA_PROBLEM_H

#include "internal.h"

/* Largest head dim (kva_head_dim_supported). */
#define KVA_MAX_HEAD_DIM 512
/* Most query rows per sequence on the fused (direct) paths. */
#define KVA_MAX_FUSED_ROWS 16

typedef struct kva_problem {
  int64_t B, H, KVH, rep, L; /* rep = H / KVH query heads per KV head */
  int64_t Dk, Dv;
  int64_t N;                 /* capacity: contiguous K.shape[2], paged: longest sequence,
                                block table: max_blocks * block_size */
  float scale;               /* resolved (never 0) */
  float softcap;             /* 0 = none */
  kva_mask mask;             /* as given; array/segments normalized below */
  int64_t mask_stride[4];    /* ARRAY: element strides in bytes, 0 where broadcast */
  const float *sinks;        /* [H] or NULL */
  int exact;                 /* KVA_ATTN_EXACT: the selectors take only "[exact f32]" kernels */
  unsigned rotate;           /* KVA_ATTN_ROTATED_K | _V of the call: src/api/attention.c rotates q
                                and un-rotates out around the backend, which always sees 0 */
  const kva_tensor *q, *out;
  const kva_tensor *lse;      /* [B, H, L] f32 or NULL: each row's log-sum-exp */
  int lse_base2;             /* lse in base 2 (KVA_LSE_BASE2) */
  const kva_kv_view *kv;
  const int32_t *seq_lens;   /* [B] or NULL (all N); contiguous layout only (block table: kv->table) */
  kva_path path;
} kva_problem;

/* Visibility of key t for query row i of a sequence of length len, for the
 * causal family (CAUSAL with window / segments); `seg` is that sequence's
 * segment row or NULL. Positions are view indices: p = len - L + i. */
static inline int kva_causal_visible(int64_t t, int64_t p, int32_t window, const int32_t *seg,
                                     int clamp) {
  int in_window = window <= 0 || t > p - window;
  if (t <= p && in_window) return 1;
  if (seg && seg[t] != 0 && seg[t] == seg[p] && (!clamp || in_window)) return 1;
  return 0;
}
#endif
