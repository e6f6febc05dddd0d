// Redundancy-bypassing dispatch (moe.dispatch = rbd) under mpirun (np 4 and 8), with simulated
// nodes of ranks_per_node ep ranks (every rpn that gives >= 2 nodes; rpn = W degrades to
// all_to_all):
//  (a) the dispatcher with rank-encoded payloads: what each expert receives (source rank and
//      token in the payload, order = all_to_all's), the (token, node) groups, the combined
//      partial sums, both backwards and d(combine weights) — all exact (small integers and
//      weights in multiples of 1/8); the stage-1 row bytes against the analytic count; uniform,
//      skewed, all-k-experts-on-one-node routings and ranks that send or receive nothing;
//  (b) the MoE layer with rbd against the same layer with all_to_all on the same ranks: y, dx,
//      every parameter gradient (including the router's, through the combine weights).
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <set>

#include "gradcheck.h"
#include "training_fixture.h"
#include "xmoe/comm/group.h"
#include "xmoe/core/rng.h"
#include "xmoe/moe/dispatch_rbd.h"
#include "xmoe/moe/layer.h"
#include "xmoe/ops/ops.h"
#include "xmoe/parallel/layout.h"

using namespace xmoe;
using namespace xmoe::moe;
using xmoe::testing::randn;
using xmoe::testing::rel_err;

namespace {

std::shared_ptr<comm::Group> world() {
  return comm::world();
}

constexpr int64_t kE = 24;  // divisible by 1, 2, 3, 4, 8
constexpr int64_t kCols = 4;

/// rpn values with at least two nodes (and W itself, which must degrade to all_to_all).
std::vector<int> rpns() {
  const int W = world()->size();
  std::vector<int> out;
  for (int rpn = 1; rpn <= W; ++rpn)
    if (W % rpn == 0) out.push_back(rpn);
  return out;
}

// ---- (a) rank-encoded payloads ----------------------------------------------------------------

enum class Routing { uniform, skewed, one_node, sparse };

/// topk [T_r * k] of rank r (computable on every rank).
std::vector<int32_t> routing_of(Routing kind, int r, int W, int rpn, int64_t k, int64_t& T) {
  const int64_t El = kE / W, per_node = El * rpn, nodes = W / rpn;
  T = (kind == Routing::sparse && r == 1) ? 0 : 10 + 3 * r;  // rank 1 sends nothing (sparse)
  Rng rng(99, static_cast<uint64_t>(r) + 1);
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> pool;
    if (kind == Routing::skewed) {
      for (int64_t j = 0; j < k; ++j) pool.push_back(static_cast<int32_t>(j));  // all on rank 0
    } else if (kind == Routing::one_node) {
      const int64_t n = (t + r) % nodes;  // every expert of the token on node n
      std::vector<int32_t> cand(per_node);
      std::iota(cand.begin(), cand.end(), static_cast<int32_t>(n * per_node));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t pick = static_cast<int64_t>(rng.uniform() * cand.size()) % cand.size();
        pool.push_back(cand[pick]);
        cand.erase(cand.begin() + pick);
      }
    } else {
      std::vector<int32_t> cand;
      for (int32_t e = 0; e < kE; ++e)  // sparse: experts of odd ranks get nothing
        if (kind != Routing::sparse || (e / El) % 2 == 0) cand.push_back(e);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t pick = static_cast<int64_t>(rng.uniform() * cand.size()) % cand.size();
        pool.push_back(cand[pick]);
        cand.erase(cand.begin() + pick);
      }
    }
    idx.insert(idx.end(), pool.begin(), pool.end());
  }
  return idx;
}

struct Pft {
  std::vector<int64_t> tpe;          // [E]
  std::vector<int32_t> token, slot;  // [N]
};

/// The order stage's layout: rows by expert, inside an expert by (token, slot).
Pft pft(const std::vector<int32_t>& idx, int64_t T, int64_t k) {
  Pft p;
  p.tpe.assign(kE, 0);
  for (int32_t e = 0; e < kE; ++e)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j)
        if (idx[t * k + j] == e) {
          ++p.tpe[e];
          p.token.push_back(static_cast<int32_t>(t));
          p.slot.push_back(static_cast<int32_t>(j));
        }
  return p;
}

float weight_of(int r, int64_t t, int64_t j) {
  return 0.125f * float(1 + (r + t * 3 + j) % 7);
}

void check_rbd(Routing kind, int rpn, int64_t k) {
  SCOPED_TRACE("routing " + std::to_string(int(kind)) + ", rpn " + std::to_string(rpn) + ", k " +
               std::to_string(k));
  auto g = world();
  const int q = g->rank(), W = g->size();
  const int64_t El = kE / W;
  const comm::Topology topo = comm::Topology::uniform(W, rpn);
  auto node_of_expert = [&](int64_t e) { return topo.node_of(static_cast<int>(e / El)); };
  std::vector<std::vector<int32_t>> idx(W);
  std::vector<int64_t> T(W);
  std::vector<Pft> layout(W);
  for (int r = 0; r < W; ++r) {
    idx[r] = routing_of(kind, r, W, rpn, k, T[r]);
    layout[r] = pft(idx[r], T[r], k);
  }
  const Pft& mine = layout[q];
  const int64_t N = static_cast<int64_t>(mine.token.size());

  DispatchConfig dc;
  dc.algorithm = "rbd";
  dc.num_experts = kE;
  dc.ep_rank = q;
  dc.ep_size = W;
  dc.group = g;
  dc.ranks_per_node = rpn;
  auto disp = make_dispatcher(dc);
  if (W / rpn == 1) {  // one node: nothing to bypass
    EXPECT_EQ(disp->name(), "all_to_all");
    return;
  }
  ASSERT_EQ(disp->name(), "rbd");
  ASSERT_TRUE(disp->reduces_in_combine());

  // Rows: x[t] of the token, rank-encoded (src, token, 0, 0): a token's rows are identical.
  Tensor rows = Tensor::empty({N, kCols});
  std::vector<float> w(N);
  for (int64_t i = 0; i < N; ++i) {
    float* x = rows.data<float>() + i * kCols;
    x[0] = float(q), x[1] = float(mine.token[i]), x[2] = 0, x[3] = 0;
    w[i] = weight_of(q, mine.token[i], mine.slot[i]);
  }
  RowInfo info{Tensor::from_vector(mine.token, {N}), Tensor::from_vector(w, {N}), T[q]};
  g->counters().reset();
  DispatchResult res = disp->dispatch(rows, mine.tpe, info);
  const DispatchHandle& h = res.handle;

  // What each local expert receives: all_to_all's order (local expert, source rank, token).
  std::vector<std::array<int64_t, 3>> expect;  // (src, token, expert) per expert-order row
  for (int64_t i = 0; i < El; ++i) {
    const int64_t e = q * El + i;
    for (int p = 0; p < W; ++p) {
      int64_t row = 0;
      for (int64_t f = 0; f < e; ++f) row += layout[p].tpe[f];
      for (int64_t c = 0; c < layout[p].tpe[e]; ++c, ++row)
        expect.push_back({p, layout[p].token[row], e});
    }
    int64_t n = 0;
    for (int p = 0; p < W; ++p) n += layout[p].tpe[e];
    EXPECT_EQ(h.recv_tokens_per_expert[i], n);
  }
  ASSERT_EQ(res.rows.size(0), static_cast<int64_t>(expect.size()));
  for (size_t j = 0; j < expect.size(); ++j) {
    const float* x = res.rows.data<float>() + j * kCols;
    ASSERT_EQ(x[0], float(expect[j][0])) << "rank " << q << " row " << j;
    ASSERT_EQ(x[1], float(expect[j][1])) << "rank " << q << " row " << j;
  }

  // Groups: one per (token, node of its experts).
  std::vector<std::set<int>> nodes(static_cast<size_t>(T[q]));
  for (int64_t i = 0; i < T[q] * k; ++i) nodes[i / k].insert(node_of_expert(idx[q][i]));
  int64_t groups = 0, remote_groups = 0, remote_rows = 0;
  const int my_node = topo.node_of(q);
  for (const auto& s : nodes) {
    groups += static_cast<int64_t>(s.size());
    remote_groups += static_cast<int64_t>(s.size()) - static_cast<int64_t>(s.count(my_node));
  }
  for (int32_t e : idx[q]) remote_rows += node_of_expert(e) != my_node;
  ASSERT_EQ(h.group_tokens.numel(), groups);
  // Stage-1 bytes leaving this node = pilots to remote nodes x d x 4 + 12 per remote row (the
  // int32 metadata). The world group has the detected topology (one node here), so its counters put
  // every byte in one class: check that at least that much moved (exact per class: bench_rbd).
  const int64_t stage1_remote = remote_groups * kCols * 4 + remote_rows * 12;
  const int64_t moved =
      g->counters().of(comm::ByteCounters::all_to_all, comm::LinkClass::intra_node) +
      g->counters().of(comm::ByteCounters::all_to_all, comm::LinkClass::inter_node);
  EXPECT_GE(moved, stage1_remote);

  // Combine: the "expert" writes (src, token, expert, owner); partial sums per (token, node).
  Tensor out = res.rows.clone();
  for (size_t j = 0; j < expect.size(); ++j) {
    out.data<float>()[j * kCols + 2] = float(expect[j][2]);
    out.data<float>()[j * kCols + 3] = float(q);
  }
  Tensor partial = disp->combine(out, h);
  ASSERT_EQ(partial.size(0), groups);
  Tensor y = Tensor::zeros({T[q], kCols});
  xmoe::ops::scatter_add_rows(y, partial, h.group_tokens);
  // Expected y[t] = sum_j w[t, j] (q, t, e_j, owner(e_j)); every term exact in f32.
  for (int64_t t = 0; t < T[q]; ++t) {
    float ey[4] = {0, 0, 0, 0};
    for (int64_t j = 0; j < k; ++j) {
      const float wj = weight_of(q, t, j);
      const int32_t e = idx[q][t * k + j];
      ey[0] += wj * q, ey[1] += wj * t, ey[2] += wj * e, ey[3] += wj * float(e / El);
    }
    for (int c = 0; c < 4; ++c) ASSERT_EQ(y.data<float>()[t * kCols + c], ey[c]) << "token " << t;
  }
  // Each group's tokens: every (token, node) pair once.
  {
    std::vector<int64_t> per_token(static_cast<size_t>(T[q]), 0);
    for (int32_t t : h.group_tokens.to_vector<int32_t>()) ++per_token[t];
    for (int64_t t = 0; t < T[q]; ++t) EXPECT_EQ(per_token[t], int64_t(nodes[t].size()));
  }

  // combine_backward with dy[t] = (q, t, 1, 0.5): d_expert_out = w dy[t], d_w = out . dy[t].
  Tensor dy = Tensor::empty({T[q], kCols});
  for (int64_t t = 0; t < T[q]; ++t) {
    float* v = dy.data<float>() + t * kCols;
    v[0] = float(q), v[1] = float(t), v[2] = 1.f, v[3] = 0.5f;
  }
  Tensor d_out = disp->combine_backward(xmoe::ops::gather_rows(dy, h.group_tokens), h);
  ASSERT_EQ(d_out.size(0), static_cast<int64_t>(expect.size()));
  for (size_t j = 0; j < expect.size(); ++j) {
    const int p = static_cast<int>(expect[j][0]);
    const int64_t t = expect[j][1], e = expect[j][2];
    int64_t slot = 0;
    while (idx[p][t * k + slot] != e) ++slot;
    const float wj = weight_of(p, t, slot);
    const float* v = d_out.data<float>() + j * kCols;
    ASSERT_EQ(v[0], wj * p);
    ASSERT_EQ(v[1], wj * t);
    ASSERT_EQ(v[2], wj);
    ASSERT_EQ(v[3], wj * 0.5f);
  }
  const std::vector<float> dw = disp->combine_weights_grad(h).to_vector<float>();
  ASSERT_EQ(static_cast<int64_t>(dw.size()), N);
  int64_t row = 0;
  for (int64_t e = 0; e < kE; ++e)
    for (int64_t c = 0; c < mine.tpe[e]; ++c, ++row) {
      const float t = float(mine.token[row]);
      EXPECT_EQ(dw[row], float(q) * float(q) + t * t + float(e) + 0.5f * float(e / El))
          << "row " << row;
    }

  // dispatch_backward: d_in = (src, token, expert, 1) -> summed per group onto pilot rows.
  Tensor d_in = out.clone();
  for (size_t j = 0; j < expect.size(); ++j) d_in.data<float>()[j * kCols + 3] = 1.f;
  Tensor d_rows = disp->dispatch_backward(d_in, h);
  ASSERT_EQ(d_rows.size(0), N);
  Tensor dx = Tensor::zeros({T[q], kCols});
  xmoe::ops::scatter_add_rows(dx, d_rows, info.token_ids);
  int64_t nonzero = 0;
  for (int64_t i = 0; i < N; ++i) nonzero += d_rows.data<float>()[i * kCols + 3] != 0.f;
  EXPECT_EQ(nonzero, groups);  // one row per group carries the group's sum
  for (int64_t t = 0; t < T[q]; ++t) {
    float esum = 0;
    for (int64_t j = 0; j < k; ++j) esum += float(idx[q][t * k + j]);
    const float* v = dx.data<float>() + t * kCols;
    ASSERT_EQ(v[0], float(k * q));
    ASSERT_EQ(v[1], float(k * t));
    ASSERT_EQ(v[2], esum);
    ASSERT_EQ(v[3], float(k));
  }
}

}  // namespace

TEST(MoeDispatchRbd, UniformRouting) {
  for (int rpn : rpns())
    for (int64_t k : {1, 2, 5}) check_rbd(Routing::uniform, rpn, k);
}

TEST(MoeDispatchRbd, SkewedRoutingEverythingToRankZero) {
  for (int rpn : rpns()) check_rbd(Routing::skewed, rpn, 3);
}

TEST(MoeDispatchRbd, EveryTokensExpertsOnOneNode) {
  for (int rpn : rpns()) check_rbd(Routing::one_node, rpn, 3);
}

TEST(MoeDispatchRbd, RanksThatSendOrReceiveNothing) {
  for (int rpn : rpns()) check_rbd(Routing::sparse, rpn, 2);
}

TEST(MoeDispatchRbd, StageOneRowBytesMatchTheAnalyticCount) {
  // The group's counters classify links by its own topology: a world group of W ranks split into
  // simulated nodes by color gives no new topology, so here the count is checked per peer: the
  // inter-node row payload of rbd = sum_t |remote nodes of t| x d x 4, against all_to_all's
  // sum_t |remote experts of t| x d x 4. (bench_rbd checks the same with comm::world(rpn).)
  auto g = world();
  const int W = g->size(), q = g->rank();
  for (int rpn : rpns()) {
    if (W / rpn < 2) continue;
    int64_t T = 0;
    const int64_t k = 4;
    const auto idx = routing_of(Routing::uniform, q, W, rpn, k, T);
    const Pft p = pft(idx, T, k);
    const int64_t N = static_cast<int64_t>(p.token.size());
    DispatchConfig dc;
    dc.algorithm = "rbd";
    dc.num_experts = kE;
    dc.ep_rank = q;
    dc.ep_size = W;
    dc.group = g;
    dc.ranks_per_node = rpn;
    auto disp = make_dispatcher(dc);
    std::vector<float> w(N, 1.f);
    DispatchResult r =
        disp->dispatch(Tensor::zeros({N, 8}), p.tpe,
                       RowInfo{Tensor::from_vector(p.token, {N}), Tensor::from_vector(w, {N}), T});
    const RbdSourcePlan& plan = r.handle.rbd->plan.source;
    const comm::Topology topo = comm::Topology::uniform(W, rpn);
    const int64_t El = kE / W;
    int64_t pilots_remote = 0, expected = 0;
    for (int dst = 0; dst < W; ++dst)
      if (topo.node_of(dst) != topo.node_of(q)) pilots_remote += plan.group_send[dst];
    for (int64_t t = 0; t < T; ++t) {
      std::set<int> remote;
      for (int64_t j = 0; j < k; ++j) {
        const int n = topo.node_of(static_cast<int>(idx[t * k + j] / El));
        if (n != topo.node_of(q)) remote.insert(n);
      }
      expected += static_cast<int64_t>(remote.size());
    }
    EXPECT_EQ(pilots_remote * 8 * 4, expected * 8 * 4) << "rpn " << rpn;
  }
}

// ---- (b) the layer: rbd == all_to_all ----------------------------------------------------------

namespace {

constexpr int64_t kD = 16, kT = 16, kSeq = 4;

MoeConfig layer_config(const std::string& gate, const std::string& dispatch) {
  return xmoe::testing::micro_moe_layer(gate, dispatch, kE);  // softmax_topk and xmoe gates
}

/// Replaces the routing: skewed = experts {0, 1, 2} (ep rank 0) for every token; one_node =
/// all three experts of token t on node (t % nodes).
HookId force_routing(MoELayer& layer, Routing kind, int nodes) {
  return layer.hooks().on<GateOut>([kind, nodes](GateOut& g) {
    Tensor idx = g.topk_idx.clone();
    int32_t* p = idx.data<int32_t>();
    const int64_t k = idx.size(1), per_node = kE / nodes;
    for (int64_t t = 0; t < idx.size(0); ++t)
      for (int64_t j = 0; j < k; ++j)
        p[t * k + j] =
            kind == Routing::skewed
                ? static_cast<int32_t>(j)
                : static_cast<int32_t>((t % nodes) * per_node + (t * 5 + j * 7) % per_node);
    g.topk_idx = idx;
  });
}

void check_layer(const std::string& gate, int rpn, Routing kind) {
  SCOPED_TRACE("gate " + gate + ", rpn " + std::to_string(rpn) + ", routing " +
               std::to_string(int(kind)));
  auto g = world();
  const int W = g->size(), r = g->rank();
  parallel::Layout par = parallel::Layout::create(g, W);
  const LayerGroups groups{par.world, par.ep_group};
  MoELayer ref(layer_config(gate, "all_to_all"), kD, "moe", 42, 0.5f, 0.3f, groups);
  MoELayer rbd(layer_config(gate, "rbd"), kD, "moe", 42, 0.5f, 0.3f, groups);
  rbd.set_ranks_per_node(rpn);
  if (kind != Routing::uniform) {
    force_routing(ref, kind, W / rpn);
    force_routing(rbd, kind, W / rpn);
  }
  for (int step = 0; step < 2; ++step) {
    const Tensor x = randn({kT, kD}, 300 + 17 * r + step);
    const Tensor dy = randn({kT, kD}, 400 + 17 * r + step, 0.1f);
    ref.zero_grad();
    rbd.zero_grad();
    Tensor y_ref = ref.forward(x, kSeq), y_rbd = rbd.forward(x, kSeq);
    Tensor dx_ref = ref.backward(dy), dx_rbd = rbd.backward(dy);
    // Tolerances: the expert inputs and outputs are bitwise those of all_to_all (same rows, same
    // order); y and dx differ only by the order of the k-term sums (per node first, then over
    // nodes); the router gradient gets d(combine weights) that are bitwise the same, the
    // expert gradients see bitwise-identical inputs. 1e-6 relative holds with margin.
    EXPECT_LE(rel_err(y_rbd, y_ref), 1e-6);
    EXPECT_LE(rel_err(dx_rbd, dx_ref), 1e-6);
    EXPECT_EQ(rbd.local_expert_rows(), ref.local_expert_rows());
    auto pr = ref.parameters(), pb = rbd.parameters();
    ASSERT_EQ(pr.size(), pb.size());
    for (size_t i = 0; i < pr.size(); ++i)
      EXPECT_LE(rel_err(pb[i]->grad, pr[i]->grad), 1e-6) << pr[i]->name;
  }
}

}  // namespace

TEST(MoeLayerRbd, EqualsAllToAll) {
  for (int rpn : rpns())
    if (world()->size() / rpn >= 2) check_layer("softmax_topk", rpn, Routing::uniform);
}

TEST(MoeLayerRbd, XmoeGateEqualsAllToAll) {
  check_layer("xmoe", 1, Routing::uniform);
}

TEST(MoeLayerRbd, SkewedRoutingLeavesRanksWithoutRows) {
  for (int rpn : rpns())
    if (world()->size() / rpn >= 2) check_layer("softmax_topk", rpn, Routing::skewed);
}

TEST(MoeLayerRbd, AllExpertsOfATokenOnOneNode) {
  for (int rpn : rpns())
    if (world()->size() / rpn >= 2) check_layer("softmax_topk", rpn, Routing::one_node);
}

TEST(MoeLayerRbd, OneNodeIsAllToAll) {
  auto g = world();
  parallel::Layout par = parallel::Layout::create(g, g->size());
  const LayerGroups groups{par.world, par.ep_group};
  MoELayer ref(layer_config("softmax_topk", "all_to_all"), kD, "moe", 42, 0.5f, 0.3f, groups);
  MoELayer rbd(layer_config("softmax_topk", "rbd"), kD, "moe", 42, 0.5f, 0.3f, groups);
  rbd.set_ranks_per_node(g->size());
  const Tensor x = randn({kT, kD}, 500 + g->rank());
  EXPECT_EQ(rbd.forward(x, kSeq).to_vector<float>(), ref.forward(x, kSeq).to_vector<float>());
  rbd.release();
  ref.release();
}

TEST(MoeLayerRbd, PermuteExpertsUnderExpertParallelism) {
  // Experts move between ranks (all_gather over the ep group, permute, keep the slice): the
  // permuted layer computes the same y and dx, and its expert gradients are the permuted ones.
  auto g = world();
  const int W = g->size();
  parallel::Layout par = parallel::Layout::create(g, W);
  const LayerGroups groups{par.world, par.ep_group};
  MoELayer a(layer_config("softmax_topk", "rbd"), kD, "moe", 42, 0.5f, 0.3f, groups);
  MoELayer b(layer_config("softmax_topk", "rbd"), kD, "moe", 42, 0.5f, 0.3f, groups);
  a.set_ranks_per_node(std::max(1, W / 2));
  b.set_ranks_per_node(std::max(1, W / 2));
  std::vector<int> perm(kE);
  for (int64_t s = 0; s < kE; ++s) perm[s] = static_cast<int>((s * 7 + 3) % kE);  // 7 ⟂ 24
  const Tensor x = randn({kT, kD}, 600 + g->rank()), dy = randn({kT, kD}, 700 + g->rank(), 0.1f);
  a.zero_grad();
  a.forward(x, kSeq);
  a.backward(dy);  // b gets a's gradients by permutation, then both recompute
  b.zero_grad();
  b.forward(x, kSeq);
  b.backward(dy);
  // Riders (here: copies of the gradients) move across ranks exactly as the gradients do.
  std::vector<ExpertRider> riders;
  for (Parameter* p : b.parameters()) riders.push_back({p, p->grad.clone()});
  b.permute_experts(perm, riders);
  auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pb.size(); ++i)
    EXPECT_EQ(riders[i].tensor.to_vector<float>(), pb[i]->grad.to_vector<float>()) << pb[i]->name;
  a.zero_grad();
  b.zero_grad();
  Tensor ya = a.forward(x, kSeq), yb = b.forward(x, kSeq);
  EXPECT_LE(rel_err(yb, ya), 1e-6);
  EXPECT_LE(rel_err(b.backward(dy), a.backward(dy)), 1e-6);
  for (size_t i = 0; i < pa.size(); ++i) {
    if (pa[i]->kind != ParamKind::expert) continue;
    // Full expert tensors: rows perm[s] of a's gradient are rows s of b's.
    Tensor fa = g->all_gather(pa[i]->grad), fb = g->all_gather(pb[i]->grad);
    const int64_t inner = fa.numel() / kE;
    const auto va = fa.to_vector<float>(), vb = fb.to_vector<float>();
    double diff = 0, scale = 0;
    for (int64_t s = 0; s < kE; ++s)
      for (int64_t j = 0; j < inner; ++j) {
        diff = std::max(diff, double(std::abs(vb[s * inner + j] - va[perm[s] * inner + j])));
        scale = std::max(scale, double(std::abs(va[perm[s] * inner + j])));
      }
    EXPECT_LE(diff, 1e-5 * scale) << pa[i]->name;
  }
}
