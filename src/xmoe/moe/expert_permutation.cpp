#include "xmoe/moe/expert_permutation.h"

#include <algorithm>
#include <string>

#include "xmoe/core/error.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

void check_permutation(std::span<const int> perm, int64_t num_experts) {
  XMOE_CHECK(static_cast<int64_t>(perm.size()) == num_experts,
             "[moe permute_experts] permutation of {} entries for {} experts", perm.size(),
             num_experts);
  std::vector<char> seen(static_cast<size_t>(num_experts), 0);
  for (int p : perm) {
    XMOE_CHECK(p >= 0 && p < num_experts && !seen[p],
               "[moe permute_experts] not a permutation of [0, {}): {} repeated or out of range",
               num_experts, p);
    seen[p] = 1;
  }
}

void permute_expert_tensor(Tensor& t, std::span<const int> perm, ExpertAxis axis, comm::Group* ep) {
  if (t.dtype() == DType::bf16) {  // bf16 gradients (moe.expert_grad_dtype): through f32, exact
    Tensor t32 = xmoe::ops::cast(t, DType::f32);
    permute_expert_tensor(t32, perm, axis, ep);
    t.copy_from(xmoe::ops::cast(t32, DType::bf16));
    return;
  }
  const auto E = static_cast<int64_t>(perm.size());
  if (axis == ExpertAxis::columns) {  // [r, E] (or [E])
    XMOE_CHECK(t.dtype() == DType::f32 && t.size(-1) == E,
               "[moe permute_experts] expected f32 [..., {}], got {}", E, t.str());
    const int64_t rows = t.numel() / E;
    std::vector<float> v = t.to_vector<float>(), out(v.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t s = 0; s < E; ++s) out[r * E + s] = v[r * E + perm[s]];
    t.copy_from(Tensor::from_vector(out, t.shape(), t.device()));
    return;
  }
  // Expert rows [E_local, ...]: the full [E, ...] tensor, permuted, then this rank's slice.
  const int64_t El = t.size(0), inner = t.numel() / std::max<int64_t>(El, 1);
  const bool sharded = ep != nullptr && ep->size() > 1;
  Tensor flat = t.reshape({El, inner});
  Tensor full = sharded ? ep->all_gather(flat) : flat.clone();
  XMOE_CHECK(full.size(0) == E, "[moe permute_experts] gathered {} expert rows, expected {}",
             full.size(0), E);
  const int64_t first = sharded ? ep->rank() * El : 0;
  std::vector<int32_t> rows(static_cast<size_t>(El));
  for (int64_t i = 0; i < El; ++i) rows[i] = perm[first + i];
  flat.copy_from(xmoe::ops::gather_rows(full, Tensor::from_vector(rows, {El}, t.device())));
}

std::vector<ExpertParameter> expert_parameters(Gate& gate, Experts& experts) {
  std::vector<ExpertParameter> out;
  std::vector<Parameter*> ps;
  gate.collect_parameters(ps);
  auto ends_with = [](const std::string& s, const std::string& suffix) {
    return s.size() >= suffix.size() &&
           s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  for (Parameter* p : ps) {  // xmoe's router.weight [d, r] is a projection: no expert columns
    const bool cols = ends_with(p->name, ".router.expert_embeddings") ||
                      (ends_with(p->name, ".router.weight") && gate.name() != "xmoe");
    if (cols) out.push_back({p, ExpertAxis::columns});
  }
  ps.clear();
  experts.collect_parameters(ps);
  for (Parameter* p : ps) out.push_back({p, ExpertAxis::rows});
  return out;
}

void permute_expert_state(Gate& gate, Experts& experts, std::span<const int> perm,
                          std::span<const ExpertRider> riders, comm::Group* ep) {
  for (const ExpertParameter& p : expert_parameters(gate, experts)) {
    permute_expert_tensor(p.param->value, perm, p.axis, ep);
    if (p.param->grad.defined()) permute_expert_tensor(p.param->grad, perm, p.axis, ep);
    for (const ExpertRider& r : riders) {
      if (r.param != p.param) continue;
      XMOE_CHECK(r.tensor.shape() == p.param->value.shape(),
                 "[moe permute_experts] a tensor riding with {} is {}, the parameter is {}",
                 p.param->name, r.tensor.str(), p.param->value.str());
      Tensor t = r.tensor;  // shares the rider's storage: permuted in place
      permute_expert_tensor(t, perm, p.axis, ep);
    }
  }
  if (Tensor* b = gate.routing_bias()) permute_expert_tensor(*b, perm, ExpertAxis::columns, ep);
}

CoactivationMatrix permuted(const CoactivationMatrix& c, std::span<const int> perm) {
  const int64_t E = c.num_experts;
  CoactivationMatrix out(E);
  for (int64_t a = 0; a < E; ++a)
    for (int64_t b = 0; b < E; ++b) out.at(a, b) = c.at(perm[a], perm[b]);
  return out;
}

Tensor renumbered(const Tensor& topk_idx, std::span<const int> perm) {
  std::vector<int32_t> inv(perm.size());
  for (size_t s = 0; s < perm.size(); ++s)
    inv[static_cast<size_t>(perm[s])] = static_cast<int32_t>(s);
  std::vector<int32_t> idx = topk_idx.to_vector<int32_t>();
  for (int32_t& e : idx) e = inv[static_cast<size_t>(e)];
  return Tensor::from_vector(idx, topk_idx.shape(), topk_idx.device());
}

}  // namespace xmoe::moe
