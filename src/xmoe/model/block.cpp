#include "xmoe/model/block.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "xmoe/core/profile.h"
#include "xmoe/model/moe_ffn.h"
#include "xmoe/moe/layer.h"
#include "xmoe/ops/ops.h"

namespace xmoe::model {

RecomputeOptions parse_recompute(const std::vector<std::string>& names) {
  RecomputeOptions r;
  for (const std::string& n : names) {
    if (n == "attention") {
      r.attention = true;
    } else if (n == "attention_core") {
      r.attention_core = true;
    } else if (n == "ffn") {
      r.ffn = true;
    } else if (n == "moe") {
      r.moe = true;
    } else if (n == "router") {
      r.router = true;
    } else {
      XMOE_FAIL(
          "[config] model.recompute entry '{}' is not one of attention, attention_core, ffn, moe, "
          "router",
          n);
    }
  }
  return r;
}

TransformerBlock::TransformerBlock(const ModelConfig& cfg, int index,
                                   std::shared_ptr<const ops::RopeTables> rope, uint64_t seed,
                                   const parallel::Layout* layout) {
  const std::string p = "layers." + std::to_string(index);
  // GPT-2 / Megatron: the projections that write into the residual stream are scaled down by
  // 1/sqrt(2·L) so that the stream's variance does not grow with depth.
  const float out_std = cfg.init_std / std::sqrt(2.0f * static_cast<float>(cfg.num_layers));
  AttentionShape shape{cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_model / cfg.num_heads};
  attn_norm_ = std::make_unique<RMSNorm>(p + ".attn_norm.weight", cfg.d_model, cfg.norm_eps);
  // Tensor parallelism: attention heads and dense FFN columns split over the tp group.
  std::shared_ptr<comm::Group> tp = layout && layout->tp > 1 ? layout->tp_group : nullptr;
  attn_ = std::make_unique<Attention>(p + ".attn", shape, std::move(rope), seed, cfg.init_std,
                                      out_std, tp);
  ffn_norm_ = std::make_unique<RMSNorm>(p + ".ffn_norm.weight", cfg.d_model, cfg.norm_eps);
  if (index < cfg.first_dense_layers) {
    ffn_ = std::make_unique<DenseFFN>(p + ".ffn", cfg.d_model, cfg.dense_hidden, seed, cfg.init_std,
                                      out_std, tp);
  } else {
    ffn_ = make_moe_ffn(cfg.moe, cfg.d_model, p + ".moe", seed, cfg.init_std, out_std, layout);
  }
  set_recompute(parse_recompute(cfg.recompute));
}

void TransformerBlock::set_recompute(const RecomputeOptions& r) {
  attn_->set_recompute(r.attention_mode());
  moe::MoELayer* moe = ffn_->moe_layer();
  ffn_->set_recompute(moe ? r.moe : r.ffn);
  if (moe) moe->set_router_recompute(r.router);
}

TransformerBlock::Stream TransformerBlock::forward(const Stream& in, int64_t batch,
                                                   int64_t seq_len) {
  ProfileScope scope("block.fwd", in.sum.device());
  // The norms write the compute dtype at once, and each residual add runs in the pass of the
  // norm after it (the block below's FFN output in the attention norm's, attention's in the FFN
  // norm's): no f32 norm outputs, no cast or add passes. In f32 compute every dtype is f32 and
  // the ops are those of the CPU path.
  RMSNorm::AddOut x = in.branch.defined()
                          ? attn_norm_->forward_add(in.sum, in.branch, compute_)
                          : RMSNorm::AddOut{in.sum, attn_norm_->forward(in.sum, compute_)};
  Tensor a = attn_->forward(x.y, batch, seq_len);
  x.y = Tensor();
  RMSNorm::AddOut h = ffn_norm_->forward_add(x.sum, a, compute_);
  a = Tensor();  // in the sum now: not held through the FFN
  // The norm keeps the sum; the FFN's output waits for the next norm (the FFN may keep it too).
  return {std::move(h.sum), ffn_->forward(h.y, seq_len)};
}

Tensor TransformerBlock::forward(const Tensor& x, int64_t batch, int64_t seq_len) {
  const Stream out = forward(Stream{x, Tensor()}, batch, seq_len);
  return ops::add(out.sum, out.branch);
}

Tensor TransformerBlock::backward(const Tensor& dy, Tensor dy_compute, Tensor* dx_compute) {
  ProfileScope scope("block.bwd", dy.device());
  // Each norm's backward reads its gradient in the compute dtype, adds the residual stream's
  // gradient and writes the compute-dtype copy that the next module reads (attention, or the
  // FFN of the block below), in one pass.
  Tensor dyn = ffn_->backward(dy_compute.defined() ? std::exchange(dy_compute, Tensor())
                                                   : as_dtype(dy, compute_));
  RMSNorm::Grad dh = ffn_norm_->backward_add(dyn, dy, compute_);
  dyn = Tensor();
  const Tensor dhn = attn_->backward(dh.dx_copy.defined() ? dh.dx_copy : dh.dx);
  dh.dx_copy = Tensor();
  RMSNorm::Grad dx = attn_norm_->backward_add(dhn, dh.dx, dx_compute ? compute_ : dh.dx.dtype());
  if (dx_compute) *dx_compute = std::move(dx.dx_copy);
  return std::move(dx.dx);
}

ActivationBytes TransformerBlock::activation_bytes_for(const ModelConfig& cfg, int index,
                                                       int64_t batch, int64_t seq_len, DType dtype,
                                                       const RecomputeOptions& r,
                                                       const ActivationLayout& layout) {
  const int64_t tokens = batch * seq_len, d = cfg.d_model;
  const int64_t t = tokens / layout.tp;  // this rank's rows of the residual stream
  const bool dense = index < cfg.first_dense_layers;
  const ActivationBytes norm = RMSNorm::activation_bytes_for(t, d);
  const ActivationBytes attn = Attention::activation_bytes_for(
      {d, cfg.num_heads, cfg.num_kv_heads, d / cfg.num_heads}, batch, seq_len, dtype,
      r.attention_mode(), layout.tp, layout.attention_workspace);
  const ActivationBytes ffn =
      dense ? DenseFFN::activation_bytes_for(tokens, d, cfg.dense_hidden, dtype, r.ffn, layout.tp)
            : moe_ffn_activation_bytes_for(cfg.moe, d, tokens, dtype, {r.moe, r.router}, layout);
  // backward(): the FFN gets dy in the compute dtype (a copy unless f32) and returns dyn in
  // it; the FFN norm makes dh [T, d] f32 and its compute-dtype copy for attention, then dyn and
  // the copy go; attention returns dhn in f32 and the attention norm makes dx f32 beside it,
  // and (every block but the first) dx's compute-dtype copy for the block below. The MoE layer
  // without SSMB returns a view of its whole [T, d] dx: dyn holds all of it.
  const auto elt = static_cast<int64_t>(dtype_size(dtype));
  const int64_t g = t * d * 4, act = t * d * elt, cast = dtype == DType::f32 ? 0 : t * d * 2;
  const int64_t dyn = !dense && layout.tp > 1 && !layout.ssmb ? tokens * d * elt : act;
  // After the FFN's backward, all it saved is gone but what it keeps (ffn.kept).
  const int64_t ffn_freed = ffn.saved - ffn.kept;
  const int64_t ffn_phase = cast + ffn.backward_extra;
  const int64_t ffn_norm_phase = dyn + cast + norm.backward_extra - ffn_freed;
  const int64_t attn_phase = g + cast + attn.backward_extra - ffn_freed - norm.saved;
  const int64_t attn_norm_phase =
      2 * g + (index > 0 ? cast : 0) + norm.backward_extra - ffn_freed - norm.saved - attn.saved;
  return {2 * norm.saved + attn.saved + ffn.saved,
          std::max({ffn_phase, ffn_norm_phase, attn_phase, attn_norm_phase}), ffn.kept};
}

void TransformerBlock::release() {
  attn_norm_->release();
  attn_->release();
  ffn_norm_->release();
  ffn_->release();
}

int64_t TransformerBlock::saved_bytes() const {
  return attn_norm_->saved_bytes() + attn_->saved_bytes() + ffn_norm_->saved_bytes() +
         ffn_->saved_bytes();
}

void TransformerBlock::collect_parameters(std::vector<Parameter*>& out) {
  attn_norm_->collect_parameters(out);
  attn_->collect_parameters(out);
  ffn_norm_->collect_parameters(out);
  ffn_->collect_parameters(out);
}

}  // namespace xmoe::model
