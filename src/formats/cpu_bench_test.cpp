// Smoke test of the `nibble bench quantize` API (cpu_bench.h) on a tiny tensor: the filter
// selects rows, byte counts follow the documented formula, times and ratios are positive.
#include <gtest/gtest.h>

#include "formats/cpu_bench.h"

namespace nibble::formats {
namespace {

TEST(CpuBench, RowsAndByteCounts) {
  const int64_t M = 128, K = 256;
  std::vector<QuantizeBenchRow> rows = bench_quantize_cpu(M, K, 1, "nvfp4_te_bf16_rtn");
  ASSERT_EQ(rows.size(), 1u);
  const double N = static_cast<double>(M * K);
  EXPECT_EQ(rows[0].name, "nvfp4_te_bf16_rtn");
  EXPECT_EQ(rows[0].bytes, 2 * 2 * N + N / 2 + N / 16 + 4);  // two BF16 passes + codes + scales + amax
  EXPECT_GT(rows[0].seconds, 0.0);
  EXPECT_GT(rows[0].memcpy_gbps, 0.0);
  EXPECT_NEAR(rows[0].ratio_to_memcpy, rows[0].gbps / rows[0].memcpy_gbps, 1e-12);
  EXPECT_GE(bench_quantize_cpu(M, K, 1, "nvfp4_").size(), 6u);
  EXPECT_TRUE(bench_quantize_cpu(M, K, 1, "no such quantizer").empty());
}

}  // namespace
}  // namespace nibble::formats
