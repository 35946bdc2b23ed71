"""Composed attention: shared-prefix (cascade) attention of B sequences whose
caches begin with the same P tokens, held once (kva_cascade_attention).

    out = kvattn.cascade_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, mask="causal")

equals kvattn.attention(q, concat(prefix, suffix_b), ...) for every sequence
b: the prefix is attended once for all B L query rows of each head (the rows
stacked as one sequence, in calls of at most 256 rows), each sequence's own
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
    from . import _Call, _flags, _kv_operand

    call = _Call(q, suffix_k, suffix_v, scale, mask, None, None, False, softcap, sinks, group_size, bits,
                 suffix_lens, out)
    call.params.flags = _flags(exact)
    prefix = C.kva_kv_view()
    prefix.layout = C.LAYOUT_CONTIGUOUS
    prefix.k, _, _ = _kv_operand(prefix_k, "prefix_k", bits, group_size, call.keep)
    prefix.v, _, _ = _kv_operand(prefix_v, "prefix_v", bits, group_size, call.keep)
    return _run_cascade_host(call, prefix, context, threads, return_lse, lse_base2)


def _run_cascade_host(call, prefix, context, threads, return_lse, lse_base2):
    """kva_cascade_attention of a prepared CPU call (q, suffix view, params, out) over the prefix view, under the
    context's lock; lse allocated here when asked for."""
    from . import default_context

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


def _run_cascade_cuda(call, q, prefix, suffix, context, return_lse, lse_base2):
    """kva_cascade_attention of a prepared CUDA call (q, params, out) over the prefix and suffix views, on the
    call's stream under the context's lock; lse (PyTorch tensors only) allocated here when asked for."""
    lse = lt = None
    if return_lse:
        if not _cuda._is_torch(q):
            raise C.error(C.EINVAL, "return_lse on CUDA arrays other than PyTorch tensors is not supported")
        import torch
        lse = torch.empty(tuple(call.out_array.shape[:3]), dtype=torch.float32, device=q.device)
        call.keep.append(lse)
        lt, _, _, _ = _cuda._tensor(lse, "lse")
    _cuda._on_stream(call, context, lambda h: lib.kva_cascade_attention(
        h, ctypes.byref(call.q), ctypes.byref(prefix), ctypes.byref(suffix), ctypes.byref(call.params),
        ctypes.byref(call.out), ctypes.byref(lt) if lt is not None else None, C.LSE_BASE2 if lse_base2 else 0, None, 0))
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
    return _run_cascade_cuda(call, q, prefix, call.view, context, return_lse, lse_base2)


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
    from . import _flags
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
    return _run_cascade_host(call, pview, context, threads, return_lse, lse_base2)


# ------------------------------------------------ context parallelism


class kva_cp_plan(ctypes.Structure):
    _fields_ = [("ranks", ctypes.c_int64), ("rank", ctypes.c_int64), ("by_head", ctypes.c_int),
                ("B", ctypes.c_int64), ("H", ctypes.c_int64), ("L", ctypes.c_int64), ("Dv", ctypes.c_int64),
                ("heads", ctypes.c_int64), ("lse_flags", ctypes.c_uint),
                ("o_bytes", ctypes.c_size_t), ("lse_bytes", ctypes.c_size_t),
                ("send_lse_offset", ctypes.c_size_t), ("send_bytes", ctypes.c_size_t),
                ("recv_lse_offset", ctypes.c_size_t), ("recv_bytes", ctypes.c_size_t)]


C._proto("kva_cp_plan_init", ctypes.c_int, _P(kva_cp_plan), ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
C._proto("kva_cp_attend", ctypes.c_int, ctypes.c_void_p, _P(kva_cp_plan), _P(C.kva_tensor), _P(C.kva_kv_view),
         _P(C.kva_attn_params), ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t)
C._proto("kva_cp_merge", ctypes.c_int, ctypes.c_void_p, _P(kva_cp_plan), ctypes.c_void_p, ctypes.c_size_t,
         _P(C.kva_tensor), _P(C.kva_tensor))

__all__ += ["CPPlan", "cp_attend", "cp_exchange", "cp_merge"]


class CPPlan:
    """The exchange layout of one context-parallel call shape for one rank
    (kva_cp_plan): R ranks each hold a disjoint part of the keys; rank r
    attends its part (cp_attend) into its send buffer, the parts travel
    (cp_exchange for ranks in one process, or any transport by the offsets
    below), and cp_merge merges the R parts a rank received: the heads it
    owns (by_head: rank r gets heads [r H/R, (r+1) H/R)) or all of them.
    Buffers are float32 numpy arrays (send_buffer(), recv_buffer())."""

    def __init__(self, ranks, rank, B, H, L, Dv, by_head=False, lse_base2=False):
        from .paged import _int

        self._p = kva_cp_plan()
        C.check(lib.kva_cp_plan_init(ctypes.byref(self._p), _int(ranks, "ranks"), _int(rank, "rank"),
                                     int(bool(by_head)), _int(B, "B"), _int(H, "H"), _int(L, "L"), _int(Dv, "Dv"),
                                     C.LSE_BASE2 if lse_base2 else 0))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._p, name)

    def send_buffer(self):
        return np.empty(self._p.send_bytes // 4, np.float32)

    def recv_buffer(self):
        return np.empty(self._p.recv_bytes // 4, np.float32)

    def send_part(self, send, dst):
        """(o, lse) float32 views of send: the part addressed to rank dst."""
        p = self._p
        d = dst if p.by_head else 0
        o0, l0 = d * p.o_bytes // 4, (p.send_lse_offset + d * p.lse_bytes) // 4
        return send[o0:o0 + p.o_bytes // 4], send[l0:l0 + p.lse_bytes // 4]

    def recv_part(self, recv, src):
        """(o, lse) float32 views of recv: the part from rank src."""
        p = self._p
        o0, l0 = src * p.o_bytes // 4, (p.recv_lse_offset + src * p.lse_bytes) // 4
        return recv[o0:o0 + p.o_bytes // 4], recv[l0:l0 + p.lse_bytes // 4]


def _cp_buffer(buf, nbytes, name):
    if not isinstance(buf, np.ndarray) or buf.dtype != np.float32 or not buf.flags.c_contiguous:
        raise TypeError("%s must be a contiguous float32 numpy array (CPPlan.%s_buffer())" % (name, name))
    if buf.nbytes < nbytes:
        raise C.error(C.EWORKSPACE, "%s has %d bytes < %d of the plan" % (name, buf.nbytes, nbytes))
    return buf.ctypes.data


def cp_attend(plan, q, k, v, send, scale=None, mask=None, window=None, softcap=None, sinks=None, group_size=64,
              bits=4, threads=None, *, seq_lens=None, context=None, exact=False):
    """This rank's part: attention of q [B, H, L, Dk] over its keys k, v
    (arguments as kvattn.attention; k = v = None: no key, zeros and -inf)
    into send (kva_cp_attend). Each rank's mask states what its rows see of
    its keys: the rank whose keys end with the query rows' own tokens takes
    the caller's mask (and the sinks), the others mask None."""
    from . import _Call, _flags, default_context

    p = plan._p
    sp = _cp_buffer(send, p.send_bytes, "send")
    ctx = context if context is not None else default_context(threads)
    if k is None and v is None:
        qa = C.prepare_input(q, "q")
        qt = C.tensor(qa, "q")
        with ctx.lock:
            C.check(lib.kva_cp_attend(ctx.handle, ctypes.byref(p), ctypes.byref(qt), None, None, sp, send.nbytes,
                                      None, 0))
        return send
    out = np.empty((p.B, p.H, p.L, p.Dv), np.float32)  # descriptor only: the call writes into send
    call = _Call(q, k, v, scale, mask, window, None, False, softcap, sinks, group_size, bits, seq_lens, out)
    call.params.flags = _flags(exact)
    with ctx.lock:
        C.check(lib.kva_cp_attend(ctx.handle, ctypes.byref(p), ctypes.byref(call.q), ctypes.byref(call.view),
                                  ctypes.byref(call.params), sp, send.nbytes, None, 0))
    return send


def cp_exchange(plans, sends):
    """The exchange of ranks in one process (simulated ranks): sends[s] from
    rank s's plan; returns recvs[d] for every rank d."""
    plans, sends = list(plans), list(sends)
    if len(plans) != len(sends) or not plans:
        raise C.error(C.EINVAL, "cp_exchange: one send buffer per plan, got %d and %d" % (len(plans), len(sends)))
    recvs = [pl.recv_buffer() for pl in plans]
    for d, pl in enumerate(plans):
        for s, src in enumerate(plans):
            o, l = pl.recv_part(recvs[d], s)
            so, sl = src.send_part(sends[s], d)
            o[:], l[:] = so, sl
    return recvs


def cp_merge(plan, recv, out=None, dtype=np.float32, threads=None, *, context=None):
    """Merges the R parts of recv into (out [B, heads, L, Dv], lse [B, heads, L])
    (kva_cp_merge; out in dtype unless given)."""
    from . import default_context

    p = plan._p
    rp = _cp_buffer(recv, p.recv_bytes, "recv")
    if out is None:
        out = np.empty((p.B, p.heads, p.L, p.Dv), dtype)
    lse = np.empty((p.B, p.heads, p.L), np.float32)
    to, tl = C.tensor(out, "out", output=True), C.tensor(lse, "lse", output=True)
    ctx = context if context is not None else default_context(threads)
    with ctx.lock:
        C.check(lib.kva_cp_merge(ctx.handle, ctypes.byref(p), rp, recv.nbytes, ctypes.byref(to), ctypes.byref(tl)))
    return out, lse


C._proto("kva_cp_attention", ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, _P(kva_cp_plan), _P(C.kva_tensor),
         _P(C.kva_kv_view), _P(C.kva_attn_params), _P(C.kva_tensor), _P(C.kva_tensor), ctypes.c_void_p,
         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
__all__ += ["cp_attention"]


def _nccl_comm(comm):
    """The ncclComm_t address of comm: an int, or a torch.distributed
    ProcessGroup (or its NCCL backend) whose communicator exists (created by
    a first collective, or eagerly with init_process_group(device_id=...))."""
    if isinstance(comm, int) and not isinstance(comm, bool):
        return comm
    backend = comm
    if not hasattr(backend, "_comm_ptr") and hasattr(comm, "_get_backend"):
        import torch
        backend = comm._get_backend(torch.device("cuda"))
    if not hasattr(backend, "_comm_ptr"):
        raise TypeError("comm must be an ncclComm_t address (int) or a torch.distributed NCCL process group, got %s"
                        % type(comm).__name__)
    return int(backend._comm_ptr())


def cp_attention(plan, comm, q, k, v, scale=None, mask=None, window=None, softcap=None, sinks=None, group_size=64,
                 bits=4, *, seq_lens=None, out=None, send=None, recv=None, context=None, exact=False,
                 return_lse=False):
    """Context parallelism over NCCL (kva_cp_attention) on PyTorch CUDA
    tensors: this rank attends q [B, H, L, Dk] over its keys k, v (arguments
    as kvattn.attention; k = v = None: no key; the mask each rank passes as
    for cp_attend), the parts are exchanged over comm and merged into out
    [B, plan.heads, L, Dv] (q's dtype unless given), on the tensors' device
    and current stream, without a host synchronization. comm: a
    torch.distributed ProcessGroup with the NCCL backend whose communicator
    exists (after a first collective), or an ncclComm_t address (int), of
    plan.ranks ranks in which this one is plan.rank. send, recv: float32
    device buffers of plan.send_bytes / plan.recv_bytes (None: allocated).
    Returns out, or (out, lse) with return_lse. Needs a build with NCCL."""
    from . import _flags

    if not _cuda._is_torch(q) or not q.is_cuda:
        raise TypeError("cp_attention takes PyTorch CUDA tensors (q is %s)" % type(q).__name__)
    import torch

    p = plan._p
    ptr = _nccl_comm(comm)
    if out is None:
        out = q.new_empty((p.B, p.heads, p.L, p.Dv))
    lse = torch.empty((p.B, p.heads, p.L), dtype=torch.float32, device=q.device) if return_lse else None
    if send is None:
        send = torch.empty(p.send_bytes // 4, dtype=torch.float32, device=q.device)
    if recv is None:
        recv = torch.empty(p.recv_bytes // 4, dtype=torch.float32, device=q.device)
    for name, buf, n in (("send", send, p.send_bytes), ("recv", recv, p.recv_bytes)):
        if not _cuda._is_torch(buf) or buf.dtype != torch.float32 or not buf.is_cuda or buf.numel() * 4 < n:
            raise C.error(C.EWORKSPACE, "%s must be a float32 CUDA tensor of >= %d bytes" % (name, n))
    shard = k is not None or v is not None
    kk, vv = (k, v) if shard else (q[:, :1], q[:, :1])  # descriptors only when there is no shard
    call = _cuda._Call(q, kk, vv, scale, mask, window, None, False, softcap, sinks, group_size,
                       bits if shard else 0, seq_lens, out)
    call.params.flags = _flags(exact)
    call.keep += [send, recv, lse]
    lt = None
    if lse is not None:
        lt, _, _, _ = _cuda._tensor(lse, "lse")
    _cuda._on_stream(call, context, lambda h: lib.kva_cp_attention(
        h, ctypes.c_void_p(ptr), ctypes.byref(p), ctypes.byref(call.q), ctypes.byref(call.view) if shard else None,
        ctypes.byref(call.params), ctypes.byref(call.out), ctypes.byref(lt) if lt is not None else None,
        ctypes.c_void_p(send.data_ptr()), ctypes.c_void_p(recv.data_ptr()), None, 0))
    return (out, lse) if return_lse else out


# ------------------------------------------------ block tables (CPU)


def _table_view(k_pool, v_pool, blocks, seq_lens, first_offset, group_size, bits):
    """A block-table kva_kv_view over numpy pools and host table arrays (and what it points to)."""
    from .paged import _table_call

    bl = np.asarray(blocks)
    q1 = np.zeros((bl.shape[0] if bl.ndim == 2 else 1, 1, 1, 1), np.float32)  # a stand-in query: only the view is used
    call = _table_call(q1, k_pool, v_pool, blocks, seq_lens, first_offset, None, None, None, None, False, None, None,
                       group_size, bits, np.empty((q1.shape[0], 1, 1, 1), np.float32))
    return call


def block_table_shared_prefix(k_pool, v_pool, blocks, seq_lens, first_offset=None, min_suffix=0, group_size=64,
                              bits=4):
    """shared_prefix for sequences given by a block table (host arrays, as
    block_table_attention's): the tokens every sequence holds in the same
    pool rows, leaving each min_suffix own tokens (kva_view_shared_prefix)."""
    from .paged import _int

    call = _table_view(k_pool, v_pool, blocks, seq_lens, first_offset, group_size, bits)
    tokens = ctypes.c_int64()
    C.check(lib.kva_view_shared_prefix(ctypes.byref(call.view), _int(min_suffix, "min_suffix"), ctypes.byref(tokens)))
    return tokens.value


def split_block_table(k_pool, v_pool, blocks, seq_lens, first_offset, prefix_tokens, group_size=64, bits=4):
    """The prefix and suffix tables of kva_block_table_split: ((blocks [1, m],
    seq_lens [1], first_offset [1]), (blocks [B, m'], seq_lens [B],
    first_offset [B])) int32, the blocks views of the given table's rows;
    prefix_tokens in [1, block_table_shared_prefix(..., min_suffix=1)]."""
    from .paged import _int, kva_block_table

    from .paged import lib as plib  # noqa: F401 (kva_block_table's prototypes)

    C._proto("kva_block_table_split", ctypes.c_int, _P(C.kva_kv_view), ctypes.c_int64, _P(ctypes.c_int32),
             _P(ctypes.c_int32), _P(kva_block_table), _P(kva_block_table))
    call = _table_view(k_pool, v_pool, blocks, seq_lens, first_offset, group_size, bits)
    base = ctypes.cast(ctypes.cast(call.view.table, _P(kva_block_table)).contents.blocks, ctypes.c_void_p).value
    bl = next(x for x in call.keep if isinstance(x, np.ndarray) and x.ndim == 2 and x.ctypes.data == base)
    B = bl.shape[0]
    lens, first = np.empty(B + 1, np.int32), np.empty(B + 1, np.int32)
    pre, suf = kva_block_table(), kva_block_table()
    _i32p = _P(ctypes.c_int32)
    C.check(lib.kva_block_table_split(ctypes.byref(call.view), _int(prefix_tokens, "prefix_tokens"),
                                      lens.ctypes.data_as(_i32p), first.ctypes.data_as(_i32p), ctypes.byref(pre),
                                      ctypes.byref(suf)))
    skip = (ctypes.cast(suf.blocks, ctypes.c_void_p).value - base) // 4  # whole blocks before the suffixes
    return ((bl[:1, :pre.max_blocks], lens[:1].copy(), first[:1].copy()),
            (bl[:, skip:skip + suf.max_blocks], lens[1:].copy(), first[1:].copy()))


def block_table_cascade_attention(q, k_pool, v_pool, prefix, suffix, scale=None, mask=None, softcap=None, sinks=None,
                                  group_size=64, bits=4, threads=None, *, out=None, context=None, return_lse=False,
                                  lse_base2=False, exact=False):
    """cascade_attention over caller pools addressed by block tables:
    prefix = (blocks [1, m], seq_lens [1], first_offset [1] or None) of the
    shared tokens, suffix = (blocks [B, m'], seq_lens [B], first_offset [B]
    or None) of each sequence's own tokens after them (split_block_table
    gives both); the other arguments as cascade_attention. numpy pools and
    host tables on the CPU; PyTorch CUDA tensors (pools, int32 tables on the
    device) on CUDA, where the prefix must hold >= min(B L, 16) tokens."""
    from . import _flags, default_context
    from .paged import _table_call

    _check_mask(mask)
    q = _token_major(q)
    if len(prefix) != 3 or len(suffix) != 3:
        raise C.error(C.EINVAL, "prefix and suffix must be (blocks, seq_lens, first_offset) tuples")
    if _cuda.is_cuda_array(q):
        return _table_cascade_cuda(q, k_pool, v_pool, prefix, suffix, scale, mask, softcap, sinks, group_size, bits,
                                   out, context, return_lse, lse_base2, exact)
    scall = _table_call(q, k_pool, v_pool, *suffix, scale, mask, None, None, False, softcap, sinks, group_size, bits,
                        out)
    scall.params.flags = _flags(exact)
    pcall = _table_view(k_pool, v_pool, *prefix, group_size, bits)
    lse = lt = None
    if return_lse:
        lse = np.empty(scall.out_array.shape[:3], np.float32)
        lt = C.tensor(lse, "lse", output=True)
    ctx = context if context is not None else default_context(threads)
    with ctx.lock:
        C.check(lib.kva_cascade_attention(ctx.handle, ctypes.byref(scall.q), ctypes.byref(pcall.view),
                                          ctypes.byref(scall.view), ctypes.byref(scall.params),
                                          ctypes.byref(scall.out), ctypes.byref(lt) if lt is not None else None,
                                          C.LSE_BASE2 if lse_base2 else 0, None, 0))
    return (scall.out_array, lse) if return_lse else scall.out_array


__all__ += ["block_table_cascade_attention", "block_table_shared_prefix", "split_block_table"]


def _cuda_table(call, blocks, seq_lens, first_offset, what):
    """A kva_block_table of int32 device arrays (kept alive by call)."""
    from .paged import kva_block_table

    bl, bshape = _cuda._int32_device(call, blocks, what + ".blocks", 2)
    B, mb = bshape
    if B > 1 and (bl.stride[0] % 4 or bl.stride[0] < 4 * mb):
        raise C.error(C.ESTRIDE, "%s.blocks: row stride %d bytes must be a multiple of 4 and >= 4 * max_blocks"
                      % (what, bl.stride[0]))
    sl, sshape = _cuda._int32_device(call, seq_lens, what + ".seq_lens", 1)
    if sshape != (B,):
        raise C.error(C.ESHAPE, "%s.seq_lens must have shape [B] = [%d] (the rows of blocks)" % (what, B))
    t = kva_block_table()
    t.batch, t.max_blocks, t.row_stride = B, mb, (bl.stride[0] // 4 if B > 1 else 0)
    t.blocks = ctypes.cast(bl.data, _P(ctypes.c_int32))
    t.seq_lens = ctypes.cast(sl.data, _P(ctypes.c_int32))
    if first_offset is not None:
        fo, fshape = _cuda._int32_device(call, first_offset, what + ".first_offset", 1)
        if fshape != (B,):
            raise C.error(C.ESHAPE, "%s.first_offset must have shape [B] = [%d]" % (what, B))
        t.first_offset = ctypes.cast(fo.data, _P(ctypes.c_int32))
    call.keep.append(t)
    return t


def _table_cascade_cuda(q, k_pool, v_pool, prefix, suffix, scale, mask, softcap, sinks, group_size, bits, out,
                        context, return_lse, lse_base2, exact):
    from . import _flags
    from .paged import lib as plib

    call = _cuda._Call(q, k_pool, v_pool, scale, mask, None, None, False, softcap, sinks, group_size, bits, None,
                       out)
    call.params.flags = _flags(exact)
    tp = _cuda_table(call, *prefix, "prefix")
    ts = _cuda_table(call, *suffix, "suffix")
    pview = plib.kva_view_block_table(ctypes.byref(call.view.k), ctypes.byref(call.view.v), ctypes.byref(tp))
    sview = plib.kva_view_block_table(ctypes.byref(call.view.k), ctypes.byref(call.view.v), ctypes.byref(ts))
    return _run_cascade_cuda(call, q, pview, sview, context, return_lse, lse_base2)
