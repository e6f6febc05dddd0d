// Dispatch of the sm90 grouped GEMMs to their instantiations (no CUTLASS headers here).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include "xmoe/backend/cuda/cuda_check.cuh"
#include "xmoe/backend/cuda/sm90/grouped_gemm.h"
#include "xmoe/core/env.h"

namespace xmoe::cuda::sm90 {

int sm_count(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return 0;
  int n = cached[device].load(std::memory_order_relaxed);
  if (n == 0) {
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cached[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

TileOrder tile_order() {
  static const TileOrder order = [] {
    TileOrder o;
    o.raster = env::choice("XMOE_SM90_RASTER") == "n" ? 1 : 0;
    o.swizzle = std::stoi(env::choice("XMOE_SM90_SWIZZLE"));
    return o;
  }();
  return order;
}

bool supported(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // 0 unknown, 1 yes, 2 no
  if (device < 0 || device >= kMaxDevices) return false;
  int state = cached[device].load(std::memory_order_relaxed);
  if (state == 0) {
    int major = 0, minor = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    state = major == 9 && minor == 0 ? 1 : 2;  // sm_90a code runs on 9.0 only
    cached[device].store(state, std::memory_order_relaxed);
  }
  return state == 1;
}

size_t scratch_bytes(GroupedKind kind, const ProblemList& list, float beta) {
  switch (kind) {
    case GroupedKind::forward:
      return detail::forward_scratch_bytes(list);
    case GroupedKind::forward_trans_w:
      return detail::forward_trans_w_scratch_bytes(list);
    case GroupedKind::weight_grad:  // the instantiation run() picks for this beta
      return beta == 0.f ? detail::weight_grad_overwrite_scratch_bytes(list)
                         : detail::weight_grad_scratch_bytes(list);
    case GroupedKind::weight_grad_bf16:
      return beta == 0.f ? detail::weight_grad_bf16_overwrite_scratch_bytes(list)
                         : detail::weight_grad_bf16_scratch_bytes(list);
  }
  return 0;
}

void run(GroupedKind kind, const ProblemList& list, float beta, void* scratch, Stream stream) {
  switch (kind) {
    case GroupedKind::forward:
      return detail::forward_run(list, beta, scratch, stream);
    case GroupedKind::forward_trans_w:
      return detail::forward_trans_w_run(list, beta, scratch, stream);
    case GroupedKind::weight_grad:
      // Overwriting needs no source tile: measured 5% faster than the beta kernel with beta 0.
      if (beta == 0.f) return detail::weight_grad_overwrite_run(list, scratch, stream);
      return detail::weight_grad_run(list, beta, scratch, stream);
    case GroupedKind::weight_grad_bf16:
      if (beta == 0.f) return detail::weight_grad_bf16_overwrite_run(list, scratch, stream);
      return detail::weight_grad_bf16_run(list, beta, scratch, stream);
  }
}

namespace {
/// XMOE_SM90_FP8_TILE's configuration.
const detail::Fp8Kernel& fp8_kernel() {
  static const detail::Fp8Kernel kernel = [] {
    const std::string name = env::choice("XMOE_SM90_FP8_TILE");
    if (name == "128x128") return detail::fp8_kernel_128x128();
    if (name == "128x128-c1x2") return detail::fp8_kernel_128x128_c1x2();
    if (name == "64x128-pp") return detail::fp8_kernel_64x128_pp();
    return detail::fp8_kernel_128x128_c2x1();
  }();
  return kernel;
}
}  // namespace

size_t fp8_scratch_bytes(const ProblemList& list) {
  return fp8_kernel().scratch_bytes(list);
}

void fp8_run(const ProblemList& list, const Fp8Scales& scales, void* scratch, Stream stream) {
  fp8_kernel().run(list, scales, scratch, stream);
}

namespace {

/// Four consecutive elements of f32 or bf16 storage, as f32.
struct Quad {
  float v[4];
};
__device__ __forceinline__ Quad load_quad(const float* p) {
  const float4 q = *reinterpret_cast<const float4*>(p);
  return {{q.x, q.y, q.z, q.w}};
}
__device__ __forceinline__ Quad load_quad(const __nv_bfloat16* p) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
  const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
  return {{a.x, a.y, b.x, b.y}};
}
__device__ __forceinline__ void store_quad(float* p, const Quad& q) {
  *reinterpret_cast<float4*>(p) = make_float4(q.v[0], q.v[1], q.v[2], q.v[3]);
}
__device__ __forceinline__ void store_quad(__nv_bfloat16* p, const Quad& q) {
  uint2 raw;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&raw);
  h[0] = __floats2bfloat162_rn(q.v[0], q.v[1]);
  h[1] = __floats2bfloat162_rn(q.v[2], q.v[3]);
  *reinterpret_cast<uint2*>(p) = raw;
}

/// Block (x, i) adds group i's partials into its dw in f32, four elements at a time (K·M is a
/// multiple of 64).
template <class T>
__global__ void add_partials_kernel(const __grid_constant__ PartialSums s) {
  const int i = static_cast<int>(blockIdx.y);
  const int64_t n = s.k * s.m;
  T* dst = static_cast<T*>(s.dw) + s.group[i] * n;
  const T* src = static_cast<const T*>(s.partials) + int64_t{s.first[i]} * n;
  const int pieces = s.pieces[i];
  for (int64_t e = 4 * (blockIdx.x * int64_t{blockDim.x} + threadIdx.x); e < n;
       e += 4 * int64_t{gridDim.x} * blockDim.x) {
    Quad acc = load_quad(dst + e);
    for (int p = 0; p < pieces; ++p) {
      const Quad v = load_quad(src + p * n + e);
      for (int j = 0; j < 4; ++j) acc.v[j] += v.v[j];
    }
    store_quad(dst + e, acc);
  }
}

}  // namespace

void add_partials(const PartialSums& sums, Stream stream) {
  if (sums.count == 0) return;
  constexpr int kThreads = 256;
  const int64_t n4 = sums.k * sums.m / 4;
  const auto blocks_x =
      static_cast<unsigned>(std::min<int64_t>((n4 + kThreads - 1) / kThreads, 64));
  const dim3 grid(blocks_x, static_cast<unsigned>(sums.count));
  auto* s = static_cast<cudaStream_t>(stream);
  if (sums.bf16) {
    add_partials_kernel<__nv_bfloat16><<<grid, kThreads, 0, s>>>(sums);
  } else {
    add_partials_kernel<float><<<grid, kThreads, 0, s>>>(sums);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace xmoe::cuda::sm90
