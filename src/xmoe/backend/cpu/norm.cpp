#include <omp.h>

#include <cmath>
#include <vector>

#include "xmoe/backend/cpu/kernels.h"

namespace xmoe::cpu {

void add_rmsnorm_forward(float* y, float* sum, float* rstd, const float* x, const float* a,
                         const float* w, int64_t rows, int64_t d, float eps) {
#pragma omp parallel for schedule(static) if (rows * d > (1 << 14))
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    if (a) {
      float* sr = sum + r * d;
      for (int64_t j = 0; j < d; ++j) sr[j] = xr[j] + a[r * d + j];
      xr = sr;
    }
    float ss = 0.f;
    for (int64_t j = 0; j < d; ++j) ss += xr[j] * xr[j];
    const float rs = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
    rstd[r] = rs;
    float* yr = y + r * d;
    for (int64_t j = 0; j < d; ++j) yr[j] = xr[j] * rs * w[j];
  }
}

void rmsnorm_backward(float* dx, float* dw, const float* x, const float* w, const float* rstd,
                      const float* dy, int64_t rows, int64_t d, const float* residual) {
  // y = x * r * w, r = (mean(x^2) + eps)^-1/2
  // dx = r * (w*dy) - x * r^3 / d * sum(w*dy*x);  dw += sum_rows dy * x * r
  const int threads = rows * d > (1 << 14) ? omp_get_max_threads() : 1;
  std::vector<float> partial(static_cast<size_t>(threads * d), 0.f);
#pragma omp parallel num_threads(threads)
  {
    float* dwt = partial.data() + static_cast<int64_t>(omp_get_thread_num()) * d;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * d;
      const float* dyr = dy + r * d;
      const float rs = rstd[r];
      float dot = 0.f;
      for (int64_t j = 0; j < d; ++j) dot += w[j] * dyr[j] * xr[j];
      const float c = rs * rs * rs * dot / static_cast<float>(d);
      float* dxr = dx + r * d;
      for (int64_t j = 0; j < d; ++j) {
        dxr[j] = rs * w[j] * dyr[j] - xr[j] * c;
        if (residual) dxr[j] += residual[r * d + j];
        dwt[j] += dyr[j] * xr[j] * rs;
      }
    }
  }
  // Reduce per-thread partials in a fixed order so results do not depend on scheduling.
  for (int t = 0; t < threads; ++t)
    for (int64_t j = 0; j < d; ++j) dw[j] += partial[static_cast<size_t>(t * d + j)];
}

}  // namespace xmoe::cpu
