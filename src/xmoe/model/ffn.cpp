#include "xmoe/model/ffn.h"

#include "xmoe/core/profile.h"
#include "xmoe/ops/ops.h"

namespace xmoe::model {

DenseFFN::DenseFFN(std::string prefix, int64_t d_model, int64_t hidden, uint64_t seed,
                   float init_std, float out_std)
    : gate_up_(Parameter::make(prefix + ".gate_up", {d_model, 2 * hidden})),
      down_(Parameter::make(prefix + ".down", {hidden, d_model})) {
  gate_up_.init_normal(seed, init_std);
  down_.init_normal(seed, out_std);
}

Tensor DenseFFN::forward(const Tensor& x, int64_t /*seq_len*/) {
  check_shape(x, {-1, gate_up_.value.size(0)}, "dense_ffn", "x");
  ProfileScope scope("block.ffn.fwd", x.device());
  x_ = x;
  Tensor h = ops::matmul(x, gate_up_.compute());                // [T, 2h]
  Tensor y = ops::matmul_f32(ops::swiglu(h), down_.compute());  // f32: joins the residual stream
  if (!recompute_) h_ = h;
  return y;
}

Tensor DenseFFN::backward(const Tensor& dy) {
  XMOE_CHECK(x_.defined(), "[dense_ffn] {}: backward without a forward", gate_up_.name);
  ProfileScope scope("block.ffn.bwd", dy.device());
  Tensor dh = h_.defined() ? h_ : ops::matmul(x_, gate_up_.compute());  // h, becomes dh below
  h_ = Tensor();
  Tensor a = ops::swiglu(dh);  // [T, h]
  ops::matmul_into(down_.grad, a, dy, /*trans_a=*/true, false, 1.f, 1.f);
  a = Tensor();
  const Tensor da = ops::matmul(dy, down_.compute(), false, /*trans_b=*/true);
  ops::swiglu_backward_(dh, da);  // in place: h is not needed again
  ops::matmul_into(gate_up_.grad, x_, dh, true, false, 1.f, 1.f);
  Tensor dx = ops::matmul_f32(dh, gate_up_.compute(), false, true);
  x_ = Tensor();
  return dx;
}

ActivationBytes DenseFFN::activation_bytes_for(int64_t tokens, int64_t d_model, int64_t hidden,
                                               DType dtype, bool recompute) {
  const auto c = static_cast<int64_t>(dtype_size(dtype));
  const int64_t x = tokens * d_model * c, h = tokens * 2 * hidden * c;
  return {x + (recompute ? 0 : h),
          (recompute ? h : 0) + tokens * hidden * c + tokens * d_model * 4};
}

void DenseFFN::collect_parameters(std::vector<Parameter*>& out) {
  out.push_back(&gate_up_);
  out.push_back(&down_);
}

}  // namespace xmoe::model
