// Memory of the linear recipes (issue #13 item 4), counted on the CPU backend's memory_stats: a
// linear keeps only its saved operands in compact form (BF16 bits, or codes + scales), every
// transient operand comes from the LinearWorkspace that all linears of a model share, so a second
// linear of the same shape adds exactly its saved bytes (written out per recipe below), and a
// repeated step allocates nothing. The saved-byte formulas are the per-linear figures of
// docs/architecture.md ("Recipe memory").
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "core/philox.h"
#include "model/linear.h"

namespace nibble::model {
namespace {

using backend::QuantFormat;
using backend::QuantizedTensor;

int64_t r64(int64_t bytes) { return (std::max<int64_t>(bytes, 1) + 63) / 64 * 64; }  // the CPU allocation unit
int64_t up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Bytes of one quantized operand's three parts, each its own allocation.
int64_t quantized_bytes(QuantFormat f, int64_t rows, int64_t cols) {
  const int64_t outer = QuantizedTensor::outer_count(f, rows, cols);
  return r64(QuantizedTensor::code_bytes(f, rows, cols)) + r64(QuantizedTensor::scale_bytes(f, rows, cols)) +
         (outer > 0 ? r64(outer * 4) : 0);
}

// What each recipe keeps between forward and backward, for x (M,K), w (N,K).
int64_t saved_bytes(const std::string& recipe, int64_t M, int64_t N, int64_t K) {
  if (recipe == "bf16") return r64(2 * M * K) + r64(2 * N * K);  // BF16 bits of x and w
  if (recipe == "nvfp4-nvidia")  // BF16 x (tokens padded to 16) for the wgrad, Ŵ as 2-D NVFP4
    return r64(2 * up(M, 16) * K) + quantized_bytes(QuantFormat::kNvfp4Te2d, N, K);
  // tetrajet-v2 without outliers: X̂, Ŵ as nvfp4-2level (rows padded to 128), and the channel
  // lists (K main ids, an empty outlier list of one element's allocation)
  return quantized_bytes(QuantFormat::kNvfp4TwoLevel, up(M, 128), K) +
         quantized_bytes(QuantFormat::kNvfp4TwoLevel, up(N, 128), K) + r64(8 * K) + r64(8);
}

std::vector<float> randn(size_t n, uint64_t seed, float scale) {
  PhiloxStream r(seed, 3);
  std::vector<float> v(n);
  for (auto& x : v) x = scale * static_cast<float>(r.next_normal());
  return v;
}

class RecipeMemory : public ::testing::TestWithParam<std::string> {};

TEST_P(RecipeMemory, SecondLinearAddsOnlyItsSavedOperandsAndSteadyStateAllocatesNothing) {
  const int64_t M = 200, N = 96, K = 256;  // M pads to 208 (TE) and 256 (2-level)
  backend::Backend& be = backend::cpu_backend();
  RecipeConfig cfg;
  cfg.name = GetParam();
  LinearInfo info;
  info.N = N, info.K = K, info.num_blocks = 1;
  auto x = randn(M * K, 1, 1.0f), w = randn(N * K, 2, 0.05f), dy = randn(M * N, 3, 1e-3f);
  std::vector<float> y(M * N), dx(M * K), dw(N * K, 0.0f);
  LinearWorkspace workspace;
  std::unique_ptr<LinearRecipe> lin[2];
  for (auto& l : lin) l = make_linear_recipe(cfg, info).value();
  auto step = [&](LinearRecipe& l, int64_t s) {
    LinearCall call{s, 9, 0, s, true, &workspace};
    l.forward(be, y.data(), x.data(), w.data(), M, N, K, call);
    l.backward(be, dx.data(), dw.data(), dy.data(), M, N, K, call);
  };
  const int64_t before = be.memory_stats().in_use_bytes;
  step(*lin[0], 0);
  const int64_t after_first = be.memory_stats().in_use_bytes;
  step(*lin[1], 0);
  const int64_t after_second = be.memory_stats().in_use_bytes;
  EXPECT_EQ(after_second - after_first, saved_bytes(cfg.name, M, N, K)) << cfg.name;
  // the first linear also grew the shared workspace: everything beyond its saved bytes is there
  // (workspace.bytes() counts requested bytes; each of its allocations rounds up by < 64)
  const int64_t transient = after_first - before - saved_bytes(cfg.name, M, N, K);
  EXPECT_GE(transient, workspace.bytes()) << cfg.name;
  EXPECT_LT(transient, workspace.bytes() + 64 * (LinearWorkspace::kSlots + 3 * LinearWorkspace::kQuantSlots))
      << cfg.name;
  be.reset_peak_memory();
  step(*lin[0], 1);
  step(*lin[1], 1);
  EXPECT_EQ(be.memory_stats().peak_bytes, after_second) << cfg.name << ": a repeated step allocated";
  EXPECT_EQ(be.memory_stats().in_use_bytes, after_second) << cfg.name;
}

INSTANTIATE_TEST_SUITE_P(Recipes, RecipeMemory, ::testing::Values("bf16", "nvfp4-nvidia", "tetrajet-v2"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

}  // namespace
}  // namespace nibble::model
