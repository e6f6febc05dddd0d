#include <cblas.h>

#include <cstring>
#include <vector>

#include "xmoe/backend/cpu/kernels.h"

namespace xmoe::cpu {

void gemm(float* c, const float* a, const float* b, int64_t m, int64_t n, int64_t k, bool trans_a,
          bool trans_b, float alpha, float beta) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m * n; ++i) c[i] = beta == 0.f ? 0.f : beta * c[i];
    return;
  }
  const int lda = static_cast<int>(trans_a ? m : k);
  const int ldb = static_cast<int>(trans_b ? k : n);
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, lda, b, ldb, beta, c, static_cast<int>(n));
}

void grouped_gemm(float* y, const float* x, const float* w, const int64_t* group_sizes,
                  int64_t groups, int64_t k, int64_t m, bool trans_w) {
  // One sgemm per non-empty group; OpenBLAS threads each of them. Fine-grained experts make
  // groups small, so the groups themselves are not split further here.
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = group_sizes[g];
    if (n > 0)
      gemm(y + row * m, x + row * k, w + g * k * m, n, m, k, false, trans_w, 1.0f, 0.0f);
    row += n;
  }
}

void grouped_gemm_weight_grad(float* dw, const float* x, const float* dy,
                              const int64_t* group_sizes, int64_t groups, int64_t k, int64_t m,
                              bool accumulate) {
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = group_sizes[g];
    float* dwg = dw + g * k * m;
    if (n > 0) {
      gemm(dwg, x + row * k, dy + row * m, k, m, n, true, false, 1.0f, accumulate ? 1.0f : 0.0f);
    } else if (!accumulate) {
      std::memset(dwg, 0, sizeof(float) * static_cast<size_t>(k * m));
    }
    row += n;
  }
}

}  // namespace xmoe::cpu
