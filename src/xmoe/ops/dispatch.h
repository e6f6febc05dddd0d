#pragma once
// Argument checks and device dispatch shared by the op implementations.
//
// Dtypes: the CPU path is f32; on CUDA a float operand is f32 or bf16 (bf16 storage, f32 math),
// and the outputs of an op have its input's dtype. Every operand of an op must be on one device.
// A CUDA op activates the tensor's device and queues its kernels on that device's current stream
// (backend/cuda/runtime.h); it does not wait for them unless a value must reach the host.
#include <cstdlib>
#include <utility>

#include "xmoe/backend/cuda/kernels.h"
#include "xmoe/backend/cuda/runtime.h"
#include "xmoe/core/env.h"
#include "xmoe/core/tensor.h"

namespace xmoe::ops::detail {

inline void require_defined(const char* op, const char* name, const Tensor& t) {
  XMOE_CHECK(t.defined(), "[{}] {} is undefined", op, name);
}

/// A CPU tensor of exactly `dtype` (CPU-only operands such as host-side tables).
inline void require_cpu(const char* op, const char* name, const Tensor& t, DType dtype) {
  require_defined(op, name, t);
  XMOE_CHECK(t.is_cpu(), "[{}] {} must be on the CPU, but it is on {}", op, name, t.device().str());
  check_dtype(t, dtype, op, name);
}

inline bool is_float(DType d) {
  return d == DType::f32 || d == DType::bf16;
}

/// A float operand: f32 on the CPU; f32 or bf16 on CUDA.
inline void require_float(const char* op, const char* name, const Tensor& t) {
  require_defined(op, name, t);
  if (t.is_cpu()) {
    check_dtype(t, DType::f32, op, name);
  } else {
    XMOE_CHECK(is_float(t.dtype()), "[{}] {} has dtype {}, expected f32 or bf16", op, name,
               dtype_name(t.dtype()));
  }
}

/// `t` is on the same device as `ref` (named `ref_name`).
inline void require_same_device(const char* op, const char* name, const Tensor& t,
                                const char* ref_name, const Tensor& ref) {
  require_defined(op, name, t);
  XMOE_CHECK(t.device() == ref.device(),
             "[{}] {} is on {} but {} is on {}: all operands of an op must be on one device", op,
             name, t.device().str(), ref_name, ref.device().str());
}

/// A float operand on ref's device with ref's dtype.
inline void require_like(const char* op, const char* name, const Tensor& t, const char* ref_name,
                         const Tensor& ref) {
  require_same_device(op, name, t, ref_name, ref);
  require_float(op, name, t);
  XMOE_CHECK(t.dtype() == ref.dtype(), "[{}] {} has dtype {} but {} has dtype {}", op, name,
             dtype_name(t.dtype()), ref_name, dtype_name(ref.dtype()));
}

/// A float operand on ref's device whose dtype is ref's or, on CUDA, f32 (an f32 accumulator or
/// master weight beside bf16 activations).
inline void require_like_or_f32(const char* op, const char* name, const Tensor& t,
                                const char* ref_name, const Tensor& ref) {
  require_same_device(op, name, t, ref_name, ref);
  require_float(op, name, t);
  XMOE_CHECK(t.dtype() == ref.dtype() || t.dtype() == DType::f32,
             "[{}] {} has dtype {} but {} has dtype {} (expected {} or f32)", op, name,
             dtype_name(t.dtype()), ref_name, dtype_name(ref.dtype()), dtype_name(ref.dtype()));
}

/// An operand of exactly `dtype` (e.g. i32 indices, f32 statistics) on ref's device.
inline void require_on(const char* op, const char* name, const Tensor& t, DType dtype,
                       const char* ref_name, const Tensor& ref) {
  require_same_device(op, name, t, ref_name, ref);
  check_dtype(t, dtype, op, name);
}

inline void require_2d(const char* op, const char* name, const Tensor& t) {
  XMOE_CHECK(t.dim() == 2, "[{}] {} must be 2-d, got shape {}", op, name, shape_str(t.shape()));
}

/// Rows and columns of x seen as [numel / last, last].
inline std::pair<int64_t, int64_t> rows_cols(const Tensor& x) {
  const int64_t cols = x.dim() ? x.size(-1) : 1;
  return {cols ? x.numel() / cols : 0, cols};
}

/// Activates t's CUDA device and returns its current stream.
inline cuda::Stream stream_of(const Tensor& t) {
  return cuda::activate(t.device().index);
}

/// Throws "[op] name[i] = v out of range [0, limit)" for the first bad entry of an i32 tensor
/// (negative entries allowed with allow_negative). On CUDA the scan runs on the device and its
/// one result is copied back, which waits for the stream.
inline void check_index_values(const char* op, const char* name, const Tensor& ids, int64_t limit,
                               bool allow_negative) {
  if (ids.is_cpu()) {
    const int32_t* p = ids.data<int32_t>();
    for (int64_t i = 0; i < ids.numel(); ++i)
      XMOE_CHECK((p[i] >= 0 || allow_negative) && p[i] < limit,
                 "[{}] {}[{}] = {} out of range [0, {})", op, name, i, p[i], limit);
    return;
  }
  Tensor first = Tensor::empty({1}, DType::i64, ids.device());
  cuda::find_bad_index(first.data<int64_t>(), ids.data<int32_t>(), ids.numel(), limit,
                       allow_negative, stream_of(ids));
  const auto bad = static_cast<int64_t>(first.item());
  XMOE_CHECK(bad < 0, "[{}] {}[{}] = {} out of range [0, {})", op, name, bad,
             static_cast<int64_t>(ids.item(bad)), limit);
}

/// XMOE_CUDA_CHECK_INDICES=1: gather_rows and scatter_add_rows also check their CUDA indices on
/// the host (one wait per call). Off by default: out-of-range rows are then zero (gather) or
/// skipped (scatter) on the device instead of throwing.
inline bool cuda_check_indices() {
  static const bool on = env::flag("XMOE_CUDA_CHECK_INDICES");
  return on;
}

}  // namespace xmoe::ops::detail
