#include "xmoe/parallel/grad_sync.h"

#include <cstring>

#include "xmoe/backend/cuda/optim_kernels.h"
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

void GradientSync::reduce_device(Bucket& b, comm::Group& group) {
  // Pack the bucket's gradients into one f32 device buffer (one multi-tensor copy; bf16
  // gradients are widened, so the sum is f32 whatever they are), all-reduce it where the
  // group's tensors live (NCCL: on this device; MPI/single: staged through the host), and
  // unpack with the 1/world scale. Nothing waits for the device except the staging copies.
  const Device d = b.params[0]->grad.device();
  const float scale = 1.0f / static_cast<float>(layout_.world_size);
  Tensor flat = Tensor::empty({b.numel}, DType::f32, d);
  std::vector<cuda::FloatArray> grads, views;
  int64_t offset = 0;
  for (Parameter* p : b.params) {
    XMOE_CHECK(p->grad.device() == d, "[grad_sync] {} has its grad on {} but {} on {}", p->name,
               p->grad.device().str(), b.params[0]->name, d.str());
    grads.push_back({p->grad.raw(), p->grad.numel(), p->grad.dtype() == DType::bf16});
    views.push_back({flat.data<float>() + offset, p->grad.numel(), false});
    offset += p->grad.numel();
  }
  const int64_t n = static_cast<int64_t>(grads.size());
  cuda::Stream stream = cuda::activate(d.index);
  cuda::multi_copy_scaled(views.data(), grads.data(), n, 1.0f, stream);
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
  cuda::multi_copy_scaled(grads.data(), views.data(), n, scale, stream);
}

void GradientSync::reduce(Bucket& b) {
  comm::Group& group = b.expert ? *layout_.dp_group : *layout_.world;
  if (b.params[0]->grad.device().is_cuda()) {
    reduce_device(b, group);
    return;
  }
  // The CPU: the same f32 bucket, bf16 gradients widened into it and rounded back.
  Tensor flat = Tensor::empty({b.numel});
  float* dst = flat.data<float>();
  for (Parameter* p : b.params) {
    if (p->grad.dtype() == DType::bf16) {
      const bf16* g = p->grad.data<bf16>();
      for (int64_t i = 0; i < p->grad.numel(); ++i) dst[i] = static_cast<float>(g[i]);
    } else {
      std::memcpy(dst, p->grad.data<float>(), p->grad.nbytes());
    }
    dst += p->grad.numel();
  }
  if (group.size() > 1) group.all_reduce(flat);
  const float scale = 1.0f / static_cast<float>(layout_.world_size);
  const float* src = flat.data<float>();
  for (Parameter* p : b.params) {
    if (p->grad.dtype() == DType::bf16) {
      bf16* g = p->grad.data<bf16>();
      for (int64_t i = 0; i < p->grad.numel(); ++i) g[i] = bf16(src[i] * scale);
    } else {
      float* g = p->grad.data<float>();
      for (int64_t i = 0; i < p->grad.numel(); ++i) g[i] = src[i] * scale;
    }
    src += p->grad.numel();
  }
}

void GradientSync::sync() {
  if (layout_.world_size == 1) return;
  settle_grads(params_);
  for (Bucket& b : buckets_) reduce(b);
}

double GradientSync::global_grad_sum_squares() const {
  std::vector<Parameter*> dense, expert;
  for (Parameter* p : params_) (p->kind == ParamKind::expert ? expert : dense).push_back(p);
  double total = optim::grad_sum_squares(dense);
  if (layout_.ep > 1) {
    // Each ep rank holds different experts: their squares add up over the ep group.
    comm::Group& ep = *layout_.ep_group;
    const bool device_grads = !expert.empty() && expert[0]->grad.device().is_cuda();
    Tensor t;
    if (device_grads && ep.device() == expert[0]->grad.device()) {
      t = optim::grad_sum_squares_device(expert);  // reduced on the device, read once below
    } else {
      t = Tensor::from_vector<double>({optim::grad_sum_squares(expert)}, {1}, ep.device());
    }
    ep.all_reduce(t);
    return total + t.item();
  }
  return total + optim::grad_sum_squares(expert);
}

}  // namespace xmoe::parallel
