#include "xmoe/model/embedding.h"

#include "xmoe/ops/model_ops.h"

namespace xmoe::model {

Embedding::Embedding(std::string name, int64_t vocab, int64_t d, uint64_t seed, float init_std)
    : weight_(Parameter::make(std::move(name), {vocab, d})) {
  weight_.init_normal(seed, init_std);
}

Tensor Embedding::forward(const Tensor& ids) {
  ids_ = ids.reshape({ids.numel()});
  return ops::embedding(weight_.value, ids_);
}

void Embedding::backward(const Tensor& dy) {
  XMOE_CHECK(ids_.defined(), "[embedding] backward without a forward");
  ops::embedding_backward(weight_.grad, ids_, dy);
  ids_ = Tensor();
}

}  // namespace xmoe::model
