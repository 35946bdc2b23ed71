#!/usr/bin/env bash
# Short GPU calls (bench/README.md): the kernel and split count of each case,
# hot against rotated caches, Nsight Compute durations of the 2k cases.
#   BIN=./build/variants/<name>/kvattn bash bench/probe_small.sh
cd "$(dirname "$0")/.." 2>/dev/null || true
BIN=${BIN:-./build/kvattn}
KB="$BIN bench --backend cuda --quiet --no-check --reps 30"
echo "== plans and times (cold, rotated)"
$KB --json --preset gemma3-4b,gqa6-256,llama3-8b --ctx 2k,8k,32k --rows 1,8 --kv q4 | python3 -c '
import sys,json
for l in sys.stdin:
    try: d=json.loads(l)
    except Exception: continue
    print("%-10s %6d L=%-2d %8.1f us  %s" % (d["preset"], d["ctx"], d["rows"], d["us"], d["kernel"]))'
echo "== hot (--rotate-gib 0)"
$KB --rotate-gib 0 --preset gemma3-4b --ctx 2k --rows 1,8 --kv q4,bf16 | grep -E "q4g64|bf16 "
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for c in "--preset gemma3-4b --ctx 2k --rows 8 --kv q4" "--preset gemma3-4b --ctx 2k --rows 1 --kv q4" "--preset gqa6-256 --ctx 2k --rows 8 --kv q4"; do
  echo "== ncu: $c"
  timeout 120 $NCU --clock-control none --cache-control none --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_active.max,launch__grid_size,launch__registers_per_thread \
    --kernel-name regex:kvc_ --launch-skip 6 --launch-count 4 $KB $c --reps 3 --warmups 1 --rotate-gib 0 2>&1 | grep -E "kvc_[a-z_]*kernel|duration|inst_exec|cycles_active|grid_size|registers" | cut -c1-120
done
