/* Machine ceilings measured by the tool in the same run as the kernels:
 *  - DRAM read bandwidth: T threads each sum a disjoint slice of one large
 *    array (larger than the last-level cache) with 4 independent vector
 *    accumulators; bytes / wall time of the slowest thread, best of P passes.
 *    Memory traffic: exactly the array, read once per pass, nothing written.
 *  - f32 FMA throughput: T threads run 16 independent chains of vector FMAs
 *    on registers (no memory traffic); 2 FLOPs per lane per FMA.
 * Vector width is chosen at run time (AVX-512, AVX2, else portable C). Also a
 * small fork-join helper (kb_parallel) for the tool's own parallel setup,
 * the CPU model name and the load average. */
#include "bench.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KB_X86 1
#endif

#define PROBE_ALIGN 4096
#define PROBE_FILL_BYTE 0x5b /* any non-zero pattern */
#define FMA_CHAINS 16
#define FMA_ITERS (1 << 22)
#define FMA_PASSES 3
#define FLOPS_PER_FMA 2.0

const char *kb_cpu_model(char *buf, size_t n) {
  snprintf(buf, n, "unknown CPU");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return buf;
  char line[256];
  while (fgets(line, sizeof line, f)) {
    char *v = strchr(line, ':');
    if (strncmp(line, "model name", 10) == 0 && v) {
      v += 1 + (v[1] == ' ');
      v[strcspn(v, "\n")] = 0;
      snprintf(buf, n, "%s", v);
      break;
    }
  }
  fclose(f);
  return buf;
}

double kb_loadavg(void) {
  double l = -1;
  FILE *f = fopen("/proc/loadavg", "r");
  if (f) {
    if (fscanf(f, "%lf", &l) != 1) l = -1;
    fclose(f);
  }
  return l;
}

double kb_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------ fork / join */
typedef struct par_arg {
  void (*fn)(void *, int);
  void *arg;
  int t;
} par_arg;

static void *par_main(void *p) {
  par_arg *a = p;
  a->fn(a->arg, a->t);
  return NULL;
}

int kb_parallel(int threads, void (*fn)(void *arg, int t), void *arg) {
  if (threads < 1) threads = 1;
  if (threads > KB_MAX_THREADS) threads = KB_MAX_THREADS;
  pthread_t tid[KB_MAX_THREADS];
  par_arg pa[KB_MAX_THREADS];
  for (int t = 1; t < threads; ++t) {
    pa[t] = (par_arg){fn, arg, t};
    if (pthread_create(&tid[t], NULL, par_main, &pa[t]) != 0) {
      /* The jobs synchronize on barriers sized for `threads`: waiting for
       * the started ones would never end, so stop the tool here. */
      fprintf(stderr, "kvattn: cannot start thread %d of %d\n", t, threads);
      exit(KB_EXIT_FAIL);
    }
  }
  fn(arg, 0);
  for (int t = 1; t < threads; ++t) pthread_join(tid[t], NULL);
  return 0;
}

/* ------------------------------------------------- read bandwidth */
typedef uint64_t (*sum_fn)(const uint64_t *p, size_t n);

static uint64_t sum_portable(const uint64_t *p, size_t n) {
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) a0 += p[i], a1 += p[i + 1], a2 += p[i + 2], a3 += p[i + 3];
  for (; i < n; ++i) a0 += p[i];
  return a0 + a1 + a2 + a3;
}

#ifdef KB_X86
#define AVX2_WORDS 4   /* u64 per 256-bit vector */
#define AVX512_WORDS 8 /* u64 per 512-bit vector */
__attribute__((target("avx2"))) static uint64_t sum_avx2(const uint64_t *p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 4 * AVX2_WORDS <= n; i += 4 * AVX2_WORDS) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(p + i + AVX2_WORDS)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(p + i + 2 * AVX2_WORDS)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(p + i + 3 * AVX2_WORDS)));
  }
  __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  uint64_t lanes[AVX2_WORDS];
  _mm256_storeu_si256((__m256i *)lanes, s);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + sum_portable(p + i, n - i);
}

__attribute__((target("avx512f"))) static uint64_t sum_avx512(const uint64_t *p, size_t n) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 4 * AVX512_WORDS <= n; i += 4 * AVX512_WORDS) {
    a0 = _mm512_add_epi64(a0, _mm512_load_si512((const void *)(p + i)));
    a1 = _mm512_add_epi64(a1, _mm512_load_si512((const void *)(p + i + AVX512_WORDS)));
    a2 = _mm512_add_epi64(a2, _mm512_load_si512((const void *)(p + i + 2 * AVX512_WORDS)));
    a3 = _mm512_add_epi64(a3, _mm512_load_si512((const void *)(p + i + 3 * AVX512_WORDS)));
  }
  __m512i s = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
  return (uint64_t)_mm512_reduce_add_epi64(s) + sum_portable(p + i, n - i);
}
#endif

static sum_fn pick_sum(const char **isa) {
#ifdef KB_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    *isa = "avx512";
    return sum_avx512;
  }
  if (__builtin_cpu_supports("avx2")) {
    *isa = "avx2";
    return sum_avx2;
  }
#endif
  *isa = "portable";
  return sum_portable;
}

static volatile uint64_t bw_sink;

typedef struct bw_job {
  uint64_t *a;
  size_t words; /* whole array */
  int threads, passes;
  sum_fn sum;
  pthread_barrier_t bar;
  double best_s;
  uint64_t sink[KB_MAX_THREADS]; /* keeps the sums live */
} bw_job;

/* Slice of thread t, in words, multiple of one cache line. */
static void slice(size_t words, int threads, int t, size_t *w0, size_t *w1) {
  const size_t line_words = 8;
  size_t per = (words / (size_t)threads) / line_words * line_words;
  *w0 = per * (size_t)t;
  *w1 = t == threads - 1 ? words : *w0 + per;
}

static void bw_thread(void *arg, int t) {
  bw_job *j = arg;
  size_t w0, w1;
  slice(j->words, j->threads, t, &w0, &w1);
  memset(j->a + w0, PROBE_FILL_BYTE, (w1 - w0) * sizeof(uint64_t)); /* first touch here */
  uint64_t acc = 0;
  for (int pass = 0; pass < j->passes; ++pass) {
    pthread_barrier_wait(&j->bar);
    double t0 = kb_now();
    acc += j->sum(j->a + w0, w1 - w0);
    pthread_barrier_wait(&j->bar);
    if (t == 0) {
      double dt = kb_now() - t0;
      if (j->best_s == 0 || dt < j->best_s) j->best_s = dt;
    }
  }
  j->sink[t] = acc;
}

int kb_probe_read_bw(int threads, size_t bytes, int passes, double *gbps, const char **isa) {
  bw_job j;
  memset(&j, 0, sizeof j);
  j.sum = pick_sum(isa);
  j.threads = threads < 1 ? 1 : threads;
  j.passes = passes < 1 ? 1 : passes;
  j.words = bytes / sizeof(uint64_t);
  j.a = aligned_alloc(PROBE_ALIGN, (j.words * sizeof(uint64_t) + PROBE_ALIGN - 1) / PROBE_ALIGN *
                                       PROBE_ALIGN);
  if (!j.a) return -ENOMEM;
  madvise(j.a, j.words * sizeof(uint64_t), MADV_HUGEPAGE);
  if (pthread_barrier_init(&j.bar, NULL, (unsigned)j.threads) != 0) {
    free(j.a);
    return -1;
  }
  int rc = kb_parallel(j.threads, bw_thread, &j);
  pthread_barrier_destroy(&j.bar);
  free(j.a);
  uint64_t all = 0;
  for (int t = 0; t < j.threads; ++t) all += j.sink[t];
  bw_sink = all;
  if (rc < 0 || j.best_s <= 0) return -1;
  *gbps = (double)(j.words * sizeof(uint64_t)) / j.best_s / 1e9;
  return 0;
}

/* ------------------------------------- the kernels' read pattern */
#define PAT_TILE 32     /* tokens per tile (KVA_TILE) */
#define PAT_ARRS 6      /* K data, scales, biases; V data, scales, biases */
#define PAT_LINE 64

typedef struct pat_arr {
  const char *base;
  int64_t s0, s1, s2; /* strides of sequence, head, token (bytes, as kva_tensor's) */
  int64_t bytes;      /* bytes of one row (0: array unused) */
} pat_arr;

typedef struct pat_job {
  pat_arr a[PAT_ARRS];
  int64_t B, KVH, N, nch, chunk; /* items: (b, head, chunk of `chunk` tokens) */
  int threads;
  uint64_t sink[KB_MAX_THREADS];
} pat_job;

static pat_arr pat_of(const kva_tensor *t, bool on) {
  pat_arr a = {0};
  if (!on || !t->data || t->ndim != 4) return a;
  const int64_t es = (int64_t)kva_dtype_size(t->dtype);
  a.base = t->data;
  a.s0 = t->stride[0], a.s1 = t->stride[1], a.s2 = t->stride[2];
  a.bytes = a.s2 ? t->shape[3] * es : 0; /* a shared scale (strides 0): one cached value */
  return a;
}

/* One 8-byte load in each cache line of [p, p + bytes) (the line holds the
 * rest: the memory traffic of reading every byte, few instructions). */
static inline uint64_t pat_touch(const char *p, int64_t bytes) {
  uint64_t acc = 0, w;
  const uintptr_t a = (uintptr_t)p, end = a + (uintptr_t)bytes;
  for (uintptr_t l = a & ~(uintptr_t)(PAT_LINE - 1); l < end; l += PAT_LINE) {
    const uintptr_t at = l < a ? a : l;
    if (end - at >= 8) {
      memcpy(&w, (const char *)at, 8);
      acc += w;
    } else {
      acc += *(const unsigned char *)at; /* a row of < 8 bytes in this line */
    }
  }
  return acc;
}
static inline void pat_prefetch(const char *p, int64_t bytes) {
  const uintptr_t a = (uintptr_t)p, end = a + (uintptr_t)bytes;
  for (uintptr_t l = a & ~(uintptr_t)(PAT_LINE - 1); l < end; l += PAT_LINE) __builtin_prefetch((const char *)l, 0, 2);
}
static inline const char *pat_row(const pat_arr *a, int64_t b, int64_t h, int64_t t) {
  return a->base + b * a->s0 + h * a->s1 + t * a->s2;
}

/* One load per line of the run [p, p + len) and, line for line alongside,
 * a prefetch of the next tile's run [nx, nx + nlen) (nx NULL: none). */
static inline uint64_t pat_run(const char *p, int64_t len, const char *nx, int64_t nlen) {
  if (((uintptr_t)p | (uintptr_t)len) & (PAT_LINE - 1)) { /* not whole lines: as rows */
    if (nx) pat_prefetch(nx, nlen);
    return pat_touch(p, len);
  }
  uint64_t acc = 0, w;
  int64_t off = 0;
  if (nx)
    for (; off < nlen && off < len; off += PAT_LINE) {
      __builtin_prefetch(nx + off, 0, 2);
      memcpy(&w, p + off, 8);
      acc += w;
    }
  for (; off < len; off += PAT_LINE) {
    memcpy(&w, p + off, 8);
    acc += w;
  }
  return acc;
}

/* Item i, as the fused kernels take a tile (fast8.c, fast.c): the tile's
 * scale and bias rows of K and V (the group tables), then K's data rows
 * while the next tile's K arrays are prefetched (tiles.h: one row per row
 * read), then V's likewise. Rows packed along tokens (contiguous layouts)
 * are read as one run per tile and array. */
static void pat_thread(void *arg, int t) {
  pat_job *j = arg;
  uint64_t acc = 0;
  const int64_t items = j->B * j->KVH * j->nch;
  const int grp[4] = {1, 2, 4, 5};
  for (int64_t it = t; it < items; it += j->threads) {
    const int64_t b = it / (j->KVH * j->nch), h = it / j->nch % j->KVH, c = it % j->nch;
    const int64_t t0 = c * j->chunk, t1 = t0 + j->chunk < j->N ? t0 + j->chunk : j->N;
    for (int64_t s = t0; s < t1; s += PAT_TILE) {
      const int64_t n = t1 - s < PAT_TILE ? t1 - s : PAT_TILE, nn = t1 - s - n < PAT_TILE ? t1 - s - n : PAT_TILE;
      for (int g = 0; g < 4; ++g) {
        const pat_arr *a = &j->a[grp[g]];
        if (!a->bytes) continue;
        if (a->s2 == a->bytes) acc += pat_touch(pat_row(a, b, h, s), n * a->bytes);
        else
          for (int64_t r = 0; r < n; ++r) acc += pat_touch(pat_row(a, b, h, s + r), a->bytes);
      }
      for (int o = 0; o < 2; ++o) {
        const pat_arr *d = &j->a[3 * o];
        for (int x = 3 * o + 1; x < 3 * o + 3 && nn; ++x) { /* the next tile's group rows */
          const pat_arr *a = &j->a[x];
          if (!a->bytes) continue;
          if (a->s2 == a->bytes) pat_prefetch(pat_row(a, b, h, s + PAT_TILE), nn * a->bytes);
          else
            for (int64_t r = 0; r < nn; ++r) pat_prefetch(pat_row(a, b, h, s + PAT_TILE + r), a->bytes);
        }
        if (d->s2 == d->bytes) {
          acc += pat_run(pat_row(d, b, h, s), n * d->bytes, nn ? pat_row(d, b, h, s + PAT_TILE) : NULL,
                         nn * d->bytes);
          continue;
        }
        for (int64_t r = 0; r < n; ++r) {
          if (r < nn) pat_prefetch(pat_row(d, b, h, s + PAT_TILE + r), d->bytes);
          acc += pat_touch(pat_row(d, b, h, s + r), d->bytes);
        }
      }
    }
  }
  j->sink[t] = acc;
}

int kb_probe_pattern(int threads, const kva_kv *k, const kva_kv *v, double *us) {
  pat_job j;
  memset(&j, 0, sizeof j);
  j.threads = threads < 1 ? 1 : threads > KB_MAX_THREADS ? KB_MAX_THREADS : threads;
  const kva_kv *kv[2] = {k, v};
  for (int o = 0; o < 2; ++o) {
    j.a[3 * o] = pat_of(&kv[o]->data, true);
    j.a[3 * o + 1] = pat_of(&kv[o]->scales, kv[o]->bits > 0 || kv[o]->scales.data);
    j.a[3 * o + 2] = pat_of(&kv[o]->biases, kv[o]->bits > 0);
  }
  if (k->data.ndim != 4 || !j.a[0].bytes) return -1;
  j.B = k->data.shape[0], j.KVH = k->data.shape[1], j.N = k->data.shape[2];
  /* about four items per thread, whole tiles */
  const int64_t heads = j.B * j.KVH, tiles = (j.N + PAT_TILE - 1) / PAT_TILE;
  j.nch = (4 * j.threads + heads - 1) / heads;
  if (j.nch > tiles) j.nch = tiles;
  if (j.nch < 1) j.nch = 1;
  j.chunk = (tiles + j.nch - 1) / j.nch * PAT_TILE;
  const double t0 = kb_now();
  const int rc = kb_parallel(j.threads, pat_thread, &j);
  *us = (kb_now() - t0) * 1e6;
  uint64_t all = 0;
  for (int t = 0; t < j.threads; ++t) all += j.sink[t];
  bw_sink = all;
  return rc < 0 ? -1 : 0;
}

/* ------------------------------------------------------ FMA rate */
typedef double (*fma_fn)(void); /* returns FLOPs done */

#define FMA_MUL 0.999999f /* keeps the chains bounded */
#define FMA_ADD 1e-6f

static volatile float fma_sink;

static double fma_portable(void) {
  float acc[FMA_CHAINS];
  for (int c = 0; c < FMA_CHAINS; ++c) acc[c] = (float)c;
  for (int i = 0; i < FMA_ITERS; ++i)
    for (int c = 0; c < FMA_CHAINS; ++c) acc[c] = acc[c] * FMA_MUL + FMA_ADD;
  float s = 0;
  for (int c = 0; c < FMA_CHAINS; ++c) s += acc[c];
  fma_sink = s;
  return FLOPS_PER_FMA * FMA_CHAINS * (double)FMA_ITERS;
}

#ifdef KB_X86
#define AVX2_LANES 8
#define AVX512_LANES 16
__attribute__((target("avx2,fma"))) static double fma_avx2(void) {
  __m256 acc[FMA_CHAINS];
  const __m256 m = _mm256_set1_ps(FMA_MUL), a = _mm256_set1_ps(FMA_ADD);
  for (int c = 0; c < FMA_CHAINS; ++c) acc[c] = _mm256_set1_ps((float)c);
  for (int i = 0; i < FMA_ITERS; ++i)
    for (int c = 0; c < FMA_CHAINS; ++c) acc[c] = _mm256_fmadd_ps(acc[c], m, a);
  __m256 s = acc[0];
  for (int c = 1; c < FMA_CHAINS; ++c) s = _mm256_add_ps(s, acc[c]);
  float lanes[AVX2_LANES];
  _mm256_storeu_ps(lanes, s);
  fma_sink = lanes[0];
  return FLOPS_PER_FMA * AVX2_LANES * FMA_CHAINS * (double)FMA_ITERS;
}

__attribute__((target("avx512f"))) static double fma_avx512(void) {
  __m512 acc[FMA_CHAINS];
  const __m512 m = _mm512_set1_ps(FMA_MUL), a = _mm512_set1_ps(FMA_ADD);
  for (int c = 0; c < FMA_CHAINS; ++c) acc[c] = _mm512_set1_ps((float)c);
  for (int i = 0; i < FMA_ITERS; ++i)
    for (int c = 0; c < FMA_CHAINS; ++c) acc[c] = _mm512_fmadd_ps(acc[c], m, a);
  __m512 s = acc[0];
  for (int c = 1; c < FMA_CHAINS; ++c) s = _mm512_add_ps(s, acc[c]);
  fma_sink = _mm512_reduce_add_ps(s);
  return FLOPS_PER_FMA * AVX512_LANES * FMA_CHAINS * (double)FMA_ITERS;
}
#endif

typedef struct fma_job {
  fma_fn fn;
  pthread_barrier_t bar;
  double best_s, flops[KB_MAX_THREADS];
} fma_job;

static void fma_thread(void *arg, int t) {
  fma_job *j = arg;
  for (int pass = 0; pass < FMA_PASSES; ++pass) {
    pthread_barrier_wait(&j->bar);
    double t0 = kb_now();
    j->flops[t] = j->fn();
    pthread_barrier_wait(&j->bar);
    if (t == 0) {
      double dt = kb_now() - t0;
      if (j->best_s == 0 || dt < j->best_s) j->best_s = dt;
    }
  }
}

int kb_probe_fma(int threads, double *gflops, const char **isa) {
  fma_job j;
  memset(&j, 0, sizeof j);
  threads = threads < 1 ? 1 : threads > KB_MAX_THREADS ? KB_MAX_THREADS : threads;
  j.fn = fma_portable;
  *isa = "portable";
#ifdef KB_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    j.fn = fma_avx512;
    *isa = "avx512";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    j.fn = fma_avx2;
    *isa = "avx2";
  }
#endif
  if (pthread_barrier_init(&j.bar, NULL, (unsigned)threads) != 0) return -1;
  int rc = kb_parallel(threads, fma_thread, &j);
  pthread_barrier_destroy(&j.bar);
  if (rc < 0 || j.best_s <= 0) return -1;
  double total = 0;
  for (int t = 0; t < threads; ++t) total += j.flops[t];
  *gflops = total / j.best_s / 1e9;
  return 0;
}
