// parallel.zero's master-weight sharding on CPU ranks (docs/training.md, "Memory at scale"):
// parameters with bf16 compute copies (the CPU AdamW kernel rewrites them as CUDA's does) keep
// only their optimizer pieces' f32 masters; the update's all-gather moves the bf16 copies. Every
// rank's copies and gathered masters must equal, bit for bit, one process's whole AdamW.
#include <gtest/gtest.h>

#include <cstring>

#include "xmoe/ops/ops.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/parallel/grad_sync.h"
#include "xmoe/parallel/layout.h"
#include "xmoe/train/state.h"

using namespace xmoe;

namespace {

struct Spec {
  const char* name;
  Shape shape;
  bool copy;       ///< a bf16 compute copy
  bool reads_f32;  ///< its module reads f32 weights too (the master stays whole)
};

/// With 40-element buckets: [wq 35, norm 3], [wk 36, wv 4], [router 18], [w1 65], [w2 2]: the
/// parameters straddle the shards of 2, 3 and 4 ranks, the buckets mix master-sharded and f32
/// parameters, and the last bucket is smaller than 3 or 4 ranks.
const Spec kSpecs[] = {
    {"wq", {7, 5}, true, false}, {"norm", {3}, false, false},    {"wk", {4, 9}, true, false},
    {"wv", {2, 2}, true, false}, {"router", {6, 3}, true, true}, {"w1", {5, 13}, true, false},
    {"w2", {1, 2}, true, false},
};
constexpr int64_t kBucketBytes = 40 * 4;

std::vector<Parameter> make_params(uint64_t seed) {
  std::vector<Parameter> out;
  for (const Spec& s : kSpecs) {
    Parameter p = Parameter::make(s.name, s.shape, ParamKind::dense, std::string(s.name) != "norm");
    p.init_normal(seed, 0.5f);
    if (s.copy) p.compute_copy = ops::cast(p.value, DType::bf16);
    p.reads_f32 = s.reads_f32;
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<Parameter*> pointers(std::vector<Parameter>& ps) {
  std::vector<Parameter*> out;
  for (Parameter& p : ps) out.push_back(&p);
  return out;
}

/// The same gradient on every rank (and in the reference) for step `step`.
Tensor gradient(const Parameter& p, int step) {
  Tensor g = Tensor::empty(p.value.shape());
  fill_normal(g, 1000 + static_cast<uint64_t>(step), stream_id(p.name), 0.1f);
  return g;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

/// A sharded optimizer (zero 1 or 2) over `params`, as train/trainer.cpp builds it.
struct Sharded {
  Sharded(std::vector<Parameter*> params, const parallel::Layout& layout, int zero)
      : sync(params, layout, kBucketBytes, zero) {
    std::vector<optim::AdamWPiece> pieces;
    for (const parallel::OwnedPiece& p : sync.owned_pieces())
      pieces.emplace_back(p.param, p.offset, p.count, Tensor(), p.shard_grad, p.master);
    opt = std::make_unique<optim::AdamW>(pieces, optim::AdamWConfig{});
    for (Parameter* p : params)
      if (parallel::GradientSync::shards_master(*p, zero)) p->shard_master_weights();
  }
  /// One update from the step's gradients (zero 2: as the owned ranges of them), then the
  /// all-gather.
  void step(int step, float lr) {
    std::vector<Tensor> whole;
    for (Parameter* p : sync.parameters()) whole.push_back(gradient(*p, step));
    if (sync.zero() == 2) {
      std::vector<Tensor> shards;
      for (const optim::AdamWPiece& piece : opt->pieces()) {
        const size_t i = static_cast<size_t>(
            std::find(sync.parameters().begin(), sync.parameters().end(), piece.param) -
            sync.parameters().begin());
        shards.push_back(
            whole[i].reshape({whole[i].numel()}).rows(piece.offset, piece.offset + piece.count));
      }
      opt->set_piece_grads(shards);
    } else {
      for (size_t i = 0; i < whole.size(); ++i) sync.parameters()[i]->grad.copy_from(whole[i]);
    }
    opt->step(lr, 0.75f);
    sync.gather_params();
    opt->set_piece_grads({});
  }
  parallel::GradientSync sync;
  std::unique_ptr<optim::AdamW> opt;
};

/// The one-process reference: a whole AdamW over unsharded parameters.
struct Reference {
  explicit Reference(uint64_t seed) : params(make_params(seed)), opt(pointers(params), {}) {}
  void step(int step, float lr) {
    for (Parameter& p : params) p.grad.copy_from(gradient(p, step));
    opt.step(lr, 0.75f);
  }
  std::vector<Parameter> params;
  optim::AdamW opt;
};

/// Every rank's parameters against the reference: the bf16 copies, the f32 values of the
/// unsharded ones, and the gathered masters (train::optimizer_state, the checkpoint's) of the
/// sharded ones; the checkpoint's tensors on rank 0 are the reference's.
void expect_equal(std::vector<Parameter>& ps, const Sharded& s, const Reference& ref,
                  const parallel::Layout& layout, int step) {
  const train::TensorMap state = train::optimizer_state(*s.opt, s.sync);
  const train::TensorMap ckpt = train::checkpoint_tensors(pointers(ps), state, {}, layout);
  std::map<std::string, Tensor> ref_state;
  ref.opt.export_state(ref_state);
  ASSERT_TRUE(state.count(optim::AdamW::kStepKey));
  EXPECT_TRUE(same_bits(state.at(optim::AdamW::kStepKey), ref_state.at(optim::AdamW::kStepKey)));
  for (size_t i = 0; i < ps.size(); ++i) {
    const Parameter &p = ps[i], &r = ref.params[i];
    SCOPED_TRACE(p.name + " after step " + std::to_string(step));
    EXPECT_EQ(p.master_sharded, kSpecs[i].copy && !kSpecs[i].reads_f32);
    if (p.compute_copy.defined()) {
      EXPECT_TRUE(same_bits(p.compute_copy, r.compute_copy));
    }
    if (p.master_sharded) {
      EXPECT_EQ(p.value.dtype(), DType::bf16);  // the f32 value is gone: value is the copy
      ASSERT_TRUE(state.count(p.name));
      EXPECT_TRUE(same_bits(state.at(p.name), r.value));
    } else {
      EXPECT_TRUE(same_bits(p.value, r.value));
    }
    for (const char* m : {".adam_m", ".adam_v"})
      EXPECT_TRUE(same_bits(state.at(p.name + m), ref_state.at(p.name + m)));
    if (layout.world_rank == 0) {
      ASSERT_TRUE(ckpt.count(p.name));
      EXPECT_TRUE(same_bits(ckpt.at(p.name), r.value));  // the zero 0 checkpoint's bits
    }
  }
}

}  // namespace

TEST(ZeroMasterWeights, ShardedMastersUpdateAndCheckpointLikeOneProcess) {
  const parallel::Layout layout = parallel::Layout::create(comm::world(), 1);
  for (int zero : {1, 2}) {
    SCOPED_TRACE("parallel.zero " + std::to_string(zero));
    Reference ref(7);
    std::vector<Parameter> ps = make_params(7);
    Sharded s(pointers(ps), layout, zero);
    int64_t whole = 0, sharded_elements = 0;
    for (const Parameter& p : ps) {
      whole += 4 * p.value.numel();
      if (p.master_sharded) sharded_elements += p.value.numel();
    }
    // This rank holds the masters of its pieces only: together the ranks hold each once.
    Tensor held = Tensor::from_vector<double>({static_cast<double>(s.opt->master_bytes())}, {1});
    layout.world->all_reduce(held);
    EXPECT_EQ(held.item(), 4.0 * static_cast<double>(sharded_elements));
    EXPECT_LT(s.opt->master_bytes(), whole);
    for (int step = 1; step <= 4; ++step) {
      ref.step(step, 0.01f * static_cast<float>(step));
      s.step(step, 0.01f * static_cast<float>(step));
      expect_equal(ps, s, ref, layout, step);
    }

    // Load the whole-format checkpoint (the one-process state) into fresh sharded parameters
    // of other initial weights: each rank takes its master pieces, the bf16 copies are cast
    // from the whole tensors; two more steps follow the reference.
    train::TensorMap ckpt;
    ref.opt.export_state(ckpt);
    for (const Parameter& p : ref.params) ckpt[p.name] = p.value;
    std::vector<Parameter> loaded = make_params(99);
    Sharded t(pointers(loaded), layout, zero);
    train::restore_checkpoint_tensors(ckpt, pointers(loaded), *t.opt, {}, "ckpt");
    // (the trainer's refresh_compute_weights: the copies of the unsharded parameters)
    for (Parameter& p : loaded)
      if (!p.master_sharded && p.compute_copy.defined())
        p.compute_copy = ops::cast(p.value, DType::bf16);
    expect_equal(loaded, t, ref, layout, 4);
    for (int step = 5; step <= 6; ++step) {
      ref.step(step, 0.02f);
      t.step(step, 0.02f);
      expect_equal(loaded, t, ref, layout, step);
    }
  }
}

TEST(ZeroMasterWeights, AllGatherMovesHalfTheBytesOfTheF32One) {
  // Only matrices with bf16 copies: sharded masters gather 2 bytes per element; the same
  // parameters read in f32 (reads_f32: masters whole) gather 4.
  const parallel::Layout layout = parallel::Layout::create(comm::world(), 1);
  int64_t bytes[2] = {0, 0};
  for (const bool reads_f32 : {false, true}) {
    std::vector<Parameter> ps;
    for (const char* name : {"a", "b", "c"}) {
      ps.push_back(Parameter::make(name, {8, 16}));
      ps.back().init_normal(3, 0.5f);
      ps.back().compute_copy = ops::cast(ps.back().value, DType::bf16);
      ps.back().reads_f32 = reads_f32;
    }
    Sharded s(pointers(ps), layout, 1);
    layout.world->counters().reset();
    s.step(1, 0.01f);
    bytes[reads_f32] =
        layout.world->counters().of(comm::ByteCounters::all_gather, comm::LinkClass::intra_node);
  }
  if (layout.world_size == 1) GTEST_SKIP() << "one rank gathers nothing";
  EXPECT_GT(bytes[1], 0);
  EXPECT_EQ(2 * bytes[0], bytes[1]);
}

TEST(ZeroMasterWeights, ShardedParametersRefuseTheirF32Weights) {
  std::vector<Parameter> ps = make_params(1);
  Parameter& wq = ps[0];
  wq.shard_master_weights();
  EXPECT_TRUE(wq.master_sharded);
  EXPECT_TRUE(same_bits(wq.compute(), wq.value));
  EXPECT_THROW(wq.weights_f32(), Error);
  EXPECT_THROW(wq.to(Device::cpu()), Error);
  EXPECT_THROW(ps[1].shard_master_weights(), Error);  // the norm has no bf16 copy
  EXPECT_THROW(ps[4].shard_master_weights(), Error);  // the router reads f32
}
