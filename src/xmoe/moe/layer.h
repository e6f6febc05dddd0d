#pragma once
// MoELayer: the six stages composed, FSMoE-style, with hooks on what each hands the next.
//
//   forward:  gate -> order -> dispatch -> expert -> combine -> iorder   (+ shared experts)
//   backward: shared, iorder, combine, expert, dispatch, order, gate     (reverse)
//
// Every stage is created by name (moe.gate, moe.impl, moe.dispatch) and owns what it saves for
// backward; what one stage hands the next is a struct of moe/stages.h. See docs/moe.md for the
// data layout and the options.
//
// Parallel context (LayerGroups, world = dp x ep): this rank holds experts
// [first_expert, first_expert + E/ep) of the ep group; dispatch moves rows over the ep group;
// the aux-loss statistics and the sigmoid gate's expert load are summed over the world, so that
// W ranks train like one process of the global batch. Gradient convention (docs/moe.md):
// backward gives W x d(global objective)/d(local tensor) for this rank's activations; the
// trainer must
//   dense params (router, shared experts): sum over the world, then / W;
//   expert params:                         sum over the expert's replicas (dp), then / W.
// Every forward/backward/update_routing_bias makes collectives: all ranks call them together.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"
#include "xmoe/core/activation_bytes.h"
#include "xmoe/core/parameter.h"
#include "xmoe/core/side_stream.h"
#include "xmoe/moe/dispatch.h"
#include "xmoe/moe/expert.h"
#include "xmoe/moe/expert_permutation.h"
#include "xmoe/moe/gate.h"
#include "xmoe/moe/hooks.h"
#include "xmoe/moe/iorder.h"
#include "xmoe/moe/order.h"
#include "xmoe/moe/placement.h"
#include "xmoe/moe/shared.h"
#include "xmoe/moe/stages.h"

namespace xmoe::moe {

/// The communicators a MoELayer uses; null = one process. A run's parallel::Layout holds them:
/// {layout.world, layout.ep_group}.
struct LayerGroups {
  /// Every rank: the aux-loss statistics, the sigmoid gate's expert load and the co-activation
  /// counts are summed over it.
  std::shared_ptr<comm::Group> world;
  /// The ranks that split the experts (rank r holds experts [r E/ep, (r + 1) E/ep)): dispatch and
  /// combine move rows over it, permute_experts moves experts.
  std::shared_ptr<comm::Group> ep;
};

/// What a MoE layer recomputes in backward instead of keeping (model.recompute "moe", "router").
struct LayerRecompute {
  bool experts = false;  ///< the experts' gate_up output h [N, 2f]
  bool router = false;   ///< the gate's [T, E] routing tensors (Gate::set_recompute)
};

class MoELayer : public Module {
 public:
  /// Router and expert weights ~ N(0, init_std^2) from (seed, parameter name), so the same
  /// however experts are sharded; the down projections (routed and shared) use down_std when
  /// given (the model passes init_std / sqrt(2 * num_layers)). Parameter names start with prefix.
  /// groups: the parallel context (none = one process). With an ep group of ep > 1 ranks,
  /// moe.dispatch must be a comm dispatcher (all_to_all, rbd) and ep must divide
  /// moe.num_experts.
  MoELayer(const MoeConfig& config, int64_t d_model, std::string prefix, uint64_t seed,
           float init_std, std::optional<float> down_std = std::nullopt, LayerGroups groups = {});
  ~MoELayer() override;

  /// x [T, d] -> y [T, d]; T must be a multiple of seq_len (sequences, for the sequence-level
  /// balance loss). Saves what backward needs.
  Tensor forward(const Tensor& x, int64_t seq_len);
  /// dy [T, d] -> dx [T, d]. Accumulates every parameter's gradient, including the router's
  /// through the combine weights and the weighted aux losses (whose upstream gradient is 1:
  /// the trainer adds aux_loss() to the loss). Frees the saved activations.
  Tensor backward(const Tensor& dy);
  /// What forward saves and backward adds for `tokens` tokens of width d_model in `dtype`,
  /// from the stages' own layouts (docs/moe.md, "Activation memory"). Routing is data-dependent:
  /// the formula takes the expected N = T·k rows (padded: E·C); with ep > 1 the experts of the
  /// busiest rank receive load_imbalance × N rows and keep them (no re-gather), and dispatch's
  /// backward sends d_rows back. Saved: the gate's routing tensors, the PFT layout (16 bytes a
  /// row), the experts' h [N, 2f] (not with recompute.experts), their output [N, d] for the
  /// I-Order, the shared experts' h [T, 2Sf] (the input x is the caller's norm output, counted
  /// here). weights_kept (Experts::keep_weights across micro-batches): the derived weights (FP8
  /// copies) stay past backward, in `kept`.
  static ActivationBytes activation_bytes_for(const MoeConfig& config, int64_t d_model,
                                              int64_t tokens, int ep, DType dtype,
                                              LayerRecompute recompute, double load_imbalance,
                                              bool weights_kept = false);
  /// Upstream gradient of the aux losses in backward (default 1). The model sets it to its loss
  /// scale (e.g. 1/grad_accum) so the aux term is weighted like the cross-entropy. Times
  /// device_scale where defined (Gate::set_aux_grad_scale: a factor on the device, no host wait).
  void set_aux_grad_scale(float s, Tensor device_scale = Tensor()) {
    aux_grad_scale_ = s;
    aux_grad_device_scale_ = std::move(device_scale);
  }
  /// Frees what the last forward saved. A forward released without a backward (evaluation)
  /// does not count toward the routing-bias update.
  void release();

  /// Weighted sum of the aux losses of the last forward, over the global batch (the same value
  /// on every rank, equal to what one process of the whole batch reports).
  float aux_loss() const { return static_cast<float>(aux_.weighted()); }
  /// The unweighted global terms (load_balance, seq_balance, z_loss) of the last forward.
  const AuxLossTerms& aux_terms() const { return aux_; }

  /// Sigmoid gate: bias_e += rate * sign(mean_load - load_e) from the load routed since the last
  /// call (all micro-batches of the step), summed over the world group first (one all_reduce), so
  /// every rank applies the same bias. A no-op for other gates. Call after the optimizer step.
  void update_routing_bias();

  /// (token, slot) pairs of this rank's tokens each expert processed in the last forward [E].
  const std::vector<int64_t>& tokens_per_expert() const { return tokens_per_expert_; }
  /// Pairs of this rank's tokens routed to each expert in the last forward, before any capacity
  /// drop [E] (local: sum over the world for the global load).
  const std::vector<int64_t>& expert_load() const { return load_; }
  /// Pairs dropped for lack of capacity in the last forward (padded impl only; PFT drops none).
  int64_t dropped_tokens() const { return dropped_; }

  /// While on, forward reuses the last forward's topk_idx (the expert choice) and recomputes
  /// only the weights and losses: routing is discrete, so gradient checks must hold it fixed.
  void set_frozen_routing(bool on) { frozen_routing_ = on; }
  bool frozen_routing() const { return frozen_routing_; }
  /// Recompute in backward instead of saving the experts' gate_up output h [N, 2f]. (Their
  /// input rows are never kept where one process holds every expert and no hook replaced them:
  /// they are gathered again from x by the saved layout.)
  /// The experts never keep their SwiGLU output silu(g)·u [N, f] (Megatron's "moe_act"
  /// recompute, always on): backward recomputes it from h.
  void set_recompute(bool on) { experts_->set_recompute(on); }
  /// Recompute the gate's [T, E] routing tensors in backward (Gate::set_recompute).
  void set_router_recompute(bool on) { gate_->set_recompute(on); }

  /// The experts' [N, f] activations in this many row chunks (moe.expert_chunks; 0: auto).
  void set_expert_chunks(int chunks) { experts_->set_chunks(chunks); }

  /// The pipelined layer (model.moe.pipeline, docs/pipeline.md): forward runs Dispatch, Expert
  /// and Combine in `forward_chunks` chunks of local experts, backward their backwards in
  /// `backward_chunks`, each exchange overlapping the experts of another chunk; 1 = unchunked.
  /// At most E_local chunks are made. The results are bitwise those of 1 chunk. A pass runs
  /// unchunked while a hook sees its inner boundaries (DispatchOut, ExpertOut; CombineGrad,
  /// ExpertGrad), which exist only whole. Throws for a dispatcher that does not pipeline.
  void set_pipeline(int forward_chunks, int backward_chunks);
  int pipeline_forward() const { return pipeline_fwd_; }
  int pipeline_backward() const { return pipeline_bwd_; }
  /// Experts::keep_weights: the trainer keeps the experts' derived weights (FP8 copies) across
  /// the micro-batches of one optimizer step, and drops them before the update.
  void keep_expert_weights(bool keep) { experts_->keep_weights(keep); }

  /// Rebuilds the dispatcher with simulated nodes of `ranks_per_node` ep ranks (rbd; 0 = the
  /// group's topology). For tests and benchmarks on one machine; collective over the ep group.
  void set_ranks_per_node(int ranks_per_node);

  // ---- Expert placement (moe/placement.h) ----
  /// While on, every forward adds this rank's tokens' expert pairs to coactivation():
  /// C[a][b] += 1 for each token that chose both a and b (a != b, both orders), and C[e][e] += 1
  /// for each token that chose e. Costs O(T k^2) integer adds per forward.
  void set_record_coactivation(bool on) { record_coactivation_ = on; }
  /// This rank's counts since the last reset (local: see global_coactivation()).
  const CoactivationMatrix& coactivation() const { return coactivation_; }
  /// The counts summed over the world group (an i64 all_reduce: collective, every rank calls it).
  CoactivationMatrix global_coactivation() const;
  void reset_coactivation();
  /// Moves the experts: new expert s is old expert perm[s] (perm a permutation of [0, E), the
  /// same on every rank). Permutes the expert weights and their gradients (with ep > 1 the
  /// experts are all-gathered over the ep group, permuted, and this rank keeps its slice), the
  /// router's expert columns (router.weight [d, E]; xmoe: router.expert_embeddings [r, E]), the
  /// sigmoid gate's bias [E], the pending load and the co-activation counts, so the layer
  /// computes the same function (up to float summation order); and, in place, each rider of one
  /// of those parameters (e.g. the optimizer's moments; riders of other parameters are left
  /// alone). The sigmoid gate with num_groups > 1 accepts only permutations that map whole
  /// groups onto groups. Collective over the ep group (every rank passes riders of the same
  /// parameters in the same order). Saved activations are dropped (call between steps).
  void permute_experts(const std::vector<int>& perm, std::span<const ExpertRider> riders = {});

  /// Callbacks on what each stage hands the next, forward and backward (see hooks.h).
  Hooks& hooks() { return hooks_; }

  const MoeConfig& config() const { return cfg_; }
  const LayerGroups& groups() const { return groups_; }
  /// Rows this rank's experts processed in the last forward [E_local] (from every ep rank).
  const std::vector<int64_t>& local_expert_rows() const { return handle_.recv_tokens_per_expert; }
  const std::string& prefix() const { return prefix_; }
  int64_t d_model() const { return d_model_; }
  Gate& gate() { return *gate_; }
  Experts& experts() { return *experts_; }
  /// Layout of the last forward (freed by backward/release).
  const TokenLayout& layout() const { return order_->layout(); }

  void collect_parameters(std::vector<Parameter*>& out) override;

 private:
  /// The shared experts' side stream for this pass's device, or null where they run in line
  /// (moe.shared_overlap off, or the CPU).
  SideStream* shared_side();
  void make_dispatcher_(int ranks_per_node);
  void record_coactivation_pairs(const Tensor& topk_idx);

  MoeConfig cfg_;
  LayerGroups groups_;
  int ep_size_ = 1, ep_rank_ = 0;
  int64_t d_model_;
  std::string prefix_;
  std::unique_ptr<Gate> gate_;
  std::unique_ptr<Order> order_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::unique_ptr<Experts> experts_;
  IOrder iorder_;
  std::unique_ptr<SharedExperts> shared_;  // null when num_shared_experts = 0
  // The shared experts' stream beside the routed path (moe.shared_overlap, CUDA), taken on the
  // first pass that uses it: the device's one, which every MoE layer shares (they run in turn
  // and each joins it before it returns).
  std::shared_ptr<SideStream> shared_side_;
  bool shared_routing_only_ = false;  // moe.shared_overlap = routing: joined before the experts
  Hooks hooks_;

  // State of the last forward.
  Device device_;  // the activations' device in the current pass (for ProfileScope)
  DispatchHandle handle_;
  AuxLossTerms aux_;
  Tensor last_topk_idx_;
  bool gate_output_replaced_ = false;
  bool have_forward_ = false;
  std::vector<int64_t> tokens_per_expert_, load_, pending_load_;
  int64_t dropped_ = 0;
  bool frozen_routing_ = false;
  float aux_grad_scale_ = 1.0f;
  Tensor aux_grad_device_scale_;
  bool record_coactivation_ = false;
  CoactivationMatrix coactivation_;
  int pipeline_fwd_ = 1, pipeline_bwd_ = 1;
};

}  // namespace xmoe::moe
