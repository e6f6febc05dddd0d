#pragma once
// Linear performance models (FSMoE): the time of a task is t = alpha + beta * x, where x is the
// bytes it moves or the floating-point operations it does. Fitted by least squares over
// measured (x, t) samples; the profiler (sched/profiler.h) measures them, sched/perf_model.h
// keeps one model per task and link class and predicts from them.
#include <span>
#include <string>

namespace xmoe::sched {

/// t(x) = alpha + beta * x, in seconds.
struct LinearModel {
  double alpha = 0;  ///< start-up time, seconds
  double beta = 0;   ///< seconds per unit of x
  double r2 = 0;     ///< coefficient of determination on the fitted samples
  int n = 0;         ///< samples fitted
  std::string unit;  ///< what x counts: "byte" or "flop"

  double predict(double x) const { return alpha + beta * x; }
};

struct FitOptions {
  /// Weight each sample by 1/t^2, so the fit minimises relative rather than absolute residuals:
  /// a geometric sweep spans many octaves, and unweighted the largest sizes alone would set
  /// alpha. Needs every t > 0.
  bool relative = false;
  /// Keep alpha >= 0 and beta >= 0 (a time is never negative): a coefficient the unconstrained
  /// fit makes negative is set to 0 and the other refitted alone.
  bool non_negative = false;
};

/// Least-squares fit of t = alpha + beta * x (closed form, in double). R² = 1 - SS_res / SS_tot
/// on the samples, unweighted (1 when every t is equal and fitted exactly). Throws
/// "[fit] ..." for fewer than 2 samples, x and t of different lengths, a non-finite value, or
/// samples that all have the same x (the slope is undefined).
LinearModel fit_linear(std::span<const double> x, std::span<const double> t, std::string unit,
                       FitOptions options = {});

/// Median over the samples of |predict(x) - t| / t (every t > 0): the accuracy of `model` on
/// samples it was not fitted to.
double median_relative_error(const LinearModel& model, std::span<const double> x,
                             std::span<const double> t);

}  // namespace xmoe::sched
