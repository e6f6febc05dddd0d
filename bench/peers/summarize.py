#!/usr/bin/env python3
"""Side-by-side table of xmoe and its PyTorch peers from the JSON lines of bench/gpu_bench.sh.

  python3 bench/peers/summarize.py /tmp/gpu-bench.jsonl     (or JSON lines on stdin)

MoE layer (per shape T, d, f, E, k): xmoe's "moe_layer" (impl xmoe_pft; f32 expert gradients,
and bf16 ones where a run has expert_grad_dtype bf16) against the "moe_layer_peer" lines
(grouped_mm, padded); ratio = xmoe TFLOP/s / peer TFLOP/s (> 1: xmoe is
faster), memory ratio = xmoe peak_extra_bytes / peer peak_extra_bytes, and the same with the
peer's bf16 parameter gradients (param_grad_bytes) added to xmoe's bf16-gradient peak, as the
pass creates them on the peer's side (xmoe allocates its gradients before the pass). Training step:
"train_step_summary" (bench_train_step) against "train_step_peer_summary"; ratio = xmoe
tokens/s / peer tokens/s. Attention ("attention" lines of bench_attention and
attention_torch.py): forward + backward ms per implementation and shape, ratio = SDPA ms / xmoe
ms. A run that did not fit ("status": "out_of_memory") shows as "did not fit" with the bytes it
asked and the device's free and total bytes: a result, not an error. Lines that are not JSON are
ignored; error lines ("error", or "status": "error") are listed and make the exit code 1.
"""
import json
import sys


def load(stream):
    rows = []
    for line in stream:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def gib(b):
    return f"{b / 2**30:.2f}" if isinstance(b, (int, float)) else "—"


def fmt(x, spec=".1f"):
    return format(x, spec) if isinstance(x, (int, float)) else "—"


def ratio(a, b, spec=".2f"):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
        return format(a / b, spec)
    return "—"


def did_not_fit(r):
    return r.get("status") == "out_of_memory"


def no_fit_cell(r):
    asked = f"asked {gib(r['bytes_asked'])} GiB, " if r.get("bytes_asked") is not None else ""
    return (f"did not fit ({asked}{gib(r.get('bytes_free'))} of {gib(r.get('bytes_total'))} "
            f"GiB free)")


def counted(xmoe_bf16, peer):
    """xmoe's peak with its bf16 gradients counted (they equal the peer's in size)."""
    a, b = xmoe_bf16.get("peak_extra_bytes"), peer.get("param_grad_bytes")
    return a + b if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None


def main():
    rows = load(open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin)
    for r in rows:
        if r.get("bench") == "moe_layer_peer_check":
            print(f"peer agreement check ({r.get('device')}, {r.get('grouped_mm_backend')}): "
                  f"{'ok' if r.get('ok') else 'FAILED'}")
    errors = [r for r in rows if "error" in r or r.get("status") == "error"]
    for r in errors:
        what = r.get("error", r.get("message"))
        print(f"ERROR in {r.get('bench')} {r.get('impl', r.get('preset', ''))}: {str(what)[:200]}")
    for r in rows:
        if did_not_fit(r):
            what = r.get("impl", r.get("preset", ""))
            where = r.get("shape") or "x".join(str(r[c]) for c in "TdfEk" if c in r)
            print(f"{r.get('bench')} {what} {where}: {no_fit_cell(r)}")

    # ---- MoE layer ----
    shape_key = lambda r: (r["T"], r["d"], r["f"], r["E"], r["k"])  # noqa: E731
    def xmoe_rows(grad_dtype):
        out = {}
        for r in rows:  # a measured line wins over one that did not fit
            if (r.get("bench") == "moe_layer" and r.get("impl") == "xmoe_pft"
                    and r.get("expert_grad_dtype", "f32") == grad_dtype
                    and ("median_ms" in r or did_not_fit(r))
                    and "median_ms" not in out.get(shape_key(r), {})):
                out[shape_key(r)] = r
        return out
    xmoe, xmoe_bf16 = xmoe_rows("f32"), xmoe_rows("bf16")
    peers = {}
    for r in rows:
        if r.get("bench") == "moe_layer_peer" and ("median_ms" in r or did_not_fit(r)):
            peers.setdefault(shape_key(r), {})[r["impl"]] = r
    shapes = sorted(set(xmoe) | set(peers), key=lambda s: (s[3], s[0]))
    if shapes:
        print("\nMoE layer, forward + backward, bf16 (TFLOP/s; ms; peak extra GiB)")
        head = ("| T, d, f, E, k | xmoe pft | xmoe pft, bf16 expert grads | torch grouped_mm "
                "| torch padded cf1 (dropped) | xmoe / grouped_mm (f32; bf16 grads) "
                "| xmoe / padded | mem xmoe / grouped_mm | mem, bf16 grads counted |")
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for s in shapes:
            x, g, p = xmoe.get(s, {}), peers.get(s, {}).get("grouped_mm", {}), \
                peers.get(s, {}).get("padded", {})
            xb = xmoe_bf16.get(s, {})
            def cell(r):
                if not r:
                    return "—"
                if did_not_fit(r):
                    return no_fit_cell(r)
                weights = " [bf16 weights]" if r.get("weights") == "bf16" else ""
                return (f"{fmt(r.get('tflops'))} ({fmt(r.get('median_ms'), '.2f')} ms, "
                        f"{gib(r.get('peak_extra_bytes'))}){weights}")
            pcell = cell(p) + (f" [{p.get('dropped')}]" if p and not did_not_fit(p) else "")
            print(f"| {', '.join(map(str, s))} | {cell(x)} | {cell(xb)} | {cell(g)} | {pcell} "
                  f"| {ratio(x.get('tflops'), g.get('tflops'))}; "
                  f"{ratio(xb.get('tflops'), g.get('tflops'))} "
                  f"| {ratio(x.get('tflops'), p.get('tflops'))} "
                  f"| {ratio(x.get('peak_extra_bytes'), g.get('peak_extra_bytes'))} "
                  f"| {ratio(counted(xb, g), g.get('peak_extra_bytes'))} |")

    # ---- attention ----
    attn = {}
    for r in rows:
        if r.get("bench") == "attention" and r.get("pass") == "forward+backward":
            key = (r["B"], r["S"], r["H"], r["Hkv"], r["hd"])
            attn.setdefault(key, {})[r["impl"]] = r["median_ms"]
    if attn:
        impls = sorted({i for v in attn.values() for i in v if i != "torch_sdpa"})
        print("\nAttention, causal, forward + backward (ms; SDPA ms / xmoe ms)")
        print("| B, S, H, Hkv, hd | " + " | ".join(impls) + " | torch_sdpa |")
        print("|" + "---|" * (len(impls) + 2))
        for key, v in sorted(attn.items()):
            sdpa = v.get("torch_sdpa")
            cells = [f"{fmt(v.get(i), '.3f')} ({ratio(sdpa, v.get(i))})" for i in impls]
            print(f"| {', '.join(map(str, key))} | " + " | ".join(cells) +
                  f" | {fmt(sdpa, '.3f')} |")

    # ---- training step ----
    xt = [r for r in rows if r.get("bench") == "train_step_summary"]
    pt = [r for r in rows if r.get("bench") == "train_step_peer_summary"]
    if xt or pt:
        print("\nTraining step (median)")
        print("| run | preset | step ms | tokens/s | TFLOP/s | MFU | peak GiB |")
        print("|---|---|---|---|---|---|---|")
        for name, r, peak in [("xmoe", r, r.get("peak_live_bytes")) for r in xt] + \
                             [("torch" + (" compiled" if r.get("compiled") else " eager"), r,
                               r.get("peak_bytes")) for r in pt]:
            if did_not_fit(r) or r.get("status") == "error":
                what = no_fit_cell(r) if did_not_fit(r) else "error"
                print(f"| {name} | {r.get('preset')} | {what} | | | | |")
                continue
            mfu = r.get("mfu")
            print(f"| {name} | {r.get('preset')} | {fmt(r.get('median_step_ms'))} "
                  f"| {fmt(r.get('tokens_per_s'), '.0f')} | {fmt(r.get('tflops_per_s'))} "
                  f"| {fmt(100 * mfu if mfu is not None else None, '.2f')}% | {gib(peak)} |")
        for x in xt:
            for p in pt:
                if p.get("preset") == x.get("preset") and "tokens_per_s" in x:
                    print(f"xmoe / torch tokens/s ({x.get('preset')}): "
                          f"{ratio(x.get('tokens_per_s'), p.get('tokens_per_s'))}; params "
                          f"{x.get('params_total')}/{x.get('params_active')} (xmoe) vs "
                          f"{p.get('params_total')}/{p.get('params_active')} (torch)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
