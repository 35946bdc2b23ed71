/* Attention-output error of 4-bit g64 keys with and without the Hadamard
 * rotation, on keys with outlier channels (`make bench-rotation`; CPU).
 * Synthetic cache per shape: B = 2 sequences, KVH = 4, H = 16 (GQA 4), one
 * decode row, N = 4096 tokens, head dim D in {128, 256}; K and V ~ N(0, 1)
 * f32, and in K a fixed set of D/32 channels (4 of 128, 8 of 256, drawn at
 * random once per shape) multiplied by s in {1 (none), 10, 20, 30}; queries
 * ~ N(0, 1) f32, scale 1/sqrt(D), causal; V is never rotated (no outliers).
 * Truth: the double-precision oracle on the unquantized f32 cache. Rows:
 *   plain:   K and V quantized to 4 bits, group 64, bf16 scales (kva_quantize)
 *   rotated: K' = H K (kva_hadamard, f32) quantized the same way, attended
 *            with KVA_ATTN_ROTATED_K; V as in plain
 * both run by kva_attention on the CPU context (the default kernels), f32
 * output. Columns: max |out - truth| over all outputs, that relative to
 * max |truth|, and the relative L2 error ||out - truth|| / ||truth||.
 * Usage: rotation_error [seed] */
#include "kvattn.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rs = 0x2545f4914f6cdd1dull;
static double urand(void) {
  rs ^= rs << 13;
  rs ^= rs >> 7;
  rs ^= rs << 17;
  return ((rs >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static float randn(void) { return (float)(sqrt(-2.0 * log(urand())) * cos(6.283185307179586 * urand())); }

#define CHECK(call)                                                              \
  do {                                                                           \
    if ((call) < 0) {                                                            \
      fprintf(stderr, "%s: %s\n", #call, kva_last_error());                      \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

typedef struct qkv {
  kva_kv kv;
  void *mem[3];
} qkv;
static void quantize4(const kva_tensor *w, qkv *out) {
  const int64_t B = w->shape[0], KVH = w->shape[1], N = w->shape[2], D = w->shape[3];
  out->mem[0] = malloc((size_t)(B * KVH * N * D / 8) * 4);
  out->mem[1] = malloc((size_t)(B * KVH * N * D / 64) * 2);
  out->mem[2] = malloc((size_t)(B * KVH * N * D / 64) * 2);
  out->kv = kva_kv_quantized(out->mem[0], out->mem[1], out->mem[2], KVA_BF16, 4, 64, B, KVH, N, D);
  CHECK(kva_quantize(w, &out->kv));
}
static void qkv_free(qkv *q) {
  for (int i = 0; i < 3; ++i) free(q->mem[i]);
}

static void errors(const float *out, const float *truth, size_t n, double *max_abs, double *max_rel, double *l2) {
  double m = 0, mt = 0, e2 = 0, t2 = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = fabs((double)out[i] - truth[i]);
    if (d > m) m = d;
    if (fabs(truth[i]) > mt) mt = fabs(truth[i]);
    e2 += d * d;
    t2 += (double)truth[i] * truth[i];
  }
  *max_abs = m;
  *max_rel = m / mt;
  *l2 = sqrt(e2 / t2);
}

int main(int argc, char **argv) {
  if (argc > 1) rs = strtoull(argv[1], NULL, 0) | 1;
  kva_context *ctx;
  CHECK(kva_context_create(&ctx, NULL));
  const int64_t B = 2, KVH = 4, H = 16, L = 1, N = 4096;
  static const int64_t dims[2] = {128, 256};
  static const float scales[4] = {1, 10, 20, 30};
  printf("| D | outliers | K format | max abs err | max err / max abs | rel L2 |\n");
  printf("|---|---|---|---|---|---|\n");
  for (int di = 0; di < 2; ++di) {
    const int64_t D = dims[di], nout = D / 32;
    int64_t ch[16];
    for (int64_t i = 0; i < nout; ++i) {
      int again;
      do { /* distinct channels */
        ch[i] = (int64_t)(urand() * (double)D);
        again = 0;
        for (int64_t j = 0; j < i; ++j) again |= ch[j] == ch[i];
      } while (again);
    }
    const size_t nkv = (size_t)(B * KVH * N * D), nq = (size_t)(B * H * L * D);
    float *k = malloc(nkv * 4), *v = malloc(nkv * 4), *kr = malloc(nkv * 4), *q = malloc(nq * 4);
    float *truth = malloc(nq * 4), *out = malloc(nq * 4);
    for (size_t i = 0; i < nkv; ++i) v[i] = randn();
    for (size_t i = 0; i < nq; ++i) q[i] = randn();
    for (int si = 0; si < 4; ++si) {
      for (size_t i = 0; i < nkv; ++i) k[i] = randn();
      for (size_t r = 0; r < nkv / (size_t)D; ++r)
        for (int64_t i = 0; i < nout; ++i) k[r * (size_t)D + (size_t)ch[i]] *= scales[si];
      kva_tensor kt = kva_tensor_4d(k, KVA_F32, B, KVH, N, D), vt = kva_tensor_4d(v, KVA_F32, B, KVH, N, D);
      kva_tensor krt = kva_tensor_4d(kr, KVA_F32, B, KVH, N, D);
      kva_tensor qt = kva_tensor_4d(q, KVA_F32, B, H, L, D), ot = kva_tensor_4d(out, KVA_F32, B, H, L, D);
      kva_tensor tt = kva_tensor_4d(truth, KVA_F32, B, H, L, D);
      kva_kv kf = kva_kv_float(k, KVA_F32, B, KVH, N, D), vf = kva_kv_float(v, KVA_F32, B, KVH, N, D);
      kva_kv_view fv = kva_view_contiguous(&kf, &vf, NULL);
      kva_attn_params p = kva_attn_defaults();
      p.mask.kind = KVA_MASK_CAUSAL;
      CHECK(kva_reference_attention(&qt, &fv, &p, &tt));
      qkv kq, vq, krq;
      quantize4(&kt, &kq);
      quantize4(&vt, &vq);
      CHECK(kva_hadamard(ctx, &kt, &krt));
      quantize4(&krt, &krq);
      for (int rot = 0; rot < 2; ++rot) {
        kva_kv_view view = kva_view_contiguous(rot ? &krq.kv : &kq.kv, &vq.kv, NULL);
        kva_attn_params pr = p;
        pr.flags = rot ? KVA_ATTN_ROTATED_K : 0;
        CHECK(kva_attention(ctx, &qt, &view, &pr, &ot, NULL, 0));
        double ma, mr, l2;
        errors(out, truth, nq, &ma, &mr, &l2);
        char what[32];
        if (si == 0) snprintf(what, sizeof what, "none");
        else snprintf(what, sizeof what, "%lld ch x%g", (long long)nout, (double)scales[si]);
        printf("| %lld | %s | q4 g64%s | %.4f | %.4f | %.4f |\n", (long long)D, what, rot ? " rotated" : "", ma, mr, l2);
      }
      qkv_free(&kq);
      qkv_free(&vq);
      qkv_free(&krq);
    }
    free(k);
    free(v);
    free(kr);
    free(q);
    free(truth);
    free(out);
  }
  kva_context_destroy(ctx);
  return 0;
}
