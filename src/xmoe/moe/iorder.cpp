#include "xmoe/moe/iorder.h"

#include "xmoe/moe/moe_ops.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

Tensor IOrder::forward(const Tensor& rows_out, const Tensor& combine_weights,
                       const TokenLayout& layout, bool keep_rows_out) {
  const char* op = "moe iorder";
  const int64_t N = layout.num_rows();
  check_shape(rows_out, {N, -1}, op, "rows_out");
  check_shape(combine_weights, {N}, op, "combine_weights");
  rows_out_ = keep_rows_out ? rows_out : Tensor();
  rows_dtype_ = rows_out.dtype();
  combine_weights_ = combine_weights;
  token_ids_ = layout.token_ids;
  padded_ = layout.padded;
  // Each token sums its own k rows (slot_to_row names them; dropped slots are -1, padding rows
  // are named by none). y has the rows' dtype: a bf16 token's sum is taken in f32, rounded once.
  return gather_sum_rows(rows_out, layout.slot_to_row.reshape({layout.num_tokens, layout.top_k}),
                         combine_weights);
}

Tensor IOrder::backward_unweighted(const Tensor& dy) const {
  XMOE_CHECK(token_ids_.defined(), "[moe iorder] backward without a forward");
  // Cast the [T, d] gradient, not the [N, d] gather of it.
  const Tensor g = as_dtype(dy, rows_dtype_);
  return padded_ ? gather_rows_masked(g, token_ids_) : xmoe::ops::gather_rows(g, token_ids_);
}

IOrder::Grads IOrder::backward(const Tensor& dy) {
  XMOE_CHECK(rows_out_.defined(), "[moe iorder] backward without a forward");
  check_shape(dy, {-1, rows_out_.size(1)}, "moe iorder backward", "dy");
  // One pass on CUDA (gather of dy by token, the dot for d_combine_weights, the scale); the CPU
  // runs the same three ops in sequence. A padding slot (-1) gives a zero row. Where nothing
  // else holds the expert output, d_rows takes its storage: out and d_rows [N, d] are never
  // both alive, which is the layer's peak where d > f. CPU only for now: the CUDA kernel in
  // place (test_cuda_moe checks it) has not yet run on a GPU.
  Tensor rows = std::move(rows_out_);
  const bool in_place = rows.sole_owner() && rows.is_cpu();
  WeightedGather r = gather_weighted_rows_dot(dy, rows, token_ids_, combine_weights_, in_place);
  Grads g;
  g.d_rows = std::move(r.d_rows);
  g.d_combine_weights = std::move(r.dot);
  return g;
}

}  // namespace xmoe::moe
