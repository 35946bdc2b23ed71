/* The backends' entry points, called by src/api/attention.c after the
 * arguments are validated and a path selected. Each backend owns its folder:
 * src/cpu/ and src/cuda/ (built when nvcc is present: KVA_HAVE_CUDA). */
#ifndef KVA_BACKEND_H
#define KVA_BACKEND_H

#include "core/problem.h"

#include <pthread.h>

typedef struct kva_threadpool kva_threadpool;

/* Locking: mu is held across each call that uses the context's state (the
 * workspace's growth and use, the pool, the stream): kva_attention,
 * kva_cache_write, kva_context_set_stream; calls on one context are
 * serialized, calls on different contexts run in parallel. next/prev link
 * the live contexts for the fork handlers (src/api/attention.c). */
struct kva_context {
  pthread_mutex_t mu;
  kva_context *next, *prev;
  kva_backend backend;
  int threads;
  kva_threadpool *pool; /* CPU: started once at create */
  void *ws;             /* workspace owned by the context (grown on demand) */
  size_t ws_bytes;
  int device;           /* CUDA */
  void *stream;         /* CUDA: cudaStream_t */
  void *cuda;           /* CUDA backend private state */
};

/* Entry points for calls made while holding ctx->mu (composed calls such
 * as kva_cascade_attention): kva_attention_lse and kva_merge_states without
 * taking the lock; the context workspace grown to at least need bytes (its
 * contents not kept). */
int kva_attention_lse_unlocked(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                               const kva_attn_params *params, kva_tensor *out, kva_tensor *lse, unsigned flags,
                               void *workspace, size_t workspace_bytes);
int kva_merge_states_unlocked(kva_context *ctx, int64_t R, const kva_tensor *parts_o, const kva_tensor *parts_lse,
                              kva_tensor *out, kva_tensor *lse_out, unsigned flags);
int kva_context_workspace(kva_context *ctx, size_t need);

/* CPU backend (src/cpu/). */
/* Workspace bytes of a validated problem; KVA_ESHAPE when the size does
 * not fit size_t (an absurd problem: no allocation is attempted). */
int kva_cpu_workspace_size(const kva_context *ctx, const kva_problem *p, size_t *bytes);
int kva_cpu_attention(kva_context *ctx, const kva_problem *p, void *ws, size_t ws_bytes);
/* kva_attention_kernel's description of the kernel each backend would run
 * (name: size >= 1 bytes, truncated). */
void kva_cpu_kernel_name(const kva_problem *p, char *name, size_t size);
int kva_cuda_kernel_name(const kva_context *ctx, const kva_problem *p, char *name, size_t size);
/* The rotation bits (KVA_ATTN_ROTATED_K / _V) of a validated problem that
 * the CUDA backend runs fused in the kernel it would select (K: q rotated
 * on load; V: out rotated back on store); the API layer runs passes
 * around the backend for the rest (src/api/attention.c rot_plan). A
 * problem given to kva_cuda_attention with p->rotate set holds only bits
 * returned here. */
unsigned kva_cuda_rotate_fused(const kva_context *ctx, const kva_problem *p);

/* A validated kva_merge_states call (src/api/merge.c). */
typedef struct kva_merge_problem {
  int64_t R, B, H, L, Dv;
  const kva_tensor *o, *lse; /* [R] parts: o [B, H, L, Dv], lse [B, H, L] f32 */
  const kva_tensor *out;     /* [B, H, L, Dv] */
  const kva_tensor *lse_out; /* [B, H, L] f32 or NULL */
  int base2;                 /* every lse in base 2 */
} kva_merge_problem;
int kva_cpu_merge_states(kva_context *ctx, const kva_merge_problem *m);
int kva_cuda_merge_states(kva_context *ctx, const kva_merge_problem *m);

/* CUDA backend (src/cuda/); stubs returning KVA_ENODEVICE when not built. */
int kva_cuda_context_init(kva_context *ctx);
void kva_cuda_context_free(kva_context *ctx);
int kva_cuda_workspace_size(const kva_context *ctx, const kva_problem *p, size_t *bytes);
int kva_cuda_attention(kva_context *ctx, const kva_problem *p, void *ws, size_t ws_bytes);
/* kva_hadamard on ctx's stream (src/cuda/hadamard.cu): x, y validated by
 * src/api/hadamard.c (device memory). */
int kva_cuda_hadamard(kva_context *ctx, const kva_tensor *x, const kva_tensor *y);
/* kva_cache_write_ex on ctx's stream (src/cuda/cache_write.cu): arguments
 * validated by src/api/cache_write.c; slots out of range are skipped;
 * flags KVA_WRITE_ROTATE_K | _V rotate the rows first. */
int kva_cuda_cache_write_ex(kva_context *ctx, const kva_kv *k_pool, const kva_kv *v_pool, const kva_tensor *k,
                            const kva_tensor *v, const int32_t *slots, int64_t n, unsigned flags);
/* A context-parallel send buffer with no key (src/cuda/cp.cu): o_bytes of
 * zeros at send, lse_count floats of -inf at send + o_bytes, on ctx's stream. */
int kva_cuda_cp_fill_empty(kva_context *ctx, void *send, size_t o_bytes, size_t lse_count);
/* Allocates / frees the context-owned workspace in device memory. */
int kva_cuda_workspace_alloc(kva_context *ctx, size_t bytes, void **ptr);
void kva_cuda_workspace_free(kva_context *ctx, void *ptr);
#endif
