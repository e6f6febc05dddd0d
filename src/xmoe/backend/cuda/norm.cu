// RMSNorm: y = x * rstd * w, rstd = (mean(x^2) + eps)^-1/2, one block per row.
// Backward: dx per row; the weight gradient is summed deterministically: block b owns rows
// b, b + P, b + 2P, ... (P depends only on the row count) and writes its partial sums to its own
// row of a (P, d) workspace, then one pass adds the P partials of each column in order.
#include "xmoe/backend/cuda/common.cuh"

namespace xmoe::cuda {

namespace {

constexpr int kNormBlock = 256;
constexpr int64_t kMaxPartials = 256;

int64_t num_partials(int64_t rows) { return rows < kMaxPartials ? (rows < 1 ? 1 : rows) : kMaxPartials; }

template <class T, class W>
__global__ void __launch_bounds__(kNormBlock)
    rmsnorm_forward_kernel(T* y, float* rstd, const T* x, const W* w, int64_t rows, int64_t d,
                           float eps) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    float ss = 0.f;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      const float v = to_float(xr[j]);
      ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float rs = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
      y[r * d + j] = from_float<T>(to_float(xr[j]) * rs * to_float(w[j]));
  }
}

// dx = rstd * (w * dy) - x * rstd^3 / d * sum(w * dy * x);  partial[b] += dy * x * rstd
template <class T, class W>
__global__ void __launch_bounds__(kNormBlock)
    rmsnorm_backward_kernel(T* dx, float* partial, const T* x, const W* w, const float* rstd,
                            const T* dy, int64_t rows, int64_t d) {
  __shared__ float scratch[32];
  float* pb = partial + blockIdx.x * d;
  // Each thread owns columns threadIdx.x + k * blockDim.x of this block's partial row.
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) pb[j] = 0.f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t o = r * d;
    const float rs = rstd[r];
    float dot = 0.f;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
      dot += to_float(w[j]) * to_float(dy[o + j]) * to_float(x[o + j]);
    dot = block_sum(dot, scratch);
    const float c = rs * rs * rs * dot / static_cast<float>(d);
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      const float xv = to_float(x[o + j]), g = to_float(dy[o + j]);
      dx[o + j] = from_float<T>(rs * to_float(w[j]) * g - xv * c);
      pb[j] += g * xv * rs;
    }
  }
}

template <class W>
__global__ void rmsnorm_dweight_kernel(W* dw, const float* partial, int64_t parts, int64_t d) {
  XMOE_GRID_STRIDE(j, d) {
    float s = 0.f;
    for (int64_t b = 0; b < parts; ++b) s += partial[b * d + j];
    dw[j] = from_float<W>(to_float(dw[j]) + s);
  }
}

}  // namespace

void rmsnorm_forward(void* y, float* rstd, const void* x, DType x_dt, const void* w, DType w_dt,
                     int64_t rows, int64_t d, float eps, Stream stream) {
  if (rows == 0) return;
  dispatch_float(x_dt, "rmsnorm", [&](auto xtag) {
    using T = typename decltype(xtag)::type;
    dispatch_float(w_dt, "rmsnorm", [&](auto wtag) {
      using W = typename decltype(wtag)::type;
      rmsnorm_forward_kernel<T, W><<<grid_for(rows, 1), kNormBlock, 0, stream>>>(
          static_cast<T*>(y), rstd, static_cast<const T*>(x), static_cast<const W*>(w), rows, d,
          eps);
      CUDA_CHECK_LAUNCH();
    });
  });
}

size_t rmsnorm_backward_workspace_bytes(int64_t rows, int64_t d) {
  return static_cast<size_t>(num_partials(rows) * d) * sizeof(float);
}

void rmsnorm_backward(void* dx, void* dw, const void* x, DType x_dt, const void* w, DType w_dt,
                      const float* rstd, const void* dy, int64_t rows, int64_t d,
                      void* workspace, Stream stream) {
  if (rows == 0 || d == 0) return;
  const int64_t parts = num_partials(rows);
  auto* partial = static_cast<float*>(workspace);
  dispatch_float(x_dt, "rmsnorm_backward", [&](auto xtag) {
    using T = typename decltype(xtag)::type;
    dispatch_float(w_dt, "rmsnorm_backward", [&](auto wtag) {
      using W = typename decltype(wtag)::type;
      rmsnorm_backward_kernel<T, W><<<static_cast<unsigned>(parts), kNormBlock, 0, stream>>>(
          static_cast<T*>(dx), partial, static_cast<const T*>(x), static_cast<const W*>(w), rstd,
          static_cast<const T*>(dy), rows, d);
      CUDA_CHECK_LAUNCH();
      rmsnorm_dweight_kernel<W><<<grid_for(d), kBlock, 0, stream>>>(static_cast<W*>(dw), partial,
                                                                   parts, d);
      CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace xmoe::cuda
