// `nibble rl` through the built binary: a two-step arithmetic run from a fresh tiny model writes
// metrics.jsonl (a start line and one line per step), reward.png and a checkpoint and prints its
// result line; a second run into the same folder needs --resume (exit 2); a missing config file
// is exit 1, an unknown key or task exit 2, --resume of an empty folder exit 1 — each one line.
#include <gtest/gtest.h>

#include <fstream>

#include "tools/cli_test_util.h"
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

}  // namespace
}  // namespace nibble::tools
