#include "xmoe/moe/gate.h"

#include "xmoe/moe/gates/gates.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

Gate::Gate(const GateArgs& args)
    : cfg_(args.config),
      prefix_(args.prefix),
      world_(args.world),
      num_experts_(args.config.num_experts),
      top_k_(args.config.top_k),
      d_model_(args.d_model) {
  XMOE_CHECK(num_experts_ >= 1, "[moe] moe.num_experts = {} must be >= 1", num_experts_);
  XMOE_CHECK(top_k_ >= 1, "[moe] moe.top_k = {} must be >= 1", top_k_);
  XMOE_CHECK(top_k_ <= num_experts_, "[moe] moe.top_k = {} exceeds moe.num_experts = {}", top_k_,
             num_experts_);
  XMOE_CHECK(d_model_ >= 1, "[moe] d_model = {} must be >= 1", d_model_);
}

int64_t Gate::check_forward_args(const Tensor& x, int64_t seq_len, const Tensor& fixed_idx) const {
  const std::string op = fmt::format("moe gate {}", name());
  // f32 or bf16 rows: each router casts its operands (and keeps x as it came, not a copy)
  if (x.dtype() != DType::bf16) check_dtype(x, DType::f32, op.c_str(), "x");
  check_shape(x, {-1, d_model_}, op.c_str(), "x");
  const int64_t T = x.size(0);
  XMOE_CHECK(seq_len >= 1 && T % seq_len == 0, "[{}] {} tokens are not a multiple of seq_len = {}",
             op, T, seq_len);
  if (fixed_idx.defined()) {
    check_dtype(fixed_idx, DType::i32, op.c_str(), "fixed_idx");
    check_shape(fixed_idx, {T, top_k_}, op.c_str(), "fixed_idx");
    xmoe::ops::check_same_device(op.c_str(), "fixed_idx", fixed_idx, "x", x);
    if (fixed_idx.is_cpu()) {
      for (int32_t e : fixed_idx.span<int32_t>())
        XMOE_CHECK(e >= 0 && e < num_experts_, "[{}] fixed_idx holds expert {} outside [0, {})", op,
                   e, num_experts_);
    } else {  // a scan on the device and one copy back (frozen routing only)
      xmoe::ops::check_index_values(op.c_str(), "fixed_idx", fixed_idx, num_experts_, false);
    }
  }
  return T;
}

void Gate::backward_add(const Tensor& d_topk_weight, Tensor& dx) {
  xmoe::ops::add_(dx, backward(d_topk_weight));
}

AuxLossWeights Gate::aux_weights() const {
  return {cfg_.aux_loss_weight, cfg_.seq_aux_loss_weight, cfg_.z_loss_weight};
}

GateRegistry& gate_registry() {
  static GateRegistry registry = [] {
    GateRegistry r("moe.gate");
    r.add("softmax_topk", make_softmax_topk_gate);
    r.add("sigmoid", make_sigmoid_gate);
    r.add("switch", make_switch_gate);
    r.add("xmoe", make_xmoe_gate);
    return r;
  }();
  return registry;
}

std::unique_ptr<Gate> make_gate(const GateArgs& args) {
  return gate_registry().create(args.config.gate, args);
}

int64_t gate_saved_bytes_for(const MoeConfig& c, int64_t tokens, bool recompute) {
  const int64_t te = tokens * c.num_experts * 4, choice = tokens * c.top_k * 8;  // idx, weights
  const int64_t rows = tokens * 4;                                               // a per-token sum
  // sigmoid: logits, scores, probs; the weights' and the probabilities' sums
  if (c.gate == "sigmoid") return (recompute ? 0 : 3 * te) + choice + 2 * rows;
  // softmax routing: logits, probs (+ the renormalisation sums)
  const int64_t softmax =
      (recompute ? 0 : 2 * te) + choice + (c.renormalize && c.softmax_before_topk ? rows : 0);
  if (c.gate == "xmoe" && !recompute)
    return softmax + te + tokens * c.router_dim * 4 + rows;  // cos, z, |z|
  return softmax;
}

int64_t gate_backward_bytes_for(const MoeConfig& c, int64_t tokens, bool recompute) {
  const int64_t dropped =
      recompute ? gate_saved_bytes_for(c, tokens, false) - gate_saved_bytes_for(c, tokens, true)
                : 0;
  return 2 * tokens * c.num_experts * 4 + dropped;
}

}  // namespace xmoe::moe
