/* Cascade (shared prefix) against one batched call, and the merge kernel
 * (`make bench-cascade`; CPU, or CUDA with --backend cuda).
 *
 * Cascade: B sequences whose caches are a shared prefix of P tokens then S
 * own tokens each, L = 1 query row, causal, bf16 queries. The batched
 * kva_attention reads each sequence's whole cache (the prefix B times);
 * kva_cascade_attention reads the prefix once for all B rows of each head
 * (one stacked call), then the suffixes, then one merge. Shapes H/KVH/D
 * 8/4/256 and 32/8/128, K/V q4 (group 64, bf16 scales) or bf16 rows. Cold:
 * before every timed call a buffer larger than the last-level cache is
 * written (--flush-mb; on CUDA a cudaMemsetAsync on the call's stream);
 * --hot skips it. Median of --reps calls each (after one warm-up call),
 * the two calls alternated, then the cascade's prefix pass (the stacked
 * rows over the prefix) and suffix pass alone; the outputs are compared (max |diff| over
 * max |out|: both run fast kernels, bf16 products on some paths).
 * Bytes each call reads: batched B (P + S) KVH D (K and V), cascade
 * (P + B S) KVH D, in the cache's format.
 *
 * Merge: kva_merge_states of R = 2..8 f32 parts [B, H, 1, Dv = 128] into
 * f32 out and lse, B H = 8 (1 x 8) and 512 (16 x 32), hot, mean over
 * --merge-iters calls (CUDA: events around the loop on one stream).
 *
 * Usage: cascade_vs_batched [--backend cpu|cuda] [--threads T = 0: all cores] [--shape 8/4/256|32/8/128|all]
 *          [--format q4|bf16|all] [--P 32768] [--S 1024] [--B 16] [--reps 5] [--hot]
 *          [--flush-mb MB] [--merge-only | --no-merge] [--merge-iters N] [--cp | --cp-only] [--cp-N 1048576]
 *          [--lse | --lse-only]
 * Context parallelism (--cp): one sequence of --cp-N tokens, q4 8/4/256 and
 * 24/4/256, B = 1: the unsharded call, then for R = 2, 4, 8 one shard's
 * kva_cp_attend, the merge of R parts (kva_cp_merge), the bytes each rank
 * exchanges, and the speedup they imply (unsharded / (shard + merge); the
 * exchange is not timed).
 * lse (--lse): kva_attention against kva_attention_lse, alternated, cold,
 * L = 1 and 8, q4 and bf16: 8/4/256 over --cp-N / 8 tokens at B = 1 and
 * 32/8/128 over --P tokens at B = --B; the outputs must be bit-identical.
 * Exit status 1 when a call fails or the outputs differ by more than 2^-6. */
#include "kvattn.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef KVA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}
static uint64_t rs = 88172645463325252ull;
static float rnd(void) {
  rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
  return (float)(rs >> 40) / (float)(1 << 24) * 2.0f - 1.0f;
}
static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static double median(double *t, int n) {
  qsort(t, (size_t)n, sizeof *t, cmp_double);
  return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

typedef struct opts {
  int cuda, threads, hot, merge, cascade, reps, merge_iters;
  int64_t P, S, B;
  size_t flush_bytes;
  int shapes, formats; /* bit masks: 1 = 8/4/256, 2 = 32/8/128; 1 = q4, 2 = bf16 */
  int cp;              /* also the context-parallel bench */
  int64_t cp_N;
  int lse;             /* also the lse-overhead bench */
} opts;

/* ------------------------------------------------------------ memory */
/* Host or device buffer of n bytes (device when o->cuda); NULL on failure. */
static void *buf_alloc(const opts *o, size_t n) {
#ifdef KVA_HAVE_CUDA
  if (o->cuda) {
    void *p = NULL;
    return cudaMalloc(&p, n ? n : 1) == cudaSuccess ? p : NULL;
  }
#endif
  (void)o;
  return malloc(n ? n : 1);
}
static void buf_free(const opts *o, void *p) {
#ifdef KVA_HAVE_CUDA
  if (o->cuda) {
    cudaFree(p);
    return;
  }
#endif
  (void)o;
  free(p);
}
static int buf_upload(const opts *o, void *dst, const void *src, size_t n) {
#ifdef KVA_HAVE_CUDA
  if (o->cuda) return cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice) == cudaSuccess ? 0 : -1;
#endif
  (void)o;
  memcpy(dst, src, n);
  return 0;
}
static int buf_download(const opts *o, void *dst, const void *src, size_t n) {
#ifdef KVA_HAVE_CUDA
  if (o->cuda) return cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost) == cudaSuccess ? 0 : -1;
#endif
  (void)o;
  memcpy(dst, src, n);
  return 0;
}

/* One K or V cache [B, KVH, N, D] in host memory: bf16 rows (bits 0) or q4
 * g64 with bf16 scales; arrays[0..2] = data, scales, biases. */
typedef struct cache {
  kva_kv kv;
  void *arr[3];
  size_t row_bytes[3], bytes[3];
  int64_t B, KVH, N;
} cache;

static int cache_alloc(cache *c, int64_t B, int64_t KVH, int64_t N, int64_t D, int bits) {
  memset(c, 0, sizeof *c);
  c->B = B, c->KVH = KVH, c->N = N;
  const int64_t rows = B * KVH * N;
  c->row_bytes[0] = bits ? (size_t)(D * bits / 8) : (size_t)D * 2;
  c->row_bytes[1] = c->row_bytes[2] = bits ? (size_t)(D / 64) * 2 : 0;
  for (int a = 0; a < (bits ? 3 : 1); ++a) {
    c->bytes[a] = c->row_bytes[a] * (size_t)rows;
    if (!(c->arr[a] = malloc(c->bytes[a]))) return -1;
  }
  c->kv = bits ? kva_kv_quantized(c->arr[0], c->arr[1], c->arr[2], KVA_BF16, bits, 64, B, KVH, N, D)
               : kva_kv_float(c->arr[0], KVA_BF16, B, KVH, N, D);
  return 0;
}
static void cache_free(cache *c) {
  for (int a = 0; a < 3; ++a) free(c->arr[a]);
}
/* Random rows, written FILL_ROWS rows at a time (quantized through f32). */
#define FILL_ROWS 65536
static int cache_fill(cache *c, int64_t D) {
  float *f = malloc(sizeof(float) * (size_t)(FILL_ROWS * D));
  if (!f) return -1;
  const int64_t rows = c->B * c->KVH * c->N;
  for (int64_t r0 = 0; r0 < rows; r0 += FILL_ROWS) {
    const int64_t n = rows - r0 < FILL_ROWS ? rows - r0 : FILL_ROWS;
    for (int64_t i = 0; i < n * D; ++i) f[i] = rnd();
    if (!c->kv.bits) {
      uint16_t *dst = (uint16_t *)c->arr[0] + r0 * D;
      for (int64_t i = 0; i < n * D; ++i) dst[i] = kva_f32_to_bf16(f[i]);
      continue;
    }
    kva_kv s = kva_kv_quantized((char *)c->arr[0] + r0 * c->row_bytes[0], (char *)c->arr[1] + r0 * c->row_bytes[1],
                                (char *)c->arr[2] + r0 * c->row_bytes[2], KVA_BF16, c->kv.bits, 64, 1, 1, n, D);
    const kva_tensor t = kva_tensor_4d(f, KVA_F32, 1, 1, n, D);
    if (kva_quantize(&t, &s)) {
      free(f);
      return -1;
    }
  }
  free(f);
  return 0;
}
/* full (b, h) = prefix (0, h) rows then suffix (b, h) rows, bit for bit. */
static void cache_concat(cache *full, const cache *pre, const cache *suf) {
  for (int a = 0; a < 3; ++a) {
    if (!full->arr[a]) continue;
    const size_t rb = full->row_bytes[a];
    for (int64_t b = 0; b < full->B; ++b)
      for (int64_t h = 0; h < full->KVH; ++h) {
        char *dst = (char *)full->arr[a] + (size_t)((b * full->KVH + h) * full->N) * rb;
        memcpy(dst, (const char *)pre->arr[a] + (size_t)(h * pre->N) * rb, (size_t)pre->N * rb);
        memcpy(dst + (size_t)pre->N * rb, (const char *)suf->arr[a] + (size_t)((b * suf->KVH + h) * suf->N) * rb,
               (size_t)suf->N * rb);
      }
  }
}
/* The cache in the backend's memory: the host arrays themselves on the CPU;
 * on CUDA device copies (dev[] to free). */
static int cache_place(const opts *o, const cache *c, kva_kv *kv, void *dev[3]) {
  *kv = c->kv;
  kva_tensor *ts[3] = {&kv->data, &kv->scales, &kv->biases};
  for (int a = 0; a < 3; ++a) {
    dev[a] = NULL;
    if (!c->arr[a] || !o->cuda) continue;
    if (!(dev[a] = buf_alloc(o, c->bytes[a])) || buf_upload(o, dev[a], c->arr[a], c->bytes[a])) return -1;
    ts[a]->data = dev[a];
  }
  return 0;
}

/* ----------------------------------------------------------- timing */
typedef struct timer {
  const opts *o;
  void *flush;
#ifdef KVA_HAVE_CUDA
  cudaStream_t s;
  cudaEvent_t e0, e1;
#endif
  double t0;
} timer;

static int timer_init(timer *t, const opts *o, kva_context *ctx) {
  memset(t, 0, sizeof *t);
  t->o = o;
  if (!o->hot && !(t->flush = buf_alloc(o, o->flush_bytes))) return -1;
#ifdef KVA_HAVE_CUDA
  if (o->cuda && (cudaStreamCreate(&t->s) != cudaSuccess || cudaEventCreate(&t->e0) != cudaSuccess ||
                  cudaEventCreate(&t->e1) != cudaSuccess || kva_context_set_stream(ctx, t->s)))
    return -1;
#endif
  (void)ctx;
  return 0;
}
static void timer_free(timer *t, kva_context *ctx) {
  if (t->flush) buf_free(t->o, t->flush);
#ifdef KVA_HAVE_CUDA
  if (t->o->cuda) {
    kva_context_set_stream(ctx, NULL);
    cudaEventDestroy(t->e0), cudaEventDestroy(t->e1), cudaStreamDestroy(t->s);
  }
#endif
  (void)ctx;
}
/* Evicts the caches (cold runs), then starts the clock. */
static void timer_start(timer *t, unsigned char fill) {
#ifdef KVA_HAVE_CUDA
  if (t->o->cuda) {
    if (t->flush) cudaMemsetAsync(t->flush, fill, t->o->flush_bytes, t->s);
    cudaEventRecord(t->e0, t->s);
    return;
  }
#endif
  if (t->flush) memset(t->flush, fill, t->o->flush_bytes);
  t->t0 = now();
}
/* Seconds since timer_start (waits for the device). */
static double timer_stop(timer *t) {
#ifdef KVA_HAVE_CUDA
  if (t->o->cuda) {
    float ms = 0;
    cudaEventRecord(t->e1, t->s);
    if (cudaEventSynchronize(t->e1) != cudaSuccess || cudaEventElapsedTime(&ms, t->e0, t->e1) != cudaSuccess)
      return NAN;
    return ms * 1e-3;
  }
#endif
  return now() - t->t0;
}

/* ----------------------------------------------------------- cascade */
static int run_cascade(const opts *o, kva_context *ctx, int64_t H, int64_t KVH, int64_t D, int bits) {
  const int64_t B = o->B, P = o->P, S = o->S, L = 1, T = P + S;
  int ok = 0;
  cache src[2][3]; /* K, V x prefix [1, KVH, P, D], suffix [B, KVH, S, D], full [B, KVH, T, D] */
  memset(src, 0, sizeof src);
  kva_kv kv[2][3];
  void *dev[2][3][3];
  memset(dev, 0, sizeof dev);
  void *dq = NULL, *dob = NULL, *doc = NULL;
  float *ob = NULL, *oc = NULL;
  timer tm;
  memset(&tm, 0, sizeof tm);
  for (int x = 0; x < 2; ++x) {
    if (cache_alloc(&src[x][0], 1, KVH, P, D, bits) || cache_alloc(&src[x][1], B, KVH, S, D, bits) ||
        cache_alloc(&src[x][2], B, KVH, T, D, bits) || cache_fill(&src[x][0], D) || cache_fill(&src[x][1], D)) {
      fprintf(stderr, "cascade: operands: %s\n", kva_last_error());
      goto done;
    }
    cache_concat(&src[x][2], &src[x][0], &src[x][1]);
    for (int i = 0; i < 3; ++i)
      if (cache_place(o, &src[x][i], &kv[x][i], dev[x][i])) {
        fprintf(stderr, "cascade: could not place the caches in the backend's memory\n");
        goto done;
      }
  }
  const size_t nq = (size_t)(B * H * L * D);
  uint16_t *hq = malloc(nq * 2);
  ob = malloc(nq * 4), oc = malloc(nq * 4);
  if (!hq || !ob || !oc) goto done;
  for (size_t i = 0; i < nq; ++i) hq[i] = kva_f32_to_bf16(rnd());
  dq = buf_alloc(o, nq * 2), dob = buf_alloc(o, nq * 4), doc = buf_alloc(o, nq * 4);
  if (!dq || !dob || !doc || buf_upload(o, dq, hq, nq * 2)) {
    free(hq);
    goto done;
  }
  free(hq);
  kva_tensor tq = kva_tensor_4d(dq, KVA_BF16, B, H, L, D);
  kva_tensor tb = kva_tensor_4d(dob, KVA_F32, B, H, L, D), tc = kva_tensor_4d(doc, KVA_F32, B, H, L, D);
  const kva_kv_view full = kva_view_contiguous(&kv[0][2], &kv[1][2], NULL);
  const kva_kv_view prefix = kva_view_contiguous(&kv[0][0], &kv[1][0], NULL);
  const kva_kv_view suffix = kva_view_contiguous(&kv[0][1], &kv[1][1], NULL);
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = KVA_MASK_CAUSAL;
  /* kernels: the batched call, the stacked prefix rows (B L <= 256: one call, as the cascade makes it) */
  char kb[200] = "?", kp[200] = "?";
  kva_tensor qs = tq, os = kva_tensor_4d(doc, KVA_F32, 1, H, B * L < 256 ? B * L : 256, D);
  qs.shape[0] = 1, qs.shape[2] = os.shape[2], qs.stride[2] = tq.stride[0];
  kva_tensor op = os; /* the prefix pass alone writes tb's buffer */
  op.data = dob;
  kva_attn_params pp = p;
  pp.mask.kind = KVA_MASK_NONE;
  kva_attention_kernel(ctx, &tq, &full, &p, &tb, kb, sizeof kb);
  kva_attention_kernel(ctx, &qs, &prefix, &pp, &os, kp, sizeof kp);
  if (timer_init(&tm, o, ctx)) {
    fprintf(stderr, "cascade: timer (flush buffer of %zu bytes, stream)\n", o->flush_bytes);
    goto done;
  }
  double *t_b = malloc(sizeof(double) * (size_t)o->reps * 4), *t_c = t_b + o->reps, *t_p = t_c + o->reps,
         *t_s = t_p + o->reps;
  if (!t_b) goto done;
  for (int r = 0; r <= o->reps; ++r) { /* call 0: warm-up (workspaces) */
    timer_start(&tm, (unsigned char)r);
    if (kva_attention(ctx, &tq, &full, &p, &tb, NULL, 0)) goto fail;
    const double tbat = timer_stop(&tm);
    timer_start(&tm, (unsigned char)(r + 1));
    if (kva_cascade_attention(ctx, &tq, &prefix, &suffix, &p, &tc, NULL, 0, NULL, 0)) goto fail;
    const double tcas = timer_stop(&tm);
    /* the cascade's two passes alone (into tb; the batched call rewrites it): the prefix rows as one call, the suffixes */
    timer_start(&tm, (unsigned char)(r + 2));
    if (B * L <= 256 && kva_attention(ctx, &qs, &prefix, &pp, &op, NULL, 0)) goto fail;
    const double tpre = timer_stop(&tm);
    timer_start(&tm, (unsigned char)(r + 3));
    if (kva_attention(ctx, &tq, &suffix, &p, &tb, NULL, 0)) goto fail;
    const double tsuf = timer_stop(&tm);
    if (r > 0) t_b[r - 1] = tbat, t_c[r - 1] = tcas, t_p[r - 1] = tpre, t_s[r - 1] = tsuf;
  }
  if (kva_attention(ctx, &tq, &full, &p, &tb, NULL, 0)) goto fail;
  const double mb = median(t_b, o->reps), mc = median(t_c, o->reps), mp = median(t_p, o->reps),
               ms = median(t_s, o->reps);
  free(t_b);
  if (buf_download(o, ob, dob, nq * 4) || buf_download(o, oc, doc, nq * 4)) goto done;
  double diff = 0, mx = 0;
  for (size_t i = 0; i < nq; ++i) diff = fmax(diff, fabs((double)ob[i] - oc[i])), mx = fmax(mx, fabs((double)ob[i]));
  const double kv_row = (double)(src[0][0].row_bytes[0] + src[0][0].row_bytes[1] + src[0][0].row_bytes[2]) * 2;
  const double bytes_b = (double)(B * T * KVH) * kv_row, bytes_c = (double)((P + B * S) * KVH) * kv_row;
  printf("%s B=%lld %lld/%lld/%lld %s, prefix %lld + %lld own tokens, L=1 bf16 q, %s, median of %d: batched %.3f ms "
         "(%.1f GB/s), cascade %.3f ms (%.1f GB/s of its own bytes): %.2fx (outputs differ by %.2e of max|out|)\n",
         o->cuda ? "cuda" : "cpu", (long long)B, (long long)H, (long long)KVH, (long long)D,
         bits ? "q4 g64" : "bf16", (long long)P, (long long)S, o->hot ? "hot" : "cold", o->reps, mb * 1e3,
         bytes_b / mb * 1e-9, mc * 1e3, bytes_c / mc * 1e-9, mb / mc, mx > 0 ? diff / mx : diff);
  printf("    batched: %s\n    cascade prefix pass: %s\n    alone: prefix pass %.3f ms, suffix pass %.3f ms\n", kb, kp,
         mp * 1e3, ms * 1e3);
  fflush(stdout);
  ok = mx > 0 && diff / mx < 1.0 / 64;
  if (!ok) fprintf(stderr, "cascade: outputs differ by %.3g of max|out|\n", mx > 0 ? diff / mx : diff);
  goto done;
fail:
  fprintf(stderr, "cascade: %s\n", kva_last_error());
done:
  timer_free(&tm, ctx);
  for (int x = 0; x < 2; ++x)
    for (int i = 0; i < 3; ++i) {
      for (int a = 0; a < 3; ++a)
        if (dev[x][i][a]) buf_free(o, dev[x][i][a]);
      cache_free(&src[x][i]);
    }
  if (dq) buf_free(o, dq);
  if (dob) buf_free(o, dob);
  if (doc) buf_free(o, doc);
  free(ob), free(oc);
  return ok;
}

/* ------------------------------------------------------------- merge */
static int run_merge(const opts *o, kva_context *ctx) {
  enum { RMAX = 8, DV = 128 };
  static const int64_t shapes[2][2] = {{1, 8}, {16, 32}}; /* B, H */
  int ok = 1;
  timer tm;
  opts oh = *o;
  oh.hot = 1;
  if (timer_init(&tm, &oh, ctx)) return 0;
  for (int si = 0; si < 2 && ok; ++si) {
    const int64_t B = shapes[si][0], H = shapes[si][1], n = B * H * DV;
    void *po[RMAX], *pl[RMAX], *out = buf_alloc(o, (size_t)n * 4), *lo = buf_alloc(o, (size_t)(B * H) * 4);
    kva_tensor to[RMAX], tl[RMAX];
    float *h = malloc(sizeof(float) * (size_t)n);
    int made = out && lo && h;
    for (int r = 0; r < RMAX; ++r) {
      po[r] = made ? buf_alloc(o, (size_t)n * 4) : NULL;
      pl[r] = made ? buf_alloc(o, (size_t)(B * H) * 4) : NULL;
      made = made && po[r] && pl[r];
      if (!made) continue;
      for (int64_t i = 0; i < n; ++i) h[i] = rnd();
      made = !buf_upload(o, po[r], h, (size_t)n * 4);
      for (int64_t i = 0; i < B * H; ++i) h[i] = 4.0f * rnd();
      made = made && !buf_upload(o, pl[r], h, (size_t)(B * H) * 4);
      to[r] = kva_tensor_4d(po[r], KVA_F32, B, H, 1, DV);
      tl[r] = kva_tensor_4d(pl[r], KVA_F32, B, H, 1, 1);
      tl[r].ndim = 3, tl[r].shape[3] = 0, tl[r].stride[3] = 0;
    }
    if (made) {
      kva_tensor tout = kva_tensor_4d(out, KVA_F32, B, H, 1, DV), tlo = kva_tensor_4d(lo, KVA_F32, B, H, 1, 1);
      tlo.ndim = 3, tlo.shape[3] = 0, tlo.stride[3] = 0;
      printf("%s merge B*H=%lld (%lldx%lld) L=1 Dv=%d f32, hot, mean of %d calls:", o->cuda ? "cuda" : "cpu",
             (long long)(B * H), (long long)B, (long long)H, DV, o->merge_iters);
      for (int R = 2; R <= RMAX && ok; ++R) {
        ok = !kva_merge_states(ctx, R, to, tl, &tout, &tlo, 0); /* warm-up */
        timer_start(&tm, 0);
        for (int it = 0; it < o->merge_iters && ok; ++it) ok = !kva_merge_states(ctx, R, to, tl, &tout, &tlo, 0);
        const double t = timer_stop(&tm);
        if (ok) printf(" R=%d %.2f us%s", R, t / o->merge_iters * 1e6, R < RMAX ? "," : "\n");
      }
      if (!ok) fprintf(stderr, "merge: %s\n", kva_last_error());
    } else {
      fprintf(stderr, "merge: could not allocate the parts\n");
      ok = 0;
    }
    for (int r = 0; r < RMAX; ++r) {
      if (po[r]) buf_free(o, po[r]);
      if (pl[r]) buf_free(o, pl[r]);
    }
    if (out) buf_free(o, out);
    if (lo) buf_free(o, lo);
    free(h);
  }
  fflush(stdout);
  timer_free(&tm, ctx);
  return ok;
}

/* --------------------------------------------- context parallelism */
/* One sequence of cp_N tokens, q4 g64, B = 1, L = 1, bf16 q, causal: the
 * unsharded call, then for R = 2, 4, 8 the shard holding the query row's
 * own tokens (the last N / R: kva_cp_attend, causal) and the merge of R
 * parts (kva_cp_merge, all-gather: every rank all heads), cold as the
 * cascade; the exchange is not timed (its bytes are printed). */
static int run_cp(const opts *o, kva_context *ctx, int64_t H, int64_t KVH, int64_t D) {
  const int64_t N = o->cp_N, L = 1;
  cache ck, cv;
  memset(&ck, 0, sizeof ck), memset(&cv, 0, sizeof cv);
  kva_kv k, v;
  void *dk[3] = {0}, *dv[3] = {0}, *dq = NULL, *dout = NULL, *send = NULL, *recv = NULL;
  double *t = malloc(sizeof(double) * (size_t)o->reps);
  uint16_t *hq = malloc(sizeof(uint16_t) * (size_t)(H * D));
  int ok = 0;
  timer tm;
  memset(&tm, 0, sizeof tm);
  if (!t || !hq || cache_alloc(&ck, 1, KVH, N, D, 4) || cache_alloc(&cv, 1, KVH, N, D, 4) || cache_fill(&ck, D) ||
      cache_fill(&cv, D) || cache_place(o, &ck, &k, dk) || cache_place(o, &cv, &v, dv)) {
    fprintf(stderr, "cp: operands: %s\n", kva_last_error());
    goto done;
  }
  for (int64_t i = 0; i < H * D; ++i) hq[i] = kva_f32_to_bf16(rnd());
  kva_cp_plan big;
  if (kva_cp_plan_init(&big, 8, 7, 0, 1, H, L, D, 0)) goto fail;
  dq = buf_alloc(o, (size_t)(H * D) * 2), dout = buf_alloc(o, (size_t)(H * D) * 4);
  send = buf_alloc(o, big.send_bytes), recv = buf_alloc(o, big.recv_bytes);
  if (!dq || !dout || !send || !recv || buf_upload(o, dq, hq, (size_t)(H * D) * 2) || timer_init(&tm, o, ctx)) goto done;
  const kva_tensor q = kva_tensor_4d(dq, KVA_BF16, 1, H, L, D);
  kva_tensor out = kva_tensor_4d(dout, KVA_F32, 1, H, L, D);
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = KVA_MASK_CAUSAL;
  const kva_kv_view full = kva_view_contiguous(&k, &v, NULL);
  for (int r = 0; r <= o->reps; ++r) {
    timer_start(&tm, (unsigned char)r);
    if (kva_attention(ctx, &q, &full, &p, &out, NULL, 0)) goto fail;
    const double x = timer_stop(&tm);
    if (r) t[r - 1] = x;
  }
  const double t1 = median(t, o->reps);
  printf("%s cp q4 g64 %lld/%lld/%lld B=1 L=1 bf16 q, %lld tokens, %s, median of %d: unsharded %.3f ms\n",
         o->cuda ? "cuda" : "cpu", (long long)H, (long long)KVH, (long long)D, (long long)N, o->hot ? "hot" : "cold",
         o->reps, t1 * 1e3);
  for (int64_t R = 2; R <= 8; R *= 2) {
    kva_cp_plan plan;
    if (kva_cp_plan_init(&plan, R, R - 1, 0, 1, H, L, D, 0)) goto fail;
    const int64_t t0 = N - N / R;
    kva_kv sk = k, sv = v;
    kva_tensor *ts[6] = {&sk.data, &sk.scales, &sk.biases, &sv.data, &sv.scales, &sv.biases};
    for (int a = 0; a < 6; ++a) ts[a]->data = (char *)ts[a]->data + t0 * ts[a]->stride[2], ts[a]->shape[2] = N - t0;
    const kva_kv_view shard = kva_view_contiguous(&sk, &sv, NULL);
    for (int r = 0; r <= o->reps; ++r) {
      timer_start(&tm, (unsigned char)r);
      if (kva_cp_attend(ctx, &plan, &q, &shard, &p, send, plan.send_bytes, NULL, 0)) goto fail;
      const double x = timer_stop(&tm);
      if (r) t[r - 1] = x;
    }
    const double ts_ = median(t, o->reps);
    /* the merge over R copies of this part (hot: the parts are what the exchange just wrote) */
    for (int64_t s2 = 0; s2 < R; ++s2) {
#ifdef KVA_HAVE_CUDA
      if (o->cuda) {
        cudaMemcpy((char *)recv + s2 * plan.o_bytes, send, plan.o_bytes, cudaMemcpyDeviceToDevice);
        cudaMemcpy((char *)recv + plan.recv_lse_offset + s2 * plan.lse_bytes, (char *)send + plan.send_lse_offset,
                   plan.lse_bytes, cudaMemcpyDeviceToDevice);
        continue;
      }
#endif
      memcpy((char *)recv + s2 * plan.o_bytes, send, plan.o_bytes);
      memcpy((char *)recv + plan.recv_lse_offset + s2 * plan.lse_bytes, (char *)send + plan.send_lse_offset,
             plan.lse_bytes);
    }
    const int iters = o->merge_iters;
    if (kva_cp_merge(ctx, &plan, recv, plan.recv_bytes, &out, NULL)) goto fail;
    opts oh = *o;
    oh.hot = 1;
    timer th = tm;
    th.o = &oh, th.flush = NULL;
    timer_start(&th, 0);
    for (int i = 0; i < iters; ++i)
      if (kva_cp_merge(ctx, &plan, recv, plan.recv_bytes, &out, NULL)) goto fail;
    const double tmg = timer_stop(&th) / iters;
    const double xbytes = (double)(R - 1) * (double)(plan.o_bytes + plan.lse_bytes);
    printf("    R=%lld: shard of %lld tokens %.3f ms, merge %.1f us, exchange per rank %.1f KB in (all-gather; by head: "
           "%.1f KB each way): implied speedup %.2fx (exchange not timed)\n",
           (long long)R, (long long)(N - t0), ts_ * 1e3, tmg * 1e6, xbytes / 1024,
           xbytes / (double)R / 1024, t1 / (ts_ + tmg));
  }
  fflush(stdout);
  ok = 1;
  goto done;
fail:
  fprintf(stderr, "cp: %s\n", kva_last_error());
done:
  timer_free(&tm, ctx);
  for (int a = 0; a < 3; ++a) {
    if (dk[a]) buf_free(o, dk[a]);
    if (dv[a]) buf_free(o, dv[a]);
  }
  if (dq) buf_free(o, dq);
  if (dout) buf_free(o, dout);
  if (send) buf_free(o, send);
  if (recv) buf_free(o, recv);
  cache_free(&ck), cache_free(&cv);
  free(t), free(hq);
  return ok;
}

/* ------------------------------------------------------------- lse */
/* kva_attention against kva_attention_lse (lse [B, H, L] f32) on one case,
 * alternated, cold: the time the lse output costs. The outputs must be bit
 * for bit the same (the same kernel runs). */
static int run_lse(const opts *o, kva_context *ctx, int64_t H, int64_t KVH, int64_t D, int bits, int64_t N,
                   int64_t B, int64_t L) {
  cache ck, cv;
  memset(&ck, 0, sizeof ck), memset(&cv, 0, sizeof cv);
  kva_kv k, v;
  void *dk[3] = {0}, *dv[3] = {0}, *dq = NULL, *do0 = NULL, *do1 = NULL, *dl = NULL;
  const size_t nq = (size_t)(B * H * L * D), nl = (size_t)(B * H * L);
  double *t0 = malloc(sizeof(double) * (size_t)o->reps), *t1 = malloc(sizeof(double) * (size_t)o->reps);
  uint16_t *hq = malloc(nq * 2), *h0 = malloc(nq * 2), *h1 = malloc(nq * 2);
  int ok = 0;
  timer tm;
  memset(&tm, 0, sizeof tm);
  if (!t0 || !t1 || !hq || !h0 || !h1 || cache_alloc(&ck, B, KVH, N, D, bits) || cache_alloc(&cv, B, KVH, N, D, bits) ||
      cache_fill(&ck, D) || cache_fill(&cv, D) || cache_place(o, &ck, &k, dk) || cache_place(o, &cv, &v, dv)) {
    fprintf(stderr, "lse: operands: %s\n", kva_last_error());
    goto done;
  }
  for (size_t i = 0; i < nq; ++i) hq[i] = kva_f32_to_bf16(rnd());
  dq = buf_alloc(o, nq * 2), do0 = buf_alloc(o, nq * 2), do1 = buf_alloc(o, nq * 2), dl = buf_alloc(o, nl * 4);
  if (!dq || !do0 || !do1 || !dl || buf_upload(o, dq, hq, nq * 2) || timer_init(&tm, o, ctx)) goto done;
  const kva_tensor q = kva_tensor_4d(dq, KVA_BF16, B, H, L, D);
  kva_tensor out0 = kva_tensor_4d(do0, KVA_BF16, B, H, L, D), out1 = kva_tensor_4d(do1, KVA_BF16, B, H, L, D);
  kva_tensor lse = kva_tensor_4d(dl, KVA_F32, 1, B, H, L);
  lse.ndim = 3;
  for (int d = 0; d < 3; ++d) lse.shape[d] = lse.shape[d + 1], lse.stride[d] = lse.stride[d + 1];
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = KVA_MASK_CAUSAL;
  const kva_kv_view view = kva_view_contiguous(&k, &v, NULL);
  char kn[200] = "?";
  kva_attention_kernel(ctx, &q, &view, &p, &out0, kn, sizeof kn);
  for (int r = 0; r <= o->reps; ++r) { /* call 0: warm-up */
    timer_start(&tm, (unsigned char)r);
    if (kva_attention(ctx, &q, &view, &p, &out0, NULL, 0)) goto fail;
    const double a = timer_stop(&tm);
    timer_start(&tm, (unsigned char)(r + 1));
    if (kva_attention_lse(ctx, &q, &view, &p, &out1, &lse, 0, NULL, 0)) goto fail;
    const double b = timer_stop(&tm);
    if (r) t0[r - 1] = a, t1[r - 1] = b;
  }
  const double m0 = median(t0, o->reps), m1 = median(t1, o->reps);
  if (buf_download(o, h0, do0, nq * 2) || buf_download(o, h1, do1, nq * 2)) goto done;
  const int same = !memcmp(h0, h1, nq * 2);
  printf("%s lse %lld/%lld/%lld %s N=%lld B=%lld L=%lld, %s, median of %d: out %.1f us, out+lse %.1f us: %+.1f %% "
         "(outputs %s)\n    kernel: %s\n",
         o->cuda ? "cuda" : "cpu", (long long)H, (long long)KVH, (long long)D, bits ? "q4 g64" : "bf16", (long long)N,
         (long long)B, (long long)L, o->hot ? "hot" : "cold", o->reps, m0 * 1e6, m1 * 1e6, 100.0 * (m1 / m0 - 1),
         same ? "bit-identical" : "DIFFER", kn);
  fflush(stdout);
  ok = same;
  goto done;
fail:
  fprintf(stderr, "lse: %s\n", kva_last_error());
done:
  timer_free(&tm, ctx);
  for (int a = 0; a < 3; ++a) {
    if (dk[a]) buf_free(o, dk[a]);
    if (dv[a]) buf_free(o, dv[a]);
  }
  void *bufs[4] = {dq, do0, do1, dl};
  for (int i = 0; i < 4; ++i)
    if (bufs[i]) buf_free(o, bufs[i]);
  cache_free(&ck), cache_free(&cv);
  free(t0), free(t1), free(hq), free(h0), free(h1);
  return ok;
}

static int usage(void) {
  fprintf(stderr, "usage: cascade_vs_batched [--backend cpu|cuda] [--threads T] [--shape 8/4/256|32/8/128|all] "
                  "[--format q4|bf16|all] [--P N] [--S N] [--B N] [--reps N] [--hot] [--flush-mb MB] "
                  "[--merge-only | --no-merge] [--merge-iters N] [--cp | --cp-only] [--cp-N tokens] [--lse | --lse-only]\n");
  return 2;
}

int main(int argc, char **argv) {
  opts o = {0, 0, 0, 1, 1, 5, 2000, 32768, 1024, 16, (size_t)1024 << 20, 3, 3, 0, 1 << 20, 0};
  int flush_set = 0;
  for (int i = 1; i < argc; ++i) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--hot")) o.hot = 1;
    else if (!strcmp(a, "--merge-only")) o.cascade = 0;
    else if (!strcmp(a, "--no-merge")) o.merge = 0;
    else if (!strcmp(a, "--cp")) o.cp = 1;
    else if (!strcmp(a, "--cp-only")) o.cp = 1, o.cascade = 0, o.merge = 0;
    else if (!strcmp(a, "--lse")) o.lse = 1;
    else if (!strcmp(a, "--lse-only")) o.lse = 1, o.cascade = 0, o.merge = 0;
    else if (!v) return usage();
    else if (++i, !strcmp(a, "--backend")) {
      if (strcmp(v, "cpu") && strcmp(v, "cuda")) return usage();
      o.cuda = !strcmp(v, "cuda");
    } else if (!strcmp(a, "--threads")) o.threads = atoi(v);
    else if (!strcmp(a, "--shape"))
      o.shapes = !strcmp(v, "8/4/256") ? 1 : !strcmp(v, "32/8/128") ? 2 : !strcmp(v, "all") ? 3 : 0;
    else if (!strcmp(a, "--format"))
      o.formats = !strcmp(v, "q4") ? 1 : !strcmp(v, "bf16") ? 2 : !strcmp(v, "all") ? 3 : 0;
    else if (!strcmp(a, "--P")) o.P = atoll(v);
    else if (!strcmp(a, "--S")) o.S = atoll(v);
    else if (!strcmp(a, "--B")) o.B = atoll(v);
    else if (!strcmp(a, "--reps")) o.reps = atoi(v);
    else if (!strcmp(a, "--flush-mb")) o.flush_bytes = (size_t)atoll(v) << 20, flush_set = 1;
    else if (!strcmp(a, "--merge-iters")) o.merge_iters = atoi(v);
    else if (!strcmp(a, "--cp-N")) o.cp_N = atoll(v);
    else return usage();
  }
  if (o.P < 1 || o.S < 1 || o.B < 1 || o.reps < 1 || o.threads < 0 || !o.shapes || !o.formats || o.merge_iters < 1 ||
      (!o.hot && !o.flush_bytes))
    return usage();
  if (o.cuda && !flush_set) o.flush_bytes = (size_t)512 << 20; /* 10x the H200's 50 MB L2 */
#ifndef KVA_HAVE_CUDA
  if (o.cuda) {
    fprintf(stderr, "built without CUDA\n");
    return 1;
  }
#endif
  kva_context *ctx;
  const kva_context_opts co = {o.cuda ? KVA_BACKEND_CUDA : KVA_BACKEND_CPU, o.threads, 0, NULL};
  if (kva_context_create(&ctx, &co)) {
    fprintf(stderr, "context: %s\n", kva_last_error());
    return 1;
  }
  if (!o.cuda) printf("cpu: %d threads, %s\n", kva_context_threads(ctx), kva_cpu_simd());
  static const int64_t shapes[2][3] = {{8, 4, 256}, {32, 8, 128}};
  int ok = 1;
  for (int s = 0; s < 2 && o.cascade; ++s)
    for (int f = 0; f < 2; ++f)
      if ((o.shapes >> s & 1) && (o.formats >> f & 1))
        ok &= run_cascade(&o, ctx, shapes[s][0], shapes[s][1], shapes[s][2], f == 0 ? 4 : 0);
  if (o.merge) ok &= run_merge(&o, ctx);
  static const int64_t cp_shapes[2][3] = {{8, 4, 256}, {24, 4, 256}};
  for (int s = 0; s < 2 && o.cp; ++s) ok &= run_cp(&o, ctx, cp_shapes[s][0], cp_shapes[s][1], cp_shapes[s][2]);
  /* lse: decode and verify, q4 and bf16: 8/4/256 at --cp-N / 8 tokens (B = 1),
   * 32/8/128 at --P tokens (B = --B) */
  for (int s = 0; s < 2 && o.lse; ++s)
    for (int f = 0; f < 2; ++f)
      for (int64_t L = 1; L <= 8; L += 7)
        if ((o.shapes >> s & 1) && (o.formats >> f & 1))
          ok &= run_lse(&o, ctx, shapes[s][0], shapes[s][1], shapes[s][2], f == 0 ? 4 : 0, s ? o.P : o.cp_N / 8,
                        s ? o.B : 1, L);
  kva_context_destroy(ctx);
  return ok ? 0 : 1;
}
