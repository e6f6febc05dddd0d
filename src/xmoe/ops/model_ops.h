#pragma once
// Model-specific ops: token embedding, rotary position embedding, causal self-attention with
// grouped-query heads, cross-entropy. Same conventions as ops.h: each function checks its
// arguments (messages name the op) and dispatches to a backend kernel (backend/cpu/model_kernels).
// Float tensors are f32 on the CPU, f32 or bf16 on CUDA (outputs in the input's dtype; lse is
// f32); ids and targets are i32 on the same device as the other operands.
#include <cstdint>

#include "xmoe/core/tensor.h"

namespace xmoe::ops {

// ---- embedding ------------------------------------------------------------------------------

/// out[i] = table[ids[i]]: table [V, d], ids i32 [N] (any shape, flattened) -> [N, d].
/// Throws if an id is outside [0, V).
Tensor embedding(const Tensor& table, const Tensor& ids);
/// dtable[ids[i]] += dout[i]: dtable [V, d], dout [N, d]. Deterministic (rows added in order).
void embedding_backward(Tensor& dtable, const Tensor& ids, const Tensor& dout);

// ---- rotary position embedding --------------------------------------------------------------

/// Precomputed cos/sin tables of RoPE, built once per model.
///
/// Pairing: "rotate-half" (GPT-NeoX / LLaMA-HF layout): within a head of width hd the pairs are
/// (j, j + hd/2) for j < hd/2, rotated by angle s * theta^(-2j/hd) at position s:
///   y[j]        = x[j] cos - x[j + hd/2] sin
///   y[j + hd/2] = x[j + hd/2] cos + x[j] sin
/// Positions restart at 0 in every sequence of a [B, S, H, hd] batch.
struct RopeTables {
  Tensor cos;  ///< [max_seq_len, hd/2]
  Tensor sin;  ///< [max_seq_len, hd/2]
  int64_t max_seq_len = 0;
  int64_t head_dim = 0;
  float theta = 0.f;
};
RopeTables rope_tables(int64_t max_seq_len, int64_t head_dim, float theta);
/// The same tables on `device` (CUDA ops need the tables on the tensors' device).
RopeTables rope_tables(int64_t max_seq_len, int64_t head_dim, float theta, Device device);

/// Rotates x [B, S, H, hd] in place (S <= tables.max_seq_len).
void rope_(Tensor& x, const RopeTables& tables);
/// Gradient of rope_: rotates dy [B, S, H, hd] in place by the opposite angle (RoPE is
/// orthogonal, so its backward is its inverse).
void rope_backward_(Tensor& dy, const RopeTables& tables);
/// Out-of-place forms.
Tensor rope(const Tensor& x, const RopeTables& tables);
Tensor rope_backward(const Tensor& dy, const RopeTables& tables);

// ---- causal self-attention ------------------------------------------------------------------

struct AttentionResult {
  Tensor out;  ///< [B, S, H, hd]
  Tensor lse;  ///< [B, H, S] f32: log-sum-exp of each softmax row, saved for backward
};
/// softmax(scale * q k^T + causal mask) v per head, scale = 1/sqrt(hd).
/// q [B, S, H, hd], k and v [B, S, Hkv, hd] with H % Hkv == 0: query head h uses kv head
/// h / (H / Hkv) (grouped-query attention; Hkv == H is multi-head, Hkv == 1 multi-query).
/// Memory: only lse (B·H·S floats) is produced besides out; the S x S probabilities are never
/// stored and are recomputed in attention_backward.
AttentionResult attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = true);

struct AttentionGrads {
  Tensor dq;  ///< [B, S, H, hd]
  Tensor dk;  ///< [B, S, Hkv, hd]
  Tensor dv;  ///< [B, S, Hkv, hd]
};
/// The scratch bytes attention_backward allocates for these shapes on `device` besides its
/// gradients: on CUDA cuDNN's workspace when cuDNN runs it (asked of cuDNN, so a GPU must be
/// present) or the native kernel's B·H·S floats; 0 on the CPU.
int64_t attention_backward_workspace_bytes(DType dtype, int64_t batch, int64_t seq, int64_t heads,
                                           int64_t kv_heads, int64_t head_dim, Device device,
                                           bool causal = true);
/// Gradients of attention from its inputs, its output `out`, the saved `lse` and dout.
AttentionGrads attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& lse, const Tensor& dout,
                                  bool causal = true);

// ---- cross-entropy --------------------------------------------------------------------------

struct CrossEntropyResult {
  float loss = 0.f;   ///< mean over the counted rows (0 if none)
  Tensor lse;         ///< [N] log-sum-exp of each row, saved for backward
  int64_t count = 0;  ///< rows with a target >= 0
};
/// Mean cross-entropy of logits [N, V] against targets i32 [N]. With ignore_negative, rows
/// whose target is < 0 (e.g. -1) are left out of the loss and of the mean; otherwise a negative
/// target throws. Targets >= V always throw.
CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& targets,
                                 bool ignore_negative = true);
/// d(dloss * loss)/d logits = dloss * (softmax - onehot) / count; ignored rows get 0.
Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets,
                              const CrossEntropyResult& fwd, float dloss = 1.0f);
/// Same, written over `logits` (saves a [N, V] buffer when the logits are not needed again).
void cross_entropy_backward_(Tensor& logits, const Tensor& targets, const CrossEntropyResult& fwd,
                             float dloss = 1.0f);

}  // namespace xmoe::ops
