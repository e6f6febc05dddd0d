#include "xmoe/moe/losses.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "xmoe/backend/cuda/moe_kernels.h"
#include "xmoe/core/profile.h"
#include "xmoe/ops/dispatch.h"

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

double AuxLossTerms::value(int i) const {
  if (device_.defined()) {
    const std::vector<double> v = device_.to_vector<double>();
    std::copy(v.begin(), v.end(), values_.begin());
    device_ = Tensor();
  }
  return values_[static_cast<size_t>(i)];
}

void all_sum_f64(comm::Group* group, std::span<double> values) {
  if (group == nullptr || group->size() == 1 || values.empty()) return;
  const int64_t n = static_cast<int64_t>(values.size());
  static_assert(sizeof(double) == sizeof(int64_t));
  // The doubles' bits (all_gather moves bytes), where the group's tensors live (NCCL: the GPU).
  std::vector<int64_t> mine(static_cast<size_t>(n));
  std::memcpy(mine.data(), values.data(), values.size_bytes());
  const std::vector<int64_t> all =
      group->all_gather(Tensor::from_vector(mine, {1, n}, group->device())).to_vector<int64_t>();
  std::vector<double> bits(all.size());  // [W, n]
  std::memcpy(bits.data(), all.data(), all.size() * sizeof(int64_t));
  for (int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (int p = 0; p < group->size(); ++p) s += bits[static_cast<size_t>(p * n + i)];
    values[i] = s;
  }
}

namespace {

AuxLossTerms aux_losses_device(const Tensor& probs, const Tensor& topk_idx,
                               const Tensor& z_logits, int64_t seq_len, const AuxLossWeights& w,
                               AuxLossState& st, comm::Group* world) {
  const char* op = "moe aux losses";
  using xmoe::ops::detail::require_on;
  require_on(op, "probs", probs, DType::f32, "probs", probs);
  require_on(op, "topk_idx", topk_idx, DType::i32, "probs", probs);
  require_on(op, "z_logits", z_logits, DType::f32, "probs", probs);
  const int64_t T = probs.size(0), E = probs.size(1), k = topk_idx.size(1), S = T / seq_len;
  const int64_t n = 2 * E + 4;
  const Device dev = probs.device();
  const cuda::Stream stream = xmoe::ops::detail::stream_of(probs);
  st = AuxLossState{};
  st.tokens = T;
  st.experts = E;
  st.top_k = k;
  st.seq_len = seq_len;
  // This rank's sums, laid out as the CPU path's: [count (E), psum (E), T, S, seq term,
  // sum lse^2]. Held as i64 because collectives move i64 bit for bit (f64 sums stay exact
  // across ranks only if no reduction touches them: they are gathered, then added in order).
  Tensor stats = Tensor::empty({1, n}, DType::i64, dev);
  st.seq_count_device = Tensor::empty({S, E}, DType::f32, dev);
  Tensor seq_psum = Tensor::empty({S, E}, DType::f64, dev);
  Tensor scratch = Tensor::empty({cuda::moe_aux_stats_scratch(T, E, seq_len)}, DType::f64, dev);
  auto as_f64 = [](Tensor& t) { return reinterpret_cast<double*>(t.data<int64_t>()); };
  cuda::moe_aux_stats(as_f64(stats), st.seq_count_device.data<float>(), seq_psum.data<double>(),
                      probs.data<float>(), topk_idx.data<int32_t>(), z_logits.data<float>(), T, E,
                      k, seq_len, scratch.data<double>(), stream);
  // Every rank's sums [W, n]: on the GPU for an NCCL world; an MPI world moves host tensors,
  // which costs this layer's one wait.
  const int64_t W = world ? world->size() : 1;
  Tensor all = stats;
  if (W > 1)
    all = world->device() == dev ? world->all_gather(stats)
                                 : world->all_gather(stats.to(world->device())).to(dev);
  Tensor terms = Tensor::empty({4}, DType::f64, dev);
  st.frac_device = Tensor::empty({E}, DType::f32, dev);
  st.denoms_device = Tensor::empty({3}, DType::f64, dev);
  cuda::moe_aux_finalize(terms.data<double>(), st.frac_device.data<float>(),
                         st.denoms_device.data<double>(), as_f64(all), W, E, k, seq_len,
                         w.load_balance, w.seq_balance, w.z_loss, stream);
  return AuxLossTerms(std::move(terms));
}

}  // namespace

AuxLossTerms aux_losses(const Tensor& probs, const Tensor& topk_idx, const Tensor& z_logits,
                        int64_t seq_len, const AuxLossWeights& w, AuxLossState& st,
                        comm::Group* world) {
  ProfileScope scope("moe.aux_loss.fwd", probs.device());
  const char* op = "moe aux losses";
  check_shape(probs, {-1, -1}, op, "probs");
  const int64_t T = probs.size(0), E = probs.size(1);
  check_shape(topk_idx, {T, -1}, op, "topk_idx");
  check_shape(z_logits, {T, E}, op, "z_logits");
  XMOE_CHECK(seq_len > 0 && T % seq_len == 0, "[{}] {} tokens are not a multiple of seq_len {}",
             op, T, seq_len);
  const int64_t k = topk_idx.size(1), S = T / seq_len;
  if (!probs.is_cpu()) return aux_losses_device(probs, topk_idx, z_logits, seq_len, w, st, world);
  st = AuxLossState{};
  st.tokens = T;
  st.experts = E;
  st.top_k = k;
  st.seq_len = seq_len;
  st.frac.assign(static_cast<size_t>(E), 0.0);
  st.seq_frac.assign(static_cast<size_t>(S * E), 0.0);
  const int32_t* idx = topk_idx.data<int32_t>();
  const float* P = probs.data<float>();
  // This rank's sums, then the global ones: [count_e (E), sum_t P[t,e] (E), T, S,
  // sum_s E sum_e f_{s,e} P_{s,e}, sum_t lse_t^2]. Counts are exact in double.
  std::vector<double> g(static_cast<size_t>(2 * E + 4), 0.0);
  double* count = g.data();
  double* psum = g.data() + E;
  std::vector<double> seq_count(S * E, 0.0), seq_psum(S * E, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = idx[t * k + j];
      count[e] += 1;
      seq_count[(t / seq_len) * E + e] += 1;
    }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      psum[e] += P[t * E + e];
      seq_psum[(t / seq_len) * E + e] += P[t * E + e];
    }
  for (int64_t i = 0; i < S * E; ++i) {
    st.seq_frac[i] = seq_count[i] / static_cast<double>(seq_len * k);
    g[2 * E + 2] += E * st.seq_frac[i] * (seq_psum[i] / static_cast<double>(seq_len));
  }
  g[2 * E] = static_cast<double>(T);
  g[2 * E + 1] = static_cast<double>(S);
  const float* L = z_logits.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    const double lse = logsumexp_row(L + t * E, E);
    g[2 * E + 3] += lse * lse;
  }
  all_sum_f64(world, g);
  const double W = world ? static_cast<double>(world->size()) : 1.0;
  const double Tg = g[2 * E], Sg = g[2 * E + 1];
  double lb = 0, seq = 0, z = 0;
  if (Tg > 0) {
    for (int64_t e = 0; e < E; ++e) {
      st.frac[e] = count[e] / (Tg * static_cast<double>(k));
      lb += E * st.frac[e] * (psum[e] / Tg);
    }
    seq = g[2 * E + 2] / Sg;
    z = g[2 * E + 3] / Tg;
  }
  st.lb_denom = st.z_denom = Tg / W;
  st.seq_denom = static_cast<double>(seq_len) * Sg / W;
  return AuxLossTerms(lb, seq, z, w.load_balance * lb + w.seq_balance * seq + w.z_loss * z);
}

void aux_losses_backward(const Tensor& z_logits, const AuxLossState& st, const AuxLossWeights& w,
                         Tensor& dprobs, Tensor& dlogits) {
  ProfileScope scope("moe.aux_loss.bwd", dprobs.device());
  const int64_t T = st.tokens, E = st.experts, L = st.seq_len;
  check_shape(dprobs, {T, E}, "moe aux losses backward", "dprobs");
  check_shape(dlogits, {T, E}, "moe aux losses backward", "dlogits");
  if (!dprobs.is_cpu()) {
    const char* op = "moe aux losses backward";
    using xmoe::ops::detail::require_on;
    require_on(op, "dprobs", dprobs, DType::f32, "dprobs", dprobs);
    require_on(op, "dlogits", dlogits, DType::f32, "dprobs", dprobs);
    require_on(op, "z_logits", z_logits, DType::f32, "dprobs", dprobs);
    XMOE_CHECK(st.denoms_device.defined(), "[{}] the forward ran on the CPU", op);
    cuda::moe_aux_backward(dprobs.data<float>(), dlogits.data<float>(), z_logits.data<float>(),
                           st.frac_device.data<float>(), st.seq_count_device.data<float>(),
                           st.denoms_device.data<double>(), T, E, L, st.top_k, w.load_balance,
                           w.seq_balance, w.z_loss, xmoe::ops::detail::stream_of(dprobs));
    return;
  }
  float* dP = dprobs.data<float>();
  // d/dP[t,e] of E * sum_e f_e * mean_t P[t,e] is E * f_e / T (f_e held fixed); over ranks
  // T is T_g / W (see the header: W times this rank's share of the global gradient).
  if (w.load_balance != 0.f)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e)
        dP[t * E + e] += static_cast<float>(w.load_balance * E * st.frac[e] / st.lb_denom);
  if (w.seq_balance != 0.f)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e)
        dP[t * E + e] +=
            static_cast<float>(w.seq_balance * E * st.seq_frac[(t / L) * E + e] / st.seq_denom);
  // d/dlogits of mean_t lse_t^2 is 2 * lse_t / T * softmax(logits_t).
  if (w.z_loss != 0.f) {
    const float* Z = z_logits.data<float>();
    float* dZ = dlogits.data<float>();
    for (int64_t t = 0; t < T; ++t) {
      const double lse = logsumexp_row(Z + t * E, E);
      const double c = w.z_loss * 2.0 * lse / st.z_denom;
      for (int64_t e = 0; e < E; ++e)
        dZ[t * E + e] += static_cast<float>(c * std::exp(Z[t * E + e] - lse));
    }
  }
}

}  // namespace xmoe::moe
