#!/usr/bin/env python3
"""Host time per call of kvattn on PyTorch CUDA tensors: the compiled
operators (torch.ops.kvattn.attention_out into a preallocated out,
torch.ops.kvattn.attention allocating it), the extension's eager entry
points (kvattn.torch_ops.eager(): the same calls without the dispatcher),
kvattn.attention on tensors (which takes the eager entry points outside
torch.compile), the ctypes path of kvattn.cuda (the binding before the
extension), and torch's scaled_dot_product_attention on the same shapes,
in one run.

Host time: the wall time of CALLS launches divided by CALLS, with the GPU
kept busy (a torch.cuda._sleep queued first, longer than the launches take),
so that no call waits for the device and the figure is what the host spends
per call; torch.cuda.synchronize only after the timed loop. Median of REPS
loops. The device time per call (CUDA events around CALLS back-to-back
calls, no sleep) is printed beside it: a call's host time is hidden behind
the GPU only while it is below that.

Shapes: decode (L = 1) of Llama-3-8B attention, 32 query / 8 KV heads, head
dim 128, N = 4096 (and --n), bf16 K/V and MLX 4-bit K/V (group 64, bf16
scales/biases); SDPA reads the bf16 K/V (enable_gqa).

Usage: PYTHONPATH=python KVATTN_LIB=build/libkvattn.so python3 bench/torch_host_overhead.py [--n 4096] [--b 1]
(needs `make torch-ext PY=python3` for the operator rows; without the
extension they are reported as unavailable).
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import kvattn
from kvattn import cuda as kcuda
from kvattn import torch_ops

# CALLS calls (up to 2 kernels each) stay well inside CUDA's queue of pending
# launches (about 1024), so no launch waits for a free slot.
CALLS = 200
REPS = 9
SLEEP_CYCLES_PER_CALL = 300_000  # ~150 us at ~2 GHz: far more than any call's host time


def host_us(fn):
    """Median host microseconds per call over REPS loops of CALLS calls, the GPU kept busy."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        torch.cuda._sleep(SLEEP_CYCLES_PER_CALL * CALLS)
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        times.append((t1 - t0) / CALLS * 1e6)
    return statistics.median(times)


def device_us(fn):
    for _ in range(10):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(CALLS):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / CALLS


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--b", type=int, default=1)
    args = ap.parse_args()
    if not torch.cuda.is_available() or kvattn.cuda_device_count() == 0:
        raise SystemExit("torch_host_overhead: needs a CUDA device and libkvattn built with CUDA")
    B, H, KVH, D, N = args.b, 32, 8, 128, args.n
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, H, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, KVH, N, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, KVH, N, D, device=dev, dtype=torch.bfloat16, generator=g)
    def q4(x):  # MLX 4-bit, group 64, bf16 scales/biases: (packed int32, scales, biases) on the device
        packed, scales, biases = kvattn.quantize(x.view(torch.int16).cpu().numpy().view(kvattn.bfloat16), 64, 4)
        return [torch.from_numpy(packed.view("int32")).to(dev)] + [
            torch.from_numpy(a.view("int16")).to(dev).view(torch.bfloat16) for a in (scales, biases)]

    kq, vq = q4(k), q4(v)
    out = torch.empty_like(q)
    have_ops = torch_ops.available()
    rows = []

    def add(name, fns):
        row = [name]
        for fn in fns:
            if fn is None:
                row += ["-", "-"]
                continue
            row += ["%.1f" % host_us(fn), "%.1f" % device_us(fn)]
        rows.append(row)

    if have_ops:
        ao = torch.ops.kvattn.attention_out.default
        aa = torch.ops.kvattn.attention.default
        # positional: the schema's order (causal, k_scales, k_biases, v_scales, v_biases, bits, ...)
        add("torch.ops.kvattn.attention_out (out preallocated)",
            [lambda: ao(out, q, k, v, True),
             lambda: ao(out, q, kq[0], vq[0], True, kq[1], kq[2], vq[1], vq[2], 4)])
        add("torch.ops.kvattn.attention (allocating out)",
            [lambda: aa(q, k, v, True),
             lambda: aa(q, kq[0], vq[0], True, kq[1], kq[2], vq[1], vq[2], 4)])
        add("torch.ops.kvattn.attention_out, keyword options",
            [lambda: ao(out, q, k, v, causal=True),
             lambda: ao(out, q, kq[0], vq[0], k_scales=kq[1], k_biases=kq[2], v_scales=vq[1], v_biases=vq[2], bits=4,
                        causal=True)])
        E = torch_ops.eager()
        if E is not None:
            # the eager entry points: the same call without the dispatcher's argument parsing
            o_bf = (True, None, None, None, None, 0, 64, 0, None, None, None, None, False, None, False, None)
            o_q4 = (True, kq[1], kq[2], vq[1], vq[2], 4, 64, 0, None, None, None, None, False, None, False, None)
            add("kvattn.torch_ops.eager().attention_out (out preallocated)",
                [lambda: E.attention_out(out, q, k, v, *o_bf), lambda: E.attention_out(out, q, kq[0], vq[0], *o_q4)])
            add("kvattn.torch_ops.eager().attention (allocating out)",
                [lambda: E.attention(q, k, v, *o_bf), lambda: E.attention(q, kq[0], vq[0], *o_q4)])
        add("kvattn.attention(..., out=out) (-> the eager entry points)",
            [lambda: kvattn.attention(q, k, v, mask="causal", out=out),
             lambda: kvattn.attention(q, tuple(kq), tuple(vq), mask="causal", bits=4, out=out)])
        add("kvattn.attention(...) (allocating)",
            [lambda: kvattn.attention(q, k, v, mask="causal"),
             lambda: kvattn.attention(q, tuple(kq), tuple(vq), mask="causal", bits=4)])
    else:
        print("torch extension not available: %s" % torch_ops.load_error())
    add("ctypes path (kvattn.cuda.attention, out=out)",
        [lambda: kcuda.attention(q, k, v, None, "causal", out=out),
         lambda: kcuda.attention(q, tuple(kq), tuple(vq), None, "causal", bits=4, out=out)])
    add("torch SDPA (bf16 K/V, enable_gqa)",
        [lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), None])

    if have_ops:  # the operators' and eager entry points' results against the ctypes path on the same data
        ref = kcuda.attention(q, k, v, None, "causal", out=torch.empty_like(q))
        got = torch.ops.kvattn.attention(q, k, v, causal=True)
        torch.cuda.synchronize()
        assert torch.equal(got, ref), "operator and ctypes path differ"
        if torch_ops.eager() is not None:
            got = torch_ops.eager().attention(q, k, v, *o_bf)
            torch.cuda.synchronize()
            assert torch.equal(got, ref), "eager entry point and ctypes path differ"

    print("kvattn host time per call on %s: B=%d H=%d KVH=%d D=%d N=%d L=1, torch %s"
          % (torch.cuda.get_device_name(), B, H, KVH, D, N, torch.__version__))
    hdr = ["call", "bf16 host us", "bf16 device us", "q4 host us", "q4 device us"]
    w = [max(len(r[i]) for r in rows + [hdr]) for i in range(len(hdr))]
    for r in [hdr] + rows:
        print("  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)))


if __name__ == "__main__":
    main()
