/* The bench's backend-ops layer: memory, copies, one timed kva_attention
 * call and the memory ceiling, per backend. CPU: host memory (2 MiB aligned,
 * transparent huge pages advised), wall-clock timing of the synchronous call,
 * DRAM read probe on the context's thread count. CUDA (when built with
 * nvcc): device memory, cudaMemcpy, CUDA-event timing of each call on the
 * context's stream, and a device-to-device copy as the ceiling (bytes read
 * plus bytes written, best of several 1 GiB copies). */
#include "bench.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#ifdef KVA_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "bench_cuda.h"
#endif

#define CPU_ALIGN (2u << 20) /* huge-page size: fewer TLB misses over the rotation */

/* ------------------------------------------------------------- CPU */
static void *cpu_alloc(kb_backend *be, size_t bytes) {
  (void)be;
  size_t rounded = (bytes + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN;
  void *p = aligned_alloc(CPU_ALIGN, rounded ? rounded : CPU_ALIGN);
  if (p) madvise(p, rounded, MADV_HUGEPAGE); /* advice only: failure is harmless */
  return p;
}

static void cpu_release(kb_backend *be, void *p, size_t bytes) {
  (void)be, (void)bytes;
  free(p);
}

static int cpu_copy(kb_backend *be, void *dst, const void *src, size_t bytes) {
  (void)be;
  memcpy(dst, src, bytes);
  return 0;
}

static int cpu_time_call(kb_backend *be, const kva_tensor *q, const kva_kv_view *kv,
                         const kva_attn_params *p, kva_tensor *out, double *us) {
  double t0 = kb_now();
  int rc = kva_attention(be->ctx, q, kv, p, out, NULL, 0);
  *us = (kb_now() - t0) * 1e6;
  return rc;
}

static int cpu_ceiling(kb_backend *be, const kb_opts *o, double *gbps, char *desc, size_t n) {
  const char *isa = "?";
  int rc = kb_probe_read_bw(be->threads, (size_t)o->bw_bytes, o->bw_passes, gbps, &isa);
  if (rc < 0) return rc;
  snprintf(desc, n, "DRAM read bandwidth: %.1f GB/s (%d thread%s summing %.1f GiB, %s, best of %d)",
           *gbps, be->threads, be->threads == 1 ? "" : "s", o->bw_bytes / KB_GIB, isa,
           o->bw_passes);
  return 0;
}

static void cpu_destroy(kb_backend *be) {
  kva_context_destroy(be->ctx);
  be->ctx = NULL;
}


/* ------------------------------------------------------------- CUDA */
#ifdef KVA_HAVE_CUDA
#define CUDA_CEILING_BYTES (1ull << 30)
#define CUDA_CEILING_PASSES 10

#define CUDA_FLUSH_READ_BYTES (128ull << 20) /* read ahead of each timed call: ~35 us of device work */
#define CUDA_FLUSH_MEMSET_BYTES (64ull << 20) /* --cuda-flush memset: ~30 us */

typedef struct cuda_state {
  cudaEvent_t start, stop;
  void *busy; /* CUDA_FLUSH_READ_BYTES of scratch (+ 4 bytes: the read's sink) */
  bool memset_flush;
  int sms;
  unsigned calls;
} cuda_state;

static void *cuda_alloc(kb_backend *be, size_t bytes) {
  (void)be;
  void *p = NULL;
  return cudaMalloc(&p, bytes ? bytes : 1) == cudaSuccess ? p : NULL;
}

static void cuda_release(kb_backend *be, void *p, size_t bytes) {
  (void)be, (void)bytes;
  cudaFree(p);
}

static int cuda_status(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return 0;
  fprintf(stderr, "kvattn bench: %s: %s\n", what, cudaGetErrorString(e));
  return KVA_ECUDA;
}

static int cuda_copy_in(kb_backend *be, void *dst, const void *src, size_t bytes) {
  (void)be;
  return cuda_status(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy host to device");
}
static int cuda_copy_out(kb_backend *be, void *dst, const void *src, size_t bytes) {
  (void)be;
  return cuda_status(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy device to host");
}
static int cuda_replicate(kb_backend *be, void *dst, const void *src, size_t bytes) {
  (void)be;
  return cuda_status(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy device to device");
}

/* Device time of one call: a flush queued first keeps the device busy while
 * the host enqueues the start event and the call, so the events time the
 * kernels alone, as in a CUDA graph or a decode loop that enqueues ahead, not
 * the host's launch overhead (without it the start event fires at once and
 * the call's host time counts too), and it evicts the previous call's lines
 * from the 60 MB L2. By default the flush reads CUDA_FLUSH_READ_BYTES
 * (tools/cuda_flush.cu: clean lines, as the reads of a decode step's other
 * work leave them); --cuda-flush memset writes CUDA_FLUSH_MEMSET_BYTES, whose
 * dirty lines are written back while the call runs (measured 2026-12-01:
 * BENCHMARKS.md). */
static int cuda_time_call(kb_backend *be, const kva_tensor *q, const kva_kv_view *kv,
                          const kva_attn_params *p, kva_tensor *out, double *us) {
  cuda_state *st = (cuda_state *)be->priv;
  ++st->calls;
  if (st->busy && st->memset_flush)
    cudaMemsetAsync(st->busy, (int)(st->calls & 0xff), CUDA_FLUSH_MEMSET_BYTES, 0);
  else if (st->busy)
    kb_cuda_read_flush(st->busy, CUDA_FLUSH_READ_BYTES, st->calls * 2654435761u,
                       (char *)st->busy + CUDA_FLUSH_READ_BYTES, st->sms);
  cudaEventRecord(st->start, 0);
  int rc = kva_attention(be->ctx, q, kv, p, out, NULL, 0);
  cudaEventRecord(st->stop, 0);
  int crc = cuda_status(cudaEventSynchronize(st->stop), "cudaEventSynchronize");
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, st->start, st->stop);
  *us = (double)ms * 1e3;
  return rc < 0 ? rc : crc;
}

static int cuda_ceiling(kb_backend *be, const kb_opts *o, double *gbps, char *desc, size_t n) {
  (void)o;
  cuda_state *st = (cuda_state *)be->priv;
  void *a = cuda_alloc(be, CUDA_CEILING_BYTES), *b = cuda_alloc(be, CUDA_CEILING_BYTES);
  int rc = a && b ? 0 : KVA_ENOMEM;
  double best = 0.0;
  for (int i = 0; rc == 0 && i <= CUDA_CEILING_PASSES; ++i) {
    cudaEventRecord(st->start, 0);
    rc = cuda_status(cudaMemcpyAsync(b, a, CUDA_CEILING_BYTES, cudaMemcpyDeviceToDevice, 0), "copy ceiling");
    cudaEventRecord(st->stop, 0);
    if (rc == 0) rc = cuda_status(cudaEventSynchronize(st->stop), "copy ceiling");
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, st->start, st->stop);
    const double g = 2.0 * (double)CUDA_CEILING_BYTES / ((double)ms * 1e6); /* read + write */
    if (i > 0 && g > best) best = g; /* pass 0 warms up */
  }
  cuda_release(be, a, 0);
  cuda_release(be, b, 0);
  if (rc < 0) return rc;
  *gbps = best;
  snprintf(desc, n, "device-to-device copy bandwidth: %.0f GB/s (read + write of %.1f GiB, best of %d)", best,
           CUDA_CEILING_BYTES / KB_GIB, CUDA_CEILING_PASSES);
  return 0;
}

static void cuda_destroy(kb_backend *be) {
  cuda_state *st = (cuda_state *)be->priv;
  if (st) {
    cudaEventDestroy(st->start);
    cudaEventDestroy(st->stop);
    if (st->busy) cudaFree(st->busy);
    free(st);
  }
  kva_context_destroy(be->ctx);
  be->ctx = NULL;
}

static int cuda_open(const kb_opts *o, kb_backend *be, char *err, size_t errn) {
  kva_context_opts co;
  memset(&co, 0, sizeof co);
  co.backend = KVA_BACKEND_CUDA;
  int rc = kva_context_create(&be->ctx, &co);
  if (rc < 0) {
    snprintf(err, errn, "kva_context_create(cuda): %s", kva_last_error());
    return rc;
  }
  cuda_state *st = (cuda_state *)calloc(1, sizeof *st);
  if (!st || cudaEventCreate(&st->start) != cudaSuccess || cudaEventCreate(&st->stop) != cudaSuccess) {
    free(st);
    kva_context_destroy(be->ctx);
    snprintf(err, errn, "--backend cuda: could not create CUDA events");
    return KVA_ECUDA;
  }
  st->memset_flush = o->cuda_flush_memset;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&st->sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    st->sms = 1;
  if (cudaMalloc(&st->busy, CUDA_FLUSH_READ_BYTES + 4) != cudaSuccess) st->busy = NULL; /* then host time counts too */
  else if (cudaMemset(st->busy, 0x5a, CUDA_FLUSH_READ_BYTES + 4) != cudaSuccess) { /* defined contents to read */
    cudaFree(st->busy);
    st->busy = NULL;
  }
  be->priv = st;
  be->name = "cuda";
  be->kind = KVA_BACKEND_CUDA;
  be->threads = 1;
  be->host_threads = (int)sysconf(_SC_NPROCESSORS_ONLN); /* the device computes; the host fills and checks */
  if (be->host_threads < 1) be->host_threads = 1;
  if (be->host_threads > KB_MAX_THREADS) be->host_threads = KB_MAX_THREADS;
  be->host_memory = false;
  be->alloc = cuda_alloc;
  be->release = cuda_release;
  be->copy_in = cuda_copy_in;
  be->copy_out = cuda_copy_out;
  be->replicate = cuda_replicate;
  be->time_call = cuda_time_call;
  be->ceiling = cuda_ceiling;
  be->destroy = cuda_destroy;
  return 0;
}
#endif

int kb_backend_open(const kb_opts *o, kb_backend *be, char *err, size_t errn) {
  memset(be, 0, sizeof *be);
  if (o->backend == KVA_BACKEND_CUDA) {
    int n = kva_cuda_device_count();
    if (n <= 0) {
      snprintf(err, errn,
               "--backend cuda: no CUDA device (%s); kva_cuda_device_count() = %d",
#ifdef KVA_HAVE_CUDA
               "built with CUDA, but no GPU is visible",
#else
               "this build has no CUDA backend: nvcc was not found at build time",
#endif
               n);
      return KVA_ENODEVICE;
    }
#ifdef KVA_HAVE_CUDA
    return cuda_open(o, be, err, errn);
#else
    return KVA_ENODEVICE; /* unreachable: no device without the backend */
#endif
  }
  kva_context_opts co;
  memset(&co, 0, sizeof co);
  co.backend = KVA_BACKEND_CPU;
  co.threads = o->threads;
  int rc = kva_context_create(&be->ctx, &co);
  if (rc < 0) {
    snprintf(err, errn, "kva_context_create(threads=%d): %s", o->threads, kva_last_error());
    return rc;
  }
  be->name = "cpu";
  be->kind = KVA_BACKEND_CPU;
  be->threads = kva_context_threads(be->ctx);
  if (be->threads < 1) be->threads = 1;
  be->host_threads = be->threads;
  be->host_memory = true;
  be->alloc = cpu_alloc;
  be->release = cpu_release;
  be->copy_in = cpu_copy;
  be->copy_out = cpu_copy;
  be->replicate = cpu_copy;
  be->time_call = cpu_time_call;
  be->ceiling = cpu_ceiling;
  be->destroy = cpu_destroy;
  return 0;
}
