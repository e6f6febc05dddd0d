// Selective activation recompute, measured per layer (docs/training.md, "Activation recompute"):
// for each model.recompute option, on a preset's model (CPU or one CUDA device):
//   "recompute_layer" lines: one dense block (if the preset has one) and one MoE block run alone
//     on a random residual input [B·S, d] f32: the bytes it holds between forward and backward
//     (allocator live bytes, its output excluded, its input included) beside
//     TransformerBlock::activation_bytes_for's prediction, the peak of its backward above that, and
//     its forward + backward time (median of --steps);
//   "recompute_step" lines: whole training steps (forward, cross-entropy, backward, gradient
//     norm, AdamW) on random tokens: median step time, the allocator peak of the step above the
//     bytes live before it, and both against the first option (none).
//   bench_recompute [--preset tiny|moe-1b|...] [--device cpu|cuda|cuda:N] [--steps N]
//                   [--warmup N] [--dtype auto|f32|bf16]
//                   [--options none,router,attention_core,attention,moe,ffn,all]
//                   [--set key=value ...]
// An option is "none", "all" (attention, ffn, moe, router; "attention" covers its core) or
// model.recompute entries joined by '+', e.g. attention_core+router+moe. An option that does not
// fit (OutOfMemory) prints its line with "status": "out_of_memory" and the next one runs.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "run_status.h"
#include "xmoe/backend/cuda/runtime.h"
#include "xmoe/config/config.h"
#include "xmoe/core/allocator.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/rng.h"
#include "xmoe/core/timer.h"
#include "xmoe/model/transformer.h"
#include "xmoe/moe/layer.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/optim/clip.h"

using namespace xmoe;

namespace {

struct Args {
  std::string preset = "tiny", device_name, dtype = "auto";
  std::string options = "none,router,attention_core,attention,moe,ffn,all";
  int steps = 5, warmup = 1;
  std::vector<std::string> sets;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

/// The model.recompute entries of an option.
std::vector<std::string> entries_of(const std::string& option) {
  if (option == "none") return {};
  if (option == "all") return {"attention", "ffn", "moe", "router"};
  return split(option, '+');
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Tensor random_tokens(int64_t b, int64_t s, int64_t vocab, Rng& rng, Device device) {
  std::vector<int32_t> v(static_cast<size_t>(b * s));
  for (auto& x : v) x = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  return Tensor::from_vector<int32_t>(v, {b, s}, device);
}

Tensor random_rows(int64_t rows, int64_t d, uint64_t stream, float std, Device device) {
  Tensor t = Tensor::empty({rows, d});
  fill_normal(t, 17, stream, std);
  return t.to(device);
}

struct Run {
  std::string preset;
  Config config;
  Device device;
  DType dtype;
  std::string option;
  nlohmann::ordered_json head() const {
    nlohmann::ordered_json j;
    j["preset"] = preset;
    j["device"] = device.str();
    j["dtype"] = std::string(dtype_name(dtype));
    j["recompute"] = option;
    j["batch_size"] = config.train.batch_size;
    j["seq_len"] = config.train.seq_len;
    return j;
  }
};

/// Block `index` alone: held bytes, backward peak, forward + backward time.
void measure_layer(model::Transformer& m, const Run& r, int index, const Args& a) {
  const ModelConfig& mc = r.config.model;
  const int64_t b = r.config.train.batch_size, s = r.config.train.seq_len, t = b * s;
  model::TransformerBlock& block = m.block(index);
  const Tensor x = random_rows(t, mc.d_model, 1, 1.0f, r.device);
  const Tensor dy = random_rows(t, mc.d_model, 2, 1e-3f, r.device);
  std::vector<double> ms;
  int64_t held = 0, backward_peak = 0;
  for (int it = 0; it < a.warmup + a.steps; ++it) {
    backend::synchronize(r.device);
    const int64_t before = memory_stats(r.device).live_bytes;
    Timer timer;
    Tensor y = block.forward(x, b, s);
    backend::synchronize(r.device);
    // The block keeps its input x (the first norm's): live before forward, but saved.
    held = memory_stats(r.device).live_bytes - before - static_cast<int64_t>(y.nbytes()) +
           static_cast<int64_t>(x.nbytes());
    y = Tensor();
    {
      PeakMemoryScope scope(r.device);
      block.backward(dy);
      backend::synchronize(r.device);
      backward_peak = scope.extra_peak_bytes();
    }
    if (it >= a.warmup) ms.push_back(timer.millis());
  }
  m.zero_grad();
  const ActivationBytes predicted = model::TransformerBlock::activation_bytes_for(
      mc, index, b, s, r.dtype, model::parse_recompute(mc.recompute), {});
  nlohmann::ordered_json j = {{"bench", "recompute_layer"}};
  j.update(r.head());
  j["layer"] = index < mc.first_dense_layers ? "dense" : "moe";
  j["layer_index"] = index;
  j["saved_bytes"] = held;
  j["predicted_saved_bytes"] = predicted.saved;
  j["backward_peak_bytes"] = backward_peak;
  j["predicted_backward_peak_bytes"] = predicted.backward_extra;
  j["fwd_bwd_ms"] = median(ms);
  j["status"] = "ok";
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

struct StepResult {
  double ms = 0;
  int64_t peak = 0;
};

/// Whole training steps: median time and the step's allocator peak above its start.
StepResult measure_steps(model::Transformer& m, const Run& r, const Args& a) {
  const TrainConfig& tc = r.config.train;
  const auto params = m.parameters();
  optim::AdamW opt(params, optim::AdamWConfig::from(tc));
  const auto moe_layers = m.moe_layers();
  Rng rng(tc.seed, stream_id("bench_recompute"));
  std::vector<double> ms;
  StepResult res;
  for (int step = 0; step < a.warmup + a.steps; ++step) {
    const Tensor ids =
        random_tokens(tc.batch_size, tc.seq_len, r.config.model.vocab_size, rng, r.device);
    const Tensor targets =
        random_tokens(tc.batch_size, tc.seq_len, r.config.model.vocab_size, rng, r.device);
    backend::synchronize(r.device);
    PeakMemoryScope scope(r.device);
    Timer t;
    m.zero_grad();
    m.forward_loss(ids, targets);
    m.backward(1.0f);
    opt.step(tc.lr, optim::clip_factor(optim::grad_norm(params), tc.grad_clip));
    for (moe::MoELayer* l : moe_layers) l->update_routing_bias();
    backend::synchronize(r.device);
    if (step < a.warmup) continue;
    ms.push_back(t.millis());
    res.peak = std::max(res.peak, scope.extra_peak_bytes());
  }
  res.ms = median(ms);
  return res;
}

void run_option(const std::string& option, const Args& a, StepResult& baseline) {
  Run r;
  r.option = option;
  r.preset = a.preset;
  r.config = preset(a.preset);
  for (const std::string& s : a.sets) apply_override(r.config, s);
  r.config.model.recompute = entries_of(option);
  r.config.train.device = a.device_name;
  r.config.train.dtype = a.dtype;
  validate(r.config);
  r.device = parse_device(a.device_name);
  r.dtype = a.dtype == "f32" || (a.dtype == "auto" && r.device.is_cpu()) ? DType::f32 : DType::bf16;
  const ModelConfig& mc = r.config.model;
  model::Transformer m(mc, r.config.train.seed);
  m.to(r.device);
  m.set_compute_dtype(r.dtype);
  if (mc.first_dense_layers > 0) measure_layer(m, r, 0, a);
  if (mc.first_dense_layers < mc.num_layers) measure_layer(m, r, mc.first_dense_layers, a);
  const StepResult step = measure_steps(m, r, a);
  if (option == "none") baseline = step;
  nlohmann::ordered_json j = {{"bench", "recompute_step"}};
  j.update(r.head());
  j["median_step_ms"] = step.ms;
  j["step_peak_bytes"] = step.peak;
  if (baseline.ms > 0) {
    j["time_vs_none"] = step.ms / baseline.ms;
    j["peak_vs_none"] = static_cast<double>(step.peak) / static_cast<double>(baseline.peak);
  }
  j["status"] = "ok";
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Selective activation recompute: bytes saved per layer and step time"};
  app.add_option("--preset", a.preset, "config preset");
  app.add_option("--device", a.device_name, "cpu, cuda or cuda:N (default: cuda if present)");
  app.add_option("--steps", a.steps, "measured steps (and layer passes)")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", a.warmup, "unmeasured steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--dtype", a.dtype, "auto, f32 or bf16");
  app.add_option("--options", a.options, "recompute options, comma-separated (see the header)");
  app.add_option("--set", a.sets, "config override key=value (repeatable)");
  CLI11_PARSE(app, argc, argv);
  if (a.device_name.empty()) a.device_name = backend::cuda_available() ? "cuda" : "cpu";
  bool failed = false;
  StepResult baseline;
  for (const std::string& option : split(a.options, ',')) {
    nlohmann::ordered_json j = {{"bench", "recompute_step"}, {"recompute", option}};
    const bench::RunStatus status =
        bench::run_reporting_failure([&] { run_option(option, a, baseline); }, j);
    const Device device = parse_device(a.device_name);
    if (device.is_cuda()) cuda::empty_cache(device.index);
    if (status == bench::RunStatus::ok) continue;
    failed = failed || status == bench::RunStatus::error;
    std::fprintf(stderr, "bench_recompute: %s: %s\n", option.c_str(),
                 j["message"].get<std::string>().c_str());
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  return failed ? 1 : 0;
}
