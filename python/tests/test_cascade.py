"""kvattn.cascade_attention (shared-prefix attention) against the library's
oracle, kvattn.reference_attention, over each sequence's whole cache (the
prefix concatenated with its own suffix): float and quantized K/V, no mask
and causal, sinks, softcap, ragged suffixes, several 16-row prefix chunks,
q stored head-major (copied) and token-major (in place), lse; bad input.
CUDA tensors (PyTorch) when a device is present."""
import numpy as np
import pytest

import kvattn
from kvref import BF16, BF16_PRODUCTS_ATOL, COMPUTE_ATOL, F32, assert_close, randn, rng_for
from test_lse import assert_lse


def _concat(prefix, suffix, B):
    """The whole caches [B, KVH, P + S, D]: the prefix [1, KVH, P, D] repeated
    before each suffix (quantized tuples part by part: rows are quantized one
    by one, so a concatenation is the cache quantized whole)."""
    if isinstance(prefix, tuple):
        return tuple(_concat(p, s, B) for p, s in zip(prefix, suffix))
    return np.concatenate([np.repeat(prefix, B, axis=0), suffix], axis=2)


def _atol(kernel):
    """The allowance of a default call: f32 products, or a kernel that rounds
    (q to integers, K/V/P to bf16: kvattn.attention_kernel's bracket)."""
    return COMPUTE_ATOL if kernel.endswith("[exact f32]") else BF16_PRODUCTS_ATOL


def _case(rng, B, H, KVH, L, P, S, D, bits, dtype=F32):
    q = randn(rng, (B, H, L, D), dtype)
    pk, pv = randn(rng, (1, KVH, P, D), dtype), randn(rng, (1, KVH, P, D), dtype)
    sk, sv = randn(rng, (B, KVH, S, D), dtype), randn(rng, (B, KVH, S, D), dtype)
    if bits:
        pk, pv, sk, sv = (kvattn.quantize(x, 64, bits) for x in (pk, pv, sk, sv))
    return q, pk, pv, sk, sv


@pytest.mark.parametrize("B,H,KVH,L,P,S,D,bits,kw", [
    (3, 8, 4, 1, 300, 40, 128, 0, dict(mask="causal")),
    (3, 8, 4, 4, 300, 40, 128, 4, dict(mask="causal", sinks=True)),
    (5, 8, 2, 4, 200, 30, 64, 4, dict(mask="causal", softcap=20.0)),  # 20 rows: two prefix chunks
    (2, 6, 6, 2, 100, 20, 256, 8, dict(sinks=True, softcap=10.0)),
    (4, 4, 2, 1, 33, 1, 64, 0, dict(mask="causal")),  # one-token suffixes
    (1, 4, 1, 8, 64, 16, 128, 4, dict(mask="causal", scale=0.05)),
])
def test_cascade_equals_whole_cache(request, B, H, KVH, L, P, S, D, bits, kw):
    rng = rng_for(request)
    kw = dict(kw)
    q, pk, pv, sk, sv = _case(rng, B, H, KVH, L, P, S, D, bits)
    if kw.pop("sinks", False):
        kw["sinks"] = randn(rng, (H,), F32)
    lens = np.maximum(L, S - 3 * np.arange(B)).astype(np.int32)  # ragged suffixes, each >= L
    out, lse = kvattn.cascade_attention(q, pk, pv, sk, sv, bits=bits, suffix_lens=lens, return_lse=True,
                                        exact=True, **kw)
    assert out.shape == (B, H, L, D) and out.dtype == q.dtype and lse.shape == (B, H, L)
    fk, fv = _concat(pk, sk, B), _concat(pv, sv, B)
    ref = kvattn.reference_attention(q, fk, fv, bits=bits, seq_lens=P + lens, **kw).astype(np.float64)
    assert_close(out, ref, "cascade out (exact)")
    _, full_lse = kvattn.attention(q, fk, fv, bits=bits, seq_lens=P + lens, return_lse=True, exact=True, **kw)
    assert_lse(lse, full_lse.astype(np.float64), "cascade lse")
    # the default call: the kernels the batched call would take (their roundings)
    out = kvattn.cascade_attention(q, pk, pv, sk, sv, bits=bits, suffix_lens=lens, **kw)
    kernel = kvattn.attention_kernel(q, fk, fv, bits=bits, seq_lens=P + lens, **kw)
    assert_close(out, ref, "cascade out (%s)" % kernel, atol=_atol(kernel))
    # q stored token-major is read in place and gives the same result
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    out2 = kvattn.cascade_attention(qt, pk, pv, sk, sv, bits=bits, suffix_lens=lens, **kw)
    assert np.array_equal(out2, out)


def test_cascade_prefix_3d_bf16_base2_and_out(request):
    rng = rng_for(request)
    B, H, KVH, L, P, S, D = 4, 8, 2, 2, 129, 17, 128
    q, pk, pv, sk, sv = _case(rng, B, H, KVH, L, P, S, D, 0, BF16)
    out = np.empty((B, H, L, D), F32)
    got, lse2 = kvattn.cascade_attention(q, pk[0], pv[0], sk, sv, mask="causal", bits=0, out=out,
                                         return_lse=True, lse_base2=True)
    assert got is out
    fk, fv = _concat(pk, sk, B), _concat(pv, sv, B)
    ref = kvattn.reference_attention(q, fk, fv, mask="causal", bits=0, out=np.empty((B, H, L, D), F32))
    # bf16 q with 8 query vectors per KV head may take bf16 products (the AMX kernel)
    assert_close(out, ref.astype(np.float64), "bf16 cascade", atol=2.0**-7)
    _, lse = kvattn.attention(q, fk, fv, mask="causal", bits=0, return_lse=True, exact=True)
    assert np.abs(lse2 * np.log(2) - lse).max() <= 1e-3 * max(1.0, np.abs(lse).max())


def test_cascade_bad_input(request):
    rng = rng_for(request)
    q, pk, pv, sk, sv = _case(rng, 2, 8, 4, 4, 64, 16, 64, 0)
    with pytest.raises(ValueError, match="window|mask"):
        kvattn.cascade_attention(q, pk, pv, sk, sv, mask=np.ones((2, 8, 4, 80), bool), bits=0)
    with pytest.raises(ValueError, match="seq_lens\\[0\\]"):
        kvattn.cascade_attention(q, pk, pv, sk, sv, bits=0, suffix_lens=[2, 16])
    with pytest.raises(ValueError, match="Dv|head dim|shape"):
        kvattn.cascade_attention(q, pk[..., :32], pv[..., :32], sk, sv, bits=0)
    two = np.concatenate([pk, pk])
    with pytest.raises(ValueError):
        kvattn.cascade_attention(q, two, two, sk, sv, bits=0)
    out = np.full((2, 8, 4, 64), 7.0, F32)
    with pytest.raises(ValueError):
        kvattn.cascade_attention(q, pk, pv, sk, sv, bits=0, suffix_lens=[2, 16], out=out)
    assert (out == 7.0).all()


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or kvattn.cuda_device_count() == 0:
        pytest.skip("no CUDA device")
    return torch


@pytest.mark.parametrize("bits", [0, 4])
def test_cascade_cuda_tensors(request, bits):
    torch = _torch_cuda()
    rng = rng_for(request)
    B, H, KVH, L, P, S, D = 4, 8, 4, 1, 1000, 60, 128
    q, pk, pv, sk, sv = _case(rng, B, H, KVH, L, P, S, D, bits, BF16)
    lens = np.array([60, 41, 60, 7], np.int32)

    def dev(x):
        if isinstance(x, tuple):
            return tuple(dev(a) for a in x)
        if x.dtype == BF16:
            return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).cuda()
        return torch.from_numpy(x.view(np.int32) if x.dtype == np.uint32 else x).cuda()

    out, lse = kvattn.cascade_attention(dev(q), dev(pk), dev(pv), dev(sk), dev(sv), mask="causal", bits=bits,
                                        suffix_lens=torch.from_numpy(lens).cuda(), return_lse=True)
    torch.cuda.synchronize()
    got = out.float().cpu().numpy()
    ref = kvattn.reference_attention(q, _concat(pk, sk, B), _concat(pv, sv, B), mask="causal", bits=bits,
                                     seq_lens=P + lens, out=np.empty((B, H, L, D), F32))
    # bf16 output, tensor-core kernels (bf16 P, quantized q): bf16 allowance
    assert_close(got, ref.astype(np.float64), "cuda cascade", atol=2.0**-7)
    assert lse.shape == (B, H, L) and torch.isfinite(lse).all()


@pytest.mark.parametrize("bits,trim", [(0, 0), (4, 21)])
def test_paged_forks_shared_prefix_split_cascade(request, bits, trim):
    rng = rng_for(request)
    B, H, KVH, L, D, P0, bs = 4, 8, 2, 2, 64, 100, 16
    pool = kvattn.Pool(512, bs, KVH, D, dtype=F32 if not bits else BF16, bits=bits, group_size=64)
    parent = pool.sequence()
    parent.append(randn(rng, (KVH, P0 + trim, D)), randn(rng, (KVH, P0 + trim, D)))
    parent.trim(P0)
    kids = [parent.fork() for _ in range(B)]
    for n, s in zip([9, 30, 2, 17], kids):
        s.append(randn(rng, (KVH, n, D)), randn(rng, (KVH, n, D)))
    # whole blocks before the parent's partial last block (copied on each child's first append)
    expect = (trim + P0) // bs * bs - trim
    assert kvattn.shared_prefix(kids) == expect
    assert kvattn.shared_prefix(kids, min_suffix=L) == expect
    assert kvattn.shared_prefix([kids[0], pool.sequence()]) == 0
    view = pool.view(kids)
    assert kvattn.shared_prefix(view, min_suffix=L) == expect
    q = randn(rng, (B, H, L, D))
    sinks = randn(rng, (H,))
    ref = view.reference_attention(q, mask="causal", sinks=sinks).astype(np.float64)
    for P in (expect, expect - 7):
        pre, suf = kvattn.split_view(view, P)
        assert list(pre.lens) == [P] and list(suf.lens) == list(view.lens - P)
        out, lse = kvattn.paged_cascade_attention(q, pre, suf, mask="causal", sinks=sinks, return_lse=True,
                                                  exact=True)
        assert_close(out, ref, "paged cascade P=%d" % P)
        assert lse.shape == (B, H, L) and np.isfinite(lse).all()
        pre.release()
        suf.release()
    with pytest.raises(ValueError, match="prefix_tokens"):
        kvattn.split_view(view, expect + L)
    with pytest.raises(ValueError, match="prefix_tokens"):
        kvattn.split_view(view, 0)
    assert pool.stats()["views"] == 1
    view.release()
    pool.check()


@pytest.mark.parametrize("bits", [0, 4])
def test_block_table_forks_cascade(request, bits):
    """Forks read through a block table of the pool's arrays: the shared
    prefix, the split, cascade over the two tables = the oracle."""
    rng = rng_for(request)
    B, H, KVH, L, D, P0, bs = 3, 8, 2, 2, 64, 90, 16
    pool = kvattn.Pool(256, bs, KVH, D, dtype=F32 if not bits else BF16, bits=bits, group_size=64)
    parent = pool.sequence()
    parent.append(randn(rng, (KVH, P0 + 5, D)), randn(rng, (KVH, P0 + 5, D)))
    parent.trim(P0)
    kids = [parent.fork() for _ in range(B)]
    for n, s in zip([7, 20, 3], kids):
        s.append(randn(rng, (KVH, n, D)), randn(rng, (KVH, n, D)))
    view = pool.view(kids)
    blocks, lens, first = view.block_table()
    gb = pool.group_size or 64
    shared = kvattn.block_table_shared_prefix(pool.k, pool.v, blocks, lens, first, min_suffix=L, group_size=gb,
                                              bits=bits)
    assert shared == kvattn.shared_prefix(view, min_suffix=L) == (P0 + 5) // bs * bs - 5
    q = randn(rng, (B, H, L, D))
    ref = view.reference_attention(q, mask="causal").astype(np.float64)
    for P in (shared, shared - 6):
        pre, suf = kvattn.split_block_table(pool.k, pool.v, blocks, lens, first, P, group_size=gb, bits=bits)
        assert pre[1].tolist() == [P] and suf[1].tolist() == (lens - P).tolist()
        out = kvattn.block_table_cascade_attention(q, pool.k, pool.v, pre, suf, mask="causal", group_size=gb,
                                                   bits=bits, exact=True)
        assert_close(out, ref, "block-table cascade P=%d" % P)
    with pytest.raises(ValueError, match="prefix_tokens"):
        kvattn.split_block_table(pool.k, pool.v, blocks, lens, first, shared + L, group_size=gb, bits=bits)
    view.release()


class _FakeDeviceArray:
    """Host memory behind a __cuda_array_interface__ (never dereferenced without a device)."""

    def __init__(self, arr):
        self.arr = arr
        self.__cuda_array_interface__ = {"shape": arr.shape, "typestr": arr.dtype.str, "data": (arr.ctypes.data, False),
                                         "strides": arr.strides, "version": 3, "stream": 1}


@pytest.mark.skipif(kvattn.cuda_device_count() > 0, reason="a CUDA device is present")
def test_block_table_cascade_cuda_arrays_route_to_the_backend():
    f = _FakeDeviceArray
    q = f(np.ones((2, 4, 1, 64), np.float16))
    pool = f(np.ones((8, 2, 16, 64), np.float16))
    out = f(np.zeros((2, 4, 1, 64), np.float16))
    pre = (f(np.zeros((1, 2), np.int32)), f(np.array([20], np.int32)), None)
    suf = (f(np.array([[2, 3], [4, 5]], np.int32)), f(np.array([5, 9], np.int32)), None)
    with pytest.raises(ValueError, match="backend or device not available"):
        kvattn.block_table_cascade_attention(q, pool, pool, pre, suf, mask="causal", bits=0, out=out)
    with pytest.raises(ValueError, match="prefix.seq_lens"):
        kvattn.block_table_cascade_attention(q, pool, pool, (pre[0], suf[1], None), suf, bits=0, out=out)


def test_block_table_cascade_cuda_tensors(request):
    torch = _torch_cuda()
    rng = rng_for(request)
    B, H, KVH, L, D, bs = 4, 16, 4, 1, 128, 16
    pool = kvattn.Pool(512, bs, KVH, D, dtype=BF16, bits=4, group_size=64)
    parent = pool.sequence()
    parent.append(randn(rng, (KVH, 1000, D)), randn(rng, (KVH, 1000, D)))
    kids = [parent.fork() for _ in range(B)]
    for n, s in zip([30, 7, 64, 1], kids):
        s.append(randn(rng, (KVH, n, D)), randn(rng, (KVH, n, D)))
    view = pool.view(kids)
    blocks, lens, first = view.block_table()
    P = kvattn.block_table_shared_prefix(pool.k, pool.v, blocks, lens, first, min_suffix=L)
    pre, suf = kvattn.split_block_table(pool.k, pool.v, blocks, lens, first, P)
    q = randn(rng, (B, H, L, D), BF16)
    ref = view.reference_attention(q, mask="causal", out=np.empty((B, H, L, D), F32)).astype(np.float64)

    def dev(x):
        if x is None:
            return None
        if isinstance(x, tuple):
            return tuple(dev(a) for a in x)
        x = np.ascontiguousarray(x)
        if x.dtype == BF16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
        return torch.from_numpy(x.view(np.int32) if x.dtype == np.uint32 else x).cuda()

    out = kvattn.block_table_cascade_attention(dev(q), dev(pool.k), dev(pool.v), dev(pre), dev(suf), mask="causal")
    torch.cuda.synchronize()
    assert_close(out.float().cpu().numpy(), ref, "cuda block-table cascade", atol=2.0**-7)
    view.release()
