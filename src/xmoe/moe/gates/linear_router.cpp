// The linear router's GEMMs, in f32 or with bf16 operands (gates.h).
#include <array>

#include "xmoe/moe/gates/gates.h"
#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

LinearRouter::LinearRouter(const GateArgs& a)
    : weight_(Parameter::make(a.prefix + ".router.weight", {a.d_model, a.config.num_experts})),
      bf16_(a.config.router_dtype == "bf16") {
  XMOE_CHECK(a.config.router_dtype == "f32" || bf16_,
             "[moe] moe.router_dtype = \"{}\" is not f32 or bf16", a.config.router_dtype);
  weight_.reads_f32 = !bf16_;  // an f32 router reads the f32 weights, not the bf16 copy
  weight_.init_normal(a.seed, a.init_std);
}

Tensor LinearRouter::operand(const Tensor& t) const {
  if (!bf16_) return xmoe::ops::as_dtype(t, DType::f32);
  if (!t.is_cpu()) return xmoe::ops::as_dtype(t, DType::bf16);
  // The CPU has no bf16 kernels: round to bf16 values, keep them in f32.
  return xmoe::ops::cast(xmoe::ops::as_dtype(t, DType::bf16), DType::f32);
}

Tensor LinearRouter::weight_operand() const {
  const Tensor& copy = weight_.compute_copy;  // bf16, rewritten by AdamW with every update
  if (bf16_ && copy.defined() && !copy.is_cpu()) return copy;
  return operand(weight_.weights_f32());
}

Tensor LinearRouter::forward(const Tensor& x) {
  x_ = x;  // the layer's input, which its caller holds: no [T, d] copy kept for backward
  return logits();
}

bool LinearRouter::splits() const {
  return !bf16_ && !x_.is_cpu() && x_.dtype() == DType::bf16;
}

namespace {
// The f32 operands' bf16 terms (ops::split_bf16_columns): hi, lo, lo2.
constexpr std::array<int, 3> kAllTerms = {0, 1, 2};
// dl W^T from the six term pairs that reach f32's 24 bits: (hi, hi), (hi, lo), (lo, hi),
// (hi, lo2), (lo2, hi), (lo, lo), dl's terms on the left, W's on the right.
constexpr std::array<int, 6> kLeftTerms = {0, 0, 1, 0, 2, 1};
constexpr std::array<int, 6> kRightTerms = {0, 1, 0, 2, 0, 1};
}  // namespace

Tensor LinearRouter::logits() const {
  XMOE_CHECK(x_.defined(), "[moe router] logits without a forward");
  if (!splits()) return xmoe::ops::matmul_f32(operand(x_), weight_operand(), false, false);
  // x W = x W_hi + x W_lo + x W_lo2: one bf16 GEMM against [W_hi | W_lo | W_lo2], the three
  // column blocks summed in f32. x is bf16 already: no f32 copy of it.
  const Tensor& w = weight_.weights_f32();
  const Tensor y =
      xmoe::ops::matmul_f32(x_, xmoe::ops::split_bf16_columns(w, kAllTerms), false, false);
  Tensor out = Tensor::empty({x_.size(0), w.size(1)}, DType::f32, x_.device());
  xmoe::ops::sum_column_blocks_into(out, y, 3, false);
  return out;
}

Tensor LinearRouter::backward(const Tensor& dlogits) {
  return backward_impl(dlogits, nullptr);
}

void LinearRouter::backward_add(const Tensor& dlogits, Tensor& dx) {
  check_shape(dx, {x_.size(0), x_.size(1)}, "moe router backward", "dx");
  backward_impl(dlogits, &dx);
}

Tensor LinearRouter::backward_impl(const Tensor& dlogits, Tensor* dx_into) {
  XMOE_CHECK(x_.defined(), "[moe router] backward without a forward");
  // dx = a b^T: written as a new f32 tensor, or added into dx_into by the GEMM.
  const auto input_grad = [&](const Tensor& a, const Tensor& b) {
    if (!dx_into) return xmoe::ops::matmul_f32(a, b, false, true);
    xmoe::ops::matmul_into(*dx_into, a, b, false, true, 1.f, 1.f);
    return Tensor();
  };
  if (splits()) {
    const Tensor& w = weight_.weights_f32();
    const Tensor dw3 = xmoe::ops::matmul_f32(x_, xmoe::ops::split_bf16_columns(dlogits, kAllTerms),
                                             true, false);  // x^T [dl_hi | dl_lo | dl_lo2]
    xmoe::ops::sum_column_blocks_into(weight_.grad, dw3, 3, true);
    return input_grad(xmoe::ops::split_bf16_columns(dlogits, kLeftTerms),
                      xmoe::ops::split_bf16_columns(w, kRightTerms));
  }
  const Tensor dl = operand(dlogits);
  xmoe::ops::matmul_into(weight_.grad, operand(x_), dl, true, false, 1.f, 1.f);  // dW += x^T dl
  return input_grad(dl, weight_operand());                                       // dx = dl W^T
}

}  // namespace xmoe::moe
