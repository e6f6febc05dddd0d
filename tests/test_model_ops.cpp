// Model ops: embedding, RoPE, causal attention (MHA, GQA, MQA), cross-entropy. Values against
// direct loops, gradients against central differences, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "gradcheck.h"
#include "xmoe/ops/model_ops.h"
#include "xmoe/ops/ops.h"

using namespace xmoe;
using xmoe::testing::expect_gradient_close;
using xmoe::testing::randn;
using xmoe::testing::weighted_sum;

namespace {
Tensor ids_tensor(std::vector<int32_t> v, Shape shape) {
  return Tensor::from_vector<int32_t>(v, std::move(shape));
}

// Direct O(S^2) reference attention in double.
std::vector<double> reference_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                        bool causal) {
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), Hkv = k.size(2), D = q.size(3);
  const float *pq = q.data<float>(), *pk = k.data<float>(), *pv = v.data<float>();
  std::vector<double> out(static_cast<size_t>(q.numel()), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / Hkv);
      for (int64_t i = 0; i < S; ++i) {
        std::vector<double> s(static_cast<size_t>(S), -1e300);
        double m = -1e300;
        for (int64_t j = 0; j < S; ++j) {
          if (causal && j > i) continue;
          double d = 0;
          for (int64_t c = 0; c < D; ++c)
            d += pq[((b * S + i) * H + h) * D + c] * pk[((b * S + j) * Hkv + g) * D + c];
          s[j] = d * scale;
          m = std::max(m, s[j]);
        }
        double z = 0;
        for (int64_t j = 0; j < S; ++j) z += (causal && j > i) ? 0 : std::exp(s[j] - m);
        for (int64_t j = 0; j < S; ++j) {
          if (causal && j > i) continue;
          const double p = std::exp(s[j] - m) / z;
          for (int64_t c = 0; c < D; ++c)
            out[((b * S + i) * H + h) * D + c] += p * pv[((b * S + j) * Hkv + g) * D + c];
        }
      }
    }
  return out;
}
}  // namespace

// ---- embedding ------------------------------------------------------------------------------

TEST(ModelOps, EmbeddingGathersRowsAndScatterAddsGradients) {
  Tensor table = randn({7, 5}, 1);
  Tensor ids = ids_tensor({3, 0, 3, 6, 3, 1}, {2, 3});  // repeated id 3
  Tensor out = ops::embedding(table, ids);
  ASSERT_EQ(out.shape(), (Shape{6, 5}));
  const auto ti = ids.to_vector<int32_t>();
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t c = 0; c < 5; ++c)
      EXPECT_EQ(out.data<float>()[i * 5 + c], table.data<float>()[ti[i] * 5 + c]);

  Tensor r = randn({6, 5}, 2);
  Tensor dtable = Tensor::zeros({7, 5});
  ops::embedding_backward(dtable, ids, r);
  expect_gradient_close(
      table, dtable, [&] { return weighted_sum(ops::embedding(table, ids), r); },
      "embedding dtable");
  // Rows of ids never seen keep a zero gradient; backward accumulates.
  for (int64_t c = 0; c < 5; ++c) EXPECT_EQ(dtable.data<float>()[2 * 5 + c], 0.f);
  Tensor twice = dtable.clone();
  ops::embedding_backward(twice, ids, r);
  for (int64_t i = 0; i < twice.numel(); ++i)
    EXPECT_FLOAT_EQ(twice.data<float>()[i], 2 * dtable.data<float>()[i]);
}

TEST(ModelOps, EmbeddingBackwardIsDeterministicOnWideRows) {
  // Wide enough to take the multi-threaded path; repeated ids in one column block.
  const int64_t V = 5, d = 300, N = 400;
  std::vector<int32_t> v(N);
  for (int64_t i = 0; i < N; ++i) v[i] = static_cast<int32_t>((i * 7) % V);
  Tensor ids = ids_tensor(v, {N});
  Tensor dy = randn({N, d}, 3);
  Tensor a = Tensor::zeros({V, d}), b = Tensor::zeros({V, d});
  ops::embedding_backward(a, ids, dy);
  ops::embedding_backward(b, ids, dy);
  EXPECT_EQ(a.to_vector<float>(), b.to_vector<float>());
  // Against the serial sum in row order.
  for (int64_t c = 0; c < d; c += 37) {
    float s = 0;
    for (int64_t i = 0; i < N; ++i)
      if (v[i] == 2) s += dy.data<float>()[i * d + c];
    EXPECT_EQ(a.data<float>()[2 * d + c], s);
  }
}

TEST(ModelOps, EmbeddingRejectsBadIds) {
  Tensor table = randn({4, 3}, 1);
  EXPECT_THROW(ops::embedding(table, ids_tensor({0, 4}, {2})), Error);
  EXPECT_THROW(ops::embedding(table, ids_tensor({-1}, {1})), Error);
  EXPECT_THROW(ops::embedding(table, Tensor::zeros({2}, DType::i64)), Error);
  Tensor dt = Tensor::zeros({4, 3});
  EXPECT_THROW(ops::embedding_backward(dt, ids_tensor({0, 1}, {2}), randn({3, 3}, 2)), Error);
}

// ---- RoPE -----------------------------------------------------------------------------------

TEST(ModelOps, RopeMatchesRotateHalfFormula) {
  const int64_t B = 2, S = 5, H = 3, D = 8;
  const float theta = 100.f;
  auto tables = ops::rope_tables(16, D, theta);
  Tensor x = randn({B, S, H, D}, 4);
  Tensor y = ops::rope(x, tables);
  const float *px = x.data<float>(), *py = y.data<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t j = 0; j < D / 2; ++j) {
          const double a = s * std::pow(theta, -2.0 * j / D);
          const int64_t o = ((b * S + s) * H + h) * D;
          const double x1 = px[o + j], x2 = px[o + j + D / 2];
          EXPECT_NEAR(py[o + j], x1 * std::cos(a) - x2 * std::sin(a), 1e-5);
          EXPECT_NEAR(py[o + j + D / 2], x2 * std::cos(a) + x1 * std::sin(a), 1e-5);
        }
  // Position 0 of every sequence is unrotated; norms are preserved.
  for (int64_t c = 0; c < H * D; ++c) EXPECT_EQ(py[c], px[c]);
  EXPECT_NEAR(ops::sum_squares(y), ops::sum_squares(x), 1e-3);
}

TEST(ModelOps, RopeGradientAndInverse) {
  auto tables = ops::rope_tables(8, 6, 10000.f);
  Tensor x = randn({2, 4, 2, 6}, 5);
  Tensor r = randn({2, 4, 2, 6}, 6);
  Tensor dx = ops::rope_backward(r, tables);
  expect_gradient_close(
      x, dx, [&] { return weighted_sum(ops::rope(x, tables), r); }, "rope dx");
  // The backward is the inverse rotation.
  Tensor back = ops::rope_backward(ops::rope(x, tables), tables);
  for (int64_t i = 0; i < x.numel(); ++i)
    EXPECT_NEAR(back.data<float>()[i], x.data<float>()[i], 1e-5);
}

TEST(ModelOps, RopeRejectsBadShapes) {
  EXPECT_THROW(ops::rope_tables(8, 5, 10000.f), Error);  // odd head_dim
  auto tables = ops::rope_tables(4, 6, 10000.f);
  Tensor longer = randn({1, 5, 1, 6}, 1);
  EXPECT_THROW(ops::rope_(longer, tables), Error);  // S > max_seq_len
  Tensor wrong_hd = randn({1, 2, 1, 4}, 1);
  EXPECT_THROW(ops::rope_(wrong_hd, tables), Error);
  Tensor three_d = randn({2, 1, 6}, 1);
  EXPECT_THROW(ops::rope_(three_d, tables), Error);
}

// ---- attention ------------------------------------------------------------------------------

class AttentionHeads : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(AttentionHeads, MatchesReferenceAndFiniteDifferences) {
  const auto [H, Hkv] = GetParam();
  const int64_t B = 2, S = 5, D = 4;
  Tensor q = randn({B, S, H, D}, 10), k = randn({B, S, Hkv, D}, 11), v = randn({B, S, Hkv, D}, 12);
  for (bool causal : {true, false}) {
    auto r = ops::attention(q, k, v, causal);
    ASSERT_EQ(r.out.shape(), q.shape());
    ASSERT_EQ(r.lse.shape(), (Shape{B, H, S}));
    const auto ref = reference_attention(q, k, v, causal);
    for (int64_t i = 0; i < q.numel(); ++i) EXPECT_NEAR(r.out.data<float>()[i], ref[i], 1e-5);

    Tensor dout = randn(q.shape(), 13);
    auto g = ops::attention_backward(q, k, v, r.out, r.lse, dout, causal);
    auto loss = [&] { return weighted_sum(ops::attention(q, k, v, causal).out, dout); };
    expect_gradient_close(q, g.dq, loss, "attention dq", 1e-2, 2e-2, 200);
    expect_gradient_close(k, g.dk, loss, "attention dk", 1e-2, 2e-2, 200);
    expect_gradient_close(v, g.dv, loss, "attention dv", 1e-2, 2e-2, 200);
  }
}

INSTANTIATE_TEST_SUITE_P(ModelOps, AttentionHeads,
                         ::testing::Values(std::make_pair(2, 2),    // multi-head
                                           std::make_pair(4, 2),    // grouped-query
                                           std::make_pair(3, 1)));  // multi-query

TEST(ModelOps, AttentionIsCausal) {
  const int64_t B = 1, S = 6, H = 2, D = 4;
  Tensor q = randn({B, S, H, D}, 20), k = randn({B, S, 1, D}, 21), v = randn({B, S, 1, D}, 22);
  auto a = ops::attention(q, k, v);
  // Change key and value at position 3: outputs at positions < 3 must not move.
  for (int64_t c = 0; c < D; ++c) {
    k.data<float>()[3 * D + c] += 1.f;
    v.data<float>()[3 * D + c] -= 2.f;
  }
  auto b = ops::attention(q, k, v);
  for (int64_t i = 0; i < 3 * H * D; ++i) EXPECT_EQ(a.out.data<float>()[i], b.out.data<float>()[i]);
  bool changed = false;
  for (int64_t i = 3 * H * D; i < S * H * D; ++i)
    changed |= a.out.data<float>()[i] != b.out.data<float>()[i];
  EXPECT_TRUE(changed);
  // Row 0 attends only to itself: out = v_0 and lse = scale * q_0 . k_0.
  for (int64_t c = 0; c < D; ++c) EXPECT_NEAR(a.out.data<float>()[c], v.data<float>()[c], 1e-6);
}

TEST(ModelOps, AttentionLargerShapeParallelPathIsDeterministic) {
  // Large enough for the OpenMP paths; B·Hkv = 4 units of backward work.
  const int64_t B = 2, S = 64, H = 4, Hkv = 2, D = 16;
  Tensor q = randn({B, S, H, D}, 30), k = randn({B, S, Hkv, D}, 31), v = randn({B, S, Hkv, D}, 32);
  Tensor dout = randn(q.shape(), 33);
  auto r1 = ops::attention(q, k, v);
  auto r2 = ops::attention(q, k, v);
  EXPECT_EQ(r1.out.to_vector<float>(), r2.out.to_vector<float>());
  const auto ref = reference_attention(q, k, v, true);
  for (int64_t i = 0; i < q.numel(); i += 7) EXPECT_NEAR(r1.out.data<float>()[i], ref[i], 1e-5);
  auto g1 = ops::attention_backward(q, k, v, r1.out, r1.lse, dout);
  auto g2 = ops::attention_backward(q, k, v, r1.out, r1.lse, dout);
  EXPECT_EQ(g1.dq.to_vector<float>(), g2.dq.to_vector<float>());
  EXPECT_EQ(g1.dk.to_vector<float>(), g2.dk.to_vector<float>());
  EXPECT_EQ(g1.dv.to_vector<float>(), g2.dv.to_vector<float>());
}

// A longer sequence, not a power of two: values against the double reference, gradients against
// finite differences, causal and not.
TEST(ModelOps, AttentionLongerSequence) {
  const int64_t B = 1, S = 150, H = 2, Hkv = 1, D = 8;
  Tensor q = randn({B, S, H, D}, 40), k = randn({B, S, Hkv, D}, 41), v = randn({B, S, Hkv, D}, 42);
  Tensor dout = randn(q.shape(), 43);
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    auto r = ops::attention(q, k, v, causal);
    const auto ref = reference_attention(q, k, v, causal);
    for (int64_t i = 0; i < q.numel(); ++i) ASSERT_NEAR(r.out.data<float>()[i], ref[i], 1e-5) << i;
    auto g = ops::attention_backward(q, k, v, r.out, r.lse, dout, causal);
    auto loss = [&] { return weighted_sum(ops::attention(q, k, v, causal).out, dout); };
    expect_gradient_close(q, g.dq, loss, "attention dq", 1e-2, 2e-2, 120);
    expect_gradient_close(k, g.dk, loss, "attention dk", 1e-2, 2e-2, 120);
    expect_gradient_close(v, g.dv, loss, "attention dv", 1e-2, 2e-2, 120);
  }
}

TEST(ModelOps, AttentionRejectsBadShapes) {
  Tensor q = randn({1, 4, 3, 4}, 1);
  EXPECT_THROW(ops::attention(q, randn({1, 4, 2, 4}, 2), randn({1, 4, 2, 4}, 3)), Error);  // 3 % 2
  EXPECT_THROW(ops::attention(q, randn({1, 5, 1, 4}, 2), randn({1, 5, 1, 4}, 3)), Error);  // S
  EXPECT_THROW(ops::attention(q, randn({1, 4, 1, 4}, 2), randn({1, 4, 1, 2}, 3)), Error);  // v
  EXPECT_THROW(ops::attention(randn({4, 3, 4}, 1), randn({1, 4, 1, 4}, 2), randn({1, 4, 1, 4}, 3)),
               Error);
}

// ---- cross-entropy --------------------------------------------------------------------------

TEST(ModelOps, CrossEntropyValueAndGradient) {
  const int64_t N = 6, V = 7;
  Tensor logits = randn({N, V}, 40, 2.f);
  Tensor targets = ids_tensor({0, 6, 3, -1, 3, 2}, {N});  // one ignored row
  auto r = ops::cross_entropy(logits, targets);
  EXPECT_EQ(r.count, 5);
  double ref = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int32_t t = targets.data<int32_t>()[i];
    if (t < 0) continue;
    double z = 0;
    for (int64_t c = 0; c < V; ++c)
      z += std::exp(static_cast<double>(logits.data<float>()[i * V + c]));
    ref += std::log(z) - logits.data<float>()[i * V + t];
  }
  EXPECT_NEAR(r.loss, ref / 5, 1e-5);

  Tensor d = ops::cross_entropy_backward(logits, targets, r, 0.5f);
  expect_gradient_close(
      logits, d, [&] { return 0.5 * ops::cross_entropy(logits, targets).loss; },
      "cross-entropy dlogits", 1e-2, 2e-2, 100);
  for (int64_t c = 0; c < V; ++c) EXPECT_EQ(d.data<float>()[3 * V + c], 0.f);  // ignored row
  // Each counted row of (softmax - onehot) sums to 0.
  for (int64_t i = 0; i < N; ++i) {
    double s = 0;
    for (int64_t c = 0; c < V; ++c) s += d.data<float>()[i * V + c];
    EXPECT_NEAR(s, 0, 1e-6);
  }
  // In-place form gives the same bits.
  Tensor inplace = logits.clone();
  ops::cross_entropy_backward_(inplace, targets, r, 0.5f);
  EXPECT_EQ(inplace.to_vector<float>(), d.to_vector<float>());
}

TEST(ModelOps, CrossEntropyIsStableForLargeLogits) {
  Tensor logits = Tensor::from_vector<float>({1000.f, 0.f, -1000.f, 500.f, 500.f, 500.f}, {2, 3});
  auto r = ops::cross_entropy(logits, ids_tensor({1, 0}, {2}));
  EXPECT_NEAR(r.loss, (1000.0 + std::log(3.0)) / 2, 1e-3);
  EXPECT_TRUE(ops::all_finite(ops::cross_entropy_backward(logits, ids_tensor({1, 0}, {2}), r)));
}

TEST(ModelOps, CrossEntropyIgnoreAndErrors) {
  Tensor logits = randn({2, 3}, 1);
  auto all_ignored = ops::cross_entropy(logits, ids_tensor({-1, -1}, {2}));
  EXPECT_EQ(all_ignored.count, 0);
  EXPECT_EQ(all_ignored.loss, 0.f);
  EXPECT_THROW(ops::cross_entropy(logits, ids_tensor({-1, 0}, {2}), /*ignore_negative=*/false),
               Error);
  EXPECT_THROW(ops::cross_entropy(logits, ids_tensor({3, 0}, {2})), Error);
  EXPECT_THROW(ops::cross_entropy(logits, ids_tensor({0, 0, 0}, {3})), Error);
}
