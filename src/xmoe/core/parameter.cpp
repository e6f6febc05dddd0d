#include "xmoe/core/parameter.h"

namespace xmoe {

Parameter Parameter::make(std::string name, Shape shape, ParamKind kind, bool weight_decay,
                          DType grad_dtype) {
  XMOE_CHECK(grad_dtype == DType::f32 || grad_dtype == DType::bf16,
             "[parameter] {}: gradient dtype {} (expected f32 or bf16)", name,
             dtype_name(grad_dtype));
  Parameter p;
  p.name = std::move(name);
  p.kind = kind;
  p.weight_decay = weight_decay;
  p.value = Tensor::zeros(shape);
  p.grad = Tensor::zeros(shape, grad_dtype);
  return p;
}

void Parameter::to(Device device) {
  XMOE_CHECK(!master_sharded,
             "[parameter] {}: its master weights are sharded over ranks (parallel.zero); it "
             "cannot move to {}",
             name, device.str());
  XMOE_CHECK(!offloaded(),
             "[parameter] {}: its master weights are offloaded to the host; it cannot move to {}",
             name, device.str());
  if (value.device() == device) return;
  value = value.to(device);
  if (grad.defined()) grad = grad.to(device);
  if (grad_released) released_grad_device = device;
  if (compute_copy.defined()) compute_copy = compute_copy.to(device);
}

void Parameter::drop_master_weights(DType dtype) {
  XMOE_CHECK(dtype == DType::bf16, "[parameter] {}: weights held only in {} (expected bf16)", name,
             dtype_name(dtype));
  if (value.dtype() == dtype) return;
  if (compute_copy.defined() && compute_copy.dtype() == dtype) {
    value = std::move(compute_copy);
  } else {
    XMOE_CHECK(value.is_cpu(),
               "[parameter] {}: dropping the master weights of a parameter on {} needs its {} "
               "compute copy (or drop them on the host)",
               name, value.device().str(), dtype_name(dtype));
    value = value.to(dtype);
  }
  compute_copy = Tensor();
}

void Parameter::shard_master_weights() {
  if (master_sharded) return;
  XMOE_CHECK(compute_copy.defined() && compute_copy.dtype() == DType::bf16 && !reads_f32 &&
                 value.dtype() == DType::f32,
             "[parameter] {}: sharding the master weights needs an f32 value, a bf16 compute "
             "copy and no f32 reader (value {}, compute copy {}, reads_f32 {})",
             name, value.str(), compute_copy.defined() ? compute_copy.str() : "none", reads_f32);
  value = compute_copy;
  device_f32 = Tensor();
  master_sharded = true;
}

void Parameter::offload_master() {
  XMOE_CHECK(!master_sharded,
             "[parameter] {}: offload the master weights before sharding them (parallel.zero)",
             name);
  if (value.is_cpu()) return;
  Tensor host = Tensor::empty_pinned(value.shape(), value.dtype());
  host.copy_from(value);
  if (reads_f32 || !compute_copy.defined()) device_f32 = value;
  value = std::move(host);
}

int64_t ShardSpec::outer() const {
  int64_t n = 1;
  for (int i = 0; i < dim; ++i) n *= view_shape()[static_cast<size_t>(i)];
  return n;
}

int64_t ShardSpec::inner() const {
  int64_t n = 1;
  const Shape& v = view_shape();
  for (size_t i = static_cast<size_t>(dim) + 1; i < v.size(); ++i) n *= v[i];
  return n;
}

namespace {

/// Calls f(local run, first global element) for each contiguous run of a shard: `outer` runs
/// of n·inner elements, run o starting at global element (o·G + offset)·inner.
template <typename F>
void for_each_run(const ShardSpec& spec, int64_t local_numel, F&& f) {
  const Shape& view = spec.view_shape();
  XMOE_CHECK(spec.dim >= 0 && static_cast<size_t>(spec.dim) < view.size(),
             "[parameter] shard dim {} outside the whole tensor's view {}", spec.dim,
             shape_str(view));
  const int64_t outer = spec.outer(), inner = spec.inner(), g = view[static_cast<size_t>(spec.dim)];
  const int64_t run = outer ? local_numel / outer : 0;
  XMOE_CHECK(run * outer == local_numel && run % inner == 0 && spec.offset >= 0 &&
                 spec.offset + run / inner <= g,
             "[parameter] a shard of {} elements does not fit offset {} of dim {} of {}",
             local_numel, spec.offset, spec.dim, shape_str(view));
  for (int64_t o = 0; o < outer; ++o) f(o * run, run, (o * g + spec.offset) * inner);
}

}  // namespace

Tensor slice_shard(const Tensor& whole, const ShardSpec& spec, const Shape& local_shape) {
  Tensor out = Tensor::empty(local_shape, whole.dtype(), whole.device());
  const Tensor src = whole.reshape({whole.numel()});
  Tensor dst = out.reshape({out.numel()});
  for_each_run(spec, out.numel(), [&](int64_t at, int64_t n, int64_t global) {
    dst.rows(at, at + n).copy_from(src.rows(global, global + n));
  });
  return out;
}

void place_shard(Tensor& whole, const ShardSpec& spec, const Tensor& shard) {
  Tensor dst = whole.reshape({whole.numel()});
  const Tensor src = shard.reshape({shard.numel()});
  for_each_run(spec, shard.numel(), [&](int64_t at, int64_t n, int64_t global) {
    dst.rows(global, global + n).copy_from(src.rows(at, at + n));
  });
}

void Parameter::init_normal(uint64_t seed, float std) {
  if (!shard.sharded()) {
    fill_normal(value, seed, stream_id(name), std, 0.0f, 0);
    return;
  }
  Tensor flat = value.reshape({value.numel()});
  for_each_run(shard, value.numel(), [&](int64_t at, int64_t n, int64_t global) {
    Tensor run = flat.rows(at, at + n);
    fill_normal(run, seed, stream_id(name), std, 0.0f, static_cast<uint64_t>(global));
  });
}

}  // namespace xmoe
