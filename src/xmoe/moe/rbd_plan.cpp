#include "xmoe/moe/rbd_plan.h"

#include <algorithm>
#include <array>
#include <bit>
#include <limits>
#include <numeric>

#include "xmoe/core/error.h"

namespace xmoe::moe {

namespace {

constexpr const char* kOp = "moe dispatch rbd";
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

int64_t sum(std::span<const int64_t> v) {
  return std::accumulate(v.begin(), v.end(), int64_t{0});
}

void check_layout(const RbdLayout& l) {
  XMOE_CHECK(l.num_ranks() >= 1 && l.experts_per_rank >= 1, "[{}] layout of {} ranks x {} experts",
             kOp, l.num_ranks(), l.experts_per_rank);
  // The stage-1 key is expert * 2 + flag in an int32.
  XMOE_CHECK(l.num_experts() <= kInt32Max / 2, "[{}] {} experts do not fit the int32 metadata", kOp,
             l.num_experts());
}

}  // namespace

int64_t RbdPilotPlan::num_groups() const {
  return sum(group_recv);
}

RbdSourcePlan plan_rbd_source(const RbdLayout& layout, const RbdRouting& routing) {
  check_layout(layout);
  const int P = layout.num_ranks();
  const int64_t E = layout.num_experts();
  const auto tpe = routing.tokens_per_expert;
  const auto tok = routing.token_ids;
  XMOE_CHECK(static_cast<int64_t>(tpe.size()) == E, "[{}] {} counts for {} experts", kOp,
             tpe.size(), E);
  const int64_t N = sum(tpe);
  XMOE_CHECK(static_cast<int64_t>(tok.size()) == N &&
                 static_cast<int64_t>(routing.combine_weights.size()) == N,
             "[{}] counts sum to {} rows, but {} token ids and {} combine weights", kOp, N,
             tok.size(), routing.combine_weights.size());
  XMOE_CHECK(N <= kInt32Max, "[{}] {} rows do not fit int32 row indices", kOp, N);
  for (int32_t t : tok)
    XMOE_CHECK(t >= 0, "[{}] token id {} (padding rows are not supported: moe.impl = pft)", kOp, t);

  // Rows by (token, node of the row's expert), ascending rows inside: each run is a group and
  // its first row, the lowest expert of the token on that node, is the pilot.
  std::vector<int32_t> expert(N), node(N);
  for (int64_t e = 0, r = 0; e < E; ++e)
    for (int64_t j = 0; j < tpe[e]; ++j, ++r) {
      expert[r] = static_cast<int32_t>(e);
      node[r] = layout.topo.node_of(layout.owner(e));
    }
  std::vector<int32_t> by_key(N);
  std::iota(by_key.begin(), by_key.end(), 0);
  std::stable_sort(by_key.begin(), by_key.end(), [&](int32_t a, int32_t b) {
    return tok[a] != tok[b] ? tok[a] < tok[b] : node[a] < node[b];
  });
  std::vector<int64_t> run_start;  // [G + 1] runs of by_key
  for (int64_t i = 0; i < N; ++i)
    if (i == 0 || tok[by_key[i]] != tok[by_key[i - 1]] || node[by_key[i]] != node[by_key[i - 1]])
      run_start.push_back(i);
  const int64_t G = static_cast<int64_t>(run_start.size());
  run_start.push_back(N);

  // Send order: by destination (the pilot's owner), then by pilot row.
  std::vector<int32_t> send(G);
  std::iota(send.begin(), send.end(), 0);
  auto pilot_of = [&](int32_t g) { return by_key[run_start[g]]; };
  auto dest_of = [&](int32_t g) { return layout.owner(expert[pilot_of(g)]); };
  std::sort(send.begin(), send.end(), [&](int32_t a, int32_t b) {
    const int da = dest_of(a), db = dest_of(b);
    return da != db ? da < db : pilot_of(a) < pilot_of(b);
  });

  RbdSourcePlan plan;
  plan.num_rows = N;
  plan.group_send.assign(P, 0);
  plan.member_send.assign(P, 0);
  plan.pilot_rows.reserve(G);
  plan.group_tokens.reserve(G);
  plan.member_rows.reserve(N);
  plan.stage1_meta.reserve(N * kRbdStage1Width);
  for (int32_t g : send) {
    const int32_t pilot = pilot_of(g);
    const int dest = dest_of(g);
    ++plan.group_send[dest];
    plan.member_send[dest] += run_start[g + 1] - run_start[g];
    plan.pilot_rows.push_back(pilot);
    plan.group_tokens.push_back(tok[pilot]);
    for (int64_t i = run_start[g]; i < run_start[g + 1]; ++i) {
      const int32_t r = by_key[i];
      plan.member_rows.push_back(r);
      plan.stage1_meta.push_back(expert[r] * 2 + (r == pilot ? 1 : 0));
      plan.stage1_meta.push_back(r);
      plan.stage1_meta.push_back(std::bit_cast<int32_t>(routing.combine_weights[r]));
    }
  }
  return plan;
}

RbdPilotPlan plan_rbd_pilot(const RbdLayout& layout, int rank, std::vector<int64_t> group_recv,
                            std::vector<int64_t> member_recv,
                            std::span<const int32_t> stage1_meta) {
  check_layout(layout);
  const int P = layout.num_ranks();
  const comm::Topology& topo = layout.topo;
  XMOE_CHECK(rank >= 0 && rank < P, "[{}] rank {} outside an ep group of {}", kOp, rank, P);
  XMOE_CHECK(static_cast<int>(group_recv.size()) == P && static_cast<int>(member_recv.size()) == P,
             "[{}] {} group and {} member counts for {} ranks", kOp, group_recv.size(),
             member_recv.size(), P);
  const int64_t M = sum(member_recv);
  XMOE_CHECK(static_cast<int64_t>(stage1_meta.size()) == M * kRbdStage1Width,
             "[{}] stage-1 metadata of {} values for {} members", kOp, stage1_meta.size(), M);
  XMOE_CHECK(sum(group_recv) <= kInt32Max && M <= kInt32Max,
             "[{}] {} groups / {} members do not fit int32 indices", kOp, sum(group_recv), M);
  const int L = static_cast<int>(topo.ranks_on(topo.node_of(rank)).size());

  // Arrival order: the group of each member (a running count of pilot flags), its owner's
  // local rank and its source rank.
  std::vector<int32_t> group(M), local(M), source(M);
  int64_t g = -1, k = 0;
  for (int p = 0; p < P; ++p) {
    const int64_t first_group = g + 1;
    for (int64_t q = 0; q < member_recv[p]; ++q, ++k) {
      const int32_t key = stage1_meta[k * kRbdStage1Width];
      const int64_t e = key / 2;
      const bool pilot = (key & 1) != 0;
      XMOE_CHECK(key >= 0 && e < layout.num_experts() && (pilot || q > 0),
                 "[{}] rank {}: bad stage-1 metadata from rank {} (expert key {})", kOp, rank, p,
                 key);
      g += pilot;
      const int owner = layout.owner(e);
      XMOE_CHECK(topo.node_of(owner) == topo.node_of(rank),
                 "[{}] rank {} got a pilot for expert {} on another node", kOp, rank, e);
      group[k] = static_cast<int32_t>(g);
      local[k] = topo.local_rank(owner);
      source[k] = p;
    }
    XMOE_CHECK(g + 1 - first_group == group_recv[p],
               "[{}] rank {}: {} groups in the metadata from rank {}, the counts say {}", kOp, rank,
               g + 1 - first_group, p, group_recv[p]);
  }

  RbdPilotPlan plan;
  plan.group_recv = std::move(group_recv);
  plan.member_recv = std::move(member_recv);
  plan.replica_send.assign(L, 0);
  for (int64_t i = 0; i < M; ++i) ++plan.replica_send[local[i]];
  std::vector<int64_t> next(L, 0);  // stage-2 position of the next replica for each node rank
  for (int l = 1; l < L; ++l) next[l] = next[l - 1] + plan.replica_send[l - 1];
  plan.replica_group.assign(M, 0);
  plan.replica_weight.assign(M, 0.f);
  plan.replica_member.assign(M, 0);
  plan.stage2_meta.assign(M * kRbdStage2Width, 0);
  for (int64_t i = 0; i < M; ++i) {
    const int32_t* m = stage1_meta.data() + i * kRbdStage1Width;
    const int64_t j = next[local[i]]++;
    plan.replica_group[j] = group[i];
    plan.replica_weight[j] = std::bit_cast<float>(m[2]);
    plan.replica_member[j] = static_cast<int32_t>(i);
    int32_t* s = plan.stage2_meta.data() + j * kRbdStage2Width;
    s[0] = static_cast<int32_t>((m[0] / 2) % layout.experts_per_rank);
    s[1] = source[i];
    s[2] = m[1];
  }
  return plan;
}

RbdOwnerPlan plan_rbd_owner(const RbdLayout& layout, std::vector<int64_t> replica_recv,
                            std::span<const int32_t> stage2_meta) {
  check_layout(layout);
  const int P = layout.num_ranks();
  const int64_t El = layout.experts_per_rank, R = sum(replica_recv);
  XMOE_CHECK(static_cast<int64_t>(stage2_meta.size()) == R * kRbdStage2Width,
             "[{}] stage-2 metadata of {} values for {} replicas", kOp, stage2_meta.size(), R);
  XMOE_CHECK(R <= kInt32Max, "[{}] {} replicas do not fit int32 indices", kOp, R);
  RbdOwnerPlan plan;
  plan.replica_recv = std::move(replica_recv);
  plan.recv_tokens_per_expert.assign(El, 0);
  plan.recv_counts_per_expert.assign(static_cast<size_t>(P * El), 0);
  plan.recv_counts.assign(P, 0);
  std::vector<std::array<int32_t, 3>> key(R);
  for (int64_t i = 0; i < R; ++i) {
    const int32_t* m = stage2_meta.data() + i * kRbdStage2Width;
    XMOE_CHECK(m[0] >= 0 && m[0] < El && m[1] >= 0 && m[1] < P && m[2] >= 0,
               "[{}] bad stage-2 metadata ({}, {}, {})", kOp, m[0], m[1], m[2]);
    key[i] = {m[0], m[1], m[2]};
    ++plan.recv_tokens_per_expert[m[0]];
    ++plan.recv_counts_per_expert[m[1] * El + m[0]];
    ++plan.recv_counts[m[1]];
  }
  plan.expert_order.resize(R);
  std::iota(plan.expert_order.begin(), plan.expert_order.end(), 0);
  std::sort(plan.expert_order.begin(), plan.expert_order.end(),
            [&](int32_t a, int32_t b) { return key[a] < key[b]; });
  plan.arrival_order.resize(R);
  for (int64_t j = 0; j < R; ++j)
    plan.arrival_order[plan.expert_order[j]] = static_cast<int32_t>(j);
  return plan;
}

namespace {

/// An all_to_all_v of `width` int32 per row among `ranks` (positions in `ranks` are the
/// senders' peer indices), received by ranks[at]: the rows each sender addressed to it, in
/// sender order. send[i], counts[i]: sender ranks[i]'s buffer and per-peer row counts.
std::vector<int32_t> exchange(const std::vector<const std::vector<int32_t>*>& send,
                              const std::vector<const std::vector<int64_t>*>& counts, int at,
                              int64_t width) {
  std::vector<int32_t> out;
  for (size_t i = 0; i < send.size(); ++i) {
    const std::vector<int64_t>& c = *counts[i];
    const int64_t start = std::accumulate(c.begin(), c.begin() + at, int64_t{0}) * width;
    out.insert(out.end(), send[i]->begin() + start, send[i]->begin() + start + c[at] * width);
  }
  return out;
}

}  // namespace

std::vector<RbdPlan> plan_rbd(const RbdLayout& layout, std::span<const RbdRouting> routing) {
  const int P = layout.num_ranks();
  XMOE_CHECK(static_cast<int>(routing.size()) == P, "[{}] {} routings for {} ranks", kOp,
             routing.size(), P);
  std::vector<RbdPlan> plans(P);
  for (int r = 0; r < P; ++r) plans[r].source = plan_rbd_source(layout, routing[r]);
  // Stage 1 over every rank: counts and member metadata.
  std::vector<const std::vector<int32_t>*> meta1(P);
  std::vector<const std::vector<int64_t>*> members(P);
  for (int r = 0; r < P; ++r) {
    meta1[r] = &plans[r].source.stage1_meta;
    members[r] = &plans[r].source.member_send;
  }
  for (int q = 0; q < P; ++q) {
    std::vector<int64_t> group_recv(P), member_recv(P);
    for (int p = 0; p < P; ++p) {
      group_recv[p] = plans[p].source.group_send[q];
      member_recv[p] = plans[p].source.member_send[q];
    }
    plans[q].pilot = plan_rbd_pilot(layout, q, std::move(group_recv), std::move(member_recv),
                                    exchange(meta1, members, q, kRbdStage1Width));
  }
  // Stage 2 inside each node: counts and replica metadata.
  for (int q = 0; q < P; ++q) {
    const std::vector<int> node = layout.topo.ranks_on(layout.topo.node_of(q));
    const int at = layout.topo.local_rank(q);
    std::vector<const std::vector<int32_t>*> meta2;
    std::vector<const std::vector<int64_t>*> replicas;
    std::vector<int64_t> replica_recv;
    for (int p : node) {
      meta2.push_back(&plans[p].pilot.stage2_meta);
      replicas.push_back(&plans[p].pilot.replica_send);
      replica_recv.push_back(plans[p].pilot.replica_send[at]);
    }
    plans[q].owner = plan_rbd_owner(layout, std::move(replica_recv),
                                    exchange(meta2, replicas, at, kRbdStage2Width));
  }
  return plans;
}

}  // namespace xmoe::moe
