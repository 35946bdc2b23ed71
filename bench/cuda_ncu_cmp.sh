#!/usr/bin/env bash
# Nsight Compute summaries of the attention kernels (fused, tensor-core,
# merge) on several cases, side by side: duration, DRAM and L2 traffic,
# instructions, issue rate, stall reasons.
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
  timeout 200 "$NCU" --clock-control none --kernel-name regex:"kvc_(tc|tcw|tcd|wg|fused|merge)_kernel" --launch-skip 4 --launch-count 2 \
    --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section InstructionStats \
    --section MemoryWorkloadAnalysis --metrics smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_mio_throttle,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct,smsp__inst_executed.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,smsp__cycles_active.avg \
    $KB $c 2>&1 | grep -E "^  [a-z].*\(|dram__|lts__|smsp__inst|l1tex__|smsp__cycles|Duration|DRAM Throughput|L2 Cache Throughput|Executed Instructions  |Issued Warp Per|No Eligible|Active Warps Per|Warp Cycles Per Issued|L2 Hit Rate|Mem Busy|pcsamp"
done > "$OUT/ncu_cmp.log" 2>&1
cat "$OUT/ncu_cmp.log"
