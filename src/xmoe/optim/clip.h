#pragma once
// Gradient norms, clipping and the non-finite check. With several ranks, the trainer sums
// grad_sum_squares over the ranks that hold different parameters (expert shards) first and
// then calls scale_grads with the factor clip_factor gives.
#include <string>
#include <vector>

#include "xmoe/core/parameter.h"

namespace xmoe::optim {

/// Sum of squares of all gradient elements (double accumulation, parameter order). CUDA
/// gradients: grad_sum_squares_device, then one host read.
double grad_sum_squares(const std::vector<Parameter*>& params);
/// The same sum as a device f64 [1] tensor (CUDA gradients, all on one device): one
/// deterministic multi-tensor reduction, nothing waits. For a collective over the ranks first.
Tensor grad_sum_squares_device(const std::vector<Parameter*>& params);
/// sqrt(grad_sum_squares).
double grad_norm(const std::vector<Parameter*>& params);
/// The factor that brings a gradient of norm `norm` to at most `max_norm`: max_norm / norm if
/// norm > max_norm, else 1. max_norm <= 0 disables clipping (factor 1).
float clip_factor(double norm, float max_norm);
/// Multiplies every gradient by s (CUDA: one multi-tensor launch per 48 tensors).
void scale_grads(const std::vector<Parameter*>& params, float s);
/// Clips the global gradient norm to max_norm (<= 0: no clipping) and returns the norm before
/// clipping. A non-finite norm is returned as is and the gradients are left unchanged.
double clip_grad_norm(const std::vector<Parameter*>& params, float max_norm);
/// True if every gradient element is finite.
bool grads_finite(const std::vector<Parameter*>& params);
/// Name of the first parameter with a non-finite gradient element, or "" if none.
std::string first_nonfinite_grad(const std::vector<Parameter*>& params);

}  // namespace xmoe::optim
