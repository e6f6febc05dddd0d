// CPU kernels of the optimizer ops (backend/cpu/optim_kernels.h).
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "xmoe/backend/cpu/optim_kernels.h"

namespace xmoe::cpu {

namespace {

// Below this many elements a loop runs on the calling thread (a parallel region costs more).
constexpr int64_t kParallelMin = int64_t{1} << 15;

/// bf16(f)'s bits (core/dtype.h: round to nearest even, NaN kept quiet) on plain integers,
/// which the vectoriser takes where it does not take the struct.
inline uint16_t bf16_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>(
      (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// A moment as f32: f32 storage, or bf16 bits widened (exact).
inline float load_moment(const float* x, int64_t j) {
  return x[j];
}
inline float load_moment(const uint16_t* x, int64_t j) {
  return std::bit_cast<float>(static_cast<uint32_t>(x[j]) << 16);
}
// Stores an updated moment: f32 as is, bf16 rounded to nearest even.
inline void store_moment(float* x, int64_t j, float value) {
  x[j] = value;
}
inline void store_moment(uint16_t* x, int64_t j, float value) {
  x[j] = bf16_bits(value);
}

// M: float (f32 moments) or uint16_t (bf16 moments' bits). The update reads the moments as
// f32, computes in f32 and uses the unrounded m, v for this step's weights; bf16 moments are
// rounded only where they are stored.
template <bool kCopy, class G, class M>
void adamw_update_impl(float* w, const G* g, M* m, M* v, uint16_t* copy, int64_t n, float lr,
                       float b1, float b2, float eps, float bc1, float bc2, float decay,
                       float grad_scale) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t j = 0; j < n; ++j) {
    const float gj = static_cast<float>(g[j]) * grad_scale;
    const float mj = b1 * load_moment(m, j) + (1.f - b1) * gj;
    const float vj = b2 * load_moment(v, j) + (1.f - b2) * gj * gj;
    store_moment(m, j, mj);
    store_moment(v, j, vj);
    const float mhat = mj / bc1, vhat = vj / bc2;
    const float wj = w[j] * decay - lr * mhat / (std::sqrt(vhat) + eps);
    w[j] = wj;
    if constexpr (kCopy) copy[j] = bf16_bits(wj);
  }
}

template <class G, class M>
void adamw_update_any(float* w, const G* g, M* m, M* v, bf16* copy, int64_t n, float lr, float b1,
                      float b2, float eps, float bc1, float bc2, float decay, float grad_scale) {
  static_assert(sizeof(bf16) == sizeof(uint16_t));
  auto* bits = reinterpret_cast<uint16_t*>(copy);
  if (copy)
    adamw_update_impl<true>(w, g, m, v, bits, n, lr, b1, b2, eps, bc1, bc2, decay, grad_scale);
  else
    adamw_update_impl<false>(w, g, m, v, bits, n, lr, b1, b2, eps, bc1, bc2, decay, grad_scale);
}

template <class D, class S>
void copy_scaled_impl(D* dst, const S* src, int64_t n, float s) {
  if constexpr (std::is_same_v<D, bf16>) {  // through the bits: see bf16_bits
    auto* bits = reinterpret_cast<uint16_t*>(dst);
    if (s == 1.0f) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
      for (int64_t i = 0; i < n; ++i) bits[i] = bf16_bits(static_cast<float>(src[i]));
    } else {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
      for (int64_t i = 0; i < n; ++i) bits[i] = bf16_bits(static_cast<float>(src[i]) * s);
    }
  } else if (s == 1.0f) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) dst[i] = D(static_cast<float>(src[i]));
  } else {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) dst[i] = D(static_cast<float>(src[i]) * s);
  }
}

}  // namespace

void adamw_update(float* param, const void* grad, bool grad_bf16, void* m, void* v,
                  bool moments_bf16, bf16* param_bf16, int64_t n, float lr, float beta1,
                  float beta2, float eps, float bc1, float bc2, float decay, float grad_scale) {
  // bf16 arrays as their bits, which the vectoriser takes (see bf16_bits).
  auto with_moments = [&](const auto* g) {
    if (moments_bf16)
      adamw_update_any(param, g, static_cast<uint16_t*>(m), static_cast<uint16_t*>(v), param_bf16,
                       n, lr, beta1, beta2, eps, bc1, bc2, decay, grad_scale);
    else
      adamw_update_any(param, g, static_cast<float*>(m), static_cast<float*>(v), param_bf16, n, lr,
                       beta1, beta2, eps, bc1, bc2, decay, grad_scale);
  };
  if (grad_bf16)
    with_moments(static_cast<const bf16*>(grad));
  else
    with_moments(static_cast<const float*>(grad));
}

void copy_scaled(void* dst, bool dst_bf16, const void* src, bool src_bf16, int64_t n, float s) {
  if (!dst_bf16 && !src_bf16 && s == 1.0f) {
    std::memcpy(dst, src, sizeof(float) * static_cast<size_t>(n));
  } else if (dst_bf16 && src_bf16) {
    copy_scaled_impl(static_cast<bf16*>(dst), static_cast<const bf16*>(src), n, s);
  } else if (dst_bf16) {
    copy_scaled_impl(static_cast<bf16*>(dst), static_cast<const float*>(src), n, s);
  } else if (src_bf16) {
    copy_scaled_impl(static_cast<float*>(dst), static_cast<const bf16*>(src), n, s);
  } else {
    copy_scaled_impl(static_cast<float*>(dst), static_cast<const float*>(src), n, s);
  }
}

}  // namespace xmoe::cpu
