// Distributed training under mpirun equals the single-process run of the same global batch:
// every rank trains with parallel.ep experts-parallel × dp data-parallel, and each rank also
// runs the one-process reference (batch = world × B) itself. f32 throughout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <utility>

#include "testing.h"
#include "training_fixture.h"
#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"
#include "xmoe/data/prepare.h"
#include "xmoe/io/file.h"
#include "xmoe/sched/perf_model.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/run_folder.h"
#include "xmoe/train/trainer.h"

namespace fs = std::filesystem;
using namespace xmoe;
using xmoe::testing::expect_same_losses;
using xmoe::testing::run_training;

namespace {

auto world() {
  return comm::world();
}

/// A corpus and a scratch folder shared by all ranks (created by rank 0).
fs::path shared_root() {
  return xmoe::testing::shared_corpus(*world(),
                                      "xmoe-mpi-train-" + std::to_string(world()->size()));
}

/// The distributed micro run (training_fixture.h); 12 experts divide over ep = 1, 2, 3, 4.
Config micro_config(const fs::path& root, const std::string& gate) {
  return xmoe::testing::micro_parallel_config(root, {.gate = gate, .experts = 12});
}

/// The one-process run of the same global batch, done by every rank for itself.
train::TrainResult reference(const Config& c, const fs::path& root, const std::string& tag) {
  return run_training(xmoe::testing::one_process(c, world()->size()),
                      (root / ("ref-" + tag + "-rank" + std::to_string(world()->rank()))).string(),
                      comm::make_single_group());
}

/// Per-step losses and gradient norms of two runs of one layout that differ only in
/// parallel.zero: the per-element AdamW math is the same, so on the CPU they agree to the bit
/// but for the order of sums (zero 2's reduce-scatter and sharded norm); 1e-6 relative.
/// Returns whether every loss and norm had the same bits.
bool expect_zero_equal(const train::TrainResult& ref, const train::TrainResult& got,
                       size_t ref_offset, const std::string& what, double tol = 1e-6) {
  EXPECT_EQ(ref.steps.size(), ref_offset + got.steps.size()) << what;
  if (ref.steps.size() != ref_offset + got.steps.size()) return false;
  bool bitwise = true;
  for (size_t i = 0; i < got.steps.size(); ++i) {
    const auto &a = ref.steps[ref_offset + i], &b = got.steps[i];
    bitwise = bitwise && a.loss == b.loss && a.grad_norm == b.grad_norm;
    EXPECT_LE(std::fabs(a.loss - b.loss), tol * std::fabs(a.loss)) << what << " step " << b.step;
    EXPECT_LE(std::fabs(a.grad_norm - b.grad_norm), tol * std::fabs(a.grad_norm))
        << what << " grad norm, step " << b.step;
  }
  return bitwise;
}

/// The run `c` with the gradient sync after backward and during it
/// (parallel.overlap_grad_sync): expected bitwise equal, validation losses included.
std::pair<train::TrainResult, train::TrainResult> train_sync_after_and_during_backward(
    Config c, const std::filesystem::path& root, const std::string& base) {
  c.parallel.overlap_grad_sync = false;
  auto after = run_training(c, (root / (base + "-after")).string(), world());
  c.parallel.overlap_grad_sync = true;
  auto during = run_training(c, (root / (base + "-during")).string(), world());
  EXPECT_TRUE(expect_zero_equal(after, during, 0, base, 0.0)) << base << ": not bitwise";
  EXPECT_EQ(after.evals.size(), during.evals.size()) << base;
  for (size_t i = 0; i < std::min(after.evals.size(), during.evals.size()); ++i)
    EXPECT_EQ(after.evals[i].val_loss, during.evals[i].val_loss) << base;
  return {std::move(after), std::move(during)};
}

/// `c` trained to its step-8 checkpoint in `dir` at parallel.zero `saved`, then resumed at
/// `resumed` (and parallel.ep `resumed_ep` when nonzero): the resumed steps against `straight`'s.
void expect_resumed_across_zero(Config c, const std::string& dir, int saved, int resumed,
                                const train::TrainResult& straight, const std::string& what,
                                double tol = 1e-6, int resumed_ep = 0) {
  c.parallel.zero = saved;
  run_training(c, dir, world(), false, 8);
  c.parallel.zero = resumed;
  if (resumed_ep) c.parallel.ep = resumed_ep;
  const auto rest = run_training(c, dir, world(), true);
  ASSERT_EQ(rest.first_step, 8) << what;
  expect_zero_equal(straight, rest, 8, what, tol);
}

/// The micro run for 20 steps (checkpoints every 4).
Config zero_config(const fs::path& root) {
  Config c = micro_config(root, "softmax_topk");
  c.train.steps = 20;
  validate(c);
  return c;
}

}  // namespace

TEST(DistributedTraining, ZeroShardsTheOptimizerAndTrainsTheSame) {
  const fs::path root = shared_root();
  const int n = world()->size();
  Config c = zero_config(root);
  std::vector<int> eps = {1, n};
  if (n == 4) eps.push_back(2);
  for (int ep : eps) {
    const int dp = n / ep;
    c.parallel.ep = ep;
    c.parallel.zero = 0;
    const std::string base = "zero-ep" + std::to_string(ep);
    const auto z0 = run_training(c, (root / (base + "-z0")).string(), world());
    for (int zero : {1, 2}) {
      c.parallel.zero = zero;
      const std::string tag = base + "-z" + std::to_string(zero);
      const auto got = run_training(c, (root / tag).string(), world());
      const bool bitwise = expect_zero_equal(z0, got, 0, tag);
      ASSERT_EQ(got.evals.size(), z0.evals.size());
      for (size_t i = 0; i < got.evals.size(); ++i)
        EXPECT_LE(std::fabs(got.evals[i].val_loss - z0.evals[i].val_loss),
                  1e-6 * z0.evals[i].val_loss)
            << tag;
      // Moment bytes: dense buckets split over the world (n), expert ones over dp; each of
      // the (at most 2) buckets pads less than one element per rank, 8 bytes (m + v) each.
      // (Rank 0 prints; the last rank holds the padding.)
      const int64_t z0b = z0.optimizer_bytes, b = got.optimizer_bytes, pad = 2 * 8 * n;
      EXPECT_GE(b, z0b / n - pad) << tag;  // the last ranks' shards may end in padding
      EXPECT_LE(b, z0b / dp + pad) << tag;
      if (n > 1) {
        EXPECT_LT(b, z0b) << tag;
      }
      // Gradients held between steps: zero 0 and 1 keep every parameter's whole gradient
      // (f32 here); zero 2 none (its shards live from the sync to the update).
      const int64_t g0 = z0.gradient_bytes, g = got.gradient_bytes;
      EXPECT_EQ(g, zero == 1 ? g0 : 0) << tag;
      if (world()->rank() == 0)
        std::printf(
            "[zero] np %d ep %d zero %d: gradients held between steps %lld bytes/rank "
            "(zero 0: %lld)\n",
            n, ep, zero, static_cast<long long>(g), static_cast<long long>(g0));
      if (world()->rank() == 0)
        std::printf(
            "[zero] np %d ep %d dp %d zero %d: AdamW moments %lld bytes/rank (zero 0: "
            "%lld, ratio %.3f); losses and norms %s zero 0's\n",
            n, ep, dp, zero, static_cast<long long>(b), static_cast<long long>(z0b),
            static_cast<double>(b) / static_cast<double>(z0b),
            bitwise ? "bitwise equal to" : "within 1e-6 of");
    }
  }
  world()->barrier();
}

// parallel.overlap_grad_sync: zero 2 starting each bucket's reduce-scatter during backward
// (small buckets, so that there are many) trains with the bits of the same run that starts them
// all after backward, with and without ep and with gradient accumulation; its step peak falls
// below zero 1's, which keeps every whole gradient through backward.
TEST(DistributedTraining, ZeroTwoOverlappedWithBackwardTrainsBitForBitAndPeaksLower) {
  const fs::path root = shared_root();
  const int n = world()->size();
  Config c = zero_config(root);
  c.train.steps = 8;
  c.parallel.bucket_kib = 4;
  for (int ep : {1, n}) {
    for (int accum : {1, 2, 3}) {
      c.parallel.ep = ep;
      c.train.grad_accum = accum == 3 ? 1 : accum;
      // 3: one micro-batch, 6 layers, attention and MoE recomputed: the saved activations are
      // small, and the peak moves to the end of backward, where whole gradients piled up.
      c.model.num_layers = accum == 3 ? 6 : 2;
      c.model.recompute =
          accum == 3 ? std::vector<std::string>{"attention", "moe"} : std::vector<std::string>{};
      const std::string base = fmt::format("overlap-ep{}-accum{}", ep, accum);
      c.parallel.zero = 1;
      const auto z1 = run_training(c, (root / (base + "-z1")).string(), world());
      c.parallel.zero = 2;
      const auto [after, during] = train_sync_after_and_during_backward(c, root, base);
      EXPECT_EQ(after.gradient_bytes, during.gradient_bytes) << base;
      // Whole gradients exist from their module's backward on (accumulation: to the last
      // micro-batch's), and no longer than to their bucket's start, where a packed copy of
      // them runs the reduce-scatter instead.
      if (accum != 2) {
        EXPECT_LT(after.peak_step_bytes, z1.peak_step_bytes) << base;
      }
      if (accum == 3 && ep == 1) {  // (with ep = n the experts' gradients are smaller)
        EXPECT_LT(during.peak_step_bytes, after.peak_step_bytes) << base;
      }
      auto mean_step = [](const train::TrainResult& r) {
        double s = 0;
        for (size_t i = 1; i < r.steps.size(); ++i) s += r.steps[i].seconds;
        return 1e3 * s / static_cast<double>(r.steps.size() - 1);
      };
      if (world()->rank() == 0)
        std::printf(
            "[overlap] np %d ep %d accum %d: step peak zero 1 %lld, zero 2 after backward %lld, "
            "overlapped %lld bytes; step %.2f / %.2f / %.2f ms; bitwise equal\n",
            n, ep, accum, static_cast<long long>(z1.peak_step_bytes),
            static_cast<long long>(after.peak_step_bytes),
            static_cast<long long>(during.peak_step_bytes), mean_step(z1), mean_step(after),
            mean_step(during));
    }
  }
  world()->barrier();
}

// parallel.overlap_grad_sync at every zero level: each bucket's all-reduce (zero 2: reduce-
// scatter) starting during backward trains with the bits of the run that starts them all after
// backward; and parallel.grad_partition = auto (dense buckets along backward's modules, without a
// profile and from one) with the bits of off at zero 0 and 1 (the in-place all-reduce sums each
// element in the same order wherever it sits in a bucket), within 1e-6 at zero 2 (other shards,
// so the norm adds its pieces in another order).
TEST(DistributedTraining, OverlappedAndPartitionedGradientSyncTrainBitForBit) {
  const fs::path root = shared_root();
  const int n = world()->size();
  Config c = zero_config(root);
  c.train.steps = 10;
  c.train.eval_every = 5;
  c.parallel.bucket_kib = 4;
  // A profile whose all-reduce start-up makes pieces of several modules (sched/grad_partition.h).
  sched::Profile profile;
  profile.machine.world_size = n;
  profile.measurement = {.statistic = "median", .warmup = 1, .repetitions = 3};
  auto model = [](sched::Task task, double alpha, double beta) {
    sched::TaskModel m;
    m.task = task;
    m.dtype = "f32";
    m.ranks = sched::is_collective(task) ? 2 : 1;
    m.in = m.out = m.groups = sched::is_gemm(task) ? 64 : 0;
    m.width = task == sched::Task::gather_rows || task == sched::Task::scatter_rows ? 64 : 0;
    m.x = {1024, 4096};
    for (double x : m.x) m.t.push_back(alpha + beta * x);
    m.fit = sched::fit_linear(m.x, m.t, std::string(sched::task_unit(task)));
    return m;
  };
  profile.models = {
      model(sched::Task::all_reduce, 2e-4, 1e-9), model(sched::Task::all_to_all_v, 2e-5, 1e-9),
      model(sched::Task::gather_rows, 1e-6, 1e-10), model(sched::Task::scatter_rows, 1e-6, 1e-10)};
  for (sched::Task t : {sched::Task::gemm_forward, sched::Task::gemm_backward_data,
                        sched::Task::gemm_backward_weight})
    profile.models.push_back(model(t, 5e-6, 1e-10));
  const std::string profile_path = (root / "partition-profile.json").string();
  if (world()->rank() == 0) sched::save_profile(profile, profile_path);
  world()->barrier();
  for (int ep : {1, n}) {
    c.parallel.ep = ep;
    for (int zero : {0, 1, 2}) {
      c.parallel.zero = zero;
      c.parallel.grad_partition = "off";
      c.model.moe.pipeline_profile = "";
      const std::string base = fmt::format("sync-ep{}-z{}", ep, zero);
      const auto [after, during] = train_sync_after_and_during_backward(c, root, base);
      c.parallel.grad_partition = "auto";  // no profile: one piece per module
      const auto modules = run_training(c, (root / (base + "-modules")).string(), world());
      c.model.moe.pipeline_profile = profile_path;
      const auto fitted = run_training(c, (root / (base + "-fitted")).string(), world());
      const double tol = zero == 2 ? 1e-6 : 0.0;
      EXPECT_TRUE(expect_zero_equal(after, modules, 0, base + "-modules", tol) || zero == 2);
      const bool bitwise = expect_zero_equal(after, fitted, 0, base + "-fitted", tol);
      EXPECT_TRUE(bitwise || zero == 2) << base << ": not bitwise";
      if (world()->rank() == 0)
        std::printf(
            "[grad sync] np %d ep %d zero %d: overlapped bitwise equal; partitioned (per module, "
            "fitted) %s\n",
            n, ep, zero, bitwise ? "bitwise equal" : "within 1e-6");
    }
  }
  world()->barrier();
}

// train.offload_optimizer with parallel.zero: each rank offloads its shard of the optimizer
// only (the pieces its AdamW owns), and trains with the bits of the same zero setting without
// offload.
TEST(DistributedTraining, OffloadWithZeroTrainsBitForBitLikeWithout) {
  const fs::path root = shared_root();
  const int n = world()->size();
  Config c = zero_config(root);
  for (int zero : {1, 2}) {
    c.parallel.zero = zero;
    c.train.offload_optimizer = false;
    const std::string tag = "offload-z" + std::to_string(zero);
    const auto plain = run_training(c, (root / (tag + "-plain")).string(), world());
    c.train.offload_optimizer = true;
    const auto off = run_training(c, (root / tag).string(), world());
    EXPECT_TRUE(expect_zero_equal(plain, off, 0, tag, 0.0)) << tag << ": not bitwise";
    EXPECT_EQ(off.optimizer_bytes, plain.optimizer_bytes) << tag;
    EXPECT_GT(off.offload_staging_bytes, 0) << tag;
    // The staged gradients are this rank's shard (4 bytes per element, f32 gradients here),
    // not the whole model's: the moments (8 bytes per element) are twice their bytes.
    EXPECT_EQ(2 * off.offload_staging_bytes, off.optimizer_bytes) << tag;
    if (world()->rank() == 0)
      std::printf("[offload] np %d zero %d: %lld staged bytes/rank, losses bitwise equal\n", n,
                  zero, static_cast<long long>(off.offload_staging_bytes));
  }
  world()->barrier();
}

// train.adam_moments_dtype = bf16 with parallel.zero: each rank's shard of the bf16 moments is
// updated element by element as zero 0 updates the whole ones, so zero 1 and 2 train as zero 0
// does (as with f32 moments: bitwise but for zero 2's order of sums, 1e-6), with half the
// moment bytes of f32; offloaded, the bits of the same setting without offload. A zero 2
// checkpoint (the shards gathered widened to f32) resumed with zero 0 repeats the straight run.
TEST(DistributedTraining, Bf16MomentsShardAndResumeLikeZeroZero) {
  const fs::path root = shared_root();
  const int n = world()->size();
  Config c = zero_config(root);
  c.parallel.ep = 1;  // dp = world: every bucket sharded over all ranks
  c.train.adam_moments_dtype = "bf16";
  const auto z0 = run_training(c, (root / "m16-z0").string(), world());
  c.train.adam_moments_dtype = "f32";
  const auto f32 = run_training(c, (root / "m32-z0").string(), world());
  EXPECT_EQ(2 * z0.optimizer_bytes, f32.optimizer_bytes);
  EXPECT_NE(z0.steps.back().loss, f32.steps.back().loss);  // the bf16 moments did run
  c.train.adam_moments_dtype = "bf16";
  for (int zero : {1, 2}) {
    c.parallel.zero = zero;
    const std::string tag = "m16-z" + std::to_string(zero);
    const auto got = run_training(c, (root / tag).string(), world());
    const bool bitwise = expect_zero_equal(z0, got, 0, tag, zero == 1 ? 0.0 : 1e-6);
    // Half of f32 zero 0's bytes split over the ranks, each bucket padded by less than one
    // element (4 bytes of m + v) per rank.
    EXPECT_GE(got.optimizer_bytes, z0.optimizer_bytes / n - 2 * 4 * n) << tag;
    EXPECT_LE(got.optimizer_bytes, z0.optimizer_bytes / n + 2 * 4 * n) << tag;
    c.train.offload_optimizer = true;
    const auto off = run_training(c, (root / (tag + "-offload")).string(), world());
    c.train.offload_optimizer = false;
    EXPECT_TRUE(expect_zero_equal(got, off, 0, tag + " offloaded", 0.0)) << tag;
    EXPECT_EQ(off.optimizer_bytes, got.optimizer_bytes) << tag;
    if (world()->rank() == 0)
      std::printf(
          "[bf16 moments] np %d zero %d: AdamW moments %lld bytes/rank (zero 0: %lld, f32 zero "
          "0: %lld); losses and norms %s zero 0's, offloaded bitwise equal\n",
          n, zero, static_cast<long long>(got.optimizer_bytes),
          static_cast<long long>(z0.optimizer_bytes), static_cast<long long>(f32.optimizer_bytes),
          bitwise ? "bitwise equal to" : "within 1e-6 of");
  }
  expect_resumed_across_zero(c, (root / "m16-z2-then-z0").string(), 2, 0, z0,
                             "bf16 moments, zero 2 resumed with zero 0");
  world()->barrier();
}

TEST(DistributedTraining, ZeroCheckpointsResumeAcrossZeroSettings) {
  const fs::path root = shared_root();
  const int n = world()->size();
  Config c = zero_config(root);
  c.parallel.ep = 1;  // dp = world: every bucket sharded over all ranks
  const auto straight = run_training(c, (root / "zero-straight").string(), world());
  // A zero 2 checkpoint (moments gathered to whole tensors) resumed with zero 0 ...
  expect_resumed_across_zero(c, (root / "zero-2-then-0").string(), 2, 0, straight,
                             "zero 2 resumed with zero 0");
  // ... and a zero 0 checkpoint resumed with zero 2 (each rank takes its shard).
  expect_resumed_across_zero(c, (root / "zero-0-then-2").string(), 0, 2, straight,
                             "zero 0 resumed with zero 2");
  // A zero 2 checkpoint of dp = world resumed at dp = 1 (ep = world) with zero 1: another
  // layout, so the sums of the expert gradients run in another order (1e-5, as elsewhere).
  if (n > 1)
    expect_resumed_across_zero(c, (root / "zero-2-then-ep").string(), 2, 1, straight,
                               "zero 2 dp=world resumed with zero 1 ep=world", 1e-5, n);
  world()->barrier();
}

TEST(DistributedTraining, MatchesOneProcessForEveryLayout) {
  const fs::path root = shared_root();
  const int n = world()->size();
  for (const std::string gate : {"softmax_topk", "sigmoid"}) {
    Config c = micro_config(root, gate);
    const auto ref = reference(c, root, gate);
    std::vector<int> eps = {n, 1};
    if (n == 4) eps.push_back(2);
    for (int ep : eps) {
      c.parallel.ep = ep;
      const std::string tag = gate + "-ep" + std::to_string(ep);
      const auto got = run_training(c, (root / tag).string(), world());
      ASSERT_EQ(got.steps.size(), ref.steps.size());
      expect_same_losses(ref, got, 0, tag);
      ASSERT_EQ(got.evals.size(), ref.evals.size());
      for (size_t i = 0; i < got.evals.size(); ++i)
        EXPECT_LE(std::fabs(got.evals[i].val_loss - ref.evals[i].val_loss),
                  1e-5 * ref.evals[i].val_loss)
            << tag;
    }
  }
  world()->barrier();
}

// train.offload_delayed_update_from over data-parallel ranks: each rank's host update of the
// all-reduced gradients runs beside its next step, as in one process, so the run follows the
// one-process delayed run of the global batch. Its first N + 2 steps are the plain offloaded
// run's bit for bit: update N + 1 = 4 is the first delayed one, but the step-4 checkpoint
// publishes it, so the delay first shows at step 6 (update 5 unseen).
TEST(DistributedTraining, DelayedOffloadUpdateMatchesOneProcess) {
  const fs::path root = shared_root();
  const int n = world()->size();
  Config c = micro_config(root, "softmax_topk");
  c.train.offload_optimizer = true;
  c.train.offload_overlap = true;
  constexpr int kFrom = 3;
  c.train.offload_delayed_update_from = kFrom;
  validate(c);
  const auto ref = reference(c, root, "delayed");
  for (int ep : {n, 1}) {
    c.parallel.ep = ep;
    c.train.offload_delayed_update_from = kFrom;
    const std::string tag = "delayed-ep" + std::to_string(ep);
    const auto got = run_training(c, (root / tag).string(), world());
    ASSERT_EQ(got.steps.size(), ref.steps.size()) << tag;
    expect_same_losses(ref, got, 0, tag);
    EXPECT_GT(got.delayed_update_bytes, 0) << tag;
    c.train.offload_delayed_update_from = -1;
    const auto plain = run_training(c, (root / (tag + "-plain")).string(), world());
    ASSERT_EQ(c.train.save_every, kFrom + 1);
    for (size_t i = 0; i <= kFrom + 1; ++i)
      EXPECT_EQ(got.steps[i].loss, plain.steps[i].loss) << tag << " step " << i + 1;
    EXPECT_NE(got.steps[kFrom + 2].loss, plain.steps[kFrom + 2].loss) << tag << ": no delay";
  }
  world()->barrier();
}

// data.mix over data-parallel ranks: each rank its windows of the mixed global batch, so the run
// (and the per-folder validation) equals the one-process run; a second folder is prepared from
// the corpus's second half.
TEST(DistributedTraining, WeightedMixMatchesOneProcess) {
  const fs::path root = shared_root();
  if (world()->rank() == 0) {
    fs::create_directories(root / "corpus-b");
    const std::string text = io::read_file((root / "corpus" / "text.txt").string());
    io::write_file_atomic((root / "corpus-b" / "text.txt").string(), text.substr(text.size() / 2));
    if (!fs::exists(root / "data-b" / "meta.json"))
      data::prepare((root / "corpus-b").string(), (root / "data-b").string(), 0.1);
  }
  world()->barrier();
  Config c = micro_config(root, "softmax_topk");
  c.data.mix = {(root / "data").string() + ":0.6", (root / "data-b").string() + ":0.4"};
  const auto ref = reference(c, root, "mix");
  const auto got = run_training(c, (root / "mix").string(), world());
  ASSERT_EQ(got.steps.size(), ref.steps.size());
  expect_same_losses(ref, got, 0, "mix");
  ASSERT_EQ(got.evals.size(), ref.evals.size());
  for (size_t i = 0; i < got.evals.size(); ++i) {
    ASSERT_EQ(got.evals[i].set_losses.size(), 2u);
    for (size_t k = 0; k < 2; ++k)
      EXPECT_LE(std::fabs(got.evals[i].set_losses[k] - ref.evals[i].set_losses[k]),
                1e-5 * ref.evals[i].set_losses[k]);
  }
  world()->barrier();
}

// bf16 expert gradients (model.moe.expert_grad_dtype): each rank rounds its own, the all-reduce
// sums them in f32, so the run follows the one-process one to within bf16 rounding.
TEST(DistributedTraining, Bf16ExpertGradientsFollowOneProcess) {
  const fs::path root = shared_root();
  Config c = micro_config(root, "softmax_topk");
  c.model.moe.expert_grad_dtype = "bf16";
  validate(c);
  const auto ref = reference(c, root, "bf16-grads");
  for (int ep : {world()->size(), 1}) {
    c.parallel.ep = ep;
    const std::string tag = "bf16-grads-ep" + std::to_string(ep);
    const auto got = run_training(c, (root / tag).string(), world());
    ASSERT_EQ(got.steps.size(), ref.steps.size());
    for (size_t i = 0; i < got.steps.size(); ++i) {
      EXPECT_NEAR(got.steps[i].loss, ref.steps[i].loss, 2e-3 * ref.steps[i].loss) << tag << i;
      EXPECT_NEAR(got.steps[i].grad_norm, ref.steps[i].grad_norm, 2e-2 * ref.steps[i].grad_norm)
          << tag << " grad norm " << i;
    }
  }
  world()->barrier();
}

TEST(DistributedTraining, ResumesWithAnotherLayout) {
  const fs::path root = shared_root();
  const int n = world()->size();
  Config c = micro_config(root, "softmax_topk");
  const auto ref = reference(c, root, "resume");
  // Saved with ep = world at step 4, resumed with ep = 1 (pure data parallelism).
  c.parallel.ep = n;
  const std::string out = (root / "resume").string();
  run_training(c, out, world(), false, 4);
  c.parallel.ep = 1;
  const auto rest = run_training(c, out, world(), true);
  ASSERT_EQ(rest.first_step, 4);
  expect_same_losses(ref, rest, 4, "resumed with ep=1");
  // A checkpoint saved by several ranks is complete and loads in one process too.
  const auto latest = train::latest_checkpoint(out);
  ASSERT_TRUE(latest.has_value());
  EXPECT_NO_THROW(train::load_checkpoint(*latest));
  world()->barrier();  // the next test's set-up removes the shared folder
}

TEST(DistributedTraining, RbdWithAffinityPlacementMatchesOneProcess) {
  // Two simulated nodes, redundancy-bypassing dispatch, and experts permuted by affinity before
  // the first step: none of it changes what is computed (up to float summation order).
  const int n = world()->size();
  if (n % 2 != 0) GTEST_SKIP() << "needs an even number of ranks for two simulated nodes";
  const fs::path root = shared_root();
  Config c = micro_config(root, "softmax_topk");
  const auto ref = reference(c, root, "rbd");
  c.parallel.ep = n;
  c.parallel.ranks_per_node = n / 2;
  c.parallel.expert_placement = "affinity";
  c.parallel.placement_batches = 2;
  c.model.moe.dispatch = "rbd";
  const auto got = run_training(c, (root / "rbd").string(), world());
  expect_same_losses(ref, got, 0, "rbd + affinity placement");
  world()->barrier();
}

// Ranks started with different configs (here the last rank's train.steps or model width) stop
// together before the first step, every rank naming the rank and the key, instead of hanging
// in a collective or training diverged replicas.
TEST(DistributedTraining, RanksWithDifferentConfigsStopNamingTheKey) {
  const int n = world()->size(), r = world()->rank();
  Config c = preset("tiny");
  EXPECT_NO_THROW(train::check_ranks_agree(*world(), c));
  for (const std::string key : {"train.steps", "model.d_model"}) {
    Config mine = c;
    if (r == n - 1) config_set(mine, key, key == "train.steps" ? "11" : "128");
    const std::string e =
        xmoe::testing::error_of([&] { train::check_ranks_agree(*world(), mine); });
    EXPECT_CONTAINS(e, "ranks were started with different configs");
    EXPECT_CONTAINS(e, fmt::format("rank {} ({})", n - 1, key));
    if (r == n - 1) {
      EXPECT_CONTAINS(e, fmt::format("{} = {} on rank 0, {} on rank {}", key, config_get(c, key),
                                     config_get(mine, key), r));
    }
  }
  // A config that reaches train() is checked there too: every rank refuses to start.
  const fs::path root = shared_root();
  Config bad = micro_config(root, "softmax_topk");
  if (r == n - 1) bad.train.seed += 1;
  const std::string e =
      xmoe::testing::error_of([&] { run_training(bad, (root / "disagree").string(), world()); });
  EXPECT_CONTAINS(e, fmt::format("rank {} (train.seed)", n - 1));
  EXPECT_FALSE(fs::exists(root / "disagree")) << "nothing may be written before the ranks agree";
  world()->barrier();
}
