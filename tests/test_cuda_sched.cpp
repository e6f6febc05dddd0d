// `xmoe profile` on one GPU: the compute models in bf16 (device synchronisation around each
// repetition), the GPU's name in the machine description, GEMM predictions that grow with rows.
// The pipelined MoE layer on one GPU over an NCCL self-exchange: equal to unchunked, and the
// communication stream overlapping compute.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "cuda_testing.h"
#include "gradcheck.h"
#include "xmoe/comm/group.h"
#include "xmoe/comm/nccl/nccl_group.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/timer.h"
#include "xmoe/moe/layer.h"
#include "xmoe/ops/ops.h"
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
  // GEMM forward / data grad / weight grad, row gather / scatter, AdamW, attention forward /
  // backward.
  ASSERT_EQ(p.models.size(), 8u);
  for (const TaskModel& m : p.models) {
    // AdamW runs on the f32 master weights; everything else in the compute dtype.
    EXPECT_EQ(m.dtype, m.task == Task::adamw ? "f32" : "bf16") << task_name(m.task);
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

// ---- The pipelined MoE layer on one GPU (model.moe.pipeline)
// -------------------------------------

namespace {

/// y, dx and every gradient of one forward/backward of a bf16 MoE layer on cuda:0 whose ep group
/// is `group` (one rank), with `chunks` chunks each way.
std::vector<Tensor> run_moe_layer(const std::shared_ptr<comm::Group>& group, int chunks) {
  MoeConfig c;
  c.num_experts = 16;
  c.top_k = 4;
  c.expert_hidden = 256;
  c.num_shared_experts = 0;
  c.dispatch = "all_to_all";
  constexpr int64_t d = 512, T = 2048, seq = 128;
  moe::MoELayer layer(c, d, "moe", 7, 0.02f, 0.02f, moe::LayerGroups{group, group});
  for (Parameter* p : layer.parameters()) {
    p->value = p->value.to(xmoe::testing::kCuda);
    p->grad = p->grad.to(xmoe::testing::kCuda);
  }
  layer.set_pipeline(chunks, chunks);
  const Tensor x = ops::cast(xmoe::testing::randn({T, d}, 1).to(xmoe::testing::kCuda), DType::bf16);
  const Tensor dy =
      ops::cast(xmoe::testing::randn({T, d}, 2, 0.1f).to(xmoe::testing::kCuda), DType::bf16);
  layer.zero_grad();
  std::vector<Tensor> out{xmoe::testing::host_f32(layer.forward(x, seq))};
  out.push_back(xmoe::testing::host_f32(layer.backward(dy)));
  for (Parameter* p : layer.parameters()) {
    p->settle_grad();
    out.push_back(xmoe::testing::host_f32(p->grad));
  }
  return out;
}

}  // namespace

// One GPU, the layer's exchange an NCCL self send/recv (an ep group of one rank over NCCL, so
// every chunk really goes through the communication stream): (1) the layer with 4 chunks equals
// the unchunked one (bitwise expected: each expert's grouped GEMMs are the same calls; checked to
// bf16 rounding, 1e-3 normalised, and the bitwise outcome printed); (2) the communication stream
// overlaps compute: a self-exchange started before a chain of GEMMs, waited for after them,
// takes less than the two alone, and the host queues all of it without waiting for the device.
TEST(CudaSched, PipelinedLayerOverlapsNcclSelfExchange) {
  XMOE_REQUIRE_CUDA();
  if (!comm::nccl::available()) GTEST_SKIP() << "this build has no NCCL (XMOE_NCCL=OFF)";
  // One GPU has no link: with NCCL's default channels a self-exchange is an HBM copy over every
  // SM, which the GEMMs need too, so nothing can overlap (seen on an H100: -5%). Between GPUs
  // the exchange is link-bound on a few CTAs; capping NCCL at 4 CTAs (read when the
  // communicator is made) gives the self-exchange that shape.
  setenv("NCCL_MAX_CTAS", "4", 1);
  setenv("NCCL_MIN_CTAS", "1", 1);
  auto nccl = comm::nccl::make_group(comm::make_single_group(), 0);
  const std::vector<Tensor> ref = run_moe_layer(nccl, 1), piped = run_moe_layer(nccl, 4);
  ASSERT_EQ(ref.size(), piped.size());
  bool bitwise = true;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_LE(xmoe::testing::normalised_error(piped[i], ref[i]), 1e-3) << "tensor " << i;
    bitwise = bitwise && piped[i].to_vector<float>() == ref[i].to_vector<float>();
  }
  std::printf("[pipeline] layer with 4 chunks vs 1 on cuda:0 over NCCL: %s\n",
              bitwise ? "bitwise equal" : "equal to bf16 rounding, not bitwise");

  const Device dev = xmoe::testing::kCuda;
  constexpr int64_t kRows = 1 << 20, kWidth = 256;  // 1 GiB of f32 rows to itself
  const Tensor send = Tensor::zeros({kRows, kWidth}, DType::f32, dev);
  Tensor recv = Tensor::empty({kRows, kWidth}, DType::f32, dev);
  const std::vector<int64_t> rows{kRows}, at{0};
  const Tensor a = ops::cast(Tensor::zeros({8192, 8192}, DType::f32, dev), DType::bf16);
  auto exchange = [&] { return nccl->all_to_all_v_rows_async(send, rows, at, recv, rows, at); };
  auto compute = [&](int n) {
    for (int i = 0; i < n; ++i) ops::matmul(a, a);
  };
  auto timed = [&](auto&& body) {
    backend::synchronize(dev);
    Timer t;
    body();
    backend::synchronize(dev);
    return t.seconds();
  };
  timed([&] { exchange()->wait(); });  // warm-up: NCCL's first p2p connects
  compute(2);
  const double t_comm = timed([&] { exchange()->wait(); });
  // As many GEMMs (1.1 TFLOP each) as take about the exchange's time.
  const double t_one = timed([&] { compute(1); });
  const int n = std::max(1, static_cast<int>(t_comm / t_one + 0.5));
  const double t_comp = timed([&] { compute(n); });
  double host = 0;
  const double t_both = timed([&] {
    Timer h;
    auto w = exchange();
    compute(n);
    w->wait();
    host = h.seconds();  // queued, not done: no host sync on the way
  });
  const double overlap = (t_comm + t_comp - t_both) / std::min(t_comm, t_comp);
  std::printf(
      "[pipeline] NCCL self-exchange 1 GiB %.3f ms, %d GEMMs 8192^3 bf16 %.3f ms, both %.3f ms "
      "(host queued them in %.3f ms): overlap %.0f%% of the shorter\n",
      t_comm * 1e3, n, t_comp * 1e3, t_both * 1e3, host * 1e3, 100 * overlap);
  EXPECT_GT(overlap, 0.25);
  EXPECT_LT(host, 0.5 * t_both);
}
