#!/usr/bin/env python3
"""Instruction mix and stall reasons of one kernel from an Nsight Compute
source-page CSV (`ncu --import R --page source --print-source sass --csv`, as
bench/cuda_profile.sh writes it to ncu_source.csv).

Prints the warp-level instructions executed by opcode (total and per warp of
the launch, and per loop trip when --trips gives the trips of the main loop
per warp), the stall-sample reasons summed over the kernel, and the hottest
instructions by stall samples.

Usage: ncu_mix.py ncu_source.csv [--warps W] [--trips T] [--top N]
  W: warps of the launch (default: the execution count of the kernel's first
     instruction); T: loop trips per warp (default 1).
"""
import argparse
import collections
import csv
import re


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--warps", type=float, default=0)
    ap.add_argument("--trips", type=float, default=1)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv)))
    hi = next(i for i, r in enumerate(rows) if "Instructions Executed" in r)
    hdr, data = rows[hi], rows[hi + 1 :]
    ie, isrc = hdr.index("Instructions Executed"), hdr.index("Source")
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    isamp = hdr.index("Warp Stall Sampling (All Samples)")
    by_op, samples, stalls, hot = collections.Counter(), collections.Counter(), collections.Counter(), []
    warps = a.warps
    for r in data:
        if len(r) <= ie or not r[ie].isdigit():
            continue
        n = int(r[ie])
        if not warps and n:
            warps = n  # the first instruction runs once per warp
        src = r[isrc].strip()
        op = re.sub(r"^@!?U?P\w+\s+", "", src).split(" ")[0]
        by_op[op] += n
        s = int(r[isamp] or 0)
        samples[op] += s
        hot.append((s, n, src))
        for h in stall_cols:
            v = r[hdr.index(h)]
            if v.isdigit():
                stalls[h] += int(v)
    per = warps * a.trips
    tot = sum(by_op.values())
    print(f"{tot} warp-instructions, {warps:.0f} warps, {tot / per:.1f} per warp{' and trip' if a.trips != 1 else ''}")
    print(f"{'opcode':24s} {'per warp':>9s} {'share':>6s} {'stall samples':>14s}")
    for op, n in by_op.most_common(a.top):
        print(f"{op:24s} {n / per:9.1f} {100 * n / tot:5.1f}% {samples[op]:14d}")
    st = sum(stalls.values()) or 1
    print("\nstall reasons (samples):")
    for h, n in stalls.most_common():
        if n:
            print(f"  {h:28s} {n:7d} {100 * n / st:5.1f}%")
    print("\nhottest instructions (stall samples, executions, SASS):")
    for s, n, src in sorted(hot, reverse=True)[:15]:
        print(f"  {s:6d} {n:9d}  {src[:90]}")


if __name__ == "__main__":
    main()
