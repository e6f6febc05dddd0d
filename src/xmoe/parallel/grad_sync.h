#pragma once
// Gradient synchronisation (parallel/layout.h). The objective is the mean over ranks of each
// rank's loss (every rank's loss is a mean over its own tokens, and every rank has as many), and
// every parameter follows one rule: grad = (1/world) Σ over the ranks of its replica group:
//   dense:             the world
//   expert:            the dp group (each replica already holds the contributions of its whole
//                      ep group's tokens, which dispatch routed to it)
//   tensor_shard,
//   tensor_replicated: the tp-replica group (each rank's gradient already holds its whole tp
//                      group's contributions, through the tp collectives or the replicated
//                      MoE layer)
// Gradients are packed into buckets of about `bucket_bytes` so that few, large all-reduces run.
// CUDA gradients are packed on the device (multi-tensor copies) and all-reduced there when the
// group lives on that device (NCCL), else staged through the host (MPI).
//
// parallel.zero (docs/training.md, "Memory at scale"): each bucket (of one kind) is split over
// its replica group by a BucketShards plan, and this
// rank's optimizer updates only its shard (owned_pieces()); gather_params() then all-gathers the
// updated parameters. With zero 2 the buckets are reduce-scattered instead of all-reduced: this
// rank keeps only its shard of the averaged gradient (a flat f32 buffer per bucket), which the
// pieces' grad views read.
#include <cstdint>
#include <span>
#include <vector>

#include "xmoe/core/parameter.h"
#include "xmoe/parallel/layout.h"
#include "xmoe/parallel/zero.h"

namespace xmoe::parallel {

/// A run of a parameter's elements that this rank's optimizer updates.
struct OwnedPiece {
  Parameter* param = nullptr;
  int64_t offset = 0;  ///< first element (flat)
  int64_t count = 0;   ///< elements
  /// zero 2: [count] view of the bucket's gradient shard; else undefined (param->grad's range)
  Tensor grad;
};

class GradientSync {
 public:
  /// `zero`: parallel.zero (0, 1 or 2).
  GradientSync(std::vector<Parameter*> params, const Layout& layout,
               int64_t bucket_bytes = 32 << 20, int zero = 0);

  /// Averages every gradient as described above (a no-op for one process without zero 2);
  /// zero 2: reduce-scatters into this rank's gradient shards instead and frees every
  /// param->grad (Parameter::release_grad) until the next zero_grad().
  void sync();
  /// Gradient bytes this rank holds now: the per-parameter gradients still allocated and, with
  /// zero 2, the shards.
  int64_t gradient_bytes() const;
  /// Global gradient norm² after sync: every element of the whole model counted once (dense
  /// once, each expert and tensor-parallel shard once; zero 2: the world's sum of every rank's
  /// gradient shards, the copies replicated over the tp group divided by tp).
  double global_grad_sum_squares() const;

  int zero() const { return zero_; }
  /// What this rank's optimizer updates, bucket by bucket: zero 0 every parameter whole
  /// (offset 0, count numel, in the order given), else this rank's shard of each bucket.
  std::vector<OwnedPiece> owned_pieces() const;
  /// zero >= 1, after the optimizer updated the owned pieces: all-gathers every bucket's
  /// parameters (and rewrites their bf16 compute copies). A no-op for zero 0. Collective.
  void gather_params();
  /// zero >= 1: every parameter's whole tensor (its shape, f32, on its device) assembled from
  /// every rank's `pieces` (one flat [count] tensor per owned piece, in owned_pieces() order),
  /// e.g. the AdamW moments for a checkpoint. Result i belongs to parameters()[i]. Collective.
  std::vector<Tensor> gather_pieces(std::span<const Tensor> pieces) const;
  /// The parameters, in the order given.
  const std::vector<Parameter*>& parameters() const { return params_; }

  /// How parameters of `numels` elements and `kinds` fill buckets of about `bucket_bytes`:
  /// one kind after another (dense, expert, tensor_shard, tensor_replicated), each in order, a
  /// bucket closed before a parameter that would take it past the size. Each bucket lists its
  /// parameters' indices. (The memory model plans the same buckets without a model.)
  static std::vector<std::vector<size_t>> bucket_plan(std::span<const int64_t> numels,
                                                      std::span<const ParamKind> kinds,
                                                      int64_t bucket_bytes);

 private:
  struct Bucket {
    std::vector<Parameter*> params;
    int64_t numel = 0;
    ParamKind kind = ParamKind::dense;
    BucketShards shards;  ///< zero >= 1
    Tensor grad_shard;    ///< zero 2: f32 [shards.shard], this rank's averaged gradient
  };
  comm::Group& group_of(const Bucket& b) const;
  /// Whether the tp ranks of a group hold the same copy of a kind's parameters.
  bool replicated_over_tp(ParamKind kind) const;
  void reduce(Bucket& b);
  /// The bucket's elements [padded] gathered from every rank's `shard` [shard].
  Tensor all_gather(const Bucket& b, const Tensor& shard) const;

  std::vector<Parameter*> params_;
  const Layout& layout_;
  int zero_ = 0;
  std::vector<Bucket> buckets_;
};

}  // namespace xmoe::parallel
