// The memory model of a step (train/memory_model.h) against the CUDA allocator on one GPU:
// bf16 compute (f32 master weights, gradients and moments, bf16 compute copies), the peak inside
// a step within 10% and the bytes live between steps within 1% of the prediction; with the
// optimizer offloaded, the device's bytes without the masters and moments, and the pinned host
// memory within 1%; zero 1 and 2 (the masters of bf16-copied parameters in the optimizer's
// pieces), the master bytes exactly.
#include <gtest/gtest.h>

#include "cuda_testing.h"
#include "memory_model_fixture.h"

using namespace xmoe;
using CudaMemoryModelTest = xmoe::testing::MemoryModelTest;

TEST_F(CudaMemoryModelTest, TinyPresetOnTheGpu) {
  XMOE_REQUIRE_CUDA();
  Config c = tiny();
  c.train.device = "cuda";
  expect_predicted(c, "tiny, cuda bf16");
  c.model.recompute = {"attention", "moe"};
  c.train.out_dir = (root_ / "run-recompute").string();
  expect_predicted(c, "tiny, cuda bf16, recompute");
  // zero 1 and 2 on one GPU: the matrices' f32 masters move into the optimizer's pieces (the
  // one shard is the whole) and the parameters keep their bf16 copies.
  c.model.recompute = {};
  for (int zero : {1, 2}) {
    c.parallel.zero = zero;
    c.train.out_dir = (root_ / fmt::format("run-zero{}", zero)).string();
    expect_predicted(c, fmt::format("tiny, cuda bf16, zero {}", zero));
  }
}

TEST_F(CudaMemoryModelTest, MoE1bShapeOnTheGpu) {
  XMOE_REQUIRE_CUDA();
  Config c = moe_1b_shape();
  expect_predicted(c, "moe-1b shape, 4 layers");
  c.model.moe.expert_grad_dtype = "bf16";
  c.train.out_dir = (root_ / "run-bf16-grads").string();
  expect_predicted(c, "moe-1b shape, bf16 expert grads");
}

TEST_F(CudaMemoryModelTest, OffloadedOptimizerOnTheGpu) {
  XMOE_REQUIRE_CUDA();
  Config c = tiny();
  c.train.device = "cuda";
  c.train.offload_optimizer = true;
  expect_predicted(c, "tiny, cuda bf16, offload");
  // zero 1: the pinned host holds the optimizer pieces' masters, not the parameters' values.
  c.parallel.zero = 1;
  c.train.out_dir = (root_ / "run-offload-zero1").string();
  expect_predicted(c, "tiny, cuda bf16, offload, zero 1");
  c.parallel.zero = 0;
  // f32 compute: the device keeps an f32 copy of every weight.
  c.train.dtype = "f32";
  c.train.out_dir = (root_ / "run-f32").string();
  expect_predicted(c, "tiny, cuda f32, offload");
  // bf16 expert gradients (2-byte staging) on moe-1b's layer shape.
  Config big = moe_1b_shape();
  big.train.out_dir = (root_ / "run-moe-1b").string();
  big.model.moe.expert_grad_dtype = "bf16";
  big.train.offload_optimizer = true;
  expect_predicted(big, "moe-1b shape, offload");
}
