#include "xmoe/moe/losses.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "xmoe/core/profile.h"
#include "xmoe/ops/moe.h"

namespace xmoe::moe {

AuxLossTerms::AuxLossTerms(Tensor terms) : device_(std::move(terms)) {
  if (device_.is_cpu()) value(0);
}

double AuxLossTerms::value(int i) const {
  if (device_.defined()) {
    const std::vector<double> v = device_.to_vector<double>();
    std::copy(v.begin(), v.end(), values_.begin());
    device_ = Tensor();
  }
  return values_[static_cast<size_t>(i)];
}

Tensor AuxLossTerms::as_tensor() const {
  if (device_.defined()) return device_;
  return Tensor::from_vector<double>(std::vector<double>(values_.begin(), values_.end()), {4});
}

void all_sum_f64(comm::Group* group, std::span<double> values) {
  if (group == nullptr || group->size() == 1 || values.empty()) return;
  const int64_t n = static_cast<int64_t>(values.size());
  static_assert(sizeof(double) == sizeof(int64_t));
  // The doubles' bits (all_gather moves bytes), where the group's tensors live (NCCL: the GPU).
  std::vector<int64_t> mine(static_cast<size_t>(n));
  std::memcpy(mine.data(), values.data(), values.size_bytes());
  const std::vector<int64_t> all =
      group->all_gather(Tensor::from_vector(mine, {1, n}, group->device())).to_vector<int64_t>();
  std::vector<double> bits(all.size());  // [W, n]
  std::memcpy(bits.data(), all.data(), all.size() * sizeof(int64_t));
  for (int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (int p = 0; p < group->size(); ++p) s += bits[static_cast<size_t>(p * n + i)];
    values[i] = s;
  }
}

AuxLossTerms aux_losses(const Tensor& probs, const Tensor& topk_idx, const Tensor& z_logits,
                        int64_t seq_len, const AuxLossWeights& w, AuxLossState& st,
                        comm::Group* world) {
  ProfileScope scope("moe.aux_loss.fwd", probs.device());
  // ops::moe_aux_stats checks the shapes and seq_len (the one place they are checked).
  const Device dev = probs.device();
  st = AuxLossState{};
  xmoe::ops::MoeAuxStats mine = xmoe::ops::moe_aux_stats(probs, topk_idx, z_logits, seq_len);
  st.tokens = probs.size(0);
  st.experts = probs.size(1);
  st.top_k = topk_idx.size(1);
  st.seq_len = seq_len;
  // This rank's sums (f64, held as i64 bits), then every rank's [W, 2E + 4]: on the GPU for an
  // NCCL world; an MPI world moves host tensors, which costs CUDA statistics this layer's one
  // wait.
  const int64_t W = world ? world->size() : 1;
  Tensor all = mine.stats;
  if (W > 1)
    all = world->device() == dev ? world->all_gather(mine.stats)
                                 : world->all_gather(mine.stats.to(world->device())).to(dev);
  xmoe::ops::MoeAuxTerms t =
      xmoe::ops::moe_aux_finalize(all, st.top_k, seq_len, w.load_balance, w.seq_balance, w.z_loss);
  st.frac = std::move(t.frac);
  st.seq_count = std::move(mine.seq_count);
  st.denoms = std::move(t.denoms);
  return AuxLossTerms(std::move(t.terms));
}

void aux_losses_backward(const Tensor& z_logits, const AuxLossState& st, const AuxLossWeights& w,
                         Tensor& dprobs, Tensor& dlogits, const Tensor& device_scale) {
  ProfileScope scope("moe.aux_loss.bwd", dprobs.device());
  const char* op = "moe aux losses backward";
  check_shape(dprobs, {st.tokens, st.experts}, op, "dprobs");
  check_shape(dlogits, {st.tokens, st.experts}, op, "dlogits");
  XMOE_CHECK(st.denoms.defined(), "[{}] backward without a forward", op);
  xmoe::ops::moe_aux_backward(dprobs, dlogits, z_logits, st.frac, st.seq_count, st.denoms,
                              st.seq_len, st.top_k, w.load_balance, w.seq_balance, w.z_loss,
                              device_scale);
}

Tensor softmax_routing_backward(const Tensor& probs, const Tensor& idx, const Tensor& dv,
                                const Tensor& z_logits, const AuxLossState& st,
                                const AuxLossWeights& w, const Tensor& device_scale) {
  ProfileScope scope("moe.aux_loss.bwd", probs.device());
  const char* op = "moe softmax routing backward";
  check_shape(probs, {st.tokens, st.experts}, op, "probs");
  XMOE_CHECK(st.denoms.defined(), "[{}] backward without a forward", op);
  return xmoe::ops::moe_softmax_routing_backward(probs, idx, dv, z_logits, st.frac, st.seq_count,
                                                 st.denoms, st.seq_len, st.top_k, w.load_balance,
                                                 w.seq_balance, w.z_loss, device_scale);
}

}  // namespace xmoe::moe
