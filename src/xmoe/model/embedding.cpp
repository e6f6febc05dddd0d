#include "xmoe/model/embedding.h"

#include "xmoe/core/profile.h"
#include "xmoe/ops/model_ops.h"
#include "xmoe/ops/ops.h"

namespace xmoe::model {

Tensor as_dtype(const Tensor& t, DType dtype) {
  return t.dtype() == dtype ? t : ops::cast(t, dtype);
}

Tensor matmul_f32(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  if (a.dtype() == DType::f32) return ops::matmul(a, b, trans_a, trans_b);
  const int64_t m = trans_a ? a.size(1) : a.size(0), n = trans_b ? b.size(0) : b.size(1);
  Tensor c = Tensor::empty({m, n}, DType::f32, a.device());
  ops::matmul_into(c, a, b, trans_a, trans_b, 1.f, 0.f);
  return c;
}

Embedding::Embedding(std::string name, int64_t vocab, int64_t d, uint64_t seed, float init_std)
    : weight_(Parameter::make(std::move(name), {vocab, d})) {
  weight_.init_normal(seed, init_std);
}

Tensor Embedding::forward(const Tensor& ids) {
  ProfileScope scope("embedding.fwd", ids.device());
  ids_ = ids.reshape({ids.numel()});
  return ops::embedding(weight_.value, ids_);
}

void Embedding::backward(const Tensor& dy) {
  XMOE_CHECK(ids_.defined(), "[embedding] backward without a forward");
  ProfileScope scope("embedding.bwd", dy.device());
  ops::embedding_backward(weight_.grad, ids_, dy);
  ids_ = Tensor();
}

}  // namespace xmoe::model
