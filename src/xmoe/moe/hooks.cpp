#include "xmoe/moe/hooks.h"

#include <algorithm>

#include "xmoe/core/error.h"

namespace xmoe::moe {

std::string_view stage_name(Stage s) {
  switch (s) {
    case Stage::gate: return "gate";
    case Stage::order: return "order";
    case Stage::dispatch: return "dispatch";
    case Stage::expert: return "expert";
    case Stage::combine: return "combine";
    case Stage::iorder: return "iorder";
    case Stage::shared: return "shared";
  }
  return "?";
}

std::string_view phase_name(Phase p) { return p == Phase::forward ? "forward" : "backward"; }

const Tensor& StageContext::get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    std::string known;
    for (const auto& n : names()) known += (known.empty() ? "" : ", ") + n;
    XMOE_FAIL("[moe hooks] no tensor '{}' {} {} {} (available: {})", name,
              when_ == When::before ? "before" : "after", stage_name(stage_), phase_name(phase_),
              known);
  }
  return it->second;
}

void StageContext::replace(const std::string& name, Tensor t) {
  XMOE_CHECK(t.defined(), "[moe hooks] replace('{}') with an undefined tensor", name);
  tensors_[name] = std::move(t);
  replaced_.insert(name);
}

std::vector<std::string> StageContext::names() const {
  std::vector<std::string> out;
  for (const auto& [n, t] : tensors_) out.push_back(n);
  return out;
}

double StageContext::scalar(const std::string& name) const {
  auto it = scalars_.find(name);
  XMOE_CHECK(it != scalars_.end(), "[moe hooks] no scalar '{}'", name);
  return it->second;
}

HookId Hooks::add(Stage stage, When when, Phase phase, HookFn fn) {
  XMOE_CHECK(static_cast<bool>(fn), "[moe hooks] empty hook for stage {}", stage_name(stage));
  hooks_.push_back({next_id_, stage, when, phase, std::move(fn)});
  return next_id_++;
}

void Hooks::remove(HookId id) {
  std::erase_if(hooks_, [id](const Entry& e) { return e.id == id; });
}

void Hooks::run(StageContext& ctx) const {
  for (const Entry& e : hooks_)
    if (e.stage == ctx.stage() && e.when == ctx.when() && e.phase == ctx.phase()) e.fn(ctx);
}

}  // namespace xmoe::moe
