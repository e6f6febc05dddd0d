#pragma once
// Small ops the MoE stages need that xmoe/ops/ops.h does not provide. Same conventions as ops.h:
// argument checks name the op, device dispatch on the first operand — CPU tensors run the host
// loops here (f32), CUDA tensors the launchers of backend/cuda/moe_kernels.h (f32 or bf16 rows,
// f32 math; weights, norms and sums f32). Index tensors are i32 on the same device; an index < 0
// marks an empty (padding) slot. No op here waits for the device.
#include <cstdint>

#include "xmoe/core/tensor.h"

namespace xmoe::moe {

/// out[i] = x[index[i]], or a zero row where index[i] < 0. x [N, d], index i32 [M] -> [M, d].
Tensor gather_rows_masked(const Tensor& x, const Tensor& index);
/// out[index[i]] += weight[i] * src[i], skipping rows with index[i] < 0 (weight undefined = 1).
void scatter_add_rows_masked(Tensor& out, const Tensor& src, const Tensor& index,
                             const Tensor& weight = Tensor());
/// out[t] = sum over j of weight[r] * src[r], r = slots[t, j] (< 0: an empty slot, skipped;
/// weight undefined = 1), added in increasing r: the values of scatter_add_rows_masked into
/// zeros when slots is the inverse of its index, as the MoE layout's slot_to_row is. src [N, d],
/// slots i32 [T, k] (k <= 32 on CUDA) -> [T, d] of src's dtype. No sort and no write conflicts,
/// so it runs in parallel over t (the scatter is sequential on the CPU, sorted on CUDA).
Tensor gather_sum_rows(const Tensor& src, const Tensor& slots, const Tensor& weight = Tensor());
/// x[i, :] *= w[i] in place; x [N, d], w f32 [N].
void scale_rows_(Tensor& x, const Tensor& w);
/// out[i] = a[i] . b[i] as f32 [N] (also for bf16 rows a, b [N, d]).
Tensor row_dot_f32(const Tensor& a, const Tensor& b);
/// The I-Order backward in one pass over the rows: for row i with token t = index[i] (< 0: a
/// padding slot, zero row and zero dot), d_rows[i] = weight[i] * dy[t] (rows' dtype) and
/// dot[i] = rows[i] . dy[t] (f32). dy [T, d] (f32 or the rows' dtype), rows [N, d], index i32
/// [N], weight f32 [N]. Equals gather, row_dot_f32, scale_rows_ in sequence; CUDA fuses them.
/// overwrite_rows: d_rows is written into rows' storage (each element is read before it is
/// overwritten), saving an [N, d] allocation; rows is then d_rows.
struct WeightedGather {
  Tensor d_rows;  ///< [N, d]
  Tensor dot;     ///< f32 [N]
};
WeightedGather gather_weighted_rows_dot(const Tensor& dy, const Tensor& rows, const Tensor& index,
                                        const Tensor& weight, bool overwrite_rows = false);
/// x itself when it has `dtype`, else ops::cast(x, dtype).
Tensor as_dtype(const Tensor& x, DType dtype);
/// out[i, j] = x[i, idx[i, j]]: x [N, E], idx i32 [N, k] -> [N, k].
Tensor take_along_rows(const Tensor& x, const Tensor& idx);
/// out[i, idx[i, j]] += src[i, j]: out [N, E], idx i32 [N, k], src [N, k].
void put_along_rows_add(Tensor& out, const Tensor& idx, const Tensor& src);
/// Transpose of a 2-d float tensor: [M, N] -> [N, M].
Tensor transpose(const Tensor& x);

struct L2NormResult {
  Tensor y;     ///< [N, d] rows of unit length
  Tensor norm;  ///< [N] max(||x_i||, eps), saved for backward
};
/// y_i = x_i / max(||x_i||, eps) over the rows of x [N, d].
L2NormResult l2_normalize_rows(const Tensor& x, float eps = 1e-6f);
/// dx_i = (dy_i - y_i (y_i . dy_i)) / norm_i (the eps clamp is treated as inactive).
Tensor l2_normalize_rows_backward(const Tensor& y, const Tensor& norm, const Tensor& dy);

/// w = scale * v / sum_j v_j over rows of v [N, k]; returns w and saves the row sums in `sums`.
Tensor renormalize_rows(const Tensor& v, float scale, Tensor& sums);
/// dv from dw for renormalize_rows: dv_j = (scale * dw_j - sum_i dw_i w_i) / s.
Tensor renormalize_rows_backward(const Tensor& w, const Tensor& sums, const Tensor& dw,
                                 float scale);

}  // namespace xmoe::moe
