#!/usr/bin/env python3
"""Sums the last training step's kernels by name from an ncu CSV (gpu-visit.sh, part kernels).

A step ends with AdamW: the kernels after the second-to-last run of adamw_kernel are the last
step's. Prints ms per kernel name, largest first, and the step's total.
"""
import collections
import csv
import sys


def main(path):
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu's CSV lines; the program's output not
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            rows.append((int(r["ID"]), r["Kernel Name"], float(r["Metric Value"].replace(",", "")) / 1e6))
    rows.sort()
    adam = [i for i, (_, name, _) in enumerate(rows) if "adamw_kernel" in name]
    # the last step: after the last AdamW launch of the step before
    ends = [i for k, i in enumerate(adam) if k + 1 < len(adam) and adam[k + 1] != i + 1]
    start = ends[-1] + 1 if ends else 0
    step = rows[start:]
    total = collections.Counter()
    count = collections.Counter()
    for _, name, ms in step:
        key = name.split("(")[0][:110]
        total[key] += ms
        count[key] += 1
    print(f"kernels {len(step)}, total {sum(total.values()):.2f} ms (the last step)")
    for key, ms in total.most_common():
        print(f"{ms:9.3f} ms {count[key]:6d}x  {key}")


if __name__ == "__main__":
    main(sys.argv[1])
