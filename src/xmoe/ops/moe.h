#pragma once
// The MoE ops: row helpers of the stages, the order stage's token layout, the router aux losses
// and the gates' selection and temperature. Same conventions as ops.h: each op checks its
// arguments (messages name the op) and dispatches on the device of its first operand to
// backend/cpu/moe_kernels.h (f32 rows) or backend/cuda/moe_kernels.h (f32 or bf16 rows, f32
// math). Routing tensors (weights, probabilities, logits, norms, sums) are f32; statistics f64;
// index tensors i32 on the same device, where an index < 0 marks an empty (padding) slot. No op
// here waits for the device unless it says so.
#include <cstdint>
#include <span>
#include <vector>

#include "xmoe/core/tensor.h"
#include "xmoe/ops/fp8.h"

namespace xmoe::ops {

// ---- row helpers ----------------------------------------------------------------------------

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
/// addend [T, d] of src's dtype (undefined: none) is added to each sum after its rows, in f32
/// before the one rounding: a sum and the add after it in one pass.
Tensor gather_sum_rows(const Tensor& src, const Tensor& slots, const Tensor& weight = Tensor(),
                       const Tensor& addend = Tensor());
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
/// fp8_groups (not empty): also d_rows' FP8 rows in groups of those sizes, the bytes and scales
/// of quantize_rows_fp8(d_rows, fp8_groups), on CUDA in the same pass (the FP8 experts' output
/// gradient, read by their down projection's data-gradient GEMM).
struct WeightedGather {
  Tensor d_rows;       ///< [N, d]
  Tensor dot;          ///< f32 [N]
  Fp8Rows d_rows_fp8;  ///< with fp8_groups
};
WeightedGather gather_weighted_rows_dot(const Tensor& dy, const Tensor& rows, const Tensor& index,
                                        const Tensor& weight, bool overwrite_rows = false,
                                        std::span<const int64_t> fp8_groups = {});
/// x itself when it has `dtype`, else cast(x, dtype).
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

// ---- order stage: the token layout ----------------------------------------------------------

struct MoeLayout {
  Tensor token_ids;           ///< i32 [N] token of each row; -1 marks a padding row
  Tensor expert_ids;          ///< i32 [N] expert of each row (non-decreasing)
  Tensor combine_weights;     ///< f32 [N] topk_weight of the row's pair; 0 for padding rows
  Tensor slot_to_row;         ///< i32 [T*k] row of pair (t, j) at t*k + j; -1 if it was dropped
  std::vector<int64_t> load;  ///< [E] pairs routed to each expert (before drops), on the host
};
/// Stable counting sort of the T*k (token, slot) pairs of topk_idx i32 [T, k] (weights
/// topk_weight f32 [T, k]) by expert, as rows of the experts' input buffer:
///   capacity == 0 (PFT): N = T*k rows; expert e's rows in (token, slot) order.
///   capacity  > 0 (padded): N = experts * capacity; the first `capacity` pairs of expert e (in
///     pair order) take rows e*C .. e*C + C - 1, later ones are dropped; free rows get token -1,
///     weight 0 and expert e.
/// Throws "[moe_layout] topk_idx holds expert e outside [0, experts)". On CUDA the layout is
/// built on the device; `load` (with the id check) is its one copy to the host, which waits.
MoeLayout moe_layout(const Tensor& topk_idx, const Tensor& topk_weight, int64_t experts,
                     int64_t capacity);

// ---- router aux losses (formulas and the multi-rank convention in moe/losses.h) -------------

struct MoeAuxStats {
  /// i64 [1, 2E + 4] holding f64 bits: [count_e (E), psum_e (E), T, S, sum_s E sum_e f_se P_se,
  /// sum_t lse_t^2], this rank's sums. i64 because collectives move i64 bit for bit: the sums
  /// stay exact across ranks when they are gathered and added in order, never reduced.
  Tensor stats;
  Tensor seq_count;  ///< f32 [S, E] pairs of sequence s routed to e (exact integers)
};
/// The statistics of probs f32 [T, E] (the router probabilities the balance losses use),
/// topk_idx i32 [T, k] and z_logits f32 [T, E] (the logits of the z-loss); seq_len divides T,
/// S = T / seq_len. Each sum in a fixed order (deterministic).
MoeAuxStats moe_aux_stats(const Tensor& probs, const Tensor& topk_idx, const Tensor& z_logits,
                          int64_t seq_len);

struct MoeAuxTerms {
  Tensor terms;   ///< f64 [4]: load balance, sequence balance, z-loss, weighted sum
  Tensor frac;    ///< [E] f_e over the global batch: f64 on the CPU, f32 on CUDA
  Tensor denoms;  ///< f64 [3] gradient denominators: T_g / W, seq_len S_g / W, T_g / W
};
/// all_stats [W, 2E + 4] (i64 bits of f64, as moe_aux_stats gives them): every rank's stats,
/// summed in rank order into the global ones, then the terms weighted by w_lb, w_seq, w_z.
MoeAuxTerms moe_aux_finalize(const Tensor& all_stats, int64_t top_k, int64_t seq_len, float w_lb,
                             float w_seq, float w_z);

/// Adds the gradient of the weighted aux losses: into dprobs f32 [T, E] the load-balance and
/// sequence terms (from frac and seq_count), into dlogits f32 [T, E] the z-loss term (from
/// z_logits f32 [T, E]); frac, seq_count and denoms as moe_aux_stats and moe_aux_finalize gave
/// them. A zero weight skips its term. `scale` (f32, one element, on dprobs' device; undefined:
/// 1) multiplies the weights where the kernels run: an upstream gradient left on the GPU costs no
/// host wait (each weight is w * scale in f32, the bits of passing the product).
void moe_aux_backward(Tensor& dprobs, Tensor& dlogits, const Tensor& z_logits, const Tensor& frac,
                      const Tensor& seq_count, const Tensor& denoms, int64_t seq_len, int64_t top_k,
                      float w_lb, float w_seq, float w_z, const Tensor& scale = Tensor());
/// dlogits f32 [T, E] of the GShard softmax routing (P = softmax(logits), weights P[idx]): dv
/// f32 [T, k] put at idx i32 [T, k] into dP, moe_aux_backward's terms added (dP; the z-loss's
/// into dlogits), then softmax's backward added: the bits of put_along_rows_add into zeros,
/// moe_aux_backward, softmax_backward and add_, in one pass on CUDA.
Tensor moe_softmax_routing_backward(const Tensor& probs, const Tensor& idx, const Tensor& dv,
                                    const Tensor& z_logits, const Tensor& frac,
                                    const Tensor& seq_count, const Tensor& denoms, int64_t seq_len,
                                    int64_t top_k, float w_lb, float w_seq, float w_z,
                                    const Tensor& scale = Tensor());

// ---- gates ----------------------------------------------------------------------------------

/// scores f32 [T, E] + bias f32 [E]; with topk_groups < groups (groups divides E, at most 64),
/// the experts outside the topk_groups best groups (group score: sum of its top-2 biased
/// scores; ties to the lower group) get -inf. Returns f32 [T, E].
Tensor moe_group_limited_scores(const Tensor& scores, const Tensor& bias, int64_t groups,
                                int64_t topk_groups);
/// x f32 / tau, tau = max(temperature, min_temperature), temperature f32 [1] read where it lives
/// (on CUDA: on the device, no wait). The CPU multiplies by 1 / tau.
Tensor moe_div_temperature(const Tensor& x, const Tensor& temperature, float min_temperature);
/// temperature_grad f32 [1] -= sum_i dlogits_i cos_i / tau^2 (f64 sum) while temperature >=
/// min_temperature (the gradient of logits = cos / tau); dlogits, cos f32 of one shape.
void moe_temperature_grad(Tensor& temperature_grad, const Tensor& dlogits, const Tensor& cos,
                          const Tensor& temperature, float min_temperature);

}  // namespace xmoe::ops
