// Multi-tensor kernels of the optimizer step. A launch covers up to kMultiTensorMax tensors,
// whose pointers and sizes travel in the kernel's argument block (PyTorch's multi_tensor_apply
// idea): each tensor is cut into chunks of kChunk elements, one block per chunk, and a block
// finds its tensor by binary search over the tensors' first block. f32 storage (gradients,
// copies and AdamW moments may be bf16, a per-tensor flag; the block branches once, outside its
// loop); the AdamW update uses explicit round-to-nearest intrinsics so that nvcc does not fuse
// a*b+c into an FMA, which keeps the CPU's formula and operation order.
#include <vector>

#include "xmoe/backend/cuda/common.cuh"
#include "xmoe/backend/cuda/optim_kernels.h"

namespace xmoe::cuda {

namespace {

constexpr int kOptimBlock = 256;
constexpr int64_t kChunk = kOptimBlock * 16;  // elements per block

// Up to kMultiTensorMax tensors of up to five arrays each (2.5 KB: below the 4 KB argument
// limit of every CUDA version).
struct TensorBatch {
  void* a[kMultiTensorMax];
  void* b[kMultiTensorMax];
  void* c[kMultiTensorMax];
  void* d[kMultiTensorMax];
  void* e[kMultiTensorMax];
  int64_t n[kMultiTensorMax];
  uint8_t flag[kMultiTensorMax];             // kDecay, kABf16, kBBf16, kCDBf16
  int32_t first_block[kMultiTensorMax + 1];  // first_block[count] = blocks of the launch
  int32_t count;
};

constexpr uint8_t kDecay = 1;   // AdamW: apply the weight decay
constexpr uint8_t kABf16 = 2;   // a[] holds bf16 elements
constexpr uint8_t kBBf16 = 4;   // b[] holds bf16 elements
constexpr uint8_t kCDBf16 = 8;  // c[] and d[] hold bf16 elements (AdamW's moments)

int64_t chunks_of(int64_t n) {
  return (n + kChunk - 1) / kChunk;
}

// f(Tag<float>{}) or f(Tag<bf16_t>{}) by a per-tensor bf16 flag (uniform over the block).
template <class F>
__device__ __forceinline__ void by_flag(bool bf16, F&& f) {
  if (bf16)
    f(Tag<bf16_t>{});
  else
    f(Tag<float>{});
}

// Tensor of this block (first_block ascending, first_block[0] = 0) and its element range.
__device__ __forceinline__ int find_tensor(const TensorBatch& t, int block) {
  int lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.first_block[mid] <= block)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Calls launch(batch, blocks, block_offset) for consecutive groups of non-empty tensors;
// fill(batch, slot, i) stores tensor i's pointers in slot `slot`.
template <class Fill, class Launch>
void for_each_batch(const int64_t* sizes, int64_t count, Fill&& fill, Launch&& launch) {
  TensorBatch batch{};
  int64_t blocks = 0, offset = 0;
  auto flush = [&] {
    if (batch.count == 0) return;
    batch.first_block[batch.count] = static_cast<int32_t>(blocks);
    launch(batch, blocks, offset);
    offset += blocks;
    batch = TensorBatch{};
    blocks = 0;
  };
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = sizes[i];
    if (n <= 0) continue;
    // Keep a launch's grid far below the 2^31 limit of int32 block indices.
    if (batch.count == kMultiTensorMax || blocks + chunks_of(n) > (int64_t{1} << 30)) flush();
    const int slot = batch.count++;
    batch.n[slot] = n;
    batch.first_block[slot] = static_cast<int32_t>(blocks);
    fill(batch, slot, i);
    blocks += chunks_of(n);
  }
  flush();
}

// Four consecutive elements (16-byte f32 or 8-byte bf16 accesses).
__device__ __forceinline__ void load4(float (&v)[4], const float* p) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
}
__device__ __forceinline__ void load4(float (&v)[4], const bf16_t* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&u);
  const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}
__device__ __forceinline__ void store4(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store4(bf16_t* p, const float (&v)[4]) {
  uint2 u;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&u);
  h[0] = __floats2bfloat162_rn(v[0], v[1]);
  h[1] = __floats2bfloat162_rn(v[2], v[3]);
  *reinterpret_cast<uint2*>(p) = u;
}

// One element's AdamW update: p, m, v in and out (m and v unrounded: the caller stores them in
// the moments' dtype and the update uses them as computed, as the CPU).
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g,
                                              const AdamWScalars& s, float decay) {
  const float gj = __fmul_rn(g, s.grad_scale);
  m = __fadd_rn(__fmul_rn(s.beta1, m), __fmul_rn(s.one_minus_beta1, gj));
  v = __fadd_rn(__fmul_rn(s.beta2, v), __fmul_rn(__fmul_rn(s.one_minus_beta2, gj), gj));
  const float mhat = __fdiv_rn(m, s.bc1), vhat = __fdiv_rn(v, s.bc2);
  const float step = __fdiv_rn(__fmul_rn(s.lr, mhat), __fadd_rn(__fsqrt_rn(vhat), s.eps));
  p = __fsub_rn(__fmul_rn(p, decay), step);
}

__device__ __forceinline__ bool aligned_to(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

__global__ void __launch_bounds__(kOptimBlock) adamw_kernel(TensorBatch t, AdamWScalars s) {
  const int ti = find_tensor(t, blockIdx.x);
  const int64_t n = t.n[ti];
  const int64_t begin = (blockIdx.x - t.first_block[ti]) * kChunk;
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  float* p = static_cast<float*>(t.a[ti]);
  bf16_t* copy = static_cast<bf16_t*>(t.e[ti]);
  const float decay = t.flag[ti] & kDecay ? s.decay : 1.0f;
  by_flag(t.flag[ti] & kBBf16, [&](auto grad_tag) {
    by_flag(t.flag[ti] & kCDBf16, [&](auto moment_tag) {
      using G = typename decltype(grad_tag)::type;
      using M = typename decltype(moment_tag)::type;
      const G* g = static_cast<const G*>(t.b[ti]);
      M* m = static_cast<M*>(t.c[ti]);
      M* v = static_cast<M*>(t.d[ti]);
      // Four elements per thread and access where every array allows it (begin is a multiple
      // of kChunk): more bytes in flight for the same per-element arithmetic.
      int64_t j = begin + threadIdx.x;
      if (aligned_to(p + begin, 16) && aligned_to(g + begin, 4 * sizeof(G)) &&
          aligned_to(m + begin, 4 * sizeof(M)) && aligned_to(v + begin, 4 * sizeof(M)) &&
          (!copy || aligned_to(copy + begin, 8))) {
        for (j = begin + 4 * threadIdx.x; j + 4 <= end; j += 4 * blockDim.x) {
          float pv[4], gv[4], mv[4], vv[4];
          load4(pv, p + j);
          load4(gv, g + j);
          load4(mv, m + j);
          load4(vv, v + j);
#pragma unroll
          for (int e = 0; e < 4; ++e) adamw_element(pv[e], mv[e], vv[e], gv[e], s, decay);
          // bf16 moments: stored rounded to nearest even, used unrounded above (as the CPU).
          store4(m + j, mv);
          store4(v + j, vv);
          store4(p + j, pv);
          if (copy) store4(copy + j, pv);
        }
        // The tail (fewer than 4 * blockDim.x elements), one element per thread.
        j = begin + ((end - begin) / 4) * 4 + threadIdx.x;
      }
      for (; j < end; j += blockDim.x) {
        float pj = p[j], mj = to_float(m[j]), vj = to_float(v[j]);
        adamw_element(pj, mj, vj, to_float(g[j]), s, decay);
        m[j] = from_float<M>(mj);
        v[j] = from_float<M>(vj);
        p[j] = pj;
        if (copy) copy[j] = from_float<bf16_t>(pj);
      }
    });
  });
}

// Tree sum of sh[0 .. blockDim.x) (a power of two) into sh[0].
__global__ void __launch_bounds__(kOptimBlock)
    sum_squares_partial_kernel(TensorBatch t, double* partial) {
  const int ti = find_tensor(t, blockIdx.x);
  const int64_t n = t.n[ti];
  const int64_t begin = (blockIdx.x - t.first_block[ti]) * kChunk;
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  double acc = 0.0;
  by_flag(t.flag[ti] & kABf16, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(t.a[ti]);
    for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
      const double xj = to_float(x[j]);
      acc += xj * xj;
    }
  });
  const double sum = block_tree_sum<kOptimBlock>(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// Block b sums partial[b * kSumSpan, (b + 1) * kSumSpan) into out[b]; run until one value is
// left (a single block over all of moe-1b's 237k partials took 0.35 ms, a chain of 927 dependent
// loads per thread). A fixed tree: the same bits every run.
constexpr int64_t kSumSpan = kOptimBlock * 16;

__global__ void __launch_bounds__(kOptimBlock)
    sum_partials_kernel(double* out, const double* partial, int64_t count) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kSumSpan;
  const int64_t end = begin + kSumSpan < count ? begin + kSumSpan : count;
  double acc = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) acc += partial[i];
  const double sum = block_tree_sum<kOptimBlock>(acc);
  if (threadIdx.x == 0) out[blockIdx.x] = sum;
}

// a[j] = b[j] * s (b = a for scaling in place), each f32 or bf16
__global__ void __launch_bounds__(kOptimBlock) copy_scaled_kernel(TensorBatch t, float s) {
  const int ti = find_tensor(t, blockIdx.x);
  const int64_t n = t.n[ti];
  const int64_t begin = (blockIdx.x - t.first_block[ti]) * kChunk;
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  by_flag(t.flag[ti] & kABf16, [&](auto dst_tag) {
    by_flag(t.flag[ti] & kBBf16, [&](auto src_tag) {
      using D = typename decltype(dst_tag)::type;
      using S = typename decltype(src_tag)::type;
      D* dst = static_cast<D*>(t.a[ti]);
      const S* src = static_cast<const S*>(t.b[ti]);
      for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x)
        dst[j] = from_float<D>(__fmul_rn(to_float(src[j]), s));
    });
  });
}

std::vector<int64_t> sizes_of(const FloatArray* xs, int64_t count) {
  std::vector<int64_t> sizes(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) sizes[static_cast<size_t>(i)] = xs[i].n;
  return sizes;
}

uint8_t bf16_flags(const FloatArray& a, const FloatArray& b) {
  return static_cast<uint8_t>((a.bf16 ? kABf16 : 0) | (b.bf16 ? kBBf16 : 0));
}

}  // namespace

void adamw_step(const AdamWTensor* tensors, int64_t count, const AdamWScalars& s, Stream stream) {
  std::vector<int64_t> sizes(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) sizes[static_cast<size_t>(i)] = tensors[i].n;
  for_each_batch(
      sizes.data(), count,
      [&](TensorBatch& b, int slot, int64_t i) {
        const AdamWTensor& t = tensors[i];
        b.a[slot] = t.param;
        b.b[slot] = const_cast<void*>(t.grad);
        b.c[slot] = t.m;
        b.d[slot] = t.v;
        b.e[slot] = t.param_bf16;
        b.flag[slot] = static_cast<uint8_t>((t.decay ? kDecay : 0) | (t.grad_bf16 ? kBBf16 : 0) |
                                            (t.moments_bf16 ? kCDBf16 : 0));
      },
      [&](const TensorBatch& b, int64_t blocks, int64_t) {
        adamw_kernel<<<static_cast<unsigned>(blocks), kOptimBlock, 0, stream>>>(b, s);
        CUDA_CHECK_LAUNCH();
      });
}

size_t multi_sum_squares_workspace_bytes(const FloatArray* xs, int64_t count) {
  int64_t blocks = 0;
  for (int64_t i = 0; i < count; ++i)
    if (xs[i].n > 0) blocks += chunks_of(xs[i].n);
  // the partials, then each level of sum_partials_kernel's sums
  int64_t total = blocks > 0 ? blocks : 1;
  for (int64_t level = total; level > kSumSpan; total += level)
    level = (level + kSumSpan - 1) / kSumSpan;
  return static_cast<size_t>(total) * sizeof(double);
}

void multi_sum_squares(double* result, const FloatArray* xs, int64_t count, void* workspace,
                       Stream stream) {
  auto* partial = static_cast<double*>(workspace);
  int64_t total = 0;
  const std::vector<int64_t> sizes = sizes_of(xs, count);
  for_each_batch(
      sizes.data(), count,
      [&](TensorBatch& b, int slot, int64_t i) {
        b.a[slot] = xs[i].data;
        b.flag[slot] = bf16_flags(xs[i], FloatArray{});
      },
      [&](const TensorBatch& b, int64_t blocks, int64_t offset) {
        sum_squares_partial_kernel<<<static_cast<unsigned>(blocks), kOptimBlock, 0, stream>>>(
            b, partial + offset);
        CUDA_CHECK_LAUNCH();
        total = offset + blocks;
      });
  // Levels of kSumSpan-wide sums, each written after the one it reads, down to the result.
  for (double* level = partial;;) {
    const int64_t sums = total > kSumSpan ? (total + kSumSpan - 1) / kSumSpan : 1;
    double* out = sums == 1 ? result : level + total;
    sum_partials_kernel<<<static_cast<unsigned>(sums), kOptimBlock, 0, stream>>>(out, level, total);
    CUDA_CHECK_LAUNCH();
    if (sums == 1) break;
    level = out;
    total = sums;
  }
}

void multi_scale(const FloatArray* xs, int64_t count, float s, Stream stream) {
  multi_copy_scaled(xs, xs, count, s, stream);
}

void multi_copy_scaled(const FloatArray* dst, const FloatArray* src, int64_t count, float s,
                       Stream stream) {
  const std::vector<int64_t> sizes = sizes_of(dst, count);
  for (int64_t i = 0; i < count; ++i)
    if (src[i].n != dst[i].n) fail("[multi_copy_scaled] a source and its destination differ in n");
  for_each_batch(
      sizes.data(), count,
      [&](TensorBatch& b, int slot, int64_t i) {
        b.a[slot] = dst[i].data;
        b.b[slot] = src[i].data;
        b.flag[slot] = bf16_flags(dst[i], src[i]);
      },
      [&](const TensorBatch& b, int64_t blocks, int64_t) {
        copy_scaled_kernel<<<static_cast<unsigned>(blocks), kOptimBlock, 0, stream>>>(b, s);
        CUDA_CHECK_LAUNCH();
      });
}

}  // namespace xmoe::cuda
