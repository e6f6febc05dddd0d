#pragma once
// A run folder (train.out_dir) belongs to one run. It holds config.yaml, metrics.jsonl, the
// step-N/ checkpoints and, while a trainer works in it, the lock file xmoe.lock ("host pid").
// What xmoe promises about it (docs/training.md, "Run folders"):
//   - `train` into a folder that holds a run refuses, naming --resume and --overwrite;
//     --overwrite deletes only xmoe's own files there (config, metrics, checkpoints);
//   - one trainer at a time: a second one is refused while the lock's owner lives;
//   - --resume continues with the run's own config; only keys given again with --set change,
//     each printed, and a change of the model is refused naming the keys.
#include <string>
#include <vector>

#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"

namespace xmoe::train {

inline constexpr const char* kRunLockFile = "xmoe.lock";

/// What a run folder holds of xmoe's own files.
struct RunFolderContents {
  bool has_config = false;
  bool has_metrics = false;
  std::vector<std::string> checkpoints;  ///< step-N (and step-N.old) folder names, by N

  bool holds_run() const { return has_config || has_metrics || !checkpoints.empty(); }
  /// "config.yaml, metrics.jsonl, 3 checkpoints (step-200 ... step-600)".
  std::string describe() const;
};
RunFolderContents inspect_run_folder(const std::string& dir);

/// Exclusive ownership of a run folder by one trainer (rank 0 of a job). Creates `dir` and
/// `dir/xmoe.lock`; a lock left by a dead process of this host is taken over (with a warning).
/// Throws naming the owner's host and pid while it may be alive. Released on destruction.
class RunLock {
 public:
  explicit RunLock(const std::string& dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  std::string path_;
};

/// Makes `dir` ready for a new run: refuses a folder that holds a run unless `overwrite`, which
/// deletes the run's config.yaml, metrics.jsonl and checkpoints (and leaves anything else).
void start_fresh_run(const std::string& dir, bool overwrite);

/// train.keep_checkpoints: deletes the step-N checkpoints of `dir` (and step-N.old) but the
/// `keep` of highest N. Called after a save completes, so the newest is never at risk.
void remove_old_checkpoints(const std::string& dir, int keep);

/// Keeps the lines of `dir/metrics.jsonl` up to `step` (a resumed run logs the steps after its
/// checkpoint again; the lines a crashed run wrote past it would repeat them). Atomic rewrite.
void truncate_metrics(const std::string& dir, int step);

/// The keys (from the key table) whose values differ between `a` and `b`, each as
/// "key: <a's value> -> <b's value>"; only keys starting with `prefix`.
std::vector<std::string> config_differences(const Config& a, const Config& b,
                                            const std::string& prefix = "");

/// The config a `--resume` continues with: the run's own (its latest checkpoint's) with the
/// `--set` overrides applied, validated. `given` is the command line's config (preset or file
/// plus the overrides); it names the run folder (train.out_dir) and, with `given_names_model`
/// (a --preset or --config was given), must describe the run's model. `changes` lists each key
/// the overrides changed; `ignored` the keys where `given` differs from the run but no --set
/// asked for the change.
struct ResumeConfig {
  Config config;
  std::string checkpoint;
  std::vector<std::string> changes;
  std::vector<std::string> ignored;
};
ResumeConfig resume_config(const Config& given, const std::vector<std::string>& overrides,
                           bool given_names_model = false);

/// All ranks of `world` agree on `config` and this binary's version before the first step:
/// a hash is compared over the world; a difference throws on every rank, naming the first key
/// that differs from rank 0's and the ranks that differ. A collective on CPU tensors.
void check_ranks_agree(comm::Group& world, const Config& config);

}  // namespace xmoe::train
