#!/usr/bin/env bash
# The CLI as a new and then a careless user meets it (issues 25 and 38): help and examples,
# misspelt commands and bad numbers named in plain words, run folders and data folders never
# written over, one trainer per run folder, --resume with the run's own config from another
# directory, plain progress lines when output is not a terminal.
# Usage: cli_user_work.sh <xmoe binary> [<mpiexec>]
set -u
xmoe=$1
mpiexec=${2:-}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/expect.sh"

mkdir -p "$work/corpus"
for i in $(seq 1 300); do echo "the quick brown fox jumps over the lazy dog number $i."; done \
  >"$work/corpus/text.txt"
micro=(--set model.d_model=32 --set model.num_layers=2 --set model.num_heads=2
  --set model.num_kv_heads=2 --set model.dense_hidden=32 --set model.max_seq_len=16
  --set model.moe.num_experts=4 --set model.moe.expert_hidden=16 --set train.seq_len=16
  --set train.batch_size=2 --set train.eval_every=0 --set train.warmup_steps=2
  --set "data.corpus=$work/corpus" --set "data.dir=$work/data")

# --- help and commands ----------------------------------------------------------------------
expect "no arguments prints the commands with examples" 0 "xmoe generate --checkpoint" "$xmoe"
expect "--help lists every command" 0 "inspect +Verify a checkpoint" "$xmoe" --help
expect "train --help shows defaults" 0 "stop-after.*-1" "$xmoe" train --help
expect "a misspelt command names the closest one" "!0" "unknown command 'trian' \(did you mean 'train'\?\)" \
  "$xmoe" trian
expect "--top-k -1 is named in plain words" "!0" "-1 is below the smallest allowed value, 0" \
  "$xmoe" generate --checkpoint "$work/none" --top-k -1
out=$("$xmoe" generate --checkpoint "$work/none" --top-k -1 2>&1)
if (($(wc -L <<<"$out") < 200)); then pass "no 300-digit bound"; else fail "no 300-digit bound"; fi
# --- config show: the memory table of a parallel layout -------------------------------------
expect "config show models tp with SSMB per rank" 0 \
  "world 4 = data 2 x tp 2, MoE layers 4 = dp 2 x ep 2 \(SSMB\)" \
  "$xmoe" config show --preset moe-1b --set parallel.tp=2 --set parallel.ep=2 --world 4
expect "config show defaults to the smallest world of the layout" 0 \
  "world 4 = data 2 x tp 2, MoE layers 2 = dp 1 x ep 2 \(no SSMB\)" \
  "$xmoe" config show --preset moe-1b --set parallel.tp=2 --set parallel.ssmb=false \
  --set parallel.ep=2
expect "config show names a tp that does not divide the world" "!0" \
  "parallel.tp = 2 does not divide 3 ranks" \
  "$xmoe" config show --preset moe-1b --set parallel.tp=2 --world 3
expect "config show prints the offloaded optimizer's pinned host memory" 0 \
  "= pinned host memory \(offload\) +14.54 GiB" \
  "$xmoe" config show --preset moe-1b --set train.offload_optimizer=true
expect "negative --stop-after is refused" "!0" "below the smallest allowed value, -1" \
  "$xmoe" train --stop-after -5
expect "negative --seed is refused" "!0" "below the smallest allowed value, 0" \
  "$xmoe" generate --checkpoint "$work/none" --seed -3

# --- run folders ----------------------------------------------------------------------------
run="$work/run"
expect "a first run trains" 0 "run folder $run" "$xmoe" train --quiet "${micro[@]}" \
  --set train.steps=4 --set train.save_every=2 --set "train.out_dir=$run"
cp "$run/metrics.jsonl" "$work/metrics.before"
expect "training into a run folder again is refused" "!0" "already holds a run.*--resume.*--overwrite" \
  "$xmoe" train --quiet "${micro[@]}" --set model.moe.gate=sigmoid --set "train.out_dir=$run"
if cmp -s "$run/metrics.jsonl" "$work/metrics.before"; then pass "the refused run wrote nothing"
else fail "the refused run wrote nothing"; fi
expect "an unwritable train.out_dir is named" "!0" "train.out_dir = /dev/null/run: cannot create" \
  "$xmoe" train --quiet "${micro[@]}" --set train.out_dir=/dev/null/run

# --resume from another directory, without data.dir: the run's own data and config.
mkdir -p "$work/elsewhere"
expect "--resume elsewhere keeps the run's config and prints the change" 0 \
  "changed train.steps: 4 -> 6" \
  bash -c "cd '$work/elsewhere' && '$xmoe' train --quiet --resume --set train.steps=6 \
           --set train.out_dir='$run'"
if grep -q "dir: \"$work/data\"" "$run/config.yaml" && [[ ! -e "$work/elsewhere/data" ]]; then
  pass "the resumed run used the run's data folder"
else
  fail "the resumed run used the run's data folder"
fi
expect "--resume that changes the model is refused naming the key" "!0" "model.d_model: 32 -> 64" \
  "$xmoe" train --quiet --resume --set model.d_model=64 --set "train.out_dir=$run"
expect "--resume at train.steps trains nothing and says so" 0 "nothing to train" \
  "$xmoe" train --resume --set "train.out_dir=$run"

# One trainer per run folder: a second one is refused while the first lives; a lock left by a
# killed trainer is taken over.
"$xmoe" train --quiet "${micro[@]}" --set train.steps=100000 --set train.save_every=0 \
  --set "train.out_dir=$work/busy" >"$work/busy.log" 2>&1 &
busy=$!
for _ in $(seq 1 100); do [[ -e "$work/busy/xmoe.lock" ]] && break; sleep 0.1; done
expect "a second trainer on a busy run folder is refused" "!0" "in use by another trainer.*pid $busy" \
  "$xmoe" train --quiet "${micro[@]}" --overwrite --set "train.out_dir=$work/busy"
kill -9 "$busy"
wait "$busy" 2>/dev/null
expect "a dead trainer's lock is taken over" 0 "taking over the lock of pid $busy" \
  "$xmoe" train --quiet "${micro[@]}" --overwrite --set train.steps=2 \
  --set "train.out_dir=$work/busy"

# --- data folders ---------------------------------------------------------------------------
expect "prepare does not write over prepared tokens" "!0" "--overwrite" \
  "$xmoe" prepare --corpus "$work/corpus" --out "$work/data"
expect "prepare --overwrite replaces them" 0 "prepared" \
  "$xmoe" prepare --corpus "$work/corpus" --out "$work/data" --overwrite
mkdir -p "$work/bare"
cp "$work/data/train.bin" "$work/data/val.bin" "$work/bare/"
expect "token files without meta.json are not prepared over" "!0" "meta.json" \
  "$xmoe" train --quiet "${micro[@]}" --set "data.dir=$work/bare" --set "train.out_dir=$work/r2"
if cmp -s "$work/bare/train.bin" "$work/data/train.bin"; then pass "the user's tokens are intact"
else fail "the user's tokens are intact"; fi
: >"$work/empty.txt"
expect "an empty corpus is an error" "!0" "no text" \
  "$xmoe" prepare --corpus "$work/empty.txt" --out "$work/empty-data"
expect "--config given a folder is an error" "!0" "is a directory" \
  "$xmoe" train --config "$work/corpus"

# --- progress lines -------------------------------------------------------------------------
if [[ -n "$mpiexec" ]]; then
  "$mpiexec" --oversubscribe -np 1 "$xmoe" train "${micro[@]}" --set train.steps=6 \
    --set train.log_every=3 --set "train.out_dir=$work/mpi" >"$work/mpi.log" 2>&1
  if grep -q $'\033' "$work/mpi.log"; then fail "no terminal escapes under mpirun"
  else pass "no terminal escapes under mpirun"; fi
  n=$(grep -c "^step " "$work/mpi.log")
  if [[ $n == 2 ]]; then pass "progress lines every train.log_every"
  else fail "progress lines every train.log_every ($n lines)"; cat "$work/mpi.log"; fi
fi

if ((fails)); then echo "$fails check(s) failed"; exit 1; fi
echo "PASS"
