// The order stage's token layout on the device: a stable counting sort of the (token, slot) pairs
// by expert (PFT), or the same with a capacity per expert (padded baseline).
//
// The pairs are cut into fixed chunks of kChunk pairs (the grid depends only on the sizes):
//   1. histogram: one block per chunk counts its pairs per expert (shared-memory integer
//      atomics: the counts do not depend on timing) -> chunk_counts (C, E); a bad expert id
//      records its pair index (atomicMin: the first bad pair).
//   2. scan (one block): load_e = sum_c chunk_counts[c, e]; start_e = exclusive prefix over e
//      (PFT) or 0 (padded); chunk_counts[c, e] becomes start_e + sum_{c' < c} chunk_counts[c', e]:
//      where chunk c's first pair of expert e goes. With fewer than 1024 experts each expert's
//      chunks are cut into slices, one thread each, so the block's threads all walk chunks.
//   3. scatter: one warp per chunk walks its pairs 32 at a time in pair order; lanes with the
//      same expert find each other (__match_any_sync) and take consecutive positions in lane
//      order. Within an expert the rows are therefore in pair order, i.e. (token, slot) order,
//      exactly as the CPU's sequential counting sort.
#include "xmoe/backend/cuda/common.cuh"
#include "xmoe/backend/cuda/moe_kernels.h"

namespace xmoe::cuda {

namespace {

// Pairs per chunk: small enough that the scatter's one warp per chunk fills the GPU (768 warps at
// moe-1b's 98,304 pairs).
constexpr int64_t kChunk = 128;
constexpr int kScanThreads = 1024;

size_t align256(size_t b) {
  return (b + 255) / 256 * 256;
}

__global__ void layout_histogram_kernel(int32_t* chunk_counts, unsigned long long* first_bad,
                                        const int32_t* topk_idx, int64_t pairs, int64_t experts) {
  extern __shared__ int32_t hist[];
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = begin + kChunk < pairs ? begin + kChunk : pairs;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int32_t e = topk_idx[i];
    if (e >= 0 && e < experts) {
      atomicAdd(&hist[e], 1);
    } else {
      atomicMin(first_bad, static_cast<unsigned long long>(i));
    }
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x)
    chunk_counts[blockIdx.x * experts + e] = hist[e];
}

// blockDim.x == kScanThreads. Thread t owns expert t % experts and slice t / experts of its
// chunks (slices = kScanThreads / experts, at least 1); where experts > kScanThreads a thread
// owns every kScanThreads-th expert, all chunks (one slice).
__global__ void __launch_bounds__(kScanThreads)
    layout_scan_kernel(int32_t* chunk_counts, int64_t* load, int64_t* start, int64_t chunks,
                       int64_t experts, bool padded) {
  __shared__ int32_t slice_sum[kScanThreads];  // [slice][expert] while experts < kScanThreads
  const int64_t slices = experts < kScanThreads ? kScanThreads / experts : 1;
  const int64_t per_slice = (chunks + slices - 1) / slices;
  const int64_t t = threadIdx.x;
  const bool sliced = slices > 1;
  // 1. Each slice's count per expert.
  if (sliced && t < slices * experts) {
    const int64_t e = t % experts, s = t / experts;
    const int64_t c1 = (s + 1) * per_slice < chunks ? (s + 1) * per_slice : chunks;
    int32_t total = 0;
    for (int64_t c = s * per_slice; c < c1; ++c) total += chunk_counts[c * experts + e];
    slice_sum[t] = total;
  }
  __syncthreads();
  // 2. Each expert's load.
  for (int64_t e = t; e < experts; e += blockDim.x) {
    int64_t total = 0;
    if (sliced) {
      for (int64_t s = 0; s < slices; ++s) total += slice_sum[s * experts + e];
    } else {
      for (int64_t c = 0; c < chunks; ++c) total += chunk_counts[c * experts + e];
    }
    load[e] = total;
  }
  __syncthreads();
  // 3. Where each expert's rows start.
  if (t == 0) {
    int64_t run = 0;
    for (int64_t e = 0; e < experts; ++e) {
      start[e] = padded ? 0 : run;
      run += load[e];
    }
  }
  __syncthreads();
  // 4. Where each (chunk, expert)'s rows start: each slice from its expert's start plus the
  // slices before it.
  if (sliced) {
    if (t < slices * experts) {
      const int64_t e = t % experts, s = t / experts;
      int64_t run = start[e];
      for (int64_t p = 0; p < s; ++p) run += slice_sum[p * experts + e];
      const int64_t c1 = (s + 1) * per_slice < chunks ? (s + 1) * per_slice : chunks;
      for (int64_t c = s * per_slice; c < c1; ++c) {
        const int32_t n = chunk_counts[c * experts + e];
        chunk_counts[c * experts + e] = static_cast<int32_t>(run);
        run += n;
      }
    }
  } else {
    for (int64_t e = t; e < experts; e += blockDim.x) {
      int64_t run = start[e];
      for (int64_t c = 0; c < chunks; ++c) {
        const int32_t n = chunk_counts[c * experts + e];
        chunk_counts[c * experts + e] = static_cast<int32_t>(run);
        run += n;
      }
    }
  }
}

__global__ void padded_init_kernel(int32_t* token_ids, int32_t* expert_ids, float* combine_weights,
                                   int64_t experts, int64_t capacity) {
  XMOE_GRID_STRIDE(r, experts * capacity) {
    token_ids[r] = -1;
    expert_ids[r] = static_cast<int32_t>(r / capacity);
    combine_weights[r] = 0.f;
  }
}

// One warp per chunk; blockDim.x == 32.
__global__ void layout_scatter_kernel(const int32_t* chunk_offsets, const int32_t* topk_idx,
                                      const float* topk_weight, int64_t pairs, int64_t top_k,
                                      int64_t experts, int64_t capacity, int32_t* token_ids,
                                      int32_t* expert_ids, float* combine_weights,
                                      int32_t* slot_to_row) {
  extern __shared__ int32_t next[];  // (E) next position of each expert in this chunk
  const int lane = threadIdx.x;
  for (int64_t e = lane; e < experts; e += 32) next[e] = chunk_offsets[blockIdx.x * experts + e];
  __syncwarp();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = begin + kChunk < pairs ? begin + kChunk : pairs;
  const unsigned lower = (1u << lane) - 1u;  // lanes below this one
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    const bool in = i < end;
    int32_t e = in ? topk_idx[i] : -1;
    if (e >= experts) e = -1;  // bad ids were recorded by the histogram; they get no row
    const unsigned peers = __match_any_sync(kFullMask, e);
    const int rank = __popc(peers & lower);
    const int32_t pos = e >= 0 ? next[e] + rank : 0;
    __syncwarp();
    if (e >= 0 && rank == 0) next[e] += __popc(peers);
    __syncwarp();
    if (!in) continue;
    int64_t row = -1;
    if (e >= 0) row = capacity > 0 ? (pos < capacity ? e * capacity + pos : -1) : pos;
    slot_to_row[i] = static_cast<int32_t>(row);
    if (row >= 0) {
      token_ids[row] = static_cast<int32_t>(i / top_k);
      expert_ids[row] = e;
      combine_weights[row] = topk_weight[i];
    }
  }
}

struct LayoutWorkspace {
  size_t chunk_counts, start, total;
};

LayoutWorkspace layout_workspace(int64_t pairs, int64_t experts) {
  const int64_t chunks = (pairs + kChunk - 1) / kChunk;
  LayoutWorkspace w{};
  w.chunk_counts = 0;
  w.start = align256(static_cast<size_t>(chunks * experts) * sizeof(int32_t));
  w.total = w.start + align256(static_cast<size_t>(experts) * sizeof(int64_t));
  return w;
}

}  // namespace

size_t moe_layout_workspace_bytes(int64_t pairs, int64_t experts) {
  return layout_workspace(pairs, experts).total;
}

void moe_layout(const int32_t* topk_idx, const float* topk_weight, int64_t pairs, int64_t top_k,
                int64_t experts, int64_t capacity, int32_t* token_ids, int32_t* expert_ids,
                float* combine_weights, int32_t* slot_to_row, int64_t* counts, void* workspace,
                size_t workspace_bytes, Stream stream) {
  if (pairs >= (int64_t{1} << 31) || experts * (capacity > 0 ? capacity : 1) >= (int64_t{1} << 31))
    fail("[moe order] more than 2^31 rows");
  const LayoutWorkspace l = layout_workspace(pairs, experts);
  if (workspace_bytes < l.total) fail("[moe order] layout workspace too small");
  const size_t smem = static_cast<size_t>(experts) * sizeof(int32_t);
  if (smem > 48 * 1024) fail("[moe order] more than 12288 experts");
  char* ws = static_cast<char*>(workspace);
  auto* chunk_counts = reinterpret_cast<int32_t*>(ws + l.chunk_counts);
  auto* start = reinterpret_cast<int64_t*>(ws + l.start);
  CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<size_t>(experts) * sizeof(int64_t), stream));
  // All ones = -1 as int64 ("no bad id"); as unsigned, the identity of atomicMin.
  CUDA_CHECK(cudaMemsetAsync(counts + experts, 0xff, sizeof(int64_t), stream));
  if (capacity > 0) {
    padded_init_kernel<<<grid_for(experts * capacity), kBlock, 0, stream>>>(
        token_ids, expert_ids, combine_weights, experts, capacity);
    CUDA_CHECK_LAUNCH();
  }
  if (pairs == 0 || experts == 0) return;
  const int64_t chunks = (pairs + kChunk - 1) / kChunk;
  layout_histogram_kernel<<<static_cast<unsigned>(chunks), kBlock, smem, stream>>>(
      chunk_counts, reinterpret_cast<unsigned long long*>(counts + experts), topk_idx, pairs,
      experts);
  CUDA_CHECK_LAUNCH();
  layout_scan_kernel<<<1, kScanThreads, 0, stream>>>(chunk_counts, counts, start, chunks, experts,
                                                     capacity > 0);
  CUDA_CHECK_LAUNCH();
  layout_scatter_kernel<<<static_cast<unsigned>(chunks), 32, smem, stream>>>(
      chunk_counts, topk_idx, topk_weight, pairs, top_k, experts, capacity, token_ids, expert_ids,
      combine_weights, slot_to_row);
  CUDA_CHECK_LAUNCH();
}

}  // namespace xmoe::cuda
