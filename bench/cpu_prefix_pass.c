/* The cascade's prefix pass on one KV head, hot-ish, min over calls:
 * REP query heads per KV head times L stacked rows (no mask), one
 * [1, 1, N, D] cache, bf16 queries, f32 out; prints ns per token-head (the
 * cost of one key for all REP * L vectors) and the kernel's name. With L = 1
 * it is the decode call that the batched side of bench/cascade_vs_batched.c
 * makes, so 16 x (L = 1) / (L = 16) bounds the cascade's speedup at B = 16.
 *   cc -O2 -Iinclude bench/cpu_prefix_pass.c build/libkvattn.a -lm -pthread -o build/cpu_prefix_pass
 *   build/cpu_prefix_pass BITS D REP L N [REPS] [THREADS]
 *   e.g. build/cpu_prefix_pass 4 256 2 16 65536 7    (8/4/256 q4, 32 vectors)
 *        build/cpu_prefix_pass 0 128 4 16 65536 7    (32/8/128 bf16, 64 vectors)
 * BITS 4 or 8 (group 64, bf16 scales) or 0 (bf16 rows). Data: uniform random
 * rows, kva_quantize / kva_convert. */
#include <kvattn.h>

#include "cpu_cache.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static int D;
int main(int argc, char **argv) {
  if (argc < 6) {
    fprintf(stderr, "usage: BITS D REP L N [REPS] [THREADS]\n");
    return 2;
  }
  const int bits = atoi(argv[1]);
  D = atoi(argv[2]);
  const int H = atoi(argv[3]), L = atoi(argv[4]);
  const int64_t N = atoll(argv[5]);
  const int reps = argc > 6 ? atoi(argv[6]) : 25, th = argc > 7 ? atoi(argv[7]) : 1;
  kva_kv kv[2];
  if (make_cache(&kv[0], bits, N, D) || make_cache(&kv[1], bits, N, D)) {
    fprintf(stderr, "cache: %s\n", kva_last_error());
    return 1;
  }
  float *qf = malloc(sizeof(float) * (size_t)(H * L * D));
  void *qb = malloc((size_t)(H * L * D * 2)), *ob = malloc(sizeof(float) * (size_t)(H * L * D));
  if (!qf || !qb || !ob) return 1;
  for (int j = 0; j < H * L * D; ++j)
    qf[j] = rnd();
  kva_tensor q32 = kva_tensor_4d(qf, KVA_F32, 1, H, L, D), q = kva_tensor_4d(qb, KVA_BF16, 1, H, L, D);
  kva_tensor out = kva_tensor_4d(ob, KVA_F32, 1, H, L, D);
  if (kva_convert(&q32, &q)) return 1;
  const kva_kv_view view = kva_view_contiguous(&kv[0], &kv[1], NULL);
  kva_context *ctx;
  const kva_context_opts o = {KVA_BACKEND_CPU, th, 0, NULL};
  if (kva_context_create(&ctx, &o)) return 1;
  kva_attn_params p = kva_attn_defaults();
  char name[200];
  kva_attention_kernel(ctx, &q, &view, &p, &out, name, sizeof name);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    if (kva_attention(ctx, &q, &view, &p, &out, NULL, 0)) {
      fprintf(stderr, "kva_attention: %s\n", kva_last_error());
      return 1;
    }
    const double t = now() - t0;
    best = t < best ? t : best;
  }
  printf("bits %d D %d rep %d L %d N %lld: %.1f ns/token-head, %.2f ns/token-vector (%s)\n", bits, D, H, L,
         (long long)N, best * 1e9 / (double)N, best * 1e9 / (double)N / (H * L), name);
  kva_context_destroy(ctx);
  return 0;
}
