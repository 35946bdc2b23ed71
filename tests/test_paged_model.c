/* Randomized driver of the paged state layer against a simple model (one
 * contiguous array per sequence, holding the expected stored rows). Long runs
 * of create / append / fork / free / trim / view / release / attend /
 * reserve / bad-input operations on a small pool (so it runs out of blocks
 * often); after every step: kva_pool_check, every sequence's length, start,
 * first offset, block count and contents bit for bit, every block's
 * reference count recounted from the tables and views, the free count, and
 * every live view still returning exactly what it returned when made.
 * Attention over a view is checked against the oracle run on the model. */
#include "attn_check.h"
#include "test_paged.h"

#define M_SEQS 8       /* most live sequences */
#define M_VIEWS 4      /* most live views */
#define M_VIEW_B 4     /* most sequences per view */
#define M_RESERVED 4   /* most reserved blocks */
#define M_DEAD 16      /* freed ids remembered for bad-input operations */
#define M_CAP 120      /* most tokens in a sequence's window */
#define M_BLOCKS 32    /* most blocks in the pool (block 8: 32, block 16: 20) */
#define M_KVH 2
#define M_D 64         /* Dk = Dv (a head dim the attention paths support) */
#define M_H 4

typedef struct mseq {
  int32_t id;
  int64_t len, start;
  int64_t base;      /* absolute position of table row 0 (first block's first row) */
  int32_t last_blk;  /* from the last check: block id of the last table entry, -1 if none */
  int last_shared;   /* ... and whether another live sequence's table holds it */
  tp_kv k, v;        /* [1, KVH, M_CAP, D]: the window's expected rows */
} mseq;

typedef struct mview {
  kva_paged_view *pv;
  int B;
  int64_t lens[M_VIEW_B], start[M_VIEW_B], fo[M_VIEW_B];
  tp_kv k, v;        /* [M_VIEW_B, KVH, M_CAP, D]: the snapshot */
} mview;

typedef struct model {
  kva_pool *pool;
  kva_pool_desc d;
  kva_context *ctx;
  mseq s[M_SEQS];
  int ns;
  mview v[M_VIEWS];
  int nv;
  int32_t reserved[M_RESERVED];
  int nr;
  int32_t dead[M_DEAD];
  int nd;
  tp_kv gk, gv;      /* gather scratch [1, KVH, M_CAP, D] */
  int32_t exp_refs[M_BLOCKS];
  long ops[16], enoblocks;
} model;

static int64_t m_fo(const mseq *q) { return q->start - q->base; }
static int64_t m_blocks(const model *m, const mseq *q) {
  int64_t bs = m->d.block_size;
  return q->len ? (m_fo(q) + q->len + bs - 1) / bs : 0;
}

static int m_rand(int n) { return (int)(test_rand_u64() % (uint64_t)n); }

/* ---- the check after every step */
static int m_check(model *m, long step) {
#define CHECK(c, ...)                                                                            \
  do {                                                                                           \
    if (!(c)) {                                                                                  \
      FAIL_("step %ld: ", step);                                                                 \
      fprintf(stderr, "    " __VA_ARGS__);                                                       \
      fprintf(stderr, " (%s)\n", kva_last_error());                                              \
      return 0;                                                                                  \
    }                                                                                            \
  } while (0)
  CHECK(kva_pool_check(m->pool) == 0, "kva_pool_check");
  memset(m->exp_refs, 0, sizeof m->exp_refs);
  for (int i = 0; i < m->nr; ++i) m->exp_refs[m->reserved[i]]++;
  /* Views: contents as when made; their references. */
  for (int i = 0; i < m->nv; ++i) {
    mview *w = &m->v[i];
    kva_paged_csr c;
    CHECK(kva_paged_view_csr(w->pv, &c) == 0, "view csr");
    for (int b = 0; b < w->B; ++b) {
      CHECK(c.lens[b] == w->lens[b] && c.start[b] == w->start[b] && c.first_offset[b] == w->fo[b],
            "view %d seq %d: len/start/offset changed", i, b);
      CHECK(tp_gather(w->pv, b, &m->gk, &m->gv, 0) == 0, "gather view");
      CHECK(tp_kv_equal(&m->gk, 0, 0, &w->k, b, 0, w->lens[b], "view K") &&
                tp_kv_equal(&m->gv, 0, 0, &w->v, b, 0, w->lens[b], "view V"),
            "view %d seq %d: contents changed since it was made", i, b);
    }
    for (int32_t e = 0; e < c.indptr[c.batch]; ++e) m->exp_refs[c.indices[e]]++;
  }
  /* Sequences: queries, contents through a temporary view, tables. */
  int32_t ids[M_SEQS];
  int map[M_SEQS], nb = 0;
  for (int i = 0; i < m->ns; ++i) {
    mseq *q = &m->s[i];
    CHECK(kva_seq_len(m->pool, q->id) == q->len, "seq %d: len %lld, model %lld", q->id,
          (long long)kva_seq_len(m->pool, q->id), (long long)q->len);
    CHECK(kva_seq_start(m->pool, q->id) == q->start, "seq %d: start", q->id);
    CHECK(kva_seq_blocks(m->pool, q->id) == m_blocks(m, q), "seq %d: %lld blocks, model %lld", q->id,
          (long long)kva_seq_blocks(m->pool, q->id), (long long)m_blocks(m, q));
    q->last_blk = -1;
    q->last_shared = 0;
    if (q->len) {
      ids[nb] = q->id;
      map[nb++] = i;
    }
  }
  if (nb) {
    kva_paged_view *t;
    kva_paged_csr c;
    CHECK(kva_paged_view_create(m->pool, ids, nb, &t) == 0 && kva_paged_view_csr(t, &c) == 0, "temporary view");
    for (int b = 0; b < nb; ++b) {
      mseq *q = &m->s[map[b]];
      int ok = c.first_offset[b] == m_fo(q) && c.lens[b] == q->len && c.start[b] == q->start &&
               tp_gather(t, b, &m->gk, &m->gv, 0) == 0 && tp_kv_equal(&m->gk, 0, 0, &q->k, 0, 0, q->len, "seq K") &&
               tp_kv_equal(&m->gv, 0, 0, &q->v, 0, 0, q->len, "seq V");
      if (!ok) kva_paged_view_release(t);
      CHECK(ok, "seq %d: offset %d (model %lld) or contents differ", q->id, c.first_offset[b], (long long)m_fo(q));
      q->last_blk = c.indices[c.indptr[b + 1] - 1];
    }
    for (int32_t e = 0; e < c.indptr[nb]; ++e) m->exp_refs[c.indices[e]]++; /* the sequences' own */
    for (int b = 0; b < nb; ++b)
      for (int o = 0; o < nb; ++o)
        if (o != b)
          for (int32_t e = c.indptr[o]; e < c.indptr[o + 1]; ++e)
            if (c.indices[e] == m->s[map[b]].last_blk) m->s[map[b]].last_shared = 1;
    kva_paged_view_release(t);
  }
  int64_t used = 0;
  for (int32_t x = 0; x < m->d.num_blocks; ++x) {
    int32_t r;
    CHECK(kva_pool_block_refs(m->pool, x, &r) == 0, "block refs");
    CHECK(r == m->exp_refs[x], "block %d: %d references, recounted %d", x, r, m->exp_refs[x]);
    used += r > 0;
  }
  kva_pool_stats st;
  CHECK(kva_pool_stats_get(m->pool, &st) == 0, "stats");
  CHECK(st.used_blocks == used && st.free_blocks == m->d.num_blocks - used && st.sequences == m->ns && st.views == m->nv,
        "stats: used %lld free %lld seqs %lld views %lld; model used %lld seqs %d views %d", (long long)st.used_blocks,
        (long long)st.free_blocks, (long long)st.sequences, (long long)st.views, (long long)used, m->ns, m->nv);
  return 1;
#undef CHECK
}

/* ---- operations; each returns 0 on a test failure */
enum { OP_CREATE, OP_APPEND, OP_FORK, OP_FREE, OP_TRIM, OP_VIEW, OP_RELEASE, OP_ATTEND, OP_RESERVE, OP_BAD, OP_COUNT };
static const int op_weight[OP_COUNT] = {6, 34, 7, 7, 10, 8, 8, 2, 4, 4};
static const char *const op_names[OP_COUNT] = {"create", "append", "fork", "free", "trim",
                                               "view", "release", "attend", "reserve", "bad"};

static int m_seq_alloc(model *m, mseq *q) {
  return tp_kv_alloc(&q->k, &m->d, 0, 1, M_CAP) || tp_kv_alloc(&q->v, &m->d, 1, 1, M_CAP) ? -1 : 0;
}

static void m_seq_drop(model *m, int i) {
  if (m->nd < M_DEAD) m->dead[m->nd++] = m->s[i].id;
  else m->dead[m_rand(M_DEAD)] = m->s[i].id;
  tp_kv_free(&m->s[i].k);
  tp_kv_free(&m->s[i].v);
  m->s[i] = m->s[--m->ns];
}

static int op_create(model *m) {
  if (m->ns == M_SEQS) return 1;
  mseq *q = &m->s[m->ns];
  memset(q, 0, sizeof *q);
  if (m_seq_alloc(m, q)) { FAIL_("alloc"); return 0; }
  if (kva_seq_create(m->pool, &q->id)) { FAIL_("kva_seq_create: %s", kva_last_error()); return 0; }
  q->last_blk = -1;
  m->ns++;
  return 1;
}

static int op_append(model *m) {
  if (!m->ns) return 1;
  mseq *q = &m->s[m_rand(m->ns)];
  const int64_t bs = m->d.block_size;
  int64_t T = 1 + m_rand(m_rand(4) == 0 ? (int)(2 * bs + 3) : 4);
  if (q->len + T > M_CAP) return 1;
  kva_dtype in_dt = m_rand(3) == 0 ? KVA_BF16 : KVA_F32;
  kva_tensor k = tp_rows(in_dt, M_KVH, T, M_D, m_rand(2)), v = tp_rows(in_dt, M_KVH, T, M_D, m_rand(2));
  kva_pool_stats st0, st1;
  kva_pool_stats_get(m->pool, &st0);
  int64_t base = q->len ? q->base : q->start, row = q->start - base + q->len;
  int64_t have = q->len ? m_blocks(m, q) : 0, fresh = (row + T + bs - 1) / bs - have;
  int64_t need = fresh + (row % bs != 0 && q->last_shared);
  int rc = kva_seq_append(m->pool, q->id, &k, &v);
  kva_pool_stats_get(m->pool, &st1);
  int ok = 1;
  if (rc == KVA_ENOBLOCKS) {
    m->enoblocks++;
    if (need <= st0.free_blocks) { FAIL_("ENOBLOCKS with %lld needed, %lld free", (long long)need, (long long)st0.free_blocks); ok = 0; }
  } else if (rc) {
    FAIL_("kva_seq_append: %s", kva_last_error());
    ok = 0;
  } else {
    if (st1.free_blocks != st0.free_blocks - need) {
      FAIL_("append took %lld blocks, the model expects %lld", (long long)(st0.free_blocks - st1.free_blocks), (long long)need);
      ok = 0;
    }
    q->base = base;
    if (tp_kv_store(&q->k, 0, q->len, &k) || tp_kv_store(&q->v, 0, q->len, &v)) { FAIL_("store"); ok = 0; }
    q->len += T;
  }
  tp_rows_free(&k);
  tp_rows_free(&v);
  return ok;
}

static int op_fork(model *m) {
  if (!m->ns || m->ns == M_SEQS) return 1;
  mseq *p = &m->s[m_rand(m->ns)], *c = &m->s[m->ns];
  int32_t id;
  if (kva_seq_fork(m->pool, p->id, &id)) { FAIL_("kva_seq_fork: %s", kva_last_error()); return 0; }
  *c = *p;
  c->id = id;
  if (m_seq_alloc(m, c)) { FAIL_("alloc"); return 0; }
  tp_kv_copy(&c->k, 0, 0, &p->k, 0, 0, p->len);
  tp_kv_copy(&c->v, 0, 0, &p->v, 0, 0, p->len);
  m->ns++;
  return 1;
}

static int op_free(model *m) {
  if (!m->ns) return 1;
  int i = m_rand(m->ns);
  if (kva_seq_free(m->pool, m->s[i].id)) { FAIL_("kva_seq_free: %s", kva_last_error()); return 0; }
  m_seq_drop(m, i);
  return 1;
}

static int op_trim(model *m) {
  if (!m->ns) return 1;
  mseq *q = &m->s[m_rand(m->ns)];
  int64_t keep = m_rand(4) == 0 ? 0 : m_rand((int)q->len + 2);
  if (kva_seq_trim(m->pool, q->id, keep)) { FAIL_("kva_seq_trim: %s", kva_last_error()); return 0; }
  if (keep >= q->len) return 1;
  const int64_t bs = m->d.block_size, d = q->len - keep;
  q->start += d;
  q->base = keep ? q->base + (q->start - q->base) / bs * bs : q->start;
  tp_kv_copy(&q->k, 0, 0, &q->k, 0, d, keep);
  tp_kv_copy(&q->v, 0, 0, &q->v, 0, d, keep);
  q->len = keep;
  return 1;
}

static int op_view(model *m) {
  if (m->nv == M_VIEWS) return 1;
  int pick[M_VIEW_B], B = 0;
  for (int tries = 0; tries < 8 && B < 1 + m_rand(M_VIEW_B); ++tries) {
    int i = m->ns ? m_rand(m->ns) : -1;
    if (i >= 0 && m->s[i].len) pick[B++] = i; /* repeats allowed */
  }
  if (!B) return 1;
  mview *w = &m->v[m->nv];
  memset(w, 0, sizeof *w);
  if (tp_kv_alloc(&w->k, &m->d, 0, M_VIEW_B, M_CAP) || tp_kv_alloc(&w->v, &m->d, 1, M_VIEW_B, M_CAP)) {
    FAIL_("alloc");
    return 0;
  }
  int32_t ids[M_VIEW_B];
  for (int b = 0; b < B; ++b) {
    mseq *q = &m->s[pick[b]];
    ids[b] = q->id;
    w->lens[b] = q->len;
    w->start[b] = q->start;
    w->fo[b] = m_fo(q);
    tp_kv_copy(&w->k, b, 0, &q->k, 0, 0, q->len);
    tp_kv_copy(&w->v, b, 0, &q->v, 0, 0, q->len);
  }
  w->B = B;
  if (kva_paged_view_create(m->pool, ids, B, &w->pv)) { FAIL_("kva_paged_view_create: %s", kva_last_error()); return 0; }
  m->nv++;
  return 1;
}

static void m_view_drop(model *m, int i) {
  kva_paged_view_release(m->v[i].pv);
  tp_kv_free(&m->v[i].k);
  tp_kv_free(&m->v[i].v);
  m->v[i] = m->v[--m->nv];
}

static int op_release(model *m) {
  if (m->nv) m_view_drop(m, m_rand(m->nv));
  return 1;
}

/* Attention over a live view against the oracle over its snapshot. */
static int op_attend(model *m) {
  if (!m->nv) return 1;
  mview *w = &m->v[m_rand(m->nv)];
  int64_t minlen = M_CAP;
  for (int b = 0; b < w->B; ++b) minlen = w->lens[b] < minlen ? w->lens[b] : minlen;
  const int64_t L = 1 + m_rand((int)(minlen < 6 ? minlen : 6)), B = w->B;
  const size_t nq = (size_t)(B * M_H * L * M_D), guard = 16;
  float *qb = (float *)malloc(nq * sizeof(float)), *ob = (float *)malloc((nq + guard) * sizeof(float));
  float *rb = (float *)malloc(nq * sizeof(float));
  float sinks[M_H];
  int ok = qb && ob && rb;
  if (!ok) FAIL_("alloc");
  for (size_t i = 0; ok && i < nq; ++i) qb[i] = 1.5f * test_randn();
  for (int h = 0; h < M_H; ++h) sinks[h] = test_randn();
  int32_t lens[M_VIEW_B];
  for (int b = 0; b < B; ++b) lens[b] = (int32_t)w->lens[b];
  kva_kv ks = w->k.kv, vs = w->v.kv; /* the snapshot's first B sequences */
  ks.data.shape[0] = vs.data.shape[0] = ks.scales.shape[0] = vs.scales.shape[0] = B;
  ks.biases.shape[0] = vs.biases.shape[0] = B;
  int64_t maxlen = 0;
  for (int b = 0; b < B; ++b) maxlen = lens[b] > maxlen ? lens[b] : maxlen;
  ks.data.shape[2] = vs.data.shape[2] = ks.scales.shape[2] = vs.scales.shape[2] = maxlen;
  ks.biases.shape[2] = vs.biases.shape[2] = maxlen;
  kva_kv_view cview = kva_view_contiguous(&ks, &vs, lens), pview = kva_view_paged(w->pv);
  kva_attn_params p = kva_attn_defaults();
  int mk = m_rand(3);
  if (mk) p.mask.kind = KVA_MASK_CAUSAL;
  if (mk == 2) p.mask.window = 1 + m_rand(40);
  if (m_rand(4) == 0) p.softcap = 10.0f;
  if (m_rand(4) == 0) p.sinks = sinks;
  kva_tensor q = kva_tensor_4d(qb, KVA_F32, B, M_H, L, M_D), out = kva_tensor_4d(ob, KVA_F32, B, M_H, L, M_D);
  kva_tensor ref = kva_tensor_4d(rb, KVA_F32, B, M_H, L, M_D);
  /* the oracle with the roundings of the kernel the paged call runs */
  if (ok && att_kernel_reference(m->ctx, &q, &pview, &p, &out, &q, &cview, &p, &ref)) { FAIL_("oracle"); ok = 0; }
  if (ok) memset(ob, 0xff, (nq + guard) * sizeof(float));
  if (ok && kva_attention(m->ctx, &q, &pview, &p, &out, NULL, 0)) { FAIL_("kva_attention: %s", kva_last_error()); ok = 0; }
  for (size_t i = 0; ok && i < guard; ++i) {
    uint32_t u;
    memcpy(&u, &ob[nq + i], 4);
    if (u != 0xffffffffu) { FAIL_("attention wrote past out"); ok = 0; }
  }
  double err = 0;
  if (ok && !att_compare(&out, &ref, att_kernel_atol(m->ctx, &q, &pview, &p, &out), 0, &err, NULL)) {
    FAIL_("attention over a view (B %lld, L %lld, mask %d) differs from the oracle: max err %.3g", (long long)B,
          (long long)L, mk, err);
    ok = 0;
  }
  free(qb);
  free(ob);
  free(rb);
  return ok;
}

static int op_reserve(model *m) {
  if (m->nr && (m->nr == M_RESERVED || m_rand(2))) {
    int n = 1 + m_rand(m->nr);
    if (kva_pool_unreserve(m->pool, n, m->reserved + m->nr - n)) { FAIL_("unreserve: %s", kva_last_error()); return 0; }
    m->nr -= n;
    return 1;
  }
  int n = 1 + m_rand(M_RESERVED - m->nr);
  kva_pool_stats st;
  kva_pool_stats_get(m->pool, &st);
  int rc = kva_pool_reserve(m->pool, n, m->reserved + m->nr);
  if (rc == KVA_ENOBLOCKS && n > st.free_blocks) return 1;
  if (rc) { FAIL_("reserve %d of %lld free: %s", n, (long long)st.free_blocks, kva_last_error()); return 0; }
  m->nr += n;
  return 1;
}

/* Calls with freed or unknown ids: ENOSEQ and (checked next) nothing changed. */
static int op_bad(model *m) {
  int32_t id = m->nd ? m->dead[m_rand(m->nd)] : 0x7ffff;
  for (int i = 0; i < m->ns; ++i)
    if (m->s[i].id == id) return 1; /* the id came back (its slot reused 8191 times) */
  kva_tensor k = tp_rows(KVA_F32, M_KVH, 2, M_D, 0), v = tp_rows(KVA_F32, M_KVH, 2, M_D, 0);
  int32_t child, ids[2] = {m->ns ? m->s[0].id : id, id};
  kva_paged_view *pv = NULL;
  int rcs[5] = {kva_seq_append(m->pool, id, &k, &v), kva_seq_fork(m->pool, id, &child), kva_seq_trim(m->pool, id, 1),
                kva_seq_free(m->pool, id), kva_paged_view_create(m->pool, ids, 2, &pv)};
  tp_rows_free(&k);
  tp_rows_free(&v);
  for (int i = 0; i < 5; ++i)
    if (rcs[i] != KVA_ENOSEQ && !(i == 4 && rcs[i] == KVA_EINVAL)) { /* EINVAL: ids[0] empty */
      FAIL_("bad-input call %d with freed id %d returned %d", i, id, rcs[i]);
      return 0;
    }
  return pv == NULL;
}

static int (*const op_fn[OP_COUNT])(model *) = {op_create, op_append, op_fork, op_free, op_trim,
                                                 op_view, op_release, op_attend, op_reserve, op_bad};

static const tp_fmt model_formats[] = {{KVA_F16, 0, 0}, {KVA_BF16, 4, 32}, {KVA_F32, 8, 64}, {KVA_F16, 2, 32}, {KVA_F32, 0, 0}};
#define N_MODEL_FORMATS ((int)(sizeof model_formats / sizeof model_formats[0]))

static void run_model(long total_ops) {
  kva_context *ctx;
  kva_context_opts o = {KVA_BACKEND_CPU, 2, 0, NULL};
  if (kva_context_create(&ctx, &o)) { FAIL_("context: %s", kva_last_error()); return; }
  int wsum = 0;
  for (int i = 0; i < OP_COUNT; ++i) wsum += op_weight[i];
  const long per = total_ops / N_MODEL_FORMATS;
  long done = 0;
  for (int fi = 0; fi < N_MODEL_FORMATS && !test_failed_flag; ++fi) {
    static model m; /* large; one at a time */
    memset(&m, 0, sizeof m);
    m.ctx = ctx;
    m.d = tp_desc(model_formats[fi], fi % 2 ? 20 : M_BLOCKS, fi % 2 ? 16 : 8, M_KVH, M_D, M_D);
    if (kva_pool_create(&m.pool, &m.d, NULL) || tp_kv_alloc(&m.gk, &m.d, 0, 1, M_CAP) ||
        tp_kv_alloc(&m.gv, &m.d, 1, 1, M_CAP)) {
      FAIL_("setup: %s", kva_last_error());
      break;
    }
    for (long step = 0; step < per && !test_failed_flag; ++step) {
      int r = m_rand(wsum), op = 0;
      while (r >= op_weight[op]) r -= op_weight[op++];
      m.ops[op]++;
      if (!op_fn[op](&m)) {
        fprintf(stderr, "    at step %ld, operation %s\n", step, op_names[op]);
        break;
      }
      if (!m_check(&m, step)) {
        fprintf(stderr, "    after operation %s\n", op_names[op]);
        break;
      }
      /* Now and then drop everything: the pool must be whole again. */
      if (step % 5000 == 4999) {
        while (m.nv) m_view_drop(&m, 0);
        while (m.ns) {
          kva_seq_free(m.pool, m.s[0].id);
          m_seq_drop(&m, 0);
        }
        kva_pool_unreserve(m.pool, m.nr, m.reserved);
        m.nr = 0;
        kva_pool_stats st;
        kva_pool_stats_get(m.pool, &st);
        if (st.free_blocks != m.d.num_blocks) FAIL_("%lld blocks leaked", (long long)(m.d.num_blocks - st.free_blocks));
      }
      done++;
    }
    char fs[32];
    tp_fmt_str(&model_formats[fi], fs, sizeof fs);
    printf("  %s block %lld: %ld ops (", fs, (long long)m.d.block_size, per);
    for (int i = 0; i < OP_COUNT; ++i) printf("%s%s %ld", i ? ", " : "", op_names[i], m.ops[i]);
    printf("), %ld out-of-blocks\n", m.enoblocks);
    while (m.nv) m_view_drop(&m, 0);
    while (m.ns) m_seq_drop(&m, 0);
    tp_kv_free(&m.gk);
    tp_kv_free(&m.gv);
    kva_pool_destroy(m.pool);
  }
  (void)done;
  kva_context_destroy(ctx);
}

/* A short run for every build (and under sanitizers). */
TEST(paged_model) { run_model(test_quick ? 2500 : 10000); }

/* The long run: >= 10^5 operations. */
TEST_SLOW(paged_model_long) { run_model(100000); }
