#pragma once
// Internal: the built-in gates' factories (each in its own file) and the softmax routing that
// softmax_topk, switch and xmoe share.
#include <memory>

#include "xmoe/moe/gate.h"

namespace xmoe::moe {

std::unique_ptr<Gate> make_softmax_topk_gate(const GateArgs& args);
std::unique_ptr<Gate> make_sigmoid_gate(const GateArgs& args);
std::unique_ptr<Gate> make_switch_gate(const GateArgs& args);
std::unique_ptr<Gate> make_xmoe_gate(const GateArgs& args);

/// logits [T, E] f32 = x @ W, W "<prefix>.router.weight" [d, E] (initialised normal), in
/// moe.router_dtype: f32 operands, or operands rounded to bf16 with f32 accumulation (bf16 tensor
/// cores on CUDA, reading the weight's bf16 compute copy where the model keeps one; on the CPU
/// the rounded values multiplied in f32: the same numbers). Logits and gradients stay f32.
/// The f32 router on a GPU with bf16 activations splits each f32 operand into three bf16 terms
/// that sum to it exactly (x is bf16 already), so its GEMMs run on bf16 tensor cores with exact
/// products and f32 accumulation: f32 GEMMs' accuracy without an f32 copy of x.
class LinearRouter {
 public:
  explicit LinearRouter(const GateArgs& a);
  Parameter& weight() { return weight_; }
  /// x [T, d] f32 or bf16; keeps x itself (not the operand cast from it) for backward.
  Tensor forward(const Tensor& x);
  /// The logits of the last forward again, from the kept x (router recompute): the same bits.
  Tensor logits() const;
  /// dlogits [T, E] f32: weight.grad += x^T dlogits; returns dx [T, d] f32 = dlogits W^T.
  Tensor backward(const Tensor& dlogits);
  /// backward with dlogits W^T added into dx [T, d] (f32 or bf16) by the GEMM (beta = 1).
  void backward_add(const Tensor& dlogits, Tensor& dx);
  void release() { x_ = Tensor(); }

 private:
  /// t as the router's GEMMs read it (see the class comment).
  Tensor operand(const Tensor& t) const;
  /// The weight as the GEMMs read it.
  Tensor weight_operand() const;
  /// f32 router on bf16 activations on a GPU: the GEMMs run on bf16 tensor cores with the f32
  /// operands split into exact bf16 terms (as accurate as f32 GEMMs, no f32 copy of x).
  bool splits() const;
  /// weight.grad += x^T dlogits, then dlogits W^T: into *dx_into (added) where given, else
  /// returned as a new f32 tensor.
  Tensor backward_impl(const Tensor& dlogits, Tensor* dx_into);

  Parameter weight_;
  bool bf16_;
  Tensor x_;
};

/// logits [T, E] -> top-k routing through a softmax, with the aux losses.
///  softmax_before_topk: P = softmax(logits), select top-k of P, weights P[idx] (GShard, Switch)
///  else:                select top-k of logits, weights softmax over the k logits (Mixtral)
///  renormalize:         weights /= their sum (a no-op for the Mixtral form)
/// The balance losses use P = softmax(logits) over all E in both forms.
class SoftmaxRouting {
 public:
  struct Options {
    int64_t top_k = 2;
    bool softmax_before_topk = true;
    bool renormalize = true;
    AuxLossWeights aux;
  };
  explicit SoftmaxRouting(Options o) : o_(o) {}
  /// world: the statistics group of the aux losses (null = one process).
  GateOutput forward(const Tensor& logits, int64_t seq_len, const Tensor& fixed_idx,
                     comm::Group* world = nullptr);
  /// d_topk_weight [T, k] -> d logits [T, E] (weight path + aux losses, whose upstream
  /// gradient is aux_scale times aux_device_scale: Gate::set_aux_grad_scale).
  Tensor backward(const Tensor& d_topk_weight, float aux_scale = 1.0f,
                  const Tensor& aux_device_scale = Tensor());
  void release();
  /// Router recompute: frees logits and probs [T, E]; restore() takes the same logits again and
  /// recomputes probs, before backward. The choice, weights and aux statistics stay.
  void drop_routing_tensors() { logits_ = probs_ = Tensor(); }
  void restore(const Tensor& logits);
  bool has_routing_tensors() const { return logits_.defined(); }

 private:
  Options o_;
  Tensor logits_, probs_, idx_, weights_, sums_;
  AuxLossState aux_state_;
};

}  // namespace xmoe::moe

namespace xmoe::moe {
/// A linear router (logits = x @ W, W "<prefix>.router.weight" [d, E]) with softmax routing;
/// softmax_topk and switch are this with different options.
std::unique_ptr<Gate> make_linear_softmax_gate(const GateArgs& a, std::string_view name,
                                               SoftmaxRouting::Options o);
}  // namespace xmoe::moe
