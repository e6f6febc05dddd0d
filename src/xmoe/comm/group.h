#pragma once
// Communication groups. One abstract Group (rank, size, split, collectives) with backends:
// single-process (in comm/group.cpp), MPI for CPU buffers (comm/mpi/), and NCCL for device
// buffers (comm/nccl/, with the CUDA backend). Collectives work on contiguous tensors; the
// *_async variants return a Work handle so communication can overlap compute.
#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "xmoe/comm/topology.h"
#include "xmoe/comm/watchdog.h"
#include "xmoe/core/tensor.h"

namespace xmoe::comm {

enum class ReduceOp : uint8_t { sum, max, min };

/// Payload bytes this rank sent, per collective kind and link class. Bytes are counted per
/// destination peer as the data a direct exchange would move (all_to_all_v: exactly the rows
/// sent to each peer; all_gather: this rank's block to each peer; reduce_scatter: block j to
/// peer j; all_reduce = reduce_scatter + all_gather), so they do not depend on the library's
/// internal algorithm. Messages to oneself are not counted.
struct ByteCounters {
  /// counts: the metadata exchange (all_to_all_counts) that precedes an all_to_all_v.
  enum Kind : int {
    all_to_all,
    counts,
    all_gather,
    reduce_scatter,
    all_reduce,
    broadcast,
    num_kinds
  };
  std::array<std::array<int64_t, 2>, num_kinds> bytes{};  // [kind][LinkClass]
  std::array<int64_t, num_kinds> calls{};

  int64_t total(LinkClass link) const;
  int64_t of(Kind kind, LinkClass link) const { return bytes[kind][static_cast<int>(link)]; }
  void reset() { *this = ByteCounters{}; }
};

/// A pending collective. wait() blocks until it is done and its outputs are valid.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
};

/// A group of processes and its collectives. The public collectives are the same for every
/// backend: they check their arguments, allocate the outputs and count the payload bytes, then
/// call the backend's transport (the protected do_* functions), so a backend holds only what
/// moves the data. Errors name the collective: "[all_to_all_v] need 4 send and recv counts...".
class Group {
 public:
  virtual ~Group() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Ranks with the same color (>= 0) form a new group, ordered by key (then by old rank).
  /// Collective.
  std::shared_ptr<Group> split(int color, int key);
  /// Which node each rank of this group is on.
  const Topology& topology() const { return topology_; }
  /// The same ranks (a new communicator) with declared nodes of `ranks_per_node` consecutive
  /// ranks, to simulate several nodes on one machine. Collective.
  std::shared_ptr<Group> with_declared_nodes(int ranks_per_node);
  /// Where the tensors this group moves live: the CPU (single, MPI) or cuda:i (NCCL).
  virtual Device device() const { return Device::cpu(); }

  /// In-place reduction over all ranks (f32, i32, i64; NCCL also bf16). The async variant
  /// returns a Work whose wait() makes the result valid.
  void all_reduce(Tensor& t, ReduceOp op = ReduceOp::sum) { all_reduce_async(t, op)->wait(); }
  std::unique_ptr<Work> all_reduce_async(Tensor& t, ReduceOp op = ReduceOp::sum);
  /// Concatenation of every rank's `t` along dim 0 (all ranks give the same shape).
  Tensor all_gather(const Tensor& t);
  /// Sum over ranks of `t`, scattered along dim 0: rank r gets rows [r·n/size, (r+1)·n/size).
  /// The async variant allocates `out` and returns a Work whose wait() makes it valid (the
  /// blocking one is it, waited: both give the same bits).
  Tensor reduce_scatter(const Tensor& t) {
    Tensor out;
    reduce_scatter_async(t, out)->wait();
    return out;
  }
  std::unique_ptr<Work> reduce_scatter_async(const Tensor& t, Tensor& out);
  /// Uneven all-to-all over dim 0: rows [o_p, o_p + send_rows[p]) of `send` go to rank p; the
  /// result holds, in rank order, recv_rows[p] rows from each rank p. Zero rows are fine.
  Tensor all_to_all_v(const Tensor& send, std::span<const int64_t> send_rows,
                      std::span<const int64_t> recv_rows) {
    Tensor recv;
    all_to_all_v_async(send, send_rows, recv_rows, recv)->wait();
    return recv;
  }
  /// all_to_all_v into `recv` (allocated here), valid after the Work's wait().
  std::unique_ptr<Work> all_to_all_v_async(const Tensor& send, std::span<const int64_t> send_rows,
                                           std::span<const int64_t> recv_rows, Tensor& recv);
  /// all_to_all_v between row ranges of existing tensors, without copies (the pipelined MoE
  /// layer moves a chunk straight out of, and back into, whole buffers): rows
  /// [send_offsets[p], + send_rows[p]) of `send` go to rank p; the recv_rows[p] rows from rank p
  /// land at rows [recv_offsets[p], + recv_rows[p]) of `recv`, whose other rows are left alone.
  /// Ranges lie inside the tensors; recv ranges do not overlap. Valid after the Work's wait().
  std::unique_ptr<Work> all_to_all_v_rows_async(const Tensor& send,
                                                std::span<const int64_t> send_rows,
                                                std::span<const int64_t> send_offsets, Tensor& recv,
                                                std::span<const int64_t> recv_rows,
                                                std::span<const int64_t> recv_offsets);
  /// Every rank gets `count` int64 values from every rank: out[p * count + i] (metadata
  /// exchange before all_to_all_v).
  std::vector<int64_t> all_to_all_counts(std::span<const int64_t> send);
  void broadcast(Tensor& t, int root);
  void barrier();
  /// Stops every process of the job (after an unrecoverable error on this rank).
  [[noreturn]] virtual void abort(int code) = 0;

  /// The collective watchdog of this group and of the groups split from it later (null: none).
  void set_watchdog(std::shared_ptr<Watchdog> watchdog) { watchdog_ = std::move(watchdog); }
  const std::shared_ptr<Watchdog>& watchdog() const { return watchdog_; }

  ByteCounters& counters() { return counters_; }
  const ByteCounters& counters() const { return counters_; }
  std::string backend_name() const { return backend_; }

 protected:
  Group(std::string backend, Topology topology)
      : backend_(std::move(backend)), topology_(std::move(topology)) {}

  // The transport of each backend. Arguments arrive checked (check_tensor included) and
  // outputs allocated; the bytes are counted after the call returns.

  /// Throws, naming `op`, unless this backend moves `t` (where it lives, group still usable).
  virtual void check_tensor(const Tensor& t, const char* op) const = 0;
  virtual std::shared_ptr<Group> do_split(int color, int key) = 0;
  virtual std::unique_ptr<Work> do_all_reduce(Tensor& t, ReduceOp op) = 0;
  /// `out`: [size·n, ...] for `t` [n, ...].
  virtual void do_all_gather(const Tensor& t, Tensor& out) = 0;
  /// `out`: [n/size, ...] for `t` [n, ...]; the reduction is a sum.
  virtual std::unique_ptr<Work> do_reduce_scatter(const Tensor& t, Tensor& out) = 0;
  /// Rows [send_offsets[p], + send_rows[p]) of `send` to rank p, rows from rank p to
  /// [recv_offsets[p], + recv_rows[p]) of `recv` (same dtype and row width); counts and
  /// offsets are >= 0, one per rank, and the ranges inside the tensors.
  virtual std::unique_ptr<Work> do_all_to_all_v(const Tensor& send,
                                                std::span<const int64_t> send_rows,
                                                std::span<const int64_t> send_offsets, Tensor& recv,
                                                std::span<const int64_t> recv_rows,
                                                std::span<const int64_t> recv_offsets) = 0;
  /// `send.size()` is a multiple of size().
  virtual std::vector<int64_t> do_all_to_all_counts(std::span<const int64_t> send) = 0;
  virtual void do_broadcast(Tensor& t, int root) = 0;
  virtual void do_barrier() = 0;

  /// Watches the collective `name` while the Scope lives (nothing without a watchdog).
  Watchdog::Scope watch(const char* name) {
    return watchdog_ ? watchdog_->watch(name, *this) : Watchdog::Scope();
  }
  /// A Work whose wait() is watched as `name`.
  std::unique_ptr<Work> watched(std::unique_ptr<Work> work, const char* name);

  /// all_to_all_counts over `other` without touching its counters: for a backend that carries
  /// its host-side exchanges over another group and counts them as its own.
  static std::vector<int64_t> uncounted_all_to_all_counts(Group& other,
                                                          std::span<const int64_t> send) {
    return other.do_all_to_all_counts(send);
  }
  /// Bytes of one dim-0 row (defined by the trailing dims, also when there are no rows).
  static int64_t row_bytes(const Tensor& t);

  std::string backend_;
  Topology topology_;
  ByteCounters counters_;
  std::shared_ptr<Watchdog> watchdog_;

 private:
  void count(ByteCounters::Kind kind, int peer, int64_t bytes);
};

/// The single-process group (size 1): collectives are copies.
std::shared_ptr<Group> make_single_group();

/// The world group: MPI when the process was started by mpirun/srun (and xmoe was built with
/// MPI), else the single-process group. `ranks_per_node` > 0 declares simulated nodes.
/// The first call initialises MPI; later calls return the same group.
std::shared_ptr<Group> world(int ranks_per_node = 0);
/// True when this process was launched by an MPI launcher (OMPI/PMI/PMIx/Slurm variables).
bool launched_by_mpi();
/// Finalises MPI if world() initialised it (call once at the end of main).
void finalize();

}  // namespace xmoe::comm
