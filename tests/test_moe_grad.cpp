// Finite-difference gradient checks of the whole MoE layer, per gate and implementation.
// Routing (the top-k choice) is discrete, so each check first routes once and then freezes the
// selection (MoELayer::set_frozen_routing): the weights, losses and everything downstream stay
// differentiable, and central differences agree with backward. The scalar checked is
//   L = sum(y * R) + aux_loss   (R a fixed random tensor),
// so backward(R) must also deliver the aux-loss gradients. f32 forward, eps = 1e-2, error
// normalised by the largest gradient entry of the tensor (gradcheck.h): 2% of that scale.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "gradcheck.h"
#include "xmoe/core/allocator.h"
#include "xmoe/moe/layer.h"
#include "xmoe/moe/padded.h"

using namespace xmoe;
using namespace xmoe::moe;
using xmoe::testing::expect_gradient_close;
using xmoe::testing::randn;
using xmoe::testing::weighted_sum;

namespace {

constexpr int64_t kT = 12, kD = 8, kSeq = 6;

MoeConfig small_config(const std::string& gate) {
  MoeConfig c;
  c.num_experts = 6;
  c.top_k = 2;
  c.expert_hidden = 4;
  c.num_shared_experts = 1;
  c.gate = gate;
  c.aux_loss_weight = 0.f;
  c.seq_aux_loss_weight = 0.f;
  c.z_loss_weight = 0.f;
  return c;
}

/// Checks d L / d x and d L / d every parameter; returns the parameter names checked.
/// With aux_only, R = 0: the aux losses are the whole loss, so their gradients are not drowned
/// by the (much larger) gradient of sum(y * R) within the tolerance.
std::vector<std::string> check_layer_gradients(const MoeConfig& cfg, float init_std = 0.5f,
                                               bool aux_only = false) {
  MoELayer layer(cfg, kD, "layers.0.moe", 7, init_std);
  Tensor x = randn({kT, kD}, 11);
  Tensor r = aux_only ? Tensor::zeros({kT, kD}) : randn({kT, kD}, 12);
  layer.forward(x, kSeq);
  layer.release();
  layer.set_frozen_routing(true);

  auto loss = [&] {
    Tensor y = layer.forward(x, kSeq);
    const double l = weighted_sum(y, r) + layer.aux_terms().weighted();
    layer.release();
    return l;
  };
  layer.zero_grad();
  layer.forward(x, kSeq);
  Tensor dx = layer.backward(r);
  expect_gradient_close(x, dx, loss, "x", 1e-2, 2e-2, 1000);
  std::vector<std::string> names;
  for (Parameter* p : layer.parameters()) {
    Tensor g = p->grad.clone();
    expect_gradient_close(p->value, g, loss, p->name.c_str(), 1e-2, 2e-2, 1000);
    names.push_back(p->name);
  }
  return names;
}

}  // namespace

TEST(MoeGrad, SoftmaxTopkGShardWithAllThreeLosses) {
  MoeConfig c = small_config("softmax_topk");
  c.aux_loss_weight = 0.5f;
  c.seq_aux_loss_weight = 0.3f;
  c.z_loss_weight = 0.1f;
  auto names = check_layer_gradients(c);
  EXPECT_EQ(names,
            (std::vector<std::string>{"layers.0.moe.router.weight", "layers.0.moe.experts.gate_up",
                                      "layers.0.moe.experts.down", "layers.0.moe.shared.gate_up",
                                      "layers.0.moe.shared.down"}));
}

TEST(MoeGrad, AuxLossesAloneReachTheRouterOfEachGate) {
  for (const std::string gate : {"softmax_topk", "mixtral", "sigmoid", "switch", "xmoe"}) {
    SCOPED_TRACE(gate);
    MoeConfig c = small_config(gate == "mixtral" ? "softmax_topk" : gate);
    c.softmax_before_topk = gate != "mixtral";
    if (gate == "switch") c.top_k = 1;
    c.num_groups = gate == "sigmoid" ? 3 : 1;
    c.topk_groups = gate == "sigmoid" ? 2 : 1;
    c.router_dim = 4;
    for (int which = 0; which < 3; ++which) {  // each loss alone, so none hides another
      c.aux_loss_weight = which == 0 ? 1.0f : 0.f;
      c.seq_aux_loss_weight = which == 1 ? 1.0f : 0.f;
      c.z_loss_weight = which == 2 ? 1.0f : 0.f;
      check_layer_gradients(c, 0.5f, /*aux_only=*/true);
    }
  }
}

TEST(MoeGrad, SoftmaxTopkGShardNoRenormalize) {
  MoeConfig c = small_config("softmax_topk");
  c.renormalize = false;
  c.aux_loss_weight = 0.2f;
  check_layer_gradients(c);
}

TEST(MoeGrad, SoftmaxTopkMixtral) {
  MoeConfig c = small_config("softmax_topk");
  c.softmax_before_topk = false;
  c.aux_loss_weight = 0.4f;
  c.z_loss_weight = 0.05f;
  check_layer_gradients(c);
}

TEST(MoeGrad, SigmoidWithGroupsScalingAndLosses) {
  MoeConfig c = small_config("sigmoid");
  c.num_groups = 3;
  c.topk_groups = 2;
  c.routed_scaling = 2.5f;
  c.aux_loss_weight = 0.3f;
  c.seq_aux_loss_weight = 0.5f;
  c.z_loss_weight = 0.05f;
  check_layer_gradients(c);
}

TEST(MoeGrad, Switch) {
  MoeConfig c = small_config("switch");
  c.top_k = 1;
  c.aux_loss_weight = 0.5f;
  c.z_loss_weight = 0.1f;
  check_layer_gradients(c);
}

TEST(MoeGrad, XmoeCosineRouterProjectionEmbeddingsTemperature) {
  MoeConfig c = small_config("xmoe");
  c.router_dim = 4;
  c.router_temperature = 0.5f;
  c.aux_loss_weight = 0.3f;
  c.seq_aux_loss_weight = 0.2f;
  c.z_loss_weight = 0.02f;
  auto names = check_layer_gradients(c);
  EXPECT_EQ(names[0], "layers.0.moe.router.weight");
  EXPECT_EQ(names[1], "layers.0.moe.router.expert_embeddings");
  EXPECT_EQ(names[2], "layers.0.moe.router.temperature");
}

TEST(MoeGrad, PaddedWithDroppedTokens) {
  MoeConfig c = small_config("softmax_topk");
  c.impl = "padded";
  c.capacity_factor = 0.75f;  // C = 3 of 4 average rows: something drops
  c.aux_loss_weight = 0.1f;
  c.num_shared_experts = 0;
  check_layer_gradients(c);
}

MoeConfig impl_config(const char* impl) {
  MoeConfig c = small_config("softmax_topk");
  c.impl = impl;
  c.capacity_factor = 2.f;
  return c;
}

/// One forward + backward of a fresh layer that `configure` has set up.
struct Pass {
  int64_t saved = 0;          ///< bytes forward kept for backward
  int64_t forward_peak = 0;   ///< peak bytes above the start of forward
  int64_t backward_peak = 0;  ///< peak bytes above the start of backward
  int64_t routed_rows = 0;    ///< (token, slot) pairs the experts processed
  std::vector<float> y;
  std::vector<std::vector<float>> grads;  ///< dx, then every parameter's gradient
};
Pass run_pass(const MoeConfig& c, const std::function<void(MoELayer&)>& configure,
              int64_t tokens = kT) {
  const Tensor x = randn({tokens, kD}, 3), r = randn({tokens, kD}, 4);
  MoELayer layer(c, kD, "m", 5, 0.5f);
  configure(layer);
  Pass pass;
  const int64_t before = memory_stats().live_bytes;
  Tensor y;
  {
    PeakMemoryScope scope;
    y = layer.forward(x, kSeq);
    pass.forward_peak = scope.extra_peak_bytes();
  }
  pass.saved = memory_stats().live_bytes - before;
  pass.y = y.to_vector<float>();
  for (int64_t n : layer.tokens_per_expert()) pass.routed_rows += n;
  {
    PeakMemoryScope scope;
    Tensor dx = layer.backward(r);
    pass.backward_peak = scope.extra_peak_bytes();
    pass.grads.push_back(dx.to_vector<float>());
  }
  for (Parameter* p : layer.parameters()) pass.grads.push_back(p->grad.to_vector<float>());
  return pass;
}

// Recompute (h) changes the bits of nothing, and keeps less: forward saves at least h [N, 2f]
// fewer bytes.
TEST(MoeGrad, RecomputeGivesTheSameGradients) {
  for (const char* impl : {"pft", "padded"}) {
    const MoeConfig c = impl_config(impl);
    const Pass kept = run_pass(c, [](MoELayer& l) { l.set_recompute(false); });
    const Pass recomputed = run_pass(c, [](MoELayer& l) { l.set_recompute(true); });
    EXPECT_EQ(kept.grads, recomputed.grads) << impl;
    const int64_t floats = kT * c.top_k * 2 * c.expert_hidden;
    if (std::string(impl) == "pft")
      EXPECT_GE(kept.saved - recomputed.saved, floats * 4)
          << "saved " << kept.saved << " vs " << recomputed.saved;
    else
      EXPECT_LT(recomputed.saved, kept.saved) << impl;
  }
}

// Router recompute (model.recompute "router") for every gate: the same output and gradients,
// bit for bit, with exactly the gate's [T, E] routing tensors (gate_saved_bytes_for) not kept.
TEST(MoeGrad, RouterRecomputeGivesTheSameGradients) {
  struct Case {
    const char* gate;
    bool softmax_before_topk;
  };
  for (const Case cs : {Case{"softmax_topk", true}, Case{"softmax_topk", false},
                        Case{"switch", true}, Case{"sigmoid", true}, Case{"xmoe", true}}) {
    MoeConfig c = small_config(cs.gate);
    SCOPED_TRACE(std::string(cs.gate) + (cs.softmax_before_topk ? "" : " mixtral"));
    c.softmax_before_topk = cs.softmax_before_topk;
    if (c.gate == "switch") c.top_k = 1;
    if (c.gate == "sigmoid") c.num_groups = c.topk_groups = 2;
    c.router_dim = 4;
    c.aux_loss_weight = 0.3f;  // every aux loss reads the dropped tensors in backward
    c.seq_aux_loss_weight = 0.2f;
    c.z_loss_weight = 0.02f;
    const Pass kept = run_pass(c, [](MoELayer& l) { l.set_router_recompute(false); });
    const Pass recomputed = run_pass(c, [](MoELayer& l) { l.set_router_recompute(true); });
    EXPECT_EQ(kept.y, recomputed.y);
    EXPECT_EQ(kept.grads, recomputed.grads);
    EXPECT_EQ(kept.saved - recomputed.saved,
              gate_saved_bytes_for(c, kT) - gate_saved_bytes_for(c, kT, true));
    EXPECT_GE(kept.saved - recomputed.saved, 2 * kT * c.num_experts * 4);
  }
}

// The experts keep no copy of their input rows [N, d]: backward gathers them again from x by
// the PFT indices, with the same bits. A hook that replaces the rows makes the experts keep them.
TEST(MoeGrad, ExpertRowsAreGatheredAgainNotKept) {
  for (const char* impl : {"pft", "padded"}) {
    const MoeConfig c = impl_config(impl);
    const Pass gathered = run_pass(c, [](MoELayer&) {});
    const Pass kept = run_pass(c, [](MoELayer& l) {
      l.hooks().on<DispatchOut>([](DispatchOut& d) { d.expert_in = d.expert_in.clone(); });
    });
    EXPECT_EQ(gathered.grads, kept.grads) << impl;
    EXPECT_EQ(gathered.y, kept.y) << impl;
    EXPECT_GE(kept.saved - gathered.saved, gathered.routed_rows * kD * 4)
        << impl << ": " << kept.saved << " vs " << gathered.saved;
    EXPECT_LE(gathered.forward_peak, kept.forward_peak) << impl;  // the rows go once h is made
    // moe.keep_expert_rows keeps them with no hook: the same bits, exactly the rows more kept
    // (the hook's clone aside, the same bytes as the hook's run).
    MoeConfig keep = c;
    keep.keep_expert_rows = true;
    const Pass kept_by_config = run_pass(keep, [](MoELayer&) {});
    EXPECT_EQ(kept_by_config.grads, gathered.grads) << impl;
    EXPECT_EQ(kept_by_config.y, gathered.y) << impl;
    EXPECT_EQ(
        kept_by_config.saved - gathered.saved,
        (std::string(impl) == "pft"
             ? gathered.routed_rows
             : c.num_experts * padded_capacity(c.capacity_factor, kT, c.top_k, c.num_experts)) *
            kD * 4)
        << impl;
  }
}

/// Registers on every boundary Bs a hook that reads each of its tensors (host copies, which the
/// allocator does not count) and replaces nothing; counts the calls.
template <class... Bs>
void observe(Hooks& hooks, int& calls, double& sum) {
  (hooks.on<Bs>([&calls, &sum](Bs& b) {
    ++calls;
    for (const TensorField& f : b.tensors()) {
      if (!f.tensor->defined()) continue;
      if (f.tensor->dtype() == DType::f32)
        for (float v : f.tensor->to_vector<float>()) sum += v;
      else
        sum += static_cast<double>(f.tensor->numel());
    }
  }),
   ...);
}

// An observing hook changes nothing, memory included: the same bits, the same bytes kept for
// backward and the same peaks, with a hook reading every tensor of every boundary.
TEST(MoeGrad, ObservingHooksChangeNothing) {
  struct Case {
    const char* impl;
    const char* dispatch;
    bool recompute;
  };
  for (const Case& cs : {Case{"pft", "local", false}, Case{"pft", "local", true},
                         Case{"pft", "all_to_all", false}, Case{"padded", "local", false}}) {
    SCOPED_TRACE(std::string(cs.impl) + " " + cs.dispatch + (cs.recompute ? " recompute" : ""));
    MoeConfig c = impl_config(cs.impl);
    c.dispatch = cs.dispatch;
    c.aux_loss_weight = 0.01f;
    const Pass plain = run_pass(c, [&](MoELayer& l) { l.set_recompute(cs.recompute); });
    int calls = 0;
    double sum = 0;
    const Pass observed = run_pass(c, [&](MoELayer& l) {
      l.set_recompute(cs.recompute);
      observe<LayerIn, GateOut, OrderOut, DispatchOut, ExpertOut, CombineOut, IOrderOut, SharedOut,
              LayerOutGrad, SharedGrad, IOrderGrad, CombineGrad, ExpertGrad, DispatchGrad,
              OrderGrad, GateGrad>(l.hooks(), calls, sum);
    });
    EXPECT_EQ(calls, 16);  // every boundary, shared experts included
    EXPECT_TRUE(std::isfinite(sum));
    EXPECT_EQ(observed.y, plain.y);
    EXPECT_EQ(observed.grads, plain.grads);
    EXPECT_EQ(observed.saved, plain.saved);
    EXPECT_EQ(observed.forward_peak, plain.forward_peak);
    EXPECT_EQ(observed.backward_peak, plain.backward_peak);
  }
}

// The experts' SwiGLU activations in row chunks (moe.expert_chunks) change the bits of
// nothing, and take the [N, f] temporaries off both peaks.
TEST(MoeGrad, ExpertChunksGiveTheSameGradientsAndLowerPeaks) {
  for (const char* impl : {"pft", "padded"}) {
    MoeConfig c = impl_config(impl);
    c.expert_hidden = 8 * kD;  // f >> d: a and da [N, f] are the largest temporaries
    c.num_shared_experts = 0;
    c.expert_chunks = 1;
    const Pass whole = run_pass(c, [](MoELayer&) {});
    c.expert_chunks = 3;
    const Pass chunked = run_pass(c, [](MoELayer&) {});
    EXPECT_EQ(whole.grads, chunked.grads) << impl;
    EXPECT_EQ(whole.y, chunked.y) << impl;
    EXPECT_EQ(whole.saved, chunked.saved) << impl;
    // At least a third of [N, f] f32 less: no chunk holds more than two thirds of the rows
    // unless one expert does, which six experts over 24 routed rows make unlikely.
    const int64_t third = whole.routed_rows * c.expert_hidden * 4 / 3;
    EXPECT_GE(whole.forward_peak - chunked.forward_peak, third)
        << impl << ": " << whole.forward_peak << " vs " << chunked.forward_peak;
    EXPECT_GE(whole.backward_peak - chunked.backward_peak, third)
        << impl << ": " << whole.backward_peak << " vs " << chunked.backward_peak;
  }
}

// Auto (moe.expert_chunks = 0) chunks where f > d and each of 4 chunks keeps 2048 rows, and
// nowhere else.
TEST(MoeGrad, ExpertChunksAutoOnlyWhereFExceedsD) {
  constexpr int64_t kManyTokens = 683 * kSeq;  // 8196 routed rows (k = 2): 4 chunks of ~2049
  auto peaks = [](MoeConfig c, int chunks) {
    c.expert_chunks = chunks;
    const Pass p = run_pass(
        c, [](MoELayer&) {}, kManyTokens);
    return std::pair{p.forward_peak, p.backward_peak};
  };
  MoeConfig wide = impl_config("pft");
  wide.num_shared_experts = 0;
  wide.expert_hidden = 2 * kD;
  EXPECT_LT(peaks(wide, 0).first, peaks(wide, 1).first);
  EXPECT_EQ(peaks(wide, 0), peaks(wide, 4));
  MoeConfig narrow = wide;
  narrow.expert_hidden = kD / 2;
  EXPECT_EQ(peaks(narrow, 0), peaks(narrow, 1));
}

// The expert weights zero their gradients lazily (Parameter::lazy_zero_grad): after zero_grad()
// the first backward overwrites whatever the memory held, the next one accumulates, and
// settle_grads() makes a zero real where no backward came.
TEST(MoeGrad, LazyZeroGradOverwritesThenAccumulates) {
  MoeConfig c = small_config("softmax_topk");  // one shared expert: both expert kinds
  Tensor x = randn({kT, kD}, 3), r = randn({kT, kD}, 4);
  MoELayer layer(c, kD, "m", 5, 0.5f);
  const std::vector<Parameter*> params = layer.parameters();
  auto pass = [&] {
    layer.forward(x, kSeq);
    layer.backward(r);
  };
  pass();  // into the zeros of Parameter::make
  std::vector<std::vector<float>> once;
  int lazy = 0;
  for (Parameter* p : params) {
    once.push_back(p->grad.to_vector<float>());
    lazy += p->lazy_zero_grad;
  }
  EXPECT_EQ(lazy, 4) << "routed gate_up/down and shared gate_up/down";

  for (Parameter* p : params) p->grad.fill_(123.f);  // stale memory a deferred zero must hide
  layer.zero_grad();
  pass();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_EQ(params[i]->grad.to_vector<float>(), once[i]) << params[i]->name;
  pass();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::vector<float> twice = params[i]->grad.to_vector<float>();
    for (size_t j = 0; j < twice.size(); ++j)
      ASSERT_NEAR(twice[j], 2.f * once[i][j], 1e-5f * (1.f + std::fabs(once[i][j])))
          << params[i]->name << "[" << j << "]";
  }

  for (Parameter* p : params) p->grad.fill_(123.f);
  layer.zero_grad();
  settle_grads(params);
  for (Parameter* p : params) {
    for (float v : p->grad.to_vector<float>()) ASSERT_EQ(v, 0.f) << p->name;
    EXPECT_FALSE(p->take_grad_overwrite()) << p->name << ": settled, so backward accumulates";
  }
}
