#include "xmoe/ops/fp8.h"

#include "xmoe/backend/cpu/kernels.h"
#include "xmoe/backend/cuda/kernels.h"
#include "xmoe/core/fp8.h"
#include "xmoe/ops/dispatch.h"
#include "xmoe/ops/ops.h"

namespace xmoe::ops {

using detail::require_float;
using detail::stream_of;

namespace {

int64_t blocks(int64_t n) {
  return (n + fp8::kBlock - 1) / fp8::kBlock;
}

int64_t total_rows(const char* op, std::span<const int64_t> group_sizes) {
  int64_t total = 0;
  for (int64_t s : group_sizes) {
    XMOE_CHECK(s >= 0, "[{}] negative group size {}", op, s);
    total += s;
  }
  return total;
}

void require_fp8_rows(const char* op, const Fp8Rows& x) {
  XMOE_CHECK(x.data.defined() && x.data.dim() == 2 && x.data.dtype() == DType::u8,
             "[{}] x.data must be [N, K] u8 (e4m3 bytes)", op);
  XMOE_CHECK(x.scales.defined() && x.scales.dtype() == DType::f32 &&
                 x.scales.numel() == x.data.size(0) * blocks(x.data.size(1)) &&
                 x.scales.device() == x.data.device(),
             "[{}] x.scales must hold {} f32 scales on {}", op,
             x.data.size(0) * blocks(x.data.size(1)), x.data.device().str());
  XMOE_CHECK(total_rows(op, x.group_sizes) == x.data.size(0),
             "[{}] group sizes sum to {} but x has {} rows", op, total_rows(op, x.group_sizes),
             x.data.size(0));
}

/// The bytes and scales of n rows of k columns in groups of group_sizes rows, on `device`.
Fp8Rows empty_fp8_rows(const char* op, int64_t n, int64_t k, std::span<const int64_t> group_sizes,
                       Device device) {
  XMOE_CHECK(total_rows(op, group_sizes) == n,
             "[{}] group sizes sum to {} but the input has {} rows", op,
             total_rows(op, group_sizes), n);
  return {Tensor::empty({n, k}, DType::u8, device),
          Tensor::empty({n * blocks(k)}, DType::f32, device),
          {group_sizes.begin(), group_sizes.end()}};
}

}  // namespace

Fp8Rows Fp8Rows::groups(int64_t begin, int64_t end) const {
  XMOE_CHECK(0 <= begin && begin <= end && end <= static_cast<int64_t>(group_sizes.size()),
             "[Fp8Rows::groups] [{}, {}) outside {} groups", begin, end, group_sizes.size());
  int64_t r0 = 0;
  for (int64_t g = 0; g < begin; ++g) r0 += group_sizes[static_cast<size_t>(g)];
  int64_t r1 = r0;
  for (int64_t g = begin; g < end; ++g) r1 += group_sizes[static_cast<size_t>(g)];
  const int64_t kb = blocks(data.size(1));
  return {data.rows(r0, r1),
          scales.rows(r0 * kb, r1 * kb),
          {group_sizes.begin() + begin, group_sizes.begin() + end}};
}

Fp8Rows empty_fp8_rows(int64_t k, std::span<const int64_t> group_sizes, Device device) {
  return empty_fp8_rows("empty_fp8_rows", total_rows("empty_fp8_rows", group_sizes), k, group_sizes,
                        device);
}

Fp8Rows quantize_rows_fp8(const Tensor& x, std::span<const int64_t> group_sizes) {
  const char* op = "quantize_rows_fp8";
  require_float(op, "x", x);
  XMOE_CHECK(x.dim() == 2, "[{}] x must be [N, K], got {}", op, shape_str(x.shape()));
  const int64_t k = x.size(1);
  Fp8Rows q = empty_fp8_rows(op, x.size(0), k, group_sizes, x.device());
  const auto groups = static_cast<int64_t>(group_sizes.size());
  if (x.is_cpu()) {
    cpu::quantize_rows_fp8(q.data.data<uint8_t>(), q.scales.data<float>(), x.data<float>(),
                           group_sizes.data(), groups, k);
  } else {
    cuda::quantize_rows_fp8(q.data.data<uint8_t>(), q.scales.data<float>(), x.raw(), x.dtype(),
                            group_sizes.data(), groups, k, stream_of(x));
  }
  return q;
}

Fp8Rows swiglu_quantize_rows_fp8(const Tensor& h, std::span<const int64_t> group_sizes) {
  const char* op = "swiglu_quantize_rows_fp8";
  require_float(op, "h", h);
  XMOE_CHECK(h.dim() == 2 && h.size(1) % 2 == 0, "[{}] h must be [N, 2f], got {}", op,
             shape_str(h.shape()));
  if (h.is_cpu()) return quantize_rows_fp8(swiglu(h), group_sizes);
  const int64_t f = h.size(1) / 2;
  Fp8Rows q = empty_fp8_rows(op, h.size(0), f, group_sizes, h.device());
  cuda::swiglu_quantize_rows_fp8(q.data.data<uint8_t>(), q.scales.data<float>(), h.raw(), h.dtype(),
                                 group_sizes.data(), static_cast<int64_t>(group_sizes.size()), f,
                                 stream_of(h));
  return q;
}

void swiglu_backward_with_value_fp8_(Tensor& h, Tensor& da, Fp8Rows& dh_q) {
  const char* op = "swiglu_backward_with_value_fp8_";
  require_float(op, "h", h);
  XMOE_CHECK(h.dim() == 2 && h.size(1) % 2 == 0, "[{}] h must be [N, 2f], got {}", op,
             shape_str(h.shape()));
  const int64_t n = h.size(0), f = h.size(1) / 2;
  check_shape(da, {n, f}, op, "da");
  XMOE_CHECK(da.dtype() == h.dtype() && da.device() == h.device(),
             "[{}] da must be {} on {} like h", op, dtype_name(h.dtype()), h.device().str());
  require_fp8_rows(op, dh_q);
  check_shape(dh_q.data, {n, 2 * f}, op, "dh_q.data");
  XMOE_CHECK(dh_q.data.device() == h.device(), "[{}] dh_q on {}, h on {}", op,
             dh_q.data.device().str(), h.device().str());
  const auto groups = static_cast<int64_t>(dh_q.group_sizes.size());
  if (h.is_cpu()) {  // the two passes
    swiglu_backward_with_value_(h, da);
    cpu::quantize_rows_fp8(dh_q.data.data<uint8_t>(), dh_q.scales.data<float>(), h.data<float>(),
                           dh_q.group_sizes.data(), groups, 2 * f);
    return;
  }
  cuda::swiglu_backward_quantize_fp8(h.raw(), da.raw(), h.dtype(), dh_q.data.data<uint8_t>(),
                                     dh_q.scales.data<float>(), dh_q.group_sizes.data(), groups, f,
                                     stream_of(h));
}

Fp8Rows gather_quantize_rows_fp8(const Tensor& x, const Tensor& index,
                                 std::span<const int64_t> group_sizes) {
  const char* op = "gather_quantize_rows_fp8";
  require_float(op, "x", x);
  XMOE_CHECK(x.dim() == 2, "[{}] x must be [M, K], got {}", op, shape_str(x.shape()));
  check_same_device(op, "index", index, "x", x);
  XMOE_CHECK(index.dtype() == DType::i32 && index.dim() == 1,
             "[{}] index must be i32 [N], got {} {}", op, dtype_name(index.dtype()),
             shape_str(index.shape()));
  if (x.is_cpu() || detail::cuda_check_indices())
    detail::check_index_values(op, "index", index, x.size(0), false);
  const int64_t k = x.size(1);
  Fp8Rows q = empty_fp8_rows(op, index.numel(), k, group_sizes, x.device());
  const auto groups = static_cast<int64_t>(group_sizes.size());
  if (x.is_cpu()) {
    cpu::gather_quantize_rows_fp8(q.data.data<uint8_t>(), q.scales.data<float>(), x.data<float>(),
                                  index.data<int32_t>(), group_sizes.data(), groups, k);
    return q;
  }
  cuda::gather_quantize_rows_fp8(q.data.data<uint8_t>(), q.scales.data<float>(), x.raw(), x.dtype(),
                                 index.data<int32_t>(), x.size(0), group_sizes.data(), groups, k,
                                 stream_of(x));
  return q;
}

Tensor dequantize_rows_fp8(const Fp8Rows& x, DType dtype) {
  const char* op = "dequantize_rows_fp8";
  require_fp8_rows(op, x);
  Tensor out = Tensor::empty(x.data.shape(), dtype, x.data.device());
  const auto groups = static_cast<int64_t>(x.group_sizes.size());
  if (out.is_cpu()) {
    XMOE_CHECK(dtype == DType::f32, "[{}] the CPU dequantises to f32, not {}", op,
               dtype_name(dtype));
    cpu::dequantize_rows_fp8(out.data<float>(), x.data.data<uint8_t>(), x.scales.data<float>(),
                             x.group_sizes.data(), groups, x.data.size(1));
  } else {
    cuda::dequantize_rows_fp8(out.raw(), dtype, x.data.data<uint8_t>(), x.scales.data<float>(),
                              x.group_sizes.data(), groups, x.data.size(1), stream_of(out));
  }
  return out;
}

Fp8Weights Fp8Weights::groups(int64_t begin, int64_t end) const {
  return {data.rows(begin, end), data_t.rows(begin, end), scales.rows(begin, end),
          scales_t.rows(begin, end)};
}

Fp8Weights quantize_weights_fp8(const Tensor& w) {
  const char* op = "quantize_weights_fp8";
  require_float(op, "w", w);
  XMOE_CHECK(w.dim() == 3, "[{}] w must be [G, K, M], got {}", op, shape_str(w.shape()));
  const int64_t g = w.size(0), k = w.size(1), m = w.size(2);
  const Device dev = w.device();
  Fp8Weights q{Tensor::empty({g, k, m}, DType::u8, dev), Tensor::empty({g, m, k}, DType::u8, dev),
               Tensor::empty({g, blocks(k), blocks(m)}, DType::f32, dev),
               Tensor::empty({g, blocks(m), blocks(k)}, DType::f32, dev)};
  if (w.is_cpu()) {
    cpu::quantize_weights_fp8(q.data.data<uint8_t>(), q.data_t.data<uint8_t>(),
                              q.scales.data<float>(), q.scales_t.data<float>(), w.data<float>(), g,
                              k, m);
  } else {
    cuda::quantize_weights_fp8(q.data.data<uint8_t>(), q.data_t.data<uint8_t>(),
                               q.scales.data<float>(), q.scales_t.data<float>(), w.raw(), w.dtype(),
                               g, k, m, stream_of(w));
  }
  return q;
}

Tensor dequantize_weights_fp8(const Fp8Weights& w, DType dtype) {
  const char* op = "dequantize_weights_fp8";
  XMOE_CHECK(w.data.defined() && w.data.dim() == 3 && w.data.dtype() == DType::u8,
             "[{}] w.data must be [G, K, M] u8 (e4m3 bytes)", op);
  const int64_t g = w.data.size(0), k = w.data.size(1), m = w.data.size(2);
  check_shape(w.scales, {g, blocks(k), blocks(m)}, op, "w.scales");
  Tensor out = Tensor::empty({g, k, m}, dtype, w.data.device());
  if (out.is_cpu()) {
    XMOE_CHECK(dtype == DType::f32, "[{}] the CPU dequantises to f32, not {}", op,
               dtype_name(dtype));
    cpu::dequantize_weights_fp8(out.data<float>(), w.data.data<uint8_t>(), w.scales.data<float>(),
                                g, k, m);
  } else {
    cuda::dequantize_weights_fp8(out.raw(), dtype, w.data.data<uint8_t>(), w.scales.data<float>(),
                                 g, k, m, stream_of(out));
  }
  return out;
}

void grouped_matmul_fp8_into(Tensor& y, const Fp8Rows& x, const Fp8Weights& w, bool trans_w) {
  const char* op = "grouped_matmul_fp8";
  require_fp8_rows(op, x);
  require_float(op, "y", y);
  XMOE_CHECK(w.data.defined() && w.data.dim() == 3 && w.data.device() == x.data.device(),
             "[{}] w must be [G, K, M] on {}", op, x.data.device().str());
  XMOE_CHECK(y.device() == x.data.device(), "[{}] y is on {} but x is on {}", op, y.device().str(),
             x.data.device().str());
  const int64_t groups = w.data.size(0);
  const int64_t k = trans_w ? w.data.size(2) : w.data.size(1);
  const int64_t m = trans_w ? w.data.size(1) : w.data.size(2);
  XMOE_CHECK(x.data.size(1) == k, "[{}] x has {} columns but w{} has inner dimension {}", op,
             x.data.size(1), trans_w ? "^T" : "", k);
  XMOE_CHECK(static_cast<int64_t>(x.group_sizes.size()) == groups,
             "[{}] x has {} groups but w has {}", op, x.group_sizes.size(), groups);
  check_shape(y, {x.data.size(0), m}, op, "y");
  // The kernel reads w_g as [N, K] K-major: the transposed copy forward, the plain one for w^T.
  if (!y.is_cpu() && y.dtype() == DType::bf16 &&
      cuda::grouped_gemm_fp8(y.raw(), x.data.data<uint8_t>(), x.scales.data<float>(),
                             (trans_w ? w.data : w.data_t).data<uint8_t>(),
                             (trans_w ? w.scales_t : w.scales).data<float>(), x.group_sizes.data(),
                             groups, k, m, stream_of(y)))
    return;
  const DType dt = y.dtype();
  grouped_matmul_into(y, dequantize_rows_fp8(x, dt), dequantize_weights_fp8(w, dt), x.group_sizes,
                      trans_w);
}

Tensor grouped_matmul_fp8(const Fp8Rows& x, const Fp8Weights& w, bool trans_w, DType dtype) {
  XMOE_CHECK(w.data.defined() && w.data.dim() == 3, "[grouped_matmul_fp8] w must be [G, K, M]");
  Tensor y = Tensor::empty({x.data.size(0), trans_w ? w.data.size(1) : w.data.size(2)}, dtype,
                           x.data.device());
  grouped_matmul_fp8_into(y, x, w, trans_w);
  return y;
}

}  // namespace xmoe::ops
