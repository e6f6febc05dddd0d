#!/usr/bin/env bash
# parallel.zero checkpoints resume at another data-parallel degree (issue 35): a zero 2 run on 4
# ranks saves whole AdamW moments; resumed on 2 ranks with zero 2 (each rank cuts its new shard)
# and with zero 0 it trains the same steps as the zero 0 run of 4 ranks resumed on 2 ranks.
# Usage: zero_resume_other_dp.sh <xmoe binary> <mpiexec>
set -u
xmoe=$1
mpiexec=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/micro_corpus.sh"
write_micro_corpus "$work/corpus"
common=(--quiet "${micro_model[@]}"
  --set train.batch_size=2 --set train.eval_every=0 --set train.warmup_steps=2
  --set "data.corpus=$work/corpus" --set "data.dir=$work/data")
fail() { echo "FAIL: $*"; exit 1; }

for zero in 2 0; do
  timeout 120 "$mpiexec" --oversubscribe -np 4 "$xmoe" train "${common[@]}" \
    --set parallel.zero=$zero --set train.steps=8 --set train.save_every=8 \
    --set "train.out_dir=$work/np4-z$zero" >"$work/np4-z$zero.log" 2>&1 ||
    { cat "$work/np4-z$zero.log"; fail "the np 4 zero $zero run failed"; }
  [[ -d "$work/np4-z$zero/step-8" ]] || fail "np 4 zero $zero saved no step-8"
done
# Three resumes on 2 ranks: (checkpoint, zero of the resumed run).
for pair in "z2 2" "z2 0" "z0 0"; do
  set -- $pair
  dir="$work/np2-from-$1-zero$2"
  cp -r "$work/np4-$1" "$dir"
  timeout 120 "$mpiexec" --oversubscribe -np 2 "$xmoe" train --quiet --resume \
    --set "train.out_dir=$dir" --set train.steps=14 --set parallel.zero=$2 >"$dir.log" 2>&1 ||
    { cat "$dir.log"; fail "resume of np 4 $1 on 2 ranks with zero $2 failed"; }
  grep -q "resumed from .*step-8 at step 8" "$dir.log" || { cat "$dir.log"; fail "$dir did not resume"; }
done
# Steps 9..14 of each resumed run, as "step loss" lines.
losses() { grep -o '"loss":[^,]*,.*"step":[0-9]*' "$1/metrics.jsonl" |
  sed -E 's/"loss":([^,]*),.*"step":([0-9]*)/\2 \1/' | awk '$1 > 8'; }
ref=$(losses "$work/np2-from-z0-zero0")
[[ $(echo "$ref" | wc -l) == 6 ]] || fail "expected 6 resumed steps, got: $ref"
for other in np2-from-z2-zero2 np2-from-z2-zero0; do
  paste <(echo "$ref") <(losses "$work/$other") | awk -v who="$other" '
    { d = $2 - $4; if (d < 0) d = -d; r = d / ($2 < 0 ? -$2 : $2);
      if ($1 != $3 || r > 1e-6) { printf "FAIL: %s step %s loss %s vs %s (rel %.2e)\n", who, $1, $4, $2, r; bad = 1 } }
    END { exit bad }' || exit 1
done
echo "PASS: zero 2 on 4 ranks resumed on 2 ranks (zero 2 and zero 0) follows zero 0's resume:"
echo "$ref"
