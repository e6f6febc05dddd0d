#pragma once
// A region profiler: wall time per named region of a training step, nested, aggregated by name.
//
//   ProfileScope scope("block.attention.fwd", x.device());
//
// Off (the default) a scope costs one branch in its constructor and one in its destructor. On
// (profiling::enable(true), or XMOE_PROFILE=1), a scope synchronises the device at entry and at
// exit, so the time between is the device time of the work queued inside (plus the host time
// around it), not the time to queue it. The synchronisations make a profiled step slower than an
// unprofiled one: use the shares, not the sum, to compare with unprofiled timings.
//
// Regions are kept as a tree: a region's path is its enclosing regions' names and its own,
// joined by '/' ("step/model.bwd/block.bwd/moe.bwd/moe.expert.bwd"). The same name under the same
// parent aggregates (every layer's "block.attention.fwd" is one region with calls = layers);
// the same name under different parents gives separate regions (the final norm is not a
// block's). Times are inclusive; `self_ms` is the part not covered by child regions.
//
// Memory: each region also records the highest live bytes of its device's allocator inside it
// (over all its calls), so the table shows where a step's peak is reached. Nested regions keep
// the enclosing region's high-water mark: a scope resets the allocator's peak at entry and
// raises it back at exit.
//
// Threads: scopes on one thread nest through a thread-local cursor; the table is shared and
// guarded by a mutex. The trainer opens scopes from its one host thread; OpenMP workers inside
// a region open none.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "xmoe/core/device.h"

namespace xmoe {

namespace profiling {

namespace detail {
extern std::atomic<int8_t> enabled;  // -1 until XMOE_PROFILE is read, then 0 or 1
bool enabled_from_env();
}  // namespace detail

/// Whether scopes record. Initially XMOE_PROFILE (0 or 1, default 0; core/env.h), read once, at
/// the first call: a bad value is an error there, not a crash before main().
inline bool enabled() {
  const int8_t on = detail::enabled.load(std::memory_order_relaxed);
  return on >= 0 ? on != 0 : detail::enabled_from_env();
}
/// Turns recording on or off; scopes already open when it is turned off still record their end.
void enable(bool on);
/// Forgets every region. Scopes open across a reset record nothing when they end.
void reset();

/// One region of the table.
struct Region {
  std::string path;    ///< "step/model.fwd/block.fwd"
  std::string name;    ///< the last component: "block.fwd"
  std::string parent;  ///< the parent's path; "" at the top
  int depth = 0;       ///< 0 at the top
  int64_t calls = 0;
  double total_ms = 0;     ///< inclusive
  double self_ms = 0;      ///< total_ms minus the children's total_ms
  int64_t peak_bytes = 0;  ///< the device's highest live bytes inside the region
};

/// Every region with at least one call, sorted by total_ms (largest first).
std::vector<Region> report();
/// report() as a text table, indented by depth in tree order (children under their parent,
/// siblings by total): calls, total ms, self ms, share of the top-level total, peak MiB.
std::string report_table();

}  // namespace profiling

/// Times the enclosing C++ scope as region `name` (a string literal or other string that
/// outlives the scope) when profiling is on; see the top of this file.
class ProfileScope {
 public:
  ProfileScope(const char* name, Device device) {
    if (profiling::enabled()) begin(name, device);
  }
  ~ProfileScope() {
    if (active_) end();
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  void begin(const char* name, Device device);
  void end();

  bool active_ = false;
  Device device_;
  int node_ = 0, parent_ = 0;
  uint64_t generation_ = 0;
  int64_t outer_peak_ = 0;  // the allocator's peak at entry, given back at exit
  std::chrono::steady_clock::time_point start_;
};

}  // namespace xmoe
