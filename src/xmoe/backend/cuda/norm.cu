// RMSNorm: y = x * rstd * w, rstd = (mean(x^2) + eps)^-1/2. The block's fused forms: the
// forward may first add a residual branch (x + a, written out as the new residual stream) and
// write y in another dtype; the backward may read dy in another dtype, add the residual
// stream's gradient and write a bf16 copy of dx beside it. Each saves whole passes over [T, d].
// 16-byte aligned rows with d % 8 == 0: the forward takes one warp per row up to d = 1024, and
// above it, as the backward does, one block per row with 8 columns per thread (d <= 8192); both
// with 16-byte accesses. Other rows: one block per row, element by element.
// The weight gradient is summed deterministically: worker b (a block) owns rows
// b, b + P, b + 2P, ... (P depends only on the row count and d) and writes its partial sums to
// its own row of a (P, d) workspace; then each column's P partials are added in a fixed order.
#include <type_traits>

#include "xmoe/backend/cuda/common.cuh"

namespace xmoe::cuda {

namespace {

constexpr int kNormBlock = 256;
constexpr int64_t kMaxPartials = 256;        // block path
constexpr int kWarpRowMax = 1024;            // forward: 4 chunks of 8 values per lane
constexpr int64_t kRowBlocks = 1024;         // backward, 8 columns a thread: 8 blocks an SM
constexpr int64_t kRowVectorMax = 8 * 1024;  // ... at most 1024 threads a block
constexpr int kRowWarps = 4;                 // warps per block of the warp path

int64_t clamp_partials(int64_t rows, int64_t most) {
  return rows < most ? (rows < 1 ? 1 : rows) : most;
}
int64_t num_partials(int64_t rows) {
  return clamp_partials(rows, kMaxPartials);
}

bool warp_path(const void* x, const void* y, const void* w, int64_t d) {
  return d % 8 == 0 && d <= kWarpRowMax && aligned16({x, y, w});
}

// Lane `lane` of a warp-path kernel holds columns warp_col(lane, c), c < CH (CH * 256 >= d).
__device__ __forceinline__ int64_t warp_col(int lane, int c) {
  return lane * 8 + c * 256;
}

// v rounded to T (what a T store then load gives): the norm reads the sum it writes out.
template <class T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// x (+ a when a is not null, stored to sum) -> y of O, rstd.
template <int CH, class T, class A, class O, class W>
__global__ void __launch_bounds__(kRowWarps * 32)
    rmsnorm_forward_warp_kernel(O* y, T* sum, float* rstd, const T* x, const A* a, const W* w,
                                int64_t rows, int64_t d, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kRowWarps;
  float wv[CH][8];
#pragma unroll
  for (int c = 0; c < CH; ++c)
    if (warp_col(lane, c) < d) load8(wv[c], w + warp_col(lane, c));
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + (threadIdx.x >> 5); r < rows;
       r += warps) {
    const int64_t o = r * d;
    float xv[CH][8];
    float ss = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int64_t j = warp_col(lane, c);
      if (j >= d) continue;
      load8(xv[c], x + o + j);
      if (a) {
        float av[8];
        load8(av, a + o + j);
#pragma unroll
        for (int e = 0; e < 8; ++e) xv[c][e] = round_to<T>(xv[c][e] + av[e]);
        store8(sum + o + j, xv[c]);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += xv[c][e] * xv[c][e];
    }
    ss = warp_sum(ss);
    const float rs = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
    if (lane == 0) rstd[r] = rs;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int64_t j = warp_col(lane, c);
      if (j >= d) continue;
      float out[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] = xv[c][e] * rs * wv[c][e];
      store8(y + o + j, out);
    }
  }
}

// Backward with 8 columns per thread (d % 8 == 0, d <= 8192): a block of d / 8 threads (rounded
// up to whole warps) takes one row at a time, reading x, dy and the residual with 16-byte loads
// before its one block-wide reduction, and keeps its columns' weight-gradient partials in
// registers (8 per thread: no spills, full occupancy). kRowBlocks blocks: every block resident at
// once, with an even share of the rows. Writes dx (+ residual when not null) of T, and its bf16
// copy when dx_copy is not null.
template <class T, class G, class W>
__global__ void __launch_bounds__(1024)
    rmsnorm_backward_row_kernel(T* dx, bf16_t* dx_copy, float* partial, const T* x, const W* w,
                                const float* rstd, const G* dy, const T* residual, int64_t rows,
                                int64_t d) {
  __shared__ float scratch[32];
  const int64_t j = static_cast<int64_t>(threadIdx.x) * 8;
  const bool owns = j < d;
  float wv[8], acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = wv[e] = 0.f;
  if (owns) load8(wv, w + j);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t o = r * d + j;
    const float rs = rstd[r];
    float xv[8], gv[8], res[8];
    float dot = 0.f;
    if (owns) {
      load8(xv, x + o);
      load8(gv, dy + o);
      if (residual) load8(res, residual + o);
#pragma unroll
      for (int e = 0; e < 8; ++e) dot += wv[e] * gv[e] * xv[e];
    }
    dot = block_sum(dot, scratch);
    if (!owns) continue;
    const float k = rs * rs * rs * dot / static_cast<float>(d);
    float out[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      out[e] = rs * wv[e] * gv[e] - xv[e] * k;
      if (residual) out[e] = round_to<T>(out[e]) + res[e];
      acc[e] += gv[e] * xv[e] * rs;
    }
    store8(dx + o, out);
    if (dx_copy) store8(dx_copy + o, out);
  }
  if (owns) store8(partial + blockIdx.x * d + j, acc);
}

// dw[j] += sum over the P partials of column j: 32 columns per block, thread row y adds
// partials y, y + 32, ... in order, then thread row 0 adds the 32 sums in order.
template <class W>
__global__ void __launch_bounds__(1024)
    rmsnorm_dweight_columns_kernel(W* dw, const float* partial, int64_t parts, int64_t d) {
  __shared__ float sums[32][33];
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (j < d)
#pragma unroll 8
    for (int64_t b = threadIdx.y; b < parts; b += 32) s += partial[b * d + j];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && j < d) {
    float t = 0.f;
    for (int i = 0; i < 32; ++i) t += sums[i][threadIdx.x];
    dw[j] = from_float<W>(to_float(dw[j]) + t);
  }
}

template <class W>
void add_partials(W* dw, const float* partial, int64_t parts, int64_t d, Stream stream) {
  rmsnorm_dweight_columns_kernel<W>
      <<<static_cast<unsigned>((d + 31) / 32), dim3(32, 32), 0, stream>>>(dw, partial, parts, d);
  CUDA_CHECK_LAUNCH();
}

template <class F>
void dispatch_chunks(int64_t d, F&& f) {
  if (d <= 256)
    f(std::integral_constant<int, 1>{});
  else if (d <= 512)
    f(std::integral_constant<int, 2>{});
  else
    f(std::integral_constant<int, 4>{});
}

unsigned warp_grid(int64_t rows, int64_t most) {
  return static_cast<unsigned>((clamp_partials(rows, most) + kRowWarps - 1) / kRowWarps);
}

// Forward of rows wider than a warp's (1024 < d <= 8192, d % 8 == 0): one block per row with 8
// columns per thread, as the backward below.
template <class T, class A, class O, class W>
__global__ void __launch_bounds__(1024)
    rmsnorm_forward_row_kernel(O* y, T* sum, float* rstd, const T* x, const A* a, const W* w,
                               int64_t rows, int64_t d, float eps) {
  __shared__ float scratch[32];
  const int64_t j = static_cast<int64_t>(threadIdx.x) * 8;
  const bool owns = j < d;
  float wv[8];
  if (owns) load8(wv, w + j);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t o = r * d + j;
    float xv[8];
    float ss = 0.f;
    if (owns) {
      load8(xv, x + o);
      if (a) {
        float av[8];
        load8(av, a + o);
#pragma unroll
        for (int e = 0; e < 8; ++e) xv[e] = round_to<T>(xv[e] + av[e]);
        store8(sum + o, xv);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += xv[e] * xv[e];
    }
    ss = block_sum(ss, scratch);
    const float rs = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    if (!owns) continue;
    float out[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = xv[e] * rs * wv[e];
    store8(y + o, out);
  }
}

template <class T, class A, class O, class W>
__global__ void __launch_bounds__(kNormBlock)
    rmsnorm_forward_kernel(O* y, T* sum, float* rstd, const T* x, const A* a, const W* w,
                           int64_t rows, int64_t d, float eps) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t o = r * d;
    // With a residual branch the sum is written first and read back: each thread reads only
    // the columns it wrote.
    const T* xr = x + o;
    if (a) {
      for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
        sum[o + j] = from_float<T>(to_float(x[o + j]) + to_float(a[o + j]));
      xr = sum + o;
    }
    float ss = 0.f;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
      const float v = to_float(xr[j]);
      ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float rs = 1.0f / sqrtf(ss / static_cast<float>(d) + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x)
      y[o + j] = from_float<O>(to_float(xr[j]) * rs * to_float(w[j]));
  }
}

// dx = rstd * (w * dy) - x * rstd^3 / d * sum(w * dy * x) (+ residual);
// partial[b] += dy * x * rstd
template <class T, class G, class W>
__global__ void __launch_bounds__(kNormBlock)
    rmsnorm_backward_kernel(T* dx, bf16_t* dx_copy, float* partial, const T* x, const W* w,
                            const float* rstd, const G* dy, const T* residual, int64_t rows,
                            int64_t d) {
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
      float out = rs * to_float(w[j]) * g - xv * c;
      if (residual) out = round_to<T>(out) + to_float(residual[o + j]);
      dx[o + j] = from_float<T>(out);
      if (dx_copy) dx_copy[o + j] = from_float<bf16_t>(out);
      pb[j] += g * xv * rs;
    }
  }
}

// The row-vector path (forward and backward), alignment aside.
bool row_vector_path(int64_t d) {
  return d % 8 == 0 && d <= kRowVectorMax;
}

}  // namespace

void rmsnorm_forward(const RmsNormArgs& g, Stream stream) {
  if (g.rows == 0) return;
  if (g.a && !g.sum) fail("[rmsnorm] a residual branch without a sum to write");
  const bool aligned = aligned16({g.x, g.y, g.w, g.sum, g.a});
  const bool warp = warp_path(g.x, g.y, g.w, g.d) && aligned;
  const bool vector = !warp && row_vector_path(g.d) && aligned;
  dispatch_float(g.x_dt, "rmsnorm", [&](auto xtag) {
    using T = typename decltype(xtag)::type;
    dispatch_float(g.a ? g.a_dt : g.x_dt, "rmsnorm", [&](auto atag) {
      using A = typename decltype(atag)::type;
      dispatch_float(g.y_dt, "rmsnorm", [&](auto ytag) {
        using O = typename decltype(ytag)::type;
        dispatch_float(g.w_dt, "rmsnorm", [&](auto wtag) {
          using W = typename decltype(wtag)::type;
          auto* y = static_cast<O*>(g.y);
          auto* sum = static_cast<T*>(g.sum);
          const auto* x = static_cast<const T*>(g.x);
          const auto* a = static_cast<const A*>(g.a);
          const auto* w = static_cast<const W*>(g.w);
          if (warp) {
            dispatch_chunks(g.d, [&](auto ch) {
              rmsnorm_forward_warp_kernel<decltype(ch)::value, T, A, O, W>
                  <<<warp_grid(g.rows, 65536), kRowWarps * 32, 0, stream>>>(y, sum, g.rstd, x, a, w,
                                                                            g.rows, g.d, g.eps);
            });
          } else if (vector) {
            const unsigned threads = static_cast<unsigned>((g.d / 8 + 31) / 32 * 32);
            rmsnorm_forward_row_kernel<T, A, O, W><<<grid_for(g.rows, 1), threads, 0, stream>>>(
                y, sum, g.rstd, x, a, w, g.rows, g.d, g.eps);
          } else {
            rmsnorm_forward_kernel<T, A, O, W><<<grid_for(g.rows, 1), kNormBlock, 0, stream>>>(
                y, sum, g.rstd, x, a, w, g.rows, g.d, g.eps);
          }
          CUDA_CHECK_LAUNCH();
        });
      });
    });
  });
}

size_t rmsnorm_backward_workspace_bytes(int64_t rows, int64_t d) {
  // The row-vector path has the more partials; an unaligned call takes the block path's fewer.
  const int64_t parts = row_vector_path(d) ? clamp_partials(rows, kRowBlocks) : num_partials(rows);
  return static_cast<size_t>(parts * d) * sizeof(float);
}

void rmsnorm_backward(const RmsNormGradArgs& g, void* workspace, Stream stream) {
  if (g.rows == 0 || g.d == 0) return;
  auto* partial = static_cast<float*>(workspace);
  const bool vector =
      row_vector_path(g.d) && aligned16({g.x, g.dx, g.w, g.dy, workspace, g.residual, g.dx_copy});
  dispatch_float(g.x_dt, "rmsnorm_backward", [&](auto xtag) {
    using T = typename decltype(xtag)::type;
    dispatch_float(g.dy_dt, "rmsnorm_backward", [&](auto gtag) {
      using G = typename decltype(gtag)::type;
      dispatch_float(g.w_dt, "rmsnorm_backward", [&](auto wtag) {
        using W = typename decltype(wtag)::type;
        auto* dx = static_cast<T*>(g.dx);
        auto* dx_copy = static_cast<bf16_t*>(g.dx_copy);
        const auto* x = static_cast<const T*>(g.x);
        const auto* w = static_cast<const W*>(g.w);
        const auto* dy = static_cast<const G*>(g.dy);
        const auto* residual = static_cast<const T*>(g.residual);
        int64_t parts = 0;
        if (vector) {
          parts = clamp_partials(g.rows, kRowBlocks);
          const unsigned threads = static_cast<unsigned>((g.d / 8 + 31) / 32 * 32);
          rmsnorm_backward_row_kernel<T, G, W>
              <<<static_cast<unsigned>(parts), threads, 0, stream>>>(
                  dx, dx_copy, partial, x, w, g.rstd, dy, residual, g.rows, g.d);
        } else {
          parts = num_partials(g.rows);
          rmsnorm_backward_kernel<T, G, W><<<static_cast<unsigned>(parts), kNormBlock, 0, stream>>>(
              dx, dx_copy, partial, x, w, g.rstd, dy, residual, g.rows, g.d);
        }
        CUDA_CHECK_LAUNCH();
        add_partials(static_cast<W*>(g.dw), partial, parts, g.d, stream);
      });
    });
  });
}

}  // namespace xmoe::cuda
