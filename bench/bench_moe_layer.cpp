// Forward + backward of the routed MoE layer on the CPU: padding-free token buffers (pft) vs the
// padded [E, C, d] baseline at capacity factors 1.0, 1.25, 2.0. One JSON line per configuration:
// median time, tokens/s, peak activation bytes (allocator counters; parameters and inputs exist
// before the measured scope), dropped (token, slot) pairs, and the padded/pft ratios.
//   bench_moe_layer [--quick] [--iters N]
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "xmoe/core/allocator.h"
#include "xmoe/core/rng.h"
#include "xmoe/core/timer.h"
#include "xmoe/moe/layer.h"

using namespace xmoe;

namespace {

struct Shape5 {
  int64_t T, d, f, E, k;
};

struct Result {
  double median_ms = 0;
  int64_t peak_bytes = 0;
  int64_t dropped = 0;
};

Result run(const Shape5& s, const std::string& impl, float cf, int iters) {
  MoeConfig c;
  c.num_experts = static_cast<int>(s.E);
  c.top_k = static_cast<int>(s.k);
  c.expert_hidden = static_cast<int>(s.f);
  c.num_shared_experts = 0;
  c.gate = "softmax_topk";
  c.impl = impl;
  c.capacity_factor = cf;
  moe::MoELayer layer(c, s.d, "bench.moe", 1, 0.02f);
  Tensor x = Tensor::empty({s.T, s.d}), dy = Tensor::empty({s.T, s.d});
  fill_normal(x, 2, 0, 1.0f);
  fill_normal(dy, 3, 0, 1.0f);
  const int64_t seq_len = std::min<int64_t>(s.T, 512);
  std::vector<double> ms;
  Result r;
  for (int i = 0; i < iters + 1; ++i) {  // the first run warms up (and is not timed)
    layer.zero_grad();
    PeakMemoryScope scope;
    Timer t;
    layer.forward(x, seq_len);
    Tensor dx = layer.backward(dy);
    if (i > 0) ms.push_back(t.millis());
    r.peak_bytes = std::max(r.peak_bytes, scope.extra_peak_bytes());
    r.dropped = layer.dropped_tokens();
  }
  std::sort(ms.begin(), ms.end());
  r.median_ms = ms[ms.size() / 2];
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int iters = 5;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
    } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: bench_moe_layer [--quick] [--iters N]\n");
      return 2;
    }
  }
  const int64_t T = quick ? 512 : 4096;
  if (quick) iters = std::min(iters, 3);
  for (const Shape5& s : {Shape5{T, 256, 128, 64, 6}, Shape5{T, 256, 128, 16, 2}}) {
    const Result pft = run(s, "pft", 0.f, iters);
    struct Variant {
      std::string impl;
      float cf;
    };
    for (const Variant& v : {Variant{"pft", 0.f}, Variant{"padded", 1.0f},
                             Variant{"padded", 1.25f}, Variant{"padded", 2.0f}}) {
      const Result r = v.impl == "pft" ? pft : run(s, v.impl, v.cf, iters);
      nlohmann::ordered_json j;
      j["bench"] = "moe_layer_fwd_bwd";
      j["device"] = "cpu";
      j["T"] = s.T;
      j["d"] = s.d;
      j["f"] = s.f;
      j["E"] = s.E;
      j["k"] = s.k;
      j["impl"] = v.impl;
      j["capacity_factor"] = v.impl == "pft" ? nlohmann::ordered_json(nullptr)
                                              : nlohmann::ordered_json(v.cf);
      j["iters"] = iters;
      j["median_ms"] = std::round(r.median_ms * 100) / 100;
      j["tokens_per_s"] = std::round(static_cast<double>(s.T) / (r.median_ms / 1e3));
      j["peak_activation_bytes"] = r.peak_bytes;
      j["dropped"] = r.dropped;
      j["mem_ratio_vs_pft"] =
          std::round(1000.0 * static_cast<double>(r.peak_bytes) / pft.peak_bytes) / 1000;
      j["time_ratio_vs_pft"] = std::round(1000.0 * r.median_ms / pft.median_ms) / 1000;
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}
