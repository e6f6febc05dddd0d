// FP8 on the GPU (model.moe.expert_dtype = fp8, docs/fp8.md) against the CPU reference: the
// quantisers write the CPU's bytes and scales, the sm90 block-scaled grouped GEMM (and the
// dequantising fallback) computes the CPU's products to bf16 rounding, and an MoE layer with FP8
// experts on the GPU follows the same layer on the CPU.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <vector>

#include "cuda_testing.h"
#include "gradcheck.h"
#include "xmoe/backend/cuda/kernels.h"
#include "xmoe/comm/group.h"
#include "xmoe/moe/layer.h"
#include "xmoe/ops/fp8.h"
#include "xmoe/ops/moe.h"
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

/// a and b hold the same FP8 bytes and the same scales (wherever each lives).
void expect_same_fp8_rows(const ops::Fp8Rows& a, const ops::Fp8Rows& b) {
  EXPECT_EQ(a.data.to(Device::cpu()).to_vector<uint8_t>(),
            b.data.to(Device::cpu()).to_vector<uint8_t>());
  EXPECT_EQ(a.scales.to(Device::cpu()).to_vector<float>(),
            b.scales.to(Device::cpu()).to_vector<float>());
}

/// An order stage's index i32 [n] on the GPU: row r reads token (61 r + 7) % tokens, and row 40
/// is a padding slot (-1); with `beyond`, row 41 reads one past the last token.
Tensor order_index(int64_t n, int64_t tokens, bool beyond) {
  std::vector<int32_t> ids(n);
  for (int64_t r = 0; r < n; ++r) ids[r] = static_cast<int32_t>((r * 61 + 7) % tokens);
  ids[40] = -1;
  if (beyond) ids[41] = static_cast<int32_t>(tokens);
  return Tensor::from_vector(ids, {n}).to(kCuda);
}

}  // namespace

TEST(CudaFp8, QuantisersWriteTheCpuBytesAndScales) {
  XMOE_REQUIRE_CUDA();
  const std::vector<int64_t> sizes{37, 0, 300, 1, 129};
  // k = 200: partial blocks (the one-block-per-warp kernel); 1408, 384, 256 and 128: whole
  // blocks (the wide kernel, whose warps take 8 blocks of 1 to 8 rows, across group boundaries);
  // bf16 and f32 rows.
  for (const int64_t k : {200, 1408, 384, 256, 128})
    for (DType dt : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(fmt::format("k {} {}", k, dtype_name(dt)));
      const Tensor x = ops::cast(randn({467, k}, 1).to(kCuda), dt);
      const ops::Fp8Rows g = ops::quantize_rows_fp8(x, sizes);
      const ops::Fp8Rows c = ops::quantize_rows_fp8(host_f32(x), sizes);
      expect_same_fp8_rows(g, c);
      EXPECT_EQ(normalised_error(ops::dequantize_rows_fp8(g, DType::f32),
                                 ops::dequantize_rows_fp8(c, DType::f32)),
                0.0);
    }
  // Weights: edge tiles and whole ones (those transposed through swizzled shared memory).
  for (const Shape& shape : {Shape{3, 200, 300}, Shape{2, 256, 384}})
    for (DType dt : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(
          fmt::format("weights {}x{}x{} {}", shape[0], shape[1], shape[2], dtype_name(dt)));
      const Tensor w = ops::cast(randn(shape, 2, 0.02f).to(kCuda), dt);
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
      expect_same_fp8_rows(fused, two_pass);
      const ops::Fp8Rows cpu = ops::swiglu_quantize_rows_fp8(host_f32(h), sizes);
      EXPECT_LT(normalised_error(ops::dequantize_rows_fp8(fused, DType::f32),
                                 ops::dequantize_rows_fp8(cpu, DType::f32)),
                dt == DType::bf16 ? 0.04 : 1e-3);
    }
}

// SwiGLU's backward with dh's FP8 rows in one pass writes the bytes of the two passes it
// replaces (swiglu_backward_with_value_, then quantize_rows_fp8 of dh), bitwise: dh, swiglu(h)
// and dh's bytes and scales, written in two runs of groups into one buffer.
TEST(CudaFp8, SwigluBackwardQuantiserWritesTheTwoPassBytes) {
  XMOE_REQUIRE_CUDA();
  const std::vector<int64_t> sizes{37, 0, 300, 1, 129};
  // f = 128, 256, 384, 1408: the fused kernel (1, 2, 3, 11 blocks a row, warps across rows and
  // groups); 200: the two passes.
  for (const int64_t f : {128, 256, 384, 1408, 200})
    for (DType dt : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(fmt::format("f {} {}", f, dtype_name(dt)));
      const Tensor h = ops::cast(randn({467, 2 * f}, 15, 2.0f).to(kCuda), dt);
      const Tensor da = ops::cast(randn({467, f}, 16).to(kCuda), dt);
      Tensor h_ref = h.clone(), da_ref = da.clone();
      ops::swiglu_backward_with_value_(h_ref, da_ref);
      const ops::Fp8Rows ref = ops::quantize_rows_fp8(h_ref, sizes);
      Tensor h_q = h.clone(), da_q = da.clone();
      ops::Fp8Rows q = ops::empty_fp8_rows(2 * f, sizes, kCuda);
      for (const auto& [g0, g1, r0, r1] :
           std::vector<std::array<int64_t, 4>>{{0, 3, 0, 337}, {3, 5, 337, 467}}) {
        Tensor hc = h_q.rows(r0, r1), dac = da_q.rows(r0, r1);
        ops::Fp8Rows qc = q.groups(g0, g1);
        ops::swiglu_backward_with_value_fp8_(hc, dac, qc);
      }
      EXPECT_TRUE(xmoe::testing::bitwise_equal(h_q, h_ref));
      EXPECT_TRUE(xmoe::testing::bitwise_equal(da_q, da_ref));
      expect_same_fp8_rows(q, ref);
    }
}

// The gathering quantiser (the FP8 experts' input read from x through the order's indices) writes
// the bytes and scales of quantising the gathered rows, on every kernel path, and reads an index
// out of range as a row of zeros, as gather_rows does on the device.
TEST(CudaFp8, GatherQuantiserWritesTheGatheredBytes) {
  XMOE_REQUIRE_CUDA();
  const std::vector<int64_t> sizes{37, 0, 300, 1, 129};
  const int64_t n = 467, tokens = 151;
  const Tensor index = order_index(n, tokens, true);
  for (const int64_t k : {200, 130, 2048, 256})
    for (DType dt : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(fmt::format("k {} {}", k, dtype_name(dt)));
      const Tensor x = ops::cast(randn({tokens, k}, 9, 2.0f).to(kCuda), dt);
      const ops::Fp8Rows fused = ops::gather_quantize_rows_fp8(x, index, sizes);
      const ops::Fp8Rows two_pass = ops::quantize_rows_fp8(ops::gather_rows(x, index), sizes);
      expect_same_fp8_rows(fused, two_pass);
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

/// hook_rows: a hook on the order stage's rows, which makes the layer gather them itself;
/// hook_combine_grad: one on the experts' output gradient, which makes them quantise it
/// themselves (not read the I-Order's FP8 rows).
std::vector<Tensor> run_layer(Device dev, const std::string& expert_dtype, bool hook_rows = false,
                              bool hook_combine_grad = false) {
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
  if (hook_combine_grad) layer.hooks().on<moe::CombineGrad>([](moe::CombineGrad&) {});
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

// The I-Order's backward that also writes d_rows' FP8 rows writes the bytes of the plain pass
// and of quantize_rows_fp8 after it: d_rows, the dots, the FP8 bytes and scales, bitwise (dy
// f32 or the rows' dtype, in place or not, a padding row; d = 200 takes the two passes).
TEST(CudaFp8, IOrderBackwardWritesTheFp8RowsOfItsGradient) {
  XMOE_REQUIRE_CUDA();
  const std::vector<int64_t> sizes{37, 0, 300, 1, 129};
  const int64_t n = 467, tokens = 151;
  const Tensor index = order_index(n, tokens, false);
  const Tensor weight = randn({n}, 17).to(kCuda);
  for (const int64_t d : {1024, 384, 128, 200})
    for (DType dt : {DType::bf16, DType::f32})
      for (const bool dy_f32 : {false, true})
        for (const bool in_place : {false, true}) {
          SCOPED_TRACE(fmt::format("d {} {} dy {} in place {}", d, dtype_name(dt),
                                   dy_f32 ? "f32" : "rows'", in_place));
          const Tensor rows = ops::cast(randn({n, d}, 18).to(kCuda), dt);
          const Tensor dy = ops::cast(randn({tokens, d}, 19).to(kCuda), dy_f32 ? DType::f32 : dt);
          const ops::WeightedGather ref =
              ops::gather_weighted_rows_dot(dy, rows.clone(), index, weight);
          const ops::Fp8Rows ref_q = ops::quantize_rows_fp8(ref.d_rows, sizes);
          const ops::WeightedGather got =
              ops::gather_weighted_rows_dot(dy, rows.clone(), index, weight, in_place, sizes);
          EXPECT_TRUE(xmoe::testing::bitwise_equal(got.d_rows, ref.d_rows));
          EXPECT_TRUE(xmoe::testing::bitwise_equal(got.dot, ref.dot));
          EXPECT_TRUE(xmoe::testing::bitwise_equal(got.d_rows_fp8.data, ref_q.data));
          EXPECT_TRUE(xmoe::testing::bitwise_equal(got.d_rows_fp8.scales, ref_q.scales));
          EXPECT_EQ(got.d_rows_fp8.group_sizes, sizes);
        }
}

// The layer whose experts read their output gradient's FP8 rows from the I-Order's pass computes
// the bits of the one whose experts quantise it themselves (a hook on that gradient).
TEST(CudaFp8, MoeLayerTakesItsOutputGradientInFp8FromTheIOrder) {
  XMOE_REQUIRE_CUDA();
  const std::vector<Tensor> fused = run_layer(kCuda, "fp8"),
                            quantised_by_experts = run_layer(kCuda, "fp8", false, true);
  ASSERT_EQ(fused.size(), quantised_by_experts.size());
  for (size_t i = 0; i < fused.size(); ++i)
    EXPECT_EQ(fused[i].to_vector<float>(), quantised_by_experts[i].to_vector<float>())
        << "tensor " << i;
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
