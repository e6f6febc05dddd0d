#pragma once
// Hooks: callbacks before/after each stage of the MoE layer, in forward and backward, that
// observe the stage's tensors or replace them — without editing the layer.
//
//   layer.hooks().after(Stage::gate, [](StageContext& c) {
//     log(c.get("topk_idx"));                     // observe
//     c.replace("topk_weight", my_weights);       // or replace what the next stages read
//   });
//
// A StageContext is the layer's named-tensor blackboard for the current pass: before a stage it
// holds everything computed so far (the stage's inputs among them), after it also the stage's
// outputs. Replacing a tensor changes what every later stage reads. Tensor names per stage are
// listed in docs/moe.md ("Hooks").
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "xmoe/core/tensor.h"

namespace xmoe::moe {

/// The stages of the MoE layer in forward order (shared experts run beside the routed path).
enum class Stage : uint8_t { gate, order, dispatch, expert, combine, iorder, shared };
inline constexpr int kNumStages = 7;
enum class Phase : uint8_t { forward, backward };
enum class When : uint8_t { before, after };

std::string_view stage_name(Stage s);
std::string_view phase_name(Phase p);

class StageContext {
 public:
  StageContext(std::string layer, Phase phase) : layer_(std::move(layer)), phase_(phase) {}

  const std::string& layer() const { return layer_; }  ///< the layer's parameter prefix
  Phase phase() const { return phase_; }
  Stage stage() const { return stage_; }
  When when() const { return when_; }

  bool has(const std::string& name) const { return tensors_.count(name) > 0; }
  /// The tensor called `name`; throws listing the available names if there is none.
  const Tensor& get(const std::string& name) const;
  /// Replaces (or adds) `name`; later stages read the new tensor. It must keep the shape and
  /// dtype the stage expects. Writing into a tensor in place works too but is not tracked.
  void replace(const std::string& name, Tensor t);
  /// Names replaced by hooks during this pass.
  bool was_replaced(const std::string& name) const { return replaced_.count(name) > 0; }
  std::vector<std::string> names() const;

  /// Scalars of the pass (e.g. "aux_loss" after the gate); read-only for hooks.
  double scalar(const std::string& name) const;
  bool has_scalar(const std::string& name) const { return scalars_.count(name) > 0; }

  // ---- used by the layer ----
  void set(const std::string& name, Tensor t) { tensors_[name] = std::move(t); }
  void erase(const std::string& name) { tensors_.erase(name); }
  void set_scalar(const std::string& name, double v) { scalars_[name] = v; }
  void enter(Stage s, When w) { stage_ = s; when_ = w; }

 private:
  std::string layer_;
  Phase phase_;
  Stage stage_ = Stage::gate;
  When when_ = When::before;
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, double> scalars_;
  std::set<std::string> replaced_;
};

using HookFn = std::function<void(StageContext&)>;
using HookId = int64_t;

class Hooks {
 public:
  /// Registers fn to run before `stage` in `phase`; returns an id for remove().
  HookId before(Stage stage, HookFn fn, Phase phase = Phase::forward) {
    return add(stage, When::before, phase, std::move(fn));
  }
  HookId after(Stage stage, HookFn fn, Phase phase = Phase::forward) {
    return add(stage, When::after, phase, std::move(fn));
  }
  HookId add(Stage stage, When when, Phase phase, HookFn fn);
  void remove(HookId id);
  void clear() { hooks_.clear(); }
  bool empty() const { return hooks_.empty(); }
  /// Runs the hooks registered for (ctx.stage(), ctx.when(), ctx.phase()) in registration order.
  void run(StageContext& ctx) const;

 private:
  struct Entry {
    HookId id;
    Stage stage;
    When when;
    Phase phase;
    HookFn fn;
  };
  std::vector<Entry> hooks_;
  HookId next_id_ = 1;
};

}  // namespace xmoe::moe
