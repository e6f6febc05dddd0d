// The pipelined MoE layer (model.moe.pipeline) under mpirun (np 1, 2, 4): a layer whose
// Dispatch, Expert and Combine run in chunks of local experts against the same layer unchunked,
// on the same ranks and inputs. Chunks follow expert boundaries, so every expert sees the same
// rows in the same order and runs the same GEMM calls: outputs, dx and every gradient must be
// bitwise equal (EXPECT_EQ on the floats), for both dispatchers (all_to_all; rbd over simulated
// nodes), several forward/backward chunk counts, uniform and skewed routing (ranks and chunks
// that receive no rows), with expert data parallelism (ep < W) too.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "gradcheck.h"
#include "training_fixture.h"
#include "xmoe/comm/group.h"
#include "xmoe/moe/layer.h"
#include "xmoe/moe/pipeline.h"
#include "xmoe/parallel/layout.h"
#include "xmoe/train/trainer.h"

using namespace xmoe;
using namespace xmoe::moe;
using xmoe::testing::randn;

namespace {

constexpr int64_t kE = 24, kD = 16, kT = 16, kSeq = 4;  // E_local = 24 / ep: 6 to 24

std::shared_ptr<comm::Group> world() {
  return comm::world();
}

/// Every token to experts {0, 1, 2}: one rank (and one chunk) gets every row.
void skew_routing(MoELayer& layer) {
  layer.hooks().on<GateOut>([](GateOut& g) {
    Tensor idx = g.topk_idx.clone();
    int32_t* p = idx.data<int32_t>();
    for (int64_t i = 0; i < idx.numel(); ++i) p[i] = static_cast<int32_t>(i % idx.size(1));
    g.topk_idx = idx;
  });
}

struct Case {
  std::string dispatch = "all_to_all";
  int ep = 1;
  int ranks_per_node = 0;  // rbd: declared nodes
  bool skewed = false;
  std::string gate = "softmax_topk";
  std::string expert_dtype = "bf16";
};

void check_pipelined_equals_unchunked(const Case& k, int forward_chunks, int backward_chunks) {
  SCOPED_TRACE(k.dispatch + " ep " + std::to_string(k.ep) + " rpn " +
               std::to_string(k.ranks_per_node) + (k.skewed ? " skewed " : " ") + k.gate + " " +
               k.expert_dtype + ", chunks " + std::to_string(forward_chunks) + "/" +
               std::to_string(backward_chunks));
  auto g = world();
  const int r = g->rank();
  parallel::Layout par = parallel::Layout::create(g, k.ep);
  const LayerGroups groups{par.world, par.ep_group};
  MoeConfig c = xmoe::testing::micro_moe_layer(k.gate, k.dispatch, kE, 0.05f);
  c.expert_dtype = k.expert_dtype;
  MoELayer ref(c, kD, "moe", 42, 0.5f, 0.3f, groups);
  MoELayer piped(c, kD, "moe", 42, 0.5f, 0.3f, groups);
  if (k.ranks_per_node > 0) {
    ref.set_ranks_per_node(k.ranks_per_node);
    piped.set_ranks_per_node(k.ranks_per_node);
  }
  piped.set_pipeline(forward_chunks, backward_chunks);
  if (k.skewed) {
    skew_routing(ref);
    skew_routing(piped);
  }
  for (int step = 0; step < 2; ++step) {  // the second step accumulates into the gradients
    const Tensor x = randn({kT, kD}, 500 + 13 * r + step);
    const Tensor dy = randn({kT, kD}, 600 + 13 * r + step, 0.1f);
    if (step == 0) {
      ref.zero_grad();
      piped.zero_grad();
    }
    const Tensor y_ref = ref.forward(x, kSeq), y = piped.forward(x, kSeq);
    EXPECT_EQ(piped.local_expert_rows(), ref.local_expert_rows());
    const Tensor dx_ref = ref.backward(dy), dx = piped.backward(dy);
    EXPECT_EQ(y.to_vector<float>(), y_ref.to_vector<float>());
    EXPECT_EQ(dx.to_vector<float>(), dx_ref.to_vector<float>());
    EXPECT_EQ(piped.aux_loss(), ref.aux_loss());
    auto pr = ref.parameters(), pp = piped.parameters();
    ASSERT_EQ(pr.size(), pp.size());
    for (size_t i = 0; i < pr.size(); ++i) {
      pr[i]->settle_grad();
      pp[i]->settle_grad();
      EXPECT_EQ(pp[i]->grad.to_vector<float>(), pr[i]->grad.to_vector<float>()) << pr[i]->name;
    }
  }
}

const std::vector<std::pair<int, int>> kChunks = {{2, 2}, {3, 1}, {1, 4}, {4, 3}, {64, 64}};

std::vector<int> ep_sizes() {
  const int W = world()->size();
  std::vector<int> out;
  for (int ep = W; ep >= 1; --ep)
    if (W % ep == 0) out.push_back(ep);
  return out;
}

}  // namespace

TEST(MoePipeline, EvenChunksFollowExpertBoundaries) {
  EXPECT_EQ(even_chunks(6, 1), (ChunkBounds{0, 6}));
  EXPECT_EQ(even_chunks(6, 4), (ChunkBounds{0, 1, 3, 4, 6}));
  EXPECT_EQ(even_chunks(3, 8), (ChunkBounds{0, 1, 2, 3}));  // at most one chunk per expert
  EXPECT_THROW(even_chunks(4, 0), Error);
}

TEST(MoePipeline, AllToAllEqualsUnchunkedBitwise) {
  for (int ep : ep_sizes())
    for (bool skewed : {false, true})
      for (auto [f, b] : kChunks)
        check_pipelined_equals_unchunked({"all_to_all", ep, 0, skewed}, f, b);
}

TEST(MoePipeline, SigmoidAndXmoeGatesEqualUnchunked) {
  const int W = world()->size();
  for (const char* gate : {"sigmoid", "xmoe"})
    check_pipelined_equals_unchunked({"all_to_all", W, 0, false, gate}, 3, 2);
}

TEST(MoePipeline, LocalDispatchEqualsUnchunked) {
  if (world()->size() != 1) GTEST_SKIP() << "local dispatch: one process";
  for (auto [f, b] : kChunks) check_pipelined_equals_unchunked({"local", 1, 0, false}, f, b);
}

// FP8 experts: the pipelined layer quantises each chunk's rows, the unchunked one (with local
// dispatch) quantises x's rows through the order's indices without gathering them; the same bits.
TEST(MoePipeline, Fp8ExpertsEqualUnchunked) {
  const int W = world()->size();
  if (W == 1)
    for (auto [f, b] : kChunks)
      check_pipelined_equals_unchunked({"local", 1, 0, false, "softmax_topk", "fp8"}, f, b);
  check_pipelined_equals_unchunked({"all_to_all", W, 0, false, "softmax_topk", "fp8"}, 3, 2);
}

TEST(MoePipeline, RbdEqualsUnchunkedBitwise) {
  const int W = world()->size();
  if (W < 2) GTEST_SKIP() << "rbd needs two nodes";
  for (int rpn = 1; rpn < W; rpn *= 2)
    for (bool skewed : {false, true})
      for (auto [f, b] : kChunks) check_pipelined_equals_unchunked({"rbd", W, rpn, skewed}, f, b);
}

TEST(MoePipeline, HooksOnInnerBoundariesRunThatPassUnchunked) {
  const int W = world()->size();
  parallel::Layout par = parallel::Layout::create(world(), W);
  const MoeConfig c = xmoe::testing::micro_moe_layer("softmax_topk", "all_to_all", kE);
  MoELayer ref(c, kD, "moe", 42, 0.5f, 0.3f, {par.world, par.ep_group});
  MoELayer piped(c, kD, "moe", 42, 0.5f, 0.3f, {par.world, par.ep_group});
  piped.set_pipeline(3, 3);
  int64_t seen = -1;
  piped.hooks().on<DispatchOut>([&](DispatchOut& d) { seen = d.expert_in.size(0); });
  const Tensor x = randn({kT, kD}, 700 + world()->rank());
  const Tensor y_ref = ref.forward(x, kSeq), y = piped.forward(x, kSeq);
  int64_t rows = 0;
  for (int64_t n : piped.local_expert_rows()) rows += n;
  EXPECT_EQ(seen, rows);  // the whole expert input, not a chunk
  EXPECT_EQ(y.to_vector<float>(), y_ref.to_vector<float>());
  const Tensor dy = randn({kT, kD}, 800);
  EXPECT_EQ(piped.backward(dy).to_vector<float>(), ref.backward(dy).to_vector<float>());
}

TEST(MoePipeline, BadChunkCountsRaiseClearErrors) {
  const MoeConfig c = xmoe::testing::micro_moe_layer("softmax_topk", "all_to_all", kE);
  MoELayer layer(c, kD, "moe", 42, 0.5f, 0.3f);
  try {
    layer.set_pipeline(0, 2);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.moe.pipeline"), std::string::npos) << e.what();
  }
}

// Training: the micro run with model.moe.pipeline against off, on the same ranks (ep = W), for
// both dispatchers: every step's loss and gradient norm within 1e-6 relative (bitwise here).
TEST(MoePipeline, TrainingLossesEqualUnpipelined) {
  namespace fs = std::filesystem;
  auto g = world();
  const int W = g->size();
  const fs::path root = xmoe::testing::shared_corpus(*g, "xmoe-pipe-train-" + std::to_string(W));
  Config c = xmoe::testing::micro_parallel_config(root, {.experts = 24});
  c.parallel.ep = W;
  c.train.steps = 6;
  for (const char* dispatch : {"all_to_all", "rbd"}) {
    if (std::string(dispatch) == "rbd" && W < 2) continue;
    c.model.moe.dispatch = dispatch;
    c.parallel.ranks_per_node = std::string(dispatch) == "rbd" ? std::max(1, W / 2) : 0;
    c.model.moe.pipeline = "off";
    c.model.moe.pipeline_backward = "same";
    validate(c);
    const std::string tag = std::string(dispatch) + "-np" + std::to_string(W);
    const auto off = xmoe::testing::run_training(c, (root / (tag + "-off")).string(), g);
    for (auto [fwd, bwd] : {std::pair{"3", "same"}, std::pair{"auto", "4"}}) {
      c.model.moe.pipeline = fwd;
      c.model.moe.pipeline_backward = bwd;
      validate(c);
      const auto piped =
          xmoe::testing::run_training(c, (root / (tag + "-" + fwd + "-" + bwd)).string(), g);
      ASSERT_EQ(piped.steps.size(), off.steps.size());
      for (size_t i = 0; i < off.steps.size(); ++i) {
        const auto &a = off.steps[i], &b = piped.steps[i];
        EXPECT_LE(std::fabs(a.loss - b.loss), 1e-6 * std::fabs(a.loss)) << tag << " step " << i;
        EXPECT_LE(std::fabs(a.grad_norm - b.grad_norm), 1e-6 * std::fabs(a.grad_norm))
            << tag << " step " << i;
        EXPECT_EQ(a.loss, b.loss) << tag << " step " << i << ": not bitwise";
      }
    }
  }
  g->barrier();
  if (g->rank() == 0) fs::remove_all(root);
}
