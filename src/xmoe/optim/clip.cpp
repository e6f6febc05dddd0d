#include "xmoe/optim/clip.h"

#include <cmath>

#include "xmoe/core/profile.h"
#include "xmoe/ops/ops.h"
#include "xmoe/ops/optim.h"

namespace xmoe::optim {

namespace {

/// The device of the gradients (all on one device), or cpu for an empty list.
Device grads_device(const std::vector<Parameter*>& params) {
  if (params.empty()) return Device::cpu();
  const Device d = params[0]->grad.device();
  for (const Parameter* p : params)
    XMOE_CHECK(
        p->grad.device() == d && (p->grad.dtype() == DType::f32 || p->grad.dtype() == DType::bf16),
        "[grad_norm] {} has grad {} but {} has {}: gradients must be f32 or bf16 on one "
        "device",
        p->name, p->grad.str(), params[0]->name, params[0]->grad.str());
  return d;
}

std::vector<Tensor> grads_of(const std::vector<Parameter*>& params) {
  std::vector<Tensor> out;
  out.reserve(params.size());
  for (const Parameter* p : params) out.push_back(p->grad);
  return out;
}

}  // namespace

Tensor grad_sum_squares_device(const std::vector<Parameter*>& params) {
  settle_grads(params);
  const Device d = grads_device(params);
  XMOE_CHECK(d.is_cuda(), "[grad_norm] grad_sum_squares_device needs CUDA gradients, got {}",
             d.str());
  return ops::multi_sum_squares(grads_of(params));
}

double grad_sum_squares(const std::vector<Parameter*>& params) {
  settle_grads(params);
  const Device d = grads_device(params);
  ProfileScope scope("optim.grad_norm", d);
  return ops::multi_sum_squares(grads_of(params)).item();  // CUDA: reduced there, read once
}

double grad_norm(const std::vector<Parameter*>& params) {
  return std::sqrt(grad_sum_squares(params));
}

float clip_factor(double norm, float max_norm) {
  if (max_norm <= 0 || !std::isfinite(norm) || norm <= max_norm) return 1.0f;
  return static_cast<float>(static_cast<double>(max_norm) / norm);
}

void scale_grads(const std::vector<Parameter*>& params, float s) {
  if (s == 1.0f) return;
  settle_grads(params);
  const Device d = grads_device(params);
  ProfileScope scope("optim.clip", d);
  std::vector<Tensor> grads = grads_of(params);
  ops::multi_scale_(grads, s);
}

double clip_grad_norm(const std::vector<Parameter*>& params, float max_norm) {
  const double norm = grad_norm(params);
  scale_grads(params, clip_factor(norm, max_norm));
  return norm;
}

bool grads_finite(const std::vector<Parameter*>& params) {
  return first_nonfinite_grad(params).empty();
}

std::string first_nonfinite_grad(const std::vector<Parameter*>& params) {
  for (const Parameter* p : params)
    if (!ops::all_finite(p->grad)) return p->name;
  return "";
}

}  // namespace xmoe::optim
