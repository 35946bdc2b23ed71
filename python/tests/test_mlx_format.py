"""Cross-check with MLX itself (the `mlx[cpu]` package; skipped where it is
absent): kvattn.quantize / dequantize bit for bit with mlx.core.quantize /
dequantize, caches written by one read by the other, and kvattn.attention on
an MLX-quantized cache against mlx.core.fast.scaled_dot_product_attention on
the MLX-dequantized K/V."""
import numpy as np
import pytest

import kvattn
from kvref import (BF16, F16, F32, FLOATS, UNIT_ROUNDOFF, assert_close, kernel_atol, randn, ref_for_kernel,
                   rng_for)

mx = pytest.importorskip("mlx.core")

MX_DTYPE = {F32: mx.float32, F16: mx.float16, BF16: mx.bfloat16}
BITS = (2, 4, 8)
GROUPS = (32, 64, 128)


def to_mx(a):
    a = np.asarray(a)
    if a.dtype == BF16:  # exact through float32
        return mx.array(a.astype(np.float32)).astype(mx.bfloat16)
    return mx.array(a)


def to_np(a):
    if a.dtype == mx.bfloat16:
        return np.array(a.astype(mx.float32)).astype(BF16)
    return np.array(a)


def bits_of(a):
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


def diff_report(name, got, want, w=None, group_size=None):
    """Which elements differ, with their values (and the group's inputs)."""
    bad = np.argwhere(bits_of(got) != bits_of(want))
    if not bad.size:
        return ""
    lines = ["%s: %d of %d elements differ" % (name, len(bad), got.size)]
    for idx in bad[:6]:
        idx = tuple(int(i) for i in idx)
        line = "  at %s: kvattn %r (0x%x) mlx %r (0x%x)" % (idx, got[idx], int(bits_of(got)[idx]), want[idx],
                                                           int(bits_of(want)[idx]))
        if w is not None and name != "packed":
            g = idx[-1]
            vals = w[idx[:-1]][g * group_size:(g + 1) * group_size].astype(np.float32)
            line += "; group min %r max %r" % (float(vals.min()), float(vals.max()))
        lines.append(line)
    return "\n".join(lines)


def special_rows(rng, d):
    rows = [np.full(d, 0.75), np.zeros(d) + 1e-9, np.abs(rng.standard_normal(d)) + 3.0,
            -np.abs(rng.standard_normal(d)) - 0.1, np.linspace(-1.0, 1.0, d), rng.standard_normal(d) * 1e-4,
            rng.standard_normal(d) * 1e3, np.where(np.arange(d) % 2 == 0, 1.0, -1.0), np.zeros(d)]
    return np.stack(rows)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("bits", BITS)
def test_quantize_bit_exact_with_mlx(request, bits, group_size, dtype):
    rng = rng_for(request)
    w = randn(rng, (2, 3, 40, 256), dtype, scale=1.5)
    w[0, 0, :9] = special_rows(rng, 256).astype(np.float32).astype(dtype)
    p, s, b = kvattn.quantize(w, group_size=group_size, bits=bits)
    mp, ms, mb = (to_np(a) for a in mx.quantize(to_mx(w), group_size=group_size, bits=bits))
    assert (p.shape, s.shape, b.shape) == (mp.shape, ms.shape, mb.shape)
    assert (p.dtype, s.dtype, b.dtype) == (mp.dtype, ms.dtype, mb.dtype)
    report = "\n".join(r for r in (diff_report("scales", s, ms, w, group_size),
                                   diff_report("biases", b, mb, w, group_size),
                                   diff_report("packed", p, mp)) if r)
    assert not report, report


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_bit_exact_with_mlx(request, bits, group_size, dtype):
    """Both directions: MLX's cache through kvattn.dequantize, and random words
    with random scales/biases through both."""
    rng = rng_for(request)
    w = randn(rng, (2, 2, 33, 256), dtype)
    mq = mx.quantize(to_mx(w), group_size=group_size, bits=bits)
    got = kvattn.dequantize(*(to_np(a) for a in mq), group_size=group_size, bits=bits)
    want = to_np(mx.dequantize(*mq, group_size=group_size, bits=bits))
    assert got.dtype == want.dtype and got.shape == want.shape
    report = diff_report("dequantize(mlx cache)", got, want)
    assert not report, report

    p = rng.integers(0, 2**32, size=(7, 256 * bits // 32), dtype=np.uint32)
    s = randn(rng, (7, 256 // group_size), dtype, scale=0.2)
    b = randn(rng, (7, 256 // group_size), dtype)
    got = kvattn.dequantize(p, s, b, group_size=group_size, bits=bits)
    want = to_np(mx.dequantize(mx.array(p), to_mx(s), to_mx(b), group_size=group_size, bits=bits))
    report = diff_report("dequantize(random words)", got, want)
    assert not report, report


# Tolerance of kvattn vs MLX attention, relative to max(|out|, 1), per output
# dtype. 16-bit: both round the output (u each), and MLX attends over K/V
# dequantized *and rounded* to the cache dtype (about u relative on every K/V
# element, so on logits of order 1 and on the output; up to 2u with the
# double rounding), where kvattn uses the exact scale*q + bias: 6u (measured:
# under 3u). f32: two f32 computations in different orders: 4e-6 (measured:
# under 1e-6).
MLX_ATT_RTOL = {F32: 4e-6, F16: 6 * UNIT_ROUNDOFF[F16], BF16: 6 * UNIT_ROUNDOFF[BF16]}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32), (2, 128), (4, 128)])
@pytest.mark.parametrize("L,H,KVH", [(1, 8, 2), (5, 12, 2), (1, 4, 4)])
def test_attention_vs_mlx_sdpa(request, dtype, bits, group_size, L, H, KVH):
    rng = rng_for(request)
    B, N, D = 2, 157, 128
    q = randn(rng, (B, H, L, D), dtype)
    k = randn(rng, (B, KVH, N, D), dtype)
    v = randn(rng, (B, KVH, N, D), dtype)
    kq = mx.quantize(to_mx(k), group_size=group_size, bits=bits)
    vq = mx.quantize(to_mx(v), group_size=group_size, bits=bits)
    sinks = None
    if L > 1:  # MLX takes sinks in the output dtype: round them to it for both
        sinks = randn(rng, (H,), dtype, scale=2.0).astype(np.float32)
    scale = D**-0.5
    want = mx.fast.scaled_dot_product_attention(
        to_mx(q), mx.dequantize(*kq, group_size=group_size, bits=bits),
        mx.dequantize(*vq, group_size=group_size, bits=bits), scale=scale, mask="causal",
        sinks=None if sinks is None else to_mx(sinks.astype(dtype)))
    want = to_np(want).astype(np.float64)
    # the exact mode (f32 products of q as given): what MLX computes, so the comparison sees the format alone
    kqn, vqn = tuple(to_np(a) for a in kq), tuple(to_np(a) for a in vq)
    got = kvattn.attention(q, kqn, vqn, scale=scale, mask="causal", sinks=sinks, group_size=group_size, bits=bits,
                           exact=True)
    assert got.dtype == dtype
    # the default kernel against the oracle carrying the query rounding it names
    fast = kvattn.attention(q, kqn, vqn, scale=scale, mask="causal", sinks=sinks, group_size=group_size, bits=bits)
    ref = ref_for_kernel(q, kqn, vqn, scale=scale, mask="causal", sinks=sinks, group_size=group_size, bits=bits)
    atol = kernel_atol(q, kqn, vqn, KVH, scale=scale, mask="causal", sinks=sinks, group_size=group_size, bits=bits)
    assert_close(fast, ref, "default kernel", atol=atol)
    rtol = MLX_ATT_RTOL[np.dtype(dtype)]
    err = np.abs(got.astype(np.float64) - want)
    bound = rtol * np.maximum(np.abs(want), 1.0)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), "max err %.3g at %s (got %r, mlx %r), bound %.3g" % (
        err.max(), worst, float(got[worst]), float(want[worst]), float(bound[worst]))
