#include "xmoe/optim/clip.h"

#include <cmath>

#include "xmoe/ops/ops.h"

namespace xmoe::optim {

double grad_sum_squares(const std::vector<Parameter*>& params) {
  double s = 0.0;
  for (const Parameter* p : params) s += ops::sum_squares(p->grad);
  return s;
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
  for (Parameter* p : params) ops::scale_(p->grad, s);
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
