#pragma once
// The MoE layer (xmoe::moe::MoELayer) as the feed-forward half of a block.
#include <memory>
#include <string>

#include "xmoe/config/config.h"
#include "xmoe/model/ffn.h"

namespace xmoe::parallel {
struct Layout;
}

namespace xmoe::model {

/// A FeedForward around moe::MoELayer(cfg, d_model, prefix, seed, init_std, out_std); its
/// parameters are named "<prefix>.*" by the layer; out_std initialises its down projections.
/// `layout` (null = one process) shards the experts over its ep group.
std::unique_ptr<FeedForward> make_moe_ffn(const MoeConfig& cfg, int64_t d_model, std::string prefix,
                                          uint64_t seed, float init_std, float out_std,
                                          const parallel::Layout* layout = nullptr);

}  // namespace xmoe::model
