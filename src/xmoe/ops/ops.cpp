#include "xmoe/ops/ops.h"

#include <cmath>
#include <numeric>

#include "xmoe/backend/cpu/kernels.h"
#include "xmoe/ops/dispatch.h"

namespace xmoe::ops {

using detail::require_2d;
using detail::require_f32;
using detail::rows_cols;

// ---- linear algebra -------------------------------------------------------------------------

namespace {
struct MatmulDims {
  int64_t m, n, k;
};

MatmulDims matmul_dims(const char* op, const Tensor& a, const Tensor& b, bool ta, bool tb) {
  require_f32(op, "a", a);
  require_f32(op, "b", b);
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
  Tensor c = Tensor::empty({m, n});
  cpu::gemm(c.data<float>(), a.data<float>(), b.data<float>(), m, n, k, trans_a, trans_b, 1.f,
            0.f);
  return c;
}

void matmul_into(Tensor& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                 float alpha, float beta) {
  const auto [m, n, k] = matmul_dims("matmul_into", a, b, trans_a, trans_b);
  require_f32("matmul_into", "c", c);
  check_shape(c, {m, n}, "matmul_into", "c");
  cpu::gemm(c.data<float>(), a.data<float>(), b.data<float>(), m, n, k, trans_a, trans_b, alpha,
            beta);
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
  const char* op = "grouped_matmul";
  require_f32(op, "x", x);
  require_f32(op, "w", w);
  require_2d(op, "x", x);
  XMOE_CHECK(w.dim() == 3, "[{}] w must be [G, K, M], got {}", op, shape_str(w.shape()));
  const int64_t groups = w.size(0);
  const int64_t k = trans_w ? w.size(2) : w.size(1), m = trans_w ? w.size(1) : w.size(2);
  XMOE_CHECK(x.size(1) == k, "[{}] x has {} columns but w{} has inner dimension {}", op, x.size(1),
             trans_w ? "^T" : "", k);
  check_groups(op, group_sizes, groups, x.size(0));
  Tensor y = Tensor::empty({x.size(0), m});
  cpu::grouped_gemm(y.data<float>(), x.data<float>(), w.data<float>(), group_sizes.data(), groups,
                    k, m, trans_w);
  return y;
}

void grouped_matmul_weight_grad(Tensor& dw, const Tensor& x, const Tensor& dy,
                                std::span<const int64_t> group_sizes, bool accumulate) {
  const char* op = "grouped_matmul_weight_grad";
  require_f32(op, "dw", dw);
  require_f32(op, "x", x);
  require_f32(op, "dy", dy);
  XMOE_CHECK(dw.dim() == 3, "[{}] dw must be [G, K, M], got {}", op, shape_str(dw.shape()));
  check_shape(x, {-1, dw.size(1)}, op, "x");
  check_shape(dy, {x.size(0), dw.size(2)}, op, "dy");
  check_groups(op, group_sizes, dw.size(0), x.size(0));
  cpu::grouped_gemm_weight_grad(dw.data<float>(), x.data<float>(), dy.data<float>(),
                                group_sizes.data(), dw.size(0), dw.size(1), dw.size(2),
                                accumulate);
}

// ---- activations ----------------------------------------------------------------------------

Tensor softmax(const Tensor& x) {
  require_f32("softmax", "x", x);
  const auto [rows, cols] = rows_cols(x);
  Tensor y = Tensor::empty(x.shape());
  cpu::softmax_forward(y.data<float>(), x.data<float>(), rows, cols);
  return y;
}

Tensor softmax_backward(const Tensor& y, const Tensor& dy) {
  require_f32("softmax_backward", "y", y);
  require_f32("softmax_backward", "dy", dy);
  check_shape(dy, y.shape(), "softmax_backward", "dy");
  const auto [rows, cols] = rows_cols(y);
  Tensor dx = Tensor::empty(y.shape());
  cpu::softmax_backward(dx.data<float>(), y.data<float>(), dy.data<float>(), rows, cols);
  return dx;
}

Tensor sigmoid(const Tensor& x) {
  require_f32("sigmoid", "x", x);
  Tensor y = Tensor::empty(x.shape());
  cpu::sigmoid_forward(y.data<float>(), x.data<float>(), x.numel());
  return y;
}

Tensor sigmoid_backward(const Tensor& y, const Tensor& dy) {
  require_f32("sigmoid_backward", "y", y);
  require_f32("sigmoid_backward", "dy", dy);
  check_shape(dy, y.shape(), "sigmoid_backward", "dy");
  Tensor dx = Tensor::empty(y.shape());
  cpu::sigmoid_backward(dx.data<float>(), y.data<float>(), dy.data<float>(), y.numel());
  return dx;
}

Tensor swiglu(const Tensor& h) {
  require_f32("swiglu", "h", h);
  require_2d("swiglu", "h", h);
  XMOE_CHECK(h.size(1) % 2 == 0, "[swiglu] h must be [N, 2f], got {}", shape_str(h.shape()));
  const int64_t f = h.size(1) / 2;
  Tensor a = Tensor::empty({h.size(0), f});
  cpu::swiglu_forward(a.data<float>(), h.data<float>(), h.size(0), f);
  return a;
}

Tensor swiglu_backward(const Tensor& h, const Tensor& da) {
  require_f32("swiglu_backward", "h", h);
  require_f32("swiglu_backward", "da", da);
  require_2d("swiglu_backward", "h", h);
  check_shape(da, {h.size(0), h.size(1) / 2}, "swiglu_backward", "da");
  Tensor dh = Tensor::empty(h.shape());
  cpu::swiglu_backward(dh.data<float>(), h.data<float>(), da.data<float>(), h.size(0),
                       h.size(1) / 2);
  return dh;
}

// ---- normalisation --------------------------------------------------------------------------

RmsNormResult rmsnorm(const Tensor& x, const Tensor& weight, float eps) {
  require_f32("rmsnorm", "x", x);
  require_f32("rmsnorm", "weight", weight);
  const auto [rows, d] = rows_cols(x);
  check_shape(weight, {d}, "rmsnorm", "weight");
  XMOE_CHECK(eps > 0, "[rmsnorm] eps must be positive, got {}", eps);
  RmsNormResult r{Tensor::empty(x.shape()), Tensor::empty({rows})};
  cpu::rmsnorm_forward(r.y.data<float>(), r.rstd.data<float>(), x.data<float>(),
                       weight.data<float>(), rows, d, eps);
  return r;
}

Tensor rmsnorm_backward(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                        const Tensor& dy, Tensor& dweight) {
  const char* op = "rmsnorm_backward";
  require_f32(op, "x", x);
  require_f32(op, "dy", dy);
  require_f32(op, "dweight", dweight);
  const auto [rows, d] = rows_cols(x);
  check_shape(dy, x.shape(), op, "dy");
  check_shape(weight, {d}, op, "weight");
  check_shape(dweight, {d}, op, "dweight");
  check_shape(rstd, {rows}, op, "rstd");
  Tensor dx = Tensor::empty(x.shape());
  cpu::rmsnorm_backward(dx.data<float>(), dweight.data<float>(), x.data<float>(),
                        weight.data<float>(), rstd.data<float>(), dy.data<float>(), rows, d);
  return dx;
}

// ---- selection and indexing -----------------------------------------------------------------

TopKResult topk(const Tensor& x, int64_t k) {
  require_f32("topk", "x", x);
  require_2d("topk", "x", x);
  XMOE_CHECK(k >= 1 && k <= x.size(1), "[topk] k = {} must be in [1, {}] (columns of x)", k,
             x.size(1));
  TopKResult r{Tensor::empty({x.size(0), k}), Tensor::empty({x.size(0), k}, DType::i32)};
  cpu::topk(r.values.data<float>(), r.indices.data<int32_t>(), x.data<float>(), x.size(0),
            x.size(1), k);
  return r;
}

namespace {
void check_index(const char* op, const Tensor& index, int64_t limit) {
  detail::require_cpu(op, "index", index, DType::i32);
  XMOE_CHECK(index.dim() == 1, "[{}] index must be 1-d, got {}", op, shape_str(index.shape()));
  const int32_t* p = index.data<int32_t>();
  for (int64_t i = 0; i < index.numel(); ++i)
    XMOE_CHECK(p[i] >= 0 && p[i] < limit, "[{}] index[{}] = {} out of range [0, {})", op, i, p[i],
               limit);
}
}  // namespace

Tensor gather_rows(const Tensor& x, const Tensor& index) {
  require_f32("gather_rows", "x", x);
  require_2d("gather_rows", "x", x);
  check_index("gather_rows", index, x.size(0));
  Tensor out = Tensor::empty({index.numel(), x.size(1)});
  cpu::gather_rows(out.data<float>(), x.data<float>(), index.data<int32_t>(), index.numel(),
                   x.size(1));
  return out;
}

void scatter_add_rows(Tensor& out, const Tensor& src, const Tensor& index, const Tensor& weight) {
  const char* op = "scatter_add_rows";
  require_f32(op, "out", out);
  require_f32(op, "src", src);
  require_2d(op, "out", out);
  check_shape(src, {index.numel(), out.size(1)}, op, "src");
  check_index(op, index, out.size(0));
  if (weight.defined()) {
    require_f32(op, "weight", weight);
    check_shape(weight, {index.numel()}, op, "weight");
  }
  cpu::scatter_add_rows(out.data<float>(), src.data<float>(), index.data<int32_t>(),
                        weight.defined() ? weight.data<float>() : nullptr, index.numel(),
                        out.size(0), out.size(1));
}

Tensor row_dot(const Tensor& a, const Tensor& b) {
  require_f32("row_dot", "a", a);
  require_f32("row_dot", "b", b);
  require_2d("row_dot", "a", a);
  check_shape(b, a.shape(), "row_dot", "b");
  Tensor out = Tensor::empty({a.size(0)});
  cpu::row_dot(out.data<float>(), a.data<float>(), b.data<float>(), a.size(0), a.size(1));
  return out;
}

// ---- elementwise and reductions -------------------------------------------------------------

namespace {
void same_shape(const char* op, const Tensor& a, const Tensor& b) {
  require_f32(op, "a", a);
  require_f32(op, "b", b);
  XMOE_CHECK(a.numel() == b.numel(), "[{}] shapes differ: {} vs {}", op, shape_str(a.shape()),
             shape_str(b.shape()));
}
}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  same_shape("add", a, b);
  Tensor c = a.clone();
  add_(c, b);
  return c;
}

void add_(Tensor& a, const Tensor& b, float alpha) {
  same_shape("add_", a, b);
  float* pa = a.data<float>();
  const float* pb = b.data<float>();
  const int64_t n = a.numel();
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) pa[i] += alpha * pb[i];
}

Tensor mul(const Tensor& a, const Tensor& b) {
  same_shape("mul", a, b);
  Tensor c = Tensor::empty(a.shape());
  const float *pa = a.data<float>(), *pb = b.data<float>();
  float* pc = c.data<float>();
  for (int64_t i = 0; i < a.numel(); ++i) pc[i] = pa[i] * pb[i];
  return c;
}

void scale_(Tensor& a, float s) {
  require_f32("scale_", "a", a);
  float* p = a.data<float>();
  const int64_t n = a.numel();
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) p[i] *= s;
}

double sum(const Tensor& x) {
  require_f32("sum", "x", x);
  const float* p = x.data<float>();
  double s = 0;
  for (int64_t i = 0; i < x.numel(); ++i) s += p[i];
  return s;
}

double sum_squares(const Tensor& x) {
  require_f32("sum_squares", "x", x);
  const float* p = x.data<float>();
  double s = 0;
  for (int64_t i = 0; i < x.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
  return s;
}

bool all_finite(const Tensor& x) {
  require_f32("all_finite", "x", x);
  const float* p = x.data<float>();
  for (int64_t i = 0; i < x.numel(); ++i)
    if (!std::isfinite(p[i])) return false;
  return true;
}

}  // namespace xmoe::ops
