#pragma once
// Grouped GEMMs of the expert layers on Hopper: CUTLASS 3 ptr-array kernels (TMA loads,
// warp-specialised cooperative consumers, a persistent scheduler over every group's tiles).
// One launch covers every non-empty group, whatever the routing: no padding, no per-group
// launches. The per-group problem shapes, pointers and strides are written on the device by a
// small kernel from a ProblemList passed by value (no host-to-device copy, no host wait).
// Plain header: blas.cpp (C++ compiler) calls it; a build without CUTLASS links unavailable.cpp.
#include <cstddef>
#include <cstdint>

#include "xmoe/backend/cuda/runtime.h"

namespace xmoe::cuda::sm90 {

enum class GroupedKind : uint8_t {
  forward,           // y_g (rows, M) bf16 = x_g (rows, K) @ w_g (K, M)
  forward_trans_w,   // y_g (rows, M) bf16 = x_g (rows, K) @ w_g^T, w_g (M, K)
  weight_grad,       // dw_g (K, M) f32 = x_g^T (K, rows) @ dy_g (rows, M) (+ beta dw_g)
  weight_grad_bf16,  // the same into bf16 dw (f32 accumulation, one rounding on the store)
};

/// Most non-empty groups one launch takes (the list travels as kernel parameters, 32 KB max).
constexpr int kMaxProblems = 1024;

/// The problems of one call, one per non-empty group, or (weight_grad) per piece of a group
/// whose rows were cut up. Problem i covers rows [row_start, row_start + rows) of the packed
/// activations; `group` indexes the weights. Bases are bf16 (x, w, dy) and bf16 or f32 (out);
/// partials have out's dtype.
struct ProblemList {
  int count = 0;
  int64_t k = 0, m = 0;  // the layer's K and M
  const void* x = nullptr;
  const void* w_or_dy = nullptr;  // w (forward) or dy (weight_grad)
  void* out = nullptr;            // y (forward) or dw (weight_grad)
  void* partials = nullptr;       // weight_grad: [pieces, K, M] (see PartialSums)
  int32_t group[kMaxProblems];
  int32_t rows[kMaxProblems];
  int32_t row_start[kMaxProblems];
  int32_t partial[kMaxProblems];  // weight_grad: -1 writes dw[group], p >= 0 partials[p]
};

/// Weight gradients of groups cut into pieces: the first piece writes dw[group] (with beta),
/// the others partials [first, first + pieces), which add_partials then adds into dw[group]
/// (in f32; bf16 dw and partials are rounded once more there).
struct PartialSums {
  int count = 0;
  int64_t k = 0, m = 0;
  bool bf16 = false;  // dw and partials are bf16 (weight_grad_bf16), else f32
  void* dw = nullptr;
  const void* partials = nullptr;
  int32_t group[kMaxProblems];
  int32_t first[kMaxProblems];
  int32_t pieces[kMaxProblems];
};

/// Multiprocessors of `device` (cached; 0 for an index past 64).
int sm_count(int device);
/// How the persistent scheduler walks each group's output tiles: raster 0 along M (the
/// default: consecutive tiles share a column of B), 1 along N; swizzle 1, 2, 4 or 8 (strips of
/// that many tiles across the raster). XMOE_SM90_RASTER = m | n and XMOE_SM90_SWIZZLE = 1..8
/// override them (read once).
struct TileOrder {
  int raster = 0;
  int swizzle = 1;
};
TileOrder tile_order();
/// True when `device` is an sm90 GPU and this build has the kernels.
bool supported(int device);
/// Device bytes `run(kind, list, beta, ...)` needs (per-group arrays and CUTLASS' workspace),
/// or 0 where the kernel cannot take the list (alignment, sizes): the caller then uses cuBLAS.
size_t scratch_bytes(GroupedKind kind, const ProblemList& list, float beta);
/// Queues the grouped GEMM on `stream`. `scratch` holds scratch_bytes(kind, list) bytes and may
/// be reused once `stream` has passed this call. beta scales the existing output (weight_grad
/// accumulation); forward kinds ignore it.
void run(GroupedKind kind, const ProblemList& list, float beta, void* scratch, Stream stream);
/// dw[group[i]] += partials[first[i] + p] for p < pieces[i], in order (deterministic).
void add_partials(const PartialSums& sums, Stream stream);

/// FP8 (model.moe.expert_dtype = fp8): y_g (rows, N) bf16 = x_g (rows, K) @ w_g^T, x and w e4m3
/// bytes, w_g stored [N, K] (list.m is N). Scales (f32) per 1 x 128 of x, grouped like
/// cpu::quantize_rows_fp8 writes them (group g's [ceil(K/128), rows_g] from row_start *
/// ceil(K/128)), and per 128 x 128 of w: [G, ceil(K/128), ceil(N/128)]. Problems are per group
/// (row_start, rows, group); `partial` is unused.
constexpr int kFp8Block = 128;
struct Fp8Scales {
  const void* x = nullptr;
  const void* w = nullptr;
};
/// As scratch_bytes, for the FP8 kernel (0: it cannot take the list). The kernel's
/// configuration is XMOE_SM90_FP8_TILE's (read once): 128 x 128 x 128 tiles of two consumer
/// warpgroups on 2 x 1 clusters (the default: fastest on an H100 at every measured shape), the
/// same on one SM or on 1 x 2 clusters, or ping-pong warpgroups of 64 x 128 tiles each.
size_t fp8_scratch_bytes(const ProblemList& list);
void fp8_run(const ProblemList& list, const Fp8Scales& scales, void* scratch, Stream stream);

namespace detail {  // one instantiation per kind, each in grouped_gemm_<kind>.cu
size_t forward_scratch_bytes(const ProblemList& list);
void forward_run(const ProblemList& list, float beta, void* scratch, Stream stream);
size_t forward_trans_w_scratch_bytes(const ProblemList& list);
void forward_trans_w_run(const ProblemList& list, float beta, void* scratch, Stream stream);
size_t weight_grad_scratch_bytes(const ProblemList& list);
void weight_grad_run(const ProblemList& list, float beta, void* scratch, Stream stream);
size_t weight_grad_overwrite_scratch_bytes(const ProblemList& list);
void weight_grad_overwrite_run(const ProblemList& list, void* scratch, Stream stream);
size_t weight_grad_bf16_scratch_bytes(const ProblemList& list);
void weight_grad_bf16_run(const ProblemList& list, float beta, void* scratch, Stream stream);
size_t weight_grad_bf16_overwrite_scratch_bytes(const ProblemList& list);
void weight_grad_bf16_overwrite_run(const ProblemList& list, void* scratch, Stream stream);
/// One FP8 kernel configuration's fp8_scratch_bytes and fp8_run; one per configuration, each
/// in grouped_gemm_fp8_<configuration>.cu.
struct Fp8Kernel {
  size_t (*scratch_bytes)(const ProblemList& list);
  void (*run)(const ProblemList& list, const Fp8Scales& scales, void* scratch, Stream stream);
};
Fp8Kernel fp8_kernel_128x128();
Fp8Kernel fp8_kernel_128x128_c2x1();
Fp8Kernel fp8_kernel_128x128_c1x2();
Fp8Kernel fp8_kernel_64x128_pp();
}  // namespace detail

}  // namespace xmoe::cuda::sm90
