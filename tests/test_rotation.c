/* Hadamard-rotated KV (kvattn.h: kva_hadamard, KVA_ATTN_ROTATED_K / _V,
 * kva_cache_write_ex): the transform against its definition (a naive
 * O(D^2) double H and the documented f32 arithmetic, bit for bit), H H = I,
 * the rotated call against the oracle's rotated call on every layout
 * (contiguous, block table, paged), float and quantized caches, decode and
 * verify, GQA, masks, softcap, sinks, lse, random and probe queries, and
 * against the unrotated call on the unrotated cache; cascade and context-
 * parallel calls with the flags; the rotating cache
 * write against kva_hadamard + kva_cache_write; bad input. The cuda_*
 * tests repeat the transform, the write (bit for bit with the CPU) and the
 * rotated call on the device. */
#include "attn_check.h"
#include "lse_check.h"

#define F32 KVA_F32
#define F16 KVA_F16
#define BF16 KVA_BF16
#define ROT_KV (KVA_ATTN_ROTATED_K | KVA_ATTN_ROTATED_V)

static const int64_t DIMS[] = {16, 32, 64, 128, 256, 512, 48, 96, 192, 384};
#define NDIMS ((int)(sizeof DIMS / sizeof DIMS[0]))
static const int64_t BAD_DIMS[] = {2, 8, 24, 80, 112, 640, 1024};
#define NBAD ((int)(sizeof BAD_DIMS / sizeof BAD_DIMS[0]))
static const kva_dtype FLOATS[3] = {F32, F16, BF16};

/* ---- the definition */
/* H_D[a][b] (kvattn.h): Sylvester on the power-of-two block m, times
 * H_3[i][j] = 2/3 - [i == j] for D = 3m. */
static double h_elem(int64_t D, int64_t a, int64_t b) {
  const int64_t m = D % 3 == 0 ? D / 3 : D;
  double v = (__builtin_popcountll((unsigned long long)((a % m) & (b % m))) & 1 ? -1.0 : 1.0) / sqrt((double)m);
  if (m != D) v *= 2.0 / 3.0 - (a / m == b / m ? 1.0 : 0.0);
  return v;
}
/* The documented f32 arithmetic (kvattn.h, kva_hadamard), written out here. */
static void t_fwht_f32(float *x, int64_t D) {
  const int64_t m = D % 3 == 0 ? D / 3 : D;
  for (int64_t h = 1; h < m; h <<= 1)
    for (int64_t i = 0; i < D; ++i)
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
  if (m != D)
    for (int64_t a = 0; a < m; ++a) {
      const float u0 = x[a], u1 = x[m + a], u2 = x[2 * m + a], s = (u0 + u1) + u2;
      x[a] = (s + s) - ((u0 + u0) + u0);
      x[m + a] = (s + s) - ((u1 + u1) + u1);
      x[2 * m + a] = (s + s) - ((u2 + u2) + u2);
    }
  const float c = m == D ? (float)(1.0 / sqrt((double)D)) : (float)(1.0 / (3.0 * sqrt((double)m)));
  for (int64_t i = 0; i < D; ++i) x[i] *= c;
}

/* A rank-4 [n0, n1, n2, D] view into a padded buffer: rows D + 8 elements
 * apart, planes one row more; every byte 0xa5 first, elements random. */
typedef struct t_buf {
  kva_tensor t;
  unsigned char *mem;
  size_t bytes;
} t_buf;
static void tb_make(t_buf *b, kva_dtype dt, int rank, const int64_t *shape, int fill) {
  const int64_t es = (int64_t)kva_dtype_size(dt), D = shape[rank - 1];
  int64_t st[4], n = 1;
  st[rank - 1] = es;
  int64_t s = (D + 8) * es;
  for (int d = rank - 2; d >= 0; --d) {
    st[d] = s;
    s = s * shape[d] + (D + 8) * es;
  }
  for (int d = 0; d < rank; ++d) n *= shape[d];
  b->bytes = (size_t)s + 64;
  b->mem = (unsigned char *)malloc(b->bytes);
  memset(b->mem, 0xa5, b->bytes);
  memset(&b->t, 0, sizeof b->t);
  b->t.data = b->mem;
  b->t.dtype = dt;
  b->t.ndim = rank;
  for (int d = 0; d < rank; ++d) {
    b->t.shape[d] = shape[d];
    b->t.stride[d] = st[d];
  }
  if (!fill) return;
  for (int64_t i = 0; i < n / D; ++i)
    for (int64_t e = 0; e < D; ++e) {
      int64_t off = 0, r = i;
      for (int d = rank - 2; d >= 0; --d) {
        off += (r % shape[d]) * st[d];
        r /= shape[d];
      }
      test_store(b->mem + off + e * es, dt, test_randn() * (e % 37 == 3 ? 20.0f : 1.0f));
    }
}
static void tb_free(t_buf *b) { free(b->mem); }
/* Address of row i (leading indices flattened) of a t_buf view. */
static char *tb_row(const kva_tensor *t, int64_t i) {
  int64_t off = 0;
  for (int d = t->ndim - 2; d >= 0; --d) {
    off += (i % t->shape[d]) * t->stride[d];
    i /= t->shape[d];
  }
  return (char *)t->data + off;
}
static int64_t tb_rows(const kva_tensor *t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim - 1; ++d) n *= t->shape[d];
  return n;
}
/* The bytes outside the view's elements still 0xa5. */
static int tb_padding_ok(const t_buf *b) {
  unsigned char *mark = (unsigned char *)calloc(b->bytes, 1);
  const int64_t es = (int64_t)kva_dtype_size(b->t.dtype), D = b->t.shape[b->t.ndim - 1];
  for (int64_t i = 0; i < tb_rows(&b->t); ++i) memset(mark + (tb_row(&b->t, i) - (char *)b->mem), 1, (size_t)(D * es));
  int ok = 1;
  for (size_t i = 0; i < b->bytes && ok; ++i)
    if (!mark[i] && b->mem[i] != 0xa5) ok = 0;
  free(mark);
  return ok;
}

static kva_context *cpu_ctx(int threads) {
  kva_context *ctx = NULL;
  kva_context_opts o = {KVA_BACKEND_CPU, threads, 0, NULL};
  return kva_context_create(&ctx, &o) == 0 ? ctx : NULL;
}

/* y (from x) against the definition: bit for bit the documented f32
 * arithmetic rounded once to y's dtype, and within f32 rounding of the
 * double H x. */
static int check_transform(const kva_tensor *x, const kva_tensor *y, const char *what) {
  const int64_t D = x->shape[x->ndim - 1];
  const int64_t xs = (int64_t)kva_dtype_size(x->dtype), ys = (int64_t)kva_dtype_size(y->dtype);
  float f[512];
  for (int64_t i = 0; i < tb_rows(x); ++i) {
    const char *xr = tb_row(x, i), *yr = tb_row(y, i);
    double norm = 0.0;
    for (int64_t e = 0; e < D; ++e) {
      f[e] = test_load(xr + e * xs, x->dtype);
      norm += (double)f[e] * f[e];
    }
    norm = sqrt(norm);
    float g[512];
    memcpy(g, f, sizeof g);
    t_fwht_f32(g, D);
    for (int64_t a = 0; a < D; ++a) {
      char want[4];
      test_store(want, y->dtype, g[a]);
      if (memcmp(want, yr + a * ys, (size_t)ys)) {
        fprintf(stderr, "    %s D %lld row %lld [%lld]: %.9g, the documented f32 arithmetic gives %.9g\n", what,
                (long long)D, (long long)i, (long long)a, test_load(yr + a * ys, y->dtype), g[a]);
        return 0;
      }
      double ref = 0.0;
      for (int64_t b = 0; b < D; ++b) ref += h_elem(D, a, b) * f[b];
      const double got = test_load(yr + a * ys, y->dtype);
      const double tol = 1e-6 * norm + att_rtol(y->dtype) * fabs(ref);
      if (!(fabs(got - ref) <= tol)) {
        fprintf(stderr, "    %s D %lld row %lld [%lld]: %.9g, H x = %.9g (allowed %.3g)\n", what, (long long)D,
                (long long)i, (long long)a, got, ref, tol);
        return 0;
      }
    }
  }
  return 1;
}

TEST(hadamard_matches_definition) {
  kva_context *ctx = cpu_ctx(2);
  ASSERT_TRUE(ctx);
  for (int di = 0; di < NDIMS; ++di) {
    const int64_t D = DIMS[di];
    ASSERT_EQ(kva_hadamard_dim_supported(D), 1);
    for (int xi = 0; xi < 3; ++xi)
      for (int yi = 0; yi < 2; ++yi) {
        const kva_dtype xdt = FLOATS[xi], ydt = yi ? xdt : F32;
        const int rank = 1 + (int)((di + xi + yi) % 4);
        const int64_t shapes[4][4] = {{D}, {5, D}, {3, 7, D}, {2, 3, 5, D}};
        t_buf x, y, z;
        tb_make(&x, xdt, rank, shapes[rank - 1], 1);
        tb_make(&y, ydt, rank, shapes[rank - 1], 0);
        ASSERT_OK(kva_hadamard(ctx, &x.t, &y.t));
        char what[64];
        snprintf(what, sizeof what, "%s -> %s rank %d", kva_dtype_name(xdt), kva_dtype_name(ydt), rank);
        int ok = check_transform(&x.t, &y.t, what) && tb_padding_ok(&y);
        if (ok && xdt == ydt) { /* in place: the same bits */
          z.bytes = x.bytes;
          z.mem = (unsigned char *)malloc(x.bytes);
          memcpy(z.mem, x.mem, x.bytes);
          z.t = x.t;
          z.t.data = z.mem;
          ok = kva_hadamard(ctx, &z.t, &z.t) == 0;
          for (int64_t i = 0; ok && i < tb_rows(&z.t); ++i)
            ok = !memcmp(tb_row(&z.t, i), tb_row(&y.t, i), (size_t)D * kva_dtype_size(ydt));
          ok = ok && tb_padding_ok(&z);
          if (!ok) FAIL_("%s D %lld: in place differs from out of place", what, (long long)D);
          tb_free(&z);
        }
        if (ok && ydt == F32) { /* H H = I within f32 rounding */
          t_buf w;
          tb_make(&w, F32, rank, shapes[rank - 1], 0);
          ok = kva_hadamard(ctx, &y.t, &w.t) == 0;
          for (int64_t i = 0; ok && i < tb_rows(&w.t); ++i) {
            double norm = 0.0, err = 0.0;
            for (int64_t e = 0; e < D; ++e) {
              const double xv = test_load(tb_row(&x.t, i) + e * kva_dtype_size(xdt), xdt);
              const double wv = test_load(tb_row(&w.t, i) + e * 4, F32);
              norm += xv * xv;
              if (fabs(wv - xv) > err) err = fabs(wv - xv);
            }
            if (!(err <= 2e-6 * sqrt(norm))) {
              FAIL_("%s D %lld: H H x differs from x by %.3g (|x| %.3g)", what, (long long)D, err, sqrt(norm));
              ok = 0;
            }
          }
          tb_free(&w);
        } else if (!ok) {
          FAIL_("%s D %lld: kva_hadamard differs from its definition (or wrote outside y)", what, (long long)D);
        }
        tb_free(&x);
        tb_free(&y);
        if (!ok) {
          kva_context_destroy(ctx);
          return;
        }
      }
  }
  kva_context_destroy(ctx);
}

TEST(hadamard_errors) {
  kva_context *ctx = cpu_ctx(1);
  ASSERT_TRUE(ctx);
  for (int i = 0; i < NBAD; ++i) {
    const int64_t D = BAD_DIMS[i], shape[2] = {3, D};
    ASSERT_EQ(kva_hadamard_dim_supported(D), 0);
    t_buf x, y;
    tb_make(&x, F32, 2, shape, 1);
    tb_make(&y, F32, 2, shape, 0);
    char needle[32];
    snprintf(needle, sizeof needle, "head dim %lld", (long long)D);
    const int rc = kva_hadamard(ctx, &x.t, &y.t);
    const int untouched = tb_padding_ok(&y) && y.mem[0] == 0xa5 && y.mem[y.bytes / 2] == 0xa5;
    tb_free(&x);
    tb_free(&y);
    ASSERT_EQ(rc, KVA_EUNSUPPORTED);
    ASSERT_TRUE(strstr(kva_last_error(), needle) != NULL);
    ASSERT_TRUE(untouched);
  }
  const int64_t shape[2] = {4, 64}, other[2] = {4, 128};
  t_buf x, y, w;
  tb_make(&x, BF16, 2, shape, 1);
  tb_make(&y, F32, 2, other, 0);
  tb_make(&w, F32, 2, shape, 0);
  ASSERT_ERR(kva_hadamard(ctx, &x.t, &y.t), KVA_ESHAPE, "y.shape[1]");
  ASSERT_ERR(kva_hadamard(NULL, &x.t, &w.t), KVA_EINVAL, "ctx");
  kva_tensor u = w.t;
  u.dtype = KVA_I32;
  ASSERT_ERR(kva_hadamard(ctx, &x.t, &u), KVA_EDTYPE, "y");
  kva_tensor part = x.t; /* rows shifted by one element: overlaps x without being x */
  part.data = (char *)x.t.data + 2;
  ASSERT_ERR(kva_hadamard(ctx, &x.t, &part), KVA_EINVAL, "overlaps");
  kva_tensor other_dt = x.t; /* same memory, another dtype: not in place */
  other_dt.dtype = F16;
  ASSERT_ERR(kva_hadamard(ctx, &x.t, &other_dt), KVA_EINVAL, "overlaps");
  ASSERT_TRUE(tb_padding_ok(&w) && w.mem[0] == 0xa5);
  tb_free(&x);
  tb_free(&y);
  tb_free(&w);
  kva_context_destroy(ctx);
}

/* ---- rotated attention */
/* A contiguous copy of a K/V operand's float rows rotated (kva_hadamard
 * into dtype dt), or a quantized cache of the rotated f32 rows. */
static int rotated_kv(kva_context *ctx, const kva_kv *src, int bits, int gs, kva_dtype dt, kva_kv *out, void **mem) {
  const kva_tensor *s = &src->data;
  const int64_t B = s->shape[0], KVH = s->shape[1], N = s->shape[2], D = s->shape[3];
  if (!bits) {
    mem[0] = malloc((size_t)(B * KVH * N * D) * kva_dtype_size(dt));
    *out = kva_kv_float(mem[0], dt, B, KVH, N, D);
    return kva_hadamard(ctx, s, &out->data);
  }
  float *f = (float *)malloc((size_t)(B * KVH * N * D) * 4);
  kva_tensor ft = kva_tensor_4d(f, F32, B, KVH, N, D);
  mem[0] = malloc((size_t)(B * KVH * N * D * bits / 32) * 4);
  mem[1] = malloc((size_t)(B * KVH * N * D / gs) * 4);
  mem[2] = malloc((size_t)(B * KVH * N * D / gs) * 4);
  *out = kva_kv_quantized(mem[0], mem[1], mem[2], dt, bits, gs, B, KVH, N, D);
  int rc = kva_hadamard(ctx, s, &ft);
  if (rc == 0) rc = kva_quantize(&ft, out);
  free(f);
  return rc;
}

/* The oracle on the rotated f32 cache (H K, H V) with the rotation flags
 * equals the oracle on the unrotated cache within f32 rounding of the
 * rotated rows; so does the fast call (within its allowance, plus the
 * 16-bit rounding of q' when its name says "q bf16" / "q f16"). */
TEST(rotation_equals_unrotated) {
  kva_context *ctx = cpu_ctx(2);
  ASSERT_TRUE(ctx);
  /* B, H, KVH, L, N, Dk, Dv, q, out, kbits, vbits, group, kv dtype, mask, window, softcap, sinks, ragged, strided */
  static const att_case cases[] = {
      {2, 8, 2, 1, 300, 128, 128, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 1, 1, 1},
      {1, 6, 2, 4, 200, 192, 128, F32, F32, 0, 0, 0, F32, MASK_WINDOW, 50, 0, 0, 0, 0},
      {1, 8, 4, 3, 150, 96, 96, BF16, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 20.0f, 0, 0, 0},
      {1, 4, 1, 8, 120, 256, 512, BF16, BF16, 0, 0, 0, F32, MASK_SEG, 0, 0, 0, 0, 1},
  };
  static const unsigned flags[3] = {ROT_KV, KVA_ATTN_ROTATED_K, KVA_ATTN_ROTATED_V};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ++ci)
    for (int fi = 0; fi < 3; ++fi) {
      const att_case *c = &cases[ci];
      char name[256];
      att_case_str(c, name, sizeof name);
      att_data d;
      ASSERT_TRUE(att_make(&d, c) == 0);
      void *km[3] = {0}, *vm[3] = {0};
      kva_kv kr = d.k, vr = d.v;
      if (flags[fi] & KVA_ATTN_ROTATED_K) ASSERT_OK(rotated_kv(ctx, &d.k, 0, 0, F32, &kr, km));
      if (flags[fi] & KVA_ATTN_ROTATED_V) ASSERT_OK(rotated_kv(ctx, &d.v, 0, 0, F32, &vr, vm));
      kva_kv_view rv = kva_view_contiguous(&kr, &vr, d.lens);
      kva_attn_params rp = d.params;
      rp.flags |= flags[fi];
      kva_tensor truth = att_alloc_like(&d, &d.out), rref = att_alloc_like(&d, &d.out);
      ASSERT_OK(kva_reference_attention(&d.q, &d.view, &d.params, &truth));
      ASSERT_OK(kva_reference_attention(&d.q, &rv, &rp, &rref));
      int ok = att_compare(&rref, &truth, ATT_ATOL_F32, att_rtol(c->odt), NULL, NULL);
      if (!ok) FAIL_("%s flags 0x%x: the oracle's rotated call on H K, H V differs from the unrotated one", name,
                     flags[fi]);
      char kname[320];
      ASSERT_TRUE(kva_attention_kernel(ctx, &d.q, &rv, &rp, &d.out, kname, sizeof kname) > 0);
      /* a kernel that rounds q' = H q to 16 bits ("[q bf16"): against the
       * oracle's rotated call with that rounding (which the line above ties
       * to the truth), not the truth itself (the rounding's effect scales
       * with |q| |k| and the softcap, no fixed bound) */
      const int qround = strstr(kname, "[q bf16") || strstr(kname, "[q f16");
      kva_tensor kref = att_alloc_like(&d, &d.out);
      ok = ok && (!qround || att_kernel_reference(ctx, &d.q, &rv, &rp, &d.out, &d.q, &rv, &rp, &kref) == 0);
      att_poison(&d);
      ok = ok && kva_attention(ctx, &d.q, &rv, &rp, &d.out, NULL, 0) == 0 && att_out_untouched_ok(&d);
      ok = ok && att_compare(&d.out, qround ? &kref : &truth, att_name_atol(kname), att_rtol(c->odt), NULL, NULL);
      if (!ok) FAIL_("%s flags 0x%x [%s]: the rotated call differs from the unrotated truth", name, flags[fi], kname);
      for (int i = 0; i < 3; ++i) {
        free(km[i]);
        free(vm[i]);
      }
      att_free(&d);
      if (!ok) {
        kva_context_destroy(ctx);
        return;
      }
    }
  kva_context_destroy(ctx);
}

/* B, H, KVH, L, N, Dk, Dv, q, out, kbits, vbits, group, kv dtype, mask, window, softcap, sinks, ragged, strided */
static const att_case rot_cases[] = {
    /* decode over 4-bit g64 caches (the rotation's use), GQA, ragged, strided */
    {1, 8, 4, 1, 600, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {3, 8, 2, 1, 300, 256, 256, F32, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 1},
    {1, 4, 1, 1, 200, 96, 96, F16, F32, 8, 8, 32, F16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 4, 2, 1, 150, 512, 512, BF16, F32, 4, 8, 128, F32, MASK_CAUSAL, 0, 30.0f, 0, 0, 0},
    {1, 6, 2, 2, 150, 192, 128, F32, F32, 8, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 1},
    /* verify rows, masks, softcap, sinks */
    {1, 8, 4, 8, 400, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {2, 12, 2, 8, 113, 256, 256, BF16, F32, 8, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 1},
    {2, 8, 4, 3, 300, 128, 128, F32, F32, 4, 4, 32, F32, MASK_WINDOW, 40, 0, 0, 1, 0},
    {1, 4, 2, 12, 300, 64, 64, F32, F32, 4, 4, 32, F32, MASK_SEG_CLAMP, 7, 0, 0, 0, 1},
    {1, 4, 2, 5, 200, 128, 128, F32, F32, 4, 4, 64, BF16, MASK_ADD, 0, 0, 1, 0, 1},
    /* float caches (AMX / fused float kernels), long L (row groups) */
    {1, 8, 4, 8, 90, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
    {1, 8, 2, 1, 500, 64, 64, F32, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 5.0f, 1, 0, 0},
    {1, 4, 2, 20, 300, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0},
};
#define NROT ((int)(sizeof rot_cases / sizeof rot_cases[0]))

enum { LAYOUT_CONTIG, LAYOUT_TABLE, LAYOUT_PAGED };
static const char *const layout_names[3] = {"contiguous", "block table", "paged"};

/* One rotated call over `view` against the oracle's rotated call with the
 * kernel's modelled roundings (out, and lse when with_lse). */
static int rot_check(kva_context *ctx, att_data *d, const kva_kv_view *view, int with_lse, const char *what) {
  char kname[320] = "";
  if (kva_attention_kernel(ctx, &d->q, view, &d->params, &d->out, kname, sizeof kname) < 0) {
    fprintf(stderr, "    %s: kva_attention_kernel: %s\n", what, kva_last_error());
    return 0;
  }
  if (!strstr(kname, "Hadamard-rotated")) {
    fprintf(stderr, "    %s: the kernel name \"%s\" does not mention the rotation\n", what, kname);
    return 0;
  }
  kva_ref_rounding rr;
  att_name_rounding(kname, &rr);
  kva_tensor ref = att_alloc_like(d, &d->out);
  lse_buf rl, kl;
  int ok = lse_buf_make(&rl, d->c.B, d->c.H, d->c.L, 0) == 0 && lse_buf_make(&kl, d->c.B, d->c.H, d->c.L, 1) == 0;
  if (ok && kva_reference_attention_rounded(&d->q, view, &d->params, &ref, &rl.t, 0, &rr)) {
    fprintf(stderr, "    %s: oracle: %s\n", what, kva_last_error());
    ok = 0;
  }
  att_poison(d);
  const int rc = ok ? kva_attention_lse(ctx, &d->q, view, &d->params, &d->out, with_lse ? &kl.t : NULL, 0, NULL, 0) : -1;
  if (ok && rc) fprintf(stderr, "    %s: kva_attention_lse: %s\n", what, kva_last_error());
  ok = ok && rc == 0 && att_out_untouched_ok(d);
  const double atol = att_name_atol(kname);
  double err = 0;
  ok = ok && att_compare(&d->out, &ref, atol, att_rtol(d->c.odt), &err, NULL);
  if (ok && with_lse) {
    const double lrt = atol == ATT_ATOL_F32 ? LSE_RTOL : ATT_ATOL_BF16;
    ok = lse_compare(&kl.t, &rl.t, lrt, what) && lse_sentinel_ok(&kl);
  }
  if (!ok) fprintf(stderr, "    %s [%s]: max err %.3g (allowed %.3g of max|ref|)\n", what, kname, err, atol);
  lse_buf_free(&rl);
  lse_buf_free(&kl);
  return ok;
}

/* A rotated cache stands for H K: the probe of att_make_q (q aligned with
 * a stored key) becomes a probe of the rotated call when q <- H q
 * (H (H q) = q: the rotated query is the aligned one). */
static int rot_probe_q(kva_context *ctx, att_data *d) { return kva_hadamard(ctx, &d->q, &d->q); }

static int rot_case(kva_context *ctx, const att_case *c, unsigned flags, int probe, int layout, const char *level) {
  char name[256], what[400];
  att_case_str(c, name, sizeof name);
  snprintf(what, sizeof what, "%s, %s queries, flags 0x%x, %s, %s", name, att_query_names[probe], flags,
           layout_names[layout], level);
  att_data d;
  if (att_make_q(&d, c, probe)) {
    FAIL_("%s: could not build operands", what);
    att_free(&d);
    return 0;
  }
  int ok = 1;
  if (probe && (flags & KVA_ATTN_ROTATED_K) && rot_probe_q(ctx, &d)) ok = 0;
  d.params.flags |= flags;
  att_table tb;
  int have_tb = 0;
  kva_pool *pool = NULL;
  kva_paged_view *pv = NULL;
  kva_kv_view view = d.view;
  if (ok && layout == LAYOUT_TABLE) {
    ok = att_table_make(&tb, &d, 16, 0xff) == 0;
    have_tb = ok;
    view = tb.view;
  } else if (ok && layout == LAYOUT_PAGED) {
    int32_t seqs[8];
    ok = kva_pool_from_contiguous(&pool, &d.view, 16, 1, 0x5eed, seqs) == 0 && kva_paged_view_create(pool, seqs, c->B, &pv) == 0;
    if (ok) view = kva_view_paged(pv);
  }
  const int with_lse = c->mask != MASK_ADD; /* one case without lse: the plain call */
  ok = ok && rot_check(ctx, &d, &view, with_lse, what);
  if (!ok) FAIL_("%s: the rotated call differs from the oracle's rotated call", what);
  if (have_tb) att_table_free(&tb);
  kva_paged_view_release(pv);
  kva_pool_destroy(pool);
  att_free(&d);
  return ok;
}

static int layout_fits(const att_case *c, int layout) {
  /* segment ids and array masks are [B, N] / [.., N] of the contiguous capacity N */
  if (layout != LAYOUT_CONTIG && (c->mask == MASK_SEG || c->mask == MASK_SEG_CLAMP || c->mask == MASK_ADD ||
                                  c->mask == MASK_BOOL))
    return 0;
  if (layout == LAYOUT_PAGED) return c->kbits == c->vbits; /* kva_pool_from_contiguous: one format */
  return 1;
}

TEST(rotation_cpu_vs_oracle) {
  kva_context *ctx = cpu_ctx(2);
  ASSERT_TRUE(ctx);
  static const unsigned flags[3] = {ROT_KV, KVA_ATTN_ROTATED_K, KVA_ATTN_ROTATED_V};
  int ok = 1;
  for (int pass = 0; pass < ATT_PASSES && ok; ++pass) {
    if (att_set_pass(pass)) continue;
    for (int ci = 0; ci < NROT && ok; ++ci) {
      const att_case *c = &rot_cases[ci];
      if (!test_case_sampled(ci, NROT)) continue;
      for (int layout = 0; layout < 3 && ok; ++layout) {
        if (!layout_fits(c, layout)) continue;
        /* every layout with K,V at the best level; each flag and probe elsewhere */
        const int fi = (ci + layout + pass) % 3, probe = (ci + pass) % 2;
        if (test_quick && pass < ATT_PASSES - 2 && layout) continue;
        ok = rot_case(ctx, c, layout == 0 ? flags[fi] : ROT_KV, probe, layout, att_pass_name(pass));
      }
    }
  }
  att_end_passes();
  kva_context_destroy(ctx);
}

/* KVA_ATTN_EXACT keeps q' in f32 and the "[exact f32]" kernels; a 16-bit q
 * without it is rounded after the rotation ("q bf16" first in the bracket). */
TEST(rotation_kernel_names) {
  kva_context *ctx = cpu_ctx(1);
  ASSERT_TRUE(ctx);
  const att_case c = {1, 8, 4, 1, 100, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0};
  att_data d;
  ASSERT_TRUE(att_make(&d, &c) == 0);
  char plain[320], rot[320], exact[320];
  ASSERT_TRUE(kva_attention_kernel(ctx, &d.q, &d.view, &d.params, &d.out, plain, sizeof plain) > 0);
  d.params.flags = ROT_KV;
  ASSERT_TRUE(kva_attention_kernel(ctx, &d.q, &d.view, &d.params, &d.out, rot, sizeof rot) > 0);
  d.params.flags = ROT_KV | KVA_ATTN_EXACT;
  ASSERT_TRUE(kva_attention_kernel(ctx, &d.q, &d.view, &d.params, &d.out, exact, sizeof exact) > 0);
  if (!strstr(rot, "Hadamard-rotated K,V [q bf16")) FAIL_("rotated bf16 call named \"%s\"", rot);
  if (!att_name_exact(exact) || !strstr(exact, "Hadamard-rotated K,V")) FAIL_("rotated exact call named \"%s\"", exact);
  d.params.flags = KVA_ATTN_ROTATED_V; /* q is not rotated: no q rounding */
  ASSERT_TRUE(kva_attention_kernel(ctx, &d.q, &d.view, &d.params, &d.out, rot, sizeof rot) > 0);
  if (!strstr(rot, "Hadamard-rotated V") || strstr(rot, "q bf16")) FAIL_("V-rotated call named \"%s\"", rot);
  (void)plain;
  att_free(&d);
  kva_context_destroy(ctx);
}

TEST(rotation_attention_errors) {
  kva_context *ctx = cpu_ctx(1);
  ASSERT_TRUE(ctx);
  /* head dim 80 has no rotation: K, V or both; nothing written */
  const att_case c80 = {1, 4, 2, 1, 50, 80, 80, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  att_data d;
  ASSERT_TRUE(att_make(&d, &c80) == 0);
  static const unsigned bad[3] = {KVA_ATTN_ROTATED_K, KVA_ATTN_ROTATED_V, ROT_KV};
  for (int i = 0; i < 3; ++i) {
    d.params.flags = bad[i];
    att_poison(&d);
    ASSERT_ERR(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, NULL, 0), KVA_EUNSUPPORTED, "head dim 80");
    ASSERT_TRUE(!memcmp(d.out_buf, d.out_image, d.out_bytes) && att_sentinel_ok(&d));
    kva_tensor ref = att_alloc_like(&d, &d.out);
    ASSERT_ERR(kva_reference_attention(&d.q, &d.view, &d.params, &ref), KVA_EUNSUPPORTED, "head dim 80");
    size_t ws;
    ASSERT_ERR(kva_attention_workspace_size(ctx, &d.q, &d.view, &d.params, &ws), KVA_EUNSUPPORTED, "head dim 80");
  }
  att_free(&d);
  /* Dk 128 rotates, Dv 80 does not */
  const att_case cmix = {1, 4, 2, 1, 50, 128, 80, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  ASSERT_TRUE(att_make(&d, &cmix) == 0);
  d.params.flags = KVA_ATTN_ROTATED_K;
  ASSERT_TRUE(rot_check(ctx, &d, &d.view, 1, "Dk 128 rotated, Dv 80"));
  d.params.flags = KVA_ATTN_ROTATED_V;
  att_poison(&d);
  ASSERT_ERR(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, NULL, 0), KVA_EUNSUPPORTED, "ROTATED_V");
  ASSERT_TRUE(!memcmp(d.out_buf, d.out_image, d.out_bytes));
  d.params.flags = 8u;
  ASSERT_ERR(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, NULL, 0), KVA_EINVAL, "params->flags");
  att_free(&d);
  /* workspace: the rotated call needs more; exactly that much works, one byte less does not */
  const att_case c = {2, 8, 2, 3, 200, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0};
  ASSERT_TRUE(att_make(&d, &c) == 0);
  size_t w0, w1;
  ASSERT_OK(kva_attention_workspace_size(ctx, &d.q, &d.view, &d.params, &w0));
  d.params.flags = ROT_KV;
  ASSERT_OK(kva_attention_workspace_size(ctx, &d.q, &d.view, &d.params, &w1));
  ASSERT_TRUE(w1 > w0);
  void *ws = malloc(w1);
  kva_tensor first = att_alloc_like(&d, &d.out);
  ASSERT_OK(kva_attention(ctx, &d.q, &d.view, &d.params, &first, NULL, 0));
  att_poison(&d);
  ASSERT_ERR(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, ws, w1 - 1), KVA_EWORKSPACE, "workspace");
  ASSERT_TRUE(!memcmp(d.out_buf, d.out_image, d.out_bytes));
  ASSERT_OK(kva_attention(ctx, &d.q, &d.view, &d.params, &d.out, ws, w1));
  const size_t row = (size_t)c.Dv * kva_dtype_size(c.odt);
  int same = 1;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.L; ++i)
        same &= !memcmp((char *)d.out.data + b * d.out.stride[0] + h * d.out.stride[1] + i * d.out.stride[2],
                        (char *)first.data + b * first.stride[0] + h * first.stride[1] + i * first.stride[2], row);
  ASSERT_TRUE(same); /* the caller's workspace gives the context workspace's bits */
  free(ws);
  att_free(&d);
  kva_context_destroy(ctx);
}

/* Cascade and context-parallel calls pass the flags to each part: the
 * cascade over a rotated prefix + suffix equals the oracle's rotated call
 * over the whole cache. */
TEST(rotation_cascade) {
  kva_context *ctx = cpu_ctx(2);
  ASSERT_TRUE(ctx);
  const att_case c = {1, 8, 2, 4, 300, 128, 128, F32, F32, 4, 4, 64, F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  att_data d;
  ASSERT_TRUE(att_make_q(&d, &c, 1) == 0);
  ASSERT_OK(rot_probe_q(ctx, &d));
  d.params.flags = ROT_KV | KVA_ATTN_EXACT;
  const int64_t P = 120;
  kva_kv kp = d.k, vp = d.v, ks = d.k, vs = d.v;
  kva_kv *parts[4] = {&kp, &vp, &ks, &vs};
  for (int i = 0; i < 4; ++i) {
    const int64_t off = i < 2 ? 0 : P, n = i < 2 ? P : c.N - P;
    kva_tensor *ts[3] = {&parts[i]->data, &parts[i]->scales, &parts[i]->biases};
    for (int t = 0; t < 3; ++t) {
      ts[t]->data = (char *)ts[t]->data + off * ts[t]->stride[2];
      ts[t]->shape[2] = n;
    }
  }
  kva_kv_view pre = kva_view_contiguous(&kp, &vp, NULL), suf = kva_view_contiguous(&ks, &vs, NULL);
  kva_tensor ref = att_alloc_like(&d, &d.out);
  ASSERT_OK(kva_reference_attention(&d.q, &d.view, &d.params, &ref));
  att_poison(&d);
  ASSERT_OK(kva_cascade_attention(ctx, &d.q, &pre, &suf, &d.params, &d.out, NULL, 0, NULL, 0));
  ASSERT_TRUE(att_out_untouched_ok(&d));
  ASSERT_TRUE(att_compare(&d.out, &ref, ATT_ATOL_F32, att_rtol(c.odt), NULL, NULL));
  att_free(&d);
  kva_context_destroy(ctx);
}

/* Context parallelism (all-gather, 2 simulated ranks: keys [0, P) with no
 * mask, [P, N) with the causal mask) with the rotation flags on both ranks
 * equals the oracle's rotated call over the whole cache. */
TEST(rotation_cp) {
  kva_context *ctx = cpu_ctx(2);
  ASSERT_TRUE(ctx);
  const att_case c = {1, 8, 2, 1, 400, 128, 128, F32, F32, 4, 4, 64, F32, MASK_CAUSAL, 0, 0, 0, 0, 0};
  att_data d;
  ASSERT_TRUE(att_make_q(&d, &c, 1) == 0);
  ASSERT_OK(rot_probe_q(ctx, &d));
  d.params.flags = ROT_KV | KVA_ATTN_EXACT;
  const int64_t P = 250;
  kva_kv ks[2][2] = {{d.k, d.v}, {d.k, d.v}};
  for (int r = 0; r < 2; ++r)
    for (int o = 0; o < 2; ++o) {
      kva_tensor *ts[3] = {&ks[r][o].data, &ks[r][o].scales, &ks[r][o].biases};
      for (int t = 0; t < 3; ++t) {
        ts[t]->data = (char *)ts[t]->data + (r ? P : 0) * ts[t]->stride[2];
        ts[t]->shape[2] = r ? c.N - P : P;
      }
    }
  kva_cp_plan plan[2];
  char *send[2], *recv;
  for (int r = 0; r < 2; ++r) ASSERT_OK(kva_cp_plan_init(&plan[r], 2, r, 0, c.B, c.H, c.L, c.Dv, 0));
  for (int r = 0; r < 2; ++r) send[r] = (char *)malloc(plan[r].send_bytes);
  recv = (char *)malloc(plan[0].recv_bytes);
  for (int r = 0; r < 2; ++r) {
    kva_kv_view shard = kva_view_contiguous(&ks[r][0], &ks[r][1], NULL);
    kva_attn_params pr = d.params;
    if (r == 0) pr.mask.kind = KVA_MASK_NONE; /* wholly before the query row */
    ASSERT_OK(kva_cp_attend(ctx, &plan[r], &d.q, &shard, &pr, send[r], plan[r].send_bytes, NULL, 0));
    memcpy(recv + r * plan[0].o_bytes, send[r], plan[0].o_bytes);
    memcpy(recv + plan[0].recv_lse_offset + r * plan[0].lse_bytes, send[r] + plan[0].send_lse_offset,
           plan[0].lse_bytes);
  }
  kva_tensor ref = att_alloc_like(&d, &d.out);
  ASSERT_OK(kva_reference_attention(&d.q, &d.view, &d.params, &ref));
  att_poison(&d);
  ASSERT_OK(kva_cp_merge(ctx, &plan[0], recv, plan[0].recv_bytes, &d.out, NULL));
  ASSERT_TRUE(att_out_untouched_ok(&d));
  ASSERT_TRUE(att_compare(&d.out, &ref, ATT_ATOL_F32, att_rtol(c.odt), NULL, NULL));
  for (int r = 0; r < 2; ++r) free(send[r]);
  free(recv);
  att_free(&d);
  kva_context_destroy(ctx);
}

/* ---- the rotating cache write */
/* Pools [nb, KVH, bs, D] of one format (contiguous), every byte `fill`. */
typedef struct rw_pool {
  kva_kv kv;
  void *mem[3];
  size_t bytes[3];
} rw_pool;
static void rw_pool_make(rw_pool *p, int64_t nb, int64_t KVH, int64_t bs, int64_t D, int bits, int gs, kva_dtype dt) {
  memset(p, 0, sizeof *p);
  if (!bits) {
    p->bytes[0] = (size_t)(nb * KVH * bs * D) * kva_dtype_size(dt);
    p->mem[0] = malloc(p->bytes[0]);
    p->kv = kva_kv_float(p->mem[0], dt, nb, KVH, bs, D);
  } else {
    p->bytes[0] = (size_t)(nb * KVH * bs * (D * bits / 32)) * 4;
    p->bytes[1] = p->bytes[2] = (size_t)(nb * KVH * bs * (D / gs)) * kva_dtype_size(dt);
    for (int i = 0; i < 3; ++i) p->mem[i] = malloc(p->bytes[i]);
    p->kv = kva_kv_quantized(p->mem[0], p->mem[1], p->mem[2], dt, bits, gs, nb, KVH, bs, D);
  }
  for (int i = 0; i < 3; ++i)
    if (p->mem[i]) memset(p->mem[i], 0x5a, p->bytes[i]);
}
static void rw_pool_free(rw_pool *p) {
  for (int i = 0; i < 3; ++i) free(p->mem[i]);
}
static int rw_pool_same(const rw_pool *a, const rw_pool *b) {
  for (int i = 0; i < 3; ++i)
    if (a->mem[i] && memcmp(a->mem[i], b->mem[i], a->bytes[i])) return 0;
  return 1;
}
static int rw_pool_untouched(const rw_pool *p) {
  for (int i = 0; i < 3; ++i)
    for (size_t j = 0; p->mem[i] && j < p->bytes[i]; ++j)
      if (((unsigned char *)p->mem[i])[j] != 0x5a) return 0;
  return 1;
}

/* Formats of the write tests: bits, group, dtype, Dk, Dv. */
typedef struct rw_fmt {
  int bits, gs;
  kva_dtype dt;
  int64_t Dk, Dv;
} rw_fmt;
static const rw_fmt RW_FMTS[] = {
    {4, 64, BF16, 128, 128}, {8, 32, F16, 192, 192}, {2, 128, F32, 256, 128},
    {4, 32, BF16, 96, 64},   {0, 0, BF16, 128, 128}, {0, 0, F32, 64, 512},
};
#define NRW ((int)(sizeof RW_FMTS / sizeof RW_FMTS[0]))

/* The rows of one write: k [n, KVH, Dk], v [n, KVH, Dv] of dtype sdt and slots. */
typedef struct rw_rows {
  t_buf k, v;
  int32_t *slots;
  int64_t n;
} rw_rows;
static void rw_rows_make(rw_rows *r, int64_t n, int64_t KVH, const rw_fmt *f, kva_dtype sdt, int64_t nslots) {
  const int64_t ks[3] = {n, KVH, f->Dk}, vs[3] = {n, KVH, f->Dv};
  tb_make(&r->k, sdt, 3, ks, 1);
  tb_make(&r->v, sdt, 3, vs, 1);
  r->n = n;
  r->slots = (int32_t *)malloc((size_t)n * 4);
  int32_t *perm = (int32_t *)malloc((size_t)nslots * 4);
  att_random_perm(perm, nslots);
  for (int64_t i = 0; i < n; ++i) r->slots[i] = i % 7 == 5 ? -1 : perm[i];
  free(perm);
}
static void rw_rows_free(rw_rows *r) {
  tb_free(&r->k);
  tb_free(&r->v);
  free(r->slots);
}

/* kva_cache_write_ex's rotation = kva_hadamard into f32 rows, then
 * kva_cache_write, bit for bit, for every format; one operand rotated
 * leaves the other as the plain write stores it. */
TEST(rotation_cache_write) {
  kva_context *ctx = cpu_ctx(2);
  ASSERT_TRUE(ctx);
  const int64_t nb = 6, KVH = 2, bs = 16, n = 40;
  for (int fi = 0; fi < NRW; ++fi)
    for (int flags = 1; flags <= 3; ++flags) {
      const rw_fmt *f = &RW_FMTS[fi];
      const kva_dtype sdt = FLOATS[(fi + flags) % 3];
      rw_rows r;
      rw_rows_make(&r, n, KVH, f, sdt, nb * bs);
      rw_pool ka, va, kb, vb;
      rw_pool_make(&ka, nb, KVH, bs, f->Dk, f->bits, f->gs, f->dt);
      rw_pool_make(&va, nb, KVH, bs, f->Dv, f->bits, f->gs, f->dt);
      rw_pool_make(&kb, nb, KVH, bs, f->Dk, f->bits, f->gs, f->dt);
      rw_pool_make(&vb, nb, KVH, bs, f->Dv, f->bits, f->gs, f->dt);
      ASSERT_OK(kva_cache_write_ex(ctx, &ka.kv, &va.kv, &r.k.t, &r.v.t, r.slots, n, (unsigned)flags));
      float *kf = (float *)malloc((size_t)(n * KVH * f->Dk) * 4), *vf = (float *)malloc((size_t)(n * KVH * f->Dv) * 4);
      kva_tensor kt = {kf, F32, 3, {n, KVH, f->Dk}, {KVH * f->Dk * 4, f->Dk * 4, 4}};
      kva_tensor vt = {vf, F32, 3, {n, KVH, f->Dv}, {KVH * f->Dv * 4, f->Dv * 4, 4}};
      const kva_tensor *kin = &r.k.t, *vin = &r.v.t;
      if (flags & KVA_WRITE_ROTATE_K) {
        ASSERT_OK(kva_hadamard(ctx, &r.k.t, &kt));
        kin = &kt;
      }
      if (flags & KVA_WRITE_ROTATE_V) {
        ASSERT_OK(kva_hadamard(ctx, &r.v.t, &vt));
        vin = &vt;
      }
      ASSERT_OK(kva_cache_write(ctx, &kb.kv, &vb.kv, kin, vin, r.slots, n));
      const int same = rw_pool_same(&ka, &kb) && rw_pool_same(&va, &vb);
      free(kf);
      free(vf);
      rw_pool_free(&ka);
      rw_pool_free(&va);
      rw_pool_free(&kb);
      rw_pool_free(&vb);
      rw_rows_free(&r);
      if (!same) {
        FAIL_("format %d bits %d g%d %s, Dk %lld Dv %lld, rows %s, flags %d: kva_cache_write_ex differs from "
              "kva_hadamard + kva_cache_write", fi, f->bits, f->gs, kva_dtype_name(f->dt), (long long)f->Dk,
              (long long)f->Dv, kva_dtype_name(sdt), flags);
        kva_context_destroy(ctx);
        return;
      }
    }
  kva_context_destroy(ctx);
}

/* Rows written rotated into 4-bit pools, attended through a block table
 * with the rotation flags: against the oracle's rotated call on the same
 * pools; and nearer the oracle's unrotated call on the f32 rows than the
 * same rows written unrotated (keys with outlier channels). */
TEST(rotation_write_then_attend) {
  kva_context *ctx = cpu_ctx(2);
  ASSERT_TRUE(ctx);
  const int64_t KVH = 2, H = 16, bs = 16, N = 150, nb = (N + bs - 1) / bs + 2, D = 128;
  const rw_fmt f = {4, 64, BF16, D, D};
  rw_rows r;
  rw_rows_make(&r, N, KVH, &f, F32, nb * bs);
  for (int64_t i = 0; i < N; ++i) r.slots[i] = (int32_t)(2 * bs + i); /* blocks 2.. in order */
  rw_pool kp, vp;
  rw_pool_make(&kp, nb, KVH, bs, D, 4, 64, BF16);
  rw_pool_make(&vp, nb, KVH, bs, D, 4, 64, BF16);
  ASSERT_OK(kva_cache_write_ex(ctx, &kp.kv, &vp.kv, &r.k.t, &r.v.t, r.slots, N, KVA_WRITE_ROTATE_K | KVA_WRITE_ROTATE_V));
  int32_t blocks[16], lens[1] = {(int32_t)N};
  for (int i = 0; i < 16; ++i) blocks[i] = 2 + i;
  kva_block_table t = {1, (N + bs - 1) / bs, 0, blocks, lens, NULL};
  kva_kv_view view = kva_view_block_table(&kp.kv, &vp.kv, &t);
  float *qm = (float *)malloc((size_t)(H * 2 * D) * 4), *om = (float *)malloc((size_t)(H * 2 * D) * 4),
        *rm = (float *)malloc((size_t)(H * 2 * D) * 4), *tm = (float *)malloc((size_t)(H * 2 * D) * 4);
  for (int64_t i = 0; i < H * 2 * D; ++i) qm[i] = test_randn();
  kva_tensor q = kva_tensor_4d(qm, F32, 1, H, 2, D), out = kva_tensor_4d(om, F32, 1, H, 2, D),
             ref = kva_tensor_4d(rm, F32, 1, H, 2, D), truth = kva_tensor_4d(tm, F32, 1, H, 2, D);
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = KVA_MASK_CAUSAL;
  p.scale = 0.02f; /* logits ~N(0, 0.8): a softmax over many keys, so the error is a mean over them */
  p.flags = ROT_KV;
  char kname[320];
  ASSERT_TRUE(kva_attention_kernel(ctx, &q, &view, &p, &out, kname, sizeof kname) > 0);
  kva_ref_rounding rr;
  att_name_rounding(kname, &rr);
  ASSERT_OK(kva_reference_attention_rounded(&q, &view, &p, &ref, NULL, 0, &rr));
  ASSERT_OK(kva_attention(ctx, &q, &view, &p, &out, NULL, 0));
  ASSERT_TRUE(att_compare(&out, &ref, att_name_atol(kname), att_rtol(F32), NULL, NULL));
  /* the unrotated truth: the f32 rows, contiguous [1, KVH, N, D] (r.k is [N, KVH, D]) */
  kva_kv kt = kva_kv_float(r.k.t.data, F32, 1, KVH, N, D), vt = kva_kv_float(r.v.t.data, F32, 1, KVH, N, D);
  kt.data.stride[1] = vt.data.stride[1] = r.k.t.stride[1];
  kt.data.stride[2] = vt.data.stride[2] = r.k.t.stride[0];
  kt.data.stride[0] = vt.data.stride[0] = r.k.t.stride[0] * N;
  kva_kv_view tv = kva_view_contiguous(&kt, &vt, NULL);
  kva_attn_params p0 = p;
  p0.flags = 0;
  ASSERT_OK(kva_reference_attention(&q, &tv, &p0, &truth));
  /* the same rows written unrotated: the rotated 4-bit cache must be closer
   * to the truth (the keys' outlier channels, every 37th scaled by 20,
   * stretch every unrotated group's range; the rotation spreads them) */
  rw_pool kq, vq;
  rw_pool_make(&kq, nb, KVH, bs, D, 4, 64, BF16);
  rw_pool_make(&vq, nb, KVH, bs, D, 4, 64, BF16);
  ASSERT_OK(kva_cache_write(ctx, &kq.kv, &vq.kv, &r.k.t, &r.v.t, r.slots, N));
  kva_kv_view pv = kva_view_block_table(&kq.kv, &vq.kv, &t);
  ASSERT_OK(kva_reference_attention(&q, &pv, &p0, &ref));
  double err = 0, l2_rot = 0, l2_plain = 0;
  att_compare(&out, &truth, 1.0, 0.0, &err, &l2_rot);
  att_compare(&ref, &truth, 1.0, 0.0, &err, &l2_plain);
  if (!(l2_rot < 0.8 * l2_plain))
    FAIL_("rotated 4-bit cache: rel L2 error %.3g vs %.3g unrotated", l2_rot, l2_plain);
  rw_pool_free(&kq);
  rw_pool_free(&vq);
  free(qm);
  free(om);
  free(rm);
  free(tm);
  rw_pool_free(&kp);
  rw_pool_free(&vp);
  rw_rows_free(&r);
  kva_context_destroy(ctx);
}

TEST(rotation_cache_write_errors) {
  kva_context *ctx = cpu_ctx(1);
  ASSERT_TRUE(ctx);
  const rw_fmt f = {0, 0, F32, 80, 128};
  rw_rows r;
  rw_rows_make(&r, 5, 2, &f, F32, 4 * 16);
  rw_pool kp, vp;
  rw_pool_make(&kp, 4, 2, 16, 80, 0, 0, F32);
  rw_pool_make(&vp, 4, 2, 16, 128, 0, 0, F32);
  ASSERT_ERR(kva_cache_write_ex(ctx, &kp.kv, &vp.kv, &r.k.t, &r.v.t, r.slots, 5, KVA_WRITE_ROTATE_K), KVA_EUNSUPPORTED,
             "head dim 80");
  ASSERT_ERR(kva_cache_write_ex(ctx, &kp.kv, &vp.kv, &r.k.t, &r.v.t, r.slots, 5, 4u), KVA_EINVAL, "flags");
  ASSERT_TRUE(rw_pool_untouched(&kp) && rw_pool_untouched(&vp));
  ASSERT_OK(kva_cache_write_ex(ctx, &kp.kv, &vp.kv, &r.k.t, &r.v.t, r.slots, 5, KVA_WRITE_ROTATE_V)); /* Dv 128 rotates */
  rw_pool_free(&kp);
  rw_pool_free(&vp);
  rw_rows_free(&r);
  kva_context_destroy(ctx);
}

/* ---- CUDA */
#ifndef KVA_HAVE_CUDA
TEST(cuda_hadamard_bits) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_rotation_cache_write_bits) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_rotation_vs_oracle) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_rotation_fp8_wide) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_rotation_graph) { SKIP("built without CUDA (nvcc not found)"); }
#else
#include <cuda_runtime_api.h>

static kva_context *cuda_ctx(void) {
  if (kva_cuda_device_count() <= 0) return NULL;
  kva_context *ctx = NULL;
  kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, NULL};
  return kva_context_create(&ctx, &o) == 0 ? ctx : NULL;
}
/* Device copies of host byte ranges (freed together). */
typedef struct dmem {
  void *p[32];
  int n;
} dmem;
static void *dcopy(dmem *m, const void *h, size_t bytes) {
  void *d = NULL;
  if (m->n == 32 || cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess) return NULL;
  if (h) cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
  m->p[m->n++] = d;
  return d;
}
static void dfree(dmem *m) {
  for (int i = 0; i < m->n; ++i) cudaFree(m->p[i]);
  m->n = 0;
}
/* The device mirror of a host view whose memory is [base, base + bytes). */
static kva_tensor dview(dmem *m, const kva_tensor *t, const void *base, size_t bytes) {
  kva_tensor d = *t;
  char *db = (char *)dcopy(m, base, bytes);
  d.data = db ? db + ((const char *)t->data - (const char *)base) : NULL;
  return d;
}

TEST(cuda_hadamard_bits) {
  kva_context *cu = cuda_ctx(), *cpu = cpu_ctx(1);
  if (!cu) {
    kva_context_destroy(cpu);
    SKIP("no CUDA device");
  }
  for (int di = 0; di < NDIMS; ++di)
    for (int xi = 0; xi < 3; ++xi)
      for (int yi = 0; yi < 3; ++yi) {
        const int64_t D = DIMS[di], shape[4] = {2, 3, 5, D};
        t_buf x, y, yd;
        tb_make(&x, FLOATS[xi], 4, shape, 1);
        tb_make(&y, FLOATS[yi], 4, shape, 0);
        tb_make(&yd, FLOATS[yi], 4, shape, 0);
        dmem m = {{0}, 0};
        kva_tensor dx = dview(&m, &x.t, x.mem, x.bytes), dy = dview(&m, &yd.t, yd.mem, yd.bytes);
        ASSERT_OK(kva_hadamard(cpu, &x.t, &y.t));
        ASSERT_OK(kva_hadamard(cu, &dx, &dy));
        if (xi == yi) ASSERT_OK(kva_hadamard(cu, &dx, &dx)); /* in place on the device */
        cudaDeviceSynchronize();
        cudaMemcpy(yd.mem, (char *)dy.data - ((char *)yd.t.data - (char *)yd.mem), yd.bytes, cudaMemcpyDeviceToHost);
        int ok = !memcmp(y.mem, yd.mem, y.bytes);
        if (ok && xi == yi) {
          cudaMemcpy(yd.mem, (char *)dx.data - ((char *)x.t.data - (char *)x.mem), x.bytes, cudaMemcpyDeviceToHost);
          for (int64_t i = 0; ok && i < tb_rows(&y.t); ++i)
            ok = !memcmp(tb_row(&y.t, i), yd.mem + (tb_row(&x.t, i) - (char *)x.mem), (size_t)D * kva_dtype_size(FLOATS[yi]));
        }
        dfree(&m);
        tb_free(&x);
        tb_free(&y);
        tb_free(&yd);
        if (!ok) {
          FAIL_("D %lld %s -> %s: the device transform differs from the CPU's (bits, padding or in place)",
                (long long)D, kva_dtype_name(FLOATS[xi]), kva_dtype_name(FLOATS[yi]));
          break;
        }
      }
  kva_context_destroy(cu);
  kva_context_destroy(cpu);
}

TEST(cuda_rotation_cache_write_bits) {
  kva_context *cu = cuda_ctx(), *cpu = cpu_ctx(1);
  if (!cu) {
    kva_context_destroy(cpu);
    SKIP("no CUDA device");
  }
  const int64_t nb = 6, KVH = 2, bs = 16, n = 40;
  for (int fi = 0; fi < NRW; ++fi)
    for (int flags = 1; flags <= 3; ++flags) {
      const rw_fmt *f = &RW_FMTS[fi];
      const kva_dtype sdt = FLOATS[(fi + flags) % 3];
      rw_rows r;
      rw_rows_make(&r, n, KVH, f, sdt, nb * bs);
      rw_pool kh, vh, kd, vd;
      rw_pool_make(&kh, nb, KVH, bs, f->Dk, f->bits, f->gs, f->dt);
      rw_pool_make(&vh, nb, KVH, bs, f->Dv, f->bits, f->gs, f->dt);
      rw_pool_make(&kd, nb, KVH, bs, f->Dk, f->bits, f->gs, f->dt);
      rw_pool_make(&vd, nb, KVH, bs, f->Dv, f->bits, f->gs, f->dt);
      ASSERT_OK(kva_cache_write_ex(cpu, &kh.kv, &vh.kv, &r.k.t, &r.v.t, r.slots, n, (unsigned)flags));
      dmem m = {{0}, 0};
      kva_kv dk = kd.kv, dv = vd.kv;
      kva_tensor *dt[6] = {&dk.data, &dk.scales, &dk.biases, &dv.data, &dv.scales, &dv.biases};
      rw_pool *hp[2] = {&kd, &vd};
      for (int i = 0; i < 6; ++i)
        if (hp[i / 3]->mem[i % 3]) dt[i]->data = dcopy(&m, hp[i / 3]->mem[i % 3], hp[i / 3]->bytes[i % 3]);
      kva_tensor k = dview(&m, &r.k.t, r.k.mem, r.k.bytes), v = dview(&m, &r.v.t, r.v.mem, r.v.bytes);
      int32_t *slots = (int32_t *)dcopy(&m, r.slots, (size_t)n * 4);
      ASSERT_OK(kva_cache_write_ex(cu, &dk, &dv, &k, &v, slots, n, (unsigned)flags));
      cudaDeviceSynchronize();
      for (int i = 0; i < 6; ++i)
        if (hp[i / 3]->mem[i % 3])
          cudaMemcpy(hp[i / 3]->mem[i % 3], dt[i]->data, hp[i / 3]->bytes[i % 3], cudaMemcpyDeviceToHost);
      const int same = rw_pool_same(&kh, &kd) && rw_pool_same(&vh, &vd);
      dfree(&m);
      rw_pool_free(&kh);
      rw_pool_free(&vh);
      rw_pool_free(&kd);
      rw_pool_free(&vd);
      rw_rows_free(&r);
      if (!same) {
        FAIL_("format %d (bits %d g%d %s, Dk %lld Dv %lld), rows %s, flags %d: the device write differs from the CPU's",
              fi, f->bits, f->gs, kva_dtype_name(f->dt), (long long)f->Dk, (long long)f->Dv, kva_dtype_name(sdt), flags);
        break;
      }
    }
  kva_context_destroy(cu);
  kva_context_destroy(cpu);
}

/* A host call's device mirror: each host array copied over its span. */
typedef struct dcall {
  kva_tensor q, out, lse;
  kva_kv_view view;
  kva_block_table tab;
  kva_attn_params p;
  size_t ob, lb; /* bytes of out, lse */
} dcall;
static int dcall_make(dcall *dc, dmem *m, const att_data *d, const kva_kv_view *hv, const att_table *tb) {
  const att_case *c = &d->c;
  dc->view = *hv;
  kva_kv *ops[2] = {&dc->view.k, &dc->view.v};
  const kva_kv *hops[2] = {&hv->k, &hv->v};
  for (int o = 0; o < 2; ++o) {
    const kva_tensor *ht[3] = {&hops[o]->data, &hops[o]->scales, &hops[o]->biases};
    kva_tensor *dt[3] = {&ops[o]->data, &ops[o]->scales, &ops[o]->biases};
    /* the rows, and every scale / bias tensor present (quantized rows; fp8 rows' scales) */
    for (int t = 0; t < 3; ++t) {
      if (t && !ht[t]->data) continue;
      size_t span = kva_dtype_size(ht[t]->dtype);
      for (int k = 0; k < ht[t]->ndim; ++k) span += (size_t)((ht[t]->shape[k] - 1) * ht[t]->stride[k]);
      *dt[t] = dview(m, ht[t], ht[t]->data, span);
      if (!dt[t]->data) return 0;
    }
  }
  if (tb) {
    dc->tab = tb->t;
    dc->tab.blocks = (const int32_t *)dcopy(m, tb->t.blocks, (size_t)(tb->t.batch * (tb->t.row_stride ? tb->t.row_stride : tb->t.max_blocks)) * 4);
    dc->tab.seq_lens = (const int32_t *)dcopy(m, tb->t.seq_lens, (size_t)tb->t.batch * 4);
    if (tb->t.first_offset) dc->tab.first_offset = (const int32_t *)dcopy(m, tb->t.first_offset, (size_t)tb->t.batch * 4);
    dc->view.table = &dc->tab;
  } else if (d->lens) {
    dc->view.seq_lens = (const int32_t *)dcopy(m, d->lens, (size_t)c->B * 4);
  }
  dc->p = d->params;
  if (d->sinks) dc->p.sinks = (const float *)dcopy(m, d->sinks, (size_t)c->H * 4);
  dc->q = dview(m, &d->q, d->q.data, (size_t)(d->q.shape[0] * d->q.stride[0]));
  dc->ob = (size_t)(c->B * c->H * c->L * c->Dv) * kva_dtype_size(c->odt);
  dc->out = kva_tensor_4d(dcopy(m, NULL, dc->ob), c->odt, c->B, c->H, c->L, c->Dv);
  dc->lb = (size_t)(c->B * c->H * c->L) * 4;
  dc->lse = kva_tensor_4d(dcopy(m, NULL, dc->lb), F32, c->B, c->H, c->L, 1);
  dc->lse.ndim = 3;
  return dc->q.data && dc->out.data && dc->lse.data && dc->view.k.data.data && dc->view.v.data.data;
}

/* The rotated call on the device (contiguous and block table) against the
 * oracle's rotated call with the kernel's roundings, out and lse; want,
 * how: NULL, or texts the kernel's name must contain (the kernel, and the
 * words of the fused parts of the rotation); splits: 1 the name must say
 * one split, 2 several, 0 either. */
static int cuda_rot_case_want(kva_context *cu, const att_case *c, unsigned flags, int probe, int table,
                              const char *want, const char *how, int splits) {
  char name[256], what[400];
  att_case_str(c, name, sizeof name);
  snprintf(what, sizeof what, "%s, %s queries, flags 0x%x, %s", name, att_query_names[probe], flags,
           table ? "block table" : "contiguous");
  kva_context *cpu = cpu_ctx(1);
  att_data d;
  if (att_make_q(&d, c, probe)) {
    att_free(&d);
    kva_context_destroy(cpu);
    return 0;
  }
  if (probe && (flags & KVA_ATTN_ROTATED_K)) kva_hadamard(cpu, &d.q, &d.q);
  d.params.flags |= flags;
  att_table tb;
  if (table && att_table_make(&tb, &d, 16, 0xff)) table = 0;
  const kva_kv_view *hv = table ? &tb.view : &d.view;
  dmem m = {{0}, 0};
  dcall dc;
  int ok = dcall_make(&dc, &m, &d, hv, table ? &tb : NULL);
  kva_tensor out = kva_tensor_4d(malloc(dc.ob), c->odt, c->B, c->H, c->L, c->Dv);
  float *lh = (float *)malloc(dc.lb);
  kva_tensor lse = dc.lse;
  lse.data = lh;
  char kname[320] = "";
  ok = ok && kva_attention_kernel(cu, &dc.q, &dc.view, &dc.p, &dc.out, kname, sizeof kname) > 0 &&
       strstr(kname, "Hadamard-rotated");
  if (ok && ((want && !strstr(kname, want)) || (how && !strstr(kname, how)))) {
    FAIL_("%s: runs \"%s\", not a \"%s\" with \"%s\"", what, kname, want ? want : "", how ? how : "");
    ok = 0;
  }
  if (ok && splits && !strstr(kname, splits == 1 ? " 1 split," : " splits,")) {
    FAIL_("%s: runs \"%s\", not with %s", what, kname, splits == 1 ? "one split" : "several splits");
    ok = 0;
  }
  kva_ref_rounding rr;
  att_name_rounding(kname, &rr);
  kva_tensor ref = att_alloc_like(&d, &out);
  lse_buf rl;
  memset(&rl, 0, sizeof rl);
  ok = ok && lse_buf_make(&rl, c->B, c->H, c->L, 0) == 0;
  ok = ok && kva_reference_attention_rounded(&d.q, hv, &d.params, &ref, &rl.t, 0, &rr) == 0;
  if (!ok) fprintf(stderr, "    %s [%s]: %s\n", what, kname, kva_last_error());
  const double atol = att_name_atol(kname);
  /* without lse (kva_attention), then with it (kva_attention_lse) */
  for (int wl = 0; wl < 2 && ok; ++wl) {
    const int rc = wl ? kva_attention_lse(cu, &dc.q, &dc.view, &dc.p, &dc.out, &dc.lse, 0, NULL, 0)
                      : kva_attention(cu, &dc.q, &dc.view, &dc.p, &dc.out, NULL, 0);
    if (rc != 0) {
      FAIL_("%s [%s]: the rotated call%s failed: %s", what, kname, wl ? " with lse" : "", kva_last_error());
      ok = 0;
      break;
    }
    cudaError_t ce = cudaDeviceSynchronize();
    if (ce == cudaSuccess) ce = cudaMemcpy(out.data, dc.out.data, dc.ob, cudaMemcpyDeviceToHost);
    if (ce == cudaSuccess && wl) ce = cudaMemcpy(lh, dc.lse.data, dc.lb, cudaMemcpyDeviceToHost);
    if (ce != cudaSuccess) {
      FAIL_("%s [%s]: the rotated call%s: %s (%s)", what, kname, wl ? " with lse" : "", cudaGetErrorName(ce),
            cudaGetErrorString(ce));
      ok = 0;
      break;
    }
    double err = 0;
    ok = att_compare(&out, &ref, atol, att_rtol(c->odt), &err, NULL) &&
         (!wl || lse_compare(&lse, &rl.t, atol == ATT_ATOL_F32 ? LSE_RTOL : ATT_ATOL_BF16, what));
    if (!ok)
      FAIL_("%s [%s]: the device's rotated call%s differs from the oracle's (max err %.3g, allowed %.3g)", what,
            kname, wl ? " with lse" : "", err, atol);
  }
  lse_buf_free(&rl);
  free(out.data);
  free(lh);
  dfree(&m);
  if (table) att_table_free(&tb);
  att_free(&d);
  kva_context_destroy(cpu);
  return ok;
}

static int cuda_rot_case(kva_context *cu, const att_case *c, unsigned flags, int probe, int table) {
  return cuda_rot_case_want(cu, c, flags, probe, table, NULL, NULL, 0);
}

/* The words a rotated call's name carries for its fused parts (rot_name). */
static const char *rot_how(unsigned flags) {
  return flags == ROT_KV               ? "(q rotated on load, out rotated back on store)"
         : flags == KVA_ATTN_ROTATED_K ? "(q rotated on load)"
                                       : "(out rotated back on store)";
}

/* B, H, KVH, L, N, Dk, Dv, q, out, kbits, vbits, group, kv dtype, mask, window, softcap, sinks, ragged, strided;
 * the kernel each must run (its name), and the context it needs: 1 the
 * per-warp q4 kernel at any size (KVA_CUDA_TCD_MIN_WORK = 0), 2 the
 * warpgroup kernel from one vector (KVA_CUDA_WG_MIN_Q = 1), 3 without it
 * (KVA_CUDA_WG_MIN_Q = KVA_CUDA_WG_BF16_MIN_Q = KVA_CUDA_WG_FP8_MIN_Q = -1: the narrow / wide
 * kernels), 0 default; kfused: q rotated on load there (else by the pass:
 * only V fused); splits: 1 the plan has one split (the kernel stores
 * out = H o / l itself, no merge), 2 several (rotated states, the plain
 * merge), 0 either. One split: N <= 128 tokens on the tensor-core kernels,
 * <= 64 on the fused one (their fewest tokens per split). */
typedef struct rot_fused_case {
  att_case c;
  const char *want;
  int env, kfused, splits;
} rot_fused_case;
static const rot_fused_case rot_fused_cases[] = {
    /* q4 decode, per-warp kernel: head dims 256, 128, 64; GQA 2 and 4; sinks, ragged, strided; one split */
    {{1, 8, 4, 1, 3000, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, "per-warp,", 1, 1, 2},
    {{2, 8, 2, 1, 1500, 128, 128, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, "per-warp,", 1, 1, 2},
    {{1, 4, 2, 2, 900, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 20.0f, 0, 0, 0}, "per-warp,", 1, 1, 2},
    {{1, 8, 4, 1, 100, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0}, "per-warp,", 1, 1, 1},
    {{2, 4, 2, 2, 128, 64, 64, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, "per-warp,", 1, 1, 1},
    /* q4 at 12 query vectors per KV head on the per-warp kernel (the 16-vector instance, q int8) */
    {{1, 12, 2, 2, 1200, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, "per-warp,", 1, 1, 2},
    {{1, 12, 2, 2, 90, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0}, "per-warp,", 1, 1, 1},
    /* q4 / q8 decode instances of the narrow tensor-core kernel (q int15); head dim 512 */
    {{1, 8, 2, 1, 2000, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0}, "decode instance", 0, 1, 2},
    {{1, 8, 2, 1, 120, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0}, "decode instance", 0, 1, 1},
    {{1, 8, 2, 1, 2000, 128, 128, BF16, BF16, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
     "q8 tensor-core kernel: decode", 0, 1, 2},
    {{1, 4, 2, 1, 1500, 512, 512, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, "decode instance", 0, 1, 2},
    {{1, 4, 2, 1, 100, 512, 512, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0}, "decode instance", 0, 1, 1},
    /* q4 verify L = 8, GQA 6: the warpgroup kernel; head dims 128, 256, 64 */
    {{1, 12, 2, 8, 1000, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, "warpgroup", 2, 1, 2},
    {{1, 12, 2, 8, 700, 256, 256, BF16, F32, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, "warpgroup", 2, 1, 2},
    {{1, 12, 2, 8, 700, 64, 64, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, "warpgroup", 2, 1, 2},
    {{1, 12, 2, 8, 100, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, "warpgroup", 2, 1, 1},
    /* the narrow kernel's 32-vector q4 instance (warpgroup kernel off) and bf16 / f16 decode
     * instances (at head dim 256 with the warpgroup kernel off) */
    {{1, 12, 2, 4, 900, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, "narrow", 3, 1, 2},
    {{1, 8, 2, 1, 900, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
     "bf16 tensor-core kernel: decode", 0, 1, 2},
    {{1, 8, 2, 1, 900, 256, 256, F16, F16, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 0, 0},
     "f16 tensor-core kernel: decode", 3, 1, 2},
    /* ... which at head dim 256 take the warpgroup kernel by default from 3 vectors */
    {{1, 8, 2, 1, 900, 256, 256, F16, F16, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 0, 0},
     "f16 tensor-core kernel: warpgroup", 0, 1, 2},
    /* bf16 at 48 vectors (default): the warpgroup kernel's 16-bit rows */
    {{1, 12, 2, 8, 500, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
     "bf16 tensor-core kernel: warpgroup", 0, 1, 2},
    /* head dim 512 on the warpgroup kernel (kvc_wg512_kernel, from 3 vectors): bf16 and f16, sinks,
     * one split and several */
    {{1, 16, 8, 8, 700, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
     "bf16 tensor-core kernel: warpgroup (wgmma), head dim 512", 0, 1, 2},
    {{1, 8, 2, 2, 100, 512, 512, F16, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 1, 0, 0},
     "f16 tensor-core kernel: warpgroup (wgmma), head dim 512", 0, 1, 1},
    /* the wide kernel (48 vectors per block; warpgroup kernel off): q rotated straight into its
     * fragment slots, every format's dim order (bf16 / f16 rows, q4, q8, fp8), head dims 64, 128,
     * 256, one split and several */
    {{1, 12, 2, 8, 500, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
     "bf16 tensor-core kernel: wide (8 warps)", 3, 1, 2},
    {{1, 12, 2, 8, 100, 64, 64, BF16, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
     "bf16 tensor-core kernel: wide (8 warps)", 3, 1, 1},
    {{1, 12, 2, 8, 700, 256, 256, BF16, F32, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
     "bf16 tensor-core kernel: wide (8 warps)", 3, 1, 2},
    {{1, 12, 2, 4, 300, 128, 128, F16, F16, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 0, 0},
     "f16 tensor-core kernel: wide (8 warps)", 3, 1, 2},
    {{1, 12, 2, 8, 1000, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
     "q4 tensor-core kernel: wide (8 warps)", 3, 1, 2},
    {{1, 12, 2, 8, 120, 256, 256, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0},
     "q4 tensor-core kernel: wide (8 warps)", 3, 1, 1},
    {{1, 12, 2, 4, 400, 64, 64, BF16, BF16, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 1, 0},
     "q8 tensor-core kernel: wide (8 warps)", 3, 1, 2},
    {{1, 8, 2, 4, 600, 256, 256, BF16, BF16, 8, 8, 64, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
     "q8 tensor-core kernel: wide (8 warps)", 3, 1, 2},
    /* (fp8 rows on the wide kernel and e4m3 on the warpgroup one: cuda_rotation_fp8_wide) */
    /* fp8 rows on the warpgroup kernel (default from 16 vectors): q rotated on load, out on store */
    {{1, 24, 4, 8, 600, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, KVA_F8E5M2, MASK_CAUSAL, 0, 0, 1, 0, 0},
     "f8e5m2 tensor-core kernel: warpgroup", 0, 1, 2},
    /* bf16 / f16 at head dim 512, L = 8 GQA 2 and 4: the warpgroup kernel's 512 instances (q rotated on load) */
    {{1, 16, 8, 8, 700, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0},
     "bf16 tensor-core kernel: warpgroup (wgmma), head dim 512", 0, 1, 0},
    {{2, 8, 2, 8, 500, 512, 512, F16, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 1, 1, 0},
     "f16 tensor-core kernel: warpgroup (wgmma), head dim 512", 0, 1, 0},
    /* bf16 / f16 / f32 rows and q8 / q4 over dims the tensor-core kernels lack: the fused kernel, head
     * dims 96, 192, 512, 64 (96 and 192: 3 x 2^k, the 3-point step); one split and several */
    {{1, 4, 2, 1, 700, 128, 128, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 1, 0, 0}, "bf16 fused kernel", 0, 1, 2},
    {{1, 4, 2, 1, 500, 96, 96, F16, F32, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 0, 0, 1}, "f16 fused kernel", 0, 1, 2},
    {{1, 4, 2, 1, 50, 96, 96, F16, F16, 0, 0, 0, F16, MASK_CAUSAL, 0, 0, 1, 0, 0}, "f16 fused kernel", 0, 1, 1},
    {{2, 6, 2, 1, 400, 192, 192, F32, F32, 8, 8, 64, F32, MASK_CAUSAL, 0, 0, 0, 1, 0}, "q8 fused kernel", 0, 1, 2},
    {{1, 6, 2, 2, 60, 192, 192, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, "bf16 fused kernel", 0, 1, 1},
    {{1, 4, 2, 1, 300, 512, 512, BF16, BF16, 0, 0, 0, BF16, MASK_CAUSAL, 0, 0, 0, 0, 0}, "bf16 fused kernel", 0, 1, 2},
    {{1, 2, 1, 1, 40, 64, 64, F32, F32, 0, 0, 0, F32, MASK_CAUSAL, 0, 0, 1, 0, 0}, "f32 fused kernel", 0, 1, 1},
    {{1, 8, 4, 3, 600, 96, 96, F32, BF16, 4, 4, 32, F32, MASK_WINDOW, 50, 0, 0, 0, 0}, "q4 fused kernel", 0, 1, 0},
};
#define NROT_FUSED ((int)(sizeof rot_fused_cases / sizeof rot_fused_cases[0]))

/* The rotated call captured in a CUDA graph (fused: the decode instance
 * rotating q on load and its states on store, the merge) replays to the
 * eager call's bits; so does a one-split call (the kernel alone). */
static int cuda_rot_graph_case(const att_case *c) {
  att_data d;
  if (att_make(&d, c)) {
    FAIL_("could not build operands");
    att_free(&d);
    return 0;
  }
  d.params.flags = ROT_KV;
  dmem m = {{0}, 0};
  dcall dc;
  cudaStream_t s = NULL;
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  kva_context *ctx = NULL;
  int ok = dcall_make(&dc, &m, &d, &d.view, NULL) && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess;
  kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, s};
  ok = ok && kva_context_create(&ctx, &o) == 0;
  char kname[320] = "";
  ok = ok && kva_attention_kernel(ctx, &dc.q, &dc.view, &dc.p, &dc.out, kname, sizeof kname) > 0;
  if (ok && !strstr(kname, rot_how(ROT_KV))) { /* the fused path: q on load, out on store */
    FAIL_("the graph case runs \"%s\", not the fused rotation", kname);
    ok = 0;
  }
  unsigned char *eager = (unsigned char *)malloc(dc.ob), *replay = (unsigned char *)malloc(dc.ob);
  ok = ok && kva_attention(ctx, &dc.q, &dc.view, &dc.p, &dc.out, NULL, 0) == 0 && cudaStreamSynchronize(s) == cudaSuccess;
  ok = ok && cudaMemcpy(eager, dc.out.data, dc.ob, cudaMemcpyDeviceToHost) == cudaSuccess;
  ok = ok && cudaMemset(dc.out.data, 0xff, dc.ob) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
  ok = ok && cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess;
  if (ok) {
    const int rc = kva_attention(ctx, &dc.q, &dc.view, &dc.p, &dc.out, NULL, 0);
    ok = cudaStreamEndCapture(s, &graph) == cudaSuccess && rc == 0;
  }
  ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess && cudaGraphLaunch(exec, s) == cudaSuccess &&
       cudaStreamSynchronize(s) == cudaSuccess;
  ok = ok && cudaMemcpy(replay, dc.out.data, dc.ob, cudaMemcpyDeviceToHost) == cudaSuccess;
  if (!ok) {
    FAIL_("the rotated call [%s] under capture: %s", kname, kva_last_error());
  } else if (memcmp(eager, replay, dc.ob)) {
    FAIL_("[%s]: the graph replay differs from the eager call", kname);
    ok = 0;
  }
  free(eager);
  free(replay);
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  kva_context_destroy(ctx);
  if (s) cudaStreamDestroy(s);
  dfree(&m);
  att_free(&d);
  return ok;
}
TEST(cuda_rotation_graph) {
  if (kva_cuda_device_count() <= 0) SKIP("no CUDA device");
  static const att_case cs[2] = {
      {2, 8, 2, 1, 3000, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0}, /* several splits */
      {2, 8, 2, 1, 100, 128, 128, BF16, BF16, 4, 4, 64, BF16, MASK_CAUSAL, 0, 0, 1, 1, 0},  /* one split */
  };
  for (int i = 0; i < 2; ++i)
    if (!cuda_rot_graph_case(&cs[i])) break;
}

/* One fused case (rot_fused_cases): K and V, K, V rotated (contiguous, both
 * query kinds), and K,V over a block table, in a context with the case's
 * environment (rot_fused_case.env). */
static int rot_fused_run(const rot_fused_case *f) {
  static const unsigned flags[3] = {ROT_KV, KVA_ATTN_ROTATED_K, KVA_ATTN_ROTATED_V};
  if (f->env == 1) setenv("KVA_CUDA_TCD_MIN_WORK", "0", 1);
  if (f->env == 1) setenv("KVA_CUDA_TCD_MAX_Q", "32", 1); /* its 17-32 vector blocks at every head dim */
  if (f->env == 2) setenv("KVA_CUDA_WG_MIN_Q", "1", 1);
  if (f->env == 3) {
    setenv("KVA_CUDA_WG_MIN_Q", "-1", 1);
    setenv("KVA_CUDA_WG_BF16_MIN_Q", "-1", 1);
    setenv("KVA_CUDA_WG_FP8_MIN_Q", "-1", 1);
  }
  kva_context *fc = cuda_ctx();
  unsetenv("KVA_CUDA_TCD_MIN_WORK");
  unsetenv("KVA_CUDA_TCD_MAX_Q");
  unsetenv("KVA_CUDA_WG_MIN_Q");
  unsetenv("KVA_CUDA_WG_BF16_MIN_Q");
  unsetenv("KVA_CUDA_WG_FP8_MIN_Q");
  if (!fc) {
    FAIL_("CUDA context: %s", kva_last_error());
    return 0;
  }
  int ok = 1;
  for (int fi = 0; fi < 3 && ok; ++fi) {
    const unsigned fl = flags[fi];
    const char *how = f->kfused ? rot_how(fl) : fl == KVA_ATTN_ROTATED_K ? NULL : rot_how(KVA_ATTN_ROTATED_V);
    for (int probe = 0; probe < 2 && ok; ++probe)
      ok = cuda_rot_case_want(fc, &f->c, fl, probe, 0, f->want, how, f->splits);
  }
  if (ok) /* over a block table: against the oracle, whichever kernel takes it (the per-warp kernel takes
           * no block table at head dim 64; bf16 decode over a table runs the general kernel) */
    ok = cuda_rot_case_want(fc, &f->c, ROT_KV, 1, 1, NULL, NULL, 0);
  kva_context_destroy(fc);
  return ok;
}

TEST(cuda_rotation_vs_oracle) {
  kva_context *cu = cuda_ctx();
  if (!cu) SKIP("no CUDA device");
  static const unsigned flags[3] = {ROT_KV, KVA_ATTN_ROTATED_K, KVA_ATTN_ROTATED_V};
  /* the CPU table without segment or array masks (their device mirrors are test_cuda.c's) */
  int ok = 1;
  for (int ci = 0; ci < NROT && ok; ++ci) {
    const att_case *c = &rot_cases[ci];
    if (c->mask == MASK_SEG || c->mask == MASK_SEG_CLAMP || c->mask == MASK_ADD || c->mask == MASK_BOOL) continue;
    for (int table = 0; table < 2 && ok; ++table)
      ok = cuda_rot_case(cu, c, table ? ROT_KV : flags[ci % 3], (ci + table) % 2, table);
  }
  kva_context_destroy(cu);
  /* the fused paths, by kernel name */
  for (int ci = 0; ci < NROT_FUSED && ok; ++ci) ok = rot_fused_run(&rot_fused_cases[ci]);
}

/* fp8 rows on the wide kernel (warpgroup kernel off): q rotated on load, out
 * on store; e4m3 and e5m2, head dims 64 / 128 / 256, out f32 and
 * bf16, one split and several; one warpgroup case (a quick subset, also for
 * a sanitizer run) */
TEST(cuda_rotation_fp8_wide) {
  if (kva_cuda_device_count() <= 0) SKIP("no CUDA device");
  static const rot_fused_case cs[] = {
      {{1, 8, 4, 8, 800, 128, 128, BF16, F32, 0, 0, ATT_FP8_TOKEN, KVA_F8E4M3, MASK_CAUSAL, 0, 0, 0, 0, 0},
       "f8e4m3 tensor-core kernel: wide (8 warps)", 3, 1, 2},
      {{1, 8, 4, 8, 100, 128, 128, BF16, BF16, 0, 0, ATT_FP8_TOKEN, KVA_F8E4M3, MASK_CAUSAL, 0, 0, 0, 0, 0},
       "f8e4m3 tensor-core kernel: wide (8 warps)", 3, 1, 1},
      {{1, 12, 2, 4, 600, 256, 256, BF16, BF16, 0, 0, ATT_FP8_TOKEN, KVA_F8E5M2, MASK_CAUSAL, 0, 0, 1, 0, 0},
       "f8e5m2 tensor-core kernel: wide (8 warps)", 3, 1, 2},
      {{1, 8, 2, 6, 500, 64, 64, BF16, F32, 0, 0, ATT_FP8_TOKEN, KVA_F8E4M3, MASK_CAUSAL, 0, 0, 0, 0, 0},
       "f8e4m3 tensor-core kernel: wide (8 warps)", 3, 1, 2},
      /* and on the warpgroup kernel (default from 16 vectors): q rotated on load there */
      {{1, 8, 4, 8, 800, 128, 128, BF16, F32, 0, 0, ATT_FP8_TOKEN, KVA_F8E4M3, MASK_CAUSAL, 0, 0, 0, 0, 0},
       "f8e4m3 tensor-core kernel: warpgroup", 0, 1, 2},
  };
  for (size_t i = 0; i < sizeof cs / sizeof cs[0]; ++i)
    if (!rot_fused_run(&cs[i])) break;
}
#endif
