#pragma once
// Router auxiliary losses, shared by the gates. Each is multiplied by its weight from MoeConfig
// inside the gate (0 disables it); the trainer adds MoELayer::aux_loss() to the reported loss.
//
//   load balance (GShard/Switch):  L_lb  = E * sum_e f_e * P_e
//       f_e = fraction of the T*k routed slots that went to e (counted, not differentiated)
//       P_e = mean over tokens of the router probability of e
//   sequence-level balance:        L_seq = mean over sequences s of E * sum_e f_{s,e} * P_{s,e}
//       (the same, within each sequence of seq_len tokens; DeepSeek-V3's complementary loss)
//   router z-loss (ST-MoE):        L_z   = mean_t logsumexp(logits_t)^2
// A perfectly balanced router has L_lb = L_seq = 1.
//
// Over several ranks (data parallelism: each rank holds T_r of the T_g tokens of the global
// batch), every statistic is taken over the GLOBAL batch, so N ranks train exactly like one
// process of T_g tokens. Convention: the objective is the mean over ranks of each rank's loss
// (each rank's cross-entropy is a mean over its tokens; the trainer averages gradients over the
// W ranks of the world), so each rank's aux term is defined by its gradient:
//
//   d aux_r / d probs_r := W * d aux_global / d probs_r      (probs_r: this rank's tokens)
//
// Then (1/W) sum_r (router gradient of rank r) = d aux_global / d router, as one process gets.
// With the global sums (counts_e, sum_t P[t,e], T_g, S_g, sum_t lse_t^2, per-sequence terms)
// all-reduced over the world in forward:
//   L_lb:  dP[t,e] = w * E * f_e / (T_g / W),  f_e = count_e / (T_g k) (global counts)
//   L_seq: dP[t,e] = w * E * f_{s,e} / (seq_len * S_g / W)   (sequences are local)
//   L_z:   dlogit  = w * 2 lse_t softmax_t / (T_g / W)
// With equal T_r (T_g = W T_r) the seq and z gradients are exactly the local ones: those losses
// are per-sequence/per-token means and average correctly when computed locally; the load-
// balance loss is not (f_e and P_e are products of global means) and needs the reduction.
// The reported values (AuxLossTerms) are the global ones, the same on every rank.
#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "xmoe/comm/group.h"
#include "xmoe/core/tensor.h"

namespace xmoe::moe {

struct AuxLossWeights {
  float load_balance = 0.f;
  float seq_balance = 0.f;
  float z_loss = 0.f;
  /// The same weights times s (the aux losses' upstream gradient, e.g. 1/grad_accum).
  AuxLossWeights scaled(float s) const { return {load_balance * s, seq_balance * s, z_loss * s}; }
};

/// Unweighted values of the last forward and their weighted sum. From CUDA inputs they stay on
/// the device until first read, so the layer's forward makes no host wait for them.
class AuxLossTerms {
 public:
  AuxLossTerms() = default;
  AuxLossTerms(double load_balance, double seq_balance, double z_loss, double weighted)
      : values_{load_balance, seq_balance, z_loss, weighted} {}
  /// f64 [4]: load balance, sequence balance, z-loss, weighted sum. A CPU tensor is read at
  /// once (nothing is kept); a CUDA one on the first read.
  explicit AuxLossTerms(Tensor terms);

  double load_balance() const { return value(0); }
  double seq_balance() const { return value(1); }
  double z_loss() const { return value(2); }
  double weighted() const { return value(3); }
  /// The four values (load balance, sequence balance, z-loss, weighted sum) as f64 [4] where
  /// they are: on the device until first read (taking them makes no host wait), else on the
  /// host.
  Tensor as_tensor() const;

 private:
  double value(int i) const;  ///< copies the device values to the host on the first call

  mutable std::array<double, 4> values_{};
  mutable Tensor device_;
};

/// What aux_losses_backward needs from the forward, on the inputs' device (from
/// ops::moe_aux_stats and ops::moe_aux_finalize).
struct AuxLossState {
  int64_t tokens = 0, experts = 0, top_k = 0, seq_len = 0;  ///< this rank's T
  Tensor frac;       ///< [E] f_e over the global batch: f64 on the CPU, f32 on CUDA
  Tensor seq_count;  ///< f32 [S, E] pairs of each of this rank's sequences routed to each expert
  /// f64 [3] gradient denominators: T_g / W, seq_len * S_g / W, T_g / W (T, seq_len * S, T
  /// alone).
  Tensor denoms;
};

/// Sums `values` over the ranks of `group` in double, identically on every rank (the partial
/// sums are all-gathered bit for bit and added in rank order). No-op for null or one rank.
/// The values travel where the group's tensors live (an NCCL group: uploaded, gathered on the
/// device, read back once). One all_gather, not an all_reduce: the sum is in a fixed order.
void all_sum_f64(comm::Group* group, std::span<double> values);

/// probs [T, E] (the differentiable router probabilities the balance losses use), topk_idx i32
/// [T, k], z_logits [T, E] (the logits of the z-loss), seq_len dividing T. `world` (null = one
/// process) is the group whose tokens form the global batch: one collective per call, which
/// every rank of it must make.
/// The statistics are reduced where the tensors live (ops::moe_aux_stats), gathered over
/// `world` (on the GPU where it is an NCCL group; an MPI group copies CUDA statistics through
/// the host: one wait) and summed in rank order (ops::moe_aux_finalize); the terms, f_e and the
/// denominators stay on the inputs' device, so on CUDA a single process or an NCCL world makes
/// no host wait.
AuxLossTerms aux_losses(const Tensor& probs, const Tensor& topk_idx, const Tensor& z_logits,
                        int64_t seq_len, const AuxLossWeights& w, AuxLossState& state,
                        comm::Group* world = nullptr);

/// Adds d(weighted aux loss)/d probs into dprobs [T, E] and d/d z_logits into dlogits [T, E].
/// device_scale (f32, one element, on the inputs' device; undefined: 1) multiplies w where the
/// kernels run: an upstream gradient that is still on the GPU costs no host wait.
void aux_losses_backward(const Tensor& z_logits, const AuxLossState& state, const AuxLossWeights& w,
                         Tensor& dprobs, Tensor& dlogits, const Tensor& device_scale = Tensor());

/// dlogits [T, E] of the GShard softmax routing (P = softmax(z_logits), weights P[idx], their
/// gradient dv [T, k]) with the aux losses' terms: what put_along_rows_add, aux_losses_backward,
/// softmax_backward and the add give, in one pass on CUDA (ops::moe_softmax_routing_backward).
Tensor softmax_routing_backward(const Tensor& probs, const Tensor& idx, const Tensor& dv,
                                const Tensor& z_logits, const AuxLossState& state,
                                const AuxLossWeights& w, const Tensor& device_scale = Tensor());

}  // namespace xmoe::moe
