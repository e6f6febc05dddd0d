#include "xmoe/moe/dispatch_rbd.h"

#include <numeric>

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

DispatchResult RbdDispatcher::dispatch(const Tensor& rows, std::span<const int64_t> tpe,
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

  DispatchResult result;
  DispatchHandle& h = result.handle;
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

  // Stage 1: the pilots across nodes; stage 2: the replicas inside the node.
  Tensor pilots = group_->all_to_all_v(xmoe::ops::gather_rows(rows, st.pilot_rows), src.group_send,
                                       pilot.group_recv);  // [G_recv, d]
  Tensor arrival = node_group_->all_to_all_v(xmoe::ops::gather_rows(pilots, st.replica_group),
                                             pilot.replica_send, owner.replica_recv);  // [R, d]
  result.rows = xmoe::ops::gather_rows(arrival, h.recv_layout);  // expert-major
  return result;
}

Tensor RbdDispatcher::combine(const Tensor& expert_out, const DispatchHandle& h) {
  RbdState& st = state(h, "combine");
  const RbdPlan& pl = st.plan;
  check(expert_out, h.num_recv_rows, "combine", "expert_out");
  // owner -> pilot: the replicas' outputs, in the pilot's stage-2 order.
  Tensor arrival = xmoe::ops::gather_rows(expert_out, h.arrival_layout);
  st.member_out = node_group_->all_to_all_v(arrival, pl.owner.replica_recv, pl.pilot.replica_send);
  // pilot: weighted sum per group, members added in expert order.
  Tensor partial =
      Tensor::zeros({pl.pilot.num_groups(), expert_out.size(1)}, DType::f32, expert_out.device());
  xmoe::ops::scatter_add_rows(partial, st.member_out, st.replica_group, st.replica_weight);
  // pilot -> source: one row per (token, node).
  return group_->all_to_all_v(partial, pl.pilot.group_recv, pl.source.group_send);  // [G, d]
}

Tensor RbdDispatcher::combine_backward(const Tensor& d_partial, const DispatchHandle& h) {
  RbdState& st = state(h, "combine backward");
  const RbdPlan& pl = st.plan;
  check(d_partial, pl.source.num_groups(), "combine backward", "d_partial");
  XMOE_CHECK(st.member_out.defined(), "[{} combine backward] without a combine", kOp);
  Tensor d_groups = group_->all_to_all_v(d_partial, pl.source.group_send, pl.pilot.group_recv);
  // pilot: the group's gradient to each member, d_w = out . d_partial, d_out = w d_partial.
  Tensor d_out = xmoe::ops::gather_rows(d_groups, st.replica_group);  // [M, d]
  const std::vector<float> d_w = xmoe::ops::row_dot(st.member_out, d_out).to_vector<float>();
  ops::scale_rows_(d_out, st.replica_weight);
  // pilot -> owners.
  Tensor d_arrival = node_group_->all_to_all_v(d_out, pl.pilot.replica_send, pl.owner.replica_recv);
  Tensor d_expert_out = xmoe::ops::gather_rows(d_arrival, h.recv_layout);
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
  return d_expert_out;
}

Tensor RbdDispatcher::dispatch_backward(const Tensor& d_recv, const DispatchHandle& h) {
  RbdState& st = state(h, "dispatch backward");
  const RbdPlan& pl = st.plan;
  check(d_recv, h.num_recv_rows, "dispatch backward", "d_recv");
  const int64_t d = d_recv.size(1);
  // owners -> pilot; the group's replicas are copies of one row: their gradients add up.
  Tensor d_arrival = xmoe::ops::gather_rows(d_recv, h.arrival_layout);
  Tensor d_members =
      node_group_->all_to_all_v(d_arrival, pl.owner.replica_recv, pl.pilot.replica_send);
  Tensor d_groups = Tensor::zeros({pl.pilot.num_groups(), d}, DType::f32, d_recv.device());
  xmoe::ops::scatter_add_rows(d_groups, d_members, st.replica_group);
  // pilot -> source, onto the pilot rows.
  Tensor d_pilots =
      group_->all_to_all_v(d_groups, pl.pilot.group_recv, pl.source.group_send);  // [G, d]
  Tensor d_rows = Tensor::zeros({pl.source.num_rows, d}, DType::f32, d_recv.device());
  xmoe::ops::scatter_add_rows(d_rows, d_pilots, st.pilot_rows);
  return d_rows;
}

}  // namespace

std::unique_ptr<Dispatcher> make_rbd_dispatcher(const DispatchConfig& config) {
  return std::make_unique<RbdDispatcher>(config);
}

}  // namespace xmoe::moe
