#!/usr/bin/env bash
# The first command of the README: install dependencies, build xmoe, and run the main job —
# `xmoe train` on the built-in default (a tiny DeepSeek-style MoE model on a real English text
# corpus, on CPU). Extra arguments are passed to `xmoe train`.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
cmake --preset cpu -DXMOE_TESTS=OFF -DXMOE_BENCH=OFF >/dev/null
cmake --build build/cpu --target xmoe_cli
echo "[setup] built build/cpu/bin/xmoe; starting the default training run"
exec build/cpu/bin/xmoe train "$@"
