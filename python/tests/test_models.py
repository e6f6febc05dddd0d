"""xmoe.torch.MoE inside models: torch.compile traces through the custom ops, and
replace_moe_layer keeps a Hugging Face Mixtral's and Qwen2-MoE's logits."""
import pytest
import torch
from torch import nn

from xmoe.torch import HFMoEBlock, MoE, replace_moe_layer


class TinyMoEModel(nn.Module):
    def __init__(self, d=32, E=8, k=2, f=16):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.moe = MoE(d, E, k, f, shared_experts=1, init_std=0.2)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        m = self.moe(self.norm(h))
        return self.out(h + m.y).square().mean() + m.aux_loss


def test_torch_compile_traces_through_the_layer():
    torch.manual_seed(0)
    model = TinyMoEModel()
    x = torch.randn(2, 8, 32)
    eager = model(x)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: no graph break at the layer
    loss = compiled(x)
    loss.backward()
    assert torch.allclose(loss, eager, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], rtol=1e-4, atol=1e-6), n


# transformers 5 fuses each block's experts into 3-d tensors, the layout replace_moe_layer reads.
transformers = pytest.importorskip("transformers", minversion="5.0")


def _tiny(config_cls, model_cls, **extra):
    config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        **extra)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # HF initialises some router weights to zero: random ones route
        for name, p in model.named_parameters():
            if "mlp" in name:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_replace_moe_layer_keeps_the_logits(arch):
    if arch == "mixtral":
        model = _tiny(transformers.MixtralConfig, transformers.MixtralForCausalLM,
                      num_local_experts=8, num_experts_per_tok=2)
    else:
        model = _tiny(transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=False)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    replace_moe_layer(model)
    blocks = [m for m in model.modules() if isinstance(m, HFMoEBlock)]
    assert len(blocks) == 2
    with torch.no_grad():
        after = model(ids).logits
    assert (after - before).abs().max() <= 1e-4 * before.abs().max()
    assert all(int(b.tokens_per_expert.sum()) == 2 * 12 * 2 for b in blocks)


def test_replace_moe_layer_refuses_a_model_without_moe_blocks():
    with pytest.raises(ValueError, match="no Mixtral or Qwen2-MoE"):
        replace_moe_layer(nn.Sequential(nn.Linear(4, 4)))
