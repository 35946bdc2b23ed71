/* kva_merge_states on the CPU.
 *   math: per row (b, h, i), the parts {m = lse_r (natural log), l = 1,
 *         o = o_r} fold left in order r = 0..R-1 with kva_softmax_merge
 *         (core/softmax_state.h, the in-call split merge's math); out =
 *         kva_softmax_out, lse = kva_softmax_lse.
 *   memory: reads R * (Dv + 1) elements per row, writes Dv (+ 1).
 *   loops: one per part dtype over a row (f32, bf16 inline; f16 through
 *         kva_load_f), the output stored per dtype likewise.
 *   threads: the context's pool over groups of MERGE_ROWS rows. A row's
 *         parts are read before its outputs are written, so out (lse_out)
 *         may be exactly one of the parts. */
#include "core/backend.h"
#include "core/softmax_state.h"
#include "cpu/threadpool.h"

#define MERGE_ROWS 16 /* rows per task (tuning only) */

typedef struct merge_run {
  const kva_merge_problem *m;
  int64_t rows;
} merge_run;

static float lse_at(const kva_tensor *t, int64_t b, int64_t h, int64_t i) {
  return *(const float *)((const char *)t->data + b * t->stride[0] + h * t->stride[1] + i * t->stride[2]);
}

/* bf16 bits to f32 (exact: the high half of an f32). */
static inline float bf16_bits_f32(uint16_t b) {
  union {
    uint32_t u;
    float f;
  } x = {(uint32_t)b << 16};
  return x.f;
}

/* acc[d] = acc[d] * a1 + o[d] * a2 over one part's row (innermost contiguous):
 * kva_softmax_merge's update of the o elements, one loop per dtype. */
static void fold_row(float *acc, const char *row, kva_dtype dt, int D, float a1, float a2) {
  if (dt == KVA_F32) {
    const float *x = (const float *)row;
    for (int d = 0; d < D; ++d) acc[d] = acc[d] * a1 + x[d] * a2;
  } else if (dt == KVA_BF16) {
    const uint16_t *x = (const uint16_t *)row;
    for (int d = 0; d < D; ++d) acc[d] = acc[d] * a1 + bf16_bits_f32(x[d]) * a2;
  } else {
    for (int d = 0; d < D; ++d) acc[d] = acc[d] * a1 + kva_load_f(row + (size_t)d * kva_dtype_size(dt), dt) * a2;
  }
}

static void merge_rows(void *arg, long task, int worker) {
  (void)worker;
  const merge_run *run = (const merge_run *)arg;
  const kva_merge_problem *m = run->m;
  const int D = (int)m->Dv;
  float acc[KVA_MAX_HEAD_DIM];
  const int64_t r_end = (task + 1) * MERGE_ROWS < run->rows ? (task + 1) * MERGE_ROWS : run->rows;
  for (int64_t row = task * MERGE_ROWS; row < r_end; ++row) {
    const int64_t i = row % m->L, h = row / m->L % m->H, b = row / m->L / m->H;
    /* the state {mx, l, acc} (core/softmax_state.h), parts {lse_r, 1, o_r} folded in order */
    float mx = -INFINITY, l = 0.0f;
    for (int d = 0; d < D; ++d) acc[d] = 0.0f;
    for (int64_t r = 0; r < m->R; ++r) {
      float z = lse_at(&m->lse[r], b, h, i);
      if (z == -INFINITY) continue; /* empty part: its o_r is never read */
      if (m->base2) z *= (float)KVA_LN2_F;
      float mn, a1, a2;
      kva_softmax_factors(mx, z, &mn, &a1, &a2);
      mx = mn;
      l = l * a1 + a2;
      fold_row(acc, kva_at4(&m->o[r], b, h, i, 0), m->o[r].dtype, D, a1, a2);
    }
    char *orow = kva_at4(m->out, b, h, i, 0);
    const int has = l > 0.0f || l != l; /* kva_softmax_out: 0 for a row without any part */
    if (m->out->dtype == KVA_F32)
      for (int d = 0; d < D; ++d) ((float *)orow)[d] = has ? acc[d] / l : 0.0f;
    else
      for (int d = 0; d < D; ++d)
        kva_store_f(orow + (size_t)d * kva_dtype_size(m->out->dtype), m->out->dtype, has ? acc[d] / l : 0.0f);
    if (m->lse_out) {
      const float lse = mx == -INFINITY ? -INFINITY : mx + logf(l);
      *(float *)((char *)m->lse_out->data + b * m->lse_out->stride[0] + h * m->lse_out->stride[1] +
                 i * m->lse_out->stride[2]) = m->base2 ? lse * KVA_LOG2E_F : lse;
    }
  }
}

int kva_cpu_merge_states(kva_context *ctx, const kva_merge_problem *m) {
  merge_run run = {m, m->B * m->H * m->L};
  kva_threadpool_run(ctx->pool, merge_rows, &run, (long)((run.rows + MERGE_ROWS - 1) / MERGE_ROWS));
  return 0;
}
