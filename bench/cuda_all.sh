#!/usr/bin/env bash
# One device call for the CUDA backend: build (make), the GPU tests against the
# oracle, compute-sanitizer memcheck + racecheck on a quick subset, the
# issue's target shapes through `kvattn bench --backend cuda` (contiguous and
# paged, checked against the oracle), the CUDA benchmark (bench/cuda_bench.cu)
# and PyTorch SDPA on the same shapes (bench/torch_sdpa.py) with the ratios.
# Logs go to $LOG (default build/cuda_logs): summary, build, tests (+ the ASan
# run), sanitizer (memcheck + racecheck), kvbench, bench, kvattn_cuda.jsonl,
# torch_sdpa, pytest. With OUT set (the device tool's folder that comes back,
# at most 8 files), they are also written there as two files: cuda_all.log
# (every log, each under a header) and kvattn_cuda.jsonl.
# The host CPU (an AVX-512 + AMX Xeon on the H200 machine) runs the whole C
# test binary at every SIMD level it has (KVATTN_SIMD caps the level: full
# at avx512, --quick at avx2 and portable), and a CPU verify/decode bench.
#   STAGES="build test seeds cpu cpubench asan memcheck racecheck kvbench bench torch pytest" (default: all)
#   J=16 (make jobs)
#   PREBUILT=<file.txz>: build/kvattn and build/kvattn_tests made elsewhere
#   (`make`, then `strip --strip-debug` and `tar -cf - -C build kvattn
#   kvattn_tests | xz -9 > F`: xz -9's 64 MiB window shares the two
#   binaries' common code, ~17 MB, and each further build variant adds
#   ~1 MB, within a device call's carry), unpacked into build/
#   so that the device spends no time compiling; run it without the build
#   stage (and without bench and pytest, which need the libraries)
set -u -o pipefail
cd "$(dirname "$0")/.."
RET=${OUT:-}
OUT=${LOG:-build/cuda_logs} # where the logs are written (below: $OUT)
J=${J:-16}
STAGES=${STAGES:-build test seeds cpu cpubench asan memcheck racecheck kvbench bench torch pytest}
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
status=0
note() { echo "== $*" | tee -a "$OUT/summary.log"; }
run() { # name timeout_s cmd...: runs with a time limit, records the exit code
  local name=$1 lim=$2; shift 2
  local t0=$SECONDS
  timeout "$lim" "$@"
  local rc=$?
  note "$name: exit $rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
  return $rc
}

date -u +"%Y-%m-%dT%H:%M:%SZ" | tee "$OUT/summary.log"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee -a "$OUT/summary.log"
nvcc --version | tail -2 | tee -a "$OUT/summary.log"

if [ -n "${PREBUILT:-}" ]; then
  mkdir -p build && tar -xJf "$PREBUILT" -C build || { note "cannot unpack $PREBUILT"; exit 1; }
  note "prebuilt: $(cd build && ls -l kvattn kvattn_tests | awk '{print $5, $NF}' | tr '\n' ' ')"
fi
if has build; then
  run build 300 make -k -j"$J" all > "$OUT/build.log" 2>&1
  run build-bench 200 nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Iinclude bench/cuda_bench.cu \
    build/libkvattn.a -o build/cuda_bench -lcudart -lm -lpthread >> "$OUT/build.log" 2>&1
  tail -3 "$OUT/build.log"
  ./build/kvattn info 2>&1 | tee -a "$OUT/summary.log"
fi
# The CUDA tests as SHARDS (default 3) processes at once, plus the longest
# (cuda_rotation_vs_oracle) alone (the oracle runs on the host's cores, the
# GPU is shared; 2026-12-02: ~190 s against ~390 s in one process): the
# test names holding "cuda", round-robin, by exact name; each shard's log
# appended to $2.
cuda_shards() { # name log [kvattn_tests options...]
  local name=$1 log=$2; shift 2
  local names i=0 n=${SHARDS:-3} pids=() k
  names=$(./build/kvattn_tests --list | grep cuda | grep -vx cuda_rotation_vs_oracle)
  local -a sh
  for t in $names; do sh[$((i % n))]+=" =$t"; i=$((i + 1)); done
  sh[$n]=" =cuda_rotation_vs_oracle"
  for k in $(seq 0 "$n"); do
    run "$name-$k" 300 ./build/kvattn_tests "$@" ${sh[$k]} > "$OUT/$name.$k.log" 2>&1 &
    pids+=($!)
  done
  for k in "${!pids[@]}"; do wait "${pids[$k]}" || status=1; done
  for k in $(seq 0 "$n"); do cat "$OUT/$name.$k.log" >> "$log"; rm -f "$OUT/$name.$k.log"; done
}
if has test; then
  : > "$OUT/tests.log"
  cuda_shards tests-cuda "$OUT/tests.log"
  grep -E "FAIL|passed|skip" "$OUT/tests.log" | tail -15
fi
if has seeds; then # the CUDA oracle tests over fresh seeds (each run prints its seed)
  for i in 1 2 3; do
    cuda_shards seeds-cuda-$i "$OUT/tests.log" --quick --seed $(( (RANDOM << 15) | RANDOM ))
  done
  grep -E "FAIL" "$OUT/tests.log" | tail -5
fi
if has cpu; then # every SIMD level of the host CPU (no GPU visible: CUDA tests skip); full at the best (its oracle tables run every level the CPU has, avxvnni included), --quick below
  for lvl in avx512 avx2 portable; do
    q=--quick; [ "$lvl" = avx512 ] && q=
    run cpu-$lvl 420 env KVATTN_SIMD=$lvl CUDA_VISIBLE_DEVICES= ./build/kvattn_tests $q > "$OUT/cpu_$lvl.log" 2>&1
    grep -E "simd|FAIL|passed" "$OUT/cpu_$lvl.log" | head -8
  done
  cat "$OUT"/cpu_*.log > "$OUT/cpu.log"
fi
if has cpubench; then # CPU decode and verify at each level (16 threads, cold)
  for lvl in avx512 avxvnni avx2; do
    run cpubench-$lvl 240 ./build/kvattn bench --backend cpu --simd $lvl --quiet --preset gemma3-4b,gqa6-256,llama3-8b \
      --ctx 32k --rows 1,8 --kv q4,q8,bf16
  done > "$OUT/cpubench.log" 2>&1
  grep -E "PASS|FAIL|ERROR|ceiling" "$OUT/cpubench.log" | head -60
fi
if has asan; then # make test-c's second run: the tests under ASan + UBSan, quick table
  run asan-build 300 make -j"$J" build/asan/kvattn_tests >> "$OUT/build.log" 2>&1
  export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
  run asan-tests 300 ./build/asan/kvattn_tests --quick cuda >> "$OUT/tests.log" 2>&1
  unset ASAN_OPTIONS UBSAN_OPTIONS
  grep -E "ERROR|FAIL|passed" "$OUT/tests.log" | tail -5
fi
if has memcheck; then
  run memcheck 400 compute-sanitizer --tool memcheck --error-exitcode 9 ./build/kvattn_tests --quick cuda \
    > "$OUT/sanitizer.log" 2>&1
  grep -E "ERROR SUMMARY|passed" "$OUT/sanitizer.log" | tail -3
fi
if has racecheck; then
  run racecheck 180 compute-sanitizer --tool racecheck --error-exitcode 9 ./build/kvattn_tests --quick cuda_nan_inf \
    >> "$OUT/sanitizer.log" 2>&1
  run racecheck-tc 180 compute-sanitizer --tool racecheck --error-exitcode 9 ./build/kvattn_tests --quick cuda_q4_tc_path \
    >> "$OUT/sanitizer.log" 2>&1
  run racecheck-table 180 compute-sanitizer --tool racecheck --error-exitcode 9 ./build/kvattn_tests --quick \
    cuda_block_table >> "$OUT/sanitizer.log" 2>&1
  run racecheck-tcd 180 compute-sanitizer --tool racecheck --error-exitcode 9 ./build/kvattn_tests --quick \
    cuda_q4_tcd_path >> "$OUT/sanitizer.log" 2>&1
  run racecheck-wg 180 compute-sanitizer --tool racecheck --error-exitcode 9 ./build/kvattn_tests --quick \
    cuda_q4_wg_path >> "$OUT/sanitizer.log" 2>&1
  run racecheck-wgbf 180 compute-sanitizer --tool racecheck --error-exitcode 9 ./build/kvattn_tests --quick \
    cuda_bf16_wg_path >> "$OUT/sanitizer.log" 2>&1
  run racecheck-wg512 180 compute-sanitizer --tool racecheck --error-exitcode 9 ./build/kvattn_tests --quick \
    cuda_bf16_wg512 >> "$OUT/sanitizer.log" 2>&1
  run racecheck-wgfp8 180 compute-sanitizer --tool racecheck --error-exitcode 9 ./build/kvattn_tests --quick \
    cuda_fp8_wg_path >> "$OUT/sanitizer.log" 2>&1
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed" "$OUT/sanitizer.log" | tail -3
fi
if has kvbench; then # the issue's target shapes, each checked against the oracle
  KB="./build/kvattn bench --backend cuda --quiet --reps 30"
  {
    run kvbench-128k 240 $KB --preset gemma3-4b,gqa6-256 --ctx 128k --rows 1,8 --kv q4
    run kvbench-verify 240 $KB --preset llama3-8b --ctx 32k --batch 4 --rows 8 --kv q4
    run kvbench-verify-paged 240 $KB --preset gqa6-256 --ctx 128k --rows 8 --kv q4 --layout paged --block 16
    # 16 and 32 query vectors per KV head (the per-warp kernel's blocks of 16), contiguous and paged
    run kvbench-verify16 240 $KB --preset gemma3-4b,llama3-8b --ctx 128k --rows 4,8,16 --kv q4
    run kvbench-verify16-paged 240 $KB --preset gemma3-4b,llama3-8b --ctx 128k --rows 8 --kv q4 --layout paged --block 16
    run kvbench-b16 240 $KB --preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4,bf16
    run kvbench-paged16 240 $KB --preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4,bf16 --layout paged --block 16
    run kvbench-paged64 240 $KB --preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4 --layout paged --block 64
    run kvbench-paged128k 240 $KB --preset gemma3-4b,gqa6-256 --ctx 128k --rows 1 --kv q4 --layout paged --block 16
    run kvbench-bf16-256k 240 $KB --preset gemma3-4b --ctx 64k --batch 4 --rows 1 --kv bf16
    run kvbench-bf16-gqa6 240 $KB --preset gqa6-256 --ctx 128k --rows 1,8 --kv bf16
    run kvbench-q8 240 $KB --preset gemma3-4b,gqa6-256 --ctx 128k --rows 1 --kv q8
    run kvbench-q8-b16 240 $KB --preset gemma3-4b,llama3-8b --ctx 32k --batch 16 --rows 1 --kv q8
    run kvbench-llama 240 $KB --preset llama3-8b --ctx 32k --batch 16 --rows 1 --kv bf16,q4
    run kvbench-llama-paged 240 $KB --preset llama3-8b --ctx 32k --batch 16 --rows 1 --kv bf16,q4 --layout paged --block 16
    # head dim 64 (Llama-3.2-1B / 3B class: MLX's group 64 is one group per row): decode and verify, q4 and q8, paged
    run kvbench-d64 240 $KB --heads 32:8 --dim 64 --ctx 32k --batch 16 --rows 1 --kv q4,q8,bf16
    run kvbench-d64-verify 240 $KB --heads 32:8 --dim 64 --ctx 32k --batch 4 --rows 8 --kv q4,bf16
    run kvbench-d64-paged 240 $KB --heads 32:8 --dim 64 --ctx 32k --batch 16 --rows 1 --kv q4 --layout paged --block 16
    # the warpgroup kernel's fp8 rows and its 16-bit instances at head dim 512 (decode from 3 vectors there)
    run kvbench-fp8 240 $KB --preset gemma3-4b,gqa6-256 --ctx 128k --rows 1,8 --kv fp8
    run kvbench-d512 240 $KB --heads 16:8 --dim 512 --ctx 32k,128k --rows 1,8 --kv bf16,q4
    run kvbench-d512-gqa4 240 $KB --heads 8:2 --dim 512 --ctx 32k,128k --rows 1,8 --kv bf16
    # the pool's scatter apart from the kernel: the same paged cases with each sequence's blocks in order
    run kvbench-paged-inorder 240 $KB --preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4,bf16 --layout paged \
      --block 16 --block-order sequential
  } > "$OUT/kvbench.log" 2>&1
  grep -vE "^\[|^$" "$OUT/kvbench.log" | grep -E "PASS|FAIL|ERROR|bandwidth|x$|==" | head -60
fi
if has bench; then
  rm -f "$OUT/kvattn_cuda.jsonl"
  run bench 240 ./build/cuda_bench "$OUT/kvattn_cuda.jsonl" > "$OUT/bench.log" 2>&1
  cat "$OUT/bench.log"
fi
if has torch; then
  export PYTHONUNBUFFERED=1
  run torch 300 python3 bench/torch_sdpa.py "$OUT/kvattn_cuda.jsonl" > "$OUT/torch_sdpa.log" 2>&1
  tail -12 "$OUT/torch_sdpa.log"
fi
if has pytest; then
  # the system Python (PyTorch with CUDA lives there on the device machine)
  run pytest 300 env PYTHONPATH=python python3 -m pytest -q -rs python/tests/test_cuda.py python/tests/test_cuda_arrays.py \
    > "$OUT/pytest.log" 2>&1
  tail -3 "$OUT/pytest.log"
fi
cat "$OUT/summary.log"
if [ -n "$RET" ] && [ "$RET" != "$OUT" ]; then # two files back, not one per log
  mkdir -p "$RET"
  for f in summary build tests cpu cpubench sanitizer kvbench bench torch_sdpa pytest; do
    [ -f "$OUT/$f.log" ] && { echo "===== $f.log"; cat "$OUT/$f.log"; }
  done > "$RET/cuda_all.log"
  [ -f "$OUT/kvattn_cuda.jsonl" ] && cp "$OUT/kvattn_cuda.jsonl" "$RET/"
fi
exit $status
