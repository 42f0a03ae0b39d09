// Tests of the linear-recipe seam: the registry (built-ins, unknown names, extension), the fp32
// recipe against a naive triple loop, and the bf16 recipe = fp32 GEMMs of bf16-rounded operands
// in all three GEMMs (forward, dgrad, wgrad), differing from fp32 within the rounding bound.
#include "model/linear.h"

#include <cmath>

#include <gtest/gtest.h>

#include "core/bits.h"
#include "core/philox.h"

namespace nibble::model {
namespace {

std::vector<float> randn(size_t n, uint64_t seed) {
  PhiloxStream r(seed, 3);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(r.next_normal());
  return v;
}

std::vector<float> rounded(const std::vector<float>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = round_to_bf16(v[i]);
  return o;
}

std::unique_ptr<LinearRecipe> make(const std::string& name) {
  RecipeConfig c;
  c.name = name;
  auto r = make_linear_recipe(c, LinearInfo{});
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return std::move(r).value();
}

TEST(LinearRegistry, BuiltinsUnknownAndExtension) {
  EXPECT_TRUE(has_linear_recipe("fp32"));
  EXPECT_TRUE(has_linear_recipe("bf16"));
  RecipeConfig c;
  c.name = "no-such-recipe";
  auto r = make_linear_recipe(c, LinearInfo{});
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("no-such-recipe"), std::string::npos);
  EXPECT_NE(r.status().message().find("bf16"), std::string::npos);
  // a new recipe plugs in by name and sees the LinearInfo (e.g. for bf16_last_blocks)
  register_linear_recipe("test-last-block-fp32", [](const RecipeConfig& cfg, const LinearInfo& info)
                                                     -> Result<std::unique_ptr<LinearRecipe>> {
    if (info.block >= info.num_blocks - cfg.bf16_last_blocks) return std::unique_ptr<LinearRecipe>(new Fp32LinearRecipe);
    return std::unique_ptr<LinearRecipe>(new Bf16LinearRecipe);
  });
  c.name = "test-last-block-fp32";
  c.bf16_last_blocks = 1;
  LinearInfo info;
  info.num_blocks = 4;
  info.block = 3;
  EXPECT_EQ(make_linear_recipe(c, info).value()->name(), "fp32");
  info.block = 2;
  EXPECT_EQ(make_linear_recipe(c, info).value()->name(), "bf16");
}

TEST(LinearRecipes, Fp32MatchesNaiveLoops) {
  const int64_t M = 6, N = 5, K = 7;
  auto x = randn(M * K, 1), w = randn(N * K, 2), dy = randn(M * N, 3);
  std::vector<float> y(M * N), dx(M * K), dw(N * K, 0.5f);
  auto r = make("fp32");
  r->forward(y.data(), x.data(), w.data(), M, N, K, LinearCall{});
  r->backward(dx.data(), dw.data(), dy.data(), M, N, K, LinearCall{});
  // binary32 sums of <= 7 products of O(1) values: |error| <= 7 * 6e-8 * sum|terms| (~10) < 1e-5
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(x[m * K + k]) * w[n * K + k];
      EXPECT_NEAR(y[m * N + n], s, 1e-5);
    }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0.5;
      for (int64_t m = 0; m < M; ++m) s += double(dy[m * N + n]) * x[m * K + k];
      EXPECT_NEAR(dw[n * K + k], s, 1e-5);
    }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (int64_t n = 0; n < N; ++n) s += double(dy[m * N + n]) * w[n * K + k];
      EXPECT_NEAR(dx[m * K + k], s, 1e-5);
    }
}

TEST(LinearRecipes, Bf16IsFp32OnRoundedOperandsInAllThreeGemms) {
  const int64_t M = 33, N = 17, K = 40;
  auto x = randn(M * K, 4), w = randn(N * K, 5), dy = randn(M * N, 6);
  auto bf = make("bf16"), fp = make("fp32");
  std::vector<float> y_bf(M * N), dx_bf(M * K), dw_bf(N * K, 0.f);
  bf->forward(y_bf.data(), x.data(), w.data(), M, N, K, LinearCall{});
  bf->backward(dx_bf.data(), dw_bf.data(), dy.data(), M, N, K, LinearCall{});
  // the same GEMMs on operands rounded beforehand: bit-identical
  auto xr = rounded(x), wr = rounded(w), dyr = rounded(dy);
  std::vector<float> y_r(M * N), dx_r(M * K), dw_r(N * K, 0.f);
  fp->forward(y_r.data(), xr.data(), wr.data(), M, N, K, LinearCall{});
  fp->backward(dx_r.data(), dw_r.data(), dyr.data(), M, N, K, LinearCall{});
  EXPECT_EQ(y_bf, y_r);
  EXPECT_EQ(dx_bf, dx_r);
  EXPECT_EQ(dw_bf, dw_r);
  // ... and differ from plain fp32 by at most the operand rounding: |a^ b^ - a b| <= (2u + u^2)|a b|
  // with u = 2^-9 (bf16 unit roundoff), plus binary32 accumulation (< K * 2^-24 * sum|ab|).
  std::vector<float> y(M * N);
  fp->forward(y.data(), x.data(), w.data(), M, N, K, LinearCall{});
  bool any_diff = false;
  const double u = std::ldexp(1.0, -9);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double abs_sum = 0;
      for (int64_t k = 0; k < K; ++k) abs_sum += std::fabs(double(x[m * K + k]) * w[n * K + k]);
      double bound = (2 * u + u * u) * abs_sum + 2 * K * std::ldexp(1.0, -24) * abs_sum;
      EXPECT_LE(std::fabs(double(y_bf[m * N + n]) - y[m * N + n]), bound);
      any_diff |= y_bf[m * N + n] != y[m * N + n];
    }
  EXPECT_TRUE(any_diff);
}

}  // namespace
}  // namespace nibble::model
