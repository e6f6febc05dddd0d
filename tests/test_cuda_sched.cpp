// `xmoe profile` on one GPU: the compute models in bf16 (device synchronisation around each
// repetition), the GPU's name in the machine description, GEMM predictions that grow with rows.
#include <gtest/gtest.h>

#include <cmath>

#include "cuda_testing.h"
#include "xmoe/comm/group.h"
#include "xmoe/sched/profiler.h"

using namespace xmoe;
using namespace xmoe::sched;

TEST(CudaProfile, QuickProfileFitsTheComputeTasksInBf16) {
  XMOE_REQUIRE_CUDA();
  ProfileOptions o;
  o.quick = true;
  o.gemm_shapes = {{1024, 512}};
  const Profile p = run_profile(comm::make_single_group(), xmoe::testing::kCuda, o);
  EXPECT_EQ(p.machine.device, "cuda");
  EXPECT_FALSE(p.machine.device_name.empty());
  ASSERT_EQ(p.models.size(), 5u);
  for (const TaskModel& m : p.models) {
    EXPECT_EQ(m.dtype, "bf16") << task_name(m.task);
    EXPECT_TRUE(std::isfinite(m.fit.alpha) && m.fit.alpha >= 0) << task_name(m.task);
    EXPECT_TRUE(std::isfinite(m.fit.beta) && m.fit.beta >= 0) << task_name(m.task);
    for (double t : m.t) EXPECT_GT(t, 0.0) << task_name(m.task);
    std::printf("[profile] %-21s alpha %8.2f us  beta %.4g s/unit  R2 %.5f  held-out %.1f%%\n",
                std::string(task_name(m.task)).c_str(), m.fit.alpha * 1e6, m.fit.beta, m.fit.r2,
                100 * m.heldout_error());
  }
  // 2048 rows x 1024 x 512 (2.1 GFLOP) takes longer than 16 rows (launch-bound), and a bf16
  // grouped GEMM of that size runs well above 1 TFLOP/s on any GPU xmoe targets.
  const double big = p.predict_gemm(Task::gemm_forward, 2048, 1024, 512);
  EXPECT_GT(big, p.predict_gemm(Task::gemm_forward, 16, 1024, 512));
  EXPECT_LT(big, 2.0 * 2048 * 1024 * 512 / 1e12);
}
