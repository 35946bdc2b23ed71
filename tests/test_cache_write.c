/* kva_cache_write (the append step into caller-owned pools): every row it
 * writes is bit for bit kva_quantize (quantized pools) or kva_convert (float
 * pools) of the same input row, and no other byte of the pools changes. Pools
 * and inputs live in strided views of random buffers (row padding, outer dims
 * in a random memory order), so every byte that is not a written row is a
 * sentinel. The CUDA backend is compared with the same expected bytes; an
 * end-to-end check attends the written pool through a block-table view. */
#include "attn_check.h"

#define GUARD 64 /* random bytes after every buffer */

static int rnd_int(int lo, int hi) { return lo + (int)(test_rand_u64() % (uint64_t)(hi - lo + 1)); }

static const kva_dtype FLOATS[3] = {KVA_F32, KVA_F16, KVA_BF16};
static const int BITS[3] = {2, 4, 8}, GROUPS[3] = {32, 64, 128};

/* ------------------------------------------------------------ buffers */
/* A host buffer of random bytes, its snapshot, and the expected contents. */
typedef struct cw_buf {
  unsigned char *p, *snap, *exp;
  size_t n;
} cw_buf;

static void buf_init(cw_buf *b, size_t bytes) {
  b->n = bytes + GUARD;
  b->p = malloc(b->n);
  b->snap = malloc(b->n);
  b->exp = malloc(b->n);
  for (size_t i = 0; i < b->n; i += 8) {
    uint64_t r = test_rand_u64();
    memcpy(b->p + i, &r, b->n - i < 8 ? b->n - i : 8);
  }
  memcpy(b->snap, b->p, b->n);
  memcpy(b->exp, b->p, b->n);
}
static void buf_free(cw_buf *b) {
  if (b->p) { free(b->p); free(b->snap); free(b->exp); }
  memset(b, 0, sizeof *b);
}
/* The address in the expected copy of a byte of the buffer. */
static void *xlate(const cw_buf *b, const void *ptr) { return b->exp + ((const unsigned char *)ptr - b->p); }
/* First offset where the buffer differs from `want` (-1: equal). */
static int64_t buf_diff(const cw_buf *b, const unsigned char *want) {
  for (size_t i = 0; i < b->n; ++i)
    if (b->p[i] != want[i]) return (int64_t)i;
  return -1;
}

/* A rank-nd tensor of `shape` in a fresh buffer: rows padded by 0..3
 * elements, outer dims laid out in a random order with 0..2 elements between
 * slices (packed: row-major, no padding). */
static kva_tensor strided(cw_buf *b, kva_dtype dt, int nd, const int64_t *shape, bool packed) {
  kva_tensor t;
  memset(&t, 0, sizeof t);
  t.dtype = dt;
  t.ndim = nd;
  const int64_t es = (int64_t)kva_dtype_size(dt);
  int order[KVA_MAX_DIMS], nl = nd - 1;
  for (int i = 0; i < nl; ++i) order[i] = i;
  for (int i = nl - 1; i > 0 && !packed; --i) { /* Fisher-Yates */
    int j = rnd_int(0, i), tmp = order[i];
    order[i] = order[j];
    order[j] = tmp;
  }
  int64_t s = (shape[nd - 1] + (packed ? 0 : rnd_int(0, 3))) * es;
  for (int i = nl - 1; i >= 0; --i) {
    t.stride[order[i]] = s;
    s = s * shape[order[i]] + (packed ? 0 : rnd_int(0, 2)) * es;
  }
  for (int d = 0; d < nd; ++d) t.shape[d] = shape[d];
  t.stride[nd - 1] = es;
  buf_init(b, (size_t)s);
  t.data = b->p;
  return t;
}

/* ------------------------------------------------------------- pools */
typedef struct cw_pool {
  kva_kv kv; /* [num_blocks, KVH, block_size, D] */
  cw_buf data, scales, biases;
  int64_t D;
} cw_pool;

/* bits 0: float pool of dtype dt; else dt is the scales/biases dtype. */
static void pool_init(cw_pool *p, int64_t nb, int64_t KVH, int64_t bs, int64_t D, int bits, int gs, kva_dtype dt,
                      bool packed) {
  memset(p, 0, sizeof *p);
  p->D = D;
  p->kv.bits = bits;
  p->kv.group_size = bits ? gs : 0;
  int64_t shape[4] = {nb, KVH, bs, bits ? D * bits / 32 : D};
  p->kv.data = strided(&p->data, bits ? KVA_U32 : dt, 4, shape, packed);
  if (!bits) return;
  shape[3] = D / gs;
  p->kv.scales = strided(&p->scales, dt, 4, shape, packed);
  p->kv.biases = strided(&p->biases, dt, 4, shape, packed);
}
static void pool_free(cw_pool *p) {
  buf_free(&p->data);
  buf_free(&p->scales);
  buf_free(&p->biases);
}
static int pool_nbufs(const cw_pool *p) { return p->kv.bits ? 3 : 1; }
static cw_buf *pool_buf(cw_pool *p, int i) { return i == 0 ? &p->data : i == 1 ? &p->scales : &p->biases; }
/* Every byte as it was before the call? */
static bool pool_untouched(cw_pool *p) {
  for (int i = 0; i < pool_nbufs(p); ++i)
    if (memcmp(pool_buf(p, i)->p, pool_buf(p, i)->snap, pool_buf(p, i)->n)) return false;
  return true;
}
/* Every byte as expected? Reports the first difference. */
static bool pool_as_expected(cw_pool *p, const char *label, const char *which) {
  static const char *names[3] = {"data", "scales", "biases"};
  for (int i = 0; i < pool_nbufs(p); ++i) {
    int64_t at = buf_diff(pool_buf(p, i), pool_buf(p, i)->exp);
    if (at >= 0) {
      FAIL_("%s: %s.%s byte %lld of %zu: got %02x, expected %02x (was %02x)", label, which, names[i], (long long)at,
            pool_buf(p, i)->n, pool_buf(p, i)->p[at], pool_buf(p, i)->exp[at], pool_buf(p, i)->snap[at]);
      return false;
    }
  }
  return true;
}
static char *at4(const kva_tensor *t, int64_t a, int64_t b, int64_t c) {
  return (char *)t->data + a * t->stride[0] + b * t->stride[1] + c * t->stride[2];
}

/* The expected row: kva_quantize / kva_convert of the input row, written
 * into the expected copy of the pool at (blk, h, row). */
static int expect_row(cw_pool *p, const kva_tensor *src, int64_t i, int64_t h, int64_t blk, int64_t row) {
  kva_tensor s = kva_tensor_1d((char *)src->data + i * src->stride[0] + h * src->stride[1], src->dtype, p->D);
  if (!p->kv.bits) {
    kva_tensor d = kva_tensor_1d(xlate(&p->data, at4(&p->kv.data, blk, h, row)), p->kv.data.dtype, p->D);
    return kva_convert(&s, &d);
  }
  kva_kv o;
  memset(&o, 0, sizeof o);
  o.bits = p->kv.bits;
  o.group_size = p->kv.group_size;
  o.data = kva_tensor_1d(xlate(&p->data, at4(&p->kv.data, blk, h, row)), KVA_U32, p->D * o.bits / 32);
  o.scales = kva_tensor_1d(xlate(&p->scales, at4(&p->kv.scales, blk, h, row)), p->kv.scales.dtype, p->D / o.group_size);
  o.biases = kva_tensor_1d(xlate(&p->biases, at4(&p->kv.biases, blk, h, row)), p->kv.biases.dtype, p->D / o.group_size);
  return kva_quantize(&s, &o);
}

/* ------------------------------------------------------------ inputs */
/* Row contents: ordinary data with a per-group magnitude and offset, and the
 * groups that stress the quantizer (constant, zeros, one sign, huge or tiny
 * ranges, rint ties, signed zeros); with nonfinite also NaN/Inf groups. */
#define NKINDS_FINITE 9
#define NKINDS 14
static void fill_group(float *x, int gs, int kind, kva_dtype dt) {
  static const float mags[] = {1e-3f, 0.1f, 1.0f, 30.0f, 1e3f};
  const float huge = dt == KVA_F16 ? 6e4f : 1e30f; /* finite in the input dtype */
  const float c = test_randn(), mag = mags[rnd_int(0, 4)], off = rnd_int(0, 1) ? 0.0f : mag * test_randu(-3, 3);
  for (int j = 0; j < gs; ++j) x[j] = off + mag * test_randn();
  switch (kind) {
  case 0: case 1: break;                                                          /* ordinary */
  case 2: for (int j = 0; j < gs; ++j) x[j] = c; break;                           /* constant */
  case 3: for (int j = 0; j < gs; ++j) x[j] = 0.0f; break;                        /* zeros */
  case 4: for (int j = 0; j < gs; ++j) x[j] = -fabsf(x[j]) - 0.25f * mag; break;  /* negative only */
  case 5: x[rnd_int(0, gs - 1)] = huge; x[rnd_int(0, gs - 1)] = -huge; break;      /* huge range */
  case 6: for (int j = 0; j < gs; ++j) x[j] = c * (1.0f + 1e-6f * test_randu(-1, 1)); break; /* tiny range */
  case 7: for (int j = 0; j < gs; ++j) x[j] = 0.5f * (float)rnd_int(-15, 15);     /* rint ties */
    x[0] = -7.5f; x[gs - 1] = 7.5f; break;
  case 8: for (int j = 0; j < gs; ++j) x[j] = (test_rand_u64() & 1) ? 0.0f : -0.0f; break;
  case 9: x[rnd_int(0, gs - 1)] = NAN; break;
  case 10: x[rnd_int(0, gs - 1)] = INFINITY; break;
  case 11: for (int j = 0; j < gs; ++j) x[j] = NAN; break;
  case 12: x[0] = -INFINITY; x[gs - 1] = INFINITY; break;
  case 13: for (int j = 0; j < gs; ++j) x[j] = (j & 1) ? INFINITY : -1.0f; break;
  }
}
/* Fills every row of t [n, KVH, D] (groups of gs). */
static void fill_rows(kva_tensor *t, int gs, bool nonfinite) {
  const int64_t es = (int64_t)kva_dtype_size(t->dtype), D = t->shape[2];
  float x[128];
  for (int64_t i = 0; i < t->shape[0]; ++i)
    for (int64_t h = 0; h < t->shape[1]; ++h)
      for (int64_t g = 0; g < D / gs; ++g) {
        fill_group(x, gs, rnd_int(0, nonfinite ? NKINDS - 1 : NKINDS_FINITE - 1), t->dtype);
        for (int j = 0; j < gs; ++j) test_store(at4(t, i, h, 0) + (g * gs + j) * es, t->dtype, x[j]);
      }
}

/* ------------------------------------------------------------- cases */
typedef struct cw_fmt {
  int kbits, vbits, group; /* 0 = float pool */
  kva_dtype kdt, vdt;      /* float pool dtype, or the scales/biases dtype */
  kva_dtype kin, vin;      /* input dtypes */
} cw_fmt;

typedef struct cw_case {
  cw_fmt f;
  int64_t nb, KVH, bs, n;
  cw_pool kp, vp;
  cw_buf kin, vin;
  kva_tensor k, v; /* [n, KVH, Dk], [n, KVH, Dv] */
  int32_t *slots;  /* [n] */
  char label[160];
} cw_case;

/* A random case of format f: a few blocks of an odd block size, Dk != Dv
 * (when a quantized pool allows another multiple of its group), n tokens at
 * distinct random slots, about one in five skipped (negative). */
static void cw_make(cw_case *c, const cw_fmt *f, bool nonfinite, int64_t n_max) {
  static const int64_t sizes[] = {1, 3, 8, 16};
  memset(c, 0, sizeof *c);
  c->f = *f;
  c->nb = rnd_int(2, 5);
  c->KVH = rnd_int(1, 3);
  c->bs = sizes[rnd_int(0, 3)];
  const int gs = f->group ? f->group : 32;
  const int64_t Dk = (int64_t)gs * rnd_int(1, 3);
  int64_t Dv = (int64_t)gs * rnd_int(1, 3);
  if (Dv == Dk) Dv = Dk == gs ? 2 * gs : Dk - gs;
  const int64_t nslots = c->nb * c->bs;
  c->n = rnd_int(1, (int)(nslots < n_max ? nslots : n_max));
  pool_init(&c->kp, c->nb, c->KVH, c->bs, Dk, f->kbits, f->group, f->kdt, false);
  pool_init(&c->vp, c->nb, c->KVH, c->bs, Dv, f->vbits, f->group, f->vdt, false);
  int64_t ks[3] = {c->n, c->KVH, Dk}, vs[3] = {c->n, c->KVH, Dv};
  c->k = strided(&c->kin, f->kin, 3, ks, false);
  c->v = strided(&c->vin, f->vin, 3, vs, false);
  fill_rows(&c->k, gs, nonfinite);
  fill_rows(&c->v, gs, nonfinite);
  memcpy(c->kin.snap, c->kin.p, c->kin.n);
  memcpy(c->vin.snap, c->vin.p, c->vin.n);
  /* distinct slots: a partial shuffle of 0..nslots-1 */
  int32_t *all = malloc(sizeof(int32_t) * (size_t)nslots);
  for (int64_t s = 0; s < nslots; ++s) all[s] = (int32_t)s;
  c->slots = malloc(sizeof(int32_t) * (size_t)c->n);
  for (int64_t i = 0; i < c->n; ++i) {
    int64_t j = i + (int64_t)(test_rand_u64() % (uint64_t)(nslots - i));
    int32_t t = all[i];
    all[i] = all[j];
    all[j] = t;
    c->slots[i] = rnd_int(0, 4) ? all[i] : (rnd_int(0, 1) ? -1 : INT32_MIN + rnd_int(0, 1000));
  }
  free(all);
  snprintf(c->label, sizeof c->label, "K %d-bit/%s V %d-bit/%s group %d in %s/%s nb %lld KVH %lld bs %lld "
           "Dk %lld Dv %lld n %lld", f->kbits, kva_dtype_name(f->kdt), f->vbits, kva_dtype_name(f->vdt), f->group,
           kva_dtype_name(f->kin), kva_dtype_name(f->vin), (long long)c->nb, (long long)c->KVH, (long long)c->bs,
           (long long)Dk, (long long)Dv, (long long)c->n);
}
static void cw_free(cw_case *c) {
  pool_free(&c->kp);
  pool_free(&c->vp);
  buf_free(&c->kin);
  buf_free(&c->vin);
  free(c->slots);
  c->slots = NULL;
}

/* Expected pools after writing tokens in order (a later token naming the
 * same slot wins; out-of-range and negative slots skipped). */
static int cw_expect(cw_case *c) {
  const int64_t nslots = c->nb * c->bs;
  for (int64_t i = 0; i < c->n; ++i) {
    const int32_t s = c->slots[i];
    if (s < 0 || s >= nslots) continue;
    for (int64_t h = 0; h < c->KVH; ++h)
      if (expect_row(&c->kp, &c->k, i, h, s / c->bs, s % c->bs) ||
          expect_row(&c->vp, &c->v, i, h, s / c->bs, s % c->bs)) {
        FAIL_("%s: building the expected rows: %s", c->label, kva_last_error());
        return 0;
      }
  }
  return 1;
}
/* Pools as expected and the inputs unchanged. */
static int cw_check(cw_case *c, const char *backend) {
  char label[200];
  snprintf(label, sizeof label, "%s [%s]", c->label, backend);
  if (!pool_as_expected(&c->kp, label, "k_pool") || !pool_as_expected(&c->vp, label, "v_pool")) return 0;
  if (memcmp(c->kin.p, c->kin.snap, c->kin.n) || memcmp(c->vin.p, c->vin.snap, c->vin.n)) {
    FAIL_("%s: an input was modified", label);
    return 0;
  }
  return 1;
}

/* Runs a case on the CPU: kva_cache_write against the expected pools. */
static int cw_run_cpu(kva_context *ctx, const cw_fmt *f, bool nonfinite, int64_t n_max) {
  cw_case c;
  cw_make(&c, f, nonfinite, n_max);
  int ok = cw_expect(&c);
  if (ok) {
    int rc = kva_cache_write(ctx, &c.kp.kv, &c.vp.kv, &c.k, &c.v, c.slots, c.n);
    if (rc) {
      FAIL_("%s: kva_cache_write: %s", c.label, kva_last_error());
      ok = 0;
    } else {
      ok = cw_check(&c, "cpu");
    }
  }
  cw_free(&c);
  return ok;
}

static kva_context *cpu_ctx(int threads) {
  kva_context *ctx = NULL;
  kva_context_opts o = {KVA_BACKEND_CPU, threads, 0, NULL};
  if (kva_context_create(&ctx, &o)) FAIL_("kva_context_create: %s", kva_last_error());
  return ctx;
}

/* ---------------------------------------------------------- CPU tests */
/* bits x group x scales dtype x input dtype; K and V quantized alike. */
TEST(cache_write_quantized_matches_quantize) {
  kva_context *ctx = cpu_ctx(2);
  ASSERT_TRUE(ctx != NULL);
  for (int bi = 0; bi < 3; ++bi)
    for (int gi = 0; gi < 3; ++gi)
      for (int si = 0; si < 3; ++si)
        for (int ii = 0; ii < 3; ++ii) {
          const cw_fmt f = {BITS[bi], BITS[bi], GROUPS[gi], FLOATS[si], FLOATS[si], FLOATS[ii], FLOATS[(ii + 1) % 3]};
          if (!cw_run_cpu(ctx, &f, false, 12)) goto done;
        }
done:
  kva_context_destroy(ctx);
}

/* Float pools of every dtype from every input dtype; mixed K/V formats. */
TEST(cache_write_float_pools) {
  kva_context *ctx = cpu_ctx(2);
  ASSERT_TRUE(ctx != NULL);
  for (int pi = 0; pi < 3; ++pi)
    for (int ii = 0; ii < 3; ++ii) {
      const cw_fmt f = {0, 0, 0, FLOATS[pi], FLOATS[(pi + 1) % 3], FLOATS[ii], FLOATS[(ii + 2) % 3]};
      if (!cw_run_cpu(ctx, &f, false, 12)) goto done;
    }
  /* quantized K with a float V, and the reverse */
  for (int r = 0; r < 2; ++r) {
    const cw_fmt a = {4, 0, 64, KVA_BF16, KVA_F16, KVA_F32, KVA_BF16};
    const cw_fmt b = {0, 8, 32, KVA_F32, KVA_F16, KVA_F16, KVA_F32};
    if (!cw_run_cpu(ctx, r ? &b : &a, false, 12)) break;
  }
done:
  kva_context_destroy(ctx);
}

/* NaN / Inf in the rows: still exactly kva_quantize's bytes. */
TEST(cache_write_nonfinite) {
  kva_context *ctx = cpu_ctx(1);
  ASSERT_TRUE(ctx != NULL);
  for (int bi = 0; bi < 3; ++bi)
    for (int si = 0; si < 3; ++si) {
      const cw_fmt f = {BITS[bi], BITS[bi], GROUPS[(bi + si) % 3], FLOATS[si], FLOATS[si], FLOATS[(si + 1) % 3],
                        FLOATS[si]};
      if (!cw_run_cpu(ctx, &f, true, 12)) goto done;
    }
  {
    const cw_fmt f = {0, 0, 0, KVA_F16, KVA_BF16, KVA_F32, KVA_F16};
    cw_run_cpu(ctx, &f, true, 12);
  }
done:
  kva_context_destroy(ctx);
}

/* Enough rows for the context's thread pool (one task per K/V head), and the
 * calling thread alone: the same bytes. */
TEST(cache_write_threads) {
  kva_context *ctx4 = cpu_ctx(4), *ctx1 = cpu_ctx(1);
  ASSERT_TRUE(ctx4 && ctx1);
  const cw_fmt f = {4, 4, 64, KVA_BF16, KVA_BF16, KVA_F32, KVA_BF16};
  cw_case c;
  memset(&c, 0, sizeof c);
  c.f = f;
  c.nb = 40;
  c.KVH = 4;
  c.bs = 16;
  c.n = test_quick ? 70 : 300;
  pool_init(&c.kp, c.nb, c.KVH, c.bs, 128, 4, 64, KVA_BF16, true);
  pool_init(&c.vp, c.nb, c.KVH, c.bs, 192, 4, 64, KVA_BF16, false);
  int64_t ks[3] = {c.n, c.KVH, 128}, vs[3] = {c.n, c.KVH, 192};
  c.k = strided(&c.kin, KVA_F32, 3, ks, false);
  c.v = strided(&c.vin, KVA_BF16, 3, vs, true);
  fill_rows(&c.k, 64, false);
  fill_rows(&c.v, 64, false);
  memcpy(c.kin.snap, c.kin.p, c.kin.n);
  memcpy(c.vin.snap, c.vin.p, c.vin.n);
  c.slots = malloc(sizeof(int32_t) * (size_t)c.n);
  for (int64_t i = 0; i < c.n; ++i) /* in order, with gaps, a few skipped */
    c.slots[i] = i % 17 == 5 ? -1 : (int32_t)(i * 2 + (i & 1));
  snprintf(c.label, sizeof c.label, "threads: n %lld", (long long)c.n);
  if (cw_expect(&c)) {
    ASSERT_OK(kva_cache_write(ctx4, &c.kp.kv, &c.vp.kv, &c.k, &c.v, c.slots, c.n));
    if (cw_check(&c, "4 threads")) {
      for (int p = 0; p < 2; ++p) /* back to the start, then the calling thread alone */
        for (int i = 0; i < pool_nbufs(p ? &c.vp : &c.kp); ++i) {
          cw_buf *b = pool_buf(p ? &c.vp : &c.kp, i);
          memcpy(b->p, b->snap, b->n);
        }
      ASSERT_OK(kva_cache_write(ctx1, &c.kp.kv, &c.vp.kv, &c.k, &c.v, c.slots, c.n));
      cw_check(&c, "1 thread");
    }
  }
  cw_free(&c);
  kva_context_destroy(ctx4);
  kva_context_destroy(ctx1);
}

/* Two tokens naming one slot: the later one's rows (the CPU writes in token order). */
TEST(cache_write_duplicate_slots) {
  kva_context *ctx = cpu_ctx(1);
  ASSERT_TRUE(ctx != NULL);
  const cw_fmt f = {4, 4, 32, KVA_F16, KVA_F16, KVA_F32, KVA_F32};
  cw_case c;
  cw_make(&c, &f, false, 12);
  if (c.n >= 3) {
    c.slots[c.n - 1] = c.slots[0] >= 0 ? c.slots[0] : 0;
    c.slots[1] = c.slots[c.n - 1];
  }
  if (cw_expect(&c)) { /* cw_expect applies the tokens in order: the last wins */
    ASSERT_OK(kva_cache_write(ctx, &c.kp.kv, &c.vp.kv, &c.k, &c.v, c.slots, c.n));
    cw_check(&c, "cpu");
  }
  cw_free(&c);
  kva_context_destroy(ctx);
}

/* Every invalid argument: its status, a message naming it, pools untouched. */
TEST(cache_write_errors) {
  kva_context *ctx = cpu_ctx(1);
  ASSERT_TRUE(ctx != NULL);
  const cw_fmt f = {4, 4, 32, KVA_BF16, KVA_BF16, KVA_F32, KVA_F32};
  cw_case c;
  cw_make(&c, &f, false, 12);
  while (c.n < 3 || c.KVH < 2 || c.bs < 2) { /* room to shrink every dim */
    cw_free(&c);
    cw_make(&c, &f, false, 12);
  }
  for (int64_t i = 0; i < c.n; ++i) c.slots[i] = (int32_t)i; /* all valid */
  kva_kv kp = c.kp.kv, vp = c.vp.kv, bad;
  kva_tensor k = c.k, v = c.v, bt;
  const int64_t n = c.n, nslots = c.nb * c.bs;
  int32_t *s = c.slots;
#define UNTOUCHED() ASSERT_TRUE(pool_untouched(&c.kp) && pool_untouched(&c.vp))
  ASSERT_ERR(kva_cache_write(NULL, &kp, &vp, &k, &v, s, n), KVA_EINVAL, "ctx");
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &k, &v, s, -1), KVA_EINVAL, "n = -1");
  ASSERT_ERR(kva_cache_write(ctx, NULL, &vp, &k, &v, s, n), KVA_EINVAL, "k_pool");
  ASSERT_ERR(kva_cache_write(ctx, &kp, NULL, &k, &v, s, n), KVA_EINVAL, "v_pool");
  bad = kp; bad.bits = 3;
  ASSERT_ERR(kva_cache_write(ctx, &bad, &vp, &k, &v, s, n), KVA_EUNSUPPORTED, "k_pool.bits");
  bad = vp; bad.group_size = 16;
  ASSERT_ERR(kva_cache_write(ctx, &kp, &bad, &k, &v, s, n), KVA_EUNSUPPORTED, "v_pool.group_size");
  bad = kp; bad.data.ndim = 3;
  ASSERT_ERR(kva_cache_write(ctx, &bad, &vp, &k, &v, s, n), KVA_ESHAPE, "k_pool.data");
  bad = kp; bad.data.dtype = KVA_F32;
  ASSERT_ERR(kva_cache_write(ctx, &bad, &vp, &k, &v, s, n), KVA_EDTYPE, "k_pool.data");
  bad = kp; bad.biases.dtype = KVA_F16;
  ASSERT_ERR(kva_cache_write(ctx, &bad, &vp, &k, &v, s, n), KVA_EDTYPE, "k_pool");
  bad = kp; bad.scales.shape[3] -= 1;
  ASSERT_ERR(kva_cache_write(ctx, &bad, &vp, &k, &v, s, n), KVA_ESHAPE, "k_pool");
  bad = kp; bad.data.stride[3] = 8;
  ASSERT_ERR(kva_cache_write(ctx, &bad, &vp, &k, &v, s, n), KVA_ESTRIDE, "k_pool.data");
  for (int d = 0; d < 3; ++d) { /* num_blocks, KVH, block_size */
    bad = vp;
    bad.data.shape[d] -= 1; /* smaller: still a valid tensor */
    bad.scales.shape[d] -= 1;
    bad.biases.shape[d] -= 1;
    ASSERT_ERR(kva_cache_write(ctx, &kp, &bad, &k, &v, s, n), KVA_ESHAPE, "v_pool.shape[");
  }
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, NULL, &v, s, n), KVA_EINVAL, "k");
  bt = k; bt.ndim = 4;
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &bt, &v, s, n), KVA_ESHAPE, "k");
  bt = v; bt.dtype = KVA_I32;
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &k, &bt, s, n), KVA_EDTYPE, "v");
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &k, &v, s, n - 1), KVA_ESHAPE, "n = ");
  bt = k; bt.shape[1] -= 1;
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &bt, &v, s, n), KVA_ESHAPE, "k.shape[1]");
  bt = v; bt.shape[2] -= 1;
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &k, &bt, s, n), KVA_ESHAPE, "v.shape[2]");
  bt = k; bt.stride[2] = 8;
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &bt, &v, s, n), KVA_ESTRIDE, "k");
  bt = k; bt.data = NULL;
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &bt, &v, s, n), KVA_EINVAL, "k.data");
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &k, &v, NULL, n), KVA_EINVAL, "slots");
  /* outputs overlapping inputs */
  bt = k; bt.data = c.kp.data.p;
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &bt, &v, s, n), KVA_EINVAL, "k_pool.data overlaps k");
  /* (v's extent, from the start of v_pool.biases, may run past that array
   * into whichever pool array the heap put after it: the message names the
   * first overlapped array, so only "overlaps v" is certain) */
  bt = v; bt.data = c.vp.biases.p;
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &k, &bt, s, n), KVA_EINVAL, "overlaps v (the pools are outputs)");
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &k, &v, (const int32_t *)c.kp.scales.p, n), KVA_EINVAL,
             "k_pool.scales overlaps slots");
  UNTOUCHED();
  /* a slot out of range after valid ones: an error naming it, nothing written */
  char msg[64];
  s[n - 1] = (int32_t)nslots;
  snprintf(msg, sizeof msg, "slots[%lld] = %lld", (long long)(n - 1), (long long)nslots);
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &k, &v, s, n), KVA_EINVAL, msg);
  s[n - 1] = INT32_MAX;
  ASSERT_ERR(kva_cache_write(ctx, &kp, &vp, &k, &v, s, n), KVA_EINVAL, "out of range");
  UNTOUCHED();
  /* n == 0: a no-op (k, v, slots not read); the pools are still checked */
  ASSERT_OK(kva_cache_write(ctx, &kp, &vp, NULL, NULL, NULL, 0));
  bad = kp; bad.bits = 5;
  ASSERT_ERR(kva_cache_write(ctx, &bad, &vp, NULL, NULL, NULL, 0), KVA_EUNSUPPORTED, "k_pool.bits");
  /* all slots skipped: nothing written */
  for (int64_t i = 0; i < n; ++i) s[i] = -1 - (int32_t)i;
  ASSERT_OK(kva_cache_write(ctx, &kp, &vp, &k, &v, s, n));
  UNTOUCHED();
  ASSERT_TRUE(kva_last_error()[0] == '\0');
#undef UNTOUCHED
  cw_free(&c);
  kva_context_destroy(ctx);
}

/* Random bad input: valid cases broken by one to three random mutations of
 * the pools, inputs, slots and n (att_mutate_tensor / att_mutate_kv, slot
 * values out of range or moved to a free slot, n changed, NULL pointers).
 * Each call must fail with a message and leave every pool and input byte
 * (guards included) as it was, or succeed and write exactly the rows its
 * descriptors name, bit for bit kva_quantize / kva_convert of the input
 * rows, and no other byte. Under ASan and UBSan in `make test`. */
static void mutate_write(kva_kv *kp, kva_kv *vp, kva_tensor *k, kva_tensor *v, int32_t *slots, int64_t n0,
                         int64_t *n, int64_t nslots, const int32_t **sp) {
  switch (att_pick(9)) {
  case 0: att_mutate_kv(kp); break;
  case 1: att_mutate_kv(vp); break;
  case 2: att_mutate_tensor(k); break;
  case 3: att_mutate_tensor(v); break;
  case 4: case 5: { /* a slot: out of range, skipped, or moved to a free slot */
    const int64_t i = att_pick((int)n0); /* n0 >= 1: the slots the case allocated */
    int32_t free_slot = -1;
    for (int64_t s = att_pick((int)nslots), tries = 0; tries < nslots && free_slot < 0; ++tries, s = (s + 1) % nslots) {
      int used = 0;
      for (int64_t j = 0; j < n0 && !used; ++j) used = slots[j] == s;
      if (!used) free_slot = (int32_t)s;
    }
    const int64_t vals[] = {nslots, nslots + 7, INT32_MAX, -1, INT32_MIN, free_slot};
    slots[i] = (int32_t)vals[att_pick(6)];
    break;
  }
  case 6: {
    const int64_t vals[] = {0, -1, *n - 1, *n + 1, att_absurd()};
    const int64_t x = vals[att_pick(5)];
    if (x <= n0 || x == vals[4]) *n = x; /* never more tokens than the slots hold, unless absurd */
    break;
  }
  case 7: *sp = NULL; break;
  default:
    if (att_pick(2)) k->data = NULL;
    else v->data = NULL;
    break;
  }
}

TEST(cache_write_random_mutations) {
  static const cw_fmt fmts[] = {
      {4, 4, 32, KVA_BF16, KVA_BF16, KVA_F32, KVA_F32}, {8, 8, 64, KVA_F16, KVA_F16, KVA_BF16, KVA_BF16},
      {0, 0, 0, KVA_BF16, KVA_F16, KVA_F32, KVA_BF16},  {2, 4, 32, KVA_F32, KVA_BF16, KVA_F16, KVA_F32},
  };
  kva_context *ctx = cpu_ctx(2);
  ASSERT_TRUE(ctx != NULL);
  const int iters = test_quick ? 300 : 1500;
  int accepted = 0;
  for (int it = 0; it < iters && !test_failed_flag; ++it) {
    cw_case c;
    cw_make(&c, &fmts[it % 4], false, 12);
    kva_kv kp = c.kp.kv, vp = c.vp.kv;
    kva_tensor k = c.k, v = c.v;
    int64_t n = c.n;
    const int64_t nslots = c.nb * c.bs;
    const int32_t *sp = c.slots;
    const int nm = 1 + att_pick(3);
    for (int m = 0; m < nm; ++m) mutate_write(&kp, &vp, &k, &v, c.slots, c.n, &n, nslots, &sp);
    const int rc = kva_cache_write(ctx, &kp, &vp, &k, &v, sp, n);
    const int inputs_kept = !memcmp(c.kin.p, c.kin.snap, c.kin.n) && !memcmp(c.vin.p, c.vin.snap, c.vin.n);
    if (rc < 0) {
      if (!kva_last_error()[0]) FAIL_("iteration %d: code %d without a message", it, rc);
      else if (!pool_untouched(&c.kp) || !pool_untouched(&c.vp) || !inputs_kept)
        FAIL_("iteration %d (%s): error %d (%s) but a pool or input changed", it, c.label, rc, kva_last_error());
    } else {
      ++accepted;
      /* the expected bytes under the mutated (valid) descriptors */
      cw_pool pk = c.kp, pv = c.vp;
      pk.kv = kp;
      pv.kv = vp;
      pk.D = kva_kv_dim(&kp);
      pv.D = kva_kv_dim(&vp);
      const int64_t bs = kp.data.shape[2], ns = kp.data.shape[0] * bs;
      for (int64_t i = 0; i < n && !test_failed_flag; ++i) {
        const int32_t s = sp[i];
        if (s < 0) continue;
        if (s >= ns) { FAIL_("iteration %d (%s): slot %d of %lld accepted", it, c.label, (int)s, (long long)ns); break; }
        for (int64_t h = 0; h < kp.data.shape[1]; ++h)
          if (expect_row(&pk, &k, i, h, s / bs, s % bs) || expect_row(&pv, &v, i, h, s / bs, s % bs)) {
            FAIL_("iteration %d (%s): expected rows: %s", it, c.label, kva_last_error());
            break;
          }
      }
      if (!test_failed_flag && (!pool_as_expected(&pk, c.label, "k_pool") || !pool_as_expected(&pv, c.label, "v_pool")))
        FAIL_("iteration %d: accepted call wrote other bytes", it);
      if (!inputs_kept) FAIL_("iteration %d (%s): an input was modified", it, c.label);
    }
    cw_free(&c);
  }
  fprintf(stderr, "  %d mutated calls, %d accepted\n", iters, accepted);
  if (!test_failed_flag && accepted == 0) FAIL_("no mutated call was accepted (the expected-bytes branch never ran)");
  kva_context_destroy(ctx);
}

/* ------------------------------------------------- end to end (CPU) */
/* A sequence written token by token through kva_cache_write into scattered
 * pool blocks holds, row for row, the bytes of kva_quantize over the whole
 * contiguous cache; attended through a block-table view it gives what the
 * contiguous cache gives (the oracle: exactly; kva_attention: to f32 rounding). */
TEST(cache_write_then_attend_block_table) {
  enum { KVH = 2, H = 4, L = 2, D = 64, BS = 8, NB = 9, N = 53, GS = 32 };
  kva_context *ctx = cpu_ctx(2);
  ASSERT_TRUE(ctx != NULL);
  for (int variant = 0; variant < 2; ++variant) {
    const int bits = variant == 0 ? 4 : 0;
    const kva_dtype pdt = variant == 0 ? KVA_BF16 : KVA_F16; /* scales, or the float pool's dtype */
    float *kf = malloc(sizeof(float) * KVH * N * D), *vf = malloc(sizeof(float) * KVH * N * D);
    for (int i = 0; i < KVH * N * D; ++i) {
      kf[i] = test_randn();
      vf[i] = 0.5f * test_randn() + 0.1f;
    }
    /* the contiguous cache [1, KVH, N, D] */
    size_t words = (size_t)KVH * N * D * (bits ? (size_t)bits : 32) / 32, groups = (size_t)KVH * N * D / GS;
    void *ck = malloc(words * 4), *cv = malloc(words * 4);
    uint16_t *cks = malloc(groups * 2), *ckb = malloc(groups * 2), *cvs = malloc(groups * 2), *cvb = malloc(groups * 2);
    kva_kv kc, vc;
    kva_tensor kft = kva_tensor_4d(kf, KVA_F32, 1, KVH, N, D), vft = kva_tensor_4d(vf, KVA_F32, 1, KVH, N, D);
    if (bits) {
      kc = kva_kv_quantized(ck, cks, ckb, pdt, bits, GS, 1, KVH, N, D);
      vc = kva_kv_quantized(cv, cvs, cvb, pdt, bits, GS, 1, KVH, N, D);
      ASSERT_OK(kva_quantize(&kft, &kc));
      ASSERT_OK(kva_quantize(&vft, &vc));
    } else {
      kc = kva_kv_float(ck, pdt, 1, KVH, N, D);
      vc = kva_kv_float(cv, pdt, 1, KVH, N, D);
      ASSERT_OK(kva_convert(&kft, &kc.data));
      ASSERT_OK(kva_convert(&vft, &vc.data));
    }
    /* pools with scattered blocks: table[j] = the j-th block of the sequence */
    cw_pool kp, vp;
    pool_init(&kp, NB, KVH, BS, D, bits, GS, pdt, false);
    pool_init(&vp, NB, KVH, BS, D, bits, GS, pdt, false);
    int32_t table[NB];
    for (int j = 0; j < NB; ++j) table[j] = (int32_t)((j * 5 + 3) % NB);
    for (int t = 0; t < N; ++t) { /* one token per call, as a decode loop appends */
      int32_t slot = table[t / BS] * BS + t % BS;
      /* token t of the [1, KVH, N, D] sources as [1, KVH, D] (head stride N*D) */
      kva_tensor kr = kva_tensor_1d(kf + (size_t)t * D, KVA_F32, D), vr;
      kr.ndim = 3;
      kr.shape[0] = 1; kr.shape[1] = KVH; kr.shape[2] = D;
      kr.stride[0] = (int64_t)KVH * N * D * 4; kr.stride[1] = (int64_t)N * D * 4; kr.stride[2] = 4;
      vr = kr;
      vr.data = vf + (size_t)t * D;
      ASSERT_OK(kva_cache_write(ctx, &kp.kv, &vp.kv, &kr, &vr, &slot, 1));
    }
    /* row for row, the bytes of the contiguous cache */
    int64_t bad = 0;
    for (int t = 0; t < N; ++t)
      for (int h = 0; h < KVH; ++h)
        for (int which = 0; which < 2; ++which) {
          const kva_kv *pool = which ? &vp.kv : &kp.kv, *cont = which ? &vc : &kc;
          const int64_t blk = table[t / BS], row = t % BS;
          bad += memcmp(at4(&pool->data, blk, h, row), at4(&cont->data, 0, h, t),
                        (size_t)(pool->data.shape[3] * (int64_t)kva_dtype_size(pool->data.dtype))) != 0;
          if (bits) {
            bad += memcmp(at4(&pool->scales, blk, h, row), at4(&cont->scales, 0, h, t), D / GS * 2) != 0;
            bad += memcmp(at4(&pool->biases, blk, h, row), at4(&cont->biases, 0, h, t), D / GS * 2) != 0;
          }
        }
    if (bad) FAIL_("%s pool: %lld rows differ from the contiguous cache", bits ? "4-bit" : "f16", (long long)bad);
    /* attention through the block table vs the contiguous cache */
    float *qb = malloc(sizeof(float) * H * L * D);
    for (int i = 0; i < H * L * D; ++i) qb[i] = test_randn();
    float o_c[H * L * D], o_t[H * L * D], r_c[H * L * D], r_t[H * L * D];
    kva_tensor q = kva_tensor_4d(qb, KVA_F32, 1, H, L, D);
    kva_tensor oc = kva_tensor_4d(o_c, KVA_F32, 1, H, L, D), ot = kva_tensor_4d(o_t, KVA_F32, 1, H, L, D);
    kva_tensor rcon = kva_tensor_4d(r_c, KVA_F32, 1, H, L, D), rt = kva_tensor_4d(r_t, KVA_F32, 1, H, L, D);
    kva_attn_params p = kva_attn_defaults();
    p.mask.kind = KVA_MASK_CAUSAL;
    int32_t lens[1] = {N}, first[1] = {0};
    kva_block_table bt;
    memset(&bt, 0, sizeof bt);
    bt.batch = 1;
    bt.max_blocks = NB;
    bt.blocks = table;
    bt.seq_lens = lens;
    bt.first_offset = first;
    kva_kv_view cview = kva_view_contiguous(&kc, &vc, NULL), tview = kva_view_block_table(&kp.kv, &vp.kv, &bt);
    /* random queries, then probes: row i of head h is a * k_p (its own key,
     * position p = N - L + i, the float row before quantization) with the
     * logit a |k_p|^2 / sqrt(D) = 12, so key p carries most of the weight */
    for (int pr = 0; pr < ATT_PROBES && !bad && !test_failed_flag; ++pr) {
      for (int h = 0; pr && h < H; ++h)
        for (int i = 0; i < L; ++i) {
          const float *kp_row = kf + ((size_t)(h / (H / KVH)) * N + (N - L + i)) * D;
          double n2 = 0;
          for (int e = 0; e < D; ++e) n2 += (double)kp_row[e] * kp_row[e];
          const double a = 12.0 * sqrt((double)D) / n2;
          for (int e = 0; e < D; ++e) qb[((size_t)h * L + i) * D + e] = (float)(a * kp_row[e]);
        }
      ASSERT_OK(kva_attention(ctx, &q, &cview, &p, &oc, NULL, 0));
      ASSERT_OK(kva_reference_attention(&q, &cview, &p, &rcon));
      if (kva_reference_attention(&q, &tview, &p, &rt)) {
        FAIL_("oracle over the block table: %s", kva_last_error());
      } else {
        if (!att_compare(&rt, &rcon, 0, 0, NULL, NULL))
          FAIL_("%s pool: the oracle over the block table differs from the oracle over the contiguous cache",
                bits ? "4-bit" : "f16");
        double err = 0;
        /* the oracle with the kernel's roundings (into rt, checked above) */
        const kva_tensor *oref = att_oracle_for(ctx, &q, &tview, &p, &ot, &rcon, &rt);
        if (!oref || kva_attention(ctx, &q, &tview, &p, &ot, NULL, 0))
          FAIL_("kva_attention over the block table: %s", kva_last_error());
        else if (!att_compare(&ot, oref, att_kernel_atol(ctx, &q, &tview, &p, &ot), att_rtol(KVA_F32), &err, NULL))
          FAIL_("%s pool, %s queries: attention over the block table differs from the oracle (max err %.3g)",
                bits ? "4-bit" : "f16", att_query_names[pr], err);
        else if (!att_compare(&ot, &oc, att_kernel_atol(ctx, &q, &tview, &p, &ot), att_rtol(KVA_F32), &err, NULL))
          FAIL_("%s pool, %s queries: attention over the block table differs from the contiguous cache (max err "
                "%.3g)",
                bits ? "4-bit" : "f16", att_query_names[pr], err);
      }
    }
    free(qb);
    pool_free(&kp);
    pool_free(&vp);
    free(kf); free(vf); free(ck); free(cv); free(cks); free(ckb); free(cvs); free(cvb);
    if (test_failed_flag) break;
  }
  kva_context_destroy(ctx);
}

/* --------------------------------------------------------------- CUDA */
#ifndef KVA_HAVE_CUDA
TEST(cuda_cache_write_bits) { SKIP("built without CUDA (nvcc not found)"); }
TEST(cuda_cache_write_graph) { SKIP("built without CUDA (nvcc not found)"); }
#else
#include <cuda_runtime_api.h>

/* Device copies of a case's buffers (same offsets, same strides). */
typedef struct cw_dev {
  void *bufs[10];
  cw_buf *host[10];
  int nbufs;
  kva_kv kp, vp;
  kva_tensor k, v;
  int32_t *slots;
} cw_dev;

static int cu_ok(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return 1;
  FAIL_("%s: %s", what, cudaGetErrorString(e));
  return 0;
}
/* Mirrors a host buffer; returns the device address of host pointer ptr in it. */
static void *dev_mirror(cw_dev *d, cw_buf *b, const void *ptr) {
  void *p = NULL;
  if (!cu_ok(cudaMalloc(&p, b->n), "cudaMalloc")) return NULL;
  d->bufs[d->nbufs] = p;
  d->host[d->nbufs++] = b;
  if (!cu_ok(cudaMemcpy(p, b->p, b->n, cudaMemcpyHostToDevice), "cudaMemcpy H2D")) return NULL;
  return (char *)p + ((const unsigned char *)ptr - b->p);
}
static int dev_pool(cw_dev *d, cw_pool *p, kva_kv *out) {
  *out = p->kv;
  if (!(out->data.data = dev_mirror(d, &p->data, p->kv.data.data))) return 0;
  if (!p->kv.bits) return 1;
  return (out->scales.data = dev_mirror(d, &p->scales, p->kv.scales.data)) &&
         (out->biases.data = dev_mirror(d, &p->biases, p->kv.biases.data));
}
static int dev_make(cw_dev *d, cw_case *c) {
  memset(d, 0, sizeof *d);
  if (!dev_pool(d, &c->kp, &d->kp) || !dev_pool(d, &c->vp, &d->vp)) return 0;
  d->k = c->k;
  d->v = c->v;
  if (!(d->k.data = dev_mirror(d, &c->kin, c->k.data)) || !(d->v.data = dev_mirror(d, &c->vin, c->v.data))) return 0;
  return cu_ok(cudaMalloc((void **)&d->slots, sizeof(int32_t) * (size_t)c->n), "cudaMalloc slots") &&
         cu_ok(cudaMemcpy(d->slots, c->slots, sizeof(int32_t) * (size_t)c->n, cudaMemcpyHostToDevice), "slots H2D");
}
/* Copies every device buffer back over its host buffer. */
static int dev_fetch(cw_dev *d) {
  if (!cu_ok(cudaDeviceSynchronize(), "kernel execution")) return 0;
  for (int i = 0; i < d->nbufs; ++i)
    if (!cu_ok(cudaMemcpy(d->host[i]->p, d->bufs[i], d->host[i]->n, cudaMemcpyDeviceToHost), "cudaMemcpy D2H"))
      return 0;
  return 1;
}
static void dev_free(cw_dev *d) {
  for (int i = 0; i < d->nbufs; ++i) cudaFree(d->bufs[i]);
  if (d->slots) cudaFree(d->slots);
  memset(d, 0, sizeof *d);
}
static int cuda_ctx(kva_context **ctx, void *stream) {
  kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, stream};
  if (kva_context_create(ctx, &o)) {
    FAIL_("kva_context_create(CUDA): %s", kva_last_error());
    return 0;
  }
  return 1;
}

/* One case on the device against the expected bytes (= the CPU's). An
 * out-of-range slot is skipped there (added when oob). */
static int cw_run_cuda(kva_context *ctx, const cw_fmt *f, bool nonfinite, bool oob) {
  cw_case c;
  cw_dev d;
  memset(&d, 0, sizeof d);
  cw_make(&c, f, nonfinite, 12);
  if (oob) c.slots[rnd_int(0, (int)c.n - 1)] = (int32_t)(c.nb * c.bs + rnd_int(0, 5));
  int ok = cw_expect(&c) && dev_make(&d, &c);
  if (ok) {
    int rc = kva_cache_write(ctx, &d.kp, &d.vp, &d.k, &d.v, d.slots, c.n);
    if (rc) {
      FAIL_("%s: kva_cache_write(CUDA): %s", c.label, kva_last_error());
      ok = 0;
    } else {
      ok = dev_fetch(&d) && cw_check(&c, "cuda");
    }
  }
  dev_free(&d);
  cw_free(&c);
  return ok;
}

/* Every format of the CPU tests, bit for bit with the CPU (kva_quantize). */
TEST(cuda_cache_write_bits) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  kva_context *ctx;
  if (!cuda_ctx(&ctx, NULL)) return;
  for (int bi = 0; bi < 3; ++bi)
    for (int gi = 0; gi < 3; ++gi)
      for (int si = 0; si < 3; ++si)
        for (int ii = 0; ii < 3; ++ii) {
          const cw_fmt f = {BITS[bi], BITS[bi], GROUPS[gi], FLOATS[si], FLOATS[si], FLOATS[ii], FLOATS[(ii + 1) % 3]};
          if (!cw_run_cuda(ctx, &f, false, (bi + gi + si + ii) % 4 == 0)) goto done;
        }
  for (int pi = 0; pi < 3; ++pi)
    for (int ii = 0; ii < 3; ++ii) {
      const cw_fmt f = {0, 0, 0, FLOATS[pi], FLOATS[(pi + 1) % 3], FLOATS[ii], FLOATS[(ii + 2) % 3]};
      if (!cw_run_cuda(ctx, &f, false, ii == 1)) goto done;
    }
  {
    const cw_fmt a = {4, 0, 64, KVA_BF16, KVA_F16, KVA_F32, KVA_BF16};
    if (!cw_run_cuda(ctx, &a, false, false)) goto done;
  }
  /* NaN / Inf rows: the CPU's bytes too (NaN payloads included) */
  for (int bi = 0; bi < 3; ++bi)
    for (int si = 0; si < 3; ++si) {
      const cw_fmt f = {BITS[bi], BITS[bi], GROUPS[(bi + si) % 3], FLOATS[si], FLOATS[si], FLOATS[(si + 1) % 3],
                        FLOATS[si]};
      if (!cw_run_cuda(ctx, &f, true, false)) goto done;
    }
  {
    const cw_fmt f = {0, 0, 0, KVA_F16, KVA_BF16, KVA_F32, KVA_F16};
    if (!cw_run_cuda(ctx, &f, true, false)) goto done;
  }
  { /* duplicate slots: the later token wins, as on the CPU */
    const cw_fmt f = {8, 8, 64, KVA_F32, KVA_F32, KVA_BF16, KVA_F32};
    cw_case c;
    cw_dev d;
    memset(&d, 0, sizeof d);
    cw_make(&c, &f, false, 12);
    c.slots[c.n - 1] = c.slots[0] = c.slots[0] >= 0 ? c.slots[0] : 1;
    if (cw_expect(&c) && dev_make(&d, &c)) {
      if (kva_cache_write(ctx, &d.kp, &d.vp, &d.k, &d.v, d.slots, c.n))
        FAIL_("duplicates: %s", kva_last_error());
      else if (dev_fetch(&d))
        cw_check(&c, "cuda, duplicate slots");
    }
    dev_free(&d);
    cw_free(&c);
  }
done:
  kva_context_destroy(ctx);
}

/* One kva_cache_write captured in a CUDA graph on ctx's stream, replayed
 * while the slots in device memory change (new rows each time, then an
 * out-of-range and a skipped slot); the pools follow the CPU's writes. */
TEST(cuda_cache_write_graph) {
  if (kva_cuda_device_count() == 0) SKIP("no CUDA device visible");
  const cw_fmt f = {4, 4, 64, KVA_BF16, KVA_BF16, KVA_BF16, KVA_BF16};
  cw_case c;
  cw_dev d;
  memset(&d, 0, sizeof d);
  cudaStream_t s = NULL;
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  kva_context *ctx = NULL;
  cw_make(&c, &f, false, 12);
  while (c.n < 3 || c.nb * c.bs < 3 * c.n + 4) { /* room for three disjoint slot sets */
    cw_free(&c);
    cw_make(&c, &f, false, 4);
  }
  for (int64_t i = 0; i < c.n; ++i) c.slots[i] = (int32_t)i;
  if (!dev_make(&d, &c) || !cu_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream") ||
      !cuda_ctx(&ctx, s))
    goto done;
  if (!cu_ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "begin capture")) goto done;
  int rc = kva_cache_write(ctx, &d.kp, &d.vp, &d.k, &d.v, d.slots, c.n);
  cudaError_t ce = cudaStreamEndCapture(s, &graph);
  if (rc) {
    FAIL_("kva_cache_write under capture: %s", kva_last_error());
    goto done;
  }
  if (!cu_ok(ce, "end capture") || !cu_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate")) goto done;
  const int32_t nslots = (int32_t)(c.nb * c.bs);
  for (int rep = 0; rep < 4; ++rep) {
    for (int64_t i = 0; i < c.n; ++i) c.slots[i] = (int32_t)(rep % 3 * c.n + i + 1); /* a fresh range */
    if (rep == 3) {
      c.slots[0] = nslots + 7; /* out of range: skipped on the device */
      c.slots[c.n - 1] = -1;
    }
    if (!cw_expect(&c)) goto done; /* the expected bytes accumulate like the pools */
    if (!cu_ok(cudaMemcpyAsync(d.slots, c.slots, sizeof(int32_t) * (size_t)c.n, cudaMemcpyHostToDevice, s), "slots") ||
        !cu_ok(cudaGraphLaunch(exec, s), "graph launch") || !cu_ok(cudaStreamSynchronize(s), "replay") ||
        !dev_fetch(&d))
      goto done;
    char label[40];
    snprintf(label, sizeof label, "cuda graph replay %d", rep);
    if (!cw_check(&c, label)) goto done;
  }
done:
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  kva_context_destroy(ctx);
  if (s) cudaStreamDestroy(s);
  dev_free(&d);
  cw_free(&c);
}
#endif
