// Unit tests of the MoE stages and layer: the PFT layout, padded baseline, gates, hooks, errors.
// Gradient checks live in test_moe_grad.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "cuda_testing.h"
#include "gradcheck.h"
#include "xmoe/core/allocator.h"
#include "xmoe/moe/layer.h"
#include "xmoe/moe/padded.h"
#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"
#include "xmoe/optim/adamw.h"

using namespace xmoe;
using namespace xmoe::moe;
using xmoe::ops::gather_sum_rows;
using xmoe::ops::gather_weighted_rows_dot;
using xmoe::ops::scatter_add_rows_masked;
using xmoe::ops::WeightedGather;
using xmoe::testing::randn;

namespace {

MoeConfig small_config(const std::string& gate = "softmax_topk") {
  MoeConfig c;
  c.num_experts = 6;
  c.top_k = 2;
  c.expert_hidden = 4;
  c.num_shared_experts = 0;
  c.gate = gate;
  return c;
}

/// Random distinct top-k expert ids per token.
Tensor random_topk(int64_t T, int64_t k, int64_t E, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t i = E - 1; i > 0; --i)
      std::swap(perm[i], perm[rng.below(static_cast<uint64_t>(i + 1))]);
    idx.insert(idx.end(), perm.begin(), perm.begin() + k);
  }
  return Tensor::from_vector(idx, {T, k});
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

// ---- Order: the padding-free token buffer -----------------------------------------------------

TEST(MoeOrder, PftInvariants) {
  const int64_t T = 37, k = 3, E = 8, d = 5;
  MoeConfig c = small_config();
  c.num_experts = E;
  c.top_k = k;
  auto order = make_order(c);
  EXPECT_EQ(order->name(), "pft");
  Tensor idx = random_topk(T, k, E, 1);
  Tensor w = randn({T, k}, 2);
  Tensor x = randn({T, d}, 3);
  Tensor rows = order->forward(x, idx, w);
  const TokenLayout& l = order->layout();

  ASSERT_EQ(l.num_rows(), T * k);  // exactly T*k rows, no padding
  EXPECT_EQ(rows.shape(), (Shape{T * k, d}));
  EXPECT_EQ(std::accumulate(l.tokens_per_expert.begin(), l.tokens_per_expert.end(), int64_t{0}),
            T * k);
  EXPECT_EQ(l.dropped, 0);
  auto tok = l.token_ids.to_vector<int32_t>();
  auto exp = l.expert_ids.to_vector<int32_t>();
  auto cw = l.combine_weights.to_vector<float>();
  auto s2r = l.slot_to_row.to_vector<int32_t>();
  auto iv = idx.to_vector<int32_t>();
  auto wv = w.to_vector<float>();
  // Grouped by expert with tokens_per_expert rows each; stable: token ids ascending inside.
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < l.tokens_per_expert[e]; ++i, ++row) {
      EXPECT_EQ(exp[row], e);
      if (i > 0) {
        EXPECT_LT(tok[row - 1], tok[row]) << "expert " << e;
      }
    }
  // slot_to_row is the inverse map, and a permutation of the rows.
  std::set<int32_t> seen;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = s2r[t * k + j];
      ASSERT_GE(r, 0);
      EXPECT_EQ(tok[r], t);
      EXPECT_EQ(exp[r], iv[t * k + j]);
      EXPECT_EQ(cw[r], wv[t * k + j]);
      seen.insert(r);
    }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), T * k);
  // The rows are the tokens.
  auto xv = x.to_vector<float>();
  auto rv = rows.to_vector<float>();
  for (int64_t r = 0; r < T * k; ++r)
    for (int64_t j = 0; j < d; ++j) EXPECT_EQ(rv[r * d + j], xv[tok[r] * d + j]);
}

TEST(MoeOrder, PftBackwardAddsRowsIntoTokensAndMapsWeights) {
  const int64_t T = 5, k = 2, E = 4, d = 3;
  MoeConfig c = small_config();
  c.num_experts = E;
  auto order = make_order(c);
  Tensor idx = random_topk(T, k, E, 9);
  order->forward(randn({T, d}, 1), idx, randn({T, k}, 2));
  const TokenLayout& l = order->layout();
  Tensor d_rows = randn({T * k, d}, 3);
  Tensor d_cw = randn({T * k}, 4);
  Order::Grads g = order->backward(d_rows, d_cw);
  auto tok = l.token_ids.to_vector<int32_t>();
  auto s2r = l.slot_to_row.to_vector<int32_t>();
  std::vector<float> expect(T * d, 0.f);
  auto dr = d_rows.to_vector<float>();
  for (int64_t r = 0; r < T * k; ++r)
    for (int64_t j = 0; j < d; ++j) expect[tok[r] * d + j] += dr[r * d + j];
  auto got = g.dx.to_vector<float>();
  for (size_t i = 0; i < expect.size(); ++i) EXPECT_FLOAT_EQ(got[i], expect[i]);
  auto dtw = g.d_topk_weight.to_vector<float>();
  auto dcw = d_cw.to_vector<float>();
  for (int64_t i = 0; i < T * k; ++i) EXPECT_EQ(dtw[i], dcw[s2r[i]]);
}

TEST(MoeOps, GatherSumRowsHasTheBitsOfTheScatterItReplaces) {
  // A padded-style layout: some rows belong to no token, some slots are empty (dropped pairs),
  // and each token's rows are out of order in its slots, so the sum order is tested.
  const int64_t T = 7, k = 3, N = 25, d = 33;
  Rng rng(5);
  std::vector<int32_t> perm(N), token(N, -1), slots(T * k, -1);
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t i = N - 1; i > 0; --i)
    std::swap(perm[i], perm[rng.below(static_cast<uint64_t>(i + 1))]);
  for (int64_t i = 0; i < T * k; ++i) {
    if (i % 5 == 4) continue;  // dropped
    slots[i] = perm[i];
    token[perm[i]] = static_cast<int32_t>(i / k);
  }
  Tensor src = randn({N, d}, 6), w = randn({N}, 7);
  Tensor slot_t = Tensor::from_vector(slots, {T, k}), tok_t = Tensor::from_vector(token, {N});
  for (const bool weighted : {false, true}) {
    Tensor ref = Tensor::zeros({T, d});
    scatter_add_rows_masked(ref, src, tok_t, weighted ? w : Tensor());
    Tensor got = gather_sum_rows(src, slot_t, weighted ? w : Tensor());
    EXPECT_EQ(got.to_vector<float>(), ref.to_vector<float>()) << "weighted " << weighted;
    // An addend is added last: the bits of the sum, then add_.
    Tensor add = randn({T, d}, 8);
    Tensor summed = gather_sum_rows(src, slot_t, weighted ? w : Tensor(), add);
    xmoe::ops::add_(ref, add);
    EXPECT_EQ(summed.to_vector<float>(), ref.to_vector<float>()) << "weighted " << weighted;
  }
  EXPECT_TRUE(
      contains(error_of([&] {
                 gather_sum_rows(src, Tensor::from_vector(std::vector<int32_t>{0, N}, {1, 2}));
               }),
               "out of range"));
}

// ---- Padded baseline ----------------------------------------------------------------------------

TEST(MoePadded, EnoughCapacityMatchesPft) {
  const int64_t T = 24, d = 8;
  MoeConfig c = small_config();
  c.num_shared_experts = 1;
  c.aux_loss_weight = 0.1f;
  MoeConfig cp = c;
  cp.impl = "padded";
  cp.capacity_factor = static_cast<float>(c.num_experts) / c.top_k;  // C = T: nothing can drop
  MoELayer pft(c, d, "m", 3, 0.5f), padded(cp, d, "m", 3, 0.5f);
  Tensor x = randn({T, d}, 5), dy = randn({T, d}, 6);
  Tensor y0 = pft.forward(x, 12), y1 = padded.forward(x, 12);
  EXPECT_EQ(padded.dropped_tokens(), 0);
  EXPECT_EQ(padded.layout().num_rows(), c.num_experts * T);  // [E, C, d] with C = T
  EXPECT_EQ(pft.tokens_per_expert(), padded.tokens_per_expert());
  auto a = y0.to_vector<float>(), b = y1.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5);
  EXPECT_NEAR(pft.aux_loss(), padded.aux_loss(), 1e-6);
  auto dx0 = pft.backward(dy).to_vector<float>(), dx1 = padded.backward(dy).to_vector<float>();
  for (size_t i = 0; i < dx0.size(); ++i) EXPECT_NEAR(dx0[i], dx1[i], 1e-5);
  auto p0 = pft.parameters(), p1 = padded.parameters();
  ASSERT_EQ(p0.size(), p1.size());
  for (size_t i = 0; i < p0.size(); ++i) {
    auto g0 = p0[i]->grad.to_vector<float>(), g1 = p1[i]->grad.to_vector<float>();
    for (size_t j = 0; j < g0.size(); ++j) EXPECT_NEAR(g0[j], g1[j], 1e-5) << p0[i]->name;
  }
}

TEST(MoePadded, CapacityOneDropsSkewedRoutingAndCountsIt) {
  const int64_t T = 12, d = 8, E = 6, k = 2;
  MoeConfig c = small_config();
  c.impl = "padded";
  c.capacity_factor = 1.0f;  // C = ceil(12 * 2 / 6) = 4
  MoELayer layer(c, d, "m", 3, 0.5f);
  // Skew: every token goes to experts 0 and 1 (a hook replaces the gate's choice).
  std::vector<int32_t> forced;
  for (int64_t t = 0; t < T; ++t) forced.insert(forced.end(), {0, 1});
  layer.hooks().on<GateOut>([&](GateOut& g) { g.topk_idx = Tensor::from_vector(forced, {T, k}); });
  Tensor y = layer.forward(randn({T, d}, 1), 6);
  EXPECT_EQ(padded_capacity(1.0f, T, k, E), 4);
  EXPECT_EQ(layer.layout().capacity, 4);
  EXPECT_EQ(layer.dropped_tokens(), 2 * (T - 4));
  EXPECT_EQ(layer.expert_load(), (std::vector<int64_t>{12, 12, 0, 0, 0, 0}));
  EXPECT_EQ(layer.tokens_per_expert(), (std::vector<int64_t>{4, 4, 0, 0, 0, 0}));
  // Tokens 4.. lost both their pairs (first come, first served) and get nothing.
  auto yv = y.to_vector<float>();
  for (int64_t t = 0; t < T; ++t) {
    double norm = 0;
    for (int64_t j = 0; j < d; ++j) norm += std::fabs(yv[t * d + j]);
    if (t < 4)
      EXPECT_GT(norm, 0) << t;
    else
      EXPECT_EQ(norm, 0) << t;
  }
  Tensor dx = layer.backward(randn({T, d}, 2));
  EXPECT_TRUE(xmoe::ops::all_finite(dx));
}

TEST(MoePadded, BuffersAreAllocatedAsECd) {
  const int64_t T = 64, d = 16;
  MoeConfig c = small_config();
  c.impl = "padded";
  c.capacity_factor = 2.0f;
  MoELayer layer(c, d, "m", 3, 0.5f);
  const int64_t C = padded_capacity(2.0f, T, c.top_k, c.num_experts);
  int64_t rows_bytes = 0;
  layer.hooks().on<OrderOut>(
      [&](OrderOut& o) { rows_bytes = static_cast<int64_t>(o.rows.nbytes()); });
  layer.forward(randn({T, d}, 1), 16);
  EXPECT_EQ(rows_bytes, c.num_experts * C * d * 4);
}

// ---- Gates ------------------------------------------------------------------------------------

TEST(MoeGate, WeightsFollowTheGateOptions) {
  const int64_t T = 16, d = 8;
  Tensor x = randn({T, d}, 1);
  struct Case {
    std::string gate;
    bool before, renorm;
    float scaling;
  };
  for (const Case& cs :
       {Case{"softmax_topk", true, true, 1.f}, Case{"softmax_topk", false, true, 1.f},
        Case{"softmax_topk", true, false, 1.f}, Case{"sigmoid", true, true, 2.5f},
        Case{"xmoe", true, true, 1.f}}) {
    MoeConfig c = small_config(cs.gate);
    c.softmax_before_topk = cs.before;
    c.renormalize = cs.renorm;
    c.routed_scaling = cs.scaling;
    auto gate = make_gate({c, d, "g", 1, 0.5f, nullptr});
    GateOutput g = gate->forward(x, 8);
    ASSERT_EQ(g.topk_idx.shape(), (Shape{T, 2}));
    ASSERT_EQ(g.topk_weight.shape(), (Shape{T, 2}));
    auto w = g.topk_weight.to_vector<float>();
    auto idx = g.topk_idx.to_vector<int32_t>();
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_NE(idx[t * 2], idx[t * 2 + 1]);
      const float s = w[t * 2] + w[t * 2 + 1];
      if (cs.renorm || !cs.before)
        EXPECT_NEAR(s, cs.scaling, 1e-5) << cs.gate;
      else
        EXPECT_LT(s, 1.0f);
      if (cs.gate != "sigmoid") {
        EXPECT_GE(w[t * 2], w[t * 2 + 1]) << cs.gate;
      }  // descending
    }
  }
}

TEST(MoeGate, AuxLossValuesMatchTheirDefinitions) {
  const int64_t T = 16, d = 8, E = 6, k = 2, L = 4;
  MoeConfig c = small_config();
  c.aux_loss_weight = 0.5f;
  c.seq_aux_loss_weight = 0.25f;
  c.z_loss_weight = 0.125f;
  auto gate = make_gate({c, d, "g", 1, 0.5f, nullptr});
  Tensor x = randn({T, d}, 2);
  GateOutput g = gate->forward(x, L);
  Tensor logits = xmoe::ops::matmul(x, gate->parameters()[0]->value);
  auto lv = logits.to_vector<float>();
  auto idx = g.topk_idx.to_vector<int32_t>();
  std::vector<double> P(T * E);
  double z = 0;
  for (int64_t t = 0; t < T; ++t) {
    double m = *std::max_element(lv.begin() + t * E, lv.begin() + (t + 1) * E), s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(lv[t * E + e] - m);
    for (int64_t e = 0; e < E; ++e) P[t * E + e] = std::exp(lv[t * E + e] - m) / s;
    z += std::pow(m + std::log(s), 2) / T;
  }
  auto balance = [&](int64_t t0, int64_t t1) {
    std::vector<double> f(E, 0), p(E, 0);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < k; ++j) f[idx[t * k + j]] += 1.0 / ((t1 - t0) * k);
      for (int64_t e = 0; e < E; ++e) p[e] += P[t * E + e] / (t1 - t0);
    }
    double l = 0;
    for (int64_t e = 0; e < E; ++e) l += E * f[e] * p[e];
    return l;
  };
  double seq = 0;
  for (int64_t s = 0; s < T / L; ++s) seq += balance(s * L, (s + 1) * L) / (T / L);
  EXPECT_NEAR(g.aux.load_balance(), balance(0, T), 1e-5);
  EXPECT_NEAR(g.aux.seq_balance(), seq, 1e-5);
  EXPECT_NEAR(g.aux.z_loss(), z, 1e-4);
  EXPECT_NEAR(g.aux.weighted(), 0.5 * balance(0, T) + 0.25 * seq + 0.125 * z, 1e-4);
}

TEST(MoeGate, SigmoidBiasUpdateMovesLoadTowardBalance) {
  const int64_t T = 256, d = 16;
  MoeConfig c = small_config("sigmoid");
  c.num_experts = 8;
  c.top_k = 2;
  c.bias_update_rate = 0.01f;
  MoELayer layer(c, d, "m", 3, 0.5f);
  // Skewed inputs: a shared offset makes a few experts win most tokens.
  Tensor x = randn({T, d}, 4);
  for (int64_t t = 0; t < T; ++t) x.data<float>()[t * d] += 3.0f;
  const Tensor zero_grad = Tensor::zeros({T, d});
  auto imbalance = [&] {
    layer.forward(x, T);
    layer.backward(zero_grad);  // a trained-on forward: its load counts toward the update
    const auto& load = layer.expert_load();
    return static_cast<double>(*std::max_element(load.begin(), load.end())) / (T * 2.0 / 8);
  };
  const double before = imbalance();
  layer.update_routing_bias();
  double after = before;
  for (int step = 0; step < 300; ++step) {
    after = imbalance();
    layer.update_routing_bias();
  }
  EXPECT_GT(before, 1.5) << "the test needs skewed routing to start from";
  EXPECT_LT(after, before);
  EXPECT_LT(after, 1.3);
  // The bias is a buffer: not among the parameters, and non-zero now.
  ASSERT_NE(layer.gate().routing_bias(), nullptr);
  EXPECT_GT(xmoe::ops::sum_squares(*layer.gate().routing_bias()), 0.0);
  // A forward released without backward (evaluation) leaves the bias where it is.
  const std::vector<float> bias = layer.gate().routing_bias()->to_vector<float>();
  layer.forward(x, T);
  layer.release();
  layer.update_routing_bias();
  EXPECT_EQ(layer.gate().routing_bias()->to_vector<float>(), bias);
  for (Parameter* p : layer.parameters()) EXPECT_EQ(p->name.find("bias"), std::string::npos);
}

TEST(MoeGate, GroupLimitedRoutingStaysInsideTheKeptGroups) {
  const int64_t T = 200, d = 8, E = 16, G = 4, K = 2, k = 3;
  MoeConfig c = small_config("sigmoid");
  c.num_experts = E;
  c.top_k = k;
  c.num_groups = G;
  c.topk_groups = K;
  auto gate = make_gate({c, d, "g", 1, 0.7f, nullptr});
  // A non-zero bias, so the group scores must use the biased scores.
  Tensor* bias = gate->routing_bias();
  for (int64_t e = 0; e < E; ++e) bias->data<float>()[e] = 0.05f * static_cast<float>(e % 5);
  Tensor x = randn({T, d}, 3);
  GateOutput g = gate->forward(x, T);
  auto idx = g.topk_idx.to_vector<int32_t>();
  auto s =
      xmoe::ops::sigmoid(xmoe::ops::matmul(x, gate->parameters()[0]->value)).to_vector<float>();
  const int64_t per = E / G;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::pair<float, int64_t>> gs;
    for (int64_t grp = 0; grp < G; ++grp) {
      std::vector<float> b;
      for (int64_t e = grp * per; e < (grp + 1) * per; ++e)
        b.push_back(s[t * E + e] + bias->data<float>()[e]);
      std::sort(b.rbegin(), b.rend());
      gs.push_back({-(b[0] + b[1]), grp});
    }
    std::sort(gs.begin(), gs.end());
    std::set<int64_t> kept = {gs[0].second, gs[1].second}, used;
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_TRUE(kept.count(idx[t * k + j] / per))
          << "token " << t << " expert " << idx[t * k + j];
      used.insert(idx[t * k + j] / per);
    }
    EXPECT_LE(static_cast<int64_t>(used.size()), K);
  }
}

// moe.router_dtype = bf16 on the CPU: the f32 router run on bf16-rounded x and W, exactly, and a
// backward whose only difference is dlogits rounded to bf16 (close to the f32 gradients).
TEST(MoeGate, Bf16RouterIsTheF32RouterOnRoundedOperands) {
  const int64_t T = 32, d = 16;
  auto rounded = [](const Tensor& t) { return ops::cast(ops::cast(t, DType::bf16), DType::f32); };
  const Tensor x = randn({T, d}, 11), dw = randn({T, 2}, 12);
  for (const std::string name : {"softmax_topk", "sigmoid", "switch"}) {
    MoeConfig c = small_config(name);
    if (name == "switch") c.top_k = 1;
    c.aux_loss_weight = 0.1f;
    c.z_loss_weight = 0.05f;
    MoeConfig cb = c;
    cb.router_dtype = "bf16";
    auto ref = make_gate({c, d, "g", 3, 0.5f, nullptr});
    auto bf = make_gate({cb, d, "g", 3, 0.5f, nullptr});
    std::vector<Parameter*> pr, pb;
    ref->collect_parameters(pr);
    bf->collect_parameters(pb);
    ASSERT_EQ(pr.size(), 1u);
    ASSERT_EQ(pb.size(), 1u);
    EXPECT_EQ(pr[0]->value.to_vector<float>(), pb[0]->value.to_vector<float>()) << name;
    pr[0]->value = rounded(pr[0]->value);
    const GateOutput gr = ref->forward(rounded(x), 8), gb = bf->forward(x, 8);
    EXPECT_EQ(gb.topk_idx.to_vector<int32_t>(), gr.topk_idx.to_vector<int32_t>()) << name;
    EXPECT_EQ(gb.topk_weight.to_vector<float>(), gr.topk_weight.to_vector<float>()) << name;
    EXPECT_EQ(gb.aux.weighted(), gr.aux.weighted()) << name;
    const Tensor d_topk = name == "switch" ? randn({T, 1}, 13) : dw;
    const Tensor dxr = ref->backward(d_topk), dxb = bf->backward(d_topk);
    EXPECT_EQ(dxb.dtype(), DType::f32);
    // bf16 rounding of dlogits: ~2^-9 relative per element.
    EXPECT_LT(xmoe::testing::normalised_error(dxb, dxr), 1e-2) << name << " dx";
    EXPECT_LT(xmoe::testing::normalised_error(pb[0]->grad, pr[0]->grad), 1e-2) << name << " dW";
    EXPECT_GT(ops::sum_squares(pb[0]->grad), 0.0) << name;
  }
  MoeConfig cosine = small_config("xmoe");
  cosine.router_dtype = "bf16";
  EXPECT_TRUE(contains(error_of([&] {
                         make_gate({cosine, d, "g", 3, 0.5f, nullptr});
                       }),
                       "moe.router_dtype = \"bf16\" applies to the linear routers"));
  MoeConfig bad = small_config();
  bad.router_dtype = "f16";
  EXPECT_TRUE(contains(error_of([&] {
                         make_gate({bad, d, "g", 3, 0.5f, nullptr});
                       }),
                       "moe.router_dtype = \"f16\" is not f32 or bf16"));
}

// Gate::set_aux_grad_scale's tensor factor (xmoe.torch passes d_aux as it is, on the device)
// gives the bits of the same factor as a host float, for every gate with aux-loss gradients;
// bad tensors are refused by name.
TEST(MoeGate, AuxGradScaleTensorIsTheHostScale) {
  const int64_t T = 32, d = 16;
  const Tensor x = randn({T, d}, 21), dw = randn({T, 2}, 22);
  for (const std::string name : {"softmax_topk", "sigmoid", "xmoe"}) {
    MoeConfig c = small_config(name);
    c.aux_loss_weight = 0.1f;
    c.seq_aux_loss_weight = 0.07f;
    c.z_loss_weight = 0.05f;
    auto run = [&](float host, const Tensor& factor) {
      auto gate = make_gate({c, d, "g", 3, 0.5f, nullptr});
      gate->forward(x, 8);
      gate->set_aux_grad_scale(host, factor);
      const Tensor dx = gate->backward(dw);
      std::vector<Parameter*> ps;
      gate->collect_parameters(ps);
      std::vector<float> out = dx.to_vector<float>();
      for (Parameter* p : ps)
        for (float g : p->grad.to_vector<float>()) out.push_back(g);
      return out;
    };
    const std::vector<float> host = run(0.37f, Tensor());
    EXPECT_EQ(run(1.f, Tensor::from_vector<float>({0.37f}, {1})), host) << name;
    EXPECT_NE(run(1.f, Tensor()), host) << name;
    EXPECT_TRUE(contains(error_of([&] { run(1.f, Tensor::zeros({2})); }), "scale has 2 elements"))
        << name;
  }
}

// Gate::backward_add (the layer's path: the linear routers add dx in their GEMM) adds what
// backward returns into the given dx and leaves the router's gradient as backward does.
TEST(MoeGate, BackwardAddIsBackwardAdded) {
  const int64_t T = 32, d = 16;
  const Tensor x = randn({T, d}, 31), dw = randn({T, 2}, 32), base = randn({T, d}, 33);
  for (const std::string name : {"softmax_topk", "sigmoid", "xmoe"}) {
    for (const std::string router : {"f32", "bf16"}) {
      if (name == "xmoe" && router == "bf16") continue;  // the cosine router is f32 only
      SCOPED_TRACE(name + " router " + router);
      MoeConfig c = small_config(name);
      c.aux_loss_weight = 0.1f;
      c.router_dtype = router;
      auto run = [&](bool add) {
        auto gate = make_gate({c, d, "g", 3, 0.5f, nullptr});
        gate->forward(x, 8);
        Tensor dx = base.clone();
        if (add) {
          gate->backward_add(dw, dx);
        } else {
          xmoe::ops::add_(dx, gate->backward(dw));
        }
        std::vector<Parameter*> ps;
        gate->collect_parameters(ps);
        return std::pair{dx.to_vector<float>(), ps[0]->grad.to_vector<float>()};
      };
      const auto [added, grad_added] = run(true);
      const auto [expected, grad] = run(false);
      ASSERT_EQ(added.size(), expected.size());
      for (size_t i = 0; i < added.size(); ++i)
        EXPECT_NEAR(added[i], expected[i], 1e-6f * (1.f + std::abs(expected[i]))) << i;
      EXPECT_EQ(grad_added, grad);
      Tensor wrong = Tensor::zeros({T + 1, d});
      if (name != "xmoe") {  // the default backward_add leaves the shape check to add_
        EXPECT_TRUE(contains(error_of([&] {
                               auto gate = make_gate({c, d, "g", 3, 0.5f, nullptr});
                               gate->forward(x, 8);
                               gate->backward_add(dw, wrong);
                             }),
                             "dx"));
      }
    }
  }
}

TEST(MoeGate, RegistryListsKnownGates) {
  auto names = gate_registry().names();
  EXPECT_EQ(names, (std::vector<std::string>{"sigmoid", "softmax_topk", "switch", "xmoe"}));
}

// ---- Hooks ------------------------------------------------------------------------------------

/// Adds to `trace` the name of each boundary in Bs as the layer hands it on.
template <class... Bs>
void trace_boundaries(Hooks& hooks, std::vector<std::string>& trace) {
  (hooks.on<Bs>([&trace](Bs&) { trace.emplace_back(Bs::kName); }), ...);
}

TEST(MoeHooks, ObserversSeeEachBoundary) {
  const int64_t T = 12, d = 8;
  MoeConfig c = small_config();
  c.num_shared_experts = 1;
  MoELayer layer(c, d, "layers.1.moe", 3, 0.5f);
  std::vector<std::string> trace;
  trace_boundaries<LayerIn, GateOut, OrderOut, DispatchOut, ExpertOut, CombineOut, IOrderOut,
                   SharedOut, LayerOutGrad, SharedGrad, IOrderGrad, CombineGrad, ExpertGrad,
                   DispatchGrad, OrderGrad, GateGrad>(layer.hooks(), trace);
  Tensor seen_idx, seen_w, seen_rows, seen_out, seen_dw;
  std::vector<int64_t> seen_tpe;
  double seen_aux = -1;
  layer.hooks().on<GateOut>([&](GateOut& g) {
    seen_idx = g.topk_idx;
    seen_w = g.topk_weight;
    seen_aux = g.aux->weighted();
  });
  layer.hooks().on<OrderOut>([&](OrderOut& o) {
    seen_rows = o.rows;
    seen_tpe = o.layout->tokens_per_expert;
  });
  layer.hooks().on<ExpertOut>([&](ExpertOut& e) { seen_out = e.expert_out; });
  layer.hooks().on<OrderGrad>([&](OrderGrad& g) { seen_dw = g.d_topk_weight; });
  Tensor x = randn({T, d}, 1);
  layer.forward(x, 6);
  EXPECT_EQ(seen_idx.shape(), (Shape{T, 2}));
  EXPECT_EQ(seen_idx.dtype(), DType::i32);
  EXPECT_EQ(seen_w.shape(), (Shape{T, 2}));
  EXPECT_EQ(seen_aux, layer.aux_terms().weighted());
  EXPECT_EQ(seen_rows.shape(), (Shape{T * 2, d}));
  EXPECT_EQ(seen_out.shape(), (Shape{T * 2, d}));
  EXPECT_EQ(seen_tpe, layer.tokens_per_expert());
  // The observed rows are the gathered tokens, in PFT order.
  auto tok = layer.layout().token_ids.to_vector<int32_t>();
  EXPECT_EQ(seen_rows.rows(0, 1).to_vector<float>(), x.rows(tok[0], tok[0] + 1).to_vector<float>());
  layer.backward(randn({T, d}, 2));
  EXPECT_EQ(seen_dw.shape(), (Shape{T, 2}));
  const std::vector<std::string> expect = {
      "LayerIn",    "GateOut",      "OrderOut",     "DispatchOut", "ExpertOut",  "CombineOut",
      "IOrderOut",  "SharedOut",    "LayerOutGrad", "SharedGrad",  "IOrderGrad", "CombineGrad",
      "ExpertGrad", "DispatchGrad", "OrderGrad",    "GateGrad"};
  EXPECT_EQ(trace, expect);
}

TEST(MoeHooks, ReplacementsMustKeepShapeAndDtype) {
  const int64_t T = 12, d = 8;
  MoELayer layer(small_config(), d, "m", 3, 0.5f);
  Tensor x = randn({T, d}, 1);
  HookId id = layer.hooks().on<GateOut>([](GateOut& g) { g.topk_weight = Tensor::zeros({3, 2}); });
  std::string err = error_of([&] { layer.forward(x, 6); });
  EXPECT_TRUE(contains(err, "[moe hooks] GateOut.topk_weight replaced by f32[3, 2]")) << err;
  layer.hooks().remove(id);
  id = layer.hooks().on<ExpertGrad>([](ExpertGrad& g) { g.d_expert_in = Tensor(); });
  layer.forward(x, 6);
  err = error_of([&] { layer.backward(randn({T, d}, 2)); });
  EXPECT_TRUE(contains(err, "ExpertGrad.d_expert_in replaced by an undefined tensor")) << err;
  layer.hooks().remove(id);
  layer.release();
  layer.hooks().on<OrderOut>(
      [](OrderOut& o) { o.combine_weights = o.combine_weights.to(DType::bf16); });
  err = error_of([&] { layer.forward(x, 6); });
  EXPECT_TRUE(contains(err, "OrderOut.combine_weights replaced by bf16")) << err;
  EXPECT_THROW(layer.hooks().on<GateOut>(Hook<GateOut>()), Error);
}

TEST(MoeHooks, ReplacingHookChangesTheOutput) {
  const int64_t T = 12, d = 8;
  MoeConfig c = small_config();
  MoELayer layer(c, d, "m", 3, 0.5f);
  Tensor x = randn({T, d}, 1);
  const auto y0 = layer.forward(x, 6).to_vector<float>();
  layer.release();
  // Force every token onto experts (4, 5) with equal weights.
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < T; ++t) idx.insert(idx.end(), {4, 5});
  const HookId id = layer.hooks().on<GateOut>([&](GateOut& g) {
    g.topk_idx = Tensor::from_vector(idx, {T, 2});
    g.topk_weight = Tensor::full({T, 2}, 0.5f);
  });
  const auto y1 = layer.forward(x, 6).to_vector<float>();
  EXPECT_EQ(layer.tokens_per_expert(), (std::vector<int64_t>{0, 0, 0, 0, T, T}));
  EXPECT_NE(y0, y1);
  // Backward runs; the replaced weights are constants, so the router gets only aux gradients.
  Tensor dx = layer.backward(randn({T, d}, 2));
  EXPECT_TRUE(xmoe::ops::all_finite(dx));
  layer.hooks().remove(id);
  EXPECT_TRUE(layer.hooks().empty());
  EXPECT_EQ(layer.forward(x, 6).to_vector<float>(), y0);
}

TEST(MoeHooks, HookCanReplaceTheExpertsInput) {
  const int64_t T = 12, d = 8;
  MoELayer layer(small_config(), d, "m", 3, 0.5f);
  Tensor x = randn({T, d}, 1);
  layer.hooks().on<DispatchOut>(
      [&](DispatchOut& dsp) { dsp.expert_in = Tensor::zeros(dsp.expert_in.shape()); });
  // Zero expert inputs give zero SwiGLU outputs, so y (no shared experts) is zero.
  EXPECT_EQ(xmoe::ops::sum_squares(layer.forward(x, 6)), 0.0);
  // Backward uses the replaced rows (zeros), not rows gathered again from x: no weight gradient
  // for gate_up reaches it.
  layer.zero_grad();
  layer.backward(randn({T, d}, 2));
  EXPECT_EQ(xmoe::ops::sum_squares(layer.parameters()[1]->grad), 0.0);
}

// A backward hook replaces a gradient: every later stage reads it.
TEST(MoeHooks, BackwardHookCanReplaceAGradient) {
  const int64_t T = 12, d = 8;
  MoELayer layer(small_config(), d, "m", 3, 0.5f);
  Tensor x = randn({T, d}, 1);
  layer.hooks().on<CombineGrad>([](CombineGrad& g) {
    g.d_expert_out = Tensor::zeros(g.d_expert_out.shape());
    g.d_combine_weights = Tensor::zeros(g.d_combine_weights.shape());
  });
  layer.forward(x, 6);
  layer.zero_grad();
  layer.backward(randn({T, d}, 2));  // no gradient reaches the experts
  for (Parameter* p : layer.parameters())
    if (p->kind == ParamKind::expert) {
      EXPECT_EQ(xmoe::ops::sum_squares(p->grad), 0.0) << p->name;
    }
}

// ---- Layer ------------------------------------------------------------------------------------

TEST(MoeLayer, ParametersAreNamedAndShardable) {
  MoeConfig c = small_config("xmoe");
  c.num_shared_experts = 2;
  MoELayer layer(c, 8, "layers.2.moe", 1, 0.02f, 0.005f);
  std::vector<std::string> names;
  for (Parameter* p : layer.parameters()) names.push_back(p->name);
  EXPECT_EQ(names, (std::vector<std::string>{
                       "layers.2.moe.router.weight", "layers.2.moe.router.expert_embeddings",
                       "layers.2.moe.router.temperature", "layers.2.moe.experts.gate_up",
                       "layers.2.moe.experts.down", "layers.2.moe.shared.gate_up",
                       "layers.2.moe.shared.down"}));
  auto ps = layer.parameters();
  EXPECT_EQ(ps[3]->value.shape(), (Shape{6, 8, 8}));
  EXPECT_EQ(ps[3]->kind, ParamKind::expert);
  EXPECT_EQ(ps[3]->shard.whole, (Shape{6, 8, 8}));
  EXPECT_EQ(ps[4]->value.shape(), (Shape{6, 4, 8}));
  EXPECT_EQ(ps[5]->value.shape(), (Shape{8, 2 * 2 * 4}));
  EXPECT_EQ(ps[5]->kind, ParamKind::dense);
  EXPECT_EQ(ps[6]->value.shape(), (Shape{2 * 4, 8}));
  EXPECT_FALSE(ps[2]->weight_decay);
  EXPECT_FLOAT_EQ(ps[2]->value.data<float>()[0], c.router_temperature);
  // down_std scales the down projections only.
  EXPECT_NEAR(std::sqrt(xmoe::ops::sum_squares(ps[4]->value) / ps[4]->value.numel()), 0.005, 0.002);
  EXPECT_NEAR(std::sqrt(xmoe::ops::sum_squares(ps[3]->value) / ps[3]->value.numel()), 0.02, 0.005);
}

TEST(MoeLayer, FrozenRoutingReusesTheSelection) {
  const int64_t T = 12, d = 8;
  MoELayer layer(small_config(), d, "m", 3, 0.5f);
  Tensor x = randn({T, d}, 1);
  layer.forward(x, 6);
  const auto tpe = layer.tokens_per_expert();
  const auto s2r = layer.layout().slot_to_row.to_vector<int32_t>();
  layer.set_frozen_routing(true);
  layer.forward(randn({T, d}, 99), 6);  // different tokens, same routing
  EXPECT_EQ(layer.tokens_per_expert(), tpe);
  EXPECT_EQ(layer.layout().slot_to_row.to_vector<int32_t>(), s2r);
}

TEST(MoeLayer, BadArgumentsRaiseClearErrors) {
  MoeConfig c = small_config();
  c.top_k = 9;
  EXPECT_TRUE(contains(error_of([&] { MoELayer l(c, 8, "m", 1, 0.1f); }),
                       "moe.top_k = 9 exceeds moe.num_experts = 6"));
  c = small_config("nope");
  const std::string gate_err = error_of([&] { MoELayer l(c, 8, "m", 1, 0.1f); });
  EXPECT_TRUE(contains(gate_err, "unknown moe.gate = 'nope'")) << gate_err;
  EXPECT_TRUE(contains(gate_err, "sigmoid, softmax_topk, switch, xmoe")) << gate_err;
  c = small_config();
  c.impl = "dense";
  EXPECT_TRUE(contains(error_of([&] { MoELayer l(c, 8, "m", 1, 0.1f); }),
                       "unknown moe.impl = 'dense' (known: padded, pft)"));
  c = small_config("switch");
  EXPECT_TRUE(contains(error_of([&] { MoELayer l(c, 8, "m", 1, 0.1f); }), "routes top-1"));
  c = small_config();
  c.dispatch = "rbd";  // one process: one node, so rbd is all_to_all
  EXPECT_NO_THROW(MoELayer(c, 8, "m", 1, 0.1f));
  c.impl = "padded";
  EXPECT_THROW(MoELayer(c, 8, "m", 1, 0.1f), Error);
  c = small_config("sigmoid");
  c.num_groups = 4;
  EXPECT_TRUE(contains(error_of([&] { MoELayer l(c, 8, "m", 1, 0.1f); }),
                       "moe.num_groups = 4 must divide moe.num_experts = 6"));

  MoELayer layer(small_config(), 8, "m", 1, 0.1f);
  EXPECT_TRUE(contains(error_of([&] {
                         layer.forward(Tensor::zeros({12, 7}), 6);
                       }),
                       "[moe] x has shape [12, 7], expected [-1, 8]"));
  EXPECT_TRUE(contains(error_of([&] {
                         layer.forward(Tensor::zeros({12, 8}), 5);
                       }),
                       "12 tokens are not a multiple of seq_len = 5"));
  EXPECT_TRUE(contains(error_of([&] {
                         layer.backward(Tensor::zeros({12, 8}));
                       }),
                       "backward without a forward"));
}

TEST(MoeLayer, RoutedOutputIsTheWeightedSumOfExpertOutputs) {
  // Reference: per token, loop over its k experts and run a plain SwiGLU with matmul.
  const int64_t T = 10, d = 8, f = 4;
  MoeConfig c = small_config();
  MoELayer layer(c, d, "m", 3, 0.5f);
  Tensor x = randn({T, d}, 1);
  Tensor idx_seen, w_seen;
  layer.hooks().on<GateOut>([&](GateOut& g) {
    idx_seen = g.topk_idx;
    w_seen = g.topk_weight;
  });
  auto y = layer.forward(x, 5).to_vector<float>();
  auto ps = layer.parameters();
  const Tensor& gu = ps[1]->value;
  const Tensor& dn = ps[2]->value;
  auto iv = idx_seen.to_vector<int32_t>();
  auto wv = w_seen.to_vector<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> ref(d, 0.f);
    for (int64_t j = 0; j < 2; ++j) {
      const int64_t e = iv[t * 2 + j];
      Tensor gu_e = gu.rows(e, e + 1).reshape({d, 2 * f}).clone();
      Tensor dn_e = dn.rows(e, e + 1).reshape({f, d}).clone();
      Tensor o = xmoe::ops::matmul(
          xmoe::ops::swiglu(xmoe::ops::matmul(x.rows(t, t + 1).clone(), gu_e)), dn_e);
      for (int64_t i = 0; i < d; ++i) ref[i] += wv[t * 2 + j] * o.data<float>()[i];
    }
    for (int64_t i = 0; i < d; ++i) EXPECT_NEAR(y[t * d + i], ref[i], 1e-5);
  }
}

TEST(MoeLayer, AllToAllWithOneRankIsExactlyLocal) {
  // ep = 1 (one process, or a single-process group): the all_to_all dispatcher is the identity,
  // so the layer's output and gradients are bit for bit those of `local`.
  for (const char* gate : {"softmax_topk", "sigmoid"}) {
    MoeConfig c = small_config(gate);
    c.num_shared_experts = 1;
    c.aux_loss_weight = 0.1f;
    c.seq_aux_loss_weight = 0.1f;
    c.z_loss_weight = 0.01f;
    MoELayer local(c, 8, "m", 3, 0.3f);
    c.dispatch = "all_to_all";
    const auto single = comm::make_single_group();
    MoELayer a2a(c, 8, "m", 3, 0.3f, std::nullopt, LayerGroups{single, single});
    Tensor x = randn({12, 8}, 4), dy = randn({12, 8}, 5);
    EXPECT_EQ(a2a.forward(x, 6).to_vector<float>(), local.forward(x, 6).to_vector<float>());
    EXPECT_EQ(a2a.aux_loss(), local.aux_loss());
    EXPECT_EQ(a2a.backward(dy).to_vector<float>(), local.backward(dy).to_vector<float>());
    auto pa = a2a.parameters(), pl = local.parameters();
    ASSERT_EQ(pa.size(), pl.size());
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_EQ(pa[i]->grad.to_vector<float>(), pl[i]->grad.to_vector<float>()) << pa[i]->name;
    DispatchConfig dc;
    dc.algorithm = "all_to_all";
    dc.num_experts = 6;
    auto d = make_dispatcher(dc);
    const std::vector<int64_t> tpe{2, 0, 1, 0, 0, 3};
    DispatchResult r = d->dispatch(x.rows(0, 6), tpe);
    EXPECT_EQ(r.handle.recv_tokens_per_expert, tpe);
    EXPECT_EQ(d->combine(r.rows, r.handle).to_vector<float>(), x.rows(0, 6).to_vector<float>());
  }
}

// The I-Order backward op in place: the reference's values (gather, dot, scale), written over
// rows, with nothing allocated but the dots; -1 slots give zero rows.
TEST(MoeOps, WeightedGatherDotInPlaceMatchesTheReference) {
  const int64_t T = 6, N = 9, d = 5;
  const Tensor dy = randn({T, d}, 1), w = randn({N}, 2);
  const Tensor index = Tensor::from_vector<int32_t>({0, 5, -1, 2, 2, 3, 1, -1, 4}, {N});
  const Tensor rows = randn({N, d}, 3);
  const WeightedGather ref = gather_weighted_rows_dot(dy, rows, index, w);
  Tensor in_place = rows.clone();
  const void* storage = in_place.raw();
  WeightedGather got;
  {
    PeakMemoryScope scope;
    got = gather_weighted_rows_dot(dy, in_place, index, w, true);
    EXPECT_LE(scope.extra_peak_bytes(), static_cast<int64_t>(N * sizeof(float)));
  }
  EXPECT_EQ(got.d_rows.raw(), storage);
  EXPECT_EQ(in_place.to_vector<float>(), ref.d_rows.to_vector<float>());
  EXPECT_EQ(got.dot.to_vector<float>(), ref.dot.to_vector<float>());
  const Tensor bad = Tensor::from_vector<int32_t>({0, 6, 0, 0, 0, 0, 0, 0, 0}, {N});
  Tensor again = rows.clone();
  EXPECT_THROW(gather_weighted_rows_dot(dy, again, bad, w, true), Error);
}

// bench_moe_layer --weights bf16: the routed experts' weights in bf16 only (no f32 master). On
// the CPU the layer computes in f32 from those bf16 weights, so it equals, bit for bit, a layer
// whose f32 master weights were rounded to bf16; the f32 weights' bytes go, the gradients stay
// f32, and AdamW refuses the bf16-only parameters.
TEST(MoeLayer, Bf16OnlyExpertWeightsEqualRoundedMasterWeights) {
  const int64_t T = 24, d = 8;
  const MoeConfig c = small_config();
  MoELayer master(c, d, "m", 3, 0.5f), bf16_only(c, d, "m", 3, 0.5f);
  for (Parameter* p : master.experts().parameters())
    p->value = p->value.to(DType::bf16).to(DType::f32);
  int64_t weight_elems = 0;
  const int64_t live = memory_stats().live_bytes;
  for (Parameter* p : bf16_only.experts().parameters()) {
    weight_elems += p->value.numel();
    p->drop_master_weights(DType::bf16);
    EXPECT_EQ(p->value.dtype(), DType::bf16) << p->name;
    EXPECT_EQ(p->grad.dtype(), DType::f32) << p->name;
  }
  EXPECT_EQ(memory_stats().live_bytes, live - 2 * weight_elems);
  const Tensor x = randn({T, d}, 21), dy = randn({T, d}, 22);
  for (MoELayer* l : {&master, &bf16_only}) l->zero_grad();
  const Tensor y_ref = master.forward(x, T), y = bf16_only.forward(x, T);
  EXPECT_EQ(y.to_vector<float>(), y_ref.to_vector<float>());
  const Tensor dx_ref = master.backward(dy), dx = bf16_only.backward(dy);
  EXPECT_EQ(dx.to_vector<float>(), dx_ref.to_vector<float>());
  const auto pr = master.parameters(), pb = bf16_only.parameters();
  ASSERT_EQ(pr.size(), pb.size());
  for (size_t i = 0; i < pr.size(); ++i) {
    pr[i]->settle_grad();
    pb[i]->settle_grad();
    EXPECT_EQ(pb[i]->grad.to_vector<float>(), pr[i]->grad.to_vector<float>()) << pb[i]->name;
  }
  EXPECT_GT(ops::sum_squares(pb.back()->grad), 0.0);
  EXPECT_TRUE(contains(error_of([&] { optim::AdamW opt(pb, optim::AdamWConfig{}); }),
                       "value must be f32 (master weights)"));
}
