/* Math: a context-parallel part with no key: o = 0, lse = -inf (the empty
 *   softmax state), src/api/cp.c's send layout.
 * Traffic: writes o_bytes (cudaMemsetAsync) and lse_count floats.
 * Launch: cudaMemsetAsync, then ceil(lse_count / 256) blocks of 256 threads,
 *   one float each; ctx's stream, no allocation, no sync (graph-capturable). */
#include "cuda/common.cuh"

#include <cuda_runtime.h>
#include <math.h>

#define KVC_CP_THREADS 256

__global__ void kvc_cp_fill_kernel(float *p, long long n, float v) {
  const long long i = (long long)blockIdx.x * KVC_CP_THREADS + threadIdx.x;
  if (i < n) p[i] = v;
}

extern "C" int kva_cuda_cp_fill_empty(kva_context *ctx, void *send, size_t o_bytes, size_t lse_count) {
  if (!ctx->cuda) return kva_seterr(KVA_ENODEVICE, "ctx: CUDA context not initialized");
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess && dev != ctx->device) e = cudaSetDevice(ctx->device);
  if (e != cudaSuccess)
    return kva_seterr(KVA_ECUDA, "selecting ctx's device: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
  cudaStream_t s = (cudaStream_t)ctx->stream;
  e = cudaMemsetAsync(send, 0, o_bytes, s);
  if (e == cudaSuccess && lse_count) {
    const unsigned blocks = (unsigned)((lse_count + KVC_CP_THREADS - 1) / KVC_CP_THREADS);
    kvc_cp_fill_kernel<<<blocks, KVC_CP_THREADS, 0, s>>>((float *)((char *)send + o_bytes), (long long)lse_count,
                                                        -INFINITY);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) return kva_seterr(KVA_ECUDA, "cp: empty part fill: %s", cudaGetErrorString(e));
  return 0;
}
