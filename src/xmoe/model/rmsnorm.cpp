#include "xmoe/model/rmsnorm.h"

#include "xmoe/core/profile.h"
#include "xmoe/ops/ops.h"

namespace xmoe::model {

RMSNorm::RMSNorm(std::string name, int64_t d, float eps)
    : weight_(Parameter::make(std::move(name), {d}, ParamKind::dense, /*weight_decay=*/false)),
      eps_(eps) {
  weight_.init_constant(1.0f);
}

Tensor RMSNorm::forward(const Tensor& x, DType y_dtype) {
  ProfileScope scope("norm.fwd", x.device());
  auto r = ops::rmsnorm(x, weight_.weights_f32(), eps_, y_dtype);
  x_ = x;
  rstd_ = r.rstd;
  return r.y;
}

RMSNorm::AddOut RMSNorm::forward_add(const Tensor& x, const Tensor& a, DType y_dtype) {
  ProfileScope scope("norm.fwd", x.device());
  auto r = ops::add_rmsnorm(x, a, weight_.weights_f32(), eps_, y_dtype);
  x_ = r.sum;
  rstd_ = r.rstd;
  return {std::move(r.sum), std::move(r.y)};
}

Tensor RMSNorm::backward(const Tensor& dy) {
  XMOE_CHECK(x_.defined(), "[rmsnorm] {}: backward without a forward", weight_.name);
  return backward_add(dy, Tensor(), x_.dtype()).dx;
}

RMSNorm::Grad RMSNorm::backward_add(const Tensor& dy, const Tensor& residual, DType copy_dtype) {
  XMOE_CHECK(x_.defined(), "[rmsnorm] {}: backward without a forward", weight_.name);
  ProfileScope scope("norm.bwd", dy.device());
  ops::RmsNormGrad g = ops::rmsnorm_backward_add(x_, weight_.weights_f32(), rstd_, dy, weight_.grad,
                                                 residual, copy_dtype);
  x_ = Tensor();
  rstd_ = Tensor();
  return {std::move(g.dx), std::move(g.dx_copy)};
}

}  // namespace xmoe::model
