/* The bench's backend-ops layer: memory, copies, one timed kva_attention
 * call and the memory ceiling, per backend. CPU: host memory (2 MiB aligned,
 * transparent huge pages advised), wall-clock timing of the synchronous call,
 * DRAM read probe on the context's thread count. CUDA: not yet wired into the
 * tool; the variant belongs under KVA_HAVE_CUDA (device memory, cudaMemcpy,
 * CUDA-event timing, device-to-device copy ceiling). */
#include "bench.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

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
    snprintf(err, errn,
             "--backend cuda: %d device%s visible, but CUDA timing is not yet implemented "
             "in the bench (planned: CUDA events, device-to-device copy ceiling)",
             n, n == 1 ? "" : "s");
    return KVA_EUNSUPPORTED;
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
