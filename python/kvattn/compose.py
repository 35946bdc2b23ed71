"""Composed attention: shared-prefix (cascade) attention of B sequences whose
caches begin with the same P tokens, held once (kva_cascade_attention).

    out = kvattn.cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, mask="causal")

equals kvattn.attention(q, concat(prefix, suffix_b), ...) for every sequence
b: the prefix is attended once for all B L query rows of each head (the rows
stacked as one sequence, in calls of at most 16 rows), each sequence's own
suffix as a batched call, and the two partial states merged.
"""
import ctypes

import numpy as np

from . import _capi as C
from ._capi import lib
from . import cuda as _cuda

_P = ctypes.POINTER
C._proto("kva_cascade_attention", ctypes.c_int, ctypes.c_void_p, _P(C.kva_tensor), _P(C.kva_kv_view),
         _P(C.kva_kv_view), _P(C.kva_attn_params), _P(C.kva_tensor), _P(C.kva_tensor), ctypes.c_uint,
         ctypes.c_void_p, ctypes.c_size_t)
C._proto("kva_cascade_workspace_size", ctypes.c_int, ctypes.c_void_p, _P(C.kva_tensor), _P(C.kva_kv_view),
         _P(C.kva_kv_view), _P(C.kva_attn_params), _P(ctypes.c_size_t))

C._proto("kva_seq_shared_prefix", ctypes.c_int, ctypes.c_void_p, _P(ctypes.c_int32), ctypes.c_int64, ctypes.c_int64,
         _P(ctypes.c_int64))
C._proto("kva_view_shared_prefix", ctypes.c_int, _P(C.kva_kv_view), ctypes.c_int64, _P(ctypes.c_int64))
C._proto("kva_paged_view_split", ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, _P(ctypes.c_void_p),
         _P(ctypes.c_void_p))

__all__ = ["cascade_attention", "paged_cascade_attention", "shared_prefix", "split_view"]


def _one_sequence(x):
    """A prefix operand [KVH, P, D] (or a tuple of such arrays) as [1, KVH, P, D];
    [1, KVH, P, D] is taken as it is."""
    def lift(a):
        nd = len(a.shape) if hasattr(a, "shape") else np.ndim(a)
        return a[None] if nd == 3 else a
    if isinstance(x, (tuple, list)):
        return tuple(lift(a) for a in x)
    return lift(x)


def _token_major(q):
    """q [B, H, L, Dk] whose sequences' rows are evenly spaced (stride[0] =
    L * stride[2], e.g. stored [B, L, H, Dk]), as the C call reads them as one
    sequence of B L rows: in place when it already is, else a token-major copy."""
    if _cuda._is_torch(q):
        if q.dim() == 4 and q.shape[0] > 1 and q.shape[2] > 1 and q.stride(0) != q.shape[2] * q.stride(2):
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        return q
    if _cuda.is_cuda_array(q):
        return q  # described in place; the library names a wrong stride[0]
    q = np.asarray(q)
    if q.ndim == 4 and q.shape[0] > 1 and q.shape[2] > 1 and q.strides[0] != q.shape[2] * q.strides[2]:
        q = np.ascontiguousarray(np.swapaxes(q, 1, 2)).swapaxes(1, 2)
    return q


def _check_mask(mask):
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        raise C.error(C.EUNSUPPORTED, "cascade_attention: mask must be None or 'causal' (every row sees the "
                      "whole prefix), got %r" % (mask if isinstance(mask, str) else type(mask).__name__))


def cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, scale=None, mask=None, softcap=None, sinks=None,
                      group_size=64, bits=4, threads=None, *, suffix_lens=None, out=None, context=None,
                      return_lse=False, lse_base2=False, exact=False):
    """Attention of q [B, H, L, Dk] over B caches that share their first P tokens.

    prefix_k, prefix_v: the shared P tokens once, [KVH, P, D] or [1, KVH, P, D]
      (float arrays, or (packed, scales, biases) tuples with `bits` /
      `group_size`, as kvattn.attention's k, v).
    suffix_k, suffix_v: each sequence's own tokens after the prefix,
      [B, KVH, S, D]; suffix_lens [B] (None = S each): s_b >= L (the suffix
      holds the query rows' own tokens).
    Row i of sequence b sits at position P + s_b - L + i. The result equals
    kvattn.attention over each sequence's whole cache (prefix then suffix)
    within rounding. mask: None or "causal" (no window, no segments: every
    row sees the whole prefix). scale, softcap, sinks ([H], joined once),
    exact: as kvattn.attention. Returns out [B, H, L, Dv] in q's dtype (or
    writes `out`); with return_lse, (out, lse) with lse [B, H, L] float32
    (natural log, base 2 with lse_base2).
    q is read as one sequence of B L rows: stored token-major ([B, L, H, Dk],
    described as [B, H, L, Dk], e.g. x.transpose(0, 2, 1, 3)) it is read in
    place, otherwise copied so.
    CUDA arrays (PyTorch CUDA tensors) run on the CUDA backend, on their
    device and current stream; sinks and suffix_lens are then device arrays.
    Forked paged sequences: split_view and paged_cascade_attention.
    """
    _check_mask(mask)
    q = _token_major(q)
    prefix_k, prefix_v = _one_sequence(prefix_k), _one_sequence(prefix_v)
    if _cuda.is_cuda_array(q):
        return _cascade_cuda(q, prefix_k, prefix_v, suffix_k, suffix_v, scale, mask, softcap, sinks, group_size,
                             bits, suffix_lens, out, context, return_lse, lse_base2, exact)
    from . import _Call, _flags, _kv_operand, default_context

    call = _Call(q, suffix_k, suffix_v, scale, mask, None, None, False, softcap, sinks, group_size, bits,
                 suffix_lens, out)
    call.params.flags = _flags(exact)
    prefix = C.kva_kv_view()
    prefix.layout = C.LAYOUT_CONTIGUOUS
    prefix.k, _, _ = _kv_operand(prefix_k, "prefix_k", bits, group_size, call.keep)
    prefix.v, _, _ = _kv_operand(prefix_v, "prefix_v", bits, group_size, call.keep)
    lse = lt = None
    if return_lse:
        lse = np.empty(call.out_array.shape[:3], np.float32)
        lt = C.tensor(lse, "lse", output=True)
    ctx = context if context is not None else default_context(threads)
    with ctx.lock:
        C.check(lib.kva_cascade_attention(ctx.handle, ctypes.byref(call.q), ctypes.byref(prefix),
                                          ctypes.byref(call.view), ctypes.byref(call.params), ctypes.byref(call.out),
                                          ctypes.byref(lt) if lt is not None else None,
                                          C.LSE_BASE2 if lse_base2 else 0, None, 0))
    return (call.out_array, lse) if return_lse else call.out_array


def _cascade_cuda(q, prefix_k, prefix_v, suffix_k, suffix_v, scale, mask, softcap, sinks, group_size, bits,
                  suffix_lens, out, context, return_lse, lse_base2, exact):
    from . import _flags

    call = _cuda._Call(q, suffix_k, suffix_v, scale, mask, None, None, False, softcap, sinks, group_size, bits,
                       suffix_lens, out)
    call.params.flags = _flags(exact)
    prefix = C.kva_kv_view()
    prefix.layout = C.LAYOUT_CONTIGUOUS
    prefix.k, _, _ = call._kv(prefix_k, "prefix_k", bits, group_size)
    prefix.v, _, _ = call._kv(prefix_v, "prefix_v", bits, group_size)
    lse = lt = None
    if return_lse:
        if not _cuda._is_torch(q):
            raise C.error(C.EINVAL, "return_lse on CUDA arrays other than PyTorch tensors is not supported")
        import torch
        lse = torch.empty(tuple(call.out_array.shape[:3]), dtype=torch.float32, device=q.device)
        call.keep.append(lse)
        lt, _, _, _ = _cuda._tensor(lse, "lse")
    ctx = context if context is not None else _cuda._context(call.device)
    with ctx.lock:
        stream = call.stream
        if stream in (None, _cuda._LEGACY_DEFAULT_STREAM):
            stream = 0
        C.check(lib.kva_context_set_stream(ctx.handle, ctypes.c_void_p(stream)))
        C.check(lib.kva_cascade_attention(ctx.handle, ctypes.byref(call.q), ctypes.byref(prefix),
                                          ctypes.byref(call.view), ctypes.byref(call.params), ctypes.byref(call.out),
                                          ctypes.byref(lt) if lt is not None else None,
                                          C.LSE_BASE2 if lse_base2 else 0, None, 0))
    return (call.out_array, lse) if return_lse else call.out_array


# ------------------------------------------------ forks of a paged pool


def shared_prefix(seqs, min_suffix=0):
    """The tokens that sequences share in memory: the longest P such that
    tokens 0..P-1 of every sequence live in the same pool rows (forks of
    one parent before they diverge), capped so that each keeps at least
    min_suffix own tokens (e.g. L, the query rows of a cascade call).
    seqs: a PagedView, or Sequence objects of one pool."""
    from .paged import PagedView, Sequence, _int

    min_suffix = _int(min_suffix, "min_suffix")
    tokens = ctypes.c_int64()
    if isinstance(seqs, PagedView):
        view = lib.kva_view_paged(seqs.handle)
        C.check(lib.kva_view_shared_prefix(ctypes.byref(view), min_suffix, ctypes.byref(tokens)))
        return tokens.value
    seqs = list(seqs)
    if not seqs or not all(isinstance(s, Sequence) for s in seqs):
        raise C.error(C.EINVAL, "seqs must be a PagedView or a non-empty list of Sequence objects")
    pool = seqs[0].pool
    if any(s.pool is not pool for s in seqs):
        raise C.error(C.EINVAL, "seqs: every sequence must belong to the same pool")
    ids = np.array([s.id for s in seqs], np.int32)
    C.check(lib.kva_seq_shared_prefix(pool.handle, ids.ctypes.data_as(_P(ctypes.c_int32)), ids.size, min_suffix,
                                      ctypes.byref(tokens)))
    return tokens.value


def split_view(view, prefix_tokens):
    """(prefix, suffix) PagedViews of a view of forks for
    paged_cascade_attention: prefix (one sequence) holds tokens
    0..prefix_tokens-1 of sequence 0, suffix each sequence's tokens from
    prefix_tokens on; prefix_tokens in [1, shared_prefix(view, 1)] (else
    KvaError). Each is a new view with its own references."""
    from .paged import PagedView, _int

    if not isinstance(view, PagedView):
        raise TypeError("view must be a kvattn.PagedView, got %s" % type(view).__name__)
    pp, ps = ctypes.c_void_p(), ctypes.c_void_p()
    C.check(lib.kva_paged_view_split(view.handle, _int(prefix_tokens, "prefix_tokens"), ctypes.byref(pp),
                                     ctypes.byref(ps)))
    return PagedView(view.pool, pp.value), PagedView(view.pool, ps.value)


def paged_cascade_attention(q, prefix, suffix, scale=None, mask=None, softcap=None, sinks=None, threads=None, *,
                            out=None, context=None, return_lse=False, lse_base2=False, exact=False):
    """cascade_attention over PagedViews of one pool (CPU): prefix a view of
    one sequence (the shared tokens), suffix a view of the B sequences' own
    tokens after them (split_view gives both); row i of sequence b at
    position P + s_b - L + i; the other arguments as cascade_attention."""
    from . import _flags, default_context
    from .paged import PagedView

    for name, x in (("prefix", prefix), ("suffix", suffix)):
        if not isinstance(x, PagedView):
            raise TypeError("%s must be a kvattn.PagedView, got %s" % (name, type(x).__name__))
    _check_mask(mask)
    q = _token_major(q)
    call = suffix._call(q, scale, mask, None, None, False, softcap, sinks, out)
    call.params.flags = _flags(exact)
    call.keep.append(prefix)
    pview = lib.kva_view_paged(prefix.handle)
    lse = lt = None
    if return_lse:
        lse = np.empty(call.out_array.shape[:3], np.float32)
        lt = C.tensor(lse, "lse", output=True)
    ctx = context if context is not None else default_context(threads)
    with ctx.lock:
        C.check(lib.kva_cascade_attention(ctx.handle, ctypes.byref(call.q), ctypes.byref(pview),
                                          ctypes.byref(call.view), ctypes.byref(call.params), ctypes.byref(call.out),
                                          ctypes.byref(lt) if lt is not None else None,
                                          C.LSE_BASE2 if lse_base2 else 0, None, 0))
    return (call.out_array, lse) if return_lse else call.out_array
