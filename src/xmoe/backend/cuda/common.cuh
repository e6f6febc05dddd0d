#pragma once
// Shared device helpers of the kernel files: bf16 <-> f32, warp and block reductions, dtype
// dispatch and grid sizes. Float storage is f32 or bf16; all math is f32.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>

#include "xmoe/backend/cuda/cuda_check.cuh"
#include "xmoe/backend/cuda/kernels.h"
#include "xmoe/core/dtype.h"

namespace xmoe::cuda {

using bf16_t = __nv_bfloat16;

__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(bf16_t x) {
  return __bfloat162float(x);
}

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  return __float2bfloat16_rn(x);  // round to nearest even, like xmoe::bf16 on the host
}

/// SwiGLU's a = silu(g) * u, the one expression every kernel computing it uses (so fused
/// kernels write the bytes of the plain one).
__device__ __forceinline__ float swiglu_value(float g, float u) {
  return g / (1.0f + expf(-g)) * u;
}
/// SwiGLU's gradient: a = silu(g) * u, silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid(g); one
/// expression for every kernel (the fused FP8 quantiser writes the plain backward's bytes).
__device__ __forceinline__ void swiglu_grad(float g, float u, float d, float& dg, float& du) {
  const float s = 1.0f / (1.0f + expf(-g));
  dg = d * u * s * (1.0f + g * (1.0f - s));
  du = d * g * s;
}

constexpr unsigned kFullMask = 0xffffffffu;

/// The sum of every thread's `acc` over the block, in a fixed tree (so its bits do not depend
/// on scheduling), for blocks of `Block` threads; valid in thread 0.
template <int Block>
__device__ __forceinline__ double block_tree_sum(double acc) {
  __shared__ double sh[Block];
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  return sh[0];
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Block-wide sum (blockDim.x a multiple of 32, at most 1024); every thread gets the result, and
// every warp adds the per-warp sums in the same order, so all threads agree bit for bit.
// `scratch` holds 32 floats; the leading __syncthreads lets a caller reuse it back to back.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_sum(lane < warps ? scratch[lane] : 0.f);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_max(lane < warps ? scratch[lane] : -INFINITY);
}

// Eight consecutive values as f32, from 16 (bf16) or 32 (f32) bytes.
__device__ __forceinline__ void load8(float (&v)[8], const bf16_t* p) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = __bfloat1622float2(h[e]);
    v[2 * e] = f.x;
    v[2 * e + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(float (&v)[8], const float* p) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void store8(bf16_t* p, const float (&v)[8]) {
  uint4 u;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
  for (int e = 0; e < 4; ++e) h[e] = __floats2bfloat162_rn(v[2 * e], v[2 * e + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}
__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// Grid-stride loop over [0, n) with 64-bit indices.
#define XMOE_GRID_STRIDE(i, n)                                                           \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

constexpr int kBlock = 256;
// Blocks for a grid-stride loop over n items with `per_block` items per block pass: enough to
// fill an H200 (132 SMs) many times over, never above the grid limit.
inline unsigned grid_for(int64_t n, int64_t per_block = kBlock) {
  const int64_t blocks = (n + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65536 ? 65536 : blocks));
}

// Whether every pointer is 16-byte aligned (null counts as aligned): the condition of the
// kernels that move 16 bytes per access.
inline bool aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

template <class T>
struct Tag {
  using type = T;
};

[[noreturn]] inline void fail_dtype(const char* op, DType dt) {
  char buf[192];
  std::snprintf(buf, sizeof buf, "[%s] dtype %s has no CUDA kernel (expected f32 or bf16)", op,
                dtype_name(dt).data());
  throw_message(buf, __FILE__, __LINE__);
}

[[noreturn]] inline void fail(const char* message) {
  throw_message(message, __FILE__, __LINE__);
}

// f(Tag<float>{}) or f(Tag<bf16_t>{}) by dtype; anything else throws naming `op`.
template <class F>
void dispatch_float(DType dt, const char* op, F&& f) {
  switch (dt) {
    case DType::f32:
      f(Tag<float>{});
      return;
    case DType::bf16:
      f(Tag<bf16_t>{});
      return;
    default:
      fail_dtype(op, dt);
  }
}

}  // namespace xmoe::cuda
