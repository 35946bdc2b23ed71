"""kvattn.attention on PyTorch CUDA tensors against the CPU path on the same
data. Skipped where PyTorch or a CUDA device is missing (CI: no GPU)."""
import numpy as np
import pytest

import kvattn
from kvref import BF16_PRODUCTS_ATOL, UNIT_ROUNDOFF, randn, rng_for

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or kvattn.cuda_device_count() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)


def to_cuda(a):
    if a.dtype == np.uint32:
        a = a.view(np.int32)
    if str(a.dtype) == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def to_numpy(t, dtype):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(dtype)
    return t.cpu().numpy()


# (bits, L, rep, dtype of q / K / V): bf16 rows at 2 query vectors per KV
# head (fused kernel), 4 and 6 (tensor cores); q4 decode and verify; q8 at 3
# vectors (tensor-core decode instance) and 16 (the wide kernel); f16 rows
# with f16 queries at 6 and 16 vectors (tensor cores).
@pytest.mark.parametrize("bits,L,rep,dt", [(0, 1, 2, "bf16"), (0, 1, 4, "bf16"), (0, 1, 6, "bf16"), (4, 1, 2, "bf16"),
                                           (4, 8, 6, "bf16"), (8, 3, 1, "bf16"), (8, 8, 2, "bf16"),
                                           (0, 1, 6, "f16"), (0, 8, 2, "f16")])
def test_cuda_matches_cpu(request, bits, L, rep, dt):
    rng = rng_for(request)
    B, KVH, N, D = 2, 2, 300, 128
    H = KVH * rep
    dtype = kvattn.bfloat16 if dt == "bf16" else np.float16
    q = randn(rng, (B, H, L, D), dtype)
    k = randn(rng, (B, KVH, N, D), dtype)
    v = randn(rng, (B, KVH, N, D), dtype)
    if bits:
        k, v = kvattn.quantize(k, 64, bits), kvattn.quantize(v, 64, bits)
    cpu = kvattn.attention(q, k, v, mask="causal", group_size=64, bits=bits).astype(np.float64)
    qc = to_cuda(q)
    kc = tuple(to_cuda(a) for a in k) if bits else to_cuda(k)
    vc = tuple(to_cuda(a) for a in v) if bits else to_cuda(v)
    out = kvattn.attention(qc, kc, vc, mask="causal", group_size=64, bits=bits)
    torch.cuda.synchronize()
    assert out.is_cuda and out.shape == (B, H, L, D) and out.dtype == qc.dtype
    got = to_numpy(out, dtype).astype(np.float64)
    # both sides may compute with 16-bit products (AMX / tensor cores): twice that allowance
    bound = 2 * UNIT_ROUNDOFF[np.dtype(dtype)] * np.abs(cpu) + 2 * BF16_PRODUCTS_ATOL * np.abs(cpu).max()
    assert np.isfinite(got).all()
    assert (np.abs(got - cpu) <= bound).all(), float(np.abs(got - cpu).max())


def test_cuda_rejects_host_sinks(request):
    rng = rng_for(request)
    q = to_cuda(randn(rng, (1, 2, 1, 64), kvattn.bfloat16))
    k = to_cuda(randn(rng, (1, 1, 16, 64), kvattn.bfloat16))
    with pytest.raises(ValueError, match="sinks must be a CUDA array"):
        kvattn.attention(q, k, k, mask="causal", bits=0, sinks=np.zeros(2, np.float32))


@pytest.mark.parametrize("bits,block", [(4, 16), (0, 64)])
def test_cuda_block_table_and_cache_write(request, bits, block):
    """Pools filled by kvattn.cache_write on the device equal the CPU's
    bytes; attention over the device block table matches the CPU's."""
    rng = rng_for(request)
    B, KVH, rep, L, D, n_tok = 2, 2, 3, 2, 128, 200
    H = KVH * rep
    k = randn(rng, (B, KVH, n_tok, D), kvattn.bfloat16)
    v = randn(rng, (B, KVH, n_tok, D), kvattn.bfloat16)
    kv = (kvattn.quantize(k, 64, bits), kvattn.quantize(v, 64, bits)) if bits else (k, v)
    cpu_pool, seqs = kvattn.Pool.from_contiguous(*kv, block_size=block, shuffle_seed=7, group_size=64, bits=bits)
    blocks, lens, first = cpu_pool.view(seqs).block_table()
    q = randn(rng, (B, H, L, D), kvattn.bfloat16)
    cpu = kvattn.block_table_attention(q, cpu_pool.k, cpu_pool.v, blocks, lens, first, mask="causal",
                                       group_size=64, bits=bits).astype(np.float64)
    # device pools written token by token with cache_write
    def dev_pool(p):
        return tuple(torch.zeros_like(to_cuda(a)) for a in p) if bits else torch.zeros_like(to_cuda(p))
    kd, vd = dev_pool(cpu_pool.k), dev_pool(cpu_pool.v)
    slots = np.array([[blocks[b, t // block] * block + t % block for t in range(n_tok)] for b in range(B)],
                     np.int32)
    for b in range(B):
        kvattn.cache_write(kd, vd, to_cuda(np.ascontiguousarray(k[b].transpose(1, 0, 2))),
                           to_cuda(np.ascontiguousarray(v[b].transpose(1, 0, 2))), to_cuda(slots[b]),
                           group_size=64, bits=bits)
    out = kvattn.block_table_attention(to_cuda(q), kd, vd, to_cuda(blocks), to_cuda(lens), to_cuda(first),
                                       mask="causal", group_size=64, bits=bits)
    torch.cuda.synchronize()
    got = to_numpy(out, kvattn.bfloat16).astype(np.float64)
    bound = 2 * UNIT_ROUNDOFF[np.dtype(kvattn.bfloat16)] * np.abs(cpu) + 2 * BF16_PRODUCTS_ATOL * np.abs(cpu).max()
    assert np.isfinite(got).all()
    assert (np.abs(got - cpu) <= bound).all(), float(np.abs(got - cpu).max())
