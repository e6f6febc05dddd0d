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
// rank keeps only its shard of the averaged gradient (a flat f32 buffer per bucket, from the
// sync to the update), which the pieces' grad views read.
//
// A bucket's collective may start during backward (grads_ready(), parallel.overlap_grad_sync), as
// soon as backward has finished all its gradients: zero 0 and 1 start its all-reduce (several
// may be in flight; sync() waits for them in order and unpacks), zero 2 its reduce-scatter (its
// gradients packed and freed at once, one bucket in flight). A bucket's operations are the same
// either way, and so are the bits. The dense buckets may be given (sched/grad_partition.h:
// pieces sized to hide in backward) instead of filled to bucket_bytes.
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
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
  /// zero 2: the gradient is a [count] view of the bucket's shard, which exists only from
  /// sync() to release_shards() (shard_grads()); else param->grad's range
  bool shard_grad = false;
  /// The optimizer holds the range's f32 master weights (GradientSync::shards_master): the
  /// parameter keeps only its bf16 copy (Parameter::shard_master_weights)
  bool master = false;
};

class GradientSync {
 public:
  /// `zero`: parallel.zero (0, 1 or 2). `dense_buckets`: the dense parameters' buckets, each
  /// dense parameter in exactly one (empty: filled to bucket_bytes like the other kinds).
  GradientSync(std::vector<Parameter*> params, const Layout& layout,
               int64_t bucket_bytes = 32 << 20, int zero = 0,
               const std::vector<std::vector<Parameter*>>& dense_buckets = {});

  /// Averages every gradient as described above (a no-op for one process without zero 2);
  /// zero 2: reduce-scatters into this rank's gradient shards instead and frees every
  /// param->grad (Parameter::release_grad) until the next zero_grad().
  void sync();
  /// Backward has finished these parameters' gradients for this step (model::
  /// Transformer::set_grads_ready, on the last micro-batch): every bucket whose parameters are
  /// all finished now is packed and its collective started (non-blocking: MPI's, or NCCL's on
  /// its stream). zero 0, 1: its all-reduce, beside those in flight; zero 2: its whole
  /// gradients freed and its reduce-scatter started after the one in flight, if any, is waited
  /// for and unpacked. sync() then does the buckets left and waits for all. Collective, in the
  /// same order on every rank (backward's). A no-op for one process below zero 2.
  void grads_ready(const std::vector<Parameter*>& params);
  /// zero 2, after sync(): the averaged gradient of each owned piece, a [count] f32 view of its
  /// bucket's shard, in owned_pieces() order (for AdamW::set_piece_grads).
  std::vector<Tensor> shard_grads() const;
  /// zero 2, after the update: frees the gradient shards (the optimizer must hold no view of
  /// them), so that between steps this rank holds no gradient at all. A no-op below zero 2.
  void release_shards();
  /// Gradient bytes this rank holds now: the per-parameter gradients still allocated and, with
  /// zero 2, the shards.
  int64_t gradient_bytes() const;
  /// The buckets' parameters, in the order sync() first considers them (for logs and tests).
  std::vector<std::vector<Parameter*>> buckets() const;
  /// Global gradient norm² after sync: every element of the whole model counted once (dense
  /// once, each expert and tensor-parallel shard once; zero 2: the world's sum of every rank's
  /// gradient shards, the copies replicated over the tp group divided by tp).
  double global_grad_sum_squares() const;

  int zero() const { return zero_; }
  /// Whether sync() leaves the gradients as backward made them (one process, zero < 2): they
  /// are final as soon as their module's backward is done.
  bool grads_final_after_backward() const { return layout_.world_size == 1 && zero_ < 2; }
  /// What this rank's optimizer updates, bucket by bucket: zero 0 every parameter whole
  /// (offset 0, count numel, in the order given), else this rank's shard of each bucket.
  std::vector<OwnedPiece> owned_pieces() const;
  /// Whether the f32 master weights of `p` are sharded at parallel.zero = `zero`: zero >= 1 and
  /// a bf16 compute copy that its module reads instead of the f32 weights (!reads_f32). Such a
  /// parameter's optimizer pieces hold its master, and gather_params() moves its bf16 copy.
  static bool shards_master(const Parameter& p, int zero);
  /// zero >= 1, after the optimizer updated the owned pieces: all-gathers every bucket's
  /// parameters: the bf16 compute copies of those whose masters are sharded (2 bytes per
  /// element), the f32 values of the others (and their bf16 copies rewritten from them). Each
  /// rank's shard of a bucket travels as two lanes, bf16 and f32, each padded to the longest
  /// rank's. A no-op for zero 0. Collective.
  void gather_params();
  /// zero >= 1: every parameter's whole tensor (its shape, f32, on its device) assembled from
  /// every rank's `pieces` (one flat [count] f32 or bf16 tensor per owned piece, bf16 widened,
  /// in owned_pieces() order),
  /// e.g. the AdamW moments or master weights for a checkpoint, on the pieces' device. Result i
  /// belongs to parameters()[i]. Collective.
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
    GatherLanes lanes;    ///< zero >= 1: how gather_params() moves every rank's shard
    /// zero 2, from its reduce-scatter to release_shards(): f32 [shards.shard], this rank's
    /// averaged gradient
    Tensor grad_shard;
    // While its collective runs: the packed gradients (zero 2: [padded]; else [numel]), zero 2:
    // this rank's sum [shard] (on the group's device), else the host copy the MPI all-reduce
    // sums when the gradients are on a GPU; the collective; `started`: this step.
    Tensor packed, summed;
    Device device;  ///< the gradients
    std::unique_ptr<comm::Work> work;
    bool started = false;
    size_t ready = 0;  ///< parameters whose gradients backward finished this step
  };
  comm::Group& group_of(const Bucket& b) const;
  /// Whether the tp ranks of a group hold the same copy of a kind's parameters.
  bool replicated_over_tp(ParamKind kind) const;
  /// zero 0, 1: packs the bucket and starts its all-reduce (beside those in flight).
  void start_all_reduce(size_t bucket);
  /// zero 0, 1: waits for every all-reduce in flight, in order, and unpacks each averaged.
  void finish_all_reduce();
  /// zero 2: packs the bucket's gradients, frees them and starts the reduce-scatter, after
  /// finishing the one in flight.
  void start_reduce_scatter(size_t bucket);
  /// zero 2: waits for the bucket in flight, if any, and scales its sum into its grad_shard.
  void finish_reduce_scatter();
  /// The bucket's elements [padded] gathered from every rank's `shard` [shard].
  Tensor all_gather(const Bucket& b, const Tensor& shard) const;

  std::vector<Parameter*> params_;
  const Layout& layout_;
  int zero_ = 0;
  std::vector<Bucket> buckets_;
  std::unordered_map<const Parameter*, size_t> bucket_of_;
  static constexpr size_t kNone = static_cast<size_t>(-1);
  size_t in_flight_ = kNone;          ///< zero 2: the bucket whose reduce-scatter runs
  std::vector<size_t> all_reducing_;  ///< zero 0, 1: the buckets in flight, in start order
};

}  // namespace xmoe::parallel
