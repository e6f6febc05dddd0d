#!/usr/bin/env bash
# `xmoe profile` as a user meets it: help, a quick one-process profile that writes a loadable
# file, a quick 2-rank profile with collectives, and bad flags named in plain words.
# Usage: cli_profile.sh <xmoe binary> [<mpiexec>]
set -u
xmoe=$1
mpiexec=${2:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/expect.sh"

expect "the command list names profile" 0 "profile +Measure this machine" "$xmoe"
expect "profile --help shows the flags and an example" 0 "ranks-per-node.*mpirun -np 4 xmoe profile" \
  bash -c "'$xmoe' profile --help | tr '\n' ' '"
expect "a quick profile prints the table and the check" 0 \
  "gemm_forward +- +1 64x128 g8 f32.*prediction check: median.*held-out sizes: [0-9.]+%.*wrote" \
  bash -c "cd '$work' && '$xmoe' profile --quick --quiet | tr '\n' ' '"
if [[ -s $work/profile.json ]] && grep -q '"format": "xmoe-profile"' "$work/profile.json"; then
  pass "the default file is profile.json in the current folder"
else
  fail "the default file is profile.json in the current folder"
fi
expect "progress goes to stderr, one line per tenth when not a terminal" 0 "profile: 100% \(" \
  bash -c "'$xmoe' profile --quick --out '$work/p.json' 2>&1 >/dev/null"
expect "--gemm-shape picks the GEMM shapes" 0 "gemm_backward_weight +- +1 32x16 g4" \
  "$xmoe" profile --quick --quiet --gemm-shape 32x16 --gemm-groups 4 --out "$work/g.json"
expect "--statistic min is recorded" 0 "min of 5 repetitions" \
  "$xmoe" profile --quick --quiet --statistic min --out "$work/m.json"
expect "--statistic mean is refused" "!0" "--statistic: mean not in \{median,min\}" \
  "$xmoe" profile --statistic mean
expect "a bad --gemm-shape is named" 1 "--gemm-shape '32by16' is not INxOUT" \
  "$xmoe" profile --quick --gemm-shape 32by16
expect "a bad --device is refused" "!0" "--device: tpu not in \{cpu,cuda\}" \
  "$xmoe" profile --device tpu
expect "--ranks-per-node -1 is named in plain words" "!0" "-1 is below the smallest allowed value, 0" \
  "$xmoe" profile --ranks-per-node -1
expect "--out into a missing folder is refused before measuring" 1 \
  "--out $work/none/p.json: the folder $work/none does not exist" \
  "$xmoe" profile --quick --out "$work/none/p.json"
expect "--ranks-per-node that does not divide the ranks" 1 \
  "--ranks-per-node 3 does not divide the 1 ranks" "$xmoe" profile --quick --ranks-per-node 3

if [[ -n $mpiexec ]]; then
  expect "2 ranks on 2 declared nodes: inter-node collectives" 0 \
    "2 rank\(s\), 2 node\(s\) of 1, mpi collectives.*all_reduce +inter_node +2 f32" \
    bash -c "'$mpiexec' --oversubscribe -np 2 '$xmoe' profile --quick --quiet --ranks-per-node 1 \
      --out '$work/mpi.json' | tr '\n' ' '"
  if grep -q '"link": "inter_node"' "$work/mpi.json" 2>/dev/null; then
    pass "the 2-rank file holds the inter-node models"
  else
    fail "the 2-rank file holds the inter-node models"
  fi
fi

echo "$fails failure(s)"
((fails == 0))
