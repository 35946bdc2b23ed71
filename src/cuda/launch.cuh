/* The CUDA backend's internal launchers (host side) and the fused path's
 * plan. context.cu selects, sizes the workspace and calls these; each kernel
 * file owns one launcher. Launchers only enqueue work on the stream: no
 * allocation, no synchronization, so every call is graph-capturable. */
#ifndef KVA_CUDA_LAUNCH_CUH
#define KVA_CUDA_LAUNCH_CUH

#include "cuda/common.cuh"

#include <cuda_runtime.h>

/* Threads per block of the fused kernel (warps split the token range). */
#define KVC_FUSED_WARPS 4
#define KVC_FUSED_THREADS (KVC_FUSED_WARPS * KVC_WARP)
/* Largest query-vector tile of the fused kernel, by elements per lane. */
#define KVC_FUSED_QW_E8 8
#define KVC_FUSED_QW_E16 4

/* The fused kernel's instance key and grid. Chosen from shapes only (never
 * from lengths), so a captured graph stays valid while lengths change; the
 * tuning never changes results beyond rounding. */
struct kvc_plan {
  int fmt;       /* kvc_fmt of K and V, or -1: no fused instance (general path) */
  int E;         /* elements per lane per row: 8 or 16 */
  int QW;        /* query vectors per block: 1, 2, 4, 8 */
  int qtiles;    /* ceil(rep * L / QW) */
  int unroll;    /* tokens per lane per step */
  int lanes_log2;
  int nsplit;
  long long chunk;
  int tc;        /* 1: a tensor-core kernel (attn_tc.cu; fmt KVC_Q4, KVC_Q8, KVC_BF16 or KVC_F16; QW = 8 or 32: narrow, 48: wide) instead of the fused one;
                    2: the per-warp q4 decode kernel (attn_tcd.cu); 3: the warpgroup verify kernel (attn_wg.cu; fmt KVC_Q4, KVC_BF16 or KVC_F16) */
  int group;     /* tensor-core: the K/V group size compiled into the instance (KVC_TC_GROUP), 0 = read at run time */
  int ring;      /* fused kernel over a BLOCK_TABLE view of bf16 / f16 rows: table rows per ring slot (the
                    staged instance, kvc_fused_ring_tok), 0 = rows loaded per lane through the table */
};

/* The group size compiled into the q4 decode instances of the tensor-core
 * kernel besides the run-time one: MLX's default. Constant group arithmetic
 * and shared-memory offsets (H200: 5-9 % faster than the same code with the
 * group read at run time, 8/4/256 and 24/4/256 at 128k, B = 16 at 32k). */
#define KVC_TC_GROUP 64

/* Opt-in dynamic shared memory per block on sm_90: the most a tensor-core
 * instance may ask for (the selector skips layouts beyond it). */
#define KVC_TC_SMEM_MAX (227 * 1024)

/* The narrow tensor-core kernel (attn_tc.cu): warps per block (each takes 16
 * tokens of a 64-token stage). */
#define KVC_TC_WARPS 4
#define KVC_TC_THREADS (KVC_TC_WARPS * KVC_WARP)
#define KVC_TC_STEP 64 /* tokens per stage: split chunks are whole stages */

/* The per-warp q4 decode kernel (attn_tcd.cu): warps per block (each owns
 * 16-token tiles of the split); split chunks are multiples of KVC_TC_STEP. */
#define KVC_TCD_WARPS 4
#define KVC_TCD_THREADS (KVC_TCD_WARPS * KVC_WARP)

/* The warpgroup kernel over 16-bit rows (attn_wg.cu): each thread copies a
 * run of this many consecutive rows per stage, which a block table's
 * blocks must hold (a run then spans at most two blocks: kvc_wg_run). */
#define KVC_WG_FLOAT_RUN(D) ((D) == 512 ? 8 : (D) / 32)

/* Formats with a fused instance (K and V share one). */
enum kvc_fmt { KVC_F32 = 0, KVC_F16, KVC_BF16, KVC_Q2, KVC_Q4, KVC_Q8, KVC_E4M3, KVC_E5M2, KVC_NFMT };

int kvc_launch_generic(const kvc_args &a, cudaStream_t stream);
int kvc_launch_fused(const kvc_args &a, const kvc_plan &plan, cudaStream_t stream);
#define KVC_MERGE_DIMS 64 /* output dims per merge block: its grid is (L * ceil(Dv / KVC_MERGE_DIMS), H, B) */
int kvc_launch_merge(const kvc_args &a, cudaStream_t stream);
int kvc_launch_tc(const kvc_args &a, const kvc_plan &plan, cudaStream_t stream);
/* Dynamic shared memory of the tensor-core kernel for K/V format f, head
 * dim D, groups per K and V row (0 for 16-bit float rows), ntm n-tiles of 8
 * query vectors; resident blocks per SM of the instance with compiled group
 * size g (0: run time) for that shared memory (0: none). */
int kvc_tc_smem(int f, int D, int gk, int gv, int ntm);
int kvc_tc_occupancy(int f, int D, int ntm, int g, int smem);
int kvc_launch_tcd(const kvc_args &a, const kvc_plan &plan, cudaStream_t stream);
/* The per-warp q4 kernel: its dynamic shared memory at head dim D; groups
 * per S m-tile for q query vectors per KV head; whether q takes the
 * 16-vector instances (one s8 query part); resident blocks per SM of that
 * instance (tbl: BLOCK_TABLE rows; 0: none). */
int kvc_tcd_smem(int D);
int kvc_tcd_gpt(int D, int q);
int kvc_tcd_hi(int q);
int kvc_tcd_occupancy(int D, int gpt, int hi, int tbl);
/* The warpgroup (wgmma) verify kernel (attn_wg.cu, sm_90a) for rows f
 * (KVC_Q4, KVC_BF16, KVC_F16): its dynamic shared memory at head dim D with
 * gk / gv groups per K / V row (q4); resident blocks per SM for that shared
 * memory (0: none). */
int kvc_wg_smem(int f, int D, int gk, int gv);
int kvc_wg_occupancy(int f, int D, int smem);
int kvc_launch_wg(const kvc_args &a, const kvc_plan &plan, cudaStream_t stream);
/* The fused kernel's launcher for one format (attn_fused.cuh; instances in
 * attn_fused_float.cu and attn_fused_quant.cu). */
template <int FMT> int kvc_launch_fused_fmt(const kvc_args &a, const kvc_plan &plan, cudaStream_t stream);
/* Resident blocks per SM of one fused instance (0 when it cannot run). */
template <int FMT> int kvc_fused_occupancy_fmt(int E, int QW);
/* ... of the staged instance (bf16 / f16, E = 16, QW 1 or 2) with smem bytes of dynamic shared memory;
 * also raises the instance's dynamic shared-memory limit (before its first launch). */
template <int FMT> int kvc_fused_ring_occupancy_fmt(int QW, int smem);
/* The fused kernel's staged BLOCK_TABLE loop (bf16 / f16 rows, E = 16, QW <= 2): each warp copies the
 * K and V rows of its chunks of table rows (chunks of kvc_plan.ring rows, inside one pool block) into
 * its own ring of KVC_RING_SLOTS slots of shared memory, KVC_RING_SLOTS - 1 chunks ahead of its math.
 * A slot is about the bytes KVA_CUDA_FUSED_RING names (tuning only: never changes results beyond
 * rounding); the loop is off unless it is set: on the H200 (8/4/256 bf16 paged/16) it measured no
 * faster than the per-lane table loads (4096: 62.2 / 700.7 / 188.8 us against 63.7 / 722.1 / 192.2
 * at 32k B=1, 32k B=16, 128k B=1; 8192: 72.6 / 872.9 / 231.6). */
#define KVC_RING_SLOTS 3
/* Dynamic shared memory of the staged loop: KVC_FUSED_WARPS rings of KVC_RING_SLOTS slots of `ring`
 * K rows (2 Dk bytes each) and V rows (2 Dv bytes). */
__host__ __device__ constexpr int kvc_fused_ring_smem(int Dk, int Dv, int ring) {
  return KVC_FUSED_WARPS * KVC_RING_SLOTS * ring * 2 * (Dk + Dv);
}
/* Tokens per lane per step of the fused kernel (registers: QW*E q values and
 * QW*E outputs per lane). */
__host__ __device__ constexpr int kvc_unroll(int E, int QW) { return E == 8 && QW <= 2 ? 4 : 2; }
#endif
