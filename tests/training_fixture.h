#pragma once
// Shared by the model, training and distributed tests: the micro model and micro training runs
// (one builder each, parameters for what differs between the tests), the folder with a small
// corpus they train on, and the harness that compares a run over a group with the one-process
// run of the same global batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "testing.h"
#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"
#include "xmoe/data/prepare.h"
#include "xmoe/train/trainer.h"

namespace xmoe::testing {

/// The model tests' micro model (test_model, test_profile): vocab 11, d = 8, 2 layers, 2 heads
/// sharing 1 kv head (head_dim 4), sequences up to 8, dense FFN 12 wide; layer 0 dense and
/// layer 1 MoE (4 experts f = 6 top-2 + 1 shared, aux loss 0.05, z-loss 0.01), or both dense.
inline ModelConfig micro_model(bool moe = true) {
  ModelConfig c;
  c.vocab_size = 11;
  c.d_model = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.max_seq_len = 8;
  c.dense_hidden = 12;
  c.first_dense_layers = moe ? 1 : 2;
  c.moe.num_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_hidden = 6;
  c.moe.num_shared_experts = 1;
  c.moe.gate = "softmax_topk";
  c.moe.aux_loss_weight = 0.05f;
  c.moe.z_loss_weight = 0.01f;
  return c;
}

/// The MoE layer of the distributed layer tests (mpi_test_moe_dispatch, mpi_test_moe_rbd):
/// `experts` experts f = 8 top-3 + 1 shared, load-balance loss 0.1, z-loss 0.01 and the
/// sequence-level loss at `seq_aux` (weighted heavily enough that their gradients matter); the
/// sigmoid gate with 4 groups, tokens in 2 of them, bias step 0.01.
inline MoeConfig micro_moe_layer(const std::string& gate, const std::string& dispatch, int experts,
                                 float seq_aux = 0.f) {
  MoeConfig c;
  c.num_experts = experts;
  c.top_k = 3;
  c.expert_hidden = 8;
  c.num_shared_experts = 1;
  c.gate = gate;
  c.dispatch = dispatch;
  c.aux_loss_weight = 0.1f;
  c.seq_aux_loss_weight = seq_aux;
  c.z_loss_weight = 0.01f;
  if (gate == "sigmoid") {
    c.num_groups = 4;
    c.topk_groups = 2;
    c.bias_update_rate = 0.01f;
  }
  return c;
}

/// What differs between the tests' micro training runs. The defaults are test_train's.
struct MicroRun {
  bool moe = true;  ///< layer 1 MoE; false: both layers dense
  int steps = 30;
  int every = 10;           ///< eval, save and log every this many steps
  std::string run = "run";  ///< train.out_dir = root/run
};

/// The `tiny` preset at micro size for one process (test_train, test_cuda_model): d = 32, 2
/// layers, 2 heads sharing 1 kv head, dense FFN 64, layer 1 with 4 experts f = 16 top-2;
/// batch 4 × seq 32, warm-up 5, evaluation on 2 batches. The corpus is root/corpus (the test
/// writes it), the tokens go to root/data (10% held out).
inline Config micro_config(const std::filesystem::path& root, const MicroRun& o = {}) {
  Config c = preset("tiny");
  c.model.d_model = 32;
  c.model.num_layers = 2;
  c.model.num_heads = 2;
  c.model.num_kv_heads = 1;
  c.model.dense_hidden = 64;
  c.model.max_seq_len = 32;
  c.model.first_dense_layers = o.moe ? 1 : 2;
  c.model.moe.num_experts = 4;
  c.model.moe.top_k = 2;
  c.model.moe.expert_hidden = 16;
  c.data.corpus = (root / "corpus").string();
  c.data.dir = (root / "data").string();
  c.data.val_fraction = 0.1f;
  c.train.steps = o.steps;
  c.train.batch_size = 4;
  c.train.seq_len = 32;
  c.train.warmup_steps = 5;
  c.train.eval_every = o.every;
  c.train.eval_batches = 2;
  c.train.save_every = o.every;
  c.train.log_every = o.every;
  c.train.out_dir = (root / o.run).string();
  validate(c);
  return c;
}

/// What differs between the distributed tests' micro runs.
struct MicroParallelRun {
  std::string gate = "softmax_topk";
  int experts = 12;  ///< divisible by every ep the test runs with
  std::string device = TrainConfig{}.device;
  std::string dtype = TrainConfig{}.dtype;
};

/// The micro run of the distributed tests (mpi_test_train, mpi_test_cuda_train): as
/// micro_config but dense FFN 48, seq 16, top-3 of `experts` with aux loss 0.01 and z-loss
/// 0.001, batch 2 per rank, 8 steps, eval (1 batch) and save every 4; train.out_dir is left to
/// the run (run_training).
inline Config micro_parallel_config(const std::filesystem::path& root,
                                    const MicroParallelRun& o = {}) {
  Config c = preset("tiny");
  c.model.d_model = 32;
  c.model.num_layers = 2;
  c.model.num_heads = 2;
  c.model.num_kv_heads = 1;
  c.model.dense_hidden = 48;
  c.model.max_seq_len = 16;
  c.model.moe.num_experts = o.experts;
  c.model.moe.top_k = 3;
  c.model.moe.expert_hidden = 16;
  c.model.moe.gate = o.gate;
  c.model.moe.aux_loss_weight = 0.01f;
  c.model.moe.z_loss_weight = 0.001f;
  c.data.corpus = (root / "corpus").string();
  c.data.dir = (root / "data").string();
  c.data.val_fraction = 0.1f;
  c.train.device = o.device;
  c.train.dtype = o.dtype;
  c.train.steps = 8;
  c.train.batch_size = 2;
  c.train.seq_len = 16;
  c.train.warmup_steps = 2;
  c.train.eval_every = 4;
  c.train.eval_batches = 1;
  c.train.save_every = 4;
  c.train.log_every = 100;
  validate(c);
  return c;
}

/// Training without the progress line.
inline train::TrainOptions quiet() {
  train::TrainOptions o;
  o.progress = false;
  return o;
}

/// `c` trained quietly until step `stop_after` (a checkpoint must be saved there), then resumed
/// in the same run folder to its end: the resumed run's result (steps stop_after + 1 on).
inline train::TrainResult train_stopped_and_resumed(const Config& c, int stop_after) {
  train::TrainOptions first = quiet();
  first.stop_after = stop_after;
  train::train(c, first);
  train::TrainOptions second = quiet();
  second.resume = true;
  return train::train(c, second);
}

/// A fresh folder per test, temp/<prefix><test name>-<pid>, with `proverbs` lines of English
/// in root/corpus/text.txt (write_proverbs); removed afterwards.
class MicroCorpusTest : public ::testing::Test {
 protected:
  explicit MicroCorpusTest(std::string prefix, int proverbs = 600)
      : prefix_(std::move(prefix)), proverbs_(proverbs) {}
  void SetUp() override {
    root_ = std::filesystem::temp_directory_path() /
            fmt::format("{}{}-{}", prefix_,
                        ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                        static_cast<long>(::getpid()));
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_ / "corpus");
    write_proverbs(root_ / "corpus" / "text.txt", proverbs_);
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  std::filesystem::path root_;

 private:
  std::string prefix_;
  int proverbs_;
};

// ---- a run over a group against one process --------------------------------------------------

/// temp/<name>-<rank 0's pid>, shared by the ranks of `world` (a CPU group): rank 0 makes it
/// afresh with a corpus (800 proverbs, stride 7) and prepares its tokens (root/data, 10% held
/// out, as micro_parallel_config) before any rank's one-process reference needs them. The pid
/// keeps two jobs of one test (two build trees' suites at once) out of each other's folder.
inline std::filesystem::path shared_corpus(comm::Group& world, const std::string& name) {
  Tensor pid = Tensor::from_vector<int64_t>({world.rank() == 0 ? int64_t{::getpid()} : 0}, {1});
  world.broadcast(pid, 0);
  const std::filesystem::path root = std::filesystem::temp_directory_path() /
                                     fmt::format("{}-{}", name, pid.to_vector<int64_t>()[0]);
  if (world.rank() == 0) {
    std::filesystem::remove_all(root);
    std::filesystem::create_directories(root / "corpus");
    write_proverbs(root / "corpus" / "text.txt", 800, 7);
    DataConfig data;
    data.corpus = (root / "corpus").string();
    data.dir = (root / "data").string();
    data.val_fraction = 0.1f;
    data::ensure_prepared(data);
  }
  world.barrier();
  return root;
}

/// Trains `c` into `out_dir` over `group`, quietly.
inline train::TrainResult run_training(Config c, const std::string& out_dir,
                                       std::shared_ptr<comm::Group> group, bool resume = false,
                                       int stop_after = -1) {
  c.train.out_dir = out_dir;
  train::TrainOptions o = quiet();
  o.world = std::move(group);
  o.resume = resume;
  o.stop_after = stop_after;
  return train::train(c, o);
}

/// The tiny preset (full size) on the micro corpus under `root` (root/corpus, root/data),
/// `steps` steps, no evaluation or checkpoint on the way.
inline Config tiny_on_corpus(const std::filesystem::path& root, int steps) {
  Config c = preset("tiny");
  c.data.corpus = (root / "corpus").string();
  c.data.dir = (root / "data").string();
  c.data.val_fraction = 0.1f;
  c.train.steps = steps;
  c.train.eval_every = 0;
  c.train.save_every = 0;
  return c;
}

/// The median wall time of a run's steps after the first (which warms up), 0 for one step.
inline double median_step_seconds(const train::TrainResult& r) {
  std::vector<double> s;
  for (size_t i = 1; i < r.steps.size(); ++i) s.push_back(r.steps[i].seconds);
  std::sort(s.begin(), s.end());
  return s.empty() ? 0 : s[s.size() / 2];
}

/// `c` for one process with the global batch of `c` over `world_size` ranks (batch = world ×
/// B, no parallel layout): the run every layout is compared with. Run it with
/// comm::make_single_group() (every rank runs its own).
inline Config one_process(Config c, int world_size) {
  c.train.batch_size *= world_size;
  c.parallel = ParallelConfig{};
  return c;
}

/// Per-step losses (1e-5 relative) and gradient norms (1e-4) of `got` equal those of `ref` from
/// step ref_offset on.
inline void expect_same_losses(const train::TrainResult& ref, const train::TrainResult& got,
                               size_t ref_offset, const std::string& what) {
  ASSERT_GE(ref.steps.size(), ref_offset + got.steps.size()) << what;
  for (size_t i = 0; i < got.steps.size(); ++i) {
    const double a = ref.steps[ref_offset + i].loss, b = got.steps[i].loss;
    EXPECT_LE(std::fabs(a - b), 1e-5 * std::fabs(a)) << what << " step " << got.steps[i].step;
    const double na = ref.steps[ref_offset + i].grad_norm, nb = got.steps[i].grad_norm;
    EXPECT_LE(std::fabs(na - nb), 1e-4 * std::fabs(na))
        << what << " grad norm, step " << got.steps[i].step;
  }
}

}  // namespace xmoe::testing
