#!/usr/bin/env bash
# moe-1b in xmoe and in PyTorch (bench/peers/train_torch.py) from the same initial weights on the
# same real tokens (issue 37): the King James Bible as Debian's bible-kjv-text package ships it
# (public domain), a SentencePiece BPE tokenizer of 32768 pieces, validation curves compared.
# docs/benchmarks.md ("Real data: moe-1b against PyTorch") says how to run it.
#
#   bash bench/real_data.sh prepare OUT     # any machine with apt's bible-kjv and a CPU xmoe
#   bash bench/real_data.sh train OUT       # the GPU machine: xmoe (cuda), then the peer
#   bash bench/real_data.sh compare OUT     # per-evaluation table, max difference, plot
#   bash bench/real_data.sh fp8 OUT         # the GPU machine: xmoe bf16 experts, then fp8 (issue 30)
#   bash bench/real_data.sh compare-fp8 OUT # fp8 against bf16: table, max difference, plot
#
# XMOE (default build/cpu/bin/xmoe for prepare, build/cuda/bin/xmoe for train) is the binary;
# STEPS (300), BATCH (8), SEQ (1024), LR (1e-3), MIN_LR (1e-4), WARMUP (30), EVAL_EVERY (25),
# EVAL_BATCHES (8), SEED (1234) the run. The corpus has ~0.95M tokens: 300 steps of 8 x 1024
# read it about 2.6 times.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
phase=${1:?usage: real_data.sh prepare|train|compare OUT}
out=${2:?usage: real_data.sh prepare|train|compare OUT}
STEPS=${STEPS:-300} BATCH=${BATCH:-8} SEQ=${SEQ:-1024} LR=${LR:-1e-3} MIN_LR=${MIN_LR:-1e-4}
WARMUP=${WARMUP:-30} EVAL_EVERY=${EVAL_EVERY:-25} EVAL_BATCHES=${EVAL_BATCHES:-8} SEED=${SEED:-1234}
mkdir -p "$out"

# xmoe_keys RUN_DIR [KEY=VALUE...]: the xmoe run's --preset and --set arguments, in `keys`.
xmoe_keys() {
  keys=(--preset moe-1b --set "data.dir=$out/data" --set "train.out_dir=$1"
    --set train.device=cuda --set train.steps=$STEPS --set train.batch_size=$BATCH
    --set train.seq_len=$SEQ --set train.lr=$LR --set train.min_lr=$MIN_LR
    --set train.warmup_steps=$WARMUP --set train.eval_every=$EVAL_EVERY
    --set train.eval_batches=$EVAL_BATCHES --set train.seed=$SEED --set train.save_every=0
    --set train.log_every=10)
  local kv
  for kv in "${@:2}"; do keys+=(--set "$kv"); done
}

case $phase in
prepare)
  xmoe=${XMOE:-$here/../build/cpu/bin/xmoe}
  command -v bible >/dev/null ||
    { echo "real_data.sh: needs Debian's bible-kjv (apt-get install bible-kjv)" >&2; exit 1; }
  # The whole text, Genesis 1:1 to Revelation 22:21 (4.3 MB).
  bible Gen1:1-Rev22:21 >"$out/kjv.txt"
  "$xmoe" tokenizer train --vocab 32768 --corpus "$out/kjv.txt" --out "$out/kjv-bpe32k.model"
  "$xmoe" prepare --corpus "$out/kjv.txt" --tokenizer "$out/kjv-bpe32k.model" \
    --out "$out/data" --val-fraction 0.05 --overwrite
  ;;
train)
  xmoe=${XMOE:-$here/../build/cuda/bin/xmoe}
  xmoe_keys "$out/xmoe"
  # step-0 holds the initial weights, which the peer loads; the run then continues from it.
  "$xmoe" train --quiet --overwrite --stop-after 0 "${keys[@]}"
  "$xmoe" train --resume "${keys[@]}"
  python3 "$here/peers/train_torch.py" --preset moe-1b --device cuda --batch "$BATCH" \
    --seq "$SEQ" --data "$out/data" --init "$out/xmoe/step-0" --train-steps "$STEPS" \
    --lr "$LR" --min-lr "$MIN_LR" --warmup-steps "$WARMUP" --eval-every "$EVAL_EVERY" \
    --eval-batches "$EVAL_BATCHES" --seed "$SEED" --metrics "$out/torch.jsonl"
  ;;
fp8)
  # The same model (same seed: the same initial weights) on the same tokens, with bf16 then
  # FP8 experts.
  xmoe=${XMOE:-$here/../build/cuda/bin/xmoe}
  for dt in bf16 fp8; do
    xmoe_keys "$out/xmoe-$dt" "model.moe.expert_dtype=$dt"
    "$xmoe" train --quiet --overwrite "${keys[@]}"
  done
  ;;
compare-fp8)
  xmoe=${XMOE:-$here/../build/cpu/bin/xmoe}
  python3 - "$out/xmoe-fp8/metrics.jsonl" "$out/xmoe-bf16/metrics.jsonl" "$out" <<'PY'
import json, sys
def curve(path):
    return {j["step"]: j["val_loss"] for j in map(json.loads, open(path)) if "val_loss" in j}
f, b = curve(sys.argv[1]), curve(sys.argv[2])
steps = sorted(set(f) & set(b))
print("| step | bf16 experts val loss | fp8 experts val loss | difference |")
print("|---:|---:|---:|---:|")
worst = 0.0
for s in steps:
    rel = (f[s] - b[s]) / b[s]
    worst = max(worst, abs(rel))
    print(f"| {s} | {b[s]:.4f} | {f[s]:.4f} | {100 * rel:+.2f}% |")
print(f"\nlargest difference {100 * worst:.2f}% over {len(steps)} evaluations "
      f"({'within' if worst <= 0.01 else 'NOT within'} 1%)")
PY
  "$xmoe" plot "$out/xmoe-bf16" --compare "$out/xmoe-fp8"
  ;;
compare)
  python3 - "$out/xmoe/metrics.jsonl" "$out/torch.jsonl" "$out" <<'PY'
import json, sys
def curve(path, key):
    return {j["step"]: j[key] for j in map(json.loads, open(path)) if key in j}
x, t = curve(sys.argv[1], "val_loss"), curve(sys.argv[2], "val_loss")
steps = sorted(set(x) & set(t))
print("| step | xmoe val loss | PyTorch val loss | difference |")
print("|---:|---:|---:|---:|")
worst = 0.0
for s in steps:
    rel = abs(x[s] - t[s]) / t[s]
    worst = max(worst, rel)
    print(f"| {s} | {x[s]:.4f} | {t[s]:.4f} | {100 * rel:.2f}% |")
print(f"\nlargest difference {100 * worst:.2f}% over {len(steps)} evaluations "
      f"({'within' if worst <= 0.01 else 'NOT within'} 1%)")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xl, tl = curve(sys.argv[1], "loss"), curve(sys.argv[2], "loss")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sorted(xl), [xl[s] for s in sorted(xl)], lw=0.6, alpha=0.5, label="xmoe train")
    ax.plot(sorted(tl), [tl[s] for s in sorted(tl)], lw=0.6, alpha=0.5, label="PyTorch train")
    ax.plot(steps, [x[s] for s in steps], "o-", label="xmoe validation")
    ax.plot(steps, [t[s] for s in steps], "s--", label="PyTorch validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("moe-1b on the KJV Bible, BPE 32768, same initial weights and tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{sys.argv[3]}/real_data.png", dpi=120)
    print(f"plot: {sys.argv[3]}/real_data.png")
except ImportError:
    print("no matplotlib: no plot")
PY
  ;;
*)
  echo "real_data.sh: unknown phase $phase (prepare, train, compare, fp8 or compare-fp8)" >&2
  exit 1
  ;;
esac
