/* libFuzzer harness for the public API on a CPU context (make fuzz).
 *
 * Each input is decoded into one call: kva_attention over a contiguous
 * cache, over caller pools addressed by a block table, or over a paged view
 * of a library pool (made from sequences or from caller CSR arrays);
 * kva_quantize, kva_dequantize, kva_convert, kva_cache_write,
 * kva_causal_mask or kva_image_mask. The input first picks a sane
 * "intended" call (small shapes: B <= 3, N <= 64, head dims 64/80/96/128),
 * then up to MAX_MUT mutations overwrite fields of its descriptors (shapes,
 * strides, dtypes, ranks, bits, group sizes, lengths, block ids, CSR
 * entries, mask parameters, pointers) with fuzzed values.
 *
 * Memory: each tensor gets a buffer of exactly the bytes its own (mutated)
 * descriptor spans, and each int32 array exactly the entries the count that
 * sizes it names (seq_lens: the view's B; a table: batch, max_blocks and
 * row_stride; CSR indices: indptr[batch]; slots: n). What the library has
 * to cross-check (one descriptor against another: q against K, a mask
 * array against [B, H, L, N], block ids against the pool, lengths against
 * N, CSR against the pool) is then the only thing standing between a lying
 * descriptor and a read past a buffer, which ASan reports. A descriptor
 * whose own span cannot be valid (negative stride, overflow past 2^62,
 * unknown dtype or rank) gets its intended buffer: the library must refuse
 * it. One whose valid span exceeds SPAN_CAP is not run.
 *
 * Invariants checked (abort, so the fuzzer reports them): no sanitizer
 * report; on error every output buffer (out, quantized arrays, pools,
 * masks) is byte-equal to its copy from before the call; on success the
 * bytes of an output buffer that its descriptor does not address (strided
 * padding) are unchanged; kva_attention_path agrees with kva_attention on
 * success or failure. */
#include <kvattn.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
  MAX_MUT = 4,        /* mutations per input: 0..MAX_MUT-1 */
  MAX_FIELDS = 512,   /* mutable fields per call */
  MAX_ALLOCS = 64,    /* buffers per call */
  ARR_CAP = 256,      /* intended entries of an int32 array */
  ARR_MAX = 1 << 16,  /* entries an array may be backed with */
  SPAN_CAP = 2 << 20, /* bytes a tensor may be backed with */
};

/* ------------------------------------------------------------ input */
typedef struct fz_in {
  const uint8_t *p;
  size_t n;
} fz_in;
static unsigned u8(fz_in *in) {
  if (!in->n) return 0;
  in->n--;
  return *in->p++;
}
static unsigned pick(fz_in *in, unsigned n) { return n ? u8(in) % n : 0; }
static uint64_t u64(fz_in *in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v = v << 8 | u8(in);
  return v;
}

/* ------------------------------------------------------------ per-call state */
typedef enum { F_I64, F_I32, F_INT, F_F32, F_PTR } fkind;
typedef struct field {
  void *p;
  fkind kind;
} field;

typedef struct out_buf { /* an output buffer and its copy from before the call */
  uint8_t *buf, *copy;
  size_t bytes;
} out_buf;

typedef struct fz {
  fz_in in;
  field f[MAX_FIELDS];
  int nf;
  void *alloc[MAX_ALLOCS];
  int nalloc;
  out_buf outs[16];
  int nout;
  int skip;     /* a descriptor spans more than SPAN_CAP: not run */
  uint8_t fill; /* byte pattern of input buffers */
} fz;

static void add(fz *s, void *p, fkind k) {
  if (s->nf < MAX_FIELDS) s->f[s->nf++] = (field){p, k};
}
static void add_tensor(fz *s, kva_tensor *t) {
  add(s, &t->data, F_PTR);
  add(s, &t->dtype, F_INT);
  add(s, &t->ndim, F_INT);
  for (int d = 0; d < KVA_MAX_DIMS; ++d) {
    add(s, &t->shape[d], F_I64);
    add(s, &t->stride[d], F_I64);
  }
}
static void add_kv(fz *s, kva_kv *kv) {
  add_tensor(s, &kv->data);
  add_tensor(s, &kv->scales);
  add_tensor(s, &kv->biases);
  add(s, &kv->bits, F_INT);
  add(s, &kv->group_size, F_INT);
}
static void add_arr(fz *s, int32_t *a, int64_t n) {
  for (int64_t i = 0; i < n && i < ARR_CAP; ++i)
    add(s, &a[i], F_I32);
}

static const int64_t interesting[] = {0,
                                      1,
                                      -1,
                                      2,
                                      3,
                                      4,
                                      5,
                                      7,
                                      8,
                                      9,
                                      15,
                                      16,
                                      17,
                                      31,
                                      32,
                                      33,
                                      63,
                                      64,
                                      65,
                                      80,
                                      96,
                                      127,
                                      128,
                                      129,
                                      255,
                                      256,
                                      INT32_MAX,
                                      INT32_MIN,
                                      (int64_t)INT32_MAX + 1,
                                      (int64_t)1 << 32,
                                      (int64_t)1 << 40,
                                      (int64_t)1 << 61,
                                      (int64_t)1 << 62,
                                      ((int64_t)1 << 62) - 1,
                                      INT64_MAX,
                                      INT64_MIN,
                                      INT64_MAX / 2,
                                      INT64_MAX / 3};

/* One mutation: a field of the call gets a fuzzed value. */
static void mutate(fz *s) {
  if (!s->nf) return;
  field *f = &s->f[u8(&s->in) % s->nf];
  const unsigned mode = pick(&s->in, 4);
  int64_t old = 0, v;
  switch (f->kind) {
  case F_I64: old = *(int64_t *)f->p; break;
  case F_I32: old = *(int32_t *)f->p; break;
  case F_INT: old = *(int *)f->p; break;
  case F_F32: {
    static const float fv[] = {NAN,  INFINITY, -INFINITY, 0.0f,   -0.0f, -1.0f,
                               1.0f, 1e30f,    1e-30f,    1e-45f, 50.0f, 3.4e38f};
    float x;
    if (mode == 3) {
      uint32_t r = (uint32_t)u64(&s->in);
      memcpy(&x, &r, 4);
    } else
      x = fv[pick(&s->in, sizeof fv / sizeof fv[0])];
    *(float *)f->p = x;
    return;
  }
  case F_PTR: /* a pointer becomes NULL, or a NULL one gets a buffer */
    *(void **)f->p = *(void **)f->p ? NULL : (void *)&s->in;
    return;
  }
  switch (mode) {
  case 0: v = interesting[pick(&s->in, sizeof interesting / sizeof interesting[0])]; break;
  case 1: v = (int64_t)((uint64_t)old + (uint64_t)(int64_t)(int8_t)u8(&s->in)); break;
  case 2: v = (int64_t)((uint64_t)old * (uint64_t)(1 + pick(&s->in, 8))); break;
  default: v = (int64_t)u64(&s->in); break;
  }
  switch (f->kind) {
  case F_I64: *(int64_t *)f->p = v; break;
  case F_I32: *(int32_t *)f->p = (int32_t)v; break;
  default: *(int *)f->p = (int)v; break;
  }
}

static void *fz_alloc(fz *s, size_t bytes) {
  if (s->nalloc == MAX_ALLOCS) abort(); /* harness bug */
  void *p = malloc(bytes ? bytes : 1);
  if (!p) abort();
  s->alloc[s->nalloc++] = p;
  return p;
}

/* Bytes the descriptor spans, or -1 when it cannot be a valid view (the
 * library must refuse it before reading). */
static int64_t claimed_span(const kva_tensor *t) {
  const int64_t es = (int64_t)kva_dtype_size(t->dtype);
  if (!es || t->ndim < 1 || t->ndim > KVA_MAX_DIMS) return -1;
  int64_t span = es;
  for (int d = 0; d < t->ndim; ++d) {
    if (t->shape[d] <= 0 || t->stride[d] < 0) return -1;
    const int64_t n1 = t->shape[d] - 1;
    if (n1 > 0 && t->stride[d] > (((int64_t)1 << 62) - span) / n1) return -1;
    span += t->stride[d] * n1;
  }
  return span;
}

/* Backs tensor t (after the mutations) with a buffer of the bytes it spans
 * (intended bytes when it cannot be valid). Input buffers are filled with
 * the call's pattern; output buffers with 0xa5 and copied for the checks. */
static void back(fz *s, kva_tensor *t, int64_t intended, int is_out) {
  if (!t->data) return;
  int64_t bytes = claimed_span(t);
  if (bytes < 0) bytes = intended;
  if (bytes > SPAN_CAP) {
    s->skip = 1;
    bytes = 1;
  }
  uint8_t *b = (uint8_t *)fz_alloc(s, (size_t)bytes);
  memset(b, is_out ? 0xa5 : s->fill, (size_t)bytes);
  t->data = b;
  if (is_out) {
    out_buf *o = &s->outs[s->nout++];
    o->buf = b;
    o->bytes = (size_t)bytes;
    o->copy = (uint8_t *)fz_alloc(s, (size_t)bytes);
    memcpy(o->copy, b, (size_t)bytes);
  }
}
static void back_kv(fz *s, kva_kv *kv, int is_out) {
  back(s, &kv->data, 4, is_out);
  back(s, &kv->scales, 4, is_out);
  back(s, &kv->biases, 4, is_out);
}

/* An int32 array of exactly n entries (n <= 0: an empty allocation) with
 * the intended values a[0..cap) where it has them, a[cap-1] after them.
 * NULL stays NULL. */
static int32_t *back_arr(fz *s, const void *ptr, const int32_t *a, int64_t cap, int64_t n) {
  if (!ptr) return NULL;
  if (n > ARR_MAX) {
    s->skip = 1;
    n = 1;
  }
  if (n < 0) n = 0;
  int32_t *b = (int32_t *)fz_alloc(s, (size_t)n * sizeof *b);
  for (int64_t i = 0; i < n; ++i)
    b[i] = i < cap ? a[i] : a[cap - 1];
  return b;
}

/* On error: every output buffer unchanged. */
static void check_outputs_unchanged(const fz *s, int rc, const char *call) {
  for (int i = 0; i < s->nout; ++i)
    if (memcmp(s->outs[i].buf, s->outs[i].copy, s->outs[i].bytes)) {
      fprintf(stderr, "fuzz: %s failed (%d: %s) but wrote output buffer %d\n", call, rc, kva_last_error(), i);
      abort();
    }
}

/* On success: the bytes of output t's buffer that t does not address are
 * unchanged. */
static int out_index(const fz *s, const void *p) {
  for (int i = 0; i < s->nout; ++i)
    if (s->outs[i].buf == p) return i;
  abort(); /* harness bug: not an output buffer */
}
static void check_padding(const fz *s, const kva_tensor *t, const char *call) {
  const out_buf *o = &s->outs[out_index(s, t->data)];
  int64_t elems = 1;
  for (int d = 0; d < t->ndim; ++d)
    elems *= t->shape[d];
  if ((size_t)elems * kva_dtype_size(t->dtype) == o->bytes) return; /* no padding (accepted: no overlap) */
  uint8_t *mark = (uint8_t *)calloc(o->bytes, 1);
  if (!mark) abort();
  const int64_t es = (int64_t)kva_dtype_size(t->dtype);
  int64_t sh[4] = {1, 1, 1, 1}, st[4] = {0, 0, 0, 0};
  for (int d = 0; d < t->ndim; ++d) {
    sh[4 - t->ndim + d] = t->shape[d];
    st[4 - t->ndim + d] = t->stride[d];
  }
  for (int64_t a = 0; a < sh[0]; ++a)
    for (int64_t b = 0; b < sh[1]; ++b)
      for (int64_t c = 0; c < sh[2]; ++c)
        for (int64_t d = 0; d < sh[3]; ++d)
          memset(mark + a * st[0] + b * st[1] + c * st[2] + d * st[3], 1, (size_t)es);
  for (size_t i = 0; i < o->bytes; ++i)
    if (!mark[i] && o->buf[i] != o->copy[i]) {
      fprintf(stderr, "fuzz: %s succeeded but wrote byte %zu that its output does not address\n", call, i);
      abort();
    }
  free(mark);
}

static kva_context *ctx;
static unsigned long stats[16][2]; /* [op][ok] calls, printed at exit with FUZZ_STATS=1 */
static void print_stats(void) {
  static const char *names[] = {"attn contiguous", "attn block table", "attn paged",  "attn csr",    "quantize",
                                "dequantize",      "convert",          "cache_write", "causal_mask", "image_mask"};
  for (int i = 0; i < 10; ++i)
    fprintf(stderr, "fuzz stats: %-16s %8lu ok %8lu refused\n", names[i], stats[i][1], stats[i][0]);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  kva_context_opts o = {KVA_BACKEND_CPU, 1, 0, NULL};
  if (kva_context_create(&ctx, &o)) {
    fprintf(stderr, "fuzz: kva_context_create: %s\n", kva_last_error());
    abort();
  }
  const char *st = getenv("FUZZ_STATS");
  if (st && *st == '1') atexit(print_stats);
  return 0;
}

/* ------------------------------------------------------------ intended shapes */
static const int64_t head_dims[] = {64, 80, 96, 128};
static const kva_dtype float_dts[] = {KVA_F32, KVA_F16, KVA_BF16};

static kva_dtype pick_float(fz_in *in) { return float_dts[pick(in, 3)]; }
/* A group size dividing D (32 when none larger does). */
static int pick_group(fz_in *in, int64_t D) {
  static const int g[] = {32, 64, 128};
  int gs = g[pick(in, 3)];
  while (D % gs)
    gs /= 2;
  return gs < 32 ? 32 : gs;
}

/* A 4-d tensor [n0, n1, n2, n3] with optional padding of the rows (pr
 * extra rows of n2) and of the row (pc extra elements). */
static kva_tensor t4(kva_dtype dt, int64_t n0, int64_t n1, int64_t n2, int64_t n3, int64_t pr, int64_t pc) {
  const int64_t es = (int64_t)kva_dtype_size(dt), rs = (n3 + pc) * es, hs = rs * (n2 + pr);
  return (kva_tensor){(void *)1, dt, 4, {n0, n1, n2, n3}, {hs * n1, hs, rs, es}};
}

/* A K or V operand [n0, n1, n2, D], float (bits 0) or quantized. */
static kva_kv make_kv(fz_in *in, int bits, int gs, kva_dtype dt, int64_t n0, int64_t n1, int64_t n2, int64_t D,
                      int64_t pr, int64_t pc) {
  kva_kv kv;
  memset(&kv, 0, sizeof kv);
  kv.bits = bits;
  kv.group_size = gs;
  if (!bits) {
    kv.data = t4(dt, n0, n1, n2, D, pr, pc);
    return kv;
  }
  kv.data = t4(KVA_U32, n0, n1, n2, D * bits / 32, pr, pc);
  kv.scales = t4(dt, n0, n1, n2, D / gs, pr, pick(in, 2));
  kv.biases = t4(dt, n0, n1, n2, D / gs, pr, 0);
  return kv;
}

/* The K/V format of a call: bits (0 = float), group size, dtype. */
typedef struct kvfmt {
  int bits, gs;
  kva_dtype dt;
} kvfmt;
static kvfmt pick_fmt(fz_in *in, int64_t D) {
  static const int bits[] = {0, 0, 2, 4, 4, 8};
  kvfmt f = {bits[pick(in, 6)], 0, pick_float(in)};
  if (f.bits) f.gs = pick_group(in, D);
  if (f.bits && D % f.gs) f.bits = 0, f.gs = 0; /* D 80 with group 32: float */
  return f;
}

/* The mask and parameters of an attention call over B sequences of up to N
 * tokens, H heads, L rows. seg/arr are the tensors to back. */
typedef struct attn_call {
  kva_tensor q, out;
  kva_kv_view view;
  kva_attn_params p;
  float sinks[16];
  int32_t lens[ARR_CAP];
  int has_lens;
  kva_block_table t;
  int32_t blocks[ARR_CAP], tlens[ARR_CAP], fo[ARR_CAP];
  int64_t ws_delta; /* caller workspace: its size minus the one asked for; INT64_MIN = none */
} attn_call;

static void pick_params(fz *s, attn_call *c, int64_t B, int64_t H, int64_t L, int64_t N) {
  fz_in *in = &s->in;
  kva_attn_params *p = &c->p;
  *p = kva_attn_defaults();
  if (pick(in, 4) == 0) p->scale = 0.05f;
  if (pick(in, 4) == 0) p->softcap = 30.0f;
  if (pick(in, 4) == 0) p->flags = KVA_ATTN_EXACT;
  if (pick(in, 3) == 0) {
    for (int h = 0; h < 16; ++h)
      c->sinks[h] = (float)(int)pick(in, 5) - 2.0f;
    p->sinks = c->sinks;
  }
  switch (pick(in, 6)) {
  case 0: p->mask.kind = KVA_MASK_NONE; break;
  case 1:
  case 2: p->mask.kind = KVA_MASK_CAUSAL; break;
  case 3:
    p->mask.kind = KVA_MASK_CAUSAL;
    p->mask.window = (int32_t)(1 + pick(in, (unsigned)N));
    break;
  case 4:
    p->mask.kind = KVA_MASK_CAUSAL;
    p->mask.segments = kva_tensor_2d((void *)1, KVA_I32, B, N);
    p->mask.segments_clamp = (int)pick(in, 2);
    if (pick(in, 2)) p->mask.window = (int32_t)(1 + pick(in, (unsigned)N));
    break;
  default: {
    static const kva_dtype mdt[] = {KVA_BOOL, KVA_F32, KVA_F16, KVA_BF16};
    p->mask.kind = KVA_MASK_ARRAY;
    p->mask.array = kva_tensor_4d((void *)1, mdt[pick(in, 4)], B, H, L, N);
    const unsigned bc = pick(in, 8); /* broadcast over B, H, L (stride 0) */
    for (int d = 0; d < 3; ++d)
      if (bc >> d & 1) p->mask.array.stride[d] = 0;
    break;
  }
  }
  for (int d = 0; d < 16; ++d)
    add(s, &c->sinks[d], F_F32);
  add(s, &p->scale, F_F32);
  add(s, &p->softcap, F_F32);
  add(s, &p->mask.kind, F_INT);
  add(s, &p->mask.window, F_I32);
  add(s, &p->mask.segments_clamp, F_INT);
  add(s, &p->flags, F_INT); /* unsigned, int-sized */
  add(s, &p->sinks, F_PTR);
  add_tensor(s, &p->mask.segments);
  add_tensor(s, &p->mask.array);
}

/* Segment ids: small values (0 = text, 1..2 images) from the input. */
static void back_params(fz *s, attn_call *c) {
  kva_attn_params *p = &c->p;
  if (p->sinks == (const float *)&s->in) p->sinks = c->sinks; /* a NULL pointer given a buffer: the intended one */
  if (p->sinks) {                                             /* [H] of q */
    int64_t H = c->q.ndim == 4 && c->q.shape[1] > 0 ? c->q.shape[1] : 1;
    if (H > ARR_MAX) s->skip = 1, H = 1;
    float *b = (float *)fz_alloc(s, (size_t)H * sizeof(float));
    for (int64_t h = 0; h < H; ++h)
      b[h] = c->sinks[h % 16];
    p->sinks = b;
  }
  back(s, &p->mask.segments, 4, 0);
  if (p->mask.segments.data) {
    const int64_t span = claimed_span(&p->mask.segments);
    int32_t *seg = (int32_t *)p->mask.segments.data;
    for (int64_t i = 0; i + 4 <= span && span <= SPAN_CAP; i += 4)
      seg[i / 4] = (int32_t)((i / 4 * 7 + s->fill) % 5 % 3);
  }
  back(s, &p->mask.array, 4, 0);
}

/* Backs the call's q and out, then runs it: kva_attention_path and
 * kva_attention must agree; invariants as in the file comment. */
static void run_attention(fz *s, attn_call *c, int op) {
  back(s, &c->q, 4, 0);
  back(s, &c->out, 4, 1);
  if (s->skip) return;
  const int path = kva_attention_path(ctx, &c->q, &c->view, &c->p, &c->out);
  void *ws = NULL;
  size_t wsb = 0;
  if (c->ws_delta != INT64_MIN) {
    size_t need = 0;
    if (kva_attention_workspace_size(ctx, &c->q, &c->view, &c->p, &need) == 0) {
      if (need > (64 << 20) || c->ws_delta > (64 << 20)) return;
      int64_t b = c->ws_delta < -(int64_t)need ? 0 : (int64_t)need + c->ws_delta;
      if (b > (64 << 20)) return;
      wsb = (size_t)b;
      ws = fz_alloc(s, wsb);
    }
  }
  const int rc = kva_attention(ctx, &c->q, &c->view, &c->p, &c->out, ws, wsb);
  stats[op][rc == 0]++;
  if (getenv("FUZZ_DEBUG")) fprintf(stderr, "fuzz: op %d: %d %s\n", op, rc, rc ? kva_last_error() : "");
  if (rc < 0) {
    check_outputs_unchanged(s, rc, "kva_attention");
    if (path > 0 && !(ws && rc == KVA_EWORKSPACE)) {
      fprintf(stderr, "fuzz: kva_attention_path accepted (%d), kva_attention refused (%d: %s)\n", path, rc,
              kva_last_error());
      abort();
    }
  } else {
    check_padding(s, &c->out, "kva_attention");
    if (path < 0) {
      fprintf(stderr, "fuzz: kva_attention_path refused (%d), kva_attention accepted\n", path);
      abort();
    }
  }
}

/* The intended call's head counts, rows and head dims. */
typedef struct shape {
  int64_t B, KVH, H, L, N, Dk, Dv;
  kvfmt kf, vf;
  kva_dtype qdt, odt;
  int64_t pr, pc;
} shape;
static shape pick_shape(fz_in *in) {
  shape sh;
  sh.B = 1 + pick(in, 3);
  sh.KVH = 1 + pick(in, 3);
  sh.H = sh.KVH * (1 + pick(in, 4));
  sh.L = 1 + (pick(in, 4) ? pick(in, 4) : pick(in, 16));
  sh.N = sh.L + (pick(in, 2) ? pick(in, 24) : pick(in, (unsigned)(65 - sh.L)));
  if (sh.N > 64) sh.N = 64;
  sh.Dk = head_dims[pick(in, 4)];
  sh.Dv = pick(in, 4) ? sh.Dk : head_dims[pick(in, 4)];
  sh.kf = pick_fmt(in, sh.Dk);
  sh.vf = pick(in, 4) ? (kvfmt){sh.kf.bits, sh.kf.gs, sh.kf.dt} : pick_fmt(in, sh.Dv);
  if (sh.vf.bits && sh.Dv % sh.vf.gs) sh.vf.bits = 0, sh.vf.gs = 0;
  sh.qdt = pick_float(in);
  sh.odt = pick_float(in);
  sh.pr = pick(in, 3) == 0 ? pick(in, 3) : 0;
  sh.pc = pick(in, 3) == 0 ? 8 * pick(in, 3) : 0;
  return sh;
}

static void common_fields(fz *s, attn_call *c) {
  add_tensor(s, &c->q);
  add_tensor(s, &c->out);
  add_kv(s, &c->view.k);
  add_kv(s, &c->view.v);
  add(s, &c->view.layout, F_INT);
  add(s, &c->ws_delta, F_I64);
}

/* kva_attention over contiguous [B, KVH, N, D] caches. */
static void op_contiguous(fz *s) {
  fz_in *in = &s->in;
  attn_call *c = (attn_call *)fz_alloc(s, sizeof *c);
  memset(c, 0, sizeof *c);
  const shape sh = pick_shape(in);
  c->q = t4(sh.qdt, sh.B, sh.H, sh.L, sh.Dk, 0, pick(in, 2) * 8);
  c->out = t4(sh.odt, sh.B, sh.H, sh.L, sh.Dv, 0, pick(in, 2) * 8);
  kva_kv k = make_kv(in, sh.kf.bits, sh.kf.gs, sh.kf.dt, sh.B, sh.KVH, sh.N, sh.Dk, sh.pr, sh.pc);
  kva_kv v = make_kv(in, sh.vf.bits, sh.vf.gs, sh.vf.dt, sh.B, sh.KVH, sh.N, sh.Dv, sh.pr, sh.pc);
  c->has_lens = (int)pick(in, 2);
  for (int64_t b = 0; b < sh.B; ++b)
    c->lens[b] = (int32_t)(sh.L + pick(in, (unsigned)(sh.N - sh.L + 1)));
  c->view = kva_view_contiguous(&k, &v, c->has_lens ? c->lens : NULL);
  c->ws_delta = pick(in, 4) ? INT64_MIN : 0;
  pick_params(s, c, sh.B, sh.H, sh.L, sh.N);
  common_fields(s, c);
  add(s, &c->view.seq_lens, F_PTR);
  add_arr(s, c->lens, sh.B);
  const unsigned nm = pick(in, MAX_MUT);
  for (unsigned i = 0; i < nm; ++i)
    mutate(s);
  /* seq_lens: [B] of the view */
  if (c->view.seq_lens) {
    const int64_t B = c->view.k.data.ndim >= 1 ? c->view.k.data.shape[0] : 1;
    c->view.seq_lens = back_arr(s, c->view.seq_lens, c->lens, ARR_CAP, B);
  }
  c->view.table = NULL, c->view.paged = NULL;
  back_kv(s, &c->view.k, 0);
  back_kv(s, &c->view.v, 0);
  back_params(s, c);
  run_attention(s, c, 0);
}

/* kva_attention over caller pools [num_blocks, KVH, bs, D] and a table. */
static void op_block_table(fz *s) {
  fz_in *in = &s->in;
  attn_call *c = (attn_call *)fz_alloc(s, sizeof *c);
  memset(c, 0, sizeof *c);
  const shape sh = pick_shape(in);
  const int64_t bs = 1 + pick(in, 16);
  int64_t mb = 0, used = 0;
  for (int64_t b = 0; b < sh.B; ++b) {
    c->tlens[b] = (int32_t)(sh.L + pick(in, (unsigned)(sh.N - sh.L + 1)));
    c->fo[b] = (int32_t)(pick(in, 3) == 0 ? pick(in, (unsigned)bs) : 0);
    const int64_t nb = (c->fo[b] + c->tlens[b] + bs - 1) / bs;
    mb = nb > mb ? nb : mb;
  }
  mb += pick(in, 2);
  const int64_t rs = pick(in, 3) == 0 ? mb + pick(in, 3) : 0, rows = rs ? rs : mb;
  const int64_t nblk = sh.B * mb + pick(in, 3);
  for (int64_t i = 0; i < sh.B * rows && i < ARR_CAP; ++i)
    c->blocks[i] = (int32_t)(pick(in, 2) ? (used++ % nblk) : pick(in, (unsigned)nblk));
  c->q = t4(sh.qdt, sh.B, sh.H, sh.L, sh.Dk, 0, 0);
  c->out = t4(sh.odt, sh.B, sh.H, sh.L, sh.Dv, 0, pick(in, 2) * 8);
  kva_kv k = make_kv(in, sh.kf.bits, sh.kf.gs, sh.kf.dt, nblk, sh.KVH, bs, sh.Dk, 0, sh.pc);
  kva_kv v = make_kv(in, sh.vf.bits, sh.vf.gs, sh.vf.dt, nblk, sh.KVH, bs, sh.Dv, 0, sh.pc);
  c->t = (kva_block_table){sh.B, mb, rs, c->blocks, c->tlens, pick(in, 2) ? c->fo : NULL};
  if (!c->t.first_offset) memset(c->fo, 0, sizeof c->fo);
  c->view = kva_view_block_table(&k, &v, &c->t);
  c->ws_delta = pick(in, 4) ? INT64_MIN : pick(in, 3) - 1;
  pick_params(s, c, sh.B, sh.H, sh.L, mb * bs);
  common_fields(s, c);
  add(s, &c->t.batch, F_I64);
  add(s, &c->t.max_blocks, F_I64);
  add(s, &c->t.row_stride, F_I64);
  add(s, &c->t.blocks, F_PTR);
  add(s, &c->t.seq_lens, F_PTR);
  add(s, &c->t.first_offset, F_PTR);
  add_arr(s, c->blocks, sh.B * rows);
  add_arr(s, c->tlens, sh.B);
  add_arr(s, c->fo, sh.B);
  const unsigned nm = pick(in, MAX_MUT);
  for (unsigned i = 0; i < nm; ++i)
    mutate(s);
  /* the table's arrays: blocks [(batch-1)*row_stride + max_blocks], seq_lens and first_offset [batch] */
  const int64_t B = c->t.batch, stride = c->t.row_stride ? c->t.row_stride : c->t.max_blocks;
  int64_t nent = 0;
  if (B >= 1 && B <= ARR_MAX && stride >= 0 && stride <= ARR_MAX && c->t.max_blocks >= 0 && c->t.max_blocks <= ARR_MAX)
    nent = (B - 1) * stride + c->t.max_blocks;
  else if (B >= 1 && c->t.max_blocks >= 1 && stride >= 1)
    nent = ARR_MAX + 1; /* a valid table this large is not run */
  c->t.blocks = back_arr(s, c->t.blocks, c->blocks, ARR_CAP, nent);
  c->t.seq_lens = back_arr(s, c->t.seq_lens, c->tlens, ARR_CAP, B);
  c->t.first_offset = back_arr(s, c->t.first_offset, c->fo, ARR_CAP, B);
  if (c->view.layout == KVA_LAYOUT_PAGED) c->view.paged = NULL;
  c->view.seq_lens = NULL;
  back_kv(s, &c->view.k, 0);
  back_kv(s, &c->view.v, 0);
  back_params(s, c);
  run_attention(s, c, 1);
}

/* A library pool of the intended format with B sequences (appended from
 * float rows, one of them maybe forked and trimmed); NULL when the pool
 * cannot be made (then nothing is run). */
typedef struct pool_call {
  kva_pool *pool;
  int32_t seqs[4];
  int nseq;
} pool_call;
static kva_pool *make_pool(fz *s, const shape *sh, int64_t bs, pool_call *pc, int64_t *maxlen) {
  fz_in *in = &s->in;
  kva_pool_desc d = {0, bs, sh->KVH, sh->Dk, sh->Dk, sh->kf.dt, sh->kf.bits, sh->kf.gs};
  int64_t lens[4], total = 0;
  *maxlen = 0;
  for (int64_t b = 0; b < sh->B; ++b) {
    lens[b] = sh->L + pick(in, (unsigned)(sh->N - sh->L + 1));
    total += (lens[b] + bs - 1) / bs + 1;
    *maxlen = lens[b] > *maxlen ? lens[b] : *maxlen;
  }
  d.num_blocks = total + pick(in, 3);
  size_t bytes = 0;
  if (kva_pool_memory_size(&d, &bytes) || bytes > SPAN_CAP) return NULL;
  void *mem = NULL;
  if (pick(in, 2)) { /* caller memory of exactly the size asked for */
    if (s->nalloc == MAX_ALLOCS || posix_memalign(&mem, KVA_POOL_ALIGN, bytes ? bytes : 1)) abort();
    s->alloc[s->nalloc++] = mem;
  }
  kva_pool *pool;
  if (kva_pool_create(&pool, &d, mem)) return NULL;
  /* rows to append: float [KVH, T, D] */
  float *rows = (float *)fz_alloc(s, (size_t)(sh->KVH * 64 * sh->Dk) * sizeof(float));
  for (int64_t i = 0; i < sh->KVH * 64 * sh->Dk; ++i)
    rows[i] = (float)((i * 37 + s->fill) % 17) * 0.125f - 1.0f;
  pc->nseq = 0;
  for (int64_t b = 0; b < sh->B; ++b) {
    int32_t id;
    if (kva_seq_create(pool, &id)) abort();
    kva_tensor r = {rows, KVA_F32, 3, {sh->KVH, lens[b], sh->Dk}, {64 * sh->Dk * 4, sh->Dk * 4, 4}};
    if (kva_seq_append(pool, id, &r, &r)) {
      fprintf(stderr, "fuzz: kva_seq_append of an intended sequence: %s\n", kva_last_error());
      abort();
    }
    pc->seqs[pc->nseq++] = id;
  }
  if (pick(in, 3) == 0) { /* a fork of the first, trimmed */
    int32_t child;
    if (kva_seq_fork(pool, pc->seqs[0], &child) == 0) {
      kva_seq_trim(pool, child, sh->L + pick(in, (unsigned)(lens[0] - sh->L + 1)));
      pc->seqs[0] = child;
    }
  }
  pc->pool = pool;
  return pool;
}

/* kva_attention over a paged view: from sequences (csr 0) or from caller
 * CSR arrays (csr 1, the mutated CSR of such a view). */
static void op_paged(fz *s, int csr) {
  fz_in *in = &s->in;
  attn_call *c = (attn_call *)fz_alloc(s, sizeof *c);
  memset(c, 0, sizeof *c);
  shape sh = pick_shape(in);
  sh.Dv = sh.Dk;
  if (sh.kf.bits == 0 && pick(in, 2)) sh.kf.dt = sh.qdt;
  const int64_t bs = KVA_BLOCK_SIZE_MIN + pick(in, 9);
  pool_call pc;
  int64_t maxlen;
  kva_pool *pool = make_pool(s, &sh, bs, &pc, &maxlen);
  if (!pool) return;
  kva_paged_view *pv = NULL, *base = NULL;
  int32_t seqs[4] = {pc.seqs[0], pc.seqs[1], pc.seqs[2], pc.seqs[3]};
  int64_t nseq = pc.nseq;
  if (!csr) {
    add_arr(s, seqs, 4);
    add(s, &nseq, F_I64);
    const unsigned nm = pick(in, 2);
    for (unsigned i = 0; i < nm; ++i)
      mutate(s);
    s->nf = 0;
    const int32_t *sp = back_arr(s, seqs, seqs, 4, nseq);
    if (s->skip) goto done;
    int rc = kva_paged_view_create(pool, sp, nseq, &pv);
    if (rc) goto done;
  } else {
    if (kva_paged_view_create(pool, pc.seqs, pc.nseq, &base)) abort();
    kva_paged_csr bc;
    if (kva_paged_view_csr(base, &bc)) abort();
    int32_t indptr[8] = {0}, indices[ARR_CAP] = {0}, last[4] = {0}, fo[4] = {0};
    int64_t start[4] = {0};
    const int64_t B = bc.batch;
    memcpy(indptr, bc.indptr, (size_t)(B + 1) * 4);
    memcpy(indices, bc.indices, (size_t)bc.indptr[B] * 4);
    memcpy(last, bc.last_len, (size_t)B * 4);
    memcpy(fo, bc.first_offset, (size_t)B * 4);
    memcpy(start, bc.start, (size_t)B * 8);
    kva_paged_csr m = {B, indptr, indices, last, pick(in, 2) ? fo : NULL, pick(in, 2) ? start : NULL, NULL};
    if (pick(in, 4) == 0) { /* reserved blocks named too */
      int32_t r[2];
      if (kva_pool_reserve(pool, 2, r) == 0) indices[0] = r[pick(in, 2)];
    }
    add(s, &m.batch, F_I64);
    add(s, &m.indptr, F_PTR);
    add(s, &m.indices, F_PTR);
    add(s, &m.last_len, F_PTR);
    add(s, &m.first_offset, F_PTR);
    add(s, &m.start, F_PTR);
    add_arr(s, indptr, B + 1);
    add_arr(s, indices, bc.indptr[B]);
    add_arr(s, last, B);
    add_arr(s, fo, B);
    for (int64_t b = 0; b < B; ++b)
      add(s, &start[b], F_I64);
    const unsigned nm = pick(in, MAX_MUT);
    for (unsigned i = 0; i < nm; ++i)
      mutate(s);
    s->nf = 0;
    /* indptr [batch + 1], indices [indptr[batch]], last_len, first_offset [batch]; start [batch] int64 */
    const int64_t mb = m.batch;
    const int64_t nb = mb < 0 ? 0 : mb > ARR_MAX ? ARR_MAX + 1 : mb; /* past ARR_MAX: not run */
    m.indptr = back_arr(s, m.indptr, indptr, 8, mb < 0 ? 0 : nb + 1);
    const int64_t ni = m.indptr && mb >= 1 && mb < ARR_MAX ? m.indptr[mb] : 0;
    m.indices = back_arr(s, m.indices, indices, ARR_CAP, ni);
    m.last_len = back_arr(s, m.last_len, last, 4, nb);
    m.first_offset = back_arr(s, m.first_offset, fo, 4, nb);
    if (m.start) {
      int64_t *st = (int64_t *)fz_alloc(s, (size_t)(nb ? nb : 1) * 8);
      for (int64_t b = 0; b < nb; ++b)
        st[b] = start[b % 4];
      m.start = st;
    }
    if (s->skip) goto done;
    const int rc = kva_paged_view_from_csr(pool, &m, &pv);
    stats[3][rc == 0]++;
    if (rc) goto done;
  }
  {
    kva_paged_csr vc;
    if (kva_paged_view_csr(pv, &vc)) abort();
    const int64_t B = vc.batch;
    if (B > 3) goto done; /* repeated sequences: keep the call small */
    c->q = t4(sh.qdt, B, sh.H, sh.L, sh.Dk, 0, 0);
    c->out = t4(sh.odt, B, sh.H, sh.L, sh.Dv, 0, pick(in, 2) * 8);
    c->view = kva_view_paged(pv);
    c->ws_delta = INT64_MIN;
    int64_t N = 1;
    for (int64_t b = 0; b < B; ++b)
      N = vc.lens[b] > N ? vc.lens[b] : N;
    if (N > 1024) goto done; /* a valid view of a long sequence (repeated blocks): seconds per call */
    pick_params(s, c, B, sh.H, sh.L, N);
    add_tensor(s, &c->q);
    add_tensor(s, &c->out);
    add(s, &c->view.layout, F_INT);
    add(s, &c->view.paged, F_PTR);
    add(s, &c->view.k.bits, F_INT);
    add(s, &c->view.k.data.shape[0], F_I64);
    const unsigned nm = pick(in, MAX_MUT);
    for (unsigned i = 0; i < nm; ++i)
      mutate(s);
    if (c->view.paged == (const kva_paged_view *)&s->in) c->view.paged = pv;
    if (c->view.layout == KVA_LAYOUT_BLOCK_TABLE) c->view.table = NULL;
    c->view.seq_lens = NULL;
    back_params(s, c);
    run_attention(s, c, csr ? 3 : 2);
    /* the view's table for a device copy: max_blocks fuzzed */
    int32_t *blocks, *lens, *fo;
    const int64_t mbk = (int64_t)pick(in, 8);
    blocks = (int32_t *)fz_alloc(s, (size_t)(B * mbk + 1) * 4);
    lens = (int32_t *)fz_alloc(s, (size_t)B * 4);
    fo = (int32_t *)fz_alloc(s, (size_t)B * 4);
    memset(blocks, 0x5a, (size_t)(B * mbk + 1) * 4);
    memset(lens, 0x5a, (size_t)B * 4);
    memset(fo, 0x5a, (size_t)B * 4);
    const int rc = kva_paged_view_block_table(pv, mbk, blocks, lens, fo);
    if (rc < 0) {
      int wrote = 0;
      for (int64_t i = 0; i < B * mbk + 1; ++i)
        wrote |= (uint32_t)blocks[i] != 0x5a5a5a5au;
      for (int64_t b = 0; b < B; ++b)
        wrote |= (uint32_t)lens[b] != 0x5a5a5a5au || (uint32_t)fo[b] != 0x5a5a5a5au;
      if (wrote) {
        fprintf(stderr, "fuzz: kva_paged_view_block_table failed (%d) but wrote its arrays\n", rc);
        abort();
      }
    }
  }
done:
  if (pv) kva_paged_view_release(pv);
  if (base) kva_paged_view_release(base);
  if (kva_pool_check(pool)) {
    fprintf(stderr, "fuzz: kva_pool_check: %s\n", kva_last_error());
    abort();
  }
  kva_pool_destroy(pool);
}

/* kva_quantize of w [.., D] into out, then kva_dequantize of the result. */
static void op_quant(fz *s, int dequant) {
  fz_in *in = &s->in;
  const int rank = 1 + (int)pick(in, 4);
  int64_t sh[4] = {1, 1, 1, 1};
  for (int d = 4 - rank; d < 3; ++d)
    sh[d] = 1 + pick(in, 4);
  const int64_t D = head_dims[pick(in, 4)];
  kvfmt f = pick_fmt(in, D);
  if (!f.bits) f.bits = 4, f.gs = 32;
  const kva_dtype wdt = pick_float(in);
  const int64_t pc = pick(in, 3) == 0 ? 8 : 0;
  kva_kv q;
  memset(&q, 0, sizeof q);
  kva_tensor w = t4(wdt, sh[0], sh[1], sh[2], D, 0, pc);
  q = make_kv(in, f.bits, f.gs, f.dt, sh[0], sh[1], sh[2], D, 0, pc);
  /* rank r: the last r dims of the 4-d descriptors */
  kva_tensor *ts[4] = {&w, &q.data, &q.scales, &q.biases};
  for (int i = 0; i < 4; ++i) {
    kva_tensor *t = ts[i];
    const int drop = 4 - rank;
    memmove(t->shape, t->shape + drop, (size_t)rank * 8);
    memmove(t->stride, t->stride + drop, (size_t)rank * 8);
    for (int d = rank; d < 4; ++d)
      t->shape[d] = 0, t->stride[d] = 0;
    t->ndim = rank;
  }
  add_tensor(s, &w);
  add_kv(s, &q);
  const unsigned nm = pick(in, MAX_MUT);
  for (unsigned i = 0; i < nm; ++i)
    mutate(s);
  if (!dequant) {
    back(s, &w, 4, 0);
    const int64_t wspan = claimed_span(&w);
    if (w.data && w.dtype == KVA_F32 && s->fill != 0xff &&
        wspan <= SPAN_CAP) /* varied finite values, or the pattern's NaN */
      for (int64_t i = 0; i + 4 <= wspan; i += 4)
        ((float *)w.data)[i / 4] = (float)(i / 4 % 13) - 6.0f;
    back_kv(s, &q, 1);
    if (s->skip) return;
    const int rc = kva_quantize(&w, &q);
    stats[4][rc == 0]++;
    if (rc < 0)
      check_outputs_unchanged(s, rc, "kva_quantize");
    else {
      check_padding(s, &q.data, "kva_quantize");
      check_padding(s, &q.scales, "kva_quantize");
      check_padding(s, &q.biases, "kva_quantize");
    }
  } else {
    back_kv(s, &q, 0);
    back(s, &w, 4, 1);
    if (s->skip) return;
    const int rc = kva_dequantize(&q, &w);
    stats[5][rc == 0]++;
    if (rc < 0)
      check_outputs_unchanged(s, rc, "kva_dequantize");
    else
      check_padding(s, &w, "kva_dequantize");
  }
}

/* kva_convert between float tensors of one shape. */
static void op_convert(fz *s) {
  fz_in *in = &s->in;
  const int64_t n0 = 1 + pick(in, 3), n1 = 1 + pick(in, 4), n2 = 1 + pick(in, 8), n3 = 1 + pick(in, 130);
  kva_tensor src = t4(pick_float(in), n0, n1, n2, n3, pick(in, 2), pick(in, 3));
  kva_tensor dst = t4(pick_float(in), n0, n1, n2, n3, pick(in, 2), pick(in, 3));
  add_tensor(s, &src);
  add_tensor(s, &dst);
  const unsigned nm = pick(in, MAX_MUT);
  for (unsigned i = 0; i < nm; ++i)
    mutate(s);
  back(s, &src, 4, 0);
  back(s, &dst, 4, 1);
  if (s->skip) return;
  const int rc = kva_convert(&src, &dst);
  stats[6][rc == 0]++;
  if (rc < 0)
    check_outputs_unchanged(s, rc, "kva_convert");
  else
    check_padding(s, &dst, "kva_convert");
}

/* Marks, in out buffer oi, the bytes of row (i0, i1, i2) of pool tensor t. */
static void mark_row(const fz *s, int oi, const kva_tensor *t, int64_t i0, int64_t i1, int64_t i2, uint8_t *mark) {
  const uint8_t *base = s->outs[oi].buf;
  const int64_t es = (int64_t)kva_dtype_size(t->dtype);
  const uint8_t *r = (const uint8_t *)t->data + i0 * t->stride[0] + i1 * t->stride[1] + i2 * t->stride[2];
  memset(mark + (r - base), 1, (size_t)(t->shape[3] * es));
}

/* kva_cache_write of n tokens into caller pools at fuzzed slots. */
static void op_cache_write(fz *s) {
  fz_in *in = &s->in;
  const int64_t KVH = 1 + pick(in, 3), bs = 1 + pick(in, 16), nblk = 1 + pick(in, 6), n = pick(in, 9);
  const int64_t D = head_dims[pick(in, 4)];
  kvfmt f = pick_fmt(in, D);
  kva_kv kp = make_kv(in, f.bits, f.gs, f.dt, nblk, KVH, bs, D, 0, pick(in, 2) * 8);
  kva_kv vp = make_kv(in, f.bits, f.gs, f.dt, nblk, KVH, bs, D, 0, 0);
  const kva_dtype sdt = pick_float(in);
  kva_tensor k = {(void *)1, sdt, 3, {n, KVH, D}, {0, 0, 0}}, v;
  const int64_t es = (int64_t)kva_dtype_size(sdt);
  k.stride[2] = es, k.stride[1] = D * es, k.stride[0] = KVH * D * es;
  v = k;
  int32_t slots[ARR_CAP];
  for (int64_t i = 0; i < n; ++i)
    slots[i] = pick(in, 8) ? (int32_t)pick(in, (unsigned)(nblk * bs)) : -1;
  int64_t nn = n;
  const int32_t *sp = slots;
  add_kv(s, &kp);
  add_kv(s, &vp);
  add_tensor(s, &k);
  add_tensor(s, &v);
  add(s, &nn, F_I64);
  add(s, &sp, F_PTR);
  add_arr(s, slots, n);
  const unsigned nm = pick(in, MAX_MUT);
  for (unsigned i = 0; i < nm; ++i)
    mutate(s);
  back(s, &k, 4, 0);
  back(s, &v, 4, 0);
  back_kv(s, &kp, 1);
  back_kv(s, &vp, 1);
  sp = back_arr(s, sp, slots, ARR_CAP, nn);
  if (s->skip) return;
  const int rc = kva_cache_write(ctx, &kp, &vp, &k, &v, sp, nn);
  stats[7][rc == 0]++;
  if (rc < 0) {
    check_outputs_unchanged(s, rc, "kva_cache_write");
    return;
  }
  /* success: the pools' bytes outside the rows of the named slots are unchanged */
  const kva_kv *pools[2] = {&kp, &vp};
  for (int pi = 0; pi < 2; ++pi) {
    const kva_kv *p = pools[pi];
    const kva_tensor *parts[3] = {&p->data, &p->scales, &p->biases};
    for (int t = 0; t < (p->bits ? 3 : 1); ++t) {
      const int oi = out_index(s, parts[t]->data);
      uint8_t *mark = (uint8_t *)calloc(s->outs[oi].bytes, 1);
      if (!mark) abort();
      const int64_t pbs = p->data.shape[2];
      for (int64_t i = 0; i < nn; ++i)
        if (sp[i] >= 0)
          for (int64_t h = 0; h < p->data.shape[1]; ++h)
            mark_row(s, oi, parts[t], sp[i] / pbs, h, sp[i] % pbs, mark);
      for (size_t b = 0; b < s->outs[oi].bytes; ++b)
        if (!mark[b] && s->outs[oi].buf[b] != s->outs[oi].copy[b]) {
          fprintf(stderr, "fuzz: kva_cache_write wrote byte %zu of pool array %d outside the named slots\n", b, oi);
          abort();
        }
      free(mark);
    }
  }
}

/* kva_causal_mask / kva_image_mask into a bool tensor. */
static void op_masks(fz *s, int image) {
  fz_in *in = &s->in;
  int64_t n = 1 + pick(in, 40), off = image ? 0 : pick(in, 40);
  int32_t window = pick(in, 2) ? (int32_t)pick(in, 50) : 0;
  int clamp = (int)pick(in, 2);
  kva_tensor out = kva_tensor_2d((void *)1, KVA_BOOL, n, off + n);
  if (pick(in, 3) == 0) out.stride[0] += 8;
  kva_tensor seg = kva_tensor_1d((void *)1, KVA_I32, n);
  add_tensor(s, &out);
  add(s, &n, F_I64);
  add(s, &off, F_I64);
  add(s, &window, F_I32);
  add(s, &clamp, F_INT);
  if (image) add_tensor(s, &seg);
  const unsigned nm = pick(in, MAX_MUT);
  for (unsigned i = 0; i < nm; ++i)
    mutate(s);
  back(s, &out, 4, 1);
  if (image) {
    back(s, &seg, 4, 0);
    const int64_t sspan = claimed_span(&seg);
    if (seg.data && sspan <= SPAN_CAP)
      for (int64_t i = 0; i + 4 <= sspan; i += 4)
        ((int32_t *)seg.data)[i / 4] = (int32_t)(i / 4 % 3);
  }
  if (s->skip) return;
  const int rc = image ? kva_image_mask(&seg, window, clamp, &out) : kva_causal_mask(n, off, window, &out);
  stats[image ? 9 : 8][rc == 0]++;
  if (rc < 0)
    check_outputs_unchanged(s, rc, image ? "kva_image_mask" : "kva_causal_mask");
  else
    check_padding(s, &out, image ? "kva_image_mask" : "kva_causal_mask");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static fz s;
  memset(&s, 0, sizeof s);
  s.in = (fz_in){data, size};
  static const uint8_t fills[] = {0x3c, 0x3c, 0x00, 0xff, 0x7f, 0x41};
  const unsigned op = pick(&s.in, 10);
  s.fill = fills[pick(&s.in, 6)];
  switch (op) {
  case 0: op_contiguous(&s); break;
  case 1: op_block_table(&s); break;
  case 2: op_paged(&s, 0); break;
  case 3: op_paged(&s, 1); break;
  case 4: op_quant(&s, 0); break;
  case 5: op_quant(&s, 1); break;
  case 6: op_convert(&s); break;
  case 7: op_cache_write(&s); break;
  case 8: op_masks(&s, 0); break;
  default: op_masks(&s, 1); break;
  }
  for (int i = 0; i < s.nalloc; ++i)
    free(s.alloc[i]);
  return 0;
}
