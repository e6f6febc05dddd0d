// The experts' grouped GEMM alone, bf16 against FP8 (model.moe.expert_dtype; docs/fp8.md), and
// the FP8 quantisers alone: where the FP8 layer's time goes.
//   bench_grouped_gemm [--device cuda] [--shapes RxKxMxG,...] [--iters N]
// A shape is R rows over G equal groups times w [G, K, M] (the experts' gate/up GEMM of moe-1b's
// layer is 98304x1024x512x64). One JSON line per case: grouped_matmul in the compute dtype,
// grouped_matmul_fp8 on operands quantised beforehand (w and w^T, as forward and the data
// gradient read them), quantize_rows_fp8 of x, quantize_weights_fp8 of w; median ms, TFLOP/s
// (GEMMs) or GB/s (quantisers: bytes read and written). On the CPU the compute dtype is f32 and
// the FP8 GEMM is the emulation (dequantise, then f32).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "timing.h"
#include "xmoe/core/rng.h"
#include "xmoe/ops/fp8.h"
#include "xmoe/ops/ops.h"

using namespace xmoe;

namespace {

struct GemmShape {
  int64_t rows, k, m, groups;
};

std::vector<GemmShape> parse_shapes(const std::string& text) {
  std::vector<GemmShape> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    GemmShape s{};
    char x1, x2, x3;
    std::stringstream one(item);
    if (!(one >> s.rows >> x1 >> s.k >> x2 >> s.m >> x3 >> s.groups) || x1 != 'x' || x2 != 'x' ||
        x3 != 'x' || s.rows < 1 || s.k < 1 || s.m < 1 || s.groups < 1)
      throw std::invalid_argument("--shapes: '" + item + "' is not RxKxMxG of positive integers");
    out.push_back(s);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"grouped GEMM: bf16 against FP8, and the FP8 quantisers"};
  std::string device_name = "cpu", shapes_text;
  int iters = 10;
  app.add_option("--device", device_name, "cpu, cuda or cuda:N");
  app.add_option("--shapes", shapes_text, "comma-separated RxKxMxG (default: by device)");
  app.add_option("--iters", iters, "timed runs per case (median)")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    const Device device = parse_device(device_name);
    const std::vector<GemmShape> shapes = !shapes_text.empty() ? parse_shapes(shapes_text)
                                          : device.is_cuda()
                                              ? std::vector<GemmShape>{{98304, 1024, 512, 64},
                                                                       {98304, 2048, 2816, 64},
                                                                       {98304, 1408, 2048, 64},
                                                                       {16384, 4096, 28672, 8}}
                                              : std::vector<GemmShape>{{2048, 256, 256, 8}};
    const DType dtype = device.is_cuda() ? DType::bf16 : DType::f32;
    for (const GemmShape& s : shapes) {
      std::vector<int64_t> sizes(static_cast<size_t>(s.groups), s.rows / s.groups);
      sizes.back() += s.rows % s.groups;
      Tensor x = Tensor::empty({s.rows, s.k}), w = Tensor::empty({s.groups, s.k, s.m});
      fill_normal(x, 1, 0, 1.f);
      fill_normal(w, 2, 0, 0.02f);
      x = ops::cast(x.to(device), dtype);
      w = ops::cast(w.to(device), dtype);
      const ops::Fp8Rows xq = ops::quantize_rows_fp8(x, sizes);
      const ops::Fp8Weights wq = ops::quantize_weights_fp8(w);
      Tensor y = Tensor::empty({s.rows, s.m}, dtype, device);
      const double flops = 2.0 * static_cast<double>(s.rows) * static_cast<double>(s.k * s.m);
      // work per second in `unit`: FLOP/s / 1e12 (GEMMs) or bytes/s / 1e9 (quantisers)
      auto line = [&](std::string_view kind, double sec, double work, const char* unit) {
        const double per = std::string_view(unit) == "tflops" ? 1e12 : 1e9;
        nlohmann::ordered_json j{{"bench", "grouped_gemm"},
                                 {"kind", kind},
                                 {"device", device.str()},
                                 {"shape", fmt::format("{}x{}x{}x{}", s.rows, s.k, s.m, s.groups)},
                                 {"ms", 1e3 * sec},
                                 {unit, work / sec / per}};
        std::printf("%s\n", j.dump().c_str());
        std::fflush(stdout);
      };
      line(dtype_name(dtype),  // the compute dtype
           bench::median_seconds(device, iters, [&] { ops::grouped_matmul_into(y, x, w, sizes); }),
           flops, "tflops");
      line("fp8",
           bench::median_seconds(device, iters, [&] { ops::grouped_matmul_fp8_into(y, xq, wq); }),
           flops, "tflops");
      const double es = static_cast<double>(dtype_size(dtype));
      const double row_bytes = static_cast<double>(s.rows * s.k) * (es + 1);
      line("quantize_rows_fp8",
           bench::median_seconds(device, iters, [&] { (void)ops::quantize_rows_fp8(x, sizes); }),
           row_bytes, "gb_per_s");
      const double weight_bytes = static_cast<double>(s.groups * s.k * s.m) * (es + 2);
      line("quantize_weights_fp8",
           bench::median_seconds(device, iters, [&] { (void)ops::quantize_weights_fp8(w); }),
           weight_bytes, "gb_per_s");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_grouped_gemm: %s\n", e.what());
    return 1;
  }
  return 0;
}
