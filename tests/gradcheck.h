#pragma once
// Finite-difference gradient checks and tensor comparisons shared by the tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "xmoe/core/rng.h"
#include "xmoe/core/tensor.h"

namespace xmoe::testing {

inline Tensor randn(Shape shape, uint64_t seed, float std = 1.0f) {
  Tensor t = Tensor::empty(std::move(shape));
  fill_normal(t, seed, 99, std);
  return t;
}

/// Compares `analytic` (d loss / d x) with central differences of `loss()` while perturbing x in
/// place. Checks up to `max_checks` elements spread over x. The error is normalised by the
/// gradient's scale so that tiny entries do not fail on rounding.
inline void expect_gradient_close(Tensor& x, const Tensor& analytic,
                                  const std::function<double()>& loss, const char* what,
                                  double eps = 1e-2, double tol = 2e-2, int64_t max_checks = 64) {
  ASSERT_EQ(x.numel(), analytic.numel()) << what;
  float* p = x.data<float>();
  const float* g = analytic.data<float>();
  double scale = 1e-6;
  for (int64_t i = 0; i < analytic.numel(); ++i) scale = std::max(scale, std::fabs((double)g[i]));
  const int64_t n = x.numel();
  const int64_t stride = std::max<int64_t>(1, n / max_checks);
  for (int64_t i = 0; i < n; i += stride) {
    const float orig = p[i];
    p[i] = orig + static_cast<float>(eps);
    const double up = loss();
    p[i] = orig - static_cast<float>(eps);
    const double down = loss();
    p[i] = orig;
    const double numeric = (up - down) / (2 * eps);
    EXPECT_NEAR(g[i], numeric, tol * scale + 1e-4)
        << what << " element " << i << " analytic " << g[i] << " numeric " << numeric;
  }
}

/// max |a - b| / max |b| over two f32 tensors of one shape (0 when b is all zero and a equals
/// it): how far a tensor is from its reference, relative to the reference's scale.
inline double rel_err(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const auto x = a.to_vector<float>(), y = b.to_vector<float>();
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff = std::max(diff, std::abs(double(x[i]) - double(y[i])));
    scale = std::max(scale, std::abs(double(y[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

/// sum(out * weights) in double: the scalar loss whose gradient w.r.t. out is `weights`.
inline double weighted_sum(const Tensor& out, const Tensor& weights) {
  const float* a = out.data<float>();
  const float* b = weights.data<float>();
  double s = 0;
  for (int64_t i = 0; i < out.numel(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

}  // namespace xmoe::testing
