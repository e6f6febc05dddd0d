// The host AdamW update (the CPU kernel of ops::adamw_step, which train.offload_optimizer runs on
// every parameter each step; docs/training.md, "Optimizer offload"): elements per second and
// the memory bandwidth they imply, for f32 and bf16 gradients, f32 and bf16 moments
// (train.adam_moments_dtype), with and without the bf16 copy the update writes, over the OpenMP
// threads given.
//   bench_adamw [--numel N] [--tensors K] [--steps S] [--threads 1,2,...] [--moments f32,bf16]
// One JSON line per case: numel, threads, grad dtype, moments dtype, bf16 copy, median seconds
// per update, elements/s, GB/s (bytes each element moves: gradient read, w, m, v read and
// written, the bf16 copy written).
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "xmoe/core/timer.h"
#include "xmoe/ops/optim.h"

using namespace xmoe;

int main(int argc, char** argv) {
  CLI::App app{"host AdamW update throughput"};
  int64_t numel = int64_t{64} << 20;
  int tensors = 4, steps = 5;
  std::string threads_list, moments_list = "f32,bf16";
  app.add_option("--numel", numel, "elements updated per step (all tensors together)");
  app.add_option("--tensors", tensors, "tensors they are split into");
  app.add_option("--steps", steps, "timed updates per case (median)");
  app.add_option("--threads", threads_list, "OpenMP thread counts, comma-separated (default: max)");
  app.add_option("--moments", moments_list, "moment dtypes, comma-separated (f32, bf16)");
  CLI11_PARSE(app, argc, argv);
  std::vector<int> thread_counts;
  std::stringstream in(threads_list);
  for (std::string t; std::getline(in, t, ',');)
    if (!t.empty()) thread_counts.push_back(std::stoi(t));
  if (thread_counts.empty()) thread_counts.push_back(omp_get_max_threads());
  std::vector<DType> moment_dtypes;
  std::stringstream moments_in(moments_list);
  for (std::string t; std::getline(moments_in, t, ',');) {
    if (t != "f32" && t != "bf16") {
      std::fprintf(stderr, "--moments: '%s' is not f32 or bf16\n", t.c_str());
      return 2;
    }
    moment_dtypes.push_back(t == "bf16" ? DType::bf16 : DType::f32);
  }

  const int64_t each = numel / tensors;
  std::vector<Tensor> w, m, v, m16, v16, g32, g16, copy;
  for (int i = 0; i < tensors; ++i) {
    w.push_back(Tensor::full({each}, 0.5f));
    m.push_back(Tensor::zeros({each}, DType::f32));
    v.push_back(Tensor::zeros({each}, DType::f32));
    m16.push_back(Tensor::zeros({each}, DType::bf16));
    v16.push_back(Tensor::zeros({each}, DType::bf16));
    g32.push_back(Tensor::full({each}, 1e-3f));
    g16.push_back(g32.back().to(DType::bf16));
    copy.push_back(Tensor::empty({each}, DType::bf16));
  }
  ops::AdamWStep s;
  s.lr = 1e-4f;
  s.bc1 = 0.1f;
  s.bc2 = 0.05f;
  for (int threads : thread_counts) {
    omp_set_num_threads(threads);
    for (DType moments : moment_dtypes)
      for (bool bf16_grad : {false, true}) {
        const bool bf16_moments = moments == DType::bf16;
        for (bool with_copy : {false, true}) {
          std::vector<ops::AdamWTensors> list;
          for (int i = 0; i < tensors; ++i)
            list.push_back({w[i], bf16_grad ? g16[i] : g32[i], bf16_moments ? m16[i] : m[i],
                            bf16_moments ? v16[i] : v[i], with_copy ? copy[i] : Tensor(), true});
          ops::adamw_step(list, s);  // warm-up (first touch)
          std::vector<double> times;
          for (int k = 0; k < steps; ++k) {
            Timer t;
            ops::adamw_step(list, s);
            times.push_back(t.seconds());
          }
          std::sort(times.begin(), times.end());
          const double sec = times[times.size() / 2];
          const double n = static_cast<double>(each * tensors);
          const double bytes =
              (bf16_grad ? 2 : 4) + 8 + (bf16_moments ? 8 : 16) + (with_copy ? 2 : 0);
          nlohmann::json j{{"bench", "adamw_host"},
                           {"numel", each * tensors},
                           {"threads", threads},
                           {"grad", bf16_grad ? "bf16" : "f32"},
                           {"moments", bf16_moments ? "bf16" : "f32"},
                           {"bf16_copy", with_copy},
                           {"seconds", sec},
                           {"elements_per_s", n / sec},
                           {"gb_per_s", n * bytes / sec / 1e9}};
          std::printf("%s\n", j.dump().c_str());
          std::fflush(stdout);
        }
      }
  }
  return 0;
}
