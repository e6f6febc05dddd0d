#include "xmoe/moe/shared.h"

#include <utility>

#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

SharedExperts::SharedExperts(const std::string& prefix, int64_t d_model, int64_t hidden,
                             uint64_t seed, float init_std, float down_std) {
  gate_up_ = Parameter::make(prefix + ".shared.gate_up", {d_model, 2 * hidden});
  down_ = Parameter::make(prefix + ".shared.down", {hidden, d_model});
  gate_up_.init_normal(seed, init_std);
  down_.init_normal(seed, down_std);
  gate_up_.lazy_zero_grad = down_.lazy_zero_grad = true;  // backward writes all of each
}

Tensor SharedExperts::forward(const Tensor& x) {
  x_ = x;
  // bf16 activations (CUDA): the weights' bf16 compute copies, kept for backward.
  wgu_ = xmoe::ops::as_dtype(gate_up_.compute(), x.dtype());
  wd_ = xmoe::ops::as_dtype(down_.compute(), x.dtype());
  h_ = xmoe::ops::matmul(x, wgu_);                       // [T, 2Sf]
  return xmoe::ops::matmul(xmoe::ops::swiglu(h_), wd_);  // [T, d]
}

Tensor SharedExperts::backward(const Tensor& dy) {
  XMOE_CHECK(h_.defined(), "[moe shared] backward without a forward");
  const Tensor g = xmoe::ops::as_dtype(dy, x_.dtype());
  const auto beta = [](Parameter& p) { return p.take_grad_overwrite() ? 0.f : 1.f; };
  Tensor dh = std::exchange(h_, Tensor());            // h, turned into dh in place
  Tensor a = xmoe::ops::matmul(g, wd_, false, true);  // da [T, Sf], turned into swiglu(h)
  xmoe::ops::swiglu_backward_with_value_(dh, a);
  xmoe::ops::matmul_into(down_.grad, a, g, true, false, 1.f, beta(down_));  // dWd += a^T dy (f32)
  a = Tensor();
  xmoe::ops::matmul_into(gate_up_.grad, x_, dh, true, false, 1.f, beta(gate_up_));  // += x^T dh
  return xmoe::ops::matmul(dh, wgu_, false, true);                                  // [T, d]
}

}  // namespace xmoe::moe
