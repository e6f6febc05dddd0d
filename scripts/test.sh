#!/usr/bin/env bash
# The second command of the README: install dependencies if missing, build everything, and run
# the CPU test suite with ctest (unit, gradient, end-to-end and MPI tests). Where nvcc exists, the
# CUDA backend is compiled too (it runs only on a GPU machine: scripts/gpu-check.sh runs the
# tests labelled `cuda`, which this command leaves out).
#
# It configures build/cpu with tests and benchmarks on whatever was configured there before
# (scripts/setup.sh builds only the CLI in the same folder), and fails when ctest finds no test.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# CI (CI=true) treats C++ warnings as errors; a user's build only shows them.
werror=OFF
[[ -n "${CI:-}" ]] && werror=ON
cmake --preset cpu -DXMOE_TESTS=ON -DXMOE_BENCH=ON -DXMOE_WERROR=$werror >/dev/null
cmake --build build/cpu
if command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "[test] compiling the CUDA backend (no GPU is needed to compile it)"
  cmake --preset cuda -DXMOE_TESTS=OFF -DXMOE_BENCH=OFF -DXMOE_WERROR=$werror >/dev/null
  cmake --build build/cuda --target xmoe
fi
ctest --preset cpu -j2 --timeout 900 --no-tests=error -LE "cuda|torch"
