// Expert placement (moe/placement.h): co-activation recording, the placement optimiser on a
// planted partition, and permute_experts (moe/expert_permutation.h) keeping the layer's function
// and, with the optimizer's moments as riders, the optimizer's trajectory (permuted). The last
// test measures, on the routing of the trained default model (runs/default/step-600, when
// present), how many inter-node pilots RBD sends with and without an optimised placement (the
// figures in docs/moe.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>

#include "gradcheck.h"
#include "testing.h"
#include "xmoe/config/config.h"
#include "xmoe/core/rng.h"
#include "xmoe/data/data_loader.h"
#include "xmoe/model/transformer.h"
#include "xmoe/moe/layer.h"
#include "xmoe/moe/placement.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/train/checkpoint.h"
#include "xmoe/train/state.h"

using namespace xmoe;
using namespace xmoe::moe;
using xmoe::testing::randn;
using xmoe::testing::rel_err;

namespace {

std::vector<int> shuffled(int n, uint64_t seed) {
  std::vector<int> p(n);
  std::iota(p.begin(), p.end(), 0);
  Rng rng(seed, 0);
  for (int i = n - 1; i > 0; --i) {
    const int j = static_cast<int>(rng.uniform() * (i + 1)) % (i + 1);
    std::swap(p[i], p[j]);
  }
  return p;
}

/// The tensor `t` of the permuted layer, mapped back: expert rows (axis 0) or columns (axis 1).
Tensor unpermute(const Tensor& t, const std::vector<int>& perm, int axis) {
  const int64_t E = static_cast<int64_t>(perm.size());
  std::vector<float> v = t.to_vector<float>(), out(v.size());
  if (axis == 0) {
    const int64_t inner = t.numel() / E;
    for (int64_t s = 0; s < E; ++s)
      std::copy_n(v.begin() + s * inner, inner, out.begin() + perm[s] * inner);
  } else {
    const int64_t rows = t.numel() / E;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t s = 0; s < E; ++s) out[r * E + perm[s]] = v[r * E + s];
  }
  return Tensor::from_vector(out, t.shape());
}

int expert_axis(const Parameter& p, const std::string& gate) {
  if (p.kind == ParamKind::expert) return 0;
  const auto& n = p.name;
  if (n.find("router.expert_embeddings") != std::string::npos) return 1;
  if (n.find("router.weight") != std::string::npos && gate != "xmoe") return 1;
  return -1;  // not permuted (shared experts, xmoe projection and temperature)
}

MoeConfig config(const std::string& gate) {
  MoeConfig c;
  c.num_experts = 8;
  c.top_k = 3;
  c.expert_hidden = 8;
  c.num_shared_experts = 1;
  c.gate = gate;
  c.aux_loss_weight = 0.1f;
  c.z_loss_weight = 0.01f;
  return c;
}

}  // namespace

TEST(Coactivation, RecordsPairsOfEachToken) {
  MoELayer layer(config("softmax_topk"), 16, "m", 1, 0.5f);
  layer.set_record_coactivation(true);
  layer.forward(randn({32, 16}, 3), 8);
  const CoactivationMatrix& c = layer.coactivation();
  int64_t diag = 0, off = 0;
  for (int a = 0; a < 8; ++a)
    for (int b = 0; b < 8; ++b) {
      EXPECT_EQ(c.at(a, b), c.at(b, a));
      (a == b ? diag : off) += c.at(a, b);
    }
  EXPECT_EQ(diag, 32 * 3);
  EXPECT_EQ(off, 32 * 3 * 2);  // k (k - 1) ordered pairs per token
  layer.release();
  layer.set_record_coactivation(false);
  layer.forward(randn({32, 16}, 4), 8);
  EXPECT_EQ(layer.coactivation().counts, c.counts);  // off: nothing added
  layer.reset_coactivation();
  EXPECT_EQ(layer.coactivation().at(0, 0), 0);
}

TEST(Placement, FindsThePlantedPartition) {
  // 32 experts in 4 hidden clusters of 8 (a shuffled labelling); tokens pick k = 4 experts of
  // one cluster with probability 0.9, else any 4.
  const int E = 32, nodes = 4, per = 8, k = 4;
  const std::vector<int> label = shuffled(E, 7);  // expert label[i] is in cluster i / per
  Rng rng(11, 0);
  std::vector<int32_t> idx;
  for (int t = 0; t < 4000; ++t) {
    const bool clustered = rng.uniform() < 0.9f;
    const int cl = static_cast<int>(rng.uniform() * nodes) % nodes;
    std::vector<int> pool = shuffled(clustered ? per : E, 100 + t);
    for (int j = 0; j < k; ++j) idx.push_back(clustered ? label[cl * per + pool[j]] : pool[j]);
  }
  const CoactivationMatrix c = CoactivationMatrix::from_routing(idx, k, E);
  const std::vector<int> perm = optimize_placement(c, nodes, per);
  EXPECT_EQ(perm, optimize_placement(c, nodes, per));  // deterministic
  std::vector<int> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < E; ++i) ASSERT_EQ(sorted[i], i);
  std::vector<int> identity(E);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_GT(intra_node_coactivation(c, perm, per), intra_node_coactivation(c, identity, per));
  // Each node holds exactly one planted cluster.
  std::vector<int> cluster_of(E);
  for (int i = 0; i < E; ++i) cluster_of[label[i]] = i / per;
  for (int n = 0; n < nodes; ++n)
    for (int s = n * per; s < (n + 1) * per; ++s)
      EXPECT_EQ(cluster_of[perm[s]], cluster_of[perm[n * per]]) << "node " << n;
  // Pilots: fewer distinct nodes per token; the C-only estimate agrees in direction.
  const PilotCount before = count_pilots(idx, k, {}, nodes, per);
  const PilotCount after = count_pilots(idx, k, perm, nodes, per);
  EXPECT_LT(after.internode_pilots, 0.5 * before.internode_pilots);
  EXPECT_EQ(after.pairs, before.pairs);
  EXPECT_LT(expected_internode_pilots(c, perm, nodes, per),
            expected_internode_pilots(c, {}, nodes, per));
}

TEST(Placement, IdentityWhenNothingToGain) {
  CoactivationMatrix c(8);  // no co-activation at all
  const std::vector<int> perm = optimize_placement(c, 2, 4);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(perm[i], i);
  EXPECT_THROW(optimize_placement(c, 3, 4), Error);
}

namespace {

/// A permuted layer computes the same y and dx, and its gradients are the permuted ones.
void check_permuted_function(const std::string& gate) {
  SCOPED_TRACE(gate);
  const MoeConfig c = config(gate);
  MoELayer a(c, 16, "m", 5, 0.5f), b(c, 16, "m", 5, 0.5f);
  if (Tensor* bias = a.gate().routing_bias()) {  // a non-trivial selection bias
    Tensor r = randn({8}, 9, 0.05f);
    bias->copy_from(r);
    b.gate().routing_bias()->copy_from(r);
  }
  const std::vector<int> perm = shuffled(8, 21);
  b.permute_experts(perm);
  const Tensor x = randn({24, 16}, 31), dy = randn({24, 16}, 32, 0.1f);
  a.zero_grad();
  b.zero_grad();
  Tensor ya = a.forward(x, 8), yb = b.forward(x, 8);
  // Summation order: y[t] adds its k expert outputs in expert-id order, which the permutation
  // changes; the router GEMM computes each logit column alone (the same dot product), so the
  // selection is the same and the aux losses differ only by the order of their sums over E.
  EXPECT_LE(rel_err(yb, ya), 1e-6);
  EXPECT_NEAR(b.aux_loss(), a.aux_loss(), 1e-6 * std::abs(a.aux_loss()) + 1e-9);
  Tensor dxa = a.backward(dy), dxb = b.backward(dy);
  EXPECT_LE(rel_err(dxb, dxa), 1e-6);
  auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    const int axis = expert_axis(*pa[i], gate);
    Tensor gb = axis < 0 ? pb[i]->grad : unpermute(pb[i]->grad, perm, axis);
    Tensor vb = axis < 0 ? pb[i]->value : unpermute(pb[i]->value, perm, axis);
    EXPECT_LE(rel_err(gb, pa[i]->grad), 1e-5) << pa[i]->name;
    EXPECT_EQ(vb.to_vector<float>(), pa[i]->value.to_vector<float>()) << pa[i]->name;
  }
  if (Tensor* bias = b.gate().routing_bias()) {
    EXPECT_EQ(unpermute(*bias, perm, 1).to_vector<float>(),
              a.gate().routing_bias()->to_vector<float>());
  }
}

}  // namespace

TEST(PermuteExperts, SameFunctionSoftmaxTopk) {
  check_permuted_function("softmax_topk");
}
TEST(PermuteExperts, SameFunctionSigmoidWithBias) {
  check_permuted_function("sigmoid");
}
TEST(PermuteExperts, SameFunctionXmoe) {
  check_permuted_function("xmoe");
}

// bf16 expert gradients (moe.expert_grad_dtype) move with their experts, bit for bit.
TEST(PermuteExperts, MovesBf16GradientsExactly) {
  MoeConfig c = config("softmax_topk");
  c.expert_grad_dtype = "bf16";
  MoELayer layer(c, 16, "m", 5, 0.5f);
  layer.zero_grad();
  layer.forward(randn({24, 16}, 31), 8);
  layer.backward(randn({24, 16}, 32, 0.1f));
  std::vector<Tensor> before;
  for (Parameter* p : layer.parameters()) {
    settle_grads({p});
    before.push_back(p->grad.clone());
  }
  const std::vector<int> perm = shuffled(8, 21);
  layer.permute_experts(perm);
  const auto ps = layer.parameters();
  int bf16_grads = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    if (ps[i]->grad.dtype() != DType::bf16) continue;
    ++bf16_grads;
    const Tensor back = unpermute(ps[i]->grad.to(DType::f32), perm, 0);
    EXPECT_EQ(back.to_vector<float>(), before[i].to(DType::f32).to_vector<float>()) << ps[i]->name;
  }
  EXPECT_EQ(bf16_grads, 2);  // gate_up and down
}

TEST(PermuteExperts, RejectsBadPermutationsAndGroupSplits) {
  MoELayer a(config("softmax_topk"), 16, "m", 5, 0.5f);
  EXPECT_THROW(a.permute_experts({0, 1, 2}), Error);
  EXPECT_THROW(a.permute_experts({0, 0, 2, 3, 4, 5, 6, 7}), Error);
  MoeConfig c = config("sigmoid");
  c.num_groups = 2;
  c.topk_groups = 1;
  MoELayer g(c, 16, "m", 5, 0.5f);
  EXPECT_THROW(g.permute_experts({0, 4, 2, 3, 1, 5, 6, 7}), Error);  // splits both groups
  EXPECT_NO_THROW(g.permute_experts({5, 4, 7, 6, 1, 0, 3, 2}));      // moves whole groups
}

// A rider moves exactly as its parameter; riders of parameters that hold no experts (xmoe's
// projection, its temperature, the shared experts) or of another layer stay as they are.
TEST(PermuteExperts, RidersMoveWithTheirParameters) {
  MoELayer layer(config("xmoe"), 16, "m", 5, 0.5f), other(config("xmoe"), 16, "o", 6, 0.5f);
  std::vector<ExpertRider> riders;
  for (Parameter* p : layer.parameters()) riders.push_back({p, p->value.clone()});
  for (Parameter* p : other.parameters()) riders.push_back({p, p->value.clone()});
  std::vector<std::vector<float>> before;
  for (const ExpertRider& r : riders) before.push_back(r.tensor.to_vector<float>());
  const std::vector<int> perm = shuffled(8, 21);
  layer.permute_experts(perm, riders);
  const auto ps = layer.parameters();
  int moved = 0;
  for (size_t i = 0; i < riders.size(); ++i) {
    const std::vector<float> now = riders[i].tensor.to_vector<float>();
    if (i < ps.size()) {
      EXPECT_EQ(now, ps[i]->value.to_vector<float>()) << ps[i]->name;
    }
    moved += now != before[i];
  }
  EXPECT_EQ(moved, 3);  // router.expert_embeddings, experts.gate_up, experts.down
  const std::string err = xmoe::testing::error_of([&] {
    layer.permute_experts(perm, std::vector<ExpertRider>{{ps[3], Tensor::zeros({2})}});
  });
  EXPECT_NE(err.find("a tensor riding with m.experts.gate_up is f32[2] on cpu, the parameter is"),
            std::string::npos)
      << err;
}

namespace {

/// AdamW's moments as riders of their parameters (what the trainer passes to permute_experts).
std::vector<ExpertRider> moment_riders(const optim::AdamW& opt) {
  std::vector<ExpertRider> riders;
  for (size_t i = 0; i < opt.parameters().size(); ++i) {
    riders.push_back({opt.parameters()[i], opt.m(i)});
    riders.push_back({opt.parameters()[i], opt.v(i)});
  }
  return riders;
}

}  // namespace

TEST(PermuteExperts, OptimizerTakesThePermutedSteps) {
  // Two identical layers + AdamW; after one step, b (and its optimizer state) is permuted;
  // three more steps on the same data: b's parameters stay a's, permuted.
  const MoeConfig c = config("softmax_topk");
  MoELayer a(c, 16, "m", 5, 0.5f), b(c, 16, "m", 5, 0.5f);
  optim::AdamWConfig oc;
  optim::AdamW oa(a.parameters(), oc), ob(b.parameters(), oc);
  const std::vector<int> perm = shuffled(8, 77);
  for (int step = 0; step < 4; ++step) {
    if (step == 1) b.permute_experts(perm, moment_riders(ob));
    const Tensor x = randn({24, 16}, 40 + step), dy = randn({24, 16}, 50 + step, 0.1f);
    for (auto* l : {&a, &b}) {
      l->zero_grad();
      l->forward(x, 8);
      l->backward(dy);
    }
    oa.step(1e-2f);
    ob.step(1e-2f);
  }
  auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    const int axis = expert_axis(*pa[i], "softmax_topk");
    Tensor vb = axis < 0 ? pb[i]->value : unpermute(pb[i]->value, perm, axis);
    // AdamW's update m / (sqrt(v) + eps) amplifies the 1e-7 gradient differences where v is
    // tiny; 1e-4 relative to the tensor's largest entry.
    EXPECT_LE(rel_err(vb, pa[i]->value), 1e-4) << pa[i]->name;
    Tensor mb = axis < 0 ? ob.m(i) : unpermute(ob.m(i), perm, axis);
    EXPECT_LE(rel_err(mb, oa.m(i)), 1e-4) << pa[i]->name << " adam_m";
  }
}
