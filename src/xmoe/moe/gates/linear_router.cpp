// The linear router's GEMMs, in f32 or with bf16 operands (gates.h).
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

Tensor LinearRouter::logits() const {
  XMOE_CHECK(x_.defined(), "[moe router] logits without a forward");
  return xmoe::ops::matmul_f32(operand(x_), weight_operand(), false, false);
}

Tensor LinearRouter::backward(const Tensor& dlogits) {
  XMOE_CHECK(x_.defined(), "[moe router] backward without a forward");
  const Tensor dl = operand(dlogits);
  xmoe::ops::matmul_into(weight_.grad, operand(x_), dl, true, false, 1.f, 1.f);  // dW += x^T dl
  return xmoe::ops::matmul_f32(dl, weight_operand(), false, true);               // dx = dl W^T
}

}  // namespace xmoe::moe
