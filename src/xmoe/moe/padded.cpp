#include "xmoe/moe/padded.h"

#include <cmath>

namespace xmoe::moe {

int64_t padded_capacity(float capacity_factor, int64_t tokens, int64_t top_k, int64_t experts) {
  const double c = std::ceil(static_cast<double>(capacity_factor) * static_cast<double>(tokens) *
                             static_cast<double>(top_k) / static_cast<double>(experts));
  return std::max<int64_t>(1, static_cast<int64_t>(c));
}

int64_t padded_layout_kernel(const int32_t* topk_idx, const float* topk_weight, int64_t tokens,
                             int64_t top_k, int64_t experts, int64_t capacity, int32_t* token_ids,
                             int32_t* expert_ids, float* combine_weights, int32_t* slot_to_row,
                             int64_t* load, int64_t* kept) {
  for (int64_t e = 0; e < experts; ++e) {
    load[e] = kept[e] = 0;
    for (int64_t c = 0; c < capacity; ++c) {
      token_ids[e * capacity + c] = -1;
      expert_ids[e * capacity + c] = static_cast<int32_t>(e);
      combine_weights[e * capacity + c] = 0.f;
    }
  }
  int64_t dropped = 0;
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int32_t e = topk_idx[i];
    ++load[e];
    if (kept[e] == capacity) {  // full: the pair is dropped (first come, first served)
      slot_to_row[i] = -1;
      ++dropped;
      continue;
    }
    const int64_t row = e * capacity + kept[e]++;
    token_ids[row] = static_cast<int32_t>(i / top_k);
    combine_weights[row] = topk_weight[i];
    slot_to_row[i] = static_cast<int32_t>(row);
  }
  return dropped;
}

namespace {

class PaddedOrder final : public Order {
 public:
  explicit PaddedOrder(const MoeConfig& c) : Order(c.num_experts), capacity_factor_(c.capacity_factor) {
    XMOE_CHECK(capacity_factor_ > 0.f, "[moe] moe.capacity_factor = {} must be > 0",
               capacity_factor_);
  }
  std::string_view name() const override { return "padded"; }

 protected:
  int64_t capacity_for(int64_t tokens, int64_t top_k) const override {
    return padded_capacity(capacity_factor_, tokens, top_k, num_experts_);
  }

  TokenLayout make_layout(const Tensor& topk_idx, const Tensor& topk_weight) const override {
    const int64_t T = topk_idx.size(0), k = topk_idx.size(1), E = num_experts_;
    const int64_t C = padded_capacity(capacity_factor_, T, k, E);
    TokenLayout l;
    l.num_tokens = T;
    l.top_k = k;
    l.num_experts = E;
    l.capacity = C;
    l.padded = true;
    l.token_ids = Tensor::empty({E * C}, DType::i32);
    l.expert_ids = Tensor::empty({E * C}, DType::i32);
    l.combine_weights = Tensor::empty({E * C});
    l.slot_to_row = Tensor::empty({T * k}, DType::i32);
    l.load.assign(static_cast<size_t>(E), 0);
    l.tokens_per_expert.assign(static_cast<size_t>(E), 0);
    l.dropped = padded_layout_kernel(topk_idx.data<int32_t>(), topk_weight.data<float>(), T, k, E,
                                     C, l.token_ids.data<int32_t>(), l.expert_ids.data<int32_t>(),
                                     l.combine_weights.data<float>(),
                                     l.slot_to_row.data<int32_t>(), l.load.data(),
                                     l.tokens_per_expert.data());
    l.group_sizes.assign(static_cast<size_t>(E), C);
    return l;
  }

 private:
  float capacity_factor_;
};

}  // namespace

std::unique_ptr<Order> make_padded_order(const MoeConfig& config) {
  return std::make_unique<PaddedOrder>(config);
}

}  // namespace xmoe::moe
