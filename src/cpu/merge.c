/* kva_merge_states on the CPU.
 *   math: per row (b, h, i), the parts {m = lse_r (natural log), l = 1,
 *         o = o_r} fold left in order r = 0..R-1 with kva_softmax_merge
 *         (core/softmax_state.h, the in-call split merge's math); out =
 *         kva_softmax_out, lse = kva_softmax_lse.
 *   memory: reads R * (Dv + 1) elements per row, writes Dv (+ 1).
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

static void merge_rows(void *arg, long task, int worker) {
  (void)worker;
  const merge_run *run = (const merge_run *)arg;
  const kva_merge_problem *m = run->m;
  const int D = (int)m->Dv;
  float acc[KVA_STATE_FLOATS(KVA_MAX_HEAD_DIM)], part[KVA_STATE_FLOATS(KVA_MAX_HEAD_DIM)];
  const int64_t r_end = (task + 1) * MERGE_ROWS < run->rows ? (task + 1) * MERGE_ROWS : run->rows;
  for (int64_t row = task * MERGE_ROWS; row < r_end; ++row) {
    const int64_t i = row % m->L, h = row / m->L % m->H, b = row / m->L / m->H;
    kva_softmax_init(acc, D);
    for (int64_t r = 0; r < m->R; ++r) {
      const float z = lse_at(&m->lse[r], b, h, i);
      if (z == -INFINITY) continue; /* empty part: its o_r is never read */
      part[0] = m->base2 ? z * (float)KVA_LN2_F : z;
      part[1] = 1.0f;
      for (int d = 0; d < D; ++d) part[2 + d] = kva_load_f(kva_at4(&m->o[r], b, h, i, d), m->o[r].dtype);
      kva_softmax_merge(acc, part, D);
    }
    for (int d = 0; d < D; ++d) kva_store_f(kva_at4(m->out, b, h, i, d), m->out->dtype, kva_softmax_out(acc, d));
    if (m->lse_out) {
      const float lse = kva_softmax_lse(acc);
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
