// comm::Group over NCCL for CUDA tensors.
//
// Streams: every communicator owns a communication stream (non-blocking, highest priority). A
// collective first makes that stream wait for the device's current (compute) stream through an
// event, so it reads inputs that queued kernels are still producing; it then queues the NCCL
// call and records a "done" event on the communication stream. Work::wait() makes the compute
// stream — the current stream at the time of the wait — wait for that event. Neither side
// blocks the host: compute queued between the call and wait() overlaps the communication.
// The synchronous collectives are the async ones followed by wait(): their results are valid
// in stream order, as for any op; the host sees them through Tensor::to / to_vector.
//
// Memory: outputs are allocated on the compute stream before the first event is recorded, so a
// reused cache block is not written by NCCL before its previous users on the compute stream are
// done. A Work keeps its tensors alive until it is waited for (or destroyed, which waits), so
// their blocks return to the compute stream's free list only after the compute stream is
// ordered behind the communication.
#include "xmoe/comm/nccl/nccl_group.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "xmoe/backend/cuda/check.h"
#include "xmoe/backend/cuda/runtime.h"
#include "xmoe/comm/nccl/check.h"
#include "xmoe/core/device_api.h"

namespace xmoe::comm::nccl {

namespace {

/// NCCL element type of a reduction (movement collectives send bytes and take any dtype).
ncclDataType_t reduce_type(DType t, const char* op) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::f64:
      return ncclFloat64;
    case DType::u8:
      break;
  }
  XMOE_FAIL("[{}] no NCCL reduction for dtype {} (f32, bf16, i32, i64, f64)", op, dtype_name(t));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  return ncclSum;
}

/// Setup traffic (the id broadcast, host discovery) is not payload: keep it off the counters.
class CountersGuard {
 public:
  explicit CountersGuard(Group& g) : group_(g), saved_(g.counters()) {}
  ~CountersGuard() { group_.counters() = saved_; }
  CountersGuard(const CountersGuard&) = delete;
  CountersGuard& operator=(const CountersGuard&) = delete;

 private:
  Group& group_;
  ByteCounters saved_;
};

/// Events without timing, reused: a collective needs two, and creating one is a driver call.
/// Shared by the group and its pending Works, so a Work may outlive its group.
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  cudaEvent_t take() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    cuda::activate(device_);
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  /// A stream that waits on `e` captured its state at cudaStreamWaitEvent: it may be reused.
  void give(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(e);
  }

 private:
  int device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

/// A collective queued on the communication stream; wait() orders the compute stream after it.
class NcclWork final : public Work {
 public:
  NcclWork(int device, std::shared_ptr<EventPool> pool, cudaEvent_t done, std::vector<Tensor> keep)
      : device_(device), pool_(std::move(pool)), done_(done), keep_(std::move(keep)) {}
  ~NcclWork() override {
    if (!done_) return;
    // Not waited for: still order the compute stream after it before the tensors are freed.
    // Never throw from a destructor; a failure here means the device is already broken.
    try {
      if (cudaStreamWaitEvent(cuda::current_stream(device_), done_, 0) != cudaSuccess)
        cudaGetLastError();
    } catch (const Error&) {
    }
    pool_->give(done_);
  }
  NcclWork(const NcclWork&) = delete;
  NcclWork& operator=(const NcclWork&) = delete;

  void wait() override {
    if (!done_) return;
    CUDA_CHECK(cudaStreamWaitEvent(cuda::current_stream(device_), done_, 0));
    pool_->give(done_);
    done_ = nullptr;
    keep_.clear();  // freed blocks are now reused only after the communication
  }

 private:
  int device_;
  std::shared_ptr<EventPool> pool_;
  cudaEvent_t done_;
  std::vector<Tensor> keep_;
};

std::shared_ptr<Group> adopt(std::shared_ptr<Group> cpu, int device, ncclComm_t comm);

class NcclGroup final : public Group {
 public:
  NcclGroup(std::shared_ptr<Group> cpu, int device, ncclComm_t comm)
      : Group("nccl", cpu->topology()),
        cpu_(std::move(cpu)),
        device_(device),
        comm_(comm),
        events_(std::make_shared<EventPool>(device)) {
    rank_ = cpu_->rank();
    size_ = cpu_->size();
    int nccl_rank = -1, nccl_size = -1;
    NCCL_CHECK(ncclCommUserRank(comm_, &nccl_rank));
    NCCL_CHECK(ncclCommCount(comm_, &nccl_size));
    XMOE_CHECK(nccl_rank == rank_ && nccl_size == size_,
               "[nccl] communicator is rank {} of {} but its CPU group says rank {} of {}",
               nccl_rank, nccl_size, rank_, size_);
    cuda::activate(device_);
    int least = 0, greatest = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    // Highest priority: communication kernels get SMs ahead of queued compute blocks.
    CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
  }

  ~NcclGroup() override {
    if (watchdog_) watchdog_->forget(*this);
    // ncclCommDestroy waits for queued operations; every rank destroys its groups in the same
    // order (it synchronises the ranks of a node in recent NCCL versions).
    // An abandoned group (comm_ already aborted) neither waits nor destroys.
    if (cudaSetDevice(device_) != cudaSuccess) cudaGetLastError();
    if (comm_ && stream_ && cudaStreamSynchronize(stream_) != cudaSuccess) cudaGetLastError();
    if (comm_) ncclCommDestroy(comm_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  /// ncclCommAbort, once: frees the communicator without waiting for anything (nccl::abandon).
  void abandon() {
    if (!comm_) return;
    if (cudaSetDevice(device_) != cudaSuccess) cudaGetLastError();
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cuda(device_); }

  [[noreturn]] void abort(int code) override {
    // Unblocks NCCL kernels that wait for peers, then stops the job through the CPU group.
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
    cpu_->abort(code);
    std::_Exit(code);
  }

 protected:
  void check_tensor(const Tensor& t, const char* op) const override {
    require_live(op);
    XMOE_CHECK(t.device().is_cuda(),
               "[{}] the NCCL backend moves CUDA tensors; got {} (copy it to cuda:{}, or use the "
               "MPI group for CPU tensors)",
               op, t.str(), device_);
    XMOE_CHECK(t.device().index == device_, "[{}] {} is not on this group's device cuda:{}", op,
               t.str(), device_);
  }

  void do_barrier() override {
    // Everything queued on this device (compute and communication) is done, then the ranks meet.
    CUDA_CHECK(cudaStreamSynchronize(cuda::activate(device_)));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    cpu_->barrier();
  }

  std::shared_ptr<Group> do_split(int color, int key) override {
    // Both splits order the new ranks by key, then by old rank, so their rank numbers agree
    // (the constructor checks it).
    require_live("split");
    std::shared_ptr<Group> sub_cpu = cpu_->split(color, key);
    cuda::activate(device_);
    ncclComm_t sub = nullptr;
    NCCL_CHECK(ncclCommSplit(comm_, color, key, &sub, nullptr));
    return adopt(std::move(sub_cpu), device_, sub);
  }

  std::unique_ptr<Work> do_all_reduce(Tensor& t, ReduceOp op) override {
    const ncclDataType_t type = reduce_type(t.dtype(), "all_reduce");
    cudaStream_t s = begin();
    if (t.numel() > 0)
      NCCL_CHECK(ncclAllReduce(t.raw(), t.raw(), static_cast<size_t>(t.numel()), type, nccl_op(op),
                               comm_, s));
    return finish({t}, "all_reduce");
  }

  void do_all_gather(const Tensor& t, Tensor& out) override {
    cudaStream_t s = begin();
    if (t.nbytes() > 0)
      NCCL_CHECK(ncclAllGather(t.raw(), out.raw(), t.nbytes(), ncclUint8, comm_, s));
    finish({t, out}, "all_gather")->wait();
  }

  std::unique_ptr<Work> do_reduce_scatter(const Tensor& t, Tensor& out) override {
    const ncclDataType_t type = reduce_type(t.dtype(), "reduce_scatter");
    cudaStream_t s = begin();
    if (out.numel() > 0)
      NCCL_CHECK(ncclReduceScatter(t.raw(), out.raw(), static_cast<size_t>(out.numel()), type,
                                   ncclSum, comm_, s));
    return finish({t, out}, "reduce_scatter");
  }

  std::unique_ptr<Work> do_all_to_all_v(const Tensor& send, std::span<const int64_t> send_rows,
                                        std::span<const int64_t> send_offsets, Tensor& recv,
                                        std::span<const int64_t> recv_rows,
                                        std::span<const int64_t> recv_offsets) override {
    const int64_t rb = row_bytes(send);
    cudaStream_t s = begin();
    // One group of point-to-point calls (the self pair included); a peer with zero rows each
    // way gets no call, but every rank opens and closes the group. The first failure is kept
    // so that the group is always closed.
    auto* src = static_cast<const char*>(send.raw());
    auto* dst = static_cast<char*>(recv.raw());
    ncclResult_t first = ncclSuccess;
    const char* failed = "";
    auto keep_first = [&](ncclResult_t r, const char* call) {
      if (r == ncclSuccess || first != ncclSuccess) return;
      first = r;
      failed = call;
    };
    NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < size_; ++p) {
      const auto sb = static_cast<size_t>(send_rows[p] * rb);
      const auto rbytes = static_cast<size_t>(recv_rows[p] * rb);
      if (sb > 0)
        keep_first(ncclSend(src + send_offsets[p] * rb, sb, ncclUint8, p, comm_, s), "ncclSend");
      if (rbytes > 0)
        keep_first(ncclRecv(dst + recv_offsets[p] * rb, rbytes, ncclUint8, p, comm_, s),
                   "ncclRecv");
    }
    const ncclResult_t end = ncclGroupEnd();
    XMOE_CHECK(first == ncclSuccess, "[nccl] {} in all_to_all_v failed: {}{}", failed,
               ncclGetErrorString(first), last_error_detail());
    NCCL_CHECK(end);
    return finish({send, recv}, "all_to_all_v");
  }

  std::vector<int64_t> do_all_to_all_counts(std::span<const int64_t> send) override {
    // Counts are small and needed on the host: they travel over the CPU group, counted here
    // (as this group's traffic) and not again on the CPU group's counters.
    return uncounted_all_to_all_counts(*cpu_, send);
  }

  void do_broadcast(Tensor& t, int root) override {
    cudaStream_t s = begin();
    if (t.nbytes() > 0)
      NCCL_CHECK(ncclBroadcast(t.raw(), t.raw(), t.nbytes(), ncclUint8, root, comm_, s));
    finish({t}, "broadcast")->wait();
  }

 private:
  void require_live(const char* op) const {
    XMOE_CHECK(comm_ != nullptr,
               "[{}] this NCCL group was abandoned after an error (nccl::abandon); make a new one",
               op);
  }

  /// Makes the communication stream wait for the work queued so far on the compute stream.
  cudaStream_t begin() {
    const cuda::Stream compute = cuda::activate(device_);
    cudaEvent_t ready = events_->take();
    CUDA_CHECK(cudaEventRecord(ready, compute));
    CUDA_CHECK(cudaStreamWaitEvent(stream_, ready, 0));
    events_->give(ready);
    return stream_;
  }

  /// Records the end of the queued collective `op`; the Work orders the compute stream after
  /// it. The host does not wait for it here (a peer that never comes blocks the device, and
  /// the host only at a later synchronisation), so the watchdog watches the communication
  /// stream: the collective is done once the stream has drained.
  std::unique_ptr<Work> finish(std::vector<Tensor> keep, const char* op) {
    cudaEvent_t done = events_->take();
    CUDA_CHECK(cudaEventRecord(done, stream_));
    if (watchdog_)
      watchdog_->watch_queued(op, *this, [device = device_, stream = stream_] {
        if (cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
        const cudaError_t state = cudaStreamQuery(stream);
        if (state != cudaErrorNotReady && state != cudaSuccess) cudaGetLastError();
        return state != cudaErrorNotReady;
      });
    return std::make_unique<NcclWork>(device_, events_, done, std::move(keep));
  }

  std::shared_ptr<Group> cpu_;
  int device_;
  ncclComm_t comm_;
  std::shared_ptr<EventPool> events_;
  cudaStream_t stream_ = nullptr;
  int rank_ = 0, size_ = 1;
};

/// The group owning `comm` (destroyed here if the group cannot be built).
std::shared_ptr<Group> adopt(std::shared_ptr<Group> cpu, int device, ncclComm_t comm) {
  try {
    return std::make_shared<NcclGroup>(std::move(cpu), device, comm);
  } catch (...) {
    ncclCommDestroy(comm);
    throw;
  }
}

}  // namespace

bool available() {
  return true;
}

std::shared_ptr<Group> make_group(std::shared_ptr<Group> cpu_group, int device) {
  XMOE_CHECK(cpu_group != nullptr, "[nccl] make_group: no CPU group");
  XMOE_CHECK(cpu_group->device().is_cpu(),
             "[nccl] make_group bootstraps over a CPU group (MPI or single); got a {} group on {}",
             cpu_group->backend_name(), cpu_group->device().str());
  // Checked before any communication, so a bad device fails every rank alike instead of
  // leaving the others waiting for the id.
  const int devices = backend::cuda_device_count();
  XMOE_CHECK(device >= 0 && device < devices,
             "[nccl] make_group: cuda:{} requested but {} CUDA device(s) are visible", device,
             devices);
  cuda::activate(device);

  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (cpu_group->rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  {
    CountersGuard guard(*cpu_group);
    Tensor buf = Tensor::empty({static_cast<int64_t>(sizeof(id))}, DType::u8);
    std::memcpy(buf.raw(), &id, sizeof(id));
    cpu_group->broadcast(buf, 0);
    std::memcpy(&id, buf.raw(), sizeof(id));
  }
  ncclComm_t comm = nullptr;
  NCCL_CHECK(ncclCommInitRank(&comm, cpu_group->size(), id, cpu_group->rank()));
  return adopt(std::move(cpu_group), device, comm);
}

HostRanks host_ranks(Group& cpu_group) {
  XMOE_CHECK(cpu_group.device().is_cpu(), "[nccl] host_ranks needs a CPU group, got {}",
             cpu_group.backend_name());
  constexpr int64_t kName = 256;
  Tensor mine = Tensor::zeros({1, kName}, DType::u8);
  gethostname(static_cast<char*>(mine.raw()), kName - 1);
  CountersGuard guard(cpu_group);
  const Tensor all = cpu_group.all_gather(mine);
  const auto* names = static_cast<const char*>(all.raw());
  const char* me = names + cpu_group.rank() * kName;
  HostRanks out{0, 0};
  for (int p = 0; p < cpu_group.size(); ++p) {
    if (std::strncmp(names + p * kName, me, kName) != 0) continue;
    if (p < cpu_group.rank()) ++out.local_rank;
    ++out.local_size;
  }
  return out;
}

void abandon(Group& group) {
  if (auto* g = dynamic_cast<NcclGroup*>(&group)) g->abandon();
}

std::shared_ptr<Group> make_world(int ranks_per_node) {
  std::shared_ptr<Group> world = comm::world(ranks_per_node);
  const HostRanks host = host_ranks(*world);
  const int devices = backend::cuda_device_count();
  // Agree before creating the communicator: a rank that throws alone would leave the others
  // waiting in ncclCommInitRank.
  int worst = 0;
  {
    CountersGuard guard(*world);
    Tensor short_by = Tensor::from_vector<int32_t>({host.local_size - devices}, {1});
    world->all_reduce(short_by, ReduceOp::max);
    worst = short_by.data<int32_t>()[0];
  }
  XMOE_CHECK(worst <= 0,
             "[nccl] a host runs more ranks than it has CUDA devices (here: {} ranks, {} devices; "
             "worst host short by {}): NCCL needs one device per rank",
             host.local_size, devices, worst);
  return make_group(std::move(world), host.local_rank);
}

}  // namespace xmoe::comm::nccl
