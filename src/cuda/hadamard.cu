/* Math: kva_hadamard on the device: y = H_D x per row of the last dim, the
 *   f32 transform of src/core/hadamard.c operation for operation (rows.cuh:
 *   kvc_hadamard_warp), rounded once to y's dtype with the CPU's conversions:
 *   the bits equal the CPU's.
 * Traffic: reads every row of x once, writes every row of y once.
 * Launch: KVC_HD_WARPS warps per block, a warp per row (grid-stride over
 *   rows), a row staged in D floats of shared memory per warp (dynamic:
 *   KVC_HD_WARPS * D * 4 bytes); a programmatic dependent launch (sm_90: it
 *   waits for the previous grid before reading); no allocation, no sync:
 *   graph-capturable.
 *   In place (y == x) is safe: a warp reads its whole row before writing it. */
#include "cuda/common.cuh"
#include "cuda/rows.cuh"

extern "C" {
#include "core/hadamard.h"
}

#include <cuda_runtime.h>
#include <string.h>

#define KVC_HD_WARPS 4

struct kvc_hd_args {
  const char *x;
  char *y;
  long long n[3], sx[3], sy[3]; /* leading dims (right-aligned into 3) and byte strides */
  long long rows;
  int D, m, x_dtype, y_dtype;
  float c;
};

__global__ void __launch_bounds__(KVC_HD_WARPS * KVC_WARP) kvc_hadamard_kernel(const kvc_hd_args a) {
  extern __shared__ float kvc_hd_smem[];
  const int warp = threadIdx.x / KVC_WARP, lane = threadIdx.x % KVC_WARP;
  float *u = kvc_hd_smem + warp * a.D;
  const int xs = kvc_cw_size(a.x_dtype), ys = kvc_cw_size(a.y_dtype);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize(); /* launched early (PDL): wait for the kernel before (x's writer) */
#endif
  for (long long r = (long long)blockIdx.x * KVC_HD_WARPS + warp; r < a.rows; r += (long long)gridDim.x * KVC_HD_WARPS) {
    const long long c2 = r % a.n[2], c1 = r / a.n[2] % a.n[1], c0 = r / a.n[2] / a.n[1];
    const char *xr = a.x + c0 * a.sx[0] + c1 * a.sx[1] + c2 * a.sx[2];
    char *yr = a.y + c0 * a.sy[0] + c1 * a.sy[1] + c2 * a.sy[2];
    for (int i = lane; i < a.D; i += KVC_WARP) u[i] = kvc_cw_load(xr + (long long)i * xs, a.x_dtype);
    kvc_hadamard_warp(u, a.D, a.m, a.c, lane);
    for (int i = lane; i < a.D; i += KVC_WARP) kvc_cw_store(yr + (long long)i * ys, a.y_dtype, u[i]);
    __syncwarp(); /* the row's reads of u before the next row's writes */
  }
}

static void kvc_hd_split(const kva_tensor *t, long long n[3], long long s[3]) {
  const int lead = t->ndim - 1;
  for (int d = 0; d < 3; ++d) {
    const int src = d - (3 - lead);
    n[d] = src >= 0 ? t->shape[src] : 1;
    s[d] = src >= 0 ? t->stride[src] : 0;
  }
}

extern "C" int kva_cuda_hadamard(kva_context *ctx, const kva_tensor *x, const kva_tensor *y) {
  if (!ctx->cuda) return kva_seterr(KVA_ENODEVICE, "ctx: CUDA context not initialized");
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess && dev != ctx->device) e = cudaSetDevice(ctx->device);
  if (e != cudaSuccess)
    return kva_seterr(KVA_ECUDA, "selecting ctx's device: %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
  kvc_hd_args a;
  memset(&a, 0, sizeof a);
  a.x = (const char *)x->data;
  a.y = (char *)y->data;
  kvc_hd_split(x, a.n, a.sx);
  long long ny[3];
  kvc_hd_split(y, ny, a.sy);
  a.rows = a.n[0] * a.n[1] * a.n[2];
  a.D = (int)x->shape[x->ndim - 1];
  a.m = kva_hadamard_block(a.D);
  a.c = kva_hadamard_scale(a.D);
  a.x_dtype = x->dtype;
  a.y_dtype = y->dtype;
  const long long blocks_needed = (a.rows + KVC_HD_WARPS - 1) / KVC_HD_WARPS;
  const unsigned grid = (unsigned)(blocks_needed < 65535 ? blocks_needed : 65535);
  const size_t smem = (size_t)KVC_HD_WARPS * (size_t)a.D * sizeof(float);
  /* programmatic dependent launch: the launch overlaps the previous kernel's
   * tail (the attention kernel before the rotated call's output pass) */
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(KVC_HD_WARPS * KVC_WARP);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = (cudaStream_t)ctx->stream;
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  e = cudaLaunchKernelEx(&cfg, kvc_hadamard_kernel, a);
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e != cudaSuccess) return kva_seterr(KVA_ECUDA, "Hadamard kernel launch: %s", cudaGetErrorString(e));
  return 0;
}
