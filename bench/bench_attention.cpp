// Causal self-attention forward and backward on a CUDA device, on random inputs, with each bf16
// backend (cuDNN's fused attention; xmoe's own kernels: tensor-core for head_dim 64/128). One JSON
// line per (shape, pass): median ms and TFLOP/s, counting the causal half of the S x S products
// (forward 2 products, backward 2.5x forward, the FlashAttention convention) so figures compare
// with bench/peers/attention_torch.py.
//   bench_attention [--shapes B,S,H,Hkv,hd;...] [--iters N] [--dtype bf16|f32]
//                   [--backends cudnn,native]
#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "timing.h"
#include "xmoe/backend/cuda/kernels.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/rng.h"
#include "xmoe/ops/model_ops.h"

using namespace xmoe;

namespace {

struct AttnShape {
  int64_t b, s, h, hkv, hd;
};

std::vector<AttnShape> parse_shapes(const std::string& text) {
  std::vector<AttnShape> out;
  std::stringstream all(text);
  std::string one;
  while (std::getline(all, one, ';')) {
    AttnShape s{};
    XMOE_CHECK(
        std::sscanf(one.c_str(), "%ld,%ld,%ld,%ld,%ld", &s.b, &s.s, &s.h, &s.hkv, &s.hd) == 5,
        "[bench_attention] --shapes: '{}' is not B,S,H,Hkv,hd", one);
    out.push_back(s);
  }
  return out;
}

Tensor random_tensor(std::vector<int64_t> shape, uint64_t seed, DType dtype, Device device) {
  Tensor t = Tensor::empty(std::move(shape));
  fill_normal(t, seed, 0, 1.0f);
  return t.to(dtype).to(device);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Causal attention forward/backward on CUDA (JSON lines)"};
  std::string shapes_text = "8,2048,16,16,64;4,4096,16,16,128;2,8192,32,8,128";
  std::string dtype_text = "bf16";
  int iters = 10;
  app.add_option("--shapes", shapes_text, "B,S,H,Hkv,hd;...");
  app.add_option("--iters", iters, "timed repetitions (median)")->check(CLI::PositiveNumber);
  app.add_option("--dtype", dtype_text, "bf16 or f32")->check(CLI::IsMember({"bf16", "f32"}));
  std::string backends_text = "cudnn,native";
  app.add_option("--backends", backends_text, "cudnn and/or native, comma-separated");
  CLI11_PARSE(app, argc, argv);
  try {
    XMOE_CHECK(backend::cuda_available(), "[bench_attention] needs a CUDA device");
    const Device dev = Device::cuda(0);
    const DType dt = dtype_text == "bf16" ? DType::bf16 : DType::f32;
    std::vector<cuda::AttentionBackend> backends;
    std::stringstream names(backends_text);
    for (std::string name; std::getline(names, name, ',');) {
      XMOE_CHECK(name == "cudnn" || name == "native",
                 "[bench_attention] --backends: '{}' is not cudnn or native", name);
      backends.push_back(name == "cudnn" ? cuda::AttentionBackend::cudnn
                                         : cuda::AttentionBackend::native);
    }
    for (const AttnShape& s : parse_shapes(shapes_text)) {
      const Tensor q = random_tensor({s.b, s.s, s.h, s.hd}, 1, dt, dev);
      const Tensor k = random_tensor({s.b, s.s, s.hkv, s.hd}, 2, dt, dev);
      const Tensor v = random_tensor({s.b, s.s, s.hkv, s.hd}, 3, dt, dev);
      const Tensor dout = random_tensor({s.b, s.s, s.h, s.hd}, 4, dt, dev);
      const double fwd_flops = 4.0 * s.b * s.h * s.s * s.s * s.hd / 2;  // causal half
      for (const cuda::AttentionBackend backend : backends) {
        cuda::set_attention_backend(backend);
        const std::string impl = cuda::attention_impl(dt, s.b, s.s, s.h, s.hkv, s.hd, true);
        ops::AttentionResult f = ops::attention(q, k, v, true);
        const double fwd =
            1e3 * bench::median_seconds(dev, iters, [&] { f = ops::attention(q, k, v, true); });
        const double bwd = 1e3 * bench::median_seconds(dev, iters, [&] {
                             ops::attention_backward(q, k, v, f.out, f.lse, dout, true);
                           });
        for (auto [pass, ms, flops] :
             {std::tuple{"forward", fwd, fwd_flops}, std::tuple{"backward", bwd, 2.5 * fwd_flops},
              std::tuple{"forward+backward", fwd + bwd, 3.5 * fwd_flops}}) {
          nlohmann::ordered_json j;
          j["bench"] = "attention";
          j["impl"] = "xmoe-" + impl;
          j["dtype"] = dtype_text;
          j["B"] = s.b;
          j["S"] = s.s;
          j["H"] = s.h;
          j["Hkv"] = s.hkv;
          j["hd"] = s.hd;
          j["pass"] = pass;
          j["median_ms"] = ms;
          j["tflops"] = flops / (ms * 1e-3) / 1e12;
          std::printf("%s\n", j.dump().c_str());
          std::fflush(stdout);
        }
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
