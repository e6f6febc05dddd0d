#pragma once
// The optimizer ops: the AdamW update and the multi-tensor sum of squares, scaling and scaled
// copy of tensor lists (gradients, gradient buckets). Same conventions as ops.h: each op checks
// its arguments (messages name the op) and dispatches on the device of the list, whose tensors
// are all on one device. On CUDA each op is one fused kernel per up to 48 tensors
// (backend/cuda/optim_kernels.h): the pointers travel as kernel arguments, so nothing is copied
// to the device and nothing waits. On the CPU the tensors are visited in order
// (backend/cpu/optim_kernels.h, or the ops of ops.h). Lists may be empty.
#include <span>

#include "xmoe/core/tensor.h"

namespace xmoe::ops {

/// One parameter of adamw_step.
struct AdamWTensors {
  Tensor param;        ///< f32 master weights, updated in place
  Tensor grad;         ///< f32 or bf16, param's numel
  Tensor m, v;         ///< moments, param's numel, updated in place; f32 or bf16, one dtype
                       ///< for the whole list
  Tensor param_bf16;   ///< bf16 copy of param rewritten from the update; or undefined
  bool decay = false;  ///< apply the decoupled weight decay
};

/// The step's scalars.
struct AdamWStep {
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  float bc1 = 1, bc2 = 1;  ///< 1 - beta^t (computed in double, rounded to f32)
  float grad_scale = 1;    ///< g = grad * grad_scale (the clip factor)
};

/// One AdamW update of every tensor, per element in this operation order (IEEE rounding, the
/// same formula on both devices):
///   g = float(grad) * grad_scale;  m = b1 m + (1 - b1) g;  v = b2 v + ((1 - b2) g) g
///   p = p * decay - (lr * (m / bc1)) / (sqrt(v / bc2) + eps);  param_bf16 = bf16(p)
/// decay = 1 - lr * weight_decay where AdamWTensors::decay, else 1. bf16 moments
/// (train.adam_moments_dtype) are read widened, m and v computed in f32 as above and used for p
/// unrounded, then stored rounded to nearest even.
void adamw_step(std::span<const AdamWTensors> tensors, const AdamWStep& step);

/// f64 [1] on the list's device (the CPU for an empty list): the sum over xs (f32 or bf16) of
/// sum x^2. Deterministic: the CPU adds sum_squares(x) in list order; CUDA adds per-block
/// partials over fixed chunks in a fixed tree. Nothing waits.
Tensor multi_sum_squares(std::span<const Tensor> xs);
/// x *= s for every x of xs (f32 or bf16, bf16 rounded once).
void multi_scale_(std::span<Tensor> xs, float s);
/// dst[i] = src[i] * s for each pair of tensors of one numel, each f32 or bf16 (bf16 rounded
/// once; s = 1 copies, widening or rounding where the dtypes differ).
void multi_copy_scaled(std::span<Tensor> dst, std::span<const Tensor> src, float s);

}  // namespace xmoe::ops
