"""xmoe.torch.MoE against plain-PyTorch references of the same layer (CPU, f32).

The softmax_topk reference is bench/peers/moe_layer_torch.py's (the peer of the benchmarks);
the other gates are written out here from docs/moe.md. Forward, the aux loss and every gradient
(input and parameters, through an aux-loss weight of 3 so its upstream gradient is checked)
must agree within f32 round-off.
"""
import gc
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from xmoe.torch import MoE, memory_stats, reset_peak_memory

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("moe_layer_torch",
                                               REPO / "bench/peers/moe_layer_torch.py")
peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peers)

B, S, D, F_, E, K = 2, 16, 32, 16, 8, 2
TOL = 2e-5  # f32: sums of a few hundred products in another order


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def balance_losses(probs, topi, seq_len, lb_w, seq_w):
    """GShard load balance E * sum_e f_e P_e, and its per-sequence mean (docs/moe.md)."""
    T, E = probs.shape
    k = topi.shape[1]
    counts = torch.zeros(T, E).scatter_add_(1, topi, torch.ones_like(topi, dtype=torch.float32))
    lb = E * (counts.sum(0) / (T * k) * probs.mean(0)).sum()
    f_s = counts.view(-1, seq_len, E).sum(1) / (seq_len * k)
    p_s = probs.view(-1, seq_len, E).mean(1)
    seq = (E * (f_s * p_s).sum(-1)).mean()
    return lb_w * lb + seq_w * seq


def z_loss(logits, w):
    return w * (torch.logsumexp(logits, -1) ** 2).mean()


def route_softmax(p, x, k, before, renorm, seq_len, lb_w=0.01, seq_w=0.0, z_w=0.0):
    logits = x @ p["router_weight"]
    probs = logits.softmax(-1)
    if before:
        topw, topi = probs.topk(k, -1)
        if renorm:
            topw = topw / topw.sum(-1, keepdim=True)
    else:  # Mixtral: top-k of the logits, softmax over the k
        topl, topi = logits.topk(k, -1)
        topw = topl.softmax(-1)
    return topw, topi, balance_losses(probs, topi, seq_len, lb_w, seq_w) + z_loss(logits, z_w)


def route_sigmoid(p, x, k, groups, topk_groups, scaling, seq_len, lb_w=0.01):
    logits = x @ p["router_weight"]
    scores = logits.sigmoid()
    T, E = scores.shape
    g = scores.detach().view(T, groups, E // groups)
    group_score = g.topk(min(2, E // groups), -1).values.sum(-1)        # [T, G]
    keep = torch.zeros(T, groups, dtype=torch.bool).scatter_(
        1, group_score.topk(topk_groups, -1).indices, True)
    masked = scores.detach().masked_fill(~keep.repeat_interleave(E // groups, 1), -math.inf)
    topi = masked.topk(k, -1).indices
    topw = scores.gather(1, topi)
    topw = topw / topw.sum(-1, keepdim=True) * scaling
    probs = scores / scores.sum(-1, keepdim=True)
    return topw, topi, balance_losses(probs, topi, seq_len, lb_w, 0.0)


def route_xmoe(p, x, k, seq_len, lb_w=0.01):
    z = F.normalize(x @ p["router_weight"], dim=-1)
    e = F.normalize(p["router_expert_embeddings"], dim=0)
    logits = (z @ e) / p["router_temperature"].clamp_min(0.01)
    probs = logits.softmax(-1)
    topw, topi = probs.topk(k, -1)
    topw = topw / topw.sum(-1, keepdim=True)
    return topw, topi, balance_losses(probs, topi, seq_len, lb_w, 0.0)


def experts(x, topw, topi, w1, w2):
    """The routed SwiGLU experts, one loop per expert (as the peers' moe_reference)."""
    y = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, slot = (topi == e).nonzero(as_tuple=True)
        o = peers.swiglu(x[tok] @ w1[e]) @ w2[e]
        y = y.index_add(0, tok, o * topw[tok, slot].unsqueeze(1))
    return y


def shared(x, p):
    return peers.swiglu(x @ p["shared_gate_up"]) @ p["shared_down"] if "shared_gate_up" in p else 0


CASES = {
    # name: (MoE kwargs, reference(x [T, d], params) -> (y, aux))
    "softmax_topk": (dict(gate="softmax_topk"), lambda x, p: peers.moe_reference(
        x, p["router_weight"], p["experts_gate_up"], p["experts_down"], K)[:2]),
    "softmax_topk_shared_seq_z": (
        dict(gate="softmax_topk", shared_experts=2, seq_aux_loss_weight=0.02, z_loss_weight=1e-3),
        lambda x, p: _routed(x, p, route_softmax(p, x, K, True, True, S, 0.01, 0.02, 1e-3))),
    "softmax_topk_mixtral_order": (
        dict(gate="softmax_topk", softmax_before_topk=False),
        lambda x, p: _routed(x, p, route_softmax(p, x, K, False, True, S))),
    "switch": (dict(gate="switch", top_k=1),
               lambda x, p: _routed(x, p, route_softmax(p, x, 1, True, False, S))),
    "sigmoid_grouped": (
        dict(gate="sigmoid", num_groups=4, topk_groups=2, routed_scaling=2.5, shared_experts=1),
        lambda x, p: _routed(x, p, route_sigmoid(p, x, K, 4, 2, 2.5, S))),
    "xmoe": (dict(gate="xmoe", router_dim=8, router_temperature=0.5),
             lambda x, p: _routed(x, p, route_xmoe(p, x, K, S))),
    "padded_no_drop": (dict(gate="softmax_topk", impl="padded", capacity_factor=E / K),
                       lambda x, p: peers.moe_reference(
                           x, p["router_weight"], p["experts_gate_up"], p["experts_down"], K)[:2]),
}


def _routed(x, p, routing):
    topw, topi, aux = routing
    return experts(x, topw, topi, p["experts_gate_up"], p["experts_down"]) + shared(x, p), aux


def run_both(kwargs, reference, seed=7):
    kw = {"top_k": K, **kwargs}
    layer = MoE(D, E, kw.pop("top_k"), F_, seed=seed, init_std=0.2, **kw)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, D, generator=gen, requires_grad=True)
    dy = torch.randn(B, S, D, generator=gen)
    out = layer(x)
    (out.y * dy).sum().add(3.0 * out.aux_loss).backward()

    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    xr = x.detach().clone().requires_grad_(True)
    y_ref, aux_ref = reference(xr.view(-1, D), params)
    (y_ref.view(B, S, D) * dy).sum().add(3.0 * aux_ref).backward()
    return layer, x, out, xr, y_ref.view(B, S, D), aux_ref, params


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_every_gradient_match_the_reference(case):
    kwargs, reference = CASES[case]
    layer, x, out, xr, y_ref, aux_ref, params = run_both(kwargs, reference)
    assert rel_err(out.y.detach(), y_ref.detach()) < TOL
    assert abs(out.aux_loss.item() - aux_ref.item()) <= 1e-6 * max(1.0, abs(aux_ref.item()))
    assert rel_err(x.grad, xr.grad) < TOL, "dx"
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        assert rel_err(p.grad, params[name].grad) < TOL, name
    assert int(out.tokens_per_expert.sum()) == B * S * layer.top_k
    assert int(out.dropped) == 0


def test_padded_drops_like_the_peer():
    """impl="padded" at capacity factor 1: the pairs beyond an expert's capacity are dropped
    first come, first served, as bench/peers' padded layer does; what remains must agree."""
    layer, x, out, xr, y_ref, aux_ref, params = run_both(
        dict(gate="softmax_topk", impl="padded", capacity_factor=1.0),
        lambda x, p: peers.moe_padded(x, p["router_weight"], p["experts_gate_up"],
                                      p["experts_down"], K, capacity_factor=1.0)[:2])
    _, _, dropped = peers.moe_padded(xr.detach().view(-1, D), params["router_weight"].detach(),
                                     params["experts_gate_up"].detach(),
                                     params["experts_down"].detach(), K, capacity_factor=1.0)
    assert int(out.dropped) == int(dropped) > 0
    assert rel_err(out.y.detach(), y_ref.detach()) < TOL
    assert rel_err(x.grad, xr.grad) < TOL
    for name, p in layer.named_parameters():
        assert rel_err(p.grad, params[name].grad) < TOL, name


def test_parameters_are_viewed_not_copied():
    """A change to a torch parameter in place reaches xmoe's next forward (no stale copy)."""
    layer = MoE(D, E, K, F_, init_std=0.2)
    x = torch.randn(4, D)
    with torch.no_grad():
        before = layer(x).y
        layer.experts_down.mul_(2.0)
        after = layer(x).y
    assert rel_err(after, 2.0 * before) < TOL


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="top_k = 9 exceeds moe.num_experts = 8"):
        MoE(D, 8, 9, F_)
    with pytest.raises(ValueError, match="unknown key 'model.moe.no_such_option'"):
        MoE(D, E, K, F_, no_such_option=1)
    with pytest.raises(ValueError, match="nope"):
        MoE(D, E, K, F_, gate="nope")
    with pytest.raises(ValueError, match="model.moe.top_k"):
        MoE(D, E, "two", F_)
    layer = MoE(D, E, K, F_)
    with pytest.raises(ValueError, match=r"expected \[..., 32\]"):
        layer(torch.randn(4, D + 1))


def test_a_second_forward_before_backward_is_refused():
    layer = MoE(D, E, K, F_)
    x = torch.randn(4, D, requires_grad=True)
    first = layer(x)
    layer(x)
    with pytest.raises(ValueError, match="forward again before the backward"):
        first.y.sum().backward()


def test_saved_activations_live_in_xmoe_until_backward():
    """Forward keeps its activations in xmoe's allocator and backward frees them; the initial
    weights are not kept (the layer computes on torch's tensors); nothing grows step by step."""
    layer = MoE(D, E, K, F_, shared_experts=1)
    x = torch.randn(64, D, requires_grad=True)
    gc.collect()  # layers of earlier tests free what they hold now, not during the counts
    base = memory_stats()["live_bytes"]
    reset_peak_memory()
    out = layer(x)
    held = memory_stats()["live_bytes"] - base
    assert held >= 64 * K * 2 * F_ * 4  # at least the experts' h [T k, 2f] in f32
    out.y.sum().backward()
    # What stays is the last expert choice (topk_idx [T, k], for frozen routing) and a few
    # statistics: small, and the same after every step (no growth).
    kept = memory_stats()["live_bytes"] - base
    assert 0 <= kept < held / 10
    assert memory_stats()["peak_bytes"] >= base + held
    for _ in range(2):
        layer(x).y.sum().backward()
        assert memory_stats()["live_bytes"] - base == kept
    with torch.no_grad():
        layer(x)
    assert memory_stats()["live_bytes"] - base <= kept
