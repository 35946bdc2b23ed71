/* The bench's CUDA L2 flush: a read-only pass over a scratch buffer, queued
 * ahead of each timed call (tools/backend.c, cuda_time_call).
 *
 * Why a read and not a memset: both keep the device busy while the host
 * enqueues the start event and the call (so the events time the kernels
 * alone) and both evict the previous call's lines from the 60 MB L2, but a
 * memset leaves ~60 MB of dirty lines there, and their write-back to DRAM
 * then competes with the timed call's reads. A decode step's previous work
 * (the layer's GEMMs, the previous layer's attention) mostly reads; this
 * pass leaves clean lines, as that work does.
 *
 * Traffic: `bytes` read once with 16-byte loads, grid-stride; one 4-byte
 * store, only if the XOR of everything read equals a value the caller picks
 * per call (so the compiler cannot drop the loads; the store almost never
 * happens). Launch: 4 blocks of 256 threads per SM. */
#include <cuda_runtime.h>

#include "bench_cuda.h"

__global__ void kb_read_flush_kernel(const uint4 *__restrict__ p, size_t n, unsigned key, unsigned *sink) {
  unsigned acc = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == key) *sink = acc;
}

extern "C" int kb_cuda_read_flush(const void *buf, size_t bytes, unsigned key, void *sink, int sms) {
  const size_t n = bytes / sizeof(uint4);
  if (n == 0) return 0;
  kb_read_flush_kernel<<<4 * (sms > 0 ? sms : 1), 256>>>((const uint4 *)buf, n, key, (unsigned *)sink);
  return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
