"""attention(..., tree_mask=...) (KVA_MASK_TREE, tree speculative verify)
against the same call with the explicit bool mask built from the rule
(kvref's causal rule on the prefix, the tree's bits on the last L keys) and
against kvref's float64 attention with that mask: odd L up to 64, random
trees of depth 1..L, B = 3 with different trees and lengths, windows and
segments on the prefix, float and 4/8-bit caches, one tree for every
sequence ([L, W]), int32 bits, CPU torch tensors (and the compiled ops when
built), CUDA tensors when a device is visible; bad input raises KvaError
naming the argument."""
import numpy as np
import pytest

import kvattn
from kvref import (BF16, F32, assert_close, causal_visible, compute_atol, np_quantize, query_rounding_bits, randn,
                   ref_attention, rng_for)


def random_tree(rng, L, depth):
    """parents of a tree of L nodes and exactly `depth` levels (parent among
    0..j-1, -1 a root), grown like tests/attn_check.c's att_random_tree."""
    par, dep, maxd = [], [], 0
    for j in range(L):
        extend = maxd < depth and j > 0 and (rng.random() < 0.5 or L - j == depth - maxd)
        cand = [k for k in range(j) if (dep[k] == maxd if extend else dep[k] < depth)]
        p = int(rng.choice(cand)) if cand else -1
        par.append(p)
        dep.append(1 if p < 0 else dep[p] + 1)
        maxd = max(maxd, dep[-1])
    assert maxd == depth
    return par


def tree_visible(n, L, bits, window=None, seg=None, clamp=False):
    """Bool [L, n]: the causal rule (window, segments) on keys < n - L, the
    bits ([L, W] uint32) on the last L keys."""
    pos = n - L + np.arange(L)
    vis = causal_visible(n, pos, window, seg, clamp)
    vis[:, n - L:] = False
    for i in range(L):
        for j in range(L):
            vis[i, n - L + j] = bool((int(bits[i, j // 32]) >> (j % 32)) & 1)
    return vis


def explicit(B, L, N, lens, bits, window=None, segments=None, clamp=False):
    m = np.zeros((B, 1, L, N), bool)
    for b in range(B):
        n = int(lens[b])
        m[b, 0, :, :n] = tree_visible(n, L, bits[b if bits.shape[0] > 1 else 0], window,
                                      None if segments is None else segments[b, :n], clamp)
    return m


def make_kv(rng, fmt, B, KVH, N, D):
    if fmt == "f32":
        return randn(rng, (B, KVH, N, D)), randn(rng, (B, KVH, N, D)), {}
    if fmt == "bf16":
        return randn(rng, (B, KVH, N, D), BF16), randn(rng, (B, KVH, N, D), BF16), {}
    bits = 4 if fmt == "q4" else 8
    k = np_quantize(randn(rng, (B, KVH, N, D)).astype(BF16), 64, bits)
    v = np_quantize(randn(rng, (B, KVH, N, D)).astype(BF16), 64, bits)
    return k, v, dict(bits=bits, group_size=64)


CASES = [
    # B, H, KVH, L, N, D, q dtype, kv format, window, segments
    (1, 4, 2, 1, 50, 64, F32, "f32", None, False),
    (3, 8, 4, 3, 90, 64, F32, "q4", None, False),
    (3, 8, 2, 7, 120, 128, BF16, "q4", None, False),
    (3, 4, 2, 17, 100, 64, F32, "bf16", 9, False),
    (3, 8, 4, 33, 150, 64, BF16, "q8", None, False),
    (2, 4, 1, 64, 130, 64, F32, "f32", None, True),
    (3, 8, 4, 64, 200, 128, BF16, "q4", 30, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B%d-H%d/%d-L%d-N%d-D%d-%s-%s-w%s-seg%d" % (
    c[0], c[1], c[2], c[3], c[4], c[5], np.dtype(c[6]).name, c[7], c[8], c[9]))
def test_tree_vs_explicit_and_reference(request, case):
    B, H, KVH, L, N, D, qdt, fmt, window, seg = case
    rng = rng_for(request)
    q = randn(rng, (B, H, L, D), qdt)
    k, v, kw = make_kv(rng, fmt, B, KVH, N, D)
    lens = np.array([N] + [int(rng.integers(L, N + 1)) for _ in range(B - 1)], np.int32)
    # sequence b: depth L (a chain), 1 (no edges) or random
    trees = [random_tree(rng, L, L if b % 3 == 0 else 1 if b % 3 == 1 else int(rng.integers(1, L + 1)))
             for b in range(B)]
    bits = kvattn.tree_bits(trees)
    assert bits.shape == (B, L, (L + 31) // 32) and bits.dtype == np.uint32
    segments = None
    if seg:
        segments = np.zeros((B, N), np.int32)
        for b in range(B):
            segments[b, 10:25] = 1
            segments[b, 40:44] = 2
    common = dict(window=window, segments=segments, seq_lens=lens, **kw)
    out = kvattn.attention(q, k, v, tree_mask=bits, **common)
    assert kvattn.attention_path(q, k, v, tree_mask=bits, **common) == "fused"
    m = explicit(B, L, N, lens, bits, window, segments)
    common.pop("window"), common.pop("segments")
    out_a = kvattn.attention(q, k, v, mask=m, **common)
    ref = ref_attention(q, k, v, mask=m, **common)
    name = kvattn.attention_kernel(q, k, v, tree_mask=bits, window=window, segments=segments, seq_lens=lens, **kw)
    name_a = kvattn.attention_kernel(q, k, v, mask=m, **common)
    atol = compute_atol(q, KVH, name)
    if "bf16" in name:
        atol = max(atol, 2.0**-7)  # a kernel that rounds K / V / P to bf16 (its bracket)
    # against the oracle carrying the query rounding the kernel names ("q intN": round_query)
    ref_t = ref_attention(q, k, v, mask=m, q_int_bits=query_rounding_bits(name), **common)
    ref_a = ref_attention(q, k, v, mask=m, q_int_bits=query_rounding_bits(name_a), **common)
    assert_close(out, ref_t, "tree " + name, atol=atol)
    assert_close(out_a, ref_a, "explicit mask " + name_a, atol=compute_atol(q, KVH, name_a))
    ref_tree = kvattn.reference_attention(q, k, v, tree_mask=bits, window=window, segments=segments, seq_lens=lens,
                                          **kw)
    ref_arr = kvattn.reference_attention(q, k, v, mask=m, seq_lens=lens, **kw)
    np.testing.assert_array_equal(ref_tree, ref_arr)  # the C oracle: the same rule both ways


def test_one_tree_for_all_and_int32(request):
    rng = rng_for(request)
    B, H, KVH, L, N, D = 3, 8, 4, 16, 80, 64
    q = randn(rng, (B, H, L, D))
    k, v = randn(rng, (B, KVH, N, D)), randn(rng, (B, KVH, N, D))
    par = random_tree(rng, L, 5)
    bits = kvattn.tree_bits(par)
    assert bits.shape == (L, 1)
    out = kvattn.attention(q, k, v, tree_mask=bits)
    np.testing.assert_array_equal(kvattn.attention(q, k, v, tree_mask=bits.view(np.int32)), out)
    np.testing.assert_array_equal(kvattn.attention(q, k, v, tree_mask=np.stack([bits] * B)), out)
    np.testing.assert_array_equal(kvattn.attention(q, k, v, mask="causal", tree_mask=bits), out)
    ref = ref_attention(q, k, v, mask=explicit(B, L, N, [N] * B, bits[None]))
    assert_close(out, ref, "one tree")


def test_rows_without_keys_are_zero(request):
    rng = rng_for(request)
    L, N = 5, 30
    q = randn(rng, (1, 2, L, 64))
    k, v = randn(rng, (1, 1, N, 64)), randn(rng, (1, 1, N, 64))
    bits = np.array([[1], [0], [3], [0], [16]], np.uint32)  # rows 1 and 3 see no new token
    out = kvattn.attention(q, k, v, tree_mask=bits, window=1)  # window 1: no prefix key either
    assert (out[:, :, [1, 3]] == 0).all() and (out[:, :, [0, 2, 4]] != 0).any()


def test_bad_tree_masks(request):
    rng = rng_for(request)
    B, H, KVH, L, N, D = 2, 4, 2, 7, 40, 64
    q = randn(rng, (B, H, L, D))
    k, v = randn(rng, (B, KVH, N, D)), randn(rng, (B, KVH, N, D))
    good = kvattn.tree_bits([list(range(-1, L - 1))] * B)
    out = np.full((B, H, L, D), 7.0, np.float32)

    def bad(code, needle, **kw):
        with pytest.raises(kvattn.KvaError) as e:
            kvattn.attention(q, k, v, out=out, **kw)
        assert e.value.code == code and needle in str(e.value), str(e.value)
        assert (out == 7.0).all()  # nothing written

    bad(kvattn._capi.ESHAPE, "tree bits", tree_mask=good[:, :L - 1])
    bad(kvattn._capi.ESHAPE, "tree bits", tree_mask=np.zeros((B, L, 2), np.uint32))
    bad(kvattn._capi.ESHAPE, "tree bits", tree_mask=np.zeros((3, L, 1), np.uint32))
    bad(kvattn._capi.EDTYPE, "tree bits", tree_mask=good.astype(np.float32))
    high = good.copy()
    high[1, 4, 0] |= np.uint32(1 << 7)
    bad(kvattn._capi.EINVAL, "(tree bits)[1][4]", tree_mask=high)
    bad(kvattn._capi.EINVAL, "tree_mask", tree_mask=good, mask=np.ones((B, H, L, N), bool))
    q65 = randn(rng, (1, 2, 65, D))
    k65, v65 = randn(rng, (1, 1, 100, D)), randn(rng, (1, 1, 100, D))
    with pytest.raises(kvattn.KvaError) as e:
        kvattn.attention(q65, k65, v65, tree_mask=np.zeros((65, 3), np.uint32))
    assert e.value.code == kvattn._capi.EUNSUPPORTED and "L = 65" in str(e.value)
    with pytest.raises(kvattn.KvaError):
        kvattn.tree_bits([0])  # node 0's parent must be -1


def _torch():
    return pytest.importorskip("torch")


def test_torch_cpu_tensors(request):
    torch = _torch()
    rng = rng_for(request)
    B, H, KVH, L, N, D = 2, 8, 4, 16, 90, 64
    q = randn(rng, (B, H, L, D))
    k, v = randn(rng, (B, KVH, N, D)), randn(rng, (B, KVH, N, D))
    bits = kvattn.tree_bits([random_tree(rng, L, 4), random_tree(rng, L, 9)])
    want = kvattn.attention(q, k, v, tree_mask=bits)
    # the bits as a torch int32 tensor with numpy operands
    got = kvattn.attention(q, k, v, tree_mask=torch.from_numpy(bits.view(np.int32)))
    np.testing.assert_array_equal(got, want)
    # all torch (the compiled ops when built, else the ctypes path)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    for tb in (torch.from_numpy(bits.view(np.int32)), torch.from_numpy(bits.view(np.int32)).view(torch.uint32)):
        got = kvattn.attention(tq, tk, tv, tree_mask=tb)
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6)


@pytest.mark.skipif(kvattn.cuda_device_count() == 0, reason="no CUDA device visible")
def test_cuda_tensors(request):
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    rng = rng_for(request)
    B, H, KVH, L, N, D = 3, 32, 8, 64, 700, 128
    q = randn(rng, (B, H, L, D), BF16)
    k, v, kw = make_kv(rng, "q4", B, KVH, N, D)
    trees = [random_tree(rng, L, d) for d in (6, 1, 64)]
    bits = kvattn.tree_bits(trees)
    ref = ref_attention(q, k, v, mask=explicit(B, L, N, [N] * B, bits), **kw)

    def dev(x):
        if x.dtype == BF16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
        if x.dtype == np.uint32:
            return torch.from_numpy(x.view(np.int32)).cuda()
        return torch.from_numpy(x).cuda()

    tk, tv = tuple(dev(x) for x in k), tuple(dev(x) for x in v)
    out = kvattn.attention(dev(q), tk, tv, tree_mask=dev(bits), **kw)
    torch.cuda.synchronize()
    got = out.float().cpu().numpy()
    assert_close(got.astype(F32), ref, "cuda tree", atol=2.0**-7)


@pytest.mark.parametrize("fmt", ["f32", "q4"])
def test_tree_paged_and_block_table(request, fmt):
    """PagedView.attention and block_table_attention with tree_mask: bit for
    bit equal to each other (the same rows through one kernel) and to the
    oracle at the kernel's allowance."""
    from kvattn.paged import Pool

    rng = rng_for(request)
    B, H, KVH, L, N, D = 3, 8, 4, 33, 300, 64
    q = randn(rng, (B, H, L, D))
    k, v, kw = make_kv(rng, fmt, B, KVH, N, D)
    lens = np.array([N, 200, 77], np.int32)
    bits = kvattn.tree_bits([random_tree(rng, L, d) for d in (L, 1, 7)])
    pool, seqs = Pool.from_contiguous(k, v, 16, seq_lens=lens, shuffle_seed=5, **kw)
    view = pool.view(seqs)
    out_p = view.attention(q, tree_mask=bits, window=50)
    blocks, sl, fo = view.block_table()
    out_t = kvattn.block_table_attention(q, pool.k, pool.v, blocks, sl, fo, tree_mask=bits, window=50, **kw)
    np.testing.assert_array_equal(out_t, out_p)
    name = kvattn.attention_kernel(q, k, v, tree_mask=bits, window=50, seq_lens=lens, **kw)
    ref = ref_attention(q, k, v, mask=explicit(B, L, N, lens, bits, window=50), seq_lens=lens,
                        q_int_bits=query_rounding_bits(name), **kw)
    assert_close(out_p, ref, "paged tree " + name, atol=compute_atol(q, KVH, name))
    np.testing.assert_array_equal(view.reference_attention(q, tree_mask=bits, window=50),
                                  kvattn.reference_attention(q, k, v, tree_mask=bits, window=50, seq_lens=lens, **kw))
    assert view.path(q, tree_mask=bits) == "fused"


def test_torch_block_table(request):
    """block_table_attention on CPU torch tensors with a torch tree_mask (the
    compiled ops when built): equal to the numpy call."""
    torch = _torch()
    from kvattn.paged import Pool

    rng = rng_for(request)
    B, H, KVH, L, N, D = 2, 8, 4, 17, 120, 64
    q = randn(rng, (B, H, L, D))
    k, v = randn(rng, (B, KVH, N, D)), randn(rng, (B, KVH, N, D))
    bits = kvattn.tree_bits([random_tree(rng, L, 3), random_tree(rng, L, 17)])
    pool, seqs = Pool.from_contiguous(k, v, 16, shuffle_seed=3)
    view = pool.view(seqs)
    blocks, sl, fo = view.block_table()
    want = kvattn.block_table_attention(q, pool.k, pool.v, blocks, sl, fo, tree_mask=bits)
    t = torch.from_numpy
    got = kvattn.block_table_attention(t(q), t(pool.k), t(pool.v), t(blocks), t(sl), t(fo),
                                       tree_mask=t(bits.view(np.int32)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6)
