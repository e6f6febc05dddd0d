#pragma once
// CPU kernels of the model-specific ops (embedding, RoPE, causal attention, cross-entropy):
// plain functions on raw row-major pointers, OpenMP-parallel where it pays. Every kernel is
// deterministic: the order of floating-point accumulation does not depend on the thread count.
#include <cstdint>

namespace xmoe::cpu {

// ---- embedding ------------------------------------------------------------------------------

// out[i, :] = table[ids[i], :]; table (V, d), out (N, d)
void embedding_forward(float* out, const float* table, const int32_t* ids, int64_t n, int64_t d);
// dtable[ids[i], :] += dout[i, :], rows added in order of i (threads split the columns)
void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t n, int64_t d);

// ---- rotary position embedding (rotate-half pairs (j, j + hd/2)) ----------------------------

// cos/sin (max_seq, hd/2): angle(s, j) = s * theta^(-2j/hd)
void rope_tables(float* cos_table, float* sin_table, int64_t max_seq, int64_t head_dim,
                 float theta);
// x (B, S, H, hd) rotated in place by +angle (forward) or -angle (inverse = backward)
void rope_apply(float* x, const float* cos_table, const float* sin_table, int64_t batch,
                int64_t seq, int64_t heads, int64_t head_dim, bool inverse);

// ---- causal self-attention with grouped-query heads -----------------------------------------

// q, out (B, S, H, hd); k, v (B, S, Hkv, hd); lse (B, H, S) = log sum_j exp(scale * q_i . k_j).
// Query head h reads kv head h / (H / Hkv). Row i attends to j <= i when causal.
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, float scale, bool causal);
// dq (B, S, H, hd), dk, dv (B, S, Hkv, hd) are overwritten. The probabilities are recomputed
// row by row from q, k and lse (nothing of size S x S is stored).
void attention_backward(float* dq, float* dk, float* dv, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const float* dout,
                        int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, float scale, bool causal);

// ---- cross-entropy --------------------------------------------------------------------------

// Per row of logits (N, V): lse[i] = log sum exp(logits[i]); loss[i] = lse[i] - logits[i, t_i],
// or 0 where targets[i] < 0 (ignored).
void cross_entropy_forward(float* loss, float* lse, const float* logits, const int32_t* targets,
                           int64_t n, int64_t v);
// dlogits[i] = scale * (softmax(logits[i]) - onehot(t_i)); zero rows where t_i < 0.
// dlogits may alias logits (in-place backward).
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, int64_t n, int64_t v, float scale);

}  // namespace xmoe::cpu
