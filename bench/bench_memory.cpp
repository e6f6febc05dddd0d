// Bytes per parameter per rank, predicted (train/memory_model.h) and measured (the allocator,
// over real training steps), for parallel.zero 0, 1, 2 on however many ranks mpirun starts:
//   mpirun --oversubscribe -np 8 build/cpu/bin/bench_memory --ep 1
//   mpirun --oversubscribe -np 4 build/cpu/bin/bench_memory --tp 2 --ssmb false
// (`--offload true`: train.offload_optimizer, whose host staging counts here on the CPU;
// `--moments bf16`: train.adam_moments_dtype).
// One JSON line per zero setting from rank 0, with the busiest rank's measurements (max over
// ranks). A small MoE config by default (`--preset`, `--set key=value` change it); the tokens
// are a generated corpus in a temporary folder.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"
#include "xmoe/core/rng.h"
#include "xmoe/data/prepare.h"
#include "xmoe/train/memory_model.h"
#include "xmoe/train/trainer.h"

namespace fs = std::filesystem;
using namespace xmoe;

namespace {

/// The largest of `v` over the world (every rank gets it).
int64_t world_max(comm::Group& world, int64_t v) {
  Tensor t = Tensor::from_vector<int64_t>({v}, {1});
  world.all_reduce(t, comm::ReduceOp::max);
  return t.to_vector<int64_t>()[0];
}

/// Rank 0 writes `bytes` of lowercase words into root/corpus.txt and prepares its tokens.
void make_corpus(comm::Group& world, const fs::path& root, const DataConfig& data, int64_t bytes) {
  if (world.rank() == 0) {
    fs::create_directories(root);
    std::ofstream out(root / "corpus.txt");
    Rng rng(7);
    for (int64_t n = 0; n < bytes;) {
      const int len = 1 + static_cast<int>(rng.below(9));
      for (int i = 0; i < len; ++i) out.put(static_cast<char>('a' + rng.below(26)));
      out.put(rng.below(12) == 0 ? '\n' : ' ');
      n += len + 1;
    }
    out.close();
    data::ensure_prepared(data);
  }
  world.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("bench_memory: bytes per parameter per rank, predicted and measured");
  std::string preset_name = "tiny";
  std::vector<std::string> sets;
  int ep = 1, tp = 1, steps = 2;
  bool ssmb = true, offload = false;
  std::string moments = "f32";
  app.add_option("--preset", preset_name, "Model preset");
  app.add_option("--set", sets, "key=value overrides");
  app.add_option("--ep", ep, "parallel.ep");
  app.add_option("--tp", tp, "parallel.tp");
  app.add_option("--ssmb", ssmb, "parallel.ssmb");
  app.add_option("--offload", offload, "train.offload_optimizer");
  app.add_option("--moments", moments, "train.adam_moments_dtype")
      ->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--steps", steps, "Training steps measured (the max over them)");
  CLI11_PARSE(app, argc, argv);

  auto world = comm::world();
  const int n = world->size(), rank = world->rank();
  Tensor pid = Tensor::from_vector<int64_t>({rank == 0 ? int64_t{::getpid()} : 0}, {1});
  world->broadcast(pid, 0);
  const fs::path root =
      fs::temp_directory_path() / fmt::format("xmoe-bench-memory-{}", pid.to_vector<int64_t>()[0]);

  Config c = preset(preset_name);
  // A small MoE: the tiny preset's shape at batch 4 x 128 per rank.
  c.train.batch_size = 4;
  c.data.corpus = (root / "corpus.txt").string();
  c.data.dir = (root / "data").string();
  c.train.steps = steps;
  c.train.eval_every = 0;
  c.train.save_every = 0;
  c.train.log_every = 1000;
  c.parallel.ep = ep;
  c.parallel.tp = tp;
  c.parallel.ssmb = ssmb;
  c.train.offload_optimizer = offload;
  c.train.adam_moments_dtype = moments;
  for (const std::string& s : sets) apply_override(c, s);
  validate(c);
  make_corpus(*world, root, c.data, 4 << 20);

  for (int zero : {0, 1, 2}) {
    c.parallel.zero = zero;
    c.train.out_dir = (root / fmt::format("run-z{}", zero)).string();
    const train::MemoryModel m = train::predict_memory(c, {.world = n, .rank = rank});
    train::TrainOptions o;
    o.progress = false;
    o.world = world;
    const train::TrainResult r = train::train(c, o);
    // The busiest rank of each measure, and of each prediction (rank 0 holds the most).
    const int64_t peak = world_max(*world, r.peak_step_bytes);
    const int64_t steady = world_max(*world, r.steady_bytes);
    const int64_t opt = world_max(*world, r.optimizer_bytes);
    const int64_t grads = world_max(*world, r.gradient_bytes);
    const int64_t peak_pred = world_max(*world, m.peak_bytes);
    const int64_t steady_pred = world_max(*world, m.steady_bytes);
    const int64_t opt_pred = world_max(*world, m.optimizer_bytes);
    const int64_t grads_pred = world_max(*world, m.gradient_bytes);
    const int64_t staging = world_max(*world, r.offload_staging_bytes);
    const int64_t staging_pred = world_max(*world, m.staging_bytes);
    if (rank != 0) continue;
    const double p = static_cast<double>(m.parameters);
    nlohmann::json j;
    j["bench"] = "memory";
    j["preset"] = preset_name;
    j["world"] = n;
    j["tp"] = m.tp;
    j["ssmb"] = m.ssmb;
    j["dp"] = m.dp;
    j["ep"] = m.ep;
    j["offload"] = m.offload;
    j["moments"] = c.train.adam_moments_dtype;
    j["zero"] = zero;
    j["params_per_rank"] = m.parameters;
    j["tokens_per_rank"] = c.train.batch_size * c.train.seq_len / m.tp;
    j["steady_bytes_per_param"] = {{"predicted", steady_pred / p}, {"measured", steady / p}};
    j["peak_bytes_per_param"] = {{"predicted", peak_pred / p}, {"measured", peak / p}};
    j["optimizer_bytes_per_param"] = {{"predicted", opt_pred / p}, {"measured", opt / p}};
    j["gradient_bytes_per_param"] = {{"predicted", grads_pred / p}, {"measured", grads / p}};
    j["staging_bytes_per_param"] = {{"predicted", staging_pred / p}, {"measured", staging / p}};
    j["peak_bytes"] = {{"predicted", peak_pred}, {"measured", peak}};
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  world->barrier();
  if (rank == 0) fs::remove_all(root);
  comm::finalize();
  return 0;
}
