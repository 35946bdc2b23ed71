/* Instances of the fused kernel (attn_fused.cuh) over float K/V rows:
 * f32, f16, bf16; E in {8, 16}, QW in {1, 2, 4, 8}; f16 and bf16 at E = 16, QW 1 and 2 also
 * staged over block tables (kvc_fused_ring_inst). */
#include "cuda/attn_fused.cuh"

template int kvc_launch_fused_fmt<KVC_F32>(const kvc_args &, const kvc_plan &, cudaStream_t);
template int kvc_launch_fused_fmt<KVC_F16>(const kvc_args &, const kvc_plan &, cudaStream_t);
template int kvc_launch_fused_fmt<KVC_BF16>(const kvc_args &, const kvc_plan &, cudaStream_t);
template int kvc_fused_occupancy_fmt<KVC_F32>(int, int);
template int kvc_fused_occupancy_fmt<KVC_F16>(int, int);
template int kvc_fused_occupancy_fmt<KVC_BF16>(int, int);
template int kvc_fused_ring_occupancy_fmt<KVC_F16>(int, int);
template int kvc_fused_ring_occupancy_fmt<KVC_BF16>(int, int);
