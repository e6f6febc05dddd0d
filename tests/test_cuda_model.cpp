// The model, the optimizer and the trainer on CUDA against the CPU (llm.c test_gpt2 style): a
// micro transformer is built once on the host (the same weights everywhere), one copy moves to
// the GPU, and logits, loss and every parameter gradient are compared by normalised error
// ||a - b|| / ||b||; AdamW, the gradient norm and the trainer's losses likewise. Without a CUDA
// device every test skips, saying why, except CudaModelBuild.ClearErrors.
//
// Tolerances:
//   f32 compute, 1e-4 (gradients) / 1e-5 (logits, loss): the same math in another order (cuBLAS
//     tiles, warp trees, FMA contraction) gives ~1e-7 * sqrt(terms) per op; a forward and a
//     backward through two blocks chain a few dozen ops. An indexing bug gives errors of order 1.
//   bf16 compute, 3e-2 (logits, loss) / 1e-1 (gradients): every matmul input is rounded to bf16
//     (2^-9 = 2e-3 relative per element), the attention and FFN activations are stored in bf16,
//     and a backward chains the rounding of its forward and of its own bf16 outputs; measured on
//     the op harness a forward + backward stays at a few 1e-3 per op, so 3e-2 over the whole
//     model is 5-10x that. Weight gradients sum bf16 products in f32 but their inputs (dy, x) are
//     bf16, and small gradients of nearly cancelling sums (norm weights) have the largest
//     relative error; 1e-1 still fails on any wrong index or missing term (error ~1).
//   AdamW 1e-6: the kernel evaluates the CPU's formula in the CPU's order with IEEE-rounded
//     operations; the only differences come from the host compiler contracting a*b+c into an
//     FMA (one rounding less), i.e. a few ulps.
//   Trainer, bf16: |loss_cuda - loss_cpu| <= 3% of the CPU loss over the first 10 steps. The
//     bf16 gradients differ from the f32 ones by ~1e-2 relative; Adam's first steps move every
//     weight by about lr * sign(m), so elements with small gradients may step the other way and
//     the runs drift apart slowly. A broken update (no step, wrong sign, lost gradient) leaves
//     the loss near ln(256) = 5.5 while the CPU run falls well below it, far outside 3%.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "cuda_testing.h"
#include "testing.h"
#include "training_fixture.h"
#include "xmoe/config/config.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/rng.h"
#include "xmoe/model/transformer.h"
#include "xmoe/ops/ops.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/optim/clip.h"
#include "xmoe/train/memory_model.h"
#include "xmoe/train/trainer.h"

namespace {

using xmoe::testing::bitwise_equal;
using xmoe::testing::host_f32;
using xmoe::testing::kCuda;
using xmoe::testing::normalised_error;
using xmoe::testing::quiet;
using xmoe::testing::train_stopped_and_resumed;

using namespace xmoe;
namespace fs = std::filesystem;

/// A dense-only micro model (first_dense_layers = num_layers): independent of the MoE layer.
ModelConfig dense_micro(bool tied = false) {
  ModelConfig m;
  m.vocab_size = 256;
  m.d_model = 64;
  m.num_layers = 2;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.max_seq_len = 32;
  m.dense_hidden = 128;
  m.first_dense_layers = m.num_layers;
  m.tie_embeddings = tied;
  return m;
}

/// Two blocks: a dense one, then an MoE one (4 experts, top-2, one shared expert).
ModelConfig moe_micro() {
  ModelConfig m = dense_micro();
  m.first_dense_layers = 1;
  m.moe.num_experts = 4;
  m.moe.top_k = 2;
  m.moe.expert_hidden = 32;
  m.moe.num_shared_experts = 1;
  return m;
}

Tensor random_ids(int64_t b, int64_t s, int64_t vocab, uint64_t seed) {
  Rng rng(seed, 3);
  std::vector<int32_t> v(static_cast<size_t>(b * s));
  for (auto& x : v) x = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  return Tensor::from_vector<int32_t>(v, {b, s});
}

struct ModelCase {
  const char* name;
  ModelConfig cfg;
  DType dtype;
  double logits_tol, loss_tol, grad_tol;
};

/// Runs forward (logits), forward_loss and backward on a CPU model and on a CUDA copy built
/// from the same seed; compares logits, loss and every gradient.
void compare_model(const ModelCase& c) {
  const uint64_t seed = 42;
  model::Transformer cpu(c.cfg, seed);
  model::Transformer gpu(c.cfg, seed);
  gpu.to(kCuda);
  gpu.set_compute_dtype(c.dtype);
  const Tensor ids = random_ids(2, 16, c.cfg.vocab_size, 1);
  const Tensor targets = random_ids(2, 16, c.cfg.vocab_size, 2);

  const Tensor ref_logits = cpu.forward(ids);
  cpu.release();
  const Tensor logits = gpu.forward(ids.to(kCuda));
  gpu.release();
  EXPECT_EQ(logits.device(), kCuda);
  const double le = normalised_error(logits, ref_logits);
  std::printf("[model] %s logits %.3g\n", c.name, le);
  EXPECT_LE(le, c.logits_tol) << c.name << " logits";

  const float ref_loss = cpu.forward_loss(ids, targets);
  cpu.backward(0.5f);
  const float loss = gpu.forward_loss(ids.to(kCuda), targets.to(kCuda));
  gpu.backward(0.5f);
  std::printf("[model] %s loss cpu %.6f cuda %.6f\n", c.name, ref_loss, loss);
  EXPECT_LE(std::fabs(loss - ref_loss), c.loss_tol * std::fabs(ref_loss)) << c.name << " loss";

  const auto ref_params = cpu.parameters();
  const auto params = gpu.parameters();
  ASSERT_EQ(ref_params.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(params[i]->name, ref_params[i]->name);
    EXPECT_EQ(params[i]->grad.device(), kCuda) << params[i]->name;
    EXPECT_EQ(params[i]->grad.dtype(), DType::f32) << params[i]->name;
    const double ge = normalised_error(params[i]->grad, ref_params[i]->grad);
    std::printf("[model] %s grad %-28s %.3g\n", c.name, params[i]->name.c_str(), ge);
    EXPECT_LE(ge, c.grad_tol) << c.name << " grad of " << params[i]->name;
  }
}

// ---- the model ------------------------------------------------------------------------------

TEST(CudaModel, DenseF32MatchesCpu) {
  XMOE_REQUIRE_CUDA();
  compare_model({"dense-f32", dense_micro(), DType::f32, 1e-5, 1e-5, 1e-4});
  ModelConfig tied = dense_micro(/*tied=*/true);
  tied.recompute = {"attention", "ffn"};
  compare_model({"dense-f32-tied-recompute", tied, DType::f32, 1e-5, 1e-5, 1e-4});
}

TEST(CudaModel, DenseBf16WithinBf16Tolerance) {
  XMOE_REQUIRE_CUDA();
  compare_model({"dense-bf16", dense_micro(), DType::bf16, 3e-2, 3e-2, 1e-1});
  compare_model({"dense-bf16-tied", dense_micro(true), DType::bf16, 3e-2, 3e-2, 1e-1});
}

TEST(CudaModel, Bf16CopiesFeedTheMatmulsNotTheNorms) {
  XMOE_REQUIRE_CUDA();
  model::Transformer m(dense_micro(), 7);
  m.to(kCuda);
  m.set_compute_dtype(DType::bf16);
  for (Parameter* p : m.parameters()) {
    EXPECT_EQ(p->value.dtype(), DType::f32) << p->name;
    EXPECT_EQ(p->value.device(), kCuda) << p->name;
    const bool matrix = p->value.dim() >= 2 && p->name != "embed.weight";
    EXPECT_EQ(p->compute_copy.defined(), matrix) << p->name;
    if (matrix) {
      EXPECT_EQ(p->compute_copy.dtype(), DType::bf16);
      EXPECT_EQ(normalised_error(p->compute_copy, p->value.to(Device::cpu()).to(DType::bf16)), 0.0)
          << p->name;
    }
  }
  m.set_compute_dtype(DType::f32);
  for (Parameter* p : m.parameters()) EXPECT_FALSE(p->compute_copy.defined()) << p->name;
}

// The MoE layer on CUDA is the MoE engineer's work: this test passes once MoELayer accepts
// CUDA tensors (and, for bf16, uses Parameter::compute() in its matmuls).
TEST(CudaModel, MoEMatchesCpu) {
  XMOE_REQUIRE_CUDA();
  // f32: routing sees the same logits up to ~1e-7, so the same experts win (no near-ties at
  // this seed); the tolerances of the dense model apply, a little looser for the router.
  compare_model({"moe-f32", moe_micro(), DType::f32, 1e-5, 1e-5, 1e-3});
}

// Selective recompute on CUDA (attention_core re-runs the flash/cuDNN attention forward from the
// kept q, k, v; router re-runs the gate's GEMM and softmax/sigmoid): the same kernels on the
// same inputs, so the gradients equal those of the run that keeps everything bit for bit, in
// f32 and bf16, for every gate; and the CUDA run still matches the CPU.
TEST(CudaModel, SelectiveRecomputeGivesTheSameGradients) {
  XMOE_REQUIRE_CUDA();
  const Tensor ids = random_ids(2, 16, 256, 1).to(kCuda);
  const Tensor targets = random_ids(2, 16, 256, 2).to(kCuda);
  for (const char* gate : {"softmax_topk", "sigmoid", "xmoe"}) {
    for (DType dtype : {DType::f32, DType::bf16}) {
      ModelConfig c = moe_micro();
      c.moe.gate = gate;
      c.moe.router_dim = 8;
      c.moe.aux_loss_weight = 0.01f;
      c.moe.z_loss_weight = 0.001f;
      auto grads = [&](std::vector<std::string> recompute) {
        c.recompute = std::move(recompute);
        model::Transformer m(c, 42);
        m.to(kCuda);
        m.set_compute_dtype(dtype);
        m.forward_loss(ids, targets);
        m.backward(0.5f);
        std::vector<Tensor> g;
        for (Parameter* p : m.parameters()) g.push_back(p->grad.to(Device::cpu()));
        return g;
      };
      const std::vector<Tensor> kept = grads({});
      const std::vector<Tensor> recomputed = grads({"attention_core", "router", "moe"});
      ASSERT_EQ(kept.size(), recomputed.size());
      for (size_t i = 0; i < kept.size(); ++i)
        EXPECT_EQ(kept[i].to_vector<float>(), recomputed[i].to_vector<float>())
            << gate << " " << dtype_name(dtype) << " gradient " << i;
    }
  }
  ModelConfig c = moe_micro();
  c.recompute = {"attention_core", "router"};
  compare_model({"moe-f32-core-router", c, DType::f32, 1e-5, 1e-5, 1e-3});
}

// ---- the optimizer --------------------------------------------------------------------------

/// big_grad: the dtype of "big"'s gradient (bf16: model.moe.expert_grad_dtype's experts).
std::vector<Parameter> optimizer_params(uint64_t seed, DType big_grad = DType::f32) {
  std::vector<Parameter> ps;
  ps.push_back(Parameter::make("w", {37, 129}));
  ps.push_back(Parameter::make("big", {3, 70000}, ParamKind::expert, true, big_grad));  // chunks
  ps.push_back(Parameter::make("norm", {129}, ParamKind::dense, /*weight_decay=*/false));
  ps.push_back(Parameter::make("empty", {0, 4}));
  for (size_t i = 0; i < ps.size(); ++i) ps[i].init_normal(seed + i, 0.5f);
  return ps;
}

void random_grads(std::vector<Parameter>& ps, uint64_t seed) {
  for (size_t i = 0; i < ps.size(); ++i) {
    Tensor g = Tensor::empty(ps[i].value.shape());
    fill_normal(g, seed, 100 + i, 1e-2f);
    ps[i].grad.copy_from(ps[i].grad.dtype() == DType::bf16 ? g.to(DType::bf16) : g);
  }
}

void expect_adamw_matches_cpu(DType big_grad, DType moments = DType::f32) {
  std::vector<Parameter> cpu = optimizer_params(5, big_grad), gpu = optimizer_params(5, big_grad);
  for (Parameter& p : gpu) p.to(kCuda);
  gpu[0].compute_copy = ops::cast(gpu[0].value, DType::bf16);  // rewritten by the step
  std::vector<Parameter*> pc, pg;
  for (auto& p : cpu) pc.push_back(&p);
  for (auto& p : gpu) pg.push_back(&p);
  optim::AdamWConfig cfg{0.9f, 0.95f, 1e-8f, 0.1f};
  cfg.moments_dtype = moments;
  optim::AdamW oc(pc, cfg), og(pg, cfg);
  EXPECT_EQ(og.device(), kCuda);
  EXPECT_EQ(og.m(1).dtype(), moments);
  for (int step = 0; step < 5; ++step) {
    random_grads(cpu, 50 + step);
    random_grads(gpu, 50 + step);
    const float lr = 1e-2f * static_cast<float>(step + 1);
    const float clip = step % 2 ? 0.37f : 1.0f;  // the clip factor, applied by the update
    oc.step(lr, clip);
    og.step(lr, clip);
  }
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double ve = normalised_error(gpu[i].value, cpu[i].value);
    const double me = normalised_error(og.m(i), oc.m(i));
    const double vv = normalised_error(og.v(i), oc.v(i));
    std::printf("[adamw] %s value %.3g m %.3g v %.3g\n", cpu[i].name.c_str(), ve, me, vv);
    EXPECT_LE(ve, 1e-6) << cpu[i].name;
    EXPECT_LE(me, 1e-6) << cpu[i].name;
    EXPECT_LE(vv, 1e-6) << cpu[i].name;
  }
  // The bf16 copy is bf16(value) after the last step, exactly.
  EXPECT_EQ(normalised_error(gpu[0].compute_copy, gpu[0].value.to(Device::cpu()).to(DType::bf16)),
            0.0);
  // Checkpoint round trip: the exported state comes back onto the device.
  std::map<std::string, Tensor> state;
  og.export_state(state);
  optim::AdamW og2(pg, cfg);
  og2.import_state(state);
  EXPECT_EQ(og2.step_count(), 5);
  EXPECT_EQ(og2.m(1).device(), kCuda);
  EXPECT_EQ(normalised_error(og2.v(1), og.v(1)), 0.0);
}

// f32 gradients, then "big" with a bf16 one (model.moe.expert_grad_dtype) beside f32 ones.
TEST(CudaModel, AdamWMatchesCpu) {
  XMOE_REQUIRE_CUDA();
  for (DType big_grad : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(big_grad));
    expect_adamw_matches_cpu(big_grad);
  }
}

// train.offload_optimizer: the same parameters updated by the device's AdamW and by the
// offloaded one (master weights and moments in pinned host memory, the CPU kernel, groups of
// 60,000 elements so that "big" spans several and the copies overlap the updates) agree within
// the AdamW parity tolerance; the bf16 copy the device keeps is bf16 of the host master
// exactly, and the f32 device copies (parameters without a bf16 copy) equal it.
void expect_offloaded_adamw_matches_device(DType big_grad, DType moments = DType::f32) {
  std::vector<Parameter> dev = optimizer_params(5, big_grad), off = optimizer_params(5, big_grad);
  for (std::vector<Parameter>* ps : {&dev, &off})
    for (Parameter& p : *ps) {
      p.to(kCuda);
      if (p.name == "w") p.compute_copy = ops::cast(p.value, DType::bf16);
    }
  for (Parameter& p : off) p.offload_master();
  EXPECT_TRUE(off[0].offloaded());
  EXPECT_FALSE(off[0].device_f32.defined());  // forward reads only its bf16 copy
  EXPECT_TRUE(off[2].device_f32.defined());   // "norm": no bf16 copy, forward reads f32
  std::vector<Parameter*> pd, po;
  for (auto& p : dev) pd.push_back(&p);
  for (auto& p : off) po.push_back(&p);
  optim::AdamWConfig cfg{0.9f, 0.95f, 1e-8f, 0.1f};
  cfg.moments_dtype = moments;
  optim::AdamWConfig off_cfg = cfg;
  off_cfg.offload = true;
  off_cfg.offload_group_numel = 60000;
  optim::AdamW od(pd, cfg), oo(po, off_cfg);
  EXPECT_EQ(oo.device(), Device::cpu());
  EXPECT_TRUE(oo.m(1).is_cpu());
  for (int step = 0; step < 5; ++step) {
    random_grads(dev, 50 + step);
    random_grads(off, 50 + step);
    const float lr = 1e-2f * static_cast<float>(step + 1);
    const float clip = step % 2 ? 0.37f : 1.0f;
    od.step(lr, clip);
    oo.step(lr, clip);
  }
  backend::synchronize(kCuda);
  for (size_t i = 0; i < dev.size(); ++i) {
    const double ve = normalised_error(off[i].value, dev[i].value);
    const double me = normalised_error(oo.m(i), od.m(i));
    const double vv = normalised_error(oo.v(i), od.v(i));
    std::printf("[adamw offload] %s value %.3g m %.3g v %.3g\n", dev[i].name.c_str(), ve, me, vv);
    EXPECT_LE(ve, 1e-6) << dev[i].name;
    EXPECT_LE(me, 1e-6) << dev[i].name;
    EXPECT_LE(vv, 1e-6) << dev[i].name;
    if (off[i].device_f32.defined()) {
      EXPECT_EQ(normalised_error(off[i].device_f32, off[i].value), 0.0) << dev[i].name;
    }
  }
  EXPECT_EQ(normalised_error(off[0].compute_copy, off[0].value.to(DType::bf16)), 0.0);
  // Checkpoint round trip: the exported host state comes back into a fresh offloaded optimizer.
  std::map<std::string, Tensor> state;
  oo.export_state(state);
  optim::AdamW oo2(po, off_cfg);
  oo2.import_state(state);
  EXPECT_EQ(oo2.step_count(), 5);
  EXPECT_EQ(normalised_error(oo2.v(1), oo.v(1)), 0.0);
}

TEST(CudaModel, OffloadedAdamWMatchesTheDeviceOne) {
  XMOE_REQUIRE_CUDA();
  for (DType big_grad : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(big_grad));
    expect_offloaded_adamw_matches_device(big_grad);
  }
}

// train.adam_moments_dtype = bf16: the multi-tensor kernel's bf16-moment variant against the
// CPU kernel (the same f32 formula, the moments rounded to nearest even where stored: within the
// AdamW tolerance above, moments compared as their bf16 values), the exported state's widened
// moments back onto the device; and the offloaded bf16-moment update against the device one.
TEST(CudaModel, Bf16MomentAdamWMatchesCpu) {
  XMOE_REQUIRE_CUDA();
  for (DType big_grad : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(big_grad));
    expect_adamw_matches_cpu(big_grad, DType::bf16);
    expect_offloaded_adamw_matches_device(big_grad, DType::bf16);
  }
}

// What leaves the GPU: the moments (8 bytes per element) of every parameter, and the f32 master
// (4) of every parameter whose forward reads only its bf16 copy; measured by the device
// allocator's live bytes with the model and its optimizer built, with and without offload.
TEST(CudaModel, OffloadFreesTheMastersAndMomentsOnTheDevice) {
  XMOE_REQUIRE_CUDA();
  for (DType dtype : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dtype));
    auto live_with_optimizer = [&](bool offload, int64_t* expected_saving) {
      backend::synchronize(kCuda);
      const int64_t base = memory_stats(kCuda).live_bytes;
      model::Transformer m(moe_micro(), 7);
      m.to(kCuda);
      m.set_compute_dtype(dtype);
      if (offload) m.offload_master_weights();
      optim::AdamWConfig cfg;
      cfg.offload = offload;
      optim::AdamW opt(m.parameters(), cfg);
      if (expected_saving) {
        *expected_saving = 0;
        for (const Parameter* p : m.parameters()) {
          EXPECT_TRUE(p->offloaded()) << p->name;
          const int64_t n = p->value.numel();
          *expected_saving += 8 * n + (p->device_f32.defined() ? 0 : 4 * n);
        }
      }
      return memory_stats(kCuda).live_bytes - base;
    };
    int64_t saving = 0;
    const int64_t plain = live_with_optimizer(false, nullptr);
    const int64_t off = live_with_optimizer(true, &saving);
    std::printf("[offload] %s: device bytes %lld -> %lld (saved %lld, masters + moments %lld)\n",
                std::string(dtype_name(dtype)).c_str(), static_cast<long long>(plain),
                static_cast<long long>(off), static_cast<long long>(plain - off),
                static_cast<long long>(saving));
    EXPECT_GE(plain - off, saving);
    EXPECT_GT(saving, 0);
  }
}

// place(): to(), set_compute_dtype() and offload_master_weights() parameter by parameter give the
// three calls' bits (the bf16 copies, the host masters, the device's f32 copies) while the device
// peaks at the part that stays plus one parameter's f32 master, not the whole f32 model.
TEST(CudaModel, PlaceOffloadsParameterByParameterWithTheSameBits) {
  XMOE_REQUIRE_CUDA();
  for (DType dtype : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dtype));
    model::Transformer a(moe_micro(), 7), b(moe_micro(), 7);
    a.to(kCuda);
    a.set_compute_dtype(dtype);
    a.offload_master_weights();
    backend::synchronize(kCuda);
    const int64_t base = memory_stats(kCuda).live_bytes;
    reset_peak_memory(kCuda);
    b.place(kCuda, dtype, true);
    backend::synchronize(kCuda);
    const int64_t peak = memory_stats(kCuda).peak_bytes - base;
    const int64_t kept = memory_stats(kCuda).live_bytes - base;
    ASSERT_TRUE(b.master_offloaded());
    EXPECT_EQ(b.compute_dtype(), dtype);
    const auto pa = a.parameters(), pb = b.parameters();
    ASSERT_EQ(pa.size(), pb.size());
    int64_t largest_master = 0, masters = 0;
    for (size_t i = 0; i < pa.size(); ++i) {
      SCOPED_TRACE(pb[i]->name);
      EXPECT_TRUE(pb[i]->value.is_cpu());
      EXPECT_TRUE(bitwise_equal(pa[i]->value, pb[i]->value));
      ASSERT_EQ(pa[i]->compute_copy.defined(), pb[i]->compute_copy.defined());
      if (pb[i]->compute_copy.defined()) {
        EXPECT_TRUE(bitwise_equal(pa[i]->compute_copy, pb[i]->compute_copy));
      }
      ASSERT_EQ(pa[i]->device_f32.defined(), pb[i]->device_f32.defined());
      if (pb[i]->device_f32.defined()) {
        EXPECT_TRUE(bitwise_equal(pa[i]->device_f32, pb[i]->device_f32));
      }
      const auto bytes = static_cast<int64_t>(pb[i]->value.nbytes());
      largest_master = std::max(largest_master, bytes);
      masters += bytes;
    }
    std::printf("[place] %s: device kept %lld bytes, peak %lld, f32 masters %lld\n",
                std::string(dtype_name(dtype)).c_str(), static_cast<long long>(kept),
                static_cast<long long>(peak), static_cast<long long>(masters));
    EXPECT_LE(peak, kept + largest_master);
  }
}

void expect_grad_norm_scale_and_nonfinite(DType big_grad) {
  std::vector<Parameter> cpu = optimizer_params(9, big_grad), gpu = optimizer_params(9, big_grad);
  for (Parameter& p : gpu) p.to(kCuda);
  random_grads(cpu, 3);
  random_grads(gpu, 3);
  std::vector<Parameter*> pc, pg;
  for (auto& p : cpu) pc.push_back(&p);
  for (auto& p : gpu) pg.push_back(&p);
  const double ref = optim::grad_sum_squares(pc), got = optim::grad_sum_squares(pg);
  EXPECT_NEAR(got, ref, 1e-12 * ref);
  // Deterministic: the same bits every time.
  EXPECT_EQ(optim::grad_sum_squares(pg), got);
  optim::scale_grads(pc, 0.25f);
  optim::scale_grads(pg, 0.25f);
  for (size_t i = 0; i < cpu.size(); ++i)
    EXPECT_EQ(normalised_error(gpu[i].grad, cpu[i].grad), 0.0) << cpu[i].name;
  // A non-finite element makes the norm non-finite (the trainer's check).
  Tensor g = gpu[1].grad.to(Device::cpu());
  if (big_grad == DType::bf16) {
    g.data<bf16>()[12345] = bf16(std::numeric_limits<float>::infinity());
  } else {
    g.data<float>()[12345] = std::numeric_limits<float>::infinity();
  }
  gpu[1].grad.copy_from(g);
  EXPECT_FALSE(std::isfinite(optim::grad_norm(pg)));
  EXPECT_EQ(optim::first_nonfinite_grad(pg), "big");
}

TEST(CudaModel, GradNormScaleAndNonFinite) {
  XMOE_REQUIRE_CUDA();
  for (DType big_grad : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(big_grad));
    expect_grad_norm_scale_and_nonfinite(big_grad);
  }
}

// ---- the trainer ----------------------------------------------------------------------------

class CudaTrainTest : public xmoe::testing::MicroCorpusTest {
 protected:
  CudaTrainTest() : MicroCorpusTest("xmoe-cuda-train-") {}

  /// test_train.cpp's micro run (training_fixture.h) for 10 steps into root/<run>, dense only
  /// unless `moe`.
  Config micro_config(const std::string& run, bool moe = false) const {
    return xmoe::testing::micro_config(root_, {.moe = moe, .steps = 10, .every = 5, .run = run});
  }

  /// `c` trained on CUDA in compute `dtype` into root/<tag>-<dtype>: every step's loss within
  /// `tol` (relative) of the CPU run `ref`.
  train::TrainResult train_on_cuda(Config c, const std::string& tag, const char* dtype,
                                   const train::TrainResult& ref, double tol) const {
    c.train.out_dir = (root_ / (tag + "-" + dtype)).string();
    c.train.device = "cuda";
    c.train.dtype = dtype;
    train::TrainResult r = train::train(c, quiet());
    EXPECT_EQ(r.steps.size(), ref.steps.size()) << tag << " " << dtype;
    for (size_t i = 0; i < std::min(r.steps.size(), ref.steps.size()); ++i) {
      std::printf("[train] %s %s step %zu loss cpu %.5f cuda %.5f mfu %.2g\n", tag.c_str(), dtype,
                  i + 1, ref.steps[i].loss, r.steps[i].loss, r.steps[i].mfu);
      EXPECT_LE(std::fabs(r.steps[i].loss - ref.steps[i].loss), tol * ref.steps[i].loss)
          << tag << " " << dtype << " step " << i + 1;
    }
    return r;
  }
};

TEST_F(CudaTrainTest, LossesFollowTheCpu) {
  XMOE_REQUIRE_CUDA();
  const auto ref = train::train(micro_config("cpu"), quiet());
  for (const char* dtype : {"f32", "bf16"}) {
    const double tol = std::string(dtype) == "f32" ? 1e-4 : 3e-2;
    const auto r = train_on_cuda(micro_config("cuda"), "cuda", dtype, ref, tol);
    ASSERT_EQ(r.steps.size(), 10u);
    for (const auto& step : r.steps) EXPECT_GT(step.mfu, 0.0) << dtype;
    ASSERT_EQ(r.evals.size(), ref.evals.size());
    EXPECT_LE(std::fabs(r.evals.back().val_loss - ref.evals.back().val_loss),
              tol * ref.evals.back().val_loss);
    // Checkpoints are host f32 safetensors.
    EXPECT_TRUE(fs::exists(root_ / (std::string("cuda-") + dtype) / "step-10" / "manifest.json"));
  }
  EXPECT_LT(ref.steps.back().loss, ref.steps.front().loss);
}

TEST_F(CudaTrainTest, ResumeOnTheDeviceReproducesTheRun) {
  XMOE_REQUIRE_CUDA();
  // Every CUDA op is deterministic, so a resumed bf16 run repeats the straight one bit for bit.
  Config c = micro_config("straight");
  c.train.device = "cuda";
  const auto straight = train::train(c, quiet());
  c.train.out_dir = (root_ / "resumed").string();
  const auto b = train_stopped_and_resumed(c, 5);
  ASSERT_EQ(b.steps.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(straight.steps[5 + i].loss, b.steps[i].loss) << "step " << 6 + i;
    EXPECT_EQ(straight.steps[5 + i].grad_norm, b.steps[i].grad_norm) << "step " << 6 + i;
  }
}

// train.offload_optimizer on the GPU (MoE model, f32 and bf16 compute): the losses follow the
// on-device optimizer's run within 1e-5 relative over 10 steps (the two AdamWs agree within
// 1e-6 on the weights, CudaModel.OffloadedAdamWMatchesTheDeviceOne; a wrong copy or a stale
// weight would be off by far more); copied during backward or after it, the same bits; saved
// and resumed with offload, the run repeats the straight offloaded one bit for bit.
TEST_F(CudaTrainTest, OffloadFollowsTheOnDeviceOptimizer) {
  XMOE_REQUIRE_CUDA();
  for (const char* dtype : {"f32", "bf16"}) {
    Config c = micro_config(std::string("plain-") + dtype, /*moe=*/true);
    c.train.device = "cuda";
    c.train.dtype = dtype;
    const auto plain = train::train(c, quiet());
    c.train.offload_optimizer = true;
    c.train.out_dir = (root_ / (std::string("offload-") + dtype)).string();
    const auto off = train::train(c, quiet());
    EXPECT_GT(off.offload_staging_bytes, 0);
    ASSERT_EQ(off.steps.size(), plain.steps.size());
    for (size_t i = 0; i < off.steps.size(); ++i) {
      std::printf("[offload] %s step %zu loss device-adamw %.7f offloaded %.7f\n", dtype, i + 1,
                  plain.steps[i].loss, off.steps[i].loss);
      EXPECT_LE(std::fabs(off.steps[i].loss - plain.steps[i].loss), 1e-5 * plain.steps[i].loss)
          << dtype << " step " << i + 1;
    }
    // train.offload_overlap (the default): the gradients that travelled during backward give
    // the bits of the run that copies them all after it.
    c.train.offload_overlap = false;
    c.train.out_dir = (root_ / (std::string("offload-after-") + dtype)).string();
    const auto after = train::train(c, quiet());
    ASSERT_EQ(after.steps.size(), off.steps.size());
    for (size_t i = 0; i < off.steps.size(); ++i)
      EXPECT_EQ(after.steps[i].loss, off.steps[i].loss) << dtype << " overlap, step " << i + 1;
    c.train.offload_overlap = true;
    c.train.out_dir = (root_ / (std::string("offload-resumed-") + dtype)).string();
    const auto rest = train_stopped_and_resumed(c, 5);
    ASSERT_EQ(rest.steps.size(), 5u);
    for (int i = 0; i < 5; ++i)
      EXPECT_EQ(rest.steps[i].loss, off.steps[5 + i].loss) << dtype << " resumed step " << 6 + i;
  }
}

// train.offload_delayed_update_from = 3 on the GPU (MoE model, f32 and bf16 compute): the
// delayed run follows the CPU's delayed run (f32 within the MoE tolerance of
// MoETrainsOnTheDeviceF32, bf16 within LossesFollowTheCpu's); its steps 1..4 are the plain
// offloaded GPU run's bit for bit; the device holds exactly the twins' bytes more between
// steps (the memory model's figure); resumed at step 5 it repeats its steps bit for bit.
TEST_F(CudaTrainTest, DelayedOffloadUpdateFollowsTheCpu) {
  XMOE_REQUIRE_CUDA();
  Config c = micro_config("delayed-cpu", /*moe=*/true);
  c.train.offload_optimizer = true;
  c.train.offload_delayed_update_from = 3;
  validate(c);
  const auto cpu = train::train(c, quiet());
  for (const char* dtype : {"f32", "bf16"}) {
    const double tol = std::string(dtype) == "f32" ? 1e-3 : 3e-2;
    const auto dpu = train_on_cuda(c, "delayed", dtype, cpu, tol);
    Config plain = c;
    plain.train.offload_delayed_update_from = -1;
    plain.train.device = "cuda";
    plain.train.dtype = dtype;
    plain.train.out_dir = (root_ / (std::string("offload-") + dtype)).string();
    const auto off = train::train(plain, quiet());
    ASSERT_EQ(off.steps.size(), dpu.steps.size());
    for (size_t i = 0; i < 4; ++i)
      EXPECT_EQ(dpu.steps[i].loss, off.steps[i].loss) << dtype << " step " << i + 1;
    EXPECT_GT(dpu.delayed_update_bytes, 0);
    Config predicted = c;
    predicted.train.device = "cuda";
    predicted.train.dtype = dtype;
    EXPECT_EQ(dpu.delayed_update_bytes, train::predict_memory(predicted).delayed_update_bytes)
        << dtype;
    EXPECT_EQ(dpu.steady_bytes - off.steady_bytes, dpu.delayed_update_bytes) << dtype;
    std::printf("[delayed] %s twins %lld bytes, steady %lld (plain offload %lld)\n", dtype,
                static_cast<long long>(dpu.delayed_update_bytes),
                static_cast<long long>(dpu.steady_bytes), static_cast<long long>(off.steady_bytes));
    Config resumed = predicted;
    resumed.train.out_dir = (root_ / (std::string("delayed-resumed-") + dtype)).string();
    const auto rest = train_stopped_and_resumed(resumed, 5);
    ASSERT_EQ(rest.steps.size(), 5u);
    for (int i = 0; i < 5; ++i)
      EXPECT_EQ(rest.steps[i].loss, dpu.steps[5 + i].loss) << dtype << " resumed step " << 6 + i;
  }
}

// Pass once the MoE layer runs on CUDA (f32), and takes bf16 inputs with its matmuls on
// Parameter::compute() (bf16). The f32 run follows the CPU run like the dense model.
TEST_F(CudaTrainTest, MoETrainsOnTheDeviceF32) {
  XMOE_REQUIRE_CUDA();
  const auto ref = train::train(micro_config("moe-cpu", /*moe=*/true), quiet());
  Config c = micro_config("moe-f32", /*moe=*/true);
  c.train.device = "cuda";
  c.train.dtype = "f32";
  const auto r = train::train(c, quiet());
  ASSERT_EQ(r.steps.size(), 10u);
  for (int i = 0; i < 10; ++i) {
    std::printf("[train] moe f32 step %d loss cpu %.5f cuda %.5f\n", i + 1, ref.steps[i].loss,
                r.steps[i].loss);
    EXPECT_LE(std::fabs(r.steps[i].loss - ref.steps[i].loss), 1e-3 * ref.steps[i].loss)
        << "step " << i + 1;
  }
}

TEST_F(CudaTrainTest, MoETrainsOnTheDeviceBf16) {
  XMOE_REQUIRE_CUDA();
  Config c = micro_config("moe-bf16", /*moe=*/true);
  c.train.device = "cuda";
  const auto r = train::train(c, quiet());
  ASSERT_EQ(r.steps.size(), 10u);
  for (const auto& s : r.steps) EXPECT_TRUE(std::isfinite(s.loss) && !s.skipped);
  EXPECT_LT(r.steps.back().loss, r.steps.front().loss);
}

// model.moe.expert_grad_dtype = bf16 on the device: f32 compute (f32 GEMMs rounded into the
// bf16 gradients) follows the CPU's bf16-gradient run closely, bf16 compute (the sm90 kernels'
// bf16 output) within bf16 tolerance.
TEST_F(CudaTrainTest, MoEWithBf16ExpertGradientsFollowsTheCpu) {
  XMOE_REQUIRE_CUDA();
  Config cpu = micro_config("moe-bf16-grads-cpu", /*moe=*/true);
  cpu.model.moe.expert_grad_dtype = "bf16";
  const auto ref = train::train(cpu, quiet());
  for (const char* dtype : {"f32", "bf16"}) {
    const double tol = std::string(dtype) == "f32" ? 2e-3 : 3e-2;
    EXPECT_EQ(train_on_cuda(cpu, "moe-bf16-grads", dtype, ref, tol).steps.size(), 10u);
  }
}

// ---- every build ----------------------------------------------------------------------------

TEST(CudaModelBuild, ClearErrors) {
  model::Transformer m(dense_micro(), 1);
  EXPECT_CONTAINS(xmoe::testing::error_of([&] { m.set_compute_dtype(DType::bf16); }),
                  "[transformer] compute dtype bf16 needs the model on a CUDA device");
  m.to(Device::cpu());  // a no-op
  EXPECT_EQ(m.device(), Device::cpu());
  if (!backend::cuda_available()) {
    Config c = preset("tiny");
    c.train.device = "cuda";
    EXPECT_CONTAINS(xmoe::testing::error_of([&] { train::train(c); }),
                    "[train] train.device = cuda: no CUDA device is available");
    return;
  }
  m.to(kCuda);
  EXPECT_CONTAINS(xmoe::testing::error_of([&] { m.forward(random_ids(1, 4, 256, 1)); }),
                  "[transformer] ids are on cpu but the model is on cuda:0");
}

}  // namespace
