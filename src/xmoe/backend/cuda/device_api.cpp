// CUDA side of core's device API and the device model (host code, compiled by the C++ compiler;
// kernels live in .cu files that include no fmt-based headers, since nvcc cannot compile fmt 9).
//
// Streams: each device has one current stream, a non-blocking stream created on first use; ops,
// copies and memsets of that device are queued on it.
// Memory: a caching allocator per device (see CachingAllocator): after the first steps of a
// training loop every request is served from its free lists, without cudaMalloc or cudaFree.
#include "xmoe/core/device_api.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "xmoe/backend/cuda/check.h"
#include "xmoe/backend/cuda/cuda_check.cuh"
#include "xmoe/backend/cuda/runtime.h"

namespace xmoe::cuda {

void throw_cuda_error(const char* call, int status, const char* message, const char* file,
                      int line) {
  ::xmoe::throw_error(file, line, fmt::format("[cuda] {} failed: {} ({})", call, message, status));
}

void throw_message(const char* message, const char* file, int line) {
  ::xmoe::throw_error(file, line, message);
}

namespace {

int visible_devices() {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no device" error for later calls
      return 0;
    }
    return n;
  }();
  return count;
}

void check_device(int device) {
  const int count = visible_devices();
  XMOE_CHECK(device >= 0 && device < count,
             "[device] cuda:{} requested but {} CUDA device(s) are visible", device, count);
}

/// Makes `device` current for a scope and restores the previous device after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceScope() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

struct StreamTable {
  std::mutex mutex;
  std::vector<Stream> streams;  // per device; null until first use
};

StreamTable& stream_table() {
  static auto* table = new StreamTable;  // leaked on purpose: used until process exit
  return *table;
}

}  // namespace

Stream current_stream(int device) {
  check_device(device);
  StreamTable& t = stream_table();
  std::lock_guard<std::mutex> lock(t.mutex);
  if (t.streams.empty()) t.streams.resize(static_cast<size_t>(visible_devices()), nullptr);
  Stream& s = t.streams[static_cast<size_t>(device)];
  if (!s) {
    DeviceScope scope(device);
    cudaStream_t created = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    s = created;
  }
  return s;
}

void set_current_stream(int device, Stream stream) {
  check_device(device);
  XMOE_CHECK(stream != nullptr, "[cuda] set_current_stream: null stream for cuda:{}", device);
  StreamTable& t = stream_table();
  std::lock_guard<std::mutex> lock(t.mutex);
  if (t.streams.empty()) t.streams.resize(static_cast<size_t>(visible_devices()), nullptr);
  t.streams[static_cast<size_t>(device)] = stream;
}

Stream activate(int device) {
  check_device(device);
  int now = -1;
  CUDA_CHECK(cudaGetDevice(&now));
  if (now != device) CUDA_CHECK(cudaSetDevice(device));
  return current_stream(device);
}

namespace {

/// Caching device allocator.
///
/// Sizes are rounded to classes: multiples of 512 B below 1 MiB, of 2 MiB above. A freed block
/// goes to the free list of the stream it was allocated on (its contents may still be read by
/// work queued there; a later request on the same stream is ordered after that work). A request
/// takes the smallest cached block of its stream that fits and wastes little (at most 2x for
/// small classes, a quarter or 2 MiB for large ones); otherwise cudaMalloc. When cudaMalloc runs
/// out of memory, every cached block is released (cudaFree synchronises) and the call retried.
/// Blocks are never split, so varying sizes (tokens per expert) settle after a few steps.
///
/// Counters: live/peak (core's MemoryStats) count the bytes tensors asked for, as on the CPU;
/// reserved/cached count the rounded blocks held from the driver.
class CachingAllocator final : public Allocator {
 public:
  explicit CachingAllocator(int device) : Allocator(Device::cuda(device)), device_(device) {}

  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    check_limit(bytes);
    const Stream stream = current_stream(device_);
    std::lock_guard<std::mutex> lock(mutex_);
    // Larger than any device: refused before the rounding could overflow.
    if (bytes > static_cast<size_t>(PTRDIFF_MAX)) refuse(bytes, "larger than any device");
    const size_t size = round_size(bytes);
    void* ptr = take_cached(size, stream);
    if (!ptr) ptr = malloc_block(size, bytes, stream);
    record_alloc(bytes);
    return ptr;
  }

  void deallocate(void* ptr, size_t bytes) override {
    if (!ptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = used_.find(ptr);
    if (it == used_.end()) return;  // not ours: never throw from a destructor path
    const Block block = it->second;
    used_.erase(it);
    free_[block.stream].emplace(block.size, ptr);
    stats_.cached_bytes += static_cast<int64_t>(block.size);
    record_free(bytes);
  }

  CacheStats cache_stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    release_cached();
  }

 private:
  struct Block {
    size_t size;
    Stream stream;
  };

  static constexpr size_t kSmall = size_t{1} << 20;  // 1 MiB
  static constexpr size_t kSmallRound = 512;
  static constexpr size_t kLargeRound = size_t{2} << 20;  // 2 MiB

  static size_t round_size(size_t bytes) {
    const size_t unit = bytes < kSmall ? kSmallRound : kLargeRound;
    return (bytes + unit - 1) / unit * unit;
  }
  static size_t max_fit(size_t size) {
    return size < kSmall ? 2 * size : size + std::max(size / 4, kLargeRound);
  }

  void* take_cached(size_t size, Stream stream) {
    auto pool = free_.find(stream);
    if (pool == free_.end()) return nullptr;
    auto it = pool->second.lower_bound(size);
    if (it == pool->second.end() || it->first > max_fit(size)) return nullptr;
    void* ptr = it->second;
    const size_t block = it->first;
    pool->second.erase(it);
    stats_.cached_bytes -= static_cast<int64_t>(block);
    used_.emplace(ptr, Block{block, stream});
    return ptr;
  }

  /// Throws OutOfMemory with the device's free and total bytes (caller holds mutex_).
  [[noreturn]] void refuse(size_t requested, const char* why) {
    DeviceScope scope(device_);
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) cudaGetLastError();
    out_of_memory(requested, static_cast<int64_t>(free), static_cast<int64_t>(total),
                  fmt::format(", {} bytes reserved by its cache ({})", stats_.reserved_bytes, why));
  }

  void* malloc_block(size_t size, size_t requested, Stream stream) {
    DeviceScope scope(device_);
    void* ptr = nullptr;
    cudaError_t status = cudaMalloc(&ptr, size);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      release_cached();
      status = cudaMalloc(&ptr, size);
    }
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      refuse(requested, cudaGetErrorString(status));
    }
    if (status != cudaSuccess) {
      cudaGetLastError();
      XMOE_FAIL("[cuda allocator] cuda:{}: cudaMalloc of {} bytes failed: {}", device_, requested,
                cudaGetErrorString(status));
    }
    used_.emplace(ptr, Block{size, stream});
    stats_.reserved_bytes += static_cast<int64_t>(size);
    stats_.num_mallocs += 1;
    return ptr;
  }

  // Caller holds mutex_. cudaFree waits for the device, so queued work using a block is done.
  void release_cached() {
    DeviceScope scope(device_);
    for (auto& [stream, pool] : free_) {
      for (auto& [size, ptr] : pool) {
        cudaFree(ptr);
        stats_.reserved_bytes -= static_cast<int64_t>(size);
        stats_.cached_bytes -= static_cast<int64_t>(size);
        stats_.num_frees += 1;
      }
      pool.clear();
    }
  }

  int device_;
  std::mutex mutex_;
  std::unordered_map<void*, Block> used_;
  std::map<Stream, std::multimap<size_t, void*>> free_;  // per stream: size -> block
  CacheStats stats_;
};

CachingAllocator& caching_allocator(int device) {
  static std::mutex mutex;
  // Leaked on purpose: tensors in static objects may be freed during static destruction.
  static auto* allocators = new std::vector<std::unique_ptr<CachingAllocator>>();
  check_device(device);
  std::lock_guard<std::mutex> lock(mutex);
  if (allocators->empty()) allocators->resize(static_cast<size_t>(visible_devices()));
  auto& slot = (*allocators)[static_cast<size_t>(device)];
  if (!slot) slot = std::make_unique<CachingAllocator>(device);
  return *slot;
}

}  // namespace

/// Page-locked host memory straight from cudaHostAlloc (no cache: the offloaded optimizer
/// allocates its buffers once). Portable: usable with every device of the process.
class PinnedHostAllocator final : public Allocator {
 public:
  PinnedHostAllocator() : Allocator(Device::cpu()) {}
  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    check_limit(bytes);
    void* ptr = nullptr;
    const cudaError_t status = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
    if (status != cudaSuccess) {
      cudaGetLastError();
      if (status == cudaErrorMemoryAllocation) {
        const long page = sysconf(_SC_PAGESIZE);
        out_of_memory(bytes, static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * page,
                      static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * page,
                      " (pinned host memory)");
      }
      XMOE_FAIL("[pinned allocator] cudaHostAlloc of {} bytes failed ({}): {} pinned bytes live",
                bytes, cudaGetErrorString(status), stats().live_bytes);
    }
    record_alloc(bytes);
    return ptr;
  }
  void deallocate(void* ptr, size_t bytes) override {
    if (!ptr) return;
    cudaFreeHost(ptr);
    record_free(bytes);
  }
};

CacheStats cache_stats(int device) {
  return caching_allocator(device).cache_stats();
}
void empty_cache(int device) {
  caching_allocator(device).empty_cache();
}

}  // namespace xmoe::cuda

namespace xmoe::backend {

bool cuda_available() {
  return cuda_device_count() > 0;
}

int cuda_device_count() {
  return cuda::visible_devices();
}

std::string cuda_device_name(int device_index) {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device_index));
  return prop.name;
}

Allocator& cuda_allocator(int device_index) {
  return cuda::caching_allocator(device_index);
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  // Queued on the current stream (after the ops that produced src), then waited for, so the
  // host sees the data on return. Unified addressing lets cudaMemcpyDefault pick the direction.
  if (src_device.is_cuda() && dst_device.is_cuda() && src_device.index != dst_device.index)
    CUDA_CHECK(cudaStreamSynchronize(cuda::activate(src_device.index)));
  const int device = dst_device.is_cuda() ? dst_device.index : src_device.index;
  const cuda::Stream stream = cuda::activate(device);
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

void fill_zero(void* dst, size_t bytes, Device device) {
  if (bytes == 0) return;
  if (device.is_cpu()) {
    std::memset(dst, 0, bytes);
    return;
  }
  CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, cuda::activate(device.index)));
}

Allocator& pinned_host_allocator() {
  static auto* allocator = new cuda::PinnedHostAllocator();  // leaked: see caching_allocator
  return *allocator;
}

void* create_stream(int device) {
  cuda::check_device(device);
  cuda::DeviceScope scope(device);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return stream;
}

void destroy_stream(int device, void* stream) {
  if (!stream) return;
  cuda::DeviceScope scope(device);
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream));  // no throw: a destructor path
  cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

void* current_stream(int device) {
  return cuda::current_stream(device);
}

void set_current_stream(int device, void* stream) {
  cuda::set_current_stream(device, static_cast<cuda::Stream>(stream));
}

void copy_bytes_async(void* dst, Device dst_device, const void* src, Device src_device,
                      size_t bytes, void* stream) {
  if (bytes == 0) return;
  const int device = dst_device.is_cuda() ? dst_device.index : src_device.index;
  cuda::activate(device);
  CUDA_CHECK(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
}

void* create_event(int device) {
  cuda::DeviceScope scope(device);
  cudaEvent_t event = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}

void destroy_event(void* event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void record_event(void* event, int device, void* stream) {
  const cuda::Stream s = stream ? static_cast<cuda::Stream>(stream) : cuda::activate(device);
  CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), s));
}

void stream_wait_event(int device, void* stream, void* event) {
  const cuda::Stream s = stream ? static_cast<cuda::Stream>(stream) : cuda::activate(device);
  CUDA_CHECK(cudaStreamWaitEvent(s, static_cast<cudaEvent_t>(event), 0));
}

void host_wait_event(void* event) {
  CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
}

void synchronize(Device device) {
  if (device.is_cuda()) {
    cuda::activate(device.index);
    CUDA_CHECK(cudaDeviceSynchronize());
  }
}

}  // namespace xmoe::backend
