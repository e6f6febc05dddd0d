#!/usr/bin/env bash
# parallel.collective_timeout_s: one rank stops answering before step 3 (XMOE_INJECT_HANG, it
# sleeps an hour); the others wait for it in a collective, their watchdogs fire after the
# timeout, and the whole job ends with exit code 124 within the timeout plus start-up and slack,
# naming the collective, the knob and the timeout. Run for 2 ranks (the missing rank is named)
# and 3 ranks with ep (the MoE dispatch's collectives).
# Usage: collective_watchdog.sh <xmoe binary> <mpiexec> [more xmoe train arguments...]
# With more arguments (mpi_collective_watchdog_nccl: --set train.device=cuda, one GPU per rank)
# only the 2-rank case runs, with them.
set -u
xmoe=$1
mpiexec=$2
shift 2
extra=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/micro_corpus.sh"
write_micro_corpus "$work/corpus"
timeout_s=3
tiny=(--quiet "${micro_model[@]}"
  --set train.batch_size=2 --set train.steps=50 --set train.eval_every=0
  --set train.warmup_steps=2 --set "parallel.collective_timeout_s=$timeout_s"
  --set "data.corpus=$work/corpus" --set "data.dir=$work/data" "${extra[@]}")
# A first run prepares the data, so the timed runs below start training at once.
"$xmoe" train "${tiny[@]}" --set train.steps=1 --set "train.out_dir=$work/prep" >/dev/null 2>&1

check() {  # check <np> <hanging rank> <extra args...>
  local np=$1 rank=$2
  shift 2
  local start=$SECONDS
  XMOE_INJECT_HANG=$rank:3 timeout 120 "$mpiexec" --oversubscribe -np "$np" -x XMOE_INJECT_HANG \
    "$xmoe" train "${tiny[@]}" "$@" --set "train.out_dir=$work/run$np" >"$work/log" 2>&1
  local rc=$? elapsed=$((SECONDS - start))
  cat "$work/log"
  # Start-up of the ranks and two steps take a few seconds; 30 s of slack for a loaded machine,
  # far less than the hour the rank sleeps.
  if [[ $rc -ne 124 || $elapsed -gt $((timeout_s + 30)) ]]; then
    echo "FAIL (np $np): expected exit code 124 within $((timeout_s + 30)) s, got rc=$rc after $elapsed s"
    exit 1
  fi
  if ! grep -qE "error: \[watchdog\] [a-z_]+ did not complete within parallel.collective_timeout_s = $timeout_s s" "$work/log"; then
    echo "FAIL (np $np): no watchdog line naming the collective, the knob and the timeout"
    exit 1
  fi
  if grep -q "rank $rank of $np: error: \[watchdog\]" "$work/log"; then
    echo "FAIL (np $np): the hanging rank $rank reported itself as waiting"
    exit 1
  fi
  echo "np $np: rank $rank hung, the job ended after $elapsed s with rc=$rc"
}
check 2 1
if ! grep -q "rank 1 of that group stopped answering" "$work/log"; then
  echo "FAIL (np 2): the missing rank (1) is not named"
  exit 1
fi
[[ ${#extra[@]} -eq 0 ]] && check 3 0 --set parallel.ep=1
echo "PASS: a hung rank ends the job within the timeout, naming the collective"
