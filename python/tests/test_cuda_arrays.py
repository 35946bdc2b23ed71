"""The CUDA-array path of the binding without a GPU: objects exposing
__cuda_array_interface__ are described (pointers, shapes, byte strides,
typestr) and routed to the CUDA backend; on a machine without one the call
fails with the library's message instead of touching the memory."""
import numpy as np
import pytest

import kvattn
from kvattn import cuda as kcuda


class FakeDeviceArray:
    """Host memory behind a __cuda_array_interface__ (never dereferenced here)."""

    def __init__(self, arr):
        self.arr = arr
        self.__cuda_array_interface__ = {
            "shape": arr.shape, "typestr": arr.dtype.str, "data": (arr.ctypes.data, False),
            "strides": arr.strides, "version": 3, "stream": 1,
        }


def test_detection():
    assert kcuda.is_cuda_array(FakeDeviceArray(np.zeros(3, np.float32)))
    assert not kcuda.is_cuda_array(np.zeros(3, np.float32))


@pytest.mark.skipif(kvattn.cuda_device_count() > 0, reason="a CUDA device is present")
def test_routes_to_cuda_backend():
    q = FakeDeviceArray(np.ones((1, 2, 1, 64), np.float16))
    k = FakeDeviceArray(np.ones((1, 1, 8, 64), np.float16))
    out = FakeDeviceArray(np.zeros((1, 2, 1, 64), np.float16))
    with pytest.raises(ValueError, match="backend or device not available"):
        kvattn.attention(q, k, k, mask="causal", bits=0, out=out)


def test_cuda_arrays_validate_before_the_backend():
    q = FakeDeviceArray(np.ones((1, 2, 1, 64), np.float16))
    k = FakeDeviceArray(np.ones((1, 1, 8, 64), np.float16))
    with pytest.raises(ValueError, match="out is required"):
        kvattn.attention(q, k, k, mask="causal", bits=0)
    out = FakeDeviceArray(np.zeros((1, 2, 1, 64), np.float16))
    with pytest.raises(ValueError, match="sinks must be a CUDA array"):
        kvattn.attention(q, k, k, mask="causal", bits=0, out=out, sinks=np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="the only string mask"):
        kvattn.attention(q, k, k, mask="full", bits=0, out=out)
    with pytest.raises(ValueError, match="unsupported typestr"):
        kvattn.attention(FakeDeviceArray(np.ones((1, 2, 1, 64), np.float64)), k, k, bits=0, out=out)


def _table_args(B=2, KVH=1, D=64, bs=16, nblk=8, mb=4):
    q = FakeDeviceArray(np.ones((B, 2, 1, D), np.float16))
    pool = FakeDeviceArray(np.ones((nblk, KVH, bs, D), np.float16))
    blocks = FakeDeviceArray(np.zeros((B, mb), np.int32))
    lens = FakeDeviceArray(np.full(B, 3, np.int32))
    out = FakeDeviceArray(np.zeros((B, 2, 1, D), np.float16))
    return q, pool, blocks, lens, out


@pytest.mark.skipif(kvattn.cuda_device_count() > 0, reason="a CUDA device is present")
def test_block_table_routes_to_cuda_backend():
    q, pool, blocks, lens, out = _table_args()
    with pytest.raises(ValueError, match="backend or device not available"):
        kvattn.block_table_attention(q, pool, pool, blocks, lens, mask="causal", bits=0, out=out)


def test_block_table_cuda_arrays_validate_before_the_backend():
    q, pool, blocks, lens, out = _table_args()
    with pytest.raises(ValueError, match="blocks must be a CUDA array"):
        kvattn.block_table_attention(q, pool, pool, np.zeros((2, 4), np.int32), lens, bits=0, out=out)
    with pytest.raises(ValueError, match="blocks must be an int32 CUDA array of rank 2"):
        kvattn.block_table_attention(q, pool, pool, FakeDeviceArray(np.zeros(8, np.int32)), lens, bits=0, out=out)
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[B\] = \[2\]"):
        kvattn.block_table_attention(q, pool, pool, blocks, FakeDeviceArray(np.ones(3, np.int32)), bits=0, out=out)
    with pytest.raises(ValueError, match="first_offset must have shape"):
        kvattn.block_table_attention(q, pool, pool, blocks, lens, FakeDeviceArray(np.zeros(5, np.int32)), bits=0,
                                     out=out)


@pytest.mark.skipif(kvattn.cuda_device_count() > 0, reason="a CUDA device is present")
def test_cache_write_routes_to_cuda_backend():
    pool = FakeDeviceArray(np.zeros((4, 1, 16, 64), np.float16))
    rows = FakeDeviceArray(np.ones((2, 1, 64), np.float16))
    slots = FakeDeviceArray(np.array([0, 17], np.int32))
    with pytest.raises(ValueError, match="backend or device not available"):
        kvattn.cache_write(pool, pool, rows, rows, slots, bits=0)
    with pytest.raises(ValueError, match=r"slots must have shape \[n\] = \[2\]"):
        kvattn.cache_write(pool, pool, rows, rows, FakeDeviceArray(np.zeros(3, np.int32)), bits=0)
