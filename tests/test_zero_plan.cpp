// The ZeRO shard plan of a gradient bucket (parallel/zero.h) and AdamW on pieces of parameters
// (optim/adamw.h): a parameter split into pieces over "ranks" gets the bits it gets whole.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>

#include "testing.h"
#include "xmoe/config/config.h"
#include "xmoe/optim/adamw.h"
#include "xmoe/parallel/zero.h"
#include "xmoe/train/trainer.h"

using namespace xmoe;
using parallel::BucketShards;

namespace {

/// Every rank's pieces, checked to tile the bucket's elements exactly once, in order.
void expect_tiles(const std::vector<int64_t>& numels, int size) {
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  std::vector<int> seen(static_cast<size_t>(total), 0);
  for (int r = 0; r < size; ++r) {
    const BucketShards b = BucketShards::plan(numels, size, r);
    EXPECT_EQ(b.padded % size, 0);
    EXPECT_EQ(b.shard * size, b.padded);
    EXPECT_GE(b.padded, total);
    EXPECT_LT(b.padded - total, size) << "padding is less than one element per rank";
    EXPECT_EQ(b.begin, r * b.shard);
    int64_t shard_pos = -1;
    for (const auto& p : b.pieces) {
      EXPECT_GT(p.count, 0);
      EXPECT_GT(p.shard_offset, shard_pos) << "pieces in bucket order";
      shard_pos = p.shard_offset;
      int64_t start = 0;
      for (size_t i = 0; i < p.param; ++i) start += numels[i];
      EXPECT_EQ(start + p.offset, b.begin + p.shard_offset) << "rank " << r;
      EXPECT_LE(p.offset + p.count, numels[p.param]);
      for (int64_t e = 0; e < p.count; ++e) ++seen[static_cast<size_t>(start + p.offset + e)];
    }
  }
  for (size_t e = 0; e < seen.size(); ++e) EXPECT_EQ(seen[e], 1) << "element " << e;
}

}  // namespace

TEST(ZeroPlan, RangesAndPadding) {
  // 10 elements over 4 ranks: padded to 12, shards of 3; rank 3 holds [9, 12): one element.
  const std::vector<int64_t> numels = {6, 4};
  const BucketShards r1 = BucketShards::plan(numels, 4, 1);
  EXPECT_EQ(r1.numel, 10);
  EXPECT_EQ(r1.padded, 12);
  EXPECT_EQ(r1.shard, 3);
  EXPECT_EQ(r1.begin, 3);
  ASSERT_EQ(r1.pieces.size(), 1u);  // [3, 6) is the end of parameter 0
  EXPECT_EQ(r1.pieces[0].param, 0u);
  EXPECT_EQ(r1.pieces[0].offset, 3);
  EXPECT_EQ(r1.pieces[0].count, 3);
  const BucketShards r3 = BucketShards::plan(numels, 4, 3);
  ASSERT_EQ(r3.pieces.size(), 1u);
  EXPECT_EQ(r3.pieces[0].param, 1u);
  EXPECT_EQ(r3.pieces[0].offset, 3);
  EXPECT_EQ(r3.pieces[0].count, 1);  // the other two elements are padding
  for (int size : {1, 2, 3, 4, 7}) expect_tiles({6, 4, 1, 9}, size);
}

TEST(ZeroPlan, ParameterStraddlesTwoShards) {
  // 5 + 5 over 2 ranks: shards [0, 5) and [5, 10) align; 4 + 6 does not: parameter 1 straddles.
  const BucketShards r0 = BucketShards::plan(std::vector<int64_t>{4, 6}, 2, 0);
  const BucketShards r1 = BucketShards::plan(std::vector<int64_t>{4, 6}, 2, 1);
  ASSERT_EQ(r0.pieces.size(), 2u);
  EXPECT_EQ(r0.pieces[1].param, 1u);
  EXPECT_EQ(r0.pieces[1].offset, 0);
  EXPECT_EQ(r0.pieces[1].count, 1);
  EXPECT_EQ(r0.pieces[1].shard_offset, 4);
  ASSERT_EQ(r1.pieces.size(), 1u);
  EXPECT_EQ(r1.pieces[0].param, 1u);
  EXPECT_EQ(r1.pieces[0].offset, 1);
  EXPECT_EQ(r1.pieces[0].count, 5);
  EXPECT_EQ(r1.pieces[0].shard_offset, 0);
}

TEST(ZeroPlan, EmptyShardsWhenFewerElementsThanRanks) {
  // 3 elements over 5 ranks: shards of 1, ranks 3 and 4 hold only padding.
  for (int r = 0; r < 5; ++r) {
    const BucketShards b = BucketShards::plan(std::vector<int64_t>{2, 1}, 5, r);
    EXPECT_EQ(b.shard, 1);
    EXPECT_EQ(b.padded, 5);
    EXPECT_EQ(b.pieces.size(), r < 3 ? 1u : 0u) << "rank " << r;
  }
  expect_tiles({2, 1}, 5);
  EXPECT_THROW(BucketShards::plan(std::vector<int64_t>{2}, 2, 2), Error);
}

TEST(ZeroPlan, GatherLanesSplitEachShardByWeightKind) {
  // bf16 (master-sharded) and f32 parameters mixed, over 1 to 9 ranks: each rank's lanes hold
  // exactly its shard's elements of each kind, packed from 0; the lengths are the longest
  // rank's, and lengths() computes them without the pieces.
  const std::vector<int64_t> numels = {5, 3, 0, 7, 1, 4};
  const std::vector<char> bf16 = {1, 0, 1, 1, 0, 1};
  for (int size = 1; size <= 9; ++size) {
    SCOPED_TRACE("size " + std::to_string(size));
    const parallel::GatherLanes g = parallel::GatherLanes::plan(numels, bf16, size);
    int64_t longest[2] = {0, 0};
    for (int r = 0; r < size; ++r) {
      const BucketShards b = BucketShards::plan(numels, size, r);
      int64_t at[2] = {0, 0};
      size_t k = 0;
      for (const parallel::LanePiece& l : g.pieces) {
        if (l.rank != r) continue;
        ASSERT_LT(k, b.pieces.size());
        const parallel::ShardPiece& s = b.pieces[k++];
        EXPECT_EQ(l.param, s.param);
        EXPECT_EQ(l.offset, s.offset);
        EXPECT_EQ(l.count, s.count);
        EXPECT_EQ(l.bf16, bf16[s.param] != 0);
        EXPECT_EQ(l.lane_at, at[l.bf16]);
        at[l.bf16] += l.count;
      }
      EXPECT_EQ(k, b.pieces.size());
      for (int j = 0; j < 2; ++j) longest[j] = std::max(longest[j], at[j]);
    }
    EXPECT_EQ(g.f32, longest[0]);
    EXPECT_EQ(g.bf16, longest[1]);
    EXPECT_EQ(parallel::GatherLanes::lengths(numels, bf16, size), std::make_pair(g.bf16, g.f32));
  }
}

TEST(ZeroPlan, AdamWOnPiecesEqualsWholeBitwise) {
  // Two parameters packed as one bucket of 7 elements over 3 "ranks" (shards of 3): each
  // rank's AdamW updates its pieces; the assembled result equals one AdamW on the whole
  // parameters, bit for bit, over several steps, with a gradient scale.
  const std::vector<float> a0 = {0.3f, -0.7f, 1.1f, 0.2f}, b0 = {1.f, -0.5f, 2.f};
  auto make = [&](const std::string& name, const std::vector<float>& v, bool decay) {
    Parameter p = Parameter::make(name, {static_cast<int64_t>(v.size())}, ParamKind::dense, decay);
    p.value.copy_from(Tensor::from_vector<float>(v, p.value.shape()));
    return p;
  };
  auto grads = [](int s, Parameter& a, Parameter& b) {
    a.grad.copy_from(Tensor::from_vector<float>({0.1f * s, -0.2f, 0.05f * s * s, 0.3f / s}, {4}));
    b.grad.copy_from(Tensor::from_vector<float>({0.01f * s, 0.7f, -0.4f * s}, {3}));
  };
  Parameter wa = make("a", a0, true), wb = make("b", b0, false);
  optim::AdamW whole({&wa, &wb}, {});
  const int ranks = 3;
  std::vector<Parameter> pa, pb;
  pa.reserve(ranks);
  pb.reserve(ranks);
  std::vector<std::unique_ptr<optim::AdamW>> opts;
  int64_t bytes = 0;
  for (int r = 0; r < ranks; ++r) {
    pa.push_back(make("a", a0, true));
    pb.push_back(make("b", b0, false));
    const BucketShards plan = BucketShards::plan(std::vector<int64_t>{4, 3}, ranks, r);
    std::vector<optim::AdamWPiece> pieces;
    for (const auto& s : plan.pieces)
      pieces.emplace_back(s.param == 0 ? &pa.back() : &pb.back(), s.offset, s.count);
    opts.push_back(std::make_unique<optim::AdamW>(pieces, optim::AdamWConfig{}));
    EXPECT_TRUE(opts.back()->sharded());
    bytes += opts.back()->state_bytes();
  }
  EXPECT_EQ(bytes, whole.state_bytes()) << "the pieces hold each moment element once";
  for (int s = 1; s <= 4; ++s) {
    grads(s, wa, wb);
    whole.step(1e-2f, 0.75f);
    for (int r = 0; r < ranks; ++r) {
      grads(s, pa[r], pb[r]);
      opts[r]->step(1e-2f, 0.75f);
    }
    // "all-gather": element e of the bucket comes from the rank whose shard holds it.
    for (int r = 0; r < ranks; ++r) {
      for (int64_t e = 0; e < 7; ++e) {
        const int owner = static_cast<int>(e / 3);
        const float got =
            e < 4 ? pa[owner].value.data<float>()[e] : pb[owner].value.data<float>()[e - 4];
        const float want = e < 4 ? wa.value.data<float>()[e] : wb.value.data<float>()[e - 4];
        EXPECT_EQ(std::memcmp(&got, &want, sizeof(float)), 0) << "step " << s << " element " << e;
      }
    }
  }
  // Sharded moments do not export; importing whole moments gives each piece its range.
  std::map<std::string, Tensor> state;
  EXPECT_THROW(opts[0]->export_state(state), Error);
  whole.export_state(state);
  opts[1]->import_state(state);
  EXPECT_EQ(opts[1]->step_count(), 4);
  // rank 1 holds a[3] (piece 0) and b[0, 2) (piece 1)
  EXPECT_EQ(opts[1]->m(0).to_vector<float>()[0], whole.m(0).to_vector<float>()[3]);
  EXPECT_EQ(opts[1]->v(1).to_vector<float>()[1], whole.v(1).to_vector<float>()[1]);
}

TEST(ZeroPlan, RefusalsNameTheKeys) {
  Config c = preset("tiny");
  c.parallel.zero = 3;
  EXPECT_CONTAINS(xmoe::testing::error_of([&] { validate(c); }), "parallel.zero");
  c.parallel.zero = 1;
  c.parallel.expert_placement = "affinity";
  const std::string e = xmoe::testing::error_of([&] { validate(c); });
  EXPECT_CONTAINS(e, "parallel.zero = 1");
  EXPECT_CONTAINS(e, "parallel.expert_placement = affinity");
}
