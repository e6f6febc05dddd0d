#pragma once
// A comm::Group whose collectives are a torch.distributed process group's: each transport call
// (Group's do_*) takes the GIL and calls a Python object (xmoe/_process_group.py) that views
// xmoe's buffers as torch tensors and runs torch.distributed on them. The MoE layer's code is
// unchanged: it sees one more Group backend. Streams: xmoe's kernels run on torch's current
// stream for the call (moe_binding.cpp's StreamScope), and a blocking torch.distributed
// collective on NCCL makes that stream wait for its own, so the exchange is ordered between
// xmoe's kernels without a host wait.
#include <pybind11/pybind11.h>

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "xmoe/comm/group.h"

namespace xmoe::torch_ext {

class TorchProcessGroup final : public comm::Group {
 public:
  /// ops: an xmoe._process_group.ProcessGroupOps (its rank, size, backend and the collectives);
  /// device: where its tensors live (the CPU for gloo, the current CUDA device for NCCL).
  TorchProcessGroup(pybind11::object ops, int rank, int size, Device device);
  ~TorchProcessGroup() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return device_; }
  /// torch.distributed cannot stop the other processes; this one exits with `code`.
  [[noreturn]] void abort(int code) override;

 protected:
  void check_tensor(const Tensor& t, const char* op) const override;
  std::shared_ptr<comm::Group> do_split(int color, int key) override;
  std::unique_ptr<comm::Work> do_all_reduce(Tensor& t, comm::ReduceOp op) override;
  void do_all_gather(const Tensor& t, Tensor& out) override;
  std::unique_ptr<comm::Work> do_reduce_scatter(const Tensor& t, Tensor& out) override;
  std::unique_ptr<comm::Work> do_all_to_all_v(const Tensor& send,
                                              std::span<const int64_t> send_rows,
                                              std::span<const int64_t> send_offsets, Tensor& recv,
                                              std::span<const int64_t> recv_rows,
                                              std::span<const int64_t> recv_offsets) override;
  std::vector<int64_t> do_all_to_all_counts(std::span<const int64_t> send) override;
  void do_broadcast(Tensor& t, int root) override;
  void do_barrier() override;

 private:
  /// Calls ops_.<method>(args...) under the GIL and returns its result as Result (void: none);
  /// a Python exception becomes an xmoe::Error naming the collective.
  template <class Result = void, class... Args>
  Result call(const char* method, Args&&... args);

  pybind11::object ops_;
  int rank_, size_;
  Device device_;
};

}  // namespace xmoe::torch_ext
