#!/usr/bin/env python3
"""Sums the last training step's kernels by name from an ncu CSV (gpu-visit.sh, part kernels).

A step ends with AdamW: the kernels after the previous step's last adamw_kernel launch are the
last step's. With one CSV, prints ms per kernel name, largest first, and the step's total; with
two (before, after), prints both columns and the difference, largest change first.

  python3 scripts/ncu_kernels.py kernels.csv
  python3 scripts/ncu_kernels.py before.csv after.csv
"""
import collections
import csv
import signal
import sys


def last_step(path):
    """(kernel name -> ms, kernel name -> launches, launches) of the CSV's last step."""
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


def main(paths):
    if len(paths) == 1:
        total, count, n = last_step(paths[0])
        print(f"kernels {n}, total {sum(total.values()):.2f} ms (the last step)")
        for key, ms in total.most_common():
            print(f"{ms:9.3f} ms {count[key]:6d}x  {key}")
        return
    (a, ca, na), (b, cb, nb) = last_step(paths[0]), last_step(paths[1])
    print(f"kernels {na} -> {nb}, total {sum(a.values()):.2f} -> {sum(b.values()):.2f} ms")
    keys = sorted(set(a) | set(b), key=lambda k: -abs(b[k] - a[k]))
    for key in keys:
        print(f"{a[key]:9.3f} {b[key]:9.3f} {b[key] - a[key]:+9.3f} ms "
              f"{ca[key]:5d}x {cb[key]:5d}x  {key}")


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the output quietly
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(sys.argv[1:])
