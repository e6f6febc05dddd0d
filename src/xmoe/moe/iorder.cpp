#include "xmoe/moe/iorder.h"

#include "xmoe/ops/moe.h"

namespace xmoe::moe {

Tensor IOrder::forward(const Tensor& rows_out, const Tensor& combine_weights,
                       const TokenLayout& layout, const Tensor& addend) {
  const char* op = "moe iorder";
  const int64_t N = layout.num_rows();
  check_shape(rows_out, {N, -1}, op, "rows_out");
  check_shape(combine_weights, {N}, op, "combine_weights");
  rows_out_ = rows_out;
  combine_weights_ = combine_weights;
  token_ids_ = layout.token_ids;
  // Each token sums its own k rows (slot_to_row names them; dropped slots are -1, padding rows
  // are named by none). y has the rows' dtype: a bf16 token's sum is taken in f32, rounded once.
  return xmoe::ops::gather_sum_rows(rows_out,
                                    layout.slot_to_row.reshape({layout.num_tokens, layout.top_k}),
                                    combine_weights, addend);
}

IOrder::Grads IOrder::backward(const Tensor& dy, std::span<const int64_t> fp8_groups) {
  XMOE_CHECK(rows_out_.defined(), "[moe iorder] backward without a forward");
  check_shape(dy, {-1, rows_out_.size(1)}, "moe iorder backward", "dy");
  // One pass on CUDA (gather of dy by token, the dot for d_combine_weights, the scale); the CPU
  // runs the same three ops in sequence. A padding slot (-1) gives a zero row. Where nothing
  // else holds the expert output, d_rows takes its storage: out and d_rows [N, d] are never
  // both alive, which was the layer's peak where d > f (each element is read before the same
  // thread overwrites it).
  Tensor rows = std::move(rows_out_);
  const bool in_place = rows.sole_owner();
  xmoe::ops::WeightedGather r = xmoe::ops::gather_weighted_rows_dot(
      dy, rows, token_ids_, combine_weights_, in_place, fp8_groups);
  Grads g;
  g.d_rows = std::move(r.d_rows);
  g.d_combine_weights = std::move(r.dot);
  g.d_rows_fp8 = std::move(r.d_rows_fp8);
  return g;
}

}  // namespace xmoe::moe
