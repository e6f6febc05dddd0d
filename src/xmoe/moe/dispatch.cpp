#include "xmoe/moe/dispatch.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "xmoe/moe/dispatch_rbd.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

namespace {

std::vector<int64_t> prefix_sums(std::span<const int64_t> v) {
  std::vector<int64_t> out(v.size() + 1, 0);
  for (size_t i = 0; i < v.size(); ++i) out[i + 1] = out[i] + v[i];
  return out;
}

/// all_to_all (and local) chunk by chunk. Chunk c sends, to each rank p, the rows of its experts
/// [p E_local + b_c, p E_local + b_{c+1}): a contiguous range of the source rows, moved in place
/// (Group::all_to_all_v_rows_async); they arrive by source and are permuted into expert-major
/// order, as dispatch does for all rows. On the way back each chunk's rows land straight in
/// their ranges of the [N, d] result. Both directions of the layer move rows alike (forward:
/// dispatch, combine; backward: combine_backward, dispatch_backward).
class AllToAllPass final : public ChunkedPass {
 public:
  /// group: the ep group, or null for one rank (the chunks are then views and copies).
  AllToAllPass(const Tensor& src, const DispatchHandle& h, const ChunkBounds& bounds,
               std::shared_ptr<comm::Group> group)
      : src_(src), group_(std::move(group)) {
    XMOE_CHECK(src.dim() == 2 && src.size(0) == h.num_send_rows,
               "[moe pipeline] source rows {} but the handle has {}", src.str(), h.num_send_rows);
    const int64_t El = static_cast<int64_t>(h.recv_tokens_per_expert.size());
    const int P = group_ ? group_->size() : 1;
    const std::vector<int64_t> send_start = prefix_sums(h.send_tokens_per_expert);
    const int chunks = static_cast<int>(bounds.size()) - 1;
    chunks_.resize(chunks);
    for (int c = 0; c < chunks; ++c) {
      Chunk& k = chunks_[c];
      const int64_t b0 = bounds[c], b1 = bounds[c + 1];
      k.recv_rows.assign(P, 0);
      k.send_rows.assign(P, 0);
      k.send_offsets.assign(P, 0);
      for (int p = 0; p < P; ++p) {
        k.send_offsets[p] = send_start[p * El + b0];
        k.send_rows[p] = send_start[p * El + b1] - k.send_offsets[p];
        if (!group_) k.recv_rows[p] = k.send_rows[p];
        for (int64_t i = b0; group_ && i < b1; ++i)
          k.recv_rows[p] += h.recv_counts_per_expert[p * El + i];
      }
      k.recv_offsets = prefix_sums(k.recv_rows);
      k.recv_offsets.pop_back();
      if (!group_) continue;
      // Within the chunk: arrival = (source, expert) blocks, expert order = (expert, source).
      const int64_t n = std::accumulate(k.recv_rows.begin(), k.recv_rows.end(), int64_t{0});
      std::vector<int64_t> block(static_cast<size_t>(P * (b1 - b0)), 0);  // arrival starts
      for (int64_t b = 1, m = P * (b1 - b0); b < m; ++b) {
        const int64_t p = (b - 1) / (b1 - b0), i = b0 + (b - 1) % (b1 - b0);
        block[b] = block[b - 1] + h.recv_counts_per_expert[p * El + i];
      }
      std::vector<int32_t> to_expert(static_cast<size_t>(n)), to_arrival(static_cast<size_t>(n));
      int64_t j = 0;
      for (int64_t i = b0; i < b1; ++i)
        for (int p = 0; p < P; ++p) {
          const int64_t start = block[p * (b1 - b0) + (i - b0)];
          for (int64_t q = 0; q < h.recv_counts_per_expert[p * El + i]; ++q, ++j) {
            to_expert[j] = static_cast<int32_t>(start + q);
            to_arrival[start + q] = static_cast<int32_t>(j);
          }
        }
      // Uploaded before the pipeline starts: no host copy between its chunks.
      k.to_expert = Tensor::from_vector(to_expert, {n}, src.device());
      k.to_arrival = Tensor::from_vector(to_arrival, {n}, src.device());
    }
    result_ = Tensor::empty(src.shape(), src.dtype(), src.device());
  }

  void start_in(int c) override {
    if (!group_) return;
    Chunk& k = chunks_.at(c);
    k.arrival = Tensor::empty({k.to_expert.size(0), src_.size(1)}, src_.dtype(), src_.device());
    k.in = group_->all_to_all_v_rows_async(src_, k.send_rows, k.send_offsets, k.arrival,
                                           k.recv_rows, k.recv_offsets);
  }

  Tensor wait_in(int c) override {
    Chunk& k = chunks_.at(c);
    if (!group_)  // one rank: the chunk's rows are a range of the source
      return src_.rows(k.send_offsets[0], k.send_offsets[0] + k.send_rows[0]);
    XMOE_CHECK(k.in != nullptr, "[moe pipeline] wait_in({}) before start_in", c);
    k.in->wait();
    k.in.reset();
    return xmoe::ops::gather_rows(std::exchange(k.arrival, Tensor()), k.to_expert);
  }

  void start_out(int c, Tensor out) override {
    Chunk& k = chunks_.at(c);
    if (!group_) {
      result_.rows(k.send_offsets[0], k.send_offsets[0] + k.send_rows[0]).copy_from(out);
      return;
    }
    k.back = xmoe::ops::gather_rows(out, k.to_arrival);  // (source, expert) order
    k.out = group_->all_to_all_v_rows_async(k.back, k.recv_rows, k.recv_offsets, result_,
                                            k.send_rows, k.send_offsets);
  }

  Tensor finish() override {
    for (Chunk& k : chunks_)
      if (k.out) k.out->wait();
    chunks_.clear();
    return std::exchange(result_, Tensor());
  }

 private:
  struct Chunk {
    std::vector<int64_t> send_rows, send_offsets, recv_rows, recv_offsets;  // [P]
    Tensor to_expert, to_arrival;  // i32 [n_c]: the chunk's permutations (not with one rank)
    Tensor arrival, back;          // the chunk's rows while they move
    std::unique_ptr<comm::Work> in, out;
  };
  Tensor src_, result_;
  std::shared_ptr<comm::Group> group_;
  std::vector<Chunk> chunks_;
};

/// One process owns every expert: dispatch and combine hand the rows through unchanged.
class LocalDispatcher final : public Dispatcher {
 public:
  explicit LocalDispatcher(const DispatchConfig& c) : num_experts_(c.num_experts) {
    XMOE_CHECK(c.ep_size == 1, "[moe dispatch local] needs ep_size = 1, got {}", c.ep_size);
  }
  std::string_view name() const override { return "local"; }
  bool pipelines() const override { return true; }
  bool moves_rows() const override { return false; }

  DispatchResult dispatch(const Tensor& rows, std::span<const int64_t> tpe) override {
    XMOE_CHECK(static_cast<int64_t>(tpe.size()) == num_experts_,
               "[moe dispatch local] {} counts for {} experts", tpe.size(), num_experts_);
    // Undefined rows (the experts read x through the order's indices): the counts alone.
    const int64_t n = std::accumulate(tpe.begin(), tpe.end(), int64_t{0});
    XMOE_CHECK(!rows.defined() || rows.size(0) == n,
               "[moe dispatch local] {} rows for counts that sum to {}", rows.size(0), n);
    DispatchResult r;
    r.rows = rows;
    r.handle.send_tokens_per_expert.assign(tpe.begin(), tpe.end());
    r.handle.recv_tokens_per_expert.assign(tpe.begin(), tpe.end());
    r.handle.num_send_rows = r.handle.num_recv_rows = n;
    r.handle.send_counts = r.handle.recv_counts = {n};
    return r;
  }
  Tensor combine(const Tensor& out, const DispatchHandle& h) override { return checked(out, h); }
  Tensor dispatch_backward(const Tensor& d, const DispatchHandle& h) override {
    return checked(d, h);
  }
  Tensor combine_backward(const Tensor& d, const DispatchHandle& h) override {
    return checked(d, h);
  }
  DispatchHandle plan(const Tensor& rows, std::span<const int64_t> tpe, const RowInfo&) override {
    return dispatch(rows, tpe).handle;
  }
  std::unique_ptr<ChunkedPass> forward_pass(const Tensor& rows, DispatchHandle& h,
                                            const ChunkBounds& bounds) override {
    return std::make_unique<AllToAllPass>(rows, h, bounds, nullptr);
  }
  std::unique_ptr<ChunkedPass> backward_pass(const Tensor& d, DispatchHandle& h,
                                             const ChunkBounds& bounds) override {
    return std::make_unique<AllToAllPass>(d, h, bounds, nullptr);
  }

 private:
  static Tensor checked(const Tensor& t, const DispatchHandle& h) {
    XMOE_CHECK(t.dim() == 2 && t.size(0) == h.num_recv_rows,
               "[moe dispatch local] {} does not match the handle's {} rows", t.str(),
               h.num_recv_rows);
    return t;
  }
  int64_t num_experts_;
};

/// DeepEP-style expert parallelism over the ep group: expert e lives on ep rank e / E_local.
///   dispatch: all_to_all_counts of the [E] per-expert counts (each rank learns, per source,
///             how many rows come for each local expert), then one all_to_all_v of exactly the
///             routed rows, then a permutation from (source, expert) to (expert, source) order.
///   combine:  the inverse permutation, then all_to_all_v back with the counts swapped.
/// With one rank it is the identity (exactly `local`).
class AllToAllDispatcher final : public Dispatcher {
 public:
  explicit AllToAllDispatcher(const DispatchConfig& c)
      : num_experts_(c.num_experts), ep_size_(c.ep_size), group_(c.group) {
    XMOE_CHECK(c.ep_size >= 1 && c.num_experts % c.ep_size == 0,
               "[moe dispatch all_to_all] moe.num_experts = {} is not divisible by ep = {}",
               c.num_experts, c.ep_size);
    XMOE_CHECK(c.ep_size == 1 || group_,
               "[moe dispatch all_to_all] ep = {} needs a communication group", c.ep_size);
    if (group_)
      XMOE_CHECK(group_->size() == c.ep_size && group_->rank() == c.ep_rank,
                 "[moe dispatch all_to_all] group is rank {} of {}, config says {} of {}",
                 group_->rank(), group_->size(), c.ep_rank, c.ep_size);
    num_local_ = num_experts_ / ep_size_;
  }
  std::string_view name() const override { return "all_to_all"; }
  bool pipelines() const override { return true; }
  bool moves_rows() const override { return ep_size_ > 1; }

  DispatchResult dispatch(const Tensor& rows, std::span<const int64_t> tpe) override {
    DispatchResult r;
    r.handle = plan(rows, tpe, RowInfo{});
    if (ep_size_ == 1) {  // one rank: the identity, bit for bit what `local` does
      r.rows = rows;
      return r;
    }
    const DispatchHandle& h = r.handle;
    Tensor arrival = group_->all_to_all_v(rows, h.send_counts, h.recv_counts);  // [N_recv, d]
    r.rows = xmoe::ops::gather_rows(arrival, h.recv_layout);                    // expert-major
    return r;
  }

  DispatchHandle plan(const Tensor& rows, std::span<const int64_t> tpe, const RowInfo&) override {
    const char* op = "moe dispatch all_to_all";
    XMOE_CHECK(static_cast<int64_t>(tpe.size()) == num_experts_, "[{}] {} counts for {} experts",
               op, tpe.size(), num_experts_);
    const int64_t N = std::accumulate(tpe.begin(), tpe.end(), int64_t{0});
    XMOE_CHECK(rows.defined() || ep_size_ == 1, "[{}] no rows to send to {} ranks", op, ep_size_);
    if (rows.defined()) {
      XMOE_CHECK(rows.dim() == 2, "[{}] rows must be [N, d], got {}", op, rows.str());
      XMOE_CHECK(rows.size(0) == N, "[{}] counts sum to {} rows but rows is {}", op, N, rows.str());
    }
    DispatchHandle h;
    h.send_tokens_per_expert.assign(tpe.begin(), tpe.end());
    h.num_send_rows = N;
    if (ep_size_ == 1) {
      h.recv_tokens_per_expert = h.recv_counts_per_expert = h.send_tokens_per_expert;
      h.send_counts = h.recv_counts = {N};
      h.num_recv_rows = N;
      return h;
    }
    const int P = ep_size_;
    const int64_t El = num_local_;
    // Rows are grouped by global expert, so the rows for rank p are the contiguous block of
    // experts [p * El, (p + 1) * El).
    h.send_counts.assign(P, 0);
    for (int64_t e = 0; e < num_experts_; ++e) h.send_counts[e / El] += tpe[e];
    // recv_counts_per_expert[p * El + i]: rows source p sends for our local expert i.
    h.recv_counts_per_expert = group_->all_to_all_counts(tpe);
    h.recv_counts.assign(P, 0);
    h.recv_tokens_per_expert.assign(El, 0);
    for (int p = 0; p < P; ++p)
      for (int64_t i = 0; i < El; ++i) {
        h.recv_counts[p] += h.recv_counts_per_expert[p * El + i];
        h.recv_tokens_per_expert[i] += h.recv_counts_per_expert[p * El + i];
      }
    h.num_recv_rows = std::accumulate(h.recv_counts.begin(), h.recv_counts.end(), int64_t{0});
    make_layouts(h, rows.device());
    return h;
  }

  std::unique_ptr<ChunkedPass> forward_pass(const Tensor& rows, DispatchHandle& h,
                                            const ChunkBounds& bounds) override {
    // A group of one rank still exchanges (NCCL: a self send/recv on the communication stream).
    return std::make_unique<AllToAllPass>(rows, h, bounds, group_);
  }
  std::unique_ptr<ChunkedPass> backward_pass(const Tensor& d, DispatchHandle& h,
                                             const ChunkBounds& bounds) override {
    check(d, h.num_send_rows, "combine backward", "d_combined");
    return std::make_unique<AllToAllPass>(d, h, bounds, group_);
  }

  Tensor combine(const Tensor& expert_out, const DispatchHandle& h) override {
    check(expert_out, h.num_recv_rows, "combine", "expert_out");
    if (ep_size_ == 1) return expert_out;
    Tensor arrival = xmoe::ops::gather_rows(expert_out, h.arrival_layout);  // (source, expert)
    return group_->all_to_all_v(arrival, h.recv_counts, h.send_counts);     // [N, d]
  }

  Tensor dispatch_backward(const Tensor& d_recv, const DispatchHandle& h) override {
    check(d_recv, h.num_recv_rows, "dispatch backward", "d_recv");
    return combine(d_recv, h);
  }

  Tensor combine_backward(const Tensor& d_combined, const DispatchHandle& h) override {
    check(d_combined, h.num_send_rows, "combine backward", "d_combined");
    if (ep_size_ == 1) return d_combined;
    Tensor arrival = group_->all_to_all_v(d_combined, h.send_counts, h.recv_counts);
    return xmoe::ops::gather_rows(arrival, h.recv_layout);
  }

 private:
  static void check(const Tensor& t, int64_t rows, const char* what, const char* name) {
    XMOE_CHECK(t.dim() == 2 && t.size(0) == rows,
               "[moe dispatch all_to_all {}] {} is {}, the handle has {} rows", what, name, t.str(),
               rows);
  }

  /// recv_layout (expert order <- arrival) and its inverse from the per-(source, expert) counts.
  void make_layouts(DispatchHandle& h, Device device) const {
    const int P = ep_size_;
    const int64_t El = num_local_, n = h.num_recv_rows;
    // Arrival offset of block (p, i): sources in rank order, each with its experts in order.
    std::vector<int64_t> arrival_start(static_cast<size_t>(P * El), 0);
    for (int64_t b = 1; b < P * El; ++b)
      arrival_start[b] = arrival_start[b - 1] + h.recv_counts_per_expert[b - 1];
    std::vector<int32_t> fwd(static_cast<size_t>(n)), inv(static_cast<size_t>(n));
    int64_t j = 0;  // expert-order row: experts in order, each with its sources in rank order
    for (int64_t i = 0; i < El; ++i)
      for (int p = 0; p < P; ++p) {
        const int64_t start = arrival_start[p * El + i], c = h.recv_counts_per_expert[p * El + i];
        for (int64_t q = 0; q < c; ++q, ++j) {
          fwd[j] = static_cast<int32_t>(start + q);
          inv[start + q] = static_cast<int32_t>(j);
        }
      }
    // Built on the host from host counts; uploaded to the rows' device (CUDA: one small copy).
    h.recv_layout = Tensor::from_vector(fwd, {n}, device);
    h.arrival_layout = Tensor::from_vector(inv, {n}, device);
  }

  int64_t num_experts_, num_local_ = 0;
  int ep_size_;
  std::shared_ptr<comm::Group> group_;
};

}  // namespace

Tensor Dispatcher::combine_weights_grad(const DispatchHandle&) const {
  XMOE_FAIL(
      "[moe dispatch {}] combine_weights_grad: this dispatcher does not reduce in combine "
      "(the I-Order stage computes the combine weights' gradient)",
      name());
}

DispatchHandle Dispatcher::plan(const Tensor&, std::span<const int64_t>, const RowInfo&) {
  XMOE_FAIL("[moe dispatch {}] does not pipeline (model.moe.pipeline)", name());
}

std::unique_ptr<ChunkedPass> Dispatcher::forward_pass(const Tensor&, DispatchHandle&,
                                                      const ChunkBounds&) {
  XMOE_FAIL("[moe dispatch {}] does not pipeline (model.moe.pipeline)", name());
}

std::unique_ptr<ChunkedPass> Dispatcher::backward_pass(const Tensor&, DispatchHandle&,
                                                       const ChunkBounds&) {
  XMOE_FAIL("[moe dispatch {}] does not pipeline (model.moe.pipeline)", name());
}

DispatchRegistry& dispatch_registry() {
  static DispatchRegistry registry = [] {
    DispatchRegistry r("moe.dispatch");
    r.add("local", [](const DispatchConfig& c) -> std::unique_ptr<Dispatcher> {
      return std::make_unique<LocalDispatcher>(c);
    });
    r.add("all_to_all", [](const DispatchConfig& c) -> std::unique_ptr<Dispatcher> {
      return std::make_unique<AllToAllDispatcher>(c);
    });
    r.add("rbd", [](const DispatchConfig& c) -> std::unique_ptr<Dispatcher> {
      // One node (or one rank): no inter-node link to spare, so plain all-to-all-v.
      if (rbd_num_nodes(c) <= 1) return std::make_unique<AllToAllDispatcher>(c);
      return make_rbd_dispatcher(c);
    });
    return r;
  }();
  return registry;
}

std::unique_ptr<Dispatcher> make_dispatcher(const DispatchConfig& config) {
  // moe.dispatch = auto: no exchange with one expert-parallel rank, all-to-all-v with several.
  if (config.algorithm == "auto") {
    DispatchConfig resolved = config;
    resolved.algorithm = config.ep_size > 1 ? "all_to_all" : "local";
    return dispatch_registry().create(resolved.algorithm, resolved);
  }
  return dispatch_registry().create(config.algorithm, config);
}

}  // namespace xmoe::moe
