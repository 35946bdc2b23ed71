/* Helpers of the paged KV tests: formats, random rows, expected-content caches. */
#include "test_paged.h"

void tp_fmt_str(const tp_fmt *f, char *buf, size_t n) {
  if (f->bits) snprintf(buf, n, "q%d/g%d/%s", f->bits, f->group, kva_dtype_name(f->dtype));
  else snprintf(buf, n, "%s", kva_dtype_name(f->dtype));
}

kva_pool_desc tp_desc(tp_fmt f, int64_t blocks, int64_t block_size, int64_t KVH, int64_t dk, int64_t dv) {
  kva_pool_desc d;
  memset(&d, 0, sizeof d);
  d.num_blocks = blocks;
  d.block_size = block_size;
  d.kv_heads = KVH;
  d.dk = dk;
  d.dv = dv;
  d.dtype = f.dtype;
  d.bits = f.bits;
  d.group_size = f.bits ? f.group : 0;
  return d;
}

#define TP_ROW_PAD 8 /* extra elements per row of strided rows */

static void store_f(char *p, kva_dtype dt, float x) {
  if (dt == KVA_F32) memcpy(p, &x, 4);
  else {
    uint16_t h = dt == KVA_F16 ? kva_f32_to_f16(x) : kva_f32_to_bf16(x);
    memcpy(p, &h, 2);
  }
}

kva_tensor tp_rows(kva_dtype dt, int64_t KVH, int64_t T, int64_t D, int strided) {
  int64_t es = (int64_t)kva_dtype_size(dt), rowe = D + (strided ? TP_ROW_PAD : 0);
  char *mem = (char *)malloc((size_t)(KVH * T * rowe * es));
  kva_tensor t;
  memset(&t, 0, sizeof t);
  t.data = mem;
  t.dtype = dt;
  t.ndim = 3;
  t.shape[0] = KVH;
  t.shape[1] = T;
  t.shape[2] = D;
  t.stride[2] = es;
  t.stride[1] = rowe * es;
  t.stride[0] = T * rowe * es;
  if (!mem) return t;
  memset(mem, 0x7f, (size_t)(KVH * T * rowe * es));
  for (int64_t h = 0; h < KVH; ++h)
    for (int64_t i = 0; i < T; ++i) {
      float off = 0.5f * test_randn();
      for (int64_t e = 0; e < D; ++e)
        store_f(mem + h * t.stride[0] + i * t.stride[1] + e * es, dt, off + test_randn());
    }
  return t;
}

void tp_rows_free(kva_tensor *t) {
  free(t->data);
  t->data = NULL;
}

kva_tensor tp_rows_slice(const kva_tensor *t, int64_t t0, int64_t n) {
  kva_tensor s = *t;
  s.data = (char *)t->data + t0 * t->stride[1];
  s.shape[1] = n;
  return s;
}

int tp_kv_alloc(tp_kv *c, const kva_pool_desc *d, int is_v, int64_t B, int64_t cap) {
  memset(c, 0, sizeof *c);
  int64_t D = is_v ? d->dv : d->dk;
  int64_t words = d->bits ? D * d->bits / 32 : D, groups = d->bits ? D / d->group_size : 1;
  size_t n = (size_t)(B * d->kv_heads * cap);
  c->mem[0] = malloc(n * (size_t)words * (d->bits ? 4 : kva_dtype_size(d->dtype)));
  c->mem[1] = malloc(n * (size_t)groups * kva_dtype_size(d->dtype));
  c->mem[2] = malloc(n * (size_t)groups * kva_dtype_size(d->dtype));
  if (!c->mem[0] || !c->mem[1] || !c->mem[2]) return -1;
  if (d->bits)
    c->kv = kva_kv_quantized(c->mem[0], c->mem[1], c->mem[2], d->dtype, d->bits, d->group_size, B, d->kv_heads,
                             cap, D);
  else c->kv = kva_kv_float(c->mem[0], d->dtype, B, d->kv_heads, cap, D);
  return 0;
}

void tp_kv_free(tp_kv *c) {
  for (int i = 0; i < 3; ++i) free(c->mem[i]);
  memset(c, 0, sizeof *c);
}

static kva_tensor slice4(const kva_tensor *t, int64_t b, int64_t t0, int64_t n) {
  kva_tensor s = *t;
  s.data = (char *)t->data + b * t->stride[0] + t0 * t->stride[2];
  s.shape[0] = 1;
  s.shape[2] = n;
  return s;
}

kva_kv tp_kv_slice(const tp_kv *c, int64_t b, int64_t t0, int64_t n) {
  kva_kv s = c->kv;
  s.data = slice4(&c->kv.data, b, t0, n);
  if (c->kv.bits) {
    s.scales = slice4(&c->kv.scales, b, t0, n);
    s.biases = slice4(&c->kv.biases, b, t0, n);
  }
  return s;
}

int tp_kv_store(tp_kv *c, int64_t b, int64_t t0, const kva_tensor *rows) {
  kva_tensor w = *rows; /* [KVH, T, D] as [1, KVH, T, D] */
  w.ndim = 4;
  for (int d = 2; d >= 0; --d) {
    w.shape[d + 1] = rows->shape[d];
    w.stride[d + 1] = rows->stride[d];
  }
  w.shape[0] = 1;
  w.stride[0] = rows->stride[0] * rows->shape[0];
  kva_kv dst = tp_kv_slice(c, b, t0, rows->shape[1]);
  return dst.bits ? kva_quantize(&w, &dst) : kva_convert(&w, &dst.data);
}

static int rows_equal(const kva_tensor *a, int64_t ba, int64_t ta, const kva_tensor *b, int64_t bb, int64_t tb,
                      int64_t n, const char *what, const char *part) {
  size_t bytes = (size_t)a->shape[3] * kva_dtype_size(a->dtype);
  for (int64_t h = 0; h < a->shape[1]; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const char *pa = (const char *)a->data + ba * a->stride[0] + h * a->stride[1] + (ta + i) * a->stride[2];
      const char *pb = (const char *)b->data + bb * b->stride[0] + h * b->stride[1] + (tb + i) * b->stride[2];
      if (memcmp(pa, pb, bytes)) {
        fprintf(stderr, "    %s: %s differs at head %lld, token %lld of %lld\n", what, part, (long long)h,
                (long long)i, (long long)n);
        return 0;
      }
    }
  return 1;
}

int tp_kv_equal(const tp_kv *a, int64_t ba, int64_t ta, const tp_kv *b, int64_t bb, int64_t tb, int64_t n,
                const char *what) {
  if (!rows_equal(&a->kv.data, ba, ta, &b->kv.data, bb, tb, n, what, "data")) return 0;
  if (!a->kv.bits) return 1;
  return rows_equal(&a->kv.scales, ba, ta, &b->kv.scales, bb, tb, n, what, "scales") &&
         rows_equal(&a->kv.biases, ba, ta, &b->kv.biases, bb, tb, n, what, "biases");
}

static void rows_copy(const kva_tensor *d, int64_t db, int64_t dt, const kva_tensor *s, int64_t sb, int64_t st,
                      int64_t n) {
  size_t bytes = (size_t)s->shape[3] * kva_dtype_size(s->dtype);
  for (int64_t h = 0; h < s->shape[1]; ++h)
    for (int64_t i = 0; i < n; ++i)
      memcpy((char *)d->data + db * d->stride[0] + h * d->stride[1] + (dt + i) * d->stride[2],
             (const char *)s->data + sb * s->stride[0] + h * s->stride[1] + (st + i) * s->stride[2], bytes);
}

void tp_kv_copy(tp_kv *dst, int64_t db, int64_t dt, const tp_kv *src, int64_t sb, int64_t st, int64_t n) {
  rows_copy(&dst->kv.data, db, dt, &src->kv.data, sb, st, n);
  if (!src->kv.bits) return;
  rows_copy(&dst->kv.scales, db, dt, &src->kv.scales, sb, st, n);
  rows_copy(&dst->kv.biases, db, dt, &src->kv.biases, sb, st, n);
}

int tp_gather(const kva_paged_view *view, int64_t b, tp_kv *k, tp_kv *v, int64_t cb) {
  kva_paged_csr csr;
  int rc = kva_paged_view_csr(view, &csr);
  if (rc) return rc;
  kva_kv ks = tp_kv_slice(k, cb, 0, csr.lens[b]), vs = tp_kv_slice(v, cb, 0, csr.lens[b]);
  return kva_paged_view_gather(view, b, &ks, &vs);
}
