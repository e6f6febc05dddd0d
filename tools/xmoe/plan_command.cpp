#include "plan_command.h"

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>

#include "validators.h"
#include "xmoe/core/error.h"
#include "xmoe/io/file.h"
#include "xmoe/plan/planner.h"
#include "xmoe/sched/perf_model.h"

namespace xmoe::cli {

PlanCommand::PlanCommand(CLI::App& app)
    : cmd_(app.add_subcommand(
          "plan", "Rank the parallel layouts of a model on a cluster by predicted tokens/s")) {
  config_.add_to(cmd_);
  cmd_->add_option("--cluster", cluster_,
                   "dgx-h100, dgx-h200, frontier, or a cluster file (YAML/JSON; docs/plan.md)")
      ->required();
  cmd_->add_option("--nodes", nodes_, "Nodes of the cluster (default: the cluster's)")
      ->check(whole_number(1, 1 << 20));
  cmd_->add_option("--profile", profile_,
                   "A profile from `xmoe profile` (its fitted GEMM and collective models replace "
                   "the cluster's declared rates)");
  cmd_->add_option("--top", top_, "Layouts to print")->check(whole_number(1, 1 << 20));
  cmd_->add_option("--out", out_, "Write the chosen layout's config here (YAML for xmoe train)");
  cmd_->add_option("--global-batch", global_batch_,
                   "Sequences per optimizer step (0: one micro-batch per data rank)")
      ->check(whole_number(0, 1 << 30));
  cmd_->add_flag("--no-offload", no_offload_, "Leave optimizer offload out of the layouts");
  cmd_->add_option("--load-imbalance", load_imbalance_,
                   "The busiest rank's expert rows over the mean (memory and expert time)")
      ->check(CLI::Range(1.0, 64.0));
  cmd_->add_flag("--largest", largest_,
                 "Find the largest model of the preset's family (layers x experts scaled) that "
                 "fits the cluster, and its best layout");
  cmd_->add_option("--largest-layers", largest_layers_, "Layer counts --largest tries")
      ->delimiter(',');
  cmd_->add_option("--largest-experts", largest_experts_, "Expert counts --largest tries")
      ->delimiter(',');
  cmd_->footer(
      "Examples:\n  xmoe plan --preset xmoe-large --cluster frontier --nodes 128 --out "
      "chosen.yaml\n"
      "  xmoe plan --preset tiny --cluster my_cluster.yaml --profile profile.json\n"
      "  xmoe plan --preset xmoe-large --cluster frontier --nodes 128 --largest");
}

void PlanCommand::run() const {
  const Config base = config_.resolve();
  plan::Cluster cluster = plan::resolve_cluster(cluster_);
  if (nodes_ > 0) cluster.nodes = nodes_;
  std::optional<sched::Profile> profile;
  if (!profile_.empty()) profile = sched::load_profile(profile_);
  const plan::Rates rates(cluster, profile);
  plan::PlanOptions options;
  options.global_batch = global_batch_;
  options.offload = !no_offload_;
  options.load_imbalance = load_imbalance_;

  plan::Candidate chosen;
  if (largest_) {
    const plan::LargestModel m =
        plan::largest_model(base, rates, largest_layers_, largest_experts_, options);
    std::printf("# %s\n", plan::describe(cluster).c_str());
    std::printf(
        "largest model that fits: %d layers x %d experts = %.1fB parameters (%.1fB active)\n"
        "layout: %s; %.1f GiB peak per GPU; %.4g s per step; %.4g tokens/s; MFU %.1f%%\n",
        m.layers, m.experts, m.parameters / 1e9, count_parameters(m.best.config.model).active / 1e9,
        m.best.layout.str().c_str(), static_cast<double>(m.best.memory.peak_bytes) / (1 << 30),
        m.best.time.total, m.best.tokens_per_s, 100 * m.best.mfu);
    chosen = m.best;
  } else {
    const plan::Plan p = plan::make_plan(base, rates, options);
    std::printf("%s", plan::plan_table(p, top_).c_str());
    XMOE_CHECK(p.fitting > 0, "[plan] no layout of {} fits {} GiB per GPU", cluster.world(),
               static_cast<double>(cluster.gpu_memory) / (1 << 30));
    chosen = p.candidates.front();
  }
  std::printf("# the chosen step, seconds:%s\n", plan::time_terms(chosen.time).c_str());
  if (!out_.empty()) {
    io::write_file_atomic(out_, plan::chosen_yaml(chosen, cluster));
    std::printf("wrote %s (xmoe train --config %s on %d ranks)\n", out_.c_str(), out_.c_str(),
                chosen.world);
  }
}

}  // namespace xmoe::cli
