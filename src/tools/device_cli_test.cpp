// `--device` of pretrain, eval, generate and bench train, driving the built binary
// (cli_test_util.h): a run trained with --device cpu resumes, evaluates and generates on the CPU
// and on the default device (cuda:0 on a GPU machine, so there the same run crosses devices),
// the device is recorded in metrics.jsonl's start and resume events and in eval's JSON; bad
// values are one line naming --device and the available devices (exit 2); `bench train` prints
// its table and JSON rows for the tiny dense and MoE configs and the linear bench, and refuses
// bad options.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include <nlohmann/json.hpp>

#include "model/tiny_olmo2_test_util.h"
#include "tools/cli_test_util.h"

namespace nibble::tools::test {
namespace {

using nlohmann::json;

std::string q(const std::string& s) { return "'" + s + "'"; }
std::string config_path(const std::string& name) { return std::string(NIBBLE_SOURCE_DIR) + "/configs/" + name; }

std::vector<json> json_lines(const std::string& text) {
  std::vector<json> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

// Tiny OLMo-2 (vocab 300), 4 steps of 2x16 tokens, 1 thread; a ~30 KB corpus.
void write_run_inputs(const ScratchDir& d) {
  json cfg{{"model", model::test::tiny_olmo2_model_json(300)},
           {"recipe", "bf16"},
           {"batch_size", 2},
           {"seq_len", 16},
           {"steps", 4},
           {"schedule", {{"type", "constant"}, {"warmup_steps", 0}}},
           {"eval", {{"interval", 0}, {"batches", 1}}},
           {"threads", 1}};
  std::ofstream(d / "run.json") << cfg.dump(2);
  std::string text;
  for (int i = 0; i < 400; ++i)
    text += "The " + std::to_string(i % 29) + " lambs went over the hill, and the shepherd followed them.\n";
  std::ofstream(d / "corpus.txt") << text;
}

TEST(DeviceCli, CpuRunResumesEvaluatesAndGeneratesOnEveryDevice) {
  ScratchDir d("device_run");
  write_run_inputs(d);
  const std::string run = d / "run", corpus = d / "corpus.txt";
  RunResult r = run_nibble(d.path, "pretrain --device cpu --config " + q(d / "run.json") + " --data " + q(corpus) +
                                       " --out " + q(run) + " --no-progress --stop-after 2");
  ASSERT_EQ(r.code, 0) << r.err;
  // The first line of output says which device trains.
  EXPECT_NE(r.err.substr(0, r.err.find('\n')).find("pretrain: on cpu"), std::string::npos) << r.err;
  // Resume on the default device (cuda:0 where a GPU is present, else the CPU).
  r = run_nibble(d.path, "pretrain --out " + q(run) + " --resume --no-progress");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("step 4/4"), std::string::npos) << r.out;
  const std::vector<json> events = json_lines(slurp(run + "/metrics.jsonl"));
  std::string start_device, resume_device;
  int steps = 0;
  for (const json& e : events) {
    if (e.value("event", "") == "start") start_device = e.value("device", "");
    if (e.value("event", "") == "resume") resume_device = e.value("device", "");
    if (e.contains("ce")) {
      ++steps;
      EXPECT_TRUE(std::isfinite(e["loss"].get<double>())) << e.dump();
    }
  }
  EXPECT_EQ(start_device, "cpu");
  EXPECT_FALSE(resume_device.empty());
  EXPECT_EQ(steps, 4);

  // eval on the CPU and on the default device: the same checkpoint, the same loss (bit-equal on
  // the CPU; on a GPU within 1e-3 nats: FP32 sums in another order over K <= 256 move a loss of
  // ~5.7 by ~1e-6 relative, far inside 1e-3).
  r = run_nibble(d.path, "eval --device cpu --json --checkpoint " + q(run) + " --data " + q(corpus));
  ASSERT_EQ(r.code, 0) << r.err;
  const json on_cpu = json::parse(r.out);
  EXPECT_EQ(on_cpu["device"], "cpu");
  ASSERT_TRUE(std::isfinite(on_cpu["loss"].get<double>()));
  r = run_nibble(d.path, "eval --json --checkpoint " + q(run) + " --data " + q(corpus));
  ASSERT_EQ(r.code, 0) << r.err;
  const json on_default = json::parse(r.out);
  if (on_default["device"] == "cpu") {
    EXPECT_EQ(on_default["loss"].get<double>(), on_cpu["loss"].get<double>());
  } else {
    EXPECT_NEAR(on_default["loss"].get<double>(), on_cpu["loss"].get<double>(), 1e-3);
  }
  r = run_nibble(d.path, "eval --device cpu --checkpoint " + q(run) + " --data " + q(corpus));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("eval: on cpu"), std::string::npos) << r.err;

  // generate on the CPU: same seed, same text; the prompt starts it.
  const std::string gen = "generate --checkpoint " + q(run) + " --prompt 'The 3' --max-new-tokens 6 --seed 4";
  r = run_nibble(d.path, gen + " --device cpu");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("The 3", 0), 0u) << r.out;
  EXPECT_TRUE(r.err.empty()) << r.err;  // the device is said with -v only: stderr stays clean
  RunResult again = run_nibble(d.path, "-v " + gen + " --device cpu");
  EXPECT_EQ(again.out, r.out);
  EXPECT_NE(again.err.find("generate: on cpu"), std::string::npos) << again.err;
  r = run_nibble(d.path, gen);  // the default device
  EXPECT_EQ(r.code, 0) << r.err;
}

// Every command that takes --device refuses a device that does not exist here: exit 2, one
// line naming the option, the value and what is available.
TEST(DeviceCli, BadDevicesAreOneLineNamingWhatIsAvailable) {
  ScratchDir d("device_bad");
  write_run_inputs(d);
  const std::string run = d / "run", corpus = d / "corpus.txt";
  RunResult r = run_nibble(d.path, "-q pretrain --device cpu --config " + q(d / "run.json") + " --data " + q(corpus) +
                                       " --out " + q(run) + " --no-progress --set steps=1");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<std::string> commands{
      "pretrain --config " + q(d / "run.json") + " --data " + q(corpus) + " --out " + q(d / "other"),
      "eval --checkpoint " + q(run) + " --data " + q(corpus),
      "generate --checkpoint " + q(run),
      "bench train --config " + q(config_path("tiny-dense.json")) + " --batch 1 --seq 16 --steps 1",
  };
  std::string available;  // as the first refusal states it
  for (const std::string& cmd : commands) {
    for (const std::string device : {"tpu", "cuda:999", "CPU", "cuda:", "cuda:-1", "cuda:1x"}) {
      SCOPED_TRACE(cmd + " --device " + device);
      r = run_nibble(d.path, cmd + " --device '" + device + "'");
      EXPECT_EQ(r.code, 2) << r.out << r.err;
      EXPECT_EQ(r.err_lines(), 1) << r.err;
      EXPECT_NE(r.err.find("--device " + device + ":"), std::string::npos) << r.err;
      const size_t at = r.err.find("available: cpu");
      ASSERT_NE(at, std::string::npos) << r.err;
      const std::string listed = r.err.substr(at, r.err.find(')', at) - at);
      if (available.empty()) available = listed;
      EXPECT_EQ(listed, available) << r.err;
    }
  }
  EXPECT_FALSE(fs::exists(d / "other")) << "a refused --device created the run folder";
  // Without a GPU (or without CUDA in this build) --device cuda is refused the same way; with
  // one, it runs.
  for (const std::string& cmd : commands) {
    SCOPED_TRACE(cmd + " --device cuda");
    r = run_nibble(d.path, cmd + " --device cuda");
    if (available == "available: cpu") {
      EXPECT_EQ(r.code, 2) << r.out << r.err;
      EXPECT_EQ(r.err_lines(), 1) << r.err;
      EXPECT_NE(r.err.find("--device cuda: "), std::string::npos) << r.err;
      const bool why = r.err.find("built without CUDA") != std::string::npos ||
                       r.err.find("no CUDA device is present") != std::string::npos;
      EXPECT_TRUE(why) << r.err;
    } else {
      EXPECT_EQ(r.code, 0) << r.out << r.err;
    }
  }
}

// The table: one row per recipe with positive tokens/s, finite losses and bf16's ratio 1.000.
TEST(DeviceCli, BenchTrainTableAndJsonOnTinyConfigs) {
  ScratchDir d("bench_train");
  const std::string common = " --device cpu --batch 2 --seq 64 --steps 1 --warmup 1";
  RunResult r = run_nibble(d.path, "bench train --config " + q(config_path("tiny-dense.json")) + common);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(" on cpu:"), std::string::npos) << r.out;
  int rows = 0;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream f(line);
    std::string recipe, mfu, peak, ratio;
    double ms = 0, tps = 0, first = NAN, last = NAN;
    if (!(f >> recipe >> ms >> tps >> mfu >> peak >> first >> last >> ratio)) continue;
    ++rows;
    EXPECT_GT(ms, 0.0) << line;
    EXPECT_GT(tps, 0.0) << line;
    EXPECT_EQ(mfu, "-") << line;  // MFU is against a GPU's peak: not shown for the CPU
    EXPECT_GT(std::stod(peak), 0.0) << line;
    EXPECT_TRUE(std::isfinite(first) && std::isfinite(last)) << line;
    if (recipe == "bf16") {
      EXPECT_EQ(ratio, "1.000") << line;
    }
    EXPECT_GT(std::stod(ratio), 0.0) << line;
  }
  EXPECT_EQ(rows, 3) << r.out;  // bf16, nvfp4-nvidia, tetrajet-v2
  for (const char* recipe : {"bf16", "nvfp4-nvidia", "tetrajet-v2"})
    EXPECT_NE(r.out.find(std::string("  ") + recipe + " "), std::string::npos) << recipe << "\n" << r.out;

  r = run_nibble(d.path, "bench train --json --config " + q(config_path("tiny-moe.json")) + common +
                             " --recipe bf16 --recipe '{\"name\": \"tetrajet-v2\", \"sr\": false}'");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<json> rows_json = json_lines(r.out);
  ASSERT_EQ(rows_json.size(), 2u) << r.out;
  EXPECT_EQ(rows_json[0]["recipe"], "bf16");
  EXPECT_EQ(rows_json[1]["recipe"], "tetrajet-v2");
  for (const json& j : rows_json) {
    EXPECT_GT(j["tokens_per_s"].get<double>(), 0.0) << j.dump();
    EXPECT_GT(j["peak_bytes"].get<int64_t>(), 0) << j.dump();
    EXPECT_TRUE(std::isfinite(j["first_loss"].get<double>()) && std::isfinite(j["last_loss"].get<double>()));
    EXPECT_TRUE(j["mfu"].is_null()) << j.dump();
    EXPECT_EQ(j["device"], "cpu");
  }
  EXPECT_EQ(rows_json[0]["ratio_to_bf16"].get<double>(), 1.0);
}

// --profile: after the table, the per-category and per-op table of one extra step (text), or a
// "profile" object per row (--json).
TEST(DeviceCli, BenchTrainProfile) {
  ScratchDir d("bench_train_profile");
  const std::string common =
      " --config " + q(config_path("tiny-dense.json")) + " --device cpu --batch 1 --seq 16 --steps 1 --warmup 0";
  RunResult r = run_nibble(d.path, "bench train --recipe bf16 --profile" + common);
  ASSERT_EQ(r.code, 0) << r.err;
  const size_t at = r.out.find("profile of one step, recipe bf16 on cpu");
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_NE(r.out.find("synchronised", at), std::string::npos) << r.out;
  for (const char* row : {"GEMM", "cross-entropy", "optimizer", "matmul_bf16_nt", "cross_entropy_forward_backward",
                          "adamw_update", "(between ops"})
    EXPECT_NE(r.out.find(row, at), std::string::npos) << row << "\n" << r.out;
  r = run_nibble(d.path, "bench train --json --recipe fp32 --profile" + common);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<json> rows = json_lines(r.out);
  ASSERT_EQ(rows.size(), 1u) << r.out;
  const json& p = rows[0]["profile"];
  EXPECT_GT(p["step_ms"].get<double>(), 0.0) << p.dump();
  ASSERT_TRUE(p["ops"].is_array() && !p["ops"].empty()) << p.dump();
  bool found = false;
  for (const json& op : p["ops"])
    if (op["op"] == "embedding_forward") found = op["count"] == 1 && op["category"] == "elementwise";
  EXPECT_TRUE(found) << p.dump();
  r = run_nibble(d.path, "bench train --json --recipe fp32" + common);  // no profile unless asked
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(json_lines(r.out)[0].contains("profile")) << r.out;
}

TEST(DeviceCli, BenchTrainLinearForEveryRecipe) {
  ScratchDir d("bench_linear");
  RunResult r = run_nibble(d.path, "bench train --device cpu --linear 128x64x128 --steps 1 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<json> rows = json_lines(r.out);
  ASSERT_EQ(rows.size(), 3u) << r.out;
  for (const json& j : rows) {
    EXPECT_GT(j["forward_ms"].get<double>(), 0.0) << j.dump();
    EXPECT_GT(j["backward_ms"].get<double>(), 0.0) << j.dump();
    EXPECT_GT(j["ratio"].get<double>(), 0.0) << j.dump();  // to the bf16 recipe on the CPU
    EXPECT_EQ(j["M"], 128);
    EXPECT_EQ(j["N"], 64);
    EXPECT_EQ(j["K"], 128);
  }
  EXPECT_EQ(rows[0]["recipe"], "bf16");
  EXPECT_EQ(rows[0]["ratio"].get<double>(), 1.0);
  // the layer's bytes: bf16 keeps x and w as BF16 bits (multiples of the CPU's 64-byte unit here)
  // and borrows dY's bits from the shared workspace
  EXPECT_EQ(rows[0]["saved_bytes"], 2 * 128 * 128 + 2 * 64 * 128) << rows[0].dump();
  EXPECT_EQ(rows[0]["workspace_bytes"], 2 * 128 * 64) << rows[0].dump();
  for (const json& j : rows) EXPECT_GT(j["workspace_bytes"].get<int64_t>(), 0) << j.dump();
  r = run_nibble(d.path, "bench train --device cpu --linear 128x64x128 --steps 1 --recipe nvfp4-nvidia");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("nvfp4-nvidia"), std::string::npos) << r.out;
}

TEST(DeviceCli, BenchTrainBadOptions) {
  ScratchDir d("bench_train_bad");
  const std::string tiny = " --config " + q(config_path("tiny-dense.json")) + " --device cpu";
  const std::vector<std::pair<std::string, std::string>> cases{
      {"--batch 0", "--batch"},
      {"--seq -3", "--seq"},
      {"--steps 0", "--steps"},
      {"--warmup x", "--warmup"},
      {"--seq 4096", "max_position_embeddings"},
      {"--recipe nope", "--recipe nope"},
      {"--recipe '{\"name\": \"bf16\", \"bogus\": 1}'", "--recipe"},
      {"--linear 12x3", "--linear 12x3"},
      {"--linear 0x4x4", "--linear 0x4x4"},
      {"--linear 128x64x128 --profile", "--profile"},
  };
  for (const auto& [args, expect] : cases) {
    SCOPED_TRACE(args);
    RunResult r = run_nibble(d.path, "bench train" + tiny + " --batch 1 --steps 1 " + args);
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_EQ(r.err_lines(), 1) << r.err;
    EXPECT_NE(r.err.find(expect), std::string::npos) << r.err;
  }
  RunResult r = run_nibble(d.path, "bench train --device cpu --config " + q(d / "missing.json"));
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err_lines(), 1) << r.err;
  EXPECT_NE(r.err.find("missing.json"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace nibble::tools::test
