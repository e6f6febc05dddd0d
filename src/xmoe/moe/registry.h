#pragma once
// Registry<Base, Args...>: stage implementations created by name. Built-in implementations are
// added explicitly by the stage's own make_* function (static self-registration would be dropped
// by the linker from the static library); users may add more with add().
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "xmoe/core/error.h"

namespace xmoe::moe {

template <class Base, class... Args>
class Registry {
 public:
  using Factory = std::function<std::unique_ptr<Base>(Args...)>;

  /// `what` names the config key in error messages, e.g. "moe.gate".
  explicit Registry(std::string what) : what_(std::move(what)) {}

  /// Adds (or replaces) the implementation called `name`.
  void add(const std::string& name, Factory factory) { factories_[name] = std::move(factory); }
  bool contains(const std::string& name) const { return factories_.count(name) > 0; }

  /// Names in sorted order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, f] : factories_) out.push_back(name);
    return out;
  }

  /// Creates `name`; an unknown name throws an Error that lists the known ones.
  std::unique_ptr<Base> create(const std::string& name, Args... args) const {
    auto it = factories_.find(name);
    if (it == factories_.end()) {
      std::string known;
      for (const auto& n : names()) known += (known.empty() ? "" : ", ") + n;
      XMOE_FAIL("[moe] unknown {} = '{}' (known: {})", what_, name, known);
    }
    return it->second(std::forward<Args>(args)...);
  }

 private:
  std::string what_;
  std::map<std::string, Factory> factories_;
};

}  // namespace xmoe::moe
