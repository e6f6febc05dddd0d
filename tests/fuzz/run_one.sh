#!/usr/bin/env bash
# Runs one libFuzzer target for SECONDS on its seed corpus (read only) plus a scratch corpus that
# keeps what it finds. A crash, leak, UB report, timeout or out-of-memory fails with the input
# printed (hex) and kept in XMOE_FUZZ_ARTIFACTS (default: next to the scratch corpus). The
# dictionary tests/fuzz/<target>.dict (key names, edge numbers) steers the mutations.
# Usage: run_one.sh TARGET SECONDS SCRATCH_CORPUS SEED_CORPUS
set -euo pipefail
target=$1 seconds=$2 scratch=$3 seeds=$4
name=$(basename "$target")
artifacts=${XMOE_FUZZ_ARTIFACTS:-$(dirname "$scratch")/../artifacts}
mkdir -p "$scratch" "$artifacts"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
dict=()
[[ -f "$(dirname "$0")/$name.dict" ]] && dict=(-dict="$(dirname "$0")/$name.dict")
status=0
"$target" "${dict[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
  -print_final_stats=1 -artifact_prefix="$artifacts/$name-" "$scratch" "$seeds" >"$log" 2>&1 ||
  status=$?
grep -E '^(INFO: seed corpus|#[0-9]+ +DONE|stat::number_of_executed_units|stat::new_units_added)' \
  "$log" || true
if ((status != 0)); then
  tail -n 60 "$log"
  for crash in $(grep -oE "Test unit written to [^ ]+" "$log" | awk '{print $5}'); do
    echo "[fuzz] $name: crashing input $crash ($(stat -c %s "$crash") bytes):"
    head -c 512 "$crash" | od -A d -c | head -n 40
  done
  echo "[fuzz] FAIL: $name (exit $status)"
  exit 1
fi
echo "[fuzz] $name: no crash in ${seconds} s"
