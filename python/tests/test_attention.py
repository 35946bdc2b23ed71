"""kvattn.attention against the float64 numpy reference of kvref.py (written
from docs/, independent of the library's oracle): float and quantized
caches, GQA, L = 1 and L > 1, every mask mode, softcap, sinks, per-sequence
lengths, strided views, 16-bit inputs, the out= argument with sentinels."""
import numpy as np
import pytest

import kvattn
from kvref import (BF16, F16, F32, assert_close, compute_atol, kernel_atol, randn, ref_attention, ref_for_kernel,
                   rng_for)


def make_kv(rng, B, KVH, N, D, dtype, bits=0, group_size=64):
    """A random K or V cache: a float array, or kvattn.quantize of one (the
    reference reads the packed words itself, so this does not trust quantize)."""
    w = randn(rng, (B, KVH, N, D), dtype)
    return w if bits == 0 else kvattn.quantize(w, group_size=group_size, bits=bits)


def run_case(request, B, H, KVH, L, N, Dk, Dv, kv_dtype, q_dtype, bits=0, group_size=64, threads=None,
             **kw):
    rng = rng_for(request)
    q = randn(rng, (B, H, L, Dk), q_dtype)
    k = make_kv(rng, B, KVH, N, Dk, kv_dtype, bits, group_size)
    v = make_kv(rng, B, KVH, N, Dv, kv_dtype, bits, group_size)
    out = kvattn.attention(q, k, v, group_size=group_size, bits=bits, threads=threads, **kw)
    assert out.shape == (B, H, L, Dv) and out.dtype == q.dtype
    ref = ref_for_kernel(q, k, v, group_size=group_size, bits=bits, threads=threads, **kw)
    # f32 rounding in the logits grows with their size: scale the allowance by
    # how much an explicit scale enlarges them over the default 1/sqrt(Dk).
    growth = max(1.0, abs(kw["scale"]) * Dk ** 0.5) if kw.get("scale") is not None else 1.0
    atol = kernel_atol(q, k, v, KVH, group_size=group_size, bits=bits, threads=threads, **kw)
    assert_close(out, ref, request.node.name, atol * growth)
    return q, k, v, out, ref


CAUSAL = {"mask": "causal"}

# (B, H, KVH, L, N, Dk, Dv, kv dtype, q dtype, bits, group, extra kwargs)
CASES = {
    "decode_f32_gqa4": (1, 8, 2, 1, 113, 128, 128, F32, F32, 0, 64, {}),
    "decode_f32_causal_B3": (3, 8, 2, 1, 97, 64, 64, F32, F32, 0, 64, CAUSAL),
    "decode_n1": (1, 4, 4, 1, 1, 64, 64, F32, F32, 0, 64, CAUSAL),
    "decode_mqa_bf16": (2, 6, 1, 1, 150, 128, 128, BF16, BF16, 0, 64, CAUSAL),
    "decode_f16": (1, 8, 4, 1, 77, 96, 96, F16, F16, 0, 64, CAUSAL),
    "decode_d80_f32": (1, 4, 2, 1, 65, 80, 80, F32, F32, 0, 64, CAUSAL),
    "decode_d256_gqa6_q4": (1, 12, 2, 1, 130, 256, 256, BF16, BF16, 4, 64, CAUSAL),
    "decode_q4_g64_f32": (2, 8, 2, 1, 257, 128, 128, F32, F32, 4, 64, CAUSAL),
    "decode_q2_g128_f16": (1, 8, 2, 1, 200, 128, 128, F16, F16, 2, 128, CAUSAL),
    "decode_q8_g32_bf16": (1, 8, 2, 1, 129, 64, 64, BF16, BF16, 8, 32, CAUSAL),
    "decode_q4_g32_d96": (1, 4, 2, 1, 90, 96, 96, F16, F32, 4, 32, CAUSAL),
    "decode_dk128_dv64": (2, 4, 2, 1, 70, 128, 64, F32, F32, 0, 64, CAUSAL),
    "decode_dk128_dv64_q8": (1, 4, 1, 1, 70, 128, 64, BF16, BF16, 8, 64, CAUSAL),
    "verify_L8_q4_bf16": (1, 12, 2, 8, 200, 64, 64, BF16, BF16, 4, 32, CAUSAL),
    "verify_L3_f32_B3": (3, 8, 2, 3, 50, 128, 128, F32, F32, 0, 64, CAUSAL),
    "verify_L16_q8": (1, 4, 2, 16, 64, 128, 128, F32, F32, 8, 64, CAUSAL),
    "verify_L5_nomask": (2, 8, 8, 5, 33, 64, 64, F32, F32, 0, 64, {}),
    "prefill_L20_f32": (1, 4, 2, 20, 40, 64, 64, F32, F32, 0, 64, CAUSAL),
    "prefill_L17_q4_bf16": (2, 4, 1, 17, 17, 128, 128, BF16, BF16, 4, 64, CAUSAL),
    "mixed_q_f32_kv_bf16_q4": (1, 8, 2, 2, 100, 128, 128, BF16, F32, 4, 64, CAUSAL),
    "decode_long_q4_bf16": (1, 8, 2, 1, 4097, 128, 128, BF16, BF16, 4, 64, CAUSAL),
    "verify_long_L8_q8_f16": (1, 8, 2, 8, 2500, 64, 64, F16, F16, 8, 32, CAUSAL),
    "decode_long_f32_B3": (3, 4, 1, 1, 1500, 128, 128, F32, F32, 0, 64, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cases(request, name):
    B, H, KVH, L, N, Dk, Dv, kvdt, qdt, bits, g, kw = CASES[name]
    run_case(request, B, H, KVH, L, N, Dk, Dv, kvdt, qdt, bits, g, **kw)


@pytest.mark.parametrize("window", [1, 7, 64])
@pytest.mark.parametrize("L,bits", [(1, 0), (4, 4), (9, 0), (19, 8)])
def test_sliding_window(request, window, L, bits):
    run_case(request, 2, 8, 2, L, 100, 128, 128, BF16, BF16, bits, 64, mask="causal", window=window)


@pytest.mark.parametrize("clamp", [False, True])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("L", [1, 6, 24])
def test_segments(request, clamp, window, L):
    """Two images in the cache (ids 1 and 2, with text around them); the query
    rows sit inside the second image for L > 1."""
    B, N = 2, 60
    seg = np.zeros((B, N), np.int32)
    seg[0, 10:25] = 1
    seg[0, 40:58] = 2
    seg[1, 5:12] = 3
    seg[1, 50:] = 4
    run_case(request, B, 4, 2, L, N, 64, 64, F32, F32, 0, 64, mask="causal", window=window, segments=seg,
             clamp=clamp)


def test_segments_1d_for_b1(request):
    seg = np.zeros(48, np.int64)  # any integer dtype, [N] for B = 1
    seg[30:46] = 1
    run_case(request, 1, 4, 2, 8, 48, 64, 64, F32, F32, 0, 64, mask="causal", segments=seg)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
@pytest.mark.parametrize("bits", [0, 4])
def test_softcap(request, softcap, bits):
    run_case(request, 1, 8, 2, 3, 90, 128, 128, F32, F32, bits, 64, mask="causal", softcap=softcap, scale=0.3)


@pytest.mark.parametrize("L,mask", [(1, None), (4, "causal"), (20, "causal")])
def test_sinks(request, L, mask):
    rng = rng_for(request, salt=1)
    sinks = (rng.standard_normal(8) * 2).astype(np.float32)
    run_case(request, 2, 8, 2, L, 60, 64, 64, F32, F32, 0, 64, mask=mask, sinks=sinks)


@pytest.mark.parametrize("scale", [0.01, 1.0, -0.2])
def test_explicit_scale(request, scale):
    run_case(request, 1, 4, 2, 2, 50, 64, 64, F32, F32, 4, 64, mask="causal", scale=scale)


# ---------------------------------------------------------- array masks

MASK_SHAPES = {
    "full": lambda B, H, L, N: (B, H, L, N),
    "LN": lambda B, H, L, N: (L, N),
    "B1LN": lambda B, H, L, N: (B, 1, L, N),
    "1H1N": lambda B, H, L, N: (1, H, 1, N),
    "N": lambda B, H, L, N: (N,),
}


@pytest.mark.parametrize("shape", list(MASK_SHAPES))
@pytest.mark.parametrize("kind", ["bool", "additive_f32", "additive_bf16", "additive_f64"])
def test_array_mask(request, shape, kind):
    B, H, KVH, L, N = 2, 4, 2, 3, 70
    rng = rng_for(request, salt=2)
    mshape = MASK_SHAPES[shape](B, H, L, N)
    if kind == "bool":
        mask = rng.random(mshape) < 0.7
        mask[..., -1] = True  # every row keeps a key (empty rows: test_empty_rows)
    else:
        mask = rng.standard_normal(mshape) * 2
        mask[rng.random(mshape) < 0.2] = -np.inf
        mask[..., 0] = 0.5
        mask = mask.astype({"additive_f32": F32, "additive_bf16": BF16, "additive_f64": np.float64}[kind])
    run_case(request, B, H, KVH, L, N, 64, 64, F32, F32, 4, 64, mask=mask)


def test_array_mask_matches_causal(request):
    """A bool array equal to the causal rule gives the causal result."""
    B, H, L, N = 1, 4, 5, 40
    q, k, v, out, _ = run_case(request, B, H, 2, L, N, 64, 64, F32, F32, 0, 64, mask="causal", window=9)
    allow = kvattn.causal_mask(L, N - L, window=9)
    out2 = kvattn.attention(q, k, v, mask=allow)
    assert_close(out2, out.astype(np.float64), "array vs causal")


def test_empty_rows_are_zero(request):
    """A row that sees no key outputs zeros (never NaN), with and without sinks."""
    B, H, L, N = 1, 4, 3, 30
    rng = rng_for(request)
    mask = rng.random((B, H, L, N)) < 0.5
    mask[0, 1, 2, :] = False
    mask[0, 3, 0, :] = False
    for sinks in (None, np.ones(H, np.float32)):
        _, _, _, out, _ = run_case(request, B, H, 2, L, N, 64, 64, F32, F32, 0, 64, mask=mask, sinks=sinks)
        assert (out[0, 1, 2] == 0).all() and (out[0, 3, 0] == 0).all()


# ------------------------------------------------------ per-sequence lengths


@pytest.mark.parametrize("L,bits,mask", [(1, 0, "causal"), (1, 4, None), (4, 4, "causal"), (18, 0, "causal")])
def test_seq_lens(request, L, bits, mask):
    B, N = 3, 1100
    seq_lens = np.array([N, L, 537], np.int64)
    run_case(request, B, 8, 2, L, N, 128, 128, BF16, BF16, bits, 64, mask=mask, seq_lens=seq_lens)


def test_seq_lens_ignore_rows_beyond(request):
    """Rows past a sequence's length are never read: NaN there changes nothing."""
    B, H, KVH, L, N, D = 2, 4, 2, 2, 50, 64
    rng = rng_for(request)
    q = randn(rng, (B, H, L, D))
    k, v = randn(rng, (B, KVH, N, D)), randn(rng, (B, KVH, N, D))
    lens = np.array([20, 50], np.int32)
    ref = ref_attention(q, k, v, mask="causal", seq_lens=lens)
    k[0, :, 20:] = np.nan
    v[0, :, 20:] = np.nan
    out = kvattn.attention(q, k, v, mask="causal", seq_lens=lens)
    assert_close(out, ref, "seq_lens")


# ------------------------------------------------------------ strided views


@pytest.mark.parametrize("bits", [0, 4])
def test_views_into_larger_cache(request, bits):
    """k[:, :, :N] of a cache with capacity 2N, a head-major slice, and a
    [B, N, KVH, D] cache transposed to [B, KVH, N, D]: read in place."""
    rng = rng_for(request)
    B, H, KVH, L, N, D, cap = 2, 8, 4, 2, 61, 128, 130
    q = randn(rng, (B, H, L, D), BF16)
    kc = make_kv(rng, B, KVH + 1, cap, D, BF16, bits)
    vt = make_kv(rng, B, cap, KVH, D, BF16, bits)  # token-major layout
    if bits:
        k = tuple(a[:, 1:, :N] for a in kc)
        v = tuple(a[:, :N].transpose(0, 2, 1, 3) for a in vt)
        assert not k[0].flags.c_contiguous and not v[0].flags.c_contiguous
    else:
        k = kc[:, 1:, :N]
        v = vt[:, :N].transpose(0, 2, 1, 3)
    out = kvattn.attention(q, k, v, mask="causal", bits=bits)
    assert_close(out, ref_for_kernel(q, k, v, mask="causal", bits=bits), "views",
                 kernel_atol(q, k, v, KVH, mask="causal", bits=bits))


def test_noncontiguous_innermost_inputs_are_copied(request):
    rng = rng_for(request)
    B, H, KVH, L, N, D = 1, 4, 2, 3, 40, 64
    q = randn(rng, (B, H, L, 2 * D))[..., ::2]
    k = randn(rng, (B, KVH, N, 2 * D))[..., 1::2]
    v = np.flip(randn(rng, (B, KVH, N, D)), axis=2)  # negative strides
    out = kvattn.attention(q, k, v, mask="causal")
    assert_close(out, ref_attention(q, k, v, mask="causal"), "copied inputs")


def test_out_argument_strided_with_sentinels(request):
    """out= a strided view inside a larger buffer: the result lands there and
    nothing around it is written."""
    rng = rng_for(request)
    B, H, KVH, L, N, D = 2, 4, 2, 3, 50, 64
    q = randn(rng, (B, H, L, D), BF16)
    k, v = randn(rng, (B, KVH, N, D), BF16), randn(rng, (B, KVH, N, D), BF16)
    sentinel = np.float32(-12345.5)
    buf = np.full((B, H + 1, L + 2, D + 16), sentinel, np.float32)
    view = buf[:, 1:, 1:L + 1, 8:8 + D]
    ret = kvattn.attention(q, k, v, mask="causal", out=view)
    assert ret is view
    assert_close(view, ref_attention(q, k, v, mask="causal"), "out view", compute_atol(q, KVH))
    touched = np.zeros(buf.shape, bool)
    touched[:, 1:, 1:L + 1, 8:8 + D] = True
    assert (buf[~touched] == sentinel).all()


# ------------------------------------------------------- contexts, paths


def test_threads_and_contexts(request):
    rng = rng_for(request)
    q = randn(rng, (2, 8, 2, 128))
    k, v = kvattn.quantize(randn(rng, (2, 2, 300, 128))), kvattn.quantize(randn(rng, (2, 2, 300, 128)))
    ref = ref_for_kernel(q, k, v, mask="causal")
    assert_close(kvattn.attention(q, k, v, mask="causal", threads=1), ref, "threads=1")
    assert_close(kvattn.attention(q, k, v, mask="causal", threads=3), ref, "threads=3")
    assert kvattn.default_context(1) is kvattn.default_context(1)
    assert kvattn.default_context(1).threads == 1
    with kvattn.Context(threads=2) as ctx:
        assert ctx.threads == 2
        assert_close(kvattn.attention(q, k, v, mask="causal", context=ctx), ref, "context")
    with pytest.raises(ValueError, match="closed"):
        kvattn.attention(q, k, v, context=ctx)


def test_reference_attention_matches_numpy(request):
    """The library's oracle agrees with the independent numpy reference."""
    rng = rng_for(request)
    q = randn(rng, (2, 6, 3, 64), BF16)
    k, v = make_kv(rng, 2, 3, 45, 64, BF16, 4), make_kv(rng, 2, 3, 45, 64, BF16, 4)
    sinks = rng.standard_normal(6).astype(np.float32)
    kw = dict(mask="causal", window=20, softcap=3.0, sinks=sinks, seq_lens=[45, 30])
    out = kvattn.reference_attention(q, k, v, **kw)
    assert_close(out, ref_attention(q, k, v, **kw), "oracle")


def test_attention_path(request):
    rng = rng_for(request)
    q1, q20 = randn(rng, (1, 4, 1, 64)), randn(rng, (1, 4, 20, 64))
    k = v = randn(rng, (1, 2, 30, 64))
    assert kvattn.attention_path(q1, k, v, mask="causal") == "fused"
    assert kvattn.attention_path(q20, k, v, mask="causal") == "fused"  # in row groups
    assert kvattn.attention_path(q1, k, v, mask=np.ones(30, bool)) == "fallback"


def test_attention_kernel(request):
    rng = rng_for(request)
    q1, q20 = randn(rng, (1, 4, 1, 64)), randn(rng, (1, 4, 20, 64))
    k = v = randn(rng, (1, 2, 30, 64))
    simd = kvattn.cpu_simd()
    name = kvattn.attention_kernel(q1, k, v, mask="causal")
    assert name.startswith("cpu " + simd + " ") and name.endswith("]") and " kernel [" in name
    # long L runs fused (row groups); the fallback path (mask arrays) the general kernel at every SIMD level
    assert kvattn.attention_kernel(q20, k, v, mask="causal") == name
    mask = np.ones(30, bool)
    assert kvattn.attention_kernel(q1, k, v, mask=mask) == "cpu " + simd + " general kernel [exact f32]"
    with pytest.raises(ValueError, match="multiple of KV heads"):
        kvattn.attention_kernel(randn(rng, (1, 3, 1, 64)), k, v)


def test_info():
    assert kvattn.version() == kvattn.__version__
    assert kvattn.version().count(".") == 2
    assert kvattn.cpu_simd() in ("avx512", "avxvnni", "avx2", "portable")
    assert isinstance(kvattn.build_info(), str) and kvattn.build_info()
    assert kvattn.cuda_device_count() >= 0


@pytest.mark.parametrize("level", ["portable", "avx2", "avxvnni", "avx512"])
def test_simd_levels_agree_with_reference(request, level):
    best = kvattn.cpu_simd()
    try:
        kvattn.set_cpu_simd(level)
    except ValueError:
        pytest.skip("CPU lacks %s" % level)
    try:
        run_case(request, 1, 8, 2, 2, 100, 128, 128, BF16, BF16, 4, 64, mask="causal")
        run_case(request, 1, 4, 2, 1, 50, 64, 64, F32, F32, 0, 64, mask="causal")
    finally:
        kvattn.set_cpu_simd(None)
    assert kvattn.cpu_simd() == best


def test_views_are_not_copied(request):
    """Descriptors point into the caller's arrays (strided views included);
    only a non-contiguous innermost axis is copied."""
    rng = rng_for(request)
    q = randn(rng, (1, 4, 1, 64))
    cache = randn(rng, (1, 2, 100, 64))
    kq = kvattn.quantize(randn(rng, (1, 3, 100, 64)))
    k = cache[:, :, :40]
    v = tuple(a[:, 1:, :40] for a in kq)
    call = kvattn._Call(q, k, v, None, "causal", None, None, False, None, None, 64, 4, None, None)
    assert call.view.k.data.data == k.ctypes.data
    assert list(call.view.k.data.stride) == list(k.strides)
    for part, a in zip(("data", "scales", "biases"), v):
        assert getattr(call.view.v, part).data == a.ctypes.data
        assert list(getattr(call.view.v, part).stride) == list(a.strides)
    kx = randn(rng, (1, 2, 40, 128))[..., ::2]
    call = kvattn._Call(q, kx, k, None, None, None, None, False, None, None, 64, 4, None, None)
    assert call.view.k.data.data != kx.ctypes.data and call.view.k.data.stride[3] == 4


def test_exact_mode(request):
    """exact=True (KVA_ATTN_EXACT): only "[exact f32]" kernels, at the f32
    allowance of the reference; the default call (AMX or integer queries
    where the CPU has them) agrees within its own allowance."""
    import ctypes

    from kvattn import _capi as C
    from kvref import COMPUTE_ATOL

    names = [n for n, _ in C.kva_attn_params._fields_]
    assert names[-1] == "flags" and dict(C.kva_attn_params._fields_)["flags"] is ctypes.c_uint
    assert C.kva_attn_params.flags.offset == C.kva_attn_params.sinks.offset + ctypes.sizeof(ctypes.c_void_p)
    assert C.ATTN_EXACT == 1
    rng = rng_for(request)
    B, H, KVH, L, N, D = 1, 8, 4, 8, 300, 128  # bf16 q over q4 K, 16 query vectors per KV head
    q = randn(rng, (B, H, L, D), BF16)
    k = make_kv(rng, B, KVH, N, D, F32, 4)
    v = make_kv(rng, B, KVH, N, D, F32, 4)
    assert kvattn.attention_kernel(q, k, v, mask="causal", exact=True).endswith("[exact f32]")
    exact = kvattn.attention(q, k, v, mask="causal", exact=True, out=np.empty((B, H, L, D), F32))
    default = kvattn.attention(q, k, v, mask="causal", out=np.empty((B, H, L, D), F32))
    ref = ref_attention(q, k, v, mask="causal")
    assert_close(exact, ref, "exact", COMPUTE_ATOL)
    assert_close(default, exact.astype(np.float64), "default vs exact", 2 * compute_atol(q, KVH))
    with pytest.raises(TypeError, match="exact must be a bool"):
        kvattn.attention(q, k, v, exact=1)
    # the same call over a paged view and a block table: bit-equal to the contiguous exact call's rows
    pool, seqs = kvattn.Pool.from_contiguous(k, v, block_size=16, shuffle_seed=3, group_size=64, bits=4)
    view = pool.view(seqs)
    paged = view.attention(q, mask="causal", exact=True, out=np.empty((B, H, L, D), F32))
    blocks, lens, first = view.block_table()
    table = kvattn.block_table_attention(q, pool.k, pool.v, blocks, lens, first, mask="causal", group_size=64,
                                         bits=4, exact=True, out=np.empty((B, H, L, D), F32))
    assert_close(paged, ref, "paged exact", COMPUTE_ATOL)
    assert_close(table, ref, "block table exact", COMPUTE_ATOL)
    with pytest.raises(TypeError, match="exact must be a bool"):
        view.attention(q, exact="yes")
