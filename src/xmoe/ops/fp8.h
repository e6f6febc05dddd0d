#pragma once
// FP8 E4M3 expert GEMMs (model.moe.expert_dtype = fp8; docs/fp8.md). DeepSeek-V3's recipe:
// activations quantised per row and 128 columns, weights per 128 x 128 block, f32 scales, f32
// accumulation with the scales applied at every 128-deep block. On an sm90 GPU the GEMM is
// CUTLASS' block-scaled FP8 grouped kernel; elsewhere (the CPU, other GPUs) the operands are
// dequantised and multiplied in the compute dtype: the same numbers, up to summation order.
#include <cstdint>
#include <span>
#include <vector>

#include "xmoe/core/tensor.h"

namespace xmoe::ops {

/// Rows quantised in groups (the expert groups of the GEMM that reads them).
struct Fp8Rows {
  Tensor data;    ///< [N, K] u8 e4m3 bytes
  Tensor scales;  ///< f32 per row and 128 columns, grouped as cpu::quantize_rows_fp8 lays them
  std::vector<int64_t> group_sizes;
  /// Groups [begin, end) (views: a group's bytes and scales lie together, in group order).
  Fp8Rows groups(int64_t begin, int64_t end) const;
};
/// Uninitialised FP8 rows of k columns in groups of group_sizes rows, on `device`.
Fp8Rows empty_fp8_rows(int64_t k, std::span<const int64_t> group_sizes, Device device);
/// x [N, K] (f32 or bf16) in groups of group_sizes rows.
Fp8Rows quantize_rows_fp8(const Tensor& x, std::span<const int64_t> group_sizes);
/// quantize_rows_fp8(swiglu(h), group_sizes) for h [N, 2f]: on CUDA one pass that never writes
/// swiglu(h) (the expert forward's down-projection input); the same bytes and scales.
Fp8Rows swiglu_quantize_rows_fp8(const Tensor& h, std::span<const int64_t> group_sizes);
/// swiglu_backward_with_value_(h, da) (h [N, 2f] becomes dh, da [N, f] becomes swiglu(h)), and
/// dh's FP8 rows, quantize_rows_fp8(dh, dh_q.group_sizes)'s bytes and scales, written into dh_q
/// (empty_fp8_rows(2f, ...) or groups of it): on CUDA with f % 128 == 0 one pass that never
/// reads dh back (the FP8 experts' backward: dh feeds the gate/up data-gradient GEMM in FP8 and
/// their weight gradient in h's dtype).
void swiglu_backward_with_value_fp8_(Tensor& h, Tensor& da, Fp8Rows& dh_q);
/// quantize_rows_fp8(gather_rows(x, index), group_sizes) for x [M, K], index i32 [N]: one pass
/// that never writes the gathered rows [N, K] (the FP8 experts' input straight from the order
/// stage's indices).
Fp8Rows gather_quantize_rows_fp8(const Tensor& x, const Tensor& index,
                                 std::span<const int64_t> group_sizes);
/// Back to `dtype`: q * scale per element.
Tensor dequantize_rows_fp8(const Fp8Rows& x, DType dtype);

/// Expert weights [G, K, M] quantised per 128 x 128 block, in both layouts the GEMMs read.
struct Fp8Weights {
  Tensor data;      ///< [G, K, M] u8 (read by x @ w^T, the data gradient)
  Tensor data_t;    ///< [G, M, K] u8 (read by x @ w, the forward)
  Tensor scales;    ///< [G, ceil(K/128), ceil(M/128)] f32
  Tensor scales_t;  ///< [G, ceil(M/128), ceil(K/128)] f32
  /// Groups [begin, end) (views).
  Fp8Weights groups(int64_t begin, int64_t end) const;
};
Fp8Weights quantize_weights_fp8(const Tensor& w);
Tensor dequantize_weights_fp8(const Fp8Weights& w, DType dtype);

/// grouped_matmul on FP8 operands: y [N, M] = x_g @ w[g] (trans_w: y [N, K] = x_g @ w[g]^T),
/// written into y (f32 or bf16, on x's device; the sm90 kernel writes bf16).
void grouped_matmul_fp8_into(Tensor& y, const Fp8Rows& x, const Fp8Weights& w,
                             bool trans_w = false);
Tensor grouped_matmul_fp8(const Fp8Rows& x, const Fp8Weights& w, bool trans_w, DType dtype);

}  // namespace xmoe::ops
