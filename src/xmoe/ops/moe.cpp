#include "xmoe/ops/moe.h"

#include <algorithm>

#include "xmoe/backend/cpu/moe_kernels.h"
#include "xmoe/backend/cuda/moe_kernels.h"
#include "xmoe/ops/dispatch.h"
#include "xmoe/ops/ops.h"

namespace xmoe::ops {

using detail::require_defined;
using detail::require_float;
using detail::require_like;
using detail::require_on;
using detail::require_same_device;
using detail::stream_of;

namespace {
/// An i32 index operand on ref's device.
void require_index(const char* op, const char* name, const Tensor& t, const char* ref_name,
                   const Tensor& ref) {
  XMOE_CHECK(t.defined(), "[{}] {} is undefined", op, name);
  require_on(op, name, t, DType::i32, ref_name, ref);
}
}  // namespace

// ---- row helpers ----------------------------------------------------------------------------

Tensor gather_rows_masked(const Tensor& x, const Tensor& index) {
  const char* op = "gather_rows_masked";
  require_float(op, "x", x);
  require_index(op, "index", index, "x", x);
  check_shape(x, {-1, -1}, op, "x");
  const int64_t n = x.size(0), d = x.size(1), m = index.numel();
  Tensor out = Tensor::empty({m, d}, x.dtype(), x.device());
  if (!x.is_cpu()) {
    // The launcher gives a zero row for any index outside [0, n), -1 included; the values are
    // checked on the host only when XMOE_CUDA_CHECK_INDICES asks (it waits for the stream).
    if (detail::cuda_check_indices()) detail::check_index_values(op, "index", index, n, true);
    cuda::gather_rows(out.raw(), x.raw(), x.dtype(), index.data<int32_t>(), m, n, d, stream_of(x));
    return out;
  }
  const int32_t* idx = index.data<int32_t>();
  for (int64_t i = 0; i < m; ++i)
    XMOE_CHECK(idx[i] < n, "[{}] index[{}] = {} out of range for x {}", op, i, idx[i],
               shape_str(x.shape()));
  cpu::gather_rows_masked(out.data<float>(), x.data<float>(), idx, m, d);
  return out;
}

void scatter_add_rows_masked(Tensor& out, const Tensor& src, const Tensor& index,
                             const Tensor& weight) {
  const char* op = "scatter_add_rows_masked";
  require_float(op, "out", out);
  require_float(op, "src", src);
  require_same_device(op, "src", src, "out", out);
  require_index(op, "index", index, "out", out);
  check_shape(out, {-1, -1}, op, "out");
  const int64_t m = index.numel(), d = out.size(1), n = out.size(0);
  check_shape(src, {m, d}, op, "src");
  if (weight.defined()) {
    require_float(op, "weight", weight);
    require_same_device(op, "weight", weight, "out", out);
    XMOE_CHECK(weight.numel() == m, "[{}] weight has {} elements, index {}", op, weight.numel(), m);
  }
  if (!out.is_cpu()) {
    // Deterministic sorted scatter of the backend (index.cu); entries outside [0, n) — the -1
    // padding rows — are skipped.
    if (detail::cuda_check_indices()) detail::check_index_values(op, "index", index, n, true);
    const cuda::Stream s = stream_of(out);
    const size_t bytes = cuda::scatter_add_rows_workspace_bytes(m, n);
    Tensor ws = Tensor::empty({static_cast<int64_t>(bytes)}, DType::u8, out.device());
    cuda::scatter_add_rows(out.raw(), out.dtype(), src.raw(), src.dtype(), index.data<int32_t>(),
                           weight.defined() ? weight.raw() : nullptr,
                           weight.defined() ? weight.dtype() : DType::f32, m, n, d, ws.raw(), bytes,
                           s);
    return;
  }
  const int32_t* idx = index.data<int32_t>();
  for (int64_t i = 0; i < m; ++i)
    XMOE_CHECK(idx[i] < n, "[{}] index[{}] = {} out of range for out {}", op, i, idx[i],
               shape_str(out.shape()));
  cpu::scatter_add_rows_masked(out.data<float>(), src.data<float>(), idx,
                               weight.defined() ? weight.data<float>() : nullptr, m, d);
}

Tensor gather_sum_rows(const Tensor& src, const Tensor& slots, const Tensor& weight,
                       const Tensor& addend) {
  const char* op = "gather_sum_rows";
  require_float(op, "src", src);
  require_index(op, "slots", slots, "src", src);
  check_shape(src, {-1, -1}, op, "src");
  check_shape(slots, {-1, -1}, op, "slots");
  const int64_t n = src.size(0), d = src.size(1), T = slots.size(0), k = slots.size(1);
  if (weight.defined()) {
    require_on(op, "weight", weight, DType::f32, "src", src);
    XMOE_CHECK(weight.numel() == n, "[{}] weight has {} elements for {} rows", op, weight.numel(),
               n);
  }
  if (addend.defined()) {
    require_like(op, "addend", addend, "src", src);
    check_shape(addend, {T, d}, op, "addend");
  }
  Tensor out = Tensor::empty({T, d}, src.dtype(), src.device());
  if (!src.is_cpu()) {
    XMOE_CHECK(k >= 1 && k <= 32, "[{}] {} slots per row; CUDA takes 1..32", op, k);
    if (detail::cuda_check_indices()) detail::check_index_values(op, "slots", slots, n, true);
    cuda::gather_sum_rows(out.raw(), out.dtype(), src.raw(), src.dtype(), slots.data<int32_t>(),
                          weight.defined() ? weight.raw() : nullptr, DType::f32,
                          addend.defined() ? addend.raw() : nullptr, T, k, n, d, stream_of(src));
    return out;
  }
  const int32_t* sl = slots.data<int32_t>();
  for (int64_t i = 0; i < T * k; ++i)
    XMOE_CHECK(sl[i] < n, "[{}] slots[{}] = {} out of range for src {}", op, i, sl[i],
               shape_str(src.shape()));
  cpu::gather_sum_rows(out.data<float>(), src.data<float>(), sl,
                       weight.defined() ? weight.data<float>() : nullptr,
                       addend.defined() ? addend.data<float>() : nullptr, T, k, d);
  return out;
}

void scale_rows_(Tensor& x, const Tensor& w) {
  const char* op = "scale_rows_";
  require_float(op, "x", x);
  require_on(op, "w", w, DType::f32, "x", x);
  check_shape(x, {-1, -1}, op, "x");
  const int64_t n = x.size(0), d = x.size(1);
  XMOE_CHECK(w.numel() == n, "[{}] w has {} elements for {} rows", op, w.numel(), n);
  if (!x.is_cpu()) {
    cuda::moe_scale_rows(x.raw(), x.dtype(), w.data<float>(), n, d, stream_of(x));
    return;
  }
  cpu::scale_rows(x.data<float>(), w.data<float>(), n, d);
}

Tensor row_dot_f32(const Tensor& a, const Tensor& b) {
  const char* op = "row_dot_f32";
  require_float(op, "a", a);
  require_like(op, "b", b, "a", a);
  check_shape(a, {-1, -1}, op, "a");
  check_shape(b, a.shape(), op, "b");
  if (a.is_cpu()) return row_dot(a, b);
  Tensor out = Tensor::empty({a.size(0)}, DType::f32, a.device());
  cuda::moe_row_dot_f32(out.data<float>(), a.raw(), b.raw(), a.dtype(), a.size(0), a.size(1),
                        stream_of(a));
  return out;
}

WeightedGather gather_weighted_rows_dot(const Tensor& dy, const Tensor& rows, const Tensor& index,
                                        const Tensor& weight, bool overwrite_rows,
                                        std::span<const int64_t> fp8_groups) {
  const char* op = "gather_weighted_rows_dot";
  check_shape(rows, {-1, -1}, op, "rows");
  const int64_t n = rows.size(0), d = rows.size(1);
  check_shape(dy, {-1, d}, op, "dy");
  check_shape(index, {n}, op, "index");
  check_shape(weight, {n}, op, "weight");
  if (rows.is_cpu() && !fp8_groups.empty()) {  // the reference: the op, then its rows quantised
    WeightedGather g = gather_weighted_rows_dot(dy, rows, index, weight, overwrite_rows);
    g.d_rows_fp8 = quantize_rows_fp8(g.d_rows, fp8_groups);
    return g;
  }
  if (rows.is_cpu() && !overwrite_rows) {  // the reference: the three ops in sequence
    WeightedGather g;
    g.d_rows = gather_rows_masked(as_dtype(dy, rows.dtype()), index);
    g.dot = row_dot_f32(rows, g.d_rows);
    scale_rows_(g.d_rows, weight);
    return g;
  }
  if (rows.is_cpu()) {  // in place, row by row, with the reference's arithmetic
    require_float(op, "rows", rows);
    require_float(op, "dy", dy);
    require_index(op, "index", index, "rows", rows);
    require_on(op, "weight", weight, DType::f32, "rows", rows);
    const int32_t* idx = index.data<int32_t>();
    for (int64_t i = 0; i < n; ++i)
      XMOE_CHECK(idx[i] < dy.size(0), "[{}] index[{}] = {} out of range [0, {})", op, i, idx[i],
                 dy.size(0));
    WeightedGather g{rows, Tensor::empty({n}, DType::f32), {}};
    cpu::gather_weighted_rows_dot_inplace(g.d_rows.data<float>(), g.dot.data<float>(),
                                          dy.data<float>(), idx, weight.data<float>(), n, d);
    return g;
  }
  require_float(op, "rows", rows);
  require_index(op, "index", index, "rows", rows);
  require_on(op, "weight", weight, DType::f32, "rows", rows);
  XMOE_CHECK(
      dy.device() == rows.device() && (dy.dtype() == DType::f32 || dy.dtype() == rows.dtype()),
      "[{}] dy must be f32 or {} on {}, got {} on {}", op, dtype_name(rows.dtype()),
      rows.device().str(), dtype_name(dy.dtype()), dy.device().str());
  if (detail::cuda_check_indices())
    detail::check_index_values(op, "index", index, dy.size(0), true);
  WeightedGather g{overwrite_rows ? rows : Tensor::empty({n, d}, rows.dtype(), rows.device()),
                   Tensor::empty({n}, DType::f32, rows.device()),
                   {}};
  if (!fp8_groups.empty()) g.d_rows_fp8 = empty_fp8_rows(d, fp8_groups, rows.device());
  XMOE_CHECK(fp8_groups.empty() || g.d_rows_fp8.data.size(0) == n,
             "[{}] FP8 groups of {} rows for {} rows", op, g.d_rows_fp8.data.size(0), n);
  cuda::moe_gather_weighted_rows_dot(
      g.d_rows.raw(), g.dot.data<float>(), dy.raw(), dy.dtype(), rows.raw(), rows.dtype(),
      index.data<int32_t>(), weight.data<float>(), n, dy.size(0), d, stream_of(rows),
      fp8_groups.empty() ? nullptr : g.d_rows_fp8.data.data<uint8_t>(),
      fp8_groups.empty() ? nullptr : g.d_rows_fp8.scales.data<float>(), fp8_groups.data(),
      static_cast<int64_t>(fp8_groups.size()));
  return g;
}

Tensor as_dtype(const Tensor& x, DType dtype) {
  return x.dtype() == dtype ? x : cast(x, dtype);
}

Tensor take_along_rows(const Tensor& x, const Tensor& idx) {
  const char* op = "take_along_rows";
  require_float(op, "x", x);
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
  const int32_t* is = idx.data<int32_t>();
  for (int64_t i = 0; i < n * k; ++i)
    XMOE_CHECK(is[i] >= 0 && is[i] < e, "[{}] idx {} out of range [0, {})", op, is[i], e);
  cpu::take_along_rows(out.data<float>(), x.data<float>(), is, n, e, k);
  return out;
}

void put_along_rows_add(Tensor& out, const Tensor& idx, const Tensor& src) {
  const char* op = "put_along_rows_add";
  require_float(op, "out", out);
  require_float(op, "src", src);
  require_same_device(op, "src", src, "out", out);
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
  for (int64_t i = 0; i < n * k; ++i)
    XMOE_CHECK(is[i] >= 0 && is[i] < e, "[{}] idx {} out of range [0, {})", op, is[i], e);
  cpu::put_along_rows_add(out.data<float>(), is, src.data<float>(), n, e, k);
}

Tensor transpose(const Tensor& x) {
  require_float("transpose", "x", x);
  check_shape(x, {-1, -1}, "transpose", "x");
  const int64_t m = x.size(0), n = x.size(1);
  Tensor y = Tensor::empty({n, m}, x.dtype(), x.device());
  if (!x.is_cpu()) {
    cuda::moe_transpose(y.raw(), x.raw(), x.dtype(), m, n, stream_of(x));
    return y;
  }
  cpu::transpose(y.data<float>(), x.data<float>(), m, n);
  return y;
}

L2NormResult l2_normalize_rows(const Tensor& x, float eps) {
  require_float("l2_normalize_rows", "x", x);
  check_shape(x, {-1, -1}, "l2_normalize_rows", "x");
  const int64_t n = x.size(0), d = x.size(1);
  L2NormResult r{Tensor::empty({n, d}, x.dtype(), x.device()),
                 Tensor::empty({n}, DType::f32, x.device())};
  if (!x.is_cpu()) {
    cuda::moe_l2_normalize_rows(r.y.raw(), r.norm.data<float>(), x.raw(), x.dtype(), n, d, eps,
                                stream_of(x));
    return r;
  }
  cpu::l2_normalize_rows(r.y.data<float>(), r.norm.data<float>(), x.data<float>(), n, d, eps);
  return r;
}

Tensor l2_normalize_rows_backward(const Tensor& y, const Tensor& norm, const Tensor& dy) {
  const char* op = "l2_normalize_rows_backward";
  require_float(op, "y", y);
  require_on(op, "norm", norm, DType::f32, "y", y);
  require_like(op, "dy", dy, "y", y);
  check_shape(dy, y.shape(), op, "dy");
  const int64_t n = y.size(0), d = y.size(1);
  XMOE_CHECK(norm.numel() == n, "[{}] norm has {} elements for {} rows", op, norm.numel(), n);
  Tensor dx = Tensor::empty({n, d}, y.dtype(), y.device());
  if (!y.is_cpu()) {
    cuda::moe_l2_normalize_rows_backward(dx.raw(), y.raw(), norm.data<float>(), dy.raw(), y.dtype(),
                                         n, d, stream_of(y));
    return dx;
  }
  cpu::l2_normalize_rows_backward(dx.data<float>(), y.data<float>(), norm.data<float>(),
                                  dy.data<float>(), n, d);
  return dx;
}

Tensor renormalize_rows(const Tensor& v, float scale, Tensor& sums) {
  require_float("renormalize_rows", "v", v);
  check_shape(v, {-1, -1}, "renormalize_rows", "v");
  const int64_t n = v.size(0), k = v.size(1);
  Tensor w = Tensor::empty({n, k}, v.dtype(), v.device());
  sums = Tensor::empty({n}, DType::f32, v.device());
  if (!v.is_cpu()) {
    cuda::moe_renormalize_rows(w.raw(), sums.data<float>(), v.raw(), v.dtype(), n, k, scale,
                               stream_of(v));
    return w;
  }
  cpu::renormalize_rows(w.data<float>(), sums.data<float>(), v.data<float>(), n, k, scale);
  return w;
}

Tensor renormalize_rows_backward(const Tensor& w, const Tensor& sums, const Tensor& dw,
                                 float scale) {
  const char* op = "renormalize_rows_backward";
  require_float(op, "w", w);
  require_like(op, "dw", dw, "w", w);
  require_on(op, "sums", sums, DType::f32, "w", w);
  check_shape(dw, w.shape(), op, "dw");
  const int64_t n = w.size(0), k = w.size(1);
  XMOE_CHECK(sums.numel() == n, "[{}] sums has {} elements for {} rows", op, sums.numel(), n);
  Tensor dv = Tensor::empty({n, k}, w.dtype(), w.device());
  if (!w.is_cpu()) {
    cuda::moe_renormalize_rows_backward(dv.raw(), w.raw(), sums.data<float>(), dw.raw(), w.dtype(),
                                        n, k, scale, stream_of(w));
    return dv;
  }
  cpu::renormalize_rows_backward(dv.data<float>(), w.data<float>(), sums.data<float>(),
                                 dw.data<float>(), n, k, scale);
  return dv;
}

// ---- order stage: the token layout ----------------------------------------------------------

MoeLayout moe_layout(const Tensor& topk_idx, const Tensor& topk_weight, int64_t experts,
                     int64_t capacity) {
  const char* op = "moe_layout";
  require_defined(op, "topk_idx", topk_idx);
  check_dtype(topk_idx, DType::i32, op, "topk_idx");
  check_shape(topk_idx, {-1, -1}, op, "topk_idx");
  require_on(op, "topk_weight", topk_weight, DType::f32, "topk_idx", topk_idx);
  check_shape(topk_weight, topk_idx.shape(), op, "topk_weight");
  XMOE_CHECK(experts >= 1 && capacity >= 0, "[{}] {} experts of capacity {}", op, experts,
             capacity);
  const int64_t T = topk_idx.size(0), k = topk_idx.size(1), E = experts, C = capacity;
  const int64_t N = C > 0 ? E * C : T * k;
  const Device dev = topk_idx.device();
  if (topk_idx.is_cpu())
    for (int32_t e : topk_idx.span<int32_t>())
      XMOE_CHECK(e >= 0 && e < E, "[{}] topk_idx holds expert {} outside [0, {})", op, e, E);
  MoeLayout l;
  l.token_ids = Tensor::empty({N}, DType::i32, dev);
  l.expert_ids = Tensor::empty({N}, DType::i32, dev);
  l.combine_weights = Tensor::empty({N}, DType::f32, dev);
  l.slot_to_row = Tensor::empty({T * k}, DType::i32, dev);
  if (topk_idx.is_cpu()) {
    l.load.assign(static_cast<size_t>(E), 0);
    if (C > 0) {
      std::vector<int64_t> kept(static_cast<size_t>(E));
      cpu::moe_layout_padded(topk_idx.data<int32_t>(), topk_weight.data<float>(), T, k, E, C,
                             l.token_ids.data<int32_t>(), l.expert_ids.data<int32_t>(),
                             l.combine_weights.data<float>(), l.slot_to_row.data<int32_t>(),
                             l.load.data(), kept.data());
    } else {
      cpu::moe_layout_pft(topk_idx.data<int32_t>(), topk_weight.data<float>(), T, k, E,
                          l.token_ids.data<int32_t>(), l.expert_ids.data<int32_t>(),
                          l.combine_weights.data<float>(), l.slot_to_row.data<int32_t>(),
                          l.load.data());
    }
    return l;
  }
  Tensor counts = Tensor::empty({E + 1}, DType::i64, dev);  // [load (E), first bad pair]
  const size_t bytes = cuda::moe_layout_workspace_bytes(T * k, E);
  Tensor ws = Tensor::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, DType::u8, dev);
  cuda::moe_layout(topk_idx.data<int32_t>(), topk_weight.data<float>(), T * k, k, E, C,
                   l.token_ids.data<int32_t>(), l.expert_ids.data<int32_t>(),
                   l.combine_weights.data<float>(), l.slot_to_row.data<int32_t>(),
                   counts.data<int64_t>(), ws.raw(), bytes, stream_of(topk_idx));
  // The one host synchronisation: grouped GEMM group sizes and all-to-all-v counts are host
  // values. The id check rides on the same copy.
  const std::vector<int64_t> c = counts.to_vector<int64_t>();
  XMOE_CHECK(c[E] < 0, "[{}] topk_idx holds expert {} outside [0, {})", op,
             static_cast<int64_t>(topk_idx.item(c[E])), E);
  l.load.assign(c.begin(), c.begin() + E);
  return l;
}

// ---- router aux losses ----------------------------------------------------------------------

MoeAuxStats moe_aux_stats(const Tensor& probs, const Tensor& topk_idx, const Tensor& z_logits,
                          int64_t seq_len) {
  const char* op = "moe_aux_stats";
  require_on(op, "probs", probs, DType::f32, "probs", probs);
  require_on(op, "topk_idx", topk_idx, DType::i32, "probs", probs);
  require_on(op, "z_logits", z_logits, DType::f32, "probs", probs);
  check_shape(probs, {-1, -1}, op, "probs");
  const int64_t T = probs.size(0), E = probs.size(1);
  check_shape(topk_idx, {T, -1}, op, "topk_idx");
  check_shape(z_logits, {T, E}, op, "z_logits");
  XMOE_CHECK(seq_len > 0 && T % seq_len == 0, "[{}] {} tokens are not a multiple of seq_len {}", op,
             T, seq_len);
  const int64_t k = topk_idx.size(1), S = T / seq_len, n = 2 * E + 4;
  const Device dev = probs.device();
  if (probs.is_cpu()) {
    MoeAuxStats s{Tensor::empty({1, n}, DType::i64), Tensor::empty({S, E}, DType::f32)};
    cpu::moe_aux_stats(static_cast<double*>(s.stats.raw()), s.seq_count.data<float>(),
                       probs.data<float>(), topk_idx.data<int32_t>(), z_logits.data<float>(), T, E,
                       k, seq_len);
    return s;
  }
  const cuda::Stream stream = stream_of(probs);
  MoeAuxStats s{Tensor::empty({1, n}, DType::i64, dev), Tensor::empty({S, E}, DType::f32, dev)};
  Tensor seq_psum = Tensor::empty({S, E}, DType::f64, dev);
  Tensor scratch = Tensor::empty({cuda::moe_aux_stats_scratch(T, E, seq_len)}, DType::f64, dev);
  cuda::moe_aux_stats(static_cast<double*>(s.stats.raw()), s.seq_count.data<float>(),
                      seq_psum.data<double>(), probs.data<float>(), topk_idx.data<int32_t>(),
                      z_logits.data<float>(), T, E, k, seq_len, scratch.data<double>(), stream);
  return s;
}

MoeAuxTerms moe_aux_finalize(const Tensor& all_stats, int64_t top_k, int64_t seq_len, float w_lb,
                             float w_seq, float w_z) {
  const char* op = "moe_aux_finalize";
  require_defined(op, "all_stats", all_stats);
  check_dtype(all_stats, DType::i64, op, "all_stats");
  check_shape(all_stats, {-1, -1}, op, "all_stats");
  const int64_t ranks = all_stats.size(0), n = all_stats.size(1), E = (n - 4) / 2;
  XMOE_CHECK(ranks >= 1 && E >= 1 && n == 2 * E + 4,
             "[{}] all_stats must be [ranks, 2E + 4], got {}", op, shape_str(all_stats.shape()));
  XMOE_CHECK(top_k >= 1 && seq_len >= 1, "[{}] top_k = {} and seq_len = {} must be >= 1", op, top_k,
             seq_len);
  const Device dev = all_stats.device();
  const auto* all = static_cast<const double*>(all_stats.raw());
  if (all_stats.is_cpu()) {
    MoeAuxTerms t{Tensor::empty({4}, DType::f64), Tensor::empty({E}, DType::f64),
                  Tensor::empty({3}, DType::f64)};
    cpu::moe_aux_finalize(t.terms.data<double>(), t.frac.data<double>(), t.denoms.data<double>(),
                          all, ranks, E, top_k, seq_len, w_lb, w_seq, w_z);
    return t;
  }
  const cuda::Stream stream = stream_of(all_stats);
  MoeAuxTerms t{Tensor::empty({4}, DType::f64, dev), Tensor::empty({E}, DType::f32, dev),
                Tensor::empty({3}, DType::f64, dev)};
  cuda::moe_aux_finalize(t.terms.data<double>(), t.frac.data<float>(), t.denoms.data<double>(), all,
                         ranks, E, top_k, seq_len, w_lb, w_seq, w_z, stream);
  return t;
}

namespace {
/// The aux-loss backward's inputs against ref [T, E] (named ref_name): device, dtypes, shapes.
void check_aux_backward_args(const char* op, const char* ref_name, const Tensor& ref,
                             const Tensor& z_logits, const Tensor& frac, const Tensor& seq_count,
                             const Tensor& denoms, int64_t seq_len, int64_t top_k,
                             const Tensor& scale) {
  require_on(op, "z_logits", z_logits, DType::f32, ref_name, ref);
  const int64_t T = ref.size(0), E = ref.size(1);
  check_shape(z_logits, {T, E}, op, "z_logits");
  XMOE_CHECK(seq_len > 0 && T % seq_len == 0 && top_k >= 1,
             "[{}] {} tokens are not a multiple of seq_len {} (top_k {})", op, T, seq_len, top_k);
  // f_e as moe_aux_finalize leaves it: f64 on the CPU (the reference keeps it exact), f32 on CUDA
  require_on(op, "frac", frac, ref.is_cpu() ? DType::f64 : DType::f32, ref_name, ref);
  check_shape(frac, {E}, op, "frac");
  require_on(op, "seq_count", seq_count, DType::f32, ref_name, ref);
  check_shape(seq_count, {T / seq_len, E}, op, "seq_count");
  require_on(op, "denoms", denoms, DType::f64, ref_name, ref);
  check_shape(denoms, {3}, op, "denoms");
  if (scale.defined()) {
    require_on(op, "scale", scale, DType::f32, ref_name, ref);
    XMOE_CHECK(scale.numel() == 1, "[{}] scale has {} elements, expected 1", op, scale.numel());
  }
}
}  // namespace

void moe_aux_backward(Tensor& dprobs, Tensor& dlogits, const Tensor& z_logits, const Tensor& frac,
                      const Tensor& seq_count, const Tensor& denoms, int64_t seq_len, int64_t top_k,
                      float w_lb, float w_seq, float w_z, const Tensor& scale) {
  const char* op = "moe_aux_backward";
  require_on(op, "dprobs", dprobs, DType::f32, "dprobs", dprobs);
  require_on(op, "dlogits", dlogits, DType::f32, "dprobs", dprobs);
  check_shape(dprobs, {-1, -1}, op, "dprobs");
  const int64_t T = dprobs.size(0), E = dprobs.size(1);
  check_shape(dlogits, {T, E}, op, "dlogits");
  check_aux_backward_args(op, "dprobs", dprobs, z_logits, frac, seq_count, denoms, seq_len, top_k,
                          scale);
  if (dprobs.is_cpu()) {
    const float s = scale.defined() ? scale.data<float>()[0] : 1.f;
    w_lb *= s, w_seq *= s, w_z *= s;
    cpu::moe_aux_backward(dprobs.data<float>(), dlogits.data<float>(), z_logits.data<float>(),
                          frac.data<double>(), seq_count.data<float>(), denoms.data<double>(), T, E,
                          seq_len, top_k, w_lb, w_seq, w_z);
    return;
  }
  cuda::moe_aux_backward(dprobs.data<float>(), dlogits.data<float>(), z_logits.data<float>(),
                         frac.data<float>(), seq_count.data<float>(), denoms.data<double>(), T, E,
                         seq_len, top_k, w_lb, w_seq, w_z,
                         scale.defined() ? scale.data<float>() : nullptr, stream_of(dprobs));
}

Tensor moe_softmax_routing_backward(const Tensor& probs, const Tensor& idx, const Tensor& dv,
                                    const Tensor& z_logits, const Tensor& frac,
                                    const Tensor& seq_count, const Tensor& denoms, int64_t seq_len,
                                    int64_t top_k, float w_lb, float w_seq, float w_z,
                                    const Tensor& scale) {
  const char* op = "moe_softmax_routing_backward";
  require_on(op, "probs", probs, DType::f32, "probs", probs);
  check_shape(probs, {-1, -1}, op, "probs");
  const int64_t T = probs.size(0), E = probs.size(1);
  require_on(op, "idx", idx, DType::i32, "probs", probs);
  check_shape(idx, {T, -1}, op, "idx");
  require_on(op, "dv", dv, DType::f32, "probs", probs);
  check_shape(dv, idx.shape(), op, "dv");
  if (probs.is_cpu()) {  // the ops it fuses, in order (moe_aux_backward checks the rest)
    Tensor dlogits = Tensor::zeros({T, E}, DType::f32, probs.device());
    Tensor dprobs = Tensor::zeros({T, E}, DType::f32, probs.device());
    put_along_rows_add(dprobs, idx, dv);
    moe_aux_backward(dprobs, dlogits, z_logits, frac, seq_count, denoms, seq_len, top_k, w_lb,
                     w_seq, w_z, scale);
    add_(dlogits, softmax_backward(probs, dprobs));
    return dlogits;
  }
  check_aux_backward_args(op, "probs", probs, z_logits, frac, seq_count, denoms, seq_len, top_k,
                          scale);
  Tensor dlogits = Tensor::empty({T, E}, DType::f32, probs.device());  // the kernel writes all
  cuda::moe_softmax_routing_backward(
      dlogits.data<float>(), probs.data<float>(), idx.data<int32_t>(), dv.data<float>(),
      idx.size(1), z_logits.data<float>(), frac.data<float>(), seq_count.data<float>(),
      denoms.data<double>(), T, E, seq_len, top_k, w_lb, w_seq, w_z,
      scale.defined() ? scale.data<float>() : nullptr, stream_of(probs));
  return dlogits;
}

// ---- gates ----------------------------------------------------------------------------------

Tensor moe_group_limited_scores(const Tensor& scores, const Tensor& bias, int64_t groups,
                                int64_t topk_groups) {
  const char* op = "moe_group_limited_scores";
  require_on(op, "scores", scores, DType::f32, "scores", scores);
  require_on(op, "bias", bias, DType::f32, "scores", scores);
  check_shape(scores, {-1, -1}, op, "scores");
  const int64_t T = scores.size(0), E = scores.size(1);
  check_shape(bias, {E}, op, "bias");
  XMOE_CHECK(groups >= 1 && E % groups == 0 && topk_groups >= 1 && topk_groups <= groups,
             "[{}] {} experts in {} groups, {} of them kept", op, E, groups, topk_groups);
  Tensor biased = Tensor::empty({T, E}, DType::f32, scores.device());
  if (scores.is_cpu()) {
    cpu::moe_group_limited_scores(biased.data<float>(), scores.data<float>(), bias.data<float>(), T,
                                  E, groups, topk_groups);
  } else {
    cuda::moe_group_limited_scores(biased.data<float>(), scores.data<float>(), bias.data<float>(),
                                   T, E, groups, topk_groups, stream_of(scores));
  }
  return biased;
}

namespace {
void check_temperature(const char* op, const Tensor& temperature, const char* ref_name,
                       const Tensor& ref) {
  require_on(op, "temperature", temperature, DType::f32, ref_name, ref);
  XMOE_CHECK(temperature.numel() == 1, "[{}] temperature must have one element, got {}", op,
             shape_str(temperature.shape()));
}
}  // namespace

Tensor moe_div_temperature(const Tensor& x, const Tensor& temperature, float min_temperature) {
  const char* op = "moe_div_temperature";
  require_on(op, "x", x, DType::f32, "x", x);
  check_temperature(op, temperature, "x", x);
  Tensor out = Tensor::empty(x.shape(), DType::f32, x.device());
  if (x.is_cpu()) {
    cpu::moe_div_temperature(out.data<float>(), x.data<float>(), temperature.data<float>()[0],
                             min_temperature, x.numel());
  } else {
    cuda::moe_div_temperature(out.data<float>(), x.data<float>(), temperature.data<float>(),
                              min_temperature, x.numel(), stream_of(x));
  }
  return out;
}

void moe_temperature_grad(Tensor& temperature_grad, const Tensor& dlogits, const Tensor& cos,
                          const Tensor& temperature, float min_temperature) {
  const char* op = "moe_temperature_grad";
  require_on(op, "dlogits", dlogits, DType::f32, "dlogits", dlogits);
  require_on(op, "cos", cos, DType::f32, "dlogits", dlogits);
  check_shape(cos, dlogits.shape(), op, "cos");
  check_temperature(op, temperature, "dlogits", dlogits);
  require_on(op, "temperature_grad", temperature_grad, DType::f32, "dlogits", dlogits);
  XMOE_CHECK(temperature_grad.numel() == 1, "[{}] temperature_grad must have one element, got {}",
             op, shape_str(temperature_grad.shape()));
  if (dlogits.is_cpu()) {
    cpu::moe_temperature_grad(temperature_grad.data<float>(), dlogits.data<float>(),
                              cos.data<float>(), temperature.data<float>()[0], min_temperature,
                              dlogits.numel());
  } else {
    cuda::moe_temperature_grad(temperature_grad.data<float>(), dlogits.data<float>(),
                               cos.data<float>(), temperature.data<float>(), min_temperature,
                               dlogits.numel(), stream_of(dlogits));
  }
}

}  // namespace xmoe::ops
