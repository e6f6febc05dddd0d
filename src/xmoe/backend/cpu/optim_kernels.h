#pragma once
// CPU kernels of the optimizer ops (ops/optim.h): plain functions on raw pointers, the reference
// of backend/cuda/optim_kernels.h. Master weights are f32; gradients and moments f32 or bf16.
#include <cstdint>

#include "xmoe/core/dtype.h"

namespace xmoe::cpu {

// AdamW on one parameter of n elements, in place, per element:
//   g = float(grad) * grad_scale;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g g
//   p = p * decay - lr * (m / bc1) / (sqrt(v / bc2) + eps)
// (decay = 1 - lr * weight_decay, or 1 without weight decay; bc = 1 - beta^t).
// `grad` is f32 or bf16 (grad_bf16), m and v both f32 or both bf16 (moments_bf16,
// train.adam_moments_dtype: widened, computed in f32 as above and used unrounded for this
// step's p, then stored rounded to nearest even). `param_bf16` (may be null): also written with
// bf16(p), in the same pass. One pass over the five arrays, vectorised (the file is built with
// -fno-math-errno: sqrt is the instruction, the same correctly rounded result) and split over
// the OpenMP threads.
void adamw_update(float* param, const void* grad, bool grad_bf16, void* m, void* v,
                  bool moments_bf16, bf16* param_bf16, int64_t n, float lr, float beta1,
                  float beta2, float eps, float bc1, float bc2, float decay, float grad_scale);

// dst[i] = src[i] * s over n elements, each array f32 or bf16 (bf16 rounded once); s == 1 is a
// plain copy (widened or rounded where the dtypes differ).
// Split over the OpenMP threads when long.
void copy_scaled(void* dst, bool dst_bf16, const void* src, bool src_bf16, int64_t n, float s);

}  // namespace xmoe::cpu
