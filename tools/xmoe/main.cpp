// xmoe: the command-line entry point.
//   xmoe train     [--preset P | --config F] [--set key=value ...] [--resume | --overwrite]
//   xmoe generate  --checkpoint DIR --prompt TEXT
//   xmoe prepare   [--corpus PATH...] [--out DIR] [--tokenizer FILE] [--overwrite]
//   xmoe tokenizer train --vocab N --corpus PATH... --out FILE
//   xmoe config    show | presets | keys
//   xmoe inspect   CHECKPOINT
//   xmoe profile   [--out FILE] [--device cpu|cuda] [--quick] [--ranks-per-node N]
//   xmoe export    --checkpoint DIR --format hf --out DIR [--dtype f32|bf16]
//   xmoe import    --hf DIR --out RUN_DIR [--set key=value ...]
//   xmoe plot      RUN_DIR [--out DIR] [--compare RUN_DIR...]
#include <fmt/format.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "config_args.h"
#include "plan_command.h"
#include "plot.h"
#include "profile_command.h"
#include "validators.h"
#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"
#include "xmoe/core/error.h"
#include "xmoe/core/profile.h"
#include "xmoe/data/prepare.h"
#include "xmoe/data/tokenizer.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/generate.h"
#include "xmoe/train/hf.h"
#include "xmoe/train/memory_model.h"
#include "xmoe/train/run_folder.h"
#include "xmoe/train/stop_signal.h"
#include "xmoe/train/trainer.h"

namespace {

using namespace xmoe;
using cli::at_least;
using cli::whole_number;
namespace fs = std::filesystem;
using cli::ConfigArgs;

/// The commands with one example each: `xmoe`, `xmoe --help` and a misspelt command show them.
constexpr const char* kCommands =
    R"(Commands (xmoe COMMAND --help lists a command's flags and their defaults):
  train      Train a model (default: the tiny preset on the built-in English corpus, CPU)
               xmoe train --set train.steps=200 --set train.out_dir=runs/short
  generate   Sample text from a checkpoint
               xmoe generate --checkpoint runs/default --prompt "The meaning of life"
  prepare    Tokenise a text corpus into train.bin / val.bin
               xmoe prepare --corpus my_texts/ --out data/mine
  tokenizer  Train a SentencePiece tokenizer on a corpus
               xmoe tokenizer train --vocab 32768 --corpus my_texts/ --out tok.model
  config     Show the resolved config, the presets, or every key
               xmoe config show --preset moe-1b
  inspect    Verify a checkpoint and list its tensors
               xmoe inspect runs/default/step-600
  profile    Measure this machine's performance models (collectives, expert GEMMs) into a file
               mpirun -np 4 xmoe profile --ranks-per-node 2 --out profile.json
  plan       Rank the parallel layouts of a model on a cluster; write the chosen config
               xmoe plan --preset xmoe-large --cluster frontier --nodes 128 --out chosen.yaml
  export     Write a checkpoint as a Hugging Face model folder (transformers, vLLM)
               xmoe export --checkpoint runs/default --format hf --out hf/default
  import     Start a run folder from a Hugging Face model folder
               xmoe import --hf hf/default --out runs/from-hf
  plot       PNG plots of a run's metrics (loss, lr, grad norm, tokens/s, expert load)
               xmoe plot runs/default
Docs: README.md, docs/training.md, docs/config.md, docs/profile.md, docs/plan.md, docs/ecosystem.md)";

const std::vector<std::string> kCommandNames = {"train",  "generate", "prepare", "tokenizer",
                                                "config", "inspect",  "profile", "plan",
                                                "export", "import",   "plot"};

/// The resolved YAML, the parameter counts and the memory model of a step per rank on `world`
/// ranks (0: the smallest world the config's parallel layout allows).
void print_config(const Config& c, int world) {
  const ParamCount n = count_parameters(c.model);
  std::printf("%s", to_yaml(c).c_str());
  std::printf("# parameters: %.2fM total, %.2fM active per token (embedding %.2fM)\n",
              n.total / 1e6, n.active / 1e6, n.embedding / 1e6);
  train::MemoryModelOptions o;
  o.world = world > 0 ? world : train::smallest_world(c);
  std::printf("%s", train::memory_table(train::predict_memory(c, o)).c_str());
}

void inspect(const std::string& dir) {
  const train::Checkpoint ckpt = train::load_checkpoint(dir);
  std::printf("checkpoint %s (verified: sizes and checksums match the manifest)\n", dir.c_str());
  std::printf("step %d, data position %llu, saved by %d rank(s)\n", ckpt.state.value("step", 0),
              static_cast<unsigned long long>(ckpt.state.value("data_position", 0ull)), ckpt.world);
  int64_t total = 0;
  for (const auto& [name, t] : ckpt.tensors) {
    std::printf("  %-48s %s\n", name.c_str(), t.str().c_str());
    total += static_cast<int64_t>(t.nbytes());
  }
  std::printf("%zu tensors, %.1f MB\n", ckpt.tensors.size(), total / 1e6);
}

/// Makes data paths absolute, so that the run's config (config.yaml, the checkpoints) names
/// the same data from any directory a later --resume or generate starts in.
void absolute_data_paths(Config& c) {
  c.data.dir = fs::absolute(c.data.dir).lexically_normal().string();
  c.data.corpus = fs::absolute(c.data.corpus).lexically_normal().string();
  std::vector<std::string> mix;
  for (const DataMixEntry& e : parse_data_mix(c.data.mix))
    mix.push_back(fmt::format("{}:{}", fs::absolute(e.dir).lexically_normal().string(),
                              e.weight));  // shortest text that round-trips
  c.data.mix = mix;
}

/// `xmoe train`: a fresh run from the command line's config, or (--resume) the run's own
/// config with the --set overrides as changes. Returns the exit code: 0, after a stop signal
/// 128 + its number (train/stop_signal.h), after a failed save with train.on_save_error = stop
/// train::kExitSaveFailed.
int run_train(const ConfigArgs& args, const train::TrainOptions& opts) {
  Config config = args.resolve();
  const bool leader = comm::world()->rank() == 0;
  // A rank's stdout is a pseudo-terminal under mpirun/srun, wherever the job's output goes:
  // log without colour codes there.
  if (comm::launched_by_mpi()) {
    auto plain =
        std::make_shared<spdlog::logger>("xmoe", std::make_shared<spdlog::sinks::stdout_sink_mt>());
    plain->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] %v");  // spdlog's default, without colour
    spdlog::set_default_logger(std::move(plain));
  }
  // Under mpirun/srun only rank 0 talks; the others log warnings and errors.
  if (!leader) spdlog::set_level(spdlog::level::warn);
  absolute_data_paths(config);
  if (opts.resume) {
    // --preset/--config name a model the run must have; without them the defaults name none.
    const bool names_model = !args.preset_name.empty() || !args.config_file.empty();
    const train::ResumeConfig r = train::resume_config(config, args.overrides, names_model);
    config = r.config;
    if (leader) {
      for (const std::string& c : r.changes) spdlog::info("--resume: changed {}", c);
      if (names_model)
        for (const std::string& c : r.ignored)
          spdlog::warn("--resume keeps the run's {} (run -> {}); give it with --set to change it",
                       c, args.config_file.empty() ? "--preset" : "--config");
    }
  }
  const ParamCount n = count_parameters(config.model);
  spdlog::info(
      "model: {:.2f}M parameters ({:.2f}M active), {} layers, {} experts top-{}, run "
      "folder {}",
      n.total / 1e6, n.active / 1e6, config.model.num_layers, config.model.moe.num_experts,
      config.model.moe.top_k, config.train.out_dir);
  const train::TrainResult r = train::train(config, opts);
  if (!r.evals.empty())
    spdlog::info("final validation loss {:.4f} nats/token after {} steps ({:.1f} s); checkpoint {}",
                 r.evals.back().val_loss, r.last_step, r.seconds, r.last_checkpoint);
  // XMOE_PROFILE=1: the regions of the whole run (evaluation passes included), rank 0's.
  if (profiling::enabled() && leader)
    std::fprintf(stderr, "xmoe: profile (XMOE_PROFILE)\n%s", profiling::report_table().c_str());
  if (!r.save_error.empty()) return train::kExitSaveFailed;
  return r.stop_signal ? train::kExitAfterSignalBase + r.stop_signal : 0;
}

/// A first argument that is no command and no flag: name it and the closest command.
bool unknown_command(int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return false;
  const std::string given = argv[1];
  if (std::find(kCommandNames.begin(), kCommandNames.end(), given) != kCommandNames.end())
    return false;
  std::string best = kCommandNames.front();
  for (const std::string& c : kCommandNames)
    if (edit_distance(given, c) < edit_distance(given, best)) best = c;
  std::fprintf(
      stderr, "xmoe: error: unknown command '%s'%s\n\n%s\n", given.c_str(),
      edit_distance(given, best) <= 3 ? fmt::format(" (did you mean '{}'?)", best).c_str() : "",
      kCommands);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"xmoe " XMOE_VERSION
               ": training fine-grained Mixture-of-Experts language models, from one CPU to GPU "
               "clusters"};
  app.set_version_flag("--version", "xmoe " XMOE_VERSION);
  app.option_defaults()->always_capture_default();  // every --help shows the defaults
  app.footer(kCommands);
  app.require_subcommand(1);
  if (argc == 1) {
    std::printf("%s\n", app.help().c_str());
    return 0;
  }
  if (unknown_command(argc, argv)) return 2;

  ConfigArgs train_cfg;
  train::TrainOptions train_opts;
  bool quiet = false;
  auto* train_cmd = app.add_subcommand(
      "train", "Train a model (default: the tiny preset on the built-in English corpus, CPU)");
  train_cfg.add_to(train_cmd);
  train_cmd->add_flag("--resume", train_opts.resume,
                      "Continue the run in train.out_dir from its latest checkpoint, with its "
                      "own config (--set changes keys)");
  train_cmd->add_flag("--overwrite", train_opts.overwrite,
                      "Start over in a train.out_dir that holds a run (deletes its checkpoints, "
                      "metrics and config)");
  train_cmd->add_flag("--quiet", quiet, "No progress line");
  train_cmd
      ->add_option("--stop-after", train_opts.stop_after,
                   "Stop after this step (with a checkpoint), as if interrupted; -1 = "
                   "train.steps; 0 = save the initial weights as step-0")
      ->check(at_least(-1));
  train_cmd->footer(
      "Examples:\n"
      "  xmoe train                                         # tiny preset, runs/default\n"
      "  xmoe train --resume                                # continue runs/default\n"
      "  xmoe train --preset moe-1b --set train.device=cuda --set train.out_dir=runs/moe-1b\n"
      "  mpirun -np 4 xmoe train --set parallel.ep=4 --set train.out_dir=runs/ep4");

  train::GenerateOptions gen;
  std::string gen_checkpoint;
  auto* gen_cmd = app.add_subcommand("generate", "Sample text from a checkpoint");
  gen_cmd->add_option("--checkpoint", gen_checkpoint, "Checkpoint folder or run folder")
      ->required();
  gen_cmd->add_option("--prompt", gen.prompt, "Text to continue");
  gen_cmd->add_option("--tokens", gen.max_new_tokens, "Tokens to sample")
      ->check(whole_number(1, 1 << 20));
  gen_cmd->add_option("--temperature", gen.temperature, "0 = greedy")->check(CLI::Range(0.0, 10.0));
  gen_cmd->add_option("--top-k", gen.top_k, "Sample from the k most likely (0 = all)")
      ->check(at_least(0));
  gen_cmd->add_option("--seed", gen.seed, "Sampling seed")->check(at_least(0));
  gen_cmd->add_option("--tokenizer", gen.tokenizer,
                      "Tokenizer file (default: the one data.dir was prepared with)");
  gen_cmd->footer(
      "Example:\n  xmoe generate --checkpoint runs/default --prompt \"The meaning of "
      "life\" --tokens 200");

  data::PrepareOptions prep;
  prep.corpus = {Config{}.data.corpus};
  prep.out_dir = Config{}.data.dir;
  prep.val_fraction = Config{}.data.val_fraction;
  prep.progress = true;
  double prep_chunk_mb = 4;
  auto* prep_cmd = app.add_subcommand("prepare", "Tokenise a text corpus into train.bin/val.bin");
  prep_cmd->add_option("--corpus", prep.corpus,
                       "Text or .jsonl files and folders of them (several: --corpus a b)");
  prep_cmd->add_option("--out", prep.out_dir, "Output folder");
  prep_cmd
      ->add_option("--val-fraction", prep.val_fraction, "Last fraction of tokens for validation")
      ->check(CLI::Range(0.0, 0.5));
  prep_cmd->add_option("--tokenizer", prep.tokenizer,
                       "SentencePiece .model or Hugging Face tokenizer.json (default: bytes)");
  prep_cmd->add_option("--text-field", prep.text_field, "Field of a .jsonl line holding the text");
  prep_cmd->add_option("--workers", prep.workers, "Tokenising threads (0 = all cores)")
      ->check(at_least(0));
  prep_cmd->add_option("--chunk-mb", prep_chunk_mb, "Text per work item, MB")
      ->check(CLI::Range(0.001, 1024.0));
  prep_cmd->add_flag("--overwrite", prep.overwrite,
                     "Replace token files already in the output folder");
  bool prep_quiet = false;
  prep_cmd->add_flag("--quiet", prep_quiet, "No progress line");
  prep_cmd->footer(
      "Examples:\n  xmoe prepare --corpus my_texts/ --out data/mine\n"
      "  xmoe prepare --corpus web.jsonl books/ --tokenizer tok.model --out data/web\n"
      "  xmoe train --set data.dir=data/mine --set train.out_dir=runs/mine");

  data::SentencePieceTrainOptions tok_train;
  auto* tokenizer_cmd = app.add_subcommand("tokenizer", "Tokenizers");
  tokenizer_cmd->require_subcommand(1);
  auto* tok_train_cmd = tokenizer_cmd->add_subcommand(
      "train", "Train a SentencePiece model on a corpus (libsentencepiece's trainer)");
  tok_train_cmd->add_option("--vocab", tok_train.vocab_size, "Vocabulary size")
      ->required()
      ->check(whole_number(1, 1 << 24));
  tok_train_cmd->add_option("--corpus", tok_train.corpus, "Text or .jsonl files and folders")
      ->required();
  tok_train_cmd->add_option("--out", tok_train.out, "Model file to write (.model)")->required();
  tok_train_cmd->add_option("--model-type", tok_train.model_type, "bpe or unigram")
      ->check(CLI::IsMember({"bpe", "unigram"}));
  tok_train_cmd->add_option("--text-field", tok_train.text_field,
                            "Field of a .jsonl line holding the text");
  tok_train_cmd->footer(
      "Example:\n  xmoe tokenizer train --vocab 32768 --corpus my_texts/ --out data/tok.model\n"
      "  xmoe prepare --corpus my_texts/ --tokenizer data/tok.model --out data/mine");

  ConfigArgs show_cfg;
  auto* config_cmd = app.add_subcommand("config", "Show configurations, presets and keys");
  config_cmd->require_subcommand(1);
  auto* show_cmd =
      config_cmd->add_subcommand("show", "Print the resolved config and parameter counts");
  show_cfg.add_to(show_cmd);
  int show_world = 0;
  show_cmd
      ->add_option("--world", show_world,
                   "Ranks the memory table models (world = data ranks x parallel.tp; parallel.ep "
                   "divides the MoE layers' ranks); 0: the fewest the layout allows")
      ->check(whole_number(0, std::numeric_limits<int>::max()));
  auto* presets_cmd = config_cmd->add_subcommand("presets", "List the presets");
  auto* keys_cmd = config_cmd->add_subcommand("keys", "Print the config reference (Markdown)");
  config_cmd->footer(
      "Examples:\n  xmoe config show --preset moe-1b --set model.moe.top_k=8\n"
      "  xmoe config show --preset moe-1b --set parallel.zero=1 --world 8\n"
      "  xmoe config presets\n  xmoe config keys > keys.md");

  std::string inspect_dir;
  auto* inspect_cmd = app.add_subcommand("inspect", "Verify a checkpoint and list its contents");
  inspect_cmd->add_option("checkpoint", inspect_dir, "Checkpoint folder")->required();
  inspect_cmd->footer("Example:\n  xmoe inspect runs/default/step-600");

  const cli::ProfileCommand profile_cmd(app);
  const cli::PlanCommand plan_cmd(app);

  train::HfExportOptions export_opts;
  std::string export_checkpoint, export_out, export_format = "hf", export_dtype = "f32";
  auto* export_cmd = app.add_subcommand(
      "export", "Write a checkpoint as a Hugging Face model folder (docs/ecosystem.md)");
  export_cmd->add_option("--checkpoint", export_checkpoint, "Checkpoint folder or run folder")
      ->required();
  export_cmd->add_option("--out", export_out, "New folder for the model")->required();
  export_cmd->add_option("--format", export_format, "Output format")->check(CLI::IsMember({"hf"}));
  export_cmd->add_option("--dtype", export_dtype, "Weight dtype")
      ->check(CLI::IsMember({"f32", "bf16"}));
  export_cmd->add_option("--architecture", export_opts.architecture,
                         "auto, Glm4MoeForCausalLM, Ernie4_5_MoeForCausalLM, "
                         "MixtralForCausalLM or LlamaForCausalLM");
  export_cmd
      ->add_option("--max-shard-size", export_opts.max_shard_bytes,
                   "Bytes per safetensors file; above it the weights are sharded with an index")
      ->check(at_least(1));
  export_cmd->footer(
      "Example:\n  xmoe export --checkpoint runs/default --format hf --out hf/default\n"
      "  python3 -c \"import transformers as t; "
      "m = t.AutoModelForCausalLM.from_pretrained('hf/default')\"");

  std::string import_hf_dir, import_out;
  std::vector<std::string> import_overrides;
  auto* import_cmd = app.add_subcommand(
      "import", "Start a run folder from a Hugging Face model folder (docs/ecosystem.md)");
  import_cmd->add_option("--hf", import_hf_dir, "Hugging Face model folder")->required();
  import_cmd->add_option("--out", import_out, "New run folder")->required();
  import_cmd->add_option("--set", import_overrides,
                         "Set a key the model folder does not fix: --set train.lr=1e-4");
  import_cmd->footer(
      "Example:\n  xmoe import --hf hf/default --out runs/from-hf\n"
      "  xmoe train --resume --set train.out_dir=runs/from-hf --set train.steps=200");

  std::string plot_dir, plot_out;
  std::vector<std::string> plot_compare;
  auto* plot_cmd =
      app.add_subcommand("plot", "PNG plots of a run's metrics.jsonl (needs python3, matplotlib)");
  plot_cmd->add_option("run", plot_dir, "Run folder (train.out_dir)")->required();
  plot_cmd->add_option("--out", plot_out, "Folder for the PNGs (default RUN/plots)");
  plot_cmd->add_option("--compare", plot_compare,
                       "Other run folders: compare_loss.png draws every run's loss on one axis");
  plot_cmd->footer(
      "Example:\n  xmoe plot runs/default\n  xmoe plot runs/bf16 --compare runs/fp8 --out plots");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  int exit_code = 0;
  try {
    if (*train_cmd) {
      train_opts.progress = !quiet;
      exit_code = run_train(train_cfg, train_opts);
    } else if (*gen_cmd) {
      std::printf("%s\n", train::generate(gen_checkpoint, gen).c_str());
    } else if (*prep_cmd) {
      prep.chunk_bytes = static_cast<size_t>(prep_chunk_mb * 1e6);
      prep.progress = !prep_quiet;
      const auto r = data::prepare(prep);
      std::printf(
          "prepared %lld train and %lld validation tokens (%s, vocab %lld) from %lld documents "
          "in %zu files (%.1f MB, %.1f MB/s) into %s\n",
          static_cast<long long>(r.train_tokens), static_cast<long long>(r.val_tokens),
          r.dtype.c_str(), static_cast<long long>(r.vocab_size),
          static_cast<long long>(r.documents), r.files.size(), r.bytes / 1e6,
          r.bytes / 1e6 / std::max(r.seconds, 1e-9), prep.out_dir.c_str());
    } else if (*tok_train_cmd) {
      data::train_sentencepiece(tok_train);
      std::printf("wrote %s (SentencePiece %s, vocab %d)\n", tok_train.out.c_str(),
                  tok_train.model_type.c_str(), tok_train.vocab_size);
    } else if (*show_cmd) {
      print_config(show_cfg.resolve(), show_world);
    } else if (*presets_cmd) {
      for (const std::string& name : preset_names())
        std::printf("%-18s %s\n", name.c_str(), preset_description(name).c_str());
    } else if (*keys_cmd) {
      std::printf("%s", config_reference_markdown().c_str());
    } else if (*inspect_cmd) {
      inspect(inspect_dir);
    } else if (*export_cmd) {
      export_opts.dtype = export_dtype == "bf16" ? DType::bf16 : DType::f32;
      const auto r = train::export_hf(export_checkpoint, export_out, export_opts);
      std::printf("exported %s as %s (%s, %.1f MB) into %s: %s\n", r.checkpoint.c_str(),
                  r.architecture.c_str(), export_dtype.c_str(), r.tensor_bytes / 1e6,
                  export_out.c_str(), fmt::format("{}", fmt::join(r.files, ", ")).c_str());
    } else if (*import_cmd) {
      const auto r = train::import_hf(import_hf_dir, import_out, import_overrides);
      std::printf(
          "imported %s (%s) into %s\ncontinue with: xmoe train --resume --set train.out_dir=%s "
          "[--set data.dir=... --set train.steps=...]\n",
          import_hf_dir.c_str(), r.architecture.c_str(), r.checkpoint.c_str(), import_out.c_str());
    } else if (*plot_cmd) {
      for (const std::string& f : cli::plot_run(plot_dir, plot_out, plot_compare))
        std::printf("%s\n", f.c_str());
    } else if (profile_cmd.chosen()) {
      profile_cmd.run();
    } else if (plan_cmd.chosen()) {
      plan_cmd.run();
    }
  } catch (const std::exception& e) {
    const bool ours = dynamic_cast<const xmoe::Error*>(&e) != nullptr;
    // A filesystem error names the operation and the path; say it is one.
    const bool fs_error = dynamic_cast<const fs::filesystem_error*>(&e) != nullptr;
    const char* kind = ours ? "error: " : fs_error ? "file system error: " : "unexpected error: ";
    if (comm::launched_by_mpi()) {
      // One failing rank stops the whole job at once: the others may be waiting in a
      // collective and would otherwise hang. Checkpoints are written atomically, so the last
      // complete one stays intact.
      auto world = comm::world();
      std::fprintf(stderr, "xmoe: rank %d of %d: %s%s\nxmoe: stopping all ranks\n", world->rank(),
                   world->size(), kind, e.what());
      std::fflush(stderr);
      world->abort(1);
    }
    std::fprintf(stderr, "xmoe: %s%s\n", kind, e.what());
    return ours || fs_error ? 1 : 2;
  }
  comm::finalize();
  return exit_code;
}
