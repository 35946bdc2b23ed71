/* Paged vs contiguous, side by side in one run (`make bench-paged`):
 * interleaved cold-cache calls (each call on the next of copies rotated over
 * > 1.1 GiB) of the same shapes on a contiguous cache and on paged pools of
 * block 16 and 64 (blocks shuffled), 2 threads, median of `reps` calls; and a
 * ragged batch of 8 sequences (1k..32k) decoded in one paged call (pools of
 * block 16, then 64) vs the same sequences one by one on contiguous caches. Ratios are contiguous /
 * paged (above 1: paged faster), of the medians and, in brackets, the
 * median of the per-rep ratios (calls timed next to each other: steadier
 * on a shared host whose speed drifts during a run).
 * Usage: paged_vs_contiguous [reps=21] [all|decode|verify|ragged] */
#include "kvattn.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}
static uint64_t rs = 88172645463325252ull;
static uint32_t rnd(void) { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (uint32_t)rs; }
static int cmpd(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }
/* Median of num[r] / den[r] over reps (before num and den are sorted). */
static double paired(const double *num, const double *den, int reps) {
  double *q = malloc(sizeof(double) * reps), m;
  for (int r = 0; r < reps; ++r) q[r] = num[r] / den[r];
  qsort(q, reps, sizeof(double), cmpd);
  m = q[reps / 2];
  free(q);
  return m;
}

typedef struct cache { kva_kv k, v; void *mem[6]; } cache;

static void fill16(uint16_t *p, size_t n, float lo, float hi) {
  for (size_t i = 0; i < n; ++i) p[i] = kva_f32_to_bf16(lo + (hi - lo) * (rnd() >> 8) * (1.0f / 16777216.0f));
}

/* B=1 contiguous cache [1, KVH, N, D], q4 g64 bf16 scales or bf16 float. */
static void make_cache(cache *c, int bits, int KVH, int64_t N, int D) {
  memset(c, 0, sizeof *c);
  size_t rows = (size_t)KVH * N;
  for (int w = 0; w < 2; ++w) {
    kva_kv *kv = w ? &c->v : &c->k;
    if (bits) {
      size_t words = rows * D * bits / 32, groups = rows * D / 64;
      uint32_t *p = malloc(words * 4);
      for (size_t i = 0; i < words; ++i) p[i] = rnd();
      uint16_t *s = malloc(groups * 2), *b = malloc(groups * 2);
      fill16(s, groups, 0.01f, 0.1f);
      fill16(b, groups, -0.5f, 0.5f);
      c->mem[w * 3] = p; c->mem[w * 3 + 1] = s; c->mem[w * 3 + 2] = b;
      *kv = kva_kv_quantized(p, s, b, KVA_BF16, bits, 64, 1, KVH, N, D);
    } else {
      uint16_t *p = malloc(rows * D * 2);
      fill16(p, rows * D, -1, 1);
      c->mem[w * 3] = p;
      *kv = kva_kv_float(p, KVA_BF16, 1, KVH, N, D);
    }
  }
}
static void free_cache(cache *c) { for (int i = 0; i < 6; ++i) free(c->mem[i]); }
static size_t cache_bytes(int bits, int KVH, int64_t N, int D) {
  size_t rows = (size_t)KVH * N;
  return 2 * (bits ? rows * D * bits / 8 + rows * D / 64 * 4 : rows * D * 2);
}

#define MAXC 64
static void run_case(kva_context *ctx, int bits, int H, int KVH, int D, int64_t N, int L, int reps) {
  size_t bytes = cache_bytes(bits, KVH, N, D);
  int copies = (int)(1.15 * (1ull << 30) / bytes) + 1;
  if (copies > MAXC) copies = MAXC;
  static cache cs[MAXC];
  static kva_pool *pools[2][MAXC];
  static kva_paged_view *views[2][MAXC];
  const int blocks[2] = {16, 64};
  for (int i = 0; i < copies; ++i) {
    make_cache(&cs[i], bits, KVH, N, D);
    kva_kv_view cv = kva_view_contiguous(&cs[i].k, &cs[i].v, NULL);
    for (int j = 0; j < 2; ++j) {
      int32_t s;
      if (kva_pool_from_contiguous(&pools[j][i], &cv, blocks[j], 0, 1000 + (uint64_t)i, &s) ||
          kva_paged_view_create(pools[j][i], &s, 1, &views[j][i])) { fprintf(stderr, "%s\n", kva_last_error()); exit(1); }
    }
  }
  uint16_t *q = malloc((size_t)H * L * D * 2), *o = malloc((size_t)H * L * D * 2);
  fill16(q, (size_t)H * L * D, -1, 1);
  kva_tensor qt = kva_tensor_4d(q, KVA_BF16, 1, H, L, D), ot = kva_tensor_4d(o, KVA_BF16, 1, H, L, D);
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = KVA_MASK_CAUSAL;
  double *t[3];
  for (int j = 0; j < 3; ++j) t[j] = malloc(sizeof(double) * reps);
  for (int r = -2; r < reps; ++r) {
    for (int j = 0; j < 3; ++j) {
      int i = ((r + 2) * 3 + j) % copies;
      kva_kv_view v = j == 0 ? kva_view_contiguous(&cs[i].k, &cs[i].v, NULL) : kva_view_paged(views[j - 1][i]);
      double t0 = now();
      if (kva_attention(ctx, &qt, &v, &p, &ot, NULL, 0)) { fprintf(stderr, "%s\n", kva_last_error()); exit(1); }
      if (r >= 0) t[j][r] = now() - t0;
    }
  }
  const double p16 = paired(t[0], t[1], reps), p64 = paired(t[0], t[2], reps);
  for (int j = 0; j < 3; ++j) qsort(t[j], reps, sizeof(double), cmpd);
  double c = t[0][reps / 2];
  printf("%s %d/%d/%d N=%lld L=%d (%d copies, %.0f MB each): contiguous %.2f ms, paged/16 %.2f ms (%.0f%% [%.0f%%]), paged/64 %.2f ms (%.0f%% [%.0f%%])\n",
         bits ? "q4g64" : "bf16", H, KVH, D, (long long)N, L, copies, bytes / 1e6, c * 1e3, t[1][reps / 2] * 1e3,
         100 * c / t[1][reps / 2], 100 * p16, t[2][reps / 2] * 1e3, 100 * c / t[2][reps / 2], 100 * p64);
  fflush(stdout);
  for (int i = 0; i < copies; ++i) {
    free_cache(&cs[i]);
    for (int j = 0; j < 2; ++j) { kva_paged_view_release(views[j][i]); kva_pool_destroy(pools[j][i]); }
  }
  for (int j = 0; j < 3; ++j) free(t[j]);
  free(q); free(o);
}

/* 8 sequences 1k..32k: one paged call (pool of block bs, shuffled) vs 8 contiguous calls. */
static void run_ragged(kva_context *ctx, int bits, int H, int KVH, int D, int bs, int reps) {
  enum { B = 8 };
  int64_t lens[B];
  size_t bytes = 0;
  for (int b = 0; b < B; ++b) { lens[b] = 1024 + (int64_t)b * (32768 - 1024) / (B - 1); bytes += cache_bytes(bits, KVH, lens[b], D); }
  int copies = (int)(1.15 * (1ull << 30) / bytes) + 1;
  if (copies > 16) copies = 16;
  static cache cs[16][B];
  static kva_pool *pools[16];
  static kva_paged_view *views[16];
  for (int i = 0; i < copies; ++i) {
    int64_t nb = 0;
    for (int b = 0; b < B; ++b) { make_cache(&cs[i][b], bits, KVH, lens[b], D); nb += (lens[b] + bs - 1) / bs; }
    kva_pool_desc d = {.num_blocks = nb, .block_size = bs, .kv_heads = KVH, .dk = D, .dv = D, .dtype = KVA_BF16, .bits = bits, .group_size = bits ? 64 : 0};
    if (kva_pool_create(&pools[i], &d, NULL)) { fprintf(stderr, "%s\n", kva_last_error()); exit(1); }
    kva_pool_shuffle(pools[i], 77 + i);
    int32_t s[B];
    for (int b = 0; b < B; ++b)
      if (kva_seq_create(pools[i], &s[b]) || kva_seq_append_raw(pools[i], s[b], &cs[i][b].k, &cs[i][b].v)) { fprintf(stderr, "%s\n", kva_last_error()); exit(1); }
    if (kva_paged_view_create(pools[i], s, B, &views[i])) { fprintf(stderr, "%s\n", kva_last_error()); exit(1); }
  }
  uint16_t *q = malloc((size_t)B * H * D * 2), *o = malloc((size_t)B * H * D * 2);
  fill16(q, (size_t)B * H * D, -1, 1);
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = KVA_MASK_CAUSAL;
  double *t[2] = {malloc(sizeof(double) * reps), malloc(sizeof(double) * reps)};
  for (int r = -2; r < reps; ++r) {
    int i = ((r + 2) * 2) % copies;
    double t0 = now();
    for (int b = 0; b < B; ++b) {
      kva_tensor qt = kva_tensor_4d(q + (size_t)b * H * D, KVA_BF16, 1, H, 1, D), ot = kva_tensor_4d(o + (size_t)b * H * D, KVA_BF16, 1, H, 1, D);
      kva_kv_view v = kva_view_contiguous(&cs[i][b].k, &cs[i][b].v, NULL);
      if (kva_attention(ctx, &qt, &v, &p, &ot, NULL, 0)) { fprintf(stderr, "%s\n", kva_last_error()); exit(1); }
    }
    if (r >= 0) t[0][r] = now() - t0;
    i = ((r + 2) * 2 + 1) % copies;
    kva_tensor qt = kva_tensor_4d(q, KVA_BF16, B, H, 1, D), ot = kva_tensor_4d(o, KVA_BF16, B, H, 1, D);
    kva_kv_view v = kva_view_paged(views[i]);
    t0 = now();
    if (kva_attention(ctx, &qt, &v, &p, &ot, NULL, 0)) { fprintf(stderr, "%s\n", kva_last_error()); exit(1); }
    if (r >= 0) t[1][r] = now() - t0;
  }
  const double pr = paired(t[0], t[1], reps);
  qsort(t[0], reps, sizeof(double), cmpd);
  qsort(t[1], reps, sizeof(double), cmpd);
  printf("ragged B=8 lens 1k..32k %s %d/%d/%d decode (%d copies, %.0f MB each): 8 contiguous calls %.2f ms, one paged/%d call %.2f ms (%.2fx [%.2fx])\n",
         bits ? "q4g64" : "bf16", H, KVH, D, copies, bytes / 1e6, t[0][reps / 2] * 1e3, bs, t[1][reps / 2] * 1e3, t[0][reps / 2] / t[1][reps / 2], pr);
  for (int i = 0; i < copies; ++i) {
    for (int b = 0; b < B; ++b) free_cache(&cs[i][b]);
    kva_paged_view_release(views[i]);
    kva_pool_destroy(pools[i]);
  }
  free(t[0]); free(t[1]);
  free(q); free(o);
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 21;
  const char *what = argc > 2 ? argv[2] : "all";
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  if (kva_context_create(&ctx, &o)) return 1;
  printf("simd %s, 2 threads, median of %d interleaved calls, cold (rotated over > 1 GiB)\n", kva_cpu_simd(), reps);
  if (!strcmp(what, "all") || !strcmp(what, "decode")) {
    run_case(ctx, 4, 8, 4, 256, 32768, 1, reps);
    run_case(ctx, 0, 8, 4, 256, 32768, 1, reps);
  }
  if (!strcmp(what, "all") || !strcmp(what, "verify")) {
    run_case(ctx, 4, 8, 4, 256, 32768, 8, reps);
    run_case(ctx, 4, 8, 4, 128, 16384, 8, reps);
  }
  if (!strcmp(what, "all") || !strcmp(what, "ragged")) {
    run_ragged(ctx, 4, 8, 4, 256, 16, reps);
    run_ragged(ctx, 4, 8, 4, 256, 64, reps);
  }
  kva_context_destroy(ctx);
  return 0;
}
