#include "xmoe/sched/linear_model.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "xmoe/core/error.h"

namespace xmoe::sched {

namespace {

struct Sums {
  double w = 0, x = 0, t = 0;  // sum of weights, weighted means of x and t
  double xx = 0, xt = 0;       // weighted centred second moments
  double raw_xx = 0, raw_xt = 0;
};

Sums weighted_sums(std::span<const double> x, std::span<const double> t,
                   std::span<const double> w) {
  Sums s;
  for (size_t i = 0; i < x.size(); ++i) {
    s.w += w[i];
    s.x += w[i] * x[i];
    s.t += w[i] * t[i];
    s.raw_xx += w[i] * x[i] * x[i];
    s.raw_xt += w[i] * x[i] * t[i];
  }
  s.x /= s.w;
  s.t /= s.w;
  for (size_t i = 0; i < x.size(); ++i) {
    s.xx += w[i] * (x[i] - s.x) * (x[i] - s.x);
    s.xt += w[i] * (x[i] - s.x) * (t[i] - s.t);
  }
  return s;
}

}  // namespace

LinearModel fit_linear(std::span<const double> x, std::span<const double> t, std::string unit,
                       FitOptions options) {
  XMOE_CHECK(x.size() == t.size(), "[fit] {} sizes but {} times", x.size(), t.size());
  XMOE_CHECK(x.size() >= 2, "[fit] a line needs at least 2 samples, got {}", x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    XMOE_CHECK(std::isfinite(x[i]) && std::isfinite(t[i]),
               "[fit] sample {} is not finite: ({}, {})", i, x[i], t[i]);
    XMOE_CHECK(!options.relative || t[i] > 0,
               "[fit] relative weighting needs positive times; sample {} has t = {}", i, t[i]);
  }
  const bool same_x = std::all_of(x.begin(), x.end(), [&](double v) { return v == x.front(); });
  XMOE_CHECK(!same_x, "[fit] all {} samples have x = {}: the slope is undefined", x.size(),
             x.front());

  std::vector<double> w(x.size(), 1.0);
  if (options.relative)
    for (size_t i = 0; i < x.size(); ++i) w[i] = 1.0 / (t[i] * t[i]);
  const Sums s = weighted_sums(x, t, w);

  LinearModel m;
  m.unit = std::move(unit);
  m.n = static_cast<int>(x.size());
  m.beta = s.xt / s.xx;
  m.alpha = s.t - m.beta * s.x;
  if (options.non_negative && m.alpha < 0) {
    m.alpha = 0;
    m.beta = s.raw_xt / s.raw_xx;  // the line through the origin
  }
  if (options.non_negative && m.beta < 0) {
    m.beta = 0;
    m.alpha = std::max(0.0, s.t);
  }

  double mean = 0;
  for (double v : t) mean += v;
  mean /= static_cast<double>(t.size());
  double ss_res = 0, ss_tot = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double r = t[i] - m.predict(x[i]);
    ss_res += r * r;
    ss_tot += (t[i] - mean) * (t[i] - mean);
  }
  m.r2 = ss_tot > 0 ? 1.0 - ss_res / ss_tot : (ss_res == 0 ? 1.0 : 0.0);
  return m;
}

double median_relative_error(const LinearModel& model, std::span<const double> x,
                             std::span<const double> t) {
  XMOE_CHECK(x.size() == t.size() && !x.empty(),
             "[fit] median_relative_error needs as many times as sizes, at least one ({} and {})",
             x.size(), t.size());
  std::vector<double> errors;
  for (size_t i = 0; i < x.size(); ++i) {
    XMOE_CHECK(t[i] > 0, "[fit] measured time {} of sample {} is not positive", t[i], i);
    errors.push_back(std::abs(model.predict(x[i]) - t[i]) / t[i]);
  }
  std::sort(errors.begin(), errors.end());
  const size_t h = errors.size() / 2;
  return errors.size() % 2 ? errors[h] : 0.5 * (errors[h - 1] + errors[h]);
}

}  // namespace xmoe::sched
