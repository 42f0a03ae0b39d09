// Tests of `nibble bench collectives` and `nibble bench weight-sync` through the binary: under
// `mpirun -np 2` rank 0 alone prints one JSON row per (op, size, path), nibble and MPI, checked,
// with finite bandwidths and the nibble/MPI ratio of the two rows; the weight sync's rows per transport and
// mode for configs/tiny-moe.json with the bytes each form must carry; a plain start is a one-rank
// world (nibble rows, busbw null; sizes in binary units); bad flags are exit 2 with one line. The mpirun cases skip
// where mpirun or MPI is missing.
#include <cmath>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tools/cli_test_util.h"
#include "tools/mpi_cli_test_util.h"

namespace nibble::tools::test {
namespace {

using nlohmann::json;

std::vector<json> json_lines(const std::string& out) {
  std::vector<json> rows;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << "not JSON: " << line;
    if (!j.is_discarded()) rows.push_back(j);
  }
  return rows;
}

std::string tiny_moe() { return "'" + std::string(NIBBLE_SOURCE_DIR) + "/configs/tiny-moe.json'"; }

TEST(DistBenchCli, CollectivesUnderMpirunTwoRanks) {
  if (const std::string why = why_no_mpirun(); !why.empty()) GTEST_SKIP() << why;
  ScratchDir d("bench_coll_mpi");
  RunResult r = run_shell(d.path, mpirun(2) + "'" + nibble_binary() +
                                      "' bench collectives --device cpu --min-bytes 1K --max-bytes 16K --factor 4 "
                                      "--warmup 1 --iters 3");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("mpirun world of 2 (mpi)"), std::string::npos) << r.err;
  const std::vector<json> rows = json_lines(r.out);
  ASSERT_EQ(rows.size(), 4u * 3u * 2u) << r.out;  // 4 ops x (1K, 4K, 16K) x (nibble, mpi): rank 0's alone
  int nibble_rows = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const json& j = rows[i];
    EXPECT_EQ(j["bench"], "collectives");
    EXPECT_EQ(j["world"], 2);
    EXPECT_EQ(j["group"], "mpi");
    EXPECT_TRUE(j["verified"].get<bool>()) << j;
    const double alg = j["algbw_gbps"].get<double>(), bus = j["busbw_gbps"].get<double>();
    EXPECT_TRUE(std::isfinite(alg) && alg > 0) << j;
    EXPECT_DOUBLE_EQ(bus, alg * j["bus_factor"].get<double>()) << j;
    EXPECT_GT(j["time_us"].get<double>(), 0.0) << j;
    if (j["path"] == "nibble") {
      ++nibble_rows;
      // the MPI row of the same op and size follows; no bound on the ratio's size (oversubscribed
      // ranks on a loaded machine can lose a time slice in either path)
      ASSERT_LT(i + 1, rows.size());
      EXPECT_EQ(rows[i + 1]["op"], j["op"]);
      EXPECT_EQ(rows[i + 1]["bytes"], j["bytes"]);
      const double ratio = j["ratio_to_library"].get<double>();
      EXPECT_TRUE(std::isfinite(ratio) && ratio > 0) << j;
      EXPECT_DOUBLE_EQ(ratio, alg / rows[i + 1]["algbw_gbps"].get<double>()) << j;
    } else {
      EXPECT_EQ(j["path"], "mpi") << j;
      EXPECT_FALSE(j.contains("ratio_to_library")) << j;
    }
  }
  EXPECT_EQ(nibble_rows, 12);
}

TEST(DistBenchCli, CollectivesInOneProcessReportAlgbwOnly) {
  ScratchDir d("bench_coll_one");
  RunResult r = run_nibble(d.path, "bench collectives --device cpu --min-bytes 1KiB --max-bytes 4KB --factor 4 "
                                   "--ops all_reduce,allgather --warmup 0 --iters 2");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("busbw is undefined (bus factor 0)"), std::string::npos) << r.err;
  const std::vector<json> rows = json_lines(r.out);
  ASSERT_EQ(rows.size(), 2u * 2u) << r.out;  // (all_reduce, all_gather) x (1K, 4K), nibble only
  EXPECT_EQ(rows[0]["op"], "all_reduce");
  EXPECT_EQ(rows[2]["op"], "all_gather");
  for (size_t i = 0; i < rows.size(); ++i) {
    const json& j = rows[i];
    EXPECT_EQ(j["bytes"], i % 2 == 0 ? 1024 : 4096) << j;
    EXPECT_EQ(j["path"], "nibble") << j;
    EXPECT_TRUE(j["busbw_gbps"].is_null()) << j;
    EXPECT_TRUE(j["ratio_to_library"].is_null()) << j;
    EXPECT_GT(j["algbw_gbps"].get<double>(), 0.0) << j;
  }
}

TEST(DistBenchCli, BadFlagsAreArgumentErrors) {
  ScratchDir d("bench_dist_bad");
  for (const std::string& args : std::vector<std::string>{"collectives --max-bytes 12Q", "collectives --max-bytes 1.5M", "collectives --min-bytes -1K",
        "collectives --max-bytes 99999999999999", "collectives --min-bytes K", "collectives --min-bytes 8K --max-bytes 4K", "collectives --max-bytes 2G",
        "collectives --factor 1", "collectives --ops all_reduce,alltoall", "collectives --iters 0",
        "weight-sync", "weight-sync --config " + tiny_moe() + " --transport pigeon",
        "weight-sync --config " + tiny_moe() + " --mode recipe", "weight-sync --config " + tiny_moe() + " --recipe nope"}) {
    RunResult r = run_nibble(d.path, "bench " + args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.out << r.err;
    EXPECT_EQ(r.err_lines(), 1) << args << ": " << r.err;
    EXPECT_TRUE(r.out.empty()) << args << ": " << r.out;
  }
  RunResult r = run_nibble(d.path, "bench weight-sync --config '" + (d / "missing.json") + "'");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err_lines(), 1) << r.err;
}

TEST(DistBenchCli, WeightSyncUnderMpirunTwoRanks) {
  if (const std::string why = why_no_mpirun(); !why.empty()) GTEST_SKIP() << why;
  ScratchDir d("bench_wsync_mpi");
  RunResult r = run_shell(d.path, mpirun(2) + "'" + nibble_binary() + "' bench weight-sync --device cpu --config " +
                                      tiny_moe() + " --warmup 1 --iters 2");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::vector<json> rows = json_lines(r.out);
  ASSERT_EQ(rows.size(), 4u) << r.out;  // (host, device) x (bf16, w4a16)
  const std::vector<std::pair<std::string, std::string>> want = {
      {"host", "bf16"}, {"host", "w4a16"}, {"device", "bf16"}, {"device", "w4a16"}};
  for (size_t i = 0; i < rows.size(); ++i) {
    const json& j = rows[i];
    EXPECT_EQ(j["transport"], want[i].first) << j;
    EXPECT_EQ(j["mode"], want[i].second) << j;
    EXPECT_EQ(j["world"], 2);
    EXPECT_EQ(j["group"], "mpi");
    EXPECT_GT(j["sync_ms"].get<double>(), 0.0) << j;
    EXPECT_GT(j["prepare_ms"].get<double>(), 0.0) << j;
    const double gbps = j["gb_per_s"].get<double>();
    EXPECT_TRUE(std::isfinite(gbps) && gbps > 0) << j;
    const int64_t payload = j["payload_bytes"], bf16 = j["bf16_bytes"];
    EXPECT_NEAR(gbps, static_cast<double>(payload) / (j["sync_ms"].get<double>() * 1e-3) / 1e9, 1e-9 * gbps) << j;
    if (want[i].second == "bf16") {
      EXPECT_EQ(payload, bf16) << j;  // BF16 bits + the FP32 rest, host and packed alike
    } else {
      // 4-bit codes + scales for the linears (the FP32 rest, embeddings and lm_head, is most of a tiny model)
      EXPECT_LT(payload, bf16) << j;
    }
  }
  EXPECT_EQ(rows[1]["payload_bytes"], rows[3]["payload_bytes"]) << "one w4a16 version, two transports";
}

}  // namespace
}  // namespace nibble::tools::test
