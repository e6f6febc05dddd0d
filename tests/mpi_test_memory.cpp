// The memory model (train/memory_model.h) per rank under mpirun: for ep = 1 and ep = world and
// parallel.zero 0, 1, 2, each rank's predicted AdamW moment bytes and gradient bytes between
// steps equal what its trainer holds (TrainResult::optimizer_bytes, gradient_bytes), and its
// live bytes between steps and its peak inside a step are those the allocator measured.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "testing.h"
#include "training_fixture.h"
#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"
#include "xmoe/train/memory_model.h"
#include "xmoe/train/trainer.h"

namespace fs = std::filesystem;
using namespace xmoe;

TEST(DistributedMemory, PredictedBytesPerRankMatchTheRun) {
  auto world = comm::world();
  const int n = world->size(), rank = world->rank();
  const fs::path root =
      xmoe::testing::shared_corpus(*world, "xmoe-mpi-memory-" + std::to_string(n));
  Config c = xmoe::testing::micro_parallel_config(root, {.experts = 12});
  c.train.steps = 2;
  c.train.eval_every = 0;
  c.train.save_every = 0;
  for (int ep : {1, n}) {
    if (12 % ep != 0) continue;
    c.parallel.ep = ep;
    for (int zero : {0, 1, 2}) {
      c.parallel.zero = zero;
      const std::string tag = fmt::format("np {} ep {} zero {} rank {}", n, ep, zero, rank);
      const train::MemoryModel m = train::predict_memory(c, {.world = n, .rank = rank});
      const train::TrainResult r = xmoe::testing::run_training(
          c, (root / fmt::format("ep{}-z{}", ep, zero)).string(), world);
      EXPECT_EQ(m.optimizer_bytes, r.optimizer_bytes) << tag;
      EXPECT_EQ(m.gradient_bytes, r.gradient_bytes) << tag;
      const double steady = static_cast<double>(m.steady_bytes - r.steady_bytes) /
                            static_cast<double>(r.steady_bytes);
      const double peak = static_cast<double>(m.peak_bytes - r.peak_step_bytes) /
                          static_cast<double>(r.peak_step_bytes);
      std::printf(
          "[memory] %s: moments %lld, gradients %lld; between steps predicted %lld measured "
          "%lld (%+.2f%%); peak predicted %lld measured %lld (%+.1f%%)\n",
          tag.c_str(), static_cast<long long>(r.optimizer_bytes),
          static_cast<long long>(r.gradient_bytes), static_cast<long long>(m.steady_bytes),
          static_cast<long long>(r.steady_bytes), 100 * steady,
          static_cast<long long>(m.peak_bytes), static_cast<long long>(r.peak_step_bytes),
          100 * peak);
      EXPECT_LE(std::abs(steady), 0.01) << tag << "\n" << train::memory_table(m);
      EXPECT_LE(std::abs(peak), 0.10) << tag << "\n" << train::memory_table(m);
    }
  }
  world->barrier();
  if (rank == 0) fs::remove_all(root);
}
