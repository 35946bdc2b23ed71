/* CPU attention driver.
 * Work split: each sequence's visible token range is cut into chunks of equal
 * size (chosen so there are ~KVA_ITEMS_PER_THREAD items per thread, never
 * fewer than KVA_MIN_CHUNK tokens); one item = (sequence, query-row group,
 * KV head, chunk) computes the partial softmax states of its rep*rows query
 * vectors with a kernel from src/cpu/simd/. A second pass merges each
 * vector's chunk states in order, adds the sink and writes the output.
 * Ragged batches split into equal chunks, so no thread idles on a short
 * sequence (item order: see run_item). Workspace: per-sequence tables +
 * partial states + per-thread scratch. */
#include "core/backend.h"
#include "cpu/kernel.h"
#include "cpu/threadpool.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Tuning (never changes results beyond rounding of the merge order). */
#define KVA_ITEMS_PER_THREAD 16 /* small chunks: ragged batches keep every thread busy */
#define KVA_MIN_CHUNK 256
#define KVA_MAX_CHUNK 4096
#define KVA_ALIGN 64
#define KVA_ITEM_VECTORS 256 /* L > 16 on the fused kernels: query vectors per item (rows of one group times rep) */

/* ---- SIMD level ---- */
/* Which levels are built follows the target (the Makefile's SIMD_LEVELS):
 * x86 builds all four and picks by cpuid; other architectures build the
 * portable level only (generic vectors: NEON on aarch64). */
#if defined(__x86_64__) || defined(__i386__)
#define KVA_X86 1
/* The sanitizer and fuzz builds compile only the levels their build host
 * runs (the Makefile's SAN_LEVELS): -DKVA_NO_SIMD_<level> leaves one out
 * (its slot NULL, never detected, refused by kva_cpu_set_simd). */
#ifdef KVA_NO_SIMD_avx2
#define KVA_L_AVX2 NULL
#define KVA_S_AVX2 ""
#else
#define KVA_L_AVX2 &kva_cpu_kernels_avx2
#define KVA_S_AVX2 " avx2"
#endif
#ifdef KVA_NO_SIMD_avxvnni
#define KVA_L_AVXVNNI NULL
#define KVA_S_AVXVNNI ""
#else
#define KVA_L_AVXVNNI &kva_cpu_kernels_avxvnni
#define KVA_S_AVXVNNI " avxvnni"
#endif
#ifdef KVA_NO_SIMD_avx512
#define KVA_L_AVX512 NULL
#define KVA_S_AVX512 ""
#else
#define KVA_L_AVX512 &kva_cpu_kernels_avx512
#define KVA_S_AVX512 " avx512"
#endif
#define KVA_CPU_LEVELS "portable" KVA_S_AVX2 KVA_S_AVXVNNI KVA_S_AVX512
#else
#define KVA_X86 0
#define KVA_CPU_LEVELS "portable"
#endif
/* Process-wide overrides (kva_cpu_set_simd, and the tests' general-only
 * switch): atomics, read once at the start of each call, so a change made
 * while other threads call applies from their next call. */
static _Atomic(const kva_cpu_kernels *) forced;
static atomic_int general_only; /* kva_cpu_general_only */
void kva_cpu_general_only(int on) { atomic_store_explicit(&general_only, on != 0, memory_order_relaxed); }
static int general_only_set(void) { return atomic_load_explicit(&general_only, memory_order_relaxed); }

#if KVA_X86
#include <cpuid.h>
/* The x86 levels from lowest to highest; a level runs where the CPU has
 * its features (avxvnni: AVX2 + AVX-VNNI, e.g. Intel client cores since
 * Alder Lake, Sierra Forest, AMD Zen 5; avx512 need not include it: Zen 4
 * has AVX-512 VNNI but not the VEX form). */
#define KVA_NLEVELS 4
static const char *const level_names[KVA_NLEVELS] = {"portable", "avx2", "avxvnni", "avx512"};
static const kva_cpu_kernels *const levels[KVA_NLEVELS] = {&kva_cpu_kernels_portable, KVA_L_AVX2, KVA_L_AVXVNNI,
                                                            KVA_L_AVX512};
/* Bit i: the CPU (and the OS's consent in XCR0 to the register state)
 * runs level i; by cpuid, once (cpuid traps to the hypervisor in a
 * virtual machine: it took ~10 % of a 60 µs call when run on every call). */
static unsigned cpu_levels(void) {
  static atomic_uint cached; /* the mask | 1u << 31 once known */
  unsigned m = atomic_load_explicit(&cached, memory_order_relaxed);
  if (m) return m & 0xffu;
  m = 1u; /* portable */
  unsigned a, b, c, d, b7 = 0, c7 = 0, a71 = 0;
  if (__get_cpuid(1, &a, &b, &c, &d) && (c >> 27 & 1) /* OSXSAVE */) {
    const unsigned c1 = c;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    (void)xhi;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) { b7 = b; c7 = c; }
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) a71 = a;
    const int ymm = (xlo & 0x6) == 0x6, zmm = (xlo & 0xe6) == 0xe6;
    const int avx2 = ymm && (b7 >> 5 & 1) && (c1 >> 12 & 1) /* fma */ && (c1 >> 29 & 1) /* f16c */ && (b7 >> 8 & 1);
    const int avxvnni = avx2 && (a71 >> 4 & 1);
    const int avx512 = avx2 && zmm && (b7 >> 16 & 1) /* f */ && (b7 >> 17 & 1) /* dq */ && (b7 >> 30 & 1) /* bw */ &&
                       (b7 >> 31 & 1) /* vl */ && (c7 >> 11 & 1) /* vnni */ && (a71 >> 5 & 1) /* bf16 */;
    m |= (unsigned)avx2 << 1 | (unsigned)avxvnni << 2 | (unsigned)avx512 << 3;
  }
  for (int i = 1; i < KVA_NLEVELS; ++i)
    if (!levels[i]) m &= ~(1u << i); /* not built */
  atomic_store_explicit(&cached, m | 1u << 31, memory_order_relaxed);
  return m;
}
static int level_index(const char *name) {
  for (int i = 0; i < KVA_NLEVELS; ++i)
    if (!strcmp(name, level_names[i])) return i;
  return -1;
}
/* The highest level the CPU runs, capped by the environment's KVATTN_SIMD
 * = avx512 | avxvnni | avx2 | portable: a lower level the CPU runs is taken
 * as if it were the best (a whole process, e.g. the test binary, runs at
 * that level); a higher, missing or unknown one is ignored. */
static int best_index(void) {
  const unsigned m = cpu_levels();
  int best = 0;
  for (int i = 0; i < KVA_NLEVELS; ++i)
    if (m >> i & 1) best = i;
  const char *e = getenv("KVATTN_SIMD");
  const int cap = e ? level_index(e) : -1;
  return cap >= 0 && cap < best && (m >> cap & 1) ? cap : best;
}
static const kva_cpu_kernels *detected_kernels(void) {
  static _Atomic(const kva_cpu_kernels *) best;
  const kva_cpu_kernels *k = atomic_load_explicit(&best, memory_order_acquire);
  if (!k) {
    k = levels[best_index()];
    atomic_store_explicit(&best, k, memory_order_release);
  }
  return k;
}
#else
static const kva_cpu_kernels *detected_kernels(void) { return &kva_cpu_kernels_portable; }
#endif

const kva_cpu_kernels *kva_cpu_kernels_get(void) {
  const kva_cpu_kernels *k = atomic_load_explicit(&forced, memory_order_acquire);
  return k ? k : detected_kernels();
}

const char *kva_cpu_simd(void) { return kva_cpu_kernels_get()->level; }

int kva_cpu_set_simd(const char *level) {
  kva_clearerr();
  if (!level) {
    atomic_store_explicit(&forced, NULL, memory_order_release);
    return 0;
  }
#if KVA_X86
  const int i = level_index(level);
  if (i >= 0) {
    if (!levels[i])
      return kva_seterr(KVA_EUNSUPPORTED, "level \"%s\": not built into this binary (a sanitizer build compiles the "
                                          "levels its build host runs)", level);
    const kva_cpu_kernels *best = detected_kernels();
    if (!(cpu_levels() >> i & 1) || i > level_index(best->level))
      return kva_seterr(KVA_EUNSUPPORTED, "level \"%s\": this CPU lacks it (or KVATTN_SIMD caps it)", level);
    atomic_store_explicit(&forced, levels[i], memory_order_release);
    return 0;
  }
#else
  if (!strcmp(level, "portable")) {
    atomic_store_explicit(&forced, &kva_cpu_kernels_portable, memory_order_release);
    return 0;
  }
  if (!strcmp(level, "avx512") || !strcmp(level, "avxvnni") || !strcmp(level, "avx2"))
    return kva_seterr(KVA_EUNSUPPORTED, "level \"%s\": an x86 level, not built for this architecture", level);
#endif
  return kva_seterr(KVA_EINVAL, "level \"%s\" (expected avx512, avxvnni, avx2 or portable)", level);
}

const char *kva_build_info(void) {
  return "kvattn " KVA_BUILD_COMPILER ", CPU kernels: " KVA_CPU_LEVELS
#ifdef KVA_HAVE_CUDA
         ", CUDA: " KVA_CUDA_CODES
#else
         ", CUDA: not built"
#endif
#ifdef KVA_HAVE_NCCL
         ", NCCL: yes"
#endif
      ;
}

/* ---- the plan: chunking and workspace layout ---- */
typedef struct cpu_plan {
  int64_t rows;     /* query rows per group */
  int64_t ngroups;  /* ceil(L / rows) */
  int64_t nq;       /* rep * rows: vectors per item */
  int64_t chunk;    /* tokens per item */
  int64_t items;
  size_t scratch_floats;
  /* workspace offsets (bytes) */
  size_t off_tables, off_partials, off_scratch, total;
} cpu_plan;

size_t kva_cpu_scratch_floats(const kva_problem *p, int64_t nq, bool *ok) {
  /* (every product checked: nq and the head dims come from the caller's shapes) */
  const int64_t Dk = p->Dk, Dv = p->Dv;
  /* general kernel: queries, K/V tiles, scores */
  int64_t gen = kva_add_chk(kva_add_chk(kva_mul_chk(nq, Dk, ok), KVA_TILE * (Dk + Dv), ok),
                            kva_mul_chk(nq, KVA_TILE, ok), ok);
  /* fast kernels: permuted rows are at most 4x D (2-bit, D = 64) plus <= 512
   * lanes of per-chunk sums, 2 floats per vector (m, l); see
   * src/cpu/simd/fast.c */
  int64_t fast = kva_mul_chk(nq, (4 * Dk + 512) + (4 * Dv + 512) + 2 + KVA_TILE, ok);
  fast = kva_add_chk(fast, KVA_TILE * (4 * Dv + 2 * 512), ok);
  /* AMX verify kernel: bf16 Qᵀ/K/V tiles and the O block (src/cpu/simd/amx.c) */
  int64_t amx = kva_add_chk(kva_mul_chk(kva_add_chk(nq, 16, ok), 2 * Dk + 4 * Dv, ok), 64 * (Dk + Dv) + 2048, ok);
  if (amx > fast) fast = amx;
  int64_t f = kva_add_chk(gen > fast ? gen : fast, 64 + KVA_ALIGN / 4 - 1, ok);
  return *ok ? (size_t)(f / (KVA_ALIGN / 4) * (KVA_ALIGN / 4)) : 0;
}

/* Visible token range [lo, len) of sequence b: with a causal sliding window
 * (no segments), keys older than the first row's window are never seen
 * (TREE: the same on its prefix; the new keys are all at or after lo). */
static int64_t visible_lo(const kva_problem *p, int64_t len) {
  if (kva_causal_family(p->mask.kind) && p->mask.window > 0 && !p->mask.segments.data) {
    int64_t lo = len - p->L - p->mask.window + 1;
    return lo > 0 ? lo : 0;
  }
  return 0;
}

/* The keys of [*t0, *t1) that rows i0 .. i0 + rows - 1 can see, for the
 * causal mask without segments (TREE rows may see any new key; segments
 * reach past a row's position): none at or past the last row's position
 * + 1, none older than the first row's window. Returns 1 when no key is
 * left (the range is then unchanged). Long L in row groups, as prefill:
 * each group skips the keys after its last row. */
static int group_key_range(const kva_problem *p, int64_t len, int64_t i0, int64_t rows, int64_t *t0, int64_t *t1) {
  if (p->mask.kind != KVA_MASK_CAUSAL || p->mask.segments.data) return 0;
  int64_t lo = *t0, hi = *t1;
  const int64_t end = len - p->L + i0 + rows; /* one past the last row's position */
  if (hi > end) hi = end;
  if (p->mask.window > 0 && lo < len - p->L + i0 - p->mask.window + 1) lo = len - p->L + i0 - p->mask.window + 1;
  if (lo >= hi) return 1;
  *t0 = lo, *t1 = hi;
  return 0;
}

static size_t align_up(size_t x) { return (x + KVA_ALIGN - 1) / KVA_ALIGN * KVA_ALIGN; }

/* The plan of a validated problem; KVA_ESHAPE when its sizes do not fit
 * (an absurd problem: B, H, L, N from the caller's descriptors). */
static int64_t group_rows(const kva_problem *p) {
  if (p->L <= KVA_MAX_FUSED_ROWS) return p->L;
  if (p->path == KVA_PATH_FUSED) {
    /* long L on the fused kernels (verify chains, tree verify, chunked
     * prefill): as many rows per item as keep rep * rows <=
     * KVA_ITEM_VECTORS (at least KVA_MAX_FUSED_ROWS), so each K/V row is
     * read once per KV head for up to that many query vectors */
    const int64_t rows = KVA_ITEM_VECTORS / p->rep;
    return rows >= p->L ? p->L : rows > KVA_MAX_FUSED_ROWS ? rows : KVA_MAX_FUSED_ROWS;
  }
  return KVA_MAX_FUSED_ROWS;
}

static int make_plan(const kva_problem *p, int threads, cpu_plan *pl) {
  bool ok = true;
  pl->rows = group_rows(p);
  pl->ngroups = (p->L + pl->rows - 1) / pl->rows;
  pl->nq = kva_mul_chk(p->rep, pl->rows, &ok);
  int64_t work = 0; /* token-items */
  for (int64_t b = 0; b < p->B; ++b) {
    int64_t len = kva_problem_len(p, b);
    work = kva_add_chk(work, kva_mul_chk(kva_mul_chk(len - visible_lo(p, len), p->KVH, &ok), pl->ngroups, &ok), &ok);
  }
  const int64_t per = (int64_t)threads * KVA_ITEMS_PER_THREAD;
  int64_t chunk = work / per + (work % per != 0);
  if (chunk < KVA_MIN_CHUNK) chunk = KVA_MIN_CHUNK;
  if (chunk > KVA_MAX_CHUNK) chunk = KVA_MAX_CHUNK;
  chunk = (chunk + KVA_TILE - 1) / KVA_TILE * KVA_TILE;
  pl->chunk = chunk;
  pl->items = 0;
  for (int64_t b = 0; b < p->B; ++b) {
    int64_t len = kva_problem_len(p, b), span = len - visible_lo(p, len);
    pl->items = kva_add_chk(pl->items, kva_mul_chk((span + chunk - 1) / chunk * p->KVH, pl->ngroups, &ok), &ok);
  }
  pl->scratch_floats = ok ? kva_cpu_scratch_floats(p, pl->nq, &ok) : 0;
  pl->off_tables = 0;
  const size_t tables = kva_size_mul_chk((size_t)p->B + 1, sizeof(int64_t), &ok);
  const size_t states = kva_size_mul_chk(kva_size_mul_chk((size_t)pl->items, (size_t)pl->nq, &ok),
                                         (size_t)KVA_STATE_FLOATS(p->Dv) * sizeof(float), &ok);
  const size_t scratch = kva_size_mul_chk((size_t)threads, kva_size_mul_chk(pl->scratch_floats, sizeof(float), &ok), &ok);
  /* each byte count below KVA_MAX_WORKSPACE: the aligned sums cannot wrap */
  if (!ok || tables > KVA_MAX_WORKSPACE || states > KVA_MAX_WORKSPACE || scratch > KVA_MAX_WORKSPACE ||
      tables + states + scratch > KVA_MAX_WORKSPACE)
    return kva_seterr(KVA_ESHAPE, "problem too large: its CPU workspace (B = %lld, H = %lld, L = %lld, N = %lld) "
                      "exceeds 2^48 bytes", (long long)p->B, (long long)p->H, (long long)p->L, (long long)p->N);
  pl->off_partials = align_up(tables);
  pl->off_scratch = pl->off_partials + align_up(states);
  pl->total = pl->off_scratch + scratch + KVA_ALIGN;
  return 0;
}

int kva_cpu_workspace_size(const kva_context *ctx, const kva_problem *p, size_t *bytes) {
  cpu_plan pl;
  int rc = make_plan(p, ctx->threads, &pl);
  if (rc < 0) return rc;
  *bytes = pl.total;
  return 0;
}

typedef struct cpu_run {
  const kva_problem *p;
  cpu_plan pl;
  kva_source src;
  kva_item_fn fused, generic;
  int heads_inner; /* items of a sequence in (group, chunk, head) order, see run_item */
  int64_t *item0;  /* [B+1] first item (and first partial state) of each sequence */
  float *partials, *scratch;
} cpu_run;

static int64_t find_seq(const cpu_run *r, long task) {
  int64_t lo = 0, hi = r->p->B; /* item0[lo] <= task < item0[hi] */
  while (hi - lo > 1) {
    int64_t mid = (lo + hi) / 2;
    if (r->item0[mid] <= task) lo = mid;
    else hi = mid;
  }
  return lo;
}

/* Items of a sequence are taken in (group, KV head, chunk) order from
 * contiguous caches: the threads stream neighbouring stretches of one
 * head's rows. Block layouts go (group, chunk, KV head): the threads work on
 * neighbouring heads of the same blocks, whose rows the pools keep side by
 * side ([num_blocks, KVH, bs, D]); measured 1-4 % faster at block 16 (q4
 * 8/4/256, cold: the ragged batch 2-4 %, one 32k sequence 1-2 %), probably
 * because what the hardware prefetchers read past one head's 2 KiB run of a
 * block is the next head's, used soon after instead of evicted first. The
 * partial state of an item stays at (group, head, chunk) either way, so the
 * merge order and the results do not depend on which thread ran what. */
static void run_item(void *arg, long task, int worker) {
  const cpu_run *r = (const cpu_run *)arg;
  const kva_problem *p = r->p;
  int64_t b = find_seq(r, task), local = task - r->item0[b];
  int64_t len = kva_problem_len(p, b), lo = visible_lo(p, len);
  int64_t nchunks = (len - lo + r->pl.chunk - 1) / r->pl.chunk;
  int64_t c, hk, g;
  if (r->heads_inner) {
    hk = local % p->KVH;
    c = local / p->KVH % nchunks;
    g = local / p->KVH / nchunks;
  } else {
    c = local % nchunks;
    hk = local / nchunks % p->KVH;
    g = local / nchunks / p->KVH;
  }
  kva_item it;
  it.p = p;
  it.src = &r->src;
  it.b = b;
  it.hk = hk;
  it.i0 = g * r->pl.rows;
  it.rows = p->L - it.i0 < r->pl.rows ? p->L - it.i0 : r->pl.rows;
  it.t0 = lo + c * r->pl.chunk;
  it.t1 = it.t0 + r->pl.chunk < len ? it.t0 + r->pl.chunk : len;
  it.len = len;
  it.state = r->partials + (size_t)(r->item0[b] + (g * p->KVH + hk) * nchunks + c) * (size_t)r->pl.nq *
                               (size_t)KVA_STATE_FLOATS(p->Dv);
  if (group_key_range(p, len, it.i0, it.rows, &it.t0, &it.t1)) { /* no row of the group sees this chunk */
    for (int64_t j = 0; j < p->rep * it.rows; ++j) kva_softmax_init(it.state + j * KVA_STATE_FLOATS(p->Dv), (int)p->Dv);
    return;
  }
  it.scratch = r->scratch + (size_t)worker * r->pl.scratch_floats;
  (r->fused ? r->fused : r->generic)(&it); /* fused: the FUSED path (one group, or a tree's groups) */
}

/* Merge task = (sequence, group, KV head): merge chunk states in order. */
static void merge_task(void *arg, long task, int worker) {
  (void)worker;
  const cpu_run *r = (const cpu_run *)arg;
  const kva_problem *p = r->p;
  int64_t per_seq = r->pl.ngroups * p->KVH;
  int64_t b = task / per_seq, g = (task % per_seq) / p->KVH, hk = task % p->KVH;
  int64_t len = kva_problem_len(p, b), lo = visible_lo(p, len);
  int64_t nchunks = (len - lo + r->pl.chunk - 1) / r->pl.chunk;
  int64_t i0 = g * r->pl.rows, rows = p->L - i0 < r->pl.rows ? p->L - i0 : r->pl.rows;
  const int64_t SF = KVA_STATE_FLOATS(p->Dv);
  int64_t first = r->item0[b] + (g * p->KVH + hk) * nchunks;
  for (int64_t j = 0; j < p->rep * rows; ++j) {
    float *acc = r->partials + ((size_t)first * (size_t)r->pl.nq + (size_t)j) * (size_t)SF;
    for (int64_t c = 1; c < nchunks; ++c)
      kva_softmax_merge(acc, acc + (size_t)c * (size_t)r->pl.nq * (size_t)SF, (int)p->Dv);
    int64_t h = hk * p->rep + j / rows, i = i0 + j % rows;
    if (p->sinks) kva_softmax_add_sink(acc, p->sinks[h], (int)p->Dv);
    for (int64_t d = 0; d < p->Dv; ++d)
      kva_store_f(kva_at4(p->out, b, h, i, d), p->out->dtype, kva_softmax_out(acc, (int)d));
    /* The kernels' m is a natural-log max (exp(s - m)): lse = m + log l
     * (-inf for a row without keys: m = -inf, l = 0). */
    if (p->lse) {
      float lse = kva_softmax_lse(acc);
      *(float *)((char *)p->lse->data + b * p->lse->stride[0] + h * p->lse->stride[1] + i * p->lse->stride[2]) =
          p->lse_base2 ? lse * KVA_LOG2E_F : lse;
    }
  }
}

void kva_cpu_kernel_name(const kva_problem *p, char *name, size_t size) {
  const kva_cpu_kernels *kt = kva_cpu_kernels_get();
  const char *fast = p->path == KVA_PATH_FUSED && !general_only_set() ? kt->fast_name(p) : NULL;
  snprintf(name, size, "cpu %s %s", kt->level, fast ? fast : "general kernel [exact f32]");
}

int kva_cpu_attention(kva_context *ctx, const kva_problem *p, void *ws, size_t ws_bytes) {
  cpu_run r;
  memset(&r, 0, sizeof r);
  r.p = p;
  int rc = make_plan(p, ctx->threads, &r.pl);
  if (rc < 0) return rc;
  if (ws_bytes < r.pl.total) return kva_seterr(KVA_EWORKSPACE, "workspace %zu < %zu bytes", ws_bytes, r.pl.total);
  char *base = (char *)(((uintptr_t)ws + KVA_ALIGN - 1) / KVA_ALIGN * KVA_ALIGN);
  if (base + r.pl.total - KVA_ALIGN > (char *)ws + ws_bytes)
    return kva_seterr(KVA_EWORKSPACE, "workspace too small after alignment");
  r.item0 = (int64_t *)(base + r.pl.off_tables);
  r.partials = (float *)(base + r.pl.off_partials);
  r.scratch = (float *)(base + r.pl.off_scratch);
  r.item0[0] = 0;
  for (int64_t b = 0; b < p->B; ++b) {
    int64_t len = kva_problem_len(p, b), span = len - visible_lo(p, len);
    r.item0[b + 1] = r.item0[b] + (span + r.pl.chunk - 1) / r.pl.chunk * p->KVH * r.pl.ngroups;
  }
  r.heads_inner = p->kv->layout != KVA_LAYOUT_CONTIGUOUS;
  switch (p->kv->layout) {
  case KVA_LAYOUT_PAGED: kva_source_paged(&r.src, p->kv); break;
  case KVA_LAYOUT_BLOCK_TABLE: kva_source_block_table(&r.src, p->kv); break;
  default: kva_source_contiguous(&r.src, p->kv); break;
  }
  const kva_cpu_kernels *kt = kva_cpu_kernels_get();
  r.generic = kt->generic;
  r.fused = p->path == KVA_PATH_FUSED && !general_only_set() ? kt->fast(p) : NULL;
  kva_threadpool_run(ctx->pool, run_item, &r, (long)r.pl.items);
  kva_threadpool_run(ctx->pool, merge_task, &r, (long)(p->B * r.pl.ngroups * p->KVH));
  return 0;
}
