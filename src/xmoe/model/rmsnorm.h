#pragma once
// RMSNorm module: y = x / sqrt(mean(x^2) + eps) * weight over the last dimension.
#include <string>

#include "xmoe/core/activation_bytes.h"
#include "xmoe/core/parameter.h"
#include "xmoe/model/embedding.h"

namespace xmoe::model {

class RMSNorm : public Module {
 public:
  /// Parameter `name` [d], initialised to 1, without weight decay.
  RMSNorm(std::string name, int64_t d, float eps);

  /// x [T, d] -> [T, d]. Saves x (shared with the caller, not copied) and rstd [T].
  Tensor forward(const Tensor& x) { return forward(x, x.dtype()); }
  /// The same, written in y_dtype (the compute dtype of the layer it feeds) in the same pass.
  Tensor forward(const Tensor& x, DType y_dtype);
  struct AddOut {
    Tensor sum;  ///< x + a, of x's dtype: the residual stream after the branch
    Tensor y;    ///< its norm, of y_dtype
  };
  /// The residual add before the norm, in one pass: saves the sum (shared with the caller).
  AddOut forward_add(const Tensor& x, const Tensor& a, DType y_dtype);
  /// Returns dx; adds into the weight's gradient; releases what forward saved.
  Tensor backward(const Tensor& dy);
  struct Grad {
    Tensor dx;       ///< of the input's dtype
    Tensor dx_copy;  ///< dx in copy_dtype, when it differs from the input's
  };
  /// backward with dy of any float dtype, the residual stream's gradient (of the input's
  /// dtype; undefined: none) added to dx, and dx also written in copy_dtype: one pass.
  Grad backward_add(const Tensor& dy, const Tensor& residual, DType copy_dtype);

  /// Frees what forward saved (forward-only use).
  void release() { x_ = rstd_ = Tensor(); }
  Parameter& weight() { return weight_; }
  int64_t saved_bytes() const { return held_bytes(x_) + held_bytes(rstd_); }
  /// x (f32: the norms read the residual stream, which no one else keeps) and rstd for
  /// `tokens` rows; backward adds its f32 dx.
  static ActivationBytes activation_bytes_for(int64_t tokens, int64_t d) {
    return {tokens * d * 4 + tokens * 4, tokens * d * 4};
  }
  void collect_parameters(std::vector<Parameter*>& out) override { out.push_back(&weight_); }

 private:
  Parameter weight_;
  float eps_;
  Tensor x_, rstd_;
};

}  // namespace xmoe::model
