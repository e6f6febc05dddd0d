// xmoe: the command-line entry point.
//   xmoe train     [--preset P | --config F] [--set key=value ...] [--resume]
//   xmoe generate  --checkpoint DIR --prompt TEXT
//   xmoe prepare   [--corpus PATH] [--out DIR]
//   xmoe config    show | presets | keys
//   xmoe inspect   CHECKPOINT
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"
#include "xmoe/core/error.h"
#include "xmoe/core/profile.h"
#include "xmoe/data/prepare.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/generate.h"
#include "xmoe/train/trainer.h"

namespace {

using namespace xmoe;

/// --preset / --config / --set, shared by the commands that take a configuration.
struct ConfigArgs {
  std::string preset_name;
  std::string config_file;
  std::vector<std::string> overrides;

  void add_to(CLI::App* cmd) {
    cmd->add_option("--preset", preset_name, "Start from a named preset (xmoe config presets)");
    cmd->add_option("--config", config_file, "YAML config file (may name a preset itself)");
    cmd->add_option("--set", overrides, "Override a key: --set model.moe.top_k=4 (repeatable)");
  }

  Config resolve() const {
    XMOE_CHECK(preset_name.empty() || config_file.empty(),
               "[config] give --preset or --config, not both");
    Config c = !config_file.empty()   ? load_config_file(config_file)
               : !preset_name.empty() ? preset(preset_name)
                                      : preset("tiny");
    for (const std::string& o : overrides) apply_override(c, o);
    validate(c);
    return c;
  }
};

void print_config(const Config& c) {
  const ParamCount n = count_parameters(c.model);
  std::printf("%s", to_yaml(c).c_str());
  std::printf("# parameters: %.2fM total, %.2fM active per token (embedding %.2fM)\n",
              n.total / 1e6, n.active / 1e6, n.embedding / 1e6);
}

void inspect(const std::string& dir) {
  const train::Checkpoint ckpt = train::load_checkpoint(dir);
  std::printf("checkpoint %s (verified: sizes and checksums match the manifest)\n", dir.c_str());
  std::printf("step %d, data position %llu, saved by %d rank(s)\n",
              ckpt.state.value("step", 0),
              static_cast<unsigned long long>(ckpt.state.value("data_position", 0ull)),
              ckpt.world);
  int64_t total = 0;
  for (const auto& [name, t] : ckpt.tensors) {
    std::printf("  %-48s %s\n", name.c_str(), t.str().c_str());
    total += static_cast<int64_t>(t.nbytes());
  }
  std::printf("%zu tensors, %.1f MB\n", ckpt.tensors.size(), total / 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"xmoe: training fine-grained Mixture-of-Experts language models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "xmoe 0.1.0");

  ConfigArgs train_cfg;
  bool resume = false, quiet = false;
  int stop_after = -1;
  auto* train_cmd = app.add_subcommand(
      "train", "Train a model (default: the tiny preset on the built-in English corpus, CPU)");
  train_cfg.add_to(train_cmd);
  train_cmd->add_flag("--resume", resume, "Continue from the latest checkpoint in train.out_dir");
  train_cmd->add_flag("--quiet", quiet, "No progress line");
  train_cmd->add_option("--stop-after", stop_after,
                        "Stop after this step (with a checkpoint), as if interrupted");

  train::GenerateOptions gen;
  std::string gen_checkpoint;
  auto* gen_cmd = app.add_subcommand("generate", "Sample text from a checkpoint");
  gen_cmd->add_option("--checkpoint", gen_checkpoint, "Checkpoint folder or run folder")->required();
  gen_cmd->add_option("--prompt", gen.prompt, "Text to continue");
  gen_cmd->add_option("--tokens", gen.max_new_tokens, "Tokens to sample")->check(CLI::Range(1, 1 << 20));
  gen_cmd->add_option("--temperature", gen.temperature, "0 = greedy")->check(CLI::Range(0.0, 10.0));
  gen_cmd->add_option("--top-k", gen.top_k, "Sample from the k most likely (0 = all)")->check(CLI::NonNegativeNumber);
  gen_cmd->add_option("--seed", gen.seed, "Sampling seed");

  DataConfig prep = Config{}.data;
  auto* prep_cmd = app.add_subcommand("prepare", "Tokenise a text corpus into train.bin/val.bin");
  prep_cmd->add_option("--corpus", prep.corpus, "Text file or folder of text files");
  prep_cmd->add_option("--out", prep.dir, "Output folder");
  prep_cmd->add_option("--val-fraction", prep.val_fraction)->check(CLI::Range(0.0, 0.5));

  ConfigArgs show_cfg;
  auto* config_cmd = app.add_subcommand("config", "Show configurations, presets and keys");
  config_cmd->require_subcommand(1);
  auto* show_cmd = config_cmd->add_subcommand("show", "Print the resolved config and parameter counts");
  show_cfg.add_to(show_cmd);
  auto* presets_cmd = config_cmd->add_subcommand("presets", "List the presets");
  auto* keys_cmd = config_cmd->add_subcommand("keys", "Print the config reference (Markdown)");

  std::string inspect_dir;
  auto* inspect_cmd = app.add_subcommand("inspect", "Verify a checkpoint and list its contents");
  inspect_cmd->add_option("checkpoint", inspect_dir, "Checkpoint folder")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (*train_cmd) {
      const Config config = train_cfg.resolve();
      // Under mpirun/srun only rank 0 talks; the others log warnings and errors.
      if (comm::world()->rank() != 0)
        spdlog::set_level(spdlog::level::warn);
      const ParamCount n = count_parameters(config.model);
      spdlog::info("model: {:.2f}M parameters ({:.2f}M active), {} layers, {} experts top-{}, run folder {}",
                   n.total / 1e6, n.active / 1e6, config.model.num_layers,
                   config.model.moe.num_experts, config.model.moe.top_k, config.train.out_dir);
      train::TrainOptions opts;
      opts.resume = resume;
      opts.progress = !quiet;
      opts.stop_after = stop_after;
      const train::TrainResult r = train::train(config, opts);
      if (!r.evals.empty())
        spdlog::info("final validation loss {:.4f} nats/token after {} steps ({:.1f} s); checkpoint {}",
                     r.evals.back().val_loss, r.last_step, r.seconds, r.last_checkpoint);
      // XMOE_PROFILE=1: the regions of the whole run (evaluation passes included), rank 0's.
      if (profiling::enabled() && comm::world()->rank() == 0)
        std::fprintf(stderr, "xmoe: profile (XMOE_PROFILE)\n%s", profiling::report_table().c_str());
    } else if (*gen_cmd) {
      std::printf("%s\n", train::generate(gen_checkpoint, gen).c_str());
    } else if (*prep_cmd) {
      const auto r = data::prepare(prep.corpus, prep.dir, prep.val_fraction);
      std::printf("prepared %lld train and %lld validation tokens from %zu files into %s\n",
                  static_cast<long long>(r.train_tokens), static_cast<long long>(r.val_tokens),
                  r.files.size(), prep.dir.c_str());
    } else if (*show_cmd) {
      print_config(show_cfg.resolve());
    } else if (*presets_cmd) {
      for (const std::string& name : preset_names())
        std::printf("%-18s %s\n", name.c_str(), preset_description(name).c_str());
    } else if (*keys_cmd) {
      std::printf("%s", config_reference_markdown().c_str());
    } else if (*inspect_cmd) {
      inspect(inspect_dir);
    }
  } catch (const std::exception& e) {
    const bool ours = dynamic_cast<const xmoe::Error*>(&e) != nullptr;
    if (comm::launched_by_mpi()) {
      // One failing rank stops the whole job at once: the others may be waiting in a
      // collective and would otherwise hang. Checkpoints are written atomically, so the last
      // complete one stays intact.
      auto world = comm::world();
      std::fprintf(stderr, "xmoe: rank %d of %d: %s%s\nxmoe: stopping all ranks\n", world->rank(),
                   world->size(), ours ? "error: " : "unexpected error: ", e.what());
      std::fflush(stderr);
      world->abort(1);
    }
    std::fprintf(stderr, "xmoe: %s%s\n", ours ? "error: " : "unexpected error: ", e.what());
    return ours ? 1 : 2;
  }
  comm::finalize();
  return 0;
}
