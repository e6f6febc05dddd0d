// sigmoid (DeepSeek-V3): s = sigmoid(x @ W). Selection uses s + bias, where the bias [E] is a
// buffer nudged after each step toward balanced load (aux-loss-free balancing), optionally
// limited to the best topk_groups of num_groups expert groups (group score = sum of its top-2
// biased scores). The weights use the raw scores of the chosen experts, normalised over the k
// and multiplied by routed_scaling. The balance losses use the normalised scores s / sum_e s.
#include "xmoe/moe/gates/gates.h"
#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

namespace {

class SigmoidGate final : public Gate {
 public:
  explicit SigmoidGate(const GateArgs& a) : Gate(a), router_(a) {
    const int64_t G = cfg_.num_groups;
    XMOE_CHECK(G >= 1 && num_experts_ % G == 0,
               "[moe] moe.num_groups = {} must divide moe.num_experts = {}", G, num_experts_);
    XMOE_CHECK(cfg_.topk_groups >= 1 && cfg_.topk_groups <= G,
               "[moe] moe.topk_groups = {} must be in [1, moe.num_groups = {}]", cfg_.topk_groups,
               G);
    XMOE_CHECK(top_k_ <= cfg_.topk_groups * (num_experts_ / G),
               "[moe] moe.top_k = {} exceeds the {} experts of moe.topk_groups = {} groups", top_k_,
               cfg_.topk_groups * (num_experts_ / G), cfg_.topk_groups);
    bias_ = Tensor::zeros({num_experts_});
  }

  GateOutput forward(const Tensor& x, int64_t seq_len, const Tensor& fixed_idx) override {
    check_forward_args(x, seq_len, fixed_idx);
    logits_ = router_.forward(x);           // [T, E] f32
    scores_ = xmoe::ops::sigmoid(logits_);  // [T, E]
    idx_ = fixed_idx.defined() ? fixed_idx : select(scores_);
    weights_ = xmoe::ops::renormalize_rows(xmoe::ops::take_along_rows(scores_, idx_),
                                           cfg_.routed_scaling, wsums_);
    probs_ = xmoe::ops::renormalize_rows(scores_, 1.0f, psums_);  // [T, E], rows sum to 1
    GateOutput out{idx_, weights_, {}};
    out.aux = aux_losses(probs_, idx_, logits_, seq_len, aux_weights(), aux_state_, world_.get());
    if (recompute_) logits_ = scores_ = probs_ = Tensor();  // [T, E] each; the sums stay
    return out;
  }

  Tensor backward(const Tensor& d_topk_weight) override {
    return router_.backward(logits_grad(d_topk_weight));
  }
  void backward_add(const Tensor& d_topk_weight, Tensor& dx) override {
    router_.backward_add(logits_grad(d_topk_weight), dx);
  }

  void update_bias(std::span<const int64_t> load) override {
    XMOE_CHECK(static_cast<int64_t>(load.size()) == num_experts_,
               "[moe gate sigmoid] update_bias got {} loads for {} experts", load.size(),
               num_experts_);
    double total = 0;
    for (int64_t l : load) total += static_cast<double>(l);
    const double mean = total / static_cast<double>(num_experts_);
    std::vector<float> step(static_cast<size_t>(num_experts_));
    for (int64_t e = 0; e < num_experts_; ++e) {
      const double diff = mean - static_cast<double>(load[e]);
      step[e] = cfg_.bias_update_rate * static_cast<float>((diff > 0) - (diff < 0));
    }
    // The load is a host value anyway: on CUDA one small upload, then an add on the device.
    xmoe::ops::add_(bias_, Tensor::from_vector(step, {num_experts_}, bias_.device()));
  }

  Tensor* routing_bias() override { return &bias_; }
  void collect_parameters(std::vector<Parameter*>& out) override {
    out.push_back(&router_.weight());
  }
  std::string_view name() const override { return "sigmoid"; }
  void release() override {
    router_.release();
    logits_ = scores_ = idx_ = weights_ = wsums_ = probs_ = psums_ = Tensor();
  }

 private:
  /// d_topk_weight -> dlogits [T, E] f32 (the routing and the aux losses).
  Tensor logits_grad(const Tensor& d_topk_weight) {
    XMOE_CHECK(weights_.defined(), "[moe gate sigmoid] backward without a forward");
    if (!scores_.defined()) {  // router recompute: forward's ops on the kept x
      logits_ = router_.logits();
      scores_ = xmoe::ops::sigmoid(logits_);
      probs_ = xmoe::ops::renormalize_rows(scores_, 1.0f, psums_);
    }
    check_shape(d_topk_weight, weights_.shape(), "moe gate sigmoid", "d_topk_weight");
    const int64_t T = scores_.size(0);
    const Device dev = scores_.device();
    Tensor dscores = Tensor::zeros({T, num_experts_}, DType::f32, dev);
    xmoe::ops::put_along_rows_add(
        dscores, idx_,
        xmoe::ops::renormalize_rows_backward(weights_, wsums_, d_topk_weight, cfg_.routed_scaling));
    Tensor dprobs = Tensor::zeros({T, num_experts_}, DType::f32, dev);
    Tensor dlogits = Tensor::zeros({T, num_experts_}, DType::f32, dev);
    aux_losses_backward(logits_, aux_state_, aux_grad_weights(), dprobs, dlogits,
                        aux_grad_device_scale_);
    xmoe::ops::add_(dscores, xmoe::ops::renormalize_rows_backward(probs_, psums_, dprobs, 1.0f));
    xmoe::ops::add_(dlogits, xmoe::ops::sigmoid_backward(scores_, dscores));
    return dlogits;
  }

  /// Top-k of scores + bias, within the topk_groups best groups. Returns i32 [T, k].
  Tensor select(const Tensor& scores) {
    // The bias is a buffer, not a parameter: it follows the scores to their device on first use.
    if (bias_.device() != scores.device()) bias_ = bias_.to(scores.device());
    Tensor biased =
        xmoe::ops::moe_group_limited_scores(scores, bias_, cfg_.num_groups, cfg_.topk_groups);
    return xmoe::ops::topk(biased, top_k_).indices;
  }

  LinearRouter router_;
  Tensor bias_;  // [E] selection bias, updated by update_bias, not by the optimizer
  Tensor logits_, scores_, idx_, weights_, wsums_, probs_, psums_;
  AuxLossState aux_state_;
};

}  // namespace

std::unique_ptr<Gate> make_sigmoid_gate(const GateArgs& a) {
  return std::make_unique<SigmoidGate>(a);
}

}  // namespace xmoe::moe
