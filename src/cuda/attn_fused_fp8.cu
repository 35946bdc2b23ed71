/* Instances of the fused kernel (attn_fused.cuh) over fp8 K/V rows (e4m3,
 * e5m2) with one f32 scale per (token, head); E in {8, 16}, QW in {1, 2, 4, 8}.
 * Math: s = scale * (q . codes), o += (p * scale) * codes; codes to f16 by
 *   cvt.rn.f16x2.e4m3x2 / e5m2x2 (two per instruction, exact), then f32.
 * Traffic (decode, the memory floor): per (token, KV head) Dk + Dv bytes of
 *   codes plus 4 bytes of scales per operand (none when the scale is shared:
 *   strides 0, one cached float), read once for all rep * L query vectors:
 *   half the bytes of bf16 rows. FLOPs: 2 (Dk + Dv) per query vector and
 *   token on CUDA cores, about 2 rep L FLOPs per byte at D 256 against the
 *   H200's ~14 (67 TFLOPS f32 / 4.8 TB/s): decode at rep <= 4 is bounded by
 *   HBM bandwidth (8/4/256 at 128k tokens, B = 1, reads 4 * 131072 *
 *   (512 + 8) bytes = 273 MB: ~57 us), wide verify (rep L >= 8) by f32 FLOPs.
 * Launch: as attn_fused.cuh (grid (qtiles, nsplit, B * KVH)). */
#include "cuda/attn_fused.cuh"

template int kvc_launch_fused_fmt<KVC_E4M3>(const kvc_args &, const kvc_plan &, cudaStream_t);
template int kvc_launch_fused_fmt<KVC_E5M2>(const kvc_args &, const kvc_plan &, cudaStream_t);
template int kvc_fused_occupancy_fmt<KVC_E4M3>(int, int);
template int kvc_fused_occupancy_fmt<KVC_E5M2>(int, int);
