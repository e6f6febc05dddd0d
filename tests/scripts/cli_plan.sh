#!/usr/bin/env bash
# `xmoe plan` as a user meets it: help, a plan on a built-in cluster whose chosen config loads,
# a CPU cluster file whose chosen config trains as it is under mpirun (with a measured profile),
# the largest-model search, and bad clusters named with the file and the key.
# Usage: cli_plan.sh <xmoe binary> [<mpiexec>]
set -u
xmoe=$1
mpiexec=${2:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/expect.sh"

expect "the command list names plan" 0 "plan +Rank the parallel layouts" "$xmoe"
expect "plan --help shows the flags and an example" 0 "--cluster.*--profile.*--largest.*frontier --nodes 128" \
  bash -c "'$xmoe' plan --help | tr '\n' ' '"
expect "moe-1b on a DGX H100 node: a ranked table and the chosen config" 0 \
  "8 in all.*layouts, [0-9]+ fit.*tokens/s.*1 +tp [0-9].*wrote $work/chosen.yaml" \
  bash -c "'$xmoe' plan --preset moe-1b --cluster dgx-h100 --top 3 --out '$work/chosen.yaml' | tr '\n' ' '"
expect "the chosen config loads and validates" 0 "# memory per rank: world 8" \
  "$xmoe" config show --config "$work/chosen.yaml" --world 8
expect "--nodes scales a built-in cluster" 0 "frontier: 128 nodes x 8 GPUs of 64 GiB \(1024 in all\)" \
  "$xmoe" plan --preset moe-1b --cluster frontier --nodes 128 --top 1
expect "a model that fits nowhere lists the smallest peaks" 1 "no layout fits; the smallest peaks" \
  "$xmoe" plan --preset xmoe-large --cluster dgx-h100 --top 2
expect "... and is an error" 1 "error: \[plan\] no layout of 8 fits 80 GiB per GPU" \
  "$xmoe" plan --preset xmoe-large --cluster dgx-h100 --top 2
expect "--largest finds the largest model of the family that fits" 0 \
  "largest model that fits: [0-9]+ layers x [0-9]+ experts = [0-9.]+B parameters.*layout: tp" \
  bash -c "'$xmoe' plan --preset moe-1b --cluster dgx-h100 --largest --largest-layers 8,16,32 \
    --largest-experts 64,256 | tr '\n' ' '"

printf 'base: dgx-h100\nintra_node: {bandwidth_gbs: -5}\n' >"$work/bad.yaml"
expect "a bad cluster file names the file and the key" 1 \
  "\[cluster\] $work/bad.yaml: intra_node.bandwidth_gbs = -5 must be > 0" \
  "$xmoe" plan --preset tiny --cluster "$work/bad.yaml"
printf 'base: dgx-h100\nlinks: 3\n' >"$work/typo.yaml"
expect "an unknown key is named with the keys there are" 1 "'links' is not a key \(keys: " \
  "$xmoe" plan --preset tiny --cluster "$work/typo.yaml"
expect "an unknown cluster name is named" 1 "'dgx-a100' is neither a built-in cluster" \
  "$xmoe" plan --preset tiny --cluster dgx-a100
expect "a missing profile is named" 1 "$work/none.json" \
  "$xmoe" plan --preset tiny --cluster dgx-h100 --profile "$work/none.json"

if [[ -n $mpiexec ]]; then
  # Two CPU ranks as a one-node cluster, rates measured by xmoe profile: the chosen config trains.
  printf 'name: this-machine\ndevice: cpu\ngpus_per_node: 2\ngpu_memory_gib: 4\npeak_tflops: 0.1\ngemm_efficiency: 0.5\nmemory_bandwidth_gbs: 5\nintra_node: {bandwidth_gbs: 1}\n' \
    >"$work/cpu.yaml"
  "$mpiexec" --oversubscribe -np 2 "$xmoe" profile --quick --quiet --out "$work/cpu.json" >/dev/null
  expect "a plan for 2 CPU ranks from their profile" 0 "this-machine: 1 nodes x 2 ranks.*wrote" \
    bash -c "'$xmoe' plan --preset tiny --cluster '$work/cpu.yaml' --profile '$work/cpu.json' \
      --set data.dir='$work/data' --set train.out_dir='$work/run' --set train.steps=2 \
      --set train.eval_every=0 --set train.save_every=0 --out '$work/cpu-chosen.yaml' | tr '\n' ' '"
  expect "its chosen config trains as it is on 2 ranks" 0 "model: .* parameters" \
    "$mpiexec" --oversubscribe -np 2 "$xmoe" train --config "$work/cpu-chosen.yaml" --quiet
  if [[ -d $work/run/step-2 ]]; then
    pass "the run reached its last step"
  else
    fail "the run reached its last step"
  fi
fi

echo "$fails failure(s)"
((fails == 0))
