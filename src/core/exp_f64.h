// exp(x) in double precision, the same bits on every x86-64 host and in every build: IEEE
// additions and multiplications only (no FMA contraction, no libm), so loops over it vectorize.
// Cody-Waite reduction x = k ln2 + r (|r| <= ln2/2, ln2 split hi/lo so k * hi is exact), a
// degree-13 Taylor polynomial of e^r (truncation < 2e-17 relative) in Horner form, and 2^k
// built from k's bits. Within 2 ulp of a correctly rounded exp (core tests compare it with
// std::exp). Below -708 (and -inf) it gives 0 where std::exp would give subnormals (< 4e-308);
// above 709, +inf; NaN stays NaN. The rollout sampler's softmax uses it (rollout/sampler.cpp), and
// so does the CUDA greedy kernel (backend/cuda/sampling.cu; nvcc builds with --fmad=false, so
// the device evaluates the very same roundings).
#pragma once

#include <bit>
#include <cstdint>
#include <limits>

#include "core/host_device.h"

namespace nibble {

NIB_HOST_DEVICE double exp_f64(double x) {
  constexpr double kLog2e = 1.4426950408889634074;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;  // 32 significant bits: k * kLn2Hi is exact
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShifter = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
  const double xc = x < -708.0 ? -708.0 : (x > 709.0 ? 709.0 : x);  // NaN passes through
  const double kt = xc * kLog2e + kShifter;  // two roundings (no FMA); k = round(x / ln2)
  const double k = kt - kShifter;            // exact
  const double r = (xc - k * kLn2Hi) - k * kLn2Lo;
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  // kt's low bits hold k (two's complement, |k| <= 1023): the biased exponent k + 1023 in [2, 2046]
  const uint64_t scale_bits = (std::bit_cast<uint64_t>(kt) + 1023) << 52;
  const double y = p * std::bit_cast<double>(scale_bits);
  // selects, not branches (loops over it vectorize): -inf and the subnormal range 0, NaN stays NaN
  const double over = x > 709.0 ? std::numeric_limits<double>::infinity() : y;
  return x < -708.0 ? 0.0 : over;
}

}  // namespace nibble
