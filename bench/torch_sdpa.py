#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention (bf16) on the shapes of bench/cuda_bench.cu,
on the same device in the same run, and the ratios to kvattn.

Every SDPA backend available (flash, efficient, cudnn, math) is tried with GQA
through enable_gqa=True and through K/V expanded with repeat_interleave (the
expansion is done once, outside the timing). Decode (L = 1) needs no mask; verify
(L > 1) uses the bottom-right causal mask (row i sees keys <= N - L + i).
K/V rotate over copies totalling >= 512 MiB (beyond the 60 MB L2); each call is
timed between CUDA events; median of REPS calls after WARMUP.

Usage: torch_sdpa.py [kvattn_results.jsonl]  (the cuda_bench JSON lines)
"""
import json
import math
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # older torch
    causal_lower_right = None

ROTATE_BYTES = 512 * 2**20
WARMUP = 5
REPS = 30
# (op, B, H, KVH, L, D, N): the shapes of bench/cuda_bench.cu
SHAPES = [
    ("decode", 16, 8, 4, 1, 256, 32768),
    ("decode", 1, 8, 4, 1, 256, 131072),
    ("decode", 1, 24, 4, 1, 256, 131072),
    ("verify", 1, 24, 4, 8, 256, 131072),
    ("decode", 16, 32, 8, 1, 128, 32768),
    ("decode", 1, 8, 4, 1, 256, 4096),
    ("decode", 4, 8, 4, 1, 256, 65536),
]
BACKENDS = [
    ("flash", SDPBackend.FLASH_ATTENTION),
    ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ("cudnn", SDPBackend.CUDNN_ATTENTION),
    ("math", SDPBackend.MATH),
]


def time_calls(fn, copies):
    for i in range(WARMUP):
        fn(i % copies)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(REPS + 1)]
    for i in range(REPS):
        ev[i].record()
        fn(i % copies)
    ev[REPS].record()
    torch.cuda.synchronize()
    t = sorted(ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(REPS))
    return t[REPS // 2]


def bench_shape(op, B, H, KVH, L, D, N):
    dev = "cuda"
    rep = H // KVH
    kv_bytes = 2 * B * KVH * N * D * 2
    copies = max(2, math.ceil(ROTATE_BYTES / kv_bytes))
    gen = torch.Generator(device=dev).manual_seed(1234)
    ks = [torch.randn(B, KVH, N, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
    vs = [torch.randn(B, KVH, N, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
    q = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16, generator=gen)
    mask = None
    if L > 1:
        if causal_lower_right is not None:
            mask = causal_lower_right(L, N)
        else:
            i = torch.arange(L, device=dev)[:, None]
            j = torch.arange(N, device=dev)[None, :]
            mask = j <= (N - L + i)
    results = {}
    for gqa in ("enable_gqa", "repeat"):
        if gqa == "repeat":
            if rep == 1:
                continue
            kx = [k.repeat_interleave(rep, dim=1) for k in ks]
            vx = [v.repeat_interleave(rep, dim=1) for v in vs]
        for name, be in BACKENDS:
            try:
                with sdpa_kernel([be]):
                    if gqa == "enable_gqa":
                        fn = lambda i: F.scaled_dot_product_attention(q, ks[i], vs[i], attn_mask=mask, enable_gqa=True)
                    else:
                        fn = lambda i: F.scaled_dot_product_attention(q, kx[i], vx[i], attn_mask=mask)
                    out = fn(0)
                    torch.cuda.synchronize()
                    if not torch.isfinite(out).all():
                        raise RuntimeError("non-finite output")
                    results[f"{name}/{gqa}"] = time_calls(fn, copies)
            except Exception as e:  # backend not available for this shape
                results[f"{name}/{gqa}"] = None
                msg = str(e).strip().splitlines()[0][:90] if str(e).strip() else type(e).__name__
                print(f"    {name}/{gqa}: unavailable ({msg})", flush=True)
        if gqa == "repeat":
            del kx, vx
    del ks, vs
    torch.cuda.empty_cache()
    return results, kv_bytes


def main():
    warnings.filterwarnings("ignore")  # SDPA explains each backend it skips; the table says it
    kv = []
    if len(sys.argv) > 1:
        with open(sys.argv[1]) as f:
            kv = [json.loads(line) for line in f if line.strip()]

    def kvattn(shape, fmt):
        op, B, H, KVH, L, D, N = shape
        for r in kv:
            if (r["op"], r["B"], r["H"], r["KVH"], r["L"], r["D"], r["N"], r["kv"]) == (op, B, H, KVH, L, D, N, fmt):
                return r["us"]
        return None

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; bf16 q/K/V; median of {REPS} event-timed calls")
    rows = []
    for shape in SHAPES:
        op, B, H, KVH, L, D, N = shape
        label = f"{op} {H}/{KVH}/{D} N={N} L={L} B={B}"
        print(f"{label}", flush=True)
        res, kv_bytes = bench_shape(*shape)
        for k, v in res.items():
            if v is not None:
                print(f"    {k:22s} {v:9.1f} us  {kv_bytes / (v * 1e-6) / 1e9:7.0f} GB/s", flush=True)
        ok = {k: v for k, v in res.items() if v is not None}
        best = min(ok.items(), key=lambda kv_: kv_[1]) if ok else (None, None)
        rows.append((label, best, kvattn(shape, "q4g64"), kvattn(shape, "bf16")))
    print()
    print(f"{'shape':40s} {'torch best':>24s} {'kvattn q4':>10s} {'ratio':>6s} {'kvattn bf16':>11s} {'ratio':>6s}")
    for label, (bname, bus), q4, bf in rows:
        bstr = f"{bus:.1f} ({bname})" if bus else "n/a"
        r4 = f"{bus / q4:.2f}x" if bus and q4 else "-"
        rb = f"{bus / bf:.2f}x" if bus and bf else "-"
        q4s = f"{q4:.1f}" if q4 else "-"
        bfs = f"{bf:.1f}" if bf else "-"
        print(f"{label:40s} {bstr:>24s} {q4s:>10s} {r4:>6s} {bfs:>11s} {rb:>6s}")


if __name__ == "__main__":
    main()
