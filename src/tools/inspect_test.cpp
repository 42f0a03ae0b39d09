// Tests of `nibble inspect`, driving the built binary on files written by `nibble quantize`:
// tensor listing, recognition of the raw / ModelOpt / compressed-tensors groups (from the
// nibble.format metadata and, with the metadata removed, from names/dtypes/shapes alone), and
// the --against error statistics on Gaussian data against bounds derived below.
#include <cmath>
#include <cstdlib>
#include <sstream>

#include <gtest/gtest.h>

#include "tools/cli_test_util.h"

namespace nibble::tools::test {
namespace {

struct Row {
  std::string format;
  double rmse = -1, rel_rmse = -1, max_abs = -1, snr_db = -1, zeros = -1;
};

// The `--against` row of `name` ("  name  format  rmse  rel_rmse  max_abs  snr_db  zeros").
Row against_row(const std::string& out, const std::string& name) {
  std::istringstream lines(out);
  std::string line;
  bool in_table = false;
  while (std::getline(lines, line)) {
    if (line.rfind("error against", 0) == 0) in_table = true;
    if (!in_table) continue;
    std::istringstream f(line);
    std::string n;
    Row r;
    if (f >> n && n == name && f >> r.format >> r.rmse >> r.rel_rmse >> r.max_abs >> r.snr_db >> r.zeros) return r;
  }
  ADD_FAILURE() << "no --against row for " << name << " in:\n" << out;
  return {};
}

class InspectCli : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<io::NamedTensor> t = test_checkpoint();
    // A larger N(0,1) matrix for the statistics: 64 x 1024 = 65536 elements, 4096 NVFP4 blocks.
    t.push_back({"g.weight", gaussian(DType::kF32, {64, 1024}, 42)});
    ASSERT_TRUE(io::write_safetensors(dir / "in.safetensors", t).is_ok());
  }
  std::string quantize(const std::string& out, const std::string& flags) {
    RunResult r = run_nibble(dir.path, "quantize '" + dir / "in.safetensors" + "' '" + dir / out + "' " + flags);
    EXPECT_EQ(r.code, 0) << r.err;
    return dir / out;
  }
  ScratchDir dir{::testing::UnitTest::GetInstance()->current_test_info()->name()};
};

TEST_F(InspectCli, ListsTensorsMetadataAndGroups) {
  std::string f = quantize("q.safetensors", "--format mxfp4 --scale-rule rceil");
  RunResult r = run_nibble(dir.path, "inspect '" + f + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("nibble.format = {"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("a.weight.codes"), std::string::npos);
  EXPECT_NE(r.out.find("U8"), std::string::npos);
  EXPECT_NE(r.out.find("  a.weight: mxfp4 1x32 rceil, layout raw, shape [32, 256]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  b.weight: mxfp4 1x32 rceil, layout raw, shape [3, 4, 128]"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("  norm.weight: "), std::string::npos) << r.out;  // copied, not a group
}

TEST_F(InspectCli, AgainstSourceNvfp4GaussianError) {
  std::string f = quantize("q.safetensors", "--format nvfp4");
  RunResult r = run_nibble(dir.path, "inspect '" + f + "' --against '" + dir / "in.safetensors" + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  Row g = against_row(r.out, "g.weight");
  EXPECT_EQ(g.format, "nvfp4");
  // Expected relative RMSE of NVFP4 (1x16, E4M3 block scale, E2M1 elements) on N(0,1): each
  // block's max maps to ~6, so the element grid step relative to the block max is 0.5/6 on
  // [0, 2/6], 1/6 on [2/6, 4/6], 2/6 above; with block max ~ 1.8 sigma (16 normal samples) the
  // rounding error (step^2/12 averaged over where N(0,1) mass falls) gives a relative RMSE of
  // about 0.09-0.1 (measured here: ~0.095). Bounds 0.05 < rel < 0.2 fail for a broken scale
  // (factor-2 errors double it), a mis-packed nibble (rel ~ 1) or an all-zero output (rel = 1).
  EXPECT_GT(g.rel_rmse, 0.05);
  EXPECT_LT(g.rel_rmse, 0.2);
  // SNR = -20 log10(rel) within rounding of the printed digits.
  EXPECT_NEAR(g.snr_db, -20.0 * std::log10(g.rel_rmse), 0.05);
  // Max error is at most half the largest grid step (1 of 6 -> 2/6 of the block max / 2),
  // block max <= max |x| ~ 4.5 for 65536 samples: < 1.
  EXPECT_GT(g.max_abs, 0.0);
  EXPECT_LT(g.max_abs, 1.0);
  // Zeros: |y| < 0.25 step -> |x| < 0.25 * bmax/6 ~ 0.075 sigma: ~6% of N(0,1) mass, some
  // more in blocks with a large max; a sane range is (0, 0.2).
  EXPECT_GT(g.zeros, 0.0);
  EXPECT_LT(g.zeros, 0.2);
  // Copied tensors are reported identical to the source.
  EXPECT_NE(r.out.find("norm.weight"), std::string::npos);
  EXPECT_EQ(r.out.find("DIFFERS"), std::string::npos) << r.out;
}

TEST_F(InspectCli, AgainstSourceOrdersFormatsByPrecision) {
  // MXFP8 (3 mantissa bits) must be far more accurate than the 4-bit formats: E4M3 RNE relative
  // error per element <= 2^-4, RMS ~ 2^-4/sqrt(3) * (mean-square ratio) ~ 0.02-0.03.
  std::string f8 = quantize("q8.safetensors", "--format mxfp8");
  RunResult r8 = run_nibble(dir.path, "inspect '" + f8 + "' --against '" + dir / "in.safetensors" + "'");
  ASSERT_EQ(r8.code, 0) << r8.err;
  Row m8 = against_row(r8.out, "g.weight");
  EXPECT_GT(m8.rel_rmse, 0.0);
  EXPECT_LT(m8.rel_rmse, 0.05);
  // MXFP4 (power-of-two scale) loses up to 2x of range against NVFP4's E4M3 scale: worse, but
  // still a 4-bit format (< 0.3).
  std::string f4 = quantize("q4.safetensors", "--format mxfp4");
  RunResult r4 = run_nibble(dir.path, "inspect '" + f4 + "' --against '" + dir / "in.safetensors" + "'");
  ASSERT_EQ(r4.code, 0) << r4.err;
  Row m4 = against_row(r4.out, "g.weight");
  std::string fn = quantize("qn.safetensors", "--format nvfp4-2level");
  RunResult rn = run_nibble(dir.path, "inspect '" + fn + "' --against '" + dir / "in.safetensors" + "'");
  ASSERT_EQ(rn.code, 0) << rn.err;
  Row n2 = against_row(rn.out, "g.weight");
  EXPECT_LT(m8.rel_rmse, n2.rel_rmse);
  EXPECT_LT(n2.rel_rmse, m4.rel_rmse);
  EXPECT_LT(m4.rel_rmse, 0.3);
}

TEST_F(InspectCli, RecognisesEngineLayoutsWithoutMetadata) {
  for (const std::string layout : {"modelopt", "compressed-tensors"}) {
    SCOPED_TRACE(layout);
    std::string f = quantize("q.safetensors", "--format nvfp4 --layout " + layout);
    // Rewrite the same tensors with no metadata: recognition must work from names/dtypes/shapes.
    auto q = io::SafetensorsFile::open(f);
    ASSERT_TRUE(q.is_ok());
    std::vector<io::NamedTensor> t;
    for (const auto& n : q->names()) t.push_back({n, *q->get(n)});
    ASSERT_TRUE(io::write_safetensors(dir / "bare.safetensors", t).is_ok());
    RunResult r = run_nibble(dir.path, "inspect '" + dir / "bare.safetensors" + "' --against '" + dir / "in.safetensors" + "'");
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.out.find("nibble.format"), std::string::npos);
    EXPECT_NE(r.out.find("  g.weight: nvfp4 1x16, layout " + layout + ", shape [64, 1024]"), std::string::npos) << r.out;
    Row g = against_row(r.out, "g.weight");
    // Same arithmetic as the raw layout up to the rounding of the stored global factor.
    EXPECT_GT(g.rel_rmse, 0.05);
    EXPECT_LT(g.rel_rmse, 0.2);
  }
}

// The whitespace-separated fields of the `--against` line of `name` (strtod reads "nan"/"inf",
// which operator>> does not).
std::vector<std::string> against_fields(const std::string& out, const std::string& name) {
  std::istringstream lines(out.substr(std::min(out.size(), out.find("error against"))));
  for (std::string line; std::getline(lines, line);) {
    std::istringstream f(line);
    std::vector<std::string> fields;
    for (std::string w; f >> w;) fields.push_back(w);
    if (!fields.empty() && fields[0] == name) return fields;
  }
  ADD_FAILURE() << "no --against row for " << name << " in:\n" << out;
  return {};
}

TEST_F(InspectCli, AgainstSourceWithNanOrInfIsNeverExact) {
  // q holds the NVFP4 form of a finite g.weight; the source it is compared with has a NaN and an
  // Inf in that tensor. The old statistics summed the NaN into both sums and printed
  // rel_rmse 0 and SNR inf: a perfect result.
  std::string q = quantize("q.safetensors", "--format nvfp4");
  auto src = io::SafetensorsFile::open(dir / "in.safetensors");
  ASSERT_TRUE(src.is_ok());
  std::vector<io::NamedTensor> t;
  for (const auto& n : src->names()) t.push_back({n, src->get(n)->clone()});
  for (auto& nt : t)
    if (nt.name == "g.weight") {
      nt.tensor.data<float>()[3] = NAN;
      nt.tensor.data<float>()[700] = -INFINITY;
    }
  ASSERT_TRUE(io::write_safetensors(dir / "nan.safetensors", t).is_ok());
  RunResult r = run_nibble(dir.path, "inspect '" + q + "' --against '" + dir / "nan.safetensors" + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  std::vector<std::string> g = against_fields(r.out, "g.weight");
  ASSERT_GE(g.size(), 8u) << r.out;
  EXPECT_EQ(g[7], "2") << r.out;  // the nonfinite column
  // The other 65534 values are compared as usual: the ordinary NVFP4 error, not zero.
  const double rel = std::strtod(g[3].c_str(), nullptr), snr = std::strtod(g[5].c_str(), nullptr);
  EXPECT_GT(rel, 0.05) << r.out;
  EXPECT_LT(rel, 0.2) << r.out;
  EXPECT_TRUE(std::isfinite(snr)) << r.out;
  EXPECT_NE(r.out.find("NOT EXACT: 2 of 65536 values are NaN/Inf"), std::string::npos) << r.out;
  // Finite tensors keep a zero count and no note.
  std::vector<std::string> a = against_fields(r.out, "a.weight");
  ASSERT_GE(a.size(), 8u) << r.out;
  EXPECT_EQ(a[7], "0");
  EXPECT_EQ(a.size(), 8u) << r.out;

  // A tensor quantized with a NaN in it (the amax is NaN, so is every value): no finite pair
  // is left, the statistics are NaN and the row says why, never "0 / inf".
  ASSERT_TRUE(io::write_safetensors(dir / "nan_in.safetensors", t).is_ok());
  RunResult qn = run_nibble(dir.path, "quantize '" + dir / "nan_in.safetensors" + "' '" + dir / "qn.safetensors" +
                                          "' --format nvfp4");
  ASSERT_EQ(qn.code, 0) << qn.err;
  r = run_nibble(dir.path, "inspect '" + dir / "qn.safetensors" + "' --against '" + dir / "nan.safetensors" + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  g = against_fields(r.out, "g.weight");
  ASSERT_GE(g.size(), 8u) << r.out;
  EXPECT_GE(std::stoll(g[7]), 2) << r.out;
  EXPECT_NE(std::strtod(g[3].c_str(), nullptr), 0.0) << r.out;  // rel_rmse: NaN or the real error, never 0
  EXPECT_NE(r.out.find("NOT EXACT"), std::string::npos) << r.out;
}

TEST_F(InspectCli, BadInputOneLineNonZero) {
  RunResult r = run_nibble(dir.path, "inspect '" + dir / "nope.safetensors" + "'");
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.err_lines(), 1) << r.err;
  std::ofstream(dir / "junk.safetensors") << std::string(64, '\xff');
  r = run_nibble(dir.path, "inspect '" + dir / "junk.safetensors" + "'");
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(r.err_lines(), 1) << r.err;
}

}  // namespace
}  // namespace nibble::tools::test
