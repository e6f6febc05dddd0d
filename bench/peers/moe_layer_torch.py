#!/usr/bin/env python3
"""PyTorch peers of xmoe's MoE-layer benchmark (bench/bench_moe_layer.cpp --device cuda).

Forward + backward of the routed experts of one MoE layer, routing and permutation included,
one device, bf16 activations and expert weights, written the two ways a competent PyTorch
user would:

  grouped_mm  router logits (f32) -> softmax -> top-k -> argsort the (token, slot) pairs by
              expert -> gather rows -> torch._grouped_mm with gate_up [E, d, 2f] -> SwiGLU ->
              torch._grouped_mm with down [E, f, d] -> scale by the combine weights ->
              index_add back to the tokens.
  padded      the same routing, then the DeepSpeed-MoE / Tutel layout: an [E, C, d] buffer,
              C = ceil(cf * T * k / E) (cf = 1.0), pairs beyond C dropped first-come-first-
              served in (token, slot) order, torch.bmm for both projections.

The gate is xmoe's default softmax_topk (softmax over E, top-k, weights renormalised; the
load-balance aux loss E * sum_e f_e * mean_t P_te with weight 0.01, backpropagated too), so
both sides do the same work. Routing comes from a random router (seeded): near uniform.

Timing: CUDA events around forward + backward, after warm-up passes, median of N. Before each
pass the gradients are set to None (PyTorch's default), so `peak_extra_bytes`
(torch.cuda.max_memory_allocated() minus the bytes held before the timed passes: parameters
and inputs) includes the parameter gradients the pass creates; `param_grad_bytes` says how
much of it that is. FLOPs = 3 x 2*T*k*(2*d*f + f*d). One JSON line per (shape, impl); one
that does not fit says "status": "out_of_memory" with the device's free and total bytes, and
the next one runs (as xmoe's bench_moe_layer does).

  python3 bench/peers/moe_layer_torch.py [--impls grouped_mm,padded] [--shapes TxdxfxExk,...]
      [--warmup 3] [--iters 10] [--device cuda|cpu] [--weights bf16|fp32] [--check]
      [--check-only] [--router-dtype f32|bf16]
  python3 bench/peers/moe_layer_torch.py --device cpu --check --shapes 256x64x32x8x2 --iters 2

--check first compares grouped_mm, padded (with a capacity that drops nothing) and a plain
per-expert loop on one small shape, same routing, f32 and bf16, and prints the errors
(bench "moe_layer_peer_check"); it exits 1 if they disagree. On the CPU, torch._grouped_mm is
PyTorch's own per-group loop (and if this PyTorch has none, a loop of torch.mm labelled
"loop-fallback" in the output); on CUDA it must be the real kernel.
"""
import argparse
import gc
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

DEFAULT_SHAPES = "16384x2048x1408x64x6,8192x7168x2048x256x8,8192x4096x14336x8x2"
CHECK_SHAPE = (512, 256, 128, 8, 2)  # dims multiples of 8: _grouped_mm wants 16-byte strides


def parse_shapes(text):
    shapes = []
    for item in text.split(","):
        if not item:
            continue
        fields = item.split("x")
        if len(fields) != 5 or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise SystemExit(f"--shapes: '{item}' is not TxdxfxExk of positive integers")
        T, d, f, E, k = map(int, fields)
        if k > E:
            raise SystemExit(f"--shapes: '{item}' has k > E")
        shapes.append((T, d, f, E, k))
    return shapes


def layer_flops(T, d, f, E, k):
    return 3 * 2 * T * k * (2 * d * f + f * d)


# ---- the grouped GEMM ------------------------------------------------------------------------

_GROUPED_MM_BACKEND = None


def _grouped_mm_loop(a, b, offs):
    """CPU-only stand-in for torch._grouped_mm (2d x 3d): one torch.mm per group."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))])


def init_grouped_mm(device):
    """Picks the grouped GEMM once: torch._grouped_mm, or on a CPU whose PyTorch lacks it the
    labelled loop fallback. Returns the name (printed in the JSON lines)."""
    global _GROUPED_MM_BACKEND
    _GROUPED_MM_BACKEND = "torch._grouped_mm"
    if torch.device(device).type == "cpu":
        try:
            torch._grouped_mm(torch.ones(1, 8), torch.ones(1, 8, 8),
                              offs=torch.ones(1, dtype=torch.int32))
        except (AttributeError, RuntimeError, NotImplementedError):
            _GROUPED_MM_BACKEND = "loop-fallback"
    elif not hasattr(torch, "_grouped_mm"):
        raise SystemExit(f"torch {torch.__version__} has no torch._grouped_mm (needs >= 2.8)")
    return _GROUPED_MM_BACKEND


def grouped_mm(a, b, offs):
    """a [N, K] rows grouped by expert, b [E, K, M], offs int32 [E] cumulative row counts."""
    if _GROUPED_MM_BACKEND == "loop-fallback":
        assert a.device.type == "cpu", "the loop fallback is for CPU smoke tests only"
        return _grouped_mm_loop(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)


# ---- the layer -------------------------------------------------------------------------------

ROUTER_BF16 = False  # --router-dtype bf16


def route(x, w_router, k, renormalize=True, aux_weight=0.01):
    """x [T, d] -> combine weights f32 [T, k], expert ids [T, k], aux loss (scalar), counts [E].

    The router runs in f32 (as xmoe's default): logits = x.float() @ w_router [d, E]; with
    --router-dtype bf16 (xmoe's model.moe.router_dtype = bf16) a bf16 GEMM, logits in f32."""
    T = x.shape[0]
    E = w_router.shape[1]
    if ROUTER_BF16:
        logits = (x.to(torch.bfloat16) @ w_router.to(torch.bfloat16)).float()  # [T, E]
    else:
        logits = x.float() @ w_router.float()                   # [T, E]
    probs = logits.softmax(dim=-1)
    topw, topi = probs.topk(k, dim=-1)                          # [T, k]
    if renormalize:
        topw = topw / topw.sum(dim=-1, keepdim=True)
    flat = topi.reshape(-1)
    # bincount would sync with the host (it sizes its output from max()); a scatter does not.
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    f_e = counts.float() / (T * k)                              # routed fraction, not differentiated
    aux = aux_weight * E * (f_e * probs.mean(dim=0)).sum()
    return topw, topi, aux, counts


def swiglu(h):
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def moe_grouped_mm(x, w_router, w1, w2, k, renormalize=True, aux_weight=0.01, **_):
    """Padding-free: x [T, d], w1 [E, d, 2f], w2 [E, f, d] -> (y [T, d], aux, dropped = 0)."""
    T, d = x.shape
    topw, topi, aux, counts = route(x, w_router, k, renormalize, aux_weight)
    flat = topi.reshape(-1)                                     # [T*k] pair -> expert
    order = torch.argsort(flat, stable=True)                    # pairs by expert, tokens ascending
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)       # [E] end row of each expert
    token = order // k                                          # [N] token of each sorted row
    rows = x.index_select(0, token)                             # [N, d]
    wdt = x.dtype
    h = grouped_mm(rows, w1.to(wdt), offs)                      # [N, 2f]
    out = grouped_mm(swiglu(h), w2.to(wdt), offs)               # [N, d]
    w = topw.reshape(-1).index_select(0, order)                 # [N] f32 combine weights
    y = x.new_zeros(T, d).index_add(0, token, out * w.unsqueeze(1).to(out.dtype))
    return y, aux, torch.zeros((), dtype=torch.int64, device=x.device)


def moe_padded(x, w_router, w1, w2, k, renormalize=True, aux_weight=0.01, capacity_factor=1.0):
    """[E, C, d] with capacity C = ceil(cf*T*k/E); overflow dropped -> (y, aux, dropped)."""
    T, d = x.shape
    E = w1.shape[0]
    N = T * k
    C = max(1, math.ceil(capacity_factor * N / E))
    topw, topi, aux, counts = route(x, w_router, k, renormalize, aux_weight)
    flat = topi.reshape(-1)
    # Position of each pair inside its expert, first come first served in (token, slot) order:
    # the rank in a stable sort by expert minus the expert's first sorted position.
    order = torch.argsort(flat, stable=True)
    starts = torch.cumsum(counts, dim=0) - counts
    rank_sorted = torch.arange(N, device=x.device) - starts.index_select(0, flat[order])
    pos = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    keep = pos < C
    dropped = (~keep).sum()
    # Kept pairs go to slot e*C + pos; dropped ones to a trash slot E*C that is cut off (no host
    # sync for a boolean mask).
    dest = torch.where(keep, flat * C + pos, torch.full_like(pos, E * C))
    pair_token = torch.arange(N, device=x.device) // k
    slot_token = torch.full((E * C + 1,), T, dtype=torch.int64, device=x.device)
    slot_token = slot_token.scatter_(0, dest, pair_token)[: E * C]   # T = empty slot (zero row)
    slot_w = topw.new_zeros(E * C + 1).scatter(0, dest, topw.reshape(-1))[: E * C]
    x_pad = F.pad(x, (0, 0, 0, 1))                              # [T+1, d], last row zero
    buf = x_pad.index_select(0, slot_token).view(E, C, d)       # [E, C, d], padding rows zero
    wdt = x.dtype
    h = torch.bmm(buf, w1.to(wdt))                              # [E, C, 2f]
    out = torch.bmm(swiglu(h), w2.to(wdt)).view(E * C, d)       # [E*C, d]
    y = x.new_zeros(T + 1, d).index_add(0, slot_token, out * slot_w.unsqueeze(1).to(out.dtype))
    return y[:T], aux, dropped


def moe_reference(x, w_router, w1, w2, k, renormalize=True, aux_weight=0.01, **_):
    """A plain loop over experts (for the checks only)."""
    T, d = x.shape
    E = w1.shape[0]
    topw, topi, aux, _counts = route(x, w_router, k, renormalize, aux_weight)
    y = x.new_zeros(T, d)
    for e in range(E):
        tok, slot = (topi == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        o = swiglu(x[tok] @ w1[e].to(x.dtype)) @ w2[e].to(x.dtype)
        y = y.index_add(0, tok, o * topw[tok, slot].unsqueeze(1).to(o.dtype))
    return y, aux, torch.zeros((), dtype=torch.int64)


IMPLS = {"grouped_mm": moe_grouped_mm, "padded": moe_padded}


# ---- setup, timing ---------------------------------------------------------------------------

def make_params(shape, device, weight_dtype, seed):
    """Router f32 [d, E] and experts N(0, 0.02^2) (xmoe's init_std), x, dy ~ N(0, 1), bf16."""
    T, d, f, E, k = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    w_router = torch.empty(d, E, device=device).normal_(0, 0.02, generator=gen)
    w1 = torch.empty(E, d, 2 * f, device=device, dtype=weight_dtype).normal_(0, 0.02, generator=gen)
    w2 = torch.empty(E, f, d, device=device, dtype=weight_dtype).normal_(0, 0.02, generator=gen)
    x = torch.empty(T, d, device=device, dtype=torch.bfloat16).normal_(0, 1, generator=gen)
    dy = torch.empty(T, d, device=device, dtype=torch.bfloat16).normal_(0, 1, generator=gen)
    for t in (w_router, w1, w2, x):
        t.requires_grad_(True)
    return w_router, w1, w2, x, dy


def one_pass(fn, x, params, dy, k, kwargs):
    for t in (x, *params):
        t.grad = None
    y, aux, dropped = fn(x, *params, k, **kwargs)
    torch.autograd.backward([y, aux], [dy, torch.ones_like(aux)])
    return dropped


def bench(fn, shape, params, x, dy, warmup, iters, kwargs):
    device = x.device
    cuda = device.type == "cuda"
    k = shape[4]
    times, base = [], 0
    dropped = None
    for i in range(warmup + iters):
        if i == warmup and cuda:
            for t in (x, *params):
                t.grad = None
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dropped = one_pass(fn, x, params, dy, k, kwargs)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            dropped = one_pass(fn, x, params, dy, k, kwargs)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    return statistics.median(times), peak, grad_bytes, int(dropped)


# ---- the agreement check ---------------------------------------------------------------------

def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def check(device, seed):
    """Same routing, nothing dropped -> grouped_mm, padded and the loop agree (y and every grad)."""
    T, d, f, E, k = CHECK_SHAPE
    init_grouped_mm(device)
    results, ok = {}, True
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        if dtype == torch.float32 and device.type == "cuda":
            tol = 1e-2  # TF32 may be on for f32 matmuls; the real test is bf16 below
        w_router, w1, w2, x, dy = make_params((T, d, f, E, k), device, torch.float32, seed)
        xs = x.detach().to(dtype).requires_grad_(True)
        w1s = w1.detach().to(dtype).requires_grad_(True)
        w2s = w2.detach().to(dtype).requires_grad_(True)
        dys = dy.to(dtype)
        outs = {}
        # Capacity E/k: C = T, so nothing can drop and padded must equal the others.
        for name, fn, kw in (("reference", moe_reference, {}),
                             ("grouped_mm", moe_grouped_mm, {}),
                             ("padded", moe_padded, {"capacity_factor": E / k})):
            params = (w_router, w1s, w2s)
            dropped = one_pass(fn, xs, params, dys, k, kw)
            outs[name] = {"y": fn(xs, *params, k, **kw)[0].detach(), "dx": xs.grad.clone(),
                          "d_router": w_router.grad.clone(), "d_gate_up": w1s.grad.clone(),
                          "d_down": w2s.grad.clone(), "dropped": int(dropped)}
        ref = outs["reference"]
        for name in ("grouped_mm", "padded"):
            errs = {key: rel_err(outs[name][key], ref[key])
                    for key in ("y", "dx", "d_router", "d_gate_up", "d_down")}
            worst = max(errs.values())
            passed = worst <= tol and outs[name]["dropped"] == 0
            ok = ok and passed
            results[f"{name}_vs_reference_{str(dtype).split('.')[-1]}"] = {
                "max_rel_err": {key: float(f"{v:.3g}") for key, v in errs.items()},
                "tol": tol, "dropped": outs[name]["dropped"], "ok": passed}
    # At capacity factor 1.0 the padded layer must drop some pairs, and only those differ.
    w_router, w1, w2, x, dy = make_params((T, d, f, E, k), device, torch.bfloat16, seed)
    _, _, dropped = moe_padded(x, w_router, w1, w2, k, capacity_factor=1.0)
    line = {"bench": "moe_layer_peer_check", "device": str(device), "torch": torch.__version__,
            "grouped_mm_backend": _GROUPED_MM_BACKEND, "T": T, "d": d, "f": f, "E": E, "k": k,
            **results, "padded_cf1_dropped": int(dropped), "ok": ok}
    print(json.dumps(line), flush=True)
    return ok


def out_of_memory(line, message, device):
    """Marks a line as a run that did not fit, with the device's free and total bytes now."""
    line.update({"status": "out_of_memory", "message": message[:500]})
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        line.update({"bytes_free": free, "bytes_total": total})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", default="grouped_mm,padded")
    ap.add_argument("--shapes", default=None, help=f"TxdxfxExk,... (default {DEFAULT_SHAPES})")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--weights", choices=("bf16", "fp32"), default="bf16",
                    help="expert weight dtype; fp32 = master weights cast to bf16 every forward "
                         "(as xmoe does; needs ~2x the memory)")
    ap.add_argument("--capacity-factor", type=float, default=1.0, help="padded only")
    ap.add_argument("--router-dtype", choices=("f32", "bf16"), default="f32",
                    help="router GEMM operands (xmoe's model.moe.router_dtype)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--check", action="store_true", help="agreement check first (small shape)")
    ap.add_argument("--check-only", action="store_true", help="the agreement check, no timing")
    args = ap.parse_args()
    global ROUTER_BF16
    ROUTER_BF16 = args.router_dtype == "bf16"

    device = torch.device(args.device)
    init_grouped_mm(device)
    impls = [s for s in args.impls.split(",") if s]
    for name in impls:
        if name not in IMPLS:
            raise SystemExit(f"--impls: unknown '{name}' (known: {', '.join(IMPLS)})")
    shapes = parse_shapes(args.shapes or DEFAULT_SHAPES)
    if (args.check or args.check_only) and not check(device, args.seed):
        print("moe_layer_torch: the implementations disagree (see the check line)", file=sys.stderr)
        sys.exit(1)
    if args.check_only:
        return
    weight_dtype = torch.bfloat16 if args.weights == "bf16" else torch.float32
    status = 0
    for shape in shapes:
        T, d, f, E, k = shape
        try:
            params_and_io = make_params(shape, device, weight_dtype, args.seed)
        except torch.OutOfMemoryError as e:  # a result: the next shape runs
            line = {"bench": "moe_layer_peer", "impl": "grouped_mm", "device": str(device),
                    "weights": args.weights, "T": T, "d": d, "f": f, "E": E, "k": k}
            out_of_memory(line, f"creating the parameters: {e}", device)
            print(json.dumps(line), flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        w_router, w1, w2, x, dy = params_and_io
        params = (w_router, w1, w2)
        for name in impls:
            kwargs = {"capacity_factor": args.capacity_factor} if name == "padded" else {}
            line = {"bench": "moe_layer_peer", "impl": name, "device": str(device),
                    "dtype": "bf16", "weights": args.weights, "router_dtype": args.router_dtype,
                    "T": T, "d": d, "f": f, "E": E, "k": k,
                    "capacity_factor": args.capacity_factor if name == "padded" else None,
                    "warmup": args.warmup, "iters": args.iters}
            try:
                ms, peak, grad_bytes, dropped = bench(IMPLS[name], shape, params, x, dy,
                                                      args.warmup, args.iters, kwargs)
                line.update({"median_ms": round(ms, 3),
                             "tflops": round(layer_flops(*shape) / (ms / 1e3) / 1e12, 3),
                             "tokens_per_s": round(T / (ms / 1e3)),
                             "peak_extra_bytes": peak, "param_grad_bytes": grad_bytes,
                             "dropped": dropped, "torch": torch.__version__})
                if name == "grouped_mm":
                    line["grouped_mm_backend"] = _GROUPED_MM_BACKEND
            except torch.OutOfMemoryError as e:  # a result: the next one runs
                out_of_memory(line, str(e), device)
            except RuntimeError as e:  # report, go on to the next
                line["error"] = f"{type(e).__name__}: {e}"[:500]
                status = 1
            print(json.dumps(line), flush=True)
            for t in params + (x,):
                t.grad = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del params, params_and_io, w_router, w1, w2, x, dy
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    sys.exit(status)


if __name__ == "__main__":
    main()
