#!/usr/bin/env bash
# Side-by-side runs of prebuilt builds in one device call: each variant is a
# folder holding its own `kvattn` and `kvattn_tests` (built here, e.g. from a
# branch, with `make BUILD=<dir> <dir>/kvattn <dir>/kvattn_tests`), carried
# to the device as one tarball so that the device spends no time compiling.
#   bash bench/cuda_variants.sh build/variants.txz   (`tar -cf - -C build/v . | xz -9`: the
#   64 MiB window shares the binaries' common code, ~1 MB per further variant)
# The tarball holds <name>/kvattn and <name>/kvattn_tests per variant (the
# names sort into the run order). For each variant: the GPU tests in TESTS
# (default: the tensor-core and block-table cases; a variant may also be one
# build run with other flags: a folder whose `kvattn` is a shell script
# exec'ing another variant's binary with extra arguments, e.g.
# `--cuda-flush memset`), racecheck on RACE (one
# test; empty to skip); then ROUNDS (default 2) rounds over the variants of
# the bench lines in BENCH (a file of `kvattn bench` argument lines; default
# below), alternated so that drift in the machine hits every variant alike.
# NCU="<kvattn bench arguments>[;<more>]": also the device time of each kernel of
# that case under Nsight Compute (first variant; clocks left as they are),
# to split a call's time between the attention kernel and the merge.
# Output: $OUT/variants.log (OUT defaults to build/cuda_logs).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/cuda_logs}
TESTS=${TESTS:-cuda_q4_tc_path cuda_q4_tc_nan_inf cuda_block_table}
RACE=${RACE-cuda_q4_tc_path}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT" build/variants
tar -xf "$1" -C build/variants || { echo "cannot unpack $1"; exit 1; }
VARS=$(cd build/variants && ls -d */ | tr -d /)
LOG="$OUT/variants.log"
KB="bench --backend cuda --quiet --no-check --reps 40"
if [ -n "${BENCH:-}" ]; then
  LINES=$(cat "$BENCH")
else
  LINES="--preset gemma3-4b,gqa6-256 --ctx 128k --rows 1 --kv q4
--preset gemma3-4b --ctx 2k --rows 1 --kv q4
--preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4
--preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4 --layout paged --block 16
--preset llama3-8b --ctx 32k --batch 16 --rows 1 --kv q4"
fi
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
  for v in $VARS; do
    echo "===== $v: tests ($TESTS)"
    timeout 300 ./build/variants/$v/kvattn_tests $TESTS 2>&1 | grep -E "FAIL|passed|skip|error" | tail -8
    echo "exit ${PIPESTATUS[0]}"
    if [ -n "$RACE" ]; then
      timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 ./build/variants/$v/kvattn_tests --quick $RACE \
        2>&1 | grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed" | tail -2
    fi
  done
  NCUB=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -n "${NCU:-}" ] && [ -n "$NCUB" ]; then
    v=$(echo $VARS | cut -d' ' -f1)
    IFS=';' read -ra NCUS <<< "$NCU"
    for c in "${NCUS[@]}"; do
      echo "===== ncu kernel times ($v): $c"
      timeout 200 "$NCUB" --clock-control none --metrics gpu__time_duration.sum --kernel-name regex:"kvc_" \
        --launch-skip 6 --launch-count 6 ./build/variants/$v/kvattn $KB $c --reps 3 --warmups 1 --rotate-gib 0 2>&1 |
        grep -E "kvc_[a-z_]*kernel|gpu__time_duration" | cut -c1-110
    done
  fi
  for r in $(seq 1 "$ROUNDS"); do
    for v in $VARS; do
      echo "===== $v (round $r)"
      while IFS= read -r line; do
        [ -n "$line" ] && timeout 200 ./build/variants/$v/kvattn $KB $line 2>&1 | grep -E "q[248]g[0-9]+ |bf16 |f16 |f32 |x$"
      done <<< "$LINES"
    done
  done
} > "$LOG" 2>&1
cat "$LOG"
