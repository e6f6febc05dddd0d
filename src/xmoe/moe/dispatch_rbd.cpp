#include "xmoe/moe/dispatch_rbd.h"

#include <algorithm>
#include <array>
#include <numeric>

#include "xmoe/moe/moe_ops.h"
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

Tensor index_tensor(const std::vector<int32_t>& v, Device device) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}, device);
}

int64_t sum(const std::vector<int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

class RbdDispatcher final : public Dispatcher {
 public:
  explicit RbdDispatcher(const DispatchConfig& c)
      : num_experts_(c.num_experts), P_(c.ep_size), rank_(c.ep_rank), group_(c.group),
        topo_(rbd_topology(c)) {
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
    XMOE_CHECK(topo_.size() == P_, "[{}] topology of {} ranks for an ep group of {}", kOp,
               topo_.size(), P_);
    El_ = num_experts_ / P_;
    node_ranks_ = topo_.ranks_on(topo_.node_of(rank_));
    // Node-local sub-group for stage 2, ranks in ep order (= Topology::local_rank).
    node_group_ = group_->split(topo_.node_of(rank_), rank_);
    XMOE_CHECK(node_group_->size() == static_cast<int>(node_ranks_.size()),
               "[{}] node group of {} ranks, topology says {}", kOp, node_group_->size(),
               node_ranks_.size());
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
  static RbdPlan& plan(const DispatchHandle& h, const char* what) {
    XMOE_CHECK(h.rbd != nullptr, "[{} {}] the handle is not from an rbd dispatch", kOp, what);
    return *h.rbd;
  }
  static void check(const Tensor& t, int64_t rows, const char* what, const char* name) {
    XMOE_CHECK(t.dim() == 2 && t.size(0) == rows, "[{} {}] {} is {}, the handle has {} rows", kOp,
               what, name, t.str(), rows);
  }

  int64_t num_experts_, El_ = 0;
  int P_, rank_;
  std::shared_ptr<comm::Group> group_, node_group_;
  comm::Topology topo_;
  std::vector<int> node_ranks_;
};

DispatchResult RbdDispatcher::dispatch(const Tensor& rows, std::span<const int64_t> tpe,
                                       const RowInfo& info) {
  XMOE_CHECK(static_cast<int64_t>(tpe.size()) == num_experts_, "[{}] {} counts for {} experts",
             kOp, tpe.size(), num_experts_);
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
  const int M = topo_.num_nodes();
  const std::vector<int32_t> tok = info.token_ids.to_vector<int32_t>();
  const std::vector<float> w = info.combine_weights.to_vector<float>();
  int64_t T = info.num_tokens;
  for (int32_t t : tok) {
    XMOE_CHECK(t >= 0, "[{}] token id {} (padding rows are not supported: moe.impl = pft)", kOp,
               t);
    T = std::max<int64_t>(T, int64_t{t} + 1);
  }

  auto sp = std::make_shared<RbdPlan>();
  RbdPlan& pl = *sp;
  DispatchResult result;
  DispatchHandle& h = result.handle;
  h.rbd = sp;
  h.send_tokens_per_expert.assign(tpe.begin(), tpe.end());
  h.num_send_rows = pl.num_rows = N;

  // ---- source: groups = (token, node) pairs; the first row of a group (lowest expert) pilots.
  std::vector<int32_t> group_of_key(static_cast<size_t>(T * M), -1), group_of_row(N);
  std::vector<int32_t> g_pilot, g_dest, g_size;
  std::vector<int32_t> expert_of_row(N);
  {
    int64_t r = 0;
    for (int64_t e = 0; e < num_experts_; ++e)
      for (int64_t j = 0; j < tpe[e]; ++j) expert_of_row[r++] = static_cast<int32_t>(e);
  }
  for (int64_t r = 0; r < N; ++r) {
    const int owner = static_cast<int>(expert_of_row[r] / El_);
    int32_t& g = group_of_key[static_cast<size_t>(tok[r]) * M + topo_.node_of(owner)];
    if (g < 0) {
      g = static_cast<int32_t>(g_pilot.size());
      g_pilot.push_back(static_cast<int32_t>(r));
      g_dest.push_back(owner);
      g_size.push_back(0);
    }
    group_of_row[r] = g;
    ++g_size[g];
  }
  const int64_t G = static_cast<int64_t>(g_pilot.size());
  // Send order: groups by destination rank (stable: by first row within a destination).
  pl.group_send.assign(P_, 0);
  pl.member_send.assign(P_, 0);
  for (int64_t g = 0; g < G; ++g) {
    ++pl.group_send[g_dest[g]];
    pl.member_send[g_dest[g]] += g_size[g];
  }
  std::vector<int64_t> dest_group_start(P_ + 1, 0);
  for (int p = 0; p < P_; ++p) dest_group_start[p + 1] = dest_group_start[p] + pl.group_send[p];
  std::vector<int32_t> send_pos(G), pilot_rows(G), group_tokens(G);
  {
    std::vector<int64_t> next(dest_group_start.begin(), dest_group_start.end() - 1);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t s = next[g_dest[g]]++;
      send_pos[g] = static_cast<int32_t>(s);
      pilot_rows[s] = g_pilot[g];
      group_tokens[s] = tok[g_pilot[g]];
    }
  }
  // Members in send order: groups in send order, each with its rows ascending (expert order).
  std::vector<int64_t> member_start(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) member_start[send_pos[g] + 1] = g_size[g];
  for (int64_t s = 0; s < G; ++s) member_start[s + 1] += member_start[s];
  pl.member_rows.assign(N, 0);
  Tensor meta1 = Tensor::empty({N, 4});  // (group index in its message, expert, row, weight)
  {
    float* m = meta1.data<float>();
    std::vector<int64_t> next(member_start.begin(), member_start.end() - 1);
    for (int64_t r = 0; r < N; ++r) {
      const int32_t g = group_of_row[r];
      const int64_t s = send_pos[g], k = next[s]++;
      pl.member_rows[k] = static_cast<int32_t>(r);
      m[k * 4 + 0] = static_cast<float>(s - dest_group_start[g_dest[g]]);
      m[k * 4 + 1] = static_cast<float>(expert_of_row[r]);
      m[k * 4 + 2] = static_cast<float>(r);
      m[k * 4 + 3] = w[r];
    }
  }
  pl.pilot_rows = index_tensor(pilot_rows, dev);
  h.group_tokens = index_tensor(group_tokens, dev);

  // ---- stage 1: pilots and their metadata across nodes (every rank takes part).
  std::vector<int64_t> counts(2 * P_);
  for (int p = 0; p < P_; ++p) {
    counts[2 * p] = pl.group_send[p];
    counts[2 * p + 1] = pl.member_send[p];
  }
  const std::vector<int64_t> rc = group_->all_to_all_counts(counts);
  pl.group_recv.assign(P_, 0);
  pl.member_recv.assign(P_, 0);
  for (int p = 0; p < P_; ++p) {
    pl.group_recv[p] = rc[2 * p];
    pl.member_recv[p] = rc[2 * p + 1];
  }
  Tensor pilots = group_->all_to_all_v(xmoe::ops::gather_rows(rows, pl.pilot_rows),
                                       pl.group_send, pl.group_recv);  // [G_recv, d]
  Tensor meta1_in = group_->all_to_all_v(meta1, pl.member_send, pl.member_recv);  // [M, 4]

  // ---- pilot: one replica per member, to the owner of its expert (stage-2 order: by owner).
  const int64_t Mr = sum(pl.member_recv);
  const int L = static_cast<int>(node_ranks_.size());
  std::vector<int32_t> m_group(Mr), m_expert(Mr), m_src(Mr), m_row(Mr), m_local(Mr);
  std::vector<float> m_w(Mr);
  {
    const float* m = meta1_in.data<float>();
    int64_t k = 0, gbase = 0;
    for (int p = 0; p < P_; ++p) {
      for (int64_t q = 0; q < pl.member_recv[p]; ++q, ++k) {
        m_group[k] = static_cast<int32_t>(gbase + static_cast<int64_t>(m[k * 4 + 0]));
        m_expert[k] = static_cast<int32_t>(m[k * 4 + 1]);
        m_row[k] = static_cast<int32_t>(m[k * 4 + 2]);
        m_w[k] = m[k * 4 + 3];
        m_src[k] = p;
        const int owner = static_cast<int>(m_expert[k] / El_);
        XMOE_CHECK(topo_.node_of(owner) == topo_.node_of(rank_),
                   "[{}] rank {} got a pilot for expert {} on another node", kOp, rank_,
                   m_expert[k]);
        m_local[k] = topo_.local_rank(owner);
      }
      gbase += pl.group_recv[p];
    }
  }
  pl.replica_send.assign(L, 0);
  for (int64_t k = 0; k < Mr; ++k) ++pl.replica_send[m_local[k]];
  std::vector<int64_t> rstart(L, 0);
  for (int l = 1; l < L; ++l) rstart[l] = rstart[l - 1] + pl.replica_send[l - 1];
  pl.stage2_to_arrival.assign(Mr, 0);
  std::vector<int32_t> s2_group(Mr);
  std::vector<float> s2_w(Mr);
  Tensor meta2 = Tensor::empty({Mr, 3});  // (local expert, source rank, source row)
  {
    float* m = meta2.data<float>();
    for (int64_t k = 0; k < Mr; ++k) {
      const int64_t j = rstart[m_local[k]]++;
      pl.stage2_to_arrival[j] = static_cast<int32_t>(k);
      s2_group[j] = m_group[k];
      s2_w[j] = m_w[k];
      m[j * 3 + 0] = static_cast<float>(m_expert[k] % El_);
      m[j * 3 + 1] = static_cast<float>(m_src[k]);
      m[j * 3 + 2] = static_cast<float>(m_row[k]);
    }
  }
  pl.member_group = index_tensor(s2_group, dev);
  pl.member_weight = Tensor::from_vector(s2_w, {Mr}, dev);

  // ---- stage 2: replicas inside the node.
  pl.replica_recv = node_group_->all_to_all_counts(pl.replica_send);
  Tensor replicas = xmoe::ops::gather_rows(pilots, pl.member_group);  // [M, d]
  Tensor arrival = node_group_->all_to_all_v(replicas, pl.replica_send, pl.replica_recv);
  Tensor meta2_in = node_group_->all_to_all_v(meta2, pl.replica_send, pl.replica_recv);

  // ---- owner: (local expert, source rank, source row) order = all_to_all's expert order.
  const int64_t R = arrival.size(0);
  h.num_recv_rows = R;
  h.recv_tokens_per_expert.assign(El_, 0);
  h.recv_counts_per_expert.assign(static_cast<size_t>(P_ * El_), 0);
  h.recv_counts.assign(P_, 0);
  h.send_counts.assign(P_, 0);
  for (int64_t e = 0; e < num_experts_; ++e) h.send_counts[e / El_] += tpe[e];
  std::vector<int32_t> order(R);
  {
    const float* m = meta2_in.data<float>();
    std::vector<std::array<int32_t, 3>> key(R);
    for (int64_t i = 0; i < R; ++i) {
      key[i] = {static_cast<int32_t>(m[i * 3]), static_cast<int32_t>(m[i * 3 + 1]),
                static_cast<int32_t>(m[i * 3 + 2])};
      ++h.recv_tokens_per_expert[key[i][0]];
      ++h.recv_counts_per_expert[key[i][1] * El_ + key[i][0]];
      ++h.recv_counts[key[i][1]];
    }
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return key[a] < key[b]; });
  }
  std::vector<int32_t> inverse(R);
  for (int64_t j = 0; j < R; ++j) inverse[order[j]] = static_cast<int32_t>(j);
  h.recv_layout = index_tensor(order, dev);
  h.arrival_layout = index_tensor(inverse, dev);
  result.rows = xmoe::ops::gather_rows(arrival, h.recv_layout);
  return result;
}

Tensor RbdDispatcher::combine(const Tensor& expert_out, const DispatchHandle& h) {
  RbdPlan& pl = plan(h, "combine");
  check(expert_out, h.num_recv_rows, "combine", "expert_out");
  // owner -> pilot: the members' outputs, in the pilot's stage-2 order.
  Tensor arrival = xmoe::ops::gather_rows(expert_out, h.arrival_layout);
  pl.member_out = node_group_->all_to_all_v(arrival, pl.replica_recv, pl.replica_send);
  // pilot: weighted sum per group, members added in expert order.
  Tensor partial = Tensor::zeros({sum(pl.group_recv), expert_out.size(1)}, DType::f32,
                                 expert_out.device());
  xmoe::ops::scatter_add_rows(partial, pl.member_out, pl.member_group, pl.member_weight);
  // pilot -> source: one row per (token, node).
  return group_->all_to_all_v(partial, pl.group_recv, pl.group_send);  // [G, d]
}

Tensor RbdDispatcher::combine_backward(const Tensor& d_partial, const DispatchHandle& h) {
  RbdPlan& pl = plan(h, "combine backward");
  check(d_partial, pl.num_groups(), "combine backward", "d_partial");
  XMOE_CHECK(pl.member_out.defined(), "[{} combine backward] without a combine", kOp);
  Tensor d_groups = group_->all_to_all_v(d_partial, pl.group_send, pl.group_recv);
  // pilot: the group's gradient to each member, d_w = out . d_partial, d_out = w d_partial.
  Tensor d_out = xmoe::ops::gather_rows(d_groups, pl.member_group);  // [M, d]
  const std::vector<float> d_w = xmoe::ops::row_dot(pl.member_out, d_out).to_vector<float>();
  scale_rows_(d_out, pl.member_weight);
  // pilot -> owners.
  Tensor d_arrival = node_group_->all_to_all_v(d_out, pl.replica_send, pl.replica_recv);
  Tensor d_expert_out = xmoe::ops::gather_rows(d_arrival, h.recv_layout);
  // pilot -> source: d_w in the source's member order (stage-1 arrival order here).
  const int64_t Mr = static_cast<int64_t>(d_w.size());
  std::vector<float> dw_arrival(Mr);
  for (int64_t j = 0; j < Mr; ++j) dw_arrival[pl.stage2_to_arrival[j]] = d_w[j];
  Tensor dw_src = group_->all_to_all_v(Tensor::from_vector(dw_arrival, {Mr, 1}), pl.member_recv,
                                       pl.member_send);  // [N, 1]
  std::vector<float> d_cw(pl.num_rows, 0.f);
  const float* v = dw_src.data<float>();
  for (int64_t k = 0; k < pl.num_rows; ++k) d_cw[pl.member_rows[k]] = v[k];
  pl.d_combine_weights = Tensor::from_vector(d_cw, {pl.num_rows}, d_partial.device());
  return d_expert_out;
}

Tensor RbdDispatcher::dispatch_backward(const Tensor& d_recv, const DispatchHandle& h) {
  RbdPlan& pl = plan(h, "dispatch backward");
  check(d_recv, h.num_recv_rows, "dispatch backward", "d_recv");
  const int64_t d = d_recv.size(1);
  // owners -> pilot; the group's replicas are copies of one row: their gradients add up.
  Tensor d_arrival = xmoe::ops::gather_rows(d_recv, h.arrival_layout);
  Tensor d_members = node_group_->all_to_all_v(d_arrival, pl.replica_recv, pl.replica_send);
  Tensor d_groups = Tensor::zeros({sum(pl.group_recv), d}, DType::f32, d_recv.device());
  xmoe::ops::scatter_add_rows(d_groups, d_members, pl.member_group);
  // pilot -> source, onto the pilot rows.
  Tensor d_pilots = group_->all_to_all_v(d_groups, pl.group_recv, pl.group_send);  // [G, d]
  Tensor d_rows = Tensor::zeros({pl.num_rows, d}, DType::f32, d_recv.device());
  xmoe::ops::scatter_add_rows(d_rows, d_pilots, pl.pilot_rows);
  return d_rows;
}

}  // namespace

std::unique_ptr<Dispatcher> make_rbd_dispatcher(const DispatchConfig& config) {
  return std::make_unique<RbdDispatcher>(config);
}

}  // namespace xmoe::moe
