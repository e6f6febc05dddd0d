#include "xmoe/parallel/grad_sync.h"

#include <cstring>

#include "xmoe/optim/clip.h"

namespace xmoe::parallel {

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
  Tensor flat = Tensor::empty({b.numel});
  float* dst = flat.data<float>();
  for (Parameter* p : b.params) {
    std::memcpy(dst, p->grad.data<float>(), p->grad.nbytes());
    dst += p->grad.numel();
  }
  if (group.size() > 1) group.all_reduce(flat);
  const float scale = 1.0f / static_cast<float>(layout_.world_size);
  const float* src = flat.data<float>();
  for (Parameter* p : b.params) {
    float* g = p->grad.data<float>();
    for (int64_t i = 0; i < p->grad.numel(); ++i) g[i] = src[i] * scale;
    src += p->grad.numel();
  }
}

void GradientSync::sync() {
  if (layout_.world_size == 1) return;
  for (Bucket& b : buckets_) reduce(b);
}

double GradientSync::global_grad_sum_squares() const {
  std::vector<Parameter*> dense, expert;
  for (Parameter* p : params_) (p->kind == ParamKind::expert ? expert : dense).push_back(p);
  double total = optim::grad_sum_squares(dense);
  double e = optim::grad_sum_squares(expert);
  if (layout_.ep > 1) {
    // Each ep rank holds different experts: their squares add up over the ep group.
    Tensor t = Tensor::from_vector<double>({e}, {1});
    layout_.ep_group->all_reduce(t);
    e = t.data<double>()[0];
  }
  return total + e;
}

}  // namespace xmoe::parallel
