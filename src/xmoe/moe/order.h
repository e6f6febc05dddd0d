#pragma once
// Stage 2, Order: lays out the T*k (token, slot) pairs as expert input rows, grouped by expert,
// then gathers the rows. Implementations by name (moe.impl):
//   pft    — the padding-free token buffer (X-MoE): exactly T*k rows, stably sorted by expert
//            (counting sort; within an expert, in (token, slot) order). No capacity, no drop.
//   padded — the DeepSpeed-MoE/Tutel baseline: [E, C, d] buffers, C = ceil(cf * T * k / E),
//            pairs beyond C per expert dropped in token order (moe/padded.h).
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "xmoe/config/config.h"
#include "xmoe/core/tensor.h"
#include "xmoe/moe/registry.h"

namespace xmoe::moe {

/// Where each (token, slot) pair sits in the expert input buffer. N = rows of the buffer
/// (PFT: T*k; padded: E*C). Index tensors live on the tensors' device; counts on the host
/// (grouped GEMM and all-to-all-v need them there). Built by ops::moe_layout: with CUDA tensors
/// on the device, and only the [E] counts are copied back (one wait).
struct TokenLayout {
  int64_t num_tokens = 0, top_k = 0, num_experts = 0;
  Tensor token_ids;        ///< i32 [N] token of each row; -1 marks a padding row
  Tensor expert_ids;       ///< i32 [N] expert of each row (non-decreasing)
  Tensor combine_weights;  ///< f32 [N] topk_weight of the row's pair; 0 for padding rows
  Tensor slot_to_row;      ///< i32 [T*k] row of pair (t, j) at t*k + j; -1 if it was dropped
  std::vector<int64_t> group_sizes;        ///< [E] buffer rows per expert (padded: C each)
  std::vector<int64_t> tokens_per_expert;  ///< [E] pairs each expert processes
  std::vector<int64_t> load;               ///< [E] pairs routed to each expert (before drops)
  int64_t capacity = 0;                    ///< padded: C; pft: 0 (none)
  int64_t dropped = 0;                     ///< pairs dropped for lack of capacity
  bool padded = false;                     ///< token_ids may hold -1 (padding rows)
  int64_t num_rows() const { return token_ids.defined() ? token_ids.numel() : 0; }
};

class Order {
 public:
  explicit Order(int64_t num_experts) : num_experts_(num_experts) {}
  virtual ~Order() = default;
  virtual std::string_view name() const = 0;

  /// Builds the layout from the gate's topk_idx i32 [T, k] and topk_weight f32 [T, k], then
  /// gathers x [T, d] into the rows [N, d].
  Tensor forward(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight);
  /// forward without the gather: only the layout (for experts that read x through token_ids).
  void plan(const Tensor& x, const Tensor& topk_idx, const Tensor& topk_weight);
  /// The rows of x [T, d] under the current layout: what forward returned, rebuilt (backward
  /// under recompute re-gathers them rather than keeping them).
  Tensor gather(const Tensor& x) const;
  const TokenLayout& layout() const { return layout_; }

  struct Grads {
    Tensor dx;             ///< [T, d]: row gradients added back into their tokens
    Tensor d_topk_weight;  ///< [T, k]: combine-weight gradients back in (token, slot) order
  };
  /// d_rows [N, d] and d_combine_weights [N] -> Grads; dx_addend [T, d] where given is added
  /// to dx in the same pass (the shared experts' dx).
  Grads backward(const Tensor& d_rows, const Tensor& d_combine_weights,
                 const Tensor& dx_addend = Tensor()) const;
  void release() { layout_ = {}; }

 protected:
  /// Rows per expert of a padded layout for T tokens of k slots; 0 = none (PFT).
  virtual int64_t capacity_for(int64_t tokens, int64_t top_k) const { return 0; }
  /// The layout of topk_idx/topk_weight [T, k] (a stable counting sort with capacity_for(T, k)
  /// rows per expert, ops::moe_layout) on their device; on CUDA the [E] counts are the one copy
  /// to the host.
  TokenLayout make_layout(const Tensor& topk_idx, const Tensor& topk_weight) const;

  int64_t num_experts_;

 private:
  TokenLayout layout_;
  int64_t d_model_ = 0;
};

using OrderRegistry = Registry<Order, const MoeConfig&>;
/// Built-in: "pft", "padded" (the value of moe.impl).
OrderRegistry& order_registry();
std::unique_ptr<Order> make_order(const MoeConfig& config);

}  // namespace xmoe::moe
