#!/usr/bin/env bash
# The benchmarks survive a run that does not fit (issue 35): under XMOE_MEMORY_LIMIT a shape or
# preset too large for the capped allocator prints an "out_of_memory" line with the bytes asked,
# free and total, and the next one still runs; another error prints an "error" line, the next one
# runs too, and only that makes the exit code 1.
# Usage: bench_out_of_memory.sh <bench_moe_layer> <bench_train_step>
set -u
moe=$1
train=$2
fails=0
pass() { echo "ok   - $1"; }
fail() { echo "FAIL - $1"; fails=$((fails + 1)); }
# line N of OUT (its JSON lines only) matches PATTERN (grep -E)
line_is() {
  local name=$1 out=$2 n=$3 pattern=$4
  local line
  line=$(grep '^{"bench"' <<<"$out" | sed -n "${n}p")
  if grep -qE -- "$pattern" <<<"$line"; then
    pass "$name"
  else
    fail "$name: line $n is '$line', wanted /$pattern/"
  fi
}
rc_is() {
  if [[ $2 == "$3" ]]; then pass "$1 (exit $2)"; else fail "$1: exit $2, wanted $3"; fi
}
cap=$((4 * 2**20))  # 4 MiB: the small shape fits, 512x256x256x64x2 (50 MiB of weights) does not
small=256x64x32x8x2

out=$(XMOE_MEMORY_LIMIT=$cap "$moe" --quick --iters 1 --warmup 0 --impls pft \
  --shapes "$small,512x256x256x64x2,$small" 2>/dev/null)
rc_is "moe layer: a shape that does not fit is a result" $? 0
line_is "moe layer: the first shape ran" "$out" 1 "\"shape\":\"$small\".*\"status\":\"ok\".*\"median_ms\""
line_is "moe layer: the second did not fit, bytes named" "$out" 2 \
  "\"shape\":\"512x256x256x64x2\".*\"status\":\"out_of_memory\",\"bytes_asked\":[1-9][0-9]*,\"bytes_free\":[0-9]+,\"bytes_total\":$cap,"
line_is "moe layer: the next shape ran after it" "$out" 3 "\"shape\":\"$small\".*\"status\":\"ok\""

out=$(XMOE_MEMORY_LIMIT=$cap "$moe" --quick --iters 1 --warmup 0 --impls pft,padded --cf -1 \
  --shapes "$small,$small" 2>/dev/null)
rc_is "moe layer: another error fails the run" $? 1
line_is "moe layer: the error is a line with its message" "$out" 2 \
  "\"impl\":\"xmoe_padded\".*\"status\":\"error\",\"message\":\".*moe.capacity_factor = -1 must be > 0"
line_is "moe layer: the next shape ran after the error" "$out" 3 "\"impl\":\"xmoe_pft\".*\"status\":\"ok\""

out=$(XMOE_MEMORY_LIMIT=$((200 * 2**20)) "$train" --preset moe-1b,nosuch,tiny --device cpu \
  --steps 1 --warmup 0 --set train.batch_size=1 --set train.seq_len=32 2>/dev/null)
rc_is "train step: an unknown preset fails the run" $? 1
line_is "train step: moe-1b did not fit in 200 MiB" "$out" 1 \
  "\"preset\":\"moe-1b\",\"device\":\"cpu\",\"status\":\"out_of_memory\",\"bytes_asked\":[1-9]"
line_is "train step: the unknown preset is an error line" "$out" 2 \
  "\"preset\":\"nosuch\",\"device\":\"cpu\",\"status\":\"error\""
line_is "train step: tiny ran after both" "$out" 4 \
  "\"bench\":\"train_step_summary\",\"preset\":\"tiny\".*\"status\":\"ok\""

if ((fails)); then
  echo "$fails check(s) failed"
  exit 1
fi
echo "all checks passed"
