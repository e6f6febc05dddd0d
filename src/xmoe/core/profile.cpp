#include "xmoe/core/profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

// Like tensor.cpp and allocator.cpp, core reaches the device through the narrow interface that
// backends implement (a CPU-only build links the stub, whose synchronize is a no-op for cpu).
#include "xmoe/core/allocator.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/env.h"

namespace xmoe::profiling {

namespace {

struct Node {
  std::string name;
  int parent = -1;
  int depth = -1;  // the root is -1, top-level regions 0
  int64_t calls = 0;
  double total_ms = 0;
  int64_t peak_bytes = 0;
  std::vector<int> children;
};

struct Table {
  std::mutex mutex;
  std::vector<Node> nodes{Node{}};  // nodes[0]: the root, above the top-level regions
  uint64_t generation = 1;          // bumped by reset(): scopes of an older one record nothing
};

Table& table() {
  static Table t;
  return t;
}

/// Where new scopes of this thread nest: the innermost open scope (node 0 when none is open or
/// the innermost one was opened before the last reset()).
struct Cursor {
  uint64_t generation = 0;
  int node = 0;
};
thread_local Cursor cursor;

int child(Table& t, int parent, const char* name) {
  for (int c : t.nodes[parent].children)
    if (t.nodes[c].name == name) return c;
  const int id = static_cast<int>(t.nodes.size());
  Node n;
  n.name = name;
  n.parent = parent;
  n.depth = t.nodes[parent].depth + 1;
  t.nodes.push_back(std::move(n));
  t.nodes[parent].children.push_back(id);
  return id;
}

std::string path_of(const std::vector<Node>& nodes, int id) {
  std::string p = nodes[id].name;
  for (int q = nodes[id].parent; q > 0; q = nodes[q].parent) p = nodes[q].name + "/" + p;
  return p;
}

double children_ms(const std::vector<Node>& nodes, int id) {
  double s = 0;
  for (int c : nodes[id].children) s += nodes[c].total_ms;
  return s;
}

}  // namespace

namespace detail {
std::atomic<int8_t> enabled{-1};

/// XMOE_PROFILE: the default of profiling::enabled() (docs/training.md, "Environment variables").
bool enabled_from_env() {
  int8_t unknown = -1;
  // An enable() that came first wins.
  enabled.compare_exchange_strong(unknown, env::flag("XMOE_PROFILE") ? 1 : 0,
                                  std::memory_order_relaxed);
  return enabled.load(std::memory_order_relaxed) != 0;
}
}  // namespace detail

void enable(bool on) {
  detail::enabled.store(on ? 1 : 0, std::memory_order_relaxed);
}

void reset() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.nodes.assign(1, Node{});
  ++t.generation;
}

std::vector<Region> report() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  std::vector<Region> out;
  for (int id = 1; id < static_cast<int>(t.nodes.size()); ++id) {
    const Node& n = t.nodes[id];
    if (n.calls == 0) continue;  // opened but not yet closed
    Region r;
    r.path = path_of(t.nodes, id);
    r.name = n.name;
    r.parent = n.parent > 0 ? path_of(t.nodes, n.parent) : "";
    r.depth = n.depth;
    r.calls = n.calls;
    r.total_ms = n.total_ms;
    r.self_ms = n.total_ms - children_ms(t.nodes, id);
    r.peak_bytes = n.peak_bytes;
    out.push_back(std::move(r));
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const Region& a, const Region& b) { return a.total_ms > b.total_ms; });
  return out;
}

std::string report_table() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  const double top = children_ms(t.nodes, 0);
  std::string s = fmt::format("{:<56} {:>8} {:>12} {:>12} {:>7} {:>10}\n", "region", "calls",
                              "total ms", "self ms", "share", "peak MiB");
  // Depth first; siblings by total, largest first.
  auto visit = [&](auto&& self, int id) -> void {
    std::vector<int> kids = t.nodes[id].children;
    std::stable_sort(kids.begin(), kids.end(),
                     [&](int a, int b) { return t.nodes[a].total_ms > t.nodes[b].total_ms; });
    for (int c : kids) {
      const Node& n = t.nodes[c];
      if (n.calls > 0)
        s += fmt::format("{:<56} {:>8} {:>12.3f} {:>12.3f} {:>6.1f}% {:>10.1f}\n",
                         std::string(2 * static_cast<size_t>(n.depth), ' ') + n.name, n.calls,
                         n.total_ms, n.total_ms - children_ms(t.nodes, c),
                         top > 0 ? 100.0 * n.total_ms / top : 0.0,
                         static_cast<double>(n.peak_bytes) / (1 << 20));
      self(self, c);
    }
  };
  visit(visit, 0);
  return s;
}

}  // namespace xmoe::profiling

namespace xmoe {

void ProfileScope::begin(const char* name, Device device) {
  // Wait for the work queued before the region, so that it is not counted inside.
  backend::synchronize(device);
  profiling::Table& t = profiling::table();
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    generation_ = t.generation;
    parent_ = profiling::cursor.generation == generation_ ? profiling::cursor.node : 0;
    node_ = profiling::child(t, parent_, name);
  }
  profiling::cursor = {generation_, node_};
  device_ = device;
  active_ = true;
  Allocator& a = allocator_for(device);
  outer_peak_ = a.stats().peak_bytes;
  a.reset_peak();
  start_ = std::chrono::steady_clock::now();
}

void ProfileScope::end() {
  try {
    backend::synchronize(device_);  // the region's queued work is part of it
  } catch (...) {
    // A device error surfaces at the next op; a destructor must not throw (it may run while an
    // exception unwinds the stack).
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
  Allocator& a = allocator_for(device_);
  const int64_t peak = a.stats().peak_bytes;
  a.raise_peak(outer_peak_);
  profiling::Table& t = profiling::table();
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    if (t.generation == generation_) {
      profiling::Node& n = t.nodes[node_];
      ++n.calls;
      n.total_ms += ms;
      n.peak_bytes = std::max(n.peak_bytes, peak);
    }
  }
  if (profiling::cursor.generation == generation_) profiling::cursor.node = parent_;
  active_ = false;
}

}  // namespace xmoe
