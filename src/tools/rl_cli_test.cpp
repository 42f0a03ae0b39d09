// `nibble rl` through the built binary: a two-step arithmetic run from a fresh tiny model writes
// metrics.jsonl (a start line and one line per step), reward.png and a checkpoint and prints its
// result line; a second run into the same folder needs --resume (exit 2); a missing config file
// is exit 1, an unknown key or task exit 2, --resume of an empty folder exit 1 — each one line.
// Disaggregated under `mpirun -np 2` (rank 0 trains, rank 1 rolls out; MoE trace arm, so routing
// and guidance records cross the process boundary): on-policy and with max_staleness 1 the
// metrics equal the one-process run's bit for bit, and a run stopped mid-way resumes in one
// process onto the same metrics. Skipped when mpirun or MPI is missing.
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "tools/cli_test_util.h"
#include "tools/mpi_cli_test_util.h"
#include "train/metrics.h"

namespace nibble::tools {
namespace {

using namespace test;

constexpr const char* kConfig = R"({"model": {"architectures": ["Olmo2ForCausalLM"], "hidden_size": 32,
  "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "head_dim": 8, "vocab_size": 512, "max_position_embeddings": 64, "rope_theta": 10000.0,
  "rms_norm_eps": 1e-6, "initializer_range": 0.1},
  "tokenizer_vocab_size": 300, "task": "arithmetic", "arm": "trace", "steps": 2, "prompts_per_step": 2,
  "group_size": 2, "max_new_tokens": 4})";

void write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(RlCli, RunsWritesItsFolderAndRefusesToOverwriteIt) {
  ScratchDir d("rl");
  write(d / "rl.json", kConfig);
  RunResult r = run_nibble(d.path, "rl --config '" + d / "rl.json" + "' --out '" + d / "run" + "' --device cpu");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("rl: trace step 2/2"), std::string::npos) << r.out;
  auto lines = train::read_metrics(d / "run/metrics.jsonl");
  ASSERT_TRUE(lines.is_ok());
  EXPECT_EQ(lines.value().size(), 3u);
  EXPECT_TRUE(fs::exists(d / "run/reward.png"));
  EXPECT_TRUE(fs::exists(d / "run/checkpoints/latest"));

  RunResult again = run_nibble(d.path, "rl --config '" + d / "rl.json" + "' --out '" + d / "run" + "'");
  EXPECT_EQ(again.code, 2);
  EXPECT_EQ(again.err_lines(), 1) << again.err;
  EXPECT_NE(again.err.find("--resume"), std::string::npos);
}

TEST(RlCli, BadInputsAreOneLineWithTheirExitCodes) {
  ScratchDir d("rl_bad");
  RunResult missing = run_nibble(d.path, "rl --config '" + d / "nope.json" + "' --out '" + d / "a" + "'");
  EXPECT_EQ(missing.code, 1);
  EXPECT_EQ(missing.err_lines(), 1) << missing.err;
  write(d / "typo.json", R"({"model": {}, "stepz": 3})");
  RunResult typo = run_nibble(d.path, "rl --config '" + d / "typo.json" + "' --out '" + d / "b" + "'");
  EXPECT_EQ(typo.code, 2);
  EXPECT_NE(typo.err.find("stepz"), std::string::npos) << typo.err;
  write(d / "task.json", R"({"model": {}, "task": "chess"})");
  RunResult task = run_nibble(d.path, "rl --config '" + d / "task.json" + "' --out '" + d / "c" + "'");
  EXPECT_EQ(task.code, 2);
  EXPECT_EQ(task.err_lines(), 1) << task.err;
  RunResult resume = run_nibble(d.path, "rl --out '" + d / "empty" + "' --resume");
  EXPECT_EQ(resume.code, 1);
  EXPECT_EQ(resume.err_lines(), 1) << resume.err;
  RunResult noconfig = run_nibble(d.path, "rl --out '" + d / "x" + "'");
  EXPECT_EQ(noconfig.code, 2);
}

constexpr const char* kMoeConfig = R"({"model": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32,
  "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 64, "rope_theta": 10000.0,
  "rms_norm_eps": 1e-6, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
  "initializer_range": 0.1},
  "tokenizer_vocab_size": 300, "task": "arithmetic", "arm": "trace", "steps": 3, "prompts_per_step": 2,
  "group_size": 2, "max_new_tokens": 4, "lr": 0.01, "weight_decay": 0.5, "max_staleness": STALENESS})";

// (A random tiny model scores 0 on arithmetic, so every advantage is 0: the weight decay is what
// moves the weights from version to version, so that a stale rollout differs from a fresh one.)

// The step lines of a metrics.jsonl without the timing fields.
std::vector<nlohmann::json> step_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  auto lines = train::read_metrics(path);
  EXPECT_TRUE(lines.is_ok()) << path;
  if (!lines.is_ok()) return out;
  for (nlohmann::json j : lines.value()) {
    if (j.contains("event")) continue;
    for (const char* k : {"rollout_tokens_per_s", "train_tokens_per_s", "sync_seconds", "step_seconds", "overlap_seconds"})
      j.erase(k);
    out.push_back(j);
  }
  return out;
}

TEST(RlCli, DisaggregatedUnderMpirunEqualsTheOneProcessRun) {
  if (const std::string why = why_no_mpirun(); !why.empty()) GTEST_SKIP() << why;
  std::vector<nlohmann::json> last_steps;
  for (const char* n : {"0", "1"}) {
    ScratchDir d(std::string("rl_mpi") + n);
    std::string cfg = kMoeConfig;
    cfg.replace(cfg.find("STALENESS"), 9, n);
    write(d / "rl.json", cfg);
    RunResult one = run_nibble(d.path, "rl --config '" + d / "rl.json" + "' --out '" + d / "one" + "' --device cpu");
    ASSERT_EQ(one.code, 0) << one.err;
    const std::string two_cmd = mpirun(2) + "'" + nibble_binary() + "' rl --config '" + d / "rl.json" + "' --device cpu ";
    RunResult two = run_shell(d.path, two_cmd + "--out '" + d / "two" + "'");
    ASSERT_EQ(two.code, 0) << two.err;
    EXPECT_NE(two.out.find("rl: trace step 3/3"), std::string::npos) << two.out;
    const auto a = step_lines(d / "one/metrics.jsonl"), b = step_lines(d / "two/metrics.jsonl");
    ASSERT_EQ(a.size(), 3u);
    ASSERT_EQ(b.size(), 3u) << "one writer: rank 0";
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "N " << n << " step " << i + 1;
    EXPECT_EQ(b[2]["policy_version"], n[0] == '0' ? 2 : 1);
    last_steps.push_back(b[2]);
    // stopped after step 2 under mpirun (a rollout in flight when N = 1), resumed in one process
    RunResult first = run_shell(d.path, two_cmd + "--out '" + d / "split" + "' --stop-after 2");
    ASSERT_EQ(first.code, 0) << first.err;
    RunResult rest = run_nibble(d.path, "rl --out '" + d / "split" + "' --resume --device cpu");
    ASSERT_EQ(rest.code, 0) << rest.err;
    const auto c = step_lines(d / "split/metrics.jsonl");
    ASSERT_EQ(c.size(), 3u);
    EXPECT_EQ(a[2], c[2]) << "N " << n;
  }
  ASSERT_EQ(last_steps.size(), 2u);
  EXPECT_NE(last_steps[0]["logp_diff_mean"], last_steps[1]["logp_diff_mean"]) << "a stale rollout (N 1) looks fresh";
}

}  // namespace
}  // namespace nibble::tools
