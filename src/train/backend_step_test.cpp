// The training step on CUDA against the CPU oracle (issue #13 item 3): for the tiny dense and tiny
// MoE configs (configs/tiny-*.json) and every recipe, (a) one forward+backward from the same
// weights and tokens gives the same loss and gradients within bounds derived below, (b) 50 AdamW
// steps with the global-norm clip give loss curves that agree (and final weights, for fp32 and bf16), and (c) CUDA is
// deterministic: 5 steps twice are bit-identical, and a run saved after 3 steps (host copies of
// parameters, optimizer and recipe state), rebuilt and continued equals the uninterrupted run.
// Without the CUDA backend in the build or without a device every case skips, saying why, before
// doing any work (the CPU-only CI build compiles this file and runs nothing costly).
// NIBBLE_STEP_TEST_DEVICE=cpu runs the cases with a second CPU backend as the device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/philox.h"
#include "model/transformer.h"
#include "train/optimizer.h"
#include "train/oscireset.h"
#include "train/outcontrol.h"

#ifdef NIBBLE_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace nibble::train {
namespace {

// ---- the cases ------------------------------------------------------------------------------

// configs/<file> of this tree: $NIBBLE_SOURCE_DIR when set (the GPU machine runs the bundle from
// a copy of the tree elsewhere; scripts/gpu_check.sh sets it), else the tree this was built from.
model::ModelConfig load_config(const char* file) {
  const char* env = std::getenv("NIBBLE_SOURCE_DIR");
  std::ifstream in(std::string(env && *env ? env : NIBBLE_SOURCE_DIR) + "/configs/" + file);
  EXPECT_TRUE(in.good()) << file;
  auto c = model::parse_model_config(nlohmann::json::parse(in));
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  return c.value();
}

model::RecipeConfig recipe(const char* json) {
  auto r = model::parse_recipe_config(nlohmann::json::parse(json));
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return r.value();
}

// Every recipe: fp32, bf16, nvfp4-nvidia, tetrajet-v2 with its default switches, and tetrajet-v2
// with outliers (calibrated at step 0, selected from step 1) and OsciReset (snapshot at step 0,
// window 1, decision at step 2, every 2 steps, threshold 1 so that resets happen) switched on.
std::vector<model::RecipeConfig> recipes() {
  return {recipe(R"({"name": "fp32"})"), recipe(R"({"name": "bf16"})"), recipe(R"({"name": "nvfp4-nvidia"})"),
          recipe(R"({"name": "tetrajet-v2"})"),
          recipe(R"({"name": "tetrajet-v2", "outcontrol": {"rht": true, "outliers": {"enabled": true,
             "fraction": 0.1, "round_to": 16, "calibration_start": 0, "calibration_end": 0}},
             "oscireset": {"enabled": true, "threshold": 1.0, "window": 1, "period": 2, "start_step": 0}})")};
}

// The backend under test, or a skip reason. NIBBLE_STEP_TEST_DEVICE=cpu puts a second CPU backend
// in CUDA's place (opt-in, seconds to minutes: a check of this harness itself, where every
// comparison must come out equal and every run must complete).
std::unique_ptr<backend::Backend> make_device_backend(std::string* why) {
  if (const char* kind = std::getenv("NIBBLE_STEP_TEST_DEVICE"); kind && std::string(kind) == "cpu")
    return backend::make_backend("cpu").value();
#ifdef NIBBLE_HAVE_CUDA
  cuda::register_cuda_backend();
  auto r = backend::make_backend("cuda");
  if (r.is_ok()) return std::move(r).value();
  *why = "no CUDA device: " + r.status().message();
#else
  *why = "built without the CUDA backend (NIBBLE_CUDA=OFF)";
#endif
  return nullptr;
}

#define NIB_REQUIRE_DEVICE(var)                                 \
  std::string var##_why;                                        \
  std::unique_ptr<backend::Backend> var = make_device_backend(&var##_why); \
  if (!var) GTEST_SKIP() << var##_why

constexpr int64_t kB = 2, kT = 32;         // tokens per step: 64 (seconds per case on one CPU core)
constexpr uint64_t kInitSeed = 21, kStepSeed = 77;
constexpr double kLr = 1e-3, kMaxNorm = 1.0, kZLoss = 1e-4;

// Tokens and targets of step s (every 7th target ignored), the same on every backend.
void batch_of_step(const model::ModelConfig& cfg, int64_t s, std::vector<int32_t>* tok, std::vector<int32_t>* tgt) {
  PhiloxStream rng(8, static_cast<uint64_t>(s));
  tok->resize(kB * kT);
  tgt->resize(kB * kT);
  for (int64_t i = 0; i < kB * kT; ++i) {
    (*tok)[i] = static_cast<int32_t>(rng.next_below(cfg.vocab_size));
    (*tgt)[i] = i % 7 == 6 ? -100 : static_cast<int32_t>(rng.next_below(cfg.vocab_size));
  }
}

std::unique_ptr<model::Model> make_model(const model::ModelConfig& cfg, const model::RecipeConfig& rc,
                                         backend::Backend* be, int64_t total_steps) {
  auto created = model::Model::create(cfg, rc, be);
  EXPECT_TRUE(created.is_ok()) << created.status().message();
  if (!created.is_ok()) return nullptr;
  auto m = std::move(created).value();
  m->init_weights(kInitSeed);
  set_recipe_total_steps(*m, total_steps);
  return m;
}

std::vector<ParamView> views_of(model::Model& m) {
  std::vector<ParamView> v;
  for (auto& p : m.param_refs()) v.push_back({p.name, p.value, p.grad, p.numel, p.weight_decay});
  return v;
}

// ---- the tolerance of FP32 arithmetic in a different order --------------------------------------
// Both backends compute every product of the same FP32 (or BF16-exact) operands; what differs is
// the order of the sums (OpenBLAS vs cuBLASLt tiles, flash attention's online softmax vs two
// passes, tree vs sequential reductions) and expf/logf (<= 2 ulp apart). A dot product of length
// K summed in any order has error <= lambda * sqrt(K) * u * sum|a_i b_i| with probability
// >= 1 - 2 exp(-lambda^2 / 2) (Higham & Mary 2019, probabilistic rounding-error analysis), u =
// 2^-24; lambda = 6 (failure < 3e-8 per dot). Measured in the L2 norm of a whole tensor (where
// sum|a b| is of the order of |sum a b|), these relative errors add along the longest chain of
// dependent reductions: the forward and backward pass each go through L layers of 6 dependent
// GEMM-like reductions (QKV, Q K^T, P V, O, gate/up, down; MoE: router, expert up, expert down
// in place of gate/up and down) plus the LM head, so chain = 2 (6 L + 1). K_max: the longest
// reduction, max(hidden, intermediate, vocab, tokens); the vocabulary (the LM head's dgrad sums
// over V) dominates. Tiny dense: 2 * 25 * 6 * 64 * 2^-24 = 1.1e-3.
double fp32_order_tolerance(const model::ModelConfig& cfg) {
  const double u = std::ldexp(1.0, -24), lambda = 6.0;
  const double k_max = static_cast<double>(
      std::max({cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size, cfg.vocab_size, kB * kT}));
  const double chain = 2.0 * (6.0 * cfg.num_hidden_layers + 1.0);
  return chain * lambda * std::sqrt(k_max) * u;
}

// ---- the tolerance of rounding decisions that flip -------------------------------------------------
// With BF16 or FP4 roundings in the step, an FP32-order difference can move an operand across a
// rounding boundary (or an SR threshold, or change a block's amax and so its scale): that element
// then lands one quantization step away, and the difference propagates and makes further
// boundary crossings downstream. Individual flips cannot be bounded elementwise, so gradients are
// compared in the L2 norm of each tensor against the recipe's own quantization noise, measured
// on the CPU as e = g_recipe - g_fp32 from the same weights and tokens. If every rounding decision
// of the step flipped independently, the CUDA result would be a second, independent realisation
// of that noise: |g_cuda - g_cpu| = |e_cuda - e_cpu| <= |e_cuda| + |e_cpu| ~ 2 |e| (triangle
// inequality, to first order), and ~sqrt(2) |e| for uncorrelated noise. Allowed: 2 |e| * 1.25 (the
// two realisations' norms differ by sampling: a tensor has >= 128 elements, so the norm of a sum of
// >= 128 independent errors varies by well under 25%) plus the FP32-order term. A wrong op (a
// missing scale, a transposed operand, the wrong SR stream) makes errors of the order of |g|
// itself, far beyond the recipe's noise (measured relative noise is printed with each case).
// fp32 has e = 0: only the FP32-order term is left.
constexpr double kFlipFactor = 2.0 * 1.25;

double l2(const float* a, const float* b, int64_t n) {  // |a - b|_2 (b null: |a|_2)
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - (b ? static_cast<double>(b[i]) : 0.0);
    s += d * d;
  }
  return std::sqrt(s);
}

struct Pass {
  double loss = 0;
  std::vector<float> grads;       // (num_params) flat, model order
  std::vector<float> token_ce;    // (B*T) per-token cross-entropy of the same forward
  std::vector<int32_t> routing;   // (moe layers, B*T, top_k) expert ids used
};

// One forward+backward at step 0 of `m` (fresh weights); routing forced when `forced` is given.
// The per-token CE comes from a forward_loss with the same step and micro-step (same SR streams).
Pass one_pass(model::Model& m, const model::ModelConfig& cfg, const std::vector<int32_t>* forced) {
  Pass p;
  std::vector<int32_t> tok, tgt;
  batch_of_step(cfg, 0, &tok, &tgt);
  const int64_t slots = m.num_moe_layers() * kB * kT * std::max<int64_t>(cfg.num_experts_per_tok, 1);
  p.routing.assign(static_cast<size_t>(slots), -1);
  model::RoutingIO rio;
  rio.forced = forced ? forced->data() : nullptr;
  rio.record = p.routing.data();
  m.set_step(0, kStepSeed);
  m.set_micro_step(0);
  m.zero_grad();
  p.loss = m.forward_backward(tok.data(), tgt.data(), kB, kT, model::LossOptions{kZLoss}, rio).loss;
  p.grads.resize(static_cast<size_t>(m.num_params()));
  m.download_gradients(p.grads.data());
  p.token_ce.resize(kB * kT);
  m.set_micro_step(0);
  model::RoutingIO rio2;
  rio2.forced = rio.forced ? rio.forced : p.routing.data();
  m.forward_loss(tok.data(), tgt.data(), kB, kT, model::LossOptions{kZLoss}, rio2, p.token_ce.data());
  return p;
}

// (a) for one config: every recipe, CPU vs device.
void check_one_step(const char* file, backend::Backend& dev) {
  const model::ModelConfig cfg = load_config(file);
  const double tau = fp32_order_tolerance(cfg);
  // The FP32 CPU pass: the reference the recipes' quantization noise is measured against, and
  // the routing every pass of this config uses (R3 replay), so a near tie in the router cannot
  // send a token to another expert on one backend only (a difference of a whole expert's output
  // for that token, which no rounding argument bounds).
  auto m32 = make_model(cfg, recipe(R"({"name": "fp32"})"), &backend::cpu_backend(), 1);
  ASSERT_TRUE(m32);
  const Pass ref32 = one_pass(*m32, cfg, nullptr);
  const std::vector<int32_t>* forced = m32->num_moe_layers() > 0 ? &ref32.routing : nullptr;
  for (const model::RecipeConfig& rc : recipes()) {
    SCOPED_TRACE(rc.raw.dump());
    auto mc = make_model(cfg, rc, &backend::cpu_backend(), 1);
    auto md = make_model(cfg, rc, &dev, 1);
    ASSERT_TRUE(mc && md);
    const Pass c = one_pass(*mc, cfg, forced), d = one_pass(*md, cfg, forced);
    ASSERT_TRUE(std::isfinite(c.loss) && std::isfinite(d.loss));
    const bool quantized = rc.name != "fp32";
    // Loss: a mean over tokens, so its difference is at most the mean per-token difference, which
    // is bounded like the gradients: FP32 order relative to the loss, plus kFlipFactor times the
    // recipe's mean per-token CE noise on the CPU.
    double ce_noise = 0;
    for (int64_t i = 0; i < kB * kT; ++i) ce_noise += std::fabs(c.token_ce[i] - ref32.token_ce[i]);
    ce_noise /= static_cast<double>(kB * kT);
    const double loss_tol = tau * std::fabs(c.loss) + (quantized ? kFlipFactor * ce_noise : 0.0);
    EXPECT_LE(std::fabs(d.loss - c.loss), loss_tol) << "loss cpu " << c.loss << " cuda " << d.loss;
    // Gradients, per parameter tensor in the L2 norm (see kFlipFactor).
    double worst = 0;
    std::string worst_name;
    for (const auto& p : mc->param_refs()) {
      const int64_t off = p.grad - mc->flat_grads();
      const float* gc = c.grads.data() + off;
      const float* gd = d.grads.data() + off;
      const double norm = l2(gc, nullptr, p.numel), diff = l2(gd, gc, p.numel);
      const double noise = quantized ? l2(gc, ref32.grads.data() + off, p.numel) : 0.0;
      const double tol = tau * norm + kFlipFactor * noise;
      EXPECT_LE(diff, tol) << p.name << ": |g_cuda - g_cpu| " << diff << ", |g_cpu| " << norm
                           << ", recipe noise |g_cpu - g_fp32| " << noise;
      if (norm > 0 && diff / norm > worst) worst = diff / norm, worst_name = p.name;
    }
    std::printf("  %s %-60s loss cpu %.9f cuda %.9f (tol %.2e); worst grad rel diff %.3e (%s), fp32-order tol %.2e\n",
                file, rc.raw.dump().c_str(), c.loss, d.loss, loss_tol, worst, worst_name.c_str(), tau);
  }
}

// ---- training runs ------------------------------------------------------------------------------

struct Run {
  std::vector<double> losses, norms;
  std::vector<float> values;                  // final parameters (num_params)
  std::vector<float> exp_avg, exp_avg_sq;     // every parameter's moments, concatenated
  int64_t resets = 0;
};

// Steps [first, last) of a run on m / opt (the trainer's order: set step and micro-step, zero
// grads, forward+backward, global-norm clip, AdamW, the recipes' after-step hook).
void run_steps(model::Model& m, AdamW& opt, const model::ModelConfig& cfg, int64_t first, int64_t last, Run* r) {
  backend::Backend& be = m.backend();
  const std::vector<ParamView> views = views_of(m);
  std::vector<int32_t> tok, tgt;
  for (int64_t s = first; s < last; ++s) {
    batch_of_step(cfg, s, &tok, &tgt);
    m.set_step(s, kStepSeed);
    m.set_micro_step(s);
    m.zero_grad();
    r->losses.push_back(m.forward_backward(tok.data(), tgt.data(), kB, kT, model::LossOptions{kZLoss}).loss);
    const GradNorm gn = global_grad_norm(views, kMaxNorm, 1.0f, be);
    r->norms.push_back(gn.norm);
    EXPECT_TRUE(opt.step(views, kLr, gn.clip_scale).is_ok());
    r->resets += recipe_after_optimizer_step(m, s);
  }
}

void finish(model::Model& m, const AdamW& opt, Run* r) {
  r->values.resize(static_cast<size_t>(m.num_params()));
  m.download_parameters(r->values.data());
  for (const auto& p : m.param_refs()) {
    const auto* a = opt.exp_avg(p.name);
    const auto* b = opt.exp_avg_sq(p.name);
    ASSERT_TRUE(a && b) << p.name;
    r->exp_avg.insert(r->exp_avg.end(), a->begin(), a->end());
    r->exp_avg_sq.insert(r->exp_avg_sq.end(), b->begin(), b->end());
  }
}

Run train(const model::ModelConfig& cfg, const model::RecipeConfig& rc, backend::Backend* be, int64_t steps) {
  Run r;
  auto m = make_model(cfg, rc, be, steps);
  if (!m) return r;
  AdamW opt(AdamWConfig{}, be);
  run_steps(*m, opt, cfg, 0, steps, &r);
  finish(*m, opt, &r);
  return r;
}

// (b) 50 steps on CPU and CUDA from the same init.
// Per-step loss bound: the step-0 bound of (a) (FP32 order relative to the loss, plus kFlipFactor
// times the recipe's mean per-token CE noise |ce_recipe - ce_fp32| at step 0 on the CPU) grows at most linearly with the step: each step adds one more step's worth of
// discrepancy in the update, and over 50 steps at lr 1e-3 the map from weights to loss is smooth
// (the loss moves by ~1% of itself), so earlier differences are carried, not amplified: bound_s =
// (1 + s) * bound_0. The final weights (fp32 and bf16 only, see below): the change from the init must agree,
// |w_cuda - w_cpu| <= rho * |w_cpu - w_0| with rho = 10 * (tau + kFlipFactor * |g_q - g_32| / |g_q|):
// AdamW divides by sqrt(v), so a relative gradient difference passes into the update at most
// amplified by 1 / (1 - beta1) = 10 (an element whose momentum is dominated by the difference),
// and does not grow over the steps relative to the total change; capped at 0.5 (the two updates
// must at least point the same way).
void check_fifty_steps(const char* file, backend::Backend& dev) {
  const model::ModelConfig cfg = load_config(file);
  const double tau = fp32_order_tolerance(cfg);
  constexpr int64_t kSteps = 50;
  auto m32 = make_model(cfg, recipe(R"({"name": "fp32"})"), &backend::cpu_backend(), 1);
  ASSERT_TRUE(m32);
  const Pass ref32 = one_pass(*m32, cfg, nullptr);
  std::vector<float> w0(static_cast<size_t>(m32->num_params()));
  m32->download_parameters(w0.data());
  for (const model::RecipeConfig& rc : recipes()) {
    SCOPED_TRACE(rc.raw.dump());
    const bool quantized = rc.name != "fp32";
    double loss_noise = 0, grad_noise = 0;
    if (quantized) {
      auto mq = make_model(cfg, rc, &backend::cpu_backend(), 1);
      ASSERT_TRUE(mq);
      const Pass q = one_pass(*mq, cfg, nullptr);
      for (int64_t i = 0; i < kB * kT; ++i) loss_noise += std::fabs(q.token_ce[i] - ref32.token_ce[i]);
      loss_noise /= static_cast<double>(kB * kT);
      const int64_t n = mq->num_params();
      grad_noise = l2(q.grads.data(), ref32.grads.data(), n) / std::max(l2(q.grads.data(), nullptr, n), 1e-30);
    }
    const Run c = train(cfg, rc, &backend::cpu_backend(), kSteps);
    const Run d = train(cfg, rc, &dev, kSteps);
    ASSERT_EQ(c.losses.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(d.losses.size(), static_cast<size_t>(kSteps));
    double worst_ratio = 0;
    for (int64_t s = 0; s < kSteps; ++s) {
      const double bound0 = tau * std::fabs(c.losses[0]) + kFlipFactor * loss_noise;
      const double tol = (1.0 + static_cast<double>(s)) * bound0;
      EXPECT_LE(std::fabs(d.losses[s] - c.losses[s]), tol) << "step " << s << ": cpu " << c.losses[s]
                                                           << " cuda " << d.losses[s];
      worst_ratio = std::max(worst_ratio, std::fabs(d.losses[s] - c.losses[s]) / tol);
    }
    // Not vacuous: the runs moved (random tokens: the loss only drifts towards ln V, with batch noise
    // larger than the drift, so "the loss went down" is not a reliable check here).
    EXPECT_NE(c.losses[kSteps - 1], c.losses[0]);
    const int64_t n = static_cast<int64_t>(c.values.size());
    ASSERT_EQ(d.values.size(), c.values.size());
    const double change = l2(c.values.data(), w0.data(), n), diff = l2(d.values.data(), c.values.data(), n);
    const double rho = std::min(0.5, 10.0 * (tau + kFlipFactor * grad_noise));
    EXPECT_GT(change, 0.0);
    // The weight bound holds where no FP4 rounding decision sits between the two runs (fp32, bf16).
    // With FP4 operands a different summation order flips a few codes at step 0 and every flip
    // changes that element's gradient by a whole FP4 step; over 50 AdamW steps on random tokens
    // (noise-dominated updates) the flips compound and the two weight trajectories decorrelate
    // element-wise (measured on the H200 at ec3139d: |dw| / |w - w0| = 0.71-0.87 for nvfp4-nvidia
    // and tetrajet-v2, i.e. two runs as different as two SR seeds) while the losses agree within
    // the bound above. For those recipes the curves are the check, as issue #13 asks.
    const bool fp4 = rc.name == "nvfp4-nvidia" || rc.name == "tetrajet-v2";
    if (!fp4) {
      EXPECT_LE(diff, rho * change) << "|w_cuda - w_cpu| " << diff << ", |w_cpu - w_0| " << change;
    }
    std::printf("  %s %-60s loss %.6f -> cpu %.6f cuda %.6f; worst step diff / tol %.3f; |dw| / |w - w0| %.3e (tol %.3e)\n",
                file, rc.raw.dump().c_str(), c.losses[0], c.losses[kSteps - 1], d.losses[kSteps - 1], worst_ratio,
                change > 0 ? diff / change : 0.0, rho);
  }
}

// ---- (c) determinism and resume on the device ---------------------------------------------------

void expect_identical(const Run& a, const Run& b, const char* what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(a.losses.size(), b.losses.size());
  EXPECT_EQ(0, std::memcmp(a.losses.data(), b.losses.data(), a.losses.size() * sizeof(double)));
  EXPECT_EQ(0, std::memcmp(a.norms.data(), b.norms.data(), a.norms.size() * sizeof(double)));
  ASSERT_EQ(a.values.size(), b.values.size());
  EXPECT_EQ(0, std::memcmp(a.values.data(), b.values.data(), a.values.size() * sizeof(float)));
  ASSERT_EQ(a.exp_avg.size(), b.exp_avg.size());
  EXPECT_EQ(0, std::memcmp(a.exp_avg.data(), b.exp_avg.data(), a.exp_avg.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.exp_avg_sq.data(), b.exp_avg_sq.data(), a.exp_avg_sq.size() * sizeof(float)));
  EXPECT_EQ(a.resets, b.resets);
}

void check_deterministic_and_resume(const char* file) {
  const model::ModelConfig cfg = load_config(file);
  constexpr int64_t kSteps = 5, kSaveAfter = 3;
  for (const model::RecipeConfig& rc : recipes()) {
    SCOPED_TRACE(rc.raw.dump());
    // Two runs, each on a backend of its own (fresh streams, plans and memory pools).
    NIB_REQUIRE_DEVICE(dev1);
    const Run a = train(cfg, rc, dev1.get(), kSteps);
    NIB_REQUIRE_DEVICE(dev2);
    const Run b = train(cfg, rc, dev2.get(), kSteps);
    expect_identical(a, b, "two uninterrupted runs");
    EXPECT_NE(a.losses[0], a.losses[kSteps - 1]);

    // Save after kSaveAfter steps through the host copies, throw the model, optimizer and backend
    // away, rebuild them, load and continue.
    Run r;
    std::vector<float> saved_values;
    std::vector<io::NamedTensor> saved_opt, saved_recipe;
    {
      NIB_REQUIRE_DEVICE(dev3);
      auto m = make_model(cfg, rc, dev3.get(), kSteps);
      ASSERT_TRUE(m);
      AdamW opt(AdamWConfig{}, dev3.get());
      run_steps(*m, opt, cfg, 0, kSaveAfter, &r);
      saved_values.resize(static_cast<size_t>(m->num_params()));
      m->download_parameters(saved_values.data());
      saved_opt = opt.export_state();
      saved_recipe = export_recipe_state(*m);
    }
    NIB_REQUIRE_DEVICE(dev4);
    auto m = model::Model::create(cfg, rc, dev4.get());
    ASSERT_TRUE(m.is_ok()) << m.status().message();
    model::Model& resumed = *m.value();
    set_recipe_total_steps(resumed, kSteps);
    resumed.upload_parameters(saved_values.data());
    ASSERT_TRUE(import_recipe_state(resumed, saved_recipe).is_ok());
    AdamW opt(AdamWConfig{}, dev4.get());
    const Status st = opt.import_state(saved_opt, views_of(resumed));
    ASSERT_TRUE(st.is_ok()) << st.message();
    EXPECT_EQ(opt.step_count(), kSaveAfter);
    run_steps(resumed, opt, cfg, kSaveAfter, kSteps, &r);
    finish(resumed, opt, &r);
    expect_identical(a, r, "saved after 3 steps, rebuilt, loaded and continued");
    if (rc.oscireset.enabled) {
      EXPECT_GT(a.resets, 0);
    }
  }
}

TEST(BackendStep, TinyDenseOneStepCudaMatchesCpu) {
  NIB_REQUIRE_DEVICE(dev);
  check_one_step("tiny-dense.json", *dev);
}

TEST(BackendStep, TinyMoeOneStepCudaMatchesCpu) {
  NIB_REQUIRE_DEVICE(dev);
  check_one_step("tiny-moe.json", *dev);
}

TEST(BackendStep, TinyDenseFiftyStepsCudaMatchesCpu) {
  NIB_REQUIRE_DEVICE(dev);
  check_fifty_steps("tiny-dense.json", *dev);
}

TEST(BackendStep, TinyMoeFiftyStepsCudaMatchesCpu) {
  NIB_REQUIRE_DEVICE(dev);
  check_fifty_steps("tiny-moe.json", *dev);
}

TEST(BackendStep, TinyDenseCudaIsDeterministicAndResumesBitIdentically) {
  NIB_REQUIRE_DEVICE(dev);  // skip early, before any CPU work
  dev.reset();
  check_deterministic_and_resume("tiny-dense.json");
}

TEST(BackendStep, TinyMoeCudaIsDeterministicAndResumesBitIdentically) {
  NIB_REQUIRE_DEVICE(dev);
  dev.reset();
  check_deterministic_and_resume("tiny-moe.json");
}

}  // namespace
}  // namespace nibble::train
