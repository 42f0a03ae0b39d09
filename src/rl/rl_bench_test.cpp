// Tests of the RL step-time benchmark (rl_bench.h): the median; the summary's trace overhead and
// sync-byte ratios from given rows (NaN where an arm is missing); and bench_rl itself on a tiny MoE
// with the arithmetic task, 2 steps per arm: one row per arm in order, one timed step, finite
// non-negative parts, and sync bytes whose linears' ratio is NVFP4's storage over BF16's, counted
// by hand for the model's linears.
#include "rl/rl_bench.h"

#include <cmath>

#include <gtest/gtest.h>

#include "model/config.h"
#include "rl/task.h"

namespace nibble::rl {
namespace {

using nlohmann::json;

TEST(RlBench, MedianOfOddAndEvenCounts) {
  EXPECT_EQ(median_of({3.0, 1.0, 2.0}), 2.0);
  EXPECT_EQ(median_of({4.0, 1.0, 3.0, 2.0}), 2.5);
  EXPECT_EQ(median_of({7.0}), 7.0);
}

RlBenchRow row(Arm a, double step, double bytes, double linear_bytes) {
  RlBenchRow r;
  r.arm = a, r.step_seconds = step, r.sync_bytes = bytes, r.sync_linear_bytes = linear_bytes;
  return r;
}

TEST(RlBench, SummaryRatiosFromTheRows) {
  const std::vector<RlBenchRow> rows = {row(Arm::kBf16Rollout, 1.0, 1000, 800), row(Arm::kTrace, 2.16, 400, 225),
                                        row(Arm::kFp4Naive, 2.0, 400, 225)};
  const RlBenchSummary s = summarize_rl_bench(rows);
  EXPECT_NEAR(s.trace_overhead, 0.08, 1e-12);
  EXPECT_DOUBLE_EQ(s.sync_bytes_ratio, 0.4);
  EXPECT_DOUBLE_EQ(s.sync_linear_bytes_ratio, 225.0 / 800.0);
  const json j = s.to_json();
  EXPECT_EQ(j["summary"], true);
  EXPECT_NEAR(j["trace_overhead"].get<double>(), 0.08, 1e-12);
  // without fp4-naive there is no overhead; without bf16-rollout no byte ratio: null in JSON
  const RlBenchSummary partial = summarize_rl_bench({rows[1]});
  EXPECT_TRUE(std::isnan(partial.trace_overhead));
  EXPECT_TRUE(std::isnan(partial.sync_bytes_ratio));
  EXPECT_TRUE(partial.to_json()["trace_overhead"].is_null());
  EXPECT_TRUE(partial.to_json()["sync_bytes_ratio"].is_null());
}

json tiny_moe() {
  return json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 512, "max_position_embeddings": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "initializer_range": 0.1})");
}

TEST(RlBench, EveryArmGivesARowOfFiniteParts) {
  RlBenchOptions o;
  o.model = tiny_moe();
  o.steps = 2;
  o.prompts_per_step = 2, o.group_size = 2, o.max_new_tokens = 3;
  auto task = make_task("arithmetic");
  ASSERT_TRUE(task.is_ok());
  std::vector<Arm> seen;
  auto rows = bench_rl(o, **task, [&](const RlBenchRow& r) { seen.push_back(r.arm); });
  ASSERT_TRUE(rows.is_ok()) << rows.status().message();
  ASSERT_EQ(rows.value().size(), 3u);
  EXPECT_EQ(seen, o.arms);
  for (const RlBenchRow& r : rows.value()) {
    SCOPED_TRACE(arm_name(r.arm));
    EXPECT_EQ(r.timed_steps, 1);
    for (double v : {r.step_seconds, r.rollout_seconds, r.logprob_seconds, r.moe_check_seconds, r.train_seconds,
                     r.sync_seconds, r.other_seconds, r.rollout_tokens_per_s, r.train_tokens_per_s}) {
      EXPECT_TRUE(std::isfinite(v));
      EXPECT_GE(v, 0.0);
    }
    // one timed step: its parts add up to it (the medians of one value each)
    EXPECT_NEAR(r.rollout_seconds + r.logprob_seconds + r.moe_check_seconds + r.train_seconds + r.sync_seconds +
                    r.other_seconds,
                r.step_seconds, 1e-9);
    EXPECT_GT(r.moe_check_seconds, 0.0);  // a MoE model
    EXPECT_GT(r.response_len, 0.0);
    const json j = r.to_json();
    EXPECT_EQ(j["arm"], arm_name(r.arm));
  }
  const RlBenchSummary s = summarize_rl_bench(rows.value());
  EXPECT_TRUE(std::isfinite(s.trace_overhead));
  EXPECT_GT(s.trace_overhead, -1.0);
  // The block linears (N, K) in two-level NVFP4: N K / 2 code bytes + N K / 16 E4M3 scales + an
  // FP32 outer scale per row and 128 columns (here one per row: K <= 128), against 2 N K in BF16.
  // Per layer: qkv (128, 32): 2816 vs 8192; o_proj (32, 64): 1280 vs 4096; 4 experts' gate+up
  // (32, 32): 4 x 704 vs 4 x 2048; their down (32, 16): 4 x 416 vs 4 x 1024. Both layers alike.
  EXPECT_NEAR(s.sync_linear_bytes_ratio, 8576.0 / 24576.0, 1e-12);
  EXPECT_GT(s.sync_bytes_ratio, s.sync_linear_bytes_ratio);  // the FP32 rest is the same in both
  EXPECT_LT(s.sync_bytes_ratio, 1.0);
}

// Two rounds of (fp4-naive, trace): the arms alternate, each arm's timed steps are pooled (one per
// round here), a row per distinct arm (a repeated arm in the list runs once a round).
TEST(RlBench, RoundsInterleaveTheArmsAndPoolTheirSteps) {
  RlBenchOptions o;
  o.model = tiny_moe();
  o.steps = 2, o.rounds = 2;
  o.arms = {Arm::kFp4Naive, Arm::kTrace, Arm::kFp4Naive};
  o.prompts_per_step = 1, o.group_size = 2, o.max_new_tokens = 2;
  auto task = make_task("arithmetic");
  ASSERT_TRUE(task.is_ok());
  auto rows = bench_rl(o, **task);
  ASSERT_TRUE(rows.is_ok()) << rows.status().message();
  ASSERT_EQ(rows.value().size(), 2u);
  EXPECT_EQ(rows.value()[0].arm, Arm::kFp4Naive);
  EXPECT_EQ(rows.value()[1].arm, Arm::kTrace);
  for (const RlBenchRow& r : rows.value()) {
    EXPECT_EQ(r.timed_steps, 2);
    EXPECT_EQ(r.rounds, 2);
    EXPECT_EQ(r.to_json().at("rounds"), 2);
    EXPECT_TRUE(std::isfinite(r.step_seconds));
  }
  o.rounds = 0;
  auto bad = bench_rl(o, **task);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

TEST(RlBench, BadOptionsAreArgumentErrors) {
  auto task = make_task("arithmetic");
  ASSERT_TRUE(task.is_ok());
  RlBenchOptions o;
  o.model = tiny_moe();
  o.steps = 1;  // nothing left after the warm-up
  auto r = bench_rl(o, **task);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  o.steps = 2;
  o.group_size = 1;  // the RL config's own check
  r = bench_rl(o, **task);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nibble::rl
