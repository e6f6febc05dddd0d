// CPU kernels of the MoE ops: row helpers, the order stage's layouts, the aux losses and the
// gates' selection and temperature (backend/cpu/moe_kernels.h).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "xmoe/backend/cpu/moe_kernels.h"

namespace xmoe::cpu {

// ---- row helpers ----------------------------------------------------------------------------

void gather_rows_masked(float* out, const float* x, const int32_t* index, int64_t m, int64_t d) {
#pragma omp parallel for schedule(static) if (m * d > (1 << 15))
  for (int64_t i = 0; i < m; ++i) {
    const int64_t r = index[i];
    if (r < 0) {
      std::memset(out + i * d, 0, sizeof(float) * static_cast<size_t>(d));
    } else {
      std::memcpy(out + i * d, x + r * d, sizeof(float) * static_cast<size_t>(d));
    }
  }
}

void scatter_add_rows_masked(float* out, const float* src, const int32_t* index,
                             const float* weight, int64_t m, int64_t d) {
  for (int64_t i = 0; i < m; ++i) {
    if (index[i] < 0) continue;
    const float wi = weight ? weight[i] : 1.0f;
    float* orow = out + static_cast<int64_t>(index[i]) * d;
    const float* srow = src + i * d;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) orow[j] += wi * srow[j];
  }
}

void gather_sum_rows(float* out, const float* src, const int32_t* slots, const float* weight,
                     const float* addend, int64_t t, int64_t k, int64_t d) {
  // No write conflicts (each token sums its own rows), so parallel over tokens.
#pragma omp parallel if (t * k * d > (1 << 15))
  {
    std::vector<int32_t> rows(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < t; ++i) {
      size_t count = 0;
      for (int64_t j = 0; j < k; ++j)
        if (slots[i * k + j] >= 0) rows[count++] = slots[i * k + j];
      std::sort(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(count));
      float* orow = out + i * d;
      std::memset(orow, 0, sizeof(float) * static_cast<size_t>(d));
      for (size_t q = 0; q < count; ++q) {
        const float wi = weight ? weight[rows[q]] : 1.0f;
        const float* srow = src + static_cast<int64_t>(rows[q]) * d;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) orow[j] += wi * srow[j];
      }
      if (addend) {
        const float* arow = addend + i * d;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) orow[j] += arow[j];
      }
    }
  }
}

void scale_rows(float* x, const float* w, int64_t n, int64_t d) {
#pragma omp parallel for schedule(static) if (n * d > (1 << 15))
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < d; ++j) x[i * d + j] *= w[i];
}

void gather_weighted_rows_dot_inplace(float* rows, float* dot, const float* dy,
                                      const int32_t* index, const float* weight, int64_t n,
                                      int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    float* row = rows + i * d;
    if (index[i] < 0) {
      dot[i] = 0.f;
      std::fill(row, row + d, 0.f);
      continue;
    }
    const float* g_row = dy + int64_t{index[i]} * d;
    float s = 0.f;
    for (int64_t j = 0; j < d; ++j) s += row[j] * g_row[j];
    dot[i] = s;
    for (int64_t j = 0; j < d; ++j) row[j] = g_row[j] * weight[i];
  }
}

void take_along_rows(float* out, const float* x, const int32_t* idx, int64_t n, int64_t e,
                     int64_t k) {
  for (int64_t i = 0; i < n * k; ++i) out[i] = x[(i / k) * e + idx[i]];
}

void put_along_rows_add(float* out, const int32_t* idx, const float* src, int64_t n, int64_t e,
                        int64_t k) {
  for (int64_t i = 0; i < n * k; ++i) out[(i / k) * e + idx[i]] += src[i];
}

void transpose(float* y, const float* x, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) y[j * m + i] = x[i * n + j];
}

void l2_normalize_rows(float* y, float* norm, const float* x, int64_t n, int64_t d, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(x[i * d + j]) * x[i * d + j];
    const float nrm = std::max(static_cast<float>(std::sqrt(ss)), eps);
    norm[i] = nrm;
    for (int64_t j = 0; j < d; ++j) y[i * d + j] = x[i * d + j] / nrm;
  }
}

void l2_normalize_rows_backward(float* dx, const float* y, const float* norm, const float* dy,
                                int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    float dot = 0.f;
    for (int64_t j = 0; j < d; ++j) dot += y[i * d + j] * dy[i * d + j];
    for (int64_t j = 0; j < d; ++j) dx[i * d + j] = (dy[i * d + j] - y[i * d + j] * dot) / norm[i];
  }
}

void renormalize_rows(float* w, float* sums, const float* v, int64_t n, int64_t k, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    float s = 0.f;
    for (int64_t j = 0; j < k; ++j) s += v[i * k + j];
    s = std::max(s, 1e-20f);  // scores are positive; the clamp only guards against underflow
    sums[i] = s;
    for (int64_t j = 0; j < k; ++j) w[i * k + j] = scale * v[i * k + j] / s;
  }
}

void renormalize_rows_backward(float* dv, const float* w, const float* sums, const float* dw,
                               int64_t n, int64_t k, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    float dot = 0.f;
    for (int64_t j = 0; j < k; ++j) dot += dw[i * k + j] * w[i * k + j];
    for (int64_t j = 0; j < k; ++j) dv[i * k + j] = (scale * dw[i * k + j] - dot) / sums[i];
  }
}

// ---- order stage: the token layout ----------------------------------------------------------

void moe_layout_pft(const int32_t* topk_idx, const float* topk_weight, int64_t tokens,
                    int64_t top_k, int64_t experts, int32_t* token_ids, int32_t* expert_ids,
                    float* combine_weights, int32_t* slot_to_row, int64_t* tokens_per_expert) {
  const int64_t pairs = tokens * top_k;
  for (int64_t e = 0; e < experts; ++e) tokens_per_expert[e] = 0;
  for (int64_t i = 0; i < pairs; ++i) ++tokens_per_expert[topk_idx[i]];
  std::vector<int64_t> next(static_cast<size_t>(experts), 0);  // exclusive prefix sums
  for (int64_t e = 1; e < experts; ++e) next[e] = next[e - 1] + tokens_per_expert[e - 1];
  // Visiting pairs in (token, slot) order keeps each expert's rows in that order (stable).
  for (int64_t i = 0; i < pairs; ++i) {
    const int32_t e = topk_idx[i];
    const int64_t row = next[e]++;
    token_ids[row] = static_cast<int32_t>(i / top_k);
    expert_ids[row] = e;
    combine_weights[row] = topk_weight[i];
    slot_to_row[i] = static_cast<int32_t>(row);
  }
}

int64_t moe_layout_padded(const int32_t* topk_idx, const float* topk_weight, int64_t tokens,
                          int64_t top_k, int64_t experts, int64_t capacity, int32_t* token_ids,
                          int32_t* expert_ids, float* combine_weights, int32_t* slot_to_row,
                          int64_t* load, int64_t* kept) {
  for (int64_t e = 0; e < experts; ++e) {
    load[e] = kept[e] = 0;
    for (int64_t c = 0; c < capacity; ++c) {
      token_ids[e * capacity + c] = -1;
      expert_ids[e * capacity + c] = static_cast<int32_t>(e);
      combine_weights[e * capacity + c] = 0.f;
    }
  }
  int64_t dropped = 0;
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int32_t e = topk_idx[i];
    ++load[e];
    if (kept[e] == capacity) {  // full: the pair is dropped (first come, first served)
      slot_to_row[i] = -1;
      ++dropped;
      continue;
    }
    const int64_t row = e * capacity + kept[e]++;
    token_ids[row] = static_cast<int32_t>(i / top_k);
    combine_weights[row] = topk_weight[i];
    slot_to_row[i] = static_cast<int32_t>(row);
  }
  return dropped;
}

// ---- aux losses -----------------------------------------------------------------------------

namespace {
double logsumexp_row(const float* x, int64_t n) {
  float m = x[0];
  for (int64_t j = 1; j < n; ++j) m = std::max(m, x[j]);
  double s = 0;
  for (int64_t j = 0; j < n; ++j) s += std::exp(static_cast<double>(x[j] - m));
  return m + std::log(s);
}
}  // namespace

void moe_aux_stats(double* stats, float* seq_count_out, const float* probs, const int32_t* topk_idx,
                   const float* z_logits, int64_t tokens, int64_t experts, int64_t top_k,
                   int64_t seq_len) {
  const int64_t T = tokens, E = experts, k = top_k, S = T / seq_len;
  // Counts are exact in double.
  double* g = stats;
  std::fill(g, g + 2 * E + 4, 0.0);
  double* count = g;
  double* psum = g + E;
  std::vector<double> seq_count(S * E, 0.0), seq_psum(S * E, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = topk_idx[t * k + j];
      count[e] += 1;
      seq_count[(t / seq_len) * E + e] += 1;
    }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      psum[e] += probs[t * E + e];
      seq_psum[(t / seq_len) * E + e] += probs[t * E + e];
    }
  for (int64_t i = 0; i < S * E; ++i) {
    const double seq_frac = seq_count[i] / static_cast<double>(seq_len * k);
    g[2 * E + 2] += E * seq_frac * (seq_psum[i] / static_cast<double>(seq_len));
    seq_count_out[i] = static_cast<float>(seq_count[i]);  // exact: integers below 2^24
  }
  g[2 * E] = static_cast<double>(T);
  g[2 * E + 1] = static_cast<double>(S);
  for (int64_t t = 0; t < T; ++t) {
    const double lse = logsumexp_row(z_logits + t * E, E);
    g[2 * E + 3] += lse * lse;
  }
}

void moe_aux_finalize(double* terms, double* frac, double* denoms, const double* all_stats,
                      int64_t ranks, int64_t experts, int64_t top_k, int64_t seq_len, float w_lb,
                      float w_seq, float w_z) {
  const int64_t E = experts, k = top_k, n = 2 * E + 4;
  // The global sums, added in rank order (the same bits on every rank).
  std::vector<double> g(all_stats, all_stats + n);
  if (ranks > 1) {
    for (int64_t i = 0; i < n; ++i) {
      double s = 0;
      for (int64_t p = 0; p < ranks; ++p) s += all_stats[p * n + i];
      g[i] = s;
    }
  }
  const double* count = g.data();
  const double* psum = g.data() + E;
  const double W = static_cast<double>(ranks);
  const double Tg = g[2 * E], Sg = g[2 * E + 1];
  double lb = 0, seq = 0, z = 0;
  std::fill(frac, frac + E, 0.0);
  if (Tg > 0) {
    for (int64_t e = 0; e < E; ++e) {
      frac[e] = count[e] / (Tg * static_cast<double>(k));
      lb += E * frac[e] * (psum[e] / Tg);
    }
    seq = g[2 * E + 2] / Sg;
    z = g[2 * E + 3] / Tg;
  }
  denoms[0] = denoms[2] = Tg / W;
  denoms[1] = static_cast<double>(seq_len) * Sg / W;
  terms[0] = lb;
  terms[1] = seq;
  terms[2] = z;
  terms[3] = w_lb * lb + w_seq * seq + w_z * z;
}

void moe_aux_backward(float* dprobs, float* dlogits, const float* z_logits, const double* frac,
                      const float* seq_count, const double* denoms, int64_t tokens, int64_t experts,
                      int64_t seq_len, int64_t top_k, float w_lb, float w_seq, float w_z) {
  const int64_t T = tokens, E = experts, L = seq_len;
  float* dP = dprobs;
  // d/dP[t,e] of E * sum_e f_e * mean_t P[t,e] is E * f_e / T (f_e held fixed); over ranks
  // T is T_g / W (see moe/losses.h: W times this rank's share of the global gradient).
  if (w_lb != 0.f)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e)
        dP[t * E + e] += static_cast<float>(w_lb * E * frac[e] / denoms[0]);
  if (w_seq != 0.f)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) {
        const double seq_frac =
            static_cast<double>(seq_count[(t / L) * E + e]) / static_cast<double>(L * top_k);
        dP[t * E + e] += static_cast<float>(w_seq * E * seq_frac / denoms[1]);
      }
  // d/dlogits of mean_t lse_t^2 is 2 * lse_t / T * softmax(logits_t).
  if (w_z != 0.f) {
    const float* Z = z_logits;
    float* dZ = dlogits;
    for (int64_t t = 0; t < T; ++t) {
      const double lse = logsumexp_row(Z + t * E, E);
      const double c = w_z * 2.0 * lse / denoms[2];
      for (int64_t e = 0; e < E; ++e)
        dZ[t * E + e] += static_cast<float>(c * std::exp(Z[t * E + e] - lse));
    }
  }
}

// ---- gates ----------------------------------------------------------------------------------

void moe_group_limited_scores(float* biased, const float* scores, const float* bias, int64_t tokens,
                              int64_t experts, int64_t groups, int64_t topk_groups) {
  const int64_t T = tokens, E = experts, G = groups, per = E / G;
  float* b = biased;
  std::memcpy(b, scores, sizeof(float) * static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) b[t * E + e] += bias[e];
  if (G > 1 && topk_groups < G) {
    std::vector<float> gscore(G);
    std::vector<int64_t> order(G);
    for (int64_t t = 0; t < T; ++t) {
      float* row = b + t * E;
      for (int64_t g = 0; g < G; ++g) {
        // Sum of the group's top-2 biased scores (the one score for groups of one).
        float first = -std::numeric_limits<float>::infinity(), second = first;
        for (int64_t e = g * per; e < (g + 1) * per; ++e) {
          if (row[e] > first) {
            second = first;
            first = row[e];
          } else if (row[e] > second) {
            second = row[e];
          }
        }
        gscore[g] = per >= 2 ? first + second : first;
        order[g] = g;
      }
      std::partial_sort(order.begin(), order.begin() + topk_groups, order.end(),
                        [&](int64_t a, int64_t c) {
                          return gscore[a] > gscore[c] || (gscore[a] == gscore[c] && a < c);
                        });
      std::vector<char> keep(G, 0);
      for (int64_t i = 0; i < topk_groups; ++i) keep[order[i]] = 1;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per]) row[e] = -std::numeric_limits<float>::infinity();
    }
  }
}

void moe_div_temperature(float* out, const float* x, float temperature, float min_temperature,
                         int64_t n) {
  // x * (1 / tau): the bits of the CPU path before this op existed (a scale by 1 / tau).
  const float s = 1.0f / std::max(temperature, min_temperature);
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * s;
}

void moe_temperature_grad(float* temperature_grad, const float* dlogits, const float* cos,
                          float temperature, float min_temperature, int64_t n) {
  if (!(temperature >= min_temperature)) return;  // clamped: tau does not follow the parameter
  const float tau = std::max(temperature, min_temperature);
  double dot = 0;
  for (int64_t i = 0; i < n; ++i) dot += static_cast<double>(dlogits[i]) * cos[i];
  temperature_grad[0] += static_cast<float>(-dot / (tau * tau));
}

}  // namespace xmoe::cpu
