#include "xmoe/ops/optim.h"

#include <string>
#include <vector>

#include "xmoe/backend/cpu/optim_kernels.h"
#include "xmoe/backend/cuda/optim_kernels.h"
#include "xmoe/ops/dispatch.h"
#include "xmoe/ops/ops.h"

namespace xmoe::ops {

using detail::require_on;
using detail::require_same_device;
using detail::stream_of;

namespace {

/// Every tensor of xs is a float tensor (f32 or bf16, also on the CPU) on the device of xs[0].
/// Names the bad element (formatted only on failure: these lists are checked every step).
void check_list(const char* op, const char* list, std::span<const Tensor> xs) {
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& x = xs[i];
    if (x.defined() && x.device() == xs[0].device() && detail::is_float(x.dtype())) continue;
    const std::string name = fmt::format("{}[{}]", list, i);
    require_same_device(op, name.c_str(), x, "the first tensor", xs[0]);
    XMOE_FAIL("[{}] {} has dtype {}, expected f32 or bf16", op, name, dtype_name(x.dtype()));
  }
}

cuda::FloatArray float_array(const Tensor& t) {
  return {t.raw(), t.numel(), t.dtype() == DType::bf16};
}

}  // namespace

void adamw_step(std::span<const AdamWTensors> tensors, const AdamWStep& s) {
  const char* op = "adamw_step";
  if (tensors.empty()) return;
  const Tensor& first = tensors[0].param;
  const Tensor& first_m = tensors[0].m;
  XMOE_CHECK(first_m.defined() && detail::is_float(first_m.dtype()),
             "[{}] m[0] is {}, expected f32 or bf16 moments", op, first_m.str());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamWTensors& t = tensors[i];
    require_on(op, "param", t.param, DType::f32, "param[0]", first);
    require_same_device(op, "grad", t.grad, "param", t.param);
    require_on(op, "m", t.m, first_m.dtype(), "param", t.param);  // all m[i], v[i] of m[0]'s dtype
    require_on(op, "v", t.v, first_m.dtype(), "param", t.param);
    const int64_t n = t.param.numel();
    XMOE_CHECK(detail::is_float(t.grad.dtype()) && t.grad.numel() == n && t.m.numel() == n &&
                   t.v.numel() == n,
               "[{}] tensor {}: grad {}, m {} and v {} must match param {} (grad f32 or bf16)", op,
               i, t.grad.str(), t.m.str(), t.v.str(), t.param.str());
    if (t.param_bf16.defined()) {
      require_on(op, "param_bf16", t.param_bf16, DType::bf16, "param", t.param);
      XMOE_CHECK(t.param_bf16.numel() == n, "[{}] tensor {}: param_bf16 {} does not match {}", op,
                 i, t.param_bf16.str(), t.param.str());
    }
  }
  if (first.is_cpu()) {
    for (const AdamWTensors& t : tensors) {
      const float decay = t.decay ? 1.0f - s.lr * s.weight_decay : 1.0f;
      float* w = t.param.data<float>();
      bf16* copy = t.param_bf16.defined() ? t.param_bf16.data<bf16>() : nullptr;
      const int64_t n = t.param.numel();
      cpu::adamw_update(w, t.grad.raw(), t.grad.dtype() == DType::bf16, t.m.raw(), t.v.raw(),
                        t.m.dtype() == DType::bf16, copy, n, s.lr, s.beta1, s.beta2, s.eps, s.bc1,
                        s.bc2, decay, s.grad_scale);
    }
    return;
  }
  // One fused update of every tensor (a launch per kMultiTensorMax), the CPU's formula in the
  // CPU's operation order; bf16 copies are rewritten in passing.
  cuda::AdamWScalars c;
  c.lr = s.lr;
  c.beta1 = s.beta1;
  c.beta2 = s.beta2;
  c.eps = s.eps;
  c.one_minus_beta1 = 1.f - s.beta1;
  c.one_minus_beta2 = 1.f - s.beta2;
  c.bc1 = s.bc1;
  c.bc2 = s.bc2;
  c.decay = 1.0f - s.lr * s.weight_decay;
  c.grad_scale = s.grad_scale;
  std::vector<cuda::AdamWTensor> list;
  list.reserve(tensors.size());
  for (const AdamWTensors& t : tensors) {
    cuda::AdamWTensor a;
    a.param = t.param.data<float>();
    a.grad = t.grad.raw();
    a.grad_bf16 = t.grad.dtype() == DType::bf16;
    a.m = t.m.raw();
    a.v = t.v.raw();
    a.moments_bf16 = t.m.dtype() == DType::bf16;
    if (t.param_bf16.defined()) a.param_bf16 = t.param_bf16.raw();
    a.n = t.param.numel();
    a.decay = t.decay;
    list.push_back(a);
  }
  cuda::adamw_step(list.data(), static_cast<int64_t>(list.size()), c, stream_of(first));
}

Tensor multi_sum_squares(std::span<const Tensor> xs) {
  const char* op = "multi_sum_squares";
  check_list(op, "xs", xs);
  if (xs.empty() || xs[0].is_cpu()) {
    double s = 0.0;
    for (const Tensor& x : xs) s += sum_squares(x);
    return Tensor::from_vector<double>({s}, {1});
  }
  const Device d = xs[0].device();
  std::vector<cuda::FloatArray> arrays;
  arrays.reserve(xs.size());
  for (const Tensor& x : xs) arrays.push_back(float_array(x));
  const int64_t n = static_cast<int64_t>(arrays.size());
  Tensor result = Tensor::empty({1}, DType::f64, d);
  Tensor workspace = Tensor::empty(
      {static_cast<int64_t>(cuda::multi_sum_squares_workspace_bytes(arrays.data(), n))}, DType::u8,
      d);
  cuda::multi_sum_squares(result.data<double>(), arrays.data(), n, workspace.raw(),
                          stream_of(xs[0]));
  return result;
}

void multi_scale_(std::span<Tensor> xs, float s) {
  check_list("multi_scale_", "xs", xs);
  if (xs.empty()) return;
  if (xs[0].is_cpu()) {
    for (Tensor& x : xs) scale_(x, s);
    return;
  }
  std::vector<cuda::FloatArray> arrays;
  arrays.reserve(xs.size());
  for (const Tensor& x : xs) arrays.push_back(float_array(x));
  cuda::multi_scale(arrays.data(), static_cast<int64_t>(arrays.size()), s, stream_of(xs[0]));
}

void multi_copy_scaled(std::span<Tensor> dst, std::span<const Tensor> src, float s) {
  const char* op = "multi_copy_scaled";
  XMOE_CHECK(dst.size() == src.size(), "[{}] {} destinations for {} sources", op, dst.size(),
             src.size());
  check_list(op, "dst", dst);
  check_list(op, "src", src);
  if (dst.empty()) return;
  require_same_device(op, "src[0]", src[0], "dst[0]", dst[0]);
  for (size_t i = 0; i < dst.size(); ++i)
    XMOE_CHECK(dst[i].numel() == src[i].numel(), "[{}] dst[{}] {} and src[{}] {} differ in size",
               op, i, dst[i].str(), i, src[i].str());
  if (dst[0].is_cpu()) {
    for (size_t i = 0; i < dst.size(); ++i)
      cpu::copy_scaled(dst[i].raw(), dst[i].dtype() == DType::bf16, src[i].raw(),
                       src[i].dtype() == DType::bf16, dst[i].numel(), s);
    return;
  }
  std::vector<cuda::FloatArray> d, from;
  d.reserve(dst.size());
  from.reserve(src.size());
  for (size_t i = 0; i < dst.size(); ++i) {
    d.push_back(float_array(dst[i]));
    from.push_back(float_array(src[i]));
  }
  cuda::multi_copy_scaled(d.data(), from.data(), static_cast<int64_t>(d.size()), s,
                          stream_of(dst[0]));
}

}  // namespace xmoe::ops
