#pragma once
// Per-device allocators with live/peak byte counters. Memory claims (PFT vs padded buffers,
// activation memory) are measured with these counters, so every tensor allocation goes here.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "xmoe/core/device.h"

namespace xmoe {

struct MemoryStats {
  int64_t live_bytes = 0;   ///< bytes currently held by tensors
  int64_t peak_bytes = 0;   ///< high-water mark of live_bytes since the last reset_peak()
  int64_t total_bytes = 0;  ///< bytes handed out since start (monotonic)
  int64_t num_allocs = 0;   ///< allocations since start
};

/// Allocators throw OutOfMemory (core/error.h) when the device cannot hold a request, or when it
/// would take the live bytes past the allocator's limit; either way nothing is counted.
class Allocator {
 public:
  /// The limit starts at XMOE_MEMORY_LIMIT (bytes; unset or 0: none).
  explicit Allocator(Device device);
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr, size_t bytes) = 0;

  Device device() const { return device_; }
  MemoryStats stats() const;
  /// Sets the peak to the current live bytes, so a following region's peak can be read.
  void reset_peak();
  /// Raises the peak to at least `bytes`: a nested region that reset it gives back the
  /// enclosing region's high-water mark.
  void raise_peak(int64_t bytes);
  /// Caps the live bytes at `bytes` (0: no cap): a request past it throws OutOfMemory as a
  /// device of that size would, e.g. to see on a large GPU what fits a smaller one.
  void set_limit(int64_t bytes);
  int64_t limit() const { return limit_.load(); }

 protected:
  /// Throws OutOfMemory when `bytes` more would pass the limit. Call before allocating.
  void check_limit(size_t bytes) const;
  /// Throws OutOfMemory for a request of `bytes` the device could not satisfy.
  [[noreturn]] void out_of_memory(size_t bytes, int64_t bytes_free, int64_t bytes_total,
                                  const std::string& detail = "") const;
  void record_alloc(size_t bytes);
  void record_free(size_t bytes);

 private:
  Device device_;
  std::atomic<int64_t> limit_{0};
  std::atomic<int64_t> live_{0}, peak_{0}, total_{0}, count_{0};
};

/// The allocator that owns memory of `device` (CUDA ones come from the CUDA backend).
Allocator& allocator_for(Device device);
MemoryStats memory_stats(Device device = Device::cpu());
void reset_peak_memory(Device device = Device::cpu());

/// RAII scope that reports the peak bytes above the live bytes at its start.
class PeakMemoryScope {
 public:
  explicit PeakMemoryScope(Device device = Device::cpu());
  /// Peak live bytes reached inside the scope minus live bytes at its start.
  int64_t extra_peak_bytes() const;

 private:
  Device device_;
  int64_t base_;
};

}  // namespace xmoe
