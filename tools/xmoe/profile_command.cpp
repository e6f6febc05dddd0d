#include "profile_command.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "validators.h"
#include "xmoe/comm/group.h"
#include "xmoe/comm/nccl/nccl_group.h"
#include "xmoe/core/device.h"
#include "xmoe/core/error.h"
#include "xmoe/sched/profiler.h"

namespace xmoe::cli {

namespace {

namespace fs = std::filesystem;

/// Rank 0's progress on stderr: a bar redrawn in place on a terminal, else a line per tenth.
class ProgressBar {
 public:
  explicit ProgressBar(bool enabled) : enabled_(enabled), tty_(isatty(fileno(stderr)) != 0) {}

  void update(const sched::ProfileProgress& p) {
    if (!enabled_ || p.total <= 0) return;
    const int tenth = 10 * p.done / p.total;
    if (tty_) {
      constexpr int kWidth = 30;
      const int filled = kWidth * p.done / p.total;
      std::fprintf(stderr, "\r[%s%s] %3d/%d %-48.48s", std::string(filled, '#').c_str(),
                   std::string(kWidth - filled, '.').c_str(), p.done, p.total, p.label.c_str());
      if (p.done == p.total) std::fprintf(stderr, "\n");
    } else if (tenth > last_tenth_) {
      std::fprintf(stderr, "profile: %3d%% (%d/%d) %s\n", 10 * tenth, p.done, p.total,
                   p.label.c_str());
    }
    last_tenth_ = tenth;
    std::fflush(stderr);
  }

 private:
  bool enabled_, tty_;
  int last_tenth_ = 0;
};

}  // namespace

ProfileCommand::ProfileCommand(CLI::App& app)
    : cmd_(app.add_subcommand(
          "profile",
          "Measure this machine's performance models (collectives, expert GEMMs) into a file")) {
  cmd_->add_option("--out", out_, "The profile file to write (JSON; docs/profile.md)");
  cmd_->add_option("--device", device_, "Where the tasks run: cpu (MPI) or cuda (NCCL)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd_->add_flag("--quick", quick_, "Small sweeps, fewer repetitions (seconds, for a first look)");
  cmd_->add_option("--ranks-per-node", ranks_per_node_,
                   "Declare nodes of N consecutive ranks (simulates several nodes on one "
                   "machine; 0 = the real nodes)")
      ->check(at_least(0));
  cmd_->add_option("--gemm-shape", gemm_shapes_,
                   "Expert GEMM weight shapes INxOUT (repeatable or comma-separated); default: "
                   "the experts of tiny on the CPU, of moe-1b on CUDA; --quick: 64x128")
      ->delimiter(',')
      ->default_str("CPU 256x256,128x256; CUDA 1024x512,256x1024");
  cmd_->add_option("--attention-shape", attention_shapes_,
                   "Causal attention shapes HEAD_DIMxSEQ_LEN (repeatable or comma-separated); "
                   "default: tiny's on the CPU, moe-1b's on CUDA; --quick: 32x64")
      ->delimiter(',')
      ->default_str("CPU 64x128; CUDA 64x2048");
  cmd_->add_option("--gemm-groups", gemm_groups_, "Experts per grouped GEMM")
      ->check(whole_number(1, 4096));
  cmd_->add_option("--statistic", statistic_,
                   "Per size over the repetitions: median, or min on a machine shared with "
                   "other work")
      ->check(CLI::IsMember({"median", "min"}));
  cmd_->add_flag("--fp8", fp8_,
                 "Also the FP8 experts' GEMMs and row quantiser (for xmoe plan of "
                 "model.moe.expert_dtype = fp8)");
  cmd_->add_flag("--quiet", quiet_, "No progress bar");
  cmd_->footer(
      "Examples:\n"
      "  xmoe profile --quick                                # this CPU, one process\n"
      "  mpirun -np 4 xmoe profile --ranks-per-node 2        # intra- and inter-node models\n"
      "  mpirun -np 8 xmoe profile --device cuda --out h100x8.json\n"
      "  xmoe profile --device cuda --fp8 --out h100-fp8.json  # FP8 experts' GEMMs too");
}

void ProfileCommand::run() const {
  sched::ProfileOptions options;
  options.quick = quick_;
  options.statistic = statistic_;
  for (const std::string& s : gemm_shapes_)
    options.gemm_shapes.push_back(sched::parse_gemm_shape(s, "--gemm-shape"));
  for (const std::string& s : attention_shapes_)
    options.attention_shapes.push_back(sched::parse_attention_shape(s, "--attention-shape"));
  options.gemm_groups = gemm_groups_;
  options.fp8 = fp8_;
  const fs::path out = fs::absolute(out_);
  XMOE_CHECK(fs::is_directory(out.parent_path()),
             "[profile] --out {}: the folder {} does not exist", out_, out.parent_path().string());

  std::shared_ptr<comm::Group> world = comm::world();
  Device device = Device::cpu();
  if (device_ == "cuda") {
    XMOE_CHECK(cuda_device_count() > 0,
               "[profile] --device cuda: no CUDA device is visible (or this xmoe was built "
               "without CUDA)");
    if (world->size() > 1) {
      XMOE_CHECK(comm::nccl::available(),
                 "[profile] --device cuda with {} processes needs NCCL, but this xmoe was built "
                 "without it (XMOE_NCCL=OFF)",
                 world->size());
      world = comm::nccl::make_world();
    }
    device = world->size() > 1 ? world->device() : Device::cuda(0);
  }
  if (ranks_per_node_ > 0) {
    XMOE_CHECK(world->size() % ranks_per_node_ == 0,
               "[profile] --ranks-per-node {} does not divide the {} ranks", ranks_per_node_,
               world->size());
    world = world->with_declared_nodes(ranks_per_node_);
  }
  const bool leader = world->rank() == 0;
  ProgressBar bar(leader && !quiet_);
  options.progress = [&](const sched::ProfileProgress& p) { bar.update(p); };

  const sched::Profile profile = sched::run_profile(world, device, options);
  if (!leader) return;
  const sched::Machine& m = profile.machine;
  std::printf(
      "xmoe profile: %s (%s), %d rank(s), %d node(s) of %d, %s collectives, %s of %d "
      "repetitions, %s\n",
      m.device.c_str(), m.device_name.c_str(), m.world_size, m.nodes, m.ranks_per_node,
      m.backend.c_str(), profile.measurement.statistic.c_str(), profile.measurement.repetitions,
      m.date.c_str());
  if (world->size() == 1)
    std::printf("one rank: no collective to time (run under mpirun for those)\n");
  std::printf("%s", sched::profile_table(profile).c_str());
  size_t heldout = 0;
  for (const sched::TaskModel& t : profile.models) heldout += t.heldout_x.size();
  const double err = profile.heldout_error();
  std::printf(
      "prediction check: median |predicted - measured| / measured over %zu held-out "
      "sizes: %s\n",
      heldout, std::isnan(err) ? "-" : fmt::format("{:.1f}%", 100 * err).c_str());
  sched::save_profile(profile, out.string());
  std::printf("wrote %s (%zu models)\n", out_.c_str(), profile.models.size());
}

}  // namespace xmoe::cli
