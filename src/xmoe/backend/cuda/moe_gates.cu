// Gate helpers on the device: the sigmoid gate's biased, group-limited selection scores and the
// xmoe gate's learned temperature (read on the device, so the forward never waits for it).
#include "xmoe/backend/cuda/common.cuh"
#include "xmoe/backend/cuda/moe_kernels.h"

namespace xmoe::cuda {

namespace {

// One thread per token (routing rows are short). Same rule as the CPU: group score = sum of its
// top-2 biased scores (the one score for groups of one); the topk_groups best groups are kept,
// ties to the lower group.
__global__ void group_limited_kernel(float* biased, const float* scores, const float* bias,
                                     int64_t tokens, int64_t experts, int64_t groups,
                                     int64_t topk_groups) {
  XMOE_GRID_STRIDE(t, tokens) {
    float* row = biased + t * experts;
    for (int64_t e = 0; e < experts; ++e) row[e] = scores[t * experts + e] + bias[e];
    if (groups <= 1 || topk_groups >= groups) continue;
    const int64_t per = experts / groups;
    unsigned long long keep = 0;
    for (int64_t i = 0; i < topk_groups; ++i) {
      int64_t best = -1;
      float best_score = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        if (keep >> g & 1ull) continue;
        float first = -INFINITY, second = -INFINITY;
        for (int64_t e = g * per; e < (g + 1) * per; ++e) {
          if (row[e] > first) {
            second = first;
            first = row[e];
          } else if (row[e] > second) {
            second = row[e];
          }
        }
        const float gs = per >= 2 ? first + second : first;
        if (best < 0 || gs > best_score) {  // strict: ties keep the lower group
          best = g;
          best_score = gs;
        }
      }
      keep |= 1ull << best;
    }
    for (int64_t e = 0; e < experts; ++e)
      if (!(keep >> (e / per) & 1ull)) row[e] = -INFINITY;
  }
}

__global__ void div_temperature_kernel(float* out, const float* x, const float* temperature,
                                       float min_temperature, int64_t n) {
  const float inv = 1.0f / fmaxf(*temperature, min_temperature);
  XMOE_GRID_STRIDE(i, n) {
    out[i] = x[i] * inv;
  }
}

constexpr int kTempThreads = 1024;

__global__ void temperature_grad_kernel(float* grad, const float* dlogits, const float* cos,
                                        const float* temperature, float min_temperature,
                                        int64_t n) {
  __shared__ double scratch[kTempThreads];
  if (*temperature < min_temperature) return;  // clamped: no gradient (uniform over the block)
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    acc += static_cast<double>(dlogits[i]) * cos[i];
  scratch[threadIdx.x] = acc;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) scratch[threadIdx.x] += scratch[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const float tau = fmaxf(*temperature, min_temperature);
    *grad += static_cast<float>(-scratch[0] / (tau * tau));
  }
}

}  // namespace

void moe_group_limited_scores(float* biased, const float* scores, const float* bias, int64_t tokens,
                              int64_t experts, int64_t groups, int64_t topk_groups, Stream stream) {
  if (tokens == 0) return;
  if (groups > 64) fail("[moe gate sigmoid] more than 64 expert groups on CUDA");
  group_limited_kernel<<<grid_for(tokens), kBlock, 0, stream>>>(biased, scores, bias, tokens,
                                                                experts, groups, topk_groups);
  CUDA_CHECK_LAUNCH();
}

void moe_div_temperature(float* out, const float* x, const float* temperature,
                         float min_temperature, int64_t n, Stream stream) {
  if (n == 0) return;
  div_temperature_kernel<<<grid_for(n), kBlock, 0, stream>>>(out, x, temperature, min_temperature,
                                                             n);
  CUDA_CHECK_LAUNCH();
}

void moe_temperature_grad(float* temperature_grad, const float* dlogits, const float* cos,
                          const float* temperature, float min_temperature, int64_t n,
                          Stream stream) {
  temperature_grad_kernel<<<1, kTempThreads, 0, stream>>>(temperature_grad, dlogits, cos,
                                                          temperature, min_temperature, n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace xmoe::cuda
