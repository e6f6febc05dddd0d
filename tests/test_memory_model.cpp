// The memory model of a step (train/memory_model.h) against the allocator: real training steps
// of the tiny preset and its variants on the CPU, the peak inside a step and the bytes live
// between steps measured (TrainResult::peak_step_bytes, steady_bytes) and compared with the
// prediction made from the config alone.
#include <gtest/gtest.h>

#include "memory_model_fixture.h"
#include "xmoe/config/config.h"
#include "xmoe/train/memory_model.h"

using namespace xmoe;
using MemoryModelTest = xmoe::testing::MemoryModelTest;

TEST_F(MemoryModelTest, TinyPresetPeakAndSteadyBytes) {
  expect_predicted(tiny(), "tiny");
}

TEST_F(MemoryModelTest, RecomputeVariants) {
  Config c = tiny();
  c.model.recompute = {"attention", "ffn", "moe"};
  expect_predicted(c, "tiny, recompute all");
  c.model.recompute = {"moe"};
  c.train.out_dir = (root_ / "run-moe").string();
  expect_predicted(c, "tiny, recompute moe");
  c.model.recompute = {"attention_core", "router"};
  c.train.out_dir = (root_ / "run-core-router").string();
  expect_predicted(c, "tiny, recompute attention_core, router");
  c.model.recompute = {"attention_core", "ffn", "moe", "router"};
  c.model.moe.gate = "sigmoid";
  c.train.out_dir = (root_ / "run-selective").string();
  expect_predicted(c, "tiny sigmoid, recompute attention_core, ffn, moe, router");
}

TEST_F(MemoryModelTest, MoEVariants) {
  // A wider MoE: top-4 of 32 experts, 2 shared, bf16 expert gradients, the sigmoid gate.
  Config c = tiny();
  c.model.moe.num_experts = 32;
  c.model.moe.top_k = 4;
  c.model.moe.num_shared_experts = 2;
  c.model.moe.expert_grad_dtype = "bf16";
  c.model.moe.gate = "sigmoid";
  c.train.batch_size = 8;
  expect_predicted(c, "top-4 of 32, sigmoid, bf16 grads");
  // The padded baseline's [E, C, d] buffers.
  c.model.moe.gate = "softmax_topk";
  c.model.moe.impl = "padded";
  c.train.out_dir = (root_ / "run-padded").string();
  expect_predicted(c, "padded, capacity 1.25");
  // The experts' input rows kept to backward instead of gathered again.
  c.model.moe.impl = "pft";
  c.model.moe.keep_expert_rows = true;
  c.train.out_dir = (root_ / "run-keep-rows").string();
  expect_predicted(c, "top-4 of 32, experts' rows kept");
}

TEST_F(MemoryModelTest, Fp8Experts) {
  // model.moe.expert_dtype = fp8: each layer's quantised weights live from its forward to its
  // backward, the quantised rows for one GEMM each.
  Config c = tiny();
  c.model.moe.expert_dtype = "fp8";
  expect_predicted(c, "tiny, fp8 experts");
  // Accumulating micro-batches, the experts quantise once per step and keep their FP8 weights
  // past their backward (Experts::keep_weights): held until the last micro-batch ends.
  c.train.grad_accum = 2;
  c.train.out_dir = (root_ / "run-fp8-accumulating").string();
  expect_predicted(c, "tiny, fp8 experts, 2 micro-batches");
  // moe.keep_expert_rows changes nothing: the quantiser gathers x, there are no rows to keep.
  c.model.moe.keep_expert_rows = true;
  c.train.out_dir = (root_ / "run-fp8-keep-rows").string();
  expect_predicted(c, "tiny, fp8 experts, 2 micro-batches, keep_expert_rows");
}

TEST_F(MemoryModelTest, OffloadedOptimizerStagingOnTheCpu) {
  // On the CPU the offloaded AdamW runs the same code: the state is host memory already, and
  // the host buffers the gradients travel through are the staging term.
  Config c = tiny();
  c.train.offload_optimizer = true;
  expect_predicted(c, "tiny, offload");
  // bf16 expert gradients: their staging is 2 bytes an element.
  c.model.moe.expert_grad_dtype = "bf16";
  c.train.out_dir = (root_ / "run-bf16-grads").string();
  expect_predicted(c, "tiny, offload, bf16 grads");
  // The delayed update: the f32 copies forward reads instead of the master weights, their
  // twins, and whole gradient buffers.
  c.train.offload_delayed_update_from = 2;
  c.train.out_dir = (root_ / "run-delayed").string();
  expect_predicted(c, "tiny, offload, delayed update");
}

// The delayed update's twins on the device: 2 bytes per bf16 compute-copy element and 4 per
// f32-copy element, in the steady bytes and the table; the host is unchanged.
TEST(MemoryModel, DelayedUpdateTwinsTheCopiesForwardReads) {
  Config c = preset("moe-1b");
  c.train.offload_optimizer = true;
  const train::MemoryModel off = train::predict_memory(c);
  c.train.offload_delayed_update_from = 2;
  const train::MemoryModel dpu = train::predict_memory(c);
  EXPECT_EQ(off.delayed_update_bytes, 0);
  EXPECT_GT(dpu.compute_copy_bytes, 0);
  EXPECT_EQ(dpu.delayed_update_bytes, dpu.compute_copy_bytes + dpu.device_f32_bytes);
  EXPECT_EQ(dpu.device_f32_bytes, off.device_f32_bytes);
  EXPECT_EQ(dpu.steady_bytes - off.steady_bytes, dpu.delayed_update_bytes);
  EXPECT_EQ(dpu.peak_bytes - off.peak_bytes, dpu.delayed_update_bytes);
  EXPECT_EQ(dpu.host_bytes, off.host_bytes);
  EXPECT_NE(train::memory_table(dpu).find("twins the delayed update writes"), std::string::npos);
  EXPECT_EQ(train::memory_table(off).find("twins the delayed update writes"), std::string::npos);
}

TEST_F(MemoryModelTest, Bf16Moments) {
  // train.adam_moments_dtype = bf16: m and v take 4 bytes per parameter, on the device and with
  // the offloaded optimizer (host memory here).
  Config c = tiny();
  c.train.adam_moments_dtype = "bf16";
  expect_predicted(c, "tiny, bf16 moments");
  c.train.offload_optimizer = true;
  c.train.out_dir = (root_ / "run-offload").string();
  expect_predicted(c, "tiny, bf16 moments, offload");
}

// The lever's bytes per parameter (docs/training.md): bf16 moments take half of f32's 8, on the
// device (and its table says so) and, offloaded, on the host.
TEST(MemoryModel, Bf16MomentsHalveTheMomentBytes) {
  Config c = preset("moe-1b");
  const train::MemoryModel f32 = train::predict_memory(c);
  c.train.adam_moments_dtype = "bf16";
  const train::MemoryModel bf = train::predict_memory(c);
  EXPECT_EQ(f32.optimizer_bytes, 8 * f32.owned_parameters);
  EXPECT_EQ(bf.optimizer_bytes, 4 * bf.owned_parameters);
  EXPECT_EQ(f32.steady_bytes - bf.steady_bytes, 4 * bf.owned_parameters);
  EXPECT_NE(train::memory_table(bf).find("AdamW moments m, v (bf16)"), std::string::npos);
  EXPECT_EQ(train::memory_table(f32).find("AdamW moments m, v (bf16)"), std::string::npos);
  c.train.offload_optimizer = true;
  const train::MemoryModel off = train::predict_memory(c);
  c.train.adam_moments_dtype = "f32";
  const train::MemoryModel off32 = train::predict_memory(c);
  EXPECT_EQ(off32.host_bytes - off.host_bytes, 4 * off.owned_parameters);
  EXPECT_EQ(off.steady_bytes, off32.steady_bytes);  // the device holds no moment
}

TEST(MemoryModel, OffloadMovesMasterAndMomentsToTheHost) {
  Config c = preset("moe-1b");
  const train::MemoryModel on_device = train::predict_memory(c);
  c.train.offload_optimizer = true;
  const train::MemoryModel off = train::predict_memory(c);
  EXPECT_EQ(on_device.host_bytes, 0);
  EXPECT_EQ(off.host_bytes, off.parameter_bytes + off.optimizer_bytes + off.staging_bytes);
  // The device keeps f32 copies only of what forward reads in f32 (norms, the embedding
  // table, the f32 routers): far less than the masters it gave up.
  EXPECT_GT(off.device_f32_bytes, 0);
  EXPECT_LT(off.device_f32_bytes, off.parameter_bytes / 4);
  EXPECT_EQ(on_device.steady_bytes - off.steady_bytes,
            on_device.parameter_bytes + on_device.optimizer_bytes - off.device_f32_bytes);
  EXPECT_NE(train::memory_table(off).find("= pinned host memory (offload)"), std::string::npos);
  // f32 compute reads every weight in f32: the device keeps a copy of each.
  c.train.dtype = "f32";
  EXPECT_EQ(train::predict_memory(c).device_f32_bytes, off.parameter_bytes);
}

TEST(MemoryModel, TensorParallelShardsTheAttentionAndDenseFfn) {
  // moe-1b with a dense first layer at tp 2: wq, wk, wv, wo and the dense FFN are halved; the
  // routed experts stay whole (ep 1), the replicated parameters too.
  Config c = preset("moe-1b");
  c.model.first_dense_layers = 1;
  c.parallel.tp = 2;
  c.parallel.ep = 2;
  const train::MemoryModel tp2 = train::predict_memory(c, {.world = 2});
  c.parallel.tp = 1;
  const train::MemoryModel tp1 = train::predict_memory(c, {.world = 2});
  const int64_t d = c.model.d_model;
  const int64_t sharded = c.model.num_layers * 4 * d * d + 3 * d * c.model.dense_hidden;
  EXPECT_EQ(tp1.parameters - tp2.parameters, sharded / 2);
  // Every rank of a tp group holds 1/2 of the micro-batch's tokens in its residual stream.
  EXPECT_LT(tp2.activation_peak_bytes, tp1.activation_peak_bytes);
  const std::string e = xmoe::testing::error_of([&] {
    c.parallel.tp = 2;
    c.parallel.ssmb = false;
    c.parallel.ep = 4;
    train::predict_memory(c, {.world = 4});
  });
  EXPECT_NE(e.find("2 ranks do not split into parallel.ep = 4"), std::string::npos) << e;
  EXPECT_NE(e.find("parallel.ssmb = false"), std::string::npos) << e;
}

TEST(MemoryModel, ZeroDividesTheOptimizerState) {
  Config c = preset("moe-1b");
  c.parallel.ep = 2;
  const train::MemoryModel z0 = train::predict_memory(c, {.world = 8});
  c.parallel.zero = 1;
  const train::MemoryModel z1 = train::predict_memory(c, {.world = 8});
  c.parallel.zero = 2;
  const train::MemoryModel z2 = train::predict_memory(c, {.world = 8});
  EXPECT_EQ(z0.parameters, z1.parameters);
  // Dense moments over 8 ranks, expert ones over dp = 4: between 1/8 and 1/4 of zero 0's.
  EXPECT_LT(z1.optimizer_bytes * 4, z0.optimizer_bytes + 8 * 8 * 8);
  EXPECT_GT(z1.optimizer_bytes * 8, z0.optimizer_bytes - 8 * 8 * 8);
  EXPECT_EQ(z1.gradient_bytes, z0.gradient_bytes);
  // With bf16 compute the f32 masters of the matrices shard like their moments (4 of the 8
  // bytes per owned element); the embedding table (read in f32) and the norms stay whole.
  const int64_t embedding = 4 * c.model.vocab_size * c.model.d_model;
  EXPECT_GT(z1.parameter_bytes, embedding);
  EXPECT_LT(z1.parameter_bytes - embedding, z1.optimizer_bytes / 2);
  EXPECT_GT(z1.parameter_bytes - embedding, z1.optimizer_bytes / 2 - embedding / 8 - 8 * 8 * 8);
  EXPECT_EQ(z2.parameter_bytes, z1.parameter_bytes);
  EXPECT_EQ(z1.steady_bytes + (z0.parameter_bytes - z1.parameter_bytes) +
                (z0.optimizer_bytes - z1.optimizer_bytes),
            z0.steady_bytes);
  // zero 2 holds no gradient between steps, and its whole gradients only from their module's
  // backward to their bucket's reduce-scatter: its peak is below zero 1's.
  EXPECT_EQ(z2.gradient_bytes, 0);
  EXPECT_LT(z2.steady_bytes, z1.steady_bytes);
  EXPECT_LT(z2.peak_bytes, z1.peak_bytes);
  c.parallel.overlap_grad_sync = false;
  const train::MemoryModel z2_after = train::predict_memory(c, {.world = 8});
  // (Here the peak is early in backward, where the overlapped run already holds the first
  // buckets' shards: within one bucket's shards of the other.)
  EXPECT_LE(z2.peak_bytes, z2_after.peak_bytes + (int64_t{32} << 20));
  std::printf(
      "[memory] moe-1b, 8 ranks, ep 2: peak zero 1 %.2f GiB, zero 2 %.2f GiB (%.2f GiB "
      "with the reduce-scatters after backward)\n",
      static_cast<double>(z1.peak_bytes) / (1 << 30),
      static_cast<double>(z2.peak_bytes) / (1 << 30),
      static_cast<double>(z2_after.peak_bytes) / (1 << 30));
  // bf16 compute on CUDA: the compute copies of the matrices (not of the looked-up embedding).
  EXPECT_GT(z0.compute_copy_bytes, 0);
  EXPECT_LT(z0.compute_copy_bytes, z0.parameter_bytes / 2);
  EXPECT_NE(train::memory_table(z2).find("gradient shards from sync to update (zero 2"),
            std::string::npos);
}

TEST(MemoryModel, RefusesAnImpossibleLayout) {
  Config c = preset("tiny");
  c.parallel.ep = 4;
  const std::string e = xmoe::testing::error_of([&] { train::predict_memory(c, {.world = 6}); });
  EXPECT_NE(e.find("6 ranks do not split into parallel.ep = 4"), std::string::npos) << e;
}
