/* One attention call's descriptors as mutable copies, and the random
 * mutations the bad-input tests apply to them: test_mutations.c runs the
 * mutated calls on the CPU, test_cuda.c on the device (the same mutations
 * of the same host descriptors, mirrored to device memory).
 *
 * Tensor mutations (att_mutate_tensor / att_mutate_kv, attn_check.h) never
 * make a view larger than its buffer; a table's columns and row stride only
 * shrink or become invalid, its block ids stay in the pool or become
 * invalid; what is left valid therefore stays inside the buffers att_make
 * and att_table_make allocated. Pointers only become NULL, so a mutated
 * descriptor points at its base call's buffer or at nothing. */
#ifndef KVA_MUTATE_CALL_H
#define KVA_MUTATE_CALL_H

#include "attn_check.h"

/* The base call: a case's operands and, with a block size, its pools. */
typedef struct mut_base {
  att_data d;
  att_table tb;
  int table;
  const kva_kv_view *view;
} mut_base;

/* One call's descriptors, mutable copies of the base call's (and of its
 * block table and the table's arrays). */
typedef struct mut_call {
  kva_tensor q, out;
  kva_kv_view view;
  kva_attn_params p;
  int32_t *lens;                /* contiguous lengths (view.seq_lens once mutated) */
  kva_block_table t;            /* BLOCK_TABLE: view.table points here */
  int32_t *blocks, *tlens, *fo; /* its arrays */
  /* a value of the arrays the CUDA backend reads in device memory was
   * mutated (a length, a block id, a first offset), or which of them a
   * sequence reads (the table's columns or row stride): the CPU refuses a
   * bad one, CUDA clamps it (kvattn.h, kva_block_table) */
  int dev_values;
} mut_call;

/* The base cases: q4 with bf16 scales (ragged, strided views), bf16 rows
 * with a window and sinks, q8 with f16 scales and segments, f16 rows with a
 * bool mask array; over contiguous caches and over caller pools of blocks
 * of 8 and 5 (block 0: contiguous). */
typedef struct mut_case {
  att_case c;
  int block;
} mut_case;
#define MUT_NCASES 6
extern const mut_case mut_cases[MUT_NCASES];
enum { MUT_ITERS = 2500, MUT_ITERS_QUICK = 400 }; /* mutated calls per case */

/* Fresh random operands of case ac, over caller pools of blocks of bs
 * tokens when bs > 0; 0 or -1 (reported). */
int mut_base_make(mut_base *m, const att_case *ac, int64_t bs);
void mut_base_free(mut_base *m);
int mut_call_alloc(mut_call *c, const mut_base *m); /* 0 or -1 */
void mut_call_free(mut_call *c);
void mut_call_reset(mut_call *c, const mut_base *m); /* the base call's descriptors into c */
void mut_call_mutate(mut_call *c, const mut_base *m); /* one mutation somewhere in the call */
void mut_call_diff(const mut_call *c, const mut_base *m); /* prints the fields that differ */
/* A call the library accepted, its output in the host view (m->d): the
 * oracle must accept the same descriptors (unless lenient: mutated device
 * values the CUDA backend clamps), the output must not have grown, and
 * where the strides are the base call's it must agree with the oracle
 * within atol: the exact oracle, or (ctx not NULL: a CPU context and host
 * descriptors) the oracle with the roundings of the kernel ctx runs for
 * the call (att_name_rounding). 0, or -1 after reporting iteration it's
 * failure. */
int mut_check_accepted(kva_context *ctx, const mut_call *c, const mut_base *m, double atol, int lenient, int it,
                       int *compared);
#endif
