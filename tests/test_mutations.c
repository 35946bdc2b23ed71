/* Randomized bad input to kva_attention (CPU): valid calls over contiguous
 * caches and over caller-owned block pools broken by one to three random
 * mutations of their descriptors (ranks, dtypes, shapes, strides, pointers,
 * bits, group sizes, layouts, lengths, scale, softcap, mask fields; block
 * tables: batch, columns, row stride, block ids, lengths, first offsets).
 * Each mutated call must either fail with a negative code and a message,
 * leaving the output and its sentinel untouched, or succeed, be accepted by
 * the oracle (kva_reference_attention) too, and (strides unchanged) agree
 * with it. Run under ASan and UBSan by `make test`, so an out-of-bounds read
 * or an overflowing size computation in validation fails here too.
 * The mutations and the base cases are mutate_call.c's (shared with the
 * CUDA form of this test, test_cuda.c). */
#include "mutate_call.h"

#include <stdint.h>

/* Runs the mutated calls of one base case (over pools of block size bs when
 * bs > 0); returns 0 when all held. */
static int run_mutations(const att_case *ac, int64_t bs, int iters, int *accepted, int *compared) {
  mut_base m;
  if (mut_base_make(&m, ac, bs)) return -1;
  kva_context *ctx = NULL;
  int rc_all = kva_context_create(&ctx, NULL) ? -1 : 0;
  att_data *d = &m.d;
  unsigned char *snap = (unsigned char *)malloc(d->out_bytes);
  mut_call c;
  if (mut_call_alloc(&c, &m) || !snap) rc_all = -1;
  for (int it = 0; it < iters && rc_all == 0; ++it) {
    att_poison(d);
    memcpy(snap, d->out_buf, d->out_bytes);
    mut_call_reset(&c, &m);
    const int nm = 1 + att_pick(3);
    for (int k = 0; k < nm; ++k) mut_call_mutate(&c, &m);
    if (getenv("KVA_MUT_TRACE")) { /* a crash's last mutations, for whoever debugs one */
      fprintf(stderr, "iteration %d:\n", it);
      mut_call_diff(&c, &m);
    }
    const int rc = kva_attention(ctx, &c.q, &c.view, &c.p, &c.out, NULL, 0);
    if (rc < 0) {
      if (!kva_last_error()[0]) { FAIL_("iteration %d: code %d without a message", it, rc); rc_all = -1; }
      if (memcmp(snap, d->out_buf, d->out_bytes) != 0 || !att_sentinel_ok(d)) {
        FAIL_("iteration %d: output modified on error %d (%s); the mutations:", it, rc, kva_last_error());
        mut_call_diff(&c, &m);
        rc_all = -1;
      }
      continue;
    }
    ++*accepted;
    if (!att_sentinel_ok(d)) { FAIL_("iteration %d: sentinel overwritten", it); rc_all = -1; break; }
    /* accepted: the oracle must accept the same descriptors and agree */
    if (mut_check_accepted(ctx, &c, &m, att_case_atol(ac), 0, it, compared)) rc_all = -1;
  }
  mut_call_free(&c);
  free(snap);
  kva_context_destroy(ctx);
  mut_base_free(&m);
  return rc_all;
}

TEST(errors_random_mutations) {
  const int iters = test_quick ? MUT_ITERS_QUICK : MUT_ITERS;
  for (int i = 0; i < MUT_NCASES; ++i) {
    int accepted = 0, compared = 0;
    if (run_mutations(&mut_cases[i].c, mut_cases[i].block, iters, &accepted, &compared) < 0) {
      char s[256];
      att_case_str(&mut_cases[i].c, s, sizeof s);
      FAIL_("case %s, block %d", s, mut_cases[i].block);
      return;
    }
    fprintf(stderr, "  case %d (block %d): %d mutated calls, %d accepted, %d of them compared with the oracle\n", i,
            mut_cases[i].block, iters, accepted, compared);
    /* some mutations (a shrink, a valid dtype, scale 1e30, no mask, another
     * block id) leave a valid call with the base strides: compared too */
    if (compared == 0) { FAIL_("case %d: no mutated call was accepted and compared (%d accepted)", i, accepted); return; }
  }
}
