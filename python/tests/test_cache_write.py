"""kvattn.cache_write: rows written in place into numpy pools [num_blocks,
KVH, block_size, D] at slots, bit for bit with kvattn.quantize of the same
rows (quantized pools) or the rows rounded to the pool dtype (float pools);
rows not named stay as they were; a bad slot raises and writes nothing."""
import numpy as np
import pytest

import kvattn
from kvref import FLOATS, randn, rng_for


def bits_of(a):
    return a.view({4: np.uint32, 2: np.uint16}[a.dtype.itemsize])


def random_pool(rng, nb, kvh, bs, d, bits, group_size, dtype):
    """A pool of random bytes (sentinels everywhere): an array, or (packed, scales, biases)."""
    def noise(shape, dt):
        return rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dt).itemsize, dtype=np.uint8).view(dt).reshape(
            shape)
    if not bits:
        return noise((nb, kvh, bs, d), dtype)
    return (noise((nb, kvh, bs, d * bits // 32), np.uint32), noise((nb, kvh, bs, d // group_size), dtype),
            noise((nb, kvh, bs, d // group_size), dtype))


def parts(pool):
    return pool if isinstance(pool, tuple) else (pool,)


def expected(pool, rows, slots, bs, bits, group_size):
    """The pool after writing rows [n, KVH, D] at slots (numpy copies)."""
    want = tuple(p.copy() for p in parts(pool))
    for i, s in enumerate(slots):
        if s < 0:
            continue
        blk, row = divmod(int(s), bs)
        if bits:
            q = kvattn.quantize(rows[i], group_size=group_size, bits=bits)  # [KVH, ...] each
            for w, part in zip(want, q):
                w[blk, :, row] = part
        else:
            want[0][blk, :, row] = rows[i].astype(want[0].dtype)
    return want


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits,group_size", [(0, 0), (2, 32), (4, 64), (8, 128)])
def test_cache_write_matches_quantize(request, bits, group_size, dtype):
    rng = rng_for(request)
    nb, kvh, bs, dk, dv, n = 5, 2, 8, 128, 256, 9
    kp = random_pool(rng, nb, kvh, bs, dk, bits, group_size, dtype)
    vp = random_pool(rng, nb, kvh, bs, dv, bits, group_size, dtype)
    k = randn(rng, (n, kvh, dk), dtype, scale=3.0)
    v = randn(rng, (n, kvh, dv), dtype)
    k[1, 0, :] = 0.5        # a constant row
    v[2, 1, : dv // 2] = 0  # zeros
    k[3] = -np.abs(k[3])    # negative only
    slots = rng.permutation(nb * bs)[:n].astype(np.int64)
    slots[4] = -1           # skipped
    want_k = expected(kp, k, slots, bs, bits, group_size)
    want_v = expected(vp, v, slots, bs, bits, group_size)
    kvattn.cache_write(kp, vp, k, v, slots, group_size=group_size or 64, bits=bits or 4)
    for got, want in zip(parts(kp) + parts(vp), want_k + want_v):
        assert got.dtype == want.dtype
        g, w = (got, want) if got.dtype == np.uint32 else (bits_of(got), bits_of(want))
        bad = np.argwhere(g != w)
        assert bad.size == 0, "%d elements differ, first %s" % (len(bad), [tuple(i) for i in bad[:4]])


def test_cache_write_strided_views(request):
    """Pools and rows as strided views (a slice of a larger cache; K/V heads
    interleaved in one array): written in place, others untouched."""
    rng = rng_for(request)
    both = random_pool(rng, 4, 2, 16, 128, 0, 0, np.float32)  # [nb, KVH, bs, 128]: K = [..., :64], V = [..., 64:]
    kp, vp = both[..., :64], both[..., 64:]
    src = randn(rng, (6, 2, 3, 64), np.float32)
    k, v = src[:, :, 0], src[:, :, 2]
    slots = np.array([0, 17, 63, -5, 30, 31])
    before = both.copy()
    kvattn.cache_write(kp, vp, k, v, slots)
    want = before.copy()
    for i, s in enumerate(slots):
        if s >= 0:
            want[s // 16, :, s % 16, :64] = k[i]
            want[s // 16, :, s % 16, 64:] = v[i]
    assert np.array_equal(bits_of(both), bits_of(want))


def test_cache_write_errors(request):
    rng = rng_for(request)
    kp = random_pool(rng, 2, 2, 8, 64, 4, 64, np.float16)
    vp = random_pool(rng, 2, 2, 8, 64, 4, 64, np.float16)
    k = randn(rng, (3, 2, 64), np.float16)
    before = [p.copy() for p in kp + vp]
    with pytest.raises(kvattn.KvaError, match=r"slots\[2\] = 16 is out of range") as e:
        kvattn.cache_write(kp, vp, k, k, [0, 5, 16])
    assert e.value.code == -1
    with pytest.raises(kvattn.KvaError, match=r"k\.shape\[2\]"):
        kvattn.cache_write(kp, vp, randn(rng, (3, 2, 32), np.float16), k, [0, 1, 2])
    with pytest.raises(kvattn.KvaError, match=r"slots must have shape"):
        kvattn.cache_write(kp, vp, k, k, [0, 1])
    for got, want in zip(kp + vp, before):
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), "a failed cache_write modified a pool"
