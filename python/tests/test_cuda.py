"""xmoe.torch.MoE on CUDA (the GPU machine; skipped elsewhere): the CUDA layer equals the CPU
layer in f32 and within bf16 tolerance in bf16, on torch's default stream and on a side stream,
forward and every gradient."""
import pytest
import torch

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
