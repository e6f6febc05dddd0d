#pragma once
// The MoE layer's stage boundaries: one struct for each hand-over from one stage to the next, so
// that a misspelt field fails to compile and a reader can follow one tensor through the layer
// (moe/layer.cpp). Hooks (moe/hooks.h) get a boundary's struct and may read or replace its
// tensors. T tokens of width d, top-k, N rows (PFT: T·k; padded: E·C), N' rows for this rank's
// experts (N' = N on one process).
//
//   forward                                                  from -> to
//   LayerIn       x [T, d]                                   the caller -> Gate, Order, Shared
//   GateOut       topk_idx i32 [T, k], topk_weight [T, k]    Gate -> Order
//   OrderOut      rows [N, d], combine_weights [N]           Order -> Dispatch (weights: I-Order)
//   DispatchOut   expert_in [N', d]                          Dispatch -> Expert
//   ExpertOut     expert_out [N', d]                         Expert -> Combine
//   CombineOut    rows_out [N, d]                            Combine -> I-Order
//   IOrderOut     y [T, d]                                   I-Order -> the layer's output
//   SharedOut     y [T, d]                                   Shared -> the layer's output (added)
//
//   backward: each field is the gradient of the forward tensor of the same name after "d_"
//   LayerOutGrad  d_y [T, d]                                 the caller -> Shared, I-Order
//   SharedGrad    d_x [T, d]                                 Shared -> dx (added)
//   IOrderGrad    d_rows_out [N, d], d_combine_weights [N]   I-Order -> Combine
//   CombineGrad   d_expert_out [N', d], d_combine_weights    Combine -> Expert (weights: Order)
//   ExpertGrad    d_expert_in [N', d]                        Expert -> Dispatch
//   DispatchGrad  d_rows [N, d]                              Dispatch -> Order
//   OrderGrad     d_x [T, d], d_topk_weight [T, k]           Order -> Gate (d_x: dx, added)
//   GateGrad      d_x [T, d]                                 Gate -> dx (added)
//
// With moe.dispatch = rbd, combine applies the combine weights and sums each token's rows per
// node: rows_out and d_rows_out are then [G, d] partial sums (G token-node groups), the I-Order
// backward has no d_combine_weights and combine's backward makes them.
//
// Each struct lists its tensors in tensors() (name and address), for the hooks' checks and
// messages; the layer itself reads the fields by name.
#include <array>
#include <cstdint>
#include <span>
#include <string_view>

#include "xmoe/core/tensor.h"
#include "xmoe/moe/losses.h"
#include "xmoe/moe/order.h"

namespace xmoe::moe {

/// A tensor field of a boundary, for the hooks' checks: its name and where it is.
struct TensorField {
  std::string_view name;
  Tensor* tensor;
};

// ---- forward ----------------------------------------------------------------------------------

/// Into the layer: what the gate, the order stage and the shared experts read.
struct LayerIn {
  Tensor x;  ///< [T, d] the tokens (f32, or bf16 on CUDA)

  static constexpr std::string_view kName = "LayerIn";
  auto tensors() { return std::array{TensorField{"x", &x}}; }
};

/// Gate -> Order: the routing.
struct GateOut {
  Tensor topk_idx;     ///< i32 [T, k] the experts each token chose
  Tensor topk_weight;  ///< f32 [T, k] their combine weights
  /// Read only: the aux losses of this forward (aux->weighted(): on CUDA a wait for the device).
  const AuxLossTerms* aux = nullptr;

  static constexpr std::string_view kName = "GateOut";
  auto tensors() {
    return std::array{TensorField{"topk_idx", &topk_idx}, TensorField{"topk_weight", &topk_weight}};
  }
};

/// Order -> Dispatch: the rows grouped by expert.
struct OrderOut {
  Tensor rows;             ///< [N, d] x[token_ids]: grouped by expert (padded: zero padding rows)
  Tensor combine_weights;  ///< f32 [N] topk_weight of each row's pair (read by the I-Order)
  /// Read only: token_ids, expert_ids, slot_to_row, tokens_per_expert, ... (moe/order.h).
  const TokenLayout* layout = nullptr;

  static constexpr std::string_view kName = "OrderOut";
  auto tensors() {
    return std::array{TensorField{"rows", &rows}, TensorField{"combine_weights", &combine_weights}};
  }
};

/// Dispatch -> Expert: the rows this rank's experts process.
struct DispatchOut {
  Tensor expert_in;  ///< [N', d] grouped by local expert
  /// Read only: rows per local expert [E_local].
  std::span<const int64_t> rows_per_expert;

  static constexpr std::string_view kName = "DispatchOut";
  auto tensors() { return std::array{TensorField{"expert_in", &expert_in}}; }
};

/// Expert -> Combine.
struct ExpertOut {
  Tensor expert_out;  ///< [N', d] the experts' outputs, in expert_in's order

  static constexpr std::string_view kName = "ExpertOut";
  auto tensors() { return std::array{TensorField{"expert_out", &expert_out}}; }
};

/// Combine -> I-Order: the outputs back on the rank of their tokens.
struct CombineOut {
  Tensor rows_out;  ///< [N, d] in OrderOut::rows' order (rbd: [G, d] weighted partial sums)

  static constexpr std::string_view kName = "CombineOut";
  auto tensors() { return std::array{TensorField{"rows_out", &rows_out}}; }
};

/// I-Order -> the layer's output.
struct IOrderOut {
  Tensor y;  ///< [T, d] the routed experts' weighted sum per token

  static constexpr std::string_view kName = "IOrderOut";
  auto tensors() { return std::array{TensorField{"y", &y}}; }
};

/// The shared experts' output, added to IOrderOut::y.
struct SharedOut {
  Tensor y;  ///< [T, d]

  static constexpr std::string_view kName = "SharedOut";
  auto tensors() { return std::array{TensorField{"y", &y}}; }
};

// ---- backward ---------------------------------------------------------------------------------

/// Into the layer's backward.
struct LayerOutGrad {
  Tensor d_y;  ///< [T, d]

  static constexpr std::string_view kName = "LayerOutGrad";
  auto tensors() { return std::array{TensorField{"d_y", &d_y}}; }
};

/// The shared experts' backward: their part of dx.
struct SharedGrad {
  Tensor d_x;  ///< [T, d]

  static constexpr std::string_view kName = "SharedGrad";
  auto tensors() { return std::array{TensorField{"d_x", &d_x}}; }
};

/// I-Order -> Combine.
struct IOrderGrad {
  Tensor d_rows_out;         ///< [N, d] (rbd: [G, d])
  Tensor d_combine_weights;  ///< f32 [N] (rbd: undefined, combine's backward makes them)

  static constexpr std::string_view kName = "IOrderGrad";
  auto tensors() {
    return std::array{TensorField{"d_rows_out", &d_rows_out},
                      TensorField{"d_combine_weights", &d_combine_weights}};
  }
};

/// Combine -> Expert; the combine weights' gradient goes on to the order stage.
struct CombineGrad {
  Tensor d_expert_out;       ///< [N', d]
  Tensor d_combine_weights;  ///< f32 [N] (the I-Order's; under rbd, combine's)

  static constexpr std::string_view kName = "CombineGrad";
  auto tensors() {
    return std::array{TensorField{"d_expert_out", &d_expert_out},
                      TensorField{"d_combine_weights", &d_combine_weights}};
  }
};

/// Expert -> Dispatch.
struct ExpertGrad {
  Tensor d_expert_in;  ///< [N', d]

  static constexpr std::string_view kName = "ExpertGrad";
  auto tensors() { return std::array{TensorField{"d_expert_in", &d_expert_in}}; }
};

/// Dispatch -> Order.
struct DispatchGrad {
  Tensor d_rows;  ///< [N, d]

  static constexpr std::string_view kName = "DispatchGrad";
  auto tensors() { return std::array{TensorField{"d_rows", &d_rows}}; }
};

/// Order -> Gate: the routed path's part of dx and the gradient of the routing weights.
struct OrderGrad {
  Tensor d_x;            ///< [T, d]
  Tensor d_topk_weight;  ///< f32 [T, k]

  static constexpr std::string_view kName = "OrderGrad";
  auto tensors() {
    return std::array{TensorField{"d_x", &d_x}, TensorField{"d_topk_weight", &d_topk_weight}};
  }
};

/// The gate's backward: the router's part of dx (routing weights and aux losses).
struct GateGrad {
  Tensor d_x;  ///< [T, d]

  static constexpr std::string_view kName = "GateGrad";
  auto tensors() { return std::array{TensorField{"d_x", &d_x}}; }
};

}  // namespace xmoe::moe
