/* The one online-softmax state, shared by the CPU kernels, the CUDA merge and
 * the tests. For one query vector over a set S of keys with logits s_j:
 *   m = max_j s_j,  l = sum_j exp(s_j - m),  o[d] = sum_j exp(s_j - m) v_j[d]
 * (o unnormalized). The empty set is m = -inf, l = 0, o = 0. Merging two
 * states rescales both to the larger max. A sink logit z joins as the state
 * {m = z, l = 1, o = 0}. The final output is o / l, or 0 when l == 0 (a row
 * that sees no key). NaN logits make m NaN, and NaN propagates to the output.
 * Stored as floats [m, l, o[0..D-1]] (KVA_STATE_FLOATS(D) floats). */
#ifndef KVA_SOFTMAX_STATE_H
#define KVA_SOFTMAX_STATE_H

#include <math.h>

#ifdef __CUDACC__
#define KVA_HD __host__ __device__ __forceinline__
#else
#define KVA_HD static inline
#endif

#define KVA_STATE_FLOATS(D) ((D) + 2)
#define KVA_LOG2E_F 1.4426950408889634f /* log2(e): lse2 = lse * KVA_LOG2E_F */
#define KVA_LN2_F 0.6931471805599453f   /* ln(2): lse = lse2 * KVA_LN2_F */

/* Log-sum-exp of a final state (natural log): m + log l; -inf when empty
 * (m = -inf, l = 0), NaN when m or l is NaN. */
KVA_HD float kva_softmax_lse(const float *s) { return s[0] == -INFINITY ? -INFINITY : s[0] + logf(s[1]); }

/* Scale factors that bring states with maxima m1, m2 to their common max.
 * exp(-inf - x) is 0, so an empty side contributes nothing. */
KVA_HD void kva_softmax_factors(float m1, float m2, float *mn, float *a1, float *a2) {
  float mx = (m1 > m2 || m1 != m1) ? m1 : m2; /* NaN-propagating max */
  *mn = mx;
  if (mx == -INFINITY) { /* both empty */
    *a1 = 0.0f;
    *a2 = 0.0f;
    return;
  }
  *a1 = expf(m1 - mx);
  *a2 = expf(m2 - mx);
}

/* s1 <- merge(s1, s2), states of D output elements. */
KVA_HD void kva_softmax_merge(float *s1, const float *s2, int D) {
  if (s2[0] == -INFINITY) return; /* empty: nothing to add */
  float mn, a1, a2;
  kva_softmax_factors(s1[0], s2[0], &mn, &a1, &a2);
  s1[0] = mn;
  s1[1] = s1[1] * a1 + s2[1] * a2;
  for (int d = 0; d < D; ++d) s1[2 + d] = s1[2 + d] * a1 + s2[2 + d] * a2;
}

/* Adds a sink logit z (denominator only). */
KVA_HD void kva_softmax_add_sink(float *s, float z, int D) {
  float mn, a1, a2;
  if (s[0] == -INFINITY) return; /* no key visible: the output stays 0 */
  kva_softmax_factors(s[0], z, &mn, &a1, &a2);
  s[0] = mn;
  s[1] = s[1] * a1 + a2;
  for (int d = 0; d < D; ++d) s[2 + d] *= a1;
}

/* Output element d of a final state. */
KVA_HD float kva_softmax_out(const float *s, int d) { return s[1] > 0.0f || s[1] != s[1] ? s[2 + d] / s[1] : 0.0f; }

KVA_HD void kva_softmax_init(float *s, int D) {
  s[0] = -INFINITY;
  s[1] = 0.0f;
  for (int d = 0; d < D; ++d) s[2 + d] = 0.0f;
}
#endif
