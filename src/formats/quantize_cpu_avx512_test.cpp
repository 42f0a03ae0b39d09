// Tests of the AVX-512 RTN row kernels (quantize_cpu_avx512.h) through the public drivers: inputs
// built so that most 256-element groups stay on the streamlined path (finite, |x| in [2^-60,
// 2^60] or 0) and still hit every branch of the element and scale steps (exact E2M1 ties,
// +-0.0, all-zero blocks, E4M3-subnormal block scales, saturating scale round-down, Inf for TE),
// mixed with groups that must take the per-block fallback (NaN, Inf, huge, tiny); every byte is
// compared with the per-block functions of nvfp4.h. On builds without AVX-512 the same drivers
// run the portable paths and the test checks those. The 2-level BF16 kernel (per-block exact
// thresholds + search) gets its own tests below: random data at many scales, values planted on
// and next to every threshold, every threshold of every block scale it can see, every magnitude
// under the block maximum for ~320 scales, and special blocks (zeros, -0.0, subnormals, huge).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "core/bits.h"
#include "core/philox.h"
#include "formats/bf16_test_util.h"
#include "formats/mx.h"
#include "formats/quantize_cpu.h"

namespace nibble::formats {
namespace {

using testing::to_bf16;

// One value of a 16-block in mode `mode` (chosen per block).
float block_value(PhiloxStream& rng, int mode, float f) {
  switch (mode) {
    case 0:  // N(0,1) times the block factor
      return static_cast<float>(rng.next_normal()) * f;
    case 1: {  // exact E2M1 grid points and midpoints (ties) of the unit grid, both signs, +-0
      static const float kTies[] = {0.0f, 0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f,
                                    2.0f, 2.5f,  3.0f, 3.5f,  4.0f, 5.0f,  6.0f};
      float v = kTies[rng.next_below(15)];
      return rng.next_below(2) ? -v : v;
    }
    case 2:  // all-zero block with signed zeros
      return rng.next_below(2) ? -0.0f : 0.0f;
    case 3:  // tiny block next to normal ones: E4M3-subnormal (or zero) block scales
      return static_cast<float>(rng.next_normal()) * 1e-6f;
    default:  // values just below a power of two: scale rounding down, saturation at 6
      return (rng.next_below(2) ? -1.0f : 1.0f) * std::nextafter(8.0f, 0.0f) * f;
  }
}

std::vector<float> fast_path_input(int64_t n, uint64_t seed) {
  PhiloxStream rng(seed, 3);
  std::vector<float> x(static_cast<size_t>(n));
  int mode = 0;
  float f = 1.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 16 == 0) {
      mode = static_cast<int>(rng.next_below(5));
      f = static_cast<float>(std::exp2(static_cast<double>(rng.next_below(41)) - 20.0));  // 2^-20 .. 2^20
    }
    x[static_cast<size_t>(i)] = block_value(rng, mode, f);
  }
  return x;
}

template <typename In>
void expect_te_equal(const std::vector<In>& x, int64_t M, int64_t K) {
  std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), scales(static_cast<size_t>(M * K / 16));
  float amax = nvfp4_te_quantize_cpu(codes.data(), scales.data(), x.data(), M, K);
  Nvfp4TeGlobal g = nvfp4_te_global(amax);
  std::vector<uint8_t> c_ref(codes.size()), s_ref(scales.size());
  for (int64_t b = 0; b < M * K / 16; ++b) {
    const In* xb = x.data() + 16 * b;
    s_ref[static_cast<size_t>(b)] = static_cast<uint8_t>(nvfp4_te_quantize_block16(c_ref.data() + 8 * b, xb, block_amax(xb, 16), g));
  }
  ASSERT_EQ(scales, s_ref);
  ASSERT_EQ(codes, c_ref);
}

template <typename In>
void expect_2level_equal(const std::vector<In>& x, int64_t M, int64_t K) {
  std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), inner(static_cast<size_t>(M * K / 16));
  std::vector<float> outer(static_cast<size_t>(M * K / 128));
  nvfp4_2level_quantize_cpu(codes.data(), inner.data(), outer.data(), x.data(), M, K);
  std::vector<uint8_t> c_ref(codes.size()), i_ref(inner.size());
  for (int64_t o = 0; o < M * K / 128; ++o) {
    float so = nvfp4_2level_quantize_block128(c_ref.data() + 64 * o, i_ref.data() + 8 * o, x.data() + 128 * o, 128);
    ASSERT_EQ(float_as_u32(outer[static_cast<size_t>(o)]), float_as_u32(so)) << o;
  }
  ASSERT_EQ(inner, i_ref);
  ASSERT_EQ(codes, c_ref);
}

TEST(Avx512Rows, InRangeGroupsEqualBlockFunctions) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    const int64_t M = 16, K = 1024;
    std::vector<float> x = fast_path_input(M * K, seed);
    expect_te_equal(x, M, K);
    expect_te_equal(to_bf16(x), M, K);
    expect_2level_equal(x, M, K);
    expect_2level_equal(to_bf16(x), M, K);
  }
}

TEST(Avx512Rows, OutOfRangeGroupsTakeTheFallbackAndNeighboursStayExact) {
  // Every other 256-group gets one special value at a varying position; the groups in between
  // stay on the streamlined path.
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            1e30f,  // > 2^60: 2-level fallback; TE fast path
                            -1e-25f,  // nonzero < 2^-60: 2-level fallback; TE fast path
                            0x1p60f, 0x1p-60f, std::nextafter(0x1p60f, 1e38f), std::nextafter(0x1p-60f, 0.0f)};
  const int64_t M = 8, K = 1280;
  std::vector<float> x = fast_path_input(M * K, 9);
  PhiloxStream rng(10, 1);
  int s = 0;
  for (int64_t g = 0; g < M * K / 256; g += 2)
    x[static_cast<size_t>(256 * g + rng.next_below(256))] = specials[s++ % 10];
  expect_te_equal(x, M, K);
  expect_te_equal(to_bf16(x), M, K);
  expect_2level_equal(x, M, K);
  expect_2level_equal(to_bf16(x), M, K);
}

TEST(Avx512Rows, TwoLevelQuotientsNextToThresholds) {
  // The 2-level element step divides by the block scale sp (by reciprocal + FMA corrections on
  // the vector path); only quotients next to an E2M1 threshold show a wrong last bit. Quantize
  // once, then keep each block's largest element (so every scale stays the same) and set the
  // others to fl(t * sp) for thresholds/grid points t <= 5 (5 * sp < block amax since sp is
  // within 2^-4 of amax / 6): the quotients land on or next to the thresholds.
  const int64_t M = 8, K = 1024;
  std::vector<float> x = fast_path_input(M * K, 21);
  for (float& v : x) v = v == 0.0f ? 1.0f : v;  // no all-zero blocks (sp = 0)
  std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), inner(static_cast<size_t>(M * K / 16));
  std::vector<float> outer(static_cast<size_t>(M * K / 128));
  nvfp4_2level_quantize_cpu(codes.data(), inner.data(), outer.data(), x.data(), M, K);
  static const float kT[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 0.5f, 1.0f, 3.0f, 4.0f};
  PhiloxStream rng(22, 2);
  for (int64_t b = 0; b < M * K / 16; ++b) {
    float sp = nvfp4_2level_block_scale(inner[static_cast<size_t>(b)], outer[static_cast<size_t>(b / 8)]);
    float* xb = x.data() + 16 * b;
    int keep = 0;
    for (int i = 1; i < 16; ++i) keep = std::fabs(xb[i]) > std::fabs(xb[keep]) ? i : keep;
    for (int i = 0; i < 16; ++i)
      if (i != keep) xb[i] = (rng.next_below(2) ? -1.0f : 1.0f) * (kT[rng.next_below(11)] * sp);
  }
  expect_2level_equal(x, M, K);
}

TEST(Avx512Rows, TeInfInputAndHugeScaleRange) {
  // Inf stays on the TE fast path (scaled value Inf -> saturated code 7 with its sign); a tensor
  // amax of Inf gives s_enc = 1 (nvfp4_te_global).
  const int64_t M = 2, K = 512;
  std::vector<float> x = fast_path_input(M * K, 4);
  x[5] = std::numeric_limits<float>::infinity();
  x[700] = -std::numeric_limits<float>::infinity();
  expect_te_equal(x, M, K);
  expect_te_equal(to_bf16(x), M, K);
}

// ---- 2-level RTN, BF16 input: the threshold-search kernel ---------------------------------------
// (quantize_cpu_avx512.h derives, per block scale sp, the 7 smallest BF16 magnitudes C_k whose
// index is >= k and searches them per element; these tests compare every byte with the
// per-block functions, which divide.)

// The reference index of BF16 magnitude pattern p in a block of scale sp.
uint32_t ref_index(uint16_t p, float sp) { return nvfp4_2level_encode_rtn(bf16_bits_to_f32(p), sp) & 7u; }

// C_1..C_7 by scanning every positive finite BF16 pattern with the reference (0x7F80 = never);
// also checks that the reference index never decreases along the patterns (the kernel's premise).
std::vector<uint16_t> scan_thresholds(float sp) {
  std::vector<uint16_t> c(8, 0x7F80);
  uint32_t prev = 0;
  for (uint32_t p = 0; p <= 0x7F7F; ++p) {
    const uint32_t idx = ref_index(static_cast<uint16_t>(p), sp);
    EXPECT_GE(idx, prev) << "sp=" << sp << " p=" << p;
    for (uint32_t k = prev + 1; k <= idx; ++k) c[k] = static_cast<uint16_t>(p);
    prev = idx > prev ? idx : prev;
  }
  return c;
}

TEST(Avx512Rows, TwoLevelBf16RandomNormalAtManyScales) {
  const int64_t M = 8, K = 1024;
  const double scales[] = {0x1p-66, 0x1p-60, 0x1p-52, 0x1p-40, 0x1p-20, 0x1p-8, 1.0,
                           0x1p8,   0x1p20,  0x1p40,  0x1p54,  0x1p58,  0x1p62, 0x1p100};
  uint64_t seed = 100;
  for (double sc : scales) {
    PhiloxStream rng(seed++, 5);
    std::vector<float> x(static_cast<size_t>(M * K));
    for (float& v : x) v = static_cast<float>(rng.next_normal() * sc);
    expect_2level_equal(to_bf16(x), M, K);
    // Mixed magnitudes: every 16-block gets its own factor 2^-30 .. 2^30 (inner scales from 448
    // down through E4M3 subnormals to 0).
    float f = 1.0f;
    for (size_t i = 0; i < x.size(); ++i) {
      if (i % 16 == 0) f = static_cast<float>(std::exp2(static_cast<double>(rng.next_below(61)) - 30.0));
      x[i] = static_cast<float>(rng.next_normal() * sc) * f;
    }
    expect_2level_equal(to_bf16(x), M, K);
  }
}

TEST(Avx512Rows, TwoLevelBf16PlantedOnAndAroundEveryThreshold) {
  // Quantize a mixed-magnitude input with the reference, scan each block's thresholds C_k from
  // its sp, keep the block's largest element and replace the other 15 by C_k - 1, C_k, C_k + 1
  // (random signs) below that maximum, so all scales stay the same (checked).
  const int64_t M = 4, K = 512;
  for (uint64_t seed : {31u, 32u}) {
    PhiloxStream rng(seed, 6);
    std::vector<uint16_t> x(static_cast<size_t>(M * K));
    float f = 1.0f;
    for (size_t i = 0; i < x.size(); ++i) {
      if (i % 16 == 0) f = static_cast<float>(std::exp2(static_cast<double>(rng.next_below(13)) - 6.0));
      x[i] = f32_to_bf16_bits(static_cast<float>(rng.next_normal()) * f);
    }
    std::vector<uint8_t> c_ref(static_cast<size_t>(M * K / 2)), i_ref(static_cast<size_t>(M * K / 16));
    std::vector<float> o_ref(static_cast<size_t>(M * K / 128));
    for (int64_t o = 0; o < M * K / 128; ++o)
      o_ref[static_cast<size_t>(o)] = nvfp4_2level_quantize_block128(c_ref.data() + 64 * o, i_ref.data() + 8 * o, x.data() + 128 * o, 128);
    std::vector<std::vector<uint16_t>> cands(static_cast<size_t>(M * K / 16));
    std::vector<int> keep(static_cast<size_t>(M * K / 16));
    for (int64_t b = 0; b < M * K / 16; ++b) {
      const float sp = nvfp4_2level_block_scale(i_ref[static_cast<size_t>(b)], o_ref[static_cast<size_t>(b / 8)]);
      uint16_t* xb = x.data() + 16 * b;
      int kp = 0;
      for (int i = 1; i < 16; ++i) kp = (xb[i] & 0x7FFF) > (xb[kp] & 0x7FFF) ? i : kp;
      keep[static_cast<size_t>(b)] = kp;
      if (sp == 0.0f) continue;
      const std::vector<uint16_t> c = scan_thresholds(sp);
      for (int k = 1; k <= 7; ++k)
        for (int d = -1; d <= 1; ++d) {
          const uint16_t p = static_cast<uint16_t>(c[static_cast<size_t>(k)] + d);
          if (c[static_cast<size_t>(k)] < 0x7F80 && p < (xb[kp] & 0x7FFF)) cands[static_cast<size_t>(b)].push_back(p);
        }
    }
    for (int pass = 0; pass < 2; ++pass) {
      int64_t planted = 0, possible = 0;
      std::vector<uint16_t> y = x;
      for (int64_t b = 0; b < M * K / 16; ++b) {
        const auto& cb = cands[static_cast<size_t>(b)];
        possible += static_cast<int64_t>(cb.size());
        for (int i = 0, j = 0; i < 16 && !cb.empty(); ++i) {
          if (i == keep[static_cast<size_t>(b)]) continue;
          const uint16_t p = cb[(static_cast<size_t>(j++) + static_cast<size_t>(pass) * 15) % cb.size()];
          y[static_cast<size_t>(16 * b + i)] = static_cast<uint16_t>(p | (rng.next_below(2) ? 0x8000 : 0));
          ++planted;
        }
      }
      EXPECT_GT(possible, 21 * (M * K / 16) / 2);  // most blocks have all 7 thresholds below their max
      EXPECT_GT(planted, 12 * (M * K / 16));
      std::vector<uint8_t> c2(c_ref.size()), i2(i_ref.size());
      for (int64_t o = 0; o < M * K / 128; ++o) {
        const float so = nvfp4_2level_quantize_block128(c2.data() + 64 * o, i2.data() + 8 * o, y.data() + 128 * o, 128);
        ASSERT_EQ(float_as_u32(so), float_as_u32(o_ref[static_cast<size_t>(o)]));
      }
      ASSERT_EQ(i2, i_ref);  // same scales: the planted values sit on the scanned thresholds
      expect_2level_equal(y, M, K);
    }
  }
}

TEST(Avx512Rows, TwoLevelBf16EveryPatternForManyBlockScales) {
  // For each (A, B): every 128-block has A (the outer amax) as its first element and B as the
  // first element of blocks 1..7; all other elements run through every positive BF16 pattern
  // from 0 to B (random signs). So every magnitude that can occur in a block of scale
  // sp = sp(B, so(A)) is quantized, on the vector path when sp is in [2^-60, 2^60].
  PhiloxStream rng(41, 7);
  std::vector<std::pair<uint16_t, uint16_t>> cases;
  auto bf = [](double v) { return f32_to_bf16_bits(static_cast<float>(v)); };
  // Outer maxima from so's lower to upper end of the range (and a little beyond).
  std::vector<uint16_t> outers = {bf(6 * 0x1p-60), bf(0x1p-50), bf(0x1p-40), bf(2688 * 0x1p-51), bf(1.0),
                                  bf(448.0),       bf(2688.0),  bf(0x1p40),  bf(6 * 0x1p60),     bf(0x1p62)};
  for (int i = 0; i < 30; ++i) outers.push_back(static_cast<uint16_t>(0x2200 + rng.next_below(0x5D80 - 0x2200)));
  for (uint16_t a : outers) {
    cases.push_back({a, a});                    // the max block: inner scale 448
    cases.push_back({a, static_cast<uint16_t>(a - 1)});
    for (int j = 0; j < 6; ++j) {               // inner scales from 448 down to E4M3 subnormals and 0
      const int sh = static_cast<int>(rng.next_below(23));  // ratio 2^0 .. 2^-22 (448 * 2^-19 < half of 2^-9)
      const int b = static_cast<int>(a) - (sh << 7) - static_cast<int>(rng.next_below(128));
      cases.push_back({a, static_cast<uint16_t>(b > 0 ? b : 1)});
    }
  }
  int in_range = 0, sub = 0, zero = 0, full = 0, tiny_sp = 0, huge_sp = 0;
  for (const auto& [a, b] : cases) {
    const float so = nvfp4_2level_outer_scale(bf16_bits_to_f32(a));
    const uint32_t si = nvfp4_2level_inner_scale(bf16_bits_to_f32(b), so);
    const float sp = nvfp4_2level_block_scale(si, so);
    in_range += (sp >= 0x1p-60f && sp <= 0x1p60f) || sp == 0.0f;
    sub += si >= 1 && si < 8;
    zero += si == 0;
    full += si == 0x7E;
    tiny_sp += sp >= 0x1p-60f && sp < 0x1p-50f;
    huge_sp += sp > 0x1p50f && sp <= 0x1p60f;
    std::vector<uint16_t> x;
    uint32_t p = 0;
    while (p <= b) {
      for (int blk = 0; blk < 8; ++blk)
        for (int i = 0; i < 16; ++i) {
          uint16_t v;
          if (i == 0) {
            v = blk == 0 ? a : b;
          } else {
            v = static_cast<uint16_t>(p <= b ? p : 0);
            ++p;
          }
          x.push_back(static_cast<uint16_t>(v | (rng.next_below(2) ? 0x8000 : 0)));
        }
    }
    while (x.size() % 256 != 0) x.push_back(0);
    expect_2level_equal(x, 1, static_cast<int64_t>(x.size()));
    if (::testing::Test::HasFatalFailure()) {
      ADD_FAILURE() << "A=0x" << std::hex << a << " B=0x" << b;
      return;
    }
  }
  EXPECT_GE(static_cast<int>(cases.size()), 300);
  EXPECT_GE(in_range, 250);
  EXPECT_GT(sub, 10);
  EXPECT_GT(zero, 10);
  EXPECT_GT(full, 30);
  EXPECT_GT(tiny_sp, 5);
  EXPECT_GT(huge_sp, 5);
}

TEST(Avx512Rows, TwoLevelBf16EveryThresholdOfEveryInRangeBlockScale) {
  // sp = fl(e4m3(si) * so) with so from a BF16 outer amax A: every A whose so keeps the maximum
  // block's sp in [2^-60, 2^60] (about 15k patterns) times every inner byte si = 1..126 is
  // every nonzero block scale the vector path can see (about 1.8M). Each (A, si) gets one 16-block:
  // its maximum B (a BF16 with inner scale si under so), then for k = 1..7 the patterns C_k - 1 and
  // C_k (those <= B), random signs. C_k is found with the reference alone: it lies among t - 1 ..
  // t + 2, t = fl(T_k * sp) truncated to BF16 (asserted by the reference index at both ends;
  // monotone by the scans above). Each 128-block starts with A, so its outer scale is so.
  static const float kT[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  PhiloxStream rng(61, 9);
  const uint32_t a_lo = f32_to_bf16_bits(6 * 0x1p-60f), a_hi = f32_to_bf16_bits(6 * 0x1p60f);
  int64_t scales = 0, no_b = 0, planted = 0;
  for (uint32_t a0 = a_lo; a0 <= a_hi; a0 += 1024) {
    std::vector<uint16_t> x;
    for (uint32_t a = a0; a < a0 + 1024 && a <= a_hi; ++a) {
      const float so = nvfp4_2level_outer_scale(bf16_bits_to_f32(static_cast<uint16_t>(a)));
      for (uint32_t si = 1; si <= 126; ++si) {
        if (x.size() % 128 == 0) x.push_back(static_cast<uint16_t>(a));  // block of the outer maximum
        const float sp = nvfp4_2level_block_scale(si, so);
        if (!(sp >= 0x1p-60f && sp <= 0x1p60f)) continue;
        // A BF16 B <= A with inner scale si (next to si * 6 * so).
        const uint32_t b0 = f32_to_bf16_bits(e4m3_decode(si) * so * 6.0f);
        uint32_t bmax = 0;
        for (uint32_t d : {0u, 1u, 2u, 3u})
          for (uint32_t b : {b0 - d, b0 + d})
            if (bmax == 0 && b <= a && nvfp4_2level_inner_scale(bf16_bits_to_f32(static_cast<uint16_t>(b)), so) == si) bmax = b;
        if (bmax == 0) {
          ++no_b;
          continue;
        }
        ++scales;
        std::vector<uint16_t> blk = {static_cast<uint16_t>(bmax)};
        for (int k = 1; k <= 7; ++k) {
          const uint32_t t = float_as_u32(kT[k - 1] * sp) >> 16;
          ASSERT_LT(ref_index(static_cast<uint16_t>(t - 1), sp), static_cast<uint32_t>(k));
          ASSERT_GE(ref_index(static_cast<uint16_t>(t + 2), sp), static_cast<uint32_t>(k));
          uint32_t c = t - 1;
          while (ref_index(static_cast<uint16_t>(c), sp) < static_cast<uint32_t>(k)) ++c;
          for (uint32_t p : {c - 1, c})
            if (p <= bmax) blk.push_back(static_cast<uint16_t>(p));
        }
        planted += static_cast<int64_t>(blk.size()) - 1;
        blk.resize(16, 0);
        for (uint16_t v : blk) x.push_back(static_cast<uint16_t>(v | (rng.next_below(2) ? 0x8000 : 0)));
        while (x.size() % 16 != 0) x.push_back(0);
      }
      while (x.size() % 128 != 0) x.push_back(0);  // the next A starts a new 128-block
    }
    while (x.size() % 256 != 0) x.push_back(0);
    expect_2level_equal(x, 1, static_cast<int64_t>(x.size()));
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_GT(scales, 1500000);
  EXPECT_LT(no_b, scales / 100);
  EXPECT_GT(planted, scales * 12);
}

TEST(Avx512Rows, TwoLevelBf16SpecialBlocks) {
  // 16-blocks of: signed zeros; all-equal values; BF16 subnormals (alone or next to normals);
  // nonzero values below 2^-60 next to normal ones; huge values (above 2^60: the group's scales
  // leave the range and it takes the fallback; up to 2^60 it stays on the vector path); -0.0
  // among normals; N(0,1); largest finite BF16.
  const int64_t M = 8, K = 2048;
  PhiloxStream rng(51, 8);
  std::vector<uint16_t> x(static_cast<size_t>(M * K));
  for (int64_t b = 0; b < M * K / 16; ++b) {
    const int mode = static_cast<int>(rng.next_below(9));
    const uint16_t eq = static_cast<uint16_t>(rng.next_below(0x7F80));
    for (int i = 0; i < 16; ++i) {
      const uint16_t s = rng.next_below(2) ? 0x8000 : 0;
      uint16_t v;
      switch (mode) {
        case 0: v = s; break;                                                               // +-0
        case 1: v = static_cast<uint16_t>(eq | (rng.next_below(4) == 0 ? s : 0)); break;  // all equal
        case 2: v = static_cast<uint16_t>(rng.next_below(0x80) | s); break;                // subnormal
        case 3: v = static_cast<uint16_t>((i == 5 ? 0x3F80 : rng.next_below(0x80)) | s); break;
        case 4: v = static_cast<uint16_t>((i == 0 ? 0x2000 + rng.next_below(0x1000) : rng.next_below(0x2180)) | s); break;
        case 5: v = static_cast<uint16_t>((0x5C00 + rng.next_below(0x200)) | s); break;    // 2^57 .. 2^61
        case 6: v = static_cast<uint16_t>((rng.next_below(3) == 0 ? 0x8000 : f32_to_bf16_bits(static_cast<float>(rng.next_normal()))) | s); break;
        case 7: v = static_cast<uint16_t>(i == 3 ? 0x7F7F | s : f32_to_bf16_bits(static_cast<float>(rng.next_normal()))); break;
        default: v = static_cast<uint16_t>(f32_to_bf16_bits(static_cast<float>(rng.next_normal() * 1e3)) ^ s); break;
      }
      x[static_cast<size_t>(16 * b + i)] = v;
    }
  }
  expect_2level_equal(x, M, K);
  // The same with a whole row of each mode (no large neighbour to set the outer scale).
  for (int mode = 0; mode < 4; ++mode) {
    std::vector<uint16_t> y(static_cast<size_t>(2 * 512));
    for (size_t i = 0; i < y.size(); ++i) {
      const uint16_t s = rng.next_below(2) ? 0x8000 : 0;
      y[i] = static_cast<uint16_t>((mode == 0 ? 0 : mode == 1 ? 0x0001 : mode == 2 ? rng.next_below(0x80) : 0x4040) | s);
    }
    expect_2level_equal(y, 2, 512);
  }
  // Row lengths with a lone last 128-block, and with a 16-group chunk plus one group.
  for (int64_t k : {int64_t{384}, int64_t{4352}}) {
    std::vector<float> z(static_cast<size_t>(3 * k));
    for (float& v : z) v = static_cast<float>(rng.next_normal());
    expect_2level_equal(to_bf16(z), 3, k);
  }
}

// ---- TE RTN, BF16 input: the threshold-search kernel --------------------------------------------
// (quantize_cpu_avx512.h derives, per block encode factor enc, the smallest BF16 magnitudes C_k
// whose index is >= k (k = 1..7) and C_0, the smallest whose negative gets the sign bit, from a
// window checked with the reference multiply; these tests compare every byte with the per-block
// functions.)

// The reference index and sign bit of BF16 magnitude pattern p under enc.
uint32_t te_ref_index(uint32_t p, float enc) { return nvfp4_te_encode_rtn(bf16_bits_to_f32(static_cast<uint16_t>(p)), enc) & 7u; }
uint32_t te_ref_sign(uint32_t p, float enc) {
  return nvfp4_te_encode_rtn(-bf16_bits_to_f32(static_cast<uint16_t>(p)), enc) >> 3;
}
// C_0..C_7 by binary search over the patterns 0 .. 0x7F80 (the predicates are monotone: checked by
// full scans in TeBf16ThresholdsAreMonotone); 0x7F81 = never.
std::vector<uint32_t> te_thresholds(float enc) {
  std::vector<uint32_t> c(8);
  for (uint32_t k = 0; k < 8; ++k) {
    auto holds = [&](uint32_t p) { return k == 0 ? te_ref_sign(p, enc) == 1 : te_ref_index(p, enc) >= k; };
    uint32_t lo = 0, hi = 0x7F81;  // smallest p in [lo, hi) with holds(p), hi if none
    while (lo < hi) {
      const uint32_t mid = (lo + hi) / 2;
      if (holds(mid)) hi = mid; else lo = mid + 1;
    }
    c[k] = lo;
  }
  return c;
}

TEST(Avx512Rows, TeBf16ThresholdsAreMonotone) {
  // The kernel's premise: along the BF16 magnitude patterns the reference index and the sign bit
  // of the negative never decrease (and te_thresholds finds the steps). Every pattern, for block
  // encode factors from regular scales, zero scales (enc = FLT_MAX) and huge block maxima.
  PhiloxStream rng(71, 10);
  std::vector<float> encs = {kFltMax, 1.0f, 0x1p-17f, 0x1p-40f, 0x1p64f, 0x1p100f, 2.0f / 3.0f};
  for (int i = 0; i < 24; ++i) {
    const Nvfp4TeGlobal g = nvfp4_te_global(bf16_bits_to_f32(static_cast<uint16_t>(0x0100 + rng.next_below(0x7E00))));
    encs.push_back(nvfp4_te_block_enc(rng.next_below(127), g));
  }
  for (float enc : encs) {
    const std::vector<uint32_t> c = te_thresholds(enc);
    uint32_t prev_idx = 0, prev_sign = 0;
    for (uint32_t p = 0; p <= 0x7F80; ++p) {
      const uint32_t idx = te_ref_index(p, enc), sign = te_ref_sign(p, enc);
      ASSERT_GE(idx, prev_idx) << "enc=" << enc << " p=" << p;
      ASSERT_GE(sign, prev_sign) << "enc=" << enc << " p=" << p;
      for (uint32_t k = 1; k <= 7; ++k) ASSERT_EQ(idx >= k, p >= c[k]) << "enc=" << enc << " p=" << p << " k=" << k;
      ASSERT_EQ(sign == 1, p >= c[0]) << "enc=" << enc << " p=" << p;
      prev_idx = idx;
      prev_sign = sign;
    }
  }
}

TEST(Avx512Rows, TeBf16EveryThresholdOfEveryBlockScale) {
  // For each tensor amax A (a quarter of all positive finite BF16 patterns, from a random offset,
  // and the ends) and each scale byte s = 0 .. 126 that some BF16 block maximum B <= A reaches, one
  // 16-block: B, then C_k - 1 and C_k (those <= B) for k = 1..7 with random signs and for k = 0
  // negative. The row starts with A (so the tensor amax is A) and holds every (A, s) block; this
  // covers regular blocks, zero scales (enc = FLT_MAX) and huge block maxima (C_0 > 1).
  PhiloxStream rng(72, 11);
  std::vector<uint32_t> amaxes = {0x0001, 0x0080, 0x3F80, 0x7F7F};
  for (uint32_t a = 1 + static_cast<uint32_t>(rng.next_below(4)); a < 0x7F80; a += 4) amaxes.push_back(a);
  int64_t blocks = 0, planted = 0, zero_scale = 0, huge = 0, signs_above_1 = 0;
  std::vector<uint16_t> x;
  for (uint32_t a : amaxes) {
    const float af = bf16_bits_to_f32(static_cast<uint16_t>(a));
    const Nvfp4TeGlobal g = nvfp4_te_global(af);
    x.assign(16, 0);
    x[0] = static_cast<uint16_t>(a);
    for (uint32_t sc = 0; sc <= 126; ++sc) {
      // A BF16 B <= A with block scale sc: search next to the value that maps to sc.
      const float target = sc == 0 ? 0.0f : e4m3_decode(sc) / g.m;
      const uint32_t b0 = std::min<uint32_t>(f32_to_bf16_bits(target), a);
      uint32_t bmax = 0xFFFFFFFFu;
      for (uint32_t d : {0u, 1u, 2u, 3u, 4u})
        for (uint32_t b : {b0 - d, b0 + d})
          if (bmax == 0xFFFFFFFFu && b <= a && b > 0 && nvfp4_te_block_scale(bf16_bits_to_f32(static_cast<uint16_t>(b)), g) == sc)
            bmax = b;
      if (bmax == 0xFFFFFFFFu) continue;
      const float enc = nvfp4_te_block_enc(sc, g);
      const std::vector<uint32_t> c = te_thresholds(enc);
      ++blocks;
      zero_scale += sc == 0;
      huge += enc <= 0x1p-17f;
      signs_above_1 += c[0] > 1;
      std::vector<uint16_t> blk = {static_cast<uint16_t>(bmax)};
      for (uint32_t k = 0; k <= 7; ++k)
        for (uint32_t p : {c[k] - 1, c[k]})
          if (c[k] >= 1 && p <= bmax) {
            const bool neg = k == 0 || rng.next_below(2) != 0;
            blk.push_back(static_cast<uint16_t>(p | (neg ? 0x8000u : 0u)));
          }
      planted += static_cast<int64_t>(blk.size()) - 1;
      blk.resize(16, 0);
      x.insert(x.end(), blk.begin(), blk.end());
    }
    while (x.size() % 256 != 0) x.push_back(0);
    expect_te_equal(x, 1, static_cast<int64_t>(x.size()));
    if (::testing::Test::HasFatalFailure()) {
      ADD_FAILURE() << "A=0x" << std::hex << a;
      return;
    }
  }
  EXPECT_GT(blocks, 700000);
  EXPECT_GT(planted, blocks * 12);
  EXPECT_GT(zero_scale, 5000);
  EXPECT_GT(huge, 10000);
  EXPECT_GT(signs_above_1, 10000);
}

TEST(Avx512Rows, TeBf16SpecialBlocks) {
  // 16-blocks of: signed zeros; all-equal values; BF16 subnormals next to normals; values far
  // below the tensor amax (block scale 0: codes +-6, or E4M3-subnormal scales); tiny values under
  // a huge block maximum (negative ones whose scaled value underflows to -0.0 get no sign bit);
  // Inf; N(0,1). Regular and irregular blocks share groups.
  const int64_t M = 8, K = 2048;
  PhiloxStream rng(73, 12);
  for (float tensor_max : {1.0f, 0x1p40f, 0x1p100f, 0x1p-100f, 3e38f}) {
    std::vector<uint16_t> x(static_cast<size_t>(M * K));
    for (int64_t b = 0; b < M * K / 16; ++b) {
      const int mode = static_cast<int>(rng.next_below(9));
      const uint16_t eq = static_cast<uint16_t>(rng.next_below(0x7F80));
      const float f = tensor_max * static_cast<float>(std::exp2(-static_cast<double>(rng.next_below(40))));
      for (int i = 0; i < 16; ++i) {
        const uint16_t s = rng.next_below(2) ? 0x8000 : 0;
        uint16_t v;
        switch (mode) {
          case 0: v = s; break;
          case 1: v = static_cast<uint16_t>(eq | s); break;
          case 2: v = static_cast<uint16_t>((i == 5 ? f32_to_bf16_bits(f) : rng.next_below(0x80)) | s); break;
          case 3: v = static_cast<uint16_t>(f32_to_bf16_bits(static_cast<float>(rng.next_normal()) * tensor_max * 0x1p-30f) | s); break;
          case 4: v = static_cast<uint16_t>((i == 0 ? f32_to_bf16_bits(f) : rng.next_below(0x0400)) | s); break;
          case 5: v = static_cast<uint16_t>(i == 7 ? 0x7F80 | s : f32_to_bf16_bits(static_cast<float>(rng.next_normal()) * f)); break;
          default: v = static_cast<uint16_t>(f32_to_bf16_bits(static_cast<float>(rng.next_normal()) * f) ^ s); break;
        }
        x[static_cast<size_t>(16 * b + i)] = v;
      }
    }
    x[3] = f32_to_bf16_bits(tensor_max);  // the tensor amax (unless an Inf block is larger)
    expect_te_equal(x, M, K);
    if (::testing::Test::HasFatalFailure()) {
      ADD_FAILURE() << "tensor_max=" << tensor_max;
      return;
    }
  }
}

// ---- MX RTN, BF16 input (quantize_cpu_avx512_mx.h) ----------------------------------------------

// Quantizes x (one row) with the driver and compares every byte with the per-block functions.
void expect_mx_equal(const std::vector<uint16_t>& x, MxScaleRule rule, bool fp8) {
  const int64_t K = static_cast<int64_t>(x.size());
  std::vector<uint8_t> out(static_cast<size_t>(fp8 ? K : K / 2)), scales(static_cast<size_t>(K / 32));
  if (fp8)
    mxfp8_quantize_cpu(out.data(), scales.data(), x.data(), 1, K, rule);
  else
    mxfp4_quantize_cpu(out.data(), scales.data(), x.data(), 1, K, rule);
  std::vector<uint8_t> o_ref(out.size()), s_ref(scales.size());
  for (int64_t b = 0; b < K / 32; ++b)
    s_ref[static_cast<size_t>(b)] = static_cast<uint8_t>(
        fp8 ? mxfp8_quantize_block32(o_ref.data() + 32 * b, x.data() + 32 * b, rule)
            : mxfp4_quantize_block32(o_ref.data() + 16 * b, x.data() + 32 * b, rule));
  ASSERT_EQ(scales, s_ref);
  for (size_t i = 0; i < out.size(); ++i)
    ASSERT_EQ(out[i], o_ref[i]) << "byte " << i << " (block " << i / (fp8 ? 32 : 16) << ", scale "
                                << int(s_ref[i / (fp8 ? 32 : 16)]) << ")";
}

TEST(Avx512Rows, MxBf16EveryMagnitudeUnderEveryScale) {
  // For each rule and each scale byte some BF16 block maximum reaches: blocks led by the smallest
  // and by the largest such maximum B, the other 31 elements running through every BF16 magnitude
  // from 0 to B (random signs), so every element the kernels can see next to that scale is
  // quantized (MXFP4: every threshold C_k and the te-ceil sign threshold; MXFP8: every rounding
  // case, E4M3 subnormals, saturation). Rows are padded with zero blocks to whole 512-groups.
  PhiloxStream rng(81, 13);
  const std::pair<MxScaleRule, bool> cases[] = {{MxScaleRule::kFloor, false}, {MxScaleRule::kRceil, false},
                                                {MxScaleRule::kTeCeil, false}, {MxScaleRule::kFloor, true},
                                                {MxScaleRule::kRceil, true}};
  for (const auto& [rule, fp8] : cases) {
    std::vector<uint32_t> lo(256, 0xFFFFFFFFu), hi(256, 0);
    for (uint32_t p = 0; p <= 0x7F7F; ++p) {
      const float v = bf16_bits_to_f32(static_cast<uint16_t>(p));
      const uint32_t byte = fp8 ? mxfp8_scale_byte(v, rule) : mxfp4_scale_byte(v, rule);
      lo[byte] = std::min(lo[byte], p);
      hi[byte] = std::max(hi[byte], p);
    }
    int scales_seen = 0;
    std::vector<uint16_t> x;
    for (uint32_t byte = 0; byte < 256; ++byte) {
      if (lo[byte] == 0xFFFFFFFFu) continue;
      ++scales_seen;
      for (uint32_t bmax : {lo[byte], hi[byte]}) {
        uint32_t p = 0;
        do {
          x.push_back(static_cast<uint16_t>(bmax | (rng.next_below(2) ? 0x8000u : 0u)));
          for (int i = 1; i < 32; ++i, ++p)
            x.push_back(static_cast<uint16_t>((p <= bmax ? p : 0) | (rng.next_below(2) ? 0x8000u : 0u)));
        } while (p <= bmax);
      }
    }
    while (x.size() % 512 != 0) x.push_back(0);
    EXPECT_GT(scales_seen, 240) << int(rule) << fp8;
    expect_mx_equal(x, rule, fp8);
    if (::testing::Test::HasFatalFailure()) {
      ADD_FAILURE() << "rule " << int(rule) << " fp8 " << fp8;
      return;
    }
  }
}

TEST(Avx512Rows, MxBf16SpecialBlocks) {
  // 32-blocks of: signed zeros; BF16 subnormals alone (MXFP8 blocks with byte < 11: the group
  // takes the per-block functions) or next to normals; N(0,1) at scales 2^-130 .. 2^127; NaN and
  // Inf (fallback groups); the largest finite BF16; ties of the unit grids. Groups mix them.
  PhiloxStream rng(82, 14);
  std::vector<uint16_t> x(static_cast<size_t>(64 * 512));
  for (size_t b = 0; b < x.size() / 32; ++b) {
    const int mode = static_cast<int>(rng.next_below(8));
    const double f = std::exp2(static_cast<double>(rng.next_below(258)) - 130.0);
    for (int i = 0; i < 32; ++i) {
      const uint16_t s = rng.next_below(2) ? 0x8000 : 0;
      uint16_t v;
      switch (mode) {
        case 0: v = s; break;
        case 1: v = static_cast<uint16_t>(rng.next_below(0x80) | s); break;
        case 2: v = static_cast<uint16_t>((i == 9 ? f32_to_bf16_bits(static_cast<float>(f)) : rng.next_below(0x80)) | s); break;
        case 3: v = static_cast<uint16_t>(i == 4 && rng.next_below(8) == 0 ? (rng.next_below(2) ? 0x7FC0 : 0x7F80) | s
                                                                         : f32_to_bf16_bits(static_cast<float>(rng.next_normal() * f)) ^ s); break;
        case 4: v = static_cast<uint16_t>((i == 0 ? 0x7F7F : f32_to_bf16_bits(static_cast<float>(rng.next_normal() * f))) ^ s); break;
        case 5: {
          static const float kTies[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f, 448.0f, 464.0f, 480.0f, 0x1p-10f, 0x1p-7f};
          v = static_cast<uint16_t>(f32_to_bf16_bits(kTies[rng.next_below(13)] * static_cast<float>(std::exp2(static_cast<double>(rng.next_below(9)) - 4.0))) | s);
          break;
        }
        default: v = static_cast<uint16_t>(f32_to_bf16_bits(static_cast<float>(rng.next_normal() * f)) ^ s); break;
      }
      x[32 * b + static_cast<size_t>(i)] = v;
    }
  }
  for (MxScaleRule rule : {MxScaleRule::kFloor, MxScaleRule::kRceil, MxScaleRule::kTeCeil}) {
    expect_mx_equal(x, rule, false);
    if (rule != MxScaleRule::kTeCeil) expect_mx_equal(x, rule, true);
  }
  // A row whose length leaves a tail of single blocks after the 512-groups.
  std::vector<uint16_t> y(x.begin(), x.begin() + 512 * 3 + 32 * 5);
  expect_mx_equal(y, MxScaleRule::kTeCeil, false);
  expect_mx_equal(y, MxScaleRule::kRceil, true);
}

}  // namespace
}  // namespace nibble::formats
