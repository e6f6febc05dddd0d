// Elementwise kernels: casts, add/mul/scale, sigmoid, SwiGLU. One thread per element in a
// grid-stride loop; f32 math whatever the storage dtype.
#include "xmoe/backend/cuda/common.cuh"

namespace xmoe::cuda {

namespace {

template <class D, class S>
__global__ void cast_kernel(D* dst, const S* src, int64_t n) {
  XMOE_GRID_STRIDE(i, n) dst[i] = from_float<D>(to_float(src[i]));
}

template <class A, class B>
__global__ void add_kernel(A* c, const A* a, const B* b, int64_t n) {
  XMOE_GRID_STRIDE(i, n) c[i] = from_float<A>(to_float(a[i]) + to_float(b[i]));
}

template <class A, class B>
__global__ void add_inplace_kernel(A* a, const B* b, float alpha, int64_t n) {
  XMOE_GRID_STRIDE(i, n) a[i] = from_float<A>(to_float(a[i]) + alpha * to_float(b[i]));
}

// Exact bf16 terms of an f32 (cpu::split_bf16_columns); up to 6 output blocks.
struct SplitTerms {
  int term[6];
};
__global__ void split_bf16_columns_kernel(bf16_t* out, const float* x, int64_t rows, int64_t cols,
                                          SplitTerms terms, int n) {
  XMOE_GRID_STRIDE(i, rows * cols) {
    const int64_t r = i / cols, c = i - r * cols;
    const float v = x[i];
    const bf16_t t0 = __float2bfloat16_rn(v);
    const bf16_t t1 = __float2bfloat16_rn(v - __bfloat162float(t0));
    const bf16_t t2 = __float2bfloat16_rn(v - __bfloat162float(t0) - __bfloat162float(t1));
    for (int j = 0; j < n; ++j) {
      const int t = terms.term[j];
      out[(r * n + j) * cols + c] = t == 0 ? t0 : t == 1 ? t1 : t2;
    }
  }
}

__global__ void sum_column_blocks_kernel(float* out, const float* y, int64_t rows, int64_t cols,
                                         int64_t n, bool accumulate) {
  XMOE_GRID_STRIDE(i, rows * cols) {
    const int64_t r = i / cols, c = i - r * cols;
    float s = y[r * cols * n + c];
    for (int64_t j = 1; j < n; ++j) s += y[(r * n + j) * cols + c];
    out[i] = accumulate ? out[i] + s : s;
  }
}

template <class T>
__global__ void mul_kernel(T* c, const T* a, const T* b, int64_t n) {
  XMOE_GRID_STRIDE(i, n) c[i] = from_float<T>(to_float(a[i]) * to_float(b[i]));
}

template <class T>
__global__ void scale_kernel(T* a, float s, int64_t n) {
  XMOE_GRID_STRIDE(i, n) a[i] = from_float<T>(to_float(a[i]) * s);
}

template <class T>
__global__ void sigmoid_forward_kernel(T* y, const T* x, int64_t n) {
  XMOE_GRID_STRIDE(i, n) y[i] = from_float<T>(1.0f / (1.0f + expf(-to_float(x[i]))));
}

template <class T>
__global__ void sigmoid_backward_kernel(T* dx, const T* y, const T* dy, int64_t n) {
  XMOE_GRID_STRIDE(i, n) {
    const float yi = to_float(y[i]);
    dx[i] = from_float<T>(to_float(dy[i]) * yi * (1.0f - yi));
  }
}

// h (rows, 2f) = [gate | up]; a (rows, f)
template <class T>
__global__ void swiglu_forward_kernel(T* a, const T* h, int64_t rows, int64_t f) {
  XMOE_GRID_STRIDE(i, rows * f) {
    const int64_t r = i / f, j = i - r * f;
    const float g = to_float(h[r * 2 * f + j]), u = to_float(h[r * 2 * f + f + j]);
    a[i] = from_float<T>(swiglu_value(g, u));
  }
}

// a = silu(g) * u; silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid(g)
template <class T>
__global__ void swiglu_backward_kernel(T* dh, const T* h, const T* da, int64_t rows, int64_t f) {
  XMOE_GRID_STRIDE(i, rows * f) {
    const int64_t r = i / f, j = i - r * f;
    const float g = to_float(h[r * 2 * f + j]), u = to_float(h[r * 2 * f + f + j]);
    const float d = to_float(da[i]);
    const float s = 1.0f / (1.0f + expf(-g));
    dh[r * 2 * f + j] = from_float<T>(d * u * s * (1.0f + g * (1.0f - s)));  // dh may be h
    dh[r * 2 * f + f + j] = from_float<T>(d * g * s);
  }
}

}  // namespace

void cast(void* dst, DType dst_dt, const void* src, DType src_dt, int64_t n, Stream stream) {
  if (n == 0) return;
  dispatch_float(dst_dt, "cast", [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_float(src_dt, "cast", [&](auto stag) {
      using S = typename decltype(stag)::type;
      cast_kernel<D, S>
          <<<grid_for(n), kBlock, 0, stream>>>(static_cast<D*>(dst), static_cast<const S*>(src), n);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void add(void* c, const void* a, DType a_dt, const void* b, DType b_dt, int64_t n, Stream stream) {
  if (n == 0) return;
  dispatch_float(a_dt, "add", [&](auto atag) {
    using A = typename decltype(atag)::type;
    dispatch_float(b_dt, "add", [&](auto btag) {
      using B = typename decltype(btag)::type;
      add_kernel<A, B><<<grid_for(n), kBlock, 0, stream>>>(
          static_cast<A*>(c), static_cast<const A*>(a), static_cast<const B*>(b), n);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void add_inplace(void* a, DType a_dt, const void* b, DType b_dt, float alpha, int64_t n,
                 Stream stream) {
  if (n == 0) return;
  dispatch_float(a_dt, "add_", [&](auto atag) {
    using A = typename decltype(atag)::type;
    dispatch_float(b_dt, "add_", [&](auto btag) {
      using B = typename decltype(btag)::type;
      add_inplace_kernel<A, B><<<grid_for(n), kBlock, 0, stream>>>(
          static_cast<A*>(a), static_cast<const B*>(b), alpha, n);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void split_bf16_columns(void* out, const float* x, int64_t rows, int64_t cols, const int* terms,
                        int n, Stream stream) {
  if (rows * cols == 0) return;
  if (n < 1 || n > 6) fail("[split_bf16_columns] 1 to 6 terms");
  SplitTerms t{};
  for (int j = 0; j < n; ++j) t.term[j] = terms[j];
  split_bf16_columns_kernel<<<grid_for(rows * cols), kBlock, 0, stream>>>(static_cast<bf16_t*>(out),
                                                                          x, rows, cols, t, n);
  CUDA_CHECK_LAUNCH();
}

void sum_column_blocks(float* out, const float* y, int64_t rows, int64_t cols, int64_t n,
                       bool accumulate, Stream stream) {
  if (rows * cols == 0) return;
  sum_column_blocks_kernel<<<grid_for(rows * cols), kBlock, 0, stream>>>(out, y, rows, cols, n,
                                                                         accumulate);
  CUDA_CHECK_LAUNCH();
}

void mul(void* c, const void* a, const void* b, DType dt, int64_t n, Stream stream) {
  if (n == 0) return;
  dispatch_float(dt, "mul", [&](auto tag) {
    using T = typename decltype(tag)::type;
    mul_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(static_cast<T*>(c), static_cast<const T*>(a),
                                                      static_cast<const T*>(b), n);
    CUDA_CHECK_LAUNCH();
  });
}

void scale_inplace(void* a, DType dt, float s, int64_t n, Stream stream) {
  if (n == 0) return;
  dispatch_float(dt, "scale_", [&](auto tag) {
    using T = typename decltype(tag)::type;
    scale_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(static_cast<T*>(a), s, n);
    CUDA_CHECK_LAUNCH();
  });
}

void sigmoid_forward(void* y, const void* x, DType dt, int64_t n, Stream stream) {
  if (n == 0) return;
  dispatch_float(dt, "sigmoid", [&](auto tag) {
    using T = typename decltype(tag)::type;
    sigmoid_forward_kernel<T>
        <<<grid_for(n), kBlock, 0, stream>>>(static_cast<T*>(y), static_cast<const T*>(x), n);
    CUDA_CHECK_LAUNCH();
  });
}

void sigmoid_backward(void* dx, const void* y, const void* dy, DType dt, int64_t n, Stream stream) {
  if (n == 0) return;
  dispatch_float(dt, "sigmoid_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    sigmoid_backward_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(
        static_cast<T*>(dx), static_cast<const T*>(y), static_cast<const T*>(dy), n);
    CUDA_CHECK_LAUNCH();
  });
}

void swiglu_forward(void* a, const void* h, DType dt, int64_t rows, int64_t f, Stream stream) {
  if (rows * f == 0) return;
  dispatch_float(dt, "swiglu", [&](auto tag) {
    using T = typename decltype(tag)::type;
    swiglu_forward_kernel<T><<<grid_for(rows * f), kBlock, 0, stream>>>(
        static_cast<T*>(a), static_cast<const T*>(h), rows, f);
    CUDA_CHECK_LAUNCH();
  });
}

void swiglu_backward(void* dh, const void* h, const void* da, DType dt, int64_t rows, int64_t f,
                     Stream stream) {
  if (rows * f == 0) return;
  dispatch_float(dt, "swiglu_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    swiglu_backward_kernel<T><<<grid_for(rows * f), kBlock, 0, stream>>>(
        static_cast<T*>(dh), static_cast<const T*>(h), static_cast<const T*>(da), rows, f);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace xmoe::cuda
