# Sourced by the CLI test scripts: pass/fail counters and `expect`.
fails=0
pass() { echo "ok   - $1"; }
fail() { echo "FAIL - $1"; fails=$((fails + 1)); }
# expect NAME RC_WANTED PATTERN CMD...: runs CMD, checks its exit code (any non-zero for "!0")
# and that its output holds PATTERN (grep -E).
expect() {
  local name=$1 want=$2 pattern=$3
  shift 3
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  if [[ ($want == "!0" && $rc -ne 0) || $rc == "$want" ]] && grep -qE -- "$pattern" <<<"$out"; then
    pass "$name"
  else
    fail "$name (rc=$rc, wanted $want and /$pattern/)"
    echo "$out" | head -20 | sed 's/^/       | /'
  fi
}
