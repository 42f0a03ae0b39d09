// SFT then RL through the built `nibble` binary, CI-sized (issue #16 item 6): a tiny MoE
// (hidden 64, 2 layers, 4 experts top-2) is warm-started by `nibble sft` on arithmetic level 0 for
// 150 steps (held-out greedy accuracy ~0.66, sampled reward ~0.3: room to learn), then `nibble rl`
// trains it with GRPO. The mechanics are asserted: in `trace-full` every guided site (the routed
// experts' linears included, each of their rows with a record) reproduces the rollout's E2M1 code
// and the trainer's own RTN code never differs from it on the CPU; in `trace` the mantissa bit is
// reproduced; every metric is finite; and the reward on the easy level
// rises over 20 steps on a fixed training set of 8 instances (docs/rl.md, "Learning").
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/cli_test_util.h"
#include "train/metrics.h"

namespace nibble::tools {
namespace {

using namespace test;
using nlohmann::json;

json sft_config() {
  return json::parse(R"({"model": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
    "norm_topk_prob": true, "router_aux_loss_coef": 0.01, "vocab_size": 320, "max_position_embeddings": 32,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "initializer_range": 0.02,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3},
    "recipe": "bf16", "seed": 1, "batch_size": 32, "seq_len": 16, "steps": 150,
    "optimizer": {"lr": 0.003, "weight_decay": 0.0},
    "schedule": {"type": "cosine", "warmup_steps": 20, "final_lr_fraction": 0.1},
    "eval": {"interval": 150, "batches": 2}, "checkpoint": {"interval": 150, "keep_last": 1},
    "threads": 1, "log_interval": 50,
    "task": {"name": "arithmetic", "levels": [0], "seed": 1, "train_examples": 4096, "val_examples": 128,
             "accuracy_examples": 64, "max_new_tokens": 4}})");
}

json rl_config(const std::string& init, const std::string& arm, int64_t steps, uint64_t seed, uint64_t task_seed) {
  return json{{"init", init},         {"task", "arithmetic"}, {"level", 0},         {"task_seed", task_seed},
              {"arm", arm},           {"steps", steps},       {"prompts_per_step", 8}, {"group_size", 8},
              {"train_instances", 8}, {"max_new_tokens", 4},  {"temperature", 1.0}, {"lr", 1e-3},
              {"seed", seed}};
}

// The per-step lines of an rl run's metrics.jsonl.
std::vector<json> step_lines(const fs::path& run) {
  auto lines = train::read_metrics(run / "metrics.jsonl");
  EXPECT_TRUE(lines.is_ok());
  std::vector<json> steps;
  if (!lines.is_ok()) return steps;
  for (const json& l : lines.value())
    if (l.contains("reward_mean")) steps.push_back(l);
  return steps;
}

double mean_reward(const std::vector<json>& s, size_t b, size_t e) {
  double sum = 0;
  for (size_t i = b; i < e; ++i) sum += s[i]["reward_mean"].get<double>();
  return sum / static_cast<double>(e - b);
}

class SftRlCli : public ::testing::Test {
 protected:
  // One SFT run for the suite (about 4 s of CPU time).
  static void SetUpTestSuite() {
    dir_ = new ScratchDir("sft_rl");
    std::ofstream(*dir_ / "sft.json") << sft_config().dump(1);
    RunResult r = run_nibble(dir_->path, "sft --config '" + *dir_ / "sft.json" + "' --out '" + *dir_ / "sft" +
                                             "' --no-progress --device cpu");
    sft_ok_ = r.code == 0;
    sft_err_ = r.err;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  // Runs `nibble rl` with this config into `name`; the per-step metric lines.
  static std::vector<json> rl(const std::string& name, const json& cfg) {
    std::ofstream(*dir_ / (name + ".json")) << cfg.dump(1);
    RunResult r = run_nibble(dir_->path, "rl --config '" + *dir_ / (name + ".json") + "' --out '" + *dir_ / name +
                                             "' --device cpu");
    EXPECT_EQ(r.code, 0) << r.err;
    return step_lines(dir_->path / name);
  }
  static ScratchDir* dir_;
  static bool sft_ok_;
  static std::string sft_err_;
};
ScratchDir* SftRlCli::dir_ = nullptr;
bool SftRlCli::sft_ok_ = false;
std::string SftRlCli::sft_err_;

// Every metric of every step is a finite number; the guidance and MoE ones are present (a
// trace arm on a MoE model).
void expect_finite(const std::vector<json>& steps) {
  for (const json& s : steps)
    for (auto it = s.begin(); it != s.end(); ++it) {
      ASSERT_TRUE(it->is_number()) << "step " << s["step"] << ": " << it.key() << " = " << it->dump();
      EXPECT_TRUE(std::isfinite(it->get<double>())) << "step " << s["step"] << ": " << it.key();
    }
}

// Every metric finite, and at every step every guided site reproduced (codes in trace-full,
// mantissa bits in trace) with no RTN code differing from the rollout's (the CPU's arithmetic is
// the same in the engine and the trainer).
void expect_exact_guidance(const std::vector<json>& steps) {
  expect_finite(steps);
  for (const json& m : steps) {
    EXPECT_EQ(m["guided_reproduced"].get<double>(), 1.0) << "step " << m["step"];
    EXPECT_EQ(m["guided_mismatch"].get<double>(), 0.0) << "step " << m["step"];
    // routed experts are guided sites too, and with R3 every routed row has its record
    EXPECT_EQ(m["guided_expert_fallback"].get<double>(), 0.0) << "step " << m["step"];
    EXPECT_GT(m["guidance_bytes_per_token"].get<double>(), 0.0);
  }
}

TEST_F(SftRlCli, TraceFullReproducesCodesAndTheRewardRises) {
  ASSERT_TRUE(sft_ok_) << sft_err_;
  const std::vector<json> s = rl("trace_full", rl_config(*dir_ / "sft", "trace-full", 20, 1, 2));
  ASSERT_EQ(s.size(), 20u);
  expect_exact_guidance(s);
  // The reward of the first 5 steps against the last 5. Measured at the commit that added this
  // test: 0.28 -> 0.55 (seed 1), and for rollout seeds 2, 3 and another training set (task_seed 5)
  // rises of 0.2 and more (docs/rl.md). A 5-step mean is over 320 samples of a 0/1 reward, its
  // sampling error at most 0.5/sqrt(320) = 0.028, so a difference of two such means has a
  // standard deviation of at most 0.04: a margin of 0.1 is 2.5 of them, while a loop that does
  // not learn (wrong sign, no update, stale rollout weights) stays near 0 or falls.
  const double first = mean_reward(s, 0, 5), last = mean_reward(s, 15, 20);
  EXPECT_GT(last - first, 0.1) << "reward " << first << " -> " << last;
}

TEST_F(SftRlCli, TraceReproducesMantissaBits) {
  ASSERT_TRUE(sft_ok_) << sft_err_;
  const std::vector<json> s = rl("trace", rl_config(*dir_ / "sft", "trace", 2, 1, 2));
  ASSERT_EQ(s.size(), 2u);
  expect_exact_guidance(s);
}

}  // namespace
}  // namespace nibble::tools
