/* The `kvattn` tool's shared types: benchmark cases (shape, KV format,
 * layout), options, results, the backend-ops layer that keeps allocation,
 * copies and timing apart from the case logic (a CUDA variant plugs in under
 * KVA_HAVE_CUDA), the rotated K/V cache set, and the probes (memory read
 * bandwidth, FMA throughput). Only the public API (include/kvattn.h) is used. */
#ifndef KVA_TOOL_BENCH_H
#define KVA_TOOL_BENCH_H

#include "kvattn.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define KB_GIB (1024.0 * 1024.0 * 1024.0)
#define KB_MIB (1024.0 * 1024.0)
#define KB_MAX_THREADS 256

/* Exit codes of the tool. */
enum { KB_EXIT_OK = 0, KB_EXIT_FAIL = 1, KB_EXIT_USAGE = 2 };

/* ------------------------------------------------------------ cases */
/* K/V storage format of a case. */
typedef struct kb_kvfmt {
  int bits;        /* 0 = float rows; 2, 4, 8 = MLX affine quantized */
  kva_dtype dtype; /* float rows: element dtype (fp8: one f32 scale per row); quantized: scale/bias dtype */
  int group;       /* quantized: elements per scale/bias group; 0 for float */
} kb_kvfmt;

/* One benchmark case. Shapes follow the library: q [B, H, L, Dk],
 * K [B, KVH, N, Dk], V [B, KVH, N, Dv], out [B, H, L, Dv]. */
typedef struct kb_case {
  char preset[24];          /* preset name, or "custom" */
  int64_t H, KVH, Dk, Dv;   /* query heads, KV heads, head dims */
  int64_t N;                /* cache length of every sequence */
  int64_t L;                /* query rows per sequence (1 decode, > 1 causal verify) */
  int64_t tree;             /* 0: causal rows; > 0: tree verify of L = tree nodes (kb_tree_parents) */
  int64_t B;                /* sequences */
  kb_kvfmt kv;
  kva_dtype qdtype, odtype; /* query / output dtype (bf16 in the suites) */
  kva_layout layout;        /* contiguous now; paged when the paged API lands */
  int64_t block;            /* paged: tokens per block; 0 for contiguous */
  bool in_order;            /* paged: each sequence's blocks in order in the pool (else shuffled) */
  unsigned hadamard;        /* --hadamard: params.flags |= these (KVA_ATTN_ROTATED_K | _V: a rotated cache) */
} kb_case;

/* The tree of a tree-verify case (--tree N, KVA_MASK_TREE), an EAGLE-style
 * draft tree of n <= KVA_TREE_MAX_ROWS nodes in breadth-first order: node 0
 * the root; level 1 its top-4 children; each next level takes up to
 * max(4, n / 4) nodes, children of the previous level's nodes in rank order,
 * 4 per parent (rank r's parent is rank r / 4 of the level above), until n
 * nodes (16: levels 1/4/4/4/3, depth 5; 32: 1/4/8/8/8/3, depth 6; 64:
 * 1/4/16/16/16/11, depth 6). parent[0] = -1. Returns the depth. */
int kb_tree_parents(int64_t n, int *parent);
/* Its KVA_MASK_TREE bits, u32 [n, ceil(n / 32)] (row i: itself and its
 * ancestors). */
void kb_tree_bits(int64_t n, const int *parent, uint32_t *bits);

/* "q4" / "bf16" ... and "q4g64" / "bf16" (with the group). */
const char *kb_kv_name(const kb_kvfmt *f);
void kb_kv_label(const kb_kvfmt *f, char *buf, size_t n);
const char *kb_layout_name(kva_layout l);
/* "gemma3-4b 8/4/256 q4g64 N=32768 L=1 B=1" (" paged/16" after the format when paged) */
void kb_case_label(const kb_case *c, char *buf, size_t n);

/* Bytes of one K (or V) row of `D` elements in format f: data + scale + bias. */
double kb_row_bytes(const kb_kvfmt *f, int64_t D);
/* Keys visible to at least one query row of a sequence (the token range the
 * kernel must read): the causal mask with the rows at the end sees all N. */
int64_t kb_visible_keys(const kb_case *c);
/* K + V data + scales + biases read: B * KVH * visible * (row_K + row_V). */
double kb_case_kv_bytes(const kb_case *c);
/* q read + out written: B * H * L * (Dk * |q| + Dv * |out|). */
double kb_case_qo_bytes(const kb_case *c);
/* 2 * (Dk + Dv) multiply-adds per (query vector, visible key):
 * B * KVH * rep * (Dk + Dv) * 2 * sum_i visible(row i). */
double kb_case_flops(const kb_case *c);
/* Do two cases read the same K/V cache (so the data can be kept)? */
bool kb_same_cache(const kb_case *a, const kb_case *b);

/* Presets (H/KVH/D). Returns false for an unknown name. */
typedef struct kb_preset {
  const char *name;
  int64_t H, KVH, D;
} kb_preset;
bool kb_find_preset(const char *name, kb_preset *out);
void kb_list_presets(FILE *f);

/* What the command line selected. Axis arrays hold the values to combine;
 * an empty axis takes the suite's default. */
#define KB_MAX_AXIS 16
typedef struct kb_axes {
  int n_preset;
  kb_preset preset[KB_MAX_AXIS];
  bool heads_set, dim_set;
  int64_t H, KVH, Dk, Dv;
  int n_ctx, n_rows, n_batch, n_kv, n_tree;
  int64_t ctx[KB_MAX_AXIS], rows[KB_MAX_AXIS], batch[KB_MAX_AXIS];
  int64_t tree[KB_MAX_AXIS]; /* --tree: tree-verify cases of these node counts, after the rows' cases */
  kb_kvfmt kv[KB_MAX_AXIS];
  int group; /* 0 = default (64) */
  kva_dtype qdtype, odtype;
  kva_layout layout;
  int64_t block;
  bool in_order; /* --block-order sequential */
} kb_axes;

/* True when the command line named any shape axis (then the run is a grid
 * of those axes instead of the default suite). */
bool kb_axes_explicit(const kb_axes *a);
typedef enum kb_suite { KB_SUITE_DEFAULT, KB_SUITE_QUICK, KB_SUITE_FULL } kb_suite;
/* Builds the case list (cases grouped so consecutive cases share a cache).
 * Returns the count, or -1 with a message in err on an invalid combination. */
int kb_build_cases(const kb_axes *a, kb_suite suite, kb_case **out, char *err, size_t errn);

/* ---------------------------------------------------------- options */
typedef struct kb_opts {
  kva_backend backend;
  int threads;          /* 0 = all cores */
  bool json, quick, full, check, quiet;
  bool list;            /* print the cases and their costs, run nothing */
  bool exact;           /* --exact: params.flags = KVA_ATTN_EXACT ("[exact f32]" kernels only) */
  int hadamard;         /* --hadamard: 0 off, 1 on (every case rotated), 2 both (each case twice) */
  unsigned hadamard_flags; /* --hadamard-of: the rotation flags (default KVA_ATTN_ROTATED_K | _V) */
  int warmups;          /* untimed calls before timing */
  int min_reps;         /* timed calls at least (fewer only for huge cases) */
  int max_reps;         /* timed calls at most */
  double budget_s;      /* timing budget per case (after min_reps) */
  double rotate_bytes;  /* rotate each case's K/V over at least this many bytes */
  double mem_cap_bytes; /* never allocate more than this for one case's copies */
  double bw_bytes;      /* bandwidth probe array size */
  int bw_passes;        /* bandwidth probe: best of this many passes */
  uint64_t seed;
  bool cuda_flush_memset; /* --cuda-flush memset: the older flush ahead of each CUDA call (dirty L2 lines) */
  bool pattern;           /* --pattern: time kb_probe_pattern alternated with the calls (CPU, contiguous) */
} kb_opts;

/* ---------------------------------------------------------- results */
typedef enum kb_status { KB_PASS = 0, KB_FAIL = 1, KB_ERROR = 2, KB_UNCHECKED = 3 } kb_status;

typedef struct kb_result {
  double us, us_min, us_p90;  /* median / min / 90th percentile of timed calls */
  int reps, warmups;
  double kv_bytes, qo_bytes, flops;
  double gbps, bw_frac, gflops;
  double floor_us;            /* kv_bytes at the probed DRAM bandwidth */
  double fma_floor_us;        /* flops at the probed f32 FMA peak */
  int copies;                 /* distinct K/V copies rotated over */
  double copy_bytes, rotation_bytes;
  bool cold;                  /* rotation (or the case alone) >= 1 GiB */
  const char *note;           /* why not cold, or NULL */
  int checked_rows;           /* (head, row) output vectors compared with the oracle */
  double max_rel_err, rel_l2; /* worst row: max|out-ref|/max|ref|, ||out-ref||/||ref|| */
  bool nonfinite, guard_ok;
  kb_status status;
  char error[256];
  char kernel[128];           /* kva_attention_kernel's description of the case's kernel */
  double setup_s, time_s, check_s;
  double pattern_us;          /* --pattern: median of the no-math read pattern's passes (0: not run) */
} kb_result;

/* Tolerances of the oracle check (see BENCHMARKS.md). */
#define KB_TOL_MAX_REL 2e-2
#define KB_TOL_REL_L2 1e-2

/* ----------------------------------------------------- backend ops */
/* What the bench needs from a backend, in one place: memory, copies, one
 * timed call, and the backend's memory ceiling. The CPU variant uses host
 * memory and the wall clock; a CUDA variant (KVA_HAVE_CUDA) would use device
 * memory, cudaMemcpy and CUDA events, and a device-to-device copy ceiling. */
typedef struct kb_backend kb_backend;
struct kb_backend {
  const char *name;     /* "cpu" */
  kva_backend kind;
  kva_context *ctx;
  int threads;          /* resolved worker threads */
  int host_threads;     /* threads for host-side work: filling caches, the oracle check */
  bool host_memory;     /* backend memory is host memory (the master copy is copy 0) */
  void *priv;           /* the backend's own state (CUDA: timing events) */
  void *(*alloc)(kb_backend *be, size_t bytes);
  void (*release)(kb_backend *be, void *p, size_t bytes);
  int (*copy_in)(kb_backend *be, void *dst, const void *src, size_t bytes);  /* host -> backend */
  int (*copy_out)(kb_backend *be, void *dst, const void *src, size_t bytes); /* backend -> host */
  int (*replicate)(kb_backend *be, void *dst, const void *src, size_t bytes); /* backend -> backend */
  /* One kva_attention call, its time in microseconds. */
  int (*time_call)(kb_backend *be, const kva_tensor *q, const kva_kv_view *kv,
                   const kva_attn_params *p, kva_tensor *out, double *us);
  /* Memory ceiling in GB/s (CPU: DRAM read probe) and a line describing it. */
  int (*ceiling)(kb_backend *be, const kb_opts *o, double *gbps, char *desc, size_t n);
  void (*destroy)(kb_backend *be);
};

/* Creates the backend named in the options; on failure prints why and
 * returns a negative status (KVA_ENODEVICE for a missing device). */
int kb_backend_open(const kb_opts *o, kb_backend *be, char *err, size_t errn);

/* ------------------------------------------------------- K/V cache set */
/* The operands of one cache, in the order they sit in a copy. */
enum { KB_KD, KB_KS, KB_KB, KB_VD, KB_VS, KB_VB, KB_NPARTS };

/* `copies` identical copies of one case's K and V (data, scales, biases) in
 * backend memory, rotated over so each timed call reads memory not in cache.
 * Contiguous layout: copies of one contiguous cache [B, KVH, N, .].
 * Paged layout: a contiguous host master plus `copies` block pools made from
 * it (kva_pool_from_contiguous, blocks shuffled over the pool) and one view
 * of the B sequences per pool. On a device backend each pool's memory and
 * its block table (kva_paged_view_block_table) are copied to the device and
 * the host pool is dropped: the timed calls read BLOCK_TABLE views. */
typedef struct kb_cacheset {
  kb_case key;                  /* the case it was made for (B, KVH, N, D, format) */
  size_t off[KB_NPARTS], size[KB_NPARTS];
  size_t copy_bytes;            /* bytes of one contiguous copy (parts aligned) */
  size_t rotated_bytes;         /* bytes the rotation spans (all copies or pools) */
  int copies;
  char *base;                   /* contiguous: backend memory, copies * copy_bytes */
  char *host;                   /* host master (== base when backend memory is host) */
  struct kva_pool **pools;      /* paged: [copies] */
  struct kva_paged_view **views; /* paged, host memory: [copies] */
  /* paged, device memory: per copy the pool image, its K/V descriptors and
   * block table (arrays in dev_mem after the pool image) */
  void **dev_mem;
  kva_kv *dev_k, *dev_v;
  kva_block_table *dev_bt;
  const char *note;             /* why the rotation is below 1 GiB, or NULL */
} kb_cacheset;

/* Allocates and fills the copies (fresh random bf16 values, quantized with
 * kva_quantize for quantized formats; copies replicate copy 0). */
int kb_cacheset_make(kb_backend *be, const kb_opts *o, const kb_case *c, uint64_t seed,
                     kb_cacheset *cs, char *err, size_t errn);
void kb_cacheset_free(kb_backend *be, kb_cacheset *cs);
/* Contiguous descriptors of copy i (backend memory) or of the host master (i < 0). */
void kb_cacheset_kv(const kb_cacheset *cs, int i, kva_kv *k, kva_kv *v);
/* The view the timed call i reads: copy (or pool) i % copies. */
kva_kv_view kb_cacheset_view(const kb_cacheset *cs, int i);

/* --------------------------------------------------------- the check */
/* Is (sequence b, KV head hk) one of the pairs the check compares (first and
 * last KV head of the first and last sequence)? In cases.c: the cache set
 * (data.c) fills those pairs with their own values. */
bool kb_is_sampled(const kb_case *c, int64_t b, int64_t hk);
/* Overwrites the query vectors of the sampled heads with probes that make
 * a causal-mask error visible (see check.c), from the host master. */
int kb_write_probes(const kb_case *c, const kb_cacheset *cs, kva_tensor *q_host, char *err,
                    size_t errn);
/* Compares out (host copy) with kva_reference_attention on the sampled
 * (sequence, KV head) pairs over the host master, on `threads` threads;
 * fills the check fields of r. */
int kb_check(const kb_case *c, const kb_cacheset *cs, const kva_tensor *q_host,
             const kva_tensor *out_host, const kva_attn_params *p, int threads, kb_result *r,
             char *err, size_t errn);

/* ----------------------------------------------------------- probes */
/* Runs fn(arg, thread_index) on `threads` threads (the caller's thread is
 * index 0) and waits for all. */
int kb_parallel(int threads, void (*fn)(void *arg, int t), void *arg);
/* DRAM read bandwidth: T threads sum disjoint slices of an array of `bytes`
 * (4 vector accumulators each), best of `passes`. GB/s = 1e9 bytes/s. */
int kb_probe_read_bw(int threads, size_t bytes, int passes, double *gbps, const char **isa);
/* The CPU kernels' read pattern with no math, over contiguous K/V operands
 * (`kvattn bench --pattern`): T threads take items (sequence, KV head,
 * chunk of whole 32-token tiles; about four per thread) in turn; per tile
 * the scale and bias rows of K and V, then K's data rows, each prefetching
 * the same row of the next tile's K arrays into L2, then V's likewise (the
 * fused kernels' order, cpu/simd/tiles.h's prefetch); one 8-byte load per
 * cache line (rows packed along tokens: one run per tile and array, the
 * next tile's prefetches line for line alongside; ~40 instructions per
 * token-head at q4 D = 256). Wall time of one pass, µs. */
int kb_probe_pattern(int threads, const kva_kv *k, const kva_kv *v, double *us);
/* f32 FMA throughput on T threads (independent vector FMA chains), GFLOP/s. */
int kb_probe_fma(int threads, double *gflops, const char **isa);

/* ------------------------------------------------------------- misc */
double kb_now(void); /* monotonic seconds */
/* The "model name" of /proc/cpuinfo ("unknown CPU" elsewhere); returns buf. */
const char *kb_cpu_model(char *buf, size_t n);
/* 1-minute load average (/proc/loadavg), or -1 when unknown. */
double kb_loadavg(void);
/* splitmix64 step. */
static inline uint64_t kb_mix64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/* Approximately N(0, 1) from one 64-bit draw: the sum of four 16-bit
 * uniforms (Irwin-Hall), centred and scaled to unit variance. */
static inline float kb_randn(uint64_t *s) {
  uint64_t r = kb_mix64(s);
  const float inv_u16 = 1.0f / 65536.0f, irwin_hall4_sd = 0.57735027f; /* sqrt(4/12) */
  float sum = (float)(r & 0xffff) + (float)((r >> 16) & 0xffff) + (float)((r >> 32) & 0xffff) +
              (float)(r >> 48);
  return (sum * inv_u16 - 2.0f) / irwin_hall4_sd;
}
/* fp8 rows (KVA_F8E4M3 / KVA_F8E5M2, with one f32 scale per (token, head))? */
static inline bool kb_is_fp8(kva_dtype dt) { return dt == KVA_F8E4M3 || dt == KVA_F8E5M2; }
/* Element load / store of a host float (f32/f16/bf16) through the public
 * conversions. */
static inline float kb_load_f(const void *p, kva_dtype dt) {
  switch (dt) {
  case KVA_F32: return *(const float *)p;
  case KVA_F16: return kva_f16_to_f32(*(const uint16_t *)p);
  case KVA_BF16: return kva_bf16_to_f32(*(const uint16_t *)p);
  default: return 0.0f;
  }
}
static inline void kb_store_f(void *p, kva_dtype dt, float x) {
  switch (dt) {
  case KVA_F32: *(float *)p = x; break;
  case KVA_F16: *(uint16_t *)p = kva_f32_to_f16(x); break;
  case KVA_BF16: *(uint16_t *)p = kva_f32_to_bf16(x); break;
  default: break;
  }
}
/* Fills a host tensor of any float dtype (contiguous) with kb_randn values. */
void kb_fill_randn(void *data, kva_dtype dt, size_t n, uint64_t seed);

/* The bench command (bench.c). Returns the exit code. */
int kb_run_bench(const kb_opts *o, const kb_axes *a, kb_suite suite);

#endif
