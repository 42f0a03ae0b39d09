// Tests of the recipes inside a training loop on a tiny OLMo-2 model (vocab 256, 2 blocks,
// hidden 128): with bf16, nvfp4-nvidia, tetrajet-v2 and tetrajet-v2 + OutControl + OsciReset the
// loss of a fixed batch falls over 24 AdamW steps; the hook glue reaches every linear (OsciReset
// windows open, decide and count resets; outliers are selected after calibration) and the step
// cost of each recipe relative to bf16 is printed.
#include "train/oscireset.h"

#include <chrono>
#include <cstdio>

#include <gtest/gtest.h>

#include "core/parallel.h"
#include "core/philox.h"
#include "model/config.h"
#include "train/optimizer.h"
#include "train/outcontrol.h"

namespace nibble::train {
namespace {

model::ModelConfig tiny_config(const std::string& file = "tiny-dense.json") {
  auto cfg = model::load_model_config(std::string(NIBBLE_SOURCE_DIR) + "/configs/" + file);
  EXPECT_TRUE(cfg.is_ok());
  model::ModelConfig c = cfg.value();
  c.vocab_size = 256;
  c.num_hidden_layers = 2;
  return c;
}

struct TrainResult {
  double first = 0, last = 0, ms_per_step = 0;
  std::map<std::string, double> stats;
  int64_t resets = 0;
};

// 24 steps of AdamW (lr 3e-3) on one fixed batch (B=4, T=32 -> M = 128 tokens): memorising it
// must lower the loss for any working recipe.
TrainResult train(const nlohmann::json& recipe_json, int steps = 24, const std::string& config = "tiny-dense.json") {
  auto rc = model::parse_recipe_config(recipe_json);
  EXPECT_TRUE(rc.is_ok()) << rc.status().message();
  auto m = model::Model::create(tiny_config(config), rc.value()).value();
  m->init_weights(1);
  set_recipe_total_steps(*m, steps);
  const int64_t B = 4, T = 32;
  std::vector<int32_t> tokens(B * T), targets(B * T);
  PhiloxStream r(3, 0);
  for (auto& t : tokens) t = static_cast<int32_t>(r.next_u32() % 256);
  for (int64_t i = 0; i < B * T; ++i) targets[i] = i % T == T - 1 ? -100 : tokens[i + 1];
  AdamW opt;
  TrainResult res;
  auto t0 = std::chrono::steady_clock::now();
  for (int step = 1; step <= steps; ++step) {
    m->set_step(step, 42);
    m->zero_grad();
    auto lp = m->forward_backward(tokens.data(), targets.data(), B, T);
    if (step == 1) res.first = lp.loss;
    res.last = lp.loss;
    std::vector<ParamView> views;
    for (auto& p : m->param_refs()) views.push_back(ParamView{p.name, p.value, p.grad, p.numel, p.weight_decay});
    EXPECT_TRUE(opt.step(views, 3e-3).is_ok());
    res.resets += recipe_after_optimizer_step(*m, step);
  }
  res.ms_per_step = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
  res.stats = recipe_stats(*m);
  return res;
}

TEST(RecipesTraining, LossFallsWithEveryRecipeAndHooksRun) {
  // One thread: results do not depend on the thread count (parallel.h), and on a shared 2-core
  // machine OpenMP's spinning workers make these small per-op regions 10x slower, not faster.
  set_num_threads(1);
  auto bf16 = train("bf16");
  auto nv = train("nvfp4-nvidia");
  auto tj = train("tetrajet-v2");
  // full: OutControl (calibration steps 3..5, 10% rounded to 32 channels) + OsciReset from 60% of
  // the 24 steps (start 14): snapshot 18, window 2, decide at 21; snapshot 24 opens a window
  nlohmann::json full = {{"name", "tetrajet-v2"},
                         {"outcontrol", {{"rht", true}, {"outliers", {{"fraction", 0.1}, {"round_to", 32},
                                                                        {"calibration_start", 3}, {"calibration_end", 5}}}}},
                         {"oscireset", {{"start_fraction", 0.6}, {"period", 6}, {"window", 2}, {"threshold", 8.0}}}};
  auto fu = train(full);
  for (auto* r : {&bf16, &nv, &tj, &fu}) {
    // the first loss is ~ln(256) = 5.55; 24 steps on one batch must remove a clear part of it
    EXPECT_LT(r->last, r->first - 0.5) << r->first << " -> " << r->last;
  }
  EXPECT_EQ(fu.stats.at("oscireset.decisions"), 8.0);  // one decision (step 21) per linear, 8 linears
  EXPECT_EQ(fu.stats.at("oscireset.start_step"), 14.0);
  EXPECT_GT(fu.stats.at("oscireset.tracked"), 0.0);  // the window opened at step 24
  EXPECT_EQ(fu.stats.at("oscireset.resets_total"), static_cast<double>(fu.resets));
  EXPECT_EQ(fu.stats.at("outliers.selected"), 8.0);
  // K = 128 (qkv, attn_out, gate_up) -> 13 -> 32 channels; K = 384 (down) -> 39 -> 64; 2 blocks
  EXPECT_EQ(fu.stats.at("outliers.channels"), 2.0 * (3 * 32 + 64));
  std::printf("per-step ms (B=4,T=32, tiny-dense vocab 256): bf16 %.1f, nvfp4-nvidia %.1f (x%.2f), tetrajet-v2 %.1f "
              "(x%.2f), tetrajet-v2 full %.1f (x%.2f); losses %.3f->%.3f %.3f->%.3f %.3f->%.3f %.3f->%.3f; resets %lld\n",
              bf16.ms_per_step, nv.ms_per_step, nv.ms_per_step / bf16.ms_per_step, tj.ms_per_step,
              tj.ms_per_step / bf16.ms_per_step, fu.ms_per_step, fu.ms_per_step / bf16.ms_per_step, bf16.first, bf16.last,
              nv.first, nv.last, tj.first, tj.last, fu.first, fu.last, static_cast<long long>(fu.resets));
}

// MoE (tiny-moe, 2 blocks, 8 experts top-2): experts see arbitrary token counts, so the
// along-token quantizers pad M to 128 (tetrajet-v2) / 16 (nvfp4-nvidia) on every expert call.
TEST(RecipesTraining, MoeLossFallsWithTheFp4Recipes) {
  set_num_threads(1);
  nlohmann::json full = {{"name", "tetrajet-v2"},
                         {"outcontrol", {{"outliers", {{"fraction", 0.1}, {"round_to", 32}, {"calibration_start", 2},
                                                       {"calibration_end", 3}}}}},
                         {"oscireset", {{"start_step", 6}, {"period", 6}, {"window", 2}}}};
  for (const nlohmann::json& j : {nlohmann::json("nvfp4-nvidia"), full}) {
    auto r = train(j, 12, "tiny-moe.json");
    EXPECT_LT(r.last, r.first - 0.5) << j.dump() << ": " << r.first << " -> " << r.last;
  }
}

}  // namespace
}  // namespace nibble::train
