#!/usr/bin/env bash
# A GPU visit without a build on the GPU machine: pack the CUDA binaries built here, then run
# them there (device minutes go to tests and timings, not to compiling).
#
#   bash scripts/gpu-visit.sh pack [BASE_DIR]   # here, after `ninja -C build/cuda ...` (below)
#   PARTS="tests ab breakdown" bash scripts/gpu-visit.sh run   # there: the `device` tool with
#                                                             # carry [".gpu"]; logs in $OUT
#
# run leaves its logs in $OUT, in one logs.tgz when there are more than 8 files (what the device
# tool brings back). pack writes .gpu/ (git-ignored): bins.tar.xz (build/cuda's xmoe,
# benchmarks and CUDA tests), lib/ (the shared libraries whose sonames the GPU machine's Ubuntu lacks: spdlog, fmt,
# yaml-cpp; docs/benchmarks.md, "GPU benchmarks: how to run"; and CUPTI's, which the timeline
# opens at run time), base.tar.xz (BASE_DIR's
# bin/bench_train_step, an earlier build's, for the `ab` part) and, where Debian's bible-kjv and
# a CPU xmoe are here, kjv/ (the real-data corpus of bench/real_data.sh) for the `curve` part.
# Build the binaries first:
#   ninja -C build/cuda xmoe_cli bench_train_step bench_moe_layer bench_grouped_gemm \
#     test_cuda_ops test_cuda_moe test_cuda_model test_cuda_fp8 test_cuda_memory_model \
#     mpi_test_cuda_train
#
# run PARTS (in order, any of):
#   tests      the CUDA test binaries, the four of one process at once (then mpi_test_cuda_train,
#              one rank)
#   memory     test_cuda_memory_model (the memory model against the allocator)
#   step       moe-1b training step, twice (bench_train_step --steps 20)
#   ab         the packed base build's step against this one, alternated, twice each (under
#              each of AB_SETS' ;-separated lists of --set values, key=value ...)
#   breakdown  where a moe-1b step goes (--breakdown), bf16 and FP8 experts
#   layer      the MoE layer on the default shapes, bf16 and FP8 experts
#   sonic      the MoE layer on SonicMoE's five shapes, bf16 and FP8, and torch._grouped_mm
#   peer       the PyTorch moe-1b step (bench/peers/train_torch.py)
#   kernels    every kernel of two moe-1b steps, in launch order, timed by ncu (kernels.csv),
#              and the second step summed by kernel name (kernels.txt); kernels-fp8: FP8 experts
#   timeline   where a moe-1b step leaves the GPU idle, in place (bench_train_step --timeline:
#              CUPTI's records), bf16 and FP8 experts
#   shared     moe-1b with model.moe.shared_overlap off, routing and all, alternated, twice each
#   variants   moe-1b under each of VARIANTS' ;-separated lists of --set values (key=value ...),
#              alternated, twice each
#   perf       the CudaPerf model-shape lines of test_cuda_ops (the norms, cross-entropy, ...)
#   profile    xmoe profile --device cuda --fp8 (profile.json), then xmoe plan of moe-1b on one
#              dgx-h100 node from it, bf16 and FP8 experts (the FP8 GEMM models, measured)
#   curve      moe-1b 1000 steps with bf16 then FP8 experts on the KJV Bible (real_data.sh fp8)
set -uo pipefail
cd "$(dirname "$0")/.."
BINS=(bin/xmoe bin/bench_train_step bin/bench_moe_layer bin/bench_grouped_gemm
  tests/test_cuda_ops tests/test_cuda_moe tests/test_cuda_model tests/test_cuda_fp8
  tests/test_cuda_memory_model tests/mpi_test_cuda_train)

pack() {
  local base=${1:-}
  mkdir -p .gpu/lib
  local missing=()
  for b in "${BINS[@]}"; do [[ -x build/cuda/$b ]] || missing+=("$b"); done
  ((${#missing[@]} == 0)) || { echo "gpu-visit: build/cuda lacks ${missing[*]}" >&2; exit 1; }
  (cd build/cuda && tar cf - "${BINS[@]}") | xz -1 -T0 >.gpu/bins.tar.xz
  # The GPU machine has spdlog, fmt and yaml-cpp under other sonames (docs/DEVICE.md).
  ldd build/cuda/bin/xmoe | awk '/libspdlog|libfmt|libyaml-cpp/ { print $3 }' |
    xargs -r -I{} cp -L {} .gpu/lib/
  local cupti
  for cupti in /usr/local/cuda/lib64/libcupti.so.13 /usr/local/cuda-13.0/lib/libcupti.so.13 \
    /usr/local/cuda/extras/CUPTI/lib64/libcupti.so.13; do
    [[ -f $cupti ]] && { cp -L "$cupti" .gpu/lib/ && break; }
  done
  if [[ -n "$base" ]]; then
    (cd "$base" && tar cf - bin/bench_train_step) | xz -1 -T0 >.gpu/base.tar.xz
  fi
  if [[ ! -d .gpu/kjv/data ]] && command -v bible >/dev/null && [[ -x build/cpu/bin/xmoe ]]; then
    XMOE=build/cpu/bin/xmoe bash bench/real_data.sh prepare .gpu/kjv >/dev/null 2>&1 &&
      rm -f .gpu/kjv/kjv.txt
  fi
  du -sh .gpu
}

run() {
  local out=${OUT:-/tmp/gpu-visit} b=build/cuda
  mkdir -p "$out"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/card.txt"
  if [[ ! -x $b/bin/xmoe || .gpu/bins.tar.xz -nt $b/bin/xmoe ]]; then
    mkdir -p $b && xz -dc .gpu/bins.tar.xz | tar xf - -C $b && touch $b/bin/xmoe
  fi
  local nccl
  nccl=$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)
  export LD_LIBRARY_PATH="$PWD/.gpu/lib${nccl:+:$nccl/lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  local sonic=24576x1536x1024x32x2,24576x1536x512x64x4,24576x1536x256x128x8
  sonic+=,32768x4096x1024x64x4,32768x4096x512x128x8
  local status=0 start=$SECONDS part t dt
  for part in ${PARTS:-tests}; do
    echo "[gpu-visit] $((SECONDS - start)) s: $part"
    case $part in
      tests)
        # The four binaries at once, a quarter of the cores each: their time is mostly the CPU
        # references they check against, and device minutes are scarce.
        local pids=() names=(test_cuda_ops test_cuda_moe test_cuda_model test_cuda_fp8) i
        dt=$SECONDS
        for t in "${names[@]}"; do
          (
            s=$SECONDS
            OMP_NUM_THREADS=$(($(nproc) / 4 > 0 ? $(nproc) / 4 : 1)) \
              $b/tests/$t --gtest_filter=-'CudaPerf*' >"$out/$t.log" 2>&1
            rc=$?
            echo "seconds: $((SECONDS - s))" >>"$out/$t.log"
            exit $rc
          ) &
          pids+=($!)
        done
        for i in "${!pids[@]}"; do
          wait "${pids[$i]}" || status=1
          t=${names[$i]}
          grep -E "^\[  (PASSED|FAILED) |Failure$|^seconds: " "$out/$t.log" | sed "s/^/$t: /"
        done
        echo "tests: $((SECONDS - dt)) s together"
        mpirun --oversubscribe -np 1 $b/tests/mpi_test_cuda_train >"$out/mpi_test_cuda_train.log" 2>&1 ||
          status=1
        grep -E "PASSED|FAILED" "$out/mpi_test_cuda_train.log" | sed 's/^/mpi_test_cuda_train: /' ;;
      memory)
        $b/tests/test_cuda_memory_model >"$out/memory.log" 2>&1 || status=1
        grep -E "^\[memory\]|FAILED|PASSED|Failure" "$out/memory.log" ;;
      step)
        for t in 1 2; do
          $b/bin/bench_train_step --preset moe-1b --device cuda --steps 20 2>&1 | grep summary
        done | tee "$out/step.jsonl" ;;
      ab)
        # AB_SETS="a=1;a=2": the pair under each ;-separated list of --set values (default: none)
        [[ -f .gpu/base.tar.xz ]] || { echo "no .gpu/base.tar.xz: pack BASE_DIR"; status=1; continue; }
        mkdir -p build/gpu-visit-base && xz -dc .gpu/base.tar.xz | tar xf - -C build/gpu-visit-base
        local ab_sets v dt
        IFS=';' read -ra ab_sets <<<"${AB_SETS:-}"
        ((${#ab_sets[@]} == 0)) && ab_sets=("")
        for v in "${ab_sets[@]}"; do
          local args=()
          for kv in $v; do args+=(--set "$kv"); done
          for t in 1 2; do
            for dt in build/gpu-visit-base/bin $b/bin; do
              echo "== $dt $v"
              $dt/bench_train_step --preset moe-1b --device cuda --steps 20 "${args[@]}" 2>&1 |
                grep summary
            done
          done
        done | tee "$out/ab.log" ;;
      breakdown)
        for dt in bf16 fp8; do
          $b/bin/bench_train_step --preset moe-1b --device cuda --warmup 10 --steps 3 --breakdown \
            --set model.moe.expert_dtype=$dt >"$out/breakdown-$dt.log" 2>&1 || status=1
          tail -42 "$out/breakdown-$dt.log"
        done ;;
      layer | sonic)
        local shapes=()
        [[ $part == sonic ]] && shapes=(--shapes "$sonic")
        for dt in bf16 fp8; do
          $b/bin/bench_moe_layer --device cuda "${shapes[@]}" --warmup 3 --iters 10 \
            --expert-dtype $dt 2>&1 | grep '^{' || status=1
        done | tee "$out/$part.jsonl"
        if [[ $part == sonic ]]; then
          python3 bench/peers/moe_layer_torch.py --shapes "$sonic" --warmup 3 --iters 10 2>&1 |
            grep '^{' | tee -a "$out/$part.jsonl"
        fi ;;
      peer)
        python3 bench/peers/train_torch.py --preset moe-1b --warmup 3 --steps 8 2>&1 |
          grep summary | tee "$out/peer.jsonl" ;;
      kernels | kernels-fp8)
        # One metric needs no replay; the clocks are left alone (METHOD.md).
        local dt=bf16
        [[ $part == kernels-fp8 ]] && dt=fp8
        timeout 400 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
          --print-units base $b/bin/bench_train_step --preset moe-1b --device cuda --warmup 1 \
          --steps 1 --set model.moe.expert_dtype=$dt >"$out/$part.csv" 2>"$out/$part.err" ||
          status=1
        python3 scripts/ncu_kernels.py --parts "$out/$part.csv" | tee "$out/$part-parts.txt"
        python3 scripts/ncu_kernels.py "$out/$part.csv" | tee "$out/$part.txt" | head -40 ;;
      timeline)
        # In place and in seconds (ncu replays each kernel: minutes): idle time, gaps, and the
        # kernels by name and by part (scripts/ncu_kernels.py reads these files as its CSVs).
        for dt in bf16 fp8; do
          $b/bin/bench_train_step --preset moe-1b --device cuda --warmup 3 --steps 3 --timeline \
            --set model.moe.expert_dtype=$dt >"$out/timeline-$dt.jsonl" 2>"$out/timeline-$dt.err" ||
            status=1
          python3 -c '
import json, sys
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    j = json.loads(line)
    if j["bench"] == "train_step_summary":
        print("%s: timed step %.2f ms" % (sys.argv[2], j.get("median_step_ms", float("nan"))))
    if j["bench"] != "train_step_timeline":
        continue
    print("recorded step %.2f ms: span %.2f, busy %.2f, idle %.2f (host late %.2f); %d kernels" % (
        j["step_ms"], j["span_ms"], j["busy_ms"], j["idle_ms"], j["host_late_ms"], j["kernels"]))
    for g in j["longest_gaps"][:8]:
        print("  gap %8.1f us (host late %8.1f): %s -> %s" % (
            g["us"], g["host_late_us"], g["before"][:50], g["after"][:50]))
    for b in j["idle_before"][:12]:
        print("  idle before %-60s %.3f ms" % (b["name"][:60], b["idle_ms"]))
' "$out/timeline-$dt.jsonl" "$dt"
          python3 scripts/ncu_kernels.py --parts "$out/timeline-$dt.jsonl"
        done | tee "$out/timeline.txt"
        python3 scripts/ncu_kernels.py "$out/timeline-bf16.jsonl" "$out/timeline-fp8.jsonl" \
          >"$out/timeline-diff.txt" 2>&1 ;;
      shared)
        for t in 1 2; do
          for o in off routing all; do
            echo "== shared_overlap=$o"
            $b/bin/bench_train_step --preset moe-1b --device cuda --steps 20 \
              --set model.moe.shared_overlap=$o 2>&1 | grep summary
          done
        done | tee "$out/shared.log" ;;
      variants)
        # VARIANTS="a=1 b=2;a=3": moe-1b with each ;-separated list of --set values, alternated,
        # twice each
        local v sets
        for t in 1 2; do
          IFS=';' read -ra sets <<<"${VARIANTS:-}"
          for v in "${sets[@]}"; do
            echo "== $v"
            local args=()
            for kv in $v; do args+=(--set "$kv"); done
            $b/bin/bench_train_step --preset moe-1b --device cuda --steps 20 "${args[@]}" 2>&1 |
              grep summary
          done
        done | tee "$out/variants.log" ;;
      perf)
        $b/tests/test_cuda_ops --gtest_also_run_disabled_tests --gtest_filter='CudaPerf*' \
          2>&1 | grep '^{' | tee "$out/perf.jsonl" ;;
      profile)
        $b/bin/xmoe profile --device cuda --fp8 --quiet --out "$out/profile.json" \
          >"$out/profile.log" 2>&1 || status=1
        grep -E "fp8|gemm|check" "$out/profile.log"
        for dt in bf16 fp8; do
          $b/bin/xmoe plan --preset moe-1b --cluster dgx-h100 --profile "$out/profile.json" \
            --top 1 --set model.moe.expert_dtype=$dt 2>&1 | tail -2
        done | tee "$out/plan.log" ;;
      curve)
        STEPS=1000 XMOE=$b/bin/xmoe bash bench/real_data.sh fp8 .gpu/kjv >"$out/curve.log" 2>&1 ||
          status=1
        tail -3 "$out/curve.log"
        for dt in bf16 fp8; do cp .gpu/kjv/xmoe-$dt/metrics.jsonl "$out/metrics-$dt.jsonl"; done ;;
      *) echo "gpu-visit: unknown part $part" >&2; status=1 ;;
    esac
  done
  echo "[gpu-visit] $((SECONDS - start)) s: $([[ $status == 0 ]] && echo PASS || echo FAIL)"
  # The device tool brings back at most 8 files of $OUT: more go back as one archive.
  local files
  files=$(find "$out" -maxdepth 1 -type f | wc -l)
  if ((files > 8)); then
    (cd "$out" && tar czf logs.tgz --exclude=logs.tgz ./* && find . -maxdepth 1 -type f \
      ! -name logs.tgz -delete)
    echo "[gpu-visit] $files files in $out/logs.tgz"
  fi
  return $status
}

case ${1:-} in
  pack) pack "${2:-}" ;;
  run) run ;;
  *) echo "usage: gpu-visit.sh pack [BASE_DIR] | run (PARTS=...)" >&2; exit 2 ;;
esac
