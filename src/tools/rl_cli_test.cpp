// `nibble rl` through the built binary: a two-step arithmetic run from a fresh tiny model writes
// metrics.jsonl (a start line and one line per step), reward.png and a checkpoint and prints its
// result line; a second run into the same folder needs --resume (exit 2); a missing config file
// is exit 1, an unknown key or task exit 2, --resume of an empty folder exit 1, a bad rollout_kv
// (or nvfp4 on a head dim NVFP4 pages cannot hold) exit 2 — each one line.
// Disaggregated under `mpirun -np N` (rank 0 trains, ranks 1..N-1 roll out; MoE trace arm, so
// routing and guidance records cross the process boundary): for N = 2 (both prompt groups on
// rank 1) and N = 3 (3 prompt groups per step split 2 + 1 over the two rollout ranks),
// on-policy and with max_staleness 1 (N = 3: 2), the metrics equal the one-process run's bit for bit, and a
// run stopped mid-way resumes in another world size (N = 2: in one process; N = 3: under
// mpirun -np 2) onto the same metrics. The weights go over the host transport (auto on CPU
// processes), and for N = 3 with max_staleness 2 (4 steps) over the device one (the packed form in
// backend memory, here host memory over MPI: the NCCL path's code on CPU processes, its buffer
// pool reused while versions wait to be used). With rollout_kv nvfp4 the KV sites' records cross
// the boundary too (mpirun -np 2 = one process). More rollout ranks than prompts per step: exit 2,
// one line. Skipped when mpirun or MPI is missing.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>

#include <fmt/format.h>

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
  // an unknown weight transport: refused before anything is written
  RunResult transport = run_nibble(d.path, "rl --config '" + d / "task.json" + "' --out '" + d / "t" +
                                               "' --weight-transport foo");
  EXPECT_EQ(transport.code, 2);
  EXPECT_EQ(transport.err_lines(), 1) << transport.err;
  EXPECT_NE(transport.err.find("--weight-transport"), std::string::npos) << transport.err;
  EXPECT_FALSE(fs::exists(d / "t"));
  // rollout_kv: bf16 or nvfp4 only; nvfp4 pages need a head dim that is a multiple of 16 (kConfig's is 8)
  write(d / "kv.json", R"({"model": {}, "rollout_kv": "fp8"})");
  RunResult kv = run_nibble(d.path, "rl --config '" + d / "kv.json" + "' --out '" + d / "k" + "'");
  EXPECT_EQ(kv.code, 2);
  EXPECT_EQ(kv.err_lines(), 1) << kv.err;
  EXPECT_NE(kv.err.find("rollout_kv 'fp8'"), std::string::npos) << kv.err;
  EXPECT_FALSE(fs::exists(d / "k"));
  nlohmann::json small = nlohmann::json::parse(kConfig);
  small["rollout_kv"] = "nvfp4";
  write(d / "kv8.json", small.dump());
  RunResult kv8 = run_nibble(d.path, "rl --config '" + d / "kv8.json" + "' --out '" + d / "k8" + "' --device cpu");
  EXPECT_EQ(kv8.code, 2);
  EXPECT_EQ(kv8.err_lines(), 1) << kv8.err;
  EXPECT_NE(kv8.err.find("multiple of 16"), std::string::npos) << kv8.err;
}

constexpr const char* kMoeConfig = R"({"model": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32,
  "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 64, "rope_theta": 10000.0,
  "rms_norm_eps": 1e-6, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
  "initializer_range": 0.1},
  "tokenizer_vocab_size": 300, "task": "arithmetic", "arm": "trace", "steps": 3, "prompts_per_step": 2,
  "group_size": 2, "max_new_tokens": 4, "lr": 0.01, "weight_decay": 0.5, "max_staleness": STALENESS})";

// kMoeConfig with max_staleness `staleness`, `prompts` prompts per step and `steps` steps.
std::string moe_config(const std::string& staleness, int prompts, int steps = 3) {
  std::string cfg = kMoeConfig;
  cfg.replace(cfg.find("STALENESS"), 9, staleness);
  const std::string st = "\"steps\": 3";
  cfg.replace(cfg.find(st), st.size(), "\"steps\": " + std::to_string(steps));
  const std::string p = "\"prompts_per_step\": 2";
  cfg.replace(cfg.find(p), p.size(), "\"prompts_per_step\": " + std::to_string(prompts));
  return cfg;
}

// (A random tiny model scores 0 on arithmetic, so every advantage is 0: the weight decay is what
// moves the weights from version to version, so that a stale rollout differs from a fresh one.)

// The step lines of a metrics.jsonl without the timing fields (names ending in _seconds or _per_s:
// the step-time split, sync and overlap seconds, tokens/s).
std::vector<nlohmann::json> step_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  auto lines = train::read_metrics(path);
  EXPECT_TRUE(lines.is_ok()) << path;
  if (!lines.is_ok()) return out;
  auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (const nlohmann::json& line : lines.value()) {
    if (line.contains("event")) continue;
    nlohmann::json j = nlohmann::json::object();
    for (auto it = line.begin(); it != line.end(); ++it)
      if (!ends_with(it.key(), "_seconds") && !ends_with(it.key(), "_per_s")) j[it.key()] = it.value();
    out.push_back(j);
  }
  return out;
}

// The third step line of a `steps`-step run of the MoE config (max_staleness `staleness`,
// `prompts` per step) under `mpirun -np np` with `--weight-transport transport`, after checking
// that every step line equals the one-process run's and that a run stopped after step 2 under
// mpirun -np np and resumed with `resume_np` processes (1: no mpirun) ends on the same metrics.
nlohmann::json disaggregated_run_equals_one_process(int np, int resume_np, const std::string& staleness, int prompts,
                                                    const std::string& transport, int steps = 3) {
  const std::string label = fmt::format("np {} staleness {} transport {}", np, staleness, transport);
  const auto n = static_cast<size_t>(steps);
  ScratchDir d(fmt::format("rl_mpi{}_{}", np, staleness));
  write(d / "rl.json", moe_config(staleness, prompts, steps));
  RunResult one = run_nibble(d.path, "rl --config '" + d / "rl.json" + "' --out '" + d / "one" + "' --device cpu");
  EXPECT_EQ(one.code, 0) << one.err;
  const std::string many_cmd = mpirun(np) + "'" + nibble_binary() + "' rl --config '" + d / "rl.json" +
                               "' --device cpu --weight-transport " + transport + " ";
  RunResult many = run_shell(d.path, many_cmd + "--out '" + d / "many" + "'");
  EXPECT_EQ(many.code, 0) << many.err;
  EXPECT_NE(many.out.find(fmt::format("rl: trace step {0}/{0}", steps)), std::string::npos) << many.out;
  EXPECT_NE(many.err.find(fmt::format("ranks 1..{} roll out", np - 1)), std::string::npos) << many.err;
  const std::string used = transport == "device" ? "device" : "host";  // auto: host on CPU processes
  EXPECT_NE(many.err.find(fmt::format("to {} rollout ranks over the {} transport", np - 1, used)), std::string::npos)
      << many.err;
  const auto a = step_lines(d / "one/metrics.jsonl"), b = step_lines(d / "many/metrics.jsonl");
  EXPECT_EQ(a.size(), n) << label;
  EXPECT_EQ(b.size(), n) << label << ": one writer, rank 0";
  if (a.size() != n || b.size() != n) return {};
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << label << " step " << i + 1;
  EXPECT_EQ(b[n - 1]["policy_version"], std::max(0, steps - 1 - std::stoi(staleness))) << label;
  // stopped after step 2 under mpirun (rollouts in flight with staleness >= 1), resumed in another world
  RunResult first = run_shell(d.path, many_cmd + "--out '" + d / "split" + "' --stop-after 2");
  EXPECT_EQ(first.code, 0) << first.err;
  const std::string rest_cmd = "rl --out '" + d / "split" + "' --resume --device cpu";
  RunResult rest = resume_np == 1 ? run_nibble(d.path, rest_cmd)
                                   : run_shell(d.path, mpirun(resume_np) + "'" + nibble_binary() + "' " + rest_cmd);
  EXPECT_EQ(rest.code, 0) << rest.err;
  const auto c = step_lines(d / "split/metrics.jsonl");
  EXPECT_EQ(c.size(), n) << label;
  if (c.size() == n) EXPECT_EQ(a[n - 1], c[n - 1]) << label << ", resumed with " << resume_np;
  return b[2];
}

TEST(RlCli, DisaggregatedUnderMpirunEqualsTheOneProcessRun) {
  if (const std::string why = why_no_mpirun(); !why.empty()) GTEST_SKIP() << why;
  const nlohmann::json fresh = disaggregated_run_equals_one_process(2, 1, "0", 2, "auto");
  const nlohmann::json stale = disaggregated_run_equals_one_process(2, 1, "1", 2, "host");
  ASSERT_FALSE(fresh.is_null() || stale.is_null());
  EXPECT_NE(fresh["logp_diff_mean"], stale["logp_diff_mean"]) << "a stale rollout (N 1) looks fresh";
}

TEST(RlCli, DisaggregatedOverTwoRolloutRanksEqualsTheOneProcessRun) {
  if (const std::string why = why_no_mpirun(); !why.empty()) GTEST_SKIP() << why;
  // 3 prompt groups over 2 rollout ranks: 2 on rank 1, 1 on rank 2. The device transport with
  // max_staleness 2 over 4 steps: a version arrives while the one before it still waits to be
  // used (its pooled buffer must not be reused)
  const nlohmann::json fresh = disaggregated_run_equals_one_process(3, 2, "0", 3, "auto");
  const nlohmann::json stale = disaggregated_run_equals_one_process(3, 2, "2", 3, "device", 4);
  ASSERT_FALSE(fresh.is_null() || stale.is_null());
  EXPECT_NE(fresh["logp_diff_mean"], stale["logp_diff_mean"]) << "a stale rollout (N 2) looks fresh";
}

// rollout_kv nvfp4 reaches the rollout rank's engine: under mpirun -np 2 the KV sites' version-2
// records cross the process boundary and every step line equals the one-process run's; those
// records make guidance_bytes_per_token larger than with BF16 pages (trace: layer 1 only).
TEST(RlCli, Nvfp4RolloutKvUnderMpirunEqualsTheOneProcessRun) {
  if (const std::string why = why_no_mpirun(); !why.empty()) GTEST_SKIP() << why;
  ScratchDir d("rl_mpi_kv");
  nlohmann::json cfg = nlohmann::json::parse(moe_config("0", 2, 2));
  write(d / "bf16.json", cfg.dump());
  cfg["rollout_kv"] = "nvfp4";
  write(d / "kv.json", cfg.dump());
  RunResult base = run_nibble(d.path, "rl --config '" + d / "bf16.json" + "' --out '" + d / "base" + "' --device cpu");
  ASSERT_EQ(base.code, 0) << base.err;
  RunResult one = run_nibble(d.path, "rl --config '" + d / "kv.json" + "' --out '" + d / "one" + "' --device cpu");
  ASSERT_EQ(one.code, 0) << one.err;
  RunResult many = run_shell(d.path, mpirun(2) + "'" + nibble_binary() + "' rl --config '" + d / "kv.json" +
                                         "' --device cpu --out '" + d / "many" + "'");
  ASSERT_EQ(many.code, 0) << many.err;
  const auto a = step_lines(d / "one/metrics.jsonl"), b = step_lines(d / "many/metrics.jsonl"),
             c = step_lines(d / "base/metrics.jsonl");
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  ASSERT_EQ(c.size(), 2u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
    EXPECT_EQ(a[i]["guided_reproduced"], 1.0);
    EXPECT_GT(a[i]["guidance_bytes_per_token"].get<double>(), c[i]["guidance_bytes_per_token"].get<double>());
  }
}

TEST(RlCli, MoreRolloutRanksThanPromptsIsOneLine) {
  if (const std::string why = why_no_mpirun(); !why.empty()) GTEST_SKIP() << why;
  ScratchDir d("rl_mpi_too_many");
  write(d / "rl.json", moe_config("0", 1));
  RunResult r = run_shell(d.path, mpirun(3) + "'" + nibble_binary() + "' rl --config '" + d / "rl.json" +
                                      "' --device cpu --out '" + d / "run" + "'");
  EXPECT_EQ(r.code, 2) << r.err;
  const std::string line = "2 rollout ranks but 1 prompts per step";
  ASSERT_NE(r.err.find(line), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(line), r.err.rfind(line)) << "printed by more than one rank: " << r.err;
  EXPECT_FALSE(fs::exists(d / "run/metrics.jsonl"));
}

}  // namespace
}  // namespace nibble::tools
