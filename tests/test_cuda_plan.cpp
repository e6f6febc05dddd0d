// `xmoe plan`'s predictions on one GPU (docs/plan.md, "How good are the predictions"): a profile
// measured in the test (sched::run_profile at the model's GEMM and attention shapes) gives the
// rates; moe-1b's layers (4 of 16, 8 x 2048 tokens a micro-batch) train a few steps in a few
// layouts, and the measured peak bytes (the CUDA allocator's) and median step time (wall; the
// GPU is not shared) are compared with the planner's prediction: within 10% and 15%.
#include <gtest/gtest.h>

#include <cstdio>

#include "cuda_testing.h"
#include "memory_model_fixture.h"
#include "xmoe/comm/group.h"
#include "xmoe/plan/planner.h"
#include "xmoe/sched/profiler.h"

using namespace xmoe;
using CudaPlanTest = xmoe::testing::MemoryModelTest;

namespace {

/// One GPU as a one-node cluster (the profile gives every rate).
plan::Cluster one_gpu() {
  plan::Cluster c = plan::builtin_cluster("dgx-h100");
  c.name = "one GPU";
  c.gpus_per_node = 1;
  return c;
}

}  // namespace

TEST_F(CudaPlanTest, MemoryAndStepTimeMatchMeasuredRunsOnOneGpu) {
  XMOE_REQUIRE_CUDA();
  Config base = moe_1b_shape();
  base.train.steps = 8;
  // moe-1b's GEMMs: attention (d 1024), router (64 experts), experts (f 256), 2 shared experts,
  // the LM head (vocab 32768); attention of head_dim 64 over 2048 tokens.
  sched::ProfileOptions po;
  po.gemm_shapes = {{1024, 1024}, {1024, 64}, {1024, 512}, {256, 1024}, {512, 1024}, {1024, 32768}};
  po.attention_shapes = {{64, 2048}};
  const plan::Rates rates(one_gpu(),
                          sched::run_profile(comm::make_single_group(), xmoe::testing::kCuda, po));

  struct Case {
    std::vector<std::string> recompute;
    std::string expert_grad_dtype;
    const char* what;
  };
  for (const Case& k :
       {Case{{}, "f32", "moe-1b x4"}, Case{{"moe", "router"}, "f32", "recompute moe"},
        Case{{}, "bf16", "bf16 expert grads"}}) {
    plan::PlanLayout l;
    l.micro_batch = 8;
    l.recompute = k.recompute;
    l.expert_grad_dtype = k.expert_grad_dtype;
    const plan::Candidate p = plan::evaluate_layout(base, l, rates);
    const train::TrainResult r = xmoe::testing::run_training(
        p.config, (root_ / ("run-" + l.str())).string(), comm::make_single_group());
    const double step = xmoe::testing::median_step_seconds(r);
    const double memory_err = static_cast<double>(p.memory.peak_bytes - r.peak_step_bytes) /
                              static_cast<double>(r.peak_step_bytes);
    const double time_err = (p.time.total - step) / step;
    std::printf(
        "[plan] cuda %-18s peak predicted %lld measured %lld (%+.1f%%); step predicted %.4f s "
        "measured %.4f s (%+.1f%%)\n[plan]   predicted:%s\n",
        k.what, static_cast<long long>(p.memory.peak_bytes),
        static_cast<long long>(r.peak_step_bytes), 100 * memory_err, p.time.total, step,
        100 * time_err, plan::time_terms(p.time).c_str());
    EXPECT_LE(std::abs(memory_err), 0.10) << k.what;
    EXPECT_LE(std::abs(time_err), 0.15) << k.what;
  }
}
