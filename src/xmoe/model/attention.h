#pragma once
// Causal self-attention with RoPE and grouped-query heads.
//
//   q = x wq [T, H·hd], k = x wk, v = x wv [T, Hkv·hd]   (seen as [B, S, heads, hd])
//   q, k <- RoPE(q), RoPE(k)
//   a = softmax(q k^T / sqrt(hd) + causal mask) v        [B, S, H, hd]
//   y = a wo                                              [T, d]
//
// Tensor parallelism over a tp group of size P (Megatron with sequence parallelism): this rank
// holds H/P query heads and Hkv/P kv heads (column shards of wq, wk, wv, a row shard of wo).
// Its input is its slice [T/P, d] of the micro-batch's tokens: gathered to [T, d], attended over
// the local heads, and the partial outputs [T, d] reduce-scattered back to [T/P, d]. Backward
// mirrors it (gather dy, reduce-scatter dx).
#include <memory>
#include <string>

#include "xmoe/comm/group.h"
#include "xmoe/core/activation_bytes.h"
#include "xmoe/core/parameter.h"
#include "xmoe/model/embedding.h"
#include "xmoe/ops/model_ops.h"

namespace xmoe::model {

struct AttentionShape {
  int64_t d_model = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;  ///< d_model / num_heads
};

/// What attention drops after forward and recomputes in backward (model.recompute).
enum class AttentionRecompute {
  none,  ///< keeps x, q, k, v, a, lse
  core,  ///< "attention_core": keeps x, q, k, v (after RoPE); recomputes a and lse from them
  all,   ///< "attention": keeps x; recomputes the projections, RoPE and the attention
};

class Attention : public Module {
 public:
  /// Parameters "<prefix>.wq" [d, H·hd], ".wk" [d, Hkv·hd], ".wv" [d, Hkv·hd], ".wo" [H·hd, d];
  /// wq, wk, wv ~ N(0, init_std^2), wo ~ N(0, out_std^2). `rope` is shared by all layers.
  /// `tp` (null = none): this rank's shards of them (shape = the whole model's; P must divide
  /// num_kv_heads), initialised as the same elements of the whole tensors.
  Attention(std::string prefix, AttentionShape shape, std::shared_ptr<const ops::RopeTables> rope,
            uint64_t seed, float init_std, float out_std,
            std::shared_ptr<comm::Group> tp = nullptr);

  /// x [B·S, d] -> [B·S, d] (f32 when x is bf16: the output joins the f32 residual stream).
  /// With tp, x and the output are this rank's rows [B·S/P, d] and `batch` its B/P sequences.
  /// Saves x (shared with the caller) and, without recompute, q, k, v (after RoPE), the
  /// attention output a and the softmax log-sum-exp: T·(2·H + 2·Hkv)·hd + B·H·S floats.
  /// Recompute core keeps x, q, k, v (drops T·H·hd + B·H·S); all keeps only x.
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq_len);
  /// dy [B·S, d] -> dx (f32); accumulates the four weight gradients (f32, also from bf16
  /// activations); releases what forward saved.
  Tensor backward(const Tensor& dy);

  /// Frees what forward saved (forward-only use).
  void release() { x_ = q_ = k_ = v_ = a_ = lse_ = Tensor(); }
  void set_recompute(AttentionRecompute r) { recompute_ = r; }
  AttentionRecompute recompute() const { return recompute_; }
  int64_t saved_bytes() const;
  /// What forward saves and backward adds, for `batch` sequences of `seq_len` tokens in
  /// `dtype` (the formula of forward's comment; backward adds da, dq, dk, dv, its f32 dx and,
  /// with recompute, what forward dropped). `shape` is the whole model's; with tensor
  /// parallelism over `tp` ranks, `batch` is the whole micro-batch (this rank gathers its
  /// tokens and works on H/tp, Hkv/tp heads) and backward also holds the gathered dy [T, d].
  /// `workspace`: the attention kernel's backward scratch
  /// (ops::attention_backward_workspace_bytes).
  static ActivationBytes activation_bytes_for(const AttentionShape& shape, int64_t batch,
                                              int64_t seq_len, DType dtype,
                                              AttentionRecompute recompute, int tp = 1,
                                              int64_t workspace = 0);
  void collect_parameters(std::vector<Parameter*>& out) override;

  Parameter& wq() { return wq_; }
  Parameter& wk() { return wk_; }
  Parameter& wv() { return wv_; }
  Parameter& wo() { return wo_; }

 private:
  // Projections and RoPE from x_ into q_, k_, v_.
  void project();
  // The attention of q_, k_, v_ into a_, lse_.
  void attend();

  AttentionShape shape_;  // this rank's heads
  std::shared_ptr<comm::Group> tp_;
  std::shared_ptr<const ops::RopeTables> rope_;
  Parameter wq_, wk_, wv_, wo_;
  AttentionRecompute recompute_ = AttentionRecompute::none;
  int64_t batch_ = 0, seq_ = 0;  // of the whole (gathered) micro-batch
  Tensor x_;                     // [T, d] (gathered)
  Tensor q_, k_, v_;             // [B, S, H|Hkv, hd]
  Tensor a_, lse_;               // [B, S, H, hd], [B, H, S]
};

}  // namespace xmoe::model
