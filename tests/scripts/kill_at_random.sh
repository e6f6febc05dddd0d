#!/usr/bin/env bash
# kill -9 at random moments (during steps and during saves: the run saves every step), then
# --resume: every resume starts from the newest complete checkpoint, and the finished run's
# metrics.jsonl holds each step once with the uninterrupted run's values bit for bit.
# Usage: kill_at_random.sh <xmoe binary> [kills] [more xmoe train arguments...]
# (train_kill_at_random_async passes --set train.async_checkpoint=true: kills then also land
# while the side thread writes.)
set -u
xmoe=$1
kills=${2:-8}
shift $(($# < 2 ? $# : 2))
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/micro_corpus.sh"
write_micro_corpus "$work/corpus"
steps=300
tiny=(--quiet "${micro_model[@]}"
  --set train.batch_size=2 --set train.eval_every=0 --set train.warmup_steps=2
  --set train.save_every=1 --set train.keep_checkpoints=2 --set "train.steps=$steps"
  --set "data.corpus=$work/corpus" --set "data.dir=$work/data" "$@")
# A metrics line without its timing (tokens_per_s differs from run to run).
values() { sed -E 's/"tokens_per_s":[^,}]*,?//' "$1/metrics.jsonl"; }

if ! "$xmoe" train "${tiny[@]}" --set "train.out_dir=$work/reference" >"$work/log" 2>&1; then
  cat "$work/log"
  echo "FAIL: the uninterrupted run failed"
  exit 1
fi

run=$work/run
resume=()
killed=0
for attempt in $(seq 1 $((kills + 20))); do
  "$xmoe" train "${tiny[@]}" "${resume[@]}" --set "train.out_dir=$run" >"$work/log" 2>&1 &
  pid=$!
  # 0.05 to 1.5 s: a start-up costs about 0.1 s and a step with its save a few ms.
  sleep "$(printf '0.%03d' $((RANDOM % 950 + 50)))"
  [[ $killed -ge $kills ]] || kill -KILL "$pid" 2>/dev/null
  wait "$pid"
  rc=$?
  if [[ $rc == 137 ]]; then
    killed=$((killed + 1))
    step=$(tail -n 1 "$run/metrics.jsonl" 2>/dev/null | grep -oE '"step":[0-9]+' | cut -d: -f2)
    echo "kill $killed: at step ${step:-0} ($(cd "$run" 2>/dev/null && echo step-* | tr '\n' ' '))"
  elif [[ $rc != 0 ]]; then
    cat "$work/log"
    echo "FAIL: run $attempt exited with rc=$rc"
    exit 1
  else
    break
  fi
  # A kill before the first checkpoint leaves nothing to resume: start over. (A step-N.tmp-*
  # folder, a save the kill interrupted, is no checkpoint.)
  if ls -d "$run"/step-* 2>/dev/null | grep -qE '/step-[0-9]+$'; then
    resume=(--resume)
  else
    resume=(--overwrite)
  fi
done
if [[ $rc != 0 ]]; then
  echo "FAIL: the run did not finish after $killed kills"
  exit 1
fi
if ! grep -q "resumed from" "$work/log" && [[ ${resume[0]:-} == --resume ]]; then
  cat "$work/log"
  echo "FAIL: the last run did not resume"
  exit 1
fi
if ! diff <(values "$work/reference") <(values "$run") >"$work/diff"; then
  head -20 "$work/diff"
  echo "FAIL: after $killed kills the metrics differ from the uninterrupted run's"
  exit 1
fi
echo "PASS: $killed kills at random moments; $steps steps equal the uninterrupted run's bit for bit"
