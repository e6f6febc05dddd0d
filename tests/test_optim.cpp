// AdamW against hand-computed steps, its checkpoint state, the LR schedule, gradient clipping
// and the non-finite check.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "testing.h"
#include "xmoe/ops/ops.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/optim/clip.h"
#include "xmoe/optim/schedule.h"

using namespace xmoe;
using optim::AdamW;
using optim::AdamWConfig;

namespace {
Parameter param(const std::string& name, std::vector<float> v, bool decay = true) {
  Parameter p = Parameter::make(name, {static_cast<int64_t>(v.size())}, ParamKind::dense, decay);
  p.value.copy_from(Tensor::from_vector<float>(v, {static_cast<int64_t>(v.size())}));
  return p;
}
/// `count` parameters p0, p1, ... of 3, 7, 11, ... elements, element j of p_i sin(freq * (i *
/// stride + j)); all with weight decay but p_{no_decay}.
std::vector<Parameter> sine_params(int count, float freq, int stride, int no_decay) {
  std::vector<Parameter> ps;
  for (int i = 0; i < count; ++i) {
    std::vector<float> v(static_cast<size_t>(3 + 4 * i));
    for (size_t j = 0; j < v.size(); ++j)
      v[j] = std::sin(freq * static_cast<float>(static_cast<size_t>(i * stride) + j));
    ps.push_back(param(fmt::format("p{}", i), v, i != no_decay));
  }
  return ps;
}
void set_grad(Parameter& p, std::vector<float> g) {
  p.grad.copy_from(Tensor::from_vector<float>(g, p.grad.shape()));
}
}  // namespace

TEST(AdamW, OneStepMatchesHandComputedValues) {
  Parameter w = param("w", {1.0f, -2.0f});
  Parameter n = param("n", {1.0f}, /*decay=*/false);
  AdamW opt({&w, &n}, {0.9f, 0.999f, 1e-8f, 0.1f});
  set_grad(w, {0.5f, 0.1f});
  set_grad(n, {-0.3f});
  opt.step(0.01f);
  EXPECT_EQ(opt.step_count(), 1);
  // Step 1: m_hat = g, v_hat = g^2, so the Adam update is lr * g / (|g| + eps) = ±lr.
  //   w0: 1.0 * (1 - 0.01 * 0.1) - 0.01 = 0.989;  w1: -2.0 * 0.999 - 0.01 = -2.008
  //   n (no decay): 1.0 + 0.01 = 1.01
  EXPECT_NEAR(w.value.data<float>()[0], 0.989f, 1e-6);
  EXPECT_NEAR(w.value.data<float>()[1], -2.008f, 1e-6);
  EXPECT_NEAR(n.value.data<float>()[0], 1.01f, 1e-6);
  EXPECT_NEAR(opt.m(0).data<float>()[0], 0.05f, 1e-7);  // (1 - 0.9) * 0.5
  // 1 - 0.999f is 0.99998713e-3 in f32: moments carry a relative error of ~1e-5.
  EXPECT_NEAR(opt.v(0).data<float>()[0], 0.00025f, 1e-8);  // (1 - 0.999) * 0.25

  // Step 2 on w0 with g = -0.25, worked by hand:
  //   m = 0.9 * 0.05 + 0.1 * (-0.25) = 0.02            m_hat = 0.02 / 0.19 = 0.1052632
  //   v = 0.999 * 0.00025 + 0.001 * 0.0625 = 0.00031225  v_hat = v / 0.001999 = 0.1562031
  //   w0 = 0.989 * 0.999 - 0.01 * 0.1052632 / 0.3952254 = 0.9853477
  set_grad(w, {-0.25f, 0.1f});
  set_grad(n, {0.0f});
  opt.step(0.01f);
  EXPECT_NEAR(w.value.data<float>()[0], 0.9853477f, 2e-6);
  EXPECT_NEAR(opt.m(0).data<float>()[0], 0.02f, 1e-7);
  EXPECT_NEAR(opt.v(0).data<float>()[0], 0.00031225f, 1e-8);
  // The optimizer does not clear the grads.
  EXPECT_EQ(w.grad.data<float>()[0], -0.25f);
  opt.zero_grad();
  EXPECT_EQ(ops::sum_squares(w.grad), 0.0);
}

// step(lr, s) on the grads g gives the bits of scale_grads(s) then step(lr), and leaves g.
TEST(AdamW, GradScaleIsTheClipFactorWithoutAPass) {
  Parameter a = param("a", {1.0f, -2.0f, 0.5f}), b = param("b", {1.0f, -2.0f, 0.5f});
  AdamW oa({&a}, {0.9f, 0.95f, 1e-8f, 0.1f}), ob({&b}, {0.9f, 0.95f, 1e-8f, 0.1f});
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> g = {0.3f + static_cast<float>(step), -1.7f, 2.9f};
    set_grad(a, g);
    set_grad(b, g);
    const float s = optim::clip_factor(7.3, 1.0f);
    optim::scale_grads({&a}, s);
    oa.step(0.01f);
    ob.step(0.01f, s);
    EXPECT_EQ(b.grad.data<float>()[0], g[0]);
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(a.value.data<float>()[j], b.value.data<float>()[j]) << step << " " << j;
      EXPECT_EQ(oa.v(0).data<float>()[j], ob.v(0).data<float>()[j]) << step << " " << j;
    }
  }
}

TEST(AdamW, StateRoundTripResumesExactly) {
  Parameter a1 = param("layers.0.w", {0.3f, -0.7f, 1.1f}), b1 = param("n", {1.f}, false);
  Parameter a2 = param("layers.0.w", {0.3f, -0.7f, 1.1f}), b2 = param("n", {1.f}, false);
  AdamW o1({&a1, &b1}, {}), o2({&a2, &b2}, {});
  auto grads = [](int s, Parameter& a, Parameter& b) {
    set_grad(a, {0.1f * s, -0.2f, 0.05f * s * s});
    set_grad(b, {0.01f * s});
  };
  for (int s = 1; s <= 3; ++s) {
    grads(s, a1, b1);
    o1.step(1e-2f);
  }
  std::map<std::string, Tensor> state;
  o1.export_state(state);
  EXPECT_EQ(state.size(), 5u);
  ASSERT_TRUE(state.count("layers.0.w.adam_m") && state.count("layers.0.w.adam_v") &&
              state.count("n.adam_m") && state.count(AdamW::kStepKey));
  EXPECT_EQ(state.at(AdamW::kStepKey).dtype(), DType::i64);
  // A resumed optimizer (weights copied, state loaded) takes the same next step, bit for bit.
  a2.value.copy_from(a1.value);
  b2.value.copy_from(b1.value);
  std::map<std::string, Tensor> copy;
  for (auto& [k, t] : state) copy[k] = t.clone();
  o2.import_state(copy);
  EXPECT_EQ(o2.step_count(), 3);
  grads(4, a1, b1);
  grads(4, a2, b2);
  o1.step(1e-2f);
  o2.step(1e-2f);
  EXPECT_EQ(a1.value.to_vector<float>(), a2.value.to_vector<float>());
  EXPECT_EQ(b1.value.to_vector<float>(), b2.value.to_vector<float>());
}

TEST(AdamW, BadStateAndConfigThrow) {
  Parameter a = param("w", {1.f, 2.f});
  AdamW opt({&a}, {});
  std::map<std::string, Tensor> state;
  opt.export_state(state);
  auto missing = state;
  missing.erase("w.adam_v");
  EXPECT_THROW(opt.import_state(missing), Error);
  auto wrong = state;
  wrong["w.adam_m"] = Tensor::zeros({3});
  EXPECT_THROW(opt.import_state(wrong), Error);
  Parameter dup = param("w", {1.f});
  EXPECT_THROW(AdamW({&a, &dup}, {}), Error);
  EXPECT_THROW(AdamW({&a}, {1.0f, 0.95f, 1e-8f, 0.1f}), Error);  // beta1 = 1
}

// AdamWConfig::offload on the CPU: the gradients are staged into host buffers group by group
// (groups of 5 elements here: several groups, pieces that straddle none or several) and updated
// by the same kernel; whole parameters, parts of parameters, pieces with their own gradients
// (f32 and bf16) end with the same bits as the plain update, moments (f32 or bf16) included.
void expect_offloaded_equals_plain(DType moments_dtype) {
  SCOPED_TRACE(dtype_name(moments_dtype));
  auto make = [] { return sine_params(4, 0.7f, 31, 2); };
  std::vector<Parameter> a = make(), b = make(), c = make();
  // bf16 compute copies on p0, p1, p3 (the offloaded update sends them back through two slots of
  // the largest group's copies, 3 + 5: three groups, so the first slot is used again).
  for (std::vector<Parameter>* ps : {&a, &b, &c})
    for (int i : {0, 1, 3}) {
      Parameter& p = (*ps)[static_cast<size_t>(i)];
      p.compute_copy = Tensor::zeros(p.value.shape(), DType::bf16);
    }
  // p3's own gradients: a bf16 [7] shard of its 15 elements, as parallel.zero = 2 hands over.
  const Tensor shard_a = Tensor::zeros({7}, DType::bf16), shard_b = Tensor::zeros({7}, DType::bf16),
               shard_c = Tensor::zeros({7}, DType::bf16);
  auto pieces = [](std::vector<Parameter>& ps, const Tensor& shard) {
    return std::vector<optim::AdamWPiece>{
        optim::AdamWPiece(&ps[0]), optim::AdamWPiece(&ps[1], 2, 5), optim::AdamWPiece(&ps[2]),
        optim::AdamWPiece(&ps[3], 8, 7, shard)};
  };
  AdamWConfig plain_cfg{0.9f, 0.95f, 1e-8f, 0.1f};
  plain_cfg.moments_dtype = moments_dtype;
  AdamWConfig off_cfg = plain_cfg;
  off_cfg.offload = true;
  off_cfg.offload_group_numel = 5;
  // c: the gradients travel through rings too (no whole buffers: prefetching does nothing).
  AdamWConfig ring_cfg = off_cfg;
  ring_cfg.offload_whole_grads = false;
  AdamW plain(pieces(a, shard_a), plain_cfg), off(pieces(b, shard_b), off_cfg),
      ring(pieces(c, shard_c), ring_cfg);
  EXPECT_TRUE(off.offloaded());
  // m and v of each piece's 3 + 5 + 11 + 7 elements
  EXPECT_EQ(off.state_bytes(), 2 * 26 * static_cast<int64_t>(dtype_size(moments_dtype)));
  EXPECT_EQ(plain.state_bytes(), off.state_bytes());
  EXPECT_EQ(plain.staging_bytes(), 0);
  EXPECT_EQ(off.staging_bytes(), (3 + 5 + 11) * 4 + 7 * 2 + optim::AdamW::kOffloadSlots * 8 * 2);
  // Rings: f32 gradients of the largest group's 11 (p2), bf16 ones of 7 (p3's shard).
  EXPECT_EQ(ring.staging_bytes(), optim::AdamW::kOffloadSlots * (11 * 4 + 7 * 2 + 8 * 2));
  for (int step = 1; step <= 5; ++step) {
    for (size_t i = 0; i < a.size(); ++i) {
      std::vector<float> g(static_cast<size_t>(a[i].grad.numel()));
      for (size_t j = 0; j < g.size(); ++j)
        g[j] = std::cos(static_cast<float>(step * 7 + i * 3 + j));
      set_grad(a[i], g);
      set_grad(b[i], g);
      set_grad(c[i], g);
    }
    std::vector<float> sg(7);
    for (size_t j = 0; j < sg.size(); ++j) sg[j] = 0.25f * static_cast<float>(j) - step;
    const Tensor s = Tensor::from_vector<float>(sg, {7}).to(DType::bf16);
    Tensor(shard_a).copy_from(s);
    Tensor(shard_b).copy_from(s);
    Tensor(shard_c).copy_from(s);
    // Gradients handed over early (train.offload_overlap) give the same bits; p3's own shard
    // is left to step(). A prefetch that is forgotten (a skipped step) is not used.
    if (step % 2 == 1) {
      off.prefetch_grads({&b[0], &b[2], &b[3]});
      ring.prefetch_grads({&c[0], &c[2], &c[3]});
    }
    if (step == 4) {
      off.prefetch_grads({&b[1]});
      off.forget_prefetched();
      for (Parameter* p : {&a[1], &b[1], &c[1]}) set_grad(*p, std::vector<float>(7, 0.125f));
    }
    plain.step(1e-2f, 0.5f);
    off.step(1e-2f, 0.5f);
    ring.step(1e-2f, 0.5f);
  }
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].value.to_vector<float>(), b[i].value.to_vector<float>()) << a[i].name;
    EXPECT_EQ(a[i].value.to_vector<float>(), c[i].value.to_vector<float>()) << a[i].name;
    EXPECT_EQ(off.m(i).dtype(), moments_dtype);
    // The moments as f32 (bf16 ones widened, exactly).
    auto f32 = [](const Tensor& t) { return t.to(DType::f32).to_vector<float>(); };
    for (const AdamW* o : {&off, &ring}) {
      EXPECT_EQ(f32(plain.m(i)), f32(o->m(i))) << a[i].name;
      EXPECT_EQ(f32(plain.v(i)), f32(o->v(i))) << a[i].name;
    }
    if (i == 2) continue;
    EXPECT_EQ(a[i].compute_copy.to(DType::f32).to_vector<float>(),
              b[i].compute_copy.to(DType::f32).to_vector<float>())
        << a[i].name;
    EXPECT_EQ(a[i].compute_copy.to(DType::f32).to_vector<float>(),
              c[i].compute_copy.to(DType::f32).to_vector<float>())
        << a[i].name;
  }
  // p1's copy: only its piece [2, 7) was updated (the rest stays as it was, zero).
  EXPECT_EQ(b[1].compute_copy.to(DType::f32).to_vector<float>()[0], 0.0f);
  EXPECT_NE(b[1].compute_copy.to(DType::f32).to_vector<float>()[2], 0.0f);
  EXPECT_NE(a[0].value.to_vector<float>(), make()[0].value.to_vector<float>());  // it did move
}

TEST(AdamW, OffloadedUpdateEqualsThePlainOneBitForBit) {
  expect_offloaded_equals_plain(DType::f32);
  expect_offloaded_equals_plain(DType::bf16);
}

// train.offload_delayed_update_from: the update of step k's gradients becomes visible after
// step k + 1's forward and backward. With gradients computed from the visible weights (bf16
// compute copies, f32 copies; g = w - target + noise), the delayed optimizer equals the plain
// offloaded one to which each step's gradients are handed one step later, bit for bit: the
// weights forward reads at every step, then the master weights, moments and copies.
void expect_delayed_equals_lagged_plain(DType moments_dtype) {
  SCOPED_TRACE(dtype_name(moments_dtype));
  constexpr int kPlainSteps = 2, kSteps = 10;
  auto make = [] {
    std::vector<Parameter> ps = sine_params(3, 0.3f, 17, 1);
    // p0: a bf16 compute copy; p1: none (forward reads f32); p2: both (reads_f32).
    for (int i : {0, 2}) {
      Parameter& p = ps[static_cast<size_t>(i)];
      p.compute_copy = p.value.to(DType::bf16);
    }
    ps[2].reads_f32 = true;
    return ps;
  };
  std::vector<Parameter> ref = make(), del = make();
  auto pieces = [](std::vector<Parameter>& ps) {
    std::vector<optim::AdamWPiece> out;
    for (Parameter& p : ps) out.emplace_back(&p);
    return out;
  };
  AdamWConfig cfg{0.9f, 0.95f, 1e-8f, 0.1f};
  cfg.moments_dtype = moments_dtype;
  cfg.offload = true;
  cfg.offload_group_numel = 5;  // three groups
  AdamWConfig del_cfg = cfg;
  del_cfg.delayed_from = kPlainSteps;
  AdamW plain(pieces(ref), cfg), delayed(pieces(del), del_cfg);
  // On the CPU the delayed optimizer gives the f32 readers (p1, p2) copies of their own; every
  // copy forward reads has a twin.
  EXPECT_FALSE(del[0].device_f32.defined());
  ASSERT_TRUE(del[1].device_f32.defined() && del[2].device_f32.defined());
  EXPECT_FALSE(ref[1].device_f32.defined());
  EXPECT_EQ(delayed.delayed_update_bytes(), (7 + 11) * 4 * 2 + (3 + 11) * 2);
  EXPECT_EQ(plain.delayed_update_bytes(), 0);
  // The gradients of step k from the weights forward reads: the f32 weights only of a parameter
  // forward reads in f32 (p0's are the master itself, which the running update writes).
  auto grads = [](const std::vector<Parameter>& ps, int step) {
    std::vector<std::vector<float>> out;
    for (size_t i = 0; i < ps.size(); ++i) {
      const Parameter& p = ps[i];
      const std::vector<float> w = p.compute().to(DType::f32).to_vector<float>();
      const bool reads_f32 = p.reads_f32 || !p.compute_copy.defined();
      const std::vector<float> w32 =
          reads_f32 ? p.weights_f32().to_vector<float>() : std::vector<float>(w.size(), 0.0f);
      std::vector<float> g(w.size());
      for (size_t j = 0; j < g.size(); ++j)
        g[j] = w[j] + 0.5f * w32[j] - 0.25f * static_cast<float>(i) +
               0.1f * std::sin(static_cast<float>(step * 13 + i * 5 + j));
      out.push_back(g);
    }
    return out;
  };
  auto lr = [](int step) { return 2e-2f * (1.0f + 0.1f * static_cast<float>(step)); };
  auto scale = [](int step) { return 1.0f / (1.0f + 0.05f * static_cast<float>(step)); };
  auto apply = [&](const std::vector<std::vector<float>>& g, int step) {
    for (size_t i = 0; i < ref.size(); ++i) set_grad(ref[i], g[i]);
    plain.step(lr(step), scale(step));
  };
  std::vector<std::vector<float>> lagged;  // the reference's gradients waiting a step
  for (int step = 1; step <= kSteps; ++step) {
    const auto g_ref = grads(ref, step), g_del = grads(del, step);
    ASSERT_EQ(g_ref, g_del) << "step " << step << ": the weights forward reads differ";
    if (step <= kPlainSteps) {
      apply(g_ref, step);
    } else {
      if (!lagged.empty()) apply(lagged, step - 1);
      lagged = g_ref;
    }
    for (size_t i = 0; i < del.size(); ++i) set_grad(del[i], g_del[i]);
    // Gradients handed over during backward wait for the running update first.
    if (step % 2 == 1) delayed.prefetch_grads({&del[0], &del[2]});
    delayed.step(lr(step), scale(step));
    EXPECT_EQ(delayed.update_pending(), step > kPlainSteps);
    EXPECT_EQ(delayed.step_count(), step);
  }
  std::map<std::string, Tensor> state;
  EXPECT_THROW(delayed.export_state(state), Error);  // pending: finish() first
  apply(lagged, kSteps);
  delayed.finish();
  EXPECT_FALSE(delayed.update_pending());
  delayed.finish();  // a no-op now
  auto f32 = [](const Tensor& t) { return t.to(DType::f32).to_vector<float>(); };
  for (size_t i = 0; i < ref.size(); ++i) {
    SCOPED_TRACE(ref[i].name);
    EXPECT_EQ(f32(ref[i].value), f32(del[i].value));
    EXPECT_EQ(f32(plain.m(i)), f32(delayed.m(i)));
    EXPECT_EQ(f32(plain.v(i)), f32(delayed.v(i)));
    EXPECT_EQ(f32(ref[i].compute()), f32(del[i].compute()));
    EXPECT_EQ(f32(ref[i].value), f32(del[i].weights_f32()));  // the published f32 copy
  }
  EXPECT_NE(f32(del[0].value), f32(make()[0].value));  // it did move
  delayed.export_state(state);
  EXPECT_EQ(state.at(AdamW::kStepKey).to_vector<int64_t>()[0], kSteps);
}

TEST(AdamW, DelayedUpdateEqualsThePlainOneAppliedAStepLater) {
  expect_delayed_equals_lagged_plain(DType::f32);
  expect_delayed_equals_lagged_plain(DType::bf16);
}

// The delayed update needs whole host gradient buffers and whole parameters; an optimizer
// destroyed with an update pending waits for it.
TEST(AdamW, DelayedUpdateRefusesRingsAndShards) {
  Parameter p = param("w", {1, 2, 3, 4});
  AdamWConfig cfg;
  cfg.offload = true;
  cfg.delayed_from = 0;
  cfg.offload_whole_grads = false;
  EXPECT_CONTAINS(xmoe::testing::error_of([&] { AdamW bad({&p}, cfg); }),
                  "needs offload with whole host gradient buffers");
  cfg.offload_whole_grads = true;
  const optim::AdamWPiece part(&p, 1, 2);
  EXPECT_CONTAINS(xmoe::testing::error_of([&] { AdamW bad(std::span(&part, 1), cfg); }),
                  "cannot be delayed");
  {
    AdamW opt({&p}, cfg);
    set_grad(p, {1, 1, 1, 1});
    opt.step(0.1f);
    EXPECT_TRUE(opt.update_pending());
    EXPECT_EQ(p.weights_f32().to_vector<float>(), std::vector<float>({1, 2, 3, 4}));
  }
  EXPECT_NE(p.value.to_vector<float>(), std::vector<float>({1, 2, 3, 4}));
}

// train.adam_moments_dtype = bf16: the moments take half the bytes; export gives them as f32
// (exactly widened), so a bf16-moment checkpoint loads into an f32-moment optimizer and back
// (rounded to nearest even on load), and a bf16 optimizer resumed from its own state takes the
// next step bit for bit.
TEST(AdamW, Bf16MomentsExportAsF32AndLoadEitherWay) {
  auto make = [] {
    return std::vector<Parameter>{param("layers.0.w", {0.3f, -0.7f, 1.1f, 0.05f}),
                                  param("n", {1.f, 0.5f}, false)};
  };
  auto grads = [](int s, std::vector<Parameter>& ps) {
    set_grad(ps[0], {0.1f * s, -0.2f, 0.05f * s * s, 0.37f / s});
    set_grad(ps[1], {0.01f * s, -0.3f});
  };
  AdamWConfig cfg16, cfg32;
  cfg16.moments_dtype = DType::bf16;
  std::vector<Parameter> a = make(), b = make(), c = make();
  AdamW o16({&a[0], &a[1]}, cfg16), r16({&b[0], &b[1]}, cfg16), r32({&c[0], &c[1]}, cfg32);
  EXPECT_EQ(o16.m(0).dtype(), DType::bf16);
  EXPECT_EQ(o16.state_bytes(), 2 * 6 * 2);
  EXPECT_EQ(r32.state_bytes(), 2 * 6 * 4);
  for (int s = 1; s <= 3; ++s) {
    grads(s, a);
    o16.step(1e-2f);
  }
  std::map<std::string, Tensor> state;
  o16.export_state(state);
  const Tensor& m = state.at("layers.0.w.adam_m");
  ASSERT_EQ(m.dtype(), DType::f32);
  EXPECT_EQ(m.shape(), Shape{4});
  EXPECT_EQ(m.to_vector<float>(), o16.m(0).to(DType::f32).to_vector<float>());
  EXPECT_NE(m.to_vector<float>(), std::vector<float>(4, 0.0f));
  for (std::vector<Parameter>* ps : {&b, &c})
    for (size_t i = 0; i < 2; ++i) (*ps)[i].value.copy_from(a[i].value);
  r16.import_state(state);
  r32.import_state(state);
  // The f32 optimizer holds the widened bf16 moments; the bf16 one the same bits as the source.
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(r32.m(i).to_vector<float>(), o16.m(i).to(DType::f32).to_vector<float>());
    EXPECT_EQ(r32.v(i).to_vector<float>(), o16.v(i).to(DType::f32).to_vector<float>());
    EXPECT_EQ(r16.v(i).to(DType::f32).to_vector<float>(),
              o16.v(i).to(DType::f32).to_vector<float>());
  }
  grads(4, a);
  grads(4, b);
  o16.step(1e-2f);
  r16.step(1e-2f);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(a[i].value.to_vector<float>(), b[i].value.to_vector<float>());
    EXPECT_EQ(o16.m(i).to(DType::f32).to_vector<float>(),
              r16.m(i).to(DType::f32).to_vector<float>());
  }
  // f32 state into bf16 moments: rounded to nearest even.
  std::map<std::string, Tensor> f32_state;
  r32.step(1e-2f);
  r32.export_state(f32_state);
  r16.import_state(f32_state);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(r16.m(i).to(DType::f32).to_vector<float>(),
              r32.m(i).to(DType::bf16).to(DType::f32).to_vector<float>());
    EXPECT_EQ(r16.v(i).to(DType::f32).to_vector<float>(),
              r32.v(i).to(DType::bf16).to(DType::f32).to_vector<float>());
  }
  EXPECT_NE(r32.m(0).to_vector<float>(), r16.m(0).to(DType::f32).to_vector<float>());
}

TEST(AdamW, MomentsDtypeFromTheConfig) {
  TrainConfig t;
  EXPECT_EQ(AdamWConfig::from(t).moments_dtype, DType::f32);
  t.adam_moments_dtype = "bf16";
  EXPECT_EQ(AdamWConfig::from(t).moments_dtype, DType::bf16);
  t.adam_moments_dtype = "f16";
  try {
    AdamWConfig::from(t);
    FAIL() << "f16 moments accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.adam_moments_dtype"), std::string::npos);
  }
  Parameter a = param("w", {1.f});
  AdamWConfig bad;
  bad.moments_dtype = DType::i32;
  EXPECT_THROW(AdamW({&a}, bad), Error);
}

// The host kernel (vectorised, threaded, the bf16 copy written in the same pass) gives the bits of
// the formula evaluated one element at a time in its order, for f32 and bf16 gradients, f32 and
// bf16 moments (train.adam_moments_dtype: the formula on the widened moments, the weights from
// the unrounded m, v, the moments stored rounded to nearest even) and sizes around the vector
// width and the threading threshold (docs/training.md, "Optimizer offload").
TEST(AdamW, HostKernelEqualsTheScalarFormulaBitForBit) {
  ops::AdamWStep s;
  s.lr = 3e-3f;
  s.weight_decay = 0.1f;
  s.bc1 = 0.271f;
  s.bc2 = 0.0497f;
  s.grad_scale = 0.625f;
  s.beta1 = 0.9f;
  s.beta2 = 0.95f;
  s.eps = 1e-8f;
  const std::vector<int64_t> sizes{1, 7, 8, 9, 16, 17, 33, 32768, 32769, 100003};
  for (DType moment_dtype : {DType::f32, DType::bf16}) {
    // What the moments' storage keeps of an f32 value.
    auto stored = [&](float x) {
      return moment_dtype == DType::bf16 ? static_cast<float>(bf16(x)) : x;
    };
    for (DType grad_dtype : {DType::f32, DType::bf16}) {
      for (int64_t n : sizes) {
        std::vector<float> w0(n), g0(n), m0(n), v0(n);
        for (int64_t i = 0; i < n; ++i) {
          const float x = static_cast<float>(i % 97) - 48.0f;
          w0[i] = 0.01f * x;
          g0[i] = i % 5 == 0 ? 0.0f : 1e-3f * x * (i % 3 == 0 ? 1e3f : 1.0f);
          m0[i] = stored(1e-4f * x);
          v0[i] = stored(1e-6f * static_cast<float>(i % 13) + 3e-9f * static_cast<float>(i % 7));
        }
        const Shape shape{n};
        Tensor w = Tensor::from_vector<float>(w0, shape),
               m = Tensor::from_vector<float>(m0, shape).to(moment_dtype),
               v = Tensor::from_vector<float>(v0, shape).to(moment_dtype),
               copy = Tensor::empty(shape, DType::bf16);
        const Tensor g = Tensor::from_vector<float>(g0, shape).to(grad_dtype);
        const std::vector<ops::AdamWTensors> list{{w, g, m, v, copy, true}};
        ops::adamw_step(list, s);
        EXPECT_EQ(m.dtype(), moment_dtype);
        const std::vector<float> gs = g.to(DType::f32).to_vector<float>();
        const std::vector<float> w1 = w.to_vector<float>(),
                                 m1 = m.to(DType::f32).to_vector<float>(),
                                 v1 = v.to(DType::f32).to_vector<float>(),
                                 c1 = copy.to(DType::f32).to_vector<float>();
        const float decay = 1.0f - s.lr * s.weight_decay;
        int64_t rounded = 0;  // moments bf16 changed: the test sees the rounding
        for (int64_t i = 0; i < n; ++i) {
          const float gj = gs[i] * s.grad_scale;
          const float mj = s.beta1 * m0[i] + (1.f - s.beta1) * gj;
          const float vj = s.beta2 * v0[i] + (1.f - s.beta2) * gj * gj;
          const float wj = w0[i] * decay - s.lr * (mj / s.bc1) / (std::sqrt(vj / s.bc2) + s.eps);
          ASSERT_EQ(m1[i], stored(mj)) << dtype_name(moment_dtype) << " " << n << " " << i;
          ASSERT_EQ(v1[i], stored(vj)) << dtype_name(moment_dtype) << " " << n << " " << i;
          ASSERT_EQ(w1[i], wj) << dtype_name(moment_dtype) << " " << n << " " << i;
          ASSERT_EQ(c1[i], static_cast<float>(bf16(wj))) << n << " " << i;
          rounded += m1[i] != mj;
        }
        if (moment_dtype == DType::bf16 && n > 100) {
          EXPECT_GT(rounded, n / 2);
        }
      }
    }
  }
}

// A list's moments are of one dtype, f32 or bf16, and the error names the operand.
TEST(AdamW, HostKernelRejectsMixedMomentDtypes) {
  ops::AdamWStep s;
  s.lr = 1e-3f;
  Tensor w = Tensor::zeros({4}), g = Tensor::zeros({4});
  Tensor m32 = Tensor::zeros({4}), m16 = Tensor::zeros({4}, DType::bf16);
  const std::vector<ops::AdamWTensors> mixed{{w, g, m16, m32, Tensor(), true}};
  try {
    ops::adamw_step(mixed, s);
    FAIL() << "mixed moments accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[adamw_step] v"), std::string::npos) << e.what();
  }
  const std::vector<ops::AdamWTensors> ints{
      {w, g, Tensor::zeros({4}, DType::i32), Tensor::zeros({4}, DType::i32), Tensor(), true}};
  EXPECT_THROW(ops::adamw_step(ints, s), Error);
}

TEST(Schedule, WarmupThenCosineToMinLr) {
  const optim::LrSchedule s{1.0f, 0.1f, 10, 110};  // steps 0..109
  EXPECT_FLOAT_EQ(s.at(0), 0.1f);                  // warmup start: peak / warmup
  EXPECT_FLOAT_EQ(s.at(4), 0.5f);
  EXPECT_FLOAT_EQ(s.at(9), 1.0f);      // warmup end: peak
  EXPECT_NEAR(s.at(59), 0.55f, 1e-6);  // half-way through the cosine: (peak + min) / 2
  EXPECT_NEAR(s.at(34), 0.1f + 0.9f * 0.5f * (1 + std::cos(M_PI * 0.25)), 1e-6);
  EXPECT_NEAR(s.at(109), 0.1f, 1e-6);                             // last step: min_lr
  EXPECT_NEAR(s.at(500), 0.1f, 1e-6);                             // and after
  for (int i = 9; i < 109; ++i) EXPECT_LT(s.at(i + 1), s.at(i));  // monotone decay
  // No warmup: the cosine starts at once, one step in (n = 1 of 100).
  const optim::LrSchedule nw{2.0f, 0.0f, 0, 100};
  EXPECT_NEAR(nw.at(0), 1.0 + std::cos(M_PI * 0.01), 1e-6);
  EXPECT_NEAR(nw.at(99), 0.0, 1e-6);
  TrainConfig t;
  t.lr = 3e-3f;
  t.min_lr = 3e-4f;
  t.warmup_steps = 50;
  t.steps = 600;
  const auto f = optim::LrSchedule::from(t);
  EXPECT_FLOAT_EQ(f.at(49), 3e-3f);
  EXPECT_NEAR(f.at(599), 3e-4f, 1e-9);
}

TEST(Clip, ScalesToTheMaxNormAndReturnsThePreClipNorm) {
  Parameter a = param("a", {3.f, 0.f}), b = param("b", {4.f});
  std::vector<Parameter*> ps = {&a, &b};
  set_grad(a, {3.f, 0.f});
  set_grad(b, {4.f});
  EXPECT_DOUBLE_EQ(optim::grad_norm(ps), 5.0);
  EXPECT_DOUBLE_EQ(optim::clip_grad_norm(ps, 1.0f), 5.0);
  EXPECT_NEAR(optim::grad_norm(ps), 1.0, 1e-6);
  EXPECT_NEAR(a.grad.data<float>()[0], 0.6f, 1e-7);
  EXPECT_NEAR(b.grad.data<float>()[0], 0.8f, 1e-7);
  // Below the limit, or clipping off: unchanged.
  EXPECT_NEAR(optim::clip_grad_norm(ps, 2.0f), 1.0, 1e-6);
  EXPECT_NEAR(b.grad.data<float>()[0], 0.8f, 1e-7);
  set_grad(b, {40.f});
  EXPECT_NEAR(optim::clip_grad_norm(ps, 0.0f), std::sqrt(0.36 + 1600.0), 1e-4);
  EXPECT_EQ(b.grad.data<float>()[0], 40.f);
  EXPECT_FLOAT_EQ(optim::clip_factor(10.0, 2.5f), 0.25f);
}

TEST(Clip, DetectsNonFiniteGradients) {
  Parameter a = param("a", {1.f, 1.f}), b = param("layers.3.moe.router", {1.f});
  std::vector<Parameter*> ps = {&a, &b};
  set_grad(a, {1.f, 2.f});
  EXPECT_TRUE(optim::grads_finite(ps));
  EXPECT_EQ(optim::first_nonfinite_grad(ps), "");
  set_grad(b, {std::numeric_limits<float>::quiet_NaN()});
  EXPECT_FALSE(optim::grads_finite(ps));
  EXPECT_EQ(optim::first_nonfinite_grad(ps), "layers.3.moe.router");
  // A non-finite norm is reported and the gradients are left alone.
  EXPECT_TRUE(std::isnan(optim::clip_grad_norm(ps, 1.0f)));
  EXPECT_EQ(a.grad.data<float>()[1], 2.f);
  set_grad(b, {std::numeric_limits<float>::infinity()});
  EXPECT_FALSE(optim::grads_finite(ps));
}

// bf16 gradients (model.moe.expert_grad_dtype = bf16): AdamW, the norm, clipping and the
// non-finite check read them as the f32 gradients of the same (bf16-exact) values.
TEST(Bf16Grads, OptimizerNormAndClipReadThemAsF32) {
  const std::vector<float> w0 = {1.0f, -2.0f, 0.5f, 3.0f};
  const std::vector<float> g = {0.375f, -1.25f, 2.5f, -0.0078125f};  // exact in bf16
  Parameter a = param("a", w0);
  Parameter b = Parameter::make("b", {4}, ParamKind::expert, true, DType::bf16);
  b.value.copy_from(Tensor::from_vector<float>(w0, {4}));
  ASSERT_EQ(b.grad.dtype(), DType::bf16);
  set_grad(a, g);
  b.grad.copy_from(Tensor::from_vector<float>(g, {4}).to(DType::bf16));
  EXPECT_DOUBLE_EQ(optim::grad_norm({&b}), optim::grad_norm({&a}));
  EXPECT_TRUE(optim::grads_finite({&a, &b}));
  const float s = optim::clip_factor(optim::grad_norm({&a}), 1.0f);
  optim::scale_grads({&a}, s);
  optim::scale_grads({&b}, s);
  const std::vector<float> ga = a.grad.to_vector<float>();
  const std::vector<float> gb = b.grad.to(DType::f32).to_vector<float>();
  for (int j = 0; j < 4; ++j) EXPECT_EQ(gb[j], static_cast<float>(bf16(ga[j]))) << j;  // once
  // The same gradient values step both to the same bits.
  a.grad.copy_from(b.grad.to(DType::f32));
  AdamW oa({&a}, {0.9f, 0.95f, 1e-8f, 0.1f}), ob({&b}, {0.9f, 0.95f, 1e-8f, 0.1f});
  oa.step(0.01f, 0.5f);
  ob.step(0.01f, 0.5f);
  EXPECT_EQ(a.value.to_vector<float>(), b.value.to_vector<float>());
  EXPECT_EQ(oa.v(0).to_vector<float>(), ob.v(0).to_vector<float>());
  // Lazily zeroed, then settled: real zeros.
  b.lazy_zero_grad = true;
  b.zero_grad();
  EXPECT_EQ(optim::grad_norm({&b}), 0.0);
  b.grad.copy_from(
      Tensor::from_vector<float>({1.f, std::numeric_limits<float>::infinity(), 0.f, 0.f}, {4})
          .to(DType::bf16));
  EXPECT_EQ(optim::first_nonfinite_grad({&a, &b}), "b");
  EXPECT_THROW(Parameter::make("c", {2}, ParamKind::dense, true, DType::i32), Error);
}
