#!/usr/bin/env bash
# The benchmark visit to the GPU machine: xmoe and its PyTorch peers side by side.
#   1. the peers' agreement check (grouped_mm / padded / loop on a small shape, on the GPU)
#   2. MoE layer fwd+bwd, bf16, three shapes: xmoe (bench_moe_layer --device cuda) as a training
#      layer holds its experts (f32 master weights, their bf16 copies, f32 gradients), then as the
#      peer does (--weights bf16 --expert-grad-dtype bf16: bf16 weights and gradients only), and
#      PyTorch (bench/peers/moe_layer_torch.py: torch._grouped_mm, padded bmm cf 1.0)
#   3. moe-1b training step: xmoe (bench_train_step) and PyTorch (bench/peers/train_torch.py)
#   4. causal attention: xmoe on cuDNN and on its own kernels (bench_attention) and SDPA
#      (bench/peers/attention_torch.py)
#   5. a summary table with the xmoe/peer ratios (bench/peers/summarize.py)
# JSON lines go to ${OUT:-/tmp}/gpu-bench.jsonl, everything to ${OUT:-/tmp}/gpu-bench.log
# (written as it runs, so a timeout still leaves them). About 5-6 minutes on one H200 (most of it
# initialising the 11 G expert parameters of the second MoE shape on the host).
# A shape or preset that does not fit the GPU (on an H100 80 GB: the second MoE shape as a
# training layer holds it, 113 GB of weights, copies and gradients) is reported as a JSON line
# with "status": "out_of_memory" and shown as "did not fit": a result, not a failure (the
# benchmarks exit 0 for it and run the next shape; docs/benchmarks.md). Any other error fails.
#
#   bash bench/gpu_bench.sh                           # xmoe built (or to build) in build/gpu-check
#   BUILD_DIR=/tmp/b XMOE_GPU_BENCH_BUILD=0 bash bench/gpu_bench.sh   # use the binaries as they are
#   XMOE_BENCH_SHAPES=8192x2048x1408x64x6 XMOE_BENCH_COMPILE=1 bash bench/gpu_bench.sh
#
# Knobs: BUILD_DIR (build/gpu-check), OUT (/tmp), PYTHON (python3), XMOE_GPU_BENCH_BUILD (1:
# configure with XMOE_BENCH=ON if needed and build the two bench targets; 0: do not build),
# XMOE_BENCH_SHAPES (the three shapes, TxdxfxExk comma-separated; "sonic": SonicMoE's five published
# shapes, T = 24576, d = 1536 with f/E/k 1024/32/2, 512/64/4, 256/128/8 and T = 32768, d = 4096
# with 1024/64/4, 512/128/8; "all": both sets), XMOE_BENCH_COMPILE (0; 1 adds
# a torch.compile run of the moe-1b peer), XMOE_BENCH_TIMEOUT (seconds per step, 300).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-/tmp}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu-bench.log"
JSONL="$OUT_DIR/gpu-bench.jsonl"
BUILD_DIR="${BUILD_DIR:-build/gpu-check}"
PY="${PYTHON:-python3}"
PEER_SHAPES=16384x2048x1408x64x6,8192x7168x2048x256x8,8192x4096x14336x8x2
SONIC_SHAPES=24576x1536x1024x32x2,24576x1536x512x64x4,24576x1536x256x128x8,32768x4096x1024x64x4,32768x4096x512x128x8
case "${XMOE_BENCH_SHAPES:-}" in
  "") SHAPES=$PEER_SHAPES ;;
  sonic) SHAPES=$SONIC_SHAPES ;;
  all) SHAPES=$PEER_SHAPES,$SONIC_SHAPES ;;
  *) SHAPES=$XMOE_BENCH_SHAPES ;;
esac
STEP_TIMEOUT="${XMOE_BENCH_TIMEOUT:-300}"
export PYTHONUNBUFFERED=1
: >"$LOG"
: >"$JSONL"

log() { echo "[gpu-bench] $*" | tee -a "$LOG"; }
# step NAME CMD...: runs CMD under a timeout; its output goes to the console and the log, its
# JSON lines (those starting with {"bench") also to the .jsonl as they come.
step() {
  local name="$1"; shift
  log "== $name: $*"
  local start=$SECONDS
  timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee -a "$LOG" |
    awk -v j="$JSONL" '{ print; fflush(); if ($0 ~ /^\{"bench"/) { print >> j; fflush(j) } }'
  local rc=${PIPESTATUS[0]}
  RESULTS+=("$(printf '%-14s %-8s %4ss' "$name" "$([[ $rc == 0 ]] && echo ok || echo FAIL:$rc)" $((SECONDS - start)))")
  return "$rc"
}
RESULTS=()
status=0

log "host: $(hostname), $(nproc) cores, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>&1 |
  tee -a "$LOG"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")' 2>&1 |
  tee -a "$LOG"
command -v nvcc >/dev/null 2>&1 || export PATH="/usr/local/cuda/bin:$PATH"

if [[ "${XMOE_GPU_BENCH_BUILD:-1}" != 0 ]]; then
  if ! grep -q '^XMOE_BENCH:BOOL=ON' "$BUILD_DIR/CMakeCache.txt" 2>/dev/null; then
    if [[ -f "$BUILD_DIR/CMakeCache.txt" ]]; then  # e.g. gpu-check.sh's (tests on, bench off)
      step configure cmake -B "$BUILD_DIR" -DXMOE_BENCH=ON || status=1
    else
      step configure cmake --preset cuda -B "$BUILD_DIR" -DXMOE_TESTS=OFF -DXMOE_BENCH=ON \
        -DXMOE_NCCL=OFF || status=1
    fi
  fi
  step build cmake --build "$BUILD_DIR" -j "$(nproc)" --target bench_moe_layer bench_train_step \
    bench_attention ||
    status=1
fi
BIN="$BUILD_DIR/bin"
have_xmoe=1
for b in bench_moe_layer bench_train_step bench_attention; do
  [[ -x "$BIN/$b" ]] || { log "missing $BIN/$b: the xmoe side is skipped"; have_xmoe=0; status=1; }
done

# 1. the peers compute the same thing (on the GPU, with the real _grouped_mm kernel)
step peer-check "$PY" bench/peers/moe_layer_torch.py --check-only || status=1

# 2. the MoE layer: three shapes, 3 warm-up + 10 timed passes each
if [[ $have_xmoe == 1 ]]; then
  step xmoe-moe "$BIN/bench_moe_layer" --device cuda --shapes "$SHAPES" --warmup 3 --iters 10 ||
    status=1
  step xmoe-moe-bf16 "$BIN/bench_moe_layer" --device cuda --shapes "$SHAPES" --warmup 3 \
    --iters 10 --weights bf16 --expert-grad-dtype bf16 || status=1
fi
step torch-moe "$PY" bench/peers/moe_layer_torch.py --shapes "$SHAPES" --warmup 3 --iters 10 ||
  status=1

# 3. the moe-1b training step (micro-batch 8 x 2048)
if [[ $have_xmoe == 1 ]]; then
  step xmoe-train "$BIN/bench_train_step" --preset moe-1b --device cuda --steps 20 || status=1
fi
step torch-train "$PY" bench/peers/train_torch.py --preset moe-1b --warmup 3 --steps 8 || status=1
if [[ "${XMOE_BENCH_COMPILE:-0}" != 0 ]]; then
  step torch-compile "$PY" bench/peers/train_torch.py --preset moe-1b --warmup 3 --steps 8 \
    --compile || status=1
fi

# 4. attention: both xmoe backends, then PyTorch's SDPA
if [[ $have_xmoe == 1 ]]; then
  step xmoe-attention "$BIN/bench_attention" --backends cudnn,native || status=1
fi
step torch-attention "$PY" bench/peers/attention_torch.py || status=1

log "== summary"
for r in "${RESULTS[@]}"; do log "  $r"; done
"$PY" bench/peers/summarize.py "$JSONL" 2>&1 | tee -a "$LOG"
log "JSON lines: $JSONL; log: $LOG"
log "$([[ $status == 0 ]] && echo PASS || echo FAIL)"
exit "$status"
