// FP8 block quantisation on the CPU: the reference for the CUDA kernels (the same bytes and
// scales) and the CPU's emulation of model.moe.expert_dtype = fp8 (docs/fp8.md).
#include "xmoe/core/fp8.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "xmoe/backend/cpu/kernels.h"

namespace xmoe::cpu {

namespace {

int64_t blocks(int64_t n) {
  return (n + fp8::kBlock - 1) / fp8::kBlock;
}

/// Row r's scale of column block j within its group (first row o, n rows): group-major, then
/// block-major, then row (the sm90 FP8 GEMM reads each group's scales as an M-major [K/128, n]).
int64_t row_scale_index(int64_t o, int64_t n, int64_t kb, int64_t r, int64_t j) {
  return o * kb + j * n + (r - o);
}

/// Rows row(r) of k columns quantised in their groups.
template <class RowOf>
void quantize_rows(uint8_t* q, float* scales, RowOf row, const int64_t* group_sizes, int64_t groups,
                   int64_t k) {
  const int64_t kb = blocks(k);
  int64_t o = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = group_sizes[g];
#pragma omp parallel for schedule(static)
    for (int64_t r = o; r < o + n; ++r) {
      const float* xr = row(r);
      uint8_t* qr = q + r * k;
      for (int64_t j = 0; j < kb; ++j) {
        const int64_t c0 = j * fp8::kBlock, c1 = std::min(k, c0 + fp8::kBlock);
        float amax = 0.f;
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(xr[c]));
        const fp8::BlockScale s = fp8::block_scale(amax);
        for (int64_t c = c0; c < c1; ++c) qr[c] = fp8::e4m3_from_float(xr[c] * s.inverse);
        scales[row_scale_index(o, n, kb, r, j)] = s.scale;
      }
    }
    o += n;
  }
}
}  // namespace

void quantize_rows_fp8(uint8_t* q, float* scales, const float* x, const int64_t* group_sizes,
                       int64_t groups, int64_t k) {
  quantize_rows(
      q, scales, [=](int64_t r) { return x + r * k; }, group_sizes, groups, k);
}

void gather_quantize_rows_fp8(uint8_t* q, float* scales, const float* x, const int32_t* index,
                              const int64_t* group_sizes, int64_t groups, int64_t k) {
  quantize_rows(
      q, scales, [=](int64_t r) { return x + int64_t{index[r]} * k; }, group_sizes, groups, k);
}

void dequantize_rows_fp8(float* x, const uint8_t* q, const float* scales,
                         const int64_t* group_sizes, int64_t groups, int64_t k) {
  const int64_t kb = blocks(k);
  int64_t o = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = group_sizes[g];
#pragma omp parallel for schedule(static)
    for (int64_t r = o; r < o + n; ++r)
      for (int64_t c = 0; c < k; ++c)
        x[r * k + c] = fp8::e4m3_to_float(q[r * k + c]) *
                       scales[row_scale_index(o, n, kb, r, c / fp8::kBlock)];
    o += n;
  }
}

void quantize_weights_fp8(uint8_t* q, uint8_t* q_t, float* scales, float* scales_t, const float* w,
                          int64_t groups, int64_t k, int64_t m) {
  const int64_t kb = blocks(k), mb = blocks(m);
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t bi = 0; bi < kb; ++bi)
      for (int64_t bj = 0; bj < mb; ++bj) {
        const float* wg = w + g * k * m;
        const int64_t r0 = bi * fp8::kBlock, r1 = std::min(k, r0 + fp8::kBlock);
        const int64_t c0 = bj * fp8::kBlock, c1 = std::min(m, c0 + fp8::kBlock);
        float amax = 0.f;
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(wg[r * m + c]));
        const fp8::BlockScale s = fp8::block_scale(amax);
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) {
            const uint8_t b = fp8::e4m3_from_float(wg[r * m + c] * s.inverse);
            q[g * k * m + r * m + c] = b;
            q_t[g * k * m + c * k + r] = b;
          }
        scales[(g * kb + bi) * mb + bj] = s.scale;
        scales_t[(g * mb + bj) * kb + bi] = s.scale;
      }
}

void dequantize_weights_fp8(float* w, const uint8_t* q, const float* scales, int64_t groups,
                            int64_t k, int64_t m) {
  const int64_t kb = blocks(k), mb = blocks(m);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < k; ++r)
      for (int64_t c = 0; c < m; ++c)
        w[(g * k + r) * m + c] = fp8::e4m3_to_float(q[(g * k + r) * m + c]) *
                                 scales[(g * kb + r / fp8::kBlock) * mb + c / fp8::kBlock];
}

}  // namespace xmoe::cpu
