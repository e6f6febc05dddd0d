#include "xmoe/optim/adamw.h"

#include <cmath>
#include <set>

#include "xmoe/core/profile.h"
#include "xmoe/ops/optim.h"

namespace xmoe::optim {

AdamWConfig AdamWConfig::from(const TrainConfig& t) {
  return {t.beta1, t.beta2, t.adam_eps, t.weight_decay};
}

namespace {

std::vector<AdamWPiece> whole_pieces(const std::vector<Parameter*>& params) {
  std::vector<AdamWPiece> out;
  for (Parameter* p : params) out.emplace_back(p);
  return out;
}

/// t as one flat [numel] view.
Tensor flat(const Tensor& t) {
  return t.reshape({t.numel()});
}

}  // namespace

AdamW::AdamW(std::vector<Parameter*> params, AdamWConfig cfg) : AdamW(whole_pieces(params), cfg) {}

AdamW::AdamW(std::span<const AdamWPiece> pieces, AdamWConfig cfg)
    : pieces_(pieces.begin(), pieces.end()), cfg_(cfg) {
  XMOE_CHECK(cfg.beta1 >= 0 && cfg.beta1 < 1, "[adamw] beta1 = {} must be in [0, 1)", cfg.beta1);
  XMOE_CHECK(cfg.beta2 >= 0 && cfg.beta2 < 1, "[adamw] beta2 = {} must be in [0, 1)", cfg.beta2);
  XMOE_CHECK(cfg.eps > 0, "[adamw] eps = {} must be positive", cfg.eps);
  XMOE_CHECK(cfg.weight_decay >= 0, "[adamw] weight_decay = {} must be >= 0", cfg.weight_decay);
  std::set<std::string> names;
  if (!pieces_.empty() && pieces_[0].param) device_ = pieces_[0].param->value.device();
  for (AdamWPiece& piece : pieces_) {
    Parameter* p = piece.param;
    XMOE_CHECK(p && p->value.defined(), "[adamw] undefined parameter");
    params_.push_back(p);
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
    const int64_t n = p->value.numel();
    if (piece.count < 0) piece.count = n;
    XMOE_CHECK(piece.offset >= 0 && piece.count >= 0 && piece.offset + piece.count <= n,
               "[adamw] {}: piece [{}, {}) outside its {} elements", p->name, piece.offset,
               piece.offset + piece.count, n);
    if (piece.grad.defined())
      XMOE_CHECK(piece.grad.numel() == piece.count && piece.grad.device() == device_ &&
                     (piece.grad.dtype() == DType::f32 || piece.grad.dtype() == DType::bf16),
                 "[adamw] {}: the piece's grad is {}, expected {} f32 or bf16 values on {}",
                 p->name, piece.grad.str(), piece.count, device_.str());
    // A whole piece keeps the parameter's shape (the exported state's); a part is flat.
    const Shape shape = piece.whole() ? p->value.shape() : Shape{piece.count};
    sharded_ = sharded_ || !piece.whole();
    m_.push_back(Tensor::zeros(shape, DType::f32, device_));
    v_.push_back(Tensor::zeros(shape, DType::f32, device_));
  }
}

int64_t AdamW::state_bytes() const {
  int64_t bytes = 0;
  for (size_t i = 0; i < m_.size(); ++i)
    bytes += static_cast<int64_t>(m_[i].nbytes() + v_[i].nbytes());
  return bytes;
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
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const AdamWPiece& piece = pieces_[i];
    Parameter& p = *piece.param;
    // A piece with its own gradient (a zero 2 shard) may have released the parameter's.
    XMOE_CHECK(p.value.device() == device_ && (!p.grad.defined() || p.grad.device() == device_),
               "[adamw] {} moved to {} after the optimizer was built on {}", p.name,
               p.value.device().str(), device_.is_cpu() ? "the CPU" : device_.str());
    if (p.compute_copy.defined())
      XMOE_CHECK(p.compute_copy.dtype() == DType::bf16 && p.compute_copy.device() == device_ &&
                     p.compute_copy.numel() == p.value.numel(),
                 "[adamw] {}: compute copy {} does not match value {}", p.name,
                 p.compute_copy.str(), p.value.str());
    if (piece.whole()) {
      list.push_back({p.value, p.grad, m_[i], v_[i], p.compute_copy, p.weight_decay});
      continue;
    }
    const int64_t a = piece.offset, b = piece.offset + piece.count;
    list.push_back({flat(p.value).rows(a, b),
                    piece.grad.defined() ? piece.grad : flat(p.grad).rows(a, b), m_[i], v_[i],
                    p.compute_copy.defined() ? flat(p.compute_copy).rows(a, b) : Tensor(),
                    p.weight_decay});
  }
  ops::adamw_step(list, s);
}

void AdamW::zero_grad() {
  for (Parameter* p : params_) p->zero_grad();
}

void AdamW::export_state(std::map<std::string, Tensor>& out) const {
  XMOE_CHECK(!sharded_,
             "[adamw] export_state: the moments are sharded over ranks (parallel.zero >= 1); "
             "gather them into whole tensors first");
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
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const int64_t a = pieces_[i].offset, b = a + pieces_[i].count;
    m_[i].copy_from(flat(ms[i]->to(Device::cpu())).rows(a, b).reshape(m_[i].shape()));
    v_[i].copy_from(flat(vs[i]->to(Device::cpu())).rows(a, b).reshape(v_[i].shape()));
  }
  step_ = s;
}

}  // namespace xmoe::optim
