/* The `kvattn` command-line tool: `kvattn info` (version, build, SIMD level,
 * threads, devices) and `kvattn bench` (the benchmark suite, each case timed
 * cold and checked against the oracle; see bench.c and BENCHMARKS.md). This
 * file parses the command line; usage errors exit with status 2. */
#include "bench.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CUDA_NAME_LEN 256

/* Defaults of `kvattn bench` (normal / --quick). */
#define DEF_WARMUPS 2
#define DEF_MIN_REPS 15
#define DEF_MAX_REPS 51
#define DEF_BUDGET_S 0.5
#define DEF_ROTATE_GIB 1.1
#define DEF_MEM_CAP_GB 12.0
#define DEF_BW_GIB 2.0
#define DEF_BW_PASSES 5
#define DEF_BLOCK 16 /* paged: tokens per block */
#define QUICK_WARMUPS 1
#define QUICK_MIN_REPS 3
#define QUICK_MAX_REPS 5
#define QUICK_BUDGET_S 0.02
#define QUICK_BW_GIB 1.0
#define QUICK_BW_PASSES 2
#define MAX_REPS_LIMIT 100000
#define MAX_THREADS_ARG KB_MAX_THREADS
#define MAX_DIM 4096
#define MAX_HEADS 4096
#define MAX_CTX (1ll << 30)

static const char *prog = "kvattn";

/* ------------------------------------------------------------- help */
static void usage_main(FILE *f) {
  fprintf(f,
          "usage: %s <command> [options]\n"
          "\n"
          "commands:\n"
          "  info     version, build, SIMD level, threads, CUDA devices\n"
          "  bench    time fused attention cold and check it against the oracle\n"
          "  help [command]\n"
          "\n"
          "  %s --help | --version\n",
          prog, prog);
}

static void usage_info(FILE *f) {
  fprintf(f, "usage: %s info\n\nPrints the library version, kva_build_info(), the CPU SIMD level\n"
             "the kernels use, the default thread count and the visible CUDA devices.\n",
          prog);
}

static void usage_bench(FILE *f) {
  fprintf(f,
          "usage: %s bench [options]\n"
          "\n"
          "Runs the default suite (about 2 minutes on 2 cores), --quick (seconds) or --full\n"
          "(the whole grid). Any shape option instead runs the grid of the given values\n"
          "(unset axes: one default, or the full grid's values with --full).\n"
          "Each case is timed cold (K/V rotated over > 1 GiB of copies; median of the timed\n"
          "calls) and checked against kva_reference_attention on a sample of heads.\n"
          "Exit status: 0 all cases pass, 1 a case failed or could not run, 2 usage error.\n"
          "\n"
          "suites:\n"
          "  --quick            tiny shapes, no rotation, few calls (CI smoke)\n"
          "  --full             presets x ctx 4k,32k,128k x kv q4,q8,bf16 x L 1,8 x B 1,8\n"
          "shape (lists are comma-separated):\n"
          "  --preset NAME[,..] gemma3-4b (8/4/256), gqa6-256 (24/4/256), llama3-8b (32/8/128)\n"
          "  --heads H:KVH      query heads : KV heads (overrides the preset)\n"
          "  --dim D | Dk:Dv    head dims (overrides the preset)\n"
          "  --ctx N[,..]       cache lengths; suffix k = 1024 (4k, 32k, 128k)\n"
          "  --rows L[,..]      query rows per sequence (1 decode, > 1 causal verify)\n"
          "  --batch B[,..]     sequences\n"
          "  --tree N[,..]      also a tree verify of N <= 64 nodes per case (KVA_MASK_TREE: an\n"
          "                     EAGLE-style tree, top-4 children per node, levels of up to\n"
          "                     max(4, N/4) nodes; 16: depth 5, 32 and 64: depth 6), printed\n"
          "                     with its ratio to the case's L=1 decode (give --rows 1)\n"
          "  --kv F[,..]        f32 | f16 | bf16 | q8 | q4 | q2 (quantized: bf16 scales) | fp8 (= f8e4m3) | f8e5m2\n"
          "                     (fp8: one f32 scale per (token, KV head))\n"
          "  --group G          quantization group: 32, 64 (default) or 128\n"
          "  --qdtype T         query dtype f32 | f16 | bf16 (default bf16)\n"
          "  --odtype T         output dtype f32 | f16 | bf16 (default bf16)\n"
          "  --layout L         contiguous (default) | paged (pools made with\n"
          "                     kva_pool_from_contiguous)\n"
          "  --block N          paged: tokens per block, %d..%d (default %d)\n"
          "  --block-order O    paged: shuffled (default: each sequence's blocks at\n"
          "                     random places in the pool) | sequential (in order)\n"
          "run:\n"
          "  --backend B        cpu (default) | cuda\n"
          "  --threads T        worker threads, 0 = all cores (default)\n"
          "  --simd LEVEL       CPU kernels of this SIMD level: avx512 | avxvnni | avx2 | portable\n"
          "                     (default: the best this CPU supports; `kvattn info` names it)\n"
          "  --exact            exact mode (KVA_ATTN_EXACT): only \"[exact f32]\" kernels, never\n"
          "                     AMX, integer-query or tensor-core ones (validation; slower)\n"
          "  --hadamard H       off (default) | on: a Hadamard-rotated cache (KVA_ATTN_ROTATED_K\n"
          "                     and _V: q rotated in, out rotated back; fused in the CUDA\n"
          "                     kernels but the general one, passes elsewhere) | both: each\n"
          "                     case unrotated, then rotated, and the rotation's cost printed\n"
          "  --hadamard-of R    what --hadamard rotates: kv (default) | k (K only: q rotated\n"
          "                     in) | v (V only: out rotated back)\n"
          "  --warmups N        untimed calls per case (default %d)\n"
          "  --reps N           at least N timed calls (default %d; fewer for huge cases)\n"
          "  --max-reps N       at most N timed calls (default %d)\n"
          "  --budget S         seconds of timed calls per case after --reps (default %g)\n"
          "  --rotate-gib X     rotate K/V over at least X GiB (default %g; 0 = no rotation)\n"
          "  --cuda-flush F     ahead of each timed CUDA call: read (default: a read of 128 MiB,\n"
          "                     leaving clean L2 lines) | memset (64 MiB written: dirty lines whose\n"
          "                     write-back competes with the call; the figures before 2026-12-01)\n"
          "  --pattern          CPU, contiguous: after each timed call, a pass of the kernels'\n"
          "                     read pattern without math (per tile K rows then V rows, the\n"
          "                     next tile prefetched) over another copy; prints each case's\n"
          "                     time against it (pattern_us in --json)\n"
          "  --mem-cap-gb X     most memory for one case's copies, GB (default %g)\n"
          "  --bw-gib X         bandwidth probe array, GiB (default %g)\n"
          "  --seed S           random seed (default: from the clock, printed)\n"
          "  --no-check         skip the oracle check\n"
          "output:\n"
          "  --json             one JSON object per case per line on stdout (with \"kernel\":\n"
          "                     the kernel kva_attention_kernel names for the case)\n"
          "  --quiet            no progress on stderr\n"
          "  --list             list the selected cases with their bytes and FLOPs; run nothing\n",
          prog, KVA_BLOCK_SIZE_MIN, KVA_BLOCK_SIZE_MAX, DEF_BLOCK, DEF_WARMUPS, DEF_MIN_REPS, DEF_MAX_REPS, DEF_BUDGET_S, DEF_ROTATE_GIB,
          DEF_MEM_CAP_GB, DEF_BW_GIB);
  fprintf(f, "\npresets:\n");
  kb_list_presets(f);
}

/* ------------------------------------------------------------ info */
static int cmd_info(int argc, char **argv) {
  for (int i = 0; i < argc; ++i) {
    if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      usage_info(stdout);
      return KB_EXIT_OK;
    }
    fprintf(stderr, "%s info: unknown option '%s'\n", prog, argv[i]);
    usage_info(stderr);
    return KB_EXIT_USAGE;
  }
  char model[128];
  kb_cpu_model(model, sizeof model);
  printf("kvattn %s (header %d.%d.%d)\n", kva_version(), KVA_VERSION_MAJOR, KVA_VERSION_MINOR,
         KVA_VERSION_PATCH);
  printf("build: %s\n", kva_build_info());
  printf("cpu: %s, %ld cores online\n", model, sysconf(_SC_NPROCESSORS_ONLN));
  printf("cpu simd: %s\n", kva_cpu_simd());
  kva_context *ctx = NULL;
  if (kva_context_create(&ctx, NULL) == 0) {
    printf("threads: %d (default CPU context)\n", kva_context_threads(ctx));
    kva_context_destroy(ctx);
  } else {
    printf("threads: unavailable (%s)\n", kva_last_error());
  }
  int nd = kva_cuda_device_count();
  printf("cuda devices: %d\n", nd);
  for (int d = 0; d < nd; ++d) {
    char name[CUDA_NAME_LEN] = "";
    size_t bytes = 0;
    if (kva_cuda_device_info(d, name, sizeof name, &bytes) == 0)
      printf("  %d: %s, %.1f GiB\n", d, name, (double)bytes / KB_GIB);
    else
      printf("  %d: unavailable (%s)\n", d, kva_last_error());
  }
  return KB_EXIT_OK;
}

/* ---------------------------------------------------------- parsing */
static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s bench: ", prog);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n(see '%s bench --help')\n", prog);
  va_end(ap);
  return -1;
}

/* Integer in [lo, hi], optional suffix k (x1024) or m (x1024^2) when allowed. */
static int parse_i64(const char *opt, const char *s, int64_t lo, int64_t hi, bool suffix,
                     int64_t *out) {
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (end == s || errno) return usage_error("%s: '%s' is not an integer", opt, s);
  if (suffix && (*end == 'k' || *end == 'K')) v *= 1024, ++end;
  else if (suffix && (*end == 'm' || *end == 'M')) v *= 1024 * 1024, ++end;
  if (*end) return usage_error("%s: '%s' is not an integer", opt, s);
  if (v < lo || v > hi)
    return usage_error("%s: %lld is out of range [%lld, %lld]", opt, v, (long long)lo,
                       (long long)hi);
  *out = v;
  return 0;
}

static int parse_f64(const char *opt, const char *s, double lo, double hi, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (end == s || *end || errno) return usage_error("%s: '%s' is not a number", opt, s);
  if (!(v >= lo && v <= hi)) return usage_error("%s: %s is out of range [%g, %g]", opt, s, lo, hi);
  *out = v;
  return 0;
}

/* Splits a comma-separated list into buf (items NUL-terminated in place):
 * 1 to KB_MAX_AXIS items, none empty ("1k,,2k" and "4k," are errors). */
typedef struct cli_list {
  char buf[256];
  char *item[KB_MAX_AXIS];
  int n;
} cli_list;
static int split_list(const char *opt, const char *s, cli_list *l) {
  if (strlen(s) >= sizeof l->buf) return usage_error("%s: list too long", opt);
  snprintf(l->buf, sizeof l->buf, "%s", s);
  l->n = 0;
  for (char *p = l->buf;;) {
    char *comma = strchr(p, ',');
    if (comma) *comma = 0;
    if (!*p) return usage_error("%s: empty item in '%s'", opt, s);
    if (l->n == KB_MAX_AXIS) return usage_error("%s: at most %d values", opt, KB_MAX_AXIS);
    l->item[l->n++] = p;
    if (!comma) return 0;
    p = comma + 1;
  }
}

/* Comma-separated list of integers. */
static int parse_list(const char *opt, const char *s, int64_t lo, int64_t hi, bool suffix,
                      int64_t *vals, int *n) {
  cli_list l;
  if (split_list(opt, s, &l) < 0) return -1;
  for (*n = 0; *n < l.n; ++*n)
    if (parse_i64(opt, l.item[*n], lo, hi, suffix, &vals[*n]) < 0) return -1;
  return 0;
}

static int parse_pair(const char *opt, const char *s, int64_t hi, bool need_pair, int64_t *a,
                      int64_t *b) {
  char buf[64];
  snprintf(buf, sizeof buf, "%s", s);
  char *colon = strchr(buf, ':');
  if (!colon && need_pair) return usage_error("%s: expected A:B, got '%s'", opt, s);
  if (colon) *colon = 0;
  if (parse_i64(opt, buf, 1, hi, false, a) < 0) return -1;
  if (!colon) {
    *b = *a;
    return 0;
  }
  return parse_i64(opt, colon + 1, 1, hi, false, b);
}

static int parse_float_dtype(const char *opt, const char *s, kva_dtype *dt) {
  if (!strcmp(s, "f32")) *dt = KVA_F32;
  else if (!strcmp(s, "f16")) *dt = KVA_F16;
  else if (!strcmp(s, "bf16")) *dt = KVA_BF16;
  else return usage_error("%s: '%s' is not one of f32, f16, bf16", opt, s);
  return 0;
}

static int parse_kv(const char *opt, const char *s, kb_kvfmt *vals, int *n) {
  cli_list l;
  if (split_list(opt, s, &l) < 0) return -1;
  *n = 0;
  for (int i = 0; i < l.n; ++i) {
    const char *tok = l.item[i];
    kb_kvfmt f = {0, KVA_BF16, 0};
    if (!strcmp(tok, "q2")) f.bits = 2;
    else if (!strcmp(tok, "q4")) f.bits = 4;
    else if (!strcmp(tok, "q8")) f.bits = 8;
    else if (!strcmp(tok, "fp8") || !strcmp(tok, "f8e4m3")) f.dtype = KVA_F8E4M3;
    else if (!strcmp(tok, "fp8e5m2") || !strcmp(tok, "f8e5m2")) f.dtype = KVA_F8E5M2;
    else if (strcmp(tok, "f32") && strcmp(tok, "f16") && strcmp(tok, "bf16"))
      return usage_error("%s: '%s' is not one of f32, f16, bf16, q8, q4, q2, fp8 (f8e4m3), f8e5m2", opt, tok);
    else parse_float_dtype(opt, tok, &f.dtype);
    if (f.bits) f.group = 64;
    vals[(*n)++] = f;
  }
  return 0;
}

static int parse_presets(const char *opt, const char *s, kb_axes *a) {
  cli_list l;
  if (split_list(opt, s, &l) < 0) return -1;
  for (a->n_preset = 0; a->n_preset < l.n; a->n_preset++)
    if (!kb_find_preset(l.item[a->n_preset], &a->preset[a->n_preset])) {
      usage_error("%s: unknown preset '%s'; known:", opt, l.item[a->n_preset]);
      kb_list_presets(stderr);
      return -1;
    }
  return 0;
}

static int cmd_bench(int argc, char **argv) {
  kb_opts o;
  memset(&o, 0, sizeof o);
  o.backend = KVA_BACKEND_CPU;
  o.check = true;
  o.hadamard_flags = KVA_ATTN_ROTATED_K | KVA_ATTN_ROTATED_V;
  o.seed = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
  kb_axes a;
  memset(&a, 0, sizeof a);
  a.qdtype = KVA_BF16, a.odtype = KVA_BF16;
  a.layout = KVA_LAYOUT_CONTIGUOUS;
  int64_t warmups = -1, min_reps = -1, max_reps = -1, group = 0, threads = 0;
  double budget = -1, rotate = -1, memcap = DEF_MEM_CAP_GB, bw = -1;
  bool block_set = false, order_set = false;

  for (int i = 0; i < argc; ++i) {
    char *opt = argv[i], *val = NULL, flag[64];
    char *eq = strchr(opt, '=');
    if (!strncmp(opt, "--", 2) && eq && (size_t)(eq - opt) < sizeof flag) {
      snprintf(flag, sizeof flag, "%.*s", (int)(eq - opt), opt);
      opt = flag, val = eq + 1;
    }
#define IS(name) (!strcmp(opt, name))
#define NEEDS_VALUE()                                                                   \
  do {                                                                                  \
    if (!val) {                                                                         \
      if (i + 1 >= argc) return usage_error("%s needs a value", opt), KB_EXIT_USAGE;     \
      val = argv[++i];                                                                  \
    }                                                                                   \
  } while (0)
#define TRY(x)                                                                          \
  do {                                                                                  \
    if ((x) < 0) return KB_EXIT_USAGE;                                                  \
  } while (0)
    if (IS("--help") || IS("-h")) {
      usage_bench(stdout);
      return KB_EXIT_OK;
    }
    bool is_flag = IS("--json") || IS("--quick") || IS("--full") || IS("--no-check") ||
                   IS("--quiet") || IS("--list") || IS("--exact") || IS("--pattern");
    if (is_flag && val) return usage_error("%s takes no value", opt), KB_EXIT_USAGE;
    if (IS("--json")) o.json = true;
    else if (IS("--quick")) o.quick = true;
    else if (IS("--full")) o.full = true;
    else if (IS("--no-check")) o.check = false;
    else if (IS("--quiet")) o.quiet = true;
    else if (IS("--list")) o.list = true;
    else if (IS("--exact")) o.exact = true;
    else if (IS("--pattern")) o.pattern = true;
    else if (IS("--preset")) { NEEDS_VALUE(); TRY(parse_presets(opt, val, &a)); }
    else if (IS("--heads")) {
      NEEDS_VALUE();
      TRY(parse_pair(opt, val, MAX_HEADS, true, &a.H, &a.KVH));
      a.heads_set = true;
    } else if (IS("--dim")) {
      NEEDS_VALUE();
      TRY(parse_pair(opt, val, MAX_DIM, false, &a.Dk, &a.Dv));
      a.dim_set = true;
    } else if (IS("--ctx")) { NEEDS_VALUE(); TRY(parse_list(opt, val, 1, MAX_CTX, true, a.ctx, &a.n_ctx)); }
    else if (IS("--rows")) { NEEDS_VALUE(); TRY(parse_list(opt, val, 1, MAX_CTX, false, a.rows, &a.n_rows)); }
    else if (IS("--batch")) { NEEDS_VALUE(); TRY(parse_list(opt, val, 1, MAX_CTX, false, a.batch, &a.n_batch)); }
    else if (IS("--tree")) { NEEDS_VALUE(); TRY(parse_list(opt, val, 1, KVA_TREE_MAX_ROWS, false, a.tree, &a.n_tree)); }
    else if (IS("--kv")) { NEEDS_VALUE(); TRY(parse_kv(opt, val, a.kv, &a.n_kv)); }
    else if (IS("--group")) {
      NEEDS_VALUE();
      TRY(parse_i64(opt, val, 1, MAX_DIM, false, &group));
      if (group != 32 && group != 64 && group != 128)
        return usage_error("--group: %lld is not one of 32, 64, 128", (long long)group),
               KB_EXIT_USAGE;
    } else if (IS("--qdtype")) { NEEDS_VALUE(); TRY(parse_float_dtype(opt, val, &a.qdtype)); }
    else if (IS("--odtype")) { NEEDS_VALUE(); TRY(parse_float_dtype(opt, val, &a.odtype)); }
    else if (IS("--layout")) {
      NEEDS_VALUE();
      if (!strcmp(val, "contiguous")) a.layout = KVA_LAYOUT_CONTIGUOUS;
      else if (!strcmp(val, "paged")) a.layout = KVA_LAYOUT_PAGED;
      else return usage_error("--layout: '%s' is not one of contiguous, paged", val), KB_EXIT_USAGE;
    } else if (IS("--block")) {
      NEEDS_VALUE();
      TRY(parse_i64(opt, val, 1, MAX_CTX, false, &a.block));
      block_set = true;
    } else if (IS("--block-order")) {
      NEEDS_VALUE();
      if (!strcmp(val, "shuffled")) a.in_order = false;
      else if (!strcmp(val, "sequential")) a.in_order = true;
      else return usage_error("--block-order: '%s' is not one of shuffled, sequential", val), KB_EXIT_USAGE;
      order_set = true;
    } else if (IS("--backend")) {
      NEEDS_VALUE();
      if (!strcmp(val, "cpu")) o.backend = KVA_BACKEND_CPU;
      else if (!strcmp(val, "cuda")) o.backend = KVA_BACKEND_CUDA;
      else return usage_error("--backend: '%s' is not one of cpu, cuda", val), KB_EXIT_USAGE;
    } else if (IS("--threads")) { NEEDS_VALUE(); TRY(parse_i64(opt, val, 0, MAX_THREADS_ARG, false, &threads)); }
    else if (IS("--simd")) {
      NEEDS_VALUE();
      if (kva_cpu_set_simd(val) != 0) return usage_error("--simd: %s", kva_last_error()), KB_EXIT_USAGE;
    }
    else if (IS("--warmups")) { NEEDS_VALUE(); TRY(parse_i64(opt, val, 0, MAX_REPS_LIMIT, false, &warmups)); }
    else if (IS("--reps")) { NEEDS_VALUE(); TRY(parse_i64(opt, val, 1, MAX_REPS_LIMIT, false, &min_reps)); }
    else if (IS("--max-reps")) { NEEDS_VALUE(); TRY(parse_i64(opt, val, 1, MAX_REPS_LIMIT, false, &max_reps)); }
    else if (IS("--budget")) { NEEDS_VALUE(); TRY(parse_f64(opt, val, 0, 3600, &budget)); }
    else if (IS("--rotate-gib")) { NEEDS_VALUE(); TRY(parse_f64(opt, val, 0, 1024, &rotate)); }
    else if (IS("--hadamard")) {
      NEEDS_VALUE();
      if (!strcmp(val, "off")) o.hadamard = 0;
      else if (!strcmp(val, "on")) o.hadamard = 1;
      else if (!strcmp(val, "both")) o.hadamard = 2;
      else return usage_error("--hadamard: '%s' is not one of off, on, both", val), KB_EXIT_USAGE;
    } else if (IS("--hadamard-of")) {
      NEEDS_VALUE();
      if (!strcmp(val, "kv")) o.hadamard_flags = KVA_ATTN_ROTATED_K | KVA_ATTN_ROTATED_V;
      else if (!strcmp(val, "k")) o.hadamard_flags = KVA_ATTN_ROTATED_K;
      else if (!strcmp(val, "v")) o.hadamard_flags = KVA_ATTN_ROTATED_V;
      else return usage_error("--hadamard-of: '%s' is not one of kv, k, v", val), KB_EXIT_USAGE;
    }
    else if (IS("--cuda-flush")) {
      NEEDS_VALUE();
      if (!strcmp(val, "read")) o.cuda_flush_memset = false;
      else if (!strcmp(val, "memset")) o.cuda_flush_memset = true;
      else return usage_error("--cuda-flush: '%s' is not one of read, memset", val), KB_EXIT_USAGE;
    }
    else if (IS("--mem-cap-gb")) { NEEDS_VALUE(); TRY(parse_f64(opt, val, 0.001, 1e6, &memcap)); }
    else if (IS("--bw-gib")) { NEEDS_VALUE(); TRY(parse_f64(opt, val, 0.001, 1024, &bw)); }
    else if (IS("--seed")) {
      NEEDS_VALUE();
      char *end;
      errno = 0;
      unsigned long long s = strtoull(val, &end, 0);
      if (end == val || *end || errno)
        return usage_error("--seed: '%s' is not an unsigned integer", val), KB_EXIT_USAGE;
      o.seed = s;
    } else {
      return usage_error("unknown option '%s'", argv[i]), KB_EXIT_USAGE;
    }
#undef IS
#undef NEEDS_VALUE
#undef TRY
  }
  if (o.quick && o.full) return usage_error("--quick and --full exclude each other"), KB_EXIT_USAGE;
  if (o.pattern && (o.backend != KVA_BACKEND_CPU || a.layout != KVA_LAYOUT_CONTIGUOUS))
    return usage_error("--pattern: the CPU backend over --layout contiguous only"), KB_EXIT_USAGE;
  if (block_set && a.layout != KVA_LAYOUT_PAGED)
    return usage_error("--block applies to --layout paged only"), KB_EXIT_USAGE;
  if (order_set && a.layout != KVA_LAYOUT_PAGED)
    return usage_error("--block-order applies to --layout paged only"), KB_EXIT_USAGE;
  if (a.layout == KVA_LAYOUT_PAGED) {
    if (!block_set) a.block = DEF_BLOCK;
    if (a.block < KVA_BLOCK_SIZE_MIN || a.block > KVA_BLOCK_SIZE_MAX)
      return usage_error("--block: %lld is out of range [%d, %d]", (long long)a.block,
                         KVA_BLOCK_SIZE_MIN, KVA_BLOCK_SIZE_MAX),
             KB_EXIT_USAGE;
  }
  if (group && a.n_kv == 0) {
    /* --group alone: the default q4 at that group. */
    a.kv[0] = (kb_kvfmt){4, KVA_BF16, 64};
    a.n_kv = 1;
  }
  a.group = (int)group;

  o.threads = (int)threads;
  o.warmups = warmups >= 0 ? (int)warmups : o.quick ? QUICK_WARMUPS : DEF_WARMUPS;
  o.min_reps = min_reps > 0 ? (int)min_reps : o.quick ? QUICK_MIN_REPS : DEF_MIN_REPS;
  o.max_reps = max_reps > 0 ? (int)max_reps : o.quick ? QUICK_MAX_REPS : DEF_MAX_REPS;
  if (o.max_reps < o.min_reps) {
    if (max_reps > 0 && min_reps > 0)
      return usage_error("--max-reps %d is below --reps %d", o.max_reps, o.min_reps),
             KB_EXIT_USAGE;
    if (max_reps > 0) o.min_reps = o.max_reps;
    else o.max_reps = o.min_reps;
  }
  o.budget_s = budget >= 0 ? budget : o.quick ? QUICK_BUDGET_S : DEF_BUDGET_S;
  o.rotate_bytes = (rotate >= 0 ? rotate : o.quick ? 0 : DEF_ROTATE_GIB) * KB_GIB;
  o.mem_cap_bytes = memcap * 1e9;
  o.bw_bytes = (bw > 0 ? bw : o.quick ? QUICK_BW_GIB : DEF_BW_GIB) * KB_GIB;
  o.bw_passes = o.quick ? QUICK_BW_PASSES : DEF_BW_PASSES;
  kb_suite suite = o.quick ? KB_SUITE_QUICK : o.full ? KB_SUITE_FULL : KB_SUITE_DEFAULT;
  return kb_run_bench(&o, &a, suite);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage_main(stderr);
    return KB_EXIT_USAGE;
  }
  const char *cmd = argv[1];
  if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
    usage_main(stdout);
    return KB_EXIT_OK;
  }
  if (!strcmp(cmd, "--version")) {
    printf("kvattn %s\n", kva_version());
    return KB_EXIT_OK;
  }
  if (!strcmp(cmd, "help")) {
    if (argc < 3) usage_main(stdout);
    else if (!strcmp(argv[2], "bench")) usage_bench(stdout);
    else if (!strcmp(argv[2], "info")) usage_info(stdout);
    else {
      fprintf(stderr, "%s help: unknown command '%s'\n", prog, argv[2]);
      return KB_EXIT_USAGE;
    }
    return KB_EXIT_OK;
  }
  if (!strcmp(cmd, "info")) return cmd_info(argc - 2, argv + 2);
  if (!strcmp(cmd, "bench")) return cmd_bench(argc - 2, argv + 2);
  fprintf(stderr, "%s: unknown command '%s'\n", prog, cmd);
  usage_main(stderr);
  return KB_EXIT_USAGE;
}
