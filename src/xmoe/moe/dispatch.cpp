#include "xmoe/moe/dispatch.h"

#include <numeric>

#include "xmoe/moe/dispatch_rbd.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

namespace {

/// One process owns every expert: dispatch and combine hand the rows through unchanged.
class LocalDispatcher final : public Dispatcher {
 public:
  explicit LocalDispatcher(const DispatchConfig& c) : num_experts_(c.num_experts) {
    XMOE_CHECK(c.ep_size == 1, "[moe dispatch local] needs ep_size = 1, got {}", c.ep_size);
  }
  std::string_view name() const override { return "local"; }

  DispatchResult dispatch(const Tensor& rows, std::span<const int64_t> tpe) override {
    XMOE_CHECK(static_cast<int64_t>(tpe.size()) == num_experts_,
               "[moe dispatch local] {} counts for {} experts", tpe.size(), num_experts_);
    DispatchResult r;
    r.rows = rows;
    r.handle.send_tokens_per_expert.assign(tpe.begin(), tpe.end());
    r.handle.recv_tokens_per_expert.assign(tpe.begin(), tpe.end());
    r.handle.num_send_rows = r.handle.num_recv_rows = rows.size(0);
    r.handle.send_counts = r.handle.recv_counts = {rows.size(0)};
    return r;
  }
  Tensor combine(const Tensor& out, const DispatchHandle& h) override { return checked(out, h); }
  Tensor dispatch_backward(const Tensor& d, const DispatchHandle& h) override {
    return checked(d, h);
  }
  Tensor combine_backward(const Tensor& d, const DispatchHandle& h) override {
    return checked(d, h);
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

  DispatchResult dispatch(const Tensor& rows, std::span<const int64_t> tpe) override {
    const char* op = "moe dispatch all_to_all";
    XMOE_CHECK(static_cast<int64_t>(tpe.size()) == num_experts_, "[{}] {} counts for {} experts",
               op, tpe.size(), num_experts_);
    XMOE_CHECK(rows.dim() == 2, "[{}] rows must be [N, d], got {}", op, rows.str());
    const int64_t N = std::accumulate(tpe.begin(), tpe.end(), int64_t{0});
    XMOE_CHECK(rows.size(0) == N, "[{}] counts sum to {} rows but rows is {}", op, N, rows.str());
    DispatchResult r;
    DispatchHandle& h = r.handle;
    h.send_tokens_per_expert.assign(tpe.begin(), tpe.end());
    h.num_send_rows = N;
    if (ep_size_ == 1) {  // one rank: the identity, bit for bit what `local` does
      h.recv_tokens_per_expert = h.recv_counts_per_expert = h.send_tokens_per_expert;
      h.send_counts = h.recv_counts = {N};
      h.num_recv_rows = N;
      r.rows = rows;
      return r;
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
    Tensor arrival = group_->all_to_all_v(rows, h.send_counts, h.recv_counts);  // [N_recv, d]
    make_layouts(h, rows.device());
    r.rows = xmoe::ops::gather_rows(arrival, h.recv_layout);  // expert-major
    return r;
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
