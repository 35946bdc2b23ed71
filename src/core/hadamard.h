/* The normalized Walsh-Hadamard transform of one row in f32 (kva_hadamard,
 * the rotated attention call's passes, kva_cache_write_ex): the arithmetic
 * kvattn.h specifies, which the CUDA kernels repeat operation for operation. */
#ifndef KVA_HADAMARD_H
#define KVA_HADAMARD_H

#include "internal.h"

/* Largest head dim kva_hadamard takes. */
#define KVA_HADAMARD_MAX_DIM 512

/* The power-of-two block m of head dim D (D = m, or D = 3 m), m >= 16 and
 * D <= KVA_HADAMARD_MAX_DIM; 0 when D is not supported. */
int kva_hadamard_block(int64_t D);

/* The final scale c of the transform of D (kvattn.h): (float)(1/sqrt(D)) or
 * (float)(1/(3 sqrt(m))). */
float kva_hadamard_scale(int64_t D);

/* x[0 .. D) <- H_D x in place, D supported (kva_hadamard_block > 0). */
void kva_hadamard_row_f32(float *x, int64_t D);

/* The KVA_EUNSUPPORTED error for head dim D of argument `what`. */
int kva_hadamard_dim_error(const char *what, int64_t D);
#endif
