#include "xmoe/model/rmsnorm.h"

#include "xmoe/core/profile.h"
#include "xmoe/ops/ops.h"

namespace xmoe::model {

RMSNorm::RMSNorm(std::string name, int64_t d, float eps)
    : weight_(Parameter::make(std::move(name), {d}, ParamKind::dense, /*weight_decay=*/false)),
      eps_(eps) {
  weight_.init_constant(1.0f);
}

Tensor RMSNorm::forward(const Tensor& x) {
  ProfileScope scope("norm.fwd", x.device());
  auto r = ops::rmsnorm(x, weight_.weights_f32(), eps_);
  x_ = x;
  rstd_ = r.rstd;
  return r.y;
}

Tensor RMSNorm::backward(const Tensor& dy) {
  XMOE_CHECK(x_.defined(), "[rmsnorm] {}: backward without a forward", weight_.name);
  ProfileScope scope("norm.bwd", dy.device());
  Tensor dx = ops::rmsnorm_backward(x_, weight_.weights_f32(), rstd_, dy, weight_.grad);
  x_ = Tensor();
  rstd_ = Tensor();
  return dx;
}

}  // namespace xmoe::model
