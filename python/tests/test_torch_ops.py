"""torch.ops.kvattn.* (the compiled PyTorch extension, kvattn.torch_ops) on
CPU tensors against the float64 numpy reference of kvref.py and the ctypes
numpy path: float and MLX-packed K/V, masks, window, softcap, sinks, ragged
lengths, block tables, lse, the out= forms (sentinels around out), cache
writes bit for bit with the numpy path, merge_states (associative, as the
numpy merge), torch.compile(fullgraph=True), and bad input (ValueError with
the library's message, outputs untouched). CUDA cases (current stream,
graph capture, compile, mismatched devices) run where a GPU is present.
Skipped when torch or the extension (make torch-ext) is missing."""
import numpy as np
import pytest

# torch before kvattn: torch's loader then picks its own CUDA libraries even
# where libkvattn.so was linked against another CUDA installation
torch = pytest.importorskip("torch")

import kvattn  # noqa: E402
from kvattn import torch_ops  # noqa: E402
from kvref import (BF16, BF16_PRODUCTS_ATOL, COMPUTE_ATOL, F16, F32, UNIT_ROUNDOFF, assert_close,  # noqa: E402
                   query_rounding_bits, randn, ref_attention, rng_for)

if not torch_ops.available():
    pytest.skip(torch_ops.load_error(), allow_module_level=True)
ops = torch_ops.load()
CUDA = torch.cuda.is_available() and kvattn.cuda_device_count() > 0

LSE_RTOL = 1e-5  # f32 rounding of m + log l, relative to max(1, |lse|)


# ----------------------------------------------------------------- helpers
def to_torch(a, device="cpu"):
    """numpy -> torch without a copy on the CPU (bf16 through int16, u32 words as int32)."""
    a = np.ascontiguousarray(a)
    if a.dtype == np.uint32:
        a = a.view(np.int32)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(a).to(device)


def to_numpy(t, dtype=None):
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    a = t.numpy()
    return a if dtype is None else a.view(dtype)


def atol_of(kernel):
    """The arithmetic allowance of the kernel that ran, from its bracket
    (kva_attention_kernel): f32 products ("[exact f32]", or a query rounding
    of N <= 8 bits that the reference applies too: ref_of), or 16-bit
    products (any bf16/f16 item)."""
    bracket = kernel[kernel.rindex("["):]
    if query_rounding_bits(kernel) and "," not in bracket:
        return COMPUTE_ATOL
    return COMPUTE_ATOL if bracket == "[exact f32]" else BF16_PRODUCTS_ATOL


def ref_of(kernel, q, k, v, **kw):
    """The float64 reference with the query rounding the kernel's bracket names (kvref.round_query)."""
    return ref_attention(q, k, v, q_int_bits=query_rounding_bits(kernel), **kw)


def make_case(rng, B, H, KVH, L, N, Dk, Dv, kvdt, qdt, bits=0, g=64):
    q = randn(rng, (B, H, L, Dk), qdt)
    k = randn(rng, (B, KVH, N, Dk), kvdt)
    v = randn(rng, (B, KVH, N, Dv), kvdt)
    if bits:
        k, v = kvattn.quantize(k, g, bits), kvattn.quantize(v, g, bits)
    return q, k, v


def kv_kwargs(k, v, bits, g, device="cpu"):
    """(k data, v data, op keyword options) of numpy K/V (arrays or packed tuples)."""
    if not bits:
        return to_torch(k, device), to_torch(v, device), {}
    kw = dict(k_scales=to_torch(k[1], device), k_biases=to_torch(k[2], device), v_scales=to_torch(v[1], device),
              v_biases=to_torch(v[2], device), bits=bits, group_size=g)
    return to_torch(k[0], device), to_torch(v[0], device), kw


def op_options(kw, device="cpu"):
    """kvattn.attention keyword arguments -> the ops' options (tensors on device)."""
    out = {}
    for name, x in kw.items():
        if name == "mask":
            if isinstance(x, str):
                out["causal"] = True
            else:
                out["mask"] = to_torch(x, device)
        elif name in ("sinks", "segments", "seq_lens"):
            out[name] = to_torch(np.asarray(x, np.float32 if name == "sinks" else np.int32), device)
        else:
            out[name] = x
    return out


CAUSAL = {"mask": "causal"}
# (B, H, KVH, L, N, Dk, Dv, kv dtype, q dtype, bits, group, kvattn.attention kwargs)
CASES = {
    "decode_f32_gqa4": (1, 8, 2, 1, 113, 128, 128, F32, F32, 0, 64, CAUSAL),
    "decode_bf16_B2": (2, 8, 2, 1, 150, 128, 128, BF16, BF16, 0, 64, CAUSAL),
    "verify_bf16_window": (1, 8, 2, 4, 90, 64, 64, BF16, BF16, 0, 64, dict(mask="causal", window=17)),
    "decode_q4_bf16": (2, 8, 2, 1, 257, 128, 128, BF16, BF16, 4, 64, CAUSAL),
    "verify_q4_bf16_gqa4": (1, 8, 2, 4, 200, 128, 128, BF16, BF16, 4, 64, CAUSAL),
    "verify_q8_f16": (1, 4, 2, 3, 129, 64, 64, F16, F16, 8, 32, CAUSAL),
    "decode_q2_f32": (1, 4, 1, 1, 70, 128, 128, F32, F32, 2, 128, CAUSAL),
    "dk128_dv64": (2, 4, 2, 1, 70, 128, 64, F32, F32, 0, 64, CAUSAL),
    "softcap_sinks_scale": (1, 8, 2, 3, 90, 128, 128, F32, F32, 4, 64,
                            dict(mask="causal", softcap=20.0, scale=0.2, sinks=[0.5, -1, 2, 0, 1, -3, 0.1, 0.0])),
    "segments_clamp": (2, 4, 2, 6, 60, 64, 64, F32, F32, 0, 64, dict(mask="causal", window=9, clamp=True)),
    "seq_lens_ragged": (3, 8, 2, 2, 120, 64, 64, BF16, BF16, 4, 64, dict(mask="causal", seq_lens=[120, 37, 64])),
    "bool_mask": (1, 4, 2, 5, 33, 64, 64, F32, F32, 0, 64, dict(mask="bool")),
    "additive_mask": (2, 4, 4, 3, 40, 64, 64, F32, F32, 0, 64, dict(mask="additive")),
    "no_mask_exact": (1, 8, 2, 8, 100, 128, 128, BF16, BF16, 4, 64, dict(exact=True)),
}


def materialize(rng, kw, B, H, L, N):
    kw = dict(kw)
    if kw.get("mask") == "bool":
        kw["mask"] = rng.random((L, N)) < 0.7
    elif kw.get("mask") == "additive":
        kw["mask"] = (rng.standard_normal((B, 1, L, N)) * 2).astype(np.float32)
    if kw.get("clamp"):
        seg = np.zeros((B, N), np.int32)
        seg[0, 10:25], seg[0, 40:58], seg[-1, 50:] = 1, 2, 3
        kw["segments"] = seg
    if "sinks" in kw:
        kw["sinks"] = np.asarray(kw["sinks"], np.float32)
    return kw


@pytest.mark.parametrize("name", list(CASES))
def test_attention_vs_reference(request, name):
    B, H, KVH, L, N, Dk, Dv, kvdt, qdt, bits, g, kw = CASES[name]
    rng = rng_for(request)
    q, k, v = make_case(rng, B, H, KVH, L, N, Dk, Dv, kvdt, qdt, bits, g)
    kw = materialize(rng, kw, B, H, L, N)
    kernel = kvattn.attention_kernel(q, k, v, group_size=g, bits=bits, **kw)
    ref = ref_of(kernel, q, k, v, group_size=g, bits=bits, **{n: x for n, x in kw.items() if n != "exact"})
    kd, vd, kvkw = kv_kwargs(k, v, bits, g)
    out = ops.attention(to_torch(q), kd, vd, **kvkw, **op_options(kw))
    assert out.shape == (B, H, L, Dv) and out.dtype == to_torch(q).dtype and out.device.type == "cpu"
    got = to_numpy(out)
    assert_close(got, ref, "%s (%s)" % (name, kernel), atol_of(kernel) * max(1.0, abs(kw.get("scale", 0)) * Dk ** 0.5))
    # the same library and kernel as the numpy path: the same bits
    numpy_out = kvattn.attention(q, k, v, group_size=g, bits=bits, **kw)
    assert np.array_equal(got.view(np.uint8), numpy_out.view(np.uint8)), name
    # kvattn.attention on torch tensors takes the ops
    wrapped = kvattn.attention(to_torch(q), (kd, kvkw["k_scales"], kvkw["k_biases"]) if bits else kd,
                               (vd, kvkw["v_scales"], kvkw["v_biases"]) if bits else vd, group_size=g, bits=bits,
                               **{n: (to_torch(np.asarray(x)) if isinstance(x, (np.ndarray, list)) else x)
                                  for n, x in op_options(kw).items() if n not in ("causal",)},
                               **({"mask": "causal"} if isinstance(kw.get("mask"), str) else {}))
    assert isinstance(wrapped, torch.Tensor) and torch.equal(wrapped, out)


def with_sentinels(shape, dtype, fill=7.0):
    """A tensor view of shape inside a larger buffer filled with `fill` (rows padded)."""
    big = torch.full(shape[:-1] + (shape[-1] + 8,), fill, dtype=dtype)
    return big, big[..., 4:4 + shape[-1]]


def test_attention_out_form(request):
    rng = rng_for(request)
    B, H, KVH, L, N, D = 2, 8, 2, 3, 100, 128
    q, k, v = make_case(rng, B, H, KVH, L, N, D, D, BF16, BF16, 4, 64)
    kd, vd, kvkw = kv_kwargs(k, v, 4, 64)
    big, out = with_sentinels((B, H, L, D), torch.float32)
    ops.attention_out(out, to_torch(q), kd, vd, causal=True, **kvkw)
    want = ops.attention(to_torch(q), kd, vd, causal=True, **kvkw)
    kernel = kvattn.attention_kernel(q, k, v, mask="causal", out=np.empty((B, H, L, D), F32))
    assert_close(to_numpy(out), ref_of(kernel, q, k, v, mask="causal"), kernel, atol_of(kernel))
    assert torch.allclose(out, want.float(), atol=2 * UNIT_ROUNDOFF[BF16] * float(want.abs().max()), rtol=0)
    assert (big[..., :4] == 7).all() and (big[..., 4 + D:] == 7).all()
    # lse forms
    big_l, lse = with_sentinels((B, H, L), torch.float32)
    out2 = torch.empty(B, H, L, D, dtype=torch.float32)
    ops.attention_lse_out(out2, lse, to_torch(q), kd, vd, causal=True, **kvkw)
    assert torch.equal(out2, out) and (big_l[..., :4] == 7).all() and (big_l[..., 4 + L:] == 7).all()
    o3, l3 = ops.attention_lse(to_torch(q), kd, vd, causal=True, **kvkw)
    assert l3.dtype == torch.float32 and torch.equal(l3, lse)


@pytest.mark.parametrize("base2", [False, True])
def test_lse_vs_reference(request, base2):
    rng = rng_for(request)
    B, H, KVH, L, N, D = 2, 8, 4, 3, 40, 64
    q, k, v = make_case(rng, B, H, KVH, L, N, D, D, F32, F32)
    sinks = rng.standard_normal(H).astype(np.float32)
    out, lse = ops.attention_lse(to_torch(q), to_torch(k), to_torch(v), causal=True, window=11,
                                 sinks=to_torch(sinks), lse_base2=base2)
    ref, ref_lse = ref_attention(q, k, v, mask="causal", window=11, sinks=sinks, return_lse=True)
    assert_close(to_numpy(out), ref, "lse out")
    ref_lse = ref_lse / np.log(2) if base2 else ref_lse
    err = np.abs(to_numpy(lse).astype(np.float64) - ref_lse) / np.maximum(1, np.abs(ref_lse))
    assert err.max() <= LSE_RTOL, err.max()
    o2, l2 = kvattn.attention(to_torch(q), to_torch(k), to_torch(v), mask="causal", window=11,
                              sinks=to_torch(sinks), return_lse=True, lse_base2=base2)
    assert torch.equal(o2, out) and torch.equal(l2, lse)


# ------------------------------------------------------------ block tables
def scatter_to_pools(rng, k, v, bs, spare=3):
    """Float or packed K/V [B, KVH, N, ...] -> pools [num_blocks, KVH, bs, ...]
    with the blocks shuffled, and the table [B, max_blocks]."""
    parts_k = k if isinstance(k, tuple) else (k,)
    parts_v = v if isinstance(v, tuple) else (v,)
    B, KVH, N = parts_k[0].shape[:3]
    mb = -(-N // bs)
    nblk = B * mb + spare
    perm = rng.permutation(nblk)[:B * mb].reshape(B, mb).astype(np.int32)

    def pool(a):
        p = np.zeros((nblk, KVH, bs) + a.shape[3:], a.dtype)
        for b in range(B):
            for j in range(mb):
                rows = a[b, :, j * bs:(j + 1) * bs]
                p[perm[b, j], :, :rows.shape[1]] = rows
        return p

    kp, vp = tuple(pool(a) for a in parts_k), tuple(pool(a) for a in parts_v)
    return (kp if isinstance(k, tuple) else kp[0]), (vp if isinstance(v, tuple) else vp[0]), perm


@pytest.mark.parametrize("bits,dt", [(0, F32), (0, BF16), (4, BF16), (8, F16)])
def test_block_table_attention(request, bits, dt):
    rng = rng_for(request)
    B, H, KVH, L, N, D, bs = 3, 8, 2, 2, 75, 64, 16
    q, k, v = make_case(rng, B, H, KVH, L, N, D, D, dt, dt, bits, 64 if bits != 8 else 32)
    g = 64 if bits != 8 else 32
    kp, vp, table = scatter_to_pools(rng, k, v, bs)
    lens = np.array([75, 40, 17], np.int32)
    first = np.array([0, 3, 15], np.int32)  # first_offset: rows of the first block before token 0
    # token t of sequence b is row first[b] + t of its table row: shift the table's rows accordingly
    want = kvattn.block_table_attention(q, kp, vp, table, lens - first, first, mask="causal", group_size=g, bits=bits)
    kd, vd, kvkw = kv_kwargs(kp, vp, bits, g)
    out = ops.block_table_attention(to_torch(q), kd, vd, to_torch(table), to_torch(lens - first), to_torch(first),
                                    causal=True, **kvkw)
    assert np.array_equal(to_numpy(out).view(np.uint8), want.view(np.uint8))
    # the float64 reference per sequence over its rows first[b] .. lens[b] - 1
    # of the contiguous cache, with the query rounding and allowance of the
    # kernel the same shape takes over contiguous K/V
    kernel = kvattn.attention_kernel(q, k, v, mask="causal", group_size=g, bits=bits)

    def rows(x, b):
        return tuple(a[b:b + 1, :, first[b]:lens[b]] for a in x) if bits else x[b:b + 1, :, first[b]:lens[b]]

    ref = np.concatenate([ref_of(kernel, q[b:b + 1], rows(k, b), rows(v, b), mask="causal", group_size=g, bits=bits)
                          for b in range(B)])
    assert_close(to_numpy(out), ref, kernel, atol_of(kernel))
    oracle = kvattn.block_table_reference_attention(q, kp, vp, table, lens - first, first, mask="causal",
                                                    group_size=g, bits=bits, out=np.empty((B, H, L, D), F32))
    exact = np.concatenate([ref_attention(q[b:b + 1], rows(k, b), rows(v, b), mask="causal", group_size=g,
                                          bits=bits) for b in range(B)])
    assert_close(oracle, exact, "the oracle over the table", COMPUTE_ATOL)  # the table read as meant
    # out= form and the lse forms
    o2 = torch.empty_like(out)
    ops.block_table_attention_out(o2, to_torch(q), kd, vd, to_torch(table), to_torch(lens - first), to_torch(first),
                                  causal=True, **kvkw)
    assert torch.equal(o2, out)
    o3, l3 = ops.block_table_attention_lse(to_torch(q), kd, vd, to_torch(table), to_torch(lens - first),
                                           to_torch(first), causal=True, **kvkw)
    assert torch.equal(o3, out) and l3.shape == (B, H, L) and torch.isfinite(l3).all()
    wrapped = kvattn.block_table_attention(to_torch(q), (kd, kvkw["k_scales"], kvkw["k_biases"]) if bits else kd,
                                           (vd, kvkw["v_scales"], kvkw["v_biases"]) if bits else vd, to_torch(table),
                                           to_torch(lens - first), to_torch(first), mask="causal", group_size=g,
                                           bits=bits)
    assert torch.equal(wrapped, out)


# ------------------------------------------------------------- cache write
@pytest.mark.parametrize("bits", [0, 4, 8])
def test_cache_write_matches_numpy(request, bits):
    rng = rng_for(request)
    nblk, KVH, bs, D, n = 6, 2, 16, 64, 9
    g = 32
    k = randn(rng, (n, KVH, D), BF16)
    v = randn(rng, (n, KVH, D), BF16)
    slots = rng.permutation(nblk * bs)[:n].astype(np.int32)
    slots[3] = -1  # padding: skipped
    if bits:
        words = D * bits // 32
        pools = [[np.zeros((nblk, KVH, bs, words), np.uint32), np.zeros((nblk, KVH, bs, D // g), BF16),
                  np.zeros((nblk, KVH, bs, D // g), BF16)] for _ in range(2)]
    else:
        pools = [[np.zeros((nblk, KVH, bs, D), BF16)] for _ in range(2)]
    tp = [[to_torch(a) for a in p] for p in pools]
    if bits:
        kvattn.cache_write(tuple(pools[0]), tuple(pools[1]), k, v, slots, group_size=g, bits=bits)
        ops.cache_write_quantized(*tp[0], *tp[1], to_torch(k), to_torch(v), to_torch(slots), bits=bits, group_size=g)
    else:
        kvattn.cache_write(pools[0][0], pools[1][0], k, v, slots)
        ops.cache_write(tp[0][0], tp[1][0], to_torch(k), to_torch(v), to_torch(slots))
    for p, t in zip(pools, tp):
        for a, b in zip(p, t):
            assert np.array_equal(np.ascontiguousarray(a).view(np.uint8), to_numpy(b).view(np.uint8))
    assert any(np.any(a.view(np.uint8)) for a in pools[0])
    # through kvattn.cache_write on torch tensors
    tp2 = [[torch.zeros_like(a) for a in p] for p in tp]
    kvattn.cache_write(tuple(tp2[0]) if bits else tp2[0][0], tuple(tp2[1]) if bits else tp2[1][0], to_torch(k),
                       to_torch(v), to_torch(slots), group_size=g, bits=bits if bits else 4)
    for p, t in zip(tp, tp2):
        for a, b in zip(p, t):
            assert torch.equal(a, b)


# ------------------------------------------------------------ merge states
def test_merge_states_associative(request):
    """Attention over three disjoint key ranges merged as ((a, b), c), as
    (a, (b, c)) and in one call equals one call over all keys, and the ops'
    merge equals the numpy merge bit for bit."""
    rng = rng_for(request)
    B, H, KVH, L, N, D = 2, 8, 2, 2, 96, 64
    q, k, v = make_case(rng, B, H, KVH, L, N, D, D, F32, F32)
    cuts = [0, 30, 61, N]
    parts = [ops.attention_lse(to_torch(q), to_torch(k[:, :, a:b]), to_torch(v[:, :, a:b]))
             for a, b in zip(cuts, cuts[1:])]
    o_all, l_all = ops.merge_states([p[0] for p in parts], [p[1] for p in parts])
    ab = ops.merge_states([parts[0][0], parts[1][0]], [parts[0][1], parts[1][1]])
    o_l, l_l = ops.merge_states([ab[0], parts[2][0]], [ab[1], parts[2][1]])
    bc = ops.merge_states([parts[1][0], parts[2][0]], [parts[1][1], parts[2][1]])
    o_r, l_r = ops.merge_states([parts[0][0], bc[0]], [parts[0][1], bc[1]])
    ref, ref_lse = ref_attention(q, k, v, return_lse=True)
    for o, lse in ((o_all, l_all), (o_l, l_l), (o_r, l_r)):
        assert_close(to_numpy(o), ref, "merge")
        err = np.abs(to_numpy(lse).astype(np.float64) - ref_lse) / np.maximum(1, np.abs(ref_lse))
        assert err.max() <= LSE_RTOL
    np_o, np_l = kvattn.merge_states([(to_numpy(o), to_numpy(lse)) for o, lse in parts])
    assert np.array_equal(np_o, to_numpy(o_all)) and np.array_equal(np_l, to_numpy(l_all))
    # out= (in place into part 0), base 2, dtype, and kvattn.merge_states on tensors
    o0 = parts[0][0].clone()
    lse = torch.empty_like(parts[0][1])
    ops.merge_states_out(o0, lse, [o0, parts[1][0], parts[2][0]], [p[1] for p in parts])
    assert torch.equal(o0, o_all) and torch.equal(lse, l_all)
    o_b, l_b = ops.merge_states([p[0] for p in parts], [p[1] / np.log(2) for p in parts], base2=True,
                                dtype=torch.bfloat16)
    assert o_b.dtype == torch.bfloat16 and torch.allclose(l_b * np.log(2), l_all, rtol=1e-5, atol=1e-5)
    w_o, w_l = kvattn.merge_states(parts)
    assert torch.equal(w_o, o_all) and torch.equal(w_l, l_all)


# ----------------------------------------------------------------- compile
def test_compile_fullgraph(request):
    """torch.compile(fullgraph=True) of a decode step (cache write, attention,
    attention_out, merge): traced without a graph break (the meta kernels),
    the same results as eager."""
    rng = rng_for(request)
    nblk, KVH, bs, D, H = 8, 2, 16, 64, 8
    kp = torch.zeros(nblk, KVH, bs, D)
    vp = torch.zeros(nblk, KVH, bs, D)
    table = torch.tensor([[3, 1, 6]], dtype=torch.int32)
    krow = to_torch(randn(rng, (40, KVH, D)))
    vrow = to_torch(randn(rng, (40, KVH, D)))
    slots = torch.tensor([int(table[0, t // bs]) * bs + t % bs for t in range(40)], dtype=torch.int32)
    q = to_torch(randn(rng, (1, H, 1, D)))
    lens = torch.tensor([40], dtype=torch.int32)

    def step(kp, vp, q, out):
        torch.ops.kvattn.cache_write(kp, vp, krow, vrow, slots)
        a = torch.ops.kvattn.block_table_attention(q, kp, vp, table, lens, causal=True)
        torch.ops.kvattn.block_table_attention_out(out, q * 2, kp, vp, table, lens, causal=True)
        o, lse = torch.ops.kvattn.block_table_attention_lse(q, kp, vp, table, lens)
        m, _ = torch.ops.kvattn.merge_states([o, o], [lse, lse])
        return a + 1, m

    out_e = torch.empty(1, H, 1, D)
    want = step(kp, vp, q, out_e)
    kp2, vp2, out_c = torch.zeros_like(kp), torch.zeros_like(vp), torch.empty(1, H, 1, D)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(kp2, vp2, q, out_c)
    assert torch.equal(kp2, kp) and torch.equal(vp2, vp)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(out_c, out_e)


def test_compile_inductor(request):
    rng = rng_for(request)
    q, k, v = make_case(rng, 1, 8, 2, 1, 64, 64, 64, F32, F32, 4, 64)
    kd, vd, kvkw = kv_kwargs(k, v, 4, 64)
    qt = to_torch(q)

    def f(q):
        return torch.ops.kvattn.attention(q * 0.5, kd, vd, causal=True, **kvkw).sum(-1)

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):  # generated code calls the operators positionally
        got = torch.compile(f, fullgraph=True)(qt)
    assert torch.allclose(got, f(qt), rtol=0, atol=1e-5)


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 3, 128, dtype=torch.bfloat16)
        kp = torch.empty(2, 2, 50, 16, dtype=torch.int32)
        s = torch.empty(2, 2, 50, 2, dtype=torch.bfloat16)
        out = torch.ops.kvattn.attention(q, kp, kp, k_scales=s, k_biases=s, v_scales=s, v_biases=s, bits=4)
        o, lse = torch.ops.kvattn.block_table_attention_lse(q, kp, kp, torch.empty(2, 4, dtype=torch.int32),
                                                            torch.empty(2, dtype=torch.int32), k_scales=s,
                                                            k_biases=s, v_scales=s, v_biases=s, bits=8)
    assert out.shape == (2, 8, 3, 128) and out.dtype == torch.bfloat16
    assert o.shape == (2, 8, 3, 64) and lse.shape == (2, 8, 3) and lse.dtype == torch.float32


# --------------------------------------------------------------- bad input
def small():
    q = torch.randn(1, 4, 1, 64)
    k = torch.randn(1, 2, 30, 64)
    return q, k, k.clone()


@pytest.mark.parametrize("case,match", [
    ("q_f64", "unsupported or mismatched dtype: q has unsupported dtype Double"),
    ("k_inner_stride", "stride"),
    ("heads", "multiple of KV heads"),
    ("window", "window"),
    ("packed_without_scales", "k.data is packed .bits = 4.: k.scales and k.biases are required"),
    ("float_as_packed", "dtype"),
    ("bits3", "bits"),
    ("scales_with_float", "given with bits = 0"),
    ("sinks_shape", r"sinks must have shape \[4\]"),
    ("sinks_dtype", r"sinks has dtype Half \(Float expected\)"),
    ("seq_lens_shape", r"seq_lens must have shape \[1\]"),
    ("seq_lens_value", "seq_lens"),
    ("causal_and_mask", "exclusive"),
    ("scale0", "scale = 0"),
    ("rank5", "rank 5"),
    ("out_dtype", "out"),
    ("out_shape", "out"),
])
def test_bad_input(case, match):
    """ValueError with the library's (or the binding's) message naming the
    argument; out untouched."""
    q, k, v = small()
    out = torch.full((1, 4, 1, 64), 3.0)
    kw, args = {}, [q, k, v]
    if case == "q_f64":
        args[0] = q.double()
    elif case == "k_inner_stride":
        args[1] = torch.randn(1, 2, 30, 128)[..., ::2]
    elif case == "heads":
        args[0] = torch.randn(1, 3, 1, 64)
    elif case == "window":
        kw = dict(causal=True, window=-2)
    elif case == "packed_without_scales":
        kw = dict(bits=4)
    elif case == "float_as_packed":
        s = torch.ones(1, 2, 30, 1)
        kw = dict(bits=4, k_scales=s, k_biases=s, v_scales=s, v_biases=s)
    elif case == "bits3":
        p = torch.zeros(1, 2, 30, 6, dtype=torch.int32)
        s = torch.ones(1, 2, 30, 1)
        args[1:] = [p, p]
        kw = dict(bits=3, k_scales=s, k_biases=s, v_scales=s, v_biases=s)
    elif case == "scales_with_float":
        kw = dict(k_scales=torch.ones(1))
    elif case == "sinks_shape":
        kw = dict(sinks=torch.zeros(3))
    elif case == "sinks_dtype":
        kw = dict(sinks=torch.zeros(4, dtype=torch.float16))
    elif case == "seq_lens_shape":
        kw = dict(seq_lens=torch.tensor([5, 5], dtype=torch.int32))
    elif case == "seq_lens_value":
        kw = dict(seq_lens=torch.tensor([31], dtype=torch.int32))
    elif case == "causal_and_mask":
        kw = dict(causal=True, mask=torch.ones(30, dtype=torch.bool))
    elif case == "scale0":
        kw = dict(scale=0.0)
    elif case == "rank5":
        args[0] = q[None]
    elif case == "out_dtype":
        out = torch.full((1, 4, 1, 64), 3.0, dtype=torch.float64)
    elif case == "out_shape":
        out = torch.full((1, 4, 1, 32), 3.0)
    before = out.clone()
    with pytest.raises(ValueError, match=match):
        ops.attention_out(out, *args, **kw)
    assert torch.equal(out, before)
    if case not in ("out_dtype", "out_shape"):
        with pytest.raises(ValueError, match=match):
            ops.attention(*args, **kw)


def test_bad_input_through_kvattn_attention():
    """kvattn.attention on tensors raises KvaError with the library's status."""
    q, k, v = small()
    with pytest.raises(kvattn.KvaError, match="window") as e:
        kvattn.attention(q, k, v, mask="causal", window=-1)
    assert e.value.code == kvattn._capi.EINVAL
    with pytest.raises(kvattn.KvaError, match="multiple of KV heads") as e:
        kvattn.attention(torch.randn(1, 3, 1, 64), k, v)
    assert e.value.code < 0


def test_bad_block_table_and_cache_write():
    q = torch.randn(1, 4, 1, 64)
    pool = torch.zeros(4, 2, 16, 64)
    table = torch.tensor([[0, 9]], dtype=torch.int32)  # block 9 is past the pool
    out = torch.full((1, 4, 1, 64), 3.0)
    with pytest.raises(ValueError, match="block"):
        ops.block_table_attention_out(out, q, pool, pool, table, torch.tensor([20], dtype=torch.int32))
    assert (out == 3).all()
    with pytest.raises(ValueError, match="block_table must be int32"):
        ops.block_table_attention(q, pool, pool, table.long(), torch.tensor([20], dtype=torch.int32))
    with pytest.raises(ValueError, match="innermost stride"):
        ops.block_table_attention(q, pool, pool, torch.zeros(1, 4, dtype=torch.int32)[:, ::2],
                                  torch.tensor([20], dtype=torch.int32))
    k = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match=r"slots must have shape \[3\]"):
        ops.cache_write(pool, pool.clone(), k, k, torch.zeros(2, dtype=torch.int32))
    before = pool.clone()
    with pytest.raises(ValueError, match="slot"):
        ops.cache_write(pool, pool.clone(), k, k, torch.tensor([0, 1, 4 * 16], dtype=torch.int32))
    assert torch.equal(pool, before)
    with pytest.raises(NotImplementedError):  # no tensor to dispatch on: torch's dispatcher refuses
        ops.merge_states([], [])
    with pytest.raises(ValueError, match="R = 0|empty"):
        kvattn.merge_states([])
    with pytest.raises(ValueError, match="one lse per part"):
        ops.merge_states([torch.zeros(1, 1, 1, 8)], [])


# -------------------------------------------------------------------- CUDA
cuda_only = pytest.mark.skipif(not CUDA, reason="no CUDA device")


def cuda_case(rng, bits, L=1, rep=4, B=2, KVH=2, N=300, D=128):
    q, k, v = make_case(rng, B, KVH * rep, KVH, L, N, D, D, BF16, BF16, bits, 64)
    kd, vd, kvkw = kv_kwargs(k, v, bits, 64, "cuda")
    return q, k, v, to_torch(q, "cuda"), kd, vd, kvkw


def cuda_bound(ref):
    """Both the CUDA kernel and the CPU reference path may round to 16-bit products."""
    return 2 * UNIT_ROUNDOFF[BF16] * np.abs(ref) + 2 * BF16_PRODUCTS_ATOL * np.abs(ref).max()


@cuda_only
@pytest.mark.parametrize("bits,L,rep", [(0, 1, 4), (4, 1, 4), (4, 8, 6), (8, 3, 1)])
def test_cuda_attention_vs_cpu(request, bits, L, rep):
    rng = rng_for(request)
    q, k, v, qc, kd, vd, kvkw = cuda_case(rng, bits, L, rep)
    out = ops.attention(qc, kd, vd, causal=True, **kvkw)
    torch.cuda.synchronize()
    assert out.is_cuda and out.dtype == torch.bfloat16
    ref = ref_attention(q, k, v, mask="causal", group_size=64, bits=bits)
    got = to_numpy(out).astype(np.float64)
    assert (np.abs(got - ref) <= cuda_bound(ref)).all(), float(np.abs(got - ref).max())
    w = kvattn.attention(qc, (kd, kvkw["k_scales"], kvkw["k_biases"]) if bits else kd,
                         (vd, kvkw["v_scales"], kvkw["v_biases"]) if bits else vd, mask="causal", bits=bits)
    assert torch.equal(w, out)


@cuda_only
def test_cuda_current_stream_and_graph_capture(request):
    """The op runs on the current stream (a capture on a side stream would
    fail otherwise) and replays in a CUDA graph: new q values and lengths
    written in place before replay give the eager result."""
    rng = rng_for(request)
    q, k, v, qc, kd, vd, kvkw = cuda_case(rng, 4)
    lens = torch.tensor([300, 120], dtype=torch.int32, device="cuda")
    out = torch.empty_like(qc)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up on the side stream (workspace, kernel attributes)
            ops.attention_out(out, qc, kd, vd, causal=True, seq_lens=lens, **kvkw)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.attention_out(out, qc, kd, vd, causal=True, seq_lens=lens, **kvkw)
    qc.copy_(to_torch(randn(rng, q.shape, BF16), "cuda"))
    lens.copy_(torch.tensor([77, 299], dtype=torch.int32))
    g.replay()
    want = ops.attention(qc, kd, vd, causal=True, seq_lens=lens, **kvkw)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    # merge and cache write captured too
    o1, l1 = ops.attention_lse(qc, kd, vd, causal=True, seq_lens=lens, **kvkw)
    mo, ml = torch.empty_like(o1), torch.empty_like(l1)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        ops.merge_states_out(mo, ml, [o1, o1], [l1, l1])
    g2.replay()
    torch.cuda.synchronize()
    assert torch.allclose(mo.float(), o1.float(), atol=2 * UNIT_ROUNDOFF[BF16] * float(o1.abs().max()), rtol=0)


@cuda_only
def test_cuda_stream_order(request):
    """Work queued on a side stream before the op (a long sleep, then the
    K/V fill) is seen by the op on that stream."""
    rng = rng_for(request)
    q, k, v, qc, kd, vd, kvkw = cuda_case(rng, 0)
    k2, v2 = torch.zeros_like(kd), torch.zeros_like(vd)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        k2.copy_(kd)
        v2.copy_(vd)
        out = ops.attention(qc, k2, v2, causal=True)
    s.synchronize()
    assert torch.equal(out, ops.attention(qc, kd, vd, causal=True))


@cuda_only
def test_cuda_compile(request):
    rng = rng_for(request)
    q, k, v, qc, kd, vd, kvkw = cuda_case(rng, 4)

    def f(q, out):
        torch.ops.kvattn.attention_out(out, q, kd, vd, causal=True, **kvkw)
        return torch.ops.kvattn.attention(q, kd, vd, causal=True, **kvkw) * 2

    torch._dynamo.reset()
    out_c, out_e = torch.empty_like(qc), torch.empty_like(qc)
    with torch._inductor.config.patch(fx_graph_cache=False):
        got = torch.compile(f, fullgraph=True)(qc, out_c)
    want = f(qc, out_e)
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(out_c, out_e)
    torch._dynamo.reset()
    g = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        got = g(qc, out_c)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@cuda_only
def test_cuda_bad_devices(request):
    rng = rng_for(request)
    q, k, v, qc, kd, vd, kvkw = cuda_case(rng, 0)
    out = torch.full_like(qc, 3.0)
    with pytest.raises(ValueError, match="a CPU tensor in a CUDA call"):
        ops.attention_out(out, qc, kd.cpu(), vd, causal=True)
    with pytest.raises(ValueError, match="sinks is on cpu"):
        ops.attention_out(out, qc, kd, vd, sinks=torch.zeros(qc.shape[1]))
    with pytest.raises(ValueError, match="out is on cpu"):
        ops.attention_out(out.cpu(), qc, kd, vd)
    with pytest.raises(ValueError, match="seq_lens is on cpu"):
        ops.attention_out(out, qc, kd, vd, seq_lens=torch.tensor([5, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="stride"):
        ops.attention_out(out, qc, torch.zeros(2, 2, 300, 256, dtype=torch.bfloat16, device="cuda")[..., ::2], vd)
    torch.cuda.synchronize()
    assert (out == 3).all()
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="cuda:1"):
            ops.attention_out(out, qc, kd.to("cuda:1"), vd)


# ------------------------------------------------------ eager entry points
def eager_args(q, k, v, **o):
    """The eager entry points' positional options (the operators' schema order)."""
    d = dict(causal=False, k_scales=None, k_biases=None, v_scales=None, v_biases=None, bits=0, group_size=64,
             window=0, scale=None, softcap=None, sinks=None, segments=None, clamp=False, mask=None, exact=False)
    d.update(o)
    return (q, k, v) + tuple(d.values())


def test_eager_entry_points(request):
    """kvattn.torch_ops.eager(): the operators' results bit for bit on plain
    tensors, their errors (ValueError, out untouched), NotImplemented for
    fake tensors and under a dispatch mode."""
    E = torch_ops.eager()
    assert E is not None
    rng = rng_for(request)
    q, k, v = make_case(rng, 2, 8, 2, 3, 90, 128, 128, BF16, BF16, 4, 64)
    kd, vd, kvkw = kv_kwargs(k, v, 4, 64)
    qt = to_torch(q)
    lens = torch.tensor([90, 41], dtype=torch.int32)
    want = ops.attention(qt, kd, vd, causal=True, window=30, seq_lens=lens, **kvkw)
    got = E.attention(*eager_args(qt, kd, vd, causal=True, window=30, **kvkw), lens)
    assert torch.equal(got, want)
    out = torch.empty_like(want)
    assert E.attention_out(out, *eager_args(qt, kd, vd, causal=True, window=30, **kvkw), lens) is None
    assert torch.equal(out, want)
    # block tables
    kp, vp, table = scatter_to_pools(rng, k, v, 16)
    kpd, vpd, pkw = kv_kwargs(kp, vp, 4, 64)
    bl = torch.tensor([90, 41], dtype=torch.int32)
    want_b = ops.block_table_attention(qt, kpd, vpd, to_torch(table), bl, None, causal=True, **pkw)
    opts = eager_args(None, None, None, causal=True, **pkw)[3:]
    assert torch.equal(E.block_table_attention(qt, kpd, vpd, to_torch(table), bl, None, *opts), want_b)
    out_b = torch.empty_like(want_b)
    E.block_table_attention_out(out_b, qt, kpd, vpd, to_torch(table), bl, None, *opts)
    assert torch.equal(out_b, want_b)
    # errors
    out.fill_(3)
    with pytest.raises(ValueError, match="window"):
        E.attention_out(out, *eager_args(qt, kd, vd, causal=True, window=-3, **kvkw), None)
    assert (out == 3).all()
    with pytest.raises(ValueError, match="k.data is packed"):
        E.attention(*eager_args(qt, kd, vd, bits=4), None)
    with pytest.raises(TypeError, match="positional arguments"):
        E.attention(qt, kd, vd)
    # not served here: the caller takes the operator
    assert E.attention(*eager_args(qt, kd, vd, causal=1, **kvkw), None) is NotImplemented  # not a bool
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    with FakeTensorMode():
        f = torch.empty(1, 4, 1, 64)
        assert E.attention(*eager_args(f, f, f), None) is NotImplemented

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        assert E.attention(*eager_args(qt, kd, vd, **kvkw), None) is NotImplemented
        r = kvattn.attention(qt, tuple(to_torch(a) for a in k), tuple(to_torch(a) for a in v), mask="causal")
    assert Count.calls >= 1 and torch.equal(r, ops.attention(qt, kd, vd, causal=True, **kvkw))


def test_kvattn_attention_under_compile(request):
    """kvattn.attention itself inside torch.compile(fullgraph=True): traced
    through the operators (the eager entry points are skipped while compiling)."""
    rng = rng_for(request)
    q, k, v = make_case(rng, 1, 8, 2, 1, 70, 64, 64, F32, F32)
    qt, kt, vt = to_torch(q), to_torch(k), to_torch(v)

    def f(q, out):
        a = kvattn.attention(q, kt, vt, mask="causal", window=40)
        kvattn.attention(q * 2, kt, vt, mask="causal", out=out)
        return a

    torch._dynamo.reset()
    out_c, out_e = torch.empty_like(qt), torch.empty_like(qt)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(qt, out_c)
    want = f(qt, out_e)
    assert torch.equal(got, want) and torch.equal(out_c, out_e)


# ------------------------------------------------------ threads and fork()
def test_threads_share_the_cpu_context(request):
    """Calls from several Python threads at once (the GIL released in the
    eager entry points and in the dispatcher): each result equals the
    single-threaded one."""
    import threading

    rng = rng_for(request)
    cases = [make_case(rng, 1, 8, 2, 2, 300, 64, 64, F32, F32, 4, 64) for _ in range(4)]
    args = []
    for q, k, v in cases:
        kd, vd, kvkw = kv_kwargs(k, v, 4, 64)
        args.append((to_torch(q), kd, vd, kvkw))
    want = [ops.attention(q, kd, vd, causal=True, **kw) for q, kd, vd, kw in args]
    got = [None] * len(args)

    def work(i):
        q, kd, vd, kw = args[i]
        for _ in range(20):
            r = kvattn.attention(q, (kd, kw["k_scales"], kw["k_biases"]), (vd, kw["v_scales"], kw["v_biases"]),
                                 mask="causal")
            o = ops.attention(q, kd, vd, causal=True, **kw)
            if not (torch.equal(r, want[i]) and torch.equal(o, want[i])):
                return
        got[i] = True

    ts = [threading.Thread(target=work, args=(i,)) for i in range(len(args))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert got == [True] * len(args)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fork_child_uses_the_cpu_context(request):
    """A child fork()ed after the parent used the CPU context (its workers
    started) gets the parent's result bit for bit."""
    import multiprocessing
    import os

    if not hasattr(os, "fork"):
        pytest.skip("no fork()")
    rng = rng_for(request)
    q, k, v = make_case(rng, 1, 8, 2, 1, 500, 64, 64, F32, F32)
    qt, kt, vt = to_torch(q), to_torch(k), to_torch(v)
    want = ops.attention(qt, kt, vt, causal=True)
    mp = multiprocessing.get_context("fork")
    recv, send = mp.Pipe(duplex=False)

    def child():
        try:
            send.send(("ok", to_numpy(ops.attention(qt, kt, vt, causal=True)).tobytes()))
        except BaseException as e:  # reported to the parent
            send.send(("error", repr(e)))

    p = mp.Process(target=child)
    p.start()
    try:
        assert recv.poll(60), "the fork()ed child did not answer (hung)"
        status, payload = recv.recv()
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    assert status == "ok", payload
    assert payload == to_numpy(want).tobytes()


def test_compile_dynamic_shapes(request):
    """torch.compile(dynamic=True): the meta kernels on symbolic sizes (batch,
    heads, rows, cache length and head dim symbolic); two shapes, one graph."""
    rng = rng_for(request)

    def f(q, kp, ks, kb):
        o = torch.ops.kvattn.attention(q, kp, kp, k_scales=ks, k_biases=kb, v_scales=ks, v_biases=kb, bits=4,
                                       causal=True)
        o2, lse = torch.ops.kvattn.attention_lse(q, kp, kp, k_scales=ks, k_biases=kb, v_scales=ks, v_biases=kb,
                                                 bits=4)
        m, ml = torch.ops.kvattn.merge_states([o2, o2], [lse, lse])
        return o + m, ml

    torch._dynamo.reset()
    g = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for B, H, KVH, L, N in ((3, 6, 2, 5, 70), (4, 12, 2, 6, 130)):  # distinct sizes > 1 (0, 1 and equal sizes specialize)
            q, k, v = make_case(rng, B, H, KVH, L, N, 64, 64, F32, F32, 4, 64)
            args = (to_torch(q), to_torch(k[0]), to_torch(k[1]), to_torch(k[2]))
            got, want = g(*args), f(*args)
            assert got[0].shape == (B, H, L, 64) and got[1].shape == (B, H, L)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
