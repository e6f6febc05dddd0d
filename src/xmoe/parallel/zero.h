#pragma once
// The ZeRO shard plan of one gradient bucket (parallel.zero, docs/training.md). A bucket packs
// its parameters' elements in order into one flat buffer of `numel` elements; over a group of N
// ranks it is padded to a multiple of N and rank r owns the elements [r·s, (r+1)·s), s =
// padded / N. A parameter may straddle two (or more) shards, and a shard may hold no parameter
// element at all (numel < N: the tail shards are all padding).
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace xmoe::parallel {

/// One run of a parameter's elements inside this rank's shard.
struct ShardPiece {
  size_t param = 0;          ///< index of the parameter in the bucket
  int64_t offset = 0;        ///< first element in the parameter (flat, row-major)
  int64_t count = 0;         ///< elements (> 0)
  int64_t shard_offset = 0;  ///< first element in this rank's shard
};

/// How one bucket splits over a group; `pieces` are this rank's, in bucket order.
struct BucketShards {
  int64_t numel = 0;   ///< the bucket's elements (Σ of its parameters' numel)
  int64_t padded = 0;  ///< numel rounded up to a multiple of the group size (at least one each)
  int64_t shard = 0;   ///< padded / group size: every rank's shard has this many elements
  int64_t begin = 0;   ///< this rank's first element in the packed bucket (rank · shard)
  std::vector<ShardPiece> pieces;

  /// The plan of a bucket whose parameters have `numels` elements, for `rank` of `size` ranks.
  static BucketShards plan(std::span<const int64_t> numels, int size, int rank);
};

/// One rank's run of a bucket's parameter in the post-update all-gather's lanes.
struct LanePiece {
  int rank = 0;
  size_t param = 0;     ///< index of the parameter in the bucket
  int64_t offset = 0;   ///< first element in the parameter (flat)
  int64_t count = 0;    ///< elements (> 0)
  bool bf16 = false;    ///< the bf16 lane (a master-sharded parameter's copy), else the f32 one
  int64_t lane_at = 0;  ///< first element in its rank's lane
};

/// How every rank's shard of a bucket travels in the all-gather after the update: the elements
/// of parameters whose masters are sharded as bf16 (their compute copies), the others as f32,
/// each rank's in two lanes padded to the longest rank's, so that both gathers are even.
struct GatherLanes {
  std::vector<LanePiece> pieces;  ///< every rank's, rank by rank, in bucket order
  int64_t bf16 = 0, f32 = 0;      ///< the lanes' lengths (elements per rank)

  /// The lanes of a bucket whose parameters have `numels` elements over `size` ranks;
  /// `bf16[i]`: parameter i travels as bf16.
  static GatherLanes plan(std::span<const int64_t> numels, std::span<const char> bf16, int size);
  /// plan()'s lane lengths {bf16, f32} alone, in one pass over the parameters and the ranks
  /// (the memory model asks it for every bucket of layouts of thousands of ranks).
  static std::pair<int64_t, int64_t> lengths(std::span<const int64_t> numels,
                                             std::span<const char> bf16, int size);
};

}  // namespace xmoe::parallel
