/* CUDA pieces of the bench built by nvcc (tools/cuda_flush.cu). */
#ifndef KVATTN_TOOLS_BENCH_CUDA_H
#define KVATTN_TOOLS_BENCH_CUDA_H
#include <stddef.h>
#ifdef __cplusplus
extern "C" {
#endif
/* Queues a read of `bytes` of device memory at `buf` on the default stream
 * (the L2 flush ahead of a timed call); `sink`: 4 device bytes, written only
 * when the XOR of the data equals `key`. `sms`: the device's SM count (grid
 * size). Returns 0, or -1 when the launch failed. */
int kb_cuda_read_flush(const void *buf, size_t bytes, unsigned key, void *sink, int sms);
#ifdef __cplusplus
}
#endif
#endif
