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
  unsigned rotate;           /* KVA_ATTN_ROTATED_K | _V of the call; the backend sees only the bits it
                                runs fused (kva_cuda_rotate_fused), src/api/attention.c runs passes for
                                the rest (q' = H q before, out = H out' after) */
  const kva_tensor *q, *out;
  const kva_tensor *lse;      /* [B, H, L] f32 or NULL: each row's log-sum-exp */
  int lse_base2;             /* lse in base 2 (KVA_LSE_BASE2) */
  const kva_kv_view *kv;
  const int32_t *seq_lens;   /* [B] or NULL (all N); contiguous layout only (block table: kv->table) */
  kva_path path;
} kva_problem;

/* The causal family: CAUSAL, and TREE (CAUSAL on the prefix, bits on the
 * L new keys). */
static inline int kva_causal_family(kva_mask_kind k) { return k == KVA_MASK_CAUSAL || k == KVA_MASK_TREE; }

/* TREE: the packed bit row of query row i of sequence b (ceil(L / 32)
 * words; p->mask_stride[0] is 0 for a broadcast tree); NULL for other kinds. */
static inline const uint32_t *kva_tree_row(const kva_problem *p, int64_t b, int64_t i) {
  if (p->mask.kind != KVA_MASK_TREE) return NULL;
  return (const uint32_t *)((const char *)p->mask.array.data + b * p->mask_stride[0] + i * p->mask_stride[1]);
}

/* Visibility of key t for query row i of a sequence of length len, for the
 * causal family (CAUSAL with window / segments; TREE); `seg` is that
 * sequence's segment row or NULL. Positions are view indices:
 * p = len - L + i. TREE: tree = kva_tree_row of the row and n0 = len - L
 * (the first new key): key t >= n0 is visible iff bit t - n0 is set, keys
 * before it follow the causal rule; CAUSAL: tree = NULL (n0 unused). */
static inline int kva_causal_visible(int64_t t, int64_t p, int32_t window, const int32_t *seg, int clamp,
                                     const uint32_t *tree, int64_t n0) {
  if (tree && t >= n0) {
    const int64_t j = t - n0;
    return (int)(tree[j >> 5] >> (j & 31) & 1u);
  }
  int in_window = window <= 0 || t > p - window;
  if (t <= p && in_window) return 1;
  if (seg && seg[t] != 0 && seg[t] == seg[p] && (!clamp || in_window)) return 1;
  return 0;
}

/* The last key that every row at positions >= pmin sees by the causal
 * triangle (windows aside): pmin for CAUSAL; for TREE the last prefix key
 * len - L - 1 (the new keys follow the bits). For "whole tile visible"
 * shortcuts. */
static inline int64_t kva_causal_all_upto(const kva_problem *p, int64_t len, int64_t pmin) {
  return p->mask.kind == KVA_MASK_TREE ? len - p->L - 1 : pmin;
}
#endif
