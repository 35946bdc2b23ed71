/* The CUDA backend's entry points when the library is built without nvcc
 * (KVA_HAVE_CUDA undefined): no devices, and every CUDA call fails with
 * KVA_ENODEVICE and a message saying why. With nvcc, src/cuda/ defines them. */
#include "core/backend.h"

#ifndef KVA_HAVE_CUDA
static int no_cuda(void) {
  return kva_seterr(KVA_ENODEVICE, "backend CUDA: this build of kvattn has no CUDA support (nvcc was "
                                   "not found at build time)");
}

int kva_cuda_device_count(void) { return 0; }

int kva_cuda_device_info(int device, char *name, size_t name_len, size_t *total_bytes) {
  kva_clearerr();
  (void)device;
  (void)name;
  (void)name_len;
  (void)total_bytes;
  return no_cuda();
}

int kva_cuda_context_init(kva_context *ctx) {
  (void)ctx;
  return no_cuda();
}

void kva_cuda_context_free(kva_context *ctx) { (void)ctx; }

int kva_cuda_workspace_size(const kva_context *ctx, const kva_problem *p, size_t *bytes) {
  (void)ctx;
  (void)p;
  *bytes = 0;
  return no_cuda();
}

int kva_cuda_merge_states(kva_context *ctx, const kva_merge_problem *m) {
  (void)ctx;
  (void)m;
  return no_cuda();
}

int kva_cuda_kernel_name(const kva_context *ctx, const kva_problem *p, char *name, size_t size) {
  (void)ctx;
  (void)p;
  (void)name;
  (void)size;
  return no_cuda();
}

int kva_cuda_attention(kva_context *ctx, const kva_problem *p, void *ws, size_t ws_bytes) {
  (void)ctx;
  (void)p;
  (void)ws;
  (void)ws_bytes;
  return no_cuda();
}

int kva_cuda_hadamard(kva_context *ctx, const kva_tensor *x, const kva_tensor *y) {
  (void)ctx;
  (void)x;
  (void)y;
  return no_cuda();
}

int kva_cuda_cache_write_ex(kva_context *ctx, const kva_kv *k_pool, const kva_kv *v_pool, const kva_tensor *k,
                            const kva_tensor *v, const int32_t *slots, int64_t n, unsigned flags) {
  (void)ctx;
  (void)k_pool;
  (void)v_pool;
  (void)k;
  (void)v;
  (void)slots;
  (void)n;
  (void)flags;
  return no_cuda();
}

int kva_cuda_cp_fill_empty(kva_context *ctx, void *send, size_t o_bytes, size_t lse_count) {
  (void)ctx;
  (void)send;
  (void)o_bytes;
  (void)lse_count;
  return no_cuda();
}

int kva_cuda_workspace_alloc(kva_context *ctx, size_t bytes, void **ptr) {
  (void)ctx;
  (void)bytes;
  *ptr = NULL;
  return no_cuda();
}

void kva_cuda_workspace_free(kva_context *ctx, void *ptr) {
  (void)ctx;
  (void)ptr;
}

unsigned kva_cuda_rotate_fused(const kva_context *ctx, const kva_problem *p) {
  (void)ctx;
  (void)p;
  return 0;
}
#else
/* ISO C forbids an empty translation unit. */
typedef int kva_cuda_stubs_unused;
#endif
