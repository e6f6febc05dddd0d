// FP8 E4M3 block quantisation and the FP8 grouped GEMM on the CPU (model.moe.expert_dtype = fp8,
// docs/fp8.md): the conversion against the format's definition, the block scales and layouts the
// sm90 kernel reads, the GEMM against exact f32 products, and an MoE layer against its bf16 run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "cuda_testing.h"
#include "gradcheck.h"
#include "xmoe/comm/group.h"
#include "xmoe/core/allocator.h"
#include "xmoe/core/fp8.h"
#include "xmoe/moe/expert.h"
#include "xmoe/moe/layer.h"
#include "xmoe/ops/fp8.h"
#include "xmoe/ops/ops.h"

using namespace xmoe;
using xmoe::testing::normalised_error;
using xmoe::testing::randn;

TEST(Fp8, E4m3ConversionRoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(fp8::e4m3_from_float(0.f), 0x00);
  EXPECT_EQ(fp8::e4m3_from_float(-0.f), 0x80);
  EXPECT_EQ(fp8::e4m3_from_float(1.f), 0x38);    // exponent 7 (bias 7), mantissa 0
  EXPECT_EQ(fp8::e4m3_from_float(-1.5f), 0xbc);  // 1.100b
  EXPECT_EQ(fp8::e4m3_from_float(448.f), 0x7e);  // the largest finite value
  EXPECT_EQ(fp8::e4m3_from_float(1e6f), 0x7e);   // saturates
  EXPECT_EQ(fp8::e4m3_from_float(-INFINITY), 0xfe);
  EXPECT_EQ(fp8::e4m3_from_float(NAN) & 0x7f, 0x7f);
  EXPECT_EQ(fp8::e4m3_from_float(0x1p-9f), 0x01);   // the smallest subnormal
  EXPECT_EQ(fp8::e4m3_from_float(0x1p-10f), 0x00);  // a tie: to even (0)
  EXPECT_EQ(fp8::e4m3_from_float(0x3p-10f), 0x02);  // 1.5 subnormal steps: to even (2)
  EXPECT_EQ(fp8::e4m3_from_float(1.0625f), 0x38);   // halfway 1 and 1.125: to even (1)
  EXPECT_EQ(fp8::e4m3_from_float(1.1875f), 0x3a);   // halfway 1.125 and 1.25: to even (1.25)
  EXPECT_EQ(fp8::e4m3_from_float(0.0155f), 0x08);   // rounds up into the smallest normal
  EXPECT_TRUE(std::isnan(fp8::e4m3_to_float(0x7f)));
  // Every finite byte decodes to a value that encodes back to it; values between two neighbours
  // go to the nearer one.
  for (int b = 0; b < 256; ++b) {
    const auto byte = static_cast<uint8_t>(b);
    if ((byte & 0x7f) == 0x7f) continue;
    const float v = fp8::e4m3_to_float(byte);
    EXPECT_EQ(fp8::e4m3_from_float(v), byte) << "byte " << b << " value " << v;
    if ((byte & 0x80) == 0 && byte < 0x7e) {
      const float next = fp8::e4m3_to_float(static_cast<uint8_t>(byte + 1));
      EXPECT_EQ(fp8::e4m3_from_float(v + 0.3f * (next - v)), byte);
      EXPECT_EQ(fp8::e4m3_from_float(v + 0.7f * (next - v)), byte + 1);
    }
  }
  EXPECT_EQ(fp8::e4m3_to_float(0x7e), 448.f);
  EXPECT_EQ(fp8::e4m3_to_float(0x01), 0x1p-9f);
}

// Rows in groups (one empty), K with a partial last block: each (row, 128 columns) has the scale
// amax / 448 at the grouped index the kernel reads, and dequantises within e4m3's step.
TEST(Fp8, RowQuantisationScalesEachRowBlock) {
  const std::vector<int64_t> sizes{100, 0, 150, 50};
  const int64_t n = 300, k = 200, kb = 2;
  const Tensor x = randn({n, k}, 3);
  const ops::Fp8Rows q = ops::quantize_rows_fp8(x, sizes);
  ASSERT_EQ(q.scales.numel(), n * kb);
  const Tensor back = ops::dequantize_rows_fp8(q, DType::f32);
  const float* xs = x.data<float>();
  const float* bs = back.data<float>();
  const float* sc = q.scales.data<float>();
  int64_t o = 0;
  for (int64_t rows : sizes) {
    for (int64_t r = o; r < o + rows; ++r)
      for (int64_t j = 0; j < kb; ++j) {
        float amax = 0;
        for (int64_t c = j * 128; c < std::min(k, (j + 1) * 128); ++c)
          amax = std::max(amax, std::fabs(xs[r * k + c]));
        ASSERT_FLOAT_EQ(sc[o * kb + j * rows + (r - o)], amax / 448.f) << "row " << r;
        for (int64_t c = j * 128; c < std::min(k, (j + 1) * 128); ++c)
          ASSERT_LE(std::fabs(bs[r * k + c] - xs[r * k + c]), amax / 16 + 1e-7f)
              << "row " << r << " col " << c;
      }
    o += rows;
  }
  const double err = normalised_error(back, x);
  EXPECT_GT(err, 1e-3);  // really quantised
  EXPECT_LT(err, 0.05);
}

// Weights [G, K, M] with partial blocks both ways: per 128 x 128 scales, the transposed copies
// exactly the transposes.
TEST(Fp8, WeightQuantisationKeepsBothLayouts) {
  const int64_t g = 3, k = 200, m = 300;
  const Tensor w = randn({g, k, m}, 4, 0.02f);
  const ops::Fp8Weights q = ops::quantize_weights_fp8(w);
  ASSERT_EQ(q.scales.shape(), (Shape{g, 2, 3}));
  ASSERT_EQ(q.scales_t.shape(), (Shape{g, 3, 2}));
  const uint8_t* d = q.data.data<uint8_t>();
  const uint8_t* dt = q.data_t.data<uint8_t>();
  for (int64_t e = 0; e < g; ++e) {
    for (int64_t r = 0; r < k; ++r)
      for (int64_t c = 0; c < m; ++c) ASSERT_EQ(d[(e * k + r) * m + c], dt[(e * m + c) * k + r]);
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t j = 0; j < 3; ++j)
        EXPECT_EQ(q.scales.data<float>()[(e * 2 + i) * 3 + j],
                  q.scales_t.data<float>()[(e * 3 + j) * 2 + i]);
  }
  const double err = normalised_error(ops::dequantize_weights_fp8(q, DType::f32), w);
  EXPECT_GT(err, 1e-3);
  EXPECT_LT(err, 0.05);
}

// The fused SwiGLU quantiser (the expert forward's down-projection input) quantises swiglu(h):
// within FP8's error of it, refusing an h that is not [N, 2f] or rows its groups do not cover.
TEST(Fp8, SwigluQuantiserQuantisesTheActivation) {
  const std::vector<int64_t> sizes{37, 0, 130, 1};
  const Tensor h = randn({168, 2 * 200}, 6, 2.0f);
  const ops::Fp8Rows q = ops::swiglu_quantize_rows_fp8(h, sizes);
  ASSERT_EQ(q.data.shape(), (Shape{168, 200}));
  EXPECT_EQ(q.group_sizes, sizes);
  const double err = normalised_error(ops::dequantize_rows_fp8(q, DType::f32), ops::swiglu(h));
  EXPECT_GT(err, 1e-3);
  EXPECT_LT(err, 0.05);
  EXPECT_THROW(ops::swiglu_quantize_rows_fp8(randn({168, 201}, 7), sizes), Error);
  EXPECT_THROW(ops::swiglu_quantize_rows_fp8(h, std::vector<int64_t>{37, 130}), Error);
}

// The gathering quantiser (the FP8 experts' input read from x through the order's indices) is
// the quantiser of the gathered rows, and refuses a bad index.
TEST(Fp8, GatherQuantiserQuantisesTheGatheredRows) {
  const std::vector<int64_t> sizes{3, 0, 4};
  const Tensor x = randn({5, 256}, 8, 2.0f);
  const Tensor index = Tensor::from_vector(std::vector<int32_t>{4, 0, 0, 2, 1, 3, 4}, {7});
  const ops::Fp8Rows q = ops::gather_quantize_rows_fp8(x, index, sizes);
  const ops::Fp8Rows ref = ops::quantize_rows_fp8(ops::gather_rows(x, index), sizes);
  EXPECT_EQ(q.data.to_vector<uint8_t>(), ref.data.to_vector<uint8_t>());
  EXPECT_EQ(q.scales.to_vector<float>(), ref.scales.to_vector<float>());
  EXPECT_EQ(q.group_sizes, sizes);
  const Tensor bad = Tensor::from_vector(std::vector<int32_t>{4, 0, 0, 2, 5, 3, 4}, {7});
  EXPECT_THROW(ops::gather_quantize_rows_fp8(x, bad, sizes), Error);
  EXPECT_THROW(ops::gather_quantize_rows_fp8(x, index, std::vector<int64_t>{3, 3}), Error);
  const Tensor floats = Tensor::from_vector(std::vector<float>{4, 0, 0, 2, 1, 3, 4}, {7});
  EXPECT_THROW(ops::gather_quantize_rows_fp8(x, floats, sizes), Error);
}

// y = x_g @ w[g] and x_g @ w[g]^T on quantised operands: within FP8's error of the exact
// products, and exactly the products of the dequantised operands.
TEST(Fp8, GroupedMatmulFollowsTheExactProducts) {
  const std::vector<int64_t> sizes{37, 0, 130, 1};
  const int64_t n = 168, k = 256, m = 384;
  const Tensor x = randn({n, k}, 5), w = randn({4, k, m}, 6, 0.05f);
  const ops::Fp8Weights wq = ops::quantize_weights_fp8(w);
  const ops::Fp8Rows xq = ops::quantize_rows_fp8(x, sizes);
  const Tensor y = ops::grouped_matmul_fp8(xq, wq, false, DType::f32);
  EXPECT_LT(normalised_error(y, ops::grouped_matmul(x, w, sizes)), 0.06);
  EXPECT_EQ(
      normalised_error(y, ops::grouped_matmul(ops::dequantize_rows_fp8(xq, DType::f32),
                                              ops::dequantize_weights_fp8(wq, DType::f32), sizes)),
      0.0);
  const Tensor dy = randn({n, m}, 7);
  const Tensor dx =
      ops::grouped_matmul_fp8(ops::quantize_rows_fp8(dy, sizes), wq, true, DType::f32);
  EXPECT_LT(normalised_error(dx, ops::grouped_matmul(dy, w, sizes, true)), 0.06);
  // Argument checks name the op and the problem.
  EXPECT_THROW(
      {
        try {
          (void)ops::grouped_matmul_fp8(xq, wq, true, DType::f32);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("grouped_matmul_fp8"), std::string::npos);
          throw;
        }
      },
      Error);
}

namespace {

/// y, dx and the expert gradients of one forward/backward of a CPU MoE layer.
/// The layer's output, input gradient and parameter gradients. hook_rows: a hook on the order
/// stage's rows (which makes the layer gather them itself); allocated: the bytes allocated.
std::vector<Tensor> run_layer(const std::string& expert_dtype, bool hook_rows = false,
                              int64_t* allocated = nullptr) {
  MoeConfig c;
  c.num_experts = 8;
  c.top_k = 2;
  c.expert_hidden = 128;
  c.num_shared_experts = 0;
  c.expert_dtype = expert_dtype;
  constexpr int64_t d = 256, T = 512, seq = 64;
  auto one = comm::make_single_group();
  moe::MoELayer layer(c, d, "moe", 7, 0.02f, 0.02f, moe::LayerGroups{one, one});
  if (hook_rows) layer.hooks().on<moe::OrderOut>([](moe::OrderOut&) {});
  const Tensor x = randn({T, d}, 1), dy = randn({T, d}, 2, 0.1f);
  layer.zero_grad();
  const int64_t before = memory_stats().total_bytes;
  std::vector<Tensor> out{layer.forward(x, seq), layer.backward(dy)};
  if (allocated) *allocated = memory_stats().total_bytes - before;
  for (Parameter* p : layer.parameters()) {
    p->settle_grad();
    out.push_back(p->grad.clone());
  }
  return out;
}

}  // namespace

// The layer with FP8 experts (forward and data gradients quantised, weight gradients exact)
// follows the unquantised layer: output, input gradient and every parameter gradient.
TEST(Fp8, MoeLayerFollowsTheUnquantisedLayer) {
  const std::vector<Tensor> ref = run_layer("bf16"), q = run_layer("fp8");
  ASSERT_EQ(ref.size(), q.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = normalised_error(q[i], ref[i]);
    EXPECT_LT(err, 0.08) << "tensor " << i;
    if (i < 2) {
      EXPECT_GT(err, 1e-4) << "tensor " << i;  // the FP8 path ran
    }
  }
}

// With one process and nothing reading the order stage's rows, the FP8 experts quantise their
// input straight from x through the PFT indices: the same numbers as quantising the gathered
// rows (a hook on the rows makes the layer gather them), without allocating those rows.
TEST(Fp8, MoeLayerQuantisesItsRowsStraightFromX) {
  int64_t fused_bytes = 0, gathered_bytes = 0;
  const std::vector<Tensor> fused = run_layer("fp8", false, &fused_bytes);
  const std::vector<Tensor> gathered = run_layer("fp8", true, &gathered_bytes);
  ASSERT_EQ(fused.size(), gathered.size());
  for (size_t i = 0; i < fused.size(); ++i)
    EXPECT_EQ(fused[i].to_vector<float>(), gathered[i].to_vector<float>()) << "tensor " << i;
  // T * k rows of d f32: the gathered copy forward no longer makes.
  EXPECT_EQ(gathered_bytes - fused_bytes, int64_t{512} * 2 * 256 * 4);
}

// keep_weights (the trainer's micro-batches of one step): the experts quantise their weights
// once and reuse the FP8 copies across passes, so a change to the weights in between is not
// seen until keep_weights(false) drops them; without it every forward quantises afresh.
TEST(Fp8, ExpertsKeepTheirQuantisedWeightsUntilReleased) {
  moe::ExpertArgs a;
  a.prefix = "moe";
  a.num_experts = a.num_local = 3;
  a.d_model = 64;
  a.hidden = 96;
  a.seed = 11;
  a.fp8 = true;
  const std::unique_ptr<moe::Experts> experts = moe::make_experts("swiglu", a);
  const std::vector<int64_t> sizes{5, 0, 9};
  const Tensor x = randn({14, 64}, 12), dy = randn({14, 64}, 13);
  auto pass = [&] {
    Tensor y = experts->forward(x, sizes);
    experts->backward(dy);
    return y;
  };
  auto scale_weights = [&](float s) {
    for (Parameter* p : experts->parameters()) {
      float* v = p->value.data<float>();
      for (int64_t i = 0; i < p->value.numel(); ++i) v[i] *= s;
    }
  };
  const std::vector<float> before = pass().to_vector<float>();
  experts->keep_weights(true);
  EXPECT_EQ(pass().to_vector<float>(), before);
  scale_weights(2.f);
  EXPECT_EQ(pass().to_vector<float>(), before);  // the kept FP8 copies
  experts->keep_weights(false);
  const std::vector<float> doubled = pass().to_vector<float>();
  EXPECT_NE(doubled, before);
  scale_weights(0.5f);                           // back (exact: powers of two)
  EXPECT_EQ(pass().to_vector<float>(), before);  // quantised afresh by every forward
}
