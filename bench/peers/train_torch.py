#!/usr/bin/env python3
"""PyTorch peer of bench_train_step: one training step of xmoe's `moe-1b` model, end to end.

The architecture is xmoe's preset exactly (src/xmoe/config/presets.cpp, docs/model.md):
decoder-only, pre-norm RMSNorm (eps 1e-5), causal attention with rotate-half RoPE (theta 1e4)
and no biases, every block an MoE FFN (first_dense_layers = 0) of 64 routed SwiGLU experts
f = 256, top-6 of a softmax over all experts (DeepSeek gate: weights not renormalised) plus
one always-on shared SwiGLU of width 2·256, GShard load-balance aux loss (weight 0.01), final
RMSNorm, untied LM head; N(0, 0.02²) init, residual-writing projections N(0, (0.02/√(2L))²).
The parameter counts are printed with the same formula as xmoe's count_parameters() (check
them against `xmoe config show --preset moe-1b`: 965.77M total, 235.96M active).

What a competent PyTorch user runs: f32 master weights, bf16 autocast, the routed experts with
torch._grouped_mm (bench/peers/moe_layer_torch.py, weights cast to bf16 per forward), SDPA
attention (F.scaled_dot_product_attention(is_causal=True): flash on the H200), fused AdamW
(lr 1e-3, betas 0.9/0.95, wd 0.1 except norms), gradient clipping at 1.0. Synthetic uniform
random tokens, micro-batch 8 x 2048. The step is timed on the host around zero_grad ->
forward -> backward -> clip -> step -> synchronize, as bench_train_step does.

Output: JSON lines, "train_step_peer_config" (parameter counts), one "train_step_peer" per
timed step, then "train_step_peer_summary": median step ms, tokens/s, TFLOP/s and MFU by the
PaLM count of src/xmoe/train/flops.h (6·N_active + 12·L·d·S FLOPs per token, against 989e12),
peak memory (torch.cuda.max_memory_allocated over the timed steps) and reserved memory; with
--moe xmoe also xmoe_peak_bytes, the peak of xmoe's own allocator (its MoE activations).

  python3 bench/peers/train_torch.py [--preset moe-1b|tiny] [--steps 8] [--warmup 3]
      [--batch B] [--seq S] [--layers L] [--device cuda|cpu] [--compile]
  python3 bench/peers/train_torch.py --preset tiny --device cpu --batch 2 --seq 64 --steps 2

--moe xmoe swaps each MoE layer for xmoe's (xmoe.torch.MoE, the same gate, experts and shared
experts; `pip install --no-build-isolation ./python -C cmake.define.XMOE_CUDA=ON` first): the
PyTorch step before and after (issue 36), with "moe" in every JSON line.

--compile tries torch.compile on the model; a failure (at compile time or in the first steps)
is reported as a "train_step_peer_compile" JSON line and the run goes on in eager mode.

Training on real tokens against xmoe (issue 37; bench/real_data/run.sh runs both):

  python3 bench/peers/train_torch.py --preset moe-1b --data data/kjv --init runs/kjv/step-0 \
      --train-steps 600 --lr 1e-3 --min-lr 1e-4 --warmup-steps 50 --eval-every 50 \
      --eval-batches 8 --metrics runs/kjv-torch.jsonl

--data DIR trains on DIR/train.bin (a folder `xmoe prepare` wrote) with the windows xmoe's loader
draws for the same --seed (src/xmoe/data/data_loader.h: window g of global batch s starts at
Philox(seed, stream "data.train", g) mod (N - T)), one process, batch = the global batch; it
evaluates on DIR/val.bin's fixed windows [k*T, k*T + T + 1) as xmoe does. --init CKPT starts
from an xmoe checkpoint's weights (`xmoe train --stop-after 0` writes step-0, the initial
weights). The learning rate follows xmoe's schedule (linear warm-up, cosine to --min-lr over
--train-steps). metrics.jsonl lines as xmoe writes them: {"step", "loss"} per step (the
cross-entropy, without the aux loss), {"step", "val_loss"} per evaluation.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_layer_torch import init_grouped_mm, moe_grouped_mm, swiglu  # noqa: E402

PEAK_FLOPS = 989e12  # src/xmoe/train/flops.h: kPeakFlopsPerDevice (H100/H200 SXM dense bf16)

# xmoe's presets (src/xmoe/config/presets.cpp); "tiny" is the ModelConfig/TrainConfig defaults.
PRESETS = {
    "moe-1b": dict(vocab=32768, d=1024, layers=16, heads=16, kv_heads=16, dense_hidden=4096,
                   first_dense=0, E=64, f=256, k=6, shared=2, renormalize=False,
                   aux_weight=0.01, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02,
                   tie=False, batch=8, seq=2048, lr=1e-3),
    "tiny": dict(vocab=256, d=256, layers=4, heads=4, kv_heads=4, dense_hidden=512,
                 first_dense=1, E=16, f=128, k=2, shared=1, renormalize=True,
                 aux_weight=0.01, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02,
                 tie=False, batch=16, seq=128, lr=3e-3),
}
WEIGHT_DECAY, BETAS, ADAM_EPS, GRAD_CLIP = 0.1, (0.9, 0.95), 1e-8, 1.0


# ---- xmoe's data order and weights ------------------------------------------------------------

MASK32 = 0xFFFFFFFF


def stream_id(name):
    """src/xmoe/core/rng.cpp: FNV-1a 64 of the name."""
    h = 1469598103934665603
    for ch in name.encode():
        h = ((h ^ ch) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def philox_block(seed, stream, counter):
    """src/xmoe/core/rng.cpp: Philox4x32-10 of (counter, stream) keyed by seed -> 4 words."""
    c = [counter & MASK32, (counter >> 32) & MASK32, stream & MASK32, (stream >> 32) & MASK32]
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & MASK32, (p0 >> 32) ^ c[3] ^ k1, p0 & MASK32]
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return c


DATA_STREAM = stream_id("data.train")


def window_start(seed, g, n_tokens, seq):
    """xmoe's DataLoader::window_start for one token file."""
    b = philox_block(seed, DATA_STREAM, g)
    return ((b[0] << 32) | b[1]) % (n_tokens - seq)


def open_tokens(data_dir, name):
    """DIR/<name> as a numpy memmap of meta.json's dtype."""
    import numpy as np
    meta = json.load(open(os.path.join(data_dir, "meta.json")))
    dtype = {"uint16": np.uint16, "uint32": np.uint32}[meta["dtype"]]
    return np.memmap(os.path.join(data_dir, name), dtype=dtype, mode="r"), meta


def windows(tokens, starts, seq, device):
    """ids, targets [len(starts), seq] int64 from windows of seq + 1 tokens."""
    import numpy as np
    w = np.stack([np.asarray(tokens[s:s + seq + 1], dtype=np.int64) for s in starts])
    w = torch.from_numpy(w).to(device)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def read_safetensors(path):
    """name -> f32/i64 tensor of a safetensors file (the format is a JSON header + raw bytes)."""
    import numpy as np
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    dtypes = {"F32": np.float32, "I64": np.int64, "BF16": None}
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        if dtypes.get(t["dtype"]) is None:
            raise SystemExit(f"train_torch: {path}: tensor {name} has dtype {t['dtype']}")
        arr = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=dtypes[t["dtype"]]).reshape(t["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out


def load_xmoe_weights(model, ckpt):
    """Copies an xmoe checkpoint's parameters (all rank files) into the model: the names are the
    same but for the routed experts, saved one slice per expert ("...experts.gate_up@e")."""
    tensors = {}
    for f in sorted(os.listdir(ckpt)):
        if f.startswith("model-rank") and f.endswith(".safetensors"):
            tensors.update(read_safetensors(os.path.join(ckpt, f)))
    experts = {}
    for name, t in tensors.items():
        if "@" in name and ".adam_" not in name:
            base, e = name.split("@")
            experts.setdefault(base, {})[int(e)] = t
    used = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # torch: layers.i.ffn.{router,gate_up,down,shared.*} of an MoE block; xmoe: .moe.*
            block = model.layers[int(name.split(".")[1])] if name.startswith("layers.") else None
            key = name
            if block is not None and block.is_moe:
                key = name.replace(".ffn.", ".moe.")
                key = key.replace(".moe.router", ".moe.router.weight")
                if key.endswith(".moe.gate_up") or key.endswith(".moe.down"):
                    key = key.replace(".moe.", ".moe.experts.")
            key = {"embed": "embed.weight", "lm_head": "lm_head.weight"}.get(key, key)
            if key in experts:
                slices = experts[key]
                t = torch.stack([slices[e] for e in range(len(slices))])
            elif key in tensors:
                t = tensors[key]
            else:
                raise SystemExit(f"train_torch: {ckpt} has no tensor {key} (for {name})")
            if tuple(t.shape) != tuple(p.shape):
                raise SystemExit(f"train_torch: {ckpt}: {key} is {list(t.shape)}, the model's "
                                 f"{name} {list(p.shape)}")
            p.copy_(t.to(p.device, p.dtype))
            used.add(key)
    return len(used)


def lr_at(step, peak, min_lr, warmup, total):
    """src/xmoe/optim/schedule.cpp: LrSchedule::at(step), step 0-based."""
    n = max(step, 0) + 1
    if n <= warmup:
        return peak * n / warmup
    p = min(1.0, (n - warmup) / max(1, total - warmup))
    return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def count_parameters(c):
    """xmoe's count_parameters() (src/xmoe/config/presets.cpp), softmax gate: (total, active)."""
    d, V, L = c["d"], c["vocab"], c["layers"]
    kv = c["kv_heads"] * (d // c["heads"])
    embedding = V * d * (1 if c["tie"] else 2)
    norms = 2 * d
    attention = d * d + 2 * d * kv + d * d
    dense_ffn = 3 * d * c["dense_hidden"]
    router = d * c["E"]
    expert = 3 * d * c["f"]
    shared = 3 * d * (c["shared"] * c["f"])
    dense_layers = min(c["first_dense"], L)
    moe_layers = L - dense_layers
    common = embedding + L * (norms + attention) + dense_layers * dense_ffn + d
    total = common + moe_layers * (router + c["E"] * expert + shared)
    active = common + moe_layers * (router + min(c["k"], c["E"]) * expert + shared)
    return total, active


def flops_per_token(c, seq, active):
    """src/xmoe/train/flops.h: 6·N_active + 12·L·d·S."""
    return 6.0 * active + 12.0 * c["layers"] * c["d"] * seq


def normal(shape, std):
    return nn.Parameter(torch.empty(shape).normal_(0.0, std))


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(seq, head_dim, theta):
    """cos, sin [seq, hd/2]: angle s·theta^(-2j/hd) (angles in float64, as xmoe builds them)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x, cos, sin):
    """Rotate-half RoPE on x [B, S, h, hd]: pairs (j, j + hd/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    c = cos[None, : x.shape[1], None, :].to(x.dtype)
    s = sin[None, : x.shape[1], None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class Attention(nn.Module):
    def __init__(self, c, out_std):
        super().__init__()
        d, H, Hkv = c["d"], c["heads"], c["kv_heads"]
        self.H, self.Hkv, self.hd = H, Hkv, d // H
        std = c["init_std"]
        self.wq = normal((d, H * self.hd), std)      # [in, out] like xmoe's "attn.wq"
        self.wk = normal((d, Hkv * self.hd), std)
        self.wv = normal((d, Hkv * self.hd), std)
        self.wo = normal((H * self.hd, d), out_std)

    def forward(self, x, cos, sin):                  # x [B, S, d]
        B, S, _ = x.shape
        q = (x @ self.wq).view(B, S, self.H, self.hd)
        k = (x @ self.wk).view(B, S, self.Hkv, self.hd)
        v = (x @ self.wv).view(B, S, self.Hkv, self.hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, hd]
        if self.Hkv != self.H:                        # GQA: query head h reads kv head h/(H/Hkv)
            k = k.repeat_interleave(self.H // self.Hkv, dim=1)
            v = v.repeat_interleave(self.H // self.Hkv, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.transpose(1, 2).reshape(B, S, self.H * self.hd) @ self.wo


class DenseFFN(nn.Module):
    def __init__(self, d, hidden, std, out_std):
        super().__init__()
        self.gate_up = normal((d, 2 * hidden), std)
        self.down = normal((hidden, d), out_std)

    def forward(self, x):
        return swiglu(x @ self.gate_up) @ self.down


class MoE(nn.Module):
    """Router f32 [d, E], routed experts gate_up [E, d, 2f] / down [E, f, d] via _grouped_mm,
    shared experts as one dense SwiGLU of width shared·f."""

    def __init__(self, c, std, out_std):
        super().__init__()
        d, E, f = c["d"], c["E"], c["f"]
        self.k, self.renormalize, self.aux_weight = c["k"], c["renormalize"], c["aux_weight"]
        self.router = normal((d, E), std)
        self.gate_up = normal((E, d, 2 * f), std)
        self.down = normal((E, f, d), out_std)
        self.shared = DenseFFN(d, c["shared"] * f, std, out_std) if c["shared"] > 0 else None

    def forward(self, x):                            # x [B, S, d] -> y, aux
        B, S, d = x.shape
        xt = x.reshape(B * S, d).to(torch.bfloat16)  # the experts' input in the compute dtype
        with torch.autocast(device_type=x.device.type, enabled=False):
            y, aux, _ = moe_grouped_mm(xt, self.router, self.gate_up, self.down, self.k,
                                       renormalize=self.renormalize, aux_weight=self.aux_weight)
        y = y.view(B, S, d)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, aux


class XmoeMoE(nn.Module):
    """The same layer as MoE, run by xmoe (xmoe.torch.MoE: router, routed and shared experts in
    one op; bf16 activations on CUDA, f32 master weights)."""

    def __init__(self, c, device):
        super().__init__()
        from xmoe.torch import MoE as XMoE  # the python/ package, installed with pip
        self.moe = XMoE(c["d"], c["E"], c["k"], c["f"], gate="softmax_topk",
                        shared_experts=c["shared"], renormalize=c["renormalize"],
                        aux_loss_weight=c["aux_weight"], init_std=c["init_std"], device=device)

    def forward(self, x):                            # x [B, S, d] -> y, aux
        dt = torch.bfloat16 if x.is_cuda else torch.float32
        out = self.moe(x.to(dt))
        return out.y, out.aux_loss


class Block(nn.Module):
    def __init__(self, c, index, out_std):
        super().__init__()
        self.attn_norm = RMSNorm(c["d"], c["norm_eps"])
        self.attn = Attention(c, out_std)
        self.ffn_norm = RMSNorm(c["d"], c["norm_eps"])
        if index < c["first_dense"]:
            self.ffn = DenseFFN(c["d"], c["dense_hidden"], c["init_std"], out_std)
            self.is_moe = False
        else:
            self.ffn = (XmoeMoE(c, torch.get_default_device()) if c.get("moe") == "xmoe"
                        else MoE(c, c["init_std"], out_std))
            self.is_moe = True

    def forward(self, x, cos, sin):
        h = x + self.attn(self.attn_norm(x), cos, sin)   # f32 residual stream
        if self.is_moe:
            y, aux = self.ffn(self.ffn_norm(h))
        else:
            y, aux = self.ffn(self.ffn_norm(h)), None
        return h + y, aux


class Transformer(nn.Module):
    def __init__(self, c, seq):
        super().__init__()
        self.c = c
        std, L = c["init_std"], c["layers"]
        out_std = std / math.sqrt(2.0 * L)
        self.embed = normal((c["vocab"], c["d"]), std)
        self.layers = nn.ModuleList(Block(c, i, out_std) for i in range(L))
        self.final_norm = RMSNorm(c["d"], c["norm_eps"])
        self.lm_head = None if c["tie"] else normal((c["d"], c["vocab"]), std)
        cos, sin = rope_tables(seq, c["d"] // c["heads"], c["rope_theta"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids, targets):                 # ids, targets [B, S] -> ce + aux
        x = F.embedding(ids, self.embed)
        aux_total = x.new_zeros(())
        for block in self.layers:
            x, aux = block(x, self.cos, self.sin)
            if aux is not None:
                aux_total = aux_total + aux
        xf = self.final_norm(x)
        logits = xf @ (self.lm_head if self.lm_head is not None else self.embed.t())
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))
        return ce + aux_total, ce


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="moe-1b")
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch (default: the preset's)")
    ap.add_argument("--seq", type=int, default=None, help="context (default: the preset's)")
    ap.add_argument("--layers", type=int, default=None, help="override num_layers (smoke tests)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="try torch.compile(model)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data", help="train on this prepared folder's tokens, as xmoe draws them")
    ap.add_argument("--init", help="initial weights: an xmoe checkpoint folder (step-N)")
    ap.add_argument("--train-steps", type=int, default=100, help="--data: optimizer steps")
    ap.add_argument("--lr", type=float, default=None, help="--data: peak lr (default preset's)")
    ap.add_argument("--min-lr", type=float, default=None, help="--data: lr at the end (lr / 10)")
    ap.add_argument("--warmup-steps", type=int, default=0, help="--data: linear warm-up steps")
    ap.add_argument("--eval-every", type=int, default=0, help="--data: steps between evals")
    ap.add_argument("--eval-batches", type=int, default=8, help="--data: batches per eval")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the preset's)")
    ap.add_argument("--metrics", help="--data: write xmoe-style metrics.jsonl lines here")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer "
                    "(default: the preset's; bench/largest_model.sh scales it)")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--memory-gib", type=float, default=None, help="cap torch's allocator at "
                    "this many GiB (an H100's 80 on an H200); out of memory is reported as a "
                    "JSON line with status out_of_memory, exit 0")
    ap.add_argument("--moe", choices=("grouped_mm", "xmoe"), default="grouped_mm",
                    help="the MoE layers: torch._grouped_mm (the peer) or xmoe's (xmoe.torch)")
    args = ap.parse_args()

    c = dict(PRESETS[args.preset])
    c["moe"] = args.moe
    if args.layers is not None:
        c["layers"] = args.layers
    if args.vocab is not None:
        c["vocab"] = args.vocab
    if args.experts is not None:
        c["E"] = args.experts
    batch, seq = args.batch or c["batch"], args.seq or c["seq"]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    backend = init_grouped_mm(device)
    torch.manual_seed(args.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # only the f32 router/loss matmuls
        if args.memory_gib is not None:
            total_bytes = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, args.memory_gib * 2**30 / total_bytes), device)
    try:
        run(args, c, batch, seq, device, cuda, backend)
    except torch.OutOfMemoryError as e:
        # Like xmoe's benchmarks: a model that does not fit is a result, not a failure.
        line = {"bench": "train_step_peer_summary", "preset": args.preset, "moe": args.moe,
                "device": str(device), "status": "out_of_memory", "experts": c["E"],
                "batch_size": batch, "seq_len": seq, "params_total": count_parameters(c)[0],
                "params_active": count_parameters(c)[1], "error": str(e).split("\n")[0][:300]}
        if cuda:
            free, total_bytes = torch.cuda.mem_get_info(device)
            line.update({"bytes_free": free, "bytes_total": total_bytes,
                         "memory_gib": args.memory_gib,
                         "peak_bytes": torch.cuda.max_memory_allocated(device)})
        print(json.dumps(line), flush=True)


def run(args, c, batch, seq, device, cuda, backend):
    """Builds the model and optimizer, then times steps (or trains on --data)."""
    with torch.device(device):  # initialise on the device (fast; the values differ from xmoe's)
        model = Transformer(c, seq)
    if args.init:
        n = load_xmoe_weights(model, args.init)
        print(json.dumps({"bench": "train_peer_init", "checkpoint": args.init, "tensors": n}),
              flush=True)
    total_expected, active_expected = count_parameters(c)
    total = sum(p.numel() for p in model.parameters())
    moe_layers = sum(1 for b in model.layers if b.is_moe)
    active = total - moe_layers * (c["E"] - c["k"]) * 3 * c["d"] * c["f"]
    fpt = flops_per_token(c, seq, active)
    print(json.dumps({"bench": "train_step_peer_config", "preset": args.preset, "moe": args.moe,
                      "layers": c["layers"], "moe_layers": moe_layers, "batch_size": batch,
                      "seq_len": seq, "params_total": total, "params_active": active,
                      "params_match_xmoe_formula": total == total_expected
                      and active == active_expected, "flops_per_token": fpt,
                      "torch": torch.__version__, "grouped_mm_backend": backend}), flush=True)
    if total != total_expected or active != active_expected:
        print(f"train_torch: parameter count {total}/{active} != xmoe's formula "
              f"{total_expected}/{active_expected}", file=sys.stderr)
        sys.exit(1)

    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY},
              {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=c["lr"], betas=BETAS, eps=ADAM_EPS,
                            **({"fused": True} if cuda else {"foreach": True}))
    params = [p for g in groups for p in g["params"]]

    step_fn = model
    compiled = False
    if args.compile:
        try:
            step_fn = torch.compile(model)
            compiled = True
        except Exception as e:  # noqa: BLE001 - report any failure, run eager
            print(json.dumps({"bench": "train_step_peer_compile", "ok": False, "stage": "compile",
                              "error": f"{type(e).__name__}: {e}"[:1000]}), flush=True)

    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if args.data:
        train_on_tokens(args, c, model, opt, params, autocast, batch, seq, device)
        return
    gen = torch.Generator(device=device).manual_seed(args.seed)
    times, opt_times = [], []
    step = 0
    while step < args.warmup + args.steps:
        ids = torch.randint(0, c["vocab"], (batch, seq), device=device, generator=gen)
        targets = torch.randint(0, c["vocab"], (batch, seq), device=device, generator=gen)
        if cuda:
            torch.cuda.synchronize(device)
            if step == args.warmup:
                torch.cuda.reset_peak_memory_stats(device)
                if args.moe == "xmoe":
                    from xmoe.torch import reset_peak_memory
                    reset_peak_memory(device)
        t0 = time.perf_counter()
        try:
            opt.zero_grad(set_to_none=True)
            for micro in range(args.grad_accum):  # the same tokens: the same work per micro
                with autocast:
                    loss, ce = step_fn(ids, targets)
                (loss / args.grad_accum).backward()
            if cuda:  # the update's own time (clip + AdamW), as bench_train_step reports it
                torch.cuda.synchronize(device)
            t_opt = time.perf_counter()
            norm = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP, foreach=True)
            opt.step()
            if cuda:
                torch.cuda.synchronize(device)
            opt_ms = (time.perf_counter() - t_opt) * 1e3
        except Exception as e:  # noqa: BLE001
            if not compiled:
                raise
            print(json.dumps({"bench": "train_step_peer_compile", "ok": False, "stage": "run",
                              "step": step, "error": f"{type(e).__name__}: {e}"[:1000],
                              "trace": traceback.format_exc()[-1500:]}), flush=True)
            step_fn, compiled = model, False
            continue  # this step again, eager
        ms = (time.perf_counter() - t0) * 1e3
        step += 1
        if step == 1 and compiled:
            print(json.dumps({"bench": "train_step_peer_compile", "ok": True,
                              "first_step_ms": round(ms, 1)}), flush=True)
        if step <= args.warmup:
            continue
        times.append(ms)
        opt_times.append(opt_ms)
        tps = batch * seq * args.grad_accum / (ms / 1e3)
        line = {"bench": "train_step_peer", "preset": args.preset, "moe": args.moe,
                "device": str(device),
                "step": step - args.warmup, "loss": round(loss.item(), 5),
                "ce": round(ce.item(), 5), "grad_norm": round(norm.item(), 5),
                "step_ms": round(ms, 2), "tokens_per_s": round(tps)}
        if cuda:
            line["mfu"] = round(fpt * tps / PEAK_FLOPS, 5)
        print(json.dumps(line), flush=True)

    median = statistics.median(times)
    tps = batch * seq * args.grad_accum / (median / 1e3)
    summary = {"bench": "train_step_peer_summary", "preset": args.preset, "moe": args.moe,
               "device": str(device),
               "dtype": "bf16-autocast", "compiled": compiled, "batch_size": batch,
               "grad_accum": args.grad_accum, "experts": c["E"], "status": "ok",
               "seq_len": seq, "tokens_per_step": batch * seq * args.grad_accum, "params_total": total,
               "params_active": active, "flops_per_token": fpt, "steps": args.steps,
               "median_step_ms": round(median, 2), "tokens_per_s": round(tps),
               "median_optimizer_ms": round(statistics.median(opt_times), 2),
               "tflops_per_s": round(fpt * tps / 1e12, 2), "torch": torch.__version__}
    if cuda:
        summary.update({"mfu": round(fpt * tps / PEAK_FLOPS, 5), "peak_flops": PEAK_FLOPS,
                        "peak_bytes": torch.cuda.max_memory_allocated(device),
                        "reserved_bytes": torch.cuda.max_memory_reserved(device)})
        if args.moe == "xmoe":  # the MoE layers' activations live in xmoe's allocator
            from xmoe.torch import memory_stats
            summary["xmoe_peak_bytes"] = memory_stats(device)["peak_bytes"]
    print(json.dumps(summary), flush=True)


def train_on_tokens(args, c, model, opt, params, autocast, batch, seq, device):
    """--data: xmoe's training loop on xmoe's windows: per step the global batch's windows,
    CE + aux loss, clip, AdamW at xmoe's lr schedule; validation on val.bin's fixed windows."""
    train, meta = open_tokens(args.data, "train.bin")
    val, _ = open_tokens(args.data, "val.bin")
    if meta["vocab_size"] > c["vocab"]:
        raise SystemExit(f"train_torch: {args.data} has vocabulary {meta['vocab_size']}, the "
                         f"model {c['vocab']} (--vocab)")
    peak = args.lr if args.lr is not None else c["lr"]
    min_lr = args.min_lr if args.min_lr is not None else peak / 10
    out = open(args.metrics, "w") if args.metrics else None

    def log(line):
        print(json.dumps(line), flush=True)
        if out:
            out.write(json.dumps(line) + "\n")
            out.flush()

    def evaluate():
        n_windows = (len(val) - 1) // seq
        n = min(args.eval_batches, max(1, n_windows // batch))
        total = 0.0
        with torch.no_grad(), autocast:
            for i in range(n):
                starts = [((i * batch + j) % n_windows) * seq for j in range(batch)]
                ids, targets = windows(val, starts, seq, device)
                total += model(ids, targets)[1].item()
        return total / n

    for step in range(1, args.train_steps + 1):
        g0 = (step - 1) * batch  # global window index of this step's first window
        starts = [window_start(args.seed, g0 + j, len(train), seq) for j in range(batch)]
        ids, targets = windows(train, starts, seq, device)
        lr = lr_at(step - 1, peak, min_lr, args.warmup_steps, args.train_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss, ce = model(ids, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP, foreach=True)
        opt.step()
        log({"step": step, "loss": ce.item(), "aux_loss": (loss - ce).item(), "lr": lr,
             "grad_norm": norm.item()})
        if args.eval_every > 0 and (step % args.eval_every == 0 or step == args.train_steps):
            log({"step": step, "val_loss": evaluate()})


if __name__ == "__main__":
    main()
