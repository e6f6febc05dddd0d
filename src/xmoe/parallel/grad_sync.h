#pragma once
// Gradient synchronisation for world = dp × ep. The objective is the mean over ranks of each
// rank's loss (every rank's loss is a mean over its own tokens, and every rank has as many), so:
//   dense parameters:  grad = (1/world) Σ_ranks grad_r        (all-reduce over the world)
//   expert parameters: grad = (1/world) Σ_dp-replicas grad_r  (all-reduce over the dp group;
//                      each replica already holds the contributions of its whole ep group's
//                      tokens, which dispatch routed to it)
// Gradients are packed into buckets of about `bucket_bytes` so that few, large all-reduces run.
// CUDA gradients are packed on the device (multi-tensor copies) and all-reduced there when the
// group lives on that device (NCCL), else staged through the host (MPI).
#include <cstdint>
#include <vector>

#include "xmoe/core/parameter.h"
#include "xmoe/parallel/layout.h"

namespace xmoe::parallel {

class GradientSync {
 public:
  GradientSync(std::vector<Parameter*> params, const Layout& layout,
               int64_t bucket_bytes = 32 << 20);

  /// Averages every gradient as described above (a no-op for one process).
  void sync();
  /// Global gradient norm² after sync: dense counted once, each expert shard once.
  double global_grad_sum_squares() const;

 private:
  struct Bucket {
    std::vector<Parameter*> params;
    int64_t numel = 0;
    bool expert = false;
  };
  void reduce(Bucket& b);

  std::vector<Parameter*> params_;
  const Layout& layout_;
  std::vector<Bucket> buckets_;
};

}  // namespace xmoe::parallel
