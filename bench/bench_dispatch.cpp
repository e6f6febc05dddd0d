// Expert-parallel token exchange under mpirun: the padding-free all-to-all-v dispatcher (X-MoE
// PFT, moe.dispatch = all_to_all) vs a padded all-to-all (DeepSpeed-MoE/Tutel: every rank sends
// a fixed [E_local, C, d] block to every rank, C = ceil(cf * T * k / E), overflow dropped).
// One JSON line per (E, k, mode, cf) on rank 0: bytes sent per rank (the group's byte counters,
// mean and max over ranks), dispatch+combine time (median over iterations of the slowest rank),
// dropped (token, slot) pairs, and the ratios against pft.
//
// Timed work, from expert-sorted rows [T*k, d] on each rank to expert-contiguous rows on the
// experts' ranks and back:
//   pft:    Dispatcher::dispatch + combine (counts exchange, all_to_all_v of the routed rows,
//           the (source, expert) -> (expert, source) permutation and its inverse);
//   padded: pack into [E, C, d] (zero padding, drops), all_to_all_v with equal counts, permute
//           [src, E_local, C] -> [E_local, src, C], and the reverse, unpack the kept rows.
// Routing: per token, k distinct experts sampled from softmax(b_e + n_te) (Gumbel top-k), with
// b_e ~ N(0, skew^2) shared by all ranks (some experts popular) and n_te ~ N(0, 1) per token.
//
//   mpirun -np 4 bench_dispatch [--tokens 4096] [--d 1024] [--iters 5] [--skew 0.25]
//                               [--cf 1.0,1.25] [--quick]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "xmoe/comm/group.h"
#include "xmoe/core/rng.h"
#include "xmoe/core/timer.h"
#include "xmoe/moe/dispatch.h"
#include "xmoe/moe/padded.h"
#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"

using namespace xmoe;

namespace {

struct Args {
  int64_t tokens = 4096, d = 1024;
  int iters = 5;
  float skew = 0.25f;  ///< max/mean expert load ~1.8 (E=64, k=6) / ~2.2 (E=256, k=8)
  std::vector<float> cfs = {1.0f, 1.25f};
};

/// Routed (token, slot) pairs per expert for this rank: [E] counts of T tokens' top-k.
std::vector<int64_t> route(int64_t T, int64_t E, int64_t k, float skew, int rank) {
  std::vector<float> bias(E);
  Rng shared(1234, 0);
  for (auto& b : bias) b = skew * shared.normal();
  Rng rng(777, static_cast<uint64_t>(rank) + 1);
  std::vector<int64_t> counts(E, 0);
  std::vector<float> z(E);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      // Gumbel top-k of the logits = k draws without replacement from their softmax.
      const float u = std::clamp(rng.uniform(), 1e-7f, 1.f - 1e-7f);
      z[e] = bias[e] + rng.normal() - std::log(-std::log(u));
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return z[a] > z[b]; });
    for (int64_t j = 0; j < k; ++j) ++counts[order[j]];
  }
  return counts;
}

double all_max(comm::Group& g, double v) {
  Tensor t = Tensor::from_vector<float>({static_cast<float>(v)}, {1});
  g.all_reduce(t, comm::ReduceOp::max);
  return t.data<float>()[0];
}

int64_t all_sum(comm::Group& g, int64_t v) {
  Tensor t = Tensor::from_vector<int64_t>({v}, {1});
  g.all_reduce(t);
  return t.data<int64_t>()[0];
}

int64_t all_max_i(comm::Group& g, int64_t v) {
  Tensor t = Tensor::from_vector<int64_t>({v}, {1});
  g.all_reduce(t, comm::ReduceOp::max);
  return t.data<int64_t>()[0];
}

int64_t a2a_bytes(const comm::Group& g) {
  return g.counters().of(comm::ByteCounters::all_to_all, comm::LinkClass::intra_node) +
         g.counters().of(comm::ByteCounters::all_to_all, comm::LinkClass::inter_node);
}

struct Measured {
  double median_ms = 0;
  int64_t bytes_mean = 0, bytes_max = 0, dropped = 0;
};

/// Runs `body` (one dispatch + combine) warmup + iters times; bytes from the last iteration.
template <class Body>
Measured measure(comm::Group& g, int iters, Body&& body) {
  std::vector<double> ms;
  int64_t bytes = 0;
  for (int i = 0; i < iters + 1; ++i) {
    g.barrier();
    g.counters().reset();
    Timer t;
    body();
    const double mine = t.millis();
    bytes = a2a_bytes(g);
    const double slowest = all_max(g, mine);
    if (i > 0) ms.push_back(slowest);
  }
  std::sort(ms.begin(), ms.end());
  Measured m;
  m.median_ms = ms[ms.size() / 2];
  m.bytes_mean = all_sum(g, bytes) / g.size();
  m.bytes_max = all_max_i(g, bytes);
  return m;
}

void run(comm::Group& g, const Args& a, int64_t E, int64_t k) {
  const int P = g.size(), rank = g.rank();
  const int64_t T = a.tokens, d = a.d, El = E / P;
  const std::vector<int64_t> counts = route(T, E, k, a.skew, rank);
  const int64_t N = T * k;
  Tensor rows = Tensor::empty({N, d});  // expert-sorted rows (what the order stage produces)
  fill_normal(rows, 5, static_cast<uint64_t>(rank), 1.0f);

  // Global load imbalance (max expert load / mean) of this routing.
  Tensor load = Tensor::from_vector(counts, {E});
  g.all_reduce(load);
  const auto gl = load.to_vector<int64_t>();
  const double imbalance = static_cast<double>(*std::max_element(gl.begin(), gl.end())) /
                           (static_cast<double>(N) * P / static_cast<double>(E));

  // ---- pft: the real dispatcher ----
  moe::DispatchConfig dc;
  dc.algorithm = "all_to_all";
  dc.num_experts = E;
  dc.ep_rank = rank;
  dc.ep_size = P;
  dc.group = comm::world();
  auto disp = moe::make_dispatcher(dc);
  Measured pft = measure(g, a.iters, [&] {
    moe::DispatchResult r = disp->dispatch(rows, counts);
    Tensor back = disp->combine(r.rows, r.handle);  // identity experts
  });
  // The count exchange: El int64 per peer (ByteCounters::counts), reported beside the rows.
  const int64_t meta_bytes = (P - 1) * El * 8;

  auto emit = [&](const char* mode, float cf, const Measured& m, int64_t capacity) {
    if (rank != 0) return;
    nlohmann::json j;
    j["bench"] = "dispatch";
    j["ranks"] = P;
    j["E"] = E;
    j["k"] = k;
    j["T_per_rank"] = T;
    j["d"] = d;
    j["mode"] = mode;
    if (cf > 0) j["cf"] = cf;
    if (capacity > 0) j["C"] = capacity;
    j["bytes_sent_per_rank"] = m.bytes_mean;
    j["bytes_sent_max_rank"] = m.bytes_max;
    if (cf == 0) j["count_bytes_per_rank"] = meta_bytes;
    j["dropped_pairs"] = m.dropped;
    j["dropped_frac"] = static_cast<double>(m.dropped) / static_cast<double>(N * P);
    j["median_ms"] = std::round(m.median_ms * 100) / 100;
    j["bytes_vs_pft"] =
        std::round(1000.0 * m.bytes_mean / std::max<int64_t>(pft.bytes_mean, 1)) / 1000;
    j["time_vs_pft"] = std::round(1000.0 * m.median_ms / pft.median_ms) / 1000;
    j["load_imbalance"] = std::round(1000 * imbalance) / 1000;
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  };
  emit("pft", 0, pft, 0);

  // ---- padded: [E, C, d] blocks, equal counts ----
  for (float cf : a.cfs) {
    const int64_t C = moe::padded_capacity(cf, T, k, E);
    // pack[e * C + c] = source row (or -1: a zero padding row); drops beyond C.
    std::vector<int32_t> pack(static_cast<size_t>(E * C), -1), unpack(N, -1);
    int64_t dropped = 0, start = 0;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t j = 0; j < counts[e]; ++j) {
        if (j < C) {
          pack[e * C + j] = static_cast<int32_t>(start + j);
          unpack[start + j] = static_cast<int32_t>(e * C + j);
        } else {
          ++dropped;
        }
      }
      start += counts[e];
    }
    Tensor pack_t = Tensor::from_vector(pack, {E * C});
    Tensor unpack_t = Tensor::from_vector(unpack, {N});
    // Arrival [src, El, C] -> expert-major [El, src, C] and back.
    std::vector<int32_t> perm(static_cast<size_t>(P * El * C)), inv(perm.size());
    for (int64_t i = 0; i < El; ++i)
      for (int p = 0; p < P; ++p)
        for (int64_t c = 0; c < C; ++c) {
          const int64_t expert_row = (i * P + p) * C + c, arrival_row = (p * El + i) * C + c;
          perm[expert_row] = static_cast<int32_t>(arrival_row);
          inv[arrival_row] = static_cast<int32_t>(expert_row);
        }
    Tensor perm_t = Tensor::from_vector(perm, {P * El * C});
    Tensor inv_t = Tensor::from_vector(inv, {P * El * C});
    const std::vector<int64_t> block(P, El * C);
    Measured pad = measure(g, a.iters, [&] {
      Tensor buf = xmoe::ops::gather_rows_masked(rows, pack_t);        // [E*C, d]
      Tensor arrival = g.all_to_all_v(buf, block, block);              // [P*El*C, d]
      Tensor expert_in = xmoe::ops::gather_rows(arrival, perm_t);      // expert-major
      Tensor back_arrival = xmoe::ops::gather_rows(expert_in, inv_t);  // identity experts
      Tensor back = g.all_to_all_v(back_arrival, block, block);        // [E*C, d]
      Tensor out = xmoe::ops::gather_rows_masked(back, unpack_t);      // [N, d], dropped = 0
    });
    pad.dropped = all_sum(g, dropped);
    emit("padded", cf, pad, C);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  std::vector<std::pair<int64_t, int64_t>> shapes = {{64, 6}, {256, 8}};
  bool quick = false;
  CLI::App app{
      "Dispatch + combine: padding-free all-to-all-v vs padded all-to-all (run under mpirun)"};
  app.add_option("--tokens", a.tokens, "tokens per rank");
  app.add_option("--d", a.d, "row width");
  app.add_option("--iters", a.iters, "timed iterations after one warm-up");
  app.add_option("--skew", a.skew, "std of the shared per-expert logit bias");
  app.add_option("--cf", a.cfs, "padded capacity factors")->delimiter(',');
  app.add_flag("--quick", quick, "small shapes (T=512, d=128, 2 iterations)");
  CLI11_PARSE(app, argc, argv);
  if (quick) {
    a.tokens = 512;
    a.d = 128;
    a.iters = 2;
  }
  auto g = comm::world();
  try {
    for (auto [E, k] : shapes) {
      if (E % g->size() != 0) {
        if (g->rank() == 0)
          std::fprintf(stderr, "skipping E = %lld: not divisible by %d ranks\n",
                       static_cast<long long>(E), g->size());
        continue;
      }
      run(*g, a, E, k);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[bench_dispatch] rank %d: %s\n", g->rank(), e.what());
    g->abort(1);
  }
  g.reset();
  comm::finalize();
  return 0;
}
