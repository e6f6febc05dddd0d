#include "xmoe/moe/moe_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace xmoe::moe {

namespace {
void require_cpu_f32(const char* op, const char* name, const Tensor& t) {
  XMOE_CHECK(t.defined(), "[{}] {} is undefined", op, name);
  XMOE_CHECK(t.is_cpu(), "[{}] {} is on {}; only the CPU is implemented", op, name,
             t.device().str());
  check_dtype(t, DType::f32, op, name);
}
void require_index(const char* op, const char* name, const Tensor& t) {
  XMOE_CHECK(t.defined() && t.is_cpu(), "[{}] {} must be a CPU tensor", op, name);
  check_dtype(t, DType::i32, op, name);
}
}  // namespace

Tensor gather_rows_masked(const Tensor& x, const Tensor& index) {
  const char* op = "gather_rows_masked";
  require_cpu_f32(op, "x", x);
  require_index(op, "index", index);
  check_shape(x, {-1, -1}, op, "x");
  const int64_t n = x.size(0), d = x.size(1), m = index.numel();
  Tensor out = Tensor::empty({m, d});
  const float* xs = x.data<float>();
  const int32_t* idx = index.data<int32_t>();
  for (int64_t i = 0; i < m; ++i)
    XMOE_CHECK(idx[i] < n, "[{}] index[{}] = {} out of range for x {}", op, i, idx[i],
               shape_str(x.shape()));
  float* o = out.data<float>();
#pragma omp parallel for schedule(static) if (m * d > (1 << 15))
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = idx[i];
    if (r < 0) {
      std::memset(o + i * d, 0, sizeof(float) * static_cast<size_t>(d));
    } else {
      std::memcpy(o + i * d, xs + r * d, sizeof(float) * static_cast<size_t>(d));
    }
  }
  return out;
}

void scatter_add_rows_masked(Tensor& out, const Tensor& src, const Tensor& index,
                             const Tensor& weight) {
  const char* op = "scatter_add_rows_masked";
  require_cpu_f32(op, "out", out);
  require_cpu_f32(op, "src", src);
  require_index(op, "index", index);
  check_shape(out, {-1, -1}, op, "out");
  const int64_t m = index.numel(), d = out.size(1), n = out.size(0);
  check_shape(src, {m, d}, op, "src");
  if (weight.defined()) {
    require_cpu_f32(op, "weight", weight);
    XMOE_CHECK(weight.numel() == m, "[{}] weight has {} elements, index {}", op, weight.numel(),
               m);
  }
  const int32_t* idx = index.data<int32_t>();
  for (int64_t i = 0; i < m; ++i)
    XMOE_CHECK(idx[i] < n, "[{}] index[{}] = {} out of range for out {}", op, i, idx[i],
               shape_str(out.shape()));
  const float* w = weight.defined() ? weight.data<float>() : nullptr;
  const float* s = src.data<float>();
  float* o = out.data<float>();
  // Sequential over i (rows may share a target), so the summation order is fixed.
  for (int64_t i = 0; i < m; ++i) {
    if (idx[i] < 0) continue;
    const float wi = w ? w[i] : 1.0f;
    float* orow = o + static_cast<int64_t>(idx[i]) * d;
    const float* srow = s + i * d;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) orow[j] += wi * srow[j];
  }
}

void scale_rows_(Tensor& x, const Tensor& w) {
  const char* op = "scale_rows_";
  require_cpu_f32(op, "x", x);
  require_cpu_f32(op, "w", w);
  check_shape(x, {-1, -1}, op, "x");
  const int64_t n = x.size(0), d = x.size(1);
  XMOE_CHECK(w.numel() == n, "[{}] w has {} elements for {} rows", op, w.numel(), n);
  float* xs = x.data<float>();
  const float* ws = w.data<float>();
#pragma omp parallel for schedule(static) if (n * d > (1 << 15))
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < d; ++j) xs[i * d + j] *= ws[i];
}

Tensor take_along_rows(const Tensor& x, const Tensor& idx) {
  const char* op = "take_along_rows";
  require_cpu_f32(op, "x", x);
  require_index(op, "idx", idx);
  check_shape(x, {-1, -1}, op, "x");
  const int64_t n = x.size(0), e = x.size(1);
  check_shape(idx, {n, -1}, op, "idx");
  const int64_t k = idx.size(1);
  Tensor out = Tensor::empty({n, k});
  const float* xs = x.data<float>();
  const int32_t* is = idx.data<int32_t>();
  float* o = out.data<float>();
  for (int64_t i = 0; i < n * k; ++i) {
    XMOE_CHECK(is[i] >= 0 && is[i] < e, "[{}] idx {} out of range [0, {})", op, is[i], e);
    o[i] = xs[(i / k) * e + is[i]];
  }
  return out;
}

void put_along_rows_add(Tensor& out, const Tensor& idx, const Tensor& src) {
  const char* op = "put_along_rows_add";
  require_cpu_f32(op, "out", out);
  require_cpu_f32(op, "src", src);
  require_index(op, "idx", idx);
  check_shape(out, {-1, -1}, op, "out");
  const int64_t n = out.size(0), e = out.size(1);
  check_shape(idx, {n, -1}, op, "idx");
  check_shape(src, idx.shape(), op, "src");
  const int64_t k = idx.size(1);
  const int32_t* is = idx.data<int32_t>();
  const float* s = src.data<float>();
  float* o = out.data<float>();
  for (int64_t i = 0; i < n * k; ++i) {
    XMOE_CHECK(is[i] >= 0 && is[i] < e, "[{}] idx {} out of range [0, {})", op, is[i], e);
    o[(i / k) * e + is[i]] += s[i];
  }
}

Tensor transpose(const Tensor& x) {
  require_cpu_f32("transpose", "x", x);
  check_shape(x, {-1, -1}, "transpose", "x");
  const int64_t m = x.size(0), n = x.size(1);
  Tensor y = Tensor::empty({n, m});
  const float* xs = x.data<float>();
  float* ys = y.data<float>();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) ys[j * m + i] = xs[i * n + j];
  return y;
}

L2NormResult l2_normalize_rows(const Tensor& x, float eps) {
  require_cpu_f32("l2_normalize_rows", "x", x);
  check_shape(x, {-1, -1}, "l2_normalize_rows", "x");
  const int64_t n = x.size(0), d = x.size(1);
  L2NormResult r{Tensor::empty({n, d}), Tensor::empty({n})};
  const float* xs = x.data<float>();
  float* ys = r.y.data<float>();
  float* ns = r.norm.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(xs[i * d + j]) * xs[i * d + j];
    const float nrm = std::max(static_cast<float>(std::sqrt(ss)), eps);
    ns[i] = nrm;
    for (int64_t j = 0; j < d; ++j) ys[i * d + j] = xs[i * d + j] / nrm;
  }
  return r;
}

Tensor l2_normalize_rows_backward(const Tensor& y, const Tensor& norm, const Tensor& dy) {
  const char* op = "l2_normalize_rows_backward";
  require_cpu_f32(op, "y", y);
  require_cpu_f32(op, "norm", norm);
  require_cpu_f32(op, "dy", dy);
  check_shape(dy, y.shape(), op, "dy");
  const int64_t n = y.size(0), d = y.size(1);
  XMOE_CHECK(norm.numel() == n, "[{}] norm has {} elements for {} rows", op, norm.numel(), n);
  Tensor dx = Tensor::empty({n, d});
  const float* ys = y.data<float>();
  const float* ns = norm.data<float>();
  const float* g = dy.data<float>();
  float* o = dx.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    float dot = 0.f;
    for (int64_t j = 0; j < d; ++j) dot += ys[i * d + j] * g[i * d + j];
    for (int64_t j = 0; j < d; ++j) o[i * d + j] = (g[i * d + j] - ys[i * d + j] * dot) / ns[i];
  }
  return dx;
}

Tensor renormalize_rows(const Tensor& v, float scale, Tensor& sums) {
  require_cpu_f32("renormalize_rows", "v", v);
  check_shape(v, {-1, -1}, "renormalize_rows", "v");
  const int64_t n = v.size(0), k = v.size(1);
  Tensor w = Tensor::empty({n, k});
  sums = Tensor::empty({n});
  const float* vs = v.data<float>();
  float* ws = w.data<float>();
  float* ss = sums.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < k; ++j) s += vs[i * k + j];
    s = std::max(s, 1e-20f);  // scores are positive; the clamp only guards against underflow
    ss[i] = s;
    for (int64_t j = 0; j < k; ++j) ws[i * k + j] = scale * vs[i * k + j] / s;
  }
  return w;
}

Tensor renormalize_rows_backward(const Tensor& w, const Tensor& sums, const Tensor& dw,
                                 float scale) {
  const char* op = "renormalize_rows_backward";
  require_cpu_f32(op, "w", w);
  require_cpu_f32(op, "dw", dw);
  check_shape(dw, w.shape(), op, "dw");
  const int64_t n = w.size(0), k = w.size(1);
  Tensor dv = Tensor::empty({n, k});
  const float* ws = w.data<float>();
  const float* g = dw.data<float>();
  const float* ss = sums.data<float>();
  float* o = dv.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    float dot = 0.f;
    for (int64_t j = 0; j < k; ++j) dot += g[i * k + j] * ws[i * k + j];
    for (int64_t j = 0; j < k; ++j) o[i * k + j] = (scale * g[i * k + j] - dot) / ss[i];
  }
  return dv;
}

}  // namespace xmoe::moe
