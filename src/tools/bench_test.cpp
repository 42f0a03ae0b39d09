// Tests of `nibble bench quantize`, driving the built binary on a tiny shape: the CPU table has
// every row with a positive ratio to the memcpy measured in the same run, the GPU part either
// prints its table or says it was skipped (CPU-only builds and GPU-less CI), and bad --size
// values are argument errors (exit 2, one line). `nibble bench attention`: rows or the skip line,
// bad --shape values exit 2. `nibble bench decode`: JSON lines with the bytes-per-step bound.
// `nibble bench rl`: a row per arm with the step-time split, and the summary row.
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/tiny_olmo2_test_util.h"
#include "tools/cli_test_util.h"

namespace nibble::tools::test {
namespace {

TEST(BenchCli, QuantizeTableOnTinyShape) {
  ScratchDir dir("bench_tiny");
  RunResult r = run_nibble(dir.path, "bench quantize --size 128x256 --repeats 1 --threads 1");
  ASSERT_EQ(r.code, 0) << r.err;
  int rows = 0;
  std::istringstream lines(r.out);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream f(line);
    std::string name;
    double mb, ms, gbps, memcpy_gbps, ratio;
    if (f >> name >> mb >> ms >> gbps >> memcpy_gbps >> ratio) {
      ++rows;
      EXPECT_GT(mb, 0.0) << line;
      EXPECT_GT(ratio, 0.0) << line;
    }
  }
  EXPECT_GE(rows, 10) << r.out;  // cpu_bench.h times 12 kernels
  EXPECT_NE(r.out.find("nvfp4_te_bf16_rtn"), std::string::npos) << r.out;
  const bool gpu_table = r.out.find("GPU quantizers") != std::string::npos;
  const bool skipped = r.out.find("no CUDA device: GPU table skipped") != std::string::npos;
  EXPECT_TRUE(gpu_table != skipped) << r.out;
}

TEST(BenchCli, BadSizeIsAnArgumentError) {
  ScratchDir dir("bench_bad");
  for (const std::string size : {"100x256", "128", "axb", "128x256x3"}) {
    RunResult r = run_nibble(dir.path, "bench quantize --cpu-only --size " + size);
    EXPECT_EQ(r.code, 2) << size << ": " << r.out << r.err;
    EXPECT_EQ(r.err_lines(), 1) << r.err;
  }
  RunResult r = run_nibble(dir.path, "bench");  // a subcommand is required
  EXPECT_EQ(r.code, 2);
}

// `bench attention` on a tiny shape: with a device, the FP32 and BF16 rows with positive TFLOP/s;
// without one (CPU build, GPU-less CI) the skip line; exit 0 either way. Bad shapes exit 2.
TEST(BenchCli, AttentionTinyShapeOrSkipped) {
  ScratchDir dir("bench_attention");
  RunResult r = run_nibble(dir.path, "bench attention --shape 1x64x2x1x32 --repeats 1");
  ASSERT_EQ(r.code, 0) << r.err;
  const bool skipped = r.out.find("no CUDA device: attention bench skipped") != std::string::npos;
  int rows = 0;
  std::istringstream lines(r.out);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream f(line);
    std::string shape, precision;
    double fwd_ms, fwd_tf, bwd_ms, bwd_tf, ratio;
    if (f >> shape >> precision >> fwd_ms >> fwd_tf >> bwd_ms >> bwd_tf >> ratio) {
      ++rows;
      EXPECT_EQ(shape, "1x64x2x1x32") << line;
      EXPECT_GT(fwd_tf, 0.0) << line;
      EXPECT_GT(bwd_tf, 0.0) << line;
    }
  }
  EXPECT_EQ(rows, skipped ? 0 : 2) << r.out;
}

TEST(BenchCli, BadAttentionShapeIsAnArgumentError) {
  ScratchDir dir("bench_attention_bad");
  for (const std::string shape : {"1x64x2x1", "1x64x3x2x32", "1x64x2x1x256", "0x64x2x1x32", "1x64x2x1x32x5"}) {
    RunResult r = run_nibble(dir.path, "bench attention --shape " + shape);
    EXPECT_EQ(r.code, 2) << shape << ": " << r.out << r.err;
    EXPECT_EQ(r.err_lines(), 1) << r.err;
  }
}

// `bench decode` on the CPU with a tiny config: one JSON line per batch with positive tokens/s,
// a bound from the measured copy bandwidth and the bytes a step reads, the engine's memory by
// kind, whether CUDA graphs ran (not on the CPU; --no-cuda-graphs says so too); bad values exit 2.
TEST(BenchCli, DecodeJsonLinesOnATinyConfig) {
  ScratchDir dir("bench_decode");
  nlohmann::json cfg = model::test::tiny_olmo2_model_json(48);
  std::ofstream(dir / "tiny.json") << cfg.dump();
  RunResult r = run_nibble(dir.path, "bench decode --device cpu --config '" + (dir / "tiny.json") +
                                         "' --mode w4a16 --batch 1,3 --prompt 5 --new 4");
  ASSERT_EQ(r.code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line;
  std::vector<int64_t> batches;
  while (std::getline(lines, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    batches.push_back(j.at("batch").get<int64_t>());
    EXPECT_EQ(j.at("mode"), "w4a16");
    EXPECT_GT(j.at("decode_tokens_per_s").get<double>(), 0);
    EXPECT_GT(j.at("copy_gb_per_s").get<double>(), 0);
    // the tiny model's 4-bit linears: 2 blocks of qkv 192x64, o 64x64, gate_up 256x64, down 64x128
    // at 9/16 byte an element + 4 bytes per row and 128-block, the BF16 lm_head 48x64, and KV
    const double linears = 2 * ((192 + 64 + 256) * (64 * 9 / 16.0 + 4) + 64 * (128 * 9 / 16.0 + 4));
    const double kv = 2 * 2 * 64 * 2.0 * (5 + 4 / 2.0);  // layers x K,V x Hkv*D x bf16 x average context
    EXPECT_NEAR(j.at("bytes_per_step").get<double>(), linears + 2 * 48 * 64 + j.at("batch").get<double>() * kv, 1.0);
    EXPECT_GT(j.at("fraction_of_bound").get<double>(), 0);
    // the engine's memory: the packed linears are their formula's bytes, an inference model has no
    // master weights and no gradients, and the backend's peak covers the kinds' total
    const nlohmann::json& mem = j.at("memory_bytes");
    EXPECT_EQ(mem.at("packed_weights").get<double>(), linears);
    EXPECT_EQ(mem.at("master_weights").get<int64_t>(), 0);
    EXPECT_EQ(mem.at("gradients").get<int64_t>(), 0);
    // FP32 embedding 48x64 and norms (per layer q, k, post-attention, post-feedforward: 4 x 64;
    // final 64), the lm_head only as BF16 bits (no FP32 copy in inference storage)
    EXPECT_EQ(mem.at("high_precision_weights").get<int64_t>(), 4 * (48 * 64 + 2 * 4 * 64 + 64) + 2 * 48 * 64);
    EXPECT_GT(mem.at("kv_pages").get<int64_t>(), 0);
    EXPECT_GT(mem.at("workspace").get<int64_t>(), 0);
    EXPECT_GE(j.at("peak_bytes").get<int64_t>(), mem.at("total").get<int64_t>());
    EXPECT_GT(j.at("init_s").get<double>(), 0);
    // CUDA graphs: the CPU backend captures none, and the line says so
    EXPECT_EQ(j.at("cuda_graphs"), "off: backend 'cpu' cannot capture graphs");
    EXPECT_EQ(j.at("graph_replays").get<int64_t>(), 0);
    EXPECT_EQ(j.at("graph_captures").get<int64_t>(), 0);
  }
  EXPECT_EQ(batches, (std::vector<int64_t>{1, 3}));
  RunResult eager = run_nibble(dir.path, "bench decode --device cpu --config '" + (dir / "tiny.json") +
                                             "' --batch 1 --prompt 5 --new 2 --no-cuda-graphs");
  ASSERT_EQ(eager.code, 0) << eager.err;
  EXPECT_EQ(nlohmann::json::parse(eager.out).at("cuda_graphs"), "off: turned off (--no-cuda-graphs)");
  RunResult uniform = run_nibble(dir.path, "bench decode --device cpu --config '" + (dir / "tiny.json") +
                                               "' --batch 1 --prompt 5 --new 2 --mode w4a16 --init uniform");
  ASSERT_EQ(uniform.code, 0) << uniform.err;
  EXPECT_EQ(nlohmann::json::parse(uniform.out).at("init"), "uniform");
  for (const char* bad : {"--batch 0", "--batch 1,,2", "--mode recipe", "--new 1", "--kv-dtype fp4", "--init normal"}) {
    RunResult b = run_nibble(dir.path, "bench decode --device cpu --config '" + (dir / "tiny.json") + "' " + bad);
    EXPECT_EQ(b.code, 2) << bad << ": " << b.err;
    EXPECT_EQ(b.err_lines(), 1) << b.err;
  }
}

// `bench decode --profile`: the JSON line gains the prefill run's and one decode step's op timings;
// a decode step of the tiny 2-layer model runs the paged attention once per layer (one step's
// calls: the runs' difference / (new - 1) rounds to exactly that), the tables go to stderr.
TEST(BenchCli, DecodeProfileTimesThePrefillAndOneDecodeStep) {
  ScratchDir dir("bench_decode_profile");
  nlohmann::json cfg = model::test::tiny_olmo2_model_json(48);
  std::ofstream(dir / "tiny.json") << cfg.dump();
  RunResult r = run_nibble(dir.path, "bench decode --device cpu --config '" + (dir / "tiny.json") +
                                         "' --batch 2 --prompt 5 --new 4 --profile");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const nlohmann::json& step = j.at("profile").at("decode_step");
  const int64_t layers = cfg.at("num_hidden_layers").get<int64_t>();
  EXPECT_EQ(step.at("ops").at("paged_attention").at(0).get<int64_t>(), layers) << step.dump();
  EXPECT_EQ(step.at("ops").at("kv_cache_write").at(0).get<int64_t>(), layers) << step.dump();
  EXPECT_GT(step.at("ms").get<double>(), 0);
  const nlohmann::json& prefill = j.at("profile").at("prefill");
  EXPECT_EQ(prefill.at("ops").at("paged_attention").at(0).get<int64_t>(), layers) << prefill.dump();
  EXPECT_NE(r.err.find("decode step (per step)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("prefill + first token"), std::string::npos) << r.err;
}

// `bench rl` on configs/tiny-moe.json (random weights, the arithmetic task), 2 steps per arm on
// the CPU: one JSON row per arm in the order given, one timed step each, a split that adds up to
// the step (one step's values: the medians of single values), then the summary row with the trace
// overhead and the sync-byte ratios (the FP4 arm's bytes below BF16's). Bad values exit 2.
TEST(BenchCli, RlRowsPerArmAndSummaryOnTinyMoe) {
  ScratchDir dir("bench_rl");
  const std::string config = std::string(NIBBLE_SOURCE_DIR) + "/configs/tiny-moe.json";
  RunResult r = run_nibble(dir.path, "bench rl --device cpu --config '" + config +
                                         "' --steps 2 --prompts 1 --group 2 --max-new 2");
  ASSERT_EQ(r.code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line;
  std::vector<std::string> arms;
  nlohmann::json summary;
  while (std::getline(lines, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    EXPECT_EQ(j.at("bench"), "rl");
    EXPECT_EQ(j.at("config"), config);
    if (j.contains("summary")) {
      summary = j;
      continue;
    }
    arms.push_back(j.at("arm").get<std::string>());
    EXPECT_EQ(j.at("timed_steps").get<int64_t>(), 1);
    double parts = 0;
    for (const char* k : {"rollout_s", "logprob_s", "moe_check_s", "train_s", "sync_s", "other_s"}) {
      EXPECT_GE(j.at(k).get<double>(), 0.0) << k;
      parts += j.at(k).get<double>();
    }
    EXPECT_NEAR(parts, j.at("step_s").get<double>(), 1e-9) << line;
    EXPECT_GT(j.at("rollout_tokens_per_s").get<double>(), 0.0);
    EXPECT_GT(j.at("sync_bytes").get<double>(), j.at("sync_linear_bytes").get<double>());
  }
  EXPECT_EQ(arms, (std::vector<std::string>{"fp4-naive", "trace", "bf16-rollout"}));
  ASSERT_TRUE(summary.is_object()) << r.out;
  EXPECT_TRUE(summary.at("trace_overhead").is_number());
  EXPECT_GT(summary.at("sync_bytes_ratio").get<double>(), 0.0);
  EXPECT_LT(summary.at("sync_bytes_ratio").get<double>(), 1.0);
  EXPECT_LT(summary.at("sync_linear_bytes_ratio").get<double>(), summary.at("sync_bytes_ratio").get<double>());
  for (const char* bad : {"--steps 1", "--rounds 0", "--arms trace,nope", "--group 1", "--task nope", "--level 99"}) {
    RunResult b = run_nibble(dir.path, "bench rl --device cpu --config '" + config + "' " + bad);
    EXPECT_EQ(b.code, 2) << bad << ": " << b.err;
    EXPECT_EQ(b.err_lines(), 1) << b.err;
  }
}

}  // namespace
}  // namespace nibble::tools::test
