// Tests of `nibble sft` through the binary: the shipped configs/sft-tiny-moe.json, shrunk with
// --set to seconds, trains (the loss falls; held-out accuracy in metrics.jsonl's validation and
// end events; the result line), leaves a pretraining-format run folder that `nibble generate`
// reads, resumes after --stop-after to the same losses as an uninterrupted run, and refuses
// misuse with one line and the documented exit code (an existing run without --resume, a missing
// or bad config, an unknown task or level).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tools/cli_test_util.h"

namespace nibble::tools::test {
namespace {

using nlohmann::json;

std::string q(const std::string& s) { return "'" + s + "'"; }
std::string config_path(const std::string& name) { return std::string(NIBBLE_SOURCE_DIR) + "/configs/" + name; }

// The shipped config made tiny: 2 layers, hidden 64, 4 experts, 16 x 8 tokens, 20 steps.
std::string sft_args(const ScratchDir& d, const std::string& out, int steps = 20) {
  return "-q sft --config " + q(config_path("sft-tiny-moe.json")) + " --out " + q(d / out) +
         " --no-progress --set steps=" + std::to_string(steps) +
         " --set eval.interval=10 --set checkpoint.interval=10 --set batch_size=16 --set seq_len=8"
         " --set schedule.warmup_steps=2 --set optimizer.lr=1e-2 --set model.hidden_size=64"
         " --set model.num_hidden_layers=2 --set model.head_dim=16 --set model.num_experts=4"
         " --set model.moe_intermediate_size=64 --set model.max_position_embeddings=32"
         " --set task.train_examples=256 --set task.val_examples=32 --set task.accuracy_examples=8"
         " --set task.max_new_tokens=4";
}

std::vector<json> metrics(const ScratchDir& d, const std::string& run) {
  std::vector<json> out;
  std::istringstream in(slurp(d / (run + "/metrics.jsonl")));
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

std::vector<double> losses(const std::vector<json>& events) {
  std::vector<double> out;
  for (const json& e : events)
    if (e.contains("loss") && !e.contains("event")) out.push_back(e["loss"].get<double>());
  return out;
}

TEST(SftCli, TrainsLogsAccuracyAndResumes) {
  ScratchDir d("sft");
  RunResult r = run_nibble(d.path, sft_args(d, "full"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("sft: arithmetic step 20/20"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("accuracy "), std::string::npos) << r.out;
  const std::vector<json> events = metrics(d, "full");
  const std::vector<double> full = losses(events);
  ASSERT_EQ(full.size(), 20u);
  EXPECT_LT(full.back(), full.front() * 0.6) << "first " << full.front() << " last " << full.back();
  ASSERT_EQ(events.back()["event"], "end");
  EXPECT_EQ(events.back()["accuracy_total"], 8);
  EXPECT_TRUE(fs::exists(d / "full/checkpoints/step_000020/tokenizer.model"));

  // The run folder is a pretraining one: generate reads it.
  r = run_nibble(d.path, "-q generate --checkpoint " + q(d / "full") + " --prompt '3+4=' --max-new-tokens 3");
  EXPECT_EQ(r.code, 0) << r.err;

  // Interrupted after step 7, resumed: the same losses bit for bit (printed with 17 digits).
  r = run_nibble(d.path, sft_args(d, "split") + " --stop-after 7");
  ASSERT_EQ(r.code, 0) << r.err;
  r = run_nibble(d.path, "-q sft --out " + q(d / "split") + " --resume --no-progress");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(losses(metrics(d, "split")), full);

  // A finished run resumed again: nothing to do, exit 0.
  r = run_nibble(d.path, "-q sft --out " + q(d / "split") + " --resume --no-progress");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("already finished at step 20/20"), std::string::npos) << r.out;
  // An existing run without --resume is refused (exit 2), and nothing changes.
  r = run_nibble(d.path, sft_args(d, "full"));
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err_lines(), 1) << r.err;
  EXPECT_NE(r.err.find("pass --resume"), std::string::npos) << r.err;
}

TEST(SftCli, MisuseIsOneLineWithItsExitCode) {
  ScratchDir d("sft_misuse");
  std::ofstream(d / "notjson.json") << "{ nope";
  struct Case {
    std::string what, args;
    int code;
    std::string needle;
  };
  const std::vector<Case> cases{
      {"no --config", "sft --out " + q(d / "a"), 2, "--config is required"},
      {"missing config", "sft --config " + q(d / "nope.json") + " --out " + q(d / "a"), 1, "nope.json"},
      {"config not JSON", "sft --config " + q(d / "notjson.json") + " --out " + q(d / "a"), 1, "not valid JSON"},
      {"unknown task", sft_args(d, "a") + " --set task.name=chess", 2, "unknown task 'chess'"},
      {"no task", sft_args(d, "a") + " --set 'task.name=\"\"'", 2, "'task.name' is empty"},
      {"level out of range", sft_args(d, "a") + " --set task.levels=[0,9]", 2, "not 9"},
      {"seq_len too short", sft_args(d, "a") + " --set seq_len=4", 2, "'seq_len'"},
      {"bad --set", sft_args(d, "a") + " --set task.train_examples=0", 2, "'task.train_examples'"},
      {"resume without a run", "sft --out " + q(d / "a") + " --resume", 1, "no checkpoint in"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    RunResult r = run_nibble(d.path, c.args);
    EXPECT_EQ(r.code, c.code) << r.err;
    EXPECT_EQ(r.err_lines(), 1) << r.err;
    EXPECT_EQ(r.err.rfind("nibble sft: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << r.err;
  }
  EXPECT_FALSE(fs::exists(d / "a")) << "a refused run leaves no folder behind";
}

}  // namespace
}  // namespace nibble::tools::test
