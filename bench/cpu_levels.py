#!/usr/bin/env python3
"""One-thread hot timings of CPU attention at one SIMD level through the
Python binding, for A/B runs of two builds of the library (KVATTN_LIB) on
the same host: 8/4/256 (gemma3-4b) at N = 8192, bf16 queries, decode (L=1)
and causal verify (L=8), best of 5 calls after one warm-up.

  PYTHONPATH=python KVATTN_LIB=build/libkvattn.so .venv/bin/python \\
      bench/cpu_levels.py portable [q4g64 bf16 q4g32 q2g64 ...]

Prints one line: the level, the kernel that ran the last case, and the
milliseconds per case. Alternate the builds over several rounds and compare
minima: a shared host's speed drifts (BENCHMARKS.md)."""
import os
import sys
import time

import ml_dtypes
import numpy as np

import kvattn

B, H, KVH, N, D = 1, 8, 4, 8192, 256


def operands(rng, fmt):
    k = rng.standard_normal((B, KVH, N, D)).astype(np.float32)
    v = rng.standard_normal((B, KVH, N, D)).astype(np.float32)
    if fmt.startswith("q"):
        bits, group = int(fmt[1]), int(fmt[3:])
        return kvattn.quantize(k, group_size=group, bits=bits), kvattn.quantize(v, group_size=group, bits=bits), \
            dict(group_size=group, bits=bits)
    dt = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}[fmt]
    return k.astype(dt), v.astype(dt), {}


def main():
    level = sys.argv[1] if len(sys.argv) > 1 else None
    fmts = sys.argv[2:] or ["q4g64", "bf16"]
    kvattn.set_cpu_simd(level)
    rng = np.random.default_rng(0)
    out, name = [], ""
    for fmt in fmts:
        k, v, kw = operands(rng, fmt)
        for L in (1, 8):
            q = rng.standard_normal((B, H, L, D)).astype(ml_dtypes.bfloat16)
            mask = "causal" if L > 1 else None
            kvattn.attention(q, k, v, mask=mask, threads=1, **kw)
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                kvattn.attention(q, k, v, mask=mask, threads=1, **kw)
                best = min(best, time.perf_counter() - t)
            name = kvattn.attention_kernel(q, k, v, mask=mask, **kw)
            out.append(f"{fmt} L={L} {best * 1e3:.1f} ms")
    print(kvattn.cpu_simd(), os.environ.get("KVATTN_LIB", ""), name, "|", "; ".join(out))


if __name__ == "__main__":
    main()
