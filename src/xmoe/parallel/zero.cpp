#include "xmoe/parallel/zero.h"

#include <algorithm>

#include "xmoe/core/error.h"

namespace xmoe::parallel {

BucketShards BucketShards::plan(std::span<const int64_t> numels, int size, int rank) {
  XMOE_CHECK(size >= 1 && rank >= 0 && rank < size, "[zero] rank {} of a group of {} ranks", rank,
             size);
  BucketShards b;
  for (int64_t n : numels) {
    XMOE_CHECK(n >= 0, "[zero] a parameter of {} elements", n);
    b.numel += n;
  }
  // At least one element per rank, so that every shard (and every collective) is non-empty.
  b.shard = std::max<int64_t>(1, (b.numel + size - 1) / size);
  b.padded = b.shard * size;
  b.begin = b.shard * rank;
  const int64_t end = b.begin + b.shard;
  int64_t start = 0;  // of parameter i in the packed bucket
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t lo = std::max(start, b.begin), hi = std::min(start + numels[i], end);
    if (lo < hi) b.pieces.push_back({i, lo - start, hi - lo, lo - b.begin});
    start += numels[i];
  }
  return b;
}

GatherLanes GatherLanes::plan(std::span<const int64_t> numels, std::span<const char> bf16,
                              int size) {
  XMOE_CHECK(bf16.size() == numels.size(), "[zero] {} lane flags for {} parameters", bf16.size(),
             numels.size());
  GatherLanes g;
  for (int r = 0; r < size; ++r) {
    int64_t at_bf16 = 0, at_f32 = 0;
    for (const ShardPiece& s : BucketShards::plan(numels, size, r).pieces) {
      const bool half = bf16[s.param] != 0;
      int64_t& at = half ? at_bf16 : at_f32;
      g.pieces.push_back({r, s.param, s.offset, s.count, half, at});
      at += s.count;
    }
    g.bf16 = std::max(g.bf16, at_bf16);
    g.f32 = std::max(g.f32, at_f32);
  }
  return g;
}

std::pair<int64_t, int64_t> GatherLanes::lengths(std::span<const int64_t> numels,
                                                 std::span<const char> bf16, int size) {
  XMOE_CHECK(bf16.size() == numels.size(), "[zero] {} lane flags for {} parameters", bf16.size(),
             numels.size());
  const BucketShards b = BucketShards::plan(numels, size, 0);
  // bf16 elements of the bucket before position x (x never decreases: one pass).
  size_t i = 0;
  int64_t start = 0, before = 0;
  auto bf16_before = [&](int64_t x) {
    for (; i < numels.size() && start + numels[i] <= x; start += numels[i++])
      if (bf16[i]) before += numels[i];
    return before + (i < numels.size() && bf16[i] ? std::max<int64_t>(0, x - start) : 0);
  };
  int64_t max_bf16 = 0, max_f32 = 0, prev = 0;
  for (int r = 0; r < size; ++r) {
    const int64_t begin = std::min(r * b.shard, b.numel),
                  end = std::min((r + 1) * b.shard, b.numel);
    const int64_t now = bf16_before(end);
    max_bf16 = std::max(max_bf16, now - prev);
    max_f32 = std::max(max_f32, end - begin - (now - prev));
    prev = now;
  }
  return {max_bf16, max_f32};
}

}  // namespace xmoe::parallel
