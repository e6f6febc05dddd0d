#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "xmoe/backend/cpu/kernels.h"

namespace xmoe::cpu {

void topk(float* values, int32_t* indices, const float* x, int64_t rows, int64_t cols, int64_t k) {
#pragma omp parallel
  {
    std::vector<int32_t> order(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * cols;
      for (int64_t j = 0; j < cols; ++j) order[static_cast<size_t>(j)] = static_cast<int32_t>(j);
      // Larger value first; ties go to the lower index, so routing is reproducible.
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [xr](int32_t a, int32_t b) {
        return xr[a] > xr[b] || (xr[a] == xr[b] && a < b);
      });
      for (int64_t j = 0; j < k; ++j) {
        indices[r * k + j] = order[static_cast<size_t>(j)];
        values[r * k + j] = xr[order[static_cast<size_t>(j)]];
      }
    }
  }
}

void gather_rows(float* out, const float* x, const int32_t* index, int64_t m, int64_t d) {
#pragma omp parallel for schedule(static) if (m * d > (1 << 15))
  for (int64_t i = 0; i < m; ++i)
    std::memcpy(out + i * d, x + static_cast<int64_t>(index[i]) * d, sizeof(float) * d);
}

void scatter_add_rows(float* out, const float* src, const int32_t* index, const float* weight,
                      int64_t m, int64_t n_out, int64_t d) {
  // Threads split the columns, not the rows: two source rows may target the same output row,
  // and a column split keeps the summation order (i ascending) fixed and race-free.
  const int threads = (m * d > (1 << 15) && d >= 32) ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t chunk = (d + nt - 1) / nt;
    const int64_t c0 = std::min<int64_t>(d, t * chunk), c1 = std::min<int64_t>(d, c0 + chunk);
    for (int64_t i = 0; i < m; ++i) {
      float* o = out + static_cast<int64_t>(index[i]) * d;
      const float* s = src + i * d;
      const float w = weight ? weight[i] : 1.0f;
#pragma omp simd
      for (int64_t j = c0; j < c1; ++j) o[j] += w * s[j];
    }
  }
  (void)n_out;
}

void row_dot(float* out, const float* a, const float* b, int64_t rows, int64_t d) {
#pragma omp parallel for schedule(static) if (rows * d > (1 << 15))
  for (int64_t r = 0; r < rows; ++r) {
    float s = 0.f;
    for (int64_t j = 0; j < d; ++j) s += a[r * d + j] * b[r * d + j];
    out[r] = s;
  }
}

}  // namespace xmoe::cpu
