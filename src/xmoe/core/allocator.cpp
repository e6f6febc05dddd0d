#include "xmoe/core/allocator.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <utility>

#include "xmoe/core/device_api.h"
#include "xmoe/core/env.h"
#include "xmoe/core/error.h"

namespace xmoe {

Allocator::Allocator(Device device)
    : device_(device), limit_(env::integer("XMOE_MEMORY_LIMIT").value_or(0)) {}

void Allocator::set_limit(int64_t bytes) {
  XMOE_CHECK(bytes >= 0, "[{} allocator] limit {} bytes must be >= 0 (0: none)", device_.str(),
             bytes);
  limit_.store(bytes);
}

void Allocator::check_limit(size_t bytes) const {
  const int64_t limit = limit_.load();
  if (limit == 0) return;
  const int64_t live = live_.load();
  if (bytes > static_cast<size_t>(INT64_MAX - live) || live + static_cast<int64_t>(bytes) > limit)
    throw OutOfMemory(device_.str(), static_cast<int64_t>(bytes),
                      std::max<int64_t>(limit - live, 0), limit, live,
                      " (the allocator's limit, e.g. XMOE_MEMORY_LIMIT)");
}

void Allocator::out_of_memory(size_t bytes, int64_t bytes_free, int64_t bytes_total,
                              const std::string& detail) const {
  throw OutOfMemory(device_.str(), static_cast<int64_t>(std::min<size_t>(bytes, INT64_MAX)),
                    bytes_free, bytes_total, live_.load(), detail);
}

MemoryStats Allocator::stats() const {
  return {live_.load(), peak_.load(), total_.load(), count_.load()};
}

void Allocator::reset_peak() {
  peak_.store(live_.load());
}

void Allocator::raise_peak(int64_t bytes) {
  int64_t peak = peak_.load();
  while (bytes > peak && !peak_.compare_exchange_weak(peak, bytes)) {
  }
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

/// The host's physical memory: {available, total} bytes (sysconf; -1 where unknown).
std::pair<int64_t, int64_t> host_memory() {
  const long page = sysconf(_SC_PAGESIZE), avail = sysconf(_SC_AVPHYS_PAGES),
             total = sysconf(_SC_PHYS_PAGES);
  if (page <= 0 || avail < 0 || total <= 0) return {-1, -1};
  return {static_cast<int64_t>(avail) * page, static_cast<int64_t>(total) * page};
}

/// 64-byte aligned host memory (one cache line; also what AVX-512 loads like). Thread-safe:
/// aligned_alloc and the atomic counters (the offloaded AdamW's update thread runs beside the
/// main one; it allocates nothing, but host tensors may be freed on either).
class CpuAllocator final : public Allocator {
 public:
  CpuAllocator() : Allocator(Device::cpu()) {}

  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    check_limit(bytes);
    // No object is larger than PTRDIFF_MAX: refused before the rounding could overflow (and
    // before a sanitizer's malloc would abort on it).
    void* p = nullptr;
    if (bytes <= static_cast<size_t>(PTRDIFF_MAX) - 63)
      p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) {
      const auto [available, total] = host_memory();
      out_of_memory(bytes, available, total, " (host memory)");
    }
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
