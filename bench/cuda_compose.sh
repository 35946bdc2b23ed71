#!/usr/bin/env bash
# Composable attention on the GPU machine (issue 25): build with NCCL (from
# the Python environment's nvidia-nccl package when the toolkit has no
# nccl.h), the cascade / context-parallel / merge C tests on the device, the
# Python tests of those (PyTorch CUDA tensors, a one-rank torch.distributed
# NCCL group), then the benchmarks: cascade against one batched call (B = 16,
# 32k shared prefix + 1k own tokens, q4 and bf16, 8/4/256 and 32/8/128,
# cold), the merge (R = 2..8, B·H = 8 and 512) and simulated context
# parallelism at 1M tokens, on CUDA and on the host CPU.
#   BUILD=build (make's build folder)  PY=python3 (with torch)  J=16
# Logs: $LOG (default $BUILD/compose_logs); with OUT set, one compose.log there too.
set -u -o pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PY=${PY:-python3}
J=${J:-16}
LOG=${LOG:-$BUILD/compose_logs}
mkdir -p "$LOG"
status=0
run() { # name cmd...
  local name=$1; shift
  echo "== $name: $*" | tee -a "$LOG/summary.log"
  if "$@" > "$LOG/$name.log" 2>&1; then echo "   ok" | tee -a "$LOG/summary.log"
  else echo "   FAILED (rc $?)" | tee -a "$LOG/summary.log"; status=1; fi
  tail -n 40 "$LOG/$name.log"
}
# NCCL: the toolkit's, else the Python environment's nvidia-nccl package
NCCL_ARG=()
if ! ls "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")/../include/nccl.h" > /dev/null 2>&1; then
  nh=$("$PY" -c 'import nvidia.nccl as m, os; print(list(m.__path__)[0])' 2>/dev/null || true)
  [ -n "$nh" ] && [ -f "$nh/include/nccl.h" ] && NCCL_ARG=("NCCL_HOME=$nh")
fi
# the objects whose code depends on KVA_HAVE_NCCL (make does not track flags)
rm -f "$BUILD/src/api/cp_nccl.o" "$BUILD/src/cpu/attend.o" "$BUILD/tests/test_cp.o"
run build make -j"$J" BUILD="$BUILD" "${NCCL_ARG[@]}" all "$BUILD/cascade_vs_batched"
run info "$BUILD/kvattn" info
run ctests "$BUILD/kvattn_tests" cascade cp_ merge lse_ cuda_lse
run pytests env PYTHONPATH=python KVATTN_LIB="$BUILD/libkvattn.so" "$PY" -m pytest -q \
  python/tests/test_cascade.py python/tests/test_cp.py python/tests/test_lse.py
run bench_cuda "$BUILD/cascade_vs_batched" --backend cuda --cp
run bench_cpu "$BUILD/cascade_vs_batched" --threads "$(nproc)" --cp
if [ -n "${OUT:-}" ]; then
  for f in "$LOG"/*.log; do echo "##### $f"; cat "$f"; done > "$OUT/compose.log" 2>&1
fi
exit $status
