#pragma once
// The MoE layer (xmoe::moe::MoELayer) as the feed-forward half of a block.
#include <memory>
#include <string>

#include "xmoe/config/config.h"
#include "xmoe/model/ffn.h"

namespace xmoe::parallel {
struct Layout;
}
namespace xmoe::moe {
struct LayerRecompute;
}

namespace xmoe::model {

/// A FeedForward around moe::MoELayer(cfg, d_model, prefix, seed, init_std, out_std); its
/// parameters are named "<prefix>.*" by the layer; out_std initialises its down projections.
/// `layout` (null = one process) shards the experts over its ep group.
/// What the MoE feed-forward saves and backward adds for a micro-batch of `tokens` tokens
/// (all of the tp group's): MoELayer::activation_bytes_for of the tokens the layer routes here,
/// tokens/tp with SSMB; without it (tp > 1) all of them, gathered, and backward holds the
/// gathered dy [T, d] beside the layer's; the returned dx is then a view of the layer's whole
/// [T, d] one.
ActivationBytes moe_ffn_activation_bytes_for(const MoeConfig& cfg, int64_t d_model, int64_t tokens,
                                             DType dtype, const moe::LayerRecompute& recompute,
                                             const ActivationLayout& layout);

std::unique_ptr<FeedForward> make_moe_ffn(const MoeConfig& cfg, int64_t d_model, std::string prefix,
                                          uint64_t seed, float init_std, float out_std,
                                          const parallel::Layout* layout = nullptr);

}  // namespace xmoe::model
