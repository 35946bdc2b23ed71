/* PTX wrappers and bit constants shared by the tensor-core kernels
 * (attn_tc.cu, attn_tcd.cu): mma.sync on bf16 / f16 / 8-bit operands,
 * bf16x2 arithmetic, cp.async into shared memory. No kernels here. */
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
__device__ __forceinline__ void kvc_cp_commit(void) { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void kvc_cp_wait(void) {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ uint32_t kvc_lds16(const unsigned char *p) { return *(const unsigned short *)p; }
/* bf16x2 of (lo, hi), each rounded to nearest even. */
__device__ __forceinline__ uint32_t kvc_bf16x2_of(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
#endif
