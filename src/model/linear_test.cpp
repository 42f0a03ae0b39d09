// Tests of the linear-recipe seam: the registry (built-ins, unknown names, extension), the fp32
// recipe against a naive triple loop, and the bf16 recipe = fp32 GEMMs of bf16-rounded operands
// in all three GEMMs (forward, dgrad, wgrad), differing from fp32 within the rounding bound.
#include "model/linear.h"

#include <cmath>
#include <cstring>

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

// bf16 experts grouped (one grouped GEMM per product, the CPU backend's per-group reference)
// give the per-expert loop's bits exactly: the same BF16 roundings and, on the CPU, the same
// per-group GEMMs. Ragged experts with empty ones, strided weights as the model lays them out,
// dW accumulated onto nonzero values (slack between experts untouched by both).
TEST(Bf16Experts, GroupedEqualsThePerExpertLoopBitwise) {
  backend::Backend& be = backend::cpu_backend();
  const int64_t E = 5, N = 12, K = 20, stride = N * K + 7;
  const std::vector<int64_t> off = {0, 3, 3, 20, 21, 21};
  const int64_t rows = off[E];
  const std::vector<float> x = randn(rows * K, 71), w = randn((E - 1) * stride + N * K, 72);
  const std::vector<float> dy = randn(rows * N, 73), dw0 = randn(w.size(), 74);
  std::vector<std::unique_ptr<LinearRecipe>> grouped, loop;
  std::vector<LinearRecipe*> gp, lp;
  for (int64_t e = 0; e < E; ++e) {
    grouped.push_back(make("bf16")), gp.push_back(grouped.back().get());
    loop.push_back(make("bf16")), lp.push_back(loop.back().get());
  }
  ASSERT_TRUE(gp[0]->runs_experts_grouped(be));
  EXPECT_FALSE(make("fp32")->runs_experts_grouped(be));
  std::vector<LinearCall> calls(E);
  ExpertGroup g;
  g.calls = calls.data(), g.E = E, g.rows = rows, g.w_stride = stride;
  ExpertGroup gg = g, gl = g;
  gg.recipes = gp.data(), gg.offsets = off.data();    // CPU backend memory is host memory
  gl.recipes = lp.data(), gl.offsets_host = off.data();

  std::vector<float> yg(rows * N, -1.0f), yl(rows * N, -2.0f);
  gp[0]->forward_experts(be, yg.data(), x.data(), w.data(), N, K, gg);
  lp[0]->LinearRecipe::forward_experts(be, yl.data(), x.data(), w.data(), N, K, gl);  // the default loop
  EXPECT_EQ(0, std::memcmp(yg.data(), yl.data(), yg.size() * sizeof(float)));

  std::vector<float> dxg(rows * K, -1.0f), dxl(rows * K, -2.0f), dwg = dw0, dwl = dw0;
  gp[0]->backward_experts(be, dxg.data(), dwg.data(), dy.data(), N, K, gg);
  lp[0]->LinearRecipe::backward_experts(be, dxl.data(), dwl.data(), dy.data(), N, K, gl);
  EXPECT_EQ(0, std::memcmp(dxg.data(), dxl.data(), dxg.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dwg.data(), dwl.data(), dwg.size() * sizeof(float)));
  // the empty experts' gradients are left as they were; a non-empty one's changed
  for (int64_t e : {1, 4})
    EXPECT_EQ(0, std::memcmp(dwg.data() + e * stride, dw0.data() + e * stride, N * K * sizeof(float))) << e;
  EXPECT_NE(0, std::memcmp(dwg.data() + 2 * stride, dw0.data() + 2 * stride, N * K * sizeof(float)));
}

}  // namespace
}  // namespace nibble::model
