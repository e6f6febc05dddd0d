#include "xmoe/optim/adamw.h"

#include <cmath>
#include <set>

#include "xmoe/backend/cuda/optim_kernels.h"
#include "xmoe/core/profile.h"

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
               "{}", p->name, p->value.str(), p->grad.str());
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
  const float b1 = cfg_.beta1, b2 = cfg_.beta2, eps = cfg_.eps;
  const double t = static_cast<double>(step_);
  const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), t));
  const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), t));
  if (device_.is_cuda()) {
    step_cuda(lr, bc1, bc2, grad_scale);
    return;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    XMOE_CHECK(p.value.is_cpu() && p.grad.is_cpu(),
               "[adamw] {} moved to {} after the optimizer was built on the CPU", p.name,
               p.value.device().str());
    const float decay = p.weight_decay ? 1.0f - lr * cfg_.weight_decay : 1.0f;
    float* w = p.value.data<float>();
    float* m = m_[i].data<float>();
    float* v = v_[i].data<float>();
    const int64_t n = p.value.numel();
    auto update = [&](const auto* g) {
#pragma omp parallel for simd schedule(static) if (n > (1 << 15))
      for (int64_t j = 0; j < n; ++j) {
        const float gj = static_cast<float>(g[j]) * grad_scale;
        m[j] = b1 * m[j] + (1.f - b1) * gj;
        v[j] = b2 * v[j] + (1.f - b2) * gj * gj;
        const float mhat = m[j] / bc1, vhat = v[j] / bc2;
        w[j] = w[j] * decay - lr * mhat / (std::sqrt(vhat) + eps);
      }
    };
    if (p.grad.dtype() == DType::bf16) {
      update(p.grad.data<bf16>());
    } else {
      update(p.grad.data<float>());
    }
  }
}

void AdamW::step_cuda(float lr, float bc1, float bc2, float grad_scale) {
  // One fused update of every parameter (a launch per kMultiTensorMax tensors), the same
  // formula and operation order as the CPU loop above; bf16 copies are rewritten in passing.
  cuda::AdamWScalars s;
  s.lr = lr;
  s.beta1 = cfg_.beta1;
  s.beta2 = cfg_.beta2;
  s.eps = cfg_.eps;
  s.one_minus_beta1 = 1.f - cfg_.beta1;
  s.one_minus_beta2 = 1.f - cfg_.beta2;
  s.bc1 = bc1;
  s.bc2 = bc2;
  s.decay = 1.0f - lr * cfg_.weight_decay;
  s.grad_scale = grad_scale;
  std::vector<cuda::AdamWTensor> list;
  list.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    XMOE_CHECK(p.value.device() == device_ && p.grad.device() == device_,
               "[adamw] {} moved to {} after the optimizer was built on {}", p.name,
               p.value.device().str(), device_.str());
    cuda::AdamWTensor t;
    t.param = p.value.data<float>();
    t.grad = p.grad.raw();
    t.grad_bf16 = p.grad.dtype() == DType::bf16;
    t.m = m_[i].data<float>();
    t.v = v_[i].data<float>();
    if (p.compute_copy.defined()) {
      XMOE_CHECK(p.compute_copy.dtype() == DType::bf16 && p.compute_copy.device() == device_ &&
                     p.compute_copy.numel() == p.value.numel(),
                 "[adamw] {}: compute copy {} does not match value {}", p.name,
                 p.compute_copy.str(), p.value.str());
      t.param_bf16 = p.compute_copy.raw();
    }
    t.n = p.value.numel();
    t.decay = p.weight_decay;
    list.push_back(t);
  }
  cuda::adamw_step(list.data(), static_cast<int64_t>(list.size()), s,
                   cuda::activate(device_.index));
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
