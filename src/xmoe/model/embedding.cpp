#include "xmoe/model/embedding.h"

#include "xmoe/core/profile.h"
#include "xmoe/ops/model_ops.h"
#include "xmoe/ops/ops.h"

namespace xmoe::model {

Tensor as_dtype(const Tensor& t, DType dtype) {
  return t.dtype() == dtype ? t : ops::cast(t, dtype);
}

Embedding::Embedding(std::string name, int64_t vocab, int64_t d, uint64_t seed, float init_std)
    : weight_(Parameter::make(std::move(name), {vocab, d})) {
  weight_.reads_f32 = true;  // the lookup reads f32 rows even when a tied LM head has a bf16 copy
  weight_.init_normal(seed, init_std);
}

Tensor Embedding::forward(const Tensor& ids) {
  ProfileScope scope("embedding.fwd", ids.device());
  ids_ = ids.reshape({ids.numel()});
  return ops::embedding(weight_.weights_f32(), ids_);
}

void Embedding::backward(const Tensor& dy) {
  XMOE_CHECK(ids_.defined(), "[embedding] backward without a forward");
  ProfileScope scope("embedding.bwd", dy.device());
  ops::embedding_backward(weight_.grad, ids_, dy);
  ids_ = Tensor();
}

}  // namespace xmoe::model
