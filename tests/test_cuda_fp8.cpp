// FP8 on the GPU (model.moe.expert_dtype = fp8, docs/fp8.md) against the CPU reference: the
// quantisers write the CPU's bytes and scales, the sm90 block-scaled grouped GEMM (and the
// dequantising fallback) computes the CPU's products to bf16 rounding, and an MoE layer with FP8
// experts on the GPU follows the same layer on the CPU.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "cuda_testing.h"
#include "gradcheck.h"
#include "xmoe/backend/cuda/kernels.h"
#include "xmoe/comm/group.h"
#include "xmoe/moe/layer.h"
#include "xmoe/ops/fp8.h"
#include "xmoe/ops/ops.h"

using namespace xmoe;
using xmoe::testing::host_f32;
using xmoe::testing::kCuda;
using xmoe::testing::normalised_error;
using xmoe::testing::randn;

namespace {

Tensor bf16_on_gpu(const Tensor& x) {
  return ops::cast(x.to(kCuda), DType::bf16);
}

}  // namespace

TEST(CudaFp8, QuantisersWriteTheCpuBytesAndScales) {
  XMOE_REQUIRE_CUDA();
  const std::vector<int64_t> sizes{37, 0, 300, 1, 129};
  // k = 200: partial blocks (the one-block-per-warp kernel); 1408 (11 blocks: a half-empty last
  // pair) and 256: whole blocks (the wide kernel); bf16 and f32 rows.
  for (const int64_t k : {200, 1408, 256})
    for (DType dt : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(fmt::format("k {} {}", k, dtype_name(dt)));
      const Tensor x = ops::cast(randn({467, k}, 1).to(kCuda), dt);
      const ops::Fp8Rows g = ops::quantize_rows_fp8(x, sizes);
      const ops::Fp8Rows c = ops::quantize_rows_fp8(host_f32(x), sizes);
      EXPECT_EQ(g.data.to(Device::cpu()).to_vector<uint8_t>(), c.data.to_vector<uint8_t>());
      EXPECT_EQ(g.scales.to(Device::cpu()).to_vector<float>(), c.scales.to_vector<float>());
      EXPECT_EQ(normalised_error(ops::dequantize_rows_fp8(g, DType::f32),
                                 ops::dequantize_rows_fp8(c, DType::f32)),
                0.0);
    }
  for (DType dt : {DType::bf16, DType::f32}) {
    const Tensor w = ops::cast(randn({3, 200, 300}, 2, 0.02f).to(kCuda), dt);
    const ops::Fp8Weights gw = ops::quantize_weights_fp8(w),
                          cw = ops::quantize_weights_fp8(host_f32(w));
    EXPECT_EQ(gw.data.to(Device::cpu()).to_vector<uint8_t>(), cw.data.to_vector<uint8_t>());
    EXPECT_EQ(gw.data_t.to(Device::cpu()).to_vector<uint8_t>(), cw.data_t.to_vector<uint8_t>());
    EXPECT_EQ(gw.scales.to(Device::cpu()).to_vector<float>(), cw.scales.to_vector<float>());
    EXPECT_EQ(gw.scales_t.to(Device::cpu()).to_vector<float>(), cw.scales_t.to_vector<float>());
  }
}

// The fused SwiGLU quantiser writes the bytes and scales of swiglu then quantize_rows_fp8 on the
// GPU (bitwise: one expression, one rounding to the rows' dtype), and follows the CPU's.
TEST(CudaFp8, SwigluQuantiserWritesTheTwoPassBytes) {
  XMOE_REQUIRE_CUDA();
  const std::vector<int64_t> sizes{37, 0, 300, 1, 129};
  // f = 200: partial blocks (one block per warp, 4-wide loads); 130: element by element; 1408
  // and 256: whole blocks (the wide kernel).
  for (const int64_t f : {200, 130, 1408, 256})
    for (DType dt : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(fmt::format("f {} {}", f, dtype_name(dt)));
      const Tensor h = ops::cast(randn({467, 2 * f}, 5, 2.0f).to(kCuda), dt);
      const ops::Fp8Rows fused = ops::swiglu_quantize_rows_fp8(h, sizes);
      const ops::Fp8Rows two_pass = ops::quantize_rows_fp8(ops::swiglu(h), sizes);
      EXPECT_EQ(fused.data.to(Device::cpu()).to_vector<uint8_t>(),
                two_pass.data.to(Device::cpu()).to_vector<uint8_t>());
      EXPECT_EQ(fused.scales.to(Device::cpu()).to_vector<float>(),
                two_pass.scales.to(Device::cpu()).to_vector<float>());
      const ops::Fp8Rows cpu = ops::swiglu_quantize_rows_fp8(host_f32(h), sizes);
      EXPECT_LT(normalised_error(ops::dequantize_rows_fp8(fused, DType::f32),
                                 ops::dequantize_rows_fp8(cpu, DType::f32)),
                dt == DType::bf16 ? 0.04 : 1e-3);
    }
}

// The gathering quantiser (the FP8 experts' input read from x through the order's indices) writes
// the bytes and scales of quantising the gathered rows, on every kernel path, and reads an index
// out of range as a row of zeros, as gather_rows does on the device.
TEST(CudaFp8, GatherQuantiserWritesTheGatheredBytes) {
  XMOE_REQUIRE_CUDA();
  const std::vector<int64_t> sizes{37, 0, 300, 1, 129};
  const int64_t n = 467, tokens = 151;
  std::vector<int32_t> ids(n);
  for (int64_t r = 0; r < n; ++r) ids[r] = static_cast<int32_t>((r * 61 + 7) % tokens);
  ids[40] = -1;
  ids[41] = static_cast<int32_t>(tokens);
  const Tensor index = Tensor::from_vector(ids, {n}).to(kCuda);
  for (const int64_t k : {200, 130, 2048, 256})
    for (DType dt : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(fmt::format("k {} {}", k, dtype_name(dt)));
      const Tensor x = ops::cast(randn({tokens, k}, 9, 2.0f).to(kCuda), dt);
      const ops::Fp8Rows fused = ops::gather_quantize_rows_fp8(x, index, sizes);
      const ops::Fp8Rows two_pass = ops::quantize_rows_fp8(ops::gather_rows(x, index), sizes);
      EXPECT_EQ(fused.data.to(Device::cpu()).to_vector<uint8_t>(),
                two_pass.data.to(Device::cpu()).to_vector<uint8_t>());
      EXPECT_EQ(fused.scales.to(Device::cpu()).to_vector<float>(),
                two_pass.scales.to(Device::cpu()).to_vector<float>());
    }
}

// Uneven groups (one empty, one of a single row), both directions, two layer shapes: the sm90
// kernel (counted) within bf16 rounding of the CPU's products of the same quantised operands; an
// f32 output takes the dequantising path, to f32 rounding.
TEST(CudaFp8, GroupedMatmulMatchesTheCpuProducts) {
  XMOE_REQUIRE_CUDA();
  const bool sm90 = cuda::grouped_gemm_sm90_available(0);
  struct Shape3 {
    int64_t k, m;
  };
  for (const Shape3 s : {Shape3{256, 384}, Shape3{1024, 512}}) {
    const std::vector<int64_t> sizes{37, 0, 300, 1, 1290};
    int64_t n = 0;
    for (int64_t r : sizes) n += r;
    const Tensor w = bf16_on_gpu(randn({5, s.k, s.m}, 3, 0.03f));
    const ops::Fp8Weights gw = ops::quantize_weights_fp8(w),
                          cw = ops::quantize_weights_fp8(host_f32(w));
    for (bool trans : {false, true}) {
      const Tensor x = bf16_on_gpu(randn({n, trans ? s.m : s.k}, 4));
      const ops::Fp8Rows gx = ops::quantize_rows_fp8(x, sizes),
                         cx = ops::quantize_rows_fp8(host_f32(x), sizes);
      const int64_t before = cuda::grouped_gemm_calls(cuda::GroupedGemmKind::fp8).sm90;
      const Tensor y = ops::grouped_matmul_fp8(gx, gw, trans, DType::bf16);
      const int64_t after = cuda::grouped_gemm_calls(cuda::GroupedGemmKind::fp8).sm90;
      const Tensor ref = ops::grouped_matmul_fp8(cx, cw, trans, DType::f32);
      const double err = normalised_error(y, ref);
      std::printf("[fp8] K %lld M %lld%s: sm90 kernel %s, error vs CPU %.2e\n",
                  static_cast<long long>(s.k), static_cast<long long>(s.m), trans ? " (w^T)" : "",
                  after > before ? "ran" : "did not run", err);
      EXPECT_LT(err, 8e-3);
      if (sm90) {
        EXPECT_EQ(after, before + 1) << "the sm90 FP8 kernel did not run";
      }
      const Tensor y32 = ops::grouped_matmul_fp8(gx, gw, trans, DType::f32);
      EXPECT_LT(normalised_error(y32, ref), 1e-5);
    }
  }
}

namespace {

/// hook_rows: a hook on the order stage's rows, which makes the layer gather them itself.
std::vector<Tensor> run_layer(Device dev, const std::string& expert_dtype, bool hook_rows = false) {
  MoeConfig c;
  c.num_experts = 16;
  c.top_k = 4;
  c.expert_hidden = 256;
  c.num_shared_experts = 0;
  c.expert_dtype = expert_dtype;
  constexpr int64_t d = 512, T = 2048, seq = 128;
  auto one = comm::make_single_group();
  moe::MoELayer layer(c, d, "moe", 7, 0.02f, 0.02f, moe::LayerGroups{one, one});
  if (hook_rows) layer.hooks().on<moe::OrderOut>([](moe::OrderOut&) {});
  for (Parameter* p : layer.parameters()) {
    p->value = p->value.to(dev);
    p->grad = p->grad.to(dev);
  }
  Tensor x = randn({T, d}, 1).to(DType::bf16).to(DType::f32);  // bf16 values
  Tensor dy = randn({T, d}, 2, 0.1f).to(DType::bf16).to(DType::f32);
  if (!dev.is_cpu()) {
    x = bf16_on_gpu(x);
    dy = bf16_on_gpu(dy);
  }
  layer.zero_grad();
  std::vector<Tensor> out{host_f32(layer.forward(x, seq))};
  out.push_back(host_f32(layer.backward(dy)));
  for (Parameter* p : layer.parameters()) {
    p->settle_grad();
    out.push_back(host_f32(p->grad));
  }
  return out;
}

}  // namespace

// On the GPU too, the FP8 layer that quantises x's rows through the order's indices (no hook)
// computes the bits of the one that gathers them first (a hook on the rows).
TEST(CudaFp8, MoeLayerQuantisesItsRowsStraightFromX) {
  XMOE_REQUIRE_CUDA();
  const std::vector<Tensor> fused = run_layer(kCuda, "fp8"),
                            gathered = run_layer(kCuda, "fp8", true);
  ASSERT_EQ(fused.size(), gathered.size());
  for (size_t i = 0; i < fused.size(); ++i)
    EXPECT_EQ(fused[i].to_vector<float>(), gathered[i].to_vector<float>()) << "tensor " << i;
}

TEST(CudaFp8, MoeLayerFollowsTheCpuLayer) {
  XMOE_REQUIRE_CUDA();
  const std::vector<Tensor> cpu = run_layer(Device::cpu(), "fp8"), gpu = run_layer(kCuda, "fp8");
  const std::vector<Tensor> gpu_bf16 = run_layer(kCuda, "bf16");
  ASSERT_EQ(cpu.size(), gpu.size());
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double err = normalised_error(gpu[i], cpu[i]);
    std::printf("[fp8] layer tensor %zu: GPU fp8 vs CPU fp8 %.2e, GPU fp8 vs GPU bf16 %.2e\n", i,
                err, normalised_error(gpu[i], gpu_bf16[i]));
    EXPECT_LT(err, 3e-2) << "tensor " << i;
  }
}
