#include "xmoe/ops/ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "xmoe/backend/cpu/kernels.h"
#include "xmoe/core/device_api.h"
#include "xmoe/ops/dispatch.h"

namespace xmoe::ops {

using detail::require_2d;
using detail::require_defined;
using detail::require_float;
using detail::require_like;
using detail::require_like_or_f32;
using detail::require_on;
using detail::require_same_device;
using detail::rows_cols;
using detail::stream_of;

// ---- linear algebra -------------------------------------------------------------------------

namespace {
struct MatmulDims {
  int64_t m, n, k;
};

MatmulDims matmul_dims(const char* op, const Tensor& a, const Tensor& b, bool ta, bool tb) {
  require_float(op, "a", a);
  require_like(op, "b", b, "a", a);
  require_2d(op, "a", a);
  require_2d(op, "b", b);
  const int64_t m = ta ? a.size(1) : a.size(0), ka = ta ? a.size(0) : a.size(1);
  const int64_t kb = tb ? b.size(1) : b.size(0), n = tb ? b.size(0) : b.size(1);
  XMOE_CHECK(ka == kb, "[{}] inner dimensions differ: a {}{} and b {}{}", op, shape_str(a.shape()),
             ta ? "^T" : "", shape_str(b.shape()), tb ? "^T" : "");
  return {m, n, ka};
}
}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  const auto [m, n, k] = matmul_dims("matmul", a, b, trans_a, trans_b);
  Tensor c = Tensor::empty({m, n}, a.dtype(), a.device());
  if (a.is_cpu()) {
    cpu::gemm(c.data<float>(), a.data<float>(), b.data<float>(), m, n, k, trans_a, trans_b, 1.f,
              0.f);
  } else {
    cuda::gemm(c.raw(), c.dtype(), a.raw(), b.raw(), a.dtype(), m, n, k, trans_a, trans_b, 1.f, 0.f,
               stream_of(a));
  }
  return c;
}

Tensor matmul_f32(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  if (a.dtype() == DType::f32) return matmul(a, b, trans_a, trans_b);
  const auto [m, n, k] = matmul_dims("matmul_f32", a, b, trans_a, trans_b);
  Tensor c = Tensor::empty({m, n}, DType::f32, a.device());
  matmul_into(c, a, b, trans_a, trans_b, 1.f, 0.f);
  return c;
}

void matmul_into(Tensor& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                 float alpha, float beta) {
  const auto [m, n, k] = matmul_dims("matmul_into", a, b, trans_a, trans_b);
  require_like_or_f32("matmul_into", "c", c, "a", a);
  check_shape(c, {m, n}, "matmul_into", "c");
  if (a.is_cpu()) {
    cpu::gemm(c.data<float>(), a.data<float>(), b.data<float>(), m, n, k, trans_a, trans_b, alpha,
              beta);
  } else {
    cuda::gemm(c.raw(), c.dtype(), a.raw(), b.raw(), a.dtype(), m, n, k, trans_a, trans_b, alpha,
               beta, stream_of(a));
  }
}

Tensor split_bf16_columns(const Tensor& x, std::span<const int> terms) {
  const char* op = "split_bf16_columns";
  require_2d(op, "x", x);
  check_dtype(x, DType::f32, op, "x");
  const int n = static_cast<int>(terms.size());
  XMOE_CHECK(n >= 1 && n <= 6, "[{}] {} terms: 1 to 6 column blocks", op, n);
  for (int t : terms) XMOE_CHECK(t >= 0 && t <= 2, "[{}] term {} is not 0, 1 or 2", op, t);
  const int64_t rows = x.size(0), cols = x.size(1);
  Tensor out = Tensor::empty({rows, cols * n}, DType::bf16, x.device());
  if (x.is_cpu())
    cpu::split_bf16_columns(static_cast<uint16_t*>(out.raw()), x.data<float>(), rows, cols,
                            terms.data(), n);
  else
    cuda::split_bf16_columns(out.raw(), x.data<float>(), rows, cols, terms.data(), n, stream_of(x));
  return out;
}

void sum_column_blocks_into(Tensor& out, const Tensor& y, int64_t n, bool accumulate) {
  const char* op = "sum_column_blocks_into";
  require_2d(op, "out", out);
  check_dtype(out, DType::f32, op, "out");
  require_on(op, "y", y, DType::f32, "out", out);
  XMOE_CHECK(n >= 1, "[{}] n = {} column blocks", op, n);
  const int64_t rows = out.size(0), cols = out.size(1);
  check_shape(y, {rows, cols * n}, op, "y");
  if (out.is_cpu())
    cpu::sum_column_blocks(out.data<float>(), y.data<float>(), rows, cols, n, accumulate);
  else
    cuda::sum_column_blocks(out.data<float>(), y.data<float>(), rows, cols, n, accumulate,
                            stream_of(out));
}

namespace {
void check_groups(const char* op, std::span<const int64_t> group_sizes, int64_t groups,
                  int64_t rows) {
  XMOE_CHECK(static_cast<int64_t>(group_sizes.size()) == groups,
             "[{}] {} group sizes for {} weight groups", op, group_sizes.size(), groups);
  int64_t total = 0;
  for (int64_t s : group_sizes) {
    XMOE_CHECK(s >= 0, "[{}] negative group size {}", op, s);
    total += s;
  }
  XMOE_CHECK(total == rows, "[{}] group sizes sum to {} but x has {} rows", op, total, rows);
}
}  // namespace

Tensor grouped_matmul(const Tensor& x, const Tensor& w, std::span<const int64_t> group_sizes,
                      bool trans_w) {
  XMOE_CHECK(w.dim() == 3, "[grouped_matmul] w must be [G, K, M], got {}", shape_str(w.shape()));
  Tensor y = Tensor::empty({x.size(0), trans_w ? w.size(1) : w.size(2)}, x.dtype(), x.device());
  grouped_matmul_into(y, x, w, group_sizes, trans_w);
  return y;
}

void grouped_matmul_into(Tensor& y, const Tensor& x, const Tensor& w,
                         std::span<const int64_t> group_sizes, bool trans_w) {
  const char* op = "grouped_matmul";
  require_float(op, "x", x);
  require_like(op, "w", w, "x", x);
  require_like(op, "y", y, "x", x);
  require_2d(op, "x", x);
  XMOE_CHECK(w.dim() == 3, "[{}] w must be [G, K, M], got {}", op, shape_str(w.shape()));
  const int64_t groups = w.size(0);
  const int64_t k = trans_w ? w.size(2) : w.size(1), m = trans_w ? w.size(1) : w.size(2);
  XMOE_CHECK(x.size(1) == k, "[{}] x has {} columns but w{} has inner dimension {}", op, x.size(1),
             trans_w ? "^T" : "", k);
  check_groups(op, group_sizes, groups, x.size(0));
  check_shape(y, {x.size(0), m}, op, "y");
  if (x.is_cpu()) {
    cpu::grouped_gemm(y.data<float>(), x.data<float>(), w.data<float>(), group_sizes.data(), groups,
                      k, m, trans_w);
  } else {
    cuda::grouped_gemm(y.raw(), x.raw(), w.raw(), x.dtype(), group_sizes.data(), groups, k, m,
                       trans_w, stream_of(x));
  }
}

void grouped_matmul_weight_grad(Tensor& dw, const Tensor& x, const Tensor& dy,
                                std::span<const int64_t> group_sizes, bool accumulate) {
  const char* op = "grouped_matmul_weight_grad";
  require_float(op, "x", x);
  require_like(op, "dy", dy, "x", x);
  // dw: f32, or bf16 (moe.expert_grad_dtype) whatever x's dtype
  require_same_device(op, "dw", dw, "x", x);
  XMOE_CHECK(detail::is_float(dw.dtype()), "[{}] dw must be f32 or bf16, got {}", op, dw.str());
  XMOE_CHECK(dw.dim() == 3, "[{}] dw must be [G, K, M], got {}", op, shape_str(dw.shape()));
  check_shape(x, {-1, dw.size(1)}, op, "x");
  check_shape(dy, {x.size(0), dw.size(2)}, op, "dy");
  check_groups(op, group_sizes, dw.size(0), x.size(0));
  if (dw.dtype() == DType::bf16 && x.dtype() == DType::f32) {
    // bf16 gradients of an f32 model (moe.expert_grad_dtype; the CPU): f32 GEMMs into an f32
    // copy, rounded once into dw.
    Tensor dw32 =
        accumulate ? cast(dw, DType::f32) : Tensor::empty(dw.shape(), DType::f32, dw.device());
    grouped_matmul_weight_grad(dw32, x, dy, group_sizes, accumulate);
    dw.copy_from(cast(dw32, DType::bf16));
    return;
  }
  if (x.is_cpu()) {
    cpu::grouped_gemm_weight_grad(dw.data<float>(), x.data<float>(), dy.data<float>(),
                                  group_sizes.data(), dw.size(0), dw.size(1), dw.size(2),
                                  accumulate);
  } else {
    cuda::grouped_gemm_weight_grad(dw.raw(), dw.dtype(), x.raw(), dy.raw(), x.dtype(),
                                   group_sizes.data(), dw.size(0), dw.size(1), dw.size(2),
                                   accumulate, stream_of(x));
  }
}

// ---- activations ----------------------------------------------------------------------------

Tensor softmax(const Tensor& x) {
  require_float("softmax", "x", x);
  const auto [rows, cols] = rows_cols(x);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (x.is_cpu()) {
    cpu::softmax_forward(y.data<float>(), x.data<float>(), rows, cols);
  } else {
    cuda::softmax_forward(y.raw(), x.raw(), x.dtype(), rows, cols, stream_of(x));
  }
  return y;
}

Tensor softmax_backward(const Tensor& y, const Tensor& dy) {
  require_float("softmax_backward", "y", y);
  require_like("softmax_backward", "dy", dy, "y", y);
  check_shape(dy, y.shape(), "softmax_backward", "dy");
  const auto [rows, cols] = rows_cols(y);
  Tensor dx = Tensor::empty(y.shape(), y.dtype(), y.device());
  if (y.is_cpu()) {
    cpu::softmax_backward(dx.data<float>(), y.data<float>(), dy.data<float>(), rows, cols);
  } else {
    cuda::softmax_backward(dx.raw(), y.raw(), dy.raw(), y.dtype(), rows, cols, stream_of(y));
  }
  return dx;
}

Tensor sigmoid(const Tensor& x) {
  require_float("sigmoid", "x", x);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (x.is_cpu()) {
    cpu::sigmoid_forward(y.data<float>(), x.data<float>(), x.numel());
  } else {
    cuda::sigmoid_forward(y.raw(), x.raw(), x.dtype(), x.numel(), stream_of(x));
  }
  return y;
}

Tensor sigmoid_backward(const Tensor& y, const Tensor& dy) {
  require_float("sigmoid_backward", "y", y);
  require_like("sigmoid_backward", "dy", dy, "y", y);
  check_shape(dy, y.shape(), "sigmoid_backward", "dy");
  Tensor dx = Tensor::empty(y.shape(), y.dtype(), y.device());
  if (y.is_cpu()) {
    cpu::sigmoid_backward(dx.data<float>(), y.data<float>(), dy.data<float>(), y.numel());
  } else {
    cuda::sigmoid_backward(dx.raw(), y.raw(), dy.raw(), y.dtype(), y.numel(), stream_of(y));
  }
  return dx;
}

Tensor swiglu(const Tensor& h) {
  require_float("swiglu", "h", h);
  require_2d("swiglu", "h", h);
  XMOE_CHECK(h.size(1) % 2 == 0, "[swiglu] h must be [N, 2f], got {}", shape_str(h.shape()));
  const int64_t f = h.size(1) / 2;
  Tensor a = Tensor::empty({h.size(0), f}, h.dtype(), h.device());
  if (h.is_cpu()) {
    cpu::swiglu_forward(a.data<float>(), h.data<float>(), h.size(0), f);
  } else {
    cuda::swiglu_forward(a.raw(), h.raw(), h.dtype(), h.size(0), f, stream_of(h));
  }
  return a;
}

namespace {
/// dh may be h itself and value da: both kernels read a row's gate, up and da before writing.
void swiglu_backward_into(Tensor& dh, const Tensor& h, const Tensor& da, Tensor* value = nullptr) {
  require_float("swiglu_backward", "h", h);
  require_like("swiglu_backward", "da", da, "h", h);
  require_2d("swiglu_backward", "h", h);
  check_shape(da, {h.size(0), h.size(1) / 2}, "swiglu_backward", "da");
  if (h.is_cpu()) {
    cpu::swiglu_backward(dh.data<float>(), h.data<float>(), da.data<float>(), h.size(0),
                         h.size(1) / 2, value ? value->data<float>() : nullptr);
  } else {
    cuda::swiglu_backward(dh.raw(), h.raw(), da.raw(), h.dtype(), h.size(0), h.size(1) / 2,
                          stream_of(h), value ? value->raw() : nullptr);
  }
}
}  // namespace

Tensor swiglu_backward(const Tensor& h, const Tensor& da) {
  Tensor dh = Tensor::empty(h.shape(), h.dtype(), h.device());
  swiglu_backward_into(dh, h, da);
  return dh;
}

void swiglu_backward_(Tensor& h, const Tensor& da) {
  swiglu_backward_into(h, h, da);
}

void swiglu_backward_with_value_(Tensor& h, Tensor& da) {
  swiglu_backward_into(h, h, da, &da);
}

// ---- normalisation --------------------------------------------------------------------------

RmsNormResult rmsnorm(const Tensor& x, const Tensor& weight, float eps) {
  return rmsnorm(x, weight, eps, x.dtype());
}

namespace {
/// The norm of x (+ a when defined, written to sum) in y_dtype: rmsnorm's and add_rmsnorm's one
/// pass. The CPU computes in f32 and casts y to y_dtype.
AddRmsNormResult norm_of_sum(const char* op, const Tensor& x, const Tensor& a, const Tensor& weight,
                             float eps, DType y_dtype) {
  require_float(op, "x", x);
  require_like_or_f32(op, "weight", weight, "x", x);
  const auto [rows, d] = rows_cols(x);
  check_shape(weight, {d}, op, "weight");
  XMOE_CHECK(eps > 0, "[{}] eps must be positive, got {}", op, eps);
  if (a.defined()) {
    require_same_device(op, "a", a, "x", x);
    require_float(op, "a", a);
    check_shape(a, x.shape(), op, "a");
  }
  AddRmsNormResult r{a.defined() ? Tensor::empty(x.shape(), x.dtype(), x.device()) : Tensor(),
                     Tensor::empty(x.shape(), x.is_cpu() ? x.dtype() : y_dtype, x.device()),
                     Tensor::empty({rows}, DType::f32, x.device())};
  if (x.is_cpu()) {
    cpu::add_rmsnorm_forward(r.y.data<float>(), a.defined() ? r.sum.data<float>() : nullptr,
                             r.rstd.data<float>(), x.data<float>(),
                             a.defined() ? a.data<float>() : nullptr, weight.data<float>(), rows, d,
                             eps);
    if (y_dtype != r.y.dtype()) r.y = cast(r.y, y_dtype);
    return r;
  }
  cuda::RmsNormArgs g;
  g.y = r.y.raw();
  g.y_dt = y_dtype;
  g.sum = a.defined() ? r.sum.raw() : nullptr;
  g.rstd = r.rstd.data<float>();
  g.x = x.raw();
  g.x_dt = x.dtype();
  g.a = a.defined() ? a.raw() : nullptr;
  g.a_dt = a.defined() ? a.dtype() : x.dtype();
  g.w = weight.raw();
  g.w_dt = weight.dtype();
  g.rows = rows;
  g.d = d;
  g.eps = eps;
  cuda::rmsnorm_forward(g, stream_of(x));
  return r;
}
}  // namespace

RmsNormResult rmsnorm(const Tensor& x, const Tensor& weight, float eps, DType y_dtype) {
  AddRmsNormResult r = norm_of_sum("rmsnorm", x, Tensor(), weight, eps, y_dtype);
  return {std::move(r.y), std::move(r.rstd)};
}

AddRmsNormResult add_rmsnorm(const Tensor& x, const Tensor& a, const Tensor& weight, float eps,
                             DType y_dtype) {
  require_defined("add_rmsnorm", "a", a);
  return norm_of_sum("add_rmsnorm", x, a, weight, eps, y_dtype);
}

Tensor rmsnorm_backward(const Tensor& x, const Tensor& weight, const Tensor& rstd, const Tensor& dy,
                        Tensor& dweight) {
  require_like("rmsnorm_backward", "dy", dy, "x", x);
  return rmsnorm_backward_add(x, weight, rstd, dy, dweight, Tensor(), x.dtype()).dx;
}

RmsNormGrad rmsnorm_backward_add(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                 const Tensor& dy, Tensor& dweight, const Tensor& residual,
                                 DType copy_dtype) {
  const char* op = "rmsnorm_backward";
  require_float(op, "x", x);
  require_same_device(op, "dy", dy, "x", x);
  require_float(op, "dy", dy);
  require_like_or_f32(op, "weight", weight, "x", x);
  require_like(op, "dweight", dweight, "weight", weight);
  require_on(op, "rstd", rstd, DType::f32, "x", x);
  const auto [rows, d] = rows_cols(x);
  check_shape(dy, x.shape(), op, "dy");
  check_shape(weight, {d}, op, "weight");
  check_shape(dweight, {d}, op, "dweight");
  check_shape(rstd, {rows}, op, "rstd");
  if (residual.defined()) {
    require_like(op, "residual", residual, "x", x);
    check_shape(residual, x.shape(), op, "residual");
  }
  const bool copy = copy_dtype != x.dtype();
  XMOE_CHECK(!copy || copy_dtype == DType::bf16, "[{}] dx's copy must be bf16, got {}", op,
             dtype_name(copy_dtype));
  RmsNormGrad r{Tensor::empty(x.shape(), x.dtype(), x.device()), Tensor()};
  if (x.is_cpu()) {
    cpu::rmsnorm_backward(r.dx.data<float>(), dweight.data<float>(), x.data<float>(),
                          weight.data<float>(), rstd.data<float>(), dy.data<float>(), rows, d,
                          residual.defined() ? residual.data<float>() : nullptr);
    if (copy) r.dx_copy = cast(r.dx, copy_dtype);
    return r;
  }
  if (copy) r.dx_copy = Tensor::empty(x.shape(), copy_dtype, x.device());
  Tensor ws = Tensor::empty({static_cast<int64_t>(cuda::rmsnorm_backward_workspace_bytes(rows, d))},
                            DType::u8, x.device());
  cuda::RmsNormGradArgs g;
  g.dx = r.dx.raw();
  g.dx_copy = copy ? r.dx_copy.raw() : nullptr;
  g.dw = dweight.raw();
  g.x = x.raw();
  g.x_dt = x.dtype();
  g.w = weight.raw();
  g.w_dt = weight.dtype();
  g.rstd = rstd.data<float>();
  g.dy = dy.raw();
  g.dy_dt = dy.dtype();
  g.residual = residual.defined() ? residual.raw() : nullptr;
  g.rows = rows;
  g.d = d;
  cuda::rmsnorm_backward(g, ws.raw(), stream_of(x));
  return r;
}

// ---- selection and indexing -----------------------------------------------------------------

TopKResult topk(const Tensor& x, int64_t k) {
  require_float("topk", "x", x);
  require_2d("topk", "x", x);
  XMOE_CHECK(k >= 1 && k <= x.size(1), "[topk] k = {} must be in [1, {}] (columns of x)", k,
             x.size(1));
  TopKResult r{Tensor::empty({x.size(0), k}, x.dtype(), x.device()),
               Tensor::empty({x.size(0), k}, DType::i32, x.device())};
  if (x.is_cpu()) {
    cpu::topk(r.values.data<float>(), r.indices.data<int32_t>(), x.data<float>(), x.size(0),
              x.size(1), k);
  } else {
    cuda::topk(r.values.raw(), r.indices.data<int32_t>(), x.raw(), x.dtype(), x.size(0), x.size(1),
               k, stream_of(x));
  }
  return r;
}

SoftmaxTopKResult softmax_topk(const Tensor& x, int64_t k) {
  require_float("softmax_topk", "x", x);
  require_2d("softmax_topk", "x", x);
  XMOE_CHECK(k >= 1 && k <= x.size(1), "[softmax_topk] k = {} must be in [1, {}] (columns of x)", k,
             x.size(1));
  if (x.is_cpu()) {
    Tensor probs = softmax(x);
    TopKResult top = topk(probs, k);
    return {std::move(probs), std::move(top)};
  }
  SoftmaxTopKResult r{Tensor::empty(x.shape(), x.dtype(), x.device()),
                      {Tensor::empty({x.size(0), k}, x.dtype(), x.device()),
                       Tensor::empty({x.size(0), k}, DType::i32, x.device())}};
  cuda::softmax_topk(r.probs.raw(), r.top.values.raw(), r.top.indices.data<int32_t>(), x.raw(),
                     x.dtype(), x.size(0), x.size(1), k, stream_of(x));
  return r;
}

namespace {
/// i32 1-d index on x's device. Its values are checked on the CPU always, on CUDA only with
/// XMOE_CUDA_CHECK_INDICES=1 (the check waits for the device).
void check_index(const char* op, const Tensor& index, int64_t limit, const Tensor& ref,
                 const char* ref_name) {
  require_on(op, "index", index, DType::i32, ref_name, ref);
  XMOE_CHECK(index.dim() == 1, "[{}] index must be 1-d, got {}", op, shape_str(index.shape()));
  if (index.is_cpu() || detail::cuda_check_indices())
    detail::check_index_values(op, "index", index, limit, false);
}
}  // namespace

Tensor gather_rows(const Tensor& x, const Tensor& index) {
  require_float("gather_rows", "x", x);
  require_2d("gather_rows", "x", x);
  check_index("gather_rows", index, x.size(0), x, "x");
  Tensor out = Tensor::empty({index.numel(), x.size(1)}, x.dtype(), x.device());
  if (x.is_cpu()) {
    cpu::gather_rows(out.data<float>(), x.data<float>(), index.data<int32_t>(), index.numel(),
                     x.size(1));
  } else {
    cuda::gather_rows(out.raw(), x.raw(), x.dtype(), index.data<int32_t>(), index.numel(),
                      x.size(0), x.size(1), stream_of(x));
  }
  return out;
}

void scatter_add_rows(Tensor& out, const Tensor& src, const Tensor& index, const Tensor& weight) {
  const char* op = "scatter_add_rows";
  require_float(op, "out", out);
  require_2d(op, "out", out);
  require_same_device(op, "src", src, "out", out);
  require_float(op, "src", src);  // on CUDA src may be bf16 into an f32 out, or the other way
  check_shape(src, {index.numel(), out.size(1)}, op, "src");
  check_index(op, index, out.size(0), out, "out");
  if (weight.defined()) {
    require_same_device(op, "weight", weight, "out", out);
    require_float(op, "weight", weight);
    check_shape(weight, {index.numel()}, op, "weight");
  }
  if (out.is_cpu()) {
    cpu::scatter_add_rows(out.data<float>(), src.data<float>(), index.data<int32_t>(),
                          weight.defined() ? weight.data<float>() : nullptr, index.numel(),
                          out.size(0), out.size(1));
  } else {
    const cuda::Stream s = stream_of(out);
    const size_t bytes = cuda::scatter_add_rows_workspace_bytes(index.numel(), out.size(0));
    Tensor ws = Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8, out.device());
    cuda::scatter_add_rows(out.raw(), out.dtype(), src.raw(), src.dtype(), index.data<int32_t>(),
                           weight.defined() ? weight.raw() : nullptr,
                           weight.defined() ? weight.dtype() : DType::f32, index.numel(),
                           out.size(0), out.size(1), ws.raw(), bytes, s);
  }
}

Tensor row_dot(const Tensor& a, const Tensor& b) {
  require_float("row_dot", "a", a);
  require_like("row_dot", "b", b, "a", a);
  require_2d("row_dot", "a", a);
  check_shape(b, a.shape(), "row_dot", "b");
  Tensor out = Tensor::empty({a.size(0)}, a.dtype(), a.device());
  if (a.is_cpu()) {
    cpu::row_dot(out.data<float>(), a.data<float>(), b.data<float>(), a.size(0), a.size(1));
  } else {
    cuda::row_dot(out.raw(), a.raw(), b.raw(), a.dtype(), a.size(0), a.size(1), stream_of(a));
  }
  return out;
}

// ---- elementwise and reductions -------------------------------------------------------------

namespace {
void same_shape(const char* op, const Tensor& a, const Tensor& b) {
  require_float(op, "a", a);
  require_like(op, "b", b, "a", a);
  XMOE_CHECK(a.numel() == b.numel(), "[{}] shapes differ: {} vs {}", op, shape_str(a.shape()),
             shape_str(b.shape()));
}

/// One value reduced on the device (deterministic), copied to the host (waits for the stream).
double cuda_reduce(const Tensor& x, cuda::Reduction kind) {
  const cuda::Stream s = stream_of(x);
  // [result double | partials], the partials 256-byte aligned
  const size_t ws = cuda::reduce_workspace_bytes(x.numel());
  Tensor buf = Tensor::empty({static_cast<int64_t>(256 + ws)}, DType::u8, x.device());
  auto* result = static_cast<double*>(buf.raw());
  cuda::reduce(result, x.raw(), x.dtype(), x.numel(), kind, static_cast<char*>(buf.raw()) + 256, s);
  double value = 0;
  backend::copy_bytes(&value, Device::cpu(), result, x.device(), sizeof(double));
  return value;
}
}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  if (!a.is_cpu()) {  // b may be bf16 with an f32 a, or the other way round: c is of a's dtype
    require_float("add", "a", a);
    require_same_device("add", "b", b, "a", a);
    require_float("add", "b", b);
    XMOE_CHECK(a.numel() == b.numel(), "[add] shapes differ: {} vs {}", shape_str(a.shape()),
               shape_str(b.shape()));
    Tensor c = Tensor::empty(a.shape(), a.dtype(), a.device());
    cuda::add(c.raw(), a.raw(), a.dtype(), b.raw(), b.dtype(), a.numel(), stream_of(a));
    return c;
  }
  same_shape("add", a, b);
  Tensor c = a.clone();
  add_(c, b);
  return c;
}

void add_(Tensor& a, const Tensor& b, float alpha) {
  if (!a.is_cpu()) {  // b may be bf16 into an f32 a, or the other way round
    require_float("add_", "a", a);
    require_same_device("add_", "b", b, "a", a);
    require_float("add_", "b", b);
    XMOE_CHECK(a.numel() == b.numel(), "[add_] shapes differ: {} vs {}", shape_str(a.shape()),
               shape_str(b.shape()));
    cuda::add_inplace(a.raw(), a.dtype(), b.raw(), b.dtype(), alpha, a.numel(), stream_of(a));
    return;
  }
  same_shape("add_", a, b);
  float* pa = a.data<float>();
  const float* pb = b.data<float>();
  const int64_t n = a.numel();
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) pa[i] += alpha * pb[i];
}

Tensor mul(const Tensor& a, const Tensor& b) {
  same_shape("mul", a, b);
  Tensor c = Tensor::empty(a.shape(), a.dtype(), a.device());
  if (!a.is_cpu()) {
    cuda::mul(c.raw(), a.raw(), b.raw(), a.dtype(), a.numel(), stream_of(a));
    return c;
  }
  const float *pa = a.data<float>(), *pb = b.data<float>();
  float* pc = c.data<float>();
  for (int64_t i = 0; i < a.numel(); ++i) pc[i] = pa[i] * pb[i];
  return c;
}

namespace {
/// CPU tensors these ops read as f32: f32 ones, and bf16 ones (moe.expert_grad_dtype gradients)
/// through an f32 copy.
bool cpu_bf16(const Tensor& x) {
  return x.defined() && x.is_cpu() && x.dtype() == DType::bf16;
}
}  // namespace

void scale_(Tensor& a, float s) {
  if (cpu_bf16(a)) {
    Tensor a32 = a.to(DType::f32);
    scale_(a32, s);
    a.copy_from(a32.to(DType::bf16));
    return;
  }
  require_float("scale_", "a", a);
  if (!a.is_cpu()) {
    cuda::scale_inplace(a.raw(), a.dtype(), s, a.numel(), stream_of(a));
    return;
  }
  float* p = a.data<float>();
  const int64_t n = a.numel();
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) p[i] *= s;
}

double sum(const Tensor& x) {
  require_float("sum", "x", x);
  if (!x.is_cpu()) return cuda_reduce(x, cuda::Reduction::sum);
  const float* p = x.data<float>();
  double s = 0;
  for (int64_t i = 0; i < x.numel(); ++i) s += p[i];
  return s;
}

double sum_squares(const Tensor& x) {
  if (cpu_bf16(x)) return sum_squares(x.to(DType::f32));
  require_float("sum_squares", "x", x);
  if (!x.is_cpu()) return cuda_reduce(x, cuda::Reduction::sum_squares);
  // Fixed chunks summed in order: the same bits for any thread count (the gradient norm of
  // every step goes through here).
  constexpr int64_t kChunk = int64_t{1} << 15;
  const float* p = x.data<float>();
  const int64_t n = x.numel(), chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    double s = 0;
    for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i)
      s += static_cast<double>(p[i]) * p[i];
    partial[static_cast<size_t>(c)] = s;
  }
  double s = 0;
  for (const double v : partial) s += v;
  return s;
}

bool all_finite(const Tensor& x) {
  if (cpu_bf16(x)) return all_finite(x.to(DType::f32));
  require_float("all_finite", "x", x);
  if (!x.is_cpu()) return cuda_reduce(x, cuda::Reduction::count_nonfinite) == 0.0;
  const float* p = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i)
    if (!std::isfinite(p[i])) return false;
  return true;
}

Tensor cast(const Tensor& x, DType dtype) {
  require_defined("cast", "x", x);
  XMOE_CHECK(detail::is_float(x.dtype()) && detail::is_float(dtype),
             "[cast] {} -> {}: only f32 <-> bf16 casts are supported", dtype_name(x.dtype()),
             dtype_name(dtype));
  if (x.is_cpu()) return x.to(dtype);
  Tensor y = Tensor::empty(x.shape(), dtype, x.device());
  cuda::cast(y.raw(), dtype, x.raw(), x.dtype(), x.numel(), stream_of(x));
  return y;
}

}  // namespace xmoe::ops
