#pragma once
// Token embedding: ids i32 [B, S] -> rows of the table [V, d].
#include <string>

#include "xmoe/core/parameter.h"

namespace xmoe::model {

/// Bytes of a tensor that is held for backward (0 if undefined).
inline int64_t held_bytes(const Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
}

/// t itself when it has `dtype`, else ops::cast(t, dtype) (a new tensor on t's device).
Tensor as_dtype(const Tensor& t, DType dtype);

class Embedding : public Module {
 public:
  /// Parameter `name` [vocab, d], N(0, init_std^2).
  Embedding(std::string name, int64_t vocab, int64_t d, uint64_t seed, float init_std);

  /// ids i32 (any shape, N elements) -> [N, d]. Saves the ids (4 bytes per token).
  Tensor forward(const Tensor& ids);
  /// Adds the scatter of dy [N, d] into the table's gradient; releases the saved ids.
  void backward(const Tensor& dy);

  /// Frees what forward saved (forward-only use).
  void release() { ids_ = Tensor(); }
  Parameter& weight() { return weight_; }
  const Parameter& weight() const { return weight_; }
  int64_t saved_bytes() const { return held_bytes(ids_); }
  void collect_parameters(std::vector<Parameter*>& out) override { out.push_back(&weight_); }

 private:
  Parameter weight_;
  Tensor ids_;  // [N] i32
};

}  // namespace xmoe::model
