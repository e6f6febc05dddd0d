// The MoE layer on CUDA against the CPU reference (names contain Cuda, so gpu-check runs them).
//
//   CudaMoeOps:    the row ops of ops/moe.h, CPU vs CUDA (f32), padding indices included.
//   CudaMoeOrder:  the device layout (stable counting sort, PFT and padded) equals the CPU's
//                  exactly: token_ids, expert_ids, combine_weights, slot_to_row, counts, drops.
//   CudaMoeAux:    two ranks' aux statistics, gathered and finalised on the device, give the
//                  whole batch's terms and f_e, and the denominators of two ranks.
//   CudaMoeLayer:  the same MoELayer (same seed, same input) on the CPU and on CUDA, two training
//                  steps (the sigmoid gate's bias is updated between them): output, dx, every
//                  parameter gradient, aux terms, tokens_per_expert, load and drops.
//
// Tolerances (normalised error ||a - b|| / ||b|| over a whole tensor):
//   f32  1e-5: the same math in another order (cuBLAS tiles, warp trees) gives ~1e-7 per element;
//        an indexing or routing bug gives errors of order 1.
//   bf16 2e-2: activations are bf16 (the CPU reference gets the same bf16-rounded x and dy, in
//        f32); bf16 rounding of stored intermediates is 2^-9 relative, a few 1e-3 after forward
//        and backward through two GEMMs; 2e-2 is 5-10x that.
// Routing must agree exactly (it is discrete): the router runs in f32 on both sides (also with
// bf16 activations) and its weights are large (init_std 0.5) so the top-k gaps are far above
// rounding; the tests check the expert choice exactly before comparing values.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "cuda_testing.h"
#include "gradcheck.h"
#include "xmoe/backend/cuda/moe_kernels.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/rng.h"
#include "xmoe/moe/layer.h"
#include "xmoe/moe/losses.h"
#include "xmoe/moe/order.h"
#include "xmoe/ops/dispatch.h"
#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"

namespace {

using xmoe::testing::host_f32;
using xmoe::testing::kCuda;
using xmoe::testing::normalised_error;

using namespace xmoe;
using namespace xmoe::moe;
using xmoe::ops::gather_rows_masked;
using xmoe::ops::gather_sum_rows;
using xmoe::ops::gather_weighted_rows_dot;
using xmoe::ops::l2_normalize_rows;
using xmoe::ops::l2_normalize_rows_backward;
using xmoe::ops::L2NormResult;
using xmoe::ops::put_along_rows_add;
using xmoe::ops::renormalize_rows;
using xmoe::ops::renormalize_rows_backward;
using xmoe::ops::row_dot_f32;
using xmoe::ops::scale_rows_;
using xmoe::ops::scatter_add_rows_masked;
using xmoe::ops::take_along_rows;
using xmoe::ops::transpose;
using xmoe::ops::WeightedGather;
using xmoe::testing::randn;

#define EXPECT_CLOSE(got, ref, tol, what)                                  \
  do {                                                                     \
    const double err_ = normalised_error(got, ref);                        \
    std::printf("[parity] %-48s %.3e\n", std::string(what).c_str(), err_); \
    EXPECT_LE(err_, tol) << what;                                          \
  } while (0)

/// Random distinct top-k expert ids per token; `skew` sends most pairs to the first experts.
Tensor random_topk(int64_t T, int64_t k, int64_t E, uint64_t seed, bool skew = false) {
  Rng rng(seed);
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> perm(static_cast<size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t i = E - 1; i > 0; --i)
      std::swap(perm[i], perm[rng.below(static_cast<uint64_t>(i + 1))]);
    if (skew && rng.uniform() < 0.7f) std::sort(perm.begin(), perm.begin() + std::min(E, k + 2));
    idx.insert(idx.end(), perm.begin(), perm.begin() + k);
  }
  return Tensor::from_vector(idx, {T, k});
}

Tensor bf16_rounded(const Tensor& x) {
  return x.to(DType::bf16).to(DType::f32);
}

// ---- ops ---------------------------------------------------------------------------------------

TEST(CudaMoeOps, MatchCpu) {
  XMOE_REQUIRE_CUDA();
  const int64_t N = 37, d = 19, E = 11, k = 3;
  Tensor x = randn({N, d}, 1);
  std::vector<int32_t> iv = {3,  -1, 0,  36, 5,  5,  -1, 12, 20, 0,  1,  2, 35, -1,
                             7,  8,  9,  10, 11, 30, 31, 32, 33, 34, 36, 4, 6,  13,
                             14, 15, 16, 17, 18, 19, 21, 22, 23, 24, 25, 26};
  Tensor index = Tensor::from_vector(iv, {static_cast<int64_t>(iv.size())});
  const int64_t M = index.numel();
  {
    Tensor ref = gather_rows_masked(x, index);
    EXPECT_CLOSE(gather_rows_masked(x.to(kCuda), index.to(kCuda)), ref, 1e-6, "gather_rows_masked");
  }
  {
    Tensor src = randn({M, d}, 2), w = randn({M}, 3);
    Tensor ref = randn({N, d}, 4), got = ref.to(kCuda);
    scatter_add_rows_masked(ref, src, index, w);
    scatter_add_rows_masked(got, src.to(kCuda), index.to(kCuda), w.to(kCuda));
    EXPECT_CLOSE(got, ref, 1e-6, "scatter_add_rows_masked");
  }
  {
    // Each output row names up to k of x's rows (-1: none), in any order; the warp ranks them.
    std::vector<int32_t> sv(iv.begin(), iv.begin() + 13 * k);
    Tensor slots = Tensor::from_vector(sv, {13, k}), w = randn({N}, 8);
    for (const bool weighted : {false, true}) {
      Tensor ref = gather_sum_rows(x, slots, weighted ? w : Tensor());
      Tensor got = gather_sum_rows(x.to(kCuda), slots.to(kCuda), weighted ? w.to(kCuda) : Tensor());
      EXPECT_CLOSE(got, ref, 1e-6, "gather_sum_rows");
    }
    // 16-byte rows: the vector path, f32 and bf16 (d = 1000: a partial last column pass).
    const int64_t dv = 1000;
    Tensor xv = randn({N, dv}, 9);
    Tensor ref = gather_sum_rows(xv, slots, w);
    EXPECT_CLOSE(gather_sum_rows(xv.to(kCuda), slots.to(kCuda), w.to(kCuda)), ref, 1e-5,
                 "gather_sum_rows vec");
    Tensor rb = gather_sum_rows(bf16_rounded(xv), slots, w);
    EXPECT_CLOSE(
        gather_sum_rows(ops::cast(xv.to(kCuda), DType::bf16), slots.to(kCuda), w.to(kCuda)), rb,
        2e-2, "gather_sum_rows bf16");
    // With an addend (the shared experts' output): both paths, f32 and bf16.
    Tensor add = randn({13, dv}, 10), add_s = randn({13, d}, 11);
    EXPECT_CLOSE(gather_sum_rows(xv.to(kCuda), slots.to(kCuda), w.to(kCuda), add.to(kCuda)),
                 gather_sum_rows(xv, slots, w, add), 1e-5, "gather_sum_rows vec addend");
    EXPECT_CLOSE(gather_sum_rows(x.to(kCuda), slots.to(kCuda), w.to(kCuda), add_s.to(kCuda)),
                 gather_sum_rows(x, slots, w, add_s), 1e-5, "gather_sum_rows addend");
    EXPECT_CLOSE(gather_sum_rows(ops::cast(xv.to(kCuda), DType::bf16), slots.to(kCuda), w.to(kCuda),
                                 ops::cast(add.to(kCuda), DType::bf16)),
                 gather_sum_rows(bf16_rounded(xv), slots, w, bf16_rounded(add)), 2e-2,
                 "gather_sum_rows bf16 addend");
    Tensor gref = gather_rows_masked(xv, index);
    EXPECT_CLOSE(gather_rows_masked(xv.to(kCuda), index.to(kCuda)), gref, 0, "gather_rows vec");
    EXPECT_CLOSE(gather_rows_masked(ops::cast(xv.to(kCuda), DType::bf16), index.to(kCuda)),
                 gather_rows_masked(bf16_rounded(xv), index), 0, "gather_rows vec bf16");
  }
  {
    Tensor w = randn({N}, 5), ref = x.clone(), got = x.to(kCuda);
    scale_rows_(ref, w);
    scale_rows_(got, w.to(kCuda));
    EXPECT_CLOSE(got, ref, 1e-6, "scale_rows_");
    Tensor gb = ops::cast(x.to(kCuda), DType::bf16);
    scale_rows_(gb, w.to(kCuda));
    Tensor rb = bf16_rounded(x);
    scale_rows_(rb, w);
    EXPECT_CLOSE(gb, rb, 2e-2, "scale_rows_ bf16");
  }
  {
    Tensor a = randn({N, d}, 6), b = randn({N, d}, 7);
    EXPECT_CLOSE(row_dot_f32(a.to(kCuda), b.to(kCuda)), ops::row_dot(a, b), 1e-5, "row_dot_f32");
  }
  // The fused I-Order backward against the CPU's gather + dot + scale: the scalar path (d = 19)
  // and the 16-byte path (d = 64, and 2056: a lane's last piece short), f32 rows, and bf16
  // rows with f32 or bf16 dy; -1 slots.
  for (const int64_t dd : {d, int64_t{64}, int64_t{2056}}) {
    Tensor dy = randn({N, dd}, 12), rows = randn({M, dd}, 13), w = randn({M}, 14);
    const WeightedGather ref = gather_weighted_rows_dot(dy, rows, index, w);
    const WeightedGather got =
        gather_weighted_rows_dot(dy.to(kCuda), rows.to(kCuda), index.to(kCuda), w.to(kCuda));
    EXPECT_CLOSE(got.d_rows, ref.d_rows, 1e-6, "gather_weighted_rows_dot rows");
    EXPECT_CLOSE(got.dot, ref.dot, 1e-5, "gather_weighted_rows_dot dot");
    const Tensor rows_b = ops::cast(rows.to(kCuda), DType::bf16);
    const WeightedGather ref_b =
        gather_weighted_rows_dot(bf16_rounded(dy), bf16_rounded(rows), index, w);
    for (const Tensor& dyc : {dy.to(kCuda), ops::cast(dy.to(kCuda), DType::bf16)}) {
      const WeightedGather gb = gather_weighted_rows_dot(dyc, rows_b, index.to(kCuda), w.to(kCuda));
      EXPECT_CLOSE(gb.d_rows, ref_b.d_rows, 2e-2, "gather_weighted_rows_dot bf16 rows");
      EXPECT_CLOSE(gb.dot, ref_b.dot, 2e-2, "gather_weighted_rows_dot bf16 dot");
    }
    // In place (the I-Order backward with a sole expert output): the same values, in rows.
    Tensor in_place = rows.to(kCuda);
    const WeightedGather gi =
        gather_weighted_rows_dot(dy.to(kCuda), in_place, index.to(kCuda), w.to(kCuda), true);
    EXPECT_TRUE(gi.d_rows.shares_storage(in_place));
    EXPECT_CLOSE(gi.d_rows, ref.d_rows, 1e-6, "gather_weighted_rows_dot in place rows");
    EXPECT_CLOSE(gi.dot, ref.dot, 1e-5, "gather_weighted_rows_dot in place dot");
  }
  Tensor scores = randn({N, E}, 8);
  Tensor idx = random_topk(N, k, E, 9);
  {
    EXPECT_CLOSE(take_along_rows(scores.to(kCuda), idx.to(kCuda)), take_along_rows(scores, idx),
                 0.0, "take_along_rows");
    Tensor src = randn({N, k}, 10), ref = randn({N, E}, 11), got = ref.to(kCuda);
    put_along_rows_add(ref, idx, src);
    put_along_rows_add(got, idx.to(kCuda), src.to(kCuda));
    EXPECT_CLOSE(got, ref, 1e-6, "put_along_rows_add");
  }
  EXPECT_CLOSE(transpose(x.to(kCuda)), transpose(x), 0.0, "transpose");
  {
    L2NormResult ref = l2_normalize_rows(x), got = l2_normalize_rows(x.to(kCuda));
    EXPECT_CLOSE(got.y, ref.y, 1e-6, "l2_normalize_rows y");
    EXPECT_CLOSE(got.norm, ref.norm, 1e-6, "l2_normalize_rows norm");
    Tensor dy = randn({N, d}, 12);
    EXPECT_CLOSE(l2_normalize_rows_backward(got.y, got.norm, dy.to(kCuda)),
                 l2_normalize_rows_backward(ref.y, ref.norm, dy), 1e-5,
                 "l2_normalize_rows_backward");
  }
  {
    Tensor v = ops::sigmoid(scores), sr, sg;
    Tensor ref = renormalize_rows(v, 2.5f, sr), got = renormalize_rows(v.to(kCuda), 2.5f, sg);
    EXPECT_CLOSE(got, ref, 1e-6, "renormalize_rows");
    EXPECT_CLOSE(sg, sr, 1e-6, "renormalize_rows sums");
    Tensor dw = randn({N, E}, 13);
    EXPECT_CLOSE(renormalize_rows_backward(got, sg, dw.to(kCuda), 2.5f),
                 renormalize_rows_backward(ref, sr, dw, 2.5f), 1e-5, "renormalize_rows_backward");
  }
}

// ---- order -------------------------------------------------------------------------------------

void expect_same_layout(const TokenLayout& got, const TokenLayout& ref, const std::string& what) {
  EXPECT_EQ(got.token_ids.to_vector<int32_t>(), ref.token_ids.to_vector<int32_t>()) << what;
  EXPECT_EQ(got.expert_ids.to_vector<int32_t>(), ref.expert_ids.to_vector<int32_t>()) << what;
  EXPECT_EQ(got.combine_weights.to_vector<float>(), ref.combine_weights.to_vector<float>()) << what;
  EXPECT_EQ(got.slot_to_row.to_vector<int32_t>(), ref.slot_to_row.to_vector<int32_t>()) << what;
  EXPECT_EQ(got.tokens_per_expert, ref.tokens_per_expert) << what;
  EXPECT_EQ(got.group_sizes, ref.group_sizes) << what;
  EXPECT_EQ(got.load, ref.load) << what;
  EXPECT_EQ(got.dropped, ref.dropped) << what;
  EXPECT_EQ(got.capacity, ref.capacity) << what;
  EXPECT_EQ(got.padded, ref.padded) << what;
}

TEST(CudaMoeOrder, DeviceLayoutEqualsTheCpuCountingSort) {
  XMOE_REQUIRE_CUDA();
  struct Case {
    int64_t T, k, E;
    bool skew;
    std::string impl;
    float cf;
  };
  // Several 128-pair chunks with a ragged end, many experts, skewed loads, empty experts; the
  // scan's chunk slices (E < 1024: 27 slices of E = 37, 16 of moe-1b's 768 chunks at E = 64)
  // and its one-thread-per-expert form (E = 700, E = 1500 > its 1024 threads).
  const std::vector<Case> cases = {
      {3001, 4, 37, false, "pft", 1.f},    {2048, 8, 256, true, "pft", 1.f},
      {5, 2, 64, false, "pft", 1.f},       {16384, 6, 64, true, "pft", 1.f},
      {700, 4, 700, false, "pft", 1.f},    {900, 3, 1500, true, "pft", 1.f},
      {1500, 2, 16, true, "padded", 0.8f}, {1500, 2, 16, false, "padded", 2.0f}};
  for (const Case& c : cases) {
    const std::string what = c.impl + " T=" + std::to_string(c.T) + " k=" + std::to_string(c.k) +
                             " E=" + std::to_string(c.E);
    MoeConfig cfg;
    cfg.num_experts = static_cast<int>(c.E);
    cfg.top_k = static_cast<int>(c.k);
    cfg.impl = c.impl;
    cfg.capacity_factor = c.cf;
    Tensor idx = random_topk(c.T, c.k, c.E, 21, c.skew);
    Tensor w = randn({c.T, c.k}, 22);
    Tensor x = randn({c.T, 6}, 23);
    auto ref_order = make_order(cfg), dev_order = make_order(cfg);
    Tensor ref_rows = ref_order->forward(x, idx, w);
    Tensor rows = dev_order->forward(x.to(kCuda), idx.to(kCuda), w.to(kCuda));
    const TokenLayout& l = dev_order->layout();
    EXPECT_TRUE(!l.token_ids.is_cpu() && !l.slot_to_row.is_cpu()) << what;
    expect_same_layout(l, ref_order->layout(), what);
    EXPECT_CLOSE(rows, ref_rows, 0.0, what + " rows");
    // PFT invariants, checked directly: expert ids non-decreasing; rows of an expert in
    // (token, slot) order; slot_to_row inverts the layout.
    const auto tok = l.token_ids.to_vector<int32_t>(), ex = l.expert_ids.to_vector<int32_t>();
    const auto s2r = l.slot_to_row.to_vector<int32_t>();
    const auto ids = idx.to_vector<int32_t>();
    EXPECT_TRUE(std::is_sorted(ex.begin(), ex.end())) << what;
    for (int64_t i = 0; i < c.T * c.k; ++i) {
      if (s2r[i] < 0) continue;
      EXPECT_EQ(tok[s2r[i]], i / c.k) << what;
      EXPECT_EQ(ex[s2r[i]], ids[i]) << what;
    }
    // Backward: dx and d_topk_weight match too.
    Tensor d_rows = randn(ref_rows.shape(), 24), dcw = randn({l.num_rows()}, 25);
    Order::Grads gr = ref_order->backward(d_rows, dcw);
    Order::Grads gg = dev_order->backward(d_rows.to(kCuda), dcw.to(kCuda));
    EXPECT_CLOSE(gg.dx, gr.dx, 1e-6, what + " dx");
    EXPECT_CLOSE(gg.d_topk_weight, gr.d_topk_weight, 0.0, what + " d_topk_weight");
  }
}

TEST(CudaMoeOrder, BadExpertIdThrowsTheCpuMessage) {
  XMOE_REQUIRE_CUDA();
  MoeConfig cfg;
  cfg.num_experts = 4;
  cfg.top_k = 2;
  auto order = make_order(cfg);
  Tensor idx = Tensor::from_vector<int32_t>({0, 1, 2, 9, 3, 0}, {3, 2});
  Tensor w = randn({3, 2}, 1), x = randn({3, 5}, 2);
  try {
    order->forward(x.to(kCuda), idx.to(kCuda), w.to(kCuda));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("topk_idx holds expert 9 outside [0, 4)"),
              std::string::npos)
        << e.what();
  }
}

// ---- aux losses over ranks --------------------------------------------------------------------

TEST(CudaMoeAux, TwoRanksFinaliseToTheWholeBatch) {
  XMOE_REQUIRE_CUDA();
  const int64_t T = 96, E = 12, k = 3, L = 16, half = T / 2, n = 2 * E + 4;
  Tensor probs = xmoe::ops::softmax(randn({T, E}, 41)), z = randn({T, E}, 42);
  Tensor idx = random_topk(T, k, E, 43, /*skew=*/true);
  const AuxLossWeights w{0.5f, 0.25f, 0.125f};
  AuxLossState ref_st;
  const AuxLossTerms ref = aux_losses(probs, idx, z, L, w, ref_st);  // one process, all of T

  // Each "rank" reduces its half on the device into its row of the gathered [2, n] statistics.
  Tensor dp = probs.to(kCuda), dz = z.to(kCuda), di = idx.to(kCuda);
  Tensor all = Tensor::empty({2, n}, DType::f64, kCuda);
  const cuda::Stream stream = xmoe::ops::detail::stream_of(dp);
  for (int64_t r = 0; r < 2; ++r) {
    Tensor seq_count = Tensor::empty({half / L, E}, DType::f32, kCuda);
    Tensor seq_psum = Tensor::empty({half / L, E}, DType::f64, kCuda);
    Tensor scratch = Tensor::empty({cuda::moe_aux_stats_scratch(half, E, L)}, DType::f64, kCuda);
    cuda::moe_aux_stats(all.data<double>() + r * n, seq_count.data<float>(),
                        seq_psum.data<double>(), dp.data<float>() + r * half * E,
                        di.data<int32_t>() + r * half * k, dz.data<float>() + r * half * E, half, E,
                        k, L, scratch.data<double>(), stream);
  }
  Tensor terms = Tensor::empty({4}, DType::f64, kCuda),
         frac = Tensor::empty({E}, DType::f32, kCuda);
  Tensor denoms = Tensor::empty({3}, DType::f64, kCuda);
  cuda::moe_aux_finalize(terms.data<double>(), frac.data<float>(), denoms.data<double>(),
                         all.data<double>(), 2, E, k, L, w.load_balance, w.seq_balance, w.z_loss,
                         stream);
  const std::vector<double> t = terms.to_vector<double>(), dn = denoms.to_vector<double>();
  auto rel = [](double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); };
  EXPECT_LE(rel(t[0], ref.load_balance()), 1e-12);
  EXPECT_LE(rel(t[1], ref.seq_balance()), 1e-12);
  EXPECT_LE(rel(t[2], ref.z_loss()), 1e-12);
  EXPECT_LE(rel(t[3], ref.weighted()), 1e-12);
  const std::vector<float> f = frac.to_vector<float>();
  const std::vector<double> ref_frac = ref_st.frac.to_vector<double>();  // f64 on the CPU
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(f[e], static_cast<float>(ref_frac[e])) << e;
  // Two ranks: each rank's gradient is W times its share of the global one (moe/losses.h).
  const std::vector<double> ref_dn = ref_st.denoms.to_vector<double>();
  EXPECT_EQ(dn[0], ref_dn[0] / 2);
  EXPECT_EQ(dn[1], ref_dn[1] / 2);
  EXPECT_EQ(dn[2], ref_dn[2] / 2);
}

// The GShard routing's backward in one pass writes the bits of the passes it replaces (dv put
// into zeros, the aux terms, softmax's backward, the add), for each mix of aux weights, with the
// scale on the host or the device, an E that is not a multiple of 32, and on the CPU.
TEST(CudaMoeAux, SoftmaxRoutingBackwardIsThePassesItReplaces) {
  XMOE_REQUIRE_CUDA();
  for (const int64_t E : {int64_t{64}, int64_t{37}}) {
    const int64_t T = 96, k = 6, L = 32;
    const Tensor z = randn({T, E}, 51, 2.f).to(kCuda);
    const ops::SoftmaxTopKResult st = ops::softmax_topk(z, k);
    const Tensor dv = randn({T, k}, 52).to(kCuda);
    const Tensor scale = Tensor::full({1}, 0.37f, kCuda);
    for (const AuxLossWeights w :
         {AuxLossWeights{0.f, 0.f, 0.f}, AuxLossWeights{0.01f, 0.f, 0.f},
          AuxLossWeights{0.01f, 0.003f, 0.f}, AuxLossWeights{0.01f, 0.003f, 0.002f}}) {
      for (const bool on_device : {false, true}) {
        SCOPED_TRACE(fmt::format("E {} w {} {} {} device scale {}", E, w.load_balance,
                                 w.seq_balance, w.z_loss, on_device));
        AuxLossState state;
        aux_losses(st.probs, st.top.indices, z, L, w, state);
        const Tensor s = on_device ? scale : Tensor();
        Tensor dprobs = Tensor::zeros({T, E}, DType::f32, kCuda);
        Tensor dlogits = Tensor::zeros({T, E}, DType::f32, kCuda);
        ops::put_along_rows_add(dprobs, st.top.indices, dv);
        aux_losses_backward(z, state, w, dprobs, dlogits, s);
        ops::add_(dlogits, ops::softmax_backward(st.probs, dprobs));
        const Tensor fused = softmax_routing_backward(st.probs, st.top.indices, dv, z, state, w, s);
        EXPECT_EQ(fused.to_vector<float>(), dlogits.to_vector<float>());
        // the CPU's composition of the same ops, within f32 rounding
        AuxLossState cpu_state;
        const Tensor probs_h = st.probs.to(Device::cpu()), z_h = z.to(Device::cpu());
        const Tensor idx_h = st.top.indices.to(Device::cpu());
        aux_losses(probs_h, idx_h, z_h, L, w, cpu_state);
        EXPECT_CLOSE(fused,
                     softmax_routing_backward(probs_h, idx_h, dv.to(Device::cpu()), z_h, cpu_state,
                                              w, on_device ? scale.to(Device::cpu()) : Tensor()),
                     1e-5, "softmax_routing_backward");
      }
    }
  }
}

// ---- the layer ---------------------------------------------------------------------------------

struct LayerRun {
  std::vector<Tensor> y, dx;  // per step
  std::vector<std::string> names;
  std::vector<Tensor> grads;  // after both steps
  std::vector<AuxLossTerms> aux;
  std::vector<std::vector<int64_t>> tpe, load;
  std::vector<int64_t> dropped;
  std::vector<Tensor> topk_idx, token_ids;
};

constexpr int64_t kD = 16, kT = 64, kSeq = 16;

/// How the routed experts hold their weights on the device.
enum class ExpertWeights {
  f32,              ///< f32 values, cast to the activations' dtype per forward
  master_and_copy,  ///< f32 master + the bf16 compute copy a bf16 model keeps
  bf16_only,        ///< bf16 only (Parameter::drop_master_weights on the host)
};

/// Two steps of one MoELayer on `dev` with activations of `act`: forward, backward (dy), then
/// update_routing_bias (sigmoid gate). Parameters are built on the CPU and moved, as the model
/// does.
/// aux_scale: the aux losses' upstream gradient, a host float or (aux_scale_on_device) an f32 [1]
/// on dev that the kernels read (MoELayer::set_aux_grad_scale).
LayerRun run_layer(const MoeConfig& c, Device dev, DType act, const std::vector<Tensor>& xs,
                   const std::vector<Tensor>& dys, ExpertWeights weights = ExpertWeights::f32,
                   float aux_scale = 1.f, bool aux_scale_on_device = false) {
  MoELayer layer(c, kD, "moe", 7, 0.5f, 0.2f);
  for (Parameter* p : layer.parameters()) {
    const bool routed = p->kind == ParamKind::expert;
    if (routed && weights == ExpertWeights::bf16_only) p->drop_master_weights(DType::bf16);
    p->value = p->value.to(dev);
    p->grad = p->grad.to(dev);
    if (routed && weights == ExpertWeights::master_and_copy)
      p->compute_copy = ops::cast(p->value, DType::bf16);
  }
  LayerRun r;
  for (size_t s = 0; s < xs.size(); ++s) {
    Tensor x = xs[s].to(dev), dy = dys[s].to(dev);
    if (act == DType::bf16) {
      x = ops::cast(x, DType::bf16);
      dy = ops::cast(dy, DType::bf16);
    }
    Tensor y = layer.forward(x, kSeq);
    EXPECT_EQ(y.device(), dev);
    EXPECT_EQ(y.dtype(), act);
    r.token_ids.push_back(layer.layout().token_ids.to(Device::cpu()));
    r.topk_idx.push_back(layer.layout().slot_to_row.to(Device::cpu()));
    r.aux.push_back(layer.aux_terms());
    r.tpe.push_back(layer.tokens_per_expert());
    r.load.push_back(layer.expert_load());
    r.dropped.push_back(layer.dropped_tokens());
    if (aux_scale_on_device)
      layer.set_aux_grad_scale(1.f, Tensor::from_vector<float>({aux_scale}, {1}).to(dev));
    else
      layer.set_aux_grad_scale(aux_scale);
    Tensor dx = layer.backward(dy);
    EXPECT_EQ(dx.dtype(), act);
    r.y.push_back(host_f32(y));
    r.dx.push_back(host_f32(dx));
    layer.update_routing_bias();
  }
  for (Parameter* p : layer.parameters()) {
    r.names.push_back(p->name);
    r.grads.push_back(host_f32(p->grad));
  }
  return r;
}

void compare_runs(const LayerRun& got, const LayerRun& ref, double tol, const std::string& what) {
  for (size_t s = 0; s < ref.y.size(); ++s) {
    const std::string step = what + " step " + std::to_string(s);
    // Routing first: the comparisons below mean nothing if the expert choice differs.
    ASSERT_EQ(got.tpe[s], ref.tpe[s]) << step << ": tokens_per_expert";
    ASSERT_EQ(got.load[s], ref.load[s]) << step << ": load";
    ASSERT_EQ(got.dropped[s], ref.dropped[s]) << step << ": dropped";
    ASSERT_EQ(got.token_ids[s].to_vector<int32_t>(), ref.token_ids[s].to_vector<int32_t>())
        << step << ": token_ids";
    ASSERT_EQ(got.topk_idx[s].to_vector<int32_t>(), ref.topk_idx[s].to_vector<int32_t>())
        << step << ": slot_to_row";
    EXPECT_CLOSE(got.y[s], ref.y[s], tol, step + " y");
    EXPECT_CLOSE(got.dx[s], ref.dx[s], tol, step + " dx");
    const auto rel = [](double a, double b) {
      return std::abs(a - b) / std::max(std::abs(b), 1e-12);
    };
    // The aux terms come from the same router on both sides (also with bf16 activations).
    EXPECT_LE(rel(got.aux[s].load_balance(), ref.aux[s].load_balance()), 1e-5) << step;
    EXPECT_LE(rel(got.aux[s].seq_balance(), ref.aux[s].seq_balance()), 1e-5) << step;
    EXPECT_LE(rel(got.aux[s].z_loss(), ref.aux[s].z_loss()), 1e-5) << step;
    EXPECT_LE(rel(got.aux[s].weighted(), ref.aux[s].weighted()), 1e-5) << step;
  }
  ASSERT_EQ(got.names, ref.names);
  for (size_t i = 0; i < ref.grads.size(); ++i)
    EXPECT_CLOSE(got.grads[i], ref.grads[i], tol, what + " grad " + ref.names[i]);
}

struct LayerCase {
  std::string name;
  MoeConfig config;
};
void PrintTo(const LayerCase& c, std::ostream* os) {
  *os << c.name;
}

std::vector<LayerCase> layer_cases() {
  MoeConfig base;
  base.num_experts = 8;
  base.top_k = 2;
  base.expert_hidden = 12;
  base.num_shared_experts = 1;
  base.aux_loss_weight = 0.05f;
  base.seq_aux_loss_weight = 0.03f;
  base.z_loss_weight = 0.01f;
  std::vector<LayerCase> v;
  MoeConfig c = base;
  v.push_back({"softmax_topk_gshard", c});
  c = base;
  c.softmax_before_topk = false;
  c.num_shared_experts = 0;
  v.push_back({"softmax_topk_mixtral", c});
  c = base;
  c.gate = "sigmoid";
  c.num_groups = 4;
  c.topk_groups = 2;
  c.routed_scaling = 2.5f;
  c.bias_update_rate = 0.05f;
  v.push_back({"sigmoid_groups", c});
  c = base;
  c.gate = "switch";
  c.top_k = 1;
  v.push_back({"switch", c});
  c = base;
  c.gate = "xmoe";
  c.router_dim = 8;
  v.push_back({"xmoe", c});
  c = base;
  c.router_dtype = "bf16";  // the CPU rounds the router's operands as the tensor cores read them
  v.push_back({"softmax_topk_bf16_router", c});
  c = v[2].config;
  c.router_dtype = "bf16";
  v.push_back({"sigmoid_bf16_router", c});
  c = base;
  c.impl = "padded";
  c.capacity_factor = 0.75f;  // drops pairs
  v.push_back({"padded", c});
  c = base;
  c.expert_hidden = 24;  // f > d, its [N, f] activations in 3 row chunks (moe.expert_chunks)
  c.expert_chunks = 3;
  v.push_back({"expert_chunks", c});
  return v;
}

class CudaMoeLayer : public ::testing::TestWithParam<LayerCase> {};

TEST_P(CudaMoeLayer, F32MatchesCpu) {
  XMOE_REQUIRE_CUDA();
  const LayerCase& lc = GetParam();
  const std::vector<Tensor> xs = {randn({kT, kD}, 101), randn({kT, kD}, 102)};
  const std::vector<Tensor> dys = {randn({kT, kD}, 103), randn({kT, kD}, 104)};
  const LayerRun ref = run_layer(lc.config, Device::cpu(), DType::f32, xs, dys);
  const LayerRun got = run_layer(lc.config, kCuda, DType::f32, xs, dys);
  if (lc.config.impl == "padded") {
    EXPECT_GT(ref.dropped[0], 0);
  }  // the case exercises drops
  compare_runs(got, ref, 1e-5, lc.name + " f32");
}

TEST_P(CudaMoeLayer, Bf16ActivationsMatchCpuF32) {
  XMOE_REQUIRE_CUDA();
  const LayerCase& lc = GetParam();
  // The reference gets the same bf16-rounded inputs, in f32.
  const std::vector<Tensor> xs = {bf16_rounded(randn({kT, kD}, 101)),
                                  bf16_rounded(randn({kT, kD}, 102))};
  const std::vector<Tensor> dys = {bf16_rounded(randn({kT, kD}, 103)),
                                   bf16_rounded(randn({kT, kD}, 104))};
  const LayerRun ref = run_layer(lc.config, Device::cpu(), DType::f32, xs, dys);
  const LayerRun got = run_layer(lc.config, kCuda, DType::bf16, xs, dys);
  compare_runs(got, ref, 2e-2, lc.name + " bf16");
}

// bench_moe_layer --weights bf16: the routed experts' weights in bf16 only give the forward and
// backward of the f32 master weights with their bf16 compute copies (the same bf16 operands, so
// the same numbers up to bf16 rounding at most), holding 2 bytes per weight instead of 6.
TEST_P(CudaMoeLayer, Bf16OnlyExpertWeightsMatchTheMasterWeights) {
  XMOE_REQUIRE_CUDA();
  const LayerCase& lc = GetParam();
  const std::vector<Tensor> xs = {randn({kT, kD}, 101), randn({kT, kD}, 102)};
  const std::vector<Tensor> dys = {randn({kT, kD}, 103), randn({kT, kD}, 104)};
  const LayerRun ref =
      run_layer(lc.config, kCuda, DType::bf16, xs, dys, ExpertWeights::master_and_copy);
  // Everything the run allocated is freed with it (a LayerRun keeps its aux-loss terms on the
  // device, so the check is on a run that has gone out of scope).
  const int64_t live = memory_stats(kCuda).live_bytes;
  { run_layer(lc.config, kCuda, DType::bf16, xs, dys, ExpertWeights::bf16_only); }
  EXPECT_EQ(memory_stats(kCuda).live_bytes, live);
  const LayerRun got = run_layer(lc.config, kCuda, DType::bf16, xs, dys, ExpertWeights::bf16_only);
  compare_runs(got, ref, 1e-2, lc.name + " bf16-only weights");
  {
    MoELayer layer(lc.config, kD, "moe", 7, 0.5f, 0.2f);
    int64_t elems = 0;
    const int64_t base = memory_stats(kCuda).live_bytes;
    for (Parameter* p : layer.experts().parameters()) {
      p->drop_master_weights(DType::bf16);
      p->value = p->value.to(kCuda);
      elems += p->value.numel();
      EXPECT_EQ(p->value.dtype(), DType::bf16);
      EXPECT_FALSE(p->compute_copy.defined());
    }
    EXPECT_EQ(memory_stats(kCuda).live_bytes - base, 2 * elems);
  }
}

TEST_P(CudaMoeLayer, DeterministicRunToRun) {
  XMOE_REQUIRE_CUDA();
  const LayerCase& lc = GetParam();
  const std::vector<Tensor> xs = {randn({kT, kD}, 101)}, dys = {randn({kT, kD}, 103)};
  const LayerRun a = run_layer(lc.config, kCuda, DType::f32, xs, dys);
  const LayerRun b = run_layer(lc.config, kCuda, DType::f32, xs, dys);
  EXPECT_EQ(a.y[0].to_vector<float>(), b.y[0].to_vector<float>());
  EXPECT_EQ(a.dx[0].to_vector<float>(), b.dx[0].to_vector<float>());
  for (size_t i = 0; i < a.grads.size(); ++i)
    EXPECT_EQ(a.grads[i].to_vector<float>(), b.grads[i].to_vector<float>()) << a.names[i];
}

// The aux losses' upstream gradient left on the device (xmoe.torch's d_aux: no host wait) gives
// the bits of the same factor passed as a host float; and it is used (a factor of 1 differs).
TEST_P(CudaMoeLayer, AuxGradScaleOnTheDeviceIsTheHostScale) {
  XMOE_REQUIRE_CUDA();
  const LayerCase& lc = GetParam();
  const std::vector<Tensor> xs = {randn({kT, kD}, 101)}, dys = {randn({kT, kD}, 103)};
  const auto run = [&](float scale, bool on_device) {
    return run_layer(lc.config, kCuda, DType::f32, xs, dys, ExpertWeights::f32, scale, on_device);
  };
  const LayerRun host = run(0.37f, false), device = run(0.37f, true), one = run(1.f, false);
  EXPECT_EQ(device.dx[0].to_vector<float>(), host.dx[0].to_vector<float>());
  bool differs = false;
  for (size_t i = 0; i < host.grads.size(); ++i) {
    EXPECT_EQ(device.grads[i].to_vector<float>(), host.grads[i].to_vector<float>())
        << host.names[i];
    differs |= one.grads[i].to_vector<float>() != host.grads[i].to_vector<float>();
  }
  EXPECT_TRUE(differs) << "the aux gradient's scale changed no gradient";
}

INSTANTIATE_TEST_SUITE_P(Gates, CudaMoeLayer, ::testing::ValuesIn(layer_cases()),
                         [](const ::testing::TestParamInfo<LayerCase>& i) { return i.param.name; });

// moe.shared_overlap: the shared experts on a side stream beside the routed path (routing, all)
// give the bits of the in-line run (off; the same kernels, each stream in order), over two
// training steps of two stacked layers at a size where the two streams' kernels do overlap
// (bf16 activations, 8192 tokens, d 512, two shared experts of 512). The layers share the
// device's one side stream (SideStream::for_device). A missing join or a block reused across
// the streams shows as differing bits.
TEST(CudaMoeSharedOverlap, SideStreamGivesTheInlineBits) {
  XMOE_REQUIRE_CUDA();
  const int64_t tokens = 8192, d = 512;
  MoeConfig c;
  c.num_experts = 16;
  c.top_k = 4;
  c.expert_hidden = 512;
  c.num_shared_experts = 2;
  c.aux_loss_weight = 0.01f;
  struct Run {
    std::vector<std::vector<float>> y, dx, grads;
  };
  const auto run = [&](const char* overlap) {
    c.shared_overlap = overlap;
    MoELayer first(c, d, "moe0", 11, 0.05f, 0.02f), second(c, d, "moe1", 12, 0.05f, 0.02f);
    for (MoELayer* layer : {&first, &second}) {
      for (Parameter* p : layer->parameters()) {
        p->value = p->value.to(kCuda);
        p->grad = p->grad.to(kCuda);
      }
    }
    Run r;
    for (uint64_t step = 0; step < 2; ++step) {
      const Tensor x = ops::cast(randn({tokens, d}, 300 + step).to(kCuda), DType::bf16);
      const Tensor dy = ops::cast(randn({tokens, d}, 400 + step).to(kCuda), DType::bf16);
      const Tensor y = second.forward(ops::cast(first.forward(x, 1024), DType::bf16), 1024);
      r.y.push_back(host_f32(y).to_vector<float>());
      first.set_aux_grad_scale(1.f);
      second.set_aux_grad_scale(1.f);
      const Tensor dh = ops::cast(second.backward(dy), DType::bf16);
      r.dx.push_back(host_f32(first.backward(dh)).to_vector<float>());
    }
    for (MoELayer* layer : {&first, &second})
      for (Parameter* p : layer->parameters())
        r.grads.push_back(host_f32(p->grad).to_vector<float>());
    return r;
  };
  const Run inline_run = run("off");
  for (const char* overlap : {"routing", "all"}) {
    SCOPED_TRACE(std::string("shared_overlap = ") + overlap);
    const Run side = run(overlap);
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_EQ(side.y[s], inline_run.y[s]) << "y, step " << s;
      EXPECT_EQ(side.dx[s], inline_run.dx[s]) << "dx, step " << s;
    }
    ASSERT_EQ(side.grads.size(), inline_run.grads.size());
    for (size_t i = 0; i < side.grads.size(); ++i)
      EXPECT_EQ(side.grads[i], inline_run.grads[i]) << "gradient " << i;
  }
}

TEST(CudaMoeLayerFrozen, FrozenRoutingOnTheDevice) {
  XMOE_REQUIRE_CUDA();
  MoeConfig c = layer_cases()[0].config;
  MoELayer layer(c, kD, "moe", 7, 0.5f);
  for (Parameter* p : layer.parameters()) {
    p->value = p->value.to(kCuda);
    p->grad = p->grad.to(kCuda);
  }
  Tensor x = randn({kT, kD}, 1).to(kCuda);
  layer.forward(x, kSeq);
  const auto first = layer.layout().slot_to_row.to_vector<int32_t>();
  layer.release();
  layer.set_frozen_routing(true);
  Tensor x2 = randn({kT, kD}, 2).to(kCuda);  // other tokens: the frozen choice is kept
  layer.forward(x2, kSeq);
  EXPECT_EQ(layer.layout().slot_to_row.to_vector<int32_t>(), first);
  layer.release();
}

}  // namespace
