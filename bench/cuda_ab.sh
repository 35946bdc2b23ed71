#!/usr/bin/env bash
# A/B of the q4 tensor-core kernel in one device call: the tree as it is (A)
# against B, same bench commands, same machine, alternated twice. B is
# FILE_B (a whole src/cuda/attn_q4_tc.cu, e.g. `git show HEAD:...` carried
# in build/), else the tree with the decode instance's stages / blocks per
# SM changed by sed (STAGES_B, BLOCKS_B). Output: $OUT/ab.log. The tree is
# restored at the end.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/cuda_logs}
STAGES_B=${STAGES_B:-3}
BLOCKS_B=${BLOCKS_B:-3}
J=${J:-16}
mkdir -p "$OUT"
F=src/cuda/attn_q4_tc.cu
cp $F /tmp/ab_A.cu
if [ -n "${FILE_B:-}" ]; then
  cp "$FILE_B" /tmp/ab_B.cu
else
  sed -e "s/return ntm == 1 ? [0-9] : 4;/return ntm == 1 ? $STAGES_B : 4;/" \
      -e "s/__launch_bounds__(KVC_TC_THREADS, NTM == 1 ? [0-9] : 2)/__launch_bounds__(KVC_TC_THREADS, NTM == 1 ? $BLOCKS_B : 2)/" $F > /tmp/ab_B.cu
fi
diff /tmp/ab_A.cu /tmp/ab_B.cu | head -5
KB="./build/kvattn bench --backend cuda --quiet --no-check --reps 40"
bench() {
  $KB --preset gemma3-4b,gqa6-256 --ctx 128k --rows 1,8 --kv q4
  $KB --preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4
  $KB --preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4 --layout paged --block 16
  $KB --preset gemma3-4b --ctx 32k --batch 16 --rows 1 --kv q4 --layout paged --block 64
  $KB --preset gemma3-4b,gqa6-256 --ctx 128k --rows 1 --kv q4 --layout paged --block 16
  $KB --preset llama3-8b --ctx 32k --batch 16 --rows 1 --kv q4
  $KB --preset gemma3-4b --ctx 2k,32k --rows 1 --kv q4
}
for round in 1 2; do
  for v in A B; do
    cp /tmp/ab_$v.cu $F
    make -j"$J" build/kvattn > /dev/null 2>&1 || { echo "build $v failed"; make build/kvattn 2>&1 | tail -20; }
    echo "== $v (round $round)"
    bench 2>&1 | grep -E "q4g64"
  done
done > "$OUT/ab.log" 2>&1
cp /tmp/ab_A.cu $F
make -j"$J" build/kvattn > /dev/null 2>&1
cat "$OUT/ab.log"
