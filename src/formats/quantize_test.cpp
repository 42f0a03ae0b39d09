// Whole-tensor quantizer tests: the CPU drivers (vectorised paths included) equal the host+device
// per-block functions the GPU runs, bit for bit, on inputs full of edge values; the documented
// edge-case behaviour (zero blocks/tensors, E4M3-subnormal scales, saturation, huge/tiny
// magnitudes, NaN/Inf inputs, -0.0 sign conventions; docs/formats.md) for every family.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/bits.h"
#include "core/philox.h"
#include "formats/bf16_test_util.h"
#include "formats/quantize_cpu.h"

namespace nibble::formats {
namespace {

using testing::to_bf16;

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// N(0,1) values times a per-16-block lognormal factor, sprinkled with -0.0, exact ties,
// FP32 subnormals and huge values: exercises every branch of the scale and element paths.
std::vector<float> edge_input(int64_t n, uint64_t seed) {
  PhiloxStream rng(seed, 11);
  std::vector<float> x(static_cast<size_t>(n));
  float f = 1.0f;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 16 == 0) f = static_cast<float>(std::exp(4.0 * rng.next_normal()));
    double v = rng.next_normal() * f;
    switch (rng.next_below(20)) {
      case 0: v = -0.0; break;
      case 1: v = 0.0; break;
      case 2: v = (rng.next_below(2) ? -1 : 1) * 1e-40; break;          // FP32 subnormal
      case 3: v = (rng.next_below(2) ? -1 : 1) * 0.25 * (1 + rng.next_below(24)); break;  // ties
      case 4: v = (rng.next_below(2) ? -1 : 1) * 1e37; break;
      default: break;
    }
    x[static_cast<size_t>(i)] = static_cast<float>(v);
  }
  return x;
}

template <typename In>
void check_te_matches_block_functions(const std::vector<In>& x, int64_t M, int64_t K, const SrKey* sr) {
  std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), scales(static_cast<size_t>(M * K / 16));
  float amax = nvfp4_te_quantize_cpu(codes.data(), scales.data(), x.data(), M, K, sr);
  float amax_ref = 0.0f;
  for (const In& v : x) amax_ref = amax_update(amax_ref, load_f32(v));
  ASSERT_EQ(float_as_u32(amax), float_as_u32(amax_ref));
  Nvfp4TeGlobal g = nvfp4_te_global(amax_ref);
  std::vector<uint8_t> c_ref(codes.size());
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < K / 16; ++b) {
      const In* xb = x.data() + r * K + 16 * b;
      uint32_t s = nvfp4_te_quantize_block16(c_ref.data() + r * K / 2 + 8 * b, xb, block_amax(xb, 16), g, sr,
                                             static_cast<uint64_t>(r * K + 16 * b));
      ASSERT_EQ(scales[static_cast<size_t>(r * K / 16 + b)], s) << r << "," << b;
    }
  ASSERT_EQ(codes, c_ref);
}

template <typename In>
void check_2level_matches_block_functions(const std::vector<In>& x, int64_t M, int64_t K, const SrKey* sr) {
  int64_t no = (K + 127) / 128;
  std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), inner(static_cast<size_t>(M * K / 16));
  std::vector<float> outer(static_cast<size_t>(M * no));
  nvfp4_2level_quantize_cpu(codes.data(), inner.data(), outer.data(), x.data(), M, K, sr);
  std::vector<uint8_t> c_ref(codes.size()), i_ref(inner.size());
  for (int64_t r = 0; r < M; ++r)
    for (int64_t o = 0; o < no; ++o) {
      int n = static_cast<int>(std::min<int64_t>(128, K - 128 * o));
      float so = nvfp4_2level_quantize_block128(c_ref.data() + r * K / 2 + 64 * o, i_ref.data() + r * K / 16 + 8 * o,
                                                x.data() + r * K + 128 * o, n, sr, static_cast<uint64_t>(r * K + 128 * o));
      ASSERT_EQ(float_as_u32(outer[static_cast<size_t>(r * no + o)]), float_as_u32(so));
    }
  ASSERT_EQ(inner, i_ref);
  ASSERT_EQ(codes, c_ref);
}

TEST(Drivers, TeEqualsBlockFunctions) {
  SrKey key{77, 3};
  // Whole 16-block groups, remainder blocks, both; short rows (the drivers cut the flat tensor
  // into pieces of 8192 elements, across rows: 784 and 48 x 200 cross piece boundaries mid-row).
  for (int64_t K : {256, 272, 784, 16, 48, 128}) {
    SCOPED_TRACE(K);
    const int64_t M = K == 48 ? 200 : 24;
    std::vector<float> x = edge_input(M * K, 1);
    check_te_matches_block_functions(x, M, K, nullptr);
    check_te_matches_block_functions(to_bf16(x), M, K, nullptr);
    check_te_matches_block_functions(x, M, K, &key);
    check_te_matches_block_functions(to_bf16(x), M, K, &key);
  }
}

TEST(Drivers, VectorIndexEqualsScalarOnThresholdNeighbours) {
  // Rows of 16-blocks [6, v1..v15] with amax = 2688: S_enc = 1, block scale E4M3(1) = 1, enc = 1,
  // so the scaled values are exactly the v's: every E2M1 threshold, grid point and SR step
  // boundary with its float neighbours, both signs, +-0, NaN, Inf-free huge values.
  std::vector<float> vals;
  for (float t : {0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f, 2.0f, 2.5f, 3.0f, 3.5f, 4.0f, 5.0f, 5.99f, 6.0f})
    for (float v : {std::nextafter(t, 0.0f), t, std::nextafter(t, 10.0f)}) {
      vals.push_back(v);
      vals.push_back(-v);
    }
  for (float v : {0.0f, -0.0f, 1e-45f, 0.1f, 5.5f, kNaN, -kNaN}) vals.push_back(v);
  const int64_t K = 256;
  int64_t rows = (static_cast<int64_t>(vals.size()) + 15 * 16 - 1) / (15 * 16);
  std::vector<float> x(static_cast<size_t>(rows * K), 0.0f);
  size_t next = 0;
  for (int64_t i = 0; i < rows * K; ++i) x[i] = i % 16 == 0 ? 6.0f : (next < vals.size() ? vals[next++] : 0.3f);
  std::vector<uint8_t> codes(x.size() / 2), scales(x.size() / 16), c_ref(x.size() / 2);
  SrKey key{5, 5};
  const SrKey* modes[] = {nullptr, &key};
  for (const SrKey* sr : modes) {
    nvfp4_te_quantize_with_amax_cpu(codes.data(), scales.data(), x.data(), rows, K, 2688.0f, sr);
    Nvfp4TeGlobal g = nvfp4_te_global(2688.0f);
    for (int64_t b = 0; b < rows * K / 16; ++b) {
      ASSERT_EQ(scales[b], 0x38);
      nvfp4_te_quantize_block16(c_ref.data() + 8 * b, x.data() + 16 * b, 6.0f, g, sr, static_cast<uint64_t>(16 * b));
    }
    ASSERT_EQ(codes, c_ref);
  }
}

TEST(Drivers, TwoLevelEqualsBlockFunctions) {
  SrKey key{78, 4};
  // Whole 128-blocks, a partial last block, a single partial block; rows of one 128-block and of
  // three (flat pieces of 8192 elements cut the 40 x 384 tensor mid-row).
  for (int64_t K : {256, 272, 48, 128, 384}) {
    SCOPED_TRACE(K);
    const int64_t M = K == 384 ? 40 : 12;
    std::vector<float> x = edge_input(M * K, 2);
    check_2level_matches_block_functions(x, M, K, nullptr);
    check_2level_matches_block_functions(to_bf16(x), M, K, nullptr);
    check_2level_matches_block_functions(x, M, K, &key);
    check_2level_matches_block_functions(to_bf16(x), M, K, &key);
  }
}

TEST(Drivers, PartialLast128BlockEqualsZeroPadding) {
  // A row of K = 144 equals the first 144 columns of the zero-padded row of 256.
  const int64_t K = 144, Kp = 256;
  std::vector<float> x = edge_input(K, 5), xp(Kp, 0.0f);
  std::copy(x.begin(), x.end(), xp.begin());
  std::vector<uint8_t> c(K / 2), i(K / 16), cp(Kp / 2), ip(Kp / 16);
  float o[2], op[2];
  nvfp4_2level_quantize_cpu(c.data(), i.data(), o, x.data(), 1, K);
  nvfp4_2level_quantize_cpu(cp.data(), ip.data(), op, xp.data(), 1, Kp);
  EXPECT_EQ(std::vector<uint8_t>(cp.begin(), cp.begin() + K / 2), c);
  EXPECT_EQ(std::vector<uint8_t>(ip.begin(), ip.begin() + K / 16), i);
  EXPECT_EQ(o[0], op[0]);
  EXPECT_EQ(o[1], op[1]);
}

TEST(Drivers, MxEqualsBlockFunctions) {
  SrKey key{31, 4};
  // 16-block groups (vector path), + remainder, remainder only; short rows; and 12 x 1056, which
  // the drivers' flat pieces of 8192 elements cut mid-row.
  for (int64_t K : {512, 544, 256, 96, 160, 1056}) {
    SCOPED_TRACE(K);
    const int64_t M = K == 1056 ? 12 : 6;
    std::vector<float> x = edge_input(M * K, 3);
    // Row 0: blocks that hit every clamp of the E8M0 rules: all zero, FP32-subnormal only
    // (byte 0 / 1 boundaries), near FLT_MAX (bytes 253..255), tiny normals; plus an Inf block
    // (NaN scale byte), a NaN and a -NaN element.
    for (int i = 0; i < 32; ++i) {
      x[i] = 0.0f;
      x[32 + i] = (i % 2 ? -1.0f : 1.0f) * 1e-40f * static_cast<float>(i + 1);
      x[64 + i] = (i % 3 ? -1.0f : 1.0f) * 3.3e38f * (static_cast<float>(i + 1) / 32.0f);
      x[96 + i] = 1.5e-38f * static_cast<float>(i) / 31.0f;
      x[128 + i] = 0x1.8p-125f * (static_cast<float>(i) / 31.0f);  // te-ceil: d = 2^-127 exactly
      x[160 + i] = 7e37f * static_cast<float>(i) / 31.0f;
    }
    x[200] = kInf;
    x[230] = kNaN;
    x[231] = -kNaN;
    std::vector<uint16_t> xb = to_bf16(x);
    for (MxScaleRule rule : {MxScaleRule::kFloor, MxScaleRule::kRceil, MxScaleRule::kTeCeil}) {
      for (const SrKey* sr : {static_cast<const SrKey*>(nullptr), static_cast<const SrKey*>(&key)}) {
        std::vector<uint8_t> codes(M * K / 2), scales(M * K / 32), c_ref(M * K / 2), codes_b(M * K / 2),
            scales_b(M * K / 32), cb_ref(M * K / 2);
        mxfp4_quantize_cpu(codes.data(), scales.data(), x.data(), M, K, rule, sr);
        mxfp4_quantize_cpu(codes_b.data(), scales_b.data(), xb.data(), M, K, rule, sr);
        for (int64_t b = 0; b < M * K / 32; ++b) {
          ASSERT_EQ(scales[b], mxfp4_quantize_block32(c_ref.data() + 16 * b, x.data() + 32 * b, rule, sr,
                                                      static_cast<uint64_t>(32 * b)));
          ASSERT_EQ(scales_b[b], mxfp4_quantize_block32(cb_ref.data() + 16 * b, xb.data() + 32 * b, rule, sr,
                                                        static_cast<uint64_t>(32 * b)));
        }
        ASSERT_EQ(codes, c_ref);
        ASSERT_EQ(codes_b, cb_ref);
      }
      if (rule == MxScaleRule::kTeCeil) continue;
      std::vector<uint8_t> el(M * K), sc(M * K / 32), el_ref(M * K), elb(M * K), scb(M * K / 32), elb_ref(M * K);
      mxfp8_quantize_cpu(el.data(), sc.data(), x.data(), M, K, rule);
      mxfp8_quantize_cpu(elb.data(), scb.data(), xb.data(), M, K, rule);
      for (int64_t b = 0; b < M * K / 32; ++b) {
        ASSERT_EQ(sc[b], mxfp8_quantize_block32(el_ref.data() + 32 * b, x.data() + 32 * b, rule));
        ASSERT_EQ(scb[b], mxfp8_quantize_block32(elb_ref.data() + 32 * b, xb.data() + 32 * b, rule));
      }
      ASSERT_EQ(el, el_ref);
      ASSERT_EQ(elb, elb_ref);
    }
  }
}

// ---- edge cases -----------------------------------------------------------------------------

TEST(EdgeCases, ZeroTensorAllFamilies) {
  const int64_t M = 2, K = 128;
  std::vector<float> x(M * K, 0.0f);
  x[3] = -0.0f;
  std::vector<uint8_t> codes(M * K / 2), s16(M * K / 16), s32(M * K / 32), e8(M * K);
  std::vector<float> outer(M), y(M * K);
  // TE: amax 0 -> S_enc = FLT_MAX (2688/0 = inf, clamped), scales 0, codes 0 (-0.0 -> 0x0).
  EXPECT_EQ(nvfp4_te_quantize_cpu(codes.data(), s16.data(), x.data(), M, K), 0.0f);
  for (uint8_t c : codes) EXPECT_EQ(c, 0);
  for (uint8_t s : s16) EXPECT_EQ(s, 0);
  nvfp4_te_dequantize_cpu(y.data(), codes.data(), s16.data(), 0.0f, M, K);
  for (float v : y) EXPECT_EQ(float_as_u32(v), 0u);
  // 2-level: s_o = 1, inner 0, codes = sign bit only (-0.0 -> 0x8).
  nvfp4_2level_quantize_cpu(codes.data(), s16.data(), outer.data(), x.data(), M, K);
  EXPECT_EQ(outer[0], 1.0f);
  EXPECT_EQ(codes[1], 0x80);  // element 3 is -0.0: high nibble of byte 1
  EXPECT_EQ(codes[0], 0x00);
  // MX floor/rceil: byte 0 (2^-127), codes 0 / 0x8 for -0.0; te-ceil: byte 0, -0.0 -> 0x0.
  mxfp4_quantize_cpu(codes.data(), s32.data(), x.data(), M, K, MxScaleRule::kFloor);
  EXPECT_EQ(s32[0], 0);
  EXPECT_EQ(codes[1], 0x80);
  mxfp4_quantize_cpu(codes.data(), s32.data(), x.data(), M, K, MxScaleRule::kTeCeil);
  EXPECT_EQ(s32[0], 0);
  EXPECT_EQ(codes[1], 0x00);
  mxfp8_quantize_cpu(e8.data(), s32.data(), x.data(), M, K, MxScaleRule::kRceil);
  EXPECT_EQ(e8[3], 0x80);
  EXPECT_EQ(e8[2], 0x00);
}

TEST(EdgeCases, TeSubnormalAndZeroScales) {
  // amax 2688 -> S_enc = 1, m = fl(1/6): a block with bamax 6 * 2^-9 gets the smallest
  // subnormal scale 0x01; a block with bamax <= 6 * 2^-10 rounds its scale to 0 and saturates.
  std::vector<float> x(48, 0.0f);
  x[0] = 2688.0f;
  x[16] = 6.0f * 0x1p-9f;
  x[17] = -3.0f * 0x1p-9f;
  x[32] = 6.0f * 0x1p-11f;
  x[33] = -1e-30f;
  std::vector<uint8_t> c(24), s(3);
  nvfp4_te_quantize_cpu(c.data(), s.data(), x.data(), 1, 48);
  EXPECT_EQ(s[0], 0x7E);
  EXPECT_EQ(s[1], 0x01);
  EXPECT_EQ(c[8], 0xD7) << "element 16: 6 -> 0x7 (low nibble), element 17: -3 -> 0xD";
  EXPECT_EQ(s[2], 0x00);
  EXPECT_EQ(c[16], 0xF7) << "zero scale: enc = FLT_MAX, non-zero elements saturate to +-6";
  std::vector<float> y(48);
  nvfp4_te_dequantize_cpu(y.data(), c.data(), s.data(), 2688.0f, 1, 48);
  EXPECT_EQ(y[16], 6.0f * 0x1p-9f);
  EXPECT_EQ(y[17], -3.0f * 0x1p-9f);
  EXPECT_EQ(y[32], 0.0f);  // scale 0 dequantizes to +-0
}

TEST(EdgeCases, TeScaleRoundingDownSaturates) {
  // bamax * m rounds down in E4M3 -> |x * enc| slightly above 6 -> saturates to code 7.
  // amax = 2688 (S_enc = 1); bamax = 6 * 4.5 = 27 -> fl(27 * fl(1/6)) = 4.5 -> E4M3 4.5 exact;
  // choose bamax = 6 * 4.6: 4.6 rounds to E4M3 4.5, so 27.6 * (1/4.5) = 6.13 > 6.
  std::vector<float> x(32, 0.0f);
  x[0] = 2688.0f;
  x[16] = 27.6f;
  x[17] = -27.6f;
  std::vector<uint8_t> c(16), s(2);
  nvfp4_te_quantize_cpu(c.data(), s.data(), x.data(), 1, 32);
  EXPECT_EQ(e4m3_decode(s[1]), 4.5f);
  EXPECT_EQ(c[8], 0xF7);
}

TEST(EdgeCases, HugeAndTinyMagnitudes) {
  // Round trip stays within half an E2M1 step plus the scale rounding for every magnitude the
  // formats represent. TE's dequant factor fl(s * amax) overflows for amax > FLT_MAX/448, so TE is
  // checked up to 1e35 (beyond: see TeDequantOverflowIsReferenceBehaviour); below
  // amax = 2688/FLT_MAX (~7.9e-36) S_enc clamps to FLT_MAX while dequant still uses amax/2688, so
  // TE does not round-trip there either (reference behaviour). 2-level: 1e-38 .. 3e38.
  for (float big : {3.0e38f, 1e35f, 1e-30f, 1e-38f}) {
    SCOPED_TRACE(big);
    const bool te_in_range = big <= 1e35f && big >= 1e-35f;
    std::vector<float> x(16);
    for (int i = 0; i < 16; ++i) x[i] = big * ((i - 7.5f) / 7.5f);
    std::vector<uint8_t> c(8), s(1), ci(8), si(1);
    std::vector<float> y(16), y2(16), outer(1);
    float amax = nvfp4_te_quantize_cpu(c.data(), s.data(), x.data(), 1, 16);
    nvfp4_te_dequantize_cpu(y.data(), c.data(), s.data(), amax, 1, 16);
    nvfp4_2level_quantize_cpu(ci.data(), si.data(), outer.data(), x.data(), 1, 16);
    nvfp4_2level_dequantize_cpu(y2.data(), ci.data(), si.data(), outer.data(), 1, 16);
    for (int i = 0; i < 16; ++i) {
      // RTN error <= half the widest E2M1 gap (1 of 6, relative to the block max) plus the E4M3
      // scale rounding (<= 2^-4 relative) and, for 1e-38 (E4M3-subnormal block scales relative to
      // S_dec), one subnormal scale step: 0.25 * |big| covers all of them.
      if (te_in_range) {
        EXPECT_LE(std::fabs(static_cast<double>(y[i]) - x[i]), 0.25 * std::fabs(big)) << i;
      }
      EXPECT_LE(std::fabs(static_cast<double>(y2[i]) - x[i]), 0.25 * std::fabs(big)) << i;
    }
  }
}

TEST(EdgeCases, TeDequantOverflowIsReferenceBehaviour) {
  // README: "Binary32 overflow gives +-inf and 0 * inf gives NaN, as in the CUDA kernel".
  std::vector<float> x(16, 0.0f);
  x[0] = 3e38f;
  std::vector<uint8_t> c(8), s(1);
  std::vector<float> y(16);
  float amax = nvfp4_te_quantize_cpu(c.data(), s.data(), x.data(), 1, 16);
  nvfp4_te_dequantize_cpu(y.data(), c.data(), s.data(), amax, 1, 16);
  EXPECT_EQ(y[0], kInf);
  EXPECT_TRUE(std::isnan(y[1]));
}

TEST(EdgeCases, NaNAndInfPolicy) {
  // docs/formats.md "NaN and Inf": amax skips NaN; a NaN element quantizes to magnitude 0.
  std::vector<float> x(32, 1.0f);
  x[5] = kNaN;
  x[6] = -kNaN;
  std::vector<uint8_t> c(16), s(2);
  float amax = nvfp4_te_quantize_cpu(c.data(), s.data(), x.data(), 1, 32);
  EXPECT_EQ(amax, 1.0f);
  EXPECT_EQ(e2m1_unpack(c.data(), 5), 0x0u);  // TE: NaN -> 0x0 (not "< 0")
  EXPECT_EQ(e2m1_unpack(c.data(), 6), 0x0u);
  EXPECT_EQ(e2m1_unpack(c.data(), 4), 0x7u);
  std::vector<float> outer(1);
  nvfp4_2level_quantize_cpu(c.data(), s.data(), outer.data(), x.data(), 1, 32);
  EXPECT_EQ(e2m1_unpack(c.data(), 5), 0x0u);  // 2-level: magnitude 0, NaN counts as positive
  EXPECT_EQ(e2m1_unpack(c.data(), 6), 0x0u);  // (the sign of a NaN differs between CPU and GPU)
  // TE with +Inf: amax = Inf -> S_enc = 1; Inf block scale 448, the Inf element -> code 0x7;
  // dequantization gives Inf/NaN (TE's kernel behaviour): the caller must check finiteness.
  x[5] = kInf;
  x[6] = 1.0f;
  amax = nvfp4_te_quantize_cpu(c.data(), s.data(), x.data(), 1, 32);
  EXPECT_EQ(amax, kInf);
  EXPECT_EQ(s[0], 0x7E);
  EXPECT_EQ(e2m1_unpack(c.data(), 5), 0x7u);
  // 2-level with Inf: its 128-block gets outer scale Inf and magnitude-0 codes; other 128-blocks
  // are unaffected.
  std::vector<float> x2(256, 1.0f);
  x2[3] = -kInf;
  std::vector<uint8_t> c2(128), s2(16);
  std::vector<float> o2(2);
  nvfp4_2level_quantize_cpu(c2.data(), s2.data(), o2.data(), x2.data(), 1, 256);
  EXPECT_EQ(o2[0], kInf);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(e2m1_unpack(c2.data(), i) & 7u, 0u) << i;
  EXPECT_EQ(e2m1_unpack(c2.data(), 3), 0x8u);
  EXPECT_EQ(o2[1], nvfp4_2level_outer_scale(1.0f));
  EXPECT_EQ(e2m1_unpack(c2.data(), 200), 0x7u);
  // MX: a block with Inf gets the NaN scale byte 0xFF (floor and rceil); MXFP8 NaN element 0x7F.
  std::vector<float> x3(32, 1.0f);
  x3[0] = kInf;
  x3[1] = kNaN;
  std::vector<uint8_t> c3(32), s3(1);
  mxfp4_quantize_cpu(c3.data(), s3.data(), x3.data(), 1, 32, MxScaleRule::kFloor);
  EXPECT_EQ(s3[0], 0xFF);
  mxfp8_quantize_cpu(c3.data(), s3.data(), x3.data(), 1, 32, MxScaleRule::kRceil);
  EXPECT_EQ(s3[0], 0xFF);
  EXPECT_EQ(c3[1], 0x7F);
}

TEST(Drivers, DequantizeEqualsBlockFunctions) {
  // Every code byte, scale bytes over the whole E4M3 range including 0, subnormals and the NaN
  // bytes 0x7F / 0xFF, outer scales of both signs, tiny and huge, and NaN: the drivers (vector path
  // for whole 256-element groups, per block otherwise) against the per-block functions, bit for bit
  // except that a NaN result only has to be a NaN (its sign and payload are unspecified: IEEE
  // leaves them open, and the compilers may swap a product's operands).
  PhiloxStream rng(91, 12);
  for (auto [M, K] : {std::pair<int64_t, int64_t>{3, 512}, {5, 256}, {2, 8192 + 256}, {6, 128}, {4, 384}, {4, 144}, {3, 272}}) {
    SCOPED_TRACE(std::to_string(M) + "x" + std::to_string(K));
    const int64_t no = (K + 127) / 128;
    std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), scales(static_cast<size_t>(M * K / 16));
    std::vector<float> outer(static_cast<size_t>(M * no));
    for (auto& c : codes) c = static_cast<uint8_t>(rng.next_below(256));
    for (auto& b : scales) b = static_cast<uint8_t>(rng.next_below(8) == 0 ? (rng.next_below(2) ? 0x7F : 0xFF) : rng.next_below(256));
    const float outers[] = {1.0f, -3.5f, 0x1p-140f, 1e38f, std::numeric_limits<float>::quiet_NaN(), 0.0f, 7e-3f};
    for (auto& o : outer) o = outers[rng.next_below(7)] * (1.0f + static_cast<float>(rng.next_below(100)) / 128.0f);
    std::vector<float> y(static_cast<size_t>(M * K)), y_ref(y.size());
    for (float amax : {2688.0f, 1e-30f, 3e38f}) {
      nvfp4_te_dequantize_cpu(y.data(), codes.data(), scales.data(), amax, M, K);
      for (int64_t b = 0; b < M * K / 16; ++b)
        nvfp4_te_dequantize_block16(y_ref.data() + 16 * b, codes.data() + 8 * b, scales[static_cast<size_t>(b)], amax);
      for (size_t i = 0; i < y.size(); ++i)
        if (!(std::isnan(y[i]) && std::isnan(y_ref[i]))) ASSERT_EQ(float_as_u32(y[i]), float_as_u32(y_ref[i])) << "te " << i;
    }
    nvfp4_2level_dequantize_cpu(y.data(), codes.data(), scales.data(), outer.data(), M, K);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t o = 0; o < no; ++o)
        nvfp4_2level_dequantize_block128(y_ref.data() + r * K + 128 * o, codes.data() + r * K / 2 + 64 * o,
                                         scales.data() + r * K / 16 + 8 * o, outer[static_cast<size_t>(r * no + o)],
                                         static_cast<int>(std::min<int64_t>(128, K - 128 * o)));
    for (size_t i = 0; i < y.size(); ++i)
      if (!(std::isnan(y[i]) && std::isnan(y_ref[i]))) ASSERT_EQ(float_as_u32(y[i]), float_as_u32(y_ref[i])) << "2-level " << i;
  }
}

// ---- dequantize(quantize(x)) is idempotent on the grid ------------------------------------------

TEST(RoundTrip, RequantizingDequantizedValuesIsIdentity) {
  const int64_t M = 8, K = 256;
  std::vector<float> x = edge_input(M * K, 9);
  std::vector<uint8_t> c(M * K / 2), s(M * K / 16), c2(M * K / 2), s2(M * K / 16);
  std::vector<float> o(M * 2), o2(M * 2), y(M * K), y2(M * K);
  nvfp4_2level_quantize_cpu(c.data(), s.data(), o.data(), x.data(), M, K);
  nvfp4_2level_dequantize_cpu(y.data(), c.data(), s.data(), o.data(), M, K);
  nvfp4_2level_quantize_cpu(c2.data(), s2.data(), o2.data(), y.data(), M, K);
  nvfp4_2level_dequantize_cpu(y2.data(), c2.data(), s2.data(), o2.data(), M, K);
  // Grid values map to themselves up to the outer scale recomputation (amax' <= amax):
  // |y2 - y| <= one E2M1 step of y's block, i.e. 2 * sp; bound by 1/3 of the 128-block amax.
  for (int64_t i = 0; i < M * K; ++i) {
    float amax = o[static_cast<size_t>(i / 128)] * 2688.0f;
    EXPECT_LE(std::fabs(y2[i] - y[i]), amax / 3.0f) << i;
  }
}

}  // namespace
}  // namespace nibble::formats
