#include "xmoe/core/allocator.h"

#include <cstdlib>
#include <new>

#include "xmoe/core/device_api.h"
#include "xmoe/core/error.h"

namespace xmoe {

MemoryStats Allocator::stats() const {
  return {live_.load(), peak_.load(), total_.load(), count_.load()};
}

void Allocator::reset_peak() {
  peak_.store(live_.load());
}

void Allocator::record_alloc(size_t bytes) {
  const int64_t live = live_.fetch_add(static_cast<int64_t>(bytes)) + static_cast<int64_t>(bytes);
  int64_t peak = peak_.load();
  while (live > peak && !peak_.compare_exchange_weak(peak, live)) {
  }
  total_.fetch_add(static_cast<int64_t>(bytes));
  count_.fetch_add(1);
}

void Allocator::record_free(size_t bytes) {
  live_.fetch_sub(static_cast<int64_t>(bytes));
}

namespace {

/// 64-byte aligned host memory (one cache line; also what AVX-512 loads like).
class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    XMOE_CHECK(p != nullptr, "[cpu allocator] out of host memory allocating {} bytes", bytes);
    record_alloc(bytes);
    return p;
  }
  void deallocate(void* ptr, size_t bytes) override {
    if (!ptr) return;
    std::free(ptr);
    record_free(bytes);
  }
};

}  // namespace

Allocator& allocator_for(Device device) {
  if (device.is_cpu()) {
    static CpuAllocator cpu;
    return cpu;
  }
  return backend::cuda_allocator(device.index);
}

MemoryStats memory_stats(Device device) {
  return allocator_for(device).stats();
}
void reset_peak_memory(Device device) {
  allocator_for(device).reset_peak();
}

PeakMemoryScope::PeakMemoryScope(Device device) : device_(device) {
  reset_peak_memory(device);
  base_ = memory_stats(device).live_bytes;
}

int64_t PeakMemoryScope::extra_peak_bytes() const {
  return memory_stats(device_).peak_bytes - base_;
}

}  // namespace xmoe
