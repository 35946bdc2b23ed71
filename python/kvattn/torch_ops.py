"""PyTorch operators of kvattn (torch.ops.kvattn.*), from the compiled
extension libkvattn_torch.so: tensors become the library's descriptors in
C++, on the tensors' device and current CUDA stream, with meta kernels for
torch.compile (no graph break) and nothing that synchronizes, so the ops can
be captured in CUDA graphs. Optional: without torch or the extension,
kvattn works as before (kvattn.attention then takes the ctypes path).

    import torch, kvattn.torch_ops
    ops = kvattn.torch_ops.load()            # torch.ops.kvattn, or raises ImportError
    out = ops.attention(q, k, v, causal=True)                    # float K/V
    out = ops.attention(q, kp, vp, k_scales=ks, k_biases=kb, v_scales=vs, v_biases=vb,
                        bits=4, group_size=64, causal=True)      # MLX-packed K/V
    ops.attention_out(out, q, k, v, causal=True)                 # into a preallocated out

The extension is found through $KVATTN_TORCH_LIB, else _lib/libkvattn_torch.so
in this package (wheels), else next to the libkvattn.so that kvattn loaded,
else the tree's build/libkvattn_torch.so (`make torch-ext`). Ops (keyword
options after the tensors; see README "PyTorch"):

  attention(q, k, v, *opts, seq_lens=None) -> out
  attention_out(out, q, k, v, *opts, seq_lens=None)
  attention_lse(q, k, v, *opts, seq_lens=None, lse_base2=False) -> (out, lse)
  attention_lse_out(out, lse, q, k, v, ...)
  block_table_attention(q, k_pool, v_pool, block_table, seq_lens, first_offset=None, *opts) -> out
  block_table_attention_out / _lse / _lse_out (as above)
  cache_write(k_pool, v_pool, k, v, slots)
  cache_write_quantized(k_pool, k_scales, k_biases, v_pool, v_scales, v_biases, k, v, slots, bits=4, group_size=64)
  merge_states(parts_o, parts_lse, base2=False, dtype=None) -> (out, lse)
  merge_states_out(out, lse, parts_o, parts_lse, base2=False)
  hadamard(x) -> y, hadamard_out(out, x)   (kva_hadamard: y = H x on the last dim; out may be x)
  cache_write_rotated(k_pool, k_scales, k_biases, v_pool, v_scales, v_biases, k, v, slots, bits, group_size,
                      flags)               (kva_cache_write_ex; bits 0 and scales None for float pools)

A rotated attention call (kvattn.attention(..., rotated=...)) is composed of
these: hadamard_out(q', q), the attention op over the rotated cache into an
f32 out' (rotated V), hadamard_out(out, out'): the passes, dtypes and bits
of the C call with KVA_ATTN_ROTATED_K / _V.

opts, in the schemas' order (positional arguments parse faster than
keywords): causal, k_scales, k_biases, v_scales, v_biases, bits (0 = float
K/V), group_size, window (0 = none), scale (None = 1/sqrt(Dk)), softcap,
sinks (float32 [H]), segments, clamp, mask (a bool or additive float tensor
broadcastable to [B, H, L, N]), exact. Errors raise ValueError with the
library's message.

eager() gives the same attention calls as C entry points for plain eager
tensors, without the dispatcher's argument parsing (the host time of a
decode step); kvattn.attention and kvattn.block_table_attention use them
outside torch.compile and the operators under it.
"""
import os

import torch

from . import _capi as C
from . import _check_i32, _flags, _mask_kind, _tree_kind, _window
from ._capi import KvaError

__all__ = ["attention", "available", "block_table_attention", "cache_write", "eager", "hadamard", "library_path",
           "load", "load_error", "merge_states"]

_state = {"loaded": None, "error": None, "path": None, "eager": None}


def _candidates():
    env = os.environ.get("KVATTN_TORCH_LIB")
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    return [os.path.join(here, "_lib", "libkvattn_torch.so"),
            os.path.join(os.path.dirname(os.path.abspath(C.LIB_PATH)), "libkvattn_torch.so"),
            os.path.normpath(os.path.join(here, "..", "..", "build", "libkvattn_torch.so"))]


def load():
    """torch.ops.kvattn, loading the extension on first use; ImportError
    (naming the paths tried) when it cannot be loaded."""
    if _state["loaded"] is None:
        tried = []
        for path in _candidates():
            if not os.path.exists(path):
                tried.append(path + " (missing)")
                continue
            try:
                torch.ops.load_library(path)
            except (OSError, RuntimeError) as e:
                tried.append("%s (%s)" % (path, e))
                continue
            _state["path"] = path
            _state["eager"] = _eager_module(path)
            break
        _state["loaded"] = _state["path"] is not None
        if not _state["loaded"]:
            _state["error"] = ("kvattn torch extension not loaded; tried: " + "; ".join(tried)
                               + ". Build it with `make torch-ext PY=<python with torch>` or set KVATTN_TORCH_LIB")
    if not _state["loaded"]:
        raise ImportError(_state["error"])
    return torch.ops.kvattn


def _eager_module(path):
    """The extension's eager entry points (the module libkvattn_torch in the
    same file; None when it was built without them)."""
    import importlib.machinery
    import importlib.util

    try:
        loader = importlib.machinery.ExtensionFileLoader("libkvattn_torch", path)
        spec = importlib.util.spec_from_file_location("libkvattn_torch", path, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    except ImportError:
        return None


def available():
    """True when the extension loads (it is then used for torch tensors)."""
    try:
        load()
    except ImportError:
        return False
    return True


def load_error():
    """Why the extension did not load (None when it did or was not tried)."""
    return _state["error"]


def eager():
    """The extension's eager entry points for plain tensors outside
    torch.compile, the same calls as the operators without the dispatcher's
    argument parsing (positional arguments in the operators' schema order;
    NotImplemented where only the dispatcher can serve the call), or None:

      eager().attention_out(out, q, k, v, causal, k_scales, k_biases, v_scales, v_biases, bits, group_size,
                            window, scale, softcap, sinks, segments, clamp, mask, exact, seq_lens)
      eager().attention(q, k, v, <the same options>, seq_lens) -> out
      eager().block_table_attention_out(out, q, k_pool, v_pool, block_table, seq_lens, first_offset, <options>)
      eager().block_table_attention(q, k_pool, v_pool, block_table, seq_lens, first_offset, <options>) -> out
    """
    load()
    return _state["eager"]


def library_path():
    """Path of the loaded extension (None before load())."""
    return _state["path"]


# ---------------------------------------------------------------- kvattn.* on torch tensors
# kvattn.attention & co. call these for torch tensors when the extension
# loads; NotImplemented sends an argument the ops do not take (a numpy
# array, a list, a Context) back to the ctypes path.

_STATUS = {C.strerror(code): code for code in range(C.EINTERNAL, 0)}


def _kva_error(e):
    """The op's ValueError as a KvaError with the library's status code."""
    msg = str(e)
    return KvaError(_STATUS.get(msg.split(":", 1)[0], C.EINVAL), msg)


_Tensor = torch.Tensor


def _tensors(*xs):
    return all(x is None or isinstance(x, _Tensor) for x in xs)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # not taken by the ops: kvattn.attention's ctypes paths


def _kv(x, bits):
    """(data, scales, biases, bits) of a K/V operand: a tensor (float, bits 0)
    or a (packed, scales, biases) tuple with `bits`; None when not tensors
    (or fp8 tensors)."""
    if isinstance(x, _Tensor):
        return None if x.dtype in _FP8 else (x, None, None, 0)
    if isinstance(x, (tuple, list)) and len(x) == 3 and _tensors(*x):
        return x[0], x[1], x[2], bits
    return None


def _options(k, v, scale, mask, window, segments, softcap, sinks, group_size, bits, clamp, exact, tree_mask=None):
    """(k data, v data, the ops' options in schema order: causal, k_scales,
    k_biases, v_scales, v_biases, bits, group_size, window, scale, softcap,
    sinks, segments, clamp, mask, exact) from kvattn.attention's arguments;
    None if some argument is not for the ops. Positional arguments: the
    operators parse them faster than keywords."""
    kk, vv = _kv(k, bits), _kv(v, bits)
    if kk is None or vv is None:
        return None
    if not ((segments is None or isinstance(segments, _Tensor)) and (sinks is None or isinstance(sinks, _Tensor))):
        return None
    if tree_mask is not None:  # the ops take a tree's bits as an int32 / uint32 mask (the prefix causal)
        if not isinstance(tree_mask, _Tensor):
            return None
        if tree_mask.dtype not in (torch.int32, torch.uint32):
            raise C.error(C.EDTYPE, "tree_mask has dtype %s (int32 or uint32 packed bits expected)" % tree_mask.dtype)
        _tree_kind(mask, tree_mask)
        causal, marr = True, tree_mask
    elif mask is None:
        causal, marr = False, None
    elif isinstance(mask, _Tensor):
        causal, marr = False, mask
    elif isinstance(mask, str):
        causal, marr = _mask_kind(mask) == C.MASK_CAUSAL, None
    else:
        return None
    if kk[3] != vv[3]:
        raise C.error(C.EINVAL, "k and v must both be tensors or both (packed, scales, biases) tuples")
    if type(group_size) is not int or not -2**31 <= group_size < 2**31:
        group_size = _check_i32(group_size, "group_size")
    if exact is not False and exact is not True:
        exact = bool(_flags(exact))
    return kk[0], vv[0], (causal, kk[1], kk[2], vv[1], vv[2], kk[3], group_size,
                          0 if window is None else _window(window), scale, softcap, sinks, segments, bool(clamp),
                          marr, exact)


def _rotated(call, q, v, bits, out, exact, rotated, return_lse):
    """A rotated call composed of the ops (the module's docstring): call(q',
    out') runs the unrotated op. Returns its result with out un-rotated."""
    flags = _flags(exact, rotated)
    if not _tensors(q, out) or not isinstance(q, _Tensor):
        return NotImplemented
    vv = _kv(v, bits)
    if vv is None:
        return NotImplemented
    ops = load()
    try:
        qr = q
        if flags & C.ATTN_ROTATED_K:  # q' in q's dtype (f32 for f32 queries and exact calls)
            qdt = torch.float32 if exact or q.dtype == torch.float32 else q.dtype
            qr = torch.empty(q.shape, dtype=qdt, device=q.device)
            ops.hadamard_out(qr, q)
        if not flags & C.ATTN_ROTATED_V:
            return call(qr, out)
        dv = vv[0].shape[-1] * 32 // vv[3] if vv[3] else vv[0].shape[-1]
        o32 = torch.empty(tuple(q.shape[:3]) + (dv,), dtype=torch.float32, device=q.device)
        res = call(qr, o32)
        if res is NotImplemented:
            return res
        if out is None:
            out = torch.empty(o32.shape, dtype=q.dtype if q.is_floating_point() else torch.float32, device=q.device)
        ops.hadamard_out(out, o32)
        return (out, res[1]) if return_lse else out
    except ValueError as e:
        if isinstance(e, KvaError):
            raise
        raise _kva_error(e) from None


def hadamard(x, out=None):
    """kvattn.hadamard on a torch tensor through the ops (out None: a new tensor)."""
    if not isinstance(x, _Tensor) or not _tensors(out):
        return NotImplemented
    ops = load()
    try:
        if out is None:
            return ops.hadamard(x)
        ops.hadamard_out(out, x)
        return out
    except ValueError as e:
        raise _kva_error(e) from None


def attention(q, k, v, scale=None, mask=None, window=None, segments=None, softcap=None, sinks=None, group_size=64,
              bits=4, *, clamp=False, seq_lens=None, out=None, return_lse=False, lse_base2=False, exact=False,
              tree_mask=None, rotated=None):
    """kvattn.attention on torch tensors through the ops (see its documentation)."""
    if rotated:
        return _rotated(lambda qr, o: attention(qr, k, v, scale, mask, window, segments, softcap, sinks, group_size,
                                                bits, clamp=clamp, seq_lens=seq_lens, out=o, return_lse=return_lse,
                                                lse_base2=lse_base2, exact=exact, tree_mask=tree_mask),
                        q, v, bits, out, exact, rotated, return_lse)
    opts = _options(k, v, scale, mask, window, segments, softcap, sinks, group_size, bits, clamp, exact, tree_mask)
    if opts is None or not _tensors(seq_lens, out):
        return NotImplemented
    kd, vd, o = opts
    ops = load()
    try:
        if return_lse:
            if out is None:
                return ops.attention_lse.default(q, kd, vd, *o, seq_lens, bool(lse_base2))
            lse = q.new_empty(out.shape[:3], dtype=torch.float32)
            ops.attention_lse_out.default(out, lse, q, kd, vd, *o, seq_lens, bool(lse_base2))
            return out, lse
        eager = _state["eager"] if not torch.compiler.is_compiling() else None
        if out is None:
            res = NotImplemented if eager is None else eager.attention(q, kd, vd, *o, seq_lens)
            return ops.attention.default(q, kd, vd, *o, seq_lens) if res is NotImplemented else res
        if eager is None or eager.attention_out(out, q, kd, vd, *o, seq_lens) is NotImplemented:
            ops.attention_out.default(out, q, kd, vd, *o, seq_lens)
        return out
    except ValueError as e:
        raise _kva_error(e) from None


def block_table_attention(q, k_pool, v_pool, blocks, seq_lens, first_offset=None, scale=None, mask=None, window=None,
                          segments=None, softcap=None, sinks=None, group_size=64, bits=4, *, clamp=False, out=None,
                          exact=False, tree_mask=None, rotated=None):
    """kvattn.block_table_attention on torch tensors through the ops."""
    if rotated:
        return _rotated(lambda qr, o: block_table_attention(qr, k_pool, v_pool, blocks, seq_lens, first_offset, scale,
                                                            mask, window, segments, softcap, sinks, group_size, bits,
                                                            clamp=clamp, out=o, exact=exact, tree_mask=tree_mask),
                        q, v_pool, bits, out, exact, rotated, False)
    opts = _options(k_pool, v_pool, scale, mask, window, segments, softcap, sinks, group_size, bits, clamp, exact,
                    tree_mask)
    if opts is None or not _tensors(blocks, seq_lens, first_offset, out) or blocks is None or seq_lens is None:
        return NotImplemented
    kd, vd, o = opts
    ops = load()
    try:
        eager = _state["eager"] if not torch.compiler.is_compiling() else None
        if out is None:
            res = (NotImplemented if eager is None else
                   eager.block_table_attention(q, kd, vd, blocks, seq_lens, first_offset, *o))
            if res is NotImplemented:
                res = ops.block_table_attention.default(q, kd, vd, blocks, seq_lens, first_offset, *o)
            return res
        if eager is None or eager.block_table_attention_out(out, q, kd, vd, blocks, seq_lens, first_offset,
                                                            *o) is NotImplemented:
            ops.block_table_attention_out.default(out, q, kd, vd, blocks, seq_lens, first_offset, *o)
        return out
    except ValueError as e:
        raise _kva_error(e) from None


def cache_write(k_pool, v_pool, k, v, slots, group_size=64, bits=4, flags=0):
    """kvattn.cache_write on torch tensors through the ops (pools written in
    place); flags: kva_cache_write_ex's rotation bits (cache_write_rotated)."""
    kp, vp = _kv(k_pool, bits), _kv(v_pool, bits)
    if kp is None or vp is None or not _tensors(k, v, slots):
        return NotImplemented
    ops = load()
    try:
        if flags and kp[3] == vp[3]:
            ops.cache_write_rotated(kp[0], kp[1], kp[2], vp[0], vp[1], vp[2], k, v, slots, kp[3],
                                    _check_i32(group_size, "group_size"), flags)
        elif kp[3] == 0 and vp[3] == 0:
            ops.cache_write(kp[0], vp[0], k, v, slots)
        elif kp[3] and vp[3]:
            ops.cache_write_quantized(kp[0], kp[1], kp[2], vp[0], vp[1], vp[2], k, v, slots,
                                      bits=_check_i32(bits, "bits"), group_size=_check_i32(group_size, "group_size"))
        else:
            raise C.error(C.EINVAL, "k_pool and v_pool must both be tensors or both (packed, scales, biases) tuples")
    except ValueError as e:
        if isinstance(e, KvaError):
            raise
        raise _kva_error(e) from None


def merge_states(parts, *, base2=False, out=None, dtype=None):
    """kvattn.merge_states on torch tensors through the ops: returns (out, lse)."""
    parts = list(parts)
    if not parts or not all(isinstance(p, (tuple, list)) and len(p) == 2 and _tensors(*p) and p[0] is not None
                            and p[1] is not None for p in parts) or not _tensors(out):
        return NotImplemented
    if dtype is not None and not isinstance(dtype, torch.dtype):
        return NotImplemented
    os_, ls_ = [p[0] for p in parts], [p[1] for p in parts]
    ops = load()
    try:
        if out is None:
            return ops.merge_states(os_, ls_, base2=bool(base2), dtype=dtype)
        lse = torch.empty(ls_[0].shape, dtype=torch.float32, device=ls_[0].device)
        ops.merge_states_out(out, lse, os_, ls_, base2=bool(base2))
        return out, lse
    except ValueError as e:
        raise _kva_error(e) from None
