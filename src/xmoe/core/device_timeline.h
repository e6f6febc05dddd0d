#pragma once
// What the GPU did over a stretch of host code, from the GPU's own records (CUPTI activity:
// every kernel, copy and memset where and when it ran, concurrent streams included, unlike
// ncu's serialised replay), with the moment the host called each launch. summarize_timeline()
// says how long the device sat idle in that stretch and whether it waited for the host (a
// launch called after the device had run dry) or for nothing the host could change.
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace xmoe {

struct DeviceActivity {
  enum class Kind : uint8_t { kernel, memcpy, memset };
  Kind kind = Kind::kernel;
  std::string name;  ///< a kernel's short name (short_kernel_name), "memcpy HtoD", "memset"
  int64_t start_ns = 0, end_ns = 0;  ///< on the device (CUPTI's clock, shared with launch_ns)
  uint32_t stream = 0;
  int64_t launch_ns = -1;  ///< when the host's launch call began; -1: not recorded
};

namespace backend {
/// Starts recording the device's activity (a CUDA build, with CUPTI's library found at run
/// time: libcupti.so.13 on the library path, or under $CUDA_HOME; otherwise throws, naming
/// it). One recording at a time.
void start_device_timeline();
/// Waits for every device, stops recording and returns the records in start order.
std::vector<DeviceActivity> stop_device_timeline();
}  // namespace backend

/// A stretch in which the device ran nothing.
struct IdleGap {
  int64_t start_ns = 0, end_ns = 0;
  std::string before, after;  ///< the activity that ended it began with / the one that ended it
  /// How much of the gap passed before the host called the launch of `after` (0: it was
  /// queued in time; the device waited on something else, e.g. an event).
  int64_t host_late_ns = 0;
  int64_t ns() const { return end_ns - start_ns; }
};

struct TimelineSummary {
  int64_t span_ns = 0;  ///< first start to last end
  int64_t busy_ns = 0;  ///< the union of the activities' intervals
  int64_t idle_ns = 0;  ///< span - busy
  /// The part of idle_ns that passed before the host called the next launch: the device waited
  /// for the host.
  int64_t host_late_ns = 0;
  int64_t kernels = 0, memcpys = 0, memsets = 0;
  std::vector<IdleGap> longest;  ///< the longest gaps, longest first
  /// Idle ns before each activity name (the gaps it ended), largest first.
  std::vector<std::pair<std::string, int64_t>> idle_before;
  /// Each activity name's summed duration and count, longest first (streams that overlap both
  /// count: the sum may pass busy_ns).
  struct NameTotal {
    std::string name;
    int64_t ns = 0, count = 0;
  };
  std::vector<NameTotal> by_name;
};

/// The summary of `records` (any order); keeps the `longest` longest gaps.
TimelineSummary summarize_timeline(std::span<const DeviceActivity> records, size_t longest = 12);

/// "void ns::(anonymous namespace)::gather_rows_kernel<uint4>(float*, int)" ->
/// "gather_rows_kernel<uint4>": no return type, no parameters, no namespaces outside the
/// template arguments; at most `most` characters.
std::string short_kernel_name(const std::string& demangled, size_t most = 96);

}  // namespace xmoe
