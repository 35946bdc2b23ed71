/* kva_hadamard: y = H_D x on the last dim (src/core/hadamard.c's f32
 * transform per row). Validation here, then the CPU rows below or the CUDA
 * kernel (src/cuda/hadamard.cu). Traffic: reads x once, writes y once. */
#include "api/hadamard.h"
#include "core/backend.h"
#include "core/hadamard.h"
#include "cpu/threadpool.h"

#include <string.h>

/* Below this many elements the CPU runs the rows on the calling thread. Tuning only. */
#define KVA_HADAMARD_PARALLEL_MIN (1 << 16)

/* The rows of x and y as a rank-4 iteration [n0, n1, n2] over rows of D. */
typedef struct hd_job {
  const kva_tensor *x, *y;
  int64_t n[3], sx[3], sy[3], D;
} hd_job;

static void hd_rows(const hd_job *j, int64_t r0, int64_t r1) {
  float buf[KVA_HADAMARD_MAX_DIM];
  const int64_t xs = (int64_t)kva_dtype_size(j->x->dtype), ys = (int64_t)kva_dtype_size(j->y->dtype);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t c = r % j->n[2], b = r / j->n[2] % j->n[1], a = r / j->n[2] / j->n[1];
    const char *xr = (const char *)j->x->data + a * j->sx[0] + b * j->sx[1] + c * j->sx[2];
    char *yr = (char *)j->y->data + a * j->sy[0] + b * j->sy[1] + c * j->sy[2];
    for (int64_t d = 0; d < j->D; ++d) buf[d] = kva_load_f(xr + d * xs, j->x->dtype);
    kva_hadamard_row_f32(buf, j->D);
    for (int64_t d = 0; d < j->D; ++d) kva_store_f(yr + d * ys, j->y->dtype, buf[d]);
  }
}

#define HD_TASK_ROWS 64
static void hd_task(void *arg, long task, int worker) {
  (void)worker;
  const hd_job *j = (const hd_job *)arg;
  const int64_t rows = j->n[0] * j->n[1] * j->n[2], r0 = (int64_t)task * HD_TASK_ROWS;
  hd_rows(j, r0, r0 + HD_TASK_ROWS < rows ? r0 + HD_TASK_ROWS : rows);
}

static void hd_split(const kva_tensor *t, int64_t n[3], int64_t s[3]) {
  const int lead = t->ndim - 1;
  for (int d = 0; d < 3; ++d) {
    const int src = d - (3 - lead); /* leading dims right-aligned into 3 */
    n[d] = src >= 0 ? t->shape[src] : 1;
    s[d] = src >= 0 ? t->stride[src] : 0;
  }
}

int kva_hadamard_run(kva_context *ctx, const kva_tensor *x, const kva_tensor *y) {
  if (ctx->backend == KVA_BACKEND_CUDA) return kva_cuda_hadamard(ctx, x, y);
  hd_job j;
  j.x = x;
  j.y = y;
  j.D = x->shape[x->ndim - 1];
  hd_split(x, j.n, j.sx);
  hd_split(y, j.n, j.sy);
  const int64_t rows = j.n[0] * j.n[1] * j.n[2];
  if (ctx->pool && ctx->threads > 1 && rows * j.D >= KVA_HADAMARD_PARALLEL_MIN)
    kva_threadpool_run(ctx->pool, hd_task, &j, (long)((rows + HD_TASK_ROWS - 1) / HD_TASK_ROWS));
  else
    hd_rows(&j, 0, rows);
  return 0;
}

/* y is x exactly (in place): same data, dtype, rank and strides. */
static int same_view(const kva_tensor *x, const kva_tensor *y) {
  if (x->data != y->data || x->dtype != y->dtype || x->ndim != y->ndim) return 0;
  for (int d = 0; d < x->ndim; ++d)
    if (x->stride[d] != y->stride[d] && x->shape[d] > 1) return 0;
  return 1;
}

int kva_hadamard(kva_context *ctx, const kva_tensor *x, kva_tensor *y) {
  kva_clearerr();
  if (!ctx) return kva_seterr(KVA_EINVAL, "ctx is NULL");
  int rc;
  if ((rc = kva_check_tensor(x, "x", KVA_DT_FLOAT, 0, false)) || (rc = kva_check_tensor(y, "y", KVA_DT_FLOAT, 0, false)))
    return rc;
  if (y->ndim != x->ndim)
    return kva_seterr(KVA_ESHAPE, "y has rank %d, x rank %d (the same shape)", y->ndim, x->ndim);
  for (int d = 0; d < x->ndim; ++d)
    if (y->shape[d] != x->shape[d])
      return kva_seterr(KVA_ESHAPE, "y.shape[%d] = %lld != x.shape[%d] = %lld", d, (long long)y->shape[d], d,
                        (long long)x->shape[d]);
  const int64_t D = x->shape[x->ndim - 1];
  if (!kva_hadamard_block(D)) return kva_hadamard_dim_error("x", D);
  if (!same_view(x, y) && kva_tensors_overlap(x, y))
    return kva_seterr(KVA_EINVAL, "y overlaps x (in place needs y == x: the same data, dtype and strides)");
  pthread_mutex_lock(&ctx->mu); /* ctx's pool or stream (core/backend.h) */
  rc = kva_hadamard_run(ctx, x, y);
  pthread_mutex_unlock(&ctx->mu);
  return rc;
}
