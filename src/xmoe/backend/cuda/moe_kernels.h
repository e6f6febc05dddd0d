#pragma once
// CUDA launchers of the MoE layer (moe_*.cu): plain functions on raw device pointers and a stream,
// like kernels.h. None synchronises with the host. Float operands are f32 or bf16 (`dt`), math
// is f32 (statistics in double); routing tensors (weights, probabilities, logits) are f32,
// indices i32. A build without CUDA links backend/cuda_stub/moe_kernels_stub.cpp, which throws.
#include <cstddef>
#include <cstdint>

#include "xmoe/backend/cuda/runtime.h"
#include "xmoe/core/dtype.h"

namespace xmoe::cuda {

// ---- row helpers (moe_ops.cu) ---------------------------------------------------------------

// x (n, d) of dt: x[i, :] *= w[i]; w (n) f32.
void moe_scale_rows(void* x, DType dt, const float* w, int64_t n, int64_t d, Stream stream);
// out (n) f32 = sum_j a (n, d) * b (n, d), a and b of dt (f32 even for bf16 rows).
void moe_row_dot_f32(float* out, const void* a, const void* b, DType dt, int64_t n, int64_t d,
                     Stream stream);
// d_rows (n, d) [dt] = w[i] * dy[idx[i]], dot (n) f32 = rows[i] . dy[idx[i]]; dy (t, d) is f32 or
// dt; an index outside [0, t) gives a zero row and 0. d_rows may be rows (each element is read
// before the same thread overwrites it).
// With q (not null), also d_rows' FP8 rows (quantize_rows_fp8's bytes and scales, in groups of
// group_sizes rows): in the same pass where d % 128 == 0 and the rows are 16-byte aligned, else a
// quantising pass after.
void moe_gather_weighted_rows_dot(void* d_rows, float* dot, const void* dy, DType dy_dt,
                                  const void* rows, DType dt, const int32_t* idx, const float* w,
                                  int64_t n, int64_t t, int64_t d, Stream stream,
                                  uint8_t* q = nullptr, float* scales = nullptr,
                                  const int64_t* group_sizes = nullptr, int64_t groups = 0);
// out (n, k) = x (n, e)[i, idx[i, j]]; an index outside [0, e) gives 0.
void moe_take_along_rows(void* out, const void* x, DType dt, const int32_t* idx, int64_t n,
                         int64_t e, int64_t k, Stream stream);
// out (n, e)[i, idx[i, j]] += src (n, k)[i, j], j in increasing order per row (the CPU's order);
// an index outside [0, e) is skipped.
void moe_put_along_rows_add(void* out, DType dt, const int32_t* idx, const void* src, DType src_dt,
                            int64_t n, int64_t e, int64_t k, Stream stream);
// y (n, m) = x (m, n)^T
void moe_transpose(void* y, const void* x, DType dt, int64_t m, int64_t n, Stream stream);
// y (n, d) = x / norm, norm (n) f32 = max(||x_i||, eps)
void moe_l2_normalize_rows(void* y, float* norm, const void* x, DType dt, int64_t n, int64_t d,
                           float eps, Stream stream);
// dx = (dy - y (y . dy)) / norm
void moe_l2_normalize_rows_backward(void* dx, const void* y, const float* norm, const void* dy,
                                    DType dt, int64_t n, int64_t d, Stream stream);
// w (n, k) = scale * v / s, s (n) f32 = max(sum_j v_j, 1e-20)
void moe_renormalize_rows(void* w, float* sums, const void* v, DType dt, int64_t n, int64_t k,
                          float scale, Stream stream);
// dv = (scale * dw - sum_j dw_j w_j) / s
void moe_renormalize_rows_backward(void* dv, const void* w, const float* sums, const void* dw,
                                   DType dt, int64_t n, int64_t k, float scale, Stream stream);

// ---- order stage: the token layout (moe_layout.cu) ------------------------------------------

size_t moe_layout_workspace_bytes(int64_t pairs, int64_t experts);
// Stable counting sort of the pairs (topk_idx (pairs) = (token, slot) in order) by expert.
//   capacity == 0 (PFT): rows = pairs; expert e's rows are [start_e, start_e + load_e) in
//     (token, slot) order; token_ids, expert_ids, combine_weights (pairs), slot_to_row (pairs).
//   capacity  > 0 (padded): rows = experts * capacity; the first `capacity` pairs of expert e (in
//     pair order) take rows e*C .. e*C + C - 1, later ones are dropped (slot_to_row = -1); free
//     rows get token -1, weight 0, expert e.
// counts (experts + 1) i64: load per expert (pairs routed to it), then the first pair whose
// expert is outside [0, experts), or -1. Deterministic (integer counts, fixed chunking).
void moe_layout(const int32_t* topk_idx, const float* topk_weight, int64_t pairs, int64_t top_k,
                int64_t experts, int64_t capacity, int32_t* token_ids, int32_t* expert_ids,
                float* combine_weights, int32_t* slot_to_row, int64_t* counts, void* workspace,
                size_t workspace_bytes, Stream stream);

// ---- aux losses (moe_losses.cu) -------------------------------------------------------------

// Statistics of the aux losses, each in a fixed order (deterministic):
//   seq_count (S, E) f32: pairs of sequence s routed to e (exact: integers below 2^24)
//   seq_psum  (S, E) f64: sum over the sequence's tokens of probs[t, e]
//   stats (2E + 4) f64: [count_e (E), psum_e (E), T, S, sum_s E sum_e f_se P_se, sum_t lse_t^2]
// probs, z_logits (T, E) f32; topk_idx (T, k); seq_len divides T; S = T / seq_len.
// scratch: moe_aux_stats_scratch(tokens, experts, seq_len) doubles of partial sums.
void moe_aux_stats(double* stats, float* seq_count, double* seq_psum, const float* probs,
                   const int32_t* topk_idx, const float* z_logits, int64_t tokens, int64_t experts,
                   int64_t top_k, int64_t seq_len, double* scratch, Stream stream);
int64_t moe_aux_stats_scratch(int64_t tokens, int64_t experts, int64_t seq_len);
// all_stats (ranks, 2E + 4): every rank's stats, summed in rank order into the global ones;
// then terms (4) f64 = [load balance, seq balance, z-loss, weighted sum], frac (E) f32 = f_e and
// denoms (3) f64 = [T_g / W, seq_len S_g / W, T_g / W] (moe/losses.h).
void moe_aux_finalize(double* terms, float* frac, double* denoms, const double* all_stats,
                      int64_t ranks, int64_t experts, int64_t top_k, int64_t seq_len, double w_lb,
                      double w_seq, double w_z, Stream stream);
// dprobs (T, E) += w_lb E / denoms[0] * frac[e] + w_seq E / (L k denoms[1]) * seq_count[t / L, e]
// dlogits (T, E) += 2 w_z / denoms[2] * lse_t * softmax(z_logits_t)
// A zero weight skips its term. scale (f32 [1] on the device, or null): the weights' upstream
// gradient, read by the kernels (each weight is w * *scale, multiplied in f32).
void moe_aux_backward(float* dprobs, float* dlogits, const float* z_logits, const float* frac,
                      const float* seq_count, const double* denoms, int64_t tokens, int64_t experts,
                      int64_t seq_len, int64_t top_k, float w_lb, float w_seq, float w_z,
                      const float* scale, Stream stream);
// dlogits (tokens, experts) = put dv (tokens, k) at idx into zeros, moe_aux_backward's terms,
// softmax's backward through probs, added to the z-loss's term: those ops' bits in one pass, one
// warp per token row.
void moe_softmax_routing_backward(float* dlogits, const float* probs, const int32_t* idx,
                                  const float* dv, int64_t k, const float* z_logits,
                                  const float* frac, const float* seq_count, const double* denoms,
                                  int64_t tokens, int64_t experts, int64_t seq_len, int64_t top_k,
                                  float w_lb, float w_seq, float w_z, const float* scale,
                                  Stream stream);

// ---- gates (moe_gates.cu) -------------------------------------------------------------------

// biased (T, E) = scores + bias; with topk_groups < groups, the experts outside the topk_groups
// best groups (group score: sum of its top-2 biased scores; ties to the lower group) get -inf.
// groups <= 64.
void moe_group_limited_scores(float* biased, const float* scores, const float* bias, int64_t tokens,
                              int64_t experts, int64_t groups, int64_t topk_groups, Stream stream);
// out (n) = x (n) / max(*temperature, min_temperature)
void moe_div_temperature(float* out, const float* x, const float* temperature,
                         float min_temperature, int64_t n, Stream stream);
// *temperature_grad -= sum_i dlogits_i cos_i / tau^2 when *temperature >= min_temperature
// (tau = max(*temperature, min)); deterministic single-block sum in double.
void moe_temperature_grad(float* temperature_grad, const float* dlogits, const float* cos,
                          const float* temperature, float min_temperature, int64_t n,
                          Stream stream);

}  // namespace xmoe::cuda
