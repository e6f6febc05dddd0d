#pragma once
// One pre-norm decoder block:
//   h = x + Attention(RMSNorm(x))
//   y = h + FFN(RMSNorm(h))        FFN = dense SwiGLU or the MoE layer
#include <memory>
#include <string>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/model/attention.h"
#include "xmoe/model/ffn.h"
#include "xmoe/model/rmsnorm.h"
#include "xmoe/parallel/layout.h"

namespace xmoe::model {

/// Which modules drop their activations after forward and recompute them in backward
/// (ModelConfig::recompute entries "attention", "attention_core", "ffn", "moe", "router";
/// docs/training.md, "Activation recompute").
struct RecomputeOptions {
  bool attention = false;       ///< keep x only: projections, RoPE and attention again
  bool attention_core = false;  ///< keep x, q, k, v: the attention a, lse again
  bool ffn = false;             ///< dense FFNs: h again
  bool moe = false;             ///< MoE layers: the experts' h again
  bool router = false;          ///< MoE layers: the gate's [T, E] routing tensors again
  /// What attention keeps ("attention" covers "attention_core").
  AttentionRecompute attention_mode() const {
    return attention        ? AttentionRecompute::all
           : attention_core ? AttentionRecompute::core
                            : AttentionRecompute::none;
  }
};
/// Parses ModelConfig::recompute; throws on an unknown entry.
RecomputeOptions parse_recompute(const std::vector<std::string>& names);

class TransformerBlock : public Module {
 public:
  /// Layer `index` of a model: parameters "layers.{index}.attn_norm.weight",
  /// "layers.{index}.attn.{wq,wk,wv,wo}", "layers.{index}.ffn_norm.weight", then
  /// "layers.{index}.ffn.{gate_up,down}" (index < first_dense_layers) or
  /// "layers.{index}.moe.*" (the MoE layer). `layout` (null = one process): the tp group splits
  /// the attention and dense FFN (the block then works on this rank's token slice), and the MoE
  /// layer takes its groups from it (model/moe_ffn.h).
  TransformerBlock(const ModelConfig& cfg, int index, std::shared_ptr<const ops::RopeTables> rope,
                   uint64_t seed, const parallel::Layout* layout = nullptr);

  /// The residual stream between blocks, x = sum + branch: the branch (the FFN's output, of the
  /// compute dtype) is left for the next norm to add in its pass; undefined: x = sum.
  struct Stream {
    Tensor sum;     ///< [B·S, d] f32
    Tensor branch;  ///< [B·S, d] or undefined
  };
  /// in -> out, the residual add after the FFN left to the next block's attention norm (or the
  /// final norm): one pass over the stream fewer per block, the same bits. With tensor
  /// parallelism, B is this rank's B/P sequences of the micro-batch.
  Stream forward(const Stream& in, int64_t batch, int64_t seq_len);
  /// x [B·S, d] (the f32 residual stream) -> [B·S, d] f32: the above, the add made here.
  Tensor forward(const Tensor& x, int64_t batch, int64_t seq_len);
  /// dy [B·S, d] -> dx. `dy_compute`: dy in the compute dtype where the caller has it (the
  /// block above wrote it beside its dx; dropped once the FFN has read it), else made here.
  /// `dx_compute` (not null): receives dx's compute-dtype copy, written in the attention norm's
  /// pass (undefined in f32 compute).
  Tensor backward(const Tensor& dy, Tensor dy_compute = Tensor(), Tensor* dx_compute = nullptr);

  /// Frees what forward saved (forward-only use).
  void release();
  void set_recompute(const RecomputeOptions& r);
  /// dtype of the attention and FFN inputs (f32, or bf16: the norms' outputs are cast, the
  /// residual stream and the norms stay f32; see docs/cuda.md).
  void set_compute_dtype(DType dtype) { compute_ = dtype; }
  bool is_moe() { return ffn_->moe_layer() != nullptr; }
  /// Bytes held for backward by the block's modules.
  int64_t saved_bytes() const;
  /// The block of layer `index` for a micro-batch of `batch` sequences of `seq_len` tokens in
  /// `dtype` (with tp, the tp group's: this rank's residual stream holds 1/tp of it): its
  /// modules' formulas, and backward's peak phase (the output gradient of each half, the
  /// residual's, and the module working).
  static ActivationBytes activation_bytes_for(const ModelConfig& cfg, int index, int64_t batch,
                                              int64_t seq_len, DType dtype,
                                              const RecomputeOptions& recompute,
                                              const ActivationLayout& layout);
  void collect_parameters(std::vector<Parameter*>& out) override;

  Attention& attention() { return *attn_; }
  FeedForward& ffn() { return *ffn_; }
  RMSNorm& attn_norm() { return *attn_norm_; }
  RMSNorm& ffn_norm() { return *ffn_norm_; }

 private:
  std::unique_ptr<RMSNorm> attn_norm_;
  std::unique_ptr<Attention> attn_;
  std::unique_ptr<RMSNorm> ffn_norm_;
  std::unique_ptr<FeedForward> ffn_;
  DType compute_ = DType::f32;
};

}  // namespace xmoe::model
