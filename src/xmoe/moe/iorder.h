#pragma once
// Stage 6, I-Order (un-permute): the weighted scatter-add of each token's k expert outputs back
// into token order, y[t] = sum_j w[t, j] * out[row(t, j)]. Padding rows (token -1) are skipped.
// Backward: d_rows[r] = w[r] * dy[token(r)] and d_combine_weights[r] = out[r] . dy[token(r)],
// which the order stage maps back to the gate's topk_weight. Where the stage holds the only
// reference to out, backward writes d_rows over it.
#include <span>

#include "xmoe/moe/order.h"
#include "xmoe/ops/fp8.h"

namespace xmoe::moe {

class IOrder {
 public:
  /// rows_out [N, d], combine_weights [N] (one per row of `layout`) -> y [T, d], plus addend
  /// [T, d] where given (the shared experts' output: the sum in the same pass).
  Tensor forward(const Tensor& rows_out, const Tensor& combine_weights, const TokenLayout& layout,
                 const Tensor& addend = Tensor());
  struct Grads {
    Tensor d_rows;                  ///< [N, d]
    Tensor d_combine_weights;       ///< [N]
    xmoe::ops::Fp8Rows d_rows_fp8;  ///< with fp8_groups
  };
  /// fp8_groups (not empty): d_rows' FP8 rows too, in groups of those sizes, in the same pass
  /// (ops::gather_weighted_rows_dot): FP8 experts read them where their rows are these rows.
  Grads backward(const Tensor& dy, std::span<const int64_t> fp8_groups = {});
  void release() { rows_out_ = combine_weights_ = token_ids_ = Tensor(); }

 private:
  Tensor rows_out_, combine_weights_, token_ids_;
};

}  // namespace xmoe::moe
