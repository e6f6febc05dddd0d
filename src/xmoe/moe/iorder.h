#pragma once
// Stage 6, I-Order (un-permute): the weighted scatter-add of each token's k expert outputs back
// into token order, y[t] = sum_j w[t, j] * out[row(t, j)]. Padding rows (token -1) are skipped.
// Backward: d_rows[r] = w[r] * dy[token(r)] and d_combine_weights[r] = out[r] . dy[token(r)],
// which the order stage maps back to the gate's topk_weight. When the experts fold the weights
// into their backward (Experts::backward_weighted), forward keeps no rows_out and backward
// gives the unweighted d_rows[r] = dy[token(r)].
#include "xmoe/moe/order.h"

namespace xmoe::moe {

class IOrder {
 public:
  /// rows_out [N, d], combine_weights [N] (one per row of `layout`) -> y [T, d]. keep_rows_out
  /// false: only backward_unweighted can follow.
  Tensor forward(const Tensor& rows_out, const Tensor& combine_weights, const TokenLayout& layout,
                 bool keep_rows_out = true);
  struct Grads {
    Tensor d_rows;             ///< [N, d]
    Tensor d_combine_weights;  ///< [N]
  };
  Grads backward(const Tensor& dy);
  /// dy [T, d] -> dy[token(r)] [N, d] in the rows' dtype (zero rows for padding slots).
  Tensor backward_unweighted(const Tensor& dy) const;
  void release() { rows_out_ = combine_weights_ = token_ids_ = Tensor(); }

 private:
  Tensor rows_out_, combine_weights_, token_ids_;
  bool padded_ = false;
  DType rows_dtype_ = DType::f32;
};

}  // namespace xmoe::moe
