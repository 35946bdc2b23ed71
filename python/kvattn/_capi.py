"""ctypes mirror of include/kvattn.h: loads the shared library, declares the
structs and function prototypes, and turns numpy arrays into kva_tensor
descriptors without copying (strides in bytes, as numpy keeps them).

Everything here is internal; the public API is in kvattn/__init__.py. Other
modules of the package (e.g. kvattn.paged) build on these helpers.
"""
import ctypes
import ctypes.util
import os

import ml_dtypes
import numpy as np

# ------------------------------------------------------------------ library


def _find_library():
    """$KVATTN_LIB, else the wheel's _lib/libkvattn.so in this package, else the
    tree's build/libkvattn.so (`make`), else the system's library path."""
    env = os.environ.get("KVATTN_LIB")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    bundled = os.path.join(here, "_lib", "libkvattn.so")
    built = os.path.normpath(os.path.join(here, "..", "..", "build", "libkvattn.so"))
    for path in (bundled, built):
        if os.path.exists(path):
            return path
    found = ctypes.util.find_library("kvattn")
    if found:
        return found
    raise ImportError(
        "kvattn: shared library libkvattn.so not found (looked for $KVATTN_LIB, %s, %s and the system's "
        "library path); install the package with `pip install .` from the source tree, or run `make` there "
        "(builds build/libkvattn.so), or set KVATTN_LIB to the library's path" % (bundled, built))


LIB_PATH = _find_library()
lib = ctypes.CDLL(LIB_PATH)

# ------------------------------------------------------------ status codes
# Mirror of KVA_STATUS_LIST (the messages come from kva_strerror at run time).
OK = 0
EINVAL = -1
ESHAPE = -2
EDTYPE = -3
ESTRIDE = -4
EUNSUPPORTED = -5
ENOMEM = -6
ENOBLOCKS = -7
ENOSEQ = -8
EWORKSPACE = -9
ENODEVICE = -10
ECUDA = -11
EINTERNAL = -12


class KvaError(ValueError):
    """A negative kva_status: str(e) is the library's message, e.code the status."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------ dtypes
F32, F16, BF16, U32, I32, BOOL, F8E4M3, F8E5M2 = 0, 1, 2, 3, 4, 5, 6, 7
MAX_DIMS = 4  # KVA_MAX_DIMS

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)  # KVA_F8E4M3: torch.float8_e4m3fn's bits
FLOAT8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)    # KVA_F8E5M2
NP_TO_KVA = {
    np.dtype(np.float32): F32,
    np.dtype(np.float16): F16,
    BFLOAT16: BF16,
    np.dtype(np.uint32): U32,
    np.dtype(np.int32): I32,
    np.dtype(np.bool_): BOOL,
    FLOAT8_E4M3: F8E4M3,
    FLOAT8_E5M2: F8E5M2,
}
KVA_TO_NP = {v: k for k, v in NP_TO_KVA.items()}
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
FP8_DTYPES = (FLOAT8_E4M3, FLOAT8_E5M2)  # K/V rows only (kvattn.h: kva_kv_fp8)

# ------------------------------------------------------------------ structs
c_int64_4 = ctypes.c_int64 * MAX_DIMS


class kva_tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("shape", c_int64_4),
        ("stride", c_int64_4),
    ]


class kva_kv(ctypes.Structure):
    _fields_ = [
        ("data", kva_tensor),
        ("scales", kva_tensor),
        ("biases", kva_tensor),
        ("bits", ctypes.c_int),
        ("group_size", ctypes.c_int),
    ]


MASK_NONE, MASK_CAUSAL, MASK_ARRAY, MASK_TREE = 0, 1, 2, 3
TREE_MAX_ROWS = 64  # KVA_TREE_MAX_ROWS


class kva_mask(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("window", ctypes.c_int32),
        ("segments", kva_tensor),
        ("segments_clamp", ctypes.c_int),
        ("array", kva_tensor),
    ]


LAYOUT_CONTIGUOUS, LAYOUT_PAGED, LAYOUT_BLOCK_TABLE = 0, 1, 2


class kva_kv_view(ctypes.Structure):
    _fields_ = [
        ("layout", ctypes.c_int),
        ("k", kva_kv),
        ("v", kva_kv),
        ("seq_lens", ctypes.POINTER(ctypes.c_int32)),
        ("paged", ctypes.c_void_p),   # const struct kva_paged_view *
        ("table", ctypes.c_void_p),   # const struct kva_block_table * (BLOCK_TABLE only; NULL otherwise)
    ]


class kva_block_table(ctypes.Structure):
    _fields_ = [
        ("batch", ctypes.c_int64),
        ("max_blocks", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
        ("blocks", ctypes.POINTER(ctypes.c_int32)),
        ("seq_lens", ctypes.POINTER(ctypes.c_int32)),
        ("first_offset", ctypes.POINTER(ctypes.c_int32)),
    ]


class kva_attn_params(ctypes.Structure):
    _fields_ = [
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("mask", kva_mask),
        ("sinks", ctypes.POINTER(ctypes.c_float)),
        ("flags", ctypes.c_uint),
    ]


ATTN_EXACT = 1  # kva_attn_params.flags: only "[exact f32]" kernels (KVA_ATTN_EXACT)
ATTN_ROTATED_K, ATTN_ROTATED_V = 2, 4  # Hadamard-rotated K / V caches (KVA_ATTN_ROTATED_K / _V)
WRITE_ROTATE_K, WRITE_ROTATE_V = 1, 2  # kva_cache_write_ex flags (KVA_WRITE_ROTATE_K / _V)


BACKEND_CPU, BACKEND_CUDA = 0, 1


class kva_context_opts(ctypes.Structure):
    _fields_ = [
        ("backend", ctypes.c_int),
        ("threads", ctypes.c_int),
        ("device", ctypes.c_int),
        ("stream", ctypes.c_void_p),
    ]


PATH_FUSED, PATH_FALLBACK = 1, 2

# -------------------------------------------------------------- prototypes
_P = ctypes.POINTER
_c_ctx = ctypes.c_void_p  # kva_context *


def _proto(name, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


_proto("kva_version", ctypes.c_char_p)
_proto("kva_build_info", ctypes.c_char_p)
_proto("kva_strerror", ctypes.c_char_p, ctypes.c_int)
_proto("kva_last_error", ctypes.c_char_p)
_proto("kva_dtype_size", ctypes.c_size_t, ctypes.c_int)
_proto("kva_kv_dim", ctypes.c_int64, _P(kva_kv))
_proto("kva_quantize", ctypes.c_int, _P(kva_tensor), _P(kva_kv))
_proto("kva_dequantize", ctypes.c_int, _P(kva_kv), _P(kva_tensor))
_proto("kva_causal_mask", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, _P(kva_tensor))
_proto("kva_image_mask", ctypes.c_int, _P(kva_tensor), ctypes.c_int32, ctypes.c_int, _P(kva_tensor))
_proto("kva_context_create", ctypes.c_int, _P(_c_ctx), _P(kva_context_opts))
_proto("kva_context_destroy", None, _c_ctx)
_proto("kva_context_threads", ctypes.c_int, _c_ctx)
_proto("kva_attention", ctypes.c_int, _c_ctx, _P(kva_tensor), _P(kva_kv_view), _P(kva_attn_params),
       _P(kva_tensor), ctypes.c_void_p, ctypes.c_size_t)
_proto("kva_attention_workspace_size", ctypes.c_int, _c_ctx, _P(kva_tensor), _P(kva_kv_view),
       _P(kva_attn_params), _P(ctypes.c_size_t))
_proto("kva_attention_path", ctypes.c_int, _c_ctx, _P(kva_tensor), _P(kva_kv_view), _P(kva_attn_params),
       _P(kva_tensor))
_proto("kva_attention_kernel", ctypes.c_int, _c_ctx, _P(kva_tensor), _P(kva_kv_view), _P(kva_attn_params),
       _P(kva_tensor), ctypes.c_char_p, ctypes.c_size_t)
_proto("kva_reference_attention", ctypes.c_int, _P(kva_tensor), _P(kva_kv_view), _P(kva_attn_params),
       _P(kva_tensor))
_proto("kva_attention_lse", ctypes.c_int, _c_ctx, _P(kva_tensor), _P(kva_kv_view), _P(kva_attn_params),
       _P(kva_tensor), _P(kva_tensor), ctypes.c_uint, ctypes.c_void_p, ctypes.c_size_t)
_proto("kva_reference_attention_lse", ctypes.c_int, _P(kva_tensor), _P(kva_kv_view), _P(kva_attn_params),
       _P(kva_tensor), _P(kva_tensor), ctypes.c_uint)
_proto("kva_merge_states", ctypes.c_int, _c_ctx, ctypes.c_int64, _P(kva_tensor), _P(kva_tensor), _P(kva_tensor),
       _P(kva_tensor), ctypes.c_uint)
LSE_BASE2 = 1
MERGE_MAX_PARTS = 32
_proto("kva_view_block_table", kva_kv_view, _P(kva_kv), _P(kva_kv), _P(kva_block_table))
_proto("kva_cpu_simd", ctypes.c_char_p)
_proto("kva_cpu_set_simd", ctypes.c_int, ctypes.c_char_p)
_proto("kva_cuda_device_count", ctypes.c_int)
_proto("kva_hadamard", ctypes.c_int, _c_ctx, _P(kva_tensor), _P(kva_tensor))
_proto("kva_hadamard_dim_supported", ctypes.c_int, ctypes.c_int64)
_proto("kva_cache_write_ex", ctypes.c_int, _c_ctx, _P(kva_kv), _P(kva_kv), _P(kva_tensor), _P(kva_tensor),
       _P(ctypes.c_int32), ctypes.c_int64, ctypes.c_uint)


def last_error():
    """Message of the last error on this thread (the library's thread-local)."""
    return lib.kva_last_error().decode("utf-8", "replace")


def strerror(code):
    return lib.kva_strerror(code).decode("utf-8", "replace")


def check(rc):
    """Raise KvaError carrying kva_last_error() for a negative status; else return rc."""
    if rc < 0:
        raise KvaError(rc, last_error() or strerror(rc))
    return rc


def error(code, message):
    """A Python-side error worded like the library's (`<strerror>: <message>`)."""
    return KvaError(code, "%s: %s" % (strerror(code), message))


def int32(value, name):
    """value (an int) for a C int argument or field: ctypes would wrap a
    larger one silently (group_size 2**32 + 64 would pass as 64)."""
    if not -2**31 <= value < 2**31:
        raise error(EINVAL, "%s = %d is out of the int32 range" % (name, value))
    return value


# ------------------------------------------------------------ descriptors


def kva_dtype_of(arr, name):
    """kva_dtype of a numpy array; KvaError (naming the argument) if it has none."""
    dt = NP_TO_KVA.get(arr.dtype)
    if dt is None:
        raise error(EDTYPE, "%s has unsupported dtype %s" % (name, arr.dtype))
    return dt


def _needs_copy(arr):
    """Inputs the library cannot take as they are: a non-contiguous innermost
    dimension or a negative stride (a reversed view). Overlapping strides (for
    example stride 0 from broadcasting) are passed on so the library reports them."""
    if arr.ndim == 0:
        return False
    if arr.shape[-1] > 1 and arr.strides[-1] != arr.itemsize:
        return True
    return any(s < 0 and n > 1 for n, s in zip(arr.shape, arr.strides))


def prepare_input(arr, name):
    """np.asarray, and a contiguous copy only when the library could not read it."""
    arr = np.asarray(arr)
    if _needs_copy(arr):
        arr = np.ascontiguousarray(arr)
    return arr


def tensor(arr, name, output=False):
    """kva_tensor describing a numpy array in place (no copy).

    Dims of size 1 get a harmless non-negative stride (the innermost one the
    element size), as the library requires. Outputs must be writeable and have
    a contiguous innermost dimension (ValueError otherwise); inputs should come
    through prepare_input first.
    """
    if arr.ndim > MAX_DIMS:
        raise error(ESHAPE, "%s has rank %d (at most %d)" % (name, arr.ndim, MAX_DIMS))
    t = kva_tensor()
    t.dtype = kva_dtype_of(arr, name)
    t.ndim = arr.ndim
    strides = arr.strides
    if arr.size == 0:  # numpy gives empty arrays zero strides; the library reports the shape
        strides = np.empty((1,) * arr.ndim, arr.dtype).strides if arr.ndim else ()
    elif output:
        if not arr.flags.writeable:
            raise error(EINVAL, "%s is read-only" % name)
        if arr.ndim and arr.shape[-1] > 1 and arr.strides[-1] != arr.itemsize:
            raise error(ESTRIDE, "%s: innermost stride %d must equal the element size %d"
                        % (name, arr.strides[-1], arr.itemsize))
    for d in range(arr.ndim):
        n, s = arr.shape[d], strides[d]
        if n == 1:
            s = arr.itemsize if d == arr.ndim - 1 else max(s, 0)
        t.shape[d] = n
        t.stride[d] = s
    t.data = arr.ctypes.data
    return t


def int32_array(x, name, allow_bool=False):
    """An integer array (or bool, when allow_bool) as int32 (values must fit),
    in place when it already is int32; other dtypes are returned as they are
    so the library names the wrong dtype."""
    arr = np.asarray(x)
    if allow_bool and arr.dtype == np.bool_:
        arr = arr.astype(np.int32)
    if arr.dtype.kind in "iu" and arr.dtype != np.int32:
        if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
            raise error(EINVAL, "%s has values outside the int32 range" % name)
        arr = arr.astype(np.int32)
    return prepare_input(arr, name)
