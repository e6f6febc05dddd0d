#include "xmoe/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace xmoe::optim {

LrSchedule LrSchedule::from(const TrainConfig& t) {
  return {t.lr, t.min_lr, t.warmup_steps, t.steps};
}

float LrSchedule::at(int64_t step) const {
  const int64_t n = std::max<int64_t>(step, 0) + 1;
  if (n <= warmup_steps) return peak_lr * static_cast<float>(n) / static_cast<float>(warmup_steps);
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  const double p = std::min(1.0, static_cast<double>(n - warmup_steps) / span);
  const double c = 0.5 * (1.0 + std::cos(std::numbers::pi * p));
  return static_cast<float>(min_lr + (static_cast<double>(peak_lr) - min_lr) * c);
}

}  // namespace xmoe::optim
