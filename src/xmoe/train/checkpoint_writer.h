#pragma once
// train.async_checkpoint: a checkpoint is written on a side thread while training goes on. The
// step hands over a host copy of the state; the thread runs the save (files, fsync, renames,
// the ranks' votes over a group of its own) and nothing else. One save at a time: a new one
// waits for the previous. The copy is created and freed on the trainer's thread (the tensor
// allocator is not thread-safe); an error on the thread is rethrown where the trainer collects
// the save, with the message a synchronous save would have thrown.
#include <atomic>
#include <exception>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "xmoe/core/tensor.h"

namespace xmoe::train {

class CheckpointWriter {
 public:
  CheckpointWriter() = default;
  /// Waits for a save in flight (its error is dropped: collect() first to see it).
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  /// Starts `write(tensors)` on the side thread. A save still in flight is collected first
  /// (waited for; its error rethrown).
  void start(std::string dir, std::map<std::string, Tensor> tensors,
             std::function<void(const std::map<std::string, Tensor>&)> write);
  /// A save was started and not collected yet.
  bool pending() const { return thread_.joinable(); }
  /// The pending save's thread has finished (collect() will not wait).
  bool finished() const { return finished_.load(std::memory_order_acquire); }
  /// Waits for the pending save, frees its copy and returns its folder; rethrows its error.
  /// "" when none is pending.
  std::string collect();

 private:
  std::thread thread_;
  std::atomic<bool> finished_{false};
  std::exception_ptr error_;
  std::string dir_;
  std::map<std::string, Tensor> tensors_;  // the host copy being written
};

/// A copy of `tensors` on the host that later steps cannot change (CPU tensors are cloned).
std::map<std::string, Tensor> host_copy(const std::map<std::string, Tensor>& tensors);

}  // namespace xmoe::train
