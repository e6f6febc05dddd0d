#include "xmoe/model/block.h"

#include <algorithm>
#include <cmath>

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

Tensor TransformerBlock::forward(const Tensor& x, int64_t batch, int64_t seq_len) {
  ProfileScope scope("block.fwd", x.device());
  // In f32 compute as_dtype returns its argument: the ops are those of the CPU path.
  const Tensor a = attn_->forward(as_dtype(attn_norm_->forward(x), compute_), batch, seq_len);
  Tensor h = as_dtype(a, x.dtype());
  ops::add_(h, x);  // h is a fresh tensor nobody else holds
  Tensor y = ffn_->forward(as_dtype(ffn_norm_->forward(h), compute_), seq_len);
  if (y.dtype() == h.dtype()) return ops::add(y, h);  // out of place: the FFN may keep its output
  Tensor out = ops::cast(y, h.dtype());
  ops::add_(out, h);
  return out;
}

Tensor TransformerBlock::backward(const Tensor& dy) {
  ProfileScope scope("block.bwd", dy.device());
  const Tensor dyn = ffn_->backward(as_dtype(dy, compute_));
  Tensor dh = ffn_norm_->backward(as_dtype(dyn, dy.dtype()));
  ops::add_(dh, dy);
  const Tensor dhn = attn_->backward(as_dtype(dh, compute_));
  Tensor dx = attn_norm_->backward(as_dtype(dhn, dh.dtype()));
  ops::add_(dx, dh);
  return dx;
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
  // backward(): dyn, dh, dhn and dx [T, d] f32 appear in turn and stay until it returns; the
  // FFN and attention get their gradient cast to the compute dtype (a copy unless f32). The
  // MoE layer without SSMB returns a view of its whole [T, d] dx: dyn holds all of it.
  const int64_t g = t * d * 4, cast = dtype == DType::f32 ? 0 : t * d * 2;
  const int64_t dyn = !dense && layout.tp > 1 && !layout.ssmb ? tokens * d * 4 : g;
  // After the FFN's backward, all it saved is gone but what it keeps (ffn.kept).
  const int64_t ffn_freed = ffn.saved - ffn.kept;
  const int64_t ffn_phase = cast + ffn.backward_extra;
  const int64_t ffn_norm_phase = dyn + norm.backward_extra - ffn_freed;
  const int64_t attn_phase = dyn + g + cast + attn.backward_extra - ffn_freed - norm.saved;
  const int64_t attn_norm_phase =
      dyn + 2 * g + norm.backward_extra - ffn_freed - norm.saved - attn.saved;
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
