// Multi-tensor kernels of the optimizer step. A launch covers up to kMultiTensorMax tensors,
// whose pointers and sizes travel in the kernel's argument block (PyTorch's multi_tensor_apply
// idea): each tensor is cut into chunks of kChunk elements, one block per chunk, and a block
// finds its tensor by binary search over the tensors' first block. f32 storage; the AdamW
// update uses explicit round-to-nearest intrinsics so that nvcc does not fuse a*b+c into an
// FMA, which keeps the CPU's formula and operation order.
#include "xmoe/backend/cuda/common.cuh"
#include "xmoe/backend/cuda/optim_kernels.h"

#include <vector>

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
  uint8_t flag[kMultiTensorMax];
  int32_t first_block[kMultiTensorMax + 1];  // first_block[count] = blocks of the launch
  int32_t count;
};

int64_t chunks_of(int64_t n) { return (n + kChunk - 1) / kChunk; }

// Tensor of this block (first_block ascending, first_block[0] = 0) and its element range.
__device__ __forceinline__ int find_tensor(const TensorBatch& t, int block) {
  int lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.first_block[mid] <= block) lo = mid;
    else hi = mid - 1;
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

__global__ void __launch_bounds__(kOptimBlock)
    adamw_kernel(TensorBatch t, AdamWScalars s) {
  const int ti = find_tensor(t, blockIdx.x);
  const int64_t n = t.n[ti];
  const int64_t begin = (blockIdx.x - t.first_block[ti]) * kChunk;
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  float* p = static_cast<float*>(t.a[ti]);
  const float* g = static_cast<const float*>(t.b[ti]);
  float* m = static_cast<float*>(t.c[ti]);
  float* v = static_cast<float*>(t.d[ti]);
  bf16_t* copy = static_cast<bf16_t*>(t.e[ti]);
  const float decay = t.flag[ti] ? s.decay : 1.0f;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const float gj = __fmul_rn(g[j], s.grad_scale);
    const float mj = __fadd_rn(__fmul_rn(s.beta1, m[j]), __fmul_rn(s.one_minus_beta1, gj));
    const float vj =
        __fadd_rn(__fmul_rn(s.beta2, v[j]), __fmul_rn(__fmul_rn(s.one_minus_beta2, gj), gj));
    m[j] = mj;
    v[j] = vj;
    const float mhat = __fdiv_rn(mj, s.bc1), vhat = __fdiv_rn(vj, s.bc2);
    const float step = __fdiv_rn(__fmul_rn(s.lr, mhat), __fadd_rn(__fsqrt_rn(vhat), s.eps));
    const float w = __fsub_rn(__fmul_rn(p[j], decay), step);
    p[j] = w;
    if (copy) copy[j] = from_float<bf16_t>(w);
  }
}

// Tree sum of sh[0 .. blockDim.x) (a power of two) into sh[0].
__device__ __forceinline__ void tree_sum(double* sh) {
  for (int st = blockDim.x / 2; st > 0; st >>= 1) {
    if (threadIdx.x < st) sh[threadIdx.x] += sh[threadIdx.x + st];
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kOptimBlock)
    sum_squares_partial_kernel(TensorBatch t, double* partial) {
  __shared__ double sh[kOptimBlock];
  const int ti = find_tensor(t, blockIdx.x);
  const int64_t n = t.n[ti];
  const int64_t begin = (blockIdx.x - t.first_block[ti]) * kChunk;
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  const float* x = static_cast<const float*>(t.a[ti]);
  double acc = 0.0;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const double xj = x[j];
    acc += xj * xj;
  }
  sh[threadIdx.x] = acc;
  __syncthreads();
  tree_sum(sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

__global__ void __launch_bounds__(kOptimBlock)
    sum_partials_kernel(double* result, const double* partial, int64_t count) {
  __shared__ double sh[kOptimBlock];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
  sh[threadIdx.x] = acc;
  __syncthreads();
  tree_sum(sh);
  if (threadIdx.x == 0) *result = sh[0];
}

// a[j] = b[j] * s (b = a for scaling in place)
__global__ void __launch_bounds__(kOptimBlock) copy_scaled_kernel(TensorBatch t, float s) {
  const int ti = find_tensor(t, blockIdx.x);
  const int64_t n = t.n[ti];
  const int64_t begin = (blockIdx.x - t.first_block[ti]) * kChunk;
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  float* dst = static_cast<float*>(t.a[ti]);
  const float* src = static_cast<const float*>(t.b[ti]);
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) dst[j] = __fmul_rn(src[j], s);
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
        b.b[slot] = const_cast<float*>(t.grad);
        b.c[slot] = t.m;
        b.d[slot] = t.v;
        b.e[slot] = t.param_bf16;
        b.flag[slot] = t.decay ? 1 : 0;
      },
      [&](const TensorBatch& b, int64_t blocks, int64_t) {
        adamw_kernel<<<static_cast<unsigned>(blocks), kOptimBlock, 0, stream>>>(b, s);
        CUDA_CHECK_LAUNCH();
      });
}

size_t multi_sum_squares_workspace_bytes(const int64_t* sizes, int64_t count) {
  int64_t blocks = 0;
  for (int64_t i = 0; i < count; ++i)
    if (sizes[i] > 0) blocks += chunks_of(sizes[i]);
  return static_cast<size_t>(blocks > 0 ? blocks : 1) * sizeof(double);
}

void multi_sum_squares(double* result, const float* const* xs, const int64_t* sizes,
                       int64_t count, void* workspace, Stream stream) {
  auto* partial = static_cast<double*>(workspace);
  int64_t total = 0;
  for_each_batch(
      sizes, count,
      [&](TensorBatch& b, int slot, int64_t i) { b.a[slot] = const_cast<float*>(xs[i]); },
      [&](const TensorBatch& b, int64_t blocks, int64_t offset) {
        sum_squares_partial_kernel<<<static_cast<unsigned>(blocks), kOptimBlock, 0, stream>>>(
            b, partial + offset);
        CUDA_CHECK_LAUNCH();
        total = offset + blocks;
      });
  sum_partials_kernel<<<1, kOptimBlock, 0, stream>>>(result, partial, total);
  CUDA_CHECK_LAUNCH();
}

void multi_scale(float* const* xs, const int64_t* sizes, int64_t count, float s, Stream stream) {
  for_each_batch(
      sizes, count,
      [&](TensorBatch& b, int slot, int64_t i) { b.a[slot] = b.b[slot] = xs[i]; },
      [&](const TensorBatch& b, int64_t blocks, int64_t) {
        copy_scaled_kernel<<<static_cast<unsigned>(blocks), kOptimBlock, 0, stream>>>(b, s);
        CUDA_CHECK_LAUNCH();
      });
}

void multi_copy_scaled(float* const* dst, const float* const* src, const int64_t* sizes,
                       int64_t count, float s, Stream stream) {
  for_each_batch(
      sizes, count,
      [&](TensorBatch& b, int slot, int64_t i) {
        b.a[slot] = dst[i];
        b.b[slot] = const_cast<float*>(src[i]);
      },
      [&](const TensorBatch& b, int64_t blocks, int64_t) {
        copy_scaled_kernel<<<static_cast<unsigned>(blocks), kOptimBlock, 0, stream>>>(b, s);
        CUDA_CHECK_LAUNCH();
      });
}

}  // namespace xmoe::cuda
