#!/usr/bin/env bash
# `xmoe plot RUN_DIR` (issue 31): PNGs of a run's metrics.jsonl, non-empty, one per panel; errors
# name what is missing. Usage: cli_plot.sh <xmoe binary>
# Exit 77 (ctest: skipped) where python3 has no matplotlib (scripts/install-deps.sh installs it).
set -u
xmoe=$1
fail() { echo "FAIL: $*"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# No metrics: the error names the folder and what it wants.
out=$("$xmoe" plot "$work" 2>&1) && fail "plot of a folder without metrics succeeded"
[[ $out == *"has no metrics.jsonl: give the run folder of xmoe train"* ]] || fail "message: $out"

if ! python3 -c "import matplotlib" 2>/dev/null; then
  echo "SKIP: python3 has no matplotlib (bash scripts/install-deps.sh installs it)"
  exit 77
fi
mkdir -p "$work/run"
python3 - "$work/run/metrics.jsonl" <<'PY'
import json, math, sys
with open(sys.argv[1], "w") as f:
    for s in range(1, 41):
        f.write(json.dumps({"step": s, "loss": 5.5 * math.exp(-s / 20) + 1.5, "aux_loss": 0.03,
                            "lr": 3e-3 * min(1, s / 10), "grad_norm": 2.0 / s ** 0.5,
                            "tokens_per_s": 7000 + 10 * s, "max_expert_load": 1500 - 10 * s,
                            "min_expert_load": 0 if s < 5 else 20 * s, "skipped": False}) + "\n")
        if s % 10 == 0:
            f.write(json.dumps({"step": s, "val_loss": 5.5 * math.exp(-s / 20) + 1.6}) + "\n")
PY
out=$("$xmoe" plot "$work/run" 2>&1) || fail "plot failed: $out"
for name in loss lr grad_norm tokens_per_s expert_load expert_load_spread overview; do
  png="$work/run/plots/$name.png"
  [[ -s $png ]] || fail "$name.png missing or empty ($out)"
  [[ $(head -c 8 "$png" | od -An -tx1 | tr -d ' \n') == 89504e470d0a1a0a ]] || fail "$name.png is no PNG"
  [[ $out == *"$png"* ]] || fail "the command did not list $png"
done
"$xmoe" plot "$work/run" --out "$work/elsewhere" >/dev/null || fail "plot --out failed"
[[ -s "$work/elsewhere/overview.png" ]] || fail "--out wrote no overview.png"

# --compare: every run's loss on one axis; a compared folder without metrics is named.
cp -r "$work/run" "$work/other"
out=$("$xmoe" plot "$work/run" --out "$work/cmp" --compare "$work/other" 2>&1) || fail "compare failed: $out"
[[ -s "$work/cmp/compare_loss.png" && $out == *compare_loss.png* ]] || fail "no compare_loss.png ($out)"
out=$("$xmoe" plot "$work/run" --compare "$work/missing" 2>&1) && fail "compare with a missing run succeeded"
[[ $out == *"missing has no metrics.jsonl"* ]] || fail "message: $out"

# A line that is not JSON is named with its line number.
echo "{not json" >>"$work/run/metrics.jsonl"
out=$("$xmoe" plot "$work/run" 2>&1) && fail "plot of a broken metrics.jsonl succeeded"
[[ $out == *"metrics.jsonl:45: not a JSON line"* ]] || fail "message: $out"
echo "PASS: xmoe plot"
