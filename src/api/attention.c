/* kva_attention: argument validation into a kva_problem, the path selector,
 * workspace handling and backend dispatch; plus the context lifecycle. */
#include "api/attention.h"
#include "api/hadamard.h"
#include "core/backend.h"
#include "core/hadamard.h"
#include "cpu/threadpool.h"
#include "paged/paged.h"
#include "paged/source.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static const int64_t supported_dims[] = {64, 80, 96, 128, 192, 256, 512};

int kva_head_dim_supported(int64_t d) {
  for (size_t i = 0; i < sizeof supported_dims / sizeof supported_dims[0]; ++i)
    if (supported_dims[i] == d) return 1;
  return 0;
}

kva_attn_params kva_attn_defaults(void) {
  kva_attn_params p;
  memset(&p, 0, sizeof p);
  return p;
}

/* KVA_MASK_TREE: mask.array is u32 [B or 1, L, ceil(L / 32)] packed bits
 * (innermost contiguous), L <= KVA_TREE_MAX_ROWS; p->mask_stride[0..2] get
 * its byte strides (0 for a broadcast batch dim). Host bits (CPU) at
 * j >= L are KVA_EINVAL naming the row; device bits are not read. */
static int check_tree(kva_problem *p, kva_backend backend) {
  const kva_tensor *a = &p->mask.array;
  if (p->L > KVA_TREE_MAX_ROWS)
    return kva_seterr(KVA_EUNSUPPORTED, "mask.kind = KVA_MASK_TREE takes at most %d query rows, got L = %lld",
                      KVA_TREE_MAX_ROWS, (long long)p->L);
  int rc = kva_check_tensor(a, "mask.array (tree bits)", KVA_DT(KVA_U32), 3, true);
  if (rc) return rc;
  const int64_t W = (p->L + 31) / 32;
  if ((a->shape[0] != p->B && a->shape[0] != 1) || a->shape[1] != p->L || a->shape[2] != W)
    return kva_seterr(KVA_ESHAPE, "mask.array (tree bits) must be u32 [B or 1, L, ceil(L/32)] = [%lld, %lld, %lld], "
                      "got [%lld, %lld, %lld]", (long long)p->B, (long long)p->L, (long long)W,
                      (long long)a->shape[0], (long long)a->shape[1], (long long)a->shape[2]);
  p->mask_stride[0] = a->shape[0] == 1 ? 0 : a->stride[0];
  p->mask_stride[1] = a->stride[1];
  p->mask_stride[2] = a->stride[2];
  p->mask_stride[3] = 0;
  if (backend != KVA_BACKEND_CPU || p->L % 32 == 0) return 0;
  const uint32_t high = ~0u << (p->L % 32); /* bits of the last word at j >= L */
  for (int64_t b = 0; b < a->shape[0]; ++b)
    for (int64_t i = 0; i < p->L; ++i) {
      const uint32_t w = *(const uint32_t *)((const char *)a->data + b * a->stride[0] + i * a->stride[1] +
                                             (W - 1) * a->stride[2]);
      if (w & high)
        return kva_seterr(KVA_EINVAL, "mask.array (tree bits)[%lld][%lld][%lld] = 0x%08x sets bits of new tokens "
                          "j >= L = %lld", (long long)b, (long long)i, (long long)(W - 1), w, (long long)p->L);
    }
  return 0;
}

static int check_mask(kva_problem *p, kva_backend backend) {
  const kva_mask *m = &p->mask;
  if ((unsigned)m->kind > KVA_MASK_TREE)
    return kva_seterr(KVA_EINVAL, "mask.kind = %d is not a kva_mask_kind", (int)m->kind);
  if (m->window < 0)
    return kva_seterr(KVA_EINVAL, "mask.window = %d must be > 0 (or 0 for none)", m->window);
  if (m->window > 0 && !kva_causal_family(m->kind))
    return kva_seterr(KVA_EINVAL, "mask.window needs mask.kind = KVA_MASK_CAUSAL or KVA_MASK_TREE");
  if (m->segments.data) {
    if (!kva_causal_family(m->kind))
      return kva_seterr(KVA_EINVAL, "mask.segments needs mask.kind = KVA_MASK_CAUSAL or KVA_MASK_TREE");
    int rc = kva_check_tensor(&m->segments, "mask.segments", KVA_DT(KVA_I32), 2, false);
    if (rc) return rc;
    if (m->segments.shape[0] != p->B || m->segments.shape[1] != p->N)
      return kva_seterr(KVA_ESHAPE, "mask.segments must be [B, N] = [%lld, %lld], got [%lld, %lld]",
                        (long long)p->B, (long long)p->N, (long long)m->segments.shape[0],
                        (long long)m->segments.shape[1]);
  } else if (m->segments_clamp) {
    return kva_seterr(KVA_EINVAL, "mask.segments_clamp is set but mask.segments is NULL");
  }
  (void)backend;
  if (m->kind == KVA_MASK_ARRAY) {
    const kva_tensor *a = &m->array;
    int rc = kva_check_tensor(a, "mask.array", KVA_DT_FLOAT | KVA_DT(KVA_BOOL), 4, true);
    if (rc) return rc;
    const int64_t want[4] = {p->B, p->H, p->L, p->N};
    static const char *names[4] = {"B", "H", "L", "N"};
    for (int d = 0; d < 4; ++d) {
      if (a->shape[d] == want[d]) p->mask_stride[d] = a->stride[d];
      else if (a->shape[d] == 1 && d != 3) p->mask_stride[d] = 0; /* broadcast */
      else
        return kva_seterr(KVA_ESHAPE, "mask.array.shape[%d] = %lld must be %s = %lld%s", d,
                          (long long)a->shape[d], names[d], (long long)want[d], d != 3 ? " or 1" : "");
    }
  } else if (m->kind == KVA_MASK_TREE) {
    int rc = check_tree(p, backend);
    if (rc) return rc;
  } else if (m->array.data) {
    return kva_seterr(KVA_EINVAL, "mask.array is set but mask.kind is not KVA_MASK_ARRAY or KVA_MASK_TREE");
  }
  if (p->out && (m->kind == KVA_MASK_ARRAY || m->kind == KVA_MASK_TREE) && kva_tensors_overlap(p->out, &m->array))
    return kva_seterr(KVA_EINVAL, "out overlaps mask.array");
  if (p->out && m->segments.data && kva_tensors_overlap(p->out, &m->segments))
    return kva_seterr(KVA_EINVAL, "out overlaps mask.segments");
  if (m->segments.data && backend == KVA_BACKEND_CPU) {
    /* host ids: every one a sequence's rows read is 0 (text) or an image's k > 0 */
    for (int64_t b = 0; b < p->B; ++b) {
      const int64_t len = kva_problem_len(p, b);
      const char *row = (const char *)m->segments.data + b * m->segments.stride[0];
      for (int64_t t = 0; t < len; ++t) {
        const int32_t id = *(const int32_t *)(row + t * m->segments.stride[1]);
        if (id < 0)
          return kva_seterr(KVA_EINVAL, "mask.segments[%lld][%lld] = %d: segment ids are 0 (text) or > 0 (image k)",
                            (long long)b, (long long)t, id);
      }
    }
  }
  return 0;
}

/* The caller's arrays besides the tensors that a call reads: sinks [H]
 * (f32), the contiguous layout's seq_lens [B] and a block table's blocks,
 * seq_lens and first_offset (i32). Each must be aligned for its loads and
 * lie apart from out; host sinks must be finite. On CUDA the arrays are
 * device memory: only their addresses are checked (the kernels read the
 * values). */
static int check_arrays(const kva_problem *p, kva_backend backend, const kva_attn_params *params) {
  const kva_kv_view *kv = p->kv;
  kva_tensor arr[5];
  const char *names[5];
  int n = 0;
  if (params->sinks) {
    arr[n] = kva_tensor_1d((void *)(uintptr_t)params->sinks, KVA_F32, p->H);
    names[n++] = "sinks";
  }
  if (kv->layout == KVA_LAYOUT_CONTIGUOUS && kv->seq_lens) {
    arr[n] = kva_tensor_1d((void *)(uintptr_t)kv->seq_lens, KVA_I32, p->B);
    names[n++] = "seq_lens";
  }
  if (kv->layout == KVA_LAYOUT_BLOCK_TABLE) {
    const kva_block_table *t = kv->table;
    /* rows 0 .. B-1 of row_stride entries, max_blocks of them in the last */
    arr[n] = kva_tensor_1d((void *)(uintptr_t)t->blocks, KVA_I32, (t->batch - 1) * kva_block_table_stride(t) + t->max_blocks);
    names[n++] = "table.blocks";
    arr[n] = kva_tensor_1d((void *)(uintptr_t)t->seq_lens, KVA_I32, t->batch);
    names[n++] = "table.seq_lens";
    if (t->first_offset) {
      arr[n] = kva_tensor_1d((void *)(uintptr_t)t->first_offset, KVA_I32, t->batch);
      names[n++] = "table.first_offset";
    }
  }
  for (int i = 0; i < n; ++i) {
    if ((uintptr_t)arr[i].data % 4)
      return kva_seterr(KVA_EINVAL, "%s = %p is not 4-byte aligned (%s elements)", names[i], arr[i].data,
                        kva_dtype_name(arr[i].dtype));
    if (p->out && kva_tensors_overlap(p->out, &arr[i])) return kva_seterr(KVA_EINVAL, "out overlaps %s", names[i]);
  }
  if (params->sinks && backend == KVA_BACKEND_CPU)
    for (int64_t h = 0; h < p->H; ++h)
      if (isnan(params->sinks[h]) || params->sinks[h] == INFINITY)
        return kva_seterr(KVA_EINVAL, "sinks[%lld] = %g must be finite or -inf (no sink)", (long long)h,
                          (double)params->sinks[h]);
  return 0;
}

/* Host fp8 scales (CPU backend): every scale of the rows a call reads is
 * finite and > 0, found through the layout's spans (one check per span
 * when the scale row stride is 0: a broadcast scale). */
static int check_fp8_scales(const kva_problem *p) {
  const kva_kv_view *kv = p->kv;
  const kva_kv *ops[2] = {&kv->k, &kv->v};
  kva_source src;
  if (kv->layout == KVA_LAYOUT_PAGED) kva_source_paged(&src, kv);
  else if (kv->layout == KVA_LAYOUT_BLOCK_TABLE) kva_source_block_table(&src, kv);
  else kva_source_contiguous(&src, kv);
  for (int w = 0; w < 2; ++w) {
    const kva_kv *op = ops[w];
    if (op->bits || !kva_is_fp8(op->data.dtype) || !op->scales.data) continue;
    const kva_tensor *st = &op->scales;
    const bool one = st->stride[0] == 0 && st->stride[1] == 0 && st->stride[2] == 0;
    for (int64_t b = 0; b < (one ? 1 : p->B); ++b) {
      const int64_t len = one ? 1 : kva_problem_len(p, b);
      for (int64_t hk = 0; hk < (one ? 1 : p->KVH); ++hk) {
        kva_span sp;
        for (int64_t t = 0; t < len; t += sp.n) {
          src.span_at(&src, b, hk, t, len, &sp);
          const char *sc = w ? sp.vs : sp.ks;
          const int64_t rs = w ? sp.vs_rs : sp.ks_rs;
          for (int64_t r = 0; r < (rs ? sp.n : 1); ++r) {
            const float s = *(const float *)(sc + r * rs);
            if (!(s > 0.0f) || s == INFINITY)
              return kva_seterr(KVA_EINVAL, "%s.scales: the scale of sequence %lld, KV head %lld, token %lld is %g "
                                "(fp8 scales must be finite and > 0)", w ? "v" : "k", (long long)b, (long long)hk,
                                (long long)(sp.t0 + r), (double)s);
          }
        }
      }
    }
  }
  return 0;
}

int kva_problem_init(kva_problem *p, kva_backend backend, const kva_tensor *q, const kva_kv_view *kv,
                     const kva_attn_params *params, const kva_tensor *out) {
  memset(p, 0, sizeof *p);
  kva_attn_params defaults = kva_attn_defaults();
  if (!params) params = &defaults;
  if (!kv) return kva_seterr(KVA_EINVAL, "kv (the K/V view) is NULL");
  int rc = kva_check_tensor(q, "q", KVA_DT_FLOAT, 4, false);
  if (rc) return rc;
  if (out && (rc = kva_check_tensor(out, "out", KVA_DT_FLOAT, 4, false))) return rc;
  int64_t B, KVH, N, Dk, Dv;
  if (kv->layout == KVA_LAYOUT_CONTIGUOUS) {
    if ((rc = kva_check_kv(&kv->k, "k", &Dk))) return rc;
    if ((rc = kva_check_kv(&kv->v, "v", &Dv))) return rc;
    B = kv->k.data.shape[0];
    KVH = kv->k.data.shape[1];
    N = kv->k.data.shape[2];
    for (int d = 0; d < 3; ++d)
      if (kv->v.data.shape[d] != kv->k.data.shape[d])
        return kva_seterr(KVA_ESHAPE, "v.shape[%d] = %lld != k.shape[%d] = %lld", d,
                          (long long)kv->v.data.shape[d], d, (long long)kv->k.data.shape[d]);
  } else if (kv->layout == KVA_LAYOUT_PAGED) {
    if (!kv->paged) return kva_seterr(KVA_EINVAL, "kv.paged is NULL for a paged view");
    if ((rc = kva_paged_view_check(kv, &B, &KVH, &Dk, &Dv, &N))) return rc;
  } else if (kv->layout == KVA_LAYOUT_BLOCK_TABLE) {
    /* k, v are the pools; N = max_blocks * block_size (the longest possible sequence). */
    if ((rc = kva_block_table_check(kv, &B, &KVH, &Dk, &Dv, &N))) return rc;
  } else {
    return kva_seterr(KVA_EINVAL, "kv.layout = %d is not a kva_layout", (int)kv->layout);
  }
  p->q = q;
  p->out = out;
  p->kv = kv;
  p->B = B;
  p->KVH = KVH;
  p->N = N;
  p->Dk = Dk;
  p->Dv = Dv;
  p->H = q->shape[1];
  p->L = q->shape[2];
  if (q->shape[0] != B)
    return kva_seterr(KVA_ESHAPE, "q.shape[0] = %lld != batch B = %lld of the K/V view",
                      (long long)q->shape[0], (long long)B);
  if (p->H % KVH)
    return kva_seterr(KVA_ESHAPE, "q heads H = %lld is not a multiple of KV heads KVH = %lld%s",
                      (long long)p->H, (long long)KVH,
                      kv->layout == KVA_LAYOUT_BLOCK_TABLE
                          ? " (k_pool.shape[1]: pools are [num_blocks, KVH, block_size, D]; an NHD pool "
                            "[num_blocks, block_size, KVH, D] is passed with axes 1 and 2 swapped, as strides)"
                          : "");
  p->rep = p->H / KVH;
  if (q->shape[3] != Dk)
    return kva_seterr(KVA_ESHAPE, "q.shape[3] = %lld != K head dim %lld", (long long)q->shape[3],
                      (long long)Dk);
  if (!kva_head_dim_supported(Dk) || !kva_head_dim_supported(Dv))
    return kva_seterr(KVA_EUNSUPPORTED, "head dim Dk = %lld / Dv = %lld (supported: 64, 80, 96, 128, "
                      "192, 256, 512)", (long long)Dk, (long long)Dv);
  if (p->L > N)
    return kva_seterr(KVA_ESHAPE, "q rows L = %lld exceed the cache length N = %lld", (long long)p->L,
                      (long long)N);
  const int64_t want[4] = {B, p->H, p->L, Dv};
  for (int d = 0; d < 4 && out; ++d)
    if (out->shape[d] != want[d])
      return kva_seterr(KVA_ESHAPE, "out.shape[%d] = %lld, expected %lld ([B, H, L, Dv])", d,
                        (long long)out->shape[d], (long long)want[d]);
  if ((rc = check_arrays(p, backend, params))) return rc;
  if (kv->layout == KVA_LAYOUT_CONTIGUOUS) {
    p->seq_lens = kv->seq_lens;
    if (kv->seq_lens && backend == KVA_BACKEND_CPU)
      for (int64_t b = 0; b < B; ++b)
        if (kv->seq_lens[b] < p->L || kv->seq_lens[b] > N)
          return kva_seterr(KVA_ESHAPE, "seq_lens[%lld] = %d must be in [L, N] = [%lld, %lld]",
                            (long long)b, kv->seq_lens[b], (long long)p->L, (long long)N);
  } else if (kv->layout == KVA_LAYOUT_BLOCK_TABLE) {
    /* Host arrays on the CPU; on CUDA they are device memory, read (and
     * clamped) by the kernels only. */
    if (backend == KVA_BACKEND_CPU && (rc = kva_block_table_check_entries(kv, p->L))) return rc;
  } else {
    if (backend == KVA_BACKEND_CPU)
      for (int64_t b = 0; b < B; ++b)
        if (kva_paged_view_len(kv, b) < p->L)
          return kva_seterr(KVA_ESHAPE, "sequence %lld of the paged view has %lld tokens < L = %lld",
                            (long long)b, (long long)kva_paged_view_len(kv, b), (long long)p->L);
  }
  /* The output may not overlap any input (for the paged and block-table
   * layouts, k/v describe the whole pools). */
  const kva_tensor *ins[] = {q, &kv->k.data, &kv->k.scales, &kv->k.biases, &kv->v.data,
                             &kv->v.scales, &kv->v.biases};
  static const char *in_names[] = {"q", "k", "k.scales", "k.biases", "v", "v.scales", "v.biases"};
  for (size_t i = 0; i < sizeof ins / sizeof ins[0]; ++i) {
    if ((i == 2 && !kva_kv_scaled(&kv->k)) || (i == 3 && !kv->k.bits)) continue;
    if ((i == 5 && !kva_kv_scaled(&kv->v)) || (i == 6 && !kv->v.bits)) continue;
    if (out && kva_tensors_overlap(out, ins[i]))
      return kva_seterr(KVA_EINVAL, "out overlaps %s", in_names[i]);
  }
  if (!isfinite(params->scale))
    return kva_seterr(KVA_EINVAL, "scale = %g must be finite (0 = 1/sqrt(Dk))", (double)params->scale);
  p->scale = params->scale != 0.0f ? params->scale : (float)(1.0 / sqrt((double)Dk));
  if (!isfinite(params->softcap) || params->softcap < 0.0f)
    return kva_seterr(KVA_EINVAL, "softcap = %g must be finite and > 0 (or 0 for none)", (double)params->softcap);
  p->softcap = params->softcap;
  if (params->flags & ~(KVA_ATTN_EXACT | KVA_ATTN_ROTATED_K | KVA_ATTN_ROTATED_V))
    return kva_seterr(KVA_EINVAL, "params->flags = 0x%x (allowed: KVA_ATTN_EXACT, KVA_ATTN_ROTATED_K, "
                      "KVA_ATTN_ROTATED_V)", params->flags);
  p->exact = (params->flags & KVA_ATTN_EXACT) != 0;
  p->rotate = params->flags & (KVA_ATTN_ROTATED_K | KVA_ATTN_ROTATED_V);
  if ((p->rotate & KVA_ATTN_ROTATED_K) && !kva_hadamard_block(Dk))
    return kva_hadamard_dim_error("params->flags KVA_ATTN_ROTATED_K (K)", Dk);
  if ((p->rotate & KVA_ATTN_ROTATED_V) && !kva_hadamard_block(Dv))
    return kva_hadamard_dim_error("params->flags KVA_ATTN_ROTATED_V (V)", Dv);
  p->sinks = params->sinks;
  p->mask = params->mask;
  if ((rc = check_mask(p, backend))) return rc;
  if (backend == KVA_BACKEND_CPU && (rc = check_fp8_scales(p))) return rc;
  p->path = kva_select_path(p);
  return 0;
}

int kva_problem_set_lse(kva_problem *p, const kva_tensor *lse, unsigned flags) {
  if (flags & ~KVA_LSE_BASE2) return kva_seterr(KVA_EINVAL, "flags = 0x%x (allowed: KVA_LSE_BASE2)", flags);
  p->lse = NULL;
  p->lse_base2 = (flags & KVA_LSE_BASE2) != 0;
  if (!lse) return 0;
  int rc = kva_check_tensor(lse, "lse", KVA_DT(KVA_F32), 3, false);
  if (rc) return rc;
  const int64_t want[3] = {p->B, p->H, p->L};
  for (int d = 0; d < 3; ++d)
    if (lse->shape[d] != want[d])
      return kva_seterr(KVA_ESHAPE, "lse.shape[%d] = %lld, expected %lld ([B, H, L])", d, (long long)lse->shape[d],
                        (long long)want[d]);
  const kva_kv_view *kv = p->kv;
  const kva_tensor *ins[] = {p->q, &kv->k.data, &kv->k.scales, &kv->k.biases, &kv->v.data, &kv->v.scales,
                             &kv->v.biases, p->out};
  static const char *in_names[] = {"q", "k", "k.scales", "k.biases", "v", "v.scales", "v.biases", "out"};
  for (size_t i = 0; i < sizeof ins / sizeof ins[0]; ++i) {
    if ((i == 2 && !kva_kv_scaled(&kv->k)) || (i == 3 && !kv->k.bits)) continue;
    if ((i == 5 && !kva_kv_scaled(&kv->v)) || (i == 6 && !kv->v.bits)) continue;
    if (ins[i] && kva_tensors_overlap(lse, ins[i])) return kva_seterr(KVA_EINVAL, "lse overlaps %s", in_names[i]);
  }
  p->lse = lse;
  return 0;
}

kva_path kva_select_path(const kva_problem *p) {
  /* every L runs fused (the CPU in row groups, CUDA in query tiles); explicit arrays take the general kernels */
  return p->mask.kind == KVA_MASK_ARRAY ? KVA_PATH_FALLBACK : KVA_PATH_FUSED;
}

/* ---- context ---- */
/* The live contexts, for the fork handlers: a fork waits until no call holds
 * a context (prepare takes every context's mutex, then its pool's), so the
 * child inherits each context unlocked and consistent; the child's first
 * CPU call starts new pool workers (src/cpu/threadpool.c). Lock order:
 * live_mu, then a context's mu, then its pool's mutexes. */
static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static kva_context *live; /* list through next/prev */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void fork_prepare(void) {
  pthread_mutex_lock(&live_mu);
  for (kva_context *c = live; c; c = c->next) {
    pthread_mutex_lock(&c->mu);
    if (c->pool) kva_threadpool_fork_prepare(c->pool);
  }
}
static void fork_parent(void) {
  for (kva_context *c = live; c; c = c->next) {
    if (c->pool) kva_threadpool_fork_parent(c->pool);
    pthread_mutex_unlock(&c->mu);
  }
  pthread_mutex_unlock(&live_mu);
}
static void fork_child(void) {
  for (kva_context *c = live; c; c = c->next) {
    if (c->pool) kva_threadpool_fork_child(c->pool);
    pthread_mutex_unlock(&c->mu);
  }
  pthread_mutex_unlock(&live_mu);
}
static void register_atfork(void) { pthread_atfork(fork_prepare, fork_parent, fork_child); }

int kva_context_create(kva_context **out, const kva_context_opts *opts) {
  kva_clearerr();
  if (!out) return kva_seterr(KVA_EINVAL, "ctx (output pointer) is NULL");
  kva_context_opts o;
  memset(&o, 0, sizeof o);
  if (opts) o = *opts;
  if (o.backend != KVA_BACKEND_CPU && o.backend != KVA_BACKEND_CUDA)
    return kva_seterr(KVA_EINVAL, "opts.backend = %d is not a kva_backend", (int)o.backend);
  if (o.threads < 0) return kva_seterr(KVA_EINVAL, "opts.threads = %d must be >= 0", o.threads);
  if (o.threads > KVA_MAX_THREADS) /* before starting any: a typo must not start a million threads */
    return kva_seterr(KVA_EINVAL, "opts.threads = %d exceeds KVA_MAX_THREADS (%d)", o.threads, KVA_MAX_THREADS);
  kva_context *ctx = (kva_context *)calloc(1, sizeof *ctx);
  if (!ctx) return kva_seterr(KVA_ENOMEM, "context");
  ctx->backend = o.backend;
  ctx->device = o.device;
  ctx->stream = o.stream;
  int rc = 0;
  if (o.backend == KVA_BACKEND_CPU) {
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    ctx->threads = o.threads > 0 ? o.threads : (int)(ncpu > KVA_MAX_THREADS ? KVA_MAX_THREADS : ncpu > 0 ? ncpu : 1);
    rc = kva_threadpool_create(&ctx->pool, ctx->threads);
  } else {
    ctx->threads = 1;
    rc = kva_cuda_context_init(ctx);
  }
  if (rc < 0) {
    free(ctx);
    return rc;
  }
  pthread_mutex_init(&ctx->mu, NULL);
  pthread_once(&atfork_once, register_atfork);
  pthread_mutex_lock(&live_mu);
  ctx->next = live;
  if (live) live->prev = ctx;
  live = ctx;
  pthread_mutex_unlock(&live_mu);
  *out = ctx;
  return 0;
}

void kva_context_destroy(kva_context *ctx) {
  if (!ctx) return;
  pthread_mutex_lock(&live_mu);
  if (ctx->prev) ctx->prev->next = ctx->next;
  else live = ctx->next;
  if (ctx->next) ctx->next->prev = ctx->prev;
  pthread_mutex_unlock(&live_mu);
  pthread_mutex_destroy(&ctx->mu);
  if (ctx->backend == KVA_BACKEND_CPU) {
    kva_threadpool_destroy(ctx->pool);
    free(ctx->ws);
  } else {
    if (ctx->ws) kva_cuda_workspace_free(ctx, ctx->ws);
    kva_cuda_context_free(ctx);
  }
  free(ctx);
}

int kva_context_threads(const kva_context *ctx) { return ctx ? ctx->threads : 0; }

int kva_context_set_stream(kva_context *ctx, void *stream) {
  kva_clearerr();
  if (!ctx) return kva_seterr(KVA_EINVAL, "ctx is NULL");
  if (ctx->backend != KVA_BACKEND_CUDA)
    return kva_seterr(KVA_EINVAL, "ctx: streams apply to the CUDA backend only");
  pthread_mutex_lock(&ctx->mu);
  ctx->stream = stream;
  pthread_mutex_unlock(&ctx->mu);
  return 0;
}

/* ---- attention ---- */
static int backend_workspace_size(const kva_context *ctx, const kva_problem *p, size_t *bytes) {
  return ctx->backend == KVA_BACKEND_CPU ? kva_cpu_workspace_size(ctx, p, bytes) : kva_cuda_workspace_size(ctx, p, bytes);
}

/* A rotated call (p->rotate, kvattn.h KVA_ATTN_ROTATED_K / _V) as the
 * backend runs it. The bits the backend runs fused (the CUDA kernels:
 * kva_cuda_rotate_fused; the CPU and the CUDA general kernel: none) stay in
 * the backend's problem; for each other bit a pass here: q' = H q [B, H, L,
 * Dk] (ROTATED_K; q's dtype, f32 for f32 queries and KVA_ATTN_EXACT) before,
 * and the kernel's output out' [B, H, L, Dv] f32 (ROTATED_V; out = H out'
 * afterwards), both contiguous in the workspace after the backend's own
 * bytes, each at a ROT_ALIGN-aligned address. The fused q is rounded the
 * same way (H q in f32, once to q's dtype, then the kernel's roundings), so
 * the bracket of the name does not depend on where the rotation runs. ws
 * NULL: the descriptors' data are NULL (sizes and names only). */
#define ROT_ALIGN 256
typedef struct rot_call {
  kva_problem p;      /* the backend's problem: rotate = fused, q and out as above for the passes */
  unsigned fused;     /* the bits the backend runs fused */
  kva_tensor q, out;  /* q' and out' */
  size_t inner;       /* the backend's workspace bytes, at the workspace's start */
  size_t total;       /* inner + q' + out' + alignment */
} rot_call;

static int rot_plan(const kva_context *ctx, const kva_problem *p, char *ws, rot_call *r) {
  r->p = *p;
  r->fused = ctx->backend == KVA_BACKEND_CUDA ? kva_cuda_rotate_fused(ctx, p) & p->rotate : 0u;
  r->p.rotate = r->fused;
  const unsigned pass = p->rotate & ~r->fused;
  const kva_dtype qdt = p->exact || p->q->dtype == KVA_F32 ? KVA_F32 : p->q->dtype;
  r->q = kva_tensor_4d(NULL, qdt, p->B, p->H, p->L, p->Dk);
  r->out = kva_tensor_4d(NULL, KVA_F32, p->B, p->H, p->L, p->Dv);
  if (pass & KVA_ATTN_ROTATED_K) r->p.q = &r->q;
  if (pass & KVA_ATTN_ROTATED_V) r->p.out = &r->out;
  int rc = backend_workspace_size(ctx, &r->p, &r->inner);
  if (rc < 0) return rc;
  /* q' and out': B H L Dk elements of q's size, B H L Dv floats (checked products) */
  bool ok = true;
  const int64_t rows = kva_mul_chk(kva_mul_chk(p->B, p->H, &ok), p->L, &ok);
  const int64_t qe = (pass & KVA_ATTN_ROTATED_K) ? kva_mul_chk(rows, p->Dk * (int64_t)kva_dtype_size(qdt), &ok) : 0;
  const int64_t oe = (pass & KVA_ATTN_ROTATED_V) ? kva_mul_chk(rows, p->Dv * 4, &ok) : 0;
  if (!ok || qe > (int64_t)KVA_MAX_WORKSPACE || oe > (int64_t)KVA_MAX_WORKSPACE)
    return kva_seterr(KVA_ESHAPE, "the rotated query and output of B H L = %lld rows exceed the workspace limit "
                      "(2^48 bytes)", (long long)rows);
  const size_t qb = (size_t)qe, ob = (size_t)oe;
  r->total = r->inner + (qb ? ROT_ALIGN + qb : 0) + (ob ? ROT_ALIGN + ob : 0);
  if (r->total > KVA_MAX_WORKSPACE)
    return kva_seterr(KVA_ESHAPE, "workspace of %zu bytes (rotated query and output) exceeds 2^48", r->total);
  if (ws) {
    uintptr_t a = ((uintptr_t)ws + r->inner + ROT_ALIGN - 1) / ROT_ALIGN * ROT_ALIGN;
    r->q.data = (void *)a;
    a = (a + qb + ROT_ALIGN - 1) / ROT_ALIGN * ROT_ALIGN;
    r->out.data = (void *)a;
  }
  return 0;
}

static int workspace_size(const kva_context *ctx, const kva_problem *p, size_t *bytes) {
  if (!p->rotate) return backend_workspace_size(ctx, p, bytes);
  rot_call r;
  const int rc = rot_plan(ctx, p, NULL, &r);
  if (rc < 0) return rc;
  *bytes = r.total;
  return 0;
}

/* The kernel name of a rotated call: the backend's kernel, ", Hadamard-
 * rotated K,V" (or K, or V) before the bracket, where the backend fuses a
 * part "(q rotated on load, out rotated back on store)" (the fused parts
 * only; a part without words runs as a pass), and "q bf16" / "q f16" first
 * in the bracket when q' is 16-bit (a rounding after the rotation, fused or
 * not: "[exact f32]" becomes "[q bf16]"). */
static void rot_name(const rot_call *r, unsigned rotate, char *name, size_t size) {
  char tail[224];
  const char *open = strrchr(name, '[');
  const size_t at = open && open > name && open[-1] == ' ' ? (size_t)(open - 1 - name) : strlen(name);
  const char *bracket = at < strlen(name) ? name + at + 1 : "";
  const char *what = rotate == (KVA_ATTN_ROTATED_K | KVA_ATTN_ROTATED_V) ? "K,V"
                     : rotate == KVA_ATTN_ROTATED_K                        ? "K"
                                                                          : "V";
  char how[96] = "";
  const unsigned fk = r->fused & KVA_ATTN_ROTATED_K, fv = r->fused & KVA_ATTN_ROTATED_V;
  if (fk || fv)
    snprintf(how, sizeof how, " (%s%s%s)", fk ? "q rotated on load" : "", fk && fv ? ", " : "",
             fv ? "out rotated back on store" : "");
  char qitem[16] = "";
  if ((rotate & KVA_ATTN_ROTATED_K) && r->q.dtype != KVA_F32)
    snprintf(qitem, sizeof qitem, "q %s", r->q.dtype == KVA_BF16 ? "bf16" : "f16");
  if (qitem[0] && !strcmp(bracket, "[exact f32]"))
    snprintf(tail, sizeof tail, ", Hadamard-rotated %s%s [%s]", what, how, qitem);
  else if (qitem[0] && bracket[0] == '[')
    snprintf(tail, sizeof tail, ", Hadamard-rotated %s%s [%s, %s", what, how, qitem, bracket + 1);
  else
    snprintf(tail, sizeof tail, ", Hadamard-rotated %s%s%s%s", what, how, bracket[0] ? " " : "", bracket);
  if (at < size) snprintf(name + at, size - at, "%s", tail);
}

int kva_attention_workspace_size(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                                 const kva_attn_params *params, size_t *bytes) {
  kva_clearerr();
  if (!ctx) return kva_seterr(KVA_EINVAL, "ctx is NULL");
  if (!bytes) return kva_seterr(KVA_EINVAL, "bytes (output pointer) is NULL");
  /* The output is not needed to size the workspace (out = NULL skips its checks). */
  kva_problem p;
  int rc = kva_problem_init(&p, ctx->backend, q, kv, params, NULL);
  if (rc < 0) return rc;
  size_t need;
  if ((rc = workspace_size(ctx, &p, &need)) < 0) return rc;
  *bytes = need;
  return 0;
}

/* The validated problem of an attention call (kva_attention and its queries). */
static int call_problem(kva_problem *p, kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                        const kva_attn_params *params, const kva_tensor *out) {
  kva_clearerr();
  if (!ctx) return kva_seterr(KVA_EINVAL, "ctx is NULL");
  if (!out) return kva_seterr(KVA_EINVAL, "out is NULL");
  return kva_problem_init(p, ctx->backend, q, kv, params, out);
}

int kva_attention_path(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                       const kva_attn_params *params, const kva_tensor *out) {
  kva_problem p;
  int rc = call_problem(&p, ctx, q, kv, params, out);
  return rc < 0 ? rc : (int)p.path;
}

int kva_attention_kernel(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                         const kva_attn_params *params, const kva_tensor *out, char *name, size_t size) {
  kva_problem p;
  int rc = call_problem(&p, ctx, q, kv, params, out);
  if (rc < 0) return rc;
  if (!name || size == 0) return kva_seterr(KVA_EINVAL, "name is NULL or size is 0");
  rot_call r;
  if (p.rotate && (rc = rot_plan(ctx, &p, NULL, &r)) < 0) return rc;
  const kva_problem *bp = p.rotate ? &r.p : &p;
  char full[320];
  if (ctx->backend == KVA_BACKEND_CPU)
    kva_cpu_kernel_name(bp, full, sizeof full);
  else if ((rc = kva_cuda_kernel_name(ctx, bp, full, sizeof full)) < 0)
    return rc;
  if (p.rotate) rot_name(&r, p.rotate, full, sizeof full);
  snprintf(name, size, "%s", full);
  return (int)p.path;
}

int kva_attention(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                  const kva_attn_params *params, kva_tensor *out, void *workspace, size_t workspace_bytes) {
  return kva_attention_lse(ctx, q, kv, params, out, NULL, 0, workspace, workspace_bytes);
}

int kva_context_workspace(kva_context *ctx, size_t need) {
  if (need <= ctx->ws_bytes) return 0;
  void *nws = NULL;
  int rc = 0;
  if (ctx->backend == KVA_BACKEND_CPU) {
    nws = malloc(need);
    if (!nws) return kva_seterr(KVA_ENOMEM, "context workspace of %zu bytes", need);
    free(ctx->ws);
  } else if ((rc = kva_cuda_workspace_alloc(ctx, need, &nws)) < 0) {
    return rc;
  } else if (ctx->ws) {
    kva_cuda_workspace_free(ctx, ctx->ws);
  }
  ctx->ws = nws;
  ctx->ws_bytes = need;
  return 0;
}

static int backend_attention(kva_context *ctx, const kva_problem *p, void *ws, size_t ws_bytes) {
  return ctx->backend == KVA_BACKEND_CPU ? kva_cpu_attention(ctx, p, ws, ws_bytes) : kva_cuda_attention(ctx, p, ws, ws_bytes);
}

/* The rotated call (kvattn.h KVA_ATTN_ROTATED_K / _V): the passes rot_plan
 * keeps, q' = H q, the backend's attention over (q', K', V') into out (or
 * out' in f32), then out = H out', with the fused bits left to the backend.
 * Traffic of the passes past the kernel's: q read once and q' written and
 * read, out' written and read once (B H L (Dk + Dv) elements; none of K/V). */
static int rotated_attention(kva_context *ctx, const kva_problem *p, void *ws) {
  rot_call r;
  int rc = rot_plan(ctx, p, (char *)ws, &r);
  if (rc < 0) return rc;
  const unsigned pass = p->rotate & ~r.fused;
  if ((pass & KVA_ATTN_ROTATED_K) && (rc = kva_hadamard_run(ctx, p->q, &r.q)) < 0) return rc;
  if ((rc = backend_attention(ctx, &r.p, ws, r.inner)) < 0) return rc;
  if (pass & KVA_ATTN_ROTATED_V) rc = kva_hadamard_run(ctx, &r.out, p->out);
  return rc;
}

int kva_attention_lse_unlocked(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                               const kva_attn_params *params, kva_tensor *out, kva_tensor *lse, unsigned flags,
                               void *workspace, size_t workspace_bytes) {
  kva_problem p;
  int rc = call_problem(&p, ctx, q, kv, params, out);
  if (rc < 0) return rc;
  if ((rc = kva_problem_set_lse(&p, lse, flags)) < 0) return rc;
  size_t need;
  if ((rc = workspace_size(ctx, &p, &need)) < 0) return rc;
  if (workspace && workspace_bytes < need)
    return kva_seterr(KVA_EWORKSPACE, "workspace_bytes = %zu < %zu needed", workspace_bytes, need);
  if (!workspace) {
    if ((rc = kva_context_workspace(ctx, need)) < 0) return rc;
    workspace = ctx->ws;
    workspace_bytes = ctx->ws_bytes;
  }
  if (p.rotate) return rotated_attention(ctx, &p, workspace);
  return backend_attention(ctx, &p, workspace, workspace_bytes);
}

int kva_attention_lse(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv,
                      const kva_attn_params *params, kva_tensor *out, kva_tensor *lse, unsigned flags,
                      void *workspace, size_t workspace_bytes) {
  if (!ctx) return call_problem(NULL, ctx, q, kv, params, out); /* the NULL-context error */
  /* Held across the workspace's growth and the backend call: the context's
   * workspace and the CPU pool serve one call at a time. */
  pthread_mutex_lock(&ctx->mu);
  const int rc = kva_attention_lse_unlocked(ctx, q, kv, params, out, lse, flags, workspace, workspace_bytes);
  pthread_mutex_unlock(&ctx->mu);
  return rc;
}
