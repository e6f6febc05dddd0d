// CPU op tests: values against direct loops, gradients against finite differences, and errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "gradcheck.h"
#include "xmoe/ops/ops.h"

using namespace xmoe;
using xmoe::testing::expect_gradient_close;
using xmoe::testing::randn;
using xmoe::testing::weighted_sum;

TEST(Ops, MatmulMatchesLoopsAllTransposes) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      Tensor a = randn(ta ? Shape{5, 3} : Shape{3, 5}, 1);
      Tensor b = randn(tb ? Shape{4, 5} : Shape{5, 4}, 2);
      Tensor c = ops::matmul(a, b, ta, tb);
      ASSERT_EQ(c.shape(), (Shape{3, 4}));
      const float *pa = a.data<float>(), *pb = b.data<float>(), *pc = c.data<float>();
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 4; ++j) {
          double s = 0;
          for (int k = 0; k < 5; ++k)
            s += (ta ? pa[k * 3 + i] : pa[i * 5 + k]) * (tb ? pb[j * 5 + k] : pb[k * 4 + j]);
          EXPECT_NEAR(pc[i * 4 + j], s, 1e-5);
        }
    }
  EXPECT_THROW(ops::matmul(randn({3, 5}, 1), randn({4, 4}, 2)), Error);
}

TEST(Ops, GroupedMatmulEqualsPerGroupMatmul) {
  const std::vector<int64_t> sizes = {3, 0, 5, 1};
  Tensor x = randn({9, 6}, 3);
  Tensor w = randn({4, 6, 7}, 4);
  Tensor y = ops::grouped_matmul(x, w, sizes);
  int64_t row = 0;
  for (int g = 0; g < 4; ++g) {
    if (sizes[g]) {
      Tensor wg = w.rows(g, g + 1).reshape({6, 7});
      Tensor ref = ops::matmul(x.rows(row, row + sizes[g]), wg);
      auto a = y.rows(row, row + sizes[g]).to_vector<float>();
      auto b = ref.to_vector<float>();
      for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5);
    }
    row += sizes[g];
  }
  // trans_w: w^T layout [G, M, K]
  Tensor wt = randn({4, 7, 6}, 5);
  Tensor yt = ops::grouped_matmul(x, wt, sizes, true);
  Tensor ref0 = ops::matmul(x.rows(0, 3), wt.rows(0, 1).reshape({7, 6}), false, true);
  auto a = yt.rows(0, 3).to_vector<float>();
  auto b = ref0.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5);
  // Weight gradient by finite differences; empty group gets zero grad.
  Tensor r = randn({9, 7}, 6);
  Tensor dw = Tensor::zeros({4, 6, 7});
  ops::grouped_matmul_weight_grad(dw, x, r, sizes, false);
  expect_gradient_close(
      w, dw, [&] { return weighted_sum(ops::grouped_matmul(x, w, sizes), r); }, "grouped dw");
  EXPECT_THROW(ops::grouped_matmul(x, w, std::vector<int64_t>{3, 0, 5}), Error);
  EXPECT_THROW(ops::grouped_matmul(x, w, std::vector<int64_t>{3, 0, 5, 2}), Error);
}

// bf16 weight gradients (moe.expert_grad_dtype) of f32 rows: the f32 result rounded once,
// overwriting, or accumulated onto what dw held.
TEST(Ops, GroupedWeightGradIntoBf16RoundsTheF32ResultOnce) {
  const std::vector<int64_t> sizes = {3, 0, 5, 1};
  Tensor x = randn({9, 6}, 7), dy = randn({9, 7}, 8);
  Tensor ref = Tensor::zeros({4, 6, 7});
  ops::grouped_matmul_weight_grad(ref, x, dy, sizes, false);
  Tensor dw = randn({4, 6, 7}, 9).to(DType::bf16);  // stale: overwritten, empty group included
  ops::grouped_matmul_weight_grad(dw, x, dy, sizes, false);
  const std::vector<float> r = ref.to_vector<float>(), once = dw.to(DType::f32).to_vector<float>();
  for (size_t i = 0; i < r.size(); ++i) ASSERT_EQ(once[i], static_cast<float>(bf16(r[i]))) << i;
  ops::grouped_matmul_weight_grad(dw, x, dy, sizes, true);
  const std::vector<float> twice = dw.to(DType::f32).to_vector<float>();
  for (size_t i = 0; i < r.size(); ++i) {  // BLAS may add in another order: within a bf16 step
    const float sum = once[i] + r[i];
    ASSERT_NEAR(twice[i], sum, std::ldexp(std::fabs(sum), -8) + 1e-6f) << i;
  }
  Tensor wrong = Tensor::zeros({4, 6, 7}, DType::i32);
  EXPECT_THROW(ops::grouped_matmul_weight_grad(wrong, x, dy, sizes, false), Error);
}

TEST(Ops, SoftmaxSigmoidSwigluGradients) {
  Tensor x = randn({4, 6}, 7);
  Tensor r = randn({4, 6}, 8);
  Tensor y = ops::softmax(x);
  for (int i = 0; i < 4; ++i) {
    double s = 0;
    for (int j = 0; j < 6; ++j) s += y.data<float>()[i * 6 + j];
    EXPECT_NEAR(s, 1.0, 1e-6);
  }
  expect_gradient_close(
      x, ops::softmax_backward(y, r), [&] { return weighted_sum(ops::softmax(x), r); }, "softmax");
  Tensor ys = ops::sigmoid(x);
  expect_gradient_close(
      x, ops::sigmoid_backward(ys, r), [&] { return weighted_sum(ops::sigmoid(x), r); }, "sigmoid");
  Tensor h = randn({5, 8}, 9);
  Tensor ra = randn({5, 4}, 10);
  expect_gradient_close(
      h, ops::swiglu_backward(h, ra), [&] { return weighted_sum(ops::swiglu(h), ra); }, "swiglu");
  Tensor in_place = h.clone();
  ops::swiglu_backward_(in_place, ra);
  EXPECT_EQ(in_place.to_vector<float>(), ops::swiglu_backward(h, ra).to_vector<float>());
  // With the value: dh as above, and da turned into swiglu(h) of h as it was (the same bits).
  Tensor dh = h.clone(), value = ra.clone();
  ops::swiglu_backward_with_value_(dh, value);
  EXPECT_EQ(dh.to_vector<float>(), in_place.to_vector<float>());
  EXPECT_EQ(value.to_vector<float>(), ops::swiglu(h).to_vector<float>());
  const float g = h.data<float>()[0], u = h.data<float>()[4];
  EXPECT_NEAR(ops::swiglu(h).data<float>()[0], g / (1 + std::exp(-g)) * u, 1e-6);
  EXPECT_THROW(ops::swiglu(randn({2, 3}, 1)), Error);
}

TEST(Ops, RmsNormGradients) {
  Tensor x = randn({6, 10}, 11);
  Tensor w = randn({10}, 12, 0.5f);
  Tensor r = randn({6, 10}, 13);
  auto out = ops::rmsnorm(x, w, 1e-5f);
  Tensor dw = Tensor::zeros({10});
  Tensor dx = ops::rmsnorm_backward(x, w, out.rstd, r, dw);
  auto f = [&] { return weighted_sum(ops::rmsnorm(x, w, 1e-5f).y, r); };
  expect_gradient_close(x, dx, f, "rmsnorm dx");
  expect_gradient_close(w, dw, f, "rmsnorm dw");
  EXPECT_THROW(ops::rmsnorm(x, randn({9}, 1), 1e-5f), Error);
}

// The block's fused forms: x + a then the norm, and the norm's backward plus the residual
// stream's gradient; d(sum(y * r) + sum(sum * q)) / dx = norm_bwd(r) + q, which the fused
// backward gives with residual q.
TEST(Ops, AddRmsNormAndItsBackwardAreTheSeparateOps) {
  Tensor x = randn({6, 10}, 21), a = randn({6, 10}, 22), w = randn({10}, 23, 0.5f);
  Tensor r = randn({6, 10}, 24), q = randn({6, 10}, 25);
  auto fused = ops::add_rmsnorm(x, a, w, 1e-5f, DType::f32);
  Tensor sum = ops::add(x, a);
  auto plain = ops::rmsnorm(sum, w, 1e-5f);
  EXPECT_EQ(fused.sum.to_vector<float>(), sum.to_vector<float>());
  EXPECT_EQ(fused.y.to_vector<float>(), plain.y.to_vector<float>());
  EXPECT_EQ(fused.rstd.to_vector<float>(), plain.rstd.to_vector<float>());

  Tensor dw = Tensor::zeros({10});
  ops::RmsNormGrad g = ops::rmsnorm_backward_add(sum, w, fused.rstd, r, dw, q, DType::f32);
  EXPECT_FALSE(g.dx_copy.defined());
  auto f = [&] {
    auto o = ops::add_rmsnorm(x, a, w, 1e-5f, DType::f32);
    return weighted_sum(o.y, r) + weighted_sum(o.sum, q);
  };
  expect_gradient_close(x, g.dx, f, "add_rmsnorm dx");
  expect_gradient_close(a, g.dx, f, "add_rmsnorm da");
  expect_gradient_close(w, dw, f, "add_rmsnorm dw");
  // A bf16 copy comes from the same values.
  Tensor dw2 = Tensor::zeros({10});
  ops::RmsNormGrad c = ops::rmsnorm_backward_add(sum, w, fused.rstd, r, dw2, q, DType::bf16);
  EXPECT_EQ(c.dx_copy.dtype(), DType::bf16);
  EXPECT_EQ(c.dx_copy.to(DType::f32).to_vector<float>(),
            g.dx.to(DType::bf16).to(DType::f32).to_vector<float>());
  EXPECT_THROW(ops::add_rmsnorm(x, randn({6, 9}, 1), w, 1e-5f, DType::f32), Error);
  EXPECT_THROW(ops::rmsnorm_backward_add(sum, w, fused.rstd, r, dw2, randn({5, 10}, 1), DType::f32),
               Error);
}

// f32 values as three bf16 terms: the terms sum back to the value exactly (24 bits in three
// 8-bit pieces), laid out as the column blocks asked for.
TEST(Ops, SplitBf16ColumnsSumsBackExactly) {
  Tensor x = randn({5, 7}, 31, 3.f);
  // bf16(x) = 1 + 2^-7, then -(2^-8 - 2^-16), then the last mantissa bit, 2^-23.
  x.data<float>()[0] = 1.0f + 0x1p-8f + 0x1p-16f + 0x1p-23f;
  x.data<float>()[1] = -3.1415927f;
  x.data<float>()[2] = 1e-30f;
  x.data<float>()[3] = 0.f;
  const std::array<int, 4> terms = {2, 0, 1, 0};
  Tensor s = ops::split_bf16_columns(x, terms);
  ASSERT_EQ(s.shape(), (Shape{5, 28}));
  ASSERT_EQ(s.dtype(), DType::bf16);
  const Tensor f = s.to(DType::f32);
  const float* t = f.data<float>();
  for (int64_t r = 0; r < 5; ++r) {
    for (int64_t c = 0; c < 7; ++c) {
      const float v = x.data<float>()[r * 7 + c];
      const float t2 = t[r * 28 + c], t0 = t[r * 28 + 7 + c], t1 = t[r * 28 + 14 + c];
      EXPECT_EQ(t[r * 28 + 21 + c], t0);
      EXPECT_EQ(t0, static_cast<float>(bf16(v)));
      EXPECT_EQ(t0 + t1 + t2, v) << r << "," << c;
      EXPECT_LE(std::abs(t2), std::abs(t1) * 0x1p-7f + 1e-38f);
    }
  }
  EXPECT_EQ(t[0], 0x1p-23f);  // row 0, block 0: term 2 of x[0]
  // The blocks summed, in order, into an f32 [5, 7] (= and +=).
  Tensor y = randn({5, 21}, 32), out = Tensor::zeros({5, 7});
  ops::sum_column_blocks_into(out, y, 3, false);
  ops::sum_column_blocks_into(out, y, 3, true);
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t c = 0; c < 7; ++c) {
      const float* yr = y.data<float>() + r * 21;
      const float sum = yr[c] + yr[7 + c] + yr[14 + c];
      EXPECT_EQ(out.data<float>()[r * 7 + c], sum + sum);
    }
  EXPECT_THROW(ops::split_bf16_columns(x, std::array<int, 1>{3}), Error);
  EXPECT_THROW(ops::sum_column_blocks_into(out, y, 2, false), Error);
}

TEST(Ops, TopKIsSortedAndStableOnTies) {
  Tensor x = Tensor::from_vector<float>({0.1f, 0.5f, 0.5f, 0.2f, 3.f, 1.f, 2.f, 0.f}, {2, 4});
  auto r = ops::topk(x, 2);
  EXPECT_EQ(r.indices.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 0, 2}));
  EXPECT_EQ(r.values.to_vector<float>(), (std::vector<float>{0.5f, 0.5f, 3.f, 2.f}));
  EXPECT_THROW(ops::topk(x, 5), Error);
  EXPECT_THROW(ops::topk(x, 0), Error);
}

TEST(Ops, GatherScatterAreAdjoint) {
  Tensor x = randn({5, 3}, 14);
  Tensor idx = Tensor::from_vector<int32_t>({4, 0, 4, 2}, {4});
  Tensor g = ops::gather_rows(x, idx);
  EXPECT_EQ(g.rows(2, 3).to_vector<float>(), x.rows(4, 5).to_vector<float>());
  // <gather(x), r> == <x, scatter(r)>
  Tensor r = randn({4, 3}, 15);
  Tensor back = Tensor::zeros({5, 3});
  ops::scatter_add_rows(back, r, idx);
  EXPECT_NEAR(weighted_sum(g, r), weighted_sum(x, back), 1e-5);
  // Weighted scatter: row 4 receives w0*r0 + w2*r2.
  Tensor w = Tensor::from_vector<float>({0.5f, 1.f, 2.f, 1.f}, {4});
  Tensor out = Tensor::zeros({5, 3});
  ops::scatter_add_rows(out, r, idx, w);
  EXPECT_NEAR(out.data<float>()[12], 0.5f * r.data<float>()[0] + 2.f * r.data<float>()[6], 1e-6);
  EXPECT_THROW(ops::gather_rows(x, Tensor::from_vector<int32_t>({5}, {1})), Error);
  Tensor dots = ops::row_dot(r, r);
  EXPECT_NEAR(dots.data<float>()[1], ops::sum_squares(r.rows(1, 2)), 1e-5);
}

TEST(Ops, ElementwiseAndReductions) {
  Tensor a = Tensor::from_vector<float>({1, 2, 3}, {3});
  Tensor b = Tensor::from_vector<float>({4, 5, 6}, {3});
  EXPECT_EQ(ops::add(a, b).to_vector<float>(), (std::vector<float>{5, 7, 9}));
  ops::add_(a, b, -1.f);
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{-3, -3, -3}));
  ops::scale_(b, 2.f);
  EXPECT_EQ(ops::sum(b), 30.0);
  EXPECT_EQ(ops::sum_squares(a), 27.0);
  EXPECT_TRUE(ops::all_finite(b));
  b.data<float>()[1] = NAN;
  EXPECT_FALSE(ops::all_finite(b));
  EXPECT_THROW(ops::add(a, Tensor::zeros({4})), Error);
}

// The CPU sum of squares (every step's gradient norm) adds fixed chunks in order: the same bits
// whatever the thread count, and the double sum of the elements.
TEST(Ops, SumSquaresIsTheSameForAnyThreadCount) {
  Tensor x = randn({3, 70001}, 50);
  double ref = 0;
  for (const float v : x.to_vector<float>()) ref += static_cast<double>(v) * v;
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const double one = ops::sum_squares(x);
  omp_set_num_threads(std::max(2, threads));
  const double many = ops::sum_squares(x);
  omp_set_num_threads(threads);
  EXPECT_EQ(one, many);
  EXPECT_NEAR(one, ref, 1e-12 * ref);
}
