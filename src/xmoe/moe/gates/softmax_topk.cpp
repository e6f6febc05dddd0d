// softmax_topk: GShard (softmax over all E, then top-k) or Mixtral (top-k of the logits, then
// softmax over the k), with optional renormalisation. Router: logits = x @ W, W [d, E].
#include "xmoe/moe/gates/gates.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

namespace {

class SoftmaxTopkGate final : public Gate {
 public:
  SoftmaxTopkGate(const GateArgs& a, std::string_view name, SoftmaxRouting::Options o)
      : Gate(a), name_(name), router_(a), routing_(o) {}

  GateOutput forward(const Tensor& x, int64_t seq_len, const Tensor& fixed_idx) override {
    check_forward_args(x, seq_len, fixed_idx);
    GateOutput out = routing_.forward(router_.forward(x), seq_len, fixed_idx, world_.get());
    if (recompute_) routing_.drop_routing_tensors();
    return out;
  }

  Tensor backward(const Tensor& d_topk_weight) override {
    return router_.backward(logits_grad(d_topk_weight));
  }
  void backward_add(const Tensor& d_topk_weight, Tensor& dx) override {
    router_.backward_add(logits_grad(d_topk_weight), dx);
  }

  void collect_parameters(std::vector<Parameter*>& out) override {
    out.push_back(&router_.weight());
  }
  std::string_view name() const override { return name_; }
  void release() override {
    router_.release();
    routing_.release();
  }

 private:
  Tensor logits_grad(const Tensor& d_topk_weight) {
    if (!routing_.has_routing_tensors()) routing_.restore(router_.logits());
    return routing_.backward(d_topk_weight, aux_grad_scale_, aux_grad_device_scale_);
  }

  std::string name_;
  LinearRouter router_;
  SoftmaxRouting routing_;
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
      SoftmaxRouting::Options{c.top_k,
                              c.softmax_before_topk,
                              c.renormalize,
                              {c.aux_loss_weight, c.seq_aux_loss_weight, c.z_loss_weight}});
}

}  // namespace xmoe::moe
