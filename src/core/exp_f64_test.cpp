// exp_f64 against std::exp: within 2 ulp over the range the sampler uses (and beyond), exact
// where exp is exact, and the documented edges (underflow to 0, overflow to inf, NaN).
#include "core/exp_f64.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/philox.h"

namespace nibble {
namespace {

// |a - b| in units of the last place of b (b normal).
double ulps(double a, double b) { return std::abs(a - b) / (std::nextafter(std::abs(b), INFINITY) - std::abs(b)); }

TEST(ExpF64, WithinTwoUlpOfStdExp) {
  PhiloxStream rng(3, 1);
  double worst = 0;
  for (int i = 0; i < 1'000'000; ++i) {
    // mostly the softmax's range (x <= 0, most mass near 0), some of the whole normal range
    const double u = rng.next_uniform_double();
    const double x = i % 4 == 0 ? -708.0 + 1417.0 * u : -40.0 * u * u;
    const double want = std::exp(x);
    worst = std::max(worst, ulps(exp_f64(x), want));
    ASSERT_LE(ulps(exp_f64(x), want), 2.0) << "x = " << x;
  }
  RecordProperty("worst_ulps", std::to_string(worst));
}

TEST(ExpF64, EdgesAndExactValues) {
  EXPECT_EQ(exp_f64(0.0), 1.0);  // the softmax's maximum contributes exactly 1
  EXPECT_EQ(exp_f64(-0.0), 1.0);
  EXPECT_EQ(exp_f64(-std::numeric_limits<double>::infinity()), 0.0);
  EXPECT_EQ(exp_f64(-708.5), 0.0);  // std::exp: a subnormal
  EXPECT_GT(exp_f64(-707.9), 0.0);
  EXPECT_EQ(exp_f64(710.0), std::numeric_limits<double>::infinity());
  EXPECT_EQ(exp_f64(std::numeric_limits<double>::infinity()), std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(exp_f64(std::nan(""))));
  EXPECT_LE(ulps(exp_f64(1.0), std::exp(1.0)), 1.0);
  EXPECT_LE(ulps(exp_f64(709.0), std::exp(709.0)), 2.0);
  EXPECT_LE(ulps(exp_f64(-708.0), std::exp(-708.0)), 2.0);
  // monotone over a fine grid near 0 (where the softmax's largest terms are)
  double prev = exp_f64(-1.0);
  for (double x = -1.0 + 1e-6; x <= 0.0; x += 1e-6) {
    const double y = exp_f64(x);
    ASSERT_GE(y, prev) << "x = " << x;
    prev = y;
  }
}

}  // namespace
}  // namespace nibble
