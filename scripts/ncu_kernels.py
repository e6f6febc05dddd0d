#!/usr/bin/env python3
"""Sums the last training step's kernels by name from an ncu CSV (gpu-visit.sh, part kernels)
or from bench_train_step --timeline's JSON lines (part timeline: CUPTI's in-place durations of
one step, the last "train_step_timeline" line of the file).

In a CSV, a step ends with AdamW: the kernels after the previous step's last adamw_kernel
launch are the last step's. With one CSV, prints ms per kernel name, largest first, and the step's total; with
two (before, after), prints both columns and the difference, largest change first. With
--parts, the same by part of the step (the routed experts' grouped GEMMs, attention, AdamW, ...:
the table docs/benchmarks.md keeps of where a step goes).

  python3 scripts/ncu_kernels.py [--parts] kernels.csv
  python3 scripts/ncu_kernels.py [--parts] before.csv after.csv
  python3 scripts/ncu_kernels.py [--parts] timeline-bf16.jsonl timeline-fp8.jsonl
"""
import collections
import csv
import json
import re
import signal
import sys

# (part, pattern over the kernel name), first match wins; unmatched kernels are "other".
PARTS = [
    ("routed experts' grouped GEMMs",
     r"GroupProblemShape|write_problems|write_fp8_problems|sm90::.*add_partials"),
    ("attention (cuDNN / xmoe)", r"cudnn|sdpa|flash|attention"),
    # the f32 router's split into bf16 terms and their sum are its GEMM's
    ("other GEMMs (cuBLAS)", r"nvjet|cublas|gemm|split_bf16_columns|sum_column_blocks"),
    ("AdamW", r"adamw"),
    ("gradient norm", r"sum_squares|sum_partials"),
    ("FP8 quantisers", r"quantize"),
    ("order / I-Order gathers", r"gather_rows|gather_weighted_rows_dot|gather_sum_rows"),
    ("router, layout, aux losses",
     r"topk|softmax|layout|seq_count|seq_psum|chunk_psum|lse_|totals|aux_|put_along|take_along"
     r"|routing"),
    ("norms", r"rmsnorm"),
    ("SwiGLU", r"swiglu"),
    ("RoPE", r"rope"),
    ("cross-entropy", r"cross_entropy"),
    ("embedding backward", r"scatter_rows|scatter_keys|RadixSort|segment_offsets|find_bad_index"),
    ("elementwise (add, cast, scale)", r"add_|cast|scale|copy|fill"),
]


def part_of(name):
    for part, pattern in PARTS:
        if re.search(pattern, name):
            return part
    return "other"


def by_part(total, count):
    """(part -> ms, part -> launches) from kernel name -> ms, launches."""
    t, c = collections.Counter(), collections.Counter()
    for key, ms in total.items():
        t[part_of(key)] += ms
        c[part_of(key)] += count[key]
    return t, c


def timeline_step(path):
    """last_step's triple from the file's last train_step_timeline line (kernels only)."""
    line = None
    with open(path) as f:
        for l in f:
            if l.startswith("{") and '"train_step_timeline"' in l:
                line = json.loads(l)
    if line is None:
        sys.exit(f"{path}: no train_step_timeline line")
    total, count = collections.Counter(), collections.Counter()
    for n in line["by_name"]:
        if n["name"].startswith(("memcpy", "memset")):
            continue
        total[n["name"][:110]] += n["ms"]
        count[n["name"][:110]] += n["count"]
    return total, count, sum(count.values())


def last_step(path):
    """(kernel name -> ms, kernel name -> launches, launches) of the CSV's last step."""
    if path.endswith(".jsonl"):
        return timeline_step(path)
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu's CSV lines, not the program's output
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            ns = float(r["Metric Value"].replace(",", ""))  # base units: thousands separated
            rows.append((int(r["ID"]), r["Kernel Name"], ns / 1e6))
    rows.sort()
    adam = [i for i, (_, name, _) in enumerate(rows) if "adamw_kernel" in name]
    # the last launch of each step's AdamW run: the next AdamW launch is not the next kernel
    ends = [i for k, i in enumerate(adam) if k + 1 < len(adam) and adam[k + 1] != i + 1]
    step = rows[ends[-1] + 1 if ends else 0:]
    total, count = collections.Counter(), collections.Counter()
    for _, name, ms in step:
        key = name.split("(")[0][:110]
        total[key] += ms
        count[key] += 1
    return total, count, len(step)


def main(paths, parts=False):
    steps = [last_step(p) for p in paths]
    if parts:
        steps = [(*by_part(t, c), n) for t, c, n in steps]
    if len(paths) == 1:
        total, count, n = steps[0]
        print(f"kernels {n}, total {sum(total.values()):.2f} ms (the last step)")
        for key, ms in total.most_common():
            print(f"{ms:9.3f} ms {count[key]:6d}x  {key}")
        return
    (a, ca, na), (b, cb, nb) = steps
    print(f"kernels {na} -> {nb}, total {sum(a.values()):.2f} -> {sum(b.values()):.2f} ms")
    keys = sorted(set(a) | set(b), key=lambda k: -abs(b[k] - a[k]))
    for key in keys:
        print(f"{a[key]:9.3f} {b[key]:9.3f} {b[key] - a[key]:+9.3f} ms "
              f"{ca[key]:5d}x {cb[key]:5d}x  {key}")


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the output quietly
    args = [a for a in sys.argv[1:] if a != "--parts"]
    if len(args) not in (1, 2):
        sys.exit(__doc__)
    main(args, parts="--parts" in sys.argv[1:])
