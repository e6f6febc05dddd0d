#include "xmoe/moe/moe_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "xmoe/backend/cuda/moe_kernels.h"
#include "xmoe/ops/dispatch.h"
#include "xmoe/ops/ops.h"

namespace xmoe::moe {

using xmoe::ops::detail::stream_of;

namespace {
/// A float operand: f32 on the CPU, f32 or bf16 on CUDA.
void require_cpu_f32(const char* op, const char* name, const Tensor& t) {
  xmoe::ops::detail::require_float(op, name, t);
}
/// An operand of exactly `dtype` on ref's device (f32 weights and statistics beside bf16 rows).
void require_exact(const char* op, const char* name, const Tensor& t, DType dtype,
                   const char* ref_name, const Tensor& ref) {
  xmoe::ops::detail::require_on(op, name, t, dtype, ref_name, ref);
}
/// A float operand on ref's device with ref's dtype.
void require_like(const char* op, const char* name, const Tensor& t, const char* ref_name,
                  const Tensor& ref) {
  xmoe::ops::detail::require_like(op, name, t, ref_name, ref);
}
void require_index(const char* op, const char* name, const Tensor& t, const char* ref_name,
                   const Tensor& ref) {
  XMOE_CHECK(t.defined(), "[{}] {} is undefined", op, name);
  xmoe::ops::detail::require_on(op, name, t, DType::i32, ref_name, ref);
}
}  // namespace

Tensor gather_rows_masked(const Tensor& x, const Tensor& index) {
  const char* op = "gather_rows_masked";
  require_cpu_f32(op, "x", x);
  require_index(op, "index", index, "x", x);
  check_shape(x, {-1, -1}, op, "x");
  const int64_t n = x.size(0), d = x.size(1), m = index.numel();
  Tensor out = Tensor::empty({m, d}, x.dtype(), x.device());
  if (!x.is_cpu()) {
    // The launcher gives a zero row for any index outside [0, n), -1 included; the values are
    // checked on the host only when XMOE_CUDA_CHECK_INDICES asks (it waits for the stream).
    if (xmoe::ops::detail::cuda_check_indices())
      xmoe::ops::detail::check_index_values(op, "index", index, n, true);
    cuda::gather_rows(out.raw(), x.raw(), x.dtype(), index.data<int32_t>(), m, n, d,
                      stream_of(x));
    return out;
  }
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
  xmoe::ops::detail::require_same_device(op, "src", src, "out", out);
  require_index(op, "index", index, "out", out);
  check_shape(out, {-1, -1}, op, "out");
  const int64_t m = index.numel(), d = out.size(1), n = out.size(0);
  check_shape(src, {m, d}, op, "src");
  if (weight.defined()) {
    require_cpu_f32(op, "weight", weight);
    xmoe::ops::detail::require_same_device(op, "weight", weight, "out", out);
    XMOE_CHECK(weight.numel() == m, "[{}] weight has {} elements, index {}", op, weight.numel(),
               m);
  }
  if (!out.is_cpu()) {
    // Deterministic sorted scatter of the backend (index.cu); entries outside [0, n) — the -1
    // padding rows — are skipped.
    if (xmoe::ops::detail::cuda_check_indices())
      xmoe::ops::detail::check_index_values(op, "index", index, n, true);
    const cuda::Stream s = stream_of(out);
    const size_t bytes = cuda::scatter_add_rows_workspace_bytes(m, n);
    Tensor ws = Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8, out.device());
    cuda::scatter_add_rows(out.raw(), out.dtype(), src.raw(), src.dtype(), index.data<int32_t>(),
                           weight.defined() ? weight.raw() : nullptr,
                           weight.defined() ? weight.dtype() : DType::f32, m, n, d, ws.raw(),
                           bytes, s);
    return;
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

Tensor gather_sum_rows(const Tensor& src, const Tensor& slots, const Tensor& weight) {
  const char* op = "gather_sum_rows";
  require_cpu_f32(op, "src", src);
  require_index(op, "slots", slots, "src", src);
  check_shape(src, {-1, -1}, op, "src");
  check_shape(slots, {-1, -1}, op, "slots");
  const int64_t n = src.size(0), d = src.size(1), T = slots.size(0), k = slots.size(1);
  if (weight.defined()) {
    require_exact(op, "weight", weight, DType::f32, "src", src);
    XMOE_CHECK(weight.numel() == n, "[{}] weight has {} elements for {} rows", op, weight.numel(),
               n);
  }
  Tensor out = Tensor::empty({T, d}, src.dtype(), src.device());
  if (!src.is_cpu()) {
    XMOE_CHECK(k >= 1 && k <= 32, "[{}] {} slots per row; CUDA takes 1..32", op, k);
    if (xmoe::ops::detail::cuda_check_indices())
      xmoe::ops::detail::check_index_values(op, "slots", slots, n, true);
    cuda::gather_sum_rows(out.raw(), out.dtype(), src.raw(), src.dtype(), slots.data<int32_t>(),
                          weight.defined() ? weight.raw() : nullptr, DType::f32, T, k, n, d,
                          stream_of(src));
    return out;
  }
  const int32_t* sl = slots.data<int32_t>();
  for (int64_t i = 0; i < T * k; ++i)
    XMOE_CHECK(sl[i] < n, "[{}] slots[{}] = {} out of range for src {}", op, i, sl[i],
               shape_str(src.shape()));
  const float* w = weight.defined() ? weight.data<float>() : nullptr;
  const float* s = src.data<float>();
  float* o = out.data<float>();
#pragma omp parallel if (T * k * d > (1 << 15))
  {
    std::vector<int32_t> rows(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      size_t count = 0;
      for (int64_t j = 0; j < k; ++j)
        if (sl[t * k + j] >= 0) rows[count++] = sl[t * k + j];
      std::sort(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(count));
      float* orow = o + t * d;
      std::memset(orow, 0, sizeof(float) * static_cast<size_t>(d));
      for (size_t q = 0; q < count; ++q) {
        const float wi = w ? w[rows[q]] : 1.0f;
        const float* srow = s + static_cast<int64_t>(rows[q]) * d;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) orow[j] += wi * srow[j];
      }
    }
  }
  return out;
}

void scale_rows_(Tensor& x, const Tensor& w) {
  const char* op = "scale_rows_";
  require_cpu_f32(op, "x", x);
  require_exact(op, "w", w, DType::f32, "x", x);
  check_shape(x, {-1, -1}, op, "x");
  const int64_t n = x.size(0), d = x.size(1);
  XMOE_CHECK(w.numel() == n, "[{}] w has {} elements for {} rows", op, w.numel(), n);
  if (!x.is_cpu()) {
    cuda::moe_scale_rows(x.raw(), x.dtype(), w.data<float>(), n, d, stream_of(x));
    return;
  }
  float* xs = x.data<float>();
  const float* ws = w.data<float>();
#pragma omp parallel for schedule(static) if (n * d > (1 << 15))
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < d; ++j) xs[i * d + j] *= ws[i];
}

Tensor row_dot_f32(const Tensor& a, const Tensor& b) {
  const char* op = "row_dot_f32";
  require_cpu_f32(op, "a", a);
  require_like(op, "b", b, "a", a);
  check_shape(a, {-1, -1}, op, "a");
  check_shape(b, a.shape(), op, "b");
  if (a.is_cpu()) return xmoe::ops::row_dot(a, b);
  Tensor out = Tensor::empty({a.size(0)}, DType::f32, a.device());
  cuda::moe_row_dot_f32(out.data<float>(), a.raw(), b.raw(), a.dtype(), a.size(0), a.size(1),
                        stream_of(a));
  return out;
}

WeightedGather gather_weighted_rows_dot(const Tensor& dy, const Tensor& rows, const Tensor& index,
                                        const Tensor& weight, bool overwrite_rows) {
  const char* op = "gather_weighted_rows_dot";
  check_shape(rows, {-1, -1}, op, "rows");
  const int64_t n = rows.size(0), d = rows.size(1);
  check_shape(dy, {-1, d}, op, "dy");
  check_shape(index, {n}, op, "index");
  check_shape(weight, {n}, op, "weight");
  if (rows.is_cpu() && !overwrite_rows) {  // the reference: the three ops in sequence
    WeightedGather g;
    g.d_rows = gather_rows_masked(as_dtype(dy, rows.dtype()), index);
    g.dot = row_dot_f32(rows, g.d_rows);
    scale_rows_(g.d_rows, weight);
    return g;
  }
  if (rows.is_cpu()) {  // in place, row by row, with the reference's arithmetic
    require_cpu_f32(op, "rows", rows);
    require_cpu_f32(op, "dy", dy);
    require_index(op, "index", index, "rows", rows);
    xmoe::ops::detail::require_on(op, "weight", weight, DType::f32, "rows", rows);
    WeightedGather g{rows, Tensor::empty({n}, DType::f32)};
    float* r = g.d_rows.data<float>();
    float* dot = g.dot.data<float>();
    const float* src = dy.data<float>();
    const int32_t* idx = index.data<int32_t>();
    const float* w = weight.data<float>();
    for (int64_t i = 0; i < n; ++i) {
      XMOE_CHECK(idx[i] < dy.size(0), "[{}] index[{}] = {} out of range [0, {})", op, i, idx[i],
                 dy.size(0));
      float* row = r + i * d;
      if (idx[i] < 0) {
        dot[i] = 0.f;
        std::fill(row, row + d, 0.f);
        continue;
      }
      const float* g_row = src + int64_t{idx[i]} * d;
      float s = 0.f;
      for (int64_t j = 0; j < d; ++j) s += row[j] * g_row[j];
      dot[i] = s;
      for (int64_t j = 0; j < d; ++j) row[j] = g_row[j] * w[i];
    }
    return g;
  }
  xmoe::ops::detail::require_float(op, "rows", rows);
  require_index(op, "index", index, "rows", rows);
  xmoe::ops::detail::require_on(op, "weight", weight, DType::f32, "rows", rows);
  XMOE_CHECK(dy.device() == rows.device() && (dy.dtype() == DType::f32 || dy.dtype() == rows.dtype()),
             "[{}] dy must be f32 or {} on {}, got {} on {}", op, dtype_name(rows.dtype()),
             rows.device().str(), dtype_name(dy.dtype()), dy.device().str());
  if (xmoe::ops::detail::cuda_check_indices())
    xmoe::ops::detail::check_index_values(op, "index", index, dy.size(0), true);
  WeightedGather g{overwrite_rows ? rows : Tensor::empty({n, d}, rows.dtype(), rows.device()),
                   Tensor::empty({n}, DType::f32, rows.device())};
  cuda::moe_gather_weighted_rows_dot(g.d_rows.raw(), g.dot.data<float>(), dy.raw(), dy.dtype(),
                                     rows.raw(), rows.dtype(), index.data<int32_t>(),
                                     weight.data<float>(), n, dy.size(0), d, stream_of(rows));
  return g;
}

Tensor take_along_rows(const Tensor& x, const Tensor& idx) {
  const char* op = "take_along_rows";
  require_cpu_f32(op, "x", x);
  require_index(op, "idx", idx, "x", x);
  check_shape(x, {-1, -1}, op, "x");
  const int64_t n = x.size(0), e = x.size(1);
  check_shape(idx, {n, -1}, op, "idx");
  const int64_t k = idx.size(1);
  Tensor out = Tensor::empty({n, k}, x.dtype(), x.device());
  if (!x.is_cpu()) {  // ids come from top-k or a checked selection: no host check here
    cuda::moe_take_along_rows(out.raw(), x.raw(), x.dtype(), idx.data<int32_t>(), n, e, k,
                              stream_of(x));
    return out;
  }
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
  xmoe::ops::detail::require_same_device(op, "src", src, "out", out);
  require_index(op, "idx", idx, "out", out);
  check_shape(out, {-1, -1}, op, "out");
  const int64_t n = out.size(0), e = out.size(1);
  check_shape(idx, {n, -1}, op, "idx");
  check_shape(src, idx.shape(), op, "src");
  const int64_t k = idx.size(1);
  if (!out.is_cpu()) {
    cuda::moe_put_along_rows_add(out.raw(), out.dtype(), idx.data<int32_t>(), src.raw(),
                                 src.dtype(), n, e, k, stream_of(out));
    return;
  }
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
  Tensor y = Tensor::empty({n, m}, x.dtype(), x.device());
  if (!x.is_cpu()) {
    cuda::moe_transpose(y.raw(), x.raw(), x.dtype(), m, n, stream_of(x));
    return y;
  }
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
  L2NormResult r{Tensor::empty({n, d}, x.dtype(), x.device()),
                 Tensor::empty({n}, DType::f32, x.device())};
  if (!x.is_cpu()) {
    cuda::moe_l2_normalize_rows(r.y.raw(), r.norm.data<float>(), x.raw(), x.dtype(), n, d, eps,
                                stream_of(x));
    return r;
  }
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
  require_exact(op, "norm", norm, DType::f32, "y", y);
  require_like(op, "dy", dy, "y", y);
  check_shape(dy, y.shape(), op, "dy");
  const int64_t n = y.size(0), d = y.size(1);
  XMOE_CHECK(norm.numel() == n, "[{}] norm has {} elements for {} rows", op, norm.numel(), n);
  Tensor dx = Tensor::empty({n, d}, y.dtype(), y.device());
  if (!y.is_cpu()) {
    cuda::moe_l2_normalize_rows_backward(dx.raw(), y.raw(), norm.data<float>(), dy.raw(),
                                         y.dtype(), n, d, stream_of(y));
    return dx;
  }
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
  Tensor w = Tensor::empty({n, k}, v.dtype(), v.device());
  sums = Tensor::empty({n}, DType::f32, v.device());
  if (!v.is_cpu()) {
    cuda::moe_renormalize_rows(w.raw(), sums.data<float>(), v.raw(), v.dtype(), n, k, scale,
                               stream_of(v));
    return w;
  }
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
  require_like(op, "dw", dw, "w", w);
  require_exact(op, "sums", sums, DType::f32, "w", w);
  check_shape(dw, w.shape(), op, "dw");
  const int64_t n = w.size(0), k = w.size(1);
  XMOE_CHECK(sums.numel() == n, "[{}] sums has {} elements for {} rows", op, sums.numel(), n);
  Tensor dv = Tensor::empty({n, k}, w.dtype(), w.device());
  if (!w.is_cpu()) {
    cuda::moe_renormalize_rows_backward(dv.raw(), w.raw(), sums.data<float>(), dw.raw(),
                                        w.dtype(), n, k, scale, stream_of(w));
    return dv;
  }
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

Tensor as_dtype(const Tensor& x, DType dtype) {
  return x.dtype() == dtype ? x : xmoe::ops::cast(x, dtype);
}

}  // namespace xmoe::moe
