#!/usr/bin/env bash
# A full disk during training. The run folder is on a 2 MiB tmpfs (a tiny checkpoint is about
# 430 kB); where `mount -t tmpfs` is not permitted (not root, a container without the
# capability) a file-size limit (ulimit -f, RLIMIT_FSIZE; SIGXFSZ ignored) makes the writes fail
# instead, and the script says so.
#   stop (default): the save that does not fit fails with a message naming the checkpoint, the
#     bytes it needs and the bytes free; the run stops after that step with exit code 75; the
#     previous checkpoint is the newest complete one and loads; no temporary folder is left.
#   continue: the run warns and trains on; once space is back a later save succeeds and the run
#     ends normally (tmpfs); a final save that fails still ends with exit code 75.
# Usage: full_disk.sh <xmoe binary>
set -u
xmoe=$1
work=$(mktemp -d)
disk=$work/disk
mkdir -p "$disk"
mounted=0
cleanup() {
  [[ $mounted == 1 ]] && umount "$disk"
  rm -rf "$work"
}
trap cleanup EXIT
source "$(dirname "$0")/micro_corpus.sh"
write_micro_corpus "$work/corpus"
tiny=(--quiet "${micro_model[@]}"
  --set train.batch_size=2 --set train.eval_every=0 --set train.warmup_steps=2
  --set train.save_every=2 --set train.steps=20
  --set "data.corpus=$work/corpus" --set "data.dir=$work/data")
fail() {
  cat "$work/log"
  echo "FAIL: $*"
  exit 1
}
# The checks of a save that failed at step <failed> after <previous> was saved, in <run>.
check_failed_save() {
  local run=$1 failed=$2 previous=$3
  grep -qF "[checkpoint] saving $run/step-$failed failed: " "$work/log" ||
    fail "no message naming $run/step-$failed"
  grep -qE "it needs about [0-9.]+ kB, [0-9.]+ [kMG]?B free on that filesystem. The previous checkpoints are intact." "$work/log" ||
    fail "the message does not give the bytes needed and free"
  "$xmoe" inspect "$run/step-$previous" >/dev/null || fail "$run/step-$previous does not load"
  [[ -z "$(ls -d "$run"/*.tmp-* "$run"/*.old 2>/dev/null)" ]] || fail "a temporary folder is left"
  [[ ! -e "$run/step-$failed" ]] || fail "$run/step-$failed exists"
}

"$xmoe" train "${tiny[@]}" --set train.steps=1 --set "train.out_dir=$work/prep" >/dev/null 2>&1
# NO_TMPFS=1 tries the fallback where tmpfs would work.
if [[ -z ${NO_TMPFS:-} ]] && mount -t tmpfs -o size=2m tmpfs "$disk" 2>"$work/mount.log"; then
  mounted=1
  echo "run folders on a 2 MiB tmpfs"
  run=$disk/stop
  "$xmoe" train "${tiny[@]}" --set "train.out_dir=$run" >"$work/log" 2>&1
  rc=$?
  [[ $rc == 75 ]] || fail "on_save_error = stop: expected exit code 75, got $rc"
  # Four checkpoints fit; the fifth (step-10) does not.
  check_failed_save "$run" 10 8
  grep -qF "Stopping (train.on_save_error = stop); the newest complete checkpoint is $run/step-8" \
    "$work/log" || fail "the stop line does not name the newest complete checkpoint"
  [[ $(grep -c '"loss"' "$run/metrics.jsonl") == 10 ]] || fail "the run did not stop after step 10"
  echo "stop: step-10 did not fit; exit 75 after step 10, step-8 intact"
  rm -rf "$run"

  # continue: a filler leaves too little space until the first failed save is reported.
  head -c 1800000 /dev/zero >"$disk/filler"
  run=$disk/continue
  "$xmoe" train "${tiny[@]}" --set train.on_save_error=continue --set train.keep_checkpoints=1 \
    --set train.steps=600 --set train.save_every=5 --set "train.out_dir=$run" \
    >"$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    grep -q "Training continues" "$work/log" && break
    sleep 0.05
  done
  rm -f "$disk/filler"
  wait $pid
  rc=$?
  [[ $rc == 0 ]] || fail "on_save_error = continue with space back: expected exit code 0, got $rc"
  grep -q "Training continues (train.on_save_error = continue); the next save tries again." \
    "$work/log" || fail "no warning that training continues"
  "$xmoe" inspect "$run/step-600" >/dev/null || fail "the final checkpoint does not load"
  [[ $(grep -c '"loss"' "$run/metrics.jsonl") == 600 ]] || fail "not every step was trained"
  echo "continue: $(grep -c "Training continues" "$work/log") failed save(s), then space back:" \
    "trained to step 600 and saved it"
else
  echo "no tmpfs (NO_TMPFS set, or mount -t tmpfs refused: $(head -c 200 "$work/mount.log" 2>/dev/null)); a file-size" \
    "limit (RLIMIT_FSIZE) makes the writes fail instead"
  limited() { (trap '' XFSZ && ulimit -f 100 && exec "$xmoe" "$@"); }  # 100 KiB per file
  for mode in stop continue; do
    run=$disk/$mode
    "$xmoe" train "${tiny[@]}" --stop-after 4 --set "train.out_dir=$run" >"$work/log" 2>&1 ||
      fail "the run before the limit failed"
    limited train "${tiny[@]}" --resume --set "train.on_save_error=$mode" \
      --set "train.out_dir=$run" >"$work/log" 2>&1
    rc=$?
    [[ $rc == 75 ]] || fail "on_save_error = $mode: expected exit code 75, got $rc"
    check_failed_save "$run" 6 4
    if [[ $mode == continue ]]; then
      [[ $(grep -c '"loss"' "$run/metrics.jsonl") == 20 ]] || fail "continue did not train on"
      grep -q "It was the final save" "$work/log" || fail "the final save's failure is not named"
    fi
    echo "$mode: exit 75, step-4 intact"
  done
fi
echo "PASS: a full disk fails the save clearly and keeps the previous checkpoint"
