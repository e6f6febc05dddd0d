#!/usr/bin/env bash
# The largest DeepSeek-style model that trains on one GPU (issue 35), with each of xmoe's
# one-GPU levers, against the largest that the PyTorch peer (bench/peers/train_torch.py, f32
# master weights, bf16 autocast, fused AdamW) trains on the same GPU.
#
# The family is moe-1b scaled in routed experts per MoE layer (16 layers, d 1024, experts 256
# wide, top-6 of E plus one shared expert): the active parameters stay 0.24 B while the total
# grows 12.6 M per expert. Every run is micro-batch MB x SEQ tokens, GA micro-batches per
# optimizer step (the same global batch for every model and both systems), so tokens/s is
# comparable and the optimizer's cost is spread as in real training.
#
# xmoe: for each lever, the memory model (`xmoe config show`, checked against the allocator in
# test_cuda_memory_model) picks the largest grid size whose predicted device peak fits MEM_GIB
# and whose pinned host bytes (offload) fit HOST_FRACTION of the host's memory; bench_train_step
# runs it, stepping down the grid on out of memory (the device's, or the host's: a run the
# kernel kills). The peer starts at PEER_FROM and walks the grid up until out of memory (down
# while it does not fit). On a GPU larger than MEM_GIB (an H200), a ballast process holds the
# rest of its memory, so both systems see an H100's 80 GB, CUDA context and fragmentation
# included. Zero needs several ranks and is not a one-GPU lever.
#
#   bash bench/largest_model.sh            # BIN: bench_train_step and xmoe (build/cuda/bin)
#   LEVERS="offload" PEER=0 bash bench/largest_model.sh
#
# Knobs: BIN, OUT (/tmp), APPEND (0; 1: add to OUT's earlier results), PYTHON, MEM_GIB (79.5: an H100 80 GB's memory as the driver reports it),
# HOST_FRACTION (0.9), MB (4), SEQ (2048), GA (16), STEPS (2), WARMUP (1; at least 3 for the
# delayed update's levers, whose first steps are not its steady state), GRID (256 to
# 1024 by 32), PEER_FROM (320), PROJECT_TOKENS (1048576), LEVERS (offload eg16 none eg16-recompute; also eg16-m16, offload-m16:
# with train.adam_moments_dtype=bf16; offload-dpu: the host update delayed by one step, hidden
# behind the next step, its optimizer_ms only the part left visible; offload-dpu-m16: that with
# bf16 moments), PEER (1: first).
# The update's time does not shrink with the batch: the table also projects each run's tokens/s
# to PROJECT_TOKENS-token global batches (1M) from its measured micro-batch and update times.
# Output: JSON lines in $OUT/largest.jsonl ("largest_model" per run, "largest_model_summary"),
# every run's output in $OUT/largest.log, and a table on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/cuda/bin}
OUT_DIR=${OUT:-/tmp}
PY=${PYTHON:-python3}
MEM_GIB=${MEM_GIB:-79.5} HOST_FRACTION=${HOST_FRACTION:-0.9}
MB=${MB:-4} SEQ=${SEQ:-2048} GA=${GA:-16} STEPS=${STEPS:-2} WARMUP=${WARMUP:-1}
GRID=${GRID:-$(seq -s ' ' 256 32 1024)}
PEER_FROM=${PEER_FROM:-320} PEER=${PEER:-1} PROJECT_TOKENS=${PROJECT_TOKENS:-1048576}
LEVERS=${LEVERS:-offload eg16 none eg16-recompute}
JSONL="$OUT_DIR/largest.jsonl" LOG="$OUT_DIR/largest.log"
mkdir -p "$OUT_DIR"
# APPEND=1 keeps earlier runs' lines (e.g. the peer measured in another invocation): the table
# then covers both.
if [[ ${APPEND:-0} != 1 ]]; then : >"$JSONL"; : >"$LOG"; fi
mem_bytes=$(${PY} -c "print(int($MEM_GIB * 2**30))")
host_bytes=$(awk '/MemTotal/ { print $2 * 1024 }' /proc/meminfo)
export PYTHONUNBUFFERED=1

# A ballast on a GPU larger than MEM_GIB: another process holds the difference.
ballast_pid=
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [[ -n $total_mib ]] && ${PY} -c "import sys; sys.exit(0 if $total_mib / 1024 > $MEM_GIB + 1 else 1)"; then
  ${PY} -c '
import sys, time, torch
free, total = torch.cuda.mem_get_info()
keep = float(sys.argv[1]) * 2**30
hold = torch.empty(int(free - keep), dtype=torch.uint8, device="cuda")
print(f"[largest] ballast: holding {hold.numel() / 2**30:.1f} GiB of {total / 2**30:.1f}; "
      f"{torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB free", file=sys.stderr, flush=True)
time.sleep(86400)' "$MEM_GIB" &
  ballast_pid=$!
  trap '[[ -n $ballast_pid ]] && kill $ballast_pid 2>/dev/null' EXIT
  sleep 15
fi

lever_sets() {
  case $1 in
    none) echo "" ;;
    eg16) echo "model.moe.expert_grad_dtype=bf16" ;;
    eg16-recompute) echo "model.moe.expert_grad_dtype=bf16 model.recompute=attention,moe,router" ;;
    offload) echo "model.moe.expert_grad_dtype=bf16 train.offload_optimizer=true train.offload_overlap=false" ;;
    eg16-m16) echo "model.moe.expert_grad_dtype=bf16 train.adam_moments_dtype=bf16" ;;
    offload-dpu) echo "model.moe.expert_grad_dtype=bf16 train.offload_optimizer=true train.offload_overlap=true train.offload_delayed_update_from=2" ;;
    offload-dpu-m16) echo "model.moe.expert_grad_dtype=bf16 train.offload_optimizer=true train.offload_overlap=true train.offload_delayed_update_from=2 train.adam_moments_dtype=bf16" ;;
    offload-m16) echo "model.moe.expert_grad_dtype=bf16 train.offload_optimizer=true train.offload_overlap=false train.adam_moments_dtype=bf16" ;;
    *) echo "largest_model.sh: unknown lever $1" >&2; exit 2 ;;
  esac
}
common_sets="train.device=cuda train.batch_size=$MB train.seq_len=$SEQ train.grad_accum=$GA"

# predicted_fit E SETS...: 0 when the memory model puts E's device peak under MEM_GIB and its
# pinned host bytes under HOST_FRACTION of the host.
predicted_fit() {
  local e=$1; shift
  local args=(--preset moe-1b --set "model.moe.num_experts=$e")
  for s in $common_sets "$@"; do args+=(--set "$s"); done
  "$BIN/xmoe" config show "${args[@]}" 2>/dev/null | ${PY} -c '
import re, sys
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
dev = host = 0
for line in sys.stdin:
    m = re.match(r"#\s+= (peak of a step[^0-9]*|pinned host memory[^0-9]*)\s+([0-9.]+) (\w+)", line)
    if not m: continue
    b = float(m.group(2)) * units[m.group(3)]
    if m.group(1).startswith("peak"): dev = b
    else: host = b
sys.exit(0 if 0 < dev <= float(sys.argv[1]) and host <= float(sys.argv[2]) else 1)
' "$mem_bytes" "$(${PY} -c "print($host_bytes * $HOST_FRACTION)")"
}

grid_desc=$(tr ' ' '\n' <<<"$GRID" | sort -n -r | tr '\n' ' ')

# peer_run E: one run of the peer; prints its status.
peer_run() {
  echo "[largest] PyTorch: $1 experts" >&2
  local line
  line=$(timeout 400 ${PY} bench/peers/train_torch.py --preset moe-1b --device cuda --experts "$1" \
    --batch "$MB" --seq "$SEQ" --grad-accum "$GA" --steps "$STEPS" --warmup "$WARMUP" 2>&1 |
    tee -a "$LOG" | grep '"train_step_peer_summary"' | tail -1)
  [[ -n $line ]] || line='{"status": "error", "log": "'"$LOG"'"}'
  ${PY} -c 'import json, sys
j = json.loads(sys.argv[1]); j.update(bench="largest_model", system="pytorch", lever="none",
    experts=int(sys.argv[2]), memory_gib=float(sys.argv[3])); print(json.dumps(j))' \
    "$line" "$1" "$MEM_GIB" >>"$JSONL"
  ${PY} -c 'import json, sys; print(json.loads(sys.argv[1]).get("status", "error"))' "$line"
}
if ((PEER)); then
  first=$(peer_run "$PEER_FROM")
  if [[ $first == ok ]]; then
    for e in $GRID; do ((e > PEER_FROM)) || continue; [[ $(peer_run "$e") == ok ]] || break; done
  elif [[ $first == out_of_memory ]]; then
    for e in $grid_desc; do ((e < PEER_FROM)) || continue; [[ $(peer_run "$e") == ok ]] && break; done
  fi
fi

for lever in $LEVERS; do
  sets=$(lever_sets "$lever")
  tried_any=0
  for e in $grid_desc; do
    # shellcheck disable=SC2086
    predicted_fit "$e" $sets || continue
    tried_any=1
    # The delayed update's steps 1..2 update as usual and step 3 is the first with a host update
    # hidden (and none beside its own copies yet): measure from step 4, the steady state.
    warmup=$WARMUP
    [[ $lever == *-dpu* ]] && ((warmup < 3)) && warmup=3
    args=(--preset moe-1b --device cuda --steps "$STEPS" --warmup "$warmup" --set "model.moe.num_experts=$e")
    for s in $common_sets $sets; do args+=(--set "$s"); done
    echo "[largest] xmoe $lever: $e experts (the memory model's largest under $MEM_GIB GiB)" >&2
    line=$(timeout 400 "$BIN/bench_train_step" "${args[@]}" 2>&1 |
      tee -a "$LOG" | grep '"train_step_summary"' | tail -1)
    rc=${PIPESTATUS[0]}
    # Killed by the kernel (137): the host's memory ran out.
    [[ -n $line ]] || line='{"status": "'$([[ $rc == 137 ]] && echo out_of_memory || echo error)'", "exit_code": '$rc', "log": "'"$LOG"'"}'
    ${PY} -c 'import json, sys
j = json.loads(sys.argv[1]); j.update(bench="largest_model", system="xmoe", lever=sys.argv[2],
    experts=int(sys.argv[3]), memory_gib=float(sys.argv[4])); print(json.dumps(j))' \
      "$line" "$lever" "$e" "$MEM_GIB" | tee -a "$JSONL"
    grep -q '"status": *"ok"' <<<"$line" && break
    grep -q '"status": *"out_of_memory"' <<<"$line" || break  # an error: stop this lever
  done
  ((tried_any)) || echo "{\"bench\": \"largest_model\", \"system\": \"xmoe\", \"lever\": \"$lever\", \"status\": \"none_predicted_to_fit\"}" | tee -a "$JSONL"
done

${PY} - "$JSONL" "$PROJECT_TOKENS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
project = int(sys.argv[2])

def projected(r):
    """tokens/s at a global batch of `project` tokens, from the measured step: GA micro-batches
    (each (step - update) / GA) and one update."""
    micro_tokens = r["tokens_per_step"] / r["grad_accum"]
    micro_ms = (r["median_step_ms"] - r["median_optimizer_ms"]) / r["grad_accum"]
    ga = max(1, round(project / micro_tokens))
    return ga * micro_tokens / ((ga * micro_ms + r["median_optimizer_ms"]) / 1e3)
best = {}
for r in rows:
    if r.get("status") == "ok":
        key = (r["system"], r["lever"])
        if key not in best or r["params_total"] > best[key]["params_total"]:
            best[key] = r
peer = best.get(("pytorch", "none"))
print(f"| system | lever | experts | parameters | parameters vs PyTorch | tokens/s | per active parameter vs PyTorch | update ms | tokens/s at {project / 2**20:g}M-token batches (projected) | vs PyTorch | peak GiB |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for (system, lever), r in best.items():
    peak = r.get("peak_live_bytes", r.get("peak_bytes", 0)) / 2**30
    per_active = lambda x, tps: tps * x["params_active"]
    rel_t = rel_p = rel_big = "-"
    if peer:
        rel_t = "%.2fx" % (per_active(r, r["tokens_per_s"]) / per_active(peer, peer["tokens_per_s"]))
        rel_p = "%.2fx" % (r["params_total"] / peer["params_total"])
        rel_big = "%.2fx" % (per_active(r, projected(r)) / per_active(peer, projected(peer)))
    print(f"| {system} | {lever} | {r['experts']} | {r['params_total']/1e9:.2f} B | {rel_p} | "
          f"{r['tokens_per_s']:.0f} | {rel_t} | {r['median_optimizer_ms']:.0f} | "
          f"{projected(r):.0f} | {rel_big} | {peak:.1f} |")
    s = dict(bench="largest_model_summary", system=system, lever=lever, experts=r["experts"],
             params_total=r["params_total"], params_active=r["params_active"],
             tokens_per_step=r["tokens_per_step"], tokens_per_s=r["tokens_per_s"],
             update_ms=r["median_optimizer_ms"], projected_batch_tokens=project,
             projected_tokens_per_s=projected(r))
    if peer:
        s.update(params_vs_peer=r["params_total"] / peer["params_total"],
                 throughput_per_active_param_vs_peer=per_active(r, r["tokens_per_s"]) /
                 per_active(peer, peer["tokens_per_s"]),
                 projected_throughput_per_active_param_vs_peer=per_active(r, projected(r)) /
                 per_active(peer, projected(peer)))
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps(s) + "\n")
PY
