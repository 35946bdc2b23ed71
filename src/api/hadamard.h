/* The Hadamard transform's backend dispatch for the library's own passes
 * (the rotated attention call, src/api/attention.c). */
#ifndef KVA_API_HADAMARD_H
#define KVA_API_HADAMARD_H

#include "core/backend.h"

/* y = H x on ctx's backend for validated x, y (kva_hadamard's contract),
 * ctx->mu held by the caller. */
int kva_hadamard_run(kva_context *ctx, const kva_tensor *x, const kva_tensor *y);
#endif
