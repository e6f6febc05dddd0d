// The run folder's rules (train/run_folder.h): one run per folder, one trainer at a time, a
// resume that keeps the run's own config, metrics that do not repeat steps.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "testing.h"
#include "xmoe/config/config.h"
#include "xmoe/io/file.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/run_folder.h"

namespace fs = std::filesystem;
using namespace xmoe;
using xmoe::testing::error_of;
using xmoe::testing::TempDir;

namespace {

std::string host_name() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

/// A checkpoint folder `dir` whose manifest holds `config` (no tensors are needed to resume
/// the config; the trainer reads them later).
void fake_checkpoint(const std::string& dir, const Config& config, int step) {
  nlohmann::json state{{"config", to_yaml(config)}, {"step", step}, {"data_position", 0}};
  train::save_checkpoint(dir, {{"w", Tensor::zeros({2})}}, state);
}

}  // namespace

TEST(RunFolder, ContentsAreDescribed) {
  TempDir tmp;
  EXPECT_FALSE(train::inspect_run_folder(tmp / "missing").holds_run());
  EXPECT_FALSE(train::inspect_run_folder(tmp.str()).holds_run());
  std::ofstream(tmp / "notes.txt") << "mine";
  EXPECT_FALSE(train::inspect_run_folder(tmp.str()).holds_run());  // the user's files are no run
  std::ofstream(tmp / "metrics.jsonl") << "{}\n";
  fs::create_directories(tmp / "step-200");
  fs::create_directories(tmp / "step-1000");
  fs::create_directories(tmp / "step-600");
  const auto c = train::inspect_run_folder(tmp.str());
  EXPECT_TRUE(c.holds_run());
  EXPECT_EQ(c.checkpoints, (std::vector<std::string>{"step-200", "step-600", "step-1000"}));
  EXPECT_EQ(c.describe(), "metrics.jsonl, 3 checkpoints (step-200 ... step-1000)");
}

TEST(RunFolder, AFolderWithARunIsRefusedUnlessOverwritten) {
  TempDir tmp;
  const std::string run = tmp / "run";
  train::start_fresh_run(run, false);  // no folder yet: nothing to refuse
  fs::create_directories(run + "/step-20");
  fs::create_directories(run + "/step-40.tmp-0a1b2c3d");
  std::ofstream(run + "/config.yaml") << "train: {steps: 40}\n";
  std::ofstream(run + "/metrics.jsonl") << "{\"step\": 1}\n";
  std::ofstream(run + "/notes.txt") << "the user's own file";
  const std::string e = error_of([&] { train::start_fresh_run(run, false); });
  EXPECT_CONTAINS(e, "train.out_dir = " + run + " already holds a run");
  EXPECT_CONTAINS(e, "config.yaml, metrics.jsonl, checkpoint step-20");
  EXPECT_CONTAINS(e, "--resume");
  EXPECT_CONTAINS(e, "--overwrite");
  EXPECT_CONTAINS(e, "train.out_dir=");
  EXPECT_TRUE(fs::exists(run + "/step-20"));  // refusing touched nothing

  train::start_fresh_run(run, true);
  EXPECT_FALSE(train::inspect_run_folder(run).holds_run());
  EXPECT_FALSE(fs::exists(run + "/step-40.tmp-0a1b2c3d"));
  EXPECT_TRUE(fs::exists(run + "/notes.txt"));  // only xmoe's files go
}

TEST(RunFolder, LockKeepsASecondTrainerOutAndStaleLocksAreTakenOver) {
  TempDir tmp;
  const std::string run = tmp / "run";
  {
    train::RunLock lock(run);
    const std::string lock_file = run + "/" + train::kRunLockFile;
    ASSERT_TRUE(fs::exists(lock_file));
    EXPECT_CONTAINS(io::read_file(lock_file), std::to_string(::getpid()));
    const std::string e = error_of([&] { train::RunLock second(run); });
    EXPECT_CONTAINS(e, run + " is in use by another trainer");
    EXPECT_CONTAINS(e, "pid " + std::to_string(::getpid()));
    EXPECT_CONTAINS(e, train::kRunLockFile);
  }
  EXPECT_FALSE(fs::exists(run + "/" + train::kRunLockFile));  // released

  // A lock left by a process of this host that has ended is taken over.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  std::ofstream(run + "/" + train::kRunLockFile) << host_name() << " " << child << "\n";
  EXPECT_NO_THROW(train::RunLock taken(run));

  // Another host's lock cannot be checked: refused, saying so.
  std::ofstream(run + "/" + train::kRunLockFile) << "some-other-host 12345\n";
  EXPECT_CONTAINS(error_of([&] { train::RunLock other(run); }), "another host");
}

TEST(RunFolder, UnwritableOrNonFolderOutDirIsNamed) {
  TempDir tmp;
  std::ofstream(tmp / "file") << "x";
  EXPECT_CONTAINS(error_of([&] { train::RunLock l(tmp / "file"); }),
                  "train.out_dir = " + (tmp / "file"));
  EXPECT_CONTAINS(error_of([&] { train::RunLock l(tmp / "file/run"); }),
                  "train.out_dir = " + (tmp / "file/run") + ": cannot create the run folder");
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(tmp / "ro");
    fs::permissions(tmp / "ro", fs::perms::owner_read | fs::perms::owner_exec);
    EXPECT_CONTAINS(error_of([&] { train::RunLock l(tmp / "ro/run"); }), "train.out_dir");
    fs::permissions(tmp / "ro", fs::perms::owner_all);
  }
}

TEST(RunFolder, MetricsAfterTheResumedStepAreDropped) {
  TempDir tmp;
  std::ofstream(tmp / "metrics.jsonl") << "{\"step\": 1, \"loss\": 5}\n"
                                       << "{\"step\": 2, \"loss\": 4}\n"
                                       << "{\"step\": 2, \"val_loss\": 4.5}\n"
                                       << "{\"step\": 3, \"loss\": 3}\n"
                                       << "{\"step\": 4, \"lo";  // a crash mid-line
  train::truncate_metrics(tmp.str(), 2);
  EXPECT_EQ(io::read_file(tmp / "metrics.jsonl"),
            "{\"step\": 1, \"loss\": 5}\n{\"step\": 2, \"loss\": 4}\n"
            "{\"step\": 2, \"val_loss\": 4.5}\n");
  train::truncate_metrics(tmp / "nothing-here", 2);  // no metrics yet: nothing to do

  // Steps past int (tests/fuzz/fuzz_metrics's seeds): dropped, not narrowed to a small step.
  std::ofstream(tmp / "metrics.jsonl") << "{\"step\": 1}\n{\"step\": 4294967297}\n"
                                       << "{\"step\": 18446744073709551615}\n{\"step\": 1.5}\n";
  train::truncate_metrics(tmp.str(), 2);
  EXPECT_EQ(io::read_file(tmp / "metrics.jsonl"), "{\"step\": 1}\n");
}

TEST(RunFolder, ResumeKeepsTheRunsConfigAndAppliesOnlyTheOverrides) {
  TempDir tmp;
  Config run = preset("tiny");
  run.train.out_dir = tmp / "run";
  run.train.steps = 40;
  run.train.lr = 1e-3f;
  run.data.dir = tmp / "my-data";
  fake_checkpoint(tmp / "run/step-20", run, 20);

  // The command line: defaults (another data.dir, lr, steps) plus one override.
  Config given = preset("tiny");
  given.train.out_dir = run.train.out_dir;
  const std::vector<std::string> sets = {"train.steps=80"};
  for (const auto& s : sets) apply_override(given, s);
  const train::ResumeConfig r = train::resume_config(given, sets);
  EXPECT_EQ(r.checkpoint, tmp / "run/step-20");
  EXPECT_EQ(r.config.data.dir, run.data.dir);  // the run's data, not the default
  EXPECT_EQ(r.config.train.lr, 1e-3f);
  EXPECT_EQ(r.config.train.steps, 80);
  EXPECT_EQ(r.changes, (std::vector<std::string>{"train.steps: 40 -> 80"}));
  EXPECT_FALSE(r.ignored.empty());  // data.dir and lr differ from the command line's defaults

  // A model change is refused, naming every key that differs.
  const std::vector<std::string> model_sets = {"model.d_model=128", "model.num_layers=2"};
  Config given_model = given;
  for (const auto& s : model_sets) apply_override(given_model, s);
  const std::string e = error_of([&] { train::resume_config(given_model, model_sets); });
  EXPECT_CONTAINS(e, "model.d_model: 256 -> 128");
  EXPECT_CONTAINS(e, "model.num_layers: 4 -> 2");

  // A --preset/--config that names another model than the run's is refused too; without one,
  // the defaults of the command line name no model.
  Config other = given;
  other.model.d_model = 64;
  EXPECT_NO_THROW(train::resume_config(other, {}, /*given_names_model=*/false));
  EXPECT_CONTAINS(error_of([&] { train::resume_config(other, {}, true); }),
                  "model.d_model: 256 -> 64");

  // No checkpoint: the error names the folder and what it holds.
  given.train.out_dir = tmp / "empty";
  EXPECT_CONTAINS(error_of([&] { train::resume_config(given, {}); }),
                  "no checkpoint in train.out_dir = " + (tmp / "empty"));
}

TEST(RunFolder, ConfigDifferencesNameKeysAndValues) {
  Config a = preset("tiny"), b = a;
  EXPECT_TRUE(train::config_differences(a, b).empty());
  b.train.seed = 7;
  b.model.moe.top_k = 4;
  EXPECT_EQ(train::config_differences(a, b),
            (std::vector<std::string>{"model.moe.top_k: 2 -> 4", "train.seed: 1234 -> 7"}));
  EXPECT_EQ(train::config_differences(a, b, "model."),
            (std::vector<std::string>{"model.moe.top_k: 2 -> 4"}));
}
