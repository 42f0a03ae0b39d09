// Element/scale codec tests (e2m1.h, e4m3.h, e8m0.h, nvfp4.h constants) against independent
// double-precision oracles written here: nearest representable value by exhaustive search,
// ties to the even code, saturation; E8M0 rules against frexp/ceil(log2) formulations.
#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/bits.h"
#include "core/philox.h"
#include "formats/e2m1.h"
#include "formats/e4m3.h"
#include "formats/e8m0.h"
#include "formats/nvfp4.h"

namespace nibble::formats {
namespace {

const double kE2M1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};

// Oracle: nearest magnitude index, ties to the even index, saturating.
uint32_t e2m1_index_ref(double a) {
  uint32_t best = 0;
  for (uint32_t i = 1; i < 8; ++i) {
    double d = std::fabs(a - kE2M1[i]), db = std::fabs(a - kE2M1[best]);
    if (d < db || (d == db && (i % 2 == 0))) best = i;
  }
  return best;
}

// Oracle: nearest non-negative finite E4M3 byte (0x00..0x7E), ties to even mantissa, saturating.
uint32_t e4m3_ref(double a) {
  if (a >= 448.0) return 0x7E;
  uint32_t best = 0;
  for (uint32_t c = 1; c <= 0x7E; ++c) {
    double v = e4m3_decode(c), bv = e4m3_decode(best);
    double d = std::fabs(a - v), db = std::fabs(a - bv);
    if (d < db || (d == db && (c % 2 == 0))) best = c;
  }
  return best;
}

TEST(E2M1, TableAndDecode) {
  for (uint32_t c = 0; c < 16; ++c) {
    double v = kE2M1[c & 7];
    EXPECT_EQ(e2m1_decode(c), c & 8 ? -v : v) << c;
    EXPECT_EQ(std::signbit(e2m1_decode(c)), (c & 8) != 0) << c;  // 0x8 is -0.0
  }
  // Mantissa bit alternates along the magnitude ladder (TRACE 1-bit guidance relies on it).
  for (uint32_t i = 0; i < 8; ++i) EXPECT_EQ(i & 1u, i % 2);
}

TEST(E2M1, RoundToNearestEvenAgainstOracle) {
  // The spec's examples.
  EXPECT_EQ(e2m1_rne_index(0.25f), 0u);
  EXPECT_EQ(e2m1_rne_index(0.75f), 2u);
  EXPECT_EQ(e2m1_rne_index(1.25f), 2u);
  EXPECT_EQ(e2m1_rne_index(1.75f), 4u);
  EXPECT_EQ(e2m1_rne_index(2.5f), 4u);
  EXPECT_EQ(e2m1_rne_index(3.5f), 6u);
  EXPECT_EQ(e2m1_rne_index(5.0f), 6u);
  EXPECT_EQ(e2m1_rne_index(6.5f), 7u);
  EXPECT_EQ(e2m1_rne_index(std::numeric_limits<float>::infinity()), 7u);
  EXPECT_EQ(e2m1_rne_index(std::numeric_limits<float>::quiet_NaN()), 0u);
  // Every float in [0, 8] on a fine grid plus the neighbours of each threshold.
  for (int i = 0; i <= 8 * 4096; ++i) {
    float a = static_cast<float>(i) / 4096.0f;
    ASSERT_EQ(e2m1_rne_index(a), e2m1_index_ref(a)) << a;
  }
  for (float t : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f})
    for (float a : {std::nextafter(t, 0.0f), t, std::nextafter(t, 10.0f)}) ASSERT_EQ(e2m1_rne_index(a), e2m1_index_ref(a)) << a;
}

// The former formulations of formats/ (kept as oracles): the 7-compare RNE chain and the SR
// step that divides by the grid gap.
uint32_t e2m1_rne_index_ref(float a) {
  return static_cast<uint32_t>(a > 0.25f) + static_cast<uint32_t>(a >= 0.75f) + static_cast<uint32_t>(a > 1.25f) +
         static_cast<uint32_t>(a >= 1.75f) + static_cast<uint32_t>(a > 2.5f) + static_cast<uint32_t>(a >= 3.5f) +
         static_cast<uint32_t>(a > 5.0f);
}
uint32_t e2m1_sr_index_ref(float a, float u) {
  uint32_t di = static_cast<uint32_t>(a >= 0.5f) + static_cast<uint32_t>(a >= 1.0f) + static_cast<uint32_t>(a >= 1.5f) +
                static_cast<uint32_t>(a >= 2.0f) + static_cast<uint32_t>(a >= 3.0f) + static_cast<uint32_t>(a >= 4.0f) +
                static_cast<uint32_t>(a >= 6.0f);
  float down = e2m1_magnitude(di);
  float gap = di < 4u ? 0.5f : (di < 6u ? 1.0f : 2.0f);
  float frac = (a - down) / gap;
  return di + ((di < 7u && u < frac) ? 1u : 0u);
}

TEST(E2M1, IntegerRoundingIndexAndSrStepEqualFormerFormulations) {
  // All 2^32 inputs are checked on the GPU (ElementCodec.ExhaustiveAgainstFormerFormulations); here every
  // 61st bit pattern (70M inputs: every sign, exponent and mantissa region incl. NaN, Inf,
  // subnormals, -0) plus all patterns within +-64 ulps of each threshold and grid value.
  auto check = [](uint32_t bits) {
    float a = u32_as_float(bits);
    ASSERT_EQ(e2m1_rne_index(a), e2m1_rne_index_ref(a)) << std::hex << bits;
    float frac = a >= 0.0f ? a - std::floor(a) : 0.5f;
    for (float u : {0.0f, 0.5f, frac, std::nextafter(frac, 0.0f)})
      ASSERT_EQ(e2m1_sr_index(a, u), e2m1_sr_index_ref(a, u)) << std::hex << bits << " " << u;
  };
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 61) check(static_cast<uint32_t>(b));
  for (float t : {0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f, 2.0f, 2.5f, 3.0f, 3.5f, 4.0f, 5.0f, 6.0f})
    for (int d = -64; d <= 64; ++d) check(float_as_u32(t) + static_cast<uint32_t>(d));
}

TEST(E2M1, SrIndexFromHalfWordEqualsFloatForm) {
  // e2m1_sr_index_h(a, h) == e2m1_sr_index(a, h * 2^-16): every 97th bit pattern of a (44M, all
  // regions incl. NaN/Inf/subnormal/-0) at h = 0, 65535, 65536 (u = 1) and the two h around the
  // decision boundary p * 2^16; and all 65536 h for 2000 random a in [0, 7).
  auto check = [](float a, uint32_t h) {
    const float u = h == 65536u ? 1.0f : static_cast<float>(h) * 0x1p-16f;
    ASSERT_EQ(e2m1_sr_index_h(a, h), e2m1_sr_index(a, u)) << std::hex << float_as_u32(a) << " h=" << std::dec << h;
  };
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 97) {
    const float a = u32_as_float(static_cast<uint32_t>(b));
    const uint32_t di = e2m1_sr_index(a, 1.0f);
    const double gap = di < 4 ? 0.5 : (di < 6 ? 1.0 : 2.0);
    const double p = a >= 0.0f && a < 6.0f ? (a - e2m1_magnitude(di)) / gap : 0.0;
    const uint32_t hb = static_cast<uint32_t>(std::min(p * 65536.0, 65535.0));
    for (uint32_t h : {0u, 65535u, 65536u, hb, std::min(hb + 1, 65535u)}) check(a, h);
  }
  PhiloxStream rng(8, 8);
  for (int i = 0; i < 2000; ++i) {
    const float a = static_cast<float>(rng.next_uniform_double() * 7.0);
    for (uint32_t h = 0; h < 65536u; ++h) check(a, h);
  }
}

TEST(TwoLevel, DivisionFreeQuotientIsCorrectlyRounded) {
  // nvfp4_2level_scaled_magnitude(x, sp, r) (reciprocal + two FMA corrections, nvfp4.h) must
  // equal fl(|x| / sp) bit for bit for every (x, sp) the format produces: sp = fl(e4m3 * so),
  // so any binary32. The GPU test covers all 2^30 (BF16 mantissa, sp mantissa) pairs; here a
  // large random sample over all exponents and a dense sample of BF16 x mantissas, plus edges.
  PhiloxStream rng(77, 3);
  auto check = [](float x, float sp) {
    float r = nvfp4_2level_block_reciprocal(sp);
    float got = nvfp4_2level_scaled_magnitude(x, sp, r);
    float want = sp == 0.0f ? 0.0f : std::fabs(x) / sp;
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << x << " " << sp;
    } else {
      ASSERT_EQ(float_as_u32(got), float_as_u32(want)) << std::hexfloat << x << " / " << sp;
    }
  };
  // (1) arbitrary bit patterns of x against sp = e4m3 * so for random so.
  for (int i = 0; i < 3000000; ++i) {
    uint32_t xb = rng.next_u32();
    float so = u32_as_float((rng.next_u32() & 0x007FFFFFu) | ((100u + rng.next_u32() % 60u) << 23));
    float sp = e4m3_decode(rng.next_u32() % 0x7Fu) * so;
    check(u32_as_float(xb), sp);
  }
  // (2) quotients near the E2M1 range: x = sp * t with t in [0, 8), random 24-bit mantissas.
  for (int i = 0; i < 3000000; ++i) {
    float sp = u32_as_float((rng.next_u32() & 0x007FFFFFu) | ((64u + rng.next_u32() % 128u) << 23));
    float t = static_cast<float>(rng.next_uniform_double() * 8.0);
    check(t * sp, sp);
    check(bf16_bits_to_f32(f32_to_bf16_bits(t * sp)), sp);
  }
  // (3) edges: zeros, subnormals, range limits of the fast path, Inf, NaN, huge/tiny sp.
  const float xs[] = {0.0f, -0.0f, 1e-45f, 1e-40f, 0x1p-61f, 0x1p-60f, 0x1.fffffep-61f, 0x1p60f, 0x1.000002p60f,
                      3e38f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), 1.0f,
                      5.0f, 6.0f, 0x1.fffffep0f};
  const float sps[] = {1e-45f, 1e-40f, 0x1p-61f, 0x1p-60f, 0x1.fffffep-61f, 0x1p-59f, 1.0f, 0x1.fffffep0f, 0x1p60f,
                       0x1.000002p60f, 3e38f, std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN(), 0.0f};
  for (float x : xs)
    for (float sp : sps) {
      check(x, sp);
      check(-x, sp);
    }
}

TEST(E2M1, Min3IndexEqualsRneIndexBelowSeven) {
  // e2m1_rne_index_bits_min3 (e2m1.h) against e2m1_rne_index: every binary32 within 2^16 ulp of
  // each multiple of 1/8 in [0, 7) (all decision values, grid points and the places where the
  // minimum switches between its three terms) and every 61st pattern elsewhere. The GPU suite
  // checks all 1.09e9 patterns.
  const uint32_t last = float_as_u32(7.0f) - 1u;
  uint64_t bad = 0, n = 0;
  uint32_t first = 0;
  auto check = [&](uint32_t u) {
    const float a = u32_as_float(u);
    ++n;
    if (e2m1_rne_index_bits_min3(a) - 0x4B000000u != e2m1_rne_index(a) && bad++ == 0) first = u;
  };
  for (int q = 1; q <= 56; ++q) {
    const uint32_t c = float_as_u32(0.125f * static_cast<float>(q));
    for (uint32_t u = c - 65536u; u <= c + 65536u && u <= last; ++u) check(u);
  }
  for (uint32_t u = 0; u <= last; u += 61u) check(u);
  EXPECT_EQ(bad, 0u) << "of " << n << "; first at bits 0x" << std::hex << first;
}

TEST(TwoLevel, RtnIndexNeedsNoPerElementRangeCheck) {
  // nvfp4_2level_block_fast_rtn (nvfp4.h): with r != 0 and bamax <= 2^60, the division-free
  // quotient gives the index of the IEEE quotient for every |x| <= bamax, tiny and subnormal |x|
  // included. Every BF16 magnitude up to 2^60, at scales across [2^-60, 2^60] (the ends, random
  // mantissas near them, and the middle); plus binary32 subnormals and tiny normals.
  PhiloxStream rng(91, 2);
  std::vector<float> sps = {0x1p-60f, 0x1.000002p-60f, 0x1.fffffep-60f, 0x1p-59f, 1.0f, 0x1.5p-30f, 0x1p60f, 0x1.fffffep59f};
  for (int i = 0; i < 40; ++i) {
    const int e = (i % 4 == 0) ? -60 : (i % 4 == 1) ? 59 : static_cast<int>(rng.next_below(120)) - 60;
    sps.push_back(std::ldexp(1.0f + static_cast<float>(rng.next_below(1u << 23)) * 0x1p-23f, e));
  }
  for (float sp : sps) {
    const float r = nvfp4_2level_block_reciprocal(sp);
    ASSERT_TRUE(nvfp4_2level_block_fast_rtn(r, 0x1p60f)) << sp;
    auto check = [&](float a) {
      const uint32_t want = e2m1_rne_index(nvfp4_2level_scaled_magnitude(a, sp));
      const uint32_t got = e2m1_rne_index(nvfp4_2level_quotient_fma(a, sp, r));
      ASSERT_EQ(got, want) << std::hexfloat << a << " / " << sp;
    };
    for (uint32_t b = 0; b <= 0x5D80u; ++b) check(bf16_bits_to_f32(static_cast<uint16_t>(b)));
    for (uint32_t u = 1; u < (1u << 23); u += 4099u) check(u32_as_float(u));                  // subnormals
    for (uint32_t u = 0x00800000u; u < 0x21800000u; u += 0x10003u) check(u32_as_float(u));  // tiny normals
  }
}

TEST(E2M1, SignConventions) {
  // TE: sign bit iff the scaled value < 0.
  EXPECT_EQ(e2m1_rne_code_te(-0.0f), 0x0u);
  EXPECT_EQ(e2m1_rne_code_te(0.0f), 0x0u);
  EXPECT_EQ(e2m1_rne_code_te(-0.1f), 0x8u);  // small negative rounding to zero
  EXPECT_EQ(e2m1_rne_code_te(-7.0f), 0xFu);
  EXPECT_EQ(e2m1_rne_code_te(std::numeric_limits<float>::quiet_NaN()), 0x0u);
  // signbit convention (TetraJet/MX).
  EXPECT_EQ(e2m1_rne_code_signbit(-0.0f), 0x8u);
  EXPECT_EQ(e2m1_rne_code_signbit(0.0f), 0x0u);
  EXPECT_EQ(e2m1_rne_code_signbit(-0.1f), 0x8u);
  EXPECT_EQ(e2m1_rne_code_signbit(-1.3f), 0xBu);  // 1.3 > 1.25 -> 1.5
  EXPECT_EQ(e2m1_rne_code_signbit(-1.2f), 0xAu);
  EXPECT_EQ(e2m1_rne_code_signbit(-std::numeric_limits<float>::infinity()), 0xFu);
  EXPECT_EQ(e2m1_rne_code_signbit(-std::numeric_limits<float>::quiet_NaN()), 0x0u);  // NaN: positive
}

TEST(E2M1, Packing) {
  for (uint32_t a = 0; a < 16; ++a)
    for (uint32_t b = 0; b < 16; ++b) {
      uint8_t p[1] = {e2m1_pack(a, b)};
      EXPECT_EQ(p[0] & 0xF, static_cast<int>(a));  // even element in the low nibble
      EXPECT_EQ(e2m1_unpack(p, 0), a);
      EXPECT_EQ(e2m1_unpack(p, 1), b);
    }
}

TEST(E4M3, DecodeRoundTripAndSpecials) {
  for (uint32_t c = 0; c < 256; ++c) {
    float v = e4m3_decode(c);
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(e4m3_rne_sat(v), c) << c;  // includes -0.0 -> 0x80
  }
  EXPECT_EQ(e4m3_decode(0x7E), 448.0f);
  EXPECT_EQ(e4m3_decode(0x01), 0x1p-9f);
  EXPECT_EQ(e4m3_decode(0x08), 0x1p-6f);
  EXPECT_EQ(e4m3_rne_sat(1e30f), 0x7Eu);
  EXPECT_EQ(e4m3_rne_sat(-std::numeric_limits<float>::infinity()), 0xFEu);
  EXPECT_EQ(e4m3_rne_sat(464.0f), 0x7Eu);   // tie 448/480 -> even (448)
  EXPECT_EQ(e4m3_rne_sat(470.0f), 0x7Eu);   // would round to 480: saturates
  EXPECT_EQ(e4m3_rne_sat(std::numeric_limits<float>::quiet_NaN()), 0x7Fu);
  EXPECT_EQ(e4m3_rne_sat(-std::numeric_limits<float>::quiet_NaN()), 0x7Fu);
  EXPECT_EQ(e4m3_rne_sat(0x1p-10f), 0x00u);  // half the smallest subnormal: tie -> 0
  EXPECT_EQ(e4m3_rne_sat(0x1.8p-9f), 0x02u); // 1.5 * 2^-9: tie -> even (2)
  EXPECT_EQ(e4m3_rne_sat(1e-45f), 0x00u);    // FP32 subnormal
}

TEST(E4M3, RoundToNearestEvenAgainstOracle) {
  // All midpoints between consecutive codes and their float neighbours, then random values.
  for (uint32_t c = 0; c < 0x7E; ++c) {
    double mid = 0.5 * (static_cast<double>(e4m3_decode(c)) + e4m3_decode(c + 1));
    float m = static_cast<float>(mid);  // exact: mid has at most 5 significant bits
    for (float a : {std::nextafter(m, 0.0f), m, std::nextafter(m, 1000.0f)})
      ASSERT_EQ(e4m3_rne_sat_magnitude(a), e4m3_ref(a)) << a;
  }
  PhiloxStream rng(1, 2);
  for (int i = 0; i < 20000; ++i) {
    float a = static_cast<float>(std::ldexp(1.0 + rng.next_uniform_double(), static_cast<int>(rng.next_below(24)) - 14));
    ASSERT_EQ(e4m3_rne_sat_magnitude(a), e4m3_ref(a)) << a;
  }
}

TEST(E8M0, DecodeAndInverse) {
  EXPECT_EQ(e8m0_decode(127), 1.0f);
  EXPECT_EQ(e8m0_decode(0), 0x1p-127f);
  EXPECT_EQ(e8m0_decode(254), 0x1p127f);
  EXPECT_TRUE(std::isnan(e8m0_decode(255)));
  for (uint32_t b = 0; b < 255; ++b) EXPECT_EQ(static_cast<double>(e8m0_inverse(b)), std::ldexp(1.0, 127 - static_cast<int>(b))) << b;
}

// Oracles: floor via frexp, round-up via the exact value, for normal and FP32-subnormal inputs.
uint32_t floor_ref(float bamax, int emax) {
  if (!std::isfinite(bamax)) return 255;
  if (bamax == 0.0f || std::fpclassify(bamax) == FP_SUBNORMAL) return 0;
  int e;
  std::frexp(bamax, &e);  // bamax = f * 2^e, f in [0.5, 1): floor(log2) = e - 1
  int E = std::clamp(e - 1 - emax, -127, 128);
  return static_cast<uint32_t>(E + 127);
}
// smallest byte b with 2^(b-127) >= d (d >= 0 finite), capped at 255.
uint32_t round_up_ref(double d) {
  for (int b = 0; b < 255; ++b)
    if (std::ldexp(1.0, b - 127) >= d) return static_cast<uint32_t>(b);
  return 255;
}

TEST(E8M0, ScaleRulesAgainstOracles) {
  PhiloxStream rng(3, 4);
  std::vector<float> vals = {0.0f, 1e-45f, 0x1p-149f, 0x1p-127f, 0x1.000002p-127f, 0x1p-126f, 6.0f, 448.0f,
                             3.0f, 5.9999995f, 6.0000005f, FLT_MAX, 1.0f, 0x1p-130f, 0x1.8p-128f};
  for (int i = 0; i < 5000; ++i)
    vals.push_back(static_cast<float>(std::ldexp(1.0 + rng.next_uniform_double(), static_cast<int>(rng.next_below(300)) - 160)));
  for (float b : vals) {
    if (!std::isfinite(b)) continue;
    EXPECT_EQ(e8m0_floor(b, 2), floor_ref(b, 2)) << b;
    EXPECT_EQ(e8m0_floor(b, 8), floor_ref(b, 8)) << b;
    float d6 = b * kRecip6, d448 = b * kRecip448;
    EXPECT_EQ(e8m0_rceil(b, kRecip6), round_up_ref(d6)) << b;
    EXPECT_EQ(e8m0_rceil(b, kRecip448), round_up_ref(d448)) << b;
    float dte = b / 6.0f;
    EXPECT_EQ(e8m0_te_ceil(b), std::min<uint32_t>(round_up_ref(dte), 254)) << b;
  }
  EXPECT_EQ(e8m0_floor(std::numeric_limits<float>::infinity(), 2), 255u);
  EXPECT_EQ(e8m0_rceil(std::numeric_limits<float>::quiet_NaN(), kRecip6), 255u);
}

TEST(Constants, ReciprocalBits) {
  EXPECT_EQ(std::bit_cast<uint32_t>(kRecip6), 0x3E2AAAABu);
  EXPECT_EQ(std::bit_cast<uint32_t>(kRecip448), 0x3B124925u);
  volatile float v2688 = 2688.0f;  // runtime division: the constant equals fl(1/2688)
  EXPECT_EQ(kRecip2688, 1.0f / v2688);
  EXPECT_EQ(kFltMax, FLT_MAX);
}

}  // namespace
}  // namespace nibble::formats
