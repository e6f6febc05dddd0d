// Router aux-loss statistics and gradients on the device (moe/losses.h). Every sum runs in a
// fixed order in double: a per-sequence integer histogram (shared-memory atomics on integers),
// per-chunk column sums combined in chunk order, per-block partials with one fixed final tree.
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

// log sum exp of one row by a warp (every lane gets it): float max, double sum of exp(x - max),
// as the CPU computes it.
__device__ double warp_row_lse(const float* row, int64_t experts, int lane) {
  float m = -INFINITY;
  for (int64_t e = lane; e < experts; e += 32) m = fmaxf(m, row[e]);
  m = warp_max(m);
  double s = 0;
  for (int64_t e = lane; e < experts; e += 32) s += exp(static_cast<double>(row[e] - m));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFullMask, s, o);
  return m + log(s);
}

// Block s * pieces + p counts piece p (kCountPiece choices) of sequence s's choices and adds its
// counts into seq_count (zeroed first): float adds of whole numbers below 2^24 are exact, so the
// sums do not depend on the order the blocks add in.
constexpr int64_t kCountPiece = 1024;

__global__ void seq_count_kernel(float* seq_count, const int32_t* topk_idx, int64_t seq_len,
                                 int64_t top_k, int64_t experts) {
  extern __shared__ int32_t hist[];
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t n = seq_len * top_k, pieces = (n + kCountPiece - 1) / kCountPiece;
  const int64_t s = blockIdx.x / pieces;
  const int64_t begin = (blockIdx.x - s * pieces) * kCountPiece;
  const int64_t end = begin + kCountPiece < n ? begin + kCountPiece : n;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int32_t e = topk_idx[s * n + i];
    if (e >= 0 && e < experts) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x)
    if (hist[e] != 0) atomicAdd(&seq_count[s * experts + e], static_cast<float>(hist[e]));
}

// Sequences are summed in chunks of kChunk tokens, all in parallel (one thread per (sequence,
// chunk, expert)), then the chunks in order: a fixed order, and no thread walks a whole
// sequence alone (8 sequences x 64 experts would leave the GPU idle for 2048 dependent adds).
constexpr int64_t kChunk = 64;
constexpr int kLseBlocks = 264;  // 2 per SM of an H200; fixed, so the sum order is too

int64_t chunks_of(int64_t seq_len) {
  return (seq_len + kChunk - 1) / kChunk;
}

// acc + v[first] + v[first + stride] + ... (count terms, in that order), the loads issued kBatch
// at a time ahead of their adds: these short sums were a chain of dependent loads.
template <int kBatch, class T>
__device__ __forceinline__ double add_strided(double acc, const T* v, int64_t count,
                                              int64_t stride) {
  int64_t i = 0;
  for (; i + kBatch <= count; i += kBatch) {
    T b[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) b[u] = v[(i + u) * stride];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) acc += b[u];
  }
  for (; i < count; ++i) acc += v[i * stride];
  return acc;
}

__global__ void chunk_psum_kernel(double* partial, const float* probs, int64_t seqs,
                                  int64_t seq_len, int64_t experts) {
  const int64_t chunks = (seq_len + kChunk - 1) / kChunk;
  XMOE_GRID_STRIDE(i, seqs * chunks * experts) {
    const int64_t e = i % experts, sc = i / experts, s = sc / chunks, c = sc % chunks;
    const int64_t t0 = s * seq_len + c * kChunk;
    const int64_t t1 = s * seq_len + min(seq_len, (c + 1) * kChunk);
    partial[i] = add_strided<16>(0.0, probs + t0 * experts + e, t1 - t0, experts);
  }
}

__global__ void seq_psum_kernel(double* seq_psum, const double* partial, int64_t seqs,
                                int64_t chunks, int64_t experts) {
  XMOE_GRID_STRIDE(i, seqs * experts) {
    const int64_t s = i / experts, e = i % experts;
    seq_psum[i] = add_strided<8>(0.0, partial + s * chunks * experts + e, chunks, experts);
  }
}

// Per-block partial sums of lse_t^2 (one warp per token row, kLseBlocks blocks of kLseThreads:
// two rows a warp at moe-1b's 16384 tokens; float max and double sum of exp, as the CPU), then
// one block adds the partials into stats[2E + 1].
constexpr int kLseThreads = 1024;

__global__ void __launch_bounds__(kLseThreads)
    lse_squares_partial_kernel(double* partial, const float* z, int64_t tokens, int64_t experts) {
  __shared__ double scratch[kLseThreads];
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  double acc = 0;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5); t < tokens;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    const float* row = z + t * experts;
    const double lse = warp_row_lse(row, experts, lane);
    if (lane == 0) acc += lse * lse;
  }
  const double total = block_sum_fixed(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

__global__ void lse_squares_total_kernel(double* stats, const double* partial, int64_t experts) {
  __shared__ double scratch[512];
  const double v = threadIdx.x < kLseBlocks ? partial[threadIdx.x] : 0.0;
  const double total = block_sum_fixed(v, scratch);
  if (threadIdx.x == 0) stats[2 * experts + 3] = total;
}

// One block: count_e, psum_e (sums over sequences), T, S and the sequence-balance term.
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
  if (threadIdx.x == 0) {
    stats[2 * experts] = static_cast<double>(seqs * seq_len);
    stats[2 * experts + 1] = static_cast<double>(seqs);
    stats[2 * experts + 2] = total;
  }
}

// One block: the ranks' statistics [ranks, 2E + 4] summed in rank order (as all_sum_f64 on the
// host), then the terms, f_e and the gradient denominators, as the CPU path computes them.
__global__ void aux_finalize_kernel(double* terms, float* frac, double* denoms, const double* all,
                                    int64_t ranks, int64_t experts, int64_t top_k, int64_t seq_len,
                                    double w_lb, double w_seq, double w_z) {
  __shared__ double scratch[kStatsThreads];
  const int64_t n = 2 * experts + 4;
  auto global = [&](int64_t i) {
    double s = 0;
    for (int64_t r = 0; r < ranks; ++r) s += all[r * n + i];
    return s;
  };
  const double Tg = global(2 * experts), Sg = global(2 * experts + 1);
  const double E = static_cast<double>(experts), W = static_cast<double>(ranks);
  double acc = 0;
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    const double f = Tg > 0 ? global(e) / (Tg * static_cast<double>(top_k)) : 0.0;
    frac[e] = static_cast<float>(f);
    if (Tg > 0) acc += E * f * (global(experts + e) / Tg);
  }
  const double lb = block_sum_fixed(acc, scratch);
  if (threadIdx.x == 0) {
    const double seq = Tg > 0 ? global(2 * experts + 2) / Sg : 0.0;
    const double z = Tg > 0 ? global(2 * experts + 3) / Tg : 0.0;
    terms[0] = lb;
    terms[1] = seq;
    terms[2] = z;
    terms[3] = w_lb * lb + w_seq * seq + w_z * z;
    denoms[0] = Tg / W;
    denoms[1] = static_cast<double>(seq_len) * Sg / W;
    denoms[2] = Tg / W;
  }
}

// The weight times the upstream gradient where it is on the device (scale; null: w as it is),
// multiplied in f32 as the host multiplies a host scale (AuxLossWeights::scaled).
__device__ __forceinline__ double scaled_weight(float w, const float* scale) {
  return static_cast<double>(scale ? w * *scale : w);
}

__global__ void aux_probs_grad_kernel(float* dprobs, const float* frac, const float* seq_count,
                                      const double* denoms, int64_t tokens, int64_t experts,
                                      int64_t seq_len, int64_t top_k, float w_lb_, float w_seq_,
                                      const float* scale) {
  // The coefficients from the forward's denominators (T_g / W, seq_len S_g / W), on the device.
  const double w_lb = scaled_weight(w_lb_, scale), w_seq = scaled_weight(w_seq_, scale);
  const double E = static_cast<double>(experts);
  const double lb_coef = w_lb != 0.0 ? w_lb * E / denoms[0] : 0.0;
  const double seq_coef =
      w_seq != 0.0 ? w_seq * E / (static_cast<double>(seq_len * top_k) * denoms[1]) : 0.0;
  XMOE_GRID_STRIDE(i, tokens * experts) {
    const int64_t t = i / experts, e = i % experts;
    float g = dprobs[i];
    if (lb_coef != 0.0) g += static_cast<float>(lb_coef * frac[e]);
    if (seq_coef != 0.0) g += static_cast<float>(seq_coef * seq_count[(t / seq_len) * experts + e]);
    dprobs[i] = g;
  }
}

// One warp per token row: dlogits += z_coef * lse_t * softmax(z_t).
__global__ void aux_z_grad_kernel(float* dlogits, const float* z, const double* denoms,
                                  int64_t tokens, int64_t experts, float w_z, const float* scale) {
  const double z_coef = scaled_weight(w_z, scale) * 2.0 / denoms[2];
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5); t < tokens;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    const float* row = z + t * experts;
    const double lse = warp_row_lse(row, experts, lane);
    const double c = z_coef * lse;
    for (int64_t e = lane; e < experts; e += 32)
      dlogits[t * experts + e] += static_cast<float>(c * exp(row[e] - lse));
  }
}

// moe_softmax_routing_backward: per row, dP_e = (0 + dv_q for each q with idx_q = e, in q order)
// + the load- and sequence-balance terms (aux_probs_grad_kernel's), dot = sum P dP (lane-strided,
// then the butterfly: softmax_backward_kernel's order), dlogits_e = (0 + z term) + P_e (dP_e -
// dot). dP is made twice (for the dot, then for the output) rather than stored: the same bits.
__global__ void softmax_routing_backward_kernel(float* dlogits, const float* probs,
                                                const int32_t* idx, const float* dv, int64_t k,
                                                const float* z, const float* frac,
                                                const float* seq_count, const double* denoms,
                                                int64_t tokens, int64_t experts, int64_t seq_len,
                                                int64_t top_k, float w_lb_, float w_seq_,
                                                float w_z_, const float* scale) {
  // aux_probs_grad_kernel runs (and makes its coefficients) only where a weight is non-zero
  const bool probs_terms = w_lb_ != 0.f || w_seq_ != 0.f;
  const double w_lb = probs_terms ? scaled_weight(w_lb_, scale) : 0.0;
  const double w_seq = probs_terms ? scaled_weight(w_seq_, scale) : 0.0;
  const double E = static_cast<double>(experts);
  const double lb_coef = w_lb != 0.0 ? w_lb * E / denoms[0] : 0.0;
  const double seq_coef =
      w_seq != 0.0 ? w_seq * E / (static_cast<double>(seq_len * top_k) * denoms[1]) : 0.0;
  const bool z_on = w_z_ != 0.f;
  const double z_coef = z_on ? scaled_weight(w_z_, scale) * 2.0 / denoms[2] : 0.0;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5); t < tokens;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    const int64_t o = t * experts;
    const int32_t* it = idx + t * k;
    const float* vt = dv + t * k;
    const float* ct = seq_count + (t / seq_len) * experts;
    auto d_prob = [&](int64_t e) {
      float g = 0.f;
      for (int64_t q = 0; q < k; ++q)
        if (it[q] == e) g = g + vt[q];
      if (lb_coef != 0.0) g += static_cast<float>(lb_coef * frac[e]);
      if (seq_coef != 0.0) g += static_cast<float>(seq_coef * ct[e]);
      return g;
    };
    float dot = 0.f;
    for (int64_t e = lane; e < experts; e += 32) dot += probs[o + e] * d_prob(e);
    dot = warp_sum(dot);
    double c = 0.0, lse = 0.0;
    if (z_on) {
      lse = warp_row_lse(z + o, experts, lane);
      c = z_coef * lse;
    }
    for (int64_t e = lane; e < experts; e += 32) {
      const float zt = z_on ? 0.f + static_cast<float>(c * exp(z[o + e] - lse)) : 0.f;
      // rounded as the separate passes round (no FMA across them)
      dlogits[o + e] = __fadd_rn(zt, __fmul_rn(probs[o + e], d_prob(e) - dot));
    }
  }
}

}  // namespace

int64_t moe_aux_stats_scratch(int64_t tokens, int64_t experts, int64_t seq_len) {
  const int64_t seqs = seq_len > 0 ? tokens / seq_len : 0;
  return kLseBlocks + seqs * chunks_of(seq_len) * experts;
}

void moe_aux_stats(double* stats, float* seq_count, double* seq_psum, const float* probs,
                   const int32_t* topk_idx, const float* z_logits, int64_t tokens, int64_t experts,
                   int64_t top_k, int64_t seq_len, double* scratch, Stream stream) {
  if (tokens == 0 || experts == 0) {
    CUDA_CHECK(
        cudaMemsetAsync(stats, 0, static_cast<size_t>(2 * experts + 4) * sizeof(double), stream));
    return;
  }
  const int64_t seqs = tokens / seq_len, chunks = chunks_of(seq_len);
  const size_t smem = static_cast<size_t>(experts) * sizeof(int32_t);
  if (smem > 48 * 1024) fail("[moe aux losses] more than 12288 experts");
  if (seq_len * top_k >= (int64_t{1} << 24))
    fail("[moe aux losses] a sequence of 2^24 or more expert choices");
  CUDA_CHECK(
      cudaMemsetAsync(seq_count, 0, static_cast<size_t>(seqs * experts) * sizeof(float), stream));
  const int64_t pieces = (seq_len * top_k + kCountPiece - 1) / kCountPiece;
  seq_count_kernel<<<static_cast<unsigned>(seqs * pieces), kBlock, smem, stream>>>(
      seq_count, topk_idx, seq_len, top_k, experts);
  CUDA_CHECK_LAUNCH();
  double* lse_partial = scratch;                 // [kLseBlocks]
  double* chunk_partial = scratch + kLseBlocks;  // [S, chunks, E]
  chunk_psum_kernel<<<grid_for(seqs * chunks * experts), kBlock, 0, stream>>>(
      chunk_partial, probs, seqs, seq_len, experts);
  CUDA_CHECK_LAUNCH();
  seq_psum_kernel<<<grid_for(seqs * experts), kBlock, 0, stream>>>(seq_psum, chunk_partial, seqs,
                                                                   chunks, experts);
  CUDA_CHECK_LAUNCH();
  lse_squares_partial_kernel<<<kLseBlocks, kLseThreads, 0, stream>>>(lse_partial, z_logits, tokens,
                                                                     experts);
  CUDA_CHECK_LAUNCH();
  lse_squares_total_kernel<<<1, 512, 0, stream>>>(stats, lse_partial, experts);
  CUDA_CHECK_LAUNCH();
  totals_kernel<<<1, kStatsThreads, 0, stream>>>(stats, seq_count, seq_psum, seqs, seq_len, top_k,
                                                 experts);
  CUDA_CHECK_LAUNCH();
}

void moe_aux_finalize(double* terms, float* frac, double* denoms, const double* all_stats,
                      int64_t ranks, int64_t experts, int64_t top_k, int64_t seq_len, double w_lb,
                      double w_seq, double w_z, Stream stream) {
  aux_finalize_kernel<<<1, kStatsThreads, 0, stream>>>(terms, frac, denoms, all_stats, ranks,
                                                       experts, top_k, seq_len, w_lb, w_seq, w_z);
  CUDA_CHECK_LAUNCH();
}

void moe_aux_backward(float* dprobs, float* dlogits, const float* z_logits, const float* frac,
                      const float* seq_count, const double* denoms, int64_t tokens, int64_t experts,
                      int64_t seq_len, int64_t top_k, float w_lb, float w_seq, float w_z,
                      const float* scale, Stream stream) {
  if (tokens == 0 || experts == 0) return;
  if (w_lb != 0.f || w_seq != 0.f) {
    aux_probs_grad_kernel<<<grid_for(tokens * experts), kBlock, 0, stream>>>(
        dprobs, frac, seq_count, denoms, tokens, experts, seq_len, top_k, w_lb, w_seq, scale);
    CUDA_CHECK_LAUNCH();
  }
  if (w_z != 0.f) {
    aux_z_grad_kernel<<<grid_for(tokens, kBlock / 32), kBlock, 0, stream>>>(
        dlogits, z_logits, denoms, tokens, experts, w_z, scale);
    CUDA_CHECK_LAUNCH();
  }
}

void moe_softmax_routing_backward(float* dlogits, const float* probs, const int32_t* idx,
                                  const float* dv, int64_t k, const float* z_logits,
                                  const float* frac, const float* seq_count, const double* denoms,
                                  int64_t tokens, int64_t experts, int64_t seq_len, int64_t top_k,
                                  float w_lb, float w_seq, float w_z, const float* scale,
                                  Stream stream) {
  if (tokens == 0 || experts == 0) return;
  softmax_routing_backward_kernel<<<grid_for(tokens, kBlock / 32), kBlock, 0, stream>>>(
      dlogits, probs, idx, dv, k, z_logits, frac, seq_count, denoms, tokens, experts, seq_len,
      top_k, w_lb, w_seq, w_z, scale);
  CUDA_CHECK_LAUNCH();
}

}  // namespace xmoe::cuda
