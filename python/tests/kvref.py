"""Test helpers written from docs/ alone, independent of the library (and
of its C oracle): a float64 numpy attention, MLX's affine quantize and
dequantize as written in docs/mlx-format.md (f32 arithmetic emulated with numpy
float32), and tolerance checks."""
import math

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
FLOATS = (F32, F16, BF16)
WORD_BITS = 32
QUANT_EPS = np.float32(1e-7)  # MLX's floor on the scale

# Unit roundoff (half an ulp, relative) of each output dtype.
UNIT_ROUNDOFF = {F32: 2.0**-24, F16: 2.0**-11, BF16: 2.0**-8}
# Absolute error allowed for the f32 computation itself (accumulation order,
# exp, the quantized algebra), for values of order 1 (scaled by max|ref|);
# measured on these tests: under 5e-7.
COMPUTE_ATOL = 2e-6
# bf16 products: the library may compute with K, V and P rounded to bf16
# (2^-9 relative each, f32 accumulation) when q is bf16 and a KV head has
# >= 6 query vectors (the AMX kernel on the CPU).
BF16_PRODUCTS_ATOL = 2.0**-7


# "P int16" (kvattn.h: the CPU AVX-512 and AVX2 kernels over 4-bit / 8-bit
# V): p times the V group scale rounded to s16 per
# (query vector, tile of 32 keys, group), each weight within 1 / 32767.5 of the
# tile's largest: |out error| <= 2^-10 |s| (2^bits - 1) <= 2^-9 max|v|, the
# form of the bf16-P bound, with the same 4x margin.
PINT16_ATOL = 2.0**-8


def compute_atol(q, kv_heads, kernel=None):
    """The arithmetic allowance for a call with queries q [B, H, L, D] (kernel:
    the name kvattn.attention_kernel gives for it, when known: its "P int16"
    or "V,P bf16")."""
    B, H, L, _ = q.shape
    atol = BF16_PRODUCTS_ATOL if q.dtype == BF16 and (H // kv_heads) * L >= 6 else COMPUTE_ATOL
    bracket = kernel[kernel.rfind("["):] if kernel is not None else ""
    if "P int16" in bracket:
        atol = max(atol, PINT16_ATOL)
    if "V,P bf16" in bracket:  # the CPU AVX-512 4-bit V dequantized to bf16, P bf16 (not modelled here)
        atol = max(atol, BF16_PRODUCTS_ATOL)
    return atol


def kernel_atol(q, k, v, kv_heads, **kw):
    """compute_atol for the kernel kvattn.attention(q, k, v, **kw) takes."""
    import kvattn

    kw.pop("out", None)
    return compute_atol(q, kv_heads, kvattn.attention_kernel(q, k, v, **kw))


def rng_for(request_or_name, salt=0):
    """A generator per test, seeded from the test's id (parameters included),
    `salt`, and $KVATTN_TEST_SEED (default 0): reproducible, and a new seed
    gives every test fresh values (as the C tests' --seed)."""
    import os
    import zlib

    name = getattr(getattr(request_or_name, "node", None), "nodeid", str(request_or_name))
    base = int(os.environ.get("KVATTN_TEST_SEED", "0") or 0)
    return np.random.default_rng([zlib.crc32(name.encode()), base, salt])


def randn(rng, shape, dtype=F32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


# ------------------------------------------------------------ quantization


def np_quantize(w, group_size, bits):
    """MLX's CPU affine quantize (docs/mlx-format.md), every step in float32:
    returns (packed u32 [..., D*bits/32], scales, biases [..., D/g] in w's dtype)."""
    w = np.asarray(w)
    lead, d = w.shape[:-1], w.shape[-1]
    g = w.astype(np.float32).reshape(-1, group_size)
    n_bins = np.float32(2**bits - 1)
    wmin, wmax = g.min(axis=1), g.max(axis=1)
    min_edge = np.abs(wmin) > np.abs(wmax)
    scale = np.maximum((wmax - wmin) / n_bins, QUANT_EPS)
    scale = np.where(min_edge, scale, -scale).astype(np.float32)
    edge = np.where(min_edge, wmin, wmax).astype(np.float32)
    q0 = np.rint(edge / scale)
    nz = q0 != 0
    scale = np.where(nz, edge / np.where(nz, q0, np.float32(1)), scale).astype(np.float32)
    bias = np.where(nz, edge, np.float32(0)).astype(np.float32)
    q = np.rint((g - bias[:, None]) / scale[:, None])
    q = np.clip(q, 0, n_bins).astype(np.uint32)
    per_word = WORD_BITS // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    words = np.bitwise_or.reduce(q.reshape(-1, per_word) << shifts, axis=1).astype(np.uint32)
    packed = words.reshape(lead + (d * bits // WORD_BITS,))
    sdt = w.dtype
    return (packed, scale.astype(sdt).reshape(lead + (d // group_size,)),
            bias.astype(sdt).reshape(lead + (d // group_size,)))


def unpack(packed, bits):
    """Codes [..., D] (uint32) of packed words [..., D*bits/32], lowest bits first."""
    packed = np.asarray(packed, dtype=np.uint32)
    per_word = WORD_BITS // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    codes = (packed[..., None] >> shifts) & np.uint32(2**bits - 1)
    return codes.reshape(packed.shape[:-1] + (packed.shape[-1] * per_word,))


def np_dequantize_mlx(packed, scales, biases, group_size, bits):
    """MLX's dequantize: q*scale rounded to the scales' dtype T, then + bias in T."""
    t = scales.dtype
    q = unpack(packed, bits).astype(t)
    s = np.repeat(scales, group_size, axis=-1)
    b = np.repeat(biases, group_size, axis=-1)
    return (q * s).astype(t) + b


def np_dequantize_exact(packed, scales, biases, group_size, bits):
    """The real value scale*q + bias in float64 (what a quantized cache means)."""
    q = unpack(packed, bits).astype(np.float64)
    s = np.repeat(np.asarray(scales, dtype=np.float64), group_size, axis=-1)
    b = np.repeat(np.asarray(biases, dtype=np.float64), group_size, axis=-1)
    return q * s + b


def as_f64(x, group_size=None, bits=None):
    """Logical float64 values of a float array or a (packed, scales, biases) tuple."""
    if isinstance(x, tuple):
        return np_dequantize_exact(*x, group_size=group_size, bits=bits)
    return np.asarray(x).astype(np.float64)


# ---------------------------------------------------------------- attention


def causal_visible(n_keys, positions, window=None, seg=None, clamp=False):
    """Bool [len(positions), n_keys] of docs/semantics.md's causal family."""
    t = np.arange(n_keys)[None, :]
    p = np.asarray(positions)[:, None]
    in_window = np.ones_like(t > p) if window is None else (t > p - window)
    vis = (t <= p) & in_window
    if seg is not None:
        seg = np.asarray(seg)
        same = (seg[t] == seg[p]) & (seg[t] != 0)
        if clamp:
            same &= in_window
        vis |= same
    return vis


def query_rounding_bits(kernel_name):
    """N of a "q intN" item with N <= 8 in a kernel name's trailing bracket
    (the query rounding the reference models: round_query), else 0."""
    import re

    m = re.search(r"\[([^\]]*)\]$", kernel_name)
    for item in (m.group(1).split(", ") if m else []):
        mm = re.fullmatch(r"q int(\d+)", item)
        if mm and int(mm.group(1)) <= 8:
            return int(mm.group(1))
    return 0


def round_query(q, group, bits):
    """q rounded as docs/precision.md says ("q intN", kvattn.h
    kva_ref_rounding), in float32 arithmetic on q as loaded, per group of
    `group` dims: sigma = max|q| / (2^(bits-1) - 1), c = rint(q * (1 /
    sigma)) clamped, q' = c * sigma (float64); a group holding a NaN or Inf,
    or whose 1 / sigma overflows, stays as it is."""
    x = np.asarray(q).astype(np.float32)
    out = x.astype(np.float64)
    lv = np.float32(2 ** (bits - 1) - 1)
    D = x.shape[-1]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        for g0 in range(0, D, group):
            xg = x[..., g0:g0 + group]
            amax = np.abs(xg).max(axis=-1, keepdims=True)
            sig = (amax / lv).astype(np.float32)
            inv = np.where(sig > 0, np.float32(1) / sig, np.float32(0)).astype(np.float32)
            keep = np.isfinite(xg).all(axis=-1, keepdims=True) & np.isfinite(inv)
            c = np.clip(np.rint((xg * inv).astype(np.float32)), -lv, lv)
            out[..., g0:g0 + group] = np.where(keep, c.astype(np.float64) * sig.astype(np.float64),
                                                 xg.astype(np.float64))
    return out


def ref_for_kernel(q, k, v, threads=None, context=None, exact=False, **kw):
    """ref_attention(q, k, v, **kw) with the query rounding of the kernel
    kvattn.attention(q, k, v, threads=threads, context=context, exact=exact,
    **kw) takes (its name's bracket: query_rounding_bits)."""
    import kvattn

    name = kvattn.attention_kernel(q, k, v, threads=threads, context=context, exact=exact, **kw)
    kw.pop("out", None)
    return ref_attention(q, k, v, q_int_bits=query_rounding_bits(name), **kw)


def ref_attention(q, k, v, scale=None, mask=None, window=None, segments=None, clamp=False, softcap=None,
                  sinks=None, seq_lens=None, group_size=64, bits=4, return_lse=False, q_int_bits=0):
    """Naive float64 attention. q [B, H, L, Dk]; k/v float arrays or quantized
    tuples; mask None / "causal" / array broadcastable to [B, H, L, N].
    return_lse: (out, lse), lse [B, H, L] = log of the softmax denominator
    (sink included), -inf for a row that sees no key. q_int_bits: the query
    first rounded per K group (the whole row for float K) as round_query."""
    if q_int_bits:
        q = round_query(q, group_size if isinstance(k, tuple) else np.asarray(q).shape[-1], q_int_bits)
    q = as_f64(q)
    k = as_f64(k, group_size, bits)
    v = as_f64(v, group_size, bits)
    B, H, L, Dk = q.shape
    KVH, N = k.shape[1], k.shape[2]
    rep = H // KVH
    scale = 1.0 / math.sqrt(Dk) if scale is None else float(scale)
    marr = None
    if mask is not None and not isinstance(mask, str):
        marr = np.asarray(mask)
        marr = np.broadcast_to(marr.reshape((1,) * (4 - marr.ndim) + marr.shape), (B, H, L, N))
    if segments is not None:
        segments = np.asarray(segments).reshape(B, N)
    out = np.zeros((B, H, L, v.shape[3]))
    lse = np.full((B, H, L), -np.inf)
    for b in range(B):
        n = N if seq_lens is None else int(seq_lens[b])
        pos = n - L + np.arange(L)
        for h in range(H):
            hk = h // rep
            s = scale * (q[b, h] @ k[b, hk, :n].T)
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            vis = np.ones((L, n), bool)
            if isinstance(mask, str):
                vis = causal_visible(n, pos, window, None if segments is None else segments[b], clamp)
            elif marr is not None:
                mb = marr[b, h, :, :n]
                if mb.dtype == np.bool_:
                    vis = mb.copy()
                else:
                    s = s + mb.astype(np.float64)
            s = np.where(vis, s, -np.inf)
            for i in range(L):
                row = s[i]
                if not np.isfinite(row).any():
                    continue  # a row that sees no key: zeros
                m = row.max()
                sink = None if sinks is None else float(np.float32(sinks[h]))
                if sink is not None:
                    m = max(m, sink)
                e = np.exp(row - m)
                den = e.sum() + (0.0 if sink is None else math.exp(sink - m))
                out[b, h, i] = (e @ v[b, hk, :n]) / den
                lse[b, h, i] = m + math.log(den)
    return (out, lse) if return_lse else out


def assert_close(out, ref, what="", atol=COMPUTE_ATOL):
    """|out - ref| <= u*|ref| + atol*max(1, |ref|max), u the output dtype's
    unit roundoff, atol the arithmetic's allowance (compute_atol); NaN/Inf
    are failures. Reports the worst element."""
    out = np.asarray(out)
    got = out.astype(np.float64)
    assert np.isfinite(got).all(), "%s: non-finite outputs at %s" % (what, np.argwhere(~np.isfinite(got))[:5])
    u = UNIT_ROUNDOFF[out.dtype]
    atol = atol * max(1.0, float(np.abs(ref).max()))
    err = np.abs(got - ref)
    bound = u * np.abs(ref) + atol
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), "%s: %d elements out of tolerance; worst at %s: got %r, want %r (err %.3g > %.3g)" % (
        what, int((err > bound).sum()), tuple(int(i) for i in worst), float(got[worst]), float(ref[worst]),
        float(err[worst]), float(bound[worst]))
