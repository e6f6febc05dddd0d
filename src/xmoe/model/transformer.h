#pragma once
// Decoder-only transformer (DeepSeek-style MoE LM):
//   ids [B, S] -> Embedding -> L x TransformerBlock -> RMSNorm -> LM head -> logits [B·S, V]
// Blocks i < first_dense_layers use a dense SwiGLU FFN, the others the MoE layer.
// Every module has an explicit forward and backward and owns what it saves (see docs/model.md).
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/model/block.h"
#include "xmoe/model/embedding.h"
#include "xmoe/model/rmsnorm.h"
#include "xmoe/ops/model_ops.h"

namespace xmoe::model {

/// Throws "[config] model.<key> ..." for an inconsistent ModelConfig (head sizes, layers, ...).
void validate(const ModelConfig& cfg);

class Transformer : public Module {
 public:
  /// Builds and initialises every parameter from `seed` (matrices N(0, init_std^2), wo and
  /// down scaled by 1/sqrt(2·num_layers), norms 1). The same seed gives the same weights on
  /// any number of ranks.
  /// `layout` (null = one process) shards the MoE layers' experts over its ep group and, with
  /// parallel.tp = P > 1, the attention heads and dense FFN columns over its tp group: each rank
  /// then takes its B/P sequences of every micro-batch [B, S] it is given (the tp group is
  /// given the same one) and computes the logits and the loss of those only (sequence
  /// parallelism). Other parameters are whole on every rank.
  Transformer(const ModelConfig& cfg, uint64_t seed, const parallel::Layout* layout = nullptr);
  ~Transformer() override;

  /// ids i32 [B, S] (S <= max_seq_len) -> logits [B·S, V]. Saves what backward needs.
  Tensor forward(const Tensor& ids);
  /// forward + mean cross-entropy against targets i32 [B, S] (targets < 0 are ignored).
  /// Keeps the logits and the loss's log-sum-exp for backward(). Returns the CE loss only:
  /// add aux_loss() for the training objective.
  float forward_loss(const Tensor& ids, const Tensor& targets);
  /// Mean cross-entropy of given logits [B·S, V] against targets [B, S] (targets < 0 ignored).
  static float loss(const Tensor& logits, const Tensor& targets);
  /// Forward-only loss for evaluation: forward + cross-entropy, then release(). Leaves the
  /// parameters' grads untouched. (MoE layers still count their load in it.)
  float evaluate_loss(const Tensor& ids, const Tensor& targets);
  /// Frees every activation saved by the last forward (all modules and the logits).
  void release();

  /// Backward of the loss of the last forward_loss, scaled by `dloss` (e.g. 1/grad_accum); the
  /// MoE aux losses' gradients get the same scale.
  /// Accumulates into every parameter's grad and releases all saved activations. The MoE
  /// layers add their aux-loss gradients themselves.
  void backward(float dloss = 1.0f);
  /// Backward from a gradient of the logits of the last forward(): dlogits [B·S, V].
  void backward_logits(const Tensor& dlogits);
  /// Called by backward with the parameters whose gradients it has just finished, module by
  /// module (the LM head, the final norm, the blocks from the last, the embedding), e.g. to
  /// start their gradient sync while the layers below run backward. Empty: none.
  using GradsReady = std::function<void(const std::vector<Parameter*>&)>;
  void set_grads_ready(GradsReady fn) { grads_ready_ = std::move(fn); }
  /// A module as backward reports it to grads_ready: its name ("lm_head", "final_norm",
  /// "block 3", "embedding") and parameters.
  struct BackwardModule {
    std::string name;
    std::vector<Parameter*> params;
  };
  /// The modules in the order backward finishes them (and reports them to grads_ready).
  std::vector<BackwardModule> backward_modules();

  /// Sum of the MoE layers' weighted auxiliary losses of the last forward.
  float aux_loss() const;
  std::vector<moe::MoELayer*> moe_layers();
  /// Switches recompute per module kind (initially from ModelConfig::recompute).
  void set_recompute(const RecomputeOptions& r);
  /// Bytes of activations currently held for backward, all modules together.
  int64_t saved_bytes() const;
  /// The model's two ends for `batch` sequences of `seq_len` tokens in `dtype` (the blocks are
  /// TransformerBlock::activation_bytes_for): the batch's ids and targets (the embedding and the
  /// loss keep views of them), the final norm, the LM head's input [T, d], the logits [T, V]
  /// and the loss's log-sum-exp. Backward turns the logits into their gradient in place and
  /// holds it to the end (`kept`, with the batch); the LM head and the final norm each make an
  /// f32 dx [T, d]. With tensor parallelism over `tp` ranks every rank holds the whole batch
  /// (`batch` sequences) and 1/tp of the rest.
  static ActivationBytes ends_activation_bytes_for(const ModelConfig& cfg, int64_t batch,
                                                   int64_t seq_len, DType dtype, int tp = 1);

  /// embed.weight, then per layer: attn_norm, attn.{wq,wk,wv,wo}, ffn_norm, ffn/moe, then
  /// final_norm.weight, lm_head.weight (absent with tie_embeddings).
  void collect_parameters(std::vector<Parameter*>& out) override;
  int64_t num_parameters();

  // ---- device and precision (docs/cuda.md) ----
  /// Moves every parameter (value, grad, bf16 copy) and the RoPE tables to `device`. Build the
  /// model on the CPU (initialisation is counter-based on the host) and move it: the weights are
  /// the same on every device. Inputs (ids, targets) must then be on `device`. MoE layers'
  /// parameters move too; their non-parameter state (the sigmoid gate's bias) is the layer's.
  void to(Device device);
  Device device() const { return device_; }
  /// The compute dtype: f32 (the default, the CPU's only), or bf16 (CUDA): every matrix
  /// parameter gets a bf16 copy (Parameter::compute_copy, rewritten by AdamW with each update);
  /// attention and FFN inputs, their matmuls (f32 accumulation), the logits and the LM head run
  /// in bf16; the residual stream, the RMSNorms, the weight gradients, the cross-entropy
  /// statistics and the loss stay f32.
  void set_compute_dtype(DType dtype);
  DType compute_dtype() const { return compute_; }
  /// train.offload_optimizer on CUDA (docs/training.md, "Optimizer offload"): every parameter's
  /// f32 master weights move to pinned host memory (Parameter::offload_master); the device
  /// keeps the gradients, the bf16 copies and an f32 copy only where forward reads f32 (f32
  /// compute: every parameter). After to() and set_compute_dtype(), which it then refuses. A
  /// no-op on the CPU.
  void offload_master_weights();
  /// to(device), set_compute_dtype(dtype) and, with `offload_master`, offload_master_weights()
  /// in one pass, parameter by parameter (the same bits): the device never holds more than one
  /// parameter's f32 master beyond what stays there, where the three calls would hold the whole
  /// f32 model for a moment (the model that fits only because of the offload would not).
  void place(Device device, DType dtype, bool offload_master);
  bool master_offloaded() const { return offloaded_; }
  /// Re-casts the bf16 copies (and, offloaded, the device's f32 copies) from the f32 master
  /// weights: after anything other than AdamW wrote parameter values (checkpoint load, expert
  /// permutation). A no-op in f32 without offload. Skips the parameters whose masters are
  /// sharded (Parameter::master_sharded): their writer (a checkpoint load, the all-gather)
  /// writes the bf16 copy itself.
  void refresh_compute_weights();

  const ModelConfig& config() const { return cfg_; }
  int num_layers() const { return static_cast<int>(blocks_.size()); }
  TransformerBlock& block(int i) { return *blocks_.at(static_cast<size_t>(i)); }
  Embedding& embedding() { return *embed_; }
  RMSNorm& final_norm() { return *final_norm_; }
  /// The LM head [d, V], or null when tied to the embedding.
  Parameter* lm_head() { return lm_head_.get(); }

 private:
  ModelConfig cfg_;
  std::shared_ptr<ops::RopeTables> rope_;  // shared with the blocks; replaced in place by to()
  std::unique_ptr<Embedding> embed_;
  std::vector<std::unique_ptr<TransformerBlock>> blocks_;
  std::unique_ptr<RMSNorm> final_norm_;
  std::unique_ptr<Parameter> lm_head_;
  Device device_ = Device::cpu();
  DType compute_ = DType::f32;
  bool offloaded_ = false;

  /// This rank's rows [B/P, ...] of a [B, ...] tensor (tp = 1: t); `what` names it in errors.
  Tensor my_sequences(const Tensor& t, const char* what) const;

  /// Materializes `params`' gradients (Parameter::materialize_grad), runs `backward`, then
  /// hands them to grads_ready_.
  template <class F>
  void backward_of(const std::vector<Parameter*>& params, F&& backward);
  GradsReady grads_ready_;

  int tp_ = 1, tp_rank_ = 0;
  float moe_aux_scale_ = 1.0f;  // the MoE layers' aux-loss gradient factor (parallel.ssmb off)

  // Saved by forward / forward_loss.
  int64_t batch_ = 0, seq_ = 0;  // batch_: this rank's sequences
  Tensor xf_;                    // [T, d] final-norm output, input of the LM head
  Tensor logits_;                // [T, V] (kept by forward_loss until backward)
  Tensor targets_;               // [T] i32
  ops::CrossEntropyResult ce_;
};

}  // namespace xmoe::model
