// Tests of AdamW against a hand-computed two-step example, PyTorch-semantics decoupled weight
// decay, gradient-norm clipping (incl. NaN/Inf), accumulation helpers, and state export/import.
#include "train/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "core/parallel.h"

namespace nibble::train {
namespace {

// Hand derivation, lr = 0.1, wd = 0.1, b1 = 0.9, b2 = 0.95, eps = 1e-8, w0 = 1, g1 = 0.5,
// g2 = -0.25:
//  step 1: w = 1 * (1 - 0.1*0.1) = 0.99; m1 = 0.1*0.5 = 0.05; v1 = 0.05*0.25 = 0.0125;
//          bc1 = 0.1, bc2 = 0.05; update = (0.1/0.1) * 0.05 / (sqrt(0.0125)/sqrt(0.05) + 1e-8)
//          = 0.05 / (0.5 + 1e-8) = 0.099999998; w1 = 0.99 - 0.099999998 = 0.890000002.
//  step 2: w = 0.890000002 * 0.99 = 0.88110000198; m2 = 0.9*0.05 + 0.1*(-0.25) = 0.02;
//          v2 = 0.95*0.0125 + 0.05*0.0625 = 0.015; bc1 = 1 - 0.81 = 0.19, bc2 = 1 - 0.9025 = 0.0975;
//          update = (0.1/0.19) * 0.02 / (sqrt(0.015)/sqrt(0.0975) + 1e-8)
//                 = 0.526315789 * 0.02 / 0.392232280 = 0.026836944; w2 = 0.854263058.
//  Without weight decay: w1 = 1 - 0.099999998 = 0.900000002, w2 = 0.900000002 - 0.026836944
//          = 0.873163058.
// Tolerance: each value passes through ~10 f32 operations (each rounding to 2^-24 relative)
// from an O(1) input, so |error| < 10 * 2^-24 * 1 ~ 6e-7; we allow 2e-6.
TEST(AdamW, HandComputedTwoSteps) {
  float w[2] = {1.0f, 1.0f};  // [0]: with weight decay, [1]: without
  float g[2];
  std::vector<ParamView> params = {{"decayed", &w[0], &g[0], 1, true}, {"plain", &w[1], &g[1], 1, false}};
  AdamW opt(AdamWConfig{0.9, 0.95, 1e-8, 0.1});
  g[0] = g[1] = 0.5f;
  ASSERT_TRUE(opt.step(params, 0.1).is_ok());
  EXPECT_NEAR(w[0], 0.890000002, 2e-6);
  EXPECT_NEAR(w[1], 0.900000002, 2e-6);
  EXPECT_NEAR((*opt.exp_avg("decayed"))[0], 0.05, 1e-8);
  EXPECT_NEAR((*opt.exp_avg_sq("decayed"))[0], 0.0125, 1e-9);
  g[0] = g[1] = -0.25f;
  ASSERT_TRUE(opt.step(params, 0.1).is_ok());
  EXPECT_NEAR(w[0], 0.854263058, 2e-6);
  EXPECT_NEAR(w[1], 0.873163058, 2e-6);
  EXPECT_NEAR((*opt.exp_avg("decayed"))[0], 0.02, 1e-8);
  EXPECT_NEAR((*opt.exp_avg_sq("decayed"))[0], 0.015, 1e-9);
  EXPECT_EQ(opt.step_count(), 2);
}

// PyTorch AdamW decays the weight by lr*wd*w *before* the Adam update and independently of the
// gradient (decoupled, not L2 in the gradient): with a zero gradient m = v = 0, the Adam term is
// 0 / (0 + eps) = 0, so exactly w *= (1 - lr*wd) per step, whatever the moments' scale.
TEST(AdamW, DecoupledWeightDecayAsPyTorch) {
  std::vector<float> w = {2.0f, -3.0f, 0.5f}, g(3, 0.0f);
  std::vector<ParamView> params = {{"w", w.data(), g.data(), 3, true}};
  AdamW opt(AdamWConfig{0.9, 0.95, 1e-8, 0.1});
  for (int s = 0; s < 3; ++s) ASSERT_TRUE(opt.step(params, 0.01).is_ok());
  const float f = 1.0f - 0.001f;  // 1 - lr*wd in f32, applied 3 times (exact products up to 3 roundings)
  EXPECT_FLOAT_EQ(w[0], 2.0f * f * f * f);
  EXPECT_FLOAT_EQ(w[1], -3.0f * f * f * f);
  EXPECT_FLOAT_EQ(w[2], 0.5f * f * f * f);
  // The decay does not depend on the gradient scale: L2-in-gradient would be normalised away by
  // Adam (update ~ sign), decoupled decay stays lr*wd*w on top of the Adam step.
  float a = 1.0f, ga = 1e-3f, b = 1.0f, gb = 1e3f;
  AdamW oa, ob;
  ASSERT_TRUE(oa.step({{"p", &a, &ga, 1, true}}, 0.1).is_ok());
  ASSERT_TRUE(ob.step({{"p", &b, &gb, 1, true}}, 0.1).is_ok());
  // Both: 1*(1-0.01) - 0.1 * g/(|g| + eps) ~ 0.99 - 0.1; the eps term moves a by 0.1*1e-8/1e-3 = 1e-6.
  EXPECT_NEAR(a, 0.89, 2e-6);
  EXPECT_NEAR(b, 0.89, 1e-6);
}

TEST(AdamW, GradScaleEqualsScaledGradient) {
  std::vector<float> w1 = {0.3f, -0.7f}, w2 = w1, g = {0.2f, -0.4f}, g_half = {0.1f, -0.2f};
  AdamW a, b;
  ASSERT_TRUE(a.step({{"w", w1.data(), g.data(), 2, true}}, 0.05, 0.5f).is_ok());
  ASSERT_TRUE(b.step({{"w", w2.data(), g_half.data(), 2, true}}, 0.05).is_ok());
  EXPECT_EQ(w1, w2);  // 0.5 * g is exact in binary, so the same arithmetic follows
}

TEST(AdamW, Errors) {
  float w = 1, g = 1;
  AdamW opt;
  EXPECT_FALSE(opt.step({{"w", &w, &g, 1, true}}, -1.0).is_ok());
  EXPECT_FALSE(opt.step({{"w", &w, &g, 1, true}}, std::nan("")).is_ok());
  EXPECT_FALSE(opt.step({{"w", &w, &g, 1, true}, {"w", &w, &g, 1, true}}, 0.1).is_ok());
  ASSERT_TRUE(opt.step({{"w", &w, &g, 1, true}}, 0.1).is_ok());
  float w2[2] = {1, 2}, g2[2] = {1, 1};
  EXPECT_FALSE(opt.step({{"w", w2, g2, 2, true}}, 0.1).is_ok());  // numel changed
  AdamW bad(AdamWConfig{1.0, 0.95, 1e-8, 0.1});
  EXPECT_FALSE(bad.step({{"w", &w, &g, 1, true}}, 0.1).is_ok());
}

TEST(GradNorm, NormClipAndNonFinite) {
  std::vector<float> a = {3.0f, 0.0f}, b = {4.0f};
  std::vector<ParamView> params = {{"a", nullptr, a.data(), 2, true}, {"b", nullptr, b.data(), 1, true}};
  GradNorm n = global_grad_norm(params, 1.0);
  EXPECT_DOUBLE_EQ(n.norm, 5.0);
  EXPECT_TRUE(n.finite);
  EXPECT_FLOAT_EQ(n.clip_scale, static_cast<float>(1.0 / (5.0 + 1e-6)));  // torch: max_norm/(norm+1e-6)
  EXPECT_FLOAT_EQ(global_grad_norm(params, 10.0).clip_scale, 1.0f);     // under the limit: no clip
  EXPECT_FLOAT_EQ(global_grad_norm(params, 0.0).clip_scale, 1.0f);      // clipping off
  EXPECT_DOUBLE_EQ(global_grad_norm(params, 1.0, 0.5f).norm, 2.5);     // norm of the scaled grads
  b[0] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(global_grad_norm(params, 1.0).finite);
  b[0] = std::nanf("");
  GradNorm nan = global_grad_norm(params, 1.0);
  EXPECT_FALSE(nan.finite);
  EXPECT_FLOAT_EQ(nan.clip_scale, 1.0f);
}

TEST(GradNorm, LargeAndThreadCountIndependent) {
  const int64_t n = 300000;  // several 64K chunks
  std::vector<float> g(n);
  double expect = 0;
  for (int64_t i = 0; i < n; ++i) {
    g[i] = static_cast<float>((i % 7) - 3) * 0.01f;
    expect += static_cast<double>(g[i]) * g[i];
  }
  std::vector<ParamView> params = {{"g", nullptr, g.data(), n, true}};
  const int saved = num_threads();
  set_num_threads(1);
  double one = global_grad_norm(params, 1.0).norm;
  set_num_threads(2);
  double two = global_grad_norm(params, 1.0).norm;
  set_num_threads(saved);
  EXPECT_EQ(one, two);  // fixed chunks summed in order: bit-identical
  // Double sums of 3e5 terms: relative error ~ n * 2^-53 ~ 3e-11.
  EXPECT_NEAR(one, std::sqrt(expect), 1e-9 * std::sqrt(expect));
}

TEST(GradAccumulation, SumThenScale) {
  std::vector<float> acc(5, 0.0f), g1 = {1, 2, 3, 4, 5}, g2 = {5, 4, 3, 2, 1};
  accumulate_grad(acc.data(), g1.data(), 5);
  accumulate_grad(acc.data(), g2.data(), 5);
  scale_grad(acc.data(), 5, 0.5f);
  EXPECT_EQ(acc, std::vector<float>(5, 3.0f));
}

TEST(AdamW, ExportImportRoundTrip) {
  std::vector<float> w = {0.1f, 0.2f, 0.3f}, g = {0.01f, -0.02f, 0.03f}, u = {1.0f}, gu = {0.5f};
  std::vector<ParamView> params = {{"layers.0.w", w.data(), g.data(), 3, true}, {"norm", u.data(), gu.data(), 1, false}};
  AdamW a;
  ASSERT_TRUE(a.step(params, 1e-3).is_ok());
  ASSERT_TRUE(a.step(params, 1e-3).is_ok());
  auto state = a.export_state();
  ASSERT_EQ(state.size(), 5u);
  EXPECT_EQ(state[0].name, "optimizer.step");

  AdamW b;
  ASSERT_TRUE(b.import_state(state, params).is_ok());
  EXPECT_EQ(b.step_count(), 2);
  std::vector<float> wa = w, wb = w;
  std::vector<ParamView> pa = {{"layers.0.w", wa.data(), g.data(), 3, true}, {"norm", u.data(), gu.data(), 1, false}};
  float ub = u[0];
  std::vector<ParamView> pb = {{"layers.0.w", wb.data(), g.data(), 3, true}, {"norm", &ub, gu.data(), 1, false}};
  ASSERT_TRUE(a.step(pa, 1e-3).is_ok());
  ASSERT_TRUE(b.step(pb, 1e-3).is_ok());
  EXPECT_EQ(wa, wb);  // the restored optimizer continues identically

  // Through a safetensors file, as a checkpoint stores it.
  std::string path = ::testing::TempDir() + "nibble_optimizer_state.safetensors";
  ASSERT_TRUE(io::write_safetensors(path, state).is_ok());
  auto file = io::SafetensorsFile::open(path);
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  std::vector<io::NamedTensor> loaded;
  for (const auto& name : file->names()) loaded.push_back({name, *file->get(name)});
  AdamW c;
  ASSERT_TRUE(c.import_state(loaded, params).is_ok());
  auto again = c.export_state();
  ASSERT_EQ(again.size(), state.size());
  for (size_t i = 0; i < state.size(); ++i) {
    EXPECT_EQ(again[i].name, state[i].name);
    ASSERT_EQ(again[i].tensor.nbytes(), state[i].tensor.nbytes());
    EXPECT_EQ(std::memcmp(again[i].tensor.raw(), state[i].tensor.raw(), state[i].tensor.nbytes()), 0) << state[i].name;
  }
  EXPECT_EQ(c.step_count(), 2);
  std::remove(path.c_str());

  // Missing moment, wrong size, unknown extra tensor, missing step: errors naming the tensor.
  auto missing = state;
  missing.pop_back();
  Status s = AdamW().import_state(missing, params);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("optimizer.norm.exp_avg_sq"), std::string::npos) << s.message();
  auto wrong = state;
  for (auto& t : wrong)
    if (t.name == "optimizer.layers.0.w.exp_avg") t.tensor = Tensor(DType::kF32, {2});
  s = AdamW().import_state(wrong, params);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("has 2 elements"), std::string::npos) << s.message();
  auto extra = state;
  extra.push_back({"optimizer.ghost.exp_avg", Tensor(DType::kF32, {1})});
  EXPECT_FALSE(AdamW().import_state(extra, params).is_ok());
  auto nostep = std::vector<io::NamedTensor>(state.begin() + 1, state.end());
  EXPECT_FALSE(AdamW().import_state(nostep, params).is_ok());
}

}  // namespace
}  // namespace nibble::train
