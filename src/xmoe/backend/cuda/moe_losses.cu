// Router aux-loss statistics and gradients on the device (moe/losses.h). Every sum runs in a
// fixed order in double: a per-sequence integer histogram (shared-memory atomics on integers),
// one thread per (sequence, expert) column sum, and single-block fixed trees for the totals.
#include "xmoe/backend/cuda/common.cuh"
#include "xmoe/backend/cuda/moe_kernels.h"

namespace xmoe::cuda {

namespace {

constexpr int kStatsThreads = 1024;

// Sum of v over the block (blockDim.x a power of two <= 1024) in a fixed tree; thread 0 gets it.
__device__ double block_sum_fixed(double v, double* scratch) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) scratch[threadIdx.x] += scratch[threadIdx.x + s];
    __syncthreads();
  }
  const double r = scratch[0];
  __syncthreads();
  return r;
}

// log sum exp of a row, as the CPU computes it: float max, double sum of exp(x - max).
__device__ double row_lse(const float* x, int64_t n) {
  float m = x[0];
  for (int64_t j = 1; j < n; ++j) m = fmaxf(m, x[j]);
  double s = 0;
  for (int64_t j = 0; j < n; ++j) s += exp(static_cast<double>(x[j] - m));
  return m + log(s);
}

__global__ void seq_count_kernel(float* seq_count, const int32_t* topk_idx, int64_t seq_len,
                                 int64_t top_k, int64_t experts) {
  extern __shared__ int32_t hist[];
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t s = blockIdx.x, n = seq_len * top_k;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t e = topk_idx[s * n + i];
    if (e >= 0 && e < experts) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x)
    seq_count[s * experts + e] = static_cast<float>(hist[e]);
}

__global__ void seq_psum_kernel(double* seq_psum, const float* probs, int64_t seqs,
                                int64_t seq_len, int64_t experts) {
  XMOE_GRID_STRIDE(i, seqs * experts) {
    const int64_t s = i / experts, e = i % experts;
    double acc = 0;
    for (int64_t t = s * seq_len; t < (s + 1) * seq_len; ++t) acc += probs[t * experts + e];
    seq_psum[i] = acc;
  }
}

// One block: stats[2E + 1] = sum_t lse_t^2.
__global__ void lse_squares_kernel(double* stats, const float* z_logits, int64_t tokens,
                                   int64_t experts) {
  __shared__ double scratch[kStatsThreads];
  double acc = 0;
  for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x) {
    const double lse = row_lse(z_logits + t * experts, experts);
    acc += lse * lse;
  }
  const double total = block_sum_fixed(acc, scratch);
  if (threadIdx.x == 0) stats[2 * experts + 1] = total;
}

// One block: count_e, psum_e (sums over sequences) and the sequence-balance term.
__global__ void totals_kernel(double* stats, const float* seq_count, const double* seq_psum,
                              int64_t seqs, int64_t seq_len, int64_t top_k, int64_t experts) {
  __shared__ double scratch[kStatsThreads];
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    double c = 0, p = 0;
    for (int64_t s = 0; s < seqs; ++s) {
      c += seq_count[s * experts + e];
      p += seq_psum[s * experts + e];
    }
    stats[e] = c;
    stats[experts + e] = p;
  }
  double acc = 0;
  const double E = static_cast<double>(experts), L = static_cast<double>(seq_len);
  for (int64_t i = threadIdx.x; i < seqs * experts; i += blockDim.x)
    acc += E * (seq_count[i] / (L * static_cast<double>(top_k))) * (seq_psum[i] / L);
  const double total = block_sum_fixed(acc, scratch);
  if (threadIdx.x == 0) stats[2 * experts] = total;
}

__global__ void aux_probs_grad_kernel(float* dprobs, const float* frac, const float* seq_count,
                                      int64_t tokens, int64_t experts, int64_t seq_len,
                                      double lb_coef, double seq_coef) {
  XMOE_GRID_STRIDE(i, tokens * experts) {
    const int64_t t = i / experts, e = i % experts;
    float g = dprobs[i];
    if (lb_coef != 0.0) g += static_cast<float>(lb_coef * frac[e]);
    if (seq_coef != 0.0) g += static_cast<float>(seq_coef * seq_count[(t / seq_len) * experts + e]);
    dprobs[i] = g;
  }
}

// One warp per token row: dlogits += z_coef * lse_t * softmax(z_t).
__global__ void aux_z_grad_kernel(float* dlogits, const float* z, int64_t tokens, int64_t experts,
                                  double z_coef) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5); t < tokens;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    const float* row = z + t * experts;
    float m = -INFINITY;
    for (int64_t e = lane; e < experts; e += 32) m = fmaxf(m, row[e]);
    m = warp_max(m);
    double s = 0;
    for (int64_t e = lane; e < experts; e += 32) s += exp(static_cast<double>(row[e] - m));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFullMask, s, o);
    const double lse = m + log(s);
    const double c = z_coef * lse;
    for (int64_t e = lane; e < experts; e += 32)
      dlogits[t * experts + e] += static_cast<float>(c * exp(row[e] - lse));
  }
}

}  // namespace

void moe_aux_stats(double* stats, float* seq_count, double* seq_psum, const float* probs,
                   const int32_t* topk_idx, const float* z_logits, int64_t tokens,
                   int64_t experts, int64_t top_k, int64_t seq_len, Stream stream) {
  if (tokens == 0 || experts == 0) {
    CUDA_CHECK(cudaMemsetAsync(stats, 0, static_cast<size_t>(2 * experts + 2) * sizeof(double),
                               stream));
    return;
  }
  const int64_t seqs = tokens / seq_len;
  const size_t smem = static_cast<size_t>(experts) * sizeof(int32_t);
  if (smem > 48 * 1024) fail("[moe aux losses] more than 12288 experts");
  seq_count_kernel<<<static_cast<unsigned>(seqs), kBlock, smem, stream>>>(seq_count, topk_idx,
                                                                         seq_len, top_k, experts);
  CUDA_CHECK_LAUNCH();
  seq_psum_kernel<<<grid_for(seqs * experts), kBlock, 0, stream>>>(seq_psum, probs, seqs, seq_len,
                                                                   experts);
  CUDA_CHECK_LAUNCH();
  lse_squares_kernel<<<1, kStatsThreads, 0, stream>>>(stats, z_logits, tokens, experts);
  CUDA_CHECK_LAUNCH();
  totals_kernel<<<1, kStatsThreads, 0, stream>>>(stats, seq_count, seq_psum, seqs, seq_len, top_k,
                                                 experts);
  CUDA_CHECK_LAUNCH();
}

void moe_aux_backward(float* dprobs, float* dlogits, const float* z_logits, const float* frac,
                      const float* seq_count, int64_t tokens, int64_t experts, int64_t seq_len,
                      double lb_coef, double seq_coef, double z_coef, Stream stream) {
  if (tokens == 0 || experts == 0) return;
  if (lb_coef != 0.0 || seq_coef != 0.0) {
    aux_probs_grad_kernel<<<grid_for(tokens * experts), kBlock, 0, stream>>>(
        dprobs, frac, seq_count, tokens, experts, seq_len, lb_coef, seq_coef);
    CUDA_CHECK_LAUNCH();
  }
  if (z_coef != 0.0) {
    aux_z_grad_kernel<<<grid_for(tokens, kBlock / 32), kBlock, 0, stream>>>(dlogits, z_logits,
                                                                             tokens, experts, z_coef);
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace xmoe::cuda
