"""xmoe's MoE layer as a PyTorch module (docs/pytorch.md).

`MoE` is an nn.Module whose parameters are ordinary torch tensors; its forward and backward are
two torch custom ops (`xmoe::moe_forward`, `xmoe::moe_backward`, with fake kernels, so
torch.compile traces through them) that run xmoe's C++ (or CUDA, on torch's current stream)
layer on those tensors' memory: the weights and the input are viewed, not copied.
With `ep_group` (a torch.distributed process group) the layer holds a slice of the experts and
exchanges token rows over that group (xmoe._process_group). `replace_moe_layer(model)` swaps the
sparse MoE blocks of a Hugging Face Mixtral, Qwen2-MoE or DeepSeek-V2/V3 model for `MoE` layers
carrying their weights.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from xmoe import _C
from xmoe._process_group import ProcessGroupOps

__all__ = ["MoE", "MoEOutput", "replace_moe_layer", "memory_stats", "reset_peak_memory"]

_layers: "weakref.WeakValueDictionary[int, MoE]" = weakref.WeakValueDictionary()
_next_id = itertools.count(1)


@dataclass
class MoEOutput:
    """What `MoE.forward` returns: the output and the routing of this forward."""

    y: Tensor                  #: [..., d_model], the input's shape and dtype
    aux_loss: Tensor           #: 0-d f32 on the input's device: the weighted aux losses (add it to the loss)
    aux_terms: Tensor          #: f64 [3] on the input's device: load_balance, seq_balance, z_loss (unweighted)
    tokens_per_expert: Tensor  #: i64 [E] on the CPU: (token, slot) pairs each expert processed
    dropped: Tensor            #: i64 [] on the CPU: pairs dropped for capacity (impl="padded" only)


def _option_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class MoE(nn.Module):
    """xmoe's MoE layer: gate, padding-free (or padded) routed SwiGLU experts, shared experts.

    Parameters (f32, the names of xmoe's checkpoints without the layer prefix):
    ``router_weight`` [d, E] (xmoe gate: [d, router_dim], plus ``router_expert_embeddings``
    [router_dim, E] and ``router_temperature`` [1]), ``experts_gate_up`` [E, d, 2f] (gate | up),
    ``experts_down`` [E, f, d], and with shared experts ``shared_gate_up`` [d, 2Sf] and
    ``shared_down`` [Sf, d]. They start from xmoe's initialisation (N(0, init_std^2) from seed).

    Any other key of the config's ``model.moe`` table goes in ``options`` (docs/config.md), e.g.
    ``softmax_before_topk=False``, ``renormalize=False``, ``num_groups=4``, ``topk_groups=2``,
    ``routed_scaling=2.5``, ``aux_loss_weight=0.01``, ``z_loss_weight=1e-3``,
    ``capacity_factor=1.25``, ``router_dim=16``, ``expert_grad_dtype="bf16"``. ``device``: where
    the parameters go once initialised (on the CPU).

    Expert parallelism: ``ep_group`` (a torch.distributed process group of ep ranks, gloo on the
    CPU, NCCL on CUDA) makes ep rank r hold experts [r E/ep, (r + 1) E/ep) (``experts_*`` are
    that slice) and move the token rows over the group. ``world_group`` (default: the default
    process group when ``ep_group`` is given, else this process alone) is where the aux-loss
    statistics and the sigmoid gate's load are summed, so the aux loss and the routing bias are
    those of one process of the global batch. Gradients follow xmoe's convention (docs/pytorch.md):
    the dense parameters' are this rank's share (average them over the world, as DDP does); the
    experts' gather every rank's tokens and must be divided by the world size
    (``expert_parameters()``). Every forward, backward and update_routing_bias is collective.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, expert_hidden: int,
                 gate: str = "softmax_topk", shared_experts: int = 0, impl: str = "pft",
                 seed: int = 1234, init_std: float = 0.02, device=None,
                 ep_group: Optional[dist.ProcessGroup] = None,
                 world_group: Optional[dist.ProcessGroup] = None, **options):
        super().__init__()
        settings = {"num_experts": num_experts, "top_k": top_k, "expert_hidden": expert_hidden,
                    "gate": gate, "num_shared_experts": shared_experts, "impl": impl,
                    "dispatch": "local" if ep_group is None else "all_to_all", **options}
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.expert_hidden, self.gate, self.impl = expert_hidden, gate, impl
        if ep_group is not None and world_group is None:
            world_group = dist.group.WORLD
        ep, world = _process_group(ep_group), _process_group(world_group)
        self.ep_size, self.ep_rank = (ep.size(), ep.rank()) if ep is not None else (1, 0)
        self.world_size = world.size() if world is not None else 1
        if num_experts % self.ep_size != 0:
            raise ValueError(f"[xmoe.torch] num_experts = {num_experts} is not divisible by the "
                             f"ep group's {self.ep_size} ranks")
        self.num_local_experts = num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts
        self._ep, self._world = ep, world  # the C++ layer holds them too
        self._layer = _C.MoELayer(d_model, [(k, _option_text(v)) for k, v in settings.items()],
                                  seed, init_std, ep, world)
        self._names: List[str] = []
        self._grad_dtypes: List[torch.dtype] = []
        self._written_whole: List[bool] = []
        for name, shape, grad_dtype, whole in self._layer.parameter_info():
            attr = name.removeprefix("moe.").replace(".", "_")
            self.register_parameter(
                attr, nn.Parameter(torch.empty(shape, dtype=torch.float32, device="cpu")))
            self._names.append(attr)
            self._grad_dtypes.append(getattr(torch, grad_dtype))
            self._written_whole.append(whole)
        self._layer.copy_initial_values([p.data_ptr() for p in self._params()])  # host memory
        # sigmoid gate: the selection bias [E] (a buffer: saved by state_dict, moved by .to(),
        # updated in place by update_routing_bias, not by the optimizer).
        self.routing_bias: Optional[Tensor]
        self.register_buffer("routing_bias", torch.zeros(num_experts, dtype=torch.float32)
                             if self._layer.has_routing_bias() else None)
        if device is not None:
            self.to(device)
        self.layer_id = next(_next_id)
        _layers[self.layer_id] = self

    def _params(self) -> List[Tensor]:
        return [getattr(self, n) for n in self._names]

    def expert_parameters(self) -> List[nn.Parameter]:
        """The routed experts' weights (this rank's slice with an ep group): under data
        parallelism their gradients are summed over the ranks that hold the same experts and
        divided by the world size, not averaged like the others (docs/pytorch.md)."""
        return [getattr(self, n) for n in self._names if n.startswith("experts_")]

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"expert_hidden={self.expert_hidden}, gate={self.gate!r}, impl={self.impl!r}")

    def forward(self, x: Tensor) -> MoEOutput:
        """x [..., d_model] (a 3-d input is [batch, seq, d]: the sequence-level balance loss
        takes its sequences from it) -> MoEOutput."""
        if x.shape[-1] != self.d_model:
            raise ValueError(f"[xmoe.torch] x has shape {tuple(x.shape)}, expected [..., {self.d_model}]")
        seq_len = x.shape[-2] if x.dim() == 3 else x.numel() // self.d_model
        params = self._params()
        need_backward = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in params))
        y, aux, terms, counts, dropped, _pass = torch.ops.xmoe.moe_forward(
            x.reshape(-1, self.d_model), params, self.routing_bias, self.layer_id, seq_len,
            need_backward)
        return MoEOutput(y.view(x.shape), aux, terms, counts, dropped)

    def update_routing_bias(self) -> None:
        """gate="sigmoid": the aux-loss-free balancing step from the load since the last call
        (call after the optimizer step); a no-op for other gates. Collective over the world
        group."""
        b = self.routing_bias
        if b is None:
            return
        if b.dtype != torch.float32 or not b.is_contiguous():
            raise ValueError(f"[xmoe.torch] routing_bias must be contiguous float32, got {b.dtype}")
        self._layer.update_routing_bias(b.data_ptr(), b.device.type, b.device.index or 0,
                                        _stream(b))


def _process_group(group: Optional[dist.ProcessGroup]):
    """xmoe's view of a torch.distributed process group (None: none)."""
    if group is None:
        return None
    ops = ProcessGroupOps(group)
    return _C.ProcessGroup(ops, ops.rank, ops.size, ops.device.type, ops.device.index or 0)


def memory_stats(device="cpu") -> dict:
    """Counters (bytes) of xmoe's allocator for `device`: live_bytes, peak_bytes, total_bytes,
    num_allocs. It holds what the layers save from forward to backward and their temporaries,
    which torch.cuda.memory_allocated() does not count; add the two for a step's memory."""
    d = torch.device(device)
    return _C.memory_stats(d.type, d.index or 0)


def reset_peak_memory(device="cpu") -> None:
    """Sets memory_stats(device)["peak_bytes"] to the live bytes now."""
    d = torch.device(device)
    _C.reset_peak_memory(d.type, d.index or 0)


def _layer(layer_id: int) -> MoE:
    layer = _layers.get(layer_id)
    if layer is None:
        raise RuntimeError(f"[xmoe.torch] no live MoE layer with id {layer_id}")
    return layer


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _check(x: Tensor, params: List[Tensor], routing_bias: Optional[Tensor]) -> None:
    for p in params + ([routing_bias] if routing_bias is not None else []):
        if p.device != x.device or p.dtype != torch.float32 or not p.is_contiguous():
            raise ValueError(
                f"[xmoe.torch] parameters must be contiguous float32 on the input's device "
                f"({x.device}); got {p.dtype} on {p.device}")
    if x.dtype not in (torch.float32, torch.bfloat16) or (x.dtype == torch.bfloat16 and not x.is_cuda):
        raise ValueError(f"[xmoe.torch] x is {x.dtype} on {x.device}: float32, or bfloat16 on CUDA")


@torch.library.custom_op("xmoe::moe_forward", mutates_args=())
def _moe_forward(x: Tensor, params: List[Tensor], routing_bias: Optional[Tensor], layer_id: int,
                 seq_len: int, need_backward: bool
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    x = x.contiguous()
    _check(x, params, routing_bias)
    layer = _layer(layer_id)
    y = torch.empty_like(x)
    # The aux losses stay on the device (load balance, sequence balance, z-loss, weighted sum):
    # reading them would make the host wait for the layer.
    aux = torch.empty(4, dtype=torch.float64, device=x.device)
    s = layer._layer.forward(x.data_ptr(), list(x.shape), str(x.dtype).removeprefix("torch."),
                             x.device.type, x.device.index or 0, _stream(x), seq_len,
                             [p.data_ptr() for p in params], "float32",
                             routing_bias.data_ptr() if routing_bias is not None else 0,
                             aux.data_ptr(), y.data_ptr(), need_backward)
    return (y, aux[3].to(torch.float32), aux[:3].clone(),
            torch.tensor(s.tokens_per_expert, dtype=torch.int64),
            torch.tensor(s.dropped, dtype=torch.int64), torch.tensor(s.pass_id, dtype=torch.int64))


@_moe_forward.register_fake
def _moe_forward_fake(x, params, routing_bias, layer_id, seq_len, need_backward):
    E = _layer(layer_id).num_experts
    return (torch.empty_like(x), x.new_empty((), dtype=torch.float32),
            x.new_empty(3, dtype=torch.float64),
            torch.empty(E, dtype=torch.int64, device="cpu"),
            torch.empty((), dtype=torch.int64, device="cpu"),
            torch.empty((), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("xmoe::moe_backward", mutates_args=())
def _moe_backward(dy: Tensor, d_aux: Tensor, x: Tensor, params: List[Tensor], layer_id: int,
                  pass_id: Tensor) -> Tuple[Tensor, List[Tensor]]:
    dy = dy.to(x.dtype).contiguous()
    layer = _layer(layer_id)
    grads = [torch.empty(p.shape, dtype=dt, device=p.device) if whole else
             torch.zeros(p.shape, dtype=dt, device=p.device)
             for p, dt, whole in zip(params, layer._grad_dtypes, layer._written_whole)]
    dx = torch.empty_like(x)
    # The aux losses' upstream gradient stays where autograd left it (on the GPU): the layer's
    # kernels read it, so backward makes no host wait. Aux-loss-free layers take none.
    aux_grad = None
    if layer._layer.has_aux_losses():
        aux_grad = d_aux.to(device=x.device, dtype=torch.float32).contiguous()
    layer._layer.backward(dy.data_ptr(), list(dy.shape), str(dy.dtype).removeprefix("torch."),
                          x.device.type, x.device.index or 0, _stream(x),
                          aux_grad.data_ptr() if aux_grad is not None else 0,
                          [p.data_ptr() for p in params], "float32",
                          [g.data_ptr() for g in grads], dx.data_ptr(), int(pass_id))
    return dx, grads


@_moe_backward.register_fake
def _moe_backward_fake(dy, d_aux, x, params, layer_id, pass_id):
    layer = _layer(layer_id)
    return (torch.empty_like(x),
            [torch.empty(p.shape, dtype=dt, device=p.device)
             for p, dt in zip(params, layer._grad_dtypes)])


def _setup_context(ctx, inputs, output):
    x, params, _routing_bias, layer_id, _seq_len, _need_backward = inputs
    ctx.layer_id = layer_id
    ctx.save_for_backward(x, output[5], *params)


def _backward(ctx, dy, d_aux, *_stats):
    x, pass_id, *params = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x)
    if d_aux is None:
        d_aux = torch.zeros((), dtype=torch.float32, device=x.device)
    dx, grads = torch.ops.xmoe.moe_backward(dy, d_aux, x, params, ctx.layer_id, pass_id)
    return dx, list(grads), None, None, None, None


torch.library.register_autograd("xmoe::moe_forward", _backward, setup_context=_setup_context)


# ---- Hugging Face models ---------------------------------------------------------------------

class HFMoEBlock(nn.Module):
    """What `replace_moe_layer` puts in place of a Hugging Face sparse MoE block: xmoe's routed
    (and, for DeepSeek, shared) experts, plus the block's own gated shared expert (Qwen2-MoE),
    which stays in PyTorch. Takes and returns hidden states [batch, seq, d] as the block did;
    the last forward's aux loss and routing are in `aux_loss` and `tokens_per_expert`."""

    def __init__(self, moe: MoE, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None):
        super().__init__()
        self.moe = moe
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.aux_loss: Tensor | None = None
        self.tokens_per_expert: Tensor | None = None

    def forward(self, hidden_states: Tensor) -> Tensor:
        out = self.moe(hidden_states)
        self.aux_loss, self.tokens_per_expert = out.aux_loss, out.tokens_per_expert
        y = out.y
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(
                hidden_states)
        return y


_HF_BLOCKS = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "DeepseekV2Moe", "DeepseekV3MoE")


def _refuse(block: nn.Module, what: str) -> ValueError:
    return ValueError(f"[xmoe.torch] replace_moe_layer: {type(block).__name__} {what}")


def _is_silu(act) -> bool:
    return type(act).__name__ in ("SiLU", "SiLUActivation")


def _expert_hidden(block: nn.Module, E: int, d: int) -> int:
    """f of the fused routed experts (transformers 5: `gate_up_proj` [E, 2f, d] (gate | up),
    `down_proj` [E, d, f]), checked to be SwiGLU."""
    ex = block.experts
    if not hasattr(ex, "gate_up_proj"):
        raise _refuse(block, "keeps one module per expert (transformers 4); replace_moe_layer "
                      "reads transformers 5's fused experts")
    f = ex.down_proj.shape[-1]
    if tuple(ex.gate_up_proj.shape) != (E, 2 * f, d) or tuple(ex.down_proj.shape) != (E, d, f):
        raise _refuse(block, f"has unexpected expert shapes {tuple(ex.gate_up_proj.shape)}, "
                      f"{tuple(ex.down_proj.shape)}")
    if not _is_silu(ex.act_fn):
        raise _refuse(block, f"experts use {ex.act_fn}; xmoe's experts are SwiGLU (silu)")
    return f


def _deepseek_gate(block: nn.Module, config) -> dict:
    """xmoe's gate options for a DeepSeek-V2 (softmax, greedy) or V3 (sigmoid, group-limited,
    e_score_correction_bias) router; what has no xmoe equivalent is refused by name."""
    router = block.gate
    E, scaling = router.weight.shape[0], float(router.routed_scaling_factor)
    groups = router.num_group or 1
    topk_groups = router.topk_group or groups
    if type(block).__name__ == "DeepseekV3MoE":
        if not router.norm_topk_prob:
            raise _refuse(block, "has norm_topk_prob = False; xmoe's sigmoid gate always "
                          "normalises the k weights")
        return dict(gate="sigmoid", num_groups=groups, topk_groups=topk_groups,
                    routed_scaling=scaling, aux_loss_weight=0.0)
    method = router.topk_method
    if method == "group_limited_greedy" and topk_groups < groups:
        raise _refuse(block, f"has topk_method = 'group_limited_greedy' (n_group = {groups}, "
                      f"topk_group = {topk_groups}): its group score (the best softmax "
                      "probability) has no xmoe gate; xmoe groups the sigmoid gate only")
    if method not in ("greedy", "group_limited_greedy"):
        raise _refuse(block, f"has topk_method = {method!r}; xmoe reads 'greedy'")
    if scaling != 1.0:
        raise _refuse(block, f"has routed_scaling_factor = {scaling} with the softmax gate; "
                      "xmoe's softmax_topk gate does not scale its weights")
    # DeepSeek-V2's router uses the top-k softmax probabilities as they are (never renormalised).
    return dict(gate="softmax_topk", softmax_before_topk=True, renormalize=False,
                aux_loss_weight=0.0)


def _from_hf_block(block: nn.Module, config, ep_group, options: dict) -> HFMoEBlock:
    """One Hugging Face sparse MoE block (router `gate.weight` [E, d], fused experts) as xmoe's;
    with ep_group this rank's slice of the experts."""
    router, ex = block.gate, block.experts
    E, d = router.weight.shape
    f = _expert_hidden(block, E, d)
    deepseek = type(block).__name__.startswith("Deepseek")
    shared = 0
    if deepseek:
        gate = _deepseek_gate(block, config)
        mlp = block.shared_experts
        shared = mlp.gate_proj.weight.shape[0] // f  # n_shared_experts (0: a width-0 MLP)
        if shared * f != mlp.gate_proj.weight.shape[0]:
            raise _refuse(block, f"has shared experts of width {mlp.gate_proj.weight.shape[0]}, "
                          f"not a multiple of moe_intermediate_size = {f}")
        if any(getattr(m, "bias", None) is not None
               for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            raise _refuse(block, "has shared experts with biases (mlp_bias); xmoe's have none")
        if not _is_silu(mlp.act_fn):
            raise _refuse(block, f"has shared experts using {mlp.act_fn}; xmoe's are SwiGLU")
    else:  # Mixtral renormalises always; Qwen2-MoE as norm_topk_prob says
        gate = dict(gate="softmax_topk", renormalize=getattr(router, "norm_topk_prob", True),
                    aux_loss_weight=getattr(config, "router_aux_loss_coef", 0.01))
    moe = MoE(d, E, router.top_k, f, shared_experts=shared, ep_group=ep_group,
              **{**gate, **options})
    mine = slice(moe.first_expert, moe.first_expert + moe.num_local_experts)
    with torch.no_grad():
        moe.router_weight.copy_(router.weight.t())
        moe.experts_gate_up.copy_(ex.gate_up_proj[mine].transpose(1, 2))
        moe.experts_down.copy_(ex.down_proj[mine].transpose(1, 2))
        if moe.routing_bias is not None and hasattr(router, "e_score_correction_bias"):
            moe.routing_bias.copy_(router.e_score_correction_bias)
        if shared:
            mlp = block.shared_experts
            moe.shared_gate_up.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t())
            moe.shared_down.copy_(mlp.down_proj.weight.t())
    moe.to(router.weight.device)
    if deepseek:
        return HFMoEBlock(moe)
    return HFMoEBlock(moe, getattr(block, "shared_expert", None),
                      getattr(block, "shared_expert_gate", None))


def replace_moe_layer(model: nn.Module, ep_group: Optional[dist.ProcessGroup] = None,
                      **options) -> nn.Module:
    """Swaps every Mixtral / Qwen2-MoE / DeepSeek-V2 / DeepSeek-V3 sparse MoE block of a Hugging
    Face model (transformers 5: fused 3-d expert weights) for xmoe's layer (weights copied once
    into xmoe's f32 layout, HFMoEBlock); returns the model. ep_group: each rank keeps its slice
    of the experts (MoE's ep_group). options: MoE options that override the block's (e.g.
    aux_loss_weight, bias_update_rate, impl). Raises when the model has none, or for a block
    feature xmoe has no equivalent of (named)."""
    config = getattr(model, "config", None)
    found = [(name, m) for name, m in model.named_modules() if type(m).__name__ in _HF_BLOCKS]
    if not found:
        raise ValueError(f"[xmoe.torch] replace_moe_layer: no Mixtral, Qwen2-MoE or DeepSeek-V2/V3 "
                         f"sparse MoE block in {type(model).__name__}")
    for name, block in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, _from_hf_block(block, config, ep_group, options))
    return model
