"""Context parallelism with simulated ranks in one process (kvattn.CPPlan,
cp_attend, cp_exchange, cp_merge): a cache split into R contiguous ranges,
each attended by its rank, the parts exchanged and merged, equal to one
call over the whole cache (kvattn.attention with return_lse) and to the
oracle; both exchange modes, float and quantized, causal with sinks, an
empty rank; bad input."""
import numpy as np
import pytest

import kvattn
from kvref import F32, assert_close, randn, rng_for
from test_lse import assert_lse


def _split(N, R, last):
    """Cuts of N tokens into R ranges, the last one `last` tokens long, rank 1 empty when R >= 3."""
    cuts = [0] + [(N - last) * r // (R - 1) for r in range(1, R)] + [N] if R > 1 else [0, N]
    if R >= 3:
        cuts[2] = cuts[1]
    return cuts


@pytest.mark.parametrize("bits", [0, 4])
@pytest.mark.parametrize("by_head", [False, True])
@pytest.mark.parametrize("R", [1, 2, 3, 4])
def test_cp_simulated_ranks(request, bits, by_head, R):
    rng = rng_for(request)
    B, H, KVH, L, N, D = 2, 8, 4, 2, 600, 128
    if by_head and H % R:
        pytest.skip("by_head needs R | H")
    q = randn(rng, (B, H, L, D))
    k, v = randn(rng, (B, KVH, N, D)), randn(rng, (B, KVH, N, D))
    sinks = randn(rng, (H,))
    kk, vv = (kvattn.quantize(k), kvattn.quantize(v)) if bits else (k, v)
    ref, ref_lse = kvattn.attention(q, kk, vv, mask="causal", sinks=sinks, bits=bits, return_lse=True, exact=True)
    oracle = kvattn.reference_attention(q, kk, vv, mask="causal", sinks=sinks, bits=bits)
    cuts = _split(N, R, 50)
    plans = [kvattn.CPPlan(R, r, B, H, L, D, by_head=by_head) for r in range(R)]
    sends = []
    for r, plan in enumerate(plans):
        t0, t1 = cuts[r], cuts[r + 1]
        send = plan.send_buffer()
        if t0 == t1:
            kvattn.cp_attend(plan, q, None, None, send)
        else:
            last = t1 == N
            sl = (lambda x: tuple(a[:, :, t0:t1] for a in x)) if bits else (lambda x: x[:, :, t0:t1])
            kvattn.cp_attend(plan, q, sl(kk), sl(vv), send, mask="causal" if last else None,
                             sinks=sinks if last else None, bits=bits, exact=True)
        sends.append(send)
    recvs = kvattn.cp_exchange(plans, sends)
    for d, plan in enumerate(plans):
        out, lse = kvattn.cp_merge(plan, recvs[d])
        h0 = d * plan.heads if by_head else 0
        hs = slice(h0, h0 + plan.heads)
        assert out.shape == (B, plan.heads, L, D)
        assert_close(out, ref[:, hs].astype(np.float64), "rank %d against one call" % d, atol=1e-5)
        assert_close(out, oracle[:, hs].astype(np.float64), "rank %d against the oracle" % d)
        assert_lse(lse, ref_lse[:, hs].astype(np.float64), "rank %d lse" % d)


def test_cp_bad_input(request):
    rng = rng_for(request)
    with pytest.raises(ValueError, match="H"):
        kvattn.CPPlan(3, 0, 1, 8, 1, 64, by_head=True)
    with pytest.raises(ValueError, match="rank"):
        kvattn.CPPlan(2, 2, 1, 8, 1, 64)
    plan = kvattn.CPPlan(2, 0, 1, 8, 1, 64)
    q = randn(rng, (1, 8, 1, 64))
    k = randn(rng, (1, 4, 30, 64))
    send = plan.send_buffer()
    with pytest.raises(ValueError, match="send"):
        kvattn.cp_attend(plan, q, k, k, send[:10], bits=0)
    with pytest.raises(ValueError, match="q.shape\\[1\\]"):
        kvattn.cp_attend(plan, randn(rng, (1, 4, 1, 64)), k, k, send, bits=0)
    with pytest.raises(TypeError, match="send"):
        kvattn.cp_attend(plan, q, k, k, send.astype(np.float64), bits=0)
    with pytest.raises(ValueError, match="recv"):
        kvattn.cp_merge(plan, plan.recv_buffer()[:5])
    with pytest.raises(ValueError, match="out.shape"):
        kvattn.cp_merge(plan, plan.recv_buffer(), out=np.empty((1, 4, 1, 64), F32))


def test_cp_attention_argument_errors(request):
    rng = rng_for(request)
    plan = kvattn.CPPlan(1, 0, 1, 8, 1, 64)
    q = randn(rng, (1, 8, 1, 64))
    with pytest.raises(TypeError, match="CUDA tensors"):
        kvattn.cp_attention(plan, 0, q, q, q)
    from kvattn.compose import _nccl_comm
    assert _nccl_comm(1234) == 1234
    with pytest.raises(TypeError, match="process group"):
        _nccl_comm(object())


def test_cp_attention_torch_one_rank(request):
    """A one-rank torch.distributed NCCL group: kva_cp_attention equals one call."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or kvattn.cuda_device_count() == 0:
        pytest.skip("no CUDA device")
    import socket

    import torch.distributed as dist
    if not dist.is_nccl_available():
        pytest.skip("torch without NCCL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % port, rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(1, device="cuda"))  # creates the communicator
        rng = rng_for(request)
        B, H, KVH, L, N, D = 2, 8, 4, 2, 500, 128
        q, k, v = randn(rng, (B, H, L, D)), randn(rng, (B, KVH, N, D)), randn(rng, (B, KVH, N, D))
        ref, ref_lse = kvattn.attention(q, k, v, mask="causal", bits=0, return_lse=True, exact=True)
        tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
        for by_head in (False, True):
            plan = kvattn.CPPlan(1, 0, B, H, L, D, by_head=by_head)
            try:
                out, lse = kvattn.cp_attention(plan, dist.group.WORLD, tq, tk, tv, mask="causal", bits=0,
                                               return_lse=True, exact=True)
            except ValueError as e:
                if "no NCCL" in str(e):
                    pytest.skip("kvattn built without NCCL")
                raise
            torch.cuda.synchronize()
            assert_close(out.cpu().numpy(), ref.astype(np.float64), "cp_attention by_head=%s" % by_head, atol=1e-5)
            assert_lse(lse.cpu().numpy(), ref_lse.astype(np.float64), "cp_attention lse")
    finally:
        dist.destroy_process_group()
