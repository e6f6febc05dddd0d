#!/usr/bin/env bash
# The CPU unit tests under AddressSanitizer (with leak checks) and UndefinedBehaviorSanitizer:
# builds the `sanitize` preset (Debug) with only the test binaries listed below and runs each.
# Any sanitizer report fails the run (UBSan halts on the first finding). CI runs it as its last
# step (.ci/run); the subset keeps that step within a few minutes on a 2-core machine: the unit
# tests of the layers that parse, move and write data (core, io, config, data, checkpoints, run
# folders, the watchdog), the ops, the optimizer, the MoE layer and the short training tests
# (test_train: resume, signals, async checkpoints); not the finite-difference gradient checks
# (test_moe_grad, minutes under ASan), the MPI binaries (Open MPI's own allocations read as
# leaks) or the shell-script end-to-end tests. Each binary left out is one compile less.
# Usage: bash scripts/sanitize.sh [TEST_BINARY...]   (default: the list below)
set -euo pipefail
cd "$(dirname "$0")/.."
tests=(test_core test_env test_io test_config test_ops test_optim test_data test_checkpoint
  test_run_folder test_watchdog test_moe test_train)
[[ $# -gt 0 ]] && tests=("$@")
# Tests that measure what the sanitizers change: the resident memory of data preparation (ASan
# keeps freed blocks in quarantine, so the peak RSS grows with everything prepared).
declare -A skip=([test_data]="-Data.PrepareKeepsMemoryFlat")
cmake --preset sanitize -B build/sanitize -DXMOE_TESTS=ON >/dev/null
ninja -C build/sanitize "${tests[@]}"
export OMP_NUM_THREADS=2 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
failed=()
for t in "${tests[@]}"; do
  start=$SECONDS
  if build/sanitize/tests/"$t" --gtest_brief=1 --gtest_filter="${skip[$t]:-*}" \
    >"build/sanitize/$t.log" 2>&1; then
    echo "[sanitize] $t: ok ($((SECONDS - start)) s)"
  else
    echo "[sanitize] $t: FAILED ($((SECONDS - start)) s); its output:"
    tail -n 60 "build/sanitize/$t.log"
    failed+=("$t")
  fi
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "[sanitize] FAIL: ${failed[*]} (full logs in build/sanitize/<test>.log)"
  exit 1
fi
echo "[sanitize] all ${#tests[@]} test binaries pass under ASan + UBSan"
