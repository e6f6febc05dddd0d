#include "xmoe/model/moe_ffn.h"

#include "xmoe/moe/layer.h"
#include "xmoe/parallel/layout.h"
#include "xmoe/parallel/tensor_parallel.h"

namespace xmoe::model {

namespace {

/// The groups the layer uses from a run's layout: the MoE world and this rank's ep group.
moe::LayerGroups groups_of(const parallel::Layout* layout) {
  if (!layout) return {};
  return {layout->moe_world, layout->ep_group};
}

/// With tensor parallelism the block's input is this rank's slice [T/P, d] of the micro-batch.
/// SSMB (sequence-sharded MoE block): the layer routes that slice directly; every rank holds
/// distinct tokens, so the layer's world is the whole world. Without SSMB (the X-MoE baseline):
/// the slice is gathered to [T, d], the layer runs the whole micro-batch replicated on the tp
/// ranks (its world: the tp-replica group) and each rank keeps its rows of the output; backward
/// gathers dy and keeps this rank's rows of dx, which the replicated compute already holds whole.
class MoEFFN : public FeedForward {
 public:
  MoEFFN(const MoeConfig& cfg, int64_t d_model, std::string prefix, uint64_t seed, float init_std,
         float out_std, const parallel::Layout* layout)
      : layer_(cfg, d_model, std::move(prefix), seed, init_std, out_std, groups_of(layout)) {
    if (!layout || layout->tp == 1 || layout->ssmb) return;
    tp_ = layout->tp_group;
    // Every tp rank of a group computes the same gradient for the layer's replicated
    // parameters: they sum over the tp-replica group only (parallel/grad_sync.h).
    for (Parameter* p : layer_.parameters())
      if (p->kind == ParamKind::dense) p->kind = ParamKind::tensor_replicated;
  }

  Tensor forward(const Tensor& x, int64_t seq_len) override {
    return parallel::own_rows(tp_.get(),
                              layer_.forward(parallel::gather_rows(tp_.get(), x), seq_len));
  }
  Tensor backward(const Tensor& dy) override {
    return parallel::own_rows(tp_.get(), layer_.backward(parallel::gather_rows(tp_.get(), dy)));
  }
  void release() override { layer_.release(); }
  // The layer's own switch: its experts recompute their gate_up output in backward.
  void set_recompute(bool on) override { layer_.set_recompute(on); }
  // The layer does not report its bytes; measure it with a PeakMemoryScope.
  int64_t saved_bytes() const override { return 0; }
  float aux_loss() const override { return layer_.aux_loss(); }
  moe::MoELayer* moe_layer() override { return &layer_; }
  void collect_parameters(std::vector<Parameter*>& out) override { layer_.collect_parameters(out); }

 private:
  moe::MoELayer layer_;
  std::shared_ptr<comm::Group> tp_;  // without SSMB only
};
}  // namespace

ActivationBytes moe_ffn_activation_bytes_for(const MoeConfig& cfg, int64_t d_model, int64_t tokens,
                                             DType dtype, const moe::LayerRecompute& recompute,
                                             const ActivationLayout& l) {
  const bool replicated = l.tp > 1 && !l.ssmb;
  ActivationBytes a = moe::MoELayer::activation_bytes_for(
      cfg, d_model, replicated ? tokens : tokens / l.tp, l.ep, dtype, recompute, l.load_imbalance,
      l.expert_weights_kept);
  if (replicated) a.backward_extra += tokens * d_model * static_cast<int64_t>(dtype_size(dtype));
  return a;
}

std::unique_ptr<FeedForward> make_moe_ffn(const MoeConfig& cfg, int64_t d_model, std::string prefix,
                                          uint64_t seed, float init_std, float out_std,
                                          const parallel::Layout* layout) {
  return std::make_unique<MoEFFN>(cfg, d_model, std::move(prefix), seed, init_std, out_std, layout);
}

}  // namespace xmoe::model
