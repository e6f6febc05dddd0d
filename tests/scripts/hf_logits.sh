#!/usr/bin/env bash
# Logits of exported models equal transformers' (issue 31). For each architecture xmoe exports,
# a micro model trained 7 steps is exported (f32) and loaded with AutoModelForCausalLM; its
# logits for a text must match xmoe's within 1e-4. The bf16 export is imported back into xmoe
# and compared the same way (the same bf16-rounded weights on both sides, f32 compute).
# Usage: hf_logits.sh <xmoe binary> <hf_reference_logits binary> <hf_logits.py>
# Exit 77 (ctest: skipped) where python3 cannot import torch and transformers.
set -u
xmoe=$1
reference=$2
compare=$3
if ! python3 -c "import torch, transformers" 2>/dev/null; then
  echo "SKIP: python3 cannot import torch and transformers (python3 -m pip install torch transformers)"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus"
for i in $(seq 1 300); do echo "the quick brown fox jumps over the lazy dog number $i. héllo"; done \
  >"$work/corpus/text.txt"
common=(--quiet --set model.d_model=64 --set model.num_layers=3 --set model.num_heads=4
  --set model.num_kv_heads=2 --set model.dense_hidden=96 --set model.max_seq_len=64
  --set model.moe.num_experts=8 --set model.moe.expert_hidden=32 --set train.seq_len=32
  --set train.batch_size=4 --set train.steps=7 --set train.eval_every=0 --set train.warmup_steps=2
  --set train.lr=1e-2 --set "data.corpus=$work/corpus" --set "data.dir=$work/data")
text="The quick brown fox, née Reynard, jumps over 13 lazy dogs."
fail() { echo "FAIL: $*"; exit 1; }

# name | architecture | model keys
cases=(
  "glm4moe|Glm4MoeForCausalLM|--set model.moe.gate=sigmoid --set model.moe.num_groups=4 --set model.moe.topk_groups=2 --set model.moe.top_k=3 --set model.moe.routed_scaling=2.5 --set model.moe.bias_update_rate=0.05"
  "ernie|Ernie4_5_MoeForCausalLM|--set model.moe.num_shared_experts=2"
  "mixtral|MixtralForCausalLM|--set model.moe.num_shared_experts=0 --set model.first_dense_layers=0 --set model.tie_embeddings=true"
  "llama|LlamaForCausalLM|--set model.first_dense_layers=3"
)
for c in "${cases[@]}"; do
  IFS='|' read -r name arch keys <<<"$c"
  # shellcheck disable=SC2086
  "$xmoe" train "${common[@]}" $keys --set "train.out_dir=$work/$name" >"$work/$name.log" 2>&1 ||
    { cat "$work/$name.log"; fail "$name: training failed"; }
  "$xmoe" export --checkpoint "$work/$name" --format hf --out "$work/$name-hf" >/dev/null ||
    fail "$name: export failed"
  "$reference" "$work/$name" "$work/$name.logits" "$text" || fail "$name: xmoe logits"
  python3 "$compare" "$work/$name-hf" "$work/$name.logits" "$arch" 1e-4 || fail "$name: f32 logits"
  # bf16: the imported weights are the bf16 values, so both sides run the same model.
  "$xmoe" export --checkpoint "$work/$name" --format hf --dtype bf16 --out "$work/$name-bf16" \
    >/dev/null || fail "$name: bf16 export failed"
  "$xmoe" import --hf "$work/$name-bf16" --out "$work/$name-back" >/dev/null ||
    fail "$name: import of the bf16 export failed"
  "$reference" "$work/$name-back" "$work/$name-back.logits" "$text" || fail "$name: bf16 logits"
  python3 "$compare" "$work/$name-bf16" "$work/$name-back.logits" "$arch" 1e-4 ||
    fail "$name: bf16 logits"
done
echo "PASS: logits of ${#cases[@]} architectures equal transformers' (f32 and bf16 weights)"
