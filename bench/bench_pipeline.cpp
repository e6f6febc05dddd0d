// The pipelined MoE layer (model.moe.pipeline) under mpirun: for a sweep of layer shapes (T, d,
// f, E, k) on W ranks (ep = W, all_to_all), the measured time of Dispatch + Expert + Combine
// (forward) and of their backward with r = 1..R chunks, against what FSMoE's formula predicts
// from the fitted models (sched/pipeline_plan.h), the r the formula chooses, and its speed-up
// over r = 1 and over the best fixed r (one r for every shape, chosen after the fact from the
// measurements). One JSON line per shape on rank 0, then a summary line.
//
// Timed: from expert-grouped rows [T k, d] on every rank (uniform routing, k distinct experts
// per token) to the combined rows [T k, d]: r = 1 is the layer's unchunked path (dispatch,
// Experts::forward, combine), r > 1 its pipelined one (plan, forward_pass, run_pipeline);
// backward likewise. Each repetition starts after a barrier; its time is the slowest rank's;
// a shape's time is the minimum over repetitions (a shared, oversubscribed machine deschedules
// ranks for whole time slices; the minimum is what the machine does when it gets the cores).
// The models come from --profile FILE, else from a quick profile run first on the same ranks
// (`xmoe profile --quick --statistic min` with the sweep's GEMM shapes). --device cuda: one GPU
// per rank over NCCL, bf16 rows, the larger GPU sweep; each timed section ends with a device
// synchronisation.
//
//   mpirun -np 4 bench_pipeline [--profile p.json] [--max-chunks 4] [--iters 3] [--quick]
//   mpirun -np 8 bench_pipeline --device cuda
//
// --grad-sync: instead, a small MoE model trained on the ranks (ep = W, parallel.zero 0, f32 on
// the CPU) three ways: gradient sync after backward (parallel.overlap_grad_sync = false),
// overlapped with backward, and overlapped with parallel.grad_partition = auto from the profile.
// One "grad_sync" JSON line each (rank 0): the median over the steps after the first two of
// the exposed sync (StepMetrics::grad_sync_seconds, the slowest rank's) and of the step.
//   mpirun -np 4 bench_pipeline --grad-sync [--profile p.json] [--corpus DIR] [--steps 12]
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "xmoe/comm/group.h"
#include "xmoe/comm/nccl/nccl_group.h"
#include "xmoe/config/config.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/rng.h"
#include "xmoe/core/timer.h"
#include "xmoe/moe/dispatch.h"
#include "xmoe/moe/expert.h"
#include "xmoe/moe/pipeline.h"
#include "xmoe/ops/ops.h"
#include "xmoe/sched/pipeline_plan.h"
#include "xmoe/sched/profiler.h"
#include "xmoe/train/trainer.h"

using namespace xmoe;

namespace {

struct LayerShape {
  int64_t T, d, f, E, k;
};

double slowest(comm::Group& g, double seconds) {
  Tensor t = Tensor::from_vector<double>({seconds}, {1});
  g.all_reduce(t, comm::ReduceOp::max);
  return t.to_vector<double>()[0];
}

/// Rows per global expert of T tokens, each to k distinct experts drawn uniformly.
std::vector<int64_t> uniform_routing(int64_t T, int64_t E, int64_t k, int rank) {
  Rng rng(4242, static_cast<uint64_t>(rank) + 1);
  std::vector<int64_t> counts(E, 0), pick(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(pick.begin(), pick.end(), 0);
    for (int64_t j = 0; j < k; ++j) {  // partial Fisher-Yates
      const int64_t s =
          j + std::min<int64_t>(E - j - 1, static_cast<int64_t>(rng.uniform() * (E - j)));
      std::swap(pick[j], pick[s]);
      ++counts[pick[j]];
    }
  }
  return counts;
}

/// [n, d] normal rows on `device`, bf16 there when it is a GPU (as training runs).
Tensor random_rows(int64_t n, int64_t d, uint64_t seed, Device device) {
  Rng rng(seed, 0);
  std::vector<float> v(static_cast<size_t>(n * d));
  for (float& x : v) x = rng.normal();
  Tensor t = Tensor::from_vector(v, {n, d}, device);
  return device.is_cuda() ? ops::cast(t, DType::bf16) : t;
}

struct Measured {
  std::vector<double> forward, backward;  // seconds for r = 1..R
};

Measured measure(const std::shared_ptr<comm::Group>& g, const LayerShape& s, int max_chunks,
                 int iters) {
  const Device dev = g->device();
  const int W = g->size(), rank = g->rank();
  const int64_t El = s.E / W;
  moe::DispatchConfig dc;
  dc.algorithm = "all_to_all";
  dc.num_experts = s.E;
  dc.ep_rank = rank;
  dc.ep_size = W;
  dc.group = g;
  auto dispatcher = moe::make_dispatcher(dc);
  moe::ExpertArgs ea;
  ea.prefix = "bench";
  ea.num_experts = s.E;
  ea.num_local = El;
  ea.first_expert = rank * El;
  ea.d_model = s.d;
  ea.hidden = s.f;
  ea.chunks = 1;
  auto experts = moe::make_experts("swiglu", ea);
  for (Parameter* p : experts->parameters()) {
    p->value = p->value.to(dev);
    p->grad = p->grad.to(dev);
  }
  const std::vector<int64_t> tpe = uniform_routing(s.T, s.E, s.k, rank);
  const int64_t N = s.T * s.k;
  const Tensor rows = random_rows(N, s.d, 11 + rank, dev);
  const Tensor dy = random_rows(N, s.d, 97 + rank, dev);
  Measured m;
  for (int r = 1; r <= max_chunks; ++r) {
    const moe::ChunkBounds bounds = moe::even_chunks(El, r);
    double best_f = 1e30, best_b = 1e30;
    for (int it = 0; it < iters + 1; ++it) {  // the first one warms up
      g->barrier();
      Timer tf;
      moe::DispatchHandle h;
      Tensor y;
      if (r == 1) {
        moe::DispatchResult d = dispatcher->dispatch(rows, tpe);
        h = std::move(d.handle);
        y = dispatcher->combine(experts->forward(std::move(d.rows), h.recv_tokens_per_expert), h);
      } else {
        h = dispatcher->plan(rows, tpe, moe::RowInfo{});
        auto pass = dispatcher->forward_pass(rows, h, bounds);
        experts->begin_forward(h.recv_tokens_per_expert);
        y = moe::run_pipeline(*pass, bounds, [&](int c, Tensor in) {
          return experts->forward_part(std::move(in), bounds[c], bounds[c + 1]);
        });
      }
      backend::synchronize(dev);
      const double fwd = slowest(*g, tf.seconds());
      g->barrier();
      Timer tb;
      if (r == 1) {
        Tensor d_in = experts->backward(dispatcher->combine_backward(dy, h));
        dispatcher->dispatch_backward(d_in, h);
      } else {
        auto pass = dispatcher->backward_pass(dy, h, bounds);
        moe::run_pipeline(*pass, bounds, [&](int c, Tensor d_out) {
          return experts->backward_part(std::move(d_out), bounds[c], bounds[c + 1]);
        });
      }
      backend::synchronize(dev);
      const double bwd = slowest(*g, tb.seconds());
      experts->release();
      if (it > 0) {
        best_f = std::min(best_f, fwd);
        best_b = std::min(best_b, bwd);
      }
    }
    m.forward.push_back(best_f);
    m.backward.push_back(best_b);
  }
  return m;
}

std::vector<double> micros(const std::vector<double>& s) {
  std::vector<double> out;
  for (double v : s) out.push_back(std::round(v * 1e7) / 10);
  return out;
}

double geomean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += std::log(x);
  return v.empty() ? 0 : std::exp(s / static_cast<double>(v.size()));
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// --grad-sync: the exposed gradient sync per step with overlap off, on, and partitioned.
void bench_grad_sync(const std::shared_ptr<comm::Group>& g, const std::string& profile_path,
                     const std::string& corpus, int steps) {
  const int W = g->size();
  const std::string root =
      (std::filesystem::temp_directory_path() / fmt::format("xmoe-bench-grad-sync-{}", W)).string();
  Config c = preset("tiny");
  c.model.d_model = 128;
  c.model.num_layers = 4;
  c.model.num_heads = 4;
  c.model.num_kv_heads = 4;
  c.model.max_seq_len = 64;
  c.model.moe.num_experts = 8;
  c.model.moe.expert_hidden = 64;
  c.data.corpus = corpus;
  c.data.dir = root + "/data";
  c.train.steps = steps;
  c.train.batch_size = 4;
  c.train.seq_len = 64;
  c.train.eval_every = 0;
  c.train.save_every = 0;
  c.train.log_every = 1000;
  c.parallel.ep = W;
  c.model.moe.pipeline_profile = profile_path;
  validate(c);
  for (const std::string mode : {"after_backward", "overlapped", "partitioned"}) {
    c.parallel.overlap_grad_sync = mode != "after_backward";
    c.parallel.grad_partition = mode == "partitioned" ? "auto" : "off";
    c.train.out_dir = root + "/" + mode;
    train::TrainOptions o;
    o.progress = false;
    o.overwrite = true;
    o.world = g;
    const train::TrainResult r = train::train(c, o);
    std::vector<double> sync, step;
    for (size_t i = 2; i < r.steps.size(); ++i) {
      sync.push_back(slowest(*g, r.steps[i].grad_sync_seconds));
      step.push_back(slowest(*g, r.steps[i].seconds));
    }
    if (g->rank() != 0) continue;
    nlohmann::ordered_json j;
    j["bench"] = "grad_sync";
    j["ranks"] = W;
    j["mode"] = mode;
    j["steps"] = sync.size();
    j["median_exposed_sync_ms"] = median_of(sync) * 1e3;
    j["median_step_ms"] = median_of(step) * 1e3;
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pipelined MoE layer: measured vs predicted time over chunk counts"};
  std::string profile_path;
  int max_chunks = 4, iters = 3;
  bool quick = false;
  std::string device = "cpu";
  app.add_option("--profile", profile_path, "the models (`xmoe profile`); default: profile now");
  app.add_option("--device", device, "cpu (MPI) or cuda (NCCL, one GPU per rank)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--max-chunks", max_chunks, "chunk counts 1..R")->check(CLI::Range(1, 64));
  app.add_option("--iters", iters, "timed repetitions per r (after one warm-up)")
      ->check(CLI::Range(1, 1000));
  app.add_flag("--quick", quick, "a few small shapes (seconds)");
  bool grad_sync = false;
  std::string corpus = "/usr/share/games/fortunes";
  int steps = 12;
  app.add_flag("--grad-sync", grad_sync, "the exposed gradient sync per step (see above)");
  app.add_option("--corpus", corpus, "--grad-sync: the text to train on");
  app.add_option("--steps", steps, "--grad-sync: steps per mode")->check(CLI::Range(3, 100000));
  CLI11_PARSE(app, argc, argv);

  const bool gpu = device == "cuda";
  auto g = gpu ? comm::nccl::make_world() : comm::world();
  const int W = g->size();
  std::vector<LayerShape> shapes;
  if (quick) {
    shapes = {{256, 64, 64, 16, 2}, {512, 128, 64, 16, 4}};
  } else if (gpu) {  // moe-1b's layer (d 1024, f 256, E 64, k 6) and around it
    for (int64_t T : {4096, 16384})
      for (int64_t d : {1024, 2048})
        for (int64_t f : {256, 1024})
          for (int64_t E : {64, 128})
            for (int64_t k : {4, 8}) shapes.push_back({T, d, f, E, k});
  } else {
    for (int64_t T : {512, 2048})
      for (int64_t d : {128, 256})
        for (int64_t f : {64, 256})
          for (int64_t E : {16, 32})
            for (int64_t k : {2, 4}) shapes.push_back({T, d, f, E, k});
  }
  std::erase_if(shapes, [&](const LayerShape& s) { return s.E % W != 0; });
  if (grad_sync) shapes = {{256, 128, 64, 8, 2}};  // the model's MoE layer (GEMM shapes to profile)

  sched::Profile profile;
  if (!profile_path.empty()) {
    profile = sched::load_profile(profile_path);
  } else {
    sched::ProfileOptions o;
    o.quick = true;
    o.statistic = "min";
    std::set<std::pair<int64_t, int64_t>> seen;
    for (const LayerShape& s : shapes)
      for (auto io : {std::pair{s.d, 2 * s.f}, std::pair{s.f, s.d}})
        if (seen.insert(io).second) o.gemm_shapes.push_back({io.first, io.second});
    profile = sched::run_profile(g, g->device(), o);
  }
  if (grad_sync) {
    if (profile_path.empty()) {
      profile_path = (std::filesystem::temp_directory_path() /
                      fmt::format("xmoe-bench-grad-sync-profile-{}.json", W))
                         .string();
      if (g->rank() == 0) sched::save_profile(profile, profile_path);
      g->barrier();
    }
    bench_grad_sync(g, profile_path, corpus, steps);
    g.reset();
    comm::finalize();
    return 0;
  }

  std::vector<std::vector<double>> fwd_all, bwd_all;
  std::vector<int> chosen_f, chosen_b;
  std::vector<double> errors;
  for (const LayerShape& s : shapes) {
    const int R = static_cast<int>(std::min<int64_t>(max_chunks, s.E / W));
    const Measured m = measure(g, s, R, iters);
    sched::PipelineShape ps{.rows = s.T * s.k,
                            .d_model = s.d,
                            .expert_hidden = s.f,
                            .local_experts = s.E / W,
                            .ep = W,
                            .elem_bytes = gpu ? 2 : 4};
    const sched::PipelineChoice c = sched::choose_pipeline(&profile, ps, R);
    for (int r = 0; r < R; ++r) {
      errors.push_back(std::abs(c.forward_seconds[r] - m.forward[r]) / m.forward[r]);
      errors.push_back(std::abs(c.backward_seconds[r] - m.backward[r]) / m.backward[r]);
    }
    fwd_all.push_back(m.forward);
    bwd_all.push_back(m.backward);
    chosen_f.push_back(c.forward);
    chosen_b.push_back(c.backward);
    if (g->rank() != 0) continue;
    nlohmann::ordered_json j;
    j["bench"] = "pipeline";
    j["ranks"] = W;
    j["device"] = device;
    j["T"] = s.T;
    j["d"] = s.d;
    j["f"] = s.f;
    j["E"] = s.E;
    j["k"] = s.k;
    j["measured_fwd_us"] = micros(m.forward);
    j["predicted_fwd_us"] = micros(c.forward_seconds);
    j["measured_bwd_us"] = micros(m.backward);
    j["predicted_bwd_us"] = micros(c.backward_seconds);
    j["chosen_fwd"] = c.forward;
    j["chosen_bwd"] = c.backward;
    const double t1 = m.forward[0] + m.backward[0];
    const double tc = m.forward[c.forward - 1] + m.backward[c.backward - 1];
    j["speedup_vs_r1"] = std::round(t1 / tc * 1000) / 1000;
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }

  // The best fixed r: one r (forward and backward) for every shape, least total measured time.
  const int R = max_chunks;
  auto best_fixed = [&](const std::vector<std::vector<double>>& all) {
    int best = 1;
    double best_total = 1e300;
    for (int r = 1; r <= R; ++r) {
      double total = 0;
      for (const auto& t : all) total += t[std::min<size_t>(r, t.size()) - 1];
      if (total < best_total) best_total = total, best = r;
    }
    return best;
  };
  const int fixed_f = best_fixed(fwd_all), fixed_b = best_fixed(bwd_all);
  std::vector<double> vs_r1, vs_fixed, oracle;
  for (size_t i = 0; i < fwd_all.size(); ++i) {
    const auto &f = fwd_all[i], &b = bwd_all[i];
    const double chosen = f[chosen_f[i] - 1] + b[chosen_b[i] - 1];
    vs_r1.push_back((f[0] + b[0]) / chosen);
    vs_fixed.push_back(
        (f[std::min<size_t>(fixed_f, f.size()) - 1] + b[std::min<size_t>(fixed_b, b.size()) - 1]) /
        chosen);
    oracle.push_back(
        (*std::min_element(f.begin(), f.end()) + *std::min_element(b.begin(), b.end())) / chosen);
  }
  std::sort(errors.begin(), errors.end());
  if (g->rank() == 0) {
    nlohmann::ordered_json j;
    j["bench"] = "pipeline_summary";
    j["ranks"] = W;
    j["shapes"] = fwd_all.size();
    j["median_abs_error"] = errors.empty() ? 0.0 : errors[errors.size() / 2];
    j["p90_abs_error"] = errors.empty() ? 0.0 : errors[errors.size() * 9 / 10];
    j["best_fixed_fwd_r"] = fixed_f;
    j["best_fixed_bwd_r"] = fixed_b;
    j["geomean_speedup_chosen_vs_r1"] = geomean(vs_r1);
    j["geomean_speedup_chosen_vs_best_fixed"] = geomean(vs_fixed);
    j["geomean_chosen_vs_oracle"] = 1.0 / geomean(oracle);
    std::printf("%s\n", j.dump().c_str());
  }
  if (gpu) g->barrier();
  g.reset();
  comm::finalize();
  return 0;
}
