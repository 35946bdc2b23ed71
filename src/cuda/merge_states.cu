/* kva_merge_states on CUDA.
 *   math: per row (b, h, i), the parts {m = lse_r (natural log), l = 1,
 *         o = o_r} fold left in order r = 0..R-1 with kva_softmax_factors
 *         (core/softmax_state.h: the CPU merge's math and order); out = o / l
 *         (0 when every part is -inf), lse = m + log l.
 *   memory: reads R * (Dv + 1) elements per row, writes Dv (+ 1).
 *   launch: grid (L, H, B), MS_THREADS threads, no shared memory: thread t
 *         takes dims t, t + MS_THREADS, ... (up to MS_DIMS per thread). Every
 *         thread reads the R lse values of its row before the barrier and
 *         writes after it, so out / lse_out may be exactly one of the parts. */
#include "cuda/launch.cuh"

#include <string.h>

#define MS_THREADS 128
#define MS_DIMS (KVA_MAX_HEAD_DIM / MS_THREADS) /* dims per thread */

struct kvc_ms_part {
  const char *o;
  const char *lse;
  long long os[4], ls[3];
  int odt;
};
struct kvc_ms_args {
  kvc_ms_part part[KVA_MERGE_MAX_PARTS];
  int R, Dv, base2;
  char *out;
  long long os[4];
  int odt;
  char *lse_out;
  long long ls[3];
};

__global__ void __launch_bounds__(MS_THREADS) kvc_merge_states_kernel(const kvc_ms_args a) {
  const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  float m = -INFINITY, l = 0.0f, o[MS_DIMS];
#pragma unroll
  for (int k = 0; k < MS_DIMS; ++k) o[k] = 0.0f;
  for (int r = 0; r < a.R; ++r) {
    const kvc_ms_part &p = a.part[r];
    float z = *(const float *)(p.lse + b * p.ls[0] + h * p.ls[1] + i * p.ls[2]);
    if (z == -INFINITY) continue; /* empty part: its o_r is never read */
    if (a.base2) z *= KVC_LN2;
    float mn, f1, f2;
    kva_softmax_factors(m, z, &mn, &f1, &f2);
    m = mn;
    l = l * f1 + f2;
    const char *row = p.o + b * p.os[0] + h * p.os[1] + i * p.os[2];
#pragma unroll
    for (int k = 0; k < MS_DIMS; ++k) {
      const int d = tid + k * MS_THREADS;
      if (d < a.Dv) o[k] = o[k] * f1 + f2 * kvc_load(row + d * p.os[3], p.odt);
    }
  }
  __syncthreads(); /* every read of the row (parts that out may alias) before any write */
  char *orow = a.out + b * a.os[0] + h * a.os[1] + i * a.os[2];
#pragma unroll
  for (int k = 0; k < MS_DIMS; ++k) {
    const int d = tid + k * MS_THREADS;
    if (d < a.Dv) kvc_store(orow + d * a.os[3], a.odt, kvc_finish(o[k], l));
  }
  if (a.lse_out && tid == 0) {
    const float lse = m == -INFINITY ? -INFINITY : m + logf(l);
    *(float *)(a.lse_out + b * a.ls[0] + h * a.ls[1] + i * a.ls[2]) = a.base2 ? lse * KVC_LOG2E : lse;
  }
}

extern "C" int kva_cuda_merge_states(kva_context *ctx, const kva_merge_problem *m) {
  if (!ctx->cuda) return kva_seterr(KVA_ENODEVICE, "ctx: CUDA context not initialized");
  if (m->Dv > KVA_MAX_HEAD_DIM)
    return kva_seterr(KVA_EUNSUPPORTED, "merge on CUDA: Dv = %lld > %d", (long long)m->Dv, KVA_MAX_HEAD_DIM);
  if (m->L > 2147483647 || m->H > 65535 || m->B > 65535)
    return kva_seterr(KVA_EUNSUPPORTED, "merge on CUDA: grid (L, H, B) = (%lld, %lld, %lld) exceeds (2^31-1, 65535, 65535)",
                      (long long)m->L, (long long)m->H, (long long)m->B);
  kvc_ms_args a;
  memset(&a, 0, sizeof a);
  a.R = (int)m->R;
  a.Dv = (int)m->Dv;
  a.base2 = m->base2;
  for (int r = 0; r < a.R; ++r) {
    a.part[r].o = (const char *)m->o[r].data;
    a.part[r].lse = (const char *)m->lse[r].data;
    for (int d = 0; d < 4; ++d) a.part[r].os[d] = m->o[r].stride[d];
    for (int d = 0; d < 3; ++d) a.part[r].ls[d] = m->lse[r].stride[d];
    a.part[r].odt = m->o[r].dtype;
  }
  a.out = (char *)m->out->data;
  for (int d = 0; d < 4; ++d) a.os[d] = m->out->stride[d];
  a.odt = m->out->dtype;
  if (m->lse_out) {
    a.lse_out = (char *)m->lse_out->data;
    for (int d = 0; d < 3; ++d) a.ls[d] = m->lse_out->stride[d];
  }
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess && dev != ctx->device) e = cudaSetDevice(ctx->device);
  if (e != cudaSuccess) return kva_seterr(KVA_ECUDA, "selecting ctx's device: %s", cudaGetErrorString(e));
  kvc_merge_states_kernel<<<dim3((unsigned)m->L, (unsigned)m->H, (unsigned)m->B), MS_THREADS, 0,
                            (cudaStream_t)ctx->stream>>>(a);
  e = cudaGetLastError();
  if (e != cudaSuccess) return kva_seterr(KVA_ECUDA, "merge_states kernel launch: %s", cudaGetErrorString(e));
  return 0;
}
