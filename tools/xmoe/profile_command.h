#pragma once
// `xmoe profile`: measures the performance models of the machine at hand and writes them to a
// JSON file (sched/profiler.h; docs/profile.md).
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace xmoe::cli {

class ProfileCommand {
 public:
  /// Adds the `profile` subcommand and its flags to `app`.
  explicit ProfileCommand(CLI::App& app);
  /// Whether the command line chose `profile`.
  bool chosen() const { return cmd_->parsed(); }
  /// Runs it (collective under mpirun/srun: every rank calls it).
  void run() const;

 private:
  CLI::App* cmd_;
  std::string out_ = "profile.json";
  std::string device_ = "cpu";
  bool quick_ = false;
  bool fp8_ = false;
  bool quiet_ = false;
  std::string statistic_ = "median";
  int ranks_per_node_ = 0;
  std::vector<std::string> gemm_shapes_;
  std::vector<std::string> attention_shapes_;
  long long gemm_groups_ = 8;
};

}  // namespace xmoe::cli
