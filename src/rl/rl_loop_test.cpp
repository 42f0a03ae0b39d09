// CI-sized runs of the RL loop (rl_loop.h) on tiny models with a small real task defined here
// ("next letter": the prompt names a letter, the answer is the one after it; a shaped reward so that
// a random tiny model's groups already differ): every arm runs and
// logs finite metrics; in trace-full the trainer's guided sites reproduce the rollout's codes
// exactly, in trace their mantissa bits (with an NVFP4 rollout KV cache, its K/V sites too); a MoE model measures expert-set mismatches and trains
// with R3, its routed experts' linears guided too (without R3, rows of other experts fall back to
// RTN and are counted); a run stopped and resumed gives the uninterrupted run's metrics and weights bit for
// bit; asynchronous rollouts (max_staleness N) come from version t - N, are deterministic and
// resume bit for bit; the step-time split adds up to the step time on-policy; a run without
// checkpoints leaves only metrics; a folder holding a run is refused without --resume; bad configs
// are one-line errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <unistd.h>
#include <filesystem>
#include <string>

#include "model/config.h"
#include "rl/rl_loop.h"
#include "rollout/guidance_store.h"
#include "train/checkpoint.h"
#include "train/metrics.h"

namespace nibble::rl {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// "next letter": level 0 uses a..e, level 1 a..y. Reward of the completion's first non-space
// character: 1 for the next letter, 0.5 for another lowercase letter, else 0.
class NextLetterTask final : public Task {
 public:
  std::string name() const override { return "next-letter"; }
  int num_levels() const override { return 2; }
  TaskInstance make(int level, uint64_t seed, int64_t index) const override {
    const int span = level == 0 ? 5 : 25;
    const int c = static_cast<int>((seed * 31 + static_cast<uint64_t>(index) * 7) % static_cast<uint64_t>(span));
    TaskInstance t;
    t.prompt = std::string("after ") + static_cast<char>('a' + c) + ":";
    t.answer = std::string(1, static_cast<char>('a' + c + 1));
    t.solution = " " + t.answer;
    t.level = level, t.seed = seed, t.index = index;
    return t;
  }
  double reward(const TaskInstance& inst, std::string_view completion) const override {
    const size_t p = completion.find_first_not_of(' ');
    if (p == std::string_view::npos) return 0.0;
    if (completion.substr(p, 1) == inst.answer) return 1.0;
    return completion[p] >= 'a' && completion[p] <= 'z' ? 0.5 : 0.0;
  }
};

json dense_model() {
  return json::parse(R"({"architectures": ["Olmo2ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "vocab_size": 320, "max_position_embeddings": 32, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "initializer_range": 0.1})");
}

json moe_model() {
  return json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 320, "max_position_embeddings": 32, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "initializer_range": 0.1})");
}

RlConfig config_for(const std::string& arm, const json& model, int64_t steps = 2) {
  json j = {{"model", model}, {"arm", arm}, {"steps", steps}, {"prompts_per_step", 2}, {"group_size", 3},
            {"max_new_tokens", 4}, {"lr", 1e-3}, {"tokenizer_vocab_size", 300}};
  auto c = parse_rl_config(j);
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  return c.value();
}

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) {
    path = fs::temp_directory_path() / ("nibble_rl_test_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

Result<RlResult> run(const RlConfig& c, const fs::path& dir, bool resume = false, int64_t stop = -1) {
  RlOptions o;
  o.run_dir = dir.string();
  o.resume = resume;
  o.stop_after_step = stop;
  static const NextLetterTask task;
  return run_rl(c, task, o);
}

void expect_finite(const RlStepMetrics& m, bool guided, bool moe) {
  for (double v : {m.reward_mean, m.reward_std, m.response_len, m.entropy, m.logp_diff_mean, m.logp_diff_max,
                   m.kl_rollout_train, m.guidance_bytes_per_token, m.rollout_tokens_per_s, m.train_tokens_per_s,
                   m.sync_seconds, m.sync_bytes, m.step_seconds, m.loss, m.grad_norm})
    EXPECT_TRUE(std::isfinite(v));
  EXPECT_EQ(std::isfinite(m.guided_mismatch), guided);
  EXPECT_EQ(std::isfinite(m.moe_set_mismatch), moe);
  EXPECT_GT(m.sync_bytes, 0);
  EXPECT_GT(m.sync_linear_bytes, 0);
  EXPECT_LT(m.sync_linear_bytes, m.sync_bytes);  // the rest (embedding, norms, lm_head) is sent too
  EXPECT_GT(m.response_len, 0);
}

// The step-time split (docs/rl.md "Step time"): every part finite and >= 0; rollout, log-prob,
// update and sync each took time; the extra forward without R3 runs for MoE only. On-policy the
// parts are disjoint intervals of one steady clock inside the step, so they add up to
// step_seconds up to the rounding of six double sums (<< 1e-9 s); a rollout counted outside the
// step (or a part counted twice) would make the sum exceed it. Asynchronous: the rollout ran beside
// the previous step, so only the trainer's parts must fit in the step.
void expect_step_split(const RlStepMetrics& m, bool on_policy, bool moe) {
  SCOPED_TRACE(fmt::format("step {}", m.step));
  const double parts[] = {m.rollout_seconds, m.logprob_seconds, m.moe_check_seconds, m.train_seconds,
                          m.sync_seconds, m.other_seconds};
  for (double v : parts) {
    EXPECT_TRUE(std::isfinite(v));
    EXPECT_GE(v, 0.0);
  }
  EXPECT_GT(m.rollout_seconds, 0.0);
  EXPECT_GT(m.logprob_seconds, 0.0);
  EXPECT_GT(m.train_seconds, 0.0);
  EXPECT_GT(m.sync_seconds, 0.0);
  EXPECT_EQ(m.moe_check_seconds > 0.0, moe);
  const double trainer = m.logprob_seconds + m.moe_check_seconds + m.train_seconds + m.sync_seconds + m.other_seconds;
  if (on_policy) {
    EXPECT_NEAR(m.rollout_seconds + trainer, m.step_seconds, 1e-9);
  } else {
    EXPECT_LE(trainer, m.step_seconds + 1e-9);
  }
}

// The latest checkpoints of two runs hold the same weights bit for bit.
void expect_same_weights(const fs::path& a, const fs::path& b) {
  auto wa = train::load_checkpoint_tensors(train::open_checkpoint(a.string()).value());
  auto wb = train::load_checkpoint_tensors(train::open_checkpoint(b.string()).value());
  ASSERT_TRUE(wa.is_ok() && wb.is_ok());
  ASSERT_EQ(wa.value().size(), wb.value().size());
  for (size_t i = 0; i < wa.value().size(); ++i) {
    Tensor ta = wa.value()[i].tensor, tb = wb.value()[i].tensor;
    ASSERT_EQ(ta.numel(), tb.numel());
    EXPECT_EQ(0, std::memcmp(ta.data<float>(), tb.data<float>(), static_cast<size_t>(ta.numel()) * 4)) << wa.value()[i].name;
  }
}

TEST(RlLoop, EveryArmRunsWithFiniteMetrics) {
  for (const char* arm : {"bf16-rollout", "fp4-naive", "qat", "quads"}) {
    TempDir d(arm);
    auto r = run(config_for(arm, dense_model(), 1), d.path);
    ASSERT_TRUE(r.is_ok()) << arm << ": " << r.status().message();
    ASSERT_EQ(r.value().steps.size(), 1u);
    expect_finite(r.value().steps[0], false, false);
    EXPECT_EQ(r.value().steps[0].guidance_bytes_per_token, 0.0);
    EXPECT_TRUE(fs::exists(d.path / "metrics.jsonl"));
    EXPECT_TRUE(fs::exists(d.path / "reward.png"));
  }
}

TEST(RlLoop, TraceFullGuidedSitesReproduceTheRolloutCodes) {
  TempDir d("trace_full");
  auto r = run(config_for("trace-full", dense_model()), d.path);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  for (const RlStepMetrics& m : r.value().steps) {
    expect_finite(m, true, false);
    EXPECT_EQ(m.guided_reproduced, 1.0);
    EXPECT_GT(m.guidance_bytes_per_token, 0.0);
  }
}

TEST(RlLoop, TraceReproducesTheMantissaBitOnTheLaterHalf) {
  TempDir d("trace");
  auto full = run(config_for("trace-full", dense_model(), 1), d.path);
  ASSERT_TRUE(full.is_ok()) << full.status().message();
  TempDir d2("trace_mbit");
  auto r = run(config_for("trace", dense_model(), 1), d2.path);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const RlStepMetrics& m = r.value().steps[0];
  expect_finite(m, true, false);
  EXPECT_EQ(m.guided_reproduced, 1.0);
  // 1 layer of 2, 1 bit instead of 4 per element: well under half of trace-full's bytes
  EXPECT_LT(m.guidance_bytes_per_token, 0.5 * full.value().steps[0].guidance_bytes_per_token);
}

// A dense model whose head dim (16) NVFP4 KV pages can hold.
json dense16_model() {
  json j = dense_model();
  j["num_attention_heads"] = 2;
  j["head_dim"] = 16;
  return j;
}

// rollout_kv nvfp4: the rollout's K and V are NVFP4 page values; the store holds the KV sites'
// per-head records of every guided layer and token besides the activation sites (exactly the
// figure with kv_cache on); trace-full reproduces every rollout code, the KV sites' included, and
// trace every mantissa bit. On the CPU the trainer's K/V step makes its forward the rollout's
// arithmetic again up to summation order (RTN in qat, guided in the trace arms); fp4-naive's BF16
// trainer has no K/V step and differs from the NVFP4 pages' log-probs.
TEST(RlLoop, Nvfp4KvCacheIsAGuidedSite) {
  auto cfg = model::parse_model_config(dense16_model());
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().message();
  for (const char* arm : {"trace-full", "trace", "qat", "fp4-naive"}) {
    SCOPED_TRACE(arm);
    TempDir d(std::string("kv_") + arm);
    RlConfig c = config_for(arm, dense16_model(), 1);
    c.rollout_kv = backend::KvPageFormat::kNvfp4;
    auto r = run(c, d.path);
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    const RlStepMetrics& m = r.value().steps[0];
    const bool guided = std::string(arm).rfind("trace", 0) == 0;
    expect_finite(m, guided, false);
    if (guided) {
      EXPECT_EQ(m.guided_reproduced, 1.0);
      EXPECT_EQ(m.guided_mismatch, 0.0);  // the CPU rollout and trainer are the same arithmetic
      const bool full = std::string(arm) == "trace-full";
      const std::vector<int64_t> layers = full ? std::vector<int64_t>{0, 1} : std::vector<int64_t>{1};
      const auto mode = full ? rollout::GuidanceMode::kTraceFull : rollout::GuidanceMode::kTrace;
      EXPECT_EQ(m.guidance_bytes_per_token,
                static_cast<double>(rollout::guidance_bytes_per_token(backend::QuantFormat::kNvfp4TwoLevel, cfg.value(),
                                                                      layers, mode, true, true)));
    }
    // What remains with the K/V step is FP32 summation order between the paged decode and the
    // training forward (these arms with BF16 pages: 5e-9 here, 3e-8 with NVFP4 pages); without it
    // the NVFP4 pages' error (up to half a grid step of each element) moves the log-probs by
    // ~0.1 and more (fp4-naive, whose BF16 trainer has no K/V step: 0.57).
    if (std::string(arm) == "fp4-naive")
      EXPECT_GT(m.logp_diff_max, 1e-2);
    else
      EXPECT_LT(m.logp_diff_max, 1e-6);
  }
}

// A MoE model in trace-full with R3: routed experts' linears are guided sites too. Every guided
// site (routed experts' rows included: guided_expert_fallback is a number, so the trainer looked
// their rows up) reproduces the rollout's codes, no routed row lacks a record, and the store holds
// exactly every site of every layer per token, the routed experts' gate/up and down inputs of the
// token's top_k experts included. With norm_topk_prob off (Qwen3-MoE's default) and on (as
// configs/tiny-moe.json): R3's gate weights are the model's own formula over the replayed set,
// equal to the rollout's, so the layers after a MoE layer see the rollout's inputs exactly (a
// renormalisation over the set with norm_topk_prob off would move them: guided codes would differ).
void check_moe_run_replays_routing(bool norm_topk) {
  SCOPED_TRACE(norm_topk ? "norm_topk_prob" : "no norm_topk_prob");
  TempDir d(norm_topk ? "moe_norm" : "moe");
  json model = moe_model();
  model["norm_topk_prob"] = norm_topk;
  auto r = run(config_for("trace-full", model, 1), d.path);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const RlStepMetrics& m = r.value().steps[0];
  expect_finite(m, true, true);
  EXPECT_GE(m.moe_set_mismatch, 0.0);
  EXPECT_LE(m.moe_set_mismatch, 1.0);
  EXPECT_EQ(m.guided_reproduced, 1.0);
  EXPECT_EQ(m.guided_mismatch, 0.0);
  EXPECT_EQ(m.guided_expert_fallback, 0.0);
  auto cfg = model::parse_model_config(model);
  ASSERT_TRUE(cfg.is_ok());
  const std::vector<int64_t> layers = {0, 1};
  EXPECT_EQ(m.guidance_bytes_per_token,
            static_cast<double>(rollout::guidance_bytes_per_token(backend::QuantFormat::kNvfp4TwoLevel, cfg.value(),
                                                                  layers, rollout::GuidanceMode::kTraceFull, true,
                                                                  false)));
}

TEST(RlLoop, MoeRunMeasuresExpertSetMismatchAndReplaysRouting) { check_moe_run_replays_routing(true); }
TEST(RlLoop, MoeRunReplaysRoutingWithoutNormTopk) { check_moe_run_replays_routing(false); }

// Without R3 the trainer routes by itself: a token whose expert set differs from the rollout's has
// a routed row without a record (RTN, counted), so rows fall back exactly when sets differ.
TEST(RlLoop, MoeWithoutR3CountsRoutedRowsWithoutARecord) {
  TempDir d("moe_no_r3");
  RlConfig c = config_for("trace-full", moe_model(), 1);  // every layer guided, as the mismatch counts all
  c.r3 = false;
  auto r = run(c, d.path);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const RlStepMetrics& m = r.value().steps[0];
  expect_finite(m, true, true);
  ASSERT_TRUE(std::isfinite(m.guided_expert_fallback));
  EXPECT_EQ(m.guided_expert_fallback > 0.0, m.moe_set_mismatch > 0.0);
  EXPECT_LE(m.guided_expert_fallback, 1.0);
  EXPECT_EQ(m.guided_reproduced, 1.0);  // the rows that have a record reproduce it
}

TEST(RlLoop, StepTimeSplitAddsUpToTheStepTime) {
  TempDir dm("split_moe"), dd("split_dense");
  const auto t0 = std::chrono::steady_clock::now();
  auto moe = run(config_for("trace", moe_model(), 2), dm.path);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(moe.is_ok()) << moe.status().message();
  double steps_sum = 0;
  for (const RlStepMetrics& m : moe.value().steps) {
    expect_step_split(m, true, true);
    steps_sum += m.step_seconds;
  }
  EXPECT_LE(steps_sum, wall);  // the steps are disjoint parts of the run
  auto dense = run(config_for("fp4-naive", dense_model(), 2), dd.path);
  ASSERT_TRUE(dense.is_ok()) << dense.status().message();
  for (const RlStepMetrics& m : dense.value().steps) expect_step_split(m, true, false);
  // metrics.jsonl carries the split
  auto lines = train::read_metrics((dd.path / "metrics.jsonl").string());
  ASSERT_TRUE(lines.is_ok());
  const json& last = lines.value().back();
  for (const char* k : {"rollout_seconds", "logprob_seconds", "moe_check_seconds", "train_seconds", "sync_seconds",
                        "other_seconds", "step_seconds", "sync_linear_bytes"})
    EXPECT_TRUE(last.contains(k) && last[k].is_number()) << k;
}

TEST(RlLoop, NoCheckpointsLeavesOnlyMetrics) {
  TempDir d("no_ckpt");
  RlOptions o;
  o.run_dir = d.path.string();
  o.checkpoints = false;
  static const NextLetterTask task;
  auto r = run_rl(config_for("fp4-naive", dense_model(), 2), task, o);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r.value().steps.size(), 2u);
  EXPECT_TRUE(r.value().checkpoint_dir.empty());
  EXPECT_FALSE(fs::exists(d.path / "checkpoints"));
  EXPECT_FALSE(fs::exists(d.path / "reward.png"));
  EXPECT_TRUE(fs::exists(d.path / "metrics.jsonl"));
}

TEST(RlLoop, ResumeReproducesTheUninterruptedRunBitForBit) {
  RlConfig c = config_for("trace", dense_model(), 3);
  TempDir a("whole"), b("resumed");
  auto whole = run(c, a.path);
  ASSERT_TRUE(whole.is_ok()) << whole.status().message();
  auto first = run(c, b.path, false, 2);
  ASSERT_TRUE(first.is_ok()) << first.status().message();
  EXPECT_EQ(first.value().end_step, 2);
  auto rest = run(c, b.path, true);
  ASSERT_TRUE(rest.is_ok()) << rest.status().message();
  EXPECT_EQ(rest.value().start_step, 2);
  ASSERT_EQ(rest.value().steps.size(), 1u);
  const RlStepMetrics &x = whole.value().steps[2], &y = rest.value().steps[0];
  EXPECT_EQ(x.reward_mean, y.reward_mean);
  EXPECT_EQ(x.loss, y.loss);
  EXPECT_EQ(x.logp_diff_mean, y.logp_diff_mean);
  EXPECT_EQ(x.entropy, y.entropy);
  EXPECT_EQ(x.grad_norm, y.grad_norm);
  expect_same_weights(a.path, b.path);
  // metrics.jsonl: start, 2 steps, resume, 1 step
  auto lines = train::read_metrics((b.path / "metrics.jsonl").string());
  ASSERT_TRUE(lines.is_ok());
  EXPECT_EQ(lines.value().size(), 5u);
}

RlConfig async_config(int64_t staleness, int64_t steps) {
  RlConfig c = config_for("trace", moe_model(), steps);
  c.max_staleness = staleness;
  return c;
}

// The values of a step that depend on the rollout and the update (not on timing).
std::vector<double> step_values(const RlStepMetrics& m) {
  return {m.reward_mean, m.reward_std, m.response_len, m.entropy, m.logp_diff_mean, m.logp_diff_max,
          m.kl_rollout_train, m.guided_mismatch, m.guided_reproduced, m.moe_set_mismatch, m.loss, m.clip_fraction,
          m.tis_fraction, m.grad_norm, m.sync_bytes, static_cast<double>(m.policy_version)};
}

// Asynchronous rollouts: step t (0-based) is generated by policy version max(0, t - N), whatever
// the threads' timing (two runs agree bit for bit); the first step (version 0 for every N) equals
// the on-policy run's, later ones differ from it (their rollouts come from older weights).
TEST(RlLoop, AsyncRolloutsComeFromVersionTMinusNAndAreDeterministic) {
  TempDir d0("sync0");
  auto on_policy = run(async_config(0, 4), d0.path);
  ASSERT_TRUE(on_policy.is_ok()) << on_policy.status().message();
  for (int64_t n : {1, 2}) {
    TempDir a("async_a" + std::to_string(n)), b("async_b" + std::to_string(n));
    auto x = run(async_config(n, 4), a.path);
    ASSERT_TRUE(x.is_ok()) << x.status().message();
    auto y = run(async_config(n, 4), b.path);
    ASSERT_TRUE(y.is_ok()) << y.status().message();
    ASSERT_EQ(x.value().steps.size(), 4u);
    for (int64_t t = 0; t < 4; ++t) {
      const RlStepMetrics &mx = x.value().steps[static_cast<size_t>(t)], &my = y.value().steps[static_cast<size_t>(t)];
      expect_finite(mx, true, true);
      expect_step_split(mx, false, true);
      EXPECT_EQ(mx.policy_version, std::max<int64_t>(0, t - n)) << "N " << n << " step " << t;
      EXPECT_EQ(mx.staleness, t - mx.policy_version);
      EXPECT_GE(mx.overlap_seconds, 0.0);
      EXPECT_EQ(step_values(mx), step_values(my)) << "N " << n << " step " << t;
    }
    EXPECT_EQ(step_values(x.value().steps[0]), step_values(on_policy.value().steps[0])) << "N " << n;
    EXPECT_NE(step_values(x.value().steps[3]), step_values(on_policy.value().steps[3])) << "N " << n;
  }
  for (const RlStepMetrics& m : on_policy.value().steps) {
    EXPECT_EQ(m.staleness, 0);
    EXPECT_EQ(m.overlap_seconds, 0.0);  // on-policy: the rollout waits for the update
  }
}

// A run with N = 2 stopped after step 2 (its step-3 rollout in flight) and resumed gives the
// uninterrupted run's metrics and weights bit for bit: the checkpoint holds versions 0 and 1.
TEST(RlLoop, AsyncResumeReproducesTheUninterruptedRunBitForBit) {
  const RlConfig c = async_config(2, 4);
  TempDir a("async_whole"), b("async_resumed");
  auto whole = run(c, a.path);
  ASSERT_TRUE(whole.is_ok()) << whole.status().message();
  auto first = run(c, b.path, false, 2);
  ASSERT_TRUE(first.is_ok()) << first.status().message();
  EXPECT_TRUE(fs::exists(fs::path(first.value().checkpoint_dir) / "rollout_policies.safetensors"));
  auto rest = run(c, b.path, true);
  ASSERT_TRUE(rest.is_ok()) << rest.status().message();
  ASSERT_EQ(rest.value().steps.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(step_values(whole.value().steps[2 + i]), step_values(rest.value().steps[i])) << i;
    EXPECT_EQ(rest.value().steps[i].policy_version, static_cast<int64_t>(i));
  }
  expect_same_weights(a.path, b.path);
}

// A checkpoint written on-policy holds no pending versions: resuming it with max_staleness 1
// (which needs version step-1) is a one-line data-loss error, not a silently different run.
TEST(RlLoop, AsyncResumeWithoutThePendingVersionsIsAnError) {
  TempDir d("async_missing");
  ASSERT_TRUE(run(async_config(0, 3), d.path, false, 2).is_ok());
  auto r = run(async_config(1, 3), d.path, true);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
}

// The mechanics learn: on the shaped next-letter reward a random tiny model's mean reward over
// its last 3 of 25 steps is at least 0.1 above its first 3 steps' (trace arm: W4A4 rollout, guided
// trainer; measured 0.09 -> 0.32; ~6 s of CPU).
TEST(RlLoop, RewardRisesOnAnEasyTask) {
  RlConfig c = config_for("trace", dense_model(), 25);
  c.prompts_per_step = 4, c.group_size = 8, c.lr = 1e-2;
  TempDir d("rises");
  auto r = run(c, d.path);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  const auto& s = r.value().steps;
  double first = 0, last = 0;
  for (int i = 0; i < 3; ++i) first += s[i].reward_mean, last += s[s.size() - 1 - i].reward_mean;
  EXPECT_GT(last, first + 0.3) << "first 3 steps " << first / 3 << ", last 3 " << last / 3;
}

TEST(RlLoop, RefusesAFolderHoldingARunWithoutResume) {
  TempDir d("refuse");
  ASSERT_TRUE(run(config_for("fp4-naive", dense_model(), 1), d.path).is_ok());
  auto again = run(config_for("fp4-naive", dense_model(), 1), d.path);
  ASSERT_FALSE(again.is_ok());
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(again.status().message().find("--resume"), std::string::npos);
  TempDir e("empty");
  auto resume = run(config_for("fp4-naive", dense_model(), 1), e.path, true);
  ASSERT_FALSE(resume.is_ok());
  EXPECT_EQ(resume.status().code(), StatusCode::kNotFound);
}

TEST(RlLoop, BadConfigsAreOneLineErrors) {
  const json base = {{"model", dense_model()}};
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"arm", "fp5"}, {"group_size", 1}, {"tis", "maybe"}, {"aggregation", "batch"}, {"typo_key", 1},
           {"minibatches", 5}, {"clip_eps", 0}, {"steps", "ten"}, {"train_instances", -1}, {"max_staleness", -1},
           {"rollout_kv", "fp8"}, {"rollout_kv", 4}}) {
    json j = base;
    j[key] = value;
    auto c = parse_rl_config(j);
    ASSERT_FALSE(c.is_ok()) << key;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << key;
    EXPECT_EQ(c.status().message().find('\n'), std::string::npos);
  }
  EXPECT_FALSE(parse_rl_config(json{{"arm", "qat"}}).is_ok());  // neither init nor model
}

// rollout_kv: bf16 by default, survives the JSON round trip; nvfp4 on a model whose head dim is
// not a multiple of 16 is a one-line error before anything runs.
TEST(RlLoop, RolloutKvKeyRoundTripsAndNeedsHeadDimsOf16) {
  RlConfig c = config_for("qat", dense_model());
  EXPECT_EQ(c.rollout_kv, backend::KvPageFormat::kBf16);
  c.rollout_kv = backend::KvPageFormat::kNvfp4;
  auto back = parse_rl_config(c.to_json());
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  EXPECT_EQ(back.value().rollout_kv, backend::KvPageFormat::kNvfp4);
  TempDir d("kv_head_dim");
  auto r = run(c, d.path);  // head dim 8
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("multiple of 16"), std::string::npos) << r.status().message();
  EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
}

// Prompt i of step s is instance s*P + i, cycled through a fixed training set when
// train_instances is set; the key survives the config's JSON round trip (checkpoints, resume).
TEST(RlLoop, TrainInstancesCycleTheStepsPrompts) {
  RlConfig c = config_for("trace", dense_model());
  c.prompts_per_step = 4;
  EXPECT_EQ(prompt_instance_index(c, 0, 3), 3);
  EXPECT_EQ(prompt_instance_index(c, 5, 2), 22);
  c.train_instances = 6;
  EXPECT_EQ(prompt_instance_index(c, 0, 3), 3);
  EXPECT_EQ(prompt_instance_index(c, 1, 2), 0);   // 6 mod 6
  EXPECT_EQ(prompt_instance_index(c, 5, 2), 4);   // 22 mod 6
  auto back = parse_rl_config(c.to_json());
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  EXPECT_EQ(back.value().train_instances, 6);
}

}  // namespace
}  // namespace nibble::rl
