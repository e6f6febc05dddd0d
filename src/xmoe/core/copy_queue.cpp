#include "xmoe/core/copy_queue.h"

#include "xmoe/core/device_api.h"

// Not synchronised: one thread uses a queue at a time (the offloaded AdamW's delayed update hands
// its queues to its update thread and takes them back when it joins it).

namespace xmoe {

CopyQueue::CopyQueue(Device device) : device_(device) {
  if (device.is_cuda()) stream_ = backend::create_stream(device.index);
}

CopyQueue::~CopyQueue() {
  if (!device_.is_cuda()) return;
  for (void* e : events_) backend::destroy_event(e);
  backend::destroy_stream(device_.index, stream_);
}

void CopyQueue::after_compute() {
  used_ = 0;
  follow_compute();
}

void CopyQueue::follow_compute() {
  if (!device_.is_cuda()) return;
  const int m = mark_on(nullptr);
  backend::stream_wait_event(device_.index, stream_, events_[static_cast<size_t>(m)]);
}

int CopyQueue::mark_on(void* stream) {
  if (!device_.is_cuda()) return 0;
  if (used_ == events_.size()) events_.push_back(backend::create_event(device_.index));
  backend::record_event(events_[used_], device_.index, stream);
  return static_cast<int>(used_++);
}

void CopyQueue::copy(const Tensor& dst, const Tensor& src) {
  XMOE_CHECK(dst.numel() == src.numel() && dst.dtype() == src.dtype(),
             "[copy_queue] {} into {}: sizes or dtypes differ", src.str(), dst.str());
  XMOE_CHECK((dst.device() == device_ || dst.is_cpu()) && (src.device() == device_ || src.is_cpu()),
             "[copy_queue] {} into {} on a queue of {}", src.str(), dst.str(), device_.str());
  if (!device_.is_cuda()) {
    Tensor view = dst;  // shares dst's storage
    view.copy_from(src);
    return;
  }
  backend::copy_bytes_async(dst.raw(), dst.device(), src.raw(), src.device(), dst.nbytes(),
                            stream_);
}

int CopyQueue::mark() {
  return mark_on(stream_);
}

void CopyQueue::host_wait(int marker) {
  if (!device_.is_cuda()) return;
  XMOE_CHECK(marker >= 0 && static_cast<size_t>(marker) < used_,
             "[copy_queue] marker {} was not made in this round ({} made)", marker, used_);
  backend::host_wait_event(events_[static_cast<size_t>(marker)]);
}

void CopyQueue::compute_waits() {
  if (!device_.is_cuda()) return;
  const int m = mark();
  backend::stream_wait_event(device_.index, nullptr, events_[static_cast<size_t>(m)]);
}

}  // namespace xmoe
