#pragma once
// A queue of copies between the host and a device that runs beside the device's compute
// stream: while the device computes and the host works, the copy engines move data. The offloaded
// optimizer (optim/adamw.h) streams gradients to the host and updated weights back on two of
// them. On the CPU there is nothing to overlap: every copy runs at once and the markers are
// no-ops, so the same code runs (and is tested) on host "device" buffers.
#include <cstdint>
#include <vector>

#include "xmoe/core/tensor.h"

namespace xmoe {

class CopyQueue {
 public:
  /// Copies to and from `device` (the CPU: synchronous copies).
  explicit CopyQueue(Device device);
  ~CopyQueue();
  CopyQueue(const CopyQueue&) = delete;
  CopyQueue& operator=(const CopyQueue&) = delete;

  Device device() const { return device_; }
  /// Later copies start after the work queued so far on the device's compute stream (e.g. the
  /// backward pass that wrote the gradients to copy). Starts a new round of markers.
  void after_compute();
  /// The same, keeping this round's markers (copies queued earlier in the round stay marked).
  void follow_compute();
  /// Queues dst <- src (same numel and dtype; one of them on the host, best pinned).
  void copy(const Tensor& dst, const Tensor& src);
  /// A marker after the copies queued so far (valid until the next after_compute()).
  int mark();
  /// Blocks the host until the copies before `marker` are done.
  void host_wait(int marker);
  /// The compute stream waits (on the device, the host does not) for every copy queued so far.
  void compute_waits();

 private:
  /// Records the next event on `stream` (null: the compute stream); returns its index.
  int mark_on(void* stream);

  Device device_;
  void* stream_ = nullptr;
  std::vector<void*> events_;  // reused round after round
  size_t used_ = 0;
};

}  // namespace xmoe
