#!/usr/bin/env bash
# SIGTERM/SIGINT during `xmoe train` finish the step, save step-N and exit 128 + the signal with
# "received SIGTERM at step N: saved step-N, stopping"; a second signal stops at once, saving
# nothing; under mpirun a signal to one rank stops every rank after the same step (the save is
# collective). train.keep_checkpoints keeps the newest checkpoints; a bad value is refused.
# Usage: train_signals.sh <xmoe binary> [mpiexec]
set -u
xmoe=$1
mpiexec=${2:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/expect.sh"
source "$(dirname "$0")/micro_corpus.sh"
write_micro_corpus "$work/corpus"
tiny=(--quiet "${micro_model[@]}"
  --set train.batch_size=2 --set train.eval_every=0 --set train.warmup_steps=2
  --set "data.corpus=$work/corpus" --set "data.dir=$work/data")

# Waits (at most 60 s) until $1/metrics.jsonl has at least $2 lines.
wait_for_steps() {
  for _ in $(seq 1 600); do
    [[ -f $1/metrics.jsonl && $(wc -l <"$1/metrics.jsonl") -ge $2 ]] && return 0
    sleep 0.1
  done
  return 1
}
# Kills $1 if it still runs after 60 s: a bound on each run (not `timeout`, which would pass a
# signal on twice: to its child and to its process group).
bound() { (sleep 60 && kill -KILL "$1" 2>/dev/null) >/dev/null 2>&1 & }
last_logged_step() { tail -n 1 "$1/metrics.jsonl" | grep -oE '"step":[0-9]+' | cut -d: -f2; }

# Signal $2 to one process: the step finishes, step-N is saved, the exit code is 128 + signal.
one_signal() {
  local name=$1 sig=$2 code=$3 run=$work/run-$1
  "$xmoe" train "${tiny[@]}" --set train.steps=100000 --set train.save_every=0 \
    --set "train.out_dir=$run" >"$run.log" 2>&1 &
  local pid=$!
  bound $pid
  wait_for_steps "$run" 3 || fail "$name: the run logged no steps"
  kill -s "$sig" "$pid"
  wait "$pid"
  local rc=$? n
  n=$(last_logged_step "$run")
  if [[ $rc == "$code" ]] &&
    grep -q "received $name at step $n: saved step-$n, stopping" "$run.log" &&
    "$xmoe" inspect "$run/step-$n" >/dev/null && ! ls -d "$run"/step-*.tmp-* 2>/dev/null; then
    pass "$name: rc=$rc, saved step-$n, stopped"
  else
    fail "$name (rc=$rc, wanted $code; last logged step $n)"
    sed 's/^/       | /' "$run.log" | tail -5
  fi
  expect "$name: the run resumes from step-$n" 0 "resumed from .*step-$n at step $n" \
    "$xmoe" train --resume --set "train.out_dir=$run" --set "train.steps=$((n + 2))"
}
one_signal SIGTERM TERM 143
one_signal SIGINT INT 130

# A second signal before the step ends (a slow step: a larger model and batch): the process
# ends by it, with no checkpoint.
run=$work/run-twice
"$xmoe" train "${tiny[@]}" --set train.steps=100000 --set train.save_every=0 \
  --set model.d_model=256 --set model.dense_hidden=1024 --set model.moe.expert_hidden=512 \
  --set train.batch_size=64 --set "train.out_dir=$run" >"$run.log" 2>&1 &
pid=$!
bound $pid
wait_for_steps "$run" 1 || fail "twice: the run logged no steps"
kill -TERM "$pid"
sleep 0.02
kill -TERM "$pid" 2>/dev/null
wait "$pid"
rc=$?
if [[ $rc == 143 ]] && ! grep -q "received SIGTERM" "$run.log" &&
  ! ls -d "$run"/step-* 2>/dev/null; then
  pass "a second SIGTERM stops at once (rc=$rc, no checkpoint)"
else
  fail "a second SIGTERM (rc=$rc, wanted 143, no save line, no step-N)"
  sed 's/^/       | /' "$run.log" | tail -5
fi

# train.keep_checkpoints: the newest two of eight saves remain.
run=$work/run-keep
expect "keep_checkpoints = 2 trains" 0 "" "$xmoe" train "${tiny[@]}" --set train.steps=8 \
  --set train.save_every=1 --set train.keep_checkpoints=2 --set "train.out_dir=$run"
kept=$(cd "$run" && echo step-*)
[[ $kept == "step-7 step-8" ]] && pass "keep_checkpoints = 2 keeps step-7 step-8" ||
  fail "keep_checkpoints = 2 left: $kept"
expect "keep_checkpoints < 0 is refused" 1 "train.keep_checkpoints" "$xmoe" train "${tiny[@]}" \
  --set train.keep_checkpoints=-1 --set "train.out_dir=$work/run-bad"

# Under mpirun, SIGTERM to rank 1 alone: both ranks save step-N together and stop.
if [[ -n $mpiexec ]]; then
  run=$work/run-mpi
  "$mpiexec" --oversubscribe -np 2 "$xmoe" train "${tiny[@]}" --set parallel.ep=2 \
    --set train.steps=100000 --set train.save_every=5 --set train.keep_checkpoints=1 \
    --set "train.out_dir=$run" >"$run.log" 2>&1 &
  pid=$!
  bound $pid
  wait_for_steps "$run" 12 || fail "mpi: the run logged no steps"
  rank1=""
  for child in $(pgrep -P "$pid"); do
    grep -qz '^OMPI_COMM_WORLD_RANK=1$' "/proc/$child/environ" 2>/dev/null && rank1=$child
  done
  if [[ -z $rank1 ]]; then
    fail "mpi: rank 1's process not found among mpirun's children"
    kill -KILL "$pid"
  else
    kill -TERM "$rank1"
  fi
  wait "$pid"
  rc=$?
  n=$(last_logged_step "$run")
  kept=$(cd "$run" && echo step-*)
  if [[ $rc == 143 ]] && grep -q "received SIGTERM at step $n: saved step-$n, stopping" "$run.log" &&
    [[ $kept == "step-$n" ]] && "$xmoe" inspect "$run/step-$n" >/dev/null; then
    pass "mpi: SIGTERM to rank 1 stops both ranks after step $n, saved step-$n (rc=$rc)"
  else
    fail "mpi: SIGTERM to rank 1 (rc=$rc, wanted 143; last step $n; checkpoints: $kept)"
    sed 's/^/       | /' "$run.log" | tail -8
  fi
fi
exit $((fails > 0))
