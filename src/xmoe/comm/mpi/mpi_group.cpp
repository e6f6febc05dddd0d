// comm::Group over MPI for CPU buffers. Rows travel as a contiguous MPI datatype of one row's
// bytes, so counts stay small integers whatever the row width.
#include "xmoe/comm/mpi/mpi_group.h"

#include <mpi.h>

namespace xmoe::comm::mpi {

namespace {

void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  XMOE_FAIL("[mpi] {} failed: {}", call, std::string(text, static_cast<size_t>(len)));
}

#define MPI_CHECK(call) check_mpi((call), #call)

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u8:
      return MPI_UINT8_T;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::bf16:
      break;
  }
  XMOE_FAIL("[mpi] no reduction for dtype {}", dtype_name(t));
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return MPI_SUM;
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
  }
  return MPI_SUM;
}

/// A datatype of one row (freed with the object).
class RowType {
 public:
  explicit RowType(int64_t bytes) {
    MPI_CHECK(MPI_Type_contiguous(static_cast<int>(std::max<int64_t>(bytes, 1)), MPI_BYTE, &type_));
    MPI_CHECK(MPI_Type_commit(&type_));
  }
  ~RowType() { MPI_Type_free(&type_); }
  RowType(const RowType&) = delete;
  RowType& operator=(const RowType&) = delete;
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_;
};

/// MPI counts are int: rows (of one row's datatype) up to INT32_MAX per peer.
std::vector<int> to_int_counts(std::span<const int64_t> rows, const char* what) {
  std::vector<int> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    XMOE_CHECK(rows[i] <= INT32_MAX, "[all_to_all_v] {}[{}] = {} out of range", what, i, rows[i]);
    out[i] = static_cast<int>(rows[i]);
  }
  return out;
}

/// A non-blocking MPI collective; keeps its buffers and datatype alive until wait().
class MpiWork final : public Work {
 public:
  MpiWork(MPI_Request request, std::vector<Tensor> keep, std::unique_ptr<RowType> type,
          std::vector<std::vector<int>> counts)
      : request_(request),
        keep_(std::move(keep)),
        type_(std::move(type)),
        counts_(std::move(counts)) {}
  ~MpiWork() override {
    if (request_ != MPI_REQUEST_NULL) MPI_Wait(&request_, MPI_STATUS_IGNORE);
  }
  void wait() override { MPI_CHECK(MPI_Wait(&request_, MPI_STATUS_IGNORE)); }

 private:
  MPI_Request request_;
  std::vector<Tensor> keep_;
  std::unique_ptr<RowType> type_;
  std::vector<std::vector<int>> counts_;
};

class MpiGroup final : public Group {
 public:
  MpiGroup(MPI_Comm comm, Topology topology, bool owns)
      : Group("mpi", std::move(topology)), comm_(comm), owns_(owns) {
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  ~MpiGroup() override {
    if (owns_) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  [[noreturn]] void abort(int code) override {
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 protected:
  void do_barrier() override { MPI_CHECK(MPI_Barrier(comm_)); }

  void check_tensor(const Tensor& t, const char* op) const override {
    XMOE_CHECK(t.is_cpu(),
               "[{}] the MPI backend moves CPU tensors; got {} (use NCCL for GPU tensors)", op,
               t.str());
  }

  std::shared_ptr<Group> do_split(int color, int key) override {
    MPI_Comm sub;
    MPI_CHECK(MPI_Comm_split(comm_, color, key, &sub));
    int sub_size = 0;
    MPI_CHECK(MPI_Comm_size(sub, &sub_size));
    std::vector<int> parent_ranks(static_cast<size_t>(sub_size));
    MPI_CHECK(MPI_Allgather(&rank_, 1, MPI_INT, parent_ranks.data(), 1, MPI_INT, sub));
    return std::make_shared<MpiGroup>(sub, topology_.subset(parent_ranks), true);
  }

  std::unique_ptr<Work> do_all_reduce(Tensor& t, ReduceOp op) override {
    MPI_Request req;
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, t.raw(), static_cast<int>(t.numel()),
                             mpi_type(t.dtype()), mpi_op(op), comm_, &req));
    return std::make_unique<MpiWork>(req, std::vector<Tensor>{t}, nullptr,
                                     std::vector<std::vector<int>>{});
  }

  void do_all_gather(const Tensor& t, Tensor& out) override {
    MPI_CHECK(MPI_Allgather(t.raw(), static_cast<int>(t.nbytes()), MPI_BYTE, out.raw(),
                            static_cast<int>(t.nbytes()), MPI_BYTE, comm_));
  }

  std::unique_ptr<Work> do_reduce_scatter(const Tensor& t, Tensor& out) override {
    MPI_Request req;
    MPI_CHECK(MPI_Ireduce_scatter_block(t.raw(), out.raw(), static_cast<int>(out.numel()),
                                        mpi_type(t.dtype()), MPI_SUM, comm_, &req));
    return std::make_unique<MpiWork>(req, std::vector<Tensor>{t, out}, nullptr,
                                     std::vector<std::vector<int>>{});
  }

  std::unique_ptr<Work> do_all_to_all_v(const Tensor& send, std::span<const int64_t> send_rows,
                                        std::span<const int64_t> send_offsets, Tensor& recv,
                                        std::span<const int64_t> recv_rows,
                                        std::span<const int64_t> recv_offsets) override {
    auto sc = to_int_counts(send_rows, "send_rows"), rc = to_int_counts(recv_rows, "recv_rows");
    auto sd = to_int_counts(send_offsets, "send_offsets");
    auto rd = to_int_counts(recv_offsets, "recv_offsets");
    auto type = std::make_unique<RowType>(row_bytes(send));
    MPI_Request req;
    MPI_CHECK(MPI_Ialltoallv(send.raw(), sc.data(), sd.data(), type->get(), recv.raw(), rc.data(),
                             rd.data(), type->get(), comm_, &req));
    return std::make_unique<MpiWork>(req, std::vector<Tensor>{send, recv}, std::move(type),
                                     std::vector<std::vector<int>>{sc, rc, sd, rd});
  }

  std::vector<int64_t> do_all_to_all_counts(std::span<const int64_t> send) override {
    const int per = static_cast<int>(send.size() / static_cast<size_t>(size_));
    std::vector<int64_t> out(send.size());
    MPI_CHECK(MPI_Alltoall(send.data(), per, MPI_INT64_T, out.data(), per, MPI_INT64_T, comm_));
    return out;
  }

  void do_broadcast(Tensor& t, int root) override {
    MPI_CHECK(MPI_Bcast(t.raw(), static_cast<int>(t.nbytes()), MPI_BYTE, root, comm_));
  }

 private:
  MPI_Comm comm_;
  bool owns_;
  int rank_ = 0, size_ = 1;
};

bool we_initialised = false;

Topology detect_topology(MPI_Comm comm, int ranks_per_node) {
  int size = 0, rank = 0;
  MPI_CHECK(MPI_Comm_size(comm, &size));
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  if (ranks_per_node > 0) return Topology::uniform(size, ranks_per_node);
  // Ranks that can share memory are on one node; name the node by its lowest world rank.
  MPI_Comm local;
  MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local));
  int leader = rank;
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_MIN, local));
  MPI_Comm_free(&local);
  std::vector<int> nodes(static_cast<size_t>(size));
  MPI_CHECK(MPI_Allgather(&leader, 1, MPI_INT, nodes.data(), 1, MPI_INT, comm));
  return Topology(std::move(nodes));
}

}  // namespace

std::shared_ptr<Group> make_world(int ranks_per_node) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised) {
    int provided = 0;
    MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    we_initialised = true;
  }
  // Errors come back as codes that MPI_CHECK turns into xmoe::Error with MPI's own text.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  return std::make_shared<MpiGroup>(MPI_COMM_WORLD, detect_topology(MPI_COMM_WORLD, ranks_per_node),
                                    false);
}

void finalize() {
  int finalised = 0;
  MPI_Finalized(&finalised);
  if (we_initialised && !finalised) MPI_Finalize();
}

}  // namespace xmoe::comm::mpi
