"""Every bad input of the issue's list raises ValueError (KvaError carrying the
library's message, or the binding's own for what the C API cannot see, such
as the length of a raw pointer) whose message names the argument; and nothing
is written to a caller's output on error."""
import ctypes

import numpy as np
import pytest

import kvattn
from kvattn import _capi as C
from kvref import randn, rng_for

B, H, KVH, L, N, D = 2, 4, 2, 2, 10, 64


@pytest.fixture
def ops(request):
    """Valid operands: q, float k/v, quantized kq/vq (4-bit, group 64), sinks."""
    rng = rng_for(request)
    q = randn(rng, (B, H, L, D))
    k, v = randn(rng, (B, KVH, N, D)), randn(rng, (B, KVH, N, D))
    return dict(q=q, k=k, v=v, kq=kvattn.quantize(k), vq=kvattn.quantize(v))


def raises(fn, pattern):
    with pytest.raises(ValueError, match=pattern) as e:
        fn()
    if isinstance(e.value, kvattn.KvaError):
        assert e.value.code < 0
    return e.value


def att(o, **kw):
    args = dict(q=o["q"], k=o["k"], v=o["v"])
    args.update(kw)
    return lambda: kvattn.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


# ------------------------------------------------------------ ranks, shapes


def test_wrong_ranks(ops):
    raises(att(ops, q=ops["q"][0]), r"\bq must have rank 4, got 3")
    raises(att(ops, k=ops["k"][0]), r"k\.data must have rank 4")
    raises(att(ops, v=ops["v"][None]), r"v\.data has rank 5")
    raises(att(ops, k=tuple(a[0] for a in ops["kq"]), v=ops["vq"]), r"k\.data must have rank 4")
    raises(att(ops, mask=np.ones((1, 1, 1, 1, N), bool)), r"mask\.array has rank 5")


def test_wrong_shapes(ops):
    o = ops
    raises(att(o, v=o["v"][:, :, :N - 1]), r"v\.shape\[2\]")
    raises(att(o, v=o["v"][:, :1]), r"v\.shape\[1\]")
    raises(att(o, q=o["q"][..., :32]), r"q\.shape\[3\] = 32")
    raises(att(o, q=o["q"][:1]), r"q\.shape\[0\] = 1")
    raises(att(o, out=np.empty((B, H, L, D + 1), np.float32)), r"out\.shape\[3\]")
    raises(att(o, out=np.empty((B, H, L + 1, D), np.float32)), r"out\.shape\[2\]")
    p, s, b = o["kq"]
    raises(att(o, k=(p, s[:, :, :N - 1], b), v=o["vq"]), r"k: scales/biases dim 2")
    raises(att(o, k=(p, s, b[:, :1]), v=o["vq"]), r"k.*biases|k.*scales/biases")
    raises(att(o, k=(p, s), v=o["vq"]), r"\bk must be an array or a \(packed, scales, biases\) tuple")


def test_dtype_mismatches(ops):
    o = ops
    raises(att(o, q=o["q"].astype(np.float64)), r"\bq has unsupported dtype float64")
    raises(att(o, q=o["q"].astype(np.int32)), r"\bq has unsupported dtype")
    raises(att(o, k=o["k"].astype(np.int32)), r"k\.data has unsupported dtype")
    raises(att(o, out=np.empty((B, H, L, D), np.int32)), r"\bout has unsupported dtype")
    p, s, b = o["kq"]
    raises(att(o, k=(p, s, b.astype(np.float16)), v=o["vq"]), r"k.*(scales|biases).*(dtype|differ)")
    raises(att(o, k=(p.astype(np.float32), s, b), v=o["vq"]), r"k\.data has unsupported dtype")
    raises(att(o, k=(p.view(np.int32), s, b), v=o["vq"]), r"k\.data has unsupported dtype")
    raises(att(o, k=(p, s.astype(np.int32), b), v=o["vq"]), r"k\.scales has unsupported dtype")
    raises(att(o, mask="causal", segments=np.zeros((B, N), np.float32)), r"segments has unsupported dtype")
    raises(att(o, mask=np.zeros((L, N), np.int32)), r"mask\.array has unsupported dtype")
    raises(att(o, seq_lens=np.full(B, N, np.float32)), r"seq_lens has unsupported dtype")


def test_heads_not_multiple(ops, request):
    q = randn(rng_for(request), (B, 3, L, D))
    raises(att(ops, q=q), r"H = 3 is not a multiple of KV heads KVH = 2")


def test_unsupported_format(ops, request):
    rng = rng_for(request)
    raises(att(ops, q=randn(rng, (B, H, L, 48)), k=randn(rng, (B, KVH, N, 48)), v=randn(rng, (B, KVH, N, 48))),
           r"head dim")
    raises(att(ops, k=ops["kq"], v=ops["vq"], bits=3), r"k\.bits = 3")
    raises(att(ops, k=ops["kq"], v=ops["vq"], bits=4, group_size=16), r"k\.group_size = 16")
    raises(att(ops, k=ops["kq"], v=ops["vq"], group_size=2**32 + 64), r"group_size = 4294967360 is out of the int32 range")
    # D = 80 at group 64: head dim not a multiple of the group
    k80 = (np.zeros((B, KVH, N, 10), np.uint32), np.ones((B, KVH, N, 1), np.float32),
           np.ones((B, KVH, N, 1), np.float32))
    raises(att(ops, q=randn(rng, (B, H, L, 80)), k=k80, v=k80), r"k: head dim 80 is not a multiple of group_size 64")


def test_bad_strides(ops):
    o = ops
    k = o["k"]
    bcast = np.broadcast_to(k[:, :, :1], k.shape)  # stride 0 over N
    raises(att(o, k=bcast), r"k\.data.*stride")
    half_row = np.lib.stride_tricks.as_strided(k, shape=k.shape, strides=k.strides[:2] + (D * 2, 4))
    raises(att(o, k=half_row), r"k\.data.*overlaps")
    p, s, b = o["kq"]
    raises(att(o, k=(np.broadcast_to(p[:1], p.shape), s, b), v=o["vq"]), r"k\.data.*stride")
    out = np.empty((B, H, L, 2 * D), np.float32)[..., ::2]
    raises(att(o, out=out), r"out: innermost stride")
    ro = np.empty((B, H, L, D), np.float32)
    ro.flags.writeable = False
    raises(att(o, out=ro), r"out is read-only")
    raises(att(o, out=o["q"]), r"out overlaps q")
    raises(att(o, out=np.broadcast_to(np.empty(D, np.float32), (B, H, L, D))), r"out")
    buf = np.zeros(k.nbytes + 64, np.uint8)  # rows 2 bytes off their f32 alignment
    odd = np.lib.stride_tricks.as_strided(buf.view(np.float32), shape=k.shape,
                                          strides=k.strides[:2] + (D * 4 + 2, 4))
    raises(att(o, k=odd), r"k\.data\.stride\[2\] = 258 is not a multiple of the element size 4")


def test_empty_dims(ops):
    o = ops
    raises(att(o, q=o["q"][:0], k=o["k"][:0], v=o["v"][:0]), r"q\.shape\[0\] = 0 must be positive")
    raises(att(o, q=o["q"][:, :, :0]), r"q\.shape\[2\] = 0 must be positive")
    raises(att(o, k=o["k"][:, :, :0], v=o["v"][:, :, :0]), r"k\.data\.shape\[2\] = 0 must be positive")


def test_rows_beyond_cache(ops, request):
    q = randn(rng_for(request), (B, H, N + 1, D))
    raises(att(ops, q=q, mask="causal"), r"q rows L = 11 exceed the cache length N = 10")


def test_seq_lens(ops):
    raises(att(ops, seq_lens=[N + 1, N]), r"seq_lens\[0\] = 11 must be in \[L, N\]")
    raises(att(ops, seq_lens=[N, L - 1]), r"seq_lens\[1\] = 1 must be in \[L, N\]")
    raises(att(ops, seq_lens=[N, 0]), r"seq_lens\[1\] = 0")
    raises(att(ops, seq_lens=[N]), r"seq_lens must have shape \[B\] = \[2\]")
    raises(att(ops, seq_lens=[[N, N]]), r"seq_lens must have shape")
    raises(att(ops, seq_lens=[N, 2**40]), r"seq_lens has values outside the int32 range")


def test_window(ops):
    raises(att(ops, mask="causal", window=0), r"window = 0 must be > 0")
    raises(att(ops, mask="causal", window=-3), r"window = -3 must be > 0")
    raises(att(ops, window=4), r"window needs mask\.kind = KVA_MASK_CAUSAL")
    raises(att(ops, mask=np.ones(N, bool), window=4), r"window needs")
    raises(lambda: kvattn.causal_mask(4, 0, window=0), r"window = 0")
    raises(lambda: kvattn.causal_mask(4, 0, window=-1), r"window = -1")
    raises(lambda: kvattn.image_mask(np.zeros(4, np.int32), window=-1), r"window = -1")


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 1e39, 0.0])
def test_scale(ops, scale):
    raises(att(ops, scale=scale), r"scale = ")


def test_scalar_types(ops):
    for kw in ({"scale": "1"}, {"softcap": "5"}, {"scale": True}, {"softcap": [5.0]}):
        with pytest.raises(TypeError, match=r"must be a number or None"):
            att(ops, **kw)()
    assert np.isfinite(att(ops, scale=np.float32(0.5), softcap=np.int64(30))()).all()


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("nan"), float("inf")])
def test_softcap(ops, softcap):
    raises(att(ops, softcap=softcap), r"softcap = ")


def test_segments(ops):
    raises(att(ops, mask="causal", segments=np.zeros((B, N - 1), np.int32)),
           r"mask\.segments must be \[B, N\] = \[2, 10\], got \[2, 9\]")
    raises(att(ops, mask="causal", segments=np.zeros((B + 1, N), np.int32)), r"mask\.segments must be \[B, N\]")
    raises(att(ops, mask="causal", segments=np.zeros(N, np.int32)), r"mask\.segments must be \[B, N\]")
    raises(att(ops, mask="causal", segments=np.zeros((1, B, N), np.int32)), r"mask\.segments must have rank 2")
    raises(att(ops, segments=np.zeros((B, N), np.int32)), r"segments needs mask\.kind = KVA_MASK_CAUSAL")
    raises(att(ops, mask="causal", clamp=True), r"segments_clamp is set but mask\.segments is NULL")


def test_sinks_and_masks(ops):
    raises(att(ops, sinks=np.zeros(H + 1, np.float32)), r"sinks must have shape \[H\] = \[4\]")
    raises(att(ops, sinks=np.zeros((1, H), np.float32)), r"sinks must have shape")
    raises(att(ops, mask=np.ones((L, N + 1), bool)), r"mask\.array\.shape\[3\] = 11 must be N = 10")
    raises(att(ops, mask=np.ones((3, L, N), bool)), r"mask\.array\.shape\[1\] = 3 must be H = 4")
    raises(att(ops, mask="bidir"), r"mask = 'bidir'")


def test_output_untouched_on_error(ops):
    out = np.full((B, H, L, D), 7.0, np.float32)
    raises(att(ops, mask="causal", window=-1, out=out), r"window")
    raises(att(ops, seq_lens=[N + 1, N], out=out), r"seq_lens")
    assert (out == 7.0).all()


# ------------------------------------------------- quantize, dequantize, masks


def test_quantize_errors(request):
    rng = rng_for(request)
    w = randn(rng, (3, 128))
    raises(lambda: kvattn.quantize(randn(rng, (3, 100))),
           r"\bw: last dim 100 is not a multiple of out\.group_size = 64")
    raises(lambda: kvattn.quantize(w, bits=3), r"bits = 3")
    raises(lambda: kvattn.quantize(w, bits=16), r"bits = 16")
    raises(lambda: kvattn.quantize(w, group_size=16), r"group_size = 16")
    # C int arguments: ctypes would wrap these to 64 and 4
    raises(lambda: kvattn.quantize(w, group_size=2**32 + 64), r"group_size = 4294967360 is out of the int32 range")
    raises(lambda: kvattn.quantize(w, bits=2**32 + 4), r"bits = 4294967300 is out of the int32 range")
    raises(lambda: kvattn.dequantize(*kvattn.quantize(w), group_size=2**32 + 64), r"out of the int32 range")
    raises(lambda: kvattn.quantize(w.astype(np.float64)), r"\bw has unsupported dtype float64")
    raises(lambda: kvattn.quantize(w.astype(np.int32)), r"\bw has unsupported dtype")
    raises(lambda: kvattn.quantize(np.float32(1.0)), r"\bw must have rank >= 1")
    raises(lambda: kvattn.quantize(np.zeros((0, 64), np.float32)), r"\bw\.shape\[0\] = 0 must be positive")
    with pytest.raises(TypeError):
        kvattn.quantize(w, bits=4.0)


def test_dequantize_errors(request):
    rng = rng_for(request)
    p, s, b = kvattn.quantize(randn(rng, (3, 128)))
    raises(lambda: kvattn.dequantize(p, s[:, :1], b), r"q\.scales")
    raises(lambda: kvattn.dequantize(p, s, b[:2]), r"q\.biases")
    raises(lambda: kvattn.dequantize(p, s, b.astype(np.float16)), r"q\.biases.*dtype")
    raises(lambda: kvattn.dequantize(p, s, b, bits=5), r"bits = 5")
    raises(lambda: kvattn.dequantize(p, s, b, group_size=48), r"group_size = 48")
    raises(lambda: kvattn.dequantize(p.astype(np.float32), s, b), r"q\.data has unsupported dtype")
    raises(lambda: kvattn.dequantize(p, s, b, dtype=np.int32), r"\bout has unsupported dtype")


def test_mask_function_errors():
    raises(lambda: kvattn.causal_mask(0, 3), r"\bn = 0 must be positive")
    raises(lambda: kvattn.causal_mask(3, -1), r"offset = -1")
    raises(lambda: kvattn.image_mask(np.zeros((2, 3), np.int32)), r"segments must have rank 1")
    raises(lambda: kvattn.image_mask(np.zeros(3, np.float32)), r"segments has unsupported dtype")
    raises(lambda: kvattn.image_mask(np.zeros(0, np.int32)), r"segments\.shape\[0\] = 0")


def test_context_errors():
    raises(lambda: kvattn.Context(threads=-1), r"threads = -1")
    raises(lambda: kvattn.Context(threads=10**9), r"exceeds KVA_MAX_THREADS \(1024\)")
    raises(lambda: kvattn.Context(threads=2**40), r"threads = 1099511627776 is out of the int32 range")
    raises(lambda: kvattn.Context(device=2**33), r"device = 8589934592 is out of the int32 range")
    raises(lambda: kvattn.set_cpu_simd("neon"), r"neon")
    with pytest.raises(ValueError, match="backend"):
        kvattn.Context(backend="tpu")


# ------------------------------------------- the C API's null pointers


def descriptors(o):
    """Valid descriptors of a quantized causal call, ready to be broken."""
    return kvattn._Call(o["q"], o["kq"], o["vq"], None, "causal", None, None, False, None, None, 64, 4, None,
                        None)


def c_attention(call, ctx=True, q=True, view=True, params=True, out=True):
    handle = kvattn.default_context().handle if ctx else None
    args = call.refs()
    args = [a if keep else None for a, keep in zip(args, (q, view, params, out))]
    return C.lib.kva_attention(handle, *args, None, 0)


def c_raises(rc, pattern):
    import re

    assert rc < 0, rc
    assert re.search(pattern, C.last_error()), C.last_error()


def test_null_pointers(ops):
    call = descriptors(ops)
    assert c_attention(call) == 0  # the intact descriptors work
    c_raises(c_attention(call, ctx=False), r"ctx is NULL")
    c_raises(c_attention(call, q=False), r"\bq is NULL")
    c_raises(c_attention(call, view=False), r"kv \(the K/V view\) is NULL")
    c_raises(c_attention(call, out=False), r"\bout is NULL")
    for field, pattern in [("q", r"q\.data is NULL"), ("out", r"out\.data is NULL")]:
        t = getattr(call, field)
        saved, t.data = t.data, None
        c_raises(c_attention(call), pattern)
        t.data = saved
    for part, pattern in [("data", r"k\.data\.data is NULL"), ("scales", r"k\.scales\.data is NULL"),
                          ("biases", r"k\.biases\.data is NULL")]:
        t = getattr(call.view.k, part)
        saved, t.data = t.data, None
        c_raises(c_attention(call), pattern)
        t.data = saved
    m = call.params.mask
    m.kind = C.MASK_ARRAY
    c_raises(c_attention(call), r"mask\.array")
    m.kind = C.MASK_CAUSAL
    assert c_attention(call) == 0
    c_raises(C.lib.kva_quantize(None, None), r"\bw is NULL")
    c_raises(C.lib.kva_dequantize(None, None), r"\bq is NULL")
    c_raises(C.lib.kva_causal_mask(2, 0, 0, None), r"\bout\b")
    c_raises(C.lib.kva_image_mask(None, 0, 0, None), r"segments")
    c_raises(C.lib.kva_reference_attention(None, None, None, None), r"NULL")


def test_c_innermost_stride_of_inputs(ops):
    """The binding copies such inputs; the C API itself refuses them by name."""
    call = descriptors(ops)
    call.q.stride[3] = 8
    c_raises(c_attention(call), r"q: innermost stride 8 must equal the element size 4")
    call = descriptors(ops)
    call.view.v.scales.stride[3] = 0
    c_raises(c_attention(call), r"v\.scales")
    call = descriptors(ops)
    call.view.k.data.stride[2] = -call.view.k.data.stride[2]
    c_raises(c_attention(call), r"k\.data\.stride\[2\]")
    assert ctypes.sizeof(C.kva_tensor) == 8 + 4 + 4 + 8 * 4 + 8 * 4


# --------------------------------- aliasing, alignment, sinks, segment ids


def _shared(nbytes):
    """One buffer that both an output and an input are views of."""
    return np.zeros(nbytes + 64, np.uint8)


def test_out_aliasing_other_inputs(ops):
    """out may not overlap the sinks, seq_lens or segment ids the call reads
    (the library checks addresses; the binding passes these arrays in place)."""
    nout = B * H * L * D * 4
    buf = _shared(nout + 4 * H)
    out = buf[:nout].view(np.float32).reshape(B, H, L, D)
    sinks = buf[nout - 4 * H:nout].view(np.float32)  # the last H floats of out
    raises(att(ops, sinks=sinks, out=out), r"out overlaps sinks")
    lens = buf[:8].view(np.int32)
    lens[:] = N
    before = buf.copy()
    raises(att(ops, seq_lens=lens, out=out), r"out overlaps seq_lens")
    seg = buf[:B * N * 4].view(np.int32).reshape(B, N)
    raises(att(ops, mask="causal", segments=seg, out=out), r"out overlaps mask\.segments")
    assert (buf == before).all()


def test_misaligned_pointers(ops):
    """Loads are typed: a float32 array 2 bytes off its alignment, and one
    whose row stride is not a multiple of 4, are refused (the binding passes
    them as they are)."""
    k = ops["k"]
    buf = np.zeros(k.nbytes + 8, np.uint8)
    off = buf[2:2 + k.nbytes].view(np.float32).reshape(k.shape)
    assert off.ctypes.data % 4 == 2
    raises(att(ops, k=off), r"k\.data: data pointer 0x[0-9a-f]+ is not aligned to its element size 4")
    out = np.zeros(B * H * L * D * 4 + 8, np.uint8)[1:1 + B * H * L * D * 4].view(np.float32).reshape(B, H, L, D)
    raises(att(ops, out=out), r"\bout: data pointer")
    assert (out == 0).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_sinks(ops, bad):
    """NaN and +inf sinks are refused (-inf is a sink that adds nothing)."""
    sinks = np.zeros(H, np.float32)
    sinks[2] = bad
    out = np.full((B, H, L, D), 7.0, np.float32)
    raises(att(ops, sinks=sinks, out=out), r"sinks\[2\] = (nan|inf) must be finite or -inf")
    assert (out == 7.0).all()


def test_negative_segment_ids(ops):
    seg = np.zeros((B, N), np.int32)
    seg[1, 3] = -1
    out = np.full((B, H, L, D), 7.0, np.float32)
    raises(att(ops, mask="causal", segments=seg, out=out), r"mask\.segments\[1\]\[3\] = -1")
    assert (out == 7.0).all()
    raises(lambda: kvattn.image_mask(np.array([0, 1, -2, 1], np.int32)), r"segments\[2\] = -2")
