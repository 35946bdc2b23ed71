/* One context shared by several threads, and a context inherited by a
 * fork()ed child. Threads: N threads x M calls on ONE context, cases of
 * different sizes (so the context's workspace grows while other calls run),
 * every output bit-equal to the result of the same inputs computed alone
 * beforehand on a context with the same thread count; with the context's
 * workspace (NULL) and with a workspace per calling thread. Fork: a child
 * calls kva_attention on its parent's context (also while another parent
 * thread is inside a call on it) and must match the parent's result; the
 * parent waits with a deadline, so a hang fails instead of stalling. */
#include "test.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef KVA_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define TH_POOL_THREADS 2 /* worker threads of every context here (results depend on the split) */
#define TH_MAX_CASES 8
#define TH_MAX_CALLERS 4

typedef struct th_case {
  int B, H, KVH, L, D;
  int64_t N;
  kva_dtype kvdt;
  float *q;        /* [B, H, L, D] f32 */
  void *k, *v;     /* [B, KVH, N, D] kvdt */
  size_t kv_bytes; /* of k (and of v) */
  size_t out_n;    /* elements of out [B, H, L, D] f32 */
  float *solo;     /* the result computed alone */
  void *dq, *dk, *dv; /* device copies (CUDA variant) */
} th_case;

/* Sizes ascending in workspace need: small decode first, large ragged
 * verify last, f32 and bf16 K/V. */
static const struct { int B, H, KVH, L, D; int64_t N; kva_dtype kvdt; } th_shapes[TH_MAX_CASES] = {
    {1, 4, 2, 1, 64, 17, KVA_F32},     {1, 8, 2, 1, 128, 113, KVA_BF16}, {2, 8, 2, 4, 64, 600, KVA_F32},
    {1, 8, 1, 1, 128, 2048, KVA_BF16}, {3, 4, 2, 4, 128, 1500, KVA_F32}, {3, 8, 4, 8, 64, 2500, KVA_BF16},
    {2, 8, 2, 4, 128, 4097, KVA_BF16}, {3, 8, 2, 2, 128, 4097, KVA_F32},
};

static int th_ncases(void) { return test_quick ? 6 : TH_MAX_CASES; }

static int th_make(th_case *c, int i) {
  memset(c, 0, sizeof *c);
  c->B = th_shapes[i].B;
  c->H = th_shapes[i].H;
  c->KVH = th_shapes[i].KVH;
  c->L = th_shapes[i].L;
  c->D = th_shapes[i].D;
  c->N = th_shapes[i].N;
  c->kvdt = th_shapes[i].kvdt;
  const size_t esz = c->kvdt == KVA_F32 ? 4 : 2, kv_n = (size_t)c->B * c->KVH * c->N * c->D;
  c->out_n = (size_t)c->B * c->H * c->L * c->D;
  c->kv_bytes = kv_n * esz;
  c->q = (float *)malloc(c->out_n * sizeof(float));
  c->k = malloc(c->kv_bytes);
  c->v = malloc(c->kv_bytes);
  c->solo = (float *)malloc(c->out_n * sizeof(float));
  if (!c->q || !c->k || !c->v || !c->solo) return -1;
  for (size_t j = 0; j < c->out_n; ++j) c->q[j] = test_randu(-2.0f, 2.0f);
  for (size_t j = 0; j < kv_n; ++j) {
    test_store((char *)c->k + j * esz, c->kvdt, test_randu(-1.0f, 1.0f));
    test_store((char *)c->v + j * esz, c->kvdt, test_randu(-1.0f, 1.0f));
  }
  return 0;
}

static void th_free(th_case *c) {
  free(c->q);
  free(c->k);
  free(c->v);
  free(c->solo);
#ifdef KVA_HAVE_CUDA
  if (c->dq) cudaFree(c->dq);
  if (c->dk) cudaFree(c->dk);
  if (c->dv) cudaFree(c->dv);
#endif
}

/* The call's operands: host or device pointers (dev), causal mask. */
typedef struct th_call {
  kva_tensor q, out;
  kva_kv k, v;
  kva_kv_view view;
  kva_attn_params params;
} th_call;

static void th_call_init(th_call *a, const th_case *c, int dev, void *out) {
  a->q = kva_tensor_4d(dev ? c->dq : (void *)c->q, KVA_F32, c->B, c->H, c->L, c->D);
  a->k = kva_kv_float(dev ? c->dk : c->k, c->kvdt, c->B, c->KVH, c->N, c->D);
  a->v = kva_kv_float(dev ? c->dv : c->v, c->kvdt, c->B, c->KVH, c->N, c->D);
  a->out = kva_tensor_4d(out, KVA_F32, c->B, c->H, c->L, c->D);
  a->params = kva_attn_defaults();
  a->params.mask.kind = KVA_MASK_CAUSAL;
}

static int th_run(kva_context *ctx, const th_case *c, int dev, void *out, void *ws, size_t ws_bytes) {
  th_call a;
  th_call_init(&a, c, dev, out);
  a.view = kva_view_contiguous(&a.k, &a.v, NULL);
  return kva_attention(ctx, &a.q, &a.view, &a.params, &a.out, ws, ws_bytes);
}

typedef struct th_shared {
  kva_context *ctx;
  th_case *cases;
  int ncases, calls, dev;
  size_t ws_bytes; /* > 0: every caller passes its own workspace of this size */
} th_shared;

typedef struct th_caller {
  const th_shared *s;
  int id;
  uint64_t rng;
  long bad, errors; /* calls whose output differed from the solo result / that failed */
} th_caller;

static void *th_caller_main(void *arg) {
  th_caller *t = (th_caller *)arg;
  const th_shared *s = t->s;
  size_t max_n = 0;
  for (int i = 0; i < s->ncases; ++i)
    if (s->cases[i].out_n > max_n) max_n = s->cases[i].out_n;
  float *host = (float *)malloc(max_n * sizeof(float));
  void *out = host, *ws = NULL;
  if (!host) { t->errors = s->calls; return NULL; }
#ifdef KVA_HAVE_CUDA
  if (s->dev && cudaMalloc(&out, max_n * sizeof(float)) != cudaSuccess) { free(host); t->errors = s->calls; return NULL; }
  if (s->dev && s->ws_bytes && cudaMalloc(&ws, s->ws_bytes) != cudaSuccess) ws = NULL;
#endif
  if (!s->dev && s->ws_bytes) ws = malloc(s->ws_bytes);
  if (s->ws_bytes && !ws) t->errors = s->calls;
  for (int i = 0; i < s->calls && !(s->ws_bytes && !ws); ++i) {
    /* Mostly growing sizes, with random picks among the cases seen so far,
     * so small and large calls overlap while the workspace grows. */
    t->rng = t->rng * 6364136223846793005ull + 1442695040888963407ull;
    int reach = 1 + (int)((long long)(i + 1) * s->ncases / s->calls);
    const th_case *c = &s->cases[(t->rng >> 33) % (uint64_t)(reach < s->ncases ? reach : s->ncases)];
    const size_t bytes = c->out_n * sizeof(float);
    int rc = th_run(s->ctx, c, s->dev, out, ws, s->ws_bytes);
    if (rc < 0) { t->errors++; continue; }
#ifdef KVA_HAVE_CUDA
    if (s->dev && cudaMemcpy(host, out, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) { t->errors++; continue; }
#endif
    if (memcmp(host, c->solo, bytes)) t->bad++;
  }
#ifdef KVA_HAVE_CUDA
  if (s->dev) {
    cudaFree(out);
    if (ws) cudaFree(ws);
    ws = NULL;
  }
#endif
  free(ws);
  free(host);
  return NULL;
}

/* Solo results on one context, then `rounds` fresh contexts each called by
 * `callers` threads at once (the first calls of a round grow the workspace
 * while others run). Returns the calls that differed or failed. */
static long th_concurrent(kva_backend backend, int caller_ws, int rounds, int callers, int calls, long *total) {
  th_case cases[TH_MAX_CASES];
  const int nc = th_ncases(), dev = backend == KVA_BACKEND_CUDA;
  kva_context_opts o = {backend, dev ? 0 : TH_POOL_THREADS, 0, NULL};
  long failures = 0;
  *total = 0;
  int made = 0;
  for (; made < nc; ++made)
    if (th_make(&cases[made], made) < 0) { FAIL_("out of memory"); goto done; }
#ifdef KVA_HAVE_CUDA
  for (int i = 0; dev && i < nc; ++i) {
    th_case *c = &cases[i];
    if (cudaMalloc(&c->dq, c->out_n * 4) || cudaMalloc(&c->dk, c->kv_bytes) || cudaMalloc(&c->dv, c->kv_bytes) ||
        cudaMemcpy(c->dq, c->q, c->out_n * 4, cudaMemcpyHostToDevice) ||
        cudaMemcpy(c->dk, c->k, c->kv_bytes, cudaMemcpyHostToDevice) ||
        cudaMemcpy(c->dv, c->v, c->kv_bytes, cudaMemcpyHostToDevice)) {
      FAIL_("device copies of case %d", i);
      goto done;
    }
  }
#endif
  kva_context *solo = NULL;
  if (kva_context_create(&solo, &o) < 0) { FAIL_("context: %s", kva_last_error()); goto done; }
  size_t ws_bytes = 0;
  for (int i = 0; i < nc; ++i) {
    th_case *c = &cases[i];
    void *out = c->solo;
#ifdef KVA_HAVE_CUDA
    if (dev && cudaMalloc(&out, c->out_n * 4) != cudaSuccess) { FAIL_("cudaMalloc"); break; }
#endif
    int rc = th_run(solo, c, dev, out, NULL, 0);
    th_call a;
    th_call_init(&a, c, dev, out);
    a.view = kva_view_contiguous(&a.k, &a.v, NULL);
    size_t need = 0;
    if (rc >= 0) rc = kva_attention_workspace_size(solo, &a.q, &a.view, &a.params, &need);
    if (need > ws_bytes) ws_bytes = need;
#ifdef KVA_HAVE_CUDA
    if (dev) {
      if (rc >= 0 && cudaMemcpy(c->solo, out, c->out_n * 4, cudaMemcpyDeviceToHost) != cudaSuccess) rc = -1;
      cudaFree(out);
    }
#endif
    if (rc < 0) { FAIL_("solo call %d: %s", i, kva_last_error()); break; }
  }
  kva_context_destroy(solo);
  if (test_failed_flag) goto done;
  for (int r = 0; r < rounds; ++r) {
    th_shared s = {NULL, cases, nc, calls, dev, caller_ws ? ws_bytes : 0};
    if (kva_context_create(&s.ctx, &o) < 0) { FAIL_("context: %s", kva_last_error()); goto done; }
    pthread_t tid[TH_MAX_CALLERS];
    th_caller t[TH_MAX_CALLERS];
    int started = 0;
    for (; started < callers; ++started) {
      t[started] = (th_caller){&s, started, test_rand_u64(), 0, 0};
      if (pthread_create(&tid[started], NULL, th_caller_main, &t[started])) break;
    }
    for (int i = 0; i < started; ++i) {
      pthread_join(tid[i], NULL);
      failures += t[i].bad + t[i].errors;
      *total += calls;
    }
    kva_context_destroy(s.ctx);
    if (started < callers) { FAIL_("pthread_create"); goto done; }
  }
done:
  for (int i = 0; i < made; ++i) th_free(&cases[i]);
  return failures;
}

static void th_check(kva_backend backend, int caller_ws) {
  long total = 0;
  const int rounds = test_quick ? 2 : 4, calls = test_quick ? 24 : 60;
  long bad = th_concurrent(backend, caller_ws, rounds, TH_MAX_CALLERS, calls, &total);
  if (test_failed_flag) return;
  printf("  %ld of %ld calls (%d threads on one context, %s workspace) differ from the solo result\n", bad, total,
         TH_MAX_CALLERS, caller_ws ? "per-thread" : "the context's");
  ASSERT_EQ(bad, 0);
}

TEST(threads_one_context) { th_check(KVA_BACKEND_CPU, 0); }
TEST(threads_one_context_caller_workspace) { th_check(KVA_BACKEND_CPU, 1); }

#ifdef KVA_HAVE_CUDA
TEST(threads_one_context_cuda) {
  if (kva_cuda_device_count() <= 0) SKIP("no CUDA device");
  th_check(KVA_BACKEND_CUDA, 0);
}
TEST(threads_one_context_cuda_caller_workspace) {
  if (kva_cuda_device_count() <= 0) SKIP("no CUDA device");
  th_check(KVA_BACKEND_CUDA, 1);
}
#else
TEST(threads_one_context_cuda) { SKIP("built without CUDA (nvcc not found)"); }
TEST(threads_one_context_cuda_caller_workspace) { SKIP("built without CUDA (nvcc not found)"); }
#endif

/* Concurrent kva_cache_write and kva_attention on one context: the writes
 * land exactly where a solo write puts them. */
TEST(threads_cache_write_and_attention) {
  enum { NB = 64, BS = 16, KVH = 2, D = 128, NTOK = 256 };
  float *kn = (float *)malloc(sizeof(float) * NTOK * KVH * D), *vn = (float *)malloc(sizeof(float) * NTOK * KVH * D);
  float *pools[4];
  for (int i = 0; i < 4; ++i) pools[i] = (float *)calloc((size_t)NB * KVH * BS * D, sizeof(float));
  int32_t slots[NTOK];
  th_case c;
  kva_context *ctx = NULL;
  kva_context_opts o = {KVA_BACKEND_CPU, TH_POOL_THREADS, 0, NULL};
  int ok = kn && vn && pools[0] && pools[1] && pools[2] && pools[3] && th_make(&c, 4) == 0;
  if (ok) {
    for (int i = 0; i < NTOK * KVH * D; ++i) { kn[i] = test_randn(); vn[i] = test_randn(); }
    for (int i = 0; i < NTOK; ++i) slots[i] = (int32_t)((i * 37) % (NB * BS));
    ok = kva_context_create(&ctx, &o) == 0 && th_run(ctx, &c, 0, c.solo, NULL, 0) == 0;
  }
  if (ok) {
    kva_kv kp[2] = {kva_kv_float(pools[0], KVA_F32, NB, KVH, BS, D), kva_kv_float(pools[1], KVA_F32, NB, KVH, BS, D)};
    kva_kv vp[2] = {kva_kv_float(pools[2], KVA_F32, NB, KVH, BS, D), kva_kv_float(pools[3], KVA_F32, NB, KVH, BS, D)};
    kva_tensor kt = {kn, KVA_F32, 3, {NTOK, KVH, D}, {KVH * D * 4, D * 4, 4}};
    kva_tensor vt = {vn, KVA_F32, 3, {NTOK, KVH, D}, {KVH * D * 4, D * 4, 4}};
    ok = kva_cache_write(ctx, &kp[0], &vp[0], &kt, &vt, slots, NTOK) == 0; /* the solo write */
    th_shared s = {ctx, &c, 1, test_quick ? 20 : 60, 0, 0};
    th_caller t = {&s, 0, 1, 0, 0};
    pthread_t tid;
    if (ok && pthread_create(&tid, NULL, th_caller_main, &t) == 0) {
      for (int i = 0; i < (test_quick ? 20 : 60) && ok; ++i) {
        memset(pools[1], 0, sizeof(float) * NB * KVH * BS * D);
        memset(pools[3], 0, sizeof(float) * NB * KVH * BS * D);
        ok = kva_cache_write(ctx, &kp[1], &vp[1], &kt, &vt, slots, NTOK) == 0 &&
             !memcmp(pools[0], pools[1], sizeof(float) * NB * KVH * BS * D) &&
             !memcmp(pools[2], pools[3], sizeof(float) * NB * KVH * BS * D);
      }
      pthread_join(tid, NULL);
      if (t.bad || t.errors) FAIL_("%ld attention calls differ, %ld failed, next to cache writes", t.bad, t.errors);
    } else {
      ok = 0;
    }
  }
  if (!ok) FAIL_("cache_write next to attention calls: %s", kva_last_error());
  kva_context_destroy(ctx);
  th_free(&c);
  free(kn);
  free(vn);
  for (int i = 0; i < 4; ++i) free(pools[i]);
}

/* ---- fork ---- */
#if defined(__SANITIZE_THREAD__)
#define TH_NO_FORK "ThreadSanitizer does not support threads started in the child of a multi-threaded fork"
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TH_NO_FORK "ThreadSanitizer does not support threads started in the child of a multi-threaded fork"
#endif
#endif
/* Why fork cannot be tested here (NULL: it can): a sanitizer (TH_NO_FORK),
 * or an emulator the runner names in KVATTN_TEST_EMULATED (make
 * test-aarch64: qemu-user 7.2 aborts in its own code, an assertion in
 * qemu_plugin_vcpu_init_hook, in the child of a multi-threaded fork). */
static const char *th_fork_skip(void) {
#ifdef TH_NO_FORK
  return TH_NO_FORK;
#else
  const char *e = getenv("KVATTN_TEST_EMULATED");
  return e && *e ? "fork of a multi-threaded process under this emulator (KVATTN_TEST_EMULATED)" : NULL;
#endif
}

/* Waits for pid at most `seconds`; kills it on timeout. Returns its exit
 * status, or -1 on timeout / abnormal end. */
static int th_wait(pid_t pid, double seconds) {
  const struct timespec tick = {0, 5 * 1000 * 1000};
  for (double waited = 0; waited < seconds; waited += 0.005) {
    int st = 0;
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (r < 0 && errno != EINTR) return -1;
    nanosleep(&tick, NULL);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return -1;
}

/* In the child: `calls` calls on the parent's context, each bit-equal to the
 * parent's result (exit 0), else exit 1 (wrong) or 2 (error); destroy must
 * not wait for the parent's workers. alarm() bounds a hang on its own. */
static void th_child(kva_context *ctx, const th_case *c, int calls, int destroy) {
  alarm(10);
  float *out = (float *)malloc(c->out_n * sizeof(float));
  int code = out ? 0 : 2;
  for (int i = 0; i < calls && code == 0; ++i) {
    memset(out, 0xff, c->out_n * sizeof(float));
    if (th_run(ctx, c, 0, out, NULL, 0) < 0) code = 2;
    else if (memcmp(out, c->solo, c->out_n * sizeof(float))) code = 1;
  }
  if (destroy) kva_context_destroy(ctx);
  free(out);
  _exit(code);
}

typedef struct th_busy { kva_context *ctx; const th_case *c; float *out; atomic_int stop; long calls; } th_busy;
static void *th_busy_main(void *arg) {
  th_busy *b = (th_busy *)arg;
  while (!atomic_load(&b->stop)) {
    th_run(b->ctx, b->c, 0, b->out, NULL, 0);
    b->calls++;
  }
  return NULL;
}

TEST(fork_child_uses_parent_context) {
  if (th_fork_skip()) SKIP("%s", th_fork_skip());
  th_case c;
  kva_context *ctx = NULL;
  kva_context_opts o = {KVA_BACKEND_CPU, TH_POOL_THREADS, 0, NULL};
  if (th_make(&c, 3) < 0 || kva_context_create(&ctx, &o) < 0) { FAIL_("setup"); th_free(&c); return; }
  ASSERT_OK(th_run(ctx, &c, 0, c.solo, NULL, 0)); /* the parent's result; its workers are running */
  int hung = 0, wrong = 0;
  /* calls in the child: 2 (then destroy), 1 (no destroy), 0 (destroy only) */
  for (int variant = 0; variant < 3; ++variant) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) { FAIL_("fork: %s", strerror(errno)); break; }
    if (pid == 0) th_child(ctx, &c, variant == 0 ? 2 : variant == 1 ? 1 : 0, variant != 1);
    int st = th_wait(pid, 10);
    hung += st < 0;
    wrong += st > 0;
  }
  /* The parent's context still works after the forks. */
  float *out = (float *)malloc(c.out_n * sizeof(float));
  if (out && th_run(ctx, &c, 0, out, NULL, 0) == 0 && memcmp(out, c.solo, c.out_n * sizeof(float))) wrong++;
  free(out);
  kva_context_destroy(ctx);
  th_free(&c);
  if (hung || wrong) FAIL_("of 3 children, %d hung or crashed, %d gave a wrong result or an error", hung, wrong);
}

/* Forks while another parent thread is inside calls on the same context
 * (holding its locks at the moment of the fork); every child must finish. */
TEST(fork_while_another_thread_calls) {
  if (th_fork_skip()) SKIP("%s", th_fork_skip());
  th_case c;
  kva_context *ctx = NULL;
  kva_context_opts o = {KVA_BACKEND_CPU, TH_POOL_THREADS, 0, NULL};
  if (th_make(&c, 2) < 0 || kva_context_create(&ctx, &o) < 0) { FAIL_("setup"); th_free(&c); return; }
  ASSERT_OK(th_run(ctx, &c, 0, c.solo, NULL, 0));
  th_busy b = {ctx, &c, (float *)malloc(c.out_n * sizeof(float)), 0, 0};
  pthread_t tid;
  if (!b.out || pthread_create(&tid, NULL, th_busy_main, &b)) { FAIL_("setup"); free(b.out); th_free(&c); return; }
  const int forks = test_quick ? 8 : 24;
  int hung = 0, wrong = 0;
  for (int i = 0; i < forks; ++i) {
    const struct timespec pause = {0, (long)(test_rand_u64() % 2000000)};
    nanosleep(&pause, NULL);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) { FAIL_("fork: %s", strerror(errno)); break; }
    if (pid == 0) th_child(ctx, &c, 1, 1);
    int st = th_wait(pid, 10);
    hung += st < 0;
    wrong += st > 0;
  }
  atomic_store(&b.stop, 1);
  pthread_join(tid, NULL);
  if (memcmp(b.out, c.solo, c.out_n * sizeof(float))) wrong++;
  free(b.out);
  kva_context_destroy(ctx);
  th_free(&c);
  if (hung || wrong) FAIL_("of %d children, %d hung or crashed, %d gave a wrong result or an error", forks, hung, wrong);
}

/* kva_merge_states from several threads on one CPU context (the merge runs
 * on the context's pool): every output bit-equal to the solo result. */
enum { TM_THREADS = 4, TM_CALLS = 60, TM_B = 2, TM_H = 8, TM_L = 4, TM_D = 128, TM_R = 3 };
typedef struct tm_job {
  kva_context *ctx;
  float *o[TM_R], *l[TM_R], *want;
  float out[TM_B * TM_H * TM_L * TM_D];
  int bad;
} tm_job;

static int tm_merge(kva_context *ctx, tm_job *j, float *out) {
  kva_tensor po[TM_R], pl[TM_R];
  for (int r = 0; r < TM_R; ++r) {
    po[r] = kva_tensor_4d(j->o[r], KVA_F32, TM_B, TM_H, TM_L, TM_D);
    pl[r] = kva_tensor_4d(j->l[r], KVA_F32, TM_B, TM_H, TM_L, 1);
    pl[r].ndim = 3;
    pl[r].shape[3] = 0, pl[r].stride[3] = 0;
    pl[r].stride[0] = TM_H * TM_L * 4, pl[r].stride[1] = TM_L * 4, pl[r].stride[2] = 4;
  }
  kva_tensor o = kva_tensor_4d(out, KVA_F32, TM_B, TM_H, TM_L, TM_D);
  return kva_merge_states(ctx, TM_R, po, pl, &o, NULL, 0);
}
static void *tm_main(void *arg) {
  tm_job *j = arg;
  for (int c = 0; c < TM_CALLS; ++c) {
    memset(j->out, 0, sizeof j->out);
    if (tm_merge(j->ctx, j, j->out) || memcmp(j->out, j->want, sizeof j->out)) ++j->bad;
  }
  return NULL;
}
TEST(threads_merge_one_context) {
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  ASSERT_OK(kva_context_create(&ctx, &o));
  static tm_job jobs[TM_THREADS];
  const size_t no = (size_t)TM_B * TM_H * TM_L * TM_D, nl = (size_t)TM_B * TM_H * TM_L;
  float *mem = calloc((no + nl) * TM_R * TM_THREADS + no * TM_THREADS, sizeof(float));
  ASSERT_TRUE(mem != NULL);
  float *p = mem;
  for (int t = 0; t < TM_THREADS; ++t) {
    jobs[t].ctx = ctx;
    jobs[t].bad = 0;
    for (int r = 0; r < TM_R; ++r) {
      jobs[t].o[r] = p, p += no;
      jobs[t].l[r] = p, p += nl;
      for (size_t i = 0; i < no; ++i) jobs[t].o[r][i] = test_randn();
      for (size_t i = 0; i < nl; ++i) jobs[t].l[r][i] = 3.0f * test_randn();
    }
    jobs[t].want = p, p += no;
    ASSERT_OK(tm_merge(ctx, &jobs[t], jobs[t].want));
  }
  pthread_t tid[TM_THREADS];
  int started = 0;
  for (; started < TM_THREADS; ++started)
    if (pthread_create(&tid[started], NULL, tm_main, &jobs[started])) break;
  for (int t = 0; t < started; ++t) pthread_join(tid[t], NULL);
  int bad = 0;
  for (int t = 0; t < started; ++t) bad += jobs[t].bad;
  if (started < TM_THREADS) FAIL_("pthread_create");
  if (bad) FAIL_("%d of %d merges differ from the solo results or failed", bad, TM_THREADS * TM_CALLS);
  free(mem);
  kva_context_destroy(ctx);
}
