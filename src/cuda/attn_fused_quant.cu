/* Instances of the fused kernel (attn_fused.cuh) over MLX-affine quantized
 * K/V rows: 2, 4 and 8 bits (group size and scale dtype are runtime values);
 * E in {8, 16}, QW in {1, 2, 4, 8}. */
#include "cuda/attn_fused.cuh"

template int kvc_launch_fused_fmt<KVC_Q2>(const kvc_args &, const kvc_plan &, cudaStream_t);
template int kvc_launch_fused_fmt<KVC_Q4>(const kvc_args &, const kvc_plan &, cudaStream_t);
template int kvc_launch_fused_fmt<KVC_Q8>(const kvc_args &, const kvc_plan &, cudaStream_t);
template int kvc_fused_occupancy_fmt<KVC_Q2>(int, int);
template int kvc_fused_occupancy_fmt<KVC_Q4>(int, int);
template int kvc_fused_occupancy_fmt<KVC_Q8>(int, int);
