#include "xmoe/backend/cpu/model_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace xmoe::cpu {

namespace {
inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
inline void axpy(float* y, float a, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}
}  // namespace

// ---- embedding ------------------------------------------------------------------------------

void embedding_forward(float* out, const float* table, const int32_t* ids, int64_t n, int64_t d) {
#pragma omp parallel for schedule(static) if (n * d > (1 << 15))
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(out + i * d, table + static_cast<int64_t>(ids[i]) * d, sizeof(float) * d);
}

void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t n,
                        int64_t d) {
  // A token id may repeat, so threads split the columns: each column block sees the rows in the
  // same order whatever the thread count, and no two threads write one element.
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (d + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n * d > (1 << 15) && blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t c0 = b * kBlock, c1 = std::min(d, c0 + kBlock);
    for (int64_t i = 0; i < n; ++i) {
      float* dst = dtable + static_cast<int64_t>(ids[i]) * d;
      const float* src = dout + i * d;
      for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
    }
  }
}

// ---- rotary position embedding --------------------------------------------------------------

void rope_tables(float* cos_table, float* sin_table, int64_t max_seq, int64_t head_dim,
                 float theta) {
  const int64_t half = head_dim / 2;
  // Angles in double: s * inv_freq reaches ~1e4 rad at long sequences, where f32 loses digits.
  for (int64_t j = 0; j < half; ++j) {
    const double inv_freq =
        std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(j) / head_dim);
    for (int64_t s = 0; s < max_seq; ++s) {
      const double a = static_cast<double>(s) * inv_freq;
      cos_table[s * half + j] = static_cast<float>(std::cos(a));
      sin_table[s * half + j] = static_cast<float>(std::sin(a));
    }
  }
}

void rope_apply(float* x, const float* cos_table, const float* sin_table, int64_t batch,
                int64_t seq, int64_t heads, int64_t head_dim, bool inverse) {
  const int64_t half = head_dim / 2;
  const float sign = inverse ? -1.f : 1.f;
  const int64_t rows = batch * seq;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim > (1 << 15))
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = r % seq;  // position inside its sequence
    const float* c = cos_table + s * half;
    const float* sn = sin_table + s * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* x1 = x + (r * heads + h) * head_dim;
      float* x2 = x1 + half;
      for (int64_t j = 0; j < half; ++j) {
        const float a = x1[j], b = x2[j], sj = sign * sn[j];
        x1[j] = a * c[j] - b * sj;
        x2[j] = b * c[j] + a * sj;
      }
    }
  }
}

// ---- causal self-attention ------------------------------------------------------------------

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, float scale, bool causal) {
  const int64_t group = heads / kv_heads;
  const int64_t rows = batch * heads * seq;  // one unit of work = one query row of one head
#pragma omp parallel if (rows * seq * head_dim > (1 << 16))
  {
    std::vector<float> p(static_cast<size_t>(seq));
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t i = row % seq, h = (row / seq) % heads, b = row / (seq * heads);
      const int64_t kvh = h / group;
      const float* qi = q + ((b * seq + i) * heads + h) * head_dim;
      const int64_t jn = causal ? i + 1 : seq;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < jn; ++j) {
        const float* kj = k + ((b * seq + j) * kv_heads + kvh) * head_dim;
        p[j] = scale * dot(qi, kj, head_dim);
        m = std::max(m, p[j]);
      }
      float sum = 0.f;
      for (int64_t j = 0; j < jn; ++j) {
        p[j] = std::exp(p[j] - m);
        sum += p[j];
      }
      float* oi = out + ((b * seq + i) * heads + h) * head_dim;
      std::fill(oi, oi + head_dim, 0.f);
      const float inv = 1.f / sum;
      for (int64_t j = 0; j < jn; ++j)
        axpy(oi, p[j] * inv, v + ((b * seq + j) * kv_heads + kvh) * head_dim, head_dim);
      lse[(b * heads + h) * seq + i] = m + std::log(sum);
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const float* dout,
                        int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, float scale, bool causal) {
  const int64_t group = heads / kv_heads;
  // One unit of work = one (batch, kv head): it owns dk, dv of that kv head and dq of the query
  // heads that share it, so no two threads write one element and the sums run in a fixed order.
  const int64_t units = batch * kv_heads;
  const int64_t work = batch * heads * seq * seq * head_dim;
#pragma omp parallel for schedule(dynamic, 1) if (work > (1 << 16) && units > 1)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t b = u / kv_heads, kvh = u % kv_heads;
    for (int64_t j = 0; j < seq; ++j) {
      std::fill_n(dk + ((b * seq + j) * kv_heads + kvh) * head_dim, head_dim, 0.f);
      std::fill_n(dv + ((b * seq + j) * kv_heads + kvh) * head_dim, head_dim, 0.f);
    }
    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
      for (int64_t i = 0; i < seq; ++i) {
        const int64_t qoff = ((b * seq + i) * heads + h) * head_dim;
        const float* qi = q + qoff;
        const float* doi = dout + qoff;
        float* dqi = dq + qoff;
        std::fill(dqi, dqi + head_dim, 0.f);
        const float li = lse[(b * heads + h) * seq + i];
        // D_i = sum_j p_ij dp_ij = dout_i . out_i
        const float di = dot(doi, out + qoff, head_dim);
        const int64_t jn = causal ? i + 1 : seq;
        for (int64_t j = 0; j < jn; ++j) {
          const int64_t koff = ((b * seq + j) * kv_heads + kvh) * head_dim;
          const float pij = std::exp(scale * dot(qi, k + koff, head_dim) - li);
          const float dpij = dot(doi, v + koff, head_dim);
          const float dsij = pij * (dpij - di) * scale;  // d loss / d (q_i . k_j)
          axpy(dqi, dsij, k + koff, head_dim);
          axpy(dk + koff, dsij, qi, head_dim);
          axpy(dv + koff, pij, doi, head_dim);
        }
      }
    }
  }
}

// ---- cross-entropy --------------------------------------------------------------------------

void cross_entropy_forward(float* loss, float* lse, const float* logits, const int32_t* targets,
                           int64_t n, int64_t v) {
#pragma omp parallel for schedule(static) if (n * v > (1 << 15))
  for (int64_t i = 0; i < n; ++i) {
    const float* x = logits + i * v;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < v; ++c) m = std::max(m, x[c]);
    double s = 0.0;
    for (int64_t c = 0; c < v; ++c) s += std::exp(static_cast<double>(x[c] - m));
    const float l = m + static_cast<float>(std::log(s));
    lse[i] = l;
    loss[i] = targets[i] < 0 ? 0.f : l - x[targets[i]];
  }
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, int64_t n, int64_t v, float scale) {
#pragma omp parallel for schedule(static) if (n * v > (1 << 15))
  for (int64_t i = 0; i < n; ++i) {
    const float* x = logits + i * v;
    float* dx = dlogits + i * v;
    const int32_t t = targets[i];
    if (t < 0) {
      std::fill(dx, dx + v, 0.f);
      continue;
    }
    for (int64_t c = 0; c < v; ++c) dx[c] = scale * std::exp(x[c] - lse[i]);
    dx[t] -= scale;
  }
}

}  // namespace xmoe::cpu
