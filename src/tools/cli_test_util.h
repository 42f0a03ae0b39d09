// Helpers for the tests that drive the `nibble` binary (quantize_test.cpp, inspect_test.cpp):
// run it with std::system, capturing stdout/stderr into files and the exit code; a scratch
// folder per test; and a small generated HF-style checkpoint (written with the io writer) that
// covers every eligibility case of `nibble quantize` (dtypes, ranks, K multiples, non-floats).
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/bits.h"
#include "core/tensor.h"
#include "io/safetensors.h"

namespace nibble::tools::test {

namespace fs = std::filesystem;

inline std::string nibble_binary() { return std::string(NIBBLE_BINARY_DIR) + "/bin/nibble"; }

struct RunResult {
  int code = -1;
  std::string out, err;
  int err_lines() const {
    int n = 0;
    for (char c : err) n += c == '\n';
    return n;
  }
};

inline std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs `nibble <args>` (args are passed to the shell as written: quote what needs it).
inline RunResult run_nibble(const fs::path& dir, const std::string& args) {
  RunResult r;
  const std::string bin = nibble_binary();
  if (!fs::exists(bin)) {
    ADD_FAILURE() << "the nibble binary is missing at " << bin << ": build the `nibble` target (cmake --build <dir> --target nibble)";
    return r;
  }
  const fs::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  std::string cmd = "'" + bin + "' " + args + " > '" + out.string() + "' 2> '" + err.string() + "'";
  int status = std::system(cmd.c_str());
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

// A fresh scratch folder, removed at destruction.
struct ScratchDir {
  fs::path path;
  explicit ScratchDir(const std::string& name) {
    path = fs::temp_directory_path() / ("nibble_cli_test_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~ScratchDir() { fs::remove_all(path); }
  std::string operator/(const std::string& f) const { return (path / f).string(); }
};

inline Tensor gaussian(DType dt, const Shape& shape, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sigma);
  Tensor t(dt, shape);
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    float v = nd(rng);
    if (dt == DType::kF32) t.data<float>()[i] = v;
    else if (dt == DType::kBF16) static_cast<uint16_t*>(t.raw())[i] = f32_to_bf16_bits(v);
    else static_cast<uint16_t*>(t.raw())[i] = f32_to_f16_bits(v);
  }
  return t;
}

// The test checkpoint, in file order (= SR stream index):
//  0 a.weight   BF16 [32, 256]      every format (K % 128 == 0)
//  1 b.weight   F32  [3, 4, 128]    rank 3 -> [12, 128]; M=12 pads the 16x16 tile
//  2 c.weight   F16  [20, 64]       nvfp4/mx only (64 % 128 != 0)
//  3 norm.weight F32 [24]           copied (24 % 16 != 0)
//  4 ids        I64  [4]            copied (not floating)
//  5 temp       F32  []             copied (scalar)
//  6 d.bias     BF16 [48]           rank 1, nvfp4 (48 % 16 == 0), mx copied
inline std::vector<io::NamedTensor> test_checkpoint() {
  std::vector<io::NamedTensor> t;
  t.push_back({"a.weight", gaussian(DType::kBF16, {32, 256}, 1)});
  // b has an outlier-heavy row so the per-block scales differ.
  Tensor b = gaussian(DType::kF32, {3, 4, 128}, 2);
  b.data<float>()[5] = 40.0f;
  t.push_back({"b.weight", b});
  t.push_back({"c.weight", gaussian(DType::kF16, {20, 64}, 3, 0.02f)});
  t.push_back({"norm.weight", gaussian(DType::kF32, {24}, 4)});
  Tensor ids(DType::kI64, {4});
  for (int i = 0; i < 4; ++i) ids.data<int64_t>()[i] = 10 * i;
  t.push_back({"ids", ids});
  Tensor temp(DType::kF32, Shape{});
  temp.data<float>()[0] = 0.7f;
  t.push_back({"temp", temp});
  t.push_back({"d.bias", gaussian(DType::kBF16, {48}, 5)});
  return t;
}

}  // namespace nibble::tools::test
