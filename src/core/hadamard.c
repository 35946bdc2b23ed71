/* The normalized Walsh-Hadamard transform of one row in f32: log2(m)
 * butterfly stages (adds and subtracts only), the 3x3 Householder block for
 * D = 3m, then one multiply by the normalization. No multiply precedes an
 * add, so no fma contraction can change the bits (the CUDA kernels match). */
#include "hadamard.h"

#include <math.h>

int kva_hadamard_block(int64_t D) {
  if (D < 16 || D > KVA_HADAMARD_MAX_DIM) return 0;
  const int64_t m = D % 3 == 0 ? D / 3 : D;
  if (m < 16 || (m & (m - 1))) return 0;
  return (int)m;
}

float kva_hadamard_scale(int64_t D) {
  const int64_t m = kva_hadamard_block(D);
  return m == D ? (float)(1.0 / sqrt((double)D)) : (float)(1.0 / (3.0 * sqrt((double)m)));
}

void kva_hadamard_row_f32(float *x, int64_t D) {
  const int64_t m = kva_hadamard_block(D);
  for (int64_t h = 1; h < m; h *= 2) /* blocks of 2h tile every m-block */
    for (int64_t i0 = 0; i0 < D; i0 += 2 * h)
      for (int64_t i = i0; i < i0 + h; ++i) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
  if (m != D)
    for (int64_t a = 0; a < m; ++a) {
      const float u0 = x[a], u1 = x[m + a], u2 = x[2 * m + a];
      const float s = (u0 + u1) + u2, s2 = s + s;
      x[a] = s2 - ((u0 + u0) + u0);
      x[m + a] = s2 - ((u1 + u1) + u1);
      x[2 * m + a] = s2 - ((u2 + u2) + u2);
    }
  const float c = kva_hadamard_scale(D);
  for (int64_t i = 0; i < D; ++i) x[i] *= c;
}

int kva_hadamard_dim_error(const char *what, int64_t D) {
  return kva_seterr(KVA_EUNSUPPORTED, "%s: head dim %lld has no Hadamard rotation (supported: powers of two "
                    "16..512 and 3 * 2^k: 48, 96, 192, 384)", what, (long long)D);
}

int kva_hadamard_dim_supported(int64_t D) { return kva_hadamard_block(D) > 0; }
