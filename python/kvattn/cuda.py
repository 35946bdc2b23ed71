"""CUDA arrays in kvattn.attention: PyTorch CUDA tensors and objects with
__cuda_array_interface__ (CuPy, Numba) are described in place (device
pointers, byte strides) and the call runs on the CUDA backend, on the
tensors' device and on the producer's current stream (PyTorch:
torch.cuda.current_stream(); __cuda_array_interface__: its "stream" entry).

Also on CUDA arrays: block_table_attention (caller pools + block table,
layout BLOCK_TABLE; the table, lengths and offsets int32 on the device) and
cache_write (the append step into such pools, quantize on write).

Supported element types: float32, float16, bfloat16 (PyTorch only: the array
interface has no bfloat16), uint32/int32 for packed quantized words, int32
lengths and segments, bool masks. Every array of one call must be on the same
device; numpy arrays (sinks, seq_lens, masks) are refused for CUDA calls
because the library reads them on the device.
"""
import ctypes
import threading

from . import _capi as C

lib = C.lib
C._proto("kva_context_set_stream", ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

_TORCH_DTYPES = {"torch.float32": C.F32, "torch.float16": C.F16, "torch.bfloat16": C.BF16,
                 "torch.int32": C.I32, "torch.uint32": C.U32, "torch.bool": C.BOOL,
                 "torch.float8_e4m3fn": C.F8E4M3, "torch.float8_e5m2": C.F8E5M2}
_CAI_DTYPES = {"<f4": C.F32, "<f2": C.F16, "<u4": C.U32, "<i4": C.I32, "|b1": C.BOOL, "<b1": C.BOOL}
_ITEMSIZE = {C.F32: 4, C.F16: 2, C.BF16: 2, C.U32: 4, C.I32: 4, C.BOOL: 1, C.F8E4M3: 1, C.F8E5M2: 1}
_LEGACY_DEFAULT_STREAM = 1  # __cuda_array_interface__ v3 code for the legacy default stream


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def is_cuda_array(x):
    """A PyTorch tensor on a CUDA device, or an object exposing __cuda_array_interface__."""
    if _is_torch(x):
        return bool(getattr(x, "is_cuda", False))
    return hasattr(x, "__cuda_array_interface__")


def _describe(x, name):
    """(data pointer, shape, byte strides, kva dtype, device ordinal or None, stream or None)."""
    if _is_torch(x):
        if not x.is_cuda:
            raise C.error(C.EINVAL, "%s is a CPU tensor in a CUDA call" % name)
        dt = _TORCH_DTYPES.get(str(x.dtype))
        if dt is None:
            raise C.error(C.EDTYPE, "%s has unsupported dtype %s" % (name, x.dtype))
        size = _ITEMSIZE[dt]
        import torch  # present: x is a torch tensor
        stream = torch.cuda.current_stream(x.device).cuda_stream
        return x.data_ptr(), tuple(x.shape), tuple(s * size for s in x.stride()), dt, x.device.index, stream
    cai = x.__cuda_array_interface__
    dt = _CAI_DTYPES.get(cai["typestr"])
    if dt is None:
        raise C.error(C.EDTYPE, "%s has unsupported typestr %s" % (name, cai["typestr"]))
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is None:  # C-contiguous
        strides, acc = [], _ITEMSIZE[dt]
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    stream = cai.get("stream")
    return cai["data"][0], shape, tuple(strides), dt, None, stream


def _tensor(x, name, as_dtype=None):
    ptr, shape, strides, dt, dev, stream = _describe(x, name)
    if len(shape) > C.MAX_DIMS:
        raise C.error(C.ESHAPE, "%s has rank %d (at most %d)" % (name, len(shape), C.MAX_DIMS))
    t = C.kva_tensor()
    t.dtype = as_dtype if as_dtype is not None and dt in (C.I32, C.U32) else dt
    t.ndim = len(shape)
    for d, (n, s) in enumerate(zip(shape, strides)):
        t.shape[d] = n
        t.stride[d] = (_ITEMSIZE[dt] if d == len(shape) - 1 else max(s, 0)) if n == 1 else s
    t.data = ptr
    return t, shape, dev, stream


_contexts = {}
_contexts_lock = threading.Lock()


def _context(device):
    from . import Context  # the package's Context class
    with _contexts_lock:
        ctx = _contexts.get(device)
        if ctx is None:
            ctx = _contexts[device] = Context(backend="cuda", device=device)
        return ctx


class _Call:
    """Descriptors of one attention call over CUDA arrays."""

    def __init__(self, q, k, v, scale, mask, window, segments, clamp, softcap, sinks, group_size, bits,
                 seq_lens, out, tree_mask=None, k_scale=None,
                 v_scale=None):
        from . import _check_i32, _mask_kind, _params, _tree_kind, _window
        group_size, bits = _check_i32(group_size, "group_size"), _check_i32(bits, "bits")
        self.keep = [q, k, v]
        self.q, qshape, dev, stream = _tensor(q, "q")
        self.device = 0 if dev is None else dev
        self.stream = stream
        view = self.view = C.kva_kv_view()
        view.layout = C.LAYOUT_CONTIGUOUS
        view.k, _, _ = self._kv(k, "k", bits, group_size, k_scale)
        view.v, vshape, dv = self._kv(v, "v", bits, group_size, v_scale)
        B, H, L = qshape[:3] if len(qshape) == 4 else (1, 1, 1)
        if out is None:
            if not _is_torch(q):
                raise C.error(C.EINVAL, "out is required for CUDA arrays other than PyTorch tensors")
            out = q.new_empty((B, H, L, dv))
        self.out_array = out
        self.keep.append(out)
        self.out, _, _, _ = _tensor(out, "out")
        if seq_lens is not None:
            t, shape, _, _ = _tensor(self._device_array(seq_lens, "seq_lens"), "seq_lens")
            if t.dtype != C.I32 or shape != (B,):
                raise C.error(C.ESHAPE, "seq_lens must be int32 [B] = [%d] on the device" % B)
            view.seq_lens = ctypes.cast(t.data, ctypes.POINTER(ctypes.c_int32))
        p = self.params = _params(scale, softcap)
        if sinks is not None:
            t, shape, _, _ = _tensor(self._device_array(sinks, "sinks"), "sinks")
            if t.dtype != C.F32 or shape != (H,):
                raise C.error(C.ESHAPE, "sinks must be float32 [H] = [%d] on the device" % H)
            p.sinks = ctypes.cast(t.data, ctypes.POINTER(ctypes.c_float))
        m = p.mask
        m.window = _window(window)
        m.segments_clamp = int(bool(clamp))
        if segments is not None:
            m.segments, _, _, _ = _tensor(self._device_array(segments, "mask.segments"), "mask.segments")
        if tree_mask is not None:
            m.kind = _tree_kind(mask, tree_mask)
            m.array = self._tree(tree_mask)
            return
        m.kind = _mask_kind(mask)
        if m.kind == C.MASK_ARRAY:
            m.array, _, _, _ = _tensor(self._device_array(mask, "mask.array"), "mask.array")

    def _tree(self, x):
        """The tree bits on the device: uint32 / int32 (read as uint32) [B, L, W], or [L, W] as [1, L, W]."""
        t, shape, _, _ = _tensor(self._device_array(x, "tree_mask"), "mask.array (tree bits)", C.U32)
        if len(shape) == 2:
            t.ndim = 3
            t.shape[2], t.shape[1], t.shape[0] = t.shape[1], t.shape[0], 1
            t.stride[2], t.stride[1], t.stride[0] = t.stride[1], t.stride[0], 0
        return t

    def _device_array(self, x, name):
        if not is_cuda_array(x):
            raise C.error(C.EINVAL, "%s must be a CUDA array in a call on CUDA arrays" % name)
        self.keep.append(x)
        return x

    def _fp8_scales(self, scale, x, shape, name):
        """Device f32 scales of fp8 rows of shape [B, KVH, N, D] (pools: [num_blocks,
        KVH, block_size, D]): None = none (scale 1); a number = one device
        float for all rows (a torch x; strides 0); a CUDA array [B, KVH, N]
        or [B, KVH, N, 1] (torch: broadcastable, expanded by strides; written
        in place by cache_write when it has the rows' shape)."""
        if scale is None:
            return C.kva_tensor()
        lead = tuple(shape[:3]) if len(shape) == 4 else None
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            if not _is_torch(x):
                raise C.error(C.EINVAL, "%s: a number needs torch tensors; pass a float32 CUDA array" % name)
            import torch
            scale = torch.full((1, 1, 1, 1), float(scale), dtype=torch.float32, device=x.device)
        if _is_torch(scale):
            if scale.dim() == 3:
                scale = scale.unsqueeze(-1)
            if lead is not None and scale.dim() == 4:
                try:
                    scale = scale.expand(*lead, 1)
                except RuntimeError:
                    pass  # the library names the dimension
        t, _, _, _ = _tensor(self._device_array(scale, name), name)
        return t

    def _kv(self, x, name, bits, group_size, scale=None):
        kv = C.kva_kv()
        if isinstance(x, (tuple, list)):
            if len(x) != 3:
                raise C.error(C.EINVAL, "%s must be an array or a (packed, scales, biases) tuple" % name)
            self.keep.extend(x)
            kv.data, pshape, _, _ = _tensor(self._device_array(x[0], name + ".data"), name + ".data", C.U32)
            kv.scales, _, _, _ = _tensor(self._device_array(x[1], name + ".scales"), name + ".scales")
            kv.biases, _, _, _ = _tensor(self._device_array(x[2], name + ".biases"), name + ".biases")
            kv.bits, kv.group_size = bits, group_size
            return kv, pshape, (pshape[-1] * 32 // bits if pshape and bits in (2, 4, 8) else 0)
        kv.data, shape, _, _ = _tensor(self._device_array(x, name), name)
        if kv.data.dtype in (C.F8E4M3, C.F8E5M2):
            kv.scales = self._fp8_scales(scale, x, shape, name + ".scales")
        elif scale is not None:
            raise C.error(C.EINVAL, "%s: a scale is for fp8 %s (float8_e4m3fn / float8_e5m2)" % (name, name))
        return kv, shape, (shape[-1] if shape else 0)


def _on_stream(call, context, fn):
    """fn(context handle), a library call, checked, under the lock of the CUDA
    context (the given one, else the call's device's) with the call's stream set on it."""
    ctx = context if context is not None else _context(call.device)
    with ctx.lock:
        stream = call.stream
        if stream in (None, _LEGACY_DEFAULT_STREAM):
            stream = 0
        C.check(lib.kva_context_set_stream(ctx.handle, ctypes.c_void_p(stream)))
        C.check(fn(ctx.handle))


def _run(call, context):
    _on_stream(call, context, lambda h: lib.kva_attention(h, ctypes.byref(call.q), ctypes.byref(call.view),
                                                          ctypes.byref(call.params), ctypes.byref(call.out), None, 0))
    return call.out_array


def attention(q, k, v, scale=None, mask=None, window=None, segments=None, softcap=None, sinks=None,
              group_size=64, bits=4, *, clamp=False, seq_lens=None, out=None, context=None, exact=False,
              tree_mask=None, k_scale=None,
              v_scale=None, rotated=None):
    """kvattn.attention on CUDA arrays (see its documentation); runs on the
    arrays' device and the producer's current stream, asynchronously.
    exact: only the fused or general CUDA-core kernels ("[exact f32]").
    tree_mask: the tree bits as a CUDA array (uint32 or int32).
    rotated: a Hadamard-rotated cache, as kvattn.attention."""
    from . import _flags

    call = _Call(q, k, v, scale, mask, window, segments, clamp, softcap, sinks, group_size, bits, seq_lens,
                 out, tree_mask, k_scale, v_scale)
    call.params.flags = _flags(exact, rotated)
    return _run(call, context)


def _int32_device(call, x, name, ndim):
    t, shape, _, _ = _tensor(call._device_array(x, name), name)
    if t.dtype != C.I32 or len(shape) != ndim:
        raise C.error(C.EDTYPE, "%s must be an int32 CUDA array of rank %d, got shape %s" % (name, ndim, list(shape)))
    return t, shape


def block_table_attention(q, k_pool, v_pool, blocks, seq_lens, first_offset=None, scale=None, mask=None,
                          window=None, segments=None, softcap=None, sinks=None, group_size=64, bits=4, *,
                          clamp=False, out=None, context=None, exact=False, tree_mask=None, k_scale=None,
                          v_scale=None, rotated=None):
    """kvattn.block_table_attention on CUDA arrays: pools [num_blocks, KVH,
    block_size, D] (or (packed, scales, biases) tuples), blocks [B,
    max_blocks], seq_lens [B] and first_offset [B] int32, all on the device
    (read by the kernels: a captured CUDA graph follows later changes). On
    the device a bad length or block id is clamped, never a fault. exact,
    rotated: as attention()."""
    from . import _flags

    call = _Call(q, k_pool, v_pool, scale, mask, window, segments, clamp, softcap, sinks, group_size, bits, None,
                 out, tree_mask, k_scale, v_scale)
    call.params.flags = _flags(exact, rotated)
    bl, bshape = _int32_device(call, blocks, "blocks", 2)
    B, mb = bshape
    if B > 1 and (bl.stride[0] % 4 or bl.stride[0] < 4 * mb):
        raise C.error(C.ESTRIDE, "blocks: row stride %d bytes must be a multiple of 4 and >= 4 * max_blocks"
                      % bl.stride[0])
    sl, sshape = _int32_device(call, seq_lens, "seq_lens", 1)
    if sshape != (B,):
        raise C.error(C.ESHAPE, "seq_lens must have shape [B] = [%d] (the rows of blocks)" % B)
    t = C.kva_block_table()
    t.batch, t.max_blocks, t.row_stride = B, mb, (bl.stride[0] // 4 if B > 1 else 0)
    t.blocks = ctypes.cast(bl.data, ctypes.POINTER(ctypes.c_int32))
    t.seq_lens = ctypes.cast(sl.data, ctypes.POINTER(ctypes.c_int32))
    if first_offset is not None:
        fo, fshape = _int32_device(call, first_offset, "first_offset", 1)
        if fshape != (B,):
            raise C.error(C.ESHAPE, "first_offset must have shape [B] = [%d]" % B)
        t.first_offset = ctypes.cast(fo.data, ctypes.POINTER(ctypes.c_int32))
    call.keep.append(t)
    call.view = C.lib.kva_view_block_table(ctypes.byref(call.view.k), ctypes.byref(call.view.v), ctypes.byref(t))
    return _run(call, context)


def cache_write(k_pool, v_pool, k, v, slots, group_size=64, bits=4, *, context=None, k_scale=None, v_scale=None,
                flags=0):
    """kvattn.cache_write on CUDA arrays: writes the rows k [n, KVH, Dk],
    v [n, KVH, Dv] into the device pools at slots [n] (int32, device), on the
    arrays' device and the producer's current stream; out-of-range slots are
    skipped on the device (negative ones by definition). flags: the
    kva_cache_write_ex rotation bits (kvattn.cache_write's rotate)."""
    from . import _check_i32

    group_size, bits = _check_i32(group_size, "group_size"), _check_i32(bits, "bits")
    call = _Call.__new__(_Call)  # only its array helpers (_device_array, _kv) and keep list
    call.keep = []
    kt, kshape, dev, stream = _tensor(call._device_array(k, "k"), "k")
    vt, _, _, _ = _tensor(call._device_array(v, "v"), "v")
    kp, _, _ = call._kv(k_pool, "k_pool", bits, group_size, k_scale)
    vp, _, _ = call._kv(v_pool, "v_pool", bits, group_size, v_scale)
    st, sshape = _int32_device(call, slots, "slots", 1)
    n = kshape[0] if kshape else 0
    if sshape != (n,):
        raise C.error(C.ESHAPE, "slots must have shape [n] = [%d] (k.shape[0])" % n)
    ctx = context if context is not None else _context(0 if dev is None else dev)
    with ctx.lock:
        s = 0 if stream in (None, _LEGACY_DEFAULT_STREAM) else stream
        C.check(lib.kva_context_set_stream(ctx.handle, ctypes.c_void_p(s)))
        C.check(lib.kva_cache_write_ex(ctx.handle, ctypes.byref(kp), ctypes.byref(vp), ctypes.byref(kt),
                                       ctypes.byref(vt), ctypes.cast(st.data, ctypes.POINTER(ctypes.c_int32)), n,
                                       flags))


def hadamard(x, out=None, *, context=None):
    """kvattn.hadamard on a CUDA array, on its device and the producer's
    current stream, asynchronously; out None: a new tensor like x (PyTorch)."""
    call = _Call.__new__(_Call)  # only its array helpers and keep list
    call.keep = [x]
    tx, shape, dev, stream = _tensor(call._device_array(x, "x"), "x")
    if out is None:
        if not _is_torch(x):
            raise C.error(C.EINVAL, "out is required for CUDA arrays other than PyTorch tensors")
        out = x.new_empty(x.shape)
    ty, _, _, _ = _tensor(call._device_array(out, "y"), "y")
    call.device, call.stream = 0 if dev is None else dev, stream
    _on_stream(call, context, lambda h: lib.kva_hadamard(h, ctypes.byref(tx), ctypes.byref(ty)))
    return out
