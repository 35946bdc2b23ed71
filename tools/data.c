/* The rotated K/V cache set of a case. One copy holds K and V of all
 * sequences and KV heads, each as data + scales + biases (quantized) or data
 * (float), contiguous [B, KVH, N, .]. Copy 0 is filled with fresh random
 * values (approximately N(0,1), drawn as bf16 and quantized with
 * kva_quantize for quantized formats), split over the tool's threads in
 * chunks of rows each seeded from (seed, part, chunk), so the values do not
 * depend on the thread count; (sequence, KV head) slabs the check does not
 * sample repeat one fresh slab (see fill_job). The other copies replicate copy 0: timed calls
 * rotate over them so each call reads K/V from DRAM, not from cache. For the
 * paged layout the rotation is over block pools built from the contiguous
 * master with kva_pool_from_contiguous, their blocks shuffled (a fragmented
 * pool), each with one view of the B sequences. */
#include "bench.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define PART_ALIGN 256       /* bytes between the parts of one copy */
#define COPY_ALIGN 4096      /* copies start on page boundaries */
#define FILL_CHUNK_ROWS 1024 /* rows quantized per kva_quantize call */
#define KB_COLD_BYTES KB_GIB /* rotation this large counts as cold */

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Layout of one operand (K or V) with head dim D. */
static void part_sizes(const kb_case *c, int64_t D, size_t *data, size_t *aux) {
  size_t rows = (size_t)(c->B * c->KVH * c->N);
  if (c->kv.bits == 0) {
    *data = rows * (size_t)D * kva_dtype_size(c->kv.dtype);
    *aux = kb_is_fp8(c->kv.dtype) ? rows * sizeof(float) : 0; /* fp8: one scale per row (the scale part) */
  } else {
    *data = rows * (size_t)(D * c->kv.bits / 32) * sizeof(uint32_t);
    *aux = rows * (size_t)(D / c->kv.group) * kva_dtype_size(c->kv.dtype);
  }
}

static void layout(kb_cacheset *cs, const kb_case *c) {
  size_t dk, ak, dv, av;
  part_sizes(c, c->Dk, &dk, &ak);
  part_sizes(c, c->Dv, &dv, &av);
  const bool fp8 = c->kv.bits == 0 && kb_is_fp8(c->kv.dtype); /* scales, no biases */
  size_t sz[KB_NPARTS] = {dk, ak, fp8 ? 0 : ak, dv, av, fp8 ? 0 : av}, off = 0;
  for (int i = 0; i < KB_NPARTS; ++i) {
    cs->off[i] = off;
    cs->size[i] = sz[i];
    off = align_up(off + sz[i], PART_ALIGN);
  }
  cs->copy_bytes = align_up(off, COPY_ALIGN);
}

static kva_kv operand(const kb_cacheset *cs, char *base, bool is_v) {
  const kb_case *c = &cs->key;
  int p = is_v ? KB_VD : KB_KD;
  int64_t D = is_v ? c->Dv : c->Dk;
  if (c->kv.bits == 0 && kb_is_fp8(c->kv.dtype))
    return kva_kv_fp8(base + cs->off[p], c->kv.dtype, (const float *)(base + cs->off[p + 1]), 1, c->B, c->KVH, c->N, D);
  if (c->kv.bits == 0) return kva_kv_float(base + cs->off[p], c->kv.dtype, c->B, c->KVH, c->N, D);
  return kva_kv_quantized(base + cs->off[p], base + cs->off[p + 1], base + cs->off[p + 2],
                          c->kv.dtype, c->kv.bits, c->kv.group, c->B, c->KVH, c->N, D);
}

void kb_cacheset_kv(const kb_cacheset *cs, int i, kva_kv *k, kva_kv *v) {
  char *base = i < 0 ? cs->host : cs->base + (size_t)i * cs->copy_bytes;
  *k = operand(cs, base, false);
  *v = operand(cs, base, true);
}

kva_kv_view kb_cacheset_view(const kb_cacheset *cs, int i) {
  int c = i % cs->copies;
  if (cs->key.layout == KVA_LAYOUT_PAGED && cs->dev_mem)
    return kva_view_block_table(&cs->dev_k[c], &cs->dev_v[c], &cs->dev_bt[c]);
  if (cs->key.layout == KVA_LAYOUT_PAGED) return kva_view_paged(cs->views[c]);
  kva_kv k, v;
  kb_cacheset_kv(cs, c, &k, &v);
  return kva_view_contiguous(&k, &v, NULL);
}

void kb_fill_randn(void *data, kva_dtype dt, size_t n, uint64_t seed) {
  uint64_t s = seed;
  switch (dt) {
  case KVA_F32: {
    float *p = data;
    for (size_t i = 0; i < n; ++i) p[i] = kb_randn(&s);
    break;
  }
  case KVA_F16: {
    uint16_t *p = data;
    for (size_t i = 0; i < n; ++i) p[i] = kva_f32_to_f16(kb_randn(&s));
    break;
  }
  case KVA_BF16: {
    uint16_t *p = data;
    for (size_t i = 0; i < n; ++i) p[i] = kva_f32_to_bf16(kb_randn(&s));
    break;
  }
  default: break;
  }
}

/* ---------------------------------------------------- parallel fill */
/* A slab is the N rows of one (sequence, KV head) of K or V. The slabs the
 * check samples are drawn fresh, plus one more (the template); the others
 * repeat the template: what they hold matters to no check and costs the same
 * to read, and a kernel that reads a wrong slab still reads values the
 * checked slabs do not have. */
typedef struct fill_job {
  const kb_cacheset *cs;
  char *base;
  uint64_t seed;
  int threads;
  int64_t N, chunks_per_slab;
  int64_t *fresh, n_fresh; /* slabs drawn fresh */
  int64_t *copy, n_copy;   /* slabs that repeat the template */
  int64_t template_slab;
  int rc[KB_MAX_THREADS];  /* per thread: first error */
  char err[KB_MAX_THREADS][160];
} fill_job;

static uint64_t chunk_seed(uint64_t seed, int part, int64_t chunk) {
  uint64_t s = seed ^ ((uint64_t)part << 56) ^ (uint64_t)chunk * 0x9e3779b97f4a7c15ull;
  return kb_mix64(&s);
}

/* Bytes of one row of part p of a copy. */
static size_t part_row_bytes(const kb_case *c, int p) {
  int64_t D = p >= KB_VD ? c->Dv : c->Dk;
  bool aux = p != KB_KD && p != KB_VD;
  if (c->kv.bits == 0 && kb_is_fp8(c->kv.dtype)) return p == KB_KD || p == KB_VD ? (size_t)D : p == KB_KD + 1 || p == KB_VD + 1 ? sizeof(float) : 0;
  if (c->kv.bits == 0) return aux ? 0 : (size_t)D * kva_dtype_size(c->kv.dtype);
  if (aux) return (size_t)(D / c->kv.group) * kva_dtype_size(c->kv.dtype);
  return (size_t)(D * c->kv.bits / 32) * sizeof(uint32_t);
}

static char *row_at(const fill_job *j, int p, int64_t r) {
  return j->base + j->cs->off[p] + (size_t)r * part_row_bytes(&j->cs->key, p);
}

/* Rows [r0, r1) of operand K (is_v false) or V of copy `base`. */
static int fill_rows(fill_job *j, bool is_v, int64_t r0, int64_t r1, uint16_t *tmp,
                     uint64_t seed) {
  const kb_case *c = &j->cs->key;
  int p = is_v ? KB_VD : KB_KD;
  int64_t D = is_v ? c->Dv : c->Dk, n = r1 - r0;
  if (c->kv.bits == 0 && kb_is_fp8(c->kv.dtype)) {
    /* bf16 values, per row scale = max |x| / max_fp8 and codes of x / scale (kva_cache_write's rule) */
    kb_fill_randn(tmp, KVA_BF16, (size_t)(n * D), seed);
    const float fmax = c->kv.dtype == KVA_F8E4M3 ? 448.0f : 57344.0f;
    for (int64_t r = 0; r < n; ++r) {
      const uint16_t *x = tmp + r * D;
      float amax = 0.0f;
      for (int64_t d = 0; d < D; ++d) amax = fmaxf(amax, fabsf(kva_bf16_to_f32(x[d])));
      const float s = amax > 0.0f ? amax / fmax : 1.0f;
      uint8_t *code = (uint8_t *)row_at(j, p, r0 + r);
      memcpy(row_at(j, p + 1, r0 + r), &s, sizeof s);
      for (int64_t d = 0; d < D; ++d) {
        const float y = kva_bf16_to_f32(x[d]) / s;
        code[d] = c->kv.dtype == KVA_F8E4M3 ? kva_f32_to_f8e4m3(y) : kva_f32_to_f8e5m2(y);
      }
    }
    return 0;
  }
  if (c->kv.bits == 0) {
    kb_fill_randn(row_at(j, p, r0), c->kv.dtype, (size_t)(n * D), seed);
    return 0;
  }
  kb_fill_randn(tmp, KVA_BF16, (size_t)(n * D), seed);
  kva_tensor w = kva_tensor_2d(tmp, KVA_BF16, n, D);
  kva_kv out;
  memset(&out, 0, sizeof out);
  out.data = kva_tensor_2d(row_at(j, p, r0), KVA_U32, n, D * c->kv.bits / 32);
  out.scales = kva_tensor_2d(row_at(j, p + 1, r0), c->kv.dtype, n, D / c->kv.group);
  out.biases = kva_tensor_2d(row_at(j, p + 2, r0), c->kv.dtype, n, D / c->kv.group);
  out.bits = c->kv.bits;
  out.group_size = c->kv.group;
  return kva_quantize(&w, &out);
}

static void fill_thread(void *arg, int t) {
  fill_job *j = arg;
  const kb_case *c = &j->cs->key;
  int64_t Dmax = c->Dk > c->Dv ? c->Dk : c->Dv;
  const bool staged = c->kv.bits || kb_is_fp8(c->kv.dtype); /* values drawn as bf16, then encoded */
  uint16_t *tmp = staged ? malloc((size_t)(FILL_CHUNK_ROWS * Dmax) * sizeof(uint16_t)) : NULL;
  if (staged && !tmp) {
    j->rc[t] = KVA_ENOMEM;
    snprintf(j->err[t], sizeof j->err[t], "out of memory filling K/V");
    return;
  }
  /* Items: (operand, fresh slab, chunk), dealt round-robin. */
  int64_t per_op = j->n_fresh * j->chunks_per_slab;
  for (int64_t it = t; it < 2 * per_op; it += j->threads) {
    bool is_v = it >= per_op;
    int64_t rem = it % per_op, slab = j->fresh[rem / j->chunks_per_slab];
    int64_t ch = rem % j->chunks_per_slab;
    int64_t r0 = slab * j->N + ch * FILL_CHUNK_ROWS, r1 = r0 + FILL_CHUNK_ROWS;
    if (r1 > (slab + 1) * j->N) r1 = (slab + 1) * j->N;
    int rc = fill_rows(j, is_v, r0, r1, tmp,
                       chunk_seed(j->seed, is_v, slab * j->chunks_per_slab + ch));
    if (rc < 0) {
      j->rc[t] = rc;
      snprintf(j->err[t], sizeof j->err[t], "kva_quantize: %s", kva_last_error());
      break;
    }
  }
  free(tmp);
}

static void repeat_thread(void *arg, int t) {
  fill_job *j = arg;
  for (int64_t it = t; it < j->n_copy; it += j->threads)
    for (int p = 0; p < KB_NPARTS; ++p) {
      size_t rb = part_row_bytes(&j->cs->key, p);
      if (rb)
        memcpy(row_at(j, p, j->copy[it] * j->N), row_at(j, p, j->template_slab * j->N),
               (size_t)j->N * rb);
    }
}

/* Fills copy `base` (host memory). */
static int fill_copy(const kb_cacheset *cs, char *base, uint64_t seed, int threads, char *err,
                     size_t errn) {
  const kb_case *c = &cs->key;
  int64_t slabs = c->B * c->KVH;
  fill_job *j = calloc(1, sizeof *j);
  int64_t *lists = malloc(2 * (size_t)slabs * sizeof *lists);
  if (!j || !lists) {
    free(j);
    free(lists);
    snprintf(err, errn, "out of memory");
    return KVA_ENOMEM;
  }
  j->cs = cs, j->base = base, j->seed = seed, j->threads = threads, j->N = c->N;
  j->chunks_per_slab = (c->N + FILL_CHUNK_ROWS - 1) / FILL_CHUNK_ROWS;
  j->fresh = lists, j->copy = lists + slabs, j->template_slab = -1;
  for (int64_t s = 0; s < slabs; ++s) {
    if (kb_is_sampled(c, s / c->KVH, s % c->KVH) || j->template_slab < 0) {
      if (!kb_is_sampled(c, s / c->KVH, s % c->KVH)) j->template_slab = s;
      j->fresh[j->n_fresh++] = s;
    } else {
      j->copy[j->n_copy++] = s;
    }
  }
  kb_parallel(threads, fill_thread, j);
  int rc = 0;
  for (int t = 0; t < threads && rc == 0; ++t)
    if (j->rc[t] < 0) {
      rc = j->rc[t];
      snprintf(err, errn, "%s", j->err[t]);
    }
  if (rc == 0 && j->n_copy) kb_parallel(threads, repeat_thread, j);
  free(lists);
  free(j);
  return rc;
}

typedef struct copy_job {
  char *dst;
  const char *src;
  size_t bytes;
  int threads;
} copy_job;

static void copy_thread(void *arg, int t) {
  copy_job *j = arg;
  size_t per = align_up(j->bytes / (size_t)j->threads + 1, COPY_ALIGN);
  size_t a = per * (size_t)t, b = a + per;
  if (a >= j->bytes) return;
  if (b > j->bytes) b = j->bytes;
  memcpy(j->dst + a, j->src + a, b - a);
}

/* ------------------------------------------------------------ paged */
/* A pool descriptor rebased from host block memory at hbase to dbase. */
static kva_tensor rebase(kva_tensor t, const char *hbase, char *dbase) {
  if (t.data) t.data = dbase + ((const char *)t.data - hbase);
  return t;
}

/* Copies pool i's block memory and its view's block table to the device
 * (one allocation: pool image, then blocks [B, max_blocks], lens, offsets). */
static int pool_to_device(kb_backend *be, kb_cacheset *cs, int i, char *err, size_t errn) {
  const kb_case *c = &cs->key;
  const kva_pool_desc d = kva_pool_get_desc(cs->pools[i]);
  size_t pbytes = 0;
  int rc = kva_pool_memory_size(&d, &pbytes);
  const int64_t maxb = (c->N + c->block - 1) / c->block;
  const size_t tbytes = sizeof(int32_t) * (size_t)(c->B * maxb + 2 * c->B);
  int32_t *tab = malloc(tbytes);
  if (rc == 0 && !tab) rc = KVA_ENOMEM;
  if (rc == 0) rc = kva_paged_view_block_table(cs->views[i], maxb, tab, tab + c->B * maxb, tab + c->B * maxb + c->B);
  const kva_kv hk = kva_pool_k(cs->pools[i]), hv = kva_pool_v(cs->pools[i]);
  const char *hbase = (const char *)hk.data.data; /* block memory starts with the K array */
  char *dev = rc == 0 ? be->alloc(be, pbytes + tbytes) : NULL;
  if (rc == 0 && !dev) rc = KVA_ENOMEM;
  if (rc == 0) rc = be->copy_in(be, dev, hbase, pbytes);
  if (rc == 0) rc = be->copy_in(be, dev + pbytes, tab, tbytes);
  free(tab);
  if (rc < 0) {
    if (dev) be->release(be, dev, 0);
    snprintf(err, errn, "paged copy %d to the %s backend: %s", i, be->name, kva_last_error());
    return rc;
  }
  cs->dev_mem[i] = dev;
  kva_kv *dk = &cs->dev_k[i], *dv = &cs->dev_v[i];
  *dk = hk;
  *dv = hv;
  dk->data = rebase(hk.data, hbase, dev);
  dk->scales = rebase(hk.scales, hbase, dev);
  dk->biases = rebase(hk.biases, hbase, dev);
  dv->data = rebase(hv.data, hbase, dev);
  dv->scales = rebase(hv.scales, hbase, dev);
  dv->biases = rebase(hv.biases, hbase, dev);
  const int32_t *dt = (const int32_t *)(dev + pbytes);
  const kva_block_table bt = {c->B, maxb, 0, dt, dt + c->B * maxb, dt + c->B * maxb + c->B};
  cs->dev_bt[i] = bt;
  return 0;
}

/* cs->copies pools from the host master, blocks shuffled (unless the case
 * asks for them in order), one view each;
 * on a device backend each goes to the device and the host pool is freed. */
static int make_pools(kb_backend *be, kb_cacheset *cs, uint64_t seed, char *err, size_t errn) {
  const kb_case *c = &cs->key;
  const bool dev = !be->host_memory;
  cs->pools = calloc((size_t)cs->copies, sizeof *cs->pools);
  cs->views = calloc((size_t)cs->copies, sizeof *cs->views);
  if (dev) {
    cs->dev_mem = calloc((size_t)cs->copies, sizeof *cs->dev_mem);
    cs->dev_k = calloc((size_t)cs->copies, sizeof *cs->dev_k);
    cs->dev_v = calloc((size_t)cs->copies, sizeof *cs->dev_v);
    cs->dev_bt = calloc((size_t)cs->copies, sizeof *cs->dev_bt);
  }
  int32_t *seqs = malloc((size_t)c->B * sizeof *seqs);
  int rc = cs->pools && cs->views && seqs && (!dev || (cs->dev_mem && cs->dev_k && cs->dev_v && cs->dev_bt))
               ? 0
               : KVA_ENOMEM;
  if (rc) snprintf(err, errn, "out of memory");
  kva_kv k, v;
  kb_cacheset_kv(cs, -1, &k, &v);
  kva_kv_view master = kva_view_contiguous(&k, &v, NULL);
  for (int i = 0; i < cs->copies && rc == 0; ++i) {
    uint64_t shuffle = c->in_order ? 0 : seed ^ (0x5bd1e995ull * (uint64_t)(i + 1)); /* 0: blocks in order */
    if (shuffle == 0 && !c->in_order) shuffle = 1;
    rc = kva_pool_from_contiguous(&cs->pools[i], &master, c->block, 0, shuffle, seqs);
    if (rc == 0) rc = kva_paged_view_create(cs->pools[i], seqs, c->B, &cs->views[i]);
    if (rc < 0) {
      snprintf(err, errn, "paged copy %d: %s", i, kva_last_error());
      break;
    }
    if (dev) {
      rc = pool_to_device(be, cs, i, err, errn);
      kva_paged_view_release(cs->views[i]);
      kva_pool_destroy(cs->pools[i]);
      cs->views[i] = NULL;
      cs->pools[i] = NULL;
    }
  }
  free(seqs);
  return rc;
}

/* ------------------------------------------------------ make / free */
int kb_cacheset_make(kb_backend *be, const kb_opts *o, const kb_case *c, uint64_t seed,
                     kb_cacheset *cs, char *err, size_t errn) {
  memset(cs, 0, sizeof *cs);
  cs->key = *c;
  layout(cs, c);
  double cb = (double)cs->copy_bytes;
  bool paged = c->layout == KVA_LAYOUT_PAGED;
  /* Bytes of one rotated copy: a contiguous copy, or one pool. */
  double rb = cb;
  if (paged) {
    int64_t per_seq = (c->N + c->block - 1) / c->block;
    kva_pool_desc d = {.num_blocks = c->B * per_seq, .block_size = c->block, .kv_heads = c->KVH,
                       .dk = c->Dk, .dv = c->Dv, .dtype = c->kv.dtype, .bits = c->kv.bits,
                       .group_size = c->kv.group};
    size_t pb = 0;
    if (kva_pool_memory_size(&d, &pb) < 0) {
      snprintf(err, errn, "kva_pool_memory_size: %s", kva_last_error());
      return KVA_EINVAL;
    }
    rb = (double)pb;
  }
  double fixed = paged ? cb : 0; /* the paged master is not rotated */
  if (fixed + rb > o->mem_cap_bytes) {
    snprintf(err, errn, "one copy of K/V needs %.2f GB, above --mem-cap-gb %.2f", (fixed + rb) / 1e9,
             o->mem_cap_bytes / 1e9);
    return KVA_ENOMEM;
  }
  int copies = o->rotate_bytes > rb ? (int)ceil(o->rotate_bytes / rb) : 1;
  if (fixed + (double)copies * rb > o->mem_cap_bytes) copies = (int)((o->mem_cap_bytes - fixed) / rb);
  if (copies < 1) copies = 1;
  cs->copies = copies;
  double total = (double)copies * rb;
  cs->rotated_bytes = (size_t)total;
  if (o->rotate_bytes <= 0 && total < KB_COLD_BYTES)
    cs->note = "rotation skipped (--quick): K/V may be served from cache";
  else if (total < KB_COLD_BYTES)
    cs->note = "rotation below 1 GiB (--mem-cap-gb): K/V may be served from cache";

  int contiguous_copies = paged ? 1 : copies;
  cs->base = be->alloc(be, (size_t)contiguous_copies * cs->copy_bytes);
  if (!cs->base) {
    snprintf(err, errn, "cannot allocate %d copies of %.1f MB", contiguous_copies, cb / 1e6);
    return KVA_ENOMEM;
  }
  cs->host = be->host_memory ? cs->base : malloc(cs->copy_bytes);
  if (!cs->host) {
    kb_cacheset_free(be, cs);
    snprintf(err, errn, "cannot allocate the %.1f MB host master", cb / 1e6);
    return KVA_ENOMEM;
  }
  /* Padding between parts is never read, but keep it defined. */
  for (int i = 0; i < KB_NPARTS; ++i) {
    size_t end = cs->off[i] + cs->size[i];
    size_t next = i + 1 < KB_NPARTS ? cs->off[i + 1] : cs->copy_bytes;
    memset(cs->host + end, 0, next - end);
  }
  int rc = fill_copy(cs, cs->host, seed, be->host_threads, err, errn);
  if (rc < 0) {
    kb_cacheset_free(be, cs);
    return rc;
  }
  if (!be->host_memory) rc = be->copy_in(be, cs->base, cs->host, cs->copy_bytes);
  for (int i = 1; i < contiguous_copies && rc == 0; ++i) {
    char *dst = cs->base + (size_t)i * cs->copy_bytes;
    if (be->host_memory) {
      copy_job cj = {dst, cs->base, cs->copy_bytes, be->threads};
      kb_parallel(be->threads, copy_thread, &cj);
    } else {
      rc = be->replicate(be, dst, cs->base, cs->copy_bytes);
    }
  }
  if (rc < 0) {
    snprintf(err, errn, "copying K/V to the %s backend failed", be->name);
    kb_cacheset_free(be, cs);
    return rc;
  }
  if (paged && (rc = make_pools(be, cs, seed, err, errn)) < 0) {
    kb_cacheset_free(be, cs);
    return rc;
  }
  return 0;
}

void kb_cacheset_free(kb_backend *be, kb_cacheset *cs) {
  for (int i = 0; cs->views && i < cs->copies; ++i) kva_paged_view_release(cs->views[i]);
  for (int i = 0; cs->pools && i < cs->copies; ++i) kva_pool_destroy(cs->pools[i]);
  for (int i = 0; cs->dev_mem && i < cs->copies; ++i)
    if (cs->dev_mem[i]) be->release(be, cs->dev_mem[i], 0);
  free(cs->views);
  free(cs->pools);
  free(cs->dev_mem);
  free(cs->dev_k);
  free(cs->dev_v);
  free(cs->dev_bt);
  if (cs->host && cs->host != cs->base) free(cs->host);
  if (cs->base) be->release(be, cs->base, 0);
  memset(cs, 0, sizeof *cs);
}
