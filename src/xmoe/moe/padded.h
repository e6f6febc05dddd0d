#pragma once
// The padded baseline (DeepSpeed-MoE / Tutel style), selected with moe.impl = "padded":
// every expert gets a buffer of C = ceil(capacity_factor * T * k / E) rows, so the expert input
// is [E, C, d] (allocated as such; padding rows are zero). Pairs beyond C for an expert are
// dropped in (token, slot) order and counted; a dropped pair contributes nothing to its token.
// The experts then run as one batched GEMM over equal groups of C rows.
#include <memory>

#include "xmoe/moe/order.h"

namespace xmoe::moe {

/// C = ceil(capacity_factor * tokens * top_k / experts), at least 1.
int64_t padded_capacity(float capacity_factor, int64_t tokens, int64_t top_k, int64_t experts);

std::unique_ptr<Order> make_padded_order(const MoeConfig& config);

}  // namespace xmoe::moe
