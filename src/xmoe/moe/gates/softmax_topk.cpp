// softmax_topk: GShard (softmax over all E, then top-k) or Mixtral (top-k of the logits, then
// softmax over the k), with optional renormalisation. Router: logits = x @ W, W [d, E].
#include "xmoe/moe/gates/gates.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

namespace {

class SoftmaxTopkGate final : public Gate {
 public:
  SoftmaxTopkGate(const GateArgs& a, std::string_view name, SoftmaxRouting::Options o)
      : Gate(a), name_(name), routing_(o) {
    weight_ = Parameter::make(prefix_ + ".router.weight", {d_model_, num_experts_});
    weight_.init_normal(a.seed, a.init_std);
  }

  GateOutput forward(const Tensor& x, int64_t seq_len, const Tensor& fixed_idx) override {
    check_forward_args(x, seq_len, fixed_idx);
    x_ = x;
    return routing_.forward(xmoe::ops::matmul(x, weight_.value), seq_len, fixed_idx,
                            world_.get());
  }

  Tensor backward(const Tensor& d_topk_weight) override {
    Tensor dlogits = routing_.backward(d_topk_weight, aux_grad_scale_);                      // [T, E]
    xmoe::ops::matmul_into(weight_.grad, x_, dlogits, true, false, 1.f, 1.f);  // dW += x^T dl
    return xmoe::ops::matmul(dlogits, weight_.value, false, true);          // dx = dl W^T
  }

  void collect_parameters(std::vector<Parameter*>& out) override { out.push_back(&weight_); }
  std::string_view name() const override { return name_; }
  void release() override {
    x_ = Tensor();
    routing_.release();
  }

 private:
  std::string name_;
  SoftmaxRouting routing_;
  Parameter weight_;
  Tensor x_;
};

}  // namespace

std::unique_ptr<Gate> make_linear_softmax_gate(const GateArgs& a, std::string_view name,
                                               SoftmaxRouting::Options o) {
  return std::make_unique<SoftmaxTopkGate>(a, name, o);
}

std::unique_ptr<Gate> make_softmax_topk_gate(const GateArgs& a) {
  const MoeConfig& c = a.config;
  return make_linear_softmax_gate(
      a, "softmax_topk",
      SoftmaxRouting::Options{c.top_k, c.softmax_before_topk, c.renormalize,
                              {c.aux_loss_weight, c.seq_aux_loss_weight, c.z_loss_weight}});
}

}  // namespace xmoe::moe
