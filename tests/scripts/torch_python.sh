#!/usr/bin/env bash
# ctest torch_python (label torch): builds xmoe's PyTorch extension (python/) against the torch
# python3 imports, into OUT (pip --target; the CMake build folder python/build/ and ccache make
# a rebuild incremental), and runs its pytest suite (python/tests) on the CPU.
#   tests/scripts/torch_python.sh SOURCE_DIR OUT
set -euo pipefail
src=$1
out=$2
python3 -m pip install --no-build-isolation --no-deps --upgrade --quiet --target "$out" \
  "$src/python"
# From OUT, so that python/xmoe (the sources, without _C) does not shadow the built package.
cd "$out"
PYTHONPATH="$out" OMP_NUM_THREADS=2 python3 -m pytest -q -p no:cacheprovider "$src/python/tests"
