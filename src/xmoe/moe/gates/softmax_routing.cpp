#include "xmoe/moe/gates/gates.h"
#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

GateOutput SoftmaxRouting::forward(const Tensor& logits, int64_t seq_len, const Tensor& fixed_idx,
                                   comm::Group* world) {
  logits_ = logits;  // [T, E]
  GateOutput out;
  if (o_.softmax_before_topk) {
    // probs [T, E] (for the balance losses and the weights), the picks and their values [T, k]:
    // one pass where the routing is not fixed
    Tensor v;
    if (fixed_idx.defined()) {
      probs_ = xmoe::ops::softmax(logits);
      idx_ = fixed_idx;
      v = xmoe::ops::take_along_rows(probs_, idx_);
    } else {
      xmoe::ops::SoftmaxTopKResult st = xmoe::ops::softmax_topk(logits, o_.top_k);
      probs_ = std::move(st.probs);
      idx_ = std::move(st.top.indices);
      v = std::move(st.top.values);
    }
    weights_ = o_.renormalize ? xmoe::ops::renormalize_rows(v, 1.0f, sums_) : v;
  } else {
    probs_ = xmoe::ops::softmax(logits);  // [T, E], for the balance losses
    idx_ = fixed_idx.defined() ? fixed_idx : xmoe::ops::topk(logits, o_.top_k).indices;
    weights_ = xmoe::ops::softmax(xmoe::ops::take_along_rows(logits, idx_));  // [T, k], sums to 1
  }
  out.topk_idx = idx_;
  out.topk_weight = weights_;
  out.aux = aux_losses(probs_, idx_, logits_, seq_len, o_.aux, aux_state_, world);
  return out;
}

Tensor SoftmaxRouting::backward(const Tensor& d_topk_weight, float aux_scale,
                                const Tensor& aux_device_scale) {
  XMOE_CHECK(weights_.defined(), "[moe gate] backward without a forward");
  XMOE_CHECK(probs_.defined(), "[moe gate] backward before the routing tensors were restored");
  check_shape(d_topk_weight, weights_.shape(), "moe gate backward", "d_topk_weight");
  if (o_.softmax_before_topk) {  // dv into dP, the aux terms, softmax's backward: one pass
    Tensor dv = o_.renormalize
                    ? xmoe::ops::renormalize_rows_backward(weights_, sums_, d_topk_weight, 1.0f)
                    : d_topk_weight;
    return softmax_routing_backward(probs_, idx_, dv, logits_, aux_state_, o_.aux.scaled(aux_scale),
                                    aux_device_scale);
  }
  const int64_t T = probs_.size(0), E = probs_.size(1);
  Tensor dprobs = Tensor::zeros({T, E}, DType::f32, probs_.device());
  // direct contributions (Mixtral weights, z-loss)
  Tensor dlogits = Tensor::zeros({T, E}, DType::f32, probs_.device());
  xmoe::ops::put_along_rows_add(dlogits, idx_,
                                xmoe::ops::softmax_backward(weights_, d_topk_weight));
  aux_losses_backward(logits_, aux_state_, o_.aux.scaled(aux_scale), dprobs, dlogits,
                      aux_device_scale);
  xmoe::ops::add_(dlogits, xmoe::ops::softmax_backward(probs_, dprobs));
  return dlogits;
}

void SoftmaxRouting::restore(const Tensor& logits) {
  logits_ = logits;
  probs_ = xmoe::ops::softmax(logits);
}

void SoftmaxRouting::release() {
  logits_ = probs_ = idx_ = weights_ = sums_ = Tensor();
}

}  // namespace xmoe::moe
