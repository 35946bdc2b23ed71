"""kvattn.causal_mask / image_mask against numpy constructions of the seed's
createCausalMask and bidirMask, and the segment mask of attention() against
the same matrices passed as explicit arrays."""
import numpy as np
import pytest

import kvattn
from kvref import assert_close, randn, ref_attention, rng_for


def seed_causal_mask(n, offset, window=None):
    """The seed's createCausalMask: linds = offset..offset+n-1 (rows),
    rinds = 0..offset+n-1 (columns); mask = linds >= rinds [and linds < rinds + window]."""
    linds = np.arange(offset, offset + n)[:, None]
    rinds = np.arange(offset + n)[None, :]
    mask = linds >= rinds
    if window is not None:
        mask &= linds < rinds + window
    return mask


def seed_bidir_mask(n, window, bidir):
    """The seed's bidirMask: causal(n, 0, window) OR outer(bidir, bidir)."""
    bidir = np.asarray(bidir, bool)
    return seed_causal_mask(n, 0, window) | (bidir[:, None] & bidir[None, :])


@pytest.mark.parametrize("n,offset", [(1, 0), (1, 9), (5, 0), (7, 13), (32, 100)])
@pytest.mark.parametrize("window", [None, 1, 3, 50])
def test_causal_mask(n, offset, window):
    got = kvattn.causal_mask(n, offset, window=window)
    assert got.dtype == np.bool_ and got.shape == (n, offset + n)
    np.testing.assert_array_equal(got, seed_causal_mask(n, offset, window))


@pytest.mark.parametrize("window", [None, 2, 6])
def test_single_image_is_seed_bidir_mask(request, window):
    rng = rng_for(request)
    n = 40
    for start, length in [(0, 5), (10, 17), (25, 15), (3, 1)]:
        seg = np.zeros(n, np.int32)
        seg[start:start + length] = 1
        got = kvattn.image_mask(seg, window=window)
        np.testing.assert_array_equal(got, seed_bidir_mask(n, window, seg != 0))
    # an arbitrary (non-contiguous) bidir set of one image id
    bidir = rng.random(n) < 0.3
    got = kvattn.image_mask(bidir.astype(np.int64), window=window)
    np.testing.assert_array_equal(got, seed_bidir_mask(n, window, bidir))
    np.testing.assert_array_equal(kvattn.image_mask(bidir, window=window), got)  # bool = one image


def numpy_image_mask(seg, window=None, clamp=False):
    seg = np.asarray(seg)
    n = len(seg)
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    in_window = np.ones((n, n), bool) if window is None else (j > i - window)
    causal = (j <= i) & in_window
    same = (seg[:, None] == seg[None, :]) & (seg[None, :] != 0)
    if clamp:
        same &= in_window
    return causal | same


@pytest.mark.parametrize("clamp", [False, True])
@pytest.mark.parametrize("window", [None, 1, 4, 30])
def test_several_images(clamp, window):
    seg = np.zeros(50, np.int32)
    seg[3:9] = 1
    seg[12:30] = 2
    seg[40:47] = 3
    got = kvattn.image_mask(seg, window=window, clamp=clamp)
    np.testing.assert_array_equal(got, numpy_image_mask(seg, window, clamp))
    # an image never sees a later one
    assert not got[5, 20] and not got[20, 42]
    # strided segments are read in place
    wide = np.zeros((50, 3), np.int32)
    wide[:, 1] = seg
    np.testing.assert_array_equal(kvattn.image_mask(wide[:, 1], window=window, clamp=clamp), got)


@pytest.mark.parametrize("window,clamp", [(None, False), (6, False), (6, True)])
def test_segments_equal_image_mask_array(request, window, clamp):
    """Prefill (L = N): attention with segments equals attention with
    image_mask(...) passed as a bool array, and the numpy reference."""
    rng = rng_for(request)
    N, H, KVH, D = 36, 4, 2, 64
    seg = np.zeros(N, np.int32)
    seg[4:15] = 1
    seg[20:33] = 2
    q = randn(rng, (1, H, N, D))
    k, v = randn(rng, (1, KVH, N, D)), randn(rng, (1, KVH, N, D))
    a = kvattn.attention(q, k, v, mask="causal", window=window, segments=seg, clamp=clamp)
    b = kvattn.attention(q, k, v, mask=kvattn.image_mask(seg, window=window, clamp=clamp))
    ref = ref_attention(q, k, v, mask="causal", window=window, segments=seg, clamp=clamp)
    assert_close(a, ref, "segments")
    assert_close(b, ref, "image_mask array")
