/* Sequence state over a block pool: create, append (convert or quantize on
 * write, or raw copy), fork (shared blocks, copy-on-write of a shared partial
 * last block at the next append), free, sliding-window trim, queries, and
 * kva_pool_from_contiguous. Every public call locks the pool; an error leaves
 * the state as it was (blocks are taken and rows written first, the tables
 * and refcounts change only once nothing can fail). */
#include "core/quant.h"
#include "paged/paged.h"

#include <stdlib.h>
#include <string.h>

/* Rows to append: float rows (converted or quantized on write) or rows in the
 * pool's format (copied). */
typedef struct append_src {
  const kva_tensor *kf, *vf; /* float [KVH, T, D], or NULL */
  const kva_kv *kr, *vr;     /* raw [1, KVH, T, D], or NULL */
  int64_t T;
} append_src;

/* ---- slots and ids */
static int32_t seq_id(const kva_pool *p, const kva_seq_state *q) {
  return (int32_t)(((int64_t)q->gen << KVA_SEQ_SLOT_BITS) | (int64_t)(q - p->seqs));
}

/* The oldest dead slot (reused, its table buffer kept) or a new one. */
static int alloc_slot(kva_pool *p, kva_seq_state **out) {
  int64_t slot;
  if (p->nfree_slots > 0) { /* oldest dead slot first: ids repeat as late as possible */
    slot = p->free_slots[p->free_slot_head];
    p->free_slot_head = (p->free_slot_head + 1) % p->slot_cap;
    p->nfree_slots--;
  } else {
    if (p->nslots == KVA_SEQ_MAX_SLOTS)
      return kva_seterr(KVA_ENOMEM, "too many live sequences (%d)", KVA_SEQ_MAX_SLOTS);
    if (p->nslots == p->slot_cap) {
      int64_t cap = p->slot_cap ? p->slot_cap * 2 : 16;
      if (cap > KVA_SEQ_MAX_SLOTS) cap = KVA_SEQ_MAX_SLOTS;
      kva_seq_state *ns = (kva_seq_state *)realloc(p->seqs, (size_t)cap * sizeof *ns);
      if (!ns) return kva_seterr(KVA_ENOMEM, "sequence table of %lld slots", (long long)cap);
      p->seqs = ns;
      int32_t *nf = (int32_t *)realloc(p->free_slots, (size_t)cap * sizeof *nf);
      if (!nf) return kva_seterr(KVA_ENOMEM, "sequence free list of %lld slots", (long long)cap);
      p->free_slots = nf;
      p->slot_cap = cap;
      p->free_slot_head = 0; /* the ring is empty here */
    }
    slot = p->nslots++;
    memset(&p->seqs[slot], 0, sizeof p->seqs[slot]);
  }
  kva_seq_state *q = &p->seqs[slot];
  q->gen = (uint16_t)(q->gen >= KVA_SEQ_GEN_MAX ? 1 : q->gen + 1);
  q->live = 1;
  q->nblocks = 0;
  q->len = 0;
  q->start = 0;
  q->first_offset = 0;
  p->live_seqs++;
  *out = q;
  return 0;
}

static void release_slot(kva_pool *p, kva_seq_state *q) {
  q->live = 0;
  q->nblocks = 0;
  p->free_slots[(p->free_slot_head + p->nfree_slots) % p->slot_cap] = (int32_t)(q - p->seqs);
  p->nfree_slots++;
  p->live_seqs--;
}

/* Grows q's table to hold n entries. */
static int reserve_table(kva_seq_state *q, int64_t n) {
  if (n <= q->cap) return 0;
  int64_t cap = q->cap ? q->cap : 4;
  while (cap < n) cap *= 2;
  int32_t *nb = (int32_t *)realloc(q->blocks, (size_t)cap * sizeof *nb);
  if (!nb) return kva_seterr(KVA_ENOMEM, "block table of %lld entries", (long long)cap);
  q->blocks = nb;
  q->cap = cap;
  return 0;
}

/* ---- writes */
/* [n, D] rows t0.. of KV head hk of a float [KVH, T, D] tensor. */
static kva_tensor float_rows(const kva_tensor *t, int64_t hk, int64_t t0, int64_t n) {
  kva_tensor r = kva_tensor_2d((char *)t->data + hk * t->stride[0] + t0 * t->stride[1], t->dtype, n, t->shape[2]);
  r.stride[0] = t->stride[1];
  return r;
}
/* [n, row] rows row0.. of head hk in block blk of one pool array. */
static kva_tensor pool_rows(const kva_tensor *a, int32_t blk, int64_t hk, int64_t row0, int64_t n) {
  kva_tensor r = kva_tensor_2d(kva_pool_row(a, blk, hk, row0), a->dtype, n, a->shape[3]);
  r.stride[0] = a->stride[2];
  return r;
}
/* Copies n rows of a raw [1, KVH, T, row] array into the pool array. */
static void copy_raw(const kva_tensor *src, const kva_tensor *dst, int32_t blk, int64_t hk, int64_t row0,
                     int64_t t0, int64_t n) {
  size_t bytes = (size_t)kva_pool_row_bytes(dst);
  for (int64_t i = 0; i < n; ++i)
    memcpy(kva_pool_row(dst, blk, hk, row0 + i), kva_at4(src, 0, hk, t0 + i, 0), bytes);
}

/* Writes tokens t0..t0+n of one operand into block blk at rows row0.. */
static int write_operand(const kva_pool *p, const kva_kv *pool_kv, const kva_tensor *f, const kva_kv *raw,
                         int32_t blk, int64_t row0, int64_t t0, int64_t n) {
  for (int64_t hk = 0; hk < p->desc.kv_heads; ++hk) {
    if (raw) {
      copy_raw(&raw->data, &pool_kv->data, blk, hk, row0, t0, n);
      if (pool_kv->bits || kva_kv_scaled(pool_kv)) /* fp8: a shared (stride 0) scale copied to each row */
        copy_raw(&raw->scales, &pool_kv->scales, blk, hk, row0, t0, n);
      if (pool_kv->bits) copy_raw(&raw->biases, &pool_kv->biases, blk, hk, row0, t0, n);
      continue;
    }
    kva_tensor src = float_rows(f, hk, t0, n);
    int rc = 0;
    if (kva_is_fp8(pool_kv->data.dtype)) { /* per row: scale amax / max_fp8, codes (as kva_cache_write) */
      for (int64_t i = 0; i < n; ++i) {
        const char *w = (const char *)src.data + i * src.stride[0];
        float *sp = (float *)kva_pool_row(&pool_kv->scales, blk, hk, row0 + i);
        *sp = kva_fp8_row_scale(w, src.dtype, src.shape[1], pool_kv->data.dtype);
        kva_fp8_quantize_row(w, src.dtype, src.shape[1], pool_kv->data.dtype, *sp,
                             (uint8_t *)kva_pool_row(&pool_kv->data, blk, hk, row0 + i));
      }
    } else if (pool_kv->bits) {
      kva_kv dst = *pool_kv;
      dst.data = pool_rows(&pool_kv->data, blk, hk, row0, n);
      dst.scales = pool_rows(&pool_kv->scales, blk, hk, row0, n);
      dst.biases = pool_rows(&pool_kv->biases, blk, hk, row0, n);
      rc = kva_quantize(&src, &dst);
    } else {
      kva_tensor dst = pool_rows(&pool_kv->data, blk, hk, row0, n);
      rc = kva_convert(&src, &dst);
    }
    if (rc < 0) return rc;
  }
  return 0;
}

/* The append itself; the caller holds the lock and validated the rows. */
static int append_locked(kva_pool *p, kva_seq_state *q, const append_src *s) {
  const int64_t bs = p->desc.block_size, T = s->T;
  const int64_t row = q->len ? q->first_offset + q->len : 0; /* next table row */
  const int64_t have = q->nblocks, total = kva_blocks_for(row + T, bs);
  const int cow = have > 0 && row % bs != 0 && p->seq_ref[q->blocks[have - 1]] > 1;
  const int64_t need = total - have + cow;
  if (need > p->nfree)
    return kva_seterr(KVA_ENOBLOCKS, "appending %lld tokens to sequence %d needs %lld free blocks%s, the pool has %lld",
                      (long long)T, seq_id(p, q), (long long)need, cow ? " (incl. 1 copy-on-write)" : "",
                      (long long)p->nfree);
  int rc = reserve_table(q, total);
  if (rc) return rc;
  int32_t cow_blk = -1;
  if (cow) {
    cow_blk = kva_pool_pop(p);
    kva_pool_copy_rows(p, cow_blk, q->blocks[have - 1], 0, row % bs);
  }
  for (int64_t i = have; i < total; ++i) q->blocks[i] = kva_pool_pop(p); /* not yet in the table */
  for (int64_t t = 0; t < T;) {
    int64_t r = row + t, slot = r / bs, off = r % bs;
    int64_t n = bs - off < T - t ? bs - off : T - t;
    int32_t blk = (cow && slot == have - 1) ? cow_blk : q->blocks[slot];
    rc = write_operand(p, &p->k, s->kf, s->kr, blk, off, t, n);
    if (!rc) rc = write_operand(p, &p->v, s->vf, s->vr, blk, off, t, n);
    if (rc) {
      /* Give the blocks back in reverse order of popping; rows written into
       * the tail of the old last block lie beyond its length: unseen. */
      for (int64_t i = total - 1; i >= have; --i) p->free_stack[p->nfree++] = q->blocks[i];
      if (cow) p->free_stack[p->nfree++] = cow_blk;
      return rc;
    }
    t += n;
  }
  if (cow) {
    int32_t old = q->blocks[have - 1];
    p->seq_ref[old]--;
    kva_pool_unref(p, old);
    q->blocks[have - 1] = cow_blk;
    p->ref[cow_blk] = p->seq_ref[cow_blk] = 1;
  }
  for (int64_t i = have; i < total; ++i) p->ref[q->blocks[i]] = p->seq_ref[q->blocks[i]] = 1;
  if (!q->len) q->first_offset = 0;
  q->nblocks = total;
  q->len += T;
  return 0;
}

/* ---- public */
int kva_seq_create(kva_pool *p, int32_t *seq) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  if (!seq) return kva_seterr(KVA_EINVAL, "seq (output pointer) is NULL");
  kva_pool_lock(p);
  kva_seq_state *q = NULL;
  int rc = alloc_slot(p, &q);
  if (!rc) *seq = seq_id(p, q);
  kva_pool_unlock(p);
  return rc;
}

static int check_float_rows(const kva_pool *p, const kva_tensor *t, const char *name, int64_t D) {
  int rc = kva_check_tensor(t, name, KVA_DT_FLOAT, 3, false);
  if (rc) return rc;
  if (t->shape[0] != p->desc.kv_heads || t->shape[2] != D)
    return kva_seterr(KVA_ESHAPE, "%s must be [KVH, T, D] = [%lld, T, %lld], got [%lld, %lld, %lld]", name,
                      (long long)p->desc.kv_heads, (long long)D, (long long)t->shape[0], (long long)t->shape[1],
                      (long long)t->shape[2]);
  return 0;
}

int kva_seq_append(kva_pool *p, int32_t seq, const kva_tensor *k, const kva_tensor *v) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  int rc = check_float_rows(p, k, "k", p->desc.dk);
  if (!rc) rc = check_float_rows(p, v, "v", p->desc.dv);
  if (rc) return rc;
  if (k->shape[1] != v->shape[1])
    return kva_seterr(KVA_ESHAPE, "k has %lld tokens, v has %lld", (long long)k->shape[1], (long long)v->shape[1]);
  append_src s = {k, v, NULL, NULL, k->shape[1]};
  kva_pool_lock(p);
  kva_seq_state *q = kva_pool_seq(p, seq, "seq");
  rc = q ? append_locked(p, q, &s) : KVA_ENOSEQ;
  kva_pool_unlock(p);
  return rc;
}

static int check_raw_rows(const kva_pool *p, const kva_kv *kv, const kva_kv *pool_kv, const char *name) {
  int64_t D;
  int rc = kva_check_kv(kv, name, &D);
  if (rc) return rc;
  if (kv->data.shape[0] != 1 || kv->data.shape[1] != p->desc.kv_heads || D != kva_kv_dim(pool_kv))
    return kva_seterr(KVA_ESHAPE, "%s must be [1, KVH, T, D] = [1, %lld, T, %lld], got [%lld, %lld, %lld, D=%lld]",
                      name, (long long)p->desc.kv_heads, (long long)kva_kv_dim(pool_kv),
                      (long long)kv->data.shape[0], (long long)kv->data.shape[1], (long long)kv->data.shape[2],
                      (long long)D);
  if (!kva_pool_same_format(kv, pool_kv))
    return kva_seterr(KVA_EDTYPE, "%s: mismatched pool formats: rows are %d-bit %s (group %d), the pool is %d-bit %s (group %d)",
                      name, kv->bits, kva_dtype_name(kv->bits ? kv->scales.dtype : kv->data.dtype),
                      kv->bits ? kv->group_size : 0, p->desc.bits, kva_dtype_name(p->desc.dtype),
                      p->desc.bits ? p->desc.group_size : 0);
  return 0;
}

int kva_seq_append_raw(kva_pool *p, int32_t seq, const kva_kv *k, const kva_kv *v) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  int rc = check_raw_rows(p, k, &p->k, "k");
  if (!rc) rc = check_raw_rows(p, v, &p->v, "v");
  if (rc) return rc;
  if (k->data.shape[2] != v->data.shape[2])
    return kva_seterr(KVA_ESHAPE, "k has %lld tokens, v has %lld", (long long)k->data.shape[2],
                      (long long)v->data.shape[2]);
  append_src s = {NULL, NULL, k, v, k->data.shape[2]};
  kva_pool_lock(p);
  kva_seq_state *q = kva_pool_seq(p, seq, "seq");
  rc = q ? append_locked(p, q, &s) : KVA_ENOSEQ;
  kva_pool_unlock(p);
  return rc;
}

int kva_seq_fork(kva_pool *p, int32_t parent, int32_t *child) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  if (!child) return kva_seterr(KVA_EINVAL, "child (output pointer) is NULL");
  kva_pool_lock(p);
  int rc = 0;
  kva_seq_state *par = kva_pool_seq(p, parent, "parent");
  int64_t pi = par ? par - p->seqs : -1; /* alloc_slot may move p->seqs */
  kva_seq_state *c = NULL;
  if (!par) rc = KVA_ENOSEQ;
  for (int64_t i = 0; !rc && i < par->nblocks; ++i) /* a table names each block once */
    if (p->ref[par->blocks[i]] == INT32_MAX)
      rc = kva_seterr(KVA_EUNSUPPORTED, "parent's block %d has %d references: too many references", par->blocks[i],
                      INT32_MAX);
  if (!rc) rc = alloc_slot(p, &c);
  if (!rc) {
    par = &p->seqs[pi];
    rc = reserve_table(c, par->nblocks);
    if (rc) release_slot(p, c);
  }
  if (!rc) {
    if (par->nblocks) memcpy(c->blocks, par->blocks, (size_t)par->nblocks * sizeof *c->blocks);
    c->nblocks = par->nblocks;
    c->len = par->len;
    c->start = par->start;
    c->first_offset = par->first_offset;
    for (int64_t i = 0; i < c->nblocks; ++i) {
      p->ref[c->blocks[i]]++;
      p->seq_ref[c->blocks[i]]++;
    }
    *child = seq_id(p, c);
  }
  kva_pool_unlock(p);
  return rc;
}

int kva_seq_free(kva_pool *p, int32_t seq) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  kva_pool_lock(p);
  kva_seq_state *q = kva_pool_seq(p, seq, "seq");
  if (q) {
    for (int64_t i = 0; i < q->nblocks; ++i) {
      p->seq_ref[q->blocks[i]]--;
      kva_pool_unref(p, q->blocks[i]);
    }
    release_slot(p, q);
  }
  kva_pool_unlock(p);
  return q ? 0 : KVA_ENOSEQ;
}

int kva_seq_trim(kva_pool *p, int32_t seq, int64_t keep_last) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  if (keep_last < 0) return kva_seterr(KVA_EINVAL, "keep_last = %lld must be >= 0", (long long)keep_last);
  kva_pool_lock(p);
  kva_seq_state *q = kva_pool_seq(p, seq, "seq");
  if (q && keep_last < q->len) {
    const int64_t bs = p->desc.block_size, dropped = q->len - keep_last;
    const int64_t row0 = q->first_offset + dropped; /* table row of the new first token */
    const int64_t drop = keep_last ? row0 / bs : q->nblocks;
    for (int64_t i = 0; i < drop; ++i) {
      p->seq_ref[q->blocks[i]]--;
      kva_pool_unref(p, q->blocks[i]);
    }
    memmove(q->blocks, q->blocks + drop, (size_t)(q->nblocks - drop) * sizeof *q->blocks);
    q->nblocks -= drop;
    q->first_offset = keep_last ? (int32_t)(row0 % bs) : 0;
    q->len = keep_last;
    q->start += dropped;
  }
  kva_pool_unlock(p);
  return q ? 0 : KVA_ENOSEQ;
}

/* Which field kva_seq_len/start/blocks reads. */
enum seq_field { SEQ_LEN, SEQ_START, SEQ_BLOCKS };

static int64_t seq_query(kva_pool *p, int32_t seq, enum seq_field f) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  kva_pool_lock(p);
  kva_seq_state *q = kva_pool_seq(p, seq, "seq");
  int64_t r = !q ? KVA_ENOSEQ : f == SEQ_LEN ? q->len : f == SEQ_START ? q->start : q->nblocks;
  kva_pool_unlock(p);
  return r;
}

int64_t kva_seq_len(kva_pool *p, int32_t seq) { return seq_query(p, seq, SEQ_LEN); }
int64_t kva_seq_start(kva_pool *p, int32_t seq) { return seq_query(p, seq, SEQ_START); }
int64_t kva_seq_blocks(kva_pool *p, int32_t seq) { return seq_query(p, seq, SEQ_BLOCKS); }

/* ---- building a pool from a contiguous cache */
/* Batch entry b, tokens [0, len) of a contiguous operand, as [1, KVH, len, D]. */
static kva_kv batch_slice(const kva_kv *kv, int64_t b, int64_t len) {
  kva_kv s = *kv;
  kva_tensor *ts[3] = {&s.data, &s.scales, &s.biases};
  for (int i = 0; i < (kv->bits ? 3 : kva_kv_scaled(kv) ? 2 : 1); ++i) {
    ts[i]->data = (char *)ts[i]->data + b * ts[i]->stride[0];
    ts[i]->shape[0] = 1;
    ts[i]->shape[2] = len;
  }
  return s;
}

int kva_pool_from_contiguous(kva_pool **out, const kva_kv_view *c, int64_t block_size, int64_t spare_blocks,
                             uint64_t shuffle_seed, int32_t *seqs) {
  kva_clearerr();
  if (!out) return kva_seterr(KVA_EINVAL, "pool (output pointer) is NULL");
  if (!c) return kva_seterr(KVA_EINVAL, "contig is NULL");
  if (!seqs) return kva_seterr(KVA_EINVAL, "seqs (output array) is NULL");
  if (c->layout != KVA_LAYOUT_CONTIGUOUS) return kva_seterr(KVA_EINVAL, "contig.layout must be KVA_LAYOUT_CONTIGUOUS");
  if (spare_blocks < 0) return kva_seterr(KVA_EINVAL, "spare_blocks = %lld must be >= 0", (long long)spare_blocks);
  int64_t Dk, Dv;
  int rc = kva_check_kv(&c->k, "contig.k", &Dk);
  if (!rc) rc = kva_check_kv(&c->v, "contig.v", &Dv);
  if (rc) return rc;
  const int64_t B = c->k.data.shape[0], KVH = c->k.data.shape[1], N = c->k.data.shape[2];
  for (int d = 0; d < 3; ++d)
    if (c->v.data.shape[d] != c->k.data.shape[d])
      return kva_seterr(KVA_ESHAPE, "contig.v.shape[%d] = %lld != contig.k.shape[%d] = %lld", d,
                        (long long)c->v.data.shape[d], d, (long long)c->k.data.shape[d]);
  kva_dtype kdt = c->k.bits ? c->k.scales.dtype : c->k.data.dtype;
  kva_dtype vdt = c->v.bits ? c->v.scales.dtype : c->v.data.dtype;
  if (c->k.bits != c->v.bits || kdt != vdt || (c->k.bits && c->k.group_size != c->v.group_size))
    return kva_seterr(KVA_EDTYPE, "contig: mismatched pool formats: K is %d-bit %s, V is %d-bit %s (one pool holds one format)",
                      c->k.bits, kva_dtype_name(kdt), c->v.bits, kva_dtype_name(vdt));
  if (block_size < KVA_BLOCK_SIZE_MIN || block_size > KVA_BLOCK_SIZE_MAX)
    return kva_seterr(KVA_EINVAL, "block_size = %lld must be in [%d, %d]", (long long)block_size,
                      KVA_BLOCK_SIZE_MIN, KVA_BLOCK_SIZE_MAX);
  if ((uintptr_t)c->seq_lens % sizeof(int32_t))
    return kva_seterr(KVA_EINVAL, "contig.seq_lens = %p is not 4-byte aligned (i32 elements)", (const void *)c->seq_lens);
  int64_t blocks = spare_blocks;
  bool ok = true;
  for (int64_t b = 0; b < B; ++b) {
    int64_t len = c->seq_lens ? c->seq_lens[b] : N;
    if (len < 1 || len > N)
      return kva_seterr(KVA_ESHAPE, "contig.seq_lens[%lld] = %lld must be in [1, N = %lld]", (long long)b,
                        (long long)len, (long long)N);
    blocks = kva_add_chk(blocks, kva_blocks_for(len, block_size), &ok);
  }
  if (!ok)
    return kva_seterr(KVA_EINVAL, "spare_blocks = %lld: with the sequences' blocks the pool would have more than "
                      "2^63 blocks", (long long)spare_blocks);
  kva_pool_desc d = {.num_blocks = blocks, .block_size = block_size, .kv_heads = KVH, .dk = Dk, .dv = Dv,
                     .dtype = kdt, .bits = c->k.bits, .group_size = c->k.bits ? c->k.group_size : 0};
  kva_pool *p;
  if ((rc = kva_pool_create(&p, &d, NULL))) return rc;
  if (shuffle_seed) kva_pool_shuffle(p, shuffle_seed);
  for (int64_t b = 0; b < B && !rc; ++b) {
    int64_t len = c->seq_lens ? c->seq_lens[b] : N;
    kva_kv ks = batch_slice(&c->k, b, len), vs = batch_slice(&c->v, b, len);
    rc = kva_seq_create(p, &seqs[b]);
    if (!rc) rc = kva_seq_append_raw(p, seqs[b], &ks, &vs);
  }
  if (rc) {
    kva_pool_destroy(p);
    return rc;
  }
  *out = p;
  return 0;
}
