/* `kvattn bench`: runs each case cold and checks it against the oracle.
 * Per case: make (or keep) the rotated K/V copies, fill q with random values
 * plus the check's probes, warm up, then time kva_attention on copy
 * (i mod copies) for each call i and take the median; check the output of
 * the last call with kva_reference_attention on a sample of heads. Prints a
 * table (or JSON lines) with the time, the effective bandwidth (K/V bytes /
 * median time), its fraction of the DRAM read bandwidth probed at the start
 * of the same run, GFLOP/s and the check's errors; progress goes to stderr. */
#include "bench.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define OUT_GUARD_BYTES 64
#define OUT_GUARD_BYTE 0xa5
#define HUGE_CASE_S 1.5 /* fewer than min_reps calls when min_reps would take longer */
#define MIN_REPS_HUGE 5
#define BW_DRIFT_WARN 0.15 /* warn when start/end bandwidth differ by more */
#define LOAD_WARN 0.5      /* 1-minute load average from which the header warns */
#define P90 0.9

/* NaN bit patterns: the output is pre-filled with them so that an element
 * the kernel never writes fails the check. */
static void fill_nan(void *p, kva_dtype dt, size_t n) {
  for (size_t i = 0; i < n; ++i) kb_store_f((char *)p + i * kva_dtype_size(dt), dt, NAN);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* ------------------------------------------------------------ progress */
typedef struct progress {
  bool on, tty;
  int i, n;
  char label[128];
} progress;

static void prog_stage(progress *pg, const char *stage) {
  if (!pg->on || !pg->tty) return;
  fprintf(stderr, "\r\033[K[%d/%d] %s: %s", pg->i + 1, pg->n, pg->label, stage);
  fflush(stderr);
}

static void prog_end(progress *pg, const kb_result *r) {
  if (!pg->on) return;
  const char *st[] = {"PASS", "FAIL", "ERROR", "unchecked"};
  if (pg->tty) {
    fprintf(stderr, "\r\033[K");
  } else {
    fprintf(stderr, "[%d/%d] %s: setup %.1fs, timing %.1fs, check %.1fs: %s\n", pg->i + 1, pg->n,
            pg->label, r->setup_s, r->time_s, r->check_s, st[r->status]);
  }
  fflush(stderr);
}

/* ------------------------------------------------------------- output */
static void json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; ++s) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\')
      fprintf(f, "\\%c", ch);
    else if (ch < 0x20)
      fprintf(f, "\\u%04x", ch);
    else
      fputc(ch, f);
  }
  fputc('"', f);
}

static void json_num(FILE *f, const char *key, double x) {
  if (isfinite(x))
    fprintf(f, ",\"%s\":%.6g", key, x);
  else
    fprintf(f, ",\"%s\":null", key);
}

/* Byte and FLOP counts: whole numbers. */
static void json_count(FILE *f, const char *key, double x) { fprintf(f, ",\"%s\":%.0f", key, x); }

static const char *status_name(kb_status s) {
  switch (s) {
  case KB_PASS: return "PASS";
  case KB_FAIL: return "FAIL";
  case KB_ERROR: return "ERROR";
  case KB_UNCHECKED: return "unchecked";
  }
  return "?";
}

typedef struct run_info {
  const kb_backend *be;
  double bw_gbps, fma_gflops;
  const char *simd;
} run_info;

static void print_json(const run_info *ri, const kb_case *c, const kb_result *r) {
  FILE *f = stdout;
  fprintf(f, "{\"op\":\"attention\",\"mode\":\"%s\",\"backend\":\"%s\",\"layout\":\"%s\"",
          c->L == 1 ? "decode" : "verify", ri->be->name, kb_layout_name(c->layout));
  fprintf(f, ",\"block\":%lld,\"block_order\":\"%s\",\"preset\":", (long long)c->block,
          c->layout != KVA_LAYOUT_PAGED ? "none" : c->in_order ? "sequential" : "shuffled");
  json_str(f, c->preset);
  fprintf(f, ",\"hadamard\":\"%s\",\"kernel\":",
          c->hadamard == (KVA_ATTN_ROTATED_K | KVA_ATTN_ROTATED_V) ? "kv" : c->hadamard == KVA_ATTN_ROTATED_K ? "k"
          : c->hadamard == KVA_ATTN_ROTATED_V ? "v" : "off");
  json_str(f, r->kernel);
  fprintf(f, ",\"kv\":\"%s\",\"group\":%d,\"kv_dtype\":\"%s\"", kb_kv_name(&c->kv), c->kv.group,
          kva_dtype_name(c->kv.dtype));
  fprintf(f, ",\"qdtype\":\"%s\",\"odtype\":\"%s\",\"mask\":\"%s\",\"tree\":%lld", kva_dtype_name(c->qdtype),
          kva_dtype_name(c->odtype), c->tree ? "tree" : "causal", (long long)c->tree);
  fprintf(f, ",\"heads\":%lld,\"kv_heads\":%lld,\"dim\":%lld,\"dim_v\":%lld", (long long)c->H,
          (long long)c->KVH, (long long)c->Dk, (long long)c->Dv);
  fprintf(f, ",\"ctx\":%lld,\"rows\":%lld,\"batch\":%lld,\"threads\":%d,\"simd\":\"%s\"",
          (long long)c->N, (long long)c->L, (long long)c->B, ri->be->threads, ri->simd);
  bool timed = r->reps > 0;
  json_num(f, "us", timed ? r->us : NAN);
  json_num(f, "us_min", timed ? r->us_min : NAN);
  json_num(f, "us_p90", timed ? r->us_p90 : NAN);
  fprintf(f, ",\"reps\":%d,\"warmups\":%d", r->reps, r->warmups);
  json_count(f, "kv_bytes", r->kv_bytes);
  json_count(f, "qo_bytes", r->qo_bytes);
  json_count(f, "flops", r->flops);
  json_num(f, "gbps", timed ? r->gbps : NAN);
  json_num(f, "bw_gbps", ri->bw_gbps);
  json_num(f, "bw_frac", timed ? r->bw_frac : NAN);
  json_num(f, "floor_us", r->floor_us);
  json_num(f, "gflops", timed ? r->gflops : NAN);
  json_num(f, "fma_gflops", ri->fma_gflops);
  json_num(f, "fma_floor_us", r->fma_floor_us);
  if (r->pattern_us > 0) json_num(f, "pattern_us", r->pattern_us);
  fprintf(f, ",\"copies\":%d", r->copies);
  json_count(f, "rotation_bytes", r->rotation_bytes);
  fprintf(f, ",\"cold\":%s", r->cold ? "true" : "false");
  bool checked = r->checked_rows > 0;
  json_num(f, "max_rel_err", checked && !r->nonfinite ? r->max_rel_err : NAN);
  json_num(f, "rel_l2", checked && !r->nonfinite ? r->rel_l2 : NAN);
  fprintf(f, ",\"checked_rows\":%d,\"nonfinite\":%s,\"status\":\"%s\"", r->checked_rows,
          r->nonfinite ? "true" : "false", status_name(r->status));
  fprintf(f, ",\"error\":");
  if (r->error[0])
    json_str(f, r->error);
  else
    fprintf(f, "null");
  fprintf(f, "}\n");
  fflush(f);
}

#define LABEL_W_MIN 44
static int label_w = LABEL_W_MIN;
static void print_table_head(void) {
  printf("%-*s %10s %9s %9s %7s %6s %8s %9s %9s %5s %6s  %s\n", label_w, "case", "us",
         "floor_us", "fma_us", "GB/s", "%bw", "GFLOP/s", "max_rel", "rel_l2", "reps", "copies",
         "check");
}

static void print_row(const kb_case *c, const kb_result *r) {
  char label[128];
  kb_case_label(c, label, sizeof label);
  if (r->status == KB_ERROR && r->reps == 0) {
    printf("%-*s %s\n", label_w, label, "ERROR (see below)");
    return;
  }
  char mr[16] = "-", l2[16] = "-";
  if (r->nonfinite)
    snprintf(mr, sizeof mr, "NaN/Inf"), snprintf(l2, sizeof l2, "NaN/Inf");
  else if (r->checked_rows)
    snprintf(mr, sizeof mr, "%.2e", r->max_rel_err), snprintf(l2, sizeof l2, "%.2e", r->rel_l2);
  printf("%-*s %10.1f %9.1f %9.1f %7.2f %5.1f%% %8.1f %9s %9s %5d %5d%s  %s\n", label_w, label,
         r->us, r->floor_us, r->fma_floor_us, r->gbps, 100.0 * r->bw_frac, r->gflops, mr, l2,
         r->reps, r->copies, r->cold ? " " : "*", status_name(r->status));
  fflush(stdout);
}

/* ------------------------------------------------------------ one case */
typedef struct case_bufs {
  kva_tensor q_host, out_host; /* host copies */
  kva_tensor q, out;           /* what the backend reads / writes */
  void *q_mem, *out_mem;       /* backend memory when not host */
  size_t out_bytes;
} case_bufs;

static void free_bufs(kb_backend *be, case_bufs *cb) {
  free(cb->q_host.data);
  free(cb->out_host.data);
  if (cb->q_mem) be->release(be, cb->q_mem, 0);
  if (cb->out_mem) be->release(be, cb->out_mem, 0);
  memset(cb, 0, sizeof *cb);
}

static int make_bufs(kb_backend *be, const kb_case *c, case_bufs *cb) {
  memset(cb, 0, sizeof *cb);
  size_t nq = (size_t)(c->B * c->H * c->L * c->Dk), no = (size_t)(c->B * c->H * c->L * c->Dv);
  size_t qb = nq * kva_dtype_size(c->qdtype);
  cb->out_bytes = no * kva_dtype_size(c->odtype);
  void *qh = malloc(qb), *oh = malloc(cb->out_bytes + OUT_GUARD_BYTES);
  cb->q_host = kva_tensor_4d(qh, c->qdtype, c->B, c->H, c->L, c->Dk);
  cb->out_host = kva_tensor_4d(oh, c->odtype, c->B, c->H, c->L, c->Dv);
  if (!qh || !oh) return KVA_ENOMEM;
  fill_nan(oh, c->odtype, no);
  memset((char *)oh + cb->out_bytes, OUT_GUARD_BYTE, OUT_GUARD_BYTES);
  if (be->host_memory) {
    cb->q = cb->q_host, cb->out = cb->out_host;
    return 0;
  }
  cb->q_mem = be->alloc(be, qb);
  cb->out_mem = be->alloc(be, cb->out_bytes + OUT_GUARD_BYTES);
  if (!cb->q_mem || !cb->out_mem) return KVA_ENOMEM;
  cb->q = cb->q_host, cb->out = cb->out_host;
  cb->q.data = cb->q_mem, cb->out.data = cb->out_mem;
  return be->copy_in(be, cb->out_mem, oh, cb->out_bytes + OUT_GUARD_BYTES);
}

static bool guard_intact(const case_bufs *cb) {
  const unsigned char *g = (const unsigned char *)cb->out_host.data + cb->out_bytes;
  for (int i = 0; i < OUT_GUARD_BYTES; ++i)
    if (g[i] != OUT_GUARD_BYTE) return false;
  return true;
}

static void set_error(kb_result *r, const char *what, const char *msg) {
  r->status = KB_ERROR;
  snprintf(r->error, sizeof r->error, "%s: %s", what, msg);
}

/* Does --pattern apply to the case: CPU backend, contiguous K/V, cold copies to read. */
static bool pattern_on(const kb_backend *be, const kb_opts *o, const kb_cacheset *cs) {
  return o->pattern && be->host_memory && cs->key.layout == KVA_LAYOUT_CONTIGUOUS && cs->copies >= 2;
}

/* Warm-ups then timed calls, each on the next copy; with --pattern each call
 * followed by a pass of the no-math read pattern over another copy (half
 * the rotation away, so it is as cold). */
static int time_case(kb_backend *be, const kb_opts *o, const kb_cacheset *cs, case_bufs *cb,
                     const kva_attn_params *p, kb_result *r) {
  const bool pat = pattern_on(be, o, cs);
  double *t = malloc((size_t)o->max_reps * sizeof *t), *pt = pat ? malloc((size_t)o->max_reps * sizeof *pt) : NULL;
  if (!t || (pat && !pt)) {
    free(t);
    free(pt);
    return KVA_ENOMEM;
  }
  int call = 0, rc = 0;
  {
    kva_kv_view view = kb_cacheset_view(cs, 0);
    rc = kva_attention_kernel(be->ctx, &cb->q, &view, p, &cb->out, r->kernel, sizeof r->kernel);
    if (rc > 0) rc = 0;
  }
  for (int w = 0; w < o->warmups && rc == 0; ++w, ++call) {
    kva_kv_view view = kb_cacheset_view(cs, call);
    double us;
    rc = be->time_call(be, &cb->q, &view, p, &cb->out, &us);
  }
  r->warmups = o->warmups;
  int n = 0, need = o->min_reps;
  double t0 = kb_now();
  while (rc == 0 && n < o->max_reps) {
    kva_kv_view view = kb_cacheset_view(cs, call++);
    rc = be->time_call(be, &cb->q, &view, p, &cb->out, &t[n]);
    if (rc < 0) break;
    if (pat) {
      kva_kv k, v;
      kb_cacheset_kv(cs, (call - 1 + cs->copies / 2) % cs->copies, &k, &v);
      if (kb_probe_pattern(be->threads, &k, &v, &pt[n]) < 0) {
        rc = KVA_EINVAL;
        break;
      }
    }
    if (n == 0 && t[0] * 1e-6 * need > HUGE_CASE_S) {
      need = (int)ceil(HUGE_CASE_S / (t[0] * 1e-6));
      if (need < MIN_REPS_HUGE) need = MIN_REPS_HUGE;
      if (need > o->min_reps) need = o->min_reps;
    }
    ++n;
    if (n >= need && kb_now() - t0 >= o->budget_s) break;
  }
  if (rc == 0) {
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    r->reps = n;
    r->us = n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
    r->us_min = t[0];
    int i90 = (int)ceil(P90 * n) - 1;
    r->us_p90 = t[i90 < 0 ? 0 : i90];
    if (pat) {
      qsort(pt, (size_t)n, sizeof *pt, cmp_double);
      r->pattern_us = n % 2 ? pt[n / 2] : 0.5 * (pt[n / 2 - 1] + pt[n / 2]);
    }
  }
  free(t);
  free(pt);
  return rc;
}

static void run_case(kb_backend *be, const kb_opts *o, const run_info *ri, const kb_case *c,
                     kb_cacheset *cs, bool *have_cache, uint64_t seed, progress *pg,
                     kb_result *r) {
  memset(r, 0, sizeof *r);
  r->kv_bytes = kb_case_kv_bytes(c);
  r->qo_bytes = kb_case_qo_bytes(c);
  r->flops = kb_case_flops(c);
  r->floor_us = r->kv_bytes / (ri->bw_gbps * 1e9) * 1e6;
  r->fma_floor_us = r->flops / (ri->fma_gflops * 1e9) * 1e6;
  char err[256] = "";
  double t0 = kb_now();

  prog_stage(pg, "filling K/V");
  if (*have_cache && !kb_same_cache(&cs->key, c)) {
    kb_cacheset_free(be, cs);
    *have_cache = false;
  }
  if (!*have_cache) {
    if (kb_cacheset_make(be, o, c, seed, cs, err, sizeof err) < 0) {
      set_error(r, "K/V setup", err);
      return;
    }
    *have_cache = true;
  }
  r->copies = cs->copies;
  r->copy_bytes = (double)cs->copy_bytes;
  r->rotation_bytes = (double)cs->rotated_bytes;
  r->cold = cs->note == NULL;
  r->note = cs->note;

  case_bufs cb;
  int rc = make_bufs(be, c, &cb);
  if (rc == 0) {
    kb_fill_randn(cb.q_host.data, c->qdtype, (size_t)(c->B * c->H * c->L * c->Dk), seed ^ 1);
    rc = kb_write_probes(c, cs, &cb.q_host, err, sizeof err);
    if (rc < 0) set_error(r, "probes", err);
  } else {
    set_error(r, "buffers", "out of memory");
  }
  if (rc == 0 && !be->host_memory)
    rc = be->copy_in(be, cb.q.data, cb.q_host.data,
                     (size_t)(c->B * c->H * c->L * c->Dk) * kva_dtype_size(c->qdtype));
  kva_attn_params p = kva_attn_defaults();
  p.mask.kind = KVA_MASK_CAUSAL;
  p.flags = (o->exact ? KVA_ATTN_EXACT : 0) | c->hadamard;
  kva_attn_params p_host = p; /* the check's (host bits) */
  uint32_t *tree_host = NULL;
  void *tree_dev = NULL;
  const size_t tree_bytes = c->tree ? sizeof(uint32_t) * (size_t)(c->L * ((c->L + 31) / 32)) : 0;
  if (rc == 0 && c->tree) { /* one EAGLE-style tree (kb_tree_parents) broadcast over the batch: u32 [1, L, W] */
    int parent[KVA_TREE_MAX_ROWS];
    tree_host = malloc(tree_bytes);
    if (!tree_host) {
      rc = KVA_ENOMEM;
      set_error(r, "tree", "out of memory");
    } else {
      kb_tree_parents(c->L, parent);
      kb_tree_bits(c->L, parent, tree_host);
      kva_tensor t = kva_tensor_2d(tree_host, KVA_U32, c->L, (c->L + 31) / 32);
      t.ndim = 3;
      t.shape[2] = t.shape[1], t.shape[1] = t.shape[0], t.shape[0] = 1;
      t.stride[2] = t.stride[1], t.stride[1] = t.stride[0], t.stride[0] = (int64_t)tree_bytes;
      p_host.mask.kind = p.mask.kind = KVA_MASK_TREE;
      p_host.mask.array = p.mask.array = t;
      if (!be->host_memory) {
        tree_dev = be->alloc(be, tree_bytes);
        rc = tree_dev ? be->copy_in(be, tree_dev, tree_host, tree_bytes) : KVA_ENOMEM;
        if (rc < 0) set_error(r, "tree", "device copy");
        p.mask.array.data = tree_dev;
      }
    }
  }
  r->setup_s = kb_now() - t0;

  if (rc == 0) {
    prog_stage(pg, "timing");
    t0 = kb_now();
    rc = time_case(be, o, cs, &cb, &p, r);
    r->time_s = kb_now() - t0;
    if (rc < 0) set_error(r, "kva_attention", kva_last_error());
  }
  if (rc == 0 && !be->host_memory)
    rc = be->copy_out(be, cb.out_host.data, cb.out.data, cb.out_bytes + OUT_GUARD_BYTES);
  if (rc == 0) {
    r->gbps = r->kv_bytes / (r->us * 1e-6) / 1e9;
    r->bw_frac = r->gbps / ri->bw_gbps;
    r->gflops = r->flops / (r->us * 1e-6) / 1e9;
    r->guard_ok = guard_intact(&cb);
    r->status = KB_UNCHECKED;
    if (o->check) {
      prog_stage(pg, "checking against the oracle");
      t0 = kb_now();
      rc = kb_check(c, cs, &cb.q_host, &cb.out_host, &p_host, be->host_threads, r, err, sizeof err);
      r->check_s = kb_now() - t0;
      if (rc < 0) {
        set_error(r, "check", err);
      } else {
        bool ok = !r->nonfinite && r->max_rel_err <= KB_TOL_MAX_REL && r->rel_l2 <= KB_TOL_REL_L2;
        r->status = ok ? KB_PASS : KB_FAIL;
        if (r->nonfinite) snprintf(r->error, sizeof r->error, "non-finite output");
      }
    }
    if (!r->guard_ok) {
      r->status = KB_FAIL;
      snprintf(r->error, sizeof r->error, "write past the end of the output");
    }
  }
  free_bufs(be, &cb);
  free(tree_host);
  if (tree_dev) be->release(be, tree_dev, tree_bytes);
}

/* --pattern: each case's time against the no-math read pattern's (cases
 * with one copy, --rotate-gib 0, have none: a second pass would be hot). */
static void print_pattern(const kb_opts *o, const kb_case *cases, const kb_result *res, int n) {
  bool any = false;
  for (int i = 0; i < n && o->pattern; ++i) {
    if (res[i].reps > 0 && res[i].copies < 2) {
      char label[128];
      kb_case_label(&cases[i], label, sizeof label);
      printf("%s%s: no read pattern pass (one K/V copy)\n", any ? "" : "\n", label);
      continue;
    }
    if (!(res[i].pattern_us > 0) || !(res[i].us > 0)) continue;
    if (!any)
      printf("\nread pattern without math (--pattern; medians of passes alternated with the calls):\n"
             "%-*s %10s %10s %8s %7s\n", label_w, "case", "us", "pat_us", "us/pat", "pat%bw");
    any = true;
    char label[128];
    kb_case_label(&cases[i], label, sizeof label);
    printf("%-*s %10.1f %10.1f %7.2fx %6.1f%%\n", label_w, label, res[i].us, res[i].pattern_us,
           res[i].us / res[i].pattern_us, 100.0 * res[i].floor_us / res[i].pattern_us);
  }
}

/* --------------------------------------------------------------- run */
static void print_ratios(const kb_case *cs, const kb_result *rs, int n) {
  bool head = false;
  for (int i = 0; i < n; ++i) {
    if (cs[i].L == 1 || rs[i].reps == 0) continue;
    for (int j = 0; j < n; ++j) {
      if (cs[j].L != 1 || rs[j].reps == 0 || !kb_same_cache(&cs[i], &cs[j]) ||
          cs[i].H != cs[j].H || cs[i].qdtype != cs[j].qdtype || cs[i].odtype != cs[j].odtype)
        continue;
      if (!head) printf("\nverify / decode (same cache and heads; tree=N: a tree verify of N nodes):\n");
      head = true;
      char label[128];
      kb_case_label(&cs[i], label, sizeof label);
      printf("  %s: %.1f us / L=1 %.1f us = %.2fx", label, rs[i].us, rs[j].us, rs[i].us / rs[j].us);
      if (cs[i].tree) printf("  (%s / %s)", rs[i].kernel, rs[j].kernel); /* which kernels the tree and decode ran */
      printf("\n");
      break;
    }
  }
}

int kb_run_bench(const kb_opts *o, const kb_axes *a, kb_suite suite) {
  char err[256];
  kb_case *cases = NULL;
  int n = kb_build_cases(a, suite, &cases, err, sizeof err);
  if (n < 0) {
    fprintf(stderr, "kvattn bench: %s\n", err);
    return KB_EXIT_USAGE;
  }
  if (n == 0) {
    fprintf(stderr, "kvattn bench: no cases selected\n");
    free(cases);
    return KB_EXIT_USAGE;
  }
  if (o->hadamard) { /* on: every case rotated; both: each case unrotated, then rotated (same cache) */
    const int per = o->hadamard == 2 ? 2 : 1;
    kb_case *hc = calloc((size_t)(n * per), sizeof *hc);
    if (!hc) {
      fprintf(stderr, "kvattn bench: out of memory\n");
      free(cases);
      return KB_EXIT_FAIL;
    }
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < per; ++j) {
        hc[i * per + j] = cases[i];
        hc[i * per + j].hadamard = per == 1 || j == 1 ? o->hadamard_flags : 0;
      }
    free(cases);
    cases = hc;
    n *= per;
  }
  if (o->list) {
    printf("%-52s %12s %12s %10s\n", "case", "kv_bytes", "qo_bytes", "GFLOP");
    for (int i = 0; i < n; ++i) {
      char label[128];
      kb_case_label(&cases[i], label, sizeof label);
      printf("%-52s %12.0f %12.0f %10.3f\n", label, kb_case_kv_bytes(&cases[i]),
             kb_case_qo_bytes(&cases[i]), kb_case_flops(&cases[i]) / 1e9);
    }
    free(cases);
    return KB_EXIT_OK;
  }
  kb_backend be;
  if (kb_backend_open(o, &be, err, sizeof err) < 0) {
    fprintf(stderr, "kvattn bench: %s\n", err);
    free(cases);
    return KB_EXIT_FAIL;
  }
  double t_start = kb_now();
  progress pg = {!o->quiet, isatty(STDERR_FILENO) != 0, 0, n, ""};
  run_info ri = {&be, 0, 0, kva_cpu_simd()};
  char bw_desc[256] = "", model[128];
  if (pg.on) fprintf(stderr, "kvattn bench: measuring the memory ceiling on %d thread%s...\n",
                     be.threads, be.threads == 1 ? "" : "s");
  if (be.ceiling(&be, o, &ri.bw_gbps, bw_desc, sizeof bw_desc) < 0 || !(ri.bw_gbps > 0)) {
    fprintf(stderr, "kvattn bench: the bandwidth probe failed (out of memory?)\n");
    be.destroy(&be);
    free(cases);
    return KB_EXIT_FAIL;
  }
  const char *fma_isa = "?";
  if (kb_probe_fma(be.threads, &ri.fma_gflops, &fma_isa) < 0) ri.fma_gflops = NAN;

  if (!o->json) {
    printf("kvattn %s bench: backend %s, %d thread%s, SIMD %s, %s\n", kva_version(), be.name,
           be.threads, be.threads == 1 ? "" : "s", ri.simd, kb_cpu_model(model, sizeof model));
    double load = kb_loadavg();
    printf("%s\n", bw_desc);
    if (load >= 0)
      printf("load average at start: %.2f on %ld cores%s\n", load, sysconf(_SC_NPROCESSORS_ONLN),
             load >= LOAD_WARN ? " (other processes were running: expect noisy figures)" : "");
    printf("f32 FMA peak: %.0f GFLOP/s (%s, %d thread%s)\n", ri.fma_gflops, fma_isa, be.threads,
           be.threads == 1 ? "" : "s");
    char rot[96];
    if (o->rotate_bytes > 0)
      snprintf(rot, sizeof rot, "K/V rotated over >= %.2f GiB of copies", o->rotate_bytes / KB_GIB);
    else
      snprintf(rot, sizeof rot, "no K/V rotation (caches may be warm)");
    printf("q %s, out %s, causal mask (tree=N: KVA_MASK_TREE, an EAGLE-style tree of N nodes); median of >= %d timed call%s after %d warm-up%s; %s; "
           "seed %llu\n",
           kva_dtype_name(cases[0].qdtype), kva_dtype_name(cases[0].odtype), o->min_reps,
           o->min_reps == 1 ? "" : "s", o->warmups, o->warmups == 1 ? "" : "s", rot,
           (unsigned long long)o->seed);
    if (be.kind == KVA_BACKEND_CUDA)
      printf("device time (CUDA events; %s ahead of each call hides the host's launch overhead, "
             "as a CUDA graph does, and flushes the L2)\n",
             o->cuda_flush_memset ? "a 64 MiB memset (dirty L2 lines)" : "a 128 MiB read (clean L2 lines)");
    printf("GB/s = K/V data+scales+biases bytes / median; %%bw = GB/s / the memory ceiling above; "
           "floor_us = those bytes at that bandwidth;\nfma_us = the case's FLOPs at the f32 FMA "
           "peak; * = K/V not rotated over 1 GiB (note below)\n\n");
    for (int i = 0; i < n; ++i) {
      char label[128];
      kb_case_label(&cases[i], label, sizeof label);
      if ((int)strlen(label) > label_w) label_w = (int)strlen(label);
    }
    print_table_head();
  }

  kb_result *res = calloc((size_t)n, sizeof *res);
  if (!res) {
    fprintf(stderr, "kvattn bench: out of memory\n");
    be.destroy(&be);
    free(cases);
    return KB_EXIT_FAIL;
  }
  kb_cacheset cs;
  memset(&cs, 0, sizeof cs);
  bool have_cache = false;
  int n_pass = 0, n_fail = 0, n_err = 0, n_warm = 0;
  double setup = 0, timing = 0, check = 0;
  for (int i = 0; i < n; ++i) {
    pg.i = i;
    kb_case_label(&cases[i], pg.label, sizeof pg.label);
    uint64_t seed = o->seed + 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
    run_case(&be, o, &ri, &cases[i], &cs, &have_cache, seed, &pg, &res[i]);
    prog_end(&pg, &res[i]);
    if (o->json)
      print_json(&ri, &cases[i], &res[i]);
    else
      print_row(&cases[i], &res[i]);
    n_pass += res[i].status == KB_PASS;
    n_fail += res[i].status == KB_FAIL;
    n_err += res[i].status == KB_ERROR;
    n_warm += res[i].reps > 0 && !res[i].cold;
    setup += res[i].setup_s, timing += res[i].time_s, check += res[i].check_s;
  }
  if (have_cache) kb_cacheset_free(&be, &cs);

  /* The ceiling again, to show whether the machine stayed as quiet. */
  double bw_end = 0;
  char bw_end_desc[256] = "";
  if (!o->quick) be.ceiling(&be, o, &bw_end, bw_end_desc, sizeof bw_end_desc);
  double total = kb_now() - t_start;

  FILE *sum = o->json ? stderr : stdout;
  if (!o->json) {
    for (int i = 0; i < n; ++i) {
      char label[128];
      kb_case_label(&cases[i], label, sizeof label);
      if (res[i].error[0]) printf("  %s: %s\n", label, res[i].error);
    }
    if (n_warm) {
      for (int i = 0; i < n; ++i)
        if (res[i].reps > 0 && !res[i].cold) {
          printf("* %s\n", res[i].note);
          break;
        }
    }
    print_ratios(cases, res, n);
    print_pattern(o, cases, res, n);
    for (int i = 1; i < n && o->hadamard == 2; i += 2) {
      if (res[i].reps == 0 || res[i - 1].reps == 0) continue;
      char label[128];
      kb_case_label(&cases[i - 1], label, sizeof label);
      printf("%s hadamard %s: %+.1f %% of the unrotated call's time (%.1f us vs %.1f us)\n",
             i == 1 ? "\n" : "", label, 100.0 * (res[i].us / res[i - 1].us - 1.0), res[i].us, res[i - 1].us);
    }
    printf("\n");
  }
  if (bw_end > 0) {
    fprintf(sum, "memory ceiling at the end: %.1f GB/s (start %.1f GB/s)%s\n", bw_end,
            ri.bw_gbps,
            fabs(bw_end - ri.bw_gbps) > BW_DRIFT_WARN * ri.bw_gbps
                ? ": the machine was not equally quiet during the run; repeat for stable figures"
                : "");
  }
  fprintf(sum, "%d case%s: %d PASS, %d FAIL, %d ERROR%s; %.0f s (setup %.0f s, timing %.0f s, "
               "check %.0f s)\n",
          n, n == 1 ? "" : "s", n_pass, n_fail, n_err,
          o->check ? "" : " (oracle check disabled)", total, setup, timing, check);
  be.destroy(&be);
  free(res);
  free(cases);
  return n_fail || n_err ? KB_EXIT_FAIL : KB_EXIT_OK;
}
