// The FP4 recipes' grouped experts (nvfp4-nvidia, tetrajet-v2; issue #13) give the per-expert
// loop's bits exactly on the CPU backend: each expert's own instance quantizes its operands (own
// amax, SR streams, RHT signs, outlier channels) into the grouped buffers, and the CPU's grouped
// GEMMs are the per-expert GEMMs. Ragged experts with empty ones, strided weights as the model
// lays them out, dW accumulated onto nonzero values, two steps (so the second forward runs on
// state the first left); with outliers, experts that calibrated on different rows (then the
// shapes differ and each expert runs its own GEMMs) and experts that agree.
#include <cstring>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "core/philox.h"
#include "model/linear.h"
#include "model/recipe_tetrajet_v2.h"

namespace nibble::model {
namespace {

std::vector<float> randn(size_t n, uint64_t seed) {
  PhiloxStream r(seed, 5);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(r.next_normal());
  return v;
}

struct Experts {
  std::vector<std::unique_ptr<LinearRecipe>> own;
  std::vector<LinearRecipe*> ptr;
};

Experts make_experts(const RecipeConfig& c, int64_t E, int64_t N, int64_t K) {
  Experts x;
  for (int64_t e = 0; e < E; ++e) {
    LinearInfo info;
    info.id = static_cast<int>(10 + e), info.kind = LinearKind::kExpertGateUp, info.expert = static_cast<int>(e);
    info.N = N, info.K = K, info.num_blocks = 1;
    auto r = make_linear_recipe(c, info);
    EXPECT_TRUE(r.is_ok()) << r.status().message();
    x.own.push_back(std::move(r).value());
    x.ptr.push_back(x.own.back().get());
  }
  return x;
}

bool same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Runs `steps` forward + backward pairs grouped and as the per-expert loop; offsets per step.
// Returns the grouped experts.
Experts expect_grouped_equals_loop(const RecipeConfig& c, const std::vector<std::vector<int64_t>>& offsets_per_step,
                                int64_t N = 32, int64_t K = 48) {
  backend::Backend& be = backend::cpu_backend();
  const int64_t E = static_cast<int64_t>(offsets_per_step[0].size()) - 1, stride = N * K + 16;
  Experts grouped = make_experts(c, E, N, K), loop = make_experts(c, E, N, K);
  const std::vector<float> w = randn((E - 1) * stride + N * K, 81);
  std::vector<float> dwg = randn(w.size(), 82), dwl = dwg;
  const std::vector<float> dw0 = dwg;
  LinearWorkspace wsg, wsl;
  for (size_t step = 0; step < offsets_per_step.size(); ++step) {
    const std::vector<int64_t>& off = offsets_per_step[step];
    const int64_t rows = off[E];
    const std::vector<float> x = randn(rows * K, 90 + step), dy = randn(rows * N, 95 + step);
    std::vector<LinearCall> calls(E), callsl(E);
    for (int64_t e = 0; e < E; ++e) {
      calls[e] = LinearCall{static_cast<int64_t>(step), 1234, static_cast<int>(10 + e), static_cast<int64_t>(step),
                            true, &wsg};
      callsl[e] = calls[e], callsl[e].workspace = &wsl;
    }
    ExpertGroup g;
    g.E = E, g.rows = rows, g.w_stride = stride;
    ExpertGroup gg = g, gl = g;
    gg.recipes = grouped.ptr.data(), gg.calls = calls.data(), gg.offsets_host = off.data();
    gl.recipes = loop.ptr.data(), gl.calls = callsl.data(), gl.offsets_host = off.data();

    std::vector<float> yg(rows * N, -1.0f), yl(rows * N, -2.0f);
    grouped.ptr[0]->forward_experts(be, yg.data(), x.data(), w.data(), N, K, gg);
    loop.ptr[0]->LinearRecipe::forward_experts(be, yl.data(), x.data(), w.data(), N, K, gl);  // the default loop
    EXPECT_TRUE(same(yg, yl)) << c.name << " step " << step;

    std::vector<float> dxg(rows * K, -1.0f), dxl(rows * K, -2.0f);
    grouped.ptr[0]->backward_experts(be, dxg.data(), dwg.data(), dy.data(), N, K, gg);
    loop.ptr[0]->LinearRecipe::backward_experts(be, dxl.data(), dwl.data(), dy.data(), N, K, gl);
    EXPECT_TRUE(same(dxg, dxl)) << c.name << " step " << step;
    EXPECT_TRUE(same(dwg, dwl)) << c.name << " step " << step;
  }
  // an expert no step routed a row to keeps its gradient; a routed one's changed
  bool any_changed = false;
  for (int64_t e = 0; e < E; ++e) {
    bool routed = false;
    for (const auto& off : offsets_per_step) routed |= off[e + 1] > off[e];
    const bool unchanged = std::memcmp(dwg.data() + e * stride, dw0.data() + e * stride, N * K * sizeof(float)) == 0;
    if (!routed) EXPECT_TRUE(unchanged) << e;
    any_changed |= routed && !unchanged;
  }
  EXPECT_TRUE(any_changed);
  return grouped;
}

std::vector<size_t> outlier_counts(const Experts& x) {
  std::vector<size_t> n;
  for (LinearRecipe* r : x.ptr) n.push_back(static_cast<TetraJetV2LinearRecipe*>(r)->outlier_channels().size());
  return n;
}

const std::vector<std::vector<int64_t>> kOffsets = {{0, 3, 3, 40, 41, 41, 200}, {0, 0, 17, 18, 150, 150, 151}};

TEST(Fp4Experts, Nvfp4NvidiaGroupedEqualsThePerExpertLoopBitwise) {
  RecipeConfig c;
  c.name = "nvfp4-nvidia";
  expect_grouped_equals_loop(c, kOffsets);
}

TEST(Fp4Experts, TetraJetV2GroupedEqualsThePerExpertLoopBitwise) {
  RecipeConfig c;
  c.name = "tetrajet-v2";  // the default switches: the fused backward operands
  expect_grouped_equals_loop(c, kOffsets);
  c.alignment = false, c.sr = false, c.rht = false;  // the unfused paths
  expect_grouped_equals_loop(c, kOffsets, 40, 64);
}

// Outliers selected at step 1 from the calibration of step 0. First, expert 1 gets no row at step
// 0: it selects no channels, the others 16, so the shapes differ and each expert runs its own
// GEMMs; then every expert is routed at step 0 and all agree (the grouped GEMMs with outliers).
TEST(Fp4Experts, TetraJetV2OutliersGroupedEqualsThePerExpertLoopBitwise) {
  RecipeConfig c;
  c.name = "tetrajet-v2";
  c.outliers.enabled = true;
  c.outliers.fraction = 0.25;
  c.outliers.round_to = 16;
  c.outliers.calibration_start = 0;
  c.outliers.calibration_end = 0;
  Experts differ = expect_grouped_equals_loop(c, {{0, 5, 5, 40}, {0, 9, 30, 31}, {0, 2, 20, 60}}, 32, 64);
  EXPECT_EQ(outlier_counts(differ), (std::vector<size_t>{16, 0, 16}));
  Experts agree = expect_grouped_equals_loop(c, {{0, 5, 6, 40}, {0, 9, 30, 31}, {0, 0, 20, 60}}, 32, 64);
  EXPECT_EQ(outlier_counts(agree), (std::vector<size_t>{16, 16, 16}));
  c.alignment = false;  // the unfused dgrad with outliers
  expect_grouped_equals_loop(c, {{0, 5, 6, 40}, {0, 9, 30, 31}}, 32, 64);
}

}  // namespace
}  // namespace nibble::model
