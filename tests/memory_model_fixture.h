#pragma once
// Shared by test_memory_model (CPU) and test_cuda_memory_model: real training steps of the tiny
// preset (and variants) with the allocator's peak and live bytes measured
// (TrainResult::peak_step_bytes, steady_bytes), compared with train::predict_memory.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "testing.h"
#include "training_fixture.h"
#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"
#include "xmoe/core/device_api.h"
#include "xmoe/train/memory_model.h"
#include "xmoe/train/trainer.h"

namespace xmoe::testing {

class MemoryModelTest : public MicroCorpusTest {
 protected:
  MemoryModelTest() : MicroCorpusTest("xmoe-memory-") {}

  /// The tiny preset (full size) trained for 2 steps on the micro corpus, no evaluation.
  Config tiny() const {
    Config c = tiny_on_corpus(root_, 2);
    c.train.out_dir = (root_ / "run").string();
    return c;
  }

  /// moe-1b's layers and micro-batch (8 x 2048) on the micro corpus, 4 of its 16 layers so
  /// that it builds quickly; 2 steps, no evaluation.
  Config moe_1b_shape() const {
    Config c = preset("moe-1b");
    const Config t = tiny();
    c.data = t.data;
    c.train.steps = 2;
    c.train.eval_every = 0;
    c.train.save_every = 0;
    c.train.out_dir = t.train.out_dir;
    c.model.num_layers = 4;
    return c;
  }

  /// Trains `c`, then checks the measured peak within 10% and the live bytes between steps
  /// (parameters, gradients, moments, state) within 1% of the prediction, the moment, gradient
  /// and offload staging bytes exactly and, with the optimizer offloaded from a GPU, the pinned
  /// host memory within 1%.
  void expect_predicted(Config c, const std::string& what) {
    validate(c);
    const train::MemoryModel m = train::predict_memory(c);
    const bool pinned = m.host_bytes > 0;
    if (pinned) backend::pinned_host_allocator().reset_peak();
    const int64_t pinned_base = pinned ? backend::pinned_host_allocator().stats().live_bytes : 0;
    const train::TrainResult r = run_training(c, c.train.out_dir, comm::make_single_group());
    ASSERT_GT(r.peak_step_bytes, 0) << what;
    EXPECT_EQ(m.optimizer_bytes, r.optimizer_bytes) << what;
    EXPECT_EQ(m.gradient_bytes, r.gradient_bytes) << what;
    EXPECT_EQ(m.staging_bytes, r.offload_staging_bytes) << what;
    EXPECT_EQ(m.parameter_bytes, r.master_bytes) << what;
    if (pinned) {
      // The master weights, moments and staging are the only pinned tensors of a run.
      const int64_t host = backend::pinned_host_allocator().stats().peak_bytes - pinned_base;
      const double host_err = static_cast<double>(m.host_bytes - host) / static_cast<double>(host);
      std::printf("[memory] %-28s pinned host predicted %10lld measured %10lld (%+.2f%%)\n",
                  what.c_str(), static_cast<long long>(m.host_bytes), static_cast<long long>(host),
                  100 * host_err);
      EXPECT_LE(std::abs(host_err), 0.01) << what << "\n" << train::memory_table(m);
    }
    const double peak_err = static_cast<double>(m.peak_bytes - r.peak_step_bytes) /
                            static_cast<double>(r.peak_step_bytes);
    const double steady_err =
        static_cast<double>(m.steady_bytes - r.steady_bytes) / static_cast<double>(r.steady_bytes);
    std::printf(
        "[memory] %-28s peak predicted %10lld measured %10lld (%+.1f%%); between steps "
        "predicted %10lld measured %10lld (%+.2f%%)\n",
        what.c_str(), static_cast<long long>(m.peak_bytes),
        static_cast<long long>(r.peak_step_bytes), 100 * peak_err,
        static_cast<long long>(m.steady_bytes), static_cast<long long>(r.steady_bytes),
        100 * steady_err);
    if (m.attention_workspace_bytes > 0)
      std::printf("[memory] %-28s attention backward workspace %lld bytes (%s)\n", what.c_str(),
                  static_cast<long long>(m.attention_workspace_bytes),
                  m.attention_workspace_asked ? "asked" : "estimated");
    EXPECT_LE(std::abs(peak_err), 0.10) << what << "\n" << train::memory_table(m);
    EXPECT_LE(std::abs(steady_err), 0.01) << what << "\n" << train::memory_table(m);
  }
};

}  // namespace xmoe::testing
