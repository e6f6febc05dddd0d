"""xmoe.torch.MoE inside models: torch.compile traces through the custom ops, and
replace_moe_layer keeps a Hugging Face Mixtral's, Qwen2-MoE's, DeepSeek-V2's and DeepSeek-V3's
logits."""
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
    settings = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = config_cls(**{**settings, **extra})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # HF initialises some router weights to zero: random ones route
        for name, p in model.named_parameters():
            if "mlp" in name:
                p.normal_(0, 0.3)
        for name, b in model.named_buffers():  # DeepSeek-V3's e_score_correction_bias
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
    return model


def _deepseek(version, **extra):
    """A tiny DeepSeek-V2/V3 (MLA attention) whose first layer is dense, the other two MoE."""
    mla = dict(num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1,
               kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
               v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    if version == 3:
        return _tiny(transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                     **{**mla, **dict(n_group=4, topk_group=2, n_shared_experts=1,
                                      routed_scaling_factor=2.5), **extra})
    return _tiny(transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                 **{**mla, **dict(n_shared_experts=2, topk_method="greedy"), **extra})


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3"])
def test_replace_moe_layer_keeps_the_logits(arch):
    if arch.startswith("deepseek"):
        model = _deepseek(int(arch[-1]))
    elif arch == "mixtral":
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


@pytest.mark.parametrize("version,extra,match", [
    (3, dict(norm_topk_prob=False), "norm_topk_prob = False"),
    (2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
     "topk_method = 'group_limited_greedy'"),
    (2, dict(routed_scaling_factor=16.0), "routed_scaling_factor = 16.0"),
    (2, dict(mlp_bias=True), "biases"),
    (3, dict(hidden_act="gelu"), "SwiGLU"),
])
def test_replace_moe_layer_refuses_deepseek_features_xmoe_lacks(version, extra, match):
    with pytest.raises(ValueError, match=match):
        replace_moe_layer(_deepseek(version, **extra))


def test_replace_moe_layer_carries_the_routing_bias_and_options():
    model = _deepseek(3)
    hf_bias = model.model.layers[1].mlp.gate.e_score_correction_bias.clone()
    replace_moe_layer(model, bias_update_rate=0.5)
    moe = model.model.layers[1].mlp.moe
    assert moe.gate == "sigmoid" and torch.equal(moe.routing_bias, hf_bias)
    assert isinstance(model.model.layers[0].mlp, transformers.models.deepseek_v3.
                      modeling_deepseek_v3.DeepseekV3MLP)  # the dense layer stays
    model(torch.randint(0, 64, (1, 8))).logits.sum().backward()
    moe.update_routing_bias()  # bias_update_rate = 0.5 reached the layer: steps of 0 or 0.5
    step = (moe.routing_bias - hf_bias).abs()
    assert ((step == 0.5) | (step == 0)).all() and (step == 0.5).sum() >= 2


def test_replace_moe_layer_refuses_a_model_without_moe_blocks():
    with pytest.raises(ValueError, match="no Mixtral, Qwen2-MoE or DeepSeek"):
        replace_moe_layer(nn.Sequential(nn.Linear(4, 4)))
