/* The oracle: naive attention in double precision over the public
 * descriptors. One query row at a time: scores for every key, masks, softcap,
 * softmax with the sink in the denominator, weighted sum of V. It shares no
 * code with the fast paths past argument validation: kva_problem_init checks
 * the call exactly as kva_attention does (and refuses what it refuses), and
 * nothing else of the problem it builds is used. Element loads, row
 * addresses (contiguous, block-table and paged views: the last through the
 * public CSR arrays, kva_paged_view_csr), lengths, dequantization, the mask
 * rule and the output rounding are this file's own. On request it applies
 * a kernel's documented roundings (kva_ref_rounding: the query to integers
 * per group, K or V elements to bf16 / f16), each from the exact value.
 * Rotated calls (KVA_ATTN_ROTATED_K / _V) rotate the query and un-rotate
 * the output with this file's own H in double (ref_hadamard_elem), or form
 * the query with kva_hadamard's f32 arithmetic when a rounding of it is
 * modelled (the query the kernel receives). */
#include "api/attention.h"

#include <math.h>
#include <string.h>

static double ref_half_to_double(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m + 1024, e - 25);
  return (h & 0x8000) ? -v : v;
}
static double ref_bf16_to_double(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
/* fp8 codes, decoded from their fields: e4m3fn (bias 7, S.1111.111 NaN,
 * no inf), e5m2 (bias 15, exponent 31: inf or NaN). */
static double ref_fp8_to_double(uint8_t c, kva_dtype dt) {
  const int M = dt == KVA_F8E4M3 ? 3 : 2, bias = dt == KVA_F8E4M3 ? 7 : 15;
  const int e = (c & 0x7f) >> M, m = c & ((1 << M) - 1);
  double v;
  if (dt == KVA_F8E4M3 && (c & 0x7f) == 0x7f) v = NAN;
  else if (dt == KVA_F8E5M2 && e == 31) v = m ? NAN : INFINITY;
  else if (e == 0) v = ldexp(m, 1 - bias - M);
  else v = ldexp(m + (1 << M), e - bias - M);
  return (c & 0x80) ? -v : v;
}
static double ref_load(const char *p, kva_dtype dt) {
  switch (dt) {
  case KVA_F32: { float f; memcpy(&f, p, 4); return f; }
  case KVA_F16: { uint16_t h; memcpy(&h, p, 2); return ref_half_to_double(h); }
  case KVA_BF16: { uint16_t h; memcpy(&h, p, 2); return ref_bf16_to_double(h); }
  case KVA_F8E4M3: case KVA_F8E5M2: return ref_fp8_to_double(*(const uint8_t *)p, dt);
  default: return NAN;
  }
}

/* f32 -> bf16, round to nearest even; NaN stays a (quiet) NaN of its sign. */
static uint16_t ref_bf16_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if (isnan(f)) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
/* f32 -> f16, round to nearest even (subnormals, overflow to inf). */
static uint16_t ref_f16_of(float f) {
  const uint16_t sign = signbit(f) ? 0x8000 : 0;
  const double a = fabs((double)f);
  if (isnan(f)) return (uint16_t)(sign | 0x7e00);
  if (a >= 65520.0) return (uint16_t)(sign | 0x7c00); /* past the midpoint of 65504 and 2^16 */
  if (a < 0x1p-14) return (uint16_t)(sign | (uint16_t)nearbyint(a * 0x1p24)); /* subnormal (or 2^-14) */
  int ex;
  frexp(a, &ex); /* a = fr 2^ex, fr in [0.5, 1): a = (1 + m/1024) 2^(ex-1) */
  int e = ex - 1;
  double m = nearbyint((ldexp(a, -e) - 1.0) * 1024.0);
  if (m == 1024.0) {
    m = 0;
    ++e;
  }
  return (uint16_t)(sign | (uint16_t)((e + 15) << 10) | (uint16_t)m);
}

/* x rounded to the nearest bf16 / f16 value (ties to even; subnormals kept,
 * overflow to +-inf); any other dt: x unchanged. One rounding from the exact
 * value (no double rounding through f32). */
static double ref_round_to(double x, kva_dtype dt) {
  if ((dt != KVA_BF16 && dt != KVA_F16) || !isfinite(x) || x == 0.0) return x;
  const int mant = dt == KVA_BF16 ? 7 : 10, emin = dt == KVA_BF16 ? -126 : -14;
  const double maxv = dt == KVA_BF16 ? 0x1.fep127 : 65504.0;
  const int e = ilogb(x);
  const double quantum = ldexp(1.0, (e < emin ? emin : e) - mant);
  const double r = nearbyint(x / quantum) * quantum; /* x / quantum: exact (a power of 2) */
  return fabs(r) > maxv ? copysign(INFINITY, x) : r;
}

/* Address of element [a, b, c, d] of a 4-d descriptor. */
static const char *ref_at(const kva_tensor *t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return (const char *)t->data + a * t->stride[0] + b * t->stride[1] + c * t->stride[2] + d * t->stride[3];
}

/* The dims of a K/V operand's rows: float, or D = words * 32 / bits. */
static int64_t ref_dim(const kva_kv *kv) { return kv->bits ? kv->data.shape[3] * 32 / kv->bits : kv->data.shape[3]; }

/* Element d of one K/V row. row: data row, sc/bi: scales/biases rows. */
static double ref_kv_elem(const kva_kv *kv, const char *row, const char *sc, const char *bi, int64_t d) {
  if (kv->bits == 0) {
    const double x = ref_load(row + d * kv->data.stride[3], kv->data.dtype);
    /* fp8 rows: scale * code (sc NULL: no scales, scale 1) */
    return sc ? ref_load(sc, KVA_F32) * x : x;
  }
  int per = 32 / kv->bits;
  uint32_t w;
  memcpy(&w, row + (d / per) * kv->data.stride[3], 4);
  uint32_t code = (w >> ((d % per) * kv->bits)) & ((1u << kv->bits) - 1u);
  int64_t g = d / kv->group_size;
  return ref_load(sc + g * kv->scales.stride[3], kv->scales.dtype) * (double)code +
         ref_load(bi + g * kv->biases.stride[3], kv->biases.dtype);
}

typedef struct { const char *row, *sc, *bi; } ref_row;

/* Row (n0, hk, n2) of one K/V operand: n0 the sequence (contiguous) or the
 * block, n2 the token or the row inside the block. */
static ref_row ref_operand_row(const kva_kv *kv, int64_t n0, int64_t hk, int64_t n2) {
  ref_row r = {ref_at(&kv->data, n0, hk, n2, 0), NULL, NULL};
  if (kv->bits == 0 && (kv->data.dtype == KVA_F8E4M3 || kv->data.dtype == KVA_F8E5M2) && kv->scales.data)
    r.sc = ref_at(&kv->scales, n0, hk, n2, 0);
  if (kv->bits) {
    r.sc = ref_at(&kv->scales, n0, hk, n2, 0);
    r.bi = ref_at(&kv->biases, n0, hk, n2, 0);
  }
  return r;
}

/* Where the tokens of a view live, read from the public descriptors. */
typedef struct {
  const kva_kv_view *view;
  kva_paged_csr csr; /* PAGED */
  int64_t bs;        /* PAGED, BLOCK_TABLE: rows per block (the pools' dim 2) */
} ref_layout;

static int64_t ref_len(const ref_layout *lo, int64_t b) {
  const kva_kv_view *v = lo->view;
  switch (v->layout) {
  case KVA_LAYOUT_PAGED: return lo->csr.lens[b];
  case KVA_LAYOUT_BLOCK_TABLE: return v->table->seq_lens[b];
  default: return v->seq_lens ? v->seq_lens[b] : v->k.data.shape[2];
  }
}

/* Row of token t of sequence b, K (which = 0) or V (1). Paged and block
 * tables: row r = first_offset + t of the sequence's blocks read as one
 * array lives in block r / bs (CSR indices or table entry), row r % bs. */
static ref_row ref_row_at(const ref_layout *lo, int which, int64_t b, int64_t hk, int64_t t) {
  const kva_kv_view *v = lo->view;
  const kva_kv *kv = which ? &v->v : &v->k;
  if (v->layout == KVA_LAYOUT_PAGED) {
    const int64_t r = (lo->csr.first_offset ? lo->csr.first_offset[b] : 0) + t;
    return ref_operand_row(kv, lo->csr.indices[lo->csr.indptr[b] + r / lo->bs], hk, r % lo->bs);
  }
  if (v->layout == KVA_LAYOUT_BLOCK_TABLE) {
    const kva_block_table *tb = v->table;
    const int64_t r = (tb->first_offset ? tb->first_offset[b] : 0) + t;
    const int64_t rs = tb->row_stride ? tb->row_stride : tb->max_blocks;
    return ref_operand_row(kv, tb->blocks[b * rs + r / lo->bs], hk, r % lo->bs);
  }
  return ref_operand_row(kv, b, hk, t);
}

/* The written mask rule (docs/semantics.md), evaluated independently of the fast
 * paths: array masks broadcast over their size-1 dims (B, H, L). */
static int ref_visible(const kva_mask *m, int64_t L, int64_t b, int64_t i, int64_t j, int64_t len, int64_t h,
                       double *add) {
  *add = 0.0;
  if (m->kind == KVA_MASK_NONE) return 1;
  if (m->kind == KVA_MASK_ARRAY) {
    const kva_tensor *a = &m->array;
    const char *e = ref_at(a, a->shape[0] == 1 ? 0 : b, a->shape[1] == 1 ? 0 : h, a->shape[2] == 1 ? 0 : i, j);
    if (a->dtype == KVA_BOOL) return *(const uint8_t *)e != 0;
    *add = ref_load(e, a->dtype);
    return 1;
  }
  int64_t pos = len - L + i;
  if (m->kind == KVA_MASK_TREE && j >= len - L) {
    /* new token jn = j - (len - L): bit jn % 32 of word jn / 32 of row i */
    const kva_tensor *a = &m->array;
    const int64_t jn = j - (len - L);
    uint32_t w;
    memcpy(&w, (const char *)a->data + (a->shape[0] == 1 ? 0 : b) * a->stride[0] + i * a->stride[1] +
                   (jn / 32) * a->stride[2], 4);
    return (int)((w >> (jn % 32)) & 1u);
  }
  int causal = j <= pos, inwin = m->window == 0 || j > pos - m->window;
  if (causal && inwin) return 1;
  if (m->segments.data) {
    const char *srow = (const char *)m->segments.data + b * m->segments.stride[0];
    int32_t sj, sp;
    memcpy(&sj, srow + j * m->segments.stride[1], 4);
    memcpy(&sp, srow + pos * m->segments.stride[1], 4);
    if (sj != 0 && sj == sp && (!m->segments_clamp || inwin)) return 1;
  }
  return 0;
}

int kva_reference_attention(const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *params,
                            kva_tensor *out) {
  return kva_reference_attention_lse(q, kv, params, out, NULL, 0);
}

int kva_reference_attention_lse(const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *params,
                                kva_tensor *out, kva_tensor *lse, unsigned flags) {
  return kva_reference_attention_rounded(q, kv, params, out, lse, flags, NULL);
}

/* Query row (b, h, i) into qr[0 .. Dk - 1]. */
static void ref_query_row(const kva_tensor *q, int64_t b, int64_t h, int64_t i, int64_t Dk, double *qr) {
  for (int64_t d = 0; d < Dk; ++d) qr[d] = ref_load(ref_at(q, b, h, i, d), q->dtype);
}
/* qr rounded as q_int_bits says (kvattn.h, kva_ref_rounding): per group of
 * gs dims, in f32 arithmetic on f32 values (the query as loaded, or as a
 * rotated call's kernel receives it). */
static void ref_query_int(double *qr, int64_t Dk, int64_t gs, int bits) {
  if (bits <= 0) return;
  const float lv = (float)((1 << (bits - 1)) - 1);
  for (int64_t g0 = 0; g0 < Dk; g0 += gs) {
    const int64_t g1 = g0 + gs < Dk ? g0 + gs : Dk;
    float amax = 0.0f;
    int finite = 1;
    for (int64_t d = g0; d < g1; ++d) {
      const float a = fabsf((float)qr[d]); /* f32 values */
      if (!isfinite(a)) finite = 0;
      else if (a > amax) amax = a;
    }
    if (!finite) continue; /* a non-finite group stays as it is */
    const float sig = amax / lv, inv = sig > 0.0f ? 1.0f / sig : 0.0f;
    if (isinf(inv)) continue; /* so does one too small for 1 / sigma (max |q| below ~2^-121 at 8 bits) */
    for (int64_t d = g0; d < g1; ++d) {
      const float y = (float)qr[d] * inv;
      float c = rintf(y);
      c = c > lv ? lv : c < -lv ? -lv : c;
      qr[d] = (double)c * (double)sig;
    }
  }
}

/* The rotation's matrix, element (a, b) of H_D in double (kvattn.h,
 * kva_hadamard): Sylvester's (-1)^popcount(a & b) / sqrt(m) on the
 * power-of-two block m, times H_3[i][j] = 2/3 - [i == j] for D = 3m. */
static double ref_hadamard_elem(int64_t D, int64_t a, int64_t b) {
  const int64_t m = D % 3 == 0 ? D / 3 : D;
  const int64_t am = a % m, bm = b % m;
  const double sylvester = (__builtin_popcountll((unsigned long long)(am & bm)) & 1 ? -1.0 : 1.0) / sqrt((double)m);
  if (m == D) return sylvester;
  return (2.0 / 3.0 - (a / m == b / m ? 1.0 : 0.0)) * sylvester;
}
/* H_D (D x D, row-major) into h. */
static void ref_hadamard_matrix(int64_t D, double *h) {
  for (int64_t a = 0; a < D; ++a)
    for (int64_t b = 0; b < D; ++b) h[a * D + b] = ref_hadamard_elem(D, a, b);
}
/* x <- H x, in double (O(D^2)); t: D scratch. */
static void ref_rotate(const double *h, int64_t D, double *x, double *t) {
  for (int64_t a = 0; a < D; ++a) {
    double acc = 0.0;
    for (int64_t b = 0; b < D; ++b) acc += h[a * D + b] * x[b];
    t[a] = acc;
  }
  memcpy(x, t, (size_t)D * sizeof *x);
}
/* x <- H x with kva_hadamard's f32 arithmetic (kvattn.h: butterflies h = 1,
 * 2, .., m/2, the 3-block, one multiply), the query a rotated call's kernel
 * receives; x holds f32 values. */
static void ref_rotate_f32(int64_t D, double *x) {
  const int64_t m = D % 3 == 0 ? D / 3 : D;
  float f[512];
  for (int64_t d = 0; d < D; ++d) f[d] = (float)x[d];
  for (int64_t h = 1; h < m; h *= 2)
    for (int64_t i = 0; i < D; ++i)
      if (i % (2 * h) < h) {
        const float a = f[i], b = f[i + h];
        f[i] = a + b;
        f[i + h] = a - b;
      }
  if (m != D)
    for (int64_t a = 0; a < m; ++a) {
      float u[3] = {f[a], f[m + a], f[2 * m + a]};
      const float s = (u[0] + u[1]) + u[2];
      for (int i = 0; i < 3; ++i) f[i * m + a] = (s + s) - ((u[i] + u[i]) + u[i]);
    }
  const float c = m == D ? (float)(1.0 / sqrt((double)D)) : (float)(1.0 / (3.0 * sqrt((double)m)));
  for (int64_t d = 0; d < D; ++d) x[d] = (double)(f[d] * c);
}

/* Doubles in the oracle's per-(sequence, KV head) row cache at most (256 MiB). */
#define REF_ROW_CACHE_ELEMS (32ull << 20)

int kva_reference_attention_rounded(const kva_tensor *q, const kva_kv_view *kv, const kva_attn_params *params,
                                    kva_tensor *out, kva_tensor *lse, unsigned flags, const kva_ref_rounding *r) {
  kva_clearerr();
  const kva_ref_rounding none = {0, KVA_F32, KVA_F32, KVA_F32};
  if (!r) r = &none;
  if (r->q_int_bits != 0 && (r->q_int_bits < 2 || r->q_int_bits > 24))
    return kva_seterr(KVA_EINVAL, "rounding->q_int_bits = %d: 0 (none) or 2..24", r->q_int_bits);
  if ((r->k_dtype != KVA_F32 && r->k_dtype != KVA_BF16 && r->k_dtype != KVA_F16) ||
      (r->v_dtype != KVA_F32 && r->v_dtype != KVA_BF16 && r->v_dtype != KVA_F16))
    return kva_seterr(KVA_EINVAL, "rounding->k_dtype / v_dtype: KVA_F32 (none), KVA_BF16 or KVA_F16");
  if (r->q_dtype != KVA_F32 && r->q_dtype != KVA_BF16 && r->q_dtype != KVA_F16)
    return kva_seterr(KVA_EINVAL, "rounding->q_dtype: KVA_F32 (none), KVA_BF16 or KVA_F16");
  if (!out) return kva_seterr(KVA_EINVAL, "out is NULL");
  kva_problem p; /* validation only: the call is checked as kva_attention checks it */
  int rc = kva_problem_init(&p, KVA_BACKEND_CPU, q, kv, params, out);
  if (rc < 0) return rc;
  ref_layout lo;
  memset(&lo, 0, sizeof lo);
  lo.view = kv;
  if (kv->layout == KVA_LAYOUT_PAGED && (rc = kva_paged_view_csr(kv->paged, &lo.csr)) < 0) return rc;
  lo.bs = kv->k.data.shape[2];
  if ((rc = kva_problem_set_lse(&p, lse, flags)) < 0) return rc;
  const kva_kv *K = &kv->k, *V = &kv->v;
  const int64_t B = q->shape[0], H = q->shape[1], L = q->shape[2], KVH = K->data.shape[1];
  const int64_t Dk = ref_dim(K), Dv = ref_dim(V), rep = H / KVH;
  const double scale = params->scale != 0.0f ? (double)params->scale : (double)(float)(1.0 / sqrt((double)Dk));
  int64_t maxlen = 1;
  for (int64_t b = 0; b < B; ++b)
    if (ref_len(&lo, b) > maxlen) maxlen = ref_len(&lo, b);
  const int64_t qgs = K->bits ? K->group_size : Dk; /* query rounding groups: K's quantization groups */
  const int rot_k = (params->flags & KVA_ATTN_ROTATED_K) != 0, rot_v = (params->flags & KVA_ATTN_ROTATED_V) != 0;
  /* a rotated query that the kernel rounds is formed as the kernel gets it (f32 arithmetic) */
  const int rot_q_f32 = rot_k && (r->q_dtype != KVA_F32 || r->q_int_bits > 0);
  double *s = (double *)malloc((size_t)maxlen * sizeof *s);
  double *o = (double *)malloc((size_t)Dv * sizeof *o);
  double *qr = (double *)malloc((size_t)Dk * sizeof *qr);
  double *hk_m = rot_k ? (double *)malloc((size_t)(Dk * Dk) * sizeof *hk_m) : NULL;
  double *hv_m = rot_v ? (double *)malloc((size_t)(Dv * Dv) * sizeof *hv_m) : NULL;
  double *rt = (double *)malloc((size_t)(Dk > Dv ? Dk : Dv) * sizeof *rt);
  unsigned char *vis = (unsigned char *)malloc((size_t)maxlen);
  if (!s || !o || !qr || !vis || !rt || (rot_k && !hk_m) || (rot_v && !hv_m)) {
    free(s); free(o); free(qr); free(vis); free(rt); free(hk_m); free(hv_m);
    return kva_seterr(KVA_ENOMEM, "oracle scratch for %lld keys", (long long)maxlen);
  }
  /* The rows of one (sequence, KV head), decoded and rounded as r says, once
   * for its rep * L query rows (the same values the per-element path gives);
   * without the memory for them, each element is decoded where it is used. */
  double *kc = NULL, *vc = NULL;
  if ((uint64_t)maxlen * (uint64_t)(Dk + Dv) <= REF_ROW_CACHE_ELEMS) {
    kc = (double *)malloc((size_t)(maxlen * Dk) * sizeof *kc);
    vc = (double *)malloc((size_t)(maxlen * Dv) * sizeof *vc);
    if (!kc || !vc) {
      free(kc); free(vc);
      kc = vc = NULL;
    }
  }
  if (rot_k) ref_hadamard_matrix(Dk, hk_m);
  if (rot_v) ref_hadamard_matrix(Dv, hv_m);
  for (int64_t b = 0; b < B; ++b) {
    int64_t len = ref_len(&lo, b);
    for (int64_t h = 0; h < H; ++h) {
      int64_t hk = h / rep;
      if (kc && h % rep == 0)
        for (int64_t j = 0; j < len; ++j) {
          const ref_row kr = ref_row_at(&lo, 0, b, hk, j), vr = ref_row_at(&lo, 1, b, hk, j);
          for (int64_t d = 0; d < Dk; ++d) kc[j * Dk + d] = ref_round_to(ref_kv_elem(K, kr.row, kr.sc, kr.bi, d), r->k_dtype);
          for (int64_t d = 0; d < Dv; ++d) vc[j * Dv + d] = ref_round_to(ref_kv_elem(V, vr.row, vr.sc, vr.bi, d), r->v_dtype);
        }
      for (int64_t i = 0; i < L; ++i) {
        ref_query_row(q, b, h, i, Dk, qr);
        if (rot_q_f32) ref_rotate_f32(Dk, qr);
        else if (rot_k) ref_rotate(hk_m, Dk, qr, rt);
        for (int64_t d = 0; d < Dk && r->q_dtype != KVA_F32; ++d) qr[d] = ref_round_to(qr[d], r->q_dtype);
        ref_query_int(qr, Dk, qgs, r->q_int_bits);
        double mx = -INFINITY;
        int any = 0;
        for (int64_t j = 0; j < len; ++j) {
          double add;
          vis[j] = (unsigned char)ref_visible(&params->mask, L, b, i, j, len, h, &add);
          if (!vis[j]) continue;
          double dot = 0.0;
          if (kc) {
            for (int64_t d = 0; d < Dk; ++d) dot += qr[d] * kc[j * Dk + d];
          } else {
            const ref_row kr = ref_row_at(&lo, 0, b, hk, j);
            for (int64_t d = 0; d < Dk; ++d)
              dot += qr[d] * ref_round_to(ref_kv_elem(K, kr.row, kr.sc, kr.bi, d), r->k_dtype);
          }
          double x = scale * dot;
          if (params->softcap > 0) x = (double)params->softcap * tanh(x / (double)params->softcap);
          x += add;
          if (x == -INFINITY) { vis[j] = 0; continue; }
          s[j] = x;
          any = 1;
          if (isnan(x)) mx = NAN;            /* NaN logits make the row NaN */
          else if (x > mx) mx = x;
        }
        double sink = params->sinks ? (double)params->sinks[h] : -INFINITY;
        for (int64_t d = 0; d < Dv; ++d) o[d] = 0.0;
        double row_lse = -INFINITY; /* log of the softmax denominator (sink included) */
        if (any) {
          if (sink > mx) mx = sink;
          double den = params->sinks ? exp(sink - mx) : 0.0;
          for (int64_t j = 0; j < len; ++j) {
            if (!vis[j]) continue;
            double e = exp(s[j] - mx);
            den += e;
            if (vc) {
              for (int64_t d = 0; d < Dv; ++d) o[d] += e * vc[j * Dv + d];
            } else {
              const ref_row vr = ref_row_at(&lo, 1, b, hk, j);
              for (int64_t d = 0; d < Dv; ++d)
                o[d] += e * ref_round_to(ref_kv_elem(V, vr.row, vr.sc, vr.bi, d), r->v_dtype);
            }
          }
          for (int64_t d = 0; d < Dv; ++d) o[d] /= den;
          row_lse = mx + log(den);
          if (rot_v) ref_rotate(hv_m, Dv, o, rt); /* out = H_Dv (P V') */
        }
        if (lse) {
          char *dst = (char *)lse->data + b * lse->stride[0] + h * lse->stride[1] + i * lse->stride[2];
          *(float *)dst = (float)(p.lse_base2 ? row_lse / 0.69314718055994530942 : row_lse);
        }
        for (int64_t d = 0; d < Dv; ++d) {
          char *dst = (char *)ref_at(out, b, h, i, d);
          const float f = (float)o[d]; /* one rounding to f32, then one to the output type */
          uint16_t u;
          switch (out->dtype) {
          case KVA_F32: memcpy(dst, &f, 4); break;
          case KVA_F16: u = ref_f16_of(f); memcpy(dst, &u, 2); break;
          default: u = ref_bf16_of(f); memcpy(dst, &u, 2); break;
          }
        }
      }
    }
  }
  free(s); free(o); free(qr); free(vis); free(rt); free(hk_m); free(hv_m); free(kc); free(vc);
  return 0;
}
