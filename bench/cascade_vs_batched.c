/* Cascade (shared prefix) against one batched call, side by side in one run
 * (`make bench-cascade`, CPU): B sequences whose caches are a shared prefix
 * of P tokens then S own tokens each, 8/4/256, 4-bit K/V (group 64, bf16
 * scales), L = 1, causal, 2 threads. The batched kva_attention reads each
 * sequence's whole cache (the prefix B times); kva_cascade_attention reads
 * the prefix once for all B rows of each head. The two calls alternate; hot
 * caches; best of reps calls each; the outputs are compared (max relative
 * difference). Usage: cascade_vs_batched [P=8192] [S=256] [B=16] [reps=9] */
#include "kvattn.h"

#include <math.h>
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
static float rnd(void) {
  rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
  return (float)(rs >> 40) / (float)(1 << 24) * 2.0f - 1.0f;
}
/* 4-bit K or V of [B, KVH, N, D] f32 rows src (buffers leak until exit). */
static int quant(int64_t B, int64_t KVH, int64_t N, int64_t D, const float *src, kva_kv *kv) {
  const size_t words = (size_t)(B * KVH * N * D / 8), groups = (size_t)(B * KVH * N * D / 64);
  void *w = malloc(words * 4), *s = malloc(groups * 2), *z = malloc(groups * 2);
  if (!w || !s || !z) return -1;
  *kv = kva_kv_quantized(w, s, z, KVA_BF16, 4, 64, B, KVH, N, D);
  const kva_tensor t = kva_tensor_4d((void *)src, KVA_F32, B, KVH, N, D);
  return kva_quantize(&t, kv);
}

int main(int argc, char **argv) {
  const int64_t P = argc > 1 ? atoll(argv[1]) : 8192, S = argc > 2 ? atoll(argv[2]) : 256;
  const int64_t B = argc > 3 ? atoll(argv[3]) : 16, H = 8, KVH = 4, L = 1, D = 256, T = P + S;
  const int reps = argc > 4 ? atoi(argv[4]) : 9;
  if (P < 1 || S < L || B < 1 || B > 16 || reps < 1) {
    fprintf(stderr, "usage: cascade_vs_batched [P >= 1] [S >= 1] [1 <= B <= 16] [reps >= 1]\n");
    return 2;
  }
  float *src[2][3]; /* K, V x prefix [1, KVH, P, D], suffix [B, KVH, S, D], full [B, KVH, T, D] */
  kva_kv kv[2][3];
  for (int x = 0; x < 2; ++x) {
    src[x][0] = malloc(sizeof(float) * KVH * P * D);
    src[x][1] = malloc(sizeof(float) * B * KVH * S * D);
    src[x][2] = malloc(sizeof(float) * B * KVH * T * D);
    if (!src[x][0] || !src[x][1] || !src[x][2]) return 1;
    for (int64_t i = 0; i < KVH * P * D; ++i) src[x][0][i] = rnd();
    for (int64_t i = 0; i < B * KVH * S * D; ++i) src[x][1][i] = rnd();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < KVH; ++h) {
        memcpy(src[x][2] + (b * KVH + h) * T * D, src[x][0] + h * P * D, sizeof(float) * P * D);
        memcpy(src[x][2] + ((b * KVH + h) * T + P) * D, src[x][1] + (b * KVH + h) * S * D, sizeof(float) * S * D);
      }
    if (quant(1, KVH, P, D, src[x][0], &kv[x][0]) || quant(B, KVH, S, D, src[x][1], &kv[x][1]) ||
        quant(B, KVH, T, D, src[x][2], &kv[x][2])) {
      fprintf(stderr, "quantize: %s\n", kva_last_error());
      return 1;
    }
  }
  float *q = malloc(sizeof(float) * B * H * L * D), *ob = malloc(sizeof(float) * B * H * L * D),
        *oc = malloc(sizeof(float) * B * H * L * D);
  if (!q || !ob || !oc) return 1;
  for (int64_t i = 0; i < B * H * L * D; ++i) q[i] = rnd();
  kva_tensor tq = kva_tensor_4d(q, KVA_F32, B, H, L, D); /* token-major storage [B, L, H, D] */
  tq.stride[0] = L * H * D * 4, tq.stride[1] = D * 4, tq.stride[2] = H * D * 4;
  kva_tensor tb = kva_tensor_4d(ob, KVA_F32, B, H, L, D), tc = kva_tensor_4d(oc, KVA_F32, B, H, L, D);
  const kva_kv_view full = kva_view_contiguous(&kv[0][2], &kv[1][2], NULL);
  const kva_kv_view prefix = kva_view_contiguous(&kv[0][0], &kv[1][0], NULL);
  const kva_kv_view suffix = kva_view_contiguous(&kv[0][1], &kv[1][1], NULL);
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = KVA_MASK_CAUSAL;
  kva_context *ctx;
  const kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  if (kva_context_create(&ctx, &o)) return 1;
  double best_b = INFINITY, best_c = INFINITY;
  for (int r = 0; r <= reps; ++r) { /* call 0: warm-up */
    double t0 = now();
    if (kva_attention(ctx, &tq, &full, &p, &tb, NULL, 0)) goto fail;
    const double tbat = now() - t0;
    t0 = now();
    if (kva_cascade_attention(ctx, &tq, &prefix, &suffix, &p, &tc, NULL, 0, NULL, 0)) goto fail;
    const double tcas = now() - t0;
    if (r > 0 && tbat < best_b) best_b = tbat;
    if (r > 0 && tcas < best_c) best_c = tcas;
  }
  double diff = 0, mx = 0;
  for (int64_t i = 0; i < B * H * L * D; ++i) diff = fmax(diff, fabs((double)ob[i] - oc[i])), mx = fmax(mx, fabs((double)ob[i]));
  printf("B=%lld 8/4/256 q4 g64, prefix %lld + %lld own tokens, L=1, 2 threads, hot, best of %d: batched %.2f ms, "
         "cascade %.2f ms: %.2fx (outputs differ by %.2e of max|out|) [%s]\n",
         (long long)B, (long long)P, (long long)S, reps, best_b * 1e3, best_c * 1e3, best_b / best_c, diff / mx,
         kva_cpu_simd());
  kva_context_destroy(ctx);
  return diff / mx < 1e-4 ? 0 : 1;
fail:
  fprintf(stderr, "%s\n", kva_last_error());
  return 1;
}
