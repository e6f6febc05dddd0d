#include "xmoe/moe/hooks.h"

#include <algorithm>

#include "xmoe/core/error.h"

namespace xmoe::moe {

namespace detail {

void check_hook(bool callable, std::string_view boundary) {
  XMOE_CHECK(callable, "[moe hooks] empty hook on {}", boundary);
}

bool check_replacement(std::string_view boundary, std::string_view field, const Tensor& was,
                       const Tensor& now) {
  if (!was.defined()) {
    XMOE_CHECK(!now.defined(),
               "[moe hooks] {}.{} holds no tensor here (rbd: see moe/stages.h); "
               "a hook cannot set it",
               boundary, field);
    return false;
  }
  XMOE_CHECK(now.defined(), "[moe hooks] {}.{} replaced by an undefined tensor", boundary, field);
  if (now.shares_storage(was) && now.raw() == was.raw() && now.shape() == was.shape() &&
      now.dtype() == was.dtype())
    return false;
  XMOE_CHECK(
      now.shape() == was.shape() && now.dtype() == was.dtype() && now.device() == was.device(),
      "[moe hooks] {}.{} replaced by {}, expected {} (a replacement keeps the shape, dtype "
      "and device)",
      boundary, field, now.str(), was.str());
  return true;
}

}  // namespace detail

void Hooks::remove(HookId id) {
  std::apply(
      [id](auto&... lists) {
        (std::erase_if(lists, [id](const auto& entry) { return entry.first == id; }), ...);
      },
      lists_);
}

void Hooks::clear() {
  std::apply([](auto&... lists) { (lists.clear(), ...); }, lists_);
}

bool Hooks::empty() const {
  return std::apply([](const auto&... lists) { return (lists.empty() && ...); }, lists_);
}

}  // namespace xmoe::moe
