"""xmoe.torch.MoE with expert parallelism over torch.distributed (gloo, CPU processes) equals the
one-process layer of the global batch: forward, the aux loss, the routing counts, every
gradient and the sigmoid gate's routing bias (docs/pytorch.md, "Expert parallelism").

Each rank runs the one-process layer on the whole batch (the reference) and the ep layer on its
own rows. xmoe's gradient convention: rank r's loss is <y_r, dy_r> + c * aux (aux global), so the
ep gradients are those of the sum of the ranks' losses, sum_r <y_r, dy_r> + W c aux, in the
reference: dx of rank r = dx_ref[rows of r]; dense parameters: summed over the world = ref;
experts: summed over the ranks holding the same experts (the data-parallel replicas) =
ref[this rank's experts].
"""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xmoe.torch import MoE

B_RANK, S, D, F_, E, K = 2, 8, 32, 16, 8, 2  # per rank: 2 sequences of 8 tokens
AUX_W = 3.0                                   # the aux loss's weight in each rank's loss
TOL = 2e-5                                    # f32: the same sums, partly in another order

GATES = {
    "softmax_topk": dict(gate="softmax_topk", seq_aux_loss_weight=0.01, z_loss_weight=1e-3),
    "sigmoid": dict(gate="sigmoid", num_groups=4, topk_groups=2, routed_scaling=2.5,
                    bias_update_rate=0.01, seq_aux_loss_weight=0.01),
}


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(layer, x, dy, aux_weight):
    layer.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    ((out.y * dy).sum() + aux_weight * out.aux_loss).backward()
    return out, x.grad, {n: p.grad.detach().clone() for n, p in layer.named_parameters()}


def check_gate(gate, ep, world, rank):
    """One gate on this rank: the ep layer (ep ranks of each ep group, world ranks in all)
    against the one-process layer of the world's batch."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(world * B_RANK, S, D, generator=g)
    dy = torch.randn(world * B_RANK, S, D, generator=g)
    rows = slice(rank * B_RANK, (rank + 1) * B_RANK)
    ep_groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world, ep)]
    dp_groups = [dist.new_group(list(range(r, world, ep))) for r in range(ep)]
    ep_group, dp_group = ep_groups[rank // ep], dp_groups[rank % ep]
    opts = dict(shared_experts=1, init_std=0.2, **GATES[gate])

    ref = MoE(D, E, K, F_, **opts)
    layer = MoE(D, E, K, F_, ep_group=ep_group, **opts)
    assert (layer.ep_size, layer.ep_rank, layer.world_size) == (ep, rank % ep, world)
    first, n_local = layer.first_expert, E // ep
    experts = slice(first, first + n_local)
    # The same global weights: xmoe initialises each expert from its global name.
    for name, p in layer.named_parameters():
        want = getattr(ref, name)
        want = want[experts] if name.startswith("experts_") else want
        assert torch.equal(p, want), name

    for step in range(2):  # the second forward uses the routing bias the first step moved
        ref_out, ref_dx, ref_grads = run(ref, x, dy, world * AUX_W)
        out, dx, grads = run(layer, x[rows], dy[rows], AUX_W)
        where = f"{gate} ep {ep} of world {world}, rank {rank}, step {step}"
        assert rel_err(out.y, ref_out.y[rows]) < TOL, where
        assert abs(out.aux_loss.item() - ref_out.aux_loss.item()) <= TOL * abs(
            ref_out.aux_loss.item()), where
        assert torch.allclose(out.aux_terms, ref_out.aux_terms, rtol=1e-6, atol=1e-12), where
        counts = out.tokens_per_expert.clone()
        dist.all_reduce(counts)
        assert torch.equal(counts, ref_out.tokens_per_expert), where
        assert rel_err(dx, ref_dx[rows]) < TOL, where
        for name, grad in grads.items():
            if name.startswith("experts_"):
                dist.all_reduce(grad, group=dp_group)  # the replicas of these experts
                want = ref_grads[name][experts]
            else:
                dist.all_reduce(grad)
                want = ref_grads[name]
            assert rel_err(grad, want) < TOL, f"{where}: d{name}"
        assert layer._ep.all_to_all_bytes() > 0  # rows did move through torch.distributed
        ref.update_routing_bias()
        layer.update_routing_bias()
        if gate == "sigmoid":  # moved by the world's load, bit for bit the one process's
            assert layer.routing_bias.abs().sum() > 0
            assert torch.equal(layer.routing_bias, ref.routing_bias), where


def worker(rank, world, ep, port):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        for gate in GATES:
            check_gate(gate, ep, world, rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)])
def test_ep_layer_equals_the_one_process_layer(world, ep):
    """(4, 2): two data-parallel replicas of a 2-rank ep group; aux statistics over all 4."""
    mp.spawn(worker, args=(world, ep, free_port()), nprocs=world, join=True)


def test_ep_errors_name_the_problem():
    mp.spawn(bad_split_worker, args=(free_port(),), nprocs=2, join=True)


def bad_split_worker(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        with pytest.raises(ValueError, match="num_experts = 7 is not divisible by the ep group"):
            MoE(D, 7, K, F_, ep_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_replace_moe_layer_with_an_ep_group():
    pytest.importorskip("transformers", minversion="5.0")
    mp.spawn(replace_worker, args=(free_port(),), nprocs=2, join=True)


def replace_worker(rank, port):
    """A tiny DeepSeek-V3 (sigmoid gate, routing bias, shared experts) swapped with ep 2: each
    rank keeps half the experts, and its logits (its own token ids) are the HF model's."""
    from test_models import _deepseek  # the same tiny model on both ranks (seeded)
    from xmoe.torch import HFMoEBlock, replace_moe_layer
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        model = _deepseek(3)
        ids = torch.randint(0, 64, (2, 2, 12), generator=torch.Generator().manual_seed(1))[rank]
        with torch.no_grad():
            before = model(ids).logits
        replace_moe_layer(model, ep_group=dist.group.WORLD)
        blocks = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
        assert len(blocks) == 2 and all(b.moe.num_local_experts == 4 for b in blocks)
        with torch.no_grad():
            after = model(ids).logits
        assert (after - before).abs().max() <= 1e-4 * before.abs().max()
    finally:
        dist.destroy_process_group()
