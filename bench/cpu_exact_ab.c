/* The default CPU kernel against exact mode (KVA_ATTN_EXACT: "[exact f32]"
 * kernels only) on one KV head, hot, one thread: min over alternated calls,
 * so that a loaded host (other builds) still gives a usable ratio; also the
 * driver for instruction counts per token-head under callgrind (mode
 * default / exact: that call only).
 *   cc -O2 -Iinclude bench/cpu_exact_ab.c build/libkvattn.a -lm -pthread -o build/cpu_exact_ab
 *   KVATTN_SIMD=avx2 build/cpu_exact_ab BITS L REP N [REPS] [ab|default|exact]
 *   KVATTN_SIMD=avx2 valgrind --tool=callgrind --toggle-collect=attend_fast8 \
 *     build/cpu_exact_ab 4 1 2 65536 1 default    (Ir / N = per token-head)
 * BITS 4 or 8 (q4 / q8, group 64, bf16 scales) or 0 (bf16 rows); L query
 * rows (causal); REP query heads per KV head; N cache length; D = 256; bf16
 * queries, f32 out. Data: uniform random rows, kva_quantize. */
#include <kvattn.h>

#include "cpu_cache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define D 256

int main(int argc, char **argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s BITS L REP N [REPS] [ab|default|exact]\n", argv[0]);
    return 2;
  }
  const int bits = atoi(argv[1]), L = atoi(argv[2]), H = atoi(argv[3]);
  const int64_t N = atoll(argv[4]);
  const int reps = argc > 5 ? atoi(argv[5]) : 25;
  const char *mode = argc > 6 ? argv[6] : "ab";
  if ((bits != 0 && bits != 4 && bits != 8) || L < 1 || H < 1 || N < L || reps < 1) {
    fprintf(stderr, "bad arguments\n");
    return 2;
  }
  kva_kv kv[2];
  if (make_cache(&kv[0], bits, N, D) || make_cache(&kv[1], bits, N, D)) {
    fprintf(stderr, "cache: %s\n", kva_last_error());
    return 1;
  }
  float *qf = malloc(sizeof(float) * (size_t)(H * L * D));
  void *qb = malloc((size_t)(H * L * D * 2)), *ob = malloc(sizeof(float) * (size_t)(H * L * D));
  if (!qf || !qb || !ob) return 1;
  for (int j = 0; j < H * L * D; ++j) qf[j] = rnd();
  kva_tensor q32 = kva_tensor_4d(qf, KVA_F32, 1, H, L, D), q = kva_tensor_4d(qb, KVA_BF16, 1, H, L, D);
  kva_tensor out = kva_tensor_4d(ob, KVA_F32, 1, H, L, D);
  if (kva_convert(&q32, &q)) return 1;
  const kva_kv_view view = kva_view_contiguous(&kv[0], &kv[1], NULL);
  kva_context *ctx;
  const kva_context_opts o = {KVA_BACKEND_CPU, 1, 0, NULL};
  if (kva_context_create(&ctx, &o)) return 1;
  const int first = !strcmp(mode, "exact") ? 1 : 0, last = !strcmp(mode, "default") ? 0 : 1;
  double best[2] = {1e30, 1e30};
  char name[2][200];
  for (int v = first; v <= last; ++v) {
    kva_attn_params p = kva_attn_defaults();
    p.mask.kind = KVA_MASK_CAUSAL;
    p.flags = v ? KVA_ATTN_EXACT : 0;
    kva_attention_kernel(ctx, &q, &view, &p, &out, name[v], sizeof name[v]);
  }
  for (int r = 0; r < reps; ++r)
    for (int v = first; v <= last; ++v) {
      kva_attn_params p = kva_attn_defaults();
      p.mask.kind = KVA_MASK_CAUSAL;
      p.flags = v ? KVA_ATTN_EXACT : 0;
      const double t0 = now();
      if (kva_attention(ctx, &q, &view, &p, &out, NULL, 0)) {
        fprintf(stderr, "kva_attention: %s\n", kva_last_error());
        return 1;
      }
      const double t = now() - t0;
      best[v] = t < best[v] ? t : best[v];
    }
  printf("bits %d L %d rep %d N %lld:", bits, L, H, (long long)N);
  for (int v = first; v <= last; ++v)
    printf("  %s %.1f ns/token-head (%s)", v ? "exact" : "default", best[v] * 1e9 / (double)N, name[v]);
  if (first == 0 && last == 1) printf("  exact/default %.3f", best[1] / best[0]);
  printf("\n");
  kva_context_destroy(ctx);
  return 0;
}
