/* PTX wrappers and bit constants shared by the tensor-core kernels
 * (attn_tc.cu, attn_tcd.cu, attn_wg.cu): mma.sync on bf16 / f16 / 8-bit
 * operands, Hopper's wgmma (bf16 / f16), bf16x2 arithmetic, cp.async into shared memory.
 * No kernels here. */
#ifndef KVA_CUDA_MMA_CUH
#define KVA_CUDA_MMA_CUH

#include <stdint.h>

/* bf16x2 constants (both halves) */
#define KVC_BF16X2_128 0x43004300u  /* 128.0: a code OR'ed into its mantissa is 128 + c */
#define KVC_BF16X2_ONE 0x3F803F80u
#define KVC_BF16X2_M128 0xC300C300u /* -128.0 */
#define KVC_BF16X2_M136 0xC308C308u /* -136.0: (128 + c) - 136 = c - 8, exact */
#define KVC_NIB_PAIR 0x000F000Fu    /* a code in each 16-bit half */
#define KVC_BF16X2_16 0x41804180u   /* 16.0 */
#define KVC_BF16X2_M2176 0xC508C508u /* -2176.0 = -(16 + 1) 128 (q8 P.V) */

__device__ __forceinline__ uint32_t kvc_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d; /* (a & b) | c in one LOP3 */
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t kvc_fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t kvc_mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
/* d += a (16x16, row) * b (16x8, col), bf16 operands, f32 accumulators. */
__device__ __forceinline__ void kvc_mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* The same with f16 operands. */
__device__ __forceinline__ void kvc_mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* d += a (16x32 u8, row) * b (32x8 s8, col), s32 accumulators (exact). */
__device__ __forceinline__ void kvc_mma_u8s8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* d += a (16x32 s8, row) * b (32x8 u8, col), s32 accumulators (exact). */
__device__ __forceinline__ void kvc_mma_s8u8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* cp.async of BYTES (4, 8 or 16) from global to the shared address d;
 * src_bytes = 0 writes zeros and reads nothing. */
template <int BYTES> __device__ __forceinline__ void kvc_cp_async(uint32_t d, const void *src, int src_bytes) {
  if (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(d), "l"(src), "n"(BYTES), "r"(src_bytes)
                 : "memory");
}
/* A 16-bit store to shared address d. */
__device__ __forceinline__ void kvc_sts16(uint32_t d, unsigned short x) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(d), "h"(x) : "memory");
}
__device__ __forceinline__ void kvc_cp_commit(void) { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void kvc_cp_wait(void) {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
/* mbarriers in shared memory (sm_80+): init with an arrival count; a
 * thread's arrival once all its earlier cp.async copies have landed
 * (noinc: counted against the init count); a plain arrival (release); a
 * wait for the completion of the phase of the given parity (acquire). */
__device__ __forceinline__ void kvc_mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void kvc_mbar_arrive_cp(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void kvc_mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void kvc_mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}" ::"r"(bar),
               "r"(parity)
               : "memory");
}
__device__ __forceinline__ uint32_t kvc_lds16(const unsigned char *p) { return *(const unsigned short *)p; }
/* bf16x2 of (lo, hi), each rounded to nearest even. */
__device__ __forceinline__ uint32_t kvc_bf16x2_of(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
/* ---- Hopper warpgroup mma (wgmma, sm_90a only: callers guard with
 * __CUDA_ARCH_FEAT_SM90_ALL) ---- */
/* Shared-memory matrix descriptor of a tile in the 128-byte swizzle: 14-bit
 * start address, leading and stride byte offsets (all >> 4), swizzle mode 1
 * (bits 62-63). The tile base must be 1024-byte aligned. */
__device__ __forceinline__ uint64_t kvc_wg_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
         (1ull << 62);
}
__device__ __forceinline__ void kvc_wg_fence(void) { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void kvc_wg_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void kvc_wg_wait(void) {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
/* Generic-proxy shared-memory writes made visible to the async proxy (the
 * wgmma operand reads), before the barrier that publishes them. */
__device__ __forceinline__ void kvc_fence_proxy_async(void) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
/* Orders the accumulator registers after a wgmma wait (the compiler sees no
 * dependency between the wait and the registers otherwise). */
template <int N> __device__ __forceinline__ void kvc_wg_fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
/* d (64 x 32, f32; per warp the lane layout of mma.m16n8, 4 n-tiles) = a b^T
 * (+ d when ACC): a 64 x 16 and b 32 x 16, both bf16 (H: f16) K-major tiles
 * in shared memory (descriptors). */
#define KVC_WGMMA_SS32(T)                                                                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                          \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." T "." T " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
               : "l"(da), "l"(db), "n"(ACC))
template <int ACC, bool H = false> __device__ __forceinline__ void kvc_wgmma_ss32(float (&d)[16], uint64_t da, uint64_t db) {
  if constexpr (H)
    KVC_WGMMA_SS32("f16");
  else
    KVC_WGMMA_SS32("bf16");
}
#undef KVC_WGMMA_SS32
/* d (64 x 64, f32) += a b: a 64 x 16 bf16 (H: f16) from registers (the
 * mma.m16n8k16 A fragment of each warp's 16 rows), b 16 x 64 of the same
 * type N-major in shared memory (descriptor; transposed operand). */
#define KVC_WGMMA_RS(T)                                                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                          \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1))
template <bool H = false> __device__ __forceinline__ void kvc_wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (H)
    KVC_WGMMA_RS("f16");
  else
    KVC_WGMMA_RS("bf16");
}
#undef KVC_WGMMA_RS
/* f16x2 of (lo, hi), each rounded to nearest even; an f16 (low 16 bits) as f32. */
__device__ __forceinline__ uint32_t kvc_f16x2_of(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ float kvc_f16_lo(uint32_t x) {
  float f;
  asm("{\n.reg .b16 h, u;\nmov.b32 {h, u}, %1;\ncvt.f32.f16 %0, h;\n}" : "=f"(f) : "r"(x));
  return f;
}
#endif
