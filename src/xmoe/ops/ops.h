#pragma once
// Public ops: one function per op. Each validates its arguments (shapes, dtypes, devices) with
// messages that name the op, then dispatches to a backend kernel (backend/cpu, backend/cuda).
// Float tensors are f32 on the CPU; on CUDA they are f32 or bf16 (bf16 storage, f32 math), and an
// op's float outputs have its input's dtype (statistics such as rstd and lse are always f32).
// All operands of an op must be on one device (docs/cuda.md).
#include <cstdint>
#include <span>
#include <vector>

#include "xmoe/core/tensor.h"

namespace xmoe::ops {

// ---- linear algebra -------------------------------------------------------------------------

/// c = op(a) @ op(b); a [M, K] (or [K, M] with trans_a), b [K, N] (or [N, K] with trans_b).
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);
/// op(a) @ op(b) into an f32 result: matmul when a is f32 (the CPU path, unchanged), else an
/// f32 output of bf16 products (f32 accumulation, no bf16 rounding of the result). Used where a
/// result joins the f32 residual stream (block outputs, input gradients) or stays f32 (logits).
Tensor matmul_f32(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);
/// c = alpha * op(a) @ op(b) + beta * c, in place (c must already have the result's shape).
void matmul_into(Tensor& c, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b,
                 float alpha = 1.0f, float beta = 0.0f);

/// x f32 [R, C] as bf16 terms that sum to it exactly: t0 = bf16(x), t1 = bf16(x - t0),
/// t2 = x - t0 - t1 (bf16 without rounding: 24 bits are three 8-bit pieces). Returns bf16
/// [R, C·terms.size()] whose column block j is term terms[j] (0, 1 or 2; at most 6 blocks):
/// the operands of f32-accurate GEMMs on bf16 tensor cores (the router's).
Tensor split_bf16_columns(const Tensor& x, std::span<const int> terms);
/// out f32 [R, C] = (accumulate ? out : 0) + the sum of y's n column blocks (y [R, C·n]), in
/// block order.
void sum_column_blocks_into(Tensor& out, const Tensor& y, int64_t n, bool accumulate);

/// Grouped GEMM over contiguous row groups: rows [o_g, o_g + n_g) of x [N, K] times w[g].
/// w is [G, K, M] (or [G, M, K] with trans_w); group_sizes has G entries summing to N.
/// Returns y [N, M]. Groups with zero rows are skipped.
Tensor grouped_matmul(const Tensor& x, const Tensor& w, std::span<const int64_t> group_sizes,
                      bool trans_w = false);
/// grouped_matmul into y [N, M] (e.g. a rows() view of a larger output).
void grouped_matmul_into(Tensor& y, const Tensor& x, const Tensor& w,
                         std::span<const int64_t> group_sizes, bool trans_w = false);
/// Weight gradient of grouped_matmul (trans_w = false): dw[g] (+)= x_g^T @ dy_g, dw [G, K, M].
void grouped_matmul_weight_grad(Tensor& dw, const Tensor& x, const Tensor& dy,
                                std::span<const int64_t> group_sizes, bool accumulate);

// ---- activations ----------------------------------------------------------------------------

/// Softmax over the last dimension.
Tensor softmax(const Tensor& x);
/// dx = y * (dy - sum(dy * y)) over the last dimension, given y = softmax(x).
Tensor softmax_backward(const Tensor& y, const Tensor& dy);
Tensor sigmoid(const Tensor& x);
/// dx = dy * y * (1 - y), given y = sigmoid(x).
Tensor sigmoid_backward(const Tensor& y, const Tensor& dy);
/// SwiGLU on a fused gate|up projection: h [N, 2f] -> silu(h[:, :f]) * h[:, f:], [N, f].
Tensor swiglu(const Tensor& h);
/// Gradient of swiglu: dh [N, 2f] from h [N, 2f] and da [N, f].
Tensor swiglu_backward(const Tensor& h, const Tensor& da);
/// swiglu_backward in place: h becomes dh (backward needs h no more; saves an [N, 2f] buffer).
void swiglu_backward_(Tensor& h, const Tensor& da);
/// swiglu_backward_ that also turns da into swiglu(h) (of h as it was): the value the
/// down-projection's weight gradient reads, in the same pass instead of a swiglu pass before
/// it, and in da's storage instead of a buffer of its own.
void swiglu_backward_with_value_(Tensor& h, Tensor& da);

// ---- normalisation --------------------------------------------------------------------------

struct RmsNormResult {
  Tensor y;     ///< [N, d]
  Tensor rstd;  ///< [N] 1 / sqrt(mean(x^2) + eps), saved for backward
};
/// y = x * rstd * weight over rows of x [N, d]; weight [d].
RmsNormResult rmsnorm(const Tensor& x, const Tensor& weight, float eps);
/// The same with y in y_dtype (the norm feeding a bf16 layer from the f32 residual stream
/// writes bf16 at once: no f32 y, no cast pass).
RmsNormResult rmsnorm(const Tensor& x, const Tensor& weight, float eps, DType y_dtype);
struct AddRmsNormResult {
  Tensor sum;   ///< [N, d] x + a, of x's dtype: the residual stream after the branch
  Tensor y;     ///< [N, d] rmsnorm(sum), of y_dtype
  Tensor rstd;  ///< [N]
};
/// The pre-norm block's residual add and the next norm in one pass: sum = x + a (a of either
/// float dtype), y = rmsnorm(sum) in y_dtype.
AddRmsNormResult add_rmsnorm(const Tensor& x, const Tensor& a, const Tensor& weight, float eps,
                             DType y_dtype);
/// Returns dx; adds the weight gradient into dweight [d].
Tensor rmsnorm_backward(const Tensor& x, const Tensor& weight, const Tensor& rstd, const Tensor& dy,
                        Tensor& dweight);
struct RmsNormGrad {
  Tensor dx;       ///< of x's dtype
  Tensor dx_copy;  ///< dx in copy_dtype when it differs from x's, else undefined
};
/// rmsnorm_backward in one pass with the block's neighbours: dy of either float dtype, the
/// residual stream's gradient (x's dtype, when defined) added to dx, and dx also written in
/// copy_dtype (bf16) when it is not x's dtype: what the layer below reads.
RmsNormGrad rmsnorm_backward_add(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                 const Tensor& dy, Tensor& dweight, const Tensor& residual,
                                 DType copy_dtype);

// ---- selection and indexing -----------------------------------------------------------------

struct TopKResult {
  Tensor values;   ///< [N, k] of x's dtype, descending
  Tensor indices;  ///< [N, k] i32; ties go to the lower index
};
/// Top-k of each row of x [N, E].
TopKResult topk(const Tensor& x, int64_t k);
struct SoftmaxTopKResult {
  Tensor probs;    ///< [N, E] softmax(x) over the last dimension
  TopKResult top;  ///< topk(probs, k)
};
/// softmax(x) and its top-k, the bits of softmax then topk; on CUDA one pass over rows of up to
/// 512 columns (the router's probabilities and its picks).
SoftmaxTopKResult softmax_topk(const Tensor& x, int64_t k);

/// out[i] = x[index[i]]: x [N, d], index i32 [M] -> [M, d].
Tensor gather_rows(const Tensor& x, const Tensor& index);
/// out[index[i]] += weight[i] * src[i]; out [N, d], src [M, d], index i32 [M], weight f32 [M]
/// (an undefined weight means 1). Deterministic: rows are added in index order of i (on CUDA
/// too: the entries are sorted by destination on the device, no atomics). On CUDA, src and
/// weight may be bf16 or f32 independently of out.
void scatter_add_rows(Tensor& out, const Tensor& src, const Tensor& index,
                      const Tensor& weight = Tensor());
/// out[i] = sum_j a[i, j] * b[i, j]: a, b [N, d] -> [N].
Tensor row_dot(const Tensor& a, const Tensor& b);

// ---- elementwise and reductions -------------------------------------------------------------

Tensor add(const Tensor& a, const Tensor& b);  ///< on CUDA b may differ in dtype (c is a's)
/// a += alpha * b
void add_(Tensor& a, const Tensor& b, float alpha = 1.0f);
Tensor mul(const Tensor& a, const Tensor& b);
/// scale_, sum_squares and all_finite also take bf16 tensors on the CPU (bf16 gradients).
void scale_(Tensor& a, float s);
double sum(const Tensor& x);
double sum_squares(const Tensor& x);
/// True if every element is finite.
bool all_finite(const Tensor& x);

/// x converted to `dtype` (f32 <-> bf16, round to nearest even) on x's device; a copy when the
/// dtype is already `dtype`.
Tensor cast(const Tensor& x, DType dtype);

// ---- argument checks ------------------------------------------------------------------------
// The ops' own rules and messages ("[op] name ..."), for the layers above that validate their
// inputs. Shapes and exact dtypes: check_shape, check_dtype (core/tensor.h).

/// A float operand: f32 on the CPU; f32 or bf16 on CUDA.
void check_float(const char* op, const char* name, const Tensor& t);
/// `t` is defined and on the device of `ref` (named ref_name).
void check_same_device(const char* op, const char* name, const Tensor& t, const char* ref_name,
                       const Tensor& ref);
/// Throws "[op] name[i] = v out of range [0, limit)" for the first bad entry of the i32 tensor
/// ids (negative entries allowed with allow_negative). On CUDA the scan runs on the device and
/// its one result is copied back, which waits for the stream.
void check_index_values(const char* op, const char* name, const Tensor& ids, int64_t limit,
                        bool allow_negative);

}  // namespace xmoe::ops
