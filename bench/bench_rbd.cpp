// Redundancy-bypassing dispatch (moe.dispatch = rbd) vs the padding-free all-to-all-v
// (all_to_all) under mpirun, with simulated nodes (comm::world(ranks_per_node), so the group's
// byte counters classify every message as intra- or inter-node). One JSON line per
// (k, routing) on rank 0:
//   inter/intra-node all_to_all_v bytes of one dispatch + combine (sum over ranks, from the
//   counters), for all_to_all and rbd, next to the analytic inter-node bytes:
//     all_to_all rows: 2 x sum_t (experts of t on remote nodes) x d x 4
//     rbd rows:        2 x sum_t (distinct remote nodes of t)   x d x 4  (pilots, then partials)
//     rbd metadata:    12 bytes per routed row to a remote node (stage 1 only: int32 expert
//                      key, source row, weight bits)
//   (the counts exchanges are a separate counter kind and not included); and the time of
//   dispatch + combine (median over iterations of the slowest rank).
// Routing per token: k distinct experts, uniform, or skewed: Gumbel top-k of b_e + n_te with
// b_e ~ N(0, 1) shared by all ranks (a few experts popular).
//
//   for rpn in 4 2 1; do mpirun -np 8 bench_rbd --rpn $rpn [--tokens 2048] [--d 512]
//                        [--experts 64] [--k 2,4,6,8,16] [--iters 3]; done
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "xmoe/comm/group.h"
#include "xmoe/core/rng.h"
#include "xmoe/core/timer.h"
#include "xmoe/moe/dispatch.h"
#include "xmoe/ops/moe.h"

using namespace xmoe;

namespace {

struct Args {
  int rpn = 0;
  int64_t tokens = 2048, d = 512, experts = 64;
  std::vector<int64_t> ks = {2, 4, 6, 8, 16};
  int iters = 3;
};

/// topk [T * k] of this rank: k distinct experts per token.
std::vector<int32_t> route(int64_t T, int64_t E, int64_t k, bool skewed, int rank) {
  std::vector<float> bias(E, 0.f);
  Rng shared(4321, 0);
  if (skewed)
    for (auto& b : bias) b = shared.normal();
  Rng rng(555, static_cast<uint64_t>(rank) + 1);
  std::vector<int32_t> idx;
  std::vector<float> z(E);
  std::vector<int32_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      const float u = std::clamp(rng.uniform(), 1e-7f, 1.f - 1e-7f);
      z[e] = bias[e] + (skewed ? rng.normal() : 0.f) - std::log(-std::log(u));
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int32_t a, int32_t b) { return z[a] > z[b]; });
    idx.insert(idx.end(), order.begin(), order.begin() + k);
  }
  return idx;
}

int64_t all_sum(comm::Group& g, int64_t v) {
  Tensor t = Tensor::from_vector<int64_t>({v}, {1});
  g.all_reduce(t);
  return t.data<int64_t>()[0];
}

double all_max(comm::Group& g, double v) {
  Tensor t = Tensor::from_vector<float>({static_cast<float>(v)}, {1});
  g.all_reduce(t, comm::ReduceOp::max);
  return t.data<float>()[0];
}

struct Measured {
  double median_ms = 0;
  int64_t inter = 0, intra = 0;  // all_to_all_v bytes summed over ranks (last iteration)
};

template <class Body>
Measured measure(comm::Group& g, int iters, Body&& body) {
  std::vector<double> ms;
  int64_t inter = 0, intra = 0;
  for (int i = 0; i < iters + 1; ++i) {
    g.barrier();
    g.counters().reset();
    Timer t;
    body();
    const double mine = t.millis();
    inter = g.counters().of(comm::ByteCounters::all_to_all, comm::LinkClass::inter_node);
    intra = g.counters().of(comm::ByteCounters::all_to_all, comm::LinkClass::intra_node);
    const double slowest = all_max(g, mine);
    if (i > 0) ms.push_back(slowest);
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], all_sum(g, inter), all_sum(g, intra)};
}

void run(comm::Group& g, const Args& a, int64_t k, bool skewed) {
  const int P = g.size(), rank = g.rank();
  const comm::Topology& topo = g.topology();
  const int64_t T = a.tokens, d = a.d, E = a.experts, El = E / P;
  const std::vector<int32_t> idx = route(T, E, k, skewed, rank);
  std::vector<float> w(static_cast<size_t>(T * k), 1.f / static_cast<float>(k));
  const ops::MoeLayout layout =
      ops::moe_layout(Tensor::from_vector(idx, {T, k}), Tensor::from_vector(w, {T, k}), E, 0);
  const std::vector<int64_t>& tpe = layout.load;  // PFT: every routed pair is processed
  const int64_t N = T * k;
  Tensor rows = Tensor::empty({N, d});
  fill_normal(rows, 7, static_cast<uint64_t>(rank), 1.0f);
  moe::RowInfo info{layout.token_ids, layout.combine_weights, T};

  // Analytic inter-node bytes of this rank (summed over ranks below).
  const int me = topo.node_of(rank);
  int64_t remote_rows = 0, remote_pilots = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::set<int> nodes;
    for (int64_t j = 0; j < k; ++j) {
      const int n = topo.node_of(static_cast<int>(idx[t * k + j] / El));
      if (n != me) ++remote_rows, nodes.insert(n);
    }
    remote_pilots += static_cast<int64_t>(nodes.size());
  }
  remote_rows = all_sum(g, remote_rows);
  remote_pilots = all_sum(g, remote_pilots);
  const int64_t a2a_expect = 2 * remote_rows * d * 4;
  const int64_t rbd_rows_expect = 2 * remote_pilots * d * 4, rbd_meta_expect = remote_rows * 12;

  moe::DispatchConfig dc;
  dc.num_experts = E;
  dc.ep_rank = rank;
  dc.ep_size = P;
  dc.group = g.split(0, rank);  // same ranks and topology, its own counters
  dc.algorithm = "all_to_all";
  auto a2a = moe::make_dispatcher(dc);
  dc.algorithm = "rbd";
  auto rbd = moe::make_dispatcher(dc);
  comm::Group& eg = *dc.group;

  const Measured ma = measure(eg, a.iters, [&] {
    moe::DispatchResult r = a2a->dispatch(rows, tpe);
    a2a->combine(r.rows, r.handle);
  });
  const Measured mr = measure(eg, a.iters, [&] {
    moe::DispatchResult r = rbd->dispatch(rows, tpe, info);
    rbd->combine(r.rows, r.handle);
  });

  if (rank == 0) {
    nlohmann::json j;
    j["bench"] = "rbd";
    j["ranks"] = P;
    j["nodes"] = topo.num_nodes();
    j["ranks_per_node"] = P / topo.num_nodes();
    j["dispatcher"] = rbd->name();
    j["experts"] = E;
    j["k"] = k;
    j["tokens_per_rank"] = T;
    j["d"] = d;
    j["routing"] = skewed ? "skewed" : "uniform";
    j["a2a_inter_bytes"] = ma.inter;
    j["a2a_inter_expected"] = a2a_expect;
    j["a2a_intra_bytes"] = ma.intra;
    j["rbd_inter_bytes"] = mr.inter;
    j["rbd_inter_rows_expected"] = rbd_rows_expect;
    j["rbd_inter_meta_expected"] = rbd_meta_expect;
    j["rbd_intra_bytes"] = mr.intra;
    j["match"] = ma.inter == a2a_expect && (rbd->name() != std::string("rbd") ||
                                            mr.inter == rbd_rows_expect + rbd_meta_expect);
    j["inter_reduction_pct"] =
        ma.inter > 0 ? std::round(1000.0 * (1.0 - double(mr.inter) / double(ma.inter))) / 10 : 0.0;
    j["a2a_ms"] = std::round(ma.median_ms * 100) / 100;
    j["rbd_ms"] = std::round(mr.median_ms * 100) / 100;
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{
      "Redundancy-bypassing dispatch vs all-to-all-v over simulated nodes (run under mpirun)"};
  app.add_option("--rpn", a.rpn, "ranks per simulated node")->required();
  app.add_option("--tokens", a.tokens, "tokens per rank");
  app.add_option("--d", a.d, "row width");
  app.add_option("--experts", a.experts, "experts E");
  app.add_option("--k", a.ks, "top-k values")->delimiter(',');
  app.add_option("--iters", a.iters, "timed iterations after one warm-up");
  CLI11_PARSE(app, argc, argv);
  auto g = comm::world(a.rpn);
  try {
    for (int64_t k : a.ks)
      for (bool skewed : {false, true}) run(*g, a, k, skewed);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[bench_rbd] rank %d: %s\n", g->rank(), e.what());
    g->abort(1);
  }
  g.reset();
  comm::finalize();
  return 0;
}
