/* MLX affine quantize/dequantize, bit for bit against an independent
 * re-implementation of the documented algorithm (docs/mlx-format.md,
 * "Quantize"; checked against mlx/backend/cpu/quantized.cpp), and the f16/bf16
 * conversions against a reference built from double-precision rounding.
 * Every output lives in a strided view inside a larger buffer filled with
 * random bytes: every byte that is not an element of the view is a sentinel. */
#include "attn_check.h" /* att_mutate_* (includes test.h) */

#include <float.h>

/* ------------------------------------------------------------ helpers */
static uint32_t fbits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static float bitsf(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* Bits of the stored element (f32: 32 bits, f16/bf16: 16 bits). */
static uint32_t raw(const void *p, kva_dtype dt) {
  if (dt == KVA_F16 || dt == KVA_BF16) { uint16_t h; memcpy(&h, p, 2); return h; }
  uint32_t u; memcpy(&u, p, 4); return u;
}
/* x rounded to dt, as stored bits. */
static uint32_t to_raw(kva_dtype dt, float x) {
  unsigned char b[4] = {0, 0, 0, 0};
  test_store(b, dt, x);
  return raw(b, dt);
}
static int rnd_int(int lo, int hi) { return lo + (int)(test_rand_u64() % (uint64_t)(hi - lo + 1)); }

static const kva_dtype FLOATS[3] = {KVA_F32, KVA_F16, KVA_BF16};
static const int BITS[3] = {2, 4, 8}, GROUPS[3] = {32, 64, 128};

/* ---------------------------------------------- strided views + sentinels */
#define GUARD 64 /* bytes after the last element */
typedef struct {
  kva_tensor t;
  unsigned char *mem, *orig; /* buffer; its snapshot (view_snap) */
  size_t bytes;
} view;

/* A view of `shape` in a fresh buffer: each row padded by `pad` elements, each
 * leading slice by `pad` more; with `swap` (rank >= 3) dims 0 and 1 are laid
 * out in swapped order. All bytes start random. */
static void view_init(view *v, kva_dtype dt, int nd, const int64_t *shape, int pad, bool swap) {
  memset(v, 0, sizeof *v);
  int64_t es = (int64_t)kva_dtype_size(dt);
  v->t.dtype = dt;
  v->t.ndim = nd;
  for (int d = 0; d < nd; ++d) v->t.shape[d] = shape[d];
  int ord[KVA_MAX_DIMS], nl = nd - 1;
  for (int i = 0; i < nl; ++i) ord[i] = i;
  if (swap && nl >= 2) { ord[0] = 1; ord[1] = 0; }
  int64_t s = (shape[nd - 1] + pad) * es;
  for (int i = nl - 1; i >= 0; --i) {
    v->t.stride[ord[i]] = s;
    s = s * shape[ord[i]] + pad * es;
  }
  v->t.stride[nd - 1] = es;
  v->bytes = (size_t)s + GUARD;
  v->mem = malloc(v->bytes);
  v->orig = malloc(v->bytes);
  for (size_t i = 0; i < v->bytes; ++i) v->mem[i] = (unsigned char)test_rand_u64();
  v->t.data = v->mem;
}
static void view_snap(view *v) { memcpy(v->orig, v->mem, v->bytes); }
static void view_free(view *v) { free(v->mem); free(v->orig); v->mem = v->orig = NULL; }

static int64_t numel(const kva_tensor *t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; ++d) n *= t->shape[d];
  return n;
}
/* Element i (row-major flat index) of t. */
static char *elp(const kva_tensor *t, int64_t i) {
  char *p = (char *)t->data;
  for (int d = t->ndim - 1; d >= 0; --d) {
    p += (i % t->shape[d]) * t->stride[d];
    i /= t->shape[d];
  }
  return p;
}
static int64_t nrows(const kva_tensor *t) { return numel(t) / t->shape[t->ndim - 1]; }
static char *rowp(const kva_tensor *t, int64_t r) { return elp(t, r * t->shape[t->ndim - 1]); }

/* Bytes outside the view's elements that changed since view_snap. */
static int64_t view_guard_damage(const view *v) {
  unsigned char *in = calloc(v->bytes, 1);
  int64_t es = (int64_t)kva_dtype_size(v->t.dtype), n = numel(&v->t), bad = 0;
  for (int64_t i = 0; i < n; ++i) memset(in + (elp(&v->t, i) - (char *)v->mem), 1, (size_t)es);
  for (size_t i = 0; i < v->bytes; ++i) bad += !in[i] && v->mem[i] != v->orig[i];
  free(in);
  return bad;
}
static bool view_unchanged(const view *v) { return memcmp(v->mem, v->orig, v->bytes) == 0; }

/* A random rank-1..4 logical shape with last dim D. */
static int random_shape(int64_t *shape, int64_t D, int maxlead) {
  int nd = rnd_int(1, 4);
  for (int d = 0; d < nd - 1; ++d) shape[d] = rnd_int(1, maxlead);
  shape[nd - 1] = D;
  return nd;
}

/* A quantized operand: views for packed data, scales and biases. */
typedef struct { view data, scales, biases; kva_kv kv; } qviews;
static void qviews_init(qviews *q, int nd, const int64_t *shape, int bits, int gs, kva_dtype sdt,
                        bool strided) {
  int64_t sh[KVA_MAX_DIMS];
  for (int d = 0; d < nd; ++d) sh[d] = shape[d];
  sh[nd - 1] = shape[nd - 1] * bits / 32;
  view_init(&q->data, KVA_U32, nd, sh, strided ? rnd_int(0, 3) : 0, strided && rnd_int(0, 1));
  sh[nd - 1] = shape[nd - 1] / gs;
  view_init(&q->scales, sdt, nd, sh, strided ? rnd_int(0, 3) : 0, strided && rnd_int(0, 1));
  view_init(&q->biases, sdt, nd, sh, strided ? rnd_int(0, 3) : 0, strided && rnd_int(0, 1));
  memset(&q->kv, 0, sizeof q->kv);
  q->kv.data = q->data.t;
  q->kv.scales = q->scales.t;
  q->kv.biases = q->biases.t;
  q->kv.bits = bits;
  q->kv.group_size = gs;
}
static void qviews_snap(qviews *q) {
  view_snap(&q->data);
  view_snap(&q->scales);
  view_snap(&q->biases);
}
static void qviews_free(qviews *q) {
  view_free(&q->data);
  view_free(&q->scales);
  view_free(&q->biases);
}
static int64_t qviews_guard_damage(const qviews *q) {
  return view_guard_damage(&q->data) + view_guard_damage(&q->scales) +
         view_guard_damage(&q->biases);
}
static uint32_t code_at(const kva_tensor *data, int64_t row, int64_t d, int bits) {
  const char *r = rowp(data, row);
  uint32_t w;
  memcpy(&w, r + (d * bits / 32) * 4, 4);
  return (w >> ((d * bits) % 32)) & ((1u << bits) - 1u);
}

/* -------------------------------------- the reference quantizer (the text) */
/* docs/mlx-format.md's quantize for one group, written from the text and MLX's CPU
 * code: wmin/wmax over the group (NaN elements take no part, as with MLX's
 * std::min/std::max from +-inf); scale = max((wmax-wmin)/(2^bits-1), 1e-7) (a
 * NaN range stays NaN); if |wmin| > |wmax| edge = wmin, else negate scale and
 * edge = wmax; q0 = rint(edge/scale); if q0 != 0: scale = edge/q0, bias =
 * edge, else bias = 0; q = clamp(rint((w-bias)/scale), 0, 2^bits-1), a NaN
 * code stored as 0. All in f32. */
static void ref_group(const float *w, int gs, int bits, float *scale, float *bias, uint32_t *q) {
  const float nbins = (float)((1 << bits) - 1);
  float wmin = INFINITY, wmax = -INFINITY;
  for (int j = 0; j < gs; ++j)
    if (!isnan(w[j])) {
      wmin = fminf(wmin, w[j]);
      wmax = fmaxf(wmax, w[j]);
    }
  float s = (wmax - wmin) / nbins;
  if (s < 1e-7f) s = 1e-7f;
  float edge;
  if (fabsf(wmin) > fabsf(wmax)) {
    edge = wmin;
  } else {
    s = -s;
    edge = wmax;
  }
  float q0 = rintf(edge / s), b = 0.0f;
  if (q0 != 0.0f) {
    s = edge / q0;
    b = edge;
  }
  for (int j = 0; j < gs; ++j) {
    float r = rintf((w[j] - b) / s);
    q[j] = (isnan(r) || r <= 0.0f) ? 0u : r >= nbins ? (uint32_t)nbins : (uint32_t)r;
  }
  *scale = s;
  *bias = b;
}
static void ref_pack(const uint32_t *q, int n, int bits, uint32_t *words) {
  memset(words, 0, (size_t)(n * bits / 32) * 4);
  for (int j = 0; j < n; ++j) words[j * bits / 32] |= q[j] << ((j * bits) % 32);
}
static bool same_param(uint32_t a, uint32_t b, kva_dtype dt) {
  if (a == b) return true;
  if (dt == KVA_F32) return isnan(bitsf(a)) && isnan(bitsf(b));
  uint32_t inf = dt == KVA_F16 ? 0x7c00u : 0x7f80u;
  return (a & 0x7fffu) > inf && (b & 0x7fffu) > inf; /* both NaN */
}

/* Compares kva_quantize's output with the reference on every group; returns
 * the number of mismatching words/scales/biases (prints the first few). */
static int64_t check_against_ref(const view *w, const kva_kv *out, const char *label) {
  const int bits = out->bits, gs = out->group_size;
  const int64_t D = w->t.shape[w->t.ndim - 1], rows = nrows(&w->t);
  const kva_dtype sdt = out->scales.dtype;
  const int64_t wsz = (int64_t)kva_dtype_size(w->t.dtype), ssz = (int64_t)kva_dtype_size(sdt);
  int64_t bad = 0;
  float x[128], s, b;
  uint32_t q[128], words[32];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < D / gs; ++g) {
      const char *wr = rowp(&w->t, r);
      for (int j = 0; j < gs; ++j) x[j] = test_load(wr + (g * gs + j) * wsz, w->t.dtype);
      ref_group(x, gs, bits, &s, &b, q);
      ref_pack(q, gs, bits, words);
      const uint32_t *got = (const uint32_t *)rowp(&out->data, r) + g * gs * bits / 32;
      for (int k = 0; k < gs * bits / 32; ++k)
        if (got[k] != words[k] && bad++ < 5)
          fprintf(stderr, "  %s: row %lld group %lld word %d: got %08x want %08x\n", label,
                  (long long)r, (long long)g, k, got[k], words[k]);
      uint32_t gsc = raw(rowp(&out->scales, r) + g * ssz, sdt);
      uint32_t gbi = raw(rowp(&out->biases, r) + g * ssz, sdt);
      if (!same_param(gsc, to_raw(sdt, s), sdt) || !same_param(gbi, to_raw(sdt, b), sdt))
        if (bad++ < 5)
          fprintf(stderr, "  %s: row %lld group %lld: scale/bias %08x/%08x want %08x/%08x "
                  "(%g, %g)\n", label, (long long)r, (long long)g, gsc, gbi, to_raw(sdt, s),
                  to_raw(sdt, b), (double)s, (double)b);
    }
  return bad;
}

/* ------------------------------------------------------- quantize tests */
TEST(quant_known_words) {
  /* Hand-computed: 4 bits, w = j % 16 -> wmin 0, wmax 15, scale -1, bias 15,
   * q = 15 - w; element k of a word at bits 4k. Likewise 2 and 8 bits. */
  static const struct { int bits; uint32_t w0, w1; float scale, bias; } cases[] = {
      {4, 0x89abcdefu, 0x01234567u, -1.0f, 15.0f},
      {2, 0x1b1b1b1bu, 0x1b1b1b1bu, -1.0f, 3.0f},
      {8, 0xfcfdfeffu, 0xf8f9fafbu, -1.0f, 255.0f},
  };
  for (int c = 0; c < 3; ++c) {
    int bits = cases[c].bits;
    float w[32], s, b;
    uint32_t pk[8];
    for (int j = 0; j < 32; ++j) w[j] = bits == 8 ? (float)j : (float)(j % (1 << bits));
    if (bits == 8) w[31] = 255.0f;
    kva_tensor wt = kva_tensor_1d(w, KVA_F32, 32);
    kva_kv out;
    memset(&out, 0, sizeof out);
    out.data = kva_tensor_1d(pk, KVA_U32, bits);
    out.scales = kva_tensor_1d(&s, KVA_F32, 1);
    out.biases = kva_tensor_1d(&b, KVA_F32, 1);
    out.bits = bits;
    out.group_size = 32;
    ASSERT_OK(kva_quantize(&wt, &out));
    ASSERT_EQ(pk[0], cases[c].w0);
    ASSERT_EQ(pk[1], cases[c].w1);
    ASSERT_TRUE(s == cases[c].scale && b == cases[c].bias);
    float back[32];
    kva_tensor bt = kva_tensor_1d(back, KVA_F32, 32);
    ASSERT_OK(kva_dequantize(&out, &bt));
    for (int j = 0; j < 32; ++j) ASSERT_TRUE(back[j] == w[j]);
  }
}

/* Random data with a per-row magnitude and offset (never zeros). */
static float random_value(float mag, float off) { return off + mag * test_randn(); }

TEST(quant_matches_reference) {
  ASSERT_TRUE((float)1e-7 == 1e-7f); /* MLX writes `float eps = 1e-7;` */
  static const float mags[] = {1e-3f, 0.1f, 1.0f, 30.0f, 1e3f};
  for (int bi = 0; bi < 3; ++bi)
    for (int gi = 0; gi < 3; ++gi)
      for (int wi = 0; wi < 3; ++wi)
        for (int si = 0; si < 3; ++si) {
          int bits = BITS[bi], gs = GROUPS[gi];
          kva_dtype wdt = FLOATS[wi], sdt = FLOATS[si];
          int64_t shape[4];
          int nd = random_shape(shape, gs * rnd_int(1, test_quick ? 2 : 3), test_quick ? 2 : 4);
          view w;
          view_init(&w, wdt, nd, shape, rnd_int(0, 3), rnd_int(0, 1));
          int64_t rows = nrows(&w.t), es = (int64_t)kva_dtype_size(wdt);
          for (int64_t r = 0; r < rows; ++r) {
            float mag = mags[rnd_int(0, 4)], off = rnd_int(0, 2) ? 0.0f : mag * test_randu(-3, 3);
            for (int64_t d = 0; d < shape[nd - 1]; ++d)
              test_store(rowp(&w.t, r) + d * es, wdt, random_value(mag, off));
          }
          view_snap(&w);
          qviews o;
          qviews_init(&o, nd, shape, bits, gs, sdt, true);
          qviews_snap(&o);
          char label[64];
          snprintf(label, sizeof label, "bits %d group %d w %s scales %s", bits, gs,
                   kva_dtype_name(wdt), kva_dtype_name(sdt));
          int rc = kva_quantize(&w.t, &o.kv);
          int64_t bad = rc ? -1 : check_against_ref(&w, &o.kv, label);
          int64_t dmg = qviews_guard_damage(&o);
          bool in_ok = view_unchanged(&w);
          view_free(&w);
          qviews_free(&o);
          if (rc) { FAIL_("%s: kva_quantize failed: %s", label, kva_last_error()); return; }
          if (bad || dmg || !in_ok) {
            FAIL_("%s: %lld mismatches, %lld sentinel bytes changed, input %s", label,
                  (long long)bad, (long long)dmg, in_ok ? "intact" : "MODIFIED");
            return;
          }
        }
}

/* Special groups (kinds below), compared with the reference bit for bit. */
#define NSPECIAL 17
static void fill_special(float *x, int gs, int kind) {
  float c = test_randn();
  for (int j = 0; j < gs; ++j) x[j] = test_randn();
  switch (kind) {
  case 0: for (int j = 0; j < gs; ++j) x[j] = c; break;                     /* constant */
  case 1: for (int j = 0; j < gs; ++j) x[j] = 0.0f; break;                  /* all +0 */
  case 2: for (int j = 0; j < gs; ++j) x[j] = -fabsf(c) - 0.25f; break;     /* constant < 0 */
  case 3: for (int j = 0; j < gs; ++j) x[j] = (test_rand_u64() & 1) ? 0.0f : -0.0f; break;
  case 4: for (int j = 0; j < gs; j += 3) x[j] = (j & 1) ? -0.0f : 0.0f; break; /* +-0 mixed in */
  case 5: x[rnd_int(0, gs - 1)] = 1e30f; x[rnd_int(0, gs - 1)] = -1e30f; break; /* very wide */
  case 6: x[rnd_int(0, gs - 1)] = 1e30f; break;
  case 7: x[rnd_int(0, gs - 1)] = -1e30f; break;
  case 8: for (int j = 0; j < gs; ++j) x[j] = 1e-8f * test_randn(); break;  /* tiny range */
  case 9: for (int j = 0; j < gs; ++j) x[j] = c * (1.0f + 1e-8f * test_randu(-1, 1)); break;
  case 10: for (int j = 0; j < gs; ++j) x[j] = test_randu(-3.0f, -1.0f); break; /* max |x| < 0 */
  case 11: for (int j = 0; j < gs; ++j) x[j] = test_randu(-1.0f, 1.0f);
    x[rnd_int(0, gs - 1)] = -2.5f; break;                                   /* |min| > |max| */
  case 12: for (int j = 0; j < gs; ++j) x[j] = 0.5f * (float)rnd_int(-15, 15); /* ties, rint */
    x[0] = -7.5f; x[gs - 1] = 7.5f; break;
  /* Non-finite values: behaviour defined by MLX's operations (see quant.c). */
  case 13: x[rnd_int(0, gs - 1)] = NAN; break;
  case 14: x[rnd_int(0, gs - 1)] = INFINITY; break;
  case 15: for (int j = 0; j < gs; ++j) x[j] = NAN; break;
  case 16: x[0] = -INFINITY; x[gs - 1] = INFINITY; break;
  }
}

TEST(quant_special_groups) {
  for (int bi = 0; bi < 3; ++bi)
    for (int gi = 0; gi < 3; ++gi)
      for (int wi = 0; wi < 3; ++wi)
        for (int si = 0; si < 3; ++si) {
          int bits = BITS[bi], gs = GROUPS[gi];
          kva_dtype wdt = FLOATS[wi], sdt = FLOATS[si];
          int64_t shape[2] = {2, (int64_t)gs * NSPECIAL};
          view w;
          view_init(&w, wdt, 2, shape, rnd_int(0, 2), false);
          int64_t es = (int64_t)kva_dtype_size(wdt);
          float x[128];
          for (int64_t r = 0; r < 2; ++r)
            for (int k = 0; k < NSPECIAL; ++k) {
              fill_special(x, gs, (k + (int)r * 5) % NSPECIAL);
              for (int j = 0; j < gs; ++j)
                test_store(rowp(&w.t, r) + ((int64_t)k * gs + j) * es, wdt, x[j]);
            }
          view_snap(&w);
          qviews o;
          qviews_init(&o, 2, shape, bits, gs, sdt, true);
          qviews_snap(&o);
          char label[64];
          snprintf(label, sizeof label, "special: bits %d group %d w %s scales %s", bits, gs,
                   kva_dtype_name(wdt), kva_dtype_name(sdt));
          int rc = kva_quantize(&w.t, &o.kv);
          int64_t bad = rc ? -1 : check_against_ref(&w, &o.kv, label);
          int64_t dmg = qviews_guard_damage(&o);
          view_free(&w);
          qviews_free(&o);
          if (rc) { FAIL_("%s: kva_quantize failed: %s", label, kva_last_error()); return; }
          if (bad || dmg) {
            FAIL_("%s: %lld mismatches, %lld sentinel bytes changed", label, (long long)bad,
                  (long long)dmg);
            return;
          }
        }
}

TEST(quant_special_values) {
  /* A few outcomes pinned by hand (4 bits, group 32, f32). */
  float w[32], s, b;
  uint32_t pk[4];
  kva_tensor wt = kva_tensor_1d(w, KVA_F32, 32);
  kva_kv out;
  memset(&out, 0, sizeof out);
  out.data = kva_tensor_1d(pk, KVA_U32, 4);
  out.scales = kva_tensor_1d(&s, KVA_F32, 1);
  out.biases = kva_tensor_1d(&b, KVA_F32, 1);
  out.bits = 4;
  out.group_size = 32;
  /* All zero: scale = -1e-7 (negated eps), bias 0, all codes 0. */
  for (int j = 0; j < 32; ++j) w[j] = 0.0f;
  ASSERT_OK(kva_quantize(&wt, &out));
  ASSERT_TRUE(s == -1e-7f && b == 0.0f && fbits(b) == 0);
  for (int k = 0; k < 4; ++k) ASSERT_EQ(pk[k], 0);
  /* Constant 2: range 0 -> scale -eps, edge 2, q0 = -2e7, scale = 2/-2e7,
   * bias 2: every code 0, so dequantize gives exactly 2. */
  for (int j = 0; j < 32; ++j) w[j] = 2.0f;
  ASSERT_OK(kva_quantize(&wt, &out));
  ASSERT_TRUE(b == 2.0f && s == 2.0f / rintf(2.0f / -1e-7f));
  for (int k = 0; k < 4; ++k) ASSERT_EQ(pk[k], 0);
  /* Symmetric -7.5..7.5: edge = wmax (|wmin| == |wmax|), q0 = rint(-7.5) = -8,
   * scale = -0.9375, and wmin's code 16 is clamped to 15. */
  for (int j = 0; j < 32; ++j) w[j] = 0.5f;
  w[0] = -7.5f;
  w[1] = 7.5f;
  ASSERT_OK(kva_quantize(&wt, &out));
  ASSERT_TRUE(s == -0.9375f && b == 7.5f);
  ASSERT_EQ(pk[0] & 0xffu, 0x0fu); /* element 0: 15 (clamped), element 1: 0 */
  /* A NaN element gets code 0 and does not disturb the others. */
  for (int j = 0; j < 32; ++j) w[j] = (float)(j % 16);
  w[3] = NAN;
  ASSERT_OK(kva_quantize(&wt, &out));
  ASSERT_TRUE(s == -1.0f && b == 15.0f);
  ASSERT_EQ(pk[0], 0x89ab0defu);
}

TEST(quant_rows_equal_whole) {
  for (int bi = 0; bi < 3; ++bi)
    for (int gi = 0; gi < 3; ++gi) {
      int bits = BITS[bi], gs = GROUPS[gi];
      kva_dtype wdt = FLOATS[rnd_int(0, 2)], sdt = FLOATS[rnd_int(0, 2)];
      int64_t shape[4] = {2, 3, test_quick ? 2 : 5, (int64_t)gs * rnd_int(1, 3)}, D = shape[3];
      view w;
      view_init(&w, wdt, 4, shape, rnd_int(0, 3), true);
      int64_t n = numel(&w.t);
      for (int64_t i = 0; i < n; ++i) test_store(elp(&w.t, i), wdt, test_randn());
      qviews o;
      qviews_init(&o, 4, shape, bits, gs, sdt, true);
      ASSERT_OK(kva_quantize(&w.t, &o.kv));
      int64_t rows = nrows(&w.t), ssz = (int64_t)kva_dtype_size(sdt), bad = 0;
      int64_t nw = D * bits / 32, ng = D / gs;
      uint32_t *pk = malloc((size_t)nw * 4);
      unsigned char *sc = malloc((size_t)(ng * ssz)), *bb = malloc((size_t)(ng * ssz));
      for (int64_t r = 0; r < rows; ++r) {
        kva_tensor wr = kva_tensor_1d(rowp(&w.t, r), wdt, D);
        kva_kv ro;
        memset(&ro, 0, sizeof ro);
        ro.data = kva_tensor_1d(pk, KVA_U32, nw);
        ro.scales = kva_tensor_1d(sc, sdt, ng);
        ro.biases = kva_tensor_1d(bb, sdt, ng);
        ro.bits = bits;
        ro.group_size = gs;
        if (kva_quantize(&wr, &ro)) { bad++; break; }
        bad += memcmp(pk, rowp(&o.data.t, r), (size_t)nw * 4) != 0;
        bad += memcmp(sc, rowp(&o.scales.t, r), (size_t)(ng * ssz)) != 0;
        bad += memcmp(bb, rowp(&o.biases.t, r), (size_t)(ng * ssz)) != 0;
      }
      free(pk); free(sc); free(bb);
      view_free(&w);
      qviews_free(&o);
      if (bad) {
        FAIL_("bits %d group %d: %lld rows differ from whole-tensor quantization", bits, gs,
              (long long)bad);
        return;
      }
    }
}

/* Unit roundoff of a dtype. */
static double unit_roundoff(kva_dtype dt) {
  return dt == KVA_F16 ? 0x1p-11 : dt == KVA_BF16 ? 0x1p-8 : 0x1p-24;
}

/* |w - dequantize(quantize(w))| per element, with s, b the stored scale and
 * bias, q the code, n = 2^bits - 1, idx = (w - b)/s and dist its distance to
 * [0, n] (nonzero only where the code was clamped):
 *   <= |s| * max(1/2, dist)                    rounding to the grid (clamping)
 *    + u_T (q|s| + |b|)                        storing s, b in T
 *    + u_T (q|s| + |w'|)                       MLX's dequantize: two roundings in T
 *    + 2 u_T (|b| + |w|)                       idx from stored rather than f32 s, b
 *    + 4 u_f32 (|w| + |b| + n|s|)              f32 rounding of (w - b)/s in quantize
 *    + (n + 3) 2^-25 for T = f16               absolute error of f16 subnormals
 * all folded as (6 u_T + 4 u_f32) M, M = |w| + |b| + n|s| (>= each term's
 * operand). The grid must also reach every value to within one step: dist <= 1
 * (far end of the grid overshoots by n/(2r) <= 1 steps, r = |edge|/scale0 >=
 * n/2). */
TEST(quant_roundtrip_error_bound) {
  static const float mags[] = {1e-2f, 1.0f, 1e2f};
  for (int bi = 0; bi < 3; ++bi)
    for (int gi = 0; gi < 3; ++gi)
      for (int wi = 0; wi < 3; ++wi)
        for (int si = 0; si < 3; ++si) {
          int bits = BITS[bi], gs = GROUPS[gi];
          kva_dtype wdt = FLOATS[wi], sdt = FLOATS[si];
          int64_t shape[3] = {test_quick ? 2 : 5, 3, (int64_t)gs * rnd_int(1, 2)};
          int64_t D = shape[2];
          view w, back;
          view_init(&w, wdt, 3, shape, 1, false);
          for (int64_t r = 0; r < nrows(&w.t); ++r) {
            float mag = mags[rnd_int(0, 2)], off = rnd_int(0, 1) ? 0.0f : mag * test_randu(-2, 2);
            for (int64_t d = 0; d < D; ++d) test_store(elp(&w.t, r * D + d), wdt, random_value(mag, off));
          }
          qviews o;
          qviews_init(&o, 3, shape, bits, gs, sdt, true);
          view_init(&back, KVA_F32, 3, shape, 2, true);
          view_snap(&back);
          ASSERT_OK(kva_quantize(&w.t, &o.kv));
          ASSERT_OK(kva_dequantize(&o.kv, &back.t));
          const double n = (double)((1 << bits) - 1), u = unit_roundoff(sdt), uf = 0x1p-24;
          const double sub = sdt == KVA_F16 ? (n + 3) * 0x1p-25 : 0.0;
          int64_t bad = 0, ssz = (int64_t)kva_dtype_size(sdt);
          double worst = 0; /* error / (|s|/2) where not clamped */
          for (int64_t r = 0; r < nrows(&w.t); ++r)
            for (int64_t d = 0; d < D; ++d) {
              double x = test_load(elp(&w.t, r * D + d), wdt), y = test_load(elp(&back.t, r * D + d), KVA_F32);
              double s = test_load(rowp(&o.scales.t, r) + (d / gs) * ssz, sdt);
              double b = test_load(rowp(&o.biases.t, r) + (d / gs) * ssz, sdt);
              double idx = (x - b) / s, dist = idx < 0 ? -idx : idx > n ? idx - n : 0.0;
              double M = fabs(x) + fabs(b) + n * fabs(s), slack = (6 * u + 4 * uf) * M + sub;
              double err = fabs(x - y), allowed = fabs(s) * fmax(0.5, dist) + slack;
              if (dist == 0 && fabs(s) > 0) worst = fmax(worst, err / (0.5 * fabs(s)));
              if (!(err <= allowed) || !(dist * fabs(s) <= fabs(s) + slack)) {
                if (bad++ < 5)
                  fprintf(stderr, "  bits %d group %d %s/%s row %lld d %lld: w %.9g back %.9g "
                          "err %.3g allowed %.3g (s %.6g b %.6g q %u dist %.3g)\n", bits, gs,
                          kva_dtype_name(wdt), kva_dtype_name(sdt), (long long)r, (long long)d,
                          x, y, err, allowed, s, b, code_at(&o.data.t, r, d, bits), dist);
              }
            }
          int64_t dmg = view_guard_damage(&back);
          view_free(&w);
          view_free(&back);
          qviews_free(&o);
          if (bad || dmg) {
            FAIL_("bits %d group %d w %s scales %s: %lld elements over the bound, %lld sentinel "
                  "bytes changed (worst unclamped error %.4f x |s|/2)", bits, gs,
                  kva_dtype_name(wdt), kva_dtype_name(sdt), (long long)bad, (long long)dmg, worst);
            return;
          }
        }
}

/* ------------------------------------------ f16/bf16 rounding reference */
/* Round a double to a binary format with `mant` stored mantissa bits and
 * `ebits` exponent bits (f16: 10, 5; bf16: 7, 8), nearest even, overflow to
 * inf; returns the 16-bit pattern. Independent of the library: it finds the
 * quantum of x's binade (or the subnormal quantum), rounds x/quantum with
 * nearbyint (exact: a power-of-two scaling) and re-encodes. x is not NaN. */
static uint16_t ref_round16(double x, int mant, int ebits) {
  const uint32_t sign = signbit(x) ? 0x8000u : 0u;
  const int bias = (1 << (ebits - 1)) - 1, emin = 1 - bias;
  const uint32_t inf = ((1u << ebits) - 1u) << mant;
  const double maxf = ldexp(2.0 - ldexp(1.0, -mant), bias);
  double a = fabs(x);
  if (isinf(a)) return (uint16_t)(sign | inf);
  if (a == 0) return (uint16_t)sign;
  int e = ilogb(a);
  if (e < emin) e = emin;
  double quantum = ldexp(1.0, e - mant);
  double r = nearbyint(a / quantum) * quantum;
  if (r > maxf) return (uint16_t)(sign | inf);
  if (r < ldexp(1.0, emin)) return (uint16_t)(sign | (uint32_t)(r / ldexp(1.0, emin - mant)));
  int er = ilogb(r);
  uint32_t m = (uint32_t)((r / ldexp(1.0, er) - 1.0) * ldexp(1.0, mant));
  return (uint16_t)(sign | ((uint32_t)(er + bias) << mant) | m);
}
/* Value of a 16-bit pattern; as_normal treats the all-ones exponent as one
 * more binade (for midpoints next to the largest finite value). */
static double dec16(uint32_t h, int mant, int ebits, bool as_normal) {
  const int bias = (1 << (ebits - 1)) - 1;
  const uint32_t emax = (1u << ebits) - 1u, e = (h >> mant) & emax, m = h & ((1u << mant) - 1u);
  double v;
  if (e == emax && !as_normal) v = m ? NAN : INFINITY;
  else if (e == 0) v = ldexp((double)m, 1 - bias - mant);
  else v = ldexp((double)((1u << mant) + m), (int)e - bias - mant);
  return (h & 0x8000u) ? -v : v;
}
static bool is_nan16(uint32_t h, int mant, int ebits) {
  uint32_t inf = ((1u << ebits) - 1u) << mant;
  return (h & 0x7fffu) > inf;
}

typedef struct {
  const char *name;
  int mant, ebits;
  uint16_t (*to16)(float);
  float (*from16)(uint16_t);
} fmt16;
static const fmt16 F16 = {"f16", 10, 5, kva_f32_to_f16, kva_f16_to_f32};
static const fmt16 BF16 = {"bf16", 7, 8, kva_f32_to_bf16, kva_bf16_to_f32};

/* Every 16-bit pattern: decodes to the exact value; back is the identity
 * (NaN stays NaN with its sign). The reference round trips too. */
static int64_t all_patterns(const fmt16 *f) {
  int64_t bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    float x = f->from16((uint16_t)h);
    uint16_t back = f->to16(x);
    bool ok;
    if (is_nan16(h, f->mant, f->ebits)) {
      ok = isnan(x) && !!signbit(x) == !!(h & 0x8000u) && is_nan16(back, f->mant, f->ebits) &&
           (back & 0x8000u) == (h & 0x8000u);
    } else {
      double v = dec16(h, f->mant, f->ebits, false);
      ok = fbits(x) == fbits((float)v) && back == h && ref_round16(v, f->mant, f->ebits) == h;
    }
#ifdef __FLT16_MANT_DIG__
    if (f->mant == 10) {
      _Float16 hv;
      uint16_t h16 = (uint16_t)h;
      memcpy(&hv, &h16, 2);
      float g = (float)hv;
      ok = ok && (isnan(g) ? isnan(x) : fbits(g) == fbits(x));
    }
#endif
    if (!ok && bad++ < 5)
      fprintf(stderr, "  %s pattern %04x -> %08x -> %04x\n", f->name, h, fbits(x), back);
  }
  return bad;
}

static int64_t check_round(const fmt16 *f, float x) {
  uint16_t got = f->to16(x);
  bool ok;
  uint16_t want = 0;
  if (isnan(x)) {
    ok = is_nan16(got, f->mant, f->ebits) && !!(got & 0x8000u) == !!signbit(x);
  } else {
    want = ref_round16((double)x, f->mant, f->ebits);
    ok = got == want;
#ifdef __FLT16_MANT_DIG__
    if (f->mant == 10) {
      _Float16 y = (_Float16)x;
      uint16_t yb;
      memcpy(&yb, &y, 2);
      ok = ok && yb == want;
    }
#endif
  }
  if (!ok) {
    static int shown;
    if (shown++ < 5)
      fprintf(stderr, "  %s(%08x = %.9g) = %04x, want %04x\n", f->name, fbits(x), (double)x, got,
              want);
  }
  return !ok;
}

/* Midpoints between all adjacent values (exact in f32) and their neighbours,
 * random f32 bit patterns, and named special cases. */
static int64_t rounding(const fmt16 *f) {
  int64_t bad = 0;
  const uint32_t inf = ((1u << f->ebits) - 1u) << f->mant;
  for (uint32_t h = 0; h < inf; ++h) {
    double mid = 0.5 * (dec16(h, f->mant, f->ebits, false) + dec16(h + 1, f->mant, f->ebits, true));
    float m = (float)mid;
    if ((double)m != mid) { bad++; continue; } /* the reference itself would be wrong */
    float xs[3] = {m, nextafterf(m, INFINITY), nextafterf(m, 0.0f)};
    for (int i = 0; i < 3; ++i) bad += check_round(f, xs[i]) + check_round(f, -xs[i]);
  }
  int64_t n = test_quick ? 200000 : 4000000;
  for (int64_t i = 0; i < n; ++i) bad += check_round(f, bitsf((uint32_t)test_rand_u64()));
  static const uint32_t special[] = {
      /* 0, inf, f32 max; f32 subnormals; NaNs (also with only low payload bits) */
      0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7f7fffffu, 0xff7fffffu,
      0x00000001u, 0x80000001u, 0x007fffffu, 0x00800000u, 0x00400000u,
      0x7f800001u, 0xff800001u, 0x7fc00000u, 0xffc00000u, 0x7fffffffu, 0xffffffffu,
      0x7f802000u, 0x7f810000u, 0x7fa00000u, 0x7f8000ffu,
      /* f16 max region; f16 subnormal ties and bounds; bf16 max region; ties near 1 */
      0x477fe000u, 0x477fefffu, 0x477ff000u, 0x477ff001u, 0x47800000u,
      0x33000000u, 0x33000001u, 0x32ffffffu, 0x33400000u, 0x33800000u, 0x387fc000u, 0x387fe000u,
      0x38800000u, 0x7f7f8000u, 0x7f7f7fffu, 0x7f7fc000u, 0x3f808000u, 0x3f818000u, 0x3f800001u,
  };
  for (size_t i = 0; i < sizeof special / sizeof special[0]; ++i)
    bad += check_round(f, bitsf(special[i]));
  return bad;
}

TEST(f16_all_patterns) { ASSERT_EQ(all_patterns(&F16), 0); }
TEST(bf16_all_patterns) { ASSERT_EQ(all_patterns(&BF16), 0); }
TEST(f16_round_nearest_even) {
  ASSERT_EQ(kva_f32_to_f16(65519.99f), 0x7bff);
  ASSERT_EQ(kva_f32_to_f16(65520.0f), 0x7c00);
  ASSERT_EQ(kva_f32_to_f16(0x1p-25f), 0x0000);        /* tie to even: 0 */
  ASSERT_EQ(kva_f32_to_f16(0x1.8p-24f), 0x0002);      /* 1.5 quanta: tie to 2 */
  ASSERT_EQ(kva_f32_to_f16(1.0f + 0x1p-11f), 0x3c00); /* tie to even */
  ASSERT_EQ(kva_f32_to_f16(1.0f + 0x1.8p-10f), 0x3c02);
  ASSERT_EQ(rounding(&F16), 0);
}
TEST(bf16_round_nearest_even) {
  ASSERT_EQ(kva_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);   /* tie to even */
  ASSERT_EQ(kva_f32_to_bf16(1.0f + 0x1.8p-7f), 0x3f82); /* tie to even (up) */
  ASSERT_EQ(kva_f32_to_bf16(FLT_MAX), 0x7f80);          /* overflow */
  ASSERT_EQ(rounding(&BF16), 0);
}

/* ------------------------------------------------------------ dequantize */
/* x rounded to dt, from a double (the reference's only rounding primitive). */
static double ref_to(kva_dtype dt, double x) {
  if (isnan(x)) return x; /* e.g. an inf scale times code 0 */
  if (dt == KVA_F32) return (double)(float)x;
  const fmt16 *f = dt == KVA_F16 ? &F16 : &BF16;
  return dec16(ref_round16(x, f->mant, f->ebits), f->mant, f->ebits, false);
}

TEST(dequant_matches_double_reference) {
  for (int oi = 0; oi < 3; ++oi)
    for (int ti = 0; ti < 3; ++ti)
      for (int bi = 0; bi < 3; ++bi)
        for (int gi = 0; gi < 3; ++gi) {
          kva_dtype odt = FLOATS[oi], T = FLOATS[ti];
          int bits = BITS[bi], gs = GROUPS[gi];
          int64_t shape[4];
          int nd = random_shape(shape, gs * rnd_int(1, 3), test_quick ? 2 : 4);
          qviews q;
          qviews_init(&q, nd, shape, bits, gs, T, true);
          int64_t rows = nrows(&q.data.t), nw = shape[nd - 1] * bits / 32, ng = shape[nd - 1] / gs;
          int64_t tsz = (int64_t)kva_dtype_size(T);
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t k = 0; k < nw; ++k) {
              uint32_t word = (uint32_t)test_rand_u64();
              memcpy(rowp(&q.data.t, r) + 4 * k, &word, 4);
            }
            for (int64_t g = 0; g < ng; ++g) {
              /* Some huge scales: the product overflows T (MLX gives inf). */
              float big = T == KVA_F16 ? 3e4f : 1e37f, mag = rnd_int(0, 15) ? 1.0f : big;
              test_store(rowp(&q.scales.t, r) + g * tsz, T, mag * test_randn());
              test_store(rowp(&q.biases.t, r) + g * tsz, T, 4.0f * test_randn());
            }
          }
          qviews_snap(&q);
          view out;
          view_init(&out, odt, nd, shape, rnd_int(0, 3), rnd_int(0, 1));
          view_snap(&out);
          int rc = kva_dequantize(&q.kv, &out.t);
          int64_t bad = 0;
          for (int64_t r = 0; r < rows && !rc; ++r)
            for (int64_t d = 0; d < shape[nd - 1]; ++d) {
              double s = test_load(rowp(&q.scales.t, r) + (d / gs) * tsz, T);
              double b = test_load(rowp(&q.biases.t, r) + (d / gs) * tsz, T);
              uint32_t c = code_at(&q.data.t, r, d, bits);
              /* MLX: multiply(q, scales) then add(biases), each rounded to T;
               * then cast to the output dtype. s*q is exact in double. */
              double v = ref_to(odt, ref_to(T, ref_to(T, s * c) + b));
              uint32_t want = to_raw(odt, (float)v);
              uint32_t got = raw(rowp(&out.t, r) + d * (int64_t)kva_dtype_size(odt), odt);
              if (!same_param(got, want, odt) && bad++ < 5)
                fprintf(stderr, "  out %s scales %s bits %d group %d: row %lld d %lld q %u s %.9g "
                        "b %.9g: got %08x want %08x\n", kva_dtype_name(odt), kva_dtype_name(T),
                        bits, gs, (long long)r, (long long)d, c, s, b, got, want);
            }
          int64_t dmg = view_guard_damage(&out);
          bool in_ok = view_unchanged(&q.data) && view_unchanged(&q.scales) &&
                       view_unchanged(&q.biases);
          view_free(&out);
          qviews_free(&q);
          if (rc || bad || dmg || !in_ok) {
            FAIL_("out %s scales %s bits %d group %d: rc %d (%s), %lld mismatches, %lld sentinel "
                  "bytes changed, input %s", kva_dtype_name(odt), kva_dtype_name(T), bits, gs, rc,
                  rc ? kva_last_error() : "", (long long)bad, (long long)dmg,
                  in_ok ? "intact" : "MODIFIED");
            return;
          }
        }
}

/* ------------------------------------------------------------ bad input */
/* Good operands: w f32 [2,3,64] (buffer room for [2,3,128]), 4-bit group-64
 * output, f16 scales; every case breaks one thing. */
typedef struct {
  float w[2 * 3 * 128];
  uint32_t data[2 * 3 * 8];
  uint16_t scales[6], biases[6];
  kva_tensor wt;
  kva_kv out;
} qsetup;

static void qsetup_init(qsetup *s) {
  for (int i = 0; i < 2 * 3 * 128; ++i) s->w[i] = test_randn();
  for (int i = 0; i < 48; ++i) s->data[i] = (uint32_t)test_rand_u64();
  for (int i = 0; i < 6; ++i) {
    s->scales[i] = (uint16_t)test_rand_u64();
    s->biases[i] = (uint16_t)test_rand_u64();
  }
  s->wt = kva_tensor_4d(s->w, KVA_F32, 1, 2, 3, 64);
  s->wt.ndim = 3; /* [2, 3, 64] */
  for (int d = 0; d < 3; ++d) {
    s->wt.shape[d] = s->wt.shape[d + 1];
    s->wt.stride[d] = s->wt.stride[d + 1];
  }
  memset(&s->out, 0, sizeof s->out);
  s->out.data = s->wt;
  s->out.data.data = s->data;
  s->out.data.dtype = KVA_U32;
  s->out.data.shape[2] = 8;
  s->out.data.stride[1] = 32; s->out.data.stride[0] = 96; s->out.data.stride[2] = 4;
  s->out.scales = s->out.data;
  s->out.scales.data = s->scales;
  s->out.scales.dtype = KVA_F16;
  s->out.scales.shape[2] = 1;
  s->out.scales.stride[2] = 2; s->out.scales.stride[1] = 2; s->out.scales.stride[0] = 6;
  s->out.biases = s->out.scales;
  s->out.biases.data = s->biases;
  s->out.bits = 4;
  s->out.group_size = 64;
}

#define NQCASES 34
static void bad_quant_case(int c) {
  static qsetup s, orig;
  qsetup_init(&s);
  ASSERT_OK(kva_quantize(&s.wt, &s.out)); /* the unbroken setup works */
  qsetup_init(&s);
  orig = s;
  kva_tensor *w = &s.wt;
  kva_kv *o = &s.out;
  const kva_tensor *wp = w;
  kva_kv *op = o;
  int code = 0;
  const char *needle = "";
#define C(n, mutation, want, text) case n: mutation; code = want; needle = text; break;
  switch (c) {
    C(0, wp = NULL, KVA_EINVAL, "w is NULL")
    C(1, op = NULL, KVA_EINVAL, "out is NULL")
    C(2, w->dtype = KVA_U32, KVA_EDTYPE, "w has unsupported dtype")
    C(3, w->dtype = KVA_I32, KVA_EDTYPE, "w ")
    C(4, w->ndim = 0, KVA_ESHAPE, "w ")
    C(5, w->ndim = 5, KVA_ESHAPE, "w ")
    C(6, w->shape[1] = 0, KVA_ESHAPE, "w.shape[1]")
    C(7, w->data = NULL, KVA_EINVAL, "w.data")
    C(8, w->stride[2] = 8, KVA_ESTRIDE, "w:")
    C(9, w->stride[0] = w->stride[1], KVA_ESTRIDE, "w:")
    C(10, o->bits = 3, KVA_EUNSUPPORTED, "out.bits")
    C(11, o->bits = 0, KVA_EUNSUPPORTED, "out.bits")
    C(12, o->bits = 16, KVA_EUNSUPPORTED, "out.bits")
    C(13, o->group_size = 16, KVA_EUNSUPPORTED, "out.group_size")
    C(14, o->group_size = 256, KVA_EUNSUPPORTED, "out.group_size")
    C(15, w->shape[2] = 96; w->stride[1] = 96 * 4; w->stride[0] = 3 * 96 * 4, KVA_ESHAPE,
      "out.group_size")
    C(16, o->data.dtype = KVA_F32, KVA_EDTYPE, "out.data")
    C(17, o->data.ndim = 2, KVA_ESHAPE, "out.data")
    C(18, o->data.shape[0] = 1, KVA_ESHAPE, "out.data.shape[0]")
    C(19, o->data.shape[2] = 7, KVA_ESHAPE, "out.data.shape[2]")
    C(20, o->data.data = NULL, KVA_EINVAL, "out.data")
    C(21, o->data.stride[1] = 4, KVA_ESTRIDE, "out.data")
    C(22, o->scales.dtype = KVA_U32, KVA_EDTYPE, "out.scales")
    C(23, o->scales.shape[2] = 2; o->scales.stride[1] = 4; o->scales.stride[0] = 12, KVA_ESHAPE,
      "out.scales.shape[2]")
    C(24, o->scales.shape[1] = 2, KVA_ESHAPE, "out.scales.shape[1]")
    C(25, o->scales.ndim = 4, KVA_ESHAPE, "out.scales")
    C(26, o->biases.dtype = KVA_BF16, KVA_EDTYPE, "out.biases: dtype bf16 differs")
    C(27, o->biases.shape[0] = 1, KVA_ESHAPE, "out.biases.shape[0]")
    C(28, o->biases.data = NULL, KVA_EINVAL, "out.biases")
    C(29, o->scales.stride[0] = 0, KVA_ESTRIDE, "out.scales")
    C(30, o->scales.data = s.data, KVA_EINVAL, "out.scales overlaps out.data")
    C(31, o->biases.data = s.scales + 1, KVA_EINVAL, "out.biases overlaps out.scales")
    C(32, o->data.data = s.w + 100, KVA_EINVAL, "out.data overlaps w")
    C(33, o->biases.data = s.w + 2, KVA_EINVAL, "out.biases overlaps w")
  }
#undef C
  ASSERT_ERR(kva_quantize(wp, op), code, needle);
  ASSERT_TRUE(memcmp(s.w, orig.w, sizeof s.w) == 0);
  ASSERT_TRUE(memcmp(s.data, orig.data, sizeof s.data) == 0);
  ASSERT_TRUE(memcmp(s.scales, orig.scales, sizeof s.scales) == 0);
  ASSERT_TRUE(memcmp(s.biases, orig.biases, sizeof s.biases) == 0);
}

TEST(quant_bad_input) {
  for (int c = 0; c < NQCASES; ++c) {
    bad_quant_case(c);
    if (test_failed_flag) { FAIL_("in kva_quantize bad-input case %d", c); return; }
  }
}

/* Good operands: 4-bit group-64 q [2,3,8] with bf16 scales, out f32 [2,3,64]. */
/* The dequantize setup: s's output as the input (bf16 scales and biases of
 * random values), out f32 [2,3,64] in outbuf (random). */
static kva_tensor dsetup_init(qsetup *s, float *outbuf) {
  qsetup_init(s);
  s->out.scales.dtype = s->out.biases.dtype = KVA_BF16;
  for (int i = 0; i < 6; ++i) {
    s->scales[i] = kva_f32_to_bf16(test_randn());
    s->biases[i] = kva_f32_to_bf16(test_randn());
  }
  for (int i = 0; i < 384; ++i) outbuf[i] = test_randn();
  kva_tensor ot = s->wt;
  ot.data = outbuf;
  return ot;
}

#define NDCASES 26
static void bad_dequant_case(int c) {
  static qsetup s, orig;
  static float outbuf[2 * 3 * 64], outorig[2 * 3 * 64];
  kva_tensor ot = dsetup_init(&s, outbuf);
  ASSERT_OK(kva_dequantize(&s.out, &ot)); /* the unbroken setup works */
  for (int i = 0; i < 384; ++i) outbuf[i] = test_randn();
  memcpy(outorig, outbuf, sizeof outbuf);
  orig = s;
  kva_kv *q = &s.out;
  kva_tensor *o = &ot;
  const kva_kv *qp = q;
  kva_tensor *op = o;
  int code = 0;
  const char *needle = "";
#define C(n, mutation, want, text) case n: mutation; code = want; needle = text; break;
  switch (c) {
    C(0, qp = NULL, KVA_EINVAL, "q is NULL")
    C(1, op = NULL, KVA_EINVAL, "out is NULL")
    C(2, q->bits = 0, KVA_EUNSUPPORTED, "q.bits")
    C(3, q->bits = 5, KVA_EUNSUPPORTED, "q.bits")
    C(4, q->group_size = 0, KVA_EUNSUPPORTED, "q.group_size")
    C(5, q->data.dtype = KVA_F32, KVA_EDTYPE, "q.data")
    C(6, q->data.ndim = 5, KVA_ESHAPE, "q.data")
    C(7, q->data.data = NULL, KVA_EINVAL, "q.data")
    C(8, q->data.shape[2] = 4, KVA_ESHAPE, "q.group_size")
    C(9, q->data.stride[2] = 8, KVA_ESTRIDE, "q.data")
    C(10, q->data.stride[1] = 0, KVA_ESTRIDE, "q.data")
    C(11, q->scales.dtype = KVA_I32, KVA_EDTYPE, "q.scales")
    C(12, q->scales.shape[1] = 1, KVA_ESHAPE, "q.scales.shape[1]")
    C(13, q->scales.shape[2] = 2; q->scales.stride[1] = 4; q->scales.stride[0] = 12, KVA_ESHAPE,
      "q.scales.shape[2]")
    C(14, q->biases.ndim = 2, KVA_ESHAPE, "q.biases")
    C(15, q->biases.dtype = KVA_F16, KVA_EDTYPE, "q.biases")
    C(16, q->scales.data = NULL, KVA_EINVAL, "q.scales")
    C(17, o->dtype = KVA_U32, KVA_EDTYPE, "out ")
    C(18, o->ndim = 2, KVA_ESHAPE, "out ")
    C(19, o->shape[2] = 32, KVA_ESHAPE, "out.shape[2]")
    C(20, o->shape[0] = 1, KVA_ESHAPE, "out.shape[0]")
    C(21, o->stride[1] = 4, KVA_ESTRIDE, "out:")
    C(22, o->data = NULL, KVA_EINVAL, "out.data")
    C(23, o->data = s.data, KVA_EINVAL, "out overlaps q.data")
    C(24, o->data = s.scales, KVA_EINVAL, "out overlaps q.scales")
    C(25, o->data = s.biases, KVA_EINVAL, "out overlaps q.biases")
  }
#undef C
  ASSERT_ERR(kva_dequantize(qp, op), code, needle);
  ASSERT_TRUE(memcmp(outbuf, outorig, sizeof outbuf) == 0);
  ASSERT_TRUE(memcmp(s.data, orig.data, sizeof s.data) == 0);
  ASSERT_TRUE(memcmp(s.scales, orig.scales, sizeof s.scales) == 0);
  ASSERT_TRUE(memcmp(s.biases, orig.biases, sizeof s.biases) == 0);
}

TEST(dequant_bad_input) {
  for (int c = 0; c < NDCASES; ++c) {
    bad_dequant_case(c);
    if (test_failed_flag) { FAIL_("in kva_dequantize bad-input case %d", c); return; }
  }
}

/* Random bad input to kva_quantize: the good setup broken by one to three
 * random mutations of w and out (att_mutate_tensor / att_mutate_kv: shapes
 * only shrink or become absurd, strides only become invalid, so nothing
 * accepted reaches past the buffers). A refused call leaves every byte of
 * w, data, scales and biases as it was; an accepted one writes, for every
 * row of its w view, exactly the bits of that row quantized alone, at the
 * row's place in its out views, and no other byte. Under ASan and UBSan in
 * `make test`. */
static char *row_at(const kva_tensor *t, const int64_t *idx) {
  char *p = (char *)t->data;
  for (int d = 0; d + 1 < t->ndim; ++d) p += idx[d] * t->stride[d];
  return p;
}
TEST(quant_random_mutations) {
  static qsetup s, orig;
  static uint32_t edata[48];
  static uint16_t escales[6], ebiases[6];
  const int iters = test_quick ? 500 : 3000;
  int accepted = 0;
  for (int it = 0; it < iters && !test_failed_flag; ++it) {
    qsetup_init(&s);
    orig = s;
    const int nm = 1 + att_pick(3);
    for (int m = 0; m < nm; ++m) {
      if (att_pick(2)) att_mutate_tensor(&s.wt);
      else att_mutate_kv(&s.out);
    }
    const int rc = kva_quantize(&s.wt, &s.out);
    if (memcmp(s.w, orig.w, sizeof s.w)) { FAIL_("iteration %d: w modified", it); break; }
    if (rc < 0) {
      if (!kva_last_error()[0]) FAIL_("iteration %d: code %d without a message", it, rc);
      else if (memcmp(s.data, orig.data, sizeof s.data) || memcmp(s.scales, orig.scales, sizeof s.scales) ||
               memcmp(s.biases, orig.biases, sizeof s.biases))
        FAIL_("iteration %d: error %d (%s) but an output byte changed", it, rc, kva_last_error());
      continue;
    }
    ++accepted;
    /* expected: the original bytes, each row of the view quantized alone into its place */
    memcpy(edata, orig.data, sizeof edata);
    memcpy(escales, orig.scales, sizeof escales);
    memcpy(ebiases, orig.biases, sizeof ebiases);
    const kva_tensor *w = &s.wt;
    const int64_t D = w->shape[w->ndim - 1], words = s.out.data.shape[s.out.data.ndim - 1],
                  groups = s.out.scales.shape[s.out.scales.ndim - 1];
    int64_t rows = 1, idx[KVA_MAX_DIMS] = {0, 0, 0, 0};
    for (int d = 0; d + 1 < w->ndim; ++d) rows *= w->shape[d];
    for (int64_t r = 0; r < rows && !test_failed_flag; ++r) {
      for (int64_t x = r, d = w->ndim - 2; d >= 0; --d) { /* row r's leading index */
        idx[d] = x % w->shape[d];
        x /= w->shape[d];
      }
      uint32_t rd[8];
      uint16_t rs[4], rb[4];
      kva_tensor row = kva_tensor_1d(row_at(w, idx), w->dtype, D);
      kva_kv one = s.out;
      one.data = kva_tensor_1d(rd, KVA_U32, words);
      one.scales = kva_tensor_1d(rs, s.out.scales.dtype, groups);
      one.biases = kva_tensor_1d(rb, s.out.biases.dtype, groups);
      if (words > 8 || groups > 4 || kva_quantize(&row, &one)) {
        FAIL_("iteration %d: quantizing row %lld alone: %s", it, (long long)r, kva_last_error());
        break;
      }
      memcpy((char *)edata + (row_at(&s.out.data, idx) - (char *)s.data), rd, (size_t)words * 4);
      memcpy((char *)escales + (row_at(&s.out.scales, idx) - (char *)s.scales), rs,
             (size_t)groups * kva_dtype_size(s.out.scales.dtype));
      memcpy((char *)ebiases + (row_at(&s.out.biases, idx) - (char *)s.biases), rb,
             (size_t)groups * kva_dtype_size(s.out.biases.dtype));
    }
    if (!test_failed_flag && (memcmp(s.data, edata, sizeof edata) || memcmp(s.scales, escales, sizeof escales) ||
                              memcmp(s.biases, ebiases, sizeof ebiases)))
      FAIL_("iteration %d: accepted call wrote other bytes than its rows quantized alone", it);
  }
  fprintf(stderr, "  %d mutated calls, %d accepted\n", iters, accepted);
  if (!test_failed_flag && accepted == 0) FAIL_("no mutated call was accepted (the expected-bytes branch never ran)");
}

/* The same for kva_dequantize: q and out mutated; a refused call leaves q's
 * buffers and out as they were, an accepted one writes each row of its q
 * views dequantized alone at that row's place in out, and nothing else. */
TEST(dequant_random_mutations) {
  static qsetup s, orig;
  static float outbuf[2 * 3 * 64], outorig[2 * 3 * 64], expect[2 * 3 * 64];
  const int iters = test_quick ? 500 : 3000;
  int accepted = 0;
  for (int it = 0; it < iters && !test_failed_flag; ++it) {
    kva_tensor ot = dsetup_init(&s, outbuf);
    memcpy(outorig, outbuf, sizeof outbuf);
    orig = s;
    const int nm = 1 + att_pick(3);
    for (int m = 0; m < nm; ++m) {
      if (att_pick(2)) att_mutate_tensor(&ot);
      else att_mutate_kv(&s.out);
    }
    const int rc = kva_dequantize(&s.out, &ot);
    if (memcmp(s.data, orig.data, sizeof s.data) || memcmp(s.scales, orig.scales, sizeof s.scales) ||
        memcmp(s.biases, orig.biases, sizeof s.biases)) {
      FAIL_("iteration %d: q modified", it);
      break;
    }
    if (rc < 0) {
      if (!kva_last_error()[0]) FAIL_("iteration %d: code %d without a message", it, rc);
      else if (memcmp(outbuf, outorig, sizeof outbuf))
        FAIL_("iteration %d: error %d (%s) but out changed", it, rc, kva_last_error());
      continue;
    }
    ++accepted;
    memcpy(expect, outorig, sizeof expect);
    const int64_t D = ot.shape[ot.ndim - 1], es = (int64_t)kva_dtype_size(ot.dtype);
    int64_t rows = 1, idx[KVA_MAX_DIMS] = {0, 0, 0, 0};
    for (int d = 0; d + 1 < ot.ndim; ++d) rows *= ot.shape[d];
    for (int64_t r = 0; r < rows && !test_failed_flag; ++r) {
      for (int64_t x = r, d = ot.ndim - 2; d >= 0; --d) { /* row r's leading index */
        idx[d] = x % ot.shape[d];
        x /= ot.shape[d];
      }
      float row[64];
      kva_kv one = s.out;
      one.data = kva_tensor_1d(row_at(&s.out.data, idx), KVA_U32, s.out.data.shape[s.out.data.ndim - 1]);
      one.scales = kva_tensor_1d(row_at(&s.out.scales, idx), s.out.scales.dtype, s.out.scales.shape[s.out.scales.ndim - 1]);
      one.biases = kva_tensor_1d(row_at(&s.out.biases, idx), s.out.biases.dtype, s.out.biases.shape[s.out.biases.ndim - 1]);
      kva_tensor dst = kva_tensor_1d(row, ot.dtype, D);
      if (D > 64 || kva_dequantize(&one, &dst)) {
        FAIL_("iteration %d: dequantizing row %lld alone: %s", it, (long long)r, kva_last_error());
        break;
      }
      memcpy((char *)expect + (row_at(&ot, idx) - (char *)outbuf), row, (size_t)(D * es));
    }
    if (!test_failed_flag && memcmp(outbuf, expect, sizeof outbuf))
      FAIL_("iteration %d: accepted call wrote other bytes than its rows dequantized alone", it);
  }
  fprintf(stderr, "  %d mutated calls, %d accepted\n", iters, accepted);
  if (!test_failed_flag && accepted == 0) FAIL_("no mutated call was accepted (the expected-bytes branch never ran)");
}

/* ------------------------------------------------------------ kva_convert */
TEST(convert_strided) {
  for (int si = 0; si < 3; ++si)
    for (int di = 0; di < 3; ++di) {
      kva_dtype sdt = FLOATS[si], ddt = FLOATS[di];
      int nd = rnd_int(3, 4);
      int64_t shape[4];
      for (int d = 0; d < nd; ++d) shape[d] = rnd_int(1, 5);
      shape[nd - 1] = rnd_int(1, 37);
      view src, dst;
      view_init(&src, sdt, nd, shape, rnd_int(0, 3), true);
      view_init(&dst, ddt, nd, shape, rnd_int(0, 3), rnd_int(0, 1));
      int64_t n = numel(&src.t);
      for (int64_t i = 0; i < n; ++i) {
        /* Mostly normal values, some arbitrary bit patterns (NaN, inf, subnormals). */
        float x = rnd_int(0, 7) ? 100.0f * test_randn() : bitsf((uint32_t)test_rand_u64());
        test_store(elp(&src.t, i), sdt, x);
      }
      view_snap(&src);
      view_snap(&dst);
      ASSERT_OK(kva_convert(&src.t, &dst.t));
      int64_t bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        float x = test_load(elp(&src.t, i), sdt);
        uint32_t want = to_raw(ddt, x), got = raw(elp(&dst.t, i), ddt);
        bad += !same_param(got, want, ddt);
      }
      int64_t dmg = view_guard_damage(&dst);
      bool in_ok = view_unchanged(&src);
      view_free(&src);
      view_free(&dst);
      if (bad || dmg || !in_ok) {
        FAIL_("%s -> %s: %lld wrong, %lld sentinel bytes changed, src %s", kva_dtype_name(sdt),
              kva_dtype_name(ddt), (long long)bad, (long long)dmg, in_ok ? "intact" : "MODIFIED");
        return;
      }
    }
}
