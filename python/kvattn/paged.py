"""Paged KV cache: block pools, sequences, immutable views and attention over
a view (the C API's kva_pool_* / kva_seq_* / kva_paged_view_*).

    import numpy as np, kvattn
    from kvattn.paged import Pool
    pool = Pool(num_blocks=256, block_size=16, kv_heads=2, dk=128, dtype=kvattn.bfloat16, bits=4)
    s = pool.sequence()                                  # a new, empty sequence
    s.append(k_rows, v_rows)                             # float [KVH, T, D]: quantized on write
    t = s.fork()                                         # shares s's blocks (copy-on-write)
    with pool.view([s, t]) as view:                      # an immutable snapshot of both
        out = view.attention(q, mask="causal")           # q [2, H, L, Dk] -> [2, H, L, Dv]
        blocks, lens, first = view.block_table()         # the same batch as a block table ...
    out2 = block_table_attention(q, pool.k, pool.v, blocks, lens, first, mask="causal", bits=4)  # bit for bit

block_table_attention reads caller pools [num_blocks, KVH, block_size, D]
(float arrays or (packed, scales, biases) tuples) through a block table
[B, max_blocks] (the vLLM-style layout; KVA_LAYOUT_BLOCK_TABLE in C).

The pool's block memory is a numpy buffer owned by the Pool (pool.k / pool.v
expose it as [num_blocks, KVH, block_size, ...] arrays); metadata lives in the
library. A view keeps its Pool object (and so the memory) alive until it is
released, even past pool.close(). Errors raise kvattn.KvaError with the
library's message.
"""
import ctypes

import numpy as np

from . import _capi as C
from ._capi import kva_block_table, lib  # kva_block_table: the struct, used by cuda.py too

__all__ = ["Pool", "Sequence", "PagedView", "block_table_attention", "block_table_reference_attention",
           "paged_attention"]

_POOL_ALIGN = 64  # KVA_POOL_ALIGN
_WORD_BITS = 32


# ----------------------------------------------------------------- structs
class kva_pool_desc(ctypes.Structure):
    _fields_ = [
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("dk", ctypes.c_int64),
        ("dv", ctypes.c_int64),
        ("dtype", ctypes.c_int),
        ("bits", ctypes.c_int),
        ("group_size", ctypes.c_int),
    ]


class kva_pool_stats(ctypes.Structure):
    _fields_ = [
        ("free_blocks", ctypes.c_int64),
        ("used_blocks", ctypes.c_int64),
        ("sequences", ctypes.c_int64),
        ("views", ctypes.c_int64),
    ]


_P = ctypes.POINTER
_i32p = _P(ctypes.c_int32)


class kva_paged_csr(ctypes.Structure):
    _fields_ = [
        ("batch", ctypes.c_int64),
        ("indptr", _i32p),
        ("indices", _i32p),
        ("last_len", _i32p),
        ("first_offset", _i32p),
        ("start", _P(ctypes.c_int64)),
        ("lens", _i32p),
    ]


def _proto(name, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


_vp = ctypes.c_void_p
_proto("kva_pool_memory_size", ctypes.c_int, _P(kva_pool_desc), _P(ctypes.c_size_t))
_proto("kva_pool_create", ctypes.c_int, _P(_vp), _P(kva_pool_desc), _vp)
_proto("kva_pool_destroy", None, _vp)
_proto("kva_pool_k", C.kva_kv, _vp)
_proto("kva_pool_v", C.kva_kv, _vp)
_proto("kva_pool_stats_get", ctypes.c_int, _vp, _P(kva_pool_stats))
_proto("kva_pool_block_refs", ctypes.c_int, _vp, ctypes.c_int32, _P(ctypes.c_int32))
_proto("kva_pool_check", ctypes.c_int, _vp)
_proto("kva_pool_shuffle", ctypes.c_int, _vp, ctypes.c_uint64)
_proto("kva_pool_reserve", ctypes.c_int, _vp, ctypes.c_int64, _i32p)
_proto("kva_pool_unreserve", ctypes.c_int, _vp, ctypes.c_int64, _i32p)
_proto("kva_seq_create", ctypes.c_int, _vp, _i32p)
_proto("kva_seq_append", ctypes.c_int, _vp, ctypes.c_int32, _P(C.kva_tensor), _P(C.kva_tensor))
_proto("kva_seq_append_raw", ctypes.c_int, _vp, ctypes.c_int32, _P(C.kva_kv), _P(C.kva_kv))
_proto("kva_seq_fork", ctypes.c_int, _vp, ctypes.c_int32, _i32p)
_proto("kva_seq_free", ctypes.c_int, _vp, ctypes.c_int32)
_proto("kva_seq_trim", ctypes.c_int, _vp, ctypes.c_int32, ctypes.c_int64)
_proto("kva_seq_len", ctypes.c_int64, _vp, ctypes.c_int32)
_proto("kva_seq_start", ctypes.c_int64, _vp, ctypes.c_int32)
_proto("kva_seq_blocks", ctypes.c_int64, _vp, ctypes.c_int32)
_proto("kva_paged_view_create", ctypes.c_int, _vp, _i32p, ctypes.c_int64, _P(_vp))
_proto("kva_paged_view_from_csr", ctypes.c_int, _vp, _P(kva_paged_csr), _P(_vp))
_proto("kva_paged_view_release", None, _vp)
_proto("kva_view_paged", C.kva_kv_view, _vp)
_proto("kva_paged_view_csr", ctypes.c_int, _vp, _P(kva_paged_csr))
_proto("kva_paged_view_gather", ctypes.c_int, _vp, ctypes.c_int64, _P(C.kva_kv), _P(C.kva_kv))
_proto("kva_paged_view_block_table", ctypes.c_int, _vp, ctypes.c_int64, _i32p, _i32p, _i32p)


def _int(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError("%s must be an int, got %r" % (name, value))
    return int(value)


def _int32(value, name):
    return C.int32(_int(value, name), name)


def _i32(arr):
    return arr.ctypes.data_as(_i32p)


def _array_at(buf, base, t):
    """numpy view of one pool array (a kva_tensor into the Pool's buffer)."""
    off = t.data - base
    shape = tuple(t.shape[d] for d in range(t.ndim))
    strides = tuple(t.stride[d] for d in range(t.ndim))
    dt = C.KVA_TO_NP[t.dtype]
    return np.ndarray(shape, dt, buffer=buf, offset=off, strides=strides)


# -------------------------------------------------------------------- pool
class Pool:
    """A block pool: K [num_blocks, KVH, block_size, Dk] and V [..., Dv] in
    one format: float (`dtype` float32/float16/bfloat16, bits=0) or MLX affine
    (bits 2/4/8, group_size 32/64/128, scales/biases in `dtype`).

    Pool calls are thread-safe (the library locks the pool); attention over a
    view may run while other threads append, fork, trim or free.
    """

    def __init__(self, num_blocks, block_size, kv_heads, dk, dv=None, dtype=np.float16, bits=0,
                 group_size=64):
        d = kva_pool_desc()
        d.num_blocks = _int(num_blocks, "num_blocks")
        d.block_size = _int(block_size, "block_size")
        d.kv_heads = _int(kv_heads, "kv_heads")
        d.dk = _int(dk, "dk")
        d.dv = d.dk if dv is None else _int(dv, "dv")
        dt = np.dtype(dtype)
        if dt not in C.FLOAT_DTYPES:
            raise C.error(C.EDTYPE, "dtype %s must be float32, float16 or bfloat16" % dt)
        d.dtype = C.NP_TO_KVA[dt]
        d.bits = _int32(bits, "bits")
        d.group_size = _int32(group_size, "group_size") if d.bits else 0
        nbytes = ctypes.c_size_t()
        C.check(lib.kva_pool_memory_size(ctypes.byref(d), ctypes.byref(nbytes)))
        raw = np.empty(nbytes.value + _POOL_ALIGN, np.uint8)
        pad = (-raw.ctypes.data) % _POOL_ALIGN
        self._mem = raw[pad:pad + nbytes.value]
        ptr = ctypes.c_void_p()
        C.check(lib.kva_pool_create(ctypes.byref(ptr), ctypes.byref(d), self._mem.ctypes.data))
        self._ptr = ptr.value
        self._destroy = lib.kva_pool_destroy
        self._init_arrays(d)

    def _init_arrays(self, d):
        self.desc = d
        self.num_blocks, self.block_size, self.kv_heads = d.num_blocks, d.block_size, d.kv_heads
        self.dk, self.dv, self.bits = d.dk, d.dv, d.bits
        self.group_size = d.group_size if d.bits else 0
        self.dtype = C.KVA_TO_NP[d.dtype]
        self._k, self._v = lib.kva_pool_k(self._ptr), lib.kva_pool_v(self._ptr)
        base = self._mem.ctypes.data
        buf = self._mem

        def arrays(kv):
            if not self.bits:
                return _array_at(buf, base, kv.data)
            return tuple(_array_at(buf, base, t) for t in (kv.data, kv.scales, kv.biases))

        self.k, self.v = arrays(self._k), arrays(self._v)

    @classmethod
    def from_contiguous(cls, k, v, block_size, seq_lens=None, spare_blocks=0, shuffle_seed=0, group_size=64,
                        bits=4):
        """A pool holding contiguous caches k, v: [B, KVH, N, D] float arrays
        (the pool gets their dtype) or (packed, scales, biases) tuples in MLX's
        format with bits / group_size (copied bit for bit). One sequence per
        batch entry (length seq_lens[b], default N), spare_blocks more free
        blocks; shuffle_seed != 0 scatters the blocks over the pool.
        Returns (pool, [Sequence])."""
        quant = isinstance(k, (tuple, list))
        parts_k = [np.asarray(a) for a in (k if quant else (k,))]
        parts_v = [np.asarray(a) for a in (v if quant else (v,))]
        if any(a.ndim != 4 for a in parts_k + parts_v):
            raise C.error(C.ESHAPE, "k and v must be [B, KVH, N, D] (or tuples of such arrays)")
        B, KVH, N = parts_k[0].shape[:3]
        bits = _int(bits, "bits") if quant else 0
        per_word = _WORD_BITS // bits if quant and bits in (2, 4, 8) else 1
        dk, dv = parts_k[0].shape[3] * per_word, parts_v[0].shape[3] * per_word
        dtype = parts_k[1].dtype if quant else parts_k[0].dtype
        lens = np.full(B, N, np.int64) if seq_lens is None else np.asarray(seq_lens, np.int64).reshape(-1)
        if lens.shape != (B,) or (lens < 1).any() or (lens > N).any():
            raise C.error(C.ESHAPE, "seq_lens must be [B] = [%d] values in [1, N = %d], got %r" % (B, N, seq_lens))
        bs = _int(block_size, "block_size")
        blocks = int(sum(-(-int(n) // bs) for n in lens)) + _int(spare_blocks, "spare_blocks")
        pool = cls(blocks, bs, KVH, dk, dv, dtype=dtype, bits=bits, group_size=group_size)
        if shuffle_seed:
            pool.shuffle(shuffle_seed)
        seqs = []
        for b in range(B):
            s = pool.sequence()
            n = int(lens[b])
            kb = tuple(a[b, :, :n] for a in parts_k)
            vb = tuple(a[b, :, :n] for a in parts_v)
            s.append_raw(kb if quant else kb[0], vb if quant else vb[0])
            seqs.append(s)
        return pool, seqs

    @property
    def handle(self):
        if not self._ptr:
            raise ValueError("the kvattn Pool is closed")
        return self._ptr

    def close(self):
        """Frees the sequences now and the pool once its last view is released."""
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            self._destroy(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    @property
    def memory_size(self):
        return self._mem.nbytes

    def stats(self):
        """{"free_blocks", "used_blocks", "sequences", "views"}."""
        st = kva_pool_stats()
        C.check(lib.kva_pool_stats_get(self.handle, ctypes.byref(st)))
        return {n: getattr(st, n) for n, _ in kva_pool_stats._fields_}

    def block_refs(self, block):
        r = ctypes.c_int32()
        C.check(lib.kva_pool_block_refs(self.handle, _int32(block, "block"), ctypes.byref(r)))
        return r.value

    def check(self):
        """Recounts every reference and checks the free list (KvaError on a mismatch)."""
        C.check(lib.kva_pool_check(self.handle))

    def shuffle(self, seed):
        """Scatters later allocations over the pool (permutes the free list)."""
        C.check(lib.kva_pool_shuffle(self.handle, _int(seed, "seed")))

    def reserve(self, n):
        """n free blocks for the caller's own use (write them through pool.k / pool.v)."""
        out = np.zeros(max(_int(n, "n"), 1), np.int32)
        C.check(lib.kva_pool_reserve(self.handle, n, _i32(out)))
        return out[:n]

    def unreserve(self, blocks):
        b = np.ascontiguousarray(C.int32_array(blocks, "blocks")).reshape(-1)
        C.check(lib.kva_pool_unreserve(self.handle, b.size, _i32(b)))

    def sequence(self):
        """A new, empty sequence."""
        sid = ctypes.c_int32()
        C.check(lib.kva_seq_create(self.handle, ctypes.byref(sid)))
        return Sequence(self, sid.value)

    def view(self, seqs):
        """An immutable snapshot of sequences (Sequence objects or ids; repeats allowed)."""
        ids = np.array([s.id if isinstance(s, Sequence) else _int(s, "seqs") for s in seqs], np.int32)
        ptr = ctypes.c_void_p()
        C.check(lib.kva_paged_view_create(self.handle, _i32(ids) if ids.size else None, ids.size,
                                          ctypes.byref(ptr)))
        return PagedView(self, ptr.value)

    def view_from_csr(self, indptr, indices, last_len, first_offset=None, start=None):
        """A view of caller block tables (CSR); every block must be allocated
        (by a sequence, a view or pool.reserve)."""
        arrs = [np.ascontiguousarray(C.int32_array(a, n)).reshape(-1)
                for a, n in ((indptr, "indptr"), (indices, "indices"), (last_len, "last_len"))]
        c = kva_paged_csr()
        c.batch = max(arrs[0].size - 1, 0)
        c.indptr, c.indices, c.last_len = (_i32(a) for a in arrs)
        if first_offset is not None:
            fo = np.ascontiguousarray(C.int32_array(first_offset, "first_offset")).reshape(-1)
            arrs.append(fo)
            c.first_offset = _i32(fo)
        if start is not None:
            st = np.ascontiguousarray(np.asarray(start, np.int64)).reshape(-1)
            arrs.append(st)
            c.start = st.ctypes.data_as(_P(ctypes.c_int64))
        if c.batch and any(a.size < c.batch for a in arrs[2:]):
            raise C.error(C.ESHAPE, "last_len / first_offset / start must have batch = %d entries" % c.batch)
        if c.batch and arrs[1].size < arrs[0][-1]:
            raise C.error(C.ESHAPE, "indices has %d entries, indptr[-1] = %d" % (arrs[1].size, arrs[0][-1]))
        ptr = ctypes.c_void_p()
        C.check(lib.kva_paged_view_from_csr(self.handle, ctypes.byref(c), ctypes.byref(ptr)))
        return PagedView(self, ptr.value)

    def __repr__(self):
        fmt = ("q%d/g%d/%s" % (self.bits, self.group_size, self.dtype)) if self.bits else str(self.dtype)
        state = "closed" if not self._ptr else "%(free_blocks)d free" % self.stats()
        return "<kvattn.paged.Pool %d x %d tokens, KVH %d, D %d/%d, %s, %s>" % (
            self.num_blocks, self.block_size, self.kv_heads, self.dk, self.dv, fmt, state)


# --------------------------------------------------------------- sequences
def _rows_kv(x, name, pool, keep):
    """Raw rows in the pool's format: (packed, scales, biases) [KVH, T, ...]
    (or a float array [KVH, T, D] for float pools) as kva_kv [1, KVH, T, ...]."""
    parts = x if isinstance(x, (tuple, list)) else (x,)
    kv = C.kva_kv()
    ts = []
    for a, sfx in zip(parts, (".data", ".scales", ".biases")):
        a = C.prepare_input(a, name + sfx)
        a = a.reshape((1,) + a.shape) if a.ndim == 3 else a
        keep.append(a)
        ts.append(C.tensor(a, name + sfx))
    kv.data = ts[0]
    if len(ts) == 3:
        kv.scales, kv.biases = ts[1], ts[2]
        kv.bits, kv.group_size = pool.bits, pool.group_size
    return kv


class Sequence:
    """One sequence of a pool (an int32 id). Operations raise KvaError once it is freed."""

    def __init__(self, pool, sid):
        self.pool = pool
        self.id = sid

    def append(self, k, v):
        """Appends T tokens: float rows k [KVH, T, Dk], v [KVH, T, Dv]
        (float32/float16/bfloat16), converted to a float pool's dtype or
        quantized on write (bit-identical to quantizing the whole cache at once)."""
        if isinstance(k, (tuple, list)) or isinstance(v, (tuple, list)):
            return self.append_raw(k, v)
        k, v = C.prepare_input(k, "k"), C.prepare_input(v, "v")
        kt, vt = C.tensor(k, "k"), C.tensor(v, "v")
        C.check(lib.kva_seq_append(self.pool.handle, self.id, ctypes.byref(kt), ctypes.byref(vt)))
        return self

    def append_raw(self, k, v):
        """Appends T rows already in the pool's format, copied bit for bit:
        (packed, scales, biases) tuples [KVH, T, ...] for a quantized pool, a
        [KVH, T, D] array of the pool's dtype for a float pool."""
        keep = []
        kk, vv = _rows_kv(k, "k", self.pool, keep), _rows_kv(v, "v", self.pool, keep)
        C.check(lib.kva_seq_append_raw(self.pool.handle, self.id, ctypes.byref(kk), ctypes.byref(vv)))
        return self

    def fork(self):
        """A new sequence sharing all of this one's blocks."""
        child = ctypes.c_int32()
        C.check(lib.kva_seq_fork(self.pool.handle, self.id, ctypes.byref(child)))
        return Sequence(self.pool, child.value)

    def free(self):
        C.check(lib.kva_seq_free(self.pool.handle, self.id))

    def trim(self, keep_last):
        """Sliding window: keeps the last keep_last tokens; whole blocks before it are freed."""
        C.check(lib.kva_seq_trim(self.pool.handle, self.id, _int(keep_last, "keep_last")))
        return self

    def _query(self, fn):
        r = fn(self.pool.handle, self.id)
        if r < 0:
            C.check(int(r))
        return int(r)

    def __len__(self):
        """Tokens in the window."""
        return self._query(lib.kva_seq_len)

    @property
    def start(self):
        """Absolute position of the window's first token."""
        return self._query(lib.kva_seq_start)

    @property
    def num_blocks(self):
        return self._query(lib.kva_seq_blocks)

    def __repr__(self):
        return "<kvattn.paged.Sequence %d of %r>" % (self.id, self.pool)


# -------------------------------------------------------------------- views
class PagedView:
    """An immutable CSR snapshot of a batch of sequences; keeps its blocks
    (and its pool) alive until release(). Usable as a context manager."""

    def __init__(self, pool, ptr):
        self.pool = pool
        self._ptr = ptr
        self._release = lib.kva_paged_view_release
        c = self._csr_struct()
        self.batch = c.batch

    @property
    def handle(self):
        if not self._ptr:
            raise ValueError("the kvattn PagedView is released")
        return self._ptr

    def release(self):
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            self._release(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        self.release()

    def _csr_struct(self):
        c = kva_paged_csr()
        C.check(lib.kva_paged_view_csr(self.handle, ctypes.byref(c)))
        return c

    def csr(self):
        """Copies of the view's arrays: indptr [B+1], indices, last_len, first_offset, lens [B] (int32),
        start [B] (int64)."""
        c = self._csr_struct()
        B = c.batch

        def take(p, n):
            return np.ctypeslib.as_array(p, shape=(n,)).copy()

        indptr = take(c.indptr, B + 1)
        return {"indptr": indptr, "indices": take(c.indices, int(indptr[-1])), "last_len": take(c.last_len, B),
                "first_offset": take(c.first_offset, B), "lens": take(c.lens, B), "start": take(c.start, B)}

    @property
    def lens(self):
        return self.csr()["lens"]

    def block_table(self, max_blocks=None):
        """The view as a block table in host memory: (blocks [B, max_blocks],
        seq_lens [B], first_offset [B]) int32 arrays, unused entries -1.
        max_blocks None = the most blocks any sequence of the view has;
        KvaError (ESHAPE) when a sequence has more than max_blocks. The table
        holds no references: keep the view (or its sequences) alive while
        the pool's blocks are read through it."""
        c = self._csr_struct()
        B = c.batch
        if max_blocks is None:
            indptr = np.ctypeslib.as_array(c.indptr, shape=(B + 1,))
            max_blocks = int(np.diff(indptr).max())
        mb = _int(max_blocks, "max_blocks")
        blocks = np.empty((B, max(mb, 1)), np.int32)
        seq_lens, first = np.empty(B, np.int32), np.empty(B, np.int32)
        C.check(lib.kva_paged_view_block_table(self.handle, mb, _i32(blocks), _i32(seq_lens), _i32(first)))
        return blocks, seq_lens, first

    def gather(self, b):
        """Sequence b's rows bit for bit in the pool's format: k, v as
        [KVH, len, D] float arrays, or (packed, scales, biases) tuples."""
        b = _int(b, "b")
        c = self._csr_struct()
        if not 0 <= b < c.batch:
            raise C.error(C.EINVAL, "b = %d is out of range [0, %d)" % (b, c.batch))
        n = c.lens[b]
        p = self.pool
        out, kvs = [], []
        for arr in (p.k, p.v):
            parts = arr if isinstance(arr, tuple) else (arr,)
            dst = tuple(np.empty((1, p.kv_heads, n, a.shape[3]), a.dtype) for a in parts)
            kv = C.kva_kv()
            kv.data = C.tensor(dst[0], "out", output=True)
            if p.bits:
                kv.scales = C.tensor(dst[1], "out", output=True)
                kv.biases = C.tensor(dst[2], "out", output=True)
                kv.bits, kv.group_size = p.bits, p.group_size
            kvs.append(kv)
            out.append(tuple(a[0] for a in dst) if p.bits else dst[0][0])
        C.check(lib.kva_paged_view_gather(self.handle, b, ctypes.byref(kvs[0]), ctypes.byref(kvs[1])))
        return out[0], out[1]

    def _call(self, q, scale, mask, window, segments, clamp, softcap, sinks, out, tree_mask=None):
        """The contiguous binding's call descriptors, with this view in place of K/V."""
        from . import _Call

        p = self.pool
        lens = self.lens
        # K/V operands: the pool's own arrays (they give the call its head dims
        # and formats); the mask is set below against the view's longest sequence.
        call = _Call(q, p.k, p.v, scale, None, window, segments, clamp, softcap, sinks, p.group_size or 64,
                     p.bits or 4, None, out)
        call.keep.append(self)
        call.view = lib.kva_view_paged(self.handle)
        _set_mask(call, q, mask, int(lens.max()), tree_mask)
        return call

    def attention(self, q, scale=None, mask=None, window=None, segments=None, softcap=None, sinks=None,
                  threads=None, *, clamp=False, out=None, context=None, exact=False, tree_mask=None,
                  rotated=None):
        """kvattn.attention over this view: q [B, H, L, Dk] (B = the view's
        sequences; row i of sequence b at position len_b - L + i, len_b its
        window length), same masks / softcap / sinks / exact / tree_mask;
        segments [B, max len] indexed by view index. Returns [B, H, L, Dv] in
        q's dtype; rotated: a Hadamard-rotated cache, as kvattn.attention."""
        from . import _flags, default_context

        call = self._call(q, scale, mask, window, segments, clamp, softcap, sinks, out, tree_mask)
        call.params.flags = _flags(exact, rotated)
        ctx = context if context is not None else default_context(threads)
        with ctx.lock:
            C.check(lib.kva_attention(ctx.handle, *call.refs(), None, 0))
        return call.out_array

    def reference_attention(self, q, scale=None, mask=None, window=None, segments=None, softcap=None, sinks=None,
                            *, clamp=False, out=None, tree_mask=None):
        """The library's double-precision oracle over this view."""
        call = self._call(q, scale, mask, window, segments, clamp, softcap, sinks, out, tree_mask)
        C.check(lib.kva_reference_attention(*call.refs()))
        return call.out_array

    def path(self, q, scale=None, mask=None, window=None, segments=None, softcap=None, sinks=None, threads=None,
             *, clamp=False, out=None, context=None, tree_mask=None):
        """"fused" or "fallback": the path attention() takes."""
        from . import default_context

        call = self._call(q, scale, mask, window, segments, clamp, softcap, sinks, out, tree_mask)
        ctx = context if context is not None else default_context(threads)
        with ctx.lock:
            path = C.check(lib.kva_attention_path(ctx.handle, *call.refs()))
        return {C.PATH_FUSED: "fused", C.PATH_FALLBACK: "fallback"}.get(path, path)

    def __repr__(self):
        return "<kvattn.paged.PagedView B=%s %s>" % (self.batch, "released" if not self._ptr else "live")


def paged_attention(q, view, **kw):
    """Attention of q over a PagedView (view.attention(q, **kw))."""
    if not isinstance(view, PagedView):
        raise TypeError("view must be a kvattn.paged.PagedView, got %s" % type(view).__name__)
    return view.attention(q, **kw)



# ------------------------------------------------------- block tables
def _table_array(x, name, ndim):
    arr = C.int32_array(x, name)
    if arr.dtype != np.int32:
        raise C.error(C.EDTYPE, "%s has unsupported dtype %s (int32 expected)" % (name, arr.dtype))
    if arr.ndim != ndim:
        raise C.error(C.ESHAPE, "%s must have rank %d, got shape %s" % (name, ndim, list(arr.shape)))
    return arr


def _set_mask(call, q, mask, N, tree_mask=None):
    """The mask of a paged call: None, "causal", or an array broadcast to
    [B, H, L, N] with N the layout's longest sequence (set after the view);
    or a tree's bits (tree_mask, as kvattn.attention)."""
    from . import _mask_kind, _tree_bits, _tree_kind

    m = call.params.mask
    if tree_mask is not None:
        m.kind = _tree_kind(mask, tree_mask)
        tb = _tree_bits(tree_mask)
        call.keep.append(tb)
        m.array = C.tensor(tb, "mask.array (tree bits)")
        return
    m.kind = _mask_kind(mask)
    if m.kind == C.MASK_ARRAY:
        qa = np.asarray(q)
        B, H, L = qa.shape[:3] if qa.ndim == 4 else (1, 1, 1)
        ma = call._mask_array(np.asarray(mask), (B, H, L, N))
        call.keep.append(ma)
        m.array = C.tensor(ma, "mask.array")


def _table_call(q, k_pool, v_pool, blocks, seq_lens, first_offset, scale, mask, window, segments, clamp, softcap,
                sinks, group_size, bits, out, tree_mask=None, k_scale=None, v_scale=None):
    """The contiguous binding's call descriptors, with the pools and a
    kva_block_table in place of K/V (layout BLOCK_TABLE)."""
    from . import _Call

    call = _Call(q, k_pool, v_pool, scale, None, window, segments, clamp, softcap, sinks, group_size, bits, None, out,
                 k_scale=k_scale, v_scale=v_scale)
    bl = _table_array(blocks, "blocks", 2)
    B, mb = bl.shape
    # Rows of blocks may be strided (e.g. table[:, :m] of a wider table):
    # row_stride in int32 elements; overlapping or odd strides are copied.
    if B > 1 and (bl.strides[0] % 4 or bl.strides[0] < 4 * mb):
        bl = np.ascontiguousarray(bl)
    row_stride = bl.strides[0] // 4 if B > 1 else 0
    sl = np.ascontiguousarray(_table_array(seq_lens, "seq_lens", 1))
    if sl.shape != (B,):
        raise C.error(C.ESHAPE, "seq_lens must have shape [B] = [%d] (the rows of blocks), got %s"
                      % (B, list(sl.shape)))
    t = kva_block_table()
    t.batch, t.max_blocks, t.row_stride = B, mb, row_stride
    t.blocks, t.seq_lens = _i32(bl), _i32(sl)
    call.keep += [bl, sl, t]
    if first_offset is not None:
        fo = np.ascontiguousarray(_table_array(first_offset, "first_offset", 1))
        if fo.shape != (B,):
            raise C.error(C.ESHAPE, "first_offset must have shape [B] = [%d], got %s" % (B, list(fo.shape)))
        call.keep.append(fo)
        t.first_offset = _i32(fo)
    call.view = lib.kva_view_block_table(ctypes.byref(call.view.k), ctypes.byref(call.view.v), ctypes.byref(t))
    kp = np.asarray(k_pool[0] if isinstance(k_pool, (tuple, list)) else k_pool)
    _set_mask(call, q, mask, mb * (kp.shape[2] if kp.ndim == 4 else 1), tree_mask)  # N = max_blocks * block_size
    return call


def block_table_attention(q, k_pool, v_pool, blocks, seq_lens, first_offset=None, scale=None, mask=None,
                          window=None, segments=None, softcap=None, sinks=None, group_size=64, bits=4, threads=None,
                          *, clamp=False, out=None, context=None, exact=False, tree_mask=None, k_scale=None,
                          v_scale=None, rotated=None):
    """Attention of q [B, H, L, Dk] over caller pools addressed by a block table.

    k_pool, v_pool: [num_blocks, KVH, block_size, D] float arrays or
      (packed, scales, biases) tuples with `bits` / `group_size` (e.g.
      Pool.k / Pool.v), read in place; fp8 pools with k_scale / v_scale
      (a number, float32 [num_blocks, KVH, block_size], or None) as in
      kvattn.attention and kvattn.cache_write.
    blocks [B, max_blocks] int32: sequence b's blocks in token order (entries
      past its last block are never read; a strided slice of a wider table
      is read in place); seq_lens [B]: tokens; first_offset [B] (None = 0):
      rows of the first block before token 0. Token t of sequence b is row
      r = first_offset[b] + t of its table row: block blocks[b, r // block_size],
      row r % block_size.
    Positions, masks and the other arguments as kvattn.attention (row i of
    sequence b at position seq_lens[b] - L + i); N = max_blocks * block_size
    for segments [B, N] and mask arrays [B, H, L, N]. Every used entry is
    validated (KvaError, nothing written). exact, rotated: as kvattn.attention. Returns
    [B, H, L, Dv] in q's dtype.
    CUDA arrays (PyTorch tensors, __cuda_array_interface__) run on the CUDA
    backend: kvattn.cuda.block_table_attention."""
    from . import _np_of_torch, _torch_cpu_fp8, _torch_of_np, _torch_ops, cuda, default_context

    ops = _torch_ops(q, threads, context) if k_scale is None and v_scale is None else None
    if ops is not None:
        res = ops.block_table_attention(q, k_pool, v_pool, blocks, seq_lens, first_offset, scale, mask, window,
                                        segments, softcap, sinks, group_size, bits, clamp=clamp, out=out, exact=exact,
                                        tree_mask=tree_mask, rotated=rotated)
        if res is not NotImplemented:
            return res
    if cuda.is_cuda_array(q):
        return cuda.block_table_attention(q, k_pool, v_pool, blocks, seq_lens, first_offset, scale, mask, window,
                                          segments, softcap, sinks, group_size, bits, clamp=clamp, out=out,
                                          context=context, exact=exact, tree_mask=tree_mask, k_scale=k_scale, v_scale=v_scale, rotated=rotated)
    from . import _flags, _no_torch_rotation

    _no_torch_rotation(q, rotated, "block_table_attention")
    call = _table_call(q, k_pool, v_pool, blocks, seq_lens, first_offset, scale, mask, window, segments, clamp,
                       softcap, sinks, group_size, bits, out, tree_mask, k_scale, v_scale)
    call.params.flags = _flags(exact, rotated)
    ctx = context if context is not None else default_context(threads)
    with ctx.lock:
        C.check(lib.kva_attention(ctx.handle, *call.refs(), None, 0))
    return call.out_array


def block_table_reference_attention(q, k_pool, v_pool, blocks, seq_lens, first_offset=None, scale=None, mask=None,
                                    window=None, segments=None, softcap=None, sinks=None, group_size=64, bits=4, *,
                                    clamp=False, out=None, tree_mask=None):
    """The library's double-precision oracle on block_table_attention's arguments."""
    call = _table_call(q, k_pool, v_pool, blocks, seq_lens, first_offset, scale, mask, window, segments, clamp,
                       softcap, sinks, group_size, bits, out, tree_mask)
    C.check(lib.kva_reference_attention(*call.refs()))
    return call.out_array
