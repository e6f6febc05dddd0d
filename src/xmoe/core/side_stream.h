#pragma once
// Ops queued beside a device's compute stream. Between begin() and end() every op on the device
// goes to a stream of the SideStream's own, which first waits for the work queued so far on the
// compute stream; join() makes the compute stream wait for the side's work up to the last end().
// The MoE layer runs its shared experts so, beside the routed path (docs/moe.md, "Shared experts
// beside the routed path").
//
// The host runs the ops in program order, so the caching allocator sees the same requests (and
// the same live and peak bytes) as without a side stream. A block allocated on the side returns
// to the side's free list (docs/cuda.md, "Streams and synchronisation"), whose next user waits for
// the compute stream first (begin()); a compute-stream tensor the side reads must be held until the
// compute stream has joined.
// On the CPU every call is a no-op: the work runs in program order, through the same code.
#include <memory>

#include "xmoe/core/device.h"

namespace xmoe {

class SideStream {
 public:
  explicit SideStream(Device device) : device_(device) {}
  /// The device's one side stream while any user holds it, else a new one: users that begin,
  /// end and join in turn (the MoE layers, one after another) share its stream, its free list
  /// and its cuBLAS workspace instead of holding one each.
  static std::shared_ptr<SideStream> for_device(Device device);
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  Device device() const { return device_; }
  /// The side's next ops start after the compute stream's work so far, and the side becomes the
  /// device's current stream.
  void begin();
  /// The compute stream becomes current again; the side's work so far is marked for join().
  void end();
  /// The compute stream waits (on the device; the host goes on) for the side's marked work.
  void join();

  /// begin() for a scope, and end() when it closes (an exception included); a null side makes
  /// the scope a no-op (the ops stay on the compute stream).
  class Scope {
   public:
    explicit Scope(SideStream* side) : side_(side) {
      if (side_) side_->begin();
    }
    ~Scope() {
      try {
        if (side_) side_->end();
      } catch (...) {  // a destructor must not throw; a device error surfaces at the next op
      }
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    SideStream* side_;
  };

 private:
  Device device_;
  void* stream_ = nullptr;   // the side (created on the first begin())
  void* compute_ = nullptr;  // the compute stream, while the side is current
  void* ready_ = nullptr;    // event: the compute stream's work before begin()
  void* done_ = nullptr;     // event: the side's work before end()
  bool marked_ = false;      // done_ recorded since the last join()
};

}  // namespace xmoe
