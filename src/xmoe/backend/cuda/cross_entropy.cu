// Cross-entropy over logits (n, v): one block per row computes the row's log-sum-exp; the loss
// mean is summed by one block in a fixed order (double), so the loss does not depend on the
// launch configuration. Rows of whole 16-byte vectors (v % 8 == 0, aligned: every vocabulary the
// presets use) take one pass with 8 values per load, each thread keeping a running max and its
// sum of exponentials (online softmax); the backward writes 8 values per store. Other rows: two
// passes (max, then the sum) element by element.
#include "xmoe/backend/cuda/common.cuh"

namespace xmoe::cuda {

namespace {

constexpr int kCeBlock = 512;

template <class T>
__global__ void __launch_bounds__(kCeBlock)
    cross_entropy_forward_kernel(float* loss, float* lse, const T* logits, const int32_t* targets,
                                 int64_t n, int64_t v) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const T* x = logits + r * v;
    float m = -INFINITY;
    for (int64_t c = threadIdx.x; c < v; c += blockDim.x) m = fmaxf(m, to_float(x[c]));
    m = block_max(m, scratch);
    float s = 0.f;
    for (int64_t c = threadIdx.x; c < v; c += blockDim.x) s += expf(to_float(x[c]) - m);
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) {
      const float l = m + logf(s);
      const int32_t t = targets[r];
      lse[r] = l;
      loss[r] = (t >= 0 && t < v) ? l - to_float(x[t]) : 0.f;
    }
  }
}

// The row's lse in one pass over 16-byte vectors: each thread's (max, sum of exp(x - max)) over
// its columns, then the block's max and the sums rescaled to it.
template <class T>
__global__ void __launch_bounds__(kCeBlock)
    cross_entropy_forward_vec_kernel(float* loss, float* lse, const T* logits,
                                     const int32_t* targets, int64_t n, int64_t v) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const T* x = logits + r * v;
    float m = -INFINITY, s = 0.f;
#pragma unroll 4
    for (int64_t c = threadIdx.x * 8; c < v; c += blockDim.x * 8) {
      float xv[8];
      load8(xv, x + c);
      float cm = xv[0];
#pragma unroll
      for (int e = 1; e < 8; ++e) cm = fmaxf(cm, xv[e]);
      const float nm = fmaxf(m, cm);
      if (nm == -INFINITY) continue;  // every value so far -inf: nothing to add yet
      float add = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) add += expf(xv[e] - nm);
      s = s * expf(m - nm) + add;
      m = nm;
    }
    const float row_max = block_max(m, scratch);
    const float scaled = m == -INFINITY ? 0.f : s * expf(m - row_max);
    const float sum = block_sum(scaled, scratch);
    if (threadIdx.x == 0) {
      const float l = row_max + logf(sum);
      const int32_t t = targets[r];
      lse[r] = l;
      loss[r] = (t >= 0 && t < v) ? l - to_float(x[t]) : 0.f;
    }
  }
}

__global__ void __launch_bounds__(1024)
    cross_entropy_reduce_kernel(double* result, const float* loss, const int32_t* targets,
                                int64_t n) {
  __shared__ double sum[1024];
  __shared__ double count[1024];
  double s = 0.0, k = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (targets[i] < 0) continue;
    s += loss[i];
    k += 1.0;
  }
  sum[threadIdx.x] = s;
  count[threadIdx.x] = k;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) {
      sum[threadIdx.x] += sum[threadIdx.x + o];
      count[threadIdx.x] += count[threadIdx.x + o];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    result[0] = sum[0];
    result[1] = count[0];
  }
}

// Reads each element before writing it, so dlogits may alias logits.
template <class T>
__global__ void cross_entropy_backward_kernel(T* dlogits, const T* logits, const float* lse,
                                              const int32_t* targets, int64_t n, int64_t v,
                                              float scale) {
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const int32_t t = targets[r];
    const bool counted = t >= 0 && t < v;
    const float l = lse[r];
    for (int64_t c = threadIdx.x; c < v; c += blockDim.x) {
      float g = 0.f;
      if (counted) g = scale * expf(to_float(logits[r * v + c]) - l) - (c == t ? scale : 0.f);
      dlogits[r * v + c] = from_float<T>(g);
    }
  }
}

// The same, 8 values per load and store.
template <class T>
__global__ void __launch_bounds__(kBlock)
    cross_entropy_backward_vec_kernel(T* dlogits, const T* logits, const float* lse,
                                      const int32_t* targets, int64_t n, int64_t v, float scale) {
  for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
    const int32_t t = targets[r];
    const bool counted = t >= 0 && t < v;
    const float l = lse[r];
#pragma unroll 4
    for (int64_t c = threadIdx.x * 8; c < v; c += blockDim.x * 8) {
      float g[8];
      load8(g, logits + r * v + c);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        g[e] = counted ? scale * expf(g[e] - l) - (c + e == t ? scale : 0.f) : 0.f;
      store8(dlogits + r * v + c, g);
    }
  }
}

bool vector_rows(const void* a, const void* b, int64_t v) {
  return v % 8 == 0 && aligned16({a, b});
}

}  // namespace

void cross_entropy_forward(float* loss, float* lse, const void* logits, DType dt,
                           const int32_t* targets, int64_t n, int64_t v, Stream stream) {
  if (n == 0) return;
  dispatch_float(dt, "cross_entropy", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto* x = static_cast<const T*>(logits);
    if (vector_rows(x, x, v))
      cross_entropy_forward_vec_kernel<T>
          <<<grid_for(n, 1), kCeBlock, 0, stream>>>(loss, lse, x, targets, n, v);
    else
      cross_entropy_forward_kernel<T>
          <<<grid_for(n, 1), kCeBlock, 0, stream>>>(loss, lse, x, targets, n, v);
    CUDA_CHECK_LAUNCH();
  });
}

void cross_entropy_reduce(double* result, const float* loss, const int32_t* targets, int64_t n,
                          Stream stream) {
  cross_entropy_reduce_kernel<<<1, 1024, 0, stream>>>(result, loss, targets, n);
  CUDA_CHECK_LAUNCH();
}

void cross_entropy_backward(void* dlogits, const void* logits, DType dt, const float* lse,
                            const int32_t* targets, int64_t n, int64_t v, float scale,
                            Stream stream) {
  if (n == 0 || v == 0) return;
  dispatch_float(dt, "cross_entropy_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto* d = static_cast<T*>(dlogits);
    const auto* x = static_cast<const T*>(logits);
    if (vector_rows(d, x, v))
      cross_entropy_backward_vec_kernel<T>
          <<<grid_for(n, 1), kBlock, 0, stream>>>(d, x, lse, targets, n, v, scale);
    else
      cross_entropy_backward_kernel<T>
          <<<grid_for(n, 1), kBlock, 0, stream>>>(d, x, lse, targets, n, v, scale);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace xmoe::cuda
