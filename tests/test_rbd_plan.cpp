// The RBD plan (moe/rbd_plan.h) in one process, no MPI: every rank's plan of a group over 2-4
// simulated nodes, with the metadata exchanges done in memory (plan_rbd).
//  (a) hand-made routings, checked field by field: a token with all its experts on one remote
//      node (one pilot, two replicas), a token whose experts span every node, ranks that
//      receive nothing, an owner whose arrivals are out of expert order;
//  (b) random routings on five topologies, the plan executed on int64 payloads the way the
//      dispatcher executes it on rows: every owner receives all_to_all's rows in all_to_all's
//      order, combine's reduction gives each token the sum of its weighted outputs, and the
//      stage-1 groups and metadata rows to remote nodes match the analytic counts;
//  (c) ids above 2^24 (tokens and source rows near 2^25, which f32 rounds) stay exact, and so
//      do the combine weights' bits; bad routings and bad metadata are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "testing.h"
#include "xmoe/moe/rbd_plan.h"

using namespace xmoe;
using namespace xmoe::moe;
using xmoe::testing::error_of;

namespace {

using I64 = std::vector<int64_t>;
using I32 = std::vector<int32_t>;

RbdLayout layout_of(int ranks, int ranks_per_node, int64_t experts_per_rank) {
  return RbdLayout{comm::Topology::uniform(ranks, ranks_per_node), experts_per_rank};
}

/// One rank's rows in the order stage's layout, owning its vectors (RbdRouting holds spans).
struct Rows {
  I64 tokens_per_expert;
  I32 token_ids;
  std::vector<float> weights;
  std::vector<int32_t> experts;  // [N] expert of each row (for the checks)
  RbdRouting routing() const { return {tokens_per_expert, token_ids, weights}; }
};

/// Rows from per-token expert lists: grouped by expert, inside an expert by token order.
/// weight(token, slot) gives each (token, expert) pair's combine weight.
template <class Weight>
Rows rows_of(int64_t num_experts, const std::vector<std::pair<int32_t, I32>>& tokens,
             Weight&& weight) {
  Rows r;
  r.tokens_per_expert.assign(num_experts, 0);
  for (int64_t e = 0; e < num_experts; ++e)
    for (const auto& [token, experts] : tokens)
      for (size_t j = 0; j < experts.size(); ++j)
        if (experts[j] == e) {
          ++r.tokens_per_expert[e];
          r.token_ids.push_back(token);
          r.weights.push_back(weight(token, static_cast<int>(j)));
          r.experts.push_back(static_cast<int32_t>(e));
        }
  return r;
}

std::vector<RbdPlan> plan_all(const RbdLayout& layout, const std::vector<Rows>& rows) {
  std::vector<RbdRouting> routing;
  for (const Rows& r : rows) routing.push_back(r.routing());
  return plan_rbd(layout, routing);
}

int32_t bits(float f) {
  return std::bit_cast<int32_t>(f);
}

// ---- (a) hand-made --------------------------------------------------------------------------

TEST(RbdPlan, TwoNodesByHand) {
  // 4 ranks, 2 per node, one expert each: experts 0, 1 on node 0, experts 2, 3 on node 1.
  const RbdLayout layout = layout_of(4, 2, 1);
  // Rank 0 only. token 0 -> {3}: one remote pilot (rank 3); token 1 -> {0, 2}: every node, two
  // pilots (rank 0 itself, rank 2); token 2 -> {2, 3}: both on node 1, one pilot (rank 2) and a
  // replica for rank 3. Rank 1 owns expert 1, which nobody chose: it receives nothing.
  std::vector<Rows> rows(4, rows_of(4, {}, [](int32_t, int) { return 0.f; }));
  rows[0] = rows_of(4, {{0, {3}}, {1, {0, 2}}, {2, {2, 3}}}, [](int32_t, int) { return 0.f; });
  // Rows by expert: e0: t1 (row 0); e2: t1 (1), t2 (2); e3: t0 (3), t2 (4).
  ASSERT_EQ(rows[0].tokens_per_expert, (I64{1, 0, 2, 2}));
  ASSERT_EQ(rows[0].token_ids, (I32{1, 1, 2, 0, 2}));
  const std::vector<float> w = {0.5f, 0.1f, 0.75f, 0.125f, 3e-39f};  // per row; 3e-39 denormal
  rows[0].weights = w;
  const std::vector<RbdPlan> plans = plan_all(layout, rows);

  // Source 0: groups (t0, n1) pilot row 3 -> rank 3; (t1, n0) row 0 -> rank 0; (t1, n1) row 1
  // -> rank 2; (t2, n1) rows 2, 4, pilot row 2 -> rank 2. Send order: by rank, then pilot row.
  const RbdSourcePlan& s = plans[0].source;
  EXPECT_EQ(s.num_rows, 5);
  EXPECT_EQ(s.group_send, (I64{1, 0, 2, 1}));
  EXPECT_EQ(s.member_send, (I64{1, 0, 3, 1}));
  EXPECT_EQ(s.pilot_rows, (I32{0, 1, 2, 3}));
  EXPECT_EQ(s.group_tokens, (I32{1, 1, 2, 0}));
  EXPECT_EQ(s.member_rows, (I32{0, 1, 2, 4, 3}));
  EXPECT_EQ(s.stage1_meta, (I32{0 * 2 + 1, 0, bits(w[0]),     // e0, pilot
                                2 * 2 + 1, 1, bits(w[1]),     // e2, pilot of (t1, n1)
                                2 * 2 + 1, 2, bits(w[2]),     // e2, pilot of (t2, n1)
                                3 * 2 + 0, 4, bits(w[4]),     // e3, replica of (t2, n1)
                                3 * 2 + 1, 3, bits(w[3])}));  // e3, pilot of (t0, n1)
  for (int r = 1; r < 4; ++r) {
    EXPECT_EQ(plans[r].source.num_groups(), 0);
    EXPECT_EQ(plans[r].source.group_send, (I64{0, 0, 0, 0}));
  }

  // Pilots. Rank 0: its own group (t1, n0), one replica for itself.
  const RbdPilotPlan& p0 = plans[0].pilot;
  EXPECT_EQ(p0.group_recv, (I64{1, 0, 0, 0}));
  EXPECT_EQ(p0.member_recv, (I64{1, 0, 0, 0}));
  EXPECT_EQ(p0.replica_send, (I64{1, 0}));
  EXPECT_EQ(p0.replica_group, (I32{0}));
  EXPECT_EQ(p0.stage2_meta, (I32{0, 0, 0}));
  // Rank 2: groups 0 = (t1, n1) and 1 = (t2, n1); replicas for rank 2 (e2: arrivals 0, 1) and
  // rank 3 (e3: arrival 2). The reduction map sends both replicas of t2 to group 1.
  const RbdPilotPlan& p2 = plans[2].pilot;
  EXPECT_EQ(p2.group_recv, (I64{2, 0, 0, 0}));
  EXPECT_EQ(p2.member_recv, (I64{3, 0, 0, 0}));
  EXPECT_EQ(p2.num_groups(), 2);
  EXPECT_EQ(p2.replica_send, (I64{2, 1}));
  EXPECT_EQ(p2.replica_group, (I32{0, 1, 1}));
  EXPECT_EQ(p2.replica_member, (I32{0, 1, 2}));
  EXPECT_EQ(p2.replica_weight, (std::vector<float>{w[1], w[2], w[4]}));
  EXPECT_EQ(p2.stage2_meta, (I32{0, 0, 1, 0, 0, 2, 0, 0, 4}));
  // Rank 3: group (t0, n1), its replica for itself.
  const RbdPilotPlan& p3 = plans[3].pilot;
  EXPECT_EQ(p3.group_recv, (I64{1, 0, 0, 0}));
  EXPECT_EQ(p3.replica_send, (I64{0, 1}));
  EXPECT_EQ(p3.replica_group, (I32{0}));
  EXPECT_EQ(p3.stage2_meta, (I32{0, 0, 3}));
  // Rank 1: no group, no replica.
  EXPECT_EQ(plans[1].pilot.num_groups(), 0);
  EXPECT_EQ(plans[1].pilot.replica_send, (I64{0, 0}));
  EXPECT_TRUE(plans[1].pilot.replica_group.empty());

  // Owners. Rank 3 gets row 4 (from pilot rank 2) before row 3 (from itself): expert order
  // (local expert, source rank, source row) swaps them.
  EXPECT_EQ(plans[3].owner.replica_recv, (I64{1, 1}));
  EXPECT_EQ(plans[3].owner.expert_order, (I32{1, 0}));
  EXPECT_EQ(plans[3].owner.arrival_order, (I32{1, 0}));
  EXPECT_EQ(plans[3].owner.recv_counts, (I64{2, 0, 0, 0}));
  EXPECT_EQ(plans[3].owner.recv_tokens_per_expert, (I64{2}));
  EXPECT_EQ(plans[2].owner.replica_recv, (I64{2, 0}));
  EXPECT_EQ(plans[2].owner.expert_order, (I32{0, 1}));
  EXPECT_EQ(plans[0].owner.replica_recv, (I64{1, 0}));
  EXPECT_EQ(plans[0].owner.recv_counts_per_expert, (I64{1, 0, 0, 0}));
  // Rank 1 receives zero rows.
  EXPECT_EQ(plans[1].owner.replica_recv, (I64{0, 0}));
  EXPECT_EQ(plans[1].owner.num_rows(), 0);
  EXPECT_EQ(plans[1].owner.recv_counts, (I64{0, 0, 0, 0}));
  EXPECT_EQ(plans[1].owner.recv_tokens_per_expert, (I64{0}));
}

TEST(RbdPlan, TokenOverEveryNodeOfFour) {
  // 8 ranks, 2 per node (4 nodes), 2 experts per rank: expert e on rank e / 2, node e / 4.
  const RbdLayout layout = layout_of(8, 2, 2);
  std::vector<Rows> rows(8, rows_of(16, {}, [](int32_t, int) { return 0.f; }));
  // Rank 5 (node 2): token 7 -> {1, 4, 9, 14, 15}: nodes 0, 1, 2, 3, 3; experts 14 and 15 are
  // both on rank 7. token 3 -> {10, 11}: both on rank 5 itself, one group that stays home.
  rows[5] = rows_of(16, {{3, {10, 11}}, {7, {1, 4, 9, 14, 15}}},
                    [](int32_t t, int j) { return 0.125f * float(t + j); });
  const std::vector<RbdPlan> plans = plan_all(layout, rows);
  const RbdSourcePlan& s = plans[5].source;
  EXPECT_EQ(s.num_groups(), 5);  // 4 nodes for token 7, 1 for token 3
  EXPECT_EQ(s.group_send, (I64{1, 0, 1, 0, 1, 1, 0, 1}));
  EXPECT_EQ(s.member_send, (I64{1, 0, 1, 0, 1, 2, 0, 2}));
  EXPECT_EQ(s.group_tokens, (I32{7, 7, 7, 3, 7}));
  // Rows: e1 t7 (0), e4 t7 (1), e9 t7 (2), e10 t3 (3), e11 t3 (4), e14 t7 (5), e15 t7 (6).
  EXPECT_EQ(s.pilot_rows, (I32{0, 1, 2, 3, 5}));
  EXPECT_EQ(s.member_rows, (I32{0, 1, 2, 3, 4, 5, 6}));
  // Rank 7 pilots token 7 on node 3 and keeps both replicas; rank 6 gets nothing.
  EXPECT_EQ(plans[7].pilot.replica_send, (I64{0, 2}));
  EXPECT_EQ(plans[7].pilot.replica_group, (I32{0, 0}));
  EXPECT_EQ(plans[7].owner.recv_tokens_per_expert, (I64{1, 1}));
  EXPECT_EQ(plans[6].pilot.num_groups(), 0);
  EXPECT_EQ(plans[6].owner.num_rows(), 0);
  // Rank 5 pilots its home group: both replicas stay on rank 5 (local rank 1 of node 2).
  EXPECT_EQ(plans[5].pilot.group_recv, (I64{0, 0, 0, 0, 0, 1, 0, 0}));
  EXPECT_EQ(plans[5].pilot.replica_send, (I64{0, 2}));
  EXPECT_EQ(plans[5].owner.recv_counts, (I64{0, 0, 0, 0, 0, 2, 0, 0}));
  // Node 2's other rank (4) owns expert 9: the pilot of token 7 on node 2.
  EXPECT_EQ(plans[4].pilot.group_recv, (I64{0, 0, 0, 0, 0, 1, 0, 0}));
  EXPECT_EQ(plans[4].pilot.replica_send, (I64{1, 0}));
}

// ---- (b) random routings, the plan executed on payloads ----------------------------------------

/// An all_to_all_v of one value per row among `senders` (in peer order), received by peer `at`.
I64 receive(const std::vector<I64>& send, const std::vector<I64>& counts, int at) {
  I64 out;
  for (size_t i = 0; i < send.size(); ++i) {
    int64_t start = 0;
    for (int p = 0; p < at; ++p) start += counts[i][p];
    out.insert(out.end(), send[i].begin() + start, send[i].begin() + start + counts[i][at]);
  }
  return out;
}

template <class T, class Index>
std::vector<T> gather(const std::vector<T>& x, const Index& idx) {
  std::vector<T> out;
  for (auto i : idx) out.push_back(x[static_cast<size_t>(i)]);
  return out;
}

struct Case {
  int ranks, rpn;
  int64_t experts_per_rank, k;
  int32_t first_token;
};

void check_random(const Case& c, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "ranks " << c.ranks << ", rpn " << c.rpn << ", E_local "
                                    << c.experts_per_rank << ", k " << c.k << ", seed " << seed);
  const RbdLayout layout = layout_of(c.ranks, c.rpn, c.experts_per_rank);
  const comm::Topology& topo = layout.topo;
  const int P = c.ranks;
  const int64_t E = layout.num_experts();
  std::mt19937 rng(seed);
  std::vector<Rows> rows(P);
  int64_t remote_groups = 0, remote_rows = 0;
  std::map<std::pair<int, int32_t>, double> expect_y;  // (rank, token) -> sum_j w_j * e_j
  for (int r = 0; r < P; ++r) {
    const int64_t T = (r == 1) ? 0 : 1 + rng() % 12;  // rank 1 sends nothing
    std::vector<std::pair<int32_t, I32>> tokens;
    for (int64_t t = 0; t < T; ++t) {
      I32 all(E);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      if (r == 2)  // rank 2's tokens skip the last rank's experts: that rank may get nothing
        all.erase(std::remove_if(all.begin(), all.end(),
                                 [&](int32_t e) { return layout.owner(e) == P - 1; }),
                  all.end());
      all.resize(static_cast<size_t>(c.k));
      tokens.push_back({c.first_token + static_cast<int32_t>(3 * t), all});
      std::set<int> remote;
      for (int32_t e : all) {
        const int n = topo.node_of(layout.owner(e));
        if (n != topo.node_of(r)) remote.insert(n), ++remote_rows;
      }
      remote_groups += static_cast<int64_t>(remote.size());
    }
    // Weights in multiples of 1/8 and small integer outputs: every sum below is exact.
    auto weight = [](int32_t t, int j) { return 0.125f * float(1 + (t + j) % 7); };
    rows[r] = rows_of(E, tokens, weight);
    for (const auto& [t, experts] : tokens)
      for (size_t j = 0; j < experts.size(); ++j)
        expect_y[{r, t}] += double(weight(t, static_cast<int>(j))) * experts[j];
  }
  const std::vector<RbdPlan> plans = plan_all(layout, rows);

  // Analytic stage-1 counts to other nodes.
  int64_t groups_out = 0, members_out = 0;
  for (int p = 0; p < P; ++p)
    for (int q = 0; q < P; ++q)
      if (topo.node_of(p) != topo.node_of(q)) {
        groups_out += plans[p].source.group_send[q];
        members_out += plans[p].source.member_send[q];
      }
  EXPECT_EQ(groups_out, remote_groups);
  EXPECT_EQ(members_out, remote_rows);

  // Dispatch on payloads: a row of rank p for token t carries (p, t) packed in an int64 (a
  // token's rows are one row x[t], which is why a pilot can stand for them).
  auto payload = [](int64_t p, int64_t token) { return (p << 40) | token; };
  std::vector<I64> pilots_send(P), group_send(P), replicas(P), replica_send(P);
  for (int p = 0; p < P; ++p) {
    I64 x;
    for (int32_t t : rows[p].token_ids) x.push_back(payload(p, t));
    pilots_send[p] = gather(x, plans[p].source.pilot_rows);
    group_send[p] = plans[p].source.group_send;
  }
  std::vector<I64> arrival(P);
  for (int q = 0; q < P; ++q) {
    const I64 pilots = receive(pilots_send, group_send, q);
    ASSERT_EQ(static_cast<int64_t>(pilots.size()), plans[q].pilot.num_groups());
    replicas[q] = gather(pilots, plans[q].pilot.replica_group);
    replica_send[q] = plans[q].pilot.replica_send;
  }
  std::vector<I64> outs(P), replica_recv(P);
  for (int q = 0; q < P; ++q) {
    std::vector<I64> send, counts;
    for (int p : topo.ranks_on(topo.node_of(q))) {
      send.push_back(replicas[p]);
      counts.push_back(replica_send[p]);
    }
    arrival[q] = receive(send, counts, topo.local_rank(q));
    const RbdOwnerPlan& o = plans[q].owner;
    ASSERT_EQ(static_cast<int64_t>(arrival[q].size()), o.num_rows());
    // all_to_all's rows and order: local experts, then source ranks, then source rows (in
    // which an expert's rows are in token order).
    I64 expect, expect_tpe, out;
    for (int64_t e = q * c.experts_per_rank; e < (q + 1) * c.experts_per_rank; ++e) {
      expect_tpe.push_back(0);
      for (int p = 0; p < P; ++p)
        for (size_t i = 0; i < rows[p].experts.size(); ++i)
          if (rows[p].experts[i] == e) {
            expect.push_back(payload(p, rows[p].token_ids[i]));
            ++expect_tpe.back();
            out.push_back(e);  // the expert's output: its global id
          }
    }
    EXPECT_EQ(gather(arrival[q], o.expert_order), expect) << "owner " << q;
    EXPECT_EQ(o.recv_tokens_per_expert, expect_tpe) << "owner " << q;
    EXPECT_EQ(gather(gather(arrival[q], o.expert_order), o.arrival_order), arrival[q]);
    outs[q] = gather(out, o.arrival_order);  // combine: expert order -> arrival order
    replica_recv[q] = o.replica_recv;
  }

  // Combine: owner -> pilot (stage 2 reversed), partial[g] = sum w_j out_j over the reduction
  // map, pilot -> source (stage 1 reversed).
  std::vector<std::vector<double>> partial_send(P);
  std::vector<I64> group_recv(P);
  for (int q = 0; q < P; ++q) {
    std::vector<I64> send, counts;
    for (int p : topo.ranks_on(topo.node_of(q))) {
      send.push_back(outs[p]);
      counts.push_back(replica_recv[p]);
    }
    const I64 member_out = receive(send, counts, topo.local_rank(q));
    const RbdPilotPlan& pl = plans[q].pilot;
    ASSERT_EQ(static_cast<int64_t>(member_out.size()), pl.num_replicas());
    partial_send[q].assign(pl.num_groups(), 0.0);
    for (int64_t j = 0; j < pl.num_replicas(); ++j)
      partial_send[q][pl.replica_group[j]] += double(pl.replica_weight[j]) * member_out[j];
    group_recv[q] = pl.group_recv;
  }
  for (int p = 0; p < P; ++p) {
    // Partials back to source p, in its send order: pilot q's groups from p are contiguous.
    std::vector<double> back;
    for (int q = 0; q < P; ++q) {
      int64_t start = 0;
      for (int s = 0; s < p; ++s) start += group_recv[q][s];
      back.insert(back.end(), partial_send[q].begin() + start,
                  partial_send[q].begin() + start + group_recv[q][p]);
    }
    ASSERT_EQ(static_cast<int64_t>(back.size()), plans[p].source.num_groups());
    std::map<int32_t, double> y;
    for (size_t g = 0; g < back.size(); ++g) y[plans[p].source.group_tokens[g]] += back[g];
    for (const auto& [t, v] : y) EXPECT_EQ(v, (expect_y[{p, t}])) << "rank " << p << " token " << t;
  }
}

TEST(RbdPlan, RandomRoutingsExecuteLikeAllToAll) {
  const Case cases[] = {{4, 2, 2, 3, 0},  // 2 nodes
                        {6, 2, 2, 4, 0},  // 3 nodes
                        {8, 2, 1, 5, 0},  // 4 nodes
                        {4, 1, 3, 6, 0},  // 4 nodes of one rank: stage 2 stays on the rank
                        {6, 3, 2, 2, 0},  // 2 nodes of 3 ranks
                        {8, 4, 2, 8, 0},  // 2 nodes, k = E / 2
                        {6, 2, 1, 3, (1 << 25) - 7}};  // 3 nodes, token ids across 2^25
  for (const Case& c : cases)
    for (uint32_t seed : {1u, 2u, 3u}) check_random(c, seed);
}

// ---- (c) large ids, weights' bits, errors -------------------------------------------------

TEST(RbdPlan, TokenIdsNear2To25StayExact) {
  // f32 has 24 significant bits: 2^25 + 1, + 2, + 3 all round to 2^25 or 2^25 + 4. As int32
  // they stay three tokens, three groups, three exact group tokens.
  constexpr int32_t kBig = 1 << 25;
  ASSERT_EQ(float(kBig + 1), float(kBig));  // what an f32 column would have done
  const RbdLayout layout = layout_of(4, 2, 1);
  std::vector<Rows> rows(4, rows_of(4, {}, [](int32_t, int) { return 0.f; }));
  rows[1] = rows_of(4, {{kBig + 1, {2, 3}}, {kBig + 2, {2}}, {kBig + 3, {0, 3}}},
                    [](int32_t, int) { return 0.5f; });
  const std::vector<RbdPlan> plans = plan_all(layout, rows);
  const RbdSourcePlan& s = plans[1].source;
  // Rows: e0 +3 (0); e2 +1 (1), +2 (2); e3 +1 (3), +3 (4). Groups in send order: (+3, n0) to
  // rank 0, (+1, n1) and (+2, n1) to rank 2, (+3, n1) to rank 3.
  EXPECT_EQ(s.group_tokens, (I32{kBig + 3, kBig + 1, kBig + 2, kBig + 3}));
  EXPECT_EQ(s.pilot_rows, (I32{0, 1, 2, 4}));
  EXPECT_EQ(s.group_send, (I64{1, 0, 2, 1}));
  // Rank 2 pilots two groups; the two replicas of kBig + 1 map to one group.
  EXPECT_EQ(plans[2].pilot.num_groups(), 2);
  EXPECT_EQ(plans[2].pilot.replica_send, (I64{2, 1}));
  EXPECT_EQ(plans[2].pilot.replica_group, (I32{0, 1, 0}));
}

TEST(RbdPlan, SourceRowsNear2To25AndWeightBitsStayExact) {
  // The pilot and owner phases alone, fed stage-1 metadata by hand: rows 2^25 + 3 and 2^25 + 1
  // (equal as f32) keep their values through stage 2 and sort in integer order at the owner.
  constexpr int32_t kBig = 1 << 25;
  const RbdLayout layout = layout_of(4, 2, 1);
  const float w1 = 0.1f, w2 = std::numeric_limits<float>::denorm_min();
  // Rank 2 receives from source 0 one group of two members (e2 pilot row kBig + 3, e3 row kBig
  // + 5) and from source 1 one group (e2, row kBig + 1).
  const I32 meta1 = {2 * 2 + 1, kBig + 3,  bits(w1), 3 * 2,   kBig + 5,
                     bits(w2),  2 * 2 + 1, kBig + 1, bits(w2)};
  const RbdPilotPlan p = plan_rbd_pilot(layout, 2, {1, 1, 0, 0}, {2, 1, 0, 0}, meta1);
  EXPECT_EQ(p.replica_send, (I64{2, 1}));
  EXPECT_EQ(p.replica_group, (I32{0, 1, 0}));
  EXPECT_EQ(p.stage2_meta, (I32{0, 0, kBig + 3, 0, 1, kBig + 1, 0, 0, kBig + 5}));
  EXPECT_EQ(bits(p.replica_weight[0]), bits(w1));
  EXPECT_EQ(bits(p.replica_weight[1]), bits(w2));
  EXPECT_EQ(bits(p.replica_weight[2]), bits(w2));
  // Owner rank 2 receives (source 1, row kBig + 2), (1, kBig + 1), (0, kBig + 3): sorted by
  // source, then row; kBig + 1 and kBig + 2 are one value as f32 (kBig), two as int32.
  ASSERT_EQ(float(kBig + 1), float(kBig + 2));
  const I32 meta2 = {0, 1, kBig + 2, 0, 1, kBig + 1, 0, 0, kBig + 3};
  const RbdOwnerPlan o = plan_rbd_owner(layout, {3, 0}, meta2);
  EXPECT_EQ(o.expert_order, (I32{2, 1, 0}));
  EXPECT_EQ(o.recv_counts, (I64{1, 2, 0, 0}));
}

TEST(RbdPlan, RefusesBadRoutingAndMetadata) {
  const RbdLayout layout = layout_of(4, 2, 1);
  Rows r = rows_of(4, {{0, {1}}, {1, {2}}}, [](int32_t, int) { return 1.f; });
  r.token_ids[1] = -1;
  EXPECT_NE(error_of([&] {
              plan_rbd_source(layout, r.routing());
            }).find("[moe dispatch rbd] token id -1"),
            std::string::npos);
  r.token_ids.pop_back();
  EXPECT_NE(error_of([&] { plan_rbd_source(layout, r.routing()); }).find("1 token ids"),
            std::string::npos);
  // A member for expert 0 (node 0) sent to rank 2 (node 1).
  EXPECT_NE(error_of([&] {
              plan_rbd_pilot(layout, 2, {1, 0, 0, 0}, {1, 0, 0, 0}, I32{1, 0, bits(1.f)});
            }).find("on another node"),
            std::string::npos);
  // A message that starts with a non-pilot member, and group counts that disagree.
  EXPECT_NE(error_of([&] {
              plan_rbd_pilot(layout, 2, {1, 0, 0, 0}, {1, 0, 0, 0}, I32{4, 0, bits(1.f)});
            }).find("bad stage-1 metadata"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              plan_rbd_pilot(layout, 2, {2, 0, 0, 0}, {1, 0, 0, 0}, I32{5, 0, bits(1.f)});
            }).find("the counts say 2"),
            std::string::npos);
}

}  // namespace
