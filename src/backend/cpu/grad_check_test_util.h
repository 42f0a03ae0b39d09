// Test helper (tests only): central finite differences in double precision for the CPU ops'
// backward passes, and a deterministic random fill. The tolerance derivation lives here once:
// with step h, the central difference (f(x+h) - f(x-h)) / 2h has truncation error
// h^2/6 |f'''| and rounding error ~ eps |f| / h (eps = 2^-52 ~ 2.2e-16). For the O(1) smooth test
// losses used here (|f| <= ~50, |f'''| <= ~1e2) and h = 1e-5: truncation <= 1.7e-9, rounding
// <= 50 * 2.2e-16 / 1e-5 = 1.1e-9. So |analytic - numeric| <= 3e-9 for a correct backward; we
// allow kGradAbsTol = 1e-7 (30x margin), plus kGradRelTol = 1e-6 of the gradient's size.
#pragma once

#include <cmath>
#include <functional>
#include <vector>

#include <gtest/gtest.h>

#include "core/philox.h"

namespace nibble::cpu::testing {

constexpr double kFdStep = 1e-5;
constexpr double kGradAbsTol = 1e-7;
constexpr double kGradRelTol = 1e-6;

inline std::vector<double> random_vector(size_t n, uint64_t seed, double scale = 1.0) {
  PhiloxStream rng(seed, 7);
  std::vector<double> v(n);
  for (auto& x : v) x = scale * rng.next_normal();
  return v;
}

// Compares analytic[i] with the central difference of loss() in x[i] for every i.
inline void expect_grad_matches_fd(std::vector<double>& x, const std::vector<double>& analytic,
                                   const std::function<double()>& loss, const char* what) {
  ASSERT_EQ(x.size(), analytic.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double saved = x[i];
    x[i] = saved + kFdStep;
    double lp = loss();
    x[i] = saved - kFdStep;
    double lm = loss();
    x[i] = saved;
    double numeric = (lp - lm) / (2 * kFdStep);
    EXPECT_NEAR(analytic[i], numeric, kGradAbsTol + kGradRelTol * std::fabs(numeric)) << what << "[" << i << "]";
  }
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace nibble::cpu::testing
