#include "xmoe/optim/adamw.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include "xmoe/core/profile.h"
#include "xmoe/ops/optim.h"

namespace xmoe::optim {

AdamWConfig AdamWConfig::from(const TrainConfig& t) {
  AdamWConfig c;
  c.beta1 = t.beta1;
  c.beta2 = t.beta2;
  c.eps = t.adam_eps;
  c.weight_decay = t.weight_decay;
  c.offload = t.offload_optimizer;
  c.offload_whole_grads = t.offload_overlap;
  c.delayed_from = t.offload_delayed_update_from;
  XMOE_CHECK(t.adam_moments_dtype == "f32" || t.adam_moments_dtype == "bf16",
             "[adamw] train.adam_moments_dtype = \"{}\" is not f32 or bf16", t.adam_moments_dtype);
  c.moments_dtype = t.adam_moments_dtype == "bf16" ? DType::bf16 : DType::f32;
  return c;
}

AdamWConfig AdamWConfig::for_run(const TrainConfig& t, bool grads_final_after_backward) {
  AdamWConfig c = from(t);
  c.offload_whole_grads =
      c.offload_whole_grads && (grads_final_after_backward || c.delayed_from >= 0);
  return c;
}

namespace {

std::vector<AdamWPiece> whole_pieces(const std::vector<Parameter*>& params) {
  std::vector<AdamWPiece> out;
  for (Parameter* p : params) out.emplace_back(p);
  return out;
}

/// A moment as exported: itself when f32; bf16 widened (exactly) on the host, so that the
/// device holds no f32 copy of it.
Tensor moment_f32(const Tensor& moment) {
  if (moment.dtype() == DType::f32) return moment;
  return (moment.is_cpu() ? moment : moment.to(Device::cpu())).to(DType::f32);
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
  XMOE_CHECK(cfg.moments_dtype == DType::f32 || cfg.moments_dtype == DType::bf16,
             "[adamw] moments_dtype = {} must be f32 or bf16", dtype_name(cfg.moments_dtype));
  XMOE_CHECK(cfg.delayed_from < 0 || (cfg.offload && cfg.offload_whole_grads),
             "[adamw] the delayed update (delayed_from = {}) needs offload with whole host "
             "gradient buffers (train.offload_optimizer, train.offload_overlap)",
             cfg.delayed_from);
  XMOE_CHECK(cfg.offload_group_numel > 0, "[adamw] offload_group_numel = {} must be positive",
             cfg.offload_group_numel);
  std::set<std::string> names;
  if (!pieces_.empty() && pieces_[0].param) {
    const AdamWPiece& first = pieces_[0];
    // Offloaded, the values live on the host and the gradients on the compute device.
    compute_device_ = first.grad.defined() ? first.grad.device() : first.param->device();
    device_ = cfg.offload ? Device::cpu() : first.param->value.device();
  }
  const bool pinned = cfg.offload && compute_device_.is_cuda();
  auto host_zeros = [&](const Shape& shape, DType dtype) {
    if (!pinned) return Tensor::zeros(shape, dtype);
    Tensor t = Tensor::empty_pinned(shape, dtype);
    t.zero_();
    return t;
  };
  std::vector<DType> grad_dtypes;  // offload: per piece
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
    XMOE_CHECK(p->value.device() == device_ && p->grad.device() == compute_device_,
               "[adamw] {} is on {} (grad on {}) but the first parameter is on {} (grad on {}): "
               "all parameters of an optimizer must be on one device{}",
               p->name, p->value.device().str(), p->grad.device().str(), device_.str(),
               compute_device_.str(),
               cfg.offload ? " (offloaded: values on the host, the first grad's device)" : "");
    const int64_t n = p->value.numel();
    if (piece.count < 0) piece.count = n;
    XMOE_CHECK(piece.offset >= 0 && piece.count >= 0 && piece.offset + piece.count <= n,
               "[adamw] {}: piece [{}, {}) outside its {} elements", p->name, piece.offset,
               piece.offset + piece.count, n);
    if (piece.grad.defined()) check_piece_grad(piece, piece.grad);
    // A whole piece keeps the parameter's shape (the exported state's); a part is flat.
    const Shape shape = piece.whole() ? p->value.shape() : Shape{piece.count};
    sharded_ = sharded_ || !piece.whole();
    for (std::vector<Tensor>* moments : {&m_, &v_})
      moments->push_back(cfg.offload ? host_zeros(shape, cfg.moments_dtype)
                                     : Tensor::zeros(shape, cfg.moments_dtype, device_));
    master_.emplace_back();
    if (piece.master) {
      XMOE_CHECK(
          !p->master_sharded && p->compute_copy.defined() && p->compute_copy.dtype() == DType::bf16,
          "[adamw] {}: a piece that holds the master weights needs the parameter's f32 "
          "value and a bf16 compute copy (its master weights already sharded: {})",
          p->name, p->master_sharded);
      // A whole parameter whose value is already where the masters go (offloaded: the pinned
      // host copy Parameter::offload_master made) becomes the master itself: no second copy of
      // every weight while the owner still holds its value (one process at zero 1). Otherwise
      // a copy of the range (on the host when offloaded), made before the owner frees value.
      const bool in_place = piece.whole() && p->value.device() == device_;
      if (in_place) {
        master_.back() = p->value;
      } else {
        master_.back() =
            cfg.offload ? host_zeros(shape, DType::f32) : Tensor::empty(shape, DType::f32, device_);
        master_.back().copy_from(flat(p->value).rows(piece.offset, piece.offset + piece.count));
      }
    }
    if (!cfg.offload) continue;
    // The dtype of the gradient this piece's update reads (own gradients given later: the f32
    // shards of zero 2).
    grad_dtypes.push_back(piece.grad.defined() ? piece.grad.dtype()
                          : piece.own_grad     ? DType::f32
                                               : p->grad.dtype());
    if (cfg.offload_whole_grads)
      grad_host_.push_back(pinned ? Tensor::empty_pinned({piece.count}, grad_dtypes.back())
                                  : Tensor::empty({piece.count}, grad_dtypes.back()));
  }
  if (!cfg.offload) return;
  std::vector<int64_t> counts;
  for (const AdamWPiece& piece : pieces_) counts.push_back(piece.count);
  groups_ = offload_groups(counts, cfg.offload_group_numel);
  std::vector<char> f32_grad, bf16_grad, copy;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const bool ring = !cfg.offload_whole_grads;
    f32_grad.push_back(ring && grad_dtypes[i] == DType::f32);
    bf16_grad.push_back(ring && grad_dtypes[i] == DType::bf16);
    copy.push_back(pieces_[i].param->compute_copy.defined());
  }
  grad_f32_ring_ = make_ring(counts, f32_grad, DType::f32, pinned);
  grad_bf16_ring_ = make_ring(counts, bf16_grad, DType::bf16, pinned);
  bf16_ring_ = make_ring(counts, copy, DType::bf16, pinned);
  prefetched_.assign(pieces_.size(), 0);
  to_host_ = std::make_unique<CopyQueue>(compute_device_);
  to_device_ = std::make_unique<CopyQueue>(compute_device_);
  if (cfg.delayed_from < 0) return;
  // Delayed: made here, on the caller's thread (the update's thread allocates nothing).
  for (AdamWPiece& piece : pieces_) {
    Parameter& p = *piece.param;
    XMOE_CHECK(piece.whole() && !piece.master,
               "[adamw] {}: the delayed update publishes whole parameters; a piece of one (a "
               "zero shard) cannot be delayed",
               p.name);
    // On the CPU forward would read value itself, which the update writes while it runs.
    if (compute_device_.is_cpu() && (p.reads_f32 || !p.compute_copy.defined()) &&
        !p.device_f32.defined()) {
      p.device_f32 = p.value.clone();
      cpu_f32_bytes_ += static_cast<int64_t>(p.device_f32.nbytes());
    }
    twin_copy_.push_back(p.compute_copy.defined() ? p.compute_copy.clone() : Tensor());
    twin_f32_.push_back(p.device_f32.defined() ? p.device_f32.clone() : Tensor());
  }
}

AdamW::~AdamW() {
  try {
    finish();
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
  }
}

int64_t AdamW::delayed_update_bytes() const {
  int64_t bytes = cpu_f32_bytes_;
  for (const std::vector<Tensor>* twins : {&twin_copy_, &twin_f32_})
    for (const Tensor& t : *twins)
      if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

void AdamW::join_update() {
  if (update_thread_.joinable()) update_thread_.join();
  if (update_error_) {
    pending_ = false;
    std::rethrow_exception(std::exchange(update_error_, nullptr));
  }
}

void AdamW::finish() {
  join_update();
  if (!pending_) return;
  pending_ = false;
  to_device_->compute_waits();  // for the copies into the twins
  for (size_t i = 0; i < pieces_.size(); ++i) {
    Parameter& p = *pieces_[i].param;
    if (twin_copy_[i].defined()) std::swap(p.compute_copy, twin_copy_[i]);
    if (twin_f32_[i].defined()) std::swap(p.device_f32, twin_f32_[i]);
  }
}

int64_t AdamW::state_bytes() const {
  int64_t bytes = 0;
  for (size_t i = 0; i < m_.size(); ++i)
    bytes += static_cast<int64_t>(m_[i].nbytes() + v_[i].nbytes());
  return bytes;
}

int64_t AdamW::master_bytes() const {
  int64_t bytes = 0;
  for (const Tensor& t : master_)
    if (t.defined()) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

int64_t AdamW::staging_bytes() const {
  int64_t bytes = grad_f32_ring_.bytes() + grad_bf16_ring_.bytes() + bf16_ring_.bytes();
  for (const Tensor& t : grad_host_) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

int64_t AdamW::ring_numel(const std::vector<std::pair<size_t, size_t>>& groups,
                          std::span<const int64_t> counts, const std::vector<char>& member) {
  int64_t largest = 0;
  for (const auto& [begin, end] : groups) {
    int64_t n = 0;
    for (size_t i = begin; i < end; ++i)
      if (member[i]) n += counts[i];
    largest = std::max(largest, n);
  }
  // One buffer a group, at most kOffloadSlots (a single group needs one).
  return static_cast<int64_t>(std::min(groups.size(), static_cast<size_t>(kOffloadSlots))) *
         largest;
}

AdamW::SlotRing AdamW::make_ring(std::span<const int64_t> counts, const std::vector<char>& member,
                                 DType dtype, bool pinned) const {
  SlotRing r;
  r.at.assign(pieces_.size(), -1);
  for (const auto& [begin, end] : groups_) {
    int64_t at = 0;
    for (size_t i = begin; i < end; ++i) {
      if (!member[i]) continue;
      r.at[i] = at;
      at += counts[i];
    }
  }
  const int64_t total = ring_numel(groups_, counts, member);
  const size_t slots = std::min(groups_.size(), static_cast<size_t>(kOffloadSlots));
  for (size_t k = 0; total > 0 && k < slots; ++k) {
    const int64_t numel = total / static_cast<int64_t>(slots);
    r.slots.push_back(pinned ? Tensor::empty_pinned({numel}, dtype)
                             : Tensor::empty({numel}, dtype));
  }
  return r;
}

Tensor AdamW::SlotRing::piece(size_t i, int64_t count, size_t g) const {
  if (at[i] < 0) return Tensor();
  return slots[g % slots.size()].rows(at[i], at[i] + count);
}

int64_t AdamW::SlotRing::bytes() const {
  int64_t n = 0;
  for (const Tensor& t : slots) n += static_cast<int64_t>(t.nbytes());
  return n;
}

std::vector<std::pair<size_t, size_t>> AdamW::offload_groups(std::span<const int64_t> counts,
                                                             int64_t group_numel) {
  std::vector<std::pair<size_t, size_t>> groups;
  for (size_t i = 0, numel = 0; i < counts.size(); ++i) {
    if (groups.empty() || numel >= static_cast<size_t>(group_numel)) {
      groups.emplace_back(i, i);
      numel = 0;
    }
    groups.back().second = i + 1;
    numel += static_cast<size_t>(counts[i]);
  }
  return groups;
}

void AdamW::check_piece_grad(const AdamWPiece& piece, const Tensor& grad) const {
  XMOE_CHECK(grad.numel() == piece.count && grad.device() == compute_device_ &&
                 (grad.dtype() == DType::f32 || grad.dtype() == DType::bf16),
             "[adamw] {}: the piece's grad is {}, expected {} f32 or bf16 values on {}",
             piece.param->name, grad.str(), piece.count, compute_device_.str());
}

void AdamW::set_piece_grads(std::span<const Tensor> grads) {
  size_t k = 0;
  for (AdamWPiece& piece : pieces_) {
    if (!piece.own_grad) continue;
    if (grads.empty()) {
      piece.grad = Tensor();
      continue;
    }
    XMOE_CHECK(k < grads.size(), "[adamw] set_piece_grads: {} gradients for more pieces",
               grads.size());
    check_piece_grad(piece, grads[k]);
    piece.grad = grads[k++];
  }
  XMOE_CHECK(k == grads.size(), "[adamw] set_piece_grads: {} gradients for {} pieces", grads.size(),
             k);
}

Tensor AdamW::piece_grad(size_t i) const {
  const AdamWPiece& piece = pieces_[i];
  if (piece.own_grad) {
    XMOE_CHECK(piece.grad.defined(),
               "[adamw] {}: the piece's own gradient was not given (set_piece_grads)",
               piece.param->name);
    return piece.grad;
  }
  const Tensor& g = piece.param->grad;
  return piece.whole() ? g : flat(g).rows(piece.offset, piece.offset + piece.count);
}

ops::AdamWTensors AdamW::piece_tensors(size_t i, const Tensor& grad,
                                       const Tensor& param_bf16) const {
  const AdamWPiece& piece = pieces_[i];
  const Parameter& p = *piece.param;
  const Tensor value = piece.master ? master_[i]
                       : piece.whole()
                           ? p.value
                           : flat(p.value).rows(piece.offset, piece.offset + piece.count);
  return {value, grad, m_[i], v_[i], param_bf16, p.weight_decay};
}

void AdamW::step(float lr, float grad_scale) {
  ProfileScope scope(cfg_.offload ? "optim.adamw_offload" : "optim.adamw", compute_device_);
  finish();  // the previous update becomes visible to the step after this one
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
  for (const AdamWPiece& piece : pieces_) {
    const Parameter& p = *piece.param;
    // A piece with its own gradient (a zero 2 shard) may have released the parameter's; a
    // piece holding the master weights updates its own f32 copy (value is the bf16 copy).
    XMOE_CHECK((piece.master ? p.master_sharded && p.compute_copy.defined()
                             : p.value.device() == device_) &&
                   (!p.grad.defined() || p.grad.device() == compute_device_),
               "[adamw] {} moved to {} after the optimizer was built on {}, or its master "
               "weights were not sharded as its piece says (master: {})",
               p.name, p.value.device().str(), device_.is_cpu() ? "the CPU" : device_.str(),
               piece.master);
    if (p.compute_copy.defined())
      XMOE_CHECK(p.compute_copy.dtype() == DType::bf16 &&
                     p.compute_copy.device() == compute_device_ &&
                     p.compute_copy.numel() == p.value.numel(),
                 "[adamw] {}: compute copy {} does not match value {}", p.name,
                 p.compute_copy.str(), p.value.str());
  }
  if (cfg_.offload) {
    step_offloaded(s);
    return;
  }
  // One update of every parameter: on CUDA one fused multi-tensor kernel (a launch per 48
  // tensors), the CPU loop's formula in its operation order; bf16 copies rewritten in passing.
  std::vector<ops::AdamWTensors> list;
  list.reserve(pieces_.size());
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const AdamWPiece& piece = pieces_[i];
    const Tensor& copy = piece.param->compute_copy;
    list.push_back(piece_tensors(i, piece_grad(i),
                                 !copy.defined() || piece.whole()
                                     ? copy
                                     : flat(copy).rows(piece.offset, piece.offset + piece.count)));
  }
  ops::adamw_step(list, s);
}

void AdamW::prefetch_grads(const std::vector<Parameter*>& params) {
  // Without whole gradient buffers the gradients travel during the update.
  if (!cfg_.offload || !cfg_.offload_whole_grads || params.empty()) return;
  join_update();  // the running update reads the host gradient buffers
  const std::set<const Parameter*> final_now(params.begin(), params.end());
  settle_grads(params);
  // After the backward that wrote them; the markers of this round stay (step() waits on them).
  if (any_prefetched_)
    to_host_->follow_compute();
  else
    to_host_->after_compute();
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const AdamWPiece& piece = pieces_[i];
    if (piece.own_grad || prefetched_[i] || !final_now.count(piece.param)) continue;
    to_host_->copy(grad_host_[i], flat(piece_grad(i)));
    prefetched_[i] = 1;
    any_prefetched_ = true;
  }
}

void AdamW::forget_prefetched() {
  if (!any_prefetched_) return;
  std::fill(prefetched_.begin(), prefetched_.end(), 0);
  any_prefetched_ = false;
}

Tensor AdamW::grad_host(size_t i, size_t g) const {
  // Its whole buffer, or its run in the group's ring buffer (the buffer group g - kOffloadSlots
  // used: that group's update, on the same thread, is done with it).
  if (cfg_.offload_whole_grads) return grad_host_[i];
  const Tensor t = grad_f32_ring_.piece(i, pieces_[i].count, g);
  return t.defined() ? t : grad_bf16_ring_.piece(i, pieces_[i].count, g);
}

int AdamW::send_grads(size_t g) {
  for (size_t i = groups_[g].first; i < groups_[g].second; ++i)
    if (!prefetched_[i]) to_host_->copy(grad_host(i, g), flat(piece_grad(i)));
  return to_host_->mark();
}

void AdamW::step_offloaded(const ops::AdamWStep& s) {
  // Both queues start after the device's queued work: the gradients are final, and nothing
  // queued still reads the weights the updates overwrite. The gradients prefetched during
  // backward are on their way already (the copy queue runs in order: a marker after a group's
  // copies is after them too).
  if (any_prefetched_)
    to_host_->follow_compute();
  else
    to_host_->after_compute();
  to_device_->after_compute();
  if (!delays(step_)) {
    update_groups(s, {}, false);
    to_device_->compute_waits();
    forget_prefetched();
    return;
  }
  // Delayed: every gradient leaves now; the next backward, which overwrites them, waits for
  // their copies, and the update runs beside the next step.
  std::vector<int> arrived;
  for (size_t g = 0; g < groups_.size(); ++g) arrived.push_back(send_grads(g));
  to_host_->compute_waits();
  forget_prefetched();
  const int threads = std::max(1, omp_get_max_threads() - 1);  // one core launches device work
  pending_ = true;
  update_thread_ = std::thread([this, s, arrived = std::move(arrived), threads]() mutable {
    try {
      omp_set_num_threads(threads);
      update_groups(s, std::move(arrived), true);
    } catch (...) {
      update_error_ = std::current_exception();
    }
  });
}

void AdamW::update_groups(const ops::AdamWStep& s, std::vector<int> arrived, bool to_twins) {
  const bool send = arrived.empty();
  if (send) {
    arrived.resize(groups_.size());
    if (!groups_.empty()) arrived[0] = send_grads(0);
  }
  std::vector<int> returned(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (send && g + 1 < groups_.size()) arrived[g + 1] = send_grads(g + 1);
    to_host_->host_wait(arrived[g]);
    // The bf16 buffer this group writes: free once the copies of the group before that used it
    // have left (long done: a group's update takes longer than its copy back).
    if (g >= kOffloadSlots) to_device_->host_wait(returned[g - kOffloadSlots]);
    auto bf16_of = [&](size_t i) { return bf16_ring_.piece(i, pieces_[i].count, g); };
    const auto [begin, end] = groups_[g];
    std::vector<ops::AdamWTensors> list;
    for (size_t i = begin; i < end; ++i)
      list.push_back(piece_tensors(i, grad_host(i, g), bf16_of(i)));
    ops::adamw_step(list, s);  // host tensors: the CPU kernel, OpenMP over each tensor
    for (size_t i = begin; i < end; ++i) {
      const AdamWPiece& piece = pieces_[i];
      const Parameter& p = *piece.param;
      const int64_t a = piece.offset, b = piece.offset + piece.count;
      const Tensor& copy = to_twins ? twin_copy_[i] : p.compute_copy;
      const Tensor& f32 = to_twins ? twin_f32_[i] : p.device_f32;
      if (bf16_ring_.at[i] >= 0) to_device_->copy(flat(copy).rows(a, b), bf16_of(i));
      if (f32.defined()) to_device_->copy(flat(f32).rows(a, b), flat(p.value).rows(a, b));
    }
    returned[g] = to_device_->mark();
  }
}

void AdamW::zero_grad() {
  for (Parameter* p : params_) p->zero_grad();
}

void AdamW::export_state(std::map<std::string, Tensor>& out) const {
  XMOE_CHECK(!pending_, "[adamw] export_state: a delayed update is pending; finish() it first");
  XMOE_CHECK(!sharded_,
             "[adamw] export_state: the moments are sharded over ranks (parallel.zero >= 1); "
             "gather them into whole tensors first");
  for (size_t i = 0; i < params_.size(); ++i) {
    out[params_[i]->name + ".adam_m"] = moment_f32(m_[i]);
    out[params_[i]->name + ".adam_v"] = moment_f32(v_[i]);
    if (master_[i].defined()) out[params_[i]->name] = master_[i];
  }
  out[kStepKey] = Tensor::from_vector<int64_t>({step_}, {1});
}

void AdamW::import_state(const std::map<std::string, Tensor>& in) {
  XMOE_CHECK(!pending_, "[adamw] import_state: a delayed update is pending; finish() it first");
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
  std::vector<const Tensor*> ms, vs, masters;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter* p = params_[i];
    ms.push_back(&find(p->name + ".adam_m", p->value.shape(), DType::f32));
    vs.push_back(&find(p->name + ".adam_v", p->value.shape(), DType::f32));
    masters.push_back(pieces_[i].master ? &find(p->name, p->value.shape(), DType::f32) : nullptr);
  }
  const int64_t s = step.to_vector<int64_t>()[0];
  XMOE_CHECK(s >= 0, "[adamw] state step = {} is negative", s);
  // The piece's range of a whole f32 moment, in the moments' dtype (bf16: rounded).
  auto range_of = [&](const Tensor& whole, size_t i) {
    const int64_t a = pieces_[i].offset, b = a + pieces_[i].count;
    const Tensor range = flat(whole.to(Device::cpu())).rows(a, b).reshape(m_[i].shape());
    return cfg_.moments_dtype == DType::f32 ? range : range.to(cfg_.moments_dtype);
  };
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const int64_t a = pieces_[i].offset, b = a + pieces_[i].count;
    m_[i].copy_from(range_of(*ms[i], i));
    v_[i].copy_from(range_of(*vs[i], i));
    if (masters[i])
      master_[i].copy_from(flat(masters[i]->to(Device::cpu())).rows(a, b).reshape(m_[i].shape()));
  }
  step_ = s;
}

}  // namespace xmoe::optim
