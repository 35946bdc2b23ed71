/* Benchmark cases: the presets, the default / quick / full suites, the grid
 * built from command-line axes, and what each case costs: K/V bytes read and
 * FLOPs (formulas below, also in BENCHMARKS.md). */
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KB_DEFAULT_GROUP 64
#define KB_DEFAULT_CTX 32768
#define KB_BITS_PER_BYTE 8.0
#define KB_K 1024
#define KB_MAX_CASES 4096

static const kb_preset presets[] = {
    {"gemma3-4b", 8, 4, 256},
    {"gqa6-256", 24, 4, 256},
    {"llama3-8b", 32, 8, 128},
};
#define N_PRESETS ((int)(sizeof presets / sizeof presets[0]))

bool kb_find_preset(const char *name, kb_preset *out) {
  for (int i = 0; i < N_PRESETS; ++i)
    if (strcmp(presets[i].name, name) == 0) {
      *out = presets[i];
      return true;
    }
  return false;
}

void kb_list_presets(FILE *f) {
  for (int i = 0; i < N_PRESETS; ++i)
    fprintf(f, "  %-10s H/KVH/D = %lld/%lld/%lld\n", presets[i].name, (long long)presets[i].H,
            (long long)presets[i].KVH, (long long)presets[i].D);
}

/* ------------------------------------------------------------ names */
const char *kb_kv_name(const kb_kvfmt *f) {
  switch (f->bits) {
  case 0: return kva_dtype_name(f->dtype);
  case 2: return "q2";
  case 4: return "q4";
  case 8: return "q8";
  }
  return "?";
}

void kb_kv_label(const kb_kvfmt *f, char *buf, size_t n) {
  if (f->bits == 0)
    snprintf(buf, n, "%s", kb_kv_name(f));
  else
    snprintf(buf, n, "%sg%d", kb_kv_name(f), f->group);
}

const char *kb_layout_name(kva_layout l) {
  return l == KVA_LAYOUT_PAGED ? "paged" : "contiguous";
}

void kb_case_label(const kb_case *c, char *buf, size_t n) {
  char kv[16], dim[32];
  kb_kv_label(&c->kv, kv, sizeof kv);
  if (c->Dk == c->Dv)
    snprintf(dim, sizeof dim, "%lld", (long long)c->Dk);
  else
    snprintf(dim, sizeof dim, "%lld:%lld", (long long)c->Dk, (long long)c->Dv);
  char lay[32] = "";
  if (c->layout == KVA_LAYOUT_PAGED)
    snprintf(lay, sizeof lay, " paged/%lld%s", (long long)c->block, c->in_order ? " in-order" : "");
  snprintf(buf, n, "%s %lld/%lld/%s %s%s N=%lld %s=%lld B=%lld%s", c->preset, (long long)c->H,
           (long long)c->KVH, dim, kv, lay, (long long)c->N, c->tree ? "tree" : "L", (long long)c->L,
           (long long)c->B, c->hadamard == KVA_ATTN_ROTATED_K ? " hadamard-k" : c->hadamard == KVA_ATTN_ROTATED_V ? " hadamard-v"
           : c->hadamard ? " hadamard" : "");
}

int kb_tree_parents(int64_t n, int *parent) {
  const int64_t cap = n / 4 > 4 ? n / 4 : 4;
  int64_t prev0 = 0, prevw = 1, next = 1; /* the previous level: nodes prev0 .. prev0 + prevw - 1 */
  int depth = n > 0;
  if (n > 0) parent[0] = -1;
  while (next < n) {
    int64_t w = 4 * prevw;
    if (depth > 1 && w > cap) w = cap;
    if (w > n - next) w = n - next;
    for (int64_t r = 0; r < w; ++r) parent[next + r] = (int)(prev0 + r / 4);
    prev0 = next, prevw = w, next += w;
    ++depth;
  }
  return depth;
}

void kb_tree_bits(int64_t n, const int *parent, uint32_t *bits) {
  const int64_t W = (n + 31) / 32;
  memset(bits, 0, sizeof(uint32_t) * (size_t)(n * W));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t a = i; a >= 0; a = parent[a]) bits[i * W + a / 32] |= 1u << (a % 32);
}

/* ------------------------------------------------------------ costs */
double kb_row_bytes(const kb_kvfmt *f, int64_t D) {
  if (f->bits == 0 && kb_is_fp8(f->dtype)) return (double)D + 4.0; /* codes + the row's f32 scale */
  if (f->bits == 0) return (double)D * (double)kva_dtype_size(f->dtype);
  double data = (double)D * f->bits / KB_BITS_PER_BYTE;
  double groups = (double)(D / f->group);
  return data + 2.0 * groups * (double)kva_dtype_size(f->dtype); /* + scales + biases */
}

/* Keys row i sees under the causal mask: positions 0..p, p = N - L + i. */
static int64_t row_visible(const kb_case *c, int64_t i) { return c->N - c->L + i + 1; }

int64_t kb_visible_keys(const kb_case *c) {
  /* The union over rows is the last row's range, 0..N-1. */
  return row_visible(c, c->L - 1);
}

double kb_case_kv_bytes(const kb_case *c) {
  double per_key = kb_row_bytes(&c->kv, c->Dk) + kb_row_bytes(&c->kv, c->Dv);
  return (double)c->B * (double)c->KVH * (double)kb_visible_keys(c) * per_key;
}

double kb_case_qo_bytes(const kb_case *c) {
  double rows = (double)c->B * (double)c->H * (double)c->L;
  return rows * ((double)c->Dk * (double)kva_dtype_size(c->qdtype) +
                 (double)c->Dv * (double)kva_dtype_size(c->odtype));
}

double kb_case_flops(const kb_case *c) {
  const double flops_per_mac = 2.0;
  double keys = 0;
  int parent[KVA_TREE_MAX_ROWS];
  if (c->tree && c->L <= KVA_TREE_MAX_ROWS) { /* row i: the prefix, itself and its ancestors */
    kb_tree_parents(c->L, parent);
    for (int64_t i = 0; i < c->L; ++i) {
      keys += (double)(c->N - c->L);
      for (int64_t a = i; a >= 0; a = parent[a]) keys += 1.0;
    }
  } else {
    for (int64_t i = 0; i < c->L; ++i) keys += (double)row_visible(c, i);
  }
  double rep = (double)(c->H / c->KVH);
  return flops_per_mac * (double)c->B * (double)c->KVH * rep * keys * (double)(c->Dk + c->Dv);
}

bool kb_same_cache(const kb_case *a, const kb_case *b) {
  return a->B == b->B && a->KVH == b->KVH && a->N == b->N && a->Dk == b->Dk && a->Dv == b->Dv &&
         a->kv.bits == b->kv.bits && a->kv.dtype == b->kv.dtype && a->kv.group == b->kv.group &&
         a->layout == b->layout && a->block == b->block && a->in_order == b->in_order;
}

bool kb_is_sampled(const kb_case *c, int64_t b, int64_t hk) {
  return (b == 0 || b == c->B - 1) && (hk == 0 || hk == c->KVH - 1);
}

/* ------------------------------------------------------------ suites */
static kb_kvfmt q(int bits, int group) { return (kb_kvfmt){bits, KVA_BF16, group}; }

typedef struct suite_entry {
  const char *preset; /* NULL: custom H/KVH/D below */
  int64_t H, KVH, D;
  kb_kvfmt kv;
  int64_t N, L, B;
  int64_t block; /* 0: the layout of the command line (contiguous by default); > 0: paged with this block */
} suite_entry;

/* The default suite (`make bench`): the performance cases first,
 * entries that share a cache kept together. About 5 minutes on 2 cores. */
static const suite_entry default_suite[] = {
    /* decode and causal verify on one q4 g64 cache, GQA 2 and GQA 6 */
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 32 * KB_K, 1, 1, 0},
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 32 * KB_K, 8, 1, 0},
    {"gqa6-256", 0, 0, 0, {4, KVA_BF16, 64}, 32 * KB_K, 1, 1, 0},
    {"gqa6-256", 0, 0, 0, {4, KVA_BF16, 64}, 32 * KB_K, 8, 1, 0},
    /* the same shapes over a bf16 cache */
    {"gemma3-4b", 0, 0, 0, {0, KVA_BF16, 0}, 32 * KB_K, 1, 1, 0},
    {"gemma3-4b", 0, 0, 0, {0, KVA_BF16, 0}, 32 * KB_K, 8, 1, 0},
    {"gqa6-256", 0, 0, 0, {0, KVA_BF16, 0}, 32 * KB_K, 1, 1, 0},
    /* 8-bit */
    {"gemma3-4b", 0, 0, 0, {8, KVA_BF16, 64}, 32 * KB_K, 1, 1, 0},
    /* llama3-8b: head dim 128, GQA 4 */
    {"llama3-8b", 0, 0, 0, {4, KVA_BF16, 64}, 32 * KB_K, 1, 1, 0},
    {"llama3-8b", 0, 0, 0, {4, KVA_BF16, 64}, 32 * KB_K, 8, 1, 0},
    {"llama3-8b", 0, 0, 0, {0, KVA_BF16, 0}, 32 * KB_K, 1, 1, 0},
    /* batches of 8 sequences */
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 32 * KB_K, 1, 8, 0},
    {"llama3-8b", 0, 0, 0, {4, KVA_BF16, 64}, 32 * KB_K, 1, 8, 0},
    /* short (4k) and long (128k) caches */
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 4 * KB_K, 1, 1, 0},
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 4 * KB_K, 8, 1, 0},
    {"gemma3-4b", 0, 0, 0, {0, KVA_BF16, 0}, 4 * KB_K, 1, 1, 0},
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 128 * KB_K, 1, 1, 0},
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 128 * KB_K, 8, 1, 0},
    {"gqa6-256", 0, 0, 0, {4, KVA_BF16, 64}, 128 * KB_K, 1, 1, 0},
    {"gqa6-256", 0, 0, 0, {4, KVA_BF16, 64}, 128 * KB_K, 8, 1, 0},
    /* ANCHORS.md's CPU verify case: 8/4/128, N=16384, L=8 */
    {NULL, 8, 4, 128, {4, KVA_BF16, 64}, 16 * KB_K, 8, 1, 0},
    {NULL, 8, 4, 128, {0, KVA_BF16, 0}, 16 * KB_K, 8, 1, 0},
    /* paged block pools, beside the contiguous figures above */
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 32 * KB_K, 1, 1, 16},
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 32 * KB_K, 8, 1, 16},
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 32 * KB_K, 1, 1, 64},
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 32 * KB_K, 8, 1, 64},
    {"gemma3-4b", 0, 0, 0, {0, KVA_BF16, 0}, 32 * KB_K, 1, 1, 16},
    {"gemma3-4b", 0, 0, 0, {0, KVA_BF16, 0}, 32 * KB_K, 1, 1, 64},
};

/* `--quick`: tiny shapes for a CI smoke run (seconds), covering every bit
 * width, GQA factors 1..6, L = 1 and 8, B > 1 and a length that is not a
 * multiple of any block size. */
static const suite_entry quick_suite[] = {
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 4 * KB_K, 1, 1, 0},
    {"gemma3-4b", 0, 0, 0, {4, KVA_BF16, 64}, 4 * KB_K, 8, 1, 0},
    {"gqa6-256", 0, 0, 0, {4, KVA_BF16, 64}, 4 * KB_K, 8, 1, 0},
    {"gemma3-4b", 0, 0, 0, {0, KVA_BF16, 0}, 4 * KB_K, 1, 1, 0},
    {"llama3-8b", 0, 0, 0, {8, KVA_BF16, 64}, 4 * KB_K, 1, 2, 0},
    {NULL, 4, 4, 128, {2, KVA_BF16, 32}, 3001, 8, 3, 0},
    {NULL, 6, 2, 64, {0, KVA_F16, 0}, 1000, 1, 2, 0},
};

static kb_case case_from(const char *preset, int64_t H, int64_t KVH, int64_t Dk, int64_t Dv,
                         kb_kvfmt kv, int64_t N, int64_t L, int64_t B, const kb_axes *a) {
  kb_case c;
  memset(&c, 0, sizeof c);
  snprintf(c.preset, sizeof c.preset, "%s", preset ? preset : "custom");
  c.H = H, c.KVH = KVH, c.Dk = Dk, c.Dv = Dv;
  c.kv = kv, c.N = N, c.L = L, c.B = B;
  c.qdtype = a->qdtype, c.odtype = a->odtype;
  c.layout = a->layout, c.block = a->block;
  c.in_order = a->in_order;
  return c;
}

static int from_table(const suite_entry *t, int n, const kb_axes *a, kb_case *out) {
  for (int i = 0; i < n; ++i) {
    kb_preset p = {t[i].preset, t[i].H, t[i].KVH, t[i].D};
    if (t[i].preset) kb_find_preset(t[i].preset, &p);
    out[i] = case_from(t[i].preset, p.H, p.KVH, p.D, p.D, t[i].kv, t[i].N, t[i].L, t[i].B, a);
    if (t[i].block > 0) {
      out[i].layout = KVA_LAYOUT_PAGED;
      out[i].block = t[i].block;
    }
  }
  return n;
}

bool kb_axes_explicit(const kb_axes *a) {
  return a->n_preset || a->heads_set || a->dim_set || a->n_ctx || a->n_rows || a->n_batch ||
         a->n_kv || a->group || a->n_tree;
}

/* The grid of the explicit axes; an axis not given takes `full`'s set (the
 * issue's grid) or a single default. Loops nest so that cases sharing a
 * cache (same KVH, D, N, B, format) are consecutive. */
static int grid(const kb_axes *a, bool full, kb_case *out, int cap, char *err, size_t errn) {
  static const kb_kvfmt full_kv[] = {{4, KVA_BF16, 64}, {8, KVA_BF16, 64}, {0, KVA_BF16, 0}};
  static const int64_t full_ctx[] = {4 * KB_K, 32 * KB_K, 128 * KB_K};
  static const int64_t full_rows[] = {1, 8}, full_batch[] = {1, 8};
  const int64_t one = 1, def_ctx = KB_DEFAULT_CTX;
  const kb_kvfmt def_kv = q(4, KB_DEFAULT_GROUP);

  kb_preset pre[KB_MAX_AXIS];
  int npre = a->n_preset;
  for (int i = 0; i < npre; ++i) pre[i] = a->preset[i];
  if (npre == 0) {
    if (full && !a->heads_set && !a->dim_set) {
      for (int i = 0; i < N_PRESETS; ++i) pre[i] = presets[i];
      npre = N_PRESETS;
    } else {
      pre[0] = presets[0];
      npre = 1;
    }
  }
  const int64_t *ctx = a->n_ctx ? a->ctx : full ? full_ctx : &def_ctx;
  int nctx = a->n_ctx ? a->n_ctx : full ? 3 : 1;
  const int64_t *rows = a->n_rows ? a->rows : full ? full_rows : &one;
  int nrows = a->n_rows ? a->n_rows : full ? 2 : 1;
  const int64_t *batch = a->n_batch ? a->batch : full ? full_batch : &one;
  int nbatch = a->n_batch ? a->n_batch : full ? 2 : 1;
  kb_kvfmt kv[KB_MAX_AXIS];
  int nkv = a->n_kv ? a->n_kv : full ? 3 : 1;
  for (int i = 0; i < nkv; ++i) kv[i] = a->n_kv ? a->kv[i] : full ? full_kv[i] : def_kv;
  for (int i = 0; i < nkv; ++i)
    if (kv[i].bits && a->group) kv[i].group = a->group;

  int n = 0;
  for (int ic = 0; ic < nctx; ++ic)
    for (int ib = 0; ib < nbatch; ++ib)
      for (int ik = 0; ik < nkv; ++ik)
        for (int ip = 0; ip < npre; ++ip)
          for (int ir = 0; ir < nrows + a->n_tree; ++ir) { /* the rows' cases, then the trees' */
            if (n == cap) {
              snprintf(err, errn, "more than %d cases", cap);
              return -1;
            }
            bool custom = a->heads_set || a->dim_set;
            int64_t H = a->heads_set ? a->H : pre[ip].H, KVH = a->heads_set ? a->KVH : pre[ip].KVH;
            int64_t Dk = a->dim_set ? a->Dk : pre[ip].D, Dv = a->dim_set ? a->Dv : pre[ip].D;
            const int64_t L = ir < nrows ? rows[ir] : a->tree[ir - nrows];
            out[n] = case_from(custom ? NULL : pre[ip].name, H, KVH, Dk, Dv, kv[ik], ctx[ic], L, batch[ib], a);
            out[n++].tree = ir < nrows ? 0 : L;
          }
  return n;
}

static int validate(const kb_case *c, char *err, size_t errn) {
  char label[128];
  kb_case_label(c, label, sizeof label);
  if (c->H <= 0 || c->KVH <= 0 || c->H % c->KVH != 0) {
    snprintf(err, errn, "%s: heads %lld:%lld: H must be a positive multiple of KVH", label,
             (long long)c->H, (long long)c->KVH);
    return -1;
  }
  if (c->tree && c->L > KVA_TREE_MAX_ROWS) {
    snprintf(err, errn, "%s: --tree %lld exceeds %d nodes (KVA_TREE_MAX_ROWS)", label, (long long)c->L,
             KVA_TREE_MAX_ROWS);
    return -1;
  }
  if (c->L > c->N) {
    snprintf(err, errn, "%s: --rows %lld exceeds --ctx %lld", label, (long long)c->L,
             (long long)c->N);
    return -1;
  }
  if (c->kv.bits) {
    int64_t dims[2] = {c->Dk, c->Dv};
    for (int i = 0; i < 2; ++i)
      if (dims[i] % c->kv.group != 0 || (dims[i] * c->kv.bits) % 32 != 0) {
        snprintf(err, errn,
                 "%s: head dim %lld must be a multiple of --group %d (and fill whole 32-bit words)",
                 label, (long long)dims[i], c->kv.group);
        return -1;
      }
  }
  return 0;
}

int kb_build_cases(const kb_axes *a, kb_suite suite, kb_case **out, char *err, size_t errn) {
  kb_case *cases = calloc(KB_MAX_CASES, sizeof *cases);
  if (!cases) {
    snprintf(err, errn, "out of memory");
    return -1;
  }
  int n;
  if (kb_axes_explicit(a))
    n = grid(a, suite == KB_SUITE_FULL, cases, KB_MAX_CASES, err, errn);
  else if (suite == KB_SUITE_FULL)
    n = grid(a, true, cases, KB_MAX_CASES, err, errn);
  else if (suite == KB_SUITE_QUICK)
    n = from_table(quick_suite, (int)(sizeof quick_suite / sizeof quick_suite[0]), a, cases);
  else
    n = from_table(default_suite, (int)(sizeof default_suite / sizeof default_suite[0]), a,
                   cases);
  for (int i = 0; i < n; ++i)
    if (validate(&cases[i], err, errn) < 0) n = -1;
  if (n < 0) {
    free(cases);
    return -1;
  }
  *out = cases;
  return n;
}
