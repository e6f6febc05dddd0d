#!/usr/bin/env bash
# A rank that fails mid-run stops the whole MPI job promptly (no hang) with a message naming the
# rank and the error, and a non-zero exit; the last checkpoint stays complete and loadable.
# Usage: rank_failure.sh <xmoe binary> <mpiexec>
set -u
xmoe=$1
mpiexec=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/micro_corpus.sh"
write_micro_corpus "$work/corpus"

XMOE_INJECT_FAULT=1:6 timeout 120 "$mpiexec" --oversubscribe -np 2 "$xmoe" train --quiet \
  --set model.d_model=32 --set model.num_layers=2 --set model.num_heads=2 \
  --set model.num_kv_heads=2 --set model.dense_hidden=32 --set model.max_seq_len=16 \
  --set model.moe.num_experts=4 --set model.moe.expert_hidden=16 --set parallel.ep=2 \
  --set train.seq_len=16 --set train.batch_size=2 --set train.steps=20 \
  --set train.save_every=4 --set train.eval_every=0 --set train.warmup_steps=2 \
  --set "data.corpus=$work/corpus" --set "data.dir=$work/data" --set "train.out_dir=$work/run" \
  >"$work/log" 2>&1
rc=$?
cat "$work/log"
if [[ $rc -eq 0 || $rc -eq 124 ]]; then
  echo "FAIL: expected a prompt non-zero exit, got rc=$rc (124 = hang killed by timeout)"
  exit 1
fi
if ! grep -q "rank 1 of 2: error: \[train\] injected fault on rank 1 at step 6" "$work/log"; then
  echo "FAIL: the failing rank's message is missing"
  exit 1
fi
if ! "$xmoe" inspect "$work/run/step-4" >/dev/null; then
  echo "FAIL: the last checkpoint (step-4) does not load"
  exit 1
fi
if ls -d "$work"/run/step-8* 2>/dev/null | grep -q .; then
  echo "FAIL: a checkpoint after the failure exists"
  exit 1
fi
echo "PASS: rc=$rc, message found, step-4 intact"
