"""kvattn.paged: pools, sequences, views and attention over a view, against
numpy models (expected rows from kvattn.quantize / astype over whole caches)
and the float64 reference of kvref.py (independent of the library's oracle)."""
import numpy as np
import pytest

import kvattn
from kvattn import _capi as C
from kvattn.paged import (PagedView, Pool, block_table_attention, block_table_reference_attention,
                          paged_attention)
from kvref import (BF16, COMPUTE_ATOL, F16, F32, UNIT_ROUNDOFF, assert_close, compute_atol, kernel_atol,
                   query_rounding_bits, randn, ref_attention, ref_for_kernel, rng_for)

# (dtype, bits, group): float pools and every bits / group at least once
FORMATS = [(F32, 0, 0), (F16, 0, 0), (BF16, 0, 0), (F16, 2, 32), (BF16, 4, 64), (F32, 8, 128), (BF16, 8, 32)]
FMT_IDS = ["f32", "f16", "bf16", "q2g32f16", "q4g64bf16", "q8g128f32", "q8g32bf16"]


def encode(rows, dtype, bits, group):
    """Expected stored rows of rows [KVH, T, D] given in the pool's dtype
    (MLX gives scales the dtype of the quantized array): the rows themselves,
    or kvattn.quantize of the whole array at once (a tuple)."""
    assert rows.dtype == dtype
    if bits == 0:
        return rows
    return kvattn.quantize(rows, group_size=group, bits=bits)


def cat(parts, axis=1):
    """Concatenate encoded rows (arrays or tuples) along the token axis."""
    if isinstance(parts[0], tuple):
        return tuple(np.concatenate([p[i] for p in parts], axis=axis) for i in range(3))
    return np.concatenate(parts, axis=axis)


def assert_rows_equal(got, want, what):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w, name in zip(got, want, ("data", "scales", "biases")):
        assert g.shape == w.shape, "%s %s: shape %s != %s" % (what, name, g.shape, w.shape)
        assert g.dtype == w.dtype and np.array_equal(g.view(np.uint8), w.view(np.uint8)), "%s %s differ" % (what, name)


def assert_same_result(a, b, what, atol=COMPUTE_ATOL):
    """Two results of the library that each satisfy assert_close against the
    exact value differ by at most the sum of both bounds (triangle inequality)."""
    u = UNIT_ROUNDOFF[a.dtype]
    x, y = a.astype(np.float64), b.astype(np.float64)
    bound = u * (np.abs(x) + np.abs(y)) + 2 * atol * max(1.0, float(np.abs(y).max()))
    err = np.abs(x - y)
    assert (err <= bound).all(), "%s: %d elements differ beyond both results' error bounds (worst %.3g)" % (
        what, int((err > bound).sum()), float((err - bound).max()))


def sl(enc, t0, t1):
    return tuple(a[:, t0:t1] for a in enc) if isinstance(enc, tuple) else enc[:, t0:t1]


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("block", [8, 16, 64])
def test_append_in_pieces_is_bit_identical(request, fmt, block):
    rng = rng_for(request)
    dtype, bits, group = fmt
    dk, dv = (256, 128) if group == 128 else (128, 64)
    pool = Pool(8, block, 2, dk, dv, dtype=dtype, bits=bits, group_size=group or 64)
    s = pool.sequence()
    total = 3 * block + block // 2 + 1
    K, V = randn(rng, (2, total, dk), dtype), randn(rng, (2, total, dv), dtype)
    t = 0
    while t < total:
        n = min(int(rng.integers(1, block + 4)), total - t)
        s.append(K[:, t:t + n], V[:, t:t + n])
        t += n
    assert len(s) == total and s.num_blocks == 4 and s.start == 0
    with pool.view([s]) as view:
        gk, gv = view.gather(0)
    assert_rows_equal(gk, encode(K, dtype, bits, group), "K")
    assert_rows_equal(gv, encode(V, dtype, bits, group), "V")
    pool.check()


def test_pool_arrays_and_memory():
    pool = Pool(10, 16, 2, 128, 64, dtype=BF16, bits=4, group_size=64)
    kp, ks, kb = pool.k
    vp, vs, vb = pool.v
    assert kp.shape == (10, 2, 16, 16) and kp.dtype == np.uint32
    assert ks.shape == (10, 2, 16, 2) and ks.dtype == BF16
    assert vp.shape == (10, 2, 16, 8) and vb.shape == (10, 2, 16, 1)
    assert pool.stats() == {"free_blocks": 10, "used_blocks": 0, "sequences": 0, "views": 0}
    assert pool.memory_size >= kp.nbytes + vp.nbytes + 2 * ks.nbytes + 2 * vs.nbytes
    f = Pool(4, 8, 1, 64, dtype=F16)
    assert f.k.shape == (4, 1, 8, 64) and f.k.dtype == F16 and f.dv == 64


@pytest.mark.parametrize("kw, code, needle", [
    ({"block_size": 7}, C.EINVAL, "block_size"),
    ({"block_size": 512}, C.EINVAL, "block_size"),
    ({"num_blocks": 0}, C.EINVAL, "num_blocks"),
    ({"bits": 3}, C.EUNSUPPORTED, "bits"),
    ({"bits": 4, "group_size": 16}, C.EUNSUPPORTED, "group_size"),
    ({"bits": 4, "dk": 96}, C.ESHAPE, "group_size"),
    ({"bits": 4, "group_size": 2**32 + 64}, C.EINVAL, "group_size = 4294967360 is out of the int32 range"),
    ({"bits": 2**32 + 4}, C.EINVAL, "bits = 4294967300 is out of the int32 range"),
    ({"kv_heads": 2**50}, C.EINVAL, "is too large"),
])
def test_bad_pool(kw, code, needle):
    args = dict(num_blocks=4, block_size=16, kv_heads=2, dk=128, dtype=F16)
    args.update(kw)
    with pytest.raises(kvattn.KvaError) as e:
        Pool(**args)
    assert e.value.code == code and needle in str(e.value)


def test_fork_copy_on_write_and_trim(request):
    rng = rng_for(request)
    pool = Pool(16, 8, 2, 64, dtype=BF16, bits=4, group_size=32)
    enc = lambda x: encode(x, BF16, 4, 32)  # noqa: E731
    a = pool.sequence()
    K, V = randn(rng, (2, 20, 64), BF16), randn(rng, (2, 20, 64), BF16)
    a.append(K, V)
    b = a.fork()
    with pool.view([a]) as va:
        blocks = va.csr()["indices"].copy()
    assert [pool.block_refs(int(x)) for x in blocks] == [2, 2, 2]
    K1, V1 = randn(rng, (2, 1, 64), BF16), randn(rng, (2, 1, 64), BF16)
    free0 = pool.stats()["free_blocks"]
    a.append(K1, V1)  # shared partial last block: copied
    assert pool.stats()["free_blocks"] == free0 - 1
    with pool.view([a, b]) as v:
        csr = v.csr()
        ka, _ = v.gather(0)
        kb_, _ = v.gather(1)
    assert list(csr["indices"][:2]) == list(blocks[:2]) and csr["indices"][2] != blocks[2]
    assert csr["indices"][5] == blocks[2]
    assert_rows_equal(ka, cat([enc(K), enc(K1)]), "parent")
    assert_rows_equal(kb_, enc(K), "child")
    # trim: window of 9 tokens; first block partly outside
    a.trim(9)
    assert len(a) == 9 and a.start == 12 and a.num_blocks == 2
    with pool.view([a]) as v:
        assert v.csr()["first_offset"][0] == 4
        ka, _ = v.gather(0)
    assert_rows_equal(ka, sl(cat([enc(K), enc(K1)]), 12, 21), "trimmed")
    a.free()
    b.free()
    pool.check()
    assert pool.stats()["free_blocks"] == 16


def test_views_are_immutable(request):
    rng = rng_for(request)
    pool = Pool(40, 16, 2, 64, dtype=F16)
    seqs, want = [], []
    for n in (10, 33, 56):
        s = pool.sequence()
        K, V = randn(rng, (2, n, 64)), randn(rng, (2, n, 64))
        s.append(K, V)
        seqs.append(s)
        want.append((K.astype(F16), V.astype(F16)))
    view = pool.view([seqs[2], seqs[0], seqs[1]])
    seqs[0].append(randn(rng, (2, 7, 64)), randn(rng, (2, 7, 64)))
    f = seqs[2].fork()
    f.append(randn(rng, (2, 30, 64)), randn(rng, (2, 30, 64)))
    seqs[1].trim(4)
    seqs[2].free()
    f.free()
    g = pool.sequence()
    g.append(randn(rng, (2, 100, 64)), randn(rng, (2, 100, 64)))  # reuses freed blocks
    for b, src in enumerate((2, 0, 1)):
        k, v = view.gather(b)
        assert_rows_equal(k, want[src][0], "view K")
        assert_rows_equal(v, want[src][1], "view V")
    pool.close()  # the view keeps the pool alive
    k, _ = view.gather(0)
    assert_rows_equal(k, want[2][0], "after close")
    view.release()


def test_errors_change_nothing(request):
    rng = rng_for(request)
    pool = Pool(6, 8, 2, 64, dtype=F16, bits=2, group_size=32)
    s = pool.sequence()
    K, V = randn(rng, (2, 36, 64), F16), randn(rng, (2, 36, 64), F16)
    s.append(K, V)
    dead = pool.sequence()
    dead.free()
    before = pool.stats()
    with pytest.raises(kvattn.KvaError) as e:
        s.append(randn(rng, (2, 13, 64)), randn(rng, (2, 13, 64)))
    assert e.value.code == C.ENOBLOCKS and "needs 2 free blocks" in str(e.value)
    for call in (lambda: dead.append(K[:, :1], V[:, :1]), dead.fork, dead.free, lambda: len(dead),
                 lambda: dead.trim(1), lambda: pool.view([s, dead])):
        with pytest.raises(kvattn.KvaError) as e:
            call()
        assert e.value.code == C.ENOSEQ
    with pytest.raises(kvattn.KvaError) as e:
        s.append(randn(rng, (3, 2, 64)), randn(rng, (3, 2, 64)))
    assert e.value.code == C.ESHAPE and "KVH" in str(e.value)
    with pytest.raises(kvattn.KvaError) as e:  # rows of another format
        s.append_raw(kvattn.quantize(K[:, :2], 32, 4), kvattn.quantize(V[:, :2], 32, 4))
    assert e.value.code in (C.ESHAPE, C.EDTYPE)
    assert pool.stats() == before and len(s) == 36
    pool.check()
    with pool.view([s]) as v:
        k, _ = v.gather(0)
    assert_rows_equal(k, encode(K, F16, 2, 32), "after errors")


def test_csr_views_and_reserve(request):
    rng = rng_for(request)
    pool = Pool(10, 16, 2, 64, dtype=F32)
    blocks = pool.reserve(3)
    K, V = randn(rng, (2, 48, 64)), randn(rng, (2, 48, 64))
    for i, blk in enumerate(blocks):
        pool.k[blk] = K[:, 16 * i:16 * i + 16]
        pool.v[blk] = V[:, 16 * i:16 * i + 16]
    view = pool.view_from_csr([0, 3], blocks, [9], first_offset=[5], start=[1000])
    pool.unreserve(blocks)
    assert pool.block_refs(int(blocks[0])) == 1
    csr = view.csr()
    assert csr["lens"][0] == 36 and csr["start"][0] == 1000
    k, v = view.gather(0)
    assert np.array_equal(k, K[:, 5:41]) and np.array_equal(v, V[:, 5:41])
    with pytest.raises(kvattn.KvaError) as e:
        pool.view_from_csr([0, 1], [99], [4])
    assert e.value.code == C.EINVAL and "out of range" in str(e.value)
    with pytest.raises(kvattn.KvaError) as e:
        pool.view_from_csr([0, 1], blocks[:1], [17])
    assert "beyond the table" in str(e.value)
    view.release()
    assert pool.stats()["free_blocks"] == 10
    pool.check()


def contiguous_of(view, enc_rows):
    """[B, KVH, maxlen, D] contiguous caches + lens from per-sequence encoded rows."""
    lens = [r[0].shape[1] if isinstance(r, tuple) else r.shape[1] for r in enc_rows]
    N = max(lens)

    def pad(x):
        return np.pad(x, [(0, 0), (0, N - x.shape[1]), (0, 0)])

    if isinstance(enc_rows[0], tuple):
        return tuple(np.stack([pad(r[i]) for r in enc_rows]) for i in range(3)), np.array(lens, np.int32)
    return np.stack([pad(r) for r in enc_rows]), np.array(lens, np.int32)


ATTN_CASES = {
    "decode_q4_causal": dict(fmt=(BF16, 4, 64), H=8, KVH=2, L=1, D=128, block=16, kw={"mask": "causal"}, q=BF16),
    "verify_q8_window": dict(fmt=(F32, 8, 32), H=6, KVH=2, L=5, D=64, block=8, kw={"mask": "causal", "window": 9}),
    "decode_f16_softcap_sinks": dict(fmt=(F16, 0, 0), H=4, KVH=4, L=2, D=64, block=64,
                                     kw={"mask": "causal", "softcap": 5.0, "sinks": True}),
    "decode_bf16_nomask": dict(fmt=(BF16, 0, 0), H=8, KVH=1, L=1, D=96, block=16, kw={}),
    "fallback_L20_q2": dict(fmt=(F32, 2, 32), H=4, KVH=2, L=20, D=64, block=16, kw={"mask": "causal"}),
    "fallback_bool_mask": dict(fmt=(F16, 4, 32), H=4, KVH=2, L=3, D=64, block=8, kw={"mask": "array"}),
}


@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_attention_over_view(request, name):
    c = ATTN_CASES[name]
    rng = rng_for(request)
    dtype, bits, group = c["fmt"]
    H, KVH, L, D = c["H"], c["KVH"], c["L"], c["D"]
    pool = Pool(64, c["block"], KVH, D, dtype=dtype, bits=bits, group_size=group or 64)
    seqs, ks, vs = [], [], []
    for n in (45, 130, 77):  # ragged; one trimmed so its first block is partly outside the window
        s = pool.sequence()
        K, V = randn(rng, (KVH, n, D), dtype), randn(rng, (KVH, n, D), dtype)
        s.append(K, V)
        keep = n - 11 if n == 130 else n
        s.trim(keep)
        seqs.append(s)
        ks.append(sl(encode(K, dtype, bits, group), n - keep, n))
        vs.append(sl(encode(V, dtype, bits, group), n - keep, n))
    view = pool.view(seqs)
    kc, lens = contiguous_of(view, ks)
    vc, _ = contiguous_of(view, vs)
    kw = dict(c["kw"])
    if kw.pop("sinks", False):
        kw["sinks"] = randn(rng, (H,))
    if kw.get("mask") == "array":
        kw["mask"] = rng.random((3, H, L, int(lens.max()))) < 0.7
    q = randn(rng, (3, H, L, D), c.get("q", F32))
    out = view.attention(q, **kw)
    assert out.shape == (3, H, L, D) and out.dtype == q.dtype
    # the reference with the kernel's query rounding (the same kernel over the view and the contiguous cache)
    ref = ref_for_kernel(q, kc, vc, seq_lens=lens, group_size=group or 64, bits=bits or 4, **kw)
    atol = kernel_atol(q, kc, vc, KVH, seq_lens=lens, group_size=group or 64, bits=bits or 4, **kw)
    assert_close(out, ref, name, atol)
    cont = kvattn.attention(q, kc, vc, seq_lens=lens, group_size=group or 64, bits=bits or 4, **kw)
    assert_same_result(out, cont, name + " vs contiguous", atol)
    assert view.path(q, **kw) == kvattn.attention_path(q, kc, vc, seq_lens=lens, group_size=group or 64,
                                                        bits=bits or 4, **kw)
    assert_close(paged_attention(q, view, **kw), ref, name + " paged_attention", atol)
    orc = view.reference_attention(q, **kw)  # the exact oracle
    if query_rounding_bits(kvattn.attention_kernel(q, kc, vc, seq_lens=lens, group_size=group or 64, bits=bits or 4, **kw)):
        assert_close(orc, ref_attention(q, kc, vc, seq_lens=lens, group_size=group or 64, bits=bits or 4, **kw),
                     name + " library's oracle", COMPUTE_ATOL)
    else:
        assert_same_result(out, orc, name + " vs the library's oracle", atol)
    view.release()


@pytest.mark.parametrize("quant", [False, True], ids=["bf16", "q4"])
def test_from_contiguous(request, quant):
    rng = rng_for(request)
    B, KVH, N, D = 3, 2, 77, 128
    K, V = randn(rng, (B, KVH, N, D), BF16), randn(rng, (B, KVH, N, D), BF16)
    if quant:
        K, V = kvattn.quantize(K, 64, 4), kvattn.quantize(V, 64, 4)
    lens = [77, 1, 40]
    pool, seqs = Pool.from_contiguous(K, V, 16, seq_lens=lens, spare_blocks=2, shuffle_seed=7, group_size=64, bits=4)
    assert pool.num_blocks == 5 + 1 + 3 + 2 and [len(s) for s in seqs] == lens
    with pool.view(seqs) as view:
        idx = view.csr()["indices"]
        assert list(idx) != sorted(idx)  # scattered by the shuffle
        for b, n in enumerate(lens):
            k, v = view.gather(b)
            want_k = tuple(a[b, :, :n] for a in K) if quant else K[b, :, :n]
            assert_rows_equal(k, want_k, "K of sequence %d" % b)
        q = randn(rng, (3, 4, 1, D), BF16)
        out = view.attention(q, mask="causal")
        ref = ref_for_kernel(q, K, V, seq_lens=lens, mask="causal", group_size=64, bits=4)
        assert_close(out, ref, "from_contiguous attention",
                     kernel_atol(q, K, V, KVH, seq_lens=lens, mask="causal", group_size=64, bits=4))


def test_view_type_and_release():
    pool = Pool(4, 8, 1, 64, dtype=F32)
    s = pool.sequence()
    s.append(np.ones((1, 3, 64), np.float32), np.ones((1, 3, 64), np.float32))
    view = pool.view([s])
    assert isinstance(view, PagedView) and view.batch == 1
    view.release()
    with pytest.raises(ValueError):
        view.attention(np.zeros((1, 1, 1, 64), np.float32))
    with pytest.raises(TypeError):
        paged_attention(np.zeros((1, 1, 1, 64), np.float32), object())
    with pytest.raises(kvattn.KvaError) as e:
        pool.view([])
    assert e.value.code == C.EINVAL


# ------------------------------------------------------------ block tables
TABLE_CASES = {
    "decode_q4_causal": dict(fmt=(BF16, 4, 64), H=8, KVH=2, L=1, D=128, block=16, kw={"mask": "causal"}, q=BF16),
    "verify_q8_window_sinks": dict(fmt=(F32, 8, 32), H=6, KVH=2, L=8, D=64, block=8,
                                   kw={"mask": "causal", "window": 9, "sinks": True}),
    "decode_f16_softcap": dict(fmt=(F16, 0, 0), H=4, KVH=4, L=1, D=64, block=32,
                               kw={"mask": "causal", "softcap": 5.0}),
    "fallback_L20_q4": dict(fmt=(F32, 4, 32), H=4, KVH=2, L=20, D=64, block=16, kw={"mask": "causal"}),
}


def _trimmed_view(rng, c):
    """A shuffled pool with three ragged sequences, two trimmed (first_offset != 0)."""
    dtype, bits, group = c["fmt"]
    pool = Pool(64, c["block"], c["KVH"], c["D"], dtype=dtype, bits=bits, group_size=group or 64)
    pool.shuffle(11)
    seqs = []
    for n, keep in ((45, 40), (130, 119), (77, 77)):
        s = pool.sequence()
        s.append(randn(rng, (c["KVH"], n, c["D"]), dtype), randn(rng, (c["KVH"], n, c["D"]), dtype))
        seqs.append(s.trim(keep))
    return pool, seqs, pool.view(seqs)


@pytest.mark.parametrize("name", list(TABLE_CASES))
def test_block_table_equals_paged(request, name):
    c = TABLE_CASES[name]
    rng = rng_for(request)
    dtype, bits, group = c["fmt"]
    pool, seqs, view = _trimmed_view(rng, c)
    kw = dict(c["kw"])
    if kw.pop("sinks", False):
        kw["sinks"] = randn(rng, (c["H"],))
    fmt = dict(group_size=group or 64, bits=bits or 4)
    q = randn(rng, (3, c["H"], c["L"], c["D"]), c.get("q", F32))
    want = paged_attention(q, view, **kw)
    blocks, lens, first = view.block_table()
    csr = view.csr()
    assert blocks.shape == (3, int(np.diff(csr["indptr"]).max())) and blocks.dtype == np.int32
    assert list(lens) == [40, 119, 77] and list(lens) == list(csr["lens"])
    assert list(first) == list(csr["first_offset"]) and first.any()
    for b in range(3):
        nb = csr["indptr"][b + 1] - csr["indptr"][b]
        assert list(blocks[b, :nb]) == list(csr["indices"][csr["indptr"][b]:csr["indptr"][b + 1]])
        assert (blocks[b, nb:] == -1).all()
    got = block_table_attention(q, pool.k, pool.v, blocks, lens, first, **fmt, **kw)
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8)), name
    # A wider table (row stride > max_blocks, junk past each sequence's blocks), read in place.
    mb = blocks.shape[1]
    wide = np.full((3, mb + 5), 2**31 - 1, np.int32)
    for b in range(3):
        nb = csr["indptr"][b + 1] - csr["indptr"][b]
        wide[b, :nb] = blocks[b, :nb]
    got2 = block_table_attention(q, pool.k, pool.v, wide[:, :mb + 1], lens, first, **fmt, **kw)
    assert np.array_equal(got2.view(np.uint8), want.view(np.uint8)), name + " (strided table)"
    ref = block_table_reference_attention(q, pool.k, pool.v, blocks, lens, first, **fmt, **kw)
    assert np.array_equal(ref.view(np.uint8), view.reference_attention(q, **kw).view(np.uint8))
    kc, lc = contiguous_of(view, [view.gather(b)[0] for b in range(3)])
    vc, _ = contiguous_of(view, [view.gather(b)[1] for b in range(3)])
    kernel = kvattn.attention_kernel(q, kc, vc, seq_lens=lc, **fmt, **kw)
    if query_rounding_bits(kernel):
        # a kernel that rounds the query: against the reference with that rounding
        assert_close(got, ref_for_kernel(q, kc, vc, seq_lens=lc, **fmt, **kw), name + " vs the reference",
                     compute_atol(q, c["KVH"], kernel))
    else:
        assert_same_result(got, ref, name + " vs the library's oracle", compute_atol(q, c["KVH"], kernel))
    view.release()


def test_block_table_mask_array_and_caller_pools(request):
    """A caller's own float pools (block size 5) and an explicit mask [B, H, L, max_blocks * block_size]
    against the float64 reference over the contiguous cache."""
    rng = rng_for(request)
    B, H, KVH, L, D, bs = 2, 4, 2, 3, 64, 5
    lens = np.array([23, 9], np.int32)
    first = np.array([3, 0], np.int32)
    K, V = randn(rng, (B, KVH, 23, D), F32), randn(rng, (B, KVH, 23, D), F32)
    k_pool = np.full((12, KVH, bs, D), np.nan, np.float32)
    v_pool = np.full((12, KVH, bs, D), np.nan, np.float32)
    max_blocks = 6
    blocks = np.full((B, max_blocks), -1, np.int32)
    free = list(rng.permutation(12))
    for b in range(B):
        for t in range(lens[b]):
            r = first[b] + t
            if blocks[b, r // bs] < 0:
                blocks[b, r // bs] = free.pop()
            k_pool[blocks[b, r // bs], :, r % bs] = K[b, :, t]
            v_pool[blocks[b, r // bs], :, r % bs] = V[b, :, t]
    q = randn(rng, (B, H, L, D), F32)
    mask = rng.random((B, H, L, max_blocks * bs)) < 0.7
    out = block_table_attention(q, k_pool, v_pool, blocks, lens, first, mask=mask)
    ref = ref_attention(q, K, V, seq_lens=lens, mask=mask[..., :23])
    assert_close(out, ref, "caller pools, mask array", compute_atol(q, KVH))
    assert np.isfinite(out).all()


def test_block_table_errors():
    pool = Pool(8, 8, 1, 64, dtype=F32)
    s = pool.sequence()
    s.append(np.ones((1, 20, 64), np.float32), np.ones((1, 20, 64), np.float32))
    q = np.zeros((1, 2, 1, 64), np.float32)
    with pool.view([s]) as view:
        blocks, lens, first = view.block_table()
        assert blocks.shape == (1, 3)
        with pytest.raises(kvattn.KvaError) as e:
            view.block_table(2)
        assert e.value.code == C.ESHAPE and "max_blocks = 2" in str(e.value)
        wide, _, _ = view.block_table(5)
        assert list(wide[0, 3:]) == [-1, -1]
        good = block_table_attention(q, pool.k, pool.v, wide, lens, first)
        assert np.array_equal(good, block_table_attention(q, pool.k, pool.v, blocks, lens))
        bad = blocks.copy()
        bad[0, 2] = 8
        with pytest.raises(kvattn.KvaError) as e:
            block_table_attention(q, pool.k, pool.v, bad, lens, first)
        assert e.value.code == C.EINVAL and "table.blocks[0][2] = 8" in str(e.value)
        with pytest.raises(kvattn.KvaError) as e:
            block_table_attention(q, pool.k, pool.v, blocks, np.array([25], np.int32))
        assert e.value.code == C.ESHAPE and "table.seq_lens[0] = 25" in str(e.value)
        with pytest.raises(kvattn.KvaError) as e:
            block_table_attention(q, pool.k, pool.v, blocks, lens, np.array([8], np.int32))
        assert e.value.code == C.EINVAL and "first_offset[0] = 8" in str(e.value)
        with pytest.raises(kvattn.KvaError) as e:
            block_table_attention(q, pool.k, pool.v, blocks, np.array([20, 20], np.int32))
        assert e.value.code == C.ESHAPE and "seq_lens must have shape [B] = [1]" in str(e.value)
        with pytest.raises(kvattn.KvaError) as e:
            block_table_attention(q, pool.k, pool.v[:4], blocks, lens)
        assert e.value.code == C.ESHAPE and "v_pool.shape[0] = 4" in str(e.value)
        with pytest.raises(kvattn.KvaError) as e:
            block_table_attention(q, pool.k, pool.v, blocks.reshape(-1), lens)
        assert e.value.code == C.ESHAPE and "blocks must have rank 2" in str(e.value)
