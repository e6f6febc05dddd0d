#pragma once
// Moving a MoE layer's experts between slots (expert placement, moe/placement.h): new expert s
// is old expert perm[s], the same perm on every rank. The experts' weights and gradients move,
// so do the router's expert columns, the sigmoid gate's bias and whatever the caller says rides
// with a parameter (e.g. the optimizer's moments): the layer computes the same function (up to
// float summation order). MoELayer::permute_experts calls this and permutes its own counters.
#include <cstdint>
#include <span>
#include <vector>

#include "xmoe/comm/group.h"
#include "xmoe/core/parameter.h"
#include "xmoe/moe/expert.h"
#include "xmoe/moe/gate.h"
#include "xmoe/moe/placement.h"

namespace xmoe::moe {

/// A tensor that moves with a parameter's experts, e.g. an AdamW moment: the parameter's shape,
/// permuted in place (a Tensor shares its storage, so the owner's tensor moves). Riders of
/// parameters that hold no experts (or belong to another layer) are left alone.
struct ExpertRider {
  const Parameter* param = nullptr;
  Tensor tensor;
};

/// Throws unless perm is a permutation of [0, num_experts).
void check_permutation(std::span<const int> perm, int64_t num_experts);

/// Where a tensor keeps its experts.
enum class ExpertAxis : uint8_t {
  rows,     ///< dim 0: this rank's E_local of E, sharded over the ep group (expert weights)
  columns,  ///< the last dim, all E (router.weight [d, E], expert_embeddings [r, E], bias [E])
};

/// Permutes t in place along `axis`. rows: the full [E, ...] tensor is all-gathered over `ep`
/// (null or size 1: all experts are here), permuted, and this rank keeps its slice (collective).
/// f32, or bf16 (through f32: exact).
void permute_expert_tensor(Tensor& t, std::span<const int> perm, ExpertAxis axis, comm::Group* ep);

/// The parameters of a gate and its experts that hold experts, in collect_parameters order.
struct ExpertParameter {
  Parameter* param;
  ExpertAxis axis;
};
std::vector<ExpertParameter> expert_parameters(Gate& gate, Experts& experts);

/// Permutes the expert parameters' values and gradients, their riders and the gate's routing
/// bias. Collective over `ep`: every rank passes the same riders' parameters in the same order.
void permute_expert_state(Gate& gate, Experts& experts, std::span<const int> perm,
                          std::span<const ExpertRider> riders, comm::Group* ep);

/// out[s] = v[perm[s]] (per-expert counters).
template <class T>
std::vector<T> permuted(const std::vector<T>& v, std::span<const int> perm) {
  std::vector<T> out(v.size());
  for (size_t s = 0; s < perm.size(); ++s) out[s] = v[static_cast<size_t>(perm[s])];
  return out;
}
/// The counts with expert ids renumbered: out.at(a, b) = c.at(perm[a], perm[b]).
CoactivationMatrix permuted(const CoactivationMatrix& c, std::span<const int> perm);
/// topk_idx i32 [T, k] of old expert ids as new ids (a frozen routing keeps its experts).
Tensor renumbered(const Tensor& topk_idx, std::span<const int> perm);

}  // namespace xmoe::moe
