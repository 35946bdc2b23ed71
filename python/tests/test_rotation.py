"""Hadamard-rotated KV from Python: kvattn.hadamard against a numpy H built
from its definition (Sylvester order; H_3 = (2/3) J - I for 3 * 2^k), in
place, H H = I; attention(..., rotated=...) over a rotated cache equal to
the numpy float64 attention over the unrotated one; cache_write(...,
rotate=...) bit for bit with quantize(hadamard(rows)); block-table calls;
bad input."""
import math

import numpy as np
import pytest

import kvattn
from kvref import BF16, F16, F32, FLOATS, UNIT_ROUNDOFF, assert_close, as_f64, randn, ref_attention, rng_for

DIMS = (16, 32, 64, 128, 256, 512, 48, 96, 192, 384)
F32_ATOL = 3e-5  # tests/attn_check.h ATT_ATOL_F32: f32 products over a few thousand keys vs the double oracle


def np_hadamard(d):
    """H_d in float64 from the definition (kvattn.h, kva_hadamard)."""
    m = d // 3 if d % 3 == 0 else d
    h = np.ones((1, 1))
    while h.shape[0] < m:
        h = np.block([[h, h], [h, -h]])
    h /= math.sqrt(m)
    if m != d:
        h3 = np.full((3, 3), 2.0 / 3.0) - np.eye(3)
        h = np.kron(h3, h)
    return h


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_hadamard_matches_definition(request, d, dtype):
    rng = rng_for(request)
    x = randn(rng, (2, 3, 5, d), dtype)
    x[..., 3] *= 20  # an outlier channel
    h = np_hadamard(d)
    np.testing.assert_allclose(h @ h, np.eye(d), atol=1e-12)
    y = kvattn.hadamard(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    ref = as_f64(x) @ h.T
    norm = np.linalg.norm(as_f64(x), axis=-1, keepdims=True)
    err = np.abs(y.astype(np.float64) - ref)
    assert (err <= 1e-6 * norm + UNIT_ROUNDOFF[np.dtype(dtype)] * np.abs(ref)).all()
    y32 = kvattn.hadamard(x, out=np.empty(x.shape, np.float32))  # f32 out: H H x = x within f32 rounding
    back = kvattn.hadamard(y32)
    np.testing.assert_allclose(back, x.astype(np.float32), atol=2e-6 * float(norm.max()))
    z = x.copy()
    assert kvattn.hadamard(z, out=z) is z  # in place: the same bits
    assert np.array_equal(z.view(np.uint8), y.view(np.uint8))


def test_hadamard_errors():
    assert kvattn.hadamard_dim_supported(128) and kvattn.hadamard_dim_supported(96)
    assert not kvattn.hadamard_dim_supported(80)
    x = np.ones((2, 80), np.float32)
    out = np.full((2, 80), 7.0, np.float32)
    with pytest.raises(kvattn.KvaError, match="head dim 80"):
        kvattn.hadamard(x, out=out)
    assert (out == 7.0).all()
    with pytest.raises(kvattn.KvaError, match="shape"):
        kvattn.hadamard(np.ones((2, 64), np.float32), out=np.empty((2, 128), np.float32))


def rotated_case(rng, dk, dv, qdtype=F32):
    b, h, kvh, l, n = 2, 8, 2, 3, 150
    q = randn(rng, (b, h, l, dk), qdtype)
    k = randn(rng, (b, kvh, n, dk))
    v = randn(rng, (b, kvh, n, dv))
    k[..., 5] *= 15.0  # an outlier channel
    return q, k, v


@pytest.mark.parametrize("rotated", [True, "kv", "k", "v"])
@pytest.mark.parametrize("dk,dv", [(128, 128), (192, 128), (64, 96)])
def test_attention_rotated_equals_unrotated(request, rotated, dk, dv):
    rng = rng_for(request)
    q, k, v = rotated_case(rng, dk, dv)
    rk = rotated in (True, "kv", "k")
    rv = rotated in (True, "kv", "v")
    kr = (k.astype(np.float64) @ np_hadamard(dk).T).astype(np.float32) if rk else k
    vr = (v.astype(np.float64) @ np_hadamard(dv).T).astype(np.float32) if rv else v
    sinks = rng.standard_normal(8).astype(np.float32)
    ref = ref_attention(q, k, v, mask="causal", softcap=30.0, sinks=sinks)
    out = kvattn.attention(q, kr, vr, mask="causal", softcap=30.0, sinks=sinks, rotated=rotated)
    assert_close(out, ref, "rotated=%r" % (rotated,))
    oracle = kvattn.reference_attention(q, kr, vr, mask="causal", softcap=30.0, sinks=sinks, rotated=rotated)
    assert_close(oracle, ref, "the oracle, rotated=%r" % (rotated,))
    name = kvattn.attention_kernel(q, kr, vr, mask="causal", rotated=rotated)
    assert "Hadamard-rotated" in name, name


def test_attention_kernel_names_rounding():
    rng = rng_for("names")
    q, k, v = rotated_case(rng, 128, 128, BF16)
    name = kvattn.attention_kernel(q, k.astype(BF16), v.astype(BF16), mask="causal", rotated=True)
    assert "Hadamard-rotated K,V [q bf16" in name, name
    name = kvattn.attention_kernel(q, k.astype(BF16), v.astype(BF16), mask="causal", rotated=True, exact=True)
    assert name.endswith("[exact f32]"), name


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32), (0, 0)])
@pytest.mark.parametrize("rotate", ["kv", "k", "v"])
def test_cache_write_rotate_and_attend(request, bits, group_size, rotate):
    rng = rng_for(request)
    nb, kvh, bs, d, n, h = 12, 2, 16, 128, 150, 8
    k = randn(rng, (n, kvh, d))
    v = randn(rng, (n, kvh, d))
    k[..., 7] *= 20.0

    def pools():
        if not bits:
            return np.zeros((nb, kvh, bs, d), BF16), np.zeros((nb, kvh, bs, d), BF16)
        mk = lambda: (np.zeros((nb, kvh, bs, d * bits // 32), np.uint32), np.zeros((nb, kvh, bs, d // group_size), BF16),
                      np.zeros((nb, kvh, bs, d // group_size), BF16))
        return mk(), mk()

    slots = np.arange(n, dtype=np.int32) + bs  # blocks 1.. in order
    kp, vp = pools()
    kvattn.cache_write(kp, vp, k, v, slots, group_size=group_size, bits=bits, rotate=rotate)
    # the same as writing hadamard(rows) in f32 unrotated
    kw = kvattn.hadamard(k) if "k" in rotate else k
    vw = kvattn.hadamard(v) if "v" in rotate else v
    kp2, vp2 = pools()
    kvattn.cache_write(kp2, vp2, kw, vw, slots, group_size=group_size, bits=bits)
    for a, b in zip(kp if bits else (kp,), kp2 if bits else (kp2,)):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    for a, b in zip(vp if bits else (vp,), vp2 if bits else (vp2,)):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    # attend through the block table, against numpy on the cache as stored
    q = randn(rng, (1, h, 2, d))
    blocks = np.arange(1, 1 + (n + bs - 1) // bs, dtype=np.int32)[None, :]
    lens = np.array([n], np.int32)
    out = kvattn.block_table_attention(q, kp, vp, blocks, lens, mask="causal", group_size=group_size, bits=bits,
                                       rotated=rotate, exact=True)
    # the stored rows (dequantized exactly, s * c + b in f32) as a contiguous cache, numpy's H in float64
    nbk = blocks.shape[1]

    def contiguous(pool):
        p = tuple(a[1:1 + nbk].transpose(1, 0, 2, 3).reshape(kvh, nbk * bs, -1)[None, :, :n] for a in
                  (pool if bits else (pool,)))
        return as_f64(p if bits else p[0], group_size, bits)

    hd = np_hadamard(d)
    qr = q.astype(np.float64) @ hd.T if "k" in rotate else q
    ref = ref_attention(qr, contiguous(kp), contiguous(vp), mask="causal")
    if "v" in rotate:
        ref = ref @ hd.T
    # the C tests' f32 allowance (ATT_ATOL_F32): the x20 channel makes logits of ~30, whose f32
    # rounding (and q' = H q's) the softmax passes on
    assert_close(out, ref, "rotate=%s bits %d" % (rotate, bits), atol=F32_ATOL)


def test_rotation_errors():
    rng = rng_for("errors")
    q = randn(rng, (1, 4, 1, 80))
    k = randn(rng, (1, 2, 40, 80))
    out = np.full((1, 4, 1, 80), 3.0, np.float32)
    with pytest.raises(kvattn.KvaError, match="head dim 80"):
        kvattn.attention(q, k, k, mask="causal", rotated=True, out=out)
    assert (out == 3.0).all()
    with pytest.raises(kvattn.KvaError, match="rotated"):
        kvattn.attention(q, k, k, rotated="q")
    kp = np.zeros((4, 2, 16, 80), np.float32)
    with pytest.raises(kvattn.KvaError, match="head dim 80"):
        kvattn.cache_write(kp, kp.copy(), k[0].transpose(1, 0, 2)[:3], k[0].transpose(1, 0, 2)[:3],
                           np.arange(3, dtype=np.int32), bits=0, rotate="k")
    assert (kp == 0).all()
    with pytest.raises(kvattn.KvaError, match="rotate"):
        kvattn.cache_write(kp, kp, k[0, :, :3].transpose(1, 0, 2), k[0, :, :3].transpose(1, 0, 2),
                           np.arange(3, dtype=np.int32), bits=0, rotate=1)
