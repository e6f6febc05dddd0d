#pragma once
// `xmoe plan`: the parallel layouts of a model on a cluster, ranked by predicted tokens/s among
// those that fit, and the chosen one written as a config (src/xmoe/plan/; docs/plan.md).
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "config_args.h"

namespace xmoe::cli {

class PlanCommand {
 public:
  /// Adds the `plan` subcommand and its flags to `app`.
  explicit PlanCommand(CLI::App& app);
  bool chosen() const { return cmd_->parsed(); }
  void run() const;

 private:
  CLI::App* cmd_;
  ConfigArgs config_;
  std::string cluster_;
  int nodes_ = 0;
  std::string profile_;
  int top_ = 10;
  std::string out_;
  int global_batch_ = 0;
  bool no_offload_ = false;
  double load_imbalance_ = 1.25;
  bool largest_ = false;
  std::vector<int> largest_layers_ = {8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64};
  std::vector<int> largest_experts_ = {64, 128, 256, 384, 512, 768, 1024};
};

}  // namespace xmoe::cli
