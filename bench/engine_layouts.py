#!/usr/bin/env python3
"""Decode time of block-table attention over engine pool layouts: kvattn's
own [num_blocks, KVH, block_size, D] pools (HND) against views of one
(2, num_blocks, block_size, KVH, D) array (vLLM's NHD layout, read through
strides), bf16 and MLX 4-bit (group 64, bf16 scales) pools, blocks shuffled.
NHD puts a head's consecutive tokens KVH rows apart instead of adjacent.

--device cpu: numpy arrays, wall time per call (median of --reps);
--device cuda: torch CUDA tensors through the extension, CUDA events around
--calls back-to-back calls into a preallocated out. Prints one line per
format and layout with the time and its ratio to HND.

Usage: PYTHONPATH=python KVATTN_LIB=build/libkvattn.so python3 bench/engine_layouts.py --device cuda [--b 16] [--n 32768]
"""
import argparse
import statistics
import time

import numpy as np

import kvattn


def pools(rng, fmt, nb, bs, kvh, d):
    """(HND k, v), (NHD views k, v): arrays or (packed, scales, biases) tuples, numpy."""
    import ml_dtypes

    raw = rng.standard_normal((2, nb, bs, kvh, d)).astype(ml_dtypes.bfloat16)
    arrays = (raw,) if fmt == "bf16" else kvattn.quantize(raw, group_size=64, bits=4)
    nhd = [tuple(a[i].transpose(0, 2, 1, 3) for a in arrays) for i in (0, 1)]
    hnd = [tuple(np.ascontiguousarray(a) for a in p) for p in nhd]
    unwrap = (lambda p: p[0]) if fmt == "bf16" else (lambda p: p)
    return arrays, [unwrap(p) for p in hnd], [unwrap(p) for p in nhd]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--kvh", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    import ml_dtypes

    rng = np.random.default_rng(0)
    B, H, KVH, D, bs, N = a.b, a.h, a.kvh, a.d, a.block, a.n
    per = (N + bs - 1) // bs
    nb = B * per
    blocks = rng.permutation(nb).astype(np.int32).reshape(B, per)
    lens = np.full(B, N, np.int32)
    q = rng.standard_normal((B, H, 1, D)).astype(ml_dtypes.bfloat16)
    print("decode B=%d H=%d KVH=%d D=%d N=%d block=%d, %s" % (B, H, KVH, D, N, bs, a.device))
    for fmt in ("bf16", "q4"):
        kw = {} if fmt == "bf16" else dict(bits=4, group_size=64)
        arrays, hnd, nhd = pools(rng, fmt, nb, bs, KVH, D)
        base = None
        for name, (kp, vp) in (("HND [nb, KVH, bs, D]", hnd), ("NHD (2, nb, bs, KVH, D) views", nhd)):
            if a.device == "cpu":
                out = np.empty((B, H, 1, D), q.dtype)
                call = lambda: kvattn.block_table_attention(q, kp, vp, blocks, lens, mask="causal", out=out, **kw)  # noqa: E731
                call()
                ts = []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    call()
                    ts.append(time.perf_counter() - t0)
                us = statistics.median(ts) * 1e6
            else:
                import torch

                def dev(x):
                    x = np.ascontiguousarray(x)
                    if x.dtype == np.uint32:
                        x = x.view(np.int32)
                    if x.dtype == ml_dtypes.bfloat16:
                        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
                    return torch.from_numpy(x).cuda()

                if name.startswith("NHD"):  # the engine's array on the device, viewed there
                    darr = [dev(x) for x in arrays]
                    kd = tuple(t[0].permute(0, 2, 1, 3) for t in darr)
                    vd = tuple(t[1].permute(0, 2, 1, 3) for t in darr)
                else:
                    kd = tuple(dev(x) for x in (kp if isinstance(kp, tuple) else (kp,)))
                    vd = tuple(dev(x) for x in (vp if isinstance(vp, tuple) else (vp,)))
                if fmt == "bf16":
                    kd, vd = kd[0], vd[0]
                qd, bd, ld = dev(q), torch.from_numpy(blocks).cuda(), torch.from_numpy(lens).cuda()
                out = torch.empty((B, H, 1, D), dtype=torch.bfloat16, device="cuda")
                call = lambda: kvattn.block_table_attention(qd, kd, vd, bd, ld, mask="causal", out=out, **kw)  # noqa: E731
                call()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ts = []
                for _ in range(a.reps):
                    e0.record()
                    for _ in range(a.calls):
                        call()
                    e1.record()
                    e1.synchronize()
                    ts.append(e0.elapsed_time(e1) * 1e3 / a.calls)
                us = statistics.median(ts)
            base = base or us
            print("  %-4s %-32s %9.1f us  %.2fx HND" % (fmt, name, us, us / base))


if __name__ == "__main__":
    main()
