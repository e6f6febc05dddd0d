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
  p.global_rows = shape.empty() ? 1 : shape[0];
  p.value = Tensor::zeros(shape);
  p.grad = Tensor::zeros(shape, grad_dtype);
  return p;
}

void Parameter::to(Device device) {
  XMOE_CHECK(!offloaded(),
             "[parameter] {}: its master weights are offloaded to the host; it cannot move to {}",
             name, device.str());
  if (value.device() == device) return;
  value = value.to(device);
  if (grad.defined()) grad = grad.to(device);
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

void Parameter::offload_master() {
  if (value.is_cpu()) return;
  Tensor host = Tensor::empty_pinned(value.shape(), value.dtype());
  host.copy_from(value);
  if (reads_f32 || !compute_copy.defined()) device_f32 = value;
  value = std::move(host);
}

void Parameter::init_normal(uint64_t seed, float std) {
  const int64_t rows = value.dim() ? value.size(0) : 1;
  const int64_t row_elems = rows ? value.numel() / rows : 0;
  fill_normal(value, seed, stream_id(name), std, 0.0f,
              static_cast<uint64_t>(row_offset * row_elems));
}

}  // namespace xmoe
