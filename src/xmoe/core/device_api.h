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

/// Page-locked host memory (cudaHostAlloc) with its own live/peak counters: copies between it
/// and a device run asynchronously, at full bandwidth. Throws in a build without CUDA.
Allocator& pinned_host_allocator();

/// Work beside a CUDA device's current (compute) stream: copies (CopyQueue, core/copy_queue.h)
/// and ops (SideStream, core/side_stream.h) on streams of their own, and events to order them
/// against the compute stream and the host. Handles are opaque (cudaStream_t, cudaEvent_t).
void* create_stream(int device);
void destroy_stream(int device, void* stream);
/// The stream every op on `device` is queued on, and its replacement (SideStream swaps it in and
/// back; the caller owns the stream it sets).
void* current_stream(int device);
void set_current_stream(int device, void* stream);
/// Queues a copy of `bytes` on `stream` (host memory should be pinned to overlap); returns at
/// once.
void copy_bytes_async(void* dst, Device dst_device, const void* src, Device src_device,
                      size_t bytes, void* stream);
void* create_event(int device);
void destroy_event(void* event);
/// Records `event` on `stream`, or on the device's current stream when `stream` is null.
void record_event(void* event, int device, void* stream);
/// `stream` (or the device's current stream when null) waits on the device for `event`.
void stream_wait_event(int device, void* stream, void* event);
/// Blocks the host until the work before `event` is done.
void host_wait_event(void* event);

}  // namespace xmoe::backend
