/* The bench's oracle check. On a sample of (sequence, KV head) pairs (first
 * and last KV head of the first and last sequence) it builds sub-view
 * descriptors into the same q / K / V buffers the timed calls read, runs
 * the double-precision oracle on them (kva_reference_attention_rounded,
 * with the query rounding the kernel's name states: query_rounding), split over the
 * tool's threads, and compares every output row of the checked query heads
 * (the first two and the last head of each sampled group) with the kernel's
 * output:
 *   max_rel_err = max over rows of max_d |out - ref| / max_d |ref|
 *   rel_l2      = max over rows of ||out - ref||_2 / ||ref||_2
 * Random data makes the softmax diffuse, which would hide a kernel that sees
 * one key too many or too few; so before timing, the queries of the sampled
 * heads are replaced by probes built from the keys themselves:
 *   own probe  (first query head of the group), row i at position p:
 *              q = a * k_p: key p (the last one the row may see) scores about
 *              PROBE_LOGIT and carries a large share of the row's weight;
 *   next probe (second query head), rows i < L-1:
 *              q = a * k_{p+1}: the first key the mask hides scores about
 *              PROBE_LOGIT, so a kernel that lets it through is far off.
 * (With a = PROBE_LOGIT / (scale |k|^2) the other keys' logits spread with
 * standard deviation ~ PROBE_LOGIT / sqrt(Dk), so the target key still holds
 * ~40% of the weight against 128k diffuse keys at Dk = 128.) The other heads
 * keep their random queries. */
#include "bench.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define PROBE_LOGIT 12.0 /* target logit, in units of the scaled q.k */
#define MAX_SAMPLES 4
#define CHECK_LEAD_HEADS 2 /* the probe heads: first two of a group */

typedef struct sample {
  int64_t b, hk;
} sample;

/* First and last KV head of the first and last sequence, without repeats. */
static int samples(const kb_case *c, sample *s) {
  int n = 0;
  int64_t bs[2] = {0, c->B - 1}, hs[2] = {0, c->KVH - 1};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      bool dup = false;
      for (int k = 0; k < n; ++k) dup |= s[k].b == bs[i] && s[k].hk == hs[j];
      if (!dup) s[n++] = (sample){bs[i], hs[j]};
    }
  return n;
}

/* A view of rows [t0, t0+n) of one (b, hk) of a tensor [B, KVH, N, X]. */
static kva_tensor sub_rows(const kva_tensor *t, int64_t b, int64_t hk, int64_t t0, int64_t n) {
  kva_tensor s = *t;
  s.data = (char *)t->data + b * t->stride[0] + hk * t->stride[1] + t0 * t->stride[2];
  s.shape[0] = 1, s.shape[1] = 1, s.shape[2] = n;
  return s;
}

static kva_kv sub_kv(const kva_kv *kv, int64_t b, int64_t hk, int64_t t0, int64_t n) {
  kva_kv s = *kv;
  s.data = sub_rows(&kv->data, b, hk, t0, n);
  if (!kv->bits && kv->scales.data) s.scales = sub_rows(&kv->scales, b, hk, t0, n); /* fp8 rows */
  if (kv->bits) {
    s.scales = sub_rows(&kv->scales, b, hk, t0, n);
    s.biases = sub_rows(&kv->biases, b, hk, t0, n);
  }
  return s;
}

/* Heads [h0, h0+nh) of sequence b of a tensor [B, H, L, D]. */
static kva_tensor sub_heads(const kva_tensor *t, int64_t b, int64_t h0, int64_t nh) {
  kva_tensor s = *t;
  s.data = (char *)t->data + b * t->stride[0] + h0 * t->stride[1];
  s.shape[0] = 1, s.shape[1] = nh;
  return s;
}

/* Address of element (b, h, i, d) of a rank-4 tensor. */
static char *at4(const kva_tensor *t, int64_t b, int64_t h, int64_t i, int64_t d) {
  return (char *)t->data + b * t->stride[0] + h * t->stride[1] + i * t->stride[2] +
         d * t->stride[3];
}

/* Keys of rows [N-L, N) of (b, hk) as f32 [L, Dk]. */
static int last_keys(const kb_case *c, const kva_kv *k, int64_t b, int64_t hk, float *dst) {
  kva_kv s = sub_kv(k, b, hk, c->N - c->L, c->L);
  kva_tensor out = kva_tensor_4d(dst, KVA_F32, 1, 1, c->L, c->Dk);
  if (k->bits || kb_is_fp8(k->data.dtype)) return kva_dequantize(&s, &out);
  return kva_convert(&s.data, &out);
}

static double dot(const float *a, const float *b, int64_t n) {
  double s = 0;
  for (int64_t d = 0; d < n; ++d) s += (double)a[d] * b[d];
  return s;
}

/* q[b, h, i, :] = a * sum_{j in [j0, j1)} keys[j], a chosen so that each key's
 * logit is about PROBE_LOGIT. */
static void write_probe(const kb_case *c, kva_tensor *q, int64_t b, int64_t h, int64_t i,
                        const float *keys, int64_t j0, int64_t j1, float *acc) {
  const double scale = 1.0 / sqrt((double)c->Dk); /* kva_attn_defaults(): scale 0 */
  double norm2 = 0;
  memset(acc, 0, (size_t)c->Dk * sizeof *acc);
  for (int64_t j = j0; j < j1; ++j) {
    const float *kj = keys + j * c->Dk;
    norm2 += dot(kj, kj, c->Dk);
    for (int64_t d = 0; d < c->Dk; ++d) acc[d] += kj[d];
  }
  norm2 /= (double)(j1 - j0);
  double a = norm2 > 0 ? PROBE_LOGIT / (scale * norm2) : 1.0;
  for (int64_t d = 0; d < c->Dk; ++d) kb_store_f(at4(q, b, h, i, d), q->dtype, (float)(a * acc[d]));
}

int kb_write_probes(const kb_case *c, const kb_cacheset *cs, kva_tensor *q_host, char *err,
                    size_t errn) {
  kva_kv k, v;
  kb_cacheset_kv(cs, -1, &k, &v);
  int64_t rep = c->H / c->KVH;
  float *keys = malloc((size_t)(c->L * c->Dk) * sizeof(float));
  float *acc = malloc((size_t)c->Dk * sizeof(float));
  sample s[MAX_SAMPLES];
  int ns = samples(c, s), rc = 0;
  for (int k_ = 0; k_ < ns && rc == 0 && keys && acc; ++k_) {
    rc = last_keys(c, &k, s[k_].b, s[k_].hk, keys);
    if (rc < 0) {
      snprintf(err, errn, "reading keys for the probes: %s", kva_last_error());
      break;
    }
    int64_t h0 = s[k_].hk * rep;
    /* With one query head per KV head, verify (L > 1) uses it for the next probe. */
    bool own = rep >= 2 || c->L == 1, next = c->L > 1;
    int64_t hn = rep >= 2 ? h0 + 1 : h0;
    for (int64_t i = 0; i < c->L; ++i) {
      if (own) write_probe(c, q_host, s[k_].b, h0, i, keys, i, i + 1, acc);
      if (next && i < c->L - 1) write_probe(c, q_host, s[k_].b, hn, i, keys, i + 1, i + 2, acc);
    }
  }
  if (!keys || !acc) {
    snprintf(err, errn, "out of memory");
    rc = KVA_ENOMEM;
  }
  free(keys);
  free(acc);
  return rc;
}

/* One unit of the check: query heads [h0, h0 + nh) of group (b, hk). */
typedef struct check_item {
  int64_t b, hk, h0, nh;
  /* results */
  int rc;
  char err[200];
  double max_rel, rel_l2;
  int rows;
  bool nonfinite;
} check_item;

typedef struct check_job {
  const kb_case *c;
  kva_kv k, v;
  const kva_tensor *q, *out;
  const kva_attn_params *p;
  kva_ref_rounding rr; /* the query rounding the kernel's bracket names (query_rounding) */
  check_item items[2 * MAX_SAMPLES];
  int n_items, threads;
} check_job;

static void check_one(const check_job *j, check_item *it) {
  const kb_case *c = j->c;
  int64_t rep = c->H / c->KVH;
  float *ref = malloc((size_t)(it->nh * c->L * c->Dv) * sizeof(float));
  if (!ref) {
    it->rc = KVA_ENOMEM;
    snprintf(it->err, sizeof it->err, "out of memory");
    return;
  }
  kva_kv ks = sub_kv(&j->k, it->b, it->hk, 0, c->N), vs = sub_kv(&j->v, it->b, it->hk, 0, c->N);
  kva_kv_view view = kva_view_contiguous(&ks, &vs, NULL);
  kva_tensor qs = sub_heads(j->q, it->b, it->hk * rep + it->h0, it->nh);
  kva_tensor rt = kva_tensor_4d(ref, KVA_F32, 1, it->nh, c->L, c->Dv);
  it->rc = kva_reference_attention_rounded(&qs, &view, j->p, &rt, NULL, 0, &j->rr);
  if (it->rc < 0) {
    snprintf(it->err, sizeof it->err, "kva_reference_attention_rounded: %s", kva_last_error());
    free(ref);
    return;
  }
  for (int64_t h = 0; h < it->nh; ++h)
    for (int64_t i = 0; i < c->L; ++i) {
      const float *rr = ref + (h * c->L + i) * c->Dv;
      const int64_t head = it->hk * rep + it->h0 + h;
      double max_err = 0, max_ref = 0, err2 = 0, ref2 = 0;
      for (int64_t d = 0; d < c->Dv; ++d) {
        double o = kb_load_f(at4(j->out, it->b, head, i, d), j->out->dtype);
        if (!isfinite(o)) it->nonfinite = true;
        double e = fabs(o - rr[d]);
        max_err = fmax(max_err, e), max_ref = fmax(max_ref, fabs(rr[d]));
        err2 += e * e, ref2 += (double)rr[d] * rr[d];
      }
      /* All-zero reference rows cannot occur with random data; then use the absolute error. */
      double rel = max_ref > 0 ? max_err / max_ref : max_err;
      double l2 = ref2 > 0 ? sqrt(err2 / ref2) : sqrt(err2);
      it->max_rel = fmax(it->max_rel, rel);
      it->rel_l2 = fmax(it->rel_l2, l2);
      it->rows++;
    }
  free(ref);
}

static void check_thread(void *arg, int t) {
  check_job *j = arg;
  for (int i = t; i < j->n_items; i += j->threads) check_one(j, &j->items[i]);
}

/* The oracle's query rounding for a kernel name: "q intN" with N <= 8 in
 * its trailing bracket (kvattn.h, kva_attention_kernel) rounds the query to
 * N-bit integers per (vector, K group) as that kernel does; the exact
 * oracle otherwise (wider integer queries and 16-bit operands are within
 * the check's tolerance of it). */
static kva_ref_rounding query_rounding(const char *kernel) {
  kva_ref_rounding r = {0, KVA_F32, KVA_F32, KVA_F32};
  const char *b = strrchr(kernel, '['), *q = b ? strstr(b, "q int") : NULL;
  if (q) {
    const int n = atoi(q + 5);
    if (n >= 2 && n <= 8) r.q_int_bits = n;
  }
  return r;
}

int kb_check(const kb_case *c, const kb_cacheset *cs, const kva_tensor *q_host,
             const kva_tensor *out_host, const kva_attn_params *p, int threads, kb_result *r,
             char *err, size_t errn) {
  check_job *j = calloc(1, sizeof *j);
  if (!j) {
    snprintf(err, errn, "out of memory");
    return KVA_ENOMEM;
  }
  j->c = c, j->q = q_host, j->out = out_host, j->p = p;
  j->rr = query_rounding(r->kernel);
  kb_cacheset_kv(cs, -1, &j->k, &j->v);
  /* Per sampled group: the two probe heads (first two of the group) and the
   * last head, which catches a wrong query-head -> KV-head mapping. */
  int64_t rep = c->H / c->KVH, first = rep < CHECK_LEAD_HEADS ? rep : CHECK_LEAD_HEADS;
  sample s[MAX_SAMPLES];
  int ns = samples(c, s);
  for (int k = 0; k < ns; ++k) {
    j->items[j->n_items++] = (check_item){.b = s[k].b, .hk = s[k].hk, .h0 = 0, .nh = first};
    if (rep > first)
      j->items[j->n_items++] = (check_item){.b = s[k].b, .hk = s[k].hk, .h0 = rep - 1, .nh = 1};
  }
  j->threads = threads < 1 ? 1 : threads > j->n_items ? j->n_items : threads;
  kb_parallel(j->threads, check_thread, j);
  int rc = 0;
  r->max_rel_err = 0, r->rel_l2 = 0, r->checked_rows = 0, r->nonfinite = false;
  for (int i = 0; i < j->n_items; ++i) {
    const check_item *it = &j->items[i];
    if (it->rc < 0 && rc == 0) {
      rc = it->rc;
      snprintf(err, errn, "%s", it->err);
    }
    r->max_rel_err = fmax(r->max_rel_err, it->max_rel);
    r->rel_l2 = fmax(r->rel_l2, it->rel_l2);
    r->checked_rows += it->rows;
    r->nonfinite |= it->nonfinite;
  }
  free(j);
  return rc;
}
