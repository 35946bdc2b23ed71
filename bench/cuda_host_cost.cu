/* Host time per call of the C library on CUDA, the floor under any
 * binding's per-call cost: kva_attention (context workspace, caller
 * workspace), kva_attention_workspace_size and an empty kernel launch, as
 * the mean of 200 asynchronous calls with the GPU kept busy by a spin
 * kernel queued first (no call waits for the device); best of 7 loops.
 * Decode of Llama-3-8B attention: B = 1, 32/8/128, N = 4096, L = 1, bf16
 * and MLX 4-bit K/V (constant memory: host time does not depend on it).
 *   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Iinclude bench/cuda_host_cost.cu \
 *     -o build/cuda_host_cost -Lbuild -lkvattn -Xlinker -rpath=$PWD/build */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "kvattn.h"
__global__ void spin(long long ns) { long long t0 = clock64(); while (clock64() - t0 < ns) {} }
__global__ void empty() {}
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec * 1e-3; }
int main() {
  const int B = 1, H = 32, KVH = 8, D = 128, N = 4096, L = 1;
  kva_context *ctx; kva_context_opts o = {}; o.backend = KVA_BACKEND_CUDA;
  if (kva_context_create(&ctx, &o)) { printf("ctx: %s\n", kva_last_error()); return 1; }
  void *q, *out, *k, *v, *kp, *ks, *kb, *vp, *vs, *vb;
  cudaMalloc(&q, B * H * L * D * 2); cudaMalloc(&out, B * H * L * D * 2);
  cudaMalloc(&k, (size_t)B * KVH * N * D * 2); cudaMalloc(&v, (size_t)B * KVH * N * D * 2);
  cudaMemset(k, 0x3c, (size_t)B * KVH * N * D * 2); cudaMemset(v, 0x3c, (size_t)B * KVH * N * D * 2); cudaMemset(q, 0x3c, B*H*L*D*2);
  size_t W = (size_t)B * KVH * N * D / 8, S = (size_t)B * KVH * N * D / 64 * 2;
  cudaMalloc(&kp, W * 4); cudaMalloc(&vp, W * 4); cudaMalloc(&ks, S); cudaMalloc(&kb, S); cudaMalloc(&vs, S); cudaMalloc(&vb, S);
  cudaMemset(kp, 0x11, W * 4); cudaMemset(vp, 0x11, W * 4); cudaMemset(ks, 0x3c, S); cudaMemset(kb, 0, S); cudaMemset(vs, 0x3c, S); cudaMemset(vb, 0, S);
  kva_tensor tq = kva_tensor_4d(q, KVA_BF16, B, H, L, D), to = kva_tensor_4d(out, KVA_BF16, B, H, L, D);
  kva_kv kf = kva_kv_float(k, KVA_BF16, B, KVH, N, D), vf = kva_kv_float(v, KVA_BF16, B, KVH, N, D);
  kva_kv kq = kva_kv_quantized(kp, ks, kb, KVA_BF16, 4, 64, B, KVH, N, D), vq = kva_kv_quantized(vp, vs, vb, KVA_BF16, 4, 64, B, KVH, N, D);
  kva_kv_view views[2] = {kva_view_contiguous(&kf, &vf, NULL), kva_view_contiguous(&kq, &vq, NULL)};
  const char *names[2] = {"bf16", "q4"};
  kva_attn_params p = kva_attn_defaults(); p.mask.kind = KVA_MASK_CAUSAL;
  const int CALLS = 200;
  for (int vi = 0; vi < 2; ++vi) {
    char name[256]; kva_attention_kernel(ctx, &tq, &views[vi], &p, &to, name, sizeof name);
    size_t wsb; kva_attention_workspace_size(ctx, &tq, &views[vi], &p, &wsb);
    void *ws; cudaMalloc(&ws, wsb + 16);
    for (int mode = 0; mode < 4; ++mode) {
      double best = 1e30;
      for (int rep = 0; rep < 7; ++rep) {
        spin<<<1, 1>>>(2000000000LL / 1000 * 3); // ~3 ms at ~2 GHz
        double t0 = now();
        for (int i = 0; i < CALLS; ++i) {
          int rc = 0;
          if (mode == 0) rc = kva_attention(ctx, &tq, &views[vi], &p, &to, NULL, 0);
          else if (mode == 1) rc = kva_attention(ctx, &tq, &views[vi], &p, &to, ws, wsb);
          else if (mode == 2) { size_t b; rc = kva_attention_workspace_size(ctx, &tq, &views[vi], &p, &b); }
          else empty<<<1, 32>>>();
          if (rc) { printf("rc %d %s\n", rc, kva_last_error()); return 1; }
        }
        double t = (now() - t0) / CALLS;
        cudaDeviceSynchronize();
        if (t < best) best = t;
      }
      static const char *mn[4] = {"kva_attention (ctx workspace)", "kva_attention (caller workspace)", "kva_attention_workspace_size", "empty kernel launch"};
      printf("%-5s %-34s %6.2f us/call   [%s]\n", names[vi], mn[mode], best, name);
    }
  }
  return 0;
}
