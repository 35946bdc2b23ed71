#!/usr/bin/env bash
# Where the time of the q4 decode goes, in one device call (after
# bench/cuda_all.sh's build stage): the SASS of the q4 kernels, Nsight
# Compute on one decode launch and its merge (speed of light, instruction
# mix, warp states, per-instruction execution counts), and a sweep over the
# cache length whose intercept is the fixed cost of a call.
# Logs go to $OUT (default build/cuda_logs): profile.log (with the opcode
# mix and stall reasons of bench/ncu_mix.py), tc.sass, ncu_source.csv.
#   CASE="--preset gemma3-4b --ctx 128k --rows 1 --kv q4" (the profiled case)
#   KERNEL="kvc_tcw?_kernel" (regex of the attention kernel the case runs:
#   kvc_fused_kernel for 16-bit rows at 1-5 query vectors per KV head)
#   SWEEP=0 skips the sweep; the SASS dump needs build/libkvattn.a
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/cuda_logs}
CASE=${CASE:---preset gemma3-4b --ctx 128k --rows 1 --kv q4}
KERNEL=${KERNEL:-kvc_tcw?_kernel}
mkdir -p "$OUT"
KB="./build/kvattn bench --backend cuda --quiet --no-check"
{
  [ "${SWEEP:-1}" = 0 ] || {
  echo "== sweep over N (q4 decode 8/4/256 and 24/4/256, B = 1): intercept = fixed cost"
  $KB --preset gemma3-4b,gqa6-256 --ctx 2k,8k,32k,128k --rows 1 --kv q4 --reps 30
  }
  echo "== registers / spills"
  cuobjdump --dump-resource-usage build/libkvattn.a 2>/dev/null | grep -A1 -E "$KERNEL|kvc_merge" | head -40
} > "$OUT/profile.log" 2>&1
cuobjdump --dump-sass build/libkvattn.a 2>/dev/null | awk -v k="$KERNEL" '/Function : /{p = $0 ~ k} p' \
  > "$OUT/tc.sass"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  {
    echo "== ncu: $CASE ($KERNEL and the merge)"
    timeout 240 "$NCU" --clock-control none --kernel-name regex:"$KERNEL|kvc_merge_kernel" --launch-skip 4 --launch-count 2 \
      --section SpeedOfLight --section InstructionStats --section WarpStateStats --section SchedulerStats \
      --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section SourceCounters \
      -o "$OUT/prof" -f $KB $CASE --reps 3 --warmups 1 --rotate-gib 0 > /dev/null
    "$NCU" --import "$OUT/prof.ncu-rep" --print-units base 2>&1 | grep -v "^    ---" | head -400
  } >> "$OUT/profile.log" 2>&1
  timeout 120 "$NCU" --import "$OUT/prof.ncu-rep" --page source --print-source sass --csv --kernel-name regex:"$KERNEL" \
    > "$OUT/ncu_source.csv" 2>&1
  python3 bench/ncu_mix.py "$OUT/ncu_source.csv" >> "$OUT/profile.log" 2>&1 # opcode mix, stalls, hot spots
  rm -f "$OUT/prof.ncu-rep"
else
  echo "no ncu on this machine" >> "$OUT/profile.log"
fi
tail -5 "$OUT/profile.log"
