#include "xmoe/model/moe_ffn.h"

#include "xmoe/moe/layer.h"
#include "xmoe/parallel/layout.h"

namespace xmoe::model {

namespace {

/// The groups the layer uses from a run's layout: the world and this rank's ep group.
moe::LayerGroups groups_of(const parallel::Layout* layout) {
  if (!layout) return {};
  return {layout->world, layout->ep_group};
}

class MoEFFN : public FeedForward {
 public:
  MoEFFN(const MoeConfig& cfg, int64_t d_model, std::string prefix, uint64_t seed, float init_std,
         float out_std, const parallel::Layout* layout)
      : layer_(cfg, d_model, std::move(prefix), seed, init_std, out_std, groups_of(layout)) {}

  Tensor forward(const Tensor& x, int64_t seq_len) override { return layer_.forward(x, seq_len); }
  Tensor backward(const Tensor& dy) override { return layer_.backward(dy); }
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
};
}  // namespace

std::unique_ptr<FeedForward> make_moe_ffn(const MoeConfig& cfg, int64_t d_model, std::string prefix,
                                          uint64_t seed, float init_std, float out_std,
                                          const parallel::Layout* layout) {
  return std::make_unique<MoEFFN>(cfg, d_model, std::move(prefix), seed, init_std, out_std, layout);
}

}  // namespace xmoe::model
