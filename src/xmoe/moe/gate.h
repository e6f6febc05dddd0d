#pragma once
// Stage 1, Gate: x [T, d] -> topk_idx i32 [T, k], topk_weight f32 [T, k], aux losses.
// Gates by name (moe.gate): softmax_topk, sigmoid, switch, xmoe; see docs/moe.md.
//
// Routing (which k experts) is discrete: it has no gradient, and a finite-difference check only
// agrees with backward while the selection stays put. forward(..., fixed_idx) reuses a given
// selection and recomputes only the (differentiable) weights and losses — that is how gradient
// checks and MoELayer::set_frozen_routing hold routing fixed.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "xmoe/config/config.h"
#include "xmoe/core/parameter.h"
#include "xmoe/moe/losses.h"
#include "xmoe/moe/registry.h"

namespace xmoe::moe {

struct GateOutput {
  Tensor topk_idx;     ///< i32 [T, k], expert ids
  Tensor topk_weight;  ///< f32 [T, k], combine weights
  AuxLossTerms aux;    ///< unweighted terms and their weighted sum (aux.weighted())
};

/// What a gate factory gets.
struct GateArgs {
  MoeConfig config;
  int64_t d_model = 0;
  std::string prefix;  ///< parameter names start with "<prefix>.router."
  uint64_t seed = 0;
  float init_std = 0.02f;
  /// Ranks whose tokens form the global batch: the aux losses' statistics are summed over it
  /// (parallel::Layout::world). Null = one process.
  std::shared_ptr<comm::Group> world;
};

class Gate : public Module {
 public:
  explicit Gate(const GateArgs& args);

  /// x [T, d] f32 or bf16 (the router computes in moe.router_dtype either way); T must be a
  /// multiple of seq_len (sequences for the sequence-level loss).
  /// fixed_idx (i32 [T, k]), when defined, replaces the gate's own expert selection.
  virtual GateOutput forward(const Tensor& x, int64_t seq_len,
                             const Tensor& fixed_idx = Tensor()) = 0;
  /// d_topk_weight [T, k] -> dx [T, d]; accumulates the router's parameter gradients, including
  /// those of the weighted aux losses of the last forward.
  virtual Tensor backward(const Tensor& d_topk_weight) = 0;
  /// backward with its dx added into `dx` [T, d] (the layer's input gradient so far, in its
  /// dtype, each element rounded once): the linear routers add in their GEMM's epilogue, where
  /// a [T, d] f32 result and a pass to add it would cost three times the bytes.
  virtual void backward_add(const Tensor& d_topk_weight, Tensor& dx);
  /// Upstream gradient of the aux losses in the next backward (default 1): the trainer's
  /// loss scale, e.g. 1/grad_accum, so the aux term is weighted like the cross-entropy; times
  /// device_scale where defined (f32, one element, on the layer's device: read by the kernels,
  /// so a gradient still on the GPU, as PyTorch's autograd gives it, costs no host wait).
  void set_aux_grad_scale(float s, Tensor device_scale = Tensor()) {
    aux_grad_scale_ = s;
    aux_grad_device_scale_ = std::move(device_scale);
  }
  /// Aux-loss-free balancing (sigmoid gate): bias_e += rate * sign(mean_load - load_e).
  /// `load` is the routed slots per expert of the last step. A no-op for other gates.
  virtual void update_bias(std::span<const int64_t> load) {}
  /// The selection bias [E] (a buffer, not trained by the optimizer), or nullptr.
  virtual Tensor* routing_bias() { return nullptr; }
  virtual std::string_view name() const = 0;
  /// Frees what forward saved for backward.
  virtual void release() = 0;
  /// Router recompute (model.recompute "router"): forward drops its [T, E] routing tensors
  /// (logits, probabilities, scores) and backward recomputes them from the kept input x with the
  /// same ops (the same bits). The expert choice, the combine weights and the aux-loss
  /// statistics are kept, so backward makes no second collective.
  void set_recompute(bool on) { recompute_ = on; }
  bool recompute() const { return recompute_; }

  int64_t num_experts() const { return num_experts_; }
  int64_t top_k() const { return top_k_; }
  int64_t d_model() const { return d_model_; }

 protected:
  /// Checks x [T, d_model], seq_len and fixed_idx; returns T.
  int64_t check_forward_args(const Tensor& x, int64_t seq_len, const Tensor& fixed_idx) const;
  AuxLossWeights aux_weights() const;

  /// aux_weights() times the aux-gradient scale, for backward.
  AuxLossWeights aux_grad_weights() const { return aux_weights().scaled(aux_grad_scale_); }

  MoeConfig cfg_;
  std::string prefix_;
  std::shared_ptr<comm::Group> world_;  // statistics group (null = one process)
  float aux_grad_scale_ = 1.0f;
  Tensor aux_grad_device_scale_;  // set_aux_grad_scale's device factor (undefined: 1)
  bool recompute_ = false;
  int64_t num_experts_, top_k_, d_model_;
};

using GateRegistry = Registry<Gate, const GateArgs&>;
/// The gate registry, holding the built-in gates; add your own with gate_registry().add().
GateRegistry& gate_registry();
/// Creates args.config.gate (an unknown name throws, listing the known gates).
std::unique_ptr<Gate> make_gate(const GateArgs& args);

/// Bytes the gate named by config.gate keeps from forward to backward for `tokens` tokens: its
/// f32 [T, E] routing tensors and [T, k] choice (the router's input is the layer's, counted by
/// the layer); with `recompute` (Gate::set_recompute) only the choice, the combine weights and
/// the per-token sums. Its backward holds about as much again (gate_backward_bytes_for).
int64_t gate_saved_bytes_for(const MoeConfig& config, int64_t tokens, bool recompute = false);
/// The gate's backward temporaries: d logits and the softmax/aux-loss gradients [T, E] (f32),
/// and with `recompute` the routing tensors forward dropped.
int64_t gate_backward_bytes_for(const MoeConfig& config, int64_t tokens, bool recompute = false);

}  // namespace xmoe::moe
