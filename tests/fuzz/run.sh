#!/usr/bin/env bash
# Builds the `fuzz` preset (clang, libFuzzer, ASan + UBSan) and runs every fuzz target for
# SECONDS (default 60) on its seed corpus, tests/fuzz/corpus/<target>/. Any crash is printed and
# fails the script; the crashing inputs stay in build/fuzz/tests/fuzz/artifacts/.
# Usage: bash tests/fuzz/run.sh [SECONDS]   (XMOE_FUZZ_JOBS: targets run at once, default 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
jobs=${XMOE_FUZZ_JOBS:-2}
command -v clang++ >/dev/null || { echo "[fuzz] clang++ not found: bash scripts/install-deps.sh"; exit 1; }
cmake --preset fuzz -B build/fuzz -DXMOE_FUZZ_SECONDS="$seconds" >/dev/null
ninja -C build/fuzz fuzz_targets
ctest --test-dir build/fuzz -L fuzz -j "$jobs" --output-on-failure
