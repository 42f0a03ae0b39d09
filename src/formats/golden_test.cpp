// Golden-vector tests: every file of ../shared/testdata/fp4/ reproduced bit for bit by the CPU
// drivers of quantize_cpu.h (codes, scale bytes, FP32 metadata, dequantized values; NaN compared
// by position). The files and their exact arithmetic are described in testdata/fp4/README.md.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/bits.h"
#include "formats/golden.h"
#include "formats/quantize_cpu.h"

namespace nibble::formats {
namespace {

const char* kKinds[] = {"normal", "student_t3", "wide", "ties_zero", "allzero"};

// Byte-exact comparison with a readable first mismatch.
void expect_bytes_eq(const std::vector<uint8_t>& got, const golden::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.bytes.size()) << what;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want.bytes[i]) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  EXPECT_EQ(bad, 0) << what << ": first mismatch at byte " << first << " got 0x" << std::hex
                    << (first >= 0 ? int(got[static_cast<size_t>(first)]) : 0) << " want 0x"
                    << (first >= 0 ? int(want.bytes[static_cast<size_t>(first)]) : 0);
}

// Bit-exact float comparison; NaN matches NaN by position (any payload).
void expect_f32_eq(const std::vector<float>& got, const golden::Tensor& want, const std::string& what) {
  std::vector<float> w = want.as<float>();
  ASSERT_EQ(got.size(), w.size()) << what;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    bool same = (std::isnan(got[i]) && std::isnan(w[i])) || float_as_u32(got[i]) == float_as_u32(w[i]);
    if (!same) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": first mismatch at " << first << " got "
                    << (first >= 0 ? got[static_cast<size_t>(first)] : 0.0f) << " want "
                    << (first >= 0 ? w[static_cast<size_t>(first)] : 0.0f);
}

TEST(Golden, Nvfp4Te1x16) {
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    golden::File f = golden::load(std::string("nvfp4_te_1x16_") + kind);
    const auto& xt = f.at("x");
    int64_t M = xt.shape[0], K = xt.shape[1];
    std::vector<float> x = xt.as<float>();
    std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), scales(static_cast<size_t>(M * K / 16));
    float amax = nvfp4_te_quantize_cpu(codes.data(), scales.data(), x.data(), M, K);
    expect_bytes_eq(codes, f.at("codes"), "codes");
    expect_bytes_eq(scales, f.at("scales"), "scales");
    expect_f32_eq({amax}, f.at("amax"), "amax");
    std::vector<float> y(static_cast<size_t>(M * K));
    nvfp4_te_dequantize_cpu(y.data(), codes.data(), scales.data(), amax, M, K);
    expect_f32_eq(y, f.at("dequant"), "dequant");
    // BF16 input path: quantize the BF16 rounding of x, compare against the f32 path on that input.
    std::vector<uint16_t> xb(x.size());
    std::vector<float> xbf(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      xb[i] = f32_to_bf16_bits(x[i]);
      xbf[i] = bf16_bits_to_f32(xb[i]);
    }
    std::vector<uint8_t> c1(codes.size()), s1(scales.size()), c2(codes.size()), s2(scales.size());
    float a1 = nvfp4_te_quantize_cpu(c1.data(), s1.data(), xb.data(), M, K);
    float a2 = nvfp4_te_quantize_cpu(c2.data(), s2.data(), xbf.data(), M, K);
    EXPECT_EQ(float_as_u32(a1), float_as_u32(a2));
    EXPECT_EQ(c1, c2);
    EXPECT_EQ(s1, s2);
  }
}

TEST(Golden, Nvfp4Te2d) {
  for (const char* kind : {"normal", "wide", "ties_zero"}) {
    SCOPED_TRACE(kind);
    golden::File f = golden::load(std::string("nvfp4_te_2d_") + kind);
    const auto& xt = f.at("x");
    int64_t M = xt.shape[0], K = xt.shape[1];
    std::vector<float> x = xt.as<float>();
    std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), scales(static_cast<size_t>(M * K / 16));
    std::vector<uint8_t> codes_t(static_cast<size_t>(K * M / 2)), scales_t(static_cast<size_t>(K * ((M + 15) / 16)));
    float amax = nvfp4_te_quantize_2d_cpu(codes.data(), scales.data(), codes_t.data(), scales_t.data(), x.data(), M, K);
    expect_bytes_eq(codes, f.at("codes"), "codes");
    expect_bytes_eq(scales, f.at("scales"), "scales");
    expect_bytes_eq(codes_t, f.at("codes_t"), "codes_t");
    expect_bytes_eq(scales_t, f.at("scales_t"), "scales_t");
    expect_f32_eq({amax}, f.at("amax"), "amax");
    std::vector<float> y(static_cast<size_t>(M * K));
    nvfp4_te_dequantize_cpu(y.data(), codes.data(), scales.data(), amax, M, K);
    expect_f32_eq(y, f.at("dequant"), "dequant");
  }
}

TEST(Golden, Nvfp4TeRht) {
  golden::File f = golden::load("nvfp4_te_rht_normal");
  const auto& xt = f.at("x_bf16");
  int64_t M = xt.shape[0], K = xt.shape[1];
  std::vector<uint16_t> x = xt.as<uint16_t>();
  // The transform matrix itself: T[i][j] = s_i H[i][j] / 4.
  std::vector<uint16_t> tm = f.at("rht_matrix").as<uint16_t>();
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float s = ((kRhtTeSignMask >> i) & 1u) ? -1.0f : 1.0f;
      EXPECT_EQ(bf16_bits_to_f32(tm[static_cast<size_t>(16 * i + j)]), s * static_cast<float>(rht_h16(i, j)) * 0.25f);
    }
  std::vector<uint16_t> yt(static_cast<size_t>(K * M));
  std::vector<uint8_t> codes_t(static_cast<size_t>(K * M / 2)), scales_t(static_cast<size_t>(K * M / 16));
  float amax_t = nvfp4_te_quantize_rht_t_cpu(codes_t.data(), scales_t.data(), yt.data(), x.data(), M, K);
  std::vector<uint8_t> yt_bytes(yt.size() * 2);
  std::memcpy(yt_bytes.data(), yt.data(), yt_bytes.size());
  expect_bytes_eq(yt_bytes, f.at("x_t_rht"), "x_t_rht");
  expect_f32_eq({amax_t}, f.at("amax_t"), "amax_t");
  expect_bytes_eq(codes_t, f.at("codes_t"), "codes_t");
  expect_bytes_eq(scales_t, f.at("scales_t"), "scales_t");
  std::vector<float> yd(static_cast<size_t>(K * M));
  nvfp4_te_dequantize_cpu(yd.data(), codes_t.data(), scales_t.data(), amax_t, K, M);
  expect_f32_eq(yd, f.at("dequant_t"), "dequant_t");
  // Rowwise part of the same file (no RHT).
  std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), scales(static_cast<size_t>(M * K / 16));
  float amax = nvfp4_te_quantize_cpu(codes.data(), scales.data(), x.data(), M, K);
  expect_f32_eq({amax}, f.at("amax"), "amax");
  expect_bytes_eq(codes, f.at("codes"), "codes");
  expect_bytes_eq(scales, f.at("scales"), "scales");
  std::vector<float> y(static_cast<size_t>(M * K));
  nvfp4_te_dequantize_cpu(y.data(), codes.data(), scales.data(), amax, M, K);
  expect_f32_eq(y, f.at("dequant"), "dequant");
}

TEST(Golden, Nvfp4TetraJetV2DoubleBlock) {
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    golden::File f = golden::load(std::string("nvfp4_tetrajet_v2_doubleblock_") + kind);
    const auto& xt = f.at("x");
    int64_t M = xt.shape[0], K = xt.shape[1];
    std::vector<float> x = xt.as<float>();
    std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), inner(static_cast<size_t>(M * K / 16));
    std::vector<float> outer(static_cast<size_t>(M * K / 128));
    nvfp4_2level_quantize_cpu(codes.data(), inner.data(), outer.data(), x.data(), M, K);
    expect_bytes_eq(codes, f.at("codes"), "codes");
    expect_bytes_eq(inner, f.at("inner_scales"), "inner_scales");
    expect_f32_eq(outer, f.at("outer_scales"), "outer_scales");
    std::vector<float> y(static_cast<size_t>(M * K));
    nvfp4_2level_dequantize_cpu(y.data(), codes.data(), inner.data(), outer.data(), M, K);
    expect_f32_eq(y, f.at("dequant"), "dequant");
    // scale_only_product: si*so, with a zero inner scale replaced by 2^-9 (README).
    std::vector<float> sop(inner.size());
    for (size_t i = 0; i < inner.size(); ++i) {
      uint32_t si = inner[i] == 0 ? 1u : inner[i];  // E4M3 0x01 = 2^-9
      sop[i] = nvfp4_2level_block_scale(si, outer[i / 8]);
    }
    expect_f32_eq(sop, f.at("scale_only_product"), "scale_only_product");
  }
}

TEST(Golden, Mxfp4) {
  struct Rule {
    const char* prefix;
    MxScaleRule rule;
  } rules[] = {{"floor", MxScaleRule::kFloor}, {"rceil", MxScaleRule::kRceil}, {"te_ceil", MxScaleRule::kTeCeil}};
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    golden::File f = golden::load(std::string("mxfp4_e2m1_") + kind);
    const auto& xt = f.at("x");
    int64_t M = xt.shape[0], K = xt.shape[1];
    std::vector<float> x = xt.as<float>();
    for (const Rule& r : rules) {
      SCOPED_TRACE(r.prefix);
      std::string p = r.prefix;
      std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), scales(static_cast<size_t>(M * K / 32));
      mxfp4_quantize_cpu(codes.data(), scales.data(), x.data(), M, K, r.rule);
      expect_bytes_eq(codes, f.at(p + "_codes"), p + "_codes");
      expect_bytes_eq(scales, f.at(p + "_scales"), p + "_scales");
      if (f.has(p + "_dequant")) {
        std::vector<float> y(static_cast<size_t>(M * K));
        mxfp4_dequantize_cpu(y.data(), codes.data(), scales.data(), M, K);
        expect_f32_eq(y, f.at(p + "_dequant"), p + "_dequant");
      }
    }
  }
}

TEST(Golden, Mxfp8) {
  struct Rule {
    const char* prefix;
    MxScaleRule rule;
  } rules[] = {{"floor", MxScaleRule::kFloor}, {"rceil", MxScaleRule::kRceil}};
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    golden::File f = golden::load(std::string("mxfp8_e4m3_") + kind);
    const auto& xt = f.at("x");
    int64_t M = xt.shape[0], K = xt.shape[1];
    std::vector<float> x = xt.as<float>();
    for (const Rule& r : rules) {
      SCOPED_TRACE(r.prefix);
      std::string p = r.prefix;
      std::vector<uint8_t> elems(static_cast<size_t>(M * K)), scales(static_cast<size_t>(M * K / 32));
      mxfp8_quantize_cpu(elems.data(), scales.data(), x.data(), M, K, r.rule);
      expect_bytes_eq(elems, f.at(p + "_codes"), p + "_codes");
      expect_bytes_eq(scales, f.at(p + "_scales"), p + "_scales");
      std::vector<float> y(static_cast<size_t>(M * K));
      mxfp8_dequantize_cpu(y.data(), elems.data(), scales.data(), M, K);
      expect_f32_eq(y, f.at(p + "_dequant"), p + "_dequant");
    }
  }
}

}  // namespace
}  // namespace nibble::formats
