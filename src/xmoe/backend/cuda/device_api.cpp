// CUDA side of core's device API (host code, compiled by the C++ compiler; kernels live in .cu files
// that include no fmt-based headers, since nvcc cannot compile fmt 9).
#include <memory>
#include <mutex>
#include <vector>

#include "xmoe/backend/cuda/check.h"
#include "xmoe/backend/device_api.h"

namespace xmoe::backend {

namespace {

class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int device) : device_(device) {}
  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    CUDA_CHECK(cudaSetDevice(device_));
    void* p = nullptr;
    const cudaError_t status = cudaMalloc(&p, bytes);
    XMOE_CHECK(status == cudaSuccess, "[cuda allocator] cuda:{} out of memory allocating {} bytes ({})",
               device_, bytes, cudaGetErrorString(status));
    record_alloc(bytes);
    return p;
  }
  void deallocate(void* ptr, size_t bytes) override {
    if (!ptr) return;
    cudaFree(ptr);
    record_free(bytes);
  }

 private:
  int device_;
};

}  // namespace

bool cuda_available() { return cuda_device_count() > 0; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

Allocator& cuda_allocator(int device_index) {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<CudaAllocator>> allocators;
  std::lock_guard<std::mutex> lock(mutex);
  const int count = cuda_device_count();
  XMOE_CHECK(device_index >= 0 && device_index < count,
             "[device] cuda:{} requested but {} CUDA device(s) are visible", device_index, count);
  if (allocators.empty()) allocators.resize(static_cast<size_t>(count));
  auto& slot = allocators[static_cast<size_t>(device_index)];
  if (!slot) slot = std::make_unique<CudaAllocator>(device_index);
  return *slot;
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  cudaMemcpyKind kind = cudaMemcpyDefault;  // unified addressing picks the direction
  if (dst_device.is_cpu() && src_device.is_cpu()) kind = cudaMemcpyHostToHost;
  CUDA_CHECK(cudaMemcpy(dst, src, bytes, kind));
}

void synchronize(Device device) {
  if (device.is_cuda()) {
    CUDA_CHECK(cudaSetDevice(device.index));
    CUDA_CHECK(cudaDeviceSynchronize());
  }
}

}  // namespace xmoe::backend
