#include "xmoe/moe/order.h"

#include <algorithm>

#include "xmoe/moe/padded.h"
#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

namespace {

class PftOrder final : public Order {
 public:
  explicit PftOrder(const MoeConfig& c) : Order(c.num_experts) {}
  std::string_view name() const override { return "pft"; }
};

}  // namespace

TokenLayout Order::make_layout(const Tensor& topk_idx, const Tensor& topk_weight) const {
  const int64_t T = topk_idx.size(0), k = topk_idx.size(1), E = num_experts_;
  const int64_t C = capacity_for(T, k);  // 0: PFT
  xmoe::ops::MoeLayout m = xmoe::ops::moe_layout(topk_idx, topk_weight, E, C);
  TokenLayout l;
  l.num_tokens = T;
  l.top_k = k;
  l.num_experts = E;
  l.capacity = C;
  l.padded = C > 0;
  l.token_ids = std::move(m.token_ids);
  l.expert_ids = std::move(m.expert_ids);
  l.combine_weights = std::move(m.combine_weights);
  l.slot_to_row = std::move(m.slot_to_row);
  l.load = std::move(m.load);
  l.tokens_per_expert = l.load;
  if (C > 0) {
    for (int64_t e = 0; e < E; ++e) {
      l.tokens_per_expert[e] = std::min(l.load[e], C);
      l.dropped += l.load[e] - l.tokens_per_expert[e];
    }
    l.group_sizes.assign(static_cast<size_t>(E), C);
  } else {
    l.group_sizes = l.load;
  }
  return l;
}

Tensor Order::forward(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight) {
  plan(x, topk_idx, topk_weight);
  return gather(x);
}

void Order::plan(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight) {
  const char* op = "moe order";
  check_dtype(topk_idx, DType::i32, op, "topk_idx");
  check_dtype(topk_weight, DType::f32, op, "topk_weight");
  check_shape(topk_idx, {x.size(0), -1}, op, "topk_idx");
  check_shape(topk_weight, topk_idx.shape(), op, "topk_weight");
  xmoe::ops::check_same_device(op, "topk_idx", topk_idx, "x", x);
  xmoe::ops::check_same_device(op, "topk_weight", topk_weight, "x", x);
  layout_ = {};  // free the previous step's layout before building the next
  d_model_ = x.size(1);
  layout_ = make_layout(topk_idx, topk_weight);
}

Tensor Order::gather(const Tensor& x) const {
  XMOE_CHECK(layout_.token_ids.defined(), "[moe order] gather without a layout");
  check_shape(x, {layout_.num_tokens, d_model_}, "moe order gather", "x");
  return layout_.padded ? xmoe::ops::gather_rows_masked(x, layout_.token_ids)
                        : xmoe::ops::gather_rows(x, layout_.token_ids);
}

Order::Grads Order::backward(const Tensor& d_rows, const Tensor& d_combine_weights,
                             const Tensor& dx_addend) const {
  const TokenLayout& l = layout_;
  XMOE_CHECK(l.token_ids.defined(), "[moe order] backward without a forward");
  const int64_t N = l.num_rows();
  check_shape(d_rows, {N, d_model_}, "moe order backward", "d_rows");
  check_shape(d_combine_weights, {N}, "moe order backward", "d_combine_weights");
  Grads g;
  // Each token sums its own k rows (slot_to_row names them): no scatter, no sort.
  g.dx = xmoe::ops::gather_sum_rows(d_rows, l.slot_to_row.reshape({l.num_tokens, l.top_k}),
                                    Tensor(), dx_addend);
  Tensor dcw = xmoe::ops::as_dtype(d_combine_weights, DType::f32).reshape({N, 1});
  g.d_topk_weight = l.padded ? xmoe::ops::gather_rows_masked(dcw, l.slot_to_row)
                             : xmoe::ops::gather_rows(dcw, l.slot_to_row);
  g.d_topk_weight = g.d_topk_weight.reshape({l.num_tokens, l.top_k});
  return g;
}

OrderRegistry& order_registry() {
  static OrderRegistry registry = [] {
    OrderRegistry r("moe.impl");
    r.add("pft", [](const MoeConfig& c) -> std::unique_ptr<Order> {
      return std::make_unique<PftOrder>(c);
    });
    r.add("padded", make_padded_order);
    return r;
  }();
  return registry;
}

std::unique_ptr<Order> make_order(const MoeConfig& config) {
  return order_registry().create(config.impl, config);
}

}  // namespace xmoe::moe
