// Row helpers of the MoE stages (ops/moe.h on CUDA): row scaling, take/put along rows,
// transpose, row L2-normalisation and row renormalisation with their backwards. Each row is
// summed by one warp (or one thread for the short routing rows), so results do not depend on
// timing; f32 math on f32 or bf16 storage.
#include "xmoe/backend/cuda/common.cuh"
#include "xmoe/backend/cuda/fp8_rows.cuh"
#include "xmoe/backend/cuda/moe_kernels.h"

namespace xmoe::cuda {

namespace {

constexpr int kWarpsPerBlock = kBlock / 32;

template <class T>
__global__ void scale_rows_kernel(T* x, const float* w, int64_t n, int64_t d) {
  XMOE_GRID_STRIDE(i, n * d) {
    x[i] = from_float<T>(to_float(x[i]) * w[i / d]);
  }
}

// One warp per row.
template <class T>
__global__ void row_dot_f32_kernel(float* out, const T* a, const T* b, int64_t n, int64_t d) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); r < n;
       r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    float s = 0.f;
    for (int64_t c = lane; c < d; c += 32) s += to_float(a[r * d + c]) * to_float(b[r * d + c]);
    s = warp_sum(s);
    if (lane == 0) out[r] = s;
  }
}

/// Row r of a weighted gather's backward: dy's row of its token (zeros for an index outside
/// [0, t)), its weight, the expert row it dots with and the gradient row it writes.
template <class T, class TY>
struct WeightedGatherRow {
  bool valid;
  float weight;
  const TY* src;
  const T* row;
  T* out;
  __device__ WeightedGatherRow(T* d_rows, const TY* dy, const T* rows, const int32_t* idx,
                               const float* w, int64_t r, int64_t t, int64_t d) {
    const int32_t tok = idx[r];
    valid = tok >= 0 && tok < t;
    weight = valid ? w[r] : 0.f;
    src = dy + (valid ? static_cast<int64_t>(tok) : 0) * d;
    row = rows + r * d;
    out = d_rows + r * d;
  }
  /// dy's 8 values from column c into g (zeros when invalid), weighted, after adding their dot
  /// with the row's 8 values to s.
  __device__ __forceinline__ void load8_weighted(int64_t c, float (&g)[8], float& s) const {
    float x[8];
    load8(g, src + c);
    load8(x, row + c);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      g[e] = valid ? g[e] : 0.f;
      s += x[e] * g[e];
      g[e] *= weight;
    }
  }
};

// One warp per row; VEC: 8 values per access (d % 8 == 0 and 16-byte aligned rows), else one.
template <class T, class TY, bool VEC>
__global__ void gather_weighted_rows_dot_kernel(T* d_rows, float* dot, const TY* dy, const T* rows,
                                                const int32_t* idx, const float* w, int64_t n,
                                                int64_t t, int64_t d) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); r < n;
       r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const WeightedGatherRow<T, TY> in(d_rows, dy, rows, idx, w, r, t, d);
    float s = 0.f;
    if constexpr (VEC) {
      for (int64_t c = 8 * lane; c < d; c += 8 * 32) {
        float g[8];
        in.load8_weighted(c, g, s);
        store8(in.out + c, g);
      }
    } else {
      for (int64_t c = lane; c < d; c += 32) {
        const float g = in.valid ? to_float(in.src[c]) : 0.f;
        s += to_float(in.row[c]) * g;
        in.out[c] = from_float<T>(g * in.weight);
      }
    }
    s = warp_sum(s);
    if (lane == 0) dot[r] = s;
  }
}

// gather_weighted_rows_dot_kernel's VEC form that also writes d_rows' FP8 rows (d % 128 == 0):
// a half-warp's 8 values a lane are one 128-column block, quantised from their values rounded to
// T (as quantize_rows_fp8 would read them back); every lane runs every 256-column step, so the
// half-warps' shuffles see full warps.
template <class T, class TY>
__global__ void gather_weighted_rows_dot_fp8_kernel(T* d_rows, float* dot, const TY* dy,
                                                    const T* rows, const int32_t* idx,
                                                    const float* w, int64_t n, int64_t t, int64_t d,
                                                    uint8_t* q, float* scales,
                                                    const __grid_constant__ RowGroups groups) {
  const int lane = threadIdx.x & 31;
  const int64_t kb = d / kFp8Block;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); r < n;
       r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const WeightedGatherRow<T, TY> in(d_rows, dy, rows, idx, w, r, t, d);
    const WarpRowGroups row_groups_of(groups, r, r);
    float s = 0.f;
    for (int64_t base = 0; base < d; base += 8 * 32) {
      const int64_t c = base + 8 * lane;
      const bool active = c < d;  // a whole half-warp: d % 128 == 0
      float g[8] = {};
      if (active) in.load8_weighted(c, g, s);  // the plain kernel's arithmetic, in its order
#pragma unroll
      for (int e = 0; e < 8; ++e) g[e] = to_float(from_float<T>(g[e]));  // as stored
      const float amax = half_warp_amax(g);
      if (!active) continue;
      store8(in.out + c, g);
      float scale, inverse;
      block_scale(amax, scale, inverse);
      store_e4m3(q + r * d + c, g, inverse);
      if ((lane & 15) == 0) scales[row_groups_of.scale_index(r, kb, c / kFp8Block)] = scale;
    }
    s = warp_sum(s);
    if (lane == 0) dot[r] = s;
  }
}

template <class T>
__global__ void take_along_rows_kernel(T* out, const T* x, const int32_t* idx, int64_t n, int64_t e,
                                       int64_t k) {
  XMOE_GRID_STRIDE(i, n * k) {
    const int32_t j = idx[i];
    out[i] = (j >= 0 && j < e) ? x[(i / k) * e + j] : from_float<T>(0.f);
  }
}

// One thread per row: the k entries of a row are added in order (they may repeat an index).
template <class T, class S>
__global__ void put_along_rows_add_kernel(T* out, const int32_t* idx, const S* src, int64_t n,
                                          int64_t e, int64_t k) {
  XMOE_GRID_STRIDE(r, n) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t c = idx[r * k + j];
      if (c < 0 || c >= e) continue;
      out[r * e + c] = from_float<T>(to_float(out[r * e + c]) + to_float(src[r * k + j]));
    }
  }
}

template <class T>
__global__ void transpose_kernel(T* y, const T* x, int64_t m, int64_t n) {
  XMOE_GRID_STRIDE(i, m * n) {  // i indexes y (n, m)
    const int64_t r = i / m, c = i % m;
    y[i] = x[c * n + r];
  }
}

template <class T>
__global__ void l2_normalize_kernel(T* y, float* norm, const T* x, int64_t n, int64_t d,
                                    float eps) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); r < n;
       r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    float ss = 0.f;
    for (int64_t c = lane; c < d; c += 32) {
      const float v = to_float(x[r * d + c]);
      ss += v * v;
    }
    const float nrm = fmaxf(sqrtf(warp_sum(ss)), eps);
    if (lane == 0) norm[r] = nrm;
    for (int64_t c = lane; c < d; c += 32)
      y[r * d + c] = from_float<T>(to_float(x[r * d + c]) / nrm);
  }
}

template <class T>
__global__ void l2_normalize_backward_kernel(T* dx, const T* y, const float* norm, const T* dy,
                                             int64_t n, int64_t d) {
  const int lane = threadIdx.x & 31;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); r < n;
       r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    float dot = 0.f;
    for (int64_t c = lane; c < d; c += 32) dot += to_float(y[r * d + c]) * to_float(dy[r * d + c]);
    dot = warp_sum(dot);
    const float inv = 1.f / norm[r];
    for (int64_t c = lane; c < d; c += 32)
      dx[r * d + c] = from_float<T>((to_float(dy[r * d + c]) - to_float(y[r * d + c]) * dot) * inv);
  }
}

// One thread per row (k or E entries: routing rows are short), summed in column order as on
// the CPU.
template <class T>
__global__ void renormalize_kernel(T* w, float* sums, const T* v, int64_t n, int64_t k,
                                   float scale) {
  XMOE_GRID_STRIDE(r, n) {
    float s = 0.f;
    for (int64_t j = 0; j < k; ++j) s += to_float(v[r * k + j]);
    s = fmaxf(s, 1e-20f);
    sums[r] = s;
    for (int64_t j = 0; j < k; ++j)
      w[r * k + j] = from_float<T>(scale * to_float(v[r * k + j]) / s);
  }
}

template <class T>
__global__ void renormalize_backward_kernel(T* dv, const T* w, const float* sums, const T* dw,
                                            int64_t n, int64_t k, float scale) {
  XMOE_GRID_STRIDE(r, n) {
    float dot = 0.f;
    for (int64_t j = 0; j < k; ++j) dot += to_float(dw[r * k + j]) * to_float(w[r * k + j]);
    for (int64_t j = 0; j < k; ++j)
      dv[r * k + j] = from_float<T>((scale * to_float(dw[r * k + j]) - dot) / sums[r]);
  }
}

unsigned warp_rows_grid(int64_t n) {
  return grid_for(n, kWarpsPerBlock);
}

}  // namespace

void moe_scale_rows(void* x, DType dt, const float* w, int64_t n, int64_t d, Stream stream) {
  if (n * d == 0) return;
  dispatch_float(dt, "scale_rows_", [&](auto tag) {
    using T = typename decltype(tag)::type;
    scale_rows_kernel<T><<<grid_for(n * d), kBlock, 0, stream>>>(static_cast<T*>(x), w, n, d);
    CUDA_CHECK_LAUNCH();
  });
}

void moe_row_dot_f32(float* out, const void* a, const void* b, DType dt, int64_t n, int64_t d,
                     Stream stream) {
  if (n == 0) return;
  dispatch_float(dt, "row_dot", [&](auto tag) {
    using T = typename decltype(tag)::type;
    row_dot_f32_kernel<T><<<warp_rows_grid(n), kBlock, 0, stream>>>(out, static_cast<const T*>(a),
                                                                    static_cast<const T*>(b), n, d);
    CUDA_CHECK_LAUNCH();
  });
}

void moe_gather_weighted_rows_dot(void* d_rows, float* dot, const void* dy, DType dy_dt,
                                  const void* rows, DType dt, const int32_t* idx, const float* w,
                                  int64_t n, int64_t t, int64_t d, Stream stream, uint8_t* q,
                                  float* scales, const int64_t* group_sizes, int64_t groups) {
  if (n == 0) return;
  const bool vec = d % 8 == 0 && reinterpret_cast<uintptr_t>(d_rows) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(dy) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(rows) % 16 == 0;
  if (q && vec && d % kFp8Block == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0) {
    const RowGroups g = row_groups(group_sizes, groups, "gather_weighted_rows_dot");
    dispatch_float(dt, "gather_weighted_rows_dot", [&](auto tag) {
      using T = typename decltype(tag)::type;
      auto launch = [&](auto dy_tag) {
        using TY = typename decltype(dy_tag)::type;
        gather_weighted_rows_dot_fp8_kernel<T, TY><<<warp_rows_grid(n), kBlock, 0, stream>>>(
            static_cast<T*>(d_rows), dot, static_cast<const TY*>(dy), static_cast<const T*>(rows),
            idx, w, n, t, d, q, scales, g);
        CUDA_CHECK_LAUNCH();
      };
      if (dy_dt == DType::f32)
        launch(Tag<float>{});
      else
        launch(tag);
    });
    return;
  }
  if (q) {  // the plain pass, then its rows quantised
    moe_gather_weighted_rows_dot(d_rows, dot, dy, dy_dt, rows, dt, idx, w, n, t, d, stream);
    quantize_rows_fp8(q, scales, d_rows, dt, group_sizes, groups, d, stream);
    return;
  }
  dispatch_float(dt, "gather_weighted_rows_dot", [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto launch = [&](auto dy_tag) {
      using TY = typename decltype(dy_tag)::type;
      auto* o = static_cast<T*>(d_rows);
      const auto* g = static_cast<const TY*>(dy);
      const auto* x = static_cast<const T*>(rows);
      if (vec)
        gather_weighted_rows_dot_kernel<T, TY, true>
            <<<warp_rows_grid(n), kBlock, 0, stream>>>(o, dot, g, x, idx, w, n, t, d);
      else
        gather_weighted_rows_dot_kernel<T, TY, false>
            <<<warp_rows_grid(n), kBlock, 0, stream>>>(o, dot, g, x, idx, w, n, t, d);
      CUDA_CHECK_LAUNCH();
    };
    if (dy_dt == DType::f32)
      launch(Tag<float>{});
    else
      launch(tag);
  });
}

void moe_take_along_rows(void* out, const void* x, DType dt, const int32_t* idx, int64_t n,
                         int64_t e, int64_t k, Stream stream) {
  if (n * k == 0) return;
  dispatch_float(dt, "take_along_rows", [&](auto tag) {
    using T = typename decltype(tag)::type;
    take_along_rows_kernel<T><<<grid_for(n * k), kBlock, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(x), idx, n, e, k);
    CUDA_CHECK_LAUNCH();
  });
}

void moe_put_along_rows_add(void* out, DType dt, const int32_t* idx, const void* src, DType src_dt,
                            int64_t n, int64_t e, int64_t k, Stream stream) {
  if (n * k == 0) return;
  dispatch_float(dt, "put_along_rows_add", [&](auto otag) {
    using T = typename decltype(otag)::type;
    dispatch_float(src_dt, "put_along_rows_add", [&](auto stag) {
      using S = typename decltype(stag)::type;
      put_along_rows_add_kernel<T, S><<<grid_for(n), kBlock, 0, stream>>>(
          static_cast<T*>(out), idx, static_cast<const S*>(src), n, e, k);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void moe_transpose(void* y, const void* x, DType dt, int64_t m, int64_t n, Stream stream) {
  if (m * n == 0) return;
  dispatch_float(dt, "transpose", [&](auto tag) {
    using T = typename decltype(tag)::type;
    transpose_kernel<T><<<grid_for(m * n), kBlock, 0, stream>>>(static_cast<T*>(y),
                                                                static_cast<const T*>(x), m, n);
    CUDA_CHECK_LAUNCH();
  });
}

void moe_l2_normalize_rows(void* y, float* norm, const void* x, DType dt, int64_t n, int64_t d,
                           float eps, Stream stream) {
  if (n == 0) return;
  dispatch_float(dt, "l2_normalize_rows", [&](auto tag) {
    using T = typename decltype(tag)::type;
    l2_normalize_kernel<T><<<warp_rows_grid(n), kBlock, 0, stream>>>(
        static_cast<T*>(y), norm, static_cast<const T*>(x), n, d, eps);
    CUDA_CHECK_LAUNCH();
  });
}

void moe_l2_normalize_rows_backward(void* dx, const void* y, const float* norm, const void* dy,
                                    DType dt, int64_t n, int64_t d, Stream stream) {
  if (n == 0) return;
  dispatch_float(dt, "l2_normalize_rows_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    l2_normalize_backward_kernel<T><<<warp_rows_grid(n), kBlock, 0, stream>>>(
        static_cast<T*>(dx), static_cast<const T*>(y), norm, static_cast<const T*>(dy), n, d);
    CUDA_CHECK_LAUNCH();
  });
}

void moe_renormalize_rows(void* w, float* sums, const void* v, DType dt, int64_t n, int64_t k,
                          float scale, Stream stream) {
  if (n == 0) return;
  dispatch_float(dt, "renormalize_rows", [&](auto tag) {
    using T = typename decltype(tag)::type;
    renormalize_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(
        static_cast<T*>(w), sums, static_cast<const T*>(v), n, k, scale);
    CUDA_CHECK_LAUNCH();
  });
}

void moe_renormalize_rows_backward(void* dv, const void* w, const float* sums, const void* dw,
                                   DType dt, int64_t n, int64_t k, float scale, Stream stream) {
  if (n == 0) return;
  dispatch_float(dt, "renormalize_rows_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    renormalize_backward_kernel<T>
        <<<grid_for(n), kBlock, 0, stream>>>(static_cast<T*>(dv), static_cast<const T*>(w), sums,
                                             static_cast<const T*>(dw), n, k, scale);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace xmoe::cuda
