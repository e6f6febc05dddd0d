#include "torch_group.h"

#include <pybind11/stl.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace py = pybind11;

namespace xmoe::torch_ext {

namespace {

/// A collective that finished when the call returned (on NCCL: queued before the current
/// stream's next work, which is all that xmoe's kernels on that stream need).
class DoneWork final : public comm::Work {
 public:
  void wait() override {}
};

/// (address, shape, dtype name) of a tensor, what the Python side views it from. Plain C++
/// values: pybind11 makes the Python tuple in call(), under the GIL.
using Buffer = std::tuple<uintptr_t, Shape, std::string>;

Buffer describe(const Tensor& t) {
  return {reinterpret_cast<uintptr_t>(t.numel() > 0 ? t.raw() : nullptr), t.shape(),
          std::string(dtype_name(t.dtype()))};
}

/// The same memory as rows of bytes [n, row_bytes]: all_to_all_v and all_gather move rows of
/// any dtype, and torch.distributed moves uint8 on gloo and NCCL alike.
Buffer describe_rows(const Tensor& t, int64_t row_bytes) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  return {reinterpret_cast<uintptr_t>(t.numel() > 0 ? t.raw() : nullptr), Shape{rows, row_bytes},
          std::string("u8")};
}

const char* reduce_name(comm::ReduceOp op) {
  switch (op) {
    case comm::ReduceOp::sum:
      return "sum";
    case comm::ReduceOp::max:
      return "max";
    case comm::ReduceOp::min:
      return "min";
  }
  return "?";
}

std::vector<int64_t> to_vector(std::span<const int64_t> s) {
  return {s.begin(), s.end()};
}

}  // namespace

TorchProcessGroup::TorchProcessGroup(py::object ops, int rank, int size, Device device)
    : Group("torch.distributed", comm::Topology::uniform(size, size)),
      ops_(std::move(ops)),
      rank_(rank),
      size_(size),
      device_(device) {
  XMOE_CHECK(size >= 1 && rank >= 0 && rank < size,
             "[xmoe.torch process group] rank {} of {} ranks", rank, size);
  backend_ = "torch.distributed:" + ops_.attr("backend").cast<std::string>();
}

TorchProcessGroup::~TorchProcessGroup() {
  py::gil_scoped_acquire gil;  // dropping the Python object needs the GIL
  ops_ = py::object();
}

void TorchProcessGroup::abort(int code) {
  std::fprintf(stderr, "[xmoe.torch process group] rank %d aborts (code %d)\n", rank_, code);
  std::_Exit(code);
}

template <class Result, class... Args>
Result TorchProcessGroup::call(const char* method, Args&&... args) {
  py::gil_scoped_acquire gil;  // also what drops the Python objects made here
  try {
    py::object result = ops_.attr(method)(std::forward<Args>(args)...);
    if constexpr (!std::is_void_v<Result>) return result.cast<Result>();
  } catch (py::error_already_set& e) {
    throw Error(fmt::format("[xmoe.torch process group {}] {}: {}", backend_, method, e.what()));
  }
}

void TorchProcessGroup::check_tensor(const Tensor& t, const char* op) const {
  XMOE_CHECK(t.device() == device_,
             "[{}] the {} process group moves tensors on {}, got one on {} (gloo: CPU, NCCL: the "
             "current CUDA device)",
             op, backend_, device_.str(), t.device().str());
}

std::shared_ptr<comm::Group> TorchProcessGroup::do_split(int, int) {
  throw Error(fmt::format(
      "[xmoe.torch process group] split: a torch.distributed group is not split by xmoe; make "
      "sub-groups with torch.distributed.new_group and pass them"));
}

std::unique_ptr<comm::Work> TorchProcessGroup::do_all_reduce(Tensor& t, comm::ReduceOp op) {
  call("all_reduce", describe(t), reduce_name(op));
  return std::make_unique<DoneWork>();
}

void TorchProcessGroup::do_all_gather(const Tensor& t, Tensor& out) {
  const int64_t rb = row_bytes(t);
  call("all_gather", describe_rows(t, rb), describe_rows(out, rb));
}

std::unique_ptr<comm::Work> TorchProcessGroup::do_reduce_scatter(const Tensor& t, Tensor& out) {
  call("reduce_scatter", describe(t), describe(out));
  return std::make_unique<DoneWork>();
}

std::unique_ptr<comm::Work> TorchProcessGroup::do_all_to_all_v(
    const Tensor& send, std::span<const int64_t> send_rows, std::span<const int64_t> send_offsets,
    Tensor& recv, std::span<const int64_t> recv_rows, std::span<const int64_t> recv_offsets) {
  const int64_t rb = row_bytes(send);
  call("all_to_all_v", describe_rows(send, rb), to_vector(send_rows), to_vector(send_offsets),
       describe_rows(recv, rb), to_vector(recv_rows), to_vector(recv_offsets));
  return std::make_unique<DoneWork>();
}

std::vector<int64_t> TorchProcessGroup::do_all_to_all_counts(std::span<const int64_t> send) {
  return call<std::vector<int64_t>>("all_to_all_counts", to_vector(send));
}

void TorchProcessGroup::do_broadcast(Tensor& t, int root) {
  call("broadcast", describe_rows(t, row_bytes(t)), root);
}

void TorchProcessGroup::do_barrier() {
  call("barrier");
}

}  // namespace xmoe::torch_ext
