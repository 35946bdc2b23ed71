/* Paged KV cache internals: the block pool, sequence state and the immutable
 * CSR views (src/paged/), and the block-table layout over caller pools.
 * Private to the library: the CPU driver and the oracle read views through
 * kva_source_paged / kva_source_block_table (src/paged/source.h) and validate
 * them with kva_paged_view_check / kva_block_table_check (+ _len).
 *
 * Token addressing: a sequence's tokens are the rows first_offset ..
 * first_offset+len-1 of its block table read as one long array; table row r
 * lives in block table[r / block_size] at row r % block_size. */
#ifndef KVA_PAGED_H
#define KVA_PAGED_H

#include "core/internal.h"

#include <pthread.h>

/* Sequence ids: slot in the low bits, a generation above (never 0). Dead
 * slots are reused oldest first, so a freed id stays invalid until its slot
 * was reused KVA_SEQ_GEN_MAX times. */
#define KVA_SEQ_SLOT_BITS 18
#define KVA_SEQ_MAX_SLOTS (1 << KVA_SEQ_SLOT_BITS)
#define KVA_SEQ_GEN_MAX 8191
#define KVA_PAGED_VIEW_MAGIC 0x6b766176u /* "kvav": a live view */

typedef struct kva_seq_state {
  int32_t *blocks;      /* [cap] block table; the first nblocks entries are used */
  int64_t nblocks, cap;
  int64_t len;          /* tokens in the window */
  int64_t start;        /* absolute position of window token 0 */
  int32_t first_offset; /* rows of blocks[0] before the window; 0 when len == 0 */
  uint16_t gen;         /* generation of the id (1..KVA_SEQ_GEN_MAX) */
  uint8_t live;
} kva_seq_state;

struct kva_pool {
  pthread_mutex_t mu;
  kva_pool_desc desc;
  kva_kv k, v;           /* [num_blocks, KVH, block_size, D] descriptors of the block memory */
  void *mem;             /* block memory */
  int own_mem;           /* allocated by kva_pool_create */
  int32_t *ref;          /* [num_blocks] references: sequence tables + views + reservations */
  int32_t *seq_ref;      /* [num_blocks] references from sequence tables (copy-on-write test) */
  uint8_t *reserved;     /* [num_blocks] 1 = reserved by the caller */
  int32_t *free_stack;   /* [num_blocks] free block ids; the top is free_stack[nfree-1] */
  int64_t nfree;
  kva_seq_state *seqs;   /* [nslots] */
  int64_t nslots, slot_cap;
  int32_t *free_slots;   /* [slot_cap] ring of dead slots to reuse, oldest at free_slot_head */
  int64_t free_slot_head, nfree_slots;
  int64_t live_seqs;
  struct kva_paged_view *views; /* doubly linked list of live views */
  int64_t live_views;
  /* Released view handles, oldest first (linked by next), reused by later
   * views and freed with the pool (kva_paged_view_release). */
  struct kva_paged_view *spare_views, *spare_tail;
  int destroyed;         /* kva_pool_destroy called; freed with its last view */
};

struct kva_paged_view {
  uint32_t magic;         /* KVA_PAGED_VIEW_MAGIC while live, 0 once released */
  void *arrays;           /* the one allocation behind the arrays below (NULL once released) */
  kva_pool *pool;
  struct kva_paged_view *prev, *next; /* the pool's list of live views */
  kva_kv k, v;            /* the pool's descriptors */
  int64_t B, block_size, KVH, Dk, Dv;
  int64_t max_len;        /* longest sequence (kva_problem.N) */
  int32_t *indptr;        /* [B+1] */
  int32_t *indices;       /* [indptr[B]] */
  int32_t *last_len;      /* [B] 1..block_size */
  int32_t *first_offset;  /* [B] 0..block_size-1 */
  int32_t *lens;          /* [B] >= 1 */
  int64_t *start;         /* [B] */
};

/* Validation of a kva_kv_view of layout PAGED for kva_attention: the view
 * handle is live and view->k/v are the pool's descriptors (else EDTYPE,
 * "mismatched pool formats"). Fills the batch, heads, head dims and the
 * longest sequence. */
int kva_paged_view_check(const kva_kv_view *view, int64_t *B, int64_t *KVH, int64_t *Dk, int64_t *Dv,
                         int64_t *max_len);
/* Tokens of sequence b of a checked paged view. */
int64_t kva_paged_view_len(const kva_kv_view *view, int64_t b);

/* ---- caller pools + a block table (KVA_LAYOUT_BLOCK_TABLE, src/paged/table.c) */
/* int32 elements between table rows (row_stride 0 = max_blocks). */
static inline int64_t kva_block_table_stride(const kva_block_table *t) {
  return t->row_stride ? t->row_stride : t->max_blocks;
}
/* Rows of sequence b's first block before its token 0. */
static inline int64_t kva_block_table_first(const kva_block_table *t, int64_t b) {
  return t->first_offset ? t->first_offset[b] : 0;
}
/* Validation of a BLOCK_TABLE kva_kv_view's descriptors (never reads the
 * table's arrays: on CUDA they are device memory). Pools rank 4
 * [num_blocks, KVH, block_size, D], checked like contiguous operands, the
 * same num_blocks, KVH and block_size (any block_size >= 1). Fills the
 * batch, heads, head dims and N = max_blocks * block_size. */
int kva_block_table_check(const kva_kv_view *view, int64_t *B, int64_t *KVH, int64_t *Dk, int64_t *Dv, int64_t *N);
/* Host-side check of every table entry one call over L query rows reads:
 * 0 <= first_offset[b] < block_size, L <= seq_lens[b], first_offset[b] +
 * seq_lens[b] <= max_blocks * block_size, and each used block id in
 * [0, num_blocks). CPU backend only (host arrays). */
int kva_block_table_check_entries(const kva_kv_view *view, int64_t L);
/* Tokens of sequence b of a checked block-table view (host arrays). */
int64_t kva_block_table_len(const kva_kv_view *view, int64_t b);

/* ---- helpers shared by pool.c, seq.c, view.c (caller holds pool->mu) */
static inline void kva_pool_lock(kva_pool *p) { pthread_mutex_lock(&p->mu); }
static inline void kva_pool_unlock(kva_pool *p) { pthread_mutex_unlock(&p->mu); }

/* Blocks needed for first_offset + len table rows. */
static inline int64_t kva_blocks_for(int64_t rows, int64_t block_size) {
  return (rows + block_size - 1) / block_size;
}
/* Takes a reference on each of n block entries (allocated blocks; repeats
 * count each time), or none and KVA_EUNSUPPORTED ("too many references")
 * when a count would pass INT32_MAX. */
int kva_pool_ref_all(kva_pool *p, const int32_t *blocks, int64_t n);
/* Pops a free block (caller checked nfree > 0); refs are set by the caller. */
static inline int32_t kva_pool_pop(kva_pool *p) { return p->free_stack[--p->nfree]; }
/* Drops one reference; a block whose count reaches 0 goes back on the free list. */
static inline void kva_pool_unref(kva_pool *p, int32_t blk) {
  if (--p->ref[blk] == 0) p->free_stack[p->nfree++] = blk;
}
/* Address of row `row` of KV head hk in block blk of one pool array. */
static inline char *kva_pool_row(const kva_tensor *t, int64_t blk, int64_t hk, int64_t row) {
  return kva_at4(t, blk, hk, row, 0);
}
/* Bytes of one row of a pool array (data, scales or biases). */
static inline int64_t kva_pool_row_bytes(const kva_tensor *t) {
  return t->shape[3] * (int64_t)kva_dtype_size(t->dtype);
}
/* Copies rows [r0, r0+n) of block src to the same rows of block dst, every
 * head, K and V (data, and scales/biases when quantized). */
void kva_pool_copy_rows(kva_pool *p, int32_t dst, int32_t src, int64_t r0, int64_t n);
/* Live sequence for id, or NULL (no error set). */
kva_seq_state *kva_pool_seq_find(kva_pool *p, int32_t id);
/* Live sequence for id, or NULL with an error set (ENOSEQ) naming `what`. */
kva_seq_state *kva_pool_seq(kva_pool *p, int32_t id, const char *what);
/* Frees the pool's memory (no lock; the caller saw destroyed and no views). */
void kva_pool_free_all(kva_pool *p);
/* Pool format equality of two operands (bits, group, dtypes, head dim). */
int kva_pool_same_format(const kva_kv *a, const kva_kv *b);
#endif
