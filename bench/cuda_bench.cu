/* CUDA benchmark driver for kvattn (until `kvattn bench --backend cuda` has a
 * CUDA backend-ops variant): times kva_attention on the target shapes of
 * issue 4 with CUDA events, and prints µs, GB/s and the fraction of the
 * device-to-device copy bandwidth measured in the same run.
 *   per case: K/V (+ scales/biases) in `copies` device copies whose total
 *   exceeds ROTATE_BYTES (> 4x the 60 MB L2), filled with random values on
 *   the device; WARMUP calls, then REPS calls each between two events on copy
 *   (i mod copies); median. Also the mean of a CUDA graph of GRAPH_CALLS
 *   calls (launch gaps removed). bytes = K/V data + scales + biases read once.
 * Build: nvcc -O2 -std=c++17 -Iinclude bench/cuda_bench.cu build/libkvattn.a -lcudart
 * Run:   cuda_bench [results.jsonl [case,case,...]]  (one JSON object per case appended;
 *        the optional list selects cases by index) */
#include "kvattn.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#define ROTATE_BYTES (512.0 * 1024 * 1024)
#define WARMUP 10
#define REPS 60
#define GRAPH_CALLS 40
#define COPY_BYTES ((size_t)1 << 30)
#define COPY_PASSES 10
#define FILL_THREADS 256

struct bcase {
  const char *kind; /* decode / verify */
  int B, H, KVH, L, D;
  long long N;
  int bits;  /* 0 = bf16 K/V */
  int group;
};

static const bcase cases[] = {
    {"decode", 16, 8, 4, 1, 256, 32768, 4, 64},
    {"decode", 1, 8, 4, 1, 256, 131072, 4, 64},
    {"decode", 1, 24, 4, 1, 256, 131072, 4, 64},
    {"verify", 1, 24, 4, 8, 256, 131072, 4, 64},
    {"decode", 16, 32, 8, 1, 128, 32768, 4, 64},
    {"decode", 1, 8, 4, 1, 256, 4096, 4, 64},
    {"decode", 1, 8, 4, 1, 256, 131072, 8, 64},
    {"decode", 16, 8, 4, 1, 256, 32768, 0, 0},
    {"decode", 1, 8, 4, 1, 256, 131072, 0, 0},
    {"decode", 1, 24, 4, 1, 256, 131072, 0, 0},
    {"verify", 1, 24, 4, 8, 256, 131072, 0, 0},
    {"decode", 4, 8, 4, 1, 256, 65536, 0, 0},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

#define CK(call)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));       \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)
#define KK(call)                                                                                   \
  do {                                                                                             \
    int r_ = (call);                                                                               \
    if (r_ < 0) {                                                                                  \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, kva_last_error());             \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

__device__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return (uint32_t)x;
}
/* words: raw random u32 (quantized codes); else bf16 uniform in [lo, hi). */
__global__ void fill_kernel(void *p, size_t n, uint64_t seed, int words, float lo, float hi) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = hash32(seed * 0x9e3779b97f4a7c15ull + i);
    if (words) ((uint32_t *)p)[i] = h;
    else {
      float u = lo + (hi - lo) * (h >> 8) * (1.0f / 16777216.0f);
      uint32_t b = __float_as_uint(u);
      ((uint16_t *)p)[i] = (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
  }
}
static void fill(void *p, size_t n, uint64_t seed, int words, float lo, float hi) {
  fill_kernel<<<1024, FILL_THREADS>>>(p, n, seed, words, lo, hi);
  CK(cudaGetLastError());
}
static void *dmalloc(size_t bytes) {
  void *p = NULL;
  CK(cudaMalloc(&p, bytes));
  return p;
}

/* One copy of a case's K and V. */
struct kvcopy {
  kva_kv k, v;
  void *bufs[6];
};
static kvcopy make_copy(const bcase &c, uint64_t seed) {
  kvcopy cp;
  memset(&cp, 0, sizeof cp);
  size_t rows = (size_t)c.B * c.KVH * c.N;
  for (int which = 0; which < 2; ++which) {
    kva_kv *kv = which ? &cp.v : &cp.k;
    if (c.bits == 0) {
      void *d = dmalloc(rows * c.D * 2);
      fill(d, rows * c.D, seed + which, 0, -2.0f, 2.0f);
      *kv = kva_kv_float(d, KVA_BF16, c.B, c.KVH, c.N, c.D);
      cp.bufs[3 * which] = d;
    } else {
      size_t words = rows * c.D * c.bits / 32, groups = rows * (c.D / c.group);
      void *d = dmalloc(words * 4), *s = dmalloc(groups * 2), *b = dmalloc(groups * 2);
      fill(d, words, seed + 10 + which, 1, 0, 0);
      fill(s, groups, seed + 20 + which, 0, 0.01f, 0.1f);
      fill(b, groups, seed + 30 + which, 0, -0.5f, 0.5f);
      *kv = kva_kv_quantized(d, s, b, KVA_BF16, c.bits, c.group, c.B, c.KVH, c.N, c.D);
      cp.bufs[3 * which] = d;
      cp.bufs[3 * which + 1] = s;
      cp.bufs[3 * which + 2] = b;
    }
  }
  return cp;
}
static void free_copy(kvcopy &cp) {
  for (int i = 0; i < 6; ++i)
    if (cp.bufs[i]) cudaFree(cp.bufs[i]);
}

static double case_bytes(const bcase &c) {
  double rows = (double)c.B * c.KVH * c.N;
  double per = c.bits ? c.D * c.bits / 8.0 + 2.0 * 2.0 * (c.D / c.group) : c.D * 2.0;
  return 2.0 * rows * per;
}

/* Device-to-device copy bandwidth (bytes read + written), best of passes. */
static double copy_bandwidth(cudaStream_t s) {
  void *a = dmalloc(COPY_BYTES), *b = dmalloc(COPY_BYTES);
  fill(a, COPY_BYTES / 4, 7, 1, 0, 0);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int i = 0; i < COPY_PASSES; ++i) {
    CK(cudaEventRecord(e0, s));
    CK(cudaMemcpyAsync(b, a, COPY_BYTES, cudaMemcpyDeviceToDevice, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  cudaFree(a);
  cudaFree(b);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 2.0 * COPY_BYTES / (best * 1e-3) / 1e9;
}

int main(int argc, char **argv) {
  FILE *js = argc > 1 ? fopen(argv[1], "a") : NULL;
  bool pick[NCASES];
  for (int i = 0; i < NCASES; ++i) pick[i] = argc <= 2;
  for (const char *sel = argc > 2 ? argv[2] : NULL; sel && *sel;) {
    int i = atoi(sel);
    if (i >= 0 && i < NCASES) pick[i] = true;
    sel = strchr(sel, ',');
    if (sel) ++sel;
  }
  int ndev = kva_cuda_device_count();
  if (ndev == 0) {
    fprintf(stderr, "cuda_bench: no CUDA device\n");
    return 1;
  }
  char name[256];
  size_t mem = 0;
  KK(kva_cuda_device_info(0, name, sizeof name, &mem));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double copy_bw = copy_bandwidth(s);
  printf("device: %s, %.1f GiB; kvattn %s; %s\n", name, mem / 1073741824.0, kva_version(), kva_build_info());
  printf("device-to-device copy: %.0f GB/s (read + write, %.0f MiB, best of %d)\n", copy_bw,
         COPY_BYTES / 1048576.0, COPY_PASSES);
  printf("bf16 q/out, causal; median of %d event-timed calls after %d warm-ups, K/V rotated over >= %.0f MiB; "
         "graph = mean of a %d-call CUDA graph\n",
         REPS, WARMUP, ROTATE_BYTES / 1048576.0, GRAPH_CALLS);
  printf("%-7s %-6s %-10s %7s %2s %3s %9s %9s %9s %7s %6s\n", "op", "kv", "H/KVH/D", "N", "L", "B", "MB", "us",
         "us_graph", "GB/s", "%copy");
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CUDA, 0, 0, s};
  KK(kva_context_create(&ctx, &o));
  cudaEvent_t ev[REPS + 1], g0, g1;
  for (int i = 0; i <= REPS; ++i) CK(cudaEventCreate(&ev[i]));
  CK(cudaEventCreate(&g0));
  CK(cudaEventCreate(&g1));
  for (int ci = 0; ci < NCASES; ++ci) {
    if (!pick[ci]) continue;
    const bcase &c = cases[ci];
    const double bytes = case_bytes(c);
    int copies = (int)std::max(2.0, ROTATE_BYTES / bytes + 1.0);
    std::vector<kvcopy> cp;
    for (int i = 0; i < copies; ++i) cp.push_back(make_copy(c, 1000 * ci + 17 * i));
    size_t qn = (size_t)c.B * c.H * c.L * c.D;
    void *qd = dmalloc(qn * 2), *od = dmalloc(qn * 2);
    fill(qd, qn, 99 + ci, 0, -1.0f, 1.0f);
    kva_tensor q = kva_tensor_4d(qd, KVA_BF16, c.B, c.H, c.L, c.D);
    kva_tensor out = kva_tensor_4d(od, KVA_BF16, c.B, c.H, c.L, c.D);
    kva_attn_params p = kva_attn_defaults();
    p.mask.kind = KVA_MASK_CAUSAL;
    std::vector<kva_kv_view> views;
    for (int i = 0; i < copies; ++i) views.push_back(kva_view_contiguous(&cp[i].k, &cp[i].v, NULL));
    size_t wsb = 0;
    KK(kva_attention_workspace_size(ctx, &q, &views[0], &p, &wsb));
    void *ws = wsb ? dmalloc(wsb) : NULL;
    for (int i = 0; i < WARMUP; ++i) KK(kva_attention(ctx, &q, &views[i % copies], &p, &out, ws, wsb));
    for (int i = 0; i < REPS; ++i) {
      CK(cudaEventRecord(ev[i], s));
      KK(kva_attention(ctx, &q, &views[i % copies], &p, &out, ws, wsb));
    }
    CK(cudaEventRecord(ev[REPS], s));
    CK(cudaStreamSynchronize(s));
    std::vector<float> t(REPS);
    for (int i = 0; i < REPS; ++i) CK(cudaEventElapsedTime(&t[i], ev[i], ev[i + 1]));
    std::sort(t.begin(), t.end());
    const double us = t[REPS / 2] * 1e3;
    /* the same calls captured in one graph */
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < GRAPH_CALLS; ++i) KK(kva_attention(ctx, &q, &views[i % copies], &p, &out, ws, wsb));
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(g0, s));
    CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(g1, s));
    CK(cudaStreamSynchronize(s));
    float gms;
    CK(cudaEventElapsedTime(&gms, g0, g1));
    const double gus = gms * 1e3 / GRAPH_CALLS;
    /* the output must be finite (random data; the tests check values) */
    std::vector<uint16_t> oh(qn);
    CK(cudaMemcpy(oh.data(), od, qn * 2, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (size_t i = 0; i < qn; ++i) bad += (oh[i] & 0x7f80u) == 0x7f80u;
    char hs[32], kv[16];
    snprintf(hs, sizeof hs, "%d/%d/%d", c.H, c.KVH, c.D);
    if (c.bits) snprintf(kv, sizeof kv, "q%dg%d", c.bits, c.group);
    else snprintf(kv, sizeof kv, "bf16");
    const double gbps = bytes / (us * 1e-6) / 1e9;
    printf("%-7s %-6s %-10s %7lld %2d %3d %9.1f %9.1f %9.1f %7.0f %5.0f%%%s\n", c.kind, kv, hs, c.N, c.L, c.B,
           bytes / 1e6, us, gus, gbps, 100.0 * gbps / copy_bw, bad ? "  NON-FINITE OUTPUT" : "");
    fflush(stdout);
    if (js)
      fprintf(js,
              "{\"op\":\"%s\",\"kv\":\"%s\",\"H\":%d,\"KVH\":%d,\"D\":%d,\"N\":%lld,\"L\":%d,\"B\":%d,"
              "\"bytes\":%.0f,\"us\":%.2f,\"us_graph\":%.2f,\"gbps\":%.1f,\"copy_gbps\":%.1f,\"copies\":%d}\n",
              c.kind, kv, c.H, c.KVH, c.D, c.N, c.L, c.B, bytes, us, gus, gbps, copy_bw, copies);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    if (ws) cudaFree(ws);
    cudaFree(qd);
    cudaFree(od);
    for (auto &x : cp) free_copy(x);
  }
  kva_context_destroy(ctx);
  if (js) fclose(js);
  return 0;
}
