"""kvattn.quantize / dequantize: shapes and dtypes as mlx.core.quantize,
bit for bit with docs/mlx-format.md's algorithm emulated in numpy float32, the
round-trip error bound, strided and high-rank inputs."""
import numpy as np
import pytest

import kvattn
from kvref import BF16, F16, F32, FLOATS, np_dequantize_mlx, np_quantize, randn, rng_for, unpack

BITS = (2, 4, 8)
GROUPS = (32, 64, 128)


def bits_of(a):
    """Bit patterns of a float array (for exact comparisons, NaN-safe)."""
    return a.view({4: np.uint32, 2: np.uint16}[a.dtype.itemsize])


def assert_same_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype,
                                                                 want.shape)
    gb, wb = (bits_of(got), bits_of(want)) if got.dtype.kind == "f" or got.dtype == BF16 else (got, want)
    bad = np.argwhere(gb != wb)
    assert bad.size == 0, "%s: %d elements differ, first %s: got %s want %s" % (
        what, len(bad), [tuple(i) for i in bad[:4]], [got[tuple(i)] for i in bad[:4]],
        [want[tuple(i)] for i in bad[:4]])


def special_groups(rng, d, dtype):
    """Rows that hit the algorithm's branches: constant (scale floor, q0 = 0),
    all positive / all negative, |min| == |max|, tiny and large magnitudes."""
    rows = [
        np.full(d, 0.75),
        np.zeros(d) + 1e-9,
        np.abs(rng.standard_normal(d)) + 3.0,
        -np.abs(rng.standard_normal(d)) - 0.1,
        np.linspace(-1.0, 1.0, d),
        rng.standard_normal(d) * 1e-4,
        rng.standard_normal(d) * 1e3,
        np.where(np.arange(d) % 2 == 0, 1.0, -1.0),
    ]
    return np.stack(rows).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("bits", BITS)
def test_quantize_matches_algorithm(request, bits, group_size, dtype):
    rng = rng_for(request)
    w = np.concatenate([randn(rng, (37, 256), dtype, scale=2.0), special_groups(rng, 256, dtype)])
    packed, scales, biases = kvattn.quantize(w, group_size=group_size, bits=bits)
    assert packed.dtype == np.uint32 and packed.shape == (w.shape[0], 256 * bits // 32)
    assert scales.dtype == dtype and scales.shape == (w.shape[0], 256 // group_size)
    assert biases.dtype == dtype and biases.shape == scales.shape
    p2, s2, b2 = np_quantize(w, group_size, bits)
    assert_same_bits(scales, s2, "scales")
    assert_same_bits(biases, b2, "biases")
    assert_same_bits(packed, p2, "packed")


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("bits", BITS)
def test_roundtrip_bound(request, bits, group_size, dtype):
    """|w - dequantize(quantize(w))| <= |scale| (one step: the rounded edge
    scale can push the far end one code past the range) plus the rounding of
    scale, bias and the result to the dtype; and most errors within half a step."""
    rng = rng_for(request)
    w = randn(rng, (16, 2 * group_size), dtype)
    p, s, b = kvattn.quantize(w, group_size=group_size, bits=bits)
    deq = kvattn.dequantize(p, s, b, group_size=group_size, bits=bits)
    assert deq.dtype == dtype and deq.shape == w.shape
    u = {F32: 2.0**-24, F16: 2.0**-11, BF16: 2.0**-8}[np.dtype(dtype)]
    sg = np.repeat(np.abs(s.astype(np.float64)), group_size, axis=-1)
    bg = np.repeat(np.abs(b.astype(np.float64)), group_size, axis=-1)
    w64 = w.astype(np.float64)
    err = np.abs(deq.astype(np.float64) - w64)
    step_rounding = 2 * (2**bits - 1) * sg * u + bg * u + 2 * np.abs(w64) * u + sg * u
    assert (err <= sg + step_rounding).all()
    assert (err <= 0.5 * sg + step_rounding).mean() > 0.95
    codes = unpack(p, bits)
    assert codes.max() <= 2**bits - 1


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_matches_mlx_rule(request, bits, dtype):
    """dequantize = MLX's rule (q*scale rounded to the dtype, then + bias) bit
    for bit, on random words, scales and biases."""
    rng = rng_for(request)
    g = 64
    p = rng.integers(0, 2**32, size=(5, 3, 128 * bits // 32), dtype=np.uint32)
    s = randn(rng, (5, 3, 128 // g), dtype, scale=0.1)
    b = randn(rng, (5, 3, 128 // g), dtype)
    got = kvattn.dequantize(p, s, b, group_size=g, bits=bits)
    assert_same_bits(got, np_dequantize_mlx(p, s, b, g, bits), "dequantize")
    as32 = kvattn.dequantize(p, s, b, group_size=g, bits=bits, dtype=np.float32)
    assert as32.dtype == np.float32
    np.testing.assert_array_equal(as32.astype(dtype), got)


@pytest.mark.parametrize("shape", [(64,), (3, 64), (2, 3, 128), (2, 2, 3, 64), (2, 1, 2, 3, 64), (1, 2, 1, 2, 1, 64)])
def test_ranks(request, shape):
    """Any rank >= 1 (mlx needs >= 2); ranks above 4 are flattened for the library."""
    rng = rng_for(request)
    w = randn(rng, shape, BF16)
    p, s, b = kvattn.quantize(w, group_size=32, bits=4)
    assert p.shape == shape[:-1] + (shape[-1] // 8,) and s.shape == shape[:-1] + (shape[-1] // 32,)
    p2, s2, b2 = np_quantize(w, 32, 4)
    assert_same_bits(p, p2, "packed")
    assert_same_bits(s, s2, "scales")
    deq = kvattn.dequantize(p, s, b, group_size=32, bits=4)
    assert deq.shape == shape
    assert_same_bits(deq, np_dequantize_mlx(p, s, b, 32, 4), "dequantize")


def test_strided_inputs(request):
    """A strided view is quantized in place; a non-contiguous last axis is copied."""
    rng = rng_for(request)
    big = randn(rng, (4, 9, 256), F16)
    view = big[1:, ::2, 64:192]
    for w in (view, big[..., ::2], np.flip(big, axis=1)):
        p, s, b = kvattn.quantize(w, group_size=64, bits=8)
        p2, s2, b2 = np_quantize(np.ascontiguousarray(w), 64, 8)
        assert_same_bits(p, p2, "packed")
        assert_same_bits(s, s2, "scales")
        assert_same_bits(b, b2, "biases")
        deq = kvattn.dequantize(p[:, ::2], s[:, ::2], b[:, ::2], group_size=64, bits=8)
        assert_same_bits(deq, np_dequantize_mlx(p[:, ::2], s[:, ::2], b[:, ::2], 64, 8), "strided dequantize")


def test_defaults_are_mlx_defaults(request):
    rng = rng_for(request)
    w = randn(rng, (2, 128))
    p, s, b = kvattn.quantize(w)
    assert p.shape == (2, 16) and s.shape == (2, 2)  # bits 4, group 64
    np.testing.assert_array_equal(kvattn.dequantize(p, s, b), kvattn.dequantize(p, s, b, 64, 4))
