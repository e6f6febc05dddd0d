// Elementwise kernels: casts, add/mul/scale, sigmoid, SwiGLU. One thread per element in a
// grid-stride loop; f32 math whatever the storage dtype. The model's large ones (add, add_,
// SwiGLU forward and backward) take 8 elements per thread with 16-byte accesses where the
// sizes are multiples of 8 and the pointers 16-byte aligned: the same per-element math, so the
// same bits, at about twice the bandwidth of one element per thread.
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

// The vector forms: n8 = n / 8 groups of 8 elements.
template <class A, class B>
__global__ void add_vec_kernel(A* c, const A* a, const B* b, int64_t n8) {
  XMOE_GRID_STRIDE(i, n8) {
    float av[8], bv[8];
    load8(av, a + 8 * i);
    load8(bv, b + 8 * i);
#pragma unroll
    for (int e = 0; e < 8; ++e) av[e] = av[e] + bv[e];
    store8(c + 8 * i, av);
  }
}

template <class A, class B>
__global__ void add_inplace_vec_kernel(A* a, const B* b, float alpha, int64_t n8) {
  XMOE_GRID_STRIDE(i, n8) {
    float av[8], bv[8];
    load8(av, a + 8 * i);
    load8(bv, b + 8 * i);
#pragma unroll
    for (int e = 0; e < 8; ++e) av[e] = av[e] + alpha * bv[e];
    store8(a + 8 * i, av);
  }
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

// value (not null): swiglu(h) too, over da's elements where it is da (each read first).
template <class T>
__global__ void swiglu_backward_kernel(T* dh, T* value, const T* h, const T* da, int64_t rows,
                                       int64_t f) {
  XMOE_GRID_STRIDE(i, rows * f) {
    const int64_t r = i / f, j = i - r * f;
    const float g = to_float(h[r * 2 * f + j]), u = to_float(h[r * 2 * f + f + j]);
    float dg, du;
    swiglu_grad(g, u, to_float(da[i]), dg, du);
    dh[r * 2 * f + j] = from_float<T>(dg);  // dh may be h
    dh[r * 2 * f + f + j] = from_float<T>(du);
    if (value) value[i] = from_float<T>(swiglu_value(g, u));
  }
}

// The vector forms: f8 = f / 8 groups of 8 columns per row.
template <class T>
__global__ void swiglu_forward_vec_kernel(T* a, const T* h, int64_t rows, int64_t f8) {
  XMOE_GRID_STRIDE(i, rows * f8) {
    const int64_t r = i / f8, j = (i - r * f8) * 8, f = f8 * 8;
    float g[8], u[8];
    load8(g, h + r * 2 * f + j);
    load8(u, h + r * 2 * f + f + j);
#pragma unroll
    for (int e = 0; e < 8; ++e) g[e] = swiglu_value(g[e], u[e]);
    store8(a + r * f + j, g);
  }
}

template <class T>
__global__ void swiglu_backward_vec_kernel(T* dh, T* value, const T* h, const T* da, int64_t rows,
                                           int64_t f8) {
  XMOE_GRID_STRIDE(i, rows * f8) {
    const int64_t r = i / f8, j = (i - r * f8) * 8, f = f8 * 8;
    float g[8], u[8], d[8], dg[8], du[8];
    load8(g, h + r * 2 * f + j);
    load8(u, h + r * 2 * f + f + j);
    load8(d, da + r * f + j);
#pragma unroll
    for (int e = 0; e < 8; ++e) swiglu_grad(g[e], u[e], d[e], dg[e], du[e]);
    store8(dh + r * 2 * f + j, dg);  // dh may be h: this thread read its elements first
    store8(dh + r * 2 * f + f + j, du);
    if (value) {
#pragma unroll
      for (int e = 0; e < 8; ++e) g[e] = swiglu_value(g[e], u[e]);
      store8(value + r * f + j, g);
    }
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
      if (n % 8 == 0 && aligned16({c, a, b})) {
        add_vec_kernel<A, B><<<grid_for(n / 8), kBlock, 0, stream>>>(
            static_cast<A*>(c), static_cast<const A*>(a), static_cast<const B*>(b), n / 8);
      } else {
        add_kernel<A, B><<<grid_for(n), kBlock, 0, stream>>>(
            static_cast<A*>(c), static_cast<const A*>(a), static_cast<const B*>(b), n);
      }
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
      if (n % 8 == 0 && aligned16({a, b})) {
        add_inplace_vec_kernel<A, B><<<grid_for(n / 8), kBlock, 0, stream>>>(
            static_cast<A*>(a), static_cast<const B*>(b), alpha, n / 8);
      } else {
        add_inplace_kernel<A, B><<<grid_for(n), kBlock, 0, stream>>>(
            static_cast<A*>(a), static_cast<const B*>(b), alpha, n);
      }
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
    if (f % 8 == 0 && aligned16({a, h})) {
      swiglu_forward_vec_kernel<T><<<grid_for(rows * f / 8), kBlock, 0, stream>>>(
          static_cast<T*>(a), static_cast<const T*>(h), rows, f / 8);
    } else {
      swiglu_forward_kernel<T><<<grid_for(rows * f), kBlock, 0, stream>>>(
          static_cast<T*>(a), static_cast<const T*>(h), rows, f);
    }
    CUDA_CHECK_LAUNCH();
  });
}

void swiglu_backward(void* dh, const void* h, const void* da, DType dt, int64_t rows, int64_t f,
                     Stream stream, void* value) {
  if (rows * f == 0) return;
  dispatch_float(dt, "swiglu_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto* out = static_cast<T*>(dh);
    auto* a = static_cast<T*>(value);
    const auto* hh = static_cast<const T*>(h);
    const auto* d = static_cast<const T*>(da);
    if (f % 8 == 0 && aligned16({dh, h, da, value})) {
      swiglu_backward_vec_kernel<T>
          <<<grid_for(rows * f / 8), kBlock, 0, stream>>>(out, a, hh, d, rows, f / 8);
    } else {
      swiglu_backward_kernel<T><<<grid_for(rows * f), kBlock, 0, stream>>>(out, a, hh, d, rows, f);
    }
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace xmoe::cuda
