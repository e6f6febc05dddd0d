#include "xmoe/moe/order.h"

#include <algorithm>

#include "xmoe/backend/cuda/moe_kernels.h"

#include "xmoe/moe/moe_ops.h"
#include "xmoe/moe/padded.h"
#include "xmoe/ops/dispatch.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

void pft_layout_kernel(const int32_t* topk_idx, const float* topk_weight, int64_t tokens,
                       int64_t top_k, int64_t experts, int32_t* token_ids, int32_t* expert_ids,
                       float* combine_weights, int32_t* slot_to_row, int64_t* tokens_per_expert) {
  const int64_t pairs = tokens * top_k;
  for (int64_t e = 0; e < experts; ++e) tokens_per_expert[e] = 0;
  for (int64_t i = 0; i < pairs; ++i) ++tokens_per_expert[topk_idx[i]];
  std::vector<int64_t> next(static_cast<size_t>(experts), 0);  // exclusive prefix sums
  for (int64_t e = 1; e < experts; ++e) next[e] = next[e - 1] + tokens_per_expert[e - 1];
  // Visiting pairs in (token, slot) order keeps each expert's rows in that order (stable).
  for (int64_t i = 0; i < pairs; ++i) {
    const int32_t e = topk_idx[i];
    const int64_t row = next[e]++;
    token_ids[row] = static_cast<int32_t>(i / top_k);
    expert_ids[row] = e;
    combine_weights[row] = topk_weight[i];
    slot_to_row[i] = static_cast<int32_t>(row);
  }
}

namespace {

class PftOrder final : public Order {
 public:
  explicit PftOrder(const MoeConfig& c) : Order(c.num_experts) {}
  std::string_view name() const override { return "pft"; }

 protected:
  TokenLayout make_layout(const Tensor& topk_idx, const Tensor& topk_weight) const override {
    const int64_t num_experts = num_experts_;
    const int64_t T = topk_idx.size(0), k = topk_idx.size(1), N = T * k;
    TokenLayout l;
    l.num_tokens = T;
    l.top_k = k;
    l.num_experts = num_experts;
    l.token_ids = Tensor::empty({N}, DType::i32);
    l.expert_ids = Tensor::empty({N}, DType::i32);
    l.combine_weights = Tensor::empty({N});
    l.slot_to_row = Tensor::empty({N}, DType::i32);
    l.tokens_per_expert.assign(static_cast<size_t>(num_experts), 0);
    pft_layout_kernel(topk_idx.data<int32_t>(), topk_weight.data<float>(), T, k, num_experts,
                      l.token_ids.data<int32_t>(), l.expert_ids.data<int32_t>(),
                      l.combine_weights.data<float>(), l.slot_to_row.data<int32_t>(),
                      l.tokens_per_expert.data());
    l.group_sizes = l.tokens_per_expert;
    l.load = l.tokens_per_expert;
    return l;
  }
};

}  // namespace

TokenLayout Order::make_device_layout(const Tensor& topk_idx, const Tensor& topk_weight) const {
  const int64_t T = topk_idx.size(0), k = topk_idx.size(1), E = num_experts_;
  const int64_t C = capacity_for(T, k);  // 0: PFT
  const int64_t N = C > 0 ? E * C : T * k;
  const Device dev = topk_idx.device();
  TokenLayout l;
  l.num_tokens = T;
  l.top_k = k;
  l.num_experts = E;
  l.capacity = C;
  l.padded = C > 0;
  l.token_ids = Tensor::empty({N}, DType::i32, dev);
  l.expert_ids = Tensor::empty({N}, DType::i32, dev);
  l.combine_weights = Tensor::empty({N}, DType::f32, dev);
  l.slot_to_row = Tensor::empty({T * k}, DType::i32, dev);
  Tensor counts = Tensor::empty({E + 1}, DType::i64, dev);  // [load (E), first bad pair]
  const size_t bytes = cuda::moe_layout_workspace_bytes(T * k, E);
  Tensor ws = Tensor::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, DType::u8, dev);
  cuda::moe_layout(topk_idx.data<int32_t>(), topk_weight.data<float>(), T * k, k, E, C,
                   l.token_ids.data<int32_t>(), l.expert_ids.data<int32_t>(),
                   l.combine_weights.data<float>(), l.slot_to_row.data<int32_t>(),
                   counts.data<int64_t>(), ws.raw(), bytes, xmoe::ops::detail::stream_of(topk_idx));
  // The order stage's one host synchronisation: grouped GEMM group sizes and all-to-all-v counts
  // are host values. The id check rides on the same copy.
  const std::vector<int64_t> c = counts.to_vector<int64_t>();
  XMOE_CHECK(c[E] < 0, "[moe order] topk_idx holds expert {} outside [0, {})",
             static_cast<int64_t>(topk_idx.item(c[E])), E);
  l.load.assign(c.begin(), c.begin() + E);
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
  const char* op = "moe order";
  check_dtype(topk_idx, DType::i32, op, "topk_idx");
  check_dtype(topk_weight, DType::f32, op, "topk_weight");
  check_shape(topk_idx, {x.size(0), -1}, op, "topk_idx");
  check_shape(topk_weight, topk_idx.shape(), op, "topk_weight");
  xmoe::ops::detail::require_same_device(op, "topk_idx", topk_idx, "x", x);
  xmoe::ops::detail::require_same_device(op, "topk_weight", topk_weight, "x", x);
  layout_ = {};  // free the previous step's layout before building the next
  d_model_ = x.size(1);
  if (topk_idx.is_cpu()) {
    for (int32_t e : topk_idx.span<int32_t>())
      XMOE_CHECK(e >= 0 && e < num_experts_, "[{}] topk_idx holds expert {} outside [0, {})", op,
                 e, num_experts_);
    layout_ = make_layout(topk_idx, topk_weight);
  } else {
    layout_ = make_device_layout(topk_idx, topk_weight);
  }
  return gather(x);
}

Tensor Order::gather(const Tensor& x) const {
  XMOE_CHECK(layout_.token_ids.defined(), "[moe order] gather without a layout");
  check_shape(x, {layout_.num_tokens, d_model_}, "moe order gather", "x");
  return layout_.padded ? gather_rows_masked(x, layout_.token_ids)
                        : xmoe::ops::gather_rows(x, layout_.token_ids);
}

Order::Grads Order::backward(const Tensor& d_rows, const Tensor& d_combine_weights) const {
  const TokenLayout& l = layout_;
  XMOE_CHECK(l.token_ids.defined(), "[moe order] backward without a forward");
  const int64_t N = l.num_rows();
  check_shape(d_rows, {N, d_model_}, "moe order backward", "d_rows");
  check_shape(d_combine_weights, {N}, "moe order backward", "d_combine_weights");
  Grads g;
  // Each token sums its own k rows (slot_to_row names them): no scatter, no sort.
  g.dx = gather_sum_rows(d_rows, l.slot_to_row.reshape({l.num_tokens, l.top_k}));
  Tensor dcw = as_dtype(d_combine_weights, DType::f32).reshape({N, 1});
  g.d_topk_weight = l.padded ? gather_rows_masked(dcw, l.slot_to_row)
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
