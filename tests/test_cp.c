/* Context parallelism with simulated ranks (CPU): a batch's keys split over
 * R = 1..8 ranks (contiguous ranges of a contiguous cache; round-robin
 * blocks as block tables and as paged views), each rank's part attended into
 * its send buffer (kva_cp_attend), the buffers exchanged by the plan's
 * offsets (all-to-all by head owner, or all-gather), each rank's parts
 * merged (kva_cp_merge): equal to the unsharded kva_attention_lse within
 * rounding, for float and quantized formats, no mask, causal, causal with a
 * window that excludes whole shards, sinks and softcap, empty shards; bad
 * input. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn_check.h"
#include "test.h"

typedef enum { CP_CONTIG, CP_TABLE_RR, CP_PAGED_RR } cp_layout;

typedef struct cpc {
  int64_t B, H, KVH, L, N, D;
  int bits, group;
  kva_dtype dt;        /* float rows' dtype, or the scales' */
  kva_mask_kind mask;
  int32_t window;      /* causal only; the boundary must fall in the last shard */
  int sinks;
  float softcap;
  cp_layout layout;
  int64_t bs;          /* block size of the round-robin layouts */
} cpc;

#define CP_MAX_MEM 64
typedef struct cpm {
  void *p[CP_MAX_MEM];
  int n;
} cpm;
static void *cpm_alloc(cpm *m, size_t n) {
  if (m->n == CP_MAX_MEM) return NULL;
  void *p = calloc(1, n ? n : 1);
  if (p) m->p[m->n++] = p;
  return p;
}
static void cpm_free(cpm *m) {
  for (int i = 0; i < m->n; ++i) free(m->p[i]);
  m->n = 0;
}

/* K or V [B, KVH, N, D] of f32 rows src in the case's format. */
static int cp_kv(cpm *m, const cpc *c, float *src, kva_kv *kv) {
  const kva_tensor t = kva_tensor_4d(src, KVA_F32, c->B, c->KVH, c->N, c->D);
  const size_t rows = (size_t)(c->B * c->KVH * c->N);
  if (!c->bits) {
    if (c->dt == KVA_F32) {
      *kv = kva_kv_float(src, KVA_F32, c->B, c->KVH, c->N, c->D);
      return 0;
    }
    void *d = cpm_alloc(m, rows * (size_t)c->D * kva_dtype_size(c->dt));
    if (!d) return -1;
    *kv = kva_kv_float(d, c->dt, c->B, c->KVH, c->N, c->D);
    return kva_convert(&t, &kv->data);
  }
  const size_t groups = rows * (size_t)(c->D / c->group), es = kva_dtype_size(c->dt);
  void *w = cpm_alloc(m, rows * (size_t)(c->D * c->bits / 32) * 4), *s = cpm_alloc(m, groups * es),
       *z = cpm_alloc(m, groups * es);
  if (!w || !s || !z) return -1;
  *kv = kva_kv_quantized(w, s, z, c->dt, c->bits, c->group, c->B, c->KVH, c->N, c->D);
  return kva_quantize(&t, kv);
}

/* Tokens [t0, t0 + n) of a contiguous operand (a strided sub-view). */
static kva_kv cp_range(const kva_kv *kv, int64_t t0, int64_t n) {
  kva_kv r = *kv;
  kva_tensor *ts[3] = {&r.data, &r.scales, &r.biases};
  for (int a = 0; a < (kv->bits ? 3 : 1); ++a) {
    ts[a]->data = (char *)ts[a]->data + t0 * ts[a]->stride[2];
    ts[a]->shape[2] = n;
  }
  return r;
}

/* One rank's shard: its view (or none), its params. */
typedef struct shard {
  int empty;
  kva_kv k, v;
  kva_kv_view view;
  kva_block_table table;
  int32_t *blocks, lens[8];
  kva_paged_view *pv;
  kva_attn_params p;
} shard;

/* The params of a shard over global tokens [t0, t1) of each sequence (all
 * sequences N long): the caller's for the shard that ends with the rows'
 * tokens; before them, none (no window), or with a window none when it
 * covers the shard for every row, empty when it covers none of it. */
static int cp_shard_params(const cpc *c, const kva_attn_params *all, int64_t t0, int64_t t1, int last, shard *s) {
  s->p = *all;
  if (last) return 0;
  s->p.sinks = NULL;
  memset(&s->p.mask, 0, sizeof s->p.mask);
  s->p.mask.kind = KVA_MASK_NONE;
  if (c->mask == KVA_MASK_CAUSAL && c->window > 0) {
    const int64_t w = c->window, N = c->N, L = c->L;
    if (t1 <= N - L - w + 1) s->empty = 1;   /* key t1 - 1 <= p_0 - w: outside every row's window */
    else if (t0 < N - w) return -1;         /* partly inside: not a case of this table */
  }
  return 0;
}

/* Splits of the case's keys for R ranks into sh[0..R). Contiguous ranges:
 * the last shard [N - last, N) (the rows' tokens and the window boundary),
 * the rest cut evenly with shard 1 empty when R >= 3. Round-robin: block i
 * to rank i % R (ranks past the block count are empty). */
static int cp_split(cpm *m, const cpc *c, int64_t R, const kva_kv *k, const kva_kv *v, kva_pool *pool,
                    const int32_t *seqs, const kva_attn_params *all, shard *sh) {
  memset(sh, 0, sizeof(shard) * (size_t)R);
  if (c->layout == CP_CONTIG) {
    int64_t cut[9];
    const int64_t last = c->window && c->window + c->L + 7 < c->N ? c->window + c->L + 7 : c->L + 9;
    cut[0] = 0, cut[R] = c->N;
    for (int64_t r = 1; r < R; ++r) cut[r] = (c->N - last) * r / (R - 1);
    if (R >= 3) cut[2] = cut[1];
    for (int64_t r = 0; r < R; ++r) {
      shard *s = &sh[r];
      if (cut[r + 1] == cut[r]) {
        s->empty = 1;
        continue;
      }
      if (cp_shard_params(c, all, cut[r], cut[r + 1], r == R - 1, s)) return -1;
      s->k = cp_range(k, cut[r], cut[r + 1] - cut[r]);
      s->v = cp_range(v, cut[r], cut[r + 1] - cut[r]);
      s->view = kva_view_contiguous(&s->k, &s->v, NULL);
    }
    return 0;
  }
  /* round-robin blocks of the pool's sequences (each N tokens) */
  const int64_t bs = c->bs, nb = (c->N + bs - 1) / bs, lastb = nb - 1;
  kva_paged_view *all_v;
  int32_t *tb = cpm_alloc(m, sizeof(int32_t) * (size_t)(c->B * nb)), tl[8], tf[8];
  if (!tb || kva_paged_view_create(pool, seqs, c->B, &all_v)) return -1;
  int rc = kva_paged_view_block_table(all_v, nb, tb, tl, tf);
  kva_paged_view_release(all_v);
  if (rc) return -1;
  for (int64_t r = 0; r < R; ++r) {
    shard *s = &sh[r];
    const int64_t mine = r < nb ? (nb - 1 - r) / R + 1 : 0; /* blocks r, r + R, ... */
    if (!mine) {
      s->empty = 1;
      continue;
    }
    const int holds_last = lastb % R == r;
    const int64_t len = holds_last ? (mine - 1) * bs + (c->N - lastb * bs) : mine * bs;
    if (cp_shard_params(c, all, 0, holds_last ? c->N : c->N - 1, holds_last, s)) return -1;
    s->blocks = cpm_alloc(m, sizeof(int32_t) * (size_t)(c->B * mine));
    if (!s->blocks) return -1;
    for (int64_t b = 0; b < c->B; ++b) {
      for (int64_t i = 0; i < mine; ++i) s->blocks[b * mine + i] = tb[b * nb + r + i * R];
      s->lens[b] = (int32_t)len;
    }
    if (c->layout == CP_TABLE_RR) {
      s->k = kva_pool_k(pool), s->v = kva_pool_v(pool);
      s->table = (kva_block_table){c->B, mine, 0, s->blocks, s->lens, NULL};
      s->view = kva_view_block_table(&s->k, &s->v, &s->table);
    } else {
      int32_t indptr[9], last_len[8];
      for (int64_t b = 0; b <= c->B; ++b) indptr[b] = (int32_t)(b * mine);
      for (int64_t b = 0; b < c->B; ++b) last_len[b] = (int32_t)(len - (mine - 1) * bs);
      const kva_paged_csr csr = {c->B, indptr, s->blocks, last_len, NULL, NULL, NULL};
      if (kva_paged_view_from_csr(pool, &csr, &s->pv)) return -1;
      s->view = kva_view_paged(s->pv);
    }
  }
  return 0;
}

static void cp_unsplit(shard *sh, int64_t R) {
  for (int64_t r = 0; r < R; ++r)
    if (sh[r].pv) kva_paged_view_release(sh[r].pv);
}

static kva_tensor cp_lse_t(float *p, int64_t B, int64_t H, int64_t L) {
  kva_tensor t = kva_tensor_4d(p, KVA_F32, B, H, L, 1);
  t.ndim = 3, t.shape[3] = 0, t.stride[3] = 0;
  return t;
}

/* Buffers of the simulated ranks: host memory, or device memory (dev). */
#ifdef KVA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
static void *cp_buf(int dev, size_t n) {
#ifdef KVA_HAVE_CUDA
  if (dev) {
    void *p = NULL;
    return cudaMalloc(&p, n ? n : 1) == cudaSuccess ? p : NULL;
  }
#endif
  (void)dev;
  return malloc(n ? n : 1);
}
static void cp_buf_free(int dev, void *p) {
#ifdef KVA_HAVE_CUDA
  if (dev) {
    if (p) cudaFree(p);
    return;
  }
#endif
  (void)dev;
  free(p);
}
/* dst <- src (n bytes, both in the ranks' memory; to_host: dst is host memory). */
static int cp_copy(int dev, void *dst, const void *src, size_t n, int to_host) {
#ifdef KVA_HAVE_CUDA
  if (dev) return cudaMemcpy(dst, src, n, to_host ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice) == cudaSuccess ? 0 : -1;
#endif
  (void)dev, (void)to_host;
  memcpy(dst, src, n);
  return 0;
}
static int cp_poison(int dev, void *p, size_t n) {
#ifdef KVA_HAVE_CUDA
  if (dev) return cudaMemset(p, 0x7f, n) == cudaSuccess ? 0 : -1;
#endif
  (void)dev;
  memset(p, 0x7f, n);
  return 0;
}

/* All ranks of one split: attend, exchange, merge, compare with ref/rlse
 * (host arrays); dev: the ranks' buffers in device memory (ctx CUDA). */
static int cp_run(kva_context *ctx, const cpc *c, int64_t R, int by_head, const kva_tensor *q, shard *sh,
                  const float *ref, const float *rlse, const char *what, int dev) {
  kva_cp_plan plan[8];
  char *send[8] = {0}, *recv[8] = {0};
  float *out = NULL, *lse = NULL, *dout = NULL, *dlse = NULL;
  int ok = 0;
  for (int64_t r = 0; r < R; ++r)
    if (kva_cp_plan_init(&plan[r], R, r, by_head, c->B, c->H, c->L, c->D, 0)) {
      FAIL_("%s: kva_cp_plan_init: %s", what, kva_last_error());
      goto done;
    }
  const kva_cp_plan *p0 = &plan[0];
  for (int64_t r = 0; r < R; ++r) {
    send[r] = cp_buf(dev, p0->send_bytes), recv[r] = cp_buf(dev, p0->recv_bytes);
    if (!send[r] || !recv[r] || cp_poison(dev, send[r], p0->send_bytes)) goto done;
    if (kva_cp_attend(ctx, &plan[r], q, sh[r].empty ? NULL : &sh[r].view, &sh[r].p, send[r], p0->send_bytes, NULL,
                      0)) {
      FAIL_("%s: rank %lld: kva_cp_attend: %s", what, (long long)r, kva_last_error());
      goto done;
    }
  }
  /* the exchange: rank d receives from rank s the part addressed to d */
  for (int64_t d = 0; d < R; ++d)
    for (int64_t s = 0; s < R; ++s) {
      const size_t part = by_head ? (size_t)d : 0;
      if (cp_copy(dev, recv[d] + s * p0->o_bytes, send[s] + part * p0->o_bytes, p0->o_bytes, 0) ||
          cp_copy(dev, recv[d] + p0->recv_lse_offset + s * p0->lse_bytes,
                  send[s] + p0->send_lse_offset + part * p0->lse_bytes, p0->lse_bytes, 0)) {
        FAIL_("%s: exchange", what);
        goto done;
      }
    }
  const int64_t hc = p0->heads;
  const size_t on = sizeof(float) * (size_t)(c->B * hc * c->L * c->D), ln = sizeof(float) * (size_t)(c->B * hc * c->L);
  out = malloc(on), lse = malloc(ln), dout = dev ? cp_buf(dev, on) : out, dlse = dev ? cp_buf(dev, ln) : lse;
  if (!out || !lse || !dout || !dlse) goto done;
  for (int64_t d = 0; d < R; ++d) {
    kva_tensor to = kva_tensor_4d(dout, KVA_F32, c->B, hc, c->L, c->D), tl = cp_lse_t(dlse, c->B, hc, c->L);
    if (kva_cp_merge(ctx, &plan[d], recv[d], p0->recv_bytes, &to, &tl)) {
      FAIL_("%s: rank %lld: kva_cp_merge: %s", what, (long long)d, kva_last_error());
      goto done;
    }
    if (dev && (cp_copy(dev, out, dout, on, 1) || cp_copy(dev, lse, dlse, ln, 1))) {
      FAIL_("%s: fetch", what);
      goto done;
    }
    const int64_t h0 = by_head ? d * hc : 0;
    double mx = 0, err = 0;
    for (int64_t i = 0; i < c->B * c->H * c->L * c->D; ++i) mx = fmax(mx, fabs((double)ref[i]));
    for (int64_t b = 0; b < c->B; ++b)
      for (int64_t h = 0; h < hc; ++h)
        for (int64_t i = 0; i < c->L; ++i) {
          const int64_t gr = (b * c->H + h0 + h) * c->L + i, lr = (b * hc + h) * c->L + i;
          for (int64_t x = 0; x < c->D; ++x) err = fmax(err, fabs((double)out[lr * c->D + x] - ref[gr * c->D + x]));
          if (!(fabs((double)lse[lr] - rlse[gr]) <= 1e-5 * (1 + fabs((double)rlse[gr])))) {
            FAIL_("%s: rank %lld: lse (b %lld, head %lld, row %lld) = %.7g, unsharded %.7g", what, (long long)d,
                  (long long)b, (long long)(h0 + h), (long long)i, lse[lr], rlse[gr]);
            goto done;
          }
        }
    if (!(err <= ATT_ATOL_F32 * fmax(mx, 1e-30))) {
      FAIL_("%s: rank %lld: out differs from the unsharded call by %.3g (max|ref| %.3g)", what, (long long)d, err, mx);
      goto done;
    }
  }
  ok = 1;
done:
  for (int64_t r = 0; r < R; ++r) cp_buf_free(dev, send[r]), cp_buf_free(dev, recv[r]);
  if (dev) cp_buf_free(dev, dout), cp_buf_free(dev, dlse);
  free(out), free(lse);
  return ok;
}

/* Device copies of the case's operands (dev runs), freed together. */
#define CP_DEV_MAX 256
typedef struct cpd {
  void *p[CP_DEV_MAX];
  int n;
} cpd;
static void *cpd_copy(cpd *d, const void *h, size_t n) {
  if (d->n == CP_DEV_MAX) return NULL;
  void *p = cp_buf(1, n);
  if (!p) return NULL;
  d->p[d->n++] = p;
#ifdef KVA_HAVE_CUDA
  if (h && cudaMemcpy(p, h, n, cudaMemcpyHostToDevice) != cudaSuccess) return NULL;
#else
  (void)h;
#endif
  return p;
}
static size_t cp_extent(const kva_tensor *t) {
  size_t e = kva_dtype_size(t->dtype);
  for (int x = 0; x < t->ndim; ++x) e += (size_t)((t->shape[x] - 1) * t->stride[x]);
  return e;
}
/* kv with its arrays copied to the device (same strides). */
static int cpd_kv(cpd *d, const kva_kv *h, kva_kv *out) {
  *out = *h;
  kva_tensor *ts[3] = {&out->data, &out->scales, &out->biases};
  for (int a = 0; a < (h->bits ? 3 : 1); ++a)
    if (!(ts[a]->data = cpd_copy(d, ts[a]->data, cp_extent(ts[a])))) return -1;
  return 0;
}
static void cpd_free(cpd *d) {
  for (int i = 0; i < d->n; ++i) cp_buf_free(1, d->p[i]);
  d->n = 0;
}

/* One case for R = 1..8, both exchange modes; dev: the ranks on ctx's
 * device (contiguous and block-table layouts), the reference the unsharded
 * call there. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__aarch64__)
/* GCC 12 for aarch64 stops with an internal compiler error
 * (vect_transform_reduction) vectorizing this function at -O3 */
__attribute__((optimize("no-tree-vectorize")))
#endif
static int cp_case(kva_context *ctx, const cpc *c, int dev) {
  cpm m = {{0}, 0};
  cpd dm = {{0}, 0};
  kva_pool *pool = NULL;
  int32_t seqs[8];
  int ok = 0;
  char cs[220];
  snprintf(cs, sizeof cs, "%sB%lld H%lld/%lld L%lld N%lld D%lld bits %d %s mask %d window %d sinks %d cap %g layout %d",
           dev ? "CUDA " : "", (long long)c->B, (long long)c->H, (long long)c->KVH, (long long)c->L, (long long)c->N,
           (long long)c->D, c->bits, kva_dtype_name(c->dt), (int)c->mask, c->window, c->sinks, (double)c->softcap,
           (int)c->layout);
  const size_t nkv = (size_t)(c->B * c->KVH * c->N * c->D), nq = (size_t)(c->B * c->H * c->L * c->D);
  float *ks = cpm_alloc(&m, nkv * 4), *vs = cpm_alloc(&m, nkv * 4), *qd = cpm_alloc(&m, nq * 4);
  float *ref = cpm_alloc(&m, nq * 4), *rlse = cpm_alloc(&m, nq / c->D * 4), sinks[64];
  if (!ks || !vs || !qd || !ref || !rlse) goto done;
  for (size_t i = 0; i < nkv; ++i) ks[i] = test_randn(), vs[i] = test_randn();
  for (size_t i = 0; i < nq; ++i) qd[i] = test_randn();
  for (int64_t h = 0; h < c->H; ++h) sinks[h] = test_randn();
  kva_kv k, v, dk, dv, pk, pv;
  memset(&dk, 0, sizeof dk), memset(&dv, 0, sizeof dv), memset(&pk, 0, sizeof pk), memset(&pv, 0, sizeof pv);
  if (cp_kv(&m, c, ks, &k) || cp_kv(&m, c, vs, &v)) {
    FAIL_("%s: operands: %s", cs, kva_last_error());
    goto done;
  }
  const kva_kv_view full = kva_view_contiguous(&k, &v, NULL);
  if (c->layout != CP_CONTIG && kva_pool_from_contiguous(&pool, &full, c->bs, 0, 17, seqs)) {
    FAIL_("%s: pool: %s", cs, kva_last_error());
    goto done;
  }
  kva_tensor q = kva_tensor_4d(qd, KVA_F32, c->B, c->H, c->L, c->D);
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = c->mask;
  p.mask.window = c->window;
  p.softcap = c->softcap;
  if (c->sinks) p.sinks = sinks;
  kva_tensor tr = kva_tensor_4d(ref, KVA_F32, c->B, c->H, c->L, c->D), trl = cp_lse_t(rlse, c->B, c->H, c->L);
  if (dev) { /* operands on the device; the reference: the unsharded call there */
    kva_tensor dq = q, dout = tr, dlse = trl;
    float *dsinks = cpd_copy(&dm, sinks, sizeof sinks);
    dq.data = cpd_copy(&dm, qd, nq * 4), dout.data = cpd_copy(&dm, NULL, nq * 4);
    dlse.data = cpd_copy(&dm, NULL, nq / c->D * 4);
    if (!dsinks || !dq.data || !dout.data || !dlse.data || cpd_kv(&dm, &k, &dk) || cpd_kv(&dm, &v, &dv)) {
      FAIL_("%s: could not mirror operands to the device", cs);
      goto done;
    }
    if (pool) {
      const kva_kv hpk = kva_pool_k(pool), hpv = kva_pool_v(pool);
      if (cpd_kv(&dm, &hpk, &pk) || cpd_kv(&dm, &hpv, &pv)) goto done;
    }
    if (c->sinks) p.sinks = dsinks;
    const kva_kv_view dfull = kva_view_contiguous(&dk, &dv, NULL);
    if (kva_attention_lse(ctx, &dq, &dfull, &p, &dout, &dlse, 0, NULL, 0) || cp_copy(1, ref, dout.data, nq * 4, 1) ||
        cp_copy(1, rlse, dlse.data, nq / c->D * 4, 1)) {
      FAIL_("%s: unsharded call on the device: %s", cs, kva_last_error());
      goto done;
    }
    q = dq;
  } else if (kva_attention_lse(ctx, &q, &full, &p, &tr, &trl, 0, NULL, 0)) {
    FAIL_("%s: unsharded call: %s", cs, kva_last_error());
    goto done;
  }
  ok = 1;
  for (int64_t R = 1; R <= 8 && ok; ++R) {
    shard sh[8];
    if (cp_split(&m, c, R, dev ? &dk : &k, dev ? &dv : &v, pool, seqs, &p, sh)) {
      FAIL_("%s: R = %lld: could not split (%s)", cs, (long long)R, kva_last_error());
      ok = 0;
      cp_unsplit(sh, R);
      break;
    }
    for (int64_t r = 0; r < R && dev && pool; ++r) { /* the shards' tables and pools on the device */
      shard *t = &sh[r];
      if (t->empty) continue;
      t->k = pk, t->v = pv;
      t->table.blocks = cpd_copy(&dm, t->blocks, sizeof(int32_t) * (size_t)(c->B * t->table.max_blocks));
      t->table.seq_lens = cpd_copy(&dm, t->lens, sizeof(int32_t) * (size_t)c->B);
      if (!t->table.blocks || !t->table.seq_lens) ok = 0;
      t->view = kva_view_block_table(&t->k, &t->v, &t->table);
    }
    for (int by_head = 0; by_head < 2 && ok; ++by_head) {
      if (by_head && c->H % R) continue;
      char what[300];
      snprintf(what, sizeof what, "%s, R = %lld, %s", cs, (long long)R, by_head ? "by head" : "all-gather");
      ok = cp_run(ctx, c, R, by_head, &q, sh, ref, rlse, what, dev);
    }
    cp_unsplit(sh, R);
  }
done:
  if (pool) kva_pool_destroy(pool);
  cpd_free(&dm);
  cpm_free(&m);
  return ok;
}

static const cpc cp_cases[] = {
    /* contiguous ranges: float formats, masks */
    {1, 8, 4, 1, 700, 128, 0, 0, KVA_F32, KVA_MASK_CAUSAL, 0, 0, 0, CP_CONTIG, 0},
    {2, 8, 2, 4, 500, 64, 0, 0, KVA_BF16, KVA_MASK_CAUSAL, 0, 1, 0, CP_CONTIG, 0},
    {1, 8, 8, 3, 400, 128, 0, 0, KVA_F16, KVA_MASK_NONE, 0, 1, 15.0f, CP_CONTIG, 0},
    {1, 8, 4, 2, 900, 64, 0, 0, KVA_F32, KVA_MASK_CAUSAL, 30, 1, 0, CP_CONTIG, 0},  /* window excludes shards */
    {1, 8, 4, 2, 300, 64, 0, 0, KVA_F32, KVA_MASK_CAUSAL, 310, 0, 0, CP_CONTIG, 0}, /* window covers them */
    /* quantized */
    {1, 8, 4, 1, 1000, 256, 4, 64, KVA_BF16, KVA_MASK_CAUSAL, 0, 0, 0, CP_CONTIG, 0},
    {2, 8, 2, 4, 600, 128, 8, 32, KVA_F16, KVA_MASK_CAUSAL, 25, 0, 0, CP_CONTIG, 0},
    /* round-robin blocks: block tables and paged views (ranks without a block at R > 5) */
    {1, 8, 4, 1, 77, 128, 4, 64, KVA_BF16, KVA_MASK_CAUSAL, 0, 1, 0, CP_TABLE_RR, 16},
    {2, 8, 2, 4, 300, 64, 0, 0, KVA_F32, KVA_MASK_CAUSAL, 0, 0, 20.0f, CP_TABLE_RR, 32},
    {1, 8, 4, 2, 500, 128, 8, 64, KVA_BF16, KVA_MASK_NONE, 0, 1, 0, CP_PAGED_RR, 16},
    {2, 8, 4, 1, 260, 64, 0, 0, KVA_F16, KVA_MASK_CAUSAL, 0, 0, 0, CP_PAGED_RR, 64},
};

TEST(cp_simulated_ranks_vs_unsharded) {
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  for (size_t i = 0; i < sizeof cp_cases / sizeof cp_cases[0] && !test_failed_flag; ++i)
    if (test_case_sampled((long)i, (long)(sizeof cp_cases / sizeof cp_cases[0])) && !cp_case(ctx, &cp_cases[i], 0))
      FAIL_("case %zu", i);
  kva_context_destroy(ctx);
}

/* The same on one CUDA device (the paged layout is the CPU's only): the
 * ranks' buffers in device memory, the exchange by device copies. */
TEST(cp_cuda_simulated_ranks) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible (or built without CUDA)");
  kva_context *ctx;
  const kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  for (size_t i = 0; i < sizeof cp_cases / sizeof cp_cases[0] && !test_failed_flag; ++i)
    if (cp_cases[i].layout != CP_PAGED_RR && !cp_case(ctx, &cp_cases[i], 1)) FAIL_("case %zu", i);
  kva_context_destroy(ctx);
}

TEST(cp_bad_input) {
  kva_cp_plan plan;
  ASSERT_ERR(kva_cp_plan_init(&plan, 0, 0, 0, 1, 8, 1, 64, 0), KVA_EINVAL, "ranks");
  ASSERT_ERR(kva_cp_plan_init(&plan, 4, 4, 0, 1, 8, 1, 64, 0), KVA_EINVAL, "rank");
  ASSERT_ERR(kva_cp_plan_init(&plan, 3, 0, 1, 1, 8, 1, 64, 0), KVA_ESHAPE, "H");
  ASSERT_ERR(kva_cp_plan_init(&plan, 2, 0, 2, 1, 8, 1, 64, 0), KVA_EINVAL, "by_head");
  ASSERT_ERR(kva_cp_plan_init(&plan, 2, 0, 0, 1, 8, 1, 64, 4), KVA_EINVAL, "lse_flags");
  ASSERT_ERR(kva_cp_plan_init(NULL, 2, 0, 0, 1, 8, 1, 64, 0), KVA_EINVAL, "plan");
  ASSERT_OK(kva_cp_plan_init(&plan, 2, 1, 1, 1, 8, 2, 64, 0));
  ASSERT_EQ(plan.heads, 4);
  kva_context *ctx;
  ASSERT_OK(kva_context_create(&ctx, NULL));
  float q[8 * 2 * 64], kd[4 * 10 * 64], vd[4 * 10 * 64];
  for (size_t i = 0; i < sizeof q / 4; ++i) q[i] = test_randn();
  for (size_t i = 0; i < sizeof kd / 4; ++i) kd[i] = test_randn(), vd[i] = test_randn();
  kva_tensor tq = kva_tensor_4d(q, KVA_F32, 1, 8, 2, 64);
  kva_kv k = kva_kv_float(kd, KVA_F32, 1, 4, 10, 64), v = kva_kv_float(vd, KVA_F32, 1, 4, 10, 64);
  const kva_kv_view view = kva_view_contiguous(&k, &v, NULL);
  char *send = malloc(plan.send_bytes), *recv = malloc(plan.recv_bytes);
  ASSERT_TRUE(send && recv);
  memset(send, 0x5a, plan.send_bytes);
  ASSERT_ERR(kva_cp_attend(ctx, &plan, &tq, &view, NULL, send, plan.send_bytes - 4, NULL, 0), KVA_EWORKSPACE,
             "send_bytes");
  kva_tensor q3 = kva_tensor_4d(q, KVA_F32, 1, 8, 1, 64);
  ASSERT_ERR(kva_cp_attend(ctx, &plan, &q3, &view, NULL, send, plan.send_bytes, NULL, 0), KVA_ESHAPE, "q.shape[2]");
  ASSERT_ERR(kva_cp_attend(ctx, &plan, &tq, &view, NULL, NULL, plan.send_bytes, NULL, 0), KVA_EINVAL, "send");
  kva_kv k32 = kva_kv_float(kd, KVA_F32, 1, 4, 5, 128);
  const kva_kv_view bad = kva_view_contiguous(&k32, &k32, NULL);
  ASSERT_ERR(kva_cp_attend(ctx, &plan, &tq, &bad, NULL, send, plan.send_bytes, NULL, 0), KVA_ESHAPE, "q.shape[3]");
  for (size_t i = 0; i < plan.send_bytes; ++i)
    if ((unsigned char)send[i] != 0x5a) {
      FAIL_("send written by a failing call (byte %zu)", i);
      break;
    }
  /* an empty part: zeros and -inf */
  ASSERT_OK(kva_cp_attend(ctx, &plan, &tq, NULL, NULL, send, plan.send_bytes, NULL, 0));
  ASSERT_TRUE(((float *)send)[0] == 0.0f && ((float *)(send + plan.send_lse_offset))[15] == -INFINITY);
  float out[4 * 2 * 64], lse[8];
  memset(out, 0x5a, sizeof out);
  kva_tensor to = kva_tensor_4d(out, KVA_F32, 1, 4, 2, 64), wrong = kva_tensor_4d(out, KVA_F32, 1, 8, 1, 64);
  kva_tensor tl = cp_lse_t(lse, 1, 4, 2);
  memset(recv, 0, plan.recv_bytes);
  ASSERT_ERR(kva_cp_merge(ctx, &plan, recv, plan.recv_bytes - 1, &to, &tl), KVA_EWORKSPACE, "recv_bytes");
  ASSERT_ERR(kva_cp_merge(ctx, &plan, recv, plan.recv_bytes, &wrong, &tl), KVA_ESHAPE, "out.shape[1]");
  ASSERT_ERR(kva_cp_merge(ctx, &plan, NULL, plan.recv_bytes, &to, &tl), KVA_EINVAL, "recv");
  kva_cp_plan junk;
  memset(&junk, 0, sizeof junk);
  ASSERT_ERR(kva_cp_merge(ctx, &junk, recv, plan.recv_bytes, &to, &tl), KVA_EINVAL, "plan");
  const unsigned char *ob = (const unsigned char *)out;
  for (size_t i = 0; i < sizeof out; ++i)
    if (ob[i] != 0x5a) {
      FAIL_("out written by a failing merge (byte %zu)", i);
      break;
    }
  free(send), free(recv);
  kva_context_destroy(ctx);
}

/* kva_cp_attention over a real NCCL communicator of one rank (both
 * exchange modes) equals the unsharded call on the device, also captured
 * into a CUDA graph and replayed; bad communicators. Needs NCCL and a device. */
#if !defined(KVA_HAVE_CUDA) || !defined(KVA_HAVE_NCCL)
TEST(cp_nccl_one_rank) {
  kva_context *ctx = NULL;
  kva_cp_plan plan;
  if (kva_cuda_device_count() > 0 && kva_context_create(&ctx, &(kva_context_opts){KVA_BACKEND_CUDA, 0, 0, NULL}) == 0 &&
      kva_cp_plan_init(&plan, 1, 0, 0, 1, 8, 1, 64, 0) == 0) {
    char b[8];
    const int rc = kva_cp_attention(ctx, b, &plan, NULL, NULL, NULL, NULL, NULL, b, b, NULL, 0);
    kva_context_destroy(ctx);
    ASSERT_ERR(rc, KVA_EUNSUPPORTED, "NCCL");
  }
  SKIP("built without NCCL");
}
#else
#include <nccl.h>

TEST(cp_nccl_one_rank) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  ncclUniqueId id;
  ncclComm_t comm;
  ASSERT_TRUE(cudaSetDevice(0) == cudaSuccess);
  ASSERT_TRUE(ncclGetUniqueId(&id) == ncclSuccess && ncclCommInitRank(&comm, 1, id, 0) == ncclSuccess);
  kva_context *ctx;
  const kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  const int64_t B = 2, H = 8, KVH = 4, L = 2, N = 700, D = 128;
  const size_t nq = (size_t)(B * H * L * D), nkv = (size_t)(B * KVH * N * D);
  float *hq = malloc(nq * 4), *hk = malloc(nkv * 4), *hv = malloc(nkv * 4), *ref = malloc(nq * 4), *got = malloc(nq * 4);
  float *rl = malloc(nq / D * 4), *gl = malloc(nq / D * 4);
  ASSERT_TRUE(hq && hk && hv && ref && got && rl && gl);
  for (size_t i = 0; i < nq; ++i) hq[i] = test_randn();
  for (size_t i = 0; i < nkv; ++i) hk[i] = test_randn(), hv[i] = test_randn();
  cpd dm = {{0}, 0};
  kva_tensor q = kva_tensor_4d(cpd_copy(&dm, hq, nq * 4), KVA_F32, B, H, L, D);
  kva_kv k = kva_kv_float(cpd_copy(&dm, hk, nkv * 4), KVA_F32, B, KVH, N, D);
  kva_kv v = kva_kv_float(cpd_copy(&dm, hv, nkv * 4), KVA_F32, B, KVH, N, D);
  kva_tensor out = kva_tensor_4d(cpd_copy(&dm, NULL, nq * 4), KVA_F32, B, H, L, D);
  kva_tensor lse = cp_lse_t(cpd_copy(&dm, NULL, nq / D * 4), B, H, L);
  const kva_kv_view view = kva_view_contiguous(&k, &v, NULL);
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = KVA_MASK_CAUSAL;
  ASSERT_OK(kva_attention_lse(ctx, &q, &view, &p, &out, &lse, 0, NULL, 0));
  ASSERT_TRUE(!cp_copy(1, ref, out.data, nq * 4, 1) && !cp_copy(1, rl, lse.data, nq / D * 4, 1));
  kva_cp_plan plan;
  cudaStream_t s;
  ASSERT_TRUE(cudaStreamCreate(&s) == cudaSuccess);
  ASSERT_OK(kva_context_set_stream(ctx, s));
  for (int by_head = 0; by_head < 2 && !test_failed_flag; ++by_head)
    for (int graph = 0; graph < 2 && !test_failed_flag; ++graph) {
      ASSERT_OK(kva_cp_plan_init(&plan, 1, 0, by_head, B, H, L, D, 0));
      void *send = cpd_copy(&dm, NULL, plan.send_bytes), *recv = cpd_copy(&dm, NULL, plan.recv_bytes);
      ASSERT_TRUE(send && recv && cudaMemset(out.data, 0xff, nq * 4) == cudaSuccess);
      ASSERT_TRUE(cudaDeviceSynchronize() == cudaSuccess);
      if (!graph) {
        ASSERT_OK(kva_cp_attention(ctx, comm, &plan, &q, &view, &p, &out, &lse, send, recv, NULL, 0));
      } else {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        ASSERT_TRUE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
        const int rc = kva_cp_attention(ctx, comm, &plan, &q, &view, &p, &out, &lse, send, recv, NULL, 0);
        ASSERT_TRUE(cudaStreamEndCapture(s, &g) == cudaSuccess);
        ASSERT_OK(rc);
        ASSERT_TRUE(cudaGraphInstantiate(&ge, g, 0) == cudaSuccess && cudaGraphLaunch(ge, s) == cudaSuccess);
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
      }
      ASSERT_TRUE(cudaStreamSynchronize(s) == cudaSuccess);
      ASSERT_TRUE(!cp_copy(1, got, out.data, nq * 4, 1) && !cp_copy(1, gl, lse.data, nq / D * 4, 1));
      double err = 0, mx = 0;
      for (size_t i = 0; i < nq; ++i) err = fmax(err, fabs((double)got[i] - ref[i])), mx = fmax(mx, fabs((double)ref[i]));
      if (!(err <= 1e-6 * mx)) FAIL_("by_head %d graph %d: out differs from the unsharded call by %.3g", by_head, graph, err);
      for (size_t i = 0; i < nq / D; ++i)
        if (!(fabs((double)gl[i] - rl[i]) <= 1e-6 * (1 + fabs((double)rl[i])))) {
          FAIL_("by_head %d graph %d: lse[%zu] = %.7g, unsharded %.7g", by_head, graph, i, gl[i], rl[i]);
          break;
        }
    }
  /* bad input: nothing runs */
  void *send = cpd_copy(&dm, NULL, plan.send_bytes), *recv = cpd_copy(&dm, NULL, plan.recv_bytes);
  ASSERT_ERR(kva_cp_attention(ctx, NULL, &plan, &q, &view, &p, &out, &lse, send, recv, NULL, 0), KVA_EINVAL, "comm");
  kva_cp_plan two;
  ASSERT_OK(kva_cp_plan_init(&two, 2, 0, 0, B, H, L, D, 0));
  ASSERT_ERR(kva_cp_attention(ctx, comm, &two, &q, &view, &p, &out, &lse, send, recv, NULL, 0), KVA_EINVAL, "ranks");
  kva_tensor bad = out;
  bad.shape[1] = 4;
  ASSERT_ERR(kva_cp_attention(ctx, comm, &plan, &q, &view, &p, &bad, &lse, send, recv, NULL, 0), KVA_ESHAPE,
             "out.shape[1]");
  kva_context *cpu;
  ASSERT_OK(kva_context_create(&cpu, NULL));
  ASSERT_ERR(kva_cp_attention(cpu, comm, &plan, &q, &view, &p, &out, &lse, send, recv, NULL, 0), KVA_EINVAL, "CUDA");
  kva_context_destroy(cpu);
  kva_context_set_stream(ctx, NULL);
  cudaStreamDestroy(s);
  cpd_free(&dm);
  free(hq), free(hk), free(hv), free(ref), free(got), free(rl), free(gl);
  kva_context_destroy(ctx);
  ncclCommDestroy(comm);
}
#endif
