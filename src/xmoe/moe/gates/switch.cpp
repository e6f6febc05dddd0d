// switch (Fedus et al. 2021): top-1 of softmax(x @ W), weighted by its probability.
#include "xmoe/moe/gates/gates.h"

namespace xmoe::moe {

std::unique_ptr<Gate> make_switch_gate(const GateArgs& a) {
  // Switch Transformer: top-1 of the softmax, weighted by its probability (no renormalisation).
  XMOE_CHECK(a.config.top_k == 1, "[moe] moe.gate = 'switch' routes top-1, but moe.top_k = {}",
             a.config.top_k);
  const MoeConfig& c = a.config;
  return make_linear_softmax_gate(
      a, "switch",
      SoftmaxRouting::Options{
          1, true, false, {c.aux_loss_weight, c.seq_aux_loss_weight, c.z_loss_weight}});
}

}  // namespace xmoe::moe
