// Linked when xmoe is built without CUDA: every CUDA entry point says so clearly.
#include <cstring>

#include "xmoe/core/device_api.h"
#include "xmoe/core/device_timeline.h"
#include "xmoe/core/error.h"

namespace xmoe::backend {

bool cuda_available() {
  return false;
}
int cuda_device_count() {
  return 0;
}

std::string cuda_device_name(int device_index) {
  XMOE_FAIL("[device] cuda:{} requested, but this xmoe was built without CUDA (XMOE_CUDA=OFF)",
            device_index);
}

Allocator& cuda_allocator(int device_index) {
  XMOE_FAIL("[device] cuda:{} requested, but this xmoe was built without CUDA (XMOE_CUDA=OFF)",
            device_index);
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  XMOE_CHECK(dst_device.is_cpu() && src_device.is_cpu(),
             "[copy] {} -> {} needs CUDA, but this xmoe was built without CUDA (XMOE_CUDA=OFF)",
             src_device.str(), dst_device.str());
  if (bytes) std::memcpy(dst, src, bytes);
}

void fill_zero(void* dst, size_t bytes, Device device) {
  XMOE_CHECK(device.is_cpu(),
             "[fill_zero] {} needs CUDA, but this xmoe was built without CUDA (XMOE_CUDA=OFF)",
             device.str());
  if (bytes) std::memset(dst, 0, bytes);
}

void synchronize(Device) {}

namespace {
[[noreturn]] void no_cuda(const char* what) {
  XMOE_FAIL("[device] {} needs CUDA, but this xmoe was built without CUDA (XMOE_CUDA=OFF)", what);
}
}  // namespace

Allocator& pinned_host_allocator() {
  no_cuda("pinned host memory");
}
void* create_stream(int) {
  no_cuda("a stream");
}
void destroy_stream(int, void*) {}
void* current_stream(int) {
  no_cuda("a stream");
}
void set_current_stream(int, void*) {
  no_cuda("a stream");
}
void copy_bytes_async(void*, Device, const void*, Device, size_t, void*) {
  no_cuda("an asynchronous copy");
}
void* create_event(int) {
  no_cuda("an event");
}
void destroy_event(void*) {}
void record_event(void*, int, void*) {
  no_cuda("an event");
}
void stream_wait_event(int, void*, void*) {
  no_cuda("an event");
}
void host_wait_event(void*) {
  no_cuda("an event");
}

void start_device_timeline() {
  no_cuda("the device timeline");
}
std::vector<DeviceActivity> stop_device_timeline() {
  no_cuda("the device timeline");
}

}  // namespace xmoe::backend
