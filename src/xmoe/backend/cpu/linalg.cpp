#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "xmoe/backend/cpu/kernels.h"
#include "xmoe/core/dtype.h"

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

namespace {

/// Runs body(g, first_row) for every group. Fine-grained experts make each group's GEMM small
/// (tens to hundreds of rows), where OpenBLAS's own threading costs more than it gains: the
/// groups are then spread over OpenMP threads, each GEMM single-threaded, largest first.
template <class Body>
void for_each_group(const int64_t* group_sizes, int64_t groups, Body&& body) {
  std::vector<int64_t> first(static_cast<size_t>(groups) + 1, 0);
  for (int64_t g = 0; g < groups; ++g) first[g + 1] = first[g] + group_sizes[g];
  const int64_t avg_rows = groups ? first[groups] / groups : 0;
  const int threads = omp_get_max_threads();
  if (groups < 2 || threads < 2 || avg_rows > 1024) {
    for (int64_t g = 0; g < groups; ++g) body(g, first[g]);
    return;
  }
  std::vector<int64_t> order(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) order[g] = g;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return group_sizes[a] > group_sizes[b]; });
  // OpenBLAS's OpenMP build runs a GEMM called inside a parallel region on the calling thread.
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < groups; ++i) body(order[i], first[order[i]]);
}

}  // namespace

void grouped_gemm(float* y, const float* x, const float* w, const int64_t* group_sizes,
                  int64_t groups, int64_t k, int64_t m, bool trans_w) {
  for_each_group(group_sizes, groups, [&](int64_t g, int64_t row) {
    const int64_t n = group_sizes[g];
    if (n > 0) gemm(y + row * m, x + row * k, w + g * k * m, n, m, k, false, trans_w, 1.0f, 0.0f);
  });
}

void grouped_gemm_weight_grad(float* dw, const float* x, const float* dy,
                              const int64_t* group_sizes, int64_t groups, int64_t k, int64_t m,
                              bool accumulate) {
  for_each_group(group_sizes, groups, [&](int64_t g, int64_t row) {
    const int64_t n = group_sizes[g];
    float* dwg = dw + g * k * m;
    if (n > 0) {
      gemm(dwg, x + row * k, dy + row * m, k, m, n, true, false, 1.0f, accumulate ? 1.0f : 0.0f);
    } else if (!accumulate) {
      std::memset(dwg, 0, sizeof(float) * static_cast<size_t>(k * m));
    }
  });
}

void split_bf16_columns(uint16_t* out, const float* x, int64_t rows, int64_t cols, const int* terms,
                        int n) {
#pragma omp parallel for schedule(static) if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float v = x[r * cols + c];
      const bf16 t0(v);
      const bf16 t1(v - static_cast<float>(t0));
      const bf16 t2(v - static_cast<float>(t0) - static_cast<float>(t1));
      const uint16_t t[3] = {t0.bits, t1.bits, t2.bits};
      for (int j = 0; j < n; ++j) out[(r * n + j) * cols + c] = t[terms[j]];
    }
  }
}

void sum_column_blocks(float* out, const float* y, int64_t rows, int64_t cols, int64_t n,
                       bool accumulate) {
#pragma omp parallel for schedule(static) if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float s = y[r * cols * n + c];
      for (int64_t j = 1; j < n; ++j) s += y[(r * n + j) * cols + c];
      out[r * cols + c] = accumulate ? out[r * cols + c] + s : s;
    }
  }
}

}  // namespace xmoe::cpu
