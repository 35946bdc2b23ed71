/* Random attention operands from a case description, sentinels, comparison. */
#include "attn_check.h"

#include "cpu/kernel.h" /* kva_cpu_general_only */

const char *const mask_names[] = {"none", "causal", "window", "seg", "seg-clamp", "bool", "add", "tree", "tree-seg"};

#define SENTINEL_BYTES 64
#define SENTINEL_BYTE 0xA5
#define PAD_BYTE 0x7f    /* make_view's padding: ~3.4e38 in f32, NaN-free, loud */
#define POISON_BYTE 0xff /* NaN in every float dtype */

void att_case_str(const att_case *c, char *buf, size_t n) {
  char kf[32], vf[32];
  static const char *const fp8s[3] = {"/token", "/tensor", "/none"};
  const int fp8 = !c->kbits && (c->kvdt == KVA_F8E4M3 || c->kvdt == KVA_F8E5M2);
  if (c->kbits) snprintf(kf, sizeof kf, "q%d/g%d/%s", c->kbits, c->group, kva_dtype_name(c->kvdt));
  else snprintf(kf, sizeof kf, "%s%s", kva_dtype_name(c->kvdt), fp8 ? fp8s[c->group % 3] : "");
  if (c->vbits) snprintf(vf, sizeof vf, "q%d/g%d", c->vbits, c->group);
  else snprintf(vf, sizeof vf, "%s", kva_dtype_name(c->kvdt));
  snprintf(buf, n, "B%d H%d/%d L%d N%lld D%d/%d q=%s out=%s K=%s V=%s mask=%s w=%d cap=%g sinks=%d ragged=%d strided=%d",
           c->B, c->H, c->KVH, c->L, (long long)c->N, c->Dk, c->Dv, kva_dtype_name(c->qdt),
           kva_dtype_name(c->odt), kf, vf, mask_names[c->mask], c->window, (double)c->softcap, c->sinks,
           c->ragged, c->strided);
}

const char *const att_query_names[ATT_PROBES] = {"random", "probe"};

/* bytes with SENTINEL_BYTES of room before and after (the output's guards). */
static void *keep(att_data *d, size_t bytes) {
  if (d->nbufs == (int)(sizeof d->bufs / sizeof d->bufs[0])) return NULL;
  char *p = (char *)malloc(SENTINEL_BYTES + bytes + SENTINEL_BYTES);
  if (!p) return NULL;
  d->bufs[d->nbufs++] = p;
  return p + SENTINEL_BYTES;
}

/* A [n0, n1, n2, n3] view; strided: a window into a padded [n0, n1+1, n2+3, n3+pad] buffer. */
static kva_tensor make_view(att_data *d, kva_dtype dt, int64_t n0, int64_t n1, int64_t n2, int64_t n3,
                            int strided, size_t *bytes_out) {
  int64_t p1 = strided ? 1 : 0, p2 = strided ? 3 : 0, p3 = strided ? 8 : 0;
  int64_t es = (int64_t)kva_dtype_size(dt);
  size_t bytes = (size_t)(n0 * (n1 + p1) * (n2 + p2) * (n3 + p3) * es);
  char *mem = (char *)keep(d, bytes);
  kva_tensor t = kva_tensor_4d(mem, dt, n0, n1, n2, n3);
  if (!mem) return t;
  /* Fill padding and all with a loud pattern; the view's elements are written by the caller. */
  memset(mem, PAD_BYTE, bytes);
  t.stride[3] = es;
  t.stride[2] = (n3 + p3) * es;
  t.stride[1] = (n2 + p2) * t.stride[2];
  t.stride[0] = (n1 + p1) * t.stride[1];
  t.data = mem + (strided ? 2 * t.stride[2] : 0); /* start inside the padding */
  if (bytes_out) *bytes_out = bytes;
  return t;
}

/* Address of element [a, b, c, e] of t. */
static char *ptr4(const kva_tensor *t, int64_t a, int64_t b, int64_t c, int64_t e) {
  return (char *)t->data + a * t->stride[0] + b * t->stride[1] + c * t->stride[2] + e * t->stride[3];
}

static void fill_float(kva_tensor *t, float amp) {
  for (int64_t a = 0; a < t->shape[0]; ++a)
    for (int64_t b = 0; b < t->shape[1]; ++b)
      for (int64_t c = 0; c < t->shape[2]; ++c)
        for (int64_t e = 0; e < t->shape[3]; ++e) {
          float x = amp * test_randn();
          char *p = (char *)t->data + a * t->stride[0] + b * t->stride[1] + c * t->stride[2] + e * t->stride[3];
          if (t->dtype == KVA_F32) memcpy(p, &x, 4);
          else {
            uint16_t h = t->dtype == KVA_F16 ? kva_f32_to_f16(x) : kva_f32_to_bf16(x);
            memcpy(p, &h, 2);
          }
        }
}

/* fp8 rows: per row, values amp * randn with a random amplitude (2^-2 ..
 * 2^2: logits stay moderate, so no visible key's P underflows in f32) encoded
 * at scale amax / max_fp8 (per token), or at one scale for the whole cache
 * that fits the largest amplitude (per tensor: small rows use fewer codes,
 * a few subnormal), or at scale 1 (none: values within range);
 * codes by the library's conversion (the oracle decodes them on its own). */
static int make_fp8_kv(att_data *d, kva_kv *kv, int D) {
  const att_case *c = &d->c;
  const float fmax = c->kvdt == KVA_F8E4M3 ? 448.0f : 57344.0f;
  kv->data = make_view(d, c->kvdt, c->B, c->KVH, c->N, D, c->strided, NULL);
  if (!kv->data.data) return -1;
  float *one = NULL;
  if (c->group == ATT_FP8_TOKEN) {
    kv->scales = make_view(d, KVA_F32, c->B, c->KVH, c->N, 1, c->strided, NULL);
    if (!kv->scales.data) return -1;
  } else if (c->group == ATT_FP8_TENSOR) {
    if (!(one = (float *)keep(d, sizeof(float)))) return -1;
    *one = 4.0f * 5.0f / fmax; /* |x| up to 5 amp at amp 4 (beyond: saturated codes) */
    kv->scales = kva_tensor_4d(one, KVA_F32, c->B, c->KVH, c->N, 1);
    for (int e = 0; e < 4; ++e) kv->scales.stride[e] = 0;
  }
  float row[KVA_MAX_HEAD_DIM];
  for (int64_t b = 0; b < c->B; ++b)
    for (int64_t h = 0; h < c->KVH; ++h)
      for (int64_t t = 0; t < c->N; ++t) {
        const float amp = c->group == ATT_FP8_NONE ? 1.0f : ldexpf(1.0f, (int)(test_rand_u64() % 5) - 2);
        float amax = 0.0f;
        for (int e = 0; e < D; ++e) {
          row[e] = amp * test_randn();
          if (fabsf(row[e]) > amax) amax = fabsf(row[e]);
        }
        float s = 1.0f;
        if (c->group == ATT_FP8_TOKEN) {
          s = amax > 0 ? amax / fmax : 1.0f;
          test_store(ptr4(&kv->scales, b, h, t, 0), KVA_F32, s);
        } else if (one) {
          s = *one;
        }
        for (int e = 0; e < D; ++e) test_store(ptr4(&kv->data, b, h, t, e), c->kvdt, row[e] / s);
      }
  return 0;
}

static int make_kv(att_data *d, kva_kv *kv, int bits, int D) {
  const att_case *c = &d->c;
  memset(kv, 0, sizeof *kv);
  if (!bits && (c->kvdt == KVA_F8E4M3 || c->kvdt == KVA_F8E5M2)) return make_fp8_kv(d, kv, D);
  if (!bits) {
    kv->data = make_view(d, c->kvdt, c->B, c->KVH, c->N, D, c->strided, NULL);
    if (!kv->data.data) return -1;
    fill_float(&kv->data, 1.0f);
    return 0;
  }
  kv->bits = bits;
  kv->group_size = c->group;
  kv->data = make_view(d, KVA_U32, c->B, c->KVH, c->N, (int64_t)D * bits / 32, c->strided, NULL);
  kv->scales = make_view(d, c->kvdt, c->B, c->KVH, c->N, D / c->group, c->strided, NULL);
  kv->biases = make_view(d, c->kvdt, c->B, c->KVH, c->N, D / c->group, c->strided, NULL);
  float *w = (float *)malloc((size_t)c->B * c->KVH * c->N * D * sizeof(float));
  if (!w || !kv->data.data || !kv->scales.data || !kv->biases.data) { free(w); return -1; }
  kva_tensor wt = kva_tensor_4d(w, KVA_F32, c->B, c->KVH, c->N, D);
  /* Values with a per-row offset so biases are not all alike. */
  for (int64_t i = 0; i < (int64_t)c->B * c->KVH * c->N; ++i) {
    float off = 0.5f * test_randn();
    for (int e = 0; e < D; ++e) w[i * D + e] = off + test_randn();
  }
  int rc = kva_quantize(&wt, kv);
  free(w);
  if (rc) fprintf(stderr, "kva_quantize: %s\n", kva_last_error());
  return rc ? -1 : 0;
}


/* Element e of K/V row (b, hk, t) as the oracle sees it: the float value,
 * or s * code + b in f32 for quantized rows. */
static float kv_elem(const kva_kv *kv, int64_t b, int64_t hk, int64_t t, int64_t e) {
  if (!kv->bits && kv->scales.data) /* fp8 rows with scales */
    return test_load(ptr4(&kv->scales, b, hk, t, 0), KVA_F32) * test_load(ptr4(&kv->data, b, hk, t, e), kv->data.dtype);
  if (!kv->bits) return test_load(ptr4(&kv->data, b, hk, t, e), kv->data.dtype);
  const int per = 32 / kv->bits;
  uint32_t w;
  memcpy(&w, ptr4(&kv->data, b, hk, t, e / per), 4);
  const uint32_t code = (w >> ((e % per) * kv->bits)) & ((1u << kv->bits) - 1);
  const float sc = test_load(ptr4(&kv->scales, b, hk, t, e / kv->group_size), kv->scales.dtype);
  const float bi = test_load(ptr4(&kv->biases, b, hk, t, e / kv->group_size), kv->biases.dtype);
  return sc * (float)code + bi;
}

/* The probe queries of att_make (attn_check.h). */
static void write_probes(att_data *d) {
  const att_case *c = &d->c;
  const int rep = c->H / c->KVH;
  const double scale = d->params.scale > 0 ? d->params.scale : 1.0 / sqrt((double)c->Dk);
  float kj[KVA_MAX_HEAD_DIM];
  for (int b = 0; b < c->B; ++b) {
    const int64_t len = d->lens ? d->lens[b] : c->N;
    for (int h = 0; h < c->H; ++h)
      for (int i = 0; i < c->L; ++i) {
        const int64_t p = len - c->L + i;
        const int64_t lo = c->mask == MASK_NONE ? 0 : c->window > 0 && p - c->window + 1 > 0 ? p - c->window + 1 : 0;
        const int64_t hi = c->mask == MASK_NONE ? len - 1 : p; /* the causal window [lo, hi] */
        const int kind = (int)(test_rand_u64() % 3);
        int64_t j = p, nvis = hi - lo + 1;
        if (c->mask == MASK_TREE || c->mask == MASK_TREE_SEG) {
          /* tree: the own key, a random visible key (prefix window or a
           * visible new token), or a random new token the row does not see */
          const int64_t n0 = len - c->L, plo = lo < n0 ? lo : n0;
          int64_t seen[KVA_TREE_MAX_ROWS], hidden[KVA_TREE_MAX_ROWS], ns = 0, nh = 0;
          for (int64_t jn = 0; jn < c->L; ++jn) {
            if (att_tree_bit(&d->params.mask.array, b, i, jn)) seen[ns++] = n0 + jn;
            else hidden[nh++] = n0 + jn;
          }
          nvis = n0 - plo + ns;
          if (kind == 1) {
            const int64_t r = (int64_t)(test_rand_u64() % (uint64_t)nvis);
            j = r < n0 - plo ? plo + r : seen[r - (n0 - plo)];
          } else if (kind == 2 && nh) {
            j = hidden[test_rand_u64() % (uint64_t)nh];
          }
        } else if (kind == 1) {
          j = lo + (int64_t)(test_rand_u64() % (uint64_t)(hi - lo + 1));
        } else if (kind == 2 && p + 1 < len) {
          j = p + 1;
        }
        double norm2 = 0;
        for (int e = 0; e < c->Dk; ++e) {
          kj[e] = kv_elem(&d->k, b, h / rep, j, e);
          norm2 += (double)kj[e] * kj[e];
        }
        const double ln9n = log(9.0 * (double)nvis), disc = 1.0 - 2.0 * ln9n / c->Dk;
        const double T = disc > 0 ? c->Dk * (1.0 - sqrt(disc)) : (double)c->Dk;
        const double a = norm2 > 0 ? T / (scale * norm2) : 1.0;
        for (int e = 0; e < c->Dk; ++e) test_store(ptr4(&d->q, b, h, i, e), c->qdt, (float)(a * kj[e]));
      }
  }
}

int att_make(att_data *d, const att_case *c) { return att_make_q(d, c, 0); }

/* i32 [B, N] segment ids (row stride N + 7 when strided): text runs and
 * image runs of random lengths 1..12, images numbered from 1 per sequence. */
static int make_segments(att_data *d) {
  const att_case *c = &d->c;
  const int64_t pad = c->strided ? 7 : 0;
  int32_t *s = (int32_t *)keep(d, sizeof(int32_t) * (size_t)(c->B * (c->N + pad)));
  if (!s) return -1;
  for (int b = 0; b < c->B; ++b) {
    int32_t img = 0;
    for (int64_t j = 0; j < c->N;) {
      int64_t run = 1 + (int64_t)(test_rand_u64() % 12);
      int is_img = (test_rand_u64() % 2) == 0;
      if (is_img) img++;
      for (int64_t e = 0; e < run && j < c->N; ++e, ++j) s[b * (c->N + pad) + j] = is_img ? img : 0;
    }
  }
  d->params.mask.segments = kva_tensor_2d(s, KVA_I32, c->B, c->N);
  d->params.mask.segments.stride[0] = (c->N + pad) * 4;
  return 0;
}

void att_random_tree(int L, int depth, int *parent) {
  int dep[KVA_TREE_MAX_ROWS], maxd = 0;
  for (int j = 0; j < L; ++j) {
    int cand[KVA_TREE_MAX_ROWS], nc = 0;
    /* extend the deepest branch when the depth must still be reached (forced
     * once the nodes left are just enough), else any node above the depth */
    const int extend = maxd < depth && j > 0 && (test_rand_u64() % 2 == 0 || L - j == depth - maxd);
    for (int k = 0; k < j; ++k)
      if (extend ? dep[k] == maxd : dep[k] < depth) cand[nc++] = k;
    parent[j] = nc ? cand[test_rand_u64() % (uint64_t)nc] : -1;
    dep[j] = parent[j] < 0 ? 1 : dep[parent[j]] + 1;
    if (dep[j] > maxd) maxd = dep[j];
  }
}

void att_tree_bits(int L, const int *parent, uint32_t *bits, int64_t row_words) {
  const int W = (L + 31) / 32;
  for (int i = 0; i < L; ++i) {
    uint32_t *r = bits + i * row_words;
    for (int w = 0; w < W; ++w) r[w] = 0;
    for (int a = i; a >= 0; a = parent[a]) r[a / 32] |= 1u << (a % 32);
  }
}

/* The TREE bits of a case (attn_check.h, MASK_TREE): one random tree per
 * sequence, depth L (a chain), 1 (no edges) or random by b % 3; strided:
 * rows of W + 1 words, and for B > 1 one tree broadcast (shape[0] = 1). */
static int make_tree(att_data *d) {
  const att_case *c = &d->c;
  const int W = (c->L + 31) / 32, rw = W + (c->strided ? 1 : 0);
  const int nb = c->strided && c->B > 1 ? 1 : c->B;
  uint32_t *bits = (uint32_t *)keep(d, sizeof(uint32_t) * (size_t)(nb * c->L * rw));
  if (!bits || c->L > KVA_TREE_MAX_ROWS) return -1;
  for (int b = 0; b < nb; ++b) {
    int parent[KVA_TREE_MAX_ROWS];
    const int depth = b % 3 == 0 ? c->L : b % 3 == 1 ? 1 : 1 + (int)(test_rand_u64() % (uint64_t)c->L);
    att_random_tree(c->L, depth, parent);
    att_tree_bits(c->L, parent, bits + (int64_t)b * c->L * rw, rw);
  }
  kva_tensor t = kva_tensor_2d(bits, KVA_U32, c->L, W);
  t.ndim = 3;
  t.shape[0] = nb;
  t.shape[1] = c->L;
  t.shape[2] = W;
  t.stride[2] = 4;
  t.stride[1] = 4 * rw;
  t.stride[0] = (int64_t)c->L * t.stride[1];
  d->params.mask.array = t;
  return 0;
}

void att_tree_random_bits(att_data *d) {
  const kva_tensor *t = &d->params.mask.array;
  for (int64_t b = 0; b < t->shape[0]; ++b)
    for (int64_t i = 0; i < t->shape[1]; ++i) {
      uint32_t *row = (uint32_t *)((char *)t->data + b * t->stride[0] + i * t->stride[1]);
      const int empty = test_rand_u64() % 4 == 0;
      for (int64_t j = 0; j < d->c.L; ++j) {
        if (j % 32 == 0) row[j / 32] = 0;
        if (!empty && test_rand_u64() % 3 == 0) row[j / 32] |= 1u << (j % 32);
      }
    }
}

/* The rule of docs/semantics.md written out per key (the causal prefix with
 * window and segments, the bits on the last L keys). */
kva_tensor att_tree_array(att_data *d) {
  const att_case *c = &d->c;
  const kva_mask *m = &d->params.mask;
  unsigned char *a = (unsigned char *)keep(d, (size_t)(c->B * c->L * c->N));
  if (!a) return kva_tensor_4d(NULL, KVA_BOOL, c->B, 1, c->L, c->N);
  for (int b = 0; b < c->B; ++b) {
    const int64_t len = d->lens ? d->lens[b] : c->N, n0 = len - c->L;
    const char *seg = m->segments.data ? (const char *)m->segments.data + b * m->segments.stride[0] : NULL;
    for (int i = 0; i < c->L; ++i) {
      const int64_t p = n0 + i;
      for (int64_t t = 0; t < c->N; ++t) {
        int v = 0;
        if (t >= len) v = 0;
        else if (t >= n0) v = att_tree_bit(&m->array, b, i, t - n0);
        else {
          const int win = m->window == 0 || t > p - m->window;
          v = t <= p && win;
          if (!v && seg) {
            int32_t st, sp;
            memcpy(&st, seg + t * 4, 4);
            memcpy(&sp, seg + p * 4, 4);
            v = st != 0 && st == sp && (!m->segments_clamp || win);
          }
        }
        a[((int64_t)b * c->L + i) * c->N + t] = (unsigned char)v;
      }
    }
  }
  return kva_tensor_4d(a, KVA_BOOL, c->B, 1, c->L, c->N);
}

int att_tree_bit(const kva_tensor *t, int64_t b, int64_t i, int64_t j) {
  uint32_t w;
  memcpy(&w, (const char *)t->data + (t->shape[0] == 1 ? 0 : b) * t->stride[0] + i * t->stride[1] + (j / 32) * 4, 4);
  return (int)(w >> (j % 32) & 1u);
}

int att_make_q(att_data *d, const att_case *c, int probe) {
  memset(d, 0, sizeof *d);
  d->c = *c;
  d->probe = probe;
  d->q = make_view(d, c->qdt, c->B, c->H, c->L, c->Dk, c->strided, NULL);
  if (!d->q.data) return -1;
  fill_float(&d->q, 1.5f);
  if (make_kv(d, &d->k, c->kbits, c->Dk) || make_kv(d, &d->v, c->vbits, c->Dv)) return -1;
  d->out = make_view(d, c->odt, c->B, c->H, c->L, c->Dv, c->strided, &d->out_bytes);
  if (!d->out.data) return -1;
  d->out_buf = (char *)d->bufs[d->nbufs - 1] + SENTINEL_BYTES;
  d->out_image = (unsigned char *)keep(d, d->out_bytes);
  if (!d->out_image) return -1;
  d->params = kva_attn_defaults();
  if (c->ragged) {
    d->lens = (int32_t *)keep(d, sizeof(int32_t) * (size_t)c->B);
    for (int b = 0; b < c->B; ++b)
      d->lens[b] = (int32_t)(c->L + (int64_t)(test_rand_u64() % (uint64_t)(c->N - c->L + 1)));
    d->lens[test_rand_u64() % (uint64_t)c->B] = (int32_t)c->N;
  }
  kva_mask *m = &d->params.mask;
  switch (c->mask) {
  case MASK_NONE: break;
  case MASK_CAUSAL: m->kind = KVA_MASK_CAUSAL; break;
  case MASK_WINDOW: m->kind = KVA_MASK_CAUSAL; m->window = c->window; break;
  case MASK_SEG:
  case MASK_SEG_CLAMP:
    m->kind = KVA_MASK_CAUSAL;
    m->window = c->window;
    m->segments_clamp = c->mask == MASK_SEG_CLAMP;
    if (make_segments(d)) return -1;
    break;
  case MASK_TREE:
  case MASK_TREE_SEG:
    m->kind = KVA_MASK_TREE;
    m->window = c->window;
    if (c->mask == MASK_TREE_SEG) {
      m->segments_clamp = c->window > 0;
      if (make_segments(d)) return -1;
    }
    if (make_tree(d)) return -1;
    break;
  case MASK_BOOL:
  case MASK_ADD: {
    m->kind = KVA_MASK_ARRAY;
    /* Broadcast over heads when H > 1 and strided (exercises stride-0 dims). */
    int64_t hh = (c->strided && c->H > 1) ? 1 : c->H;
    kva_dtype dt = c->mask == MASK_BOOL ? KVA_BOOL : KVA_F32;
    size_t es = kva_dtype_size(dt);
    char *a = (char *)keep(d, es * (size_t)(c->B * hh * c->L * c->N));
    m->array = kva_tensor_4d(a, dt, c->B, hh, c->L, c->N);
    for (int64_t i = 0; i < c->B * hh * c->L * c->N; ++i) {
      if (dt == KVA_BOOL) a[i] = (char)(test_rand_u64() % 10 < 7);
      else {
        float x = (test_rand_u64() % 10 < 2) ? -INFINITY : test_randu(-2.0f, 2.0f);
        memcpy(a + 4 * i, &x, 4);
      }
    }
    break;
  }
  }
  if (c->softcap > 0) d->params.softcap = c->softcap;
  if (c->sinks) {
    d->sinks = (float *)keep(d, sizeof(float) * (size_t)c->H);
    for (int h = 0; h < c->H; ++h) d->sinks[h] = test_randn();
    d->params.sinks = d->sinks;
  }
  d->view = kva_view_contiguous(&d->k, &d->v, d->lens);
  if (probe) write_probes(d);
  return 0;
}

void att_free(att_data *d) {
  for (int i = 0; i < d->nbufs; ++i) free(d->bufs[i]);
  d->nbufs = 0;
}

/* The guards: the SENTINEL_BYTES before and after the out buffer. */
static unsigned char *out_sentinel(const att_data *d) { return (unsigned char *)d->out_buf + d->out_bytes; }
static unsigned char *out_front(const att_data *d) { return (unsigned char *)d->out_buf - SENTINEL_BYTES; }

/* Sets every byte of out's elements to x (in buf, an image of out_buf). */
static void fill_out_elems(const att_data *d, unsigned char *buf, unsigned char x) {
  const kva_tensor *t = &d->out;
  const size_t es = kva_dtype_size(t->dtype);
  const ptrdiff_t base = (const char *)t->data - (const char *)d->out_buf;
  for (int64_t a = 0; a < t->shape[0]; ++a)
    for (int64_t b = 0; b < t->shape[1]; ++b)
      for (int64_t c = 0; c < t->shape[2]; ++c)
        memset(buf + base + a * t->stride[0] + b * t->stride[1] + c * t->stride[2], x, (size_t)t->shape[3] * es);
}

void att_poison(att_data *d) {
  memset(d->out_buf, PAD_BYTE, d->out_bytes); /* the padding between and around rows: make_view's pattern */
  fill_out_elems(d, (unsigned char *)d->out_buf, POISON_BYTE);
  memcpy(d->out_image, d->out_buf, d->out_bytes);
  memset(out_sentinel(d), SENTINEL_BYTE, SENTINEL_BYTES);
  memset(out_front(d), SENTINEL_BYTE, SENTINEL_BYTES);
}

int att_sentinel_ok(const att_data *d) {
  const unsigned char *s = out_sentinel(d), *f = out_front(d);
  for (int i = 0; i < SENTINEL_BYTES; ++i)
    if (s[i] != SENTINEL_BYTE || f[i] != SENTINEL_BYTE) {
      fprintf(stderr, "    guard byte %d %s out overwritten\n", i, s[i] != SENTINEL_BYTE ? "after" : "before");
      return 0;
    }
  return 1;
}

int att_out_padding_is(const att_data *d, unsigned char pad) {
  unsigned char *now = (unsigned char *)malloc(d->out_bytes);
  if (!now) return 0;
  memcpy(now, d->out_buf, d->out_bytes);
  fill_out_elems(d, now, pad);
  size_t i = 0;
  while (i < d->out_bytes && now[i] == pad) ++i;
  free(now);
  if (i < d->out_bytes) fprintf(stderr, "    out's padding overwritten at byte %zu of its buffer\n", i);
  return i == d->out_bytes;
}

int att_out_untouched_ok(const att_data *d) {
  if (!att_sentinel_ok(d)) return 0;
  /* out's padding (strided views): as att_poison left it. The elements are
   * set back to the poison byte in a copy, which must then equal the image. */
  unsigned char *now = (unsigned char *)malloc(d->out_bytes);
  if (!now) return 0;
  memcpy(now, d->out_buf, d->out_bytes);
  fill_out_elems(d, now, POISON_BYTE);
  size_t bad = 0;
  while (bad < d->out_bytes && now[bad] == d->out_image[bad]) ++bad;
  free(now);
  if (bad < d->out_bytes) {
    fprintf(stderr, "    out's padding overwritten at byte %zu of its buffer\n", bad);
    return 0;
  }
  return 1;
}

kva_tensor att_alloc_like(att_data *d, const kva_tensor *t) {
  size_t bytes = (size_t)(t->shape[0] * t->shape[1] * t->shape[2] * t->shape[3]) * kva_dtype_size(t->dtype);
  void *mem = keep(d, bytes);
  if (mem) memset(mem, 0xff, bytes);
  return kva_tensor_4d(mem, t->dtype, t->shape[0], t->shape[1], t->shape[2], t->shape[3]);
}

/* The items "OPERANDS TYPE" of a kernel name's trailing bracket (separated
 * by ", "; OPERANDS joined by ',', "K,V,P bf16"): fn(item, type, end, arg)
 * for each, type the text after the item's last space (NULL without one),
 * end the item's end; stops at a nonzero return and returns it. -1 when the
 * name has no trailing bracket. */
typedef int (*att_item_fn)(const char *item, const char *type, const char *end, void *arg);
static int att_bracket_items(const char *name, att_item_fn fn, void *arg) {
  const char *open = strrchr(name, '[');
  const size_t n = strlen(name);
  if (!open || n < 2 || name[n - 1] != ']') return -1;
  for (const char *item = open + 1; item < name + n - 1;) {
    const char *end = strstr(item, ", ");
    if (!end || end > name + n - 1) end = name + n - 1;
    const char *sp = NULL;
    for (const char *x = item; x < end; ++x)
      if (*x == ' ') sp = x + 1;
    const int rc = fn(item, sp, end, arg);
    if (rc) return rc;
    item = end < name + n - 1 ? end + 2 : end;
  }
  return 0;
}

/* att_name_atol's item: the largest allowance into *arg; -1 for an unknown item. */
static int atol_item(const char *item, const char *sp, const char *end, void *arg) {
  double *atol = arg;
  char type[16];
  const size_t tl = sp ? (size_t)(end - sp) : 0;
  if (!sp || sp == item + 1 || tl == 0 || tl >= sizeof type) return -1;
  memcpy(type, sp, tl);
  type[tl] = '\0';
  double a;
  if ((!strcmp(type, "bf16") || !strcmp(type, "f16")) && item[0] == 'q' && item[1] == ' ')
    a = ATT_ATOL_F32; /* a rotated call's q' rounded to 16 bits: the oracle applies it (q_dtype) */
  else if (!strcmp(type, "bf16") || !strcmp(type, "f16")) a = ATT_ATOL_BF16;
  else if (!strcmp(type, "int16") && item[0] == 'P' && item[1] == ' ') a = ATT_ATOL_PINT16;
  else if (!strncmp(type, "int", 3) && atoi(type + 3) >= 8 && item[0] == 'q' && item[1] == ' ')
    a = atoi(type + 3) >= ATT_QINT_EXACT_BITS || atoi(type + 3) <= ATT_QINT_ORACLE_BITS ? ATT_ATOL_F32 : ATT_ATOL_BF16;
  else return -1;
  if (a > *atol) *atol = a;
  return 0;
}

double att_name_atol(const char *name) {
  const char *open = strrchr(name, '[');
  if (open && !strcmp(open, "[exact f32]")) return ATT_ATOL_F32;
  double atol = 0.0;
  if (att_bracket_items(name, atol_item, &atol)) return -1.0;
  return atol > 0 ? atol : -1.0;
}

/* att_name_rounding's item: the roundings it names into *arg. */
static int rounding_item(const char *item, const char *sp, const char *end, void *arg) {
  kva_ref_rounding *r = arg;
  (void)end;
  if (!sp) return 0;
  const kva_dtype t = !strncmp(sp, "bf16", 4) ? KVA_BF16 : !strncmp(sp, "f16", 3) ? KVA_F16 : KVA_F32;
  for (const char *x = item; x < sp - 1; ++x) { /* operands "K,V,P" */
    if (*x == 'K' && t != KVA_F32) r->k_dtype = t;
    if (*x == 'V' && t != KVA_F32) r->v_dtype = t;
  }
  if (item[0] == 'q' && item[1] == ' ' && !strncmp(sp, "int", 3) && atoi(sp + 3) <= ATT_QINT_ORACLE_BITS)
    r->q_int_bits = atoi(sp + 3);
  if (item[0] == 'q' && item[1] == ' ' && t != KVA_F32) r->q_dtype = t; /* "q bf16": the rotated query */
  return 0;
}

int att_name_rounding(const char *name, kva_ref_rounding *r) {
  r->q_int_bits = 0;
  r->k_dtype = r->v_dtype = r->q_dtype = KVA_F32;
  return att_bracket_items(name, rounding_item, r) < 0 ? -1 : 0;
}

int att_kernel_reference(kva_context *ctx, const kva_tensor *kq, const kva_kv_view *kkv, const kva_attn_params *kp,
                         const kva_tensor *kout, const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *p,
                         kva_tensor *ref) {
  char name[256];
  int rc = kva_attention_kernel(ctx, kq, kkv, kp, kout, name, sizeof name);
  if (rc < 0) {
    fprintf(stderr, "    att_kernel_reference: kva_attention_kernel: %s\n", kva_last_error());
    return rc;
  }
  kva_ref_rounding r;
  att_name_rounding(name, &r);
  rc = kva_reference_attention_rounded(q, kv, p, ref, NULL, 0, &r);
  if (rc < 0) fprintf(stderr, "    att_kernel_reference: oracle: %s\n", kva_last_error());
  return rc;
}

const kva_tensor *att_oracle_for(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *p,
                                 const kva_tensor *out, const kva_tensor *exact, kva_tensor *scratch) {
  char name[256];
  if (kva_attention_kernel(ctx, q, kv, p, out, name, sizeof name) < 0) {
    fprintf(stderr, "    att_oracle_for: kva_attention_kernel: %s\n", kva_last_error());
    return NULL;
  }
  kva_ref_rounding r;
  att_name_rounding(name, &r);
  if (r.q_int_bits == 0 && r.k_dtype == KVA_F32 && r.v_dtype == KVA_F32 && r.q_dtype == KVA_F32) return exact;
  if (kva_reference_attention_rounded(q, kv, p, scratch, NULL, 0, &r) < 0) {
    fprintf(stderr, "    att_oracle_for: oracle: %s\n", kva_last_error());
    return NULL;
  }
  return scratch;
}

int att_name_exact(const char *name) {
  static const char exact[] = "[exact f32]";
  const size_t n = strlen(name), e = sizeof exact - 1;
  return n >= e && !strcmp(name + n - e, exact);
}

double att_kernel_atol(kva_context *ctx, const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *params,
                       const kva_tensor *out) {
  char name[256];
  if (kva_attention_kernel(ctx, q, kv, params, out, name, sizeof name) < 0) {
    fprintf(stderr, "    att_kernel_atol: kva_attention_kernel: %s\n", kva_last_error());
    return -1.0;
  }
  const double atol = att_name_atol(name);
  if (atol < 0) fprintf(stderr, "    att_kernel_atol: no rounding bracket in the kernel name \"%s\"\n", name);
  return atol;
}

/* Bytes of a contiguous [n0, n1, n2, n3] tensor of dt. */
static size_t dense_bytes(kva_dtype dt, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
  return (size_t)(n0 * n1 * n2 * n3) * kva_dtype_size(dt);
}

double att_case_atol(const att_case *c) {
  /* Descriptors of the case's shapes over zeroed memory that is never read
   * (calloc: untouched pages), on the default CPU context; only the kernel
   * name is asked for. */
  static kva_context *ctx;
  if (!ctx && kva_context_create(&ctx, NULL)) return -1.0;
  void *mem[12] = {0};
  int nm = 0;
  kva_kv k, v;
  memset(&k, 0, sizeof k);
  memset(&v, 0, sizeof v);
  kva_kv *kvs[2] = {&k, &v};
  const int bits[2] = {c->kbits, c->vbits}, dims[2] = {c->Dk, c->Dv};
  for (int i = 0; i < 2; ++i) {
    kva_kv *x = kvs[i];
    if (!bits[i]) {
      mem[nm] = calloc(1, dense_bytes(c->kvdt, c->B, c->KVH, c->N, dims[i]));
      *x = kva_kv_float(mem[nm++], c->kvdt, c->B, c->KVH, c->N, dims[i]);
    } else {
      mem[nm] = calloc(1, dense_bytes(KVA_U32, c->B, c->KVH, c->N, (int64_t)dims[i] * bits[i] / 32));
      mem[nm + 1] = calloc(1, dense_bytes(c->kvdt, c->B, c->KVH, c->N, dims[i] / c->group));
      mem[nm + 2] = calloc(1, dense_bytes(c->kvdt, c->B, c->KVH, c->N, dims[i] / c->group));
      *x = kva_kv_quantized(mem[nm], mem[nm + 1], mem[nm + 2], c->kvdt, bits[i], c->group, c->B, c->KVH, c->N,
                            dims[i]);
      nm += 3;
    }
  }
  mem[nm] = calloc(1, dense_bytes(c->qdt, c->B, c->H, c->L, c->Dk));
  kva_tensor q = kva_tensor_4d(mem[nm++], c->qdt, c->B, c->H, c->L, c->Dk);
  mem[nm] = calloc(1, dense_bytes(c->odt, c->B, c->H, c->L, c->Dv));
  kva_tensor out = kva_tensor_4d(mem[nm++], c->odt, c->B, c->H, c->L, c->Dv);
  kva_attn_params p = kva_attn_defaults();
  kva_mask *m = &p.mask;
  if (c->mask != MASK_NONE) m->kind = KVA_MASK_CAUSAL;
  if (c->mask == MASK_WINDOW || c->mask == MASK_SEG || c->mask == MASK_SEG_CLAMP) m->window = c->window;
  if (c->mask == MASK_SEG || c->mask == MASK_SEG_CLAMP) {
    mem[nm] = calloc(1, dense_bytes(KVA_I32, 1, 1, c->B, c->N));
    m->segments = kva_tensor_2d(mem[nm++], KVA_I32, c->B, c->N);
    m->segments_clamp = c->mask == MASK_SEG_CLAMP;
  }
  if (c->mask == MASK_TREE || c->mask == MASK_TREE_SEG) {
    m->kind = KVA_MASK_TREE;
    m->window = c->window;
    if (c->mask == MASK_TREE_SEG) {
      mem[nm] = calloc(1, dense_bytes(KVA_I32, 1, 1, c->B, c->N));
      m->segments = kva_tensor_2d(mem[nm++], KVA_I32, c->B, c->N);
      m->segments_clamp = c->window > 0;
    }
    mem[nm] = calloc(1, dense_bytes(KVA_U32, 1, c->B, c->L, (c->L + 31) / 32)); /* no bit set */
    m->array = kva_tensor_2d(mem[nm++], KVA_U32, c->L, (c->L + 31) / 32);
    m->array.ndim = 3;
    m->array.shape[0] = c->B;
    m->array.shape[1] = c->L;
    m->array.shape[2] = (c->L + 31) / 32;
    m->array.stride[2] = 4;
    m->array.stride[1] = 4 * m->array.shape[2];
    m->array.stride[0] = c->L * m->array.stride[1];
  }
  if (c->mask == MASK_BOOL || c->mask == MASK_ADD) {
    const kva_dtype dt = c->mask == MASK_BOOL ? KVA_BOOL : KVA_F32;
    m->kind = KVA_MASK_ARRAY;
    mem[nm] = calloc(1, dense_bytes(dt, c->B, c->H, c->L, c->N));
    m->array = kva_tensor_4d(mem[nm++], dt, c->B, c->H, c->L, c->N);
  }
  if (c->softcap > 0) p.softcap = c->softcap;
  if (c->sinks) {
    mem[nm] = calloc((size_t)c->H, sizeof(float));
    p.sinks = (const float *)mem[nm++];
  }
  int missing = 0;
  for (int i = 0; i < nm; ++i) missing |= !mem[i];
  const kva_kv_view view = kva_view_contiguous(&k, &v, NULL);
  const double atol = missing ? -1.0 : att_kernel_atol(ctx, &q, &view, &p, &out);
  for (int i = 0; i < nm; ++i) free(mem[i]);
  return atol;
}

double att_rtol(kva_dtype out) {
  switch (out) {
  case KVA_BF16: return 1.0 / 128; /* one bf16 ulp: both sides round to bf16 */
  case KVA_F16: return 1.0 / 1024;
  default: return 0.0;
  }
}

static double elem(const kva_tensor *t, int64_t a, int64_t b, int64_t c, int64_t e) {
  const char *p = (const char *)t->data + a * t->stride[0] + b * t->stride[1] + c * t->stride[2] + e * t->stride[3];
  switch (t->dtype) {
  case KVA_F32: { float f; memcpy(&f, p, 4); return f; }
  case KVA_F16: { uint16_t h; memcpy(&h, p, 2); return kva_f16_to_f32(h); }
  default: { uint16_t h; memcpy(&h, p, 2); return kva_bf16_to_f32(h); }
  }
}

int att_compare(const kva_tensor *out, const kva_tensor *ref, double atol_rel, double rtol, double *max_err,
                double *rel_l2) {
  double maxref = 0, num = 0, den = 0, worst = 0, worst_ratio = 0;
  long long bad = 0;
  for (int pass = 0; pass < 2; ++pass)
    for (int64_t a = 0; a < out->shape[0]; ++a)
      for (int64_t b = 0; b < out->shape[1]; ++b)
        for (int64_t c = 0; c < out->shape[2]; ++c)
          for (int64_t e = 0; e < out->shape[3]; ++e) {
            double o = elem(out, a, b, c, e), r = elem(ref, a, b, c, e);
            if (pass == 0) {
              if (isfinite(r) && fabs(r) > maxref) maxref = fabs(r);
              int on = isnan(o), rn = isnan(r), oi = isinf(o), ri = isinf(r);
              if (on != rn || oi != ri || (oi && ri && o != r)) {
                fprintf(stderr, "    NaN/Inf mismatch at [%lld,%lld,%lld,%lld]: out %g ref %g\n", (long long)a,
                        (long long)b, (long long)c, (long long)e, o, r);
                return 0;
              }
              continue;
            }
            if (!isfinite(r)) continue;
            double err = fabs(o - r), allowed = atol_rel * maxref + rtol * fabs(r);
            num += err * err;
            den += r * r;
            if (err > worst) worst = err;
            if (err > allowed) {
              if (bad++ == 0)
                fprintf(stderr, "    mismatch at [%lld,%lld,%lld,%lld]: out %.8g ref %.8g err %.3g > allowed %.3g\n",
                        (long long)a, (long long)b, (long long)c, (long long)e, o, r, err, allowed);
              /* the worst element by err / allowed (allowed 0: err itself) */
              const double ratio = allowed > 0 ? err / allowed : INFINITY;
              if (ratio > worst_ratio) worst_ratio = ratio;
            }
          }
  if (max_err) *max_err = worst;
  if (rel_l2) *rel_l2 = den > 0 ? sqrt(num / den) : sqrt(num);
  if (bad)
    fprintf(stderr, "    %lld elements out of tolerance; max err %.3g (max|ref| %.3g), worst err/allowed %.3g\n",
            bad, worst, maxref, worst_ratio);
  return bad == 0;
}

static void nan_row(const kva_tensor *t, int b, int hk, int64_t tok) {
  char *r = (char *)t->data + b * t->stride[0] + hk * t->stride[1] + tok * t->stride[2];
  for (int64_t e = 0; e < t->shape[3]; ++e) test_store(r + e * t->stride[3], t->dtype, NAN);
}
void att_plant_unseen(att_data *d) {
  const att_case *c = &d->c;
  const kva_kv *ops[2] = {&d->k, &d->v};
  for (int b = 0; b < c->B; ++b) {
    const int64_t len = d->lens ? d->lens[b] : c->N;
    const int64_t first = c->mask == MASK_WINDOW || (c->mask == MASK_TREE && c->window > 0)
                              ? len - c->L - c->window + 1
                              : 0; /* row 0's first key */
    for (int hk = 0; hk < c->KVH; ++hk)
      for (int64_t t = 0; t < c->N; ++t) {
        if (t >= first && t < len) continue;
        for (int i = 0; i < 2; ++i)
          if (ops[i]->bits) {
            nan_row(&ops[i]->scales, b, hk, t);
            nan_row(&ops[i]->biases, b, hk, t);
          } else {
            nan_row(&ops[i]->data, b, hk, t);
          }
      }
  }
}

void att_plant_last_v(att_data *d, float x) {
  const att_case *c = &d->c;
  for (int b = 0; b < c->B; ++b) {
    const int64_t last = (d->lens ? d->lens[b] : c->N) - 1;
    for (int hk = 0; hk < c->KVH; ++hk) {
      const kva_tensor *t = d->v.bits ? &d->v.scales : &d->v.data; /* quantized: group 0's scale */
      char *r = (char *)t->data + b * t->stride[0] + hk * t->stride[1] + last * t->stride[2];
      test_store(r, t->dtype, x);
    }
  }
}

/* ------------------------------------------------ caller-owned block pools */
/* One pool array [nblk, KVH, bs, W] shaped like `like` (a [B, KVH, N, W]
 * operand) with padded strides, every byte `fill`. */
static kva_tensor pool_array(const kva_tensor *like, int64_t nblk, int64_t bs, unsigned char fill, void **mem,
                             int align16) {
  const int64_t es = (int64_t)kva_dtype_size(like->dtype), W = like->shape[3], KVH = like->shape[1];
  kva_tensor t = *like;
  t.shape[0] = nblk;
  t.shape[2] = bs;
  t.stride[3] = es;
  /* padded rows (fp8, and every type when align16: by 16 bytes, keeping the rows 16-byte aligned) */
  t.stride[2] = (W + (es == 1 || align16 ? 16 / es : 4)) * es;
  t.stride[1] = (bs + 1) * t.stride[2]; /* a padding row after each head */
  t.stride[0] = KVH * t.stride[1] + 64;
  size_t bytes = (size_t)(nblk * t.stride[0]);
  *mem = malloc(bytes);
  if (*mem) memset(*mem, fill, bytes);
  t.data = *mem;
  return t;
}

/* perm[0..n) = a uniformly random permutation of 0..n-1 (Fisher-Yates on the test generator). */
void att_random_perm(int32_t *perm, int64_t n) {
  for (int64_t i = 0; i < n; ++i) perm[i] = (int32_t)i;
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = (int64_t)(test_rand_u64() % (uint64_t)(i + 1));
    const int32_t x = perm[i];
    perm[i] = perm[j];
    perm[j] = x;
  }
}

/* Copies row (b, hk, t) of src into pool row (blk, hk, row). */
static void pool_copy_row(const kva_tensor *dst, int64_t blk, int64_t row, const kva_tensor *src, int64_t b,
                          int64_t hk, int64_t t) {
  memcpy((char *)dst->data + blk * dst->stride[0] + hk * dst->stride[1] + row * dst->stride[2],
         (const char *)src->data + b * src->stride[0] + hk * src->stride[1] + t * src->stride[2],
         (size_t)src->shape[3] * kva_dtype_size(src->dtype));
}

static int pool_kv_make(kva_kv *p, void **mem, const kva_kv *like, int64_t nblk, int64_t bs, unsigned char fill,
                        int align16) {
  *p = *like;
  p->data = pool_array(&like->data, nblk, bs, fill, &mem[0], align16);
  if (!like->bits && like->scales.data && like->scales.stride[2]) { /* fp8 per-token scales */
    p->scales = pool_array(&like->scales, nblk, bs, fill, &mem[1], align16);
    if (!mem[1]) return -1;
  } else if (!like->bits && like->scales.data) { /* one shared scale (strides 0): the pool's shape */
    p->scales.shape[0] = nblk;
    p->scales.shape[2] = bs;
  }
  if (like->bits) {
    p->scales = pool_array(&like->scales, nblk, bs, fill, &mem[1], align16);
    p->biases = pool_array(&like->biases, nblk, bs, fill, &mem[2], align16);
    if (!mem[1] || !mem[2]) return -1;
  }
  return mem[0] ? 0 : -1;
}

static void pool_kv_write(kva_kv *p, int64_t blk, int64_t row, const kva_kv *src, int64_t b, int64_t hk, int64_t t) {
  pool_copy_row(&p->data, blk, row, &src->data, b, hk, t);
  if (!src->bits && src->scales.data && src->scales.stride[2]) pool_copy_row(&p->scales, blk, row, &src->scales, b, hk, t);
  if (src->bits) {
    pool_copy_row(&p->scales, blk, row, &src->scales, b, hk, t);
    pool_copy_row(&p->biases, blk, row, &src->biases, b, hk, t);
  }
}

static int table_make(att_table *tb, const att_data *d, int64_t bs, unsigned char fill, int align16) {
  const att_case *c = &d->c;
  memset(tb, 0, sizeof *tb);
  tb->bs = bs;
  tb->lens = (int32_t *)malloc(sizeof(int32_t) * (size_t)c->B);
  tb->fo = (int32_t *)malloc(sizeof(int32_t) * (size_t)c->B);
  if (!tb->lens || !tb->fo) return -1;
  int64_t mb = 0;
  tb->nblk = 3; /* spare blocks nobody uses */
  for (int b = 0; b < c->B; ++b) {
    tb->lens[b] = d->lens ? d->lens[b] : (int32_t)c->N;
    tb->fo[b] = (int32_t)(test_rand_u64() % (uint64_t)bs);
    const int64_t nb = (tb->fo[b] + tb->lens[b] + bs - 1) / bs;
    tb->nblk += nb;
    if (nb > mb) mb = nb;
  }
  mb += 1;
  /* blocks: a random permutation of the pool, taken in order */
  int32_t *perm = (int32_t *)malloc(sizeof(int32_t) * (size_t)tb->nblk);
  tb->blocks = (int32_t *)malloc(sizeof(int32_t) * (size_t)(c->B * mb));
  if (!perm || !tb->blocks || pool_kv_make(&tb->k, tb->mem, &d->k, tb->nblk, bs, fill, align16) ||
      pool_kv_make(&tb->v, tb->mem + 3, &d->v, tb->nblk, bs, fill, align16)) {
    free(perm);
    return -1;
  }
  att_random_perm(perm, tb->nblk);
  int64_t next = 0;
  for (int b = 0; b < c->B; ++b) {
    int32_t *row = tb->blocks + b * mb;
    for (int64_t i = 0; i < mb; ++i) row[i] = -1;
    for (int64_t t = 0; t < tb->lens[b]; ++t) {
      const int64_t r = tb->fo[b] + t, slot = r / bs;
      if (r % bs == 0 || t == 0) row[slot] = perm[next++];
      for (int64_t hk = 0; hk < c->KVH; ++hk) {
        pool_kv_write(&tb->k, row[slot], r % bs, &d->k, b, hk, t);
        pool_kv_write(&tb->v, row[slot], r % bs, &d->v, b, hk, t);
      }
    }
  }
  free(perm);
  tb->t = (kva_block_table){c->B, mb, 0, tb->blocks, tb->lens, tb->fo};
  tb->view = kva_view_block_table(&tb->k, &tb->v, &tb->t);
  return 0;
}

int att_table_make(att_table *tb, const att_data *d, int64_t bs, unsigned char fill) {
  return table_make(tb, d, bs, fill, 0);
}
int att_table_make_aligned(att_table *tb, const att_data *d, int64_t bs, unsigned char fill) {
  return table_make(tb, d, bs, fill, 1);
}

void att_table_free(att_table *tb) {
  for (int i = 0; i < 6; ++i) free(tb->mem[i]);
  free(tb->blocks);
  free(tb->lens);
  free(tb->fo);
  memset(tb, 0, sizeof *tb);
}

/* ------------------------------------------------ random mutations */
/* A distinct absurd value: 2^k plus random low bits for k = 40 .. 62 (so
 * products with element sizes, 32 / bits and other shapes overflow int64
 * at every magnitude), or near INT64_MAX. */
int64_t att_absurd(void) {
  const uint64_t r = test_rand_u64();
  if (r % 4 == 0) return INT64_MAX - (int64_t)(r >> 40);
  const int k = 40 + (int)(r / 4 % 23);
  return ((int64_t)1 << k) + (int64_t)(r >> (64 - (k - 16))); /* low bits below 2^(k-16) */
}
int att_pick(int n) { return (int)(test_rand_u64() % (uint64_t)n); }

void att_mutate_tensor(kva_tensor *t) {
  const int nd = t->ndim >= 1 && t->ndim <= KVA_MAX_DIMS ? t->ndim : 1;
  const int d = att_pick(nd);
  switch (att_pick(7)) {
  case 0: { /* rank */
    static const int ranks[] = {-1, 0, 1, 2, 3, 5, 100};
    t->ndim = ranks[att_pick(7)];
    break;
  }
  case 1: { /* dtype, valid or not */
    static const int dts[] = {-1, 0, 1, 2, 3, 4, 5, 6, 1000};
    t->dtype = (kva_dtype)dts[att_pick(9)];
    break;
  }
  case 2: /* shape: shrink (only along a real stride: an absurd one that case 5 grew the shape for would
           * become a valid view far outside the buffer) */
    if (t->shape[d] > 1 && t->stride[d] < ((int64_t)1 << 40))
      t->shape[d] -= 1 + att_pick((int)(t->shape[d] - 1 < 8 ? t->shape[d] - 1 : 8));
    break;
  case 3: { /* shape: zero, negative, absurd; or an absurd innermost dim with every other dim shrunk to
             * 1 (one long row: no overlap refuses it before its size is used, e.g. words * 32 / bits) */
    const int k = att_pick(4);
    if (k == 3) {
      for (int e = 0; e < nd; ++e) t->shape[e] = 1;
      t->shape[nd - 1] = att_absurd();
      break;
    }
    t->shape[d] = k == 0 ? 0 : k == 1 ? -1 - att_pick(100) : att_absurd();
    break;
  }
  case 4: { /* stride: negative, zero, overlapping, one byte off */
    const int64_t s = t->stride[d];
    const int k = att_pick(4);
    /* (halving only a real stride: half of an absurd one would be a valid
     * view far outside the buffer) */
    const int64_t es = (int64_t)kva_dtype_size(t->dtype);
    t->stride[d] = k == 0   ? -s - 1
                   : k == 1 ? 0
                   : k == 2 ? (s > 1 && s < ((int64_t)1 << 40) ? s / 2 : 0)
                            : s + (att_pick(2) && es > 1 ? 1 : -1); /* one byte more only where it misaligns */
    break;
  }
  case 5: { /* stride: absurd (2^40 .. 2^63), a multiple of the element size or not; with shape[d] > 1 the
             * view spans 2^62 bytes or more (the shape grows to make it so), else the stride is unused */
    const int64_t es = (int64_t)kva_dtype_size(t->dtype), s = att_absurd();
    t->stride[d] = att_pick(2) && es > 1 ? s / es * es : s;
    if (t->shape[d] > 1 && t->shape[d] - 1 < (((int64_t)1 << 62) / t->stride[d]) + 1)
      t->shape[d] = (((int64_t)1 << 62) / t->stride[d]) + 2;
    break;
  }
  default: /* pointer */
    t->data = NULL;
    break;
  }
}

void att_mutate_kv(kva_kv *kv) {
  switch (att_pick(5)) {
  case 0: att_mutate_tensor(&kv->data); break;
  case 1: att_mutate_tensor(&kv->scales); break;
  case 2: att_mutate_tensor(&kv->biases); break;
  case 3: {
    static const int bits[] = {-1, 0, 1, 2, 3, 4, 8, 16, 32};
    kv->bits = bits[att_pick(9)];
    break;
  }
  default: {
    static const int groups[] = {-64, 0, 1, 16, 32, 48, 64, 128, 256, 1 << 30};
    kv->group_size = groups[att_pick(10)];
    break;
  }
  }
}

/* One mutation somewhere in the call; lens: a writable copy of the lengths. */

static const char *const att_pass_names[ATT_PASSES] = {"portable", "avx2", "avx512", "avxvnni", "general"};
static int att_general; /* the last pass active */
int att_set_pass(int pass) {
  static const char *said[ATT_PASSES]; /* the test that last said it skips the pass */
  att_general = pass == ATT_PASSES - 1;
  kva_cpu_general_only(att_general);
  const int rc = kva_cpu_set_simd(att_general ? NULL : att_pass_names[pass]);
  if (rc && said[pass] != test_current_name) {
    said[pass] = test_current_name;
    printf("  skip %s: %s\n", att_pass_names[pass], kva_last_error());
  }
  return rc;
}
const char *att_pass_name(int pass) { return att_pass_names[pass]; }
const char *att_pass_now(void) { return att_general ? "general" : kva_cpu_simd(); }
void att_end_passes(void) {
  att_general = 0;
  kva_cpu_general_only(0);
  kva_cpu_set_simd(NULL);
}
