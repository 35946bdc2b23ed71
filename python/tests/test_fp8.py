"""fp8 K/V in the Python binding: kvattn.attention over ml_dtypes float8_e4m3fn /
float8_e5m2 caches with k_scale / v_scale (None, a number, per-(token, head)
arrays) against the float64 reference of kvref.py on the dequantized values
(scale * fp8, decoded by ml_dtypes: independent of the library); cache_write
into fp8 pools against ml_dtypes' and torch's rounding (in range) and the
written scale rule; torch CPU fp8 tensors; bad input."""
import ml_dtypes
import numpy as np
import pytest

import kvattn
from kvref import BF16, F32, assert_close, compute_atol, randn, ref_attention, rng_for

E4 = np.dtype(ml_dtypes.float8_e4m3fn)
E5 = np.dtype(ml_dtypes.float8_e5m2)
FMAX = {E4: 448.0, E5: 57344.0}


def fp8_cache(rng, shape, dt, kind):
    """(codes, scale argument, dequantized float64 values) of a random fp8
    cache [B, KVH, N, D]: kind "token" (per-row scales amax / max, random
    row amplitudes), "tensor" (one float), "none" (scale 1)."""
    amp = 2.0 ** rng.integers(-2, 3, size=shape[:3] + (1,)) if kind != "none" else np.ones(shape[:3] + (1,))
    x = (rng.standard_normal(shape) * amp).astype(np.float32)
    if kind == "token":
        s = (np.abs(x).max(axis=-1) / np.float32(FMAX[dt])).astype(np.float32)
        codes = (x / s[..., None]).astype(dt)
        return codes, s, codes.astype(np.float64) * s[..., None].astype(np.float64)
    if kind == "tensor":
        s = np.float32(4 * 5 / FMAX[dt])
        codes = np.clip(x / s, -FMAX[dt], FMAX[dt]).astype(dt)
        return codes, float(s), codes.astype(np.float64) * float(s)
    codes = x.astype(dt)
    return codes, None, codes.astype(np.float64)


CASES = {
    "decode_e4m3_token": (1, 8, 4, 1, 113, 128, E4, "token", {"mask": "causal"}),
    "decode_e5m2_tensor": (2, 8, 2, 1, 97, 64, E5, "tensor", {"mask": "causal"}),
    "decode_e4m3_none": (1, 4, 4, 1, 50, 64, E4, "none", {}),
    "verify3_e4m3_gqa6": (1, 12, 2, 3, 200, 128, E4, "token", {"mask": "causal"}),
    "verify8_e5m2_window": (1, 8, 4, 8, 300, 64, E5, "token", {"mask": "causal", "window": 20}),
    "verify16_e4m3_softcap_sinks": (2, 4, 2, 16, 80, 64, E4, "token", {"mask": "causal", "softcap": 20.0}),
    "head256_e4m3": (1, 8, 4, 1, 64, 256, E4, "tensor", {"mask": "causal"}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp8_attention_vs_reference(request, name):
    B, H, KVH, L, N, D, dt, kind, kw = CASES[name]
    rng = rng_for(request)
    q = randn(rng, (B, H, L, D), BF16)
    k, ks, kf = fp8_cache(rng, (B, KVH, N, D), dt, kind)
    v, vs, vf = fp8_cache(rng, (B, KVH, N, D), dt, kind)
    if "softcap" in kw:
        kw = dict(kw, sinks=rng.standard_normal(H).astype(np.float32))
    out = kvattn.attention(q, k, v, k_scale=ks, v_scale=vs, **kw)
    assert out.shape == (B, H, L, D) and out.dtype == BF16
    ref = ref_attention(q, kf, vf, **kw)
    assert_close(out, ref, name, compute_atol(q, KVH))
    assert kvattn.attention_kernel(q, k, v, k_scale=ks, v_scale=vs, **kw).endswith("[exact f32]")
    # the library's oracle agrees
    o32 = np.empty((B, H, L, D), np.float32)
    assert_close(kvattn.reference_attention(q, k, v, k_scale=ks, v_scale=vs, out=o32, **kw), ref, name,
                 compute_atol(q, KVH))


def test_fp8_scales_broadcast_and_strided(request):
    """A [B, KVH, 1] scale array broadcast over tokens, and a strided view of a cache."""
    rng = rng_for(request)
    B, H, KVH, N, D = 2, 4, 2, 60, 64
    q = randn(rng, (B, H, 1, D), F32)
    big = (rng.standard_normal((B, KVH, N + 7, D)) * 3).astype(np.float32).astype(E4)
    k = big[:, :, 3:3 + N]
    s = (rng.uniform(0.5, 2.0, (B, KVH, 1))).astype(np.float32)
    out = kvattn.attention(q, k, k, k_scale=s, v_scale=s, mask="causal")
    kf = k.astype(np.float64) * np.broadcast_to(s, (B, KVH, N))[..., None]
    assert_close(out, ref_attention(q, kf, kf, mask="causal"), "broadcast", compute_atol(q, KVH))


def test_fp8_cache_write_rounding(request):
    """Codes of a pool with scale 1 equal ml_dtypes' astype (and torch's .to(),
    when torch imports) for values in range, including ties and subnormals;
    past max they saturate."""
    rng = rng_for(request)
    for dt in (E4, E5):
        n, KVH, D = 40, 2, 64
        codes = np.arange(256, dtype=np.uint8).view(dt).astype(np.float64)
        fin = np.unique(codes[np.isfinite(codes)])
        mids = (fin[:-1] + fin[1:]) / 2
        vals = np.concatenate([fin, mids, rng.standard_normal(n * KVH * D) * FMAX[dt] / 8]).astype(np.float32)
        vals = vals[np.abs(vals) < FMAX[dt]][: n * KVH * D]
        x = np.resize(vals, (n, KVH, D)).astype(np.float32)
        kp = np.zeros((4, KVH, 16, D), dt)
        vp = np.zeros((4, KVH, 16, D), dt)
        slots = np.arange(n, dtype=np.int32)
        kvattn.cache_write(kp, vp, x, x, slots)
        got = np.concatenate([kp[b].transpose(1, 0, 2) for b in range(4)])[:n]  # slot = block * 16 + row
        want = x.astype(dt)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), dt
        try:
            import torch
        except ImportError:
            continue
        tdt = torch.float8_e4m3fn if dt == E4 else torch.float8_e5m2
        tw = torch.from_numpy(x).to(tdt).view(torch.uint8).numpy()
        assert np.array_equal(got.view(np.uint8), tw), dt
        # saturation past max (torch and ml_dtypes give NaN / inf there)
        big = np.full((1, KVH, D), 3 * FMAX[dt], np.float32)
        kvattn.cache_write(kp, vp, big, -big, np.array([63], np.int32))
        assert (kp[3, :, 15].astype(np.float64) == FMAX[dt]).all()
        assert (vp[3, :, 15].astype(np.float64) == -FMAX[dt]).all()


def test_fp8_cache_write_scales(request):
    """Per-row scales: computed as max|x| / max_fp8 and stored; codes of
    x / scale; a fixed scale is read and left as it is."""
    rng = rng_for(request)
    n, KVH, D, nblk, bs = 21, 3, 128, 3, 8
    x = (rng.standard_normal((n, KVH, D)) * 2.0 ** rng.integers(-4, 4, (n, KVH, 1))).astype(np.float32)
    kp = np.zeros((nblk, KVH, bs, D), E4)
    vp = np.zeros((nblk, KVH, bs, D), E5)
    ks = np.full((nblk, KVH, bs), -1.0, np.float32)
    slots = rng.permutation(nblk * bs)[:n].astype(np.int32)
    kvattn.cache_write(kp, vp, x, x, slots, k_scale=ks, v_scale=0.25)
    for i, slot in enumerate(slots):
        b, r = divmod(int(slot), bs)
        s = (np.abs(x[i]).max(axis=-1) / np.float32(448.0)).astype(np.float32)
        assert np.array_equal(ks[b, :, r], s)
        assert np.array_equal(kp[b, :, r].view(np.uint8), (x[i] / s[:, None]).astype(E4).view(np.uint8))
        assert np.array_equal(vp[b, :, r].view(np.uint8), (x[i] / np.float32(0.25)).astype(E5).view(np.uint8))
    for slot in np.setdiff1d(np.arange(nblk * bs), slots):
        assert (ks[slot // bs, :, slot % bs] == -1.0).all()


def test_fp8_torch_cpu_tensors(request):
    torch = pytest.importorskip("torch")
    rng = rng_for(request)
    B, H, KVH, L, N, D = 1, 8, 4, 2, 70, 128
    q = torch.from_numpy(rng.standard_normal((B, H, L, D)).astype(np.float32)).to(torch.bfloat16)
    x = torch.from_numpy((rng.standard_normal((B, KVH, N, D)) * 2).astype(np.float32))
    s = x.abs().amax(-1) / 448.0
    k = (x / s[..., None]).to(torch.float8_e4m3fn)
    v = (x / 2).to(torch.float8_e5m2)
    out = kvattn.attention(q, k, v, mask="causal", k_scale=s, v_scale=None)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (B, H, L, D)
    kf = k.to(torch.float64) * s[..., None].to(torch.float64)
    ref = ref_attention(q.to(torch.float32).numpy(), kf.numpy(), v.to(torch.float64).numpy(), mask="causal")
    assert_close(out.view(torch.int16).numpy().view(BF16), ref, "torch fp8", compute_atol(q, KVH))
    o2 = torch.empty_like(q)
    assert kvattn.attention(q, k, v, mask="causal", k_scale=s, out=o2) is o2
    assert torch.equal(o2, out)


def test_fp8_errors(request):
    rng = rng_for(request)
    q = randn(rng, (1, 4, 1, 64), F32)
    k = (rng.standard_normal((1, 2, 30, 64))).astype(np.float32).astype(E4)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(kvattn.KvaError, match="k.scales") as e:
            kvattn.attention(q, k, k, k_scale=bad, v_scale=1.0)
        assert e.value.code == -1  # KVA_EINVAL
    s = np.ones((1, 2, 30), np.float32)
    s[0, 1, 7] = np.nan
    with pytest.raises(kvattn.KvaError, match="v.scales"):
        kvattn.attention(q, k, k, v_scale=s)
    with pytest.raises(kvattn.KvaError, match="k.scales"):
        kvattn.attention(q, k, k, k_scale=np.ones((1, 3, 30), np.float32))
    with pytest.raises(kvattn.KvaError, match="k_scale is for fp8"):
        kvattn.attention(q, k.astype(np.float32), k, k_scale=1.0)
    with pytest.raises(kvattn.KvaError, match="q"):
        kvattn.attention(q.astype(E4), k, k)
    kp = np.zeros((2, 2, 16, 64), E4)
    x = np.ones((3, 2, 64), np.float32)
    with pytest.raises(kvattn.KvaError, match="k_pool.scales"):
        kvattn.cache_write(kp, kp.copy(), x, x, np.arange(3, dtype=np.int32), k_scale=-2.0)
    assert not kp.view(np.uint8).any()


def _cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or kvattn.cuda_device_count() == 0:
        pytest.skip("no CUDA device (or a CPU-only build)")
    return torch


@pytest.mark.parametrize("L", [1, 8])
def test_fp8_cuda_torch_attention(request, L):
    """torch CUDA fp8 tensors with device scales (per token, per tensor)
    against the float64 reference (K e4m3, V e5m2: formats that differ run
    the general kernel, f32 products)."""
    torch = _cuda_torch()
    rng = rng_for(request)
    B, H, KVH, N, D = 2, 8, 4, 700, 128
    x = torch.from_numpy((rng.standard_normal((B, KVH, N, D)) * 2).astype(np.float32))
    s = x.abs().amax(-1) / 448.0
    k = (x / s[..., None]).to(torch.float8_e4m3fn)
    v = (x / 0.01).to(torch.float8_e5m2)
    q = torch.from_numpy(rng.standard_normal((B, H, L, D)).astype(np.float32)).to(torch.bfloat16)
    out = kvattn.attention(q.cuda(), k.cuda(), v.cuda(), mask="causal", k_scale=s.cuda(), v_scale=0.01)
    torch.cuda.synchronize()
    kf = k.to(torch.float64) * s[..., None].to(torch.float64)
    vf = v.to(torch.float64) * float(np.float32(0.01))
    ref = ref_attention(q.to(torch.float32).numpy(), kf.numpy(), vf.numpy(), mask="causal")
    assert_close(out.cpu().view(torch.int16).numpy().view(BF16), ref, "cuda fp8", compute_atol(q, KVH))


def test_fp8_cuda_cache_write_bits(request):
    """kvattn.cache_write of torch CUDA fp8 pools (per-row scales written on
    the device) equals the CPU write bit for bit."""
    torch = _cuda_torch()
    rng = rng_for(request)
    n, KVH, D, nblk, bs = 37, 4, 128, 5, 16
    x = torch.from_numpy((rng.standard_normal((n, KVH, D)) * 2.0 ** rng.integers(-6, 6, (n, KVH, 1))).astype(
        np.float32)).to(torch.bfloat16)
    slots = torch.from_numpy(rng.permutation(nblk * bs)[:n].astype(np.int32))
    pools = [torch.zeros((nblk, KVH, bs, D), dtype=dt) for dt in (torch.float8_e4m3fn, torch.float8_e5m2)]
    scales = torch.full((nblk, KVH, bs), -1.0)
    kvattn.cache_write(pools[0], pools[1], x, x, slots, k_scale=scales, v_scale=0.5)
    dpools = [torch.zeros_like(p).cuda() for p in pools]
    dscales = torch.full((nblk, KVH, bs), -1.0, device="cuda")
    kvattn.cache_write(dpools[0], dpools[1], x.cuda(), x.cuda(), slots.cuda(), k_scale=dscales, v_scale=0.5)
    torch.cuda.synchronize()
    for p, dp in zip(pools, dpools):
        assert torch.equal(p.view(torch.uint8), dp.cpu().view(torch.uint8))
    assert torch.equal(scales, dscales.cpu())


def test_fp8_block_table_pools(request):
    """fp8 caller pools written by cache_write (per-row scales) read through a
    shuffled block table equal attention over the contiguous cache."""
    rng = rng_for(request)
    B, H, KVH, N, D, bs = 2, 8, 2, 45, 64, 16
    nb = (N + bs - 1) // bs
    x = (rng.standard_normal((B, N, KVH, D)) * 2).astype(np.float32)
    kp = np.zeros((B * nb + 1, KVH, bs, D), E4)
    vp = np.zeros((B * nb + 1, KVH, bs, D), E5)
    ks = np.ones((B * nb + 1, KVH, bs), np.float32)
    vs = np.ones((B * nb + 1, KVH, bs), np.float32)
    perm = rng.permutation(B * nb + 1)[: B * nb].astype(np.int32).reshape(B, nb)
    for b in range(B):
        slots = (perm[b][np.arange(N) // bs] * bs + np.arange(N) % bs).astype(np.int32)
        kvattn.cache_write(kp, vp, x[b], x[b], slots, k_scale=ks, v_scale=vs)
    q = randn(rng, (B, H, 1, D), F32)
    lens = np.full(B, N, np.int32)
    out = kvattn.block_table_attention(q, kp, vp, perm, lens, mask="causal", k_scale=ks, v_scale=vs)
    kf = np.stack([kp[perm[b]].transpose(1, 0, 2, 3).reshape(KVH, nb * bs, D)[:, :N] for b in range(B)])
    ksf = np.stack([ks[perm[b]].transpose(1, 0, 2).reshape(KVH, nb * bs)[:, :N] for b in range(B)])
    vf = np.stack([vp[perm[b]].transpose(1, 0, 2, 3).reshape(KVH, nb * bs, D)[:, :N] for b in range(B)])
    vsf = np.stack([vs[perm[b]].transpose(1, 0, 2).reshape(KVH, nb * bs)[:, :N] for b in range(B)])
    ref = ref_attention(q, kf.astype(np.float64) * ksf[..., None], vf.astype(np.float64) * vsf[..., None],
                        mask="causal")
    assert_close(out, ref, "fp8 block table", compute_atol(q, KVH))
    assert_close(kvattn.attention(q, kf, vf, mask="causal", k_scale=ksf, v_scale=vsf), ref, "contiguous",
                 compute_atol(q, KVH))
