// Training-step and linear-layer benchmarks on any backend (train_bench.h). Steps run exactly as
// the trainer runs one optimizer step with grad_accum 1 (zero_grad, forward_backward with the
// model's z-loss, global-norm clip at 1.0, AdamW at a fixed LR), on Philox random tokens; every
// timed region ends with a backend synchronize so host clocks measure device work. A profiled
// bench builds the model and optimizer on a ProfilingBackend over `be`, disabled (plain
// forwarding) for the warm-up and timed steps and enabled for one extra step.
#include "train/train_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/philox.h"
#include "model/transformer.h"
#include "train/optimizer.h"

namespace nibble::train {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}
}  // namespace

double model_flops_per_token(const model::ModelConfig& c, int64_t seq_len, int64_t* active_params) {
  const int64_t C = c.hidden_size, L = c.num_hidden_layers;
  const int64_t Nq = c.q_width(), Nkv = c.kv_width();
  int64_t active = 0;
  for (int64_t l = 0; l < L; ++l) {
    active += C * (Nq + 2 * Nkv) + Nq * C;  // q, k, v, o
    active += 2 * C;                         // two norms (OLMo-2: post-attn, post-ff; Qwen3: input, post-attn)
    active += c.arch == model::Architecture::kOlmo2 ? Nq + Nkv : 2 * c.head_dim;  // QK-norm gains
    if (c.is_moe_layer(l)) {
      active += c.num_experts * C;  // router
      active += c.num_experts_per_tok * 3 * C * c.moe_intermediate_size;  // top-k experts only
      if (c.shared_expert_intermediate_size > 0) active += 3 * C * c.shared_expert_intermediate_size;
    } else {
      active += 3 * C * c.intermediate_size;
    }
  }
  active += C;                   // final norm
  active += c.vocab_size * C;    // lm_head (a GEMM; only the embedding lookup is not counted)
  if (active_params) *active_params = active;
  return 6.0 * static_cast<double>(active) + 6.0 * static_cast<double>(L * C * seq_len);
}

Result<TrainBenchResult> bench_train_step(backend::Backend& device_be, const model::ModelConfig& config,
                                          const model::RecipeConfig& recipe, const TrainBenchOptions& o) {
  if (o.batch <= 0 || o.seq_len <= 0 || o.timed_steps <= 0 || o.warmup_steps < 0)
    return invalid_argument("bench train: batch {}, seq {}, steps {} must be positive", o.batch, o.seq_len,
                            o.timed_steps);
  if (o.seq_len > config.max_position_embeddings)
    return invalid_argument("bench train: --seq {} exceeds the model's max_position_embeddings {}", o.seq_len,
                            config.max_position_embeddings);
  backend::ProfilingBackend profiler(device_be);
  backend::Backend& be = o.profile ? static_cast<backend::Backend&>(profiler) : device_be;
  be.synchronize();
  be.reset_peak_memory();
  NIB_ASSIGN_OR_RETURN(std::unique_ptr<model::Model> m, model::Model::create(config, recipe, &be));
  m->init_weights(o.seed);
  const int64_t n_tok = o.batch * o.seq_len;
  std::vector<int32_t> tokens(static_cast<size_t>(n_tok)), targets(tokens.size());
  PhiloxStream rng(o.seed, 1);
  for (int64_t i = 0; i < n_tok; ++i) {
    tokens[i] = static_cast<int32_t>(rng.next_u32() % static_cast<uint32_t>(config.vocab_size));
    targets[i] = static_cast<int32_t>(rng.next_u32() % static_cast<uint32_t>(config.vocab_size));
  }
  AdamW adamw(AdamWConfig{}, &be);
  std::vector<ParamView> views;
  for (auto& p : m->param_refs()) views.push_back({p.name, p.value, p.grad, p.numel, p.weight_decay});
  model::LossOptions loss_options;
  loss_options.z_loss_coef = 1e-5;

  TrainBenchResult r;
  r.recipe = recipe.name;
  std::vector<double> times;
  const int n_steps = o.warmup_steps + o.timed_steps;
  for (int s = 0; s < n_steps + (o.profile ? 1 : 0); ++s) {
    const bool profiled_step = s == n_steps;
    if (profiled_step) {
      profiler.reset_timings();
      profiler.set_enabled(true);
    }
    const auto t0 = Clock::now();
    m->set_step(s, o.seed);
    m->zero_grad();
    model::LossParts lp = m->forward_backward(tokens.data(), targets.data(), o.batch, o.seq_len, loss_options);
    GradNorm gn = global_grad_norm(views, 1.0, 1.0f, be);
    if (gn.finite) NIB_RETURN_IF_ERROR(adamw.step(views, 3e-4, gn.clip_scale));
    be.synchronize();
    const double dt = seconds_since(t0);
    if (profiled_step) {
      profiler.set_enabled(false);
      r.profiled = true;
      r.profile = backend::make_step_profile(profiler, dt);
      continue;  // the losses and times reported are those of the unprofiled steps
    }
    if (s == 0) r.first_loss = lp.loss;
    r.last_loss = lp.loss;
    if (s >= o.warmup_steps) times.push_back(dt);
  }
  r.step_seconds = median(times);
  r.tokens_per_second = static_cast<double>(n_tok) / r.step_seconds;
  r.flops_per_token = model_flops_per_token(config, o.seq_len, &r.active_nonembedding_params);
  r.mfu = r.tokens_per_second * r.flops_per_token / (o.peak_tflops * 1e12);
  r.peak_bytes = be.memory_stats().peak_bytes;
  return r;
}

Result<LinearBenchResult> bench_linear(backend::Backend& be, const model::RecipeConfig& recipe, int64_t M, int64_t N,
                                       int64_t K, int repeats) {
  if (M <= 0 || N <= 0 || K <= 0 || repeats <= 0)
    return invalid_argument("bench linear: shape {}x{}x{} and repeats {} must be positive", M, N, K, repeats);
  model::LinearInfo info;
  info.name = "bench.linear";
  info.kind = model::LinearKind::kGateUp;
  info.num_blocks = 1;
  info.N = N;
  info.K = K;
  NIB_ASSIGN_OR_RETURN(std::unique_ptr<model::LinearRecipe> lin, model::make_linear_recipe(recipe, info));
  backend::Buffer<float> x, w, y, dy, dx, dw;
  model::LinearWorkspace workspace;  // as the model shares it across its linears
  std::vector<float> host(static_cast<size_t>(std::max({M * K, N * K, M * N})));
  auto fill = [&](float* dst, int64_t n, uint64_t stream, double scale) {
    PhiloxStream rng(7, stream);
    for (int64_t i = 0; i < n; ++i) host[i] = static_cast<float>(rng.next_normal() * scale);
    be.copy_to_device(dst, host.data(), static_cast<size_t>(n) * sizeof(float));
  };
  fill(x.ensure(be, M * K, "bench X"), M * K, 1, 1.0);
  fill(w.ensure(be, N * K, "bench W"), N * K, 2, 0.02);
  fill(dy.ensure(be, M * N, "bench dY"), M * N, 3, 1e-3);
  y.ensure(be, M * N, "bench Y");
  dx.ensure(be, M * K, "bench dX");
  be.fill_zero(dw.ensure(be, N * K, "bench dW"), static_cast<size_t>(N * K) * sizeof(float));
  LinearBenchResult r;
  r.recipe = recipe.name;
  std::vector<double> tf, tb;
  const int64_t in_use_before = be.memory_stats().in_use_bytes;
  for (int i = 0; i < 2 + repeats; ++i) {
    if (i == 1 && in_use_before >= 0) {  // after one forward + backward: saved operands + workspace
      r.workspace_bytes = workspace.bytes();
      r.saved_bytes = be.memory_stats().in_use_bytes - in_use_before - r.workspace_bytes;
    }
    model::LinearCall call{i, 1, 0, i, true, &workspace};
    auto t0 = Clock::now();
    lin->forward(be, y.data(), x.data(), w.data(), M, N, K, call);
    be.synchronize();
    const double f = seconds_since(t0);
    t0 = Clock::now();
    lin->backward(be, dx.data(), dw.data(), dy.data(), M, N, K, call);
    be.synchronize();
    const double b = seconds_since(t0);
    if (i >= 2) tf.push_back(f), tb.push_back(b);
  }
  r.forward_s = median(tf);
  r.backward_s = median(tb);
  return r;
}

}  // namespace nibble::train
