/* The oracle: naive attention in double precision over the public
 * descriptors. One query row at a time: scores for every key, masks, softcap,
 * softmax with the sink in the denominator, weighted sum of V. It shares no
 * code with the fast paths (own element loads, own dequantization, own mask
 * rule); it does reuse the argument validation of kva_attention. */
#include "core/attention.h"
#include "cpu/source.h"

#include <math.h>
#include <string.h>

static double ref_half_to_double(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m + 1024, e - 25);
  return (h & 0x8000) ? -v : v;
}
static double ref_bf16_to_double(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static double ref_load(const char *p, kva_dtype dt) {
  switch (dt) {
  case KVA_F32: { float f; memcpy(&f, p, 4); return f; }
  case KVA_F16: { uint16_t h; memcpy(&h, p, 2); return ref_half_to_double(h); }
  case KVA_BF16: { uint16_t h; memcpy(&h, p, 2); return ref_bf16_to_double(h); }
  default: return NAN;
  }
}

/* Element d of one K/V row. row: data row, sc/bi: scales/biases rows. */
static double ref_kv_elem(const kva_kv *kv, const char *row, const char *sc, const char *bi, int64_t d) {
  if (kv->bits == 0) return ref_load(row + d * (int64_t)kva_dtype_size(kv->data.dtype), kv->data.dtype);
  int per = 32 / kv->bits;
  uint32_t w;
  memcpy(&w, row + (d / per) * 4, 4);
  uint32_t code = (w >> ((d % per) * kv->bits)) & ((1u << kv->bits) - 1u);
  int64_t g = d / kv->group_size, es = (int64_t)kva_dtype_size(kv->scales.dtype);
  return ref_load(sc + g * es, kv->scales.dtype) * (double)code + ref_load(bi + g * es, kv->biases.dtype);
}

typedef struct { const char *row, *sc, *bi; } ref_row;

static ref_row ref_contig_row(const kva_kv *kv, int64_t b, int64_t hk, int64_t t) {
  ref_row r = {kva_at4(&kv->data, b, hk, t, 0), NULL, NULL};
  if (kv->bits) {
    r.sc = kva_at4(&kv->scales, b, hk, t, 0);
    r.bi = kva_at4(&kv->biases, b, hk, t, 0);
  }
  return r;
}

static ref_row ref_row_at(const kva_kv_view *view, int which, int64_t b, int64_t hk, int64_t t) {
  if (view->layout == KVA_LAYOUT_PAGED || view->layout == KVA_LAYOUT_BLOCK_TABLE) {
    /* Row addresses only: the layout's own lookup, no attention math. */
    kva_source src;
    kva_span sp;
    if (view->layout == KVA_LAYOUT_PAGED) kva_source_paged(&src, view);
    else kva_source_block_table(&src, view);
    src.span_at(&src, b, hk, t, t + 1, &sp);
    ref_row r = which ? (ref_row){sp.v, sp.vs, sp.vb} : (ref_row){sp.k, sp.ks, sp.kb};
    return r;
  }
  return ref_contig_row(which ? &view->v : &view->k, b, hk, t);
}

/* The written mask rule, evaluated independently of the fast paths. */
static int ref_visible(const kva_problem *p, int64_t b, int64_t i, int64_t j, int64_t len, int64_t h,
                       double *add) {
  *add = 0.0;
  const kva_mask *m = &p->mask;
  if (m->kind == KVA_MASK_NONE) return 1;
  if (m->kind == KVA_MASK_ARRAY) {
    const char *e = (const char *)m->array.data + b * p->mask_stride[0] + h * p->mask_stride[1] +
                    i * p->mask_stride[2] + j * p->mask_stride[3];
    if (m->array.dtype == KVA_BOOL) return *(const uint8_t *)e != 0;
    *add = ref_load(e, m->array.dtype);
    return 1;
  }
  int64_t pos = len - p->L + i;
  int causal = j <= pos, inwin = m->window == 0 || j > pos - m->window;
  if (causal && inwin) return 1;
  if (m->segments.data) {
    const char *srow = (const char *)m->segments.data + b * m->segments.stride[0];
    int32_t sj, sp;
    memcpy(&sj, srow + j * m->segments.stride[1], 4);
    memcpy(&sp, srow + pos * m->segments.stride[1], 4);
    if (sj != 0 && sj == sp && (!m->segments_clamp || inwin)) return 1;
  }
  return 0;
}

int kva_reference_attention(const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *params,
                            kva_tensor *out) {
  return kva_reference_attention_lse(q, kv, params, out, NULL, 0);
}

int kva_reference_attention_lse(const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *params,
                                kva_tensor *out, kva_tensor *lse, unsigned flags) {
  kva_clearerr();
  if (!out) return kva_seterr(KVA_EINVAL, "out is NULL");
  kva_problem p;
  int rc = kva_problem_init(&p, KVA_BACKEND_CPU, q, kv, params, out);
  if (rc < 0) return rc;
  if ((rc = kva_problem_set_lse(&p, lse, flags)) < 0) return rc;
  const kva_kv *K = &kv->k, *V = &kv->v;
  double *s = (double *)malloc((size_t)p.N * sizeof *s);
  double *o = (double *)malloc((size_t)p.Dv * sizeof *o);
  unsigned char *vis = (unsigned char *)malloc((size_t)p.N);
  if (!s || !o || !vis) {
    free(s); free(o); free(vis);
    return kva_seterr(KVA_ENOMEM, "oracle scratch for N = %lld", (long long)p.N);
  }
  for (int64_t b = 0; b < p.B; ++b) {
    int64_t len = kva_problem_len(&p, b);
    for (int64_t h = 0; h < p.H; ++h) {
      int64_t hk = h / p.rep;
      for (int64_t i = 0; i < p.L; ++i) {
        double mx = -INFINITY;
        int any = 0;
        for (int64_t j = 0; j < len; ++j) {
          double add;
          vis[j] = (unsigned char)ref_visible(&p, b, i, j, len, h, &add);
          if (!vis[j]) continue;
          ref_row kr = ref_row_at(kv, 0, b, hk, j);
          double dot = 0.0;
          for (int64_t d = 0; d < p.Dk; ++d)
            dot += ref_load(kva_at4(q, b, h, i, d), q->dtype) * ref_kv_elem(K, kr.row, kr.sc, kr.bi, d);
          double x = (double)p.scale * dot;
          if (p.softcap > 0) x = (double)p.softcap * tanh(x / (double)p.softcap);
          x += add;
          if (x == -INFINITY) { vis[j] = 0; continue; }
          s[j] = x;
          any = 1;
          if (isnan(x)) mx = NAN;            /* NaN logits make the row NaN */
          else if (x > mx) mx = x;
        }
        double sink = p.sinks ? (double)p.sinks[h] : -INFINITY;
        for (int64_t d = 0; d < p.Dv; ++d) o[d] = 0.0;
        double row_lse = -INFINITY; /* log of the softmax denominator (sink included) */
        if (any) {
          if (sink > mx) mx = sink;
          double den = p.sinks ? exp(sink - mx) : 0.0;
          for (int64_t j = 0; j < len; ++j) {
            if (!vis[j]) continue;
            double e = exp(s[j] - mx);
            den += e;
            ref_row vr = ref_row_at(kv, 1, b, hk, j);
            for (int64_t d = 0; d < p.Dv; ++d) o[d] += e * ref_kv_elem(V, vr.row, vr.sc, vr.bi, d);
          }
          for (int64_t d = 0; d < p.Dv; ++d) o[d] /= den;
          row_lse = mx + log(den);
        }
        if (lse) {
          char *dst = (char *)lse->data + b * lse->stride[0] + h * lse->stride[1] + i * lse->stride[2];
          *(float *)dst = (float)(p.lse_base2 ? row_lse / 0.69314718055994530942 : row_lse);
        }
        for (int64_t d = 0; d < p.Dv; ++d) {
          char *dst = kva_at4(out, b, h, i, d);
          switch (out->dtype) {
          case KVA_F32: *(float *)dst = (float)o[d]; break;
          default: kva_store_f(dst, out->dtype, (float)o[d]); break; /* one rounding via f32 */
          }
        }
      }
    }
  }
  free(s); free(o); free(vis);
  return 0;
}
