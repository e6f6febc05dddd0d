#pragma once
// The feed-forward half of a block, behind one small interface so that a block holds either a
// dense SwiGLU FFN or the MoE layer (model/moe_ffn.h) without knowing which.
#include <string>

#include "xmoe/comm/group.h"
#include "xmoe/core/activation_bytes.h"
#include "xmoe/core/parameter.h"
#include "xmoe/model/embedding.h"

namespace xmoe::moe {
class MoELayer;
}

namespace xmoe::model {

/// The parallel layout a block's activation formulas need (train/memory_model.h): every rank
/// of a tp group works on 1/tp of the micro-batch's tokens (docs/training.md, "Tensor
/// parallelism").
struct ActivationLayout {
  int tp = 1;        ///< parallel.tp
  bool ssmb = true;  ///< parallel.ssmb: the MoE layer routes this rank's 1/tp of the tokens
  int ep = 1;        ///< parallel.ep
  /// With ep > 1, the busiest rank's experts receive this many times the expected T·k rows.
  double load_imbalance = 1.25;
  /// Attention backward's scratch per layer (ops::attention_backward_workspace_bytes): cuDNN's
  /// workspace on a GPU, which no formula gives.
  int64_t attention_workspace = 0;
  /// train.grad_accum > 1: the experts keep their derived weights (FP8 copies) across the
  /// micro-batches of a step (moe::Experts::keep_weights), held past their backward.
  bool expert_weights_kept = false;
};

class FeedForward : public Module {
 public:
  /// x [T, d] -> [T, d]; T = batch · seq_len tokens, sequence-major. x is in the model's
  /// compute dtype (f32, or bf16 on CUDA); the output may be x's dtype or f32 (the block casts).
  virtual Tensor forward(const Tensor& x, int64_t seq_len) = 0;
  /// dy [T, d] -> dx; accumulates parameter gradients; releases what forward saved.
  virtual Tensor backward(const Tensor& dy) = 0;
  /// Frees what forward saved (forward-only use, e.g. evaluation).
  virtual void release() = 0;
  /// Drop saved activations after forward and recompute them in backward.
  virtual void set_recompute(bool on) = 0;
  /// Bytes currently held for backward.
  virtual int64_t saved_bytes() const = 0;
  /// Weighted auxiliary loss of the last forward (0 for dense).
  virtual float aux_loss() const { return 0.f; }
  /// The MoE layer inside, or null for a dense FFN.
  virtual moe::MoELayer* moe_layer() { return nullptr; }
};

/// SwiGLU FFN: y = (silu(x Wg) * x Wu) Wd with a fused gate|up weight.
/// Tensor parallelism over a tp group of P ranks: this rank holds hidden units [t·h/P,
/// (t+1)·h/P) (gate_up's columns of those units, gate and up, and down's rows); its input, its
/// slice [T/P, d] of the tokens, is gathered to [T, d] and the partial outputs reduce-scattered
/// back to [T/P, d] (backward: the mirror), as in model/attention.h.
class DenseFFN : public FeedForward {
 public:
  /// Parameters "<prefix>.gate_up" [d, 2h] ~ N(0, init_std^2), "<prefix>.down" [h, d] ~
  /// N(0, out_std^2); with `tp`, this rank's shards of them (P must divide h).
  DenseFFN(std::string prefix, int64_t d_model, int64_t hidden, uint64_t seed, float init_std,
           float out_std, std::shared_ptr<comm::Group> tp = nullptr);

  /// Saves x (shared with the caller) and, unless recompute is on, h = x gate_up [T, 2h]:
  /// T·2h floats. The SwiGLU output silu(g)·u is recomputed from h in backward (elementwise).
  Tensor forward(const Tensor& x, int64_t seq_len) override;
  Tensor backward(const Tensor& dy) override;
  void release() override { x_ = h_ = Tensor(); }
  void set_recompute(bool on) override { recompute_ = on; }
  int64_t saved_bytes() const override { return held_bytes(x_) + held_bytes(h_); }
  /// What forward saves (x, and h unless recompute) for `tokens` rows in `dtype`; backward adds
  /// silu(g)·u or its gradient [T, hidden] (one at a time), its f32 dx and, with recompute, h.
  /// With tensor parallelism over `tp` ranks, `tokens` is the whole micro-batch's (gathered)
  /// and `hidden` the whole FFN's (this rank holds hidden/tp units); backward also holds the
  /// gathered dy [T, d].
  static ActivationBytes activation_bytes_for(int64_t tokens, int64_t d_model, int64_t hidden,
                                              DType dtype, bool recompute, int tp = 1);
  void collect_parameters(std::vector<Parameter*>& out) override;

  Parameter& gate_up() { return gate_up_; }
  Parameter& down() { return down_; }

 private:
  std::shared_ptr<comm::Group> tp_;
  Parameter gate_up_, down_;
  bool recompute_ = false;
  Tensor x_, h_;  // x_: gathered [T, d]
};

}  // namespace xmoe::model
