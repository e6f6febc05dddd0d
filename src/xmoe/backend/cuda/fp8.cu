// FP8 E4M3 block quantisation on the GPU (docs/fp8.md): the same bytes and scales as the CPU
// reference (backend/cpu/fp8.cpp; CUDA's satfinite round-to-nearest-even conversion, one f32
// multiply by the block's 448 / amax), read by the sm90 FP8 grouped GEMM.
#include <cuda_fp8.h>

#include "xmoe/backend/cuda/common.cuh"
#include "xmoe/core/fp8.h"

namespace xmoe::cuda {

namespace {

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

__device__ __forceinline__ void load4(float (&v)[4], const bf16_t* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&u);
  const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}
__device__ __forceinline__ void load4(float (&v)[4], const float* p) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
}

/// The first row of every group (and the total last), passed by value.
struct RowGroups {
  int count = 0;
  int32_t start[kMaxFp8Groups + 1];
};

RowGroups row_groups(const int64_t* group_sizes, int64_t groups, const char* op) {
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

/// Index of row r's scale of column block j (cpu::quantize_rows_fp8's grouped layout: a group's
/// scales are [kb, n] from its first row's o * kb).
__device__ __forceinline__ int64_t row_scale_index(const RowGroups& groups, int64_t r, int64_t kb,
                                                   int64_t j) {
  int64_t o, n;
  row_group(groups, r, o, n);
  return o * kb + j * n + (r - o);
}

__device__ __forceinline__ void load_vec(float (&v)[4], const bf16_t* p) {
  load4(v, p);
}
__device__ __forceinline__ void load_vec(float (&v)[4], const float* p) {
  load4(v, p);
}
__device__ __forceinline__ void load_vec(float (&v)[8], const bf16_t* p) {
  load8(v, p);
}
__device__ __forceinline__ void load_vec(float (&v)[8], const float* p) {
  load8(v, p);
}

/// Where a quantiser's rows come from: x [rows, k] itself; (swiglu) the SwiGLU of h [rows, 2k] =
/// [gate | up], rounded to T as swiglu_forward writes it, so that the fused pass quantises the
/// very numbers the two passes would (and no [rows, k] activation is written); or (gather) row
/// index[r] of x [x_rows, k], as gather_rows would copy it (an index outside [0, x_rows) reads
/// zeros), so that the order stage's [rows, k] copy of x is never written.
enum class RowKind { plain, swiglu, gather };
template <class T, RowKind kKind>
struct RowSource {
  const T* x;
  int64_t k;
  const int32_t* index = nullptr;  // gather
  int64_t x_rows = 0;              // gather

  /// Row r's first element (gather: null for an index out of range).
  __device__ __forceinline__ const T* row(int64_t r) const {
    if constexpr (kKind == RowKind::gather) {
      const int64_t i = index[r];
      return i >= 0 && i < x_rows ? x + i * k : nullptr;
    } else if constexpr (kKind == RowKind::swiglu) {
      return x + r * 2 * k;
    } else {
      return x + r * k;
    }
  }
  __device__ __forceinline__ float at(int64_t r, int64_t c) const {
    const T* p = row(r);
    if constexpr (kKind == RowKind::swiglu) {
      return to_float(from_float<T>(swiglu_value(to_float(p[c]), to_float(p[k + c]))));
    } else if constexpr (kKind == RowKind::gather) {
      return p ? to_float(p[c]) : 0.f;
    } else {
      return to_float(p[c]);
    }
  }
  /// N consecutive columns from c (aligned to N elements).
  template <int N>
  __device__ __forceinline__ void load(float (&v)[N], int64_t r, int64_t c) const {
    const T* p = row(r);
    if constexpr (kKind == RowKind::swiglu) {
      float g[N], u[N];
      load_vec(g, p + c);
      load_vec(u, p + k + c);
#pragma unroll
      for (int e = 0; e < N; ++e) v[e] = to_float(from_float<T>(swiglu_value(g[e], u[e])));
    } else if constexpr (kKind == RowKind::gather) {
      if (p) {
        load_vec(v, p + c);
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) v[e] = 0.f;
      }
    } else {
      load_vec(v, p + c);
    }
  }
};

/// One warp per (row, 128-column block).
template <class T, RowKind kKind>
__global__ void quantize_rows_kernel(uint8_t* q, float* scales, const RowSource<T, kKind> x,
                                     const __grid_constant__ RowGroups groups, int64_t k) {
  const int64_t kb = (k + kFp8Block - 1) / kFp8Block, rows = groups.start[groups.count];
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t item = warp; item < rows * kb; item += warps) {
    const int64_t r = item / kb, j = item % kb;
    const int64_t c0 = j * kFp8Block, c1 = min(k, c0 + kFp8Block);
    float v[kFp8Block / 32];
    float amax = 0.f;
    // A whole block with 4-aligned rows: each lane's 4 consecutive elements in one load and one
    // 4-byte store; otherwise element by element.
    const bool whole = c1 - c0 == kFp8Block && k % 4 == 0;
    if (whole) {
      x.load(v, r, c0 + 4 * lane);
    } else {
#pragma unroll
      for (int t = 0; t < kFp8Block / 32; ++t) {
        const int64_t c = c0 + lane + 32 * t;
        v[t] = c < c1 ? x.at(r, c) : 0.f;
      }
    }
#pragma unroll
    for (int t = 0; t < kFp8Block / 32; ++t) amax = fmaxf(amax, fabsf(v[t]));
    amax = warp_max(amax);
    float scale, inverse;
    block_scale(amax, scale, inverse);
    if (whole) {
      uint32_t packed = 0;
#pragma unroll
      for (int t = 0; t < 4; ++t) packed |= uint32_t{to_e4m3(v[t] * inverse)} << (8 * t);
      *reinterpret_cast<uint32_t*>(q + r * k + c0 + 4 * lane) = packed;
    } else {
#pragma unroll
      for (int t = 0; t < kFp8Block / 32; ++t) {
        const int64_t c = c0 + lane + 32 * t;
        if (c < c1) q[r * k + c] = to_e4m3(v[t] * inverse);
      }
    }
    if (lane == 0) scales[row_scale_index(groups, r, kb, j)] = scale;
  }
}

/// Rows of whole 128-column blocks (k % 128 == 0, 16-byte aligned): each half-warp quantises one
/// block, 8 elements a lane in one 16-byte load, and a warp takes kPairs pairs of a row's blocks
/// at once, so every lane has kPairs loads in flight (the one-block-per-warp kernel above, with
/// one 8-byte load per lane, is latency-bound at about a quarter of HBM's bandwidth). The same
/// bytes and scales.
template <class T, RowKind kKind>
__global__ void quantize_rows_wide_kernel(uint8_t* q, float* scales, const RowSource<T, kKind> x,
                                          const __grid_constant__ RowGroups groups, int64_t k) {
  constexpr int kPairs = 4;
  const int64_t kb = k / kFp8Block, rows = groups.start[groups.count];
  const int64_t chunks = (kb + 2 * kPairs - 1) / (2 * kPairs);  // warp items per row
  const int lane = threadIdx.x & 31, half = lane >> 4, sub = lane & 15;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t item = warp; item < rows * chunks; item += warps) {
    const int64_t r = item / chunks, first = item % chunks * 2 * kPairs + half;
    float v[kPairs][8];
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      const int64_t j = first + 2 * p;  // this half-warp's block
      if (j < kb) {
        x.load(v[p], r, j * kFp8Block + 8 * sub);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[p][e] = 0.f;
      }
    }
    int64_t o, n;  // the row's group, found once for its blocks
    row_group(groups, r, o, n);
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      float amax = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[p][e]));
#pragma unroll
      for (int off = 8; off > 0; off >>= 1)  // within the half-warp
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      const int64_t j = first + 2 * p;
      if (j >= kb) continue;
      float scale, inverse;
      block_scale(amax, scale, inverse);
      uint2 packed{0, 0};
#pragma unroll
      for (int e = 0; e < 8; ++e)
        (e < 4 ? packed.x : packed.y) |= uint32_t{to_e4m3(v[p][e] * inverse)} << (8 * (e % 4));
      *reinterpret_cast<uint2*>(q + r * k + j * kFp8Block + 8 * sub) = packed;
      if (sub == 0) scales[o * kb + j * n + (r - o)] = scale;
    }
  }
}

template <class T>
__global__ void dequantize_rows_kernel(T* x, const uint8_t* q, const float* scales,
                                       const __grid_constant__ RowGroups groups, int64_t k) {
  const int64_t kb = (k + kFp8Block - 1) / kFp8Block, n = groups.start[groups.count] * k;
  XMOE_GRID_STRIDE(i, n) {
    const int64_t r = i / k, c = i % k;
    x[i] = from_float<T>(from_e4m3(q[i]) * scales[row_scale_index(groups, r, kb, c / kFp8Block)]);
  }
}

/// One block per (128 x 128 tile, group): the tile's amax, its bytes in both layouts.
template <class T>
__global__ void quantize_weights_kernel(uint8_t* q, uint8_t* q_t, float* scales, float* scales_t,
                                        const T* w, int64_t k, int64_t m) {
  __shared__ alignas(8) uint8_t tile[kFp8Block][kFp8Block + 8];  // [m][k]: read back along k
  __shared__ float scratch[32];
  const int64_t kb = (k + kFp8Block - 1) / kFp8Block, mb = (m + kFp8Block - 1) / kFp8Block;
  const int64_t bj = blockIdx.x, bi = blockIdx.y, g = blockIdx.z;
  const int64_t r0 = bi * kFp8Block, c0 = bj * kFp8Block;
  const int rn = static_cast<int>(min(int64_t{kFp8Block}, k - r0));
  const int cn = static_cast<int>(min(int64_t{kFp8Block}, m - c0));
  const T* wg = w + g * k * m;
  if (rn == kFp8Block && cn == kFp8Block && k % 8 == 0 && m % 8 == 0) {
    // A whole tile: thread t holds rows t / 16 + 16 i (i < 8), columns 8 (t % 16) + [0, 8) in
    // registers (one 16- or 32-byte load each), so the tile is read once.
    constexpr int kRowsPerPass = 16;
    const int col = 8 * (threadIdx.x % 16), row = threadIdx.x / 16;
    float v[8][8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      load8(v[i], wg + (r0 + row + kRowsPerPass * i) * m + c0 + col);
#pragma unroll
      for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[i][e]));
    }
    amax = block_max(amax, scratch);
    float scale, inverse;
    block_scale(amax, scale, inverse);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = row + kRowsPerPass * i;
      uint2 packed{0, 0};
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const uint8_t b = to_e4m3(v[i][e] * inverse);
        (e < 4 ? packed.x : packed.y) |= uint32_t{b} << (8 * (e % 4));
        tile[col + e][r] = b;
      }
      *reinterpret_cast<uint2*>(q + g * k * m + (r0 + r) * m + c0 + col) = packed;
    }
    __syncthreads();
    // The transpose, 8 bytes a thread along k.
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int idx = threadIdx.x + kBlock * i, c = idx / 16, r = 8 * (idx % 16);
      uint2 packed;
      memcpy(&packed, &tile[c][r], 8);
      *reinterpret_cast<uint2*>(q_t + g * k * m + (c0 + c) * k + r0 + r) = packed;
    }
    if (threadIdx.x == 0) {
      scales[(g * kb + bi) * mb + bj] = scale;
      scales_t[(g * mb + bj) * kb + bi] = scale;
    }
    return;
  }
  float amax = 0.f;
  for (int i = threadIdx.x; i < rn * kFp8Block; i += blockDim.x) {
    const int r = i / kFp8Block, c = i % kFp8Block;
    if (c < cn) amax = fmaxf(amax, fabsf(to_float(wg[(r0 + r) * m + c0 + c])));
  }
  amax = block_max(amax, scratch);
  float scale, inverse;
  block_scale(amax, scale, inverse);
  for (int i = threadIdx.x; i < rn * kFp8Block; i += blockDim.x) {
    const int r = i / kFp8Block, c = i % kFp8Block;
    if (c < cn) {
      const uint8_t b = to_e4m3(to_float(wg[(r0 + r) * m + c0 + c]) * inverse);
      q[g * k * m + (r0 + r) * m + c0 + c] = b;
      tile[c][r] = b;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < cn * kFp8Block; i += blockDim.x) {
    const int c = i / kFp8Block, r = i % kFp8Block;
    if (r < rn) q_t[g * k * m + (c0 + c) * k + r0 + r] = tile[c][r];
  }
  if (threadIdx.x == 0) {
    scales[(g * kb + bi) * mb + bj] = scale;
    scales_t[(g * mb + bj) * kb + bi] = scale;
  }
}

template <class T>
__global__ void dequantize_weights_kernel(T* w, const uint8_t* q, const float* scales,
                                          int64_t groups, int64_t k, int64_t m) {
  const int64_t kb = (k + kFp8Block - 1) / kFp8Block, mb = (m + kFp8Block - 1) / kFp8Block;
  XMOE_GRID_STRIDE(i, groups * k * m) {
    const int64_t g = i / (k * m), r = (i / m) % k, c = i % m;
    w[i] = from_float<T>(from_e4m3(q[i]) * scales[(g * kb + r / kFp8Block) * mb + c / kFp8Block]);
  }
}

/// Rows of k columns from x (swiglu: from h [rows, 2k]; gather: rows index[r] of x [x_rows, k])
/// quantised in their groups.
template <RowKind kKind>
void quantize_rows(uint8_t* q, float* scales, const void* x, DType dt, const int64_t* group_sizes,
                   int64_t groups, int64_t k, Stream stream, const char* op,
                   const int32_t* index = nullptr, int64_t x_rows = 0) {
  const RowGroups g = row_groups(group_sizes, groups, op);
  const int64_t items = int64_t{g.start[groups]} * ((k + kFp8Block - 1) / kFp8Block);
  if (items == 0) return;
  // Whole blocks at 16-byte (and q at 8-byte) alignment: the wide kernel.
  const bool wide = k % kFp8Block == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(q) % 8 == 0;
  dispatch_float(dt, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const RowSource<T, kKind> source{static_cast<const T*>(x), k, index, x_rows};
    if (wide) {
      const int64_t chunks = (k / kFp8Block + 7) / 8;
      quantize_rows_wide_kernel<T, kKind>
          <<<grid_for(int64_t{g.start[groups]} * chunks * 32), kBlock, 0, stream>>>(q, scales,
                                                                                    source, g, k);
    } else {
      quantize_rows_kernel<T, kKind>
          <<<grid_for(items * 32), kBlock, 0, stream>>>(q, scales, source, g, k);
    }
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

void quantize_rows_fp8(uint8_t* q, float* scales, const void* x, DType dt,
                       const int64_t* group_sizes, int64_t groups, int64_t k, Stream stream) {
  quantize_rows<RowKind::plain>(q, scales, x, dt, group_sizes, groups, k, stream,
                                "quantize_rows_fp8");
}

void swiglu_quantize_rows_fp8(uint8_t* q, float* scales, const void* h, DType dt,
                              const int64_t* group_sizes, int64_t groups, int64_t f,
                              Stream stream) {
  quantize_rows<RowKind::swiglu>(q, scales, h, dt, group_sizes, groups, f, stream,
                                 "swiglu_quantize_rows_fp8");
}

void swiglu_backward_quantize_fp8(void* h, void* da, DType dt, uint8_t* q, float* scales,
                                  const int64_t* group_sizes, int64_t groups, int64_t f,
                                  Stream stream) {
  const RowGroups g = row_groups(group_sizes, groups, "swiglu_backward_with_value_fp8_");
  const int64_t rows = g.start[groups];
  swiglu_backward(h, h, da, dt, rows, f, stream, da);
  quantize_rows<RowKind::plain>(q, scales, h, dt, group_sizes, groups, 2 * f, stream,
                                "swiglu_backward_with_value_fp8_");
}

void gather_quantize_rows_fp8(uint8_t* q, float* scales, const void* x, DType dt,
                              const int32_t* index, int64_t x_rows, const int64_t* group_sizes,
                              int64_t groups, int64_t k, Stream stream) {
  quantize_rows<RowKind::gather>(q, scales, x, dt, group_sizes, groups, k, stream,
                                 "gather_quantize_rows_fp8", index, x_rows);
}

void dequantize_rows_fp8(void* x, DType dt, const uint8_t* q, const float* scales,
                         const int64_t* group_sizes, int64_t groups, int64_t k, Stream stream) {
  const RowGroups g = row_groups(group_sizes, groups, "dequantize_rows_fp8");
  const int64_t n = int64_t{g.start[groups]} * k;
  if (n == 0) return;
  dispatch_float(dt, "dequantize_rows_fp8", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dequantize_rows_kernel<T>
        <<<grid_for(n), kBlock, 0, stream>>>(static_cast<T*>(x), q, scales, g, k);
    CUDA_CHECK_LAUNCH();
  });
}

void quantize_weights_fp8(uint8_t* q, uint8_t* q_t, float* scales, float* scales_t, const void* w,
                          DType dt, int64_t groups, int64_t k, int64_t m, Stream stream) {
  if (groups * k * m == 0) return;
  const dim3 grid(static_cast<unsigned>((m + kFp8Block - 1) / kFp8Block),
                  static_cast<unsigned>((k + kFp8Block - 1) / kFp8Block),
                  static_cast<unsigned>(groups));
  dispatch_float(dt, "quantize_weights_fp8", [&](auto tag) {
    using T = typename decltype(tag)::type;
    quantize_weights_kernel<T>
        <<<grid, kBlock, 0, stream>>>(q, q_t, scales, scales_t, static_cast<const T*>(w), k, m);
    CUDA_CHECK_LAUNCH();
  });
}

void dequantize_weights_fp8(void* w, DType dt, const uint8_t* q, const float* scales,
                            int64_t groups, int64_t k, int64_t m, Stream stream) {
  const int64_t n = groups * k * m;
  if (n == 0) return;
  dispatch_float(dt, "dequantize_weights_fp8", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dequantize_weights_kernel<T>
        <<<grid_for(n), kBlock, 0, stream>>>(static_cast<T*>(w), q, scales, groups, k, m);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace xmoe::cuda
