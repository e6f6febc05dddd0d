// CPU kernels of the optimizer ops (backend/cpu/optim_kernels.h).
#include <omp.h>

#include <cmath>
#include <cstring>

#include "xmoe/backend/cpu/optim_kernels.h"

namespace xmoe::cpu {

namespace {

template <class G>
void adamw_update_impl(float* w, const G* g, float* m, float* v, int64_t n, float lr, float b1,
                       float b2, float eps, float bc1, float bc2, float decay, float grad_scale) {
#pragma omp parallel for simd schedule(static) if (n > (1 << 15))
  for (int64_t j = 0; j < n; ++j) {
    const float gj = static_cast<float>(g[j]) * grad_scale;
    m[j] = b1 * m[j] + (1.f - b1) * gj;
    v[j] = b2 * v[j] + (1.f - b2) * gj * gj;
    const float mhat = m[j] / bc1, vhat = v[j] / bc2;
    w[j] = w[j] * decay - lr * mhat / (std::sqrt(vhat) + eps);
  }
}

template <class D, class S>
void copy_scaled_impl(D* dst, const S* src, int64_t n, float s) {
  if (s == 1.0f) {
    for (int64_t i = 0; i < n; ++i) dst[i] = D(static_cast<float>(src[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = D(static_cast<float>(src[i]) * s);
  }
}

}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float bc1, float bc2, float decay,
                  float grad_scale) {
  adamw_update_impl(param, grad, m, v, n, lr, beta1, beta2, eps, bc1, bc2, decay, grad_scale);
}

void adamw_update(float* param, const bf16* grad, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float bc1, float bc2, float decay,
                  float grad_scale) {
  adamw_update_impl(param, grad, m, v, n, lr, beta1, beta2, eps, bc1, bc2, decay, grad_scale);
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
