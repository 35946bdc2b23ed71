/* Validation of an attention call into a kva_problem, and the one selector
 * that picks the path (shared by kva_attention, kva_attention_path and the
 * oracle's argument checks). */
#ifndef KVA_ATTENTION_H
#define KVA_ATTENTION_H

#include "core/problem.h"

/* Checks every argument (shapes, dtypes, strides, masks, lengths) and fills
 * *p. `backend` says where pointers live: host-side checks of seq_lens and
 * segments values are done only for the CPU backend. */
int kva_problem_init(kva_problem *p, kva_backend backend, const kva_tensor *q, const kva_kv_view *kv,
                     const kva_attn_params *params, const kva_tensor *out);

/* Validates lse ([B, H, L] f32, innermost contiguous, no overlap with the
 * inputs or out) and flags (0 or KVA_LSE_BASE2) of a call whose problem p is
 * already validated, and records them in p. lse NULL: no lse. */
int kva_problem_set_lse(kva_problem *p, const kva_tensor *lse, unsigned flags);

/* The selector: fused direct path or the general fallback. */
kva_path kva_select_path(const kva_problem *p);

/* Head dims the fused paths are built for. */
int kva_head_dim_supported(int64_t d);
#endif
