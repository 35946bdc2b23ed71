#!/usr/bin/env bash
# A/B of the tensor-core kernels in one device call: the tree as it is (A)
# against B, same bench commands, same machine, alternated twice. B is the
# tree with PATCH_B applied (`git apply`; e.g. a `git diff` carried in
# build/ab), else FILE_B (a whole src/cuda/attn_tc.cu, e.g. `git show
# HEAD:...` carried in build/ab), else the tree with the decode instance's
# stages / blocks per SM changed by sed (STAGES_B, BLOCKS_B). Output:
# $OUT/ab.log. The tree is restored at the end. BENCH: a file of `kvattn
# bench` argument lines to run instead of the built-in sets (SHORT=1 or all).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/cuda_logs}
STAGES_B=${STAGES_B:-3}
BLOCKS_B=${BLOCKS_B:-3}
J=${J:-16}
mkdir -p "$OUT"
F=src/cuda/attn_tc.cu
FILES="$F src/cuda/context.cu src/cuda/launch.cuh"
mkdir -p /tmp/ab_A /tmp/ab_B
for f in $FILES; do cp "$f" /tmp/ab_A/"$(basename "$f")"; done
if [ -n "${PATCH_B:-}" ]; then
  git apply "$PATCH_B" || { echo "PATCH_B does not apply"; exit 1; }
elif [ -n "${FILE_B:-}" ]; then
  cp "$FILE_B" $F
else
  sed -i -e "s/return ntm == 1 ? [0-9] : 4;/return ntm == 1 ? $STAGES_B : 4;/" \
      -e "s/__launch_bounds__(KVC_TC_THREADS, NTM == 1 ? [0-9] : 2)/__launch_bounds__(KVC_TC_THREADS, NTM == 1 ? $BLOCKS_B : 2)/" $F
fi
for f in $FILES; do cp "$f" /tmp/ab_B/"$(basename "$f")"; done
use() { # the files of version $1 where they differ (the rest keep their times: no rebuild)
  for f in $FILES; do cmp -s /tmp/ab_$1/"$(basename "$f")" "$f" || cp /tmp/ab_$1/"$(basename "$f")" "$f"; done
}
use A
for f in $FILES; do diff /tmp/ab_A/"$(basename "$f")" /tmp/ab_B/"$(basename "$f")" | head -4; done
KB="./build/kvattn bench --backend cuda --quiet --no-check --reps 40"
bench() {
  if [ -n "${BENCH:-}" ]; then # a file of `kvattn bench` argument lines
    while IFS= read -r line; do [ -n "$line" ] && $KB $line; done < "$BENCH"
    return
  fi
  if [ -n "${SHORT:-}" ]; then # SHORT=1: the 128k decode and verify shapes, B = 16 decode
    $KB --preset gemma3-4b,gqa6-256 --ctx 128k --rows 1,8 --kv q4
    $KB --preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4
    $KB --preset llama3-8b --ctx 32k --rows 8 --kv q4,bf16
    $KB --preset gqa6-256 --ctx 128k --rows 8 --kv bf16
    return
  fi
  $KB --preset gemma3-4b,gqa6-256 --ctx 128k --rows 1,8 --kv q4
  $KB --preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4
  $KB --preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4 --layout paged --block 16
  $KB --preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4 --layout paged --block 64
  $KB --preset gemma3-4b,gqa6-256 --ctx 128k --rows 1 --kv q4 --layout paged --block 16
  $KB --preset llama3-8b --ctx 32k --batch 16 --rows 1 --kv q4
  $KB --preset gemma3-4b --ctx 2k,32k --rows 1 --kv q4
  $KB --preset llama3-8b --ctx 32k --rows 8 --kv q4
  $KB --preset gqa6-256 --ctx 128k --rows 1,8 --kv bf16
}
for round in 1 2; do
  for v in A B; do
    use $v
    make -j"$J" build/kvattn > /dev/null 2>&1 || { echo "build $v failed"; make build/kvattn 2>&1 | tail -20; }
    echo "== $v (round $round)"
    bench 2>&1 | grep -E "q4g64|bf16 "
  done
done > "$OUT/ab.log" 2>&1
use A
make -j"$J" build/kvattn > /dev/null 2>&1
cat "$OUT/ab.log"
