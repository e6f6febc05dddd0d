// Forward + backward of the routed MoE layer (gate, order, experts, un-permute; no shared
// expert): padding-free token buffers (pft) vs the padded [E, C, d] baseline, on the CPU (f32)
// or a CUDA device (bf16 activations, f32 master weights and gradients). One JSON line per
// configuration: median time, TFLOP/s (3 x 2·T·k·(2·d·f + f·d): forward and the two backward
// GEMMs of each projection), tokens/s, peak bytes above those held before the timed pass
// (allocator counters: parameters, their gradients, the expert weights' bf16 compute copies and
// the inputs exist before, as in a bf16 model), dropped (token, slot) pairs. Gradients are zeroed
// before each pass, outside the timing; the expert ones lazily (the pass overwrites them).
//
//   bench_moe_layer [--device cpu|cuda|cuda:N] [--shapes TxdxfxExk,...] [--impls pft,padded]
//                   [--cf 1.0,1.25,2.0] [--iters N] [--warmup N] [--quick] [--recompute]
//                   [--expert-chunks N] [--breakdown] [--router-dtype f32|bf16]
//                   [--expert-grad-dtype f32|bf16] [--weights f32|bf16]
//
// --recompute: the layer keeps neither h nor its input rows (MoELayer::set_recompute): the
// memory-for-time trade of model.recompute=moe. --expert-chunks: model.moe.expert_chunks (the
// experts' [N, f] activations made this many row chunks at a time; 0 = auto). --breakdown: after
// the timed passes, 2 more with the region profiler on (core/profile.h): one
// "moe_layer_breakdown" line per region (ms per pass; the profiler synchronises the device at
// every region boundary) and the table on stderr. --router-dtype: model.moe.router_dtype (bf16:
// the router's GEMMs on bf16 operands; the peer takes the same flag). --expert-grad-dtype:
// model.moe.expert_grad_dtype (bf16: the experts' weight gradients in bf16, as the peer's).
// --weights: f32 (default) keeps f32 master weights and, on CUDA, their bf16 compute copies, as
// a training model holds them; bf16 holds the routed experts' weights in bf16 only
// (Parameter::drop_master_weights: no f32 master, as the peer's), what a pass that no optimizer
// follows needs: 2 bytes per expert parameter instead of 4 + 2 (docs/training.md).
//
// Each shape and implementation runs in its own scope. One that does not fit (OutOfMemory, from
// the device or XMOE_MEMORY_LIMIT) prints a line with "status": "out_of_memory" and the bytes
// asked, free and total, frees everything and the next one runs; any other error prints
// "status": "error" with the message. The exit code is 1 when some run failed for a reason other
// than memory. Measured lines have "status": "ok".
//
// Defaults: on the CPU the two small shapes of docs/benchmarks.md, pft and padded at capacity
// factors 1.0, 1.25, 2.0 (with the ratios against pft); on CUDA the three peer shapes of
// bench/peers/moe_layer_torch.py, pft only. The peers print the same fields
// (bench "moe_layer_peer"); bench/peers/summarize.py puts them side by side.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "run_status.h"
#include "xmoe/backend/cuda/runtime.h"
#include "xmoe/core/allocator.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/error.h"
#include "xmoe/core/profile.h"
#include "xmoe/core/rng.h"
#include "xmoe/core/timer.h"
#include "xmoe/moe/layer.h"
#include "xmoe/ops/ops.h"

using namespace xmoe;

namespace {

struct Shape5 {
  int64_t T, d, f, E, k;
};

/// "16384x2048x1408x64x6,8192x..." -> shapes (T, d, f, E, k).
std::vector<Shape5> parse_shapes(const std::string& text) {
  std::vector<Shape5> out;
  std::stringstream list(text);
  std::string item;
  while (std::getline(list, item, ',')) {
    if (item.empty()) continue;
    std::vector<int64_t> v;
    std::stringstream fields(item);
    std::string field;
    while (std::getline(fields, field, 'x')) {
      try {
        size_t used = 0;
        v.push_back(std::stoll(field, &used));
        XMOE_CHECK(used == field.size() && v.back() > 0, "bad field");
      } catch (const std::exception&) {
        XMOE_FAIL("[bench_moe_layer] --shapes: '{}' is not TxdxfxExk of positive integers", item);
      }
    }
    XMOE_CHECK(v.size() == 5, "[bench_moe_layer] --shapes: '{}' is not TxdxfxExk", item);
    XMOE_CHECK(v[4] <= v[3], "[bench_moe_layer] --shapes: '{}' has k > E", item);
    out.push_back({v[0], v[1], v[2], v[3], v[4]});
  }
  XMOE_CHECK(!out.empty(), "[bench_moe_layer] --shapes: no shape in '{}'", text);
  return out;
}

double layer_flops(const Shape5& s) {
  return 3.0 * 2.0 * static_cast<double>(s.T * s.k) * static_cast<double>(3 * s.d * s.f);
}

struct Variant {
  std::string impl;
  float cf;
};

/// What a line says about the run, whatever its outcome.
nlohmann::ordered_json describe(const Shape5& s, const Variant& v, Device device, bool recompute,
                                int expert_chunks, const std::string& router_dtype,
                                const std::string& expert_grad_dtype, const std::string& weights,
                                const std::string& expert_dtype) {
  nlohmann::ordered_json j;
  j["bench"] = "moe_layer";
  j["impl"] = "xmoe_" + v.impl;
  j["device"] = device.str();
  j["dtype"] = device.is_cuda() ? "bf16" : "f32";
  j["weights"] = weights;
  j["recompute"] = recompute;
  j["expert_chunks"] = expert_chunks;
  j["router_dtype"] = router_dtype;
  j["expert_grad_dtype"] = expert_grad_dtype;
  j["expert_dtype"] = expert_dtype;
  j["shape"] = fmt::format("{}x{}x{}x{}x{}", s.T, s.d, s.f, s.E, s.k);
  j["T"] = s.T;
  j["d"] = s.d;
  j["f"] = s.f;
  j["E"] = s.E;
  j["k"] = s.k;
  j["capacity_factor"] =
      v.impl == "pft" ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(v.cf);
  return j;
}

struct Result {
  double median_ms = 0;
  int64_t peak_bytes = 0;
  int64_t dropped = 0;
  int64_t held_bytes = 0;       // live before a timed pass: parameters, gradients, copies, inputs
  int64_t reserved_bytes = -1;  // CUDA caching allocator, after the timed passes
  std::vector<profiling::Region> regions;  // --breakdown: kProfiledPasses passes, totals
  std::string region_table;
};

constexpr int kProfiledPasses = 2;

Result run(const Shape5& s, const std::string& impl, float cf, int warmup, int iters, Device device,
           bool recompute, int expert_chunks, bool breakdown, const std::string& router,
           const std::string& expert_grad, bool bf16_weights, const std::string& expert_dtype) {
  MoeConfig c;  // softmax_topk (softmax, then top-k, renormalised), aux_loss_weight 0.01
  c.num_experts = static_cast<int>(s.E);
  c.top_k = static_cast<int>(s.k);
  c.expert_hidden = static_cast<int>(s.f);
  c.num_shared_experts = 0;
  c.gate = "softmax_topk";
  c.router_dtype = router;
  c.expert_grad_dtype = expert_grad;
  c.expert_dtype = expert_dtype;
  c.impl = impl;
  c.capacity_factor = cf;
  c.expert_chunks = expert_chunks;
  moe::MoELayer layer(c, s.d, "bench.moe", 1, 0.02f);
  layer.set_recompute(recompute);
  // --weights bf16: the routed experts' weights cast on the host and their f32 master freed
  // (after their host gradient: the host holds the least), before anything goes to the device.
  // On CUDA, values go over; gradients are made zero on the device (no host copy of E·3·d·f
  // floats); f32 matrices get the bf16 compute copies a bf16 model keeps (read by the experts,
  // and by the router with --router-dtype bf16).
  for (Parameter* p : layer.parameters()) {
    const bool bf16_only = bf16_weights && p->kind == ParamKind::expert;
    if (device.is_cpu()) {
      if (bf16_only) p->drop_master_weights(DType::bf16);
      continue;
    }
    const Shape shape = p->grad.shape();
    const DType grad_dtype = p->grad.dtype();
    p->grad = Tensor();
    if (bf16_only) p->drop_master_weights(DType::bf16);
    p->value = p->value.to(device);
    p->grad = Tensor::zeros(shape, grad_dtype, device);
    if (p->value.dim() >= 2 && p->value.dtype() == DType::f32)
      p->compute_copy = ops::cast(p->value, DType::bf16);
  }
  Tensor x = Tensor::empty({s.T, s.d}), dy = Tensor::empty({s.T, s.d});
  fill_normal(x, 2, 0, 1.0f);
  fill_normal(dy, 3, 0, 1.0f);
  if (device.is_cuda()) {  // bf16 activations: the experts run bf16 GEMMs
    x = ops::cast(x.to(device), DType::bf16);
    dy = ops::cast(dy.to(device), DType::bf16);
  }
  // Sequences only matter for the sequence-level balance loss (weight 0 here).
  const int64_t seq_len = s.T % 2048 == 0 ? 2048 : s.T;
  std::vector<double> ms;
  Result r;
  for (int i = 0; i < warmup + iters; ++i) {
    layer.zero_grad();
    backend::synchronize(device);
    r.held_bytes = memory_stats(device).live_bytes;
    PeakMemoryScope scope(device);
    Timer t;
    layer.forward(x, seq_len);
    Tensor dx = layer.backward(dy);
    backend::synchronize(device);  // the pass is done when its kernels are
    const double elapsed = t.millis();
    if (i < warmup) continue;
    ms.push_back(elapsed);
    r.peak_bytes = std::max(r.peak_bytes, scope.extra_peak_bytes());
    r.dropped = layer.dropped_tokens();
  }
  if (device.is_cuda()) r.reserved_bytes = cuda::cache_stats(device.index).reserved_bytes;
  if (breakdown) {
    profiling::reset();
    profiling::enable(true);
    for (int i = 0; i < kProfiledPasses; ++i) {
      layer.zero_grad();
      ProfileScope scope("pass", device);
      layer.forward(x, seq_len);
      Tensor dx = layer.backward(dy);
    }
    profiling::enable(false);
    r.regions = profiling::report();
    r.region_table = profiling::report_table();
  }
  std::sort(ms.begin(), ms.end());
  r.median_ms = ms[ms.size() / 2];
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string device_name = "cpu", shapes_text;
  std::vector<std::string> impls;
  std::vector<float> cfs = {1.0f, 1.25f, 2.0f};
  int iters = 5, warmup = 1;
  bool quick = false, recompute = false, breakdown = false;
  int expert_chunks = 0;
  std::string router_dtype = "f32", expert_grad_dtype = "f32", weights = "f32",
              expert_dtype = "bf16";
  CLI::App app{"Forward + backward of the routed MoE layer: pft vs padded, CPU or CUDA"};
  app.add_option("--device", device_name, "cpu, cuda or cuda:N");
  app.add_option("--shapes", shapes_text, "comma-separated TxdxfxExk (default: by device)");
  app.add_option("--impls", impls, "pft, padded (default: both on the CPU, pft on CUDA)")
      ->delimiter(',');
  app.add_option("--cf", cfs, "capacity factors of the padded runs")->delimiter(',');
  app.add_option("--iters", iters, "timed passes (median)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed passes first")->check(CLI::NonNegativeNumber);
  app.add_flag("--quick", quick, "CPU default shapes at T = 512, at most 3 passes");
  app.add_flag("--recompute", recompute, "recompute h and re-gather the rows in backward");
  app.add_option("--expert-chunks", expert_chunks,
                 "the experts' [N, f] activations in row chunks (model.moe.expert_chunks; 0 auto)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--breakdown", breakdown, "profile 2 more passes by region (JSON lines, table)");
  app.add_option("--router-dtype", router_dtype, "router GEMM operands (model.moe.router_dtype)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--expert-grad-dtype", expert_grad_dtype,
                 "experts' weight gradients (model.moe.expert_grad_dtype)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--weights", weights,
                 "routed experts' weights: f32 master (+ bf16 copies on CUDA) or bf16 only")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--expert-dtype", expert_dtype,
                 "routed experts' forward and data-gradient GEMMs (model.moe.expert_dtype)")
      ->check(CLI::IsMember({"bf16", "fp8"}));
  CLI11_PARSE(app, argc, argv);

  try {
    const Device device = parse_device(device_name);
    std::vector<Shape5> shapes;
    if (!shapes_text.empty()) {
      shapes = parse_shapes(shapes_text);
    } else if (device.is_cuda()) {
      shapes = {{16384, 2048, 1408, 64, 6}, {8192, 7168, 2048, 256, 8}, {8192, 4096, 14336, 8, 2}};
    } else {
      const int64_t T = quick ? 512 : 4096;
      shapes = {{T, 256, 128, 64, 6}, {T, 256, 128, 16, 2}};
    }
    if (quick) iters = std::min(iters, 3);
    if (impls.empty())
      impls = device.is_cuda() ? std::vector<std::string>{"pft"}
                               : std::vector<std::string>{"pft", "padded"};
    for (const std::string& impl : impls)
      XMOE_CHECK(impl == "pft" || impl == "padded",
                 "[bench_moe_layer] --impls: unknown '{}' (pft, padded)", impl);
    const bool with_pft = std::find(impls.begin(), impls.end(), "pft") != impls.end();

    bool failed = false;  // a run failed for a reason other than memory
    for (const Shape5& s : shapes) {
      std::vector<Variant> variants;
      for (const std::string& impl : impls) {
        if (impl == "pft")
          variants.push_back({"pft", 0.f});
        else
          for (float cf : cfs) variants.push_back({"padded", cf});
      }
      Result pft;
      bool have_pft = false;
      for (const Variant& v : variants) {
        nlohmann::ordered_json j = describe(s, v, device, recompute, expert_chunks, router_dtype,
                                            expert_grad_dtype, weights, expert_dtype);
        Result r;  // the layer, its gradients and activations live inside run() only
        const bench::RunStatus status = bench::run_reporting_failure(
            [&] {
              r = run(s, v.impl, v.cf, warmup, iters, device, recompute, expert_chunks, breakdown,
                      router_dtype, expert_grad_dtype, weights == "bf16", expert_dtype);
            },
            j);
        failed = failed || status == bench::RunStatus::error;
        if (device.is_cuda()) cuda::empty_cache(device.index);  // the next run starts clean
        if (status != bench::RunStatus::ok) {
          std::fprintf(stderr, "bench_moe_layer: %s %s: %s\n", j["impl"].get<std::string>().c_str(),
                       j["shape"].get<std::string>().c_str(),
                       j["message"].get<std::string>().c_str());
          std::printf("%s\n", j.dump().c_str());
          std::fflush(stdout);
          continue;
        }
        if (v.impl == "pft") {
          pft = r;
          have_pft = true;
        }
        j["status"] = "ok";
        j["warmup"] = warmup;
        j["iters"] = iters;
        j["median_ms"] = std::round(r.median_ms * 1000) / 1000;
        j["tflops"] = std::round(layer_flops(s) / (r.median_ms / 1e3) / 1e9) / 1e3;
        j["tokens_per_s"] = std::round(static_cast<double>(s.T) / (r.median_ms / 1e3));
        j["peak_extra_bytes"] = r.peak_bytes;
        j["held_bytes"] = r.held_bytes;
        if (r.reserved_bytes >= 0) j["reserved_bytes"] = r.reserved_bytes;
        j["dropped"] = r.dropped;
        if (with_pft && have_pft && v.impl != "pft") {
          j["mem_ratio_vs_pft"] =
              std::round(1000.0 * static_cast<double>(r.peak_bytes) / pft.peak_bytes) / 1000;
          j["time_ratio_vs_pft"] = std::round(1000.0 * r.median_ms / pft.median_ms) / 1000;
        }
        std::printf("%s\n", j.dump().c_str());
        for (const profiling::Region& region : r.regions) {
          nlohmann::ordered_json b;
          b["bench"] = "moe_layer_breakdown";
          b["impl"] = "xmoe_" + v.impl;
          b["T"] = s.T;
          b["d"] = s.d;
          b["f"] = s.f;
          b["E"] = s.E;
          b["k"] = s.k;
          b["region"] = region.path;
          b["calls_per_pass"] = static_cast<double>(region.calls) / kProfiledPasses;
          b["ms_per_pass"] = std::round(1000.0 * region.total_ms / kProfiledPasses) / 1000;
          b["self_ms_per_pass"] = std::round(1000.0 * region.self_ms / kProfiledPasses) / 1000;
          std::printf("%s\n", b.dump().c_str());
        }
        if (breakdown)
          std::fprintf(stderr, "bench_moe_layer: %s, profile of %d passes (totals)\n%s",
                       j["impl"].get<std::string>().c_str(), kProfiledPasses,
                       r.region_table.c_str());
        std::fflush(stdout);
      }
    }
    return failed ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_moe_layer: %s\n", e.what());
    return 1;
  }
  return 0;
}
