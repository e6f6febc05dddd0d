#pragma once
// Argument checks shared by the op implementations.
#include "xmoe/core/tensor.h"

namespace xmoe::ops::detail {

/// The CPU path is f32; other devices come with their backends.
inline void require_cpu(const char* op, const char* name, const Tensor& t, DType dtype) {
  XMOE_CHECK(t.defined(), "[{}] {} is undefined", op, name);
  XMOE_CHECK(t.is_cpu(), "[{}] has no {} implementation ({} is on {})", op, t.device().str(), name,
             t.device().str());
  check_dtype(t, dtype, op, name);
}

inline void require_f32(const char* op, const char* name, const Tensor& t) {
  require_cpu(op, name, t, DType::f32);
}

inline void require_2d(const char* op, const char* name, const Tensor& t) {
  XMOE_CHECK(t.dim() == 2, "[{}] {} must be 2-d, got shape {}", op, name, shape_str(t.shape()));
}

/// Rows and columns of x seen as [numel / last, last].
inline std::pair<int64_t, int64_t> rows_cols(const Tensor& x) {
  const int64_t cols = x.dim() ? x.size(-1) : 1;
  return {cols ? x.numel() / cols : 0, cols};
}

}  // namespace xmoe::ops::detail
