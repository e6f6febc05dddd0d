#pragma once
// Learning-rate schedule: linear warmup, then cosine decay to min_lr.
#include <cstdint>

#include "xmoe/config/config.h"

namespace xmoe::optim {

struct LrSchedule {
  float peak_lr = 3e-3f;  ///< reached at the end of the warmup
  float min_lr = 3e-4f;   ///< reached at total_steps and kept after
  int64_t warmup_steps = 50;
  int64_t total_steps = 600;
  /// train.lr, train.min_lr, train.warmup_steps, train.steps.
  static LrSchedule from(const TrainConfig& t);

  /// Learning rate of update `step`, 0-based (the first update is step 0). With n = step + 1
  /// the number of updates made once this one is done:
  ///   n <= warmup:  peak_lr * n / warmup          (peak_lr / warmup at step 0)
  ///   else:         min_lr + (peak_lr - min_lr) * (1 + cos(pi * p)) / 2,
  ///                 p = min(1, (n - warmup) / max(1, total - warmup))
  /// so step warmup - 1 is at the peak and the last step (total - 1) at min_lr, kept after.
  float at(int64_t step) const;
};

}  // namespace xmoe::optim
