"""kvattn — fused attention of a few query rows over a long, possibly
MLX-affine-quantized KV cache: the Python binding (ctypes over libkvattn.so,
numpy arrays, bfloat16 through ml_dtypes).

    import numpy as np, kvattn
    q = np.random.randn(1, 8, 1, 128).astype(np.float32)         # [B, H, L, D]
    k = np.random.randn(1, 2, 1000, 128).astype(np.float32)      # [B, KVH, N, D]
    v = np.random.randn(1, 2, 1000, 128).astype(np.float32)
    kq, vq = kvattn.quantize(k), kvattn.quantize(v)              # (packed, scales, biases)
    out = kvattn.attention(q, kq, vq, mask="causal")             # [B, H, L, D], q's dtype

Arrays are passed to the library in place (no copy) with their strides, so a
view such as ``cache[:, :, :n]`` costs nothing; an input whose innermost
dimension is not contiguous (or that has a negative stride) is copied first.
Every error of the library raises ``KvaError`` (a ``ValueError``) whose message
names the offending argument.

The library is found through $KVATTN_LIB, else _lib/libkvattn.so in this
package (what `pip install .` bundles), else ../../build/libkvattn.so next to
this package (the tree's `make`), else the system's library path.
"""
import atexit
import ctypes
import os
import threading
import weakref

import numpy as np

from . import _capi as C
from ._capi import BFLOAT16 as bfloat16
from ._capi import KvaError, lib

__all__ = [
    "Context", "KvaError", "attention", "attention_kernel", "attention_path", "bfloat16", "build_info", "cache_write",
    "causal_mask", "cpu_simd", "cuda_device_count", "default_context", "dequantize", "hadamard",
    "hadamard_dim_supported", "image_mask", "quantize", "reference_attention", "set_cpu_simd", "tree_bits", "version",
]

__version__ = lib.kva_version().decode()

_QUANT_BITS = (2, 4, 8)
_WORD_BITS = 32


def version():
    """Version of the linked library, "MAJOR.MINOR.PATCH"."""
    return lib.kva_version().decode()


def build_info():
    """One line describing the library's build (compiler, SIMD levels, CUDA targets)."""
    return lib.kva_build_info().decode()


def cpu_simd():
    """SIMD level the CPU kernels use: "avx512", "avxvnni", "avx2" or "portable"."""
    return lib.kva_cpu_simd().decode()


def set_cpu_simd(level=None):
    """Force a SIMD level ("avx512", "avxvnni", "avx2", "portable"); None = best available."""
    C.check(lib.kva_cpu_set_simd(None if level is None else level.encode()))


def cuda_device_count():
    """CUDA devices visible to the library (0 when built without CUDA)."""
    return lib.kva_cuda_device_count()


# ------------------------------------------------------------------ contexts


class Context:
    """A kva_context: the CPU thread pool (started once) and a workspace
    reused across calls. Usable as a context manager; close() frees it.

    threads: worker threads, None or 0 = all cores. Calls on one context are
    serialized (a lock); use one context per Python thread for parallel calls.
    """

    def __init__(self, threads=None, backend="cpu", device=0):
        backends = {"cpu": C.BACKEND_CPU, "cuda": C.BACKEND_CUDA}
        if backend not in backends:
            raise ValueError("backend must be 'cpu' or 'cuda', got %r" % (backend,))
        if threads is not None and not isinstance(threads, (int, np.integer)):
            raise TypeError("threads must be an int or None, got %r" % (threads,))
        for name, x in (("threads", threads), ("device", device)):
            if x is not None:
                C.int32(int(x), name)
        opts = C.kva_context_opts()
        opts.backend = backends[backend]
        opts.threads = 0 if threads is None else int(threads)
        opts.device = int(device)
        opts.stream = None
        ptr = ctypes.c_void_p()
        C.check(lib.kva_context_create(ctypes.byref(ptr), ctypes.byref(opts)))
        self._ptr = ptr.value
        self._destroy = lib.kva_context_destroy  # kept: usable from __del__ at interpreter exit
        self.backend = backend
        self.lock = threading.Lock()
        _all_contexts.add(self)

    @property
    def handle(self):
        if not self._ptr:
            raise ValueError("the kvattn Context is closed")
        return self._ptr

    @property
    def threads(self):
        """Worker threads of the context's pool."""
        return lib.kva_context_threads(self.handle)

    def close(self):
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            self._destroy(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def __repr__(self):
        state = "closed" if not self._ptr else "threads=%d" % self.threads
        return "<kvattn.Context %s %s>" % (self.backend, state)


_contexts = {}
_contexts_lock = threading.Lock()
_all_contexts = weakref.WeakSet()


def _after_fork_in_child():
    """A lock that another thread held at fork() stays held in the child,
    where that thread does not exist: the child starts with fresh locks (the
    library keeps each context itself consistent across a fork)."""
    global _contexts_lock
    _contexts_lock = threading.Lock()
    for ctx in list(_all_contexts):
        ctx.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def default_context(threads=None):
    """The module's CPU context for `threads` (None = all cores), created on
    first use and kept until exit."""
    if threads is not None and not isinstance(threads, (int, np.integer)):
        raise TypeError("threads must be an int or None, got %r" % (threads,))
    key = 0 if threads is None else int(threads)
    with _contexts_lock:
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = _contexts[key] = Context(threads=key)
        return ctx


@atexit.register
def _close_contexts():
    with _contexts_lock:
        for ctx in _contexts.values():
            ctx.close()
        _contexts.clear()


# -------------------------------------------------------------- quantization


def _check_int(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError("%s must be an int, got %r" % (name, value))
    return int(value)


def _check_i32(value, name):
    """An int for a C int argument or field (C.int32)."""
    return C.int32(_check_int(value, name), name)


def _packed_words(d, bits):
    """u32 words per row of d elements (a stand-in of 1 when bits is invalid:
    the library then reports bits)."""
    return d * bits // _WORD_BITS if bits in _QUANT_BITS else 1


def _groups(d, group_size):
    return d // group_size if group_size > 0 and d % group_size == 0 else 1


def _flat(arr):
    """Ranks above the library's 4 are flattened into the leading dims."""
    return arr if arr.ndim <= C.MAX_DIMS else arr.reshape(-1, arr.shape[-1])


def quantize(w, group_size=64, bits=4):
    """MLX affine quantization along the last axis, bit for bit with
    mlx.core.quantize: returns (packed uint32 [..., D*bits/32],
    scales [..., D/group_size], biases [..., D/group_size]), scales and biases
    in w's dtype (float32, float16 or bfloat16). bits 2/4/8, group 32/64/128."""
    group_size = _check_i32(group_size, "group_size")
    bits = _check_i32(bits, "bits")
    w = C.prepare_input(w, "w")
    if w.ndim == 0:
        raise C.error(C.ESHAPE, "w must have rank >= 1, got a scalar")
    lead, d = w.shape[:-1], w.shape[-1]
    sdt = w.dtype if w.dtype in C.FLOAT_DTYPES else np.dtype(np.float32)
    packed = np.empty(lead + (_packed_words(d, bits),), np.uint32)
    scales = np.empty(lead + (_groups(d, group_size),), sdt)
    biases = np.empty_like(scales)
    wf = _flat(w)
    out = C.kva_kv()
    out.data = C.tensor(_flat(packed), "out.data", output=True)
    out.scales = C.tensor(_flat(scales), "out.scales", output=True)
    out.biases = C.tensor(_flat(biases), "out.biases", output=True)
    out.bits = bits
    out.group_size = group_size
    wt = C.tensor(wf, "w")
    C.check(lib.kva_quantize(ctypes.byref(wt), ctypes.byref(out)))
    return packed, scales, biases


def dequantize(packed, scales, biases, group_size=64, bits=4, dtype=None):
    """Inverse of quantize: w[..., d] = scale * q + bias, shaped [..., D]
    (D = packed.shape[-1] * 32 / bits), in scales' dtype unless `dtype` is given."""
    group_size = _check_i32(group_size, "group_size")
    bits = _check_i32(bits, "bits")
    kv = C.kva_kv()
    arrs = [C.prepare_input(a, n) for a, n in ((packed, "q.data"), (scales, "q.scales"), (biases, "q.biases"))]
    p, s, b = arrs
    if p.ndim == 0:
        raise C.error(C.ESHAPE, "packed must have rank >= 1, got a scalar")
    if dtype is None:
        dtype = s.dtype if s.dtype in C.FLOAT_DTYPES else np.dtype(np.float32)
    dtype = np.dtype(dtype)
    d = p.shape[-1] * _WORD_BITS // bits if bits in _QUANT_BITS else p.shape[-1]
    out = np.empty(p.shape[:-1] + (d,), dtype)
    kv.data = C.tensor(_flat(p), "q.data")
    kv.scales = C.tensor(_flat(s), "q.scales")
    kv.biases = C.tensor(_flat(b), "q.biases")
    kv.bits = bits
    kv.group_size = group_size
    ot = C.tensor(_flat(out), "out", output=True)
    C.check(lib.kva_dequantize(ctypes.byref(kv), ctypes.byref(ot)))
    return out


# --------------------------------------------------------------------- masks


def _window(window):
    """None -> 0 (no window). 0 is refused here (the C API's 0 means "none",
    which a Python caller spells None); negative values go to the library."""
    if window is None:
        return 0
    window = _check_i32(window, "window")
    if window == 0:
        raise C.error(C.EINVAL, "window = 0 must be > 0 (None = no window)")
    return window


def causal_mask(n, offset=0, window=None):
    """The seed's createCausalMask: bool [n, offset + n]; row r (position
    offset + r) sees key j iff j <= offset + r (and j > offset + r - window)."""
    n = _check_int(n, "n")
    offset = _check_int(offset, "offset")
    w = _window(window)
    shape = (n, offset + n) if n > 0 and offset >= 0 else (1, 1)
    out = np.empty(shape, np.bool_)
    ot = C.tensor(out, "out", output=True)
    C.check(lib.kva_causal_mask(n, offset, w, ctypes.byref(ot)))
    return out


def image_mask(segments, window=None, clamp=False):
    """Image-token mask of n tokens: segments int [n] (0 = text, k > 0 = image k)
    -> bool [n, n], allow = causal_window OR (seg[i] == seg[j] != 0), the image
    exception limited to the window too when clamp. One image without clamp is
    the seed's bidirMask; a bool array is taken as that (True = image 1)."""
    w = _window(window)
    seg = C.int32_array(segments, "segments", allow_bool=True)
    n = seg.shape[0] if seg.ndim >= 1 and seg.shape[0] > 0 else 1
    out = np.empty((n, n), np.bool_)
    st = C.tensor(seg, "segments")
    ot = C.tensor(out, "out", output=True)
    C.check(lib.kva_image_mask(ctypes.byref(st), w, int(bool(clamp)), ctypes.byref(ot)))
    return out


# ----------------------------------------------------------------- attention


_torch_ops_module = None  # kvattn.torch_ops once imported, False when its extension does not load


def _torch_ops(x, threads=None, context=None):
    """kvattn.torch_ops when x is a torch tensor, no explicit CPU threads or
    context is asked for, and the compiled extension loads; else None."""
    global _torch_ops_module
    if threads is not None or context is not None or not type(x).__module__.startswith("torch"):
        return None
    if _torch_ops_module is None:
        from . import torch_ops
        _torch_ops_module = torch_ops if torch_ops.available() else False
    return _torch_ops_module or None


def _params(scale, softcap):
    """kva_attn_params with the scalar options checked (0 means "default" in
    C; in Python that is spelled None)."""
    p = C.kva_attn_params()
    for name, x in (("scale", scale), ("softcap", softcap)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating))):
            raise TypeError("%s must be a number or None, got %r" % (name, x))
    if scale is not None:
        scale = float(scale)
        if scale == 0.0:
            raise C.error(C.EINVAL, "scale = 0 is not a scale (None = 1/sqrt(Dk))")
        p.scale = scale
    if softcap is not None:
        softcap = float(softcap)
        if softcap == 0.0:
            raise C.error(C.EINVAL, "softcap = 0 must be > 0 (None = no softcap)")
        p.softcap = softcap
    return p


def _rotation(rotated, name, k_bit, v_bit):
    """The flag bits of a rotation argument: None / False = none, True or
    "kv" = K and V, "k" = K only, "v" = V only."""
    if rotated is None or rotated is False:
        return 0
    if rotated is True:
        return k_bit | v_bit
    bits = {"kv": k_bit | v_bit, "k": k_bit, "v": v_bit}.get(rotated) if isinstance(rotated, str) else None
    if bits is None:
        raise C.error(C.EINVAL, "%s = %r: None, True (K and V), 'kv', 'k' or 'v'" % (name, rotated))
    return bits


def _flags(exact, rotated=None):
    """kva_attn_params.flags of the `exact` (a bool) and `rotated` arguments."""
    if not isinstance(exact, (bool, np.bool_)):
        raise TypeError("exact must be a bool, got %r" % (exact,))
    return (C.ATTN_EXACT if exact else 0) | _rotation(rotated, "rotated", C.ATTN_ROTATED_K, C.ATTN_ROTATED_V)


def _no_torch_rotation(x, rotated, what):
    """A rotated call on CPU torch tensors needs the compiled operators
    (`make torch-ext`; CUDA tensors also run through kvattn.cuda)."""
    if rotated and type(x).__module__.startswith("torch") and not _cuda.is_cuda_array(x):
        raise C.error(C.EUNSUPPORTED, "%s: a rotation on CPU torch tensors runs through the torch operators "
                      "(make torch-ext), which did not load: pass numpy arrays or CUDA tensors" % what)


def hadamard(x, out=None, *, threads=None, context=None):
    """y = H_D x on the last dim (kva_hadamard): H_D the normalized
    Walsh-Hadamard matrix (symmetric, orthonormal, H H = I), D a power of two
    16..512 or 3 * 2^k (48, 96, 192, 384; kvattn.h gives the 3x3 block);
    computed in f32, rounded once to out's dtype. x: float32/float16/bfloat16,
    rank 1..4; out: None (a new array of x's dtype), an array of x's shape
    (may be x itself: in place). numpy arrays on the CPU; CUDA arrays
    (PyTorch CUDA tensors, __cuda_array_interface__) on their device and
    stream (kvattn.cuda.hadamard). Returns out."""
    ops = _torch_ops(x, threads, context)
    if ops is not None:
        res = ops.hadamard(x, out)
        if res is not NotImplemented:
            return res
    if _cuda.is_cuda_array(x):
        return _cuda.hadamard(x, out, context=context)
    _no_torch_rotation(x, True, "hadamard")
    x = C.prepare_input(x, "x")
    if out is None:
        out = np.empty(x.shape, x.dtype)
    if not isinstance(out, np.ndarray):
        raise TypeError("out must be a numpy array, got %s" % type(out).__name__)
    tx = C.tensor(x, "x")
    ty = C.tensor(out, "y", output=True)
    ctx = context if context is not None else default_context(threads)
    with ctx.lock:
        C.check(lib.kva_hadamard(ctx.handle, ctypes.byref(tx), ctypes.byref(ty)))
    return out


def hadamard_dim_supported(d):
    """True when hadamard() (and the rotated attention) support head dim d."""
    return bool(lib.kva_hadamard_dim_supported(_check_int(d, "d")))


def _mask_kind(mask):
    """kva_mask_kind of the `mask` argument: None, "causal" or an array."""
    if mask is None:
        return C.MASK_NONE
    if isinstance(mask, str):
        if mask != "causal":
            raise C.error(C.EINVAL, "mask = %r: the only string mask is 'causal'" % mask)
        return C.MASK_CAUSAL
    return C.MASK_ARRAY


def _fp8_scales(scale, lead, name, keep, output=False):
    """kva_tensor of the float32 scales of fp8 rows whose leading dims are
    lead = (B, KVH, N) (pools: (num_blocks, KVH, block_size)): None = none
    (scale 1); a number = one scale for every row (strides 0); an array of
    shape lead or lead + (1,), or broadcastable to it (broadcast dims get
    stride 0). output: the array is written in place (kvattn.cache_write's
    per-row scales): a writeable float32 numpy array of shape lead [+ (1,)]."""
    if scale is None:
        return C.kva_tensor()
    if isinstance(scale, (int, float, np.integer, np.floating)) and not isinstance(scale, (bool, np.bool_)):
        a = np.full((1, 1, 1, 1), scale, np.float32)
        keep.append(a)
        return C.tensor(np.broadcast_to(a, tuple(lead) + (1,)) if len(lead) == 3 else a, name)
    if output:
        if not isinstance(scale, np.ndarray):
            raise TypeError("%s must be a number or a numpy array, got %s" % (name, type(scale).__name__))
        a = scale[..., None] if scale.ndim == 3 else scale
        keep.append(a)
        return C.tensor(a, name, output=True)
    a = np.asarray(scale)
    if a.dtype != np.float32 and a.dtype.kind == "f":
        a = a.astype(np.float32)
    if a.ndim == 3:
        a = a[..., None]
    if len(lead) == 3:
        try:
            a = np.broadcast_to(a, tuple(lead) + (1,))
        except ValueError:
            pass  # the library names the dimension
    keep.append(a)
    return C.tensor(C.prepare_input(a, name), name)


def _kv_operand(x, name, bits, group_size, keep, scale=None):
    """kva_kv of one K or V operand: an array [B, KVH, N, D] (float, or fp8
    with its scales `scale`) or a (packed, scales, biases) tuple (mlx-lm's
    quantized cache layout)."""
    kv = C.kva_kv()
    if isinstance(x, (tuple, list)):
        if len(x) != 3:
            raise C.error(C.EINVAL, "%s must be an array or a (packed, scales, biases) tuple, got %d items"
                          % (name, len(x)))
        p, s, b = (C.prepare_input(a, name + sfx) for a, sfx in zip(x, (".data", ".scales", ".biases")))
        keep += [p, s, b]
        kv.data = C.tensor(p, name + ".data")
        kv.scales = C.tensor(s, name + ".scales")
        kv.biases = C.tensor(b, name + ".biases")
        kv.bits = bits
        kv.group_size = group_size
        dim = p.shape[-1] * _WORD_BITS // bits if p.ndim and bits in _QUANT_BITS else 0
        return kv, p.shape, dim
    a = C.prepare_input(x, name)
    keep.append(a)
    kv.data = C.tensor(a, name + ".data")
    if a.dtype in C.FP8_DTYPES:
        kv.scales = _fp8_scales(scale, a.shape[:3] if a.ndim == 4 else (), name + ".scales", keep)
    elif scale is not None:
        raise C.error(C.EINVAL, "%s_scale is for fp8 %s (float8_e4m3fn / float8_e5m2); %s is %s"
                      % (name, name.upper(), name, a.dtype))
    return kv, a.shape, (a.shape[-1] if a.ndim else 0)


def _tree_kind(mask, tree_mask):
    """The mask kind of a call with a tree_mask: KVA_MASK_TREE, whose prefix
    follows the causal rule (mask None or "causal")."""
    if not (mask is None or (isinstance(mask, str) and mask == "causal")):
        raise C.error(C.EINVAL, "tree_mask: mask must be None or 'causal' (the prefix before the L new tokens "
                      "is causal), got %r" % (mask if isinstance(mask, str) else type(mask).__name__))
    return C.MASK_TREE


def _tree_bits(tree_mask):
    """The packed bits of tree_mask as uint32 [B or 1, L, ceil(L/32)]: a
    numpy array (or anything np.asarray takes, e.g. a CPU torch tensor) of
    uint32 or int32 (the same bits) [B, L, W], or [L, W] for one tree shared
    by every sequence. Other dtypes and ranks go to the library, which names
    them."""
    a = np.asarray(tree_mask)
    if a.dtype == np.int32:
        a = a.view(np.uint32)
    if a.ndim == 2:
        a = a[None]
    return C.prepare_input(a, "tree_mask")


class _Call:
    """The descriptors of one attention call, and the arrays they point into."""

    def __init__(self, q, k, v, scale, mask, window, segments, clamp, softcap, sinks, group_size, bits,
                 seq_lens, out, tree_mask=None, k_scale=None,
                 v_scale=None):
        group_size = _check_i32(group_size, "group_size")
        bits = _check_i32(bits, "bits")
        keep = self.keep = []
        q = C.prepare_input(q, "q")
        keep.append(q)
        self.q = C.tensor(q, "q")
        kk, kshape, _ = _kv_operand(k, "k", bits, group_size, keep, k_scale)
        vv, _, dv = _kv_operand(v, "v", bits, group_size, keep, v_scale)
        view = self.view = C.kva_kv_view()
        view.layout = C.LAYOUT_CONTIGUOUS
        view.k, view.v = kk, vv
        B, H, L = q.shape[:3] if q.ndim == 4 else (1, 1, 1)
        kB, N = (kshape[0], kshape[2]) if len(kshape) == 4 else (B, None)

        if out is None:
            odt = q.dtype if q.dtype in C.FLOAT_DTYPES else np.dtype(np.float32)
            out = np.empty((B, H, L, max(dv, 1)), odt)
        elif not isinstance(out, np.ndarray):
            raise TypeError("out must be a numpy array, got %s" % type(out).__name__)
        self.out_array = out
        self.out = C.tensor(out, "out", output=True)

        if seq_lens is not None:
            sl = C.int32_array(seq_lens, "seq_lens")
            if sl.dtype != np.int32:
                raise C.error(C.EDTYPE, "seq_lens has unsupported dtype %s (int32 expected)" % sl.dtype)
            if N is not None and sl.shape != (kB,):  # (a K of the wrong rank fails first in the library)
                raise C.error(C.ESHAPE, "seq_lens must have shape [B] = [%d], got %s" % (kB, list(sl.shape)))
            sl = np.ascontiguousarray(sl)
            keep.append(sl)
            view.seq_lens = sl.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))

        p = self.params = _params(scale, softcap)
        if sinks is not None:
            sk = np.ascontiguousarray(np.asarray(sinks), dtype=np.float32)
            if q.ndim == 4 and sk.shape != (H,):  # (a q of the wrong rank fails first in the library)
                raise C.error(C.ESHAPE, "sinks must have shape [H] = [%d], got %s" % (H, list(sk.shape)))
            keep.append(sk)
            p.sinks = sk.ctypes.data_as(ctypes.POINTER(ctypes.c_float))

        m = p.mask
        m.window = _window(window)
        m.segments_clamp = int(bool(clamp))
        if segments is not None:
            seg = C.int32_array(segments, "mask.segments", allow_bool=True)
            if seg.ndim == 1:
                seg = seg.reshape(1, -1)
            keep.append(seg)
            m.segments = C.tensor(seg, "mask.segments")
        if tree_mask is not None:
            m.kind = _tree_kind(mask, tree_mask)
            tb = _tree_bits(tree_mask)
            keep.append(tb)
            m.array = C.tensor(tb, "mask.array (tree bits)")
            return
        m.kind = _mask_kind(mask)
        if m.kind == C.MASK_ARRAY:
            ma = self._mask_array(np.asarray(mask), (B, H, L, N))
            keep.append(ma)
            m.array = C.tensor(ma, "mask.array")

    @staticmethod
    def _mask_array(ma, full):
        """A bool or additive float mask broadcast to [B, H, L, N] by strides
        (stride 0 on broadcast dims, as the library accepts); float64 becomes
        float32. A shape that does not broadcast goes to the library as it is,
        which names the dimension."""
        if ma.dtype == np.float64:
            ma = ma.astype(np.float32)
        if ma.ndim > C.MAX_DIMS:
            raise C.error(C.ESHAPE, "mask.array has rank %d (at most 4: [B, H, L, N])" % ma.ndim)
        ma = ma.reshape((1,) * (C.MAX_DIMS - ma.ndim) + ma.shape)
        if full[3] is not None:
            try:
                ma = np.broadcast_to(ma, full)
            except ValueError:
                pass
        inner_ok = ma.shape[-1] == 1 or ma.strides[-1] in (0, ma.itemsize)
        if not inner_ok or any(s < 0 for s in ma.strides):
            ma = np.ascontiguousarray(ma)
        return ma

    def refs(self):
        return (ctypes.byref(self.q), ctypes.byref(self.view), ctypes.byref(self.params),
                ctypes.byref(self.out))


def _is_torch_tensor(x):
    return type(x).__module__.split(".")[0] == "torch"


def _torch_cpu_fp8(*xs):
    """Is one of xs a torch CPU tensor of an fp8 dtype (which the compiled
    operators do not take: the call goes through numpy views)?"""
    for x in xs:
        if _is_torch_tensor(x) and not x.is_cuda and str(x.dtype) in ("torch.float8_e4m3fn", "torch.float8_e5m2"):
            return True
    return False


def _np_of_torch(x):
    """A numpy view of a torch CPU tensor (same memory; bfloat16 and fp8
    through ml_dtypes); anything else unchanged."""
    if not _is_torch_tensor(x):
        return x
    import torch
    x = x.detach()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(C.BFLOAT16)
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.view(torch.uint8).numpy().view(C.FLOAT8_E4M3 if x.dtype == torch.float8_e4m3fn else C.FLOAT8_E5M2)
    return x.numpy()


def _torch_of_np(a):
    """A torch CPU tensor on a numpy array's memory (bfloat16 included)."""
    import torch
    if a.dtype == C.BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _torch_cpu_call(fn, q, k, v, out, kw):
    """fn (kvattn.attention) on numpy views of torch CPU tensors (fp8 K/V),
    results as torch tensors (out, when given, written in place)."""
    conv = {n: _np_of_torch(x) for n, x in kw.items()}
    res = fn(_np_of_torch(q), _np_of_torch(k), _np_of_torch(v), out=None if out is None else _np_of_torch(out),
             **conv)
    if out is not None:
        return (out, _torch_of_np(res[1])) if isinstance(res, tuple) else out
    return tuple(_torch_of_np(r) for r in res) if isinstance(res, tuple) else _torch_of_np(res)


def attention(q, k, v, scale=None, mask=None, window=None, segments=None, softcap=None, sinks=None,
              group_size=64, bits=4, threads=None, *, clamp=False, seq_lens=None, out=None, context=None,
              return_lse=False, lse_base2=False, exact=False, tree_mask=None, k_scale=None,
              v_scale=None, rotated=None):
    """Attention of q [B, H, L, Dk] over K [B, KVH, N, Dk] / V [B, KVH, N, Dv].

    k, v: float arrays (float32/float16/bfloat16) or (packed, scales, biases)
      tuples in MLX's affine format with `bits` / `group_size` (the same for
      both; mlx-lm's QuantizedKVCache layout); strided views (e.g.
      cache[:, :, :n]) are read in place. fp8 arrays (ml_dtypes
      float8_e4m3fn / float8_e5m2, torch.float8_e4m3fn / float8_e5m2) with
      k_scale / v_scale: None (scale 1), a number (per-tensor) or float32
      scales [B, KVH, N] (per token and head; broadcastable); the value is
      scale * fp8 (kvattn.h kva_kv_fp8). Scales must be finite and > 0.
    Row i of sequence b sits at position p = len_b - L + i (len_b = N, or
      seq_lens[b] when seq_lens ([B] int) is given).
    scale: logit scale, None = 1/sqrt(Dk). softcap: logit = c*tanh(logit/c).
    mask: None, "causal" (key j visible iff j <= p; `window` w also requires
      j > p - w; `segments` [B, N] (or [N] for B = 1) image ids, 0 = text,
      add seg[p] == seg[j] != 0, limited to the window when clamp; a bool
      array is one image per sequence), or an array
      broadcastable to [B, H, L, N]: bool (True = visible) or additive float.
    tree_mask: tree speculative verify (KVA_MASK_TREE, L <= 64): packed bits
      uint32 (or int32, the same bits) [B, L, ceil(L/32)], or [L, W] for one
      tree shared by every sequence; row i sees new token j (key len - L + j)
      iff bit j % 32 of word j // 32 of its row is set, and the prefix (keys
      before len - L) by the causal rule with `window` / `segments`; mask must
      be None or "causal". numpy, CPU torch and CUDA arrays (on CUDA the bits
      are device memory and bits >= L are ignored; on the CPU they are an
      error). tree_bits() builds the bits from parent indices.
    sinks: [H] per-head sink logits (join the softmax denominator only).
    A row that sees no key outputs zeros. Returns out [B, H, L, Dv] in q's
    dtype (or writes `out`). threads / context pick the CPU context.
    return_lse: returns (out, lse), lse [B, H, L] float32 = log of each row's
      softmax denominator (sink included; -inf for a row that sees no key),
      base 2 with lse_base2 (kva_attention_lse; CPU arrays).
    exact: for validation, run only kernels with f32 products everywhere
      ("[exact f32]": no rounding of q, K, V or P below f32; KVA_ATTN_EXACT),
      never the AMX, integer-query or tensor-core kernels; slower where
      those would run. attention_kernel(..., exact=True) names the kernel.
    rotated: the cache holds Hadamard-rotated rows (hadamard(), cache_write(
      ..., rotate=...)): True or "kv" (K and V), "k", "v"; the call rotates q
      and un-rotates the output (KVA_ATTN_ROTATED_K / _V): the result of the
      unrotated cache within rounding. numpy and CUDA arrays.
    CUDA arrays (PyTorch CUDA tensors, __cuda_array_interface__ objects) run
    on the CUDA backend, on their device and stream: see kvattn.cuda.
    PyTorch tensors (CPU and CUDA) go through the compiled operators
    (kvattn.torch_ops) when that extension is built.
    """
    flags = _flags(exact, rotated)
    ops = _torch_ops(q, threads, context) if k_scale is None and v_scale is None else None
    if ops is not None:
        res = ops.attention(q, k, v, scale, mask, window, segments, softcap, sinks, group_size, bits, clamp=clamp,
                            seq_lens=seq_lens, out=out, return_lse=return_lse, lse_base2=lse_base2, exact=exact,
                            tree_mask=tree_mask, rotated=rotated)
        if res is not NotImplemented:
            return res
    if _cuda.is_cuda_array(q):
        if return_lse:
            raise C.error(C.EUNSUPPORTED, "return_lse: not wired for CUDA arrays in the Python binding yet "
                          "(the C API kva_attention_lse supports CUDA)")
        return _cuda.attention(q, k, v, scale, mask, window, segments, softcap, sinks, group_size, bits,
                               clamp=clamp, seq_lens=seq_lens, out=out, context=context, exact=exact,
                               tree_mask=tree_mask, k_scale=k_scale, v_scale=v_scale,
                               rotated=rotated)
    if _torch_cpu_fp8(q, k, v):
        return _torch_cpu_call(attention, q, k, v, out, dict(
            scale=scale, mask=mask, window=window, segments=segments, softcap=softcap, sinks=sinks,
            group_size=group_size, bits=bits, threads=threads, clamp=clamp, seq_lens=seq_lens, context=context,
            return_lse=return_lse, lse_base2=lse_base2, exact=exact, tree_mask=tree_mask, k_scale=k_scale,
            v_scale=v_scale, rotated=rotated))
    _no_torch_rotation(q, rotated, "attention")
    call = _Call(q, k, v, scale, mask, window, segments, clamp, softcap, sinks, group_size, bits, seq_lens,
                 out, tree_mask, k_scale, v_scale)
    call.params.flags = flags
    ctx = context if context is not None else default_context(threads)
    if return_lse:
        lse = np.empty(call.out_array.shape[:3], np.float32)
        lt = C.tensor(lse, "lse", output=True)
        with ctx.lock:
            C.check(lib.kva_attention_lse(ctx.handle, *call.refs(), ctypes.byref(lt),
                                          C.LSE_BASE2 if lse_base2 else 0, None, 0))
        return call.out_array, lse
    with ctx.lock:
        C.check(lib.kva_attention(ctx.handle, *call.refs(), None, 0))
    return call.out_array


def merge_states(parts, *, base2=False, out=None, dtype=None, threads=None, context=None):
    """Merges partial attention results over disjoint key sets:
    parts = [(o_r, lse_r), ...], o_r [B, H, L, Dv] float32/float16/bfloat16,
    lse_r [B, H, L] float32 (e.g. attention(..., return_lse=True) over pieces
    of a cache). lse = log sum_r exp(lse_r), out = sum_r exp(lse_r - lse) o_r
    (-inf parts skipped; all -inf: zeros and -inf). Returns (out, lse); out in
    `dtype` (default o_0's dtype) or written to `out` (may be one of the o_r).
    base2: every lse in base 2. kva_merge_states on the CPU context; torch
    tensors through the compiled operators (kvattn.torch_ops) when built."""
    parts = list(parts)
    ops = _torch_ops(parts[0][0] if parts and isinstance(parts[0], (tuple, list)) and parts[0] else None, threads,
                     context)
    if ops is not None:
        res = ops.merge_states(parts, base2=base2, out=out, dtype=dtype)
        if res is not NotImplemented:
            return res
    if not parts:
        raise C.error(C.EINVAL, "merge_states: parts is empty (R = 0)")
    os_, ls_ = [], []
    for r, part in enumerate(parts):
        if not isinstance(part, (tuple, list)) or len(part) != 2:
            raise C.error(C.EINVAL, "parts[%d] must be an (o, lse) pair" % r)
        os_.append(C.prepare_input(np.asarray(part[0]), "parts_o[%d]" % r))
        ls_.append(C.prepare_input(np.asarray(part[1]), "parts_lse[%d]" % r))
    R = len(parts)
    to = (C.kva_tensor * R)(*[C.tensor(a, "parts_o[%d]" % r) for r, a in enumerate(os_)])
    tl = (C.kva_tensor * R)(*[C.tensor(a, "parts_lse[%d]" % r) for r, a in enumerate(ls_)])
    if out is None:
        out = np.empty(os_[0].shape, dtype if dtype is not None else os_[0].dtype)
    lse = np.empty(os_[0].shape[:3] if os_[0].ndim == 4 else ls_[0].shape, np.float32)
    tout = C.tensor(out, "out", output=True)
    tlse = C.tensor(lse, "lse_out", output=True)
    ctx = context if context is not None else default_context(threads)
    with ctx.lock:
        C.check(lib.kva_merge_states(ctx.handle, R, to, tl, ctypes.byref(tout), ctypes.byref(tlse),
                                     C.LSE_BASE2 if base2 else 0))
    return out, lse


def reference_attention(q, k, v, scale=None, mask=None, window=None, segments=None, softcap=None,
                        sinks=None, group_size=64, bits=4, *, clamp=False, seq_lens=None, out=None, tree_mask=None, k_scale=None,
                        v_scale=None, rotated=None):
    """The library's oracle (naive double-precision loops) on the same arguments as attention()."""
    call = _Call(q, k, v, scale, mask, window, segments, clamp, softcap, sinks, group_size, bits, seq_lens,
                 out, tree_mask, k_scale, v_scale)
    call.params.flags = _flags(False, rotated)
    C.check(lib.kva_reference_attention(*call.refs()))
    return call.out_array


def attention_path(q, k, v, scale=None, mask=None, window=None, segments=None, softcap=None, sinks=None,
                   group_size=64, bits=4, threads=None, *, clamp=False, seq_lens=None, out=None,
                   context=None, tree_mask=None, k_scale=None,
                   v_scale=None):
    """Validates like attention() and says which path would run: "fused" or "fallback"."""
    call = _Call(q, k, v, scale, mask, window, segments, clamp, softcap, sinks, group_size, bits, seq_lens,
                 out, tree_mask, k_scale, v_scale)
    ctx = context if context is not None else default_context(threads)
    with ctx.lock:
        path = C.check(lib.kva_attention_path(ctx.handle, *call.refs()))
    return {C.PATH_FUSED: "fused", C.PATH_FALLBACK: "fallback"}.get(path, path)


def attention_kernel(q, k, v, scale=None, mask=None, window=None, segments=None, softcap=None, sinks=None,
                     group_size=64, bits=4, threads=None, *, clamp=False, seq_lens=None, out=None,
                     context=None, exact=False, tree_mask=None, k_scale=None,
                     v_scale=None, rotated=None):
    """Validates like attention() and describes the kernel that would run, e.g.
    "cpu avx512 fused kernel [exact f32]" or "cpu avx512 AMX kernel (bf16
    tiles) [K,V,P bf16]": words for reading (they may change), then the
    kernel's roundings in a stable trailing bracket (kvattn.h,
    kva_attention_kernel); with exact=True always "[exact f32]"; rotated:
    ", Hadamard-rotated K,V" before the bracket ("q bf16" first in it for a
    16-bit q)."""
    call = _Call(q, k, v, scale, mask, window, segments, clamp, softcap, sinks, group_size, bits, seq_lens,
                 out, tree_mask, k_scale, v_scale)
    call.params.flags = _flags(exact, rotated)
    ctx = context if context is not None else default_context(threads)
    name = ctypes.create_string_buffer(256)
    with ctx.lock:
        C.check(lib.kva_attention_kernel(ctx.handle, *call.refs(), name, len(name)))
    return name.value.decode()


def tree_bits(parents):
    """The tree_mask bits of a draft tree: parents[j] = the parent node of
    node j (among 0..j-1), or -1 for a root; one tree (a sequence of ints,
    [L, W] uint32 out) or one per sequence (a list of them, [B, L, W]). Row i
    sees itself and its ancestors."""
    trees = list(parents)
    if trees and not isinstance(trees[0], (list, tuple, np.ndarray)):
        return _tree_rows(trees)
    return np.stack([_tree_rows(list(t)) for t in trees])


def _tree_rows(par):
    L = len(par)
    if not 1 <= L <= C.TREE_MAX_ROWS:
        raise C.error(C.EUNSUPPORTED, "a tree of %d nodes (1..%d)" % (L, C.TREE_MAX_ROWS))
    bits = np.zeros((L, (L + 31) // 32), np.uint32)
    for i in range(L):
        a = i
        while a >= 0:
            bits[i, a // 32] |= np.uint32(1 << (a % 32))
            p = int(par[a])
            if not -1 <= p < a:
                raise C.error(C.EINVAL, "tree parents[%d] = %d must be in -1..%d" % (a, p, a - 1))
            a = p
    return bits


# ------------------------------------------------------------- cache write


def _pool_operand(x, name, bits, group_size, scale=None, keep=None):
    """kva_kv of a pool written in place: a float or fp8 array [num_blocks,
    KVH, block_size, D] (fp8: with `scale`, see cache_write) or a (packed,
    scales, biases) tuple of arrays."""
    parts = x if isinstance(x, (tuple, list)) else (x,)
    if len(parts) not in (1, 3):
        raise C.error(C.EINVAL, "%s must be an array or a (packed, scales, biases) tuple, got %d items"
                      % (name, len(parts)))
    for a in parts:
        if not isinstance(a, np.ndarray):
            raise TypeError("%s must be numpy arrays (written in place), got %s" % (name, type(a).__name__))
    kv = C.kva_kv()
    kv.data = C.tensor(parts[0], name + ".data", output=True)
    if len(parts) == 1 and parts[0].dtype in C.FP8_DTYPES:
        lead = parts[0].shape[:3] if parts[0].ndim == 4 else ()
        per_row = isinstance(scale, np.ndarray) and scale.shape in (tuple(lead), tuple(lead) + (1,))
        kv.scales = _fp8_scales(scale, lead, name + ".scales", keep, output=per_row)
    elif scale is not None:
        raise C.error(C.EINVAL, "%s: a scale is for fp8 pools (float8_e4m3fn / float8_e5m2)" % name)
    if len(parts) == 3:
        kv.scales = C.tensor(parts[1], name + ".scales", output=True)
        kv.biases = C.tensor(parts[2], name + ".biases", output=True)
        kv.bits = bits
        kv.group_size = group_size
    return kv


def cache_write(k_pool, v_pool, k, v, slots, group_size=64, bits=4, threads=None, *, context=None, k_scale=None,
                v_scale=None, rotate=None):
    """Writes n new tokens into caller-owned pools, in place (the engine's
    append step, kva_cache_write).

    k_pool, v_pool: [num_blocks, KVH, block_size, D] numpy arrays (float32,
      float16 or bfloat16), or (packed, scales, biases) tuples in MLX's affine
      format with `bits` / `group_size`; written in place.
    k [n, KVH, Dk], v [n, KVH, Dv]: the new rows (float); slots [n] int:
      block * block_size + row, negative = skip the token. Float pools store
      the rows rounded to their dtype; quantized pools store quantize() of
      each row, bit for bit. A slot past the pools raises KvaError (nothing
      is written then). CUDA arrays (pools, rows and slots on the device)
      run on the CUDA backend: kvattn.cuda.cache_write; torch tensors go
      through the compiled operators (kvattn.torch_ops) when built.
    fp8 pools (float8_e4m3fn / float8_e5m2 arrays; torch fp8 tensors) store
      round(x / scale), nearest even, saturating (torch's
      x.to(torch.float8_e4m3fn) bits in range), with k_scale / v_scale:
      a float32 array [num_blocks, KVH, block_size] (or [..., 1]): each
      written row's scale max|x| / max_fp8 is computed and stored there; a
      number or a broadcast array: the fixed scale(s), read; None: scale 1.
    rotate: store Hadamard-rotated rows (kva_cache_write_ex): True or "kv"
      (K and V), "k", "v"; each row rotated in f32 (hadamard()'s arithmetic)
      and then stored or quantized once; attend with attention(...,
      rotated=...). numpy and CUDA arrays."""
    wflags = _rotation(rotate, "rotate", C.WRITE_ROTATE_K, C.WRITE_ROTATE_V)
    ops = _torch_ops(k, threads, context) if k_scale is None and v_scale is None else None
    if ops is not None and ops.cache_write(k_pool, v_pool, k, v, slots, group_size, bits,
                                           wflags) is not NotImplemented:
        return None
    if _cuda.is_cuda_array(k):
        return _cuda.cache_write(k_pool, v_pool, k, v, slots, group_size, bits, context=context, k_scale=k_scale,
                                 v_scale=v_scale, flags=wflags)
    if _torch_cpu_fp8(k_pool, v_pool):
        return cache_write(*(_np_of_torch(x) for x in (k_pool, v_pool, k, v, slots)), group_size, bits, threads,
                           context=context, k_scale=_np_of_torch(k_scale), v_scale=_np_of_torch(v_scale),
                           rotate=rotate)
    _no_torch_rotation(k, wflags, "cache_write")
    group_size = _check_i32(group_size, "group_size")
    bits = _check_i32(bits, "bits")
    keep = []
    kp = _pool_operand(k_pool, "k_pool", bits, group_size, k_scale, keep)
    vp = _pool_operand(v_pool, "v_pool", bits, group_size, v_scale, keep)
    k = C.prepare_input(k, "k")
    v = C.prepare_input(v, "v")
    sl = np.ascontiguousarray(C.int32_array(slots, "slots"))
    if sl.dtype != np.int32:
        raise C.error(C.EDTYPE, "slots has unsupported dtype %s (int32 expected)" % sl.dtype)
    n = k.shape[0] if k.ndim else 0
    if sl.shape != (n,):
        raise C.error(C.ESHAPE, "slots must have shape [n] = [%d] (k.shape[0]), got %s" % (n, list(sl.shape)))
    kt = C.tensor(k, "k")
    vt = C.tensor(v, "v")
    ctx = context if context is not None else default_context(threads)
    if ctx.backend != "cpu":
        raise C.error(C.EINVAL, "cache_write: numpy pools need a CPU context, got %r" % (ctx,))
    with ctx.lock:
        C.check(lib.kva_cache_write_ex(ctx.handle, ctypes.byref(kp), ctypes.byref(vp), ctypes.byref(kt),
                                       ctypes.byref(vt), sl.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n, wflags))


# CUDA arrays (kvattn.cuda) and the paged KV cache (pools, sequences,
# immutable views) build on the helpers above.
from . import cuda as _cuda  # noqa: E402
from .paged import (PagedView, Pool, Sequence, block_table_attention,  # noqa: E402
                    block_table_reference_attention, paged_attention)

__all__ += ["PagedView", "Pool", "Sequence", "block_table_attention", "block_table_reference_attention",
            "paged_attention"]
from .compose import (CPPlan, block_table_cascade_attention, block_table_shared_prefix,  # noqa: E402
                      cascade_attention, cp_attend, cp_attention, cp_exchange, cp_merge, paged_cascade_attention,
                      shared_prefix, split_block_table, split_view)

__all__ += ["CPPlan", "block_table_cascade_attention", "block_table_shared_prefix", "cascade_attention",
            "cp_attend", "cp_attention", "cp_exchange", "cp_merge", "paged_cascade_attention", "shared_prefix",
            "split_block_table", "split_view"]
