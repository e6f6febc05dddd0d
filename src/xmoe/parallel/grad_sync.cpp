#include "xmoe/parallel/grad_sync.h"

#include "xmoe/core/profile.h"
#include "xmoe/ops/optim.h"

namespace xmoe::parallel {

namespace {

/// Σ grad² of `params` as an f64 [1] tensor on their device (the CPU for none): one
/// deterministic multi-tensor reduction; nothing waits.
Tensor grad_sum_squares(const std::vector<Parameter*>& params) {
  settle_grads(params);
  std::vector<Tensor> grads;
  grads.reserve(params.size());
  for (const Parameter* p : params) grads.push_back(p->grad);
  return ops::multi_sum_squares(grads);
}

}  // namespace

GradientSync::GradientSync(std::vector<Parameter*> params, const Layout& layout,
                           int64_t bucket_bytes)
    : params_(std::move(params)), layout_(layout) {
  const int64_t bucket_numel = std::max<int64_t>(1, bucket_bytes / 4);
  for (bool expert : {false, true}) {
    Bucket b;
    b.expert = expert;
    for (Parameter* p : params_) {
      if ((p->kind == ParamKind::expert) != expert) continue;
      if (b.numel > 0 && b.numel + p->grad.numel() > bucket_numel) {
        buckets_.push_back(std::move(b));
        b = Bucket{};
        b.expert = expert;
      }
      b.params.push_back(p);
      b.numel += p->grad.numel();
    }
    if (b.numel > 0) buckets_.push_back(std::move(b));
  }
}

void GradientSync::reduce(Bucket& b) {
  comm::Group& group = b.expert ? *layout_.dp_group : *layout_.world;
  // Pack the bucket's gradients into one f32 buffer (bf16 gradients are widened, so the sum is
  // f32 whatever they are; CUDA: one multi-tensor copy), all-reduce it where the group's tensors
  // live (NCCL: on this device; MPI: on the host, CUDA buffers staged through it), and unpack
  // with the 1/world scale (bf16 rounded once). Nothing waits for the device except staging.
  const Device d = b.params[0]->grad.device();
  const float scale = 1.0f / static_cast<float>(layout_.world_size);
  Tensor flat = Tensor::empty({b.numel}, DType::f32, d);
  std::vector<Tensor> grads, views;
  int64_t offset = 0;
  for (Parameter* p : b.params) {
    XMOE_CHECK(p->grad.device() == d, "[grad_sync] {} has its grad on {} but {} on {}", p->name,
               p->grad.device().str(), b.params[0]->name, d.str());
    grads.push_back(p->grad);
    views.push_back(flat.rows(offset, offset + p->grad.numel()));
    offset += p->grad.numel();
  }
  ops::multi_copy_scaled(views, grads, 1.0f);
  if (group.size() > 1) {
    if (group.device() == d) {
      group.all_reduce(flat);
    } else {
      XMOE_CHECK(group.device().is_cpu(),
                 "[grad_sync] gradients on {} but the group's tensors live on {}", d.str(),
                 group.device().str());
      Tensor host = flat.to(Device::cpu());
      group.all_reduce(host);
      flat.copy_from(host);
    }
  }
  ops::multi_copy_scaled(grads, views, scale);
}

void GradientSync::sync() {
  if (layout_.world_size == 1) return;
  settle_grads(params_);
  for (Bucket& b : buckets_) reduce(b);
}

double GradientSync::global_grad_sum_squares() const {
  std::vector<Parameter*> dense, expert;
  for (Parameter* p : params_) (p->kind == ParamKind::expert ? expert : dense).push_back(p);
  ProfileScope scope("optim.grad_norm",
                     params_.empty() ? Device::cpu() : params_[0]->grad.device());
  const double total = grad_sum_squares(dense).item();
  Tensor t = grad_sum_squares(expert);
  if (layout_.ep > 1) {
    // Each ep rank holds different experts: their squares add up over the ep group (on the
    // device where the group lives there: NCCL; else through the host).
    comm::Group& ep = *layout_.ep_group;
    if (t.device() != ep.device()) t = t.to(ep.device());
    ep.all_reduce(t);
  }
  return total + t.item();
}

}  // namespace xmoe::parallel
