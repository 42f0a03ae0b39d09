// Tests of `nibble quantize`, driving the built binary: every format/layout of a generated
// checkpoint is read back and compared bit for bit with direct calls of the formats CPU drivers
// (formats/quantize_cpu.h); copy/skip reporting; the ModelOpt and compressed-tensors names,
// dtypes and shapes; SR determinism by seed; bad flag combinations (exit 2) and bad input
// (exit 1), each with exactly one line on stderr.
#include <cstring>
#include <regex>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "formats/quantize_cpu.h"
#include "tools/cli_test_util.h"

namespace nibble::tools::test {
namespace {

namespace fm = nibble::formats;

struct Case {
  std::string flags;   // after --format
  std::string format;  // nvfp4 | nvfp4-2level | mxfp4 | mxfp8
  bool block_16x16 = false;
  fm::MxScaleRule rule = fm::MxScaleRule::kFloor;
  bool sr = false;
  uint64_t seed = 0;
};

int64_t block_of(const std::string& f) { return f == "nvfp4" ? 16 : f == "nvfp4-2level" ? 128 : 32; }

bool eligible(const Tensor& x, const std::string& format) {
  DType d = x.dtype();
  return (d == DType::kF32 || d == DType::kBF16 || d == DType::kF16) && x.rank() >= 1 && x.numel() > 0 &&
         x.dim(-1) % block_of(format) == 0;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.raw());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

// The expected member bytes of one tensor, computed with the drivers directly.
struct Expected {
  std::vector<uint8_t> codes, scales, global;  // global: f32 bytes (amax or outer scales)
  float amax = 0;
};
Expected reference(const Tensor& x, const Case& c, uint64_t stream) {
  const int64_t K = x.dim(-1), M = x.numel() / K;
  const fm::SrKey key{c.seed, stream};
  const fm::SrKey* sr = c.sr ? &key : nullptr;
  Tensor xf = x.to_f32();  // exact for BF16/F16
  const float* f = xf.data<float>();
  const bool bf16 = x.dtype() == DType::kBF16;
  const auto* b = static_cast<const uint16_t*>(x.raw());
  Expected e;
  const int64_t n = M * K;
  if (c.format == "nvfp4") {
    e.codes.resize(n / 2);
    e.scales.resize(n / 16);
    if (c.block_16x16) e.amax = fm::nvfp4_te_quantize_2d_cpu(e.codes.data(), e.scales.data(), nullptr, nullptr, f, M, K);
    else if (bf16) e.amax = fm::nvfp4_te_quantize_cpu(e.codes.data(), e.scales.data(), b, M, K, sr);
    else e.amax = fm::nvfp4_te_quantize_cpu(e.codes.data(), e.scales.data(), f, M, K, sr);
    e.global.resize(4);
    std::memcpy(e.global.data(), &e.amax, 4);
  } else if (c.format == "nvfp4-2level") {
    e.codes.resize(n / 2);
    e.scales.resize(n / 16);
    std::vector<float> outer(n / 128);
    if (bf16) fm::nvfp4_2level_quantize_cpu(e.codes.data(), e.scales.data(), outer.data(), b, M, K, sr);
    else fm::nvfp4_2level_quantize_cpu(e.codes.data(), e.scales.data(), outer.data(), f, M, K, sr);
    e.global.resize(outer.size() * 4);
    std::memcpy(e.global.data(), outer.data(), e.global.size());
  } else if (c.format == "mxfp4") {
    e.codes.resize(n / 2);
    e.scales.resize(n / 32);
    if (bf16) fm::mxfp4_quantize_cpu(e.codes.data(), e.scales.data(), b, M, K, c.rule, sr);
    else fm::mxfp4_quantize_cpu(e.codes.data(), e.scales.data(), f, M, K, c.rule, sr);
  } else {
    e.codes.resize(n);
    e.scales.resize(n / 32);
    if (bf16) fm::mxfp8_quantize_cpu(e.codes.data(), e.scales.data(), b, M, K, c.rule);
    else fm::mxfp8_quantize_cpu(e.codes.data(), e.scales.data(), f, M, K, c.rule);
  }
  return e;
}

Shape with_last(Shape s, int64_t k) {
  s.back() = k;
  return s;
}

class QuantizeCli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(io::write_safetensors(dir / "in.safetensors", test_checkpoint(), {{"origin", "unit-test"}}).is_ok());
  }
  ScratchDir dir{::testing::UnitTest::GetInstance()->current_test_info()->name()};
};

TEST_F(QuantizeCli, RawLayoutMatchesDriversBitForBit) {
  const std::vector<Case> cases = {
      {"nvfp4", "nvfp4"},
      {"nvfp4 --block 16x16", "nvfp4", true},
      {"nvfp4 --rounding sr --seed 7", "nvfp4", false, fm::MxScaleRule::kFloor, true, 7},
      {"nvfp4-2level", "nvfp4-2level"},
      {"nvfp4-2level --rounding sr --seed 9", "nvfp4-2level", false, fm::MxScaleRule::kFloor, true, 9},
      {"mxfp4", "mxfp4", false, fm::MxScaleRule::kFloor},
      {"mxfp4 --scale-rule ceil", "mxfp4", false, fm::MxScaleRule::kTeCeil},
      {"mxfp4 --scale-rule rceil --rounding sr --seed 3", "mxfp4", false, fm::MxScaleRule::kRceil, true, 3},
      {"mxfp8", "mxfp8", false, fm::MxScaleRule::kRceil},
      {"mxfp8 --scale-rule ocp", "mxfp8", false, fm::MxScaleRule::kFloor},
  };
  auto in = io::SafetensorsFile::open(dir / "in.safetensors");
  ASSERT_TRUE(in.is_ok());
  const auto names = in->names();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flags);
    RunResult r = run_nibble(dir.path, "quantize '" + dir / "in.safetensors" + "' '" + dir / "out.safetensors" +
                                           "' --format " + c.flags);
    ASSERT_EQ(r.code, 0) << r.err;
    auto out = io::SafetensorsFile::open(dir / "out.safetensors");
    ASSERT_TRUE(out.is_ok()) << out.status().message();
    int quantized = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      const std::string& n = names[i];
      Tensor x = *in->get(n);
      SCOPED_TRACE(n);
      if (!eligible(x, c.format)) {
        // Copied unchanged, and reported on its own line with the reason.
        ASSERT_TRUE(out->contains(n));
        Tensor y = *out->get(n);
        EXPECT_EQ(y.dtype(), x.dtype());
        EXPECT_EQ(y.shape(), x.shape());
        EXPECT_EQ(bytes_of(y), bytes_of(x));
        EXPECT_NE(r.out.find("copied " + n + ": "), std::string::npos) << r.out;
        continue;
      }
      ++quantized;
      EXPECT_FALSE(out->contains(n));
      Expected e = reference(x, c, i);  // SR stream = index in file order
      const int64_t K = x.dim(-1);
      Tensor codes = *out->get(n + ".codes"), scales = *out->get(n + ".scales");
      const bool mx = c.format == "mxfp4" || c.format == "mxfp8";
      EXPECT_EQ(codes.dtype(), c.format == "mxfp8" ? DType::kF8E4M3 : DType::kU8);
      EXPECT_EQ(codes.shape(), with_last(x.shape(), c.format == "mxfp8" ? K : K / 2));
      EXPECT_EQ(scales.dtype(), DType::kU8);
      EXPECT_EQ(scales.shape(), with_last(x.shape(), K / (mx ? 32 : 16)));
      EXPECT_EQ(bytes_of(codes), e.codes);
      EXPECT_EQ(bytes_of(scales), e.scales);
      if (mx) {
        EXPECT_FALSE(out->contains(n + ".global"));
      } else {
        Tensor g = *out->get(n + ".global");
        EXPECT_EQ(g.dtype(), DType::kF32);
        EXPECT_EQ(g.shape(), c.format == "nvfp4" ? Shape{} : with_last(x.shape(), K / 128));
        EXPECT_EQ(bytes_of(g), e.global);
      }
    }
    EXPECT_GE(quantized, 2);
    // The metadata records the format and keeps the input's own entries.
    auto meta = out->metadata();
    EXPECT_EQ(meta.at("origin"), "unit-test");
    auto info = nlohmann::json::parse(meta.at("nibble.format"));
    EXPECT_EQ(info.at("format"), c.format);
    EXPECT_EQ(info.at("tensors").size(), static_cast<size_t>(quantized));
    EXPECT_EQ(info.at("rounding"), c.sr ? "sr" : "rtn");
  }
}

TEST_F(QuantizeCli, SkipRegexCopiesAndReports) {
  RunResult r = run_nibble(dir.path, "quantize '" + dir / "in.safetensors" + "' '" + dir / "out.safetensors" +
                                         "' --format nvfp4 --skip '^a\\.|bias$'");
  ASSERT_EQ(r.code, 0) << r.err;
  auto out = io::SafetensorsFile::open(dir / "out.safetensors");
  ASSERT_TRUE(out.is_ok());
  EXPECT_TRUE(out->contains("a.weight"));
  EXPECT_TRUE(out->contains("d.bias"));
  EXPECT_TRUE(out->contains("b.weight.codes"));
  EXPECT_TRUE(out->contains("c.weight.codes"));
  EXPECT_NE(r.out.find("copied a.weight: matches --skip"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("copied d.bias: matches --skip"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("copied ids: dtype I64"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("copied temp: scalar"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("copied norm.weight: last dimension 24 is not a multiple of 16"), std::string::npos) << r.out;
  // One summary row per quantized tensor: b.weight and c.weight.
  EXPECT_NE(r.out.find("quantized 2 tensors"), std::string::npos) << r.out;
}

TEST_F(QuantizeCli, ModeloptLayout) {
  RunResult r = run_nibble(dir.path, "quantize '" + dir / "in.safetensors" + "' '" + dir / "mo.safetensors" +
                                         "' --format nvfp4 --layout modelopt --skip bias");
  ASSERT_EQ(r.code, 0) << r.err;
  auto in = io::SafetensorsFile::open(dir / "in.safetensors");
  auto out = io::SafetensorsFile::open(dir / "mo.safetensors");
  ASSERT_TRUE(out.is_ok());
  for (const std::string n : {"a.weight", "b.weight", "c.weight"}) {
    SCOPED_TRACE(n);
    Tensor x = *in->get(n);
    const int64_t K = x.dim(-1);
    Tensor w = *out->get(n), s = *out->get(n + "_scale"), s2 = *out->get(n + "_scale_2");
    EXPECT_EQ(w.dtype(), DType::kU8);
    EXPECT_EQ(w.shape(), with_last(x.shape(), K / 2));
    EXPECT_EQ(s.dtype(), DType::kF8E4M3);
    EXPECT_EQ(s.shape(), with_last(x.shape(), K / 16));
    EXPECT_EQ(s2.dtype(), DType::kF32);
    EXPECT_EQ(s2.shape(), Shape{});
    Expected e = reference(x, Case{"nvfp4", "nvfp4"}, 0);
    EXPECT_EQ(bytes_of(w), e.codes);
    EXPECT_EQ(bytes_of(s), e.scales);
    EXPECT_EQ(s2.data<float>()[0], e.amax / 2688.0f);  // decode direction
  }
  EXPECT_TRUE(out->contains("d.bias"));       // skipped
  EXPECT_TRUE(out->contains("norm.weight"));  // K = 24
  auto hf = nlohmann::json::parse(slurp(dir.path / "hf_quant_config.json"));
  EXPECT_EQ(hf.at("quantization").at("quant_algo"), "NVFP4");
  EXPECT_EQ(hf.at("quantization").at("group_size"), 16);
  EXPECT_EQ(hf.at("quantization").at("exclude_modules"), nlohmann::json::array({"norm"}));
  EXPECT_EQ(nlohmann::json::parse(out->metadata().at("hf_quant_config")), hf);
}

TEST_F(QuantizeCli, CompressedTensorsLayout) {
  RunResult r = run_nibble(dir.path, "quantize '" + dir / "in.safetensors" + "' '" + dir / "ct.safetensors" +
                                         "' --format nvfp4 --layout compressed-tensors");
  ASSERT_EQ(r.code, 0) << r.err;
  auto in = io::SafetensorsFile::open(dir / "in.safetensors");
  auto out = io::SafetensorsFile::open(dir / "ct.safetensors");
  ASSERT_TRUE(out.is_ok());
  for (const std::string n : {"a.weight", "b.weight", "d.bias"}) {
    SCOPED_TRACE(n);
    Tensor x = *in->get(n);
    const int64_t K = x.dim(-1);
    EXPECT_FALSE(out->contains(n));
    Tensor w = *out->get(n + "_packed"), s = *out->get(n + "_scale"), g = *out->get(n + "_global_scale");
    EXPECT_EQ(w.dtype(), DType::kU8);
    EXPECT_EQ(w.shape(), with_last(x.shape(), K / 2));
    EXPECT_EQ(s.dtype(), DType::kF8E4M3);
    EXPECT_EQ(g.dtype(), DType::kF32);
    EXPECT_EQ(g.shape(), Shape{1});
    size_t idx = 0;
    auto names = in->names();
    while (names[idx] != n) ++idx;
    Expected e = reference(x, Case{"nvfp4", "nvfp4"}, idx);
    EXPECT_EQ(bytes_of(w), e.codes);
    EXPECT_EQ(bytes_of(s), e.scales);
    EXPECT_EQ(g.data<float>()[0], 2688.0f / e.amax);  // encode direction (amax > 0 here)
  }
  auto qc = nlohmann::json::parse(out->metadata().at("quantization_config"));
  EXPECT_EQ(qc.at("format"), "nvfp4-pack-quantized");
}

TEST_F(QuantizeCli, StochasticRoundingIsDeterministicBySeed) {
  auto quantize = [&](const std::string& out, const std::string& flags) {
    RunResult r = run_nibble(dir.path, "quantize '" + dir / "in.safetensors" + "' '" + dir / out + "' " + flags);
    EXPECT_EQ(r.code, 0) << r.err;
    auto f = io::SafetensorsFile::open(dir / out);
    EXPECT_TRUE(f.is_ok());
    return bytes_of(*f->get("a.weight.codes"));
  };
  auto s1 = quantize("s1.safetensors", "--format nvfp4 --rounding sr --seed 11");
  auto s1b = quantize("s1b.safetensors", "--format nvfp4 --rounding sr --seed 11");
  auto s2 = quantize("s2.safetensors", "--format nvfp4 --rounding sr --seed 12");
  auto rtn = quantize("rtn.safetensors", "--format nvfp4");
  EXPECT_EQ(s1, s1b);
  // 8192 elements: a different seed (or RTN) agreeing on every code has probability ~0.
  EXPECT_NE(s1, s2);
  EXPECT_NE(s1, rtn);
  // Whole files are identical for the same seed (atomic writer, deterministic order).
  EXPECT_EQ(slurp(dir.path / "s1.safetensors"), slurp(dir.path / "s1b.safetensors"));
}

TEST_F(QuantizeCli, ShardedCheckpointFolder) {
  // An HF-style sharded folder (model-0000i-of-0000n.safetensors + index) is read as one file;
  // SR streams follow the tensor order across shards.
  fs::create_directories(dir.path / "sharded");
  ASSERT_TRUE(io::write_safetensors_sharded(dir / "sharded", test_checkpoint(), 20000).is_ok());
  ASSERT_TRUE(fs::exists(dir.path / "sharded" / "model.safetensors.index.json"));
  RunResult r = run_nibble(dir.path, "quantize '" + dir / "sharded" + "' '" + dir / "q.safetensors" +
                                         "' --format nvfp4 --rounding sr --seed 5");
  ASSERT_EQ(r.code, 0) << r.err;
  auto in = io::SafetensorsFile::open(dir / "sharded");
  auto out = io::SafetensorsFile::open(dir / "q.safetensors");
  ASSERT_TRUE(in.is_ok() && out.is_ok());
  const auto names = in->names();
  for (size_t i = 0; i < names.size(); ++i) {
    Tensor x = *in->get(names[i]);
    if (!eligible(x, "nvfp4")) continue;
    Expected e = reference(x, Case{"nvfp4", "nvfp4", false, fm::MxScaleRule::kFloor, true, 5}, i);
    EXPECT_EQ(bytes_of(*out->get(names[i] + ".codes")), e.codes) << names[i];
  }
}

TEST_F(QuantizeCli, BadFlagCombinationsExitTwoWithOneLine) {
  const std::vector<std::string> bad = {
      "--format nvfp4 --scale-rule ocp",
      "--format nvfp4 --seed 3",
      "--format mxfp4 --layout modelopt",
      "--format nvfp4-2level --layout compressed-tensors",
      "--format mxfp4 --block 16x16",
      "--format nvfp4 --block 16x16 --rounding sr",
      "--format mxfp8 --rounding sr",
      "--format mxfp8 --scale-rule ceil",
      "--format nvfp5",
      "--format nvfp4 --layout gguf",
      "--format nvfp4 --rounding up",
      "--format nvfp4 --skip '('",
      "",  // --format is required
  };
  for (const std::string& flags : bad) {
    SCOPED_TRACE(flags);
    RunResult r = run_nibble(dir.path, "quantize '" + dir / "in.safetensors" + "' '" + dir / "bad.safetensors" + "' " + flags);
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_EQ(r.err_lines(), 1) << r.err;
    EXPECT_FALSE(fs::exists(dir.path / "bad.safetensors"));
  }
}

TEST_F(QuantizeCli, BadInputExitsNonZeroWithOneLine) {
  {
    RunResult r = run_nibble(dir.path, "quantize '" + dir / "missing.safetensors" + "' '" + dir / "o.safetensors" +
                                           "' --format nvfp4");
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_EQ(r.err_lines(), 1) << r.err;
    EXPECT_NE(r.err.find("nibble quantize: "), std::string::npos) << r.err;
  }
  {
    std::ofstream(dir / "junk.safetensors") << "this is not a safetensors file at all";
    RunResult r = run_nibble(dir.path, "quantize '" + dir / "junk.safetensors" + "' '" + dir / "o.safetensors" +
                                           "' --format nvfp4");
    EXPECT_EQ(r.code, 1) << r.err;
    EXPECT_EQ(r.err_lines(), 1) << r.err;
  }
  EXPECT_FALSE(fs::exists(dir.path / "o.safetensors"));
}

}  // namespace
}  // namespace nibble::tools::test
