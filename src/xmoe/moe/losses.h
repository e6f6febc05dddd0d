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
#include <cstdint>
#include <vector>

#include "xmoe/core/tensor.h"

namespace xmoe::moe {

struct AuxLossWeights {
  float load_balance = 0.f;
  float seq_balance = 0.f;
  float z_loss = 0.f;
  /// The same weights times s (the aux losses' upstream gradient, e.g. 1/grad_accum).
  AuxLossWeights scaled(float s) const { return {load_balance * s, seq_balance * s, z_loss * s}; }
};

/// Unweighted values of the last forward and their weighted sum.
struct AuxLossTerms {
  double load_balance = 0;
  double seq_balance = 0;
  double z_loss = 0;
  double weighted = 0;
};

/// What aux_losses_backward needs from the forward (the counted fractions).
struct AuxLossState {
  int64_t tokens = 0, experts = 0, top_k = 0, seq_len = 0;
  std::vector<double> frac;      ///< [E] f_e
  std::vector<double> seq_frac;  ///< [S, E] f_{s,e}
};

/// probs [T, E] (the differentiable router probabilities the balance losses use), topk_idx i32
/// [T, k], z_logits [T, E] (the logits of the z-loss), seq_len dividing T.
AuxLossTerms aux_losses(const Tensor& probs, const Tensor& topk_idx, const Tensor& z_logits,
                        int64_t seq_len, const AuxLossWeights& w, AuxLossState& state);

/// Adds d(weighted aux loss)/d probs into dprobs [T, E] and d/d z_logits into dlogits [T, E].
void aux_losses_backward(const Tensor& z_logits, const AuxLossState& state,
                         const AuxLossWeights& w, Tensor& dprobs, Tensor& dlogits);

}  // namespace xmoe::moe
