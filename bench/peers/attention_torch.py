"""PyTorch peer of bench_attention: causal SDPA forward and backward (bf16, one GPU).

Prints the same JSON lines as bench/bench_attention.cpp (impl "torch_sdpa"), with the same FLOP
count (causal half of the S x S products; backward = 2.5x forward), so the two compare line by
line. The SDPA backend is PyTorch's choice (FlashAttention-2 or cuDNN on Hopper).
    python3 bench/peers/attention_torch.py [--shapes "B,S,H,Hkv,hd;..."] [--iters N]
"""
import argparse
import json

import torch
import torch.nn.functional as F


def median_ms(fn, iters):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8,2048,16,16,64;4,4096,16,16,128;2,8192,32,8,128")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    for text in args.shapes.split(";"):
        b, s, h, hkv, hd = (int(x) for x in text.split(","))
        # SDPA wants (B, H, S, hd); xmoe's layout is (B, S, H, hd): transpose views, as a model
        # written around SDPA would.
        q = torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, s, hkv, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(b, s, hkv, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        q.requires_grad_(True)
        k.requires_grad_(True)
        v.requires_grad_(True)
        dout = torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16)
        gqa = hkv != h

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        out = fwd()
        f_ms = median_ms(lambda: fwd(), args.iters)

        def fwd_bwd():
            o = fwd()
            torch.autograd.grad(o, (q, k, v), dout)

        fb_ms = median_ms(fwd_bwd, args.iters)
        del out
        fwd_flops = 4.0 * b * h * s * s * hd / 2
        for name, ms, flops in (("forward", f_ms, fwd_flops),
                                ("backward", fb_ms - f_ms, 2.5 * fwd_flops),
                                ("forward+backward", fb_ms, 3.5 * fwd_flops)):
            print(json.dumps({"bench": "attention", "impl": "torch_sdpa", "dtype": "bf16", "B": b,
                              "S": s, "H": h, "Hkv": hkv, "hd": hd, "pass": name,
                              "median_ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}), flush=True)


if __name__ == "__main__":
    main()
