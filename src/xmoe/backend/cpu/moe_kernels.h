#pragma once
// CPU kernels of the MoE ops (ops/moe.h): plain functions on raw row-major pointers, the
// reference of backend/cuda/moe_kernels.h. Rows are f32; routing weights, norms and sums f32;
// statistics f64; indices i32, where an index < 0 marks an empty (padding) slot. The ops check
// every index before calling these, so nothing here throws. Deterministic: no result depends on
// the thread count.
#include <cstdint>

namespace xmoe::cpu {

// ---- row helpers ----------------------------------------------------------------------------

// out (m, d) = x[index[i]], a zero row where index[i] < 0
void gather_rows_masked(float* out, const float* x, const int32_t* index, int64_t m, int64_t d);
// out[index[i]] += weight[i] * src (m, d)[i], rows with index[i] < 0 skipped; weight may be null
// (1). Sequential over i: rows may share a target, and the order of the sums is fixed.
void scatter_add_rows_masked(float* out, const float* src, const int32_t* index,
                             const float* weight, int64_t m, int64_t d);
// out (t, d)[i] = sum over r = slots (t, k)[i, j] >= 0 of weight[r] * src[r], added in
// increasing r; weight may be null (1); addend (t, d), where not null, added to each sum last
void gather_sum_rows(float* out, const float* src, const int32_t* slots, const float* weight,
                     const float* addend, int64_t t, int64_t k, int64_t d);
// x (n, d)[i, :] *= w[i]
void scale_rows(float* x, const float* w, int64_t n, int64_t d);
// In place over rows (n, d): dot[i] = rows[i] . dy[index[i]], then rows[i] = dy[index[i]] *
// weight[i]; index[i] < 0 gives a zero row and 0. The arithmetic of gather_rows_masked,
// row_dot and scale_rows in sequence.
void gather_weighted_rows_dot_inplace(float* rows, float* dot, const float* dy,
                                      const int32_t* index, const float* weight, int64_t n,
                                      int64_t d);
// out (n, k) = x (n, e)[i, idx[i, j]]
void take_along_rows(float* out, const float* x, const int32_t* idx, int64_t n, int64_t e,
                     int64_t k);
// out (n, e)[i, idx[i, j]] += src (n, k)[i, j], in order of (i, j)
void put_along_rows_add(float* out, const int32_t* idx, const float* src, int64_t n, int64_t e,
                        int64_t k);
// y (n, m) = x (m, n)^T
void transpose(float* y, const float* x, int64_t m, int64_t n);
// y (n, d) = x / norm, norm (n) = max(||x_i||, eps) (the squares summed in f64)
void l2_normalize_rows(float* y, float* norm, const float* x, int64_t n, int64_t d, float eps);
// dx = (dy - y (y . dy)) / norm
void l2_normalize_rows_backward(float* dx, const float* y, const float* norm, const float* dy,
                                int64_t n, int64_t d);
// w (n, k) = scale * v / s, sums (n) = s = max(sum_j v_j, 1e-20)
void renormalize_rows(float* w, float* sums, const float* v, int64_t n, int64_t k, float scale);
// dv = (scale * dw - sum_j dw_j w_j) / s
void renormalize_rows_backward(float* dv, const float* w, const float* sums, const float* dw,
                               int64_t n, int64_t k, float scale);

// ---- order stage: the token layout ----------------------------------------------------------

// Counting sort of the pairs (topk_idx (tokens * top_k), ids in [0, experts)) by expert, stable
// (within an expert, in (token, slot) order): token_ids, expert_ids, combine_weights and
// slot_to_row (tokens * top_k); tokens_per_expert (experts).
void moe_layout_pft(const int32_t* topk_idx, const float* topk_weight, int64_t tokens,
                    int64_t top_k, int64_t experts, int32_t* token_ids, int32_t* expert_ids,
                    float* combine_weights, int32_t* slot_to_row, int64_t* tokens_per_expert);
// The padded layout: expert e's first `capacity` pairs (in pair order) take rows e*C .. e*C+C-1
// of token_ids, expert_ids, combine_weights (experts * capacity; free rows: token -1, weight 0);
// later ones are dropped (slot_to_row -1). load and kept (experts): pairs routed to and kept by
// each expert. Returns the number of dropped pairs.
int64_t moe_layout_padded(const int32_t* topk_idx, const float* topk_weight, int64_t tokens,
                          int64_t top_k, int64_t experts, int64_t capacity, int32_t* token_ids,
                          int32_t* expert_ids, float* combine_weights, int32_t* slot_to_row,
                          int64_t* load, int64_t* kept);

// ---- aux losses (formulas in moe/losses.h) --------------------------------------------------

// This rank's sums in f64: stats (2E + 4) = [count_e (E), psum_e (E), T, S,
// sum_s E sum_e f_se P_se, sum_t lse_t^2]; seq_count (S, E) = pairs of sequence s routed to e
// (exact integers). probs, z_logits (T, E); topk_idx (T, k); S = T / seq_len.
void moe_aux_stats(double* stats, float* seq_count, const float* probs, const int32_t* topk_idx,
                   const float* z_logits, int64_t tokens, int64_t experts, int64_t top_k,
                   int64_t seq_len);
// all_stats (ranks, 2E + 4): every rank's stats, summed in rank order (one rank: taken as is);
// then terms (4) = [load balance, seq balance, z-loss, weighted sum], frac (E) = f_e and
// denoms (3) = [T_g / W, seq_len S_g / W, T_g / W].
void moe_aux_finalize(double* terms, double* frac, double* denoms, const double* all_stats,
                      int64_t ranks, int64_t experts, int64_t top_k, int64_t seq_len, float w_lb,
                      float w_seq, float w_z);
// dprobs (T, E) += w_lb E f_e / denoms[0] + w_seq E f_se / denoms[1], f_se = seq_count / (L k);
// dlogits (T, E) += 2 w_z lse_t / denoms[2] * softmax(z_logits_t). A zero weight skips its term.
void moe_aux_backward(float* dprobs, float* dlogits, const float* z_logits, const double* frac,
                      const float* seq_count, const double* denoms, int64_t tokens, int64_t experts,
                      int64_t seq_len, int64_t top_k, float w_lb, float w_seq, float w_z);

// ---- gates ----------------------------------------------------------------------------------

// biased (T, E) = scores + bias; with topk_groups < groups, the experts outside the topk_groups
// best groups (group score: sum of its top-2 biased scores; ties to the lower group) get -inf.
void moe_group_limited_scores(float* biased, const float* scores, const float* bias, int64_t tokens,
                              int64_t experts, int64_t groups, int64_t topk_groups);
// out (n) = x * (1 / max(temperature, min_temperature))
void moe_div_temperature(float* out, const float* x, float temperature, float min_temperature,
                         int64_t n);
// *temperature_grad -= sum_i dlogits_i cos_i / tau^2 (in f64) when temperature >=
// min_temperature, tau = max(temperature, min_temperature)
void moe_temperature_grad(float* temperature_grad, const float* dlogits, const float* cos,
                          float temperature, float min_temperature, int64_t n);

}  // namespace xmoe::cpu
