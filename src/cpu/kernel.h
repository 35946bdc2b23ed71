/* CPU attention kernels: one work item = one (sequence, KV head, query-row
 * group) over one token range, producing the online-softmax states of its
 * rep*rows query vectors (core/softmax_state.h). Kernel bodies live in
 * src/cpu/simd/ and are compiled once per SIMD level; kva_cpu_kernels()
 * returns the table of the level in use. */
#ifndef KVA_CPU_KERNEL_H
#define KVA_CPU_KERNEL_H

#include "core/softmax_state.h"
#include "paged/source.h"

/* Tokens per tile: K/V rows dequantized/converted into an L1-resident tile. */
#define KVA_TILE 32

typedef struct kva_item {
  const kva_problem *p;
  const kva_source *src;
  int64_t b, hk;     /* sequence, KV head */
  int64_t i0, rows;  /* query rows [i0, i0 + rows) of the L rows */
  int64_t t0, t1;    /* token range of the view */
  int64_t len;       /* cache length of sequence b */
  float *state;      /* out: rep*rows states of KVA_STATE_FLOATS(Dv) floats, vector j = r*rows + ii */
  float *scratch;    /* kva_cpu_scratch_floats() floats, 64-byte aligned */
} kva_item;

typedef void (*kva_item_fn)(const kva_item *it);

typedef struct kva_cpu_kernels {
  const char *level;
  kva_item_fn generic; /* every format, mask, softcap; any row count */
  /* Specialized decode/verify kernel for this item's formats, or NULL when
   * none applies (checked per call; never changes results beyond rounding). */
  kva_item_fn (*fast)(const kva_problem *p);
  const char *(*fast_name)(const kva_problem *p); /* the name of what fast picks, NULL for none */
} kva_cpu_kernels;

/* Floats of per-worker scratch for nq query vectors. */
size_t kva_cpu_scratch_floats(const kva_problem *p, int64_t nq, bool *ok); /* ok cleared when it overflows */

const kva_cpu_kernels *kva_cpu_kernels_get(void);
/* Tests only (not in the public header): every call runs the general kernel
 * (on != 0), the fallback path's kernel, which otherwise serves only array
 * masks and long L now that every level has a fused kernel. Process-wide,
 * like kva_cpu_set_simd. */
void kva_cpu_general_only(int on);

extern const kva_cpu_kernels kva_cpu_kernels_portable, kva_cpu_kernels_avx2, kva_cpu_kernels_avxvnni,
    kva_cpu_kernels_avx512;
#endif
