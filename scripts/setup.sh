#!/usr/bin/env bash
# The first command of the README: install dependencies, build xmoe, and run the main job —
# `xmoe train` on the built-in default (a tiny DeepSeek-style MoE model on a real English text
# corpus, on CPU). Extra arguments are passed to `xmoe train`.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
cmake --preset cpu -DXMOE_TESTS=OFF -DXMOE_BENCH=OFF >/dev/null
cmake --build build/cpu --target xmoe_cli
# A second run of this command continues the first run from its latest checkpoint instead of
# writing over it (xmoe refuses a run folder that holds a run); a first run that died before
# its first checkpoint starts over.
if [[ " $* " != *"train.out_dir"* ]]; then
  if compgen -G "runs/default/step-*" >/dev/null; then
    echo "[setup] built build/cpu/bin/xmoe; runs/default holds a run: continuing it (--resume)"
    exec build/cpu/bin/xmoe train --resume "$@"
  elif [[ -e runs/default/config.yaml ]]; then
    echo "[setup] built build/cpu/bin/xmoe; runs/default holds a run with no checkpoint: starting over"
    exec build/cpu/bin/xmoe train --overwrite "$@"
  fi
fi
echo "[setup] built build/cpu/bin/xmoe; starting the default training run"
exec build/cpu/bin/xmoe train "$@"
