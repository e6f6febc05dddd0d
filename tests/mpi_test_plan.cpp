// `xmoe plan`'s predictions against measured runs (docs/plan.md, "How good are the
// predictions"): under mpirun -np 1, 2 and 4 on this machine, a profile measured in the test
// (sched::run_profile, quick, at the model's GEMM and attention shapes) gives the rates; each
// layout (dp, ep, zero, tp with SSMB, recompute, the pipelined MoE layer) is trained for a few
// steps and its measured peak bytes (the allocator's, every rank) and step time (CPU seconds, see
// kStepTimeBound) are compared with the planner's prediction for it.
#include <gtest/gtest.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "testing.h"
#include "training_fixture.h"
#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"
#include "xmoe/plan/planner.h"
#include "xmoe/sched/profiler.h"
#include "xmoe/train/trainer.h"

namespace fs = std::filesystem;
using namespace xmoe;

namespace {

/// Step time is compared with CPU seconds: on this shared 2-core VM (other builds, ranks
/// oversubscribed) wall time measures the other work too, 60-90% above the step's own; the
/// process's CPU time is the step's own work. Measured errors against it: -1..-6% at np 1 and
/// np 4 while the machine was lightly loaded, up to ±25% at load average ~20 (the profile's
/// short timings and the steps then see different caches and clocks). The bound catches a model
/// that is structurally off (a missing term, a wrong unit), not that noise.
constexpr double kStepTimeBound = 0.5;
/// The planner models rank 0 (it holds the most zero shard elements) with the busiest rank's
/// expert rows at --load-imbalance 1.25 times the mean; within 10% there. Another rank's peak
/// moves with its own routing: a fresh router's busiest rank of ep 4 took 10.7% more than
/// predicted in one run (np 4, ep 4), so other ranks are held to 15%.
constexpr double kMemoryBound = 0.10, kOtherRanksMemoryBound = 0.15;

/// The tiny preset at batch 8 on the shared micro corpus, 6 steps, nothing saved.
Config measured_config(const fs::path& root) {
  Config c = xmoe::testing::tiny_on_corpus(root, 6);
  c.train.batch_size = 8;
  c.train.log_every = 100;
  validate(c);
  return c;
}

/// The CPU ranks of this job as a one-node cluster (the profile gives every rate).
plan::Cluster this_machine(int ranks) {
  plan::Cluster c;
  c.name = "this machine";
  c.nodes = 1;
  c.gpus_per_node = ranks;
  c.device = "cpu";
  c.gpu_memory = int64_t{64} << 30;
  c.usable_memory = 1;
  return c;
}

/// The tiny model's GEMM shapes (in x out) for tp 1 and 2: attention projections and scores
/// (head_dim 64, seq 128), dense FFN, router, experts, shared expert, LM head.
std::vector<sched::GemmShape> tiny_gemm_shapes() {
  return {{256, 256},  {256, 128}, {128, 256}, {64, 128}, {128, 64},
          {256, 1024}, {512, 256}, {256, 512}, {256, 16}, {256, 64}};
}

struct Case {
  plan::PlanLayout layout;
  std::string what;
};

/// A layout of micro-batch 8 with everything else at its default.
plan::PlanLayout layout(int tp, int ep, int zero, std::vector<std::string> recompute = {},
                        int moe_chunks = 1) {
  plan::PlanLayout l;
  l.moe_chunks = moe_chunks;
  l.tp = tp;
  l.ep = ep;
  l.dispatch = ep > 1 ? "all_to_all" : "auto";
  l.zero = zero;
  l.recompute = std::move(recompute);
  l.micro_batch = 8;
  return l;
}

std::vector<Case> cases(int n) {
  if (n == 1)
    return {{layout(1, 1, 0), "ep 1"}, {layout(1, 1, 0, {"moe", "router"}), "recompute moe"}};
  // np 2 runs ep 2 pipelined (2 chunks each way); np 4 the unchunked ep layouts.
  if (n == 2)
    return {{layout(1, 2, 1, {}, 2), "ep 2 z1 pipeline 2"}, {layout(1, 1, 2), "dp 2 zero 2"}};
  return {{layout(1, 4, 1), "ep 4 zero 1"},
          {layout(1, 2, 0), "dp 2 ep 2"},
          {layout(2, 2, 0), "tp 2 ssmb ep 2"}};
}

/// This process's CPU seconds (every thread, user and system).
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace

TEST(PlanPredictions, MemoryAndStepTimeMatchMeasuredRuns) {
  auto world = comm::world();
  const int n = world->size(), rank = world->rank();
  if (n != 1 && n != 2 && n != 4) GTEST_SKIP() << "layouts for 1, 2 and 4 ranks";
  const fs::path root = xmoe::testing::shared_corpus(*world, "xmoe-mpi-plan-" + std::to_string(n));
  sched::ProfileOptions po;
  po.quick = true;
  po.gemm_shapes = tiny_gemm_shapes();
  po.attention_shapes = {{64, 128}};
  const plan::Rates rates(this_machine(n), sched::run_profile(world, Device::cpu(), po));
  const Config base = measured_config(root);
  double worst_memory = 0, worst_time = 0;
  for (const Case& k : cases(n)) {
    const plan::Candidate p = plan::evaluate_layout(base, k.layout, rates);
    // CPU seconds per step: a run of 6 steps less one of 2, over 4 (the set-up cancels); the
    // least over the ranks (a rank also spins in MPI while a peer is descheduled).
    Config shorter = p.config;
    shorter.train.steps = 2;
    double start = cpu_seconds();
    xmoe::testing::run_training(shorter, (root / ("short-" + k.layout.str())).string(), world);
    const double cpu_short = cpu_seconds() - start;
    start = cpu_seconds();
    const train::TrainResult r =
        xmoe::testing::run_training(p.config, (root / ("run-" + k.layout.str())).string(), world);
    Tensor per_step = Tensor::from_vector<double>(
        {(cpu_seconds() - start - cpu_short) / (p.config.train.steps - 2)}, {1});
    world->all_reduce(per_step, comm::ReduceOp::min);
    const double cpu_step = per_step.to_vector<double>()[0],
                 wall_step = xmoe::testing::median_step_seconds(r);

    const double memory_err = static_cast<double>(p.memory.peak_bytes - r.peak_step_bytes) /
                              static_cast<double>(r.peak_step_bytes);
    const double time_err = (p.time.total - cpu_step) / cpu_step;
    std::printf("[plan] np %d rank %d %-16s peak predicted %10lld measured %10lld (%+.1f%%)\n", n,
                rank, k.what.c_str(), static_cast<long long>(p.memory.peak_bytes),
                static_cast<long long>(r.peak_step_bytes), 100 * memory_err);
    if (rank == 0) {
      std::printf(
          "[plan] np %d %-16s step predicted %.4f s; measured CPU %.4f s (%+.1f%%), wall %.4f s "
          "(%+.1f%%)\n[plan]   predicted:%s\n",
          n, k.what.c_str(), p.time.total, cpu_step, 100 * time_err, wall_step,
          100 * (p.time.total - wall_step) / wall_step, plan::time_terms(p.time).c_str());
    }
    worst_memory = std::max(worst_memory, std::abs(memory_err));
    worst_time = std::max(worst_time, std::abs(time_err));
    EXPECT_LE(std::abs(memory_err), rank == 0 ? kMemoryBound : kOtherRanksMemoryBound) << k.what;
    EXPECT_LE(std::abs(time_err), kStepTimeBound) << k.what;
  }
  std::printf("[plan] np %d rank %d worst errors: memory %.1f%%, step time (CPU) %.1f%%\n", n, rank,
              100 * worst_memory, 100 * worst_time);
  world->barrier();
  if (rank == 0) fs::remove_all(root);
}
