#!/usr/bin/env bash
# Nsight Compute summaries of the q4 kernel on several cases, side by side:
# duration, DRAM throughput, instructions, issue rate, stall reasons.
# Usage: OUT=dir bash bench/cuda_ncu_cmp.sh "case args" ["case args" ...]
# Output: $OUT/ncu_cmp.log
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/cuda_logs}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
KB="./build/kvattn bench --backend cuda --quiet --no-check --reps 3 --warmups 1 --rotate-gib 0"
for c in "$@"; do
  echo "== $c"
  timeout 200 "$NCU" --clock-control none --kernel-name regex:"kvc_(tc_q4|fused|merge)" --launch-skip 4 --launch-count 2 \
    --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section InstructionStats \
    --section MemoryWorkloadAnalysis --metrics smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_mio_throttle \
    $KB $c 2>&1 | grep -E "^  [a-z].*\(|Duration|DRAM Throughput|L2 Cache Throughput|Executed Instructions  |Issued Warp Per|No Eligible|Active Warps Per|Warp Cycles Per Issued|L2 Hit Rate|Mem Busy|pcsamp"
done > "$OUT/ncu_cmp.log" 2>&1
cat "$OUT/ncu_cmp.log"
