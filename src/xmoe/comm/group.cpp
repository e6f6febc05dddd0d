#include "xmoe/comm/group.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "xmoe/core/device_api.h"
#include "xmoe/comm/mpi/mpi_group.h"

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

namespace {

class DoneWork final : public Work {
 public:
  void wait() override {}
};

/// Size-1 group: every collective is the identity (or a copy).
class SingleGroup final : public Group {
 public:
  SingleGroup() : Group("single", Topology()) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::shared_ptr<Group> split(int, int) override { return std::make_shared<SingleGroup>(); }
  void all_reduce(Tensor&, ReduceOp) override { ++counters_.calls[ByteCounters::all_reduce]; }
  std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op) override {
    all_reduce(t, op);
    return std::make_unique<DoneWork>();
  }
  Tensor all_gather(const Tensor& t) override { return t.clone(); }
  Tensor reduce_scatter(const Tensor& t) override { return t.clone(); }
  Tensor all_to_all_v(const Tensor& send, std::span<const int64_t> send_rows,
                      std::span<const int64_t> recv_rows) override {
    check_counts(send, send_rows, recv_rows);
    ++counters_.calls[ByteCounters::all_to_all];
    return send.clone();
  }
  std::unique_ptr<Work> all_to_all_v_async(const Tensor& send, std::span<const int64_t> send_rows,
                                           std::span<const int64_t> recv_rows,
                                           Tensor& recv) override {
    recv = all_to_all_v(send, send_rows, recv_rows);
    return std::make_unique<DoneWork>();
  }
  std::vector<int64_t> all_to_all_counts(std::span<const int64_t> send) override {
    return {send.begin(), send.end()};
  }
  void broadcast(Tensor&, int root) override {
    XMOE_CHECK(root == 0, "[comm] broadcast root {} in a group of size 1", root);
  }
  void barrier() override {}
  [[noreturn]] void abort(int code) override { std::_Exit(code); }

 private:
  static void check_counts(const Tensor& send, std::span<const int64_t> s,
                           std::span<const int64_t> r) {
    XMOE_CHECK(s.size() == 1 && r.size() == 1 && s[0] == r[0] && s[0] == send.size(0),
               "[all_to_all_v] single-process group: counts must be [{}], got send {} recv {}",
               send.size(0), s.size() ? s[0] : -1, r.size() ? r[0] : -1);
  }
};

std::mutex world_mutex;
std::shared_ptr<Group> world_group;

}  // namespace

std::shared_ptr<Group> make_single_group() { return std::make_shared<SingleGroup>(); }

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE",
                        "SLURM_NTASKS"}) {
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
