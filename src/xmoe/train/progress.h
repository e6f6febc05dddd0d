#pragma once
// The live progress line: step, loss, lr, grad norm, tokens/s, ETA and expert-load balance.
// On a terminal it redraws one line; otherwise (logs, CI) it prints every log_every steps.
#include "xmoe/core/timer.h"
#include "xmoe/train/trainer.h"

namespace xmoe::train {

class Progress {
 public:
  Progress(bool enabled, int first_step, int last_step);
  /// `print` marks a log step (every train.log_every); a terminal also redraws on other steps.
  void on_step(const StepMetrics& m, bool print);
  void on_eval(int step, double val_loss);
  void finish(double seconds);

 private:
  bool enabled_, tty_;
  int first_step_, last_step_;
  double smoothed_loss_ = -1, smoothed_tps_ = -1;
  Timer timer_;
};

}  // namespace xmoe::train
