/* kva_cache_write: the engine's append step. n new tokens' K/V rows go into
 * caller-owned pools [num_blocks, KVH, block_size, D] at slots
 * block * block_size + row: converted for float pools, quantized (the
 * kva_quantize row of src/core/quant.c) for MLX-affine ones. Validation here,
 * then the CPU write below or the CUDA kernel (src/cuda/cache_write.cu).
 * Traffic: reads n*KVH*(Dk+Dv) input values, writes the same rows in the
 * pools' formats; nothing else in the pools is touched. kva_cache_write_ex
 * can rotate rows first (H_D in f32, src/core/hadamard.c). */
#include "core/backend.h"
#include "core/hadamard.h"
#include "core/quant.h"
#include "cpu/threadpool.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Below this many input elements the write runs on the calling thread (the
 * pool's wake-up costs more than the work). Tuning only. */
#define KVA_CACHE_WRITE_PARALLEL_MIN (1 << 16)

/* One pool and the rows written into it. */
typedef struct cw_operand {
  const kva_kv *pool;    /* [num_blocks, KVH, block_size, D] */
  const kva_tensor *src; /* [n, KVH, D] f32/f16/bf16 */
  int64_t D;
  int rotate;            /* store H_D of each row (kva_cache_write_ex) */
} cw_operand;

typedef struct cw_job {
  cw_operand op[2]; /* K, V */
  const int32_t *slots;
  int64_t n, KVH, block_size;
} cw_job;

/* The src operand's [n, KVH, D] shape and the pool's KVH and D. */
static int check_rows(const kva_tensor *t, const char *name, int64_t n, int64_t KVH, int64_t D,
                      const char *pool) {
  int rc = kva_check_tensor(t, name, KVA_DT_FLOAT, 3, false);
  if (rc) return rc;
  if (t->shape[0] != n)
    return kva_seterr(KVA_ESHAPE, "%s.shape[0] = %lld != n = %lld (tokens)", name, (long long)t->shape[0],
                      (long long)n);
  if (t->shape[1] != KVH)
    return kva_seterr(KVA_ESHAPE, "%s.shape[1] = %lld != %s KV heads = %lld", name, (long long)t->shape[1], pool,
                      (long long)KVH);
  if (t->shape[2] != D)
    return kva_seterr(KVA_ESHAPE, "%s.shape[2] = %lld != %s head dim = %lld", name, (long long)t->shape[2], pool,
                      (long long)D);
  return 0;
}

/* Every written array of a pool (data, and scales/biases when quantized)
 * must lie apart from the inputs. */
static int check_pool_apart(const kva_kv *pool, const char *pname, const kva_tensor *const *ins,
                            const char *const *in_names, int nins) {
  const kva_tensor *parts[3] = {&pool->data, &pool->scales, &pool->biases};
  static const char *part_names[3] = {"data", "scales", "biases"};
  const int nparts = pool->bits ? 3 : kva_kv_scaled(pool) && kva_fp8_scales_per_row(&pool->scales) ? 2 : 1;
  for (int p = 0; p < nparts; ++p)
    for (int i = 0; i < nins; ++i)
      if (kva_tensors_overlap(parts[p], ins[i]))
        return kva_seterr(KVA_EINVAL, "%s.%s overlaps %s (the pools are outputs)", pname, part_names[p],
                          in_names[i]);
  return 0;
}

/* Token i's row of KV head h written into its slot of one pool. */
static void write_row(const cw_operand *o, int64_t i, int64_t h, int64_t blk, int64_t row) {
  const kva_kv *pool = o->pool;
  const kva_tensor *src = o->src;
  const char *s = (const char *)src->data + i * src->stride[0] + h * src->stride[1];
  kva_dtype sdt = src->dtype;
  float rot[KVA_HADAMARD_MAX_DIM];
  if (o->rotate) { /* the rotated row in f32, then written as an f32 row */
    const int64_t ssz = (int64_t)kva_dtype_size(sdt);
    for (int64_t e = 0; e < o->D; ++e) rot[e] = kva_load_f(s + e * ssz, sdt);
    kva_hadamard_row_f32(rot, o->D);
    s = (const char *)rot;
    sdt = KVA_F32;
  }
  if (pool->bits) {
    kva_quantize_row(s, sdt, o->D, pool->bits, pool->group_size,
                     (uint32_t *)kva_at4(&pool->data, blk, h, row, 0), kva_at4(&pool->scales, blk, h, row, 0),
                     kva_at4(&pool->biases, blk, h, row, 0), pool->scales.dtype);
    return;
  }
  if (kva_is_fp8(pool->data.dtype)) { /* per-row scales computed and stored, or the fixed scale (1 without) */
    float scale = 1.0f;
    char *sp = pool->scales.data ? kva_at4(&pool->scales, blk, h, row, 0) : NULL;
    if (sp && kva_fp8_scales_per_row(&pool->scales)) {
      scale = kva_fp8_row_scale(s, sdt, o->D, pool->data.dtype);
      memcpy(sp, &scale, 4);
    } else if (sp) {
      memcpy(&scale, sp, 4);
    }
    kva_fp8_quantize_row(s, sdt, o->D, pool->data.dtype, scale, (uint8_t *)kva_at4(&pool->data, blk, h, row, 0));
    return;
  }
  char *d = kva_at4(&pool->data, blk, h, row, 0);
  const int64_t ssz = (int64_t)kva_dtype_size(sdt), dsz = (int64_t)kva_dtype_size(pool->data.dtype);
  for (int64_t e = 0; e < o->D; ++e) kva_store_f(d + e * dsz, pool->data.dtype, kva_load_f(s + e * ssz, sdt));
}

/* Task t: every token of KV head t % KVH of operand t / KVH (K, V), in token
 * order, so two tokens naming one slot leave the later one, as a sequential
 * write would. */
static void cw_task(void *arg, long task, int worker) {
  (void)worker;
  const cw_job *j = (const cw_job *)arg;
  const cw_operand *o = &j->op[task / j->KVH];
  const int64_t h = task % j->KVH;
  for (int64_t i = 0; i < j->n; ++i) {
    const int32_t slot = j->slots[i];
    if (slot < 0) continue;
    write_row(o, i, h, slot / j->block_size, slot % j->block_size);
  }
}

static int cpu_cache_write(kva_context *ctx, const cw_job *j) {
  const int64_t nslots = j->op[0].pool->data.shape[0] * j->block_size;
  for (int64_t i = 0; i < j->n; ++i)
    if (j->slots[i] >= nslots)
      return kva_seterr(KVA_EINVAL, "slots[%lld] = %d is out of range: the pools hold num_blocks * block_size = "
                        "%lld slots (negative = skip)", (long long)i, j->slots[i], (long long)nslots);
  /* fp8 pools with fixed (read) scales: each one a written row uses is finite and > 0 */
  for (int w = 0; w < 2; ++w) {
    const kva_kv *pool = j->op[w].pool;
    if (!kva_is_fp8(pool->data.dtype) || !pool->scales.data || kva_fp8_scales_per_row(&pool->scales)) continue;
    for (int64_t i = 0; i < j->n; ++i) {
      if (j->slots[i] < 0) continue;
      for (int64_t h = 0; h < j->KVH; ++h) {
        float s;
        memcpy(&s, kva_at4(&pool->scales, j->slots[i] / j->block_size, h, j->slots[i] % j->block_size, 0), 4);
        if (!(s > 0.0f) || s == INFINITY)
          return kva_seterr(KVA_EINVAL, "%s.scales: the fixed scale of slot %d, KV head %lld is %g (fp8 scales must be "
                            "finite and > 0)", w ? "v_pool" : "k_pool", j->slots[i], (long long)h, (double)s);
      }
    }
  }
  const long ntasks = (long)(2 * j->KVH);
  const int64_t work = j->n * j->KVH * (j->op[0].D + j->op[1].D);
  if (ctx->pool && ctx->threads > 1 && work >= KVA_CACHE_WRITE_PARALLEL_MIN) {
    kva_threadpool_run(ctx->pool, cw_task, (void *)j, ntasks);
  } else {
    for (long t = 0; t < ntasks; ++t) cw_task((void *)j, t, 0);
  }
  return 0;
}

int kva_cache_write(kva_context *ctx, const kva_kv *k_pool, const kva_kv *v_pool, const kva_tensor *k,
                    const kva_tensor *v, const int32_t *slots, int64_t n) {
  return kva_cache_write_ex(ctx, k_pool, v_pool, k, v, slots, n, 0);
}

int kva_cache_write_ex(kva_context *ctx, const kva_kv *k_pool, const kva_kv *v_pool, const kva_tensor *k,
                       const kva_tensor *v, const int32_t *slots, int64_t n, unsigned flags) {
  kva_clearerr();
  if (!ctx) return kva_seterr(KVA_EINVAL, "ctx is NULL");
  if (n < 0) return kva_seterr(KVA_EINVAL, "n = %lld must be >= 0", (long long)n);
  if (flags & ~(KVA_WRITE_ROTATE_K | KVA_WRITE_ROTATE_V))
    return kva_seterr(KVA_EINVAL, "flags = 0x%x (allowed: KVA_WRITE_ROTATE_K, KVA_WRITE_ROTATE_V)", flags);
  int64_t Dk, Dv;
  int rc;
  if ((rc = kva_check_kv(k_pool, "k_pool", &Dk)) || (rc = kva_check_kv(v_pool, "v_pool", &Dv))) return rc;
  if ((flags & KVA_WRITE_ROTATE_K) && !kva_hadamard_block(Dk))
    return kva_hadamard_dim_error("flags KVA_WRITE_ROTATE_K (k_pool)", Dk);
  if ((flags & KVA_WRITE_ROTATE_V) && !kva_hadamard_block(Dv))
    return kva_hadamard_dim_error("flags KVA_WRITE_ROTATE_V (v_pool)", Dv);
  static const char *dims[3] = {"num_blocks", "KVH", "block_size"};
  for (int d = 0; d < 3; ++d)
    if (v_pool->data.shape[d] != k_pool->data.shape[d])
      return kva_seterr(KVA_ESHAPE, "v_pool.shape[%d] = %lld != k_pool.shape[%d] = %lld (%s)", d,
                        (long long)v_pool->data.shape[d], d, (long long)k_pool->data.shape[d], dims[d]);
  if (n == 0) return 0; /* nothing to write: k, v and slots are not read */
  const int64_t KVH = k_pool->data.shape[1];
  if ((rc = check_rows(k, "k", n, KVH, Dk, "k_pool")) || (rc = check_rows(v, "v", n, KVH, Dv, "v_pool"))) return rc;
  if (!slots) return kva_seterr(KVA_EINVAL, "slots is NULL (n = %lld tokens)", (long long)n);
  const kva_tensor slots_t = kva_tensor_1d((void *)(uintptr_t)slots, KVA_I32, n);
  const kva_tensor *ins[3] = {k, v, &slots_t};
  static const char *in_names[3] = {"k", "v", "slots"};
  if ((rc = check_pool_apart(k_pool, "k_pool", ins, in_names, 3)) ||
      (rc = check_pool_apart(v_pool, "v_pool", ins, in_names, 3)))
    return rc;
  /* per-row fp8 scales are written: they may not overlap themselves */
  if (kva_is_fp8(k_pool->data.dtype) && kva_fp8_scales_per_row(&k_pool->scales) &&
      (rc = kva_check_tensor(&k_pool->scales, "k_pool.scales", KVA_DT(KVA_F32), 4, false)))
    return rc;
  if (kva_is_fp8(v_pool->data.dtype) && kva_fp8_scales_per_row(&v_pool->scales) &&
      (rc = kva_check_tensor(&v_pool->scales, "v_pool.scales", KVA_DT(KVA_F32), 4, false)))
    return rc;
  cw_job j = {{{k_pool, k, Dk, (flags & KVA_WRITE_ROTATE_K) != 0}, {v_pool, v, Dv, (flags & KVA_WRITE_ROTATE_V) != 0}},
              slots, n, KVH, k_pool->data.shape[2]};
  pthread_mutex_lock(&ctx->mu); /* ctx's pool or stream (core/backend.h) */
  rc = ctx->backend == KVA_BACKEND_CUDA ? kva_cuda_cache_write_ex(ctx, k_pool, v_pool, k, v, slots, n, flags)
                                        : cpu_cache_write(ctx, &j);
  pthread_mutex_unlock(&ctx->mu);
  return rc;
}
