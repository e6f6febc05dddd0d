// What a checkpoint save costs the training loop, synchronous against train.async_checkpoint,
// on the CPU. For each config, three runs of the same steps: no saves but the final one
// (save_every = 0), a save every `--every` steps written on the trainer's thread, and the same
// saves written on the side thread. Prints one JSON line per run: the seconds the loop waited
// for saves (TrainResult::save_seconds), per save, the checkpoint's bytes, and the run's wall
// seconds per step; and a summary line per config with the ratio. The final save is counted
// with the others: the run waits for it whole in both modes (an async run's last write is not
// hidden), so with few saves per run the async figure tends to the synchronous one.
//   bench_checkpoint [--config tiny|wide] [--steps N] [--every N] [--dir FOLDER]
// tiny: the `tiny` preset (a 79 MB checkpoint: weights and AdamW moments); wide: d_model 512,
// 4 layers, 8 experts of 256, a dense FFN of 1024 (a 200 MB checkpoint). The runs write into --dir
// (default a folder under the system's temporary folder), which the bench removes at the end.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/core/timer.h"
#include "xmoe/data/prepare.h"
#include "xmoe/train/trainer.h"

using namespace xmoe;
namespace fs = std::filesystem;

namespace {

Config bench_config(const std::string& name, const fs::path& dir) {
  Config c = preset("tiny");
  if (name == "wide") {
    for (const char* kv :
         {"model.d_model=512", "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=8",
          "model.dense_hidden=1024", "model.moe.num_experts=8", "model.moe.expert_hidden=256"})
      apply_override(c, kv);
  } else if (name != "tiny") {
    XMOE_FAIL("[bench_checkpoint] --config {}: expected tiny or wide", name);
  }
  c.train.batch_size = 2;
  c.train.seq_len = 64;
  c.train.eval_every = 0;
  c.data.corpus = (dir / "corpus.txt").string();
  c.data.dir = (dir / "data").string();
  return c;
}

int64_t folder_bytes(const fs::path& p) {
  int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(p))
    if (e.is_regular_file()) n += static_cast<int64_t>(e.file_size());
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("bench_checkpoint");
  std::vector<std::string> configs{"tiny", "wide"};
  int steps = 20, every = 2;
  std::string dir_arg;
  app.add_option("--config", configs, "tiny, wide (several: repeat or comma-separate)")
      ->delimiter(',');
  app.add_option("--steps", steps, "steps per run")->check(CLI::PositiveNumber);
  app.add_option("--every", every, "steps between saves")->check(CLI::PositiveNumber);
  app.add_option("--dir", dir_arg, "folder for the runs (removed at the end)");
  CLI11_PARSE(app, argc, argv);
  const fs::path dir =
      dir_arg.empty() ? fs::temp_directory_path() / "xmoe_bench_checkpoint" : fs::path(dir_arg);
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream corpus(dir / "corpus.txt");
    for (int i = 0; i < 4000; ++i)
      corpus << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  try {
    for (const std::string& name : configs) {
      Config base = bench_config(name, dir);
      base.train.steps = steps;
      data::ensure_prepared(base.data);
      double sync_per_save = 0;
      for (const char* mode : {"final_only", "sync", "async"}) {
        Config c = base;
        c.train.out_dir = (dir / (name + "-" + mode)).string();
        c.train.save_every = std::string(mode) == "final_only" ? 0 : every;
        c.train.keep_checkpoints = 1;
        c.train.async_checkpoint = std::string(mode) == "async";
        train::TrainOptions o;
        o.progress = false;
        Timer wall;
        const train::TrainResult r = train::train(c, o);
        const double seconds = wall.seconds();
        const int saves = c.train.save_every > 0 ? steps / every + (steps % every ? 1 : 0) : 1;
        nlohmann::ordered_json j;
        j["bench"] = "checkpoint_save";
        j["config"] = name;
        j["mode"] = mode;
        j["steps"] = r.last_step;
        j["saves"] = saves;
        j["checkpoint_bytes"] = folder_bytes(r.last_checkpoint);
        j["save_wait_s"] = r.save_seconds;
        j["save_wait_ms_per_save"] = r.save_seconds / saves * 1e3;
        j["wall_s_per_step"] = seconds / steps;
        std::printf("%s\n", j.dump().c_str());
        if (std::string(mode) == "sync") sync_per_save = r.save_seconds / saves;
        if (std::string(mode) == "async") {
          nlohmann::ordered_json s;
          s["bench"] = "checkpoint_save_summary";
          s["config"] = name;
          s["sync_ms_per_save"] = sync_per_save * 1e3;
          s["async_ms_per_save"] = r.save_seconds / saves * 1e3;
          s["async_over_sync"] = r.save_seconds / saves / sync_per_save;
          std::printf("%s\n", s.dump().c_str());
        }
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_checkpoint: %s\n", e.what());
    fs::remove_all(dir);
    return 1;
  }
  fs::remove_all(dir);
  return 0;
}
