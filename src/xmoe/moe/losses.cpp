#include "xmoe/moe/losses.h"

#include <algorithm>
#include <cmath>

namespace xmoe::moe {

namespace {
double logsumexp_row(const float* x, int64_t n) {
  float m = x[0];
  for (int64_t j = 1; j < n; ++j) m = std::max(m, x[j]);
  double s = 0;
  for (int64_t j = 0; j < n; ++j) s += std::exp(static_cast<double>(x[j] - m));
  return m + std::log(s);
}
}  // namespace

AuxLossTerms aux_losses(const Tensor& probs, const Tensor& topk_idx, const Tensor& z_logits,
                        int64_t seq_len, const AuxLossWeights& w, AuxLossState& st) {
  const char* op = "moe aux losses";
  check_shape(probs, {-1, -1}, op, "probs");
  const int64_t T = probs.size(0), E = probs.size(1);
  check_shape(topk_idx, {T, -1}, op, "topk_idx");
  check_shape(z_logits, {T, E}, op, "z_logits");
  XMOE_CHECK(seq_len > 0 && T % seq_len == 0, "[{}] {} tokens are not a multiple of seq_len {}",
             op, T, seq_len);
  const int64_t k = topk_idx.size(1), S = T / seq_len;
  st = {T, E, k, seq_len, std::vector<double>(E, 0.0), std::vector<double>(S * E, 0.0)};
  const int32_t* idx = topk_idx.data<int32_t>();
  const float* P = probs.data<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = idx[t * k + j];
      st.frac[e] += 1.0 / static_cast<double>(T * k);
      st.seq_frac[(t / seq_len) * E + e] += 1.0 / static_cast<double>(seq_len * k);
    }
  AuxLossTerms out;
  std::vector<double> mean_p(E, 0.0), seq_mean_p(S * E, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      mean_p[e] += P[t * E + e] / static_cast<double>(T);
      seq_mean_p[(t / seq_len) * E + e] += P[t * E + e] / static_cast<double>(seq_len);
    }
  for (int64_t e = 0; e < E; ++e) out.load_balance += E * st.frac[e] * mean_p[e];
  for (int64_t i = 0; i < S * E; ++i) out.seq_balance += E * st.seq_frac[i] * seq_mean_p[i];
  out.seq_balance /= static_cast<double>(S);
  const float* L = z_logits.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    const double lse = logsumexp_row(L + t * E, E);
    out.z_loss += lse * lse / static_cast<double>(T);
  }
  out.weighted = w.load_balance * out.load_balance + w.seq_balance * out.seq_balance +
                 w.z_loss * out.z_loss;
  return out;
}

void aux_losses_backward(const Tensor& z_logits, const AuxLossState& st, const AuxLossWeights& w,
                         Tensor& dprobs, Tensor& dlogits) {
  const int64_t T = st.tokens, E = st.experts, L = st.seq_len, S = T / L;
  check_shape(dprobs, {T, E}, "moe aux losses backward", "dprobs");
  check_shape(dlogits, {T, E}, "moe aux losses backward", "dlogits");
  float* dP = dprobs.data<float>();
  // d/dP[t,e] of E * sum_e f_e * mean_t P[t,e] is E * f_e / T (f_e held fixed).
  if (w.load_balance != 0.f)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e)
        dP[t * E + e] += static_cast<float>(w.load_balance * E * st.frac[e] / T);
  if (w.seq_balance != 0.f)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e)
        dP[t * E + e] +=
            static_cast<float>(w.seq_balance * E * st.seq_frac[(t / L) * E + e] / (L * S));
  // d/dlogits of mean_t lse_t^2 is 2 * lse_t / T * softmax(logits_t).
  if (w.z_loss != 0.f) {
    const float* Z = z_logits.data<float>();
    float* dZ = dlogits.data<float>();
    for (int64_t t = 0; t < T; ++t) {
      const double lse = logsumexp_row(Z + t * E, E);
      const double c = w.z_loss * 2.0 * lse / T;
      for (int64_t e = 0; e < E; ++e)
        dZ[t * E + e] += static_cast<float>(c * std::exp(Z[t * E + e] - lse));
    }
  }
}

}  // namespace xmoe::moe
