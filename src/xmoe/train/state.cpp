#include "xmoe/train/state.h"

#include <cstring>

#include "xmoe/moe/layer.h"
#include "xmoe/ops/ops.h"
#include "xmoe/parallel/tensor_parallel.h"

namespace xmoe::train {

namespace {

const char* const kAdamSuffixes[] = {".adam_m", ".adam_v"};

/// The sigmoid gate's balancing bias is state, not a parameter.
std::string bias_name(const moe::MoELayer& layer) {
  return layer.prefix() + ".router.bias";
}

/// t itself on the CPU, else a host copy: checkpoints are written from host memory (f32).
Tensor on_host(const Tensor& t) {
  return t.is_cpu() ? t : t.to(Device::cpu());
}

/// Splits an expert tensor [n_local, ...] into per-expert slices named name@g.
void add_expert_slices(TensorMap& out, const std::string& name, const Tensor& t,
                       int64_t row_offset) {
  for (int64_t r = 0; r < t.size(0); ++r) {
    Shape shape(t.shape().begin() + 1, t.shape().end());
    out.emplace(expert_slice_name(name, row_offset + r), t.rows(r, r + 1).reshape(shape));
  }
}

/// Stacks name@g for the rows this parameter holds into a tensor of `shape`.
Tensor gather_expert_slices(const TensorMap& in, const std::string& name, const Shape& shape,
                            int64_t row_offset, const std::string& dir) {
  Tensor out = Tensor::empty(shape);
  const int64_t row_elems = shape[0] ? out.numel() / shape[0] : 0;
  for (int64_t r = 0; r < shape[0]; ++r) {
    const std::string slice = expert_slice_name(name, row_offset + r);
    auto it = in.find(slice);
    XMOE_CHECK(it != in.end(),
               "[checkpoint] {} has no tensor '{}' (was it saved with fewer experts?)", dir, slice);
    XMOE_CHECK(it->second.numel() == row_elems && it->second.dtype() == DType::f32,
               "[checkpoint] {}: '{}' is {}, expected {} f32 values", dir, slice, it->second.str(),
               row_elems);
    std::memcpy(out.data<float>() + r * row_elems, it->second.data<float>(),
                static_cast<size_t>(row_elems) * sizeof(float));
  }
  return out;
}

Tensor find_whole(const TensorMap& in, const std::string& name, const Shape& shape,
                  const std::string& dir) {
  auto it = in.find(name);
  XMOE_CHECK(it != in.end(), "[checkpoint] {} has no tensor '{}'", dir, name);
  XMOE_CHECK(it->second.shape() == shape,
             "[checkpoint] {}: '{}' has shape {} but the model expects {}", dir, name,
             shape_str(it->second.shape()), shape_str(shape));
  return it->second;
}

/// The tensor `name` of parameter p's shape: whole, stacked from expert slices, or this rank's
/// tensor-parallel shard of the whole tensor.
Tensor load_for(const TensorMap& in, const Parameter& p, const std::string& name,
                const std::string& dir) {
  if (p.kind == ParamKind::expert)
    return gather_expert_slices(in, name, p.value.shape(), p.shard.offset, dir);
  if (p.kind == ParamKind::tensor_shard)
    return slice_shard(find_whole(in, name, p.shard.whole, dir), p.shard, p.value.shape());
  return find_whole(in, name, p.value.shape(), dir);
}

}  // namespace

std::string expert_slice_name(const std::string& name, int64_t global_expert) {
  return name + "@" + std::to_string(global_expert);
}

TensorMap optimizer_state(const optim::AdamW& opt, const parallel::GradientSync& sync) {
  TensorMap out;
  if (sync.zero() == 0) {
    opt.export_state(out);
    return out;
  }
  // The AdamW pieces are the sync's owned pieces, in that order (train/trainer.cpp); bf16
  // moments are gathered widened to f32, as export_state gives them.
  const size_t n = opt.parameters().size();
  std::vector<Tensor> ms, vs;
  for (size_t i = 0; i < n; ++i) {
    ms.push_back(opt.m(i));
    vs.push_back(opt.v(i));
  }
  const std::vector<Tensor> m = sync.gather_pieces(ms), v = sync.gather_pieces(vs);
  for (size_t i = 0; i < sync.parameters().size(); ++i) {
    out[sync.parameters()[i]->name + ".adam_m"] = m[i];
    out[sync.parameters()[i]->name + ".adam_v"] = v[i];
  }
  out[optim::AdamW::kStepKey] = Tensor::from_vector<int64_t>({opt.step_count()}, {1});
  // The master weights of the parameters that hold only their bf16 copies, gathered like the
  // moments (the other pieces give their value's range; only the sharded ones are kept).
  bool any_sharded = false;
  for (const Parameter* p : sync.parameters()) any_sharded = any_sharded || p->master_sharded;
  if (!any_sharded) return out;
  std::vector<Tensor> masters;
  for (size_t i = 0; i < n; ++i) {
    const optim::AdamWPiece& piece = opt.pieces()[i];
    masters.push_back(piece.master ? opt.master(i)
                                   : piece.param->value.reshape({piece.param->value.numel()})
                                         .rows(piece.offset, piece.offset + piece.count)
                                         .to(opt.device()));
  }
  const std::vector<Tensor> w = sync.gather_pieces(masters);
  for (size_t i = 0; i < sync.parameters().size(); ++i)
    if (sync.parameters()[i]->master_sharded) out[sync.parameters()[i]->name] = w[i];
  return out;
}

TensorMap checkpoint_tensors(const std::vector<Parameter*>& params, const TensorMap& opt_state,
                             const std::vector<moe::MoELayer*>& moe_layers,
                             const parallel::Layout& layout) {
  TensorMap out;
  // The f32 weights: value, or the gathered masters of a parameter that holds only bf16 ones.
  auto weights_of = [&](const Parameter& p) -> const Tensor& {
    if (!p.master_sharded) return p.value;
    const auto it = opt_state.find(p.name);
    XMOE_CHECK(it != opt_state.end(),
               "[checkpoint] {}: its master weights are sharded but the optimizer state has no "
               "'{}'",
               p.name, p.name);
    return it->second;
  };
  const bool dense_writer = layout.world_rank == 0;
  auto is_param = [&](const std::string& name) {
    for (const Parameter* p : params)
      if (p->name == name) return true;
    return false;
  };
  const bool expert_writer =
      layout.dp_rank == 0 && (layout.tp_rank == 0 || !layout.experts_replicated_over_tp());
  for (const Parameter* p : params) {
    if (p->kind == ParamKind::tensor_shard) {
      // Whole tensors, so that any tp resumes: every tp group gathers (collective), rank 0
      // writes.
      auto whole = [&](const Tensor& t) {
        return parallel::gather_shards(*layout.tp_group, t, p->shard);
      };
      const Tensor value = whole(weights_of(*p));
      std::vector<Tensor> moments;
      for (const char* s : kAdamSuffixes) moments.push_back(whole(opt_state.at(p->name + s)));
      if (!dense_writer) continue;
      out.emplace(p->name, value);
      for (size_t i = 0; i < moments.size(); ++i)
        out.emplace(p->name + kAdamSuffixes[i], moments[i]);
    } else if (p->kind == ParamKind::expert) {
      if (!expert_writer) continue;
      add_expert_slices(out, p->name, on_host(weights_of(*p)), p->shard.offset);
      for (const char* s : kAdamSuffixes)
        add_expert_slices(out, p->name + s, on_host(opt_state.at(p->name + s)), p->shard.offset);
    } else if (dense_writer) {
      out.emplace(p->name, on_host(weights_of(*p)));
      for (const char* s : kAdamSuffixes)
        out.emplace(p->name + s, on_host(opt_state.at(p->name + s)));
    }
  }
  if (dense_writer) {
    for (auto& [name, t] : opt_state)
      if (!out.count(name) && name.find(".adam_") == std::string::npos && !is_param(name))
        out.emplace(name, on_host(t));
    for (moe::MoELayer* layer : moe_layers)
      if (const Tensor* bias = layer->gate().routing_bias())
        out.emplace(bias_name(*layer), on_host(*bias));
  }
  return out;
}

void restore_parameters(const TensorMap& tensors, const std::vector<Parameter*>& params,
                        const std::string& dir) {
  for (Parameter* p : params) {
    const Tensor whole = load_for(tensors, *p, p->name, dir);
    if (p->master_sharded)  // cast on the parameter's device, as AdamW and the gather do
      p->compute_copy.copy_from(ops::cast(whole.to(p->compute_copy.device()), DType::bf16));
    else
      p->value.copy_from(whole);
  }
}

void restore_checkpoint_tensors(const TensorMap& tensors, const std::vector<Parameter*>& params,
                                optim::AdamW& opt, const std::vector<moe::MoELayer*>& moe_layers,
                                const std::string& dir) {
  restore_parameters(tensors, params, dir);
  // The whole (local-shape) moments of the optimizer's parameters; it validates them and takes
  // its pieces' ranges.
  TensorMap local;
  for (const Parameter* p : opt.parameters()) {
    for (const char* s : kAdamSuffixes)
      local[p->name + s] = load_for(tensors, *p, p->name + s, dir);
    if (p->master_sharded) local[p->name] = load_for(tensors, *p, p->name, dir);
  }
  local[optim::AdamW::kStepKey] = find_whole(tensors, optim::AdamW::kStepKey, {1}, dir);
  opt.import_state(local);
  restore_routing_biases(tensors, moe_layers, dir);
}

void restore_routing_biases(const TensorMap& tensors, const std::vector<moe::MoELayer*>& moe_layers,
                            const std::string& dir) {
  for (moe::MoELayer* layer : moe_layers)
    if (Tensor* bias = layer->gate().routing_bias())
      bias->copy_from(find_whole(tensors, bias_name(*layer), bias->shape(), dir));
}

}  // namespace xmoe::train
