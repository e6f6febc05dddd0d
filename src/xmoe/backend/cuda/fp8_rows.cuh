#pragma once
// The device side of FP8 row quantisation shared by the kernels that write FP8 rows (fp8.cu's
// quantisers, moe_ops.cu's I-Order backward): the e4m3 conversion, the block scale, the groups'
// scale layout (cpu::quantize_rows_fp8's) and a half-warp's 128-column block.
#include <cuda_fp8.h>

#include <cstdio>

#include "xmoe/backend/cuda/common.cuh"
#include "xmoe/backend/cuda/kernels.h"
#include "xmoe/core/fp8.h"

namespace xmoe::cuda {

constexpr int kFp8Block = static_cast<int>(fp8::kBlock);

__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ float from_e4m3(uint8_t b) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  return __half2float(__half(h));
}
/// As fp8::block_scale.
__device__ __forceinline__ void block_scale(float amax, float& scale, float& inverse) {
  if (!(amax > 0.f) || isinf(amax)) {
    scale = inverse = 1.f;
  } else {
    scale = amax / fp8::kE4m3Max;
    inverse = fp8::kE4m3Max / amax;
  }
}

/// The first row of every group (and the total last), passed by value.
struct RowGroups {
  int count = 0;
  int32_t start[kMaxFp8Groups + 1];
};

inline RowGroups row_groups(const int64_t* group_sizes, int64_t groups, const char* op) {
  if (groups > kMaxFp8Groups) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "[%s] %lld groups: the FP8 kernels take at most %d", op,
                  static_cast<long long>(groups), kMaxFp8Groups);
    fail(buf);
  }
  RowGroups r;
  r.count = static_cast<int>(groups);
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    r.start[g] = static_cast<int32_t>(row);
    row += group_sizes[g];
  }
  r.start[groups] = static_cast<int32_t>(row);
  return r;
}

/// The group of row r: its first row o and its rows n (the last group whose start <= r).
__device__ __forceinline__ void row_group(const RowGroups& groups, int64_t r, int64_t& o,
                                          int64_t& n) {
  int lo = 0, hi = groups.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (groups.start[mid] <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  o = groups.start[lo];
  n = groups.start[lo + 1] - o;
}

/// The groups of the rows [r_first, r_last] that a warp's blocks fall in: looked up once where
/// one group holds them all (the common case), else row by row.
struct WarpRowGroups {
  const RowGroups& groups;
  int64_t o = 0, n = 0;
  bool one = false;
  __device__ WarpRowGroups(const RowGroups& g, int64_t r_first, int64_t r_last) : groups(g) {
    row_group(g, r_first, o, n);
    one = r_last < o + n;
  }
  /// Index of row r's scale of column block j of kb (cpu::quantize_rows_fp8's layout).
  __device__ int64_t scale_index(int64_t r, int64_t kb, int64_t j) const {
    int64_t ro = o, rn = n;
    if (!one) row_group(groups, r, ro, rn);
    return ro * kb + j * rn + (r - ro);
  }
};

/// The largest |v| over a half-warp's 16 lanes (8 values each): one 128-column block.
__device__ __forceinline__ float half_warp_amax(const float (&v)[8]) {
  float amax = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, off));
  return amax;
}

/// A half-warp's 8 bytes of a quantised block (each lane 8 consecutive columns).
__device__ __forceinline__ void store_e4m3(uint8_t* q, const float (&v)[8], float inverse) {
  uint2 packed{0, 0};
#pragma unroll
  for (int e = 0; e < 8; ++e)
    (e < 4 ? packed.x : packed.y) |= uint32_t{to_e4m3(v[e] * inverse)} << (8 * (e % 4));
  *reinterpret_cast<uint2*>(q) = packed;
}

}  // namespace xmoe::cuda
