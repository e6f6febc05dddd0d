// Multi-process training on the GPU (train.device = cuda under mpirun): the trainer builds an
// NCCL group over the MPI world and the layout splits it, so dispatch, the gradient all-reduces,
// the routing statistics, the expert norm, evaluation and the checkpoint barriers all move
// device tensors. Each rank also runs the one-process references of the same global batch
// (batch = world × B) itself: on its own GPU and on the CPU. Meaningful at np 1 too: the trainer
// then trains over a one-rank NCCL world.
//
// Tolerances (relative, every step):
//   f32, NCCL world vs one-process CUDA: 1e-4 on the loss, 1e-3 on the gradient norm. The same
//     math with the sums over ranks in another order (NCCL's all-reduce, the aux statistics)
//     and GEMMs of other shapes (B instead of world × B sequences: cuBLAS may pick other tiles),
//     i.e. ~1e-6 per step, grown by 8 AdamW steps. mpi_test_train.cpp asks 1e-5 / 1e-4 on the
//     CPU. A lost or doubled gradient, a row sent to the wrong expert or a rank's statistics
//     left out of a reduction gives 1e-2 and more.
//   f32 vs the CPU: 1e-3, test_cuda_model.cpp's MoE f32 tolerance (the router is
//     precision-sensitive; the dense model alone stays within 1e-4).
//   bf16 vs the CPU (f32) and vs one-process CUDA bf16: 3e-2, test_cuda_model.cpp's trainer
//     tolerance (every matmul input rounded to bf16; the runs drift apart slowly under Adam).
//   Resume over the same layout: 1e-6. Every CUDA op is deterministic and NCCL repeats its
//     reductions for one communicator size and message size, so it should be bit for bit; the
//     margin only allows NCCL to pick another algorithm on the fresh communicator.
//
// Every test skips, with the reason, when xmoe was built without NCCL, when no CUDA device is
// visible, or when a host runs more ranks than it has devices (NCCL takes one device per rank).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>

#include "cuda_testing.h"
#include "testing.h"
#include "training_fixture.h"
#include "xmoe/comm/group.h"
#include "xmoe/comm/nccl/nccl_group.h"
#include "xmoe/config/config.h"
#include "xmoe/core/device_api.h"
#include "xmoe/data/prepare.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/memory_model.h"
#include "xmoe/train/trainer.h"

namespace fs = std::filesystem;
using namespace xmoe;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

struct Tolerance {
  double loss, grad_norm;  // relative; grad_norm < 0: not compared
};

void expect_close(const train::TrainResult& ref, const train::TrainResult& got, size_t ref_offset,
                  Tolerance tol, const std::string& what) {
  ASSERT_GE(ref.steps.size(), ref_offset + got.steps.size()) << what;
  ASSERT_FALSE(got.steps.empty()) << what;
  for (size_t i = 0; i < got.steps.size(); ++i) {
    const auto& a = ref.steps[ref_offset + i];
    const auto& b = got.steps[i];
    EXPECT_FALSE(b.skipped) << what << " step " << b.step;
    EXPECT_LE(std::fabs(a.loss - b.loss), tol.loss * std::fabs(a.loss))
        << what << " step " << b.step << ": loss " << b.loss << ", reference " << a.loss;
    if (tol.grad_norm >= 0) {
      EXPECT_LE(std::fabs(a.grad_norm - b.grad_norm), tol.grad_norm * std::fabs(a.grad_norm))
          << what << " step " << b.step << ": grad norm " << b.grad_norm << ", reference "
          << a.grad_norm;
    }
  }
}

void expect_close_evals(const train::TrainResult& ref, const train::TrainResult& got, double tol,
                        const std::string& what) {
  ASSERT_EQ(got.evals.size(), ref.evals.size()) << what;
  for (size_t i = 0; i < got.evals.size(); ++i)
    EXPECT_LE(std::fabs(got.evals[i].val_loss - ref.evals[i].val_loss), tol * ref.evals[i].val_loss)
        << what << " validation at step " << got.evals[i].step;
}

constexpr Tolerance kF32{1e-4, 1e-3};
constexpr Tolerance kF32VsCpu{1e-3, -1};
constexpr Tolerance kBf16{3e-2, -1};

}  // namespace

class CudaNcclTrain : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    world_ = comm::world();
    skip_ = skip_reason();
    if (!skip_.empty()) return;
    root_ = xmoe::testing::shared_corpus(*world_,
                                         "xmoe-mpi-cuda-train-" + std::to_string(world_->size()));
  }
  static void TearDownTestSuite() {
    if (skip_.empty()) {
      world_->barrier();
      if (world_->rank() == 0) fs::remove_all(root_);
    }
    world_.reset();
  }
  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
  }
  void TearDown() override {
    if (skip_.empty()) world_->barrier();  // no rank starts the next test's runs early
  }

  /// Empty when NCCL can run here (tests/cuda_testing.h).
  static std::string skip_reason() { return xmoe::testing::nccl_skip_reason(*world_, local_rank_); }

  static int world_size() { return world_->size(); }

  /// mpi_test_train.cpp's micro run (training_fixture.h) on the rank's GPU; 24 experts divide
  /// over ep = 1, 2, 3, 4, 6, 8 GPUs.
  static Config micro_config(const std::string& gate = "softmax_topk",
                             const std::string& dtype = "f32") {
    // device "cuda" under mpirun: the rank's position on its host
    return xmoe::testing::micro_parallel_config(
        root_, {.gate = gate, .experts = 24, .device = "cuda", .dtype = dtype});
  }

  static train::TrainResult run(const Config& c, const std::string& tag,
                                std::shared_ptr<comm::Group> group, bool resume = false,
                                int stop_after = -1) {
    return xmoe::testing::run_training(c, (root_ / tag).string(), std::move(group), resume,
                                       stop_after);
  }

  /// Over the whole job: the trainer makes the NCCL world from the MPI one.
  static train::TrainResult run_nccl(const Config& c, const std::string& tag, bool resume = false,
                                     int stop_after = -1) {
    return run(c, tag, world_, resume, stop_after);
  }

  /// The one-process run of the same global batch (world / tp micro-batches), by every rank for
  /// itself: on its own GPU (device "cuda") or on the CPU (device "cpu", f32).
  static train::TrainResult reference(const Config& global, const std::string& device,
                                      const std::string& tag, int tp = 1) {
    Config c = xmoe::testing::one_process(global, world_->size() / tp);
    if (device == "cpu") {
      c.train.device = "cpu";
      c.train.dtype = "f32";
    } else {
      c.train.device = fmt::format("cuda:{}", local_rank_);
    }
    return run(c, fmt::format("ref-{}-{}-rank{}", tag, device, world_->rank()),
               comm::make_single_group());
  }

  static inline std::shared_ptr<comm::Group> world_;
  static inline std::string skip_;
  static inline int local_rank_ = 0;
  static inline fs::path root_;
};

TEST_F(CudaNcclTrain, F32MatchesOneProcessForEveryLayout) {
  const int n = world_size();
  for (const std::string gate : {"softmax_topk", "sigmoid"}) {  // sigmoid: the load all-reduce
    const Config c0 = micro_config(gate);
    const auto ref_cuda = reference(c0, "cuda", gate);
    const auto ref_cpu = reference(c0, "cpu", gate);
    std::vector<int> eps = {n};
    if (n > 1) eps.push_back(1);
    if (n == 4 || n == 8) eps.push_back(2);
    for (int ep : eps) {
      Config c = c0;
      c.parallel.ep = ep;
      const std::string tag = fmt::format("{}-ep{}", gate, ep);
      const auto got = run_nccl(c, tag);
      ASSERT_EQ(got.steps.size(), ref_cuda.steps.size()) << tag;
      expect_close(ref_cuda, got, 0, kF32, tag + " vs one-process CUDA");
      expect_close(ref_cpu, got, 0, kF32VsCpu, tag + " vs one-process CPU");
      expect_close_evals(ref_cuda, got, kF32.loss, tag);
      for (const auto& s : got.steps) EXPECT_GT(s.mfu, 0.0) << tag;
    }
  }
}

// Tensor parallelism over NCCL (mpi_test_tp.cpp on the CPU): tp = 2 with and without SSMB, the
// tp all-gathers (bf16 activations in bf16) and reduce-scatters on the device.
TEST_F(CudaNcclTrain, TensorParallelFollowsOneProcess) {
  const int n = world_size();
  if (n % 2 != 0) GTEST_SKIP() << "tp = 2 needs an even number of GPUs";
  for (const std::string dtype : {"f32", "bf16"}) {
    Config c0 = micro_config("softmax_topk", dtype);
    c0.model.num_heads = 4;
    c0.model.num_kv_heads = 2;
    validate(c0);
    const auto ref_cuda = reference(c0, "cuda", "tp-" + dtype, 2);
    const auto ref_cpu = reference(c0, "cpu", "tp-" + dtype, 2);
    for (const bool ssmb : {true, false}) {
      Config c = c0;
      c.parallel.tp = 2;
      c.parallel.ssmb = ssmb;
      c.parallel.ep = ssmb ? n : n / 2;
      validate(c);
      const std::string tag =
          fmt::format("{}-tp2-ep{}-{}", dtype, c.parallel.ep, ssmb ? "ssmb" : "nossmb");
      const auto got = run_nccl(c, tag);
      ASSERT_EQ(got.steps.size(), ref_cuda.steps.size()) << tag;
      if (dtype == "f32") {
        expect_close(ref_cuda, got, 0, kF32, tag + " vs one-process CUDA");
        expect_close(ref_cpu, got, 0, kF32VsCpu, tag + " vs one-process CPU");
      } else {
        expect_close(ref_cpu, got, 0, kBf16, tag + " vs one-process CPU");
        expect_close(ref_cuda, got, 0, kBf16, tag + " vs one-process CUDA bf16");
      }
    }
  }
}

TEST_F(CudaNcclTrain, Bf16FollowsTheCpuAndOneProcess) {
  const int n = world_size();
  const Config c0 = micro_config("softmax_topk", "bf16");
  const auto ref_cuda = reference(c0, "cuda", "bf16");
  const auto ref_cpu = reference(c0, "cpu", "bf16");
  for (int ep : n > 1 ? std::vector<int>{n, 1} : std::vector<int>{1}) {
    Config c = c0;
    c.parallel.ep = ep;
    const std::string tag = fmt::format("bf16-ep{}", ep);
    const auto got = run_nccl(c, tag);
    ASSERT_EQ(got.steps.size(), ref_cpu.steps.size()) << tag;
    expect_close(ref_cpu, got, 0, kBf16, tag + " vs one-process CPU");
    expect_close(ref_cuda, got, 0, kBf16, tag + " vs one-process CUDA bf16");
    EXPECT_LT(got.steps.back().loss, got.steps.front().loss) << tag;
  }
}

// parallel.zero over NCCL: zero 1 shards the AdamW moments over the GPUs of each parameter's
// data-parallel group, zero 2 also reduce-scatters the gradients (started during backward: 4
// KiB buckets make many) and holds none between steps; the f32 master weights stay whole and
// the bf16 copies are rewritten from the all-gathered parameters. One GPU: zero 0's bits, f32
// and bf16. Several: within 1e-5 relative of zero 0 (NCCL's reduce-scatter and the sharded
// norm add in another order), the moments per rank divided by dp.
TEST_F(CudaNcclTrain, ZeroShardsTheOptimizerOverNccl) {
  const int n = world_size();
  for (const std::string dtype : {"f32", "bf16"}) {
    Config c = micro_config("softmax_topk", dtype);
    c.parallel.ep = 1;
    c.parallel.bucket_kib = 4;
    c.parallel.zero = 0;
    const auto z0 = run_nccl(c, "zero0-" + dtype);
    for (int zero : {1, 2}) {
      c.parallel.zero = zero;
      const std::string tag = fmt::format("zero{}-{}", zero, dtype);
      const auto got = run_nccl(c, tag);
      ASSERT_EQ(got.steps.size(), z0.steps.size()) << tag;
      for (size_t i = 0; i < got.steps.size(); ++i) {
        const auto &a = z0.steps[i], &b = got.steps[i];
        if (n == 1) {
          EXPECT_EQ(a.loss, b.loss) << tag << " step " << i + 1;
          EXPECT_EQ(a.grad_norm, b.grad_norm) << tag << " step " << i + 1;
        } else {
          EXPECT_LE(std::fabs(a.loss - b.loss), 1e-5 * a.loss) << tag << " step " << i + 1;
          EXPECT_LE(std::fabs(a.grad_norm - b.grad_norm), 1e-4 * a.grad_norm)
              << tag << " step " << i + 1;
        }
      }
      if (n > 1) {
        EXPECT_LT(got.optimizer_bytes, z0.optimizer_bytes) << tag;
      }
      EXPECT_EQ(got.gradient_bytes, zero == 2 ? 0 : z0.gradient_bytes) << tag;
      if (world_->rank() == 0)
        std::printf(
            "[zero-nccl] np %d %s zero %d: moments %lld (zero 0 %lld), gradients between steps "
            "%lld (%lld), step peak %lld (%lld) bytes\n",
            n, dtype.c_str(), zero, static_cast<long long>(got.optimizer_bytes),
            static_cast<long long>(z0.optimizer_bytes), static_cast<long long>(got.gradient_bytes),
            static_cast<long long>(z0.gradient_bytes), static_cast<long long>(got.peak_step_bytes),
            static_cast<long long>(z0.peak_step_bytes));
    }
  }
}

TEST_F(CudaNcclTrain, ZeroShardsTheBf16MasterWeights) {
  // bf16 compute: at zero 1 and 2 the matrices' f32 masters live only in the optimizer's pieces
  // (each rank its shard) and the update all-gathers bf16 copies. One GPU: zero 0's bits, the
  // parameters' whole f32 values gone (the optimizer holds all of them); several: within 1e-5,
  // and fewer master bytes. The bytes are the memory model's. A checkpoint saved at zero 1 holds
  // zero 0's tensors and resumes at zero 0, and a zero 0 one resumes at zero 1.
  const int n = world_size();
  Config c = micro_config("softmax_topk", "bf16");
  c.parallel.ep = 1;
  c.parallel.bucket_kib = 4;  // parameters straddle the shards
  c.parallel.zero = 0;
  const auto z0 = run_nccl(c, "master-zero0");
  EXPECT_EQ(z0.sharded_master_bytes, 0);
  for (int zero : {1, 2}) {
    c.parallel.zero = zero;
    const std::string tag = fmt::format("master-zero{}", zero);
    const auto got = run_nccl(c, tag);
    ASSERT_EQ(got.steps.size(), z0.steps.size()) << tag;
    if (n == 1) {
      for (size_t i = 0; i < got.steps.size(); ++i) {
        EXPECT_EQ(z0.steps[i].loss, got.steps[i].loss) << tag << " step " << i + 1;
        EXPECT_EQ(z0.steps[i].grad_norm, got.steps[i].grad_norm) << tag << " step " << i + 1;
      }
      EXPECT_EQ(got.master_bytes, z0.master_bytes) << tag;  // the one shard is the whole
    } else {
      expect_close(z0, got, 0, {1e-5, 1e-4}, tag);
      EXPECT_LT(got.master_bytes, z0.master_bytes) << tag;
    }
    EXPECT_GT(got.sharded_master_bytes, 0) << tag;
    const train::MemoryModel predicted =
        train::predict_memory(c, {.world = n, .rank = world_->rank()});
    EXPECT_EQ(got.master_bytes, predicted.parameter_bytes) << tag;
    if (world_->rank() == 0)
      std::printf(
          "[zero-master] np %d zero %d: f32 masters %lld bytes (in optimizer pieces %lld; zero 0 "
          "%lld), between steps %lld (%lld), step peak %lld (%lld)\n",
          n, zero, static_cast<long long>(got.master_bytes),
          static_cast<long long>(got.sharded_master_bytes), static_cast<long long>(z0.master_bytes),
          static_cast<long long>(got.steady_bytes), static_cast<long long>(z0.steady_bytes),
          static_cast<long long>(got.peak_step_bytes), static_cast<long long>(z0.peak_step_bytes));
  }

  // Saved at step 4 with zero 1 and with zero 0: the same tensors (one GPU: the same bits).
  c.parallel.zero = 1;
  run_nccl(c, "master-save-zero1", false, 4);
  c.parallel.zero = 0;
  run_nccl(c, "master-save-zero0", false, 4);
  const auto dir1 = train::latest_checkpoint((root_ / "master-save-zero1").string());
  const auto dir0 = train::latest_checkpoint((root_ / "master-save-zero0").string());
  ASSERT_TRUE(dir1.has_value() && dir0.has_value());
  const train::Checkpoint ck1 = train::load_checkpoint(*dir1), ck0 = train::load_checkpoint(*dir0);
  ASSERT_EQ(ck1.tensors.size(), ck0.tensors.size());
  for (const auto& [name, t0] : ck0.tensors) {
    ASSERT_TRUE(ck1.tensors.count(name)) << name;
    const Tensor& t1 = ck1.tensors.at(name);
    ASSERT_EQ(t1.nbytes(), t0.nbytes()) << name;
    if (n == 1 || t0.dtype() != DType::f32) {
      EXPECT_EQ(std::memcmp(t1.raw(), t0.raw(), t0.nbytes()), 0) << name;
    } else {
      const std::vector<float> a = t0.to_vector<float>(), b = t1.to_vector<float>();
      double worst = 0;
      for (size_t i = 0; i < a.size(); ++i)
        worst = std::max(worst, static_cast<double>(std::fabs(a[i] - b[i])));
      EXPECT_LE(worst, 1e-4) << name;
    }
  }
  // Resumed across zero settings: the zero 1 checkpoint at zero 0, the zero 0 one at zero 1.
  const auto at0 = run_nccl(c, "master-save-zero1", true);
  ASSERT_EQ(at0.first_step, 4);
  expect_close(z0, at0, 4, n == 1 ? Tolerance{1e-6, 1e-6} : Tolerance{1e-5, 1e-4},
               "zero 1 checkpoint resumed at zero 0");
  c.parallel.zero = 1;
  const auto at1 = run_nccl(c, "master-save-zero0", true);
  ASSERT_EQ(at1.first_step, 4);
  expect_close(z0, at1, 4, n == 1 ? Tolerance{1e-6, 1e-6} : Tolerance{1e-5, 1e-4},
               "zero 0 checkpoint resumed at zero 1");
}

TEST_F(CudaNcclTrain, CheckpointResumesAcrossTheNcclWorld) {
  const int n = world_size();
  Config c = micro_config("sigmoid");  // the balancing bias is checkpointed state too
  c.parallel.ep = n;
  const auto straight = run_nccl(c, "straight");
  ASSERT_EQ(straight.steps.size(), 8u);

  // Saved at step 4 over the NCCL world (host f32 safetensors, one file per rank), resumed
  // with the same layout: the run repeats.
  run_nccl(c, "resume-same", false, 4);
  const auto latest = train::latest_checkpoint((root_ / "resume-same").string());
  ASSERT_TRUE(latest.has_value());
  const train::Checkpoint ck = train::load_checkpoint(*latest);  // complete, loads on the host
  EXPECT_EQ(ck.world, n);
  EXPECT_EQ(ck.state.at("step").get<int>(), 4);
  const auto same = run_nccl(c, "resume-same", true);
  ASSERT_EQ(same.first_step, 4);
  ASSERT_EQ(same.steps.size(), 4u);
  expect_close(straight, same, 4, {1e-6, 1e-6}, "resumed with the same layout");

  // Saved with ep = world, resumed with ep = 1 (data parallelism only): the same training.
  if (n > 1) {
    run_nccl(c, "resume-ep1", false, 4);
    Config d = c;
    d.parallel.ep = 1;
    const auto rest = run_nccl(d, "resume-ep1", true);
    ASSERT_EQ(rest.first_step, 4);
    expect_close(straight, rest, 4, kF32, "resumed with ep = 1");
  }
}

TEST_F(CudaNcclTrain, AffinityPlacementOverDeclaredNodes) {
  // One declared node per rank: the experts are permuted by affinity before the first step
  // (co-activation counts all-reduced, expert tensors all-gathered over the NCCL ep group).
  // It does not change what is computed. With one rank there is nothing to place.
  const int n = world_size();
  Config c = micro_config();
  const auto ref = reference(c, "cuda", "placement");
  c.parallel.ep = n;
  c.parallel.ranks_per_node = 1;
  c.parallel.expert_placement = "affinity";
  c.parallel.placement_batches = 2;
  const auto got = run_nccl(c, "placement");
  expect_close(ref, got, 0, kF32, "affinity placement");
}

TEST_F(CudaNcclTrain, RbdIsRefusedOnTheGpu) {
  const int n = world_size();
  Config c = micro_config();
  c.parallel.ep = n;
  c.parallel.ranks_per_node = 1;
  c.model.moe.dispatch = "rbd";
  c.train.steps = 2;
  if (n == 1) {  // one node: rbd is all_to_all, which runs on the GPU
    EXPECT_EQ(run_nccl(c, "rbd").steps.size(), 2u);
    return;
  }
  // Every rank refuses at the same point, and the run's NCCL groups go with the exception.
  EXPECT_NE(error_of([&] { run_nccl(c, "rbd"); }).find("moe.dispatch = rbd runs on CPU tensors"),
            std::string::npos);
  // The job is still usable: a fresh NCCL world trains.
  c.model.moe.dispatch = "all_to_all";
  EXPECT_EQ(run_nccl(c, "after-rbd").steps.size(), 2u);
}
