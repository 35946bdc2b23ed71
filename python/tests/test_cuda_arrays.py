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
