// Per-element error bounds for the op tests whose backends may round differently (a reduction's
// order, expf's last bits): within_bound checks |a[i] - ref[i]| <= bound[i] for every i, where
// each case derives bound[i] from its formula's rounding analysis (written beside the case) and
// the reference's magnitudes. kUnitRoundoff is binary32's u = 2^-24; kUnitRoundoffF64 binary64's.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <fmt/format.h>

namespace nibble::backend::testing {

constexpr double kUnitRoundoff = 0x1p-24;
constexpr double kUnitRoundoffF64 = 0x1p-53;

template <typename T>
::testing::AssertionResult within_bound(const std::vector<T>& a, const std::vector<T>& ref,
                                        const std::vector<double>& bound) {
  if (a.size() != ref.size() || a.size() != bound.size())
    return ::testing::AssertionFailure() << "sizes differ: " << a.size() << ", " << ref.size() << ", " << bound.size();
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(a[i]), r = static_cast<double>(ref[i]);
    if (std::isnan(x) || std::isnan(r)) {
      if (std::isnan(x) != std::isnan(r)) return ::testing::AssertionFailure() << "NaN mismatch at " << i;
      continue;
    }
    if (!(std::fabs(x - r) <= bound[i]))
      return ::testing::AssertionFailure() << fmt::format("index {}: {} vs reference {} (|diff| {:.3g} > bound {:.3g})",
                                                          i, x, r, std::fabs(x - r), bound[i]);
  }
  return ::testing::AssertionSuccess();
}

// Bitwise equality of any trivially copyable element arrays (u16 BF16 bits, f64 sums, i32 ids).
template <typename T>
::testing::AssertionResult same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure() << "first difference at index " << i << ": " << +a[i] << " vs " << +b[i];
  return ::testing::AssertionSuccess();
}

}  // namespace nibble::backend::testing
