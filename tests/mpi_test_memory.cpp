// The memory model (train/memory_model.h) per rank under mpirun: for ep = 1 and ep = world and
// parallel.zero 0, 1, 2, and for tensor parallelism (tp 2 and 4, with and without SSMB, with
// ep, zero and optimizer offload), each rank's predicted AdamW moment bytes, gradient bytes
// between steps and offload staging bytes equal what its trainer holds (TrainResult::
// optimizer_bytes, gradient_bytes, offload_staging_bytes, master_bytes), and its live bytes
// between steps and its peak inside a step are those the allocator measured; and the pipelined
// MoE layer's peak over its chunk count.
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

namespace {

fs::path shared_root(comm::Group& world) {
  return xmoe::testing::shared_corpus(world, "xmoe-mpi-memory-" + std::to_string(world.size()));
}

/// The distributed micro run (training_fixture.h) with 12 experts, 2 steps measured, no
/// evaluation or checkpoint.
Config measured_config(const fs::path& root) {
  Config c = xmoe::testing::micro_parallel_config(root, {.experts = 12});
  c.train.steps = 2;
  c.train.eval_every = 0;
  c.train.save_every = 0;
  return c;
}

/// Trains `c` for its steps on every rank and checks this rank's prediction against it.
void expect_predicted(const Config& c, const fs::path& out, const std::string& what) {
  auto world = comm::world();
  const int n = world->size(), rank = world->rank();
  const std::string tag = fmt::format("np {} {} rank {}", n, what, rank);
  const train::MemoryModel m = train::predict_memory(c, {.world = n, .rank = rank});
  const train::TrainResult r = xmoe::testing::run_training(c, out.string(), world);
  EXPECT_EQ(m.optimizer_bytes, r.optimizer_bytes) << tag;
  EXPECT_EQ(m.gradient_bytes, r.gradient_bytes) << tag;
  EXPECT_EQ(m.staging_bytes, r.offload_staging_bytes) << tag;
  EXPECT_EQ(m.parameter_bytes, r.master_bytes) << tag;
  const double steady =
      static_cast<double>(m.steady_bytes - r.steady_bytes) / static_cast<double>(r.steady_bytes);
  const double peak = static_cast<double>(m.peak_bytes - r.peak_step_bytes) /
                      static_cast<double>(r.peak_step_bytes);
  std::printf(
      "[memory] %s: moments %lld, gradients %lld, staging %lld; between steps predicted %lld "
      "measured %lld (%+.2f%%); peak predicted %lld measured %lld (%+.1f%%)\n",
      tag.c_str(), static_cast<long long>(r.optimizer_bytes),
      static_cast<long long>(r.gradient_bytes), static_cast<long long>(r.offload_staging_bytes),
      static_cast<long long>(m.steady_bytes), static_cast<long long>(r.steady_bytes), 100 * steady,
      static_cast<long long>(m.peak_bytes), static_cast<long long>(r.peak_step_bytes), 100 * peak);
  EXPECT_LE(std::abs(steady), 0.01) << tag << "\n" << train::memory_table(m);
  EXPECT_LE(std::abs(peak), 0.10) << tag << "\n" << train::memory_table(m);
}

struct TpLayout {
  int tp = 1, ep = 1;
  bool ssmb = true;
  int zero = 0;
  bool offload = false;
  std::string tag() const {
    return fmt::format("tp {} ep {} {} zero {}{}", tp, ep, ssmb ? "ssmb" : "no-ssmb", zero,
                       offload ? " offload" : "");
  }
};

/// The tensor-parallel layouts of `n` ranks (np 3: none; 3 divides neither the kv heads nor
/// the batch).
std::vector<TpLayout> tp_layouts(int n) {
  if (n == 2)
    return {{2, 1, true}, {2, 1, false}, {2, 2, true, 2}, {2, 1, false, 1}, {2, 2, true, 0, true}};
  if (n == 4)
    return {{2, 1, true}, {2, 2, true, 1}, {2, 2, false, 2},      {2, 1, false, 0, true},
            {4, 1, true}, {4, 1, false},   {4, 4, true, 2, true}, {4, 1, false, 1}};
  return {};
}

}  // namespace

TEST(DistributedMemory, PredictedBytesPerRankMatchTheRun) {
  auto world = comm::world();
  const int n = world->size();
  const fs::path root = shared_root(*world);
  Config c = measured_config(root);
  for (int ep : {1, n}) {
    if (12 % ep != 0) continue;
    c.parallel.ep = ep;
    for (int zero : {0, 1, 2}) {
      c.parallel.zero = zero;
      expect_predicted(c, root / fmt::format("ep{}-z{}", ep, zero),
                       fmt::format("ep {} zero {}", ep, zero));
    }
  }
  world->barrier();
  if (world->rank() == 0) fs::remove_all(root);
}

// train.adam_moments_dtype = bf16: each rank's shard of the bf16 moments (zero 1, 2; offloaded
// at zero 1) as predicted.
TEST(DistributedMemory, Bf16MomentBytesPerRankMatchTheRun) {
  auto world = comm::world();
  const fs::path root = shared_root(*world);
  Config c = measured_config(root);
  c.train.adam_moments_dtype = "bf16";
  for (int zero : {0, 1, 2}) {
    c.parallel.zero = zero;
    c.train.offload_optimizer = zero == 1;
    expect_predicted(c, root / fmt::format("m16-z{}", zero),
                     fmt::format("bf16 moments zero {}{}", zero, zero == 1 ? " offload" : ""));
  }
  world->barrier();
  if (world->rank() == 0) fs::remove_all(root);
}

TEST(DistributedMemory, TensorParallelBytesPerRankMatchTheRun) {
  auto world = comm::world();
  const int n = world->size();
  if (tp_layouts(n).empty()) GTEST_SKIP() << "no tensor-parallel layout of " << n << " ranks";
  const fs::path root = shared_root(*world);
  // 8 query heads over 4 kv heads (tp up to 4), 4 sequences per micro-batch, a dense first
  // layer (tp-split FFN) and an MoE layer with a shared expert.
  Config c = measured_config(root);
  c.model.num_heads = 8;
  c.model.num_kv_heads = 4;
  c.train.batch_size = 4;
  for (const TpLayout& l : tp_layouts(n)) {
    c.parallel.tp = l.tp;
    c.parallel.ep = l.ep;
    c.parallel.ssmb = l.ssmb;
    c.parallel.zero = l.zero;
    c.train.offload_optimizer = l.offload;
    validate(c);
    expect_predicted(
        c, root / fmt::format("tp{}-ep{}-{}-z{}-o{}", l.tp, l.ep, l.ssmb, l.zero, l.offload),
        l.tag());
  }
  world->barrier();
  if (world->rank() == 0) fs::remove_all(root);
}

// The pipelined MoE layer (model.moe.pipeline, docs/pipeline.md "Memory"): its backward makes
// the whole d_rows [N, d] up front and moves one chunk's rows at a time, so its working set
// falls as r grows; unchunked, combine's backward holds the arrived and permuted rows [N', d]
// at once. A layer heavy in routed rows (top-k 8 of 16) makes the MoE backward the step's peak.
// Routing is uneven here (with a fresh router's top-8 of 16 the busiest rank peaks ~10% above
// the prediction at the default 1.25), so the prediction is made at load_imbalance 1.5 and checked
// against the busiest rank within 10%, and its ordering over r against the measured one.
TEST(DistributedMemory, PipelinedMoeLayerBytesFallWithTheChunks) {
  auto world = comm::world();
  const int n = world->size();
  if (n == 1 || 16 % n != 0) GTEST_SKIP() << "ep = np must divide the 16 experts";
  const fs::path root = shared_root(*world);
  Config c = xmoe::testing::tiny_on_corpus(root, 2);
  c.model.num_layers = 2;
  c.model.moe.top_k = 8;
  c.train.batch_size = 8;
  c.parallel.ep = n;
  std::vector<int64_t> predicted, busiest;
  for (const std::string r : {"off", "2", "4"}) {
    c.model.moe.pipeline = r;
    validate(c);
    const train::MemoryModel m = train::predict_memory(c, {.world = n, .load_imbalance = 1.5});
    const train::TrainResult run =
        xmoe::testing::run_training(c, (root / ("pipeline-" + r)).string(), world);
    Tensor peak = Tensor::from_vector<int64_t>({run.peak_step_bytes}, {1});
    world->all_reduce(peak, comm::ReduceOp::max);
    predicted.push_back(m.peak_bytes);
    busiest.push_back(peak.to_vector<int64_t>()[0]);
    const double err =
        static_cast<double>(m.peak_bytes - busiest.back()) / static_cast<double>(busiest.back());
    if (world->rank() == 0)
      std::printf(
          "[memory] np %d ep %d pipeline %s: peak predicted %lld, busiest rank %lld (%+.1f%%)\n", n,
          n, r.c_str(), static_cast<long long>(m.peak_bytes),
          static_cast<long long>(busiest.back()), 100 * err);
    EXPECT_LE(std::abs(err), 0.10) << "pipeline " << r << "\n" << train::memory_table(m);
  }
  EXPECT_GT(predicted[1], predicted[2]);
  EXPECT_GT(busiest[1], busiest[2]);
  world->barrier();
  if (world->rank() == 0) fs::remove_all(root);
}
