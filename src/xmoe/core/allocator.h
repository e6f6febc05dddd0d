#pragma once
// Per-device allocators with live/peak byte counters. Memory claims (PFT vs padded buffers,
// activation memory) are measured with these counters, so every tensor allocation goes here.
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "xmoe/core/device.h"

namespace xmoe {

struct MemoryStats {
  int64_t live_bytes = 0;   ///< bytes currently held by tensors
  int64_t peak_bytes = 0;   ///< high-water mark of live_bytes since the last reset_peak()
  int64_t total_bytes = 0;  ///< bytes handed out since start (monotonic)
  int64_t num_allocs = 0;   ///< allocations since start
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr, size_t bytes) = 0;

  MemoryStats stats() const;
  /// Sets the peak to the current live bytes, so a following region's peak can be read.
  void reset_peak();

 protected:
  void record_alloc(size_t bytes);
  void record_free(size_t bytes);

 private:
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
