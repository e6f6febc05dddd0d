// Top-k of each row, one warp per row. Round t picks the best element that comes after the
// (t-1)-th pick in the order (value descending, index ascending): no per-row storage, any E, and
// ties go to the lower index exactly as the CPU's comparator. Cost O(k * E / 32) per lane, small
// for routing (k <= 16, E <= 512); the row stays in L1.
#include <climits>

#include "xmoe/backend/cuda/common.cuh"

namespace xmoe::cuda {

namespace {

constexpr int kWarpsPerBlock = kBlock / 32;

// (va, ia) before (vb, ib)? An index of INT_MAX means "none" and is after everything.
__device__ __forceinline__ bool before(float va, int ia, float vb, int ib) {
  if (ib == INT_MAX) return ia != INT_MAX;
  if (ia == INT_MAX) return false;
  return va > vb || (va == vb && ia < ib);
}

template <class T>
__global__ void topk_kernel(T* values, int32_t* indices, const T* x, int64_t rows, int64_t cols,
                            int64_t k) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); r < rows;
       r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const T* xr = x + r * cols;
    float pv = INFINITY;
    int pi = -1;  // previous pick; every element comes after (+inf, -1)
    for (int64_t t = 0; t < k; ++t) {
      float bv = -INFINITY;
      int bi = INT_MAX;
      for (int j = lane; j < cols; j += 32) {
        const float v = to_float(xr[j]);
        const bool after_prev = v < pv || (v == pv && j > pi);
        if (after_prev && before(v, j, bv, bi)) {
          bv = v;
          bi = j;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(kFullMask, bv, o);
        const int oi = __shfl_xor_sync(kFullMask, bi, o);
        if (before(ov, oi, bv, bi)) {
          bv = ov;
          bi = oi;
        }
      }
      if (lane == 0) {  // bi stays "none" only if NaNs left fewer than k comparable values
        values[r * k + t] = bi != INT_MAX ? xr[bi] : from_float<T>(NAN);
        indices[r * k + t] = bi != INT_MAX ? bi : -1;
      }
      pv = bv;
      pi = bi;
    }
  }
}

}  // namespace

void topk(void* values, int32_t* indices, const void* x, DType dt, int64_t rows, int64_t cols,
          int64_t k, Stream stream) {
  if (rows == 0 || k == 0) return;
  if (cols >= INT_MAX) fail("[topk] more than 2^31 columns");
  dispatch_float(dt, "topk", [&](auto tag) {
    using T = typename decltype(tag)::type;
    topk_kernel<T><<<grid_for(rows, kWarpsPerBlock), kBlock, 0, stream>>>(
        static_cast<T*>(values), indices, static_cast<const T*>(x), rows, cols, k);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace xmoe::cuda
