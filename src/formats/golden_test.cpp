// Golden-vector tests: every file of ../shared/testdata/fp4/ reproduced bit for bit by the CPU
// drivers of quantize_cpu.h (codes, scale bytes, FP32 metadata, dequantized values; NaN compared
// by position). The files and their exact arithmetic are described in testdata/fp4/README.md.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/bits.h"
#include "formats/bf16_test_util.h"
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

// A golden file and its input x: (M,K) f32.
struct GoldenInput {
  golden::File f;
  int64_t M = 0, K = 0;
  std::vector<float> x;
};
GoldenInput load_input(const std::string& name) {
  GoldenInput in;
  in.f = golden::load(name);
  const golden::Tensor& xt = in.f.at("x");
  in.M = xt.shape[0];
  in.K = xt.shape[1];
  in.x = xt.as<float>();
  return in;
}

// A TE 1x16 result, codes: (rows, cols/2) e2m1x2, scales: (rows, cols/16) ue4m3, amax, against
// the file's codes<suffix>, scales<suffix>, amax<suffix>, and its TE dequantization against
// dequant<suffix>.
void expect_te_1x16_eq(const golden::File& f, const std::string& suffix, const std::vector<uint8_t>& codes,
                       const std::vector<uint8_t>& scales, float amax, int64_t rows, int64_t cols) {
  expect_bytes_eq(codes, f.at("codes" + suffix), "codes" + suffix);
  expect_bytes_eq(scales, f.at("scales" + suffix), "scales" + suffix);
  expect_f32_eq({amax}, f.at("amax" + suffix), "amax" + suffix);
  std::vector<float> y(static_cast<size_t>(rows * cols));
  nvfp4_te_dequantize_cpu(y.data(), codes.data(), scales.data(), amax, rows, cols);
  expect_f32_eq(y, f.at("dequant" + suffix), "dequant" + suffix);
}

TEST(Golden, Nvfp4Te1x16) {
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    auto [f, M, K, x] = load_input(std::string("nvfp4_te_1x16_") + kind);
    std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), scales(static_cast<size_t>(M * K / 16));
    float amax = nvfp4_te_quantize_cpu(codes.data(), scales.data(), x.data(), M, K);
    expect_te_1x16_eq(f, "", codes, scales, amax, M, K);
    // BF16 input path: quantize the BF16 rounding of x, compare against the f32 path on that input.
    std::vector<uint16_t> xb = testing::to_bf16(x);
    std::vector<float> xbf = testing::from_bf16(xb);
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
    auto [f, M, K, x] = load_input(std::string("nvfp4_te_2d_") + kind);
    std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), scales(static_cast<size_t>(M * K / 16));
    std::vector<uint8_t> codes_t(static_cast<size_t>(K * M / 2)), scales_t(static_cast<size_t>(K * ((M + 15) / 16)));
    float amax = nvfp4_te_quantize_2d_cpu(codes.data(), scales.data(), codes_t.data(), scales_t.data(), x.data(), M, K);
    expect_te_1x16_eq(f, "", codes, scales, amax, M, K);
    expect_bytes_eq(codes_t, f.at("codes_t"), "codes_t");
    expect_bytes_eq(scales_t, f.at("scales_t"), "scales_t");
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
  expect_te_1x16_eq(f, "_t", codes_t, scales_t, amax_t, K, M);
  // Rowwise part of the same file (no RHT).
  std::vector<uint8_t> codes(static_cast<size_t>(M * K / 2)), scales(static_cast<size_t>(M * K / 16));
  float amax = nvfp4_te_quantize_cpu(codes.data(), scales.data(), x.data(), M, K);
  expect_te_1x16_eq(f, "", codes, scales, amax, M, K);
}

TEST(Golden, Nvfp4TetraJetV2DoubleBlock) {
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    auto [f, M, K, x] = load_input(std::string("nvfp4_tetrajet_v2_doubleblock_") + kind);
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

struct MxRule {
  const char* prefix;  // tensor names <prefix>_codes, <prefix>_scales, <prefix>_dequant
  MxScaleRule rule;
};

// One MX family's golden files <file_prefix><kind>: for every kind and rule, the element bytes
// (elems_per_byte per byte) and E8M0 scale bytes of quantize(x) bit for bit, then dequantize's
// values; with dequant_optional, a rule whose file has no <prefix>_dequant skips that last check.
template <typename Quantize, typename Dequantize>
void expect_mx_golden(const std::string& file_prefix, const std::vector<MxRule>& rules, int64_t elems_per_byte,
                      bool dequant_optional, Quantize quantize, Dequantize dequantize) {
  for (const char* kind : kKinds) {
    SCOPED_TRACE(kind);
    auto [f, M, K, x] = load_input(file_prefix + kind);
    for (const MxRule& r : rules) {
      SCOPED_TRACE(r.prefix);
      std::string p = r.prefix;
      std::vector<uint8_t> elems(static_cast<size_t>(M * K / elems_per_byte)), scales(static_cast<size_t>(M * K / 32));
      quantize(elems.data(), scales.data(), x.data(), M, K, r.rule);
      expect_bytes_eq(elems, f.at(p + "_codes"), p + "_codes");
      expect_bytes_eq(scales, f.at(p + "_scales"), p + "_scales");
      if (dequant_optional && !f.has(p + "_dequant")) continue;
      std::vector<float> y(static_cast<size_t>(M * K));
      dequantize(y.data(), elems.data(), scales.data(), M, K);
      expect_f32_eq(y, f.at(p + "_dequant"), p + "_dequant");
    }
  }
}

TEST(Golden, Mxfp4) {
  // Dequant optional: the files have no te_ceil_dequant.
  expect_mx_golden(
      "mxfp4_e2m1_", {{"floor", MxScaleRule::kFloor}, {"rceil", MxScaleRule::kRceil}, {"te_ceil", MxScaleRule::kTeCeil}},
      2, /*dequant_optional=*/true, [](auto... args) { mxfp4_quantize_cpu(args...); }, mxfp4_dequantize_cpu);
}

TEST(Golden, Mxfp8) {
  expect_mx_golden("mxfp8_e4m3_", {{"floor", MxScaleRule::kFloor}, {"rceil", MxScaleRule::kRceil}}, 1,
                   /*dequant_optional=*/false, [](auto... args) { mxfp8_quantize_cpu(args...); },
                   mxfp8_dequantize_cpu);
}

}  // namespace
}  // namespace nibble::formats
