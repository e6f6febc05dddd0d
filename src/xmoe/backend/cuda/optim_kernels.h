#pragma once
// CUDA launchers of the optimizer step (optim.cu): multi-tensor AdamW, sum of squares, scaling and
// scaled copies over lists of f32 device arrays (gradients may be bf16: FloatArray). A list of any
// length is cut into launches of up to kMultiTensorMax tensors (the pointers travel as kernel
// arguments, so nothing is copied to the device and nothing waits). Plain header: the C++ compiler
// (optim/, parallel/) and nvcc both include it; a build without CUDA links
// backend/cuda_stub/optim_kernels_stub.cpp.
#include <cstddef>
#include <cstdint>

#include "xmoe/backend/cuda/runtime.h"

namespace xmoe::cuda {

/// Tensors per launch of a multi-tensor kernel.
constexpr int kMultiTensorMax = 48;

/// A device array of n f32 or bf16 elements: a gradient (bf16 with model.moe.expert_grad_dtype)
/// or a staging buffer.
struct FloatArray {
  void* data = nullptr;
  int64_t n = 0;
  bool bf16 = false;
};

/// One parameter of a multi-tensor AdamW step: device arrays of n elements, f32 but for grad
/// and the moments.
struct AdamWTensor {
  float* param = nullptr;
  const void* grad = nullptr;
  bool grad_bf16 = false;
  void* m = nullptr;
  void* v = nullptr;
  bool moments_bf16 = false;   ///< m and v bf16 (train.adam_moments_dtype), else f32
  void* param_bf16 = nullptr;  ///< bf16 copy of param, rewritten from the update; or null
  int64_t n = 0;
  bool decay = false;  ///< apply the decoupled weight decay
};

/// The step's scalars, computed on the host exactly as the CPU AdamW computes them.
struct AdamWScalars {
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0;
  float one_minus_beta1 = 0, one_minus_beta2 = 0;  ///< 1.f - beta (f32, as the CPU)
  float bc1 = 1, bc2 = 1;                          ///< 1 - beta^t (double, rounded to f32)
  float decay = 1;                                 ///< 1 - lr * weight_decay
  float grad_scale = 1;                            ///< g = grad * grad_scale (the clip factor)
};

// Per element, in the CPU's operation order with IEEE round-to-nearest (no FMA contraction):
//   g = float(grad) * grad_scale;  m = b1 m + (1 - b1) g;  v = b2 v + ((1 - b2) g) g
//   p = p * decay - (lr * (m / bc1)) / (sqrt(v / bc2) + eps);  param_bf16 = bf16(p)
// bf16 moments are widened, and stored rounded to nearest even after p used the f32 m, v.
void adamw_step(const AdamWTensor* tensors, int64_t count, const AdamWScalars& s, Stream stream);

/// Bytes of device workspace multi_sum_squares needs for these arrays.
size_t multi_sum_squares_workspace_bytes(const FloatArray* xs, int64_t count);
/// *result (one device double) = sum over the arrays of sum x^2. Deterministic: per-block
/// partials in double over fixed chunks, then one block adds them in a fixed tree.
void multi_sum_squares(double* result, const FloatArray* xs, int64_t count, void* workspace,
                       Stream stream);
/// x *= s for each array (bf16 rounded once).
void multi_scale(const FloatArray* xs, int64_t count, float s, Stream stream);
/// dst[i] = src[i] * s for each pair of arrays of the same n, any dtypes (gradient bucket pack
/// and unpack).
void multi_copy_scaled(const FloatArray* dst, const FloatArray* src, int64_t count, float s,
                       Stream stream);

}  // namespace xmoe::cuda
