// FP8 E4M3 block quantisation and the FP8 grouped GEMM on the CPU (model.moe.expert_dtype = fp8,
// docs/fp8.md): the conversion against the format's definition, the block scales and layouts the
// sm90 kernel reads, the GEMM against exact f32 products, and an MoE layer against its bf16 run.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
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

// A run of groups of quantised rows is the quantisation of those groups' rows alone: the bytes
// and scales of consecutive groups lie together (how the FP8 experts' backward writes dh's FP8
// rows chunk by chunk into one buffer).
TEST(Fp8, GroupsOfQuantisedRowsAreTheirRowsQuantised) {
  const std::vector<int64_t> sizes{37, 0, 130, 1, 9};
  const Tensor x = randn({177, 300}, 11, 2.0f);
  const ops::Fp8Rows all = ops::quantize_rows_fp8(x, sizes);
  const ops::Fp8Rows middle = all.groups(1, 4);  // rows [37, 168)
  const ops::Fp8Rows alone =
      ops::quantize_rows_fp8(x.rows(37, 168), std::vector<int64_t>{0, 130, 1});
  EXPECT_EQ(middle.group_sizes, alone.group_sizes);
  EXPECT_EQ(middle.data.to_vector<uint8_t>(), alone.data.to_vector<uint8_t>());
  EXPECT_EQ(middle.scales.to_vector<float>(), alone.scales.to_vector<float>());
  EXPECT_EQ(all.groups(2, 2).data.size(0), 0);
  EXPECT_THROW(all.groups(3, 6), Error);
  const ops::Fp8Rows empty = ops::empty_fp8_rows(300, sizes, Device::cpu());
  EXPECT_EQ(empty.data.shape(), (Shape{177, 300}));
  EXPECT_EQ(empty.scales.numel(), 177 * 3);
}

// SwiGLU's backward with its FP8 output: h becomes dh and da swiglu(h) as in
// swiglu_backward_with_value_, and the rows written, group by group into one buffer, are
// quantize_rows_fp8(dh).
TEST(Fp8, SwigluBackwardQuantiserQuantisesDh) {
  const std::vector<int64_t> sizes{37, 0, 130, 1};
  const Tensor h = randn({168, 2 * 200}, 12, 2.0f), da = randn({168, 200}, 13);
  Tensor h_ref = h.clone(), da_ref = da.clone();
  ops::swiglu_backward_with_value_(h_ref, da_ref);
  const ops::Fp8Rows ref = ops::quantize_rows_fp8(h_ref, sizes);
  Tensor h_q = h.clone(), da_q = da.clone();
  ops::Fp8Rows q = ops::empty_fp8_rows(400, sizes, Device::cpu());
  for (const auto& [g0, g1, r0, r1] :
       std::vector<std::array<int64_t, 4>>{{0, 2, 0, 37}, {2, 4, 37, 168}}) {
    Tensor hc = h_q.rows(r0, r1), dac = da_q.rows(r0, r1);
    ops::Fp8Rows qc = q.groups(g0, g1);
    ops::swiglu_backward_with_value_fp8_(hc, dac, qc);
  }
  EXPECT_EQ(h_q.to_vector<float>(), h_ref.to_vector<float>());
  EXPECT_EQ(da_q.to_vector<float>(), da_ref.to_vector<float>());
  EXPECT_EQ(q.data.to_vector<uint8_t>(), ref.data.to_vector<uint8_t>());
  EXPECT_EQ(q.scales.to_vector<float>(), ref.scales.to_vector<float>());
  Tensor bad_da = randn({168, 199}, 14);
  EXPECT_THROW(ops::swiglu_backward_with_value_fp8_(h_q, bad_da, q), Error);
  ops::Fp8Rows short_q = q.groups(0, 3);
  EXPECT_THROW(ops::swiglu_backward_with_value_fp8_(h_q, da_q, short_q), Error);
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
/// stage's rows (which makes the layer gather them itself); allocated: the bytes allocated;
/// hook_combine_grad: a hook on the experts' output gradient (which makes them quantise it
/// themselves instead of reading the I-Order's FP8 rows).
std::vector<Tensor> run_layer(const std::string& expert_dtype, bool hook_rows = false,
                              int64_t* allocated = nullptr, bool hook_combine_grad = false,
                              const std::string& impl = "pft") {
  MoeConfig c;
  c.impl = impl;
  c.num_experts = 8;
  c.top_k = 2;
  c.expert_hidden = 128;
  c.num_shared_experts = 0;
  c.expert_dtype = expert_dtype;
  constexpr int64_t d = 256, T = 512, seq = 64;
  auto one = comm::make_single_group();
  moe::MoELayer layer(c, d, "moe", 7, 0.02f, 0.02f, moe::LayerGroups{one, one});
  if (hook_rows) layer.hooks().on<moe::OrderOut>([](moe::OrderOut&) {});
  if (hook_combine_grad) layer.hooks().on<moe::CombineGrad>([](moe::CombineGrad&) {});
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

/// Three FP8 SwiGLU experts (all local) of d_model d and hidden f.
std::unique_ptr<moe::Experts> fp8_experts(int64_t d, int64_t f, uint64_t seed) {
  moe::ExpertArgs a;
  a.prefix = "moe";
  a.num_experts = a.num_local = 3;
  a.d_model = d;
  a.hidden = f;
  a.seed = seed;
  a.fp8 = true;
  return moe::make_experts("swiglu", a);
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

// With one process and no hook between them, the I-Order's backward writes the experts' output
// gradient in FP8 too, and the experts read it instead of quantising it again: the same bits
// as with a hook on that gradient (then the experts quantise it themselves).
TEST(Fp8, MoeLayerTakesItsOutputGradientInFp8FromTheIOrder) {
  for (const char* impl : {"pft", "padded"}) {
    SCOPED_TRACE(impl);
    const std::vector<Tensor> fused = run_layer("fp8", false, nullptr, false, impl),
                              quantised_by_experts = run_layer("fp8", false, nullptr, true, impl);
    ASSERT_EQ(fused.size(), quantised_by_experts.size());
    for (size_t i = 0; i < fused.size(); ++i)
      EXPECT_EQ(fused[i].to_vector<float>(), quantised_by_experts[i].to_vector<float>())
          << "tensor " << i;
  }
}

// Experts given their output gradient's FP8 rows read them (rows of 2 dy: scales twice dy's,
// the same bytes, so the data gradient doubles exactly) and, given dy's own rows, compute the
// bits of quantising dy themselves.
TEST(Fp8, ExpertsReadTheOutputGradientsFp8RowsTheyAreGiven) {
  const std::unique_ptr<moe::Experts> experts = fp8_experts(256, 128, 21);
  const std::vector<int64_t> sizes{5, 0, 9};
  const Tensor x = randn({14, 256}, 22), dy = randn({14, 256}, 23);
  auto data_grad = [&](const ops::Fp8Rows* rows) {
    experts->forward(x, sizes);
    return (rows ? experts->backward(dy, *rows) : experts->backward(dy)).to_vector<float>();
  };
  const std::vector<float> plain = data_grad(nullptr);
  const ops::Fp8Rows own = ops::quantize_rows_fp8(dy, sizes);
  EXPECT_EQ(data_grad(&own), plain);
  Tensor dy2 = dy.clone();
  ops::scale_(dy2, 2.f);
  const ops::Fp8Rows twice = ops::quantize_rows_fp8(dy2, sizes);
  EXPECT_EQ(twice.data.to_vector<uint8_t>(), own.data.to_vector<uint8_t>());
  std::vector<float> doubled = data_grad(&twice);
  for (float& v : doubled) v /= 2.f;
  EXPECT_EQ(doubled, plain);
  EXPECT_THROW(experts->backward(dy, ops::quantize_rows_fp8(dy, std::vector<int64_t>{14, 0, 0})),
               Error);
}

// keep_weights (the trainer's micro-batches of one step): the experts quantise their weights
// once and reuse the FP8 copies across passes, so a change to the weights in between is not
// seen until keep_weights(false) drops them; without it every forward quantises afresh.
TEST(Fp8, ExpertsKeepTheirQuantisedWeightsUntilReleased) {
  const std::unique_ptr<moe::Experts> experts = fp8_experts(64, 96, 11);
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
