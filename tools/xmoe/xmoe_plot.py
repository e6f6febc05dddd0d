#!/usr/bin/env python3
"""PNG plots of a run's metrics.jsonl; `xmoe plot RUN_DIR [--out DIR]` runs this helper.

Usage: xmoe_plot.py METRICS_JSONL OUT_DIR [--compare METRICS_JSONL ...]
Writes loss.png (training and validation loss), lr.png, grad_norm.png, tokens_per_s.png,
expert_load.png (the busiest and the idlest expert's load),
expert_load_spread.png (their ratio), mfu.png (CUDA runs) and
overview.png (all panels), and prints one line per file written. With --compare, also
compare_loss.png: every run's training loss (mean over 20-step windows) and validation loss on
one axis, each run named by its folder.
Exit status: 0 done, 2 bad input (the message says what), 3 matplotlib missing.
"""
import json
import os
import sys


def fail(message, status=2):
    print(message, file=sys.stderr)
    sys.exit(status)


def read_metrics(path):
    """Training lines (with "loss") and validation lines (with "val_loss"), in file order."""
    steps, evals = [], []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            text = text.strip()
            if not text:
                continue
            try:
                line = json.loads(text)
            except json.JSONDecodeError as e:
                fail(f"{path}:{number}: not a JSON line ({e.msg})")
            if "val_loss" in line:
                evals.append(line)
            elif "loss" in line:
                steps.append(line)
    return steps, evals


def series(lines, key):
    """(steps, values) of the lines that hold `key` with a finite number."""
    xs, ys = [], []
    for line in lines:
        v = line.get(key)
        if isinstance(v, (int, float)) and v == v and abs(v) != float("inf"):
            xs.append(line["step"])
            ys.append(v)
    return xs, ys


def panels(steps, evals):
    """Each panel: (file stem, title, y label, [(label, xs, ys)], log y)."""
    out = [("loss", "Loss", "nats/token",
            [("training", *series(steps, "loss")), ("validation", *series(evals, "val_loss"))],
            False),
           ("lr", "Learning rate", "lr", [("lr", *series(steps, "lr"))], False),
           ("grad_norm", "Gradient norm (before clipping)", "global L2 norm",
            [("grad norm", *series(steps, "grad_norm"))], True),
           ("tokens_per_s", "Throughput", "tokens/s",
            [("tokens/s", *series(steps, "tokens_per_s"))], False)]
    out.append(("expert_load", "Expert load (tokens per expert, over all MoE layers)", "tokens",
                [("busiest expert", *series(steps, "max_expert_load")),
                 ("idlest expert", *series(steps, "min_expert_load"))], False))
    # Steps where an expert got no token have no ratio: they are left out of this panel.
    ratio = [(line["step"], line["max_expert_load"] / line["min_expert_load"]) for line in steps
             if line.get("min_expert_load", 0) > 0 and "max_expert_load" in line]
    out.append(("expert_load_spread", "Expert load spread (busiest / idlest; 1 = balanced)",
                "ratio", [("busiest / idlest", [s for s, _ in ratio], [r for _, r in ratio])],
                True))
    mfu = series(steps, "mfu")
    if mfu[0]:
        out.append(("mfu", "Model FLOPs utilisation", "MFU", [("MFU", *mfu)], False))
    # A panel with no point at all (a dense model has no expert load) is left out.
    return [p for p in out if any(xs for _, xs, _ in p[3])]


def draw(ax, title, ylabel, curves, log_y):
    for label, xs, ys in curves:
        if xs:
            ax.plot(xs, ys, label=label, marker="o" if len(xs) < 20 else None, linewidth=1.2)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log_y and all(y > 0 for _, _, ys in curves for y in ys):
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if len([c for c in curves if c[1]]) > 1:
        ax.legend()


def run_name(metrics):
    return os.path.basename(os.path.dirname(os.path.abspath(metrics)))


def windowed(xs, ys, width=20):
    """Means over consecutive windows of `width` steps (a readable training curve)."""
    out_x, out_y = [], []
    for i in range(0, len(xs) - width + 1, width):
        out_x.append(xs[i + width - 1])
        out_y.append(sum(ys[i:i + width]) / width)
    return (out_x, out_y) if out_x else (xs, ys)


def draw_comparison(plt, runs, path):
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=100)
    for metrics, steps, evals in runs:
        name = run_name(metrics)
        line, = ax.plot(*windowed(*series(steps, "loss")), linewidth=1.2,
                        label=f"{name} training (20-step mean)")
        xs, ys = series(evals, "val_loss")
        if xs:
            ax.plot(xs, ys, marker="o", linestyle="--", color=line.get_color(), linewidth=1,
                    label=f"{name} validation")
    ax.set_title("Loss")
    ax.set_xlabel("step")
    ax.set_ylabel("nats/token")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv):
    args = argv[1:]
    compare = []
    if "--compare" in args:
        at = args.index("--compare")
        compare, args = args[at + 1:], args[:at]
        if not compare:
            fail("--compare needs at least one metrics.jsonl")
    if len(args) != 2:
        fail("usage: xmoe_plot.py METRICS_JSONL OUT_DIR [--compare METRICS_JSONL ...]")
    metrics, out_dir = args
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        fail(f"matplotlib is not installed for {sys.executable} "
             "(bash scripts/install-deps.sh installs it, or: python3 -m pip install matplotlib)", 3)
    if not os.path.isfile(metrics):
        fail(f"{metrics}: no such file (is the folder a run folder of xmoe train?)")
    steps, evals = read_metrics(metrics)
    if not steps:
        fail(f"{metrics} holds no training step yet")
    os.makedirs(out_dir, exist_ok=True)
    chosen = panels(steps, evals)
    written = []
    for stem, title, ylabel, curves, log_y in chosen:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
        draw(ax, title, ylabel, curves, log_y)
        fig.tight_layout()
        path = os.path.join(out_dir, stem + ".png")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    cols = 2
    rows = (len(chosen) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(13, 4 * rows), dpi=90, squeeze=False)
    for ax, (_, title, ylabel, curves, log_y) in zip(axes.flat, chosen):
        draw(ax, title, ylabel, curves, log_y)
    for ax in list(axes.flat)[len(chosen):]:
        ax.axis("off")
    fig.suptitle(f"{os.path.dirname(os.path.abspath(metrics))}: steps "
                 f"{steps[0]['step']}-{steps[-1]['step']}")
    fig.tight_layout()
    path = os.path.join(out_dir, "overview.png")
    fig.savefig(path)
    plt.close(fig)
    written.append(path)
    if compare:
        runs = [(metrics, steps, evals)]
        for other in compare:
            if not os.path.isfile(other):
                fail(f"{other}: no such file (is the folder a run folder of xmoe train?)")
            other_steps, other_evals = read_metrics(other)
            if not other_steps:
                fail(f"{other} holds no training step yet")
            runs.append((other, other_steps, other_evals))
        path = os.path.join(out_dir, "compare_loss.png")
        draw_comparison(plt, runs, path)
        written.append(path)
    for path in written:
        print(path)


if __name__ == "__main__":
    main(sys.argv)
