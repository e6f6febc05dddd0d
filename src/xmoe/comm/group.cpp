#include "xmoe/comm/group.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>

#include "xmoe/comm/mpi/mpi_group.h"
#include "xmoe/core/device_api.h"

namespace xmoe::comm {

int64_t ByteCounters::total(LinkClass link) const {
  int64_t s = 0;
  for (const auto& k : bytes) s += k[static_cast<int>(link)];
  return s;
}

std::shared_ptr<Group> Group::with_declared_nodes(int ranks_per_node) {
  Topology declared = Topology::uniform(size(), ranks_per_node);
  std::shared_ptr<Group> g = split(0, rank());
  g->topology_ = std::move(declared);
  return g;
}

void Group::count(ByteCounters::Kind kind, int peer, int64_t bytes) {
  if (peer == rank() || bytes == 0) return;
  counters_.bytes[kind][static_cast<int>(topology_.link(rank(), peer))] += bytes;
}

int64_t Group::row_bytes(const Tensor& t) {
  int64_t n = static_cast<int64_t>(dtype_size(t.dtype()));
  for (int64_t i = 1; i < t.dim(); ++i) n *= t.size(i);
  return n;
}

namespace {

/// An async collective's Work whose wait() (where a rank blocks for its peers) is watched.
class WatchedWork final : public Work {
 public:
  WatchedWork(std::unique_ptr<Work> work, Group& group, const char* name)
      : work_(std::move(work)), group_(group), name_(name) {}
  void wait() override {
    const Watchdog::Scope scope = group_.watchdog()->watch(name_, group_);
    work_->wait();
  }

 private:
  std::unique_ptr<Work> work_;
  Group& group_;
  const char* name_;
};

}  // namespace

std::unique_ptr<Work> Group::watched(std::unique_ptr<Work> work, const char* name) {
  if (!watchdog_) return work;
  return std::make_unique<WatchedWork>(std::move(work), *this, name);
}

std::shared_ptr<Group> Group::split(int color, int key) {
  XMOE_CHECK(color >= 0, "[split] color {} must be >= 0", color);
  const Watchdog::Scope scope = watch("split");
  std::shared_ptr<Group> g = do_split(color, key);
  g->watchdog_ = watchdog_;
  return g;
}

void Group::barrier() {
  const Watchdog::Scope scope = watch("barrier");
  do_barrier();
}

std::unique_ptr<Work> Group::all_reduce_async(Tensor& t, ReduceOp op) {
  check_tensor(t, "all_reduce");
  std::unique_ptr<Work> work = watched(do_all_reduce(t, op), "all_reduce");
  ++counters_.calls[ByteCounters::all_reduce];
  // reduce_scatter + all_gather of this rank's 1/size of the tensor
  const int64_t block = static_cast<int64_t>(t.nbytes()) / size();
  for (int p = 0; p < size(); ++p) count(ByteCounters::all_reduce, p, 2 * block);
  return work;
}

Tensor Group::all_gather(const Tensor& t) {
  check_tensor(t, "all_gather");
  XMOE_CHECK(t.dim() >= 1, "[all_gather] needs at least 1-d tensors, got {}", t.str());
  Shape shape = t.shape();
  shape[0] *= size();
  Tensor out = Tensor::empty(shape, t.dtype(), t.device());
  {
    const Watchdog::Scope scope = watch("all_gather");
    do_all_gather(t, out);
  }
  ++counters_.calls[ByteCounters::all_gather];
  for (int p = 0; p < size(); ++p)
    count(ByteCounters::all_gather, p, static_cast<int64_t>(t.nbytes()));
  return out;
}

std::unique_ptr<Work> Group::reduce_scatter_async(const Tensor& t, Tensor& out) {
  check_tensor(t, "reduce_scatter");
  XMOE_CHECK(t.dim() >= 1 && t.size(0) % size() == 0,
             "[reduce_scatter] dim 0 of {} is not divisible by the group size {}", t.str(), size());
  Shape shape = t.shape();
  shape[0] /= size();
  out = Tensor::empty(shape, t.dtype(), t.device());
  std::unique_ptr<Work> work = watched(do_reduce_scatter(t, out), "reduce_scatter");
  ++counters_.calls[ByteCounters::reduce_scatter];
  for (int p = 0; p < size(); ++p)
    count(ByteCounters::reduce_scatter, p, static_cast<int64_t>(out.nbytes()));
  return work;
}

namespace {

void check_counts(std::span<const int64_t> send_rows, std::span<const int64_t> recv_rows) {
  for (size_t p = 0; p < send_rows.size(); ++p)
    XMOE_CHECK(send_rows[p] >= 0 && recv_rows[p] >= 0,
               "[all_to_all_v] negative count for rank {}: send {} recv {}", p, send_rows[p],
               recv_rows[p]);
}

std::vector<int64_t> prefix_offsets(std::span<const int64_t> rows) {
  std::vector<int64_t> out(rows.size(), 0);
  for (size_t p = 1; p < rows.size(); ++p) out[p] = out[p - 1] + rows[p - 1];
  return out;
}

}  // namespace

std::unique_ptr<Work> Group::all_to_all_v_async(const Tensor& send,
                                                std::span<const int64_t> send_rows,
                                                std::span<const int64_t> recv_rows, Tensor& recv) {
  check_tensor(send, "all_to_all_v");
  const int n = size();
  XMOE_CHECK(static_cast<int>(send_rows.size()) == n && static_cast<int>(recv_rows.size()) == n,
             "[all_to_all_v] need {} send and recv counts, got {} and {}", n, send_rows.size(),
             recv_rows.size());
  check_counts(send_rows, recv_rows);
  const int64_t sent = std::accumulate(send_rows.begin(), send_rows.end(), int64_t{0});
  XMOE_CHECK(send.dim() >= 1 && sent == send.size(0),
             "[all_to_all_v] send counts sum to {} but send has {} rows", sent,
             send.dim() ? send.size(0) : 0);
  Shape shape = send.shape();
  shape[0] = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  recv = Tensor::empty(shape, send.dtype(), send.device());
  return all_to_all_v_rows_async(send, send_rows, prefix_offsets(send_rows), recv, recv_rows,
                                 prefix_offsets(recv_rows));
}

std::unique_ptr<Work> Group::all_to_all_v_rows_async(
    const Tensor& send, std::span<const int64_t> send_rows, std::span<const int64_t> send_offsets,
    Tensor& recv, std::span<const int64_t> recv_rows, std::span<const int64_t> recv_offsets) {
  check_tensor(send, "all_to_all_v");
  check_tensor(recv, "all_to_all_v");
  const int n = size();
  XMOE_CHECK(static_cast<int>(send_rows.size()) == n && static_cast<int>(recv_rows.size()) == n &&
                 static_cast<int>(send_offsets.size()) == n &&
                 static_cast<int>(recv_offsets.size()) == n,
             "[all_to_all_v] need {} send and recv counts and offsets, got {}, {}, {} and {}", n,
             send_rows.size(), recv_rows.size(), send_offsets.size(), recv_offsets.size());
  XMOE_CHECK(send.dim() >= 1 && recv.dim() >= 1 && send.dtype() == recv.dtype() &&
                 row_bytes(send) == row_bytes(recv),
             "[all_to_all_v] send {} and recv {} differ in dtype or row width", send.str(),
             recv.str());
  check_counts(send_rows, recv_rows);
  for (int p = 0; p < n; ++p) {
    XMOE_CHECK(send_offsets[p] >= 0 && send_offsets[p] + send_rows[p] <= send.size(0) &&
                   recv_offsets[p] >= 0 && recv_offsets[p] + recv_rows[p] <= recv.size(0),
               "[all_to_all_v] rank {}: send rows [{}, +{}) of {} or recv rows [{}, +{}) of {} "
               "out of range",
               p, send_offsets[p], send_rows[p], send.size(0), recv_offsets[p], recv_rows[p],
               recv.size(0));
  }
  std::unique_ptr<Work> work =
      watched(do_all_to_all_v(send, send_rows, send_offsets, recv, recv_rows, recv_offsets),
              "all_to_all_v");
  ++counters_.calls[ByteCounters::all_to_all];
  const int64_t rb = row_bytes(send);
  for (int p = 0; p < n; ++p) count(ByteCounters::all_to_all, p, send_rows[p] * rb);
  return work;
}

std::vector<int64_t> Group::all_to_all_counts(std::span<const int64_t> send) {
  const auto n = static_cast<size_t>(size());
  XMOE_CHECK(send.size() % n == 0, "[all_to_all_counts] {} values do not split over {} ranks",
             send.size(), n);
  std::vector<int64_t> out;
  {
    const Watchdog::Scope scope = watch("all_to_all_counts");
    out = do_all_to_all_counts(send);
  }
  const auto per = static_cast<int64_t>(send.size() / n);
  for (int p = 0; p < size(); ++p)
    count(ByteCounters::counts, p, per * static_cast<int64_t>(sizeof(int64_t)));
  return out;
}

void Group::broadcast(Tensor& t, int root) {
  check_tensor(t, "broadcast");
  XMOE_CHECK(root >= 0 && root < size(), "[broadcast] root {} outside a group of {}", root, size());
  {
    const Watchdog::Scope scope = watch("broadcast");
    do_broadcast(t, root);
  }
  ++counters_.calls[ByteCounters::broadcast];
  if (rank() == root)
    for (int p = 0; p < size(); ++p)
      count(ByteCounters::broadcast, p, static_cast<int64_t>(t.nbytes()));
}

namespace {

class DoneWork final : public Work {
 public:
  void wait() override {}
};

/// Size-1 group: every collective is the identity (or a copy); tensors on any device.
class SingleGroup final : public Group {
 public:
  SingleGroup() : Group("single", Topology()) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  [[noreturn]] void abort(int code) override { std::_Exit(code); }

 protected:
  void check_tensor(const Tensor&, const char*) const override {}
  void do_barrier() override {}
  std::shared_ptr<Group> do_split(int, int) override { return std::make_shared<SingleGroup>(); }
  std::unique_ptr<Work> do_all_reduce(Tensor&, ReduceOp) override {
    return std::make_unique<DoneWork>();
  }
  void do_all_gather(const Tensor& t, Tensor& out) override { out.copy_from(t); }
  std::unique_ptr<Work> do_reduce_scatter(const Tensor& t, Tensor& out) override {
    out.copy_from(t);
    return std::make_unique<DoneWork>();
  }
  std::unique_ptr<Work> do_all_to_all_v(const Tensor& send, std::span<const int64_t> send_rows,
                                        std::span<const int64_t> send_offsets, Tensor& recv,
                                        std::span<const int64_t> recv_rows,
                                        std::span<const int64_t> recv_offsets) override {
    XMOE_CHECK(recv_rows[0] == send_rows[0],
               "[all_to_all_v] single-process group: send and recv counts differ: send {} recv {}",
               send_rows[0], recv_rows[0]);
    if (send_rows[0] > 0)
      recv.rows(recv_offsets[0], recv_offsets[0] + recv_rows[0])
          .copy_from(send.rows(send_offsets[0], send_offsets[0] + send_rows[0]));
    return std::make_unique<DoneWork>();
  }
  std::vector<int64_t> do_all_to_all_counts(std::span<const int64_t> send) override {
    return {send.begin(), send.end()};
  }
  void do_broadcast(Tensor&, int) override {}
};

std::mutex world_mutex;
std::shared_ptr<Group> world_group;

}  // namespace

std::shared_ptr<Group> make_single_group() {
  return std::make_shared<SingleGroup>();
}

// The launcher's own variables, not xmoe knobs: those are declared in core/env.cpp.
bool launched_by_mpi() {
  for (const char* v :
       {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS"}) {
    if (std::getenv(v)) return true;
  }
  return false;
}

std::shared_ptr<Group> world(int ranks_per_node) {
  std::lock_guard<std::mutex> lock(world_mutex);
  if (!world_group) {
    world_group = launched_by_mpi() ? mpi::make_world(ranks_per_node) : make_single_group();
  }
  return world_group;
}

void finalize() {
  std::lock_guard<std::mutex> lock(world_mutex);
  if (world_group && world_group->backend_name() == "mpi") {
    world_group.reset();
    mpi::finalize();
  }
}

}  // namespace xmoe::comm
