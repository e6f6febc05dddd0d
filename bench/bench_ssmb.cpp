// One MoE block (model/moe_ffn.h: router, routed experts over the ep group, shared experts)
// under tensor parallelism, with sequence-sharded MoE blocks (SSMB: each tp rank routes its 1/tp
// of the micro-batch's tokens) and without (the tp group gathers the micro-batch and runs the
// layer on all of it, replicated), on CPU ranks under mpirun. Per (tp, ssmb), ep = world / tp
// (the largest ep both modes can use). One JSON line each, maxima over the ranks:
//   held_bytes      activations held between forward and backward (allocator live bytes)
//   peak_bytes      allocator peak of forward + backward above the bytes live before
//   dispatch_bytes  all-to-all bytes this rank sent over the ep group (dispatch + combine,
//                   forward and backward; comm byte counters)
//   gather_bytes    tp all-gather bytes (no SSMB: the block's input and its gradient)
//   ms              forward + backward, median of --iters (oversubscribed ranks: indicative)
// SSMB against recompute at equal memory (X-MoE, issue 27): for each tp > 1 the block also runs
// without SSMB under each --recompute mix (model.recompute entries joined by '+'; one block takes
// moe and router), and an "ssmb_vs_recompute" line gives both peaks (peak_bytes: the largest
// rank's forward + backward peak) and the time ratio recompute / SSMB.
// --layers L > 0 runs whole models instead of one block ("bench": "ssmb_model"): L MoE blocks
// (attention with d / 64 heads split over tp, the block above, embedding and LM head over a
// vocabulary of 512), forward_loss + backward of the tp group's micro-batch: held_bytes are the
// activations of every layer at the end of forward, peak_bytes the step's peak. One block's
// peak is its held bytes plus its own backward, which recomputing raises; a model's is the sum
// of L layers' held bytes plus one backward, which is where recompute and SSMB both pay.
//
//   mpirun -np N bench_ssmb [--d 512] [--experts 32] [--hidden 128] [--top-k 6] [--shared 2]
//                           [--batch 4] [--seq 256] [--iters 3] [--recompute moe,moe+router]
//                           [--layers 0]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "xmoe/comm/group.h"
#include "xmoe/core/allocator.h"
#include "xmoe/core/rng.h"
#include "xmoe/core/timer.h"
#include "xmoe/model/moe_ffn.h"
#include "xmoe/model/transformer.h"
#include "xmoe/moe/layer.h"
#include "xmoe/parallel/layout.h"

using namespace xmoe;

namespace {

struct Args {
  int64_t d = 512, experts = 32, hidden = 128, top_k = 6, shared = 2, batch = 4, seq = 256;
  int iters = 3;
  std::string recompute = "moe,moe+router";
  int layers = 0;
};

/// What one (tp, ssmb, recompute) run measured: maxima over the ranks.
struct Measured {
  int64_t held = 0, peak = 0;
  double ms = 0;
};

/// A --recompute mix ("moe+router") as the layer's switches; an unknown entry throws.
moe::LayerRecompute parse_mix(const std::string& mix) {
  moe::LayerRecompute rc;
  std::stringstream in(mix);
  for (std::string e; std::getline(in, e, '+');) {
    if (e == "moe")
      rc.experts = true;
    else if (e == "router")
      rc.router = true;
    else
      XMOE_FAIL("[bench_ssmb] --recompute entry '{}' is not moe or router", e);
  }
  return rc;
}

int64_t sent(const comm::Group& g, comm::ByteCounters::Kind kind) {
  return g.counters().of(kind, comm::LinkClass::intra_node) +
         g.counters().of(kind, comm::LinkClass::inter_node);
}

/// The maximum over the world of each value.
std::vector<int64_t> world_max(comm::Group& world, std::vector<int64_t> v) {
  Tensor t = Tensor::from_vector<int64_t>(v, {static_cast<int64_t>(v.size())});
  world.all_reduce(t, comm::ReduceOp::max);
  return t.to_vector<int64_t>();
}

/// Held and peak bytes and the median of `ms`, each the maximum over the world.
Measured over_world(comm::Group& world, int64_t held, int64_t peak, std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  const std::vector<int64_t> v =
      world_max(world, {held, peak, static_cast<int64_t>(ms[ms.size() / 2] * 1e3)});
  return {v[0], v[1], static_cast<double>(v[2]) / 1e3};
}

Measured run(std::shared_ptr<comm::Group> world, const Args& a, int tp, bool ssmb,
             const std::string& mix = "none") {
  const int ep = world->size() / tp;
  const parallel::Layout layout = parallel::Layout::create(world, ep, tp, ssmb);
  MoeConfig mc;
  mc.num_experts = a.experts;
  mc.expert_hidden = a.hidden;
  mc.top_k = a.top_k;
  mc.num_shared_experts = a.shared;
  mc.dispatch = ep > 1 ? "all_to_all" : "local";
  auto block = model::make_moe_ffn(mc, a.d, "layers.1.moe", 1, 0.02f, 0.005f, &layout);
  const moe::LayerRecompute rc = mix == "none" ? moe::LayerRecompute{} : parse_mix(mix);
  block->set_recompute(rc.experts);
  block->moe_layer()->set_router_recompute(rc.router);
  // This rank's slice of its tp group's micro-batch (the residual stream's rows here).
  const int64_t rows = a.batch * a.seq / tp;
  Tensor x = Tensor::empty({rows, a.d});
  fill_normal(x, 7, 1000 + static_cast<uint64_t>(layout.world_rank), 1.0f);
  Tensor dy = Tensor::empty({rows, a.d});
  fill_normal(dy, 7, 2000 + static_cast<uint64_t>(layout.world_rank), 1e-3f);

  std::vector<double> ms;
  std::vector<int64_t> measured;
  for (int it = 0; it <= a.iters; ++it) {  // iteration 0 warms up
    block->zero_grad();
    for (const auto& g : {layout.ep_group, layout.tp_group}) g->counters().reset();
    world->barrier();
    const int64_t before = memory_stats().live_bytes;
    Timer timer;
    int64_t held = 0, peak = 0;
    {
      PeakMemoryScope scope;
      Tensor y = block->forward(x, a.seq);
      held = memory_stats().live_bytes - before - static_cast<int64_t>(y.nbytes());
      y = Tensor();
      block->backward(dy);
      peak = scope.extra_peak_bytes();
    }
    const double t = timer.seconds() * 1e3;
    if (it == 0) continue;
    ms.push_back(t);
    measured = {held, peak,
                sent(*layout.ep_group, comm::ByteCounters::all_to_all) +
                    sent(*layout.ep_group, comm::ByteCounters::counts),
                sent(*layout.tp_group, comm::ByteCounters::all_gather)};
  }
  const Measured result = over_world(*world, measured[0], measured[1], ms);
  const std::vector<int64_t> m = world_max(*world, {measured[2], measured[3]});
  if (layout.world_rank != 0) return result;
  nlohmann::json j{{"bench", "ssmb"},
                   {"world", layout.world_size},
                   {"tp", tp},
                   {"ssmb", ssmb},
                   {"recompute", mix},
                   {"ep", ep},
                   {"shape", fmt::format("B={} S={} d={} E={} f={} k={} shared={}", a.batch, a.seq,
                                         a.d, a.experts, a.hidden, a.top_k, a.shared)},
                   {"tokens_routed_per_rank", ssmb ? rows : rows * tp},
                   {"held_bytes", result.held},
                   {"peak_bytes", result.peak},
                   {"dispatch_bytes", m[0]},
                   {"gather_bytes", m[1]},
                   {"ms", result.ms}};
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
  return result;
}

/// Deterministic token ids [b, s] below `vocab` for data rank `salt`.
Tensor token_ids(int64_t b, int64_t s, int64_t vocab, uint64_t salt) {
  std::vector<int32_t> v(static_cast<size_t>(b * s));
  Rng rng(salt, 5);
  for (auto& t : v) t = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  return Tensor::from_vector<int32_t>(v, {b, s});
}

std::vector<std::string> entries_of(const std::string& mix) {
  std::vector<std::string> out;
  std::stringstream in(mix);
  for (std::string e; std::getline(in, e, '+');) out.push_back(e);
  return mix == "none" ? std::vector<std::string>{} : out;
}

/// --layers L: a whole model of L MoE blocks under (tp, ssmb, recompute mix).
Measured run_model(std::shared_ptr<comm::Group> world, const Args& a, int tp, bool ssmb,
                   const std::string& mix = "none") {
  const int ep = world->size() / tp;
  const parallel::Layout layout = parallel::Layout::create(world, ep, tp, ssmb);
  ModelConfig mc;
  mc.vocab_size = 512;
  mc.d_model = static_cast<int>(a.d);
  mc.num_heads = mc.num_kv_heads = static_cast<int>(std::max<int64_t>(4, a.d / 64));
  mc.num_layers = a.layers;
  mc.first_dense_layers = 0;
  mc.max_seq_len = static_cast<int>(a.seq);
  mc.recompute = entries_of(mix);
  mc.moe.num_experts = static_cast<int>(a.experts);
  mc.moe.expert_hidden = static_cast<int>(a.hidden);
  mc.moe.top_k = static_cast<int>(a.top_k);
  mc.moe.num_shared_experts = static_cast<int>(a.shared);
  mc.moe.dispatch = ep > 1 ? "all_to_all" : "local";
  model::Transformer m(mc, 1, &layout);
  const uint64_t data = static_cast<uint64_t>(layout.data_rank());
  const Tensor ids = token_ids(a.batch, a.seq, mc.vocab_size, 100 + data);
  const Tensor targets = token_ids(a.batch, a.seq, mc.vocab_size, 200 + data);
  std::vector<double> ms;
  int64_t held = 0, peak = 0;
  for (int it = 0; it <= a.iters; ++it) {  // iteration 0 warms up
    m.zero_grad();
    world->barrier();
    const int64_t before = memory_stats().live_bytes;
    Timer timer;
    {
      PeakMemoryScope scope;
      m.forward_loss(ids, targets);
      held = memory_stats().live_bytes - before;
      m.backward();
      peak = scope.extra_peak_bytes();
    }
    if (it > 0) ms.push_back(timer.seconds() * 1e3);
  }
  const Measured result = over_world(*world, held, peak, ms);
  if (layout.world_rank != 0) return result;
  nlohmann::json j{
      {"bench", "ssmb_model"},
      {"world", layout.world_size},
      {"tp", tp},
      {"ssmb", ssmb},
      {"recompute", mix},
      {"ep", ep},
      {"shape", fmt::format("L={} B={} S={} d={} H={} E={} f={} k={} shared={}", a.layers, a.batch,
                            a.seq, a.d, mc.num_heads, a.experts, a.hidden, a.top_k, a.shared)},
      {"held_bytes", result.held},
      {"peak_bytes", result.peak},
      {"ms", result.ms}};
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
  return result;
}

/// SSMB against the replicated block with recompute `mix`, on rank 0.
void compare(const comm::Group& world, int tp, const Measured& ssmb, const Measured& recompute,
             const std::string& mix) {
  if (world.rank() != 0) return;
  nlohmann::json j{{"bench", "ssmb_vs_recompute"},
                   {"world", world.size()},
                   {"tp", tp},
                   {"recompute", mix},
                   {"ssmb_peak_bytes", ssmb.peak},
                   {"recompute_peak_bytes", recompute.peak},
                   {"peak_ratio", static_cast<double>(recompute.peak) / ssmb.peak},
                   {"ssmb_ms", ssmb.ms},
                   {"recompute_ms", recompute.ms},
                   {"time_ratio", recompute.ms / ssmb.ms}};
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"MoE block memory and dispatch bytes with and without SSMB (run under mpirun)"};
  app.add_option("--d", a.d, "model width");
  app.add_option("--experts", a.experts, "routed experts (divisible by the world size)");
  app.add_option("--hidden", a.hidden, "expert hidden size f");
  app.add_option("--top-k", a.top_k, "experts per token");
  app.add_option("--shared", a.shared, "shared experts");
  app.add_option("--batch", a.batch, "sequences per micro-batch (per tp group)");
  app.add_option("--seq", a.seq, "sequence length");
  app.add_option("--iters", a.iters, "timed iterations after one warm-up");
  app.add_option("--layers", a.layers, "whole models of this many MoE blocks (0: one block)");
  app.add_option("--recompute", a.recompute,
                 "recompute mixes run without SSMB for tp > 1 (moe, router joined by '+'), "
                 "comma-separated; empty: none");
  CLI11_PARSE(app, argc, argv);
  auto world = comm::world();
  try {
    for (int tp : {1, 2, 4}) {
      if (world->size() % tp != 0 || a.batch % tp != 0) continue;
      auto measure = [&](bool ssmb, const std::string& mix) {
        return a.layers > 0 ? run_model(world, a, tp, ssmb, mix) : run(world, a, tp, ssmb, mix);
      };
      Measured with_ssmb;
      for (bool ssmb : {true, false})
        if (tp > 1 || ssmb) {
          const Measured m = measure(ssmb, "none");
          if (ssmb) with_ssmb = m;
        }
      if (tp == 1) continue;
      std::stringstream mixes(a.recompute);
      for (std::string mix; std::getline(mixes, mix, ',');)
        if (!mix.empty()) compare(*world, tp, with_ssmb, measure(false, mix), mix);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[bench_ssmb] rank %d: %s\n", world->rank(), e.what());
    world->abort(1);
  }
  world.reset();
  comm::finalize();
  return 0;
}
