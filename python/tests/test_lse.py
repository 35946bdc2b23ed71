"""kvattn.attention(..., return_lse=True) and kvattn.merge_states against the
float64 numpy reference of kvref.py: lse over masks, softcap, sinks, ragged
lengths, rows without keys, base 2; merging attention over disjoint key
ranges equals one call over all keys."""
import math

import numpy as np
import pytest

import kvattn
from kvref import F32, assert_close, randn, ref_attention, rng_for

LSE_RTOL = 1e-5  # f32 rounding of m + log l, relative to max(1, |lse|)


def assert_lse(got, ref, what=""):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    inf = np.isinf(ref)
    assert (np.isinf(got) == inf).all() and (got[inf] == ref[inf]).all(), what
    err = np.abs(got[~inf] - ref[~inf]) / np.maximum(1.0, np.abs(ref[~inf]))
    assert err.size == 0 or err.max() <= LSE_RTOL, "%s: lse err %.3g" % (what, err.max())


@pytest.mark.parametrize("kw", [
    dict(),
    dict(mask="causal"),
    dict(mask="causal", window=7),
    dict(mask="causal", softcap=20.0),
    dict(sinks=True),
    dict(mask="causal", seq_lens=[40, 23]),
    dict(mask="additive"),
    dict(lse_base2=True, mask="causal"),
])
def test_lse_matches_reference(request, kw):
    kw = dict(kw)
    rng = rng_for(request)
    B, H, KVH, L, N, D = 2, 8, 4, 3, 40, 64
    q = randn(rng, (B, H, L, D), F32)
    k = randn(rng, (B, KVH, N, D), F32)
    v = randn(rng, (B, KVH, N, D), F32)
    if kw.pop("sinks", False):
        kw["sinks"] = randn(rng, (H,), F32)
    if kw.get("mask") == "additive":
        kw["mask"] = randn(rng, (B, 1, L, N), F32)
    base2 = kw.pop("lse_base2", False)
    out, lse = kvattn.attention(q, k, v, return_lse=True, lse_base2=base2, **kw)
    assert lse.shape == (B, H, L) and lse.dtype == np.float32
    ref, ref_lse = ref_attention(q, k, v, return_lse=True, **kw)
    assert_close(out, ref, "out")
    assert_lse(lse.astype(np.float64) * (math.log(2) if base2 else 1.0), ref_lse, "lse")


def test_lse_row_without_keys(request):
    rng = rng_for(request)
    q = randn(rng, (1, 2, 3, 64), F32)
    k = randn(rng, (1, 1, 20, 64), F32)
    v = randn(rng, (1, 1, 20, 64), F32)
    mask = np.ones((1, 2, 3, 20), bool)
    mask[0, 1, 2] = False
    out, lse = kvattn.attention(q, k, v, mask=mask, sinks=randn(rng, (2,), F32), return_lse=True)
    assert lse[0, 1, 2] == -np.inf and (out[0, 1, 2] == 0).all()
    assert np.isfinite(lse[0, 0]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_merge_equals_one_call(request, causal):
    rng = rng_for(request)
    B, H, KVH, L, N, D = 2, 8, 2, 4, 300, 64
    q = randn(rng, (B, H, L, D), F32)
    k = randn(rng, (B, KVH, N, D), F32)
    v = randn(rng, (B, KVH, N, D), F32)
    sinks = randn(rng, (H,), F32)
    mask = "causal" if causal else None
    full, full_lse = kvattn.attention(q, k, v, mask=mask, sinks=sinks, return_lse=True)
    cuts = [0, 100, 104, 211, N]
    parts = []
    for r in range(len(cuts) - 1):
        last = r == len(cuts) - 2
        # earlier parts: every row sees all their keys; the last part's positions line up (causal)
        parts.append(kvattn.attention(q, k[:, :, cuts[r]:cuts[r + 1]], v[:, :, cuts[r]:cuts[r + 1]],
                                      mask=mask if last else None, sinks=sinks if r == 0 else None,
                                      return_lse=True))
    out, lse = kvattn.merge_states(parts)
    ref, ref_lse = ref_attention(q, k, v, mask=mask, sinks=sinks, return_lse=True)
    assert_close(out, ref, "merged out")
    assert_close(out, full.astype(np.float64), "merged out against one call")
    assert_lse(lse, ref_lse, "merged lse")
    err = np.abs(lse.astype(np.float64) - full_lse) / np.maximum(1.0, np.abs(full_lse))
    assert err.max() <= LSE_RTOL
    # another grouping and order agree
    a, la = kvattn.merge_states(parts[:2])
    b, lb = kvattn.merge_states(parts[2:][::-1])
    out2, lse2 = kvattn.merge_states([(b, lb), (a, la)])
    assert np.abs(out2 - out).max() <= 1e-5 * max(1.0, np.abs(out).max())
    assert np.abs(lse2 - lse).max() <= LSE_RTOL * max(1.0, np.abs(lse).max())


def test_merge_empty_and_errors(request):
    rng = rng_for(request)
    o = randn(rng, (1, 2, 3, 64), F32)
    lse = randn(rng, (1, 2, 3), F32)
    empty = np.full((1, 2, 3), -np.inf, np.float32)
    out, l = kvattn.merge_states([(o, lse), (randn(rng, (1, 2, 3, 64), F32), empty)])
    assert (out == o).all() and (l == lse).all()
    out, l = kvattn.merge_states([(o, empty)])
    assert (out == 0).all() and (l == -np.inf).all()
    with pytest.raises(ValueError, match="parts_o\\[1\\]"):
        kvattn.merge_states([(o, lse), (o[..., :32], lse)])
    with pytest.raises(ValueError, match="parts_lse\\[0\\]"):
        kvattn.merge_states([(o, lse.astype(np.float16))])
    with pytest.raises(ValueError, match="R = 0"):
        kvattn.merge_states([])
