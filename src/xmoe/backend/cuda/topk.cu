// Top-k of each row, one warp per row. Round t picks the best element that comes after the
// (t-1)-th pick in the order (value descending, index ascending): no per-row storage, any E, and
// ties go to the lower index exactly as the CPU's comparator. Rows of up to 512 columns sit in
// registers (16 a lane), so each round is a pass over registers and a butterfly; longer rows are
// read again from global memory (L1) each round, O(k * E / 32) loads per lane.
// softmax_topk makes the softmax of the row in the same registers first (softmax.cu's formula and
// order: the same bits) and writes it, then picks from it.
#include <climits>
#include <type_traits>

#include "xmoe/backend/cuda/common.cuh"
#include "xmoe/backend/cuda/kernels.h"

namespace xmoe::cuda {

namespace {

constexpr int kWarpsPerBlock = kBlock / 32;

// (va, ia) before (vb, ib)? An index of INT_MAX means "none" and is after everything.
__device__ __forceinline__ bool before(float va, int ia, float vb, int ib) {
  if (ib == INT_MAX) return ia != INT_MAX;
  if (ia == INT_MAX) return false;
  return va > vb || (va == vb && ia < ib);
}

// The best (bv, bi) of the warp, in every lane: a butterfly.
__device__ __forceinline__ void warp_best(float& bv, int& bi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, bv, o);
    const int oi = __shfl_xor_sync(kFullMask, bi, o);
    if (before(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
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
      warp_best(bv, bi);
      if (lane == 0) {  // bi stays "none" only if NaNs left fewer than k comparable values
        values[r * k + t] = bi != INT_MAX ? xr[bi] : from_float<T>(NAN);
        indices[r * k + t] = bi != INT_MAX ? bi : -1;
      }
      pv = bv;
      pi = bi;
    }
  }
}

// Picks round by round from the lane's values v[i] (column lane + 32 i, those < cols) and writes
// the picks' values (of T) and indices.
template <int N, class T>
__device__ __forceinline__ void warp_topk_registers(const float (&v)[N], int64_t cols, int64_t k,
                                                    int lane, T* values, int32_t* indices) {
  float pv = INFINITY;
  int pi = -1;
  for (int64_t t = 0; t < k; ++t) {
    float bv = -INFINITY;
    int bi = INT_MAX;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int j = lane + 32 * i;
      const bool after_prev = v[i] < pv || (v[i] == pv && j > pi);
      if (j < cols && after_prev && before(v[i], j, bv, bi)) {
        bv = v[i];
        bi = j;
      }
    }
    warp_best(bv, bi);
    if (lane == 0) {
      values[t] = bi != INT_MAX ? from_float<T>(bv) : from_float<T>(NAN);
      indices[t] = bi != INT_MAX ? bi : -1;
    }
    pv = bv;
    pi = bi;
  }
}

// N = ceil(cols / 32) <= 16: the row in registers (softmax: y = softmax(x) written first, and
// the picks made from y as stored).
template <int N, bool Softmax, class T>
__global__ void topk_registers_kernel(T* values, int32_t* indices, T* y, const T* x, int64_t rows,
                                      int64_t cols, int64_t k) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); r < rows;
       r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const T* xr = x + r * cols;
    float v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int j = lane + 32 * i;
      v[i] = j < cols ? to_float(xr[j]) : -INFINITY;
    }
    if constexpr (Softmax) {
      // softmax_forward_kernel's steps in its order: lane-strided max and sum, the butterflies.
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < N; ++i)
        if (lane + 32 * i < cols) m = fmaxf(m, v[i]);
      m = warp_max(m);
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < N; ++i)
        if (lane + 32 * i < cols) s += expf(v[i] - m);
      const float inv = 1.0f / warp_sum(s);
      T* yr = y + r * cols;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int j = lane + 32 * i;
        if (j < cols) {
          const T stored = from_float<T>(expf(v[i] - m) * inv);
          yr[j] = stored;
          v[i] = to_float(stored);
        }
      }
    }
    warp_topk_registers<N>(v, cols, k, lane, values + r * k, indices + r * k);
  }
}

constexpr int64_t kRegisterCols = 32 * 16;

// f(std::integral_constant<int, N>) for the smallest N in {1, 2, 4, 8, 16} with 32 N >= cols.
template <class F>
void by_lane_values(int64_t cols, F&& f) {
  if (cols <= 32)
    f(std::integral_constant<int, 1>{});
  else if (cols <= 64)
    f(std::integral_constant<int, 2>{});
  else if (cols <= 128)
    f(std::integral_constant<int, 4>{});
  else if (cols <= 256)
    f(std::integral_constant<int, 8>{});
  else
    f(std::integral_constant<int, 16>{});
}

}  // namespace

void topk(void* values, int32_t* indices, const void* x, DType dt, int64_t rows, int64_t cols,
          int64_t k, Stream stream) {
  if (rows == 0 || k == 0) return;
  if (cols >= INT_MAX) fail("[topk] more than 2^31 columns");
  dispatch_float(dt, "topk", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (cols <= kRegisterCols) {
      by_lane_values(cols, [&](auto n) {
        topk_registers_kernel<decltype(n)::value, false, T>
            <<<grid_for(rows, kWarpsPerBlock), kBlock, 0, stream>>>(
                static_cast<T*>(values), indices, nullptr, static_cast<const T*>(x), rows, cols, k);
      });
    } else {
      topk_kernel<T><<<grid_for(rows, kWarpsPerBlock), kBlock, 0, stream>>>(
          static_cast<T*>(values), indices, static_cast<const T*>(x), rows, cols, k);
    }
    CUDA_CHECK_LAUNCH();
  });
}

void softmax_topk(void* probs, void* values, int32_t* indices, const void* x, DType dt,
                  int64_t rows, int64_t cols, int64_t k, Stream stream) {
  if (rows == 0 || cols == 0) return;
  if (cols > kRegisterCols) {  // the two passes
    softmax_forward(probs, x, dt, rows, cols, stream);
    topk(values, indices, probs, dt, rows, cols, k, stream);
    return;
  }
  dispatch_float(dt, "softmax_topk", [&](auto tag) {
    using T = typename decltype(tag)::type;
    by_lane_values(cols, [&](auto n) {
      topk_registers_kernel<decltype(n)::value, true, T>
          <<<grid_for(rows, kWarpsPerBlock), kBlock, 0, stream>>>(
              static_cast<T*>(values), indices, static_cast<T*>(probs), static_cast<const T*>(x),
              rows, cols, k);
    });
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace xmoe::cuda
