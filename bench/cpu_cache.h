/* The CPU microbenchmarks' shared parts (bench/cpu_exact_ab.c,
 * bench/cpu_prefix_pass.c): uniform random values, a monotonic clock, and
 * one [1, 1, N, D] cache of uniform random rows in the format of bits (4 or
 * 8: group 64, bf16 scales, by kva_quantize; 0: bf16 rows). */
#ifndef KVATTN_BENCH_CPU_CACHE_H
#define KVATTN_BENCH_CPU_CACHE_H
#include <kvattn.h>

#include <stdlib.h>
#include <string.h>
#include <time.h>

static float rnd(void) { return (float)rand() / (float)RAND_MAX * 2.0f - 1.0f; }
static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* 0, or -1 when an allocation or the conversion fails. */
static int make_cache(kva_kv *kv, int bits, int64_t N, int64_t D) {
  float *w = malloc(sizeof(float) * (size_t)(N * D));
  if (!w) return -1;
  for (int64_t j = 0; j < N * D; ++j) w[j] = rnd();
  kva_tensor wt = kva_tensor_4d(w, KVA_F32, 1, 1, N, D);
  memset(kv, 0, sizeof *kv);
  int rc;
  if (bits) {
    kv->bits = bits;
    kv->group_size = 64;
    kv->data = kva_tensor_4d(malloc((size_t)(N * D * bits / 8)), KVA_U32, 1, 1, N, D * bits / 32);
    kv->scales = kva_tensor_4d(malloc((size_t)(N * D / 64 * 2)), KVA_BF16, 1, 1, N, D / 64);
    kv->biases = kva_tensor_4d(malloc((size_t)(N * D / 64 * 2)), KVA_BF16, 1, 1, N, D / 64);
    rc = kv->data.data && kv->scales.data && kv->biases.data ? kva_quantize(&wt, kv) : -1;
  } else {
    kv->data = kva_tensor_4d(malloc((size_t)(N * D * 2)), KVA_BF16, 1, 1, N, D);
    rc = kv->data.data ? kva_convert(&wt, &kv->data) : -1;
  }
  free(w);
  return rc ? -1 : 0;
}
#endif
