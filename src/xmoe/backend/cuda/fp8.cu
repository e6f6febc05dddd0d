// FP8 E4M3 block quantisation on the GPU (docs/fp8.md): the same bytes and scales as the CPU
// reference (backend/cpu/fp8.cpp; CUDA's satfinite round-to-nearest-even conversion, one f32
// multiply by the block's 448 / amax), read by the sm90 FP8 grouped GEMM.
#include "xmoe/backend/cuda/common.cuh"
#include "xmoe/backend/cuda/fp8_rows.cuh"

namespace xmoe::cuda {

namespace {

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
/// block, 8 elements a lane in one 16-byte load, and a warp takes kWarpBlocks consecutive blocks
/// of the flattened (row, block) list at once, so every lane has kWarpBlocks / 2 loads in flight
/// however few blocks a row has (the one-block-per-warp kernel above, with one 8-byte load per
/// lane, is latency-bound at about a quarter of HBM's bandwidth, and so was this one while a warp
/// took the blocks of one row: f = 256 gave a lane one load). The same bytes and scales.
template <class T, RowKind kKind>
__global__ void quantize_rows_wide_kernel(uint8_t* q, float* scales, const RowSource<T, kKind> x,
                                          const __grid_constant__ RowGroups groups, int64_t k) {
  constexpr int kWarpBlocks = 8, kLoads = kWarpBlocks / 2;
  const int64_t kb = k / kFp8Block, blocks = int64_t{groups.start[groups.count]} * kb;
  const int lane = threadIdx.x & 31, half = lane >> 4, sub = lane & 15;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t first = warp * kWarpBlocks; first < blocks; first += warps * kWarpBlocks) {
    float v[kLoads][8];
#pragma unroll
    for (int p = 0; p < kLoads; ++p) {
      const int64_t b = first + 2 * p + half;  // this half-warp's block
      if (b < blocks) {
        x.load(v[p], b / kb, b % kb * kFp8Block + 8 * sub);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[p][e] = 0.f;
      }
    }
    const WarpRowGroups warp_groups(groups, first / kb,
                                    (min(first + kWarpBlocks, blocks) - 1) / kb);
#pragma unroll
    for (int p = 0; p < kLoads; ++p) {
      const float amax = half_warp_amax(v[p]);
      const int64_t b = first + 2 * p + half;
      if (b >= blocks) continue;
      const int64_t r = b / kb, j = b % kb;
      float scale, inverse;
      block_scale(amax, scale, inverse);
      store_e4m3(q + r * k + j * kFp8Block + 8 * sub, v[p], inverse);
      if (sub == 0) scales[warp_groups.scale_index(r, kb, j)] = scale;
    }
  }
}

/// swiglu_backward_vec_kernel with value = da, and quantize_rows_wide_kernel of the dh it writes,
/// in one pass (f % 128 == 0, 16-byte aligned): each half-warp takes one 128-column block j of
/// f, i.e. blocks j (gate) and f / 128 + j (up) of dh, and a warp kWarpBlocks consecutive (row,
/// j) at once. dh is quantised from its values rounded to T, as the two passes would read them.
template <class T>
__global__ void swiglu_backward_quantize_kernel(T* h, T* da, uint8_t* q, float* scales,
                                                const __grid_constant__ RowGroups groups,
                                                int64_t f) {
  constexpr int kWarpBlocks = 4, kLoads = kWarpBlocks / 2;
  const int64_t fb = f / kFp8Block, kb = 2 * fb, blocks = int64_t{groups.start[groups.count]} * fb;
  const int lane = threadIdx.x & 31, half = lane >> 4, sub = lane & 15;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t first = warp * kWarpBlocks; first < blocks; first += warps * kWarpBlocks) {
    float g[kLoads][8], u[kLoads][8], d[kLoads][8];
#pragma unroll
    for (int p = 0; p < kLoads; ++p) {
      const int64_t b = first + 2 * p + half;
      if (b < blocks) {
        const int64_t r = b / fb, c = b % fb * kFp8Block + 8 * sub;
        load8(g[p], h + r * 2 * f + c);
        load8(u[p], h + r * 2 * f + f + c);
        load8(d[p], da + r * f + c);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) g[p][e] = u[p][e] = d[p][e] = 0.f;
      }
    }
    const WarpRowGroups warp_groups(groups, first / fb,
                                    (min(first + kWarpBlocks, blocks) - 1) / fb);
#pragma unroll
    for (int p = 0; p < kLoads; ++p) {
      float dg[8], du[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        swiglu_grad(g[p][e], u[p][e], d[p][e], dg[e], du[e]);
        dg[e] = to_float(from_float<T>(dg[e]));  // as stored
        du[e] = to_float(from_float<T>(du[e]));
        g[p][e] = swiglu_value(g[p][e], u[p][e]);
      }
      const float amax_g = half_warp_amax(dg), amax_u = half_warp_amax(du);
      const int64_t b = first + 2 * p + half;
      if (b >= blocks) continue;
      const int64_t r = b / fb, j = b % fb, c = j * kFp8Block + 8 * sub;
      store8(h + r * 2 * f + c, dg);  // dh over h: this lane read its elements first
      store8(h + r * 2 * f + f + c, du);
      store8(da + r * f + c, g[p]);
      float scale_g, inverse_g, scale_u, inverse_u;
      block_scale(amax_g, scale_g, inverse_g);
      block_scale(amax_u, scale_u, inverse_u);
      store_e4m3(q + r * 2 * f + c, dg, inverse_g);
      store_e4m3(q + r * 2 * f + f + c, du, inverse_u);
      if (sub == 0) {
        scales[warp_groups.scale_index(r, kb, j)] = scale_g;
        scales[warp_groups.scale_index(r, kb, fb + j)] = scale_u;
      }
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
  // [m][k] bytes, read back along k; the edge tiles' path pads its rows, the whole tiles' path
  // swizzles its 8-byte chunks instead (below).
  __shared__ alignas(16) uint8_t tile[kFp8Block][kFp8Block + 8];
  __shared__ float scratch[32];
  const int64_t kb = (k + kFp8Block - 1) / kFp8Block, mb = (m + kFp8Block - 1) / kFp8Block;
  const int64_t bj = blockIdx.x, bi = blockIdx.y, g = blockIdx.z;
  const int64_t r0 = bi * kFp8Block, c0 = bj * kFp8Block;
  const int rn = static_cast<int>(min(int64_t{kFp8Block}, k - r0));
  const int cn = static_cast<int>(min(int64_t{kFp8Block}, m - c0));
  const T* wg = w + g * k * m;
  if (rn == kFp8Block && cn == kFp8Block && k % 8 == 0 && m % 8 == 0) {
    // A whole tile: thread t holds the 8 x 8 piece at rows 8 (t / 16) + [0, 8), columns
    // 8 (t % 16) + [0, 8) in registers (eight 16- or 32-byte loads), so the tile is read once
    // and each thread transposes its own piece. The transposed pieces pass through shared memory
    // as 8-byte chunks, chunk a of column c stored at a ^ (c / 8): byte stores into padded rows
    // hit one bank eight times over, the swizzled chunks no bank twice per half-warp.
    static_assert(kBlock == 16 * 16 && kFp8Block == 16 * 8, "16 x 16 threads of 8 x 8 pieces");
    const int a = threadIdx.x / 16, b = threadIdx.x % 16;
    float v[8][8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      load8(v[i], wg + (r0 + 8 * a + i) * m + c0 + 8 * b);
#pragma unroll
      for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[i][e]));
    }
    amax = block_max(amax, scratch);
    float scale, inverse;
    block_scale(amax, scale, inverse);
    uint32_t rows[8][2];  // row i's 8 bytes
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      rows[i][0] = rows[i][1] = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        rows[i][e / 4] |= uint32_t{to_e4m3(v[i][e] * inverse)} << (8 * (e % 4));
      *reinterpret_cast<uint2*>(q + g * k * m + (r0 + 8 * a + i) * m + c0 + 8 * b) =
          uint2{rows[i][0], rows[i][1]};
    }
    uint8_t(*tile_t)[kFp8Block] = reinterpret_cast<uint8_t(*)[kFp8Block]>(&tile[0][0]);
#pragma unroll
    for (int e = 0; e < 8; ++e) {  // column 8 b + e's 8 bytes along k
      uint2 column{0, 0};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t byte = (rows[i][e / 4] >> (8 * (e % 4))) & 0xffu;
        (i < 4 ? column.x : column.y) |= byte << (8 * (i % 4));
      }
      *reinterpret_cast<uint2*>(&tile_t[8 * b + e][8 * (a ^ b)]) = column;
    }
    __syncthreads();
    // The transposed tile out, 8 bytes a thread along k (chunk j of column c at j ^ (c / 8)).
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int idx = threadIdx.x + kBlock * i, c = idx / 16, j = idx % 16;
      *reinterpret_cast<uint2*>(q_t + g * k * m + (c0 + c) * k + r0 + 8 * j) =
          *reinterpret_cast<const uint2*>(&tile_t[c][8 * (j ^ (c / 8))]);
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
      quantize_rows_wide_kernel<T, kKind>
          <<<grid_for((items + 7) / 8 * 32), kBlock, 0, stream>>>(q, scales, source, g, k);
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
  const char* op = "swiglu_backward_with_value_fp8_";
  const RowGroups g = row_groups(group_sizes, groups, op);
  const int64_t rows = g.start[groups];
  if (rows * f == 0) return;
  if (f % kFp8Block != 0 || !aligned16({h, da}) || reinterpret_cast<uintptr_t>(q) % 8 != 0) {
    swiglu_backward(h, h, da, dt, rows, f, stream, da);
    quantize_rows<RowKind::plain>(q, scales, h, dt, group_sizes, groups, 2 * f, stream, op);
    return;
  }
  dispatch_float(dt, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    swiglu_backward_quantize_kernel<T>
        <<<grid_for((rows * (f / kFp8Block) + 3) / 4 * 32), kBlock, 0, stream>>>(
            static_cast<T*>(h), static_cast<T*>(da), q, scales, g, f);
    CUDA_CHECK_LAUNCH();
  });
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
