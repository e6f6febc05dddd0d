// The transformer: finite-difference gradients of a whole micro model (dense, MoE, tied),
// recompute on/off equality, causality, parameter naming/order/initialisation, errors.
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "gradcheck.h"
#include "training_fixture.h"
#include "xmoe/core/allocator.h"
#include "xmoe/model/transformer.h"
#include "xmoe/moe/layer.h"
#include "xmoe/ops/ops.h"
#include "xmoe/optim/adamw.h"

using namespace xmoe;
using xmoe::testing::expect_gradient_close;

namespace {

// The shared micro model (training_fixture.h: vocab 11, d = 8, 2 layers, layer 1 MoE in the
// MoE variant) with rope_theta 100 and large weights, so that every path carries a gradient
// well above f32 rounding.
ModelConfig micro_config(bool moe) {
  ModelConfig c = xmoe::testing::micro_model(moe);
  c.rope_theta = 100.f;
  c.init_std = 0.4f;
  return c;
}

Tensor make_ids(int64_t b, int64_t s, int64_t vocab, int32_t offset) {
  std::vector<int32_t> v(static_cast<size_t>(b * s));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<int32_t>((i * 7 + static_cast<size_t>(offset) + i * i) % vocab);
  return Tensor::from_vector<int32_t>(v, {b, s});
}

std::map<std::string, std::vector<float>> grads_of(model::Transformer& m) {
  std::map<std::string, std::vector<float>> g;
  for (Parameter* p : m.parameters()) g[p->name] = p->grad.to_vector<float>();
  return g;
}

// The objective the trainer minimises: CE + weighted aux losses; leaves nothing saved.
double objective(model::Transformer& m, const Tensor& ids, const Tensor& targets) {
  const double l = m.forward_loss(ids, targets) + m.aux_loss();
  m.release();
  return l;
}

// Analytic gradients of the objective against central differences for every parameter
// (up to 24 elements each, spread over the tensor).
void check_model_gradients(model::Transformer& m, const Tensor& ids, const Tensor& targets) {
  m.zero_grad();
  m.forward_loss(ids, targets);
  m.backward();
  for (Parameter* p : m.parameters()) {
    const Tensor analytic = p->grad.clone();
    expect_gradient_close(
        p->value, analytic, [&] { return objective(m, ids, targets); }, p->name.c_str(), 1e-2, 3e-2,
        24);
    // Parameters that are used must receive a gradient.
    EXPECT_GT(ops::sum_squares(analytic), 0.0) << p->name;
  }
}

}  // namespace

TEST(Model, ParameterNamesOrderShapesAndInit) {
  ModelConfig c = micro_config(false);
  c.init_std = 0.02f;
  c.d_model = 64;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.dense_hidden = 96;
  c.vocab_size = 100;
  model::Transformer m(c, 7);
  std::vector<std::string> names;
  for (Parameter* p : m.parameters()) names.push_back(p->name);
  const std::vector<std::string> expected = {"embed.weight",
                                             "layers.0.attn_norm.weight",
                                             "layers.0.attn.wq",
                                             "layers.0.attn.wk",
                                             "layers.0.attn.wv",
                                             "layers.0.attn.wo",
                                             "layers.0.ffn_norm.weight",
                                             "layers.0.ffn.gate_up",
                                             "layers.0.ffn.down",
                                             "layers.1.attn_norm.weight",
                                             "layers.1.attn.wq",
                                             "layers.1.attn.wk",
                                             "layers.1.attn.wv",
                                             "layers.1.attn.wo",
                                             "layers.1.ffn_norm.weight",
                                             "layers.1.ffn.gate_up",
                                             "layers.1.ffn.down",
                                             "final_norm.weight",
                                             "lm_head.weight"};
  EXPECT_EQ(names, expected);
  std::map<std::string, Parameter*> by;
  for (Parameter* p : m.parameters()) by[p->name] = p;
  EXPECT_EQ(by["embed.weight"]->value.shape(), (Shape{100, 64}));
  EXPECT_EQ(by["layers.0.attn.wq"]->value.shape(), (Shape{64, 64}));
  EXPECT_EQ(by["layers.0.attn.wk"]->value.shape(), (Shape{64, 32}));  // 2 kv heads x 16
  EXPECT_EQ(by["layers.0.attn.wo"]->value.shape(), (Shape{64, 64}));
  EXPECT_EQ(by["layers.0.ffn.gate_up"]->value.shape(), (Shape{64, 192}));
  EXPECT_EQ(by["layers.0.ffn.down"]->value.shape(), (Shape{96, 64}));
  EXPECT_EQ(by["lm_head.weight"]->value.shape(), (Shape{64, 100}));
  // Norms: ones, no weight decay. Matrices: N(0, 0.02^2); wo and down scaled by 1/sqrt(2L).
  for (auto* n : {"layers.0.attn_norm.weight", "final_norm.weight"}) {
    EXPECT_FALSE(by[n]->weight_decay);
    for (float v : by[n]->value.to_vector<float>()) EXPECT_EQ(v, 1.f);
  }
  auto stdev = [](const Tensor& t) { return std::sqrt(ops::sum_squares(t) / t.numel()); };
  EXPECT_TRUE(by["layers.0.attn.wq"]->weight_decay);
  EXPECT_NEAR(stdev(by["layers.0.attn.wq"]->value), 0.02, 0.002);
  EXPECT_NEAR(stdev(by["embed.weight"]->value), 0.02, 0.002);
  EXPECT_NEAR(stdev(by["layers.1.ffn.gate_up"]->value), 0.02, 0.002);
  EXPECT_NEAR(stdev(by["layers.0.attn.wo"]->value), 0.01, 0.001);  // 0.02 / sqrt(4)
  EXPECT_NEAR(stdev(by["layers.1.ffn.down"]->value), 0.01, 0.001);
  // Same seed, same weights; another seed, other weights.
  model::Transformer same(c, 7), other(c, 8);
  EXPECT_EQ(same.parameters()[2]->value.to_vector<float>(),
            by["layers.0.attn.wq"]->value.to_vector<float>());
  EXPECT_NE(other.parameters()[2]->value.to_vector<float>(),
            by["layers.0.attn.wq"]->value.to_vector<float>());
  EXPECT_EQ(m.num_parameters(),
            100 * 64 * 2 + 2 * (64 + 64 * 64 * 2 + 64 * 32 * 2 + 64 + 64 * 192 + 96 * 64) + 64);
}

TEST(Model, ForwardShapesAndLoss) {
  model::Transformer m(micro_config(false), 1);
  Tensor ids = make_ids(3, 5, 11, 0);
  Tensor logits = m.forward(ids);
  EXPECT_EQ(logits.shape(), (Shape{15, 11}));
  EXPECT_TRUE(ops::all_finite(logits));
  Tensor targets = make_ids(3, 5, 11, 1);
  const float l = m.forward_loss(ids, targets);
  EXPECT_NEAR(l, model::Transformer::loss(logits, targets), 1e-6);
  EXPECT_GT(m.saved_bytes(), 0);
  // evaluate_loss: the same value, nothing left saved, grads untouched.
  EXPECT_EQ(m.evaluate_loss(ids, targets), l);
  EXPECT_EQ(m.saved_bytes(), 0);
  for (Parameter* p : m.parameters()) EXPECT_EQ(ops::sum_squares(p->grad), 0.0);
  EXPECT_THROW(m.backward(), Error);  // released: nothing to backpropagate
}

// backward_modules() lists the modules in the order backward reports them to grads_ready (the
// gradient partition's pieces rely on it), every parameter once; tied embeddings: no LM head.
TEST(Model, BackwardModulesAreTheOrderBackwardReports) {
  for (bool tied : {false, true}) {
    ModelConfig c = micro_config(/*moe=*/true);
    c.tie_embeddings = tied;
    model::Transformer m(c, 1);
    std::vector<std::vector<Parameter*>> reported;
    m.set_grads_ready([&](const std::vector<Parameter*>& ps) { reported.push_back(ps); });
    m.forward_loss(make_ids(2, 5, 11, 0), make_ids(2, 5, 11, 1));
    m.backward();
    const auto modules = m.backward_modules();
    ASSERT_EQ(modules.size(), reported.size());
    size_t params = 0;
    for (size_t i = 0; i < modules.size(); ++i) {
      EXPECT_EQ(modules[i].params, reported[i]) << modules[i].name;
      params += modules[i].params.size();
    }
    EXPECT_EQ(params, m.parameters().size());
    EXPECT_EQ(modules.front().name, tied ? "final_norm" : "lm_head");
    EXPECT_EQ(modules.back().name, "embedding");
  }
}

TEST(Model, DenseGradientsMatchFiniteDifferences) {
  model::Transformer m(micro_config(false), 3);
  Tensor ids = make_ids(2, 5, 11, 2);
  Tensor targets = make_ids(2, 5, 11, 5);
  targets.data<int32_t>()[3] = -1;  // an ignored position
  check_model_gradients(m, ids, targets);
}

TEST(Model, TiedEmbeddingGradientsMatchFiniteDifferences) {
  ModelConfig c = micro_config(false);
  c.tie_embeddings = true;
  c.num_layers = 1;
  c.first_dense_layers = 1;
  model::Transformer m(c, 4);
  EXPECT_EQ(m.lm_head(), nullptr);
  EXPECT_EQ(m.parameters().back()->name, "final_norm.weight");
  check_model_gradients(m, make_ids(2, 4, 11, 1), make_ids(2, 4, 11, 6));
}

TEST(Model, MoeGradientsMatchFiniteDifferencesWithFrozenRouting) {
  model::Transformer m(micro_config(true), 5);
  ASSERT_EQ(m.moe_layers().size(), 1u);
  EXPECT_TRUE(m.block(1).is_moe());
  EXPECT_FALSE(m.block(0).is_moe());
  bool found_moe_param = false;
  for (Parameter* p : m.parameters()) found_moe_param |= p->name.rfind("layers.1.moe.", 0) == 0;
  EXPECT_TRUE(found_moe_param);
  Tensor ids = make_ids(2, 6, 11, 3);
  Tensor targets = make_ids(2, 6, 11, 4);
  // Route once, then hold the expert choice fixed: top-k is discrete, and a perturbation that
  // flips a choice would make the loss jump.
  objective(m, ids, targets);
  for (moe::MoELayer* l : m.moe_layers()) l->set_frozen_routing(true);
  EXPECT_GT(m.aux_loss(), 0.f);
  check_model_gradients(m, ids, targets);
}

TEST(Model, RecomputeGivesIdenticalGradients) {
  const std::vector<std::vector<std::string>> mixes = {{"attention", "ffn", "moe"},
                                                       {"attention_core"},
                                                       {"router"},
                                                       {"moe", "router"},
                                                       {"attention_core", "ffn", "moe", "router"}};
  for (bool moe : {false, true}) {
    for (const auto& mix : mixes) {
      const bool moe_only = std::all_of(
          mix.begin(), mix.end(), [](const std::string& e) { return e == "moe" || e == "router"; });
      if (!moe && moe_only) continue;  // nothing of the dense model is recomputed
      SCOPED_TRACE(fmt::format("moe {} recompute {}", moe, fmt::join(mix, ",")));
      ModelConfig c = micro_config(moe);
      c.moe.aux_loss_weight = 0.1f;  // the aux losses' backward reads the router's tensors
      c.moe.z_loss_weight = 0.01f;
      model::Transformer base(c, 9);
      c.recompute = mix;
      model::Transformer re(c, 9);
      Tensor ids = make_ids(2, 7, 11, 1), targets = make_ids(2, 7, 11, 2);
      // Allocator live bytes: the MoE layer does not report what it saves.
      int64_t live = memory_stats().live_bytes;
      const float l1 = base.forward_loss(ids, targets);
      const int64_t saved_base = memory_stats().live_bytes - live;
      live = memory_stats().live_bytes;
      const float l2 = re.forward_loss(ids, targets);
      const int64_t saved_re = memory_stats().live_bytes - live;
      EXPECT_EQ(l1, l2);
      EXPECT_EQ(base.aux_loss(), re.aux_loss());
      EXPECT_LT(saved_re, saved_base);
      base.backward();
      re.backward();
      EXPECT_EQ(grads_of(base), grads_of(re));
      EXPECT_EQ(base.saved_bytes(), 0);
      EXPECT_EQ(re.saved_bytes(), 0);
    }
  }
}

TEST(Model, RecomputeSwitchPerModule) {
  ModelConfig c = micro_config(false);
  c.max_seq_len = 16;
  model::Transformer m(c, 2);
  Tensor ids = make_ids(2, 16, 11, 0);
  auto saved_with = [&](model::RecomputeOptions r) {
    m.set_recompute(r);
    m.forward(ids);
    const int64_t s = m.saved_bytes();
    m.release();
    return s;
  };
  const int64_t none = saved_with({});
  const int64_t attn = saved_with({.attention = true});
  const int64_t core = saved_with({.attention_core = true});
  const int64_t ffn = saved_with({.ffn = true});
  const int64_t T = 32, hd = 4;
  // Attention drops q [T, 2 hd], k, v [T, hd], out [T, 2 hd] and lse [B, H, S] per layer.
  EXPECT_EQ(none - attn, 2 * 4 * (T * (2 + 1 + 1 + 2) * hd + T * 2));
  // Its core drops out and lse only.
  EXPECT_EQ(none - core, 2 * 4 * (T * 2 * hd + T * 2));
  // "attention" covers "attention_core".
  EXPECT_EQ(saved_with({.attention = true, .attention_core = true}), attn);
  // The dense FFN drops h [T, 2 * 12] per layer.
  EXPECT_EQ(none - ffn, 2 * 4 * T * 24);
  EXPECT_THROW(model::parse_recompute({"attention", "mlp"}), Error);
}

TEST(Model, LogitsAreCausal) {
  for (bool moe : {false, true}) {
    model::Transformer m(micro_config(moe), 11);
    const int64_t B = 2, S = 7, V = 11, j = 4;
    Tensor ids = make_ids(B, S, V, 0);
    const auto a = m.forward(ids).to_vector<float>();
    Tensor changed = ids.clone();
    changed.data<int32_t>()[1 * S + j] = (changed.data<int32_t>()[1 * S + j] + 5) % V;  // seq 1
    const auto b = m.forward(changed).to_vector<float>();
    for (int64_t s = 0; s < S; ++s) {
      double diff0 = 0, diff1 = 0;
      for (int64_t v = 0; v < V; ++v) {
        diff0 = std::max(diff0, (double)std::fabs(a[(0 * S + s) * V + v] - b[(0 * S + s) * V + v]));
        diff1 = std::max(diff1, (double)std::fabs(a[(1 * S + s) * V + v] - b[(1 * S + s) * V + v]));
      }
      EXPECT_LE(diff0, 1e-6) << "moe " << moe << ": other sequence, position " << s;
      if (s < j)
        EXPECT_LE(diff1, 1e-6) << "moe " << moe << ": position " << s << " < " << j;
      else
        EXPECT_GT(diff1, 1e-4) << "moe " << moe << ": position " << s << " >= " << j;
    }
  }
}

TEST(Model, GradientsAccumulateOverMicroBatches) {
  model::Transformer m(micro_config(false), 12);
  Tensor ids = make_ids(2, 5, 11, 0), targets = make_ids(2, 5, 11, 3);
  m.forward_loss(ids, targets);
  m.backward();
  const auto once = grads_of(m);
  m.forward_loss(ids, targets);
  m.backward(0.5f);
  for (auto& [name, g] : grads_of(m))
    for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], 1.5f * once.at(name)[i], 1e-6) << name;
}

TEST(Model, TrainingReducesTheLoss) {
  for (bool moe : {false, true}) {
    ModelConfig c = micro_config(moe);
    c.init_std = 0.1f;
    model::Transformer m(c, 13);
    optim::AdamW opt(m.parameters(), {0.9f, 0.95f, 1e-8f, 0.0f});
    Tensor ids = make_ids(2, 8, 11, 0), targets = make_ids(2, 8, 11, 1);
    float first = 0, last = 0;
    for (int step = 0; step < 40; ++step) {
      opt.zero_grad();
      last = m.forward_loss(ids, targets);
      if (step == 0) first = last;
      m.backward();
      optim::clip_grad_norm(m.parameters(), 1.0f);
      opt.step(1e-2f);
    }
    EXPECT_LT(last, 0.5f * first) << "moe " << moe;
  }
}

TEST(Model, ConfigAndInputErrors) {
  ModelConfig c = micro_config(false);
  c.num_heads = 3;  // 8 % 3
  EXPECT_THROW(model::Transformer(c, 1), Error);
  c = micro_config(false);
  c.num_kv_heads = 3;
  EXPECT_THROW(model::Transformer(c, 1), Error);
  c = micro_config(false);
  c.recompute = {"everything"};
  EXPECT_THROW(model::Transformer(c, 1), Error);
  model::Transformer m(micro_config(false), 1);
  EXPECT_THROW(m.forward(make_ids(1, 9, 11, 0)), Error);  // S > max_seq_len
  EXPECT_THROW(m.forward(Tensor::zeros({1, 4}, DType::i64)), Error);
  EXPECT_THROW(m.forward(Tensor::from_vector<int32_t>({0, 11}, {1, 2})), Error);  // id >= V
  EXPECT_THROW(m.backward(), Error);  // no forward_loss yet
}
