#include "xmoe/optim/adamw.h"

#include <cmath>
#include <set>

#include "xmoe/core/profile.h"
#include "xmoe/ops/optim.h"

namespace xmoe::optim {

AdamWConfig AdamWConfig::from(const TrainConfig& t) {
  return {t.beta1, t.beta2, t.adam_eps, t.weight_decay};
}

AdamW::AdamW(std::vector<Parameter*> params, AdamWConfig cfg)
    : params_(std::move(params)), cfg_(cfg) {
  XMOE_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1, "[adamw] beta1 = {} must be in [0, 1)", cfg.beta1);
  XMOE_CHECK(cfg.beta2 >= 0 && cfg.beta2 < 1, "[adamw] beta2 = {} must be in [0, 1)", cfg.beta2);
  XMOE_CHECK(cfg.eps > 0, "[adamw] eps = {} must be positive", cfg.eps);
  XMOE_CHECK(cfg.weight_decay >= 0, "[adamw] weight_decay = {} must be >= 0", cfg.weight_decay);
  std::set<std::string> names;
  if (!params_.empty() && params_[0]) device_ = params_[0]->value.device();
  for (Parameter* p : params_) {
    XMOE_CHECK(p && p->value.defined(), "[adamw] undefined parameter");
    XMOE_CHECK(names.insert(p->name).second, "[adamw] parameter name '{}' appears twice", p->name);
    check_shape(p->grad, p->value.shape(), "adamw", p->name.c_str());
    XMOE_CHECK(p->value.dtype() == DType::f32 &&
                   (p->grad.dtype() == DType::f32 || p->grad.dtype() == DType::bf16),
               "[adamw] {}: value must be f32 (master weights) and grad f32 or bf16, got {} and "
               "{}",
               p->name, p->value.str(), p->grad.str());
    XMOE_CHECK(p->value.device() == device_ && p->grad.device() == device_,
               "[adamw] {} is on {} (grad on {}) but the first parameter is on {}: all parameters "
               "of an optimizer must be on one device",
               p->name, p->value.device().str(), p->grad.device().str(), device_.str());
    m_.push_back(Tensor::zeros(p->value.shape(), DType::f32, device_));
    v_.push_back(Tensor::zeros(p->value.shape(), DType::f32, device_));
  }
}

void AdamW::step(float lr, float grad_scale) {
  ProfileScope scope("optim.adamw", device_);
  settle_grads(params_);
  ++step_;
  const double t = static_cast<double>(step_);
  ops::AdamWStep s;
  s.lr = lr;
  s.beta1 = cfg_.beta1;
  s.beta2 = cfg_.beta2;
  s.eps = cfg_.eps;
  s.weight_decay = cfg_.weight_decay;
  s.bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(cfg_.beta1), t));
  s.bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(cfg_.beta2), t));
  s.grad_scale = grad_scale;
  // One update of every parameter: on CUDA one fused multi-tensor kernel (a launch per 48
  // tensors), the CPU loop's formula in its operation order; bf16 copies rewritten in passing.
  std::vector<ops::AdamWTensors> list;
  list.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    XMOE_CHECK(p.value.device() == device_ && p.grad.device() == device_,
               "[adamw] {} moved to {} after the optimizer was built on {}", p.name,
               p.value.device().str(), device_.is_cpu() ? "the CPU" : device_.str());
    if (p.compute_copy.defined())
      XMOE_CHECK(p.compute_copy.dtype() == DType::bf16 && p.compute_copy.device() == device_ &&
                     p.compute_copy.numel() == p.value.numel(),
                 "[adamw] {}: compute copy {} does not match value {}", p.name,
                 p.compute_copy.str(), p.value.str());
    list.push_back({p.value, p.grad, m_[i], v_[i], p.compute_copy, p.weight_decay});
  }
  ops::adamw_step(list, s);
}

void AdamW::zero_grad() {
  for (Parameter* p : params_) p->zero_grad();
}

void AdamW::export_state(std::map<std::string, Tensor>& out) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    out[params_[i]->name + ".adam_m"] = m_[i];
    out[params_[i]->name + ".adam_v"] = v_[i];
  }
  out[kStepKey] = Tensor::from_vector<int64_t>({step_}, {1});
}

void AdamW::import_state(const std::map<std::string, Tensor>& in) {
  auto find = [&](const std::string& key, const Shape& shape, DType dtype) -> const Tensor& {
    auto it = in.find(key);
    XMOE_CHECK(it != in.end(), "[adamw] state has no tensor '{}'", key);
    XMOE_CHECK(it->second.dtype() == dtype && it->second.shape() == shape,
               "[adamw] state tensor '{}' is {}{}, expected {}{}", key,
               dtype_name(it->second.dtype()), shape_str(it->second.shape()), dtype_name(dtype),
               shape_str(shape));
    return it->second;
  };
  // Validate everything before changing anything.
  const Tensor& step = find(kStepKey, {1}, DType::i64);
  std::vector<const Tensor*> ms, vs;
  for (Parameter* p : params_) {
    ms.push_back(&find(p->name + ".adam_m", p->value.shape(), DType::f32));
    vs.push_back(&find(p->name + ".adam_v", p->value.shape(), DType::f32));
  }
  const int64_t s = step.to_vector<int64_t>()[0];
  XMOE_CHECK(s >= 0, "[adamw] state step = {} is negative", s);
  for (size_t i = 0; i < params_.size(); ++i) {
    m_[i].copy_from(ms[i]->to(Device::cpu()));
    v_[i].copy_from(vs[i]->to(Device::cpu()));
  }
  step_ = s;
}

}  // namespace xmoe::optim
