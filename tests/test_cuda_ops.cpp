// CUDA backend tests (ggml test-backend-ops style). Every op runs on the CPU (the f32 reference)
// and on CUDA in f32 and in bf16; outputs are compared by normalised error ||a - b|| / ||b||.
// Adding an op is one entry in parity_cases(). Without a CUDA device every test skips, saying
// why; CudaBuild.ClearErrors also runs there and checks the error a CUDA tensor gives.
//
// Tolerances (normalised error over a whole output):
//   f32  1e-5: same math in a different order (cuBLAS tiles, warp trees, FMA contraction) gives
//        relative differences around 1e-7 * sqrt(terms); 1e-5 leaves a wide margin and still
//        catches any indexing bug (which gives errors of order 1).
//   bf16 2e-2: the bf16 run gets the same bf16-rounded inputs as its reference, so what differs
//        is the rounding of bf16 outputs (and bf16 intermediates an op stores): 2^-9 = 2e-3
//        relative per element, a few 1e-3 after a chained forward + backward; 2e-2 is 5-10x that.
//   Integer outputs (top-k indices) must match exactly; bf16 ties are identical on both sides
//   because both see the same rounded values.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cuda_testing.h"
#include "gradcheck.h"
#include "xmoe/backend/cuda/kernels.h"
#include "xmoe/backend/cuda/runtime.h"
#include "xmoe/core/allocator.h"
#include "xmoe/core/device_api.h"
#include "xmoe/core/device_timeline.h"
#include "xmoe/core/rng.h"
#include "xmoe/core/timer.h"
#include "xmoe/ops/model_ops.h"
#include "xmoe/ops/moe.h"
#include "xmoe/ops/ops.h"
#include "xmoe/ops/optim.h"

namespace {

using xmoe::testing::host_f32;
using xmoe::testing::kCuda;
using xmoe::testing::normalised_error;

using namespace xmoe;
using ops::AttentionResult;
using xmoe::testing::randn;

Tensor scalar(double v) {
  return Tensor::from_vector<float>({static_cast<float>(v)}, {1});
}

/// i32 [n] with values in [0, limit) (repeats likely), or -1 with probability `ignore`.
Tensor rand_index(int64_t n, int64_t limit, uint64_t seed, float ignore = 0.f) {
  Rng rng(seed, 7);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v)
    x = rng.uniform() < ignore ? -1 : static_cast<int32_t>(rng.below(static_cast<uint64_t>(limit)));
  return Tensor::from_vector<int32_t>(v, {n});
}

/// Normal values rounded to quarters: many exact ties, for top-k's tie rule.
Tensor rand_ties(Shape shape, uint64_t seed) {
  Tensor t = randn(std::move(shape), seed, 2.f);
  for (float& x : t.span<float>()) x = std::round(x * 4.f) / 4.f;
  return t;
}

// ---- the case list --------------------------------------------------------------------------

using Tensors = std::vector<Tensor>;

struct OpCase {
  std::string name;
  std::function<Tensors()> inputs;       ///< CPU f32 (and i32) tensors
  std::function<Tensors(Tensors&)> run;  ///< runs on the inputs' device; may modify them
  std::vector<int> keep_f32 = {};        ///< inputs that stay f32 in the bf16 run
  double tol_f32 = 1e-5;
  double tol_bf16 = 2e-2;
};

std::ostream& operator<<(std::ostream& os, const OpCase& c) {
  return os << c.name;
}

Device device_of(const Tensors& in) {
  return in.at(0).device();
}

std::vector<int64_t> kGroups = {5, 0, 9, 1, 0, 13};  // 28 rows, empty groups included

/// Inputs x, dy, dw_acc, dw: the weight gradient of `sizes`, accumulated into dw_acc and
/// overwriting dw.
std::function<Tensors(Tensors&)> weight_grad_both_ways(std::vector<int64_t> sizes) {
  return [sizes = std::move(sizes)](Tensors& in) {
    ops::grouped_matmul_weight_grad(in[2], in[0], in[1], sizes, true);
    ops::grouped_matmul_weight_grad(in[3], in[0], in[1], sizes, false);
    return Tensors{in[2], in[3]};
  };
}

/// An f32 copy (on the CPU) of an f64 tensor; f32 tensors as they are. The CPU keeps some MoE
/// statistics in f64 where CUDA keeps f32 (ops::MoeAuxTerms::frac).
Tensor f32_of(const Tensor& t) {
  if (t.dtype() != DType::f64) return t;
  const std::vector<double> v = t.to_vector<double>();
  return Tensor::from_vector(std::vector<float>(v.begin(), v.end()), t.shape());
}

/// Each element of an f64 tensor as a scalar output.
void push_scalars(Tensors& out, const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(scalar(t.item(i)));
}

// Router aux losses (moe/losses.h): T = 96 tokens in sequences of 16, E = 11, k = 3.
constexpr int64_t kAuxT = 96, kAuxE = 11, kAuxK = 3, kAuxL = 16;
constexpr float kAuxLb = 0.07f, kAuxSeq = 0.13f, kAuxZ = 0.011f;

/// Inputs probs, topk_idx, z_logits, dprobs, dlogits.
Tensors aux_inputs() {
  return Tensors{ops::softmax(randn({kAuxT, kAuxE}, 80, 2.f)),
                 rand_index(kAuxT * kAuxK, kAuxE, 81).reshape({kAuxT, kAuxK}),
                 randn({kAuxT, kAuxE}, 82, 2.f), randn({kAuxT, kAuxE}, 83),
                 randn({kAuxT, kAuxE}, 84)};
}

/// One process of the whole batch (stats, finalize, backward into in[3], in[4]), then the same
/// batch as two ranks of half each: their stats gathered into [2, 2E + 4] and finalized (the
/// sums added in rank order), and rank 0's backward with the two-rank denominators.
Tensors aux_run(Tensors& in) {
  const Device dev = device_of(in);
  Tensors out;
  const ops::MoeAuxStats s = ops::moe_aux_stats(in[0], in[1], in[2], kAuxL);
  const ops::MoeAuxTerms t = ops::moe_aux_finalize(s.stats, kAuxK, kAuxL, kAuxLb, kAuxSeq, kAuxZ);
  ops::moe_aux_backward(in[3], in[4], in[2], t.frac, s.seq_count, t.denoms, kAuxL, kAuxK, kAuxLb,
                        kAuxSeq, kAuxZ);
  push_scalars(out, t.terms);
  push_scalars(out, t.denoms);
  out.insert(out.end(), {f32_of(t.frac), s.seq_count, in[3], in[4]});

  const int64_t half = kAuxT / 2;
  Tensor all = Tensor::empty({2, 2 * kAuxE + 4}, DType::i64, dev);
  Tensor seq_count0;
  for (int64_t r = 0; r < 2; ++r) {
    const ops::MoeAuxStats sr = ops::moe_aux_stats(in[0].rows(r * half, (r + 1) * half),
                                                   in[1].rows(r * half, (r + 1) * half),
                                                   in[2].rows(r * half, (r + 1) * half), kAuxL);
    all.rows(r, r + 1).copy_from(sr.stats);
    if (r == 0) seq_count0 = sr.seq_count;
  }
  const ops::MoeAuxTerms t2 = ops::moe_aux_finalize(all, kAuxK, kAuxL, kAuxLb, kAuxSeq, kAuxZ);
  Tensor dprobs = randn({half, kAuxE}, 85).to(dev), dlogits = randn({half, kAuxE}, 86).to(dev);
  ops::moe_aux_backward(dprobs, dlogits, in[2].rows(0, half), t2.frac, seq_count0, t2.denoms, kAuxL,
                        kAuxK, kAuxLb, kAuxSeq, kAuxZ);
  push_scalars(out, t2.terms);
  push_scalars(out, t2.denoms);
  out.insert(out.end(), {f32_of(t2.frac), dprobs, dlogits});
  return out;
}

// Optimizer ops over 50 tensors: more than one multi-tensor launch (48 per launch).
constexpr int64_t kListLen = 50;

int64_t list_numel(int64_t i) {
  return (i * 37) % 301 + 1;
}

/// 50 tensors of assorted sizes (inputs [first, first + 50)).
Tensors rand_list(uint64_t seed, bool non_negative = false) {
  Tensors xs;
  for (int64_t i = 0; i < kListLen; ++i) {
    Tensor x = randn({list_numel(i)}, seed + static_cast<uint64_t>(i));
    if (non_negative)
      for (float& v : x.span<float>()) v *= v;
    xs.push_back(x);
  }
  return xs;
}

/// The tensors of a list flattened into one (the first one's device and dtype): one
/// comparison per list.
Tensor concat(const std::vector<Tensor>& xs) {
  int64_t total = 0;
  for (const Tensor& x : xs) total += x.numel();
  Tensor out = Tensor::empty({total}, xs.at(0).dtype(), xs[0].device());
  for (int64_t offset = 0; const Tensor& x : xs) {
    out.rows(offset, offset + x.numel()).copy_from(x);
    offset += x.numel();
  }
  return out;
}

/// Indices [first, first + 50).
std::vector<int> list_indices(int first) {
  std::vector<int> v;
  for (int i = 0; i < kListLen; ++i) v.push_back(first + i);
  return v;
}

/// The AdamW cases' inputs: params, grads, m, v (kListLen each).
Tensors adamw_inputs() {
  Tensors in = rand_list(100), g = rand_list(200), m = rand_list(300), v = rand_list(400, true);
  in.insert(in.end(), g.begin(), g.end());
  in.insert(in.end(), m.begin(), m.end());
  in.insert(in.end(), v.begin(), v.end());
  return in;
}

/// Two AdamW steps of `list`, the second with a clip factor.
void two_adamw_steps(const std::vector<ops::AdamWTensors>& list) {
  ops::AdamWStep s{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f, 0.05f, 1.0f};
  ops::adamw_step(list, s);
  s.bc1 = 0.19f;
  s.bc2 = 0.0975f;
  s.grad_scale = 0.37f;
  ops::adamw_step(list, s);
}

/// keep_f32 of the AdamW case: params, m and v stay f32 (the bf16 run gets bf16 gradients).
std::vector<int> adamw_kept() {
  std::vector<int> v = list_indices(0), m = list_indices(2 * kListLen),
                   w = list_indices(3 * kListLen);
  v.insert(v.end(), m.begin(), m.end());
  v.insert(v.end(), w.begin(), w.end());
  return v;
}

std::vector<OpCase> parity_cases() {
  std::vector<OpCase> c;
  // linear algebra
  c.push_back({"matmul",
               [] {
                 return Tensors{randn({37, 53}, 1), randn({53, 29}, 2), randn({53, 37}, 3),
                                randn({29, 53}, 4)};
               },
               [](Tensors& in) {
                 return Tensors{ops::matmul(in[0], in[1]), ops::matmul(in[2], in[1], true, false),
                                ops::matmul(in[0], in[3], false, true),
                                ops::matmul(in[2], in[3], true, true)};
               }});
  c.push_back({"matmul_large_k",
               [] {
                 return Tensors{randn({64, 1024}, 5), randn({1024, 96}, 6)};
               },
               [](Tensors& in) { return Tensors{ops::matmul(in[0], in[1])}; }});
  c.push_back({"matmul_into_f32_accumulator",
               [] {
                 return Tensors{randn({31, 40}, 7), randn({24, 40}, 8), randn({31, 24}, 9)};
               },
               [](Tensors& in) {
                 ops::matmul_into(in[2], in[0], in[1], false, true, 0.5f, 1.0f);
                 return Tensors{in[2]};
               },
               {2}});
  c.push_back(
      {"grouped_matmul",
       [] {
         return Tensors{randn({28, 24}, 10), randn({6, 24, 40}, 11), randn({6, 40, 24}, 12)};
       },
       [](Tensors& in) {
         return Tensors{ops::grouped_matmul(in[0], in[1], kGroups),
                        ops::grouped_matmul(in[0], in[2], kGroups, true)};
       }});
  c.push_back({"grouped_matmul_weight_grad",
               [] {
                 return Tensors{randn({28, 24}, 13), randn({28, 40}, 14), randn({6, 24, 40}, 15),
                                randn({6, 24, 40}, 16)};
               },
               [](Tensors& in) {
                 ops::grouped_matmul_weight_grad(in[2], in[0], in[1], kGroups, false);
                 ops::grouped_matmul_weight_grad(in[3], in[0], in[1], kGroups, true);
                 return Tensors{in[2], in[3]};
               }});
  c.push_back({"grouped_matmul_weight_grad_f32_dw",
               [] {
                 return Tensors{randn({28, 24}, 17), randn({28, 40}, 18), randn({6, 24, 40}, 19)};
               },
               [](Tensors& in) {
                 ops::grouped_matmul_weight_grad(in[2], in[0], in[1], kGroups, true);
                 return Tensors{in[2]};
               },
               {2}});
  // Even enough groups for the padded strided-batch path of bf16 rows into an f32 dw (largest
  // group <= 1.5x the mean; one empty group), and d = 24 rows: 48 bytes, 16-byte padded copies.
  c.push_back({"grouped_matmul_weight_grad_f32_dw_even",
               [] {
                 return Tensors{randn({40, 24}, 70), randn({40, 16}, 71), randn({5, 24, 16}, 72),
                                randn({5, 24, 16}, 73)};
               },
               [](Tensors& in) {
                 const std::vector<int64_t> even = {9, 10, 0, 11, 10};
                 ops::grouped_matmul_weight_grad(in[2], in[0], in[1], even, true);
                 ops::grouped_matmul_weight_grad(in[3], in[0], in[1], even, false);
                 return Tensors{in[2], in[3]};
               },
               {2, 3}});
  // bf16 K, M multiples of 8 take the sm90 CUTLASS kernels on an H200: groups of 1 to 517 rows
  // (several 128-row tiles, ragged last tiles, empty groups) and M = 264, K = 136 (partial
  // 256-wide and 64-deep tiles). K = 20, M = 36 (not 16-byte rows) stays on cuBLAS.
  c.push_back({"grouped_matmul_ragged_tiles",
               [] {
                 return Tensors{randn({1261, 136}, 74), randn({8, 136, 264}, 75),
                                randn({1261, 264}, 76), randn({8, 136, 264}, 77)};
               },
               [](Tensors& in) {
                 const std::vector<int64_t> sizes = {300, 0, 129, 1, 517, 64, 0, 250};
                 return Tensors{ops::grouped_matmul(in[0], in[1], sizes),
                                ops::grouped_matmul(in[2], in[3], sizes, true)};
               }});
  c.push_back({"grouped_matmul_weight_grad_ragged_tiles",
               [] {
                 return Tensors{randn({1261, 136}, 78), randn({1261, 264}, 79),
                                randn({8, 136, 264}, 80), randn({8, 136, 264}, 81)};
               },
               weight_grad_both_ways({300, 0, 129, 1, 517, 64, 0, 250}),
               {2, 3}});
  // One group far longer than the rest: on sm90 it is cut into pieces summed afterwards.
  c.push_back({"grouped_matmul_weight_grad_skewed_pieces",
               [] {
                 return Tensors{randn({2064, 64}, 86), randn({2064, 128}, 87),
                                randn({8, 64, 128}, 88), randn({8, 64, 128}, 89)};
               },
               weight_grad_both_ways({2000, 3, 0, 17, 1, 40, 0, 3}),
               {2, 3}});
  // bf16 dw (model.moe.expert_grad_dtype) in the bf16 run: the sm90 kernels' bf16 output, and
  // bf16 partials for the cut-up group.
  c.push_back({"grouped_matmul_weight_grad_bf16_dw_ragged_tiles",
               [] {
                 return Tensors{randn({1261, 136}, 90), randn({1261, 264}, 91),
                                randn({8, 136, 264}, 92), randn({8, 136, 264}, 93)};
               },
               weight_grad_both_ways({300, 0, 129, 1, 517, 64, 0, 250})});
  c.push_back({"grouped_matmul_weight_grad_bf16_dw_skewed_pieces",
               [] {
                 return Tensors{randn({2064, 64}, 94), randn({2064, 128}, 95),
                                randn({8, 64, 128}, 96), randn({8, 64, 128}, 97)};
               },
               weight_grad_both_ways({2000, 3, 0, 17, 1, 40, 0, 3})});
  c.push_back({"grouped_matmul_unaligned_rows",
               [] {
                 return Tensors{randn({28, 20}, 82), randn({6, 20, 36}, 83), randn({28, 36}, 84),
                                randn({6, 20, 36}, 85)};
               },
               [](Tensors& in) {
                 ops::grouped_matmul_weight_grad(in[3], in[0], in[2], kGroups, true);
                 return Tensors{ops::grouped_matmul(in[0], in[1], kGroups),
                                ops::grouped_matmul(in[2], in[1], kGroups, true), in[3]};
               },
               {3}});
  // activations
  c.push_back(
      {"softmax",
       [] {
         return Tensors{randn({13, 64}, 20, 3.f), randn({13, 64}, 21), randn({5, 1000}, 22),
                        randn({5, 1000}, 23)};
       },
       [](Tensors& in) {
         Tensor y = ops::softmax(in[0]), y2 = ops::softmax(in[2]);
         return Tensors{y, ops::softmax_backward(y, in[1]), y2, ops::softmax_backward(y2, in[3])};
       }});
  c.push_back({"sigmoid",
               [] {
                 return Tensors{randn({7, 33}, 24, 3.f), randn({7, 33}, 25)};
               },
               [](Tensors& in) {
                 Tensor y = ops::sigmoid(in[0]);
                 return Tensors{y, ops::sigmoid_backward(y, in[1])};
               }});
  // f = 48: 8 columns per thread (16-byte accesses); f = 13: one per thread.
  for (const int64_t f : {48, 13}) {
    c.push_back({"swiglu_f" + std::to_string(f),
                 [f] {
                   return Tensors{randn({11, 2 * f}, 26, 2.f), randn({11, f}, 27)};
                 },
                 [](Tensors& in) {
                   Tensor in_place = in[0].clone();
                   ops::swiglu_backward_(in_place, in[1]);
                   Tensor dh = in[0].clone(), value = in[1].clone();
                   ops::swiglu_backward_with_value_(dh, value);
                   return Tensors{ops::swiglu(in[0]), ops::swiglu_backward(in[0], in[1]), in_place,
                                  dh, value};
                 }});
  }
  // normalisation
  auto rmsnorm_run = [](Tensors& in) {
    auto r = ops::rmsnorm(in[0], in[1], 1e-5f);
    Tensor dx = ops::rmsnorm_backward(in[0], in[1], r.rstd, in[2], in[3]);
    return Tensors{r.y, r.rstd, dx, in[3]};
  };
  auto rmsnorm_inputs = [] {
    return Tensors{randn({300, 96}, 28), randn({96}, 29), randn({300, 96}, 30), randn({96}, 31)};
  };
  c.push_back({"rmsnorm", rmsnorm_inputs, rmsnorm_run});
  c.push_back({"rmsnorm_f32_weight", rmsnorm_inputs, rmsnorm_run, {1, 3}});
  // Warp path with a part-filled last chunk (1000 = 3 * 256 + 232), and the block path (d % 8).
  c.push_back({"rmsnorm_wide",
               [] {
                 return Tensors{randn({70, 1000}, 32), randn({1000}, 33), randn({70, 1000}, 34),
                                randn({1000}, 35)};
               },
               rmsnorm_run});
  c.push_back(
      {"rmsnorm_odd_width",
       [] {
         return Tensors{randn({40, 50}, 36), randn({50}, 37), randn({40, 50}, 38), randn({50}, 39)};
       },
       rmsnorm_run});
  // selection and indexing
  c.push_back({"topk",
               [] {
                 return Tensors{rand_ties({17, 64}, 32), randn({3, 512}, 33),
                                randn({5, 100}, 34, 2.f), rand_ties({6, 513}, 35)};
               },
               [](Tensors& in) {
                 auto a = ops::topk(in[0], 6);
                 auto b = ops::topk(in[1], 16);
                 // rows in registers (a part of the last lane value used) and read again
                 auto c = ops::topk(in[2], 8);
                 auto d = ops::topk(in[3], 3);
                 return Tensors{a.values, a.indices, b.values, b.indices,
                                c.values, c.indices, d.values, d.indices};
               }});
  // The router's probabilities and picks in one pass (f32, as the router runs): rows in
  // registers, the two-pass path above 512 columns, ties.
  c.push_back({"softmax_topk",
               [] {
                 return Tensors{rand_ties({17, 64}, 36), randn({9, 100}, 37, 3.f),
                                randn({3, 600}, 38), randn({40, 7}, 39)};
               },
               [](Tensors& in) {
                 Tensors out;
                 const int64_t ks[] = {6, 8, 16, 7};
                 for (size_t i = 0; i < 4; ++i) {
                   auto r = ops::softmax_topk(in[i], ks[i]);
                   out.insert(out.end(), {r.probs, r.top.values, r.top.indices});
                 }
                 return out;
               },
               {0, 1, 2, 3}});
  c.push_back({"gather_rows",
               [] {
                 return Tensors{randn({20, 48}, 34), rand_index(33, 20, 35)};
               },
               [](Tensors& in) { return Tensors{ops::gather_rows(in[0], in[1])}; }});
  c.push_back({"scatter_add_rows",
               [] {
                 return Tensors{randn({12, 40}, 36), randn({50, 40}, 37), rand_index(50, 12, 38),
                                randn({50}, 39), randn({12, 40}, 40)};
               },
               [](Tensors& in) {
                 ops::scatter_add_rows(in[0], in[1], in[2], in[3]);
                 ops::scatter_add_rows(in[4], in[1], in[2]);
                 return Tensors{in[0], in[4]};
               }});
  c.push_back({"scatter_add_rows_f32_out",
               [] {
                 return Tensors{randn({12, 40}, 41), randn({500, 40}, 42), rand_index(500, 12, 43),
                                randn({500}, 44)};
               },
               [](Tensors& in) {
                 ops::scatter_add_rows(in[0], in[1], in[2], in[3]);
                 return Tensors{in[0]};
               },
               {0}});
  c.push_back({"row_dot",
               [] {
                 return Tensors{randn({19, 70}, 45), randn({19, 70}, 46)};
               },
               [](Tensors& in) { return Tensors{ops::row_dot(in[0], in[1])}; }});
  // elementwise and reductions
  // 279 values: one per thread; 288: add and add_ take 8 per thread.
  for (const int64_t cols : {31, 32}) {
    c.push_back({"elementwise_" + std::to_string(cols),
                 [cols] {
                   return Tensors{randn({9, cols}, 47), randn({9, cols}, 48)};
                 },
                 [](Tensors& in) {
                   Tensor s = ops::add(in[0], in[1]), m = ops::mul(in[0], in[1]);
                   Tensor a = in[0].clone();
                   ops::add_(a, in[1], -0.75f);
                   ops::scale_(in[1], 3.0f);
                   return Tensors{s, m, a, in[1]};
                 }});
  }
  c.push_back({"reductions",
               [] {
                 return Tensors{randn({1000, 77}, 49)};
               },
               [](Tensors& in) {
                 return Tensors{scalar(ops::sum(in[0])), scalar(ops::sum_squares(in[0])),
                                scalar(ops::all_finite(in[0]) ? 1 : 0)};
               }});
  c.push_back({"all_finite_inf",
               [] {
                 Tensor x = randn({5, 8}, 50);
                 x.span<float>()[17] = std::numeric_limits<float>::infinity();
                 return Tensors{x};
               },
               [](Tensors& in) { return Tensors{scalar(ops::all_finite(in[0]) ? 1 : 0)}; }});
  c.push_back({"cast",
               [] {
                 return Tensors{randn({6, 45}, 51)};
               },
               [](Tensors& in) {
                 Tensor b = ops::cast(in[0], DType::bf16);
                 return Tensors{b, ops::cast(b, DType::f32), ops::cast(in[0], DType::f32)};
               }});
  // model ops
  c.push_back({"embedding",
               [] {
                 return Tensors{randn({30, 64}, 52), rand_index(45, 30, 53), randn({45, 64}, 54),
                                randn({30, 64}, 55)};
               },
               [](Tensors& in) {
                 Tensor out = ops::embedding(in[0], in[1]);
                 ops::embedding_backward(in[3], in[1], in[2]);
                 return Tensors{out, in[3]};
               }});
  // head_dim 16: 8 pairs per thread; 12: one per thread.
  for (const int64_t hd : {16, 12}) {
    c.push_back({"rope_hd" + std::to_string(hd),
                 [hd] {
                   return Tensors{randn({2, 9, 3, hd}, 56)};
                 },
                 [hd](Tensors& in) {
                   const ops::RopeTables t = ops::rope_tables(12, hd, 10000.f, device_of(in));
                   Tensor y = ops::rope(in[0], t);
                   Tensor back = ops::rope_backward(y, t);
                   ops::rope_(in[0], t);
                   return Tensors{y, back, in[0]};
                 }});
  }
  struct Attn {
    const char* name;
    int64_t b, s, h, hkv, hd;
    bool causal;
  };
  for (const Attn a : {Attn{"attention_gqa_causal", 2, 37, 4, 2, 32, true},
                       Attn{"attention_mqa_full", 1, 70, 2, 1, 64, false},
                       Attn{"attention_hd80_causal", 1, 45, 3, 3, 80, true},
                       Attn{"attention_hd128_causal", 1, 33, 2, 2, 128, true},
                       Attn{"attention_hd256_causal", 1, 40, 2, 1, 256, true},
                       // bf16 of these runs on the tensor-core kernels: several 64-row tiles,
                       // a ragged last tile, GQA groups of 2 and 4, causal and not.
                       Attn{"attention_tc_hd64_gqa_causal", 2, 200, 4, 2, 64, true},
                       Attn{"attention_tc_hd64_full", 1, 129, 2, 2, 64, false},
                       Attn{"attention_tc_hd128_gqa_causal", 1, 150, 8, 2, 128, true},
                       Attn{"attention_tc_hd128_full", 2, 64, 2, 1, 128, false}}) {
    c.push_back(
        {a.name,
         [a] {
           return Tensors{randn({a.b, a.s, a.h, a.hd}, 60), randn({a.b, a.s, a.hkv, a.hd}, 61),
                          randn({a.b, a.s, a.hkv, a.hd}, 62), randn({a.b, a.s, a.h, a.hd}, 63)};
         },
         [a](Tensors& in) {
           auto f = ops::attention(in[0], in[1], in[2], a.causal);
           auto g = ops::attention_backward(in[0], in[1], in[2], f.out, f.lse, in[3], a.causal);
           return Tensors{f.out, f.lse, g.dq, g.dk, g.dv};
         }});
  }
  // Rows of 300 (two element-wise passes) and of 4096, whole 16-byte vectors (one pass).
  for (const int64_t v : {300, 4096}) {
    const uint64_t seed = v == 300 ? 64 : 66;
    const float scale = v == 300 ? 2.f : 4.f;
    c.push_back(
        {v == 300 ? "cross_entropy" : "cross_entropy_vector_rows",
         [v, seed, scale] {
           return Tensors{randn({23, v}, seed, scale), rand_index(23, v, seed + 1, 0.2f)};
         },
         [](Tensors& in) {
           auto r = ops::cross_entropy(in[0], in[1]);
           Tensor d = ops::cross_entropy_backward(in[0], in[1], r, 0.5f);
           Tensor logits = in[0].clone();
           ops::cross_entropy_backward_(logits, in[1], r, 0.5f);
           return Tensors{scalar(r.loss), r.lse, d, logits, scalar(static_cast<double>(r.count))};
         }});
  }
  // MoE ops. The row ops and the layout have their cases in test_cuda_moe.cpp (CudaMoeOps,
  // CudaMoeOrder); these are the rest. Routing tensors are f32 on both devices (all kept).
  c.push_back({"moe_aux_losses", aux_inputs, aux_run, {0, 2, 3, 4}});
  // Quarter-rounded scores and bias: many exact ties between group scores (ties go to the
  // lower group); groups of 4, 2 and 1 expert(s), and one group (no limit).
  c.push_back({"moe_group_limited_scores",
               [] {
                 return Tensors{rand_ties({37, 16}, 87), rand_ties({16}, 88)};
               },
               [](Tensors& in) {
                 return Tensors{ops::moe_group_limited_scores(in[0], in[1], 4, 2),
                                ops::moe_group_limited_scores(in[0], in[1], 8, 3),
                                ops::moe_group_limited_scores(in[0], in[1], 16, 5),
                                ops::moe_group_limited_scores(in[0], in[1], 1, 1)};
               },
               {0, 1}});
  // The xmoe gate's temperature: a learned one, and one below the 0.01 clamp (no gradient).
  c.push_back({"moe_temperature",
               [] {
                 return Tensors{randn({13, 9}, 89), randn({13, 9}, 90),
                                Tensor::from_vector<float>({0.7f}, {1}),
                                Tensor::from_vector<float>({0.001f}, {1}), randn({1}, 91)};
               },
               [](Tensors& in) {
                 Tensor g = in[4].clone(), clamped = in[4].clone();
                 ops::moe_temperature_grad(g, in[1], in[0], in[2], 0.01f);
                 ops::moe_temperature_grad(clamped, in[1], in[0], in[3], 0.01f);
                 return Tensors{ops::moe_div_temperature(in[0], in[2], 0.01f),
                                ops::moe_div_temperature(in[0], in[3], 0.01f), g, clamped};
               },
               {0, 1, 2, 3, 4}});
  // Optimizer ops. AdamW: inputs params, grads, m, v (50 each); two steps (the second with a
  // clip factor), weight decay on every other tensor, bf16 copies of the params rewritten. The
  // bf16 run gives it bf16 gradients.
  c.push_back({"adamw_step", adamw_inputs,
               [](Tensors& in) {
                 std::vector<ops::AdamWTensors> list;
                 for (int64_t i = 0; i < kListLen; ++i)
                   list.push_back({in[i], in[kListLen + i], in[2 * kListLen + i],
                                   in[3 * kListLen + i], ops::cast(in[i], DType::bf16),
                                   i % 2 == 0});
                 two_adamw_steps(list);
                 // The bf16 copy must be bf16(param) exactly, on each device (compared as
                 // copy - bf16(param), zero on both sides: the params themselves may differ by
                 // an f32 rounding, which can move a bf16 rounding by one bf16 ulp).
                 std::vector<Tensor> p, m, v, copy_error;
                 for (const ops::AdamWTensors& t : list) {
                   p.push_back(t.param);
                   m.push_back(t.m);
                   v.push_back(t.v);
                   copy_error.push_back(ops::cast(t.param_bf16, DType::f32));
                   ops::add_(copy_error.back(),
                             ops::cast(ops::cast(t.param, DType::bf16), DType::f32), -1.0f);
                 }
                 return Tensors{concat(p), concat(m), concat(v), concat(copy_error)};
               },
               adamw_kept(), 1e-6});
  // AdamW with bf16 moments (train.adam_moments_dtype): the same inputs, m and v rounded to bf16
  // before the first step and stored in bf16 by each; compared as f32 (the moments' bf16 values).
  c.push_back({"adamw_step_bf16_moments", adamw_inputs,
               [](Tensors& in) {
                 std::vector<ops::AdamWTensors> list;
                 for (int64_t i = 0; i < kListLen; ++i)
                   list.push_back(
                       {in[i], in[kListLen + i], ops::cast(in[2 * kListLen + i], DType::bf16),
                        ops::cast(in[3 * kListLen + i], DType::bf16), Tensor(), i % 2 == 0});
                 two_adamw_steps(list);
                 std::vector<Tensor> p, m, v;
                 for (const ops::AdamWTensors& t : list) {
                   p.push_back(t.param);
                   m.push_back(ops::cast(t.m, DType::f32));
                   v.push_back(ops::cast(t.v, DType::f32));
                 }
                 return Tensors{concat(p), concat(m), concat(v)};
               },
               adamw_kept(), 1e-6});
  // The gradient-list ops: sum of squares, scale, then the gradient sync's pack into one f32
  // buffer (kept f32) and scaled unpack. The bf16 run gives them bf16 tensors.
  c.push_back({"multi_tensor", [] { return rand_list(500); },
               [](Tensors& in) {
                 std::vector<Tensor> xs(in.begin(), in.begin() + kListLen);
                 const double ss = ops::multi_sum_squares(xs).item();
                 ops::multi_scale_(xs, 0.5f);
                 int64_t total = 0;
                 for (const Tensor& x : xs) total += x.numel();
                 Tensor flat = Tensor::zeros({total}, DType::f32, device_of(in));
                 std::vector<Tensor> views;
                 for (int64_t offset = 0; const Tensor& x : xs) {
                   views.push_back(flat.rows(offset, offset + x.numel()));
                   offset += x.numel();
                 }
                 ops::multi_copy_scaled(views, xs, 1.0f);
                 Tensor packed = flat.clone();
                 ops::multi_copy_scaled(xs, views, 0.25f);
                 return Tensors{scalar(ss), packed, concat(xs)};
               }});
  return c;
}

/// The case's inputs on `device` in `dtype` (float inputs not in keep_f32), and the matching
/// CPU f32 reference inputs (bf16-rounded where the device run gets bf16).
std::pair<Tensors, Tensors> prepare(const OpCase& c, Device device, DType dtype) {
  Tensors ref, dev;
  const Tensors base = c.inputs();
  for (size_t i = 0; i < base.size(); ++i) {
    const Tensor& t = base[i];
    const bool keep =
        std::find(c.keep_f32.begin(), c.keep_f32.end(), static_cast<int>(i)) != c.keep_f32.end();
    if (t.dtype() != DType::f32 || keep || dtype == DType::f32) {
      ref.push_back(t.clone());
      dev.push_back(t.to(device));
    } else {
      Tensor rounded = t.to(dtype);
      ref.push_back(rounded.to(DType::f32));
      dev.push_back(rounded.to(device));
    }
  }
  return {ref, dev};
}

class CudaOps : public ::testing::TestWithParam<OpCase> {};

TEST_P(CudaOps, MatchesCpu) {
  XMOE_REQUIRE_CUDA();
  const OpCase& c = GetParam();
  for (DType dtype : {DType::f32, DType::bf16}) {
    auto [ref_in, dev_in] = prepare(c, kCuda, dtype);
    const Tensors ref = c.run(ref_in);
    const Tensors got = c.run(dev_in);
    ASSERT_EQ(ref.size(), got.size()) << c.name;
    const double tol = dtype == DType::f32 ? c.tol_f32 : c.tol_bf16;
    for (size_t i = 0; i < ref.size(); ++i) {
      SCOPED_TRACE(c.name + " output " + std::to_string(i) + " in " +
                   std::string(dtype_name(dtype)));
      ASSERT_FALSE(got[i].is_cpu() && got[i].numel() > 1) << "ran on the CPU";
      ASSERT_EQ(got[i].shape(), ref[i].shape());
      if (ref[i].dtype() == DType::i32) {
        EXPECT_EQ(got[i].dtype(), DType::i32);
        EXPECT_EQ(got[i].to_vector<int32_t>(), ref[i].to_vector<int32_t>());
        continue;
      }
      const bool kept = got[i].dtype() == DType::f32;
      EXPECT_TRUE(dtype == DType::f32 || kept || got[i].dtype() == DType::bf16);
      const double err = normalised_error(got[i], ref[i]);
      std::printf("[parity] %-34s out %zu %-4s error %.2e (tolerance %.0e)\n", c.name.c_str(), i,
                  std::string(dtype_name(dtype)).c_str(), err, tol);
      EXPECT_LE(err, tol);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Parity, CudaOps, ::testing::ValuesIn(parity_cases()),
                         [](const ::testing::TestParamInfo<OpCase>& info) {
                           return info.param.name;
                         });

// ---- determinism ----------------------------------------------------------------------------

TEST(CudaDeterminism, ScatterAttentionNormAreBitwiseRepeatable) {
  XMOE_REQUIRE_CUDA();
  const Tensor src = randn({4000, 64}, 70).to(kCuda), w = randn({4000}, 71).to(kCuda);
  const Tensor index = rand_index(4000, 37, 72).to(kCuda);
  auto scatter = [&] {
    Tensor out = Tensor::zeros({37, 64}, DType::f32, kCuda);
    ops::scatter_add_rows(out, src, index, w);
    return out.to_vector<float>();
  };
  EXPECT_EQ(scatter(), scatter());
  const Tensor q = randn({2, 64, 4, 64}, 73).to(kCuda), k = randn({2, 64, 2, 64}, 74).to(kCuda);
  const Tensor v = randn({2, 64, 2, 64}, 75).to(kCuda), dout = randn({2, 64, 4, 64}, 76).to(kCuda);
  auto attn = [&] {
    auto f = ops::attention(q, k, v);
    auto g = ops::attention_backward(q, k, v, f.out, f.lse, dout);
    return std::vector<std::vector<float>>{g.dq.to_vector<float>(), g.dk.to_vector<float>(),
                                           g.dv.to_vector<float>()};
  };
  EXPECT_EQ(attn(), attn());
  const Tensor x = randn({3000, 128}, 77).to(kCuda), weight = randn({128}, 78).to(kCuda);
  auto dweight = [&] {
    Tensor dw = Tensor::zeros({128}, DType::f32, kCuda);
    auto r = ops::rmsnorm(x, weight, 1e-6f);
    ops::rmsnorm_backward(x, weight, r.rstd, x, dw);
    return dw.to_vector<float>();
  };
  EXPECT_EQ(dweight(), dweight());
}

// softmax_topk writes the bits of softmax then topk on the device, f32 and bf16, at every
// register width and in the two-pass path.
TEST(CudaSoftmaxTopk, WritesTheBitsOfSoftmaxThenTopk) {
  XMOE_REQUIRE_CUDA();
  const std::pair<int64_t, int64_t> shapes[] = {{300, 8},  {300, 33}, {4096, 64}, {200, 100},
                                                {70, 256}, {30, 500}, {5, 700}};
  for (const DType dt : {DType::f32, DType::bf16}) {
    for (const auto& [rows, cols] : shapes) {
      Tensor x = ops::cast(rand_ties({rows, cols}, 80 + static_cast<uint64_t>(cols)).to(kCuda), dt);
      const int64_t k = std::min<int64_t>(cols, 6);
      const ops::SoftmaxTopKResult fused = ops::softmax_topk(x, k);
      const Tensor probs = ops::softmax(x);
      const ops::TopKResult top = ops::topk(probs, k);
      const std::string what = fmt::format("{} x {} {}", rows, cols, dtype_name(dt));
      EXPECT_EQ(host_f32(fused.probs).to_vector<float>(), host_f32(probs).to_vector<float>())
          << what;
      EXPECT_EQ(host_f32(fused.top.values).to_vector<float>(),
                host_f32(top.values).to_vector<float>())
          << what;
      EXPECT_EQ(fused.top.indices.to_vector<int32_t>(), top.indices.to_vector<int32_t>()) << what;
    }
  }
}

// The gradient norm's sum of squares over more partials than one level of the final sum takes
// (4096 per block; 4096-element chunks): three levels at 2^26 + 5 elements. The values are
// small whole numbers, so every order of adding gives the exact sum; and the run repeats its bits.
TEST(CudaMultiSumSquares, SumsOverSeveralLevelsOfPartials) {
  XMOE_REQUIRE_CUDA();
  const int64_t n = (int64_t{1} << 26) + 5;
  std::vector<float> host(static_cast<size_t>(n));
  double expected = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    host[static_cast<size_t>(i)] = static_cast<float>(i % 5) - 2.0f;
    expected += static_cast<double>((i % 5 - 2) * (i % 5 - 2));
  }
  const Tensor big = Tensor::from_vector(host, {n}, kCuda);
  const Tensor small = Tensor::full({7}, 3.0f, kCuda);
  const std::vector<Tensor> xs = {small, big, small};
  const double got = ops::multi_sum_squares(xs).item();
  EXPECT_EQ(got, expected + 2 * 7 * 9.0);
  EXPECT_EQ(ops::multi_sum_squares(xs).item(), got);
  EXPECT_EQ(ops::multi_sum_squares(std::vector<Tensor>{small}).item(), 63.0);
}

// The block's fused norms (x + a then the norm in bf16; the backward from a bf16 gradient with
// the residual stream's gradient added and a bf16 copy) write exactly what the separate passes
// they replace wrote: casts, add_, rmsnorm, rmsnorm_backward, add_, cast. Warp path (d = 1024)
// and block path (d = 50).
TEST(CudaFusedNorm, AddNormAndBackwardWriteTheSeparatePassesBytes) {
  // Host f32 values of a tensor of either dtype on either device.
  const auto vec = [](const Tensor& t) {
    return (t.dtype() == DType::f32 ? t : ops::cast(t, DType::f32)).to_vector<float>();
  };
  const auto host_f32 = [](const Tensor& t) {
    return (t.dtype() == DType::f32 ? t : ops::cast(t, DType::f32)).to(Device::cpu());
  };
  // The backward's row-vector path (d % 8 == 0, up to 8192 columns; more rows than its 1024
  // blocks in the second case) and the element-by-element one (d = 50).
  const std::pair<int64_t, int64_t> shapes[] = {
      {333, 1024}, {2500, 1024}, {333, 2048}, {40, 7168}, {333, 50}};
  for (const auto& [rows, d] : shapes) {
    SCOPED_TRACE("rows = " + std::to_string(rows) + ", d = " + std::to_string(d));
    const Tensor x = randn({rows, d}, 101).to(kCuda);
    const Tensor a = ops::cast(randn({rows, d}, 102).to(kCuda), DType::bf16);
    const Tensor w = randn({d}, 103).to(kCuda);
    const Tensor dy = ops::cast(randn({rows, d}, 104).to(kCuda), DType::bf16);
    const Tensor res = randn({rows, d}, 105).to(kCuda);

    auto fused = ops::add_rmsnorm(x, a, w, 1e-6f, DType::bf16);
    Tensor h = ops::cast(a, DType::f32);
    ops::add_(h, x);
    auto plain = ops::rmsnorm(h, w, 1e-6f);
    EXPECT_EQ(vec(fused.sum), vec(h));
    EXPECT_EQ(vec(fused.rstd), vec(plain.rstd));
    EXPECT_EQ(fused.y.dtype(), DType::bf16);
    EXPECT_EQ(vec(fused.y), vec(ops::cast(plain.y, DType::bf16)));
    // The plain norm written in bf16, without the add.
    EXPECT_EQ(vec(ops::rmsnorm(x, w, 1e-6f, DType::bf16).y),
              vec(ops::cast(ops::rmsnorm(x, w, 1e-6f).y, DType::bf16)));

    Tensor dw_fused = Tensor::zeros({d}, DType::f32, kCuda);
    Tensor dw_plain = Tensor::zeros({d}, DType::f32, kCuda);
    ops::RmsNormGrad g =
        ops::rmsnorm_backward_add(h, w, plain.rstd, dy, dw_fused, res, DType::bf16);
    Tensor dx = ops::rmsnorm_backward(h, w, plain.rstd, ops::cast(dy, DType::f32), dw_plain);
    ops::add_(dx, res);
    EXPECT_EQ(vec(g.dx), vec(dx));
    EXPECT_EQ(vec(g.dx_copy), vec(ops::cast(dx, DType::bf16)));
    EXPECT_EQ(vec(dw_fused), vec(dw_plain));

    // And the CPU's ops, to f32 rounding (the bf16 inputs are exact in f32).
    Tensor dw_cpu = Tensor::zeros({d});
    const Tensor w_cpu = host_f32(w);
    auto cpu = ops::add_rmsnorm(host_f32(x), host_f32(a), w_cpu, 1e-6f, DType::f32);
    ops::RmsNormGrad gc = ops::rmsnorm_backward_add(cpu.sum, w_cpu, cpu.rstd, host_f32(dy), dw_cpu,
                                                    host_f32(res), DType::f32);
    const auto close = [&](const Tensor& got, const Tensor& want, float tol, const char* what) {
      const std::vector<float> g = vec(got), e = want.to_vector<float>();
      ASSERT_EQ(g.size(), e.size()) << what;
      for (size_t i = 0; i < g.size(); ++i)
        ASSERT_NEAR(g[i], e[i], tol * (1.f + std::abs(e[i]))) << what << " at " << i;
    };
    close(fused.y, cpu.y, 8e-3f, "y");
    close(g.dx, gc.dx, 1e-4f, "dx");
    close(dw_fused, dw_cpu, 1e-3f, "dw");
  }
}

// bf16 logits (the model's) through the one-pass kernels, and rows of other widths through the
// two-pass ones: the CPU's f32 cross-entropy on the same (bf16-exact) values.
TEST(CudaCrossEntropy, Bf16LogitsMatchTheCpu) {
  XMOE_REQUIRE_CUDA();
  for (const int64_t v : {32768, 1000, 36}) {
    SCOPED_TRACE("v = " + std::to_string(v));
    const int64_t n = 37;
    const Tensor logits = ops::cast(randn({n, v}, 68, 3.f).to(kCuda), DType::bf16);
    const Tensor targets = rand_index(n, v, 69, 0.2f).to(kCuda);
    const Tensor cpu_logits = ops::cast(logits, DType::f32).to(Device::cpu());
    const auto got = ops::cross_entropy(logits, targets);
    const auto want = ops::cross_entropy(cpu_logits, targets.to(Device::cpu()));
    EXPECT_NEAR(got.loss, want.loss, 1e-5 * std::abs(want.loss));
    EXPECT_LE(normalised_error(got.lse.to(Device::cpu()), want.lse), 1e-6);
    Tensor d = logits.clone();
    ops::cross_entropy_backward_(d, targets, got, 0.25f);
    const Tensor dw =
        ops::cross_entropy_backward(cpu_logits, targets.to(Device::cpu()), want, 0.25f);
    EXPECT_LE(normalised_error(ops::cast(d, DType::f32).to(Device::cpu()), dw), 4e-3);
  }
}

// The f32 router's GEMMs on bf16 tensor cores (moe/gates: LinearRouter): the exact bf16 terms
// are the CPU's bytes, and x W and dl W^T from them are as accurate as f32 GEMMs (the bf16
// router, which rounds W to bf16, is over 100x further off).
TEST(CudaSplitGemm, Bf16TermsGiveF32Products) {
  const int64_t T = 777, d = 1024, E = 64;
  const Tensor x = ops::cast(randn({T, d}, 111).to(kCuda), DType::bf16);
  const Tensor w = randn({d, E}, 112, 0.02f).to(kCuda);
  const Tensor dl = randn({T, E}, 113, 1e-3f).to(kCuda);
  const std::array<int, 3> all = {0, 1, 2};
  const std::array<int, 6> left = {0, 0, 1, 0, 2, 1}, right = {0, 1, 0, 2, 0, 1};
  const Tensor w3 = ops::split_bf16_columns(w, all);
  EXPECT_EQ(ops::cast(w3, DType::f32).to_vector<float>(),
            ops::split_bf16_columns(w.to(Device::cpu()), all).to(DType::f32).to_vector<float>());

  // The f64 references from the same operands.
  const std::vector<float> xv = ops::cast(x, DType::f32).to_vector<float>();
  const std::vector<float> wv = w.to_vector<float>(), dv = dl.to_vector<float>();
  const auto rel_error = [](const std::vector<float>& got, const std::vector<double>& want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      num = std::max(num, std::abs(got[i] - want[i]));
      den = std::max(den, std::abs(want[i]));
    }
    return num / den;
  };
  std::vector<double> logits(T * E, 0.0), dx(T * d, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < d; ++k) {
      for (int64_t e = 0; e < E; ++e) {
        logits[t * E + e] += double(xv[t * d + k]) * wv[k * E + e];
        dx[t * d + k] += double(dv[t * E + e]) * wv[k * E + e];
      }
    }

  Tensor split_logits = Tensor::empty({T, E}, DType::f32, kCuda);
  ops::sum_column_blocks_into(split_logits, ops::matmul_f32(x, w3), 3, false);
  const Tensor split_dx = ops::matmul_f32(ops::split_bf16_columns(dl, left),
                                          ops::split_bf16_columns(w, right), false, true);
  const double e_logits = rel_error(split_logits.to_vector<float>(), logits);
  const double e_dx = rel_error(split_dx.to_vector<float>(), dx);
  const double e_bf16 =
      rel_error(ops::matmul_f32(x, ops::cast(w, DType::bf16)).to_vector<float>(), logits);
  std::printf("[split gemm] relative error: logits %.2e, dx %.2e; bf16 weights %.2e\n", e_logits,
              e_dx, e_bf16);
  // f32 accumulation over K = 1024 (an H100 gave 1.1e-6 for both) against the bf16 weights'
  // 1.5e-3.
  EXPECT_LT(e_logits, 4e-6);
  EXPECT_LT(e_dx, 4e-6);
  EXPECT_GT(e_bf16, 100 * e_logits);
}

// ---- attention: cuDNN and xmoe's kernels ----------------------------------------------------

/// Switches the bf16 attention backend for one scope.
struct AttentionBackendScope {
  explicit AttentionBackendScope(cuda::AttentionBackend b) : saved(cuda::attention_backend()) {
    cuda::set_attention_backend(b);
  }
  ~AttentionBackendScope() { cuda::set_attention_backend(saved); }
  cuda::AttentionBackend saved;
};

// Both implementations of bf16 attention give the same outputs (to bf16 rounding), the lse of
// either one's forward drives the other's backward (the same natural-log convention), and
// cuDNN's backward is bitwise repeatable. The parity cases above check cuDNN against the CPU.
TEST(CudaAttention, CudnnAndXmoeKernelsAgree) {
  XMOE_REQUIRE_CUDA();
  if (!cuda::cudnn_attention_available()) GTEST_SKIP() << "this build or machine has no cuDNN";
  struct Shape {
    int64_t b, s, h, hkv, hd;
    bool causal;
  };
  for (const Shape a : {Shape{2, 200, 4, 2, 64, true}, Shape{1, 129, 2, 2, 64, false},
                        Shape{1, 150, 8, 2, 128, true}, Shape{2, 96, 4, 1, 128, false}}) {
    SCOPED_TRACE(
        fmt::format("B={} S={} H={} Hkv={} hd={} causal={}", a.b, a.s, a.h, a.hkv, a.hd, a.causal));
    EXPECT_STREQ(cuda::attention_impl(DType::bf16, a.b, a.s, a.h, a.hkv, a.hd, a.causal), "cudnn");
    const DType bf = DType::bf16;
    const Tensor q = ops::cast(randn({a.b, a.s, a.h, a.hd}, 80).to(kCuda), bf);
    const Tensor k = ops::cast(randn({a.b, a.s, a.hkv, a.hd}, 81).to(kCuda), bf);
    const Tensor v = ops::cast(randn({a.b, a.s, a.hkv, a.hd}, 82).to(kCuda), bf);
    const Tensor dout = ops::cast(randn({a.b, a.s, a.h, a.hd}, 83).to(kCuda), bf);
    auto forward = [&](cuda::AttentionBackend b) {
      AttentionBackendScope scope(b);
      return ops::attention(q, k, v, a.causal);
    };
    auto backward = [&](cuda::AttentionBackend b, const AttentionResult& f) {
      AttentionBackendScope scope(b);
      return ops::attention_backward(q, k, v, f.out, f.lse, dout, a.causal);
    };
    const auto cudnn = cuda::AttentionBackend::cudnn, native = cuda::AttentionBackend::native;
    const AttentionResult fc = forward(cudnn), fn = forward(native);
    EXPECT_LE(normalised_error(fc.out, fn.out), 1e-2);
    EXPECT_LE(normalised_error(fc.lse, fn.lse), 1e-3);
    const ops::AttentionGrads gc = backward(cudnn, fc), gn = backward(native, fn);
    const ops::AttentionGrads mixed = backward(native, fc), mixed2 = backward(cudnn, fn);
    for (const auto* g : {&gn, &mixed, &mixed2}) {
      EXPECT_LE(normalised_error(g->dq, gc.dq), 2e-2);
      EXPECT_LE(normalised_error(g->dk, gc.dk), 2e-2);
      EXPECT_LE(normalised_error(g->dv, gc.dv), 2e-2);
    }
    const ops::AttentionGrads again = backward(cudnn, fc);
    EXPECT_EQ(host_f32(again.dq).to_vector<float>(), host_f32(gc.dq).to_vector<float>());
    EXPECT_EQ(host_f32(again.dk).to_vector<float>(), host_f32(gc.dk).to_vector<float>());
    EXPECT_EQ(host_f32(again.dv).to_vector<float>(), host_f32(gc.dv).to_vector<float>());
  }
}

// ---- allocator, copies, zero fill -----------------------------------------------------------

TEST(CudaAllocator, ReusesFreedBlocksAndCounts) {
  XMOE_REQUIRE_CUDA();
  // Blocks earlier tests left in the cache would fit the requests below as well as the freed one.
  cuda::empty_cache(0);
  const MemoryStats before = memory_stats(kCuda);
  void* small = nullptr;
  {
    Tensor t = Tensor::empty({1000}, DType::f32, kCuda);
    small = t.raw();
    EXPECT_EQ(memory_stats(kCuda).live_bytes, before.live_bytes + 4000);
    EXPECT_GE(cuda::cache_stats(0).reserved_bytes, memory_stats(kCuda).live_bytes);
  }
  EXPECT_EQ(memory_stats(kCuda).live_bytes, before.live_bytes);
  const cuda::CacheStats warm = cuda::cache_stats(0);
  EXPECT_GE(warm.cached_bytes, 4096);
  {
    Tensor t = Tensor::empty({1000}, DType::f32, kCuda);  // same size class: the freed block
    EXPECT_EQ(t.raw(), small);
    Tensor big = Tensor::empty({3 << 18}, DType::f32, kCuda);  // 3 MiB -> a 4 MiB class
    void* big_ptr = big.raw();
    big = Tensor();
    Tensor big2 = Tensor::empty({(3 << 18) - 1000}, DType::f32, kCuda);
    EXPECT_EQ(big2.raw(), big_ptr);
  }
  {
    PeakMemoryScope scope(kCuda);
    Tensor a = Tensor::empty({2048}, DType::f32, kCuda);
    { Tensor b = Tensor::empty({1024}, DType::bf16, kCuda); }
    EXPECT_EQ(scope.extra_peak_bytes(), 2048 * 4 + 1024 * 2);
  }
  cuda::empty_cache(0);
  const cuda::CacheStats emptied = cuda::cache_stats(0);
  EXPECT_EQ(emptied.cached_bytes, 0);
  EXPECT_GT(emptied.num_frees, warm.num_frees);
  EXPECT_EQ(memory_stats(kCuda).live_bytes, before.live_bytes);
}

TEST(CudaAllocator, NoDeviceMallocAfterWarmup) {
  XMOE_REQUIRE_CUDA();
  const Tensor x = randn({256, 128}, 80).to(kCuda), w = randn({128, 256}, 81).to(kCuda);
  const Tensor index = rand_index(256, 64, 82).to(kCuda);
  auto step = [&] {
    Tensor h = ops::matmul(x, w);
    Tensor a = ops::swiglu(h);
    Tensor s = ops::softmax(a);
    Tensor out = Tensor::zeros({64, 128}, DType::f32, kCuda);
    ops::scatter_add_rows(out, s, index);
    const Tensor qkv = x.reshape({4, 32, 8, 32});  // 256 x 128 values as [B, S, H, hd]
    auto f = ops::attention(qkv, qkv, qkv);
    return ops::sum(out) + ops::sum(f.out);
  };
  // Blocks are not split, so a best fit can take a larger cached block and leave a later request
  // to cudaMalloc; the pool only grows, and a fixed sequence settles within a few steps.
  for (int i = 0; i < 3; ++i) step();
  const int64_t mallocs = cuda::cache_stats(0).num_mallocs;
  for (int i = 0; i < 3; ++i) step();
  EXPECT_EQ(cuda::cache_stats(0).num_mallocs, mallocs) << "cudaMalloc after warm-up";
}

// An allocation larger than the device: OutOfMemory with the device's free and total bytes
// (cudaMemGetInfo) and nothing counted, and the device works on. Then the allocator's cap
// (XMOE_MEMORY_LIMIT) refuses what a device of that size would.
TEST(CudaAllocator, ImpossibleAllocationThrowsOutOfMemoryAndCountsNothing) {
  XMOE_REQUIRE_CUDA();
  const Tensor held = Tensor::empty({1 << 20}, DType::f32, kCuda);  // 4 MiB live
  const MemoryStats before = memory_stats(kCuda);
  const int64_t asked = int64_t{1} << 50;  // 1 PiB
  try {
    Tensor t = Tensor::empty({asked / 2}, DType::bf16, kCuda);
    FAIL() << "allocated " << t.str();
  } catch (const OutOfMemory& e) {
    EXPECT_EQ(e.device(), "cuda:0");
    EXPECT_EQ(e.bytes_asked(), asked);
    EXPECT_GT(e.bytes_total(), int64_t{8} << 30);  // any GPU these tests run on
    EXPECT_GT(e.bytes_free(), 0);
    EXPECT_LE(e.bytes_free(), e.bytes_total());
    EXPECT_EQ(e.live_bytes(), before.live_bytes);
    const std::string what = e.what();
    EXPECT_NE(what.find("[cuda:0 allocator] out of memory: asked 1125899906842624 bytes"),
              std::string::npos)
        << what;
  }
  MemoryStats after = memory_stats(kCuda);
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_EQ(after.num_allocs, before.num_allocs);
  EXPECT_EQ(after.total_bytes, before.total_bytes);
  const Tensor works = Tensor::full({4}, 2.5f, kCuda);
  EXPECT_EQ(works.to_vector<float>(), (std::vector<float>{2.5f, 2.5f, 2.5f, 2.5f}));
  EXPECT_EQ(host_f32(held.rows(0, 1)).numel(), 1);

  Allocator& allocator = allocator_for(kCuda);
  const int64_t old_limit = allocator.limit();
  const int64_t live = memory_stats(kCuda).live_bytes;
  allocator.set_limit(live + (3 << 20));  // 3 MiB more
  try {
    Tensor t = Tensor::empty({1 << 20}, DType::f32, kCuda);  // 4 MiB: refused
    ADD_FAILURE() << "allocated " << t.str() << " past the limit";
  } catch (const OutOfMemory& e) {
    EXPECT_EQ(e.bytes_asked(), 4 << 20);
    EXPECT_EQ(e.bytes_free(), 3 << 20);
    EXPECT_EQ(e.bytes_total(), live + (3 << 20));
  }
  EXPECT_EQ(memory_stats(kCuda).live_bytes, live);
  { const Tensor fits = Tensor::empty({1 << 19}, DType::f32, kCuda); }  // 2 MiB: fits
  allocator.set_limit(old_limit);
  EXPECT_EQ(memory_stats(kCuda).live_bytes, live);
}

// On an sm90 GPU with CUTLASS built in, every bf16 expert GEMM of the shapes training uses runs
// on the sm90 kernels: a silent cuBLAS fallback is still correct, so only this sees it.
TEST(CudaGroupedGemm, Sm90KernelsRunWhereTheyApply) {
  XMOE_REQUIRE_CUDA();
  if (!cuda::grouped_gemm_sm90_available(0)) GTEST_SKIP() << "no sm90 grouped GEMM here";
  const DType bf = DType::bf16;
  const int64_t d = 256, f = 128;
  const std::vector<std::vector<int64_t>> routings = {
      {64, 64, 64, 64, 64, 64, 64, 64},  // even
      {3, 0, 17, 1, 300, 0, 40, 151},    // ragged, empty groups
      {4000, 8, 8, 8, 8, 8, 8, 8},       // one long group: weight gradient in pieces
  };
  for (const auto& sizes : routings) {
    int64_t rows = 0;
    for (int64_t s : sizes) rows += s;
    const auto groups = static_cast<int64_t>(sizes.size());
    const Tensor x = ops::cast(randn({rows, d}, 1).to(kCuda), bf);
    const Tensor w = ops::cast(randn({groups, d, f}, 2).to(kCuda), bf);
    const Tensor dy = ops::cast(randn({rows, f}, 3).to(kCuda), bf);
    Tensor dw = Tensor::zeros({groups, d, f}, DType::f32, kCuda);
    const auto before = std::vector<cuda::GroupedGemmCalls>{
        cuda::grouped_gemm_calls(cuda::GroupedGemmKind::forward),
        cuda::grouped_gemm_calls(cuda::GroupedGemmKind::forward_trans_w),
        cuda::grouped_gemm_calls(cuda::GroupedGemmKind::weight_grad)};
    ops::grouped_matmul(x, w, sizes);
    ops::grouped_matmul(dy, w, sizes, true);
    ops::grouped_matmul_weight_grad(dw, x, dy, sizes, false);
    ops::grouped_matmul_weight_grad(dw, x, dy, sizes, true);
    backend::synchronize(kCuda);
    const cuda::GroupedGemmKind kinds[] = {cuda::GroupedGemmKind::forward,
                                           cuda::GroupedGemmKind::forward_trans_w,
                                           cuda::GroupedGemmKind::weight_grad};
    const int64_t expected_calls[] = {1, 1, 2};
    for (int i = 0; i < 3; ++i) {
      const cuda::GroupedGemmCalls now = cuda::grouped_gemm_calls(kinds[i]);
      EXPECT_EQ(now.sm90 - before[i].sm90, expected_calls[i])
          << "kind " << i << ", " << rows << " rows";
      EXPECT_EQ(now.cublas - before[i].cublas, 0) << "kind " << i << ", " << rows << " rows";
    }
  }
}

TEST(CudaTensor, CopiesAndZeroFill) {
  XMOE_REQUIRE_CUDA();
  const std::vector<float> v = {1.f, -2.f, 3.5f, 0.25f, 8.f};
  Tensor t = Tensor::from_vector<float>(v, {5}, kCuda);
  EXPECT_EQ(t.to_vector<float>(), v);
  EXPECT_EQ(t.clone().to_vector<float>(), v);
  EXPECT_DOUBLE_EQ(t.item(2), 3.5);
  t.zero_();  // cudaMemsetAsync, ordered before the copy back
  EXPECT_EQ(t.to_vector<float>(), std::vector<float>(5, 0.f));
  Tensor z = Tensor::zeros({1 << 20}, DType::bf16, kCuda);
  EXPECT_EQ(ops::sum_squares(z), 0.0);
  Tensor f = Tensor::full({3}, 2.5f, kCuda);
  EXPECT_DOUBLE_EQ(ops::sum(f), 7.5);
}

// ---- timings (disabled: run with --gtest_also_run_disabled_tests --gtest_filter='CudaPerf*') --

/// JSON lines with the time of the main ops at moe-1b shapes (bf16): a first look at where the
/// straightforward kernels stand, not a benchmark (bench/ measures against PyTorch). Operands
/// are zeros (an upper bound: less power, higher clocks) except the GEMMs'.
TEST(CudaPerf, DISABLED_ModelShapes) {
  XMOE_REQUIRE_CUDA();
  auto time_ms = [](const std::function<void()>& f) {
    f();
    backend::synchronize(kCuda);
    Timer t;
    constexpr int kIters = 5;
    for (int i = 0; i < kIters; ++i) f();
    backend::synchronize(kCuda);
    return t.millis() / kIters;
  };
  auto report = [](const char* op, const char* shape, double ms, double flops) {
    std::printf("{\"op\": \"%s\", \"shape\": \"%s\", \"ms\": %.3f, \"tflops\": %.1f}\n", op, shape,
                ms, flops / (ms * 1e-3) / 1e12);
  };
  const DType bf = DType::bf16;
  auto device_randn = [&](Shape s, uint64_t seed) {
    return ops::cast(randn(s, seed).to(kCuda), bf);
  };
  {
    const Tensor z = Tensor::zeros({8192, 8192}, bf, kCuda), a = device_randn({8192, 8192}, 9);
    report("matmul_zeros", "8192^3", time_ms([&] { ops::matmul(z, z); }), 2.0 * 8192 * 8192 * 8192);
    report("matmul", "8192^3", time_ms([&] { ops::matmul(a, a); }), 2.0 * 8192 * 8192 * 8192);
  }
  {  // B=8, S=2048, H=16, hd=64: causal, so half the S x S scores count
    const Tensor q = Tensor::zeros({8, 2048, 16, 64}, bf, kCuda);
    const double flops = 4.0 * 8 * 16 * 2048 * 2048 * 64 / 2;
    AttentionResult f;
    report("attention", "8x2048x16x64", time_ms([&] { f = ops::attention(q, q, q); }), flops);
    report("attention_backward", "8x2048x16x64",
           time_ms([&] { ops::attention_backward(q, q, q, f.out, f.lse, q); }), 2.5 * flops);
  }
  {  // 16384 tokens x top-6 over 64 experts, d = 1024, f = 256 (gate|up = 512)
    const int64_t rows = 16384 * 6, d = 1024, f2 = 512;
    const std::vector<int64_t> sizes(64, rows / 64);
    // Random operands: zeros draw less power and run the tensor cores at higher clocks.
    const Tensor x = device_randn({rows, d}, 1), w = device_randn({64, d, f2}, 2);
    const Tensor dy = device_randn({rows, f2}, 3);
    Tensor dw = Tensor::zeros({64, d, f2}, DType::f32, kCuda);
    const double flops = 2.0 * rows * d * f2;
    report("grouped_matmul", "98304x1024x512,E64",
           time_ms([&] { ops::grouped_matmul(x, w, sizes); }), flops);
    report("grouped_matmul_trans_w", "98304x512x1024,E64",
           time_ms([&] { ops::grouped_matmul(dy, w, sizes, true); }), flops);
    report("grouped_matmul_weight_grad", "98304x1024x512,E64,f32dw",
           time_ms([&] { ops::grouped_matmul_weight_grad(dw, x, dy, sizes, true); }), flops);
    Tensor dw_down = Tensor::zeros({64, f2 / 2, d}, DType::f32, kCuda);
    const Tensor a = device_randn({rows, f2 / 2}, 4);
    report("grouped_matmul_weight_grad_down", "98304x256x1024,E64,f32dw",
           time_ms([&] { ops::grouped_matmul_weight_grad(dw_down, a, x, sizes, true); }),
           flops / 2);
    // Routing as uneven as an untrained router's can be: group g gets rows ~ 1 / (g + 1), a
    // quarter of them in the first group, and the last eight none.
    std::vector<int64_t> skewed(64, 0);
    double norm = 0;
    for (int g = 0; g < 56; ++g) norm += 1.0 / (g + 1);
    int64_t given = 0;
    for (int g = 1; g < 56; ++g) given += skewed[g] = static_cast<int64_t>(rows / norm / (g + 1));
    skewed[0] = rows - given;
    report("grouped_matmul_skewed", "98304x1024x512,E64",
           time_ms([&] { ops::grouped_matmul(x, w, skewed); }), flops);
    report("grouped_matmul_trans_w_skewed", "98304x512x1024,E64",
           time_ms([&] { ops::grouped_matmul(dy, w, skewed, true); }), flops);
    report("grouped_matmul_weight_grad_skewed", "98304x1024x512,E64,f32dw",
           time_ms([&] { ops::grouped_matmul_weight_grad(dw, x, dy, skewed, true); }), flops);
    report("grouped_matmul_weight_grad_down_skewed", "98304x256x1024,E64,f32dw",
           time_ms([&] { ops::grouped_matmul_weight_grad(dw_down, a, x, skewed, true); }),
           flops / 2);
    // Where the weight gradient's time goes: long reductions (8 groups of 12288 rows, one wave
    // of tiles) against short ones (64 x 1536 above), and a dense 8192^3 one (one group) against
    // matmul's 8192^3, overwriting (no f32 read of dW).
    const std::vector<int64_t> long_groups(8, rows / 8);
    Tensor dw8 = Tensor::zeros({8, d, f2}, DType::f32, kCuda);
    report("grouped_matmul_weight_grad_long", "98304x1024x512,E8,f32dw",
           time_ms([&] { ops::grouped_matmul_weight_grad(dw8, x, dy, long_groups, false); }),
           flops);
    report("grouped_matmul_weight_grad_overwrite", "98304x1024x512,E64,f32dw",
           time_ms([&] { ops::grouped_matmul_weight_grad(dw, x, dy, sizes, false); }), flops);
    {
      const Tensor a8 = device_randn({8192, 8192}, 7);
      Tensor dw_dense = Tensor::zeros({1, 8192, 8192}, DType::f32, kCuda);
      const std::vector<int64_t> one = {8192};
      report("grouped_matmul_weight_grad_dense", "8192^3,E1,f32dw",
             time_ms([&] { ops::grouped_matmul_weight_grad(dw_dense, a8, a8, one, false); }),
             2.0 * 8192 * 8192 * 8192);
    }
    {  // the write ceiling the f32 weight gradients of short reductions run into
      Tensor big = Tensor::zeros({int64_t{1} << 30}, DType::f32, kCuda);  // 4 GiB
      const double ms = time_ms([&] { big.zero_(); });
      std::printf(
          "{\"op\": \"memset_f32\", \"shape\": \"4 GiB\", \"ms\": %.3f, "
          "\"gb_per_s\": %.0f}\n",
          ms, 4.0 * (int64_t{1} << 30) / (ms * 1e-3) / 1e9);
    }
    const Tensor da = Tensor::zeros({rows, f2 / 2}, bf, kCuda);
    report("swiglu_backward", "98304x(2x256)", time_ms([&] { ops::swiglu_backward(dy, da); }), 0);
    const Tensor index = rand_index(rows, 16384, 5).to(kCuda);
    Tensor out = Tensor::zeros({16384, d}, bf, kCuda);
    report("scatter_add_rows", "98304->16384x1024",
           time_ms([&] { ops::scatter_add_rows(out, x, index); }), 0);
    report("gather_rows", "98304x1024", time_ms([&] { ops::gather_rows(out, index); }), 0);
  }
  {
    const Tensor logits = Tensor::zeros({16384, 32768}, bf, kCuda);
    const Tensor targets = rand_index(16384, 32768, 6).to(kCuda);
    report("cross_entropy", "16384x32768", time_ms([&] { ops::cross_entropy(logits, targets); }),
           0);
    const Tensor x = Tensor::zeros({16384, 1024}, bf, kCuda), w = Tensor::zeros({1024}, bf, kCuda);
    report("rmsnorm", "16384x1024", time_ms([&] { ops::rmsnorm(x, w, 1e-6f); }), 0);
    const auto r = ops::rmsnorm(x, w, 1e-6f);
    Tensor dw = Tensor::zeros({1024}, bf, kCuda);
    report("rmsnorm_backward", "16384x1024",
           time_ms([&] { ops::rmsnorm_backward(x, w, r.rstd, x, dw); }), 0);
    // The block's FFN norm forward: the f32 stream plus attention's f32 output, the sum written
    // in f32 and the norm in bf16 (14 bytes per value), and its norm backward: the f32 residual
    // stream, a bf16 gradient, the residual's gradient added and a bf16 copy written (16 bytes
    // per value; the GB/s count those).
    for (const int64_t d : {1024, 2048, 7168}) {
      const int64_t rows = 16384;
      const Tensor xf = Tensor::zeros({rows, d}, DType::f32, kCuda);
      const Tensor wf = Tensor::zeros({d}, DType::f32, kCuda);
      const double ms = time_ms([&] { ops::add_rmsnorm(xf, xf, wf, 1e-6f, bf); });
      std::printf(
          "{\"op\": \"add_rmsnorm\", \"shape\": \"%ldx%ld\", \"ms\": %.4f, "
          "\"gb_per_s\": %.0f}\n",
          static_cast<long>(rows), static_cast<long>(d), ms, 14.0 * rows * d / (ms * 1e-3) / 1e9);
    }
    for (const int64_t d : {1024, 2048, 7168}) {
      const int64_t rows = 16384;
      const Tensor xf = Tensor::zeros({rows, d}, DType::f32, kCuda);
      const Tensor wf = Tensor::zeros({d}, DType::f32, kCuda);
      const Tensor dyb = Tensor::zeros({rows, d}, bf, kCuda);
      const Tensor rstd = Tensor::zeros({rows}, DType::f32, kCuda);
      Tensor dwf = Tensor::zeros({d}, DType::f32, kCuda);
      const double ms =
          time_ms([&] { ops::rmsnorm_backward_add(xf, wf, rstd, dyb, dwf, xf, DType::bf16); });
      std::printf(
          "{\"op\": \"rmsnorm_backward_add\", \"shape\": \"%ldx%ld\", \"ms\": %.4f, "
          "\"gb_per_s\": %.0f}\n",
          static_cast<long>(rows), static_cast<long>(d), ms, 16.0 * rows * d / (ms * 1e-3) / 1e9);
    }
  }
  cuda::empty_cache(0);
}

// ---- errors (runs in every build) -----------------------------------------------------------

bool throws_containing(const std::function<void()>& f, const std::string& text) {
  try {
    f();
  } catch (const Error& e) {
    if (std::string(e.what()).find(text) != std::string::npos) return true;
    ADD_FAILURE() << "message '" << e.what() << "' lacks '" << text << "'";
    return false;
  }
  ADD_FAILURE() << "no exception (expected one containing '" << text << "')";
  return false;
}

TEST(CudaBuild, ClearErrors) {
  // CPU: bf16 has no CPU kernels and says so.
  EXPECT_TRUE(throws_containing(
      [] {
        ops::softmax(randn({2, 3}, 90).to(DType::bf16));
      },
      "[softmax] x has dtype bf16, expected f32"));
  if (!backend::cuda_available()) {
    // A CPU-only build (or a machine without a GPU) names the device it cannot provide.
    EXPECT_TRUE(throws_containing([] { Tensor::empty({4}, DType::f32, kCuda); }, "cuda:0"));
    EXPECT_TRUE(throws_containing([] { randn({4}, 91).to(kCuda); }, "cuda:0"));
    return;
  }
  const Tensor a = randn({4, 4}, 92);
  EXPECT_TRUE(throws_containing([&] { ops::matmul(a, a.to(kCuda)); }, "on one device"));
  EXPECT_TRUE(throws_containing(
      [&] {
        ops::embedding(a.to(kCuda), Tensor::from_vector<int32_t>({1, 7}, {2}, kCuda));
      },
      "[embedding] ids[1] = 7 out of range [0, 4)"));
  EXPECT_TRUE(throws_containing(
      [&] {
        ops::cross_entropy(a.to(kCuda), Tensor::from_vector<int32_t>({0, 1, 9, 2}, {4}, kCuda));
      },
      "[cross_entropy] targets[2] = 9 out of range [0, 4)"));
  EXPECT_TRUE(
      throws_containing([&] { ops::cast(rand_index(3, 3, 93).to(kCuda), DType::f32); }, "[cast]"));
}

// The device timeline records what ran, where and when: the kernels of two ops, in order, with
// their launch calls before them, and the copy back to the host.
TEST(CudaTimeline, RecordsKernelsCopiesAndTheirLaunches) {
  XMOE_REQUIRE_CUDA();
  const Tensor a = randn({1024, 1024}, 1).to(kCuda), b = randn({1024, 1024}, 2).to(kCuda);
  backend::start_device_timeline();
  const Tensor c = ops::mul(ops::add(a, b), a);
  const std::vector<float> host = c.to_vector<float>();
  const std::vector<DeviceActivity> records = backend::stop_device_timeline();
  int64_t kernels = 0, copies_back = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    const DeviceActivity& r = records[i];
    SCOPED_TRACE(r.name);
    EXPECT_FALSE(r.name.empty());
    EXPECT_LE(r.start_ns, r.end_ns);
    if (i > 0) {
      EXPECT_LE(records[i - 1].start_ns, r.start_ns);
    }
    if (r.kind == DeviceActivity::Kind::kernel) {
      ++kernels;
      EXPECT_GE(r.launch_ns, 0) << "a kernel without its launch call";
      EXPECT_LE(r.launch_ns, r.start_ns);
    }
    if (r.kind == DeviceActivity::Kind::memcpy && r.name == "memcpy DtoH") ++copies_back;
  }
  EXPECT_GE(kernels, 2);
  EXPECT_GE(copies_back, 1);
  const TimelineSummary s = summarize_timeline(records);
  EXPECT_GT(s.busy_ns, 0);
  EXPECT_EQ(s.span_ns, s.busy_ns + s.idle_ns);
  EXPECT_THROW(backend::stop_device_timeline(), Error);  // not recording any more
}

}  // namespace
