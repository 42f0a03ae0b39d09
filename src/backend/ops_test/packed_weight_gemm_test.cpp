// Op tests of Backend::matmul_nt_nvfp4_weight (the rollout engine's decode GEMM on packed two-level
// NVFP4 weights) on every backend that has Op::kNvfp4WeightGemm: y = x . dequantize(w)^T against a
// double reference on the backend's own dequantize() within the FP32 summation bound derived
// below, for batch sizes across the CUDA kernel's row tiles (1 .. 64 rows), N not a multiple of
// its warps, K with a partial 128-block; the same bits on a second call (no atomics).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "backend/ops_test/ops_test_util.h"
#include "core/bits.h"

namespace nibble::backend::testing {
namespace {

class PackedWeightGemmOpsTest : public OpsTest {
 protected:
  void SetUp() override {
    OpsTest::SetUp();
    if (IsSkipped()) return;
    if (!be().supports(Op::kNvfp4WeightGemm))
      GTEST_SKIP() << "backend '" << be().name() << "' has no packed NVFP4 weight GEMM";
  }
};

// Bound: a K-term FP32 dot product summed in any order (with or without FMA) is within
// gamma_K sum_k |w_k x_k| <= (K + 2) u sum_k |w_k x_k| of the exact sum (u = 2^-24, K u << 1);
// the weights and activations are the very FP32 values of dequantize() and x, so nothing else
// differs. Checked with a factor 2 margin as the other op tests.
TEST_P(PackedWeightGemmOpsTest, EqualsDequantizeThenGemmWithinTheSummationBound) {
  struct Shape {
    int64_t M, N, K;
  };
  for (Shape s : {Shape{1, 37, 96}, Shape{3, 64, 160}, Shape{8, 130, 256}, Shape{13, 48, 512}, Shape{64, 33, 128}}) {
    SCOPED_TRACE(fmt::format("M={} N={} K={}", s.M, s.N, s.K));
    // weights with rows of different magnitudes (2^-6 .. 2^5), quantized by the backend's quantizer
    std::vector<float> w = normal_vector(s.N * s.K, 41 + s.N, 1.0);
    for (int64_t n = 0; n < s.N; ++n)
      for (int64_t k = 0; k < s.K; ++k) w[n * s.K + k] = std::ldexp(w[n * s.K + k], static_cast<int>(n % 12) - 6);
    QuantizedBuffer qb;
    QuantizedTensor q = qb.view(be(), QuantFormat::kNvfp4TwoLevel, s.N, s.K);
    be().quantize(q, upload(w));
    float* wd_dev = zeros<float>(s.N * s.K);
    be().dequantize(wd_dev, q);
    const std::vector<float> wd = download(wd_dev, s.N * s.K);
    std::vector<float> x = normal_vector(s.M * s.K, 43, 1.0);
    for (float& v : x) v = round_to_bf16(v);  // the engine's BF16 activation
    float* x_dev = upload(x);
    float* y_dev = zeros<float>(s.M * s.N);
    be().matmul_nt_nvfp4_weight(y_dev, x_dev, q, s.M);
    const std::vector<float> y = download(y_dev, s.M * s.N);
    for (int64_t m = 0; m < s.M; ++m)
      for (int64_t n = 0; n < s.N; ++n) {
        double ref = 0, mag = 0;
        for (int64_t k = 0; k < s.K; ++k) {
          ref += double(wd[n * s.K + k]) * x[m * s.K + k];
          mag += std::fabs(double(wd[n * s.K + k]) * x[m * s.K + k]);
        }
        const double bound = 2.0 * (s.K + 2) * 0x1.0p-24 * mag;
        ASSERT_LE(std::fabs(y[m * s.N + n] - ref), bound) << "y[" << m << "," << n << "] = " << y[m * s.N + n];
      }
    float* y2_dev = zeros<float>(s.M * s.N);
    be().matmul_nt_nvfp4_weight(y2_dev, x_dev, q, s.M);
    ASSERT_TRUE(bits_equal(y, download(y2_dev, s.M * s.N)));
  }
}

NIB_INSTANTIATE_OPS_TEST(PackedWeightGemmOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
