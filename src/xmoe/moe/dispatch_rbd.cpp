#include "xmoe/moe/dispatch_rbd.h"

#include <numeric>
#include <utility>

#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

comm::Topology rbd_topology(const DispatchConfig& c) {
  if (c.ranks_per_node > 0) {
    XMOE_CHECK(c.ep_size % c.ranks_per_node == 0,
               "[moe dispatch rbd] ranks_per_node = {} does not divide ep = {}", c.ranks_per_node,
               c.ep_size);
    return comm::Topology::uniform(c.ep_size, c.ranks_per_node);
  }
  if (c.group) return c.group->topology();
  return comm::Topology();
}

int rbd_num_nodes(const DispatchConfig& c) {
  if (c.ep_size <= 1) return 1;
  return rbd_topology(c).num_nodes();
}

namespace {

constexpr const char* kOp = "moe dispatch rbd";

template <class T>
Tensor vector_tensor(const std::vector<T>& v, Device device) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}, device);
}

/// int32 metadata [rows, width] as a tensor, for all_to_all_v.
Tensor meta_tensor(const std::vector<int32_t>& v, int64_t width) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size()) / width, width});
}

std::span<const int32_t> meta_span(const Tensor& t) {
  return {t.data<int32_t>(), static_cast<size_t>(t.numel())};
}

class RbdDispatcher final : public Dispatcher {
 public:
  explicit RbdDispatcher(const DispatchConfig& c)
      : num_experts_(c.num_experts), P_(c.ep_size), rank_(c.ep_rank), group_(c.group) {
    XMOE_CHECK(c.ep_size >= 1 && c.num_experts % c.ep_size == 0,
               "[{}] moe.num_experts = {} is not divisible by ep = {}", kOp, c.num_experts,
               c.ep_size);
    XMOE_CHECK(group_, "[{}] ep = {} needs a communication group", kOp, c.ep_size);
    // Before the collective split below: every rank of a GPU run refuses at the same point.
    XMOE_CHECK(group_->device().is_cpu(),
               "[{}] moe.dispatch = rbd runs on CPU tensors only (its plan and metadata are built "
               "and exchanged on the host), but the ep group moves tensors on {} (train.device = "
               "cuda); use moe.dispatch = all_to_all (or auto) on the GPU",
               kOp, group_->device().str());
    XMOE_CHECK(group_->size() == c.ep_size && group_->rank() == c.ep_rank,
               "[{}] group is rank {} of {}, config says {} of {}", kOp, group_->rank(),
               group_->size(), c.ep_rank, c.ep_size);
    layout_.topo = rbd_topology(c);
    layout_.experts_per_rank = num_experts_ / P_;
    const comm::Topology& topo = layout_.topo;
    XMOE_CHECK(topo.size() == P_, "[{}] topology of {} ranks for an ep group of {}", kOp,
               topo.size(), P_);
    // Node-local sub-group for stage 2, ranks in ep order (= Topology::local_rank).
    node_group_ = group_->split(topo.node_of(rank_), rank_);
    XMOE_CHECK(node_group_->size() == static_cast<int>(topo.ranks_on(topo.node_of(rank_)).size()),
               "[{}] node group of {} ranks, topology says {}", kOp, node_group_->size(),
               topo.ranks_on(topo.node_of(rank_)).size());
  }
  std::string_view name() const override { return "rbd"; }
  bool reduces_in_combine() const override { return true; }

  DispatchResult dispatch(const Tensor&, std::span<const int64_t>) override {
    XMOE_FAIL("[{}] dispatch needs RowInfo (the rows' token ids and combine weights)", kOp);
  }

  DispatchResult dispatch(const Tensor& rows, std::span<const int64_t> tpe,
                          const RowInfo& info) override;
  Tensor combine(const Tensor& expert_out, const DispatchHandle& h) override;
  Tensor combine_backward(const Tensor& d_partial, const DispatchHandle& h) override;
  Tensor dispatch_backward(const Tensor& d_recv, const DispatchHandle& h) override;
  Tensor combine_weights_grad(const DispatchHandle& h) const override {
    XMOE_CHECK(h.rbd && h.rbd->d_combine_weights.defined(),
               "[{}] combine_weights_grad before combine_backward", kOp);
    return h.rbd->d_combine_weights;
  }
  bool pipelines() const override { return true; }
  DispatchHandle plan(const Tensor& rows, std::span<const int64_t> tpe,
                      const RowInfo& info) override;
  std::unique_ptr<ChunkedPass> forward_pass(const Tensor& rows, DispatchHandle& h,
                                            const ChunkBounds& bounds) override;
  std::unique_ptr<ChunkedPass> backward_pass(const Tensor& d_partial, DispatchHandle& h,
                                             const ChunkBounds& bounds) override;

  // The stages, shared by the unchunked calls and the chunked passes (RbdPass).
  /// Stage 1: the pilots of `rows` [N, d] to their pilot ranks: [G_recv, d].
  Tensor send_pilots(const Tensor& rows, const RbdState& st);
  /// Pilot: the weighted sum per group of the members' outputs [M, d] (stage-2 order; saved
  /// for backward), back to the sources over stage 1: [G, d].
  Tensor reduce_members(RbdState& st, Tensor member_out);
  /// Pilot: from d_partial [G, d] (stage 1 back), the members' output gradients [M, d] (stage-2
  /// order), and d(combine weights) to the sources (st.d_combine_weights).
  Tensor member_grads(RbdState& st, const Tensor& d_partial);
  /// Pilot: the members' input gradients [M, d] summed per group, back over stage 1 onto the
  /// source's pilot rows: d_rows [N, d].
  Tensor rows_grad(RbdState& st, const Tensor& d_members);
  /// Stage 2, pilot -> owners: replicas [M, d] (stage-2 order) -> expert-major rows [R, d].
  Tensor to_owners(const Tensor& replicas, const DispatchHandle& h);
  /// Stage 2, owners -> pilot: expert-major rows [R, d] -> the members' rows [M, d].
  Tensor to_pilots(const Tensor& expert_rows, const DispatchHandle& h);
  const std::shared_ptr<comm::Group>& node_group() const { return node_group_; }

 private:
  /// The plan of this rank: the three phases of rbd_plan.h with the metadata exchanges
  /// between them (collective over the ep group, then the node group).
  RbdPlan make_plan(const RbdRouting& routing);

  static RbdState& state(const DispatchHandle& h, const char* what) {
    XMOE_CHECK(h.rbd != nullptr, "[{} {}] the handle is not from an rbd dispatch", kOp, what);
    return *h.rbd;
  }
  static void check(const Tensor& t, int64_t rows, const char* what, const char* name) {
    XMOE_CHECK(t.dim() == 2 && t.size(0) == rows, "[{} {}] {} is {}, the handle has {} rows", kOp,
               what, name, t.str(), rows);
  }

  int64_t num_experts_;
  int P_, rank_;
  std::shared_ptr<comm::Group> group_, node_group_;
  RbdLayout layout_;
};

RbdPlan RbdDispatcher::make_plan(const RbdRouting& routing) {
  RbdPlan plan;
  plan.source = plan_rbd_source(layout_, routing);
  const RbdSourcePlan& src = plan.source;
  // Stage-1 metadata over the ep group (every rank takes part, also with nothing to send).
  std::vector<int64_t> counts(2 * P_);
  for (int p = 0; p < P_; ++p) {
    counts[2 * p] = src.group_send[p];
    counts[2 * p + 1] = src.member_send[p];
  }
  const std::vector<int64_t> rc = group_->all_to_all_counts(counts);
  std::vector<int64_t> group_recv(P_), member_recv(P_);
  for (int p = 0; p < P_; ++p) {
    group_recv[p] = rc[2 * p];
    member_recv[p] = rc[2 * p + 1];
  }
  const Tensor meta1 = group_->all_to_all_v(meta_tensor(src.stage1_meta, kRbdStage1Width),
                                            src.member_send, member_recv);
  plan.pilot = plan_rbd_pilot(layout_, rank_, std::move(group_recv), std::move(member_recv),
                              meta_span(meta1));
  // Stage-2 metadata inside the node.
  const RbdPilotPlan& pilot = plan.pilot;
  std::vector<int64_t> replica_recv = node_group_->all_to_all_counts(pilot.replica_send);
  const Tensor meta2 = node_group_->all_to_all_v(meta_tensor(pilot.stage2_meta, kRbdStage2Width),
                                                 pilot.replica_send, replica_recv);
  plan.owner = plan_rbd_owner(layout_, std::move(replica_recv), meta_span(meta2));
  return plan;
}

DispatchHandle RbdDispatcher::plan(const Tensor& rows, std::span<const int64_t> tpe,
                                   const RowInfo& info) {
  XMOE_CHECK(static_cast<int64_t>(tpe.size()) == num_experts_, "[{}] {} counts for {} experts", kOp,
             tpe.size(), num_experts_);
  XMOE_CHECK(rows.dim() == 2, "[{}] rows must be [N, d], got {}", kOp, rows.str());
  const int64_t N = std::accumulate(tpe.begin(), tpe.end(), int64_t{0});
  XMOE_CHECK(rows.size(0) == N, "[{}] counts sum to {} rows but rows is {}", kOp, N, rows.str());
  check_shape(info.token_ids, {N}, kOp, "token_ids");
  check_dtype(info.token_ids, DType::i32, kOp, "token_ids");
  check_shape(info.combine_weights, {N}, kOp, "combine_weights");
  check_dtype(info.combine_weights, DType::f32, kOp, "combine_weights");
  XMOE_CHECK(rows.is_cpu(),
             "[{}] moe.dispatch = rbd runs on CPU tensors only, got rows {} (train.device = cuda); "
             "use moe.dispatch = all_to_all (or auto) on the GPU",
             kOp, rows.str());
  const Device dev = rows.device();
  const std::vector<int32_t> tok = info.token_ids.to_vector<int32_t>();
  const std::vector<float> w = info.combine_weights.to_vector<float>();

  auto sp = std::make_shared<RbdState>();
  RbdState& st = *sp;
  st.plan = make_plan(RbdRouting{tpe, tok, w});
  const RbdSourcePlan& src = st.plan.source;
  const RbdPilotPlan& pilot = st.plan.pilot;
  const RbdOwnerPlan& owner = st.plan.owner;
  st.pilot_rows = vector_tensor(src.pilot_rows, dev);
  st.replica_group = vector_tensor(pilot.replica_group, dev);
  st.replica_weight = vector_tensor(pilot.replica_weight, dev);

  DispatchHandle h;
  h.rbd = sp;
  h.send_tokens_per_expert.assign(tpe.begin(), tpe.end());
  h.num_send_rows = N;
  h.send_counts.assign(P_, 0);
  for (int64_t e = 0; e < num_experts_; ++e) h.send_counts[layout_.owner(e)] += tpe[e];
  h.recv_counts = owner.recv_counts;
  h.recv_tokens_per_expert = owner.recv_tokens_per_expert;
  h.recv_counts_per_expert = owner.recv_counts_per_expert;
  h.num_recv_rows = owner.num_rows();
  h.recv_layout = vector_tensor(owner.expert_order, dev);
  h.arrival_layout = vector_tensor(owner.arrival_order, dev);
  h.group_tokens = vector_tensor(src.group_tokens, dev);
  return h;
}

Tensor RbdDispatcher::send_pilots(const Tensor& rows, const RbdState& st) {
  return group_->all_to_all_v(xmoe::ops::gather_rows(rows, st.pilot_rows),
                              st.plan.source.group_send, st.plan.pilot.group_recv);
}

Tensor RbdDispatcher::reduce_members(RbdState& st, Tensor member_out) {
  const RbdPlan& pl = st.plan;
  st.member_out = std::move(member_out);
  // pilot: weighted sum per group, members added in expert order.
  Tensor partial = Tensor::zeros({pl.pilot.num_groups(), st.member_out.size(1)}, DType::f32,
                                 st.member_out.device());
  xmoe::ops::scatter_add_rows(partial, st.member_out, st.replica_group, st.replica_weight);
  // pilot -> source: one row per (token, node).
  return group_->all_to_all_v(partial, pl.pilot.group_recv, pl.source.group_send);  // [G, d]
}

Tensor RbdDispatcher::member_grads(RbdState& st, const Tensor& d_partial) {
  const RbdPlan& pl = st.plan;
  check(d_partial, pl.source.num_groups(), "combine backward", "d_partial");
  XMOE_CHECK(st.member_out.defined(), "[{} combine backward] without a combine", kOp);
  Tensor d_groups = group_->all_to_all_v(d_partial, pl.source.group_send, pl.pilot.group_recv);
  // pilot: the group's gradient to each member, d_w = out . d_partial, d_out = w d_partial.
  Tensor d_out = xmoe::ops::gather_rows(d_groups, st.replica_group);  // [M, d]
  const std::vector<float> d_w = xmoe::ops::row_dot(st.member_out, d_out).to_vector<float>();
  ops::scale_rows_(d_out, st.replica_weight);
  // pilot -> source: d_w in the source's member order (stage-1 arrival order here).
  const int64_t M = static_cast<int64_t>(d_w.size());
  std::vector<float> dw_arrival(M);
  for (int64_t j = 0; j < M; ++j) dw_arrival[pl.pilot.replica_member[j]] = d_w[j];
  Tensor dw_src = group_->all_to_all_v(Tensor::from_vector(dw_arrival, {M, 1}),
                                       pl.pilot.member_recv, pl.source.member_send);  // [N, 1]
  std::vector<float> d_cw(pl.source.num_rows, 0.f);
  const float* v = dw_src.data<float>();
  for (int64_t k = 0; k < pl.source.num_rows; ++k) d_cw[pl.source.member_rows[k]] = v[k];
  st.d_combine_weights = Tensor::from_vector(d_cw, {pl.source.num_rows}, d_partial.device());
  return d_out;
}

Tensor RbdDispatcher::rows_grad(RbdState& st, const Tensor& d_members) {
  const RbdPlan& pl = st.plan;
  const int64_t d = d_members.size(1);
  // The group's replicas are copies of one row: their gradients add up.
  Tensor d_groups = Tensor::zeros({pl.pilot.num_groups(), d}, DType::f32, d_members.device());
  xmoe::ops::scatter_add_rows(d_groups, d_members, st.replica_group);
  // pilot -> source, onto the pilot rows.
  Tensor d_pilots =
      group_->all_to_all_v(d_groups, pl.pilot.group_recv, pl.source.group_send);  // [G, d]
  Tensor d_rows = Tensor::zeros({pl.source.num_rows, d}, DType::f32, d_members.device());
  xmoe::ops::scatter_add_rows(d_rows, d_pilots, st.pilot_rows);
  return d_rows;
}

Tensor RbdDispatcher::to_owners(const Tensor& replicas, const DispatchHandle& h) {
  const RbdPlan& pl = h.rbd->plan;
  Tensor arrival =
      node_group_->all_to_all_v(replicas, pl.pilot.replica_send, pl.owner.replica_recv);  // [R, d]
  return xmoe::ops::gather_rows(arrival, h.recv_layout);  // expert-major
}

Tensor RbdDispatcher::to_pilots(const Tensor& expert_rows, const DispatchHandle& h) {
  const RbdPlan& pl = h.rbd->plan;
  Tensor arrival = xmoe::ops::gather_rows(expert_rows, h.arrival_layout);
  return node_group_->all_to_all_v(arrival, pl.owner.replica_recv, pl.pilot.replica_send);
}

DispatchResult RbdDispatcher::dispatch(const Tensor& rows, std::span<const int64_t> tpe,
                                       const RowInfo& info) {
  DispatchResult result;
  result.handle = plan(rows, tpe, info);
  const RbdState& st = *result.handle.rbd;
  // Stage 1: the pilots across nodes; stage 2: the replicas inside the node.
  Tensor pilots = send_pilots(rows, st);  // [G_recv, d]
  result.rows = to_owners(xmoe::ops::gather_rows(pilots, st.replica_group), result.handle);
  return result;
}

Tensor RbdDispatcher::combine(const Tensor& expert_out, const DispatchHandle& h) {
  RbdState& st = state(h, "combine");
  check(expert_out, h.num_recv_rows, "combine", "expert_out");
  return reduce_members(st, to_pilots(expert_out, h));  // the replicas' outputs, stage-2 order
}

Tensor RbdDispatcher::combine_backward(const Tensor& d_partial, const DispatchHandle& h) {
  RbdState& st = state(h, "combine backward");
  return to_owners(member_grads(st, d_partial), h);
}

Tensor RbdDispatcher::dispatch_backward(const Tensor& d_recv, const DispatchHandle& h) {
  RbdState& st = state(h, "dispatch backward");
  check(d_recv, h.num_recv_rows, "dispatch backward", "d_recv");
  return rows_grad(st, to_pilots(d_recv, h));
}

/// rbd chunk by chunk: stage 1 (the pilots across nodes, and the per-group sums back) runs whole,
/// since a pilot carries its token to every expert of a node, whatever the chunk; stage 2 (the
/// replicas inside the node) runs per chunk: the replicas of chunk c's experts go to their
/// owners while the experts compute chunk c - 1, and come back into their own range of a
/// chunk-major buffer, put into stage-2 order by one gather before the per-group sums, so those
/// add in the unchunked order (bitwise equal). Forward: in = the replicas from the pilots, out =
/// the experts' outputs. Backward: in = the members' output gradients, out = their input
/// gradients.
class RbdPass final : public ChunkedPass {
 public:
  RbdPass(RbdDispatcher& dispatcher, const Tensor& src, DispatchHandle& h,
          const ChunkBounds& bounds, bool forward)
      : rbd_(dispatcher), st_(*h.rbd), forward_(forward), node_(dispatcher.node_group()) {
    const RbdPlan& pl = st_.plan;
    const int L = node_->size(), chunks = static_cast<int>(bounds.size()) - 1;
    const int64_t El = static_cast<int64_t>(h.recv_tokens_per_expert.size());
    std::vector<int> chunk_of(static_cast<size_t>(El));
    for (int c = 0; c < chunks; ++c)
      for (int64_t i = bounds[c]; i < bounds[c + 1]; ++i) chunk_of[i] = c;
    chunks_.resize(chunks);
    for (Chunk& k : chunks_) {
      k.send.assign(L, 0);
      k.recv.assign(L, 0);
    }
    // Pilot: replicas in stage-2 order (by owner), each for its owner's local expert.
    const int64_t M = pl.pilot.num_replicas();
    std::vector<std::vector<int32_t>> replicas(chunks), groups(chunks);
    std::vector<int32_t> chunk_row(static_cast<size_t>(M));  // chunk-major row of replica j
    for (int l = 0, j = 0; l < L; ++l)
      for (int64_t q = 0; q < pl.pilot.replica_send[l]; ++q, ++j) {
        const int c = chunk_of[pl.pilot.stage2_meta[j * kRbdStage2Width]];
        ++chunks_[c].send[l];
        replicas[c].push_back(j);
        groups[c].push_back(pl.pilot.replica_group[j]);
      }
    int64_t row = 0;
    for (int c = 0; c < chunks; ++c) {
      Chunk& k = chunks_[c];
      k.member_offsets.assign(L, 0);
      for (int l = 0; l < L; ++l)
        k.member_offsets[l] = l == 0 ? row : k.member_offsets[l - 1] + k.send[l - 1];
      for (int32_t j : replicas[c]) chunk_row[j] = static_cast<int32_t>(row++);
      k.replicas = vector_tensor(forward_ ? groups[c] : replicas[c], src.device());
    }
    to_stage2_ = vector_tensor(chunk_row, src.device());
    // Owner: arrival rows (by node rank, then the pilot's order) -> chunk arrival rows.
    const std::vector<int32_t>& order = pl.owner.expert_order;
    std::vector<int64_t> expert_start(static_cast<size_t>(El) + 1, 0);
    for (int64_t i = 0; i < El; ++i)
      expert_start[i + 1] = expert_start[i] + h.recv_tokens_per_expert[i];
    std::vector<int> arrival_chunk(order.size());
    for (int64_t i = 0; i < El; ++i)
      for (int64_t j = expert_start[i]; j < expert_start[i + 1]; ++j)
        arrival_chunk[order[j]] = chunk_of[i];
    std::vector<int32_t> pos(order.size());
    std::vector<int64_t> seen(static_cast<size_t>(chunks), 0);
    for (int l = 0, a = 0; l < L; ++l)
      for (int64_t q = 0; q < pl.owner.replica_recv[l]; ++q, ++a) {
        const int c = arrival_chunk[a];
        ++chunks_[c].recv[l];
        pos[a] = static_cast<int32_t>(seen[c]++);
      }
    for (int c = 0; c < chunks; ++c) {
      const int64_t j0 = expert_start[bounds[c]], n = expert_start[bounds[c + 1]] - j0;
      std::vector<int32_t> to_expert(static_cast<size_t>(n)), to_arrival(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) {
        to_expert[j] = pos[order[j0 + j]];
        to_arrival[to_expert[j]] = static_cast<int32_t>(j);
      }
      chunks_[c].to_expert = vector_tensor(to_expert, src.device());
      chunks_[c].to_arrival = vector_tensor(to_arrival, src.device());
    }
    // Stage 1 (whole): forward, the pilots; backward, the members' output gradients.
    src_ = forward_ ? rbd_.send_pilots(src, st_) : rbd_.member_grads(st_, src);
    by_chunk_ = Tensor::empty({M, src.size(1)}, src.dtype(), src.device());
  }

  void start_in(int c) override {
    Chunk& k = chunks_.at(c);
    k.arrival = Tensor::empty({k.to_expert.size(0), src_.size(1)}, src_.dtype(), src_.device());
    k.in = node_->all_to_all_v_rows_async(xmoe::ops::gather_rows(src_, k.replicas), k.send,
                                          offsets(k.send), k.arrival, k.recv, offsets(k.recv));
  }

  Tensor wait_in(int c) override {
    Chunk& k = chunks_.at(c);
    XMOE_CHECK(k.in != nullptr, "[{} pipeline] wait_in({}) before start_in", kOp, c);
    k.in->wait();
    k.in.reset();
    return xmoe::ops::gather_rows(std::exchange(k.arrival, Tensor()), k.to_expert);
  }

  void start_out(int c, Tensor out) override {
    Chunk& k = chunks_.at(c);
    k.back = xmoe::ops::gather_rows(out, k.to_arrival);  // the owner's stage-2 arrival order
    k.out = node_->all_to_all_v_rows_async(k.back, k.recv, offsets(k.recv), by_chunk_, k.send,
                                           k.member_offsets);
  }

  Tensor finish() override {
    for (Chunk& k : chunks_)
      if (k.out) k.out->wait();
    chunks_.clear();
    Tensor members = xmoe::ops::gather_rows(std::exchange(by_chunk_, Tensor()), to_stage2_);
    src_ = Tensor();
    return forward_ ? rbd_.reduce_members(st_, std::move(members)) : rbd_.rows_grad(st_, members);
  }

 private:
  static std::vector<int64_t> offsets(const std::vector<int64_t>& counts) {
    std::vector<int64_t> out(counts.size(), 0);
    for (size_t i = 1; i < counts.size(); ++i) out[i] = out[i - 1] + counts[i - 1];
    return out;
  }

  struct Chunk {
    std::vector<int64_t> send, recv;      // [L] replicas to / from each rank of the node
    std::vector<int64_t> member_offsets;  // [L] where each owner's rows land in by_chunk_
    Tensor replicas;  // i32: rows of src_ the chunk sends (forward: groups; backward: replicas)
    Tensor to_expert, to_arrival;  // i32 [n_c]: the chunk's arrival <-> expert order
    Tensor arrival, back;
    std::unique_ptr<comm::Work> in, out;
  };
  RbdDispatcher& rbd_;
  RbdState& st_;
  bool forward_;
  std::shared_ptr<comm::Group> node_;
  Tensor src_;        // forward: the pilots [G_recv, d]; backward: d(member outputs) [M, d]
  Tensor by_chunk_;   // [M, d] the way back, chunk-major
  Tensor to_stage2_;  // i32 [M]: chunk-major row of each replica (stage-2 order)
  std::vector<Chunk> chunks_;
};

std::unique_ptr<ChunkedPass> RbdDispatcher::forward_pass(const Tensor& rows, DispatchHandle& h,
                                                         const ChunkBounds& bounds) {
  state(h, "forward pass");
  return std::make_unique<RbdPass>(*this, rows, h, bounds, true);
}

std::unique_ptr<ChunkedPass> RbdDispatcher::backward_pass(const Tensor& d_partial,
                                                          DispatchHandle& h,
                                                          const ChunkBounds& bounds) {
  state(h, "backward pass");
  return std::make_unique<RbdPass>(*this, d_partial, h, bounds, false);
}

}  // namespace

std::unique_ptr<Dispatcher> make_rbd_dispatcher(const DispatchConfig& config) {
  return std::make_unique<RbdDispatcher>(config);
}

}  // namespace xmoe::moe
