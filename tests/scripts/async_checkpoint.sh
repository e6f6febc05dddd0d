#!/usr/bin/env bash
# train.async_checkpoint: checkpoints written on the side thread equal the synchronous ones byte
# for byte (the tensor files, and the manifest but for the run folder and the key itself), in
# one process and with 2 MPI ranks (ep = 2: expert shards, the ranks' votes); a run stopped
# and resumed with async saves reproduces the uninterrupted run's losses bit for bit; SIGTERM
# during async saves stops with a complete checkpoint that it names.
# Usage: async_checkpoint.sh <xmoe binary> [mpiexec]
set -u
xmoe=$1
mpiexec=${2:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/micro_corpus.sh"
write_micro_corpus "$work/corpus"
tiny=(--quiet "${micro_model[@]}"
  --set train.batch_size=2 --set train.eval_every=0 --set train.warmup_steps=2
  --set train.save_every=3 --set train.steps=20
  --set "data.corpus=$work/corpus" --set "data.dir=$work/data")
values() { sed -E 's/"tokens_per_s":[^,}]*,?//' "$1/metrics.jsonl"; }
fail() {
  cat "$work/log"
  echo "FAIL: $*"
  exit 1
}
train() {  # train <out_dir> <args...>: launcher from $launch
  local out=$1
  shift
  "${launch[@]}" "$xmoe" train "${tiny[@]}" "$@" --set "train.out_dir=$out" >"$work/log" 2>&1
}
# Every checkpoint of <a> equals <b>'s: same folders, same files, tensor files byte for byte.
same_checkpoints() {
  local a=$1 b=$2
  [[ "$(cd "$a" && echo step-*)" == "$(cd "$b" && echo step-*)" ]] ||
    fail "checkpoint folders differ: $(cd "$a" && echo step-*) vs $(cd "$b" && echo step-*)"
  for d in "$a"/step-*; do
    local n
    n=$(basename "$d")
    for f in "$d"/*; do
      local g
      g="$b/$n/$(basename "$f")"
      if [[ $f == *manifest.json ]]; then
        diff <(sed -e 's/async_checkpoint: true/async_checkpoint: false/' -e "s#$a#OUT#g" "$f") \
          <(sed -e "s#$b#OUT#g" "$g") >/dev/null || fail "$f differs from $g"
      else
        cmp -s "$f" "$g" || fail "$f differs from $g byte for byte"
      fi
    done
  done
  echo "same checkpoints: $(cd "$a" && echo step-*)"
}

launch=()
train "$work/sync" || fail "the synchronous run failed"
train "$work/async" --set train.async_checkpoint=true || fail "the async run failed"
same_checkpoints "$work/async" "$work/sync"

# Stopped after step 10 (--stop-after saves it), resumed to 20, all saves async.
train "$work/resumed" --set train.async_checkpoint=true --stop-after 10 ||
  fail "the first half failed"
train "$work/resumed" --resume || fail "the resumed half failed"
grep -q "resumed from" "$work/log" || fail "the second half did not resume"
diff <(values "$work/sync") <(values "$work/resumed") >/dev/null ||
  fail "the resumed async run's metrics differ from the uninterrupted run's"
echo "resumed at step 10: the metrics equal the uninterrupted run's bit for bit"

# SIGTERM while saving every step asynchronously: the run waits for the writer, says which
# checkpoint it saved, exits 143, and that checkpoint is complete.
launch=()
"$xmoe" train "${tiny[@]}" --set train.async_checkpoint=true --set train.save_every=1 \
  --set train.steps=100000 --set "train.out_dir=$work/signal" >"$work/log" 2>&1 &
pid=$!
for _ in $(seq 1 200); do
  [[ -n "$(ls -d "$work"/signal/step-* 2>/dev/null)" ]] && break
  sleep 0.05
done
kill -TERM "$pid"
wait "$pid"
rc=$?
[[ $rc == 143 ]] || fail "SIGTERM with async saves: expected exit code 143, got $rc"
saved=$(grep -oE "received SIGTERM at step [0-9]+: saved step-[0-9]+" "$work/log" | grep -oE "step-[0-9]+$")
[[ -n "$saved" ]] || fail "no line naming the saved checkpoint"
"$xmoe" inspect "$work/signal/$saved" >/dev/null || fail "$saved does not load"
echo "SIGTERM: saved $saved (async), exit 143"

if [[ -n "$mpiexec" ]]; then
  launch=("$mpiexec" --oversubscribe -np 2)
  train "$work/sync2" --set parallel.ep=2 || fail "the synchronous 2-rank run failed"
  train "$work/async2" --set parallel.ep=2 --set train.async_checkpoint=true ||
    fail "the async 2-rank run failed"
  same_checkpoints "$work/async2" "$work/sync2"
fi
echo "PASS: async checkpoints equal the synchronous ones and resume bit for bit"
