"""Hadamard rotation through the torch operators (kvattn.torch_ops):
torch.ops.kvattn.hadamard / hadamard_out and cache_write_rotated bit for bit
with the numpy path, and kvattn.attention / block_table_attention(...,
rotated=...) on torch tensors (composed of the ops) bit for bit with the
C call on numpy arrays; torch.compile(fullgraph=True) of the transform;
CUDA tensors where a GPU is present. Skipped without torch or the extension."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvattn  # noqa: E402
from kvattn import torch_ops  # noqa: E402
from kvref import BF16, F32, randn, rng_for  # noqa: E402

if not torch_ops.available():
    pytest.skip(torch_ops.load_error(), allow_module_level=True)
ops = torch_ops.load()
CUDA = torch.cuda.is_available() and kvattn.cuda_device_count() > 0
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def to_torch(a, device="cpu"):
    a = np.ascontiguousarray(a)
    if a.dtype == np.uint32:
        a = a.view(np.int32)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(a).to(device)


def to_numpy(t, like):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    if like.dtype == np.uint32:
        return t.numpy().view(np.uint32)
    return t.numpy()


def same_bits(a, b):
    return np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 96, 128, 384, 512])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_hadamard_op_bits(request, device, d, dtype):
    x = randn(rng_for(request), (3, 5, d), dtype)
    want = kvattn.hadamard(x)
    xt = to_torch(x, device)
    assert same_bits(to_numpy(ops.hadamard(xt), x), want)
    assert same_bits(to_numpy(kvattn.hadamard(xt), x), want)
    ops.hadamard_out(xt, xt)  # in place
    assert same_bits(to_numpy(xt, x), want)


def test_hadamard_op_compile():
    x = torch.randn(4, 128)
    f = torch.compile(lambda t: ops.hadamard(t) * 2.0, fullgraph=True)
    assert torch.equal(f(x), ops.hadamard(x) * 2.0)


def test_hadamard_op_error():
    with pytest.raises(ValueError, match="head dim 80"):
        ops.hadamard(torch.ones(2, 80))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rotated", ["kv", "k", "v"])
@pytest.mark.parametrize("bits", [0, 4])
def test_attention_rotated_torch(request, device, rotated, bits):
    rng = rng_for(request)
    b, h, kvh, l, n, d = 2, 8, 2, 2, 200, 128
    q = randn(rng, (b, h, l, d), BF16)
    kf = randn(rng, (b, kvh, n, d), BF16)
    vf = randn(rng, (b, kvh, n, d), BF16)
    if bits:
        k, v = kvattn.quantize(kf, 64, 4), kvattn.quantize(vf, 64, 4)
        kt, vt = tuple(to_torch(a, device) for a in k), tuple(to_torch(a, device) for a in v)
    else:
        k, v, kt, vt = kf, vf, to_torch(kf, device), to_torch(vf, device)
    want = kvattn.attention(q, k, v, mask="causal", group_size=64, bits=bits, rotated=rotated)
    got = kvattn.attention(to_torch(q, device), kt, vt, mask="causal", group_size=64, bits=bits, rotated=rotated)
    if device == "cpu":  # the same passes and kernels: the same bits
        assert same_bits(to_numpy(got, want), want)
    else:
        np.testing.assert_allclose(to_numpy(got, want).astype(np.float32), want.astype(np.float32), atol=2e-2)
    out = torch.full(got.shape, float("nan"), dtype=got.dtype, device=device)
    kvattn.attention(to_torch(q, device), kt, vt, mask="causal", group_size=64, bits=bits, rotated=rotated, out=out)
    assert torch.equal(out, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [0, 4])
def test_cache_write_rotated_op_bits(request, device, bits):
    rng = rng_for(request)
    nb, kvh, bs, d, n = 6, 2, 16, 128, 40
    k = randn(rng, (n, kvh, d), F32)
    v = randn(rng, (n, kvh, d), F32)
    slots = rng.permutation(nb * bs)[:n].astype(np.int32)

    def pools():
        if not bits:
            return np.zeros((nb, kvh, bs, d), BF16), np.zeros((nb, kvh, bs, d), BF16)
        mk = lambda: (np.zeros((nb, kvh, bs, d // 8), np.uint32), np.zeros((nb, kvh, bs, d // 64), BF16),
                      np.zeros((nb, kvh, bs, d // 64), BF16))
        return mk(), mk()

    kp, vp = pools()
    kvattn.cache_write(kp, vp, k, v, slots, group_size=64, bits=bits, rotate="kv")
    kq, vq = pools()
    tk = tuple(to_torch(a, device) for a in (kq if bits else (kq,)))
    tv = tuple(to_torch(a, device) for a in (vq if bits else (vq,)))
    kvattn.cache_write(tk if bits else tk[0], tv if bits else tv[0], to_torch(k, device), to_torch(v, device),
                       to_torch(slots, device), group_size=64, bits=bits, rotate="kv")
    for want, got in zip((kp if bits else (kp,)) + (vp if bits else (vp,)), tk + tv):
        assert same_bits(to_numpy(got, want), want)
    # attend the rotated pools (zeros where no row was written) through a block table: ops = numpy call
    tbl = np.arange(nb, dtype=np.int32)[None, :]
    lens = np.array([nb * bs], np.int32)
    q = randn(rng, (1, 8, 1, d), BF16)
    want = kvattn.block_table_attention(q, kp, vp, tbl, lens, group_size=64, bits=bits, rotated=True)
    got = kvattn.block_table_attention(to_torch(q, device), tk if bits else tk[0], tv if bits else tv[0],
                                       to_torch(tbl, device), to_torch(lens, device), group_size=64, bits=bits,
                                       rotated=True)
    if device == "cpu":
        assert same_bits(to_numpy(got, want), want)
