"""Engine KV pool layouts through views, no copies: vLLM's NHD pools
(num_blocks, block_size, KVH, D), one array (2, num_blocks, block_size, KVH, D)
holding K and V, FlashInfer's (num_blocks, 2, block_size, KVH, D) and its HND
form (num_blocks, 2, KVH, block_size, D), handed to kvattn as
[num_blocks, KVH, block_size, D] views (pool[0].transpose(0, 2, 1, 3)); float
pools and MLX-packed q4 / q8 pools (packed words, scales and biases each in the
layout). cache_write's slot mapping (source rows sliced from a fused qkv array,
padding slots -1) writes the engine's buffer in place, bit for bit with
quantize of the rows, nothing else touched; block_table_attention over the
views equals the same call over contiguous copies bit for bit and the float64
reference over the tokens gathered into a contiguous cache. The same through
torch tensors (CPU, and CUDA when present) when torch and the compiled ops are
there."""
import numpy as np
import pytest

import kvattn
from kvref import (BF16, BF16_PRODUCTS_ATOL, F16, F32, UNIT_ROUNDOFF, assert_close, compute_atol,
                   query_rounding_bits, randn, ref_attention, ref_for_kernel, rng_for)

LAYOUTS = ("nhd", "kv_first", "kv_inner", "hnd_kv_inner")
FORMATS = {  # pool dtype (float rows, or scales/biases), bits, group size, query dtype
    "f32": (F32, 0, 64, F32),
    "f16": (F16, 0, 64, F16),
    "bf16": (BF16, 0, 64, BF16),
    "q4_bf16": (BF16, 4, 64, BF16),
    "q8_f16": (F16, 8, 32, F32),
}


def fill_of(dtype):
    return np.uint32(0xFFFFFFFF) if dtype == np.uint32 else np.nan


def engine_array(layout, nb, bs, kvh, w, dtype):
    """The engine's buffer(s) for one array family and the K, V views
    [nb, KVH, bs, w] kvattn takes (NaN / all-ones everywhere)."""
    full = lambda shape: np.full(shape, fill_of(dtype), dtype)  # noqa: E731
    if layout == "nhd":
        a, b = full((nb, bs, kvh, w)), full((nb, bs, kvh, w))
        return [a, b], a.transpose(0, 2, 1, 3), b.transpose(0, 2, 1, 3)
    if layout == "kv_first":
        base = full((2, nb, bs, kvh, w))
        return [base], base[0].transpose(0, 2, 1, 3), base[1].transpose(0, 2, 1, 3)
    if layout == "kv_inner":
        base = full((nb, 2, bs, kvh, w))
        return [base], base[:, 0].transpose(0, 2, 1, 3), base[:, 1].transpose(0, 2, 1, 3)
    base = full((nb, 2, kvh, bs, w))
    return [base], base[:, 0], base[:, 1]


def engine_pools(layout, nb, bs, kvh, d, dtype, bits, group):
    """(buffers, k_pool, v_pool): arrays, or (packed, scales, biases) tuples of views."""
    if not bits:
        return engine_array(layout, nb, bs, kvh, d, dtype)
    fams = [engine_array(layout, nb, bs, kvh, w, dt)
            for w, dt in ((d * bits // 32, np.uint32), (d // group, dtype), (d // group, dtype))]
    return [b for f in fams for b in f[0]], tuple(f[1] for f in fams), tuple(f[2] for f in fams)


def parts(pool):
    return pool if isinstance(pool, tuple) else (pool,)


def bits_equal(a, b):
    return np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def engine_step(rng, B, H, KVH, D, bs, dtype, max_len, min_len=1):
    """Ragged lengths, a table of shuffled block ids, the slot of every token
    (prefill round robin, padding -1 between), and the fused qkv rows."""
    lens = rng.integers(min_len, max_len + 1, B).astype(np.int32)
    lens[rng.integers(B)] = max_len
    need = [(int(n) + bs - 1) // bs for n in lens]
    nb = sum(need) + 3
    perm = rng.permutation(nb).astype(np.int32)
    mb = max(need) + 1
    blocks = np.full((B, mb), -1, np.int32)
    at = 0
    for b in range(B):
        blocks[b, :need[b]] = perm[at:at + need[b]]
        at += need[b]
    slots, owner = [], []
    for t in range(max_len):
        for b in range(B):
            if t < lens[b]:
                slots.append(int(blocks[b, t // bs]) * bs + t % bs)
                owner.append((b, t))
                if rng.random() < 0.1:
                    slots.append(-1)
                    owner.append(None)
    slots = np.array(slots, np.int32)
    qkv = randn(rng, (len(slots), H + 2 * KVH, D), dtype)
    return lens, blocks, nb, slots, owner, qkv[:, H:H + KVH], qkv[:, H + KVH:]


def expected_pool(pool, rows, slots, bs, bits, group):
    """The views' contents after writing rows at slots (contiguous copies)."""
    want = [np.array(p) for p in parts(pool)]
    for i, s in enumerate(slots):
        if s < 0:
            continue
        blk, row = divmod(int(s), bs)
        new = kvattn.quantize(rows[i], group_size=group, bits=bits) if bits else (rows[i].astype(want[0].dtype),)
        for w, part in zip(want, new):
            w[blk, :, row] = part
    return want


def gather(pool, blocks, lens, bs):
    """The tokens of each sequence copied into a contiguous cache [B, KVH, max_len, W] (per part)."""
    B, L = len(lens), int(max(lens))
    out = []
    for p in parts(pool):
        c = np.zeros((B, p.shape[1], L, p.shape[3]), p.dtype)
        for b in range(B):
            for t in range(int(lens[b])):
                c[b, :, t] = p[blocks[b, t // bs], :, t % bs]
        out.append(c)
    return tuple(out) if isinstance(pool, tuple) else out[0]


@pytest.mark.parametrize("L", [1, 4])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cache_write_then_attend(request, layout, fmt, L):
    rng = rng_for(request)
    dtype, bits, group, qdt = FORMATS[fmt]
    B, H, KVH, D, bs = 3, 8, 2, 128, 16
    lens, blocks, nb, slots, _, k_rows, v_rows = engine_step(rng, B, H, KVH, D, bs, dtype, 70, min_len=L)
    bufs, k_pool, v_pool = engine_pools(layout, nb, bs, KVH, D, dtype, bits, group)
    assert all(any(np.shares_memory(p, b) for b in bufs) for p in parts(k_pool) + parts(v_pool))
    want_k = expected_pool(k_pool, k_rows, slots, bs, bits, group)
    want_v = expected_pool(v_pool, v_rows, slots, bs, bits, group)
    before = [b.copy() for b in bufs]
    kw = dict(group_size=group, bits=bits or 4)
    kvattn.cache_write(k_pool, v_pool, k_rows, v_rows, slots, **kw)
    for got, want in zip(parts(k_pool) + parts(v_pool), want_k + want_v):
        assert bits_equal(got, want), "%s %s: pool contents after cache_write" % (layout, fmt)
    assert any(not bits_equal(b, a) for b, a in zip(bufs, before)), "the engine's buffer was written in place"
    # a slot past the pools raises and writes nothing
    snap = [b.copy() for b in bufs]
    with pytest.raises(kvattn.KvaError, match="out of range"):
        kvattn.cache_write(k_pool, v_pool, k_rows[:2], v_rows[:2], np.array([0, nb * bs], np.int32), **kw)
    assert all(bits_equal(b, s) for b, s in zip(bufs, snap))

    q = randn(rng, (B, H, L, D), qdt)
    att = dict(mask="causal", **kw)
    out = np.full((B, H, L, D), np.nan, qdt)
    got = kvattn.block_table_attention(q, k_pool, v_pool, blocks, lens, out=out, **att)
    assert got is out
    # the views read in place equal contiguous copies of the pools, bit for bit
    copy = lambda p: tuple(np.ascontiguousarray(a) for a in p) if isinstance(p, tuple) else np.ascontiguousarray(p)  # noqa: E731
    same = kvattn.block_table_attention(q, copy(k_pool), copy(v_pool), blocks, lens, **att)
    assert bits_equal(got, same), "%s %s: strided pools vs contiguous copies" % (layout, fmt)
    # against the float64 reference over the tokens in a contiguous cache
    kc, vc = gather(k_pool, blocks, lens, bs), gather(v_pool, blocks, lens, bs)
    kernel = kvattn.attention_kernel(q, kc, vc, seq_lens=lens, **att)
    ref = (ref_for_kernel(q, kc, vc, seq_lens=lens, **att) if query_rounding_bits(kernel)
           else ref_attention(q, kc, vc, seq_lens=lens, **att))
    assert_close(got, ref, "%s %s L=%d" % (layout, fmt, L), compute_atol(q, KVH, kernel))


def test_unpermuted_nhd_pool_is_an_error():
    """An NHD pool passed as it is ([nb, bs, KVH, D]) names the layout rule."""
    rng = np.random.default_rng(5)
    base = randn(rng, (2, 6, 16, 2, 64), F32)
    q = randn(rng, (1, 8, 1, 64), F32)
    out = np.full((1, 8, 1, 64), 7.0, np.float32)
    with pytest.raises(kvattn.KvaError, match="axes 1 and 2 swapped"):
        kvattn.block_table_attention(q, base[0], base[1], np.array([[0, 1]], np.int32), np.array([20], np.int32),
                                     out=out)
    assert (out == 7.0).all()
    good = kvattn.block_table_attention(q, base[0].transpose(0, 2, 1, 3), base[1].transpose(0, 2, 1, 3),
                                        np.array([[0, 1]], np.int32), np.array([20], np.int32))
    assert np.isfinite(good).all()


# ------------------------------------------------------------------ torch
def _torch():
    torch = pytest.importorskip("torch")
    from kvattn import torch_ops

    if not torch_ops.available():
        pytest.skip(torch_ops.load_error())
    return torch


DEVICES = ["cpu", "cuda"]


def to_torch(a, torch, device):
    a = np.ascontiguousarray(a)
    if a.dtype == np.uint32:
        a = a.view(np.int32)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(a).to(device)


def to_numpy(t, torch):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["bf16", "q4_bf16", "q8_f16"])
@pytest.mark.parametrize("layout", ["kv_first", "kv_inner"])
def test_torch_engine_pools(request, layout, fmt, device):
    """vLLM's attention backend step on torch tensors: pool = (2, nb, bs, KVH, D)
    (or FlashInfer's (nb, 2, ...)), k_pool = pool[0].permute(0, 2, 1, 3);
    cache_write of qkv slices, then block_table_attention into a preallocated
    out. Pools bit for bit with the numpy path; out against the reference."""
    torch = _torch()
    if device == "cuda" and not (torch.cuda.is_available() and kvattn.cuda_device_count() > 0):
        pytest.skip("no CUDA device")
    rng = rng_for(request)
    dtype, bits, group, qdt = FORMATS[fmt]
    B, H, KVH, D, bs, L = 3, 16, 4, 128, 16, 1
    lens, blocks, nb, slots, _, k_rows, v_rows = engine_step(rng, B, H, KVH, D, bs, dtype, 300)
    # the numpy path's pools: the expected bytes
    bufs, k_np, v_np = engine_pools(layout, nb, bs, KVH, D, dtype, bits, group)
    kw = dict(group_size=group, bits=bits or 4)
    kvattn.cache_write(k_np, v_np, k_rows, v_rows, slots, **kw)
    # the same buffers as torch tensors, viewed the engine's way
    tbufs = [to_torch(np.full(b.shape, fill_of(b.dtype), b.dtype), torch, device) for b in bufs]
    view = {"kv_first": lambda t, i: t[i].permute(0, 2, 1, 3),
            "kv_inner": lambda t, i: t[:, i].permute(0, 2, 1, 3)}[layout]
    if bits:
        k_t = tuple(view(t, 0) for t in tbufs)
        v_t = tuple(view(t, 1) for t in tbufs)
    else:
        k_t, v_t = view(tbufs[0], 0), view(tbufs[0], 1)
    qkv_t = to_torch(np.concatenate([np.zeros((len(slots), H, D), dtype), k_rows, v_rows], axis=1), torch, device)
    kvattn.cache_write(k_t, v_t, qkv_t[:, H:H + KVH], qkv_t[:, H + KVH:], to_torch(slots, torch, device), **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    for t, b in zip(tbufs, bufs):
        assert bits_equal(to_numpy(t, torch).view(b.dtype) if b.dtype == np.uint32 else to_numpy(t, torch), b)
    q = randn(rng, (B, H, L, D), qdt)
    out = torch.full((B, H, L, D), float("nan"), dtype=to_torch(q, torch, "cpu").dtype, device=device)
    got = kvattn.block_table_attention(to_torch(q, torch, device), k_t, v_t, to_torch(blocks, torch, device),
                                       to_torch(lens, torch, device), mask="causal", out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    if device == "cuda":
        torch.cuda.synchronize()
    kc, vc = gather(k_np, blocks, lens, bs), gather(v_np, blocks, lens, bs)
    res = to_numpy(out, torch)
    if device == "cpu":  # the CPU kernels, as for numpy arrays
        att = dict(seq_lens=lens, mask="causal", **kw)
        kernel = kvattn.attention_kernel(q, kc, vc, **att)
        ref = ref_for_kernel(q, kc, vc, **att) if query_rounding_bits(kernel) else ref_attention(q, kc, vc, **att)
        assert_close(res, ref, "torch cpu %s %s" % (layout, fmt), compute_atol(q, KVH, kernel))
        return
    res = res.astype(np.float64)
    # CUDA: the tensor-core kernels' bf16 products
    ref = ref_attention(q, kc, vc, seq_lens=lens, mask="causal", **kw)
    bound = 2 * UNIT_ROUNDOFF[np.dtype(qdt)] * np.abs(ref) + 2 * BF16_PRODUCTS_ATOL * np.abs(ref).max()
    assert (np.abs(res - ref) <= bound).all(), float(np.abs(res - ref).max())
    # the ctypes CUDA path (kvattn.cuda: descriptors from the tensors' strides) on the same views
    tb2 = [torch.full_like(t, -1) if t.dtype == torch.int32 else torch.full_like(t, float("nan")) for t in tbufs]
    k2 = tuple(view(t, 0) for t in tb2) if bits else view(tb2[0], 0)
    v2 = tuple(view(t, 1) for t in tb2) if bits else view(tb2[0], 1)
    kvattn.cuda.cache_write(k2, v2, qkv_t[:, H:H + KVH], qkv_t[:, H + KVH:], to_torch(slots, torch, device), **kw)
    torch.cuda.synchronize()
    for t, b in zip(tb2, bufs):
        assert bits_equal(to_numpy(t, torch).view(b.dtype) if b.dtype == np.uint32 else to_numpy(t, torch), b)
    out2 = torch.full_like(out, float("nan"))
    kvattn.cuda.block_table_attention(to_torch(q, torch, device), k2, v2, to_torch(blocks, torch, device),
                                      to_torch(lens, torch, device), mask="causal", out=out2, **kw)
    torch.cuda.synchronize()
    res2 = to_numpy(out2, torch).astype(np.float64)
    assert (np.abs(res2 - ref) <= bound).all(), float(np.abs(res2 - ref).max())
