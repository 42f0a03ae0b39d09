// Tests of the AVX-512 RTN row kernels (quantize_cpu_avx512.h) through the public drivers: inputs
// built so that most 256-element groups stay on the streamlined path (finite, |x| in [2^-60,
// 2^60] or 0) and still hit every branch of the element and scale steps (exact E2M1 ties,
// +-0.0, all-zero blocks, E4M3-subnormal block scales, saturating scale round-down, Inf for TE),
// mixed with groups that must take the per-block fallback (NaN, Inf, huge, tiny); every byte is
// compared with the per-block functions of nvfp4.h. On builds without AVX-512 the same drivers
// run the portable paths and the test checks those.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/bits.h"
#include "core/philox.h"
#include "formats/quantize_cpu.h"

namespace nibble::formats {
namespace {

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

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = f32_to_bf16_bits(x[i]);
  return b;
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

}  // namespace
}  // namespace nibble::formats
