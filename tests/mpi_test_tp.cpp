// Tensor parallelism (parallel.tp) with sequence parallelism, with and without sequence-sharded
// MoE blocks (parallel.ssmb), combined with expert and data parallelism, under mpirun: training
// equals the one-process run of the same global batch (world / tp micro-batches per step), the
// synchronised gradients equal the one-process gradients, and checkpoints resume across a change
// of tp. f32 throughout.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "testing.h"
#include "training_fixture.h"
#include "xmoe/comm/group.h"
#include "xmoe/config/config.h"
#include "xmoe/model/transformer.h"
#include "xmoe/parallel/grad_sync.h"
#include "xmoe/parallel/layout.h"
#include "xmoe/parallel/tensor_parallel.h"
#include "xmoe/train/trainer.h"

namespace fs = std::filesystem;
using namespace xmoe;
using xmoe::testing::expect_same_losses;
using xmoe::testing::run_training;

namespace {

auto world() {
  return comm::world();
}

fs::path shared_root() {
  return xmoe::testing::shared_corpus(*world(), "xmoe-mpi-tp-" + std::to_string(world()->size()));
}

/// The distributed micro run (training_fixture.h) with 8 query heads sharing 4 kv heads (tp up
/// to 4), a dense first layer, 12 experts + 1 shared, the sequence-level balance loss on (its
/// statistics are per sequence: they must stay whole on a tp rank), 4 sequences per micro-batch.
Config tp_config(const fs::path& root, int steps) {
  Config c = xmoe::testing::micro_parallel_config(root, {.experts = 12});
  c.model.num_heads = 8;
  c.model.num_kv_heads = 4;
  c.model.moe.num_shared_experts = 1;
  c.model.moe.seq_aux_loss_weight = 0.01f;
  c.train.batch_size = 4;
  c.train.steps = steps;
  validate(c);
  return c;
}

struct TpLayout {
  int tp = 1, ep = 1;
  bool ssmb = true;
  int zero = 0;
  std::string tag() const {
    return fmt::format("tp{}-ep{}-{}-zero{}", tp, ep, ssmb ? "ssmb" : "nossmb", zero);
  }
};

/// The layouts of `n` ranks: tp 2 and 4, with and without SSMB, with ep and dp (np 3: none,
/// 3 divides neither the kv heads nor the batch).
std::vector<TpLayout> layouts(int n) {
  if (n == 2) return {{2, 1, true}, {2, 1, false}, {2, 2, true, 2}};
  if (n == 4)
    return {{2, 1, true},      // tp 2 × dp 2
            {2, 2, true},      // ep 2 over the world (SSMB)
            {2, 2, false, 1},  // ep 2 over the tp-replica group, zero 1
            {4, 1, true},     {4, 1, false}, {4, 4, true, 2}};
  return {};
}

Config with_layout(Config c, const TpLayout& l) {
  c.parallel.tp = l.tp;
  c.parallel.ep = l.ep;
  c.parallel.ssmb = l.ssmb;
  c.parallel.zero = l.zero;
  validate(c);
  return c;
}

/// The one-process run of the same global batch: world / tp micro-batches of B.
train::TrainResult reference(const Config& c, const fs::path& root, int tp,
                             const std::string& tag) {
  return run_training(xmoe::testing::one_process(c, world()->size() / tp),
                      (root / ("ref-" + tag + "-rank" + std::to_string(world()->rank()))).string(),
                      comm::make_single_group());
}

/// Deterministic token ids [b, s] below `vocab`, the same on every rank.
Tensor token_ids(int64_t b, int64_t s, int64_t vocab, uint64_t salt) {
  std::vector<int32_t> v(static_cast<size_t>(b * s));
  uint64_t x = 0x9e3779b97f4a7c15ull ^ salt;
  for (auto& t : v) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    t = static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(vocab));
  }
  return Tensor::from_vector<int32_t>(v, {b, s});
}

/// max |a - b| <= tol · max |ref| (+ a floor for all-zero gradients).
void expect_close(const Tensor& got, const Tensor& ref, const std::string& what) {
  ASSERT_EQ(got.shape(), ref.shape()) << what;
  const auto a = got.to_vector<float>(), b = ref.to_vector<float>();
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  EXPECT_LE(diff, 2e-5 * scale + 1e-8)
      << what << ": max |diff| " << diff << ", max |ref| " << scale;
}

}  // namespace

TEST(TensorParallel, TrainsLikeOneProcess) {
  const int n = world()->size();
  if (layouts(n).empty()) GTEST_SKIP() << "no tensor-parallel layout of " << n << " ranks";
  const fs::path root = shared_root();
  const Config base = tp_config(root, 20);
  std::map<int, train::TrainResult> refs;  // by tp: the global batch is world / tp × B
  for (const TpLayout& l : layouts(n)) {
    if (!refs.count(l.tp)) refs.emplace(l.tp, reference(base, root, l.tp, std::to_string(l.tp)));
    const train::TrainResult& ref = refs.at(l.tp);
    const auto got = run_training(with_layout(base, l), (root / l.tag()).string(), world());
    ASSERT_EQ(got.steps.size(), ref.steps.size()) << l.tag();
    expect_same_losses(ref, got, 0, l.tag());
    ASSERT_EQ(got.evals.size(), ref.evals.size());
    for (size_t i = 0; i < got.evals.size(); ++i)
      EXPECT_LE(std::fabs(got.evals[i].val_loss - ref.evals[i].val_loss),
                1e-5 * ref.evals[i].val_loss)
          << l.tag();
  }
  world()->barrier();
}

// After one forward and backward of the same global batch, every synchronised gradient (the
// tensor-parallel shards gathered, the expert shards against their rows) equals the one-process
// gradient of the mean cross-entropy plus the aux losses.
TEST(TensorParallel, GradientsMatchOneProcess) {
  const int n = world()->size();
  if (layouts(n).empty()) GTEST_SKIP() << "no tensor-parallel layout of " << n << " ranks";
  const ModelConfig m = tp_config("unused", 1).model;
  const int64_t b = 4, s = 16;
  for (TpLayout l : layouts(n)) {
    l.zero = 0;  // compares whole gradients
    const parallel::Layout layout = parallel::Layout::create(world(), l.ep, l.tp, l.ssmb);
    ModelConfig mc = m;
    mc.moe.dispatch = l.ep > 1 ? "all_to_all" : "local";
    const int64_t global_b = b * layout.data_ranks();
    const Tensor ids = token_ids(global_b, s, m.vocab_size, 1),
                 targets = token_ids(global_b, s, m.vocab_size, 2);
    model::Transformer ref(m, 7);
    const float ref_loss = ref.forward_loss(ids, targets);
    ref.backward();

    model::Transformer tp(mc, 7, &layout);
    const int64_t first = layout.data_rank() * b;
    Tensor loss_t = Tensor::from_vector<double>(
        {tp.forward_loss(ids.rows(first, first + b), targets.rows(first, first + b))}, {1});
    tp.backward();
    world()->all_reduce(loss_t);
    EXPECT_NEAR(loss_t.item() / n, ref_loss, 1e-5 * ref_loss) << l.tag();
    EXPECT_NEAR(tp.aux_loss(), ref.aux_loss(), 1e-5 * ref.aux_loss() + 1e-7) << l.tag();
    const std::vector<Parameter*> ps = tp.parameters(), rs = ref.parameters();
    parallel::GradientSync sync(ps, layout);
    sync.sync();
    ASSERT_EQ(ps.size(), rs.size());
    for (size_t i = 0; i < ps.size(); ++i) {
      const Parameter& p = *ps[i];
      ASSERT_EQ(p.name, rs[i]->name);
      const std::string what = l.tag() + " " + p.name;
      if (p.kind == ParamKind::tensor_shard) {
        expect_close(parallel::gather_shards(*layout.tp_group, p.grad, p.shard), rs[i]->grad, what);
      } else if (p.kind == ParamKind::expert) {
        expect_close(p.grad, rs[i]->grad.rows(p.shard.offset, p.shard.offset + p.value.size(0)),
                     what);
      } else {
        expect_close(p.grad, rs[i]->grad, what);
      }
    }
    // The global norm counts every element of the whole model once.
    double ref_sq = 0;
    for (const Parameter* r : rs)
      for (float g : r->grad.to_vector<float>()) ref_sq += static_cast<double>(g) * g;
    EXPECT_NEAR(sync.global_grad_sum_squares(), ref_sq, 1e-4 * ref_sq) << l.tag();
  }
  world()->barrier();
}

// Selective recompute under tp (heads split, SSMB or not): attention_core, router and moe give
// bit for bit the gradients of the run that keeps everything, and backward makes the same
// collectives (the router's recompute reuses the aux-loss statistics: no second reduction).
TEST(TensorParallel, SelectiveRecomputeGivesTheSameGradients) {
  const int n = world()->size();
  if (layouts(n).empty()) GTEST_SKIP() << "no tensor-parallel layout of " << n << " ranks";
  const ModelConfig m = tp_config("unused", 1).model;
  const int64_t b = 4, s = 16;
  for (const TpLayout& l : {layouts(n)[0], layouts(n)[1]}) {
    const parallel::Layout layout = parallel::Layout::create(world(), l.ep, l.tp, l.ssmb);
    ModelConfig mc = m;
    mc.moe.dispatch = l.ep > 1 ? "all_to_all" : "local";
    const std::vector<std::shared_ptr<comm::Group>> groups = {layout.world, layout.moe_world,
                                                              layout.tp_group, layout.ep_group};
    const Tensor ids = token_ids(b, s, m.vocab_size, 10 + layout.data_rank()),
                 targets = token_ids(b, s, m.vocab_size, 20 + layout.data_rank());
    auto run = [&](std::vector<std::string> recompute, std::vector<std::vector<float>>& grads) {
      mc.recompute = std::move(recompute);
      model::Transformer model(mc, 7, &layout);
      for (const auto& g : groups) g->counters().reset();
      const float loss = model.forward_loss(ids, targets);
      model.backward();
      for (Parameter* p : model.parameters()) grads.push_back(p->grad.to_vector<float>());
      std::vector<int64_t> calls;
      for (const auto& g : groups)
        calls.insert(calls.end(), g->counters().calls.begin(), g->counters().calls.end());
      return std::pair{loss, calls};
    };
    std::vector<std::vector<float>> kept, recomputed;
    const auto a = run({}, kept);
    const auto r = run({"attention_core", "router", "moe"}, recomputed);
    EXPECT_EQ(a.first, r.first) << l.tag();
    EXPECT_EQ(a.second, r.second) << l.tag() << ": recompute changed the collectives";
    EXPECT_EQ(kept, recomputed) << l.tag();
  }
  world()->barrier();
}

// A tp = 2 checkpoint resumes at tp = 1 and the other way round (the global batch kept: tp 1
// reads B / 2 per rank), continuing the one-process run.
TEST(TensorParallel, ResumesAcrossAChangeOfTp) {
  const int n = world()->size();
  if (n % 2 != 0) GTEST_SKIP() << "tp = 2 needs an even number of ranks";
  const fs::path root = shared_root();
  Config tp2 = tp_config(root, 8);
  tp2.parallel.tp = 2;
  validate(tp2);
  Config tp1 = tp2;
  tp1.parallel.tp = 1;
  tp1.train.batch_size /= 2;
  validate(tp1);
  const auto ref = reference(tp_config(root, 8), root, 2, "resume");
  for (const bool from_tp2 : {true, false}) {
    const std::string out = (root / (from_tp2 ? "tp2-then-tp1" : "tp1-then-tp2")).string();
    run_training(from_tp2 ? tp2 : tp1, out, world(), false, 4);
    const auto rest = run_training(from_tp2 ? tp1 : tp2, out, world(), true);
    ASSERT_EQ(rest.first_step, 4);
    expect_same_losses(ref, rest, 4, from_tp2 ? "tp 2 resumed at tp 1" : "tp 1 resumed at tp 2");
  }
  world()->barrier();
}

// A tp that does not divide the processes, the kv heads, the dense FFN or the micro-batch, and
// an ep that does not divide the MoE layers' ranks, are refused naming the keys.
TEST(TensorParallel, BadLayoutsAreRefusedNamingTheKey) {
  const int n = world()->size();
  const std::string e =
      xmoe::testing::error_of([&] { parallel::Layout::create(world(), 1, n + 1); });
  EXPECT_CONTAINS(
      e, fmt::format("parallel.tp = {} does not divide the number of processes {}", n + 1, n));
  if (n % 2 == 0 && n > 2) {
    const std::string ep =
        xmoe::testing::error_of([&] { parallel::Layout::create(world(), n, 2, /*ssmb=*/false); });
    EXPECT_CONTAINS(ep, fmt::format("parallel.ep = {} does not divide the {} ranks", n, n / 2));
    EXPECT_CONTAINS(ep, "parallel.ssmb = false");
  }
  Config c = tp_config("unused", 1);
  c.parallel.tp = 8;  // kv heads 4
  EXPECT_CONTAINS(xmoe::testing::error_of([&] { validate(c); }),
                  "model.num_kv_heads = 4 is not divisible by parallel.tp = 8");
  c.parallel.tp = 4;
  c.model.dense_hidden = 50;
  EXPECT_CONTAINS(xmoe::testing::error_of([&] { validate(c); }),
                  "model.dense_hidden = 50 is not divisible by parallel.tp = 4");
  c.model.dense_hidden = 48;
  c.train.batch_size = 6;
  EXPECT_CONTAINS(xmoe::testing::error_of([&] { validate(c); }),
                  "train.batch_size = 6 is not divisible by parallel.tp = 4");
  world()->barrier();
}
