#pragma once
// The device runtime core needs (memory, copies, synchronisation), declared here and
// implemented by a backend: backend/cuda/device_api.cpp, or backend/cuda_stub in a build
// without CUDA, whose functions throw a clear error. So core includes nothing above it.
#include <cstddef>
#include <string>

#include "xmoe/core/allocator.h"

namespace xmoe::backend {

bool cuda_available();
int cuda_device_count();
/// The product name of cuda:`device_index` ("NVIDIA H100 80GB HBM3"), for reports.
std::string cuda_device_name(int device_index);
Allocator& cuda_allocator(int device_index);
/// Copies between any two devices (host<->device, device<->device); synchronous.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
/// Sets `bytes` bytes at `dst` to zero: memset on the CPU; on CUDA a cudaMemsetAsync queued on the
/// device's current stream (ordered before later ops; copy_bytes waits for it).
void fill_zero(void* dst, size_t bytes, Device device);
/// Blocks until the device's queued work is done (no-op for CPU).
void synchronize(Device device);

}  // namespace xmoe::backend
