// Tests of the model, recipes and optimizer on the backend seam: training steps of the tiny dense
// and tiny MoE configs (configs/tiny-*.json) through an explicitly made CpuBackend equal the
// default path (backend::cpu_backend()) bit for bit, every recipe and every tetrajet-v2 switch
// (outlier calibration and selection, OsciReset snapshot, window and decision all fall inside
// the three steps); parameters and gradients round-trip exactly through download / upload.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "core/parallel.h"
#include "core/philox.h"
#include "model/transformer.h"
#include "train/optimizer.h"
#include "train/oscireset.h"

namespace nibble::train {
namespace {

// configs/<file> with 2 blocks and vocabulary 512 (seconds per test on one thread).
model::ModelConfig load_config(const char* file) {
  std::ifstream in(std::string(NIBBLE_SOURCE_DIR) + "/configs/" + file);
  EXPECT_TRUE(in.good()) << file;
  auto c = model::parse_model_config(nlohmann::json::parse(in));
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  model::ModelConfig cfg = c.value();
  cfg.vocab_size = 512;
  cfg.num_hidden_layers = 2;
  return cfg;
}

model::RecipeConfig recipe(const char* json) {
  auto r = model::parse_recipe_config(nlohmann::json::parse(json));
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return r.value();
}

// Every recipe; tetrajet-v2 with outliers calibrated at step 0 and selected at step 1, and
// OsciReset snapshotting at step 0, accumulating at step 1, deciding at step 2 (threshold 1 so
// resets happen).
std::vector<model::RecipeConfig> recipes() {
  return {recipe(R"({"name": "fp32"})"), recipe(R"({"name": "bf16"})"), recipe(R"({"name": "nvfp4-nvidia"})"),
          recipe(R"({"name": "tetrajet-v2"})"),
          recipe(R"({"name": "tetrajet-v2", "alignment": false, "sr": false, "outcontrol": {"rht": false}})"),
          recipe(R"({"name": "tetrajet-v2", "outcontrol": {"rht": true, "outliers": {"enabled": true,
             "fraction": 0.1, "round_to": 16, "calibration_start": 0, "calibration_end": 0}},
             "oscireset": {"enabled": true, "threshold": 1.0, "window": 1, "period": 2, "start_step": 0}})")};
}

struct Trace {
  std::vector<double> losses, norms;
  std::vector<float> values, grads, exp_avg;
  int64_t resets = 0;
};

// `steps` optimizer steps on fixed random batches (B=2, T=32). be == nullptr: the default path
// (Model::create and AdamW without a backend argument).
Trace train(const model::ModelConfig& cfg, const model::RecipeConfig& rc, backend::Backend* be, int steps) {
  Trace tr;
  auto created = be ? model::Model::create(cfg, rc, be) : model::Model::create(cfg, rc);
  EXPECT_TRUE(created.is_ok()) << created.status().message();
  auto m = std::move(created).value();
  m->init_weights(21);
  set_recipe_total_steps(*m, steps);
  backend::Backend& mb = m->backend();
  EXPECT_EQ(&mb, be ? be : &backend::cpu_backend());
  AdamW opt = be ? AdamW(AdamWConfig{}, be) : AdamW(AdamWConfig{});
  std::vector<ParamView> views;
  for (auto& p : m->param_refs()) views.push_back({p.name, p.value, p.grad, p.numel, p.weight_decay});
  const int64_t B = 2, T = 32;
  PhiloxStream rng(8, 3);
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (int s = 0; s < steps; ++s) {
    for (int64_t i = 0; i < B * T; ++i) {
      tok[i] = static_cast<int32_t>(rng.next_below(cfg.vocab_size));
      tgt[i] = i % 7 == 6 ? -100 : static_cast<int32_t>(rng.next_below(cfg.vocab_size));
    }
    m->set_step(s, 77);
    m->set_micro_step(s);
    m->zero_grad();
    tr.losses.push_back(m->forward_backward(tok.data(), tgt.data(), B, T, model::LossOptions{1e-4}).loss);
    GradNorm gn = be ? global_grad_norm(views, 1.0, 1.0f, *be) : global_grad_norm(views, 1.0, 1.0f);
    tr.norms.push_back(gn.norm);
    EXPECT_TRUE(opt.step(views, 1e-3, gn.clip_scale).is_ok());
    tr.resets += recipe_after_optimizer_step(*m, s);
  }
  tr.values.resize(m->num_params());
  tr.grads.resize(m->num_params());
  m->download_parameters(tr.values.data());
  m->download_gradients(tr.grads.data());
  tr.exp_avg = *opt.exp_avg("model.layers.0.self_attn.q_proj.weight");
  return tr;
}

void expect_same_bits(const Trace& a, const Trace& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  EXPECT_EQ(0, std::memcmp(a.losses.data(), b.losses.data(), a.losses.size() * sizeof(double)));
  EXPECT_EQ(0, std::memcmp(a.norms.data(), b.norms.data(), a.norms.size() * sizeof(double)));
  ASSERT_EQ(a.values.size(), b.values.size());
  EXPECT_EQ(0, std::memcmp(a.values.data(), b.values.data(), a.values.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.grads.data(), b.grads.data(), a.grads.size() * sizeof(float)));
  ASSERT_EQ(a.exp_avg.size(), b.exp_avg.size());
  EXPECT_EQ(0, std::memcmp(a.exp_avg.data(), b.exp_avg.data(), a.exp_avg.size() * sizeof(float)));
  EXPECT_EQ(a.resets, b.resets);
}

void check_explicit_backend(const char* config_file) {
  set_num_threads(1);  // results do not depend on it; small ops are faster without OpenMP workers
  const model::ModelConfig cfg = load_config(config_file);
  auto be = backend::make_backend("cpu");
  ASSERT_TRUE(be.is_ok()) << be.status().message();
  ASSERT_NE(be.value().get(), &backend::cpu_backend());
  for (const model::RecipeConfig& rc : recipes()) {
    SCOPED_TRACE(rc.raw.dump());
    Trace a = train(cfg, rc, nullptr, 3);
    Trace b = train(cfg, rc, be.value().get(), 3);
    expect_same_bits(a, b);
    // the run did something: finite, changing losses
    EXPECT_TRUE(std::isfinite(a.losses[0]) && std::isfinite(a.losses[2]));
    EXPECT_NE(a.losses[0], a.losses[1]);
    if (rc.oscireset.enabled) {
      EXPECT_GT(a.resets, 0);
    }
  }
}

TEST(BackendSeam, TinyDenseStepsThroughAnExplicitCpuBackendEqualTheDefault) {
  check_explicit_backend("tiny-dense.json");
}

TEST(BackendSeam, TinyMoeStepsThroughAnExplicitCpuBackendEqualTheDefault) {
  check_explicit_backend("tiny-moe.json");
}

// download -> upload into a fresh model reproduces the parameters, gradients and the loss exactly.
TEST(BackendSeam, ParametersAndGradientsRoundTripExactly) {
  set_num_threads(1);
  for (const char* file : {"tiny-dense.json", "tiny-moe.json"}) {
    SCOPED_TRACE(file);
    const model::ModelConfig cfg = load_config(file);
    const model::RecipeConfig rc = recipe(R"({"name": "bf16"})");
    auto a = model::Model::create(cfg, rc).value();
    auto b = model::Model::create(cfg, rc).value();
    a->init_weights(3);
    const int64_t n = a->num_params(), B = 1, T = 16;
    std::vector<int32_t> tok(B * T), tgt(B * T);
    for (int64_t i = 0; i < B * T; ++i) tok[i] = static_cast<int32_t>((i * 37) % cfg.vocab_size), tgt[i] = tok[i];
    a->zero_grad();
    const double la = a->forward_backward(tok.data(), tgt.data(), B, T).loss;

    std::vector<float> v(n), g(n), v2(n), g2(n);
    a->download_parameters(v.data());
    a->download_gradients(g.data());
    b->upload_parameters(v.data());
    b->upload_gradients(g.data());
    b->download_parameters(v2.data());
    b->download_gradients(g2.data());
    EXPECT_EQ(0, std::memcmp(v.data(), v2.data(), n * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(g.data(), g2.data(), n * sizeof(float)));
    // the copies see the parameters where param_refs() says they are
    const auto& p = b->param_refs().back();
    EXPECT_EQ(0, std::memcmp(v.data() + (p.value - b->flat_values()), p.value, p.numel * sizeof(float)));
    b->zero_grad();
    const double lb = b->forward_backward(tok.data(), tgt.data(), B, T).loss;
    EXPECT_EQ(la, lb);
    b->download_gradients(g2.data());
    EXPECT_EQ(0, std::memcmp(g.data(), g2.data(), n * sizeof(float)));
    // a changed upload changes the model
    v[0] += 1.0f;
    b->upload_parameters(v.data());
    b->download_parameters(v2.data());
    EXPECT_EQ(v2[0], v[0]);
  }
}

}  // namespace
}  // namespace nibble::train
