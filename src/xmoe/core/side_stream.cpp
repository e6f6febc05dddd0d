#include "xmoe/core/side_stream.h"

#include <map>
#include <mutex>
#include <utility>

#include "xmoe/core/device_api.h"
#include "xmoe/core/error.h"

namespace xmoe {

SideStream::~SideStream() {
  if (!stream_) return;
  if (compute_) backend::set_current_stream(device_.index, compute_);  // no throw on CUDA
  backend::destroy_event(ready_);
  backend::destroy_event(done_);
  backend::destroy_stream(device_.index, stream_);  // waits for the side's work
}

std::shared_ptr<SideStream> SideStream::for_device(Device device) {
  if (!device.is_cuda()) return std::make_shared<SideStream>(device);  // no stream to share
  static std::mutex mutex;
  static std::map<int, std::weak_ptr<SideStream>> sides;  // CUDA index -> side; users own it
  std::lock_guard<std::mutex> lock(mutex);
  std::weak_ptr<SideStream>& slot = sides[device.index];
  std::shared_ptr<SideStream> side = slot.lock();
  if (!side) {
    side = std::make_shared<SideStream>(device);
    slot = side;
  }
  return side;
}

void SideStream::begin() {
  if (!device_.is_cuda()) return;
  XMOE_CHECK(!compute_, "[side_stream] begin() twice on {} without end()", device_.str());
  if (!stream_) {
    stream_ = backend::create_stream(device_.index);
    ready_ = backend::create_event(device_.index);
    done_ = backend::create_event(device_.index);
  }
  backend::record_event(ready_, device_.index, nullptr);
  backend::stream_wait_event(device_.index, stream_, ready_);
  compute_ = backend::current_stream(device_.index);
  backend::set_current_stream(device_.index, stream_);
}

void SideStream::end() {
  if (!device_.is_cuda() || !compute_) return;
  backend::set_current_stream(device_.index, std::exchange(compute_, nullptr));
  backend::record_event(done_, device_.index, stream_);
  marked_ = true;
}

void SideStream::join() {
  if (!device_.is_cuda() || !marked_) return;
  backend::stream_wait_event(device_.index, nullptr, done_);
  marked_ = false;
}

}  // namespace xmoe
