// One training step of a preset's model end to end (forward, cross-entropy, backward, gradient
// norm and clipping, AdamW) on synthetic uniform-random tokens, on the CPU or a CUDA device.
// Prints one JSON line per measured step and a summary line (median): step ms, tokens/s, MFU
// (PaLM count against train/flops.h's peak; CUDA only), peak device bytes from the allocator
// counters (live tensors; on CUDA also the bytes reserved by the caching allocator).
// The first --warmup steps (default 2) are not measured: allocator and cuBLAS warm-up.
//   bench_train_step [--preset tiny|moe-1b|...[,...]] [--device cpu|cuda|cuda:N] [--steps N]
//                    [--warmup N] [--dtype auto|f32|bf16] [--dense] [--breakdown] [--timeline]
//                    [--set key=value ...]
// --set train.offload_optimizer=true runs the offloaded update: the summary line then gives
// its median time per step (median_optimizer_ms, also without offload), the device bytes
// before the offload and with the optimizer built, and the pinned host bytes; the gradients
// start for the host during backward unless --set train.offload_overlap=false.
// --set takes config keys (e.g. train.batch_size=4, model.num_layers=2); --dense makes every
// block a dense FFN (model.first_dense_layers = model.num_layers). --set train.grad_accum=G
// makes a step G micro-batches' forward and backward, then one update, as the trainer does
// (with offload, the gradients start for the host during the last backward only): the
// optimizer's cost per token falls by G (bench/largest_model.sh).
// --breakdown: after the timed steps, 2 more steps with the region profiler on
// (core/profile.h): one "train_step_breakdown" line per region (path, calls and ms per step,
// share of the profiled step, the highest device bytes live inside it) and a
// "train_step_breakdown_summary" line; the table also goes to stderr. The profiler synchronises the
// device at every region boundary, so the profiled step ("profiled_step_ms") is slower than the
// timed one ("step_ms", the median above). The timed steps always run with profiling off (also
// under XMOE_PROFILE=1). Several presets (comma-separated) run one after the other, each in its own
// scope: one that does not fit (OutOfMemory, from the device or XMOE_MEMORY_LIMIT) prints a
// "train_step_summary" line with "status": "out_of_memory" and the bytes asked, free and total,
// frees everything and the next preset runs; any other error prints "status": "error" with the
// message. The exit code is 1 when some preset failed for a reason other than memory.
// --timeline (CUDA): after the timed steps, one more step with the device timeline recorded
// (core/device_timeline.h: CUPTI's records of every kernel, copy and memset, in place): a
// "train_step_timeline" line with the step's device span, busy and idle ms, the idle ms that
// passed before the host had called the next launch, the longest gaps (what ran before and
// after each), the idle ms before each kernel name, largest first, and every name's summed ms
// and launches (scripts/ncu_kernels.py reads them as it reads ncu's CSV).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "run_status.h"
#include "xmoe/backend/cuda/runtime.h"
#include "xmoe/config/config.h"
#include "xmoe/core/allocator.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/device_timeline.h"
#include "xmoe/core/profile.h"
#include "xmoe/core/rng.h"
#include "xmoe/core/timer.h"
#include "xmoe/model/transformer.h"
#include "xmoe/moe/layer.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/optim/clip.h"
#include "xmoe/train/flops.h"

using namespace xmoe;

namespace {

Tensor random_tokens(int64_t b, int64_t s, int64_t vocab, Rng& rng, Device device) {
  std::vector<int32_t> v(static_cast<size_t>(b * s));
  for (auto& x : v) x = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  return Tensor::from_vector<int32_t>(v, {b, s}, device);
}

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: bench_train_step [--preset NAME[,NAME...]] [--device cpu|cuda|cuda:N] "
               "[--steps N] [--warmup N] [--dtype auto|f32|bf16] [--dense] [--breakdown] "
               "[--timeline] [--set key=value ...]\n");
  std::exit(2);
}

struct Options {
  std::string device_name, dtype_name_arg = "auto";
  int steps = 10, warmup = 2;
  bool dense = false, breakdown = false, timeline = false;
  std::vector<std::string> sets;
};

/// Builds the preset's model and optimizer, times its steps and prints their lines; everything
/// it allocated is freed when it returns or throws.
void run_preset(const std::string& preset_name, const Options& o) {
  const std::string& dtype_name_arg = o.dtype_name_arg;
  const int steps = o.steps, warmup = o.warmup;
  const bool breakdown = o.breakdown;
  const std::string& device_name = o.device_name;
  Config config = preset(preset_name);
  for (const std::string& s : o.sets) apply_override(config, s);
  if (o.dense) config.model.first_dense_layers = config.model.num_layers;
  config.train.device = device_name;
  config.train.dtype = dtype_name_arg;
  validate(config);
  const Device device = parse_device(device_name);
  const DType dtype = dtype_name_arg == "f32" || (dtype_name_arg == "auto" && device.is_cpu())
                          ? DType::f32
                          : DType::bf16;
  const TrainConfig& tc = config.train;
  const int64_t batch = tc.batch_size, seq = tc.seq_len, vocab = config.model.vocab_size;
  const int64_t accum = tc.grad_accum;
  const int64_t tokens = batch * seq * accum;

  model::Transformer model(config.model, tc.seed);
  // --set train.offload_optimizer=true: master weights and moments to pinned host memory,
  // parameter by parameter (as the trainer does); the device bytes with the optimizer built show
  // what stayed on the GPU.
  const int64_t live_before = memory_stats(device).live_bytes;
  model.place(device, dtype, tc.offload_optimizer);
  const auto params = model.parameters();
  optim::AdamW opt(params, optim::AdamWConfig::from(tc));
  const int64_t live_after = memory_stats(device).live_bytes;
  const auto moe_layers = model.moe_layers();
  Rng rng(tc.seed, stream_id("bench_train_step"));

  struct StepResult {
    float loss;
    double norm;
    double optimizer_ms;  ///< the update (offloaded: copies, host update, copies back)
  };
  // train.offload_overlap (the trainer's default with offload): each module's gradients start
  // for the host during backward.
  const bool prefetch = tc.offload_optimizer && tc.offload_overlap;
  // One step: `accum` micro-batches (ids, targets: [accum * batch, seq]), the update.
  auto train_step = [&](const Tensor& ids, const Tensor& targets) {
    {
      ProfileScope scope("zero_grad", device);
      model.zero_grad();
    }
    float loss = 0;
    for (int64_t micro = 0; micro < accum; ++micro) {
      const bool last = micro + 1 == accum;
      model.set_grads_ready(
          prefetch && last ? model::Transformer::GradsReady(
                                 [&](const std::vector<Parameter*>& ps) { opt.prefetch_grads(ps); })
                           : model::Transformer::GradsReady{});
      loss += model.forward_loss(ids.rows(micro * batch, (micro + 1) * batch),
                                 targets.rows(micro * batch, (micro + 1) * batch)) /
              static_cast<float>(accum);
      model.backward(1.0f / static_cast<float>(accum));
    }
    const double norm = optim::grad_norm(params);  // the host has waited for backward here
    Timer update;
    opt.step(tc.lr, optim::clip_factor(norm, tc.grad_clip));
    for (moe::MoELayer* l : moe_layers) l->update_routing_bias();
    backend::synchronize(device);  // the step is done when the optimizer's kernels are
    return StepResult{loss, norm, update.millis()};
  };

  profiling::enable(false);  // timed steps: no synchronisation at region boundaries
  std::vector<double> ms, opt_ms;
  for (int step = 0; step < warmup + steps; ++step) {
    const Tensor ids = random_tokens(accum * batch, seq, vocab, rng, device);
    const Tensor targets = random_tokens(accum * batch, seq, vocab, rng, device);
    if (step == warmup) reset_peak_memory(device);
    Timer t;
    const auto [loss, norm, optimizer_ms] = train_step(ids, targets);
    const double step_ms = t.millis();
    if (step < warmup) continue;
    ms.push_back(step_ms);
    opt_ms.push_back(optimizer_ms);
    const double tps = static_cast<double>(tokens) / (step_ms / 1e3);
    nlohmann::ordered_json j;
    j["bench"] = "train_step";
    j["preset"] = preset_name;
    j["device"] = device.str();
    j["dtype"] = std::string(dtype_name(dtype));
    j["step"] = step - warmup + 1;
    j["loss"] = loss;
    j["grad_norm"] = norm;
    j["step_ms"] = step_ms;
    j["optimizer_ms"] = optimizer_ms;
    j["tokens_per_s"] = tps;
    if (device.is_cuda()) j["mfu"] = train::mfu(config.model, seq, tps, 1);
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  std::sort(opt_ms.begin(), opt_ms.end());
  const double tps = static_cast<double>(tokens) / (median / 1e3);
  const ParamCount pc = count_parameters(config.model);
  nlohmann::ordered_json j;
  j["bench"] = "train_step_summary";
  j["preset"] = preset_name;
  j["device"] = device.str();
  j["dtype"] = std::string(dtype_name(dtype));
  j["batch_size"] = batch;
  j["grad_accum"] = accum;
  j["seq_len"] = seq;
  j["tokens_per_step"] = tokens;
  j["params_total"] = pc.total;
  j["params_active"] = pc.active;
  j["flops_per_token"] = train::training_flops_per_token(config.model, seq);
  j["steps"] = steps;
  j["median_step_ms"] = median;
  j["tokens_per_s"] = tps;
  j["tflops_per_s"] = train::training_flops_per_token(config.model, seq) * tps / 1e12;
  if (device.is_cuda()) {
    j["mfu"] = train::mfu(config.model, seq, tps, 1);
    j["peak_flops"] = train::kPeakFlopsPerDevice;
  }
  j["status"] = "ok";
  j["peak_live_bytes"] = memory_stats(device).peak_bytes;
  j["offload_optimizer"] = tc.offload_optimizer;
  j["median_optimizer_ms"] = opt_ms[opt_ms.size() / 2];
  // The model (with its master weights where they stay on the device) and its optimizer.
  j["device_live_bytes_with_optimizer"] = live_after - live_before;
  j["optimizer_state_bytes"] = opt.state_bytes();
  j["offload_staging_bytes"] = opt.staging_bytes();
  if (device.is_cuda() && tc.offload_optimizer)
    j["pinned_host_bytes"] = backend::pinned_host_allocator().stats().live_bytes;
  if (device.is_cuda()) j["reserved_bytes"] = cuda::cache_stats(device.index).reserved_bytes;
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);

  if (o.timeline) {
    const Tensor ids = random_tokens(accum * batch, seq, vocab, rng, device);
    const Tensor targets = random_tokens(accum * batch, seq, vocab, rng, device);
    backend::start_device_timeline();
    Timer t;
    train_step(ids, targets);
    const double step_ms = t.millis();
    const std::vector<DeviceActivity> records = backend::stop_device_timeline();
    const TimelineSummary sum = summarize_timeline(records);
    auto ms = [](int64_t ns) { return static_cast<double>(ns) / 1e6; };
    nlohmann::ordered_json tl;
    tl["bench"] = "train_step_timeline";
    tl["preset"] = preset_name;
    tl["device"] = device.str();
    tl["step_ms"] = step_ms;  // the host's, with CUPTI recording
    tl["span_ms"] = ms(sum.span_ns);
    tl["busy_ms"] = ms(sum.busy_ns);
    tl["idle_ms"] = ms(sum.idle_ns);
    tl["host_late_ms"] = ms(sum.host_late_ns);
    tl["kernels"] = sum.kernels;
    tl["memcpys"] = sum.memcpys;
    tl["memsets"] = sum.memsets;
    nlohmann::ordered_json gaps = nlohmann::ordered_json::array();
    for (const IdleGap& g : sum.longest)
      gaps.push_back({{"us", static_cast<double>(g.ns()) / 1e3},
                      {"host_late_us", static_cast<double>(g.host_late_ns) / 1e3},
                      {"before", g.before},
                      {"after", g.after}});
    tl["longest_gaps"] = gaps;
    nlohmann::ordered_json before = nlohmann::ordered_json::array();
    for (size_t i = 0; i < sum.idle_before.size() && i < 20; ++i)
      before.push_back(
          {{"name", sum.idle_before[i].first}, {"idle_ms", ms(sum.idle_before[i].second)}});
    tl["idle_before"] = before;
    nlohmann::ordered_json names = nlohmann::ordered_json::array();
    for (const TimelineSummary::NameTotal& n : sum.by_name)
      names.push_back({{"name", n.name}, {"ms", ms(n.ns)}, {"count", n.count}});
    tl["by_name"] = names;
    std::printf("%s\n", tl.dump().c_str());
    std::fflush(stdout);
  }

  if (breakdown) {
    constexpr int kProfiledSteps = 2;
    profiling::reset();
    profiling::enable(true);
    for (int step = 0; step < kProfiledSteps; ++step) {
      const Tensor ids = random_tokens(accum * batch, seq, vocab, rng, device);
      const Tensor targets = random_tokens(accum * batch, seq, vocab, rng, device);
      ProfileScope scope("step", device);
      train_step(ids, targets);
    }
    profiling::enable(false);
    const std::vector<profiling::Region> regions = profiling::report();
    double step_total = 0, step_self = 0;
    for (const profiling::Region& r : regions)
      if (r.path == "step") step_total = r.total_ms, step_self = r.self_ms;
    const double profiled_step_ms = step_total / kProfiledSteps;
    for (const profiling::Region& r : regions) {
      nlohmann::ordered_json b;
      b["bench"] = "train_step_breakdown";
      b["preset"] = preset_name;
      b["device"] = device.str();
      b["region"] = r.path;
      b["name"] = r.name;
      b["parent"] = r.parent;
      b["calls_per_step"] = static_cast<double>(r.calls) / kProfiledSteps;
      b["ms_per_step"] = r.total_ms / kProfiledSteps;
      b["self_ms_per_step"] = r.self_ms / kProfiledSteps;
      b["share"] = step_total > 0 ? r.total_ms / step_total : 0.0;
      b["peak_live_bytes"] = r.peak_bytes;
      std::printf("%s\n", b.dump().c_str());
    }
    nlohmann::ordered_json s;
    s["bench"] = "train_step_breakdown_summary";
    s["preset"] = preset_name;
    s["device"] = device.str();
    s["dtype"] = std::string(dtype_name(dtype));
    s["profiled_steps"] = kProfiledSteps;
    // Every region boundary synchronises the device: the profiled step is slower.
    s["profiled_step_ms"] = profiled_step_ms;
    s["step_ms"] = median;
    s["sync_overhead"] = median > 0 ? profiled_step_ms / median - 1.0 : 0.0;
    s["unattributed_ms_per_step"] = step_self / kProfiledSteps;  // in "step", in no region
    s["regions"] = regions.size();
    std::printf("%s\n", s.dump().c_str());
    std::fflush(stdout);
    std::fprintf(stderr, "bench_train_step: profile of %d steps (totals, not per step)\n%s",
                 kProfiledSteps, profiling::report_table().c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string presets = "tiny";
  Options o;
  for (int i = 1; i < argc; ++i) {
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    if (!std::strcmp(argv[i], "--preset"))
      presets = next();
    else if (!std::strcmp(argv[i], "--device"))
      o.device_name = next();
    else if (!std::strcmp(argv[i], "--steps"))
      o.steps = std::max(1, std::atoi(next().c_str()));
    else if (!std::strcmp(argv[i], "--warmup"))
      o.warmup = std::max(0, std::atoi(next().c_str()));
    else if (!std::strcmp(argv[i], "--dtype"))
      o.dtype_name_arg = next();
    else if (!std::strcmp(argv[i], "--dense"))
      o.dense = true;
    else if (!std::strcmp(argv[i], "--breakdown"))
      o.breakdown = true;
    else if (!std::strcmp(argv[i], "--timeline"))
      o.timeline = true;
    else if (!std::strcmp(argv[i], "--set"))
      o.sets.push_back(next());
    else
      usage();
  }
  if (o.device_name.empty()) o.device_name = backend::cuda_available() ? "cuda" : "cpu";
  Device device;
  try {
    device = parse_device(o.device_name);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train_step: %s\n", e.what());
    return 1;
  }
  if (o.timeline && !device.is_cuda()) {  // before any preset is built and timed
    std::fprintf(stderr, "bench_train_step: --timeline needs a CUDA device, not %s\n",
                 device.str().c_str());
    return 2;
  }
  bool failed = false;  // a preset failed for a reason other than memory
  std::stringstream list(presets);
  for (std::string name; std::getline(list, name, ',');) {
    if (name.empty()) continue;
    nlohmann::ordered_json j;
    j["bench"] = "train_step_summary";
    j["preset"] = name;
    j["device"] = device.str();
    const bench::RunStatus status = bench::run_reporting_failure([&] { run_preset(name, o); }, j);
    if (device.is_cuda()) cuda::empty_cache(device.index);  // the next preset starts clean
    if (status == bench::RunStatus::ok) continue;
    failed = failed || status == bench::RunStatus::error;
    std::fprintf(stderr, "bench_train_step: %s: %s\n", name.c_str(),
                 j["message"].get<std::string>().c_str());
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  return failed ? 1 : 0;
}
