/* Paged KV block pool: memory layout and sizes, creation and destruction,
 * the refcounted free list, caller reservations, statistics and a full
 * invariant check (kva_pool_check). Block memory is K, V[, K scales, K biases,
 * V scales, V biases], each array [num_blocks, KVH, block_size, row] and
 * KVA_POOL_ALIGN-aligned. Metadata (refcounts, free list, tables) is malloc'd
 * here, never in the attention path. */
#include "paged/paged.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* The six arrays of a pool, in memory order. */
enum { ARR_K, ARR_V, ARR_KS, ARR_KB, ARR_VS, ARR_VB, ARR_COUNT };

static size_t align_up(size_t x) { return (x + KVA_POOL_ALIGN - 1) / KVA_POOL_ALIGN * KVA_POOL_ALIGN; }

static int check_desc(const kva_pool_desc *d) {
  if (!d) return kva_seterr(KVA_EINVAL, "desc is NULL");
  if (d->num_blocks < 1 || d->num_blocks > INT32_MAX)
    return kva_seterr(KVA_EINVAL, "desc.num_blocks = %lld must be in [1, %d]", (long long)d->num_blocks,
                      INT32_MAX);
  if (d->block_size < KVA_BLOCK_SIZE_MIN || d->block_size > KVA_BLOCK_SIZE_MAX)
    return kva_seterr(KVA_EINVAL, "desc.block_size = %lld must be in [%d, %d]", (long long)d->block_size,
                      KVA_BLOCK_SIZE_MIN, KVA_BLOCK_SIZE_MAX);
  if (d->kv_heads < 1) return kva_seterr(KVA_EINVAL, "desc.kv_heads = %lld must be >= 1", (long long)d->kv_heads);
  if (d->dk < 1 || d->dv < 1)
    return kva_seterr(KVA_EINVAL, "desc.dk = %lld / desc.dv = %lld must be >= 1", (long long)d->dk,
                      (long long)d->dv);
  if (!kva_is_float(d->dtype) && !(d->bits == 0 && kva_is_fp8(d->dtype)))
    return kva_seterr(KVA_EDTYPE, "desc.dtype = %s must be f32, f16 or bf16 (or f8e4m3 / f8e5m2 with bits 0)",
                      kva_dtype_name(d->dtype));
  if (d->bits == 0) return 0;
  if (d->bits != 2 && d->bits != 4 && d->bits != 8)
    return kva_seterr(KVA_EUNSUPPORTED, "desc.bits = %d (supported: 0 = float, 2, 4, 8)", d->bits);
  if (d->group_size != 32 && d->group_size != 64 && d->group_size != 128)
    return kva_seterr(KVA_EUNSUPPORTED, "desc.group_size = %d (supported: 32, 64, 128)", d->group_size);
  if (d->dk % d->group_size || d->dv % d->group_size)
    return kva_seterr(KVA_ESHAPE, "desc.dk = %lld and desc.dv = %lld must be multiples of group_size %d",
                      (long long)d->dk, (long long)d->dv, d->group_size);
  return 0;
}

/* Elements per row and element dtype of array a (fp8 pools: one f32 scale
 * per (token, head) in the scale arrays, no biases). */
static void array_row(const kva_pool_desc *d, int a, int64_t *elems, kva_dtype *dt) {
  int64_t D = (a == ARR_K || a == ARR_KS || a == ARR_KB) ? d->dk : d->dv;
  if (a == ARR_K || a == ARR_V) {
    *elems = d->bits ? kva_packed_words(D, d->bits) : D;
    *dt = d->bits ? KVA_U32 : d->dtype;
  } else if (!d->bits && kva_is_fp8(d->dtype)) {
    *elems = a == ARR_KS || a == ARR_VS ? 1 : 0;
    *dt = KVA_F32;
  } else {
    *elems = d->bits ? D / d->group_size : 0;
    *dt = d->dtype;
  }
}

/* Byte offsets of the arrays and the total; desc already checked. Fails on overflow. */
static int layout(const kva_pool_desc *d, size_t off[ARR_COUNT], size_t *total) {
  size_t pos = 0;
  double approx = 0.0; /* the arrays so far, in bytes: all of them must fit size_t */
  for (int a = 0; a < ARR_COUNT; ++a) {
    int64_t elems;
    kva_dtype dt;
    array_row(d, a, &elems, &dt);
    approx += (double)d->num_blocks * (double)d->kv_heads * (double)d->block_size * (double)elems *
              (double)kva_dtype_size(dt);
    if (approx > (double)(SIZE_MAX / 4))
      return kva_seterr(KVA_EINVAL, "desc: pool of %.3g bytes or more is too large", approx);
    off[a] = pos;
    pos = align_up(pos + (size_t)d->num_blocks * (size_t)d->kv_heads * (size_t)d->block_size *
                             (size_t)elems * kva_dtype_size(dt));
  }
  *total = pos;
  return 0;
}

int kva_pool_memory_size(const kva_pool_desc *desc, size_t *bytes) {
  kva_clearerr();
  int rc = check_desc(desc);
  if (rc) return rc;
  if (!bytes) return kva_seterr(KVA_EINVAL, "bytes (output pointer) is NULL");
  size_t off[ARR_COUNT];
  return layout(desc, off, bytes);
}

static kva_tensor array_tensor(const kva_pool_desc *d, char *mem, const size_t off[ARR_COUNT], int a) {
  int64_t elems;
  kva_dtype dt;
  array_row(d, a, &elems, &dt);
  return kva_tensor_4d(mem + off[a], dt, d->num_blocks, d->kv_heads, d->block_size, elems);
}

/* Block memory owned by the pool: large pools get 2 MiB alignment and the
 * advice to back them with huge pages, since a batch's blocks are scattered
 * over the whole pool (one TLB entry per 2 MiB instead of per 4 KiB). */
#define POOL_HUGE_PAGE ((size_t)2 << 20)
static void *pool_alloc(size_t bytes) {
  if (bytes < POOL_HUGE_PAGE) return aligned_alloc(KVA_POOL_ALIGN, (bytes + KVA_POOL_ALIGN - 1) / KVA_POOL_ALIGN * KVA_POOL_ALIGN);
  const size_t rounded = (bytes + POOL_HUGE_PAGE - 1) / POOL_HUGE_PAGE * POOL_HUGE_PAGE;
  void *m = aligned_alloc(POOL_HUGE_PAGE, rounded);
#ifdef MADV_HUGEPAGE
  if (m) madvise(m, rounded, MADV_HUGEPAGE); /* advice: failure is harmless */
#endif
  return m;
}

int kva_pool_create(kva_pool **out, const kva_pool_desc *desc, void *memory) {
  kva_clearerr();
  if (!out) return kva_seterr(KVA_EINVAL, "pool (output pointer) is NULL");
  int rc = check_desc(desc);
  if (rc) return rc;
  size_t off[ARR_COUNT], total;
  if ((rc = layout(desc, off, &total))) return rc;
  if (memory && (uintptr_t)memory % KVA_POOL_ALIGN)
    return kva_seterr(KVA_EINVAL, "memory %p is not %d-byte aligned", memory, KVA_POOL_ALIGN);
  kva_pool *p = (kva_pool *)calloc(1, sizeof *p);
  size_t nb = (size_t)desc->num_blocks;
  if (p && pthread_mutex_init(&p->mu, NULL)) {
    free(p);
    p = NULL;
  }
  if (p) {
    p->ref = (int32_t *)calloc(nb, sizeof *p->ref);
    p->seq_ref = (int32_t *)calloc(nb, sizeof *p->seq_ref);
    p->reserved = (uint8_t *)calloc(nb, 1);
    p->free_stack = (int32_t *)malloc(nb * sizeof *p->free_stack);
    p->mem = memory ? memory : pool_alloc(total);
    p->own_mem = memory == NULL;
  }
  if (!p || !p->ref || !p->seq_ref || !p->reserved || !p->free_stack || !p->mem) {
    if (p) kva_pool_free_all(p);
    return kva_seterr(KVA_ENOMEM, "pool of %lld blocks (%zu bytes of block memory)",
                      (long long)desc->num_blocks, total);
  }
  p->desc = *desc;
  memset(&p->k, 0, sizeof p->k);
  memset(&p->v, 0, sizeof p->v);
  p->k.data = array_tensor(desc, p->mem, off, ARR_K);
  p->v.data = array_tensor(desc, p->mem, off, ARR_V);
  if (desc->bits) {
    p->k.scales = array_tensor(desc, p->mem, off, ARR_KS);
    p->k.biases = array_tensor(desc, p->mem, off, ARR_KB);
    p->v.scales = array_tensor(desc, p->mem, off, ARR_VS);
    p->v.biases = array_tensor(desc, p->mem, off, ARR_VB);
    p->k.bits = p->v.bits = desc->bits;
    p->k.group_size = p->v.group_size = desc->group_size;
  } else if (kva_is_fp8(desc->dtype)) { /* per-(token, head) scales, computed on append */
    p->k.scales = array_tensor(desc, p->mem, off, ARR_KS);
    p->v.scales = array_tensor(desc, p->mem, off, ARR_VS);
  }
  /* Block 0 is popped first: a fresh pool hands out blocks in order. */
  for (size_t i = 0; i < nb; ++i) p->free_stack[i] = (int32_t)(nb - 1 - i);
  p->nfree = (int64_t)nb;
  *out = p;
  return 0;
}

void kva_pool_free_all(kva_pool *p) {
  for (struct kva_paged_view *v = p->spare_views, *next; v; v = next) {
    next = v->next;
    free(v);
  }
  if (p->seqs)
    for (int64_t s = 0; s < p->nslots; ++s) free(p->seqs[s].blocks);
  free(p->seqs);
  free(p->free_slots);
  free(p->ref);
  free(p->seq_ref);
  free(p->reserved);
  free(p->free_stack);
  if (p->own_mem) free(p->mem);
  pthread_mutex_destroy(&p->mu);
  free(p);
}

void kva_pool_destroy(kva_pool *p) {
  if (!p) return;
  kva_pool_lock(p);
  /* Sequences and reservations go now; blocks still held by views stay. */
  for (int64_t s = 0; s < p->nslots; ++s) {
    kva_seq_state *q = &p->seqs[s];
    if (!q->live) continue;
    for (int64_t i = 0; i < q->nblocks; ++i) {
      p->seq_ref[q->blocks[i]]--;
      kva_pool_unref(p, q->blocks[i]);
    }
    q->live = 0;
    q->nblocks = 0;
  }
  p->live_seqs = 0;
  for (int64_t b = 0; b < p->desc.num_blocks; ++b)
    if (p->reserved[b]) {
      p->reserved[b] = 0;
      kva_pool_unref(p, (int32_t)b);
    }
  p->destroyed = 1;
  int last = p->live_views == 0;
  kva_pool_unlock(p);
  if (last) kva_pool_free_all(p);
}

kva_pool_desc kva_pool_get_desc(const kva_pool *p) {
  kva_pool_desc d;
  memset(&d, 0, sizeof d);
  if (p) d = p->desc;
  return d;
}

kva_kv kva_pool_k(const kva_pool *p) {
  kva_kv kv;
  memset(&kv, 0, sizeof kv);
  if (p) kv = p->k;
  return kv;
}

kva_kv kva_pool_v(const kva_pool *p) {
  kva_kv kv;
  memset(&kv, 0, sizeof kv);
  if (p) kv = p->v;
  return kv;
}

int kva_pool_same_format(const kva_kv *a, const kva_kv *b) {
  if (a->bits != b->bits || a->data.dtype != b->data.dtype) return 0;
  if (a->data.shape[3] != b->data.shape[3]) return 0;
  if (!a->bits) return kva_kv_scaled(a) == kva_kv_scaled(b); /* fp8: both with scales or both without */
  return a->group_size == b->group_size && a->scales.dtype == b->scales.dtype &&
         a->biases.dtype == b->biases.dtype;
}

void kva_pool_copy_rows(kva_pool *p, int32_t dst, int32_t src, int64_t r0, int64_t n) {
  const kva_tensor *arrs[ARR_COUNT] = {&p->k.data, &p->v.data, &p->k.scales, &p->k.biases,
                                       &p->v.scales, &p->v.biases};
  int narr = p->desc.bits || kva_is_fp8(p->desc.dtype) ? ARR_COUNT : ARR_KS;
  for (int a = 0; a < narr; ++a)
    for (int64_t hk = 0; hk < p->desc.kv_heads && arrs[a]->data; ++hk) /* (fp8: no biases) */
      memcpy(kva_pool_row(arrs[a], dst, hk, r0), kva_pool_row(arrs[a], src, hk, r0),
             (size_t)(n * kva_pool_row_bytes(arrs[a])));
}

kva_seq_state *kva_pool_seq_find(kva_pool *p, int32_t id) {
  int64_t slot = id & (KVA_SEQ_MAX_SLOTS - 1), gen = (int64_t)id >> KVA_SEQ_SLOT_BITS;
  if (id < 0 || slot >= p->nslots || !p->seqs[slot].live || p->seqs[slot].gen != gen) return NULL;
  return &p->seqs[slot];
}

kva_seq_state *kva_pool_seq(kva_pool *p, int32_t id, const char *what) {
  kva_seq_state *q = kva_pool_seq_find(p, id);
  if (!q) kva_seterr(KVA_ENOSEQ, "%s = %d is not a live sequence of this pool (unknown or freed)", what, id);
  return q;
}

int kva_pool_stats_get(kva_pool *p, kva_pool_stats *st) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  if (!st) return kva_seterr(KVA_EINVAL, "stats (output pointer) is NULL");
  kva_pool_lock(p);
  st->free_blocks = p->nfree;
  st->used_blocks = p->desc.num_blocks - p->nfree;
  st->sequences = p->live_seqs;
  st->views = p->live_views;
  kva_pool_unlock(p);
  return 0;
}

int kva_pool_block_refs(kva_pool *p, int32_t block, int32_t *refs) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  if (!refs) return kva_seterr(KVA_EINVAL, "refs (output pointer) is NULL");
  if (block < 0 || block >= p->desc.num_blocks)
    return kva_seterr(KVA_EINVAL, "block = %d is out of range [0, %lld)", block, (long long)p->desc.num_blocks);
  kva_pool_lock(p);
  *refs = p->ref[block];
  kva_pool_unlock(p);
  return 0;
}

/* The invariant check; the caller holds the lock. cnt/scnt: scratch [num_blocks]. */
static int check_locked(kva_pool *p, int32_t *cnt, int32_t *scnt) {
  const int64_t nb = p->desc.num_blocks, bs = p->desc.block_size;
  int64_t live = 0;
  for (int64_t s = 0; s < p->nslots; ++s) {
    const kva_seq_state *q = &p->seqs[s];
    if (!q->live) continue;
    live++;
    int32_t id = (int32_t)(((int64_t)q->gen << KVA_SEQ_SLOT_BITS) | s);
    int64_t want = q->len ? kva_blocks_for(q->first_offset + q->len, bs) : 0;
    if (q->nblocks != want || q->first_offset < 0 || q->first_offset >= bs || (q->len == 0 && q->first_offset) ||
        q->nblocks > q->cap)
      return kva_seterr(KVA_EINTERNAL, "sequence %d: %lld blocks for len %lld first_offset %d (want %lld)", id,
                        (long long)q->nblocks, (long long)q->len, q->first_offset, (long long)want);
    for (int64_t i = 0; i < q->nblocks; ++i) {
      int32_t b = q->blocks[i];
      if (b < 0 || b >= nb) return kva_seterr(KVA_EINTERNAL, "sequence %d: block %d out of range", id, b);
      cnt[b]++;
      scnt[b]++;
    }
  }
  if (live != p->live_seqs)
    return kva_seterr(KVA_EINTERNAL, "%lld live sequences counted, %lld recorded", (long long)live,
                      (long long)p->live_seqs);
  int64_t nviews = 0;
  for (const struct kva_paged_view *v = p->views; v; v = v->next) {
    nviews++;
    for (int32_t i = 0; i < v->indptr[v->B]; ++i) cnt[v->indices[i]]++;
  }
  if (nviews != p->live_views)
    return kva_seterr(KVA_EINTERNAL, "%lld live views listed, %lld recorded", (long long)nviews,
                      (long long)p->live_views);
  for (int64_t b = 0; b < nb; ++b) {
    if (p->reserved[b] > 1) return kva_seterr(KVA_EINTERNAL, "block %lld reserved %d times", (long long)b, p->reserved[b]);
    cnt[b] += p->reserved[b];
    if (cnt[b] != p->ref[b] || scnt[b] != p->seq_ref[b])
      return kva_seterr(KVA_EINTERNAL, "block %lld: refcount %d (sequences %d), recounted %d (sequences %d)",
                        (long long)b, p->ref[b], p->seq_ref[b], cnt[b], scnt[b]);
  }
  if (p->nfree < 0 || p->nfree > nb) return kva_seterr(KVA_EINTERNAL, "nfree = %lld", (long long)p->nfree);
  for (int64_t i = 0; i < p->nfree; ++i) {
    int32_t b = p->free_stack[i];
    if (b < 0 || b >= nb) return kva_seterr(KVA_EINTERNAL, "free list entry %d out of range", b);
    if (p->ref[b] != 0) return kva_seterr(KVA_EINTERNAL, "block %d is on the free list with %d references", b, p->ref[b]);
    if (cnt[b] == -1) return kva_seterr(KVA_EINTERNAL, "block %d is on the free list twice", b);
    cnt[b] = -1;
  }
  for (int64_t b = 0; b < nb; ++b)
    if (p->ref[b] == 0 && cnt[b] != -1)
      return kva_seterr(KVA_EINTERNAL, "block %lld has no reference and is not on the free list (leak)", (long long)b);
  return 0;
}

int kva_pool_check(kva_pool *p) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  int32_t *cnt = (int32_t *)calloc((size_t)p->desc.num_blocks, sizeof *cnt);
  int32_t *scnt = (int32_t *)calloc((size_t)p->desc.num_blocks, sizeof *scnt);
  if (!cnt || !scnt) {
    free(cnt);
    free(scnt);
    return kva_seterr(KVA_ENOMEM, "kva_pool_check scratch");
  }
  kva_pool_lock(p);
  int rc = check_locked(p, cnt, scnt);
  kva_pool_unlock(p);
  free(cnt);
  free(scnt);
  return rc;
}

/* splitmix64: the free-list shuffle. */
static uint64_t mix64(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

int kva_pool_shuffle(kva_pool *p, uint64_t seed) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  kva_pool_lock(p);
  uint64_t st = seed;
  for (int64_t i = p->nfree - 1; i > 0; --i) { /* Fisher-Yates */
    int64_t j = (int64_t)(mix64(&st) % (uint64_t)(i + 1));
    int32_t t = p->free_stack[i];
    p->free_stack[i] = p->free_stack[j];
    p->free_stack[j] = t;
  }
  kva_pool_unlock(p);
  return 0;
}

int kva_pool_reserve(kva_pool *p, int64_t n, int32_t *blocks) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  if (n < 0) return kva_seterr(KVA_EINVAL, "n = %lld must be >= 0", (long long)n);
  if (n > 0 && !blocks) return kva_seterr(KVA_EINVAL, "blocks (output array) is NULL");
  kva_pool_lock(p);
  int rc = 0;
  if (n > p->nfree) {
    rc = kva_seterr(KVA_ENOBLOCKS, "kva_pool_reserve of %lld blocks: only %lld free", (long long)n,
                    (long long)p->nfree);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      int32_t b = kva_pool_pop(p);
      p->ref[b] = 1;
      p->reserved[b] = 1;
      blocks[i] = b;
    }
  }
  kva_pool_unlock(p);
  return rc;
}

int kva_pool_unreserve(kva_pool *p, int64_t n, const int32_t *blocks) {
  kva_clearerr();
  if (!p) return kva_seterr(KVA_EINVAL, "pool is NULL");
  if (n < 0) return kva_seterr(KVA_EINVAL, "n = %lld must be >= 0", (long long)n);
  if (n > 0 && !blocks) return kva_seterr(KVA_EINVAL, "blocks is NULL");
  kva_pool_lock(p);
  /* Validate everything first (marking seen blocks 2 to catch repeats), then commit. */
  int rc = 0;
  int64_t i = 0;
  for (; i < n; ++i) {
    int32_t b = blocks[i];
    if (b < 0 || b >= p->desc.num_blocks) {
      rc = kva_seterr(KVA_EINVAL, "blocks[%lld] = %d is out of range [0, %lld)", (long long)i, b,
                      (long long)p->desc.num_blocks);
      break;
    }
    if (p->reserved[b] != 1) {
      rc = kva_seterr(KVA_EINVAL, "blocks[%lld] = %d is not reserved%s", (long long)i, b,
                      p->reserved[b] == 2 ? " (repeated)" : "");
      break;
    }
    p->reserved[b] = 2;
  }
  for (int64_t j = 0; j < i; ++j) p->reserved[blocks[j]] = 1;
  if (!rc)
    for (i = 0; i < n; ++i) {
      p->reserved[blocks[i]] = 0;
      kva_pool_unref(p, blocks[i]);
    }
  kva_pool_unlock(p);
  return rc;
}
