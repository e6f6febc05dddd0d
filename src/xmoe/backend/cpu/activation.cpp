#include <cmath>

#include "xmoe/backend/cpu/kernels.h"

namespace xmoe::cpu {

namespace {
constexpr int64_t kParallelMin = 1 << 14;  // below this, threads cost more than they save
}

void softmax_forward(float* y, const float* x, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols > kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float* yr = y + r * cols;
    float mx = -INFINITY;
    for (int64_t j = 0; j < cols; ++j) mx = std::max(mx, xr[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < cols; ++j) {
      yr[j] = std::exp(xr[j] - mx);
      sum += yr[j];
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < cols; ++j) yr[j] *= inv;
  }
}

void softmax_backward(float* dx, const float* y, const float* dy, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols > kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* yr = y + r * cols;
    const float* dyr = dy + r * cols;
    float dot = 0.f;
    for (int64_t j = 0; j < cols; ++j) dot += yr[j] * dyr[j];
    for (int64_t j = 0; j < cols; ++j) dx[r * cols + j] = yr[j] * (dyr[j] - dot);
  }
}

void sigmoid_forward(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) y[i] = 1.0f / (1.0f + std::exp(-x[i]));
}

void sigmoid_backward(float* dx, const float* y, const float* dy, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > kParallelMin)
  for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * y[i] * (1.0f - y[i]);
}

void swiglu_forward(float* a, const float* h, int64_t rows, int64_t f) {
#pragma omp parallel for schedule(static) if (rows * f > kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = h + r * 2 * f;
    const float* u = g + f;
    float* ar = a + r * f;
#pragma omp simd
    for (int64_t j = 0; j < f; ++j) ar[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
}

void swiglu_backward(float* dh, const float* h, const float* da, int64_t rows, int64_t f,
                     float* value) {
  // a = silu(g) * u; silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid(g)
#pragma omp parallel for schedule(static) if (rows * f > kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = h + r * 2 * f;
    const float* u = g + f;
    const float* dar = da + r * f;
    float* dg = dh + r * 2 * f;
    float* du = dg + f;
    float* ar = value ? value + r * f : nullptr;
#pragma omp simd
    for (int64_t j = 0; j < f; ++j) {  // all read before any write: dh may be h, value da
      const float gj = g[j], uj = u[j], dj = dar[j], s = 1.0f / (1.0f + std::exp(-gj));
      dg[j] = dj * uj * s * (1.0f + gj * (1.0f - s));
      du[j] = dj * gj * s;
      if (ar) ar[j] = gj / (1.0f + std::exp(-gj)) * uj;  // swiglu_forward's expression
    }
  }
}

}  // namespace xmoe::cpu
