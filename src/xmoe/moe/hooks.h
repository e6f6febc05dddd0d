#pragma once
// Hooks: callbacks on the MoE layer's stage boundaries (moe/stages.h), in forward and backward,
// that observe a boundary's tensors or replace them — without editing the layer.
//
//   layer.hooks().on<GateOut>([](GateOut& g) {
//     log(g.topk_idx);                 // observe
//     g.topk_weight = my_weights;      // or replace what the next stages read
//   });
//
// A hook runs when the layer hands the boundary on: on<GateOut> after the gate, before the order
// stage; on<DispatchOut> before the experts; on<CombineGrad> between combine's and the experts'
// backward. Hooks on one boundary run in registration order.
//
// An observing hook changes nothing, memory included: the layer keeps no extra reference because
// a hook is registered (a hook that keeps a tensor keeps it alive, of course). A replacement
// must be a defined tensor of the same shape and dtype (checked); the layer then reads it in
// place of its own, and may keep what it would otherwise have dropped (e.g. replaced expert
// input rows are kept for backward rather than gathered again). Writing into a tensor in place
// works too but is not seen as a replacement.
#include <array>
#include <cstdint>
#include <functional>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "xmoe/moe/stages.h"

namespace xmoe::moe {

/// A hook on boundary B.
template <class B>
using Hook = std::function<void(B&)>;
using HookId = int64_t;

namespace detail {
/// Throws unless a hook for `boundary` is callable.
void check_hook(bool callable, std::string_view boundary);
/// Whether a hook replaced `was` by `now` (another storage, offset, shape or dtype); throws
/// naming boundary.field if `now` cannot stand in for `was` (undefined, other shape or dtype).
bool check_replacement(std::string_view boundary, std::string_view field, const Tensor& was,
                       const Tensor& now);
}  // namespace detail

class Hooks {
 public:
  /// Registers fn on boundary B (one of moe/stages.h); returns an id for remove().
  template <class B>
  HookId on(Hook<B> fn);
  void remove(HookId id);
  void clear();
  bool empty() const;
  /// Whether a hook is registered on boundary B.
  template <class B>
  bool has() const {
    return !std::get<List<B>>(lists_).empty();
  }

  /// Used by the layer: runs B's hooks on `boundary`; true when one replaced a tensor.
  template <class B>
  bool run(B& boundary) const;

 private:
  template <class B>
  using List = std::vector<std::pair<HookId, Hook<B>>>;
  std::tuple<List<LayerIn>, List<GateOut>, List<OrderOut>, List<DispatchOut>, List<ExpertOut>,
             List<CombineOut>, List<IOrderOut>, List<SharedOut>, List<LayerOutGrad>,
             List<SharedGrad>, List<IOrderGrad>, List<CombineGrad>, List<ExpertGrad>,
             List<DispatchGrad>, List<OrderGrad>, List<GateGrad>>
      lists_;
  HookId next_id_ = 1;
};

template <class B>
HookId Hooks::on(Hook<B> fn) {
  detail::check_hook(static_cast<bool>(fn), B::kName);
  std::get<List<B>>(lists_).emplace_back(next_id_, std::move(fn));
  return next_id_++;
}

template <class B>
bool Hooks::run(B& boundary) const {
  const List<B>& hooks = std::get<List<B>>(lists_);
  if (hooks.empty()) return false;
  const auto fields = boundary.tensors();
  // The tensors as they came, to tell a replacement; dropped before the next stage runs.
  std::array<Tensor, std::tuple_size_v<decltype(fields)>> was;
  for (size_t i = 0; i < fields.size(); ++i) was[i] = *fields[i].tensor;
  for (const auto& [id, fn] : hooks) fn(boundary);
  bool replaced = false;
  for (size_t i = 0; i < fields.size(); ++i)
    replaced |= detail::check_replacement(B::kName, fields[i].name, was[i], *fields[i].tensor);
  return replaced;
}

}  // namespace xmoe::moe
