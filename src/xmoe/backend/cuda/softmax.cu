// Softmax over the last dimension. One warp per row (rows are short: router scores over E <= 512
// experts); lanes stride over the columns and reduce with a fixed butterfly.
#include "xmoe/backend/cuda/common.cuh"

namespace xmoe::cuda {

namespace {

constexpr int kWarpsPerBlock = kBlock / 32;

#define XMOE_FOR_EACH_ROW_WARP(r, rows)                                                    \
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); \
       r < (rows); r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock)

template <class T>
__global__ void softmax_forward_kernel(T* y, const T* x, int64_t rows, int64_t cols) {
  const int lane = threadIdx.x & 31;
  XMOE_FOR_EACH_ROW_WARP(r, rows) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    float m = -INFINITY;
    for (int64_t j = lane; j < cols; j += 32) m = fmaxf(m, to_float(xr[j]));
    m = warp_max(m);
    float s = 0.f;
    for (int64_t j = lane; j < cols; j += 32) s += expf(to_float(xr[j]) - m);
    const float inv = 1.0f / warp_sum(s);
    for (int64_t j = lane; j < cols; j += 32)
      yr[j] = from_float<T>(expf(to_float(xr[j]) - m) * inv);
  }
}

template <class T>
__global__ void softmax_backward_kernel(T* dx, const T* y, const T* dy, int64_t rows,
                                        int64_t cols) {
  const int lane = threadIdx.x & 31;
  XMOE_FOR_EACH_ROW_WARP(r, rows) {
    const int64_t o = r * cols;
    float dot = 0.f;
    for (int64_t j = lane; j < cols; j += 32) dot += to_float(y[o + j]) * to_float(dy[o + j]);
    dot = warp_sum(dot);
    for (int64_t j = lane; j < cols; j += 32)
      dx[o + j] = from_float<T>(to_float(y[o + j]) * (to_float(dy[o + j]) - dot));
  }
}

}  // namespace

void softmax_forward(void* y, const void* x, DType dt, int64_t rows, int64_t cols, Stream stream) {
  if (rows == 0 || cols == 0) return;
  dispatch_float(dt, "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_forward_kernel<T><<<grid_for(rows, kWarpsPerBlock), kBlock, 0, stream>>>(
        static_cast<T*>(y), static_cast<const T*>(x), rows, cols);
    CUDA_CHECK_LAUNCH();
  });
}

void softmax_backward(void* dx, const void* y, const void* dy, DType dt, int64_t rows, int64_t cols,
                      Stream stream) {
  if (rows == 0 || cols == 0) return;
  dispatch_float(dt, "softmax_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_backward_kernel<T><<<grid_for(rows, kWarpsPerBlock), kBlock, 0, stream>>>(
        static_cast<T*>(dx), static_cast<const T*>(y), static_cast<const T*>(dy), rows, cols);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace xmoe::cuda
