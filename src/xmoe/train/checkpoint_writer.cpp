#include "xmoe/train/checkpoint_writer.h"

#include <utility>

namespace xmoe::train {

CheckpointWriter::~CheckpointWriter() {
  // Also while an exception unwinds: the writers of all ranks vote only among themselves, so a
  // save in flight ends even when a trainer thread has failed.
  if (thread_.joinable()) thread_.join();
}

void CheckpointWriter::start(std::string dir, std::map<std::string, Tensor> tensors,
                             std::function<void(const std::map<std::string, Tensor>&)> write) {
  collect();
  dir_ = std::move(dir);
  tensors_ = std::move(tensors);
  error_ = nullptr;
  finished_.store(false, std::memory_order_release);
  thread_ = std::thread([this, write = std::move(write)] {
    try {
      write(tensors_);
    } catch (...) {
      error_ = std::current_exception();
    }
    finished_.store(true, std::memory_order_release);
  });
}

std::string CheckpointWriter::collect() {
  if (!thread_.joinable()) return "";
  thread_.join();
  tensors_.clear();
  std::string dir = std::move(dir_);
  dir_.clear();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return dir;
}

std::map<std::string, Tensor> host_copy(const std::map<std::string, Tensor>& tensors) {
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) {
      out.emplace(name, t);
      continue;
    }
    out.emplace(name, t.device().is_cpu() ? t.clone() : t.to(Device::cpu()));
  }
  return out;
}

}  // namespace xmoe::train
