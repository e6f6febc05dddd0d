#include "xmoe/train/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>

#include "xmoe/comm/group.h"

namespace xmoe::train {

namespace {
std::string format_duration(double s) {
  const int t = static_cast<int>(s + 0.5);
  return t >= 3600 ? fmt::format("{}h{:02}m", t / 3600, t / 60 % 60)
                   : fmt::format("{}m{:02}s", t / 60, t % 60);
}
}  // namespace

// Under mpirun the rank's stdout is a pseudo-terminal even when mpirun's own output goes to a
// file, so only a process that no launcher started redraws its line.
Progress::Progress(bool enabled, int first_step, int last_step)
    : enabled_(enabled),
      tty_(isatty(fileno(stdout)) != 0 && !comm::launched_by_mpi()),
      first_step_(first_step),
      last_step_(last_step) {}

void Progress::on_step(const StepMetrics& m, bool print) {
  if (!m.skipped) {
    smoothed_loss_ = smoothed_loss_ < 0 ? m.loss : 0.9 * smoothed_loss_ + 0.1 * m.loss;
    smoothed_tps_ = smoothed_tps_ < 0 ? m.tokens_per_s : 0.9 * smoothed_tps_ + 0.1 * m.tokens_per_s;
  }
  if (!enabled_ || (!print && !tty_)) return;
  const int done = m.step - first_step_;
  const double eta = done > 0 ? timer_.seconds() / done * (last_step_ - m.step) : 0;
  // An expert that got no token has no ratio: say so rather than print 0.00x.
  const std::string balance =
      m.min_expert_load > 0
          ? fmt::format("{:.2f}x", static_cast<double>(m.max_expert_load) / m.min_expert_load)
          : std::string("an expert idle");
  // No finite step yet (all skipped): no rate to show.
  const std::string rate = smoothed_tps_ < 0 ? std::string("      - tok/s")
                                             : fmt::format("{:>7.0f} tok/s", smoothed_tps_);
  const std::string line = fmt::format(
      "step {:>5}/{} | loss {:.4f} | aux {:.4f} | lr {:.2e} | gnorm {:.3f} | {}{} | "
      "load max/min {}/{} ({}) | ETA {}{}",
      m.step, last_step_, m.loss, m.aux_loss, m.lr, m.grad_norm, rate,
      // MFU at the smoothed rate, like tok/s
      m.mfu > 0 && m.tokens_per_s > 0 && smoothed_tps_ > 0
          ? fmt::format(" | MFU {:.1f}%", 100.0 * m.mfu * smoothed_tps_ / m.tokens_per_s)
          : std::string(),
      m.max_expert_load, m.min_expert_load, balance, format_duration(eta),
      m.skipped ? " | SKIPPED" : "");
  if (tty_) {
    std::printf("\r\033[K%s%s", line.c_str(), print ? "\n" : "");
  } else {
    std::printf("%s\n", line.c_str());
  }
  std::fflush(stdout);
}

void Progress::on_eval(int step, double val_loss) {
  if (!enabled_) return;
  std::printf("%sstep %5d | validation loss %.4f nats/token\n", tty_ ? "\r\033[K" : "", step,
              val_loss);
  std::fflush(stdout);
}

void Progress::finish(double seconds) {
  if (!enabled_) return;
  std::printf("%sdone in %s\n", tty_ ? "\r\033[K" : "", format_duration(seconds).c_str());
  std::fflush(stdout);
}

}  // namespace xmoe::train
