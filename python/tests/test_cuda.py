"""xmoe.torch.MoE on CUDA (the GPU machine; skipped elsewhere): the CUDA layer equals the CPU
layer in f32 and within bf16 tolerance in bf16, on torch's default stream and on a side stream,
forward and every gradient; with expert parallelism over an NCCL process group it equals the
one-process CUDA layer of the global batch. Under torchrun the ep test uses torchrun's group
(`torchrun --nproc-per-node N -m pytest python/tests/test_cuda.py -k ep`); under plain pytest
it makes a one-rank NCCL group itself."""
import os
import socket

import pytest
import torch
import torch.distributed as dist

from xmoe import _C
from xmoe.torch import MoE

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and _C.cuda_available()),
                                reason="needs a GPU and xmoe built with XMOE_CUDA=ON")

B, S, D, F_, E, K = 4, 64, 256, 128, 16, 4


def rel_err(a, b):
    return ((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max()).item()


def run(layer, x, dy):
    layer.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    (out.y.float() * dy).sum().add(3.0 * out.aux_loss).backward()
    return out, x.grad, {n: p.grad.detach().clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("gate,extra", [("softmax_topk", {}),
                                        ("sigmoid", dict(num_groups=4, topk_groups=2))])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_matches_cpu(gate, extra, dtype, tol, side_stream):
    torch.manual_seed(0)
    layer = MoE(D, E, K, F_, gate=gate, shared_experts=1, init_std=0.05, **extra)
    x = torch.randn(B, S, D).to(torch.bfloat16).float()  # exact in bf16: the router sees the same x
    dy = torch.randn(B, S, D)
    ref_out, ref_dx, ref_grads = run(layer, x, dy)
    layer.cuda()
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        out, dx, grads = run(layer, x.cuda().to(dtype), dy.cuda())
    torch.cuda.synchronize()
    # f32 on CUDA may use TF32 GEMMs; bf16 rounds the experts' operands and activations.
    assert out.y.dtype == dtype and out.y.is_cuda
    assert rel_err(out.y, ref_out.y) < tol
    assert abs(out.aux_loss.item() - ref_out.aux_loss.item()) < tol * abs(ref_out.aux_loss.item())
    assert rel_err(dx, ref_dx) < tol
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < tol, name


def test_cuda_layer_under_torch_compile():
    layer = MoE(D, E, K, F_, shared_experts=1).cuda()
    x = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = torch.compile(lambda t: layer(t).y.float().square().mean(), fullgraph=True)
    loss = f(x)
    loss.backward()
    assert torch.isfinite(loss) and x.grad is not None and torch.isfinite(x.grad).all()


@pytest.fixture(scope="module")
def nccl_world():
    """torchrun's NCCL world, or a one-rank one made here."""
    made = not dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    if made and "RANK" in os.environ:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    elif made:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    if made:
        dist.destroy_process_group()


@pytest.mark.parametrize("gate,extra", [("softmax_topk", {}),
                                        ("sigmoid", dict(num_groups=4, topk_groups=2))])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_ep_over_nccl_matches_the_one_process_layer(nccl_world, gate, extra, dtype, tol,
                                                         side_stream):
    """Rank r's rows through the ep layer (E/W experts, rows over NCCL) against the one-process
    CUDA layer of every rank's rows; gradients by xmoe's convention (tests/test_ep.py)."""
    W, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)  # the same global batch on every rank
    x = torch.randn(W * B, S, D).to(torch.bfloat16).float().cuda().to(dtype)
    dy = torch.randn(W * B, S, D).cuda()
    rows = slice(r * B, (r + 1) * B)
    ref = MoE(D, E, K, F_, gate=gate, shared_experts=1, init_std=0.05, **extra).cuda()
    layer = MoE(D, E, K, F_, gate=gate, shared_experts=1, init_std=0.05, ep_group=nccl_world,
                **extra).cuda()
    experts = slice(layer.first_expert, layer.first_expert + layer.num_local_experts)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        ref_out, ref_dx, ref_grads = run_with_aux(ref, x, dy, 3.0 * W)
        out, dx, grads = run_with_aux(layer, x[rows], dy[rows], 3.0)
        for name, g in grads.items():
            if not name.startswith("experts_"):
                dist.all_reduce(g)  # ep = world: dense grads summed, each expert on one rank
        layer.update_routing_bias()  # an i64 all_reduce over NCCL
    torch.cuda.synchronize()
    assert rel_err(out.y, ref_out.y[rows]) < tol
    assert abs(out.aux_loss.item() - ref_out.aux_loss.item()) < tol * abs(ref_out.aux_loss.item())
    assert rel_err(dx, ref_dx[rows]) < tol
    for name, g in grads.items():
        want = ref_grads[name][experts] if name.startswith("experts_") else ref_grads[name]
        assert rel_err(g, want) < tol, name


def run_with_aux(layer, x, dy, aux_weight):
    layer.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    (out.y.float() * dy).sum().add(aux_weight * out.aux_loss).backward()
    return out, x.grad, {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
