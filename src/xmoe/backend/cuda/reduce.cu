// Reductions to one value (sum, sum of squares, non-finite count) and per-row dot products.
// Deterministic: the grid size depends only on n, every block sums a fixed set of elements in a
// fixed order (double), and one block adds the per-block partials in a fixed tree.
#include "xmoe/backend/cuda/common.cuh"

namespace xmoe::cuda {

namespace {

constexpr int kReduceBlock = 256;
constexpr int kReduceMaxBlocks = 1024;

int reduce_blocks(int64_t n) {
  const int64_t per_block = kReduceBlock * 8;  // ~8 elements per thread before the tree
  const int64_t b = (n + per_block - 1) / per_block;
  return static_cast<int>(b < 1 ? 1 : (b > kReduceMaxBlocks ? kReduceMaxBlocks : b));
}

// Tree sum of sh[0 .. blockDim.x) (a power of two) into sh[0].
template <class T>
__global__ void __launch_bounds__(kReduceBlock)
    reduce_partial_kernel(double* partial, const T* x, int64_t n, Reduction kind) {
  double acc = 0.0;
  XMOE_GRID_STRIDE(i, n) {
    const float v = to_float(x[i]);
    if (kind == Reduction::sum)
      acc += v;
    else if (kind == Reduction::sum_squares)
      acc += static_cast<double>(v) * v;
    else
      acc += isfinite(v) ? 0.0 : 1.0;
  }
  const double sum = block_tree_sum<kReduceBlock>(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

__global__ void __launch_bounds__(kReduceBlock)
    reduce_final_kernel(double* result, const double* partial, int count) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
  const double sum = block_tree_sum<kReduceBlock>(acc);
  if (threadIdx.x == 0) *result = sum;
}

// One warp per row: lanes stride over the columns, then a fixed butterfly.
template <class T>
__global__ void row_dot_kernel(T* out, const T* a, const T* b, int64_t rows, int64_t d) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       r < rows; r += warps) {
    float s = 0.f;
    for (int64_t j = lane; j < d; j += 32) s += to_float(a[r * d + j]) * to_float(b[r * d + j]);
    s = warp_sum(s);
    if (lane == 0) out[r] = from_float<T>(s);
  }
}

}  // namespace

size_t reduce_workspace_bytes(int64_t n) {
  return static_cast<size_t>(reduce_blocks(n)) * sizeof(double);
}

void reduce(double* result, const void* x, DType dt, int64_t n, Reduction kind, void* workspace,
            Stream stream) {
  const int blocks = reduce_blocks(n);
  auto* partial = static_cast<double*>(workspace);
  dispatch_float(dt, "reduce", [&](auto tag) {
    using T = typename decltype(tag)::type;
    reduce_partial_kernel<T>
        <<<blocks, kReduceBlock, 0, stream>>>(partial, static_cast<const T*>(x), n, kind);
    CUDA_CHECK_LAUNCH();
  });
  reduce_final_kernel<<<1, kReduceBlock, 0, stream>>>(result, partial, blocks);
  CUDA_CHECK_LAUNCH();
}

void row_dot(void* out, const void* a, const void* b, DType dt, int64_t rows, int64_t d,
             Stream stream) {
  if (rows == 0) return;
  dispatch_float(dt, "row_dot", [&](auto tag) {
    using T = typename decltype(tag)::type;
    row_dot_kernel<T><<<grid_for(rows, kBlock / 32), kBlock, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), rows, d);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace xmoe::cuda
