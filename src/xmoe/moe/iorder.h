#pragma once
// Stage 6, I-Order (un-permute): the weighted scatter-add of each token's k expert outputs back
// into token order, y[t] = sum_j w[t, j] * out[row(t, j)]. Padding rows (token -1) are skipped.
// Backward: d_rows[r] = w[r] * dy[token(r)] and d_combine_weights[r] = out[r] . dy[token(r)],
// which the order stage maps back to the gate's topk_weight. Where the stage holds the only
// reference to out, backward writes d_rows over it.
#include "xmoe/moe/order.h"

namespace xmoe::moe {

class IOrder {
 public:
  /// rows_out [N, d], combine_weights [N] (one per row of `layout`) -> y [T, d], plus addend
  /// [T, d] where given (the shared experts' output: the sum in the same pass).
  Tensor forward(const Tensor& rows_out, const Tensor& combine_weights, const TokenLayout& layout,
                 const Tensor& addend = Tensor());
  struct Grads {
    Tensor d_rows;             ///< [N, d]
    Tensor d_combine_weights;  ///< [N]
  };
  Grads backward(const Tensor& dy);
  void release() { rows_out_ = combine_weights_ = token_ids_ = Tensor(); }

 private:
  Tensor rows_out_, combine_weights_, token_ids_;
};

}  // namespace xmoe::moe
